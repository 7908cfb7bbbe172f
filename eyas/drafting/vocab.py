"""The EAGLE-3 draft vocabulary (design 0x08C): ``d2t [Vd]``, the target id of each draft id (a
drafter's head scores only these tokens). Built from token counts, trimmed to its most frequent
tokens, and a head's rows carried over when it is rebuilt: tensors in, tensors out.
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.protocol.checks import check_tensor as _check


def check_d2t(d2t: Tensor, vocab: int) -> None:
    """A draft vocabulary ``d2t`` [Vd] int64 of target ids in [0, vocab), refused naming ``d2t``."""
    _check(d2t, "d2t", 1)
    if d2t.dtype != torch.int64:
        raise ValueError(f"d2t: expected dtype torch.int64, got {d2t.dtype}")
    if d2t.numel() == 0:
        raise ValueError("d2t: the draft vocabulary is empty")
    if int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
        raise ValueError(f"d2t: ids must lie in [0, V={vocab})")


def build_draft_vocab(
    token_counts: Tensor,  # [V] int64 occurrences of each target token in the training data
    size: int,
) -> Tensor:  # [size] int64 d2t, ascending target ids
    """The ``size`` most frequent training tokens, ties broken by the lower id, sorted ascending.

    If fewer than ``size`` tokens occur, the rest are the lowest-id zero-count tokens (the
    vocabulary always has exactly ``size`` entries).
    """
    _check(token_counts, "token_counts", 1)
    if token_counts.dtype != torch.int64:
        raise ValueError(f"token_counts: expected dtype torch.int64, got {token_counts.dtype}")
    vocab = token_counts.shape[0]
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= vocab:
        raise ValueError(f"size: must be an int in [1, V={vocab}], got {size!r}")
    if vocab and int(token_counts.min()) < 0:
        raise ValueError("token_counts: counts must be >= 0")
    # stable descending sort keeps equal counts in ascending id order
    order = torch.sort(token_counts, descending=True, stable=True).indices
    return torch.sort(order[:size]).values


def trim_draft_vocab(
    d2t: Tensor,  # [Vd] int64 target ids of a draft vocabulary
    token_counts: Tensor,  # [V] int64 occurrences of each target token in the training data
    size: int,
) -> Tensor:  # [size] int64 the kept target ids, ascending
    """The ``size`` most frequent tokens *of the draft vocabulary* ``d2t`` (ties broken by the lower
    target id), sorted ascending: a smaller vocabulary whose every token the drafter was trained on,
    so its head rows carry over unchanged (:func:`carry_rows`) and nothing is retrained."""
    _check(token_counts, "token_counts", 1)
    if token_counts.dtype != torch.int64:
        raise ValueError(f"token_counts: expected dtype torch.int64, got {token_counts.dtype}")
    check_d2t(d2t, token_counts.shape[0])
    if d2t.unique().numel() != d2t.numel():
        raise ValueError("d2t: draft ids must map to distinct target ids")
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= d2t.shape[0]:
        raise ValueError(f"size: must be an int in [1, Vd={d2t.shape[0]}], got {size!r}")
    ids = torch.sort(d2t).values  # [Vd] ascending, so the stable sort below breaks ties by the lower id
    order = torch.sort(token_counts[ids], descending=True, stable=True).indices  # [Vd]
    return torch.sort(ids[order[:size]]).values


NOT_IN_OLD_VOCAB = -1  # carry_rows: a target token the old draft vocabulary lacks


def carry_rows(
    old_d2t: Tensor,  # [Vo] int64 target ids of the old draft vocabulary
    old_rows: Tensor,  # [Vo, ...] one row per old draft id (head weights, an optimizer moment)
    new_d2t: Tensor,  # [Vn] int64 target ids of the new draft vocabulary
    fill: Tensor,  # [Vn, ...] the rows of the new vocabulary's tokens that the old one lacks
) -> Tensor:  # [Vn, ...] old_rows' dtype
    """Rows indexed by draft id, moved to a rebuilt draft vocabulary: a target token in both
    vocabularies keeps its old row; every other new row is taken from ``fill``."""
    if old_rows.dim() < 1 or old_rows.shape[0] != old_d2t.shape[0]:
        raise ValueError(f"old_rows: expected a row per old draft id ({old_d2t.shape[0]}), got {list(old_rows.shape)}")
    if tuple(fill.shape) != (new_d2t.shape[0], *old_rows.shape[1:]):
        raise ValueError(f"fill: expected [{new_d2t.shape[0]}, {list(old_rows.shape[1:])}], got {list(fill.shape)}")
    vocab = int(max(int(old_d2t.max()), int(new_d2t.max()))) + 1
    check_d2t(old_d2t, vocab)
    check_d2t(new_d2t, vocab)
    old_slot = torch.full((vocab,), NOT_IN_OLD_VOCAB, dtype=torch.int64, device=old_d2t.device)  # [V] old draft id
    old_slot[old_d2t] = torch.arange(old_d2t.shape[0], device=old_d2t.device)
    slot = old_slot[new_d2t]  # [Vn]
    kept = slot != NOT_IN_OLD_VOCAB
    out = fill.to(old_rows.dtype).clone()
    out[kept] = old_rows[slot[kept]]
    return out


def rebuilt_head(
    old_d2t: Tensor,  # [Vo] int64
    old_head: Tensor,  # [Vo, d] the drafter's head rows
    new_d2t: Tensor,  # [Vn] int64
    target_head: Tensor,  # [V, d] the frozen target's LM-head rows
) -> Tensor:  # [Vn, d] float32
    """The EAGLE-3 draft head for a rebuilt draft vocabulary (``carry_rows``): a token the old
    vocabulary had keeps its trained row; a new token starts at its target LM-head row taken into
    the drafter's head space by the linear map ``W [d, d]`` that best takes the target's rows of the
    kept tokens to the drafter's (least squares, ``argmin_W ||T_kept W - H_kept||``). Without any
    kept token the new rows are the target's own."""
    _check(old_head, "old_head", 2)
    _check(target_head, "target_head", 2)
    if old_head.shape[1] != target_head.shape[1]:
        raise ValueError(f"target_head: width {target_head.shape[1]} != the draft head's {old_head.shape[1]}")
    old_t = old_head.float()
    target_t = target_head.float()
    t2d_new = torch.zeros(target_head.shape[0], dtype=torch.bool, device=target_head.device)
    t2d_new[new_d2t] = True
    kept = t2d_new[old_d2t]  # [Vo] old rows whose token stays
    fill = target_t[new_d2t]  # [Vn, d]
    if int(kept.sum()) > 0:
        fit = torch.linalg.lstsq(target_t[old_d2t[kept]], old_t[kept], driver="gelsd").solution  # [d, d]
        fill = fill @ fit
    return carry_rows(old_d2t, old_t, new_d2t, fill)
