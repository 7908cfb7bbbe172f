"""Draft training rows: which (batch row, storage index) pairs a drafter trains on (design 0x02A).

Coordinates are zero-based storage indices ``t`` inside a padded batch row of length ``S``.

Terms (design 0x02A, 0x03B):

- **valid** ``v_t`` (``token_valid``): slot ``t`` holds a real token with a teacher feature.
- **segment** ``seg(t)`` (``segment_id``): packed samples in one batch row carry distinct ids.
  Padding may carry any id; it is excluded by ``v_t = 0``.
- **supervision flag** ``l_t`` (``supervise``): the dataset's choice of loss rows (e.g. assistant
  tokens), indexed by the *source* row ``t``, as in the pinned training pipeline.
- **draft row t**: input = teacher feature ``f_t`` and the advanced token ``x_{t+1}``;
  target = teacher feature ``f_{t+1}`` and the distribution ``q_{t+2} = softmax(W_U f_{t+1})``.
  The soft target needs no observed ``x_{t+2}``.
- **boundary-valid** ``b_t = [seg(t) == seg(t+1)] v_t v_{t+1}``; ``t = S-1`` is never valid
  (its ``t+1`` is out of range, and an out-of-range address is invalid, never gathered).
- **soft loss mask** ``m_soft_t = b_t l_t``; **hard loss mask**
  ``m_hard_t = m_soft_t v_{t+2} [seg(t+1) == seg(t+2)]`` -- a different, observed-token
  objective with at most ``S-2`` rows per segment, not another name for the soft rows.
- **context row**: a boundary-valid row with ``l_t = 0``. It stays in the plan and in the
  attention mask; only its loss is excluded. A supervision mask is not an attention mask.

Addresses are planned before any gather (`compile_soft_rows`), and `gather_rows` reads only the
planned ``(b, t)`` / ``(b, t+1)`` slots, so padding and cross-segment slots are never touched:
multiplying a loss by zero after an invalid read would not undo that read (NaN * 0 = NaN).

Zero eligible rows: when ``plan.num_supervised == 0`` both normalised losses are undefined
(their denominator is ``sum m = 0``); the trainer skips the whole optimizer step, including the
decoupled weight decay, rather than stepping on a zero or NaN loss (design 0x03B, 0x04C).

Two layouts are offered:

- **compact** (`RowPlan`): the ``R`` boundary-valid rows of the whole batch, in ``(b, t)`` order,
  with their original batch/segment/position identities, and an ``[R, R]`` block-causal mask.
- **dense**: keep the ``[B, S]`` grid; `dense_row_masks` marks which rows are valid/supervised,
  `block_causal_mask` gives a ``[B, S, S]`` mask and `dense_gather_rows` fills the shifted inputs
  with invalid rows *replaced* by zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.protocol.checks import check_tensor as _check

INVALID_ROW_TOKEN: int = 0  # dense layout: advanced token written into a row that is not b_t = 1
INVALID_ROW_FEATURE: float = 0.0  # dense layout: feature value written into such a row


# --------------------------------------------------------------------------------------------
# boundary checks
# --------------------------------------------------------------------------------------------


def _check_grid(**named: Tensor) -> tuple[int, int]:
    """All named tensors are [B, S] with the dtype their name implies; returns (B, S)."""
    dtypes = {
        "token_valid": torch.bool,
        "row_valid": torch.bool,
        "supervise": torch.bool,
        "segment_id": torch.int64,
        "position_id": torch.int64,
        "tokens": torch.int64,
    }
    shape: tuple[int, int] | None = None
    first = ""
    for name, value in named.items():
        _check(value, name, 2, dtypes[name])
        if shape is None:
            shape, first = (value.shape[0], value.shape[1]), name
        elif tuple(value.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {first} shape {shape}")
    assert shape is not None
    return shape


# --------------------------------------------------------------------------------------------
# dense layout: per-slot masks over the [B, S] grid
# --------------------------------------------------------------------------------------------


def dense_row_masks(
    token_valid: Tensor,  # [B, S] bool v_t
    segment_id: Tensor,  # [B, S] int64 seg(t)
    supervise: Tensor,  # [B, S] bool l_t, indexed by the source row
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-slot row masks of the dense layout (design 0x02A).

    Returns ``(row_valid, row_supervise, row_supervise_hard)``, each ``[B, S]`` bool:

    - ``row_valid[b, t] = b_t = [seg(t) == seg(t+1)] v_t v_{t+1}`` (False at ``t = S-1``),
    - ``row_supervise = m_soft = b_t l_t``,
    - ``row_supervise_hard = m_hard = m_soft v_{t+2} [seg(t+1) == seg(t+2)]``
      (False at ``t >= S-2``).
    """
    batch, seq = _check_grid(token_valid=token_valid, segment_id=segment_id, supervise=supervise)
    v, seg = token_valid, segment_id

    # pair (t, t+1) is legal iff both valid and in one segment; defined for t in [0, S-2]
    pair_ok = v[:, :-1] & v[:, 1:] & (seg[:, :-1] == seg[:, 1:])  # [B, S-1]
    row_valid = torch.zeros(batch, seq, dtype=torch.bool, device=v.device)
    row_valid[:, : seq - 1] = pair_ok
    row_supervise = row_valid & supervise

    # hard rows also need the observed x_{t+2}: pair (t+1, t+2) legal, t in [0, S-3]
    next_ok = torch.zeros(batch, seq, dtype=torch.bool, device=v.device)
    next_ok[:, : max(seq - 2, 0)] = pair_ok[:, 1:]
    row_supervise_hard = row_supervise & next_ok
    return row_valid, row_supervise, row_supervise_hard


def block_causal_mask(
    segment_id: Tensor,  # [B, S] int64
    row_valid: Tensor,  # [B, S] bool b_t (from dense_row_masks)
) -> Tensor:  # [B, S, S] bool, True = query t may attend to key j
    """Block-causal draft attention for the dense layout (design 0x02A, 0x03C).

    Query row ``t`` sees key row ``j`` iff ``j <= t``, ``seg(j) == seg(t)`` and both rows are
    row-valid, so packed samples never see each other and no row sees padding.

    An invalid query row additionally sees itself (and only itself). Without that, its mask row
    would be all False and a softmax over it would be 0/0 = NaN, which then poisons gradients
    even though the row carries no loss. The output at such a row is meaningless but finite;
    no valid query ever sees it, because valid queries only see valid keys.
    """
    batch, seq = _check_grid(segment_id=segment_id, row_valid=row_valid)
    device = segment_id.device
    causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()  # [S, S]
    same_segment = segment_id[:, :, None] == segment_id[:, None, :]  # [B, S, S]
    both_valid = row_valid[:, :, None] & row_valid[:, None, :]  # [B, S, S]
    mask = causal & same_segment & both_valid
    self_only = torch.eye(seq, dtype=torch.bool, device=device) & ~row_valid[:, :, None]
    return mask | self_only


def dense_gather_rows(
    features: Tensor,  # [B, S, F] teacher features f_t
    tokens: Tensor,  # [B, S] int64 x_t
    row_valid: Tensor,  # [B, S] bool b_t (from dense_row_masks)
) -> tuple[Tensor, Tensor, Tensor]:
    """Shifted draft-row inputs and targets on the dense grid (design 0x02A, 0x03B).

    Returns ``(source_feature [B, S, F], advanced_token [B, S], target_feature [B, S, F])`` with
    row ``t`` holding ``f_t``, ``x_{t+1}``, ``f_{t+1}`` where ``row_valid[b, t]``. Every other row
    is *replaced* (``torch.where``, a select -- not a multiply) by ``INVALID_ROW_FEATURE`` and
    ``INVALID_ROW_TOKEN``, so NaN/inf or huge ids stored in padding cannot leak. This matters even
    under a correct attention mask: masked attention still multiplies masked values by a zero
    probability, and ``0 * NaN = NaN``.
    """
    _check(features, "features", 3)
    batch, seq = _check_grid(tokens=tokens, row_valid=row_valid)
    if tuple(features.shape[:2]) != (batch, seq):
        raise ValueError(f"features: shape {tuple(features.shape)} does not match [B, S] = {(batch, seq)}")

    keep = row_valid[:, :, None]  # [B, S, 1]
    fill = torch.full((), INVALID_ROW_FEATURE, dtype=features.dtype, device=features.device)
    source_feature = torch.where(keep, features, fill)

    shifted_feature = torch.cat([features[:, 1:], torch.zeros_like(features[:, :1])], dim=1)
    target_feature = torch.where(keep, shifted_feature, fill)

    shifted_token = torch.cat([tokens[:, 1:], torch.zeros_like(tokens[:, :1])], dim=1)
    advanced_token = torch.where(row_valid, shifted_token, INVALID_ROW_TOKEN)
    return source_feature, advanced_token, target_feature


# --------------------------------------------------------------------------------------------
# compact layout: a plan of boundary-valid rows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowPlan:
    """The boundary-valid draft rows of a batch, compacted in ``(b, t)`` order (design 0x02A).

    Every planned row has ``b_t = 1``; rows with ``supervise = False`` are context only.
    The target index of a row is ``source + 1``; its advanced token is also read at ``source + 1``.
    """

    batch_index: Tensor  # [R] int64 original batch row b of each draft row
    source: Tensor  # [R] int64 source index t (f_t, x_{t+1}); target index is t + 1
    segment_id: Tensor  # [R] int64 original segment id
    position_id: Tensor  # [R] int64 original position of the source t
    supervise: Tensor  # [R] bool m_soft (loss rows); False rows are context only
    supervise_hard: Tensor  # [R] bool m_hard (implies supervise)

    def __post_init__(self) -> None:
        for name, dtype in (
            ("batch_index", torch.int64),
            ("source", torch.int64),
            ("segment_id", torch.int64),
            ("position_id", torch.int64),
            ("supervise", torch.bool),
            ("supervise_hard", torch.bool),
        ):
            _check(getattr(self, name), name, 1, dtype)
        rows = self.batch_index.shape[0]
        for name in ("source", "segment_id", "position_id", "supervise", "supervise_hard"):
            if getattr(self, name).shape[0] != rows:
                raise ValueError(f"{name}: length {getattr(self, name).shape[0]} != batch_index length {rows}")

    @property
    def num_rows(self) -> int:
        """R: all boundary-valid rows, supervised or context."""
        return self.batch_index.shape[0]

    @property
    def num_supervised(self) -> int:
        """sum m_soft; 0 means the trainer skips the optimizer step (incl. weight decay)."""
        return int(self.supervise.sum().item())

    @property
    def target(self) -> Tensor:  # [R] int64
        """Target index t + 1 of each row (feature f_{t+1}, advanced token x_{t+1})."""
        return self.source + 1


def compile_soft_rows(
    token_valid: Tensor,  # [B, S] bool v_t
    segment_id: Tensor,  # [B, S] int64 seg(t)
    supervise: Tensor,  # [B, S] bool l_t, indexed by the source row
    position_id: Tensor,  # [B, S] int64 position of t within its own segment
) -> RowPlan:
    """Plan every boundary-valid row ``b_t = 1`` of the batch, in ``(b, t)`` order (design 0x02A).

    Only masks are read here; features and tokens are gathered afterwards by `gather_rows`,
    which touches nothing but the planned addresses.
    """
    _check_grid(
        token_valid=token_valid,
        segment_id=segment_id,
        supervise=supervise,
        position_id=position_id,
    )
    row_valid, row_supervise, row_supervise_hard = dense_row_masks(token_valid, segment_id, supervise)
    batch_index, source = row_valid.nonzero(as_tuple=True)  # row-major: (b, t) order
    return RowPlan(
        batch_index=batch_index,
        source=source,
        segment_id=segment_id[batch_index, source],
        position_id=position_id[batch_index, source],
        supervise=row_supervise[batch_index, source],
        supervise_hard=row_supervise_hard[batch_index, source],
    )


def gather_rows(
    plan: RowPlan,
    features: Tensor,  # [B, S, F] teacher features f_t
    tokens: Tensor,  # [B, S] int64 x_t
) -> tuple[Tensor, Tensor, Tensor]:
    """Read the planned addresses: ``(f_t [R, F], x_{t+1} [R], f_{t+1} [R, F])`` (design 0x03B).

    For one unpadded, unpacked segment this equals ``features[:, :-1]``, ``tokens[:, 1:]`` and
    ``features[:, 1:]``. Only ``(b, t)`` and ``(b, t+1)`` of planned rows are indexed, so padding
    and slots outside the plan are never read.
    """
    _check(features, "features", 3)
    batch, seq = _check_grid(tokens=tokens)
    if tuple(features.shape[:2]) != (batch, seq):
        raise ValueError(f"features: shape {tuple(features.shape)} does not match tokens [B, S] = {(batch, seq)}")
    if plan.num_rows:
        if int(plan.batch_index.min()) < 0 or int(plan.batch_index.max()) >= batch:
            raise ValueError(f"plan.batch_index: out of range for batch size {batch}")
        if int(plan.source.min()) < 0 or int(plan.source.max()) + 1 >= seq:
            raise ValueError(f"plan.source: source or source + 1 out of range for length {seq}")

    b, t = plan.batch_index, plan.source
    return features[b, t], tokens[b, t + 1], features[b, t + 1]


def row_attention_mask(plan: RowPlan) -> Tensor:  # [R, R] bool, True = row i may attend to row j
    """Block-causal mask over compacted rows (design 0x02A).

    Row ``i`` sees row ``j`` iff both come from the same batch row and segment and
    ``source_j <= source_i``. Packed samples never see each other; context rows are visible.
    Every row sees itself, so no mask row is all False.
    """
    same_batch = plan.batch_index[:, None] == plan.batch_index[None, :]  # [R, R]
    same_segment = plan.segment_id[:, None] == plan.segment_id[None, :]  # [R, R]
    causal = plan.source[None, :] <= plan.source[:, None]  # [R, R] source_j <= source_i
    return same_batch & same_segment & causal
