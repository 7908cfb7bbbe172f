"""The target engine: the one owner of target weights, committed KV and provisional branch KV.

Per request it keeps a :class:`TargetSession`. A round is

1. :meth:`TargetEngine.verify` -- flatten the draft tree behind the frontier token (design 0x05C),
   write every tree row's K/V into *provisional* slots after the committed prefix, and return the
   target logits and features of every row.
2. acceptance -- a pure function of the :class:`Verified` (``eyas.verification.accept``).
3. :meth:`TargetEngine.publish` -- the publish transaction (design 0x05D), keyed by
   ``(request_id, round)``: gather the accepted rows' K/V onto the committed prefix by the
   verification's own row map (never by token equality), keep their features for the drafter's
   reseed, emit the frontier token and mark it *append required*: its K/V and feature come from
   the next forward, where it is the root row of the next tree.

Prefill is the same transaction with every prompt row accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eyas.compute import keep_freed_memory
from eyas.protocol.checks import check_in_vocab
from eyas.protocol.messages import AcceptDecision, PublishAck, Seed
from eyas.protocol.tree import DraftTree, FlatTree, flatten_tree
from eyas.target.batch_kv import BatchKV, BatchRows, RowGroup
from eyas.target.config import FeatureTap
from eyas.target.experts import expert_bytes, expert_union
from eyas.target.layers import MoE
from eyas.target.model import TargetModel
from eyas.target.prefix_cache import BLOCK_TOKENS, CachedBlock, PrefixCache, block_hashes

PREFILL_ROUND = 0  # the round number of the prompt's prefill; speculation rounds count from 1


def check_context(
    prompt_tokens: int, max_new_tokens: int, max_context: int, prompt_field: str = "prompt", note: str = ""
) -> None:
    """Refuse a request whose prompt and answer cannot fit in the target's context (one slot is the
    frontier token's): naming the prompt when it alone does not fit, else ``max_new_tokens``. The
    front door (the serving ingress) and the engine run the same rule."""
    if prompt_tokens + 1 > max_context:
        raise ValueError(
            f"{prompt_field}: {prompt_tokens} tokens do not fit in the target's context ({max_context}{note})"
        )
    if prompt_tokens + max_new_tokens + 1 > max_context:
        raise ValueError(
            f"max_new_tokens: prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) exceed the "
            f"target's context ({max_context}{note}); at most {max_context - prompt_tokens - 1} here"
        )


@dataclass(frozen=True)
class Verified:
    """Target output over one round's rows, still provisional."""

    request_id: str
    round: int
    flat: FlatTree | None  # None for the prompt prefill
    logits: torch.Tensor  # [R, V] float32 (prefill: [1, V], the last prompt row)
    features: torch.Tensor  # [R, F]
    captured: torch.Tensor | None = None  # [R, C]: the engine's capture taps of each row (None: none)
    # [R] int64: each row's first maximal logit, from the head's kernel (None: not computed)
    argmax: torch.Tensor | None = None


@dataclass(frozen=True)
class PrefillProgress:
    """A prompt still being prefilled (chunked prefill): ``prefilled`` of its ``prompt_len`` rows
    have provisional K/V; the rest come in later rounds, and the prefill's :class:`Verified` comes
    with the chunk that finishes it."""

    request_id: str
    prefilled: int
    prompt_len: int


@dataclass(frozen=True)
class CommittedRows:
    """A learning session's committed state, for the drafter that learns from served traffic
    (``eyas.learning``): row ``j`` is committed token ``j`` as an input; its features predict token ``j + 1``."""

    tokens: torch.Tensor  # [S] int64: prompt + committed answer
    prompt_len: int
    features: torch.Tensor  # [S, F]: the served taps of every committed row
    captured: torch.Tensor  # [S - prompt_len, C]: the capture taps of the committed answer rows
    taps: tuple[FeatureTap, ...]
    capture_taps: tuple[FeatureTap, ...]


@dataclass
class TargetSession:
    """Mutable per-request target state. Only :class:`TargetEngine` touches it."""

    request_id: str
    kv_row: int  # this request's row of the engine's BatchKV
    max_slots: int  # its slot budget: prompt + max_new_tokens + the tree's rows + 1
    prompt_len: int
    committed_len: int = 0  # slots [0, committed_len) hold committed K/V
    round: int = PREFILL_ROUND  # the round of the last published (or pending) verify
    pending: Verified | None = None  # the verify of `round` awaiting publish
    frontier_token: int | None = None  # emitted, append required
    last_ack: PublishAck | None = None
    last_seed: Seed | None = None
    tokens: list[int] = field(default_factory=list)  # committed tokens (prompt + accepted)
    features: list[torch.Tensor] = field(default_factory=list)  # per publish [A, F]: committed rows' features
    prefilled: int = 0  # prompt rows with provisional K/V so far (chunked prefill)
    prefill_features: list[torch.Tensor] = field(default_factory=list)  # per chunk [T, F]
    cached_tokens: int = 0  # prompt rows whose K/V and features came from the prefix cache
    learn: bool = False  # keep the committed answer rows' capture taps (the engine's capture_taps)
    captured: list[torch.Tensor] = field(default_factory=list)  # per verify publish [A, C]


class TargetEngine:
    """Owner of the target's weights and of every live request's K/V, in ONE padded store
    (:class:`~eyas.target.batch_kv.BatchKV`): a round's prefill chunks, decode rows and tree rows
    all run as one forward with one attention call per layer (:meth:`step`)."""

    def __init__(
        self,
        model: TargetModel,
        taps: tuple[FeatureTap, ...],
        prefix_cache: PrefixCache | int = 0,
        capture_taps: tuple[FeatureTap, ...] = (),
    ):
        """``prefix_cache``: the model's prefix cache (``eyas.target.prefix_cache``), shared by its
        engines, or the byte budget of one of this engine's own (0: off): committed K/V and feature
        rows of prompts and answers seen before, reused by a new prompt that starts the same way.
        ``capture_taps``: features beyond ``taps`` that every forward also computes (from the same
        pass: no extra forward) and that a session opened with ``learn`` keeps for its committed
        answer rows (``eyas.learning``: what a drafter learns from; () = none)."""
        keep_freed_memory()  # a round's [rows, vocabulary] logits and the like reuse freed memory (eyas.compute)
        self.model = model
        self.cfg = model.cfg
        self.taps = taps
        self.capture_taps = tuple(t for t in capture_taps if t not in taps)
        self.sessions: dict[str, TargetSession] = {}
        self.prefix_cache = prefix_cache if isinstance(prefix_cache, PrefixCache) else PrefixCache(prefix_cache)
        key_dtype, key_width = model.key_layout
        self.kv = BatchKV(
            self.cfg.num_layers,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            model.kv_dtype,
            model.embed.weight.device,
            key_dtype=key_dtype,
            key_width=key_width,
        )
        self.last_expert_union: tuple[tuple[int, ...], ...] = ()  # MoE: experts the last verify touched, per layer
        self.last_expert_bytes: int = 0
        self.last_request_expert_bytes: dict[str, int] = {}  # MoE: each request's own rows' union, last verify

    def expert_traffic_shape(self) -> dict[str, int]:
        """What the scheduler's expert model needs (``eyas.scheduler.cost.ExpertTraffic``): MoE layers,
        routed experts per layer, top-k and bytes of one expert; all 0 for a dense target."""
        moe_layers = sum(1 for layer in self.model.layers if isinstance(layer.mlp, MoE))
        if not self.cfg.num_experts or not moe_layers:
            return {"moe_layers": 0, "num_experts": 0, "experts_per_token": 0, "bytes_per_expert": 0}
        return {
            "moe_layers": moe_layers,
            "num_experts": self.cfg.num_experts,
            "experts_per_token": self.cfg.experts_per_token,
            "bytes_per_expert": self.cfg.expert_bytes_per_expert,
        }

    # --- sessions ------------------------------------------------------------------------------
    def open_session(
        self, request_id: str, prompt_ids: list[int], max_new_tokens: int, max_tree_rows: int, learn: bool = False
    ) -> None:
        if request_id in self.sessions:
            raise ValueError(f"request_id: {request_id!r} already has a live session")
        if not prompt_ids:
            raise ValueError("prompt: must hold at least one token")
        check_in_vocab(prompt_ids, self.cfg.vocab_size, "prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        window = ", the checkpoint's sliding window" if self.cfg.max_context < self.cfg.max_position_embeddings else ""
        check_context(len(prompt_ids), max_new_tokens, self.cfg.max_context, "prompt", window)
        slots = len(prompt_ids) + max_new_tokens + max_tree_rows + 1
        if slots > self.cfg.max_context:
            raise ValueError(
                f"tree_budget: prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) + the "
                f"tree's {max_tree_rows} rows exceed the context ({self.cfg.max_context}{window}); "
                "ask for a smaller tree or fewer tokens"
            )
        s = TargetSession(
            request_id,
            self.kv.open_row(request_id, slots),
            slots,
            len(prompt_ids),
            tokens=list(prompt_ids),
            learn=learn and bool(self.capture_taps),
        )
        self.sessions[request_id] = s
        if self.prefix_cache.capacity_bytes:
            # the longest cached prefix, short of the last prompt token (its logits give the first token)
            hit = self.prefix_cache.lookup(s.tokens, s.prompt_len - 1, self.taps)
            if hit:
                n = len(hit) * BLOCK_TOKENS
                self.kv.write_prefix(
                    s.kv_row, torch.cat([b.keys for b in hit], dim=2), torch.cat([b.values for b in hit], dim=2)
                )
                s.prefill_features = [torch.cat([b.features[self.taps] for b in hit])] if self.taps else []
                s.prefilled = s.cached_tokens = n

    def close_session(self, request_id: str) -> None:
        """Forget a request (its committed blocks offered to the prefix cache first); the last KV row
        moves into its place, so live rows stay ``[0, live)``."""
        s = self.sessions.get(request_id)
        if s is not None and s.committed_len:
            self._offer_blocks(s)
        self.kv.close_session(self.sessions, request_id)

    def _offer_blocks(self, s: TargetSession) -> None:
        """Put ``s``'s committed full blocks that the prefix cache lacks into it: K/V copied from its
        committed slots, features from its committed rows (design 0x05D: committed state only; each
        block complete before it is visible)."""
        cache = self.prefix_cache
        if not cache.capacity_bytes:
            return
        chain = block_hashes(s.tokens, s.committed_len // BLOCK_TOKENS)
        missing = cache.missing(chain, self.taps)
        new = {}
        if missing:
            features = torch.cat(s.features) if self.taps else None  # [committed_len, F]
            for i, h in missing:
                a, b = i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS
                feats = {self.taps: features[a:b].clone()} if self.taps else {}
                if h in cache.blocks:  # cached for another address: only this one's features are new
                    new[h] = CachedBlock(cache.blocks[h].keys, cache.blocks[h].values, feats)
                else:
                    new[h] = CachedBlock(*self.kv.read_span(s.kv_row, a, b), feats)
        cache.insert_chain(chain, new)

    def prefix_cache_stats(self) -> dict[str, int]:
        """The prefix cache's counters (tokens queried and hit, blocks in and out) and its bytes."""
        return self.prefix_cache.as_dict()

    def kv_slots_allocated(self) -> int:
        """KV slots reserved by live sessions (the leak invariant: 0 once every session is closed)."""
        return sum(s.max_slots for s in self.sessions.values())

    def kv_bytes_allocated(self) -> int:
        """Bytes the padded store holds (rows x the longest budget; 0 once every session is closed)."""
        return self.kv.nbytes

    def committed_kv(self, request_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's committed keys and values, views of its KV row ([L, H_kv, committed_len, hd] each)."""
        s = self._session(request_id)
        return self.kv.k[:, s.kv_row, :, : s.committed_len], self.kv.v[:, s.kv_row, :, : s.committed_len]

    def answer_ids(self, request_id: str) -> list[int]:
        """The committed answer so far: the accepted tokens after the prompt (the frontier, emitted
        but not yet an input row, excluded). The history the logits processors read."""
        s = self._session(request_id)
        return s.tokens[s.prompt_len :]

    def committed_seed(self, request_id: str) -> Seed:
        """A reseed for a drafter that lost its state: every committed row's verified feature from
        position 0 (design 0x05D: a drafter reseeds from committed state, never an unverified row)."""
        s = self._session(request_id)
        if s.frontier_token is None or not s.features:
            raise ValueError(f"request_id: {request_id!r} has nothing committed yet (prefill and publish first)")
        return Seed(
            torch.cat(s.features),
            torch.tensor(s.tokens[1:] + [s.frontier_token], dtype=torch.int64),
            start_position=0,
            round=s.round,
        )

    def committed_rows(self, request_id: str) -> CommittedRows | None:
        """A session opened with ``learn``: its committed rows and their features (None: not learning,
        or no answer row committed yet)."""
        s = self._session(request_id)
        if not s.learn or not s.captured:
            return None
        captured = torch.cat(s.captured)
        assert captured.shape[0] == s.committed_len - s.prompt_len, "one captured row per committed answer row"
        return CommittedRows(
            torch.tensor(s.tokens[: s.committed_len], dtype=torch.int64),
            s.prompt_len,
            torch.cat(s.features)[: s.committed_len],
            captured,
            self.taps,
            self.capture_taps,
        )

    def _session(self, request_id: str) -> TargetSession:
        if request_id not in self.sessions:
            raise ValueError(f"request_id: {request_id!r} has no live session")
        return self.sessions[request_id]

    # --- forward passes ------------------------------------------------------------------------
    def prefill(self, request_id: str) -> Verified:
        """The whole prompt in one forward (no chunking)."""
        (out,), _ = self.step([request_id], [])
        if isinstance(out, ValueError):
            raise out
        return out

    def prefill_batch(
        self, request_ids: list[str], max_prefill_rows: int | None = None
    ) -> list[Verified | PrefillProgress | ValueError]:
        """Prefill several requests' prompts in one forward, at most ``max_prefill_rows`` prompt rows
        in all (None: no bound); see :meth:`step`."""
        return self.step(request_ids, [], max_prefill_rows)[0]

    def verify(self, request_id: str, tree: DraftTree) -> Verified:
        """Run the frontier token plus ``tree`` as one forward over provisional slots (design 0x05C)."""
        _, (out,) = self.step([], [(request_id, tree)])
        if isinstance(out, ValueError):
            raise out
        return out

    def verify_batch(self, items: list[tuple[str, DraftTree]]) -> list[Verified | ValueError]:
        """Verify several requests' trees in one forward; see :meth:`step`."""
        return self.step([], items)[1]

    @torch.inference_mode()
    def step(
        self, prefills: list[str], verifies: list[tuple[str, DraftTree]], max_prefill_rows: int | None = None
    ) -> tuple[list[Verified | PrefillProgress | ValueError], list[Verified | ValueError]]:
        """ONE forward for a round: the next chunk of each prompt in ``prefills`` (in order, at most
        ``max_prefill_rows`` prompt rows in all, None: no bound) and the frontier token plus tree of
        each of ``verifies`` (design 0x05C), with one attention call per layer over the K/V store.

        A request that cannot take part (unknown, already prefilled, a bad tree, twice in the round)
        gets its ``ValueError`` in its place and is left out; every other is computed as if alone.
        A prompt whose last chunk ran gets its :class:`Verified` (publish it as round 0); one with
        rows still to go gets a :class:`PrefillProgress`."""
        named = list(prefills) + [rid for rid, _ in verifies]
        if len(set(named)) != len(named):
            raise ValueError("request_id: a request appears twice in one batch")
        if max_prefill_rows is not None and max_prefill_rows < 0:
            raise ValueError(f"max_prefill_rows: must be >= 0, got {max_prefill_rows}")
        budget = max_prefill_rows
        groups, logit_rows, jobs, lo = [], [], [], 0  # jobs: (kind, session, payload, (lo, hi))
        pre_out: list = [None] * len(prefills)
        ver_out: list = [None] * len(verifies)
        for i, request_id in enumerate(prefills):
            try:
                s = self._session(request_id)
                if s.committed_len or s.pending is not None:
                    raise ValueError(f"request_id: {request_id!r} is already prefilled")
            except ValueError as err:
                pre_out[i] = err
                continue
            c0 = s.prefilled
            c1 = s.prompt_len if budget is None else min(s.prompt_len, c0 + budget)
            if c1 == c0:  # no prefill rows left this round
                pre_out[i] = PrefillProgress(request_id, c0, s.prompt_len)
                continue
            if budget is not None:
                budget -= c1 - c0
            t = c1 - c0
            mask = torch.ones(t, c1, dtype=torch.bool).tril_(c0)
            groups.append(
                RowGroup(
                    s.kv_row,
                    torch.tensor(s.tokens[c0:c1], dtype=torch.int64),
                    torch.arange(c0, c1),
                    c0,
                    mask if t > 1 or c0 else None,
                )
            )
            if c1 == s.prompt_len:
                logit_rows.append(lo + t - 1)
            jobs.append(("prefill", i, s, (c0, c1), (lo, lo + t)))
            lo += t
        for i, (request_id, tree) in enumerate(verifies):
            try:
                s, flat, mask = self._prepare_verify(request_id, tree)
            except ValueError as err:
                ver_out[i] = err
                continue
            groups.append(RowGroup(s.kv_row, flat.tokens, flat.positions, s.committed_len, mask))
            logit_rows.extend(range(lo, lo + flat.num_rows))
            jobs.append(("verify", i, s, flat, (lo, lo + flat.num_rows)))
            lo += flat.num_rows
        if not groups:
            return pre_out, ver_out
        plan = BatchRows.build(groups, self.kv.device)
        rows = "all" if len(logit_rows) == plan.num_rows else torch.tensor(logit_rows, dtype=torch.int64)
        out = self.model.forward_batch(self.kv, plan, self.taps + self.capture_taps, rows)
        served = len(self.taps) * self.cfg.hidden_size
        logits, features = out.logits[0], out.features[0][:, :served]  # [n_logit_rows, V], [N, F]
        argmax = out.argmax[0] if out.argmax is not None else None  # [n_logit_rows]
        captured = out.features[0][:, served:] if self.capture_taps else None  # [N, C]
        at = {r: j for j, r in enumerate(logit_rows)}  # packed row -> its logits row
        if any(kind == "verify" for kind, *_ in jobs):
            self._account_experts([(s.request_id, b - a) for _, _, s, _, (a, b) in jobs])
        for kind, i, s, payload, (a, b) in jobs:
            if kind == "prefill":
                c0, c1 = payload
                s.prefill_features.append(features[a:b])
                s.prefilled = c1
                if c1 < s.prompt_len:
                    pre_out[i] = PrefillProgress(s.request_id, c1, s.prompt_len)
                    continue
                s.pending = Verified(
                    s.request_id,
                    PREFILL_ROUND,
                    None,
                    logits[at[b - 1]][None],
                    torch.cat(s.prefill_features),
                    argmax=None if argmax is None else argmax[at[b - 1]][None],
                )
                s.prefill_features = []
                pre_out[i] = s.pending
            else:
                s.pending = Verified(
                    s.request_id,
                    s.round + 1,
                    payload,
                    logits[at[a] : at[a] + b - a],
                    features[a:b],
                    captured[a:b] if captured is not None and s.learn else None,
                    argmax=None if argmax is None else argmax[at[a] : at[a] + b - a],
                )
                ver_out[i] = s.pending
        return pre_out, ver_out

    def _account_experts(self, members: list[tuple[str, int]]) -> None:
        """Record the union of experts the forward's rows routed to, and its weight bytes, for the
        whole forward and for each member request's own rows (``members``: (request id, rows) in
        packed order) (design 0x09A)."""
        if self.cfg.num_experts:
            routing = self.model.expert_routing()
            self.last_expert_union = expert_union(routing)
            self.last_expert_bytes = expert_bytes(self.last_expert_union, self.cfg.expert_bytes_per_expert)
            lo, per_request = 0, {}
            for request_id, rows in members:
                per_request[request_id] = expert_bytes(
                    expert_union(routing, slice(lo, lo + rows)), self.cfg.expert_bytes_per_expert
                )
                lo += rows
            self.last_request_expert_bytes = per_request

    def _prepare_verify(self, request_id: str, tree: DraftTree) -> tuple[TargetSession, FlatTree, torch.Tensor | None]:
        """Every check of a verify, before any forward: -> (session, flat rows, mask [R, n+R] or None)."""
        s = self._session(request_id)
        if s.pending is not None:
            raise ValueError(f"round: {s.pending.round} of {request_id!r} is not yet published")
        if s.frontier_token is None:
            raise ValueError(f"request_id: {request_id!r} has no frontier token (prefill first)")
        n = s.committed_len
        rows = 1 + tree.num_nodes
        if n + rows > s.max_slots:
            raise ValueError(f"rows: {rows} tree rows exceed the session's KV budget ({s.max_slots - n} slots left)")
        fused = self.model.fused
        if fused is not None and rows > 1 and tree.tokens.device.type == "cpu":  # gguf: one kernel call
            tokens, positions, parents, depths, tree_mask, retrieve, probs, mask = fused.kernels.flatten_tree(
                tree.tokens, tree.parents, tree.depths, tree.draft_probs, s.frontier_token, n, n
            )
            flat = FlatTree(
                tokens=tokens, positions=positions, parents=parents, depths=depths, tree_mask=tree_mask,
                retrieve=retrieve, draft_probs=probs,
            )  # fmt: skip
            return s, flat, mask
        flat = flatten_tree(tree, s.frontier_token, n)
        mask = torch.cat([torch.ones(rows, n, dtype=torch.bool), flat.tree_mask], dim=1) if rows > 1 else None
        return s, flat, mask

    # --- the publish transaction (design 0x05D) ------------------------------------------------------
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
        rows = decision.accepted_rows.cpu()  # [A] flat rows, from the verification's retrieve map (host side)
        row_list = rows.tolist()
        on_device = rows.to(self.kv.device)  # the same, to index the features and K/V on the engine's device
        if v.flat is None:  # prefill: every prompt row is accepted
            if row_list != list(range(s.prompt_len)):
                raise ValueError("accepted_rows: a prefill accepts exactly the prompt rows")
            features = v.features.clone()
        else:
            if max(row_list) >= v.flat.num_rows:
                raise ValueError(f"accepted_rows: {row_list} reach past the {v.flat.num_rows} verified rows")
            flat_tokens = v.flat.tokens.tolist()
            if [flat_tokens[r] for r in row_list[1:]] != decision.accepted_tokens.tolist():
                raise ValueError("accepted_tokens: do not match the verified rows they name")
            features = v.features.index_select(0, on_device)  # [A, F], a tensor of its own
        if not 0 <= decision.frontier_token < self.cfg.vocab_size:
            raise ValueError(f"frontier_token: {decision.frontier_token} lies outside the vocabulary")
        n, a = s.committed_len, rows.numel()
        new_rows = [] if v.flat is None else [s.frontier_token] + decision.accepted_tokens.tolist()
        emitted = (decision.frontier_token,) if v.flat is None else tuple(decision.emitted_tokens)
        committed_tokens = s.tokens + new_rows
        seed = Seed(
            features,
            torch.tensor(committed_tokens[n + 1 :] + [decision.frontier_token], dtype=torch.int64),
            start_position=n,
            round=round,
        )
        ack = PublishAck(request_id, round, n + a, emitted)
        # -- writes: K/V first (into slots >= n only), then the bookkeeping, committed_len last --
        if v.flat is not None and row_list != list(range(a)):  # rows 0..a-1 already sit at their slots
            self.kv.commit(s.kv_row, n + on_device, n)  # provisional slot n + r -> committed slot n + i
        s.tokens = committed_tokens
        s.features.append(seed.features)
        if v.captured is not None:
            s.captured.append(v.captured.index_select(0, on_device).clone())
        s.frontier_token = decision.frontier_token
        s.pending, s.round, s.last_ack, s.last_seed = None, round, ack, seed
        s.committed_len = n + a
        if v.flat is None:  # the prompt is committed: its blocks serve the next request that shares them
            self._offer_blocks(s)
        return seed, ack
