"""``eyas experiment autoscale``: replay a workload against the autoscaling Eyas app and record a timeline.

One run:

1. starts Ray's fake multi-node cluster (ray_configs/fake_cluster.yaml: each "node" is another raylet
   on this machine; node types stand in for target and drafter hosts through custom resources), or
   joins a running cluster (``--address``);
2. **calibrates**: deploys the app of ray_configs/autoscale.yaml with its replicas pinned
   (:func:`pinned_args`) and measures one target replica's **capacity** on the workload's calibration
   mix (:func:`measure_capacity`: closed loops, ``max_batch`` requests in flight); on the fake cluster
   also two pinned replicas once (the shared host's parallelism);
3. redeploys with the autoscaler's bounds and replays the workload's arrivals (its ``"Nx"`` rates
   resolved against the capacity: :meth:`~eyas.experiments.workload.Workload.at_capacity`) as
   streaming gRPC clients, checking every answer against in-process greedy target-only decoding
   (speculation must not change a token);
4. samples every ``sample_interval_s``: request rate, requests in flight, the tree work the replicas
   report (pending verify rows, draft rows, KV bytes), replicas per deployment running and asked for
   (``serve.status()``), alive nodes per type (``ray.nodes()``) and those being launched (the
   autoscaler's status), p50/p99 latency over a trailing window and tokens/s;
5. writes ``timeline.json`` and ``timeline.png`` (shared time axes) and a summary: the calibration,
   the scaling report (:func:`~eyas.experiments.workload.scaling_report`: threshold crossed, capacity
   asked for / running / given back, a verdict and why), and the simulator fitted on the calibration
   alone (:func:`simulator_report`) predicting the same run beside what was measured.

Node types are read from the cluster config: a node counts as type T when it offers the custom
resource T (the fake and real configs both follow that convention); every other node is the head.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import copy
import itertools
import json
import logging
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from eyas.autoscale.policy import ReplicaMetrics, ScalingState, TargetScalingConfig, decide_target_replicas
from eyas.experiments import sim
from eyas.experiments.workload import (
    BURST_START,
    Arrival,
    Sample,
    Timeline,
    Workload,
    arrivals,
    load_window,
    percentile,
    phase_spans,
    plot_timeline,
    scaling_events,
    scaling_report,
    summary,
)
from eyas.serve.serve_file import read_serve_file

log = logging.getLogger("eyas.experiment")
CLOSE_GRACE_S = 30.0  # Replay.close: how long requests still running at the end get to stop once cancelled
LATE_ERROR = "not finished when the experiment ended (cancelled)"
LATENCY_WINDOW_S = 10.0  # p50/p99 in a sample cover requests finished in this trailing window
RATE_WINDOW_S = 5.0  # request rate and tokens/s in a sample: over this trailing window
HEAD = "head"
REPO_CONFIGS = Path(__file__).resolve().parents[2] / "ray_configs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the fake multi-node cluster -------------------------------------------------------------------
class FakeCluster:
    """Ray's fake multi-node provider on this machine, from a cluster config file.

    The same as ``ray.cluster_utils.AutoscalingCluster(...).start()``, but it takes the whole config
    from our file (the Ray wheel does not ship the example that class builds on), runs the ``ray``
    CLI of this interpreter, and refuses to start (rather than ``ray stop --force`` the machine) when
    another Ray is already running here. ``shutdown`` stops every Ray process of this user.
    """

    def __init__(self, config: dict):
        self.config = config
        head = config["available_node_types"][config["head_node_type"]]
        self.head_resources = dict(head.get("resources", {}))
        self.port = free_port()
        self.config_file: str | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> FakeCluster:
        return cls(yaml.safe_load(Path(path).read_text()))

    def node_types(self) -> list[str]:
        return [t for t in self.config["available_node_types"] if t != self.config["head_node_type"]]

    def start(self) -> str:
        running = ray_processes_running()
        if running:
            raise RuntimeError(
                f"another Ray is running on this machine ({running}); stop it (`ray stop`) or "
                "pass --address to run the experiment on it"
            )
        import ray

        address = f"{ray.util.get_node_ip_address()}:{self.port}"
        config = dict(self.config, provider=dict(self.config["provider"], gcs_address=address))  # new nodes join here
        fd, self.config_file = tempfile.mkstemp(suffix=".json", prefix="eyas-fake-cluster-")
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        res = dict(self.head_resources)
        cmd = [
            *_ray_cli(),
            "start",
            "--head",
            f"--port={self.port}",
            f"--autoscaling-config={self.config_file}",
            "--include-dashboard=false",
            f"--num-cpus={int(res.pop('CPU', 1))}",
            "--disable-usage-stats",
        ]
        if "GPU" in res:
            cmd.append(f"--num-gpus={int(res.pop('GPU'))}")
        if "object_store_memory" in res:
            cmd.append(f"--object-store-memory={int(res.pop('object_store_memory'))}")
        if res:
            cmd.append(f"--resources={json.dumps(res)}")
        env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_AUTH_MODE="disabled")
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return address

    def shutdown(self) -> None:
        subprocess.run(
            [*_ray_cli(), "stop", "--force"], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if self.config_file:
            Path(self.config_file).unlink(missing_ok=True)


def _ray_cli() -> list[str]:
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"]


def ray_processes_running() -> list[str]:
    """Names of this user's running Ray core processes (a GCS server means a running cluster)."""
    import psutil

    me = os.getuid()
    found = []
    for p in psutil.process_iter(["name", "uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real == me and p.info["name"] in ("gcs_server", "raylet"):
                found.append(f"{p.info['name']} pid {p.pid}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


# --- observing the cluster ---------------------------------------------------------------------------
def count_nodes(nodes: list[dict], node_types: list[str]) -> dict[str, int]:
    """Alive nodes per type; a node is of type T when it offers the custom resource T.

    Example: nodes offering {CPU: 2}, {CPU: 1, target_host: 1} (alive) and {CPU: 1, target_host: 1}
    (dead) with types [target_host, drafter_host] -> {head: 1, target_host: 1, drafter_host: 0}.
    """
    counts = {HEAD: 0, **{t: 0 for t in node_types}}
    for n in nodes:
        if not n.get("Alive"):
            continue
        kind = next((t for t in node_types if n.get("Resources", {}).get(t)), HEAD)
        counts[kind] += 1
    return counts


def target_reports(stats: dict) -> list[dict]:
    """The target replicas' autoscaling reports in an app's ``Stats`` (one dict per replica)."""
    return [a for a in stats.get("autoscaling", {}).values() if a.get("kind") == "target"]


def initial_replicas(autoscaling: dict) -> int:
    """The replicas a Serve ``autoscaling_config`` starts with: ``initial_replicas``, else ``min_replicas``."""
    return autoscaling.get("initial_replicas", autoscaling.get("min_replicas", 1))


def target_policy(cfg) -> TargetScalingConfig:
    """The target deployment's Eyas policy, from its ``autoscaling_config``'s ``policy_kwargs``."""
    return TargetScalingConfig(**((cfg.target_autoscaling or {}).get("policy", {}).get("policy_kwargs") or {}))


def replica_states(app: str = "eyas") -> dict[str, tuple[int, int]]:
    """Per deployment: (running, starting) replicas; a replica waiting for its node counts as starting."""
    from ray import serve

    status = serve.status().applications.get(app)
    if status is None:
        return {}
    return {
        name: (int(d.replica_states.get("RUNNING", 0)), int(d.replica_states.get("STARTING", 0)))
        for name, d in status.deployments.items()
    }


def replica_startup_s(states: list[tuple[float, int, int]]) -> float | None:
    """Seconds from a replica being asked for (running + starting rises) to it running (running rises).

    ``states``: (t, running, starting) samples of one deployment. Example: (0, 1, 0), (1, 1, 1),
    (5, 1, 1), (6, 2, 0) -> asked at 1, running at 6 -> 5.0. None when no replica was added.
    """
    for i in range(1, len(states)):
        t, run, start = states[i]
        if run + start > states[i - 1][1] + states[i - 1][2]:
            base = states[i - 1][1]
            for t2, run2, _ in states[i:]:
                if run2 > base:
                    return t2 - t
            return None
    return None


@dataclass
class RequestLog:
    """One replayed request, as the client saw it (times: seconds since the replay started)."""

    arrival: Arrival
    request_id: str = field(default_factory=lambda: f"replay-{uuid.uuid4().hex}")  # its name, for Cancel
    sent_t: float = math.nan
    first_t: float = math.nan
    done_t: float = math.nan
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    rounds: int = 0
    error: str | None = None
    correct: bool | None = None
    stats: dict | None = None  # the last chunk's GenerateStats (rounds, new_tokens, draft_ms, hop_ms)

    @property
    def latency_s(self) -> float:
        return self.done_t - self.arrival.t


class Replay:
    """Sends each arrival at its time from a thread pool of streaming gRPC clients."""

    def __init__(self, address: str, workload: Workload, schedule: list[Arrival], max_clients: int = 64):
        self.address, self.workload, self.schedule = address, workload, schedule
        self.logs = [RequestLog(a) for a in schedule]
        self.pool = concurrent.futures.ThreadPoolExecutor(max_clients, thread_name_prefix="eyas-client")
        self.local = threading.local()
        self.t0 = 0.0
        self.futures: list[concurrent.futures.Future] = []
        self.on_done = None
        self.lock = threading.Lock()
        self.token_times: list[tuple[float, int]] = []  # (when, tokens) of every streamed chunk

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self.t0 = time.monotonic()
        threading.Thread(target=self._dispatch, name="eyas-dispatch", daemon=True).start()

    def _dispatch(self) -> None:
        for rec in self.logs:
            delay = rec.arrival.t - self.now()
            if delay > 0:
                time.sleep(delay)
            self.futures.append(self.pool.submit(self._one, rec))

    def _client(self):
        from eyas.serve.client import EyasClient

        if getattr(self.local, "client", None) is None:
            self.local.client = EyasClient(self.address, timeout_s=600)
        return self.local.client

    def _one(self, rec: RequestLog) -> None:
        rec.sent_t = self.now()
        try:
            for chunk in self._client().stream(
                prompt=rec.arrival.prompt,
                method=self.workload.method,
                max_new_tokens=rec.arrival.max_new_tokens,
                request_id=rec.request_id,
            ):
                if chunk.token_ids and math.isnan(rec.first_t):
                    rec.first_t = self.now()
                rec.tokens.extend(chunk.token_ids)
                if chunk.token_ids:
                    with self.lock:
                        self.token_times.append((self.now(), len(chunk.token_ids)))
                if chunk.finish_reason:
                    rec.finish_reason = chunk.finish_reason
                    rec.rounds = chunk.stats.rounds
                    rec.stats = {
                        "rounds": chunk.stats.rounds,
                        "new_tokens": chunk.stats.new_tokens,
                        "draft_ms": chunk.stats.draft_ms,
                        "hop_ms": chunk.stats.hop_ms,
                    }
                    if chunk.finish_reason == "error":
                        rec.error = chunk.text
        except Exception as err:  # noqa: BLE001 - recorded in the log's record: the experiment reports it, it does not stop
            rec.error = f"{type(err).__name__}: {err}"
        rec.done_t = self.now()
        if self.on_done is not None:
            self.on_done(rec)

    def dispatched(self) -> int:
        return len(self.futures)

    def finished(self) -> list[RequestLog]:
        return [r for r in self.logs if not math.isnan(r.done_t)]

    def close(self, canceller=None, grace_s: float = CLOSE_GRACE_S) -> list[RequestLog]:
        """End the replay. Requests still running are cancelled by name (``canceller``: an
        ``EyasClient``), then their client threads get ``grace_s`` seconds to return, so a stuck request
        holds the experiment that long, not for its client's whole timeout (600 s); those not sent yet
        are dropped. Those that were cancelled, dropped or did not return are recorded as errors
        (``LATE_ERROR``) and returned."""
        late = [r for r in self.logs if math.isnan(r.done_t)]  # running, or queued for a client thread
        for rec in late:
            if canceller is not None and not math.isnan(rec.sent_t):
                try:
                    canceller.cancel(rec.request_id)
                except Exception as err:  # noqa: BLE001 - logged; the app may be gone: the wait below still bounds the close
                    log.warning("Cancel(%s) failed: %s", rec.request_id, err)
        _, running = concurrent.futures.wait(list(self.futures), timeout=grace_s)
        self.pool.shutdown(wait=not running, cancel_futures=True)
        late = [r for r in late if math.isnan(r.done_t) or r.finish_reason == "cancelled"]
        for rec in late:
            rec.error = rec.error or LATE_ERROR
        return late


def sample_now(replay: Replay, stats: dict, replicas: dict[str, int], nodes: dict[str, int]) -> Sample:
    """One timeline sample from the replay's logs and the cluster's state (see eyas.experiments.workload.Sample)."""
    t = replay.now()
    window = min(RATE_WINDOW_S, max(t, 1e-9))
    arrived = sum(1 for r in replay.logs if t - window < r.arrival.t <= t)
    done = replay.finished()
    recent = [r.latency_s for r in done if r.done_t > t - LATENCY_WINDOW_S]
    with replay.lock:
        fresh_tokens = sum(n for when, n in replay.token_times if when > t - window)
    targets = target_reports(stats)
    return Sample(
        t=t,
        request_rate=arrived / window,
        in_flight=replay.dispatched() - len(done),
        completed=len(done),
        pending_verify_rows=sum(a.get("pending_verify_rows", 0.0) for a in targets),
        draft_rows=sum(a.get("draft_rows", 0.0) for a in targets),
        kv_bytes_used=sum(a.get("kv_bytes_used", 0.0) for a in targets),
        replicas=replicas,
        nodes=nodes,
        p50_latency_s=percentile(recent, 50),
        p99_latency_s=percentile(recent, 99),
        tokens_per_s=fresh_tokens / window,
    )


# --- the simulator's prediction of the same run --------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """What the simulator takes from the measured run (all from this run's own replicas and clients)."""

    verify_ms: dict[int, float]  # the target replicas' latency curve: total verify rows -> ms
    tokens_per_round: float  # tau: new tokens per request per round
    rows_per_request: float  # mean verify rows per request per round
    draft_ms_per_round: float  # mean drafter time per round
    hop_ms_per_round: float  # mean time per round outside both forwards
    prompt_len: float  # mean prompt tokens
    startup_s: float  # a new target replica: node launch + model load + curve
    cost_scale: float = 1.0  # round cost multiplier fitted to the run's makespan (fit_cost_scale)


CALIBRATION_PHASE = -1  # Arrival.phase of a calibration request (it belongs to no phase of the workload)


@dataclass(frozen=True)
class CapacityRun:
    """One calibration repeat: ``requests`` prompts answered by one target replica, ``concurrency`` of
    them in flight at a time (a closed loop). Its **capacity** is the answered requests over the
    makespan (first send to last answer)."""

    requests: int
    concurrency: int
    makespan_s: float
    output_tokens: tuple[int, ...]  # per answered request
    p50_latency_s: float
    p99_latency_s: float
    peak_pending_rows: float  # the target's pending verify rows, highest sample while it ran
    errors: int
    incorrect: int

    @property
    def capacity_per_s(self) -> float:
        return len(self.output_tokens) / self.makespan_s if self.makespan_s > 0 else 0.0


def calibrate(stats: dict, reports: list[dict], startup_s: float, prompt_len: float) -> Calibration:
    """``stats``: the app's last ``Stats``; ``reports``: per request its final stats (RequestLog.stats).

    The curve is the first target replica's, as its live rounds left it (measured at start, then
    moved towards every round's observed time); draft and hop ms are per round over all requests."""
    loops = list(stats.get("scheduler", {}).get("loops", {}).values())
    curve = loops[0]["latency_curve"] if loops else {"rows": [1], "ms": [50.0]}
    rows_hist = [p for p in stats.get("metrics", {}).get("eyas.verify_rows", [])]
    rows = sum(p["sum"] for p in rows_hist) / max(sum(p["count"] for p in rows_hist), 1)
    rounds = sum(r["rounds"] for r in reports) or 1
    tokens = sum(r["new_tokens"] for r in reports)
    return Calibration(
        verify_ms=dict(zip(curve["rows"], curve["ms"])),
        tokens_per_round=max(1.0, tokens / rounds),
        rows_per_request=max(1.0, rows),
        draft_ms_per_round=sum(r["draft_ms"] for r in reports) / rounds,
        hop_ms_per_round=sum(r["hop_ms"] for r in reports) / rounds,
        prompt_len=prompt_len,
        startup_s=startup_s,
    )


@dataclass(frozen=True)
class PolicyTiming:
    """How Serve feeds the target policy: what the simulator copies so that it decides when Serve does.

    ``look_back_s``: Serve averages each replica's reports over this window (``look_back_period_s``);
    ``lag_s``: a report reaches the controller up to ``metrics_interval_s`` late; ``control_s``: how
    often the policy is called (Serve's control loop runs about every 0.1 s; a coarser step keeps the
    simulation fast and moves a decision by at most that much)."""

    look_back_s: float = 0.0
    lag_s: float = 0.0
    control_s: float = 1.0

    @classmethod
    def of(cls, autoscaling: dict | None) -> PolicyTiming:
        a = autoscaling or {}
        return cls(
            look_back_s=float(a.get("look_back_period_s", 30.0)),
            lag_s=float(a.get("metrics_interval_s", 10.0)),
            control_s=0.5,
        )


RECENT_S = 15.0  # predict: the policy's rows estimate uses the output lengths of this many seconds of arrivals
#: on a shared host, the share of a round's compute a starting replica takes: half (its start-up is
#: partly reading and building the model, partly timing its latency curve, which computes). Checked on
#: two step_burst runs: 0 predicted their burst p99 at -33 % and +2 %, 1 at -11 % and +30 %.
LOAD_SHARE = 0.5


def predict(
    schedule: list[Arrival],
    cal: Calibration,
    policy: TargetScalingConfig,
    max_batch: int,
    initial_replicas: int,
    until_s: float,
    control_interval_s: float = 1.0,
    host_replicas: float | None = None,
    timing: PolicyTiming | None = None,
) -> sim.SimResult:
    """Simulate the replayed arrivals on replicas of the calibrated cost, scaled by the same policy.

    The policy sees what a target replica reports (``RoundLoop.work``): pending verify rows = requests
    in rounds x half their rounds x rows per round (on average half of a request is still to run) +
    queued requests x (prompt rows + output rows), averaged over ``timing.look_back_s`` and
    ``timing.lag_s`` late, as Serve hands it over. ``host_replicas``: the replicas share one host (the
    fake cluster; see ``sim.ReplicaModel.host_replicas``).
    """
    timing = timing or PolicyTiming(control_s=control_interval_s)
    state = {"s": ScalingState.initial(initial_replicas)}
    seen: list[tuple[float, float]] = []  # (time, pending rows) at every control tick
    mean_out = sum(a.max_new_tokens for a in schedule) / len(schedule)
    times = [a.t for a in schedule]
    prefix = list(itertools.accumulate((a.max_new_tokens for a in schedule), initial=0))

    def recent_out(t: float) -> float:
        """The mean output length of the arrivals in the last ``RECENT_S`` (what is in flight now:
        a workload whose answers grow, short_to_long, must not be judged by the whole run's mean)."""
        lo, hi = bisect.bisect_right(times, t - RECENT_S), bisect.bisect_right(times, t)
        return (prefix[hi] - prefix[lo]) / (hi - lo) if hi > lo else mean_out

    def scale(s: sim.ScalingState) -> int:
        out = recent_out(s.time_s)
        rows = s.running * out / cal.tokens_per_round / 2 * cal.rows_per_request + s.queued * (cal.prompt_len + out)
        seen.append((s.time_s, rows))
        now = s.time_s - timing.lag_s
        window = [r for t, r in seen if now - timing.look_back_s < t <= now]
        if timing.look_back_s or timing.lag_s:
            if not window:  # nothing reported yet: Serve keeps the count
                return s.replicas
            rows = sum(window) / len(window)
        replicas, state["s"] = decide_target_replicas(
            [ReplicaMetrics(pending_verify_rows=rows, timestamp=s.time_s)],
            ScalingState(s.replicas, state["s"].above_since, state["s"].below_since, state["s"].last_decision_at),
            policy,
            now=s.time_s,
        )
        return replicas

    lengths = sorted({a.max_new_tokens for a in schedule})
    weights = [sum(a.max_new_tokens == n for a in schedule) / len(schedule) for n in lengths]
    per_round_ms = cal.draft_ms_per_round + cal.hop_ms_per_round
    model = sim.ReplicaModel(
        verify_ms=sim.Curve.from_points({r: cal.cost_scale * (ms + per_round_ms) for r, ms in cal.verify_ms.items()}),
        tokens_per_round=cal.tokens_per_round,
        rows_per_request=cal.rows_per_request,
        max_batch=max_batch,
        prefill_rows_per_prompt_token=1.0,
        host_replicas=host_replicas,
        load_share=LOAD_SHARE if host_replicas is not None else 0.0,
    )
    workload = sim.Workload(
        sim.Arrivals.explicit([a.t for a in schedule]),
        output_len=list(zip(lengths, weights)),
        prompt_len=max(1, round(cal.prompt_len)),
    )
    cluster = sim.ClusterModel(
        replicas=initial_replicas,
        autoscaling=sim.Autoscaling(scale, control_interval_s=timing.control_s, startup_delay_s=cal.startup_s),
    )
    return sim.simulate(workload, model, cluster, until_s=until_s, horizon_s=until_s + 600)


def fit_cost_scale(
    schedule: list[Arrival],
    cal: Calibration,
    policy: TargetScalingConfig,
    max_batch: int,
    initial_replicas: int,
    until_s: float,
    measured_makespan_s: float,
    host_replicas: float | None = None,
    iterations: int = 24,
) -> float:
    """The one fitted parameter: the factor on the calibrated round cost that makes the simulated run
    of ``schedule`` take as long as the measured one (first arrival to last answer). Bisection on a log
    scale over [1/32, 32]: the simulated makespan grows with the cost, and 24 halvings pin the factor
    to about 1e-6 (relative). The experiment fits it on the calibration repeats only
    (:func:`fit_on_capacity_run`), so that everything it then says about the workload is a prediction.

    Why a factor at all: the start-up curve times one request's rows; a batched round of many
    ragged requests (per-segment attention, sampling and bookkeeping) costs more than its rows say.
    """
    lo, hi = math.log(1 / 32), math.log(32)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        trial = Calibration(**{**cal.__dict__, "cost_scale": math.exp(mid)})
        r = predict(schedule, trial, policy, max_batch, initial_replicas, until_s, host_replicas=host_replicas)
        if r.makespan_s < measured_makespan_s:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def fit_on_capacity_run(cal: Calibration, run: CapacityRun, max_batch: int) -> float:
    """The cost scale that makes one replica, simulated, answer the repeat's requests (all queued at
    once, ``min(concurrency, max_batch)`` in a batch: the calibration's closed loop) in its makespan."""
    one = TargetScalingConfig(min_replicas=1, max_replicas=1)
    schedule = [Arrival(0.0, "calibration", "", n, 0) for n in run.output_tokens]
    return fit_cost_scale(
        schedule, cal, one, min(run.concurrency, max_batch), 1, until_s=0.0, measured_makespan_s=run.makespan_s
    )


CAPACITY_BATCHES = 8  # a saturated replica's capacity is timed over this many full batches of requests


def replica_capacity(cal: Calibration, policy: TargetScalingConfig, max_batch: int, output_len: int) -> float:
    """Requests/s one saturated replica finishes, by simulation: ``CAPACITY_BATCHES x max_batch``
    requests of ``output_len`` tokens arrive at once at one replica that may not scale. Unlike a
    full batch's round time alone, this counts every joiner's prefill rows and the fitted cost scale.
    """
    one = policy.model_copy(update={"min_replicas": 1, "max_replicas": 1})
    n = CAPACITY_BATCHES * max_batch
    r = predict([Arrival(0.0, "capacity", "", output_len, 0)] * n, cal, one, max_batch, initial_replicas=1, until_s=0.0)
    done = n - r.unfinished  # a replica slower than predict's 600-s horizon leaves some unfinished
    return done / r.makespan_s if done and r.makespan_s > 0 else 0.0


def plan(
    cal: Calibration,
    policy: TargetScalingConfig,
    max_batch: int,
    rates: list[float],
    duration_s: float,
    output_len: int,
    cost_per_replica_hour: float = 1.0,
) -> list[dict]:
    """Predicted replicas, nodes, latency and cost at arrival rates far above this machine's (Poisson).

    Each rate starts at its steady-state count, ``ceil(rate / replica_capacity)``, so that the plan is
    not a cold start: from a count that cannot keep up, the queue grows until replicas launched now
    are ready, and a rows-per-replica policy asks for a replica per few queued rows (tens of
    thousands at 100 req/s).
    """
    big = policy.model_copy(update={"max_replicas": 100_000, "max_step_up": None})
    per_replica = replica_capacity(cal, policy, max_batch, output_len)
    out = []
    for rate in rates:
        schedule = [
            Arrival(t, "plan", "", output_len, 0)
            for t in sim.Arrivals.poisson(rate, duration_s=duration_s).sample(random.Random(0))
        ]
        start = max(1, math.ceil(rate / per_replica)) if per_replica else 1
        r = predict(schedule, cal, big, max_batch, initial_replicas=start, until_s=duration_s)
        out.append(
            {
                "rate_per_s": rate,
                "requests": len(schedule),
                "peak_replicas": r.peak_replicas,
                "peak_nodes": r.peak_nodes,
                "p50_latency_s": r.p50_latency_s,
                "p99_latency_s": r.p99_latency_s,
                "tokens_per_s": r.throughput_tokens_per_s,
                "cost_per_hour_at_peak": r.peak_replicas * cost_per_replica_hour,
                "unfinished": r.unfinished,
            }
        )
    return out


# --- the run -------------------------------------------------------------------------------------------
def _references(cfg, workload: Workload) -> dict[tuple[str, int], list[int]]:
    """Greedy target-only tokens per (prompt, max_new_tokens) of every kind in every mix, in-process at
    the app's precision and dtype: the exactness reference (known before the capacity is)."""
    from eyas.protocol.schema import parse_request
    from eyas.runtime import Eyas

    rt = Eyas(cfg.target, precision=cfg.precision, dtype=cfg.dtype)
    keys = sorted({(k.prompt, k.max_new_tokens) for mix in workload.mixes.values() for k in mix.prompts})
    return {
        k: rt.generate(parse_request(prompt=k[0], method="target", max_new_tokens=k[1]))[1]["token_ids"] for k in keys
    }


def with_max_target_replicas(args: dict, n: int) -> dict:
    """The app's args with the target deployment allowed ``n`` replicas: Serve's bound and the
    policy's, which must agree (:mod:`eyas.autoscale.serve_policy`)."""
    out = copy.deepcopy(args)
    a = out.get("target_autoscaling")
    if not a:
        raise ValueError("--max-target-replicas: the serve config's target has no autoscaling_config")
    if n < a.get("min_replicas", 1):
        raise ValueError(f"--max-target-replicas: {n} is below the target's min_replicas {a.get('min_replicas', 1)}")
    a["max_replicas"] = n
    a.setdefault("policy", {}).setdefault("policy_kwargs", {})["max_replicas"] = n
    return out


def pinned_args(args: dict, target_replicas: int | None = None) -> dict:
    """The app's args with each autoscaling deployment held at its initial count (``min = max``; the
    target at ``target_replicas`` when given): the calibration's deployment, which the autoscaler may
    not grow. Only the deployments' autoscaling options differ from ``args``' (the replicas' own
    config leaves them out), so moving from one to the other is Serve's light update: no replica
    restarts."""
    out = copy.deepcopy(args)
    for kind in ("target", "drafter"):
        a = out.get(f"{kind}_autoscaling")
        if not a:
            continue
        n = initial_replicas(a)
        if kind == "target" and target_replicas is not None:
            n = target_replicas
        a.update(min_replicas=n, max_replicas=n, initial_replicas=n)
        kwargs = (a.get("policy") or {}).get("policy_kwargs")
        if kwargs is not None:
            kwargs.update(min_replicas=n, max_replicas=n)
    return out


def run_autoscale(
    workload: Workload,
    out_dir: str | Path,
    *,
    serve_config: str | Path | None = None,
    cluster_config: str | Path | None = None,
    address: str | None = None,
    check: bool = True,
    plan_rates: tuple[float, ...] = (100.0, 1000.0),
    progress: bool = True,
    precision: str | None = None,
    max_target_replicas: int | None = None,
) -> dict:
    """Run the experiment; returns the summary (also in ``out_dir/timeline.json``).

    Phases: (0) reference answers in-process; (1) deploy with the replicas pinned and measure one
    target replica's capacity (``workload.calibration``); (2) release the autoscaler (a light update)
    and replay the workload, its ``"Nx"`` rates resolved against that capacity; (3) the report: what
    scaled when and why (:func:`~eyas.experiments.workload.scaling_report`), and the simulator, fitted
    on the calibration alone, predicting the run beside what was measured."""
    from tqdm import tqdm

    from eyas.serve.config import parse_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    served = read_serve_file(serve_config or REPO_CONFIGS / "autoscale.yaml")
    args, extra = served.args, served.deployment_options
    if precision is not None:
        args["precision"] = precision
    if max_target_replicas is not None:
        args = with_max_target_replicas(args, max_target_replicas)
    cfg = parse_config(args)
    cluster_doc = yaml.safe_load(Path(cluster_config or REPO_CONFIGS / "fake_cluster.yaml").read_text())
    node_types = [t for t in cluster_doc["available_node_types"] if t != cluster_doc["head_node_type"]]
    if progress:
        print("experiment: greedy target-only reference answers, in-process ...", file=sys.stderr, flush=True)
    references = _references(cfg, workload) if check else {}
    cluster = None if address else FakeCluster(cluster_doc)
    timeline = Timeline(
        workload.name,
        meta={"serve_args": args, "node_types": node_types, "address": address or "fake cluster"},
    )
    try:
        if cluster is not None:
            address = cluster.start()
        summary_doc = _run(
            workload,
            address,
            args,
            extra,
            cfg,
            node_types,
            references,
            timeline,
            out,
            progress,
            tqdm,
            cluster is not None,
        )
    finally:
        _stop_serve()
        if cluster is not None:
            cluster.shutdown()
    replayed = summary_doc.pop("_workload")
    # on the fake cluster every node is a process on this machine: how many rounds it runs at once was
    # calibrated (two pinned replicas' capacity over one's), at most its cores over a replica's threads
    host = None
    if cluster is not None:
        cores = (os.cpu_count() or 1) / cfg.torch_threads
        host = min(cores, max(1.0, summary_doc["calibration"]["host_replicas"] or cores))
    until = timeline.samples[-1].t if timeline.samples else 0.0
    summary_doc["simulator"] = simulator_report(
        summary_doc, Calibration(**summary_doc.pop("_calibration")), replayed, cfg, host, until, plan_rates
    )
    timeline.meta["summary"] = summary_doc
    timeline.write_json(out / "timeline.json")
    plot_timeline(timeline, out / "timeline.png", workload=replayed)
    return summary_doc


def simulator_report(
    doc: dict,
    base: Calibration,
    replayed: Workload,
    cfg,
    host: float | None,
    until: float,
    plan_rates: tuple[float, ...] = (),
) -> dict:
    """The simulator, fitted on the calibration alone, beside what the run measured.

    One fit per calibration repeat (:func:`fit_on_capacity_run`); the prediction is the median of
    theirs and its interval their span. ``doc``: the run's summary (its ``calibration`` runs and
    ``report``); ``base``: the calibration's costs with ``cost_scale`` 1; ``replayed``: the workload in
    requests/s; ``host``: rounds the shared host runs at once (None: a host per replica)."""
    schedule = arrivals(replayed)
    policy = target_policy(cfg)
    timing = PolicyTiming.of(cfg.target_autoscaling)
    window = tuple(doc["report"]["window"])
    initial = doc["initial_target_replicas"]
    predictions = []
    for run in (CapacityRun(**r) for r in doc["calibration"]["runs"]):
        cal = Calibration(**{**base.__dict__, "cost_scale": fit_on_capacity_run(base, run, cfg.max_batch)})
        r = predict(schedule, cal, policy, cfg.max_batch, initial, until_s=until, host_replicas=host, timing=timing)
        predictions.append((cal, predicted_outcome(r, window, initial)))
    measured = measured_outcome(doc)
    predicted = {k: _median([p[k] for _, p in predictions]) for k in measured}
    middle = predictions[len(predictions) // 2][0]
    return {
        "fitted_on": "calibration",
        "calibration": middle.__dict__,
        "cost_scales": [c.cost_scale for c, _ in predictions],
        "predicted": predicted,
        "interval": {k: _span([p[k] for _, p in predictions]) for k in measured},
        "measured": measured,
        "error": {
            k: (predicted[k] - measured[k]) / measured[k]
            if (measured[k] or 0) > 0 and predicted[k] is not None
            else None
            for k in measured
        },
        "host_replicas": host,
        "timing": timing.__dict__,
        "plan": plan(
            middle,
            policy,
            cfg.max_batch,
            list(plan_rates),
            duration_s=30.0,
            output_len=round(sum(a.max_new_tokens for a in schedule) / len(schedule)),
        )
        if plan_rates
        else [],
    }


#: what the simulator predicts and the run measures, side by side
OUTCOME_KEYS = ("time_to_added_capacity_s", "p99_window_s", "peak_replicas", "peak_nodes", "scale_down_s")


def predicted_outcome(r: sim.SimResult, window: tuple[float, float], initial: int) -> dict:
    """The outcome keys (:data:`OUTCOME_KEYS`) of a simulated run. ``p99_window_s``: the p99 latency of
    the requests that arrived in the load window; a target replica is a node (one each)."""
    points = [(p.time_s, p.ready + p.starting, p.ready) for p in r.timeline]
    ev = scaling_events(points, initial, window[1])
    lat = [q.latency_s for q in r.requests if window[0] <= q.arrival_s < window[1] and not math.isnan(q.finish_s)]
    return {
        "time_to_added_capacity_s": None if ev.running_at is None else ev.running_at - window[0],
        "p99_window_s": percentile(lat, 99),
        "peak_replicas": ev.peak,
        "peak_nodes": ev.peak,
        "scale_down_s": None if ev.back_at is None else ev.back_at - window[1],
    }


def measured_outcome(doc: dict) -> dict:
    """The outcome keys of the measured run (from ``_run``'s summary and its report)."""
    rep = doc["report"]
    node = rep.get("node") or {}
    return {
        "time_to_added_capacity_s": rep["time_to_added_capacity_s"],
        "p99_window_s": doc.get("p99_window_s"),
        "peak_replicas": rep["replica"]["peak"],
        "peak_nodes": node.get("peak"),
        "scale_down_s": rep["scale_down_s"],
    }


def _median(values: list) -> float | None:
    known = sorted(v for v in values if v is not None)
    return known[len(known) // 2] if known else None


def _span(values: list) -> list | None:
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def _stop_serve() -> None:
    try:
        import ray
        from ray import serve

        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    except Exception:
        log.exception("stopping Serve")


def measure_capacity(
    address: str, workload: Workload, max_batch: int, stats_client, references, progress, replicas: int = 1
) -> list[tuple[CapacityRun, list[dict]]]:
    """The calibration (see :class:`~eyas.experiments.workload.CalibrationSpec`): ``repeats`` closed
    loops of ``requests`` prompts from the calibration mix, ``concurrency`` in flight, against the
    pinned app; per repeat its capacity, latency, peak tree work, any wrong answer and the requests'
    final stats. ``replicas`` > 1 (target replicas pinned there): one repeat, with that many times
    the requests and the concurrency (how far a shared host's capacity grows with replicas)."""
    spec = workload.calibration
    mix = workload.calibration_mix()
    concurrency = (spec.concurrency or max_batch) * replicas
    n = (spec.requests or 2 * (spec.concurrency or max_batch)) * replicas
    repeats = spec.repeats if replicas == 1 else 1
    rng = random.Random(workload.seed + 7919 + replicas)
    runs = []
    for repeat in range(repeats):
        kinds = rng.choices(mix.prompts, weights=[k.weight for k in mix.prompts], k=n)
        batch = [Arrival(0.0, k.name, k.prompt, k.max_new_tokens, CALIBRATION_PHASE) for k in kinds]
        replay = Replay(address, workload, batch, max_clients=concurrency)  # one client thread each: a closed loop
        replay.start()
        peak = 0.0
        deadline = time.monotonic() + 600
        while len(replay.finished()) < n and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                stats = stats_client.stats()
            except Exception as err:  # noqa: BLE001 - a missed sample: the next one reads the peak
                log.warning("Stats failed while calibrating: %s", err)
                continue
            peak = max(peak, sum(a.get("pending_verify_rows", 0.0) for a in target_reports(stats)))
        replay.close(stats_client)
        ok = [r for r in replay.logs if r.error is None]
        lat = [r.latency_s for r in ok]
        run = CapacityRun(
            requests=n,
            concurrency=concurrency,
            makespan_s=max((r.done_t for r in ok), default=0.0),
            output_tokens=tuple(len(r.tokens) for r in ok),
            p50_latency_s=percentile(lat, 50) or 0.0,
            p99_latency_s=percentile(lat, 99) or 0.0,
            peak_pending_rows=peak,
            errors=n - len(ok),
            incorrect=sum(
                bool(references) and r.tokens != references[(r.arrival.prompt, r.arrival.max_new_tokens)] for r in ok
            ),
        )
        runs.append((run, [r.stats for r in ok if r.stats]))
        if progress:
            print(
                f"calibration {repeat + 1}/{repeats} ({replicas} target replica{'s' if replicas > 1 else ''}): "
                f"{n} requests, {concurrency} in flight: "
                f"{run.capacity_per_s:.2f} req/s, p50 latency {run.p50_latency_s:.2f} s, "
                f"peak pending verify rows {peak:.0f}",
                file=sys.stderr,
                flush=True,
            )
    return runs


def _run(
    workload, address, args, extra, cfg, node_types, references, timeline, out, progress, tqdm, shared_host
) -> dict:
    """The experiment on a running cluster; ``extra``: the Serve file's deployment options."""
    import ray
    from ray import serve

    from eyas.serve.app import GRPC_SERVICER_FUNCTIONS, build_app
    from eyas.serve.client import EyasClient

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, namespace="eyas-experiment", log_to_driver=False)
    grpc_port = free_port()
    # proxies on the head only: a proxy on a worker node would keep it from ever going idle
    serve.start(
        proxy_location="HeadOnly",
        http_options={"host": "127.0.0.1", "port": free_port()},
        grpc_options={"port": grpc_port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
    )
    if progress:
        print("experiment: deploying with the replicas pinned (calibration) ...", file=sys.stderr, flush=True)
    t_deploy = time.monotonic()
    serve.run(build_app(pinned_args(args), extra), name="eyas", route_prefix="/")
    deploy_s = time.monotonic() - t_deploy
    grpc_address = f"127.0.0.1:{grpc_port}"
    stats_client = EyasClient(grpc_address, timeout_s=60)
    measured = measure_capacity(grpc_address, workload, cfg.max_batch, stats_client, references, progress)
    runs = [r for r, _ in measured]
    cal_reports = [rep for _, reps in measured for rep in reps]
    capacity = statistics.median(r.capacity_per_s for r in runs)
    if not capacity > 0:
        raise RuntimeError("calibration: no request was answered; see the replicas' logs")
    cal_stats = stats_client.stats()
    host_runs: list[CapacityRun] = []
    if (
        shared_host and workload.calibration.shared_host
    ):  # every replica a process on this machine: how much do two get done beside each other?
        if progress:
            print("experiment: two target replicas pinned (the shared host's parallelism) ...", file=sys.stderr)
        serve.run(build_app(pinned_args(args, target_replicas=2), extra), name="eyas", route_prefix="/")
        host_runs = [
            r for r, _ in measure_capacity(grpc_address, workload, cfg.max_batch, stats_client, references, progress, 2)
        ]
    host_replicas = host_runs[0].capacity_per_s / capacity if host_runs else None
    replayed = workload.at_capacity(capacity) if workload.relative else workload
    schedule = arrivals(replayed)
    if not schedule:
        raise ValueError(f"workload {workload.name}: the phases produce no arrival")
    t_release = time.monotonic()
    serve.run(build_app(args, extra), name="eyas", route_prefix="/")  # the autoscaler's bounds back
    _wait_for_nodes(node_types, cfg, timeout_s=60)
    release_s = time.monotonic() - t_release
    if progress:
        print(
            f"experiment: capacity {capacity:.2f} req/s; autoscaler released ({release_s:.1f} s); "
            f"replaying {len(schedule)} arrivals",
            file=sys.stderr,
            flush=True,
        )
    timeline.meta.update(arrivals=len(schedule), capacity_per_s=capacity)
    replay = Replay(grpc_address, replayed, schedule)
    bar = tqdm(total=len(schedule), desc=f"{workload.name}", unit="req", disable=not progress)
    replay.on_done = lambda rec: bar.update(1)
    initial = {k: v[0] for k, v in replica_states().items()}
    target_states: list[tuple[float, int, int]] = []
    for (start, _), phase in zip(phase_spans(replayed), replayed.phases):
        if phase.label:
            timeline.mark(start, phase.label)
    timeline.mark(0.0, "released", release_s=release_s)
    replay.start()
    end_t = schedule[-1].t + workload.drain_s
    last_stats: dict = {}
    while True:
        time.sleep(workload.sample_interval_s)
        try:
            last_stats = stats_client.stats()
        except Exception:
            log.warning("Stats failed", exc_info=True)
        states = replica_states()
        nodes = count_nodes(ray.nodes(), node_types)
        s = sample_now(replay, last_stats, {k: v[0] for k, v in states.items()}, nodes)
        s.asked_replicas = {k: run + start for k, (run, start) in states.items()}
        s.asked_nodes = asked_nodes(nodes)
        target_states.append((s.t, *states.get("EyasTarget", (0, 0))))
        timeline.add(s)
        all_done = len(replay.finished()) == len(schedule)
        if s.t >= end_t and all_done and _settled(timeline, initial, node_types):
            break
        if s.t >= end_t + 120:  # give scale-down two more minutes, then stop anyway
            break
    late = replay.close(stats_client)
    if late:
        log.warning("%d requests were still running at the end and were cancelled", len(late))
    bar.close()
    stats_client.close()
    logs = replay.logs
    for rec in logs:
        if references and rec.error is None:
            rec.correct = rec.tokens == references[(rec.arrival.prompt, rec.arrival.max_new_tokens)]
    (out / "requests.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "t": r.arrival.t,
                    "kind": r.arrival.kind,
                    "max_new_tokens": r.arrival.max_new_tokens,
                    "latency_s": r.latency_s,
                    "ttft_s": r.first_t - r.arrival.t,
                    "tokens": len(r.tokens),
                    "finish_reason": r.finish_reason,
                    "error": r.error,
                    "correct": r.correct,
                }
            )
            + "\n"
            for r in logs
        )
    )
    doc = summary(timeline)
    lat = [r.latency_s for r in logs if r.error is None]
    window = load_window(replayed)
    doc["p99_window_s"] = percentile(
        [r.latency_s for r in logs if r.error is None and window[0] <= r.arrival.t < window[1]], 99
    )
    burst = next(
        ((a, b) for (a, b), ph in zip(phase_spans(replayed), replayed.phases) if ph.label == BURST_START), None
    )
    if burst is not None:  # by arrival: requests that came before the burst, and during it
        doc["p99_steady_s"] = percentile([r.latency_s for r in logs if r.error is None and r.arrival.t < burst[0]], 99)
        doc["p99_burst_s"] = doc["p99_window_s"]
    target_counts = [s.replicas.get("EyasTarget", 0) for s in timeline.samples]
    errors = sum(r.error is not None for r in logs) + sum(r.errors for r in runs)
    incorrect = sum(r.correct is False for r in logs) + sum(r.incorrect for r in runs)
    policy = target_policy(cfg)
    doc.update(
        requests=len(logs),
        errors=errors,
        incorrect=incorrect,
        checked=bool(references),
        p50_latency_s=percentile(lat, 50),
        p99_latency_s=percentile(lat, 99),
        initial_target_replicas=initial.get("EyasTarget", 1),
        peak_target_replicas=max(target_counts, default=0),
        final_target_replicas=target_counts[-1] if target_counts else 0,
        deploy_s=deploy_s,
        makespan_s=max((r.done_t for r in logs if r.error is None), default=0.0) - schedule[0].t,
        calibration={
            "capacity_per_s": capacity,
            "runs": [asdict(r) for r in runs],
            "host_runs": [asdict(r) for r in host_runs],
            "host_replicas": host_replicas,
            "rows_at_capacity": statistics.median(r.peak_pending_rows for r in runs),
            "threshold_rows_per_replica": policy.target_verify_rows_per_replica,
            "rates": [[p.rate_start, p.rate_end] for p in workload.phases],
            "rates_per_s": [[p.rate_start, p.end_rate] for p in replayed.phases],
        },
        report=scaling_report(
            timeline,
            replayed,
            deployment="EyasTarget",
            node_type="target_host" if "target_host" in node_types else None,
            rows_per_replica=policy.target_verify_rows_per_replica,
            errors=errors,
            incorrect=incorrect,
        ),
    )
    doc["peak_target_replicas_asked"] = max((run + start for _, run, start in target_states), default=0)
    doc["target_replica_startup_s"] = replica_startup_s(target_states)
    # fitted on the calibration only: its stats (the latency curve, rows per round) and its requests;
    # a new replica's start-up is the pinned deployment's (node launch, model load, latency curve)
    doc["_calibration"] = calibrate(
        cal_stats, cal_reports, deploy_s, prompt_len=_mean_prompt_len(args, schedule)
    ).__dict__
    doc["_workload"] = replayed
    return doc


def _wait_for_nodes(node_types: list[str], cfg, timeout_s: float) -> None:
    """After a redeploy: wait (up to ``timeout_s``) until the target nodes are back to the replicas the
    app starts with, so that the replay's first sample is the cluster at rest."""
    import ray

    want = initial_replicas(cfg.target_autoscaling or {})
    if "target_host" not in node_types:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and count_nodes(ray.nodes(), node_types)["target_host"] > want:
        time.sleep(1.0)


def asked_nodes(alive: dict[str, int]) -> dict[str, int]:
    """Per node type, the nodes Ray's autoscaler has asked for: running, being set up and launches
    not yet started, all from one snapshot of its status (the GCS KV; mixing it with the fresher
    ``alive`` counts a node that has just started twice). {} when the status is not readable
    (another autoscaler version, or none); a type it does not list keeps its ``alive`` count."""
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
        report = json.loads(raw)["autoscaler_report"] if raw else None
    except Exception as err:  # noqa: BLE001 - an optional view: said, and the run goes on without it
        log.warning("the Ray autoscaler's status is not readable (%s: %s)", type(err).__name__, err)
        return {}
    if not report:
        return {}
    out = {k: 0 for k in alive if k != HEAD}
    for node_type, count in (report.get("active_nodes") or {}).items():
        if node_type in out:
            out[node_type] += int(count)
    for pending in report.get("pending_nodes") or []:
        if len(pending) > 1 and pending[1] in out:
            out[pending[1]] += 1
    for node_type, count in (report.get("pending_launches") or {}).items():
        if node_type in out:
            out[node_type] += int(count)
    return {k: max(v, alive.get(k, 0)) if v == 0 else v for k, v in out.items()}


def _mean_prompt_len(args: dict, schedule: list[Arrival]) -> float:
    from eyas.target.loader import DEFAULT_TARGET, encode_prompt, load_tokenizer

    tok = load_tokenizer(args.get("target", DEFAULT_TARGET))
    return sum(len(encode_prompt(tok, a.prompt, False)) for a in schedule) / len(schedule)


def _settled(timeline: Timeline, initial: dict[str, int], node_types: list[str]) -> bool:
    """Back to the starting replica counts (and so, soon after, the starting nodes)."""
    s = timeline.samples[-1]
    first = timeline.samples[0]
    return all(s.replicas.get(k, 0) <= v for k, v in initial.items()) and s.nodes == first.nodes
