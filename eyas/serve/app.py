"""The Ray Serve application: the ``Eyas`` gRPC service over target and drafter deployments.

    client --gRPC/HTTP--> Serve proxy --> EyasServer (ingress) --one streaming call per request-->
        EyasTarget replica (TargetWorker + RoundLoop) --one call per round--> EyasDrafter replica

``EyasServer`` validates and tokenizes a request and streams it through one ``EyasTarget`` replica,
which runs it to the end in its batched round loop (eyas/serve/deployments.py says who owns
what). Target and drafter replicas scale independently, each with its own ``autoscaling_config``
and tree-work policy (eyas/autoscale/serve_policy.py), or at fixed counts.

RPCs (eyas.proto, service ``Eyas``): ``Generate``, ``GenerateStream`` (one chunk per round, the
last with finish reason and stats), ``Stats`` (every replica's telemetry, tree work, latency curve
and leak invariant, merged from the app's registry), ``Cancel`` (stop a named request). A bad request
gets ``INVALID_ARGUMENT`` naming the field; nothing is opened for it.

HTTP, on the same ingress replica (a FastAPI app under ``@serve.ingress``, ``eyas/serve/http_api.py``;
``GET /openapi.json`` lists it): the OpenAI API (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``; ``eyas/serve/openai_api.py``), ``GET /metrics`` (Prometheus text of every target
replica), and Eyas's own JSON routes (``POST /``, ``POST /cancel``, ``GET /stats``). An optional API
key guards every route and RPC; at most ``max_inflight_requests`` requests run at once (then 503 /
``RESOURCE_EXHAUSTED``). Every protocol runs a request through one path (``EyasServer._request``)
and answers its failures from one table (``eyas/serve/errors.py``).

Cancellation, two ways, both stopping the request at its next round boundary and closing its
sessions: (1) the client closes its stream, and Serve cancels the ingress call and with it the
target call; (2) the client names its request (``request_id``) and calls ``Cancel``: the ingress posts
the name to the app's registry, and the target replica running it picks it up with its next report
(about 0.5 s). (1) alone is not enough with Ray Serve 2.60: its gRPC proxy drops a client's cancel
that arrives while it is writing a chunk to that client (``bench/cancel.py``: 7 of 20 early closes
on a loaded 2-core machine were lost). ``EyasClient.stream`` names every request and does both.

Build it with ``build_app(config)`` (``serve run ray_configs/serve.yaml``, ``eyas serve``), where
``config`` is a :class:`ServeConfig` as a dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError

from eyas.generate import FINISH_ERROR
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import wire
from eyas.protocol.checks import check_in_vocab
from eyas.protocol.schema import GenerateRequest
from eyas.protocol.service import SERVICER_FUNCTION, TIMEOUT_METADATA, decode_message, timeout_from_metadata
from eyas.protocol.text import AnswerText
from eyas.serve import openai_api as oai
from eyas.serve.config import ServeConfig, parse_config  # noqa: F401 - parse_config: the app's config API
from eyas.serve.errors import DeadlinePassed, Failure, Overloaded, ReplicaLost, Unauthenticated, failure_of, is_expected
from eyas.serve.registry import HEAD_NODE_RESOURCE, app_name, get_registry
from eyas.step import SUFFIX
from eyas.target.engine import check_context
from eyas.target.loader import load_target_config, load_tokenizer, request_prompt_ids

log = logging.getLogger("eyas.serve")
RESUME_BACKOFF_S = 0.5  # the wait before a request whose replica died is sent again

# requests reach the ingress as bytes, decoded here so that a corrupt one is INVALID_ARGUMENT naming the field
GRPC_SERVICER_FUNCTIONS = [SERVICER_FUNCTION]


def _unauthenticated(grpc_context, reply):
    """``reply`` with the table's UNAUTHENTICATED answer (eyas.serve.errors)."""
    failure = failure_of(Unauthenticated("missing or wrong API key: send 'authorization: Bearer <key>' metadata"))
    return _grpc_answer(grpc_context, failure, reply)


def _grpc_answer(grpc_context, failure: Failure, reply):
    """``reply``, with ``failure``'s status and message from the one table (eyas.serve.errors) set on a
    gRPC call's context."""
    if grpc_context is not None:
        grpc_context.set_code(failure.grpc_code)
        grpc_context.set_details(failure.message)
    return reply


def _refused(grpc_context, err: Exception, reply):
    """``reply`` with ``err``'s answer from the one table: a refusal before the request started."""
    return _grpc_answer(grpc_context, failure_of(err), reply)


# Errors of a dead or unreachable replica, on which a request resumes on another one.
_REPLICA_LOST = (RayActorError, ActorUnavailableError)


class _Resuming:
    """One request's stream of items from the target deployment. It holds one of the ingress's
    admission slots until ``cancel()`` (every caller cancels in a ``finally``; a second cancel is a
    no-op), and it resumes a request whose replica dies: the request is sent again, to a live or
    replacement replica, as the *committed prefix* (the prompt plus every token already streamed to
    the client) with the tokens still owed, so the client sees no duplicate and no missing token.

    The committed prefix carries its own end: the target marks the chunk that completes the answer
    (``finish``: EOS, a stop string, ``max_tokens``; ``EyasTarget.generate``). A replica lost after
    that chunk and before its report is not resumed (a resumed request would run on past the end):
    the stream ends with a report built here from the tokens sent, its finish reason the target's.
    Each item's ``first`` is the answer index of its first token; a chunk that overlaps what was
    already sent is cut to what is new, so delivery is exactly once.

    Greedy output is the uninterrupted run's (the continuation of a prefix is the target's argmax
    wherever it is computed). A sampled request stays a valid sample of the target's distribution:
    the resumed part draws with seed ``seed + tokens already sent``, so it is not the sample the
    uninterrupted run would have drawn. The final report covers the whole answer (tokens, text, stop
    strings); its timings and rounds are the last replica's. Past ``resume_timeout_s`` from the
    failure without a replica answering, the stream raises :class:`ReplicaLost`; so does a request
    with a ``response_format`` that has streamed part of its answer (its grammar would restart at the
    resumed prompt: not yet carried across a resume)."""

    def __init__(
        self,
        start,
        req: GenerateRequest,
        ids: list[int],
        tokenizer,
        release,
        resume_timeout_s: float,
        deadline: float | None = None,
    ):
        """``deadline``: a ``time.monotonic()`` instant past which the stream raises :class:`DeadlinePassed`
        (its caller's ``finally`` then cancels the request in its replica)."""
        self.start, self.req, self.ids, self.tokenizer = start, req, ids, tokenizer
        self.release, self.resume_timeout_s, self.deadline = release, resume_timeout_s, deadline
        self.sent: list[int] = []
        self.finished_as: str | None = None  # the finish reason the target marked on the last chunk sent
        self.resumes = 0
        self.started = time.monotonic()
        self.stream = start(req, ids)

    def __aiter__(self):
        return self._items()

    async def _items(self):
        lost_at = None
        while True:
            prefix = len(self.sent)
            try:
                async for item in self._within_deadline(self.stream):
                    lost_at = None
                    if "tokens" in item:
                        item = self._new_part(item, prefix)
                        if item is None:
                            continue
                    elif "report" in item and (self.resumes or prefix):
                        item = {"report": self._merged(item["report"], prefix)}
                    yield item
                return
            except _REPLICA_LOST as err:
                owed = self.req.max_new_tokens - len(self.sent)
                if self.finished_as is not None or owed <= 0:
                    log.warning(
                        "request %s: target replica lost after the answer's last token (%s); not resumed",
                        self.req.request_id or "-",
                        type(err).__name__,
                    )
                    yield {"report": self._finished_report()}
                    return
                now = time.monotonic()
                lost_at = lost_at or now
                if now - lost_at > self.resume_timeout_s or self.release is None:
                    raise ReplicaLost(
                        "the target replica serving this request failed and none resumed it; retry the request"
                    ) from None
                if self.req.response_format is not None and self.sent:  # the grammar would restart mid-value
                    raise ReplicaLost(
                        "the target replica serving this request failed after part of its structured answer, "
                        "which cannot resume mid-value; retry the request"
                    ) from None
                log.warning(
                    "request %s: target replica lost after %d tokens (%s); resuming",
                    self.req.request_id or "-",
                    len(self.sent),
                    type(err).__name__,
                )
                self.stream.cancel()
                await asyncio.sleep(RESUME_BACKOFF_S)
                self.resumes += 1
                resumed = self.req.model_copy(
                    update={"max_new_tokens": owed, "seed": (self.req.seed + len(self.sent)) % 2**63}
                )
                self.stream = self.start(resumed, self.ids + self.sent)

    def _new_part(self, item: dict, prefix: int) -> dict | None:
        """A replica's chunk as the client's: its index in the whole answer (this attempt started
        after ``prefix`` tokens), cut to the tokens not sent yet (None: nothing new)."""
        first = prefix + int(item.get("first", len(self.sent) - prefix))
        skip = max(len(self.sent) - first, 0)
        tokens = list(item["tokens"])[skip:]
        if first > len(self.sent):
            raise RuntimeError(f"a chunk starts at token {first} but {len(self.sent)} were sent")
        if not tokens:
            return None
        self.sent.extend(tokens)
        self.finished_as = item.get("finish")
        part = {"tokens": tokens, "first": len(self.sent) - len(tokens), "finish": self.finished_as}
        if "logprobs" in item:
            part["logprobs"] = list(item["logprobs"])[skip:]
        return part

    def _finished_report(self) -> dict:
        """The report of an answer whose last token was sent before its replica died (its rounds
        and timings went with the replica)."""
        from eyas.generate import GenerationResult, finish
        from eyas.runtime import build_report

        reason = self.finished_as or finish(self.sent, self.req.max_new_tokens, ())[1]
        result = GenerationResult(
            token_ids=list(self.sent), finish_reason=reason, prefill_s=0.0, wall_s=time.monotonic() - self.started
        )
        text = AnswerText.of(self.tokenizer, self.sent, self.req.stop, self.req.min_tokens)
        return {**build_report(self.req, result, text, None, None, None), "resumes": self.resumes}

    async def _within_deadline(self, stream):
        """``stream``'s items, each awaited no longer than the time left before the deadline."""
        if self.deadline is None:
            async for item in stream:
                yield item
            return
        items = stream.__aiter__()
        while True:
            left = self.deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                item = await asyncio.wait_for(items.__anext__(), left)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise DeadlinePassed(
                    f"deadline: {TIMEOUT_METADATA} passed after {len(self.sent)} tokens; the request was stopped"
                ) from None
            yield item

    def _merged(self, report: dict, prefix: int) -> dict:
        """The last replica's report over the whole answer: the first ``prefix`` tokens came before."""
        tokens = self.sent[:prefix] + list(report["token_ids"])
        return {
            **report,
            "token_ids": tokens,
            "new_tokens": len(tokens),
            "text": AnswerText.of(self.tokenizer, tokens, self.req.stop, self.req.min_tokens),
            "resumes": self.resumes,
        }

    def cancel(self) -> None:
        self.stream.cancel()
        if self.release is not None:
            release, self.release = self.release, None
            release()


def _logged(err: BaseException) -> Failure:
    """A request that failed after it started: logged here (a warning for a failure the table expects,
    the traceback otherwise), answered from the one table with no internals in its message."""
    if is_expected(err):
        log.warning("request failed: %s", err)
    else:
        log.error("request failed", exc_info=err)
    return failure_of(err)


def _deadline(grpc_context) -> float | None:
    """The ``time.monotonic()`` instant of the call's ``eyas-timeout-ms`` (None: no deadline)."""
    if grpc_context is None:
        return None
    timeout_s = timeout_from_metadata(grpc_context.invocation_metadata())
    return None if timeout_s is None else time.monotonic() + timeout_s


def _stats(report: dict) -> pb.GenerateStats:
    return pb.GenerateStats(
        tau=report["accept_length_mean"],
        rounds=report["target_forwards"],
        draft_ms=1000 * report["draft_s"],
        verify_ms=1000 * report["verify_s"],
        prefill_ms=1000 * report["prefill_s"],
        drafter_fallback=report["drafter_fallback"],
        wall_ms=1000 * report["wall_s"],
        new_tokens=report["new_tokens"],
        hop_ms=1000 * report["hop_s"],
        drafter_reseeds=report["drafter_reseeds"],
        resumes=report.get("resumes", 0),
        cached_tokens=report.get("cached_tokens", 0),
        drafter_version=report.get("drafter_version"),
    )


# The ingress holds no model; it lives on the head node beside the proxy, so that it never keeps a
# worker node from going idle (override `ray_actor_options` in the Serve config to place it elsewhere).
@serve.deployment(
    name="EyasServer",
    ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001}},
    max_ongoing_requests=256,
    health_check_period_s=10,
)
@serve.ingress()  # HTTP: the FastAPI app of __serve_build_asgi_app__; gRPC: the methods below
class EyasServer:
    def __init__(self, config: dict, target):
        self.cfg = parse_config(config)
        self.target = target.options(stream=True)
        self.tokenizer = load_tokenizer(self.cfg.target)
        self.max_context = load_target_config(self.cfg.target).max_context  # checked here, before any replica
        self.app_name = app_name()
        self.model_name = self.cfg.served_model_name or self.cfg.target
        self.created = oai.now()
        self.inflight = 0  # admitted requests (the event loop is this count's only writer)
        get_registry(self.app_name)  # start it now, from the head, before any replica reports

    def _authorized(self, grpc_context) -> bool:
        """The gRPC calls' API-key check (no key configured: every call passes)."""
        if not self.cfg.api_key:
            return True
        metadata = dict(grpc_context.invocation_metadata()) if grpc_context is not None else {}
        try:
            oai.check_api_key(self.cfg.api_key, metadata.get("authorization"))
        except oai.OpenAIError:
            return False
        return True

    # --- the Eyas service --------------------------------------------------------------------------
    async def Generate(self, request: bytes | pb.GenerateRequest, grpc_context=None) -> pb.GenerateResponse:
        if not self._authorized(grpc_context):
            return _unauthenticated(grpc_context, pb.GenerateResponse())
        try:
            req, ids = self._validate(wire.generate_request_from_proto(decode_message(pb.GenerateRequest, request)))
            deadline = _deadline(grpc_context)
        except ValueError as err:
            return _refused(grpc_context, err, pb.GenerateResponse())
        report = await self._drain(req, ids, deadline)
        if isinstance(report, Failure):
            return _grpc_answer(grpc_context, report, pb.GenerateResponse())
        return pb.GenerateResponse(
            token_ids=report["token_ids"],
            text=report["text"],
            finish_reason=report["finish_reason"],
            stats=_stats(report),
            report_json=json.dumps(report),
        )

    async def GenerateStream(self, request: bytes | pb.GenerateRequest, grpc_context=None):
        # Serve's proxy applies the context's status only along with a message, so a refusal or a
        # failure also sends one error chunk that carries it
        if not self._authorized(grpc_context):
            yield _unauthenticated(grpc_context, pb.GenerateChunk(finish_reason=FINISH_ERROR, text="unauthenticated"))
            return
        try:
            req, ids = self._validate(wire.generate_request_from_proto(decode_message(pb.GenerateRequest, request)))
            deadline = _deadline(grpc_context)
        except ValueError as err:
            yield _refused(grpc_context, err, pb.GenerateChunk(finish_reason=FINISH_ERROR, text=str(err)))
            return
        text = AnswerText(self.tokenizer, req.stop, req.min_tokens)  # the SSE stream's rule (eyas/protocol/text.py)
        async with self._request(req, ids, deadline) as items:
            async for item in items:
                if isinstance(item, Failure):
                    yield _grpc_answer(
                        grpc_context, item, pb.GenerateChunk(finish_reason=FINISH_ERROR, text=item.message)
                    )
                    return
                if "tokens" in item:
                    yield pb.GenerateChunk(
                        token_ids=item["tokens"], text=text.push(item["tokens"]), first_token_index=item["first"]
                    )
                else:
                    report = item["report"]
                    yield pb.GenerateChunk(
                        text=text.finish(),
                        finish_reason=report["finish_reason"],
                        stats=_stats(report),
                        first_token_index=report["new_tokens"],
                    )

    async def Stats(self, request: bytes | pb.StatsRequest, grpc_context=None) -> pb.StatsResponse:
        if not self._authorized(grpc_context):
            return _unauthenticated(grpc_context, pb.StatsResponse())
        try:
            decode_message(pb.StatsRequest, request)
        except ValueError as err:
            return _refused(grpc_context, err, pb.StatsResponse())
        return pb.StatsResponse(json=json.dumps(await self.stats(), default=str))

    async def Cancel(self, request: bytes | pb.CancelRequest, grpc_context=None) -> pb.CancelResponse:
        if not self._authorized(grpc_context):
            return _unauthenticated(grpc_context, pb.CancelResponse())
        try:
            await self.cancel(wire.cancel_request_from_proto(decode_message(pb.CancelRequest, request)).request_id)
        except ValueError as err:
            return _refused(grpc_context, err, pb.CancelResponse())
        return pb.CancelResponse()

    # --- HTTP: a FastAPI app under Serve's ingress (eyas/serve/http_api.py) ------------------------
    def __serve_build_asgi_app__(self):
        from eyas.serve.http_api import build_http_app

        return build_http_app(self)

    # --- the one request path ------------------------------------------------------------------------
    def _request(self, req: GenerateRequest, ids: list[int], deadline: float | None = None):
        """The one path every protocol runs a validated request through, as ``async with
        self._request(...) as items: async for item in items``. The items are the target's
        ``{"tokens": [...]}`` per round, then ``{"report": {...}}``; any failure instead ends them with
        one :class:`~eyas.serve.errors.Failure` from the one table: the ingress full, a refusal found
        in the replica, a replica lost and not resumed, a passed deadline, an error finish, or an error
        inside the server (logged). Leaving the block, however it is left (the answer is complete, the
        client went away, the caller was cancelled), cancels the request in its replica and releases
        its admission slot."""
        return contextlib.aclosing(self._items(req, ids, deadline))

    async def _items(self, req: GenerateRequest, ids: list[int], deadline: float | None):
        try:
            stream = self._start(req, ids, deadline)
        except Overloaded as err:
            yield failure_of(err)
            return
        try:
            async for item in stream:
                if "invalid" in item:
                    yield failure_of(ValueError(item["invalid"]))
                    return
                if "report" in item and item["report"]["finish_reason"] == FINISH_ERROR:
                    yield failure_of(RuntimeError("an error finish"))  # the replica logged it
                    return
                yield item
        except Exception as err:  # noqa: BLE001 - logged by _logged; the client gets the table's answer
            yield _logged(err)
        finally:
            stream.cancel()  # a no-op after the last item; stops the request in its replica otherwise

    async def _drain(self, req: GenerateRequest, ids: list[int], deadline: float | None = None) -> dict | Failure:
        """A unary call's answer: the request's final report, or its failure (``_request``; a stream
        that ends without a report is an internal failure)."""
        report = None
        async with self._request(req, ids, deadline) as items:
            async for item in items:
                if isinstance(item, Failure):
                    return item
                report = item.get("report", report)
        return report if report is not None else _logged(RuntimeError("the request's stream ended without a report"))

    # --- internals -----------------------------------------------------------------------------------
    def _start(self, req: GenerateRequest, ids: list[int], deadline: float | None = None):
        """The request's stream of items from one target replica. The caller cancels it in a ``finally``
        of its own coroutine, so that a client that goes away stops the request at once (a ``finally`` in
        an inner async generator would run only when that generator is garbage-collected)."""
        if self.inflight >= self.cfg.max_inflight_requests:
            raise Overloaded.at(self.inflight)
        self.inflight += 1
        received = time.time()
        try:
            return _Resuming(
                lambda r, i: self.target.generate.remote(r, i, received),  # the validated request itself
                req,
                ids,
                self.tokenizer,
                self._release,
                self.cfg.resume_timeout_s,
                deadline,
            )  # it releases once
        except BaseException:
            self.inflight -= 1
            raise

    def _release(self) -> None:
        self.inflight -= 1

    def _validate(self, req: GenerateRequest) -> tuple[GenerateRequest, list[int]]:
        """What a validated request asks of this deployment: a method it serves, a prompt within its
        context -> (the request, its prompt ids)."""
        if req.drafter is not None:  # a server-side folder: never a client's to name
            raise ValueError("drafter: a drafter folder is the deployment's choice, not a request's")
        if req.method not in ("target", SUFFIX) and req.method not in self.cfg.methods:
            raise ValueError(
                f"method: this deployment serves {['target', SUFFIX, *self.cfg.methods]}, not {req.method!r}"
            )
        ids, field = request_prompt_ids(self.tokenizer, req, len(self.tokenizer))
        check_context(len(ids), req.max_new_tokens, self.max_context, field)
        check_in_vocab(req.stop_token_ids, len(self.tokenizer), "stop_token_ids")
        return req, ids

    async def cancel(self, request_id: str) -> None:
        """A named cancel: posted to the app's registry, from where the target replica that runs the
        request (if any) picks it up with its next report. Idempotent; unknown names are no-ops."""
        await get_registry(self.app_name).cancel.remote(request_id)

    async def prometheus(self) -> str:
        """Every live target replica's metrics in Prometheus's text format, labelled by ``replica``."""
        from eyas.serve.telemetry import merge_prometheus

        reports = await get_registry(self.app_name).snapshot.remote()
        return merge_prometheus({r["replica"]: r["prometheus"] for r in reports if r.get("prometheus")})

    async def health(self) -> str | None:
        """Why the app cannot serve now (None: it can): a target replica must be reporting and ok, and,
        when the app serves a drafter method, a drafter replica too (Serve's own health checks restart
        a replica; this says whether requests would be answered)."""
        workers = (await self.stats())["workers"]
        for kind in ("target", "drafter") if self.cfg.methods else ("target",):
            if not any(w["kind"] == kind and w.get("ok") for w in workers):
                return f"no {kind} replica is ready"
        return None

    async def stats(self) -> dict:
        """Every live replica's report, merged: workers (leak invariant), per-replica round loops and
        autoscaling stats, and the telemetry of all target replicas (metrics and spans concatenated)."""
        reports = await get_registry(self.app_name).snapshot.remote()
        return merge_reports(reports, self.cfg.scheduler)


def merge_reports(reports: list[dict], scheduler: str) -> dict:
    """One ``Stats`` view of the replicas' registry reports (see ``EyasTarget._report``)."""
    metrics: dict[str, list] = {}
    spans: list[dict] = []
    draft_kv = 0
    for r in reports:
        tel = r.get("telemetry") or {}
        for name, points in tel.get("metrics", {}).items():
            metrics.setdefault(name, []).extend(dict(p, replica=r["replica"]) for p in points)
        spans.extend(tel.get("spans", []))
        if r["kind"] == "drafter":
            draft_kv += r["worker"].get("kv_bytes_allocated", 0)
    metrics.setdefault("eyas.kv_bytes", []).append({"attributes": {"side": "draft"}, "value": draft_kv})
    return {
        "metrics": metrics,
        "spans": spans,
        "workers": [dict(r["worker"], kind=r["kind"], replica=r["replica"]) for r in reports],
        "replicas": {kind: sum(r["kind"] == kind for r in reports) for kind in ("target", "drafter")},
        "scheduler": {"policy": scheduler, "loops": {r["replica"]: r["loop"] for r in reports if "loop" in r}},
        "autoscaling": {r["replica"]: dict(r.get("autoscaling", {}), kind=r["kind"]) for r in reports},
        # each target replica's prefix cache: tokens queried and hit, blocks, bytes held and allowed
        "prefix_cache": {r["replica"]: r["prefix_cache"] for r in reports if "prefix_cache" in r},
    }


def _deployment_options(cfg: ServeConfig, kind: str) -> dict:
    c = cfg.model_dump()
    actor = {"num_cpus": c[f"{kind}_num_cpus"], "num_gpus": c[f"{kind}_num_gpus"]}
    if c[f"{kind}_resources"]:
        actor["resources"] = dict(c[f"{kind}_resources"])
    options = {"ray_actor_options": actor}
    if kind == "target":
        from eyas.serve.routing import router_config

        several = cfg.target_autoscaling is not None or cfg.target_replicas > 1  # one replica: nothing to choose
        options["request_router_config"] = router_config(
            cfg.target_router if several else "power-of-two", cfg.prefix_router_imbalance
        )
    if c[f"{kind}_autoscaling"] is not None:
        options["autoscaling_config"] = c[f"{kind}_autoscaling"]
        options["num_replicas"] = "auto"
    else:
        options["num_replicas"] = c[f"{kind}_replicas"]
    return options


def build_app(args: dict | None = None, deployment_options: dict | None = None):
    """The application builder ``serve run``/``serve deploy`` call (``import_path: eyas.serve.app:build_app``).
    ``deployment_options``: deployment name -> Serve options over the ones the args make (a Serve file's
    ``deployments:``, checked by ``eyas.serve.serve_file``; ``serve deploy`` applies them itself)."""
    extra = deployment_options or {}
    from eyas.serve.deployments import EyasDrafter, EyasTarget

    config = parse_config(args)  # fail here, naming the field, before any replica starts
    for warning in config.warnings():
        log.warning("config.%s", warning)
    # the replicas' own config: the autoscaling sections are the deployments' options only, so that a
    # change of bounds (eyas experiment autoscale releasing its calibration) is Serve's light update,
    # not a restart of every replica
    raw = config.model_dump(exclude={"target_autoscaling", "drafter_autoscaling"})
    drafter = None
    if config.drafter_replicas > 0 or config.drafter_autoscaling is not None:
        drafter = EyasDrafter.options(**_deployment_options(config, "drafter"), **extra.get("EyasDrafter", {})).bind(
            raw
        )
    target = EyasTarget.options(**_deployment_options(config, "target"), **extra.get("EyasTarget", {})).bind(
        raw, drafter
    )
    return EyasServer.options(**extra.get("EyasServer", {})).bind(raw, target)
