"""Pydantic validation of what arrives at an edge: a client's generate and cancel requests.

Every violation becomes a ``ValueError`` whose message starts with the offending field's name,
so a CLI prints it and a gRPC server maps it to ``INVALID_ARGUMENT`` unchanged.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from eyas.protocol.sampling_params import SamplingParams

# hass: an EAGLE-1-architecture drafter trained with HASS; suffix: drafts from the request's own prompt
# and answer alone (eyas.drafting.suffix), no drafter model
METHODS = ("target", "eagle1", "hass", "eagle3", "suffix")
# GenerateRequest's fields that say how a request is decoded, not what it asks for (Eyas's own knobs: an
# OpenAI body carries them as extras, eyas.serve.openai_api)
DECODING_FIELDS = (
    "method",
    "suffix_drafts",
    "learn",
    "tree_kind",
    "tree_depth",
    "tree_width",
    "tree_budget",
    "tree_min_value",
    "tree_expand_min_value",
)


MAX_REQUEST_ID_LEN: int = 256  # a request id (``request_id``) is 1 to this many characters
MAX_LOGPROBS: int = 20  # top alternatives per token a request may ask for (OpenAI's bound)
MAX_PENALTY: float = 2.0  # presence_penalty / frequency_penalty lie in [-2, 2] (OpenAI's bound)
MAX_LOGIT_BIAS: float = 100.0  # a logit_bias entry lies in [-100, 100] (OpenAI's bound)
MAX_LOGIT_BIAS_ENTRIES: int = 1024  # token ids one request may bias
MAX_STOP_TOKEN_IDS: int = 64  # stop_token_ids one request may give
CHOICE_SEP = "#"  # choice i > 0 of a named OpenAI request with n > 1 runs as <request_id>#<i>
# The smallest non-zero temperature (vLLM's threshold too): below it logits / T overflows fp32 for
# ordinary logits (1e-300 is 0 in fp32), and the served distribution is the argmax's in all but name.
MIN_TEMPERATURE: float = 1e-2
INT32_MAX: int = 2**31 - 1  # the wire's int32 fields (max_new_tokens, top_k, prompt_ids, tree knobs)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the wire's int64 seed
# Tree knobs past these are refused at the front door: no drafter here is trained past a handful of
# steps, and a verify of more rows than MAX_TREE_BUDGET costs more than any speculation could repay.
MAX_TREE_DEPTH: int = 32
MAX_TREE_WIDTH: int = 64
MAX_TREE_BUDGET: int = 512


def request_id_problem(value: str) -> str | None:
    """Why ``value`` is not a request id (1 to MAX_REQUEST_ID_LEN characters, not blank), or None.
    The one rule for every edge: client requests here, Verifier messages in ``wire.check_request_id``."""
    if not value.strip() or len(value) > MAX_REQUEST_ID_LEN:
        return (
            f"must be a non-empty string of at most {MAX_REQUEST_ID_LEN} characters, "
            f"got {value[:40]!r}{'...' if len(value) > 40 else ''} ({len(value)} characters)"
        )
    return None


def _request_id(v: str | None, required: bool) -> str | None:
    if v is None or (not v and not required):
        return v
    problem = request_id_problem(v)
    if problem:
        raise ValueError(f"request_id: {problem}")
    return v


MAX_MESSAGES = 1024  # turns in one request's conversation


class ChatTurn(BaseModel):
    """One turn of a request's conversation (``GenerateRequest.messages``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class GenerateRequest(BaseModel):
    """A client's request. Types are strict (``"max_new_tokens": true`` or ``"raw": "yes"`` are
    refused, not coerced; an int is accepted where a float is asked); every bound is checked here,
    before any replica does work, and a violation names the field."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    # a conversation instead of prompt / prompt_ids, templated by the target tokenizer's chat template
    messages: list[ChatTurn] | None = None
    raw: bool = False  # False: wrap the prompt in the chat template
    method: str = "eagle3"
    # graft suffix drafts (continuations of what the prompt and answer already hold) into the drafter's
    # tree, verified in the same forward (eyas.drafting.suffix); method "suffix" drafts with them alone
    suffix_drafts: bool = False
    # the answer may teach the drafter where the app learns online (eyas.learning; config learn.enabled,
    # off by default); false: nothing of this request is kept
    learn: bool = True
    max_new_tokens: int = 128
    # vLLM's ignore_eos: the answer does not end at the target's end-of-sequence tokens (they are emitted
    # like any other token) but at max_new_tokens or a stop string
    ignore_eos: bool = False
    # vLLM's stop_token_ids: token ids that end the answer like an end-of-sequence token (emitted, then done)
    stop_token_ids: list[int] = Field(default_factory=list)
    # vLLM's min_tokens: no end-of-sequence or stop token id can be drawn, and no stop string ends the
    # answer, before it holds this many tokens (0: off); at most max_new_tokens
    min_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = Field(default_factory=list)
    request_id: str | None = None
    drafter: str | None = None  # a drafter checkpoint folder; default: the shipped one
    tree_kind: Literal["dynamic", "static", "chain"] = "dynamic"
    tree_depth: int | None = None
    tree_width: int | None = None
    tree_budget: int | None = None
    # cost-aware dynamic trees: path-value floors of a verified and of an expanded node, in [0, 1]
    # (eyas.drafting.tree, "value floors"); default: the drafter's default tree's
    tree_min_value: float | None = None
    tree_expand_min_value: float | None = None
    # each emitted token's log-probability under the target's raw distribution (before temperature and
    # top-k/top-p: vLLM's default "raw_logprobs"), with this many top alternatives; None: none
    logprobs: int | None = None
    # the logits processors (eyas.verification.processors), applied by the target to every verify row
    # with that row's own history (the answer so far and its path in the tree): OpenAI's presence and
    # frequency penalties (over the answer), vLLM's repetition penalty (over prompt and answer) and
    # min_p, and a bias added to the logit of each token id given
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    # structured output (eyas.verification.grammar): OpenAI's response_format, kept in its canonical
    # form ({"type": "json_object"} or {"type": "json_schema", "schema": {...}}; None: text)
    response_format: dict | None = None

    @field_validator("response_format", mode="before")
    @classmethod
    def _format(cls, v):
        from eyas.protocol.response_format import canonical_response_format

        return canonical_response_format(v)  # a ValueError names response_format (or its nested field)

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v):  # JSON object keys arrive as strings: "50256" is token 50256
        if isinstance(v, dict):
            out = {}
            for k, b in v.items():
                if isinstance(k, str):
                    if not k.strip().isdigit():
                        raise ValueError(f"logit_bias: keys are token ids, got {k[:40]!r}")
                    k = int(k)
                out[k] = b
            return out
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} token ids, got {len(v)}")
        for token, bias in v.items():
            if not 0 <= token <= INT32_MAX:
                raise ValueError(f"token ids must be >= 0, got {token}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(
                    f"token {token}: a bias must lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                )
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        if len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} token ids, got {len(v)}")
        if any(not 0 <= t <= INT32_MAX for t in v):
            raise ValueError("token ids must be >= 0 (and fit in 32 bits)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v):
        if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            raise ValueError(f"must lie in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v}")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition(cls, v):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"must be a finite number > 0 (1 = off), got {v}")
        return v

    @field_validator("min_p")
    @classmethod
    def _min_p(cls, v):
        if not 0 <= v <= 1:
            raise ValueError(f"must lie in [0, 1], got {v}")
        return v

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        if v not in METHODS:
            raise ValueError(f"unknown method {v!r}; expected one of {METHODS}")
        return v

    @field_validator("request_id")
    @classmethod
    def _named(cls, v):
        return _request_id(v, required=False)  # unset or "": the server names the request

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v):
        if not 0 <= v <= INT32_MAX:
            raise ValueError(f"must be >= 0 (0 = off) and <= {INT32_MAX}, got {v}")
        return v

    @model_validator(mode="after")
    def _min_tokens_fit(self):
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is more than max_new_tokens {self.max_new_tokens}")
        if self.min_tokens and self.response_format is not None:
            raise ValueError("min_tokens: not with response_format (a finished structure allows only the answer's end)")
        return self

    @field_validator("max_new_tokens")
    @classmethod
    def _max_new(cls, v):
        if not 1 <= v <= INT32_MAX:
            raise ValueError(f"must be >= 1 and <= {INT32_MAX}, got {v}")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v):
        if not INT64_MIN <= v <= INT64_MAX:
            raise ValueError(f"must fit in 64 signed bits, got {v}")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"must be a finite number >= 0, got {v}")
        if 0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {v}")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v):
        if not (0 < v <= 1):
            raise ValueError(f"must lie in (0, 1], got {v}")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise ValueError(f"must be between 0 and {MAX_LOGPROBS} (top alternatives per token), got {v}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v):
        if not 0 <= v <= INT32_MAX:
            raise ValueError(f"must be >= 0 (0 = off) and <= {INT32_MAX}, got {v}")
        return v

    @field_validator("tree_depth", "tree_budget", "tree_width")
    @classmethod
    def _tree_knob(cls, v, info):
        if v is None:
            return v
        low, high = {
            "tree_depth": (0, MAX_TREE_DEPTH),
            "tree_budget": (0, MAX_TREE_BUDGET),
            "tree_width": (1, MAX_TREE_WIDTH),
        }[info.field_name]
        if not low <= v <= high:
            raise ValueError(f"must be >= {low} and <= {high}, got {v}")
        return v

    @field_validator("tree_min_value", "tree_expand_min_value")
    @classmethod
    def _tree_floor(cls, v):
        if v is not None and not (math.isfinite(v) and 0 <= v <= 1):
            raise ValueError(f"must be a path value in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _suffix(self):
        if self.suffix_drafts and self.method in ("target", "suffix"):
            raise ValueError(
                f"suffix_drafts: grafts suffix drafts into a drafter's tree; method {self.method!r} has none "
                "(use method 'suffix' for suffix drafts alone)"
            )
        return self

    @model_validator(mode="after")
    def _prompt(self):
        if self.messages is not None:
            if self.prompt is not None or self.prompt_ids is not None:
                raise ValueError("messages: give one of prompt, prompt_ids and messages")
            if not 1 <= len(self.messages) <= MAX_MESSAGES:
                raise ValueError(f"messages: must hold 1 to {MAX_MESSAGES} turns, got {len(self.messages)}")
            if self.raw:
                raise ValueError("raw: a message list is always templated; send prompt with raw instead")
            if self.messages[-1].role != "user":
                raise ValueError(
                    f"messages.{len(self.messages) - 1}.role: the last turn must be the user's, "
                    f"got {self.messages[-1].role!r}"
                )
            for i, turn in enumerate(self.messages):
                if turn.role == "user" and not turn.content.strip():
                    raise ValueError(f"messages.{i}.content: a user turn must not be blank")
            return self
        if self.prompt_ids is not None:
            if self.prompt is not None:
                raise ValueError("prompt_ids: give prompt or prompt_ids, not both")
            if not self.prompt_ids:
                raise ValueError("prompt_ids: must hold at least one token")
            if any(not 0 <= t <= INT32_MAX for t in self.prompt_ids):
                raise ValueError("prompt_ids: token ids must be >= 0 (and fit in 32 bits)")
        elif self.prompt is None or not self.prompt.strip():
            raise ValueError("prompt: must be a non-empty string (or give prompt_ids)")
        return self

    def to_sampling_params(self, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
        """The sampler this request asks for: the one conversion from a request to its sampler (its
        fields were checked here; ``SamplingParams`` checks them again only for direct callers).
        ``stop_ids``: the ids that end this request's answer (``eyas.generate.stop_ids_for``), which
        ``min_tokens`` masks while the answer is shorter."""
        from eyas.protocol.response_format import grammar_key
        from eyas.protocol.sampling_params import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            min_p=self.min_p,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items())),
            grammar=grammar_key(self.response_format),
            min_tokens=self.min_tokens,
            min_tokens_stop_ids=tuple(int(t) for t in stop_ids) if self.min_tokens else (),
        )


class CancelRequest(BaseModel):
    """Stop the in-flight request the client named ``request_id`` (the ``Cancel`` RPC)."""

    model_config = ConfigDict(extra="forbid")

    request_id: str

    @field_validator("request_id")
    @classmethod
    def _named(cls, v):
        return _request_id(v, required=True)


def parse_request(**fields) -> GenerateRequest:
    """Validate ``fields``; raise ``ValueError("<field>: <why>")`` on the first violation."""
    return _parse(GenerateRequest, fields)


def parse_cancel(**fields) -> CancelRequest:
    """Like :func:`parse_request`, for a ``Cancel``."""
    return _parse(CancelRequest, fields)


def _parse(model, fields: dict):
    try:
        return model(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "request"
        msg = first["msg"].removeprefix("Value error, ")
        if msg.startswith(field + ":") or ":" in msg.split(" ")[0]:
            raise ValueError(msg) from None
        raise ValueError(f"{field}: {msg}") from None
