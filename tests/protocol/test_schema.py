"""Request validation at the edge: strict types, every bound, the field named (design 0x05D)."""

from __future__ import annotations

import pytest

from eyas.protocol import wire
from eyas.protocol.schema import INT32_MAX, MAX_TREE_BUDGET, MAX_TREE_DEPTH, MAX_TREE_WIDTH, parse_request


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"max_new_tokens": True}, "max_new_tokens"),  # strict: a bool is not an int
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"raw": "yes"}, "raw"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stop": "\n"}, "stop"),
        ({"max_new_tokens": 3_000_000_000}, "max_new_tokens"),  # past the wire's int32
        ({"top_k": INT32_MAX + 1}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": 1e-300}, "temperature"),
        ({"temperature": 1e-45}, "temperature"),
        ({"tree_depth": MAX_TREE_DEPTH + 1}, "tree_depth"),
        ({"tree_width": MAX_TREE_WIDTH + 1}, "tree_width"),
        ({"tree_budget": MAX_TREE_BUDGET + 1}, "tree_budget"),
        ({"tree_budget": -1}, "tree_budget"),
        ({"tree_min_value": -0.01}, "tree_min_value"),
        ({"tree_min_value": 1.5}, "tree_min_value"),
        ({"tree_min_value": float("nan")}, "tree_min_value"),
        ({"tree_min_value": "0.1"}, "tree_min_value"),
        ({"tree_expand_min_value": float("inf")}, "tree_expand_min_value"),
        ({"tree_expand_min_value": True}, "tree_expand_min_value"),
        ({"prompt_ids": [1, 2]}, "prompt_ids"),  # beside prompt: which one was meant?
    ],
)
def test_bad_fields_are_refused_by_name(fields, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        parse_request(**{"prompt": "hi", **fields})


def test_the_bounds_themselves_pass_and_fit_the_wire():
    """Every value the schema accepts also fits its proto field (no 'Value out of range' later)."""
    req = parse_request(
        prompt_ids=[INT32_MAX],
        max_new_tokens=INT32_MAX,
        top_k=INT32_MAX,
        seed=2**63 - 1,
        temperature=0.01,
        top_p=1e-300,
        tree_depth=MAX_TREE_DEPTH,
        tree_width=MAX_TREE_WIDTH,
        tree_budget=MAX_TREE_BUDGET,
        tree_min_value=1.0,
        tree_expand_min_value=0.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        min_p=1.0,
        logit_bias={0: -100.0, INT32_MAX: 100.0},
    )
    assert wire.generate_request_from_proto(wire.generate_request_to_proto(req)) == req
    assert parse_request(prompt="hi", temperature=1).temperature == 1.0  # an int is a float


CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Name a planet."},
]


def test_a_message_list_is_a_request_and_crosses_the_wire():
    req = parse_request(messages=CONVERSATION, max_new_tokens=4)
    assert [m.role for m in req.messages] == ["system", "user", "assistant", "user"]
    assert wire.generate_request_from_proto(wire.generate_request_to_proto(req)) == req


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"messages": CONVERSATION, "prompt": "hi"}, "messages"),
        ({"messages": CONVERSATION, "prompt_ids": [1]}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": CONVERSATION[:3]}, "messages.2.role"),  # the last turn is the assistant's
        ({"messages": [{"role": "user", "content": "  "}]}, "messages.0.content"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages.0.name"),
        ({"messages": [{"role": "user", "content": "x"}], "raw": True}, "raw"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_a_bad_message_list_is_refused_naming_the_field(fields, field):
    with pytest.raises(ValueError, match=rf"^{field.replace('.', '[.]')}: "):
        parse_request(**fields)


def test_messages_are_templated_by_the_tokenizers_own_chat_template():
    """One user turn gives what ``prompt`` gives; a system turn changes the ids (SmolLM2's template
    otherwise inserts its default system prompt)."""
    from eyas.target.loader import load_tokenizer, request_prompt_ids

    tok = load_tokenizer()
    by_prompt, _ = request_prompt_ids(tok, parse_request(prompt="Name a planet."), len(tok))
    by_turn, field = request_prompt_ids(tok, parse_request(messages=[CONVERSATION[-1]]), len(tok))
    assert by_turn == by_prompt and field == "messages"
    ids, _ = request_prompt_ids(tok, parse_request(messages=CONVERSATION), len(tok))
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
