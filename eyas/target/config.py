"""The target's architecture as Eyas serves it (``TargetConfig``: one Llama-family decoder, dense or
MoE, read from a transformers config) and its feature taps: the residual stream after
``layers_applied`` decoder layers, optionally passed through the final RMSNorm (design 0x08B).
EAGLE-1 taps the LM-head input ``(L, normed)``; EAGLE-3 taps ``(2, L//2, L-3)`` un-normed, as the
pinned EAGLE reference does."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class TargetConfig:
    """A Llama-family decoder configuration (the part the forward needs)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    num_experts: int = 0  # mixture of experts (Mixtral, OLMoE kinds): experts per layer; 0 = dense MLP
    experts_per_token: int = 0  # router top-k
    norm_topk_prob: bool = True  # renormalise the top-k router weights (Mixtral yes, OLMoE no)
    qk_norm: bool = False  # RMSNorm over the whole q and k projections before RoPE (OLMoE)
    clip_qkv: float | None = None  # clamp q, k, v to +-clip_qkv (OLMoE option)
    qkv_bias: bool = False  # the q/k/v projections carry biases (Qwen2, Qwen2-MoE); o_proj never does
    moe_intermediate_size: int | None = None  # routed experts' width when set (Qwen2-MoE); else intermediate_size
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (a gated dense MLP in every MoE layer); 0 = none
    dense_layers: tuple[int, ...] = ()  # in an MoE config, layers with a dense MLP of intermediate_size (Qwen2-MoE)
    sliding_window: int | None = None  # attention window of the checkpoint (Mistral, Mixtral, Qwen2); None = full
    # a scaled RoPE (Llama-3.x "llama3", "linear", "dynamic", "yarn"): its parameters as sorted
    # (key, value) pairs, rope_type included, rope_theta not; () = plain RoPE
    rope_scaling: tuple[tuple[str, object], ...] = ()
    qk_norm_per_head: bool = False  # the q/k RMSNorms act on each head's head_dim (Qwen3), not all heads (OLMoE)

    @classmethod
    def from_hf(cls, hf_config) -> TargetConfig:
        """Read a transformers config (or a dict of one) of a supported kind: Llama (Llama-3.x rope
        scaling included), Mistral, Qwen2 and Qwen3 (dense), Mixtral, OLMoE, Qwen2-MoE, Qwen3-MoE."""
        cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe"):
            raise ValueError(
                f"config.model_type: {model_type!r} is not a Llama-family decoder"
                + (" (MoE: the Mixtral, OLMoE, Qwen2-MoE and Qwen3-MoE kinds only yet)" if "moe" in model_type else "")
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.hidden_act: {act!r} is not supported (the SwiGLU MLP uses silu)")
        experts = {
            "mixtral": cfg.get("num_local_experts", 0),
            "olmoe": cfg.get("num_experts") or cfg.get("num_local_experts", 0),
            "qwen2_moe": cfg.get("num_experts") or cfg.get("num_local_experts", 0),
            "qwen3_moe": cfg.get("num_experts") or cfg.get("num_local_experts", 0),
        }.get(model_type, 0)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_scaling = _rope_scaling(rope)
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ValueError("config.attention_bias/mlp_bias: biased projections are not supported yet")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        qwen_moe = model_type in ("qwen2_moe", "qwen3_moe") and bool(experts)
        qwen3 = model_type in ("qwen3", "qwen3_moe")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            num_experts=int(experts),
            experts_per_token=int(cfg.get("num_experts_per_tok", 0)) if experts else 0,
            norm_topk_prob={
                "olmoe": bool(cfg.get("norm_topk_prob", True)),
                "qwen2_moe": bool(cfg.get("norm_topk_prob", False)),
                "qwen3_moe": bool(cfg.get("norm_topk_prob", False)),
            }.get(model_type, True),
            qk_norm=model_type == "olmoe" or qwen3,
            qk_norm_per_head=qwen3,
            clip_qkv=float(cfg["clip_qkv"]) if model_type == "olmoe" and cfg.get("clip_qkv") is not None else None,
            # Qwen2's attention always has q/k/v biases; Qwen2-MoE's config has a switch (default on)
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True))),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]) if qwen_moe else None,
            shared_expert_intermediate_size=(
                int(cfg.get("shared_expert_intermediate_size") or 0) if qwen_moe and model_type == "qwen2_moe" else 0
            ),
            dense_layers=_qwen2_moe_dense_layers(cfg) if qwen_moe else (),
            sliding_window=_sliding_window(cfg, model_type),
            rope_scaling=rope_scaling,
        )

    def digest(self) -> str:
        """sha256 of the canonical JSON of this config (the fingerprint's config part).

        A field added after a kind shipped is left out while it holds its default, so every config
        that existed before hashes exactly as it did (shipped drafters record this digest)."""
        fields = asdict(self)
        if not self.num_experts:  # a dense config hashes as it did before MoE support existed
            fields.pop("num_experts"), fields.pop("experts_per_token")
        for name, default in (
            ("norm_topk_prob", True),
            ("qk_norm", False),
            ("clip_qkv", None),  # pre-OLMoE
            ("qkv_bias", False),
            ("moe_intermediate_size", None),  # pre-Qwen2
            ("shared_expert_intermediate_size", 0),
            ("dense_layers", ()),
            ("sliding_window", None),
            ("rope_scaling", ()),
            ("qk_norm_per_head", False),
        ):
            if fields[name] == default:
                fields.pop(name)
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @property
    def max_context(self) -> int:
        """Tokens a session may hold: ``max_position_embeddings``, capped at ``sliding_window``.

        Eyas's attention is full causal. A sliding-window checkpoint lets query i see key j only while
        ``i - j < sliding_window``; over a context of at most ``sliding_window`` tokens every such pair
        holds, so the two forwards are the same computation. Capping the context there keeps every
        output exact instead of silently diverging past the window (a windowed KV cache: not yet)."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        scaling = dict(self.rope_scaling)
        if scaling.get("rope_type") == "dynamic":
            # dynamic NTK rescales RoPE by each forward's longest position once it passes the original
            # context, so a tree verify and a one-row decode would rotate the same token differently;
            # inside the original context it is plain RoPE (HF's too), so the context stops there
            limit = min(limit, int(scaling.get("original_max_position_embeddings") or self.max_position_embeddings))
        return limit

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @property
    def expert_intermediate_size(self) -> int:
        """Hidden width of one routed expert: ``moe_intermediate_size`` (Qwen2-MoE) or ``intermediate_size``."""
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a routed mixture-of-experts MLP (else a dense one)."""
        return bool(self.num_experts) and layer not in self.dense_layers

    @property
    def expert_bytes_per_expert(self) -> int:
        """fp32 bytes of one routed expert's weights (gate, up, down); a shared expert is read by every
        row, like the dense weights, and is not counted."""
        return 3 * self.hidden_size * self.expert_intermediate_size * 4 if self.num_experts else 0


def _sliding_window(cfg: dict, model_type: str) -> int | None:
    """The checkpoint's attention window, or None when every layer attends to the full context.

    Mistral and Mixtral window every layer when ``sliding_window`` is set; Qwen2 and Qwen2-MoE only
    under ``use_sliding_window`` (some of their layers, by ``max_window_layers``; capping the context
    at the window is exact for all of them alike). transformers 5 also lists ``layer_types``; a list
    without ``"sliding_attention"`` means no window."""
    if model_type not in ("mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"):
        return None
    if model_type.startswith("qwen") and not cfg.get("use_sliding_window"):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config.sliding_window: must be a positive integer or null, got {window!r}")
    return window


def _qwen2_moe_dense_layers(cfg: dict) -> tuple[int, ...]:
    """Qwen2-MoE layers with a dense MLP, by transformers' rule: layer i is sparse iff i is not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``. Worked example: 4 layers,
    step 2, mlp_only_layers [3] -> sparse 1 only -> dense (0, 2, 3)."""
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step", 1))
    return tuple(i for i in range(cfg["num_hidden_layers"]) if i in only or (i + 1) % step != 0)


@dataclass(frozen=True)
class FeatureTap:
    """The residual stream after ``layers_applied`` decoder layers; ``normed`` applies the final norm."""

    layers_applied: int
    normed: bool


def eagle1_feature_address(cfg: TargetConfig) -> tuple[FeatureTap, ...]:
    """The LM-head input: after every layer and the final norm (design 0x02, pinned EAGLE-1)."""
    return (FeatureTap(cfg.num_layers, True),)


def eagle3_feature_address(cfg: TargetConfig, normed: bool = True) -> tuple[FeatureTap, ...]:
    """Low/mid/high residual streams after layers 2, L//2, L-3 (design 0x08B, pinned EAGLE-3).

    Eyas serves them through the target's final RMSNorm (``normed=True``), unlike the pinned
    reference: SmolLM2's mid/high residual streams carry massive activations (RMS about 55, single
    channels near 25,000), which the final norm's weights scale back to the range of the LM-head
    input. The choice is part of the feature address and recorded in the manifest.
    """
    n = cfg.num_layers
    return tuple(FeatureTap(k, normed) for k in (min(2, n), n // 2, max(n - 3, 0)))


SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")


def _rope_scaling(rope: dict) -> tuple[tuple[str, object], ...]:
    """A config's RoPE parameters as ``TargetConfig.rope_scaling`` (() for plain RoPE)."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return ()
    if rope_type not in SCALED_ROPE_TYPES:
        raise ValueError(
            f"config.rope_parameters.rope_type: {rope_type!r} is not supported yet "
            f"(supported: default, {', '.join(SCALED_ROPE_TYPES)})"
        )
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.rope_parameters.partial_rotary_factor: a partial rotary is not supported yet")
    params = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    params["rope_type"] = rope_type
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items()))
