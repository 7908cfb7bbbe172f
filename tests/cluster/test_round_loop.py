"""RoundLoop over in-process workers: batched rounds for many requests, exact output, failures isolated."""
from __future__ import annotations

import threading

import pytest
import torch

from eyas.actors.drafter_worker import DrafterWorker
from eyas.actors.target_worker import TargetWorker
from eyas.cluster.round_loop import RoundLoop, WorkerCalls
from eyas.cluster.verifier_client import DrafterUnavailable
from eyas.drafting.engine import TreeSpec
from eyas.generate import generate
from eyas.scheduler.latency import LatencyCurve
from eyas.scheduler.policy import Budgets, PromptLengthPolicy, TreeWorkPolicy
from eyas.target.engine import TargetEngine
from eyas.testing import tiny_eagle1_engine
from eyas.verification.sampling import SamplingParams

FLAT = LatencyCurve.from_points({1: 50.0, 16: 55.0, 64: 70.0, 256: 200.0})


@pytest.fixture()
def workers(tiny_target):
    return TargetWorker(tiny_target), DrafterWorker({"eagle1": tiny_eagle1_engine(tiny_target)},
                                                    tiny_target.cfg.vocab_size)


class FlakyDrafter:
    """A DrafterWorker whose propose_batch fails on the given calls, losing every session (a restart)."""

    def __init__(self, worker: DrafterWorker, fail_calls: set[int]):
        self.worker, self.fail_calls, self.calls = worker, fail_calls, 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def propose_batch(self, items):
        self.calls += 1
        if self.calls in self.fail_calls:
            for rid in list(self.worker.session_method):
                self.worker.close_session(rid)
            raise DrafterUnavailable("drafter: the actor died (test)")
        return self.worker.propose_batch(items)


def prompts(n):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, 60, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def run_all(loop, jobs, n=20):
    futures = [loop.submit(f"r{i}", p, n, method, TreeSpec(), SamplingParams(), 0) for i, (p, method) in enumerate(jobs)]
    return [f.result(timeout=120) for f in futures]


@pytest.mark.parametrize("policy", [TreeWorkPolicy(Budgets(max_batch=8)), PromptLengthPolicy(Budgets(max_batch=4))])
def test_many_requests_in_batched_rounds_are_token_identical_to_target_only(tiny_target, workers, policy):
    target, drafter = workers
    loop = RoundLoop(WorkerCalls(target, 30, local=True), WorkerCalls(drafter, 30, local=True, drafter=True),
                     drafter.info(), policy, FLAT.copy())
    jobs = [(p, "eagle1" if i % 3 else "target") for i, p in enumerate(prompts(8))]
    try:
        results = run_all(loop, jobs)
    finally:
        loop.close()
    base = TargetEngine(tiny_target, ())
    for (p, method), r in zip(jobs, results):
        assert r.token_ids == generate(base, p, max_new_tokens=20).token_ids, method
    assert sum(x.tree_nodes > 0 for r in results for x in r.rounds) > 0
    assert loop.rounds < sum(len(r.rounds) for r in results)  # rounds were shared by several requests
    assert target.leak_check()["ok"] and not target.sessions and not drafter.session_method


def test_a_drafter_that_dies_is_reseeded_then_given_up_and_no_token_changes(tiny_target, workers):
    target, drafter = workers
    flaky = FlakyDrafter(drafter, fail_calls={3, 6, 7, 8, 9, 10})
    loop = RoundLoop(WorkerCalls(target, 30, local=True), WorkerCalls(flaky, 30, local=True, drafter=True),
                     drafter.info(), TreeWorkPolicy(), FLAT.copy())
    jobs = [(p, "eagle1") for p in prompts(4)]
    try:
        results = run_all(loop, jobs, n=30)
    finally:
        loop.close()
    base = TargetEngine(tiny_target, ())
    for (p, _), r in zip(jobs, results):
        assert r.token_ids == generate(base, p, max_new_tokens=30).token_ids
    assert all(r.drafter_reseeds >= 1 for r in results) and any(r.drafter_fallback for r in results)
    assert not target.sessions and not drafter.session_method


def test_cancel_and_bad_requests_leave_the_others_alone(tiny_target, workers):
    target, drafter = workers
    loop = RoundLoop(WorkerCalls(target, 30, local=True), WorkerCalls(drafter, 30, local=True, drafter=True),
                     drafter.info(), TreeWorkPolicy(), FLAT.copy())
    cancel = threading.Event()
    try:
        bad = loop.submit("bad", [1, 10_000], 8, "eagle1", TreeSpec(), SamplingParams(), 0)
        seen = []

        def on_tokens(new):
            seen.append(new)
            if len(seen) == 2:
                cancel.set()
            return False

        gone = loop.submit("gone", [1, 2, 3], 200, "eagle1", TreeSpec(), SamplingParams(), 0, on_tokens, cancel)
        ok = loop.submit("ok", [4, 5, 6], 20, "eagle1", TreeSpec(), SamplingParams(), 0)
        with pytest.raises(ValueError, match="^prompt_ids: "):
            bad.result(timeout=60)
        assert gone.result(timeout=60).finish_reason == "cancelled"
        assert ok.result(timeout=60).token_ids == generate(TargetEngine(tiny_target, ()), [4, 5, 6],
                                                           max_new_tokens=20).token_ids
    finally:
        loop.close()
    assert target.leak_check()["ok"] and not target.sessions and not drafter.session_method
