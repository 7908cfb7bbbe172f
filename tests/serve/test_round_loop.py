"""RoundLoop over in-process workers: batched rounds for many requests, exact output, failures isolated."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from eyas.actors.drafter_worker import DrafterWorker
from eyas.actors.target_worker import TargetWorker
from eyas.drafting.engine import TreeSpec
from eyas.generate import generate
from eyas.protocol.sampling_params import SamplingParams
from eyas.scheduler.latency import DraftCost, LatencyCurve
from eyas.scheduler.policy import Budgets, PromptLengthPolicy, TreeWorkPolicy
from eyas.serve.round_loop import RoundLoop, WorkerCalls
from eyas.step import DrafterUnavailable
from eyas.target.engine import TargetEngine
from tests.testing import FLAT, EveryThirdRoundPolicy, local_loop, tiny_eagle1_engine

STEEP = LatencyCurve.from_points({1: 50.0, 2: 100.0, 64: 3200.0})


@pytest.fixture()
def workers(tiny_target):
    return TargetWorker(tiny_target), DrafterWorker(
        {"eagle1": tiny_eagle1_engine(tiny_target)}, tiny_target.cfg.vocab_size
    )


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
    return [
        torch.randint(1, 60, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist() for _ in range(n)
    ]


def run_all(loop, jobs, n=20):
    """Submit every (prompt, method) job, wait for all, and close the loop whatever happens."""
    try:
        futures = [
            loop.submit(f"r{i}", p, n, method, TreeSpec(), SamplingParams(), 0) for i, (p, method) in enumerate(jobs)
        ]
        return [f.result(timeout=120) for f in futures]
    finally:
        loop.close()


def assert_target_only_output(target_model, jobs, results, n):
    """Each result's tokens equal greedy target-only decoding of its prompt (``n`` new tokens)."""
    base = TargetEngine(target_model, ())
    for (p, method), r in zip(jobs, results):
        assert r.token_ids == generate(base, p, max_new_tokens=n).token_ids, method


@pytest.mark.parametrize("policy", [TreeWorkPolicy(Budgets(max_batch=8)), PromptLengthPolicy(Budgets(max_batch=4))])
def test_many_requests_in_batched_rounds_are_token_identical_to_target_only(tiny_target, workers, policy):
    target, drafter = workers
    loop = local_loop(target, drafter, drafter.info(), policy)
    jobs = [(p, "eagle1" if i % 3 else "target") for i, p in enumerate(prompts(8))]
    results = run_all(loop, jobs)
    assert_target_only_output(tiny_target, jobs, results, 20)
    assert sum(x.tree_nodes > 0 for r in results for x in r.rounds) > 0
    assert loop.rounds < sum(len(r.rounds) for r in results)  # rounds were shared by several requests
    assert target.leak_check()["ok"] and not target.sessions and not drafter.session_method


def test_a_drafter_that_dies_is_reseeded_then_given_up_and_no_token_changes(tiny_target, workers):
    target, drafter = workers
    flaky = FlakyDrafter(drafter, fail_calls={3, 6, 7, 8, 9, 10})
    # the fixed-tree policy drafts every round, so the drafter's failing calls land where counted (the
    # tree-work policy may stop drafting once it has measured what drafting costs)
    loop = local_loop(target, flaky, drafter.info(), PromptLengthPolicy())
    jobs = [(p, "eagle1") for p in prompts(4)]
    results = run_all(loop, jobs, n=30)
    assert_target_only_output(tiny_target, jobs, results, 30)
    assert all(r.drafter_reseeds >= 1 for r in results) and any(r.drafter_fallback for r in results)
    assert not target.sessions and not drafter.session_method


class DownDrafter:
    """A DrafterWorker that goes down at its ``down_at``-th propose (losing every session, as a dead
    replica does) and answers again after ``probes_down`` of the loop's probes (``info`` calls): a
    replacement replica coming up. Counts the calls made to it while down."""

    def __init__(self, worker: DrafterWorker, down_at: int, probes_down: int):
        self.worker, self.down_at, self.probes_down = worker, down_at, probes_down
        self.proposes, self.down, self.probes, self.calls_while_down = 0, False, 0, []

    def __getattr__(self, name):
        attr = getattr(self.worker, name)

        def call(*args):
            if name == "propose_batch":
                self.proposes += 1
                if self.proposes == self.down_at:
                    self.down = True
                    for rid in list(self.worker.session_method):
                        self.worker.close_session(rid)
            if self.down:
                self.calls_while_down.append(name)
                if name == "info":
                    self.probes += 1
                    self.down = self.probes < self.probes_down
                raise DrafterUnavailable("drafter: the replica is gone (test)")
            return attr(*args)

        return call


class PacedTarget:
    """A TargetWorker whose calls, while ``drafter`` is down, each wait up to ``wait_s`` for it to come
    back: the rounds stay plain while it is down (nothing waits on the drafter for long), but a tiny
    model's plain rounds can no longer finish every answer before the loop's probe sees the drafter
    again (without this, a fast machine ran out the answers first and the reseed was never tried)."""

    def __init__(self, worker, drafter: DownDrafter, wait_s: float = 0.05):
        self.worker, self.drafter, self.wait_s = worker, drafter, wait_s

    def __getattr__(self, name):
        attr = getattr(self.worker, name)

        def call(*args, **kwargs):
            deadline = time.monotonic() + self.wait_s
            while self.drafter.down and time.monotonic() < deadline:
                time.sleep(0.001)
            return attr(*args, **kwargs)

        return call


def drafter_down_loop(monkeypatch, target, drafter, down: DownDrafter):
    """A loop over ``target`` (paced while ``down`` is down: :class:`PacedTarget`) and ``down`` (wrapping
    ``drafter``), whose probe asks every 20 ms whether the drafter answers again."""
    from eyas.serve import round_loop

    monkeypatch.setattr(round_loop, "DRAFTER_PROBE_S", 0.02)
    return local_loop(PacedTarget(target, down), down, drafter.info(), PromptLengthPolicy())


def test_a_drafter_that_goes_down_makes_rounds_plain_at_once_and_comes_back_by_reseeding(
    tiny_target, workers, monkeypatch
):
    """While the drafter is down the rounds go on target-only with no drafter call in them (the
    streams do not wait for a replacement); only the loop's probe asks, and once it answers every
    request still running reseeds and drafts again; no token changes and nobody is given up."""
    target, drafter = workers
    down = DownDrafter(drafter, down_at=3, probes_down=4)
    loop = drafter_down_loop(monkeypatch, target, drafter, down)
    jobs = [(p, "eagle1") for p in prompts(4)]
    results = run_all(loop, jobs, n=60)
    assert_target_only_output(tiny_target, jobs, results, 60)
    assert down.calls_while_down[0] == "propose_batch" and set(down.calls_while_down[1:]) == {"info"}
    assert down.probes == 4 and sum(r.drafter_reseeds for r in results) >= 1
    assert not any(r.drafter_fallback for r in results)
    assert any(x.tree_nodes > 0 for r in results for x in r.rounds[-5:])  # drafting again at the end
    assert not target.sessions and not drafter.session_method


def test_cancel_and_bad_requests_leave_the_others_alone(tiny_target, workers):
    target, drafter = workers
    loop = local_loop(target, drafter, drafter.info(), TreeWorkPolicy())
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
        assert (
            ok.result(timeout=60).token_ids
            == generate(TargetEngine(tiny_target, ()), [4, 5, 6], max_new_tokens=20).token_ids
        )
    finally:
        loop.close()
    assert target.leak_check()["ok"] and not target.sessions and not drafter.session_method


def test_the_work_a_loop_reports_counts_rows_still_to_run_and_falls_to_zero_when_idle(tiny_target, workers):
    """``RoundLoop.work`` (what a target replica reports to the autoscaler).

    Worked example of the formula, on a hand-built live request: 4 of 16 tokens out after 2 rounds of
    3 rows (2 nodes + the root, 2 tokens a round) -> (16 - 4) / 2 = 6 rounds x 3 rows = 18 rows; a
    queued request with a 5-token prompt and max_new_tokens 8 adds 5 + 8 = 13 -> 31 pending rows.
    """
    import concurrent.futures
    import time

    from eyas.generate import RoundStats
    from eyas.scheduler.policy import AcceptanceEstimate
    from eyas.serve.round_loop import Live

    target, drafter = workers
    loop = RoundLoop(WorkerCalls(target, 30, local=True), None, {}, TreeWorkPolicy(Budgets()), FLAT.copy())
    try:
        assert loop.work() == {
            "pending_verify_rows": 0.0,
            "draft_rows": 0.0,
            "expert_bytes": 0.0,
            "live": 0,
            "pending": 0,
            "batch": 0,
        }

        def live(rid, prompt, max_new):
            return Live(
                request_id=rid,
                method="eagle1",
                prompt_ids=prompt,
                max_new_tokens=max_new,
                tree=TreeSpec(),
                sampling=SamplingParams(),
                rng_seed=0,
                on_tokens=None,
                future=concurrent.futures.Future(),
                cancel=threading.Event(),
                arrival=time.perf_counter(),
                acceptance=AcceptanceEstimate(),
            )

        running = live("a", [1, 2, 3], 16)
        running.out, running.prompt_done, running.seed = [5, 6, 7, 8], 3, object()
        halfway = live("h", list(range(1, 11)), 8)  # a prompt 4 of 10 rows into its chunked prefill
        halfway.prompt_done = 4
        running.rounds = [RoundStats(accept_length=1, new_tokens=2, tree_nodes=2, draft_s=0.0, verify_s=0.0)] * 2
        with loop.lock:  # hold the loop: this test places the requests itself
            loop.live["a"], loop.live["h"] = running, halfway
            queued = live("b", [1, 2, 3, 4, 5], 8)
            loop.pending.append(queued)
            work = loop.work()
            loop.live.clear()
            loop.pending.clear()
        # 18 rows for a (6 rounds x 3 rows); 6 prompt rows + 8 plain rows for h; 5 + 8 for the queued b
        assert work["pending_verify_rows"] == 18 + 14 + 13 and work["live"] == 2 and work["pending"] == 1
        loop.submit("c", [1, 2, 3], 6, "target", TreeSpec(), SamplingParams(), 0).result(timeout=60)
        assert loop.work()["pending_verify_rows"] == 0.0  # finished requests leave no work behind
    finally:
        loop.close()


class CountingTarget:
    """A TargetWorker that records, for every round call that prefills, how many prompts it carries
    and how many prompt rows each took (and refuses single prefills)."""

    def __init__(self, worker: TargetWorker):
        self.worker, self.prefill_batches, self.prefill_rows = worker, [], []

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def prefill(self, request):
        raise AssertionError("the loop prefills in its rounds")

    def prefill_batch(self, requests, max_prefill_rows=None):
        raise AssertionError("the loop prefills in its rounds")

    def round_batch(self, prefills, verifies, max_prefill_rows=None):
        raise AssertionError("the loop's worker calls carry objects (TargetWorker.step)")

    def step(self, prefills, verifies, max_prefill_rows=None):
        self.calls = getattr(self, "calls", 0) + 1
        if getattr(self, "during_call", None):
            self.during_call(self.calls)
        if prefills:
            self.prefill_batches.append(len(prefills))
            before = {rid: self._prefilled(rid) for rid in prefills}
        out = self.worker.step(prefills, verifies, max_prefill_rows)
        if prefills:
            self.prefill_rows.append({rid: self._prefilled(rid) - n for rid, n in before.items()})
        return out

    def _prefilled(self, request_id):
        s = self.worker.sessions.get(request_id)
        t = s.engine.sessions.get(request_id) if s is not None else None
        return t.prefilled if t is not None else 0


def test_arrivals_between_rounds_are_prefilled_together_in_one_forward(tiny_target, workers):
    """Six requests (one with a prompt outside the vocabulary) arrive while the loop is busy: it opens
    the five valid ones, prefills them in ONE batched call, and every output is target-only's."""
    target, drafter = workers
    counting = CountingTarget(target)
    loop = local_loop(counting, drafter, drafter.info(), TreeWorkPolicy(Budgets(max_batch=8)))
    jobs = [(p, "eagle1" if i % 2 else "target") for i, p in enumerate(prompts(5))]
    try:
        with loop.lock:  # the loop thread waits: every request below arrives before its next look
            futures = [
                loop.submit(f"r{i}", p, 12, method, TreeSpec(), SamplingParams(), 0)
                for i, (p, method) in enumerate(jobs)
            ]
            bad = loop.submit("bad", [1, 10_000], 12, "target", TreeSpec(), SamplingParams(), 0)
        results = [f.result(timeout=120) for f in futures]
        with pytest.raises(ValueError, match="^prompt_ids: "):
            bad.result(timeout=60)
    finally:
        loop.close()
    assert counting.prefill_batches == [5]
    assert_target_only_output(tiny_target, jobs, results, 12)
    assert target.leak_check()["ok"] and not target.sessions and not drafter.session_method


@pytest.mark.parametrize("budget_rows", [None, 1])
def test_an_moe_target_reports_expert_bytes_per_request_and_per_round_and_the_budget_holds(budget_rows):
    """Seed 0x09A through the worker protocol: every round's decisions carry the expert bytes of the
    request's own rows and of the whole batched verify; the loop's expert model learns from each round.
    With a budget of one row's experts every round verifies one request alone. Output stays exact."""
    from eyas.scheduler.cost import ExpertTraffic
    from tests.testing import ours_from_hf, tiny_hf

    moe = ours_from_hf(tiny_hf("mixtral", experts=16, top_k=2, seed=5))
    target = TargetWorker(moe)
    drafter = DrafterWorker({"eagle1": tiny_eagle1_engine(moe)}, moe.cfg.vocab_size)
    experts = ExpertTraffic(**target.engine_for(()).expert_traffic_shape())
    budget = None if budget_rows is None else experts.predict(budget_rows)
    records = []
    loop = local_loop(
        target,
        drafter,
        drafter.info(),
        TreeWorkPolicy(Budgets(max_batch=8, max_expert_bytes=budget)),
        on_round=records.append,
        experts=experts,
    )
    jobs = [(p, "eagle1") for p in prompts(4)]
    results = run_all(loop, jobs, n=12)
    assert_target_only_output(moe, jobs, results, 12)
    per_expert, most = moe.cfg.expert_bytes_per_expert, experts.all_bytes
    assert records and all(0 < r.expert_bytes <= r.batch_expert_bytes <= most for r in records)
    assert all(r.expert_bytes % per_expert == 0 and r.batch_expert_bytes % per_expert == 0 for r in records)
    assert loop.experts is experts and experts.observations == loop.rounds
    by_round = {}
    for r in records:
        by_round.setdefault(r.start_ns, []).append(r)
    if budget_rows is None:
        assert max(len(rs) for rs in by_round.values()) > 1  # rounds were shared
    else:
        assert all(len(rs) == 1 and rs[0].flat is None for rs in by_round.values())  # one plain row a round
        assert all(r.batch_expert_bytes == r.expert_bytes for r in records)
    assert target.leak_check()["ok"] and not target.sessions


def test_stats_merge_every_replicas_report():
    """Stats = the registry's reports merged: workers with their kind, telemetry points concatenated and
    tagged with their replica, drafter KV as the draft side of eyas.kv_bytes, replica counts by kind."""
    from eyas.serve.app import merge_reports

    point = {"attributes": {"finish_reason": "length"}, "value": 2}
    target = {
        "replica": "t1",
        "kind": "target",
        "worker": {"live_sessions": 0, "ok": True},
        "loop": {"rounds": 7},
        "autoscaling": {"pending_verify_rows": 12.0},
        "telemetry": {"metrics": {"eyas.requests": [point]}, "spans": [{"name": "eyas.round"}]},
    }
    drafter = {
        "replica": "d1",
        "kind": "drafter",
        "worker": {"live_sessions": 0, "ok": True, "kv_bytes_allocated": 4096},
        "autoscaling": {"draft_rows": 3.0},
    }
    stats = merge_reports([target, dict(target, replica="t2"), drafter], "tree-work")
    assert stats["replicas"] == {"target": 2, "drafter": 1}
    assert [p["replica"] for p in stats["metrics"]["eyas.requests"]] == ["t1", "t2"]
    assert {"attributes": {"side": "draft"}, "value": 4096} in stats["metrics"]["eyas.kv_bytes"]
    assert [w["kind"] for w in stats["workers"]] == ["target", "target", "drafter"] and len(stats["spans"]) == 2
    assert stats["scheduler"] == {"policy": "tree-work", "loops": {"t1": {"rounds": 7}, "t2": {"rounds": 7}}}
    assert stats["autoscaling"]["d1"] == {"draft_rows": 3.0, "kind": "drafter"}


def test_plain_rounds_skip_the_drafter_and_its_seeds_catch_up_exactly(tiny_target, workers):
    """In a round planned plain the drafter is not called at all; the seeds of those rounds concatenate
    (``Seed.then``) and the drafter reads them when the request drafts again. Greedy output stays
    token-identical to target-only, and the drafter sees exactly one call per drafting round."""
    target, drafter = workers
    counting = FlakyDrafter(drafter, fail_calls=set())
    policy = EveryThirdRoundPolicy()
    loop = local_loop(target, counting, drafter.info(), policy)
    jobs = [(p, "eagle1") for p in prompts(3)]
    results = run_all(loop, jobs, n=24)
    assert_target_only_output(tiny_target, jobs, results, 24)
    assert all(not r.drafter_fallback and r.drafter_reseeds == 0 for r in results)
    drafted_rounds = sum(1 for i in range(1, policy.rounds + 1) if i % 3 == 0 and i <= loop.rounds)
    assert counting.calls == drafted_rounds > 0
    assert sum(x.tree_nodes > 0 for r in results for x in r.rounds) > 0
    assert loop.draft_cost.to_dict()["observations"] == drafted_rounds
    assert not target.sessions and not drafter.session_method


class _TorchCallsOnThisThread:
    """The torch functions called on the thread that enters it (a torch-function mode is per thread)."""

    def __init__(self):
        from torch.overrides import TorchFunctionMode

        names = self.names = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                names.append(getattr(func, "__name__", str(func)))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def test_the_loops_own_thread_joins_no_seeds_so_no_second_openmp_team_slows_the_forwards(tiny_target, workers):
    """A request planned plain for two rounds drafts from three queued seeds, which are joined into
    one. On the round loop's thread that concatenation gave the process a second OpenMP team (torch's
    CPU kernels spin up a team per thread that runs them in parallel), and every forward after it ran
    up to 2x slower (eyas.compute). The drafter side joins them on the compute thread: the loop's
    thread runs no torch.cat, and the output is target-only's."""
    target, drafter = workers
    calls = _TorchCallsOnThisThread()
    loop = local_loop(target, drafter, drafter.info(), EveryThirdRoundPolicy())
    round_ = loop._round

    def watched_round():
        with calls.mode:
            round_()

    loop._round = watched_round
    jobs = [(p, "eagle1") for p in prompts(3)]
    results = run_all(loop, jobs, n=24)
    assert_target_only_output(tiny_target, jobs, results, 24)
    assert sum(x.tree_nodes > 0 for r in results for x in r.rounds) > 0  # it drafted from joined seeds
    assert calls.names and "cat" not in calls.names, sorted(set(calls.names))


def test_the_loop_starts_from_the_drafters_measured_cost_and_skips_a_drafter_that_does_not_pay(tiny_target, workers):
    """The drafter worker's start-up measurement (``measure_costs``) reaches the loop through ``info``:
    the loop's draft cost starts fitted to it, not at the optimistic 0. When that cost is far above a
    verify forward (here 1,000 ms per depth, written into the worker's measurement), the tree-work
    policy plans every round plain from the first one: no propose call at all, and the output is still
    target-only's."""
    target, drafter = workers
    measured = drafter.measure_costs(repeats=1)
    assert set(measured) == {"eagle1"} and [d for d, _, _ in measured["eagle1"]] == [1, 3, 5, 5]
    loop = local_loop(target, drafter, drafter.info(), TreeWorkPolicy(Budgets()))
    # fitted to the measurement itself (not the optimistic 0); a timing-free check, since a loaded
    # machine can measure any shape of costs
    assert loop.draft_cost.to_dict() == DraftCost.from_points(measured["eagle1"]).to_dict()
    assert loop.draft_cost.to_dict()["observations"] == 4
    loop.close()

    drafter.draft_points["eagle1"] = [(1, 0, 1000.0), (3, 8, 3000.0), (5, 16, 5000.0)]
    counting = FlakyDrafter(drafter, fail_calls=set())
    loop = local_loop(target, counting, drafter.info(), TreeWorkPolicy(Budgets()))
    assert loop.draft_cost.predict(5) == pytest.approx(5000.0)
    jobs = [(p, "eagle1") for p in prompts(2)]
    results = run_all(loop, jobs, n=12)
    assert_target_only_output(tiny_target, jobs, results, 12)
    assert counting.calls == 0 and all(x.tree_nodes == 0 for r in results for x in r.rounds)
    assert not target.sessions and not drafter.session_method


def test_a_steep_latency_curve_turns_speculation_off_in_the_loop(tiny_target, workers):
    """A verify of 2 rows costing twice one (and 64 rows 64x): no tree pays, so the tree-work policy
    plans every round plain. Each request verifies its one root row a round, the drafter proposes
    nothing, and the output is target-only's."""
    target, drafter = workers
    counting = FlakyDrafter(drafter, fail_calls=set())
    rows = []
    loop = local_loop(
        target, counting, drafter.info(), TreeWorkPolicy(Budgets()), STEEP, on_round=lambda rec: rows.append(rec.flat)
    )
    loop.curve.observe = lambda rows, ms, weight=0: None  # keep the curve steep whatever this CPU measures
    jobs = [(p, "eagle1") for p in prompts(3)]
    results = run_all(loop, jobs, n=10)
    assert_target_only_output(tiny_target, jobs, results, 10)
    assert counting.calls == 0 and rows and all(flat is None for flat in rows)
    assert not target.sessions and not drafter.session_method


def test_a_short_request_beside_a_long_prompt_gets_its_first_token_within_three_of_its_rounds(tiny_target, workers):
    """Chunked prefill: a 200-token prompt prefills 16 rows a round; a short request that arrives
    during its second round is prefilled beside it (shortest prompt first) and has its first token
    within 3 rounds of arriving, long before the long prompt's; every output is target-only's."""
    target, drafter = workers
    counting = CountingTarget(target)
    loop = local_loop(counting, drafter, drafter.info(), TreeWorkPolicy(Budgets()), max_prefill_rows=16)
    long, short = [(5 * i + 3) % 60 + 1 for i in range(200)], [3, 1, 4, 1, 5]
    first_token_call, submitted = {}, {}

    def first_token(rid):
        def seen(tokens):
            first_token_call.setdefault(rid, counting.calls)
            return False

        return seen

    def arrive_in_round_two(call):
        if call == 2 and "short" not in submitted:
            submitted["short"] = (
                call,
                loop.submit(
                    "short", short, 8, "target", TreeSpec(), SamplingParams(), 0, on_tokens=first_token("short")
                ),
            )

    counting.during_call = arrive_in_round_two
    try:
        f_long = loop.submit("long", long, 8, "eagle1", TreeSpec(), SamplingParams(), 0, on_tokens=first_token("long"))
        r_long = f_long.result(timeout=120)
        arrived, f_short = submitted["short"]
        r_short = f_short.result(timeout=120)
    finally:
        loop.close()
    assert first_token_call["long"] == -(-200 // 16)  # the long prompt took 13 prefill rounds
    assert first_token_call["short"] - arrived + 1 <= 3  # the short one: its first token within 3 rounds
    assert first_token_call["short"] < first_token_call["long"]
    assert all(max(rows.values(), default=0) <= 16 and sum(rows.values()) <= 16 for rows in counting.prefill_rows)
    assert_target_only_output(tiny_target, [(long, "eagle1"), (short, "target")], [r_long, r_short], 8)
    assert target.leak_check()["ok"] and not target.sessions


def test_a_planned_tree_keeps_the_requests_value_floors():
    """The tree-work policy plans a shape (width, depth, budget); the request's cost-aware floors
    ride along, and a request without floors gets plain EAGLE-2."""
    from eyas.scheduler.cost import TreeShape
    from eyas.serve.round_loop import tree_spec

    floored = TreeSpec(expand_width=3, max_depth=4, verify_budget=6, min_value=0.06, expand_min_value=0.35)
    assert tree_spec(TreeShape(2, 3, 6), floored) == TreeSpec("dynamic", 2, 3, 6, min_value=0.06, expand_min_value=0.35)
    assert tree_spec(TreeShape(2, 3, 6)) == TreeSpec("dynamic", 2, 3, 6)


@pytest.mark.parametrize("precision", ["fp32", "gguf"])
def test_logprobs_are_the_targets_own_and_speculation_does_not_change_them(tiny_target, precision):
    """Each emitted token's logprob (and its top 3) comes with its publish: the target's raw
    log-softmax at the row that emitted it. Under EAGLE-1 they equal target-only's, bit for bit at gguf
    (row-invariant kernels) and within 1e-5 at fp32 (whose GEMM rounds differently by row count),
    and they match a teacher-forced forward of prompt + answer."""
    from tests.testing import ours_from_hf, tiny_hf

    model = tiny_target
    if precision == "gguf":
        from eyas import kernels
        from eyas.target.quantized import quantize_gguf

        if kernels.load() is None:
            pytest.skip("Eyas's CPU kernels do not run here")
        model = ours_from_hf(tiny_hf("llama", hidden=128, heads=4, kv_heads=2, vocab=64, seed=3))
        quantize_gguf(model)
    target = TargetWorker(model)
    drafter = DrafterWorker({"eagle1": tiny_eagle1_engine(model)}, model.cfg.vocab_size)
    loop = local_loop(target, drafter, drafter.info(), PromptLengthPolicy(Budgets(max_batch=4)))
    got: dict[str, list] = {"target": [], "eagle1": []}
    try:
        for method in got:
            tokens: list[int] = []

            def on_tokens(new, logprobs, out=got[method], tokens=tokens):
                assert len(logprobs) == len(new)
                tokens.extend(new)
                out.extend(logprobs)
                return False

            r = loop.submit(
                method, [3, 1, 4, 1, 5], 16, method, TreeSpec(), SamplingParams(), 0, on_tokens, logprobs=3
            ).result(timeout=120)
            assert r.token_ids == tokens[: len(r.token_ids)]
    finally:
        loop.close()
    if precision == "gguf":
        assert got["eagle1"] == got["target"]
    else:
        for (a, ta), (b, tb) in zip(got["eagle1"], got["target"]):
            assert abs(a - b) < 1e-5 and [t for t, _ in ta] == [t for t, _ in tb]
    answer = generate(TargetEngine(model, ()), [3, 1, 4, 1, 5], max_new_tokens=16).token_ids
    ids = torch.tensor([[3, 1, 4, 1, 5, *answer]])
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    with torch.inference_mode():
        logits = model(ids, torch.arange(t)[None], model.allocate_cache(1, t), 0, mask, (), logits_rows="all").logits[0]
    want = torch.log_softmax(logits[4 : 4 + len(answer)], dim=-1)
    for i, (lp, top) in enumerate(got["target"][: len(answer)]):
        assert abs(lp - float(want[i, answer[i]])) < 1e-4, i
        assert [tok for tok, _ in top] == want[i].topk(3).indices.tolist()
    assert target.leak_check()["ok"]


def test_suffix_drafts_alone_and_grafted_in_batched_rounds_are_token_identical_and_survive_a_drafter_loss(
    tiny_target, workers, monkeypatch
):
    """Requests of method suffix (no drafter) and EAGLE requests with suffix drafts grafted share rounds
    with plain EAGLE and target-only ones; every answer is target-only's; suffix candidates were
    verified (more rows than the EAGLE trees alone give); while the drafter is down the suffix-alone
    requests go on drafting and nobody spends a reseed on it; no index or session is left."""
    from eyas.step import suffix_tree_spec

    target, drafter = workers
    down = DownDrafter(drafter, down_at=4, probes_down=3)
    loop = drafter_down_loop(monkeypatch, target, drafter, down)
    kinds = [("suffix", False), ("eagle1", True), ("eagle1", False), ("target", False)]
    jobs = [(p * 3, kinds[i % 4]) for i, p in enumerate(prompts(8))]
    try:
        futures = [
            loop.submit(
                f"s{i}",
                p,
                40,
                method,
                suffix_tree_spec(loop.suffix_side.spec) if method == "suffix" else TreeSpec(),
                SamplingParams(),
                0,
                suffix=suffix,
            )
            for i, (p, (method, suffix)) in enumerate(jobs)
        ]
        results = [f.result(timeout=120) for f in futures]
    finally:
        loop.close()
    base = TargetEngine(tiny_target, ())
    for (p, kind), r in zip(jobs, results):
        assert r.token_ids == generate(base, p, max_new_tokens=40).token_ids, kind
    alone = [r for (_, kind), r in zip(jobs, results) if kind[0] == "suffix"]
    assert all(sum(x.tree_nodes for x in r.rounds) > 0 and not r.drafter_reseeds for r in alone)
    assert not any(r.drafter_fallback for r in results)
    assert not loop.suffix_side.indexes and not loop.suffix_side.alone
    stats = loop.suffix_side.stats()
    assert (stats["requests"], stats["history_tokens"], stats["index_entries"]) == (0, 0, 0)
    assert stats["shared"]["answers"] == len(jobs)  # every answer kept for later requests' matches
    assert not target.sessions and not drafter.session_method


def test_a_later_request_drafts_from_an_earlier_answer_and_an_opted_out_answer_is_never_kept(tiny_target, workers):
    """The loop keeps finished answers (SharedSuffixCache): a suffix request asking what an earlier one
    asked copies its answer (every answer target-only's, in fewer rounds, its trees from the shared
    cache); an answer of a request with learn: false is not kept."""
    from eyas.step import suffix_tree_spec

    target, drafter = workers
    loop = local_loop(target, drafter, drafter.info(), PromptLengthPolicy())
    prompt, tree = prompts(1)[0], suffix_tree_spec(loop.suffix_side.spec)

    def ask(rid, learn=True, p=prompt):
        return loop.submit(rid, p, 40, "suffix", tree, SamplingParams(), 0, learn=learn).result(timeout=120)

    try:
        first = ask("first")
        second = ask("second")
        kept = loop.suffix_side.stats()
        ask("private", learn=False, p=prompts(2)[1])
        after = loop.suffix_side.stats()
    finally:
        loop.close()
    base = generate(TargetEngine(tiny_target, ()), prompt, max_new_tokens=40).token_ids
    assert first.token_ids == second.token_ids == base
    assert len(second.rounds) < len(first.rounds) and kept["trees_from"]["shared"] > 0
    assert kept["shared"]["answers"] == 2 and after["shared"] == kept["shared"]


class LateDrafter:
    """A DrafterWorker whose first ``open_session`` of each request times out and still runs ``delay_s``
    later, after calls made in the meantime (a Serve replica runs its calls concurrently: a later close
    can take the worker's lock first), as a handle's call does when it outlives its timeout (the call
    is not withdrawn). Until the late opens have run it answers no probe (``info``): it is stalled."""

    def __init__(self, worker: DrafterWorker, delay_s: float):
        self.worker, self.delay_s, self.late, self.pending = worker, delay_s, set(), 0

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def info(self):
        if self.pending:
            raise DrafterUnavailable("drafter: TimeoutError (test)")
        return self.worker.info()

    def open_session(self, request_id, *args):
        if request_id in self.late:
            return self.worker.open_session(request_id, *args)
        self.late.add(request_id)
        self.pending += 1

        def later():
            time.sleep(self.delay_s)
            try:
                self.worker.open_session(request_id, *args)
            except ValueError:
                pass  # a session of that id is live already (a reseed opened one): refused
            finally:
                self.pending -= 1

        threading.Thread(target=later, daemon=True).start()
        raise DrafterUnavailable("drafter: TimeoutError (test)")


def test_a_drafter_call_that_times_out_and_runs_after_its_request_finished_leaves_no_session(
    tiny_target, workers, monkeypatch
):
    """Each request's draft session opens late: its open times out, the loop goes plain and the answers
    finish before the late opens run. The loop closes each such request's session again later
    (``LATE_CLOSE_S``), so the drafter holds none; no token changes."""
    from eyas.serve import round_loop

    monkeypatch.setattr(round_loop, "DRAFTER_PROBE_S", 5.0)  # the drafter stays down for the whole answer
    monkeypatch.setattr(round_loop, "LATE_CLOSE_S", (0.3, 1.5))
    target, drafter = workers
    late = LateDrafter(drafter, delay_s=0.8)
    loop = local_loop(target, late, drafter.info(), PromptLengthPolicy())
    jobs = [(p, "eagle1") for p in prompts(3)]
    results = run_all(loop, jobs, n=8)
    assert_target_only_output(tiny_target, jobs, results, 8)
    assert late.late == {f"r{i}" for i in range(3)}
    deadline = time.monotonic() + 5
    while late.pending and time.monotonic() < deadline:  # the late opens run (0.8 s after they timed out)
        time.sleep(0.05)
    assert not late.pending
    while drafter.session_method and time.monotonic() < deadline:  # and the loop's late closes
        time.sleep(0.05)
    assert not drafter.session_method and not target.sessions


class RefusingReopenDrafter(DownDrafter):
    """A DownDrafter whose first reopen of each request after it comes back is refused (``ValueError``,
    as when a late open of that request took the worker's lock between the reseed's close and open)."""

    def __init__(self, worker: DrafterWorker, down_at: int, probes_down: int):
        super().__init__(worker, down_at, probes_down)
        self.opens, self.refused = {}, set()

    def open_session(self, request_id, *args):
        self.opens[request_id] = self.opens.get(request_id, 0) + 1
        if not self.down and self.opens[request_id] == 2 and request_id not in self.refused:
            self.refused.add(request_id)
            raise ValueError(f"request_id: {request_id!r} already has a live draft session")
        return self.__getattr__("open_session")(request_id, *args)


def test_a_refused_reseed_is_retried_and_fails_nobody(tiny_target, workers, monkeypatch):
    """A reseed whose open the drafter refuses leaves its request to reseed again next round (counted
    by the reseed rule); the round goes on, no request fails and no token changes."""
    target, drafter = workers
    refusing = RefusingReopenDrafter(drafter, down_at=3, probes_down=2)
    loop = drafter_down_loop(monkeypatch, target, drafter, refusing)
    jobs = [(p, "eagle1") for p in prompts(3)]
    results = run_all(loop, jobs, n=40)
    assert_target_only_output(tiny_target, jobs, results, 40)
    assert refusing.refused and all(r.finish_reason in ("length", "stop") for r in results)
    assert any(r.drafter_reseeds >= 2 for r in results)
    assert not target.sessions and not drafter.session_method
