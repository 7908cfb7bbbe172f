"""The runtime's tree defaults (eyas/runtime.py)."""

from __future__ import annotations

import pytest

from eyas.drafting.engine import TreeSpec
from eyas.protocol.schema import parse_request
from eyas.runtime import FP16W_DEFAULT_TREE, smaller_tree, tree_for


def test_smaller_tree_caps_each_knob_and_keeps_the_kind():
    """Worked example: the manifest's 4/5/16 capped by the fp16w default is 3/4/6 with its value
    floors; a chain of depth 1 stays a chain of depth 1 (only knobs above the cap move; a chain has
    no use for the floors, which only a dynamic tree reads)."""
    assert smaller_tree(TreeSpec(), FP16W_DEFAULT_TREE) == TreeSpec(
        "dynamic", 3, 4, 6, min_value=0.06, expand_min_value=0.35
    )
    chain = TreeSpec("chain", expand_width=1, max_depth=1, verify_budget=16)
    assert smaller_tree(chain, FP16W_DEFAULT_TREE) == TreeSpec("chain", 1, 1, 6, min_value=0.06, expand_min_value=0.35)
    assert smaller_tree(TreeSpec("dynamic", 3, 1, 2), TreeSpec("dynamic", 2, 5, 16)) == TreeSpec("dynamic", 2, 1, 2)


def test_smaller_tree_keeps_the_higher_value_floor():
    tree = TreeSpec("dynamic", 2, 2, 4, min_value=0.2, expand_min_value=0.0)
    cap = TreeSpec("dynamic", 4, 5, 16, min_value=0.05, expand_min_value=0.3)
    assert smaller_tree(tree, cap) == TreeSpec("dynamic", 2, 2, 4, min_value=0.2, expand_min_value=0.3)


def test_a_request_s_own_floors_win_and_unset_ones_take_the_drafter_s():
    base = TreeSpec("dynamic", 3, 4, 6, min_value=0.06, expand_min_value=0.35)
    assert tree_for(parse_request(prompt="hi"), base) == base
    assert tree_for(parse_request(prompt="hi", tree_min_value=0, tree_width=2), base) == TreeSpec(
        "dynamic", 2, 4, 6, min_value=0.0, expand_min_value=0.35
    )
    assert tree_for(parse_request(prompt="hi", tree_expand_min_value=1), base).expand_min_value == 1.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(min_value=-1.0), "min_value"),
        (dict(expand_min_value=1.01), "expand_min_value"),
        (dict(min_value=None), "min_value"),
    ],
)
def test_tree_spec_refuses_a_floor_outside_zero_one(kwargs, field):
    with pytest.raises(ValueError, match=f"^tree.{field}: "):
        TreeSpec(**kwargs)
