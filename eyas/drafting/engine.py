"""The drafter engine: the one owner of drafter weights and draft KV.

Every live request's draft K/V lives in one padded store (``BatchKV``, as the target engine's:
``eyas.target.batch_kv``); a :class:`DraftSession` owns one row of it. Its slots ``[0, committed_len)``
are *context rows*: draft rows whose state is a verified target feature (design 0x05D: the drafter
never commits a row built on an unverified feature). A round:

1. :meth:`DrafterEngine.propose` appends the new context rows of the :class:`~eyas.target.engine.Seed`
   (the features of the rows the target just committed), then grows a tree (design 0x05B, 0x06B):
   the seed's last context row proposes the depth-1 candidates; each expanded node becomes one
   draft row in a *provisional* slot, reading its parent's output state and its own token, and
   attending to the context rows plus its tree ancestors. Its output proposes its children.
2. :meth:`DrafterEngine.publish` discards the provisional rows. The next seed carries the verified
   features that replace them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from eyas.compute import keep_freed_memory
from eyas.drafting.model import Drafter
from eyas.drafting.tree import DEFAULT_STATIC_CHOICES, DynamicTreeBuilder, StaticTreeBuilder, chain_choices
from eyas.protocol.messages import Seed
from eyas.protocol.tree import PARENT_IS_ROOT, DraftTree
from eyas.target.batch_kv import RowGroup
from eyas.target.config import FeatureTap

TREE_KINDS = ("dynamic", "static", "chain")
# seed rows up to which one request's round runs through the fused step (its attention is a kernel's row by
# row: past ~256 rows over a long context torch's attention on the Python path is as fast; a seed of 8 rows
# 0.33 vs 0.80 ms, 64 rows 1.49 vs 1.95, 256 rows 11.2 vs 13.3 on a fresh session, 15.1 vs 15.0 after 500)
FUSED_SEED_ROWS = 256


@dataclass(frozen=True)
class TreeSpec:
    """The tree a drafter grows per round. EAGLE-2's three knobs stay separate (design 0x06D)."""

    kind: str = "dynamic"
    expand_width: int = 4  # dynamic: nodes expanded per depth, and children per expanded node
    max_depth: int = 5  # dynamic and chain: the deepest candidate
    verify_budget: int = 16  # dynamic: candidate rows sent to the verifier (the root excluded)
    choices: tuple[tuple[int, ...], ...] = DEFAULT_STATIC_CHOICES  # static: child-rank paths
    # dynamic, cost-aware: path-value floors for a verified node and for an expanded one
    # (``eyas.drafting.tree``, "value floors"); 0 and 0 is plain EAGLE-2
    min_value: float = 0.0
    expand_min_value: float = 0.0

    def __post_init__(self):
        if self.kind not in TREE_KINDS:
            raise ValueError(f"tree.kind: {self.kind!r} is not one of {TREE_KINDS}")
        for name in ("expand_width", "max_depth", "verify_budget"):
            value = getattr(self, name)
            if type(value) is not int or value < (1 if name == "expand_width" else 0):
                raise ValueError(f"tree.{name}: {value!r} is not a valid count")
        for name in ("min_value", "expand_min_value"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"tree.{name}: a path-value floor must be a number in [0, 1], got {value!r}")

    @property
    def cost_aware(self) -> bool:
        """Whether a value floor prunes the tree (a dynamic tree only)."""
        return self.kind == "dynamic" and (self.min_value > 0 or self.expand_min_value > 0)

    def builder(self):
        if self.kind == "dynamic":
            return DynamicTreeBuilder(
                expand_width=self.expand_width,
                verify_budget=self.verify_budget,
                max_depth=self.max_depth,
                min_value=self.min_value,
                expand_min_value=self.expand_min_value,
            )
        if self.kind == "chain":
            return StaticTreeBuilder(chain_choices(self.max_depth)) if self.max_depth else None
        return StaticTreeBuilder(self.choices)

    @property
    def max_candidates(self) -> int:
        """An upper bound on the candidate rows of one tree (verify rows = this + the root)."""
        if self.kind == "dynamic":
            return self.verify_budget
        return self.max_depth if self.kind == "chain" else len(self.choices)

    def draft_slots(self, prompt_len: int, max_new_tokens: int) -> int:
        """Draft KV slots a request needs: every committed row, one round's verify rows, its draft rows."""
        return prompt_len + max_new_tokens + (self.max_candidates + 1) + self.max_draft_rows + 1

    @property
    def max_draft_rows(self) -> int:
        """An upper bound on the provisional draft rows one round writes."""
        if self.kind == "dynamic":
            return self.expand_width * max(self.max_depth - 1, 0)
        return self.max_candidates


@dataclass
class DraftSession:
    """Mutable per-request draft state. Only :class:`DrafterEngine` touches it."""

    request_id: str
    kv_row: int  # its row of the engine's K/V store
    max_slots: int  # the slots it may use in that row
    committed_len: int = 0  # context rows: built on verified target features
    provisional_len: int = 0  # tree rows of the current round, after the context rows
    # the request's logits processors over the draft logits (``eyas.verification.processors.
    # draft_processor``: logits [P, C], each row's history -> logits) and the committed tokens they read
    process: Callable | None = None
    history: list[int] = field(default_factory=list)  # the seeds' advanced tokens, in order


class DrafterEngine:
    def __init__(
        self,
        drafter: Drafter,
        embed: nn.Embedding,
        lm_head: nn.Module,
        int8_head: bool = False,
        taps: tuple[FeatureTap, ...] = (),
    ):
        """``int8_head``: draft through an int8 copy of the target LM head (EAGLE-1 only).
        ``taps``: the feature address this drafter reads (what a remote target must tap for it).

        Draft confidences only rank candidates; the target decides acceptance, so a cheaper head
        changes speed and acceptance rate, never the output (the head is 49152 x 576 here, 18 ms
        a row at fp32 against about 3 ms at int8 on this CPU).
        """
        keep_freed_memory()  # a round's tensors (a long seed's, its head's) reuse freed memory (eyas.compute)
        self.drafter = drafter.eval().requires_grad_(False)
        self.embed = embed  # frozen target embedding (not owned)
        self.lm_head = lm_head  # frozen target LM head (not owned)
        if int8_head and drafter.head is None and isinstance(lm_head, nn.Linear):
            from torch.ao.quantization import quantize_dynamic

            copy = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)
            copy.weight = nn.Parameter(lm_head.weight.detach().clone(), requires_grad=False)
            self.lm_head = quantize_dynamic(nn.Sequential(copy), {nn.Linear}, dtype=torch.qint8)[0]
        self.taps = tuple(taps)
        self.device = embed.weight.device  # where every draft tensor lives (the target's device)
        self.sessions: dict[str, DraftSession] = {}
        self.version = 0  # the live drafter's version (swap_drafter); 0: the one it was built with
        self.fuse_steps = True  # run a step as one kernel call where the drafter allows it (benches: False)
        # grow a dynamic tree in one kernel call where a step fuses (tests and benches: False, a call a step)
        self.native_trees = True
        # (the drafter and fused layer it was made for, held: compared by identity, never by a reusable id; step)
        self._fused: tuple[tuple[object, object], object | None] = ((None, None), None)
        # every live request's draft K/V in one padded store, rows [0, live) (eyas.target.batch_kv)
        self.kv = self.drafter.allocate_store()

    def swap_drafter(self, drafter: Drafter, version: int | None = None) -> None:
        """Serve ``drafter`` from the next drafting pass on (a round boundary: call it between rounds).
        It must be the same network over the same feature address and draft vocabulary (a learned
        version of the live one). Live sessions keep their draft K/V, written by the previous weights:
        what they propose may differ, what they output may not (the target verifies every token).
        ``version``: its number (the learner's; above the live one's); None: the live one's plus 1."""
        if version is not None and (type(version) is not int or version <= self.version):
            raise ValueError(f"version: a swap serves a version above the live {self.version}, got {version!r}")
        old = self.drafter
        if drafter.cfg != old.cfg:
            raise ValueError(f"drafter: a swap needs the live drafter's config {old.cfg}, got {drafter.cfg}")
        if (old.head is None) != (drafter.head is None) or (
            old.head is not None and not torch.equal(old.d2t.cpu(), drafter.d2t.cpu())
        ):
            raise ValueError("drafter: a swap keeps the live drafter's draft vocabulary")
        self.drafter = drafter.eval().requires_grad_(False)
        self._fused = ((None, None), None)  # the old drafter's fused step goes with it
        self.version = self.version + 1 if version is None else version

    @property
    def fused_step(self):
        """The live drafter's whole step as one kernel call (``eyas.target.quantized.FusedDraftStep``: a
        reference EAGLE-3 drafter at gguf), or None: its steps run through the Python path. Made again
        when the drafter or its fused layer is replaced (a swap, ``gguf_drafter`` after the engine)."""
        from eyas.target.quantized import FusedDraftStep

        if not self.fuse_steps:
            return None
        key = (self.drafter, self.drafter.layer.fused)
        if self._fused[0][0] is not key[0] or self._fused[0][1] is not key[1]:
            fits = FusedDraftStep.fits(self.drafter, self.embed)
            self._fused = (key, FusedDraftStep(self.drafter, self.embed) if fits else None)
        return self._fused[1]

    def version_of(self, request_id: str) -> int:
        """The drafter version that drafts ``request_id``'s trees now (one drafter here: the live one)."""
        return self.version

    def kv_slots_allocated(self) -> int:
        return sum(s.max_slots for s in self.sessions.values())

    def kv_bytes_allocated(self) -> int:
        """Bytes the padded store holds (0 once every session is closed)."""
        return self.kv.nbytes

    def open_session(self, request_id: str, max_slots: int, process: Callable | None = None) -> None:
        """``process``: the request's logits processors over this drafter's logits (None: none), so
        that its tree is drafted for the processed distribution the target verifies."""
        if request_id in self.sessions:
            raise ValueError(f"request_id: {request_id!r} already has a live draft session")
        self.sessions[request_id] = DraftSession(
            request_id, self.kv.open_row(request_id, max_slots), max_slots, process=process
        )

    @property
    def draft_columns(self) -> dict[int, int] | None:
        """Target token id -> this drafter's logit column (an EAGLE-3 draft vocabulary; None: the same ids)."""
        if self.drafter.head is None:
            return None
        if not hasattr(self, "_columns"):
            self._columns = {int(t): i for i, t in enumerate(self.drafter.d2t.tolist())}
        return self._columns

    def close_session(self, request_id: str) -> None:
        """Forget a request; the last KV row moves into its place, so live rows stay ``[0, live)``."""
        self.kv.close_session(self.sessions, request_id)

    def _session(self, request_id: str) -> DraftSession:
        if request_id not in self.sessions:
            raise ValueError(f"request_id: {request_id!r} has no live draft session")
        return self.sessions[request_id]

    def _top_children(self, hidden: torch.Tensor, k: int, processed=()) -> tuple[torch.Tensor, torch.Tensor]:
        # one LM-head call for every parent row of every request in the batch
        """hidden: [P, d] -> the top-k (target ids [P, k] int64, confidences [P, k] float32).
        ``processed``: (first row, rows, process, histories) of the requests with logits processors."""
        fused = None if processed else self.drafter.top_children(hidden, k, self.lm_head)
        if fused is not None:  # gguf: the norm, the head and the top-k in one kernel call
            ids, conf = fused
            return self.drafter.to_target_ids(ids), conf
        logits = self.drafter.logits(hidden, self.lm_head)
        for lo, n, process, histories in processed:
            logits[lo : lo + n] = process(logits[lo : lo + n], histories)
        probs = torch.softmax(logits, dim=-1)
        conf, ids = probs.topk(k, dim=-1)
        return self.drafter.to_target_ids(ids), conf

    @torch.inference_mode()
    def propose(self, request_id: str, seed, tree: TreeSpec) -> DraftTree:
        return self.propose_batch([(request_id, seed, tree)])[0]

    @torch.inference_mode()
    def propose_batch(self, items: list[tuple[str, Seed, TreeSpec]]) -> list[DraftTree]:
        """Grow one tree per request; every step of every request's growth shares one drafter pass
        over the store (one attention call for all of them, each request's own causal and tree mask
        in it) and one LM-head call."""
        if len({rid for rid, _, _ in items}) != len(items):
            raise ValueError("request_id: a request appears twice in one drafting batch")
        # checks first; a seed decoded from the wire (on the CPU) moves to the drafter's device here
        growths = [_Growth(self._session(rid), seed, tree, self.device) for rid, seed, tree in items]
        fused = self.fused_step
        if fused is not None and len(growths) == 1 and self._fusable(growths[0], fused):
            return [self._grow_fused(growths[0], fused)]
        # 1. context rows from verified target features (design 0x05A/0x05D) ----------------------
        hidden = self.drafter.forward_batch(self.kv, [g.context_rows(self.drafter, self.embed) for g in growths])
        for g, h in zip(growths, hidden):
            g.start_tree(h)
        # 2. grow the trees over provisional rows (design 0x05B, 0x06B), all requests in lockstep ------
        while active := [g for g in growths if g.parent_hidden is not None]:
            k = max(g.builder.children_per_parent for g in active)
            processed, lo = [], 0
            for g in active:
                if g.s.process is not None:
                    processed.append((lo, g.parent_hidden.shape[0], g.s.process, g.parent_histories()))
                lo += g.parent_hidden.shape[0]
            tokens, conf = self._top_children(torch.cat([g.parent_hidden for g in active]), k, processed)
            steps, lo = [], 0
            for g in active:
                n, kk = g.parent_hidden.shape[0], g.builder.children_per_parent
                rows = g.add_children(tokens[lo : lo + n, :kk], conf[lo : lo + n, :kk])
                lo += n
                if rows is not None:
                    steps.append((g, rows))
            if not steps:
                break
            outs = self.drafter.forward_batch(
                self.kv, [(state, self.embed(toks), rows) for _, (state, toks, rows) in steps]
            )
            for (g, _), h in zip(steps, outs):
                g.absorb(h)
        return [g.result() for g in growths]

    def _fusable(self, g: _Growth, step) -> bool:
        """Whether one request's round runs through :attr:`fused_step`: a seed of at most
        ``FUSED_SEED_ROWS`` rows (a steady round's, a backlog of skipped rounds', a short prompt's), no
        logits processors, within the rotary table."""
        s, a = g.s, g.seed.features.shape[0]
        return (
            s.process is None
            and a <= FUSED_SEED_ROWS
            and s.max_slots <= step.max_position  # every row's position is below its slots
        )

    def _grow_fused(self, g: _Growth, step) -> DraftTree:
        """:meth:`propose_batch` for one request without the interpreter between kernels: a dynamic tree
        (EAGLE-2's) grown and selected in ONE call (``FusedDraftStep.tree``, while :attr:`native_trees`),
        other trees one :attr:`fused_step` call a step (its draft forward and its children's top-k
        together) under their builder: the same growth either way, bit for bit."""

        def run(rows: torch.Tensor, tokens: torch.Tensor, group: RowGroup, k: int, topk_rows: int):
            n = rows.shape[0]
            self.kv.fit(group.kv_row + 1, group.start + n)
            keys, values = self.kv.k[0, group.kv_row], self.kv.v[0, group.kv_row]  # [H_kv, S, hd] views of its row
            return step(rows, tokens, group.positions, keys, values, group.start, group.mask, k, topk_rows)

        if type(g.builder) is DynamicTreeBuilder and self.native_trees:  # the whole tree in one kernel call
            s, a = g.s, g.seed.features.shape[0]
            self.kv.fit(s.kv_row + 1, s.committed_len + a + g.max_draft_rows)
            keys, values = self.kv.k[0, s.kv_row], self.kv.v[0, s.kv_row]  # [H_kv, S, hd] views of its row
            tree, written = step.tree(g.seed.features, g.host_tokens, keys, values, s.committed_len, g.builder)
            s.committed_len += a
            s.provisional_len += written
            return tree
        grows = g.builder is not None and not g.builder.done
        k = g.builder.children_per_parent if grows else 1
        hidden, ids, conf = run(g.seed.features, g.seed.advanced_tokens, g.context_group(), k, int(grows))
        g.start_tree(hidden)
        while g.parent_hidden is not None:
            rows = g.add_children(ids, conf)
            if rows is None:
                break
            state, tokens, group = rows
            k = g.builder.children_per_parent  # the new parents' (a static tree's ranks vary by depth)
            hidden, ids, conf = run(state, tokens, group, k, state.shape[0])
            g.absorb(hidden)
        return g.result()

    def publish(self, request_id: str) -> None:
        """Discard this round's provisional tree rows (design 0x05D)."""
        self._session(request_id).provisional_len = 0

    def measure_cost(
        self,
        tree: TreeSpec = TreeSpec(),
        depths: tuple[int, ...] = (1, 3, 5),
        repeats: int = 3,
        prefix: int = 64,
        batch: int = 4,
    ) -> list[tuple[int, int, float]]:
        """What one steady-state drafting call costs on this device, as ``(depth, draft rows, ms)``
        points for :meth:`DraftCost.from_points <eyas.scheduler.latency.DraftCost.from_points>`: one
        request at each of ``depths``, and ``batch`` requests at the deepest (so that the cost per
        packed row can be told from the cost per depth). Each point is the median of ``repeats``
        :meth:`propose_batch` calls that read a 2-row seed per request after a ``prefix``-row context
        and grow ``tree`` cut at that depth; ``draft rows`` counts the rows packed for each request:
        its 2 seed rows plus the provisional rows its tree may write (:attr:`TreeSpec.max_draft_rows`).
        Uses its own sessions, closed before returning."""
        import statistics
        import time

        feature_dim = self.drafter.cfg.num_taps * self.drafter.cfg.hidden_size
        gen = torch.Generator().manual_seed(0)
        vocab = self.embed.weight.shape[0]

        def seed(start: int, rows: int, round_: int) -> Seed:
            return Seed(
                torch.randn(rows, feature_dim, generator=gen),
                torch.randint(0, vocab, (rows,), generator=gen),
                start,
                round_,
            )

        def point(depth: int, n: int) -> tuple[int, int, float]:
            spec = TreeSpec(tree.kind, tree.expand_width, depth, tree.verify_budget, tree.choices)
            rids = [f"__draft_cost_{i}__" for i in range(n)]
            try:
                for rid in rids:
                    self.open_session(rid, spec.draft_slots(prefix, 2 * (repeats + 1)) + 2 * (repeats + 1))
                self.propose_batch([(rid, seed(0, prefix, 0), spec) for rid in rids])  # contexts, and a warm-up
                samples = []
                for r in range(repeats):
                    for rid in rids:
                        self.publish(rid)
                    t0 = time.perf_counter()
                    self.propose_batch([(rid, seed(prefix + 2 * r, 2, r + 1), spec) for rid in rids])
                    samples.append(1000 * (time.perf_counter() - t0))
                return depth, n * (2 + spec.max_draft_rows), statistics.median(samples)
            finally:
                for rid in rids:
                    self.close_session(rid)

        points = [point(depth, 1) for depth in depths]
        if batch > 1 and depths:
            points.append(point(max(depths), batch))
        return points


class _Growth:
    """One request's tree growth inside :meth:`DrafterEngine.propose_batch` (design 0x05B, 0x06B).

    Draft rows are written into the request's own session: the seed's context rows at
    ``[committed_len, committed_len + A)`` (they become committed), then each expanded node as one
    provisional row that reads its parent's output state and its own token and attends to the context
    rows plus its tree ancestors. Its output proposes its children.
    """

    def __init__(self, s: DraftSession, seed: Seed, tree: TreeSpec, device: torch.device):
        if s.provisional_len:
            raise ValueError(f"request_id: {s.request_id!r} has an unpublished draft round")
        if seed.start_position != s.committed_len:
            raise ValueError(f"seed.start_position: {seed.start_position} != draft context length {s.committed_len}")
        need = s.committed_len + seed.features.shape[0] + tree.max_draft_rows
        if need > s.max_slots:
            raise ValueError(
                f"seed: {s.committed_len} committed + {seed.features.shape[0]} new context rows + the "
                f"tree's {tree.max_draft_rows} draft rows exceed the draft session's {s.max_slots} slots"
            )
        self.host_tokens = seed.advanced_tokens.cpu()  # [A]: the plan's host copy
        self.max_draft_rows = tree.max_draft_rows  # the provisional rows this round may write, at most
        self.s, self.seed, self.builder, self.device = s, seed.to(device), tree.builder(), device
        self.parent_hidden: torch.Tensor | None = None  # [P, d] rows whose children come next; None = done
        self.parents: list[int] = []
        self.node_state: dict[int, torch.Tensor] = {}  # node id -> output of the row that proposed it  [d]
        self.node_slot: dict[int, int] = {}  # node id -> provisional slot of its own row

    def context_group(self) -> RowGroup:
        """The seed's context rows at slots ``[committed_len, committed_len + A)``: positions, and each row's
        mask over the committed context and the seed's rows before it (None for one row). Host data, moved
        once when the round's plan is built (BatchRows)."""
        n, a = self.s.committed_len, self.seed.features.shape[0]
        mask = torch.ones(a, n + a, dtype=torch.bool).tril_(n) if a > 1 else None  # [A, n+A]
        return RowGroup(self.s.kv_row, self.host_tokens, torch.arange(n, n + a), n, mask)

    def context_rows(self, drafter: Drafter, embed: nn.Embedding):
        state = drafter.target_state(self.seed.features.to(drafter.dtype))  # [A, d]
        return state, embed(self.seed.advanced_tokens), self.context_group()

    def parent_histories(self) -> list[list[int]]:
        """Each parent row's history for the logits processors: the committed tokens, then its path."""
        out = []
        for node in self.parents:
            path, walk = [], node
            while walk != PARENT_IS_ROOT:
                path.insert(0, self.builder.node(walk).token)
                walk = self.builder.node(walk).parent
            out.append(self.s.history + path)
        return out

    def start_tree(self, hidden: torch.Tensor) -> None:  # [A, d] outputs of the context rows
        self.s.committed_len += hidden.shape[0]
        if self.s.process is not None:
            self.s.history.extend(self.host_tokens.tolist())
        self.base = self.s.committed_len  # first provisional slot
        self.last_position = self.s.committed_len - 1  # position of the seed's row; depth-k rows sit at +k
        self.grows = self.builder is not None and not self.builder.done
        if self.grows:
            self.parents, self.parent_hidden = [PARENT_IS_ROOT], hidden[-1:]

    def add_children(self, tokens: torch.Tensor, conf: torch.Tensor):
        """Add the parents' top children; -> the next rows (state, device tokens, RowGroup) or None when done."""
        b = self.builder
        for node in b.add_children(self.parents, tokens, conf):
            self.node_state[node] = self.parent_hidden[self.parents.index(b.node(node).parent)]
        parents = [] if b.done else b.expandable()
        if not parents:
            self.parent_hidden = None
            return None
        s, p = self.s, len(parents)
        first = self.base + s.provisional_len
        slots = list(range(first, first + p))
        for node, slot in zip(parents, slots):
            self.node_slot[node] = slot
        assert slots[-1] < s.max_slots, "checked when the growth began"
        mask = torch.zeros(p, slots[-1] + 1, dtype=torch.bool)  # [P, slots] built on the host, moved with the plan
        mask[:, : self.base] = True
        seen_rows, seen_slots = [], []  # each row's ancestors' rows and the row itself, set in one indexing
        for i, node in enumerate(parents):
            walk = node
            while walk != PARENT_IS_ROOT:
                seen_rows.append(i)
                seen_slots.append(self.node_slot[walk])
                walk = b.node(walk).parent
        mask[seen_rows, seen_slots] = True
        tokens_ = torch.tensor([b.node(x).token for x in parents], dtype=torch.int64)  # [P] host
        positions = torch.tensor([self.last_position + b.node(x).depth for x in parents], dtype=torch.int64)  # [P]
        self.parents = parents
        return (
            torch.stack([self.node_state[x] for x in parents]),
            tokens_.to(self.device),
            RowGroup(s.kv_row, tokens_, positions, first, mask),
        )

    def absorb(self, hidden: torch.Tensor) -> None:  # [P, d]
        self.s.provisional_len += hidden.shape[0]
        self.parent_hidden = hidden

    def result(self) -> DraftTree:
        return self.builder.select() if self.grows else DraftTree.empty()
