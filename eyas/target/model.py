"""The frozen target's compact forward, gpt-fast style.

Terms (design 0x01A, 0x05C):
- *row*: one token fed to a forward, with an explicit position id. A verify forward feeds the
  flattened tree: row 0 is the frontier token, rows 1.. are draft candidates.
- *slot*: an index into the preallocated KV cache. A forward writes its rows into slots
  ``[start, start + T)`` and attends over ``[0, start + T)`` through an explicit boolean mask,
  so one call can verify a whole tree whose rows share positions.
- *feature tap*: the residual stream after ``layers_applied`` decoder layers, optionally passed
  through the final RMSNorm (design 0x08B). EAGLE-1 taps the LM-head input ``(L, normed)``;
  EAGLE-3 taps ``(2, L//2, L-3)`` un-normed, as the pinned EAGLE reference does.

This module owns no state between calls: the KV cache is passed in and is owned by the engine
(``eyas.target.engine``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.target.batch_kv import BatchKV, BatchRows, Grid


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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


def rope_frequencies(
    head_dim: int, theta: float, max_positions: int, scaling: tuple[tuple[str, object], ...] = ()
) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim / 2], attention scaling of cos/sin). A scaled RoPE's frequencies come
    from transformers' own ``ROPE_INIT_FUNCTIONS`` (the reference they must equal), fed a config
    holding just the fields those functions read."""
    if not scaling:
        return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}
    cfg = LlamaConfig(
        hidden_size=head_dim,
        num_attention_heads=1,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        rope_parameters={**params, "rope_theta": theta},
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryTable(nn.Module):
    """cos/sin tables indexed by explicit position ids (HF's non-interleaved rotate-half layout).

    ``scaling``: a scaled RoPE's parameters (``TargetConfig.rope_scaling``); its frequencies and the
    attention scaling folded into cos/sin are transformers' (``rope_frequencies``)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: tuple[tuple[str, object], ...] = ()):
        super().__init__()
        inv_freq, attention_scaling = rope_frequencies(head_dim, theta, max_positions, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [B, T]
        """cos/sin of ``positions``; ``max_position``: their largest, when the caller knows it on the
        host (no device read)."""
        top = int(positions.max()) if max_position is None else max_position
        if top >= self.cos.shape[0]:
            raise ValueError(f"positions: {top} exceeds the rotary table ({self.cos.shape[0]})")
        return self.cos[positions], self.sin[positions]  # [B, T, hd] each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, hd]; cos/sin: [B, T, hd]."""
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@dataclass
class KVCache:
    """Preallocated per-sequence K/V for every layer. Owned by one engine; slots are explicit."""

    k: torch.Tensor  # [L, B, H_kv, S_max, hd]
    v: torch.Tensor  # [L, B, H_kv, S_max, hd]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch: int,
        num_kv_heads: int,
        max_slots: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> KVCache:
        shape = (num_layers, batch, num_kv_heads, max_slots, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @property
    def max_slots(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_slot(self) -> int:
        L, B, H, _, hd = self.k.shape
        return 2 * L * B * H * hd * self.k.element_size()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v ([B, H_kv, T, hd]) in slots [start, start+T); return the keys/values of [0, start+T)."""
        t = k.shape[2]
        self.k[layer, :, :, start : start + t] = k
        self.v[layer, :, :, start : start + t] = v
        return self.k[layer, :, :, : start + t], self.v[layer, :, :, : start + t]

    def gather_commit(self, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy slots ``src_slots`` ([A] int64) onto ``[dst_start, dst_start + A)``.

        The gather reads every source before any write, so overlapping ranges are safe.
        """
        assert src_slots.ndim == 1 and src_slots.dtype == torch.int64
        a = src_slots.numel()
        if dst_start + a > self.max_slots:
            raise ValueError(f"kv commit: {dst_start + a} slots exceed the cache ({self.max_slots})")
        k_rows = self.k.index_select(3, src_slots)  # [L, B, H, A, hd]
        v_rows = self.v.index_select(3, src_slots)
        self.k[:, :, :, dst_start : dst_start + a] = k_rows
        self.v[:, :, :, dst_start : dst_start + a] = v_rows


class GrowingKV:
    """An autograd-friendly cache for training: each write appends, nothing is modified in place.

    Writes must be contiguous (``start`` equal to the rows written so far), as in a training-time
    rollout where step s writes rows [s*S, (s+1)*S).
    """

    def __init__(self, num_layers: int):
        self.k: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.v: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        have = sum(x.shape[2] for x in self.k[layer])
        if start != have:
            raise ValueError(f"start: GrowingKV appends only ({start} != {have} rows written)")
        self.k[layer].append(k)
        self.v[layer].append(v)
        return torch.cat(self.k[layer], 2), torch.cat(self.v[layer], 2)

    @property
    def max_slots(self) -> int:
        return 1 << 30


class Attention(nn.Module):
    def __init__(
        self,
        d: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        qk_norm: bool = False,
        eps: float = 1e-6,
        clip_qkv: float | None = None,
        qkv_bias: bool = False,
        d_in: int | None = None,
        qk_norm_per_head: bool = False,
    ):
        """``d_in``: the width the q/k/v projections read, when it is not ``d`` (the EAGLE-3 draft
        layer reads ``[embedding; state]``, 2d wide, and writes d). ``qk_norm``: RMSNorms on q and k
        before RoPE, over all heads at once (OLMoE) or, with ``qk_norm_per_head``, over each head's
        ``head_dim`` (Qwen3)."""
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.wqkv = nn.Linear(d_in or d, (heads + 2 * kv_heads) * head_dim, bias=qkv_bias)  # q, k, v rows fused
        self.wo = nn.Linear(heads * head_dim, d, bias=False)
        self.qk_norm_per_head = qk_norm_per_head
        self.q_norm = RMSNorm(head_dim if qk_norm_per_head else heads * head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim if qk_norm_per_head else kv_heads * head_dim, eps) if qk_norm else None
        self.clip_qkv = clip_qkv
        self.row_stable = False  # int8, half precision: attend row by row over each row's visible keys (see _attend)
        self.kernels = None  # fp16w with Eyas's CPU kernels (eyas.kernels): decode and tree rows attend through them

    def _attend(self, q, keys, values, mask, start: int):
        """Attention of q [B, H, T, hd] over keys/values [B, H_kv, S, hd] under mask [B, T, S] (None: all).

        With ``row_stable`` (set by :func:`quantize_int8` and :func:`make_batch_invariant`) every query row attends alone, over only
        the keys its mask shows, in slot order (the committed prefix, then its tree ancestors, then
        itself): the very call a one-row decode of that token makes. The fused kernel's result for
        a row otherwise depends on how many rows and masked keys share the call; at fp32 that is
        a last-bit difference, but an int8 target rounds the next layer's activations to a grid, so
        such a difference can move a value to the next grid step and change the token. Row by row,
        a verify row computes exactly what target-only decoding computes, and greedy speculative
        output stays token-identical at int8 (design 0x05C: the verifier must equal the target).
        A prompt prefill (``start == 0``) runs fused: it is the same call in every decoding mode."""
        if keys.dtype != q.dtype:  # a cache kept wider than the compute (regen's float32 K/V): attend in its dtype
            return self._attend(q.to(keys.dtype), keys, values, mask, start).to(q.dtype)
        gqa = self.heads != self.kv_heads
        B, _, T, _ = q.shape
        if self.kernels is not None and start > 0 and T <= KERNEL_ATTEND_ROWS and q.dtype == torch.float32:
            # fp16w's row-invariant attention: a verify row over its visible slots in order, as its decode
            return self.kernels.attend(q, keys, values, mask, self.head_dim**-0.5)
        if not self.row_stable or start == 0 or (mask is None and T > 1):
            attn_mask = None if mask is None else mask.unsqueeze(1)  # [B, 1, T, S]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, enable_gqa=gqa)
        out = torch.empty_like(q)
        for b in range(B):
            for t in range(T):
                if mask is None:
                    k, v = keys[b : b + 1].contiguous(), values[b : b + 1].contiguous()
                else:
                    idx = mask[b, t].nonzero().squeeze(1)  # visible slots, in order
                    k, v = keys[b : b + 1, :, idx], values[b : b + 1, :, idx]
                out[b, :, t] = F.scaled_dot_product_attention(q[b : b + 1, :, t : t + 1], k, v, enable_gqa=gqa)[0, :, 0]
        return out

    def project(self, x):
        """q [.., H*hd], k [.., H_kv*hd], v [.., H_kv*hd] of x [.., d] (with OLMoE's or Qwen3's q/k norms
        and OLMoE's clipping)."""
        hd = self.head_dim
        q, k, v = self.wqkv(x).split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        if self.q_norm is not None and self.qk_norm_per_head:  # [.., H, hd] normed per head
            q = self.q_norm(q.unflatten(-1, (self.heads, hd))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (self.kv_heads, hd))).flatten(-2)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def forward(self, x, cos, sin, cache, layer: int, start: int, mask):
        """x: [B, T, d_in]; cache: a KVCache (or GrowingKV); mask: [B, T, start+T] bool or None."""
        B, T, _ = x.shape
        hd = self.head_dim
        q, k, v = self.project(x)
        q = q.view(B, T, self.heads, hd).transpose(1, 2)
        k = k.view(B, T, self.kv_heads, hd).transpose(1, 2)
        v = v.view(B, T, self.kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys, values = cache.write(layer, start, k, v)  # [B, H_kv, start+T, hd] each
        out = self._attend(q, keys, values, mask, start)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.heads * hd))

    def forward_batch(self, x, cos, sin, kv: BatchKV, plan: BatchRows, layer: int):
        """Packed rows of every request in the round, x [1, N, d], over the engine's one K/V store.

        The projections run once over all N rows; the new K/V are written at each row's (KV row,
        slot); the decode and tree rows attend in ONE call over the store's rows, through the plan's
        padded query grid and mask, and each wide group (a prefill chunk, or the forward's only
        request) in a call of its own (``eyas.target.batch_kv``). No row sees another request's keys."""
        _, N, _ = x.shape
        hd, H, Hkv = self.head_dim, self.heads, self.kv_heads
        q, k, v = self.project(x)
        q = apply_rotary(q.view(1, N, H, hd).transpose(1, 2), cos, sin)[0].transpose(0, 1)  # [N, H, hd]
        k = apply_rotary(k.view(1, N, Hkv, hd).transpose(1, 2), cos, sin)[0].transpose(0, 1)  # [N, H_kv, hd]
        v = v.view(N, Hkv, hd)
        return self.wo(self.attend_batch(q, k, v, kv, plan, layer)[None])  # [1, N, d]

    def attend_batch(self, q, k, v, kv: BatchKV, plan: BatchRows, layer: int) -> torch.Tensor:
        """The packed rows' new K/V written into the store and their attention (see
        :meth:`forward_batch`): q [N, H, hd], k and v [N, H_kv, hd] (rotary applied) -> [N, H * hd]."""
        N, H, hd = q.shape
        out = q.new_empty(N, H * hd)
        for w in plan.wide:  # contiguous slots: its keys are a view of its own KV row
            keys, values = kv.write_span(
                layer, w.kv_row, w.start, k[w.lo : w.hi].transpose(0, 1)[None], v[w.lo : w.hi].transpose(0, 1)[None]
            )  # [1, H_kv, start+T, hd]
            o = self._attend(q[w.lo : w.hi].transpose(0, 1)[None], keys, values, w.mask, w.start)  # [1, H, T, hd]
            out[w.lo : w.hi] = o[0].transpose(0, 1).reshape(w.hi - w.lo, H * hd)
        if plan.grid is not None:
            g = plan.grid
            kv.write(layer, plan.kv_rows[g.rows], plan.slots[g.rows], k[g.rows], v[g.rows])
            keys, values = kv.view(layer, g.num_kv_rows, g.key_len)  # [B, H_kv, S, hd] views, read in place
            out[g.rows] = (
                self._attend_rows_alone(q[g.rows], keys, values, g)
                if self.row_stable
                else self._attend_grid(q[g.rows], keys, values, g)
            )
        return out  # [1, N, d]

    def _attend_grid(self, q, keys, values, g: Grid):
        """q [M, H, hd] of the grid's rows over keys/values [B, H_kv, S, hd] -> [M, H*hd]: one call.
        One query row per request (plain decoding) runs as two batched matmuls grouped by KV head
        (no K/V expanded or copied; on a CPU faster than the fused kernel at one row); more run
        through the fused kernel with the grid's mask."""
        B, W, H, Hkv, hd = g.num_kv_rows, g.width, self.heads, self.kv_heads, self.head_dim
        grid = q.new_zeros(B * W, H, hd)
        grid[g.cells] = q
        if self.kernels is not None and q.dtype == torch.float32:  # fp16w's row-invariant attention
            out = self.kernels.attend(grid.view(B, W, H, hd).transpose(1, 2), keys, values, g.mask[:, 0], hd**-0.5)
            return out.transpose(1, 2).reshape(B * W, H * hd)[g.cells]
        if W == 1:
            G = H // Hkv
            qg = grid.view(B, Hkv, G, hd)  # [B, H_kv, G, hd]
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * hd**-0.5  # [B, H_kv, G, S]
            scores = scores.masked_fill_(g.grouped_mask(G), float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, H_kv, G, hd]
            return out.reshape(B, H * hd)[g.cells]
        out = F.scaled_dot_product_attention(
            grid.view(B, W, H, hd).transpose(1, 2), keys, values, attn_mask=g.mask, enable_gqa=H != Hkv
        )  # [B, H, W, hd]
        return out.transpose(1, 2).reshape(B * W, H * hd)[g.cells]

    def _attend_rows_alone(self, q, keys, values, g: Grid):
        """int8's row-stable attention (see :meth:`_attend`) for the grid's rows: each row alone,
        over only the keys its mask shows, in slot order. q [M, H, hd] -> [M, H*hd]."""
        gqa = self.heads != self.kv_heads
        out = q.new_empty(q.shape[0], self.heads * self.head_dim)
        for m, cell in enumerate(g.cells.tolist()):
            b, t = divmod(cell, g.width)
            idx = g.mask[b, 0, t].nonzero().squeeze(1)
            o = F.scaled_dot_product_attention(
                q[m][None, :, None], keys[b : b + 1, :, idx], values[b : b + 1, :, idx], enable_gqa=gqa
            )  # [1, H, 1, hd]
            out[m] = o.reshape(-1)
        return out


def head_rows(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` for x [..., d]; a plain bias-free nn.Linear over several rows outside autograd runs as
    ``(W @ x^T)^T``.

    A vocabulary head is a tall, thin GEMM: V (49,152) output columns, d (576) inputs, few rows. As
    ``x @ W^T`` MKL's CPU kernel for 2-17 rows is barely faster than one call per row; the same product
    with W on the left (V rows, few columns) is 2.8x faster at 2 rows, 2.3x at 5, 1.3x at 17 and 1.2x
    at 272 on the project's 2-core machine (fp32, 49,152 x 576). It is the same product up to float
    rounding (last bits, as between any two kernels); one row keeps ``head(x)``, the call a one-row
    decode makes. Other modules (int8 heads, biased ones), hooked ones and training (autograd) call
    ``head(x)``."""
    if (
        type(head) is not nn.Linear
        or head.bias is not None
        or torch.is_grad_enabled()
        or x.dtype != head.weight.dtype
        or x.numel() <= x.shape[-1]
        or head._forward_pre_hooks
        or head._forward_hooks
    ):  # a hooked head (int8 calibration) is called
        return head(x)
    rows = x.reshape(-1, x.shape[-1])  # [N, d]
    return (head.weight @ rows.T).T.contiguous().reshape(*x.shape[:-1], head.weight.shape[0])  # [..., V]


class MLP(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.ffn = ffn
        self.w_gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.w_down = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        gate, up = self.w_gate_up(x).split(self.ffn, dim=-1)
        return self.w_down(F.silu(gate) * up)


class MoE(nn.Module):
    """A sparse mixture-of-experts MLP of the Mixtral, OLMoE or Qwen2-MoE kind: softmax router, top-k, the
    top-k weights renormalised (Mixtral) or not (OLMoE, Qwen2-MoE: ``norm_topk_prob: false``), SiLU-gated
    *routed* experts of width ``ffn`` (design 0x09A).

    A *shared expert* (Qwen2-MoE, ``shared_ffn > 0``) is a dense SiLU-gated MLP that every row reads; its
    output is scaled by ``sigmoid(shared_gate(x))`` (one scalar per row) and added to the routed sum.

    Each forward records the routed experts every row went to in ``last_routing`` ([N, k] int64, rows in
    input order), so the engine can count the union of experts a verify touched; the shared expert is
    read by every forward and is not part of it.
    """

    def __init__(
        self, d: int, ffn: int, num_experts: int, top_k: int, norm_topk_prob: bool = True, shared_ffn: int = 0
    ):
        super().__init__()
        self.ffn, self.num_experts, self.top_k, self.norm_topk_prob = ffn, num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(d, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * ffn, d))  # [E, 2f, d]
        self.down = nn.Parameter(torch.empty(num_experts, d, ffn))  # [E, d, f]
        self.shared = MLP(d, shared_ffn) if shared_ffn else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if shared_ffn else None
        self.last_routing: torch.Tensor | None = None
        self.linear = F.linear  # an expert's product (row_invariant_linear: batch-invariant)

    def forward(self, x):  # [..., d]
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [N, k]
        if self.norm_topk_prob:  # Mixtral renormalises the top-k weights; OLMoE keeps the router's mass
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(h.dtype)
        self.last_routing = experts
        out = torch.zeros_like(h)
        for e in experts.unique().tolist():  # increasing expert id
            slot, row = torch.where(experts.T == e)  # (k slot, row) pairs
            gate, up = self.linear(h[row], self.gate_up[e]).chunk(2, dim=-1)
            y = self.linear(F.silu(gate) * up, self.down[e]) * weights[row, slot, None]
            out.index_add_(0, row, y)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(h)) * self.shared(h)  # [N, 1] * [N, d]
        return out.reshape(shape)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        d: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        ffn: int,
        eps: float,
        num_experts: int = 0,
        top_k: int = 0,
        norm_topk_prob: bool = True,
        qk_norm: bool = False,
        clip_qkv: float | None = None,
        qkv_bias: bool = False,
        shared_ffn: int = 0,
        qk_norm_per_head: bool = False,
    ):
        """``ffn``: the dense MLP's width, or each routed expert's when ``num_experts`` > 0."""
        super().__init__()
        self.attn_norm = RMSNorm(d, eps)
        self.attn = Attention(
            d, heads, kv_heads, head_dim, qk_norm, eps, clip_qkv, qkv_bias, qk_norm_per_head=qk_norm_per_head
        )
        self.mlp_norm = RMSNorm(d, eps)
        self.mlp = MoE(d, ffn, num_experts, top_k, norm_topk_prob, shared_ffn) if num_experts else MLP(d, ffn)
        self.fused = None  # the gguf precision's fused kernels for this layer (eyas.target.quantized.FusedLayer)

    def forward(self, x, cos, sin, cache, layer, start, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, layer, start, mask)
        return x + self.mlp(self.mlp_norm(x))

    def forward_batch(self, x, cos, sin, kv, plan, layer):
        if self.fused is not None:
            return self.fused.forward_batch(x, cos, sin, kv, plan, layer)
        x = x + self.attn.forward_batch(self.attn_norm(x), cos, sin, kv, plan, layer)
        return x + self.mlp(self.mlp_norm(x))


@dataclass(frozen=True)
class ForwardOut:
    logits: torch.Tensor | None  # [B, T_logits, V] float32 (T_logits = T, or 1 for last-row only)
    features: torch.Tensor  # [B, T, n_taps * d]


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose result for a row does not depend on how many rows share the call: one row
    is computed as two (itself twice). On the CPU a half-precision product of one row takes another
    kernel (oneDNN's) than the same row among several, which rounds differently for some inputs --
    enough to change a bfloat16 model's next token after a near-tie. Measured on the default target
    at bfloat16 (docs/benchmarks.md): with it and row-stable attention, greedy speculative output
    matched target-only on 20 of 20 MT-bench prompts, against 9 without either."""
    if x.numel() != x.shape[-1]:
        return F.linear(x, weight, bias)
    row = x.reshape(1, -1)
    return F.linear(torch.cat([row, row]), weight, bias)[:1].reshape(*x.shape[:-1], weight.shape[0])


class RowInvariantLinear(nn.Linear):
    """An ``nn.Linear`` computed through :func:`row_invariant_linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return row_invariant_linear(x, self.weight, self.bias)


def make_batch_invariant(model: TargetModel) -> TargetModel:
    """In place, for half-precision compute: every op whose result for a row depends on the number of
    rows in the call is made not to, so that a verify row computes exactly what a one-row decode of
    the same token computes (the idea of vLLM's and SGLang's deterministic modes):

    - attention: row-stable (each verify row alone over its own visible keys, in slot order, as the
      decode of that token attends; the fused kernel's result otherwise moves with the masked keys
      of other rows, see :meth:`Attention._attend`);
    - linear layers, the LM head and the MoE experts' products: one row runs as two
      (:func:`row_invariant_linear`).

    RMSNorm, the residual adds and the activations are per row already."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowInvariantLinear
        elif isinstance(module, Attention):
            module.row_stable = True
        elif isinstance(module, MoE):
            module.linear = row_invariant_linear
    return model


def checked_shape(name: str, value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``value`` for parameter ``name``, refused (naming it) when its shape is not the config's."""
    if value.shape != shape:
        raise ValueError(f"checkpoint: {name} has shape {tuple(value.shape)}, the config says {tuple(shape)}")
    return value


class TargetModel(nn.Module):
    """Llama-family decoder over weights we own; frozen (no parameter requires grad)."""

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            DecoderLayer(
                d,
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.expert_intermediate_size if cfg.is_moe_layer(i) else cfg.intermediate_size,
                cfg.rms_norm_eps,
                cfg.num_experts if cfg.is_moe_layer(i) else 0,
                cfg.experts_per_token,
                cfg.norm_topk_prob,
                cfg.qk_norm,
                cfg.clip_qkv,
                cfg.qkv_bias,
                cfg.shared_expert_intermediate_size,
                qk_norm_per_head=cfg.qk_norm_per_head,
            )
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = RotaryTable(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)
        self.fused = None  # the gguf precision's one-call forward of every layer (eyas.target.quantized.FusedForward)
        self.requires_grad_(False)

    def allocate_cache(self, batch: int, max_slots: int) -> KVCache:
        c = self.cfg
        return KVCache.allocate(
            c.num_layers,
            batch,
            c.num_kv_heads,
            max_slots,
            c.head_dim,
            self.embed.weight.dtype,
            self.embed.weight.device,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None,
        taps: tuple[FeatureTap, ...],
        logits_rows: str = "all",
    ) -> ForwardOut:
        """Run rows ``tokens`` at ``positions``, writing K/V into slots ``[start, start+T)``.

        tokens, positions: [B, T] int64. mask: [B, T, start+T] bool (True = may attend) or None,
        which means every row sees every slot up to ``start + T`` (only right for T == 1).
        logits_rows: "all", "last" or "none".
        """
        assert tokens.ndim == 2 and tokens.dtype == torch.int64, "tokens: [B, T] int64"
        assert positions.shape == tokens.shape, "positions: must match tokens [B, T]"
        B, T = tokens.shape
        if mask is None and T > 1:
            raise ValueError("mask: required when more than one row is fed")
        if mask is not None:
            assert mask.shape == (B, T, start + T) and mask.dtype == torch.bool, "mask: [B, T, start+T] bool"
        if start + T > cache.max_slots:
            raise ValueError(f"rows: {start + T} slots exceed the KV cache ({cache.max_slots})")
        cos, sin = self.rope(positions)
        if self.fused is not None and isinstance(cache, KVCache):
            seen = torch.ones(B, T, start + T, dtype=torch.bool) if mask is None else mask
            return self._run_fused(
                self.embed(tokens),
                cos,
                sin,
                cache.k,
                cache.v,
                torch.arange(B).repeat_interleave(T),
                torch.arange(start, start + T).repeat(B),
                seen.reshape(B * T, start + T),
                taps,
                logits_rows,
            )
        return self._run(
            self.embed(tokens), taps, logits_rows, lambda i, layer, x: layer(x, cos, sin, cache, i, start, mask)
        )

    def forward_batch(
        self, kv: BatchKV, plan: BatchRows, taps: tuple[FeatureTap, ...], logits_rows: str | torch.Tensor = "all"
    ) -> ForwardOut:
        """Every request's rows of one round in one forward over the engine's K/V store: one
        attention call per layer (``eyas.target.batch_kv``). -> logits [1, N or n, V] and features
        [1, N, F] in packed order; ``logits_rows``: "all", "none", or packed-row indices [n]."""
        kv.fit(plan.num_kv_rows, plan.key_len)  # the store grows with what is written, within the budgets
        cos, sin = self.rope(plan.positions[None], plan.max_position)
        if isinstance(logits_rows, torch.Tensor):
            logits_rows = logits_rows.to(plan.tokens.device)
        if self.fused is not None:
            return self._run_fused(
                self.embed(plan.tokens[None]),
                cos,
                sin,
                kv.k,
                kv.v,
                plan.kv_rows,
                plan.slots,
                plan.visibility(),
                taps,
                logits_rows,
            )
        return self._run(
            self.embed(plan.tokens[None]),
            taps,
            logits_rows,
            lambda i, layer, x: layer.forward_batch(x, cos, sin, kv, plan, i),
        )

    def expert_routing(self) -> list[torch.Tensor]:
        """Per MoE layer, the experts each row of the last forward routed to ([N, k] each; [] if dense)."""
        return [layer.mlp.last_routing for layer in self.layers if isinstance(layer.mlp, MoE)]

    def _run(self, x, taps, logits_rows, step) -> ForwardOut:
        wanted = {t.layers_applied for t in taps}
        tapped: dict[int, torch.Tensor] = {0: x} if 0 in wanted else {}
        for i, layer in enumerate(self.layers):
            x = step(i, layer, x)
            if i + 1 in wanted:
                tapped[i + 1] = x
        return self._outputs(x, tapped, taps, logits_rows)

    def _run_fused(self, x, cos, sin, k_store, v_store, kv_rows, slots, mask, taps, logits_rows) -> ForwardOut:
        """:meth:`_run` through the fused kernels (``self.fused``: every layer in one call). x [B, T, d]
        packed as B * T rows; cos, sin [B, T, hd]; the K/V store [L, R, H_kv, S, hd] written in place at
        (kv_rows, slots) [B * T]; mask [B * T, key_len] bool: what each row sees of its K/V row."""
        B, T, d = x.shape
        wanted = sorted({t.layers_applied for t in taps} - {0})
        out, kept = self.fused(
            x.reshape(B * T, d),
            cos.reshape(B * T, -1),
            sin.reshape(B * T, -1),
            k_store,
            v_store,
            kv_rows,
            slots,
            mask,
            wanted,
        )
        tapped = {n: kept[i].view(B, T, d) for i, n in enumerate(wanted)}
        if any(t.layers_applied == 0 for t in taps):
            tapped[0] = x
        return self._outputs(out.view(B, T, d), tapped, taps, logits_rows)

    def _outputs(self, x, tapped, taps, logits_rows) -> ForwardOut:
        """The features of ``taps`` from the kept layer outputs ``tapped``, and the logits of the final
        norm of ``x`` at ``logits_rows``."""
        final = self.norm(x)
        features = (
            torch.cat(
                [
                    self.norm(tapped[t.layers_applied])
                    if t.normed and t.layers_applied != len(self.layers)
                    else (final if t.normed else tapped[t.layers_applied])
                    for t in taps
                ],
                dim=-1,
            )
            if taps
            else final[..., :0]
        )
        if isinstance(logits_rows, torch.Tensor):  # [n] packed-row indices (forward_batch)
            logits = head_rows(self.lm_head, final[:, logits_rows]).float()
        elif logits_rows == "all":
            logits = head_rows(self.lm_head, final).float()
        elif logits_rows == "last":
            logits = head_rows(self.lm_head, final[:, -1:]).float()
        elif logits_rows == "none":
            logits = None
        else:
            raise ValueError(f"logits_rows: {logits_rows!r} is not all/last/none")
        return ForwardOut(logits, features)

    # --- weights ---------------------------------------------------------------------------
    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor]) -> None:
        """Fill from a transformers state dict of a supported kind (``model.layers.N.self_attn.q_proj.weight``
        ...; the memory layout, ``eyas.target.checkpoint``), refusing one that holds a tensor this target
        does not consume (:meth:`hf_parameter_sources`)."""
        params = dict(self.named_parameters())
        with torch.no_grad():
            for name, source in self.hf_parameter_sources(sd).items():
                params[name].copy_(checked_shape(name, source(), params[name].shape))

    def hf_parameter_sources(self, sd: Mapping[str, torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
        """For each parameter, a function that reads its value from ``sd`` (a transformers state dict in
        the memory layout, or a :class:`~eyas.target.checkpoint.CheckpointTensors` that reads it from
        disk on demand): q/k/v are fused into ``wqkv``, gate and up into ``w_gate_up``; nothing is read
        before a function is called, so a loader can fill the parameters one at a time.

        Refuses, naming the tensor, a state dict that lacks one, or that holds a tensor this target
        does not consume: an ignored tensor (a bias, a norm, a shared expert) would otherwise give
        silently wrong logits. Rotary ``inv_freq`` buffers (recomputed here) and a tied
        ``lm_head.weight`` (the embedding) are the only tensors skipped."""
        c = self.cfg
        used: set[str] = set()
        out: dict[str, Callable[[], torch.Tensor]] = {}

        def name(n):
            if n not in sd:
                raise ValueError(f"checkpoint: missing tensor {n!r}")
            used.add(n)
            return n

        def one(param: str, n: str):
            n = name(n)
            out[param] = lambda: sd[n]

        def cat(param: str, names: list[str]):
            names = [name(n) for n in names]
            out[param] = lambda: torch.cat([sd[n] for n in names], 0)

        def gated_mlp(p, prefix: str):  # an HF SiLU-gated MLP (gate_proj, up_proj, down_proj) under prefix p
            cat(prefix + "w_gate_up.weight", [p + "gate_proj.weight", p + "up_proj.weight"])
            one(prefix + "w_down.weight", p + "down_proj.weight")

        one("embed.weight", "model.embed_tokens.weight")
        for i, layer in enumerate(self.layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            qkv = [p + f"self_attn.{x}_proj." for x in "qkv"]
            cat(q + "attn.wqkv.weight", [x + "weight" for x in qkv])
            if c.qkv_bias:
                cat(q + "attn.wqkv.bias", [x + "bias" for x in qkv])  # [(H + 2 H_kv) hd]
            one(q + "attn.wo.weight", p + "self_attn.o_proj.weight")
            if c.qk_norm:
                one(q + "attn.q_norm.weight", p + "self_attn.q_norm.weight")
                one(q + "attn.k_norm.weight", p + "self_attn.k_norm.weight")
            if isinstance(layer.mlp, MoE):  # transformers' fused experts: gate_up [E, 2f, d], down [E, d, f]
                one(q + "mlp.router.weight", p + "mlp.gate.weight")
                one(q + "mlp.gate_up", p + "mlp.experts.gate_up_proj")
                one(q + "mlp.down", p + "mlp.experts.down_proj")
                if layer.mlp.shared is not None:
                    gated_mlp(p + "mlp.shared_expert.", q + "mlp.shared.")
                    one(q + "mlp.shared_gate.weight", p + "mlp.shared_expert_gate.weight")
            else:
                gated_mlp(p + "mlp.", q + "mlp.")
            one(q + "attn_norm.weight", p + "input_layernorm.weight")
            one(q + "mlp_norm.weight", p + "post_attention_layernorm.weight")
        one("norm.weight", "model.norm.weight")
        if not c.tie_word_embeddings:
            one("lm_head.weight", "lm_head.weight")
        skipped = {"lm_head.weight"} if c.tie_word_embeddings else set()
        unused = [k for k in sd if k not in used and k not in skipped and k.rsplit(".", 1)[-1] != "inv_freq"]
        if unused:
            raise ValueError(
                f"checkpoint: tensor {unused[0]!r} is not used by this target"
                + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else "")
                + "; its config and weights disagree, or the architecture is not supported"
            )
        missing = set(dict(self.named_parameters())) - set(out) - skipped
        assert not missing, f"parameters without a source: {sorted(missing)}"
        return out

    def weight_digest(self) -> str:
        """sha256 over every parameter's name, shape and fp32 bytes (the fingerprint's weight part)."""
        h = hashlib.sha256()
        for name, p in sorted(self.state_dict().items()):
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                continue
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().float().contiguous().cpu().numpy().tobytes())
        return h.hexdigest()


KERNEL_ATTEND_ROWS = 32  # query rows a call up to which fp16w's decode and verify rows attend through eyas.kernels


def quantize_fp16_weights(module: nn.Module, use_kernels: bool | None = None) -> nn.Module:
    """Served precision ``fp16w``, in place: every ``nn.Linear`` under ``module`` (a target: LM head
    included; or a drafter: it drafts at fp16w beside such a target) keeps its weights in fp16 and
    computes in fp32 (fp32 activations, fp32 accumulation). The embedding, norms and MoE expert
    stacks stay fp32.

    Where Eyas's CPU kernels run (``eyas.kernels``: x86 with AVX2, FMA and F16C, a C++ compiler;
    ``use_kernels``, default ``eyas.kernels.preferred()``), the linears are :class:`~eyas.kernels.F16WLinear` and every decode and verify
    row attends through the kernels' attention: both row-invariant, so a verify row is bit for bit
    the one-row decode of its token. Elsewhere (and for any Linear whose shape the kernel does not
    take) the linears are ``torch.ao``'s dynamic fp16 linear on fbgemm and attention is PyTorch's.

    Why it exists (measured on this 2-core AVX2 CPU, a verify after a 300-token context): MKL's fp32
    GEMM costs about 2x its GEMV from 2 rows on, so a speculative verify is expensive; fbgemm's fp16
    kernel reads half the bytes and stays nearly flat for a few rows: 1 row 31 ms (fp32 60-69),
    2 rows 34, 5 rows 40, 9 rows 52, 17 rows 85.

    Exactness is defined against the target as served (target-only at ``fp16w``). A row's result
    depends on the rows beside it only in the last bits of the fp32 accumulation, as at fp32
    (measured: at most 3e-6 apart), and activations are not rounded to a grid, so, unlike
    ``int8``, no row-stable attention is needed. The model is not fp32's: fp16 rounds 42 % of
    SmolLM2-135M's weights (at most 0.002 apart). Inference only: the new modules hold packed
    weights, no parameters.
    """
    from torch.ao.quantization import quantize_dynamic

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ValueError("precision: fp16w needs torch's fbgemm kernels (an x86 CPU build of torch)")
    from eyas import kernels as cpu_kernels

    use_kernels = cpu_kernels.preferred() if use_kernels is None else use_kernels
    compiled = cpu_kernels.load() if use_kernels else None
    if compiled is not None:  # Eyas's row-invariant kernels, where the CPU and a compiler allow them
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and cpu_kernels.F16WLinear.fits(child):
                    setattr(parent, name, cpu_kernels.F16WLinear(child.weight, child.bias))
            if isinstance(parent, Attention):
                parent.kernels = compiled
    torch.backends.quantized.engine = "fbgemm"
    quantize_dynamic(module, {nn.Linear}, dtype=torch.float16, inplace=True)  # every other Linear
    return module


class RowStableInt8Linear(nn.Module):
    """fbgemm int8 linear with SmoothQuant scaling and a batch-independent activation scale.

    fbgemm's dynamic linear picks one activation scale per call from the min/max of the *whole*
    input, so a row's result would depend on the other rows in the same forward: a 17-row verify
    would compute the frontier row differently from a 1-row decode, and greedy speculative output
    would drift from target-only output. Here the input is divided by per-channel smoothing
    factors (SmoothQuant: the outlier channels' range moves into the weights), clamped to a
    calibrated ``[-bound, bound]``, and an anchor row holding ``-bound`` and ``+bound`` is appended,
    so every call uses the same scale and zero point: each output row depends on its own row only.
    """

    def __init__(self, qlinear: nn.Module, inv_smooth: torch.Tensor, bound: float):
        super().__init__()
        self.qlinear = qlinear
        self.bound = float(bound)
        self.register_buffer("inv_smooth", inv_smooth.float(), persistent=False)  # [in]
        anchor = torch.zeros(1, inv_smooth.numel())
        anchor[0, 0], anchor[0, -1] = -self.bound, self.bound
        self.register_buffer("anchor", anchor, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in]
        flat = (x.reshape(-1, x.shape[-1]) * self.inv_smooth).clamp(-self.bound, self.bound)
        out = self.qlinear(torch.cat([flat, self.anchor.to(flat.dtype)], 0))[:-1]
        return out.reshape(*x.shape[:-1], out.shape[-1])


@torch.inference_mode()
def calibrate_activation_absmax(model: TargetModel, calibration_ids: list[int]) -> dict[str, torch.Tensor]:
    """Per-input-channel max |x| of every Linear over one causal forward of ``calibration_ids``."""
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):

            def hook(m, args, name=name):
                v = args[0].reshape(-1, args[0].shape[-1]).abs().amax(0)
                amax[name] = torch.maximum(amax[name], v) if name in amax else v

            hooks.append(mod.register_forward_pre_hook(hook))
    n = len(calibration_ids)
    cache = model.allocate_cache(1, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril().unsqueeze(0)
    try:
        model(torch.tensor([calibration_ids]), torch.arange(n).unsqueeze(0), cache, 0, mask, (), logits_rows="all")
    finally:
        for h in hooks:
            h.remove()
    return amax


SMOOTH_ALPHA = 0.7  # SmoothQuant migration strength; 0.7 gave the best top-1 agreement with fp32 here


def quantize_int8(model: TargetModel, calibration_ids: list[int] | None = None) -> TargetModel:
    """Served precision ``int8``: fbgemm int8 weights (per output channel) for every Linear, LM head
    included, with SmoothQuant smoothing and batch-independent activation scales
    (:class:`RowStableInt8Linear`), calibrated on ``calibration_ids``.

    The embedding stays fp32 (a lookup, not a GEMM). Exactness is defined against the target as
    served: target-only and speculative decoding use the same precision.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    if calibration_ids is None:
        gen = torch.Generator().manual_seed(0)
        calibration_ids = torch.randint(0, model.cfg.vocab_size, (256,), generator=gen).tolist()
    if model.cfg.tie_word_embeddings:  # untie so that quantizing the head leaves the embedding fp32
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(model.embed.weight.detach().clone(), requires_grad=False)
        model.lm_head = head
    amax = calibrate_activation_absmax(model, calibration_ids)
    smooth: dict[str, tuple[torch.Tensor, float]] = {}
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear):
                act = amax[name].clamp(min=1e-5)
                s = (act**SMOOTH_ALPHA / mod.weight.abs().amax(0).clamp(min=1e-5) ** (1 - SMOOTH_ALPHA)).clamp(min=1e-5)
                mod.weight.mul_(s[None, :])
                smooth[name] = (1.0 / s, float((act / s).max()))
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
    quantize_dynamic(model, {name: per_channel_dynamic_qconfig for name in smooth}, dtype=torch.qint8, inplace=True)
    for name, (inv_s, bound) in smooth.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, RowStableInt8Linear(getattr(parent, child), inv_s, bound))
    for mod in model.modules():
        if isinstance(mod, Attention):
            mod.row_stable = True
    return model
