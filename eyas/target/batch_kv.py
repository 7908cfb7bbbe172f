"""One K/V store for every live request of a target engine, and the plan of one batched forward.

Terms (design 0x05C, 0x05D):
- *KV row*: one request's place in the store's batch dimension. Its slots ``[0, committed)`` hold
  committed K/V; the slots after them are provisional (a verify's tree rows, a prompt's prefill
  chunks) until the publish transaction gathers the accepted ones onto the committed prefix.
- *packed row*: one token of the forward (a prefill row, a decode row or a tree row). Every
  projection and MLP runs once over the N packed rows of all requests together.
- *padded query grid*: the decode and tree rows of every request attend in ONE call per layer
  over the KV rows ``[0, kv_rows)``: each request's packed rows are placed at ``[kv_row, 0:T_i]``
  of a ``[kv_rows, width]`` query grid, and a boolean mask ``[kv_rows, 1, width, key_len]``
  expresses each row's causal prefix, tree ancestry and padding. Grid cells that carry no packed
  row see slot 0 only (so no softmax row is empty) and are discarded. A prefill chunk wider than
  ``GRID_WIDTH`` rows attends in a call of its own (padding every request to a chunk's width
  would multiply the attention's work by the batch size), as does the only request of a forward.

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
MIN_ROWS = 4  # the smallest row capacity allocated
GRID_WIDTH = 64  # a request feeding more rows than this (a prefill chunk) attends in its own call


class BatchKV:
    """Padded K/V of an engine's live requests, and which request owns each row. Owned by one engine
    (a ``TargetEngine`` or a ``DrafterEngine``); mutated only by it."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        key_dtype: torch.dtype | None = None,
        key_width: int | None = None,
    ):
        """``key_dtype``, ``key_width``: how a key is held (``TargetModel.key_layout``: Q8 blocks under the
        gguf precision's fused forward); None: as the values (``dtype``, ``head_dim``)."""
        self.shape_per_slot = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, torch.device(device)
        self.key_dtype, self.key_width = key_dtype or dtype, key_width or head_dim
        self.k = torch.zeros(
            num_layers, 0, num_kv_heads, 0, self.key_width, dtype=self.key_dtype, device=self.device
        )  # [L, B, H_kv, S, key_width]
        self.v = torch.zeros(
            num_layers, 0, num_kv_heads, 0, head_dim, dtype=dtype, device=self.device
        )  # [L, B, H_kv, S, hd]
        self.owners: list[tuple[str, int]] = []  # KV row -> (its request id, the slots it may use); rows [0, live)
        # the storage the last close of every row released, kept for the next growth (None: none kept):
        # sequential requests reuse it instead of allocating, zeroing and page-faulting a store each
        self.spare: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def row_capacity(self) -> int:
        return self.k.shape[1]

    @property
    def slot_capacity(self) -> int:
        return self.k.shape[3]

    @property
    def bytes_per_slot(self) -> int:
        L, H, hd = self.shape_per_slot
        return L * H * (self.key_width * self.k.element_size() + hd * self.v.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes of the store live rows use (0 once every row is closed)."""
        return self.row_capacity * self.slot_capacity * self.bytes_per_slot

    @property
    def spare_nbytes(self) -> int:
        """Bytes of the released storage kept for the next growth (:attr:`spare`)."""
        return 0 if self.spare is None else self.spare[0].shape[1] * self.spare[0].shape[3] * self.bytes_per_slot

    def reserve(self, rows: int, slots: int) -> None:
        """Grow (never shrink) to at least ``rows`` KV rows of ``slots`` slots, keeping every value."""
        if rows <= self.row_capacity and slots <= self.slot_capacity:
            return
        new_rows = max(self.row_capacity, MIN_ROWS)
        while new_rows < rows:
            new_rows *= 2
        new_slots = max(self.slot_capacity, -(-slots // SLOT_GRANULE) * SLOT_GRANULE)
        L, H, hd = self.shape_per_slot
        spare, self.spare = self.spare, None
        with torch.inference_mode(False):  # a store grown inside a forward stays writable outside one
            if spare is not None and spare[0].shape[1] >= new_rows and spare[0].shape[3] >= new_slots:
                # the kept storage, whole: its slots past the copied ones hold an earlier request's finite
                # K/V, which no row sees (a row's mask shows only slots it has written)
                k, v = spare
            else:
                k = torch.zeros(L, new_rows, H, new_slots, self.key_width, dtype=self.key_dtype, device=self.device)
                v = torch.zeros(L, new_rows, H, new_slots, hd, dtype=self.dtype, device=self.device)
            b, s = self.row_capacity, self.slot_capacity
            k[:, :b, :, :s], v[:, :b, :, :s] = self.k, self.v
        self.k, self.v = k, v

    def open_row(self, owner: str, slots: int) -> int:
        """Give ``owner`` the next KV row, with a budget of ``slots`` slots -> that row. The storage grows
        with what is written (:meth:`fit`), not with the budgets: a request whose answer may run to the
        end of the context holds only the slots it has filled so far."""
        self.reserve(len(self.owners) + 1, 0)
        self.owners.append((owner, slots))
        return len(self.owners) - 1

    def fit(self, rows: int, slots: int) -> None:
        """Make room for a forward over KV rows ``[0, rows)`` and slots ``[0, slots)``: growing the slots
        geometrically (twice the current capacity, within the largest budget) so that a long answer
        copies the store O(log n) times. A forward past every live row's budget is refused."""
        if rows <= self.row_capacity and slots <= self.slot_capacity:
            return
        budget = max((b for _, b in self.owners), default=0)
        if rows > len(self.owners) or slots > budget:
            raise ValueError(
                f"rows: the plan reaches past the K/V store ({rows} rows x {slots} slots; {len(self.owners)} rows "
                f"of at most {budget} slots open)"
            )
        granule = lambda n: -(-n // SLOT_GRANULE) * SLOT_GRANULE  # noqa: E731
        self.reserve(rows, max(granule(slots), min(2 * self.slot_capacity, granule(budget))))

    def close_row(self, kv_row: int) -> str | None:
        """Free ``kv_row``: the last row moves into its place with its K/V, so the live rows stay
        ``[0, live)``; the last row's close releases the storage (kept as the :attr:`spare`). -> the owner
        now at ``kv_row`` (it moved), or None."""
        last, slots = self.owners.pop()
        moved = None
        if kv_row < len(self.owners):
            self.move(len(self.owners), kv_row, min(slots, self.slot_capacity))
            self.owners[kv_row] = (last, slots)
            moved = last
        if not self.owners:
            self.release()
        return moved

    def close_session(self, sessions: dict, request_id: str) -> None:
        """An engine's close: drop ``request_id``'s session from ``sessions`` (request id -> a session
        with a ``kv_row``; a no-op for an unknown id), free its row (:meth:`close_row`), and give the
        session whose row moved into the place its new row."""
        s = sessions.pop(request_id, None)
        if s is None:
            return
        moved = self.close_row(s.kv_row)
        if moved is not None:
            sessions[moved].kv_row = s.kv_row

    def release(self, keep: bool = True) -> None:
        """Give the storage up (:meth:`close_row` calls this when the last row closes): kept as the
        :attr:`spare` for the next growth (``keep``), else freed with any spare."""
        if keep and self.k.numel() and (self.spare is None or self.spare[0].numel() <= self.k.numel()):
            self.spare = (self.k, self.v)
        elif not keep:
            self.spare = None
        self.k = self.k.new_zeros(self.k.shape[0], 0, self.k.shape[2], 0, self.k.shape[4])
        self.v = self.v.new_zeros(self.v.shape[0], 0, self.v.shape[2], 0, self.v.shape[4])

    def write(self, layer: int, kv_rows: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v ([N, H_kv, hd]) of N packed rows at (``kv_rows``[n], ``slots``[n]) ([N] int64 each)."""
        self.k[layer, kv_rows, :, slots] = k
        self.v[layer, kv_rows, :, slots] = v

    def write_span(
        self, layer: int, kv_row: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v ([1, H_kv, T, hd]) of one request at slots [start, start+T) of ``kv_row``; return
        its keys/values of [0, start+T) (views, [1, H_kv, start+T, hd])."""
        t = k.shape[2]
        self.k[layer, kv_row, :, start : start + t] = k[0]
        self.v[layer, kv_row, :, start : start + t] = v[0]
        return (self.k[layer, kv_row : kv_row + 1, :, : start + t], self.v[layer, kv_row : kv_row + 1, :, : start + t])

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
        self.k[:, kv_row, :, dst_start : dst_start + a] = k_rows
        self.v[:, kv_row, :, dst_start : dst_start + a] = v_rows

    def write_prefix(self, kv_row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values ([L, H_kv, n, hd] each) at slots ``[0, n)`` of ``kv_row`` (a prefix-cache hit)."""
        n = keys.shape[2]
        self.fit(kv_row + 1, n)
        self.k[:, kv_row, :, :n] = keys
        self.v[:, kv_row, :, :n] = values

    def read_span(self, kv_row: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of ``kv_row``'s keys and values at slots ``[start, stop)`` ([L, H_kv, stop - start, hd] each)."""
        return self.k[:, kv_row, :, start:stop].clone(), self.v[:, kv_row, :, start:stop].clone()

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
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    start: int
    mask: torch.Tensor | None  # [T, start + T] bool, or None when T == 1


@dataclass(frozen=True)
class Grid:
    """The padded query grid of a batched attention call: the packed rows ``rows`` of the requests
    in it, each request's rows at cells ``[kv_row, 0:T]`` of ``[num_kv_rows, width]``."""

    rows: torch.Tensor  # [M] int64, the packed rows in the grid
    cells: torch.Tensor  # [M] int64, each one's cell in the [num_kv_rows * width] grid
    num_kv_rows: int  # the attention call's batch: KV rows [0, num_kv_rows)
    width: int  # the grid's query rows per KV row (its widest request)
    key_len: int  # slots [0, key_len) are read
    mask: torch.Tensor  # [num_kv_rows, 1, width, key_len] bool: True = may attend
    _blocked: dict = field(default_factory=dict, compare=False, repr=False)  # grouped_mask's per-size cache

    def grouped_mask(self, group: int) -> torch.Tensor:
        """Where a query may NOT look, for queries grouped by KV head as rows (g, w):
        [num_kv_rows, 1, group * width, key_len] bool (built once per group size, then shared)."""
        cached = self._blocked.get(group)
        if cached is None:
            B, _, W, S = self.mask.shape
            cached = (~self.mask).unsqueeze(2).expand(B, 1, group, W, S).reshape(B, 1, group * W, S)
            self._blocked[group] = cached
        return cached


@dataclass(frozen=True)
class Wide:
    """A request whose rows attend in their own call: a prefill chunk wider than ``GRID_WIDTH``, or
    the only request of the forward. Rows ``[lo, hi)`` of the packed batch, slots ``[start,
    start + hi - lo)`` of KV row ``kv_row``."""

    kv_row: int
    start: int
    lo: int
    hi: int
    mask: torch.Tensor | None  # [1, T, start + T] bool, or None for one row that sees every slot


@dataclass(frozen=True)
class BatchRows:
    """The plan of one batched forward, built once and shared by every layer.

    The requests' decode and tree rows attend in ONE call, over a padded grid; a request wider than
    ``GRID_WIDTH`` rows (a prefill chunk) attends in its own call, since padding every request to
    a chunk's width would multiply the attention's work by the batch size."""

    tokens: torch.Tensor  # [N] int64, the packed rows of every group in order
    positions: torch.Tensor  # [N] int64
    kv_rows: torch.Tensor  # [N] int64, each packed row's KV row
    slots: torch.Tensor  # [N] int64, each packed row's slot
    grid: Grid | None
    wide: tuple[Wide, ...]
    bounds: tuple[tuple[int, int], ...]  # each group's [lo, hi) among the packed rows
    max_position: int  # the largest position id (read on the host, before the move)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_kv_rows(self) -> int:
        return max([self.grid.num_kv_rows if self.grid else 0] + [w.kv_row + 1 for w in self.wide])

    @property
    def key_len(self) -> int:
        return max([self.grid.key_len if self.grid else 0] + [w.start + w.hi - w.lo for w in self.wide])

    def visibility(self) -> torch.Tensor:
        """What each packed row sees of its K/V row, as one mask [N, key_len] bool (True: may attend),
        for kernels that attend row by row (``eyas.target.quantized``)."""
        seen = torch.zeros(self.num_rows, self.key_len, dtype=torch.bool, device=self.tokens.device)
        for w in self.wide:
            t = w.hi - w.lo
            if w.mask is None:
                seen[w.lo, : w.start + 1] = True
            else:
                seen[w.lo : w.hi, : w.start + t] = w.mask[0]
        if self.grid is not None:
            g = self.grid
            B, _, W, S = g.mask.shape
            seen[g.rows, :S] = g.mask.reshape(B * W, S)[g.cells]
        return seen

    @classmethod
    def build(cls, groups: list[RowGroup], device: str | torch.device = "cpu") -> BatchRows:
        assert groups, "groups: at least one"
        kv_rows_seen = [g.kv_row for g in groups]
        assert len(set(kv_rows_seen)) == len(kv_rows_seen), "groups: a KV row appears twice"
        kv_rows, slots, bounds, lo = [], [], [], 0
        gridded, wide = [], []
        for g in groups:
            t = g.tokens.shape[0]
            assert g.tokens.ndim == 1 and g.tokens.dtype == torch.int64 and g.positions.shape == g.tokens.shape
            if g.mask is None and t != 1:
                raise ValueError("mask: required when a request feeds more than one row")
            if g.mask is not None:
                assert g.mask.shape == (t, g.start + t) and g.mask.dtype == torch.bool, "mask: [T, start+T] bool"
            kv_rows.append(torch.full((t,), g.kv_row, dtype=torch.int64))
            slots.append(torch.arange(g.start, g.start + t))
            bounds.append((lo, lo + t))
            if len(groups) == 1 or t > GRID_WIDTH:
                wide.append(Wide(g.kv_row, g.start, lo, lo + t, None if g.mask is None else g.mask[None].to(device)))
            else:
                gridded.append((g, lo))
            lo += t
        cat = lambda xs: torch.cat(xs).to(device)  # noqa: E731
        grid = cls._grid(gridded, device) if gridded else None
        positions = torch.cat([g.positions for g in groups])
        return cls(
            cat([g.tokens for g in groups]),
            positions.to(device),
            cat(kv_rows),
            cat(slots),
            grid,
            tuple(wide),
            tuple(bounds),
            int(positions.max()),
        )

    @staticmethod
    def _grid(gridded: list[tuple[RowGroup, int]], device) -> Grid:
        width = max(g.tokens.shape[0] for g, _ in gridded)
        num_kv_rows = max(g.kv_row for g, _ in gridded) + 1
        key_len = max(g.start + g.tokens.shape[0] for g, _ in gridded)
        mask = torch.zeros(num_kv_rows, width, key_len, dtype=torch.bool)
        mask[:, :, 0] = True  # padding cells see slot 0 only; their output is discarded
        rows, cells = [], []
        for g, lo in gridded:
            t = g.tokens.shape[0]
            if g.mask is None:
                mask[g.kv_row, 0, : g.start + 1] = True
            else:
                mask[g.kv_row, :t, : g.start + t] = g.mask
            rows.append(torch.arange(lo, lo + t))
            cells.append(g.kv_row * width + torch.arange(t))
        return Grid(
            torch.cat(rows).to(device),
            torch.cat(cells).to(device),
            num_kv_rows,
            width,
            key_len,
            mask.unsqueeze(1).to(device),
        )
