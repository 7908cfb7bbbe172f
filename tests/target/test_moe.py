"""Mixture-of-experts targets (Mixtral and OLMoE kinds): logits equal HF's; expert unions and bytes are exact."""
from __future__ import annotations

import pytest
import torch

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import PARENT_IS_SEED, DraftTree
from eyas.target.engine import TargetEngine
from eyas.target.experts import expert_bytes, expert_union
from eyas.testing import branch_tokens, ours_from_hf, tiny_hf_mixtral, tiny_hf_olmoe


@pytest.fixture(scope="module", params=["mixtral", "olmoe", "olmoe-clip"])
def moe_pair(request):
    hf = {"mixtral": tiny_hf_mixtral, "olmoe": tiny_hf_olmoe,
          "olmoe-clip": lambda: tiny_hf_olmoe(clip_qkv=0.5, seed=1)}[request.param]()
    return hf, ours_from_hf(hf)


def test_expert_union_worked_example():
    """Rows routed [[0, 2], [2, 3], [0, 3]] in layer 0 and [[1, 1], [1, 5], [5, 1]] in layer 1 ->
    unions (0, 2, 3) and (1, 5); with 100 bytes an expert -> (3 + 2) * 100 = 500 bytes."""
    routing = [torch.tensor([[0, 2], [2, 3], [0, 3]]), torch.tensor([[1, 1], [1, 5], [5, 1]])]
    assert expert_union(routing) == ((0, 2, 3), (1, 5))
    assert expert_bytes(expert_union(routing), 100) == 500


def test_moe_logits_equal_hf(moe_pair):
    hf, ours = moe_pair
    assert ours.cfg.num_experts == 8 and ours.cfg.experts_per_token == 2
    ids = torch.tensor([[3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3]])
    n = ids.shape[1]
    out = ours(ids, torch.arange(n)[None], ours.allocate_cache(1, n), 0,
               torch.ones(n, n, dtype=torch.bool).tril()[None], ())
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)


def test_a_verify_records_the_union_of_experts_its_rows_route_to(moe_pair):
    """Brute force: each verify row's experts come from HF's router on that row's own causal branch."""
    hf, ours = moe_pair
    e = TargetEngine(ours, ())
    prompt = [1, 2, 3, 4, 5]
    e.open_session("m", prompt, 8, 8)
    v = e.prefill("m")
    e.publish("m", v.round, AcceptDecision(torch.arange(5), torch.tensor(prompt[1:]), 6))
    tree = DraftTree(torch.tensor([10, 11, 12, 13]), torch.tensor([PARENT_IS_SEED, 0, PARENT_IS_SEED, 2]),
                     torch.tensor([1, 2, 1, 2]), torch.full((4,), .5))
    v = e.verify("m", tree)
    expected = [set() for _ in range(ours.cfg.num_layers)]
    for row in range(v.flat.num_rows):
        with torch.no_grad():
            routers = hf(torch.tensor([e.sessions["m"].tokens + branch_tokens(v.flat, row)]),
                         output_router_logits=True).router_logits
        for layer, logits in enumerate(routers):
            expected[layer] |= set(torch.softmax(logits[-1].float(), -1).topk(2).indices.tolist())
        assert len(routers) == ours.cfg.num_layers
    assert e.last_expert_union == tuple(tuple(sorted(x)) for x in expected)
    per_expert = 3 * ours.cfg.hidden_size * ours.cfg.intermediate_size * 4
    assert ours.cfg.expert_bytes_per_expert == per_expert
    layer0 = ours.layers[0].mlp
    assert per_expert == (layer0.gate_up[0].numel() + layer0.down[0].numel()) * layer0.gate_up.element_size()
    assert e.last_expert_bytes == sum(len(u) for u in expected) * per_expert


def test_a_dense_config_keeps_its_fingerprint_digest(tiny_target):
    from dataclasses import asdict
    import hashlib
    import json

    legacy = {k: v for k, v in asdict(tiny_target.cfg).items()   # the fields before MoE and OLMoE support
              if k not in ("num_experts", "experts_per_token", "norm_topk_prob", "qk_norm", "clip_qkv")}
    assert tiny_target.cfg.digest() == hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()


def test_an_olmoe_config_reads_its_own_knobs():
    """OLMoE: q/k norms on, top-k weights not renormalised, experts from ``num_experts``; Qwen2-MoE is
    refused naming the field."""
    from eyas.target.model import TargetConfig

    hf = tiny_hf_olmoe(clip_qkv=2.0)
    cfg = TargetConfig.from_hf(hf.config)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.qk_norm, cfg.clip_qkv) == (8, 2, False, True, 2.0)
    assert cfg.digest() != TargetConfig.from_hf({**hf.config.to_dict(), "clip_qkv": None}).digest()
    with pytest.raises(ValueError, match="^config.model_type: 'qwen2_moe'"):
        TargetConfig.from_hf({**hf.config.to_dict(), "model_type": "qwen2_moe"})
