"""One table from failure to answer (eyas.serve.errors), and one request path (``EyasServer._request``)
that every protocol of the ingress runs through: each failure, raised where it happens (at admission,
in the replica's stream, as an error finish), reaches the gRPC status, the JSON routes' body and the
OpenAI body (plain and as an SSE event) alike, and the request is cancelled in its replica every time.
The e2e suite sends real failures (a killed replica, a deadline, overload, refusals) through the
real proxies."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from eyas.generate import FINISH_ERROR, FINISH_LENGTH
from eyas.serve import app, http_api
from eyas.serve.errors import (
    INTERNAL_ERROR,
    DeadlinePassed,
    Failure,
    NotFound,
    Overloaded,
    ReplicaLost,
    TooLarge,
    Unauthenticated,
    failure_of,
    is_expected,
)

ROWS = [
    (ValueError("max_new_tokens: must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"),
    (Overloaded("overloaded: 3 requests in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "overloaded"),
    (ReplicaLost("the target replica serving this request failed"), grpc.StatusCode.UNAVAILABLE, 503, "replica_lost"),
    (DeadlinePassed("deadline: eyas-timeout-ms passed"), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "deadline_exceeded"),
    (RuntimeError("boom at 10.0.0.1 pid=42"), grpc.StatusCode.INTERNAL, 500, "internal_error"),
    (KeyError("token_ids"), grpc.StatusCode.INTERNAL, 500, "internal_error"),
]
# refusals made at the edge, before a request runs: rows of the same table
EDGE_ROWS = [
    (Unauthenticated("missing or wrong API key"), grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key"),
    (NotFound("model: 'x' does not exist"), grpc.StatusCode.NOT_FOUND, 404, "model_not_found"),
    (
        TooLarge("request: the body is 9 bytes, over the 8-byte limit"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        413,
        "request_too_large",
    ),
]


class Context:
    """What the ingress sets on a gRPC call's context."""

    def __init__(self):
        self.code, self.details = None, None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


class Stream:
    """A target stream that sends one round's tokens, then ``then`` (an item, or an exception to raise)."""

    def __init__(self, then):
        self.then, self.cancelled = then, 0

    async def _items(self):
        yield {"tokens": [7]}
        if isinstance(self.then, BaseException):
            raise self.then
        yield self.then

    def __aiter__(self):
        return self._items()

    def cancel(self):
        self.cancelled += 1


class Server:
    """The ingress's request path (the real methods of ``EyasServer``) over a scripted ``_start``."""

    _request = app.EyasServer.func_or_class._request
    _items = app.EyasServer.func_or_class._items
    _drain = app.EyasServer.func_or_class._drain

    def __init__(self, then=None, refuse: Exception | None = None):
        self.stream, self.refuse = Stream(then), refuse

    def _start(self, req, ids, deadline=None):
        if self.refuse is not None:
            raise self.refuse
        return self.stream


def _report(finish: str) -> dict:
    return {"report": {"finish_reason": finish, "token_ids": [7], "text": "x"}}


@pytest.mark.parametrize(("err", "grpc_code", "http", "code"), ROWS + EDGE_ROWS)
def test_every_failure_answers_alike_on_grpc_the_json_route_and_the_openai_routes(err, grpc_code, http, code):
    failure = failure_of(err)
    assert (failure.grpc_code, failure.http_status, failure.code) == (grpc_code, http, code)
    internal = grpc_code == grpc.StatusCode.INTERNAL
    assert failure.message == (INTERNAL_ERROR if internal else str(err))
    assert "pid" not in failure.message and "10.0.0.1" not in failure.message
    assert is_expected(err) is not internal
    ctx = Context()  # gRPC (Generate and GenerateStream)
    assert app._grpc_answer(ctx, failure, "reply") == "reply"
    assert (ctx.code, ctx.details) == (grpc_code, failure.message)
    assert failure.json_body() == {"error": failure.message, "code": code}  # POST /
    assert http_api.json_failure(failure).status_code == http
    openai = http_api.openai_error(failure)  # /v1/*, and each SSE error event
    assert (openai.status, openai.code, openai.message) == (http, code, failure.message)
    assert openai.body()["error"]["type"] == ("invalid_request_error" if http < 500 else "server_error")
    # a refusal names the OpenAI parameter (Eyas's max_new_tokens is OpenAI's max_tokens); a failure none
    assert openai.param == ("max_tokens" if http == 400 else None)


@pytest.mark.parametrize(("err", "grpc_code", "http", "code"), [r for r in ROWS if r[2] != 400])
def test_a_failure_in_the_replicas_stream_ends_the_request_path_with_its_row_and_cancels(err, grpc_code, http, code):
    """Raised mid-stream (after a round's tokens): every protocol's drain gets the table's Failure, the
    tokens before it were passed on, and the request was cancelled in its replica once."""
    server = Server(then=err)

    async def items():
        async with server._request(None, [1]) as it:
            return [item async for item in it]

    got = asyncio.run(items())
    assert got[0] == {"tokens": [7]} and isinstance(got[-1], Failure) and len(got) == 2
    assert (got[-1].grpc_code, got[-1].http_status, got[-1].code) == (grpc_code, http, code)
    assert server.stream.cancelled == 1
    again = Server(then=err)
    assert asyncio.run(again._drain(None, [1])) == got[-1] and again.stream.cancelled == 1


def test_admission_a_refusal_in_the_replica_and_an_error_finish_use_the_table_too():
    full = asyncio.run(Server(refuse=Overloaded("overloaded: retry later"))._drain(None, [1]))
    assert (full.grpc_code, full.http_status, full.code) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "overloaded")
    refused = Server(then={"invalid": "prompt_ids: 9000 tokens do not fit"})
    failure = asyncio.run(refused._drain(None, [1]))
    assert (failure.http_status, failure.message) == (400, "prompt_ids: 9000 tokens do not fit")
    errored = Server(then=_report(FINISH_ERROR))
    failure = asyncio.run(errored._drain(None, [1]))
    assert (failure.grpc_code, failure.http_status, failure.message) == (grpc.StatusCode.INTERNAL, 500, INTERNAL_ERROR)
    assert refused.stream.cancelled == errored.stream.cancelled == 1
    cut = Server(then={"tokens": [8]})  # the stream ended without its report
    failure = asyncio.run(cut._drain(None, [1]))
    assert (failure.http_status, failure.message) == (500, INTERNAL_ERROR) and cut.stream.cancelled == 1
    done = Server(then=_report(FINISH_LENGTH))
    assert asyncio.run(done._drain(None, [1]))["finish_reason"] == FINISH_LENGTH and done.stream.cancelled == 1


def test_a_caller_that_stops_reading_cancels_the_request_at_once():
    """A client that goes away: the protocol's loop leaves the block after the first round; the
    request is cancelled then, not when the generator is collected."""
    server = Server(then=_report(FINISH_LENGTH))

    async def first_round_only():
        async with server._request(None, [1]) as it:
            async for _ in it:
                break
        return server.stream.cancelled

    assert asyncio.run(first_round_only()) == 1
