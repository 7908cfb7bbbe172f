"""TargetWorker and DrafterWorker without Ray: reseeding, fallback, cancellation, leaks, publish atomicity.

The decode loop runs over ``LocalTransport`` (the Verifier messages to an in-process TargetWorker),
so everything here is the code the Ray actors run, minus the process boundary.
"""

from __future__ import annotations

import threading

import pytest
import torch

from eyas.actors.drafter_worker import DrafterWorker
from eyas.actors.target_worker import TargetWorker
from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.generate import generate
from eyas.protocol import eyas_pb2 as pb
from eyas.remote.verifier_client import LocalTransport, RemoteVerifier, generate_remote
from eyas.runtime import FP16W_DEFAULT_TREE
from eyas.step import DrafterUnavailable
from eyas.target.engine import TargetEngine
from tests.testing import tiny_eagle1_engine

PROMPT = [7, 7, 7, 7, 7, 9, 30, 11]
TREE = TreeSpec(expand_width=2, max_depth=3, verify_budget=6)


@pytest.fixture()
def worker(tiny_target):
    return TargetWorker(tiny_target)


@pytest.fixture(scope="module")
def drafter_engine(tiny_target):
    return tiny_eagle1_engine(tiny_target)


def baseline(tiny_target, n=30):
    return generate(TargetEngine(tiny_target, ()), PROMPT, max_new_tokens=n).token_ids


class Flaky:
    """A drafter that raises DrafterUnavailable on the given propose calls (0-based), and loses its
    session when it does (as a restarted actor would)."""

    def __init__(self, engine: DrafterEngine, fail_at: set[int] | None = None, always: bool = False):
        self.engine, self.fail_at, self.always, self.calls = engine, fail_at or set(), always, 0
        self.taps = engine.taps

    def open_session(self, request_id, slots):
        if self.always:
            raise DrafterUnavailable("drafter: down")
        self.engine.open_session(request_id, slots)

    def propose(self, request_id, seed, tree):
        self.calls += 1
        if self.always or self.calls - 1 in self.fail_at:
            self.engine.close_session(request_id)
            raise DrafterUnavailable("drafter: the actor died (test)")
        return self.engine.propose(request_id, seed, tree)

    def publish(self, request_id):
        self.engine.publish(request_id)

    def close_session(self, request_id):
        self.engine.close_session(request_id)


def test_a_drafter_that_dies_mid_request_is_reseeded_and_the_output_is_unchanged(tiny_target, worker, drafter_engine):
    flaky = Flaky(drafter_engine, fail_at={3})
    out = generate_remote(
        RemoteVerifier(LocalTransport(worker)), PROMPT, max_new_tokens=30, drafter=flaky, tree=TREE, request_id="reseed"
    )
    assert out.token_ids == baseline(tiny_target)
    assert out.drafter_reseeds == 1 and not out.drafter_fallback
    # the round whose propose failed went plain (the round step's rule); the next reseeded and drafted
    assert [i for i, r in enumerate(out.rounds) if r.tree_nodes == 0] == [3]
    assert worker.leak_check()["ok"] and not worker.sessions and not drafter_engine.sessions


def test_a_drafter_that_stays_down_falls_back_to_target_only_with_the_same_tokens(tiny_target, worker, drafter_engine):
    from eyas.step import MAX_DRAFTER_RESEEDS

    # one failure more than the reseeds allowed, in a row (each reseed's next propose fails again)
    in_a_row = set(range(2, 2 + MAX_DRAFTER_RESEEDS + 1))
    for flaky in (Flaky(drafter_engine, fail_at=in_a_row), Flaky(drafter_engine, always=True)):
        out = generate_remote(
            RemoteVerifier(LocalTransport(worker)),
            PROMPT,
            max_new_tokens=30,
            drafter=flaky,
            tree=TREE,
            request_id="fallback",
        )
        assert out.token_ids == baseline(tiny_target)
        assert out.drafter_fallback
        assert out.rounds[-1].tree_nodes == 0
    assert worker.leak_check()["ok"] and not worker.sessions and not drafter_engine.sessions


def test_a_reseeded_drafter_proposes_what_the_continuing_one_would(tiny_target, worker, drafter_engine):
    """Seed 0x05D: the committed state alone (every verified feature from position 0) rebuilds the
    draft context; the next tree equals the one the drafter that followed every round proposes."""
    verifier = RemoteVerifier(LocalTransport(worker))
    taps = tuple((t.layers_applied, t.normed) for t in drafter_engine.taps)
    verifier.open_session("follow", PROMPT, 40, TREE.max_candidates + 1, taps=taps)
    drafter_engine.open_session("follow", 200)
    seed, _ = verifier.publish("follow", verifier.prefill("follow").round)
    for _ in range(4):
        verdict = verifier.verify("follow", drafter_engine.propose("follow", seed, TREE))
        seed, _ = verifier.publish("follow", verdict.round)
        drafter_engine.publish("follow")
    continuing = drafter_engine.propose("follow", seed, TREE)
    fresh = DrafterWorker({"eagle1": drafter_engine}, tiny_target.cfg.vocab_size)
    drafter_engine.close_session("follow")
    fresh.open_session("follow", "eagle1", 200)
    reseed = worker.reseed(pb.ReseedRequest(request_id="follow"))
    assert reseed.start_position == 0
    rebuilt, _ = fresh.propose("follow", reseed, TREE)
    assert torch.equal(rebuilt.tokens, continuing.tokens) and torch.equal(rebuilt.parents, continuing.parents)
    torch.testing.assert_close(rebuilt.draft_probs, continuing.draft_probs, rtol=1e-4, atol=1e-5)
    fresh.close_session("follow")
    verifier.close_session("follow")


def test_cancel_stops_at_a_round_boundary_and_releases_every_session(tiny_target, worker, drafter_engine):
    cancel = threading.Event()
    seen = []

    def on_tokens(new):
        seen.append(new)
        if len(seen) == 3:
            cancel.set()

    out = generate_remote(
        RemoteVerifier(LocalTransport(worker)),
        PROMPT,
        max_new_tokens=40,
        drafter=drafter_engine,
        tree=TREE,
        request_id="cancel",
        cancel=cancel,
        on_tokens=on_tokens,
    )
    assert out.finish_reason == "cancelled" and len(out.rounds) == 2
    assert out.token_ids == baseline(tiny_target)[: len(out.token_ids)]
    check = worker.leak_check()
    assert check.pop("kv_bytes_spare") > 0  # the closed row's storage, kept for the next request
    assert check | {"worker": None} == {
        "worker": None,
        "live_sessions": 0,
        "kv_slots_allocated": 0,
        "kv_slots_live": 0,
        "kv_bytes_allocated": 0,
        "orphans": [],
        "last_expert_bytes": 0,
        "ok": True,
    }
    assert not drafter_engine.sessions


def test_an_error_mid_request_releases_every_session(worker, drafter_engine):
    def boom(new):
        raise RuntimeError("client handler failed")

    with pytest.raises(RuntimeError):
        generate_remote(
            RemoteVerifier(LocalTransport(worker)),
            PROMPT,
            max_new_tokens=20,
            drafter=drafter_engine,
            tree=TREE,
            request_id="boom",
            on_tokens=boom,
        )
    assert worker.leak_check()["ok"] and worker.leak_check()["live_sessions"] == 0 and not drafter_engine.sessions


def test_a_publish_that_fails_half_way_changes_nothing_and_can_be_retried(
    tiny_target, worker, drafter_engine, monkeypatch
):
    verifier = RemoteVerifier(LocalTransport(worker))
    taps = tuple((t.layers_applied, t.normed) for t in drafter_engine.taps)
    verifier.open_session("atomic", PROMPT, 30, TREE.max_candidates + 1, taps=taps)
    drafter_engine.open_session("atomic", 200)
    seed, ack = verifier.publish("atomic", verifier.prefill("atomic").round)
    out = list(ack.output_tokens)
    failed = 0
    while len(out) < 20:
        verdict = verifier.verify("atomic", drafter_engine.propose("atomic", seed, TREE))
        engine = worker.sessions["atomic"].engine
        t = engine.sessions["atomic"]
        if verdict.decision.accept_length and not failed:
            before = (
                engine.committed_kv("atomic")[0].clone(),
                t.committed_len,
                list(t.tokens),
                t.round,
                len(t.features),
                t.frontier_token,
            )

            def broken(*_a, **_k):
                raise RuntimeError("device error during the KV gather")

            monkeypatch.setattr(engine.kv, "commit", broken)
            with pytest.raises(RuntimeError):
                verifier.publish("atomic", verdict.round)
            monkeypatch.undo()
            after = (
                engine.committed_kv("atomic")[0],
                t.committed_len,
                list(t.tokens),
                t.round,
                len(t.features),
                t.frontier_token,
            )
            assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
            failed += 1
        seed, ack = verifier.publish("atomic", verdict.round)  # the retry commits the same decision
        drafter_engine.publish("atomic")
        out.extend(ack.output_tokens)
    assert failed == 1
    assert out[:20] == baseline(tiny_target, 20)
    verifier.close_session("atomic")
    drafter_engine.close_session("atomic")


def test_bad_seeds_and_unknown_methods_are_refused_naming_the_field(tiny_target, drafter_engine):
    w = DrafterWorker({"eagle1": drafter_engine}, tiny_target.cfg.vocab_size)
    with pytest.raises(ValueError, match="^method: "):
        w.open_session("x", "eagle3", 64)
    w.open_session("x", "eagle1", 64)
    bad = pb.Seed(request_id="x", round=1)  # no advanced tokens, no features
    with pytest.raises(ValueError, match="^seed.advanced_tokens: "):
        w.propose("x", bad, TREE)
    with pytest.raises(ValueError, match="^request_id: "):
        w.propose("nobody", bad, TREE)
    assert w.close_session("x") and not w.close_session("x")
    assert w.leak_check()["ok"]


def test_a_batched_prefill_answers_a_retry_with_the_same_decision_and_refuses_alone(worker):
    """prefill_batch: a request prefilled before gets its earlier decision again; an unknown or repeated
    request gets a Refusal naming the field; the valid ones are decided as single prefills would be."""
    from eyas.protocol import wire
    from eyas.protocol.messages import Refusal

    for rid, prompt in (("x", PROMPT), ("y", PROMPT[:3])):
        worker.open_session(
            wire.session_spec_to_proto(
                wire.SessionSpec(request_id=rid, prompt_ids=tuple(prompt), max_new_tokens=8, max_tree_rows=1)
            )
        )
    first = worker.prefill(pb.PrefillRequest(request_id="x"))
    out = worker.prefill_batch([pb.PrefillRequest(request_id=r) for r in ("x", "ghost", "y", "y")])
    assert out[0] is first
    assert isinstance(out[1], Refusal) and out[1].message.startswith("request_id: ")
    assert isinstance(out[3], Refusal) and "twice" in out[3].message
    assert isinstance(out[2], pb.AcceptDecision) and out[2].round == first.round
    assert worker.publish(pb.PublishRequest(request_id="y", round=out[2].round)).committed_len == 3


def test_the_object_calls_decide_what_the_messages_do_and_refuse_each_item_alone(tiny_target, drafter_engine):
    """TargetWorker.step / publish_rounds / committed_seed (a caller in the worker's process, no
    protobuf): the same decisions, seeds and tokens as round_batch / publish_batch / reseed on a twin
    worker; an unknown request, a bad prompt, a tree over the session's rows and an unpublished round
    are each refused alone, naming the field, and change nothing."""
    from eyas.protocol import wire
    from eyas.protocol.messages import Refusal
    from eyas.step import Decided, Published

    objects, messages = TargetWorker(tiny_target), TargetWorker(tiny_target)
    taps = tuple((t.layers_applied, t.normed) for t in drafter_engine.taps)
    spec = wire.SessionSpec(
        request_id="a", prompt_ids=tuple(PROMPT), max_new_tokens=12, max_tree_rows=TREE.max_candidates + 1, taps=taps
    )
    assert objects.open(spec) == tuple(tiny_target.cfg.eos_token_ids)
    messages.open_session(wire.session_spec_to_proto(spec))
    with pytest.raises(ValueError, match="^prompt_ids: "):
        objects.open(wire.SessionSpec(request_id="bad", prompt_ids=(1, 10_000), max_new_tokens=4, max_tree_rows=1))
    (pre,), _ = objects.step(["a"], [])
    (pre_msg,), _ = messages.round_batch([pb.PrefillRequest(request_id="a")], [])
    assert isinstance(pre, Decided) and pre.round == pre_msg.round
    (pub,) = objects.publish_rounds([("a", pre.round)])
    (ack,) = messages.publish_batch([pb.PublishRequest(request_id="a", round=pre_msg.round)])
    assert isinstance(pub, Published) and list(pub.tokens) == list(ack.output_tokens)
    torch.testing.assert_close(pub.seed.features, wire.seed_from_proto(ack.seed).features)
    drafter_engine.open_session("a", 256)
    try:
        tree = drafter_engine.propose("a", pub.seed, TREE)
        _, (ver, ghost) = objects.step([], [("a", tree), ("ghost", tree)])
        flat = wire.flat_tree_to_proto(
            ver.flat, request_id="a", round=ver.round, base_position=ver.flat.positions[0].item()
        )
        _, (ver_msg,) = messages.round_batch([], [flat])
        assert isinstance(ghost, Refusal) and ghost.not_found and ghost.message.startswith("request_id: ")
        assert torch.equal(ver.decision.accepted_tokens, wire.decision_from_proto(ver_msg).accepted_tokens)
        _, (again,) = objects.step([], [("a", tree)])
        assert isinstance(again, Refusal) and again.message.startswith(
            f"round: {ver.round} of 'a' is not yet published"
        )
        objects.publish_rounds([("a", ver.round)])
        over = tree.__class__(
            torch.zeros(20, dtype=torch.int64), torch.arange(-1, 19), torch.arange(1, 21), torch.full((20,), 0.5)
        )
        _, (refused,) = objects.step([], [("a", over)])
        assert isinstance(refused, Refusal) and refused.message.startswith("tree_budget: 21 rows exceed")
        seed = objects.committed_seed("a")
        assert (
            seed.start_position == 0
            and seed.features.shape[0] == objects.sessions["a"].engine.sessions["a"].committed_len
        )
    finally:
        drafter_engine.close_session("a")
        objects.close("a"), messages.close("a")
    assert objects.leak_check()["ok"] and messages.leak_check()["ok"]


@pytest.mark.real_model
def test_a_drafter_worker_for_an_fp16w_target_drafts_with_fp16_weights():
    """The drafter deployment gets the app's precision: at fp16w its drafter (and the target head an
    EAGLE-1 drafter reads) hold fbgemm fp16 weights; drafting still works."""
    w = DrafterWorker.load("smollm2-135m", ("eagle3",), precision="fp16w")
    engine = w.engines["eagle3"]
    assert not any(isinstance(m, torch.nn.Linear) for m in engine.drafter.modules())
    assert not isinstance(engine.lm_head, torch.nn.Linear)
    assert w.default_trees["eagle3"] == FP16W_DEFAULT_TREE  # the manifest's 4/5/16 capped at fp16w
    points = w.measure_costs(repeats=1)["eagle3"]
    assert points and all(ms > 0 for _, _, ms in points)


@pytest.mark.real_model
def test_a_drafter_worker_for_a_gguf_target_drafts_with_q4_blocks_and_the_ggufs_own_head():
    """At gguf the drafter deployment's drafter holds Q4_1 blocks and the target head an EAGLE-1
    drafter reads is the GGUF's own Q8_0 head, as the gguf target's is; drafting still works."""
    from eyas.target.quantized import Q4_1, Q8_0, QLinear

    w = DrafterWorker.load("smollm2-135m", ("eagle1",), precision="gguf")
    engine = w.engines["eagle1"]
    assert not any(type(m) is torch.nn.Linear for m in engine.drafter.modules())
    assert {m.qtype for m in engine.drafter.modules() if isinstance(m, QLinear)} == {Q4_1}
    assert isinstance(engine.lm_head, QLinear) and engine.lm_head.qtype == Q8_0
    points = w.measure_costs(repeats=1)["eagle1"]
    assert points and all(ms > 0 for _, _, ms in points)


@pytest.mark.real_model
def test_a_drafter_worker_takes_the_target_dtype_and_device():
    """The drafter deployment gets the app's dtype and device: at bfloat16 its drafters and the target
    embedding and head they read are bfloat16 on that device, and it drafts; a device this machine
    lacks is refused naming the field."""
    w = DrafterWorker.load("smollm2-135m", ("eagle1",), dtype="bfloat16", device="cpu")
    engine = w.engines["eagle1"]
    assert engine.drafter.dtype == torch.bfloat16 and engine.embed.weight.dtype == torch.bfloat16
    assert engine.lm_head.weight.dtype == torch.bfloat16 and engine.device == torch.device("cpu")
    points = w.measure_costs(repeats=1)["eagle1"]
    assert points and all(ms > 0 for _, _, ms in points)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device: cuda is not available on this machine"):
            DrafterWorker.load("smollm2-135m", ("eagle1",), device="cuda")


def test_the_verify_latency_curve_measures_each_row_count_and_leaves_nothing_behind(worker):
    """measure_latency verifies a chain of R - 1 candidates (R rows with the frontier) for each R and
    closes its probe session: a point for every row count, positive, and no live session or K/V after."""
    curve = worker.measure_latency(rows=(1, 2, 4), repeats=1, prefix=8)
    assert sorted(curve) == [1, 2, 4] and all(ms > 0 for ms in curve.values())
    assert worker.leak_check()["ok"] and not worker.sessions


def test_the_latency_curve_times_a_round_not_the_store_growing(worker, monkeypatch):
    """Each timed verify is its session's second: the first may grow the K/V store past the prompt (a
    one-off that made the gguf curve flat at ~3x a round), the timed one finds it grown."""
    engine = worker.engine_for(())
    grew: list[bool] = []
    verify = engine.verify

    def watched(rid, tree):
        before = (engine.kv.row_capacity, engine.kv.slot_capacity)
        out = verify(rid, tree)
        grew.append((engine.kv.row_capacity, engine.kv.slot_capacity) != before)
        return out

    monkeypatch.setattr(engine, "verify", watched)
    worker.measure_latency(rows=(1, 4), repeats=1, prefix=128)  # 128: a full slot granule, so the tree grows it
    # the very first verify grows the store (later probes open into the storage the last close kept)
    assert grew[0] and len(grew) % 2 == 0 and not any(grew[1::2])
