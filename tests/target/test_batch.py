"""Batched ragged verification: several requests' trees in one forward equal each verified alone."""

from __future__ import annotations

import pytest
import torch

from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree
from eyas.target.config import eagle1_feature_address
from eyas.target.engine import TargetEngine
from eyas.verification.accept import greedy_accept
from tests.testing import branch_tokens

PROMPTS = {"a": [1, 2, 3], "b": [7, 7, 7, 7, 7, 9, 30, 11], "c": [5, 4, 3, 2, 1, 9, 8, 7, 6, 5, 4, 3]}


def tree(tokens, parents, depths) -> DraftTree:
    n = len(tokens)
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.full((n,), 0.5))


TREES = {  # different sizes and shapes per request
    "a": tree([4, 9, 6, 2], [PARENT_IS_ROOT, 0, PARENT_IS_ROOT, 1], [1, 2, 1, 3]),
    "b": DraftTree.empty(),
    "c": tree([11, 12, 13, 14, 15, 16], [PARENT_IS_ROOT, 0, 1, PARENT_IS_ROOT, 3, 0], [1, 2, 3, 1, 2, 2]),
}


def started(model, rounds_before=None) -> TargetEngine:
    """An engine with the three sessions prefilled and published, then advanced ``rounds_before[rid]``
    plain rounds, so that the committed lengths (the prefixes) differ."""
    e = TargetEngine(model, eagle1_feature_address(model.cfg))
    for rid, prompt in PROMPTS.items():
        e.open_session(rid, prompt, 30, 8)
        v = e.prefill(rid)
        rows = torch.arange(len(prompt))
        from eyas.protocol.messages import AcceptDecision

        e.publish(rid, v.round, AcceptDecision(rows, torch.tensor(prompt[1:]), int(v.logits[-1].argmax())))
        for _ in range((rounds_before or {}).get(rid, 0)):
            v = e.verify(rid, DraftTree.empty())
            e.publish(rid, v.round, greedy_accept(v.flat, v.logits))
    return e


def test_batch_equals_single_in_logits_acceptance_and_committed_kv(tiny_target):
    before = {"a": 3, "b": 0, "c": 1}
    alone, batched = started(tiny_target, before), started(tiny_target, before)
    singles = {rid: alone.verify(rid, TREES[rid]) for rid in PROMPTS}
    together = dict(zip(PROMPTS, batched.verify_batch([(rid, TREES[rid]) for rid in PROMPTS])))
    for rid in PROMPTS:
        s, b = singles[rid], together[rid]
        assert torch.equal(s.flat.tokens, b.flat.tokens)
        torch.testing.assert_close(b.logits, s.logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.features, s.features, rtol=1e-4, atol=1e-4)
        ds, db = greedy_accept(s.flat, s.logits), greedy_accept(b.flat, b.logits)
        assert torch.equal(ds.accepted_rows, db.accepted_rows) and ds.frontier_token == db.frontier_token
        alone.publish(rid, s.round, ds)
        batched.publish(rid, b.round, db)
        ta, tb = alone.sessions[rid], batched.sessions[rid]
        n = ta.committed_len
        assert n == tb.committed_len and ta.tokens == tb.tokens
        (kb, vb), (ka, va) = batched.committed_kv(rid), alone.committed_kv(rid)
        assert kb.shape[2] == n
        torch.testing.assert_close(kb, ka, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(vb, va, rtol=1e-4, atol=1e-5)


def test_each_requests_tree_rows_equal_its_own_per_branch_causal_forward(tiny_target, tiny_pair):
    """Ragged tree attention with prefixes > 0 and batch 3: row r of request q equals HF's causal
    forward over q's committed tokens + the root + r's ancestors + r."""
    hf, _ = tiny_pair
    e = started(tiny_target, {"a": 2, "c": 1})
    out = dict(zip(PROMPTS, e.verify_batch([(rid, TREES[rid]) for rid in PROMPTS])))
    for rid, v in out.items():
        committed = e.sessions[rid].tokens
        for row in range(v.flat.num_rows):
            with torch.no_grad():
                ref = hf(torch.tensor([committed + branch_tokens(v.flat, row)])).logits[0, -1]
            torch.testing.assert_close(v.logits[row], ref, rtol=1e-4, atol=1e-4)


def test_a_request_that_fails_validation_mid_batch_leaves_the_others_unchanged(tiny_target):
    alone, batched = started(tiny_target), started(tiny_target)
    batched.verify("b", DraftTree.empty())  # b has an unpublished round: its next verify must fail
    state_b = (batched.sessions["b"].committed_len, list(batched.sessions["b"].tokens), batched.sessions["b"].round)
    huge = tree(list(range(1, 46)), list(range(-1, 44)), list(range(1, 46)))  # 46 rows > the 39 KV slots c has left
    res = batched.verify_batch([("a", TREES["a"]), ("b", TREES["b"]), ("c", huge)])
    assert isinstance(res[1], ValueError) and str(res[1]).startswith("round: ")
    assert isinstance(res[2], ValueError) and str(res[2]).startswith("rows: ")
    torch.testing.assert_close(res[0].logits, alone.verify("a", TREES["a"]).logits, rtol=1e-4, atol=1e-4)
    s = batched.sessions["b"]
    assert (s.committed_len, s.tokens, s.round) == state_b and batched.sessions["c"].pending is None
    with pytest.raises(ValueError, match="^request_id: "):
        batched.verify_batch([("a", TREES["a"]), ("a", TREES["a"])])


def test_batched_prefill_equals_each_prompt_prefilled_alone(tiny_target, tiny_pair):
    """Three prompts of 3, 8 and 12 tokens in one packed forward: each last-row logit row equals its
    own prefill's and HF's causal forward; features and the KV each publish commits are the same."""
    hf, _ = tiny_pair
    taps = eagle1_feature_address(tiny_target.cfg)
    alone, batched = TargetEngine(tiny_target, taps), TargetEngine(tiny_target, taps)
    for e in (alone, batched):
        for rid, prompt in PROMPTS.items():
            e.open_session(rid, prompt, 30, 8)
    together = dict(zip(PROMPTS, batched.prefill_batch(list(PROMPTS))))
    from eyas.protocol.messages import AcceptDecision

    for rid, prompt in PROMPTS.items():
        s, b = alone.prefill(rid), together[rid]
        assert b.logits.shape == s.logits.shape == (1, tiny_target.cfg.vocab_size) and b.flat is None
        torch.testing.assert_close(b.logits, s.logits, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            torch.testing.assert_close(b.logits[0], hf(torch.tensor([prompt])).logits[0, -1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b.features, s.features, rtol=1e-5, atol=1e-5)
        frontier = int(s.logits[-1].argmax())
        assert frontier == int(b.logits[-1].argmax())
        rows = torch.arange(len(prompt))
        for e, v in ((alone, s), (batched, b)):
            e.publish(rid, v.round, AcceptDecision(rows, torch.tensor(prompt[1:]), frontier))
        n = len(prompt)
        assert batched.committed_kv(rid)[0].shape[2] == n
        torch.testing.assert_close(batched.committed_kv(rid)[0], alone.committed_kv(rid)[0], rtol=1e-5, atol=1e-5)


def test_a_batched_prefill_refuses_a_bad_member_and_prefills_the_others(tiny_target):
    e = TargetEngine(tiny_target, ())
    for rid in ("a", "c"):
        e.open_session(rid, PROMPTS[rid], 8, 8)
    e.prefill("c")  # c is already prefilled
    res = e.prefill_batch(["a", "ghost", "c"])
    assert isinstance(res[1], ValueError) and str(res[1]).startswith("request_id: 'ghost'")
    assert isinstance(res[2], ValueError) and "already prefilled" in str(res[2])
    assert res[0].round == e.sessions["a"].pending.round and e.sessions["a"].pending is res[0]
    with pytest.raises(ValueError, match="^request_id: "):
        e.prefill_batch(["a", "a"])


@pytest.mark.parametrize("chunk", [1, 5, 7])
def test_a_prompt_prefilled_in_chunks_equals_it_prefilled_whole_while_others_verify(tiny_target, tiny_pair, chunk):
    """Chunked prefill: a 30-token prompt prefilled ``chunk`` rows a round, in the same forwards as
    two other requests' verifies, ends with the logits, features and committed KV of a whole-prompt
    prefill (and HF's causal forward); until its last chunk it gets PrefillProgress, nothing is
    committed and it cannot verify; the other requests' rounds equal their rounds alone."""
    from eyas.protocol.messages import AcceptDecision
    from eyas.target.engine import PrefillProgress

    hf, _ = tiny_pair
    taps = eagle1_feature_address(tiny_target.cfg)
    long = [(5 * i + 3) % 60 + 1 for i in range(30)]
    whole, chunked = TargetEngine(tiny_target, taps), started(tiny_target, {"a": 2, "c": 1})
    alone = started(tiny_target, {"a": 2, "c": 1})
    whole.open_session("long", long, 8, 8)
    chunked.open_session("long", long, 8, 8)
    reference = whole.prefill("long")
    steps = 0
    while True:
        pre, ver = chunked.step(["long"], [("a", TREES["a"]), ("c", TREES["c"])], max_prefill_rows=chunk)
        for rid, v in zip(("a", "c"), ver):
            mine = alone.verify(rid, TREES[rid])
            torch.testing.assert_close(v.logits, mine.logits, rtol=1e-4, atol=1e-4)
            for e, x in ((chunked, v), (alone, mine)):
                e.publish(rid, x.round, greedy_accept(x.flat, x.logits))
        steps += 1
        if not isinstance(pre[0], PrefillProgress):
            break
        assert pre[0].prefilled == min(steps * chunk, 30) and chunked.sessions["long"].committed_len == 0
        with pytest.raises(ValueError, match="^request_id: 'long' has no frontier token"):
            chunked.verify("long", DraftTree.empty())
    assert steps == -(-30 // chunk)
    v = pre[0]
    torch.testing.assert_close(v.logits, reference.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v.features, reference.features, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(v.logits[0], hf(torch.tensor([long])).logits[0, -1], rtol=1e-4, atol=1e-4)
    frontier = int(reference.logits[-1].argmax())
    for e, x in ((whole, reference), (chunked, v)):
        e.publish("long", x.round, AcceptDecision(torch.arange(30), torch.tensor(long[1:]), frontier))
    torch.testing.assert_close(chunked.committed_kv("long")[0], whole.committed_kv("long")[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.committed_kv("long")[1], whole.committed_kv("long")[1], rtol=1e-5, atol=1e-5)


def test_closing_a_request_moves_the_last_kv_row_into_its_place_and_the_store_is_freed_when_empty(tiny_target):
    """The store keeps live requests in rows [0, live): closing one moves the last row (values and
    all) into the hole; the moved request's committed KV and next verify are unchanged."""
    e = started(tiny_target, {"a": 2, "b": 0, "c": 1})
    rows = {rid: e.sessions[rid].kv_row for rid in PROMPTS}
    assert sorted(rows.values()) == [0, 1, 2]
    last = max(rows, key=rows.get)
    first = min(rows, key=rows.get)
    kv_before = [t.clone() for t in e.committed_kv(last)]
    before = e.verify(last, TREES[last])
    e.sessions[last].pending = None
    e.close_session(first)
    assert e.sessions[last].kv_row == rows[first]
    assert all(torch.equal(a, b) for a, b in zip(kv_before, e.committed_kv(last)))
    torch.testing.assert_close(e.verify(last, TREES[last]).logits, before.logits, rtol=1e-5, atol=1e-5)
    assert e.kv_bytes_allocated() > 0
    for rid in list(e.sessions):
        e.close_session(rid)
    assert e.kv_bytes_allocated() == 0 and e.kv_slots_allocated() == 0


def test_the_store_grows_with_what_is_written_not_with_the_budgets(tiny_target):
    """A request may budget its answer to the end of the context (an OpenAI request without
    max_tokens); the store holds only the slots filled so far, grows geometrically as they fill (a
    handful of copies for a long answer), and decodes exactly what a small budget decodes."""
    from eyas.generate import generate

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    small = TargetEngine(tiny_target, ())
    want = generate(small, prompt, max_new_tokens=60).token_ids
    big = TargetEngine(tiny_target, ())
    capacities = []
    original_fit = big.kv.fit

    def fit(rows, slots):
        original_fit(rows, slots)
        capacities.append(big.kv.slot_capacity)

    big.kv.fit = fit
    got = generate(big, prompt, max_new_tokens=240, stop_ids=(), on_tokens=lambda _: len(capacities) > 150)
    assert got.token_ids[:60] == want
    assert capacities[0] == 128  # the first 128 filled slots' granule, not the 248 budgeted (256)
    assert sorted(set(capacities)) == [128, 256]  # grown once as the answer passed 128 slots, not once per token
    with pytest.raises(ValueError, match="^rows: the plan reaches past the K/V store"):
        big.kv.fit(1, 10_000)  # past every open row's budget


def test_a_closed_store_is_reused_by_the_next_request_and_changes_nothing(tiny_target):
    """The last close keeps the store's storage (an earlier answer's K/V still in it) for the next
    request, which grows into it without allocating, and decodes what a fresh engine decodes: no row
    sees a slot it has not written."""
    from eyas.generate import generate

    prompts = ([3, 1, 4, 1, 5, 9, 2, 6] * 20, [7, 7, 7, 9, 30])  # a long answer first, then a short one
    fresh = [generate(TargetEngine(tiny_target, ()), p, max_new_tokens=40).token_ids for p in prompts]
    e = TargetEngine(tiny_target, ())
    assert generate(e, prompts[0], max_new_tokens=40).token_ids == fresh[0]
    assert e.kv_bytes_allocated() == 0 and e.kv.spare_nbytes > 0
    kept = e.kv.spare[0].data_ptr()
    stores = set()
    got = generate(e, prompts[1], max_new_tokens=40, on_tokens=lambda _: stores.add(e.kv.k.data_ptr()))
    assert got.token_ids == fresh[1]
    assert stores == {kept}  # grown into the kept storage, once, and never again
    e.kv.release(keep=False)
    assert e.kv.spare is None and e.kv.spare_nbytes == 0
