"""The in-process decode loop: target-only and speculative decoding share everything but the drafting.

Each round is the one round step (``eyas.step.round_step``, design 0x05A-0x05D):

    propose  -> the drafter grows a tree behind the frontier token    (target-only: an empty tree)
    verify   -> the target runs the frontier + tree rows in one forward
    accept   -> a pure function picks the accepted path and the next frontier token
    publish  -> the target commits the accepted rows; the drafter drops its tree rows

Target-only decoding is the same loop with an empty tree: each round verifies one row (the
frontier) and accepts it, which is plain autoregressive decoding. Here both sides are engines in
this process (:class:`EngineTarget`, ``eyas.step.SessionDrafter``); the remote client and the serving
loop drive the same step over other sides. This module also holds the one finish rule of every
loop (:func:`is_finished`, :func:`finish`) and the records they keep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.drafting.suffix import SharedSuffixCache, SuffixSpec
from eyas.protocol.checks import check_in_vocab
from eyas.protocol.messages import AcceptDecision
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import FlatTree
from eyas.scheduler.gate import DrafterGate
from eyas.step import (
    SUFFIX,
    Decided,
    DrafterSide,
    DraftState,
    Published,
    Round,
    SessionDrafter,
    SuffixSide,
    TargetSide,
    decide_verified,
    round_step,
    suffix_tree_spec,
    verify_rows,
)
from eyas.target.engine import PrefillProgress, TargetEngine, Verified
from eyas.verification.grammar import GrammarCursor

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED, FINISH_ERROR = "stop", "length", "cancelled", "error"


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """One finished round, for observers (``eyas.serve.telemetry``): what was sent and decided, and
    when each step ran (``time.time_ns`` at the round's start plus perf-counter offsets in seconds)."""

    request_id: str
    round: int
    flat: FlatTree | None  # the verified rows (None: target-only, one root row)
    decision: AcceptDecision
    start_ns: int
    draft_s: float  # the propose call
    pack_s: float  # flattening + encoding the tree
    verify_s: float  # the Verify call, pack excluded (the forward and the decision inside)
    accept_s: float  # the target's decision, inside verify_s
    publish_s: float  # the Publish call
    fallback: bool  # the drafter was given up before this round
    expert_bytes: int = 0  # MoE target: expert weights this request's own verify rows routed to
    batch_expert_bytes: int = 0  # MoE target: the union over the whole batched verify (design 0x09A)

    @classmethod
    def of(cls, r: Round, v: Decided, *, start_ns: int, fallback: bool, pack_s: float, accept_s: float) -> RoundRecord:
        """The record of ``v``'s request in round ``r`` (``pack_s`` / ``accept_s``: its own, or a
        batch's longest, which every request in the batch waited for)."""
        nodes = r.trees[v.request_id].num_nodes
        return cls(
            request_id=v.request_id,
            round=v.round,
            flat=v.flat if nodes else None,
            decision=v.decision,
            start_ns=start_ns,
            draft_s=r.draft_s,
            pack_s=pack_s,
            verify_s=r.verify_s - pack_s,
            accept_s=accept_s,
            publish_s=r.publish_s,
            fallback=fallback,
            expert_bytes=v.expert_bytes,
            batch_expert_bytes=v.batch_expert_bytes,
        )


@dataclass(frozen=True, kw_only=True)
class RoundStats:
    accept_length: int  # candidate tokens accepted (the frontier excluded)
    new_tokens: int  # tokens this round emitted: accepted candidates + the new frontier
    tree_nodes: int  # candidate rows verified (the root excluded)
    draft_s: float
    verify_s: float
    hop_s: float = 0.0  # remote loops: round wall time outside the workers' own compute

    @classmethod
    def of(cls, r: Round, v: Decided) -> RoundStats:
        """What round ``r`` did for ``v``'s request (every request in a batch waited for the whole
        round: each is charged its full times)."""
        return cls(
            accept_length=v.decision.accept_length,
            new_tokens=v.decision.num_new_tokens,
            tree_nodes=r.trees[v.request_id].num_nodes,
            draft_s=r.draft_s,
            verify_s=r.verify_s,
            hop_s=r.hop_s,
        )


@dataclass(frozen=True, kw_only=True)
class GenerationResult:
    token_ids: list[int]  # generated ids only (a stop token included, if one was emitted)
    finish_reason: str  # "stop" | "length" | "cancelled"
    prefill_s: float
    wall_s: float
    rounds: tuple[RoundStats, ...] = field(default_factory=tuple)
    drafter_fallback: bool = False  # the drafter failed and the rest of the request ran target-only
    drafter_reseeds: int = 0  # times the drafter was reseeded from the target's committed state
    cached_tokens: int = 0  # prompt tokens whose K/V and features came from the target's prefix cache
    queue_s: float = 0.0  # seconds it waited for admission to the batch (a serving loop's queue)
    # the version of the drafter that drafted its last tree (0: the shipped or configured one; a learned
    # version's number after a swap, eyas.learning); None: no drafter drafted for it
    drafter_version: int | None = None

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


class EngineTarget:
    """The target side of the round step for a :class:`TargetEngine` in this process: each request
    is decided with its own prompt, sampler and generator (:meth:`add`)."""

    def __init__(self, engine: TargetEngine):
        self.engine = engine
        self.samplers: dict[str, tuple[list[int], SamplingParams, torch.Generator, GrammarCursor | None]] = {}

    def add(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        generator: torch.Generator,
        grammar: GrammarCursor | None = None,
    ):
        """``grammar``: the request's structured-output cursor (its own; None: no grammar)."""
        self.samplers[request_id] = (list(prompt_ids), sampling, generator, grammar)

    def step(self, prefilling, verifies, max_prefill_rows):
        pre, ver = self.engine.step(
            [s.request_id for s in prefilling], [(s.request_id, t) for s, t in verifies], max_prefill_rows
        )
        return [self._decided(v) for v in pre], [self._decided(v) for v in ver]

    def _decided(self, v: Verified | PrefillProgress | ValueError) -> Decided | PrefillProgress:
        if isinstance(v, ValueError):  # a request in this process: its error is the caller's
            raise v
        if isinstance(v, PrefillProgress):
            return v
        prompt_ids, sampling, generator, grammar = self.samplers[v.request_id]
        t0 = time.perf_counter()
        decision = decide_verified(self.engine, v, prompt_ids, sampling, generator, grammar)  # accept
        return Decided(
            request_id=v.request_id, round=v.round, decision=decision, flat=v.flat, accept_s=time.perf_counter() - t0
        )

    def publish(self, decided: list[Decided]) -> list[Published]:
        out = []
        for d in decided:
            seed, ack = self.engine.publish(d.request_id, d.round, d.decision)
            out.append(Published(seed=seed, tokens=tuple(ack.output_tokens)))
        return out

    def reseed(self, request_id: str):
        return self.engine.committed_seed(request_id)


def generate(
    target: TargetEngine,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    drafter: DrafterEngine | None = None,
    tree: TreeSpec = TreeSpec(),
    seed: int = 0,
    request_id: str = "local",
    stop_ids: tuple[int, ...] | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    suffix: SuffixSpec | None = None,
    grammar: GrammarCursor | None = None,
    shared_suffix: SharedSuffixCache | None = None,
    gate: DrafterGate | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; speculative when ``drafter`` is given,
    or ``suffix``: suffix drafts from the request's own history (``eyas.drafting.suffix``), alone
    without a drafter, grafted into its tree with one.

    on_tokens: called with each publish's new tokens; returning True stops (finish reason "stop").
    grammar: the structured-output cursor of ``sampling.grammar`` (``GrammarCompiler.cursor``): every
    verify row is masked under its own path (``eyas.verification.grammar``).
    shared_suffix: earlier answers the suffix drafts may copy from too (the caller keeps it and adds
    the answers it allows to be kept).
    gate: the drafter gate of suffix drafts grafted into the drafter's tree (``eyas.scheduler.gate``;
    None: one of this request's own), kept by a caller so that its round costs carry across requests."""
    if (grammar is None) != (sampling.grammar == ""):
        raise ValueError("grammar: a cursor goes with sampling.grammar, and only with it")
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    stop_ids = tuple(target.cfg.eos_token_ids if stop_ids is None else stop_ids)
    drafter_side = SessionDrafter(drafter) if drafter is not None else None
    if suffix is not None:
        drafter_side = SuffixSide(drafter_side, suffix, shared_suffix, gate)
        tree = tree if drafter is not None else suffix_tree_spec(suffix)
    sides = EngineTarget(target), drafter_side
    sides[0].add(request_id, prompt_ids, sampling, torch.Generator().manual_seed(seed), grammar)
    speculative = drafter_side is not None
    state = DraftState(
        request_id=request_id,
        method="target" if not speculative else ("drafter" if drafter is not None else SUFFIX),
        suffix=suffix is not None and drafter is not None,
        draft_slots=tree.draft_slots(len(prompt_ids), max_new_tokens),
        processors=(sampling, tuple(prompt_ids)) if (sampling.processes or grammar) and drafter is not None else None,
        grammar=grammar.twin() if grammar is not None and drafter is not None else None,
    )
    rows = verify_rows(tree, suffix if state.suffix else None) if speculative else 1
    target.open_session(request_id, prompt_ids, max_new_tokens, rows)
    try:
        return decode(
            sides,
            state,
            tree if speculative else None,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            on_tokens=on_tokens,
            cached_tokens=target.sessions[request_id].cached_tokens,
        )
    finally:
        target.close_session(request_id)
        if drafter_side is not None:
            drafter_side.close_session(request_id)


# prompt rows a prefill forward takes at most (a longer prompt runs in chunks, each row computed as in one
# forward): at gguf a 1,024-token prompt prefilled in 0.89x the time in chunks of 256, shorter ones alike
# (docs/benchmarks.md); a remote target prefills its whole prompt in one call whatever this says
PREFILL_CHUNK_ROWS = 256


def decode(
    sides: tuple[TargetSide, DrafterSide | None],
    state: DraftState,
    tree: TreeSpec | None,
    *,
    max_new_tokens: int,
    stop_ids: tuple[int, ...],
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    cancel: threading.Event | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    cached_tokens: int = 0,
) -> GenerationResult:
    """The one decode loop of a single request, in process (:func:`generate`) or against a remote
    target (``eyas.remote.verifier_client.generate_remote``): the prefill, then one round step a
    round (``tree`` None: plain rounds) until the finish rule says done. Its sessions are open on
    both sides; the caller closes them.

    on_tokens: called with each publish's new tokens; returning True stops (finish reason "stop").
    cancel: set it to stop at the next round boundary (finish reason "cancelled").
    on_round: called with a :class:`RoundRecord` after each round (spans and metrics)."""
    request_id = state.request_id
    cancelled = False
    t_start = time.perf_counter()
    emitted = None
    while emitted is None:  # the prefill (round 0), at most PREFILL_CHUNK_ROWS prompt rows a forward
        published = round_step(*sides, [], [state], PREFILL_CHUNK_ROWS).published
        if request_id in published:
            emitted = published[request_id].tokens
    out = list(emitted)
    stopped = bool(on_tokens and on_tokens(list(emitted)))
    prefill_s = time.perf_counter() - t_start
    rounds: list[RoundStats] = []
    while not is_finished(out, max_new_tokens, stop_ids, emitted, stopped):
        if cancel is not None and cancel.is_set():
            cancelled = True
            break
        start_ns = time.time_ns()
        r = round_step(*sides, [(state, tree)])  # one round
        v = r.verdicts[0]
        emitted = r.published[request_id].tokens
        out.extend(emitted)
        stopped = bool(on_tokens and on_tokens(list(emitted)))
        if on_round is not None:
            on_round(
                RoundRecord.of(r, v, start_ns=start_ns, fallback=state.fallback, pack_s=v.pack_s, accept_s=v.accept_s)
            )
        rounds.append(RoundStats.of(r, v))
    wall_s = time.perf_counter() - t_start
    token_ids, reason = finish(out, max_new_tokens, stop_ids, stopped=stopped, cancelled=cancelled)
    return GenerationResult(
        token_ids=token_ids,
        finish_reason=reason,
        prefill_s=prefill_s,
        wall_s=wall_s,
        rounds=tuple(rounds),
        drafter_fallback=state.fallback,
        drafter_reseeds=state.reseeds,
        cached_tokens=cached_tokens,
        drafter_version=state.drafter_version,
    )


def stop_ids_for(
    eos_ids: tuple[int, ...], *, ignore_eos: bool = False, stop_token_ids=(), vocab_size: int | None = None
) -> tuple[int, ...]:
    """The token ids that end a request's answer (the finish rule's ``stop_ids``): the target's
    end-of-sequence ids unless ``ignore_eos``, then the request's own ``stop_token_ids`` (vLLM's),
    refused naming the field when one lies outside a vocabulary of ``vocab_size``."""
    if vocab_size is not None:
        check_in_vocab(stop_token_ids, vocab_size, "stop_token_ids")
    own = tuple(int(t) for t in stop_token_ids)
    return tuple(dict.fromkeys((() if ignore_eos else tuple(eos_ids)) + own))


def keeps_answer(finish_reason: str, learn: bool) -> bool:
    """Whether a finished answer may be kept for later requests' suffix drafts (``SharedSuffixCache``):
    its request allows it (``learn``) and it ended as an answer does (stop or length; not cancelled,
    not failed). The one rule of the serving loop and of an in-process ``Eyas``."""
    return learn and finish_reason in (FINISH_STOP, FINISH_LENGTH)


def is_finished(out: list[int], max_new_tokens: int, stop_ids: tuple[int, ...], emitted, stopped: bool) -> bool:
    """The one finish rule of every decode loop, after a publish that ``emitted`` these tokens: the
    answer is done at ``max_new_tokens``, at a stop token, or when the caller stopped it."""
    return stopped or len(out) >= max_new_tokens or any(t in stop_ids for t in emitted)


def finish(
    out: list[int], max_new_tokens: int, stop_ids: tuple[int, ...], *, stopped: bool = False, cancelled: bool = False
) -> tuple[list[int], str]:
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
            return out[: i + 1], FINISH_STOP
    return out[:max_new_tokens], FINISH_LENGTH
