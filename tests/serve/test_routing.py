"""Routing by prefix (eyas.serve.routing): what Ray Serve LLM's router is handed, and which router
the target deployment gets. The router itself runs against two real replicas in
tests/e2e/test_serve.py."""

from __future__ import annotations

import pytest

from eyas.serve.app import _deployment_options
from eyas.serve.config import parse_config
from eyas.serve.routing import POWER_OF_TWO, TOKEN_CHAR_BASE, PrefixRouter, _prompt_ids, token_text


def test_token_text_is_one_character_per_token_so_a_common_prefix_is_a_common_token_prefix():
    a, b = [1, 2, 3, 49151, 7], [1, 2, 3, 49151, 8, 9]
    ta, tb = token_text(a), token_text(b)
    assert len(ta) == len(a) and [ord(ch) - TOKEN_CHAR_BASE for ch in ta] == a
    common = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
    assert common == 4 and ta.encode("utf-8")  # valid text: no surrogate code points
    assert token_text([0x0]) != token_text([0x1]) and token_text([]) == ""


def test_the_router_reads_generates_prompt_ids_and_nothing_else():
    request = {"prompt": "ignored: the ids are what the target computes", "method": "target"}
    assert _prompt_ids((request, [5, 6, 7], 123.0)) == [5, 6, 7]
    assert _prompt_ids((request,)) is None  # one argument: not generate
    assert _prompt_ids(()) is None and _prompt_ids(None) is None
    assert _prompt_ids((request, "text")) is None and _prompt_ids((request, [])) is None

    class Pending:
        args = (request, [5, 6, 7], 1.0)

    assert PrefixRouter._extract_text_from_request(object.__new__(PrefixRouter), Pending()) == token_text([5, 6, 7])


@pytest.mark.parametrize(
    ("config", "router"),
    [
        ({"target_replicas": 2}, "eyas.serve.routing:PrefixRouter"),  # the default
        ({"target_replicas": 2, "target_router": "power-of-two"}, POWER_OF_TWO),
        ({"target_replicas": 1}, POWER_OF_TWO),  # one replica: nothing to choose, no prefix tree
        ({"target_autoscaling": {"min_replicas": 1, "max_replicas": 3}}, "eyas.serve.routing:PrefixRouter"),
    ],
)
def test_the_target_deployment_gets_the_configured_router(config, router):
    options = _deployment_options(parse_config(config), "target")
    assert options["request_router_config"]["request_router_class"] == router
    if router.endswith("PrefixRouter"):
        assert options["request_router_config"]["request_router_kwargs"] == {"imbalanced_threshold": 2.0}
    assert "request_router_config" not in _deployment_options(parse_config(config), "drafter")


@pytest.mark.parametrize(
    ("bad", "field"),
    [({"target_router": "round-robin"}, "target_router"), ({"prefix_router_imbalance": -1}, "prefix_router_imbalance")],
)
def test_bad_router_knobs_are_refused_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=rf"^config\.{field}:"):
        parse_config(bad)
