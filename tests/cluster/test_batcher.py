"""BatchRunner: many requests, one batched verify per round, greedy output unchanged."""
from __future__ import annotations

import pytest
import torch

from eyas.cluster.batcher import BatchRunner
from eyas.generate import generate
from eyas.scheduler.latency import LatencyCurve
from eyas.scheduler.policy import Budgets, PromptLengthPolicy, TreeWorkPolicy
from eyas.target.engine import TargetEngine
from eyas.target.model import eagle1_feature_address
from eyas.testing import EveryThirdRoundPolicy, tiny_eagle1_engine

FLAT = LatencyCurve.from_points({1: 50.0, 16: 55.0, 64: 70.0, 256: 200.0})
STEEP = LatencyCurve.from_points({1: 50.0, 2: 100.0, 64: 3200.0})


@pytest.fixture(scope="module")
def drafter(tiny_target):
    return tiny_eagle1_engine(tiny_target)


def prompts(n):
    g = torch.Generator().manual_seed(11)
    return {f"q{i}": torch.randint(1, 60, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
            for i in range(n)}


@pytest.mark.parametrize("concurrency", [1, 8])
@pytest.mark.parametrize("policy", ["tree-work", "prompt-length"])
def test_greedy_output_is_token_identical_to_target_only(tiny_target, drafter, concurrency, policy):
    target = TargetEngine(tiny_target, eagle1_feature_address(tiny_target.cfg))
    pol = TreeWorkPolicy(Budgets(max_batch=8)) if policy == "tree-work" else PromptLengthPolicy(Budgets(max_batch=4))
    runner = BatchRunner(target, drafter, pol, LatencyCurve.from_points({1: 50.0, 16: 55.0, 64: 70.0}))
    ps = prompts(concurrency)
    for rid, p in ps.items():
        runner.submit(rid, p, max_new_tokens=20)
    done = runner.run()
    base = TargetEngine(tiny_target, ())
    for rid, p in ps.items():
        assert done[rid].token_ids == generate(base, p, max_new_tokens=20).token_ids, rid
    assert not target.sessions and not drafter.sessions  # every session released
    if concurrency == 8:
        assert max(r.batch for r in runner.log) > 1  # rounds really were batched
    assert sum(f.speculative_rounds for f in done.values()) > 0


def test_a_steep_latency_curve_turns_speculation_off_in_the_loop(tiny_target, drafter):
    target = TargetEngine(tiny_target, eagle1_feature_address(tiny_target.cfg))
    runner = BatchRunner(target, drafter, TreeWorkPolicy(), STEEP)
    runner.curve.observe = lambda rows, ms, weight=0: None  # keep the curve steep whatever this CPU measures
    for rid, p in prompts(3).items():
        runner.submit(rid, p, max_new_tokens=10)
    done = runner.run()
    assert all(f.speculative_rounds == 0 for f in done.values())
    assert all(r.verify_rows == r.batch for r in runner.log)  # one row per request: plain decoding


def test_an_invalid_request_is_refused_at_submit_and_the_batch_goes_on(tiny_target, drafter):
    target = TargetEngine(tiny_target, eagle1_feature_address(tiny_target.cfg))
    runner = BatchRunner(target, drafter, TreeWorkPolicy(), FLAT)
    runner.submit("ok", [1, 2, 3], max_new_tokens=8)
    with pytest.raises(ValueError, match="^prompt: "):
        runner.submit("bad", [1, 10_000], max_new_tokens=8)
    assert set(runner.admitting) == {"ok"} and "bad" not in target.sessions and "bad" not in drafter.sessions
    assert len(runner.run()["ok"].token_ids) == 8


def test_an_moe_target_reports_the_expert_bytes_of_each_batched_round():
    """Seed 0x09A: the batch's rows route to a union of experts; the round log carries its bytes."""
    from eyas.testing import ours_from_hf, tiny_hf_mixtral

    moe = ours_from_hf(tiny_hf_mixtral())
    runner = BatchRunner(TargetEngine(moe, ()), None, TreeWorkPolicy(), FLAT)
    for rid, p in prompts(3).items():
        runner.submit(rid, p, max_new_tokens=6)
    runner.run()
    per_expert = moe.cfg.expert_bytes_per_expert
    assert all(r.expert_bytes > 0 and r.expert_bytes % per_expert == 0 for r in runner.log)
    assert all(r.expert_bytes <= moe.cfg.num_layers * moe.cfg.num_experts * per_expert for r in runner.log)
    # the plan predicted each round's bytes from its rows, and every round calibrated the prediction
    assert all(r.predicted_expert_bytes >= moe.cfg.num_layers * moe.cfg.experts_per_token * per_expert
               for r in runner.log)
    assert runner.experts.observations == len(runner.log)


def test_plain_rounds_skip_the_drafter_and_output_is_unchanged(tiny_target, drafter, monkeypatch):
    """A policy that drafts every third round only: the drafter runs in those rounds alone, reads the
    concatenated seeds of the plain rounds before them, and greedy output equals target-only."""
    calls = []
    real = drafter.propose_batch
    monkeypatch.setattr(drafter, "propose_batch", lambda items: calls.append(len(items)) or real(items))
    target = TargetEngine(tiny_target, eagle1_feature_address(tiny_target.cfg))
    policy = EveryThirdRoundPolicy()
    runner = BatchRunner(target, drafter, policy, FLAT.copy())
    ps = prompts(3)
    for rid, p in ps.items():
        runner.submit(rid, p, max_new_tokens=20)
    done = runner.run()
    base = TargetEngine(tiny_target, ())
    for rid, p in ps.items():
        assert done[rid].token_ids == generate(base, p, max_new_tokens=20).token_ids, rid
    assert len(calls) == len(runner.log) // 3 > 0
    assert sum(f.speculative_rounds for f in done.values()) > 0
    assert not target.sessions and not drafter.sessions


def test_requests_submitted_between_steps_are_prefilled_in_one_batched_forward(tiny_target, drafter, monkeypatch):
    """Three submits, then a step: one prefill_batch of 3 (no single prefill), and a cancel before the
    step leaves no session behind."""
    target = TargetEngine(tiny_target, eagle1_feature_address(tiny_target.cfg))
    sizes = []
    real = target.prefill_batch
    monkeypatch.setattr(target, "prefill_batch", lambda ids: sizes.append(len(ids)) or real(ids))
    monkeypatch.setattr(target, "prefill", lambda rid: pytest.fail("a single prefill"))
    runner = BatchRunner(target, drafter, TreeWorkPolicy(), FLAT.copy())
    ps = prompts(4)
    for rid, p in ps.items():
        runner.submit(rid, p, max_new_tokens=10)
    runner.cancel("q3")
    assert runner.in_flight == 3 and runner.finished["q3"].finish_reason == "cancelled"
    done = runner.run()
    assert sizes == [3]
    base = TargetEngine(tiny_target, ())
    for rid in ("q0", "q1", "q2"):
        assert done[rid].token_ids == generate(base, ps[rid], max_new_tokens=10).token_ids, rid
    assert not target.sessions and not drafter.sessions
