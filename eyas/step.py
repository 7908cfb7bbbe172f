"""The round step: propose -> verify (+ accept) -> publish, the one round function of every decode loop.

Three loops drive it: the in-process ``eyas.generate.generate``, the remote-verifier client
``eyas.remote.verifier_client.generate_remote`` and the serving ``eyas.serve.round_loop.RoundLoop``.
Each hands :func:`round_step` its two sides, a *target side* and a *drafter side* (the
:class:`TargetSide` and :class:`DrafterSide` protocols): engines called directly in one process,
workers behind Ray, or a ``Verifier`` over gRPC. The step itself is the same everywhere (seed
0x05A-0x05D):

    propose  the drafter grows each drafting request's tree from its unread seeds (a reseed first,
             for a request whose draft session was lost: the reseed rule below)
    verify   ONE target call: the prompts' next prefill chunks and every request's frontier + tree
             rows in one forward, each decided (accepted) under its own sampler
    publish  ONE target call: each decided request commits its accepted rows, its own transaction;
             the drafter drops its provisional tree rows

Terms. A *seed* (``Seed``) is what a publish returns for the drafter: the verified target features
of the rows it committed. A request's *unread* seeds are those its drafter has not consumed yet
(a request that decodes plainly for a few rounds skips the drafter; its seeds queue, joined when it
drafts again). *Reseeding* rebuilds a lost draft session from the target's committed state (seed
0x05D); a request reseeds at most :data:`MAX_DRAFTER_RESEEDS` times, every attempt counted, and
goes on target-only after that (*fallback*). Greedy tokens never depend on the drafter: the target
decides every one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from eyas.drafting.engine import TreeSpec
from eyas.drafting.suffix import (
    SharedSuffixCache,
    SuffixIndex,
    SuffixSpec,
    accepted_depth,
    expected_accepted,
    first_token_value,
    graft,
    suffix_tree,
)
from eyas.protocol.messages import AcceptDecision, Refusal, Seed
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import DraftTree, FlatTree
from eyas.scheduler.gate import DrafterGate, RoundWork, SuffixOffer
from eyas.target.engine import PrefillProgress, TargetEngine, Verified
from eyas.verification.accept import decide
from eyas.verification.grammar import GrammarCursor
from eyas.verification.processors import draft_processor

log = logging.getLogger("eyas.step")

# The one reseed rule of every decode loop: a request reseeds its draft session from the target's
# committed state (design 0x05D) at most this many times before it goes on target-only: once for a
# drafter that died, and again whenever a drafter deployment moved it to a replica that does not
# hold its session (scale-up, scale-down, a replaced replica).
MAX_DRAFTER_RESEEDS = 4
CONSUME_SEED_ONLY = TreeSpec(kind="chain", max_depth=0)  # a plain round's drafter call: context rows only
SUFFIX = "suffix"  # the method that drafts from the request's own history alone (SuffixSide)
EMPTY = DraftTree.empty()


class DrafterUnavailable(RuntimeError):
    """The drafter died, timed out or lost the session; the round goes plain and the request reseeds."""


def may_reseed(reseeds: int) -> bool:
    """The reseed rule: whether a request that has reseeded ``reseeds`` times may reseed again."""
    return reseeds < MAX_DRAFTER_RESEEDS


@dataclass(kw_only=True)
class DraftState:
    """One request's drafting state across rounds: owned by the loop that made it, advanced by
    :func:`round_step` (and by no one else)."""

    request_id: str
    method: str  # "target" | "eagle1" | "hass" | "eagle3" | "suffix" (suffix drafts alone)
    suffix: bool = False  # suffix drafts grafted into the drafter's tree (SuffixSide)
    # the request's sampler and prompt when a logits processor or a grammar is on: the drafter drafts
    # under them
    processors: tuple | None = None  # (SamplingParams, prompt ids)
    # an in-process drafter's own cursor of the request's grammar (a remote drafter makes its own)
    grammar: GrammarCursor | None = None
    draft_slots: int = 0  # draft KV slots its session opens with
    seed: Seed | None = None  # the last publish's seed (None until its prompt is prefilled)
    unread: list[Seed] = field(default_factory=list)  # seeds the drafter has not read yet, in order
    drafter_open: bool = False
    needs_reseed: bool = False
    fallback: bool = False
    reseeds: int = 0
    # the version of the drafter that drafted its last tree (0: the one the drafter was built with;
    # a learned one's number after a swap, eyas.learning); None: no drafter has drafted for it
    drafter_version: int | None = None

    @property
    def speculative(self) -> bool:
        return self.method != "target" and not self.fallback


@dataclass(frozen=True, kw_only=True)
class Decided:
    """A round the target verified and decided, to be published."""

    request_id: str
    round: int
    decision: AcceptDecision
    flat: FlatTree | None = None  # the verified rows (None for a prefill)
    compute_s: float = 0.0  # the target's forward and decision
    accept_s: float = 0.0  # of which the decision
    pack_s: float = 0.0  # flattening and encoding the rows, where a side does it
    expert_bytes: int = 0  # MoE: expert weights this request's rows routed to
    batch_expert_bytes: int = 0  # MoE: the union over the whole forward (design 0x09A)


@dataclass(frozen=True, kw_only=True)
class Published:
    """A committed round: the drafter's next seed and the tokens it emitted."""

    seed: Seed
    tokens: tuple[int, ...]
    compute_s: float = 0.0
    # per emitted token (logprob, ((token, logprob), ...top alternatives)), when the request asked for them
    logprobs: tuple | None = None


class TargetSide(Protocol):
    def step(
        self, prefilling: list[DraftState], verifies: list[tuple[DraftState, DraftTree]], max_prefill_rows: int | None
    ) -> tuple[list[Decided | PrefillProgress | Refusal], list[Decided | Refusal]]:
        """The prompts' next chunks and the verifies, in one forward, each decided."""

    def publish(self, decided: list[Decided]) -> list[Published | Refusal]: ...

    def reseed(self, request_id: str) -> Seed:
        """Every committed row's verified feature from position 0."""


class DrafterSide(Protocol):
    def open_session(self, state: DraftState) -> None: ...

    def close_session(self, request_id: str) -> None: ...

    def propose_batch(
        self, items: list[tuple[str, list[Seed], TreeSpec]]
    ) -> tuple[list[DraftTree | Refusal], float, list[int | None]]:
        """Each item: (request id, its unread seeds in order, its tree). The side joins the seeds
        (``Seed.join``) on the thread that runs its torch compute, since a concatenation on any
        other thread of the process would give it a second OpenMP team (``eyas.compute``).
        -> (per item a tree or a refusal, seconds of drafter compute, per item the version of the
        drafter that drafted it: 0 the one it was built with; None: no drafter did); raises
        DrafterUnavailable."""

    def publish(self, request_ids: list[str]) -> None:
        """Drop these requests' provisional tree rows (the round was published)."""


class SessionDrafter:
    """The drafter side of the round step for a drafter object in this process with a
    ``DrafterEngine``'s per-request methods (``open_session(request_id, slots)``, ``propose``,
    ``publish``, ``close_session``): an engine, a ``DrafterWorker``, a test's stand-in."""

    def __init__(self, drafter):
        self.drafter = drafter

    def open_session(self, state: DraftState) -> None:
        if state.processors is None:
            self.drafter.open_session(state.request_id, state.draft_slots)
            return
        process = draft_processor(*state.processors, columns=self.drafter.draft_columns, grammar=state.grammar)
        self.drafter.open_session(state.request_id, state.draft_slots, process)

    def close_session(self, request_id: str) -> None:
        self.drafter.close_session(request_id)

    def propose_batch(self, items: list[tuple[str, list[Seed], TreeSpec]]) -> tuple[list[DraftTree], float, list[int]]:
        trees, compute_s, versions = [], 0.0, []
        for request_id, seeds, tree in items:  # on the caller's thread, which runs the drafter too
            t0 = time.perf_counter()
            out = self.drafter.propose(request_id, Seed.join(seeds), tree)
            tree_, seconds = out if isinstance(out, tuple) else (out, time.perf_counter() - t0)
            trees.append(tree_)
            compute_s += seconds
            versions.append(self.drafter.version_of(request_id) if hasattr(self.drafter, "version_of") else 0)
        return trees, compute_s, versions

    def publish(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.drafter.publish(request_id)


def suffix_tree_spec(spec: SuffixSpec) -> TreeSpec:
    """The tree a suffix-alone request plans its rounds with (its rows and depth bound)."""
    return TreeSpec(kind="dynamic", expand_width=1, max_depth=spec.max_depth, verify_budget=spec.budget)


def verify_rows(tree: TreeSpec, suffix: SuffixSpec | None = None) -> int:
    """The verify rows a speculative request's target session opens with: the root, the drafter's
    tree and, grafted into it, up to ``suffix.budget`` suffix candidates."""
    return tree.max_candidates + 1 + (suffix.budget if suffix is not None else 0)


class SuffixSide:
    """A drafter side with suffix drafts (``eyas.drafting.suffix``), over an inner drafter side (or
    none): a request of method ``suffix`` drafts from its own history alone, one with ``suffix``
    set gets the suffix candidates grafted into its drafter's tree (one tree, one verify), and any
    other passes through. Owns every such request's :class:`SuffixIndex`, fed from the seeds the
    round step hands the drafter (their ``advanced_tokens`` are the committed history, in order).
    ``inner`` may change between rounds (None while the drafter is down: suffix-alone requests go on
    drafting, the others' calls raise DrafterUnavailable as the drafter's would). ``shared``: the
    loop's cache of earlier answers (None: a request's own history only): a request drafts the
    continuation tree, of its own history or of the earlier answers, with the larger expected
    accepted tokens. ``gate``: whether a grafted request's drafter grows a tree in a round
    (``eyas.scheduler.gate``: measured round costs against each source's expected tokens); a skipped
    drafter's seeds wait here and it reads them, in one call, when it drafts next."""

    def __init__(
        self,
        inner: DrafterSide | None,
        spec: SuffixSpec = SuffixSpec(),
        shared: SharedSuffixCache | None = None,
        gate: DrafterGate | None = None,
    ):
        self.inner, self.spec, self.shared = inner, spec, shared
        self.gate = gate if gate is not None else DrafterGate(skip_value=spec.drafter_skip_value)
        self.indexes: dict[str, SuffixIndex] = {}
        self.alone: set[str] = set()
        self.sources = {"own": 0, "shared": 0}  # rounds whose suffix tree came from each source
        # a grafted request's seeds its drafter has not read (the rounds the gate skipped it), in order
        self.pending: dict[str, list[Seed]] = {}
        self.pending_rows: dict[str, int] = {}  # ... and their rows together (Seed.total_rows of each list)
        self.drafted: dict[str, int] = {}  # grafted request -> its drafter's own tree's nodes last round
        self.offered: dict[str, tuple[DraftTree, SuffixOffer]] = {}  # grafted request -> its suffix tree last round
        self.last_round: tuple[float, RoundWork] | None = None  # when the last propose began, and what it did

    def over(self, inner: DrafterSide | None) -> SuffixSide:
        self.inner = inner
        return self

    def stats(self) -> dict:
        """What the suffix indexes hold now (``eyas stats``): requests, history tokens, index entries
        (each an n-gram end, about ``max_match`` a token: the memory grows with the live histories),
        the rounds whose suffix tree came from each source, and the shared cache's size."""
        indexes = list(self.indexes.values())
        return {
            "requests": len(indexes),
            "history_tokens": sum(len(ix.tokens) for ix in indexes),
            "index_entries": sum(ix.entries for ix in indexes),
            "trees_from": dict(self.sources),
            "shared": self.shared.stats() if self.shared is not None else None,
            "drafter_gate": self.gate.stats(),
        }

    def remember(self, answer: list[int]) -> None:
        """A finished answer whose request allows it to be kept, for later requests' matches."""
        if self.shared is not None:
            self.shared.add(answer)

    def serves(self, state: DraftState) -> bool:
        """Whether the request can draft now: a suffix-alone one always, others while a drafter is up
        (so a request does not spend its reseeds while the drafter is down)."""
        return state.method == SUFFIX or self.inner is not None

    def open_session(self, state: DraftState) -> None:
        self.pending.pop(state.request_id, None)  # a reseed hands the whole history again
        self.pending_rows.pop(state.request_id, None)
        self.drafted.pop(state.request_id, None)
        self.offered.pop(state.request_id, None)
        if state.method == SUFFIX or state.suffix:
            self.indexes[state.request_id] = SuffixIndex(self.spec.max_match)
        if state.method == SUFFIX:
            self.alone.add(state.request_id)
            return
        if self.inner is None:
            raise DrafterUnavailable("drafter: none is up")
        self.inner.open_session(state)

    def forget(self, request_id: str) -> bool:
        """Drop a request's suffix state. -> whether it drafted with suffix drafts alone (no drafter session)."""
        self.indexes.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.pending_rows.pop(request_id, None)
        self.drafted.pop(request_id, None)
        self.offered.pop(request_id, None)
        self.gate.forget(request_id)
        alone = request_id in self.alone
        self.alone.discard(request_id)
        return alone

    def close_session(self, request_id: str) -> None:
        if not self.forget(request_id) and self.inner is not None:
            self.inner.close_session(request_id)

    def propose_batch(
        self, items: list[tuple[str, list[Seed], TreeSpec]]
    ) -> tuple[list[DraftTree | Refusal], float, list[int | None]]:
        t0 = time.perf_counter()
        self._observe(items, t0)
        suffix: dict[str, DraftTree] = {}
        for request_id, seeds, tree in items:  # indexing is idempotent: a failed drafter call may hand them again
            index = self.indexes.get(request_id)
            if index is not None:
                for seed in seeds:
                    index.extend_seed(seed.start_position, seed.advanced_tokens.tolist())
                if tree.max_candidates > 0:  # grafted: up to twice the drafter tree's planned rows beside it
                    rows = tree.max_candidates if request_id in self.alone else 2 * tree.max_candidates
                    suffix[request_id] = self._tree(index, rows)
        suffix_s = time.perf_counter() - t0
        # a grafted request whose drafter the gate skips this round: its seeds wait for its next drafting
        # round; its suffix tree alone is verified (eyas.scheduler.gate)
        neural = []
        for rid, seeds, tree in items:
            if rid in self.alone:
                continue
            if rid in suffix:
                backlog = self.pending_rows.get(rid, 0) + Seed.total_rows(seeds)
                t = suffix[rid]
                offer = SuffixOffer(expected=expected_accepted(t), first=first_token_value(t), nodes=t.num_nodes)
                if offer.nodes:
                    self.offered[rid] = (t, offer)
                if not self.gate.should_draft(rid, offer, backlog, Seed.total_rows(seeds)):
                    self._queue(rid, seeds)
                    continue
            self.pending_rows.pop(rid, None)
            neural.append((rid, self.pending.pop(rid, []) + list(seeds), tree))
        trees, compute_s, versions, draft_s = {}, 0.0, {}, 0.0
        if neural:
            if self.inner is None:
                raise DrafterUnavailable("drafter: none is up")
            t_draft = time.perf_counter()
            out, compute_s, drafted_by = self.inner.propose_batch(neural)
            draft_s = time.perf_counter() - t_draft
            trees = {item[0]: tree for item, tree in zip(neural, out)}
            versions = {item[0]: v for item, v in zip(neural, drafted_by)}
        result = []
        for request_id, _, _ in items:
            drafted = trees.get(request_id, EMPTY)
            if request_id in suffix and not isinstance(drafted, Refusal):
                if request_id in trees:
                    self.drafted[request_id] = drafted.num_nodes
                drafted = graft(drafted, suffix[request_id])
            result.append(drafted)
        grafted_drafted = [item for item in neural if item[0] in suffix]
        self.last_round = (
            t0,
            RoundWork(
                drafted=bool(grafted_drafted),
                verify_rows=sum(1 + t.num_nodes for t in result if not isinstance(t, Refusal)),
                context_rows=sum(Seed.total_rows(seeds) for _, seeds, _ in grafted_drafted),
                draft_s=draft_s if grafted_drafted else 0.0,
            ),
        )
        # the suffix work counts as drafting; a suffix-alone request has no drafter version (None)
        return result, compute_s + suffix_s, [versions.get(rid) for rid, _, _ in items]

    def _queue(self, request_id: str, seeds: list[Seed]) -> None:
        """Keep seeds for the request's next drafting round (once each: a call may hand them again)."""
        queue = self.pending.setdefault(request_id, [])
        for seed in seeds:
            if not queue or seed.start_position >= queue[-1].end_position:
                queue.append(seed)
                self.pending_rows[request_id] = self.pending_rows.get(request_id, 0) + int(seed.features.shape[0])

    def _observe(self, items: list[tuple[str, list[Seed], TreeSpec]], now: float) -> None:
        """What the last round showed the gate: its wall time (when every request comes back after
        exactly that one round, one seed each) and, per grafted request, how many of its accepted tokens
        (the seed's advanced tokens but the new frontier) its suffix tree held and how many more its
        drafter's tree added."""
        for rid, seeds, _ in items:
            drafter_nodes, offered = self.drafted.pop(rid, None), self.offered.pop(rid, None)
            if len(seeds) != 1:
                continue
            accepted = seeds[0].advanced_tokens.tolist()[:-1]
            copied = accepted_depth(offered[0], accepted) if offered is not None else 0
            if drafter_nodes is not None:
                room = 1.0 - self.gate.calibrated(offered[1]).first if offered is not None else 1.0
                self.gate.observe_drafted(drafter_nodes, len(accepted) - copied, room)
            if offered is not None:
                self.gate.observe_suffix(offered[1], copied)
        grafted = [rid for rid, _, _ in items if rid in self.indexes and rid not in self.alone]
        if self.last_round is not None and grafted and all(len(seeds) == 1 for _, seeds, _ in items):
            self.gate.observe_round(self.last_round[1], now - self.last_round[0])

    def _tree(self, index: SuffixIndex, planned_rows: int) -> DraftTree:
        """The request's suffix tree this round, at most ``planned_rows`` nodes: the rows its planned
        tree may verify (a serving loop's scheduler shrinks them under load, to none in a plain round;
        grafted, twice the drafter tree's planned rows, beside them: a copied span's rows are as cheap as
        a drafted node's and need no drafter step); a copied span may still run deeper
        than the drafter's depth (the spec's ``max_depth``)."""
        spec = self.spec if planned_rows >= self.spec.budget else replace(self.spec, budget=planned_rows)
        own = suffix_tree(index, spec)
        if self.shared is None:
            return own
        shared = self.shared.tree(index.tokens, spec)
        source, best = max((("own", own), ("shared", shared)), key=lambda st: expected_accepted(st[1]))
        if best.num_nodes:
            self.sources[source] += 1
        return best

    def publish(self, request_ids: list[str]) -> None:
        neural = [r for r in request_ids if r not in self.alone and r not in self.pending]
        if neural and self.inner is not None:
            self.inner.publish(neural)


@dataclass(frozen=True, kw_only=True)
class Round:
    """What one :func:`round_step` did, for the loop's records."""

    trees: dict[str, DraftTree]  # request id -> the tree it verified (empty: a plain round)
    prefills: list[Decided | PrefillProgress | Refusal]
    verdicts: list[Decided | Refusal]  # one per batch item, in order
    published: dict[str, Published | Refusal]  # request id -> its publish (finished prefills and decided verifies)
    draft_compute_s: float  # the drafter's own compute in the propose call
    drafter_lost: bool  # a drafter call raised DrafterUnavailable this round
    draft_s: float  # propose (reseeds included)
    verify_s: float  # the target call: forward and decisions
    publish_s: float

    @property
    def hop_s(self) -> float:
        """The round's wall time outside the workers' own compute (calls, encoding, queues: the Ray or
        gRPC hops); 0 where no side reports its compute (engines in this process)."""
        compute_s = (
            self.draft_compute_s
            + max((v.compute_s for v in self.verdicts if isinstance(v, Decided)), default=0.0)
            + sum(a.compute_s for a in self.published.values() if isinstance(a, Published))
        )
        return max(self.draft_s + self.verify_s + self.publish_s - compute_s, 0.0) if compute_s else 0.0


def round_step(
    target: TargetSide,
    drafter: DrafterSide | None,
    batch: list[tuple[DraftState, TreeSpec | None]],
    prefilling: list[DraftState] = (),
    max_prefill_rows: int | None = None,
) -> Round:
    """One round for ``batch`` (each decoding request with this round's tree; None: a plain round)
    and the ``prefilling`` prompts. ``drafter``: None while there is none (or it is down): every
    round is plain and reseeds wait."""
    t0 = time.perf_counter()
    trees, drafted, draft_compute_s, lost = propose(target, drafter, batch)  # propose
    t1 = time.perf_counter()
    prefills, verdicts = target.step(
        list(prefilling), [(s, trees[s.request_id]) for s, _ in batch], max_prefill_rows
    )  # verify + accept
    t2 = time.perf_counter()
    states = [*prefilling, *(s for s, _ in batch)]
    decided = [(s, v) for s, v in zip(states, [*prefills, *verdicts]) if isinstance(v, Decided)]
    acks = target.publish([v for _, v in decided]) if decided else []  # publish
    if drafted:
        drafter.publish(drafted)
    for (s, _), ack in zip(decided, acks):
        if isinstance(ack, Published):
            lost |= _advance(s, ack.seed, drafter, first=s.seed is None)
    return Round(
        trees=trees,
        prefills=prefills,
        verdicts=verdicts,
        published={s.request_id: ack for (s, _), ack in zip(decided, acks)},
        draft_compute_s=draft_compute_s,
        drafter_lost=lost,
        draft_s=t1 - t0,
        verify_s=t2 - t1,
        publish_s=time.perf_counter() - t2,
    )


def _advance(s: DraftState, seed: Seed, drafter: DrafterSide | None, first: bool) -> bool:
    """A publish's seed. After the prefill the draft session opens (it drafts from the next round);
    later seeds queue until the drafter reads them. -> whether the drafter was unavailable."""
    s.seed = seed
    if first:
        s.unread = [seed]
        return open_draft(s, drafter)
    s.unread = s.unread + [seed] if s.speculative else [seed]  # joined once, when read
    return False


def open_draft(s: DraftState, drafter: DrafterSide | None) -> bool:
    """Open a speculative request's draft session; one that cannot open now reseeds later.
    -> whether the drafter was unavailable."""
    if not s.speculative:
        return False
    if drafter is None:
        s.needs_reseed = True  # opened and seeded from the committed state once the drafter answers
        return False
    try:
        drafter.open_session(s)
        s.drafter_open = True
        return False
    except DrafterUnavailable:
        s.needs_reseed = True
        return True


def propose(
    target: TargetSide, drafter: DrafterSide | None, batch: list[tuple[DraftState, TreeSpec | None]]
) -> tuple[dict[str, DraftTree], list[str], float, bool]:
    """Every batch item's tree (empty unless its request drafts this round), after the reseeds due.

    Who calls the drafter: requests with a tree this round, and those whose draft session must be
    reseeded (they read the reseed now, drafting nothing if planned plain).
    -> (request id -> tree, the requests that drafted, the drafter's compute seconds, whether the
    drafter was unavailable)."""
    trees = {s.request_id: EMPTY for s, _ in batch}  # one shared empty tree (never written)
    drafting = [(s, tree) for s, tree in batch if s.speculative and (tree is not None or s.needs_reseed)]
    if isinstance(drafter, SuffixSide):  # while the drafter is down only suffix-alone requests draft
        drafting = [(s, tree) for s, tree in drafting if drafter.serves(s)]
    if drafter is None or not drafting:
        return trees, [], 0.0, False
    for s, _ in drafting:
        if s.needs_reseed and reseed(target, drafter, s):
            return trees, [], 0.0, True
    drafting = [(s, tree) for s, tree in drafting if s.drafter_open and not s.fallback]
    if not drafting:
        return trees, [], 0.0, False
    try:
        out, compute_s, versions = drafter.propose_batch(
            [(s.request_id, list(s.unread), tree or CONSUME_SEED_ONLY) for s, tree in drafting]
        )
    except DrafterUnavailable:
        for s, _ in drafting:
            if not (isinstance(drafter, SuffixSide) and s.method == SUFFIX):  # its session needs no drafter
                s.needs_reseed, s.drafter_open = True, False
        return trees, [], 0.0, True
    drafted = []
    for (s, _), tree, version in zip(drafting, out, versions):
        if isinstance(tree, Refusal):  # e.g. a restarted drafter lost the session
            s.needs_reseed, s.drafter_open = True, False
        else:
            trees[s.request_id], s.unread = tree, []
            drafted.append(s.request_id)
            s.drafter_version = s.drafter_version if version is None else version
    return trees, drafted, compute_s, False


def decide_verified(
    engine: TargetEngine,
    v: Verified,
    prompt_ids: list[int],
    sampling: SamplingParams,
    generator: torch.Generator,
    grammar: GrammarCursor | None,
) -> AcceptDecision:
    """The accept step of one request's verified round, for every target side: the committed answer
    read from ``engine`` only when a logits processor or the grammar needs it, the grammar's masks of
    the rows from the request's cursor, then ``verification.accept.decide``."""
    reads_answer = (sampling.processes or grammar is not None) and v.flat is not None
    output = engine.answer_ids(v.request_id) if reads_answer else ()
    allowed = grammar.tree_bitmask(list(output), v.flat) if grammar is not None else None
    return decide(v, prompt_ids, sampling, generator, output, allowed)


def reseed(target: TargetSide, drafter: DrafterSide, s: DraftState) -> bool:
    """Rebuild ``s``'s draft session from the target's committed state (design 0x05D), or give the
    drafter up for it (the reseed rule). -> whether the drafter was unavailable."""
    if not may_reseed(s.reseeds):
        s.fallback, s.needs_reseed = True, False
        return False
    s.reseeds += 1
    try:
        try:
            drafter.close_session(s.request_id)
        except DrafterUnavailable:
            raise
        except ValueError as err:  # a refusal: the session is already gone, which is what a reseed expects
            log.debug("reseed %s: close_session: %s", s.request_id, err)
        except Exception as err:  # noqa: BLE001 - anything else is unexpected: said, and the reseed goes on
            log.warning("reseed %s: the drafter's close_session failed (%s: %s)", s.request_id, type(err).__name__, err)
        try:
            drafter.open_session(s)
        except ValueError as err:  # a refusal (a late open of this request took the drafter's lock first):
            # it stays to be reseeded, next round, counted by the reseed rule; the round goes on
            log.warning("reseed %s: the drafter refused the open (%s); again next round", s.request_id, err)
            return False
        s.seed = target.reseed(s.request_id)
        s.unread = [s.seed]
        s.drafter_open, s.needs_reseed = True, False
        return False
    except DrafterUnavailable:
        return True
