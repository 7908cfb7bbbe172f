"""The capacity-planning simulator (eyas.experiments.sim): queueing theory, hand-computed rounds,
batching, autoscaling with drains, and speed.

Units: times in seconds unless a name says ``_ms``; lengths in tokens; rates per second.
"""

from __future__ import annotations

import math

import pytest

from eyas.experiments.sim import (
    Arrivals,
    Autoscaling,
    ClusterModel,
    Curve,
    ReplicaModel,
    ScalingState,
    Workload,
    percentile,
    simulate,
)

MS = 1e-3  # seconds per millisecond


# ------------------------------------------------------------------------------------------ curve


def test_curve_interpolates_clamps_and_extrapolates_never_decreasing():
    """Knots {1: 10, 5: 30} ms: 3 rows -> 20 ms (midway), 0 rows -> 10 (clamped to the first knot),
    9 rows -> 30 + 4 * 5 = 50 (last slope, 5 ms/row). A falling last segment extrapolates flat."""
    c = Curve.from_points({5: 30.0, 1: 10.0})  # order of the dict does not matter
    assert c(3) == pytest.approx(20.0)
    assert c(0) == 10.0 and c(1) == 10.0 and c(5) == 30.0
    assert c(9) == pytest.approx(50.0)
    falling = Curve.from_points({1: 10.0, 2: 8.0})
    assert falling(100) == 8.0
    assert Curve.from_points({4: 7.0})(1000) == 7.0
    assert Curve.zero()(123) == 0.0
    with pytest.raises(ValueError):
        Curve.from_points({})
    with pytest.raises(ValueError):
        Curve((2.0, 1.0), (1.0, 1.0))


def test_percentile_matches_linear_interpolation():
    """[1, 2, 3, 4]: p50 = 2.5 (midway between the 2nd and 3rd), p100 = 4, p0 = 1."""
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile([4, 1, 3, 2], 0) == 1
    assert math.isnan(percentile([], 50))


# ---------------------------------------------------------------------------------- M/D/1 check

MD1_SERVICE_MS = 100.0  # S: one round of one row, the whole service of a 1-token request
MD1_REQUESTS = 20_000
MD1_WQ_REL_TOL = 0.10  # |Wq_sim - Wq_PK| / Wq_PK
MD1_UTIL_ABS_TOL = 0.02  # |utilisation - rho|


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_md1_waiting_time_matches_pollaczek_khinchine(rho):
    """One replica, max_batch 1, tau 1, 1-token outputs: each request is one 100 ms round, so the pool
    is an M/D/1 queue with S = 0.1 s and lambda = rho / S. Pollaczek-Khinchine for deterministic
    service: Wq = rho * S / (2 * (1 - rho)), e.g. rho 0.5 -> 0.05 s, rho 0.8 -> 0.2 s.

    Simulated Wq = mean(latency) - S over 20,000 Poisson arrivals (seed 1). Tolerance: 10 % relative
    on Wq, 0.02 absolute on utilisation (busy / serving time) against rho. Measured at seed 1:
    Wq error +1.6 % (rho 0.5) and -1.5 % (rho 0.8); utilisation 0.4986 and 0.7977.
    """
    s = MD1_SERVICE_MS * MS
    model = ReplicaModel(Curve.from_points({1: MD1_SERVICE_MS}), tokens_per_round=1.0, rows_per_request=1, max_batch=1)
    work = Workload(Arrivals.poisson(rho / s, count=MD1_REQUESTS), output_len=1, prompt_len=1)
    r = simulate(work, model, seed=1, sample_interval_s=100.0)

    assert r.unfinished == 0 and len(r.latencies_s) == MD1_REQUESTS
    assert min(r.latencies_s) == pytest.approx(s)  # nobody is served faster than S
    wq = sum(lat - s for lat in r.latencies_s) / len(r.latencies_s)
    wq_pk = rho * s / (2 * (1 - rho))
    assert abs(wq - wq_pk) / wq_pk < MD1_WQ_REL_TOL, (wq, wq_pk)
    assert abs(r.mean_utilisation - rho) < MD1_UTIL_ABS_TOL
    assert r.ttft_s == r.latencies_s  # one round: the first token is the last


# ------------------------------------------------------------------------------- hand-computed

ROUND_MS = 100.0


@pytest.mark.parametrize(
    "curve, first_tokens, finishes",
    [
        # flat 100 ms rounds: A, B run [0, .1], [.1, .2]; C waits for a free slot, runs [.2, .3], [.3, .4]
        ({1: ROUND_MS, 2: ROUND_MS}, (0.1, 0.1, 0.3), (0.2, 0.2, 0.4)),
        # 2 rows cost 150 ms: A, B run [0, .15], [.15, .3]; C alone runs [.3, .4], [.4, .5]
        ({1: ROUND_MS, 2: 150.0}, (0.15, 0.15, 0.4), (0.3, 0.3, 0.5)),
    ],
)
def test_three_requests_two_rounds_each_by_hand(curve, first_tokens, finishes):
    """3 requests at t=0, one replica, max_batch 2, tau 1 and 2-token outputs (so 2 rounds each).
    Requests 0 and 1 fill the batch; request 2 joins at the first round boundary with a free slot,
    i.e. after 0 and 1 finish (continuous batching). Flat 100 ms rounds give TTFT (0.1, 0.1, 0.3),
    finish (0.2, 0.2, 0.4), throughput 6 tokens / 0.4 s = 15 tokens/s; the replica is busy the whole time.
    """
    model = ReplicaModel(Curve.from_points(curve), tokens_per_round=1.0, rows_per_request=1, max_batch=2)
    r = simulate(Workload(Arrivals.explicit([0.0, 0.0, 0.0]), output_len=2, prompt_len=4), model)

    assert [q.rounds for q in r.requests] == [2, 2, 2]
    assert [q.first_token_s for q in r.requests] == pytest.approx(first_tokens)
    assert [q.finish_s for q in r.requests] == pytest.approx(finishes)
    assert r.ttft_s == pytest.approx(first_tokens)
    assert r.latencies_s == pytest.approx(finishes)  # all arrived at 0
    assert r.total_tokens == 6
    assert r.throughput_tokens_per_s == pytest.approx(6 / finishes[-1])
    assert r.mean_utilisation == pytest.approx(1.0)
    assert r.busy_replica_seconds == pytest.approx(finishes[-1])
    assert r.timeline[0].running == 2 and r.timeline[0].queued == 1  # t=0, after the first round started


def test_round_time_adds_drafter_and_verify_and_prefill_rows():
    """One request, tau 3, 10 tokens -> ceil(10 / 3) = 4 rounds (3 + 3 + 3 + 1 tokens).
    A 16-node tree: 17 verify rows, 16 draft rows. verify {1: 10, 33: 30} ms -> verify(17) = 20 ms;
    draft {0: 1, 16: 5} ms -> draft(16) = 5 ms; a round is 25 ms: TTFT 25 ms, latency 100 ms.
    With prefill 0.5 rows per prompt token and a 32-token prompt the first round verifies
    17 + 16 = 33 rows (30 ms), so it takes 35 ms: TTFT 35 ms, latency 35 + 3 * 25 = 110 ms.
    """
    base = dict(
        verify_ms=Curve.from_points({1: 10.0, 33: 30.0}),
        tokens_per_round=3.0,
        rows_per_request=17,
        draft_ms=Curve.from_points({0: 1.0, 16: 5.0}),
        draft_rows_per_request=16,
        max_batch=4,
    )
    work = Workload(Arrivals.explicit([1.0]), output_len=10, prompt_len=32)

    r = simulate(work, ReplicaModel(**base))
    assert r.requests[0].rounds == 4
    assert r.ttft_s[0] == pytest.approx(25 * MS)
    assert r.latencies_s[0] == pytest.approx(100 * MS)

    r = simulate(work, ReplicaModel(**base, prefill_rows_per_prompt_token=0.5))
    assert r.ttft_s[0] == pytest.approx(35 * MS)
    assert r.latencies_s[0] == pytest.approx(110 * MS)


# -------------------------------------------------------------------------------------- batching

FLAT_CURVE = {1: 100.0, 64: 101.0}  # rows cost almost nothing: a round is ~100 ms at any batch
BATCH_OUTPUT_LEN = 10  # tokens, tau 1 -> 10 rounds, ~1 s per request
BATCH_RATE = 50.0  # requests/s, far above one request/s
BATCH_REQUESTS = 200


def test_batching_multiplies_throughput_under_a_flat_latency_curve():
    """200 requests at 50/s, 10 rounds of ~100 ms each. max_batch 1 serves one request per second:
    10 tokens/s (2,000 tokens; the last finishes at 200 s, the first arrived at 0). max_batch 32
    serves up to 32 at once: at most 32 * 1 token / 0.1 s = 320 tokens/s (a bit less: 101 ms rounds
    when full). Expect > 10x the throughput of max_batch 1, below that bound.
    """
    work = Workload(Arrivals.deterministic(BATCH_RATE, count=BATCH_REQUESTS), output_len=BATCH_OUTPUT_LEN, prompt_len=8)

    def throughput(max_batch):
        model = ReplicaModel(Curve.from_points(FLAT_CURVE), tokens_per_round=1.0, max_batch=max_batch)
        r = simulate(work, model, sample_interval_s=10.0)
        assert r.unfinished == 0 and r.total_tokens == BATCH_REQUESTS * BATCH_OUTPUT_LEN
        return r.throughput_tokens_per_s

    one, many = throughput(1), throughput(32)
    assert one == pytest.approx(10.0, rel=0.01)
    assert 10 * one < many <= 32 / (FLAT_CURVE[1] * MS)


# ----------------------------------------------------------------------------------- autoscaling

MIN_REPLICAS, MAX_REPLICAS = 1, 8
QUEUE_PER_REPLICA = 10
CONTROL_S = 1.0
STARTUP_S = 3.0
BURST_RATE, BURST_S = 40.0, 20.0  # requests/s for 20 s; one replica serves ~4/s (max_batch 4, 1 s each)
WATCH_UNTIL_S = 120.0  # keep simulating after the burst to watch the scale-down
NODE_SIZE = 4
PRICE_PER_REPLICA_HOUR = 2.0


def queue_policy(state: ScalingState) -> int:
    """ceil(queued / 10) replicas, bounded to 1..8."""
    return min(MAX_REPLICAS, max(MIN_REPLICAS, math.ceil(state.queued / QUEUE_PER_REPLICA)))


def test_autoscaling_grows_for_a_burst_then_drains_without_dropping_requests():
    """A 20 s burst at 40 req/s against replicas that serve ~4 req/s each (tau 1, 10-token outputs,
    100 ms rounds, max_batch 4). The policy asks for ceil(queue / 10) replicas (1..8) every second;
    new replicas serve 3 s after launch, so until the first tick (1 s) + 3 s only the first replica
    serves. The queue drives the pool to 8 replicas; after the burst it shrinks back to 1 through
    drains: a draining replica is alive only while it still has requests, and every request finishes.
    Billed replica-seconds agree with the 1 s timeline's Riemann sum within 3 %.
    """
    model = ReplicaModel(Curve.from_points(FLAT_CURVE), tokens_per_round=1.0, max_batch=4)
    work = Workload(Arrivals.poisson(BURST_RATE, duration_s=BURST_S), output_len=BATCH_OUTPUT_LEN, prompt_len=16)
    cluster = ClusterModel(
        replicas=MIN_REPLICAS,
        node_size=NODE_SIZE,
        cost_per_replica_hour=PRICE_PER_REPLICA_HOUR,
        autoscaling=Autoscaling(queue_policy, control_interval_s=CONTROL_S, startup_delay_s=STARTUP_S),
    )
    r = simulate(
        work, model, cluster, seed=3, sample_interval_s=CONTROL_S, until_s=WATCH_UNTIL_S, horizon_s=WATCH_UNTIL_S
    )  # a hard stop: requests left unfinished would show below
    fixed = simulate(work, model, ClusterModel(replicas=MIN_REPLICAS), seed=3)

    # no request dropped: all finished, none faster than its rounds allow
    assert len(r.requests) == len(fixed.requests) > BURST_RATE * BURST_S / 2
    assert r.unfinished == 0
    assert all(q.finish_s >= q.arrival_s + q.rounds * FLAT_CURVE[1] * MS - 1e-9 for q in r.requests)
    assert len({q.replica for q in r.requests}) > MIN_REPLICAS

    tl = r.timeline
    assert all(p.ready == MIN_REPLICAS for p in tl if p.time_s < CONTROL_S + STARTUP_S)  # startup delay
    assert any(p.ready > MIN_REPLICAS for p in tl if p.time_s <= CONTROL_S + STARTUP_S + CONTROL_S)
    assert r.peak_replicas == MAX_REPLICAS and all(p.replicas <= MAX_REPLICAS for p in tl)
    assert any(p.draining > 0 for p in tl)  # drained with requests still live
    assert tl[-1].time_s == WATCH_UNTIL_S and r.end_s == WATCH_UNTIL_S
    assert tl[-1].replicas == MIN_REPLICAS and tl[-1].running == 0 and tl[-1].queued == 0
    assert all(p.nodes == math.ceil(p.replicas / NODE_SIZE) for p in tl)
    assert r.peak_nodes == MAX_REPLICAS // NODE_SIZE

    riemann = sum(p.replicas * CONTROL_S for p in tl[:-1])  # left sum over [0, 120)
    assert r.replica_seconds == pytest.approx(riemann, rel=0.03)
    assert r.cost == pytest.approx(r.replica_seconds / 3600 * PRICE_PER_REPLICA_HOUR)
    assert 0 < r.busy_replica_seconds <= r.serving_replica_seconds <= r.replica_seconds

    # and it helps: the fixed single replica takes ~5x longer to clear the burst
    assert r.p99_latency_s < fixed.p99_latency_s / 2
    assert r.makespan_s < fixed.makespan_s / 2


def test_scale_to_zero_queues_until_a_replica_is_ready():
    """No replica at first; the policy asks for one at the first tick (1 s) and it serves 3 s later,
    so 3 requests that arrived at 0.5..0.7 s wait in the pool queue until 4 s, then share the new
    replica's first 100 ms round (max_batch 4): all finish at 4.1 s."""
    model = ReplicaModel(Curve.from_points({1: ROUND_MS, 4: ROUND_MS}), max_batch=4)
    cluster = ClusterModel(
        replicas=0, autoscaling=Autoscaling(lambda s: 1, control_interval_s=CONTROL_S, startup_delay_s=STARTUP_S)
    )
    r = simulate(Workload(Arrivals.explicit([0.5, 0.6, 0.7]), output_len=1, prompt_len=1), model, cluster)
    assert [q.finish_s for q in r.requests] == pytest.approx([CONTROL_S + STARTUP_S + ROUND_MS * MS] * 3)
    at_1s = r.timeline[1]  # after the first tick: the requests wait in the pool queue, one replica starts
    assert (at_1s.time_s, at_1s.queued, at_1s.starting, at_1s.ready) == (CONTROL_S, 3, 1, 0)


# ---------------------------------------------------------------------------- workload, seeding


def test_output_lengths_follow_the_given_distribution_and_the_seed():
    """Lengths 10 (p 0.25) and 30 (p 0.75) over 4,000 requests: the share of 10s is 0.25 within 0.03
    (about 4 standard errors). Rounds at tau 3: ceil(10/3) = 4 and ceil(30/3) = 10. The same seed
    reproduces every time exactly; another seed changes them."""
    model = ReplicaModel(Curve.from_points({1: 10.0, 64: 20.0}), tokens_per_round=3.0, max_batch=16)
    work = Workload(Arrivals.poisson(50.0, count=4000), output_len=((10, 0.25), (30, 0.75)), prompt_len=8)
    a, b, c = (simulate(work, model, seed=s) for s in (7, 7, 8))
    share = sum(q.output_len == 10 for q in a.requests) / len(a.requests)
    assert abs(share - 0.25) < 0.03
    assert {(q.output_len, q.rounds) for q in a.requests} == {(10, 4), (30, 10)}
    assert a.latencies_s == b.latencies_s and a.timeline == b.timeline
    assert a.latencies_s != c.latencies_s


def test_invalid_inputs_are_rejected():
    with pytest.raises(ValueError):
        ReplicaModel(Curve.from_points({1: 1.0}), tokens_per_round=0.5)  # tau counts the bonus token
    with pytest.raises(ValueError):
        Arrivals.poisson(10.0)  # neither duration nor count
    with pytest.raises(ValueError):
        Workload(Arrivals.explicit([0.0]), output_len=0)
    with pytest.raises(ValueError):
        ClusterModel(replicas=0)  # would never serve


# ------------------------------------------------------------------------------------------ speed

SPEED_RATE = 1000.0  # requests/s
SPEED_S = 30.0  # simulated seconds of arrivals
SPEED_REPLICAS = 160  # ~98 % utilised at this load


def test_thousand_requests_per_second_for_30_s_on_160_replicas():
    """~30,000 requests (mean output 160 tokens, tau 3, 16-node trees, max_batch 32) on 160 replicas
    (a few seconds of wall time; no wall-clock assertion, tests assert behaviour). In the steady state (10..30 s) the pool emits what arrives:
    1000 req/s * 160 tokens = 160,000 tokens/s, within 5 %."""
    model = ReplicaModel(
        Curve.from_points({1: 20.0, 64: 25.0, 256: 40.0, 1024: 120.0}),
        tokens_per_round=3.0,
        rows_per_request=17,
        max_batch=32,
        draft_ms=Curve.from_points({1: 2.0, 512: 6.0}),
        draft_rows_per_request=16,
    )
    lengths = ((64, 0.5), (256, 0.5))
    work = Workload(Arrivals.poisson(SPEED_RATE, duration_s=SPEED_S), output_len=lengths, prompt_len=128)
    r = simulate(work, model, ClusterModel(replicas=SPEED_REPLICAS, node_size=8), seed=0)
    assert r.unfinished == 0 and abs(len(r.requests) - SPEED_RATE * SPEED_S) < 5 * math.sqrt(SPEED_RATE * SPEED_S)
    steady = [p.tokens_per_s for p in r.timeline if 10 <= p.time_s <= SPEED_S]
    offered = SPEED_RATE * sum(n * p for n, p in lengths)
    assert sum(steady) / len(steady) == pytest.approx(offered, rel=0.05)
    assert 0 < r.mean_utilisation <= 1


MANY_REPLICAS = 5000


def test_thousands_of_replicas_rebuild_the_routing_table_once_per_control_tick(monkeypatch):
    """A policy that asks for 5,000 replicas at the first tick (1 s), then for 1 from 6 s on.

    Starting, readying and stopping a replica are O(1); only a resize (once per control tick) rebuilds
    the routing table. Before this, every replica that became ready or stopped rebuilt it over all
    alive replicas: O(N^2) in the replicas launched, which made `eyas experiment autoscale`'s plan at
    100 req/s with 1 verify row per replica (~50,000 replicas) run for tens of minutes.
    Worked example: ticks at 1..12 s; 5,000 replicas launched at 1 s are ready at 4 s (3 s start-up);
    the tick at 6 s stops the 4,999 idle newest ones at once; 12 s of ticks = 12 rebuilds at most.
    """
    from eyas.experiments import sim

    rebuilds = []
    real = sim._Sim.set_active
    monkeypatch.setattr(sim._Sim, "set_active", lambda self: (rebuilds.append(1), real(self))[1])
    model = ReplicaModel(Curve.from_points({1: ROUND_MS}), max_batch=4)
    policy = lambda s: MANY_REPLICAS if s.time_s < 6 else 1  # noqa: E731
    cluster = ClusterModel(
        replicas=1, autoscaling=Autoscaling(policy, control_interval_s=CONTROL_S, startup_delay_s=STARTUP_S)
    )
    work = Workload(Arrivals.explicit([0.5 * i for i in range(20)]), output_len=4, prompt_len=4)
    r = simulate(work, model, cluster, until_s=12.0)
    ready = {p.time_s: p.ready for p in r.timeline}
    assert r.peak_replicas == MANY_REPLICAS and ready[5.0] == MANY_REPLICAS and r.timeline[-1].replicas == 1
    assert r.unfinished == 0
    assert len(rebuilds) <= 12, len(rebuilds)


def test_replicas_on_a_shared_host_slow_each_other_down():
    """Worked example: two replicas, one 1-round request each at t=0, 100 ms rounds, ``host_replicas=1``.

    Replica 0 starts its round first (1 busy: 100 ms, done at 0.1 s); replica 1 starts while 2 are busy:
    2 x 100 ms, done at 0.2 s. With hardware of their own both finish at 0.1 s.
    """
    from eyas.experiments.sim import Arrivals, ClusterModel, Curve, ReplicaModel, Workload, simulate

    work = Workload(Arrivals.explicit([0.0, 0.0]), output_len=1, prompt_len=1)
    own = simulate(work, ReplicaModel(Curve.from_points({1: 100.0})), ClusterModel(replicas=2))
    shared = simulate(work, ReplicaModel(Curve.from_points({1: 100.0}), host_replicas=1), ClusterModel(replicas=2))
    assert sorted(r.finish_s for r in own.requests) == pytest.approx([0.1, 0.1])
    assert sorted(r.finish_s for r in shared.requests) == pytest.approx([0.1, 0.2])
