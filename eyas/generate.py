"""The decode loop: target-only and speculative decoding share everything but the drafting.

One round (DESIGN.md, "One speculation round"):

    propose  -> the drafter grows a tree behind the frontier token    (target-only: an empty tree)
    verify   -> the target runs the frontier + tree rows in one forward
    accept   -> a pure function picks the accepted path and the next frontier token
    publish  -> the target commits the accepted rows; the drafter drops its tree rows

Target-only decoding is the same loop with an empty tree: each round verifies one row (the
frontier) and accepts it, which is plain autoregressive decoding.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import DraftTree, FlatTree
from eyas.target.engine import TargetEngine
from eyas.verification.accept import decide
from eyas.verification.sampling import SamplingParams

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"
# The one reseed rule of every decode loop: a request reseeds its draft session from the target's
# committed state (seed 0x05D) at most this many times before it goes on target-only: once for a
# drafter that died, and again whenever a drafter deployment moved it to a replica that does not
# hold its session (scale-up, scale-down, a replaced replica).
MAX_DRAFTER_RESEEDS = 4


class DrafterUnavailable(RuntimeError):
    """The drafter died, timed out or lost the session; the decode loop reseeds or goes target-only."""


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """One finished round, for observers (``eyas.serve.telemetry``): what was sent and decided, and
    when each step ran (``time.time_ns`` at the round's start plus perf-counter offsets in seconds)."""

    request_id: str
    round: int
    flat: FlatTree | None          # the verified rows (None: target-only, one root row)
    decision: AcceptDecision
    start_ns: int
    draft_s: float                 # the propose call
    pack_s: float                  # flattening + encoding the tree
    verify_s: float                # the Verify call, pack excluded (the forward and the decision inside)
    accept_s: float                # the target's decision, inside verify_s
    publish_s: float               # the Publish call
    fallback: bool                 # the drafter was given up before this round
    expert_bytes: int = 0          # MoE target: expert weights this request's own verify rows routed to
    batch_expert_bytes: int = 0    # MoE target: the union over the whole batched verify (seed 0x09A)


@dataclass(frozen=True, kw_only=True)
class RoundStats:
    accept_length: int   # candidate tokens accepted (the frontier excluded)
    new_tokens: int      # tokens this round emitted: accepted candidates + the new frontier
    tree_nodes: int      # candidate rows verified (the root excluded)
    draft_s: float
    verify_s: float
    hop_s: float = 0.0   # remote loops: round wall time outside the workers' own compute


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    token_ids: list[int]         # generated ids only (a stop token included, if one was emitted)
    finish_reason: str           # "stop" | "length" | "cancelled"
    prefill_s: float
    wall_s: float
    rounds: tuple[RoundStats, ...] = field(default_factory=tuple)
    drafter_fallback: bool = False   # the drafter failed and the rest of the request ran target-only
    drafter_reseeds: int = 0         # times the drafter was reseeded from the target's committed state

    @property
    def target_forwards(self) -> int:
        """Verify rounds after the prefill."""
        return len(self.rounds)

    @property
    def accept_length_mean(self) -> float:
        """new tokens per target forward after the prefill (tau, the frontier included)."""
        return len(self.token_ids) / max(self.target_forwards, 1)

    @property
    def draft_s(self) -> float:
        return sum(r.draft_s for r in self.rounds)

    @property
    def verify_s(self) -> float:
        return sum(r.verify_s for r in self.rounds)

    @property
    def hop_s(self) -> float:
        return sum(r.hop_s for r in self.rounds)


def generate(target: TargetEngine, prompt_ids: list[int], *, max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(), drafter: DrafterEngine | None = None,
             tree: TreeSpec = TreeSpec(), seed: int = 0, request_id: str = "local",
             stop_ids: tuple[int, ...] | None = None,
             on_tokens: Callable[[list[int]], bool | None] | None = None) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; speculative when ``drafter`` is given.

    on_tokens: called with each publish's new tokens; returning True stops (finish reason "stop")."""
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    stop_ids = tuple(target.cfg.eos_token_ids if stop_ids is None else stop_ids)
    generator = torch.Generator().manual_seed(seed)
    max_rows = tree.max_candidates + 1 if drafter is not None else 1
    target.open_session(request_id, prompt_ids, max_new_tokens, max_rows)
    if drafter is not None:
        drafter.open_session(request_id, tree.draft_slots(len(prompt_ids), max_new_tokens))
    try:
        t_start = time.perf_counter()
        verified = target.prefill(request_id)
        seed_state, ack = target.publish(request_id, verified.round, decide(verified, prompt_ids, sampling, generator))
        out = list(ack.output_tokens)
        stopped = bool(on_tokens and on_tokens(list(ack.output_tokens)))
        prefill_s = time.perf_counter() - t_start
        rounds: list[RoundStats] = []
        while not is_finished(out, max_new_tokens, stop_ids, ack.output_tokens, stopped):
            t0 = time.perf_counter()
            draft = drafter.propose(request_id, seed_state, tree) if drafter else DraftTree.empty()   # propose
            t1 = time.perf_counter()
            verified = target.verify(request_id, draft)                                                # verify
            t2 = time.perf_counter()
            decision = decide(verified, prompt_ids, sampling, generator)                                # accept
            seed_state, ack = target.publish(request_id, verified.round, decision)                      # publish
            if drafter:
                drafter.publish(request_id)
            out.extend(ack.output_tokens)
            stopped = bool(on_tokens and on_tokens(list(ack.output_tokens)))
            rounds.append(RoundStats(accept_length=decision.accept_length, new_tokens=decision.num_new_tokens,
                                     tree_nodes=draft.num_nodes, draft_s=t1 - t0, verify_s=t2 - t1))
        wall_s = time.perf_counter() - t_start
    finally:
        target.close_session(request_id)
        if drafter is not None:
            drafter.close_session(request_id)
    token_ids, reason = finish(out, max_new_tokens, stop_ids, stopped=stopped)
    return GenerationResult(token_ids=token_ids, finish_reason=reason, prefill_s=prefill_s, wall_s=wall_s,
                            rounds=tuple(rounds))


def may_reseed(reseeds: int) -> bool:
    """The reseed rule: whether a request that has reseeded ``reseeds`` times may reseed again."""
    return reseeds < MAX_DRAFTER_RESEEDS


def is_finished(out: list[int], max_new_tokens: int, stop_ids: tuple[int, ...], emitted, stopped: bool) -> bool:
    """The one finish rule of every decode loop, after a publish that ``emitted`` these tokens: the
    answer is done at ``max_new_tokens``, at a stop token, or when the caller stopped it."""
    return stopped or len(out) >= max_new_tokens or any(t in stop_ids for t in emitted)


def finish(out: list[int], max_new_tokens: int, stop_ids: tuple[int, ...], *, stopped: bool = False,
           cancelled: bool = False) -> tuple[list[int], str]:
    """The answer and its finish reason: cut by :func:`finish_tokens`, then "cancelled" for a
    cancelled request, or "stop" for one the caller stopped (a stop string) within its length."""
    tokens, reason = finish_tokens(out, max_new_tokens, stop_ids)
    if cancelled:
        return tokens, FINISH_CANCELLED
    if stopped and len(out) <= max_new_tokens:
        return tokens, FINISH_STOP
    return tokens, reason


def finish_tokens(out: list[int], max_new_tokens: int, stop_ids: tuple[int, ...]) -> tuple[list[int], str]:
    """Cut at the first stop token (kept) or at ``max_new_tokens``."""
    for i, tok in enumerate(out[:max_new_tokens]):
        if tok in stop_ids:
            return out[:i + 1], FINISH_STOP
    return out[:max_new_tokens], FINISH_LENGTH
