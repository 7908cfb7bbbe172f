"""Draft trees: the candidate nodes a drafter proposes, and the builders that grow them.

Terms (design 0x05B, 0x06A, 0x06B):

- **seed**: the context anchor of a round -- the frontier token the target just produced, at
  depth 0 with log path value 0. It is *not* a node of a `DraftTree` and is never counted in the
  verification budget. A node whose parent is the seed has `parents[i] == PARENT_IS_ROOT`.
- **confidence** `c_u`: the drafter's conditional probability of token `u` given its parent's
  prefix. It is *not* renormalised over the retained children; omitted vocabulary mass is allowed,
  so sibling confidences sum to at most 1.
- **path value** `V(u) = prod_{j in path(u)} c_j`, accumulated in log space as
  `log V(u) = sum_j log(max(c_j, CONFIDENCE_FLOOR))` (design 0x06A). Because `c <= 1`,
  `V(child) <= V(parent)`.
- **ranking key** `(-log V(u), depth(u), node_id(u))`: higher value first, shallower first on ties,
  then build order. With the monotonicity above, every prefix of this global order is
  ancestor-closed, so the top-`verify_budget` nodes form a connected tree with no post-hoc repair.
- **expansion width / maximum depth / verification budget**: three separate knobs (design 0x06D).
  Width bounds how many nodes of the latest layer are expanded per step (and how many children
  each proposes), depth bounds the number of drafting steps, and the budget bounds how many nodes
  are finally sent to the target.
- **value floors** (cost-aware trees): ``min_value`` keeps a node out of the verification tree when
  its path value is below it, and ``expand_min_value`` expands a node only when its path value is
  at least it (a layer none of whose top nodes reaches it ends the growth). A path value estimates
  the chance that the target accepts the node's whole path (EAGLE-2's observation: draft
  confidence is close to calibrated), so a floor is the price of the work in accepted tokens: a
  verify row is worth adding when its expected accepted tokens exceed what the row costs, and a
  drafting step when its best children's do. Where verify rows and drafting steps are dear (a CPU,
  where every extra row is a full pass of the weights' arithmetic) the floors trade a little tau for
  cheaper rounds; both 0 (the default) is plain EAGLE-2. Both keep the selection ancestor-closed,
  since a child's value never exceeds its parent's (the idea of stopping a tree by expected
  acceptance is OPT-Tree's and SpecDec++'s; these floors are its simplest form).

Builder protocol (the drafter engine owns draft KV and features; a builder only does bookkeeping
on integer node ids)::

    builder = DynamicTreeBuilder(expand_width=W, verify_budget=B, max_depth=D)
    while not builder.done:
        parents = builder.expandable()          # first step: [PARENT_IS_ROOT]
        k = builder.children_per_parent
        # drafter: top-k tokens and conditional probabilities per parent, descending -> [P, k]
        new_ids = builder.add_children(parents, tokens, probs)
    tree = builder.select()                     # DraftTree, parents precede children
    node_ids = builder.selected_node_ids()      # tree node i is builder node node_ids[i]

`builder.node(i)` returns the record of built node i (`BuiltNode`: parent, column in its
add_children call, token, depth, confidence, log value), so the engine can map node ids to its
own draft rows, including for a static builder that drops some proposed columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree

CONFIDENCE_FLOOR: float = 1e-12  # ranking floor inside log(); stored confidences are unchanged
SIBLING_MASS_TOLERANCE: float = 1e-12  # design 0x06B slack on sibling mass for float64 confidences


# --------------------------------------------------------------------------------------------
# Shared builder bookkeeping
# --------------------------------------------------------------------------------------------


def _check_children_args(
    parents: Sequence[int],
    tokens: torch.Tensor,
    probs: torch.Tensor,
    expandable: list[int],
    children_per_parent: int,
) -> tuple[list[int], list[list[int]], list[list[float]]]:
    """Validate one `add_children` call (design 0x06B); return python lists (parents, tokens, probs).

    Every record (parent, token, confidence) must have: a parent from the current expandable set,
    a finite confidence in [0, 1], a token not already proposed under that parent, and sibling
    confidences summing to at most 1 + SIBLING_MASS_TOLERANCE + k * eps(probs.dtype): the seed's
    slack is for float64; float32 top-k probabilities carry rounding of about eps(float32) each.
    """
    parents = list(parents)
    for p in parents:
        if type(p) is not int:
            raise ValueError(f"parents: expected int node ids, got {type(p).__name__}")
        if p not in expandable:
            raise ValueError(f"parents: child parent {p} must belong to the current expandable set {expandable}")
    for name, value in (("tokens", tokens), ("probs", probs)):
        if not isinstance(value, torch.Tensor) or value.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D tensor [P, k]")
        if value.shape != (len(parents), children_per_parent):
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} != (len(parents), children_per_parent) = "
                f"({len(parents)}, {children_per_parent})"
            )
    if tokens.dtype != torch.int64:
        raise ValueError(f"tokens: expected dtype torch.int64, got {tokens.dtype}")
    if not probs.dtype.is_floating_point:
        raise ValueError(f"probs: expected a floating dtype, got {probs.dtype}")

    mass_limit = 1.0 + SIBLING_MASS_TOLERANCE + children_per_parent * torch.finfo(probs.dtype).eps
    token_rows = tokens.tolist()
    prob_rows = probs.to(torch.float64).tolist()
    seen: set[tuple[int, int]] = set()
    mass_by_parent: dict[int, float] = {}
    for p, token_row, prob_row in zip(parents, token_rows, prob_rows):
        for token, confidence in zip(token_row, prob_row):
            if token < 0:
                raise ValueError(f"tokens: negative token id {token} under parent {p}")
            if not math.isfinite(confidence) or not 0.0 <= confidence <= 1.0:
                raise ValueError(
                    f"probs: confidence {confidence} under parent {p} must be a finite probability in [0, 1]"
                )
            if (p, token) in seen:
                raise ValueError(f"tokens: duplicate token alternative {token} under one parent {p}")
            seen.add((p, token))
            mass = mass_by_parent.get(p, 0.0) + confidence
            if mass > mass_limit:
                raise ValueError(f"probs: sibling probability mass {mass} under parent {p} exceeds one")
            mass_by_parent[p] = mass
    return parents, token_rows, prob_rows


@dataclass(frozen=True)
class BuiltNode:
    """One node as a builder recorded it. `column` locates it in the `add_children` call that
    created it: row = position of `parent` in that call's parents, column = `column`."""

    parent: int  # builder node id of the parent, or PARENT_IS_ROOT
    column: int  # column in its add_children call's [P, k] inputs (the rank, for static trees)
    token: int
    depth: int  # >= 1
    confidence: float  # conditional draft confidence as given (float32 value widened to float)
    log_value: float  # log path value, design 0x06A


class _NodeStore:
    """Build-order node records shared by the builders; node ids are indices into these lists."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []  # builder node id of the parent, or PARENT_IS_ROOT
        self.columns: list[int] = []
        self.depths: list[int] = []
        self.confidences: list[float] = []
        self.log_values: list[float] = []  # log path value, design 0x06A

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, column: int, token: int, confidence: float) -> int:
        parent_log = 0.0 if parent == PARENT_IS_ROOT else self.log_values[parent]
        parent_depth = 0 if parent == PARENT_IS_ROOT else self.depths[parent]
        self.tokens.append(token)
        self.parents.append(parent)
        self.columns.append(column)
        self.depths.append(parent_depth + 1)
        self.confidences.append(confidence)
        self.log_values.append(parent_log + math.log(max(confidence, CONFIDENCE_FLOOR)))
        return len(self.tokens) - 1

    def node(self, node_id: int) -> BuiltNode:
        if type(node_id) is not int or not 0 <= node_id < len(self.tokens):
            raise ValueError(f"node_id: {node_id!r} is not a built node (0..{len(self.tokens) - 1})")
        return BuiltNode(
            parent=self.parents[node_id],
            column=self.columns[node_id],
            token=self.tokens[node_id],
            depth=self.depths[node_id],
            confidence=self.confidences[node_id],
            log_value=self.log_values[node_id],
        )

    def rank_key(self, node: int) -> tuple[float, int, int]:
        """Ranking key (-log value, depth, node_id): best first, shallow first on ties."""
        if node == PARENT_IS_ROOT:
            return (-0.0, 0, PARENT_IS_ROOT)
        return (-self.log_values[node], self.depths[node], node)

    def to_tree(self, node_ids: list[int], device: torch.device | str) -> DraftTree:
        """A DraftTree of `node_ids` (in that order), parents remapped to positions in the order."""
        position = {node: i for i, node in enumerate(node_ids)}
        parents = []
        for node in node_ids:
            p = self.parents[node]
            if p == PARENT_IS_ROOT:
                parents.append(PARENT_IS_ROOT)
                continue
            assert p in position, f"selection not ancestor-closed: node {node} lacks parent {p}"
            assert position[p] < position[node], f"parent {p} ranked after its child {node}"
            parents.append(position[p])
        return DraftTree(
            tokens=torch.tensor([self.tokens[n] for n in node_ids], dtype=torch.int64, device=device),
            parents=torch.tensor(parents, dtype=torch.int64, device=device),
            depths=torch.tensor([self.depths[n] for n in node_ids], dtype=torch.int64, device=device),
            draft_probs=torch.tensor([self.confidences[n] for n in node_ids], dtype=torch.float32, device=device),
        )


# --------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree
# --------------------------------------------------------------------------------------------


class _Builder:
    """What both builders answer of their built nodes (``self._nodes``, a :class:`_NodeStore`)."""

    _nodes: _NodeStore

    @property
    def num_built(self) -> int:
        """Number of candidate nodes built so far (seed excluded)."""
        return len(self._nodes)

    def node(self, node_id: int) -> BuiltNode:
        """The record of a built node (the engine's row map, confidence telemetry); its ``column`` is
        its rank among its parent's proposals, which says which proposal was kept."""
        return self._nodes.node(node_id)


class DynamicTreeBuilder(_Builder):
    """EAGLE-2 context-aware dynamic tree: expand by path value, then rerank globally (design 0x06B).

    Each step expands the top `expand_width` nodes of the latest generated layer by the ranking
    key, each proposing `expand_width` children. After at most `max_depth` steps, `select()` takes
    the global top `verify_budget` built nodes by the same key. Monotone path values make that
    prefix ancestor-closed, so no ancestors are added afterwards (which could exceed the budget).

    Node ids are build-order integers, returned by `add_children`. `selected_node_ids()` maps the
    nodes of the selected `DraftTree` back to these ids, so the engine can find its own rows.
    """

    def __init__(
        self,
        *,
        expand_width: int,
        verify_budget: int,
        max_depth: int,
        min_value: float = 0.0,
        expand_min_value: float = 0.0,
    ) -> None:
        if type(expand_width) is not int or expand_width < 1:
            raise ValueError(f"expand_width: expansion width must be a positive integer, got {expand_width!r}")
        for name, value in (("verify_budget", verify_budget), ("max_depth", max_depth)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: verification budget and depth must be nonnegative integers, got {value!r}")
        for name, value in (("min_value", min_value), ("expand_min_value", expand_min_value)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: a path-value floor must be a number in [0, 1], got {value!r}")
        self.expand_width = expand_width
        self.verify_budget = verify_budget
        self.max_depth = max_depth
        # log floors (-inf for 0: every node passes, plain EAGLE-2)
        self._min_log_value = math.log(min_value) if min_value > 0 else -math.inf
        self._expand_min_log_value = math.log(expand_min_value) if expand_min_value > 0 else -math.inf
        self._nodes = _NodeStore()
        self._frontier: list[int] = [PARENT_IS_ROOT]  # the latest generated layer
        self._steps = 0  # layers generated so far == depth of the frontier

    @property
    def done(self) -> bool:
        return self.verify_budget == 0 or self._steps >= self.max_depth or not self._worth_expanding()

    @property
    def children_per_parent(self) -> int:
        return self.expand_width

    def _worth_expanding(self) -> list[int]:
        """Top `expand_width` nodes of the latest layer by the ranking key, those at the expansion floor."""
        top = sorted(self._frontier, key=self._nodes.rank_key)[: self.expand_width]
        return [n for n in top if n == PARENT_IS_ROOT or self._nodes.log_values[n] >= self._expand_min_log_value]

    def expandable(self) -> list[int]:
        """Top `expand_width` nodes of the latest layer by the ranking key (at the expansion floor); [] once done."""
        if self.done:
            return []
        return self._worth_expanding()

    def add_children(
        self,
        parents: Sequence[int],
        tokens: torch.Tensor,  # [P, k] int64, k == children_per_parent
        probs: torch.Tensor,  # [P, k] float, conditional confidences under each parent
    ) -> list[int]:
        """Record one drafting step; return the new node ids in row-major order (all are kept)."""
        if self.done:
            raise ValueError("add_children: the builder is done; call select()")
        parents, token_rows, prob_rows = _check_children_args(
            parents, tokens, probs, self.expandable(), self.children_per_parent
        )
        new_ids = [
            self._nodes.add(p, column, token, confidence)
            for p, token_row, prob_row in zip(parents, token_rows, prob_rows)
            for column, (token, confidence) in enumerate(zip(token_row, prob_row))
        ]
        self._frontier = new_ids
        self._steps += 1
        return new_ids

    def selected_node_ids(self) -> list[int]:
        """Node ids of the selected tree, in tree order: the global top `verify_budget` by key, less
        those under the value floor (a suffix of that order: the selection stays ancestor-closed)."""
        ranked = sorted(range(len(self._nodes)), key=self._nodes.rank_key)
        selected = [n for n in ranked[: self.verify_budget] if self._nodes.log_values[n] >= self._min_log_value]
        assert len(selected) <= self.verify_budget
        return selected

    def select(self, device: torch.device | str = "cpu") -> DraftTree:
        """The verification tree: top `verify_budget` nodes ordered by the key (parents first)."""
        return self._nodes.to_tree(self.selected_node_ids(), device)


# --------------------------------------------------------------------------------------------
# Static (Medusa / EAGLE-1 style) tree
# --------------------------------------------------------------------------------------------


def chain_choices(depth: int) -> list[list[int]]:
    """A chain of `depth` top-1 nodes: [[0], [0, 0], ...] (plain speculative decoding)."""
    if type(depth) is not int or depth < 0:
        raise ValueError(f"depth: expected a nonnegative integer, got {depth!r}")
    return [[0] * d for d in range(1, depth + 1)]


# An EAGLE-1-like static tree (25 nodes, depth 5): wide near the seed, top-1 chains deeper.
# Each entry is a path of child ranks from the seed. It is shaped like EAGLE-1's published choice
# lists (more branches where acceptance is likely), not a copy of any of them.
DEFAULT_STATIC_CHOICES: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (3, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 2, 0), (1, 0, 0), (2, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (1, 0, 0, 0),
    (0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (0, 0, 0, 1, 0),
)  # fmt: skip


class StaticTreeBuilder(_Builder):
    """A fixed tree shape given as a choice list (Medusa / EAGLE-1 style).

    A *choice* is a path of child ranks from the seed: (0,) is the seed's top-1 child, (1, 0) the
    top-1 child of the seed's top-2 child. The choice list must be ancestor-closed (every prefix of
    a choice is a choice). Each step expands the nodes of the latest layer that have children in
    the list; the drafter proposes `children_per_parent` ranked tokens per parent (column j is
    rank j, probabilities non-increasing) and only children whose rank path is a choice are kept.
    `select()` returns every built node in build order (layer by layer, so parents first).
    """

    def __init__(self, choices: Sequence[Sequence[int]]) -> None:
        paths: set[tuple[int, ...]] = set()
        for choice in choices:
            if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence):
                raise ValueError(f"choices: each choice must be a sequence of ranks, got {choice!r}")
            path = tuple(choice)
            if not path:
                raise ValueError("choices: empty path (the seed is implicit, not a choice)")
            for rank in path:
                if type(rank) is not int or rank < 0:
                    raise ValueError(f"choices: ranks must be nonnegative integers, got {rank!r} in {list(path)}")
            if path in paths:
                raise ValueError(f"choices: duplicate choice {list(path)}")
            paths.add(path)
        for path in paths:
            for cut in range(1, len(path)):
                if path[:cut] not in paths:
                    raise ValueError(f"choices: not ancestor-closed: {list(path)} needs its prefix {list(path[:cut])}")
        self.choices: frozenset[tuple[int, ...]] = frozenset(paths)
        self._nodes = _NodeStore()
        self._paths: list[tuple[int, ...]] = []  # rank path of each built node
        self._frontier: list[int] = [PARENT_IS_ROOT] if paths else []

    def _path(self, node: int) -> tuple[int, ...]:
        return () if node == PARENT_IS_ROOT else self._paths[node]

    def _child_ranks(self, node: int) -> list[int]:
        prefix = self._path(node)
        return sorted(p[-1] for p in self.choices if len(p) == len(prefix) + 1 and p[:-1] == prefix)

    @property
    def done(self) -> bool:
        return not self.expandable()

    def expandable(self) -> list[int]:
        """Nodes of the latest layer that have children in the choice list, in build order."""
        return [n for n in self._frontier if self._child_ranks(n)]

    @property
    def children_per_parent(self) -> int:
        """1 + the largest rank needed at the next layer; 0 once done."""
        ranks = [r for n in self.expandable() for r in self._child_ranks(n)]
        return 1 + max(ranks) if ranks else 0

    def add_children(
        self,
        parents: Sequence[int],
        tokens: torch.Tensor,  # [P, k] int64, k == children_per_parent; column j is rank j
        probs: torch.Tensor,  # [P, k] float, non-increasing along each row
    ) -> list[int]:
        """Record one step; return ids of the kept children (rank path in choices), row-major."""
        if self.done:
            raise ValueError("add_children: the builder is done; call select()")
        parents, token_rows, prob_rows = _check_children_args(
            parents, tokens, probs, self.expandable(), self.children_per_parent
        )
        for p, prob_row in zip(parents, prob_rows):
            if any(a < b for a, b in zip(prob_row, prob_row[1:])):
                raise ValueError(f"probs: row for parent {p} is not descending; column j must be rank j")
        new_ids = []
        for p, token_row, prob_row in zip(parents, token_rows, prob_rows):
            for rank, (token, confidence) in enumerate(zip(token_row, prob_row)):
                path = self._path(p) + (rank,)
                if path in self.choices:
                    new_ids.append(self._nodes.add(p, rank, token, confidence))
                    self._paths.append(path)
        self._frontier = new_ids
        return new_ids

    def selected_node_ids(self) -> list[int]:
        """All built nodes in build order (tree node i is builder node i)."""
        return list(range(len(self._nodes)))

    def select(self, device: torch.device | str = "cpu") -> DraftTree:
        return self._nodes.to_tree(self.selected_node_ids(), device)
