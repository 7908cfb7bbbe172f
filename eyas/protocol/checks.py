"""Boundary checks on tensors shared by every module that takes tensors in (a ValueError names the field)."""

from __future__ import annotations

import torch
from torch import Tensor


def check_in_vocab(tokens, vocab_size: int, name: str) -> None:
    """Every id in ``tokens`` lies in ``[0, vocab_size)``; the error starts with ``name``."""
    bad = [int(t) for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name}: token ids {bad[:5]} lie outside the vocabulary [0, {vocab_size})")


def check_tensor(value: object, name: str, ndim: int, dtype: torch.dtype | None = None) -> Tensor:
    """``value`` must be a ``ndim``-D tensor (of ``dtype`` when given); the error starts with ``name``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(value.shape)}")
    if dtype is not None and value.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {value.dtype}")
    return value
