"""Ray Serve adapters for the Eyas autoscaling policies (eyas.autoscale.serve_policy).

Every test drives a policy with real ``ray.serve.config.AutoscalingContext`` objects built by hand
(plain strings as replica ids), the way Serve's controller calls it on each tick: no Ray cluster.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time

import pytest
import yaml
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import (
    SERVE_AUTOSCALING_DECISION_COUNTERS_KEY,
    SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY,
)
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from eyas.autoscale import serve_policy
from eyas.autoscale.policy import ReplicaMetrics, ScalingState, TargetScalingConfig
from eyas.autoscale.serve_policy import (
    STATE_KEY,
    DrafterTreeWorkPolicy,
    TargetTreeWorkPolicy,
    metrics_from_context,
    state_from_dict,
    state_to_dict,
)

TARGET_PATH = "eyas.autoscale.serve_policy:TargetTreeWorkPolicy"
# the policy_kwargs of the module docstring's example: 64 rows a replica, 2 s up, 10 s down, 1..4
KWARGS = dict(
    target_verify_rows_per_replica=64, upscale_delay_s=2, downscale_delay_s=10, min_replicas=1, max_replicas=4
)
INSTANT = dict(KWARGS, upscale_delay_s=0, downscale_delay_s=0)  # the same without delays


# --- helpers -------------------------------------------------------------------------------------------
def spread(replicas: int, **totals: float) -> dict[str, dict[str, float]]:
    """``aggregated_metrics`` with each total split evenly over replicas "r0".."r{n-1}"."""
    return {name: {f"r{i}": total / replicas for i in range(replicas)} for name, total in totals.items()}


def make_ctx(
    target: int, metrics=None, *, now: float | None = 100.0, policy_state=None, lo: int = 1, hi: int = 4, config=None
) -> AutoscalingContext:
    """One tick's context as Serve's controller builds it (``target`` replicas, all running)."""
    return AutoscalingContext(
        deployment_id=DeploymentID(name="target", app_name="eyas"),
        deployment_name="target",
        app_name="eyas",
        current_num_replicas=target,
        target_num_replicas=target,
        running_replicas=[f"r{i}" for i in range(target)],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi,
        policy_state={} if policy_state is None else policy_state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


class Controller:
    """A stand-in for Serve's controller: carries the replica count and policy_state between ticks, and
    lets every running replica report an even share of the load."""

    def __init__(self, policy, replicas: int, *, lo: int = 1, hi: int = 4):
        self.policy, self.replicas, self.lo, self.hi = policy, replicas, lo, hi
        self.policy_state: dict = {}

    def tick(self, now: float, **totals: float) -> int:
        ctx = make_ctx(
            self.replicas,
            spread(self.replicas, **totals),
            now=now,
            policy_state=self.policy_state,
            lo=self.lo,
            hi=self.hi,
        )
        self.replicas, self.policy_state = self.policy(ctx)
        return self.replicas

    @property
    def ours(self) -> dict:
        return self.policy_state[STATE_KEY]


# --- scale up / down -----------------------------------------------------------------------------------
def test_scale_up_waits_for_the_delay_then_steps_across_ticks():
    """The module docstring's worked example: 64 rows a replica, 2 s upscale delay, at most 2 added
    at once. 200 pending rows need 200 / 64 = 3.125 -> 4 replicas:

    t=100: 1 (clock starts)   t=101: 1 (1 s < 2 s)   t=102: 3 (1 + max_step_up 2; clock restarts)
    t=103: 3 (1 s since 102)  t=104: 4 (the rest)    t=105: 4 (need 3.125 fits 4: hold)
    """
    c = Controller(TargetTreeWorkPolicy(**KWARGS), replicas=1)
    got = [c.tick(t, pending_verify_rows=200) for t in (100.0, 101.0)]
    assert got == [1, 1] and c.ours["above_since"] == 100.0
    assert c.tick(102.0, pending_verify_rows=200) == 3
    assert c.ours == {
        "current_replicas": 3,
        "above_since": 102.0,
        "below_since": None,
        "last_decision_at": 102.0,
        "needs": {"verify_rows": 3.125},
        "decided_at": 102.0,
    }
    assert [c.tick(t, pending_verify_rows=200) for t in (103.0, 104.0, 105.0)] == [3, 4, 4]
    assert c.ours["above_since"] is None and c.ours["last_decision_at"] == 104.0


def test_scale_down_needs_the_load_a_band_below_the_boundary_and_the_delay():
    """3 replicas, 64 rows each, band 0.1, 10 s downscale delay. Keeping 2 replicas needs the load at
    or below 2 x 64 x 0.9 = 115.2 rows:

    * 120 rows (need 1.875, ceil(1.875 / 0.9) = 3): hold at 3 for good, although 2 replicas would
      carry 120 < 128 rows;
    * 115 rows (ceil(1.797 / 0.9) = 2): the clock starts at t=200, 2 replicas at t=210;
    * then 115 rows on 2 replicas hold (down wants ceil(1.997) = 2).
    """
    c = Controller(TargetTreeWorkPolicy(**KWARGS), replicas=3)
    assert [c.tick(100.0 + t, pending_verify_rows=120) for t in range(0, 60, 5)] == [3] * 12
    assert c.ours["below_since"] is None
    assert [c.tick(t, pending_verify_rows=115) for t in (200.0, 205.0, 209.9)] == [3, 3, 3]
    assert c.ours["below_since"] == 200.0
    assert c.tick(210.0, pending_verify_rows=115) == 2
    assert [c.tick(210.0 + t, pending_verify_rows=115) for t in range(1, 60, 5)] == [2] * 12


def test_steady_load_wobbling_at_a_boundary_does_not_flap_over_50_ticks():
    """Load 128 + 6 sin(i) rows (122..134) wobbles around the 2-replica boundary (128), no delays.
    With the 0.1 band it crosses to 3 once (tick 1: 133 rows need 2.08) and stays: 3 replicas only
    drop to 2 at <= 115.2 rows. Without the band (tolerance 0) the same load flaps 2 <-> 3."""
    loads = [128 + 6 * math.sin(i) for i in range(50)]

    def counts(**kw) -> list[int]:
        c = Controller(TargetTreeWorkPolicy(**INSTANT, **kw), replicas=2)
        return [c.tick(100.0 + i, pending_verify_rows=load) for i, load in enumerate(loads)]

    def changes(ns: list[int]) -> int:
        return sum(a != b for a, b in zip(ns, ns[1:]))

    banded = counts()
    assert banded == [2] + [3] * 49 and changes(banded) == 1
    assert changes(counts(downscale_tolerance=0.0)) > 10  # the band is what holds it


# --- bounds --------------------------------------------------------------------------------------------
def test_decision_is_clamped_into_serves_capacity_adjusted_range():
    """1 replica, 1,000 rows, no delays: the Eyas policy says 1 + max_step_up 2 = 3, Serve's capacity-
    adjusted max (target_capacity lowered it) is 2: the policy returns 2, and records 2."""
    c = Controller(TargetTreeWorkPolicy(**INSTANT), replicas=1, hi=2)
    assert c.tick(100.0, pending_verify_rows=1000) == 2
    assert c.ours["current_replicas"] == 2
    assert [c.tick(100.0 + t, pending_verify_rows=1000) for t in range(1, 5)] == [2] * 4


def test_idle_load_stays_at_serves_capacity_adjusted_min():
    """Idle replicas want the policy min (1); Serve's capacity-adjusted min is 2: the count stays 2."""
    c = Controller(TargetTreeWorkPolicy(**INSTANT), replicas=2, lo=2, hi=4)
    assert [c.tick(100.0 + t, pending_verify_rows=0) for t in range(5)] == [2] * 5


def test_a_count_above_the_policy_max_moves_into_range_at_once():
    """Serve's count is 6 but policy_kwargs say max 4 (the config changed): 4 on the first tick,
    no 10 s downscale delay and no max_step_down=1, even with no metrics at all."""
    policy = TargetTreeWorkPolicy(**KWARGS)
    n, state = policy(make_ctx(6, None, lo=1, hi=10))
    assert n == 4 and state[STATE_KEY]["last_decision_at"] == 100.0


def test_a_huge_load_never_exceeds_the_max():
    """10,000 rows need 157 replicas; max_replicas=4: 1 -> 3 -> 4 -> 4 ..."""
    c = Controller(TargetTreeWorkPolicy(**INSTANT), replicas=1)
    assert [c.tick(100.0 + t, pending_verify_rows=10_000) for t in range(6)] == [3, 4, 4, 4, 4, 4]


# --- missing and bad metrics ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "metrics",
    [None, {}, {"pending_verify_rows": {}}, {"qps": {"r0": 5.0}}],
    ids=["none", "empty", "no-replicas", "only-other-metrics"],
)
def test_no_metrics_keeps_the_count(metrics):
    """No Eyas metric from any replica: keep ctx.target_num_replicas (3), with no needs and no clocks."""
    n, state = TargetTreeWorkPolicy(**INSTANT)(make_ctx(3, metrics))
    assert n == 3
    assert state[STATE_KEY] == {
        "current_replicas": 3,
        "above_since": None,
        "below_since": None,
        "last_decision_at": None,
        "needs": {},
        "decided_at": 100.0,
    }


def test_a_tick_without_metrics_restarts_the_upscale_clock():
    """Load at t=100, nothing at t=101, load again from t=102: the 2 s count from 102, so 3 at t=104."""
    policy = TargetTreeWorkPolicy(**KWARGS)
    state: dict = {}
    got = []
    for t, metrics in (
        (100.0, spread(1, pending_verify_rows=200)),
        (101.0, None),
        (102.0, spread(1, pending_verify_rows=200)),
        (103.0, spread(1, pending_verify_rows=200)),
        (104.0, spread(1, pending_verify_rows=200)),
    ):
        n, state = policy(make_ctx(1 if not got else got[-1], metrics, now=t, policy_state=state))
        got.append(n)
    assert got == [1, 1, 1, 1, 3]


def test_negative_and_non_finite_values_read_as_zero_and_warn_once(caplog):
    """-5, NaN and +inf pending rows count as 0; the one good replica's 64 rows need exactly 1.0.
    Three ticks of the same bad reports log one warning (per metric name, per policy instance)."""
    bad = {"pending_verify_rows": {"r0": -5.0, "r1": float("nan"), "r2": float("inf"), "r3": 64.0}}
    policy = TargetTreeWorkPolicy(**INSTANT)
    with caplog.at_level(logging.WARNING, logger="eyas.autoscale.serve_policy"):
        for t in (100.0, 101.0, 102.0):
            n, state = policy(make_ctx(4, bad, now=t))
            assert state[STATE_KEY]["needs"] == {"verify_rows": 1.0}
            assert n == 3  # ceil(1.0 / 0.9) = 2 < 4: down by max_step_down=1
    warnings = [r for r in caplog.records if "pending_verify_rows" in r.getMessage()]
    assert len(warnings) == 1


def test_metrics_from_context_one_report_per_replica():
    """Golden: r0 sends only verify rows, r1 also draft rows, "qps" is not ours and r2 only sends it;
    a None value reads as 0."""
    got = metrics_from_context(
        {
            "pending_verify_rows": {"r0": 10.0, "r1": 20.0},
            "draft_rows": {"r1": 5.0},
            "kv_bytes_used": {"r0": None},
            "qps": {"r2": 1.0},
        },
        now=7.0,
        warned=set(),
    )
    assert got == [
        ReplicaMetrics(pending_verify_rows=10.0, timestamp=7.0),
        ReplicaMetrics(pending_verify_rows=20.0, draft_rows=5.0, timestamp=7.0),
    ]
    assert metrics_from_context(None, now=7.0) == []


def test_missing_current_time_uses_the_wall_clock():
    """ctx.current_time=None: the decision is stamped with time.time()."""
    before = time.time()
    _, state = TargetTreeWorkPolicy(**KWARGS)(make_ctx(1, spread(1, pending_verify_rows=10), now=None))
    assert before <= state[STATE_KEY]["decided_at"] <= time.time()


# --- drafters ------------------------------------------------------------------------------------------
def test_drafter_policy_ignores_verify_rows_kv_and_experts():
    """2 drafters reporting 90 draft rows in all (100 a replica): need 0.9, ceil(0.9 / 0.9) = 1, so 1
    replica, however many verify rows, KV bytes or expert bytes the same reports carry. The target
    policy reading the same reports scales up (max 4)."""
    metrics = spread(
        2, draft_rows=90, pending_verify_rows=10_000, kv_bytes_used=1e12, kv_bytes_capacity=2e9, expert_bytes=1e12
    )
    drafter = DrafterTreeWorkPolicy(target_draft_rows_per_replica=100, upscale_delay_s=0, downscale_delay_s=0)
    n, state = drafter(make_ctx(2, metrics))
    assert n == 1 and state[STATE_KEY]["needs"] == pytest.approx({"draft_rows": 0.9})
    target = TargetTreeWorkPolicy(**INSTANT, target_expert_bytes_per_replica=1e9)
    assert target(make_ctx(2, metrics))[0] == 4


def test_drafters_scale_up_on_draft_rows():
    """1 drafter, 100 rows a replica, no delays: 250 draft rows need 2.5 -> 3 (no step limit)."""
    c = Controller(DrafterTreeWorkPolicy(target_draft_rows_per_replica=100, upscale_delay_s=0), replicas=1, hi=8)
    assert c.tick(100.0, draft_rows=250) == 3


# --- policy_kwargs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (TargetTreeWorkPolicy, {"target_verify_rows_per_replica": 0}, "target_verify_rows_per_replica"),
        (TargetTreeWorkPolicy, {"target_verify_rows_per_replica": "lots"}, "target_verify_rows_per_replica"),
        (TargetTreeWorkPolicy, {"bogus": 1}, "bogus"),
        (TargetTreeWorkPolicy, {"min_replicas": 5, "max_replicas": 2}, "max_replicas"),
        (TargetTreeWorkPolicy, {"min_replicas": 0}, "min_replicas"),
        (DrafterTreeWorkPolicy, {"target_verify_rows_per_replica": 64}, "target_verify_rows_per_replica"),
        (DrafterTreeWorkPolicy, {"downscale_tolerance": 1.0}, "downscale_tolerance"),
    ],
)
def test_bad_policy_kwargs_raise_value_error_naming_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=rf"policy_kwargs\.{field}: "):
        cls(**kwargs)


def test_policy_kwargs_become_the_config():
    assert TargetTreeWorkPolicy(**KWARGS).config == TargetScalingConfig(**KWARGS)
    assert DrafterTreeWorkPolicy().config.target_draft_rows_per_replica == 512.0  # the defaults


# --- the way Serve uses it -----------------------------------------------------------------------------
def test_serve_builds_and_resolves_the_policy_from_its_import_path():
    """Serve imports policy_function, cloudpickles it, and _resolve_policy_callable instantiates the
    class once with policy_kwargs; the instance answers a tick (1 replica, 100 rows, no delays: 2)."""
    policy = AutoscalingPolicy(policy_function=TARGET_PATH, policy_kwargs=INSTANT)
    instance = _resolve_policy_callable(policy)
    assert type(instance).__name__ == "TargetTreeWorkPolicy"
    assert instance.config == TargetScalingConfig(**INSTANT)
    n, state = instance(make_ctx(1, spread(1, pending_verify_rows=100)))
    assert n == 2 and state[STATE_KEY]["needs"] == {"verify_rows": 100 / 64}


def test_serve_resolving_bad_kwargs_raises_naming_the_field():
    policy = AutoscalingPolicy(policy_function=TARGET_PATH, policy_kwargs={"max_kv_utilisation": 2})
    with pytest.raises(ValueError, match=r"policy_kwargs\.max_kv_utilisation: "):
        _resolve_policy_callable(policy)


# Serve 2.60 warns that the docstring's look_back_period_s (5) is not above the deprecated
# metrics_interval_s field's default (10 s); the module docstring explains it.
_LOOK_BACK_WARNING = "ignore:`look_back_period_s`:FutureWarning"


def _docstring_yaml() -> dict:
    """The ``autoscaling_config`` example of the module docstring, parsed."""
    lines = serve_policy.__doc__.splitlines()
    start = lines.index("    autoscaling_config:")
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return yaml.safe_load("\n".join(block))["autoscaling_config"]


@pytest.mark.filterwarnings(_LOOK_BACK_WARNING)
def test_docstring_example_through_serves_own_wrapper():
    """The module docstring's YAML builds a Serve AutoscalingConfig; Serve's full wrapper
    (_apply_autoscaling_config over _resolve_policy_callable) with its own delays at 0 passes the
    Eyas decisions through unchanged: 200 rows on 1 replica -> 1, 1, 3, 3, 4 at t=100..104."""
    config = AutoscalingConfig(**_docstring_yaml())
    assert config.upscale_delay_s == 0 and config.downscale_delay_s == 0
    assert config.policy.policy_kwargs == KWARGS
    wrapped = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    replicas, state, got = 1, {}, []
    for t in (100.0, 101.0, 102.0, 103.0, 104.0):
        ctx = make_ctx(replicas, spread(replicas, pending_verify_rows=200), now=t, policy_state=state, config=config)
        replicas, state = wrapped(ctx)
        got.append(replicas)
    assert got == [1, 1, 3, 3, 4]
    assert SERVE_AUTOSCALING_DECISION_COUNTERS_KEY in state and state[STATE_KEY]["current_replicas"] == 4


@pytest.mark.filterwarnings(_LOOK_BACK_WARNING)
def test_serves_default_delays_would_hold_the_decision_back():
    """Why the docstring says 0: with Serve's default 30 s upscale delay on top, the wrapper still
    returns 1 at t=102 although the Eyas policy (2 s) asks for 3."""
    config = AutoscalingConfig(**{**_docstring_yaml(), "upscale_delay_s": 30})
    wrapped = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    state: dict = {}
    for t in (100.0, 101.0, 102.0):
        n, state = wrapped(make_ctx(1, spread(1, pending_verify_rows=200), now=t, policy_state=state, config=config))
    assert n == 1


def test_policy_state_keeps_serves_keys_and_the_input_untouched():
    """Serve's internal keys (and any other) go back as they came; ours live under "eyas" only."""
    given = {SERVE_AUTOSCALING_DECISION_COUNTERS_KEY: 2, SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY: 99.0, "other": "x"}
    snapshot = dict(given)
    _, state = TargetTreeWorkPolicy(**KWARGS)(make_ctx(2, spread(2, pending_verify_rows=100), policy_state=given))
    assert given == snapshot
    assert {k: v for k, v in state.items() if k != STATE_KEY} == snapshot
    json.dumps(state[STATE_KEY])  # plain data


# --- state helpers -------------------------------------------------------------------------------------
def test_state_round_trip_and_override():
    """Golden: ScalingState(3, 102.0, None, 102.0) <-> {"current_replicas": 3, "above_since": 102.0, ...};
    current_replicas=5 replaces the stored count, extra keys ("needs") are ignored."""
    s = ScalingState(3, 102.0, None, 102.0)
    d = state_to_dict(s)
    assert d == {"current_replicas": 3, "above_since": 102.0, "below_since": None, "last_decision_at": 102.0}
    assert state_from_dict(d) == s
    assert state_from_dict({**d, "needs": {"kv": 1.0}}, current_replicas=5) == ScalingState(5, 102.0, None, 102.0)


@pytest.mark.parametrize(
    "stored",
    ["junk", {"current_replicas": 1, "above_since": "soon"}, {"current_replicas": 1, "below_since": float("nan")}],
)
def test_malformed_stored_state_starts_afresh(stored, caplog):
    """A malformed "eyas" entry raises in state_from_dict, but a tick starts afresh (and logs) instead
    of crashing Serve's controller."""
    with pytest.raises(ValueError, match=re.escape(f"policy_state[{STATE_KEY!r}]")):
        state_from_dict(stored, current_replicas=2)
    with caplog.at_level(logging.WARNING, logger="eyas.autoscale.serve_policy"):
        n, state = TargetTreeWorkPolicy(**KWARGS)(
            make_ctx(2, spread(2, pending_verify_rows=100), policy_state={STATE_KEY: stored})
        )
    assert n == 2 and state[STATE_KEY]["below_since"] is None
    assert any("malformed" in r.getMessage() for r in caplog.records)
