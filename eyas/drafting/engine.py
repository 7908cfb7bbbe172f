"""The drafter engine: the one owner of drafter weights and draft KV.

Per request a :class:`DraftSession` holds the draft KV cache. Its slots ``[0, committed_len)``
are *context rows*: draft rows whose state is a verified target feature (seed 0x05D: the drafter
never commits a row built on an unverified feature). A round:

1. :meth:`DrafterEngine.propose` appends the new context rows of the :class:`~eyas.target.engine.Seed`
   (the features of the rows the target just committed), then grows a tree (seed 0x05B, 0x06B):
   the seed's last context row proposes the depth-1 candidates; each expanded node becomes one
   draft row in a *provisional* slot, reading its parent's output state and its own token, and
   attending to the context rows plus its tree ancestors. Its output proposes its children.
2. :meth:`DrafterEngine.publish` discards the provisional rows. The next seed carries the verified
   features that replace them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from eyas.drafting.model import Drafter
from eyas.protocol.tree import PARENT_IS_SEED, DraftTree
from eyas.drafting.tree import (DEFAULT_STATIC_CHOICES, DynamicTreeBuilder,
                                StaticTreeBuilder, chain_choices)
from eyas.target.model import FeatureTap, KVCache

TREE_KINDS = ("dynamic", "static", "chain")


@dataclass(frozen=True)
class TreeSpec:
    """The tree a drafter grows per round. EAGLE-2's three knobs stay separate (seed 0x06D)."""

    kind: str = "dynamic"
    expand_width: int = 4      # dynamic: nodes expanded per depth, and children per expanded node
    max_depth: int = 5         # dynamic and chain: the deepest candidate
    verify_budget: int = 16    # dynamic: candidate rows sent to the verifier (the root excluded)
    choices: tuple[tuple[int, ...], ...] = DEFAULT_STATIC_CHOICES  # static: child-rank paths

    def __post_init__(self):
        if self.kind not in TREE_KINDS:
            raise ValueError(f"tree.kind: {self.kind!r} is not one of {TREE_KINDS}")
        for name in ("expand_width", "max_depth", "verify_budget"):
            value = getattr(self, name)
            if type(value) is not int or value < (1 if name == "expand_width" else 0):
                raise ValueError(f"tree.{name}: {value!r} is not a valid count")

    def builder(self):
        if self.kind == "dynamic":
            return DynamicTreeBuilder(expand_width=self.expand_width, verify_budget=self.verify_budget,
                                      max_depth=self.max_depth)
        if self.kind == "chain":
            return StaticTreeBuilder(chain_choices(self.max_depth)) if self.max_depth else None
        return StaticTreeBuilder(self.choices)

    @property
    def max_candidates(self) -> int:
        """An upper bound on the candidate rows of one tree (verify rows = this + the root)."""
        if self.kind == "dynamic":
            return self.verify_budget
        return self.max_depth if self.kind == "chain" else len(self.choices)

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
    cache: KVCache
    committed_len: int = 0     # context rows: built on verified target features
    provisional_len: int = 0   # tree rows of the current round, after the context rows


class DrafterEngine:
    def __init__(self, drafter: Drafter, embed: nn.Embedding, lm_head: nn.Module, int8_head: bool = False,
                 taps: tuple[FeatureTap, ...] = ()):
        """``int8_head``: draft through an int8 copy of the target LM head (EAGLE-1 only).
        ``taps``: the feature address this drafter reads (what a remote target must tap for it).

        Draft confidences only rank candidates; the target decides acceptance, so a cheaper head
        changes speed and acceptance rate, never the output (the head is 49152 x 576 here, 18 ms
        a row at fp32 against about 3 ms at int8 on this CPU).
        """
        self.drafter = drafter.eval().requires_grad_(False)
        self.embed = embed          # frozen target embedding (not owned)
        self.lm_head = lm_head      # frozen target LM head (not owned)
        if int8_head and drafter.head is None and isinstance(lm_head, nn.Linear):
            from torch.ao.quantization import quantize_dynamic

            copy = nn.Linear(lm_head.in_features, lm_head.out_features, bias=False)
            copy.weight = nn.Parameter(lm_head.weight.detach().clone(), requires_grad=False)
            self.lm_head = quantize_dynamic(nn.Sequential(copy), {nn.Linear}, dtype=torch.qint8)[0]
        self.taps = tuple(taps)
        self.sessions: dict[str, DraftSession] = {}

    def kv_slots_allocated(self) -> int:
        return sum(s.cache.max_slots for s in self.sessions.values())

    def open_session(self, request_id: str, max_slots: int) -> None:
        if request_id in self.sessions:
            raise ValueError(f"request_id: {request_id!r} already has a live draft session")
        self.sessions[request_id] = DraftSession(request_id, self.drafter.allocate_cache(max_slots))

    def close_session(self, request_id: str) -> None:
        self.sessions.pop(request_id, None)

    def _session(self, request_id: str) -> DraftSession:
        if request_id not in self.sessions:
            raise ValueError(f"request_id: {request_id!r} has no live draft session")
        return self.sessions[request_id]

    def _top_children(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [P, d] -> the top-k (target ids [P, k] int64, confidences [P, k] float32)."""
        probs = torch.softmax(self.drafter.logits(hidden, self.lm_head), dim=-1)
        conf, ids = probs.topk(k, dim=-1)
        return self.drafter.to_target_ids(ids), conf

    @torch.inference_mode()
    def propose(self, request_id: str, seed, tree: TreeSpec) -> DraftTree:
        s = self._session(request_id)
        if s.provisional_len:
            raise ValueError(f"request_id: {request_id!r} has an unpublished draft round")
        a = seed.features.shape[0]
        if seed.start_position != s.committed_len:
            raise ValueError(f"seed.start_position: {seed.start_position} != draft context length {s.committed_len}")
        # 1. context rows from verified target features (seed 0x05A/0x05D) ---------------------
        n = s.committed_len
        state = self.drafter.target_state(seed.features.to(self.drafter.fuse.weight.dtype))  # [A, d]
        positions = torch.arange(n, n + a)
        mask = torch.cat([torch.ones(a, n, dtype=torch.bool), torch.ones(a, a, dtype=torch.bool).tril()], 1)
        hidden = self.drafter(state[None], self.embed(seed.advanced_tokens)[None], positions[None],
                              s.cache, n, mask[None] if a > 1 else None)[0]  # [A, d]
        s.committed_len = n + a
        builder = tree.builder()
        if builder is None or builder.done:
            return DraftTree.empty()
        # 2. grow the tree over provisional rows (seed 0x05B, 0x06B) ----------------------------
        base = s.committed_len                    # first provisional slot
        last_position = n + a - 1                 # position of the seed's row; depth-k rows sit at +k
        node_state: dict[int, torch.Tensor] = {}  # node id -> output of the row that proposed it  [d]
        node_slot: dict[int, int] = {}            # node id -> provisional slot of its own row
        parents, parent_hidden = [PARENT_IS_SEED], hidden[-1:]
        while True:
            tokens, conf = self._top_children(parent_hidden, builder.children_per_parent)
            new_ids = builder.add_children(parents, tokens, conf)
            for node in new_ids:
                node_state[node] = parent_hidden[parents.index(builder.node(node).parent)]
            if builder.done:
                break
            parents = builder.expandable()
            if not parents:
                break
            p = len(parents)
            slots = torch.arange(base + s.provisional_len, base + s.provisional_len + p)
            for node, slot in zip(parents, slots.tolist()):
                node_slot[node] = slot
            mask = torch.zeros(p, int(slots[-1]) + 1, dtype=torch.bool)
            mask[:, :base] = True
            for i, node in enumerate(parents):  # ancestors' rows and the row itself
                walk = node
                while walk != PARENT_IS_SEED:
                    mask[i, node_slot[walk]] = True
                    walk = builder.node(walk).parent
            node_tokens = torch.tensor([builder.node(x).token for x in parents], dtype=torch.int64)
            node_pos = torch.tensor([last_position + builder.node(x).depth for x in parents], dtype=torch.int64)
            parent_hidden = self.drafter(torch.stack([node_state[x] for x in parents])[None],
                                         self.embed(node_tokens)[None], node_pos[None], s.cache,
                                         int(slots[0]), mask[None])[0]
            s.provisional_len += p
        return builder.select()

    def publish(self, request_id: str) -> None:
        """Discard this round's provisional tree rows (seed 0x05D)."""
        self._session(request_id).provisional_len = 0
