"""Autoscaling policies for target and drafter replicas: pure functions, no Ray.

Eyas runs two kinds of replica that scale independently:

* **target replicas** are expensive: each holds the large model, its KV cache and (for a
  mixture-of-experts target) its experts. They scale on the verify work queued for them, on KV
  pressure and, optionally, on expert bytes touched per round.
* **drafter replicas** are cheap. They scale on the draft rows asked of them only.

Each replica reports a :class:`ReplicaMetrics` (a thin Ray Serve adapter turns the dict returned by
``record_autoscaling_stats()`` into one with :meth:`ReplicaMetrics.from_stats`). The policies are
pure: everything they remember between calls lives in a frozen :class:`ScalingState` that the caller
passes in and gets back::

    state = ScalingState.initial(1)
    replicas, state = decide_target_replicas(metrics, state, TargetScalingConfig(), now=time.monotonic())

``now`` and ``ReplicaMetrics.timestamp`` are seconds on one clock (whichever the adapter uses).

How a decision is made
----------------------
1. **Need** (fractional replicas) per signal, from the totals over all reports:

   * verify rows: ``sum(pending_verify_rows) / target_verify_rows_per_replica``
   * KV: ``sum(kv_bytes_used) / (mean(kv_bytes_capacity) * max_kv_utilisation)`` (the mean over
     the reports with a capacity; the signal is skipped when no report has one)
   * expert bytes (only when ``target_expert_bytes_per_replica`` is set):
     ``sum(expert_bytes) / target_expert_bytes_per_replica``
   * drafters: ``sum(draft_rows) / target_draft_rows_per_replica`` (their only signal)

   ``need = max`` over the signals. Worked example: 3 targets with 300 pending verify rows in all and
   ``target_verify_rows_per_replica=100`` need 3.0; if they also use 2,700 of 3 x 1,000 KV bytes
   with ``max_kv_utilisation=0.8`` the KV signal needs 2700 / 800 = 3.375, so ``need = 3.375``.

2. **Direction**, with a hysteresis band ``downscale_tolerance`` (``tol``):

   * up when ``ceil(need) > current``: the wanted count is ``ceil(need)`` (4 in the example);
   * down when ``ceil(need / (1 - tol)) < current``: the wanted count is ``ceil(need / (1 - tol))``,
     i.e. the fewest replicas that the load fills to at most ``1 - tol`` of their per-replica target.
     A load has to fall a band *below* a replica boundary before that replica is removed, while it
     only has to cross the boundary to add one, so a steady load wobbling around a boundary does
     not flap. Example: ``tol=0.1``, 100 rows a replica, 2 replicas: 205 rows scales up to 3, and
     3 replicas come back down to 2 only once the load is at or below 2 x 100 x 0.9 = 180 rows;
   * otherwise hold.

   The wanted count is clamped to ``[min_replicas, max_replicas]``; idle (zero) load wants
   ``min_replicas``.

3. **Delay**: a direction must hold on every call for ``upscale_delay_s`` (up) or
   ``downscale_delay_s`` (down) before the count changes; a call in the other direction, a hold, or
   a call with no metrics restarts the clock. The change then moves at most ``max_step_up`` /
   ``max_step_down`` replicas towards the wanted count (``None``: no limit), and the clock restarts
   at that call: a further step needs the condition to hold for another full delay.

4. **Bounds are hard**: a current count outside ``[min_replicas, max_replicas]`` (the config changed)
   is moved into the range at once, without delay or step limits.

5. **No metrics** (an empty list, or every report older than ``max_metrics_age_s``): the current
   count is kept and the delay clocks restart.

The policies only see what replicas report: a replica that has not reported yet adds no load, so
the adapter should pass one (recent) report per running replica.

Knobs (both configs)
--------------------
``min_replicas`` / ``max_replicas``
    The range the count is kept in. Targets need ``min_replicas >= 1`` (with no target there is no
    one to report load, so nothing would scale it back up); drafters may go to 0 (target-only
    serving), but then the adapter must pass draft-row reports from elsewhere to scale them up again.
``upscale_delay_s`` / ``downscale_delay_s``
    How long the load must keep wanting more / fewer replicas before the count changes. Long
    downscale delays keep expensive targets (and their KV caches) through short lulls.
``downscale_tolerance``
    The hysteresis band, a fraction in ``[0, 1)``: see step 2. 0 disables it (and flaps at a
    boundary); 0.1 means a replica is removed only when the rest would be at most 90 % busy.
``max_step_up`` / ``max_step_down``
    The most replicas added / removed by one decision (``None``: no limit).
``max_metrics_age_s``
    Reports with ``timestamp < now - max_metrics_age_s`` are ignored (``None``: use all reports).

Target-only knobs (:class:`TargetScalingConfig`)
------------------------------------------------
``target_verify_rows_per_replica``
    Pending verify rows one target replica is meant to carry (the default matches the serving
    app's ``max_verify_rows`` per batched round).
``max_kv_utilisation``
    The fraction of a replica's KV capacity the fleet should use at most, in ``(0, 1]``; above it
    the KV signal asks for more replicas even when the verify queue is short.
``target_expert_bytes_per_replica``
    Expert bytes touched per round one MoE target replica should carry; ``None`` ignores the
    ``expert_bytes`` reports (dense targets).

Drafter-only knob (:class:`DrafterScalingConfig`)
-------------------------------------------------
``target_draft_rows_per_replica``
    Draft rows one drafter replica is meant to carry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

__all__ = [
    "DrafterScalingConfig",
    "ReplicaMetrics",
    "ScalingState",
    "TargetScalingConfig",
    "decide_drafter_replicas",
    "decide_target_replicas",
    "drafter_replica_needs",
    "target_replica_needs",
]

_EPS = 1e-9  # ceil(3.0000000000000004) is 4: float noise must not add a replica


# --- configs -------------------------------------------------------------------------------------------
class _ScalingConfig(BaseModel):
    """The knobs both policies share (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas; the count never goes below it.")
    max_replicas: int = Field(  # validate_default: a min_replicas above the default max must fail too
        4, ge=1, validate_default=True, description="Most replicas; the count never goes above it."
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="Seconds the load must keep wanting more replicas before one is added."
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, description="Seconds the load must keep wanting fewer replicas before one is removed."
    )
    downscale_tolerance: float = Field(
        0.1,
        ge=0,
        lt=1,
        description="Hysteresis band: scale down to n replicas only if the load fills them to at most "
        "(1 - downscale_tolerance) of their per-replica target.",
    )
    max_step_up: int | None = Field(None, ge=1, description="Most replicas added by one decision (None: no limit).")
    max_step_down: int | None = Field(None, ge=1, description="Most replicas removed by one decision (None: no limit).")
    max_metrics_age_s: float | None = Field(
        None, gt=0, description="Ignore reports older than this many seconds before `now` (None: use all)."
    )

    @field_validator("max_replicas")
    @classmethod
    def _max_at_least_min(cls, v: int, info: ValidationInfo) -> int:
        lo = info.data.get("min_replicas")
        if lo is not None and v < lo:
            raise ValueError(f"max_replicas ({v}) must be >= min_replicas ({lo})")
        return v


class TargetScalingConfig(_ScalingConfig):
    """How target replicas (model + KV cache, expensive) scale. Defaults: 1..4 replicas, 30 s up,
    600 s down, 10 % band, at most 2 added and 1 removed per decision."""

    min_replicas: int = Field(
        1, ge=1, description="Fewest target replicas (>= 1: with none, no one reports load to scale up on)."
    )
    target_verify_rows_per_replica: float = Field(
        256.0, gt=0, description="Pending verify rows one target replica is meant to carry."
    )
    max_kv_utilisation: float = Field(
        0.8, gt=0, le=1, description="Fraction of each replica's KV capacity the fleet may use before scaling up."
    )
    target_expert_bytes_per_replica: float | None = Field(
        None, gt=0, description="Expert bytes touched per round one MoE replica should carry (None: ignore)."
    )
    max_step_up: int | None = Field(2, ge=1, description="Most target replicas added by one decision (None: no limit).")
    max_step_down: int | None = Field(
        1, ge=1, description="Most target replicas removed by one decision (None: no limit)."
    )


class DrafterScalingConfig(_ScalingConfig):
    """How drafter replicas (small models, cheap) scale. Defaults: 1..8 replicas, 10 s up, 120 s down,
    10 % band, no step limits."""

    max_replicas: int = Field(
        8, ge=1, validate_default=True, description="Most drafter replicas; the count never goes above it."
    )
    target_draft_rows_per_replica: float = Field(
        512.0, gt=0, description="Draft rows one drafter replica is meant to carry."
    )
    upscale_delay_s: float = Field(
        10.0, ge=0, description="Seconds the load must keep wanting more replicas before one is added."
    )
    downscale_delay_s: float = Field(
        120.0, ge=0, description="Seconds the load must keep wanting fewer replicas before one is removed."
    )


# --- metrics and state ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ReplicaMetrics:
    """One replica's report. All values are >= 0; rows and bytes may be window averages (floats).

    pending_verify_rows: verify rows queued for the next rounds (target replicas).
    draft_rows:          draft rows asked of the drafters (drafter replicas, or the targets' view).
    kv_bytes_used:       KV cache bytes in use.
    kv_bytes_capacity:   KV cache bytes available to this replica (0: not reported).
    expert_bytes:        MoE expert bytes touched per round (0 for dense targets).
    timestamp:           when the report was taken (the clock of ``now``).
    """

    pending_verify_rows: float = 0.0
    draft_rows: float = 0.0
    kv_bytes_used: float = 0.0
    kv_bytes_capacity: float = 0.0
    expert_bytes: float = 0.0
    timestamp: float = 0.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name == "timestamp":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"ReplicaMetrics.{f.name} must be a finite number >= 0, got {v!r}")

    _STAT_KEYS = ("pending_verify_rows", "draft_rows", "kv_bytes_used", "kv_bytes_capacity", "expert_bytes")

    def as_stats(self) -> dict[str, float]:
        """The dict a replica's ``record_autoscaling_stats()`` returns (timestamp left out)."""
        return {k: float(getattr(self, k)) for k in self._STAT_KEYS}

    @classmethod
    def from_stats(cls, stats: Mapping[str, float], timestamp: float) -> ReplicaMetrics:
        """From a ``record_autoscaling_stats()`` dict; missing keys are 0, unknown keys are ignored."""
        return cls(**{k: float(stats.get(k, 0.0)) for k in cls._STAT_KEYS}, timestamp=float(timestamp))


@dataclasses.dataclass(frozen=True)
class ScalingState:
    """What a policy remembers between calls.

    current_replicas: the count the last decision returned.
    above_since:      since when the load has wanted more replicas on every call (None: it does not).
    below_since:      since when the load has wanted fewer replicas on every call (None: it does not).
    last_decision_at: when the count last changed (None: never).
    """

    current_replicas: int
    above_since: float | None = None
    below_since: float | None = None
    last_decision_at: float | None = None

    def __post_init__(self):
        if (
            isinstance(self.current_replicas, bool)
            or not isinstance(self.current_replicas, int)
            or self.current_replicas < 0
        ):
            raise ValueError(f"ScalingState.current_replicas must be an int >= 0, got {self.current_replicas!r}")

    @classmethod
    def initial(cls, replicas: int) -> ScalingState:
        return cls(current_replicas=replicas)


# --- needs ---------------------------------------------------------------------------------------------
def _fresh(metrics: Sequence[ReplicaMetrics] | None, cfg: _ScalingConfig, now: float) -> list[ReplicaMetrics]:
    ms = list(metrics or ())
    if cfg.max_metrics_age_s is not None:
        ms = [m for m in ms if m.timestamp >= now - cfg.max_metrics_age_s]
    return ms


def target_replica_needs(metrics: Sequence[ReplicaMetrics], config: TargetScalingConfig) -> dict[str, float]:
    """Fractional target replicas each signal asks for: ``verify_rows``, ``kv`` (when some report has a
    capacity) and ``expert_bytes`` (when configured). No staleness filtering here."""
    needs = {"verify_rows": sum(m.pending_verify_rows for m in metrics) / config.target_verify_rows_per_replica}
    caps = [m.kv_bytes_capacity for m in metrics if m.kv_bytes_capacity > 0]
    if caps:
        per_replica = (sum(caps) / len(caps)) * config.max_kv_utilisation
        needs["kv"] = sum(m.kv_bytes_used for m in metrics) / per_replica
    if config.target_expert_bytes_per_replica is not None:
        needs["expert_bytes"] = sum(m.expert_bytes for m in metrics) / config.target_expert_bytes_per_replica
    return needs


def drafter_replica_needs(metrics: Sequence[ReplicaMetrics], config: DrafterScalingConfig) -> dict[str, float]:
    """Fractional drafter replicas asked for: ``draft_rows`` only (target signals are ignored)."""
    return {"draft_rows": sum(m.draft_rows for m in metrics) / config.target_draft_rows_per_replica}


# --- decisions -----------------------------------------------------------------------------------------
def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def _decide(need: float | None, state: ScalingState, cfg: _ScalingConfig, now: float) -> tuple[int, ScalingState]:
    cur, lo, hi = state.current_replicas, cfg.min_replicas, cfg.max_replicas
    if not lo <= cur <= hi:  # bounds are hard: no delay, no step limit
        new = min(max(cur, lo), hi)
        return new, ScalingState(new, None, None, now)
    hold = ScalingState(cur, None, None, state.last_decision_at)
    if need is None:
        return cur, hold

    up = _ceil(need)
    down = _ceil(need / (1.0 - cfg.downscale_tolerance))
    if up > cur:
        wanted = min(up, hi)
        if wanted <= cur:
            return cur, hold
        since = state.above_since if state.above_since is not None else now
        if now - since < cfg.upscale_delay_s:
            return cur, ScalingState(cur, since, None, state.last_decision_at)
        step = cfg.max_step_up
        new = wanted if step is None else min(wanted, cur + step)
    elif down < cur:
        wanted = max(down, lo)
        if wanted >= cur:
            return cur, hold
        since = state.below_since if state.below_since is not None else now
        if now - since < cfg.downscale_delay_s:
            return cur, ScalingState(cur, None, since, state.last_decision_at)
        step = cfg.max_step_down
        new = wanted if step is None else max(wanted, cur - step)
    else:
        return cur, hold
    # a step short of the wanted count restarts the clock now: the next step comes a full delay later
    more = now if new != wanted else None
    return new, ScalingState(new, more if new > cur else None, more if new < cur else None, now)


def decide_target_replicas(
    metrics: Sequence[ReplicaMetrics], state: ScalingState, config: TargetScalingConfig, now: float
) -> tuple[int, ScalingState]:
    """The target replica count to run now, and the state to pass to the next call.

    Example (``target_verify_rows_per_replica=100``, ``upscale_delay_s=30``, 1 replica): a burst of
    350 pending rows at t=0 keeps 1 replica (the clock starts); the same burst at t=30 returns 4
    (``max_step_up=None``) or 3 (``max_step_up=2``).
    """
    ms = _fresh(metrics, config, now)
    need = max(target_replica_needs(ms, config).values()) if ms else None
    return _decide(need, state, config, now)


def decide_drafter_replicas(
    metrics: Sequence[ReplicaMetrics], state: ScalingState, config: DrafterScalingConfig, now: float
) -> tuple[int, ScalingState]:
    """The drafter replica count to run now, and the state to pass to the next call. Only
    ``draft_rows`` counts: verify rows, KV and expert bytes are the targets' business.

    Example (``target_draft_rows_per_replica=500``, ``downscale_delay_s=60``, 3 replicas, band 0.1):
    900 draft rows want ceil(1.8 / 0.9) = 2 replicas; after 60 s of that the count drops to 2.
    """
    ms = _fresh(metrics, config, now)
    need = max(drafter_replica_needs(ms, config).values()) if ms else None
    return _decide(need, state, config, now)
