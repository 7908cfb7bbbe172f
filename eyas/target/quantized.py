"""The ``gguf`` precision: the checkpoint's own quantized blocks, computed as llama.cpp computes them.

Terms:

- *block*: GGUF's unit of quantized weights, 32 consecutive inputs of one output row with their own
  scale: ``Q4_0`` (w = d * (q - 8), q 4-bit; 18 bytes), ``Q4_1`` (w = d * q + m; 20 bytes), ``Q8_0``
  (w = d * q, q 8-bit; 34 bytes). The default target's GGUF holds its layers' linears as Q4_1 and
  its tied embedding / LM head as Q8_0: 96.5 MB a forward reads, against 270 MB at ``fp16w``.
- *numerics*: each activation row is quantized to 8 bits per block of 32 (scale = the block's
  absolute maximum / 127, rounded to nearest even), a weight block's and an activation block's
  products are summed in integers (exact), and the sums are scaled and accumulated in fp32 in one
  fixed order (llama.cpp's ``vec_dot_q4_1_q8_1`` arithmetic). RMSNorm, rotary, SiLU x up and the
  residual adds run in fp32 inside the same kernels (``eyas/kernels/quant.cpp``); attention scores a
  query against keys held in Q8 blocks (llama.cpp's ``-ctk q8_0``; each key quantized once, when
  written, the query row as an activation row) in integers, and weighs fp16 values in fp32.
  Every kernel is row-invariant, so a verify row is bit for bit the one-row decode of its token and
  greedy speculative output equals target-only output at ``gguf`` (tested). The model is not fp32's: its top-1 agreement with fp32 is measured
  (``bench/roofline.py --agreement``).
- A GGUF target's blocks are read from the file as they are (rows of ``attn_q`` and ``attn_k`` put
  back in HF's head order, as transformers' GGUF loader does); any other checkpoint is quantized at
  load with llama.cpp's reference quantizers, its layers to Q4_1 and its LM head to Q8_0, as the
  default GGUF holds them.

A *plain* decoder layer (Llama's: no q/k norms, biases or clipping; a dense MLP) runs fused: one
call for RMSNorm + q/k/v + rotary, the attention, one call for the output projection + residual +
RMSNorm + gate/up + SiLU x up + down + residual (:class:`FusedLayer`). Other layers run their usual
modules with :class:`QLinear` in place of each linear. MoE expert stacks, norms and the embedding
stay fp32, as at fp16w.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from eyas.compute import on_huge_pages
from eyas.target.config import TargetConfig
from eyas.target.layers import MLP, Attention, DecoderLayer
from eyas.target.model import TargetModel

Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGML's type ids
QTYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
BLOCK = 32  # weights a block
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
LAYER_QTYPE, HEAD_QTYPE = Q4_1, Q8_0  # what a checkpoint without blocks of its own is quantized to


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """One linear's weights [N, K] as GGUF blocks."""

    data: torch.Tensor  # [N, K / 32 * BLOCK_BYTES[qtype]] uint8
    qtype: int
    in_features: int  # K

    def __post_init__(self):
        assert self.qtype in BLOCK_BYTES, f"qtype: {self.qtype} is not one of {QTYPE_NAMES}"
        assert self.data.dtype == torch.uint8 and self.data.dim() == 2, "data: [N, bytes] uint8"
        assert self.data.shape[1] * BLOCK == self.in_features * BLOCK_BYTES[self.qtype], "data: bytes a row vs K"

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor | slice) -> Blocks:
        return Blocks(data=self.data[index].contiguous(), qtype=self.qtype, in_features=self.in_features)

    @staticmethod
    def cat(parts: list[Blocks]) -> Blocks:
        """Output rows stacked (a fused q/k/v or gate/up weight): one qtype and K for all."""
        assert len({(p.qtype, p.in_features) for p in parts}) == 1, "parts: one qtype and in_features"
        return Blocks(data=torch.cat([p.data for p in parts]), qtype=parts[0].qtype, in_features=parts[0].in_features)

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        return _kernels().dequantize_weight(self.data, self.qtype, self.in_features)

    @staticmethod
    def quantize(weight: torch.Tensor, qtype: int) -> Blocks:  # weight [N, K]
        w = weight.detach().float().contiguous()
        return Blocks(data=_kernels().quantize_weight(w, qtype), qtype=qtype, in_features=w.shape[1])


def _kernels():
    from eyas import kernels

    compiled = kernels.load()
    if compiled is None:
        raise ValueError(f"precision: gguf needs Eyas's CPU kernels, which are off here ({kernels.why_not()})")
    return compiled


class QLinear(nn.Module):
    """A linear over GGUF blocks: fp32 in, fp32 out, Q8 activations, row-invariant. Inference only."""

    def __init__(self, blocks: Blocks, bias: torch.Tensor | None = None):
        super().__init__()
        self.kernels = _kernels()
        self.qtype, self.in_features, self.out_features = blocks.qtype, blocks.in_features, blocks.out_features
        # [ceil(N / G), K/32 * G * block bytes] uint8: the blocks with G outputs interleaved (kernels.repack)
        self.register_buffer(
            "packed", self.kernels.repack(blocks.data, blocks.qtype, blocks.in_features), persistent=False
        )
        self.weight_bytes = blocks.nbytes  # what a forward reads (the packing pads to whole groups only)
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = self.kernels.linear_q(
            x.reshape(-1, self.in_features).float().contiguous(), self.packed, self.qtype, self.out_features
        )
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def forward_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` and each row's first maximal index (what ``torch.argmax`` picks, NaN first) in
        one kernel call: x [..., K] -> (y [..., N], ids [...] int64). The greedy token of a head's row with
        no torch reduction (one woke the thread pool for ~50-100 us a round)."""
        assert self.bias is None, "forward_argmax: a bias-free head"
        y, ids = self.kernels.linear_q_argmax(
            x.reshape(-1, self.in_features).float().contiguous(), self.packed, self.qtype, self.out_features
        )
        return y.view(*x.shape[:-1], self.out_features), ids.view(x.shape[:-1])

    def top_k(self, x: torch.Tensor, k: int, norm: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A vocabulary head's top ``k`` in one kernel call: x [P, K] (through the RMSNorm ``norm`` first,
        if given) -> (ids [P, k] int64, best first, and their softmax probabilities [P, k] float32): what
        ``softmax(self(norm(x))).topk(k)`` gives, up to float rounding (a tie to the lower id)."""
        assert self.bias is None, "top_k: a bias-free head"
        weight, eps = (norm.weight.detach().float(), norm.eps) if norm is not None else (NO_NORM, 0.0)
        return self.kernels.head_topk(
            x.reshape(-1, self.in_features).float().contiguous(),
            weight,
            eps,
            self.packed,
            self.qtype,
            self.out_features,
            k,
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, {QTYPE_NAMES[self.qtype]}, bias={self.bias is not None}"
        )


NO_NORM = torch.empty(0)  # attn_in's norm weight for an input that comes normed


class FusedLayer:
    """A plain decoder layer's batched forward in two kernel calls around the attention (see the
    module docstring): x [1, N, d] -> [1, N, d], the same rows :meth:`DecoderLayer.forward_batch`
    computes with :class:`QLinear` modules, fused."""

    def __init__(self, layer: DecoderLayer):
        attn = layer.attn
        self.layer, self.kernels = layer, _kernels()
        self.eps = (layer.attn_norm.eps, layer.mlp_norm.eps)
        self.heads, self.kv_heads, self.head_dim = attn.heads, attn.kv_heads, attn.head_dim

    @staticmethod
    def fits(layer: DecoderLayer) -> bool:
        a = layer.attn
        return (
            isinstance(layer.mlp, MLP)
            and all(
                isinstance(m, QLinear) and m.bias is None for m in (a.wqkv, a.wo, layer.mlp.w_gate_up, layer.mlp.w_down)
            )
            and a.q_norm is None
            and a.clip_qkv is None
        )

    def forward_batch(self, x, cos, sin, kv, plan, layer_index: int):
        layer = self.layer
        a, mlp = layer.attn, layer.mlp
        rows = x[0]  # [N, d]
        q, k, v = self.kernels.attn_in(
            rows,
            layer.attn_norm.weight,
            self.eps[0],
            a.wqkv.packed,
            a.wqkv.qtype,
            cos[0],
            sin[0],
            self.heads,
            self.kv_heads,
            self.head_dim,
        )  # [N, H, hd], [N, H_kv, hd] x 2
        out = a.attend_batch(q, k, v, kv, plan, layer_index)  # [N, H * hd]
        return self.kernels.attn_out_mlp(
            rows,
            out,
            a.wo.packed,
            a.wo.qtype,
            layer.mlp_norm.weight,
            self.eps[1],
            mlp.w_gate_up.packed,
            mlp.w_gate_up.qtype,
            mlp.w_down.packed,
            mlp.w_down.qtype,
            mlp.ffn,
        )[None]


class FusedForward:
    """Every decoder layer of a model whose layers are all plain, in ONE kernel call a forward
    (``forward_layers``): per layer RMSNorm, q/k/v, rotary, the K/V written into the store, each row's
    attention over what its mask shows, o, residual, RMSNorm, gate/up, SiLU x up, down, residual.
    The Python side only embeds, looks up rotary tables and builds the rows' mask, once a forward."""

    HEAD_DIMS = (32, 64, 96, 128)  # the fused attention's compiled widths

    @classmethod
    def fits(cls, model: TargetModel) -> bool:
        return all(layer.fused is not None for layer in model.layers) and model.cfg.head_dim in cls.HEAD_DIMS

    def __init__(self, model: TargetModel, q8_keys: bool = True):
        """``q8_keys``: the store holds keys in Q8 blocks, scored in integers (``TargetModel.key_layout``);
        False: fp16 keys, scored in fp32."""
        layers = list(model.layers)
        assert layers and all(FusedLayer.fits(layer) for layer in layers), "model: every layer plain"
        self.q8_keys = q8_keys
        eps = {layer.attn_norm.eps for layer in layers} | {layer.mlp_norm.eps for layer in layers}
        assert len(eps) == 1, "model: one RMSNorm epsilon"
        self.kernels, self.eps = _kernels(), eps.pop()
        a, m = layers[0].attn, layers[0].mlp
        self.heads, self.kv_heads, self.head_dim, self.ffn = a.heads, a.kv_heads, a.head_dim, m.ffn
        self.attn_norm = [layer.attn_norm.weight.detach().float().contiguous() for layer in layers]
        self.mlp_norm = [layer.mlp_norm.weight.detach().float().contiguous() for layer in layers]
        self.weights = [
            [layer.attn.wqkv.packed for layer in layers],
            [layer.attn.wo.packed for layer in layers],
            [layer.mlp.w_gate_up.packed for layer in layers],
            [layer.mlp.w_down.packed for layer in layers],
        ]
        self.final_norm = model.norm.weight.detach().float().contiguous()  # [d]
        self.final_eps = float(model.norm.eps)
        self.qtypes = [
            q
            for layer in layers
            for q in (layer.attn.wqkv.qtype, layer.attn.wo.qtype, layer.mlp.w_gate_up.qtype, layer.mlp.w_down.qtype)
        ]

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm in one kernel call (the kernels' order): x [..., d] -> [..., d] float32."""
        d = x.shape[-1]
        return self.kernels.rms_norm(x.reshape(-1, d).float(), self.final_norm, self.final_eps).view(*x.shape[:-1], d)

    def __call__(self, x, cos, sin, k_store, v_store, kv_rows, slots, mask, taps: list[int]):
        """x [N, d], cos/sin [N, hd], the store [L, R, H_kv, S, hd] (written in place), kv_rows/slots [N],
        mask [N, key_len] -> (x after the last layer [N, d], x after each of ``taps`` layers [len, N, d])."""
        return self.kernels.forward_layers(
            x.float().contiguous(),
            cos.float().contiguous(),
            sin.float().contiguous(),
            self.attn_norm,
            self.mlp_norm,
            *self.weights,
            self.qtypes,
            self.eps,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.ffn,
            k_store,
            v_store,
            kv_rows,
            slots,
            mask,
            taps,
        )


class FusedDraftLayer:
    """A drafter's decoder layer (``eyas.drafting.model.DraftLayer``) in two kernel calls around the
    attention, as :class:`FusedLayer`: q/k/v of its input (through its own RMSNorm, or as it comes:
    the reference EAGLE-3 layer reads ``[norm(E(x)); norm(state)]``), then o + residual, RMSNorm,
    gate/up, SiLU x up, down + residual."""

    def __init__(self, layer):
        self.layer, self.kernels = layer, _kernels()
        self.norm = layer.attn_norm.weight.detach() if layer.attn_norm is not None else NO_NORM
        self.eps = layer.attn_norm.eps if layer.attn_norm is not None else layer.mlp_norm.eps

    @staticmethod
    def fits(layer) -> bool:
        a, mlp = layer.attn, layer.mlp
        return (
            all(isinstance(m, QLinear) and m.bias is None for m in (a.wqkv, a.wo, mlp.w_gate_up, mlp.w_down))
            and a.q_norm is None
            and a.clip_qkv is None
        )

    def forward_batch(self, x, residual, cos, sin, kv, plan):  # x [1, N, d_in], residual [1, N, d]
        layer = self.layer
        a, mlp = layer.attn, layer.mlp
        q, k, v = self.kernels.attn_in(
            x[0].contiguous(),
            self.norm,
            self.eps,
            a.wqkv.packed,
            a.wqkv.qtype,
            cos[0],
            sin[0],
            a.heads,
            a.kv_heads,
            a.head_dim,
        )
        out = a.attend_batch(q, k, v, kv, plan, 0)
        return self.kernels.attn_out_mlp(
            residual[0].contiguous(),
            out,
            a.wo.packed,
            a.wo.qtype,
            layer.mlp_norm.weight,
            layer.mlp_norm.eps,
            mlp.w_gate_up.packed,
            mlp.w_gate_up.qtype,
            mlp.w_down.packed,
            mlp.w_down.qtype,
            mlp.ffn,
        )[None]


class FusedDraftStep:
    """A reference-layout EAGLE-3 drafter's whole step over one request's rows in ONE kernel call
    (``kernels.draft_step``): fc of the target features (context rows), the two input RMSNorms, q/k/v
    with rotary, the K/V written into the request's store row and the attention, o + state and the MLP,
    then the final norm, the draft head and the top k in target ids. The Python path calls the same
    kernels one by one with torch's glue between them (about 0.2 ms a step in the interpreter, beside
    0.1 ms of kernels); only the two input norms' rounding differs (the kernels' RMSNorm), which moves
    a draft confidence in its last bits, never an output (the target verifies every token)."""

    def __init__(self, drafter, embed: nn.Module):
        layer, a, mlp = drafter.layer, drafter.layer.attn, drafter.layer.mlp
        self.kernels = _kernels()
        self.weights = [
            drafter.reduce.packed,
            drafter.embed_norm.weight.detach(),
            drafter.state_norm.weight.detach(),
            a.wqkv.packed,
            a.wo.packed,
            layer.mlp_norm.weight.detach(),
            mlp.w_gate_up.packed,
            mlp.w_down.packed,
            drafter.norm.weight.detach(),
            drafter.head.packed,
            drafter.d2t,
            embed.weight.detach(),
            drafter.rope.cos,
            drafter.rope.sin,
        ]
        self.state_weights = [NO_NORM, *self.weights[1:]]  # tree rows: states already, no fc
        self.qtypes = [m.qtype for m in (drafter.reduce, a.wqkv, a.wo, mlp.w_gate_up, mlp.w_down, drafter.head)]
        self.shape = [a.heads, a.kv_heads, a.head_dim, mlp.ffn, drafter.head.out_features]
        self.eps = drafter.cfg.rms_norm_eps
        self.max_position = drafter.rope.cos.shape[0]

    @staticmethod
    def fits(drafter, embed: nn.Module) -> bool:
        """Whether ``drafter`` runs as one call: reference EAGLE-3 without per-tap norms, every linear in
        GGUF blocks with no bias (``gguf_drafter``), float32 on the CPU, norms of one epsilon."""
        cfg = drafter.cfg
        if (cfg.method, cfg.layout, cfg.fc_norm) != ("eagle3", "reference", False) or drafter.layer.fused is None:
            return False
        linears = (drafter.reduce, drafter.head)
        norms = (drafter.embed_norm, drafter.state_norm, drafter.layer.mlp_norm, drafter.norm)
        return (
            all(type(m) is QLinear and m.bias is None for m in linears)
            and all(n.eps == cfg.rms_norm_eps and n.weight.dtype == torch.float32 for n in norms)
            and embed.weight.device.type == "cpu"
            and embed.weight.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and drafter.layer.attn.head_dim % 8 == 0
            and drafter.layer.attn.head_dim <= 128
        )

    def __call__(self, rows, tokens, positions, keys, values, start: int, mask, k: int, topk_rows: int):
        """rows [N, taps * d] target features (context rows) or [N, d] states (tree rows); tokens,
        positions [N] int64 (host-known positions below the rotary table's end); keys, values the
        request's store row [H_kv, S, hd]; mask [N, start + N] bool or None (one row) -> (hidden [N, d],
        target ids [topk_rows, k] and their confidences [topk_rows, k] of the last ``topk_rows`` rows)."""
        weights = self.weights if rows.shape[1] != self.weights[2].shape[0] else self.state_weights
        return self.kernels.draft_step(
            rows.float().contiguous(),
            tokens,
            positions,
            keys,
            values,
            start,
            mask,
            weights,
            self.qtypes,
            [*self.shape, k, topk_rows],
            self.eps,
        )

    def tree(self, rows, tokens, keys, values, start: int, builder):
        """A whole EAGLE-2 dynamic tree in ONE call (``kernels.draft_tree``): the seed's context rows [A,
        taps * d] and tokens [A] at slots and positions ``start`` .. ``start + A - 1`` (each seeing the
        slots up to its own), then every layer's expanded nodes as provisional rows from slot ``start + A``
        (positions ``start + A - 1`` + depth), grown and selected as ``builder`` (a fresh
        ``DynamicTreeBuilder``) would over the same steps. -> (DraftTree, provisional rows written)."""
        from eyas.protocol.tree import DraftTree

        b = builder
        tokens_, parents, depths, conf, written = self.kernels.draft_tree(
            rows.float().contiguous(),
            tokens,
            keys,
            values,
            start,
            self.weights,
            self.qtypes,
            self.shape,
            [b.expand_width, b.max_depth, b.verify_budget],
            [b._min_log_value, b._expand_min_log_value],
            self.eps,
        )
        return DraftTree(tokens=tokens_, parents=parents, depths=depths, draft_probs=conf), int(written)


# --- reading a GGUF's blocks -----------------------------------------------------------------------
def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a materialized checkpoint folder was made from (None: not from a GGUF)."""
    meta = folder / "eyas_target.json"
    if not meta.exists():
        return None
    source = json.loads(meta.read_text()).get("source")
    return Path(source) if source and str(source).endswith(".gguf") and Path(source).exists() else None


def _unpermute_rows(data: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter orders q/k rows for interleaved rotary; back to HF's head order (the
    reverse transformers' GGUF loader applies, on whole rows of blocks)."""
    n = data.shape[0]
    return data.reshape(heads, n // heads // 2, 2, data.shape[1]).swapaxes(2, 1).reshape(data.shape)


def read_gguf_blocks(path: Path, cfg: TargetConfig) -> dict[str, Blocks]:
    """The GGUF's quantized linears, keyed by this model's module names (``layers.0.attn.wqkv``,
    ``lm_head``, ...). A tensor of a type the kernels do not take (K-quants, fp16) is absent: its
    linear is quantized at load instead (:func:`quantize_gguf` says which)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    raw: dict[str, Blocks] = {}
    for t in reader.tensors:
        qtype = int(t.tensor_type)
        if qtype not in BLOCK_BYTES:
            continue
        data = torch.from_numpy(t.data.copy()).view(torch.uint8)
        raw[t.name] = Blocks(data=data.reshape(int(t.shape[-1]), -1), qtype=qtype, in_features=int(t.shape[0]))
    out: dict[str, Blocks] = {}
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        q, k, v = (raw.get(p + f"attn_{n}.weight") for n in "qkv")
        if q is not None and k is not None and v is not None and q.qtype == k.qtype == v.qtype:
            q = Blocks(data=_unpermute_rows(q.data, cfg.num_heads), qtype=q.qtype, in_features=q.in_features)
            k = Blocks(data=_unpermute_rows(k.data, cfg.num_kv_heads), qtype=k.qtype, in_features=k.in_features)
            out[f"layers.{i}.attn.wqkv"] = Blocks.cat([q, k, v])
        if (o := raw.get(p + "attn_output.weight")) is not None:
            out[f"layers.{i}.attn.wo"] = o
        gate, up = raw.get(p + "ffn_gate.weight"), raw.get(p + "ffn_up.weight")
        if gate is not None and up is not None and gate.qtype == up.qtype:
            out[f"layers.{i}.mlp.w_gate_up"] = Blocks.cat([gate, up])
        if (down := raw.get(p + "ffn_down.weight")) is not None:
            out[f"layers.{i}.mlp.w_down"] = down
    head = raw.get("output.weight") or (raw.get("token_embd.weight") if cfg.tie_word_embeddings else None)
    if head is not None:
        out["lm_head"] = head
    return out


def gguf_head(folder: Path, cfg: TargetConfig, weight: torch.Tensor) -> QLinear:
    """The LM head at ``gguf``: the GGUF's own blocks (its ``output`` or tied ``token_embd``), else
    ``weight`` [V, d] quantized to Q8_0 -- the head :func:`quantize_gguf` gives the whole target."""
    source = gguf_source(folder)
    own = read_gguf_blocks(source, cfg).get("lm_head") if source is not None else None
    return QLinear(own if own is not None else Blocks.quantize(weight, HEAD_QTYPE))


def quantize_linears(module: nn.Module, qtype: int = Q8_0) -> nn.Module:
    """Every ``nn.Linear`` under ``module`` whose inputs come in whole blocks, as a :class:`QLinear`
    over its weight quantized to ``qtype`` now; attention through the kernels. A drafter beside a
    ``gguf`` target drafts so (Q8_0: its acceptance barely moves, and it never changes an output)."""
    kernels = _kernels()
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.in_features % BLOCK == 0:
                setattr(parent, name, QLinear(Blocks.quantize(child.weight, qtype), child.bias))
        if isinstance(parent, Attention):
            parent.kernels = kernels
    return module


def blocks_on_huge_pages(module: nn.Module) -> None:
    """Every :class:`QLinear` of ``module`` reads its blocks from huge pages, in the order a forward reads
    them (``eyas.compute.on_huge_pages``); before any fused step captures them."""
    linears = [m for m in module.modules() if isinstance(m, QLinear)]
    for linear, packed in zip(linears, on_huge_pages([m.packed for m in linears])):
        linear.packed = packed


def quantize_gguf(model: TargetModel, blocks: dict[str, Blocks] | None = None) -> dict[str, str]:
    """Served precision ``gguf``, in place: every dense linear of ``model`` becomes a :class:`QLinear`
    over ``blocks[name]`` (a GGUF's own), or over its fp32 weight quantized now (layers Q4_1, LM head
    Q8_0) where ``blocks`` has none; plain layers run fused; attention runs through the row-invariant
    kernel. -> each linear's name and where its blocks came from ("Q4_1 (gguf)", "Q8_0 (quantized)")."""
    blocks = blocks or {}
    kernels = _kernels()
    origin: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child.in_features % BLOCK:
                continue
            full = f"{name}.{child_name}" if name else child_name
            own = blocks.get(full)
            if own is not None and own.data.shape[0] == child.out_features and own.in_features == child.in_features:
                b, origin[full] = own, f"{QTYPE_NAMES[own.qtype]} (gguf)"
            else:
                qtype = HEAD_QTYPE if full == "lm_head" else LAYER_QTYPE
                b, origin[full] = Blocks.quantize(child.weight, qtype), f"{QTYPE_NAMES[qtype]} (quantized)"
            setattr(module, child_name, QLinear(b, child.bias))
    for module in model.modules():
        if isinstance(module, Attention):
            module.kernels = kernels
    blocks_on_huge_pages(model)
    for layer in model.layers:
        layer.fused = FusedLayer(layer) if FusedLayer.fits(layer) else None
    model.fused = FusedForward(model) if FusedForward.fits(model) else None
    return origin
