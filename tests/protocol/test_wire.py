"""Converters between protobuf messages and the internal types; inbound validation (docs/architecture.md, "The wire contract")."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import wire
from eyas.protocol.codec import encode_tensor
from eyas.protocol.messages import AcceptDecision, PublishAck, Seed
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.schema import GenerateRequest, parse_request
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree, flatten_tree
from eyas.protocol.tree import ROW_IS_ROOT as ROOT
from eyas.protocol.wire import WireError

VOCAB, BASE, FRONTIER, ROUND, MAX_ROWS = 32, 10, 3, 4, 8
A, A1, B, B1 = 10, 11, 20, 21


def tree() -> DraftTree:
    """The design 0x06C tree [A, A1, B, B1] (parents [SEED, 0, SEED, 2])."""
    return DraftTree(
        torch.tensor([A, A1, B, B1]),
        torch.tensor([PARENT_IS_ROOT, 0, PARENT_IS_ROOT, 2]),
        torch.tensor([1, 2, 1, 2]),
        torch.tensor([0.6, 0.8, 0.4, 0.95]),
    )


def good(**overrides) -> pb.FlatTree:
    msg = wire.draft_tree_to_proto(tree(), frontier_token=FRONTIER, request_id="r", round=ROUND, base_position=BASE)
    for field, value in overrides.items():
        setattr(msg, field, value)
    return msg


def inbound(msg: pb.FlatTree):
    return wire.flat_tree_from_proto(
        msg, vocab_size=VOCAB, max_rows=MAX_ROWS, base_position=BASE, round=ROUND, frontier_token=FRONTIER
    )


def rows(*values, dtype=torch.int64) -> bytes:
    return encode_tensor(torch.tensor(values, dtype=dtype))


@pytest.mark.parametrize("include_derived", [False, True])
def test_flat_tree_round_trip_and_back_to_the_draft_tree(include_derived):
    flat = flatten_tree(tree(), FRONTIER, BASE)
    msg = wire.flat_tree_to_proto(
        flat, request_id="r", round=ROUND, base_position=BASE, include_derived=include_derived
    )
    assert msg.HasField("tree_mask") == include_derived
    back = inbound(pb.FlatTree.FromString(msg.SerializeToString()))
    for field in ("tokens", "positions", "parents", "depths", "tree_mask", "retrieve", "draft_probs"):
        assert torch.equal(getattr(back, field), getattr(flat, field)), field
    again = wire.draft_tree_from_flat(back)
    for field in ("tokens", "parents", "depths", "draft_probs"):
        assert torch.equal(getattr(again, field), getattr(tree(), field)), field


def test_root_only_tree_round_trips():
    msg = wire.draft_tree_to_proto(
        DraftTree.empty(), frontier_token=FRONTIER, request_id="r", round=ROUND, base_position=BASE
    )
    flat = inbound(msg)
    assert flat.num_rows == 1 and wire.draft_tree_from_flat(flat).num_nodes == 0


@pytest.mark.parametrize(
    "overrides, field, why",
    [
        ({"parents": rows(ROOT, 2, 0, 0, 3)}, "parents", "must precede children"),
        ({"parents": rows(ROOT, 0, 9, 0, 3)}, "parents", "not ancestor-closed"),
        ({"parents": rows(ROOT, 0, -5, 0, 3)}, "parents", "not ancestor-closed"),
        ({"parents": rows(0, 0, 1, 0, 3)}, "parents", "root"),
        ({"parents": rows(ROOT, 1, 1, 0, 3)}, "parents", "must precede children"),  # a self-loop
        ({"depths": rows(0, 1, 3, 1, 2)}, "depths", "parent depth + 1"),
        ({"positions": rows(10, 11, 13, 11, 12)}, "positions", "base_position + depth"),
        ({"tokens": rows(FRONTIER, A, A1, B, VOCAB)}, "tokens", "outside [0, 32)"),
        ({"tokens": rows(FRONTIER, A, A1, B, -1)}, "tokens", "outside [0, 32)"),
        ({"tokens": rows(FRONTIER, A, A1, A, B1)}, "tokens", "duplicate token"),
        ({"tokens": rows(FRONTIER + 1, A, A1, B, B1)}, "tokens", "not the frontier token"),
        ({"tokens": rows(FRONTIER, A, A1, B, B1, dtype=torch.int32)}, "tokens", "expected dtype int64"),
        ({"tokens": rows(*range(MAX_ROWS + 1))}, "tokens", "exceed the limit of 8"),
        ({"tokens": rows()}, "tokens", "at least the root"),
        ({"tokens": b"\x93garbage"}, "tokens", "not a msgpack-encoded tensor"),
        ({"tokens": b""}, "tokens", "missing"),
        ({"parents": rows(ROOT, 0, -1, 0)}, "parents", "expected shape (5,)"),
        ({"parents": encode_tensor(torch.tensor([[-1, 0, 1, 0, 3]]))}, "parents", "expected shape (5,)"),
        ({"draft_probs": rows(1.0, 0.6, 0.8, 0.4, 0.95, dtype=torch.float64)}, "draft_probs", "expected dtype float32"),
        ({"draft_probs": rows(1.0, 0.6, 1.8, 0.4, 0.95, dtype=torch.float32)}, "draft_probs", "in [0, 1]"),
        ({"draft_probs": rows(1.0, 0.6, float("nan"), 0.4, 0.95, dtype=torch.float32)}, "draft_probs", "in [0, 1]"),
        ({"tree_mask": encode_tensor(torch.eye(5, dtype=torch.bool))}, "tree_mask", "ancestor-or-self"),
        ({"tree_mask": encode_tensor(torch.eye(5, 4, dtype=torch.bool))}, "tree_mask", "expected shape (5, 5)"),
        ({"tree_mask": encode_tensor(torch.eye(5, dtype=torch.uint8))}, "tree_mask", "expected dtype bool"),
        ({"retrieve": rows(0, 1, 2)}, "retrieve", "expected shape ('*', '*')"),
        ({"retrieve": encode_tensor(torch.tensor([[0, 1, 2], [0, 3, 5]]))}, "retrieve", "root->leaf paths"),
        ({"round": ROUND - 1}, "round", "stale or from the future"),
        ({"round": ROUND + 1}, "round", "stale or from the future"),
        ({"base_position": BASE + 1}, "base_position", "not the committed length"),
        ({"request_id": ""}, "request_id", "non-empty string of at most 256 characters"),
        ({"request_id": "  "}, "request_id", "non-empty string of at most 256 characters"),
    ],
)
def test_inbound_flat_tree_is_rejected_naming_the_field(overrides, field, why):
    with pytest.raises(WireError) as err:
        inbound(good(**overrides))
    assert str(err.value).startswith(f"{field}: ") and why in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def test_decision_round_trip_and_rejections():
    d = AcceptDecision(torch.tensor([0, 3, 4]), torch.tensor([B, B1]), 7)
    msg = wire.decision_to_proto(d, request_id="r", round=ROUND)
    back = wire.decision_from_proto(msg, request_id="r", round=ROUND, vocab_size=VOCAB, max_rows=5)
    assert torch.equal(back.accepted_rows, d.accepted_rows) and back.emitted_tokens == [B, B1, 7]
    cases = [
        (dict(round=ROUND + 1), {}, "round"),
        (dict(request_id="q"), {}, "request_id"),
        (dict(accepted_rows=rows(1, 3, 4)), {}, "accepted_rows"),
        (dict(accepted_rows=rows(0, 4, 3)), {}, "accepted_rows"),
        (dict(accepted_tokens=rows(B)), {}, "accepted_tokens"),
        (dict(accepted_tokens=rows(B, VOCAB)), {}, "accepted_tokens"),
        (dict(frontier_token=VOCAB), {}, "frontier_token"),
        (dict(frontier_token=-3), {}, "frontier_token"),
        ({}, {"max_rows": 2}, "accepted_rows"),
    ]
    for overrides, kwargs, field in cases:
        bad = pb.AcceptDecision()
        bad.CopyFrom(msg)
        for name, value in overrides.items():
            setattr(bad, name, value)
        with pytest.raises(WireError, match=f"^{field}: "):
            wire.decision_from_proto(bad, **({"request_id": "r", "round": ROUND, "vocab_size": VOCAB} | kwargs))


def seed_and_ack():
    seed = Seed(torch.randn(3, 6), torch.tensor([5, 6, 7]), start_position=10, round=ROUND)
    return seed, PublishAck("r", ROUND, 13, (6, 7))


def test_seed_and_ack_round_trip():
    seed, ack = seed_and_ack()
    msg = pb.PublishAck.FromString(wire.ack_to_proto(ack, seed).SerializeToString())
    seed2, ack2 = wire.ack_from_proto(msg, request_id="r", round=ROUND, feature_dim=6, vocab_size=VOCAB)
    assert ack2 == ack
    assert torch.equal(seed2.features, seed.features) and torch.equal(seed2.advanced_tokens, seed.advanced_tokens)
    assert (seed2.start_position, seed2.round, seed2.frontier_token) == (10, ROUND, 7)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda m: setattr(m, "committed_len", 14), "seed.start_position"),
        (lambda m: m.output_tokens.__setitem__(-1, 8), "seed.advanced_tokens"),
        (lambda m: m.output_tokens.__setitem__(0, VOCAB), "output_tokens"),
        (lambda m: m.ClearField("output_tokens"), "output_tokens"),
        (lambda m: m.ClearField("seed"), "seed"),
        (lambda m: setattr(m.seed, "round", ROUND - 1), "seed.round"),
        (lambda m: setattr(m.seed, "request_id", "q"), "seed.request_id"),
        (lambda m: setattr(m.seed, "features", encode_tensor(torch.randn(3, 5))), "seed.features"),
        (lambda m: setattr(m.seed, "features", encode_tensor(torch.ones(3, 6, dtype=torch.int64))), "seed.features"),
        (lambda m: setattr(m.seed, "advanced_tokens", rows(6, 7)), "seed.features"),
        (lambda m: setattr(m.seed, "advanced_tokens", rows()), "seed.features"),
        (lambda m: setattr(m, "round", ROUND + 1), "round"),
    ],
)
def test_inconsistent_ack_is_rejected(mutate, field):
    msg = wire.ack_to_proto(*reversed(seed_and_ack()))
    mutate(msg)
    with pytest.raises(WireError) as err:
        wire.ack_from_proto(msg, request_id="r", round=ROUND, feature_dim=6, vocab_size=VOCAB)
    assert str(err.value).startswith(f"{field}: "), str(err.value)


def test_session_spec_defaults_and_rejections():
    msg = pb.OpenSessionRequest(request_id="r", prompt_ids=[1, 2], max_new_tokens=4, max_tree_rows=3)
    spec = wire.session_spec_from_proto(msg, vocab_size=VOCAB)
    assert spec.sampling == SamplingParams() and spec.seed == 0
    assert wire.session_spec_from_proto(wire.session_spec_to_proto(spec), vocab_size=VOCAB) == spec
    for overrides, field in [
        ({"prompt_ids": []}, "prompt_ids"),
        ({"prompt_ids": [1, VOCAB]}, "prompt_ids"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_tree_rows": 0}, "max_tree_rows"),
        ({"request_id": "x" * 257}, "request_id"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 2.0}, "min_p"),
    ]:
        bad = pb.OpenSessionRequest(request_id="r", prompt_ids=[1, 2], max_new_tokens=4, max_tree_rows=3)
        for name, value in overrides.items():
            if name == "prompt_ids":
                bad.ClearField("prompt_ids")
                bad.prompt_ids.extend(value)
            else:
                setattr(bad, name, value)
        with pytest.raises(WireError, match=f"^{field}: "):
            wire.session_spec_from_proto(bad, vocab_size=VOCAB)


def test_session_spec_carries_the_logits_processors():
    spec = wire.SessionSpec(
        request_id="r",
        prompt_ids=(1, 2),
        max_new_tokens=4,
        max_tree_rows=3,
        sampling=SamplingParams(
            temperature=0.7,
            top_k=5,
            top_p=0.9,
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            repetition_penalty=1.3,
            min_p=0.1,
            logit_bias=((1, -100.0), (5, 2.5)),
            min_tokens=7,
            min_tokens_stop_ids=(0, 3),
        ),
    )
    assert wire.session_spec_from_proto(wire.session_spec_to_proto(spec), vocab_size=VOCAB) == spec
    bad = wire.session_spec_to_proto(spec)
    bad.logit_bias[VOCAB] = 1.0
    with pytest.raises(WireError, match="^logit_bias: "):
        wire.session_spec_from_proto(bad, vocab_size=VOCAB)
    bad = wire.session_spec_to_proto(spec)
    bad.min_tokens_stop_ids.append(VOCAB)
    with pytest.raises(WireError, match="^min_tokens_stop_ids: "):
        wire.session_spec_from_proto(bad, vocab_size=VOCAB)
    bad = wire.session_spec_to_proto(spec)
    bad.min_tokens = -1
    with pytest.raises(WireError, match="^min_tokens: "):
        wire.session_spec_from_proto(bad, vocab_size=VOCAB)


def test_generate_request_round_trip_keeps_unset_fields_unset():
    req = parse_request(prompt="hi", method="eagle1", tree_depth=0, top_p=0.9, stop=["\n"], tree_min_value=0.0)
    msg = wire.generate_request_to_proto(req)
    assert msg.HasField("tree_depth") and msg.tree_depth == 0 and not msg.HasField("tree_budget")
    assert msg.HasField("tree_min_value") and not msg.HasField("tree_expand_min_value")
    assert wire.generate_request_from_proto(pb.GenerateRequest.FromString(msg.SerializeToString())) == req
    bare = wire.generate_request_from_proto(pb.GenerateRequest(prompt_ids=[1, 2]))
    assert bare == parse_request(prompt_ids=[1, 2])
    assert bare.max_new_tokens == 128 and bare.top_p == 1.0 and bare.tree_budget is None


@pytest.mark.parametrize(
    "msg, field",
    [
        (pb.GenerateRequest(), "prompt"),
        (pb.GenerateRequest(prompt="hi", max_new_tokens=0), "max_new_tokens"),
        (pb.GenerateRequest(prompt="hi", top_p=0.0), "top_p"),
        (pb.GenerateRequest(prompt="hi", method="eagle9"), "method"),
        (pb.GenerateRequest(prompt="hi", tree_kind="bushy"), "tree_kind"),
        (pb.GenerateRequest(prompt_ids=[1, -2]), "prompt_ids"),
        (pb.GenerateRequest(prompt="hi", request_id=" "), "request_id"),
        (pb.GenerateRequest(prompt="hi", request_id="r" * 257), "request_id"),
    ],
)
def test_generate_request_rejections_name_the_field(msg, field):
    with pytest.raises(WireError, match=f"^{field}: "):
        wire.generate_request_from_proto(msg)
    with pytest.raises(WireError, match="^drafter: "):
        wire.generate_request_to_proto(parse_request(prompt="hi", drafter="/tmp/d"))


def test_cancel_request_round_trip_and_rejections():
    """A Cancel names one request: 1 to 256 characters, not blank; both directions validate."""
    assert wire.cancel_request_from_proto(wire.cancel_request_to_proto("req-7")).request_id == "req-7"
    assert wire.generate_request_from_proto(pb.GenerateRequest(prompt="hi", request_id="")).request_id == ""
    for bad in ("", "   ", "r" * 257):
        with pytest.raises(WireError, match="^request_id: "):
            wire.cancel_request_from_proto(pb.CancelRequest(request_id=bad))
        with pytest.raises(ValueError, match="^request_id: "):
            wire.cancel_request_to_proto(bad)


def test_one_field_list_for_the_request_model_the_proto_and_the_converters():
    """GenerateRequest's fields are the proto's (``drafter``, a server-side folder, aside), and the
    converters carry every one of them, so that a field added in one place and not the others fails here."""
    schema = set(GenerateRequest.model_fields) - {"drafter"}
    assert schema == {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields}
    carried = {"raw", "stop", "prompt_ids", "messages", "logit_bias", "response_format", "stop_token_ids"}
    assert set(wire._OPTIONAL_REQUEST_FIELDS) | carried == schema
    assert not set(wire._OPTIONAL_REQUEST_FIELDS) & carried
    # grammar: the response format's key; min_tokens_stop_ids: the target's ids that end the answer
    sampler = {f.name for f in fields(SamplingParams)} - {"grammar", "min_tokens_stop_ids"}
    assert sampler <= schema and set(wire.SAMPLING_FIELDS) | {"logit_bias"} == sampler
    session = {f.name for f in pb.OpenSessionRequest.DESCRIPTOR.fields}
    assert sampler - {"logit_bias"} <= session and {"grammar", "min_tokens_stop_ids"} <= session
