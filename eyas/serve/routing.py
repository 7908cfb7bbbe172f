"""Which target replica a request goes to: Ray Serve's request-router API, with Ray Serve LLM's
``PrefixCacheAffinityRouter`` for routing by prefix.

Terms:
    prefix routing   a request goes to the target replica whose prefix cache most likely holds the
                     longest prefix of its prompt (a previous turn of the same conversation, a shared
                     system prompt), unless the replicas' queues differ by ``prefix_router_imbalance``
                     or more, when the power-of-two-choices rule balances load instead.
    match rate       the share of a prompt that Ray Serve LLM's prefix tree (one per deployment, in a
                     detached actor) matches on the replica it names; under 10 % the router sends the
                     request to the replica whose tree holds the least.

Ray Serve LLM's router matches *characters* of the text found in a request argument's ``prompt`` or
``messages``. Eyas routes token ids, not text: ``PrefixRouter`` hands it the prompt's token ids as a
string of one character per token, so a match in the tree is a match of whole tokens, exactly what
the prefix cache (``eyas.target.prefix_cache``) can reuse. The rest (the tree, its eviction, the
balance against load, a dead replica's removal) is Ray Serve LLM's own code.
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

# the first code point of the token alphabet: past the surrogates (0xD800-0xDFFF), so that every id of
# a vocabulary up to 1,048,576 - 0xE000 tokens is one valid character
TOKEN_CHAR_BASE = 0xE000
POWER_OF_TWO = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"


def token_text(prompt_ids: list[int]) -> str:
    """The prompt's token ids as a string of one character per token (``TOKEN_CHAR_BASE + id``)."""
    return "".join(chr(TOKEN_CHAR_BASE + i) for i in prompt_ids)


class _PromptIds:
    """What Ray Serve LLM's router reads a prompt from: an object with a ``prompt`` attribute."""

    __slots__ = ("prompt",)

    def __init__(self, prompt: str):
        self.prompt = prompt


class PrefixRouter(PrefixCacheAffinityRouter):
    """``PrefixCacheAffinityRouter`` over the token ids of ``EyasTarget.generate(request, prompt_ids,
    ...)``: its second argument. A call without token ids (``info``, ``stats``, health) is routed by
    power of two choices, as Ray Serve LLM does for a request it cannot read."""

    def _extract_text_from_request(self, pending_request) -> str:
        ids = _prompt_ids(pending_request.args)
        if ids is None:
            return super()._extract_text_from_request(pending_request)
        return token_text(ids)

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if pending_request is not None and _prompt_ids(pending_request.args) is None:
            pending_request = None  # nothing to match: the power-of-two choice alone
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        if pending_request is not None and _prompt_ids(pending_request.args) is not None:
            super().on_request_routed(pending_request, replica_id, result)


def _prompt_ids(args: Any) -> list[int] | None:
    """The prompt's token ids among a call's positional arguments (``generate``'s second), or None."""
    if not args or len(args) < 2:
        return None
    ids = args[1]
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids[:8]):
        return ids
    return None


def router_config(router: str, imbalance: float) -> dict:
    """The ``request_router_config`` of the target deployment for the serve config's ``target_router``."""
    if router == "prefix":
        return {
            "request_router_class": f"{__name__}:PrefixRouter",
            "request_router_kwargs": {"imbalanced_threshold": imbalance},
        }
    return {"request_router_class": POWER_OF_TWO}
