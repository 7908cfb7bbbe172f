"""The target engine: the one owner of target weights, committed KV and provisional branch KV.

Per request it keeps a :class:`TargetSession`. A round is

1. :meth:`TargetEngine.verify` -- flatten the draft tree behind the frontier token (seed 0x05C),
   write every tree row's K/V into *provisional* slots after the committed prefix, and return the
   target logits and features of every row.
2. acceptance -- a pure function of the :class:`Verified` (``eyas.verification.accept``).
3. :meth:`TargetEngine.publish` -- the publish transaction (seed 0x05D), keyed by
   ``(request_id, round)``: gather the accepted rows' K/V onto the committed prefix by the
   verification's own row map (never by token equality), keep their features for the drafter's
   reseed, emit the frontier token and mark it *append required*: its K/V and feature come from
   the next forward, where it is the root row of the next tree.

Prefill is the same transaction with every prompt row accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.protocol.messages import AcceptDecision, PublishAck, Seed
from eyas.protocol.tree import DraftTree, FlatTree, flatten_tree
from eyas.target.experts import expert_bytes, expert_union
from eyas.target.model import FeatureTap, KVCache, MoE, Segment, TargetModel

PREFILL_ROUND = 0  # the round number of the prompt's prefill; speculation rounds count from 1


def check_context(prompt_tokens: int, max_new_tokens: int, max_context: int, prompt_field: str = "prompt",
                  note: str = "") -> None:
    """Refuse a request whose prompt and answer cannot fit in the target's context (one slot is the
    frontier token's): naming the prompt when it alone does not fit, else ``max_new_tokens``. The
    front door (the serving ingress) and the engine run the same rule."""
    if prompt_tokens + 1 > max_context:
        raise ValueError(f"{prompt_field}: {prompt_tokens} tokens do not fit in the target's context "
                         f"({max_context}{note})")
    if prompt_tokens + max_new_tokens + 1 > max_context:
        raise ValueError(f"max_new_tokens: prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) exceed the "
                         f"target's context ({max_context}{note}); at most {max_context - prompt_tokens - 1} here")


@dataclass(frozen=True)
class Verified:
    """Target output over one round's rows, still provisional."""

    request_id: str
    round: int
    flat: FlatTree | None      # None for the prompt prefill
    logits: torch.Tensor       # [R, V] float32 (prefill: [1, V], the last prompt row)
    features: torch.Tensor     # [R, F]


@dataclass
class TargetSession:
    """Mutable per-request target state. Only :class:`TargetEngine` touches it."""

    request_id: str
    cache: KVCache
    prompt_len: int
    committed_len: int = 0         # slots [0, committed_len) hold committed K/V
    round: int = PREFILL_ROUND     # the round of the last published (or pending) verify
    pending: Verified | None = None  # the verify of `round` awaiting publish
    frontier_token: int | None = None  # emitted, append required
    last_ack: PublishAck | None = None
    last_seed: Seed | None = None
    tokens: list[int] = field(default_factory=list)  # committed tokens (prompt + accepted)
    features: list[torch.Tensor] = field(default_factory=list)  # per publish [A, F]: committed rows' features


class TargetEngine:
    def __init__(self, model: TargetModel, taps: tuple[FeatureTap, ...]):
        self.model = model
        self.cfg = model.cfg
        self.taps = taps
        self.sessions: dict[str, TargetSession] = {}
        self.last_expert_union: tuple[tuple[int, ...], ...] = ()  # MoE: experts the last verify touched, per layer
        self.last_expert_bytes: int = 0
        self.last_request_expert_bytes: dict[str, int] = {}  # MoE: each request's own rows' union, last verify

    def expert_traffic_shape(self) -> dict[str, int]:
        """What the scheduler's expert model needs (``eyas.scheduler.cost.ExpertTraffic``): MoE layers,
        routed experts per layer, top-k and bytes of one expert; all 0 for a dense target."""
        moe_layers = sum(1 for layer in self.model.layers if isinstance(layer.mlp, MoE))
        if not self.cfg.num_experts or not moe_layers:
            return {"moe_layers": 0, "num_experts": 0, "experts_per_token": 0, "bytes_per_expert": 0}
        return {"moe_layers": moe_layers, "num_experts": self.cfg.num_experts,
                "experts_per_token": self.cfg.experts_per_token, "bytes_per_expert": self.cfg.expert_bytes_per_expert}

    # --- sessions ------------------------------------------------------------------------------
    def open_session(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, max_tree_rows: int) -> None:
        if request_id in self.sessions:
            raise ValueError(f"request_id: {request_id!r} already has a live session")
        if not prompt_ids:
            raise ValueError("prompt: must hold at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:5]} lie outside the vocabulary [0, {self.cfg.vocab_size})")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        window = ", the checkpoint's sliding window" if self.cfg.max_context < self.cfg.max_position_embeddings else ""
        check_context(len(prompt_ids), max_new_tokens, self.cfg.max_context, "prompt", window)
        slots = len(prompt_ids) + max_new_tokens + max_tree_rows + 1
        if slots > self.cfg.max_context:
            raise ValueError(f"tree_budget: prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) + the "
                             f"tree's {max_tree_rows} rows exceed the context ({self.cfg.max_context}{window}); "
                             "ask for a smaller tree or fewer tokens")
        self.sessions[request_id] = TargetSession(request_id, self.model.allocate_cache(1, slots), len(prompt_ids),
                                                  tokens=list(prompt_ids))

    def close_session(self, request_id: str) -> None:
        self.sessions.pop(request_id, None)

    def kv_slots_allocated(self) -> int:
        """KV slots held by live sessions (the leak invariant: 0 once every session is closed)."""
        return sum(s.cache.max_slots for s in self.sessions.values())

    def kv_bytes_allocated(self) -> int:
        return sum(s.cache.max_slots * s.cache.bytes_per_slot for s in self.sessions.values())

    def committed_seed(self, request_id: str) -> Seed:
        """A reseed for a drafter that lost its state: every committed row's verified feature from
        position 0 (seed 0x05D: a drafter reseeds from committed state, never an unverified row)."""
        s = self._session(request_id)
        if s.frontier_token is None or not s.features:
            raise ValueError(f"request_id: {request_id!r} has nothing committed yet (prefill and publish first)")
        return Seed(torch.cat(s.features), torch.tensor(s.tokens[1:] + [s.frontier_token], dtype=torch.int64),
                    start_position=0, round=s.round)

    def _session(self, request_id: str) -> TargetSession:
        if request_id not in self.sessions:
            raise ValueError(f"request_id: {request_id!r} has no live session")
        return self.sessions[request_id]

    # --- forward passes ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, request_id: str) -> Verified:
        s = self._session(request_id)
        if s.committed_len or s.pending is not None:
            raise ValueError(f"request_id: {request_id!r} is already prefilled")
        n = s.prompt_len
        tokens = torch.tensor([s.tokens], dtype=torch.int64)
        mask = torch.ones(n, n, dtype=torch.bool).tril_().unsqueeze(0)
        out = self.model(tokens, torch.arange(n).unsqueeze(0), s.cache, 0, mask, self.taps, logits_rows="last")
        s.pending = Verified(request_id, PREFILL_ROUND, None, out.logits[0], out.features[0])
        return s.pending

    @torch.inference_mode()
    def prefill_batch(self, request_ids: list[str]) -> list[Verified | ValueError]:
        """Prefill several requests' prompts in ONE forward (packed: each its own KV cache and causal
        mask; the LM head runs on each prompt's last row only). A request that cannot be prefilled
        (unknown, already prefilled) gets its ``ValueError`` in its place and is left out."""
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_id: a request appears twice in one batch")
        prepared: list[TargetSession | ValueError] = []
        for request_id in request_ids:
            try:
                s = self._session(request_id)
                if s.committed_len or s.pending is not None:
                    raise ValueError(f"request_id: {request_id!r} is already prefilled")
                prepared.append(s)
            except ValueError as err:
                prepared.append(err)
        ok = [s for s in prepared if not isinstance(s, ValueError)]
        segments = [Segment(torch.tensor(s.tokens, dtype=torch.int64), torch.arange(s.prompt_len), s.cache, 0,
                            torch.ones(s.prompt_len, s.prompt_len, dtype=torch.bool).tril_()) for s in ok]
        outs = iter(self.model.forward_packed(segments, self.taps, logits_rows="last") if ok else [])
        results: list[Verified | ValueError] = []
        for s in prepared:
            if isinstance(s, ValueError):
                results.append(s)
                continue
            out = next(outs)
            s.pending = Verified(s.request_id, PREFILL_ROUND, None, out.logits[0], out.features[0])
            results.append(s.pending)
        return results

    @torch.inference_mode()
    def verify(self, request_id: str, tree: DraftTree) -> Verified:
        """Run the frontier token plus ``tree`` as one forward over provisional slots (seed 0x05C)."""
        s, flat, mask = self._prepare_verify(request_id, tree)
        out = self.model(flat.tokens.unsqueeze(0), flat.positions.unsqueeze(0), s.cache, s.committed_len,
                         None if mask is None else mask.unsqueeze(0), self.taps, logits_rows="all")
        s.pending = Verified(request_id, s.round + 1, flat, out.logits[0], out.features[0])
        self._account_experts([(request_id, flat.num_rows)])
        return s.pending

    def _account_experts(self, members: list[tuple[str, int]]) -> None:
        """Record the union of experts the forward's rows routed to, and its weight bytes, for the
        whole forward and for each member request's own rows (``members``: (request id, rows) in
        packed order) (seed 0x09A)."""
        if self.cfg.num_experts:
            routing = self.model.expert_routing()
            self.last_expert_union = expert_union(routing)
            self.last_expert_bytes = expert_bytes(self.last_expert_union, self.cfg.expert_bytes_per_expert)
            lo, per_request = 0, {}
            for request_id, rows in members:
                per_request[request_id] = expert_bytes(expert_union(routing, slice(lo, lo + rows)),
                                                       self.cfg.expert_bytes_per_expert)
                lo += rows
            self.last_request_expert_bytes = per_request

    @torch.inference_mode()
    def verify_batch(self, items: list[tuple[str, DraftTree]]) -> list[Verified | ValueError]:
        """Verify several requests' trees in ONE forward (a ragged batch: each request keeps its own
        KV cache, positions and tree mask; no row sees another request's keys).

        A request whose tree fails validation gets its ``ValueError`` in its place of the result and
        is left out of the forward; every other request is verified as if alone.
        """
        if len({rid for rid, _ in items}) != len(items):
            raise ValueError("request_id: a request appears twice in one batch")
        prepared: list[tuple[TargetSession, FlatTree, torch.Tensor | None] | ValueError] = []
        for request_id, tree in items:
            try:
                prepared.append(self._prepare_verify(request_id, tree))
            except ValueError as err:
                prepared.append(err)
        ok = [p for p in prepared if not isinstance(p, ValueError)]
        outs = iter(self.model.forward_packed(
            [Segment(flat.tokens, flat.positions, s.cache, s.committed_len, mask) for s, flat, mask in ok],
            self.taps) if ok else [])
        if ok:
            self._account_experts([(s.request_id, flat.num_rows) for s, flat, _ in ok])
        results: list[Verified | ValueError] = []
        for p in prepared:
            if isinstance(p, ValueError):
                results.append(p)
                continue
            s, flat, _ = p
            out = next(outs)
            s.pending = Verified(s.request_id, s.round + 1, flat, out.logits[0], out.features[0])
            results.append(s.pending)
        return results

    def _prepare_verify(self, request_id: str, tree: DraftTree) -> tuple[TargetSession, FlatTree, torch.Tensor | None]:
        """Every check of a verify, before any forward: -> (session, flat rows, mask [R, n+R] or None)."""
        s = self._session(request_id)
        if s.pending is not None:
            raise ValueError(f"round: {s.pending.round} of {request_id!r} is not yet published")
        if s.frontier_token is None:
            raise ValueError(f"request_id: {request_id!r} has no frontier token (prefill first)")
        n = s.committed_len
        flat = flatten_tree(tree, s.frontier_token, n)
        rows = flat.num_rows
        if n + rows > s.cache.max_slots:
            raise ValueError(f"rows: {rows} tree rows exceed the session's KV budget "
                             f"({s.cache.max_slots - n} slots left)")
        mask = torch.cat([torch.ones(rows, n, dtype=torch.bool), flat.tree_mask], dim=1) if rows > 1 else None
        return s, flat, mask

    # --- the publish transaction (seed 0x05D) ------------------------------------------------------
    def publish(self, request_id: str, round: int, decision: AcceptDecision) -> tuple[Seed, PublishAck]:
        """Commit the accepted rows of round ``round``; idempotent; a stale or future round is refused.

        Every check and every read happens before the first write, and ``committed_len`` moves
        last, so a failure leaves the committed prefix ``[0, committed_len)`` as it was.
        """
        s = self._session(request_id)
        if s.last_ack is not None and round == s.last_ack.round:
            return s.last_seed, s.last_ack  # applied twice: a no-op with the same ack
        if s.pending is None or round != s.pending.round:
            expected = s.pending.round if s.pending is not None else s.round + 1
            raise ValueError(f"round: {round} is stale or from the future (expected {expected})")
        v = s.pending
        rows = decision.accepted_rows  # [A] flat rows, from the verification's retrieve map
        if v.flat is None:  # prefill: every prompt row is accepted
            if rows.tolist() != list(range(s.prompt_len)):
                raise ValueError("accepted_rows: a prefill accepts exactly the prompt rows")
            features = v.features
        else:
            if int(rows.max()) >= v.flat.num_rows:
                raise ValueError(f"accepted_rows: {rows.tolist()} reach past the {v.flat.num_rows} verified rows")
            if not torch.equal(v.flat.tokens[rows[1:]], decision.accepted_tokens):
                raise ValueError("accepted_tokens: do not match the verified rows they name")
            features = v.features.index_select(0, rows)  # [A, F]
        if not 0 <= decision.frontier_token < self.cfg.vocab_size:
            raise ValueError(f"frontier_token: {decision.frontier_token} lies outside the vocabulary")
        n, a = s.committed_len, rows.numel()
        new_rows = [] if v.flat is None else [s.frontier_token] + decision.accepted_tokens.tolist()
        emitted = (decision.frontier_token,) if v.flat is None else tuple(decision.emitted_tokens)
        committed_tokens = s.tokens + new_rows
        seed = Seed(features.clone(),
                    torch.tensor(committed_tokens[n + 1:] + [decision.frontier_token], dtype=torch.int64),
                    start_position=n, round=round)
        ack = PublishAck(request_id, round, n + a, emitted)
        # -- writes: K/V first (into slots >= n only), then the bookkeeping, committed_len last --
        if v.flat is not None:
            s.cache.gather_commit(n + rows, n)  # provisional slot n + r -> committed slot n + i
        s.tokens = committed_tokens
        s.features.append(seed.features)
        s.frontier_token = decision.frontier_token
        s.pending, s.round, s.last_ack, s.last_seed = None, round, ack, seed
        s.committed_len = n + a
        return seed, ack
