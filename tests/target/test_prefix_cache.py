"""The target engine's prefix cache: block hashes, the byte budget and LRU, committed state only,
and outputs and acceptance equal with the cache on and off (greedy, sampled, target-only and
speculative), on a tiny random target."""

from __future__ import annotations

import pytest
import torch

from eyas.drafting.engine import TreeSpec
from eyas.generate import generate
from eyas.protocol.sampling_params import SamplingParams
from eyas.target.engine import TargetEngine
from eyas.target.prefix_cache import BLOCK_TOKENS, CachedBlock, PrefixCache, block_hashes
from tests.testing import tiny_eagle1_engine


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 60, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def block(nbytes_per: int = 4) -> CachedBlock:
    return CachedBlock(torch.zeros(1, 1, BLOCK_TOKENS, nbytes_per // 4), torch.zeros(1, 1, BLOCK_TOKENS, 0))


def test_the_hash_chain_names_whole_prefixes():
    a = tokens(40, 1)
    b = a[:32] + [7] * 8
    c = [a[0] + 1] + a[1:]
    assert len(block_hashes(a)) == 2 == len(block_hashes(a[:47]))
    assert block_hashes(a) == block_hashes(b)[:2]  # same first 32 tokens
    assert block_hashes(c)[1] != block_hashes(a)[1]  # block 1 equal, its prefix not: another hash
    assert block_hashes(a, 1) == block_hashes(a)[:1]


def test_the_budget_evicts_the_least_recently_used_leaf_first():
    one = block().nbytes
    cache = PrefixCache(3 * one)
    chain = tokens(4 * BLOCK_TOKENS, 2)
    for _i, h in cache.missing(block_hashes(chain, 3)):
        cache.insert(h, block())
    cache.touch_chain(chain, 3 * BLOCK_TOKENS)
    other = tokens(BLOCK_TOKENS, 3)
    ((_, h),) = cache.missing(block_hashes(other, 1))
    assert cache.insert(h, block())  # over budget: the chain's last block goes
    assert cache.nbytes == 3 * one and cache.stats.evicted_blocks == 1
    assert len(cache.lookup(chain, len(chain))) == 2  # blocks 0 and 1 still reachable
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        PrefixCache(-1)
    assert not PrefixCache(one - 1).insert(h, block())  # a block larger than the budget is not kept


def run(engine, prompt, drafter=None, sampling=SamplingParams(), seed=0, rid="r"):
    return generate(
        engine,
        prompt,
        max_new_tokens=20,
        drafter=drafter,
        tree=TreeSpec(),
        sampling=sampling,
        seed=seed,
        request_id=rid,
    )


@pytest.mark.parametrize("speculative", [False, True])
def test_a_repeated_prompt_hits_and_decodes_exactly_as_without_the_cache(tiny_target, speculative):
    """The second identical prompt reuses every full block but the last token's; its tokens, and with a
    drafter its per-round acceptance, equal the cache-off run's."""
    drafter = tiny_eagle1_engine(tiny_target) if speculative else None
    taps = drafter.taps if drafter else ()
    prompt = tokens(3 * BLOCK_TOKENS + 5, 4)
    off = run(TargetEngine(tiny_target, taps), prompt, drafter)
    engine = TargetEngine(tiny_target, taps, prefix_cache=1 << 26)
    first = run(engine, prompt, drafter, rid="a")
    second = run(engine, prompt, drafter, rid="b")
    assert first.cached_tokens == 0 and second.cached_tokens == 3 * BLOCK_TOKENS
    for r in (first, second):
        assert r.token_ids == off.token_ids
        assert [x.accept_length for x in r.rounds] == [x.accept_length for x in off.rounds]
    st = engine.prefix_cache_stats()
    assert st["queries"] == 2 * len(prompt) and st["hits"] == 3 * BLOCK_TOKENS
    assert engine.kv_slots_allocated() == 0 and not engine.sessions


def test_a_next_turn_reuses_the_previous_prompt_and_answer(tiny_target):
    """A conversation's next prompt (the last prompt, its answer and a new message) hits past the
    previous prompt: the answer's blocks were offered when the first request closed."""
    engine = TargetEngine(tiny_target, (), prefix_cache=1 << 26)
    p1 = tokens(2 * BLOCK_TOKENS + 3, 5)
    a1 = run(engine, p1, rid="t1").token_ids
    p2 = p1 + a1 + tokens(9, 6)
    cached = run(engine, p2, rid="t2")
    assert cached.cached_tokens == ((len(p1) + len(a1)) // BLOCK_TOKENS) * BLOCK_TOKENS > len(p1)
    assert cached.token_ids == run(TargetEngine(tiny_target, ()), p2).token_ids


def test_a_sampled_request_with_a_seed_draws_the_same_tokens(tiny_target):
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    drafter = tiny_eagle1_engine(tiny_target)
    prompt = tokens(2 * BLOCK_TOKENS + 1, 7)
    off = run(TargetEngine(tiny_target, drafter.taps), prompt, drafter, sampling, seed=11)
    engine = TargetEngine(tiny_target, drafter.taps, prefix_cache=1 << 26)
    run(engine, prompt, drafter, sampling, seed=3, rid="warm")
    on = run(engine, prompt, drafter, sampling, seed=11, rid="hit")
    assert on.cached_tokens > 0 and on.token_ids == off.token_ids


def test_only_committed_state_is_cached(tiny_target):
    """After speculative rounds with rejected branches, every cached block equals the K/V and features
    a plain prefill of the committed tokens computes (no provisional or rejected row got in)."""
    drafter = tiny_eagle1_engine(tiny_target)
    engine = TargetEngine(tiny_target, drafter.taps, prefix_cache=1 << 26)
    prompt = tokens(BLOCK_TOKENS + 2, 8)
    out = generate(engine, prompt, max_new_tokens=40, drafter=drafter, tree=TreeSpec(), request_id="c")
    assert any(r.accept_length < r.tree_nodes for r in out.rounds)  # some drafted rows were rejected
    committed = (prompt + out.token_ids)[: len(prompt) + len(out.token_ids) - 1]
    ref = TargetEngine(tiny_target, drafter.taps)
    ref.open_session("ref", committed, 1, 1)
    verified = ref.prefill("ref")
    k, v = ref.kv.read_span(ref.sessions["ref"].kv_row, 0, len(committed))
    hashes = block_hashes(committed)
    assert len(hashes) >= 2 and all(h in engine.prefix_cache.blocks for h in hashes)
    for i, h in enumerate(hashes):
        b = engine.prefix_cache.blocks[h]
        a, z = i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS
        assert torch.allclose(b.keys, k[:, :, a:z], atol=1e-5) and torch.allclose(b.values, v[:, :, a:z], atol=1e-5)
        assert torch.allclose(b.features[drafter.taps], verified.features[a:z], atol=1e-5)


def test_eviction_while_a_hit_request_is_live_changes_nothing_it_computes(tiny_target):
    """A budget of two blocks: a request opens on a hit (its blocks copied into its own slots), then
    other prompts evict those blocks before it prefills; its prefill's logits and features equal a
    cache-off prefill's, and the cache never exceeds its budget."""
    prompt = tokens(2 * BLOCK_TOKENS + 1, 9)
    probe = TargetEngine(tiny_target, (), prefix_cache=1 << 26)
    run(probe, prompt, rid="p")
    per_block = next(iter(probe.prefix_cache.blocks.values())).nbytes
    engine = TargetEngine(tiny_target, (), prefix_cache=2 * per_block)
    run(engine, prompt, rid="w")
    engine.open_session("x", prompt, 4, 1)
    assert engine.sessions["x"].cached_tokens == 2 * BLOCK_TOKENS
    for seed in (10, 11):
        run(engine, tokens(3 * BLOCK_TOKENS + 1, seed), rid=f"evict{seed}")
    assert engine.prefix_cache.stats.evicted_blocks >= 2 and engine.prefix_cache.nbytes <= 2 * per_block
    assert not engine.prefix_cache.lookup(prompt, len(prompt) - 1)  # x's blocks are gone from the cache
    hit = engine.prefill("x")
    ref = TargetEngine(tiny_target, ())
    ref.open_session("x", prompt, 4, 1)
    want = ref.prefill("x")
    assert torch.allclose(hit.logits, want.logits, atol=1e-5) and torch.allclose(hit.features, want.features, atol=1e-5)
    engine.close_session("x")
    assert engine.kv_slots_allocated() == 0


def test_engines_of_one_model_share_the_k_v_and_keep_features_per_address(tiny_target):
    """One cache for a model's engines: a target-only request hits the K/V an EAGLE request committed;
    an engine of another feature address first adds its own features to those blocks (a miss), then
    hits; every output equals the cache off."""
    from eyas.target.config import FeatureTap
    from eyas.target.prefix_cache import PrefixCache

    drafter = tiny_eagle1_engine(tiny_target)
    cache = PrefixCache(1 << 26)
    spec, plain = TargetEngine(tiny_target, drafter.taps, cache), TargetEngine(tiny_target, (), cache)
    prompt = tokens(2 * BLOCK_TOKENS + 3, 12)
    run(spec, prompt, drafter, rid="s1")
    assert run(plain, prompt, rid="p1").cached_tokens == 2 * BLOCK_TOKENS  # K/V alone serves target-only
    other = TargetEngine(tiny_target, (FeatureTap(1, False),), cache)  # another feature address
    assert run(other, prompt, rid="o1").cached_tokens == 0  # no features for it yet
    assert run(other, prompt, rid="o2").cached_tokens == 2 * BLOCK_TOKENS  # now there are
    block = next(iter(cache.blocks.values()))
    assert set(block.features) == {drafter.taps, other.taps}
    assert cache.nbytes == sum(b.nbytes for b in cache.blocks.values())
    off = run(TargetEngine(tiny_target, ()), prompt)
    assert run(plain, prompt, rid="p2").token_ids == off.token_ids
