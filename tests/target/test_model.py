"""The compact target forward: equal to HF transformers, tree rows equal per-branch forwards."""

from __future__ import annotations

import pytest
import torch

from eyas.target.config import FeatureTap, TargetConfig, eagle1_feature_address, eagle3_feature_address
from eyas.target.layers import head_rows
from eyas.target.model import TargetModel
from eyas.target.precision import quantize_fp16_weights, quantize_int8
from tests.testing import ours_from_hf, tiny_hf

TOL = 1e-4


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)


def full_forward(model, ids: list[int], taps=()):
    cache = model.allocate_cache(1, len(ids))
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, 0, causal(len(ids)), taps)


@pytest.mark.parametrize("shape", [dict(), dict(layers=3, heads=2, kv_heads=2, hidden=16), dict(tie=True)])
def test_tiny_logits_equal_hf(shape):
    hf = tiny_hf("llama", **shape)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, hf.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    out = full_forward(ours, ids[0].tolist())
    assert (out.logits - ref).abs().max().item() < TOL


@pytest.mark.parametrize("tie", [False, True])
def test_qwen2_logits_equal_hf(tie):
    """Qwen2 (dense): the q/k/v projection biases are loaded into the fused wqkv; without them the logits
    move far beyond the tolerance (the bug this test pins: biases once silently dropped)."""
    hf = tiny_hf("qwen2", tie=tie)
    ours = ours_from_hf(hf)
    assert ours.cfg.qkv_bias and ours.layers[0].attn.wo.bias is None
    ids = torch.randint(0, hf.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    out = full_forward(ours, ids[0].tolist())
    assert (out.logits - ref).abs().max().item() < TOL
    for layer in ours.layers:
        layer.attn.wqkv.bias.zero_()
    assert (full_forward(ours, ids[0].tolist()).logits - ref).abs().max().item() > 100 * TOL


def test_an_unconsumed_checkpoint_tensor_is_refused():
    """A checkpoint tensor the target does not read is an error naming it (a Qwen2 checkpoint under a Llama
    config: its q/k/v biases); rotary inv_freq buffers and a tied lm_head.weight are not."""
    hf = tiny_hf("qwen2")
    as_llama = TargetConfig.from_hf({**hf.config.to_dict(), "model_type": "llama"})
    assert not as_llama.qkv_bias
    with pytest.raises(
        ValueError,
        match=r"^checkpoint: tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' .*"
        r"\(and 5 more\)",
    ):
        TargetModel(as_llama).load_hf_state_dict(hf.state_dict())
    tied = tiny_hf("llama", tie=True)
    sd = {
        **tied.state_dict(),
        "model.rotary_emb.inv_freq": torch.ones(4),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
        "lm_head.weight": tied.lm_head.weight,
    }
    TargetModel(TargetConfig.from_hf(tied.config)).load_hf_state_dict(sd)
    with pytest.raises(ValueError, match="^checkpoint: tensor 'model.extra.weight' is not used"):
        TargetModel(TargetConfig.from_hf(tied.config)).load_hf_state_dict({**sd, "model.extra.weight": torch.ones(1)})


def test_qwen2_int8_keeps_the_qkv_bias():
    """int8: the biased wqkv becomes a RowStableInt8Linear whose fbgemm linear carries the fp32 bias
    unchanged (SmoothQuant scales only the weight's input columns), and its output tracks fp32 to well
    within the bias's own size."""
    hf = tiny_hf("qwen2", seed=3)
    fp, q = ours_from_hf(hf), quantize_int8(ours_from_hf(hf))
    bias = fp.layers[0].attn.wqkv.bias  # [(H + 2 H_kv) hd]
    assert torch.equal(q.layers[0].attn.wqkv.qlinear.bias(), bias)
    ids = torch.randint(0, hf.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(1))
    x = fp.layers[0].attn_norm(fp.embed(ids))  # [1, T, d]
    err = (q.layers[0].attn.wqkv(x) - fp.layers[0].attn.wqkv(x)).abs().max().item()
    assert err < 0.2 * bias.abs().max().item()
    assert full_forward(q, ids[0].tolist()).logits.isfinite().all()


@pytest.mark.parametrize("use_kernels", [False, True], ids=["fbgemm", "eyas-kernels"])
def test_fp16w_keeps_fp16_weights_computes_in_fp32_and_stays_close_to_fp32(use_kernels):
    """fp16w: every Linear (LM head and the Qwen2 qkv bias included) becomes an fp16-weight linear
    (fbgemm's, or Eyas's row-invariant kernel where it runs); the embedding (tied to the head here)
    stays fp32 and untouched; the logits stay fp32 and within fp16's weight rounding of the fp32
    model's (relative 2^-11 per weight), same top-1."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    from eyas import kernels

    if use_kernels and kernels.load() is None:
        pytest.skip(f"Eyas's CPU kernels do not run here: {kernels.why_not()}")
    kind = kernels.F16WLinear if use_kernels else DynamicLinear
    for hf in (tiny_hf("llama", tie=True, seed=2), tiny_hf("qwen2", seed=3)):
        fp = ours_from_hf(hf)
        embed = fp.embed.weight.detach().clone()
        h = quantize_fp16_weights(ours_from_hf(hf), use_kernels=use_kernels)
        assert not any(isinstance(m, torch.nn.Linear) for m in h.modules())
        assert isinstance(h.lm_head, kind) and isinstance(h.layers[0].attn.wqkv, kind)
        assert all((a.kernels is not None) == use_kernels for a in h.modules() if hasattr(a, "row_stable"))
        assert torch.equal(h.embed.weight, embed)
        ids = torch.randint(0, hf.config.vocab_size, (21,), generator=torch.Generator().manual_seed(1)).tolist()
        a, b = full_forward(fp, ids).logits, full_forward(h, ids).logits  # [1, T, V]
        assert b.dtype == torch.float32
        assert 0 < (a - b).abs().max().item() < 1e-2 * a.abs().max().item()
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize(
    "build, digest",
    [
        (lambda: tiny_hf("llama"), "171a82362ee775fac9625994d2df98c8b76e0b82b85a4fb09a3eab885a53bfca"),
        (lambda: tiny_hf("llama", tie=True), "c06621e60ba0e99cd65184ec70b02671631b65762ba2efd1eb586eb424789773"),
    ],
)
def test_dense_config_digests_are_pinned(build, digest):
    """Digests computed before Qwen2 support: new config fields must not move a dense Llama fingerprint."""
    assert TargetConfig.from_hf(build().config).digest() == digest


def test_the_default_targets_config_digest_is_pinned():
    """SmolLM2-135M's config (the fields its config.json sets; no weights are loaded) hashes to the
    digest the shipped drafters in drafters/*/manifest.json record."""
    smollm2 = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 9.999999747378752e-06,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
        "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
    }
    assert TargetConfig.from_hf(smollm2).digest() == "42f05d7e81184a0c52bba08e0105fd6c97ff3f224b5424e4533bbf4d6f17b92a"


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
        assert (feats[:, i * d : (i + 1) * d] - ref).abs().max().item() < TOL


def test_default_feature_addresses():
    cfg = TargetConfig(
        vocab_size=10,
        hidden_size=8,
        num_layers=30,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
        rope_theta=1e4,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    assert eagle1_feature_address(cfg) == (FeatureTap(30, True),)
    assert [t.layers_applied for t in eagle3_feature_address(cfg)] == [2, 15, 27]


def test_tree_rows_equal_per_branch_forwards(tiny_target):
    """Each row of one tree-masked forward equals a plain causal forward of its own branch.

    Worked example: prefix p (7 tokens), root r, tree r->a, r->b, a->c. Row c sees p, r, a, c and
    sits at position 7 + 2; its logits must equal the last row of forward(p + [r, a, c]).
    """
    m = tiny_target
    prefix = [5, 9, 2, 33, 17, 8, 40]
    rows = [11, 21, 22, 31]  # r, a, b, c
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
    rows = [10, 11, 12, 13]  # r, a, b (child of r), d (child of b): parents -1, 0, 0, 2
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
    with pytest.raises(ValueError, match="^config.rope_parameters.rope_type: 'longrope'"):
        TargetConfig.from_hf(
            {
                "model_type": "llama",
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 8,
                "rope_scaling": {"rope_type": "longrope", "factor": 8.0},
            }
        )


def test_a_sliding_window_caps_the_context():
    """Mistral with an 8-token window. Worked example: within 8 tokens every query sees every earlier key,
    so our full-causal forward equals HF's windowed one; at 12 tokens HF's rows 8-11 lose their oldest keys
    and differ. So the context is capped at the window (``max_context`` 8) and a session that would pass
    it is refused, naming the field, before any KV is allocated."""
    from eyas.target.engine import TargetEngine

    hf = tiny_hf("mistral", sliding_window=8)
    ours = ours_from_hf(hf)
    assert (ours.cfg.sliding_window, ours.cfg.max_position_embeddings, ours.cfg.max_context) == (8, 256, 8)
    ids = torch.randint(0, hf.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits  # [1, 12, V]
    out = full_forward(ours, ids[0].tolist()).logits  # [1, 12, V]
    assert (out[:, :8] - ref[:, :8]).abs().max().item() < TOL
    assert (out[:, 8:] - ref[:, 8:]).abs().amax(-1).min().item() > 100 * TOL
    engine = TargetEngine(ours, ())
    engine.open_session("fits", [1, 2, 3], max_new_tokens=2, max_tree_rows=2)  # 3 + 2 + 2 + 1 = 8 slots
    with pytest.raises(ValueError, match=r"^max_new_tokens: .*context \(8, the checkpoint's sliding window\)"):
        engine.open_session("long", [1, 2, 3], max_new_tokens=5, max_tree_rows=0)
    with pytest.raises(ValueError, match=r"^tree_budget: .*2 rows exceed the context \(8, the checkpoint's sliding"):
        engine.open_session("long", [1, 2, 3], max_new_tokens=3, max_tree_rows=2)  # the answer fits, the tree not
    with pytest.raises(ValueError, match=r"^prompt: 8 tokens do not fit"):
        engine.open_session("long", list(range(8)), max_new_tokens=1, max_tree_rows=0)
    assert set(engine.sessions) == {"fits"}
    unwindowed = TargetConfig.from_hf(tiny_hf("mistral", sliding_window=None).config)
    assert unwindowed.sliding_window is None and unwindowed.max_context == 256
    assert unwindowed.digest() == TargetConfig.from_hf({**hf.config.to_dict(), "sliding_window": None}).digest()
    assert ours.cfg.digest() != unwindowed.digest()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("sliding_window", 0, "^config.sliding_window: must be a positive integer"),
        ("sliding_window", 4.5, "^config.sliding_window"),
        ("hidden_act", "gelu", "^config.hidden_act: 'gelu'"),
    ],
)
def test_config_refuses_what_the_forward_cannot_run(field, value, match):
    with pytest.raises(ValueError, match=match):
        TargetConfig.from_hf({**tiny_hf("mistral").config.to_dict(), field: value})


def test_qwen2_window_only_under_use_sliding_window():
    raw = tiny_hf("qwen2").config.to_dict()
    assert TargetConfig.from_hf({**raw, "sliding_window": 8}).sliding_window is None
    assert (
        TargetConfig.from_hf({**raw, "use_sliding_window": True, "sliding_window": 8, "layer_types": None}).max_context
        == 8
    )
    assert (
        TargetConfig.from_hf(
            {**raw, "use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"] * 2}
        ).sliding_window
        is None
    )


def test_head_rows_is_the_heads_product():
    """head_rows computes a bias-free vocabulary head over several rows as (W @ x^T)^T: equal to head(x)
    up to float rounding, in x's leading shape; one row, autograd and a hooked head (int8 calibration
    counts the head's inputs through a hook) get head(x) itself, bit for bit."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 300, bias=False)
    x = torch.randn(2, 7, 16)  # [B, T, d]
    with torch.inference_mode():
        out = head_rows(head, x)
        assert out.shape == (2, 7, 300) and out.is_contiguous()
        assert torch.allclose(out, head(x), atol=1e-5)
        assert torch.equal(head_rows(head, x[:1, :1]), head(x[:1, :1]))
        head.forward = None  # several rows outside autograd never call the module
        assert torch.equal(head_rows(head, x), out)
        del head.forward
    seen = []
    hook = head.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    with torch.inference_mode():
        head_rows(head, x)
    hook.remove()
    assert seen == [(2, 7, 16)]
    y = head_rows(head, x.requires_grad_())  # training: autograd path
    y.sum().backward()
    assert head.weight.grad is not None and x.grad is not None


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
