"""The runtime's tree defaults (eyas/runtime.py)."""

from __future__ import annotations

from eyas.drafting.engine import TreeSpec
from eyas.runtime import FP16W_DEFAULT_TREE, smaller_tree


def test_smaller_tree_caps_each_knob_and_keeps_the_kind():
    """Worked example: the manifest's 4/5/16 capped by 2/2/4 is 2/2/4; a chain of depth 1 stays a
    chain of depth 1 (only knobs above the cap move)."""
    assert smaller_tree(TreeSpec(), FP16W_DEFAULT_TREE) == TreeSpec("dynamic", 2, 2, 4)
    chain = TreeSpec("chain", expand_width=1, max_depth=1, verify_budget=16)
    assert smaller_tree(chain, FP16W_DEFAULT_TREE) == TreeSpec("chain", 1, 1, 4)
    assert smaller_tree(TreeSpec("dynamic", 3, 1, 2), TreeSpec("dynamic", 2, 5, 16)) == TreeSpec("dynamic", 2, 1, 2)
