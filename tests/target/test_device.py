"""The target engine computes on its model's device: nothing it runs mixes that device with the CPU.

There is no GPU here, so the device is ``meta`` (shapes without values), and a torch-function mode
refuses any op whose tensor operands (0-dim ones aside) sit on more than one device. Meta alone is
lenient (indexing a meta tensor with a CPU index passes); the mode is what catches a CPU index
into device K/V, a CPU mask beside device scores, and the like: the mistakes a CUDA run would
raise on. Host-side bookkeeping (flattening a tree, building masks) stays on the CPU, and is moved
once, when a round's plan is built.
"""

from __future__ import annotations

import pytest
import torch

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import DraftTree
from eyas.target.config import eagle3_feature_address
from eyas.target.engine import PrefillProgress, TargetEngine
from tests.testing import NoDeviceMix, ours_from_hf, tiny_hf


def test_the_mode_catches_what_meta_alone_lets_through():
    k = torch.ones(4, 3, device="meta")
    k.index_select(0, torch.tensor([0, 1]))  # meta alone: no error
    with NoDeviceMix(), pytest.raises(AssertionError, match="operands on"):
        k.index_select(0, torch.tensor([0, 1]))


def test_prefill_chunks_verify_and_publish_stay_on_the_model_device():
    """Two requests on a meta target: a chunked prefill beside a verify, whole prefills, batched and
    lone verifies, publishes (commit by index) and a reseed: no op mixes meta and CPU, and every
    tensor the engine holds or returns is on meta (logits, features, the K/V store)."""
    model = ours_from_hf(tiny_hf("llama")).to("meta")
    e = TargetEngine(model, eagle3_feature_address(model.cfg))
    tree = DraftTree(
        torch.tensor([3, 4, 5]), torch.tensor([-1, 0, 0]), torch.tensor([1, 2, 2]), torch.tensor([0.5, 0.4, 0.3])
    )
    guard = NoDeviceMix()
    with guard:
        e.open_session("a", [1, 2, 3, 4, 5, 6], 8, 4)
        e.open_session("b", [7, 8, 9], 8, 4)
        (a,), _ = e.step(["a"], [])
        e.publish("a", a.round, AcceptDecision(torch.arange(6), torch.tensor([2, 3, 4, 5, 6]), 11))
        e.open_session("c", list(range(1, 21)), 8, 4)
        pre, ver = e.step(["b", "c"], [("a", tree)], max_prefill_rows=8)  # b whole, c 5 of 20 rows
        assert isinstance(pre[1], PrefillProgress) and pre[1].prefilled == 5
        e.publish("a", ver[0].round, AcceptDecision(torch.tensor([0, 2]), torch.tensor([4]), 12))
        e.publish("b", pre[0].round, AcceptDecision(torch.arange(3), torch.tensor([8, 9]), 13))
        c = pre[1]
        while isinstance(c, PrefillProgress):
            (c,), _ = e.step(["c"], [], max_prefill_rows=8)
        e.publish("c", c.round, AcceptDecision(torch.arange(20), torch.arange(2, 21), 14))
        out = e.verify_batch([("a", DraftTree.empty()), ("b", tree), ("c", DraftTree.empty())])
        seed = e.committed_seed("a")
        held = [e.kv.k, e.kv.v, seed.features] + [t for v in out for t in (v.logits, v.features)]
        held += [f for s in e.sessions.values() for f in s.features]
        e.publish("c", out[2].round, AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 15))
        e.close_session("b")  # c's row moves into b's place
        lone = e.verify("c", DraftTree.empty())
    assert guard.ops > 100
    assert {t.device.type for t in held + [lone.logits, lone.features, e.kv.k]} == {"meta"}
