"""A drafter drives a target over a real loopback gRPC channel (eyas/protocol/verifier_*.py).

docs/architecture.md, "The wire contract": every inbound message is validated before use; a bad one gets
INVALID_ARGUMENT naming the field and never touches the committed state.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from eyas.drafting.engine import TreeSpec
from eyas.generate import generate
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import wire
from eyas.protocol.codec import encode_tensor
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree, flatten_tree
from eyas.protocol.tree import ROW_IS_ROOT as ROOT
from eyas.remote.verifier_client import RemoteRejected, RemoteVerifier, generate_remote
from eyas.remote.verifier_server import serve_verifier
from eyas.target.config import eagle1_feature_address
from eyas.target.engine import TargetEngine
from tests.testing import tiny_eagle1_engine

PROMPTS = ([1, 2, 3], [7, 7, 7, 7, 7, 9, 30, 11])
TREE = TreeSpec(expand_width=2, max_depth=3, verify_budget=6)  # 7 verify rows a round


@pytest.fixture(scope="module")
def server(tiny_target):
    running = serve_verifier(tiny_target, max_workers=2)
    yield running
    running.stop(None)


@pytest.fixture(scope="module")
def client(server):
    with RemoteVerifier(server.address, timeout_s=30) as remote:
        yield remote


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return tiny_eagle1_engine(tiny_target)


def test_greedy_decode_over_grpc_equals_in_process_target_only(tiny_target, client, drafter):
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=30)
        for j, tree in enumerate((TREE, TreeSpec(kind="static"))):
            remote = generate_remote(
                client, prompt, max_new_tokens=30, drafter=drafter, tree=tree, request_id=f"greedy-{i}-{j}"
            )
            assert remote.token_ids == base.token_ids
            assert remote.finish_reason == base.finish_reason
            accepted += sum(r.accept_length for r in remote.rounds)
        target_only = generate_remote(client, prompt, max_new_tokens=30, request_id=f"target-{i}")
        assert target_only.token_ids == base.token_ids and target_only.target_forwards == 29
    assert accepted > 0  # candidate rows were accepted and gathered, not only roots


def test_sampled_decode_over_grpc_equals_in_process(tiny_target, client, drafter):
    """The remote target samples with the session's seed in the same order as the in-process loop."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    local = TargetEngine(tiny_target, eagle1_feature_address(tiny_target.cfg))
    here = generate(local, PROMPTS[1], max_new_tokens=24, sampling=sampling, drafter=drafter, tree=TREE, seed=5)
    there = generate_remote(
        client,
        PROMPTS[1],
        max_new_tokens=24,
        sampling=sampling,
        drafter=drafter,
        tree=TREE,
        seed=5,
        request_id="sampled",
    )
    assert there.token_ids == here.token_ids
    assert [r.accept_length for r in there.rounds] == [r.accept_length for r in here.rounds]


# --------------------------------------------------------------------------------------------
# Malformed messages
# --------------------------------------------------------------------------------------------


def committed_state(server, request_id: str) -> dict:
    """Everything a bad message must leave alone: the whole KV cache and the session's bookkeeping."""
    s = server.servicer.worker.sessions[request_id]
    t = s.engine.sessions[request_id]
    return dict(
        k=s.engine.kv.k[:, t.kv_row].clone(),
        v=s.engine.kv.v[:, t.kv_row].clone(),
        committed_len=t.committed_len,
        tokens=list(t.tokens),
        frontier=t.frontier_token,
        round=t.round,
        pending=t.pending,
        last_ack=t.last_ack,
        server_pending=s.pending,
        server_published=s.published,
    )


def assert_same_state(before: dict, after: dict) -> None:
    for key in before:
        if key in ("k", "v"):  # bit-identical, not merely equal
            assert torch.equal(before[key].view(torch.int32), after[key].view(torch.int32)), key
        elif key in ("pending", "server_pending", "server_published", "last_ack"):
            assert before[key] is after[key], key
        else:
            assert before[key] == after[key], key


def expect_rejection(call, code: grpc.StatusCode, field: str, label: str = "") -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, (label, err.value.code(), err.value.details())
    assert err.value.details().startswith(f"{field}: "), (label, err.value.details())


def open_and_advance(client, drafter, request_id: str, rounds: int):
    """A session one prefill and ``rounds`` speculation rounds in; returns (drafter seed, output so far)."""
    prompt = PROMPTS[1]
    client.open_session(
        request_id, prompt, 40, TREE.max_candidates + 1, taps=tuple((t.layers_applied, t.normed) for t in drafter.taps)
    )
    drafter.open_session(request_id, len(prompt) + 40 + TREE.max_candidates + 1 + TREE.max_draft_rows + 1)
    seed, ack = client.publish(request_id, client.prefill(request_id).round)
    out = list(ack.output_tokens)
    for _ in range(rounds):
        verdict = client.verify(request_id, drafter.propose(request_id, seed, TREE))
        seed, ack = client.publish(request_id, verdict.round)
        drafter.publish(request_id)
        out.extend(ack.output_tokens)
    return seed, out


def chain(n: int, token: int = 5) -> DraftTree:
    return DraftTree.chain([token] * n)


def test_malformed_messages_are_refused_and_touch_nothing(tiny_target, server, client, drafter):
    rid = "malformed"
    seed, out = open_and_advance(client, drafter, rid, rounds=2)
    s = client.sessions[rid]
    vocab, base, frontier, rnd = s.info.vocab_size, s.committed_len, s.frontier_token, s.round + 1
    tree = DraftTree(
        torch.tensor([4, 9, 6]),
        torch.tensor([PARENT_IS_ROOT, 0, PARENT_IS_ROOT]),
        torch.tensor([1, 2, 1]),
        torch.tensor([0.5, 0.5, 0.5]),
    )

    def flat_msg(t: DraftTree = tree, **overrides) -> pb.FlatTree:
        msg = wire.flat_tree_to_proto(flatten_tree(t, frontier, base), request_id=rid, round=rnd, base_position=base)
        for name, value in overrides.items():
            setattr(msg, name, value)
        return msg

    def ints(*values, dtype=torch.int64) -> bytes:
        return encode_tensor(torch.tensor(values, dtype=dtype))

    bad_trees = [
        ("parent after its child", flat_msg(parents=ints(ROOT, 2, 0, 0)), "parents"),
        ("not ancestor-closed", flat_msg(parents=ints(ROOT, 0, 7, 0)), "parents"),
        ("positions off", flat_msg(positions=ints(base, base + 1, base + 3, base + 1)), "positions"),
        ("rows over the budget", flat_msg(chain(TREE.max_candidates + 1)), "tokens"),
        ("wrong tensor shape", flat_msg(depths=ints(0, 1, 2)), "depths"),
        ("wrong 2-D shape", flat_msg(tree_mask=encode_tensor(torch.ones(4, 3, dtype=torch.bool))), "tree_mask"),
        ("wrong dtype", flat_msg(tokens=ints(frontier, 4, 9, 6, dtype=torch.int32)), "tokens"),
        ("wrong float dtype", flat_msg(draft_probs=ints(1, 0.5, 0.5, 0.5, dtype=torch.float16)), "draft_probs"),
        ("out-of-vocabulary token", flat_msg(tokens=ints(frontier, 4, vocab, 6)), "tokens"),
        ("stale round", flat_msg(round=rnd - 1), "round"),
        ("future round", flat_msg(round=rnd + 1), "round"),
        ("another root token", flat_msg(tokens=ints((frontier + 1) % vocab, 4, 9, 6)), "tokens"),
        ("another base position", flat_msg(base_position=base - 1), "base_position"),
        ("garbage bytes", flat_msg(parents=b"\x85not msgpack"), "parents"),
        ("duplicate sibling", flat_msg(tokens=ints(frontier, 4, 9, 4)), "tokens"),
        ("empty request id", flat_msg(request_id=""), "request_id"),
    ]
    before = committed_state(server, rid)
    for label, msg, field in bad_trees:
        expect_rejection(
            lambda msg=msg: client.transport.stub.Verify(msg, timeout=30),
            grpc.StatusCode.INVALID_ARGUMENT,
            field,
            label,
        )
        assert_same_state(before, committed_state(server, rid))
    for bad_round in (rnd - 2, rnd + 5, rnd):  # stale, future, and the undecided next round
        expect_rejection(
            lambda bad_round=bad_round: client.transport.stub.Publish(
                pb.PublishRequest(request_id=rid, round=bad_round), timeout=30
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "round",
        )
        assert_same_state(before, committed_state(server, rid))
    expect_rejection(
        lambda: client.transport.stub.Verify(flat_msg(request_id="nobody"), timeout=30),
        grpc.StatusCode.NOT_FOUND,
        "request_id",
    )
    expect_rejection(
        lambda: client.transport.stub.Publish(pb.PublishRequest(request_id="nobody", round=1), timeout=30),
        grpc.StatusCode.NOT_FOUND,
        "request_id",
    )
    expect_rejection(
        lambda: client.transport.stub.Prefill(pb.PrefillRequest(request_id=rid), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT,
        "request_id",
    )  # already prefilled
    assert_same_state(before, committed_state(server, rid))

    # The session is intact: the decode continues and matches the in-process target-only output.
    while len(out) < 40:
        verdict = client.verify(rid, drafter.propose(rid, seed, TREE))
        seed, ack = client.publish(rid, verdict.round)
        drafter.publish(rid)
        out.extend(ack.output_tokens)
    client.close_session(rid)
    drafter.close_session(rid)
    base_out = generate(TargetEngine(tiny_target, ()), PROMPTS[1], max_new_tokens=40)
    assert out[:40] == base_out.token_ids


def test_duplicate_publish_returns_the_same_ack_and_changes_nothing(server, client, drafter):
    rid = "duplicate"
    seed, _ = open_and_advance(client, drafter, rid, rounds=1)
    verdict = client.verify(rid, drafter.propose(rid, seed, TREE))
    request = pb.PublishRequest(request_id=rid, round=verdict.round)
    first = client.transport.stub.Publish(request, timeout=30)
    drafter.publish(rid)
    after_first = committed_state(server, rid)
    for _ in range(2):
        assert client.transport.stub.Publish(request, timeout=30) == first
        assert_same_state(after_first, committed_state(server, rid))
    seed2, ack = client.publish(rid, verdict.round)  # through the validating client too
    assert ack.round == verdict.round and list(ack.output_tokens) == list(first.output_tokens)
    assert torch.equal(seed2.features, wire.seed_from_proto(first.seed).features)
    assert_same_state(after_first, committed_state(server, rid))
    assert client.close_session(rid) and not client.close_session(rid)
    drafter.close_session(rid)


def test_retried_verify_gets_the_same_decision_and_another_tree_is_refused(server, client, drafter):
    rid = "retry"
    seed, _ = open_and_advance(client, drafter, rid, rounds=0)
    s = client.sessions[rid]
    flat = flatten_tree(drafter.propose(rid, seed, TREE), s.frontier_token, s.committed_len)
    msg = wire.flat_tree_to_proto(
        flat, request_id=rid, round=s.round + 1, base_position=s.committed_len, include_derived=True
    )
    first = client.transport.stub.Verify(msg, timeout=30)
    pending = committed_state(server, rid)
    assert client.transport.stub.Verify(msg, timeout=30) == first
    other = wire.draft_tree_to_proto(
        chain(2, token=1),
        frontier_token=s.frontier_token,
        request_id=rid,
        round=s.round + 1,
        base_position=s.committed_len,
    )
    expect_rejection(lambda: client.transport.stub.Verify(other, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "round")
    assert_same_state(pending, committed_state(server, rid))
    client.publish(rid, first.round)
    drafter.publish(rid)
    client.close_session(rid)
    drafter.close_session(rid)


def test_client_raises_value_errors_and_sessions_are_checked(client):
    with pytest.raises(RemoteRejected) as err:
        client.open_session("bad-prompt", [1, 10_000], 4, 1)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(err.value).startswith("prompt_ids: ")
    expect_rejection(
        lambda: client.transport.stub.OpenSession(
            pb.OpenSessionRequest(
                request_id="bad-sampling", prompt_ids=[1, 2], max_new_tokens=4, max_tree_rows=1, temperature=-1.0
            ),
            timeout=30,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    )
    with pytest.raises(RemoteRejected, match="^max_new_tokens: "):
        client.open_session("too-long", [1, 2], 10_000, 1)
    client.open_session("twice", [1, 2], 4, 1)
    with pytest.raises(RemoteRejected, match="^request_id: "):
        client.open_session("twice", [1, 2], 4, 1)
    early = wire.draft_tree_to_proto(
        DraftTree.empty(), frontier_token=0, request_id="twice", round=1, base_position=0
    )  # verify before the prefill is published
    expect_rejection(lambda: client.transport.stub.Verify(early, timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "round")
    with pytest.raises(ValueError, match="^request_id: "):  # the client knows no such session
        client.verify("nobody", DraftTree.empty())
    assert client.close_session("twice")
