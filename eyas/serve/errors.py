"""How a failed request answers, on every protocol: one table from failure to gRPC status, HTTP
status and OpenAI error.

Terms:
    refusal     the client's mistake, found before or while the request starts (a bad field, a prompt
                too long for the context): a ``ValueError`` whose message names the field.
    failure     anything that stops a request the server accepted: the ingress is full, the target
                replica serving it was lost and none resumed it, its deadline passed, or an error
                inside the server (the log has it; the client is told only that it happened).

The gRPC methods (``Generate``, ``GenerateStream``), Eyas's JSON route (``POST /``) and the OpenAI
routes (``/v1/*``, plain and streamed) all answer through :func:`failure_of`, so a lost replica is
UNAVAILABLE over gRPC and a 503 over HTTP on every route. No message carries internals: an internal
error's message is :data:`INTERNAL_ERROR`, the others' are written for the client.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

INTERNAL_ERROR = "internal error: the request failed in the server; retry it"  # what a client sees


class Overloaded(Exception):
    """The ingress already runs ``max_inflight_requests`` requests."""

    @classmethod
    def at(cls, inflight: int) -> Overloaded:
        return cls(f"overloaded: {inflight} requests in flight (max_inflight_requests); retry later")


class ReplicaLost(Exception):
    """The target replica running a request died and no replica resumed it in time. Its message is
    what the client sees: no pid, address or traceback."""


class DeadlinePassed(Exception):
    """The request's ``eyas-timeout-ms`` passed before it finished; it was cancelled in its replica.
    Its message is what the client sees."""


class Unauthenticated(Exception):
    """A missing or wrong API key. Its message is what the client sees (never a key)."""


class NotFound(Exception):
    """A model this server does not serve."""


class TooLarge(Exception):
    """A request body over ``max_body_bytes``."""


@dataclass(frozen=True, kw_only=True)
class Failure:
    """What one failure answers on each protocol."""

    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str  # OpenAI's error ``type``
    code: str  # OpenAI's error ``code`` (and Eyas's JSON route's)
    message: str  # what the client is told

    def json_body(self) -> dict:
        """The error on Eyas's JSON route (``POST /``)."""
        return {"error": self.message, "code": self.code}


# failure -> (gRPC status, HTTP status, OpenAI type, code); the message is the exception's own
TABLE: dict[type[Exception], tuple[grpc.StatusCode, int, str, str]] = {
    ValueError: (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "invalid_request"),
    Overloaded: (grpc.StatusCode.RESOURCE_EXHAUSTED, 503, "server_error", "overloaded"),
    ReplicaLost: (grpc.StatusCode.UNAVAILABLE, 503, "server_error", "replica_lost"),
    DeadlinePassed: (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "server_error", "deadline_exceeded"),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", "invalid_api_key"),
    NotFound: (grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found"),
    TooLarge: (grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error", "request_too_large"),
}
INTERNAL = (grpc.StatusCode.INTERNAL, 500, "server_error", "internal_error")


def failure_of(err: BaseException) -> Failure:
    """The answer to ``err`` on every protocol: its row of :data:`TABLE`, else an internal error whose
    message says nothing of the exception (the caller logs it)."""
    for kind, (grpc_code, http_status, openai_type, code) in TABLE.items():
        if isinstance(err, kind):
            return Failure(
                grpc_code=grpc_code, http_status=http_status, openai_type=openai_type, code=code, message=str(err)
            )
    grpc_code, http_status, openai_type, code = INTERNAL
    return Failure(
        grpc_code=grpc_code, http_status=http_status, openai_type=openai_type, code=code, message=INTERNAL_ERROR
    )


def is_expected(err: BaseException) -> bool:
    """A failure the server anticipates (logged as a warning, without a traceback): any row of the table."""
    return isinstance(err, tuple(TABLE))
