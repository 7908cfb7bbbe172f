"""The drafter side of the ``Verifier`` service: :class:`RemoteVerifier` and :func:`generate_remote`.

``RemoteVerifier`` offers the target-side steps the decode loop needs (open, prefill, verify,
publish, close) over a gRPC channel, and validates every reply before use (DESIGN.md, "The wire
contract"). It tracks the round, the committed length and the frontier token from the acks, so a
caller hands ``verify`` a ``DraftTree`` exactly as it would hand ``TargetEngine.verify``.

``generate_remote`` is ``eyas.generate.generate`` with the target behind that channel: the
drafter proposes locally, the remote target verifies, decides and publishes (seed 0x05A-0x05D).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import grpc

from eyas.drafting.engine import DrafterEngine, TreeSpec
from eyas.generate import GenerationResult, RoundStats, finish_tokens
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import eyas_pb2_grpc
from eyas.protocol import wire
from eyas.protocol.messages import AcceptDecision, PublishAck, Seed
from eyas.protocol.tree import DraftTree, flatten_tree
from eyas.cluster.verifier_server import GRPC_OPTIONS
from eyas.verification.sampling import SamplingParams

DEFAULT_TIMEOUT_S: float = 60.0
REJECTED_CODES = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
NOT_PUBLISHED = -1  # RemoteSession.round before round 0 (the prefill) is published


class RemoteRejected(ValueError):
    """The verifier refused a message (INVALID_ARGUMENT or NOT_FOUND); the text names the field."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code


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


@dataclass
class RemoteSession:
    """The client's view of a remote session, advanced by each validated ack."""

    info: SessionInfo
    round: int = NOT_PUBLISHED     # the last published round
    committed_len: int = 0
    frontier_token: int | None = None


class RemoteVerifier:
    """A ``Verifier`` client. ``target``: an address ("127.0.0.1:50051") or an open channel."""

    def __init__(self, target: str | grpc.Channel, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self._own_channel = isinstance(target, str)
        self.channel = grpc.insecure_channel(target, options=GRPC_OPTIONS) if self._own_channel else target
        self.stub = eyas_pb2_grpc.VerifierStub(self.channel)
        self.timeout_s = timeout_s
        self.sessions: dict[str, RemoteSession] = {}

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> RemoteVerifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _rpc(self, method, request):
        try:
            return method(request, timeout=self.timeout_s)
        except grpc.RpcError as err:
            if err.code() in REJECTED_CODES:
                raise RemoteRejected(err.code(), err.details()) from None
            raise

    def _session(self, request_id: str) -> RemoteSession:
        if request_id not in self.sessions:
            raise ValueError(f"request_id: {request_id!r} has no session opened by this client")
        return self.sessions[request_id]

    # --- the steps of a round ------------------------------------------------------------------
    def open_session(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, max_tree_rows: int, *,
                     sampling: SamplingParams = SamplingParams(), seed: int = 0) -> SessionInfo:
        spec = wire.SessionSpec(request_id, tuple(prompt_ids), max_new_tokens, max_tree_rows,
                                sampling.temperature, sampling.top_p, sampling.top_k, seed)
        reply = self._rpc(self.stub.OpenSession, wire.session_spec_to_proto(spec))
        if reply.request_id != request_id or reply.max_tree_rows != max_tree_rows:
            raise wire.WireError(f"request_id: the verifier opened {reply.request_id!r} "
                                 f"with {reply.max_tree_rows} rows, not {request_id!r} with {max_tree_rows}")
        info = SessionInfo(request_id, reply.vocab_size, reply.feature_dim, reply.max_tree_rows,
                           len(prompt_ids), tuple(reply.eos_token_ids))
        self.sessions[request_id] = RemoteSession(info)
        return info

    def prefill(self, request_id: str) -> RemoteVerdict:
        s = self._session(request_id)
        reply = self._rpc(self.stub.Prefill, pb.PrefillRequest(request_id=request_id))
        round_ = s.round + 1
        decision = wire.decision_from_proto(reply, request_id=request_id, round=round_,
                                            vocab_size=s.info.vocab_size, max_rows=s.info.prompt_len)
        return RemoteVerdict(round_, decision)

    def verify(self, request_id: str, tree: DraftTree) -> RemoteVerdict:
        """Send the frontier token plus ``tree`` as this round's FlatTree; return the target's verdict."""
        s = self._session(request_id)
        if s.frontier_token is None:
            raise ValueError(f"request_id: {request_id!r} has no frontier token (prefill and publish first)")
        round_ = s.round + 1
        flat = flatten_tree(tree, s.frontier_token, s.committed_len)
        reply = self._rpc(self.stub.Verify, wire.flat_tree_to_proto(flat, request_id=request_id, round=round_,
                                                                     base_position=s.committed_len))
        decision = wire.decision_from_proto(reply, request_id=request_id, round=round_,
                                            vocab_size=s.info.vocab_size, max_rows=flat.num_rows)
        rows = decision.accepted_rows
        if int(rows.max()) >= flat.num_rows or not bool((flat.tokens[rows[1:]] == decision.accepted_tokens).all()):
            raise wire.WireError("accepted_tokens: do not match the rows this client sent")
        return RemoteVerdict(round_, decision)

    def publish(self, request_id: str, round: int) -> tuple[Seed, PublishAck]:
        s = self._session(request_id)
        reply = self._rpc(self.stub.Publish, pb.PublishRequest(request_id=request_id, round=round))
        seed, ack = wire.ack_from_proto(reply, request_id=request_id, round=round, feature_dim=s.info.feature_dim,
                                        vocab_size=s.info.vocab_size,
                                        max_rows=max(s.info.prompt_len, s.info.max_tree_rows))
        if ack.round > s.round:  # a duplicate publish returns an ack the session already holds
            s.round, s.committed_len, s.frontier_token = ack.round, ack.committed_len, ack.output_tokens[-1]
        return seed, ack

    def close_session(self, request_id: str) -> bool:
        self.sessions.pop(request_id, None)
        return self._rpc(self.stub.CloseSession, pb.CloseSessionRequest(request_id=request_id)).closed


def generate_remote(verifier: RemoteVerifier, prompt_ids: list[int], *, max_new_tokens: int,
                    sampling: SamplingParams = SamplingParams(), drafter: DrafterEngine | None = None,
                    tree: TreeSpec = TreeSpec(), seed: int = 0, request_id: str = "remote",
                    stop_ids: tuple[int, ...] | None = None) -> GenerationResult:
    """``eyas.generate.generate`` with the target behind ``verifier``; the same tokens for the same
    seed, since the remote target decides with the same sampler in the same order."""
    if type(max_new_tokens) is not int or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
    max_rows = tree.max_candidates + 1 if drafter is not None else 1
    info = verifier.open_session(request_id, prompt_ids, max_new_tokens, max_rows, sampling=sampling, seed=seed)
    stop_ids = tuple(info.eos_token_ids if stop_ids is None else stop_ids)
    try:
        if drafter is not None:
            drafter.open_session(request_id, len(prompt_ids) + max_new_tokens + max_rows + tree.max_draft_rows + 1)
        t_start = time.perf_counter()
        verdict = verifier.prefill(request_id)
        seed_state, ack = verifier.publish(request_id, verdict.round)
        out = list(ack.output_tokens)
        prefill_s = time.perf_counter() - t_start
        rounds: list[RoundStats] = []
        while len(out) < max_new_tokens and not any(t in stop_ids for t in ack.output_tokens):
            t0 = time.perf_counter()
            draft = drafter.propose(request_id, seed_state, tree) if drafter else DraftTree.empty()   # propose
            t1 = time.perf_counter()
            verdict = verifier.verify(request_id, draft)                                               # verify+accept
            t2 = time.perf_counter()
            seed_state, ack = verifier.publish(request_id, verdict.round)                              # publish
            if drafter:
                drafter.publish(request_id)
            out.extend(ack.output_tokens)
            d = verdict.decision
            rounds.append(RoundStats(d.accept_length, d.num_new_tokens, draft.num_nodes, t1 - t0, t2 - t1))
        wall_s = time.perf_counter() - t_start
    finally:
        verifier.close_session(request_id)
        if drafter is not None:
            drafter.close_session(request_id)
    return GenerationResult(*finish_tokens(out, max_new_tokens, stop_ids), prefill_s, wall_s, tuple(rounds))
