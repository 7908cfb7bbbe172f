"""The drafter engine: tree rows attend exactly to their context and ancestors."""

from __future__ import annotations

import pytest
import torch

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.drafting.model import DrafterConfig, init_drafter
from eyas.protocol.messages import Seed
from eyas.protocol.tree import PARENT_IS_ROOT
from eyas.target.config import eagle1_feature_address, eagle3_feature_address
from eyas.target.layers import GrowingKV


def make_seed(model, method, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = model.cfg.hidden_size * (1 if method == "eagle1" else 3)
    return Seed(torch.randn(n, width, generator=g), torch.randint(0, model.cfg.vocab_size, (n,), generator=g), 0, 0)


def reference_branch_probs(drafter, model, seed: Seed, branch: list[int]) -> torch.Tensor:
    """Plain causal drafter forward: context rows, then one row per branch token (state = previous
    output). Returns the draft distribution of the row that proposes the branch's last token."""
    n = seed.features.shape[0]
    state = drafter.target_state(seed.features)
    tokens = seed.advanced_tokens
    cache = GrowingKV(1)
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None]
    h = drafter(state[None], model.embed(tokens)[None], torch.arange(n)[None], cache, 0, causal)[0]
    last, start = h[-1], n
    for tok in branch[:-1]:  # each ancestor node becomes a draft row at the next position
        mask = torch.ones(1, 1, start + 1, dtype=torch.bool)
        last = drafter(
            last[None, None], model.embed(torch.tensor([[tok]])), torch.tensor([[start]]), cache, start, mask
        )[0, 0]
        start += 1
    return torch.softmax(drafter.logits(last, model.lm_head), dim=-1)


@pytest.mark.parametrize("method", ["eagle1", "eagle3"])
@pytest.mark.parametrize(
    "tree",
    [
        TreeSpec(expand_width=3, max_depth=4, verify_budget=10),
        TreeSpec(kind="static"),
        TreeSpec(kind="chain", max_depth=3),
    ],
)
@torch.inference_mode()
def test_tree_confidences_equal_per_branch_forwards(tiny_target, method, tree):
    """Every node's confidence equals its probability under a plain causal forward of its branch."""
    drafter = init_drafter(DrafterConfig.for_target(method, tiny_target.cfg), seed=3)
    with torch.no_grad():  # larger weights: peaked, informative draft distributions
        for p in drafter.parameters():
            p.mul_(10.0 if p.ndim == 2 else 1.0)
    engine = DrafterEngine(drafter, tiny_target.embed, tiny_target.lm_head)
    engine.open_session("r", 64)
    seed = make_seed(tiny_target, method)
    out = engine.propose("r", seed, tree)
    assert out.num_nodes == tree.max_candidates
    for i in range(out.num_nodes):
        branch, j = [], i
        while j != PARENT_IS_ROOT:
            branch.insert(0, int(out.tokens[j]))
            j = int(out.parents[j])
        probs = reference_branch_probs(drafter, tiny_target, seed, branch)
        draft_id = branch[-1] if method == "eagle1" else int((drafter.d2t == branch[-1]).nonzero())
        assert abs(float(probs[draft_id]) - float(out.draft_probs[i])) < 1e-5, (i, branch)


def test_publish_discards_tree_rows_and_reseeds(tiny_target):
    drafter = init_drafter(DrafterConfig.for_target("eagle1", tiny_target.cfg))
    engine = DrafterEngine(drafter, tiny_target.embed, tiny_target.lm_head)
    engine.open_session("r", 64)
    engine.propose("r", make_seed(tiny_target, "eagle1", n=5), TreeSpec())
    s = engine.sessions["r"]
    assert s.committed_len == 5 and s.provisional_len > 0
    with pytest.raises(ValueError, match="unpublished"):
        engine.propose("r", make_seed(tiny_target, "eagle1", n=2), TreeSpec())
    engine.publish("r")
    assert s.provisional_len == 0
    with pytest.raises(ValueError, match="start_position"):
        engine.propose("r", make_seed(tiny_target, "eagle1", n=2), TreeSpec())  # must start at 5
    nxt = Seed(torch.randn(2, tiny_target.cfg.hidden_size), torch.tensor([1, 2]), 5, 1)
    engine.propose("r", nxt, TreeSpec())
    assert s.committed_len == 7


def test_tree_spec_validation():
    with pytest.raises(ValueError, match="tree.kind"):
        TreeSpec(kind="bushy")
    with pytest.raises(ValueError, match="tree.expand_width"):
        TreeSpec(expand_width=0)
    with pytest.raises(ValueError, match="tree.verify_budget"):
        TreeSpec(verify_budget=-1)


def test_feature_address_widths(tiny_target):
    assert len(eagle1_feature_address(tiny_target.cfg)) == 1
    assert len(eagle3_feature_address(tiny_target.cfg)) == 3


def test_batched_drafting_equals_drafting_each_request_alone(tiny_target):
    """propose_batch over three requests with different contexts and tree kinds grows, for each one,
    the tree a lone propose grows (same nodes, confidences within float tolerance)."""
    from eyas.drafting.engine import DrafterEngine, TreeSpec
    from eyas.drafting.model import DrafterConfig, init_drafter
    from eyas.protocol.messages import Seed

    cfg = tiny_target.cfg
    drafter = init_drafter(DrafterConfig.for_target("eagle1", cfg), seed=5)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.mul_(20)  # peaked draft distributions, so trees are not ties
    alone, batched = (DrafterEngine(drafter, tiny_target.embed, tiny_target.lm_head) for _ in range(2))
    g = torch.Generator().manual_seed(0)
    specs = {
        "a": TreeSpec(expand_width=2, max_depth=3, verify_budget=6),
        "b": TreeSpec(kind="chain", max_depth=4),
        "c": TreeSpec(kind="static"),
    }
    seeds = {}
    for rid, n in (("a", 3), ("b", 7), ("c", 12)):
        seeds[rid] = Seed(
            torch.randn(n, cfg.hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (n,), generator=g), 0, 0
        )
        for e in (alone, batched):
            e.open_session(rid, 128)

    def assert_batched_equals_alone(round_seeds: dict[str, Seed]) -> None:
        singles = {rid: alone.propose(rid, round_seeds[rid], specs[rid]) for rid in round_seeds}
        together = dict(
            zip(round_seeds, batched.propose_batch([(rid, round_seeds[rid], specs[rid]) for rid in round_seeds]))
        )
        for rid in round_seeds:
            a, b = singles[rid], together[rid]
            assert a.num_nodes > 0 and torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
            torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-4, atol=1e-5)
            assert alone.sessions[rid].provisional_len == batched.sessions[rid].provisional_len

    assert_batched_equals_alone(seeds)
    # one store: closing "a" (KV row 0) moves the last row ("c") into its place with its K/V; the
    # next round of "b" and "c" still drafts what each does alone, and the store is freed at the end
    assert [batched.sessions[r].kv_row for r in "abc"] == [0, 1, 2]
    batched.close_session("a")
    assert batched.sessions["c"].kv_row == 0 and batched.sessions["b"].kv_row == 1
    nxt = {}
    for rid in ("b", "c"):
        for e in (alone, batched):
            e.publish(rid)
        n = batched.sessions[rid].committed_len
        nxt[rid] = Seed(
            torch.randn(2, cfg.hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (2,), generator=g), n, 1
        )
    assert_batched_equals_alone(nxt)
    for rid in ("b", "c"):
        batched.close_session(rid)
    assert batched.kv_slots_allocated() == 0 and batched.kv_bytes_allocated() == 0


def test_a_seed_or_tree_beyond_the_session_slots_is_refused_naming_the_field(tiny_target):
    drafter = init_drafter(DrafterConfig.for_target("eagle1", tiny_target.cfg))
    engine = DrafterEngine(drafter, tiny_target.embed, tiny_target.lm_head)
    engine.open_session("r", 8)
    with pytest.raises(
        ValueError,
        match="^seed: 0 committed \\+ 9 new context rows \\+ the tree's 0 draft rows "
        "exceed the draft session's 8 slots",
    ):
        engine.propose("r", make_seed(tiny_target, "eagle1", n=9), TreeSpec(kind="chain", max_depth=0))
    with pytest.raises(ValueError, match="^seed: 0 committed \\+ 6 new context rows \\+ the tree's 16 draft rows"):
        engine.propose("r", make_seed(tiny_target, "eagle1", n=6), TreeSpec())
    s = engine.sessions["r"]
    assert s.committed_len == 0 and s.provisional_len == 0  # refused before any write


def test_measure_cost_times_each_depth_and_leaves_no_session():
    """The start-up draft cost: a (depth, draft rows, ms) point per requested depth for one request,
    plus one for ``batch`` requests at the deepest; rows count per request its 2 seed rows and its
    tree's bound on provisional rows (width 2, depth 4 -> 2 + 2 x 3 = 8 per request). No wall-clock
    bound is asserted. The measuring sessions are closed: no draft KV stays allocated."""
    from tests.testing import ours_from_hf, tiny_eagle1_engine, tiny_hf

    model = ours_from_hf(tiny_hf("llama"))
    engine = tiny_eagle1_engine(model)
    points = engine.measure_cost(
        TreeSpec(expand_width=2, max_depth=4, verify_budget=6), depths=(1, 2, 4), repeats=2, prefix=8, batch=3
    )
    assert [(d, r) for d, r, _ in points] == [(1, 2), (2, 4), (4, 8), (4, 24)]
    assert all(ms > 0 for _, _, ms in points)
    assert engine.sessions == {} and engine.kv_slots_allocated() == 0
