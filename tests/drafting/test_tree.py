"""Draft trees and their builders (design 0x05B, 0x06A-0x06C)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.drafting.tree import (
    CONFIDENCE_FLOOR,
    DEFAULT_STATIC_CHOICES,
    DynamicTreeBuilder,
    StaticTreeBuilder,
    chain_choices,
)
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree

Proposal = Callable[[int | None, int], tuple[list[int], list[float]]]
# (parent token, or None for the seed; k) -> (k tokens, k descending confidences)


def drive(builder, propose: Proposal) -> None:
    """Run the builder protocol the way the drafter engine does, tracking each node's token."""
    token_of: dict[int, int] = {}
    while not builder.done:
        parents = builder.expandable()
        k = builder.children_per_parent
        rows = [propose(None if p == PARENT_IS_ROOT else token_of[p], k) for p in parents]
        tokens = torch.tensor([r[0] for r in rows], dtype=torch.int64).reshape(len(parents), k)
        probs = torch.tensor([r[1] for r in rows], dtype=torch.float32).reshape(len(parents), k)
        for i in builder.add_children(parents, tokens, probs):
            node = builder.node(i)
            assert node.token == rows[parents.index(node.parent)][0][node.column]
            token_of[i] = node.token


# The design 0x06C fixture as a drafter: token ids stand for the named candidates.
A, B, A1, A2, B1, B2 = 10, 20, 11, 12, 21, 22
NAMES = {A: "A", B: "B", A1: "A1", A2: "A2", B1: "B1", B2: "B2"}
SEED_FIXTURE = {  # parent token -> children; B2 (0.03) fills the second column under B
    None: ([A, B], [0.60, 0.40]),
    A: ([A1, A2], [0.80, 0.20]),
    B: ([B1, B2], [0.95, 0.03]),
}


def build_seed_fixture(verify_budget: int) -> DynamicTreeBuilder:
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=verify_budget, max_depth=2)
    drive(builder, lambda parent_token, k: SEED_FIXTURE[parent_token])
    return builder


def test_seed_tree_fixture_budget_four_selects_a_a1_b_b1():
    """Seed 0x06C, width 2, depth 2, budget 4.

        root
        |- A  0.60  value 0.60
        |  |- A1 0.80  value 0.48
        |  `- A2 0.20  value 0.12
        `- B  0.40  value 0.40
           |- B1 0.95  value 0.38
           `- B2 0.03  value 0.012   (filler: the drafter always proposes 2 children)

    Global reranking: A 0.60, A1 0.48, B 0.40, B1 0.38, A2 0.12, B2 0.012.
    Budget 4 -> [A, A1, B, B1], ancestor-closed without adding ancestors afterwards;
    tree parents [SEED, 0, SEED, 2], depths [1, 2, 1, 2].
    """
    builder = build_seed_fixture(verify_budget=4)
    assert builder.num_built == 6
    tree = builder.select()
    assert [NAMES[t] for t in tree.tokens.tolist()] == ["A", "A1", "B", "B1"]
    assert tree.parents.tolist() == [PARENT_IS_ROOT, 0, PARENT_IS_ROOT, 2]
    assert tree.depths.tolist() == [1, 2, 1, 2]
    assert tree.draft_probs.tolist() == pytest.approx([0.60, 0.80, 0.40, 0.95])
    assert tree.num_nodes == 4 and tree.max_depth == 2
    selected = builder.selected_node_ids()
    assert [NAMES[builder.node(i).token] for i in selected] == ["A", "A1", "B", "B1"]
    assert [builder.node(i).log_value for i in selected] == pytest.approx(
        [math.log(v) for v in (0.60, 0.48, 0.40, 0.38)]
    )
    assert tree.children_of(PARENT_IS_ROOT) == [0, 2]
    assert tree.children_of(0) == [1]


def test_seed_tree_fixture_breadth_first_would_spend_fourth_slot_on_a2():
    """Breadth-first order [A, B, A1, A2, B1] would take A2 (value 0.12) as its fourth node;
    global reranking by path value excludes A2 and takes B1 (0.38) instead (design 0x06C)."""
    builder = build_seed_fixture(verify_budget=4)
    breadth_first = [A, B, A1, A2]  # first four of the breadth-first order
    selected = builder.select().tokens.tolist()
    assert A2 in breadth_first and A2 not in selected
    assert B1 in selected


def test_seed_tree_fixture_full_budget_orders_by_value():
    tree = build_seed_fixture(verify_budget=100).select()
    assert [NAMES[t] for t in tree.tokens.tolist()] == ["A", "A1", "B", "B1", "A2", "B2"]


def test_expandable_takes_top_width_of_latest_layer():
    """Width 1: after the seed step only A (0.6) is expanded, never B."""
    builder = DynamicTreeBuilder(expand_width=1, verify_budget=10, max_depth=3)
    assert builder.expandable() == [PARENT_IS_ROOT]
    assert builder.children_per_parent == 1
    (a,) = builder.add_children([PARENT_IS_ROOT], torch.tensor([[A]]), torch.tensor([[0.6]]))
    assert builder.expandable() == [a]
    with pytest.raises(ValueError, match="expandable"):
        builder.add_children([PARENT_IS_ROOT], torch.tensor([[B]]), torch.tensor([[0.4]]))


@pytest.mark.parametrize("budget, depth", [(0, 3), (5, 0)])
def test_zero_budget_or_depth_gives_empty_tree(budget, depth):
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=budget, max_depth=depth)
    assert builder.done and builder.expandable() == []
    tree = builder.select()
    assert tree.num_nodes == 0 and tree.max_depth == 0
    with pytest.raises(ValueError, match="done"):
        builder.add_children([PARENT_IS_ROOT], torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))


# --------------------------------------------------------------------------------------------
# Value floors (cost-aware trees)
# --------------------------------------------------------------------------------------------


def test_min_value_keeps_nodes_under_the_floor_out_of_the_verified_tree():
    """The seed fixture, budget 100, floor 0.39: A 0.60, A1 0.48 and B 0.40 are verified; B1 (0.38),
    A2 (0.12) and B2 (0.012) are built but not sent. The selection stays ancestor-closed."""
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=100, max_depth=2, min_value=0.39)
    drive(builder, lambda parent_token, k: SEED_FIXTURE[parent_token])
    assert builder.num_built == 6
    tree = builder.select()
    assert [NAMES[t] for t in tree.tokens.tolist()] == ["A", "A1", "B"]
    assert tree.parents.tolist() == [PARENT_IS_ROOT, 0, PARENT_IS_ROOT]


def test_min_value_above_every_node_gives_a_plain_round():
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=4, max_depth=2, min_value=0.7)
    drive(builder, lambda parent_token, k: SEED_FIXTURE[parent_token])
    assert builder.select().num_nodes == 0


def test_expand_min_value_expands_only_nodes_at_the_floor():
    """Floor 0.5: after the seed step only A (0.60) is expanded, B (0.40) is not, though the width
    is 2; the growth then ends at depth 2 as before."""
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=100, max_depth=3, expand_min_value=0.5)
    drive(builder, lambda parent_token, k: SEED_FIXTURE.get(parent_token, ([90, 91], [0.5, 0.5])))
    tokens = [builder.node(i).token for i in range(builder.num_built)]
    assert [NAMES.get(t, t) for t in tokens] == ["A", "B", "A1", "A2"]  # A1 (0.48) is not expanded
    assert builder.done and builder.expandable() == []


def test_expand_min_value_above_the_first_layer_stops_after_one_step():
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=4, max_depth=5, expand_min_value=0.9)
    assert builder.expandable() == [PARENT_IS_ROOT]  # the seed (value 1) always grows its first layer
    builder.add_children([PARENT_IS_ROOT], torch.tensor([[A, B]]), torch.tensor([[0.6, 0.4]]))
    assert builder.done and builder.expandable() == []
    assert [NAMES[t] for t in builder.select().tokens.tolist()] == ["A", "B"]


@settings(max_examples=100, deadline=None)
@given(
    width=st.integers(1, 3),
    depth=st.integers(1, 4),
    budget=st.integers(1, 10),
    min_value=st.sampled_from([0.0, 0.01, 0.1, 0.3]),
    expand_min_value=st.sampled_from([0.0, 0.05, 0.2, 0.5]),
    data=st.data(),
)
def test_value_floors_are_the_plain_tree_cut_by_value(width, depth, budget, min_value, expand_min_value, data):
    """A tree with floors is what plain EAGLE-2 builds, with the layers grown only from nodes at the
    expansion floor and the verified nodes those of the plain selection at the verification floor:
    the same drafter proposals drive a plain and a floored builder side by side."""
    floored = DynamicTreeBuilder(
        expand_width=width,
        verify_budget=budget,
        max_depth=depth,
        min_value=min_value,
        expand_min_value=expand_min_value,
    )
    proposals: dict[int | None, tuple[list[int], list[float]]] = {}

    def propose(parent_token, k):
        if parent_token not in proposals:
            tokens = data.draw(st.lists(st.integers(0, 10**6), min_size=k, max_size=k, unique=True))
            conf = sorted(data.draw(st.lists(st.floats(0.0, 1.0), min_size=k, max_size=k)), reverse=True)
            proposals[parent_token] = (tokens, [c / max(sum(conf), 1.0) for c in conf])
        return proposals[parent_token]

    drive(floored, propose)
    values = [math.exp(floored.node(i).log_value) for i in range(floored.num_built)]
    for i in range(floored.num_built):  # every built node's parent passed the expansion floor
        parent = floored.node(i).parent
        assert parent == PARENT_IS_ROOT or values[parent] >= expand_min_value * (1 - 1e-9)
    selected = floored.selected_node_ids()
    ranked = sorted(range(floored.num_built), key=lambda n: (-floored.node(n).log_value, floored.node(n).depth, n))
    assert selected == [n for n in ranked[:budget] if values[n] >= min_value * (1 - 1e-9)]
    assert all(floored.node(n).parent == PARENT_IS_ROOT or floored.node(n).parent in selected for n in selected)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(min_value=-0.1), "min_value"),
        (dict(min_value=1.5), "min_value"),
        (dict(min_value=float("nan")), "min_value"),
        (dict(min_value=True), "min_value"),
        (dict(expand_min_value=2.0), "expand_min_value"),
        (dict(expand_min_value="0.5"), "expand_min_value"),
    ],
)
def test_value_floors_are_refused_outside_zero_one(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        DynamicTreeBuilder(expand_width=2, verify_budget=4, max_depth=2, **kwargs)


# --------------------------------------------------------------------------------------------
# Property: the selection is the global top-budget by (-log value, depth, node id)
# --------------------------------------------------------------------------------------------

CONFIDENCE = st.one_of(
    st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.125]),  # exact extremes and ties
    st.floats(min_value=0.0, max_value=1.0),
)


@settings(max_examples=150, deadline=None)
@given(
    width=st.integers(1, 3),
    depth=st.integers(0, 4),
    budget=st.integers(0, 14),
    data=st.data(),
)
def test_dynamic_selection_is_global_top_budget(width, depth, budget, data):
    builder = DynamicTreeBuilder(expand_width=width, verify_budget=budget, max_depth=depth)
    log_value: dict[int, float] = {PARENT_IS_ROOT: 0.0}
    node_depth: dict[int, int] = {PARENT_IS_ROOT: 0}
    node_parent: dict[int, int] = {}
    layer = [PARENT_IS_ROOT]

    def key(n: int) -> tuple[float, int, int]:
        return (-log_value[n], node_depth[n], n)

    while not builder.done:
        parents = builder.expandable()
        assert parents == sorted(layer, key=key)[:width]
        tokens, probs = [], []
        for _ in parents:
            tokens.append(data.draw(st.lists(st.integers(0, 40), min_size=width, max_size=width, unique=True)))
            conf = data.draw(st.lists(CONFIDENCE, min_size=width, max_size=width))
            if sum(conf) > 1.0:
                conf = [c / sum(conf) for c in conf]
            probs.append(conf)
        probs_t = torch.tensor(probs, dtype=torch.float32).reshape(len(parents), width)
        new_ids = builder.add_children(
            parents, torch.tensor(tokens, dtype=torch.int64).reshape(len(parents), width), probs_t
        )
        stored = probs_t.to(torch.float64).tolist()
        for node, (p, c) in zip(new_ids, [(p, c) for p, row in zip(parents, stored) for c in row]):
            node_parent[node] = p
            node_depth[node] = node_depth[p] + 1
            log_value[node] = log_value[p] + math.log(max(c, CONFIDENCE_FLOOR))
        layer = new_ids

    expected = sorted(node_parent, key=key)[:budget]
    assert builder.selected_node_ids() == expected
    tree = builder.select()
    assert tree.num_nodes == len(expected) <= budget
    chosen = set(expected)
    assert all(node_parent[n] == PARENT_IS_ROOT or node_parent[n] in chosen for n in expected)
    for i, p in enumerate(tree.parents.tolist()):  # DraftTree also validates this on construction
        assert p == PARENT_IS_ROOT or 0 <= p < i
        assert p == PARENT_IS_ROOT or expected[p] == node_parent[expected[i]]


# --------------------------------------------------------------------------------------------
# Invalid inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(expand_width=0, verify_budget=4, max_depth=2), "expand_width"),
        (dict(expand_width=True, verify_budget=4, max_depth=2), "expand_width"),
        (dict(expand_width=2.0, verify_budget=4, max_depth=2), "expand_width"),
        (dict(expand_width=2, verify_budget=-1, max_depth=2), "verify_budget"),
        (dict(expand_width=2, verify_budget=False, max_depth=2), "verify_budget"),
        (dict(expand_width=2, verify_budget=4, max_depth=-1), "max_depth"),
        (dict(expand_width=2, verify_budget=4, max_depth=True), "max_depth"),
        (dict(expand_width=2, verify_budget=4, max_depth="2"), "max_depth"),
    ],
)
def test_dynamic_builder_rejects_bad_knobs(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DynamicTreeBuilder(**kwargs)


@pytest.mark.parametrize(
    "parents, tokens, probs, problem",
    [
        ([PARENT_IS_ROOT], [[1, 2]], [[-0.1, 0.5]], "finite probability"),
        ([PARENT_IS_ROOT], [[1, 2]], [[float("nan"), 0.5]], "finite probability"),
        ([PARENT_IS_ROOT], [[1, 2]], [[1.5, 0.0]], "finite probability"),
        ([PARENT_IS_ROOT], [[1, 1]], [[0.5, 0.25]], "duplicate token"),
        ([PARENT_IS_ROOT], [[1, 2]], [[0.7, 0.6]], "sibling probability mass"),
        ([0], [[1, 2]], [[0.5, 0.25]], "expandable"),
        ([PARENT_IS_ROOT], [[1, 2, 3]], [[0.5, 0.25, 0.0]], "children_per_parent"),
        ([PARENT_IS_ROOT], [[-3, 2]], [[0.5, 0.25]], "negative token"),
    ],
)
def test_add_children_rejects_invalid_records(parents, tokens, probs, problem):
    builder = DynamicTreeBuilder(expand_width=2, verify_budget=4, max_depth=2)
    with pytest.raises(ValueError, match=problem):
        builder.add_children(
            parents,
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(probs, dtype=torch.float32),
        )


def test_add_children_rejects_wrong_dtypes():
    builder = DynamicTreeBuilder(expand_width=1, verify_budget=4, max_depth=2)
    with pytest.raises(ValueError, match="tokens"):
        builder.add_children([PARENT_IS_ROOT], torch.tensor([[1]], dtype=torch.int32), torch.tensor([[0.5]]))
    with pytest.raises(ValueError, match="probs"):
        builder.add_children([PARENT_IS_ROOT], torch.tensor([[1]]), torch.tensor([[1]]))


def test_duplicate_token_under_one_parent_listed_twice_is_rejected():
    builder = DynamicTreeBuilder(expand_width=1, verify_budget=4, max_depth=2)
    with pytest.raises(ValueError, match="duplicate token"):
        builder.add_children(
            [PARENT_IS_ROOT, PARENT_IS_ROOT],
            torch.tensor([[7], [7]]),
            torch.tensor([[0.5], [0.25]]),
        )


def _tree(tokens, parents, depths, probs) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor(depths, dtype=torch.int64),
        draft_probs=torch.tensor(probs, dtype=torch.float32),
    )


@pytest.mark.parametrize(
    "tokens, parents, depths, probs, field",
    [
        ([1, 2], [1, PARENT_IS_ROOT], [2, 1], [0.5, 0.5], "parents"),  # parent after child
        ([1, 2], [PARENT_IS_ROOT, 5], [1, 2], [0.5, 0.5], "parents"),  # parent not in tree
        ([1, 2], [PARENT_IS_ROOT, 0], [1, 3], [0.5, 0.5], "depths"),
        ([1, 2], [PARENT_IS_ROOT, 0], [0, 1], [0.5, 0.5], "depths"),
        ([1, 1], [PARENT_IS_ROOT, PARENT_IS_ROOT], [1, 1], [0.5, 0.4], "duplicate token"),
        ([1, 2], [PARENT_IS_ROOT, 0], [1, 2], [0.5, 1.5], "draft_probs"),
        ([1, 2], [PARENT_IS_ROOT, 0], [1, 2], [float("nan"), 0.5], "draft_probs"),
        ([-1, 2], [PARENT_IS_ROOT, 0], [1, 2], [0.5, 0.5], "tokens"),
    ],
)
def test_draft_tree_rejects_invalid_fields(tokens, parents, depths, probs, field):
    with pytest.raises(ValueError, match=field):
        _tree(tokens, parents, depths, probs)


def test_draft_tree_rejects_bad_layout():
    good = dict(
        tokens=torch.tensor([1], dtype=torch.int64),
        parents=torch.tensor([PARENT_IS_ROOT], dtype=torch.int64),
        depths=torch.tensor([1], dtype=torch.int64),
        draft_probs=torch.tensor([0.5], dtype=torch.float32),
    )
    with pytest.raises(ValueError, match="draft_probs"):
        DraftTree(**{**good, "draft_probs": torch.tensor([0.5], dtype=torch.float64)})
    with pytest.raises(ValueError, match="tokens"):
        DraftTree(**{**good, "tokens": torch.tensor([[1]], dtype=torch.int64)})
    with pytest.raises(ValueError, match="depths"):
        DraftTree(**{**good, "depths": torch.tensor([1, 2], dtype=torch.int64)})
    assert DraftTree.empty().num_nodes == 0


# --------------------------------------------------------------------------------------------
# Static trees
# --------------------------------------------------------------------------------------------


def ranked_proposal(parent_token: int | None, k: int) -> tuple[list[int], list[float]]:
    """Rank j under token t proposes token 10t + j + 1 (t = 0 at the seed), confidence 2^-(j+1)."""
    base = 0 if parent_token is None else 10 * parent_token
    return [base + j + 1 for j in range(k)], [0.5 ** (j + 1) for j in range(k)]


def test_chain_choices_build_a_chain():
    """chain_choices(3) = [[0], [0, 0], [0, 0, 0]]: three top-1 nodes, each the last one's child."""
    assert chain_choices(3) == [[0], [0, 0], [0, 0, 0]]
    assert chain_choices(0) == []
    builder = StaticTreeBuilder(chain_choices(3))
    drive(builder, ranked_proposal)
    tree = builder.select()
    assert tree.parents.tolist() == [PARENT_IS_ROOT, 0, 1]
    assert tree.depths.tolist() == [1, 2, 3]
    assert tree.tokens.tolist() == [1, 11, 111]
    with pytest.raises(ValueError, match="depth"):
        chain_choices(-1)


def test_static_choice_list_builds_expected_tree():
    """Choices [[0], [1], [0, 0], [0, 1], [1, 0]] with children_per_parent 2 at both layers:

    seed -> n0 (rank 0, token 1), n1 (rank 1, token 2)
    n0   -> n2 (rank 0, token 11), n3 (rank 1, token 12)
    n1   -> n4 (rank 0, token 21); rank 1 under n1 (token 22) is proposed but dropped
    """
    builder = StaticTreeBuilder([[0], [1], [0, 0], [0, 1], [1, 0]])
    assert builder.expandable() == [PARENT_IS_ROOT] and builder.children_per_parent == 2
    drive(builder, ranked_proposal)
    tree = builder.select()
    assert tree.tokens.tolist() == [1, 2, 11, 12, 21]
    assert tree.parents.tolist() == [PARENT_IS_ROOT, PARENT_IS_ROOT, 0, 0, 1]
    assert tree.depths.tolist() == [1, 1, 2, 2, 2]
    assert tree.draft_probs.tolist() == [0.5, 0.25, 0.5, 0.25, 0.5]
    assert builder.selected_node_ids() == [0, 1, 2, 3, 4]
    assert [builder.node(i).column for i in range(5)] == [0, 1, 0, 1, 0]  # column = rank
    assert builder.node(4).parent == 1 and builder.node(4).depth == 2
    with pytest.raises(ValueError, match="node_id"):
        builder.node(5)


def test_default_static_choices_are_a_valid_tree():
    builder = StaticTreeBuilder(DEFAULT_STATIC_CHOICES)
    drive(builder, ranked_proposal)
    tree = builder.select()
    assert tree.num_nodes == len(DEFAULT_STATIC_CHOICES) == 25
    assert tree.max_depth == 5


def test_empty_choices_give_empty_tree():
    builder = StaticTreeBuilder([])
    assert builder.done and builder.select().num_nodes == 0


@pytest.mark.parametrize(
    "choices, problem",
    [
        ([[0], [0, 0, 0]], "ancestor-closed"),
        ([[1, 0]], "ancestor-closed"),
        ([[0], [0]], "duplicate"),
        ([[0], []], "empty path"),
        ([[-1]], "nonnegative"),
        ([[True]], "nonnegative"),
        ([[0.0]], "nonnegative"),
        (["0"], "sequence"),
    ],
)
def test_static_builder_rejects_bad_choices(choices, problem):
    with pytest.raises(ValueError, match=problem):
        StaticTreeBuilder(choices)


def test_static_builder_rejects_non_descending_ranks():
    builder = StaticTreeBuilder([[0], [1]])
    with pytest.raises(ValueError, match="descending"):
        builder.add_children([PARENT_IS_ROOT], torch.tensor([[1, 2]]), torch.tensor([[0.2, 0.5]]))
