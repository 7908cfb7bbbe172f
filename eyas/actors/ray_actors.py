"""The Ray actors of DESIGN.md, and the adapters the decode loop drives them through.

- :class:`TargetWorkerActor` / :class:`DrafterWorkerActor`: ``TargetWorker`` / ``DrafterWorker``
  loaded inside the actor process, which then owns the device state. Resources (``num_cpus``,
  ``num_gpus``) come from :func:`start_target_worker` / :func:`start_drafter_worker`.
- :class:`RayTransport`: carries the ``Verifier`` messages to a target actor, so
  ``eyas.cluster.verifier_client.RemoteVerifier`` and ``generate_remote`` work over Ray exactly as
  over gRPC. A refusal (``ValueError`` in the actor) becomes ``RemoteRejected`` naming the field;
  the actor keeps serving.
- :class:`RayDrafter`: a drafter actor with the ``DrafterEngine`` interface of the decode loop. A dead
  actor or a timeout becomes ``DrafterUnavailable``, which the loop turns into a reseed or a
  target-only fallback.

Per round the loop makes three actor calls (propose, verify, publish); each carries only the
protocol's messages (DESIGN.md, "The wire contract"), never a cache.
"""
from __future__ import annotations

import grpc
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from eyas.actors.drafter_worker import DrafterWorker
from eyas.actors.target_worker import RPC_METHODS, SessionNotFound, TargetWorker
from eyas.cluster.verifier_client import DrafterUnavailable, RemoteRejected
from eyas.drafting.engine import TreeSpec
from eyas.protocol import wire
from eyas.protocol.messages import Seed
from eyas.target.model import FeatureTap



class TargetWorkerActor(TargetWorker):
    def __init__(self, target: str, precision: str = "fp32", threads: int = 1):
        loaded = TargetWorker.load(target, precision, threads)
        super().__init__(loaded.model, loaded.name)

    def ready(self) -> str:
        return self.name


class DrafterWorkerActor(DrafterWorker):
    def __init__(self, target: str, methods: tuple[str, ...], drafter_dirs: dict[str, str] | None = None,
                 threads: int = 1):
        loaded = DrafterWorker.load(target, methods, drafter_dirs, threads)
        super().__init__(loaded.engines, loaded.vocab_size, loaded.sources, loaded.default_trees, loaded.name)

    def ready(self) -> str:
        return self.name


def start_target_worker(target: str, precision: str = "fp32", *, threads: int = 1, num_cpus: float = 1,
                        num_gpus: float = 0, name: str | None = None):
    options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_concurrency=1)
    if name:
        options["name"] = name
    return ray.remote(TargetWorkerActor).options(**options).remote(target, precision, threads)


def start_drafter_worker(target: str, methods: tuple[str, ...], drafter_dirs: dict[str, str] | None = None, *,
                         threads: int = 1, num_cpus: float = 1, num_gpus: float = 0, max_restarts: int = 1,
                         name: str | None = None):
    """``max_restarts``: a crashed drafter comes back (empty) and requests reseed onto it."""
    options = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=max_restarts, max_concurrency=1)
    if name:
        options["name"] = name
    return ray.remote(DrafterWorkerActor).options(**options).remote(target, tuple(methods), drafter_dirs, threads)


def _refusal(err: RayTaskError) -> RemoteRejected | None:
    cause = getattr(err, "cause", None)
    if isinstance(cause, SessionNotFound):
        return RemoteRejected(grpc.StatusCode.NOT_FOUND, str(cause.args[0]))
    if isinstance(cause, ValueError):
        return RemoteRejected(grpc.StatusCode.INVALID_ARGUMENT, str(cause))
    return None


class RayTransport:
    """``Verifier`` messages to a ``TargetWorkerActor`` (see ``eyas.cluster.verifier_client.Transport``)."""

    def __init__(self, actor):
        self.actor = actor

    def __call__(self, rpc: str, request, timeout_s: float):
        ref = getattr(self.actor, RPC_METHODS[rpc]).remote(request)
        try:
            return ray.get(ref, timeout=timeout_s)
        except RayTaskError as err:
            refusal = _refusal(err)
            if refusal is None:
                raise
            raise refusal from None

    def close(self) -> None:
        pass


class RayDrafter:
    """A ``DrafterWorkerActor`` serving one method, with the decode loop's drafter interface."""

    def __init__(self, actor, method: str, taps: tuple[tuple[int, bool], ...], timeout_s: float = 30.0):
        self.actor = actor
        self.method = method
        self.taps = tuple(FeatureTap(layer, normed) for layer, normed in taps)
        self.timeout_s = timeout_s

    def _get(self, ref):
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except GetTimeoutError as err:
            ray.cancel(ref)
            raise DrafterUnavailable(f"drafter: no answer in {self.timeout_s} s") from err
        except RayActorError as err:
            raise DrafterUnavailable(f"drafter: the actor died ({type(err).__name__})") from err
        except RayTaskError as err:
            refusal = _refusal(err)
            if refusal is not None and "no live draft session" in str(refusal):
                raise DrafterUnavailable(f"drafter: lost the session ({refusal})") from err
            raise refusal or err from None

    def open_session(self, request_id: str, max_slots: int) -> None:
        self._get(self.actor.open_session.remote(request_id, self.method, max_slots))

    def propose(self, request_id: str, seed: Seed, tree: TreeSpec):
        return self._get(self.actor.propose.remote(request_id, wire.seed_to_proto(seed, request_id=request_id), tree))

    def publish(self, request_id: str) -> None:
        """Nothing to send: the worker discards the provisional rows when the next seed arrives."""

    def close_session(self, request_id: str) -> bool:
        return self._get(self.actor.close_session.remote(request_id))
