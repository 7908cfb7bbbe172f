"""Expert-union accounting per request inside a batched verify (design 0x09A), on a tiny random Mixtral."""

from __future__ import annotations

import pytest
import torch

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree
from eyas.target.engine import TargetEngine
from eyas.target.experts import expert_bytes, expert_union
from tests.testing import ours_from_hf, tiny_hf

PROMPTS = {"a": [1, 2, 3, 4, 5], "b": [9, 8, 7], "c": [20, 21, 22, 23, 24, 25, 26]}
TREES = {  # a: a 4-node tree of two branches; b: plain (root row only); c: a chain of 2
    "a": DraftTree(
        torch.tensor([10, 11, 12, 13]),
        torch.tensor([PARENT_IS_ROOT, 0, PARENT_IS_ROOT, 2]),
        torch.tensor([1, 2, 1, 2]),
        torch.full((4,), 0.5),
    ),
    "b": DraftTree.empty(),
    "c": DraftTree(
        torch.tensor([30, 31]), torch.tensor([PARENT_IS_ROOT, 0]), torch.tensor([1, 2]), torch.full((2,), 0.5)
    ),
}


@pytest.fixture(scope="module")
def moe():
    return ours_from_hf(tiny_hf("mixtral", experts=16, top_k=2, seed=3))


def opened(model, ids):
    e = TargetEngine(model, ())
    for rid in ids:
        e.open_session(rid, PROMPTS[rid], 8, 8)
        v = e.prefill(rid)
        e.publish(rid, v.round, AcceptDecision(torch.arange(len(PROMPTS[rid])), torch.tensor(PROMPTS[rid][1:]), 6))
    return e


def test_expert_union_of_a_row_range():
    """Worked example: rows routed [[0, 2], [2, 3], [0, 3]]; rows 1:2 alone -> (2, 3); rows 0:2 -> (0, 2, 3)."""
    routing = [torch.tensor([[0, 2], [2, 3], [0, 3]])]
    assert expert_union(routing, slice(1, 2)) == ((2, 3),)
    assert expert_union(routing, slice(0, 2)) == ((0, 2, 3),)


def test_each_request_in_a_batched_verify_gets_the_bytes_of_its_own_rows(moe):
    """Batch a, b, c in one forward: each request's figure equals what verifying it alone records,
    and the batch's figure is the union over all three (no more than their sum, no less than the largest)."""
    batched = opened(moe, PROMPTS)
    batched.verify_batch(list(TREES.items()))
    per_expert = moe.cfg.expert_bytes_per_expert
    alone = {}
    for rid, tree in TREES.items():
        e = opened(moe, [rid])
        e.verify(rid, tree)
        alone[rid] = (e.last_expert_union, e.last_expert_bytes)
        assert e.last_request_expert_bytes == {rid: e.last_expert_bytes}
    assert batched.last_request_expert_bytes == {rid: b for rid, (_, b) in alone.items()}
    union = tuple(
        tuple(sorted(set().union(*(alone[rid][0][layer] for rid in TREES)))) for layer in range(moe.cfg.num_layers)
    )
    assert batched.last_expert_union == union
    assert batched.last_expert_bytes == expert_bytes(union, per_expert)
    assert max(b for _, b in alone.values()) <= batched.last_expert_bytes <= sum(b for _, b in alone.values())
    # a plain request (one row) reads exactly top-k experts in each layer
    assert alone["b"][1] == moe.cfg.num_layers * moe.cfg.experts_per_token * per_expert


def test_a_refused_member_adds_no_expert_bytes(moe):
    e = opened(moe, ["a", "c"])
    out = e.verify_batch([("a", TREES["a"]), ("ghost", TREES["b"]), ("c", TREES["c"])])
    assert isinstance(out[1], ValueError)
    assert set(e.last_request_expert_bytes) == {"a", "c"}


def test_expert_traffic_shape_describes_the_moe_layers(moe, tiny_target):
    shape = TargetEngine(moe, ()).expert_traffic_shape()
    assert shape == {
        "moe_layers": moe.cfg.num_layers,
        "num_experts": 16,
        "experts_per_token": 2,
        "bytes_per_expert": moe.cfg.expert_bytes_per_expert,
    }
    assert set(TargetEngine(tiny_target, ()).expert_traffic_shape().values()) == {0}
