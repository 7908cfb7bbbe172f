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


def _chunk(tokens, first, finish=None):
    return {"tokens": tokens, "first": first, "finish": finish}


def _resuming(scripts, req, calls, tokenizer):
    def start(req, ids):
        calls.append((req.max_new_tokens, list(ids)))
        return scripts[len(calls) - 1]

    return app._Resuming(start, req, [1, 2], tokenizer, lambda: None, resume_timeout_s=5)


def test_a_replica_lost_after_the_last_token_and_before_its_report_is_not_resumed(tokenizer, monkeypatch):
    """The chaos soak's wrong answers (#51): the chunk with EOS reached the ingress, the replica died
    before its report (a drafter already lost made that window 2 s long), and the request resumed
    from a prefix that ended in EOS: the answer ran on with the next user turn. The committed chunk
    carries its finish; the stream ends there with a report of the tokens sent, status OK."""
    monkeypatch.setattr(app, "RESUME_BACKOFF_S", 0.0)
    eos = tokenizer.eos_token_id
    calls: list = []
    scripts = [Scripted([_chunk([10, 11], 0), _chunk([12, eos], 2, "stop")], ActorDiedError())]
    items = run(_resuming(scripts, parse_request(prompt="hi", max_new_tokens=64), calls, tokenizer))
    assert len(calls) == 1  # no resume
    assert [t for i in items if "tokens" in i for t in i["tokens"]] == [10, 11, 12, eos]
    report = items[-1]["report"]
    assert report["token_ids"] == [10, 11, 12, eos] and report["finish_reason"] == "stop"
    assert report["new_tokens"] == 4 and report["text"] == ""  # 10-12 are special tokens: skipped


def test_two_target_losses_then_a_loss_after_the_end_keep_the_answer_whole(tokenizer, monkeypatch):
    """Loss mid-answer (resumed), loss mid-answer again (resumed), loss after the last chunk (ended)."""
    monkeypatch.setattr(app, "RESUME_BACKOFF_S", 0.0)
    calls: list = []
    scripts = [
        Scripted([_chunk([10], 0)], ActorDiedError()),
        Scripted([_chunk([11, 12], 0)], ActorDiedError()),
        Scripted([_chunk([13], 0, "length")], ActorDiedError()),
    ]
    items = run(_resuming(scripts, parse_request(prompt="hi", max_new_tokens=4), calls, tokenizer))
    assert calls == [(4, [1, 2]), (3, [1, 2, 10]), (1, [1, 2, 10, 11, 12])]
    chunks = [i for i in items if "tokens" in i]
    assert [(c["first"], c["tokens"]) for c in chunks] == [(0, [10]), (1, [11, 12]), (3, [13])]  # whole-answer indices
    report = items[-1]["report"]
    assert report["token_ids"] == [10, 11, 12, 13] and report["finish_reason"] == "length" and report["resumes"] == 2


def test_every_owed_token_sent_is_a_finished_answer_not_a_failure(tokenizer, monkeypatch):
    """The soak's "all 64 tokens, then UNAVAILABLE": a stream whose max_tokens were all sent before
    its replica died ends with finish reason "length", not ReplicaLost (even from a replica that
    marks no finish)."""
    monkeypatch.setattr(app, "RESUME_BACKOFF_S", 0.0)
    calls: list = []
    scripts = [Scripted([{"tokens": [10, 11, 12]}], ActorDiedError())]
    items = run(_resuming(scripts, parse_request(prompt="hi", max_new_tokens=3), calls, tokenizer))
    assert len(calls) == 1 and items[-1]["report"]["finish_reason"] == "length"


def test_a_chunk_the_stream_already_sent_is_delivered_once(tokenizer):
    calls: list = []
    scripts = [
        Scripted(
            [
                _chunk([10, 11], 0),
                _chunk([10, 11], 0),  # the same chunk again
                _chunk([11, 12], 1),  # an overlap
                {"report": {"token_ids": [10, 11, 12], "new_tokens": 3, "text": "x", "finish_reason": "length"}},
            ]
        )
    ]
    items = run(_resuming(scripts, parse_request(prompt="hi", max_new_tokens=3), calls, tokenizer))
    assert [(i["first"], i["tokens"]) for i in items if "tokens" in i] == [(0, [10, 11]), (2, [12])]


def test_the_target_marks_the_chunk_that_completes_the_answer(tokenizer):
    """``deployments._trimmed``: each publish's kept tokens with their answer index; the chunk with
    EOS, the one reaching max_tokens, and the one completing a stop string carry the finish reason."""
    from eyas.protocol.text import AnswerText
    from eyas.serve.deployments import _trimmed

    def chunks(req, publishes):
        out: list[dict] = []
        on_tokens = _trimmed(req, out.append, AnswerText(tokenizer, req.stop), (2,))
        stopped = [on_tokens(p) for p in publishes]
        return [(c["first"], c["tokens"], c["finish"]) for c in out], stopped

    words = tokenizer.encode(" one two three END four")
    got, _ = chunks(parse_request(prompt="hi", max_new_tokens=9), [[40, 41], [42, 2, 43], [44]])
    assert got == [(0, [40, 41], None), (2, [42, 2], "stop")]  # cut through EOS; nothing after it
    got, _ = chunks(parse_request(prompt="hi", max_new_tokens=3), [[40, 41], [42, 43]])
    assert got == [(0, [40, 41], None), (2, [42], "length")]
    got, stopped = chunks(parse_request(prompt="hi", max_new_tokens=20, stop=["END"]), [words[:3], words[3:]])
    assert got[-1][2] == "stop" and stopped == [False, True] and got[0][2] is None
