"""The cost model, the latency curve and the two policies (pure; worked examples in docstrings)."""

from __future__ import annotations

import pytest

from eyas.scheduler.cost import PLAIN, ExpertTraffic, TreeShape, batch_work, round_work
from eyas.scheduler.latency import DraftCost, LatencyCurve, measure_curve
from eyas.scheduler.policy import AcceptanceEstimate, Budgets, Candidate, PromptLengthPolicy, TreeWorkPolicy

FLAT = LatencyCurve.from_points({1: 50.0, 16: 55.0, 64: 70.0, 128: 120.0})  # rows nearly free (GPU-like)
STEEP = LatencyCurve.from_points({1: 50.0, 2: 100.0, 16: 700.0, 64: 2000.0})  # each row costs a forward


def cand(rid, arrival=0.0, prompt=10, committed=10, rates=None):
    est = AcceptanceEstimate() if rates is None else AcceptanceEstimate(list(rates) + [0.0] * (8 - len(rates)))
    return Candidate(rid, arrival, prompt, committed, est)


def test_round_work_counts_rows_nodes_and_bytes():
    """Worked example: width 4, depth 5, budget 16 at 100 committed tokens, 10 B per target KV row and
    2 B per draft KV row -> 17 verify rows, 16 nodes, 4*4 = 16 draft rows; committed 1000 B,
    provisional 170 B, draft (100 + 16) * 2 = 232 B."""
    w = round_work("a", TreeShape(4, 5, 16), committed_len=100, target_kv_bytes_per_row=10, draft_kv_bytes_per_row=2)
    assert (w.verify_rows, w.tree_nodes, w.draft_rows) == (17, 16, 16)
    assert (w.committed_kv_bytes, w.provisional_kv_bytes, w.draft_kv_bytes, w.kv_bytes) == (1000, 170, 232, 1402)
    plain = round_work("b", PLAIN, committed_len=100, target_kv_bytes_per_row=10, draft_kv_bytes_per_row=2)
    assert (plain.verify_rows, plain.tree_nodes, plain.draft_rows, plain.draft_kv_bytes) == (1, 0, 0, 0)
    total = batch_work([w, plain])
    assert (total.requests, total.verify_rows, total.kv_bytes) == (2, 18, 1402 + 1010)
    with pytest.raises(ValueError, match="^tree.verify_budget: "):
        TreeShape(4, 5, -1)


def test_latency_curve_interpolates_extrapolates_and_learns():
    c = LatencyCurve.from_points({1: 10.0, 3: 30.0, 5: 34.0})
    assert c.predict(2) == 20.0 and c.predict(4) == 32.0 and c.predict(7) == 38.0 and c.predict(1) == 10.0
    for _ in range(60):
        c.observe(3, 60.0)  # the machine got slower at 3 rows
    assert abs(c.predict(3) - 60.0) < 0.1
    c.observe(2, 100.0, weight=1.0)  # halfway between knots 1 and 3: each knot takes half the error
    assert c.ms[0] > 10.0 and c.ms[1] > 60.0
    with pytest.raises(ValueError, match="^latency_curve.rows: "):
        LatencyCurve([2, 1], [1.0, 2.0])
    # plain rounds only (1 row), the machine faster than at start-up: the whole curve comes down with the
    # 1-row knot, so a tree's marginal cost is read off the start-up shape, not off a stale level
    c = LatencyCurve.from_points({1: 6.0, 4: 7.0, 8: 10.0})
    for _ in range(100):
        c.observe(1, 3.5)
    assert abs(c.predict(1) - 3.5) < 0.05 and 3.5 < c.predict(4) < 5.0 and c.predict(8) < 8.0
    calls = []
    m = measure_curve(lambda r: calls.append(r), rows=(1, 4), repeats=3, warmup=1)
    assert m.rows == [1, 4] and calls == [1] * 4 + [4] * 4


def test_acceptance_estimate_expected_tokens():
    """rates (0.8, 0.5, 0.25): E[depth 1] = 0.8; E[depth 3] = 0.8 + 0.4 + 0.1 = 1.3."""
    e = AcceptanceEstimate([0.8, 0.5, 0.25] + [0.0] * 5)
    assert e.expected(1) == pytest.approx(0.8) and e.expected(3) == pytest.approx(1.3) and e.expected(0) == 0
    for _ in range(50):
        e.observe(accept_length=0, depth_cap=3)  # never accepted: rate 1 -> 0, deeper rates untouched
    assert e.rates[0] < 0.01 and e.rates[1] == 0.5


def test_the_policy_turns_speculation_off_when_verify_rows_are_expensive():
    reqs = [cand(f"r{i}", i) for i in range(4)]
    steep = TreeWorkPolicy().plan(reqs, STEEP)
    assert set(steep.shapes) == {"r0", "r1", "r2", "r3"} and all(s == PLAIN for s in steep.shapes.values())
    flat = TreeWorkPolicy().plan(reqs, FLAT)
    assert all(s.speculates for s in flat.shapes.values())
    assert flat.tokens_per_s > steep.tokens_per_s


def test_the_policy_shrinks_speculation_for_a_request_whose_drafts_are_rejected():
    good, bad = cand("good", 0, rates=[0.9] * 8), cand("bad", 1, rates=[0.02] * 8)
    plan = TreeWorkPolicy().plan([good, bad], FLAT)
    assert plan.shapes["good"].verify_budget >= 10 and plan.shapes["bad"] == PLAIN


def test_deep_trees_when_the_batch_is_small_and_small_trees_when_it_is_large():
    curve = LatencyCurve.from_points({1: 50.0, 16: 60.0, 32: 80.0, 128: 400.0})
    alone = TreeWorkPolicy().plan([cand("a", rates=[0.7] * 8)], curve)
    crowd = TreeWorkPolicy(Budgets(max_batch=16)).plan([cand(f"c{i}", i, rates=[0.7] * 8) for i in range(16)], curve)
    mean_crowd = sum(s.verify_rows for s in crowd.shapes.values()) / 16
    assert alone.shapes["a"].verify_rows > mean_crowd


def test_budgets_bound_the_batch_and_admission_is_oldest_first():
    reqs = [cand(f"r{i}", arrival=10 - i, committed=100) for i in range(6)]
    plan = TreeWorkPolicy(Budgets(max_batch=3, max_verify_rows=20)).plan(reqs, FLAT)
    assert set(plan.shapes) == {"r5", "r4", "r3"} and plan.verify_rows <= 20
    kv = TreeWorkPolicy(Budgets(max_kv_bytes=2_500, target_kv_bytes_per_row=10)).plan(reqs, FLAT)
    assert len(kv.shapes) == 2 and sum(w.kv_bytes for w in kv.work) <= 2_500  # 101 rows * 10 B each, plus trees


# an MoE target with 64 experts, top-2, in one layer, 1 byte an expert: predict(rows) = 64 (1 - (62/64)^rows)
# rounded: 2 B for one row, 8 B for 4, 14 B for 8, 25 B for 16, 48 B for 44
WIDE_MOE = ExpertTraffic(moe_layers=1, num_experts=64, experts_per_token=2, bytes_per_expert=1)


def test_an_expert_bytes_budget_keeps_an_moe_verify_small():
    """Seed 0x09A: rows route to a growing union of experts. Unbudgeted, a well-accepted request gets
    a big tree on a flat curve; with at most 14 B of experts (8 rows' worth) its tree stays within 8 rows.
    Each request's own figure is the bytes its rows alone would read."""
    good = cand("good", rates=[0.9] * 8)
    free = TreeWorkPolicy().plan([good], FLAT, experts=WIDE_MOE)
    assert free.verify_rows > 8 and free.expert_bytes == WIDE_MOE.predict(free.verify_rows)
    capped = TreeWorkPolicy(Budgets(max_expert_bytes=WIDE_MOE.predict(8))).plan([good], FLAT, experts=WIDE_MOE)
    assert capped.shapes["good"].speculates and capped.verify_rows <= 8
    assert capped.expert_bytes <= WIDE_MOE.predict(8) == 14
    assert capped.work[0].expert_bytes == WIDE_MOE.predict(capped.verify_rows)
    assert TreeWorkPolicy().plan([good], FLAT).expert_bytes == 0  # a dense target reads no experts


def test_an_expert_bytes_budget_bounds_admission_oldest_first_and_never_starves_the_oldest():
    reqs = [cand(f"r{i}", arrival=10 - i) for i in range(5)]
    plan = TreeWorkPolicy(Budgets(max_expert_bytes=WIDE_MOE.predict(3))).plan(reqs, STEEP, experts=WIDE_MOE)
    assert set(plan.shapes) == {"r4", "r3", "r2"} and plan.verify_rows == 3
    tiny = TreeWorkPolicy(Budgets(max_expert_bytes=1)).plan(reqs, FLAT, experts=WIDE_MOE)  # below one row's 2 B
    assert set(tiny.shapes) == {"r4"} and tiny.shapes["r4"] == PLAIN


def test_the_prompt_length_baseline_batches_similar_prompts_with_one_fixed_tree():
    reqs = [
        cand("short1", 0, prompt=10),
        cand("long", 1, prompt=900),
        cand("short2", 2, prompt=12),
        cand("mid", 3, prompt=300),
    ]
    plan = PromptLengthPolicy(Budgets(max_batch=2)).plan(reqs, STEEP)
    assert set(plan.shapes) == {"short1", "short2"}
    assert all(s == TreeShape(4, 5, 16) for s in plan.shapes.values())  # fixed, even on a steep curve


def test_the_prompt_length_baseline_counts_a_target_only_request_as_one_row():
    """Worked example: max_verify_rows 40, the fixed tree 17 rows: 2 speculative requests (34 rows)
    fit with 6 target-only ones (1 row each, 40 in all), and max_batch 8 is reached. Counting the
    tree for the target-only ones too would have stopped the batch at 2."""
    spec = [cand(f"s{i}", i) for i in range(3)]
    plain = [Candidate(f"t{i}", 10 + i, 10, 10, AcceptanceEstimate(), speculative=False) for i in range(8)]
    plan = PromptLengthPolicy(Budgets(max_batch=8, max_verify_rows=40)).plan(spec + plain, FLAT)
    assert len(plan.shapes) == 8 and plan.verify_rows == 40
    assert {rid for rid, s in plan.shapes.items() if s == TreeShape(4, 5, 16)} == {"s0", "s1"}
    assert sum(s == PLAIN for s in plan.shapes.values()) == 6


def test_draft_cost_fits_base_and_per_depth():
    """Worked example: rounds at depth 2 costing 30 ms and at depth 4 costing 50 ms fit base 10 ms and
    10 ms per depth, so depth 5 is predicted at 60 ms; a round where nobody drafts costs 0. With one
    depth seen only, the whole cost goes per depth (40 ms at depth 4 -> 10 ms per depth)."""
    d = DraftCost(prior_ms_per_depth=7.0)
    assert d.predict(3) == 21.0 and d.predict(0) == 0.0
    d.observe(2, 30.0)
    d.observe(4, 50.0)
    assert d.base_ms == pytest.approx(10.0) and d.per_depth_ms == pytest.approx(10.0)
    assert d.predict(5) == pytest.approx(60.0) and d.predict(0) == 0.0
    one = DraftCost()
    one.observe(4, 40.0)
    assert one.base_ms == 0.0 and one.per_depth_ms == pytest.approx(10.0)
    with pytest.raises(ValueError, match="^draft_cost.prior_ms_per_depth: "):
        DraftCost(prior_ms_per_depth=-1.0)


def test_draft_cost_from_start_up_points():
    """Start-up points (depth, draft rows, ms): [(1, 0, 20), (3, 8, 44), (5, 16, 68), (5, 64, 92)].
    At depth 5, 48 more rows cost 24 ms more -> per_row_ms = 0.5. Without the rows' part the points
    are 20, 40, 60, 60 ms at depths 1, 3, 5, 5 -> base 10 ms + 10 ms per depth. So a depth-4 round of
    one request (12 rows) is predicted at 10 + 40 + 6 = 56 ms, and the same depth for 4 requests
    (48 rows) at 74 ms. A live round joins the same fit. A point that is not a measurement is
    refused, naming the field."""
    d = DraftCost.from_points([(1, 0, 20.0), (3, 8, 44.0), (5, 16, 68.0), (5, 64, 92.0)])
    assert d.per_row_ms == pytest.approx(0.5)
    assert d.base_ms == pytest.approx(10.0) and d.per_depth_ms == pytest.approx(10.0)
    assert d.predict(4, 12) == pytest.approx(56.0) and d.predict(4, 48) == pytest.approx(74.0)
    assert d.predict(0, 48) == 0.0 and len(d.history) == 4
    d.observe(3, 44.0, 8)
    assert d.predict(4, 12) == pytest.approx(56.0) and len(d.history) == 5
    flat = DraftCost.from_points([(1, 0, 20.0), (3, 8, 40.0)])  # no depth at two row counts
    assert flat.per_row_ms == 0.0 and flat.predict(5, 100) == pytest.approx(60.0)
    for bad in ([(0, 0, 5.0)], [(2, 0, -1.0)], [(2.5, 0, 3.0)], [(2, -1, 3.0)]):
        with pytest.raises(ValueError, match="^draft_cost.points: "):
            DraftCost.from_points(bad)


def test_many_drafting_requests_cost_more_than_one_so_a_big_batch_may_stay_plain():
    """The same acceptance (0.7 per depth) and a flat curve (50 ms for 1 row, 52 ms for 256).
    One request, drafting at 10 ms per depth + 5 ms per draft row: it drafts. Sixteen requests with
    draft rows free: all sixteen draft. The same sixteen at 50 ms per draft row: no request gets a
    tree that writes draft rows (depth > 1 writes width x (depth - 1) rows for each request), so the
    per-row part of drafting, paid by every request, is what holds the batch back."""
    curve = LatencyCurve.from_points({1: 50.0, 256: 52.0})
    one = [cand("solo", rates=[0.7] * 8)]
    many = [cand(f"r{i}", i, rates=[0.7] * 8) for i in range(16)]
    cheap = DraftCost(prior_ms_per_depth=10.0, per_row_ms=5.0)
    assert any(s.speculates for s in TreeWorkPolicy().plan(one, curve, cheap).shapes.values())
    costly_rows = DraftCost(prior_ms_per_depth=10.0, per_row_ms=50.0)
    free_rows = DraftCost(prior_ms_per_depth=10.0)
    assert all(s.speculates for s in TreeWorkPolicy().plan(many, curve, free_rows).shapes.values())
    plan = TreeWorkPolicy().plan(many, curve, costly_rows)
    assert all(s.draft_rows == 0 for s in plan.shapes.values())


def test_the_policy_turns_speculation_off_when_drafting_is_expensive():
    """Rows are nearly free (FLAT) and acceptance is good, but a drafter forward costs 200 ms per depth:
    a depth-1 tree (1.7 tokens) costs 55 + 200 ms against 50 ms for one plain token -> plain wins;
    the same requests with free drafting speculate."""
    reqs = [cand(f"r{i}", i, rates=[0.7] * 8) for i in range(4)]
    costly = DraftCost(prior_ms_per_depth=200.0)
    plan = TreeWorkPolicy().plan(reqs, FLAT, costly)
    assert all(not s.speculates for s in plan.shapes.values())
    assert plan.predicted_ms == pytest.approx(FLAT.predict(4))
    free = TreeWorkPolicy().plan(reqs, FLAT, DraftCost())
    assert all(s.speculates for s in free.shapes.values())


def test_the_policy_raises_the_whole_batch_when_only_all_together_pay():
    """8 requests, a flat 100 ms verify, drafting 40 ms per depth, each request accepting depth 1 with
    probability 0.5. Worked example: plain J = 8 / 100 = 0.080 tokens/ms. One request alone on a
    depth-1 tree: 8.5 / 140 = 0.061 (worse, so one-request moves never start). All eight on depth 1:
    12 / 140 = 0.086 (better): the policy must take the all-at-once move."""
    flat = LatencyCurve.from_points({1: 100.0, 128: 100.0})
    reqs = [cand(f"r{i}", i, rates=[0.5]) for i in range(8)]
    plan = TreeWorkPolicy(shapes=(PLAIN, TreeShape(1, 1, 1))).plan(reqs, flat, DraftCost(prior_ms_per_depth=40.0))
    assert all(s == TreeShape(1, 1, 1) for s in plan.shapes.values())
    assert plan.expected_tokens == pytest.approx(12.0) and plan.predicted_ms == pytest.approx(140.0)


def test_a_request_whose_drafter_has_not_read_its_prompt_pays_for_those_rows():
    """The drafter must read a request's unread context rows (its prompt, in its first drafting round)
    before it drafts: ``draft_backlog`` rows at ``per_row_ms`` each. Flat curve (50 ms / 52 ms),
    0.7 acceptance, drafting at 10 ms per depth + 0.5 ms per row: with no backlog the request drafts;
    with a 400-row backlog drafting would add 200 ms to a 50 ms round, so it stays plain."""
    curve = LatencyCurve.from_points({1: 50.0, 256: 52.0})
    cost = DraftCost(prior_ms_per_depth=10.0, per_row_ms=0.5)
    fresh = Candidate("a", 0.0, 400, 400, AcceptanceEstimate([0.7] * 8), draft_backlog=400)
    caught_up = Candidate("a", 0.0, 400, 400, AcceptanceEstimate([0.7] * 8), draft_backlog=2)
    assert not TreeWorkPolicy().plan([fresh], curve, cost).shapes["a"].speculates
    assert TreeWorkPolicy().plan([caught_up], curve, cost).shapes["a"].speculates
