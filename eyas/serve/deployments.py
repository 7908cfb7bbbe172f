"""The target and drafter deployments of the Eyas Serve app. Each scales on its own tree work.

    client --gRPC--> Serve proxy --> EyasServer (ingress) --handle, one streaming call per request-->
        EyasTarget replica: TargetWorker + RoundLoop, in one process
            --handle, one call per round (multiplexed by target replica)--> EyasDrafter replica: DrafterWorker

``EyasTarget``
    One replica = one copy of the target model, its KV cache and the :class:`RoundLoop` that batches
    all of its requests' rounds. A request lives in one target replica from admission to finish (the
    ingress makes one streaming call per request), so its committed KV never moves and the target's
    per-round calls are plain method calls in the same process. Scaling down is Serve's graceful
    shutdown: the replica leaves the routing table, finishes every live request (up to
    ``graceful_shutdown_timeout_s``), then goes. Sessions drain; none is dropped.

``EyasDrafter``
    One replica = one ``DrafterWorker`` (the drafters' weights and draft KV). A target replica sends
    every call of its requests with ``multiplexed_model_id`` = its own replica id, so Serve's
    model-multiplexing router keeps one target replica's draft sessions on one drafter replica. When
    the router moves them anyway (a drafter replica was added, removed or replaced), the new replica
    does not hold the session and answers with a refusal; the request then reseeds its draft session
    from the target's committed state (design 0x05D: every committed feature from position 0) on the
    new replica. Greedy tokens never change: the target decides each one.

Both report their tree work through ``record_autoscaling_stats()`` (see
:mod:`eyas.autoscale.serve_policy` for the policies that read it), and post their state to the app's
:class:`~eyas.serve.registry.Registry` for ``Stats``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from eyas import compute
from eyas.actors.drafter_worker import DrafterWorker
from eyas.actors.target_worker import TargetWorker
from eyas.drafting.engine import TreeSpec
from eyas.generate import finish, is_finished, stop_ids_for
from eyas.learning.capture import CaptureConfig
from eyas.protocol.messages import Refusal
from eyas.protocol.schema import GenerateRequest
from eyas.protocol.text import AnswerText
from eyas.runtime import build_report, tree_for
from eyas.scheduler.cost import ExpertTraffic
from eyas.scheduler.latency import LatencyCurve
from eyas.scheduler.policy import Budgets, PromptLengthPolicy, TreeWorkPolicy
from eyas.serve.registry import Reporter, app_name, cancels_due, get_registry
from eyas.serve.round_loop import RoundLoop, WorkerCalls
from eyas.serve.telemetry import Telemetry
from eyas.step import SUFFIX, DrafterUnavailable, suffix_tree_spec
from eyas.target.loader import load_tokenizer

log = logging.getLogger("eyas.serve")
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)
STREAM_DONE = object()
DRAFTER_INFO_WAIT_S = 120.0  # how long a starting target replica keeps asking the drafter for its info
# a drafter closes the sessions of a target replica missing this long from the registry's live list
# (which drops a replica 10 s after its last report): a dead target replica never closes them
ORPHAN_GRACE_S = 15.0


class _Locked:
    """A worker whose every method runs under one lock: the round loop and the reporter thread share it."""

    def __init__(self, worker, lock: threading.Lock):
        self._worker, self._lock = worker, lock

    def __getattr__(self, name):
        method = getattr(self._worker, name)

        def locked(*args):
            with self._lock:
                return method(*args)

        def call(*args):  # on the process's compute thread (eyas.compute), where the lock is taken
            return compute.run(locked, *args)

        return call


class ServeCalls:
    """``calls(method, *args)`` on the drafter deployment, pinned by ``multiplexed_model_id``.

    A drafter that cannot answer (no replica, a dead one, a timeout) raises ``DrafterUnavailable``; a
    refusal (``ValueError`` in the drafter) is raised as that ``ValueError``.
    """

    def __init__(self, handle, model_id: str, timeout_s: float, round_timeout_s: float | None = None):
        self.handle = handle.options(multiplexed_model_id=model_id)
        self.timeout_s = timeout_s
        # the calls a round waits on: short, since a Serve handle with no live replica waits for a
        # replacement (tens of seconds) and a round must not; the loop goes plain and probes with info
        self.round_timeout_s = round_timeout_s or timeout_s

    def __call__(self, method: str, *args):
        timeout = self.timeout_s if method == "info" else self.round_timeout_s
        try:
            return getattr(self.handle, method).remote(*args).result(timeout_s=timeout)
        except ray.exceptions.RayTaskError as err:
            cause = getattr(err, "cause", None)
            if isinstance(cause, ValueError):
                raise cause from None
            raise DrafterUnavailable(f"drafter: {type(cause or err).__name__}") from err
        except Exception as err:  # TimeoutError, a dead replica, a deployment with no replica
            raise DrafterUnavailable(f"drafter: {type(err).__name__}: {err}") from err


LEARNER_PREFIX = "eyas-learner"


def learning_drafter_dir(cfg) -> str:
    """The folder of the drafter that learns online (``learn.method``'s: the config's, else the shipped one)."""
    from eyas.runtime import DEFAULT_DRAFTER_DIRS, REPO_DRAFTERS

    return cfg.drafters.get(cfg.learn.method) or str(REPO_DRAFTERS / DEFAULT_DRAFTER_DIRS[cfg.learn.method])


def learning_capture(cfg) -> CaptureConfig | None:
    """A target replica's capture: the learning drafter's sessions (its feature address) when
    ``learn.enabled`` (None: off)."""
    from eyas.drafting.manifest import read_manifest

    if not cfg.learn.enabled:
        return None
    taps = read_manifest(learning_drafter_dir(cfg)).taps()
    return CaptureConfig(taps, cfg.learn.capture_bytes, cfg.learn.capture_age_s)


def learner_for(app: str, cfg):
    """The app's learner actor (``eyas.learning.loop.LearnerLoop``), started on first use: detached,
    on the head node, nice 19 with one thread and no CPU reserved (it takes what serving leaves)."""
    from pathlib import Path

    from eyas.learning.learner import LearnConfig
    from eyas.learning.loop import LearnerLoop
    from eyas.serve.registry import HEAD_NODE_RESOURCE

    s = cfg.learn
    return (
        ray.remote(LearnerLoop)
        .options(
            name=f"{LEARNER_PREFIX}:{app}",
            get_if_exists=True,
            lifetime="detached",
            num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
        )
        .remote(
            target=cfg.target,
            drafter_dir=learning_drafter_dir(cfg),
            out=str(Path(s.out).expanduser() / app),
            config=LearnConfig(
                lr=s.lr,
                decay_steps=s.decay_steps,
                warmup_steps=s.warmup_steps,
                margin=s.margin,
                heldout_every=s.heldout_every,
                min_window=s.min_window,
                window=s.window,
                epochs=s.epochs,
            ),
            replay=s.replay,
            steps_per_check=s.steps_per_check,
            duty=s.duty,
            nice=19,
            threads=1,
        )
    )


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:  # outside a Serve replica (unit tests)
        return uuid.uuid4().hex[:8]


def _actor_name() -> str | None:
    try:
        return ray.get_runtime_context().get_actor_name()
    except Exception as err:  # noqa: BLE001 - said; a name is only a label in the replica's stats
        log.warning("no actor name for this replica's stats (%s: %s)", type(err).__name__, err)
        return None


@serve.deployment(
    name="EyasTarget",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=64,
    graceful_shutdown_timeout_s=600,
    graceful_shutdown_wait_loop_s=1,
    health_check_period_s=10,
)
class EyasTarget:
    def __init__(self, config: dict, drafter=None):
        from eyas.serve.config import parse_config

        self.cfg = c = parse_config(config)
        self.app_name = app_name()
        self.replica_id = _replica_id()
        self.worker_lock = threading.Lock()
        self.device = c.device_for("target")
        capture = learning_capture(c)
        self.worker = compute.run(
            TargetWorker.load,
            c.target,
            c.precision,
            c.torch_threads,
            c.dtype,
            self.device,
            c.prefix_cache_bytes,
            capture,
        )
        self.locked = _Locked(self.worker, self.worker_lock)
        self.tokenizer = load_tokenizer(c.target)
        self.telemetry = Telemetry(
            f"eyas-target-{self.replica_id}",
            model_name=c.target,
            console=c.console_spans,
            otlp_endpoint=c.otlp_endpoint,
        )
        self.telemetry.add_kv_source(lambda: {"target": self.locked.leak_check()["kv_bytes_allocated"]})
        self.telemetry.add_load_source(self._load)
        self.telemetry.add_prefix_cache_source(lambda: self.locked.prefix_cache_stats())
        self.drafter = (
            None
            if drafter is None
            else ServeCalls(drafter, self.replica_id, c.drafter_timeout_s, c.drafter_round_timeout_s)
        )
        self.curve_key = f"{c.target}/{c.precision}/{c.dtype}/{_device_kind(self.device, c.torch_threads)}"
        curve = self._start_curve()
        budgets = Budgets(max_batch=c.max_batch, max_verify_rows=c.max_verify_rows, max_expert_bytes=c.max_expert_bytes)
        policy = TreeWorkPolicy(budgets) if c.scheduler == "tree-work" else PromptLengthPolicy(budgets)
        self.loop = RoundLoop(
            WorkerCalls(self.locked, c.target_timeout_s, local=True),
            self.drafter,
            {},
            policy,
            curve,
            on_round=self.telemetry.record_round,
            on_finish=lambda *_: self.reporter.poke(),
            experts=ExpertTraffic(**self.worker.engine_for(()).expert_traffic_shape()),
            max_prefill_rows=c.max_prefill_rows,
        )
        # named requests in flight here: request id -> (wall time the ingress received it, its cancel)
        self.inflight: dict[str, tuple[float, threading.Event]] = {}
        self.reporter = Reporter(
            self.app_name,
            self.replica_id,
            "target",
            self._report,
            on_reply=lambda reply: self._cancel_named(reply["cancels"]),
        )
        if self.drafter is not None:  # a blocking handle call must not run on the replica's event loop
            threading.Thread(target=self._fetch_drafter_info, name="eyas-drafter-info", daemon=True).start()
        if c.learn.enabled:
            threading.Thread(target=self._push_captured, name="eyas-learn-push", daemon=True).start()

    def _push_captured(self) -> None:
        """Every ``learn.push_period_s``: the learning sessions' samples to the app's learner (no wait
        on its answer; a learner that cannot be reached is said once and tried again next period)."""
        learner, warned = None, False
        while self.loop.thread.is_alive():
            time.sleep(self.cfg.learn.push_period_s)
            try:
                learner = learner or learner_for(self.app_name, self.cfg)
                samples = self.locked.take_captured()
                if samples:
                    learner.add.remote(samples)
                warned = False
            except Exception as err:  # noqa: BLE001 - said once an outage; serving does not depend on learning
                learner = None
                if not warned:
                    log.warning("captured samples not handed to the learner: %s: %s", type(err).__name__, err)
                    warned = True

    def _fetch_drafter_info(self) -> None:
        """The drafter's taps, default trees and measured draft cost, asked off the event loop at start-up
        (until a drafter answers or the first speculative request asks for it itself)."""
        deadline = time.monotonic() + DRAFTER_INFO_WAIT_S
        while not self.loop.drafter_info and time.monotonic() < deadline:
            try:
                self.loop.set_drafter_info(self.drafter("info"))
                return
            except DrafterUnavailable:
                time.sleep(1.0)
        if not self.loop.drafter_info:
            log.warning("no drafter answered within %.0f s: speculative requests ask again", DRAFTER_INFO_WAIT_S)

    def _start_curve(self) -> LatencyCurve:
        """The verify latency curve: a sibling's (same target, precision and device kind) when the app's
        registry has one, else measured here. Either way live rounds keep it up to date."""
        try:
            known = ray.get(get_registry(self.app_name).get_curve.remote(self.curve_key), timeout=10)
        except Exception as err:  # noqa: BLE001 - logged; without a sibling's curve the replica measures its own
            log.info("no latency curve from the registry (%s): measuring one", err)
            known = None
        if known:
            return LatencyCurve(list(known["rows"]), list(known["ms"]))
        curve = LatencyCurve.from_points(self.locked.measure_latency(CURVE_ROWS, self.cfg.curve_repeats))
        try:
            get_registry(self.app_name).put_curve.remote(self.curve_key, curve.to_dict())
        except Exception as err:  # noqa: BLE001 - logged; siblings then measure their own curve
            log.info("latency curve not shared with the registry: %s", err)
        return curve

    def _drafter_info(self) -> dict:
        """Per method: taps and default tree, from the drafter deployment ({} when there is none)."""
        if self.drafter is None:
            return {}
        try:
            return self.drafter("info")
        except DrafterUnavailable as err:
            log.warning("no drafter answered (%s): speculative requests go target-only", err)
            return {}

    # --- requests (from the ingress) ------------------------------------------------------------
    async def generate(self, req: GenerateRequest, prompt_ids: list[int], received_at: float | None = None):
        """Stream ``{"tokens": [...], "first": i, "finish": reason | None}`` per publish, then
        ``{"report": ...}`` (or ``{"invalid": msg}``). ``first`` is the answer index of the chunk's
        first token; ``finish`` is set on the chunk that completes the answer (its finish reason by
        the one finish rule, ``eyas.generate.finish``), so that the committed tokens carry their own
        end: an ingress whose replica dies after that chunk and before the report does not resume.

        The request stops early (finish reason ``cancelled``) when its caller goes away or when a
        named cancel for its ``request_id`` issued after ``received_at`` (the ingress's wall time)
        reaches this replica (see :meth:`_cancel_named`). ``req`` was validated at the ingress and
        crosses to this replica as itself."""
        assert isinstance(req, GenerateRequest), "req: the ingress's validated GenerateRequest"
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        named = req.request_id or None
        if named is not None:
            self.inflight[named] = (time.time() if received_at is None else received_at, cancel)
        start = time.time() if received_at is None else received_at
        if req.method != "target" and not self.loop.drafter_info and self.drafter is not None:
            # the drafter came up after this replica: ask it now, off the event loop
            self.loop.set_drafter_info(await asyncio.to_thread(self._drafter_info))
        future = self._submit(
            req, prompt_ids, cancel, start, lambda chunk: loop.call_soon_threadsafe(queue.put_nowait, chunk)
        )
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, STREAM_DONE))
        try:
            while (chunk := await queue.get()) is not STREAM_DONE:
                yield chunk
            try:
                report = future.result()
            except ValueError as err:
                yield {"invalid": str(err)}
                return
            yield {"report": report}
        finally:
            cancel.set()  # a no-op after a finished request; stops one whose caller went away
            if named is not None and self.inflight.get(named, (None, None))[1] is cancel:
                del self.inflight[named]

    def _cancel_named(self, cancels: dict[str, float]) -> None:
        """The reporter thread's hook: stop the in-flight requests that the registry's named cancels
        (request id -> issued at) apply to."""
        entries = dict(self.inflight)  # the event loop adds and removes entries; act on a copy
        for rid in cancels_due({rid: received for rid, (received, _) in entries.items()}, cancels):
            entries[rid][1].set()

    def _submit(
        self, req: GenerateRequest, ids: list[int], cancel: threading.Event, start: float, on_tokens
    ) -> concurrent.futures.Future:
        """Hand one request to the round loop; a future of its report. No thread waits for it: the
        loop's own thread finishes it, so a replica runs up to ``max_batch`` requests at once and every
        other request waits in the loop's queue, where the scheduler and the autoscaler count it.
        The request's count, duration and time to first token (from ``start``, the ingress's receipt)
        are recorded together, then reported, so a scrape that sees it counted also sees its
        latencies; a request whose caller went away is counted as well (finish reason ``cancelled``)."""
        first_token_at: list[float] = []
        last_chunk_at: list[float] = []

        def on_new(new) -> None:
            now = time.time()
            first_token_at[:] = first_token_at or [now]
            if last_chunk_at:
                self.telemetry.record_gap(req.method, now - last_chunk_at[0], len(new["tokens"]))
            last_chunk_at[:] = [now]
            on_tokens(new)

        info = self.loop.drafter_info.get(req.method, {})
        tree = (
            suffix_tree_spec(self.loop.suffix_side.spec)
            if req.method == SUFFIX
            else tree_for(req, info.get("default_tree", TreeSpec()))
        )
        stops = AnswerText(self.tokenizer, req.stop, req.min_tokens)
        # the ingress checked the stop token ids against the vocabulary (EyasServer._validate)
        stop_ids = stop_ids_for(
            self.worker.cfg.eos_token_ids, ignore_eos=req.ignore_eos, stop_token_ids=req.stop_token_ids
        )
        running = self.loop.submit(
            req.request_id or uuid.uuid4().hex,
            ids,
            req.max_new_tokens,
            req.method,
            tree,
            req.to_sampling_params(stop_ids),
            req.seed,
            _trimmed(req, on_new, stops, stop_ids),
            cancel,
            logprobs=req.logprobs,
            suffix=req.suffix_drafts,
            learn=req.learn,
            stop_ids=stop_ids,
        )
        report: concurrent.futures.Future = concurrent.futures.Future()

        def finished(done: concurrent.futures.Future) -> None:  # on the round loop's thread
            try:
                result = done.result()
                self.telemetry.record_latency(
                    req.method,
                    time.time() - start,
                    first_token_at[0] - start if first_token_at else None,
                    result.queue_s,
                    len(ids),
                    len(result.token_ids),
                )
                self.telemetry.record_request(
                    req.method, result.finish_reason, result.drafter_fallback, result.drafter_version
                )
                self.reporter.poke()
                report.set_result(
                    build_report(
                        req,
                        result,
                        AnswerText.of(self.tokenizer, result.token_ids, req.stop, req.min_tokens),
                        self.cfg.precision,
                        info.get("source"),
                        tree,
                    )
                )
            except BaseException as err:  # noqa: BLE001 - a refusal (ValueError) or a failure, for the caller
                report.set_exception(err)

        running.add_done_callback(finished)
        return report

    def _load(self) -> dict[str, float]:
        """Requests running and waiting, and the K/V slots held as a fraction of the replica's capacity
        (``max_batch`` rows of the whole context): the gauges vLLM's dashboards chart."""
        work, leak = self.loop.work(), self.locked.leak_check()
        capacity = self.cfg.max_batch * self.worker.cfg.max_context
        return {
            "num_requests_running": work["live"],
            "num_requests_waiting": work["pending"],
            "kv_cache_usage_perc": min(leak["kv_slots_allocated"] / capacity, 1.0) if capacity else 0.0,
        }

    # --- autoscaling and stats -------------------------------------------------------------------
    def record_autoscaling_stats(self) -> dict[str, float]:
        """Tree work for :class:`~eyas.autoscale.serve_policy.TargetTreeWorkPolicy` (window-averaged by Serve)."""
        return self._autoscaling(self.loop.work(), self.locked.leak_check())

    def _autoscaling(self, work: dict, leak: dict) -> dict[str, float]:
        return {
            "pending_verify_rows": work["pending_verify_rows"],
            "draft_rows": work["draft_rows"],
            "kv_bytes_used": float(leak["kv_bytes_allocated"]),
            "kv_bytes_capacity": float(self.cfg.kv_capacity_bytes),
            "expert_bytes": work["expert_bytes"],
        }

    def _report(self) -> dict:
        leak = self.locked.leak_check()
        work = self.loop.work()
        return {
            "worker": dict(
                leak, live_requests=work["live"] + work["pending"], actor_name=_actor_name(), namespace="serve"
            ),
            "loop": {
                "latency_curve": self.loop.curve.to_dict(),
                "draft_cost": self.loop.draft_cost.to_dict(),
                "experts": self.loop.experts.to_dict(),
                "rounds": self.loop.rounds,
                "suffix": self.loop.suffix_side.stats(),
                **work,
            },
            "autoscaling": self._autoscaling(work, leak),
            "prefix_cache": self.locked.prefix_cache_stats(),
            "telemetry": self.telemetry.snapshot(),
            "prometheus": self.telemetry.prometheus_text(),
        }

    def check_health(self) -> None:
        if not self.loop.thread.is_alive():
            raise RuntimeError("the round loop stopped")

    def __del__(self):
        for stop in (lambda: self.loop.close(), lambda: self.reporter.stop()):
            try:
                stop()
            except Exception as err:  # noqa: BLE001 - said; a replica being torn down has nothing left to serve
                log.warning("replica teardown: %s: %s", type(err).__name__, err)


@serve.deployment(
    name="EyasDrafter",
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=64,
    graceful_shutdown_timeout_s=30,
    health_check_period_s=10,
)
class EyasDrafter:
    def __init__(self, config: dict):
        from eyas.serve.config import parse_config

        self.cfg = c = parse_config(config)
        self.replica_id = _replica_id()
        self.worker = compute.run(
            DrafterWorker.load,
            c.target,
            tuple(c.methods),
            dict(c.drafters) or None,
            c.torch_threads,
            c.precision,
            c.dtype,
            c.device_for("drafter"),
        )
        compute.run(self.worker.measure_costs)  # the targets' schedulers start from this replica's measured draft cost
        self.lock = threading.Lock()
        self.recent: dict[
            str, tuple[float, int]
        ] = {}  # caller (target replica) -> (time, draft rows of its last round)
        self.owners: dict[str, str] = {}  # request id -> the target replica that opened its session
        self.missing_since: dict[str, float] = {}  # target replica -> when it first fell off the registry's live list
        self.reporter = Reporter(app_name(), self.replica_id, "drafter", self._report, on_reply=self._reclaim)
        self.live_version = 0  # the learned drafter version this replica serves (learn.enabled; 0: the shipped one)
        if c.learn.enabled:
            threading.Thread(target=self._poll_versions, name="eyas-learn-poll", daemon=True).start()

    def _poll_versions(self) -> None:
        """Every ``learn.poll_period_s`` (with a random offset, so that replicas swap one at a time): a
        version the learner promoted replaces the live drafter between two calls, under the worker lock:
        a round boundary."""
        import random

        learner, warned = None, False
        while True:
            time.sleep(self.cfg.learn.poll_period_s * (0.5 + random.random()))
            try:
                learner = learner or learner_for(app_name(), self.cfg)
                version, folder = ray.get(learner.live.remote(), timeout=30)
                if version > self.live_version and folder is not None:
                    method = self.cfg.learn.method
                    drafter = self.worker.load_version(method, folder)  # off the lock: rounds go on meanwhile
                    with self.lock:
                        compute.run(self.worker.swap_in, method, drafter, folder, version)
                    self.live_version = version
                    log.info("drafter version %d live (%s)", version, folder)
                warned = False
            except Exception as err:  # noqa: BLE001 - said once an outage; the live drafter keeps serving
                learner = None
                if not warned:
                    log.warning("no drafter version from the learner: %s: %s", type(err).__name__, err)
                    warned = True

    @serve.multiplexed(max_num_models_per_replica=64)
    async def _affinity(self, model_id: str) -> str:
        """Nothing to load: registering the caller's id makes Serve route its next calls here."""
        return model_id

    async def _call(self, method: str, *args):
        caller = serve.get_multiplexed_model_id()
        if caller:
            await self._affinity(caller)
        return await asyncio.to_thread(self._locked, caller, method, *args)

    def _locked(self, caller: str, method: str, *args):
        with self.lock:
            if method == "open_session" and self.owners.get(args[0], caller) != caller:
                # a request resumed on another target replica after its first one died: the old
                # replica's session of it is stale (it can never be closed by its owner)
                self.worker.close_session(args[0])
                self.owners.pop(args[0], None)
            out = compute.run(getattr(self.worker, method), *args)
        if method == "propose_batch":
            rows = sum(len(t.tokens) for t in out[0] if not isinstance(t, Refusal))
            self.recent[caller] = (time.monotonic(), rows)
        elif method == "open_session" and caller:
            self.owners[args[0]] = caller
        elif method == "close_session":
            self.owners.pop(args[0], None)
        return out

    def _reclaim(self, reply: dict) -> None:
        """The reporter's hook: close the sessions of target replicas that have been missing from the
        registry's live list (``live_targets``) for ORPHAN_GRACE_S -- a dead replica never closes them.
        A live replica that was only slow to report finds its session gone and reseeds it."""
        live, now = set(reply.get("live_targets", ())), time.monotonic()
        owners = set(self.owners.values())
        self.missing_since = {o: self.missing_since.get(o, now) for o in owners if o not in live}
        for owner, since in self.missing_since.items():
            if now - since < ORPHAN_GRACE_S:
                continue
            stranded = [rid for rid, o in list(self.owners.items()) if o == owner]
            with self.lock:
                for rid in stranded:
                    self.worker.close_session(rid)
                    self.owners.pop(rid, None)
            log.warning(
                "closed %d draft sessions of target replica %s (gone for %.0f s)", len(stranded), owner, now - since
            )

    async def info(self) -> dict:
        return await self._call("info")

    async def open_session(self, request_id: str, method: str, max_slots: int, *processors) -> None:
        """``processors``: the request's (SamplingParams, prompt ids) when a logits processor is on."""
        return await self._call("open_session", request_id, method, max_slots, *processors)

    async def propose_batch(self, items: list) -> tuple[list, float, list[int]]:
        return await self._call("propose_batch", items)

    async def close_session(self, request_id: str) -> bool:
        return await self._call("close_session", request_id)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Draft rows per round over the target replicas that called in the last 5 s."""
        now = time.monotonic()
        return {"draft_rows": float(sum(rows for t, rows in list(self.recent.values()) if now - t <= 5.0))}

    def _report(self) -> dict:
        with self.lock:
            leak = self.worker.leak_check()
        stranded = sum(o in self.missing_since for o in list(self.owners.values()))
        return {
            "worker": dict(
                leak,
                live_requests=0,
                actor_name=_actor_name(),
                namespace="serve",
                stranded_sessions=stranded,
                drafter_version=self.live_version,
            ),
            "autoscaling": self.record_autoscaling_stats(),
        }

    def __del__(self):
        try:
            self.reporter.stop()
        except Exception as err:  # noqa: BLE001 - said; a replica being torn down has nothing left to serve
            log.warning("replica teardown: %s: %s", type(err).__name__, err)


def _device_kind(device: str, threads: int) -> str:
    """What a latency curve was measured on: the GPU's name, or the CPU and its torch threads."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu-{threads}t"


def _trimmed(req: GenerateRequest, on_chunk, stops: AnswerText, eos_ids: tuple[int, ...]):
    """The per-publish token callback: hands ``on_chunk`` what the final answer keeps of each publish
    (up to ``max_new_tokens`` and through the first stop id) as ``{"tokens", "first", "finish"}``
    (see ``EyasTarget.generate``), and reports whether a stop string appeared."""
    emitted: list[int] = []

    def tokens(new: list[int], logprobs: tuple | None = None) -> bool:
        first = len(emitted)
        for t in new:
            if len(emitted) >= req.max_new_tokens or (emitted and emitted[-1] in eos_ids):
                break
            emitted.append(t)
        chunk = emitted[first:]
        stopped = stops.on_tokens(chunk)
        if chunk and on_chunk is not None:
            done = is_finished(emitted, req.max_new_tokens, eos_ids, chunk, stopped)
            reason = finish(emitted, req.max_new_tokens, eos_ids, stopped=stopped)[1] if done else None
            item = {"tokens": chunk, "first": first, "finish": reason}
            if logprobs is not None:
                item["logprobs"] = list(logprobs[: len(chunk)])  # the kept tokens', in order
            on_chunk(item)
        return stopped

    return tokens
