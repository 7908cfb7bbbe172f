"""The scheduler's cost model: the work one request's round puts on the drafter and the target.

Seed 0x09 ("Scheduler-visible work"): draft rows, draft-tree nodes, draft KV bytes, target
verification rows, temporary target branch-KV bytes, accepted progress; design 0x09A: for a
mixture-of-experts target, the expert weights the verify rows route to.

Pure functions over counts: no model, no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass

ROOT_ROWS = 1  # every verify carries the frontier token as its root row


@dataclass(frozen=True)
class TreeShape:
    """A tree the scheduler may give a request for one round (EAGLE-2's three knobs, design 0x06D).

    ``verify_budget == 0`` is plain decoding: no drafting, one verify row.
    """

    expand_width: int
    max_depth: int
    verify_budget: int

    def __post_init__(self):
        for name in ("expand_width", "max_depth", "verify_budget"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ValueError(f"tree.{name}: {getattr(self, name)!r} is not a count")

    @property
    def speculates(self) -> bool:
        return self.verify_budget > 0 and self.max_depth > 0

    @property
    def verify_rows(self) -> int:
        return ROOT_ROWS + (self.verify_budget if self.speculates else 0)

    @property
    def tree_nodes(self) -> int:
        return self.verify_budget if self.speculates else 0

    @property
    def draft_rows(self) -> int:
        """Drafter rows written this round: the expanded nodes (width per depth below the last)."""
        return self.expand_width * max(self.max_depth - 1, 0) if self.speculates else 0

    def drafter_rows(self, backlog: int) -> int:
        """Rows the drafter packs for a request at this shape: its ``backlog`` of context rows not yet
        read (unread seeds), then its tree's draft rows; 0 when it does not draft."""
        return self.draft_rows + backlog if self.speculates else 0

    @property
    def depth_cap(self) -> int:
        """The most candidate tokens one round can accept."""
        return min(self.max_depth, self.verify_budget) if self.speculates else 0


PLAIN = TreeShape(0, 0, 0)
DEFAULT_PREFILL_CHUNK = (
    128  # prompt rows one serving round may prefill, all requests together (measured: docs/benchmarks.md)
)


@dataclass(frozen=True)
class RoundWork:
    """What one request's round costs (design 0x09)."""

    request_id: str
    tree_nodes: int
    verify_rows: int
    draft_rows: int
    committed_kv_bytes: int  # target KV of the committed prefix
    provisional_kv_bytes: int  # target branch KV of this round's verify rows (freed or gathered at publish)
    draft_kv_bytes: int  # drafter KV: context rows + this round's provisional rows
    expert_bytes: int = 0  # MoE: expert weights the verify rows route to (0 for a dense target)

    @property
    def kv_bytes(self) -> int:
        return self.committed_kv_bytes + self.provisional_kv_bytes + self.draft_kv_bytes


def round_work(
    request_id: str,
    shape: TreeShape,
    *,
    committed_len: int,
    target_kv_bytes_per_row: int,
    draft_kv_bytes_per_row: int = 0,
    expert_bytes: int = 0,
) -> RoundWork:
    """The work of a request with ``committed_len`` committed tokens running one round of ``shape``."""
    if committed_len < 0:
        raise ValueError(f"committed_len: {committed_len} < 0")
    draft_ctx = committed_len if shape.speculates else 0
    return RoundWork(
        request_id,
        shape.tree_nodes,
        shape.verify_rows,
        shape.draft_rows,
        committed_len * target_kv_bytes_per_row,
        shape.verify_rows * target_kv_bytes_per_row,
        (draft_ctx + shape.draft_rows) * draft_kv_bytes_per_row,
        expert_bytes,
    )


@dataclass(frozen=True)
class BatchWork:
    """The sum over a batch: what the latency curve and the budgets see."""

    requests: int
    verify_rows: int
    draft_rows: int
    tree_nodes: int
    kv_bytes: int
    expert_bytes: int  # the requests' own unions summed: an upper bound of the batch's union (shared experts)


def batch_work(works: list[RoundWork]) -> BatchWork:
    return BatchWork(
        len(works),
        sum(w.verify_rows for w in works),
        sum(w.draft_rows for w in works),
        sum(w.tree_nodes for w in works),
        sum(w.kv_bytes for w in works),
        sum(w.expert_bytes for w in works),
    )


EXPERT_EMA = 0.2  # how fast the routing skew follows live rounds


@dataclass
class ExpertTraffic:
    """Bytes of expert weights a verify of R rows reads on a mixture-of-experts target (design 0x09A).

    Terms: each of ``moe_layers`` layers routes every row to ``experts_per_token`` (k) of its
    ``num_experts`` (E) experts; a verify reads the *union* of the experts its rows route to, each
    ``bytes_per_expert`` bytes. If each row's k experts were a uniformly random k-subset, an expert
    would be missed by one row with probability 1 - k/E, so R rows touch

        U(R) = E * (1 - (1 - k/E) ** R)         experts per layer, in expectation,

    Real routing is skewed (popular experts), so fewer are touched: ``skew`` (observed / predicted,
    an exponential average over live rounds) scales the figure; a verify never reads fewer than k
    per layer nor more than all E. A dense target is
    ``ExpertTraffic()`` and predicts 0.

    Worked example: E = 8, k = 2, 2 MoE layers, 1 MB an expert: one row reads 2 experts per layer
    (4 MB); two rows 8 * (1 - 0.75**2) = 3.5 per layer (7 MB); 64 rows nearly all 8 (16 MB, the cap).
    """

    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    bytes_per_expert: int = 0
    skew: float = 1.0
    observations: int = 0

    def __post_init__(self):
        for name in ("moe_layers", "num_experts", "experts_per_token", "bytes_per_expert"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise ValueError(f"experts.{name}: {getattr(self, name)!r} is not a count")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts.experts_per_token: {self.experts_per_token} > num_experts {self.num_experts}")

    @property
    def is_moe(self) -> bool:
        return self.moe_layers > 0 and self.num_experts > 0 and self.bytes_per_expert > 0

    @property
    def all_bytes(self) -> int:
        """Every routed expert of every MoE layer: the most a verify can read."""
        return self.moe_layers * self.num_experts * self.bytes_per_expert

    def union_size(self, rows: int) -> float:
        """U(rows): expected experts touched per layer under uniform routing."""
        if not self.is_moe or rows <= 0:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** rows)

    def predict(self, rows: int) -> int:
        """Expected expert bytes a verify of ``rows`` rows (all requests of a batch together) reads."""
        if not self.is_moe or rows <= 0:
            return 0
        per_layer = max(self.union_size(rows) * self.skew, min(self.experts_per_token, self.num_experts))
        return int(min(round(self.moe_layers * per_layer * self.bytes_per_expert), self.all_bytes))

    def observe(self, rows: int, expert_bytes: int, weight: float = EXPERT_EMA) -> None:
        """Fold a live verify's rows and measured union bytes into ``skew``."""
        if not self.is_moe or rows <= 0 or expert_bytes <= 0:
            return
        uniform = self.moe_layers * self.union_size(rows) * self.bytes_per_expert
        ratio = max(expert_bytes / uniform, 1e-3)
        self.skew += weight * (ratio - self.skew)
        self.observations += 1

    def to_dict(self) -> dict:
        return {
            "moe_layers": self.moe_layers,
            "num_experts": self.num_experts,
            "experts_per_token": self.experts_per_token,
            "bytes_per_expert": self.bytes_per_expert,
            "skew": round(self.skew, 4),
            "observations": self.observations,
        }


def expected_accepted(rank_rates: list[list[float]], shape: TreeShape) -> float:
    """Expected accepted candidate tokens of one round (the bonus token not counted) on a tree of
    ``shape`` whose nodes are the ``verify_budget`` most likely ones.

    ``rank_rates[d][r]``: the probability that the target's token at depth ``d + 1`` is the drafter's
    ``(r + 1)``-th choice there, given that the path to it was accepted (at depth 1, ``r = 0`` is the
    top-1 accuracy; ``sum_r`` is at most 1). A depth past the list takes the last depth's rates, a
    rank past a depth's list is never accepted. A node's chance to be accepted is the product of its
    path's rates; exactly one path is accepted a round, so the expectation is the sum of the chosen
    nodes' chances. Nodes are chosen best-first (each node's parent is at least as likely, so the
    choice is a tree), at most ``expand_width`` children a node and ``max_depth`` deep: EAGLE-2's
    selection when the drafter's confidence orders the nodes as their true chances do (an upper
    bound otherwise). tau = 1 + this."""
    import heapq

    if not shape.speculates or not rank_rates:
        return 0.0
    for d, rates in enumerate(rank_rates):
        if any(r < 0 for r in rates) or sum(rates) > 1 + 1e-9:
            raise ValueError(f"rank_rates[{d}]: {rates} are not probabilities of disjoint events")

    def children(depth: int, chance: float):  # depth: 1-based depth of the children
        rates = rank_rates[min(depth, len(rank_rates)) - 1]
        return [(-chance * rates[r], depth) for r in range(min(shape.expand_width, len(rates)))]

    frontier = children(1, 1.0)
    heapq.heapify(frontier)
    total = 0.0
    for _ in range(shape.verify_budget):
        if not frontier:
            break
        neg, depth = heapq.heappop(frontier)
        total += -neg
        if depth < shape.max_depth:
            for child in children(depth + 1, -neg):
                heapq.heappush(frontier, child)
    return total


def rank_rates_from_topk(topk: list[list[float]]) -> list[list[float]]:
    """Per-depth rank rates (:func:`expected_accepted`) from cumulative top-k accuracies per depth
    (``topk[d][k - 1]`` = P(the target's token is among the drafter's k best at depth d + 1)); an
    accuracy that falls with k (noise) is clipped."""
    out = []
    for row in topk:
        rates, prev = [], 0.0
        for acc in row:
            acc = min(max(acc, prev), 1.0)
            rates.append(acc - prev)
            prev = acc
        out.append(rates)
    return out
