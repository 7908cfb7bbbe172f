"""The target's layers, gpt-fast style: RMSNorm, rotary tables (with the scaled RoPE kinds), the
K/V caches of a single sequence, attention (a batched forward over the engine's one store, or a
cache), the MLP and the mixture of experts, one decoder layer; and the row-invariant linear that
half precision needs (a row's result must not depend on the rows beside it).

Terms: a *row* is one token fed to a forward with an explicit position id; a *slot* an index into
a K/V cache or store (``eyas.target.model``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.target.batch_kv import BatchKV, BatchRows, Grid


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., d]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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
        key_dtype: torch.dtype | None = None,
        key_width: int | None = None,
    ) -> KVCache:
        """``key_dtype``, ``key_width``: how a key is held (``TargetModel.key_layout``; None: as the values)."""
        shape = (num_layers, batch, num_kv_heads, max_slots, head_dim)
        key_shape = shape[:4] + (key_width or head_dim,)
        return cls(
            torch.zeros(key_shape, dtype=key_dtype or dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def max_slots(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_slot(self) -> int:
        L, B, H, _, _ = self.k.shape
        return L * B * H * (self.k.shape[4] * self.k.element_size() + self.v.shape[4] * self.v.element_size())

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


KERNEL_ATTEND_ROWS = 32  # query rows a call up to which fp16w's decode and verify rows attend through eyas.kernels
