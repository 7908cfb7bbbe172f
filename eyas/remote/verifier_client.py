"""The drafter side of the ``Verifier`` messages: :class:`RemoteVerifier` and :func:`generate_remote`.

``RemoteVerifier`` offers the target-side steps the decode loop needs (open, prefill, verify,
publish, close, reseed) over a *transport*, and validates every reply before use (docs/architecture.md, "The
wire contract"). A transport carries one ``Verifier`` message to a ``TargetWorker`` and brings its
reply back: :class:`GrpcTransport` over a gRPC channel (a drafter in another cluster), or
:class:`LocalTransport` to an in-process worker. The client tracks the round, the
committed length and the frontier token from the acks, so a caller hands ``verify`` a
``DraftTree`` exactly as it would hand ``TargetEngine.verify``.

``generate_remote`` is ``eyas.generate.generate`` with the target behind that transport
(:class:`VerifierTarget`) and the drafter local or remote: the same round step
(``eyas.step.round_step``: propose -> verify (+ the target's accept) -> publish, design 0x05A-0x05D).
A round whose drafter fails or times out goes plain; the request then reseeds from the target's
committed state (design 0x05D) under the one reseed rule, and after that goes on target-only: the
same greedy tokens, ``drafter_fallback``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc

from eyas.drafting.engine import TreeSpec
from eyas.generate import GenerationResult, RoundRecord, decode
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import eyas_pb2_grpc, wire
from eyas.protocol.messages import AcceptDecision, PublishAck, Seed
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import DraftTree, FlatTree, flatten_tree
from eyas.remote.verifier_server import GRPC_OPTIONS
from eyas.step import Decided, DrafterUnavailable, DraftState, Published, SessionDrafter

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: float = 60.0
REJECTED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
NOT_PUBLISHED = -1  # RemoteSession.round before round 0 (the prefill) is published


class RemoteRejected(ValueError):
    """The verifier refused a message (INVALID_ARGUMENT or NOT_FOUND); the text names the field."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


class Transport(Protocol):
    """Carries one Verifier message (rpc name as in eyas.proto) and returns the reply message.

    Raises :class:`RemoteRejected` when the worker refuses the message."""

    def __call__(self, rpc: str, request, timeout_s: float): ...

    def close(self) -> None: ...


class GrpcTransport:
    """The ``Verifier`` service over a gRPC channel."""

    def __init__(self, target: str | grpc.Channel):
        self._own_channel = isinstance(target, str)
        self.channel = grpc.insecure_channel(target, options=GRPC_OPTIONS) if self._own_channel else target
        self.stub = eyas_pb2_grpc.VerifierStub(self.channel)

    def __call__(self, rpc: str, request, timeout_s: float):
        try:
            return getattr(self.stub, rpc)(request, timeout=timeout_s)
        except grpc.RpcError as err:
            if err.code() in REJECTED_CODES:
                raise RemoteRejected(err.code(), err.details()) from None
            raise

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()


class LocalTransport:
    """The ``Verifier`` messages to a ``TargetWorker`` in this process (tests, single-process tools)."""

    def __init__(self, worker):
        from eyas.actors.target_worker import RPC_METHODS, SessionNotFound

        self.worker, self._methods, self._not_found = worker, RPC_METHODS, SessionNotFound

    def __call__(self, rpc: str, request, timeout_s: float):
        try:
            return getattr(self.worker, self._methods[rpc])(request)
        except self._not_found as err:
            raise RemoteRejected(grpc.StatusCode.NOT_FOUND, str(err.args[0])) from None
        except ValueError as err:
            raise RemoteRejected(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SessionInfo:
    request_id: str
    vocab_size: int
    feature_dim: int
    max_tree_rows: int
    prompt_len: int
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RemoteVerdict:
    """A decided round: publish it with ``RemoteVerifier.publish(request_id, round)``."""

    round: int
    decision: AcceptDecision
    compute_s: float = 0.0  # the worker's forward + decision time
    accept_s: float = 0.0  # of which the decision
    flat: FlatTree | None = None  # the rows this client sent (None for the prefill)
    pack_s: float = 0.0  # flattening and encoding them


@dataclass
class RemoteSession:
    """The client's view of a remote session, advanced by each validated ack."""

    info: SessionInfo
    round: int = NOT_PUBLISHED  # the last published round
    committed_len: int = 0
    frontier_token: int | None = None
    publish_compute_s: float = 0.0  # the worker's time in the last publish


class RemoteVerifier:
    """A ``Verifier`` client. ``target``: an address ("127.0.0.1:50051"), an open channel, or a transport."""

    def __init__(self, target: str | grpc.Channel | Transport, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.transport = GrpcTransport(target) if isinstance(target, (str, grpc.Channel)) else target
        self.timeout_s = timeout_s
        self.sessions: dict[str, RemoteSession] = {}

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> RemoteVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _rpc(self, rpc: str, request):
        return self.transport(rpc, request, self.timeout_s)

    def _session(self, request_id: str) -> RemoteSession:
        if request_id not in self.sessions:
            raise ValueError(f"request_id: {request_id!r} has no session opened by this client")
        return self.sessions[request_id]

    # --- the steps of a round ------------------------------------------------------------------
    def open_session(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        max_tree_rows: int,
        *,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        taps: tuple[tuple[int, bool], ...] = (),
    ) -> SessionInfo:
        """``taps``: the drafter's feature address as (layers_applied, normed) pairs; () for none."""
        spec = wire.SessionSpec(
            request_id=request_id,
            prompt_ids=tuple(prompt_ids),
            max_new_tokens=max_new_tokens,
            max_tree_rows=max_tree_rows,
            sampling=sampling,
            seed=seed,
            taps=tuple(tuple(t) for t in taps),
        )
        reply = self._rpc("OpenSession", wire.session_spec_to_proto(spec))
        if reply.request_id != request_id or reply.max_tree_rows != max_tree_rows:
            raise wire.WireError(
                f"request_id: the verifier opened {reply.request_id!r} "
                f"with {reply.max_tree_rows} rows, not {request_id!r} with {max_tree_rows}"
            )
        info = SessionInfo(
            request_id,
            reply.vocab_size,
            reply.feature_dim,
            reply.max_tree_rows,
            len(prompt_ids),
            tuple(reply.eos_token_ids),
        )
        self.sessions[request_id] = RemoteSession(info)
        return info

    def prefill(self, request_id: str) -> RemoteVerdict:
        s = self._session(request_id)
        reply = self._rpc("Prefill", pb.PrefillRequest(request_id=request_id))
        round_ = s.round + 1
        decision = wire.decision_from_proto(
            reply, request_id=request_id, round=round_, vocab_size=s.info.vocab_size, max_rows=s.info.prompt_len
        )
        return RemoteVerdict(round_, decision, reply.compute_ms / 1000, reply.accept_ms / 1000)

    def verify(self, request_id: str, tree: DraftTree) -> RemoteVerdict:
        """Send the frontier token plus ``tree`` as this round's FlatTree; return the target's verdict."""
        s = self._session(request_id)
        if s.frontier_token is None:
            raise ValueError(f"request_id: {request_id!r} has no frontier token (prefill and publish first)")
        round_ = s.round + 1
        t0 = time.perf_counter()
        flat = flatten_tree(tree, s.frontier_token, s.committed_len)  # pack
        msg = wire.flat_tree_to_proto(flat, request_id=request_id, round=round_, base_position=s.committed_len)
        pack_s = time.perf_counter() - t0
        reply = self._rpc("Verify", msg)
        decision = wire.decision_from_proto(
            reply, request_id=request_id, round=round_, vocab_size=s.info.vocab_size, max_rows=flat.num_rows
        )
        rows = decision.accepted_rows
        if int(rows.max()) >= flat.num_rows or not bool((flat.tokens[rows[1:]] == decision.accepted_tokens).all()):
            raise wire.WireError("accepted_tokens: do not match the rows this client sent")
        return RemoteVerdict(round_, decision, reply.compute_ms / 1000, reply.accept_ms / 1000, flat, pack_s)

    def publish(self, request_id: str, round: int) -> tuple[Seed, PublishAck]:
        s = self._session(request_id)
        reply = self._rpc("Publish", pb.PublishRequest(request_id=request_id, round=round))
        seed, ack = wire.ack_from_proto(
            reply,
            request_id=request_id,
            round=round,
            feature_dim=s.info.feature_dim,
            vocab_size=s.info.vocab_size,
            max_rows=max(s.info.prompt_len, s.info.max_tree_rows),
        )
        if ack.round > s.round:  # a duplicate publish returns an ack the session already holds
            s.round, s.committed_len, s.frontier_token = ack.round, ack.committed_len, ack.output_tokens[-1]
        s.publish_compute_s = reply.compute_ms / 1000
        return seed, ack

    def reseed(self, request_id: str) -> Seed:
        """Every committed row's verified feature from position 0 (for a drafter that lost its session)."""
        s = self._session(request_id)
        reply = self._rpc("Reseed", pb.ReseedRequest(request_id=request_id))
        seed = wire.seed_from_proto(
            reply, feature_dim=s.info.feature_dim, vocab_size=s.info.vocab_size, max_rows=s.committed_len
        )
        if seed.start_position != 0 or seed.features.shape[0] != s.committed_len:
            raise wire.WireError(f"seed.features: a reseed must cover the {s.committed_len} committed rows from 0")
        return seed

    def close_session(self, request_id: str) -> bool:
        self.sessions.pop(request_id, None)
        return self._rpc("CloseSession", pb.CloseSessionRequest(request_id=request_id)).closed


class VerifierTarget:
    """The round step's target side for a :class:`RemoteVerifier`: its validated per-request
    messages (a prompt is prefilled whole, by one Prefill call)."""

    def __init__(self, verifier: RemoteVerifier):
        self.verifier = verifier

    def step(self, prefilling, verifies, max_prefill_rows):
        pre = [self._decided(s.request_id, self.verifier.prefill(s.request_id)) for s in prefilling]
        ver = [self._decided(s.request_id, self.verifier.verify(s.request_id, tree)) for s, tree in verifies]
        return pre, ver

    @staticmethod
    def _decided(request_id: str, v: RemoteVerdict) -> Decided:
        return Decided(
            request_id=request_id,
            round=v.round,
            decision=v.decision,
            flat=v.flat,
            compute_s=v.compute_s,
            accept_s=v.accept_s,
            pack_s=v.pack_s,
        )

    def publish(self, decided: list[Decided]) -> list[Published]:
        out = []
        for d in decided:
            seed, ack = self.verifier.publish(d.request_id, d.round)
            out.append(
                Published(
                    seed=seed,
                    tokens=tuple(ack.output_tokens),
                    compute_s=self.verifier.sessions[d.request_id].publish_compute_s,
                )
            )
        return out

    def reseed(self, request_id: str) -> Seed:
        return self.verifier.reseed(request_id)


def generate_remote(
    verifier: RemoteVerifier,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    drafter=None,
    tree: TreeSpec = TreeSpec(),
    seed: int = 0,
    request_id: str = "remote",
    stop_ids: tuple[int, ...] | None = None,
    taps: tuple[tuple[int, bool], ...] | None = None,
    cancel: threading.Event | None = None,
    on_tokens: Callable[[list[int]], bool | None] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> GenerationResult:
    """``eyas.generate.generate`` with the target behind ``verifier``: the same round step, so the
    same tokens for the same seed (the remote target decides with the same sampler in the same order).

    drafter: anything with ``open_session / propose / publish / close_session`` (e.g. a ``DrafterEngine``); its ``taps`` name the feature address unless ``taps`` does.
    cancel: set it to stop at the next round boundary (finish reason "cancelled").
    on_tokens: called with each publish's new tokens; returning True stops (finish reason "stop").
    on_round: called with a :class:`RoundRecord` after each round (spans and metrics).
    """
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    if taps is None:
        taps = tuple((t.layers_applied, t.normed) for t in getattr(drafter, "taps", ())) if drafter else ()
    max_rows = tree.max_candidates + 1 if drafter is not None else 1
    info = verifier.open_session(
        request_id, prompt_ids, max_new_tokens, max_rows, sampling=sampling, seed=seed, taps=taps
    )
    stop_ids = tuple(info.eos_token_ids if stop_ids is None else stop_ids)
    sides = VerifierTarget(verifier), SessionDrafter(drafter) if drafter is not None else None
    state = DraftState(
        request_id=request_id,
        method="target" if drafter is None else "drafter",
        draft_slots=tree.draft_slots(len(prompt_ids), max_new_tokens),
    )
    try:
        return decode(
            sides,
            state,
            tree if drafter is not None else None,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            on_tokens=on_tokens,
            cancel=cancel,
            on_round=on_round,
        )
    finally:
        verifier.close_session(request_id)
        if drafter is not None:
            try:
                drafter.close_session(request_id)
            except DrafterUnavailable:
                pass
