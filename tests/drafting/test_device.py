"""The drafter engine computes on its weights' device: nothing it runs mixes that device with the CPU.

As for the target engine (tests/target/test_device.py), the device is ``meta`` and ``NoDeviceMix``
refuses any op whose operands span two devices. Unlike the target, the drafter reads values on the
host to grow its tree (the top children's ids and confidences); on meta those reads answer fixed
values of the right shape (``HostReadsOnMeta``), so the whole growth runs: context rows, every depth's
packed pass, the LM head and the tree's selection. Seeds arrive on the CPU, as decoded from the wire.
"""

from __future__ import annotations

import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.drafting.model import DrafterConfig, init_drafter
from eyas.protocol.messages import Seed
from eyas.target.config import eagle1_feature_address, eagle3_feature_address
from tests.testing import NoDeviceMix, ours_from_hf, tiny_hf


class HostReadsOnMeta(NoDeviceMix):
    """``NoDeviceMix``, and a host read (``tolist``) of a meta tensor answers values of its shape: row
    ``i`` of an integer ``[P, k]`` reads ``[0, ..., k-1]``, a floating one ``1 / (k + 1)`` each."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist and args[0].is_meta:
            t = args[0]
            self.ops += 1
            rows, k = t.shape if t.dim() == 2 else (1, t.numel())
            row = list(range(k)) if not t.dtype.is_floating_point else [1.0 / (k + 1)] * k
            return [list(row) for _ in range(rows)] if t.dim() == 2 else row
        return super().__torch_function__(func, types, args, kwargs)


def test_drafting_stays_on_the_drafter_device():
    """Two requests, EAGLE-1 and EAGLE-3 drafters on a meta target head, a dynamic tree and a chain,
    two rounds each (context rows, tree growth, publish): no op mixes meta with the CPU, the draft K/V
    is on meta, and each proposed tree comes back to the host with its planned size."""
    target = ours_from_hf(tiny_hf("llama")).to("meta")
    cfg = target.cfg
    for method, taps in (("eagle1", eagle1_feature_address(cfg)), ("eagle3", eagle3_feature_address(cfg))):
        engine = DrafterEngine(
            init_drafter(DrafterConfig.for_target(method, cfg)).to("meta"), target.embed, target.lm_head, taps=taps
        )
        width = len(taps) * cfg.hidden_size
        trees = {"a": TreeSpec(expand_width=2, max_depth=3, verify_budget=5), "b": TreeSpec(kind="chain", max_depth=2)}
        guard = HostReadsOnMeta()
        with guard:
            for rid in trees:
                engine.open_session(rid, 64)
            start = {"a": 0, "b": 0}
            for round_ in range(2):
                rows = {"a": 5 if round_ == 0 else 2, "b": 3 if round_ == 0 else 1}
                seeds = [
                    (rid, Seed(torch.randn(rows[rid], width), torch.arange(rows[rid]), start[rid], round_), trees[rid])
                    for rid in trees
                ]  # host tensors, as decoded from the wire
                out = engine.propose_batch(seeds)
                for rid in trees:
                    engine.publish(rid)
                    start[rid] += rows[rid]
                assert [t.num_nodes for t in out] == [5, 2]
                assert {t.tokens.device.type for t in out} == {"cpu"}  # a tree is host data (it is flattened there)
        assert guard.ops > 50
        assert engine.kv.k.device.type == "meta"
