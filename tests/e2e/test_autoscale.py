"""End to end on Ray's fake multi-node cluster: a burst adds a node and a target replica, idle removes them.

``eyas experiment autoscale`` runs in a subprocess, as a user runs it: it starts the fake cluster of
ray_configs/fake_cluster.yaml (each node another raylet on this machine; target replicas need a
``target_host`` node), deploys ray_configs/autoscale.yaml pinned at one replica and measures its
capacity, releases the autoscaler, replays tests/e2e/workloads/tiny_burst.yaml (its rates multiples of
that capacity, so the burst overloads one replica on a slow machine and a fast one alike) and checks
every answer against in-process greedy target-only decoding. It runs first in tests/e2e (no other
Ray may run beside it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real_model
def test_a_burst_adds_a_node_and_a_target_replica_and_idle_removes_them(tmp_path):
    serve = yaml.safe_load((ROOT / "ray_configs/autoscale.yaml").read_text())
    args = serve["applications"][0]["args"]
    kwargs = args["target_autoscaling"]["policy"]["policy_kwargs"]
    # 64 pending verify rows a replica (the shipped 256 is half of what one carries at capacity with 16
    # in flight; this calibration keeps 4 in flight): the burst, 1.5x the measured capacity, grows a
    # queue on any machine. At most 2 replicas; quick delays to keep the test short.
    kwargs.update(target_verify_rows_per_replica=64, max_replicas=2, upscale_delay_s=1, downscale_delay_s=10)
    args["target_autoscaling"]["max_replicas"] = 2
    config = tmp_path / "serve.yaml"
    config.write_text(yaml.safe_dump(serve))
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "eyas.cli",
            "experiment",
            "autoscale",
            "--workload",
            str(ROOT / "tests/e2e/workloads/tiny_burst.yaml"),
            "--serve-config",
            str(config),
            "--out",
            str(out),
            "--plan-rates",
            "100",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    doc = json.loads((out / "timeline.json").read_text())
    s = doc["meta"]["summary"]
    assert s["requests"] > 0 and s["errors"] == 0 and s["incorrect"] == 0 and s["checked"]
    cal = s["calibration"]
    assert (
        cal["capacity_per_s"] > 0 and len(cal["runs"]) == 2 and cal["rates_per_s"][1][0] == 1.5 * cal["capacity_per_s"]
    )
    rep = s["report"]
    assert rep["success"] and rep["why"] is None, rep
    w0, w1 = rep["window"]
    assert w0 <= rep["replica"]["asked_at"] < rep["replica"]["running_at"] < w1 < rep["replica"]["back_at"]
    assert rep["threshold"]["crossed_at"] is not None and rep["node"]["running_at"] is not None
    samples = doc["samples"]
    targets = [x["replicas"].get("EyasTarget", 0) for x in samples]
    target_nodes = [x["nodes"].get("target_host", 0) for x in samples]
    assert max(targets) > targets[0] and max(target_nodes) > target_nodes[0], (targets, target_nodes)
    assert targets[-1] == targets[0] and target_nodes[-1] == target_nodes[0], (targets, target_nodes)
    assert all(x["completed"] <= s["requests"] for x in samples) and samples[-1]["completed"] == s["requests"]
    assert (out / "timeline.png").stat().st_size > 10_000
    sim = s["simulator"]
    assert sim["fitted_on"] == "calibration" and len(sim["cost_scales"]) == 2
    assert sim["predicted"]["peak_replicas"] >= 1 and sim["predicted"]["time_to_added_capacity_s"] is not None
    assert sim["plan"][0]["peak_replicas"] >= 1
    assert "SUCCESS" in run.stdout and "simulator (fitted on the calibration)" in run.stdout
