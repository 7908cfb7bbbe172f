"""Rendering training conversations with the tokenizer's own chat template (the real tokenizer)."""

from __future__ import annotations

import copy

import pytest

from eyas.training.data import assistant_spans, render

CONVERSATION = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue, like the sea."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Green."},
]
# Llama-3's chat template, in short: a header per turn, <|eot_id|> closing each
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from eyas.target.loader import load_tokenizer

    return load_tokenizer()


def _supervised_text(tokenizer, sample) -> str:
    return tokenizer.decode(sample.input_ids[sample.loss_mask].tolist())


def test_chatml_supervises_each_assistant_turn_and_its_end_token(tokenizer):
    text, spans = assistant_spans(tokenizer, CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["Blue, like the sea.<|im_end|>", "Green.<|im_end|>"]
    sample = render(tokenizer, "c", CONVERSATION, 512)
    assert _supervised_text(tokenizer, sample) == "Blue, like the sea.<|im_end|>Green.<|im_end|>"


def test_another_template_is_located_by_its_own_rendering(tokenizer):
    """No ChatML marker is assumed: under a Llama-3 template the spans are its content plus <|eot_id|>."""
    llama = copy.deepcopy(tokenizer)
    llama.chat_template = LLAMA3_TEMPLATE
    text, spans = assistant_spans(llama, CONVERSATION)
    assert [text[a:b] for a, b in spans] == ["Blue, like the sea.<|eot_id|>", "Green.<|eot_id|>"]
    assert "<|im_start|>assistant" not in text and "<|start_header_id|>assistant" in text


def test_a_template_that_does_not_render_prefixes_as_prefixes_is_refused(tokenizer):
    odd = copy.deepcopy(tokenizer)
    odd.chat_template = "{{ messages | length }}:{% for m in messages %}{{ m['content'] }};{% endfor %}"
    with pytest.raises(ValueError, match="^chat_template: "):
        assistant_spans(odd, CONVERSATION)
