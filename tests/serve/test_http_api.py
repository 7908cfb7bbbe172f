"""The HTTP front door (eyas.serve.http_api) as an ASGI app, driven in-process over a scripted request
path: the OpenAPI document, the API key as one dependency, 404/405/413 and bad bodies in each route's
error shape, and a failure from the one table answering alike on Eyas's route and OpenAI's. The e2e
suite runs the same app behind Ray Serve's real proxy with the real ``openai`` client."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from eyas.generate import FINISH_LENGTH
from eyas.serve.errors import Failure, ReplicaLost, failure_of
from eyas.serve.http_api import build_http_app
from eyas.target.loader import load_tokenizer

MODEL = "smollm2-135m"
REPORT = {
    "token_ids": [42],
    "text": "Hi",
    "finish_reason": FINISH_LENGTH,
    "new_tokens": 1,
    "method": "target",
    "accept_length_mean": 1.0,
    "target_forwards": 1,
    "drafter_fallback": False,
    "cached_tokens": 0,
}


class Server:
    """What the HTTP app uses of an ``EyasServer`` replica, with a scripted answer per request."""

    def __init__(self, tokenizer, answer=REPORT, api_key=None):
        self.cfg = SimpleNamespace(api_key=api_key, max_body_bytes=1024, max_inflight_requests=4)
        self.tokenizer, self.model_name, self.created, self.inflight = tokenizer, MODEL, 0, 0
        self.max_context = 60  # so that a request without max_tokens stays within _validate's 64
        self.answer, self.cancelled, self.ran = answer, [], 0

    def _validate(self, request):
        if request.max_new_tokens > 64:
            raise ValueError("max_new_tokens: over this test's 64")
        return request, [1, 2]

    async def _drain(self, req, ids, deadline=None):
        self.ran += 1
        return self.answer

    async def cancel(self, request_id):
        self.cancelled.append(request_id)

    async def stats(self):
        return {"workers": []}

    async def prometheus(self):
        return "eyas_requests_total 0\n"


def call(app, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, object]:
    """(status, JSON body or text) of one HTTP request to the ASGI ``app``."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        + [(b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    sent = []
    incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    raw = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_openapi_lists_every_route_with_its_typed_body(tokenizer):
    status, doc = call(build_http_app(Server(tokenizer)), "GET", "/openapi.json")
    assert status == 200
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/", "/cancel", "/stats", "/metrics"} <= set(
        doc["paths"]
    )
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "messages", "max_tokens", "stream", "tree_depth"} <= set(chat["properties"])
    eyas = doc["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "prompt_ids", "max_new_tokens", "method"} <= set(eyas["properties"])


def test_the_api_key_guards_every_route_but_the_schema(tokenizer):
    app = build_http_app(Server(tokenizer, api_key="k3y"))
    for method, path in (("GET", "/v1/models"), ("GET", "/stats"), ("GET", "/metrics"), ("POST", "/")):
        status, body = call(app, method, path, b"{}")
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (path, body)
        assert "k3y" not in json.dumps(body)
    status, body = call(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert status == 401
    status, body = call(app, "GET", "/v1/models", headers={"Authorization": "Bearer k3y"})
    assert status == 200 and body["data"][0]["id"] == MODEL
    assert call(app, "GET", "/openapi.json")[0] == 200


def test_unknown_routes_methods_large_and_bad_bodies_answer_in_the_routes_shape(tokenizer):
    server = Server(tokenizer)
    app = build_http_app(server)
    status, body = call(app, "GET", "/v1/nope")
    assert status == 404 and body["error"]["code"] == "not_found" and body["error"]["message"].startswith("/v1/nope: ")
    status, body = call(app, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    status, body = call(app, "POST", "/nope", b"{}")
    assert status == 404 and body["code"] == "not_found" and body["error"].startswith("/nope: ")
    big = b'{"prompt": "' + b"a" * 2000 + b'"}'
    status, body = call(app, "POST", "/", big)
    assert status == 413 and body["error"].startswith("request: the body is ")
    status, body = call(app, "POST", "/v1/completions", big)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    status, body = call(app, "POST", "/", b"[" * 500 + b"]" * 500)
    assert status == 400 and body["error"] == "request: the body must be a JSON object"
    status, body = call(app, "POST", "/", b"{")
    assert status == 400 and body["error"].startswith("request: the body is not JSON")
    status, body = call(app, "POST", "/", b'{"prompt": "hi", "colour": "red"}')
    assert status == 400 and body["error"].startswith("colour: ")
    status, body = call(app, "POST", "/", b'{"prompt": "hi", "max_new_tokens": 65}')
    assert status == 400 and body["error"].startswith("max_new_tokens: ")
    status, body = call(app, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 2}).encode())
    assert status == 400 and body["error"]["param"] == "n"
    status, body = call(app, "POST", "/cancel", b'{"request_id": ""}')
    assert status == 400 and body["error"].startswith("request_id: ")
    assert server.ran == 0 and server.cancelled == []  # nothing ran for a refused request


def test_a_request_runs_and_a_failure_answers_from_the_table_on_both_routes(tokenizer):
    server = Server(tokenizer)
    app = build_http_app(server)
    status, body = call(app, "POST", "/", b'{"prompt": "hi", "max_new_tokens": 1}')
    assert (status, body) == (200, REPORT)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    status, body = call(app, "POST", "/v1/chat/completions", json.dumps(chat).encode())
    assert (
        status == 200 and body["choices"][0]["message"]["content"] == "Hi" and body["usage"]["completion_tokens"] == 1
    )
    assert call(app, "POST", "/cancel", b'{"request_id": "r1"}') == (200, {}) and server.cancelled == ["r1"]
    assert call(app, "GET", "/metrics") == (200, "eyas_requests_total 0\n")
    assert call(app, "GET", "/stats") == call(app, "GET", "/") == (200, {"workers": []})
    lost: Failure = failure_of(ReplicaLost("the target replica serving this request failed; retry the request"))
    server.answer = lost
    status, body = call(app, "POST", "/", b'{"prompt": "hi", "max_new_tokens": 1}')
    assert (status, body) == (503, {"error": lost.message, "code": "replica_lost"})
    status, body = call(app, "POST", "/v1/chat/completions", json.dumps(chat).encode())
    assert status == 503 and body["error"] == {
        "message": lost.message,
        "type": "server_error",
        "param": None,
        "code": "replica_lost",
    }
