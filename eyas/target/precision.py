"""The served precisions other than fp32, applied to a built target in place: ``make_batch_invariant``
(half-precision compute with row-invariant ops), ``quantize_fp16_weights`` (``fp16w``) and
``quantize_int8`` (``int8``: SmoothQuant, row-stable activation scales). ``gguf`` lives in
``eyas.target.quantized``. Each keeps a verify row bit for bit the one-row decode of its token
(docs/architecture.md, "Precision modes")."""

from __future__ import annotations

import torch
import torch.nn as nn

from eyas.target.layers import Attention, MoE, RowInvariantLinear, row_invariant_linear
from eyas.target.model import TargetModel


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
