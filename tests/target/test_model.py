"""The compact target forward: equal to HF transformers, tree rows equal per-branch forwards."""
from __future__ import annotations

import pytest
import torch

from eyas.testing import ours_from_hf, tiny_hf_llama
from eyas.target.model import FeatureTap, TargetConfig, eagle1_feature_address, eagle3_feature_address

TOL = 1e-4


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)


def full_forward(model, ids: list[int], taps=()):
    cache = model.allocate_cache(1, len(ids))
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, 0, causal(len(ids)), taps)


@pytest.mark.parametrize("shape", [dict(), dict(layers=3, heads=2, kv_heads=2, hidden=16), dict(tie=True)])
def test_tiny_logits_equal_hf(shape):
    hf = tiny_hf_llama(**shape)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    out = full_forward(ours, ids[0].tolist())
    assert (out.logits - ref).abs().max().item() < TOL


def test_feature_taps_equal_hf_hidden_states(tiny_pair):
    """Tap (k, normed=False) is HF's hidden_states[k] (after k layers); (L, True) is the LM-head input."""
    hf, ours = tiny_pair
    L = ours.cfg.num_layers
    taps = (FeatureTap(0, False), FeatureTap(1, False), FeatureTap(L, True))
    ids = list(range(3, 15))
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    feats = full_forward(ours, ids, taps).features[0]
    d = ours.cfg.hidden_size
    for i, ref in enumerate([hs[0][0], hs[1][0], hs[L][0]]):
        assert (feats[:, i * d:(i + 1) * d] - ref).abs().max().item() < TOL


def test_default_feature_addresses():
    cfg = TargetConfig(vocab_size=10, hidden_size=8, num_layers=30, num_heads=2, num_kv_heads=1, head_dim=4,
                       intermediate_size=16, rope_theta=1e4, rms_norm_eps=1e-5, max_position_embeddings=64,
                       tie_word_embeddings=True)
    assert eagle1_feature_address(cfg) == (FeatureTap(30, True),)
    assert [t.layers_applied for t in eagle3_feature_address(cfg)] == [2, 15, 27]


def test_tree_rows_equal_per_branch_forwards(tiny_target):
    """Each row of one tree-masked forward equals a plain causal forward of its own branch.

    Worked example: prefix p (7 tokens), root r, tree r->a, r->b, a->c. Row c sees p, r, a, c and
    sits at position 7 + 2; its logits must equal the last row of forward(p + [r, a, c]).
    """
    m = tiny_target
    prefix = [5, 9, 2, 33, 17, 8, 40]
    rows = [11, 21, 22, 31]           # r, a, b, c
    parents = [-1, 0, 0, 1]
    depth = [0, 1, 1, 2]
    n, R = len(prefix), len(rows)
    cache = m.allocate_cache(1, n + R)
    full_forward_prefix = m(torch.tensor([prefix]), torch.arange(n)[None], cache, 0, causal(n), ())
    tree = torch.zeros(R, R, dtype=torch.bool)
    for i in range(R):
        j = i
        while j != -1:
            tree[i, j] = True
            j = parents[j]
    mask = torch.cat([torch.ones(R, n, dtype=torch.bool), tree], 1)[None]
    out = m(torch.tensor([rows]), torch.tensor([[n + d for d in depth]]), cache, n, mask, ())
    for i in range(R):
        branch, j = [], i
        while j != -1:
            branch.insert(0, rows[j])
            j = parents[j]
        ref = full_forward(m, prefix + branch).logits[0, -1]
        assert (out.logits[0, i] - ref).abs().max().item() < TOL, f"row {i}"
    assert full_forward_prefix.logits.shape[1] == n


def test_kv_commit_by_index_equals_fresh_prefill(tiny_target):
    """KV rollback: keep rows [0, 2] of a 4-row tree, then the next forward equals a fresh prefill."""
    m = tiny_target
    prefix = [3, 4, 5, 6]
    rows, parents = [10, 11, 12, 13], [-1, 0, 0, 2]   # r, a, b (child of r), d (child of b)
    n, R = len(prefix), len(rows)
    cache = m.allocate_cache(1, n + R + 1)
    m(torch.tensor([prefix]), torch.arange(n)[None], cache, 0, causal(n), ())
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(R, n, dtype=torch.bool), tree], 1)[None]
    m(torch.tensor([rows]), torch.tensor([[n, n + 1, n + 1, n + 2]]), cache, n, mask, ())
    cache.gather_commit(torch.tensor([n + 0, n + 2]), n)  # accept r, b
    committed = n + 2
    nxt = m(torch.tensor([[50]]), torch.tensor([[committed]]), cache, committed, None, ())
    ref = full_forward(m, prefix + [10, 12, 50]).logits[0, -1]
    assert (nxt.logits[0, -1] - ref).abs().max().item() < TOL


def test_mask_shape_is_checked(tiny_target):
    cache = tiny_target.allocate_cache(1, 8)
    with pytest.raises(ValueError, match="mask"):
        tiny_target(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache, 0, None, ())
    with pytest.raises(ValueError, match="slots"):
        tiny_target(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), cache, 7, torch.ones(1, 2, 9, dtype=torch.bool), ())


def test_config_rejects_unsupported_rope():
    with pytest.raises(ValueError, match="rope"):
        TargetConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                              "num_attention_heads": 2, "intermediate_size": 8,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


@pytest.mark.real_model
def test_real_default_model_logits_equal_hf(real_eyas):
    from transformers import AutoModelForCausalLM

    from eyas.target.loader import _materialize_gguf, default_gguf_path

    hf = AutoModelForCausalLM.from_pretrained(_materialize_gguf(default_gguf_path()), dtype=torch.float32).eval()
    ids = real_eyas.encode("Write a haiku about the sea.")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits
    out = full_forward(real_eyas.model, ids)
    assert (out.logits - ref).abs().max().item() < TOL
