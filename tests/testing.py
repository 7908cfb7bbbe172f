"""Tiny random-weight models for tests and examples (no downloads, milliseconds per forward)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from eyas.scheduler.latency import LatencyCurve
from eyas.serve.round_loop import RoundLoop, WorkerCalls


def tiny_hf_llama(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    tie: bool = False,
):
    """A random-weight HF LlamaForCausalLM; ``init_std`` large enough for peaked distributions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg.rope_theta = 10000.0
    model = LlamaForCausalLM(cfg).eval()
    return _spread(model, init_std)


def _spread(model, init_std: float, normal_names: tuple[str, ...] = (), bias_std: float | None = None):
    """Make a fresh HF model's weights non-trivial, in ``named_parameters`` order (so a seed gives the
    same weights as ever): norm weights uniform in [0.5, 1.5]; with ``bias_std``, biases N(0, bias_std);
    parameters whose name contains one of ``normal_names``, N(0, init_std)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif bias_std is not None and name.endswith(".bias"):
                p.normal_(0, bias_std)
            elif any(key in name for key in normal_names):
                p.normal_(0, init_std)
    return model


def ours_from_hf(hf):
    from eyas.target.model import TargetConfig, TargetModel

    cfg = TargetConfig.from_hf(hf.config)
    model = TargetModel(cfg)
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


def tiny_hf_mixtral(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
):
    """A random-weight HF MixtralForCausalLM (a mixture-of-experts target of the Mixtral kind)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        rms_norm_eps=1e-5,
        initializer_range=init_std,
        tie_word_embeddings=False,
        sliding_window=None,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg.rope_theta = 10000.0
    model = MixtralForCausalLM(cfg).eval()
    # fused expert tensors are not touched by init_std in every version
    return _spread(model, init_std, normal_names=("experts",))


def tiny_hf_olmoe(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    clip_qkv: float | None = None,
):
    """A random-weight HF OlmoeForCausalLM (the OLMoE kind: q/k norms, top-k weights not renormalised)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(seed)
    cfg = OlmoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=False,
        clip_qkv=clip_qkv,
        rms_norm_eps=1e-5,
        initializer_range=init_std,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = OlmoeForCausalLM(cfg).eval()
    # fused experts and the router start at zero/untouched
    return _spread(model, init_std, normal_names=("experts", "gate"))


def tiny_hf_mistral(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    sliding_window: int | None = 8,
):
    """A random-weight HF MistralForCausalLM whose attention window is ``sliding_window`` tokens."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=init_std,
        sliding_window=sliding_window,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    cfg.rope_theta = 10000.0
    model = MistralForCausalLM(cfg).eval()
    return _spread(model, init_std)


def tiny_hf_qwen2(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    tie: bool = False,
):
    """A random-weight HF Qwen2ForCausalLM (dense; q/k/v projections carry biases, o_proj none)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    # HF starts biases at zero, which would hide a bias never loaded
    return _spread(model, init_std, bias_std=2 * init_std)


def tiny_hf_qwen2_moe(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    norm_topk_prob: bool = False,
    mlp_only_layers: tuple[int, ...] = (1,),
    decoder_sparse_step: int = 1,
):
    """A random-weight HF Qwen2MoeForCausalLM (the Qwen2-MoE kind: q/k/v biases, routed experts of width
    ``hidden // 2``, a sigmoid-gated shared expert of width ``3 * hidden // 2``, dense MLPs of width
    ``2 * hidden`` in ``mlp_only_layers`` and in layers off ``decoder_sparse_step``)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=3 * hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        rms_norm_eps=1e-5,
        initializer_range=init_std,
        tie_word_embeddings=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen2MoeForCausalLM(cfg).eval()
    # biases start at zero; fused experts, router and shared-expert gate at zero or untouched by init_std
    return _spread(model, init_std, normal_names=("experts", "gate"), bias_std=2 * init_std)


def tiny_hf_llama_scaled(
    rope: dict,
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    max_positions: int = 256,
):
    """A random-weight HF LlamaForCausalLM with a scaled RoPE: ``rope`` is its ``rope_parameters``
    without ``rope_theta`` (for example Llama-3.1's ``{"rope_type": "llama3", "factor": 8.0, ...}``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        initializer_range=init_std,
        rope_parameters={**rope, "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _spread(LlamaForCausalLM(cfg).eval(), init_std)


def tiny_hf_qwen3(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    seed: int = 0,
    init_std: float = 0.2,
    tie: bool = False,
):
    """A random-weight HF Qwen3ForCausalLM (dense): per-head q/k RMSNorms, and ``head_dim`` set apart
    from hidden / heads (16 here against 32 / 4 = 8)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        initializer_range=init_std,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _spread(Qwen3ForCausalLM(cfg).eval(), init_std)


def tiny_hf_qwen3_moe(
    vocab: int = 64,
    hidden: int = 32,
    layers: int = 3,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 8,
    top_k: int = 2,
    seed: int = 0,
    init_std: float = 0.2,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (1,),
    decoder_sparse_step: int = 1,
):
    """A random-weight HF Qwen3MoeForCausalLM (the Qwen3-MoE kind: per-head q/k norms, no q/k/v
    biases, routed experts of width ``hidden // 2`` with no shared expert, dense MLPs of width
    ``2 * hidden`` in ``mlp_only_layers`` and in layers off ``decoder_sparse_step``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=256,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        rms_norm_eps=1e-5,
        initializer_range=init_std,
        tie_word_embeddings=False,
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return _spread(Qwen3MoeForCausalLM(cfg).eval(), init_std, normal_names=("experts", "gate"))


def tiny_eagle1_engine(target, layout: str = "eyas-v1"):
    """An untrained EAGLE-1 DrafterEngine over ``target`` (``init_drafter``'s fixed seed), with its taps.

    The serving tests need a drafter some of whose proposals the tiny targets accept, and partly
    rejected ones too; this seed of the ``eyas-v1`` network does both on them (the tests that need
    an acceptance assert that it happened). An untrained ``reference`` network proposes nothing the
    target accepts there."""
    from eyas.drafting.engine import DrafterEngine
    from eyas.drafting.model import DrafterConfig, init_drafter
    from eyas.target.model import eagle1_feature_address

    cfg = target.cfg
    return DrafterEngine(
        init_drafter(DrafterConfig.for_target("eagle1", cfg, layout=layout)),
        target.embed,
        target.lm_head,
        taps=eagle1_feature_address(cfg),
    )


def branch_tokens(flat, row: int) -> list[int]:
    """The tokens of a flattened tree's path from the root row to ``row`` (both included)."""
    path = []
    while row >= 0:
        path.append(int(flat.tokens[row]))
        row = int(flat.parents[row])
    return path[::-1]


class EveryThirdRoundPolicy:
    """A scheduling policy for tests: every third round all requests draft (width 2, depth 3, budget 6);
    the other rounds are plain."""

    name = "every-third"

    def __init__(self):
        self.rounds = 0

    def plan(self, waiting, curve, draft=None, experts=None, prefill_rows=0):
        from eyas.scheduler.cost import PLAIN, TreeShape
        from eyas.scheduler.policy import Plan

        self.rounds += 1
        shape = TreeShape(2, 3, 6) if self.rounds % 3 == 0 else PLAIN
        return Plan({c.request_id: shape for c in waiting}, (), 1.0, 1.0)


class NoDeviceMix(TorchFunctionMode):
    """Raise on any torch op whose tensor operands (of one dim or more) span more than one device."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0}
        if len(devices) > 1:
            raise AssertionError(f"{getattr(func, '__name__', func)}: operands on {sorted(devices)}")
        self.ops += 1
        return func(*args, **kwargs)


def assert_verify_rows_equal_decodes(model, prompt: list[int], chain: list[int]) -> None:
    """After ``prompt``, ``chain`` verified in one forward (a causal mask over the chain) gives, row
    by row, bit for bit the logits of decoding the same tokens one at a time."""
    P, M = len(prompt), len(chain)

    def prefilled():
        cache = model.allocate_cache(1, P + M)
        model(
            torch.tensor([prompt]), torch.arange(P)[None], cache, 0, torch.ones(P, P, dtype=torch.bool).tril()[None], ()
        )
        return cache

    with torch.inference_mode():
        mask = torch.ones(M, P + M, dtype=torch.bool)  # [M, P+M]
        mask[:, P:] = torch.ones(M, M, dtype=torch.bool).tril()
        verified = model(
            torch.tensor([chain]), torch.arange(P, P + M)[None], prefilled(), P, mask[None], (), logits_rows="all"
        ).logits[0]
        cache = prefilled()
        for i, t in enumerate(chain):
            one = model(torch.tensor([[t]]), torch.tensor([[P + i]]), cache, P + i, None, (), logits_rows="all")
            assert torch.equal(verified[i], one.logits[0, 0]), f"row {i}"


# a latency curve for the round loop tests (ms a forward by rows): flat, so that budgets decide
FLAT = LatencyCurve.from_points({1: 50.0, 16: 55.0, 64: 70.0, 256: 200.0})


def local_loop(target, drafter, info, policy, curve=FLAT, **kwargs) -> RoundLoop:
    """A RoundLoop over a target worker and a drafter worker (or a stand-in around one) in this process,
    both called directly (``WorkerCalls(..., local=True)``)."""
    return RoundLoop(
        WorkerCalls(target, 30, local=True),
        WorkerCalls(drafter, 30, local=True, drafter=True),
        info,
        policy,
        curve.copy(),
        **kwargs,
    )
