"""``WorkerPool``: the target and drafter actors one serving replica drives, and their load.

The pool is the one owner of the actor handles and of the per-actor count of live requests. Target
and drafter capacity scale independently: :meth:`WorkerPool.resize` starts actors of either kind,
or marks surplus ones *draining*; a draining actor takes no new request and is killed when its last
live request releases it, so scaling down never drops a live request (its sessions hold committed
KV that cannot move cheaply between processes here).

Requests go to the least-loaded non-draining actor of a kind (the tree-work scheduler of the
scheduler issue replaces this choice).
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

import ray

from eyas.actors.ray_actors import start_drafter_worker, start_target_worker

KINDS = ("target", "drafter")


@dataclass
class Worker:
    kind: str
    index: int
    actor: object
    name: str = ""
    live: int = 0
    draining: bool = False
    served: int = 0


@dataclass(frozen=True)
class PoolSpec:
    target: str
    precision: str = "fp32"
    methods: tuple[str, ...] = ("eagle3",)
    drafter_dirs: dict = field(default_factory=dict)
    threads: int = 1
    target_num_cpus: float = 1.0
    target_num_gpus: float = 0.0
    drafter_num_cpus: float = 1.0
    drafter_num_gpus: float = 0.0
    drafter_max_restarts: int = 1


class WorkerPool:
    def __init__(self, spec: PoolSpec, target_workers: int = 1, drafter_workers: int = 1):
        self.spec = spec
        self.lock = threading.Lock()
        self.workers: dict[str, list[Worker]] = {k: [] for k in KINDS}
        self._next_index = 0
        self.drafter_info: dict[str, dict] = {}
        self.resize(target_workers, drafter_workers)

    def _start(self, kind: str) -> Worker:
        s = self.spec
        self._next_index += 1
        name = f"eyas-{kind}-{self._next_index}-{uuid.uuid4().hex[:8]}"  # findable with ray.get_actor
        if kind == "target":
            actor = start_target_worker(s.target, s.precision, threads=s.threads, num_cpus=s.target_num_cpus,
                                        num_gpus=s.target_num_gpus, name=name)
        else:
            actor = start_drafter_worker(s.target, s.methods, s.drafter_dirs or None, threads=s.threads,
                                         num_cpus=s.drafter_num_cpus, num_gpus=s.drafter_num_gpus,
                                         max_restarts=s.drafter_max_restarts, name=name)
        return Worker(kind, self._next_index, actor, name)

    def resize(self, target_workers: int, drafter_workers: int) -> dict:
        """Grow or shrink each kind to the given count of serving (non-draining) actors."""
        if target_workers < 1:
            raise ValueError(f"target_workers: must be >= 1, got {target_workers}")
        if drafter_workers < 0:
            raise ValueError(f"drafter_workers: must be >= 0, got {drafter_workers}")
        started = []
        with self.lock:
            for kind, want in (("target", target_workers), ("drafter", drafter_workers)):
                serving = [w for w in self.workers[kind] if not w.draining]
                for w in serving[want:]:          # surplus: drain, newest first kept out of rotation
                    w.draining = True
                for w in [w for w in self.workers[kind] if w.draining][:max(want - len(serving), 0)]:
                    w.draining = False            # undrain before starting new ones
                serving = [w for w in self.workers[kind] if not w.draining]
                for _ in range(want - len(serving)):
                    w = self._start(kind)
                    self.workers[kind].append(w)
                    started.append(w)
            self._reap()
        ray.get([w.actor.ready.remote() for w in started])  # loaded, or raise here
        drafters = [w for w in started if w.kind == "drafter"]
        if drafters and not self.drafter_info:
            self.drafter_info = ray.get(drafters[0].actor.info.remote())
        return self.sizes()

    def acquire(self, kind: str) -> Worker | None:
        with self.lock:
            live = [w for w in self.workers[kind] if not w.draining]
            if not live:
                return None
            w = min(live, key=lambda x: (x.live, x.served))
            w.live += 1
            w.served += 1
            return w

    def release(self, w: Worker | None) -> None:
        if w is None:
            return
        with self.lock:
            w.live -= 1
            self._reap()

    def _reap(self) -> None:
        """Kill draining actors with no live request (called with the lock held)."""
        for kind in KINDS:
            for w in [w for w in self.workers[kind] if w.draining and w.live == 0]:
                ray.kill(w.actor)
                self.workers[kind].remove(w)

    def sizes(self) -> dict:
        with self.lock:
            return {kind: {"serving": sum(not w.draining for w in ws), "draining": sum(w.draining for w in ws),
                           "live_requests": sum(w.live for w in ws)} for kind, ws in self.workers.items()}

    def leak_checks(self, timeout_s: float = 10.0) -> list[dict]:
        with self.lock:
            workers = [w for ws in self.workers.values() for w in ws]
        namespace = ray.get_runtime_context().namespace
        out = []
        for w in workers:
            try:
                check = ray.get(w.actor.leak_check.remote(), timeout=timeout_s)
            except Exception as err:  # a dead or restarting worker holds no session
                check = {"error": f"{type(err).__name__}", "live_sessions": 0, "ok": None}
            out.append(dict(check, kind=w.kind, index=w.index, live_requests=w.live, actor_name=w.name,
                            namespace=namespace, draining=w.draining))
        return out

    def shutdown(self) -> None:
        with self.lock:
            for ws in self.workers.values():
                for w in ws:
                    ray.kill(w.actor)
                ws.clear()
