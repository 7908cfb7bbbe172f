"""The replica registry: where every target and drafter replica of one Eyas app posts its state.

Serve routes a handle call to *one* replica; ``Stats`` needs *all* of them (their leak invariant,
latency curves, telemetry and tree work). So each replica runs a :class:`Reporter` thread that posts a
small JSON-able dict to one named :class:`Registry` actor every ``period_s`` (and at once when poked,
e.g. when a request finishes), and removes itself when it shuts down. The ingress reads
:meth:`Registry.snapshot`. A replica that died without saying goodbye ages out after ``max_age_s``.

The registry only *mirrors* state: each replica stays the one owner of what it reports.

It also carries **named cancels** (the ``Cancel`` RPC): the ingress posts ``request_id`` with the
time it was issued (:class:`CancelBook`); every report's reply hands the book's recent entries back,
and each target replica stops its own in-flight requests of those names (:func:`cancels_due`). So a
cancel reaches whichever replica runs the request within one report period, whichever ingress replica
took it, and independently of the client's stream (whose close Ray Serve 2.60's gRPC proxy can lose).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from eyas.protocol.schema import CHOICE_SEP

log = logging.getLogger("eyas.registry")
REGISTRY_PREFIX = "eyas-registry"
DEFAULT_MAX_AGE_S = 10.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every Ray head node offers it
REPLY_TIMEOUT_S = 5.0  # a target replica waits this long for the registry's reply to its report
OUTAGE_FAILURES = 2  # reports failed in a row that make a WARNING (one alone is the registry restarting)
CANCEL_TTL_S = 120.0  # how long a named cancel is handed out (it may overtake its request by this much)


class CancelBook:
    """Named cancels, each kept ``ttl_s`` seconds: ``request_id -> wall time it was issued``."""

    def __init__(self, ttl_s: float = CANCEL_TTL_S):
        self.ttl_s = ttl_s
        self.issued: dict[str, float] = {}

    def cancel(self, request_id: str, now: float) -> None:
        self.issued[request_id] = now

    def recent(self, now: float) -> dict[str, float]:
        for rid in [r for r, t in self.issued.items() if now - t > self.ttl_s]:
            del self.issued[rid]
        return dict(self.issued)


def cancels_due(inflight: dict[str, float], cancels: dict[str, float]) -> list[str]:
    """The in-flight requests a set of named cancels stops.

    inflight: request id -> wall time the ingress received the request;
    cancels:  request id -> wall time the cancel was issued.
    A cancel applies to a request received no later than the cancel, so a client that reuses a
    cancelled id for a new request (after the old one ended) is not cancelled again; a cancel of
    ``a`` also stops the choices ``a#1``, ``a#2`` ... of an OpenAI request with n > 1. Example:
    inflight {"a": 10.0, "b": 12.0, "a#1": 10.0}, cancels {"a": 11.0, "b": 11.5, "c": 1.0} -> ["a", "a#1"].
    """
    out = []
    for rid, received in inflight.items():
        base, sep, index = rid.rpartition(CHOICE_SEP)
        name = base if rid not in cancels and sep and index.isdigit() else rid
        if name in cancels and received <= cancels[name]:
            out.append(rid)
    return out


@ray.remote(num_cpus=0, max_restarts=-1)
class Registry:
    def __init__(self):
        self.reports: dict[str, tuple[str, float, dict]] = {}  # replica id -> (kind, wall time, payload)
        self.curves: dict[str, dict] = {}  # (target, precision, device) key -> the latest latency curve
        self.cancels = CancelBook()

    def put_curve(self, key: str, curve: dict) -> None:
        """A target replica's latency curve (measured, or updated from its live rounds)."""
        self.curves[key] = curve

    def get_curve(self, key: str) -> dict | None:
        """The latest curve for replicas of the same target on the same kind of device, if any: a new
        replica starts from it instead of measuring its own (seconds of start-up on a CPU)."""
        return self.curves.get(key)

    def report(self, replica_id: str, kind: str, payload: dict) -> dict:
        """Store a replica's state; reply with the recent named cancels (``cancels``: request id ->
        issued at) and the target replicas that reported within ``DEFAULT_MAX_AGE_S``
        (``live_targets``: a drafter reclaims the sessions of the others)."""
        now = time.time()
        self.reports[replica_id] = (kind, now, payload)
        live = sorted(r for r, (k, t, _) in self.reports.items() if k == "target" and now - t <= DEFAULT_MAX_AGE_S)
        return {"cancels": self.cancels.recent(now), "live_targets": live}

    def cancel(self, request_id: str) -> None:
        """A named cancel from the ingress (the ``Cancel`` RPC); idempotent."""
        self.cancels.cancel(request_id, time.time())

    def forget(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)

    def snapshot(self, max_age_s: float = DEFAULT_MAX_AGE_S) -> list[dict]:
        now = time.time()
        for rid in [r for r, (_, t, _) in self.reports.items() if now - t > max_age_s]:
            del self.reports[rid]
        return [
            dict(payload, replica=rid, kind=kind, age_s=now - t)
            for rid, (kind, t, payload) in sorted(self.reports.items())
        ]


def app_name() -> str:
    """The Serve application of the calling replica ("eyas" outside a replica, e.g. in unit tests)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().app_name
    except RayServeException:  # outside a Serve replica (unit tests)
        return "eyas"


def get_registry(app_name: str):
    """The app's registry actor, started on first use (detached: it outlives whichever replica made it).

    It lives on the head node: an actor on a worker node keeps that node from ever going idle, so
    the cluster autoscaler could not remove it after a burst."""
    return Registry.options(
        name=f"{REGISTRY_PREFIX}:{app_name}",
        get_if_exists=True,
        lifetime="detached",
        resources={HEAD_NODE_RESOURCE: 0.001},
    ).remote()


class Reporter:
    """Posts ``payload()`` for one replica every ``period_s`` seconds, or at once after :meth:`poke`;
    hands each reply (``Registry.report``'s: the recent named cancels, the live target replicas) to
    ``on_reply`` when given."""

    def __init__(
        self,
        app_name: str,
        replica_id: str,
        kind: str,
        payload: Callable[[], dict],
        period_s: float = 0.5,
        on_reply: Callable[[dict], None] | None = None,
    ):
        self.app_name, self.replica_id, self.kind, self.payload = app_name, replica_id, kind, payload
        self.on_reply = on_reply
        self.period_s = period_s
        self.wake = threading.Event()
        self.stopped = False
        self.registry = None
        self.failures = 0  # reports failed in a row
        self.thread = threading.Thread(target=self._run, name=f"eyas-reporter-{kind}", daemon=True)
        self.thread.start()

    def poke(self) -> None:
        self.wake.set()

    def _run(self) -> None:
        while not self.stopped:
            try:
                if self.registry is None:
                    self.registry = get_registry(self.app_name)
                reply = self.registry.report.remote(self.replica_id, self.kind, self.payload())
                if self.on_reply is not None:
                    self.on_reply(ray.get(reply, timeout=REPLY_TIMEOUT_S))
                self.failures = 0
            except Exception as err:  # noqa: BLE001 - the registry restarts or the replica is going away: next period
                # said at an outage's second failure in a row (one alone is a registry restarting), then
                # quiet until a report gets through
                self.failures += 1
                (log.warning if self.failures == OUTAGE_FAILURES else log.debug)(
                    "report to the replica registry failed (%s: %s); retrying every %.0f s",
                    type(err).__name__,
                    err,
                    self.period_s,
                )
                self.registry = None
            self.wake.wait(self.period_s)
            self.wake.clear()

    def stop(self) -> None:
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=5)
        try:
            ray.get(get_registry(self.app_name).forget.remote(self.replica_id), timeout=5)
        except Exception as err:  # noqa: BLE001 - said; the registry forgets a replica that stops reporting anyway
            log.warning("registry forget(%s) failed (%s: %s)", self.replica_id, type(err).__name__, err)
