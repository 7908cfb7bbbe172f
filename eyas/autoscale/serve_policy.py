"""Ray Serve custom autoscaling policies that run the pure Eyas policies of :mod:`eyas.autoscale.policy`.

Ray Serve (2.60) accepts a custom policy in a deployment's ``autoscaling_config``. When
``policy_function`` names a class, Serve's controller instantiates it once with ``**policy_kwargs``
and calls ``instance(ctx)`` on every autoscaling tick, with ``ctx`` a
:class:`ray.serve.config.AutoscalingContext`; the call returns ``(desired_num_replicas, policy_state)``
and Serve hands ``policy_state`` back as ``ctx.policy_state`` on the next tick. The two classes here
do exactly that:

* :class:`TargetTreeWorkPolicy` runs :func:`~eyas.autoscale.policy.decide_target_replicas`
  (``policy_kwargs`` are the fields of :class:`~eyas.autoscale.policy.TargetScalingConfig`);
* :class:`DrafterTreeWorkPolicy` runs :func:`~eyas.autoscale.policy.decide_drafter_replicas`
  (``policy_kwargs`` are the fields of :class:`~eyas.autoscale.policy.DrafterScalingConfig`).

Who reports what
----------------
Every replica reports its load from a ``record_autoscaling_stats()`` method returning a dict of
floats (:meth:`ReplicaMetrics.as_stats` builds it); the metric names are exactly
``ReplicaMetrics._STAT_KEYS``:

* **target replicas** report ``pending_verify_rows``, ``draft_rows``, ``kv_bytes_used``,
  ``kv_bytes_capacity`` and ``expert_bytes`` (0 for a dense target);
* **drafter replicas** report ``draft_rows`` (the drafter policy reads nothing else, so any other
  key a drafter sends is ignored).

Serve aggregates each metric over ``look_back_period_s`` per replica (mean by default) and passes the result as
``ctx.aggregated_metrics: {metric_name: {replica_id: value}}``; :func:`metrics_from_context` turns
that into one :class:`ReplicaMetrics` per replica (a metric a replica did not send is 0). A negative
or non-finite value (a buggy replica) is read as 0 and logged once per metric, so that it cannot
crash Serve's controller. No metrics at all (``None``, ``{}``, or only other metric names) keeps the
current count and restarts the delay clocks.

Delays belong to the Eyas policy
--------------------------------
The Eyas policy applies its own upscale / downscale delays, step limits and hysteresis band (from
``policy_kwargs``). Serve wraps every custom policy in its own delay logic as well, so set Serve's
``upscale_delay_s`` and ``downscale_delay_s`` to 0 in ``autoscaling_config`` (Serve's defaults are
30 s and 600 s, which would add to the Eyas delays) and leave Serve's ``upscaling_factor`` /
``downscaling_factor`` / ``smoothing_factor`` unset (1.0), which would otherwise rescale each step.
Keep Serve's ``min_replicas`` / ``max_replicas`` equal to the ``policy_kwargs`` ones: the decision is
clamped into both ranges (Serve's, capacity-adjusted, last). ``max_metrics_age_s`` has no effect
here: Serve's ``look_back_period_s`` already windows the reports, and they are all stamped "now".

How fresh the reports are is Serve's business: each replica calls ``record_autoscaling_stats()``
every ``min(0.2 * look_back_period_s, metrics_interval_s)`` but pushes to the controller only every
``metrics_interval_s`` (10 s by default). In Serve 2.60 that field is marked deprecated in favour of
``RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S``, but the replica still reads the field, not
the variable. With the example's 5 s window Serve therefore warns (FutureWarning) that
``look_back_period_s`` should exceed ``metrics_interval_s``, and the policy sees reports up to 10 s
old; add ``metrics_interval_s: 1`` (at the cost of a DeprecationWarning) for fresher ones.

Example (a target deployment in a Serve config file)::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      upscale_delay_s: 0
      downscale_delay_s: 0
      look_back_period_s: 5
      policy:
        policy_function: eyas.autoscale.serve_policy:TargetTreeWorkPolicy
        policy_kwargs: {target_verify_rows_per_replica: 64, upscale_delay_s: 2, downscale_delay_s: 10, min_replicas: 1, max_replicas: 4}

A drafter deployment is the same with ``eyas.autoscale.serve_policy:DrafterTreeWorkPolicy`` and,
e.g., ``policy_kwargs: {target_draft_rows_per_replica: 512}``. A drafter deployment allowed down to
0 replicas is brought back by Serve's own cold start (a request to it while it has none), which
bypasses the custom policy.

Policy state
------------
Serve keeps its own keys in ``ctx.policy_state`` (e.g. ``__decision_counters``); they are returned
unchanged, and everything Eyas remembers lives under the one key ``"eyas"`` (:data:`STATE_KEY`)::

    {"current_replicas": 3, "above_since": 102.0, "below_since": None, "last_decision_at": 102.0,
     "needs": {"verify_rows": 3.125}, "decided_at": 102.0}

``current_replicas`` is always re-read from ``ctx.target_num_replicas`` (Serve may have changed the
count since the last tick); ``needs`` (fractional replicas per signal) and ``decided_at`` are there
for inspection only. Times are ``ctx.current_time`` (Serve passes ``time.time()``; ``None`` falls back
to it).

Worked example (``TargetTreeWorkPolicy(target_verify_rows_per_replica=64, upscale_delay_s=2,
downscale_delay_s=10, min_replicas=1, max_replicas=4)``, default ``max_step_up=2``; the running
replicas report 200 pending verify rows in all, so ``need = 200 / 64 = 3.125`` wants 4 replicas):

=====  ==========  ======  ==========================================================
t      target      result  why
=====  ==========  ======  ==========================================================
100    1           1       the upscale clock starts (``above_since=100``)
101    1           1       1 s < 2 s
102    1           3       2 s held: up by at most 2; the clock restarts at 102
104    3           4       another 2 s held: the remaining replica
=====  ==========  ======  ==========================================================
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping, MutableSet
from typing import Any, ClassVar

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

__all__ = [
    "STATE_KEY",
    "DrafterTreeWorkPolicy",
    "TargetTreeWorkPolicy",
    "metrics_from_context",
    "state_from_dict",
    "state_to_dict",
]

log = logging.getLogger(__name__)

STATE_KEY = "eyas"  # the one key of ctx.policy_state the Eyas policies own

_STATE_FIELDS = ("current_replicas", "above_since", "below_since", "last_decision_at")
_TIME_FIELDS = _STATE_FIELDS[1:]  # optional timestamps (None: not running)

# metric names already warned about by callers that do not keep their own set (once per process)
_WARNED_METRICS: set[str] = set()


# --- metrics -------------------------------------------------------------------------------------------
def _clean_value(value: Any) -> float | None:
    """``value`` as a finite float >= 0, or None when it is negative, NaN, infinite or not a number."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _warn_once(metric: str, replica: Hashable, value: Any, warned: MutableSet[str]) -> None:
    if metric in warned:
        return
    warned.add(metric)
    log.warning(
        "autoscaling metric %r from replica %s is %r (not a finite number >= 0): read as 0; "
        "further bad %r values are not logged",
        metric,
        replica,
        value,
        metric,
    )


def metrics_from_context(
    aggregated: Mapping[str, Mapping[Hashable, Any]] | None, now: float, *, warned: MutableSet[str] | None = None
) -> list[ReplicaMetrics]:
    """One :class:`ReplicaMetrics` per replica found in ``ctx.aggregated_metrics``, stamped ``now``.

    ``aggregated`` maps a metric name to ``{replica_id: value}``. Only the names in
    ``ReplicaMetrics._STAT_KEYS`` are read (others are ignored); a replica that sent some of them
    gets 0 for the rest; replicas come in the order they are first seen. A negative, NaN, infinite
    or non-numeric value is read as 0 and logged once per metric name (``warned`` holds the names
    already logged; ``None``: once per process).

    Example::

        metrics_from_context({"pending_verify_rows": {"a": 10.0, "b": 20.0},
                              "draft_rows": {"b": 5.0}, "qps": {"c": 1.0}}, now=7.0)
        == [ReplicaMetrics(pending_verify_rows=10.0, timestamp=7.0),
            ReplicaMetrics(pending_verify_rows=20.0, draft_rows=5.0, timestamp=7.0)]
    """
    warned = _WARNED_METRICS if warned is None else warned
    per_replica: dict[Hashable, dict[str, float]] = {}  # replica id -> {metric name: clean value}
    for name in ReplicaMetrics._STAT_KEYS:
        for replica, value in ((aggregated or {}).get(name) or {}).items():
            clean = _clean_value(value)
            if clean is None:
                _warn_once(name, replica, value, warned)
                clean = 0.0
            per_replica.setdefault(replica, {})[name] = clean
    return [ReplicaMetrics.from_stats(stats, timestamp=now) for stats in per_replica.values()]


# --- state ---------------------------------------------------------------------------------------------
def state_to_dict(state: ScalingState) -> dict[str, Any]:
    """A :class:`ScalingState` as a plain (JSON-friendly) dict; :func:`state_from_dict` reads it back.

    Example: ``state_to_dict(ScalingState(3, 102.0, None, 102.0)) == {"current_replicas": 3,
    "above_since": 102.0, "below_since": None, "last_decision_at": 102.0}``.
    """
    return {name: getattr(state, name) for name in _STATE_FIELDS}


def _time_or_none(data: Mapping[str, Any], name: str) -> float | None:
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"policy_state[{STATE_KEY!r}].{name} must be a finite number or None, got {v!r}")
    return float(v)


def state_from_dict(data: Mapping[str, Any], current_replicas: int | None = None) -> ScalingState:
    """The :class:`ScalingState` in ``data`` (as written by :func:`state_to_dict`; other keys ignored).

    ``current_replicas`` overrides the stored count (the adapter passes ``ctx.target_num_replicas``,
    which Serve may have changed since the last tick); ``None`` keeps the stored one. A malformed
    ``data`` raises ValueError naming the field.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"policy_state[{STATE_KEY!r}] must be a dict, got {type(data).__name__}")
    replicas = data.get("current_replicas") if current_replicas is None else current_replicas
    return ScalingState(replicas, *(_time_or_none(data, name) for name in _TIME_FIELDS))


def _restore_state(policy_state: Mapping[str, Any], target_num_replicas: int, deployment: str) -> ScalingState:
    """The state stored under :data:`STATE_KEY` with Serve's current count, or a fresh one when there is
    none (first tick) or it is malformed (logged; the delay clocks restart)."""
    stored = policy_state.get(STATE_KEY)
    if stored is None:
        return ScalingState.initial(target_num_replicas)
    try:
        return state_from_dict(stored, current_replicas=target_num_replicas)
    except ValueError as exc:
        log.warning("deployment %s: ignoring malformed autoscaling state (%s); starting afresh", deployment, exc)
        return ScalingState.initial(target_num_replicas)


# --- the Serve policies --------------------------------------------------------------------------------
def _clamp(n: int, lo: int, hi: int) -> int:
    """``n`` moved into ``[lo, hi]`` (``hi`` wins should ``lo > hi``)."""
    return min(max(n, lo), hi)


def _validation_message(exc: ValidationError) -> str:
    """``policy_kwargs.<field>: <reason>`` for each error, joined by ``; ``."""
    parts = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"policy_kwargs.{field}: {err['msg']}")
    return "; ".join(parts)


class _TreeWorkPolicy:
    """Shared adapter: ``policy_kwargs`` -> config once, then ``ctx`` -> pure decision -> ``(n, state)``
    on every tick. Subclasses name the config class, the decision and the needs function."""

    config_cls: ClassVar[type]
    _decide: ClassVar[Callable[..., tuple[int, ScalingState]]]
    _needs: ClassVar[Callable[..., dict[str, float]]]

    def __init__(self, **policy_kwargs: Any):
        try:
            self.config = self.config_cls(**policy_kwargs)
        except ValidationError as exc:
            raise ValueError(f"{type(self).__name__}: {_validation_message(exc)}") from None
        self._warned: set[str] = set()  # metric names already logged as bad, once per policy instance

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """One autoscaling tick: ``(desired_num_replicas, policy_state)`` for Serve."""
        now = ctx.current_time if ctx.current_time is not None else time.time()
        policy_state = dict(ctx.policy_state or {})
        metrics = metrics_from_context(ctx.aggregated_metrics, now, warned=self._warned)
        state = _restore_state(policy_state, ctx.target_num_replicas, ctx.deployment_name)
        replicas, state = self._decide(metrics, state, self.config, now)
        replicas = _clamp(replicas, ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
        needs = self._needs(metrics, self.config) if metrics else {}
        ours = {**state_to_dict(state), "current_replicas": replicas, "needs": needs, "decided_at": now}
        return replicas, {**policy_state, STATE_KEY: ours}


class TargetTreeWorkPolicy(_TreeWorkPolicy):
    """Serve policy for target replicas: verify rows, KV pressure and (optionally) expert bytes.

    ``policy_kwargs`` are :class:`~eyas.autoscale.policy.TargetScalingConfig` fields; a bad one
    raises ValueError naming it (``policy_kwargs.target_verify_rows_per_replica: ...``).

    Example (``target_verify_rows_per_replica=64``, ``upscale_delay_s=0``, ``max_replicas=4``): two
    replicas reporting 100 and 80 pending verify rows need 180 / 64 = 2.81 replicas, so a tick with
    ``target_num_replicas=2`` returns 3.
    """

    config_cls = TargetScalingConfig
    _decide = staticmethod(decide_target_replicas)
    _needs = staticmethod(target_replica_needs)


class DrafterTreeWorkPolicy(_TreeWorkPolicy):
    """Serve policy for drafter replicas: ``draft_rows`` only (verify rows, KV and expert bytes are
    ignored, even when a replica reports them).

    ``policy_kwargs`` are :class:`~eyas.autoscale.policy.DrafterScalingConfig` fields.

    Example (``target_draft_rows_per_replica=100``, ``downscale_delay_s=0``, band 0.1): 3 replicas
    reporting 150 draft rows in all want ``ceil(1.5 / 0.9) = 2`` replicas, so the tick returns 2.
    """

    config_cls = DrafterScalingConfig
    _decide = staticmethod(decide_drafter_replicas)
    _needs = staticmethod(drafter_replica_needs)
