"""End to end on Ray's fake multi-node cluster: a burst adds a node and a target replica, idle removes them.

``eyas experiment autoscale`` runs in a subprocess, as a user runs it: it starts the fake cluster of
ray_configs/fake_cluster.yaml (each node another raylet on this machine; target replicas need a
``target_host`` node), deploys ray_configs/autoscale.yaml with a lower verify-row target so that this
small burst is enough, replays tests/e2e/workloads/tiny_burst.yaml and checks every answer against
in-process greedy target-only decoding. It runs first in tests/e2e (no other Ray may run beside it).
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
    # 1 verify row per replica: any request in flight during the burst asks for the second replica
    # (one run: asked ~0.5 s into the burst, running 18 s later, back to 1 at the end). At the earlier
    # 10 rows the 3-s average rarely held above the threshold for the upscale delay and a CI run saw
    # no second replica; 3 rows passed. 1 row once ran past the subprocess's 900 s: not the cluster
    # but the 100 req/s plan after it, whose simulator rebuilt its routing table at every replica start
    # and stop, O(N^2) in the ~50,000 replicas that policy asks for (now O(1) each: ~2 s), so this
    # test also guards that.
    kwargs.update(target_verify_rows_per_replica=1, max_replicas=2, upscale_delay_s=1, downscale_delay_s=10)
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
    samples = doc["samples"]
    targets = [x["replicas"].get("EyasTarget", 0) for x in samples]
    target_nodes = [x["nodes"].get("target_host", 0) for x in samples]
    assert max(targets) > targets[0] and max(target_nodes) > target_nodes[0], (targets, target_nodes)
    assert targets[-1] == targets[0] and target_nodes[-1] == target_nodes[0], (targets, target_nodes)
    assert all(x["completed"] <= s["requests"] for x in samples) and samples[-1]["completed"] == s["requests"]
    assert (out / "timeline.png").stat().st_size > 10_000
    assert s["simulator"]["predicted"]["p99_latency_s"] > 0 and s["simulator"]["plan"][0]["peak_replicas"] >= 1
