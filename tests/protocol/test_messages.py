"""Protocol dataclasses: seeds that concatenate across plain rounds."""

from __future__ import annotations

import pytest
import torch

from eyas.protocol.messages import Seed


def test_seeds_concatenate_in_order():
    """Worked example: rows [5, 7) of round 3 then row [7, 8) of round 4 -> rows [5, 8) of round 4, its
    features in order and the later seed's frontier token."""
    a = Seed(torch.arange(4.0).reshape(2, 2), torch.tensor([11, 12]), start_position=5, round=3)
    b = Seed(torch.tensor([[9.0, 9.0]]), torch.tensor([13]), start_position=7, round=4)
    ab = a.then(b)
    assert (ab.start_position, ab.end_position, ab.round, ab.frontier_token) == (5, 8, 4, 13)
    assert ab.features.tolist() == [[0.0, 1.0], [2.0, 3.0], [9.0, 9.0]]
    assert ab.advanced_tokens.tolist() == [11, 12, 13]


def test_a_gap_or_an_old_round_is_refused():
    a = Seed(torch.zeros(2, 2), torch.tensor([1, 2]), start_position=5, round=3)
    with pytest.raises(ValueError, match="^seed.start_position: 8 != 7"):
        a.then(Seed(torch.zeros(1, 2), torch.tensor([3]), start_position=8, round=4))
    with pytest.raises(ValueError, match="^seed.round: 3 is not after 3"):
        a.then(Seed(torch.zeros(1, 2), torch.tensor([3]), start_position=7, round=3))


def test_join_equals_chained_then():
    a = Seed(torch.zeros(2, 2), torch.tensor([1, 2]), start_position=5, round=3)
    b = Seed(torch.ones(1, 2), torch.tensor([3]), start_position=7, round=4)
    c = Seed(torch.full((2, 2), 2.0), torch.tensor([4, 5]), start_position=8, round=6)
    j, t = Seed.join([a, b, c]), a.then(b).then(c)
    assert torch.equal(j.features, t.features) and torch.equal(j.advanced_tokens, t.advanced_tokens)
    assert (j.start_position, j.round) == (t.start_position, t.round) == (5, 6) and Seed.join([a]) is a
    with pytest.raises(ValueError, match="^seed.start_position: "):
        Seed.join([a, c])
