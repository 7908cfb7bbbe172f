"""``RoundLoop``: the serving replica's scheduler loop over one target worker and one drafter worker.

All live requests of a target worker advance together, one round at a time:

    plan     the policy (eyas.scheduler.policy) picks the batch and each request's tree from the
             latency curve and each request's recent acceptance
    step     the round step of every decode loop (``eyas.step.round_step``) over the workers
             (:class:`WorkerTarget`, :class:`WorkerDrafter`):
               propose  ONE call: ``DrafterWorker.propose_batch`` grows every planned request's tree
               verify   ONE call: ``TargetWorker.step`` runs the prompts' next prefill chunks
                        and all verify rows in one forward (per feature address), and decides
                        acceptance per request
               publish  ONE call: ``TargetWorker.publish_rounds``, each request its own transaction

so the per-round cost is three worker calls for the whole batch, not three per request. Requests
join between rounds (their prompts are prefilled in chunks by the rounds that follow, beside the
others' decoding) and leave when they finish, are cancelled or fail.
The loop is the one owner of the per-request scheduling state (:class:`Live`); the workers own the KV.

Greedy requests get the tree the policy plans (within their own knobs); a sampled request always
gets its own tree, so that its draws, and so its tokens, are reproducible for a seed and equal the
in-process loop's (the target's distribution is matched either way: design 0x05C).

Failures: a request the target refuses finishes with an error (the others go on). A dead or slow
drafter makes the rounds plain for everyone at once, with no further drafter call in the round path
(``drafter_down``), while a probe thread asks it for its ``info`` every ``DRAFTER_PROBE_S``; once it
answers (typically a replacement replica), each request reseeds its draft session from the target's
committed state (design 0x05D), up to ``MAX_DRAFTER_RESEEDS`` times in all (``eyas.step.may_reseed``,
the rule of every decode loop), after which it goes on target-only
(``drafter_fallback``). Greedy tokens never change: the target decides every one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eyas import compute
from eyas.drafting.engine import TreeSpec
from eyas.drafting.suffix import SharedSuffixCache
from eyas.generate import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    GenerationResult,
    RoundRecord,
    RoundStats,
    finish,
    is_finished,
    keeps_answer,
)
from eyas.protocol import wire
from eyas.protocol.messages import Refusal, Seed
from eyas.protocol.sampling_params import SamplingParams
from eyas.scheduler.cost import DEFAULT_PREFILL_CHUNK, PLAIN, ExpertTraffic, TreeShape
from eyas.scheduler.latency import DraftCost, LatencyCurve
from eyas.scheduler.policy import PRIOR_EMA, AcceptanceEstimate, Candidate
from eyas.step import (
    SUFFIX,
    Decided,
    DrafterUnavailable,
    DraftState,
    Published,
    SuffixSide,
    round_step,
    verify_rows,
)
from eyas.target.engine import PrefillProgress

log = logging.getLogger("eyas.round_loop")
NEVER_ACCEPTS = AcceptanceEstimate([0.0] * 8)  # target-only requests: no tree ever pays
DRAFTER_PROBE_S = 0.5  # how often a loop whose drafter is down asks whether it answers again
# a drafter call that timed out is not withdrawn: it may still run after its request finished (an
# open landing after the close, on a replica that runs its calls concurrently). A request whose drafter
# calls failed has its draft session closed again after each of these delays (seconds after it finished)
LATE_CLOSE_S = (5.0, 30.0, 120.0)


class WorkerCalls:
    """Method calls on a worker: a Ray actor handle (``ray.get`` with a timeout) or a local object,
    whose methods run on the process's compute thread (``eyas.compute``)."""

    def __init__(self, worker, timeout_s: float, local: bool = False, drafter: bool = False):
        self.worker, self.timeout_s, self.local, self.drafter = worker, timeout_s, local, drafter

    def __call__(self, method: str, *args):
        if self.local:  # on the process's compute thread (eyas.compute): one OpenMP team per process
            return compute.run(getattr(self.worker, method), *args)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        ref = getattr(self.worker, method).remote(*args)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (GetTimeoutError, RayActorError) as err:
            if self.drafter:
                raise DrafterUnavailable(f"drafter: {type(err).__name__}") from err
            raise


@dataclass(kw_only=True)
class Live(DraftState):
    """One request in the loop: its drafting state (``DraftState``, advanced by the round step) and
    its scheduling state. Only :class:`RoundLoop` touches it."""

    prompt_ids: list[int]
    max_new_tokens: int
    tree: TreeSpec  # the request's own knobs: the largest tree it may get
    sampling: SamplingParams
    rng_seed: int
    on_tokens: Callable[[list[int]], bool] | None
    future: concurrent.futures.Future
    cancel: threading.Event
    arrival: float
    acceptance: AcceptanceEstimate
    opened: float | None = None  # when its target session opened (admission); None while queued
    out: list[int] = field(default_factory=list)
    rounds: list[RoundStats] = field(default_factory=list)
    prefill_s: float = 0.0
    prompt_done: int = 0  # prompt rows prefilled so far (chunked prefill; all of them once seeded)
    cached_tokens: int = 0  # prompt rows the target's prefix cache supplied at open
    stopped: bool = False
    eos: tuple[int, ...] = ()
    logprobs: int | None = None  # top alternatives of each emitted token's logprob (None: no logprobs)
    learn: bool = True  # its committed rows may teach the drafter (eyas.learning; where capture is on)
    stop_ids: tuple[int, ...] | None = None  # the ids that end its answer (None: the target's end-of-sequence ids)


class WorkerTarget:
    """The round step's target side for a ``TargetWorker`` behind :class:`WorkerCalls`. Objects go
    in and come out (``TargetWorker.step``, ``publish_rounds``, ``committed_seed``): the serving
    replica's target worker is in its own process, and a Ray actor would pickle them."""

    def __init__(self, calls: WorkerCalls):
        self.calls = calls

    def step(self, prefilling: list[Live], verifies, max_prefill_rows: int | None):
        return self.calls(
            "step", [s.request_id for s in prefilling], [(s.request_id, tree) for s, tree in verifies], max_prefill_rows
        )

    def publish(self, decided: list[Decided]) -> list[Published | Refusal]:
        return self.calls("publish_rounds", [(d.request_id, d.round) for d in decided])

    def reseed(self, request_id: str) -> Seed:
        return self.calls("committed_seed", request_id)


class WorkerDrafter:
    """The round step's drafter side for a ``DrafterWorker`` behind :class:`WorkerCalls` (or the
    drafter deployment's calls): seeds travel as ``Seed`` objects to a worker in this process and
    as protobuf messages to one in another process (the serving drafter deployment)."""

    def __init__(self, calls):
        self.calls = calls
        self.local = getattr(calls, "local", False)

    def open_session(self, state: Live) -> None:
        extra = state.processors if state.processors is not None else ()  # (SamplingParams, prompt ids)
        self.calls("open_session", state.request_id, state.method, state.draft_slots, *extra)

    def close_session(self, request_id: str) -> None:
        self.calls("close_session", request_id)

    def propose_batch(self, items):
        """Each item's unread seeds are joined on the compute thread (``DrafterSide.propose_batch``),
        then handed on as one ``Seed``, or encoded for a drafter in another process. A round whose
        items hold one seed each (nothing to join) makes no extra hop to that thread."""
        if all(len(unread) == 1 for _, unread, _ in items):
            seeds = [unread[0] for _, unread, _ in items]
        else:
            seeds = compute.run(lambda: [Seed.join(unread) for _, unread, _ in items])
        return self.calls(
            "propose_batch",
            [
                (rid, seed if self.local else wire.seed_to_proto(seed, request_id=rid), tree)
                for (rid, _, tree), seed in zip(items, seeds)
            ],
        )

    def publish(self, request_ids: list[str]) -> None:
        """Nothing to send: the worker drops a round's tree rows when the request's next seed arrives."""


def measured_draft_points(drafter_info: dict) -> list[tuple[int, int, float]]:
    """The drafter's start-up draft cost points ``(depth, draft rows, ms)``, those of its costliest
    method (the highest total ms; ``[]`` when it measured none)."""
    measured = [
        [(int(d), int(r), float(ms)) for d, r, ms in info.get("draft_points") or ()] for info in drafter_info.values()
    ]
    return max(measured, key=lambda pts: sum(ms for _, _, ms in pts), default=[])


class RoundLoop:
    def __init__(
        self,
        target: WorkerCalls,
        drafter: WorkerCalls | None,
        drafter_info: dict,
        policy,
        curve: LatencyCurve,
        on_round: Callable[[RoundRecord], None] | None = None,
        on_finish: Callable[[str, GenerationResult], None] | None = None,
        draft_cost: DraftCost | None = None,
        experts: ExpertTraffic | None = None,
        max_prefill_rows: int | None = DEFAULT_PREFILL_CHUNK,
    ):
        """``draft_cost``: the scheduler's starting cost of drafting; by default the drafter's start-up
        measurement from ``drafter_info`` (its costliest method's), else the optimistic prior.
        ``experts``: an MoE target's expert traffic model (``TargetEngine.expert_traffic_shape``), which
        live verifies calibrate; None for a dense target. ``max_prefill_rows``: prompt rows one round
        may prefill, all requests together (chunked prefill: a long prompt takes several rounds
        while the others keep decoding; None: a whole prompt in one round)."""
        if max_prefill_rows is not None and max_prefill_rows < 1:
            raise ValueError(f"max_prefill_rows: must be >= 1, got {max_prefill_rows}")
        self.max_prefill_rows = max_prefill_rows
        self.target, self.drafter, self.drafter_info = target, drafter, drafter_info
        # the round step's two sides over these workers (eyas.step)
        self.target_side = WorkerTarget(target)
        self.drafter_side = WorkerDrafter(drafter) if drafter is not None else None
        # suffix drafts (eyas.drafting.suffix) for the requests that ask for them, over the drafter side;
        # their matches are looked up in their own history and in this loop's earlier answers
        self.suffix_side = SuffixSide(None, shared=SharedSuffixCache())
        self.policy, self.curve = policy, curve
        # what a round's drafting adds (the propose call, hop included); live rounds refit it
        self.draft_cost = (
            draft_cost if draft_cost is not None else DraftCost.from_points(measured_draft_points(drafter_info))
        )
        self._draft_cost_given = draft_cost is not None or bool(measured_draft_points(drafter_info))
        self.experts = experts if experts is not None else ExpertTraffic()
        self.on_round, self.on_finish = on_round, on_finish
        self.prior = AcceptanceEstimate()
        self.live: dict[str, Live] = {}
        self.pending: list[Live] = []
        self.lock = threading.Condition()
        self.stopped = False
        self.rounds = 0
        self.last_verify_rows = 0  # rows of the last round, all requests together
        self.last_draft_rows = 0  # draft tree nodes of the last round, all requests together
        self.last_batch = 0  # requests the last round verified (at most max_batch; the rest of live waited)
        self.last_prefill_rows = 0  # prompt rows the last round prefilled
        self.last_expert_bytes = 0  # MoE: expert weights the last round's batched verify read
        # set while the drafter is unreachable: rounds are plain for everyone (no drafter call can stall
        # them) and a probe thread asks the drafter for its info until it answers, then clears it
        self.drafter_down = threading.Event()
        self.thread = threading.Thread(target=self._run, name="eyas-round-loop", daemon=True)
        self.thread.start()

    # --- the client side (any thread) ----------------------------------------------------------

    def set_drafter_info(self, drafter_info: dict) -> None:
        """The drafter deployment's ``info``, when it arrives after the loop started (a replica asks
        for it off its event loop). Its start-up draft cost replaces the prior, unless a cost was
        given or measured already."""
        with self.lock:
            self.drafter_info = drafter_info
            points = measured_draft_points(drafter_info)
            if points and not self._draft_cost_given:
                self.draft_cost = DraftCost.from_points(points)
                self._draft_cost_given = True

    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        method: str,
        tree: TreeSpec,
        sampling: SamplingParams,
        seed: int,
        on_tokens=None,
        cancel: threading.Event | None = None,
        logprobs: int | None = None,
        suffix: bool = False,
        learn: bool = True,
        stop_ids: tuple[int, ...] | None = None,
    ) -> concurrent.futures.Future:
        """-> a future of the ``GenerationResult``; validation errors of the prefill surface through it.
        ``logprobs``: each publish hands ``on_tokens`` its tokens' logprobs too (``on_tokens(tokens,
        logprobs)``), with this many top alternatives each. ``suffix``: suffix drafts grafted into the
        drafter's tree (method ``suffix``: suffix drafts alone). ``learn``: the request allows its
        committed rows to teach the drafter where the target captures traffic (``eyas.learning``).
        ``stop_ids``: the token ids that end the answer (``eyas.generate.stop_ids_for``: vLLM's
        ``ignore_eos`` and ``stop_token_ids``); None: the target's end-of-sequence ids."""
        live = Live(
            request_id=request_id,
            method=method,
            suffix=suffix,
            draft_slots=tree.draft_slots(len(prompt_ids), max_new_tokens),
            prompt_ids=list(prompt_ids),
            max_new_tokens=max_new_tokens,
            tree=tree,
            sampling=sampling,
            rng_seed=seed,
            on_tokens=on_tokens,
            future=concurrent.futures.Future(),
            cancel=cancel or threading.Event(),
            arrival=time.perf_counter(),
            acceptance=AcceptanceEstimate.from_prior(self.prior),
            logprobs=logprobs,
            learn=learn,
            stop_ids=stop_ids,
            processors=(sampling, tuple(prompt_ids)) if sampling.processes or sampling.grammar else None,
        )
        with self.lock:
            self.pending.append(live)
            self.lock.notify()
        return live.future

    def close(self) -> None:
        with self.lock:
            self.stopped = True
            self.lock.notify()
        self.thread.join(timeout=10)

    def load(self) -> int:
        return len(self.live) + len(self.pending)

    def work(self) -> dict[str, float]:
        """The tree work this loop carries (what its replica reports to the autoscaler).

        pending_verify_rows: verify rows still to run for every request here: a live request needs
                             about ``remaining tokens / its tokens per round`` more rounds of its last
                             round's rows; a request waiting for admission needs its prompt rows
                             (prefill) plus ``max_new_tokens`` plain rows (an upper bound: EOS may
                             come first). Example: a live request at 4 of 16 tokens after 2 rounds
                             of 3 rows (2 tokens a round) has 6 rounds x 3 rows = 18 rows left;
        draft_rows:          the last round's draft tree nodes, all requests together;
        expert_bytes:        MoE targets: expert weights the last round's verify read (0 when dense);
        live / pending:      requests in rounds / waiting for admission.
        batch:               requests the last round took (at most ``max_batch``; the other live ones
                             waited that round, their rows counted in ``pending_verify_rows``).
        """
        with self.lock:
            waiting = sum(len(x.prompt_ids) + x.max_new_tokens for x in self.pending)
            pending = len(self.pending)
        rows = 0.0
        live = _snapshot(self.live)
        for x in live:
            per_round = len(x.out) / len(x.rounds) if x.rounds else 1.0
            last_rows = x.rounds[-1].tree_nodes + 1 if x.rounds else 1
            rows += max(x.max_new_tokens - len(x.out), 0) / max(per_round, 1.0) * last_rows
            rows += len(x.prompt_ids) - x.prompt_done if x.seed is None else 0  # prompt rows still to prefill
        return {
            "pending_verify_rows": float(rows + waiting),
            "draft_rows": float(self.last_draft_rows if live else 0),
            "expert_bytes": float(self.last_expert_bytes if live else 0),
            "live": len(live),
            "pending": pending,
            "batch": self.last_batch if live else 0,
        }

    # --- the loop (its own thread) ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.stopped and not self.pending and not self.live:
                    self.lock.wait()
                if self.stopped:
                    break
                admitted, self.pending = self.pending, []
            if admitted:
                try:
                    self._admit(admitted)
                except Exception as err:  # never let admission stop the loop
                    log.exception("admission of %s failed", [x.request_id for x in admitted])
                    for live in admitted:
                        if live.request_id in self.live:
                            self._finish(live, FINISH_ERROR, err)
                        elif not live.future.done():
                            live.future.set_exception(err)
            for live in [x for x in self.live.values() if x.cancel.is_set()]:
                self._finish(live, FINISH_CANCELLED)
            if self.live:
                try:
                    self._round()
                except Exception as err:  # a worker failed for the whole batch: fail its requests, keep serving
                    log.exception("round failed")
                    for live in list(self.live.values()):
                        self._finish(live, FINISH_ERROR, err)

    def _admit(self, admitted: list[Live]) -> None:
        """Open the arrivals' target sessions; their prompts are prefilled by the rounds that follow,
        in chunks, in the same forward as everyone else's decoding (:meth:`_round`). A request
        refused here fails alone."""
        for live in admitted:
            if self._open(live):
                self.live[live.request_id] = live

    def _open(self, live: Live) -> bool:
        """The request's target session; a refusal (naming the field) fails its future."""
        info = self.drafter_info.get(live.method, {})
        taps = tuple(tuple(t) for t in info.get("taps", ())) if live.method != "target" else ()
        max_rows = verify_rows(live.tree, self.suffix_side.spec if live.suffix else None) if live.speculative else 1
        spec = wire.SessionSpec(
            request_id=live.request_id,
            prompt_ids=tuple(live.prompt_ids),
            max_new_tokens=live.max_new_tokens,
            max_tree_rows=max_rows,
            sampling=live.sampling,
            seed=live.rng_seed,
            taps=taps,
            logprobs=live.logprobs,
            learn=live.learn,
        )
        try:
            eos = self.target("open", spec)
            live.eos = tuple(eos) if live.stop_ids is None else live.stop_ids
            live.opened = time.perf_counter()
            live.cached_tokens = live.prompt_done = self.target("cached_tokens", live.request_id)
        except Exception as err:  # noqa: BLE001 - handed to the request's caller, which maps it
            live.future.set_exception(_as_value_error(err))
            return False
        return True

    def _round(self) -> None:
        """One round: plan, then the round step (``eyas.step.round_step``): propose, ONE target call
        (``TargetWorker.step``) that runs the prompts' next prefill chunks (at most ``max_prefill_rows``
        rows, shortest prompt first) and the planned verifies in one forward, and ONE publish call."""
        prefilling = [x for x in self.live.values() if x.seed is None]
        decoding = [x for x in self.live.values() if x.seed is not None]
        prefill_rows = sum(len(x.prompt_ids) - x.prompt_done for x in prefilling)
        if self.max_prefill_rows is not None:
            prefill_rows = min(prefill_rows, self.max_prefill_rows)
        cands = [
            Candidate(
                x.request_id,
                x.arrival,
                len(x.prompt_ids),
                len(x.prompt_ids) + len(x.out) - 1,
                x.acceptance if x.speculative else NEVER_ACCEPTS,
                Seed.total_rows(x.unread) if x.speculative else 0,
                speculative=x.speculative,
            )
            for x in decoding
        ]
        backlog = {c.request_id: c.draft_backlog for c in cands}
        plan = (
            self.policy.plan(cands, self.curve, self.draft_cost, self.experts, prefill_rows=prefill_rows)
            if cands
            else None
        )  # plan
        shapes = {rid: self._fit(self.live[rid], shape) for rid, shape in plan.shapes.items()} if plan else {}
        batch = [self.live[rid] for rid in shapes]
        for x in prefilling:  # no drafter for its method (by the time its prompt is done): target-only
            if x.speculative and x.method != SUFFIX and (self.drafter is None or x.method not in self.drafter_info):
                x.fallback = True
        start_ns = time.time_ns()
        neural = None if self.drafter_down.is_set() else self.drafter_side
        suffixed = any(x.method == SUFFIX or x.suffix for x in [*batch, *prefilling])
        r = round_step(
            self.target_side,
            self.suffix_side.over(neural) if suffixed else neural,
            [(x, self._tree(x, shapes[x.request_id])) for x in batch],
            prefilling,
            self.max_prefill_rows,
        )  # the round step
        if r.drafter_lost:
            log.warning("drafter unavailable: rounds are plain until it answers again; then reseeding")
            self._drafter_lost()
        drafted = [rid for rid, t in r.trees.items() if t.num_nodes]
        if batch:
            self.draft_cost.observe(
                max((shapes[rid].depth_cap for rid in drafted), default=0),
                1000 * r.draft_s,
                sum(shapes[rid].drafter_rows(backlog[rid]) for rid in drafted),
            )
        ran_prefill_rows = self._prefill_progress(prefilling, r)
        decided = [(live, v) for live, v in zip(batch, r.verdicts) if isinstance(v, Decided)]
        for live, v in zip(batch, r.verdicts):
            if isinstance(v, Refusal):
                self._finish(live, FINISH_ERROR, ValueError(v.message))
        pack_s = max((v.pack_s for _, v in decided), default=0.0)
        rows = sum(t.num_nodes + 1 for t in r.trees.values())
        self.last_verify_rows, self.last_draft_rows = rows, rows - len(r.trees)
        self.last_prefill_rows = ran_prefill_rows
        self.last_batch = len(batch)
        self.curve.observe(rows + ran_prefill_rows, 1000 * (r.verify_s - pack_s))
        if not batch:  # a round that only prefilled
            return
        self.rounds += 1  # rounds that decoded
        self.last_expert_bytes = max((v.batch_expert_bytes for _, v in decided), default=0)
        self.experts.observe(rows + ran_prefill_rows, self.last_expert_bytes)
        accept_s = max((v.accept_s for _, v in decided), default=0.0)
        for live, v in decided:
            ack = r.published[live.request_id]
            if isinstance(ack, Refusal):
                self._finish(live, FINISH_ERROR, ValueError(ack.message))
                continue
            nodes = r.trees[live.request_id].num_nodes
            if nodes:
                live.acceptance.observe(v.decision.accept_length, shapes[live.request_id].depth_cap)
                self.prior.observe(v.decision.accept_length, shapes[live.request_id].depth_cap, weight=PRIOR_EMA)
            live.rounds.append(RoundStats.of(r, v))
            if self.on_round is not None:
                self.on_round(
                    RoundRecord.of(r, v, start_ns=start_ns, fallback=live.fallback, pack_s=pack_s, accept_s=accept_s)
                )
            self._emit(live, list(ack.tokens), ack.logprobs)

    def _prefill_progress(self, prefilling: list[Live], r) -> int:
        """Each prefilling request's part of the round ``r``: a refusal fails it; a ``PrefillProgress``
        moves its prefilled count on; a finished prompt's publish (round 0) sends its first token
        (its draft session was opened by the step). -> the prompt rows this round ran."""
        before = sum(x.prompt_done for x in prefilling)
        for live, reply in zip(prefilling, r.prefills):
            if isinstance(reply, Refusal):
                self._finish(live, FINISH_ERROR, ValueError(reply.message))
            elif isinstance(reply, PrefillProgress):
                live.prompt_done = reply.prefilled
            else:
                live.prompt_done = len(live.prompt_ids)
                ack = r.published[live.request_id]
                if isinstance(ack, Refusal):
                    self._finish(live, FINISH_ERROR, ValueError(ack.message))
                    continue
                live.prefill_s = time.perf_counter() - live.arrival
                self._emit(live, list(ack.tokens), ack.logprobs)
        return sum(x.prompt_done for x in prefilling) - before

    # --- helpers ------------------------------------------------------------------------------------
    def _fit(self, live: Live, shape: TreeShape) -> TreeShape:
        """The planned tree, within the request's own knobs (and none when it cannot draft)."""
        if not live.speculative or live.needs_reseed and not live.drafter_open:
            return PLAIN
        t = live.tree
        if live.sampling.temperature > 0:  # seeded sampling stays reproducible: always the request's own tree
            return TreeShape(t.expand_width, t.max_depth, t.max_candidates)
        if t.kind != "dynamic":  # static and chain trees are the request's explicit choice
            return TreeShape(t.expand_width, t.max_depth, t.max_candidates) if shape.speculates else PLAIN
        return (
            TreeShape(
                min(shape.expand_width, t.expand_width),
                min(shape.max_depth, t.max_depth),
                min(shape.verify_budget, t.verify_budget),
            )
            if shape.speculates
            else PLAIN
        )

    def _tree(self, live: Live, shape: TreeShape) -> TreeSpec | None:
        """The tree a planned shape gives the request this round (None: a plain round)."""
        if not shape.speculates:
            return None
        if live.tree.kind != "dynamic" or live.sampling.temperature > 0:
            return live.tree
        return tree_spec(shape, live.tree)

    def _drafter_lost(self) -> None:
        """Plain rounds for everyone from now on, and a probe that lifts that once the drafter (a
        replacement replica, typically) answers; design 0x05D reseeds then bring each request back."""
        if self.drafter_down.is_set():
            return
        self.drafter_down.set()
        threading.Thread(target=self._probe_drafter, name="eyas-drafter-probe", daemon=True).start()

    def _probe_drafter(self) -> None:
        while self.drafter_down.is_set() and not self.stopped:
            try:
                self.drafter("info")
            except DrafterUnavailable:
                time.sleep(DRAFTER_PROBE_S)
                continue
            except Exception as err:  # noqa: BLE001 - an answer, even an error, means it is up: said
                log.warning("the drafter answered info with an error (%s: %s); it is up", type(err).__name__, err)
            log.info("the drafter answers again: reseeding the draft sessions")
            self.drafter_down.clear()

    def _emit(self, live: Live, tokens: list[int], logprobs: tuple | None = None) -> None:
        live.out.extend(tokens)
        if live.on_tokens is not None and (
            live.on_tokens(tokens) if live.logprobs is None else live.on_tokens(tokens, logprobs)
        ):
            live.stopped = True
        if is_finished(live.out, live.max_new_tokens, live.eos, tokens, live.stopped):
            self._finish(live, None)

    def _close_draft_session(self, request_id: str) -> None:
        try:
            self.drafter("close_session", request_id)
        except (DrafterUnavailable, ValueError) as err:  # a lost drafter's sessions went with it; a refusal: gone
            log.debug("drafter close_session %s: %s", request_id, err)
        except Exception as err:  # noqa: BLE001 - unexpected: said; the request is finished either way
            log.warning("drafter close_session %s failed (%s: %s)", request_id, type(err).__name__, err)

    def _close_late(self, request_id: str) -> None:
        """Close a finished request's draft session again after each of ``LATE_CLOSE_S`` (a refusal:
        nothing was left). It goes on after the loop closes: the drafter deployment outlives a target
        replica."""
        waited = 0.0
        for delay in LATE_CLOSE_S:
            time.sleep(max(delay - waited, 0.0))
            waited = delay
            self._close_draft_session(request_id)

    def _finish(self, live: Live, reason: str | None, err: Exception | None = None) -> None:
        if live.future.done():
            return
        self.live.pop(live.request_id, None)
        try:
            self.target("close", live.request_id)
        except Exception:
            log.exception("close_session %s", live.request_id)
        # a drafter method's session may outlive what the loop knows of it (a call that failed or timed out
        # after the drafter opened it): it is closed whenever one may exist; a drafter without it refuses
        may_hold = live.drafter_open or (
            live.method != "target" and (live.needs_reseed or live.reseeds or live.fallback)
        )
        if not self.suffix_side.forget(live.request_id) and may_hold and self.drafter is not None:
            if self.drafter_down.is_set():  # it would wait out the call's timeout: the round loop must not
                threading.Thread(
                    target=self._close_draft_session, args=(live.request_id,), name="eyas-drafter-close", daemon=True
                ).start()
            else:
                self._close_draft_session(live.request_id)
            if live.needs_reseed or live.reseeds or live.fallback:  # a call of its failed: it may still run
                threading.Thread(
                    target=self._close_late, args=(live.request_id,), name="eyas-drafter-late-close", daemon=True
                ).start()
        if err is not None and reason == FINISH_ERROR and not live.out:
            live.future.set_exception(_as_value_error(err))
            return
        tokens, finished_as = finish(live.out, live.max_new_tokens, live.eos, stopped=live.stopped)
        if keeps_answer(reason or finished_as, live.learn):
            self.suffix_side.remember(tokens)  # later requests may copy from it (learn: false keeps nothing)
        now = time.perf_counter()
        wall = now - live.arrival
        result = GenerationResult(
            token_ids=tokens,
            finish_reason=reason or finished_as,
            prefill_s=live.prefill_s,
            wall_s=wall,
            rounds=tuple(live.rounds),
            drafter_fallback=live.fallback,
            drafter_reseeds=live.reseeds,
            cached_tokens=live.cached_tokens,
            drafter_version=live.drafter_version,
            queue_s=max((live.opened or now) - live.arrival, 0.0),
        )
        if self.on_finish is not None:
            self.on_finish(live.request_id, result)
        live.future.set_result(result)


def tree_spec(shape: TreeShape, request_tree: TreeSpec | None = None) -> TreeSpec:
    """The dynamic tree of a planned shape that speculates, with the request tree's value floors."""
    assert shape.speculates, shape
    return TreeSpec(
        kind="dynamic",
        expand_width=max(shape.expand_width, 1),
        max_depth=shape.max_depth,
        verify_budget=shape.verify_budget,
        min_value=request_tree.min_value if request_tree is not None else 0.0,
        expand_min_value=request_tree.expand_min_value if request_tree is not None else 0.0,
    )


def _snapshot(live: dict) -> list:
    """The values of a dict the loop thread may be changing (another thread reads it for stats)."""
    while True:
        try:
            return list(live.values())
        except RuntimeError:  # changed size during the copy: copy again
            continue


def _as_value_error(err: Exception) -> Exception:
    """A refusal from a worker, as the ValueError naming the field (the ingress maps it to INVALID_ARGUMENT)."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, (ValueError, LookupError)):
        return ValueError(str(cause.args[0]) if cause.args else str(cause))
    return err
