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
from dataclasses import dataclass

import torch

from eyas.protocol.schema import MAX_LOGIT_BIAS, MAX_PENALTY, MIN_TEMPERATURE
from eyas.protocol.wire import SessionSpec

TOP_K_OFF: int = 0  # top_k value meaning "no top-k truncation"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # finite, >= 0; 0 means greedy
    top_k: int = TOP_K_OFF  # int >= 0; TOP_K_OFF disables it
    top_p: float = 1.0  # in (0, 1]; 1.0 disables it
    # the logits processors (eyas.verification.processors): OpenAI's penalties over the answer so far,
    # vLLM's repetition penalty over prompt and answer, min-p, and a bias per token id
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1.0 disables it
    min_p: float = 0.0  # in [0, 1]; 0 disables it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids increasing
    # structured output: the grammar's key (eyas.verification.grammar.grammar_key; "" = none). Its
    # masks come from the request's GrammarCursor, which its session owns
    grammar: str = ""

    @classmethod
    def of(cls, request) -> SamplingParams:
        """The sampler of a request: a ``GenerateRequest`` or a ``SessionSpec`` (the one conversion)."""
        from eyas.verification.grammar import grammar_key

        bias = request.logit_bias
        grammar = request.grammar if isinstance(request, SessionSpec) else grammar_key(request.response_format)
        return cls(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            min_p=request.min_p,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in (bias.items() if isinstance(bias, dict) else bias))),
            grammar=grammar,
        )

    @property
    def processes(self) -> bool:
        """Whether a logits processor changes the logits (eyas.verification.processors)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature: expected a number, got {self.temperature!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be finite and >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature: must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {self.temperature!r}")
        if type(self.top_k) is not int or self.top_k < 0:
            raise ValueError(f"top_k: must be an int >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p: expected a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise ValueError(f"{name}: must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}], got {v!r}")
        rp = self.repetition_penalty
        if isinstance(rp, bool) or not isinstance(rp, (int, float)) or not (math.isfinite(rp) and rp > 0):
            raise ValueError(f"repetition_penalty: must be a finite number > 0 (1 = off), got {rp!r}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be a number in [0, 1], got {self.min_p!r}")
        ids = [t for t, _ in self.logit_bias]
        if ids != sorted(set(ids)) or any(t < 0 for t in ids):
            raise ValueError("logit_bias: token ids must be distinct and >= 0")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias: every bias must lie in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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


def session_spec(
    request_id: str,
    prompt_ids,
    max_new_tokens: int,
    max_tree_rows: int,
    sampling: SamplingParams,
    seed: int,
    taps=(),
    logprobs: int | None = None,
    learn: bool = True,
) -> SessionSpec:
    """The target session a request opens (``wire.SessionSpec``), its sampler carried whole."""
    return SessionSpec(
        request_id=request_id,
        prompt_ids=tuple(prompt_ids),
        max_new_tokens=max_new_tokens,
        max_tree_rows=max_tree_rows,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=seed,
        taps=tuple(tuple(t) for t in taps),
        logprobs=logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        min_p=sampling.min_p,
        logit_bias=sampling.logit_bias,
        grammar=sampling.grammar,
        learn=learn,
    )
