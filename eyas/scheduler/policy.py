"""Scheduling policies: which requests go into a round's batch, and each one's tree.

``TreeWorkPolicy`` (the Eyas policy) maximises expected accepted tokens per second of the batch:

    J(batch, trees) = sum_i (1 + E_i[accepted | tree_i]) / (latency(sum_i verify_rows_i)
                                                           + draft(max_i depth_i, sum_i drafted_rows_i))

where ``drafted_rows_i`` is request i's tree rows plus its backlog of context rows the drafter has
not read yet (its whole prompt in its first drafting round, or the rows of the rounds it spent
plain), both 0 for a plain request; ``latency`` is the measured :class:`~eyas.scheduler.latency.LatencyCurve`, ``draft`` the
measured :class:`~eyas.scheduler.latency.DraftCost` of the round's drafting (0 when nobody drafts) and ``E_i`` comes
from the request's recent acceptance (:class:`AcceptanceEstimate`: per-depth acceptance rates, an
exponential average of what its rounds accepted, started from the prior that all requests'
observed acceptance gives). Every admitted request starts with plain decoding (one row); trees are
upgraded greedily while J improves and the budgets on verify rows and KV bytes hold. A move raises
one request's tree, or raises every request to one shape at once: the drafting cost's part per depth
is paid once per round (its part per draft row by each request), so where one request's gain cannot
pay for it the whole batch's may. When verify rows are expensive (a steep curve), drafting is slow
or a request's drafts are rarely accepted, no upgrade pays and speculation shrinks to plain
decoding, for that request or all. On a mixture-of-experts target a verify reads the union of the
experts its rows route to (design 0x09A), which grows with the batch's rows (:class:`ExpertTraffic`);
``Budgets.max_expert_bytes`` caps it, for admissions and tree upgrades alike.

``PromptLengthPolicy`` (the baseline, selectable by config): batches of requests with similar prompt
lengths, every one with the same fixed tree.

Pure: counts and curves in, a :class:`Plan` out. No model, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eyas.scheduler.cost import PLAIN, ExpertTraffic, RoundWork, TreeShape, round_work
from eyas.scheduler.latency import DraftCost, LatencyCurve

MAX_DEPTH = 8
DEFAULT_SHAPES = (
    PLAIN,
    TreeShape(1, 1, 1),
    TreeShape(2, 2, 3),
    TreeShape(2, 3, 6),
    TreeShape(4, 4, 10),
    TreeShape(4, 5, 16),
    TreeShape(8, 6, 32),
)
# P(accept depth d | accepted d-1) before any data: the shipped EAGLE-3 drafter's (stage 12's 500k point),
# measured on all 80 MT-bench first turns at fp16w with a plain 2/4/8 tree (bench/results/trees-fp16w-stage12.json:
# accept@d 51.2, 26.4, 10.2, 3.2 %, so 0.512, 0.516, 0.386, 0.314); deeper than measured, 0.3
PRIOR_RATES = (0.51, 0.52, 0.39, 0.31, 0.3, 0.3, 0.3, 0.3)
EMA = 0.3
PRIOR_EMA = 0.2  # how fast the all-requests prior (a new request's starting estimate) follows observed acceptance
MIN_GAIN = 1e-3  # relative improvement of J an upgrade must bring


@dataclass
class AcceptanceEstimate:
    """Per-depth conditional acceptance rates of one request (or the prior of all requests).

    rate[d-1] = P(at least d candidates accepted | at least d-1 accepted), over rounds whose tree
    could accept d. Expected accepted tokens of a tree that reaches depth D: sum_{d<=D} prod_{j<=d} rate_j.
    """

    rates: list[float] = field(default_factory=lambda: list(PRIOR_RATES))
    rounds: int = 0

    def observe(self, accept_length: int, depth_cap: int, weight: float = EMA) -> None:
        for d in range(1, min(depth_cap, MAX_DEPTH) + 1):
            if accept_length >= d - 1:  # the round reached depth d-1, so depth d was a trial
                hit = 1.0 if accept_length >= d else 0.0
                self.rates[d - 1] += weight * (hit - self.rates[d - 1])
        self.rounds += 1

    def expected(self, depth: int) -> float:
        total, p = 0.0, 1.0
        for d in range(min(depth, MAX_DEPTH)):
            p *= self.rates[d]
            total += p
        return total

    @classmethod
    def from_prior(cls, prior: AcceptanceEstimate) -> AcceptanceEstimate:
        return cls(list(prior.rates), 0)


@dataclass(frozen=True)
class Candidate:
    """A live request waiting for its next round."""

    request_id: str
    arrival: float  # monotonic seconds at admission
    prompt_len: int
    committed_len: int
    acceptance: AcceptanceEstimate
    draft_backlog: int = 0  # context rows the drafter must read before this request can draft (unread seeds)
    speculative: bool = True  # False: a target-only request, which never drafts (one verify row a round)


@dataclass(frozen=True)
class Budgets:
    max_batch: int = 16
    max_verify_rows: int = 128
    max_kv_bytes: int = 1 << 34
    target_kv_bytes_per_row: int = 0
    draft_kv_bytes_per_row: int = 0
    max_expert_bytes: int | None = None  # MoE: expert weights one verify may read (None: no cap; design 0x09A)


@dataclass(frozen=True)
class Plan:
    shapes: dict[str, TreeShape]  # the batch: request id -> its tree this round (PLAIN = no drafting)
    work: tuple[RoundWork, ...]
    predicted_ms: float
    expected_tokens: float
    expert_bytes: int = 0  # MoE: predicted union of expert weights the batch's verify reads

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.expected_tokens / self.predicted_ms if self.predicted_ms > 0 else 0.0

    @property
    def verify_rows(self) -> int:
        return sum(w.verify_rows for w in self.work)


NO_EXPERTS = ExpertTraffic()  # a dense target


def _work(c: Candidate, shape: TreeShape, b: Budgets, experts: ExpertTraffic = NO_EXPERTS) -> RoundWork:
    """One request's round; its ``expert_bytes`` are those its own verify rows would read alone."""
    return round_work(
        c.request_id,
        shape,
        committed_len=c.committed_len,
        target_kv_bytes_per_row=b.target_kv_bytes_per_row,
        draft_kv_bytes_per_row=b.draft_kv_bytes_per_row,
        expert_bytes=experts.predict(shape.verify_rows),
    )


def _experts_fit(experts: ExpertTraffic, rows: int, b: Budgets) -> bool:
    """Whether a verify of ``rows`` rows in all stays within the expert-bytes budget."""
    return b.max_expert_bytes is None or experts.predict(rows) <= b.max_expert_bytes


class TreeWorkPolicy:
    name = "tree-work"

    def __init__(
        self, budgets: Budgets = Budgets(), shapes: tuple[TreeShape, ...] = DEFAULT_SHAPES, speculate: bool = True
    ):
        self.budgets = budgets
        self.shapes = tuple(sorted(set(shapes) | {PLAIN}, key=lambda s: (s.verify_rows, s.draft_rows)))
        self.speculate = speculate

    def plan(
        self,
        waiting: list[Candidate],
        curve: LatencyCurve,
        draft: DraftCost | None = None,
        experts: ExpertTraffic = NO_EXPERTS,
        prefill_rows: int = 0,
    ) -> Plan:
        """The batch and its trees. ``draft`` is what drafting adds to a round (None: free);
        ``experts`` predicts an MoE target's expert bytes, held to ``budgets.max_expert_bytes``
        (the oldest request is always admitted: one row must be able to run). ``prefill_rows``:
        prompt rows the same forward carries (chunked prefill); they cost latency like verify rows,
        so a round that prefills makes every tree's rows dearer, but they take no verify budget."""
        b = self.budgets
        batch: list[Candidate] = []
        rows = kv = 0
        for c in sorted(waiting, key=lambda c: c.arrival):  # admission: oldest first, plain work must fit
            w = _work(c, PLAIN, b)
            if (
                len(batch) == b.max_batch
                or rows + w.verify_rows > b.max_verify_rows
                or kv + w.kv_bytes > b.max_kv_bytes
            ):
                continue
            if batch and not _experts_fit(experts, rows + w.verify_rows, b):
                continue
            batch.append(c)
            rows, kv = rows + w.verify_rows, kv + w.kv_bytes
        if not batch:
            return Plan({}, (), 0.0, 0.0)
        level = {c.request_id: 0 for c in batch}  # index into self.shapes
        draft_ms = draft.predict if draft is not None else (lambda depth, rows=0: 0.0)

        # per request and shape index, computed once: expected tokens, KV bytes, drafter rows
        n_shapes = len(self.shapes)
        tok = {c.request_id: [1.0 + c.acceptance.expected(s.depth_cap) for s in self.shapes] for c in batch}
        kvb = {c.request_id: [_work(c, s, b).kv_bytes for s in self.shapes] for c in batch}
        drw = {c.request_id: [s.drafter_rows(c.draft_backlog) for s in self.shapes] for c in batch}
        vrows = [s.verify_rows for s in self.shapes]
        caps = [s.depth_cap for s in self.shapes]

        total_tokens = sum(tok[c.request_id][0] for c in batch)
        depth = 0  # the deepest tree in the batch (0: nobody drafts)
        drows = 0  # draft rows of the batch's trees, all together
        latency = lambda verify_rows: curve.predict(verify_rows + prefill_rows)  # noqa: E731
        best_j = total_tokens / (latency(rows) + draft_ms(depth, drows))
        while self.speculate:
            # a move raises one request's tree, or every request to one shape at once (the round's
            # drafting cost is paid once, so one request alone may not pay for it where all do);
            # each move as (new levels, d_tokens, d_rows, d_kv, new depth, d_draft_rows)
            moves = []
            for rid, cur in level.items():
                t, kvr, dr = tok[rid], kvb[rid], drw[rid]
                for nxt in range(cur + 1, n_shapes):
                    moves.append(
                        (
                            {rid: nxt},
                            t[nxt] - t[cur],
                            vrows[nxt] - vrows[cur],
                            kvr[nxt] - kvr[cur],
                            max(depth, caps[nxt]),
                            dr[nxt] - dr[cur],
                        )
                    )
            for k in range(1, n_shapes):
                up = {rid: k for rid, i in level.items() if i < k}
                if len(up) > 1:
                    moves.append(
                        (
                            up,
                            sum(tok[r][k] - tok[r][level[r]] for r in up),
                            sum(vrows[k] - vrows[level[r]] for r in up),
                            sum(kvb[r][k] - kvb[r][level[r]] for r in up),
                            max(depth, caps[k]),
                            sum(drw[r][k] - drw[r][level[r]] for r in up),
                        )
                    )
            best = None
            for up, d_tok, d_rows, d_kv, new_depth, d_drows in moves:
                if (
                    rows + d_rows > b.max_verify_rows
                    or kv + d_kv > b.max_kv_bytes
                    or not _experts_fit(experts, rows + d_rows, b)
                ):
                    continue
                j = (total_tokens + d_tok) / (latency(rows + d_rows) + draft_ms(new_depth, drows + d_drows))
                if j > best_j * (1 + MIN_GAIN) and (best is None or j > best[0]):
                    best = (j, up, d_tok, d_rows, d_kv, new_depth, d_drows)
            if best is None:
                break
            best_j, up, d_tok, d_rows, d_kv, depth, d_drows = best
            level.update(up)
            rows, kv, total_tokens, drows = rows + d_rows, kv + d_kv, total_tokens + d_tok, drows + d_drows
        shapes = {c.request_id: self.shapes[level[c.request_id]] for c in batch}
        work = tuple(_work(c, shapes[c.request_id], b, experts) for c in batch)
        return Plan(shapes, work, latency(rows) + draft_ms(depth, drows), total_tokens, experts.predict(rows))


class PromptLengthPolicy:
    """The baseline: a batch of requests with the closest prompt lengths, all with one fixed tree."""

    name = "prompt-length"

    def __init__(self, budgets: Budgets = Budgets(), shape: TreeShape = TreeShape(4, 5, 16)):
        self.budgets = budgets
        self.shape = shape

    def plan(
        self,
        waiting: list[Candidate],
        curve: LatencyCurve,
        draft: DraftCost | None = None,
        experts: ExpertTraffic = NO_EXPERTS,
        prefill_rows: int = 0,
    ) -> Plan:
        """The fixed tree for every speculative member (a target-only one runs plainly, one row); MoE
        expert bytes are predicted and reported, not budgeted; ``prefill_rows`` add to the predicted
        latency only."""
        if not waiting:
            return Plan({}, (), 0.0, 0.0)
        b = self.budgets
        oldest = min(waiting, key=lambda c: c.arrival)
        by_len = sorted(waiting, key=lambda c: (abs(c.prompt_len - oldest.prompt_len), c.arrival))
        batch, rows, kv = [], 0, 0
        for c in by_len:
            w = _work(c, self._shape(c), b)
            if (
                len(batch) == b.max_batch
                or rows + w.verify_rows > b.max_verify_rows
                or kv + w.kv_bytes > b.max_kv_bytes
            ):
                continue
            batch.append(c)
            rows, kv = rows + w.verify_rows, kv + w.kv_bytes
        if not batch:  # the fixed tree does not fit: the oldest request alone, plainly
            shapes = {oldest.request_id: PLAIN}
            batch = [oldest]
        else:
            shapes = {c.request_id: self._shape(c) for c in batch}
        work = tuple(_work(c, shapes[c.request_id], b, experts) for c in batch)
        expected = sum(1.0 + c.acceptance.expected(shapes[c.request_id].depth_cap) for c in batch)
        drafting = [c for c in batch if shapes[c.request_id].speculates]
        ms = curve.predict(sum(w.verify_rows for w in work) + prefill_rows) + (
            draft.predict(self.shape.depth_cap, sum(self.shape.drafter_rows(c.draft_backlog) for c in drafting))
            if draft is not None and drafting
            else 0.0
        )
        return Plan(shapes, work, ms, expected, experts.predict(sum(w.verify_rows for w in work)))

    def _shape(self, c: Candidate) -> TreeShape:
        return self.shape if c.speculative else PLAIN


POLICIES = {"tree-work": TreeWorkPolicy, "prompt-length": PromptLengthPolicy}
