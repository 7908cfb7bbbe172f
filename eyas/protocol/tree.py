"""The tree messages of the wire contract: a drafter's `DraftTree` and the verifier's `FlatTree`.

Both are validated on construction; `validate_flat_tree` adds the checks an inbound message needs
(docs/architecture.md, "The wire contract"). Pure tensor code: no model, no Ray.

Flatten a draft tree into the rows the target verifies in one forward pass (design 0x05C).

Terms:

- **row**: one token the target reads in the verify forward. Row 0 is the **root**: the frontier
  token (the seed of the draft round, depth 0). Rows 1..N are the `DraftTree` nodes in tree order,
  so parents precede children in rows too.
- **position**: `base_position + depth`, where `base_position` is the position of the root
  (the committed prefix length). Siblings share a position.
- **tree mask**: `tree_mask[i, j]` is True iff row j is row i or an ancestor of row i. Row i attends
  to the committed prefix plus exactly these rows.
- **retrieve map**: one line per leaf (a row with no children), listing the rows of the
  root->leaf path, padded with RETRIEVE_PAD to `max_depth + 1` columns. Acceptance picks one line;
  the accepted KV and feature rows are gathered through it, never rebuilt from token equality
  (design 0x05D), because the same token id can occupy several rows.

An empty tree flattens to the root alone, which is how target-only decoding verifies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

PARENT_IS_ROOT: int = -1  # DraftTree.parents value: the node is a child of the root row (the frontier token)
ROW_IS_ROOT: int = -1  # parents[0]: the root row has no parent row
RETRIEVE_PAD: int = -1  # padding after the leaf in a retrieve-map line


# --------------------------------------------------------------------------------------------
# DraftTree
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DraftTree:
    """Candidate nodes proposed by a drafter, seed excluded (design 0x05B).

    Nodes are stored in an order where every parent precedes its children, which also makes the
    tree ancestor-closed: every parent index refers to an earlier node of this tree.
    """

    tokens: torch.Tensor  # [N] int64 candidate token ids, >= 0
    parents: torch.Tensor  # [N] int64 parent node index or PARENT_IS_ROOT; parents[i] < i
    depths: torch.Tensor  # [N] int64 >= 1; parent's depth + 1 (seed children: 1)
    draft_probs: torch.Tensor  # [N] float32 conditional draft confidence in [0, 1]

    def __post_init__(self) -> None:
        for name, dtype in (
            ("tokens", torch.int64),
            ("parents", torch.int64),
            ("depths", torch.int64),
            ("draft_probs", torch.float32),
        ):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
            if value.ndim != 1:
                raise ValueError(f"{name}: expected a 1-D tensor, got shape {tuple(value.shape)}")
            if value.dtype != dtype:
                raise ValueError(f"{name}: expected dtype {dtype}, got {value.dtype}")
        n = self.tokens.shape[0]
        for name in ("parents", "depths", "draft_probs"):
            if getattr(self, name).shape[0] != n:
                raise ValueError(f"{name}: length {getattr(self, name).shape[0]} != tokens length {n}")

        tokens = self.tokens.tolist()
        parents = self.parents.tolist()
        depths = self.depths.tolist()
        probs = self.draft_probs.tolist()
        seen: set[tuple[int, int]] = set()
        for i in range(n):
            p = parents[i]
            if p != PARENT_IS_ROOT and not 0 <= p < i:
                raise ValueError(
                    f"parents: node {i} has parent {p}; a parent must be PARENT_IS_ROOT or an "
                    f"earlier node (parents precede children, ancestor-closed)"
                )
            expected_depth = 1 if p == PARENT_IS_ROOT else depths[p] + 1
            if depths[i] != expected_depth:
                raise ValueError(
                    f"depths: node {i} has depth {depths[i]}, expected {expected_depth} "
                    f"(parent depth + 1, seed children at depth 1)"
                )
            if tokens[i] < 0:
                raise ValueError(f"tokens: node {i} has negative token id {tokens[i]}")
            if not (math.isfinite(probs[i]) and 0.0 <= probs[i] <= 1.0):
                raise ValueError(f"draft_probs: node {i} has confidence {probs[i]}, expected finite in [0, 1]")
            key = (p, tokens[i])
            if key in seen:
                raise ValueError(f"tokens: duplicate token {tokens[i]} under one parent ({p}) at node {i}")
            seen.add(key)

    def __reduce__(self):
        """Pickle as plain lists, rebuilt (and validated again) by the constructor on arrival. Ray
        carries a tree from the drafter replica to the target's round loop every round; four
        small tensors cost about 1.6 ms to pickle and unpickle, lists about 0.1 ms (measured)."""
        return _draft_tree_from_lists, (
            self.tokens.tolist(),
            self.parents.tolist(),
            self.depths.tolist(),
            self.draft_probs.tolist(),
        )

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        """A tree with no candidates: verification then checks only the frontier (target-only)."""
        zeros_i = torch.zeros(0, dtype=torch.int64, device=device)
        return cls(
            tokens=zeros_i,
            parents=zeros_i.clone(),
            depths=zeros_i.clone(),
            draft_probs=torch.zeros(0, dtype=torch.float32, device=device),
        )

    @classmethod
    def chain(cls, tokens, draft_prob: float = 0.5) -> DraftTree:
        """A chain: ``tokens`` ([N] ids, or a list) one below the other under the root, each at
        confidence ``draft_prob``; N = 0 gives the empty tree. What latency probes and tests verify."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)  # [N]
        n = tokens.shape[0]
        return cls(
            tokens=tokens,
            parents=torch.arange(-1, n - 1),
            depths=torch.arange(1, n + 1),
            draft_probs=torch.full((n,), float(draft_prob), dtype=torch.float32),
        )

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[0]

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node; 0 for an empty tree (only the seed)."""
        return int(self.depths.max().item()) if self.num_nodes else 0

    def children_of(self, node: int) -> list[int]:
        """Indices of the children of `node` (PARENT_IS_ROOT for the seed), in node order."""
        if type(node) is not int or not (node == PARENT_IS_ROOT or 0 <= node < self.num_nodes):
            raise ValueError(f"node: {node!r} is not PARENT_IS_ROOT or a node index of this tree")
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]


def _draft_tree_from_lists(
    tokens: list[int], parents: list[int], depths: list[int], draft_probs: list[float]
) -> DraftTree:
    return DraftTree(
        torch.tensor(tokens, dtype=torch.int64),
        torch.tensor(parents, dtype=torch.int64),
        torch.tensor(depths, dtype=torch.int64),
        torch.tensor(draft_probs, dtype=torch.float32),
    )


@dataclass(frozen=True)
class FlatTree:
    """Verify rows of one request's tree (design 0x05C). Construction checks layout only (dtype,
    ndim, shapes); `validate_flat_tree` checks the semantics an inbound message must satisfy."""

    tokens: torch.Tensor  # [R] int64; row 0 the frontier token (root), rows 1.. the tree nodes
    positions: torch.Tensor  # [R] int64; base_position + depth
    parents: torch.Tensor  # [R] int64; parent row, ROW_IS_ROOT for row 0
    depths: torch.Tensor  # [R] int64; 0 for the root
    tree_mask: torch.Tensor  # [R, R] bool; [i, j] = row j is an ancestor of row i or j == i
    retrieve: torch.Tensor  # [num_leaves, max_depth + 1] int64; root->leaf rows, PAD-padded
    draft_probs: torch.Tensor  # [R] float32; root = 1.0

    def __post_init__(self) -> None:
        for name, dtype, ndim in (
            ("tokens", torch.int64, 1),
            ("positions", torch.int64, 1),
            ("parents", torch.int64, 1),
            ("depths", torch.int64, 1),
            ("tree_mask", torch.bool, 2),
            ("retrieve", torch.int64, 2),
            ("draft_probs", torch.float32, 1),
        ):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
            if value.ndim != ndim:
                raise ValueError(f"{name}: expected {ndim}-D, got shape {tuple(value.shape)}")
            if value.dtype != dtype:
                raise ValueError(f"{name}: expected dtype {dtype}, got {value.dtype}")
        r = self.tokens.shape[0]
        if r < 1:
            raise ValueError("tokens: a flat tree has at least the root row")
        for name in ("positions", "parents", "depths", "draft_probs"):
            if getattr(self, name).shape[0] != r:
                raise ValueError(f"{name}: length {getattr(self, name).shape[0]} != tokens length {r}")
        if tuple(self.tree_mask.shape) != (r, r):
            raise ValueError(f"tree_mask: shape {tuple(self.tree_mask.shape)} != ({r}, {r})")
        if self.retrieve.shape[0] < 1 or self.retrieve.shape[1] < 1:
            raise ValueError(f"retrieve: expected at least one line and column, got {tuple(self.retrieve.shape)}")

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]


def tree_mask_from_parents(parents: list[int]) -> list[list[bool]]:
    """Ancestor-or-self mask rows of a parents-precede-children row list (python lists)."""
    mask: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = list(mask[p]) if p != ROW_IS_ROOT else [False] * len(parents)
        row[i] = True
        mask.append(row)
    return mask


def retrieve_from_parents(parents: list[int], depths: list[int]) -> list[list[int]]:
    """Retrieve map: one root->leaf row path per leaf (leaves in row order), RETRIEVE_PAD-padded."""
    has_child = [False] * len(parents)
    for p in parents:
        if p != ROW_IS_ROOT:
            has_child[p] = True
    width = max(depths) + 1
    lines = []
    for leaf in (i for i, c in enumerate(has_child) if not c):
        path = [leaf]
        while parents[path[-1]] != ROW_IS_ROOT:
            path.append(parents[path[-1]])
        path.reverse()
        lines.append(path + [RETRIEVE_PAD] * (width - len(path)))
    return lines


def flatten_tree(tree: DraftTree, frontier_token: int, base_position: int) -> FlatTree:
    """Rows, positions, ancestry mask and retrieve map of `tree` under the root `frontier_token`.

    Worked example (design 0x06C tree, selected [A, A1, B, B1], base_position 10)::

        tree parents  [-1, 0, -1, 2]           (A, A1, B, B1; PARENT_IS_ROOT = -1)
        rows          [root, A, A1, B, B1]
        parents       [ROW_IS_ROOT, 0, 1, 0, 3]
        positions     [10, 11, 12, 11, 12]
        retrieve      [[0, 1, 2], [0, 3, 4]]
    """
    if type(frontier_token) is not int or frontier_token < 0:
        raise ValueError(f"frontier_token: expected a nonnegative int, got {frontier_token!r}")
    if type(base_position) is not int or base_position < 0:
        raise ValueError(f"base_position: expected a nonnegative int, got {base_position!r}")
    device = tree.tokens.device
    if tree.tokens.shape[0] == 0:  # a plain round's one row (most rounds of a loaded server): no walk
        as_long = dict(dtype=torch.int64, device=device)
        return FlatTree(
            tokens=torch.tensor([frontier_token], **as_long),
            positions=torch.tensor([base_position], **as_long),
            parents=torch.tensor([ROW_IS_ROOT], **as_long),
            depths=torch.zeros(1, **as_long),
            tree_mask=torch.ones(1, 1, dtype=torch.bool, device=device),
            retrieve=torch.zeros(1, 1, **as_long),
            draft_probs=torch.ones(1, dtype=torch.float32, device=device),
        )
    parents = [ROW_IS_ROOT] + [0 if p == PARENT_IS_ROOT else p + 1 for p in tree.parents.tolist()]
    depths = [0] + tree.depths.tolist()
    as_long = dict(dtype=torch.int64, device=device)
    return FlatTree(
        tokens=torch.cat([torch.tensor([frontier_token], **as_long), tree.tokens]),
        positions=torch.tensor(depths, **as_long) + base_position,
        parents=torch.tensor(parents, **as_long),
        depths=torch.tensor(depths, **as_long),
        tree_mask=torch.tensor(tree_mask_from_parents(parents), dtype=torch.bool, device=device),
        retrieve=torch.tensor(retrieve_from_parents(parents, depths), **as_long),
        draft_probs=torch.cat([torch.ones(1, dtype=torch.float32, device=device), tree.draft_probs]),
    )


def validate_flat_tree(flat: FlatTree, *, vocab_size: int, max_rows: int, base_position: int) -> None:
    """Check the wire contract of a FlatTree; raise ValueError naming the field that breaks it.

    Checks: rows within `max_rows`; row 0 is the root; parents precede children and the tree is
    ancestor-closed (every parent is an earlier row); depths follow parents; positions equal
    `base_position` + depth; tree_mask equals the ancestor-or-self relation; retrieve equals the
    root->leaf paths; token ids in [0, vocab_size) with no duplicate token under one parent;
    draft probs finite in [0, 1].
    """
    for name, value, minimum in (
        ("vocab_size", vocab_size, 1),
        ("max_rows", max_rows, 1),
        ("base_position", base_position, 0),
    ):
        if type(value) is not int or value < minimum:
            raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    r = flat.num_rows
    if r > max_rows:
        raise ValueError(f"tokens: {r} rows exceed the budget of {max_rows} rows")

    parents = flat.parents.tolist()
    if parents[0] != ROW_IS_ROOT:
        raise ValueError(f"parents: row 0 must be the root (ROW_IS_ROOT), got parent {parents[0]}")
    for i in range(1, r):
        p = parents[i]
        if not 0 <= p < r:
            raise ValueError(f"parents: row {i} has parent {p}, which is not a row of this tree (not ancestor-closed)")
        if p >= i:
            raise ValueError(f"parents: row {i} has parent {p}; parents must precede children")

    depths = flat.depths.tolist()
    if depths[0] != 0:
        raise ValueError(f"depths: root row must have depth 0, got {depths[0]}")
    for i in range(1, r):
        if depths[i] != depths[parents[i]] + 1:
            raise ValueError(f"depths: row {i} has depth {depths[i]}, expected parent depth + 1")

    positions = flat.positions.tolist()
    for i in range(r):
        if positions[i] != base_position + depths[i]:
            raise ValueError(
                f"positions: row {i} has position {positions[i]}, expected base_position + depth "
                f"= {base_position + depths[i]}"
            )

    if flat.tree_mask.tolist() != tree_mask_from_parents(parents):
        raise ValueError("tree_mask: does not match the ancestor-or-self relation of parents")
    if flat.retrieve.tolist() != retrieve_from_parents(parents, depths):
        raise ValueError("retrieve: does not match the root->leaf paths of parents")

    tokens = flat.tokens.tolist()
    seen: set[tuple[int, int]] = set()
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab_size:
            raise ValueError(f"tokens: row {i} has token id {token} outside [0, {vocab_size})")
        if i and (parents[i], token) in seen:
            raise ValueError(f"tokens: duplicate token {token} under parent row {parents[i]}")
        seen.add((parents[i], token))

    for i, prob in enumerate(flat.draft_probs.tolist()):
        if not (math.isfinite(prob) and 0.0 <= prob <= 1.0):
            raise ValueError(f"draft_probs: row {i} has {prob}, expected finite in [0, 1]")
