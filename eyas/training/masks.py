"""Rollout visibility for HASS alignment (design 0x07B) and EAGLE-3 training-time test (design 0x08C).

Rollout layout for one batch row of ``S`` draft rows unrolled for ``steps`` steps:

- **node (s, i)**: step ``s`` in ``[0, steps)``, row ``i`` in ``[0, S)``; flat key index
  ``s * S + i`` of the concatenated ``steps * S`` keys.
- **step 0** is native training: node ``(0, i)`` reads teacher feature ``f_i`` and token
  ``x_{i+1}`` (draft row ``i`` of design 0x02A).
- **node (s, i), s >= 1** is the depth-``s`` draft node of a chain rooted at row ``i``: it reads
  the drafter's own output state of ``(s-1, i)`` and token ``x_{i+s+1}``, and predicts
  ``x_{i+s+2}`` with target distribution ``q`` from teacher feature ``f_{i+s+1}``.
- **target prefix** of ``(s, i)``: the step-0 rows ``(0, j)`` with ``j <= i``, same segment and
  ``row_valid[j]`` -- the committed context a depth-``s`` node has at serving time.
- **draft ancestors** of ``(s, i)``: ``(s-1, i), ..., (1, i)``; its own chain only.
- **position id** of ``(s, i)``: ``position_id[i] + s``, matching serving, where a depth-``k``
  node sits at ``last_context_position + k`` (`rollout_position_ids`).

Visibility (design 0x08C): ``A[(s, i), (s', j)] = 1`` iff ``(s', j)`` is in the target prefix of
``(s, i)``, a draft ancestor of it, or ``(s, i)`` itself. Siblings ``(s', j)``, ``s' >= 1``,
``j != i`` belong to other chains and must stay invisible, as must later step-0 rows, other
segments and later steps: a dense causal mask over the physically concatenated rows would
train dependencies that do not exist at inference (design 0x07B).
"""

from __future__ import annotations

import torch
from torch import Tensor

from eyas.protocol.checks import check_tensor as _check


def _check_steps(steps: object) -> int:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps: must be an int >= 1, got {steps!r}")
    return steps


def _check_same_length(first: str, length: int, **named: Tensor) -> None:
    for name, value in named.items():
        if value.shape[0] != length:
            raise ValueError(f"{name}: length {value.shape[0]} != {first} length {length}")


def _allowed_edges(segment_id: Tensor, steps: int) -> Tensor:  # [steps, S, steps, S] bool
    """Upper bound on legal edges, before the row-validity filter of the target prefix."""
    seq = segment_id.shape[0]
    device = segment_id.device
    step = torch.arange(steps, device=device)
    row = torch.arange(seq, device=device)
    q_step = step[:, None, None, None]  # query step s
    k_step = step[None, None, :, None]  # key step s'
    q_row = row[None, :, None, None]  # query row i
    k_row = row[None, None, None, :]  # key row j
    same_segment = (segment_id[:, None] == segment_id[None, :])[None, :, None, :]

    prefix = (k_step == 0) & (k_row <= q_row) & same_segment
    chain = (k_step >= 1) & (k_step <= q_step) & (k_row == q_row)
    return prefix | chain


def rollout_visibility(
    segment_id: Tensor,  # [S] int64
    row_valid: Tensor,  # [S] bool b_i of the step-0 rows
    steps: int,
) -> Tensor:  # [steps, S, steps * S] bool; [s, i, s' * S + j] = (s, i) may attend to (s', j)
    """Attention mask of an unrolled draft rollout (design 0x07B, 0x08C).

    ``A[(s, i), (s', j)] = 1`` iff

    - ``s' == 0`` and ``j <= i`` and ``seg(j) == seg(i)`` and ``row_valid[j]`` (target prefix), or
    - ``1 <= s' <= s`` and ``j == i`` (draft ancestors and the node itself), or
    - ``s == s' == 0`` and ``j == i`` (every query sees itself, so no row is all False).

    Step ``s`` only needs keys of steps ``0..s``: it uses the ``[s, :, :(s + 1) * S]`` slice; the
    columns of later steps are False in its rows.
    """
    steps = _check_steps(steps)
    _check(segment_id, "segment_id", 1, torch.int64)
    _check(row_valid, "row_valid", 1, torch.bool)
    seq = segment_id.shape[0]
    _check_same_length("segment_id", seq, row_valid=row_valid)

    allowed = _allowed_edges(segment_id, steps)  # [steps, S, steps, S]
    step = torch.arange(steps, device=segment_id.device)
    row = torch.arange(seq, device=segment_id.device)
    key_valid = (step[:, None] >= 1) | row_valid[None, :]  # [steps, S] prefix keys must be valid
    self_edge = (step[:, None, None, None] == step[None, None, :, None]) & (
        row[None, :, None, None] == row[None, None, None, :]
    )  # [steps, S, steps, S]
    mask = (allowed & key_valid[None, None, :, :]) | self_edge
    return mask.reshape(steps, seq, steps * seq)


def rollout_valid(
    token_valid: Tensor,  # [S] bool v_t
    segment_id: Tensor,  # [S] int64
    supervise: Tensor,  # [S] bool l_t, indexed by the source row
    steps: int,
) -> Tensor:  # [steps, S] bool, True = node (s, i) carries a loss
    """Loss mask of the rollout nodes (design 0x08C ``rollout_valid_mask(step)``).

    Node ``(s, i)`` is supervised iff slots ``i, i+1, ..., i+s+1`` all exist (``i+s+1 < S``), are
    all valid and all lie in one segment, and ``l_i`` is set. The slot range covers everything
    the chain reads: ``f_i``, the tokens ``x_{i+1} .. x_{i+s+1}``, and the target feature
    ``f_{i+s+1}`` whose ``q`` is the node's target. At ``s = 0`` this is exactly
    ``m_soft_i = b_i l_i``.

    Choice: supervision is taken from the chain's source row ``i`` (the row whose context the
    chain extends), not from ``l_{i+s}`` (the one-step row that predicts the same token). The
    pinned EAGLE-3 loop instead shifts its loss mask left once per step, i.e. reads ``l_{i+s}``;
    the two differ only where ``l`` changes inside a segment (e.g. at a user/assistant turn).
    """
    steps = _check_steps(steps)
    _check(token_valid, "token_valid", 1, torch.bool)
    _check(segment_id, "segment_id", 1, torch.int64)
    _check(supervise, "supervise", 1, torch.bool)
    seq = token_valid.shape[0]
    _check_same_length("token_valid", seq, segment_id=segment_id, supervise=supervise)

    # link[t] = slots t and t+1 both valid and in one segment, for t in [0, S-2]
    link = token_valid[:-1] & token_valid[1:] & (segment_id[:-1] == segment_id[1:])  # [S-1]
    out = torch.zeros(steps, seq, dtype=torch.bool, device=token_valid.device)
    chain = torch.zeros(seq, dtype=torch.bool, device=token_valid.device)
    chain[: max(seq - 1, 0)] = link  # chain[i] = links i .. i+s all hold; s = 0 here
    for s in range(steps):
        if s > 0:
            # extend by link[i+s]; rows with i+s+1 >= S have no such link -> False
            nxt = torch.zeros(seq, dtype=torch.bool, device=token_valid.device)
            width = max(seq - 1 - s, 0)
            nxt[:width] = link[s : s + width]
            chain = chain & nxt
        out[s] = chain & supervise
    return out


def rollout_position_ids(
    position_id: Tensor,  # [S] int64 position of each step-0 row within its segment
    steps: int,
) -> Tensor:  # [steps, S] int64; [s, i] = position_id[i] + s
    """Position id of node ``(s, i)``: ``position_id[i] + s``, as a depth-``s`` node at serving."""
    steps = _check_steps(steps)
    _check(position_id, "position_id", 1, torch.int64)
    step = torch.arange(steps, dtype=torch.int64, device=position_id.device)
    return position_id[None, :] + step[:, None]


def no_sibling_or_future_edges(
    mask: Tensor,  # [steps, S, steps * S] bool
    segment_id: Tensor,  # [S] int64
    steps: int,
) -> bool:
    """The dependency-graph check of design 0x07B: True iff ``mask`` has no forbidden edge.

    Forbidden edges from query ``(s, i)`` to key ``(s', j)``:

    - to a later step, ``s' > s`` (future);
    - to a later step-0 row, ``s' == 0`` and ``j > i`` (future);
    - to another segment, ``seg(j) != seg(i)``;
    - to another chain, ``s' >= 1`` and ``j != i`` (sibling).

    This bounds the mask from above; it does not demand that every legal edge be present.
    """
    steps = _check_steps(steps)
    _check(segment_id, "segment_id", 1, torch.int64)
    _check(mask, "mask", 3, torch.bool)
    seq = segment_id.shape[0]
    if tuple(mask.shape) != (steps, seq, steps * seq):
        raise ValueError(
            f"mask: expected shape {(steps, seq, steps * seq)} for steps={steps}, S={seq}, got {tuple(mask.shape)}"
        )
    allowed = _allowed_edges(segment_id, steps).reshape(steps, seq, steps * seq)
    return not bool((mask & ~allowed).any())
