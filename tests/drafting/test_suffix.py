"""Suffix drafts (eyas.drafting.suffix): the index, the continuation tree, grafting into a drafter's
tree, and exactness through the decode loop (alone and grafted; greedy and sampled)."""

from __future__ import annotations

import pytest
import torch

from eyas.drafting.suffix import (
    SharedSuffixCache,
    SuffixIndex,
    SuffixSpec,
    accepted_depth,
    expected_accepted,
    first_token_value,
    graft,
    suffix_tree,
)
from eyas.generate import generate
from eyas.protocol.schema import parse_request
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree
from eyas.target.engine import TargetEngine
from eyas.verification.sampling import target_probs
from tests.test_generate import P_THRESHOLD, PROMPT, SAMPLING, TREE, chi_square_p, engines, pair_counts


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    tokens, parents, out = tree.tokens.tolist(), tree.parents.tolist(), set()
    for i in range(tree.num_nodes):
        path, walk = [], i
        while walk != PARENT_IS_ROOT:
            path.insert(0, tokens[walk])
            walk = parents[walk]
        out.add(tuple(path))
    return out


def test_the_longest_earlier_suffix_gives_a_frequency_scored_continuation_tree():
    """History 1 2 3 4 5 9 | 1 2 3 4 6 7 | 1 2 3: the match "1 2 3" occurred twice, followed by
    4 5 9 ... and 4 6 7 ...: 4 has score 1, 5 and 6 one half each; values multiply along a path."""
    index = SuffixIndex(12)
    index.extend([1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 1, 2, 3])
    assert index.occurrences(SuffixSpec()) == [2, 8]
    assert index.entries == sum(min(12, end + 1) for end in range(15))  # one per n-gram end, n <= 12
    tree = suffix_tree(index, SuffixSpec(budget=6, min_value=0.0, max_depth=3, max_spec_factor=2.0))
    assert paths(tree) == {(4,), (4, 5), (4, 5, 9), (4, 6), (4, 6, 7)}
    probs = dict(zip(tree.tokens.tolist(), tree.draft_probs.tolist()))
    assert (probs[4], probs[5], probs[6], probs[9], probs[7]) == (1.0, 0.5, 0.5, 1.0, 1.0)
    # a value floor above 1/2 keeps only the certain first token
    assert paths(suffix_tree(index, SuffixSpec(min_value=0.6))) == {(4,)}
    # a history whose tail never occurred before drafts nothing
    fresh = SuffixIndex(12)
    fresh.extend([1, 2, 3, 4, 5])
    assert suffix_tree(fresh, SuffixSpec()).num_nodes == 0


def test_the_budget_keeps_the_highest_path_values_with_their_ancestors():
    """ "7 8" occurred three times, followed by 1 1 1, 2 2 6 and 1 1 9: 1 and 1-1 are worth 2/3, every
    other path 1/3 (ties go to the shallower node)."""
    index = SuffixIndex(8)
    index.extend([7, 8, 1, 1, 1, 5, 7, 8, 2, 2, 6, 7, 8, 1, 1, 9, 7, 8])
    assert index.occurrences(SuffixSpec()) == [1, 7, 12]
    tree = suffix_tree(index, SuffixSpec(budget=3, min_value=0.0, max_spec_factor=2.0))
    assert paths(tree) == {(1,), (1, 1), (2,)}
    assert paths(suffix_tree(index, SuffixSpec(budget=3, min_value=0.5, max_spec_factor=2.0))) == {(1,), (1, 1)}


def test_a_match_bounds_its_tree_by_its_length_measured_past_max_match():
    """A tree drawn from a match of n tokens holds at most max_spec_factor * n candidates and is at most
    that deep (SuffixDecoding's max_spec_factor): a 2-token match copies 2 tokens, a long one up to the
    budget; a match as long as ``max_match`` is measured on past it (here 4 tokens of index, 9 matched)."""
    span = list(range(100, 120))
    index = SuffixIndex(4)
    index.extend([1, 2] + span + [3] + [1, 2])  # "1 2" matches once: 2 tokens
    ends, length = index.match(SuffixSpec(max_match=4))
    assert ends == [1] and length == 2
    tree = suffix_tree(index, SuffixSpec(max_match=4, max_depth=16, budget=16, min_value=0.0))
    assert paths(tree) == {tuple(span[:1]), tuple(span[:2])}
    half = suffix_tree(index, SuffixSpec(max_match=4, max_depth=16, budget=16, min_value=0.0, max_spec_factor=0.5))
    assert paths(half) == {tuple(span[:1])}  # at least one candidate
    long = SuffixIndex(4)
    long.extend(span + [7] + span[:9])  # the last 9 tokens occurred before: 4 indexed, 9 measured
    ends, length = long.match(SuffixSpec(max_match=4, budget=16))
    assert ends == [8] and length == 9
    tree = suffix_tree(long, SuffixSpec(max_match=4, max_depth=16, budget=16, min_value=0.0))
    assert tree.num_nodes == 9 and paths(tree) >= {tuple(span[9:18])}
    capped = suffix_tree(long, SuffixSpec(max_match=4, max_depth=16, budget=6, min_value=0.0))
    assert capped.num_nodes == 6 and SuffixSpec(max_match=4, budget=6).match_reach == 6
    cache = SharedSuffixCache(100, SuffixSpec(min_match=2, max_match=4, budget=16))
    cache.add(span)
    assert cache.match(span[:9] + [5] + span[:9])[1] == 9
    assert cache.tree(span[:9], SuffixSpec(max_match=4, max_depth=16, budget=16, min_value=0.0)).num_nodes == 9
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(ValueError, match="^suffix.max_spec_factor: "):
            SuffixSpec(max_spec_factor=bad)


def test_graft_merges_shared_paths_and_appends_the_rest_in_one_tree():
    base = DraftTree(
        torch.tensor([4, 8, 5]), torch.tensor([-1, -1, 0]), torch.tensor([1, 1, 2]), torch.tensor([0.4, 0.2, 0.3])
    )
    extra = DraftTree(
        torch.tensor([4, 5, 6, 9]), torch.tensor([-1, 0, 1, 0]), torch.tensor([1, 2, 3, 2]), torch.ones(4)
    )
    merged = graft(base, extra)
    assert paths(merged) == paths(base) | paths(extra)
    assert merged.num_nodes == 5  # 4 and 4-5 shared
    assert merged.draft_probs[0] == 1.0  # the larger score of a shared node
    assert graft(base, DraftTree.empty()) is base


def with_suffix(tiny_target, method: str | None, prompt: list[int], shared: SharedSuffixCache | None = None):
    """40 greedy tokens with suffix drafts: alone (``method`` None) or grafted into ``method``'s tree;
    ``shared``: earlier answers they may copy from too."""
    target, drafter = engines(tiny_target, method or "eagle3")
    return generate(
        target if method else TargetEngine(tiny_target, ()),
        prompt,
        max_new_tokens=40,
        stop_ids=(),
        drafter=drafter if method else None,
        suffix=SuffixSpec(),
        shared_suffix=shared,
    )


@pytest.mark.parametrize("method", [None, "eagle1", "eagle3"])
def test_greedy_identity_with_suffix_drafts(tiny_target, method):
    """Suffix drafts alone (no drafter) and grafted into EAGLE trees: greedy output equals target-only,
    and on a repetitive prompt they take fewer target forwards than target-only."""
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4], [5, 6, 7, 5, 6, 7, 5, 6, 7]):
        base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=40, stop_ids=())
        spec = with_suffix(tiny_target, method, prompt)
        assert spec.token_ids == base.token_ids
        assert len(spec.rounds) < len(base.rounds)


def test_sampled_speculation_with_grafted_suffix_drafts_matches_the_target_joint(small_vocab_suffix):
    """1,500 draws of (x1, x2) through EAGLE trees with suffix drafts grafted: chi-square p > 1e-3."""
    model, target, drafter = small_vocab_suffix
    counts = pair_counts(
        target,
        PROMPT * 3,
        model.cfg.vocab_size,
        sampling=SAMPLING,
        drafter=drafter,
        tree=TREE,
        suffix=SuffixSpec(min_value=0.0),
    )
    assert chi_square_p(counts, joint(model, PROMPT * 3)) > P_THRESHOLD


def joint(model, prompt: list[int]) -> torch.Tensor:
    """P(x1, x2) of target-only sampling after ``prompt``, from plain forwards: [V, V]."""

    def last_probs(ids):
        cache = model.allocate_cache(1, len(ids))
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()[None]
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], cache, 0, mask, ()).logits[0, -1:]
        return target_probs(logits, SAMPLING)[0].double()

    p1 = last_probs(prompt)
    return torch.stack([p1[x] * last_probs(prompt + [x]) for x in range(model.cfg.vocab_size)])


@pytest.fixture(scope="module")
def small_vocab_suffix():
    from tests.testing import ours_from_hf, tiny_hf

    model = ours_from_hf(tiny_hf("llama", vocab=8, init_std=0.3, seed=5))
    target, drafter = engines(model, "eagle1", seed=1)
    return model, target, drafter


def test_suffix_is_a_method_and_a_flag_refused_where_it_means_nothing():
    assert parse_request(prompt="hi", method="suffix").method == "suffix"
    assert parse_request(prompt="hi", method="eagle3", suffix_drafts=True).suffix_drafts
    for method in ("target", "suffix"):
        with pytest.raises(ValueError, match="^suffix_drafts: "):
            parse_request(prompt="hi", method=method, suffix_drafts=True)


class RecordingInner:
    """The inner drafter side's protocol: records the seeds and trees asked for, drafts nothing."""

    def __init__(self):
        self.asked = {}

    def open_session(self, state):
        pass

    def close_session(self, request_id):
        pass

    def propose_batch(self, items):
        self.asked = {rid: (seeds, tree) for rid, seeds, tree in items}
        return [DraftTree.empty() for _ in items], 0.0, [3 for _ in items]

    def publish(self, request_ids):
        pass


def test_the_drafter_grows_no_tree_in_a_round_whose_suffix_span_is_likely():
    """Grafted, with a gate that skips the drafter where the suffix tree expects at least
    ``drafter_skip_value`` accepted tokens (the rule of a request's first round): that request does not
    call its drafter (its seeds wait, once each, and are read with the next round's when it drafts);
    another grows its own tree; a seed handed over again (after a failed drafter call) is not indexed
    twice."""
    from eyas.protocol.messages import Seed
    from eyas.scheduler.gate import DrafterGate
    from eyas.step import CONSUME_SEED_ONLY, DraftState, SuffixSide

    class ThresholdGate(DrafterGate):
        def should_draft(self, request_id, offer, context_rows=0, fresh_rows=None):
            return offer.expected < self.skip_value

    inner = RecordingInner()
    side = SuffixSide(inner, SuffixSpec(), gate=ThresholdGate())
    histories = {"copying": [5, 6, 7, 8] * 6, "fresh": list(range(10, 34))}
    seeds = {}
    for rid, tokens in histories.items():
        side.open_session(DraftState(request_id=rid, method="eagle3", suffix=True))
        seeds[rid] = Seed(torch.zeros(len(tokens), 0), torch.tensor(tokens), 0, 0)
    trees, _, versions = side.propose_batch([(rid, [seeds[rid]], TREE) for rid in histories])
    assert {rid: tree for rid, (_, tree) in inner.asked.items()} == {"fresh": TREE} and versions == [None, 3]
    assert paths(trees[0]) >= {(5,), (5, 6), (5, 6, 7)} and trees[1].num_nodes == 0
    side.propose_batch([(rid, [seeds[rid]], TREE) for rid in histories])  # the same seeds again
    assert side.indexes["copying"].tokens == histories["copying"] and side.pending["copying"] == [seeds["copying"]]
    # a plain round: the drafter reads the waiting seed and the new one together, in order
    more = Seed(torch.zeros(2, 0), torch.tensor([5, 6]), 24, 1)
    side.propose_batch([("copying", [more], CONSUME_SEED_ONLY)])
    assert inner.asked == {"copying": ([seeds["copying"], more], CONSUME_SEED_ONLY)} and not side.pending
    for rid in histories:
        side.close_session(rid)
    assert not side.indexes


def test_the_gate_drafts_where_a_drafter_round_pays_for_its_cost_and_tries_the_other_kind():
    """The drafter gate (eyas.scheduler.gate): its cost model recovers a round's parts from timed rounds
    and their timed drafter calls (base, drafting, a verify row, a backlog row); with a 5 ms base a drafter tree worth 0.7 tokens does
    not pay for its 2 ms and 4 rows, with a 35 ms base it does, unless the copied span alone is worth
    more; one kind runs at most EXPLORE_EVERY rounds in a row while the two are close, twice as many after
    each try that left the rule's choice as it was, and a drafter that has not read the request's context
    is not tried; a drafted tree's
    accepted depth is read along its own path."""
    from eyas.scheduler.gate import (
        DRAFTED,
        EXPLORE_EVERY,
        SKIPPED,
        DrafterGate,
        RoundWork,
        SuffixOffer,
        drafter_pays,
    )

    none, likely = SuffixOffer(), SuffixOffer(expected=2.0, first=0.9, nodes=4)
    assert not drafter_pays(none, 0.7, 0.009, 0.005) and drafter_pays(none, 0.7, 0.045, 0.035)
    assert not drafter_pays(likely, 0.7, 0.045, 0.035)  # the span's first token likely: the drafter adds little
    assert drafter_pays(SuffixOffer(expected=0.4, first=0.3, nodes=2), 0.7, 0.045, 0.035)
    for base, drafts in ((0.005, False), (0.035, True)):
        gate = DrafterGate()
        for i in range(60):
            suffix_nodes = i % 7
            context = 2 + i % 3 + (40 if i == 7 else 0)
            for work in (
                RoundWork(drafted=False, verify_rows=1 + suffix_nodes),
                # the drafter call timed by the loop; drafted rounds verify more rows: the two are fitted apart
                RoundWork(
                    drafted=True, verify_rows=5 + suffix_nodes, context_rows=context, draft_s=0.002 + 0.00005 * context
                ),
            ):
                gate.observe_round(work, base + 0.0005 * work.verify_rows + work.draft_s)
        assert gate.cost.coef == pytest.approx((base, 0.002, 0.0005, 0.00005), rel=1e-3, abs=1e-7)
        gate.gain_sums = [0.5, 1.0]  # the drafter adds half a token a round
        assert gate.should_draft("r", SuffixOffer(), 2) == drafts
        assert not gate.should_draft("r", SuffixOffer(expected=3.0, first=0.95, nodes=6), 2)
        assert gate.worth(SuffixOffer(), 200) < gate.worth(SuffixOffer(), 2)  # a long backlog costs
    gate = DrafterGate()
    gate.samples = {DRAFTED: 99, SKIPPED: 99}
    close, pays = (0.005, 0.002, 0.0005, 0.0), (0.005, 0.0001, 0.0005, 0.0)  # skipped 5.5 ms, drafted 9.5 / 7.6 ms
    gate.cost.coef = close  # close, skipped wins; a drafter that has not read the request's context is not tried
    assert not any(gate.should_draft("r") for _ in range(3 * EXPLORE_EVERY))
    gate.cost.coef = pays  # the rule drafts once (its drafter reads the context) ...
    assert gate.should_draft("r")
    gate.cost.coef = close  # ... then skips: each try that leaves its choice as it was doubles the run to the next
    runs = [gate.should_draft("r") for _ in range(7 * EXPLORE_EVERY + 3)]
    assert [i for i, drafted in enumerate(runs) if drafted] == [
        EXPLORE_EVERY,
        3 * EXPLORE_EVERY + 1,
        7 * EXPLORE_EVERY + 2,
    ]
    assert gate.stats()["rounds"] == {DRAFTED: 4, SKIPPED: 10 * EXPLORE_EVERY}
    gate.cost.coef = pays  # the rule changes its mind: it drafts ...
    assert all(gate.should_draft("r") for _ in range(EXPLORE_EVERY - 1))
    gate.cost.coef = close  # ... and skips again: the first try comes after EXPLORE_EVERY rounds again
    runs = [gate.should_draft("r") for _ in range(EXPLORE_EVERY + 1)]
    assert not any(runs[:-1]) and runs[-1]
    gate.forget("r")  # the request ends: a new one under its id has not read its context
    assert not any(gate.should_draft("r") for _ in range(2 * EXPLORE_EVERY))
    tree = DraftTree(
        torch.tensor([4, 8, 5, 6]), torch.tensor([-1, -1, 0, 2]), torch.tensor([1, 1, 2, 3]), torch.ones(4)
    )
    assert [accepted_depth(tree, a) for a in ([4, 5, 6, 1], [4, 6], [8], [], [9, 4])] == [3, 1, 1, 0, 0]
    offer = SuffixOffer(expected=expected_accepted(tree), first=first_token_value(tree), nodes=tree.num_nodes)
    assert (offer.expected, offer.first, offer.nodes) == (4.0, 1.0, 4)
    for accepted in (0, 2) * 10:  # verified: a quarter of its tokens, its first token half the time
        gate.observe_suffix(offer, accepted)
    for _ in range(300):  # drafted rounds: 2 tokens beyond the copied span where it left half a token's room
        gate.observe_drafted(3, 2, 0.5)
    assert gate.gain == pytest.approx(4.0, rel=0.01) and gate.drafter_nodes == pytest.approx(3.0)
    calibrated = gate.calibrated(offer)
    assert calibrated.expected == pytest.approx(1.0, rel=0.1) and calibrated.first == pytest.approx(0.5, rel=0.1)


def test_a_long_backlog_alone_does_not_keep_a_paying_drafter_from_drafting():
    """After skipped rounds a drafter reads their seeds once (its backlog) and its next drafted rounds their
    own seed only: the gate charges the backlog's extra rows over BACKLOG_ROUNDS rounds. A drafter that
    pays at its own seed (4 ms base, 0.5 ms drafting, 0.4 ms a verify row, 0.07 ms a read row, 0.8 tokens)
    drafts again after 40 backlog rows, which charged to one round would have kept it out for good."""
    from eyas.scheduler.gate import BACKLOG_ROUNDS, DRAFTED, SKIPPED, DrafterGate, SuffixOffer

    gate = DrafterGate()
    gate.samples = {DRAFTED: 99, SKIPPED: 99}
    gate.cost.coef = (0.004, 0.0005, 0.0004, 0.00007)
    gate.gain_sums, gate.drafter_nodes = [0.8, 1.0], 2.0
    assert gate.worth(SuffixOffer(), 2, 2) > 1.0  # steady: its own 2-row seed
    assert gate.worth(SuffixOffer(), 40) < 1.0 < gate.worth(SuffixOffer(), 40, 2)  # the backlog at once / spread
    assert gate.worth(SuffixOffer(), 2 + 38 * BACKLOG_ROUNDS, 2) < 1.0  # a backlog past the spread still costs
    assert gate.should_draft("r", SuffixOffer(), 40, 2)


def test_a_gated_hybrid_skips_its_drafter_where_rounds_say_so_and_stays_exact(tiny_target):
    """A gate whose cost model says the drafter pays a little less than it costs (its estimates held):
    the hybrid request skips it in most rounds (its seeds wait, read when it drafts next), tries it every
    EXPLORE_EVERY rounds (then twice as far) once its drafter has read the context, and its greedy output
    equals target-only's. Before its drafter has read the context (the rule never drafted it), or far
    from paying, it is never tried."""
    from eyas.scheduler.gate import DRAFTED, SKIPPED, DrafterGate, RoundCost

    class HeldGate(DrafterGate):  # the test's costs, not this machine's
        read = True  # the request's drafter counted as having read its context (as after a first drafted round)

        def should_draft(self, request_id, *args):
            if self.read:
                self.drafted_once.add(request_id)
            return super().should_draft(request_id, *args)

        def observe_round(self, work, seconds):
            pass

        def observe_drafted(self, nodes, added, room):
            pass

    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]
    base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=40, stop_ids=())
    for drafting_s, read, tried in ((0.0001, True, True), (0.0001, False, False), (0.01, True, False)):
        gate = HeldGate(
            cost=RoundCost(coef=(0.001, drafting_s, 0.0, 0.0)), samples={DRAFTED: 9, SKIPPED: 9}, gain_sums=[0.0, 1.0]
        )
        gate.read = read
        target, drafter = engines(tiny_target, "eagle3")
        out = generate(target, prompt, max_new_tokens=40, stop_ids=(), drafter=drafter, suffix=SuffixSpec(), gate=gate)
        assert out.token_ids == base.token_ids
        assert gate.decisions[SKIPPED] > gate.decisions[DRAFTED] and (gate.decisions[DRAFTED] > 0) == tried


def test_the_shared_cache_finds_the_longest_match_across_answers_and_evicts_the_oldest_first():
    """Answers kept oldest first: a lookup finds the longest suffix of the history the answers hold
    (from min_match up), the continuation tree scores what followed; past max_tokens the oldest answer
    goes, every index entry of it with it (none left pointing at it), and nothing else changes."""
    cache = SharedSuffixCache(40, SuffixSpec(min_match=2, max_match=6, max_spec_factor=2.0))
    cache.add([1, 2, 3, 4, 5, 6, 7])  # "3 4 5" then 6 7
    cache.add([9, 9, 4, 5, 8, 8])  # "4 5" then 8 8
    cache.add([0])  # too short to match anything: not kept
    assert [(a[e + 1 :]) for a, e in cache.occurrences([2, 3, 4, 5])] == [[6, 7]]  # "3 4 5" beats "4 5"
    assert [(a[e + 1 :]) for a, e in cache.occurrences([7, 4, 5])] == [[6, 7], [8, 8]]  # "4 5" in both
    assert paths(cache.tree([7, 4, 5])) == {(6,), (6, 7), (8,), (8, 8)}
    assert cache.occurrences([5, 1]) == [] and cache.stats()["answers"] == 2
    for i in range(10):
        cache.add([100 + i] * 3 + [200 + i] * 2)
    stats = cache.stats()
    assert stats["tokens"] <= 40 and stats["answers"] == 8 and stats["max_tokens"] == 40
    assert cache.occurrences([3, 4, 5]) == []  # the first two answers are gone
    alive = set(cache.answers)
    entries = [aid for ends in cache.ends.values() for aid, _ in ends]
    assert set(entries) <= alive and len(entries) == stats["index_entries"] == stats["tokens"] - 8
    with pytest.raises(ValueError, match="^suffix.shared_tokens: "):
        SharedSuffixCache(0)


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_a_request_copies_an_earlier_answer_from_the_shared_cache_and_stays_exact(tiny_target, method):
    """With the target's own earlier answer in the shared cache, a suffix request (alone or grafted)
    drafts it back: greedy output equals target-only's, in far fewer rounds than without the cache."""
    prompt = [11, 4, 29, 7, 3, 18]
    base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=40, stop_ids=())
    cache = SharedSuffixCache()
    cache.add(base.token_ids)
    runs = {shared is not None: with_suffix(tiny_target, method, prompt, shared) for shared in (None, cache)}
    assert runs[True].token_ids == runs[False].token_ids == base.token_ids
    assert len(runs[True].rounds) * 2 <= len(runs[False].rounds)


def test_suffix_candidates_never_add_more_rows_than_the_round_plans():
    """Load awareness: a suffix-alone request's tree holds at most the candidate rows its planned tree
    may verify (a loaded loop's scheduler plans fewer, none in a plain round), however many its
    history offers; a copied span still runs as deep as the spec allows."""
    from eyas.drafting.engine import TreeSpec
    from eyas.protocol.messages import Seed
    from eyas.step import CONSUME_SEED_ONLY, DraftState, SuffixSide, suffix_tree_spec

    spec = SuffixSpec(budget=6, max_depth=8)
    history = [5, 6, 7, 8, 9, 10, 11, 12, 13] * 3 + [5, 6]
    sizes = {}
    for name, tree in (
        ("full", suffix_tree_spec(spec)),
        ("two", TreeSpec(kind="dynamic", expand_width=1, max_depth=2, verify_budget=2)),
        ("plain", CONSUME_SEED_ONLY),
    ):
        side = SuffixSide(None, spec)
        side.open_session(DraftState(request_id="r", method="suffix"))
        (drafted,), _, versions = side.propose_batch(
            [("r", [Seed(torch.zeros(len(history), 0), torch.tensor(history), 0, 0)], tree)]
        )
        sizes[name] = (drafted.num_nodes, int(drafted.depths.max()) if drafted.num_nodes else 0)
        assert versions == [None]  # a suffix-alone request: no drafter drafted it
    assert sizes["full"] == (6, 6) and sizes["two"] == (2, 2) and sizes["plain"] == (0, 0)
