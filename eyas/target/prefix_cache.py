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
    keys: torch.Tensor  # [L, H_kv, BLOCK_TOKENS, hd]
    values: torch.Tensor  # [L, H_kv, BLOCK_TOKENS, hd]
    features: torch.Tensor  # [BLOCK_TOKENS, F]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.features))


@dataclass
class PrefixCacheStats:
    """Counters in tokens (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``) and blocks."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of them, found cached
    inserted_blocks: int = 0
    evicted_blocks: int = 0


@dataclass
class PrefixCache:
    """Cached blocks keyed by their hash chain, within ``capacity_bytes`` (0: caches nothing)."""

    capacity_bytes: int
    blocks: OrderedDict[bytes, CachedBlock] = field(default_factory=OrderedDict)  # oldest first
    nbytes: int = 0
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def __post_init__(self):
        if type(self.capacity_bytes) is not int or self.capacity_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: must be a byte count >= 0, got {self.capacity_bytes!r}")

    def lookup(self, tokens: list[int], max_tokens: int) -> list[CachedBlock]:
        """The cached blocks of ``tokens``' longest cached prefix of at most ``max_tokens`` tokens, in
        order (a prompt keeps at least its last token to compute: its logits give the first token);
        counts the query and the hit."""
        hashes = block_hashes(tokens, max_tokens // BLOCK_TOKENS)
        found = []
        for h in hashes:
            block = self.blocks.get(h)
            if block is None:
                break
            found.append((h, block))
        self._touch([h for h, _ in found])
        self.stats.queries += len(tokens)
        self.stats.hits += len(found) * BLOCK_TOKENS
        return [b for _, b in found]

    def missing(self, tokens: list[int], upto: int) -> list[tuple[int, bytes]]:
        """(block index, hash) of the full blocks of ``tokens[:upto]`` not cached yet; touches the
        cached ones."""
        hashes = block_hashes(tokens, upto // BLOCK_TOKENS)
        self._touch([h for h in hashes if h in self.blocks])
        return [(i, h) for i, h in enumerate(hashes) if h not in self.blocks]

    def insert(self, h: bytes, block: CachedBlock) -> bool:
        """Make one complete block visible (:meth:`insert_chain` of a chain of one)."""
        return self.insert_chain([h], {h: block}) == 1

    def insert_chain(self, chain: list[bytes], new: dict[bytes, CachedBlock]) -> int:
        """Make ``chain``'s blocks visible in order (``new`` holds the complete ones not cached yet),
        evicting the least recently used blocks outside the chain as the budget needs; stops at the
        first block that does not fit (a later one would be unreachable). -> blocks of the chain
        cached now, from its first."""
        keep = set(chain)
        cached = 0
        for h in chain:
            if h not in self.blocks:
                block = new[h]
                while self.nbytes + block.nbytes > self.capacity_bytes:
                    victim = next((k for k in self.blocks if k not in keep), None)
                    if victim is None:
                        break
                    self.nbytes -= self.blocks.pop(victim).nbytes
                    self.stats.evicted_blocks += 1
                if self.nbytes + block.nbytes > self.capacity_bytes:
                    break
                self.blocks[h] = block
                self.nbytes += block.nbytes
                self.stats.inserted_blocks += 1
            cached += 1
        self._touch(chain[:cached])
        return cached

    def touch_chain(self, tokens: list[int], upto: int) -> None:
        """Mark the cached blocks of ``tokens[:upto]`` used, its first block most recent."""
        self._touch([h for h in block_hashes(tokens, upto // BLOCK_TOKENS) if h in self.blocks])

    def _touch(self, chain: list[bytes]) -> None:
        for h in reversed(chain):  # deepest first, so the chain's first block ends most recent
            self.blocks.move_to_end(h)

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0
