"""Flattening a draft tree into verify rows, and the wire-contract validator (design 0x05C)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.protocol.tree import (
    PARENT_IS_ROOT,
    RETRIEVE_PAD,
    ROW_IS_ROOT,
    DraftTree,
    FlatTree,
    flatten_tree,
    validate_flat_tree,
)

T, F = True, False
A, A1, B, B1 = 10, 11, 20, 21
FRONTIER = 3
BASE = 10
VOCAB = 32


def seed_fixture_tree() -> DraftTree:
    """The selected design 0x06C tree [A, A1, B, B1] (parents [SEED, 0, SEED, 2])."""
    return DraftTree(
        tokens=torch.tensor([A, A1, B, B1]),
        parents=torch.tensor([PARENT_IS_ROOT, 0, PARENT_IS_ROOT, 2]),
        depths=torch.tensor([1, 2, 1, 2]),
        draft_probs=torch.tensor([0.60, 0.80, 0.40, 0.95]),
    )


def test_flatten_seed_fixture_worked_example():
    """Rows [root=3, A, A1, B, B1] at base position 10:

        row  token  parent  depth  position  mask (ancestors or self)
        0    3      ROOT    0      10        {0}
        1    A      0       1      11        {0, 1}
        2    A1     1       2      12        {0, 1, 2}
        3    B      0       1      11        {0, 3}
        4    B1     3       2      12        {0, 3, 4}

    Leaves are rows 2 and 4, so retrieve = [[0, 1, 2], [0, 3, 4]].
    """
    flat = flatten_tree(seed_fixture_tree(), FRONTIER, BASE)
    assert flat.tokens.tolist() == [FRONTIER, A, A1, B, B1]
    assert flat.parents.tolist() == [ROW_IS_ROOT, 0, 1, 0, 3]
    assert flat.depths.tolist() == [0, 1, 2, 1, 2]
    assert flat.positions.tolist() == [10, 11, 12, 11, 12]
    assert flat.tree_mask.tolist() == [
        [T, F, F, F, F],
        [T, T, F, F, F],
        [T, T, T, F, F],
        [T, F, F, T, F],
        [T, F, F, T, T],
    ]
    assert flat.retrieve.tolist() == [[0, 1, 2], [0, 3, 4]]
    assert flat.draft_probs.tolist() == pytest.approx([1.0, 0.60, 0.80, 0.40, 0.95])
    validate_flat_tree(flat, vocab_size=VOCAB, max_rows=5, base_position=BASE)


def test_flatten_pads_retrieve_for_shallow_leaves():
    """Root -> X (leaf) and root -> Y -> Y1: retrieve [[0, 1, PAD], [0, 2, 3]]."""
    tree = DraftTree(
        tokens=torch.tensor([5, 6, 7]),
        parents=torch.tensor([PARENT_IS_ROOT, PARENT_IS_ROOT, 1]),
        depths=torch.tensor([1, 1, 2]),
        draft_probs=torch.tensor([0.5, 0.3, 0.9]),
    )
    flat = flatten_tree(tree, FRONTIER, 0)
    assert flat.retrieve.tolist() == [[0, 1, RETRIEVE_PAD], [0, 2, 3]]
    validate_flat_tree(flat, vocab_size=VOCAB, max_rows=8, base_position=0)


def test_empty_tree_flattens_to_root_row():
    """Target-only decoding: one row, the frontier token at the base position."""
    flat = flatten_tree(DraftTree.empty(), FRONTIER, BASE)
    assert flat.num_rows == 1
    assert flat.tokens.tolist() == [FRONTIER]
    assert flat.parents.tolist() == [ROW_IS_ROOT]
    assert flat.positions.tolist() == [BASE]
    assert flat.tree_mask.tolist() == [[T]]
    assert flat.retrieve.tolist() == [[0]]
    assert flat.depths.tolist() == [0] and flat.draft_probs.tolist() == [1.0]
    assert [t.dtype for t in (flat.tokens, flat.positions, flat.parents, flat.depths, flat.retrieve)] == [
        torch.int64
    ] * 5
    assert flat.tree_mask.dtype == torch.bool and flat.draft_probs.dtype == torch.float32
    validate_flat_tree(flat, vocab_size=VOCAB, max_rows=1, base_position=BASE)


@st.composite
def draft_trees(draw, max_nodes: int = 12) -> DraftTree:
    """Random DraftTrees: node i's parent is the seed or an earlier node; token i is unique."""
    n = draw(st.integers(0, max_nodes))
    parents: list[int] = [draw(st.integers(PARENT_IS_ROOT, i - 1)) for i in range(n)]
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == PARENT_IS_ROOT else depths[p] + 1)
    return DraftTree(
        tokens=torch.arange(n, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor(depths, dtype=torch.int64),
        draft_probs=torch.full((n,), 0.5),
    )


@settings(max_examples=60, deadline=None)
@given(tree=draft_trees(), base=st.integers(0, 1000))
def test_flatten_random_trees_satisfy_the_contract(tree, base):
    """Mask row i is exactly i's ancestor chain; retrieve lines are the root->leaf chains."""
    flat = flatten_tree(tree, FRONTIER, base)
    validate_flat_tree(flat, vocab_size=VOCAB, max_rows=tree.num_nodes + 1, base_position=base)
    parents = flat.parents.tolist()
    for i in range(flat.num_rows):
        chain = {i}
        while parents[min(chain)] != ROW_IS_ROOT:
            chain.add(parents[min(chain)])
        assert {j for j, m in enumerate(flat.tree_mask[i].tolist()) if m} == chain
    leaves = [i for i in range(flat.num_rows) if i not in parents]
    assert [max(line) for line in flat.retrieve.tolist()] == leaves


@pytest.mark.parametrize("frontier, base", [(-1, 0), (True, 0), (3, -2), (3, 1.0)])
def test_flatten_rejects_bad_arguments(frontier, base):
    with pytest.raises(ValueError, match="frontier_token|base_position"):
        flatten_tree(seed_fixture_tree(), frontier, base)


def _flat() -> FlatTree:
    return flatten_tree(seed_fixture_tree(), FRONTIER, BASE)


@pytest.mark.parametrize(
    "change, problem",
    [
        # parent after child: row 1's parent is row 2
        (dict(parents=torch.tensor([ROW_IS_ROOT, 2, 0, 0, 3])), "parents must precede children"),
        # not ancestor-closed: row 4's parent row 7 is not in the tree
        (dict(parents=torch.tensor([ROW_IS_ROOT, 0, 1, 0, 7])), "not ancestor-closed"),
        (dict(parents=torch.tensor([0, 0, 1, 0, 3])), "parents: row 0"),
        (dict(depths=torch.tensor([0, 1, 3, 1, 2])), "depths"),
        (dict(positions=torch.tensor([10, 11, 12, 11, 13])), "positions"),
        (dict(positions=torch.tensor([0, 1, 2, 1, 2])), "positions"),
        (dict(tokens=torch.tensor([FRONTIER, A, A1, B, VOCAB])), "outside"),
        (dict(tokens=torch.tensor([FRONTIER, A, A1, -1, B1])), "outside"),
        (dict(tokens=torch.tensor([FRONTIER, A, A1, A, B1])), "duplicate token"),
        (dict(tree_mask=torch.eye(5, dtype=torch.bool)), "tree_mask"),
        (dict(retrieve=torch.tensor([[0, 1, 2], [0, 3, RETRIEVE_PAD]])), "retrieve"),
        (dict(draft_probs=torch.tensor([1.0, 0.6, 0.8, 1.4, 0.95])), "draft_probs"),
    ],
)
def test_validate_flat_tree_rejects(change, problem):
    bad = dataclasses.replace(_flat(), **change)
    with pytest.raises(ValueError, match=problem):
        validate_flat_tree(bad, vocab_size=VOCAB, max_rows=5, base_position=BASE)


def test_validate_flat_tree_rejects_rows_over_budget():
    with pytest.raises(ValueError, match="exceed the budget"):
        validate_flat_tree(_flat(), vocab_size=VOCAB, max_rows=4, base_position=BASE)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(vocab_size=0, max_rows=5, base_position=BASE), "vocab_size"),
        (dict(vocab_size=VOCAB, max_rows=True, base_position=BASE), "max_rows"),
        (dict(vocab_size=VOCAB, max_rows=5, base_position=-1), "base_position"),
    ],
)
def test_validate_flat_tree_rejects_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        validate_flat_tree(_flat(), **kwargs)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(tokens=torch.tensor([FRONTIER, A, A1, B, B1], dtype=torch.int32)), "tokens"),
        (dict(positions=torch.tensor([10, 11, 12, 11])), "positions"),
        (dict(tree_mask=torch.ones(5, 4, dtype=torch.bool)), "tree_mask"),
        (dict(tree_mask=torch.ones(5, 5, dtype=torch.int64)), "tree_mask"),
        (dict(retrieve=torch.tensor([0, 1, 2])), "retrieve"),
        (dict(draft_probs=torch.ones(5, dtype=torch.float64)), "draft_probs"),
    ],
)
def test_flat_tree_layout_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(_flat(), **change)


def test_a_draft_tree_pickles_through_lists_and_arrives_equal_and_validated():
    """Ray pickles trees between replicas: the round trip keeps every value and dtype (float32
    confidences survive float64 lists exactly), an empty tree stays empty, and the arrival runs
    the constructor's checks again."""
    import pickle

    from eyas.protocol import tree as tree_module

    t = DraftTree(
        torch.tensor([5, 6, 7]),
        torch.tensor([PARENT_IS_ROOT, PARENT_IS_ROOT, 0]),
        torch.tensor([1, 1, 2]),
        torch.tensor([0.7, 0.1, 1 / 3], dtype=torch.float32),
    )
    blob = pickle.dumps(t)
    assert len(blob) < 400  # lists, not four pickled tensors (about 1.5 kB)
    back = pickle.loads(blob)
    for name in ("tokens", "parents", "depths", "draft_probs"):
        assert torch.equal(getattr(back, name), getattr(t, name))
        assert getattr(back, name).dtype == getattr(t, name).dtype
    assert pickle.loads(pickle.dumps(DraftTree.empty())).num_nodes == 0
    with pytest.raises(ValueError, match="^depths: node 2"):
        tree_module._draft_tree_from_lists([5, 6, 7], [PARENT_IS_ROOT, PARENT_IS_ROOT, 0], [1, 1, 3], [0.7, 0.1, 0.2])


def test_a_chain_hangs_each_token_under_the_last_and_an_empty_chain_is_the_empty_tree():
    tree = DraftTree.chain([7, 3, 9], draft_prob=0.25)
    assert tree.tokens.tolist() == [7, 3, 9]
    assert tree.parents.tolist() == [PARENT_IS_ROOT, 0, 1]
    assert tree.depths.tolist() == [1, 2, 3]
    assert tree.draft_probs.tolist() == [0.25, 0.25, 0.25] and tree.draft_probs.dtype == torch.float32
    empty = DraftTree.chain([])
    assert empty.num_nodes == 0 and all(
        torch.equal(getattr(empty, f), getattr(DraftTree.empty(), f)) for f in ("tokens", "parents", "depths")
    )
