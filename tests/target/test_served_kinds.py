"""The targets people serve, against HF transformers on tiny random checkpoints built with
transformers' own config classes: Llama-3.x rope scaling (``llama3``) and ``linear``, ``dynamic``
and ``yarn``; Qwen3 dense (per-head q/k RMSNorm, ``head_dim`` set apart from hidden / heads);
Qwen3-MoE. Logits and greedy continuations equal HF's; feature taps and both drafter kinds keep
greedy speculative output equal to target-only on each."""

from __future__ import annotations

import pytest
import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.drafting.model import DrafterConfig, init_drafter
from eyas.generate import generate
from eyas.target.config import TargetConfig, eagle1_feature_address, eagle3_feature_address
from eyas.target.engine import TargetEngine
from tests.testing import hf_greedy, ours_from_hf, tiny_hf

TOL = 1e-4
SCALED = {  # rope_parameters (rope_theta aside) as the checkpoints write them
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 96},
}
KINDS = {
    **{f"llama-{k}": (lambda v=v: tiny_hf("llama_scaled", rope=v)) for k, v in SCALED.items()},
    "qwen3": lambda: tiny_hf("qwen3"),
    "qwen3-tied": lambda: tiny_hf("qwen3", tie=True, seed=2),
    "qwen3_moe": lambda: tiny_hf("qwen3_moe"),
    # decoder_sparse_step 2 over 4 layers: dense, sparse, dense, sparse; top-k weights not renormalised
    "qwen3_moe-step": lambda: tiny_hf(
        "qwen3_moe", layers=4, mlp_only_layers=(), decoder_sparse_step=2, norm_topk_prob=False, seed=1
    ),
}


@pytest.fixture(scope="module", params=list(KINDS))
def pair(request):
    hf = KINDS[request.param]()
    return request.param, hf, ours_from_hf(hf)


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)


def logits(model, ids: torch.Tensor) -> torch.Tensor:  # ids [1, T] -> [1, T, V]
    T = ids.shape[1]
    return model(ids, torch.arange(T)[None], model.allocate_cache(1, T), 0, causal(T), ()).logits


def test_logits_equal_hf(pair):
    _, hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (logits(ours, ids) - ref).abs().max().item() < TOL


def test_greedy_continuations_equal_hf_generate(pair):
    _, hf, ours = pair
    prompt = [3, 17, 5, 42, 8, 1]
    ref = hf_greedy(hf, prompt, 24)
    assert generate(TargetEngine(ours, ()), prompt, max_new_tokens=24).token_ids == ref


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
def test_taps_and_drafters_keep_greedy_speculative_output_exact(pair, method):
    _, hf, ours = pair
    taps = eagle1_feature_address(ours.cfg) if method == "eagle1" else eagle3_feature_address(ours.cfg)
    drafter = DrafterEngine(init_drafter(DrafterConfig.for_target(method, ours.cfg), seed=0), ours.embed, ours.lm_head)
    prompt = [3, 17, 5, 42, 8, 1]
    base = generate(TargetEngine(ours, ()), prompt, max_new_tokens=24)
    for tree in (TreeSpec(), TreeSpec(kind="chain", max_depth=3)):
        spec = generate(TargetEngine(ours, taps), prompt, max_new_tokens=24, drafter=drafter, tree=tree)
        assert spec.token_ids == base.token_ids, tree
    with torch.no_grad():  # the taps are HF's hidden states (EAGLE-3 taps: entering layers 2, L//2, L-3)
        hidden = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    out = ours(
        torch.tensor([prompt]),
        torch.arange(len(prompt))[None],
        ours.allocate_cache(1, len(prompt)),
        0,
        causal(len(prompt)),
        taps,
    )
    d = ours.cfg.hidden_size
    for i, tap in enumerate(taps):
        ref = hidden[tap.layers_applied]  # HF's last hidden state is already through the final norm
        if tap.normed and tap.layers_applied < ours.cfg.num_layers:
            continue
        assert (out.features[..., i * d : (i + 1) * d] - ref).abs().max().item() < TOL, tap


@pytest.mark.parametrize("kind", ["llama3", "linear", "yarn"])
def test_the_scaling_is_applied(kind):
    """The same weights under plain RoPE give other logits: the test above can fail."""
    hf = tiny_hf("llama_scaled", rope=SCALED[kind])
    raw = hf.config.to_dict()
    plain = TargetConfig.from_hf({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    scaled = ours_from_hf(hf)
    from eyas.target.model import TargetModel

    unscaled = TargetModel(plain)
    unscaled.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 64, (1, 60), generator=torch.Generator().manual_seed(1))
    assert (logits(unscaled, ids) - logits(scaled, ids)).abs().max().item() > 100 * TOL
    assert scaled.cfg.rope_type == kind and scaled.cfg.digest() != plain.digest()


def test_dynamic_ntk_is_served_within_its_original_context():
    """Past the original context dynamic NTK rescales by each forward's longest position, which a tree
    verify and a one-row decode would not share; inside it, it is plain RoPE. So the context stops there."""
    cfg = ours_from_hf(tiny_hf("llama_scaled", rope=SCALED["dynamic"])).cfg
    assert (cfg.max_position_embeddings, cfg.max_context) == (256, 96)
    engine = TargetEngine(ours_from_hf(tiny_hf("llama_scaled", rope=SCALED["dynamic"])), ())
    with pytest.raises(ValueError, match=r"^max_new_tokens: "):
        engine.open_session("long", list(range(1, 60)), max_new_tokens=60, max_tree_rows=0)


def test_qwen3_norms_each_head_and_keeps_its_own_head_dim():
    hf = tiny_hf("qwen3")
    ours = ours_from_hf(hf)
    assert (ours.cfg.head_dim, ours.cfg.hidden_size // ours.cfg.num_heads) == (16, 8)
    assert ours.cfg.qk_norm and ours.cfg.qk_norm_per_head and ours.layers[0].attn.q_norm.weight.shape == (16,)
    ids = torch.randint(0, 64, (1, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    for layer in ours.layers:  # drop the per-head norms' weights: the logits move
        layer.attn.q_norm.weight.fill_(1.0)
    assert (logits(ours, ids) - ref).abs().max().item() > 100 * TOL


@pytest.mark.parametrize(
    "rope, match",
    [
        (
            {"rope_type": "longrope", "factor": 2.0},
            r"^config\.rope_parameters\.rope_type: 'longrope' is not supported yet",
        ),
        (
            {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
            r"^config\.rope_parameters\.partial_rotary",
        ),
    ],
)
def test_an_unsupported_rope_is_refused_naming_the_field(rope, match):
    raw = tiny_hf("llama_scaled", rope=SCALED["linear"]).config.to_dict()
    with pytest.raises(ValueError, match=match):
        TargetConfig.from_hf({**raw, "rope_parameters": {**rope, "rope_theta": 10000.0}})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_target_matches_hf_at_that_dtype(dtype):
    """bf16 / fp16 compute against HF transformers at the same dtype, on a tiny Llama: the logits
    agree to that dtype's precision and so does the top token of every row. The bound separates:
    HF at that dtype is 1.3 % (bf16) / 0.17 % (fp16) of the logit scale from ours at it, but 2.8 % /
    0.44 % from ours at float32, so a forward that left the dtype fails it."""
    from tests.testing import tiny_hf

    hf = tiny_hf("llama", hidden=64, heads=4, kv_heads=2, seed=3)
    ours = ours_from_hf(hf).to(dtype)
    hf = hf.to(dtype)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]])
    with torch.no_grad():
        want = hf(ids).logits.float()
    got = logits(ours, ids)
    assert got.dtype == torch.float32
    scale = want.abs().max()
    bound = {torch.bfloat16: 0.02, torch.float16: 0.003}[dtype]
    assert (got - want).abs().max() <= bound * scale, float((got - want).abs().max() / scale)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
