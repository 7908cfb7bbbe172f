"""Rollout visibility as a dependency graph (design 0x07B HASS, 0x08C EAGLE-3 TTT)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.training.masks import (
    no_sibling_or_future_edges,
    rollout_position_ids,
    rollout_valid,
    rollout_visibility,
)

Node = tuple[int, int]  # (step s, row i)


def long_t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def bool_t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


# --------------------------------------------------------------------------------------------
# brute-force reference: explicit nodes with parent pointers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutNode:
    step: int
    row: int
    segment: int
    draft_parent: Node | None  # (s-1, i) for s >= 2; None for depth 1 and step-0 rows


def build_nodes(segment: list[int], steps: int) -> dict[Node, RolloutNode]:
    nodes = {}
    for s in range(steps):
        for i, seg in enumerate(segment):
            parent = (s - 1, i) if s >= 2 else None
            nodes[(s, i)] = RolloutNode(step=s, row=i, segment=seg, draft_parent=parent)
    return nodes


def brute_force_visible(nodes: dict[Node, RolloutNode], row_valid: list[bool], query: Node) -> set[Node]:
    """Target prefix + draft ancestors (walked through parent pointers) + the node itself."""
    node = nodes[query]
    seen = {query}
    if node.step >= 1:  # a draft node's chain: itself, then parents up to depth 1
        walk = node.draft_parent
        while walk is not None:
            seen.add(walk)
            walk = nodes[walk].draft_parent
    for j in range(node.row + 1):  # target prefix: committed step-0 rows of the same sample
        if row_valid[j] and nodes[(0, j)].segment == node.segment:
            seen.add((0, j))
    return seen


def edges_of(mask: torch.Tensor, seq: int) -> set[tuple[Node, Node]]:
    """Dependency graph of a [steps, S, steps*S] mask as a set of (query, key) node edges."""
    out = set()
    for s, i, k in mask.nonzero().tolist():
        out.add(((s, i), (k // seq, k % seq)))
    return out


def graph_violations(edges: set[tuple[Node, Node]], segment: list[int]) -> list[str]:
    """Independent (pure python) statement of the design 0x07B graph rules."""
    bad = []
    for (s, i), (s2, j) in edges:
        if s2 > s:
            bad.append(f"future step: ({s},{i}) -> ({s2},{j})")
        if s2 == 0 and j > i:
            bad.append(f"future position: ({s},{i}) -> (0,{j})")
        if segment[i] != segment[j]:
            bad.append(f"cross segment: ({s},{i}) -> ({s2},{j})")
        if s2 >= 1 and j != i:
            bad.append(f"sibling: ({s},{i}) -> ({s2},{j})")
    return bad


# --------------------------------------------------------------------------------------------
# golden
# --------------------------------------------------------------------------------------------


def test_rollout_visibility_golden():
    """S = 3 rows in one segment, all row-valid, steps = 2.

    Keys: [(0,0) (0,1) (0,2) (1,0) (1,1) (1,2)]; visible keys per query:

        (0,0): (0,0)                        (1,0): (0,0)             + (1,0)
        (0,1): (0,0) (0,1)                  (1,1): (0,0) (0,1)       + (1,1)
        (0,2): (0,0) (0,1) (0,2)            (1,2): (0,0) (0,1) (0,2) + (1,2)

    Step 0 uses only the first S columns; depth-1 nodes never see sibling chains (1, j != i).
    """
    mask = rollout_visibility(long_t([0, 0, 0]), bool_t([1, 1, 1]), steps=2)
    expected = bool_t(
        [
            [
                [1, 0, 0, 0, 0, 0],
                [1, 1, 0, 0, 0, 0],
                [1, 1, 1, 0, 0, 0],
            ],
            [
                [1, 0, 0, 1, 0, 0],
                [1, 1, 0, 0, 1, 0],
                [1, 1, 1, 0, 0, 1],
            ],
        ]
    )
    assert torch.equal(mask, expected)
    assert not mask[0, :, 3:].any()  # step 0 needs only keys of step 0
    assert no_sibling_or_future_edges(mask, long_t([0, 0, 0]), steps=2)


def test_rollout_visibility_matches_parent_pointer_construction():
    """Two packed segments [0, 0, 0, 1, 1] with row 2 invalid (its pair crosses the boundary),
    steps = 3: every node sees exactly its parent-pointer chain + target prefix + itself.
    """
    segment = [0, 0, 0, 1, 1]
    row_valid = [True, True, False, True, False]
    steps, seq = 3, len(segment)
    mask = rollout_visibility(long_t(segment), bool_t(row_valid), steps)
    edges = edges_of(mask, seq)
    nodes = build_nodes(segment, steps)
    for query in nodes:
        got = {key for q, key in edges if q == query}
        assert got == brute_force_visible(nodes, row_valid, query), query
    assert graph_violations(edges, segment) == []
    assert no_sibling_or_future_edges(mask, long_t(segment), steps)
    assert mask.any(dim=-1).all()  # every query sees at least itself: no NaN rows


def test_graph_is_acyclic_and_ancestor_closed():
    """As a networkx dependency graph: a DAG (after dropping self loops) whose every node's
    visible set is closed under visibility (what an ancestor sees, the node sees too).
    """
    nx = pytest.importorskip("networkx")
    segment = [0, 0, 1, 1, 1, 1]
    row_valid = [True, False, True, True, True, False]
    steps, seq = 4, len(segment)
    mask = rollout_visibility(long_t(segment), bool_t(row_valid), steps)
    graph = nx.DiGraph()
    graph.add_nodes_from((s, i) for s in range(steps) for i in range(seq))
    graph.add_edges_from((q, k) for q, k in edges_of(mask, seq) if q != k)
    assert nx.is_directed_acyclic_graph(graph)
    for node in graph.nodes:
        if node[0] >= 1:  # draft nodes: their context is transitively closed
            assert nx.descendants(graph, node) == set(graph.successors(node))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=7),
    st.integers(1, 4),
)
def test_rollout_visibility_property(slots, steps):
    """Random packing/validity: brute-force equality and the graph check both hold."""
    segment = [s for s, _ in slots]
    row_valid = [v for _, v in slots]
    seq = len(segment)
    mask = rollout_visibility(long_t(segment), bool_t(row_valid), steps)
    assert mask.shape == (steps, seq, steps * seq)
    edges = edges_of(mask, seq)
    nodes = build_nodes(segment, steps)
    for query in nodes:
        assert {k for q, k in edges if q == query} == brute_force_visible(nodes, row_valid, query)
    assert no_sibling_or_future_edges(mask, long_t(segment), steps)
    for s in range(steps):  # step s only uses keys of steps 0..s
        assert not mask[s, :, (s + 1) * seq :].any()


# --------------------------------------------------------------------------------------------
# the check can fail
# --------------------------------------------------------------------------------------------


def test_dense_causal_mask_over_concatenated_rows_fails_the_check():
    """A dense lower-triangular mask over the physically concatenated steps*S rows looks causal
    but lets (1, 2) see (1, 0) and (1, 1) -- sibling chains -- and the check rejects it.
    """
    segment = long_t([0, 0, 0])
    steps, seq = 2, 3
    flat = torch.ones(steps * seq, steps * seq, dtype=torch.bool).tril()
    dense = flat.reshape(steps, seq, steps * seq)
    assert not no_sibling_or_future_edges(dense, segment, steps)
    violations = graph_violations(edges_of(dense, seq), [0, 0, 0])
    assert any(v.startswith("sibling") for v in violations)


@pytest.mark.parametrize(
    "query, key, rule",
    [
        ((0, 1), (0, 2), "future position"),
        ((0, 1), (1, 1), "future step"),
        ((1, 1), (1, 0), "sibling"),
        ((2, 2), (1, 1), "sibling"),
        ((1, 3), (0, 1), "cross segment"),
    ],
)
def test_each_single_forbidden_edge_is_caught(query, key, rule):
    """Adding one forbidden edge to a correct mask flips the check (segments [0, 0, 0, 1])."""
    segment = [0, 0, 0, 1]
    steps, seq = 3, len(segment)
    mask = rollout_visibility(long_t(segment), torch.ones(seq, dtype=torch.bool), steps).clone()
    assert no_sibling_or_future_edges(mask, long_t(segment), steps)
    mask[query[0], query[1], key[0] * seq + key[1]] = True
    assert not no_sibling_or_future_edges(mask, long_t(segment), steps)
    assert any(v.startswith(rule) for v in graph_violations(edges_of(mask, seq), segment))


# --------------------------------------------------------------------------------------------
# rollout supervision and positions
# --------------------------------------------------------------------------------------------


def test_rollout_valid_golden():
    """S = 6, valid = [1, 1, 1, 1, 1, 0], one segment, supervise = [0, 1, 1, 1, 1, 1], steps 3.

    Node (s, i) needs slots i .. i+s+1 valid in one segment and l_i:
        s = 0: i + 1 <= 4 -> rows 0..3 valid, l_0 = 0 -> [0, 1, 1, 1, 0, 0]   (= m_soft)
        s = 1: i + 2 <= 4 -> rows 0..2          -> [0, 1, 1, 0, 0, 0]
        s = 2: i + 3 <= 4 -> rows 0..1          -> [0, 1, 0, 0, 0, 0]
    """
    out = rollout_valid(bool_t([1, 1, 1, 1, 1, 0]), long_t([0] * 6), bool_t([0, 1, 1, 1, 1, 1]), steps=3)
    assert out.tolist() == [
        [False, True, True, True, False, False],
        [False, True, True, False, False, False],
        [False, True, False, False, False, False],
    ]


def test_rollout_valid_stops_at_segment_boundary():
    """segment = [0, 0, 0, 1, 1, 1], all valid and supervised, steps = 2.

    s = 0: [1, 1, 0, 1, 1, 0]    (pair (2, 3) crosses the boundary)
    s = 1: [1, 0, 0, 1, 0, 0]    (row 1 would read slot 3 of the next sample)
    """
    out = rollout_valid(
        torch.ones(6, dtype=torch.bool),
        long_t([0, 0, 0, 1, 1, 1]),
        torch.ones(6, dtype=torch.bool),
        steps=2,
    )
    assert out.int().tolist() == [[1, 1, 0, 1, 1, 0], [1, 0, 0, 1, 0, 0]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 1), st.booleans(), st.booleans()), min_size=1, max_size=8),
    st.integers(1, 4),
)
def test_rollout_valid_property(slots, steps):
    """rollout_valid equals the direct definition; supervised nodes only see supervised-legal
    ancestors (a supervised (s, i) implies (s', i) is valid for all s' < s)."""
    segment = [s for s, _, _ in slots]
    valid = [v for _, v, _ in slots]
    supervise = [sup for _, _, sup in slots]
    seq = len(slots)
    out = rollout_valid(bool_t(valid), long_t(segment), bool_t(supervise), steps)
    for s in range(steps):
        for i in range(seq):
            span = range(i, i + s + 2)
            expect = (
                i + s + 1 < seq
                and all(valid[t] for t in span)
                and len({segment[t] for t in span}) == 1
                and supervise[i]
            )
            assert bool(out[s, i]) == expect
            if expect and s > 0:
                assert bool(out[s - 1, i])


def test_rollout_position_ids():
    """Node (s, i) sits at position_id[i] + s.

    position_id = [0, 1, 0, 1] (two packed samples) -> step 2: [2, 3, 2, 3].
    """
    out = rollout_position_ids(long_t([0, 1, 0, 1]), steps=3)
    assert out.tolist() == [[0, 1, 0, 1], [1, 2, 1, 2], [2, 3, 2, 3]]


# --------------------------------------------------------------------------------------------
# boundary errors
# --------------------------------------------------------------------------------------------


def test_invalid_inputs_name_the_field():
    seg = long_t([0, 0, 0])
    valid = bool_t([1, 1, 1])
    with pytest.raises(ValueError, match="steps"):
        rollout_visibility(seg, valid, 0)
    with pytest.raises(ValueError, match="row_valid"):
        rollout_visibility(seg, bool_t([1, 1]), 2)
    with pytest.raises(ValueError, match="segment_id"):
        rollout_visibility(seg.int(), valid, 2)
    with pytest.raises(ValueError, match="supervise"):
        rollout_valid(valid, seg, seg, 2)
    with pytest.raises(ValueError, match="mask"):
        no_sibling_or_future_edges(torch.ones(2, 3, 3, dtype=torch.bool), seg, 2)


def test_step_zero_agrees_with_dense_block_causal_mask():
    """For row-valid queries, step 0 of the rollout is the one-step dense mask of design 0x02A."""
    from eyas.training.rows import block_causal_mask, dense_row_masks

    valid = bool_t([[1, 1, 1, 1, 1, 1, 0]])
    segment = long_t([[0, 0, 0, 1, 1, 1, 1]])
    row_valid, _, _ = dense_row_masks(valid, segment, valid.clone())
    dense = block_causal_mask(segment, row_valid)[0]  # [S, S]
    rollout = rollout_visibility(segment[0], row_valid[0], steps=3)[0, :, :7]  # [S, S]
    rows = row_valid[0]
    assert torch.equal(dense[rows], rollout[rows])
