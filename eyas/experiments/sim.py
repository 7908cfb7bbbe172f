"""A discrete-event simulator of a pool of speculative-decoding replicas, for capacity planning.

Pure: the standard library only (no Ray, no torch, no model). Deterministic given a seed.

Terms
-----
request
    Arrives at ``arrival_s``, has a prompt of ``prompt_len`` tokens and must emit ``output_len``
    tokens. Its *latency* is ``finish_s - arrival_s``; its *time to first token* (TTFT) is the end of
    its first round minus ``arrival_s``.
replica
    One target (plus its drafter) serving requests in batched *rounds*. A round verifies one
    draft per batched request; the requests join and leave the batch only at round boundaries
    (continuous batching). At most ``max_batch`` requests are in a replica's batch; the rest of the
    requests routed to it wait in its queue.
tau (``tokens_per_round``)
    The mean tokens a request gains per round, accepted draft tokens plus the bonus token
    (1.0 for plain decoding). A request needs ``rounds = ceil(output_len / tau)`` rounds: ``tau``
    tokens in each of them but the last, which emits the remainder.
rows
    Verify rows a request puts in a round: ``rows_per_request`` (1 for plain decoding, 17 for a
    16-node tree plus its root), plus ``prompt_len * prefill_rows_per_prompt_token`` in its first
    round. A round of a batch with ``R`` total rows and ``D`` total draft rows takes
    ``draft_ms(D) + verify_ms(R)`` milliseconds (drafter and target run one after the other).
utilisation
    Busy time (a round in progress) over serving time (ready and not yet stopped), per replica.

Routing and scaling mirror the EyasTarget deployment (eyas/serve/deployments.py): a request is routed on arrival to
the ready, non-draining replica with the fewest requests (queued + running; ties to the one that has
served fewest, then the oldest) and stays there, so a replica that starts later takes only new
arrivals. With no ready replica the request waits in a pool queue that the next ready replica takes
over. An optional autoscaling policy is called every ``control_interval_s``: growing first un-drains
draining replicas and then launches new ones, which serve after ``startup_delay_s``; shrinking first
cancels starting replicas, then drains the newest serving ones. A draining replica takes no new
request, finishes every request already routed to it, then stops: no request is ever dropped.

Worked example (see ``tests/experiments/test_sim.py``): 3 requests at t=0, one replica, ``max_batch=2``,
2 rounds each, 100 ms rounds -> requests 0 and 1 run rounds [0, 0.1] and [0.1, 0.2] and finish at
0.2 s; request 2 waits for a free slot and runs [0.2, 0.3], [0.3, 0.4]: TTFT 0.3 s, latency 0.4 s.

Event queue: a heap of ``(time_s, kind, seq, payload)``; at equal times the kinds run in the order
round end, replica ready, arrival, control, round start, sample, so that every request that arrives
at the instant a round ends joins the next round.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

MS_PER_S = 1000.0
S_PER_HOUR = 3600.0
ROUTER_SLACK = 4  # rebuild the router heap when it holds this many entries per active replica
ROUNDS_EPS = 1e-9  # output_len / tau within this of an integer counts as that integer (float noise)
NOT_ROUTED = -1  # RequestRecord.replica of a request never routed (the run ended first)

# event kinds, in the order they run at equal times
_ROUND_END, _READY, _ARRIVAL, _CONTROL, _ROUND_START, _SAMPLE = range(6)

# replica states
STARTING, ACTIVE, DRAINING, STOPPED = "starting", "active", "draining", "stopped"


# ----------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Curve:
    """Milliseconds as a piecewise-linear function of rows, given as knots ``{rows: ms}``.

    Between knots: linear interpolation. Below the first knot: the first knot's ms. Past the last
    knot: the last segment's slope, floored at 0 (never decreasing). One knot: constant.

    Example: ``Curve.from_points({1: 10.0, 5: 30.0})``: ``c(3) == 20.0``, ``c(9) == 50.0``,
    ``c(0) == 10.0``.
    """

    rows: tuple[float, ...]  # increasing knot positions (total rows in a round)
    ms: tuple[float, ...]  # milliseconds at each knot, >= 0

    def __post_init__(self):
        if not self.rows or len(self.rows) != len(self.ms):
            raise ValueError("Curve: rows and ms must be non-empty and of equal length")
        if any(b <= a for a, b in zip(self.rows, self.rows[1:])) or self.rows[0] < 0:
            raise ValueError(f"Curve.rows: {self.rows} must increase from >= 0")
        if any(not (m >= 0) for m in self.ms):
            raise ValueError(f"Curve.ms: {self.ms} must be >= 0")

    @classmethod
    def from_points(cls, points: Mapping[float, float]) -> Curve:
        keys = sorted(points)
        return cls(tuple(float(k) for k in keys), tuple(float(points[k]) for k in keys))

    @classmethod
    def zero(cls) -> Curve:
        """0 ms at any row count (e.g. no drafter)."""
        return cls((0.0,), (0.0,))

    def __call__(self, rows: float) -> float:
        r, m = self.rows, self.ms
        if rows <= r[0]:
            return m[0]
        i = bisect.bisect_left(r, rows)
        if i >= len(r):  # past the last knot
            if len(r) == 1:
                return m[0]
            slope = max((m[-1] - m[-2]) / (r[-1] - r[-2]), 0.0)
            return m[-1] + slope * (rows - r[-1])
        if r[i] == rows:
            return m[i]
        return m[i - 1] + (m[i] - m[i - 1]) * (rows - r[i - 1]) / (r[i] - r[i - 1])


Lengths = int | tuple[tuple[int, float], ...]  # a fixed length, or (length, probability) pairs


def _check_lengths(name: str, v) -> Lengths:
    if isinstance(v, int):
        if v < 1:
            raise ValueError(f"{name}: {v} must be >= 1")
        return v
    pairs = tuple((int(n), float(p)) for n, p in v)
    if not pairs or any(n < 1 or p < 0 for n, p in pairs) or not sum(p for _, p in pairs) > 0:
        raise ValueError(f"{name}: {v} must be (length >= 1, probability >= 0) pairs with positive total")
    return pairs


def _draw_lengths(spec: Lengths, n: int, rng: random.Random) -> list[int]:
    if isinstance(spec, int):
        return [spec] * n
    return rng.choices([k for k, _ in spec], weights=[p for _, p in spec], k=n)  # weights normalised


@dataclass(frozen=True)
class Arrivals:
    """When requests arrive. Build with :meth:`poisson`, :meth:`deterministic` or :meth:`explicit`.

    ``poisson``: exponential gaps of mean ``1 / rate_per_s``, the first at one gap after 0.
    ``deterministic``: one request every ``1 / rate_per_s`` s, the first at 0.
    Both stop after ``count`` requests or at ``duration_s`` (arrivals at times < duration_s).
    ``explicit``: the given times (sorted).
    """

    kind: str  # "poisson" | "deterministic" | "explicit"
    rate_per_s: float = 0.0  # requests per second
    duration_s: float | None = None
    count: int | None = None
    times_s: tuple[float, ...] = ()  # explicit arrival times, seconds

    def __post_init__(self):
        if self.kind not in ("poisson", "deterministic", "explicit"):
            raise ValueError(f"Arrivals.kind: {self.kind!r}")
        if self.kind != "explicit":
            if not self.rate_per_s > 0:
                raise ValueError(f"Arrivals.rate_per_s: {self.rate_per_s} must be > 0")
            if (self.duration_s is None) == (self.count is None):
                raise ValueError("Arrivals: give exactly one of duration_s and count")
        elif any(t < 0 for t in self.times_s):
            raise ValueError("Arrivals.times_s: must be >= 0")

    @classmethod
    def poisson(cls, rate_per_s: float, *, duration_s: float | None = None, count: int | None = None) -> Arrivals:
        return cls("poisson", rate_per_s, duration_s, count)

    @classmethod
    def deterministic(cls, rate_per_s: float, *, duration_s: float | None = None, count: int | None = None) -> Arrivals:
        return cls("deterministic", rate_per_s, duration_s, count)

    @classmethod
    def explicit(cls, times_s: Sequence[float]) -> Arrivals:
        return cls("explicit", times_s=tuple(sorted(float(t) for t in times_s)))

    def sample(self, rng: random.Random) -> list[float]:
        """Arrival times in seconds, increasing."""
        if self.kind == "explicit":
            return list(self.times_s)
        limit = math.inf if self.duration_s is None else self.duration_s
        count = math.inf if self.count is None else self.count
        out: list[float] = []
        if self.kind == "deterministic":
            gap = 1.0 / self.rate_per_s
            while len(out) < count and len(out) * gap < limit:
                out.append(len(out) * gap)
            return out
        t = rng.expovariate(self.rate_per_s)
        while len(out) < count and t < limit:
            out.append(t)
            t += rng.expovariate(self.rate_per_s)
        return out


@dataclass(frozen=True)
class Workload:
    """The requests: arrival process, output and prompt lengths (tokens; fixed or (length, prob) pairs)."""

    arrivals: Arrivals
    output_len: Lengths = 128
    prompt_len: Lengths = 128

    def __post_init__(self):
        object.__setattr__(self, "output_len", _check_lengths("Workload.output_len", self.output_len))
        object.__setattr__(self, "prompt_len", _check_lengths("Workload.prompt_len", self.prompt_len))


@dataclass(frozen=True)
class ReplicaModel:
    """One replica's round cost and batching. Times in ms; see the module docstring for terms."""

    verify_ms: Curve  # ms of a verify of R total rows
    tokens_per_round: float = 1.0  # tau: mean tokens per request per round, incl. the bonus token
    rows_per_request: float = 1.0  # verify rows per batched request per round
    max_batch: int = 1  # requests in one round
    draft_ms: Curve = Curve.zero()  # ms of a drafter pass of D total draft rows
    draft_rows_per_request: float = 0.0  # draft rows per batched request per round
    prefill_rows_per_prompt_token: float = 0.0  # extra verify rows per prompt token in a request's first round
    # None: every replica has hardware of its own. A number H: all replicas share one host that runs H
    # rounds at once at full speed, so a round that starts while B replicas (itself included) are in a
    # round takes max(1, B / H) times as long (Ray's fake multi-node cluster: every node is a process
    # on the same machine). Example: H = 2, three replicas busy -> every new round takes 1.5x.
    host_replicas: float | None = None
    # on a shared host, a starting replica (loading its model, timing its latency curve) counts as
    # this fraction of a round in flight (0: starting costs the host nothing; 1: as much as serving)
    load_share: float = 0.0

    def __post_init__(self):
        if self.host_replicas is not None and not self.host_replicas > 0:
            raise ValueError(f"ReplicaModel.host_replicas: {self.host_replicas} must be > 0 (or None)")
        if not self.tokens_per_round >= 1.0:
            raise ValueError(f"ReplicaModel.tokens_per_round: {self.tokens_per_round} must be >= 1 (bonus token)")
        if self.max_batch < 1:
            raise ValueError(f"ReplicaModel.max_batch: {self.max_batch} must be >= 1")
        if not 0.0 <= self.load_share <= 1.0:
            raise ValueError(f"ReplicaModel.load_share: {self.load_share} must be in [0, 1]")
        if self.rows_per_request < 0 or self.draft_rows_per_request < 0 or self.prefill_rows_per_prompt_token < 0:
            raise ValueError("ReplicaModel: row counts must be >= 0")

    def rounds(self, output_len: int) -> int:
        """Rounds to emit ``output_len`` tokens: ``ceil(output_len / tau)``, e.g. 10 tokens at tau 3 -> 4."""
        return max(1, math.ceil(output_len / self.tokens_per_round - ROUNDS_EPS))

    def round_ms(self, batch: int, extra_rows: float = 0.0) -> float:
        """Milliseconds of one round of ``batch`` requests plus ``extra_rows`` prefill rows."""
        return self.draft_ms(batch * self.draft_rows_per_request) + self.verify_ms(
            batch * self.rows_per_request + extra_rows
        )


@dataclass(frozen=True)
class ScalingState:
    """What an autoscaling policy sees at a control tick.

    ``replicas`` counts starting + ready non-draining replicas (what the last decision asked for);
    ``queued`` counts requests routed but not yet in a batch (plus any waiting for a first ready
    replica); ``running`` counts requests in a batch; ``utilisation`` and ``arrivals_per_s`` are
    over the last control interval.
    """

    time_s: float
    replicas: int
    ready: int
    starting: int
    draining: int
    queued: int
    running: int
    utilisation: float
    arrivals_per_s: float


Policy = Callable[[ScalingState], int]  # state -> desired replicas (>= 0)


@dataclass(frozen=True)
class Autoscaling:
    policy: Policy
    control_interval_s: float = 10.0  # seconds of simulated time between policy calls (first at this time)
    startup_delay_s: float = 60.0  # seconds from launch until a new replica serves

    def __post_init__(self):
        if not self.control_interval_s > 0 or self.startup_delay_s < 0:
            raise ValueError("Autoscaling: control_interval_s must be > 0 and startup_delay_s >= 0")


@dataclass(frozen=True)
class ClusterModel:
    """The pool: ``replicas`` ready at t=0, ``node_size`` replicas per node, price per replica-hour."""

    replicas: int = 1
    node_size: int = 1
    cost_per_replica_hour: float = 0.0
    autoscaling: Autoscaling | None = None

    def __post_init__(self):
        if self.replicas < 0 or self.node_size < 1 or self.cost_per_replica_hour < 0:
            raise ValueError("ClusterModel: replicas >= 0, node_size >= 1, cost_per_replica_hour >= 0")
        if self.replicas == 0 and self.autoscaling is None:
            raise ValueError("ClusterModel: 0 replicas and no autoscaling would never serve")


# ---------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class RequestRecord:
    """One finished request. Times in seconds of simulated time."""

    arrival_s: float
    prompt_len: int
    output_len: int
    rounds: int
    replica: int  # the id of the replica that served it (0 = the first; NOT_ROUTED: none)
    first_token_s: float  # end of its first round
    finish_s: float  # end of its last round

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(frozen=True)
class TimelinePoint:
    """The pool at ``time_s`` (after every event at that time); ``tokens_per_s`` over the last interval."""

    time_s: float
    replicas: int  # alive: starting + ready + draining (all billed)
    ready: int  # serving non-draining
    starting: int
    draining: int
    nodes: int  # ceil(replicas / node_size)
    queued: int
    running: int
    tokens_per_s: float


@dataclass(frozen=True)
class SimResult:
    """The outcome of :func:`simulate`. Times in seconds; percentiles interpolate linearly.

    ``throughput_tokens_per_s`` = output tokens / makespan, where makespan = last finish - first
    arrival. ``mean_utilisation`` = busy / serving replica-seconds. ``replica_seconds`` is billed
    time, launch (t=0 for the initial replicas) to stop or ``end_s``, starting time included;
    ``cost = replica_seconds / 3600 * cost_per_replica_hour``. Latency statistics and ``total_tokens``
    cover finished requests, TTFT statistics the requests with a first token; ``peak_replicas`` is
    the most replicas alive at once.
    """

    requests: tuple[RequestRecord, ...]  # in arrival order
    latencies_s: tuple[float, ...]  # per request, arrival order
    ttft_s: tuple[float, ...]  # per request, arrival order
    unfinished: int  # requests not finished by horizon_s (their times are NaN)
    mean_latency_s: float
    p50_latency_s: float
    p99_latency_s: float
    p50_ttft_s: float
    p99_ttft_s: float
    total_tokens: int
    makespan_s: float
    throughput_tokens_per_s: float
    mean_utilisation: float
    busy_replica_seconds: float
    serving_replica_seconds: float
    replica_seconds: float
    cost: float
    peak_replicas: int
    peak_nodes: int
    end_s: float  # the last simulated instant
    timeline: tuple[TimelinePoint, ...]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default); NaN for no values. E.g. ``percentile([1, 2, 3, 4], 50) == 2.5``."""
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# --------------------------------------------------------------------------------------- internals


class _Req:
    __slots__ = (
        "arrival",
        "prompt_len",
        "output_len",
        "rounds",
        "last_tokens",
        "prefill_rows",
        "replica",
        "first_token",
        "finish",
    )

    def __init__(self, arrival: float, prompt_len: int, output_len: int, model: ReplicaModel):
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.rounds = model.rounds(output_len)
        self.last_tokens = output_len - (self.rounds - 1) * model.tokens_per_round  # tokens of the last round
        self.prefill_rows = prompt_len * model.prefill_rows_per_prompt_token
        self.replica = NOT_ROUTED
        self.first_token = math.nan
        self.finish = math.nan


class _Replica:
    __slots__ = (
        "id",
        "status",
        "launch_s",
        "ready_s",
        "queue",
        "running",
        "load",
        "served",
        "round",
        "finish_at",
        "joiners",
        "busy",
        "round_start",
        "start_pending",
    )

    def __init__(self, rid: int, launch_s: float):
        self.id = rid
        self.status = STARTING
        self.launch_s = launch_s
        self.ready_s = math.nan
        self.queue: deque[_Req] = deque()  # routed, not yet in the batch
        self.running = 0  # requests in the batch
        self.load = 0  # queued + running
        self.served = 0  # requests ever routed here
        self.round = 0  # index of the next round to start
        self.finish_at: dict[int, list[_Req]] = {}  # round index -> requests whose last round it is
        self.joiners: list[_Req] = []  # requests in their first round now
        self.busy = False
        self.round_start = 0.0
        self.start_pending = False  # a round-start event is in the heap


class _Sim:
    """The mutable state of one run; :func:`simulate` is the public face."""

    def __init__(
        self,
        workload: Workload,
        model: ReplicaModel,
        cluster: ClusterModel,
        seed: int,
        sample_interval_s: float,
        until_s: float | None,
        horizon_s: float,
    ):
        rng = random.Random(seed)
        times = workload.arrivals.sample(rng)
        outs = _draw_lengths(workload.output_len, len(times), rng)
        prompts = _draw_lengths(workload.prompt_len, len(times), rng)
        self.reqs = [_Req(t, p, o, model) for t, p, o in zip(times, prompts, outs)]
        self.model = model
        self.cluster = cluster
        self.scaling = cluster.autoscaling
        self.sample_interval_s = sample_interval_s
        self.until_s = 0.0 if until_s is None else until_s
        self.horizon_s = horizon_s
        self.peak = 0

        self.heap: list[tuple] = []
        self.round_s: dict[int, float] = {}  # batch size -> seconds of a round without prefill rows
        self.seq = 0
        self.replicas: list[_Replica] = []  # every replica ever launched, by id
        # keyed by id (insertion order = launch order): a replica's start and stop are O(1), so a plan
        # that launches tens of thousands of replicas stays linear in its events
        self.alive: dict[int, _Replica] = {}  # not stopped
        self.active: dict[int, _Replica] = {}  # ready and not draining: the routing targets
        self.busy_count = 0  # alive replicas in a round
        self.router: list[tuple[int, int, int]] = []  # heap of (load, served, id) of active replicas; stale
        #                                               entries (an older load or served) are skipped lazily
        self.pool_queue: deque[_Req] = deque()  # arrived while no replica was ready
        self.queued = 0
        self.running = 0
        self.done = 0
        self.last_finish = 0.0
        self.tokens_since_sample = 0.0
        self.arrivals_since_control = 0
        # closed-interval accounting of stopped replicas and finished rounds (replica-seconds)
        self.busy_closed = 0.0
        self.serving_closed = 0.0
        self.billed_closed = 0.0
        self.last_control = (0.0, 0.0, 0.0)  # (time, busy_total, serving_total) at the last tick
        self.timeline: list[TimelinePoint] = []

    # -- event plumbing
    def push(self, t: float, kind: int, payload=None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, payload))

    def schedule_round(self, r: _Replica, t: float) -> None:
        """Start a round on idle ``r`` at ``t``, after every other event at ``t`` (a shortcut when none is left)."""
        if not r.busy and not r.start_pending:
            if self.heap and self.heap[0][0] <= t:
                r.start_pending = True
                self.push(t, _ROUND_START, r)
            else:  # nothing else happens at t: start now (saves a heap round trip per round)
                self.round_start(r, t)

    # -- replicas
    def launch(self, t: float, delay: float) -> _Replica:
        r = _Replica(len(self.replicas), t)
        self.replicas.append(r)
        self.alive[r.id] = r
        self.peak = max(self.peak, len(self.alive))
        self.push(t + delay, _READY, r)
        return r

    def ready(self, r: _Replica, t: float) -> None:
        if r.status != STARTING:  # cancelled while starting
            return
        r.status, r.ready_s = ACTIVE, t
        self.active[r.id] = r
        heapq.heappush(self.router, (r.load, r.served, r.id))
        waiting, self.pool_queue = self.pool_queue, deque()
        routed = {self.route(q, t, start=False) for q in waiting}
        for r2 in sorted(routed, key=lambda x: x.id):  # after routing them all, so that they share a round
            self.schedule_round(r2, t)

    def stop(self, r: _Replica, t: float) -> None:
        if r.status in (ACTIVE, DRAINING):
            self.serving_closed += t - r.ready_s
        r.status = STOPPED
        self.billed_closed += t - r.launch_s
        del self.alive[r.id]
        self.active.pop(r.id, None)  # its router entries go stale and are skipped

    def set_active(self) -> None:
        """Recompute the routing targets after a resize (once per control tick), and rebuild the router heap."""
        self.active = {r.id: r for r in self.alive.values() if r.status == ACTIVE}
        self.router = [(r.load, r.served, r.id) for r in self.active.values()]
        heapq.heapify(self.router)

    def offer(self, r: _Replica) -> None:
        """Tell the router that ``r``'s load changed."""
        if r.status == ACTIVE:
            heapq.heappush(self.router, (r.load, r.served, r.id))
            if len(self.router) > ROUTER_SLACK * (len(self.active) + 1):  # too many stale entries
                self.set_active()

    def least_loaded(self) -> _Replica:
        """The active replica with the fewest requests (ties: fewest served, then oldest); O(log N)."""
        while True:
            load, served, rid = self.router[0]
            r = self.replicas[rid]
            if r.status == ACTIVE and r.load == load and r.served == served:
                return r
            heapq.heappop(self.router)

    def resize(self, desired: int, t: float) -> None:
        """Grow: un-drain (oldest first), then launch. Shrink: cancel starting, then drain, newest first."""
        serving = [r for r in self.alive.values() if r.status in (STARTING, ACTIVE)]
        if desired > len(serving):
            need = desired - len(serving)
            for r in [r for r in self.alive.values() if r.status == DRAINING][:need]:
                r.status = ACTIVE
                need -= 1
            for _ in range(need):
                self.launch(t, self.scaling.startup_delay_s)
        else:
            for r in sorted(serving, key=lambda r: (r.status != STARTING, -r.id))[: len(serving) - desired]:
                if r.status == STARTING or r.load == 0:
                    self.stop(r, t)
                else:
                    r.status = DRAINING
        self.set_active()

    # -- requests
    def route(self, q: _Req, t: float, start: bool = True) -> _Replica | None:
        """Queue ``q`` on the least-loaded active replica (and start its round if idle and ``start``),
        or in the pool queue when none is active; returns the replica."""
        if not self.active:
            self.pool_queue.append(q)
            return None
        r = self.least_loaded()
        q.replica = r.id
        r.queue.append(q)
        r.load += 1
        r.served += 1
        heapq.heapreplace(self.router, (r.load, r.served, r.id))  # r's entry is the top
        if start:
            self.schedule_round(r, t)
        return r

    def round_start(self, r: _Replica, t: float) -> None:
        r.start_pending = False
        if r.status == STOPPED or r.busy:
            return
        m = self.model
        admit = min(m.max_batch - r.running, len(r.queue))
        extra_rows = 0.0
        joiners = [r.queue.popleft() for _ in range(admit)]
        for q in joiners:
            extra_rows += q.prefill_rows
            r.finish_at.setdefault(r.round + q.rounds - 1, []).append(q)
        r.joiners = joiners
        r.running += admit
        self.running += admit
        self.queued -= admit
        if r.running == 0:
            if r.status == DRAINING:
                self.stop(r, t)
            return
        r.busy = True
        self.busy_count += 1
        r.round_start = t
        if extra_rows:
            dur = m.round_ms(r.running, extra_rows) / MS_PER_S
        else:
            dur = self.round_s.get(r.running)
            if dur is None:
                dur = self.round_s[r.running] = m.round_ms(r.running) / MS_PER_S
        if m.host_replicas is not None:  # a shared host: the rounds in flight (and model loads) share its speed
            loading = m.load_share * sum(x.status == STARTING for x in self.alive.values()) if m.load_share else 0.0
            dur *= max(1.0, (self.busy_count + loading) / m.host_replicas)
        self.push(t + dur, _ROUND_END, r)

    def round_end(self, r: _Replica, t: float) -> None:
        r.busy = False
        self.busy_count -= 1
        self.busy_closed += t - r.round_start
        for q in r.joiners:
            q.first_token = t
        r.joiners = []
        finishers = r.finish_at.pop(r.round, ())
        tokens = self.model.tokens_per_round * (r.running - len(finishers))
        for q in finishers:
            q.finish = t
            tokens += q.last_tokens
        self.tokens_since_sample += tokens
        n = len(finishers)
        r.running -= n
        r.load -= n
        self.running -= n
        self.done += n
        if n:
            self.last_finish = t
            self.offer(r)
        r.round += 1
        if r.running or r.queue:
            self.schedule_round(r, t)
        elif r.status == DRAINING:
            self.stop(r, t)

    # -- accounting
    def totals(self, t: float) -> tuple[float, float, float]:
        """(busy, serving, billed) replica-seconds from 0 to ``t``, open intervals included."""
        busy, serving, billed = self.busy_closed, self.serving_closed, self.billed_closed
        for r in self.alive.values():
            billed += t - r.launch_s
            if r.status in (ACTIVE, DRAINING):
                serving += t - r.ready_s
            if r.busy:
                busy += t - r.round_start
        return busy, serving, billed

    def counts(self) -> tuple[int, int, int]:
        """(ready non-draining, starting, draining) replicas."""
        starting = sum(r.status == STARTING for r in self.alive.values())
        draining = sum(r.status == DRAINING for r in self.alive.values())
        return len(self.active), starting, draining

    def control(self, t: float) -> None:
        busy, serving, _ = self.totals(t)
        t0, busy0, serving0 = self.last_control
        ready, starting, draining = self.counts()
        state = ScalingState(
            time_s=t,
            replicas=ready + starting,
            ready=ready,
            starting=starting,
            draining=draining,
            queued=self.queued,
            running=self.running,
            utilisation=(busy - busy0) / (serving - serving0) if serving > serving0 else 0.0,
            arrivals_per_s=self.arrivals_since_control / (t - t0) if t > t0 else 0.0,
        )
        self.last_control = (t, busy, serving)
        self.arrivals_since_control = 0
        self.resize(max(0, int(self.scaling.policy(state))), t)

    def sample(self, t: float) -> None:
        ready, starting, draining = self.counts()
        self.timeline.append(
            TimelinePoint(
                time_s=t,
                replicas=len(self.alive),
                ready=ready,
                starting=starting,
                draining=draining,
                nodes=math.ceil(len(self.alive) / self.cluster.node_size),
                queued=self.queued,
                running=self.running,
                tokens_per_s=self.tokens_since_sample / self.sample_interval_s,
            )
        )
        self.tokens_since_sample = 0.0

    # -- the loop
    def run(self) -> SimResult:
        for _ in range(self.cluster.replicas):  # ready now; their queued ready events find them ACTIVE
            self.ready(self.launch(0.0, 0.0), 0.0)
        if self.reqs:
            self.push(self.reqs[0].arrival, _ARRIVAL, 0)
        if self.scaling is not None:
            self.push(self.scaling.control_interval_s, _CONTROL, 1)
        self.push(0.0, _SAMPLE, 0)
        total = len(self.reqs)
        end = self.until_s
        while self.heap:
            t = self.heap[0][0]
            if t > self.horizon_s:
                end = self.horizon_s
                break
            if self.done == total:
                end = max(self.last_finish, self.until_s)
                if t > end:
                    break
            _, kind, _, payload = heapq.heappop(self.heap)
            if kind == _ROUND_END:
                self.round_end(payload, t)
            elif kind == _READY:
                self.ready(payload, t)
            elif kind == _ARRIVAL:
                self.arrivals_since_control += 1
                self.queued += 1
                if payload + 1 < total:  # before routing, so that schedule_round sees a simultaneous arrival
                    self.push(self.reqs[payload + 1].arrival, _ARRIVAL, payload + 1)
                self.route(self.reqs[payload], t)
            elif kind == _CONTROL:
                self.control(t)
                self.push((payload + 1) * self.scaling.control_interval_s, _CONTROL, payload + 1)
            elif kind == _ROUND_START:
                self.round_start(payload, t)
            else:
                self.sample(t)
                self.push((payload + 1) * self.sample_interval_s, _SAMPLE, payload + 1)
        return self.result(end)

    def result(self, end: float) -> SimResult:
        busy, serving, billed = self.totals(end)
        records = tuple(
            RequestRecord(q.arrival, q.prompt_len, q.output_len, q.rounds, q.replica, q.first_token, q.finish)
            for q in self.reqs
        )
        lat = tuple(q.finish - q.arrival for q in self.reqs)
        ttft = tuple(q.first_token - q.arrival for q in self.reqs)
        done_lat = [x for x in lat if not math.isnan(x)]
        done_ttft = [x for x in ttft if not math.isnan(x)]
        tokens = sum(q.output_len for q in self.reqs if not math.isnan(q.finish))
        makespan = self.last_finish - self.reqs[0].arrival if self.done else 0.0
        peak = self.peak
        return SimResult(
            requests=records,
            latencies_s=lat,
            ttft_s=ttft,
            unfinished=len(self.reqs) - self.done,
            mean_latency_s=sum(done_lat) / len(done_lat) if done_lat else math.nan,
            p50_latency_s=percentile(done_lat, 50),
            p99_latency_s=percentile(done_lat, 99),
            p50_ttft_s=percentile(done_ttft, 50),
            p99_ttft_s=percentile(done_ttft, 99),
            total_tokens=tokens,
            makespan_s=makespan,
            throughput_tokens_per_s=tokens / makespan if makespan > 0 else 0.0,
            mean_utilisation=busy / serving if serving > 0 else 0.0,
            busy_replica_seconds=busy,
            serving_replica_seconds=serving,
            replica_seconds=billed,
            cost=billed / S_PER_HOUR * self.cluster.cost_per_replica_hour,
            peak_replicas=peak,
            peak_nodes=math.ceil(peak / self.cluster.node_size),
            end_s=end,
            timeline=tuple(self.timeline),
        )


def simulate(
    workload: Workload,
    model: ReplicaModel,
    cluster: ClusterModel = ClusterModel(),
    *,
    seed: int = 0,
    sample_interval_s: float = 1.0,
    until_s: float | None = None,
    horizon_s: float = math.inf,
) -> SimResult:
    """Simulate ``workload`` on a pool of ``model`` replicas until every request has finished and,
    if given, at least until ``until_s`` (e.g. to watch an autoscaler scale down when idle); never
    past ``horizon_s`` (a hard stop for overloaded pools: requests left have NaN finish times).

    Deterministic given ``seed`` (one ``random.Random(seed)`` draws arrivals, then output lengths,
    then prompt lengths). The timeline is sampled at 0, ``sample_interval_s``, ... up to the end.
    """
    if not sample_interval_s > 0:
        raise ValueError(f"sample_interval_s: {sample_interval_s} must be > 0")
    return _Sim(workload, model, cluster, seed, sample_interval_s, until_s, horizon_s).run()
