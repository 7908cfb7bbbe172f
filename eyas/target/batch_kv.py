"""One K/V store for every live request of a target engine, and the plan of one batched forward.

Terms (seed 0x05C, 0x05D):
- *KV row*: one request's place in the store's batch dimension. Its slots ``[0, committed)`` hold
  committed K/V; the slots after them are provisional (a verify's tree rows, a prompt's prefill
  chunks) until the publish transaction gathers the accepted ones onto the committed prefix.
- *packed row*: one token of the forward (a prefill row, a decode row or a tree row). Every
  projection and MLP runs once over the N packed rows of all requests together.
- *padded query*: attention runs as ONE call per layer over the KV rows ``[0, kv_rows)``: each
  request's packed rows are placed at ``[kv_row, 0:T_i]`` of a ``[kv_rows, width]`` query grid,
  and a boolean mask ``[kv_rows, 1, width, key_len]`` expresses each row's causal prefix, tree
  ancestry and padding. Grid cells that carry no packed row see slot 0 only (so no softmax row is
  empty) and are discarded.

The store is padded, not paged: a request's keys are a view of its row, so the attention call
reads K/V in place with no gather (a paged store gathers its blocks per layer, which on a CPU
costs as much memory traffic as the attention itself). The price is memory: every row is as long
as the longest live request's budget. The engine keeps its live requests in rows ``[0, live)``
(closing one moves the last row into the hole), so a round's view is a prefix of the store.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SLOT_GRANULE = 128  # the store's slot capacity grows in multiples of this (fewer reallocations)
MIN_ROWS = 4        # the smallest row capacity allocated


class BatchKV:
    """Padded K/V of an engine's live requests. Owned by one ``TargetEngine``; mutated only by it."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        self.shape_per_slot = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.k = torch.zeros(num_layers, 0, num_kv_heads, 0, head_dim, dtype=dtype, device=self.device)  # [L, B, H_kv, S, hd]
        self.v = torch.zeros_like(self.k)                                                                 # [L, B, H_kv, S, hd]

    @property
    def row_capacity(self) -> int:
        return self.k.shape[1]

    @property
    def slot_capacity(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_slot(self) -> int:
        L, H, hd = self.shape_per_slot
        return 2 * L * H * hd * self.k.element_size()

    @property
    def nbytes(self) -> int:
        return self.row_capacity * self.slot_capacity * self.bytes_per_slot

    def reserve(self, rows: int, slots: int) -> None:
        """Grow (never shrink) to at least ``rows`` KV rows of ``slots`` slots, keeping every value."""
        if rows <= self.row_capacity and slots <= self.slot_capacity:
            return
        new_rows = max(self.row_capacity, MIN_ROWS)
        while new_rows < rows:
            new_rows *= 2
        new_slots = max(self.slot_capacity, -(-slots // SLOT_GRANULE) * SLOT_GRANULE)
        L, H, hd = self.shape_per_slot
        k = torch.zeros(L, new_rows, H, new_slots, hd, dtype=self.dtype, device=self.device)
        v = torch.zeros_like(k)
        b, s = self.row_capacity, self.slot_capacity
        k[:, :b, :, :s], v[:, :b, :, :s] = self.k, self.v
        self.k, self.v = k, v

    def release(self) -> None:
        """Free the storage (the engine calls this when its last request closes)."""
        self.k = self.k.new_zeros(self.k.shape[0], 0, self.k.shape[2], 0, self.k.shape[4])
        self.v = torch.zeros_like(self.k)

    def write(self, layer: int, kv_rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k/v ([N, H_kv, hd]) of N packed rows at (``kv_rows``[n], ``slots``[n]) ([N] int64 each)."""
        self.k[layer, kv_rows, :, slots] = k
        self.v[layer, kv_rows, :, slots] = v

    def write_span(self, layer: int, kv_row: int, start: int, k: torch.Tensor, v: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v ([1, H_kv, T, hd]) of one request at slots [start, start+T) of ``kv_row``; return
        its keys/values of [0, start+T) (views, [1, H_kv, start+T, hd])."""
        t = k.shape[2]
        self.k[layer, kv_row, :, start:start + t] = k[0]
        self.v[layer, kv_row, :, start:start + t] = v[0]
        return (self.k[layer, kv_row:kv_row + 1, :, :start + t], self.v[layer, kv_row:kv_row + 1, :, :start + t])

    def view(self, layer: int, rows: int, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of KV rows ``[0, rows)``, slots ``[0, slots)``: views ([rows, H_kv, slots, hd])."""
        return self.k[layer, :rows, :, :slots], self.v[layer, :rows, :, :slots]

    def commit(self, kv_row: int, src_slots: torch.Tensor, dst_start: int) -> None:
        """Copy row ``kv_row``'s slots ``src_slots`` ([A] int64) onto ``[dst_start, dst_start + A)``.

        The gather reads every source before any write, so overlapping ranges are safe."""
        assert src_slots.ndim == 1 and src_slots.dtype == torch.int64
        a = src_slots.numel()
        if dst_start + a > self.slot_capacity:
            raise ValueError(f"kv commit: {dst_start + a} slots exceed the store ({self.slot_capacity})")
        k_rows = self.k[:, kv_row].index_select(2, src_slots)  # [L, H, A, hd]
        v_rows = self.v[:, kv_row].index_select(2, src_slots)
        self.k[:, kv_row, :, dst_start:dst_start + a] = k_rows
        self.v[:, kv_row, :, dst_start:dst_start + a] = v_rows

    def move(self, src_row: int, dst_row: int, slots: int) -> None:
        """Copy the first ``slots`` slots of KV row ``src_row`` into ``dst_row`` (compaction on close)."""
        self.k[:, dst_row, :, :slots] = self.k[:, src_row, :, :slots]
        self.v[:, dst_row, :, :slots] = self.v[:, src_row, :, :slots]


@dataclass(frozen=True)
class RowGroup:
    """One request's rows in a batched forward: ``T`` rows at slots ``[start, start + T)`` of KV row
    ``kv_row``; ``mask`` [T, start + T] bool says what each row sees (None: one row that sees every
    slot up to its own)."""

    kv_row: int
    tokens: torch.Tensor          # [T] int64
    positions: torch.Tensor       # [T] int64
    start: int
    mask: torch.Tensor | None     # [T, start + T] bool, or None when T == 1


@dataclass(frozen=True)
class BatchRows:
    """The plan of one batched forward, built once and shared by every layer."""

    tokens: torch.Tensor        # [N] int64, the packed rows of every group in order
    positions: torch.Tensor     # [N] int64
    kv_rows: torch.Tensor       # [N] int64, each packed row's KV row
    slots: torch.Tensor         # [N] int64, each packed row's slot
    grid_index: torch.Tensor    # [N] int64, each packed row's cell in the [num_kv_rows * width] query grid
    num_kv_rows: int            # the attention call's batch: KV rows [0, num_kv_rows)
    width: int                  # the query grid's row count per KV row (the largest group)
    key_len: int                # slots [0, key_len) are read
    mask: torch.Tensor | None   # [num_kv_rows, 1, width, key_len] bool (alone: its own [1, T, start+T] or None)
    bounds: tuple[tuple[int, int], ...]  # each group's [lo, hi) among the packed rows
    alone: tuple[int, int, torch.Tensor | None] | None  # one group: (KV row, start, its mask [1, T, start+T])
    _blocked: dict = field(default_factory=dict, compare=False, repr=False)  # grouped_mask's per-size cache

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def grouped_mask(self, group: int) -> torch.Tensor:
        """Where a query may NOT look, for queries grouped by KV head as rows (g, w):
        [num_kv_rows, 1, group * width, key_len] bool (built once per group size, then shared)."""
        cached = self._blocked.get(group)
        if cached is None:
            B, _, W, S = self.mask.shape
            cached = (~self.mask).unsqueeze(2).expand(B, 1, group, W, S).reshape(B, 1, group * W, S)
            self._blocked[group] = cached
        return cached

    @classmethod
    def build(cls, groups: list[RowGroup], device: str | torch.device = "cpu") -> "BatchRows":
        assert groups, "groups: at least one"
        if len(groups) == 1:  # one request: no grid, no padding (the attention call of a lone forward)
            g = groups[0]
            t = g.tokens.shape[0]
            if g.mask is None and t != 1:
                raise ValueError("mask: required when a request feeds more than one row")
            if g.mask is not None:
                assert g.mask.shape == (t, g.start + t) and g.mask.dtype == torch.bool, "mask: [T, start+T] bool"
            mask = None if g.mask is None else g.mask[None].to(device)
            return cls(g.tokens.to(device), g.positions.to(device), torch.full((t,), g.kv_row, device=device),
                       torch.arange(g.start, g.start + t, device=device), torch.arange(t, device=device),
                       g.kv_row + 1, t, g.start + t, mask, ((0, t),), (g.kv_row, g.start, mask))
        kv_rows_seen = [g.kv_row for g in groups]
        assert len(set(kv_rows_seen)) == len(kv_rows_seen), "groups: a KV row appears twice"
        width = max(g.tokens.shape[0] for g in groups)
        num_kv_rows = max(kv_rows_seen) + 1
        key_len = max(g.start + g.tokens.shape[0] for g in groups)
        mask = torch.zeros(num_kv_rows, width, key_len, dtype=torch.bool, device=device)
        mask[:, :, 0] = True  # padding cells see slot 0 only; their output is discarded
        kv_rows, slots, grid, bounds, lo = [], [], [], [], 0
        for g in groups:
            t = g.tokens.shape[0]
            assert g.tokens.ndim == 1 and g.tokens.dtype == torch.int64 and g.positions.shape == g.tokens.shape
            if g.mask is None:
                if t != 1:
                    raise ValueError("mask: required when a request feeds more than one row")
                mask[g.kv_row, 0, :g.start + 1] = True
            else:
                assert g.mask.shape == (t, g.start + t) and g.mask.dtype == torch.bool, "mask: [T, start+T] bool"
                mask[g.kv_row, :t, :g.start + t] = g.mask
            kv_rows.append(torch.full((t,), g.kv_row, dtype=torch.int64))
            slots.append(torch.arange(g.start, g.start + t))
            grid.append(g.kv_row * width + torch.arange(t))
            bounds.append((lo, lo + t))
            lo += t
        cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
        return cls(cat([g.tokens for g in groups]), cat([g.positions for g in groups]), cat(kv_rows), cat(slots),
                   cat(grid), num_kv_rows, width, key_len, mask.unsqueeze(1), tuple(bounds), None)
