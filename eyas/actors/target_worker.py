"""``TargetWorker``: the owner of one target's device state, speaking the ``Verifier`` messages.

It is a plain class. Each ``EyasTarget`` Serve replica owns one (eyas/serve/deployments.py),
``eyas.remote.verifier_server`` serves it over plain gRPC, and the tests call it directly. It speaks
two ways: objects for a caller in its own process (the replica's round loop: ``open``, ``step``,
``publish_rounds``, ``committed_seed``, ``close``), and the protobuf messages of ``eyas.proto`` for
one across a process boundary (the ``Verifier`` rpcs and their batched forms), which are decoded
and checked, then run through the same object calls (design 0x05A-0x05D, the wire contract).

State it owns: the target weights, and per request one session (through :class:`TargetEngine`:
committed KV, provisional branch KV) plus the session's sampler and the decided-but-unpublished
verdict. A round (design 0x05A-0x05D):

    OpenSession -> Prefill -> Publish(0) -> [Verify(FlatTree) -> Publish(round)]* -> CloseSession

The target decides: ``verify`` validates the inbound ``FlatTree`` against the session (round,
committed length, frontier token, vocabulary, row budget), runs ``TargetEngine.verify`` and decides
acceptance with ``eyas.step.decide_verified`` under the session's sampling parameters. ``publish`` commits
the decision *this worker* made for that round (a drafter cannot substitute another); it is
idempotent and refuses a stale or future round (``TargetEngine.publish``). Every check runs before
the first write, so a bad message leaves the committed KV, features and output unchanged.

Errors: ``ValueError`` (``WireError`` included) names the field; ``SessionNotFound`` for an unknown
request id. Calls are serialized by the caller (one lock in the gRPC server; a Ray actor runs one
call at a time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from eyas.learning.capture import CaptureConfig, TrafficBuffer, sample_of
from eyas.protocol import eyas_pb2 as pb
from eyas.protocol import wire
from eyas.protocol.messages import AcceptDecision, PublishAck, Refusal, Seed
from eyas.protocol.sampling_params import SamplingParams
from eyas.protocol.tree import DraftTree, FlatTree
from eyas.step import Decided, Published, decide_verified
from eyas.target.config import FeatureTap
from eyas.target.engine import PrefillProgress, TargetEngine
from eyas.target.model import TargetModel
from eyas.target.prefix_cache import PrefixCache
from eyas.verification.accept import emitted_logprobs
from eyas.verification.grammar import GrammarCompiler, GrammarCursor, Grammars

RPC_METHODS = {
    "OpenSession": "open_session",
    "Prefill": "prefill",
    "Verify": "verify",
    "Publish": "publish",
    "CloseSession": "close_session",
    "Reseed": "reseed",
}  # Verifier rpc -> TargetWorker method
FLAT_FIELDS = ("tokens", "positions", "parents", "depths", "tree_mask", "retrieve", "draft_probs")


class SessionNotFound(LookupError):
    """No live session for a request id (gRPC NOT_FOUND)."""


@dataclass
class Verdict:
    """One decided round, kept until it is published (and after, to answer a duplicate publish)."""

    decided: Decided  # the round, its rows (None for the prefill) and decision
    reply: pb.AcceptDecision | None = None  # its message, encoded once when a caller speaks protobuf
    logprobs: tuple | None = None  # the emitted tokens' (eyas.verification.accept.emitted_logprobs), when asked for

    @property
    def round(self) -> int:
        return self.decided.round

    @property
    def flat(self) -> FlatTree | None:
        return self.decided.flat

    @property
    def decision(self) -> AcceptDecision:
        return self.decided.decision


@dataclass
class WorkerSession:
    """The worker's per-request state beside the engine's ``TargetSession``."""

    engine: TargetEngine  # the engine of this session's feature address
    prompt_ids: list[int]
    max_tree_rows: int
    sampling: SamplingParams
    generator: torch.Generator
    pending: Verdict | None = None  # decided, not yet published
    published: Verdict | None = None  # the last published round
    published_result: tuple[Published, PublishAck] | None = None  # its result, returned again to a duplicate
    published_reply: pb.PublishAck | None = None  # the same as a message, once a caller asked for one
    logprobs: int | None = None  # top alternatives each emitted token's logprob carries (None: no logprobs)
    grammar: GrammarCursor | None = None  # the structured-output grammar's cursor (None: no grammar)


def _same_rows(a: FlatTree, b: FlatTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in FLAT_FIELDS)


class TargetWorker:
    """One target model; one :class:`TargetEngine` per feature address that sessions ask for."""

    def __init__(
        self,
        model: TargetModel,
        name: str = "target",
        prefix_cache_bytes: int = 0,
        tokenizer=None,
        capture: CaptureConfig | None = None,
    ):
        """``prefix_cache_bytes``: the budget of the prefix cache its engines share (``eyas.target.prefix_cache``;
        0: off), checked here, naming it, before any engine exists. ``tokenizer``: the target's, for
        structured output (its grammars are compiled over its vocabulary); None: refused, naming
        ``response_format``. ``capture``: keep what a drafter learns from, of every learning session
        at its feature address (``eyas.learning.capture``; None: off, the default)."""
        self.grammars = Grammars(
            None
            if tokenizer is None
            else lambda: GrammarCompiler(tokenizer, self.vocab_size, list(self.cfg.eos_token_ids)),
            missing="response_format: this target was loaded without its tokenizer; no grammar can be compiled",
        )
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.model = model
        self.cfg = model.cfg
        self.name = name
        self.vocab_size = model.cfg.vocab_size
        self.engines: dict[tuple[FeatureTap, ...], TargetEngine] = {}
        self.sessions: dict[str, WorkerSession] = {}
        self.capture = None if capture is None else TrafficBuffer(capture)
        self.train_taps: tuple[FeatureTap, ...] = ()
        if capture is not None:
            from eyas.training.features import training_taps

            self.train_taps = training_taps(model)

    @classmethod
    def load(
        cls,
        target: str,
        precision: str = "fp32",
        threads: int | None = None,
        dtype: str = "float32",
        device: str = "cpu",
        prefix_cache_bytes: int = 0,
        capture: CaptureConfig | None = None,
    ) -> TargetWorker:
        """Load ``target`` (see ``eyas.target.loader.load_target``); ``threads``: torch CPU threads;
        ``dtype``: the compute dtype at precision fp32; ``device``: where it computes; ``capture``: see
        the constructor."""
        from eyas.target.loader import load_target

        if threads:
            torch.set_num_threads(threads)
        suffix = "" if dtype == "float32" else f"/{dtype}"
        loaded = load_target(target, precision, device=device, dtype=dtype)
        return cls(
            loaded.model,
            name=f"{target}/{precision}{suffix}",
            prefix_cache_bytes=prefix_cache_bytes,
            tokenizer=loaded.tokenizer,
            capture=capture,
        )

    def engine_for(self, taps: tuple[FeatureTap, ...]) -> TargetEngine:
        for tap in taps:
            if not 0 <= tap.layers_applied <= self.cfg.num_layers:
                raise ValueError(f"tap_layers: {tap.layers_applied} is outside [0, {self.cfg.num_layers}]")
        if taps not in self.engines:
            capture = self.train_taps if self.capture is not None and taps == self.capture.config.taps else ()
            self.engines[taps] = TargetEngine(self.model, taps, self.prefix_cache, capture_taps=capture)
        return self.engines[taps]

    # --- the Verifier messages -------------------------------------------------------------------
    def open_session(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        spec = wire.session_spec_from_proto(request, vocab_size=self.vocab_size)
        self.open(spec)
        engine = self.sessions[spec.request_id].engine
        return pb.OpenSessionResponse(
            request_id=spec.request_id,
            vocab_size=self.vocab_size,
            feature_dim=len(engine.taps) * self.cfg.hidden_size,
            max_tree_rows=spec.max_tree_rows,
            eos_token_ids=list(self.cfg.eos_token_ids),
        )

    def open(self, spec: wire.SessionSpec) -> tuple[int, ...]:
        """:meth:`open_session` for a ``SessionSpec`` object (checked as the message is) -> the
        target's stop token ids."""
        wire.check_session_spec(spec, vocab_size=self.vocab_size)
        sampling = spec.sampling
        if spec.request_id in self.sessions:
            raise ValueError(f"request_id: {spec.request_id!r} already has a live session")
        grammar = self.grammars.cursor(sampling.grammar)
        engine = self.engine_for(tuple(FeatureTap(layer, normed) for layer, normed in spec.taps))
        engine.open_session(
            spec.request_id, list(spec.prompt_ids), spec.max_new_tokens, spec.max_tree_rows, learn=spec.learn
        )
        self.sessions[spec.request_id] = WorkerSession(
            engine,
            list(spec.prompt_ids),
            spec.max_tree_rows,
            sampling,
            torch.Generator().manual_seed(spec.seed),
            logprobs=spec.logprobs,
            grammar=grammar,
        )
        return tuple(self.cfg.eos_token_ids)

    def prefill(self, request: pb.PrefillRequest) -> pb.AcceptDecision:
        s = self._session(request.request_id)
        if s.pending is not None and s.pending.flat is None:
            return self._reply(s.pending)  # a retried prefill: the same decision
        t0 = time.perf_counter()
        verified = s.engine.prefill(request.request_id)
        return self._reply(self._decide(s, verified, t0))

    def verify(self, request: pb.FlatTree) -> pb.AcceptDecision:
        s = self._session(request.request_id)
        flat = self._inbound_flat(s, request)
        if s.pending is not None:  # this round is decided but unpublished: only a retry is answered
            if s.pending.flat is not None and _same_rows(s.pending.flat, flat):
                return self._reply(s.pending)
            raise ValueError(f"round: {request.round} is already verified with another tree; publish it first")
        t0 = time.perf_counter()
        verified = s.engine.verify(request.request_id, wire.draft_tree_from_flat(flat))
        return self._reply(self._decide(s, verified, t0))

    def publish(self, request: pb.PublishRequest) -> pb.PublishAck:
        s = self._session(request.request_id)
        self.publish_round(request.request_id, request.round)
        if s.published_reply is None:  # encoded once; a duplicate publish gets the same message
            published, ack = s.published_result
            s.published_reply = wire.ack_to_proto(ack, published.seed)
            s.published_reply.compute_ms = 1000 * published.compute_s
        return s.published_reply

    def publish_round(self, request_id: str, round: int) -> Published:
        """Commit the decision this worker made for ``round`` (the publish transaction: idempotent,
        a stale or future round refused, every check before the first write) -> the drafter's next
        seed and the emitted tokens."""
        s = self._session(request_id)
        verdict = next((v for v in (s.pending, s.published) if v is not None and v.round == round), None)
        if verdict is None:
            last = s.published.round if s.published is not None else "none"
            raise ValueError(
                f"round: {round} is stale, undecided or from the future "
                f"(last published {last}, decided {s.pending.round if s.pending else 'none'})"
            )
        if verdict is s.published and s.published_result is not None:
            return s.published_result[0]  # applied twice: a no-op with the same result
        t0 = time.perf_counter()
        seed, ack = s.engine.publish(request_id, round, verdict.decision)
        published = Published(
            seed=seed, tokens=tuple(ack.output_tokens), compute_s=time.perf_counter() - t0, logprobs=verdict.logprobs
        )
        s.pending, s.published, s.published_result, s.published_reply = None, verdict, (published, ack), None
        return published

    def close_session(self, request: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        return pb.CloseSessionResponse(closed=self.close(request.request_id))

    def close(self, request_id: str) -> bool:
        """:meth:`close_session` for a request id -> whether a session was closed."""
        wire.check_request_id(request_id)
        s = self.sessions.pop(request_id, None)
        if s is not None:
            try:
                if self.capture is not None:
                    rows = s.engine.committed_rows(request_id)
                    sample = None if rows is None else sample_of(rows, self.train_taps, request_id)
                    if sample is not None:
                        self.capture.add(sample)
            finally:
                s.engine.close_session(request_id)
        return s is not None

    def take_captured(self, max_samples: int | None = None) -> list:
        """The learning sessions' samples kept so far (``eyas.learning.capture``), oldest first, removed
        from the buffer: up to ``max_samples`` (None: all; [] when capture is off)."""
        return [] if self.capture is None else self.capture.take(max_samples)

    def capture_stats(self) -> dict[str, int]:
        """The capture buffer's counters (empty when capture is off)."""
        return {} if self.capture is None else self.capture.stats()

    # --- batched rounds (the scheduler: many requests, one forward) ------------------------------
    def verify_batch(self, requests: list[pb.FlatTree]) -> list[pb.AcceptDecision | Refusal]:
        """Verify and decide several requests' rounds in one forward per feature address
        (:meth:`round_batch` without prefills)."""
        return self.round_batch([], requests)[1]

    def prefill_batch(
        self, requests: list[pb.PrefillRequest], max_prefill_rows: int | None = None
    ) -> list[pb.AcceptDecision | PrefillProgress | Refusal]:
        """Prefill and decide several newly opened requests (:meth:`round_batch` without verifies)."""
        return self.round_batch(requests, [], max_prefill_rows)[0]

    def round_batch(
        self, prefills: list[pb.PrefillRequest], verifies: list[pb.FlatTree], max_prefill_rows: int | None = None
    ) -> tuple[list[pb.AcceptDecision | PrefillProgress | Refusal], list[pb.AcceptDecision | Refusal]]:
        """:meth:`step` for protobuf messages: each FlatTree is validated against its session
        (round, committed length, frontier, vocabulary, row budget) and decoded first; a message
        refused there gets its :class:`Refusal` and touches nothing."""
        trees: list = []
        for request in verifies:
            try:
                s = self._session(request.request_id)
                if s.pending is not None:
                    raise ValueError(f"round: {s.pending.round} of {request.request_id!r} is not yet published")
                trees.append(wire.draft_tree_from_flat(self._inbound_flat(s, request)))
            except (ValueError, SessionNotFound) as err:
                trees.append(Refusal.of(err))
        pre, ver = self.step(
            [p.request_id for p in prefills], [(r.request_id, t) for r, t in zip(verifies, trees)], max_prefill_rows
        )

        def encode(x):
            return x if isinstance(x, (Refusal, PrefillProgress)) else self._reply(self.sessions[x.request_id].pending)

        return [encode(x) for x in pre], [encode(x) for x in ver]

    def step(
        self, prefills: list[str], verifies: list[tuple[str, DraftTree | Refusal]], max_prefill_rows: int | None = None
    ) -> tuple[list[Decided | PrefillProgress | Refusal], list[Decided | Refusal]]:
        """One round's target work in ONE forward per feature address (``TargetEngine.step``): the
        next prompt chunk of each of ``prefills`` (at most ``max_prefill_rows`` prompt rows in all,
        shortest remaining prompt first; None: no bound) and the frontier + tree of each of
        ``verifies``, each then decided under its session's sampling. Objects in, objects out: a
        caller in this process passes its DraftTree as it is (a verify's rows are flattened once,
        by the engine, behind the session's own frontier and committed length).

        Each item is checked on its own; a refused one gets a :class:`Refusal` in its place and
        touches nothing, and the others are computed as if alone. A retried prefill gets its earlier
        decision again; a prompt with rows still to go gets a ``PrefillProgress``."""
        t0 = time.perf_counter()
        pre_out: list = [None] * len(prefills)
        ver_out: list = [None] * len(verifies)
        groups: dict[int, tuple[TargetEngine, list, list]] = {}  # engine -> (prefill members, verify members)
        seen: set[str] = set()
        for i, request_id in enumerate(prefills):
            try:
                if request_id in seen:
                    raise ValueError(f"request_id: {request_id!r} appears twice in one batch")
                seen.add(request_id)
                s = self._session(request_id)
                if s.pending is not None and s.pending.flat is None:
                    pre_out[i] = s.pending.decided  # a retried prefill: the same decision
                    continue
                groups.setdefault(id(s.engine), (s.engine, [], []))[1].append((i, s))
            except (ValueError, SessionNotFound) as err:
                pre_out[i] = Refusal.of(err)
        for i, (request_id, tree) in enumerate(verifies):
            try:
                if isinstance(tree, Refusal):  # refused while decoding (round_batch)
                    ver_out[i] = tree
                    continue
                if request_id in seen:
                    raise ValueError(f"request_id: {request_id!r} appears twice in one batch")
                seen.add(request_id)
                s = self._session(request_id)
                if s.pending is not None:
                    raise ValueError(f"round: {s.pending.round} of {request_id!r} is not yet published")
                if tree.num_nodes + 1 > s.max_tree_rows:
                    raise ValueError(f"tree_budget: {tree.num_nodes + 1} rows exceed the session's {s.max_tree_rows}")
                groups.setdefault(id(s.engine), (s.engine, [], []))[2].append((i, s, tree))
            except (ValueError, SessionNotFound) as err:
                ver_out[i] = Refusal.of(err)
        share = self._prefill_shares(prefills, groups, max_prefill_rows)
        for key, (engine, pre, ver) in groups.items():
            pre_done, ver_done = engine.step(
                [prefills[i] for i, _ in pre], [(verifies[i][0], tree) for i, _, tree in ver], share[key]
            )
            for (i, s), v in zip(pre, pre_done):
                pre_out[i] = (
                    Refusal.of(v)
                    if isinstance(v, ValueError)
                    else v
                    if isinstance(v, PrefillProgress)
                    else self._decide(s, v, t0).decided
                )
            for (i, s, _), v in zip(ver, ver_done):
                ver_out[i] = Refusal.of(v) if isinstance(v, ValueError) else self._decide(s, v, t0).decided
        return pre_out, ver_out

    @staticmethod
    def _prefill_shares(prefills: list[str], groups: dict, max_prefill_rows: int | None) -> dict[int, int | None]:
        """The round's prefill rows, shortest remaining prompt first across every engine (so a short
        prompt is not stuck behind a long one of another feature address): sorts each engine's
        prefill members into that order and returns each engine's share of the rows (None: no bound).
        Each engine's own shortest-first fill of its share then gives every prompt its rows."""

        def left(member) -> int:
            t = member[1].engine.sessions[prefills[member[0]]]
            return t.prompt_len - t.prefilled

        for _, pre, _ in groups.values():
            pre.sort(key=left)
        if max_prefill_rows is None:
            return {key: None for key in groups}
        share, budget = dict.fromkeys(groups, 0), max_prefill_rows
        for key, member in sorted(
            ((k, m) for k, (_, pre, _) in groups.items() for m in pre), key=lambda km: left(km[1])
        ):
            rows = min(left(member), budget)
            share[key], budget = share[key] + rows, budget - rows
        return share

    def publish_batch(self, requests: list[pb.PublishRequest]) -> list[pb.PublishAck | Refusal]:
        """Each request's own publish transaction; one refusal never touches another's state."""
        out = []
        for request in requests:
            try:
                out.append(self.publish(request))
            except (ValueError, SessionNotFound) as err:
                out.append(Refusal.of(err))
        return out

    def publish_rounds(self, rounds: list[tuple[str, int]]) -> list[Published | Refusal]:
        """:meth:`publish_round` for each ``(request id, round)``: objects in, objects out."""
        out = []
        for request_id, round_ in rounds:
            try:
                out.append(self.publish_round(request_id, round_))
            except (ValueError, SessionNotFound) as err:
                out.append(Refusal.of(err))
        return out

    def reseed(self, request: pb.ReseedRequest) -> pb.Seed:
        """The committed state as one seed from position 0, for a drafter that lost its session."""
        return wire.seed_to_proto(self.committed_seed(request.request_id), request_id=request.request_id)

    def committed_seed(self, request_id: str) -> Seed:
        """:meth:`reseed` as an object."""
        return self._session(request_id).engine.committed_seed(request_id)

    @torch.inference_mode()
    def measure_latency(
        self,
        rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
        repeats: int = 3,
        prefix: int = 64,
        taps: tuple[FeatureTap, ...] = (),
    ) -> dict[int, float]:
        """The verify latency curve on this worker's device: ms of a verify of R rows after a
        ``prefix``-token committed context (the median of ``repeats``), for each R in ``rows``,
        tapping ``taps`` as a drafter's sessions would. Each timed verify is a session's second: its
        first grows the K/V store past the prompt (a one-off a request pays once or twice, 10-20 ms
        at gguf against a 7 ms verify), which is not what a round costs."""
        from eyas.protocol.tree import DraftTree
        from eyas.scheduler.latency import measure_curve

        engine = self.engine_for(tuple(taps))
        ids = [(7 * i + 3) % self.vocab_size for i in range(prefix)]
        rid = "__latency_curve__"

        def run(r: int) -> float:
            engine.open_session(rid, ids, 4 + r, r)
            try:
                v = engine.prefill(rid)
                engine.publish(rid, v.round, AcceptDecision(torch.arange(prefix), torch.tensor(ids[1:]), 1))
                tree = DraftTree.chain([2] * (r - 1))
                v = engine.verify(rid, tree)  # the store grows here, untimed
                engine.publish(rid, v.round, AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 1))
                t0 = time.perf_counter()
                engine.verify(rid, tree)
                return time.perf_counter() - t0
            finally:
                engine.close_session(rid)

        curve = measure_curve(run, tuple(rows), repeats=repeats, warmup=1)
        return dict(zip(curve.rows, curve.ms))

    def cached_tokens(self, request_id: str) -> int:
        """The prompt tokens of a live request that its engine's prefix cache supplied."""
        s = self._session(request_id)
        return s.engine.sessions[request_id].cached_tokens

    def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache its engines share: tokens queried and hit, blocks, bytes held and allowed."""
        return self.prefix_cache.as_dict()

    # --- the leak invariant --------------------------------------------------------------------
    def leak_check(self) -> dict:
        """KV slots allocated == the sum over live sessions; no engine session without a worker one."""
        engine_ids = {rid for e in self.engines.values() for rid in e.sessions}
        allocated = sum(e.kv_slots_allocated() for e in self.engines.values())
        expected = sum(s.engine.sessions[rid].max_slots for rid, s in self.sessions.items() if rid in s.engine.sessions)
        return {
            "worker": self.name,
            "live_sessions": len(self.sessions),
            "kv_slots_allocated": allocated,
            "kv_slots_live": expected,
            "kv_bytes_allocated": sum(e.kv_bytes_allocated() for e in self.engines.values()),
            "kv_bytes_spare": sum(e.kv.spare_nbytes for e in self.engines.values()),  # kept for the next request
            "orphans": sorted(engine_ids ^ set(self.sessions)),
            "last_expert_bytes": sum(e.last_expert_bytes for e in self.engines.values()),  # MoE (design 0x09A)
            "ok": allocated == expected and engine_ids == set(self.sessions),
        }

    # --- internals -------------------------------------------------------------------------------
    def _session(self, request_id: str) -> WorkerSession:
        wire.check_request_id(request_id)
        s = self.sessions.get(request_id)
        if s is None or request_id not in s.engine.sessions:
            raise SessionNotFound(f"request_id: {request_id!r} has no live session")
        return s

    def _inbound_flat(self, s: WorkerSession, request: pb.FlatTree) -> FlatTree:
        """Validate an inbound FlatTree against the session (round, committed length, frontier, budget)."""
        t = s.engine.sessions[request.request_id]
        if t.frontier_token is None:
            raise ValueError("round: the session has no frontier token yet (prefill and publish round 0 first)")
        return wire.flat_tree_from_proto(
            request,
            vocab_size=self.vocab_size,
            max_rows=s.max_tree_rows,
            base_position=t.committed_len,
            round=t.round + 1,
            frontier_token=t.frontier_token,
        )

    def _decide(self, s: WorkerSession, verified, t0: float) -> Verdict:
        """Decide a verified round under the session's sampler; it is the session's pending verdict."""
        t1 = time.perf_counter()
        decision = decide_verified(s.engine, verified, s.prompt_ids, s.sampling, s.generator, s.grammar)
        logprobs = (
            None
            if s.logprobs is None
            else tuple(emitted_logprobs(verified.logits, decision, verified.flat is None, s.logprobs))
        )
        t2 = time.perf_counter()
        moe = verified.flat is not None and s.engine.cfg.num_experts  # MoE: what this verify read (design 0x09A)
        s.pending = Verdict(
            Decided(
                request_id=verified.request_id,
                round=verified.round,
                decision=decision,
                flat=verified.flat,
                compute_s=t2 - t0,
                accept_s=t2 - t1,
                expert_bytes=s.engine.last_request_expert_bytes.get(verified.request_id, 0) if moe else 0,
                batch_expert_bytes=s.engine.last_expert_bytes if moe else 0,
            ),
            logprobs=logprobs,
        )
        return s.pending

    @staticmethod
    def _reply(verdict: Verdict) -> pb.AcceptDecision:
        """The verdict as a message (encoded once)."""
        if verdict.reply is None:
            d = verdict.decided
            reply = wire.decision_to_proto(d.decision, request_id=d.request_id, round=d.round)
            reply.compute_ms, reply.accept_ms = 1000 * d.compute_s, 1000 * d.accept_s
            reply.expert_bytes, reply.batch_expert_bytes = d.expert_bytes, d.batch_expert_bytes
            verdict.reply = reply
        return verdict.reply
