"""The expert-traffic part of the cost model (design 0x09A): worked examples, an exact expectation, calibration."""

from __future__ import annotations

import itertools

import pytest

from eyas.scheduler.cost import ExpertTraffic

MB = 1 << 20


def test_expert_traffic_worked_example():
    """E = 8 experts, top-2, 2 MoE layers, 1 MB an expert: one row reads 2 experts a layer (4 MB); two
    rows 8 * (1 - 0.75**2) = 3.5 a layer (7 MB); 64 rows all 8 experts of both layers (16 MB, the cap)."""
    x = ExpertTraffic(moe_layers=2, num_experts=8, experts_per_token=2, bytes_per_expert=MB)
    assert x.is_moe and x.all_bytes == 16 * MB
    assert x.predict(1) == 4 * MB
    assert x.predict(2) == 7 * MB
    assert x.predict(64) == 16 * MB
    assert x.predict(0) == 0
    assert [x.predict(r) for r in range(1, 40)] == sorted(x.predict(r) for r in range(1, 40))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_union_size_is_the_exact_expectation_under_uniform_top_k_routing(rows):
    """Brute force over every assignment of a 2-subset of 6 experts to each row: the mean union size."""
    x = ExpertTraffic(moe_layers=1, num_experts=6, experts_per_token=2, bytes_per_expert=1)
    subsets = list(itertools.combinations(range(6), 2))
    sizes = [len(set().union(*choice)) for choice in itertools.product(subsets, repeat=rows)]
    assert x.union_size(rows) == pytest.approx(sum(sizes) / len(sizes), rel=1e-12)


def test_skewed_routing_calibrates_the_prediction_down_but_never_below_one_rows_experts():
    """Real routing piles onto popular experts: 8 rows that keep touching 3 of 8 experts a layer pull
    the prediction for 8 rows from 8 * (1 - 0.75**8) = 7.2 toward 3 experts a layer; one row still reads 2."""
    x = ExpertTraffic(moe_layers=2, num_experts=8, experts_per_token=2, bytes_per_expert=MB)
    before = x.predict(8)
    assert before == round(2 * 8 * (1 - 0.75**8) * MB)
    for _ in range(40):
        x.observe(8, 2 * 3 * MB)
    assert x.observations == 40
    assert x.predict(8) == pytest.approx(6 * MB, rel=0.01)
    assert x.predict(1) == 4 * MB  # a row always reads its own top-k
    assert x.to_dict()["skew"] == pytest.approx(3 / (8 * (1 - 0.75**8)), rel=0.01)


def test_a_dense_target_predicts_no_expert_bytes_and_ignores_observations():
    x = ExpertTraffic()
    x.observe(16, 123)
    assert not x.is_moe and x.predict(16) == 0 and x.observations == 0


def test_bad_expert_counts_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="^experts.num_experts: "):
        ExpertTraffic(moe_layers=1, num_experts=-1)
    with pytest.raises(ValueError, match="^experts.experts_per_token: 4 > num_experts 2"):
        ExpertTraffic(moe_layers=1, num_experts=2, experts_per_token=4, bytes_per_expert=1)
