"""Draft training rows: index shift, soft/hard masks, packing, padding (design 0x02A, 0x03B, 0x09)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eyas.training.rows import (
    INVALID_ROW_FEATURE,
    INVALID_ROW_TOKEN,
    RowPlan,
    block_causal_mask,
    compile_soft_rows,
    dense_gather_rows,
    dense_row_masks,
    gather_rows,
    row_attention_mask,
)

HUGE_TOKEN = 2**62  # an id no embedding table has; reading it would be visible in the outputs
FEATURE_WIDTH = 3


def bool_t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


def long_t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def features_for(batch: int, seq: int) -> torch.Tensor:  # [B, S, F]; f[b, t, :] = 100 b + t
    base = 100.0 * torch.arange(batch)[:, None] + torch.arange(seq)[None, :]
    return base[:, :, None].expand(batch, seq, FEATURE_WIDTH).clone()


def positions_for(segment_id: torch.Tensor) -> torch.Tensor:  # [B, S] position within segment
    pos = torch.zeros_like(segment_id)
    for b in range(segment_id.shape[0]):
        for t in range(1, segment_id.shape[1]):
            same = segment_id[b, t] == segment_id[b, t - 1]
            pos[b, t] = pos[b, t - 1] + 1 if same else 0
    return pos


# --------------------------------------------------------------------------------------------
# golden: the design 0x09 row oracle
# --------------------------------------------------------------------------------------------


def test_row_oracle_golden():
    """Seed 0x09 row oracle (zero-based storage indices).

    tokens:     [11, 12, 13, 14, 15, 16]
    valid:      [1,  1,  1,  1,  1,  0]
    soft rows:  4 (sources 0, 1, 2, 3; all supervised)
    hard rows:  3 (sources 0, 1, 2)
    first row:  f_0 + token 12 -> f_1 (+ q_2)
    last soft:  f_3 + token 15 -> f_4 (+ q_5); q_5 comes from f_4
    slot 5 is invalid and never read: features[..., 5, :] = NaN and tokens[..., 5] = huge id,
    yet every gathered output is finite and free of the huge id.
    """
    tokens = long_t([[11, 12, 13, 14, 15, 16]])
    valid = bool_t([[1, 1, 1, 1, 1, 0]])
    segment = long_t([[0, 0, 0, 0, 0, 0]])
    supervise = bool_t([[1, 1, 1, 1, 1, 1]])
    position = long_t([[0, 1, 2, 3, 4, 5]])

    plan = compile_soft_rows(valid, segment, supervise, position)
    assert plan.num_rows == 4
    assert plan.source.tolist() == [0, 1, 2, 3]
    assert plan.target.tolist() == [1, 2, 3, 4]
    assert plan.batch_index.tolist() == [0, 0, 0, 0]
    assert plan.position_id.tolist() == [0, 1, 2, 3]
    assert plan.num_supervised == 4
    assert plan.supervise_hard.tolist() == [True, True, True, False]
    assert int(plan.supervise_hard.sum()) == 3

    features = features_for(1, 6)
    features[..., 5, :] = float("nan")
    tokens[..., 5] = HUGE_TOKEN
    source_feature, advanced_token, target_feature = gather_rows(plan, features, tokens)

    assert source_feature.shape == (4, FEATURE_WIDTH)
    assert target_feature.shape == (4, FEATURE_WIDTH)
    assert torch.isfinite(source_feature).all() and torch.isfinite(target_feature).all()
    assert HUGE_TOKEN not in advanced_token.tolist()
    assert advanced_token.tolist() == [12, 13, 14, 15]
    assert source_feature[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]  # f_0 .. f_3
    assert target_feature[:, 0].tolist() == [1.0, 2.0, 3.0, 4.0]  # f_1 .. f_4 (f_4 -> q_5)


def test_unpadded_segment_matches_plain_shift():
    """One unpadded segment: rows equal feature[:, :-1], tokens[:, 1:], feature[:, 1:] (0x03B)."""
    seq = 7
    tokens = torch.arange(20, 20 + seq, dtype=torch.int64)[None, :]
    valid = torch.ones(1, seq, dtype=torch.bool)
    segment = torch.zeros(1, seq, dtype=torch.int64)
    features = torch.randn(1, seq, 5)
    plan = compile_soft_rows(valid, segment, valid.clone(), positions_for(segment))
    source_feature, advanced_token, target_feature = gather_rows(plan, features, tokens)
    assert plan.num_rows == seq - 1  # soft: up to S-1 rows
    assert int(plan.supervise_hard.sum()) == seq - 2  # hard: up to S-2 rows
    assert torch.equal(source_feature, features[0, :-1])
    assert torch.equal(advanced_token, tokens[0, 1:])
    assert torch.equal(target_feature, features[0, 1:])


# --------------------------------------------------------------------------------------------
# supervision, padding, packing, empty plans
# --------------------------------------------------------------------------------------------


def test_unsupervised_rows_stay_as_context():
    """l_t = 0 rows (e.g. the prompt) stay in the plan and in the mask but carry no loss.

    tokens 6, all valid, one segment, supervise = [0, 0, 1, 1, 1, 0]:
    rows 0..4 (5 rows), m_soft = [0, 0, 1, 1, 1], m_hard = [0, 0, 1, 1, 0].
    """
    valid = torch.ones(1, 6, dtype=torch.bool)
    segment = torch.zeros(1, 6, dtype=torch.int64)
    supervise = bool_t([[0, 0, 1, 1, 1, 0]])
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert plan.source.tolist() == [0, 1, 2, 3, 4]
    assert plan.supervise.tolist() == [False, False, True, True, True]
    assert plan.supervise_hard.tolist() == [False, False, True, True, False]
    assert plan.num_supervised == 3

    mask = row_attention_mask(plan)
    assert mask[2, 0] and mask[2, 1]  # supervised rows attend to the context rows
    assert torch.equal(mask, torch.ones(5, 5, dtype=torch.bool).tril())


def test_padding_is_never_planned_or_read():
    """Right padding in batch row 1: valid = [1, 1, 1, 0, 0]; padding carries NaN / huge ids.

    Row 0 (no padding) plans sources 0..3; row 1 plans sources 0, 1 only (pair (2, 3) has an
    invalid slot 3). Gathered outputs are finite and contain no padding token.
    """
    valid = bool_t([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    segment = long_t([[0, 0, 0, 0, 0], [0, 0, 0, 7, 7]])  # padding may carry any id
    supervise = torch.ones(2, 5, dtype=torch.bool)
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert list(zip(plan.batch_index.tolist(), plan.source.tolist())) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 0),
        (1, 1),
    ]
    assert plan.supervise_hard.tolist() == [True, True, True, False, True, False]

    features = features_for(2, 5)
    features[1, 3:] = float("nan")
    tokens = long_t([[1, 2, 3, 4, 5], [6, 7, 8, HUGE_TOKEN, HUGE_TOKEN]])
    source_feature, advanced_token, target_feature = gather_rows(plan, features, tokens)
    assert torch.isfinite(source_feature).all() and torch.isfinite(target_feature).all()
    assert advanced_token.tolist() == [2, 3, 4, 5, 7, 8]

    mask = row_attention_mask(plan)
    assert not mask[:4, 4:].any() and not mask[4:, :4].any()  # batch rows never see each other


def test_two_packed_segments_in_one_row():
    """Two samples packed in one row: segment = [3, 3, 3, 9, 9, 9, 9].

    The pair (2, 3) crosses the boundary, so source 2 is not a row. Rows: 0, 1 (segment 3) and
    3, 4, 5 (segment 9). Hard rows also need seg(t+1) == seg(t+2): source 1 is soft-only.
    Positions restart in segment 9. The attention mask has no cross-segment edge.
    """
    valid = torch.ones(1, 7, dtype=torch.bool)
    segment = long_t([[3, 3, 3, 9, 9, 9, 9]])
    supervise = torch.ones(1, 7, dtype=torch.bool)
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert plan.source.tolist() == [0, 1, 3, 4, 5]
    assert plan.segment_id.tolist() == [3, 3, 9, 9, 9]
    assert plan.position_id.tolist() == [0, 1, 0, 1, 2]
    assert plan.supervise_hard.tolist() == [True, False, True, True, False]

    features = features_for(1, 7)
    tokens = torch.arange(7, dtype=torch.int64)[None, :]
    source_feature, advanced_token, target_feature = gather_rows(plan, features, tokens)
    for r in range(plan.num_rows):  # no row crosses the boundary
        t = int(plan.source[r])
        assert segment[0, t] == segment[0, t + 1]
        assert int(advanced_token[r]) == t + 1 and target_feature[r, 0] == t + 1

    mask = row_attention_mask(plan)
    expected = bool_t(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_zero_eligible_rows():
    """No supervised row -> num_supervised == 0: the trainer then skips the optimizer step,
    including weight decay (design 0x03B, 0x04C).

    Case 1: all rows context-only (supervise all False): 3 rows planned, 0 supervised.
    Case 2: only single-token samples / padding: no row is planned at all.
    """
    valid = torch.ones(1, 4, dtype=torch.bool)
    segment = torch.zeros(1, 4, dtype=torch.int64)
    supervise = torch.zeros(1, 4, dtype=torch.bool)
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert plan.num_rows == 3 and plan.num_supervised == 0

    valid = bool_t([[1, 0, 0, 0], [0, 0, 0, 0]])
    segment = long_t([[0, 1, 2, 3], [0, 0, 0, 0]])
    supervise = torch.ones(2, 4, dtype=torch.bool)
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert plan.num_rows == 0 and plan.num_supervised == 0
    source_feature, advanced_token, target_feature = gather_rows(
        plan, features_for(2, 4), torch.zeros(2, 4, dtype=torch.int64)
    )
    assert source_feature.shape == (0, FEATURE_WIDTH) and advanced_token.shape == (0,)
    assert row_attention_mask(plan).shape == (0, 0)


def test_interior_invalid_slot_breaks_rows_but_not_context():
    """valid = [1, 1, 0, 1, 1] in one segment: pairs (1, 2) and (2, 3) are illegal.

    Rows 0 and 3; both in segment 0, so row 3 may attend to row 0 (same sample, causal).
    """
    valid = bool_t([[1, 1, 0, 1, 1]])
    segment = torch.zeros(1, 5, dtype=torch.int64)
    supervise = torch.ones(1, 5, dtype=torch.bool)
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert plan.source.tolist() == [0, 3]
    assert plan.supervise_hard.tolist() == [False, False]
    assert row_attention_mask(plan).tolist() == [[True, False], [True, True]]


# --------------------------------------------------------------------------------------------
# dense layout
# --------------------------------------------------------------------------------------------


def test_dense_masks_match_formulas_and_plan():
    """Dense masks equal b_t, m_soft, m_hard of design 0x02A and agree with the compact plan."""
    valid = bool_t([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    segment = long_t([[0, 0, 0, 0, 0, 0], [4, 4, 4, 5, 5, 5]])
    supervise = bool_t([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    row_valid, row_sup, row_hard = dense_row_masks(valid, segment, supervise)
    assert row_valid.tolist() == [
        [True, True, True, True, False, False],
        [True, True, False, True, True, False],
    ]
    assert row_sup.tolist() == [
        [True, True, True, True, False, False],
        [False, True, False, True, True, False],
    ]
    assert row_hard.tolist() == [
        [True, True, True, False, False, False],
        [False, False, False, True, False, False],
    ]
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))
    assert torch.equal(plan.supervise, row_sup[plan.batch_index, plan.source])
    assert torch.equal(plan.supervise_hard, row_hard[plan.batch_index, plan.source])


def test_block_causal_mask_dense():
    """segment = [0, 0, 0, 1, 1, 1], valid = [1, 1, 1, 1, 1, 0] -> row_valid = [1, 1, 0, 1, 0, 0].

    Valid queries see valid earlier keys of their own segment only; invalid queries (2, 4, 5)
    see only themselves, so no mask row is all False and attention never produces NaN.
    """
    valid = bool_t([[1, 1, 1, 1, 1, 0]])
    segment = long_t([[0, 0, 0, 1, 1, 1]])
    row_valid, _, _ = dense_row_masks(valid, segment, valid.clone())
    assert row_valid.tolist() == [[True, True, False, True, False, False]]
    mask = block_causal_mask(segment, row_valid)
    expected = bool_t(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ]
    )[None]
    assert torch.equal(mask, expected)

    scores = torch.randn(1, 6, 6).masked_fill(~mask, float("-inf"))
    assert torch.isfinite(torch.softmax(scores, dim=-1)).all()


def test_dense_gather_replaces_invalid_rows():
    """Dense gather on the oracle row with NaN / huge ids in slot 5.

    Valid rows 0..3 hold (f_t, x_{t+1}, f_{t+1}); rows 4, 5 are replaced by the fill values,
    so the output is finite even though slot 5 is poisoned.
    """
    tokens = long_t([[11, 12, 13, 14, 15, HUGE_TOKEN]])
    valid = bool_t([[1, 1, 1, 1, 1, 0]])
    segment = torch.zeros(1, 6, dtype=torch.int64)
    row_valid, _, _ = dense_row_masks(valid, segment, valid.clone())
    features = features_for(1, 6)
    features[..., 5, :] = float("nan")
    source_feature, advanced_token, target_feature = dense_gather_rows(features, tokens, row_valid)
    assert torch.isfinite(source_feature).all() and torch.isfinite(target_feature).all()
    assert advanced_token.tolist() == [[12, 13, 14, 15, INVALID_ROW_TOKEN, INVALID_ROW_TOKEN]]
    assert source_feature[0, :, 0].tolist() == [0.0, 1.0, 2.0, 3.0] + [INVALID_ROW_FEATURE] * 2
    assert target_feature[0, :, 0].tolist() == [1.0, 2.0, 3.0, 4.0] + [INVALID_ROW_FEATURE] * 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.booleans()), min_size=1, max_size=9))
def test_plan_matches_brute_force(slots):
    """Random (segment, valid, supervise) rows: the plan equals an explicit per-t enumeration."""
    segment = long_t([[s for s, _, _ in slots]])
    valid = bool_t([[v for _, v, _ in slots]])
    supervise = bool_t([[sup for _, _, sup in slots]])
    seq = len(slots)
    plan = compile_soft_rows(valid, segment, supervise, positions_for(segment))

    def ok(t: int) -> bool:  # legal pair (t, t+1)
        return t + 1 < seq and slots[t][1] and slots[t + 1][1] and slots[t][0] == slots[t + 1][0]

    expected = [t for t in range(seq) if ok(t)]
    assert plan.source.tolist() == expected
    assert plan.supervise.tolist() == [slots[t][2] for t in expected]
    assert plan.supervise_hard.tolist() == [slots[t][2] and ok(t + 1) for t in expected]
    mask = row_attention_mask(plan)
    for i, ti in enumerate(expected):
        for j, tj in enumerate(expected):
            assert bool(mask[i, j]) == (tj <= ti and slots[ti][0] == slots[tj][0])


# --------------------------------------------------------------------------------------------
# boundary errors
# --------------------------------------------------------------------------------------------


def test_invalid_inputs_name_the_field():
    ok_b = torch.ones(1, 4, dtype=torch.bool)
    ok_i = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="token_valid"):
        compile_soft_rows(ok_i, ok_i, ok_b, ok_i)  # wrong dtype
    with pytest.raises(ValueError, match="segment_id"):
        compile_soft_rows(ok_b, torch.zeros(1, 5, dtype=torch.int64), ok_b, ok_i)  # wrong shape
    with pytest.raises(ValueError, match="supervise"):
        compile_soft_rows(ok_b, ok_i, ok_b[0], ok_i)  # wrong ndim
    with pytest.raises(ValueError, match="position_id"):
        compile_soft_rows(ok_b, ok_i, ok_b, ok_i.float())

    plan = compile_soft_rows(ok_b, ok_i, ok_b, ok_i)
    with pytest.raises(ValueError, match="features"):
        gather_rows(plan, torch.zeros(1, 5, 2), torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="plan.source"):
        gather_rows(plan, torch.zeros(1, 3, 2), torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="supervise_hard"):
        RowPlan(
            batch_index=ok_i[0],
            source=ok_i[0],
            segment_id=ok_i[0],
            position_id=ok_i[0],
            supervise=ok_b[0],
            supervise_hard=ok_b[0, :2],
        )
