"""The target distribution "as served": the logits processors (``processors.py``: logit bias, then
the repetition, frequency and presence penalties), then temperature, min-p, top-k and top-p, in fp32.

Exact speculative acceptance preserves whatever distribution the server would otherwise sample
from, so acceptance (`accept.py`) and plain sampling must both read it from `target_probs`.

Terms:

- **greedy**: temperature 0. The served distribution is the one-hot of the argmax (the first
  maximal index on ties), whatever top-k and top-p say.
- **top-k** (0 = off): keep the tokens whose logit is >= the k-th largest logit. Tokens tied with
  the k-th largest are all kept, so the kept set can exceed k on exact ties.
- **min-p** (0 = off): after temperature, drop the tokens whose probability is below min_p times
  the largest (vLLM's ``min_p``); the argmax is always kept, so greedy decoding ignores it.
- **top-p** (1.0 = off): after top-k, keep the smallest set of most probable tokens whose mass is
  >= top_p (a token is dropped when the mass strictly before it in descending order already
  reaches top_p); the argmax is always kept.
"""

from __future__ import annotations

import math

import torch

from eyas.protocol.sampling_params import TOP_K_OFF, SamplingParams


def target_probs(
    logits: torch.Tensor,  # [R, V] float (any floating dtype; computed in fp32)
    params: SamplingParams,
) -> torch.Tensor:  # [R, V] float32, rows sum to 1
    """The served distribution of each row: one-hot argmax if greedy, else T -> min-p -> top-k ->
    top-p. ``logits`` are the processed ones (``processors.processed_logits``) where a processor is on."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ValueError("logits: expected a 2-D tensor [R, V]")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits: expected a floating dtype, got {logits.dtype}")
    if logits.shape[1] < 1:
        raise ValueError("logits: vocabulary dimension is empty")
    if bool(torch.isnan(logits).any()):
        raise ValueError("logits: contain NaN")
    logits = logits.float()

    if params.greedy:
        probs = torch.zeros_like(logits)
        probs.scatter_(1, logits.argmax(dim=1, keepdim=True), 1.0)
        return probs

    scaled = logits / params.temperature
    vocab = scaled.shape[1]
    if params.min_p > 0:  # p < min_p * p_max  <=>  scaled < max + log(min_p): no softmax needed
        floor = scaled.max(dim=1, keepdim=True).values + math.log(params.min_p)  # [R, 1]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    if params.top_k != TOP_K_OFF and params.top_k < vocab:
        kth_largest = torch.topk(scaled, params.top_k, dim=1).values[:, -1:]  # [R, 1]
        scaled = scaled.masked_fill(scaled < kth_largest, float("-inf"))
    probs = torch.softmax(scaled, dim=1)

    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=1) - sorted_probs  # [R, V]
        drop_sorted = mass_before >= params.top_p
        drop_sorted[:, 0] = False  # the argmax is always kept (a top_p below fp32's range compares as 0)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=1, keepdim=True)
    return probs


def sample(
    probs: torch.Tensor,  # [V] or [R, V] float, nonnegative, positive mass per row
    generator: torch.Generator | None,
) -> torch.Tensor:  # [] or [R] int64 on probs.device
    """Draw one token per row with torch.multinomial, on the generator's device (a CPU generator
    draws CUDA probabilities on the host: the same draws for a seed on every device)."""
    if not isinstance(probs, torch.Tensor) or probs.ndim not in (1, 2):
        raise ValueError("probs: expected a tensor [V] or [R, V]")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"probs: expected a floating dtype, got {probs.dtype}")
    rows = probs.reshape(-1, probs.shape[-1])
    if rows.shape[1] < 1:
        raise ValueError("probs: vocabulary dimension is empty")
    if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
        raise ValueError("probs: entries must be finite and nonnegative")
    if bool((rows.sum(dim=1) <= 0).any()):
        raise ValueError("probs: every row needs positive mass")
    where = generator.device if generator is not None else rows.device
    tokens = torch.multinomial(rows.to(where), 1, generator=generator).squeeze(1).to(probs.device)  # [R]
    return tokens[0] if probs.ndim == 1 else tokens
