"""One table from failure to answer (eyas.serve.errors), and the ingress's protocols answering
through it: the gRPC status, the JSON route's body, the OpenAI body (plain and as an SSE event).
The e2e suite sends real failures (a killed replica, a deadline, overload, refusals) through the
real proxies."""

from __future__ import annotations

import grpc
import pytest

from eyas.serve import app
from eyas.serve.errors import INTERNAL_ERROR, DeadlinePassed, Overloaded, ReplicaLost, failure_of, is_expected

ROWS = [
    (ValueError("max_new_tokens: must be >= 1"), grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"),
    (Overloaded("overloaded: 3 requests in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "overloaded"),
    (ReplicaLost("the target replica serving this request failed"), grpc.StatusCode.UNAVAILABLE, 503, "replica_lost"),
    (DeadlinePassed("deadline: eyas-timeout-ms passed"), grpc.StatusCode.DEADLINE_EXCEEDED, 504, "deadline_exceeded"),
    (RuntimeError("boom at 10.0.0.1 pid=42"), grpc.StatusCode.INTERNAL, 500, "internal_error"),
    (KeyError("token_ids"), grpc.StatusCode.INTERNAL, 500, "internal_error"),
]


class Context:
    """What the ingress sets on a gRPC call's context."""

    def __init__(self):
        self.code, self.details = None, None

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


@pytest.mark.parametrize(("err", "grpc_code", "http", "code"), ROWS)
def test_every_failure_answers_alike_on_grpc_the_json_route_and_the_openai_routes(err, grpc_code, http, code):
    failure = failure_of(err)
    assert (failure.grpc_code, failure.http_status, failure.code) == (grpc_code, http, code)
    internal = grpc_code == grpc.StatusCode.INTERNAL
    assert failure.message == (INTERNAL_ERROR if internal else str(err))
    assert "pid" not in failure.message and "10.0.0.1" not in failure.message
    assert is_expected(err) is not internal
    ctx = Context()  # gRPC (Generate and GenerateStream)
    assert app._failed(ctx, err, "reply") == "reply"
    assert (ctx.code, ctx.details) == (grpc_code, failure.message)
    assert failure.json_body() == {"error": failure.message, "code": code}  # POST /
    openai = app._openai_error(err)  # /v1/*, and each SSE error event
    assert (openai.status, openai.code, openai.message) == (http, code, failure.message)
    assert openai.body()["error"]["type"] == ("invalid_request_error" if http == 400 else "server_error")


def test_overload_and_an_error_finish_use_the_table_too():
    assert (app._overloaded_error().status, app._overloaded_error().code) == (503, "overloaded")
    error = app._server_error()
    assert (error.status, error.code, error.message) == (500, "internal_error", INTERNAL_ERROR)
    ctx = Context()
    app._refused(ctx, Overloaded("overloaded: retry later"), None)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
