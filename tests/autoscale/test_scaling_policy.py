"""Autoscaling policies (eyas.autoscale.policy): pure functions of (metrics, state, config, now)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from eyas.autoscale.policy import (
    DrafterScalingConfig,
    ReplicaMetrics,
    ScalingState,
    TargetScalingConfig,
    decide_drafter_replicas,
    decide_target_replicas,
    drafter_replica_needs,
    target_replica_needs,
)


def spread(n: int, now: float = 0.0, **totals: float) -> list[ReplicaMetrics]:
    """n reports whose fields add up to ``totals`` (split evenly)."""
    return [ReplicaMetrics(**{k: v / n for k, v in totals.items()}, timestamp=now) for _ in range(n)]


def tcfg(**kw) -> TargetScalingConfig:
    base = dict(
        min_replicas=1,
        max_replicas=10,
        target_verify_rows_per_replica=100,
        upscale_delay_s=0,
        downscale_delay_s=0,
        downscale_tolerance=0.1,
        max_step_up=None,
        max_step_down=None,
    )
    return TargetScalingConfig(**{**base, **kw})


def dcfg(**kw) -> DrafterScalingConfig:
    base = dict(
        min_replicas=1,
        max_replicas=10,
        target_draft_rows_per_replica=100,
        upscale_delay_s=0,
        downscale_delay_s=0,
        downscale_tolerance=0.1,
    )
    return DrafterScalingConfig(**{**base, **kw})


# --- scale up / down with delays -------------------------------------------------------------------------
def test_burst_scales_up_after_the_upscale_delay_not_before():
    """1 replica, 100 rows each, 30 s delay: 350 rows want ceil(3.5) = 4, granted at t=30 only."""
    cfg = tcfg(upscale_delay_s=30)
    state = ScalingState.initial(1)
    for t in (0.0, 10.0, 29.9):
        n, state = decide_target_replicas(spread(1, t, pending_verify_rows=350), state, cfg, now=t)
        assert n == 1 and state.current_replicas == 1
    assert state.above_since == 0.0
    n, state = decide_target_replicas(spread(1, 30, pending_verify_rows=350), state, cfg, now=30.0)
    assert n == 4
    assert state == ScalingState(4, None, None, 30.0)


def test_a_calm_call_restarts_the_upscale_clock():
    """Burst at t=0, calm at t=10, burst again from t=20: the 30 s count from t=20, so t=49 holds, t=50 scales."""
    cfg = tcfg(upscale_delay_s=30)
    state = ScalingState.initial(1)
    for t, rows in ((0, 350), (10, 50), (20, 350), (40, 350), (49, 350)):
        n, state = decide_target_replicas(spread(1, t, pending_verify_rows=rows), state, cfg, now=t)
        assert n == 1, t
    n, _ = decide_target_replicas(spread(1, 50, pending_verify_rows=350), state, cfg, now=50)
    assert n == 4


def test_idle_scales_down_to_min_after_the_downscale_delay_and_never_below():
    """5 replicas, min 2, 600 s delay, zero load: 5 until t=600, then 2, and 2 for ever after."""
    cfg = tcfg(min_replicas=2, downscale_delay_s=600)
    state = ScalingState.initial(5)
    idle = spread(5, pending_verify_rows=0, kv_bytes_used=0, kv_bytes_capacity=5000)
    for t in (0, 300, 599.5):
        n, state = decide_target_replicas(idle, state, cfg, now=t)
        assert n == 5
    assert state.below_since == 0
    n, state = decide_target_replicas(idle, state, cfg, now=600)
    assert n == 2
    for t in range(601, 5000, 250):
        n, state = decide_target_replicas(spread(2, pending_verify_rows=0), state, cfg, now=t)
        assert n == 2


def test_idle_with_step_limit_walks_down_one_delay_per_step():
    """max_step_down=1, 100 s delay, 4 -> min 1: 3 at t=100, 2 at t=200, 1 at t=300 (each step restarts the clock)."""
    cfg = tcfg(downscale_delay_s=100, max_step_down=1)
    state = ScalingState.initial(4)
    seen = {}
    for t in range(0, 401, 10):
        n, state = decide_target_replicas([ReplicaMetrics(timestamp=t)], state, cfg, now=t)
        seen[t] = n
    assert seen[90] == 4 and seen[100] == 3 and seen[190] == 3
    assert seen[200] == 2 and seen[290] == 2 and seen[300] == 1 and seen[400] == 1


def test_scale_down_waits_for_the_downscale_delay():
    """3 replicas, 120 rows (need 1.2, band 0.1 -> ceil(1.33) = 2): 2 only after 60 s of it."""
    cfg = tcfg(downscale_delay_s=60)
    state = ScalingState.initial(3)
    n, state = decide_target_replicas(spread(3, pending_verify_rows=120), state, cfg, now=0)
    assert n == 3
    n, state = decide_target_replicas(spread(3, pending_verify_rows=120), state, cfg, now=59)
    assert n == 3
    n, state = decide_target_replicas(spread(3, pending_verify_rows=120), state, cfg, now=60)
    assert n == 2


# --- bounds and steps ------------------------------------------------------------------------------------
def test_never_above_max_never_below_min():
    cfg = tcfg(min_replicas=2, max_replicas=5)
    n, _ = decide_target_replicas(spread(1, pending_verify_rows=10_000), ScalingState.initial(2), cfg, now=0)
    assert n == 5
    n, _ = decide_target_replicas(spread(5), ScalingState.initial(5), cfg, now=0)
    assert n == 2


def test_a_count_outside_the_bounds_is_corrected_at_once():
    """The config changed under a running fleet: bounds are hard, no delay, no step limit."""
    cfg = tcfg(
        min_replicas=3, max_replicas=4, upscale_delay_s=1e6, downscale_delay_s=1e6, max_step_up=1, max_step_down=1
    )
    n, state = decide_target_replicas(spread(1, pending_verify_rows=0), ScalingState.initial(1), cfg, now=7)
    assert (n, state.last_decision_at) == (3, 7)
    n, _ = decide_target_replicas(spread(9, pending_verify_rows=10_000), ScalingState.initial(9), cfg, now=7)
    assert n == 4
    n, _ = decide_target_replicas([], ScalingState.initial(9), cfg, now=7)
    assert n == 4


@settings(max_examples=150, deadline=None)
@given(
    lo=st.integers(1, 4),
    extra=st.integers(0, 6),
    start=st.integers(0, 12),
    step_up=st.none() | st.integers(1, 3),
    step_down=st.none() | st.integers(1, 3),
    loads=st.lists(st.floats(0, 5000, allow_nan=False), min_size=1, max_size=30),
    drafter_lo=st.integers(0, 3),
)
def test_bounds_hold_for_any_load_sequence(lo, extra, start, step_up, step_down, loads, drafter_lo):
    hi = lo + extra
    cfg = tcfg(
        min_replicas=lo,
        max_replicas=hi,
        max_step_up=step_up,
        max_step_down=step_down,
        upscale_delay_s=1,
        downscale_delay_s=2,
    )
    dhi = max(hi, drafter_lo)
    dc = dcfg(min_replicas=drafter_lo, max_replicas=dhi, max_step_up=step_up, max_step_down=step_down)
    ts, ds = ScalingState.initial(start), ScalingState.initial(start)
    for t, load in enumerate(loads):
        before = ts.current_replicas
        n, ts = decide_target_replicas(
            spread(3, t, pending_verify_rows=load, kv_bytes_used=load, kv_bytes_capacity=3000), ts, cfg, now=float(t)
        )
        assert lo <= n <= hi and n == ts.current_replicas
        if lo <= before <= hi:  # inside the bounds, every change respects the step limits
            assert before - (step_down or 99) <= n <= before + (step_up or 99)
        m, ds = decide_drafter_replicas(spread(2, t, draft_rows=load), ds, dc, now=float(t))
        assert drafter_lo <= m <= dhi


def test_step_limits_cap_each_decision():
    """Need 10 from 1 with max_step_up=3 and no delay: 4, 7, 10; then idle with max_step_down=4: 6, 2, 1."""
    cfg = tcfg(max_step_up=3, max_step_down=4)
    state = ScalingState.initial(1)
    ups = []
    for t in range(4):
        n, state = decide_target_replicas(spread(2, pending_verify_rows=1000), state, cfg, now=t)
        ups.append(n)
    assert ups == [4, 7, 10, 10]
    downs = []
    for t in range(4, 8):
        n, state = decide_target_replicas(spread(2), state, cfg, now=t)
        downs.append(n)
    assert downs == [6, 2, 1, 1]


# --- signals ---------------------------------------------------------------------------------------------
def test_kv_utilisation_alone_forces_scale_up():
    """No verify rows; 2 replicas at 900 of 1000 KV bytes each: 1800 / (1000 * 0.8) = 2.25 -> 3 replicas.
    At max_kv_utilisation=1.0 the same load needs 1.8, so 2 replicas hold."""
    kv = spread(2, pending_verify_rows=0, kv_bytes_used=1800, kv_bytes_capacity=2000)
    n, _ = decide_target_replicas(kv, ScalingState.initial(2), tcfg(max_kv_utilisation=0.8), now=0)
    assert n == 3
    n, _ = decide_target_replicas(kv, ScalingState.initial(2), tcfg(max_kv_utilisation=1.0), now=0)
    assert n == 2
    assert target_replica_needs(kv, tcfg(max_kv_utilisation=0.8)) == pytest.approx({"verify_rows": 0.0, "kv": 2.25})


def test_kv_signal_is_skipped_without_capacity_reports():
    metrics = spread(2, kv_bytes_used=10**9)  # no capacity reported: nothing to divide by
    assert "kv" not in target_replica_needs(metrics, tcfg())
    n, _ = decide_target_replicas(metrics, ScalingState.initial(2), tcfg(), now=0)
    assert n == 1


def test_module_docstring_worked_example():
    """300 rows at 100 a replica -> 3.0; 2700 of 3 x 1000 KV bytes at 0.8 -> 3.375; need 3.375 -> 4 replicas."""
    metrics = spread(3, pending_verify_rows=300, kv_bytes_used=2700, kv_bytes_capacity=3000)
    cfg = tcfg(max_kv_utilisation=0.8)
    assert max(target_replica_needs(metrics, cfg).values()) == pytest.approx(3.375)
    assert decide_target_replicas(metrics, ScalingState.initial(3), cfg, now=0)[0] == 4


def test_expert_bytes_count_only_when_configured():
    """1.5 GB of expert bytes touched: ignored by default; at 1 GB a replica it asks for 2 replicas."""
    metrics = spread(1, pending_verify_rows=10, expert_bytes=1.5e9)
    n, _ = decide_target_replicas(metrics, ScalingState.initial(1), tcfg(), now=0)
    assert n == 1
    assert "expert_bytes" not in target_replica_needs(metrics, tcfg())
    n, _ = decide_target_replicas(metrics, ScalingState.initial(1), tcfg(target_expert_bytes_per_replica=1e9), now=0)
    assert n == 2


def test_exact_boundary_does_not_add_a_replica_from_float_noise():
    """0.1 + 0.2 rows at 0.1 a replica is 3.0000000000000004 in floats: still 3 replicas, not 4."""
    metrics = [ReplicaMetrics(pending_verify_rows=0.1), ReplicaMetrics(pending_verify_rows=0.2)]
    cfg = tcfg(target_verify_rows_per_replica=0.1)
    assert decide_target_replicas(metrics, ScalingState.initial(3), cfg, now=0)[0] == 3


# --- hysteresis ------------------------------------------------------------------------------------------
def _oscillate(cfg: TargetScalingConfig, start: int, boundary: float, calls: int = 200) -> list[int]:
    """Load alternating over 0.95x .. 1.05x of ``boundary`` (a deterministic wobble), one call a second."""
    state, counts = ScalingState.initial(start), []
    for i in range(calls):
        load = boundary * (0.95 + 0.10 * ((i * 7919) % 101) / 100)
        n, state = decide_target_replicas(
            spread(max(1, state.current_replicas), i, pending_verify_rows=load), state, cfg, now=float(i)
        )
        counts.append(n)
    return counts


def _changes(counts: list[int]) -> int:
    return sum(a != b for a, b in zip(counts, counts[1:]))


@pytest.mark.parametrize("start", [2, 3])
@pytest.mark.parametrize("delays", [(0, 0), (5, 5), (30, 600)])
def test_steady_load_near_a_threshold_does_not_flap(start, delays):
    """Load wobbling 190..210 rows around the 2-replica boundary (200): the count changes at most once
    (2 -> 3 when 210 crosses it; 3 -> 2 would need <= 2 x 100 x 0.9 = 180)."""
    up, down = delays
    counts = _oscillate(tcfg(downscale_tolerance=0.1, upscale_delay_s=up, downscale_delay_s=down), start, 200.0)
    assert _changes([start] + counts) <= 1
    assert set(counts) <= {2, 3}


def test_without_the_band_the_same_load_flaps():
    """The control for the test above: downscale_tolerance=0 and no delays flap many times."""
    counts = _oscillate(tcfg(downscale_tolerance=0.0), 2, 200.0)
    assert _changes(counts) > 20


def test_load_clearly_below_the_band_still_scales_down():
    """3 replicas, 170 rows: ceil(1.7 / 0.9) = 2 -> scale down to 2 (the band does not block real drops)."""
    n, _ = decide_target_replicas(spread(3, pending_verify_rows=170), ScalingState.initial(3), tcfg(), now=0)
    assert n == 2
    n, _ = decide_target_replicas(spread(3, pending_verify_rows=185), ScalingState.initial(3), tcfg(), now=0)
    assert n == 3


# --- drafters scale on their own signal ------------------------------------------------------------------
def test_drafter_policy_ignores_target_signals_and_vice_versa():
    """Heavy verify / KV / expert load with no draft rows: targets go up, drafters go down to min.
    Heavy draft rows with an idle target: drafters go up, targets go down."""
    heavy_target = spread(2, pending_verify_rows=1000, kv_bytes_used=1900, kv_bytes_capacity=2000, expert_bytes=1e12)
    tc, dc = tcfg(target_expert_bytes_per_replica=1e9), dcfg(min_replicas=1)
    assert decide_target_replicas(heavy_target, ScalingState.initial(2), tc, now=0)[0] == 10
    assert decide_drafter_replicas(heavy_target, ScalingState.initial(4), dc, now=0)[0] == 1
    assert drafter_replica_needs(heavy_target, dc) == {"draft_rows": 0.0}

    heavy_draft = spread(2, draft_rows=650)
    assert decide_drafter_replicas(heavy_draft, ScalingState.initial(2), dc, now=0)[0] == 7
    assert decide_target_replicas(heavy_draft, ScalingState.initial(4), tc, now=0)[0] == 1


def test_drafter_delays_and_band_apply():
    """500 rows a drafter, 60 s down delay, 3 drafters, 900 rows: ceil(1.8 / 0.9) = 2 after 60 s."""
    cfg = dcfg(target_draft_rows_per_replica=500, downscale_delay_s=60, upscale_delay_s=10)
    state = ScalingState.initial(3)
    n, state = decide_drafter_replicas(spread(3, draft_rows=900), state, cfg, now=0)
    assert n == 3
    n, state = decide_drafter_replicas(spread(3, draft_rows=900), state, cfg, now=60)
    assert n == 2
    n, state = decide_drafter_replicas(spread(2, draft_rows=1600), state, cfg, now=61)
    assert n == 2 and state.above_since == 61
    n, state = decide_drafter_replicas(spread(2, draft_rows=1600), state, cfg, now=71)
    assert n == 4


def test_drafters_may_scale_to_zero():
    cfg = dcfg(min_replicas=0)
    n, state = decide_drafter_replicas(spread(2), ScalingState.initial(2), cfg, now=0)
    assert n == 0
    n, _ = decide_drafter_replicas([], state, cfg, now=1)  # nobody reports: stays at 0
    assert n == 0
    n, _ = decide_drafter_replicas(spread(1, draft_rows=150), state, cfg, now=2)  # targets report draft rows
    assert n == 2


# --- missing metrics, staleness, purity ------------------------------------------------------------------
def test_empty_metrics_keep_the_count_and_restart_the_clocks():
    cfg = tcfg(upscale_delay_s=30)
    _, state = decide_target_replicas(spread(1, pending_verify_rows=500), ScalingState.initial(2), cfg, now=0)
    assert state.above_since == 0
    n, state = decide_target_replicas([], state, cfg, now=20)
    assert n == 2 and state.above_since is None and state.below_since is None
    n, state = decide_target_replicas(spread(1, pending_verify_rows=500), state, cfg, now=31)
    assert n == 2  # the clock restarted at t=31, not t=0
    # idle with no reports at all is "missing", not "zero load": no scale-down
    n, _ = decide_target_replicas([], ScalingState.initial(5), tcfg(), now=1e6)
    assert n == 5


def test_stale_reports_are_ignored_when_max_age_is_set():
    old = spread(1, 0.0, pending_verify_rows=900)
    n, _ = decide_target_replicas(old, ScalingState.initial(1), tcfg(), now=100)
    assert n == 9  # no max age: every report counts
    n, _ = decide_target_replicas(old, ScalingState.initial(1), tcfg(max_metrics_age_s=10), now=100)
    assert n == 1  # all stale = missing: keep the count
    mixed = old + spread(1, 95.0, pending_verify_rows=250)
    n, _ = decide_target_replicas(mixed, ScalingState.initial(1), tcfg(max_metrics_age_s=10), now=100)
    assert n == 3


def test_policies_are_pure():
    cfg = tcfg(upscale_delay_s=30)
    metrics = spread(2, 5, pending_verify_rows=500)
    state = ScalingState(2, above_since=0.0)
    first = decide_target_replicas(metrics, state, cfg, now=31)
    assert first == decide_target_replicas(metrics, state, cfg, now=31) == (5, ScalingState(5, None, None, 31))
    assert state == ScalingState(2, above_since=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.current_replicas = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        metrics[0].pending_verify_rows = 1
    with pytest.raises(ValidationError):
        cfg.max_replicas = 3


def test_module_does_not_import_ray():
    code = "import sys, eyas.autoscale.policy; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# --- validation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (TargetScalingConfig, dict(min_replicas=3, max_replicas=2), "max_replicas"),
        (TargetScalingConfig, dict(min_replicas=5), "max_replicas"),  # above the default max of 4
        (TargetScalingConfig, dict(min_replicas=0), "min_replicas"),
        (TargetScalingConfig, dict(upscale_delay_s=-1), "upscale_delay_s"),
        (TargetScalingConfig, dict(downscale_delay_s=-0.5), "downscale_delay_s"),
        (TargetScalingConfig, dict(max_kv_utilisation=1.5), "max_kv_utilisation"),
        (TargetScalingConfig, dict(max_kv_utilisation=0), "max_kv_utilisation"),
        (TargetScalingConfig, dict(target_verify_rows_per_replica=0), "target_verify_rows_per_replica"),
        (TargetScalingConfig, dict(target_expert_bytes_per_replica=-1), "target_expert_bytes_per_replica"),
        (TargetScalingConfig, dict(downscale_tolerance=1.0), "downscale_tolerance"),
        (TargetScalingConfig, dict(max_step_up=0), "max_step_up"),
        (TargetScalingConfig, dict(max_step_down=0), "max_step_down"),
        (TargetScalingConfig, dict(target_draft_rows_per_replica=10), "target_draft_rows_per_replica"),  # extra
        (DrafterScalingConfig, dict(min_replicas=9, max_replicas=3), "max_replicas"),
        (DrafterScalingConfig, dict(downscale_delay_s=-1), "downscale_delay_s"),
        (DrafterScalingConfig, dict(target_draft_rows_per_replica=-5), "target_draft_rows_per_replica"),
        (DrafterScalingConfig, dict(max_kv_utilisation=0.5), "max_kv_utilisation"),  # extra: a target knob
        (DrafterScalingConfig, dict(min_replicas=-1), "min_replicas"),
    ],
)
def test_config_validation_names_the_field(cls, kwargs, field):
    with pytest.raises(ValidationError) as err:
        cls(**kwargs)
    errors = err.value.errors()
    assert errors[0]["loc"] == (field,)
    assert field in str(err.value)


def test_min_above_max_message_names_both_fields():
    with pytest.raises(ValidationError, match=r"max_replicas \(2\) must be >= min_replicas \(3\)"):
        TargetScalingConfig(min_replicas=3, max_replicas=2)


def test_defaults_are_valid_and_documented():
    for cls in (TargetScalingConfig, DrafterScalingConfig):
        cfg = cls()
        assert cfg.min_replicas <= cfg.max_replicas
        assert all(f.description for f in cls.model_fields.values()), cls
    assert TargetScalingConfig().max_kv_utilisation == 0.8
    assert TargetScalingConfig().target_expert_bytes_per_replica is None
    assert TargetScalingConfig.model_validate({"min_replicas": 2, "max_replicas": 6}).max_replicas == 6


@pytest.mark.parametrize(
    "field", ["pending_verify_rows", "draft_rows", "kv_bytes_used", "kv_bytes_capacity", "expert_bytes"]
)
def test_replica_metrics_reject_negative_or_nan(field):
    with pytest.raises(ValueError, match=field):
        ReplicaMetrics(**{field: -1})
    with pytest.raises(ValueError, match=field):
        ReplicaMetrics(**{field: float("nan")})


def test_replica_metrics_stats_round_trip():
    m = ReplicaMetrics(
        pending_verify_rows=3, draft_rows=4, kv_bytes_used=5, kv_bytes_capacity=6, expert_bytes=7, timestamp=8
    )
    assert ReplicaMetrics.from_stats(m.as_stats(), timestamp=8) == m
    assert ReplicaMetrics.from_stats({"draft_rows": 2, "other": 1}, 0) == ReplicaMetrics(draft_rows=2)
