"""The served target distribution: temperature, top-k, top-p; and sampling from it."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.protocol.sampling_params import SamplingParams
from eyas.verification.sampling import sample, target_probs


def log_probs(*probs: float) -> torch.Tensor:
    """Logits whose softmax is `probs` (one row)."""
    return torch.tensor([[math.log(p) for p in probs]])


def test_greedy_is_one_hot_argmax_first_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, top_k=1, top_p=0.5)
    assert params.greedy
    assert target_probs(logits, params).tolist() == [[0, 1, 0, 0], [1, 0, 0, 0]]


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    got = target_probs(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(got, torch.softmax(logits / 2.0, dim=1))
    assert not SamplingParams(temperature=2.0).greedy


def test_top_k_keeps_k_largest():
    """Logits [1, 3, 2, 0], k = 2: keep tokens 1 and 2 -> softmax([3, 2]) on them, 0 elsewhere."""
    got = target_probs(torch.tensor([[1.0, 3.0, 2.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))
    kept = torch.softmax(torch.tensor([3.0, 2.0]), dim=0)
    assert torch.allclose(got, torch.tensor([[0.0, kept[0], kept[1], 0.0]]))


def test_top_k_keeps_ties_with_kth_and_ignores_k_above_vocab():
    got = target_probs(torch.tensor([[1.0, 2.0, 2.0, 0.0]]), SamplingParams(temperature=1.0, top_k=1))
    assert torch.allclose(got, torch.tensor([[0.0, 0.5, 0.5, 0.0]]))
    logits = torch.tensor([[1.0, 2.0, 0.5]])
    got = target_probs(logits, SamplingParams(temperature=1.0, top_k=10))
    assert torch.allclose(got, torch.softmax(logits, dim=1))


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.79, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.5 < 0.79 <= 0.5 + 0.3: two tokens
        (0.81, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),  # needs the third token
        (0.1, [1.0, 0.0, 0.0, 0.0]),  # the argmax is always kept
        (1.0, [0.5, 0.3, 0.15, 0.05]),
    ],
)
def test_top_p_keeps_smallest_set_reaching_mass(top_p, expected):
    """Probabilities [0.5, 0.3, 0.15, 0.05]: keep the fewest most probable tokens, mass >= top_p."""
    got = target_probs(log_probs(0.5, 0.3, 0.15, 0.05), SamplingParams(temperature=1.0, top_p=top_p))
    assert got.tolist()[0] == pytest.approx(expected, abs=1e-6)


def test_top_p_handles_unsorted_vocabulary():
    got = target_probs(log_probs(0.15, 0.5, 0.05, 0.3), SamplingParams(temperature=1.0, top_p=0.79))
    assert got.tolist()[0] == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)


def test_top_k_applies_before_top_p():
    """[0.4, 0.3, 0.2, 0.1], k = 2 -> [4/7, 3/7]; top_p 0.5 then keeps only 4/7 >= 0.5.
    (top-p first would keep 0.4 + 0.3, and top-k 2 would keep both.)"""
    params = SamplingParams(temperature=1.0, top_k=2, top_p=0.5)
    got = target_probs(log_probs(0.4, 0.3, 0.2, 0.1), params)
    assert got.tolist()[0] == pytest.approx([1.0, 0.0, 0.0, 0.0], abs=1e-6)


def test_target_probs_is_fp32_and_normalised():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    got = target_probs(logits, SamplingParams(temperature=0.7, top_k=20, top_p=0.9))
    assert got.dtype == torch.float32 and got.shape == (3, 50)
    assert torch.allclose(got.sum(dim=1), torch.ones(3))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=True), "temperature"),
        (dict(temperature=1e-300), "temperature"),  # 0 in fp32: logits / T would be inf
        (dict(temperature=5e-324), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
    ],
)
def test_sampling_params_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_target_probs_rejects_bad_logits():
    with pytest.raises(ValueError, match="logits"):
        target_probs(torch.zeros(4), SamplingParams())
    with pytest.raises(ValueError, match="logits"):
        target_probs(torch.zeros(2, 4, dtype=torch.int64), SamplingParams())
    with pytest.raises(ValueError, match="NaN"):
        target_probs(torch.tensor([[0.0, float("nan")]]), SamplingParams())


def test_sample_shapes_and_determinism():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    first = sample(probs, torch.Generator().manual_seed(7))
    again = sample(probs, torch.Generator().manual_seed(7))
    assert first.shape == (2,) and first.dtype == torch.int64
    assert first.tolist() == again.tolist() and first[0].item() == 1
    one = sample(probs[0], torch.Generator().manual_seed(0))
    assert one.shape == () and one.item() == 1


@pytest.mark.parametrize(
    "probs",
    [
        torch.tensor([[0.0, 0.0]]),
        torch.tensor([[-0.1, 1.1]]),
        torch.tensor([[float("nan"), 1.0]]),
        torch.zeros(1, 1, 2),
    ],
)
def test_sample_rejects_bad_probs(probs):
    with pytest.raises(ValueError, match="probs"):
        sample(probs, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-9])
def test_a_tiny_top_p_keeps_the_argmax(top_p):
    """A top_p below fp32's range compares as 0 against the masses; the argmax is kept regardless
    (it was dropped with the rest, and the all-zero row failed in the sampler)."""
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9]])
    got = target_probs(logits, SamplingParams(temperature=0.7, top_p=top_p))
    assert torch.equal(got, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
