"""The target engine's prefix cache: committed K/V and feature rows of token blocks seen before.

Terms:

- *block*: ``BLOCK_TOKENS`` consecutive tokens of a request's committed sequence, starting at a
  multiple of ``BLOCK_TOKENS``; only full blocks are cached.
- *block hash*: a hash chain over the token ids (the scheme vLLM's automatic prefix caching uses):
  ``h_i = sha256(h_{i-1} || tokens of block i)``, ``h_{-1}`` a fixed root. Equal hashes mean equal
  whole prefixes, so the longest run of known hashes from block 0 is the longest cached prefix.
- *entry*: one block's K/V for every layer (``[L, H_kv, BLOCK_TOKENS, hd]``, keys and values) and its
  rows' feature taps (``[BLOCK_TOKENS, F]``), copied out of a session's committed slots.

Rules (the publish transaction's, design 0x05D):

- Only committed state enters: a session's blocks are offered after its prefill is published (the
  prompt) and when it closes (prompt and answer), never a provisional tree row or a rejected branch.
- An entry is complete when it becomes visible: it is built from slots already written, then put in
  the table in one step (vllm#41838 published a block's hash before its K/V was written).
- A hit *copies* the entries into the new session's own slots; the session then never refers to the
  cache again, so eviction cannot change a live request, and a cancelled or lost request leaves no
  reference behind.
- A byte budget bounds the entries; the least recently used go first, deepest first along a chain
  (a lookup or insert touches a chain from its last block to its first, so a block is never older
  than its descendants and an evicted block never strands reachable children).

Pure bookkeeping and tensor copies: no model, no Ray.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

BLOCK_TOKENS = 16
_ROOT = b"eyas-prefix-cache/1"


def block_hashes(tokens: list[int], blocks: int | None = None) -> list[bytes]:
    """The hash chain of ``tokens``' full blocks (the first ``blocks`` of them, None: all)."""
    n = len(tokens) // BLOCK_TOKENS if blocks is None else min(blocks, len(tokens) // BLOCK_TOKENS)
    out, h = [], _ROOT
    for b in range(n):
        block = tokens[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS]
        h = hashlib.sha256(h + b"|" + ",".join(map(str, block)).encode()).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class CachedBlock:
    """One block: its K/V, the same for every engine of a model, and its rows' features per feature
    address (an engine of other taps adds its own the first time it commits the block)."""

    keys: torch.Tensor  # [L, H_kv, BLOCK_TOKENS, hd]
    values: torch.Tensor  # [L, H_kv, BLOCK_TOKENS, hd]
    features: dict = field(default_factory=dict)  # taps -> [BLOCK_TOKENS, F]; () needs none

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, *self.features.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def serves(self, taps: tuple) -> bool:
        """Whether an engine of feature address ``taps`` can use this block (target-only needs no features)."""
        return not taps or taps in self.features


@dataclass
class PrefixCacheStats:
    """Counters in tokens (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``) and blocks."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of them, found cached
    inserted_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class PrefixCache:
    """Cached blocks keyed by their hash chain, within ``capacity_bytes`` (0: caches nothing). One
    per model: its engines (one per feature address) share the K/V and keep features per address."""

    capacity_bytes: int
    blocks: OrderedDict[bytes, CachedBlock] = field(default_factory=OrderedDict)  # oldest first
    nbytes: int = 0
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self):
        if type(self.capacity_bytes) is not int or self.capacity_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: must be a byte count >= 0, got {self.capacity_bytes!r}")

    def lookup(self, tokens: list[int], max_tokens: int, taps: tuple = ()) -> list[CachedBlock]:
        """The cached blocks of ``tokens``' longest cached prefix of at most ``max_tokens`` tokens that
        an engine of ``taps`` can use, in order (a prompt keeps at least its last token to compute:
        its logits give the first token); counts the query and the hit."""
        hashes = block_hashes(tokens, max_tokens // BLOCK_TOKENS)
        found = []
        for h in hashes:
            block = self.blocks.get(h)
            if block is None or not block.serves(taps):
                break
            found.append((h, block))
        self._touch([h for h, _ in found])
        self.stats.queries += len(tokens)
        self.stats.hits += len(found) * BLOCK_TOKENS
        return [b for _, b in found]

    def missing(self, chain: list[bytes], taps: tuple = ()) -> list[tuple[int, bytes]]:
        """(block index, hash) of the blocks of the hash chain ``chain`` (:func:`block_hashes`) not cached
        yet for ``taps`` (absent, or without that address's features)."""
        return [(i, h) for i, h in enumerate(chain) if h not in self.blocks or not self.blocks[h].serves(taps)]

    def insert(self, h: bytes, block: CachedBlock) -> bool:
        """Make one complete block visible (:meth:`insert_chain` of a chain of one)."""
        return self.insert_chain([h], {h: block}) == 1

    def insert_chain(self, chain: list[bytes], new: dict[bytes, CachedBlock]) -> int:
        """Make ``chain``'s blocks visible in order: ``new`` holds the complete ones the cache lacks for
        their address (a block already cached for another address takes only the new features).
        Evicts the least recently used blocks outside the chain as the budget needs; stops at the
        first block that does not fit (a later one would be unreachable). -> blocks of the chain
        cached now, from its first."""
        keep = set(chain)
        cached = 0
        for h in chain:
            if h in new:
                old = self.blocks.get(h)
                if old is None:
                    add, grow = new[h], new[h].nbytes
                else:
                    extra = {t: f for t, f in new[h].features.items() if t not in old.features}
                    add, grow = None, sum(f.numel() * f.element_size() for f in extra.values())
                if not self._make_room(grow, keep):
                    break
                if add is not None:
                    self.blocks[h] = add
                    self.stats.inserted_blocks += 1
                else:
                    old.features.update(extra)
                self.nbytes += grow
            elif h not in self.blocks:
                break
            cached += 1
        self._touch(chain[:cached])
        return cached

    def _make_room(self, grow: int, keep: set[bytes]) -> bool:
        while self.nbytes + grow > self.capacity_bytes:
            victim = next((k for k in self.blocks if k not in keep), None)
            if victim is None:
                return False
            self.nbytes -= self.blocks.pop(victim).nbytes
            self.stats.evicted_blocks += 1
        return True

    def touch_chain(self, tokens: list[int], upto: int) -> None:
        """Mark the cached blocks of ``tokens[:upto]`` used, its first block most recent."""
        self._touch([h for h in block_hashes(tokens, upto // BLOCK_TOKENS) if h in self.blocks])

    def _touch(self, chain: list[bytes]) -> None:
        for h in reversed(chain):  # deepest first, so the chain's first block ends most recent
            self.blocks.move_to_end(h)

    def as_dict(self) -> dict[str, int]:
        """Its counters (tokens queried and hit, blocks in and out) and its bytes held and allowed."""
        st = self.stats
        return {
            "queries": st.queries,
            "hits": st.hits,
            "inserted_blocks": st.inserted_blocks,
            "evicted_blocks": st.evicted_blocks,
            "blocks": len(self.blocks),
            "bytes": self.nbytes,
            "capacity_bytes": self.capacity_bytes,
        }

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0
