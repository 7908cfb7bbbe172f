"""``BatchRunner``: many requests decoded round by round, each round ONE batched target forward.

Each round (seed 0x09):

    admit   -> ``TargetEngine.prefill_batch``: the requests submitted since the last round, their
               prompts in one packed forward, each prefill published on its own
    plan    -> the policy picks the batch and each request's tree from the latency curve and the
               requests' recent acceptance (eyas.scheduler.policy)
    propose -> ``DrafterEngine.propose_batch``: the drafter grows every planned request's tree, each
               growth step of all requests in one packed drafter pass; a request planned plain is not
               drafted at all, and its seeds queue up until it drafts again (``Seed.join``)
    verify  -> ``TargetEngine.verify_batch``: every request's rows in one forward, each with its own
               KV cache and tree mask (a ragged batch)
    accept  -> per request, the same pure decision as the single-request loop
    publish -> per request, its own transaction: one request's failure never touches another's state

The runner owns the per-request scheduling state (:class:`Running`); the engines own the KV. The
latency curve is updated from every round's measured verify time, and each request's acceptance
estimate from its accepted length.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.generate import FINISH_LENGTH, decide, finish_tokens
from eyas.protocol.messages import Seed
from eyas.protocol.tree import DraftTree
from eyas.scheduler.cost import ExpertTraffic, TreeShape, prefill_chunks
from eyas.scheduler.latency import DraftCost, LatencyCurve
from eyas.scheduler.policy import PRIOR_EMA, AcceptanceEstimate, Candidate, Plan
from eyas.target.engine import TargetEngine
from eyas.verification.sampling import SamplingParams

CONSUME_SEED_ONLY = TreeSpec(kind="chain", max_depth=0)  # plain decoding: the drafter appends context rows only


def tree_spec(shape: TreeShape) -> TreeSpec:
    if not shape.speculates:
        return CONSUME_SEED_ONLY
    return TreeSpec(kind="dynamic", expand_width=max(shape.expand_width, 1), max_depth=shape.max_depth,
                    verify_budget=shape.verify_budget)


@dataclass
class Running:
    """One live request's scheduling state. Only :class:`BatchRunner` touches it."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator
    stop_ids: tuple[int, ...]
    arrival: float
    acceptance: AcceptanceEstimate
    seed: Seed | None = None          # the last publish's seed
    unread: list[Seed] = field(default_factory=list)  # seeds the drafter has not read yet, in order
    out: list[int] = field(default_factory=list)
    rounds: int = 0
    speculative_rounds: int = 0
    first_token_s: float | None = None
    finished_s: float | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.out) >= self.max_new_tokens or any(t in self.stop_ids for t in self.out)


@dataclass(frozen=True)
class Finished:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    rounds: int
    speculative_rounds: int
    arrival: float
    first_token_s: float
    finished_s: float
    error: str | None = None


@dataclass(frozen=True)
class RoundLog:
    batch: int
    verify_rows: int
    verify_ms: float
    predicted_ms: float
    new_tokens: int
    expert_bytes: int = 0   # MoE targets: expert weights the batch's verify rows routed to (seed 0x09A)
    predicted_expert_bytes: int = 0   # ... as the plan predicted them


class BatchRunner:
    def __init__(self, target: TargetEngine, drafter: DrafterEngine | None, policy, curve: LatencyCurve,
                 max_tree_rows: int = 33, draft_cost: DraftCost | None = None):
        """``draft_cost``: the scheduler's starting cost of drafting (e.g. ``DraftCost.from_points(
        drafter.measure_cost(...))``); by default the optimistic prior, which live rounds refit."""
        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.curve = curve
        self.draft_cost = draft_cost if draft_cost is not None else DraftCost()
        self.experts = ExpertTraffic(**target.expert_traffic_shape())   # MoE: calibrated by live verifies
        self.max_tree_rows = max_tree_rows if drafter is not None else 1
        self.prior = AcceptanceEstimate()
        self.running: dict[str, Running] = {}
        self.admitting: dict[str, Running] = {}   # submitted, prefilled together at the next step
        self.finished: dict[str, Finished] = {}
        self.log: list[RoundLog] = []

    # --- admission ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), seed: int = 0) -> None:
        """Open the request's sessions (validation errors raise here, naming the field); its prefill
        runs at the next :meth:`step`, batched with every other request submitted since the last one."""
        self.target.open_session(request_id, prompt_ids, max_new_tokens, self.max_tree_rows)
        try:
            if self.drafter is not None:
                self.drafter.open_session(request_id, len(prompt_ids) + max_new_tokens + 2 * self.max_tree_rows
                                          + 8 * self.max_tree_rows)
        except Exception:
            self._close(request_id)
            raise
        self.admitting[request_id] = Running(request_id, list(prompt_ids), max_new_tokens, sampling,
                                             torch.Generator().manual_seed(seed), tuple(self.target.cfg.eos_token_ids),
                                             time.perf_counter(), AcceptanceEstimate.from_prior(self.prior))

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (admitting or running)."""
        return len(self.admitting) + len(self.running)

    def _admit(self) -> None:
        """Prefill every submitted request in batched forwards (one per ``MAX_PREFILL_ROWS`` prompt
        rows), then publish each (its own transaction)."""
        admitting, self.admitting = list(self.admitting.values()), {}
        for chunk in prefill_chunks([len(r.prompt_ids) for r in admitting]):
            self._prefill([admitting[i] for i in chunk])

    def _prefill(self, admitting: list[Running]) -> None:
        verified = self.target.prefill_batch([r.request_id for r in admitting])
        for r, v in zip(admitting, verified):
            try:
                if isinstance(v, ValueError):
                    raise v
                r.seed, ack = self.target.publish(r.request_id, v.round, decide(v, r.prompt_ids, r.sampling,
                                                                                r.generator))
            except ValueError as err:
                r.error = str(err)
                self._finish(r)
                continue
            r.unread = [r.seed]
            r.out.extend(ack.output_tokens)
            r.first_token_s = time.perf_counter()
            self.running[r.request_id] = r
            if r.done:
                self._finish(r)

    # --- one round ------------------------------------------------------------------------------
    def step(self) -> Plan | None:
        self._admit()                                                                         # admit
        if not self.running:
            return None
        candidates = [Candidate(r.request_id, r.arrival, len(r.prompt_ids), len(r.prompt_ids) + len(r.out) - 1,
                                r.acceptance, Seed.total_rows(r.unread) if self.drafter else 0)
                      for r in self.running.values()]
        plan = self.policy.plan(candidates, self.curve, self.draft_cost, self.experts)       # plan
        if not plan.shapes:
            raise RuntimeError("scheduler: no request fits the budgets")
        trees = {rid: DraftTree.empty() for rid in plan.shapes}
        drafting = [rid for rid, shape in plan.shapes.items() if shape.speculates and self.drafter is not None]
        if drafting:                                                                         # propose (batched)
            t0 = time.perf_counter()
            for rid in drafting:
                if self.drafter.sessions[rid].provisional_len:
                    self.drafter.publish(rid)
            items = [(rid, Seed.join(self.running[rid].unread), tree_spec(plan.shapes[rid])) for rid in drafting]
            for rid in drafting:
                self.running[rid].unread = []
            trees.update(zip(drafting, self.drafter.propose_batch(items)))
            backlog = {c.request_id: c.draft_backlog for c in candidates}
            self.draft_cost.observe(max(plan.shapes[rid].depth_cap for rid in drafting),
                                    1000 * (time.perf_counter() - t0),
                                    sum(plan.shapes[rid].drafter_rows(backlog[rid]) for rid in drafting))
        items = list(trees.items())
        t0 = time.perf_counter()
        verified = self.target.verify_batch(items)                                            # verify
        verify_ms = 1000 * (time.perf_counter() - t0)
        rows = sum(v.flat.num_rows for v in verified if not isinstance(v, ValueError))
        self.curve.observe(rows, verify_ms)
        self.experts.observe(rows, self.target.last_expert_bytes)
        new_tokens = 0
        for (rid, tree), v in zip(items, verified):
            r = self.running[rid]
            try:
                if isinstance(v, ValueError):
                    raise v
                decision = decide(v, r.prompt_ids, r.sampling, r.generator)                  # accept
                seed, ack = self.target.publish(rid, v.round, decision)                      # publish
                # after a plain round the drafter reads this seed and the unread ones before it together
                r.seed = seed
                r.unread = r.unread + [seed] if self.drafter is not None else [seed]
            except ValueError as err:
                r.error = str(err)
                self._finish(r)
                continue
            r.out.extend(ack.output_tokens)
            new_tokens += len(ack.output_tokens)
            r.rounds += 1
            shape = plan.shapes[rid]
            if tree.num_nodes:
                r.speculative_rounds += 1
                r.acceptance.observe(decision.accept_length, shape.depth_cap)
                self.prior.observe(decision.accept_length, shape.depth_cap, weight=PRIOR_EMA)
            if r.done:
                self._finish(r)
        self.log.append(RoundLog(len(items), rows, verify_ms, plan.predicted_ms, new_tokens,
                                 self.target.last_expert_bytes, plan.expert_bytes))
        return plan

    def run(self) -> dict[str, Finished]:
        while self.in_flight:
            self.step()
        return self.finished

    def cancel(self, request_id: str) -> None:
        r = self.running.get(request_id) or self.admitting.pop(request_id, None)
        if r is not None:
            r.error = "cancelled"
            self._finish(r)

    # --- internals ------------------------------------------------------------------------------
    def _finish(self, r: Running) -> None:
        self.running.pop(r.request_id, None)
        self._close(r.request_id)
        tokens, reason = finish_tokens(r.out, r.max_new_tokens, r.stop_ids)
        if r.error is not None:
            reason = "cancelled" if r.error == "cancelled" else "error"
        self.finished[r.request_id] = Finished(r.request_id, tokens, reason if reason else FINISH_LENGTH, r.rounds,
                                               r.speculative_rounds, r.arrival, r.first_token_s or time.perf_counter(),
                                               time.perf_counter(), r.error)

    def _close(self, request_id: str) -> None:
        self.target.close_session(request_id)
        if self.drafter is not None:
            self.drafter.close_session(request_id)

