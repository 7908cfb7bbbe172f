"""Tiny random-weight models for tests and examples (no downloads, milliseconds per forward)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from eyas.scheduler.latency import LatencyCurve
from eyas.serve.round_loop import RoundLoop, WorkerCalls

# Each kind's HF classes, defaults beyond the shared ones, its own config fields (from the builder's
# arguments), the parameters N(0, init_std) fills beyond HF's init ("experts", "gate": fused experts and
# routers that HF leaves at zero or untouched), whether biases are spread (HF starts them at zero, which
# would hide a bias never loaded), and whether its RoPE theta is set as an attribute or in rope_parameters.
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_KINDS = {
    # plain Llama (SmolLM2's architecture)
    "llama": dict(classes=("LlamaConfig", "LlamaForCausalLM"), fields=lambda a: {}),
    # Llama with a scaled RoPE: ``rope`` is its rope_parameters without rope_theta (e.g. Llama-3.1's
    # {"rope_type": "llama3", "factor": 8.0, ...})
    "llama_scaled": dict(
        classes=("LlamaConfig", "LlamaForCausalLM"),
        defaults={"rope": None},
        fields=lambda a: {"rope_parameters": {**a["rope"], "rope_theta": 10000.0}},
        rope_attr=False,
    ),
    # an attention window of ``sliding_window`` tokens
    "mistral": dict(
        classes=("MistralConfig", "MistralForCausalLM"),
        defaults={"sliding_window": 8},
        fields=lambda a: {"sliding_window": a["sliding_window"]},
    ),
    # mixture of experts, the Mixtral kind
    "mixtral": dict(
        classes=("MixtralConfig", "MixtralForCausalLM"),
        fields=lambda a: {
            "num_local_experts": a["experts"],
            "num_experts_per_tok": a["top_k"],
            "sliding_window": None,
        },
        normal=("experts",),
    ),
    # the OLMoE kind: q/k norms, top-k weights not renormalised
    "olmoe": dict(
        classes=("OlmoeConfig", "OlmoeForCausalLM"),
        defaults={"clip_qkv": None},
        fields=lambda a: {
            "num_experts": a["experts"],
            "num_experts_per_tok": a["top_k"],
            "norm_topk_prob": False,
            "clip_qkv": a["clip_qkv"],
        },
        normal=("experts", "gate"),
        rope_attr=False,
    ),
    # dense Qwen2: q/k/v projections carry biases, o_proj none
    "qwen2": dict(
        classes=("Qwen2Config", "Qwen2ForCausalLM"),
        fields=lambda a: {"use_sliding_window": False, "rope_parameters": _ROPE},
        bias=True,
        rope_attr=False,
    ),
    # the Qwen2-MoE kind: q/k/v biases, routed experts of width hidden // 2, a sigmoid-gated shared expert of
    # width 3 * hidden // 2, dense MLPs of width 2 * hidden in mlp_only_layers and in layers off decoder_sparse_step
    "qwen2_moe": dict(
        classes=("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        defaults={"layers": 3, "norm_topk_prob": False, "mlp_only_layers": (1,), "decoder_sparse_step": 1},
        fields=lambda a: {
            **_moe_fields(a),
            "shared_expert_intermediate_size": 3 * a["hidden"] // 2,
            "use_sliding_window": False,
            "rope_parameters": _ROPE,
        },
        normal=("experts", "gate"),
        bias=True,
        rope_attr=False,
    ),
    # dense Qwen3: per-head q/k RMSNorms, head_dim apart from hidden / heads (16 against 32 / 4 = 8)
    "qwen3": dict(
        classes=("Qwen3Config", "Qwen3ForCausalLM"),
        defaults={"head_dim": 16},
        fields=lambda a: {
            "head_dim": a["head_dim"],
            "use_sliding_window": False,
            "rope_parameters": _ROPE,
        },
        rope_attr=False,
    ),
    # the Qwen3-MoE kind: per-head q/k norms, no q/k/v biases, routed experts of width hidden // 2 and no shared
    # expert, dense MLPs in mlp_only_layers and in layers off decoder_sparse_step
    "qwen3_moe": dict(
        classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        defaults={
            "layers": 3,
            "head_dim": 16,
            "norm_topk_prob": True,
            "mlp_only_layers": (1,),
            "decoder_sparse_step": 1,
        },
        fields=lambda a: {
            **_moe_fields(a),
            "head_dim": a["head_dim"],
            "use_sliding_window": False,
            "rope_parameters": _ROPE,
        },
        normal=("experts", "gate"),
        rope_attr=False,
    ),
}


def _moe_fields(a: dict) -> dict:
    return {
        "moe_intermediate_size": a["hidden"] // 2,
        "num_experts": a["experts"],
        "num_experts_per_tok": a["top_k"],
        "norm_topk_prob": a["norm_topk_prob"],
        "mlp_only_layers": list(a["mlp_only_layers"]),
        "decoder_sparse_step": a["decoder_sparse_step"],
    }


def tiny_hf(kind: str = "llama", **overrides):
    """A random-weight HF causal LM of ``kind`` (a key of ``_KINDS``), built as transformers builds it
    and with its weights spread so that its distributions are peaked (``init_std``) and norms, biases
    and experts are not trivial. ``overrides``: ``vocab`` (64), ``hidden`` (32; the MLP 2x), ``layers``
    (2; 3 for the MoE kinds), ``heads`` (4), ``kv_heads`` (2), ``seed`` (0), ``init_std`` (0.2), ``tie``
    (False), ``max_positions`` (256), ``experts`` (8) and ``top_k`` (2) for the MoE kinds, and each
    kind's own (its ``defaults``)."""
    import transformers

    spec = _KINDS[kind]
    args = {
        "vocab": 64,
        "hidden": 32,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "seed": 0,
        "init_std": 0.2,
        "tie": False,
        "max_positions": 256,
        "experts": 8,
        "top_k": 2,
        **spec.get("defaults", {}),
    }
    unknown = sorted(set(overrides) - set(args))
    if unknown:
        raise TypeError(f"tiny_hf({kind!r}): unknown argument {unknown[0]!r}")
    args.update(overrides)
    config_cls, model_cls = (getattr(transformers, name) for name in spec["classes"])
    torch.manual_seed(args["seed"])
    cfg = config_cls(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=2 * args["hidden"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"],
        max_position_embeddings=args["max_positions"],
        rms_norm_eps=1e-5,
        initializer_range=args["init_std"],
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=args["tie"],
        **spec["fields"](args),
    )
    if spec.get("rope_attr", True):
        cfg.rope_theta = 10000.0
    model = model_cls(cfg).eval()
    bias_std = 2 * args["init_std"] if spec.get("bias") else None
    return _spread(model, args["init_std"], normal_names=spec.get("normal", ()), bias_std=bias_std)


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


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    """HF ``generate``'s greedy continuation of ``prompt``: exactly ``new_tokens`` new ids (no stop)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
    return out[0, len(prompt) :].tolist()


def ours_from_hf(hf):
    from eyas.target.config import TargetConfig
    from eyas.target.model import TargetModel

    cfg = TargetConfig.from_hf(hf.config)
    model = TargetModel(cfg)
    model.load_hf_state_dict(hf.state_dict())
    return model.eval()


def tiny_eagle1_engine(target, layout: str = "eyas-v1"):
    """An untrained EAGLE-1 DrafterEngine over ``target`` (``init_drafter``'s fixed seed), with its taps.

    The serving tests need a drafter some of whose proposals the tiny targets accept, and partly
    rejected ones too; this seed of the ``eyas-v1`` network does both on them (the tests that need
    an acceptance assert that it happened). An untrained ``reference`` network proposes nothing the
    target accepts there."""
    from eyas.drafting.engine import DrafterEngine
    from eyas.drafting.model import DrafterConfig, init_drafter
    from eyas.target.config import eagle1_feature_address

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


def local_loop(target, drafter, info, policy, curve=FLAT, learn_curve: bool = False, **kwargs) -> RoundLoop:
    """A RoundLoop over a target worker and a drafter worker (or a stand-in around one) in this process,
    both called directly (``WorkerCalls(..., local=True)``). ``curve`` is the test's premise (e.g. rows
    nearly free, as on a GPU): it is kept as it is unless ``learn_curve``, since live rounds would scale it
    to this CPU's speed (``LatencyCurve.observe``), where a tiny drafter costs as much as its target."""
    loop = RoundLoop(
        WorkerCalls(target, 30, local=True),
        WorkerCalls(drafter, 30, local=True, drafter=True),
        info,
        policy,
        curve.copy(),
        **kwargs,
    )
    if not learn_curve:
        loop.curve.observe = lambda rows, ms, weight=0: None
    return loop
