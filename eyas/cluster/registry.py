"""The replica registry: where every target and drafter replica of one Eyas app posts its state.

Serve routes a handle call to *one* replica; ``Stats`` needs *all* of them (their leak invariant,
latency curves, telemetry and tree work). So each replica runs a :class:`Reporter` thread that posts a
small JSON-able dict to one named :class:`Registry` actor every ``period_s`` (and at once when poked,
e.g. when a request finishes), and removes itself when it shuts down. The ingress reads
:meth:`Registry.snapshot`. A replica that died without saying goodbye ages out after ``max_age_s``.

The registry only *mirrors* state: each replica stays the one owner of what it reports.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import ray

log = logging.getLogger("eyas.registry")
REGISTRY_PREFIX = "eyas-registry"
DEFAULT_MAX_AGE_S = 10.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node offers it


@ray.remote(num_cpus=0, max_restarts=-1)
class Registry:
    def __init__(self):
        self.reports: dict[str, tuple[str, float, dict]] = {}  # replica id -> (kind, wall time, payload)
        self.curves: dict[str, dict] = {}  # (target, precision, device) key -> the latest latency curve

    def put_curve(self, key: str, curve: dict) -> None:
        """A target replica's latency curve (measured, or updated from its live rounds)."""
        self.curves[key] = curve

    def get_curve(self, key: str) -> dict | None:
        """The latest curve for replicas of the same target on the same kind of device, if any: a new
        replica starts from it instead of measuring its own (seconds of start-up on a CPU)."""
        return self.curves.get(key)

    def report(self, replica_id: str, kind: str, payload: dict) -> None:
        self.reports[replica_id] = (kind, time.time(), payload)

    def forget(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)

    def snapshot(self, max_age_s: float = DEFAULT_MAX_AGE_S) -> list[dict]:
        now = time.time()
        for rid in [r for r, (_, t, _) in self.reports.items() if now - t > max_age_s]:
            del self.reports[rid]
        return [dict(payload, replica=rid, kind=kind, age_s=now - t)
                for rid, (kind, t, payload) in sorted(self.reports.items())]


def app_name() -> str:
    """The Serve application of the calling replica ("eyas" outside a replica, e.g. in unit tests)."""
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:
        return "eyas"


def get_registry(app_name: str):
    """The app's registry actor, started on first use (detached: it outlives whichever replica made it).

    It lives on the head node: an actor on a worker node keeps that node from ever going idle, so
    the cluster autoscaler could not remove it after a burst."""
    return Registry.options(name=f"{REGISTRY_PREFIX}:{app_name}", get_if_exists=True, lifetime="detached",
                            resources={HEAD_NODE_RESOURCE: 0.001}).remote()


class Reporter:
    """Posts ``payload()`` for one replica every ``period_s`` seconds, or at once after :meth:`poke`."""

    def __init__(self, app_name: str, replica_id: str, kind: str, payload: Callable[[], dict],
                 period_s: float = 0.5):
        self.app_name, self.replica_id, self.kind, self.payload = app_name, replica_id, kind, payload
        self.period_s = period_s
        self.wake = threading.Event()
        self.stopped = False
        self.registry = None
        self.thread = threading.Thread(target=self._run, name=f"eyas-reporter-{kind}", daemon=True)
        self.thread.start()

    def poke(self) -> None:
        self.wake.set()

    def _run(self) -> None:
        while not self.stopped:
            try:
                if self.registry is None:
                    self.registry = get_registry(self.app_name)
                self.registry.report.remote(self.replica_id, self.kind, self.payload())
            except Exception:  # the registry restarts or the replica is going away: try again next period
                log.debug("report failed", exc_info=True)
                self.registry = None
            self.wake.wait(self.period_s)
            self.wake.clear()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)
        try:
            ray.get(get_registry(self.app_name).forget.remote(self.replica_id), timeout=5)
        except Exception:
            pass
