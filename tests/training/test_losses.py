"""Draft training losses, noise, draft vocabulary, metrics (design 0x04, 0x07A, 0x08C, 0x09)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from eyas.drafting.vocab import build_draft_vocab, carry_rows, rebuilt_head, trim_draft_vocab
from eyas.training.losses import (
    draft_vocab_targets,
    eagle1_loss,
    feature_noise,
    masked_smooth_l1,
    soft_cross_entropy,
    target_argmax_in_draft_vocab,
    topk_accuracy,
    topk_distillation,
    ttt_loss,
)


def bool_t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------
# EAGLE-1 (design 0x04A-0x04B)
# --------------------------------------------------------------------------------------------


def test_loss_fixture():
    """Seed 0x09 loss fixture: L_reg = 0.6, L_cls = 2.4 -> L = 0.6 + 0.1 * 2.4 = 0.84."""
    loss = eagle1_loss(torch.tensor(0.6), torch.tensor(2.4))
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(0.84, abs=1e-6)
    assert float(eagle1_loss(0.6, 2.4)) == pytest.approx(0.84, abs=1e-6)


def test_smooth_l1_worked_example():
    """beta = 1, residuals r = pred - target, d = 2, mask = [1, 1, 0]:

    row 0: r = [0.5, -2.0] -> [0.5^2 / 2, 2.0 - 0.5] = [0.125, 1.5]  -> mean 0.8125
    row 1: r = [1.0,  0.0] -> [1.0 - 0.5, 0]  (|r| = beta is linear) -> mean 0.25
    row 2: unsupervised; holds NaN, which must not reach the loss
    L_reg = (0.8125 + 0.25) / 2 = 0.53125
    """
    target = torch.zeros(3, 2)
    pred = torch.tensor([[0.5, -2.0], [1.0, 0.0], [float("nan"), 0.0]])
    loss = masked_smooth_l1(pred, target, bool_t([1, 1, 0]))
    assert loss.dtype == torch.float32
    assert float(loss) == pytest.approx(0.53125, abs=1e-7)


def test_smooth_l1_matches_piecewise_formula_with_beta():
    """Random residuals spanning both branches, beta = 0.3, against the design 0x04A formula."""
    gen = seeded(0)
    pred = torch.randn(5, 4, generator=gen)
    target = torch.randn(5, 4, generator=gen)
    mask = bool_t([1, 0, 1, 1, 0])
    beta = 0.3
    r = (pred - target).double()
    elem = torch.where(r.abs() < beta, r**2 / (2 * beta), r.abs() - beta / 2)
    expected = elem.mean(dim=1)[mask].mean()
    assert float(masked_smooth_l1(pred, target, mask, beta=beta)) == pytest.approx(float(expected), rel=1e-6)


def test_soft_cross_entropy_is_entropy_plus_kl():
    """L_cls = H(q) + KL(q || p) over the masked rows (design 0x04B)."""
    gen = seeded(1)
    logits = torch.randn(4, 7, generator=gen)
    q = torch.softmax(torch.randn(4, 7, generator=gen), dim=-1)
    mask = bool_t([1, 1, 0, 1])
    loss = soft_cross_entropy(logits, q, mask)

    log_p = torch.log_softmax(logits.double(), dim=-1)
    qd = q.double()
    entropy = -(qd * qd.log()).sum(-1)
    kl = (qd * (qd.log() - log_p)).sum(-1)
    assert float(loss) == pytest.approx(float((entropy + kl)[mask].mean()), rel=1e-6)
    one_hot = F.one_hot(q.argmax(-1), 7).float()
    assert float(soft_cross_entropy(logits, one_hot, mask)) != pytest.approx(float(loss))


def test_losses_are_fp32_from_bf16_inputs():
    """BF16 inputs: every loss is an fp32 scalar and agrees with the fp32 computation on the
    same (bf16-rounded) values."""
    gen = seeded(2)
    pred = torch.randn(3, 8, generator=gen).bfloat16()
    target = torch.randn(3, 8, generator=gen).bfloat16()
    logits = (5 * torch.randn(3, 11, generator=gen)).bfloat16()
    q = torch.softmax(torch.randn(3, 11, generator=gen), dim=-1).bfloat16()
    mask = bool_t([1, 0, 1])
    for fn, args in (
        (masked_smooth_l1, (pred, target, mask)),
        (soft_cross_entropy, (logits, q, mask)),
        (lambda a, b, m: topk_distillation(a, b, m, k=3), (logits, q, mask)),
    ):
        out = fn(*args)
        assert out.dtype == torch.float32 and out.ndim == 0
        ref = fn(*(a.float() if a.is_floating_point() else a for a in args))
        assert float(out) == float(ref)
    assert ttt_loss([torch.tensor(1.0, dtype=torch.bfloat16)]).dtype == torch.float32
    assert draft_vocab_targets(logits, torch.tensor([0, 3, 5])).dtype == torch.float32


def test_gradient_flows_only_through_supervised_rows():
    """Masked-out rows get exactly zero gradient (they are selected away, not multiplied)."""
    logits = torch.randn(3, 5, requires_grad=True)
    q = torch.softmax(torch.randn(3, 5), dim=-1)
    soft_cross_entropy(logits, q, bool_t([1, 0, 1])).backward()
    assert logits.grad is not None
    assert torch.count_nonzero(logits.grad[1]) == 0 and torch.count_nonzero(logits.grad[0]) > 0


@pytest.mark.parametrize(
    "fn",
    [
        lambda m: masked_smooth_l1(torch.zeros(2, 3), torch.zeros(2, 3), m),
        lambda m: soft_cross_entropy(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), m),
        lambda m: topk_distillation(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), m, k=2),
        lambda m: topk_accuracy(torch.zeros(2, 3), torch.full((2, 3), 1 / 3), m),
    ],
)
def test_empty_mask_raises_naming_mask(fn):
    """sum m = 0: the normalised loss is undefined -> ValueError naming `mask`."""
    with pytest.raises(ValueError, match="mask"):
        fn(bool_t([0, 0]))


def test_invalid_inputs_name_the_field():
    with pytest.raises(ValueError, match="target"):
        masked_smooth_l1(torch.zeros(2, 3), torch.zeros(2, 4), bool_t([1, 1]))
    with pytest.raises(ValueError, match="mask"):
        masked_smooth_l1(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2))  # not bool
    with pytest.raises(ValueError, match="beta"):
        masked_smooth_l1(torch.zeros(2, 3), torch.zeros(2, 3), bool_t([1, 1]), beta=0.0)
    with pytest.raises(ValueError, match="draft_logits"):
        soft_cross_entropy(torch.zeros(2, 3, 1), torch.zeros(2, 3), bool_t([1, 1]))
    with pytest.raises(ValueError, match="k"):
        topk_distillation(torch.zeros(2, 3), torch.zeros(2, 3), bool_t([1, 1]), k=4)
    with pytest.raises(ValueError, match="step_losses"):
        ttt_loss([])
    with pytest.raises(ValueError, match="d2t"):
        draft_vocab_targets(torch.zeros(2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="size"):
        build_draft_vocab(torch.tensor([1, 2, 3]), 4)


# --------------------------------------------------------------------------------------------
# HASS top-K (design 0x07A)
# --------------------------------------------------------------------------------------------


def test_topk_distillation_is_not_renormalised():
    """One row, V = 4, K = 2, uniform draft p = 1/4 everywhere:

    q = [0.5, 0.3, 0.15, 0.05] -> top-2 = {0, 1}, Z_K = 0.8
    L_topK     = -(0.5 + 0.3) log(1/4) = 0.8 log 4
    renormalised: -(0.625 + 0.375) log(1/4) = log 4
    L_topK = Z_K * renormalised, and the two differ.
    """
    q = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = torch.zeros(1, 4)
    mask = bool_t([1])
    loss = float(topk_distillation(logits, q, mask, k=2))
    assert loss == pytest.approx(0.8 * math.log(4), rel=1e-6)
    renormalised = -(torch.tensor([0.625, 0.375]) * torch.log_softmax(logits, -1)[0, :2]).sum()
    assert loss == pytest.approx(0.8 * float(renormalised), rel=1e-6)
    assert loss != pytest.approx(float(renormalised))


def test_topk_distillation_general_and_full_k():
    """Random rows: L_topK = Z_K * renormalised per row; with K = V it is the soft CE."""
    gen = seeded(3)
    logits = torch.randn(5, 9, generator=gen)
    q = torch.softmax(2 * torch.randn(5, 9, generator=gen), dim=-1)
    mask = bool_t([1, 1, 0, 1, 1])
    k = 3
    q_top, ids = q.topk(k, dim=-1)
    z = q_top.sum(-1)
    log_p = torch.log_softmax(logits, -1).gather(-1, ids)
    renorm = -((q_top / z[:, None]) * log_p).sum(-1)
    expected = (z * renorm)[mask].mean()
    assert float(topk_distillation(logits, q, mask, k)) == pytest.approx(float(expected), rel=1e-5)
    assert float(topk_distillation(logits, q, mask, 9)) == pytest.approx(
        float(soft_cross_entropy(logits, q, mask)), rel=1e-5
    )


# --------------------------------------------------------------------------------------------
# EAGLE-3 (design 0x08C)
# --------------------------------------------------------------------------------------------


def test_ttt_loss_weights():
    """Step losses [1.0, 2.0, 4.0] with decay 0.8: 1.0 + 0.8 * 2.0 + 0.64 * 4.0 = 5.16."""
    out = ttt_loss([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(4.0)])
    assert out.dtype == torch.float32
    assert float(out) == pytest.approx(5.16, rel=1e-6)
    seven = ttt_loss([torch.tensor(1.0)] * 7)
    assert float(seven) == pytest.approx(sum(0.8**s for s in range(7)), rel=1e-6)
    assert float(ttt_loss([torch.tensor(1.0), torch.tensor(1.0)], decay=0.5)) == pytest.approx(1.5)


def test_ttt_loss_keeps_gradients():
    a = torch.tensor(1.0, requires_grad=True)
    b = torch.tensor(1.0, requires_grad=True)
    ttt_loss([a, b]).backward()
    assert float(a.grad) == 1.0 and float(b.grad) == pytest.approx(0.8)


def test_build_draft_vocab_with_ties():
    """counts over V = 8 ids: [5, 0, 7, 5, 1, 5, 0, 9], size 4.

    By count: id 7 (9), id 2 (7), then ids 0, 3, 5 tie at 5 -> lower ids 0, 3 win.
    d2t = sorted([7, 2, 0, 3]) = [0, 2, 3, 7].
    size 7 exhausts the nonzero ids (0, 2, 3, 4, 5, 7) and adds the lowest zero-count id 1.
    """
    counts = torch.tensor([5, 0, 7, 5, 1, 5, 0, 9])
    d2t = build_draft_vocab(counts, 4)
    assert d2t.dtype == torch.int64
    assert d2t.tolist() == [0, 2, 3, 7]
    assert build_draft_vocab(counts, 7).tolist() == [0, 1, 2, 3, 4, 5, 7]
    assert build_draft_vocab(counts, 8).tolist() == list(range(8))


def test_trim_draft_vocab_keeps_the_most_frequent_of_its_own_tokens():
    """d2t [9, 7, 5, 2, 0] (unsorted: the tied 7 before 2), counts 2:3, 5:8, 7:3, 9:1, 0:0 and 11:100 (not in d2t).

    size 3: id 5 (8), then 2 and 7 (3 each) -> [2, 5, 7]; size 2: 5, then the 2-7 tie goes to the
    lower id 2 -> [2, 5]; id 11 never enters, however frequent (its row was never trained)."""
    d2t = torch.tensor([9, 7, 5, 2, 0])
    counts = torch.zeros(12, dtype=torch.int64)
    counts[torch.tensor([2, 5, 7, 9, 11])] = torch.tensor([3, 8, 3, 1, 100])
    assert trim_draft_vocab(d2t, counts, 3).tolist() == [2, 5, 7]
    assert trim_draft_vocab(d2t, counts, 2).tolist() == [2, 5]
    assert trim_draft_vocab(d2t, counts, 5).tolist() == [0, 2, 5, 7, 9]
    for size in (0, 6, True):
        with pytest.raises(ValueError, match="^size: must be an int in \\[1, Vd=5\\]"):
            trim_draft_vocab(d2t, counts, size)
    with pytest.raises(ValueError, match="^d2t: draft ids must map to distinct"):
        trim_draft_vocab(torch.tensor([2, 2, 5]), counts, 2)
    with pytest.raises(ValueError, match="^token_counts: expected dtype torch.int64"):
        trim_draft_vocab(d2t, counts.float(), 2)


def test_carry_rows_keeps_shared_tokens_and_fills_the_rest():
    """old vocabulary [1, 4, 6] (rows 10, 40, 60), new [0, 4, 6, 7]: tokens 4 and 6 keep rows 40 and
    60 at their new draft ids 1 and 2; tokens 0 and 7 take the fill's rows 0 and 3."""
    old = torch.tensor([[10.0], [40.0], [60.0]])
    fill = torch.tensor([[-1.0], [-2.0], [-3.0], [-4.0]])
    out = carry_rows(torch.tensor([1, 4, 6]), old, torch.tensor([0, 4, 6, 7]), fill)
    assert out.tolist() == [[-1.0], [40.0], [60.0], [-4.0]]
    with pytest.raises(ValueError, match="^fill: expected"):
        carry_rows(torch.tensor([1, 4, 6]), old, torch.tensor([0, 4]), fill)


def test_rebuilt_head_maps_new_tokens_through_the_kept_rows_fit():
    """When the drafter's head is an exact linear map of the target's rows (H = T W), a token new to
    the vocabulary starts at exactly its target row times W; the kept rows are unchanged."""
    g = torch.Generator().manual_seed(0)
    V, d = 64, 8
    target = torch.randn(V, d, generator=g)
    w = torch.randn(d, d, generator=g)
    old_d2t = torch.arange(0, 40)
    old_head = target[old_d2t] @ w + 0.0
    old_head[3] += 5.0  # a trained row off the map stays as it was (the fit is least squares)
    new_d2t = torch.arange(2, 60)
    head = rebuilt_head(old_d2t, old_head, new_d2t, target)
    assert head.shape == (58, d)
    torch.testing.assert_close(head[:38], old_head[2:40])
    fit = torch.linalg.lstsq(target[2:40], old_head[2:40]).solution
    torch.testing.assert_close(head[38:], target[40:60] @ fit)
    torch.testing.assert_close(fit, w, atol=0.5, rtol=0)  # one outlier row barely moves the map


def test_draft_vocab_targets_renormalise_over_draft_vocab():
    """target logits log([0.1, 0.2, 0.3, 0.4]), d2t = [1, 3]:

    restricted mass [0.2, 0.4] renormalised -> [1/3, 2/3] (the pinned contract).
    Row 2 has its full-vocab argmax (id 0) outside the draft vocab -> pinned mask drops it.
    """
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]))
    d2t = torch.tensor([1, 3])
    q = draft_vocab_targets(logits, d2t)
    assert q.shape == (2, 2)
    assert q[0].tolist() == pytest.approx([1 / 3, 2 / 3], rel=1e-6)
    assert torch.allclose(q.sum(-1), torch.ones(2))
    assert target_argmax_in_draft_vocab(logits, d2t).tolist() == [True, False]


# --------------------------------------------------------------------------------------------
# noise (design 0x04E)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [64, 512, 2048])
def test_noise_bounds(seq):
    """paper: |eps| <= 0.1 at every S; pinned: |eps| <= 0.1 * 512 / S (so 0.8 at S = 64)."""
    features = torch.zeros(2, seq, 16)
    paper = feature_noise(features, "paper", seeded(4))
    pinned = feature_noise(features, "pinned", seeded(4))
    assert paper.shape == features.shape and pinned.shape == features.shape
    assert paper.abs().max() <= 0.1
    bound = 0.1 * 512 / seq
    assert pinned.abs().max() <= bound + 1e-7
    assert pinned.abs().max() > 0.9 * bound  # it really uses the rescaled width
    if seq == 512:  # same draws, same interval at the reference length
        assert torch.allclose(paper, pinned)


def test_noise_none_dtype_and_unknown_kind():
    features = torch.randn(1, 4, 8).bfloat16()
    assert torch.equal(feature_noise(features, "none", seeded(5)), torch.zeros_like(features))
    assert feature_noise(features, "paper", seeded(5)).dtype == torch.bfloat16
    a = feature_noise(torch.zeros(1, 4, 8), "paper", seeded(6))
    b = feature_noise(torch.zeros(1, 4, 8), "paper", seeded(6))
    assert torch.equal(a, b)  # reproducible from the generator
    with pytest.raises(ValueError, match="noise"):
        feature_noise(features, "gaussian", seeded(5))


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------


def test_topk_accuracy():
    """Target argmax per row: [2, 0, 1, 3]; draft ranking per row (best first):

    row 0: [2, 1, 0, 3] -> top-1 hit
    row 1: [3, 0, 1, 2] -> top-3 hit only
    row 2: [0, 2, 3, 1] -> miss for k <= 3
    row 3: masked out (would be a hit)
    top-1 = 1/3, top-3 = 2/3
    """
    q = F.one_hot(torch.tensor([2, 0, 1, 3]), 4).float()
    logits = torch.tensor(
        [
            [2.0, 3.0, 4.0, 1.0],
            [3.0, 2.0, 1.0, 4.0],
            [4.0, 1.0, 3.0, 2.0],
            [0.0, 0.0, 0.0, 9.0],
        ]
    )
    acc = topk_accuracy(logits, q, bool_t([1, 1, 1, 0]))
    assert acc == {1: pytest.approx(1 / 3), 3: pytest.approx(2 / 3)}


def test_row_soft_cross_entropy_equals_autograd_through_log_softmax_in_value_and_gradient():
    """The fused per-row soft CE (chunked, fp32 inside) gives each row's -sum q log p and the same
    gradient as autograd through log_softmax, also at bf16 logits and over several chunks."""
    import torch.nn.functional as F

    from eyas.training.losses import row_soft_cross_entropy

    g = torch.Generator().manual_seed(3)
    rows, vocab = 150, 97  # more rows than one chunk (64)
    z = torch.randn(rows, vocab, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.softmax(torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3, -1)
    w = torch.rand(rows, generator=g, dtype=torch.float64)
    ours = row_soft_cross_entropy(z, q)
    ref = -(q * F.log_softmax(z, -1)).sum(-1)
    assert ours.dtype == torch.float32 and ours.shape == (rows,)
    assert torch.allclose(ours.double(), ref, atol=1e-5)
    (ours.double() * w).sum().backward()
    ours_grad, z.grad = z.grad.clone(), None
    (ref * w).sum().backward()
    assert torch.allclose(ours_grad, z.grad, atol=1e-6)
    zb = z.detach().bfloat16().requires_grad_()
    row_soft_cross_entropy(zb, q).sum().backward()
    assert zb.grad.dtype == torch.bfloat16
    zf = zb.detach().double().requires_grad_()
    (-(q * F.log_softmax(zf, -1)).sum(-1)).sum().backward()
    assert torch.allclose(zb.grad.double(), zf.grad, atol=1e-2)
    with pytest.raises(ValueError, match="target_probs"):
        row_soft_cross_entropy(z, q[:, :5])
