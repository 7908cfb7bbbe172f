"""Request validation at the edge: strict types, every bound, the field named (seed 0x05D)."""
from __future__ import annotations

import pytest

from eyas.protocol import wire
from eyas.protocol.schema import INT32_MAX, MAX_TREE_BUDGET, MAX_TREE_DEPTH, MAX_TREE_WIDTH, parse_request


@pytest.mark.parametrize("fields, field", [
    ({"max_new_tokens": True}, "max_new_tokens"),          # strict: a bool is not an int
    ({"max_new_tokens": "8"}, "max_new_tokens"),
    ({"raw": "yes"}, "raw"),
    ({"temperature": "0.5"}, "temperature"),
    ({"stop": "\n"}, "stop"),
    ({"max_new_tokens": 3_000_000_000}, "max_new_tokens"),  # past the wire's int32
    ({"top_k": INT32_MAX + 1}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),
    ({"tree_depth": MAX_TREE_DEPTH + 1}, "tree_depth"),
    ({"tree_width": MAX_TREE_WIDTH + 1}, "tree_width"),
    ({"tree_budget": MAX_TREE_BUDGET + 1}, "tree_budget"),
    ({"tree_budget": -1}, "tree_budget"),
    ({"prompt_ids": [1, 2]}, "prompt_ids"),                 # beside prompt: which one was meant?
])
def test_bad_fields_are_refused_by_name(fields, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        parse_request(**{"prompt": "hi", **fields})


def test_the_bounds_themselves_pass_and_fit_the_wire():
    """Every value the schema accepts also fits its proto field (no 'Value out of range' later)."""
    req = parse_request(prompt_ids=[INT32_MAX], max_new_tokens=INT32_MAX, top_k=INT32_MAX, seed=2**63 - 1,
                        temperature=0.01, top_p=1e-300, tree_depth=MAX_TREE_DEPTH, tree_width=MAX_TREE_WIDTH,
                        tree_budget=MAX_TREE_BUDGET)
    assert wire.generate_request_from_proto(wire.generate_request_to_proto(req)) == req
    assert parse_request(prompt="hi", temperature=1).temperature == 1.0   # an int is a float
