"""Workloads and timelines for the autoscaling experiment (``eyas experiment autoscale``): pure, no Ray.

The experiment replays a **workload** against the Eyas Serve app on a fake multi-node Ray cluster
and records a **timeline** of what the cluster did. This module holds the parts that need neither
Ray nor a model; the runner that drives the cluster uses them.

Terms
-----
* **Workload** (:class:`Workload`, a YAML file under ``ray_configs/workloads/``): a list of
  **phases** played back to back, and named **mixes** of prompt kinds.
* **Phase** (:class:`Phase`): ``duration_s`` seconds during which requests arrive at a rate that
  moves from ``rate_start`` to ``rate_end``, along a straight line (``shape: linear``) or
  a half-cosine ease (``shape: cosine``, flat at both ends, for a diurnal curve). Phase ``i`` covers
  the half-open interval ``[start_i, start_i + duration_s)`` of workload time, where ``start_i`` is
  the sum of the earlier phases' durations.
* **Rate**: requests/s (``0.5``, for replaying a trace), or a multiple of the **capacity**
  (``"3x"``): the request rate one target replica sustains on the workload's calibration mix,
  measured by the experiment before the phases (:class:`CalibrationSpec`). Written in capacity, a
  burst of ``"3x"`` overloads one replica on a slow machine and a fast one alike, so the same file
  scales on both; :meth:`Workload.at_capacity` turns it into requests/s.
* **Mix** (:class:`Mix`): prompt kinds (:class:`PromptKind`) with weights; each arrival draws one
  kind with probability ``weight / sum(weights)`` from its phase's mix.
* **Arrival** (:class:`Arrival`): one request to send, at workload time ``t`` seconds.
  :func:`arrivals` draws them from a non-homogeneous Poisson process whose rate is :func:`rate_at`,
  by thinning (Lewis and Shedler): candidate times come from a homogeneous process at the phase's
  highest rate ``r_max`` and each is kept with probability ``rate_at(t) / r_max``. One
  ``random.Random(workload.seed)`` drives the candidates, the thinning and the kinds, so a seed
  fixes the whole list.
* **Sample** (:class:`Sample`): the cluster's state at one instant, taken every
  ``sample_interval_s`` by the runner; a **timeline** (:class:`Timeline`) is the list of samples
  plus **events** (``{"t": 3.2, "kind": "burst_start", ...}``) and is saved as JSON and plotted
  with :func:`plot_timeline`. :func:`summary` reduces a timeline to the numbers an experiment
  reports (time to added capacity, burst against steady p99 latency, peaks).
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from eyas.experiments import sim

#: seconds after the burst start over which :func:`summary` takes the burst p99 latency
BURST_WINDOW_S = 60.0
#: the event kind that marks the start of a burst (the default ``burst_t`` of :func:`summary`)
BURST_START = "burst_start"


# --------------------------------------------------------------------------------------------------
# Workload files
# --------------------------------------------------------------------------------------------------


class PromptKind(BaseModel):
    """One kind of request in a mix: the text sent and how many tokens to generate."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="Label of the kind, recorded on each arrival.")
    weight: float = Field(gt=0, description="Relative draw weight within its mix (need not sum to 1).")
    prompt: str = Field(min_length=1, description="The prompt text sent to the server.")
    max_new_tokens: int = Field(ge=1, description="Output token cap for this kind's requests.")


class Mix(BaseModel):
    """A weighted set of prompt kinds; each arrival draws one kind by weight."""

    model_config = ConfigDict(extra="forbid")

    prompts: list[PromptKind] = Field(min_length=1, description="The kinds; names must be unique.")

    @model_validator(mode="after")
    def _unique_names(self) -> Mix:
        names = [kind.name for kind in self.prompts]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise PydanticCustomError("duplicate_kind", "prompt kind names repeat: {names}", {"names": str(repeated)})
        return self


CAPACITY_MULTIPLE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*x\s*$")


def _check_rate(value: float | str) -> float | str:
    """A rate is requests/s (a number >= 0) or a multiple of the calibrated capacity: ``"3x"``, ``"0.05x"``."""
    if isinstance(value, str):
        if not CAPACITY_MULTIPLE.match(value):
            raise PydanticCustomError(
                "rate",
                "a rate is requests/s (a number) or a multiple of the calibrated capacity such as '3x', got '{value}'",
                {"value": value},
            )
        return value.strip()
    if not value >= 0:
        raise PydanticCustomError("rate", "a rate must be >= 0, got {value}", {"value": value})
    return float(value)


#: requests/s (a float), or a multiple of one target replica's calibrated capacity (``"3x"``)
Rate = Annotated[float | str, AfterValidator(_check_rate)]


def absolute_rate(rate: float | str, capacity_per_s: float) -> float:
    """``rate`` in requests/s: a number as it is, ``"Nx"`` as ``N * capacity_per_s``."""
    if isinstance(rate, str):
        return float(CAPACITY_MULTIPLE.match(rate).group(1)) * capacity_per_s
    return rate


class CalibrationSpec(BaseModel):
    """How ``eyas experiment autoscale`` measures one target replica's capacity before the phases.

    The app is deployed with its replicas pinned (the autoscaler may not add any); ``repeats`` times,
    ``requests`` prompts drawn from ``mix`` are sent at once by ``concurrency`` clients (a closed loop:
    each client sends its next prompt when its last one is answered). One repeat's **capacity** is its
    requests / its makespan (first send to last answer): the rate one replica sustains with
    ``concurrency`` requests in flight, whose latency the run reports beside it. The capacity a
    ``"Nx"`` rate multiplies is the median over the repeats; the simulator is fitted on each repeat.
    """

    model_config = ConfigDict(extra="forbid")

    mix: str | None = Field(None, description="The mix calibrated on; None = default_mix.")
    concurrency: int | None = Field(
        None, ge=1, description="Requests in flight while calibrating; None = the app's max_batch."
    )
    requests: int | None = Field(None, ge=1, description="Requests per repeat; None = 2 x concurrency.")
    repeats: int = Field(3, ge=1, le=20, description="Calibration repeats (the simulator's interval spans them).")
    shared_host: bool = Field(
        True,
        description=(
            "On the fake cluster (every replica a process on this machine), also measure two pinned target "
            "replicas once: how many rounds the host runs at once, for the simulator (false: its cores)."
        ),
    )


class Phase(BaseModel):
    """A stretch of ``duration_s`` seconds whose arrival rate moves from ``rate_start`` to ``rate_end``."""

    model_config = ConfigDict(extra="forbid")

    duration_s: float = Field(gt=0, description="Length of the phase in seconds.")
    rate_start: Rate = Field(
        description="Arrival rate at the start of the phase: requests/s, or a multiple of the calibrated capacity ('3x')."
    )
    rate_end: Rate | None = Field(
        None,
        description=(
            "Arrival rate at the end of the phase (requests/s or 'Nx'); None means the same as rate_start (a constant rate)."
        ),
    )
    shape: Literal["linear", "cosine"] = Field(
        "linear",
        description=(
            "How the rate moves between rate_start and rate_end: a straight line, or a half-cosine "
            "ease that is flat at both ends (a diurnal curve)."
        ),
    )
    mix: str | None = Field(None, description="Name of a mix in the workload's mixes; None = default_mix.")
    label: str | None = Field(
        None, description=("An event the runner marks on the timeline when the phase starts, e.g. burst_start.")
    )

    @property
    def relative(self) -> bool:
        """True when a rate is a multiple of the calibrated capacity (``"3x"``): resolve it first."""
        return isinstance(self.rate_start, str) or isinstance(self.rate_end, str)

    def at_capacity(self, capacity_per_s: float) -> Phase:
        """This phase in requests/s: every ``"Nx"`` rate becomes ``N * capacity_per_s``."""
        return self.model_copy(
            update={
                "rate_start": absolute_rate(self.rate_start, capacity_per_s),
                "rate_end": None if self.rate_end is None else absolute_rate(self.rate_end, capacity_per_s),
            }
        )

    @property
    def end_rate(self) -> float:
        """The rate at the end of the phase (``rate_end``, or ``rate_start`` when that is None)."""
        self._require_absolute()
        return self.rate_start if self.rate_end is None else self.rate_end

    @property
    def max_rate(self) -> float:
        """The highest rate in the phase: both shapes are monotonic, so it is at one of the ends."""
        return max(self.rate_start, self.end_rate)

    def _require_absolute(self) -> None:
        if self.relative:
            raise ValueError(
                f"phase rate {self.rate_start!r} is a multiple of the calibrated capacity: resolve the workload "
                "with Workload.at_capacity(requests_per_s) first (eyas experiment autoscale calibrates it)"
            )

    def rate(self, offset_s: float) -> float:
        """The rate ``offset_s`` seconds into the phase (clamped to ``[0, duration_s]``).

        With ``f = offset_s / duration_s``: linear is ``start + (end - start) * f``; cosine is
        ``start + (end - start) * (1 - cos(pi * f)) / 2``. Both equal the midpoint of start and
        end at ``f = 0.5``.
        """
        self._require_absolute()
        f = min(max(offset_s / self.duration_s, 0.0), 1.0)
        if self.shape == "cosine":
            f = (1.0 - math.cos(math.pi * f)) / 2.0
        return self.rate_start + (self.end_rate - self.rate_start) * f


class Workload(BaseModel):
    """A replayable workload: phases played back to back, prompts drawn from named mixes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="Name shown in plots and timelines.")
    description: str = Field("", description="Free text: what the workload tests.")
    seed: int = Field(0, description="Seed of random.Random for arrival times and prompt kinds.")
    method: str = Field("eagle3", min_length=1, description="Speculative-decoding method requested.")
    phases: list[Phase] = Field(min_length=1, description="Phases, played in order.")
    mixes: dict[str, Mix] = Field(min_length=1, description="Named prompt mixes.")
    default_mix: str = Field(description="Mix used by phases that name none.")
    sample_interval_s: float = Field(1.0, gt=0, description="Seconds between timeline samples.")
    drain_s: float = Field(
        30.0, ge=0, description=("Seconds the runner keeps sampling after the last arrival (to watch scale-down).")
    )
    latency_target_s: float | None = Field(
        None, gt=0, description=("Optional end-to-end latency goal in seconds (drawn on the plot's latency panel).")
    )
    calibration: CalibrationSpec = Field(
        default_factory=CalibrationSpec, description="How one target replica's capacity is measured first."
    )
    expect_scaling: bool = Field(
        True,
        description=(
            "A scale-up experiment: the report calls the run a success only when target capacity was added "
            "while the load lasted (the burst phase, else the phases) and given back after."
        ),
    )

    @model_validator(mode="after")
    def _mix_names_exist(self) -> Workload:
        known = sorted(self.mixes)
        if self.default_mix not in self.mixes:
            raise _unknown_mix("default_mix", self.default_mix, known)
        for i, phase in enumerate(self.phases):
            if phase.mix is not None and phase.mix not in self.mixes:
                raise _unknown_mix(f"phases.{i}.mix", phase.mix, known)
        if self.calibration.mix is not None and self.calibration.mix not in self.mixes:
            raise _unknown_mix("calibration.mix", self.calibration.mix, known)
        return self

    @property
    def relative(self) -> bool:
        """True when a phase's rate is a multiple of the calibrated capacity."""
        return any(phase.relative for phase in self.phases)

    def at_capacity(self, capacity_per_s: float) -> Workload:
        """The workload in requests/s, with ``"Nx"`` rates read as multiples of ``capacity_per_s``."""
        if not capacity_per_s > 0:
            raise ValueError(f"capacity_per_s: {capacity_per_s} must be > 0")
        return self.model_copy(update={"phases": [p.at_capacity(capacity_per_s) for p in self.phases]})

    def calibration_mix(self) -> Mix:
        """The mix the capacity is measured on."""
        return self.mixes[self.calibration.mix or self.default_mix]

    def phase_mix(self, index: int) -> Mix:
        """The mix that phase ``index`` draws from (its own, or ``default_mix``)."""
        return self.mixes[self.phases[index].mix or self.default_mix]


def _unknown_mix(field_path: str, name: str, known: list[str]) -> PydanticCustomError:
    return PydanticCustomError(
        "unknown_mix",
        "{field}: unknown mix '{name}'; known: {known}",
        {"field": field_path, "name": name, "known": str(known)},
    )


def _dotted(loc: Iterable[Any]) -> str:
    """A pydantic error location as a dotted path: ``("phases", 2, "mix")`` -> ``phases.2.mix``."""
    return ".".join(str(part) for part in loc)


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML file.

    Raises ``ValueError`` for a bad file, its message starting with the path as given and then
    the dotted field path of the first problem, e.g.
    ``ray_configs/workloads/x.yaml: phases.0.duration_s: Input should be greater than 0``.
    A problem that concerns the whole file (YAML syntax, not a mapping) has no field path; a
    cross-field problem (an unknown mix name) names its field inside the message. ``OSError``
    (e.g. a missing file) is not caught.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: invalid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of workload fields, got {type(data).__name__}")
    try:
        return Workload.model_validate(data)
    except ValidationError as err:
        raise ValueError(_validation_message(path, err)) from None


def _validation_message(path: Path, err: ValidationError) -> str:
    errors = err.errors()
    first = errors[0]
    where = _dotted(first["loc"])
    message = f"{path}: {where}: {first['msg']}" if where else f"{path}: {first['msg']}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return message


# --------------------------------------------------------------------------------------------------
# Arrivals
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrival:
    """One request to send ``t`` seconds after the workload starts, drawn from phase ``phase``'s mix."""

    t: float
    kind: str
    prompt: str
    max_new_tokens: int
    phase: int


def total_duration(workload: Workload) -> float:
    """Seconds from the first phase's start to the last phase's end (the sum of the durations)."""
    return sum(phase.duration_s for phase in workload.phases)


def phase_spans(workload: Workload) -> list[tuple[float, float]]:
    """``(start, end)`` workload times of each phase; phase ``i`` covers ``[start, end)``."""
    spans: list[tuple[float, float]] = []
    start = 0.0
    for phase in workload.phases:
        spans.append((start, start + phase.duration_s))
        start += phase.duration_s
    return spans


def rate_at(workload: Workload, t: float) -> float:
    """The planned arrival rate (requests/s) at workload time ``t``.

    ``t`` falls in the phase whose half-open interval ``[start, end)`` holds it, so at a boundary
    the later phase's ``rate_start`` applies. Before 0 and from :func:`total_duration` on the
    rate is 0 (nothing is planned there).
    """
    for phase, (start, end) in zip(workload.phases, phase_spans(workload)):
        if start <= t < end:
            return phase.rate(t - start)
    return 0.0


def arrivals(workload: Workload) -> list[Arrival]:
    """All arrivals of the workload, sorted by ``t``; the same workload (and seed) gives the same list.

    Per phase, by thinning: candidate gaps are exponential at the phase's highest rate ``r_max``,
    a candidate at ``t`` is kept with probability ``rate_at(t) / r_max``, and a kept one draws its
    kind by weight from the phase's mix. A phase whose rate is 0 throughout has no arrivals.
    """
    rng = random.Random(workload.seed)
    out: list[Arrival] = []
    for index, (phase, (start, end)) in enumerate(zip(workload.phases, phase_spans(workload))):
        out.extend(_phase_arrivals(rng, phase, index, start, end, workload.phase_mix(index)))
    return out


def _phase_arrivals(rng: random.Random, phase: Phase, index: int, start: float, end: float, mix: Mix) -> list[Arrival]:
    r_max = phase.max_rate
    if r_max <= 0:
        return []
    weights = [kind.weight for kind in mix.prompts]
    out: list[Arrival] = []
    t = start
    while True:
        t += rng.expovariate(r_max)
        if t >= end:
            return out
        if rng.random() * r_max < phase.rate(t - start):
            kind = rng.choices(mix.prompts, weights=weights)[0]
            out.append(
                Arrival(t=t, kind=kind.name, prompt=kind.prompt, max_new_tokens=kind.max_new_tokens, phase=index)
            )


# --------------------------------------------------------------------------------------------------
# Timeline
# --------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """The cluster at one instant of an experiment (one row of a timeline).

    ``t``: seconds since the workload started. ``request_rate``: arrivals per second over the last
    sample interval. ``in_flight``: requests sent and not yet finished. ``completed``: requests
    finished so far (cumulative). ``pending_verify_rows`` / ``draft_rows`` / ``kv_bytes_used``: the
    autoscaling signals summed over replicas (see :mod:`eyas.autoscale.policy`). ``replicas``:
    deployment name -> running replicas. ``nodes``: node type -> alive nodes. ``p50_latency_s`` /
    ``p99_latency_s``: end-to-end latency percentiles over the requests that finished in a trailing
    window (None when none did). ``tokens_per_s``: output tokens of the requests that finished in
    the last interval, divided by the interval. ``asked_replicas``: deployment -> running + starting
    replicas (a replica counts from the moment Serve is asked for it). ``asked_nodes``: node type ->
    alive nodes plus those Ray's autoscaler is launching (empty when its status is not readable).
    """

    t: float
    request_rate: float
    in_flight: int
    completed: int
    pending_verify_rows: float
    draft_rows: float
    kv_bytes_used: float
    replicas: dict[str, int]
    nodes: dict[str, int]
    p50_latency_s: float | None
    p99_latency_s: float | None
    tokens_per_s: float
    asked_replicas: dict[str, int] = field(default_factory=dict)  # running + starting (what was asked for)
    asked_nodes: dict[str, int] = field(default_factory=dict)  # alive + launching, per type (Ray's autoscaler)

    @property
    def total_nodes(self) -> int:
        """Alive nodes of all types together."""
        return sum(self.nodes.values())


class Timeline:
    """Samples and events of one experiment run, in the order they were added.

    An event is a dict with at least ``t`` (seconds since start) and ``kind`` (e.g.
    ``"burst_start"``), plus any extra keys given to :meth:`mark`.
    """

    def __init__(self, workload_name: str, meta: dict | None = None) -> None:
        self.workload_name = workload_name
        self.meta: dict = dict(meta or {})
        self.samples: list[Sample] = []
        self.events: list[dict] = []

    def add(self, sample: Sample) -> None:
        """Append a sample."""
        self.samples.append(sample)

    def mark(self, t: float, kind: str, **info: Any) -> None:
        """Record an event of ``kind`` at time ``t``; ``info`` keys are stored alongside."""
        self.events.append({"t": t, "kind": kind, **info})

    def to_json(self) -> dict:
        """A JSON-ready dict: ``workload``, ``meta``, ``samples``, ``events`` and ``summary``."""
        return {
            "workload": self.workload_name,
            "meta": self.meta,
            "samples": [asdict(s) for s in self.samples],
            "events": list(self.events),
            "summary": summary(self),
        }

    def write_json(self, path: str | Path) -> None:
        """Write :meth:`to_json` to ``path`` (parent folders are created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Timeline:
        """Rebuild a timeline from :meth:`to_json` output (its ``summary`` is ignored: it is derived)."""
        timeline = cls(data["workload"], data.get("meta"))
        for raw in data.get("samples", []):
            timeline.add(Sample(**raw))
        timeline.events = [dict(event) for event in data.get("events", [])]
        return timeline


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (``0 <= q <= 100``) of ``values`` by linear interpolation; None if empty.

    Linear interpolation between closest ranks (numpy's default): with the values sorted as
    ``v[0..n-1]``, the position is ``p = q / 100 * (n - 1)`` and the result is
    ``v[floor(p)] + (v[ceil(p)] - v[floor(p)]) * (p - floor(p))``. Example: the 50th percentile of
    ``[1, 2, 3, 4]`` is 2.5, the 99th of ``[0, 10]`` is 9.9.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = list(values)
    return sim.percentile(ordered, q) if ordered else None


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------


def burst_start_time(timeline: Timeline) -> float | None:
    """``t`` of the first event of kind ``"burst_start"``, or None when there is none."""
    for event in timeline.events:
        if event.get("kind") == BURST_START:
            return float(event["t"])
    return None


def _state_at(samples: list[Sample], t: float) -> Sample:
    """The sample in force at ``t``: the last one at or before ``t`` (the first one if all are later)."""
    before = [s for s in samples if s.t <= t]
    return before[-1] if before else samples[0]


def _first_rise(samples: list[Sample], burst_t: float, value: Any) -> float | None:
    """Seconds from ``burst_t`` to the first sample at/after it whose ``value(sample)`` exceeds the
    value in force at ``burst_t``; None if it never does."""
    baseline = value(_state_at(samples, burst_t))
    for s in samples:
        if s.t >= burst_t and value(s) > baseline:
            return s.t - burst_t
    return None


def _deployments(samples: list[Sample]) -> list[str]:
    return sorted({name for s in samples for name in s.replicas})


def _node_types(samples: list[Sample]) -> list[str]:
    return sorted({name for s in samples for name in s.nodes})


def summary(timeline: Timeline, burst_t: float | None = None) -> dict:
    """The headline numbers of a run.

    ``burst_t`` (seconds) defaults to the first ``"burst_start"`` event's ``t``. A deployment or node
    type missing from a sample counts as 0 there. Keys:

    * ``burst_t``: the burst time used (None when there is none).
    * ``time_to_added_capacity_s``: ``{"replicas": {deployment: s}, "nodes": s}``, where ``s`` is
      the first sample time at/after ``burst_t`` at which the deployment's replicas (or the total
      alive nodes) exceed their value in force at ``burst_t`` (that of the last sample at or before
      ``burst_t``), minus ``burst_t``; None if they never do, or when there is no burst.
    * ``p99_burst_s``: the highest ``p99_latency_s`` over samples with
      ``burst_t <= t <= burst_t + 60`` (None when there is no burst or no latency there).
    * ``p99_steady_s``: the median ``p99_latency_s`` over samples before ``burst_t`` that have one
      (i.e. some request finished in their window); over all samples when there is no burst.
    * ``peak_replicas`` / ``final_replicas``: deployment -> highest / last replica count.
    * ``peak_nodes`` / ``final_nodes``: node type -> highest / last alive count;
      ``peak_nodes_total``: the highest total alive nodes.
    * ``completed``: the last sample's cumulative completed count.

    Worked example: samples at t = 0..10 s with 1 replica until t = 6 and 2 from t = 7, and a burst
    at t = 5: the replicas in force at 5 are 1, the first sample at/after 5 with more is t = 7, so
    ``time_to_added_capacity_s["replicas"][deployment] = 7 - 5 = 2.0``.
    """
    if burst_t is None:
        burst_t = burst_start_time(timeline)
    samples = sorted(timeline.samples, key=lambda s: s.t)
    deployments = _deployments(samples)
    node_types = _node_types(samples)
    last = samples[-1] if samples else None
    return {
        "burst_t": burst_t,
        "time_to_added_capacity_s": _time_to_added_capacity(samples, burst_t, deployments),
        "p99_burst_s": _p99_burst(samples, burst_t),
        "p99_steady_s": _p99_steady(samples, burst_t),
        "peak_replicas": {d: max(s.replicas.get(d, 0) for s in samples) for d in deployments},
        "peak_nodes": {n: max(s.nodes.get(n, 0) for s in samples) for n in node_types},
        "peak_nodes_total": max((s.total_nodes for s in samples), default=0),
        "final_replicas": {d: last.replicas.get(d, 0) for d in deployments} if last else {},
        "final_nodes": {n: last.nodes.get(n, 0) for n in node_types} if last else {},
        "completed": last.completed if last else 0,
    }


def _time_to_added_capacity(samples: list[Sample], burst_t: float | None, deployments: list[str]) -> dict:
    if burst_t is None or not samples:
        return {"replicas": {d: None for d in deployments}, "nodes": None}
    replicas = {d: _first_rise(samples, burst_t, lambda s, d=d: s.replicas.get(d, 0)) for d in deployments}
    return {"replicas": replicas, "nodes": _first_rise(samples, burst_t, lambda s: s.total_nodes)}


def _p99_burst(samples: list[Sample], burst_t: float | None) -> float | None:
    if burst_t is None:
        return None
    window = [
        s.p99_latency_s for s in samples if burst_t <= s.t <= burst_t + BURST_WINDOW_S and s.p99_latency_s is not None
    ]
    return max(window, default=None)


def _p99_steady(samples: list[Sample], burst_t: float | None) -> float | None:
    steady = [s.p99_latency_s for s in samples if (burst_t is None or s.t < burst_t) and s.p99_latency_s is not None]
    return statistics.median(steady) if steady else None


# --------------------------------------------------------------------------------------------------
# What happened: the scaling report
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingEvents:
    """When capacity was asked for, ran and was given back, relative to a load window ``[start, end)``.

    From a series of ``(t, asked, running)`` points of one deployment (or node type), with
    ``initial`` the count before the load. ``asked_at`` / ``running_at``: the first ``t`` at which
    ``asked`` / ``running`` exceed ``initial`` (None: never); ``back_at``: the first ``t`` after both
    ``running_at`` and the window's end at which ``asked`` is back at ``initial`` or below (None:
    never, or nothing was added); ``peak``: the most asked for. Times are absolute (workload time).
    """

    asked_at: float | None
    running_at: float | None
    back_at: float | None
    peak: int


def scaling_events(points: list[tuple[float, int, int]], initial: int, end: float) -> ScalingEvents:
    """See :class:`ScalingEvents`. Worked example: initial 1, points (0,1,1) (5,2,1) (9,2,2) (20,1,1),
    window end 12 -> asked at 5, running at 9, back at 20, peak 2."""
    asked_at = next((t for t, asked, _ in points if asked > initial), None)
    running_at = next((t for t, _, run in points if run > initial), None)
    back_at = None
    if running_at is not None:
        back_at = next((t for t, asked, _ in points if t >= max(running_at, end) and asked <= initial), None)
    return ScalingEvents(asked_at, running_at, back_at, max((a for _, a, _ in points), default=initial))


def load_window(workload: Workload) -> tuple[float, float]:
    """The span the load should scale up in: the phase labelled ``burst_start`` when there is one,
    else all the phases (a load that grows in rate or in work per request)."""
    spans = phase_spans(workload)
    for (start, end), phase in zip(spans, workload.phases):
        if phase.label == BURST_START:
            return start, end
    return 0.0, total_duration(workload)


def scaling_report(
    timeline: Timeline,
    workload: Workload,
    *,
    deployment: str,
    node_type: str | None,
    rows_per_replica: float,
    errors: int = 0,
    incorrect: int = 0,
) -> dict:
    """What the autoscaler did and whether a scale-up experiment succeeded, and if not, why.

    ``workload`` is the one replayed (rates in requests/s). The signal is the target policy's:
    the pending verify rows of all target replicas over ``rows_per_replica`` (its
    ``target_verify_rows_per_replica``) is the replicas it asks for; the load **crossed** the
    threshold at the first sample in the load window (:func:`load_window`) whose rows exceed
    ``rows_per_replica`` x the replicas running then. (The policy acts on Serve's window average
    and after its upscale delay, so a brief crossing need not add a replica.)

    A run with ``workload.expect_scaling`` is a **success** when it had no error and no incorrect
    answer, a target replica was asked for no earlier than the window's start, ran before its end,
    and the count was back at its start by the end of the run. Otherwise ``why`` names the first
    reason in this order: errors; scaled before the load window (the quieter load alone crossed the
    threshold); thresholds not crossed; crossed but nothing asked for (the policy's delay and window
    outlasted the crossing); asked for but never running (capacity unavailable: no node, or
    ``max_replicas`` reached); running only after the window ended (start-up longer than the burst);
    not given back by the end of the run.
    """
    start, end = load_window(workload)
    samples = sorted(timeline.samples, key=lambda s: s.t)
    if not samples:
        return {"success": False, "why": "no samples were taken", "window": [start, end]}
    initial = samples[0].asked_replicas.get(deployment, samples[0].replicas.get(deployment, 0))
    points = [
        (s.t, s.asked_replicas.get(deployment, s.replicas.get(deployment, 0)), s.replicas.get(deployment, 0))
        for s in samples
    ]
    replica = scaling_events(points, initial, end)
    node = None
    if node_type is not None:
        first = samples[0].nodes.get(node_type, 0)
        node_points = [
            (s.t, s.asked_nodes.get(node_type, s.nodes.get(node_type, 0)), s.nodes.get(node_type, 0)) for s in samples
        ]
        node = scaling_events(node_points, first, end)
    in_window = [s for s in samples if start <= s.t < end]
    per_replica = [s.pending_verify_rows / max(s.replicas.get(deployment, 0), 1) for s in in_window]
    crossed_at = next((s.t for s, r in zip(in_window, per_replica) if r > rows_per_replica), None)
    why = None
    if errors or incorrect:
        why = f"{errors} errors and {incorrect} incorrect answers"
    elif replica.asked_at is not None and replica.asked_at < start:
        why = f"scaled before the load window: a replica was asked for at {replica.asked_at:.1f} s, the window starts at {start:.1f} s"
    elif replica.asked_at is None and crossed_at is None:
        why = (
            f"thresholds not crossed: pending verify rows per target replica peaked at {max(per_replica, default=0):.0f}, "
            f"under the policy's {rows_per_replica:g}"
        )
    elif replica.asked_at is None:
        why = f"crossed the threshold at {crossed_at:.1f} s but no replica was asked for (the policy's delay and window outlasted the load)"
    elif replica.running_at is None:
        why = f"capacity unavailable: a replica was asked for at {replica.asked_at:.1f} s and never ran (no node, or max_replicas)"
    elif replica.running_at >= end:
        why = f"too slow: the replica asked for at {replica.asked_at:.1f} s ran at {replica.running_at:.1f} s, after the load ended at {end:.1f} s"
    elif replica.back_at is None:
        why = "the added capacity was not given back by the end of the run"
    return {
        "expected": workload.expect_scaling,
        "success": workload.expect_scaling and why is None,
        "why": why if workload.expect_scaling else "not a scale-up experiment (expect_scaling: false)",
        "window": [start, end],
        "initial_replicas": initial,
        "threshold": {
            "rows_per_replica": rows_per_replica,
            "peak_rows_per_replica": max(per_replica, default=0.0),
            "crossed_at": crossed_at,
        },
        "replica": asdict(replica),
        "node": asdict(node) if node is not None else None,
        "time_to_added_capacity_s": None if replica.running_at is None else replica.running_at - start,
        "scale_down_s": None if replica.back_at is None else replica.back_at - end,
    }


# --------------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------------


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def plot_timeline(timeline: Timeline, path: str | Path, workload: Workload | None = None) -> None:
    """Save a PNG of the timeline: five stacked panels sharing the time axis.

    1. request rate (measured; plus the planned :func:`rate_at` curve when ``workload`` is given)
       and in-flight requests (right axis);
    2. pending verify rows and draft rows;
    3. replicas per deployment running (step lines) and asked for (dotted);
    4. alive nodes per type (step lines) and asked for (dotted: alive plus launching);
    5. p50 / p99 latency (left axis; the workload's ``latency_target_s`` as a dotted line when
       given) and tokens/s (right axis).

    Every event is a vertical dashed line on every panel, labelled with its kind on the top panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = sorted(timeline.samples, key=lambda s: s.t)
    ts = [s.t for s in samples]
    fig, axes = plt.subplots(5, 1, sharex=True, figsize=(13, 13))
    _plot_load(axes[0], samples, ts, workload)
    _plot_work(axes[1], samples, ts)
    _plot_counts(axes[2], ts, [s.replicas for s in samples], "replicas", [s.asked_replicas for s in samples])
    _plot_counts(axes[3], ts, [s.nodes for s in samples], "nodes", [s.asked_nodes for s in samples])
    _plot_latency(axes[4], samples, ts, workload)
    _plot_events(axes, timeline.events)
    axes[-1].set_xlabel("time since start (s)")
    fig.suptitle(f"autoscaling timeline: {timeline.workload_name}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def _plot_load(ax, samples: list[Sample], ts: list[float], workload: Workload | None) -> None:
    ax.plot(ts, [s.request_rate for s in samples], color="tab:blue", label="request rate")
    if workload is not None:
        end = total_duration(workload)
        grid = [end * i / 400 for i in range(400)]
        ax.plot(grid, [rate_at(workload, t) for t in grid], color="tab:blue", linestyle=":", label="planned rate")
    ax.set_ylabel("requests/s")
    right = ax.twinx()
    right.step(ts, [s.in_flight for s in samples], where="post", color="tab:orange", label="in flight")
    right.set_ylabel("in flight")
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    _legend(ax, right)


def _plot_work(ax, samples: list[Sample], ts: list[float]) -> None:
    ax.plot(ts, [s.pending_verify_rows for s in samples], label="pending verify rows")
    ax.plot(ts, [s.draft_rows for s in samples], label="draft rows")
    ax.set_ylabel("rows")
    ax.set_ylim(bottom=0)
    _legend(ax)


def _plot_counts(
    ax, ts: list[float], counts: list[dict[str, int]], ylabel: str, asked: list[dict[str, int]] | None = None
) -> None:
    names = sorted({name for c in counts for name in c})
    for name in names:
        (line,) = ax.step(ts, [c.get(name, 0) for c in counts], where="post", label=name)
        if asked and any(name in a for a in asked):
            values = [a.get(name, c.get(name, 0)) for a, c in zip(asked, counts)]
            ax.step(ts, values, where="post", color=line.get_color(), linestyle=":", label=f"{name} asked for")
    ax.set_ylabel(ylabel)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(bottom=0)
    if names:
        _legend(ax)


def _plot_latency(ax, samples: list[Sample], ts: list[float], workload: Workload | None) -> None:
    ax.plot(ts, [_or_nan(s.p50_latency_s) for s in samples], label="p50 latency")
    ax.plot(ts, [_or_nan(s.p99_latency_s) for s in samples], label="p99 latency")
    if workload is not None and workload.latency_target_s is not None:
        ax.axhline(workload.latency_target_s, color="gray", linestyle=":", label="latency target")
    ax.set_ylabel("latency (s)")
    right = ax.twinx()
    right.plot(ts, [s.tokens_per_s for s in samples], color="tab:green", label="tokens/s")
    right.set_ylabel("tokens/s")
    ax.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    _legend(ax, right)


def _plot_events(axes, events: list[dict]) -> None:
    for event in events:
        for ax in axes:
            ax.axvline(event["t"], color="gray", linestyle="--", linewidth=0.8)
        axes[0].annotate(
            str(event.get("kind", "")),
            xy=(event["t"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize="x-small",
            color="gray",
        )


def _legend(left, right=None) -> None:
    """One legend for a panel (and its twin axis), outside the plot on the right so it hides no data."""
    handles, labels = left.get_legend_handles_labels()
    if right is not None:
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    left.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.08, 1.0), fontsize="small", borderaxespad=0.0)
