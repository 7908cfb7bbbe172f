"""The scheduler's cost model: the work one request's round puts on the drafter and the target.

Seed 0x09 ("Scheduler-visible work"): draft rows, draft-tree nodes, draft KV bytes, target
verification rows, temporary target branch-KV bytes, accepted progress; seed 0x09A: for a
mixture-of-experts target, the expert weights the verify rows route to.

Pure functions over counts: no model, no Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

ROOT_ROWS = 1  # every verify carries the frontier token as its root row


@dataclass(frozen=True)
class TreeShape:
    """A tree the scheduler may give a request for one round (EAGLE-2's three knobs, seed 0x06D).

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


@dataclass(frozen=True)
class RoundWork:
    """What one request's round costs (seed 0x09)."""

    request_id: str
    tree_nodes: int
    verify_rows: int
    draft_rows: int
    committed_kv_bytes: int     # target KV of the committed prefix
    provisional_kv_bytes: int   # target branch KV of this round's verify rows (freed or gathered at publish)
    draft_kv_bytes: int         # drafter KV: context rows + this round's provisional rows
    expert_bytes: int = 0       # MoE: expert weights the verify rows route to (0 for a dense target)

    @property
    def kv_bytes(self) -> int:
        return self.committed_kv_bytes + self.provisional_kv_bytes + self.draft_kv_bytes


def round_work(request_id: str, shape: TreeShape, *, committed_len: int, target_kv_bytes_per_row: int,
               draft_kv_bytes_per_row: int = 0, expert_bytes: int = 0) -> RoundWork:
    """The work of a request with ``committed_len`` committed tokens running one round of ``shape``."""
    if committed_len < 0:
        raise ValueError(f"committed_len: {committed_len} < 0")
    draft_ctx = committed_len if shape.speculates else 0
    return RoundWork(request_id, shape.tree_nodes, shape.verify_rows, shape.draft_rows,
                     committed_len * target_kv_bytes_per_row, shape.verify_rows * target_kv_bytes_per_row,
                     (draft_ctx + shape.draft_rows) * draft_kv_bytes_per_row, expert_bytes)


@dataclass(frozen=True)
class BatchWork:
    """The sum over a batch: what the latency curve and the budgets see."""

    requests: int
    verify_rows: int
    draft_rows: int
    tree_nodes: int
    kv_bytes: int
    expert_bytes: int


def batch_work(works: list[RoundWork]) -> BatchWork:
    return BatchWork(len(works), sum(w.verify_rows for w in works), sum(w.draft_rows for w in works),
                     sum(w.tree_nodes for w in works), sum(w.kv_bytes for w in works),
                     sum(w.expert_bytes for w in works))

