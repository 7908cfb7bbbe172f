"""The HTTP front door (eyas.serve.http_api) as an ASGI app, driven in-process over a scripted request
path: the OpenAPI document, the API key as one dependency, 404/405/413 and bad bodies in each route's
error shape, and a failure from the one table answering alike on Eyas's route and OpenAI's. The e2e
suite runs the same app behind Ray Serve's real proxy with the real ``openai`` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
from types import SimpleNamespace

import pytest

from eyas.generate import FINISH_LENGTH
from eyas.serve.errors import Failure, ReplicaLost, failure_of
from eyas.serve.http_api import build_http_app
from eyas.target.loader import encode_prompt, load_tokenizer

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

    def __init__(self, tokenizer, answer=REPORT, api_key=None, metrics_open=True):
        self.cfg = SimpleNamespace(
            api_key=api_key, max_body_bytes=1024, max_inflight_requests=4, metrics_open=metrics_open
        )
        self.unhealthy: str | None = None
        self.tokenizer, self.model_name, self.created, self.inflight = tokenizer, MODEL, 0, 0
        self.max_context = 60  # so that a request without max_tokens stays within _validate's 64
        self.answer, self.cancelled, self.ran, self.started = answer, [], 0, []

    def _validate(self, req):
        if req.max_new_tokens > 64:
            raise ValueError("max_new_tokens: over this test's 64")
        return req, [1, 2]

    async def _drain(self, req, ids, deadline=None):
        self.ran += 1
        return self.answer

    def _request(self, req, ids, deadline=None):
        """The one request path, scripted: the answer's tokens, then its report (or the failure)."""
        self.ran += 1
        self.started.append((req.request_id, req.seed, self.ran))

        async def items():
            if isinstance(self.answer, Failure):
                yield self.answer
                return
            yield {"tokens": list(self.answer["token_ids"]), "first": 0, "finish": self.answer["finish_reason"]}
            yield {"report": {**self.answer, "seed": req.seed}}

        return contextlib.aclosing(items())

    async def cancel(self, request_id):
        self.cancelled.append(request_id)

    async def stats(self):
        return {"workers": []}

    async def prometheus(self):
        return "eyas_requests_total 0\n"

    async def health(self):
        return self.unhealthy


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
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()  # the client stays connected: a streamed answer runs to its end

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
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/",
        "/cancel",
        "/stats",
        "/metrics",
        "/health",
        "/tokenize",
        "/detokenize",
    } <= set(doc["paths"])
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"model", "messages", "max_tokens", "stream", "tree_depth"} <= set(chat["properties"])
    eyas = doc["paths"]["/"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"prompt", "prompt_ids", "max_new_tokens", "method"} <= set(eyas["properties"])


def test_the_api_key_guards_every_route_but_the_schema_health_and_metrics(tokenizer):
    app = build_http_app(Server(tokenizer, api_key="k3y"))
    for method, path in (("GET", "/v1/models"), ("GET", "/stats"), ("POST", "/tokenize"), ("POST", "/")):
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
    status, body = call(app, "POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 0}).encode())
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


def test_n_choices_run_choice_0_first_then_the_rest_each_with_its_own_seed(tokenizer):
    """n = 3: three choices in index order, seeds seed, seed + 1, seed + 2; a named request's
    choices are named <id>, <id>#1, <id>#2; the prompt counted once in usage, every choice's tokens;
    streamed, each choice's deltas and finish carry its index."""
    server = Server(tokenizer, answer={**REPORT, "token_ids": tokenizer.encode("Hi")})
    app = build_http_app(server)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": 3, "seed": 5}
    status, body = call(app, "POST", "/v1/chat/completions", json.dumps({**chat, "request_id": "q"}).encode())
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["Hi"] * 3
    assert [(rid, seed) for rid, seed, _ in server.started] == [("q", 5), ("q#1", 6), ("q#2", 7)]
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["prompt_tokens"] == len(
        encode_prompt(tokenizer, "hi")
    )  # the prompt counted once
    assert [c["seed"] for c in body["eyas"]["choices"]] == [5, 6, 7]
    status, text = call(app, "POST", "/v1/chat/completions", json.dumps({**chat, "stream": True}).encode())
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    by_index = {i: [e for e in events if e["choices"] and e["choices"][0]["index"] == i] for i in range(3)}
    for i, es in by_index.items():
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in es) == "Hi", i
        assert es[-1]["choices"][0]["finish_reason"] == "length"
    assert text.rstrip().endswith("data: [DONE]")
    status, body = call(app, "POST", "/v1/chat/completions", json.dumps({**chat, "n": 17}).encode())
    assert status == 400 and body["error"]["param"] == "n"


def test_the_operator_routes_health_tokenize_detokenize_model_and_an_open_metrics(tokenizer):
    """/health (200 ready, 503 naming what is missing) and /metrics answer without the API key, every
    other route still asks for it; /tokenize a prompt or a conversation as the OpenAI routes encode
    them, /detokenize as an answer's text is made, refusing a bad id by name; /v1/models/{id}."""
    server = Server(tokenizer, api_key="k3y")
    app = build_http_app(server)
    key = {"Authorization": "Bearer k3y"}
    assert call(app, "GET", "/health") == (200, {"status": "ok"})
    server.unhealthy = "no drafter replica is ready"
    assert call(app, "GET", "/health") == (503, {"status": "unavailable", "reason": "no drafter replica is ready"})
    assert call(app, "GET", "/metrics")[0] == 200
    assert call(app, "POST", "/tokenize", b'{"prompt": "Hi"}')[0] == 401
    status, body = call(app, "POST", "/tokenize", b'{"prompt": "Hi there"}', key)
    assert status == 200 and body["tokens"] == encode_prompt(tokenizer, "Hi there", raw=True) and body["count"] == 2
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi!"}]}).encode()
    status, body = call(app, "POST", "/tokenize", chat, key)
    assert status == 200 and body["tokens"] == encode_prompt(tokenizer, "Hi!")
    status, body = call(app, "POST", "/detokenize", json.dumps({"tokens": body["tokens"]}).encode(), key)
    assert status == 200 and "Hi!" in body["prompt"]
    status, body = call(app, "POST", "/detokenize", b'{"tokens": [1, 99999999]}', key)
    assert status == 400 and body["error"].startswith("tokens: 99999999 is not a token id")
    status, body = call(app, "POST", "/tokenize", b'{"prompt": "a", "messages": []}', key)
    assert status == 400 and body["error"].startswith("prompt: give prompt or messages")
    status, body = call(app, "POST", "/tokenize", b'{"text": "a"}', key)
    assert status == 400 and body["error"].startswith("text: ")
    assert call(app, "GET", f"/v1/models/{MODEL}", headers=key)[1]["id"] == MODEL
    status, body = call(app, "GET", "/v1/models/gpt-4o", headers=key)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    closed = build_http_app(Server(tokenizer, api_key="k3y", metrics_open=False))
    assert call(closed, "GET", "/metrics")[0] == 401 and call(closed, "GET", "/health")[0] == 200
