"""The sampler a request asks for: temperature, top-k, top-p, the logits processors' knobs and the
structured-output grammar's key, as one frozen value (``SamplingParams``). A ``GenerateRequest``
makes it (``GenerateRequest.to_sampling_params``), a target session carries it whole
(``wire.SessionSpec.sampling``), and ``eyas.verification`` computes the served distribution from it.

Terms (the served distribution itself is defined in ``eyas.verification.sampling``): **greedy** is
temperature 0; ``TOP_K_OFF`` (0), ``top_p`` 1.0, ``min_p`` 0, ``repetition_penalty`` 1.0 and zero
penalties switch their step off. **min_tokens** (vLLM's): while an answer is shorter than it, the
ids that would end it (``min_tokens_stop_ids``: the target's end-of-sequence ids unless ``ignore_eos``,
and the request's ``stop_token_ids``) cannot be drawn; 0 switches it off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eyas.protocol.schema import MAX_LOGIT_BIAS, MAX_PENALTY, MIN_TEMPERATURE

TOP_K_OFF: int = 0  # top_k value meaning "no top-k truncation"


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampler (the module docstring's terms); checked when built, a ``ValueError`` naming
    the field."""

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
    # structured output: the grammar's key (eyas.protocol.response_format.grammar_key; "" = none). Its
    # masks come from the request's GrammarCursor, which its session owns
    grammar: str = ""
    # vLLM's min_tokens: the ids that would end the answer are masked while it is shorter than this
    min_tokens: int = 0  # >= 0; 0 disables it
    min_tokens_stop_ids: tuple[int, ...] = ()  # the ids masked meanwhile (eyas.generate.stop_ids_for's)

    @property
    def processes(self) -> bool:
        """Whether a logits processor changes the logits (eyas.verification.processors)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.holds_stops
        )

    @property
    def holds_stops(self) -> bool:
        """Whether min_tokens masks the answer's stop ids at some length."""
        return self.min_tokens > 0 and bool(self.min_tokens_stop_ids)

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
        if type(self.min_tokens) is not int or self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be an int >= 0 (0 = off), got {self.min_tokens!r}")
        if any(type(t) is not int or t < 0 for t in self.min_tokens_stop_ids):
            raise ValueError("min_tokens_stop_ids: token ids must be ints >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
