"""The OpenAI-compatible front door of the Serve app: requests in, Eyas requests out, and back.

Pure translation, no Ray: :class:`EyasServer` (``eyas/serve/app.py``) routes ``/v1/*`` here, runs
the request like any other and hands the report back to be shaped as OpenAI's API shapes it.

Terms:
- *chat request*: ``POST /v1/chat/completions``; ``messages`` (system, user, assistant turns) are
  rendered with the target's own chat template, with the generation prompt added.
- *completion request*: ``POST /v1/completions``; ``prompt`` (one string) is fed as it is, as
  ``eyas generate --raw`` feeds it (the tokenizer's special tokens added, as vLLM does).
- *Eyas extension*: the extra body fields ``method``, ``tree_kind``, ``tree_depth``, ``tree_width``,
  ``tree_budget``, ``tree_min_value``, ``tree_expand_min_value``, ``top_k`` and ``request_id`` (the openai client's ``extra_body``), validated like
  every other field; and the response's ``eyas`` object: per-request speculative statistics in the
  vocabulary of vLLM's spec-decode metrics (:func:`spec_stats`).
- Every refusal is an :class:`OpenAIError`: status 400 with ``{"error": {"message", "type", "param",
  "code"}}`` naming the parameter; 404 for an unknown model; 401 for a missing or wrong API key.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eyas.generate import FINISH_LENGTH
from eyas.protocol.schema import CHOICE_SEP, DECODING_FIELDS, MAX_LOGPROBS, GenerateRequest, parse_request
from eyas.protocol.text import Detokenizer, token_bytes
from eyas.serve.errors import Failure, NotFound, Unauthenticated, failure_of
from eyas.target.loader import encode_messages, encode_prompt

CHAT, COMPLETION = "chat.completion", "text_completion"
# Eyas's own request fields, and vLLM's extras Eyas takes beside OpenAI's, that an OpenAI body may carry
EYAS_EXTRAS = (*DECODING_FIELDS, "top_k", "request_id", "ignore_eos", "stop_token_ids", "min_tokens")
# OpenAI parameters Eyas knows and does not implement: refused by name, never ignored
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "audio",
    "modalities",
    "prediction",
    "best_of",
    "echo",
    "suffix",
    "reasoning_effort",
    "web_search_options",
    "service_tier",
    "store",
    "metadata",
)
MAX_CHOICES = 16  # n: choices of one prompt a request may ask for
MAX_COMPLETION_LOGPROBS = 5  # /v1/completions' logprobs (OpenAI's bound there; chat's top_logprobs: 20)
DEFAULT_MAX_TOKENS = 128  # no max_tokens and no known context (a server always knows its target's)
DEFAULT_METHOD = "eagle3"  # when it names no Eyas method
# Eyas's names -> the OpenAI parameter a validation error should name
PARAM_OF_FIELD = {"max_new_tokens": "max_tokens", "prompt_ids": "messages", "prompt": "prompt"}


class OpenAIError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def of(cls, failure: Failure, param: str | None = None) -> OpenAIError:
        """A failure from the one table (``eyas.serve.errors``) in OpenAI's shape."""
        return cls(
            failure.message, param=param, status=failure.http_status, type_=failure.openai_type, code=failure.code
        )


def param_of(message: str) -> str:
    """The OpenAI parameter that Eyas's own ``"<field>: <why>"`` refusal names."""
    field = message.split(":", 1)[0]
    return PARAM_OF_FIELD.get(field, field)


def invalid(message: str) -> OpenAIError:
    """A 400 for Eyas's own ``"<field>: <why>"`` refusal, ``param`` naming the OpenAI parameter."""
    return OpenAIError(message, param=param_of(message))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias
    # structured output: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema":
    # {"name": ..., "schema": {...}}}, checked (and the schema compiled) by the request model
    response_format: dict | None = None
    # vLLM's sampling extras (extra_body)
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    ignore_eos: bool | None = None  # the answer runs on past end-of-sequence tokens to max_tokens
    stop_token_ids: list[int] | None = None  # token ids that end the answer like end-of-sequence
    min_tokens: int | None = None  # no end of the answer (stop ids or strings) before this many tokens
    # the Eyas extension (extra_body)
    method: str | None = None
    suffix_drafts: bool | None = None
    learn: bool | None = None  # false: this request's answer never teaches the drafter (eyas.learning)
    tree_kind: str | None = None
    tree_depth: int | None = None
    tree_width: int | None = None
    tree_budget: int | None = None
    tree_min_value: float | None = None
    tree_expand_min_value: float | None = None
    top_k: int | None = None
    request_id: str | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class CompletionRequest(_Common):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)


@dataclass(frozen=True)
class OpenAIRequest:
    """A parsed OpenAI request: what Eyas runs, and how the answer goes back."""

    kind: str  # CHAT or COMPLETION
    request: GenerateRequest
    prompt_ids: list[int]
    model: str
    stream: bool
    include_usage: bool
    n: int = 1  # choices of the one prompt, each with its own seed (choice i: seed + i)
    tokenizer: object = None  # renders logprobs' tokens


def choice_requests(req: GenerateRequest, n: int) -> list[GenerateRequest]:
    """A request's n choices as requests: choice i draws with ``seed + i`` and, when the request is
    named, is named ``<request_id>#<i>`` (a named cancel of ``request_id`` stops every choice)."""
    return [
        req.model_copy(
            update={
                "seed": (req.seed + i) % 2**63,
                "request_id": f"{req.request_id}{CHOICE_SEP}{i}" if req.request_id and i else req.request_id,
            }
        )
        for i in range(n)
    ]


def _pydantic_error(err: ValidationError) -> OpenAIError:
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    if first["type"] == "extra_forbidden":
        where = ".".join(loc)
        return OpenAIError(f"{where}: is not a parameter Eyas supports", param=where, code="unsupported_parameter")
    return OpenAIError(f"{'.'.join(loc)}: {first['msg']}", param=".".join(loc) or None)


def model_not_found(asked: str, served: str) -> OpenAIError:
    """The 404 for a model this server does not serve (the table's ``NotFound`` row)."""
    return OpenAIError.of(
        failure_of(NotFound(f"model: {asked!r} does not exist; this server serves {served!r}")), param="model"
    )


def check_api_key(expected: str | None, authorization: str | None) -> None:
    """Refuse (401) unless ``authorization`` is ``Bearer <expected>``; compared in constant time.
    No key configured: everything passes. Neither key appears in the error."""
    if not expected:
        return
    given = (authorization or "").removeprefix("Bearer ").strip() if (authorization or "").startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise OpenAIError.of(
            failure_of(Unauthenticated("Incorrect or missing API key: send 'Authorization: Bearer <key>'"))
        )


def parse_openai(kind: str, body: object, tokenizer, model_name: str, max_context: int | None = None) -> OpenAIRequest:
    """Validate an OpenAI body and turn it into the Eyas request it asks for. ``max_context``: the
    target's context; a request that gives no ``max_tokens`` may answer up to the end of it, as with
    OpenAI and vLLM (without it, :data:`DEFAULT_MAX_TOKENS`)."""
    if not isinstance(body, dict):
        raise OpenAIError("request: the body must be a JSON object")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise OpenAIError(f"{name}: is not supported by Eyas", param=name, code="unsupported_parameter")
    try:
        parsed = (ChatRequest if kind == CHAT else CompletionRequest).model_validate(
            {k: v for k, v in body.items() if k not in UNSUPPORTED}
        )
    except ValidationError as err:
        raise _pydantic_error(err) from None
    if parsed.model != model_name:
        raise model_not_found(parsed.model, model_name)
    if not 1 <= parsed.n <= MAX_CHOICES:
        raise OpenAIError(f"n: must be between 1 and {MAX_CHOICES}, got {parsed.n}", param="n")
    if parsed.stream_options is not None and not parsed.stream:
        raise OpenAIError("stream_options: only allowed with stream: true", param="stream_options")
    max_param = "max_tokens"
    if kind == CHAT:
        if parsed.max_tokens is not None and parsed.max_completion_tokens is not None:
            raise OpenAIError("max_tokens: give max_tokens or max_completion_tokens, not both", param="max_tokens")
        max_new = parsed.max_completion_tokens or parsed.max_tokens
        max_param = "max_completion_tokens" if parsed.max_completion_tokens is not None else "max_tokens"
        prompt_ids = render_messages(tokenizer, parsed.messages)
    else:
        if not parsed.prompt.strip():
            raise OpenAIError("prompt: must be a non-empty string", param="prompt")
        prompt_ids = encode_prompt(tokenizer, parsed.prompt, raw=True)  # as `eyas generate --raw` feeds it
        if not prompt_ids:
            raise OpenAIError("prompt: encodes to no token", param="prompt")
        max_new = parsed.max_tokens
    stop = [parsed.stop] if isinstance(parsed.stop, str) else list(parsed.stop or [])
    if kind == CHAT:
        if parsed.top_logprobs is not None and not parsed.logprobs:
            raise OpenAIError("top_logprobs: only with logprobs: true", param="top_logprobs")
        logprobs = (parsed.top_logprobs or 0) if parsed.logprobs else None
    else:
        logprobs = parsed.logprobs
    fields = {
        "prompt_ids": prompt_ids,
        "max_new_tokens": max_new if max_new is not None else default_max_tokens(len(prompt_ids), max_context),
        "temperature": parsed.temperature,
        "top_p": parsed.top_p,
        "stop": stop,
        "method": parsed.method or DEFAULT_METHOD,
        "logprobs": logprobs,
        "presence_penalty": parsed.presence_penalty,
        "frequency_penalty": parsed.frequency_penalty,
        "repetition_penalty": parsed.repetition_penalty,
        "min_p": parsed.min_p,
        "logit_bias": parsed.logit_bias or {},
        "response_format": parsed.response_format,
    }
    # no seed: a fresh one, as OpenAI and vLLM draw (reported in the response's eyas.seed, to replay it)
    fields["seed"] = parsed.seed if parsed.seed is not None else secrets.randbits(63)
    fields.update({k: getattr(parsed, k) for k in EYAS_EXTRAS if k != "method" and getattr(parsed, k) is not None})
    try:
        req = parse_request(**fields)
    except ValueError as err:
        field = str(err).split(":", 1)[0]
        param = max_param if field == "max_new_tokens" else PARAM_OF_FIELD.get(field, field)
        if kind == COMPLETION and field == "prompt_ids":
            param = "prompt"
        raise OpenAIError(
            f"{param}:{str(err).split(':', 1)[1]}" if ":" in str(err) else str(err), param=param
        ) from None
    if req.logit_bias and max(req.logit_bias) >= len(tokenizer):  # the keys are checked by the request model
        raise OpenAIError(
            f"logit_bias: {max(req.logit_bias)} is not a token id of this model (0 to {len(tokenizer) - 1})",
            param="logit_bias",
        )
    return OpenAIRequest(
        kind=kind,
        request=req,
        prompt_ids=prompt_ids,
        model=model_name,
        stream=parsed.stream,
        include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
        n=parsed.n,
        tokenizer=tokenizer,
    )


def default_max_tokens(prompt_tokens: int, max_context: int | None) -> int:
    """What a request without ``max_tokens`` may answer: the rest of the target's context (one slot is
    the frontier token's; at least 1, so that a prompt that fills the context is refused naming it)."""
    if max_context is None:
        return DEFAULT_MAX_TOKENS
    return max(max_context - prompt_tokens - 1, 1)


def render_messages(tokenizer, messages: list[Message]) -> list[int]:
    """Token ids of a conversation through the tokenizer's own chat template (generation prompt added)."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            "messages: the target's tokenizer has no chat template; use /v1/completions", param="messages"
        )
    return encode_messages(tokenizer, turns)


# --- responses -----------------------------------------------------------------------------------------
def finish_reason(eyas_reason: str) -> str:
    return "length" if eyas_reason == FINISH_LENGTH else "stop"


def spec_stats(report: dict) -> dict:
    """Per-request speculative statistics (vLLM's spec-decode names).

    A *speculative step* is a round that verified at least one drafted token. ``num_draft_tokens``
    counts the drafted tokens verified (tree nodes, the root excluded); ``num_accepted_tokens`` those
    accepted; ``acceptance_histogram[i]`` (``num_accepted_tokens_per_pos``) the steps that accepted a
    token at depth i+1; ``mean_acceptance_length`` = 1 + accepted / steps (the bonus token counted,
    as vLLM counts it); ``draft_acceptance_rate`` = accepted / drafted.
    """
    spec = [r for r in report.get("rounds", []) if r["tree_nodes"] > 0]
    drafted = sum(r["tree_nodes"] for r in spec)
    accepted = sum(r["accept_length"] for r in spec)
    depth = max((r["accept_length"] for r in spec), default=0)
    histogram = [sum(1 for r in spec if r["accept_length"] > i) for i in range(depth)]
    return {
        "method": report["method"],
        "num_spec_steps": len(spec),
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_histogram": histogram,
        "mean_acceptance_length": 1 + accepted / len(spec) if spec else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_target_forward": report["accept_length_mean"],
        "seed": report.get("seed"),  # the request's sampling seed (a fresh one when it gave none)
        "target_forwards": report["target_forwards"],
        "drafter_fallback": report["drafter_fallback"],
        "drafter_version": report.get("drafter_version"),
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` always (the prompt tokens the
    target's prefix cache supplied)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response(
    req: OpenAIRequest, response_id: str, created: int, reports: list[dict], logprobs: list[list] | None = None
) -> dict:
    """The non-streamed answer: one choice per report, in index order; ``logprobs``: each choice's
    emitted tokens' (see :func:`logprobs_object`), when the request asked for them."""
    choices = []
    for i, report in enumerate(reports):
        reason = finish_reason(report["finish_reason"])
        lp = logprobs_object(req, report["token_ids"], logprobs[i]) if logprobs is not None else None
        if req.kind == CHAT:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": report["text"]},
                    "finish_reason": reason,
                    "logprobs": lp,
                }
            )
        else:
            choices.append({"index": i, "text": report["text"], "finish_reason": reason, "logprobs": lp})
    return {
        "id": response_id,
        "object": req.kind,
        "created": created,
        "model": req.model,
        "choices": choices,
        "usage": choices_usage(req, reports),
        "eyas": choices_stats(reports),
    }


def logprobs_object(req: OpenAIRequest, token_ids: list[int], entries: list, offset: int = 0) -> dict:
    """OpenAI's logprobs of ``token_ids``, from the target's ``entries`` ((logprob, ((id, logprob), ...)) per
    token): chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or completions' ``{tokens,
    token_logprobs, top_logprobs, text_offset}`` (``offset``: the text before the first token)."""
    tok = req.tokenizer
    text = lambda t: tok.decode([t])  # noqa: E731 - a token alone (a partial character reads U+FFFD; bytes has it all)
    pairs = list(zip(token_ids, entries))
    if req.kind == CHAT:
        return {
            "content": [
                {
                    "token": text(t),
                    "logprob": lp,
                    "bytes": list(token_bytes(tok, t)),
                    "top_logprobs": [
                        {"token": text(a), "logprob": v, "bytes": list(token_bytes(tok, a))} for a, v in top
                    ],
                }
                for t, (lp, top) in pairs
            ],
            "refusal": None,
        }
    detok, offsets = Detokenizer(tok), []
    for t, _ in pairs:
        offsets.append(offset + len(detok.text))
        detok.push([t])
    return {
        "tokens": [text(t) for t, _ in pairs],
        "token_logprobs": [lp for _, (lp, _) in pairs],
        "top_logprobs": [{text(a): v for a, v in top} for _, (_, top) in pairs],
        "text_offset": offsets,
    }


def choices_usage(req: OpenAIRequest, reports: list[dict]) -> dict:
    """OpenAI's usage of n choices: the prompt counted once, every choice's tokens; cached_tokens: the
    prompt tokens the prefix cache supplied to choice 0 (the later choices reuse its prompt)."""
    return usage(len(req.prompt_ids), sum(r["new_tokens"] for r in reports), reports[0].get("cached_tokens", 0))


def choices_stats(reports: list[dict]) -> dict:
    """The eyas object: one choice's speculation, or with n > 1 each choice's under ``choices``."""
    if len(reports) == 1:
        return spec_stats(reports[0])
    return {"choices": [{**spec_stats(r), "cached_tokens": r.get("cached_tokens", 0)} for r in reports]}


def chunk(
    req: OpenAIRequest,
    response_id: str,
    created: int,
    text: str | None,
    reason: str | None,
    role: bool = False,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk of choice ``index``: a text delta (or the finish), in the chat or the
    completion shape; ``logprobs``: its tokens' (:func:`logprobs_object`)."""
    if req.kind == CHAT:
        delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: OpenAIRequest, response_id: str, created: int, reports: list[dict]) -> dict:
    obj = "chat.completion.chunk" if req.kind == CHAT else "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [],
        "usage": choices_usage(req, reports),
        "eyas": choices_stats(reports),
    }


def models(model_name: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "eyas"}]}


def now() -> int:
    return int(time.time())
