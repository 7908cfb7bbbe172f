"""Mixture-of-experts targets (Mixtral, OLMoE and Qwen2-MoE kinds): logits equal HF's; expert unions and bytes
are exact."""

from __future__ import annotations

import pytest
import torch

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree
from eyas.target.config import TargetConfig
from eyas.target.engine import TargetEngine
from eyas.target.experts import expert_bytes, expert_union
from eyas.target.layers import MoE
from tests.testing import branch_tokens, ours_from_hf, tiny_hf

MOE_KINDS = {
    "mixtral": lambda: tiny_hf("mixtral"),
    "olmoe": lambda: tiny_hf("olmoe"),
    "olmoe-clip": lambda: tiny_hf("olmoe", clip_qkv=0.5, seed=1),
    # layers sparse, dense (mlp_only_layers), sparse; top-k weights not renormalised (Qwen2-MoE's default)
    "qwen2_moe": lambda: tiny_hf("qwen2_moe"),
    # decoder_sparse_step 2 over 4 layers: dense, sparse, dense, sparse; top-k weights renormalised
    "qwen2_moe-step": lambda: tiny_hf(
        "qwen2_moe", layers=4, mlp_only_layers=(), decoder_sparse_step=2, norm_topk_prob=True, seed=1
    ),
    # per-head q/k norms, no shared expert; layers sparse, dense (mlp_only_layers), sparse
    "qwen3_moe": lambda: tiny_hf("qwen3_moe"),
}


@pytest.fixture(scope="module", params=list(MOE_KINDS))
def moe_pair(request):
    hf = MOE_KINDS[request.param]()
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
    out = ours(
        ids, torch.arange(n)[None], ours.allocate_cache(1, n), 0, torch.ones(n, n, dtype=torch.bool).tril()[None], ()
    )
    with torch.no_grad():
        ref = hf(ids).logits
    torch.testing.assert_close(out.logits, ref, rtol=1e-4, atol=1e-4)


def test_a_verify_records_the_union_of_experts_its_rows_route_to(moe_pair):
    """Brute force: each verify row's experts come from HF's router on that row's own causal branch.

    HF returns router logits for the sparse layers only, in layer order (a Qwen2-MoE dense layer has no
    router), as ``expert_routing()`` and the union do; the shared expert is read by every row and is not
    counted."""
    hf, ours = moe_pair
    e = TargetEngine(ours, ())
    prompt = [1, 2, 3, 4, 5]
    e.open_session("m", prompt, 8, 8)
    v = e.prefill("m")
    e.publish("m", v.round, AcceptDecision(torch.arange(5), torch.tensor(prompt[1:]), 6))
    tree = DraftTree(
        torch.tensor([10, 11, 12, 13]),
        torch.tensor([PARENT_IS_ROOT, 0, PARENT_IS_ROOT, 2]),
        torch.tensor([1, 2, 1, 2]),
        torch.full((4,), 0.5),
    )
    v = e.verify("m", tree)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert sparse == [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, MoE)] and sparse
    expected = [set() for _ in sparse]
    for row in range(v.flat.num_rows):
        with torch.no_grad():
            routers = hf(
                torch.tensor([e.sessions["m"].tokens + branch_tokens(v.flat, row)]), output_router_logits=True
            ).router_logits
        assert len(routers) == len(sparse)
        for k, logits in enumerate(routers):
            expected[k] |= set(torch.softmax(logits[-1].float(), -1).topk(ours.cfg.experts_per_token).indices.tolist())
    assert e.last_expert_union == tuple(tuple(sorted(x)) for x in expected)
    hf_experts = hf.model.layers[sparse[0]].mlp.experts  # fused [E, 2f, d] and [E, d, f]
    per_expert = (hf_experts.gate_up_proj[0].numel() + hf_experts.down_proj[0].numel()) * 4
    assert ours.cfg.expert_bytes_per_expert == per_expert
    first = ours.layers[sparse[0]].mlp
    assert per_expert == (first.gate_up[0].numel() + first.down[0].numel()) * first.gate_up.element_size()
    assert e.last_expert_bytes == sum(len(u) for u in expected) * per_expert


def test_a_dense_config_keeps_its_fingerprint_digest(tiny_target):
    import hashlib
    import json
    from dataclasses import asdict

    legacy = {
        k: v
        for k, v in asdict(tiny_target.cfg).items()  # the fields before MoE, OLMoE and Qwen2 support
        if k
        not in (
            "num_experts",
            "experts_per_token",
            "norm_topk_prob",
            "qk_norm",
            "clip_qkv",
            "qkv_bias",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "dense_layers",
            "sliding_window",
            "rope_scaling",
            "qk_norm_per_head",
        )
    }
    assert tiny_target.cfg.digest() == hashlib.sha256(json.dumps(legacy, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize(
    "kind, digest",
    [
        ("mixtral", "afdb1be0e60bb2b86240e15dc91a7e04dd6682f77df6a3261549285cfb61bfae"),
        ("olmoe", "88c75f7f3b39130106bc1d70e5cc0ca5f5781c958d3b5f9828faea560ac27a51"),
        ("olmoe-clip", "34eac58132387992dd3f195081449f8809f4fe06d74462e098def5219876c4d4"),
    ],
)
def test_moe_config_digests_are_pinned(kind, digest):
    """Digests computed before Qwen2/Qwen2-MoE support: adding fields must not move an existing kind's
    fingerprint (a drafter records it and is refused on a mismatch)."""
    assert TargetConfig.from_hf(MOE_KINDS[kind]().config).digest() == digest


def test_a_qwen2_moe_config_reads_its_own_knobs():
    """Qwen2-MoE: q/k/v biases, top-k weights not renormalised by default, routed experts of
    ``moe_intermediate_size`` (which sizes an expert's bytes), a shared expert, dense layers by HF's rule."""
    hf = tiny_hf("qwen2_moe", hidden=32)  # intermediate 64, routed 16, shared 48; layer 1 dense
    cfg = TargetConfig.from_hf(hf.config)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.qkv_bias) == (8, 2, False, True)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (64, 16, 48)
    assert cfg.dense_layers == (1,)
    assert cfg.expert_bytes_per_expert == 3 * 32 * 16 * 4 != 3 * 32 * cfg.intermediate_size * 4
    raw = hf.config.to_dict()
    # transformers' rule: sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
    stepped = TargetConfig.from_hf({**raw, "num_hidden_layers": 6, "mlp_only_layers": [3], "decoder_sparse_step": 2})
    assert stepped.dense_layers == (0, 2, 3, 4) and stepped.is_moe_layer(1) and not stepped.is_moe_layer(3)
    assert TargetConfig.from_hf({k: v for k, v in raw.items() if k != "norm_topk_prob"}).norm_topk_prob is False
    assert cfg.digest() != TargetConfig.from_hf({**raw, "mlp_only_layers": []}).digest()
    assert cfg.sliding_window is None  # Qwen2-MoE's default window (0) is off under use_sliding_window false
    windowed = TargetConfig.from_hf({**raw, "use_sliding_window": True, "sliding_window": 16, "layer_types": None})
    assert windowed.max_context == 16


def test_an_olmoe_config_reads_its_own_knobs():
    """OLMoE: q/k norms on, top-k weights not renormalised, experts from ``num_experts``; an MoE kind not
    supported yet (DeepSeek-V3) is refused naming the field and the kinds that are."""
    hf = tiny_hf("olmoe", clip_qkv=2.0)
    cfg = TargetConfig.from_hf(hf.config)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.qk_norm, cfg.clip_qkv) == (
        8,
        2,
        False,
        True,
        2.0,
    )
    assert cfg.digest() != TargetConfig.from_hf({**hf.config.to_dict(), "clip_qkv": None}).digest()
    with pytest.raises(ValueError, match="^config.model_type: 'deepseek_v3_moe'.*Qwen3-MoE"):
        TargetConfig.from_hf({**hf.config.to_dict(), "model_type": "deepseek_v3_moe"})
