"""The Ray Serve application: the ``Eyas`` gRPC service over target and drafter actors.

    client --gRPC--> Serve gRPC proxy --> EyasServer replica --actor calls--> TargetWorker / DrafterWorker

``EyasServer`` is the ingress and the engine: it validates and tokenizes a request, picks a target
and a drafter actor from its :class:`~eyas.cluster.pool.WorkerPool`, and runs the decode loop
(``generate_remote``) over them in a worker thread: per round one ``propose`` call to the drafter
actor and ``Verify`` + ``Publish`` calls to the target actor, each carrying only the protocol's
messages. Per-round traffic never goes through Serve handles (13 ms a round, against about 1.4 ms
for a plain actor call on this machine; DESIGN.md and docs/serving.md say why).

RPCs (eyas.proto, service ``Eyas``): ``Generate``, ``GenerateStream`` (one chunk per round, the
last with finish reason and stats), ``Stats`` (telemetry JSON + the workers' leak invariant).
A bad request gets ``INVALID_ARGUMENT`` naming the field; nothing is opened for it. A client that
goes away cancels its request at the next round boundary, and its sessions are closed.

Build it with ``build_app(config)`` (``serve run ray_configs/serve.yaml``, ``eyas serve``), where
``config`` is a :class:`ServeConfig` as a dict.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import uuid
from typing import Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from eyas.actors.ray_actors import RayDrafter, RayTransport
from eyas.cluster.pool import PoolSpec, WorkerPool
from eyas.cluster.round_loop import RoundLoop, WorkerCalls
from eyas.scheduler.latency import LatencyCurve
from eyas.scheduler.policy import Budgets, PromptLengthPolicy, TreeWorkPolicy
from eyas.cluster.telemetry import Telemetry
from eyas.cluster.verifier_client import RemoteVerifier, generate_remote
from eyas.drafting.engine import TreeSpec
from eyas.generate import FINISH_ERROR
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import wire
from eyas.protocol.schema import GenerateRequest
from eyas.runtime import StopStrings, build_report, tree_for
from eyas.target.loader import DEFAULT_TARGET, checkpoint_folder, encode_prompt, load_tokenizer
from eyas.target.model import TargetConfig
from eyas.verification.sampling import SamplingParams

log = logging.getLogger("eyas.serve")

GRPC_SERVICER_FUNCTIONS = ["eyas.protocol.eyas_pb2_grpc.add_EyasServicer_to_server"]
CURVE_ROWS = (1, 2, 4, 8, 16, 32, 64)


class ServeConfig(BaseModel):
    """The application's arguments (``args:`` in ray_configs/serve.yaml)."""

    model_config = ConfigDict(extra="forbid")

    target: str = DEFAULT_TARGET
    precision: Literal["fp32", "int8"] = "fp32"
    methods: list[Literal["eagle1", "eagle3"]] = Field(default_factory=lambda: ["eagle3", "eagle1"])
    drafters: dict[str, str] = Field(default_factory=dict)  # method -> drafter folder (default: shipped)
    target_workers: int = Field(1, ge=1)
    drafter_workers: int = Field(1, ge=0)
    target_num_cpus: float = Field(1.0, ge=0)
    target_num_gpus: float = Field(0.0, ge=0)
    drafter_num_cpus: float = Field(1.0, ge=0)
    drafter_num_gpus: float = Field(0.0, ge=0)
    torch_threads: int = Field(1, ge=1)
    target_timeout_s: float = Field(300.0, gt=0)
    drafter_timeout_s: float = Field(30.0, gt=0)
    drafter_max_restarts: int = Field(1, ge=0)
    console_spans: bool = False
    # "tree-work": all live requests of a target worker advance in batched rounds with per-request trees
    # from the latency curve; "prompt-length": batched rounds of similar prompt lengths, one fixed tree
    # (the baseline); "per-request": each request its own decode loop (no batching across requests)
    scheduler: Literal["tree-work", "prompt-length", "per-request"] = "tree-work"
    max_batch: int = Field(16, ge=1)          # requests per batched round
    max_verify_rows: int = Field(256, ge=1)   # verify rows per batched round (all requests together)
    curve_repeats: int = Field(3, ge=1)       # timings per row count when the latency curve is measured


def parse_config(config: dict | None) -> ServeConfig:
    try:
        return ServeConfig.model_validate(config or {})
    except ValidationError as err:
        first = err.errors()[0]
        raise ValueError(f"config.{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def _invalid(grpc_context, err: Exception, reply):
    if grpc_context is not None:
        grpc_context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
        grpc_context.set_details(str(err))
    return reply


def _stats(report: dict) -> pb.GenerateStats:
    return pb.GenerateStats(tau=report["accept_length_mean"], rounds=report["target_forwards"],
                            draft_ms=1000 * report["draft_s"], verify_ms=1000 * report["verify_s"],
                            prefill_ms=1000 * report["prefill_s"], drafter_fallback=report["drafter_fallback"],
                            wall_ms=1000 * report["wall_s"], new_tokens=report["new_tokens"],
                            hop_ms=1000 * report["hop_s"], drafter_reseeds=report["drafter_reseeds"])


@serve.deployment(name="EyasServer", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64,
                  health_check_period_s=10)
class EyasServer:
    def __init__(self, config: dict | None = None):
        self.cfg = parse_config(config)
        c = self.cfg
        self.tokenizer = load_tokenizer(c.target)
        self.pool = WorkerPool(PoolSpec(c.target, c.precision, tuple(c.methods), dict(c.drafters), c.torch_threads,
                                        c.target_num_cpus, c.target_num_gpus, c.drafter_num_cpus,
                                        c.drafter_num_gpus, c.drafter_max_restarts),
                               c.target_workers, c.drafter_workers)
        self.telemetry = Telemetry("eyas-serve", console=c.console_spans)
        self.telemetry.add_kv_source(self._kv_bytes)
        self.eos_ids = TargetConfig.from_hf(json.loads((checkpoint_folder(c.target) / "config.json").read_text())
                                            ).eos_token_ids
        self.loops: dict[int, RoundLoop] = {}
        self.loops_lock = threading.Lock()

    # --- the Eyas service --------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        try:
            req, ids = self._validate(request)
        except ValueError as err:
            return _invalid(grpc_context, err, pb.GenerateResponse())
        cancel = threading.Event()
        try:
            report = await asyncio.get_running_loop().run_in_executor(None, self._run, req, ids, cancel, None)
        except asyncio.CancelledError:
            cancel.set()  # the client went away: the loop stops at the next round and closes its sessions
            raise
        except ValueError as err:
            return _invalid(grpc_context, err, pb.GenerateResponse())
        return pb.GenerateResponse(token_ids=report["token_ids"], text=report["text"],
                                   finish_reason=report["finish_reason"], stats=_stats(report),
                                   report_json=json.dumps(report))

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context=None):
        try:
            req, ids = self._validate(request)
        except ValueError as err:
            # Serve's proxy applies the context's status only along with a message, so one error chunk goes too
            yield _invalid(grpc_context, err, pb.GenerateChunk(finish_reason=FINISH_ERROR, text=str(err)))
            return
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        done = object()
        future = loop.run_in_executor(None, self._run, req, ids, cancel,
                                      lambda new: loop.call_soon_threadsafe(queue.put_nowait, list(new)))
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, done))
        sent: list[int] = []
        text = ""
        try:
            while (new := await queue.get()) is not done:
                sent.extend(new)
                full = self.tokenizer.decode(sent, skip_special_tokens=True)
                yield pb.GenerateChunk(token_ids=new, text=full[len(text):])
                text = full
            try:
                report = future.result()
            except ValueError as err:
                yield _invalid(grpc_context, err, pb.GenerateChunk(finish_reason=FINISH_ERROR, text=str(err)))
                return
            except Exception as err:  # the request failed after it started: say so in the stream
                log.exception("GenerateStream failed")
                yield pb.GenerateChunk(finish_reason=FINISH_ERROR, text=f"{type(err).__name__}: {err}")
                return
            yield pb.GenerateChunk(finish_reason=report["finish_reason"], stats=_stats(report))
        finally:
            cancel.set()  # a no-op after a finished request; stops a running one whose client went away

    async def Stats(self, request: pb.StatsRequest, grpc_context=None) -> pb.StatsResponse:
        return pb.StatsResponse(json=await asyncio.get_running_loop().run_in_executor(None, self.stats_json))

    # --- HTTP (POST JSON with the GenerateRequest fields; GET /stats) -------------------------------
    async def __call__(self, http_request):
        from starlette.responses import JSONResponse

        if http_request.method == "GET":
            return JSONResponse(json.loads(await asyncio.get_running_loop().run_in_executor(None, self.stats_json)))
        try:
            body = await http_request.json()
            if not isinstance(body, dict):
                raise ValueError("request: the body must be a JSON object")
            request = wire.generate_request_to_proto(GenerateRequest(**{k: v for k, v in body.items()}))
            req, ids = self._validate(request)
        except Exception as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        try:
            report = await asyncio.get_running_loop().run_in_executor(None, self._run, req, ids, threading.Event(), None)
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        return JSONResponse(report)

    # --- operations ----------------------------------------------------------------------------------
    def resize(self, target_workers: int, drafter_workers: int) -> dict:
        return self.pool.resize(target_workers, drafter_workers)

    def leak_checks(self) -> list[dict]:
        return self.pool.leak_checks()

    def stats_json(self) -> str:
        with self.loops_lock:
            loops = {str(i): {"latency_curve": loop.curve.to_dict(), "rounds": loop.rounds, "live": loop.load()}
                     for i, loop in self.loops.items()}
        return self.telemetry.snapshot_json(workers=self.pool.leak_checks(), pool=self.pool.sizes(),
                                            scheduler={"policy": self.cfg.scheduler, "loops": loops})

    def check_health(self) -> None:
        if not self.pool.workers["target"]:
            raise RuntimeError("no target worker")

    # --- internals -----------------------------------------------------------------------------------
    def _kv_bytes(self) -> dict[str, int]:
        totals = {"target": 0, "draft": 0}
        for check in self.pool.leak_checks(timeout_s=5):
            totals["target" if check["kind"] == "target" else "draft"] += check.get("kv_bytes_allocated", 0)
        return totals

    def _validate(self, request: pb.GenerateRequest) -> tuple[GenerateRequest, list[int]]:
        req = wire.generate_request_from_proto(request)
        if req.method != "target" and req.method not in self.cfg.methods:
            raise ValueError(f"method: this deployment serves {['target', *self.cfg.methods]}, not {req.method!r}")
        if req.prompt_ids is not None:
            vocab = len(self.tokenizer)
            bad = [t for t in req.prompt_ids if t >= vocab]
            if bad:
                raise ValueError(f"prompt_ids: {bad[:5]} lie outside the vocabulary [0, {vocab})")
            return req, list(req.prompt_ids)
        return req, encode_prompt(self.tokenizer, req.prompt, req.raw)

    def _trimmed(self, req: GenerateRequest, on_tokens, stops: StopStrings):
        """The per-publish token callback: streams what the final answer keeps (up to max_new_tokens and
        through the first stop id) and reports whether a stop string appeared."""
        emitted: list[int] = []

        def tokens(new: list[int]) -> bool:
            if on_tokens is not None:
                chunk = []
                for t in new:
                    if len(emitted) >= req.max_new_tokens or (emitted and emitted[-1] in self.eos_ids):
                        break
                    emitted.append(t)
                    chunk.append(t)
                if chunk:
                    on_tokens(chunk)
            return stops.on_tokens(new)

        return tokens

    def _run(self, req: GenerateRequest, ids: list[int], cancel: threading.Event, on_tokens) -> dict:
        """One request, start to finish, in a worker thread; returns the ``eyas generate --json`` report."""
        if self.cfg.scheduler == "per-request":
            return self._run_alone(req, ids, cancel, on_tokens)
        target = self.pool.acquire("target")
        try:
            loop = self._loop_for(target)
            info = self.pool.drafter_info.get(req.method, {})
            tree = tree_for(req, info.get("default_tree", TreeSpec()))
            stops = StopStrings(self.tokenizer, req.stop)
            future = loop.submit(req.request_id or uuid.uuid4().hex, ids, req.max_new_tokens, req.method, tree,
                                 SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p),
                                 req.seed, self._trimmed(req, on_tokens, stops), cancel)
            result = future.result()
        finally:
            self.pool.release(target)
            self._reap_loops()
        self.telemetry.record_request(req.method, result.finish_reason, result.drafter_fallback)
        return build_report(req, result, stops.text(result.token_ids), self.cfg.precision, info.get("source"), tree)

    def _loop_for(self, target) -> RoundLoop:
        """The scheduler loop of a target worker (made on first use, paired with the least-loaded drafter)."""
        with self.loops_lock:
            if target.index not in self.loops:
                drafter = self.pool.acquire("drafter")
                self.pool.release(drafter)
                calls = WorkerCalls(target.actor, self.cfg.target_timeout_s)
                curve = LatencyCurve.from_points(calls("measure_latency", CURVE_ROWS, self.cfg.curve_repeats))
                self.loops[target.index] = RoundLoop(
                    calls, None if drafter is None else WorkerCalls(drafter.actor, self.cfg.drafter_timeout_s,
                                                                     drafter=True),
                    self.pool.drafter_info, self._policy(), curve, on_round=self.telemetry.record_round)
            return self.loops[target.index]

    def _policy(self):
        budgets = Budgets(max_batch=self.cfg.max_batch, max_verify_rows=self.cfg.max_verify_rows)
        return TreeWorkPolicy(budgets) if self.cfg.scheduler == "tree-work" else PromptLengthPolicy(budgets)

    def _reap_loops(self) -> None:
        live = {w.index for w in self.pool.workers["target"]}
        with self.loops_lock:
            for index in [i for i in self.loops if i not in live]:
                self.loops.pop(index).close()

    def _run_alone(self, req: GenerateRequest, ids: list[int], cancel: threading.Event, on_tokens) -> dict:
        """The per-request path (``scheduler: per-request``): its own decode loop, three actor calls a round."""
        target = self.pool.acquire("target")
        drafter = self.pool.acquire("drafter") if req.method != "target" else None
        try:
            info = self.pool.drafter_info.get(req.method, {})
            tree = tree_for(req, info.get("default_tree", TreeSpec()))
            remote_drafter = None if drafter is None else RayDrafter(drafter.actor, req.method, tuple(info["taps"]),
                                                                     self.cfg.drafter_timeout_s)
            stops = StopStrings(self.tokenizer, req.stop)
            request_id = req.request_id or uuid.uuid4().hex
            verifier = RemoteVerifier(RayTransport(target.actor), timeout_s=self.cfg.target_timeout_s)
            tokens = self._trimmed(req, on_tokens, stops)

            result = generate_remote(verifier, ids, max_new_tokens=req.max_new_tokens,
                                     sampling=SamplingParams(temperature=req.temperature, top_k=req.top_k,
                                                             top_p=req.top_p),
                                     drafter=remote_drafter, tree=tree, seed=req.seed, request_id=request_id,
                                     cancel=cancel, on_tokens=tokens, on_round=self.telemetry.record_round)
        finally:
            self.pool.release(target)
            self.pool.release(drafter)
        if req.method != "target" and drafter is None:  # no drafter worker at all: target-only from the start
            result = dataclasses.replace(result, drafter_fallback=True)
        self.telemetry.record_request(req.method, result.finish_reason, result.drafter_fallback)
        return build_report(req, result, stops.text(result.token_ids), self.cfg.precision, info.get("source"), tree)


def build_app(args: dict | None = None):
    """The application builder ``serve run``/``serve deploy`` call (``import_path: eyas.cluster.app:build_app``)."""
    config = parse_config(args)  # fail here, naming the field, before any actor starts
    return EyasServer.bind(config.model_dump())
