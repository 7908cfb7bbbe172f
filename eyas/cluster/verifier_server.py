"""A plain grpcio server for the ``Verifier`` service over one :class:`TargetEngine`.

A drafter drives a target over gRPC, outside Ray (DESIGN.md, "One speculation round"):

    OpenSession -> Prefill -> Publish(0) -> [Verify(FlatTree) -> Publish(round)]* -> CloseSession

The target decides: Verify validates the inbound FlatTree (``wire.flat_tree_from_proto``) against
the session (round, committed length, frontier token, vocabulary, row budget), runs
``TargetEngine.verify`` and decides acceptance with ``eyas.generate.decide`` under the session's
sampling parameters. Publish commits the decision *this server* made for that round (seed 0x05D);
it is idempotent and refuses a stale round (``TargetEngine.publish``).

Errors: a ``ValueError`` (``WireError`` included) becomes ``INVALID_ARGUMENT`` with its message,
which starts with the field's name; an unknown session becomes ``NOT_FOUND``. Validation runs
before the engine is called, and the engine checks before it writes, so a bad message never
touches the committed state. One lock serializes every engine call (the engine has one owner).
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import torch

from eyas.generate import decide
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import eyas_pb2_grpc
from eyas.protocol import wire
from eyas.protocol.messages import AcceptDecision
from eyas.protocol.tree import FlatTree
from eyas.target.engine import TargetEngine
from eyas.verification.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES: int = 64 << 20  # a seed of a long EAGLE-3 prompt exceeds gRPC's 4 MiB default
GRPC_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))
FLAT_FIELDS = ("tokens", "positions", "parents", "depths", "tree_mask", "retrieve", "draft_probs")


class SessionNotFound(LookupError):
    """No live session for a request id (NOT_FOUND)."""


@dataclass(frozen=True)
class Verdict:
    """One decided round, kept until it is published (and after, to answer a duplicate publish)."""

    round: int
    flat: FlatTree | None          # None for the prefill
    decision: AcceptDecision
    reply: pb.AcceptDecision


@dataclass
class ServerSession:
    """The server's per-request state beside the engine's ``TargetSession``."""

    prompt_ids: list[int]
    max_tree_rows: int
    sampling: SamplingParams
    generator: torch.Generator
    pending: Verdict | None = None     # decided, not yet published
    published: Verdict | None = None   # the last published round


def _same_rows(a: FlatTree, b: FlatTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FLAT_FIELDS)


class VerifierServicer(eyas_pb2_grpc.VerifierServicer):
    def __init__(self, engine: TargetEngine):
        self.engine = engine
        self.sessions: dict[str, ServerSession] = {}
        self.lock = threading.Lock()
        self.vocab_size = engine.cfg.vocab_size
        self.feature_dim = len(engine.taps) * engine.cfg.hidden_size

    # --- the RPCs: each runs its handler under the lock and maps errors to status codes --------
    def OpenSession(self, request, context):
        return self._call(context, self._open_session, request)

    def Prefill(self, request, context):
        return self._call(context, self._prefill, request)

    def Verify(self, request, context):
        return self._call(context, self._verify, request)

    def Publish(self, request, context):
        return self._call(context, self._publish, request)

    def CloseSession(self, request, context):
        return self._call(context, self._close_session, request)

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

    # --- handlers (called with the lock held) ------------------------------------------------
    def _session(self, request_id: str) -> ServerSession:
        wire.check_request_id(request_id)
        if request_id not in self.sessions or request_id not in self.engine.sessions:
            raise SessionNotFound(f"request_id: {request_id!r} has no live session")
        return self.sessions[request_id]

    def _open_session(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        spec = wire.session_spec_from_proto(request, vocab_size=self.vocab_size)
        sampling = SamplingParams(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p)
        if spec.request_id in self.sessions:
            raise ValueError(f"request_id: {spec.request_id!r} already has a live session")
        self.engine.open_session(spec.request_id, list(spec.prompt_ids), spec.max_new_tokens, spec.max_tree_rows)
        self.sessions[spec.request_id] = ServerSession(list(spec.prompt_ids), spec.max_tree_rows, sampling,
                                                       torch.Generator().manual_seed(spec.seed))
        return pb.OpenSessionResponse(request_id=spec.request_id, vocab_size=self.vocab_size,
                                      feature_dim=self.feature_dim, max_tree_rows=spec.max_tree_rows,
                                      eos_token_ids=list(self.engine.cfg.eos_token_ids))

    def _prefill(self, request: pb.PrefillRequest) -> pb.AcceptDecision:
        s = self._session(request.request_id)
        if s.pending is not None and s.pending.flat is None:
            return s.pending.reply  # a retried prefill: the same decision
        verified = self.engine.prefill(request.request_id)
        return self._decided(request.request_id, s, verified)

    def _verify(self, request: pb.FlatTree) -> pb.AcceptDecision:
        s = self._session(request.request_id)
        t = self.engine.sessions[request.request_id]
        if t.frontier_token is None:
            raise ValueError("round: the session has no frontier token yet (prefill and publish round 0 first)")
        flat = wire.flat_tree_from_proto(request, vocab_size=self.vocab_size, max_rows=s.max_tree_rows,
                                         base_position=t.committed_len, round=t.round + 1,
                                         frontier_token=t.frontier_token)
        if s.pending is not None:  # this round is decided but unpublished: only a retry is answered
            if s.pending.flat is not None and _same_rows(s.pending.flat, flat):
                return s.pending.reply
            raise ValueError(f"round: {request.round} is already verified with another tree; publish it first")
        verified = self.engine.verify(request.request_id, wire.draft_tree_from_flat(flat))
        return self._decided(request.request_id, s, verified)

    def _decided(self, request_id: str, s: ServerSession, verified) -> pb.AcceptDecision:
        decision = decide(verified, s.prompt_ids, s.sampling, s.generator)
        reply = wire.decision_to_proto(decision, request_id=request_id, round=verified.round)
        s.pending = Verdict(verified.round, verified.flat, decision, reply)
        return reply

    def _publish(self, request: pb.PublishRequest) -> pb.PublishAck:
        s = self._session(request.request_id)
        verdict = next((v for v in (s.pending, s.published) if v is not None and v.round == request.round), None)
        if verdict is None:
            last = s.published.round if s.published is not None else "none"
            raise ValueError(f"round: {request.round} is stale, undecided or from the future "
                             f"(last published {last}, decided {s.pending.round if s.pending else 'none'})")
        seed, ack = self.engine.publish(request.request_id, request.round, verdict.decision)
        if verdict is s.pending:
            s.pending, s.published = None, verdict
        return wire.ack_to_proto(ack, seed)

    def _close_session(self, request: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        wire.check_request_id(request.request_id)
        existed = self.sessions.pop(request.request_id, None) is not None
        self.engine.close_session(request.request_id)
        return pb.CloseSessionResponse(closed=existed)


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


def serve_verifier(engine: TargetEngine, host: str = "127.0.0.1", port: int = 0, *,
                   max_workers: int = 4) -> VerifierServer:
    """Start a Verifier server over ``engine`` on ``host:port`` (port 0: any free one)."""
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS)
    servicer = VerifierServicer(engine)
    eyas_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"address: could not bind {host}:{port}")
    server.start()
    return VerifierServer(server, servicer, host, bound)
