"""The HTTP front door of the Serve app: one FastAPI app under Serve's ingress, beside the gRPC methods.

:class:`EyasServer` (``eyas/serve/app.py``) is a ``@serve.ingress`` deployment: Ray Serve 2.60 sends
HTTP to the ASGI app that :func:`build_http_app` builds for each replica, and gRPC to the class's
``Generate``/``GenerateStream``/``Stats``/``Cancel`` methods, both on the same replica. Every route
runs a request through the replica's one request path (``EyasServer._request``), whose failures
answer from the one table (``eyas/serve/errors.py``).

Routes (``GET /openapi.json`` lists them, ``GET /docs`` renders it):

- the OpenAI API: ``POST /v1/chat/completions``, ``POST /v1/completions`` (plain, or server-sent
  events with ``stream: true``; a client that closes the stream cancels its request), ``GET
  /v1/models``. Errors in OpenAI's shape, ``param`` naming the parameter.
- Eyas's own: ``POST /`` (the fields of :class:`eyas.protocol.schema.GenerateRequest`; the report
  back), ``POST /cancel`` (``{"request_id"}``), ``GET /stats`` (and ``GET /``: every replica's report,
  merged), ``GET /metrics`` (Prometheus text of every target replica). Errors as ``{"error": "<field>:
  <why>", ...}``.

Terms:
    request body  read by Eyas, not by FastAPI: bounded in size (``max_body_bytes``, else 413) and in
                  nesting (a parser's recursion error is a 400) before any parse, then validated by the
                  same pydantic models the OpenAPI document declares (``openapi_extra``), so that a bad
                  field is a 400 naming it, in the route's error shape, never FastAPI's 422.
    API key       one app-wide dependency (:func:`check_api_key`): a missing or wrong key is a 401 in
                  OpenAI's shape on every route but the schema pages (``/openapi.json``, ``/docs``),
                  which describe the API and hold nothing of a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Protocol

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from eyas.protocol.schema import CancelRequest, GenerateRequest, parse_cancel, parse_request
from eyas.protocol.text import AnswerText
from eyas.serve import openai_api as oai
from eyas.serve.errors import Failure, Overloaded, TooLarge, failure_of
from eyas.target.loader import encode_prompt


class Ingress(Protocol):
    """What the HTTP app uses of its ``EyasServer`` replica (``eyas/serve/app.py``)."""

    cfg: object  # the ServeConfig: api_key, max_body_bytes, max_inflight_requests
    tokenizer: object
    model_name: str
    created: int
    inflight: int  # admitted requests
    max_context: int  # the target's context: what an OpenAI request without max_tokens may fill

    def _validate(self, req: GenerateRequest) -> tuple[GenerateRequest, list[int]]: ...

    def _request(self, req: GenerateRequest, ids: list[int], deadline: float | None = None): ...

    async def _drain(self, req: GenerateRequest, ids: list[int], deadline: float | None = None) -> dict | Failure: ...

    async def cancel(self, request_id: str) -> None: ...

    async def stats(self) -> dict: ...

    async def prometheus(self) -> str: ...

    async def health(self) -> str | None: ...


PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def openai_error(failure: Failure) -> oai.OpenAIError:
    """A failure from the one table in OpenAI's shape; a refusal's ``param`` names the parameter."""
    return oai.OpenAIError.of(failure, param=oai.param_of(failure.message) if failure.http_status == 400 else None)


def openai_response(error: oai.OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def json_failure(failure: Failure) -> JSONResponse:
    """A failure on Eyas's JSON routes."""
    return JSONResponse(failure.json_body(), status_code=failure.http_status)


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def read_body(request: Request, max_body_bytes: int) -> object:
    """The request's JSON body: bounded in size, and in nesting (a parser's recursion error is a 400)."""
    raw = await request.body()
    if len(raw) > max_body_bytes:
        raise openai_error(
            failure_of(TooLarge(f"request: the body is {len(raw)} bytes, over the {max_body_bytes}-byte limit"))
        )
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise oai.OpenAIError(f"request: the body is not JSON ({err})") from None
    except RecursionError:
        raise oai.OpenAIError("request: the body nests too deeply") from None


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt or a conversation (vLLM's route)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[oai.Message] | None = None


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids (vLLM's route)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def _first_error(err: ValidationError) -> str:
    """A pydantic error as Eyas's ``field: why``."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "request"
    return f"{where}: {'is not a field of this route' if first['type'] == 'extra_forbidden' else first['msg']}"


def _body_schema(model) -> dict:
    """``openapi_extra`` declaring ``model`` as a route's JSON body (the route reads the body itself)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def _is_openai(request: Request) -> bool:
    path = request.url.path
    root = request.scope.get("root_path", "").rstrip("/")
    path = path[len(root) :] if root and path.startswith(root) else path
    return path == "/v1" or path.startswith("/v1/")


def build_http_app(server: Ingress) -> FastAPI:
    """The HTTP API of one ``EyasServer`` replica (called by Serve when the replica starts)."""
    cfg = server.cfg

    open_paths = {"/health"} | ({"/metrics"} if getattr(cfg, "metrics_open", True) else set())

    async def check_api_key(request: Request) -> None:
        root = request.scope.get("root_path", "").rstrip("/")
        path = request.url.path
        if (path[len(root) :] if root and path.startswith(root) else path) in open_paths:
            return  # a load balancer's probe and a scraper carry no key
        oai.check_api_key(cfg.api_key, request.headers.get("authorization"))

    app = FastAPI(
        title="Eyas",
        summary="Speculative decoding on Ray: the OpenAI API, and Eyas's own JSON routes.",
        version="0.1.0",
        dependencies=[Depends(check_api_key)],
    )

    @app.exception_handler(oai.OpenAIError)
    async def _openai_refusal(request: Request, err: oai.OpenAIError):
        if _is_openai(request) or err.status == 401:  # a key refusal answers in OpenAI's shape everywhere
            return openai_response(err)
        return JSONResponse({"error": err.message, "code": err.code or "invalid_request"}, status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(request: Request, err: StarletteHTTPException):
        """404 and 405, in the route's error shape, naming the routes there are."""
        path = request.url.path
        if err.status_code == 404:
            message = (
                f"{path}: no such route (/v1/chat/completions, /v1/completions, /v1/models, /, /cancel, /stats, "
                "/metrics, /health, /tokenize, /detokenize)"
            )
            code = "not_found"
        elif err.status_code == 405:
            message, code = f"{path}: method {request.method} is not allowed here", "method_not_allowed"
        else:
            message, code = str(err.detail), "http_error"
        if _is_openai(request):
            return openai_response(oai.OpenAIError(message, status=err.status_code, code=code))
        return JSONResponse({"error": message, "code": code}, status_code=err.status_code)

    # --- the OpenAI API ------------------------------------------------------------------------------
    @app.get("/v1/models", tags=["openai"])
    async def models() -> dict:
        return oai.models(server.model_name, server.created)

    @app.get("/v1/models/{model_id}", tags=["openai"])
    async def model(model_id: str):
        if model_id != server.model_name:
            raise oai.model_not_found(model_id, server.model_name)
        return oai.models(server.model_name, server.created)["data"][0]

    @app.post("/v1/chat/completions", tags=["openai"], openapi_extra=_body_schema(oai.ChatRequest))
    async def chat_completions(request: Request):
        return await _openai(request, oai.CHAT)

    @app.post("/v1/completions", tags=["openai"], openapi_extra=_body_schema(oai.CompletionRequest))
    async def completions(request: Request):
        return await _openai(request, oai.COMPLETION)

    async def _openai(request: Request, kind: str):
        parsed = oai.parse_openai(
            kind, await read_body(request, cfg.max_body_bytes), server.tokenizer, server.model_name, server.max_context
        )
        try:
            req, ids = server._validate(parsed.request)
        except ValueError as err:
            raise oai.invalid(str(err)) from None
        response_id = ("chatcmpl-" if kind == oai.CHAT else "cmpl-") + (req.request_id or uuid.uuid4().hex)
        if server.inflight + parsed.n > cfg.max_inflight_requests:  # a 503 status, before any event is sent
            return openai_response(openai_error(failure_of(Overloaded.at(server.inflight))))
        reqs = oai.choice_requests(req, parsed.n)
        if parsed.stream:
            return StreamingResponse(_sse(parsed, reqs, ids, response_id), media_type="text/event-stream")
        reports: dict[int, dict] = {}
        logprobs = [[] for _ in reqs] if req.logprobs is not None else None
        async with contextlib.aclosing(_choices(reqs, ids)) as items:
            async for i, item in items:
                if isinstance(item, Failure):
                    return openai_response(openai_error(item))
                if "report" in item:
                    reports[i] = item["report"]
                elif logprobs is not None:
                    logprobs[i].extend(item.get("logprobs", ()))
        answer = [reports[i] for i in range(len(reqs))]
        return JSONResponse(oai.response(parsed, response_id, oai.now(), answer, logprobs))

    async def _choices(reqs: list[GenerateRequest], ids: list[int]):
        """The items of a request's choices through the one request path, merged as ``(index,
        item)``. Choice 0 runs first; the others start once its first token arrived: its prompt is
        then committed and in its replica's prefix cache, so theirs is copied, not recomputed (with
        several replicas the router sends them to the one that holds it). Leaving the generator
        (the answer is complete, the client went away, a failure) cancels every choice."""
        queue: asyncio.Queue = asyncio.Queue()
        tasks: list[asyncio.Task] = []

        async def pump(i: int, req: GenerateRequest) -> None:
            try:
                async with server._request(req, ids) as items:
                    async for item in items:
                        if i == 0 and len(tasks) < len(reqs):
                            tasks.extend(asyncio.create_task(pump(j, r)) for j, r in enumerate(reqs[1:], 1))
                        await queue.put((i, item))
            finally:
                queue.put_nowait((i, None))  # this choice ended

        tasks.append(asyncio.create_task(pump(0, reqs[0])))
        ended = 0
        try:
            while ended < len(tasks):
                i, item = await queue.get()
                if item is None:
                    ended += 1
                    continue
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sse(parsed: oai.OpenAIRequest, reqs: list[GenerateRequest], ids: list[int], response_id: str):
        """Server-sent events: per choice a chunk per round that added text and its finish, then the
        usage (when asked for), then ``[DONE]``; a failure is one error event. A client that closes
        the stream cancels the request (every choice's path has a ``finally``)."""
        created = oai.now()
        texts = [
            AnswerText(server.tokenizer, r.stop, r.min_tokens) for r in reqs
        ]  # the gRPC stream's rule (eyas/protocol/text.py)
        reports: dict[int, dict] = {}
        if parsed.kind == oai.CHAT:
            for i in range(len(reqs)):
                yield sse_event(oai.chunk(parsed, response_id, created, None, None, role=True, index=i))
        async with contextlib.aclosing(_choices(reqs, ids)) as items:
            async for i, item in items:
                if isinstance(item, Failure):
                    yield sse_event(openai_error(item).body())
                    return
                if "tokens" in item:
                    before = len(texts[i].detok.text)
                    delta = texts[i].push(item["tokens"])
                    lp = (
                        oai.logprobs_object(parsed, item["tokens"], item.get("logprobs", []), before)
                        if reqs[i].logprobs is not None
                        else None
                    )
                    if delta or lp:
                        yield sse_event(oai.chunk(parsed, response_id, created, delta, None, index=i, logprobs=lp))
                    continue
                reports[i] = report = item["report"]
                delta = texts[i].finish()
                if delta:
                    yield sse_event(oai.chunk(parsed, response_id, created, delta, None, index=i))
                reason = oai.finish_reason(report["finish_reason"])
                yield sse_event(oai.chunk(parsed, response_id, created, None, reason, index=i))
        if parsed.include_usage and len(reports) == len(reqs):
            yield sse_event(oai.usage_chunk(parsed, response_id, created, [reports[i] for i in range(len(reqs))]))
        yield "data: [DONE]\n\n"

    # --- Eyas's own routes ---------------------------------------------------------------------------
    async def json_object(request: Request) -> dict:
        body = await read_body(request, cfg.max_body_bytes)
        if not isinstance(body, dict):
            raise ValueError("request: the body must be a JSON object")
        return body

    @app.post("/", tags=["eyas"], openapi_extra=_body_schema(GenerateRequest))
    async def generate(request: Request):
        """Run one request to the end; the report back (tokens, text, finish reason, statistics)."""
        try:
            req, ids = server._validate(parse_request(**await json_object(request)))
        except ValueError as err:
            return json_failure(failure_of(err))
        report = await server._drain(req, ids)
        if isinstance(report, Failure):
            return json_failure(report)
        return JSONResponse(report)

    @app.post("/cancel", tags=["eyas"], openapi_extra=_body_schema(CancelRequest))
    async def cancel(request: Request):
        """Stop the named request at its next round boundary (idempotent; an unknown name is a no-op)."""
        try:
            await server.cancel(parse_cancel(**await json_object(request)).request_id)
        except ValueError as err:
            return json_failure(failure_of(err))
        return JSONResponse({})

    @app.get("/stats", tags=["eyas"])
    @app.get("/", tags=["eyas"], include_in_schema=False)
    async def stats():
        """Every live replica's report, merged (``eyas stats``)."""
        return JSONResponse(json.loads(json.dumps(await server.stats(), default=str)))

    @app.get("/health", tags=["operator"])
    async def health():
        """200 once a target replica (and a drafter replica, when the app serves a drafter method)
        reports ready; 503 naming what is missing otherwise. Open without the API key."""
        why = await server.health()
        if why is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "reason": why}, status_code=503)

    @app.post("/tokenize", tags=["operator"], openapi_extra=_body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        """The target's token ids of a prompt (as /v1/completions feeds it) or of a conversation (through
        the chat template, as /v1/chat/completions does): ``{"tokens", "count", "max_model_len"}``."""
        try:
            body = TokenizeRequest.model_validate(await json_object(request))
        except ValidationError as err:
            return json_failure(failure_of(ValueError(_first_error(err))))
        if (body.prompt is None) == (body.messages is None):
            return json_failure(failure_of(ValueError("prompt: give prompt or messages, not both or neither")))
        if body.messages is not None:
            if not body.messages:
                return json_failure(failure_of(ValueError("messages: at least one message")))
            ids = oai.render_messages(server.tokenizer, body.messages)
        else:
            ids = encode_prompt(server.tokenizer, body.prompt, raw=True)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": server.max_context})

    @app.post("/detokenize", tags=["operator"], openapi_extra=_body_schema(DetokenizeRequest))
    async def detokenize(request: Request):
        """The text of token ids, as an answer's text is made (special tokens skipped): ``{"prompt"}``."""
        try:
            body = DetokenizeRequest.model_validate(await json_object(request))
        except ValidationError as err:
            return json_failure(failure_of(ValueError(_first_error(err))))
        vocab = len(server.tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            return json_failure(failure_of(ValueError(f"tokens: {bad} is not a token id (0 to {vocab - 1})")))
        return JSONResponse({"prompt": AnswerText.of(server.tokenizer, body.tokens)})

    @app.get("/metrics", tags=["eyas"], response_class=Response)
    async def metrics():
        """Every live target replica's metrics in Prometheus's text format, labelled by ``replica``."""
        return Response(await server.prometheus(), media_type=PROMETHEUS_TEXT)

    return app
