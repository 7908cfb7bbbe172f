"""The frozen target's compact forward, gpt-fast style (``TargetModel``): its config and feature
taps in ``config.py``, its layers in ``layers.py``, the served precisions in ``precision.py`` (and
``quantized.py`` for gguf).

Terms (design 0x01A, 0x05C):
- *row*: one token fed to a forward, with an explicit position id. A verify forward feeds the
  flattened tree: row 0 is the frontier token, rows 1.. are draft candidates.
- *slot*: an index into the preallocated KV cache. A forward writes its rows into slots
  ``[start, start + T)`` and attends over ``[0, start + T)`` through an explicit boolean mask,
  so one call can verify a whole tree whose rows share positions.
- *feature tap*: the residual stream after ``layers_applied`` decoder layers, optionally passed
  through the final RMSNorm (design 0x08B; ``eyas.target.config.FeatureTap``).

This module owns no state between calls: the KV cache is passed in and is owned by the engine
(``eyas.target.engine``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from eyas.target.batch_kv import BatchKV, BatchRows
from eyas.target.config import FeatureTap, TargetConfig
from eyas.target.layers import DecoderLayer, KVCache, MoE, RMSNorm, RotaryTable, head_rows


@dataclass(frozen=True)
class ForwardOut:
    logits: torch.Tensor | None  # [B, T_logits, V] float32 (T_logits = T, or 1 for last-row only)
    features: torch.Tensor  # [B, T, n_taps * d]
    # [B, T_logits] int64: each logits row's first maximal index (None: not computed)
    argmax: torch.Tensor | None = None


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

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the store's values are: fp16 under the gguf precision's one-call forward (llama.cpp's default
        cache type: half the bytes a decode reads at a long context; each value rounded once, when written,
        so a verify row still equals its one-row decode), else the compute dtype. Keys: :attr:`key_layout`."""
        return torch.float16 if self.fused is not None else self.embed.weight.dtype

    @property
    def key_layout(self) -> tuple[torch.dtype, int]:
        """How the store holds a key (dtype, elements a key a head): as the values (:attr:`kv_dtype`, head_dim),
        or, under the gguf precision's one-call forward, in Q8 blocks as llama.cpp's ``-ctk q8_0`` does
        (head_dim int8, then head_dim / 32 fp32 scales: uint8, head_dim * 9 / 8 bytes), scored in integers
        (``eyas/kernels/quant.cpp``, "keys in Q8 blocks")."""
        hd = self.cfg.head_dim
        if self.fused is not None and self.fused.q8_keys:
            return torch.uint8, hd + hd // 8
        return self.kv_dtype, hd

    def allocate_cache(self, batch: int, max_slots: int) -> KVCache:
        c = self.cfg
        key_dtype, key_width = self.key_layout
        return KVCache.allocate(
            c.num_layers,
            batch,
            c.num_kv_heads,
            max_slots,
            c.head_dim,
            self.kv_dtype,
            self.embed.weight.device,
            key_dtype=key_dtype,
            key_width=key_width,
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
        norm = self.norm if self.fused is None else self.fused.norm  # fused: the kernels' RMSNorm (one call)
        final = norm(x)
        features = (
            torch.cat(
                [
                    norm(tapped[t.layers_applied])
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
            rows = final[:, logits_rows]
        elif logits_rows in ("all", "last", "none"):
            rows = {"all": final, "last": final[:, -1:], "none": None}[logits_rows]
        else:
            raise ValueError(f"logits_rows: {logits_rows!r} is not all/last/none")
        head = self.lm_head
        if rows is None:
            return ForwardOut(None, features)
        if (
            hasattr(head, "forward_argmax")
            and head.bias is None
            and not (head._forward_hooks or head._forward_pre_hooks)
        ):
            logits, argmax = head.forward_argmax(rows)  # the gguf head: each row's greedy token in the same call
            return ForwardOut(logits, features, argmax)
        return ForwardOut(head_rows(head, rows).float(), features)

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
