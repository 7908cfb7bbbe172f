"""The autoscaling experiment's pure parts: node typing, replica start-up, the calibrated simulator,
and the cluster configs (validated against Ray's own cluster schema)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from eyas.autoscale.policy import TargetScalingConfig
from eyas.experiments.experiment import Calibration, count_nodes, plan, predict, replica_startup_s
from eyas.experiments.workload import Arrival

CONFIGS = Path(__file__).resolve().parents[2] / "ray_configs"


def test_nodes_are_typed_by_the_custom_resource_they_offer_and_dead_ones_do_not_count():
    """Worked example: head {CPU: 2}; a live and a dead target_host node -> head 1, target_host 1, drafter_host 0."""
    nodes = [
        {"Alive": True, "Resources": {"CPU": 2.0}},
        {"Alive": True, "Resources": {"CPU": 1.0, "target_host": 1.0}},
        {"Alive": False, "Resources": {"CPU": 1.0, "target_host": 1.0}},
    ]
    assert count_nodes(nodes, ["target_host", "drafter_host"]) == {"head": 1, "target_host": 1, "drafter_host": 0}


def test_replica_startup_runs_from_asked_for_to_running():
    """Asked for at t=1 (running + starting rises to 2), running at t=6 -> 5 s; never added -> None."""
    assert replica_startup_s([(0, 1, 0), (1, 1, 1), (5, 1, 1), (6, 2, 0)]) == 5.0
    assert replica_startup_s([(0, 1, 0), (1, 1, 0)]) is None
    assert replica_startup_s([(0, 1, 0), (1, 1, 1), (2, 1, 0)]) is None  # cancelled before it ran


CAL = Calibration(
    verify_ms={1: 40.0, 64: 120.0},
    tokens_per_round=1.5,
    rows_per_request=4.0,
    draft_ms_per_round=10.0,
    hop_ms_per_round=5.0,
    prompt_len=30.0,
    startup_s=20.0,
)


def test_the_calibrated_simulator_scales_up_for_a_burst_and_back_down_after_it():
    policy = TargetScalingConfig(
        min_replicas=1, max_replicas=4, target_verify_rows_per_replica=20, upscale_delay_s=1, downscale_delay_s=5
    )
    burst = [Arrival(10 + i * 0.1, "k", "p", 20, 1) for i in range(200)]  # 10 req/s for 20 s
    r = predict(burst, CAL, policy, max_batch=8, initial_replicas=1, until_s=120)
    assert r.unfinished == 0 and r.peak_replicas > 1
    assert r.timeline[-1].replicas == 1  # idle at the end: back to min_replicas


def test_planning_far_above_this_machine_gives_replicas_in_proportion_to_the_rate():
    policy = TargetScalingConfig(min_replicas=1, target_verify_rows_per_replica=20, upscale_delay_s=1)
    low, high = plan(CAL, policy, max_batch=8, rates=[100, 1000], duration_s=20, output_len=20)
    assert high["peak_replicas"] > 5 * low["peak_replicas"] and low["peak_nodes"] >= low["peak_replicas"]
    assert low["unfinished"] == 0 and high["unfinished"] == 0


def test_the_plan_starts_at_a_replica_count_that_keeps_up_with_the_rate():
    """At 100 req/s, with a policy that never asks for more (1,000 pending rows per replica), the
    plan's latency does not grow with how long it runs: its starting count, from the simulated
    capacity of one saturated replica (prefill rows included), keeps up. Measured: p99 1.91 s after
    10 s and 1.94 s after 40 s (21 replicas). The old start, from a full batch's round time alone,
    fell behind: 16 replicas, p99 4.15 s after 10 s and 9.8 s after 40 s."""
    policy = TargetScalingConfig(min_replicas=1, target_verify_rows_per_replica=1000, upscale_delay_s=1)
    short, long_ = (plan(CAL, policy, max_batch=8, rates=[100], duration_s=d, output_len=20)[0] for d in (10, 40))
    assert short["peak_replicas"] == long_["peak_replicas"]
    assert long_["p99_latency_s"] < 1.2 * short["p99_latency_s"], (short, long_)


@pytest.mark.parametrize("name", ["cluster.yaml", "fake_cluster.yaml"])
def test_the_cluster_configs_pass_rays_cluster_schema(name):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((CONFIGS / name).read_text())
    # `ray up` fills the provider's defaults in, then checks; the wheel lacks the fake provider's defaults
    # file, and fake_cluster.yaml spells every field out, so it is checked as it is
    validate_config(config if config["provider"]["type"] == "fake_multinode" else prepare_config(config))
    types = config["available_node_types"]
    assert {"target_host", "drafter_host"} <= {r for t in types.values() for r in t["resources"]}


def test_the_autoscale_app_config_is_valid_and_asks_for_those_node_types():
    from ray.serve.config import AutoscalingConfig

    from eyas.autoscale.serve_policy import DrafterTreeWorkPolicy, TargetTreeWorkPolicy
    from eyas.serve.config import parse_config
    from eyas.serve.serve_file import read_serve_file

    cfg = parse_config(read_serve_file(CONFIGS / "autoscale.yaml").args)
    assert cfg.target_resources == {"target_host": 1} and cfg.drafter_resources == {"drafter_host": 1}
    for auto, cls in ((cfg.target_autoscaling, TargetTreeWorkPolicy), (cfg.drafter_autoscaling, DrafterTreeWorkPolicy)):
        AutoscalingConfig(**auto)
        cls(**auto["policy"]["policy_kwargs"])  # the knobs are valid for the policy
        assert auto["policy"]["policy_function"].endswith(cls.__name__)


# ---- fitted on the calibration only --------------------------------------------------------------------


def test_the_cost_scale_fitted_on_a_calibration_repeat_reproduces_its_makespan_and_grows_with_it():
    """A repeat of 32 requests, 16 in flight: the fitted factor makes one simulated replica answer them
    in the measured makespan; a makespan twice as long fits a larger factor (about twice)."""
    from eyas.experiments.experiment import CapacityRun, fit_on_capacity_run

    def run(makespan):
        return CapacityRun(32, 16, makespan, (20,) * 32, 1.0, 2.0, 100.0, 0, 0)

    fast, slow = fit_on_capacity_run(CAL, run(8.0), max_batch=16), fit_on_capacity_run(CAL, run(16.0), max_batch=16)
    one = TargetScalingConfig(min_replicas=1, max_replicas=1)
    again = predict(
        [Arrival(0.0, "k", "", 20, 0)] * 32,
        Calibration(**{**CAL.__dict__, "cost_scale": fast}),
        one,
        max_batch=16,
        initial_replicas=1,
        until_s=0.0,
    )
    assert abs(again.makespan_s - 8.0) < 0.05 and 1.7 < slow / fast < 2.3
    assert run(8.0).capacity_per_s == 4.0


def test_serves_window_and_report_lag_delay_the_simulated_scale_up():
    """The policy sees Serve's look-back average, a report interval late: the simulated replica is
    asked for later than with instantaneous reports, never earlier."""
    from eyas.experiments.experiment import PolicyTiming

    policy = TargetScalingConfig(min_replicas=1, max_replicas=4, target_verify_rows_per_replica=20, upscale_delay_s=1)
    burst = [Arrival(10 + i * 0.1, "k", "p", 20, 1) for i in range(200)]

    def first_start(timing):
        r = predict(burst, CAL, policy, max_batch=8, initial_replicas=1, until_s=60, timing=timing)
        return next(p.time_s for p in r.timeline if p.starting > 0)

    now = first_start(PolicyTiming(control_s=0.5))
    late = first_start(PolicyTiming(look_back_s=3.0, lag_s=1.0, control_s=0.5))
    assert 10 < now < late <= now + 4.5, (now, late)
    assert PolicyTiming.of({"look_back_period_s": 3, "metrics_interval_s": 1}) == PolicyTiming(3.0, 1.0, 0.5)


def test_on_a_shared_host_a_loading_replica_slows_the_serving_ones():
    """Fake cluster: every node is a process on one machine, so a replica loading its model takes a
    share of the cores the serving replica computes on. One replica, a second starting for 20 s: the
    first's rounds run at half speed while it loads (host of 1 round at once), not with a host each."""
    from eyas.experiments import sim

    model = dict(verify_ms=sim.Curve.from_points({1: 100.0}), max_batch=1)
    steady = sim.Workload(sim.Arrivals.explicit([0.0] * 20), output_len=10, prompt_len=1)
    two_at_five = sim.Autoscaling(lambda s: 2 if s.time_s >= 5 else 1, control_interval_s=1.0, startup_delay_s=20.0)
    cluster = sim.ClusterModel(replicas=1, autoscaling=two_at_five)
    own = sim.simulate(steady, sim.ReplicaModel(**model, host_replicas=1.0), cluster)
    shared = sim.simulate(steady, sim.ReplicaModel(**model, host_replicas=1.0, load_share=1.0), cluster)
    assert shared.makespan_s > own.makespan_s + 5.0, (own.makespan_s, shared.makespan_s)


def test_the_calibration_pins_the_autoscaled_deployments():
    from eyas.experiments.experiment import pinned_args
    from eyas.serve.serve_file import read_serve_file

    args = read_serve_file(CONFIGS / "autoscale.yaml").args
    pinned = pinned_args(args)
    for kind in ("target", "drafter"):
        a = pinned[f"{kind}_autoscaling"]
        assert a["min_replicas"] == a["max_replicas"] == a["initial_replicas"] == 1
        assert a["policy"]["policy_kwargs"]["max_replicas"] == 1
    two = pinned_args(args, target_replicas=2)["target_autoscaling"]
    assert two["min_replicas"] == two["max_replicas"] == 2
    assert args["target_autoscaling"]["max_replicas"] == 3, "the caller's args are left as they were"


def test_max_target_replicas_moves_serves_bound_and_the_policys_together_and_refuses_what_cannot_be():
    from eyas.experiments.experiment import with_max_target_replicas
    from eyas.serve.serve_file import read_serve_file

    args = read_serve_file(CONFIGS / "autoscale.yaml").args
    five = with_max_target_replicas(args, 5)["target_autoscaling"]
    assert five["max_replicas"] == five["policy"]["policy_kwargs"]["max_replicas"] == 5
    fake = yaml.safe_load((CONFIGS / "fake_cluster.yaml").read_text())
    assert fake["available_node_types"]["target_host"]["max_workers"] >= 5, "room for 5 target hosts"
    with pytest.raises(ValueError, match="--max-target-replicas: 0 is below"):
        with_max_target_replicas(args, 0)
    with pytest.raises(ValueError, match="no autoscaling_config"):
        with_max_target_replicas({"target_autoscaling": None}, 4)
