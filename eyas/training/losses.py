"""Draft training losses and feature noise (design 0x04, 0x07A, 0x08C; the EAGLE-3 draft vocabulary
itself is ``eyas.drafting.vocab``).

Terms:

- ``R`` rows, each a draft row of design 0x02A; ``mask [R]`` bool is the loss mask ``m``
  (``m_soft`` from `eyas.training.rows`). Every normalised loss divides by ``sum m`` and raises
  ``ValueError`` naming ``mask`` when it is 0: the trainer skips that optimizer step instead.
- ``p`` = draft distribution ``softmax(draft_logits)``; ``q`` = target distribution
  (``target_probs``), the frozen target's soft distribution, not a one-hot label (design 0x04B).
- Reductions (design 0x04A): mean over the feature width ``d`` per row, then a masked mean over
  rows. Masked-out rows are *selected away* before any arithmetic, so a NaN in an unsupervised
  row cannot reach the loss (``0 * NaN = NaN``).

Dtype (design 0x04D): inputs may be BF16; softmax, log-softmax, the accumulation and the
normalising denominator are computed in fp32, and every loss is returned as an fp32 scalar.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from eyas.drafting.vocab import check_d2t
from eyas.protocol.checks import check_tensor as _check

LOSS_DTYPE = torch.float32  # declared accumulation dtype of every loss (design 0x04D)

EAGLE1_REG_WEIGHT: float = 1.0  # v_w, paper + pinned code (design 0x04B)
EAGLE1_CLS_WEIGHT: float = 0.1  # p_w, weights classification, not regression
TTT_DECAY: float = 0.8  # pinned EAGLE-3 per-step weight base: w_s = 0.8 ** s (design 0x08C)

PAPER_NOISE_HALF_WIDTH: float = 0.1  # EAGLE paper: U(-0.1, 0.1) (design 0x04E)
PINNED_NOISE_REFERENCE_LENGTH: int = 512  # pinned code: (rand - 0.5) * 0.2 * 512 / S
NOISE_KINDS: tuple[str, ...] = ("paper", "pinned", "none")


# --------------------------------------------------------------------------------------------
# boundary checks
# --------------------------------------------------------------------------------------------


def _check_float(value: Tensor, name: str) -> None:
    if not value.is_floating_point():
        raise ValueError(f"{name}: expected a floating dtype, got {value.dtype}")


def _supervised_rows(mask: Tensor, rows: int) -> Tensor:  # [M] int64 indices of masked rows
    _check(mask, "mask", 1)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected dtype torch.bool, got {mask.dtype}")
    if mask.shape[0] != rows:
        raise ValueError(f"mask: length {mask.shape[0]} != number of rows {rows}")
    index = mask.nonzero().squeeze(1)
    if index.numel() == 0:
        raise ValueError(
            "mask: no supervised rows (sum m = 0); the normalised loss is undefined -- skip the optimizer step instead"
        )
    return index


def _check_pair(first: Tensor, first_name: str, second: Tensor, second_name: str) -> None:
    _check(first, first_name, 2)
    _check(second, second_name, 2)
    _check_float(first, first_name)
    _check_float(second, second_name)
    if first.shape != second.shape:
        raise ValueError(f"{second_name}: shape {tuple(second.shape)} != {first_name} shape {tuple(first.shape)}")


def _as_scalar(value: Tensor | float, name: str) -> Tensor:
    if isinstance(value, Tensor):
        if value.ndim != 0:
            raise ValueError(f"{name}: expected a scalar (0-D) tensor, got shape {tuple(value.shape)}")
        return value.to(LOSS_DTYPE)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=LOSS_DTYPE)
    raise ValueError(f"{name}: expected a scalar tensor or a number, got {type(value).__name__}")


# --------------------------------------------------------------------------------------------
# EAGLE-1 objective (design 0x04A-0x04B)
# --------------------------------------------------------------------------------------------


def masked_smooth_l1(
    pred: Tensor,  # [R, d] predicted feature \hat f_{t+1}
    target: Tensor,  # [R, d] teacher feature f_{t+1}
    mask: Tensor,  # [R] bool m_soft
    beta: float = 1.0,
) -> Tensor:  # [] fp32
    """Feature regression ``L_reg`` (design 0x04A).

    ``smoothL1_beta(r) = r^2 / (2 beta)`` if ``|r| < beta`` else ``|r| - beta / 2``, with
    ``r = pred - target``; mean over ``d`` per row, mean over the masked rows.
    """
    _check_pair(pred, "pred", target, "target")
    if not (isinstance(beta, (int, float)) and beta > 0):
        raise ValueError(f"beta: must be a number > 0, got {beta!r}")
    index = _supervised_rows(mask, pred.shape[0])
    pred_rows = pred.index_select(0, index).to(LOSS_DTYPE)  # [M, d]
    target_rows = target.index_select(0, index).to(LOSS_DTYPE)  # [M, d]
    per_elem = F.smooth_l1_loss(pred_rows, target_rows, reduction="none", beta=float(beta))
    return per_elem.mean(dim=-1).mean()


def soft_cross_entropy(
    draft_logits: Tensor,  # [R, V]
    target_probs: Tensor,  # [R, V] q, rows sum to 1
    mask: Tensor,  # [R] bool m_soft
) -> Tensor:  # [] fp32
    """Token classification ``L_cls = -(1 / sum m) sum_t m_t sum_v q_t(v) log p_t(v)`` (design 0x04B).

    Equals ``H(q) + KL(q || p)``; with ``q`` fixed by the frozen target, minimising it over the
    drafter minimises the forward KL.
    """
    _check_pair(draft_logits, "draft_logits", target_probs, "target_probs")
    index = _supervised_rows(mask, draft_logits.shape[0])
    log_p = F.log_softmax(draft_logits.index_select(0, index).to(LOSS_DTYPE), dim=-1)  # [M, V]
    q = target_probs.index_select(0, index).to(LOSS_DTYPE)  # [M, V]
    return -(q * log_p).sum(dim=-1).mean()


class _RowSoftCrossEntropy(torch.autograd.Function):
    """Per-row ``-sum_v q(v) log softmax(z)(v)`` in row chunks, fp32 inside: the forward keeps only
    the log-partition per row, the backward writes ``(softmax(z) * sum q - q) * grad`` straight into
    the gradient. Nothing of size ``[R, V]`` is materialised besides that gradient, where autograd
    through ``log_softmax``, the product and the sum keeps several (each a fresh allocation the size
    of the vocabulary per row: the costliest elementwise work of a drafter's training step)."""

    CHUNK_ROWS = 64

    @staticmethod
    def forward(ctx, logits, q):  # logits [R, V] any float; q [R, V] fp32 -> [R] fp32
        lse = torch.empty(logits.shape[0], dtype=LOSS_DTYPE, device=logits.device)
        out = torch.empty_like(lse)
        qsum = torch.empty_like(lse)
        for a in range(0, logits.shape[0], _RowSoftCrossEntropy.CHUNK_ROWS):
            z = logits[a : a + _RowSoftCrossEntropy.CHUNK_ROWS].to(LOSS_DTYPE)
            qc = q[a : a + _RowSoftCrossEntropy.CHUNK_ROWS]
            lse[a : a + z.shape[0]] = torch.logsumexp(z, dim=-1)
            qsum[a : a + z.shape[0]] = qc.sum(-1)
            out[a : a + z.shape[0]] = lse[a : a + z.shape[0]] * qsum[a : a + z.shape[0]] - (qc * z).sum(-1)
        ctx.save_for_backward(logits, q, lse, qsum)
        return out

    @staticmethod
    def backward(ctx, grad):  # grad [R]
        logits, q, lse, qsum = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for a in range(0, logits.shape[0], _RowSoftCrossEntropy.CHUNK_ROWS):
            b = min(a + _RowSoftCrossEntropy.CHUNK_ROWS, logits.shape[0])
            p = torch.exp(logits[a:b].to(LOSS_DTYPE) - lse[a:b, None])
            grad_logits[a:b] = ((p * qsum[a:b, None] - q[a:b]) * grad[a:b, None]).to(logits.dtype)
        return grad_logits, None


def row_soft_cross_entropy(
    draft_logits: Tensor,  # [R, V], any float dtype (BF16 under autocast)
    target_probs: Tensor,  # [R, V] q, no gradient
) -> Tensor:  # [R] fp32
    """Each row's ``-sum_v q(v) log p(v)``, ``p = softmax(draft_logits)`` (the summand of
    :func:`soft_cross_entropy`), with a fused, chunked backward (:class:`_RowSoftCrossEntropy`)."""
    _check(draft_logits, "draft_logits", 2)
    _check(target_probs, "target_probs", 2)
    if draft_logits.shape != target_probs.shape:
        raise ValueError(
            f"target_probs: shape {tuple(target_probs.shape)} != draft_logits shape {tuple(draft_logits.shape)}"
        )
    if target_probs.requires_grad:
        raise ValueError("target_probs: the target distribution takes no gradient")
    return _RowSoftCrossEntropy.apply(draft_logits, target_probs.to(LOSS_DTYPE))


def eagle1_loss(
    l_reg: Tensor | float,  # [] L_reg
    l_cls: Tensor | float,  # [] L_cls
    reg_weight: float = EAGLE1_REG_WEIGHT,
    cls_weight: float = EAGLE1_CLS_WEIGHT,
) -> Tensor:  # [] fp32
    """``L = v_w L_reg + p_w L_cls``; paper/pinned ``v_w = 1.0``, ``p_w = 0.1`` (design 0x04B).

    Fixture (design 0x09): ``L_reg = 0.6, L_cls = 2.4 -> 0.6 + 0.1 * 2.4 = 0.84``.
    """
    return reg_weight * _as_scalar(l_reg, "l_reg") + cls_weight * _as_scalar(l_cls, "l_cls")


# --------------------------------------------------------------------------------------------
# HASS top-K distillation (design 0x07A)
# --------------------------------------------------------------------------------------------


def topk_distillation(
    draft_logits: Tensor,  # [R, V]
    target_probs: Tensor,  # [R, V] q
    mask: Tensor,  # [R] bool
    k: int,
) -> Tensor:  # [] fp32
    """HASS top-K loss ``-sum_{v in top-K(q)} q(v) log p(v)``, masked mean over rows (design 0x07A).

    The target mass is *not* renormalised over the top-K set: with ``Z_K = sum_{top-K} q < 1``
    the loss is ``Z_K`` times the renormalised one, so omitted mass also scales the row's
    contribution. Ties at the K-th probability are broken by `torch.topk`.
    """
    _check_pair(draft_logits, "draft_logits", target_probs, "target_probs")
    vocab = draft_logits.shape[1]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= vocab:
        raise ValueError(f"k: must be an int in [1, V={vocab}], got {k!r}")
    index = _supervised_rows(mask, draft_logits.shape[0])
    log_p = F.log_softmax(draft_logits.index_select(0, index).to(LOSS_DTYPE), dim=-1)  # [M, V]
    q = target_probs.index_select(0, index).to(LOSS_DTYPE)  # [M, V]
    q_top, top_ids = q.topk(k, dim=-1)  # [M, k]
    return -(q_top * log_p.gather(-1, top_ids)).sum(dim=-1).mean()


# --------------------------------------------------------------------------------------------
# EAGLE-3 training-time test (design 0x08C)
# --------------------------------------------------------------------------------------------


def ttt_loss(
    step_losses: Sequence[Tensor],  # each [] L_s, the normalised loss of rollout step s
    decay: float = TTT_DECAY,
) -> Tensor:  # [] fp32
    """``L_E3 = sum_s decay**s * L_s`` over rollout steps ``s = 0, 1, ...`` (design 0x08C).

    Each ``L_s`` is already normalised by its own ``sum_t m_t^(s)``; no feature-regression addend.
    """
    if not isinstance(step_losses, Sequence) or len(step_losses) == 0:
        raise ValueError("step_losses: expected a non-empty sequence of scalar losses")
    if not (isinstance(decay, (int, float)) and decay > 0):
        raise ValueError(f"decay: must be a number > 0, got {decay!r}")
    total = _as_scalar(step_losses[0], "step_losses[0]")
    for s in range(1, len(step_losses)):
        total = total + float(decay) ** s * _as_scalar(step_losses[s], f"step_losses[{s}]")
    return total


def draft_vocab_targets(
    target_logits: Tensor,  # [R, V] target logits over the full vocabulary
    d2t: Tensor,  # [Vd] int64 target-vocabulary id of each draft-vocabulary slot
) -> Tensor:  # [R, Vd] fp32 probabilities over the draft vocabulary
    """Target distribution over the EAGLE-3 draft vocabulary (pinned implementation, design 0x08C).

    ``q_d(i) = softmax_i(target_logits[:, d2t])``: the target logits are *restricted* to the draft
    vocabulary and then softmaxed, i.e. the target mass is renormalised over the draft vocabulary,
    as the pinned code does. This is a pinned implementation contract, not the paper's definition.

    ``d2t`` here holds absolute target ids (the pinned checkpoint stores ``d2t`` as offsets
    ``target_id - draft_id``; convert before calling). The pinned code also drops rows whose
    full-vocabulary target argmax lies outside the draft vocabulary; see
    `target_argmax_in_draft_vocab`.
    """
    _check(target_logits, "target_logits", 2)
    _check_float(target_logits, "target_logits")
    check_d2t(d2t, target_logits.shape[1])
    restricted = target_logits.to(LOSS_DTYPE).index_select(-1, d2t)  # [R, Vd]
    return F.softmax(restricted, dim=-1)


def target_argmax_in_draft_vocab(
    target_logits: Tensor,  # [R, V]
    d2t: Tensor,  # [Vd] int64 absolute target ids
) -> Tensor:  # [R] bool
    """Whether each row's full-vocabulary target argmax is in the draft vocabulary.

    The pinned EAGLE-3 code multiplies its loss mask by this (its ``position_mask``); AND it into
    ``mask`` to reproduce that choice.
    """
    _check(target_logits, "target_logits", 2)
    _check_float(target_logits, "target_logits")
    vocab = target_logits.shape[1]
    check_d2t(d2t, vocab)
    in_draft = torch.zeros(vocab, dtype=torch.bool, device=target_logits.device)  # [V] t2d
    in_draft[d2t] = True
    return in_draft[target_logits.argmax(dim=-1)]


# --------------------------------------------------------------------------------------------
# noise (design 0x04E)
# --------------------------------------------------------------------------------------------


def feature_noise(
    features: Tensor,  # [..., S, d]
    kind: str,
    generator: torch.Generator | None = None,
) -> Tensor:  # same shape, dtype and device as features
    """Additive training noise ``epsilon`` for ``f~ = f + epsilon`` (design 0x04E).

    - ``"paper"``: ``U(-0.1, 0.1)`` as the EAGLE paper reports;
    - ``"pinned"``: ``(rand - 0.5) * 0.2 * 512 / S`` with ``S = features.shape[-2]``, the pinned
      code's length-scaled draw; it equals the paper interval only at ``S = 512``;
    - ``"none"``: zeros.

    Drawn in fp32 from ``generator``, then cast to the features' dtype.
    """
    _check_float(features, "features")
    if features.ndim < 2:
        raise ValueError(f"features: expected [..., S, d], got shape {tuple(features.shape)}")
    if kind not in NOISE_KINDS:
        raise ValueError(f"noise: unknown kind {kind!r}; expected one of {NOISE_KINDS}")
    if kind == "none":
        return torch.zeros_like(features)
    uniform = torch.rand(  # drawn where the generator lives (the CPU by default), then moved
        features.shape,
        generator=generator,
        dtype=torch.float32,
        device=generator.device if generator is not None else features.device,
    ).to(features.device)  # [..., S, d] in [0, 1)
    half_width = PAPER_NOISE_HALF_WIDTH
    if kind == "pinned":
        seq = features.shape[-2]
        if seq == 0:
            return torch.zeros_like(features)
        half_width = PAPER_NOISE_HALF_WIDTH * PINNED_NOISE_REFERENCE_LENGTH / seq
    return ((uniform - 0.5) * (2.0 * half_width)).to(features.dtype)


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def topk_accuracy(
    draft_logits: Tensor,  # [R, V]
    target_probs: Tensor,  # [R, V] q
    mask: Tensor,  # [R] bool
    ks: Sequence[int] = (1, 3),
) -> dict[int, float]:
    """Fraction of masked rows whose target argmax is among the draft top-k, per ``k`` in ``ks``.

    Argmax ties in ``q`` resolve to the lowest id (`torch.argmax`); draft top-k ties per
    `torch.topk`.
    """
    _check_pair(draft_logits, "draft_logits", target_probs, "target_probs")
    vocab = draft_logits.shape[1]
    if len(ks) == 0:
        raise ValueError("ks: expected at least one k")
    for k in ks:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= vocab:
            raise ValueError(f"ks: every k must be an int in [1, V={vocab}], got {k!r}")
    index = _supervised_rows(mask, draft_logits.shape[0])
    target_ids = target_probs.index_select(0, index).to(LOSS_DTYPE).argmax(dim=-1)  # [M]
    logits = draft_logits.index_select(0, index).to(LOSS_DTYPE)  # [M, V]
    top_ids = logits.topk(max(ks), dim=-1).indices  # [M, max k], descending
    hits = top_ids == target_ids[:, None]  # [M, max k]
    return {k: float(hits[:, :k].any(dim=-1).to(LOSS_DTYPE).mean()) for k in ks}
