"""Greedy and exact stochastic acceptance of a flattened tree (design 0x05C, 0x05D, 0x09)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree, FlatTree, flatten_tree
from eyas.verification.accept import greedy_accept, stochastic_accept
from eyas.verification.sampling import target_probs

SEED = PARENT_IS_ROOT
VOCAB = 16
FRONTIER = 3


def make_flat(tokens: list[int], parents: list[int], frontier: int = FRONTIER) -> FlatTree:
    """Flatten a DraftTree given by node tokens and parents (depths and probs derived)."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == SEED else depths[p] + 1)
    tree = DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.int64),
        parents=torch.tensor(parents, dtype=torch.int64),
        depths=torch.tensor(depths, dtype=torch.int64),
        draft_probs=torch.full((len(tokens),), 0.5),
    )
    return flatten_tree(tree, frontier, 0)


def logits_with_argmax(argmax: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[R, vocab] logits whose row r has its maximum at argmax[r]."""
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


# Seed 0x06C shape with a repeated token: rows [root, A=5, A1=7, B=6, B1=7].
REPEATED = dict(tokens=[5, 7, 6, 7], parents=[SEED, 0, SEED, 2])


def test_greedy_no_match_accepts_only_root():
    """Argmax at the root is 9, matching neither A (5) nor B (6): rows [0], frontier 9."""
    flat = make_flat(**REPEATED)
    decision = greedy_accept(flat, logits_with_argmax([9, 0, 0, 0, 0]))
    assert decision.accepted_rows.tolist() == [0]
    assert decision.accepted_tokens.tolist() == []
    assert decision.frontier_token == 9
    assert decision.accept_length == 0 and decision.num_new_tokens == 1


def test_greedy_full_path_gets_bonus_frontier():
    """Argmax [6, _, _, 7, 2]: B (row 3) then B1 (row 4) match; frontier = argmax of row 4 = 2."""
    flat = make_flat(**REPEATED)
    decision = greedy_accept(flat, logits_with_argmax([6, 0, 0, 7, 2]))
    assert decision.accepted_rows.tolist() == [0, 3, 4]
    assert decision.accepted_tokens.tolist() == [6, 7]
    assert decision.frontier_token == 2
    assert decision.emitted_tokens == [6, 7, 2]


def test_greedy_repeated_token_is_identified_by_row():
    """Token 7 sits at rows 2 (under A) and 4 (under B). The target follows B, so the accepted
    row is 4; reconstructing it by token equality would find row 2 first (design 0x05D)."""
    flat = make_flat(**REPEATED)
    decision = greedy_accept(flat, logits_with_argmax([6, 7, 0, 7, 1]))
    assert decision.accepted_rows.tolist() == [0, 3, 4]
    assert 2 not in decision.accepted_rows.tolist()
    assert flat.tokens.tolist().index(7) == 2  # what a token search would (wrongly) return


def test_greedy_picks_longest_of_two_matching_paths():
    """Rows [root, A=1, A1=2, A2=3, A21=4]; retrieve [[0, 1, 2, PAD], [0, 1, 3, 4]].
    Argmax [1, 3, _, 4, 8]: line 1 matches only A (A1=2 != 3), line 2 matches A, A2, A21.
    The longer line wins: rows [0, 1, 3, 4], frontier 8."""
    flat = make_flat(tokens=[1, 2, 3, 4], parents=[SEED, 0, 0, 2])
    assert flat.retrieve.tolist() == [[0, 1, 2, -1], [0, 1, 3, 4]]
    decision = greedy_accept(flat, logits_with_argmax([1, 3, 0, 4, 8]))
    assert decision.accepted_rows.tolist() == [0, 1, 3, 4]
    assert decision.accepted_tokens.tolist() == [1, 3, 4]
    assert decision.frontier_token == 8


def test_greedy_on_empty_tree_is_target_only_decoding():
    flat = flatten_tree(DraftTree.empty(), FRONTIER, 0)
    decision = greedy_accept(flat, logits_with_argmax([11]))
    assert decision.accepted_rows.tolist() == [0] and decision.frontier_token == 11


def test_greedy_reads_a_given_argmax_instead_of_the_logits():
    """The head's own argmax (the gguf kernel's, ``Verified.argmax``) decides when given: the same
    decision as the logits' on agreeing input, the given ids when they differ (so it is read, not
    recomputed), for a tree and for a plain round; an argmax of the wrong length is refused by name."""
    flat = make_flat(tokens=[1, 2, 3, 4], parents=[SEED, 0, 0, 2])
    logits = logits_with_argmax([1, 3, 0, 4, 8])
    want = greedy_accept(flat, logits)
    given = greedy_accept(flat, logits, torch.tensor([1, 3, 0, 4, 8]))
    assert (given.accepted_rows.tolist(), given.frontier_token) == (want.accepted_rows.tolist(), want.frontier_token)
    other = greedy_accept(flat, logits, torch.tensor([1, 2, 9, 0, 0]))  # A then A1, frontier 9
    assert other.accepted_rows.tolist() == [0, 1, 2] and other.frontier_token == 9
    plain = flatten_tree(DraftTree.empty(), FRONTIER, 0)
    assert greedy_accept(plain, logits_with_argmax([11]), torch.tensor([5])).frontier_token == 5
    with pytest.raises(ValueError, match=r"^argmax: shape \(4,\) != \(5,\)"):
        greedy_accept(flat, logits, torch.tensor([1, 3, 0, 4]))


def test_publication_fixture_accepts_rows_0_2_and_frontier_separately():
    """Seed 0x09 publication fixture. Rows [root, a=4, b=8]; the target's argmax is b at the root
    and 9 at row 2. accepted rows [0, 2] -> target KV rows [0, 2] are gathered; token 9 is the
    frontier: emitted, not one of the accepted rows, its KV appended by the next forward."""
    flat = make_flat(tokens=[4, 8], parents=[SEED, SEED])
    logits = logits_with_argmax([8, 0, 9])
    for decision in (
        greedy_accept(flat, logits),
        stochastic_accept(flat, target_probs(logits, SamplingParams()), torch.Generator().manual_seed(0)),
    ):
        assert decision.accepted_rows.tolist() == [0, 2]
        assert decision.accepted_tokens.tolist() == [8]
        assert decision.frontier_token == 9
        assert decision.emitted_tokens == [8, 9]
        verified_kv = torch.arange(3 * 2).reshape(3, 2)  # [R, 2] stand-in for per-row target KV
        assert verified_kv[decision.accepted_rows].tolist() == [[0, 1], [4, 5]]


@st.composite
def trees_with_argmax(draw) -> tuple[FlatTree, list[int]]:
    """A random flat tree (sibling tokens distinct, repeats across branches likely) and a
    target argmax per row that often equals one of the row's children."""
    n = draw(st.integers(0, 8))
    parents: list[int] = []
    tokens: list[int] = []
    for i in range(n):
        parent = draw(st.integers(SEED, i - 1))
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        parents.append(parent)
        tokens.append(draw(st.sampled_from([t for t in range(9) if t not in taken])))
    flat = make_flat(tokens, parents)
    flat_parents = flat.parents.tolist()
    argmax = []
    for row in range(flat.num_rows):
        child_tokens = [flat.tokens[c].item() for c, p in enumerate(flat_parents) if p == row]
        any_token = st.integers(0, VOCAB - 1)
        argmax.append(draw(st.sampled_from(child_tokens) | any_token if child_tokens else any_token))
    return flat, argmax


@settings(max_examples=80, deadline=None)
@given(case=trees_with_argmax(), seed=st.integers(0, 2**32 - 1))
def test_greedy_path_properties_and_stochastic_one_hot_agrees(case, seed):
    """Greedy: the accepted rows form a parent chain from the root, each accepted token is the
    argmax of its parent row, the frontier is the argmax of the last row, and the path cannot be
    extended (no child of the last row carries that argmax). Exact acceptance with a one-hot
    (temperature 0) target makes the same decision: u < 1 accepts, u < 0 never does."""
    flat, argmax = case
    logits = logits_with_argmax(argmax)
    decision = greedy_accept(flat, logits)
    rows = decision.accepted_rows.tolist()
    parents, tokens = flat.parents.tolist(), flat.tokens.tolist()
    assert rows[0] == 0
    for parent_row, row in zip(rows, rows[1:]):
        assert parents[row] == parent_row and tokens[row] == argmax[parent_row]
    assert decision.frontier_token == argmax[rows[-1]]
    assert all(tokens[c] != argmax[rows[-1]] for c in range(1, flat.num_rows) if parents[c] == rows[-1])

    exact = stochastic_accept(flat, target_probs(logits, SamplingParams()), torch.Generator().manual_seed(seed))
    assert exact.accepted_rows.tolist() == rows
    assert exact.frontier_token == decision.frontier_token


def test_stochastic_with_all_mass_on_children_never_runs_dry():
    """All root mass on the children t0, t1 (t2 has none): the residual after rejecting every
    child would be empty, so by construction the last child with mass is always accepted."""
    flat = make_flat(**EXACT_TREE)
    probs = EXACT_PROBS.clone()
    probs[0] = torch.tensor([0.7, 0.3, 0.0, 0.0, 0.0, 0.0])
    generator = torch.Generator().manual_seed(5)
    firsts = {stochastic_accept(flat, probs, generator).emitted_tokens[0] for _ in range(300)}
    assert firsts == {0, 1}


# --------------------------------------------------------------------------------------------
# Exactness of stochastic acceptance
# --------------------------------------------------------------------------------------------

# Rows: 0 root, 1 t0, 2 t1, 3 t2 (children of the root); 4 t3, 5 t1 (children of row 1).
EXACT_TREE = dict(tokens=[0, 1, 2, 3, 1], parents=[SEED, SEED, SEED, 0, 0], frontier=5)
P_ROOT = [0.30, 0.05, 0.20, 0.15, 0.10, 0.20]
P_ROW1 = [0.10, 0.25, 0.05, 0.40, 0.10, 0.10]
P_OTHER = [1 / 6] * 6
EXACT_PROBS = torch.tensor([P_ROOT, P_ROW1, P_OTHER, P_OTHER, P_OTHER, P_OTHER])
TRIALS = 20_000
# A correct sampler fails a check with chance 0.1%; the fixed seed makes each run deterministic.
P_THRESHOLD = 1e-3


def _inexact_accept_without_residual_update(
    flat: FlatTree, probs: torch.Tensor, generator: torch.Generator
) -> AcceptDecision:
    """A broken variant: accept each child with the *unmodified* target probability p(c) and
    sample the frontier from the unmodified p. Rejected children keep their mass, so they are
    over-emitted (e.g. token 0 at the root: 0.30 + 0.532 * 0.30 instead of 0.30)."""
    parents = flat.parents.tolist()
    tokens = flat.tokens.tolist()
    p = probs.double().tolist()
    uniforms = iter(torch.rand(2 * flat.num_rows + 1, generator=generator, dtype=torch.float64).tolist())
    path = [0]
    while True:
        row = path[-1]
        for child in [c for c in range(flat.num_rows) if parents[c] == row]:
            if next(uniforms) < p[row][tokens[child]]:
                path.append(child)
                break
        else:
            u, frontier = next(uniforms), 0  # inverse CDF of the unmodified p[row]
            while u >= p[row][frontier] and frontier < len(p[row]) - 1:
                u -= p[row][frontier]
                frontier += 1
            rows = torch.tensor(path)
            return AcceptDecision(accepted_rows=rows, accepted_tokens=flat.tokens[rows[1:]], frontier_token=frontier)


def run_trials(accept, trials: int = TRIALS) -> tuple[Counter, Counter]:
    """(first emitted token counts, second emitted token counts given row 1 was accepted first)."""
    flat = make_flat(**EXACT_TREE)
    generator = torch.Generator().manual_seed(1234)
    first, second_after_row1 = Counter(), Counter()
    for _ in range(trials):
        decision = accept(flat, EXACT_PROBS, generator)
        emitted = decision.emitted_tokens
        first[emitted[0]] += 1
        if decision.accepted_rows.tolist()[:2] == [0, 1]:
            second_after_row1[emitted[1]] += 1
    return first, second_after_row1


def chisquare_p(counts: Counter, probs: list[float]) -> float:
    n = sum(counts.values())
    observed = [counts[t] for t in range(len(probs))]
    return chisquare(observed, [n * p for p in probs]).pvalue


@pytest.fixture(scope="module")
def exact_counts() -> tuple[Counter, Counter]:
    return run_trials(stochastic_accept)


def test_stochastic_first_token_matches_target(exact_counts):
    """The first emitted token (accepted child of the root, or the frontier when all of t0, t1, t2
    are rejected) is distributed as the target at the root, P_ROOT (chi-square, p > 1e-3)."""
    first, _ = exact_counts
    assert sum(first.values()) == TRIALS
    assert chisquare_p(first, P_ROOT) > P_THRESHOLD


def test_stochastic_second_token_after_row1_matches_target(exact_counts):
    """Given row 1 (token 0) was accepted, the next emitted token (t3 at row 4, t1 at row 5, or a
    frontier from the residual) is distributed as the target at row 1, P_ROW1."""
    _, second = exact_counts
    assert sum(second.values()) > 0.25 * TRIALS  # about 0.30 * TRIALS
    assert chisquare_p(second, P_ROW1) > P_THRESHOLD


def test_exactness_check_can_fail():
    """The same check on the broken variant gives p < 1e-3 -- the check has the power to fail,
    even with a quarter of the trials."""
    first, _ = run_trials(_inexact_accept_without_residual_update, trials=TRIALS // 4)
    assert chisquare_p(first, P_ROOT) < P_THRESHOLD


# --------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------


def test_accept_rejects_mismatched_target():
    flat = make_flat(**REPEATED)
    with pytest.raises(ValueError, match="rows"):
        greedy_accept(flat, torch.zeros(4, VOCAB))
    with pytest.raises(ValueError, match="vocabulary"):
        greedy_accept(flat, torch.zeros(5, 6))  # token 7 is outside a 6-token vocabulary
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept(flat, torch.zeros(5, VOCAB, dtype=torch.int64))
    with pytest.raises(ValueError, match="target_probs"):
        stochastic_accept(flat, -torch.ones(5, VOCAB), torch.Generator())
    with pytest.raises(ValueError, match="positive mass"):
        stochastic_accept(flat, torch.zeros(5, VOCAB), torch.Generator())
    with pytest.raises(ValueError, match="generator"):
        stochastic_accept(flat, torch.ones(5, VOCAB), None)


@pytest.mark.parametrize(
    "rows, tokens, frontier, field",
    [
        ([1, 2], [7], 0, "accepted_rows"),
        ([], [], 0, "accepted_rows"),
        ([0, 3, 2], [1, 2], 0, "accepted_rows"),
        ([0, 2], [], 0, "accepted_tokens"),
        ([0], [], -1, "frontier_token"),
        ([0], [], True, "frontier_token"),
    ],
)
def test_accept_decision_validation_names_field(rows, tokens, frontier, field):
    with pytest.raises(ValueError, match=field):
        AcceptDecision(
            accepted_rows=torch.tensor(rows, dtype=torch.int64),
            accepted_tokens=torch.tensor(tokens, dtype=torch.int64),
            frontier_token=frontier,
        )
