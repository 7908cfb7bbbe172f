"""A plain grpcio server for the ``Verifier`` service over one :class:`TargetWorker`.

A drafter drives a target over gRPC, outside Ray (docs/architecture.md, "One round"):

    OpenSession -> Prefill -> Publish(0) -> [Verify(FlatTree) -> Publish(round)]* -> CloseSession

``TargetWorker`` (eyas/actors/target_worker.py) does the work: validation, verify, the target's
acceptance decision, and the publish transaction. The same worker is the Ray actor inside a cluster.

Errors: a ``ValueError`` (``WireError`` included) becomes ``INVALID_ARGUMENT`` with its message,
which starts with the field's name; an unknown session becomes ``NOT_FOUND``. Validation runs
before the engine is called, and the engine checks before it writes, so a bad message never
touches the committed state. One lock serializes every worker call (the worker has one owner).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from eyas.actors.target_worker import SessionNotFound, TargetWorker
from eyas.protocol import eyas_pb2_grpc
from eyas.target.model import TargetModel

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES: int = 64 << 20  # a seed of a long EAGLE-3 prompt exceeds gRPC's 4 MiB default
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


class VerifierServicer(eyas_pb2_grpc.VerifierServicer):
    def __init__(self, worker: TargetWorker):
        self.worker = worker
        self.lock = threading.Lock()

    def OpenSession(self, request, context):
        return self._call(context, self.worker.open_session, request)

    def Prefill(self, request, context):
        return self._call(context, self.worker.prefill, request)

    def Verify(self, request, context):
        return self._call(context, self.worker.verify, request)

    def Publish(self, request, context):
        return self._call(context, self.worker.publish, request)

    def CloseSession(self, request, context):
        return self._call(context, self.worker.close_session, request)

    def Reseed(self, request, context):
        return self._call(context, self.worker.reseed, request)

    def _call(self, context: grpc.ServicerContext, handler, request):
        try:
            with self.lock:
                return handler(request)
        except SessionNotFound as err:
            code, message = grpc.StatusCode.NOT_FOUND, str(err.args[0])
        except ValueError as err:
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
        except Exception as err:  # a bug, not a bad message: keep serving, say so
            log.exception("verifier: %s failed", handler.__name__)
            code, message = grpc.StatusCode.INTERNAL, f"internal: {type(err).__name__}: {err}"
        context.abort(code, message)


@dataclass(frozen=True)
class VerifierServer:
    server: grpc.Server
    servicer: VerifierServicer
    host: str
    port: int

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace: float | None = None) -> None:
        self.server.stop(grace).wait()


def serve_verifier(
    target: TargetWorker | TargetModel, host: str = "127.0.0.1", port: int = 0, *, max_workers: int = 4
) -> VerifierServer:
    """Start a Verifier server over ``target`` on ``host:port`` (port 0: any free one)."""
    worker = target if isinstance(target, TargetWorker) else TargetWorker(target)
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    servicer = VerifierServicer(worker)
    eyas_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"address: could not bind {host}:{port}")
    server.start()
    return VerifierServer(server, servicer, host, bound)
