"""The ingress's resume of a request whose target replica died (``app._Resuming``), on scripted
streams: the prefix is sent again with the tokens still owed, the report covers the whole answer,
and past the resume timeout the client gets a clean ``ReplicaLost``. (The e2e twin kills a real
replica: tests/e2e/test_serve.py.)"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError

from eyas.protocol.schema import parse_request
from eyas.serve import app
from eyas.serve.errors import INTERNAL_ERROR, failure_of
from eyas.target.loader import load_tokenizer


class Scripted:
    """A replica stream that yields ``items`` then raises ``error`` (None: ends normally)."""

    def __init__(self, items, error=None):
        self.items, self.error, self.cancelled = items, error, False

    async def _gen(self):
        for item in self.items:
            yield item
        if self.error is not None:
            raise self.error

    def __aiter__(self):
        return self._gen()

    def cancel(self):
        self.cancelled = True


def run(stream) -> list[dict]:
    async def collect():
        return [item async for item in stream]

    return asyncio.run(collect())


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_a_lost_replica_resumes_from_the_committed_prefix(tokenizer, monkeypatch):
    monkeypatch.setattr(app, "RESUME_BACKOFF_S", 0.0)
    calls, released = [], []
    scripts = [
        Scripted([{"tokens": [10, 11]}, {"tokens": [12]}], ActorDiedError()),
        Scripted(
            [
                {"tokens": [13, 14]},
                {"report": {"token_ids": [13, 14], "new_tokens": 2, "text": "x", "finish_reason": "length"}},
            ]
        ),
    ]

    def start(req, ids):
        calls.append((req.max_new_tokens, req.seed, list(ids)))
        return scripts[len(calls) - 1]

    req = parse_request(prompt="hi", max_new_tokens=5, seed=7, temperature=0.5)
    stream = app._Resuming(start, req, [1, 2], tokenizer, lambda: released.append(1), resume_timeout_s=5)
    items = run(stream)
    assert calls == [(5, 7, [1, 2]), (2, 10, [1, 2, 10, 11, 12])]  # owed 2; seed + 3 sent
    assert [t for i in items if "tokens" in i for t in i["tokens"]] == [10, 11, 12, 13, 14]
    report = items[-1]["report"]
    assert report["token_ids"] == [10, 11, 12, 13, 14] and report["new_tokens"] == 5 and report["resumes"] == 1
    assert report["text"] == tokenizer.decode([10, 11, 12, 13, 14], skip_special_tokens=True)
    assert scripts[0].cancelled
    stream.cancel(), stream.cancel()
    assert released == [1]  # the admission slot is released once


def test_no_replica_in_time_is_a_clean_error(tokenizer, monkeypatch):
    monkeypatch.setattr(app, "RESUME_BACKOFF_S", 0.01)
    died = ActorDiedError()
    stream = app._Resuming(
        lambda req, ids: Scripted([], died),
        parse_request(prompt="hi", max_new_tokens=4),
        [1],
        tokenizer,
        lambda: None,
        resume_timeout_s=0.05,
    )
    with pytest.raises(app.ReplicaLost) as err:
        run(stream)
    message = failure_of(err.value).message
    assert message.startswith("the target replica serving this request failed") and "pid" not in message
    assert failure_of(RuntimeError("boom at 10.0.0.1 pid=42")).message == INTERNAL_ERROR
