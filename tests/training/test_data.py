"""Rendering training conversations with the tokenizer's own chat template (the real tokenizer)."""

from __future__ import annotations

import copy
import json

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


def test_a_sampled_pass_trains_from_its_own_answers_file_and_the_heldout_split_stays_greedy(tokenizer, tmp_path):
    """``data.regen_temperature``/``regen_sample`` read the train split's answers from the pass's own
    file (``<target>-sharegpt-train.t0.7s1.answers.jsonl``, as ``python -m eyas.training.regen
    --temperature 0.7 --sample 1`` writes it); the held-out split is read from the greedy file. Files
    that already hold enough answers are read as they are (nothing is regenerated)."""
    from eyas.training.config import DataConfig, TrainConfig
    from eyas.training.prepare import cache_dirs, regenerated_samples

    def answers(name: str, ids: list[str], text: str) -> None:
        with open(tmp_path / name, "w") as f:
            for rid in ids:
                messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": f"{text} {rid}"}]
                f.write(json.dumps({"id": rid, "messages": messages, "new_tokens": 3, "truncated": False}) + "\n")

    answers("smollm2-135m-sharegpt-train.answers.jsonl", ["a", "b", "c"], "greedy")
    answers("smollm2-135m-sharegpt-train.t0.7s1.answers.jsonl", ["a~t0.7s1", "b~t0.7s1", "c~t0.7s1"], "sampled")
    answers("smollm2-135m-sharegpt-heldout.answers.jsonl", ["h"], "greedy")
    data = dict(regenerate=True, answers_dir=str(tmp_path), train_samples=2, heldout_samples=1, cache_dir=str(tmp_path))
    sampled = TrainConfig(data=DataConfig(**data, regen_temperature=0.7, regen_sample=1))
    greedy = TrainConfig(data=DataConfig(**data))
    folder = tmp_path / "cache"
    texts = [_supervised_text(tokenizer, s) for s in regenerated_samples(sampled, tokenizer, "train", 2, folder)]
    assert texts == ["sampled a~t0.7s1<|im_end|>", "sampled b~t0.7s1<|im_end|>"]
    texts = [_supervised_text(tokenizer, s) for s in regenerated_samples(greedy, tokenizer, "train", 2, folder)]
    assert texts == ["greedy a<|im_end|>", "greedy b<|im_end|>"]
    heldout = regenerated_samples(sampled, tokenizer, "heldout", 1, folder)
    assert [_supervised_text(tokenizer, s) for s in heldout] == ["greedy h<|im_end|>"]
    assert cache_dirs(sampled)[0] != cache_dirs(greedy)[0] and cache_dirs(sampled)[1] == cache_dirs(greedy)[1]


def test_answer_token_counts_count_every_train_answers_file_as_training_supervises_it(tokenizer, tmp_path):
    """rebuild_draft_vocab's counts: the supervised tokens (the answer and its end-of-turn token) of
    every train answers file in answers_dir, greedy and sampled (an answer cut at the token limit
    without its end-of-turn token, as training supervises it); the held-out split is not counted."""
    from eyas.training.config import DataConfig, TrainConfig
    from eyas.training.prepare import answer_token_counts

    def answers(name: str, text: str, truncated: bool = False) -> None:
        messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": text}]
        record = {"id": "x", "messages": messages, "new_tokens": 1, "truncated": truncated}
        (tmp_path / name).write_text(json.dumps(record))

    answers("smollm2-135m-sharegpt-train.answers.jsonl", "Blue")
    answers("smollm2-135m-sharegpt-train.t0.7s1.answers.jsonl", "Blue sea", truncated=True)
    answers("smollm2-135m-sharegpt-heldout.answers.jsonl", "Green")
    cfg = TrainConfig(data=DataConfig(regenerate=True, answers_dir=str(tmp_path)))
    counts = answer_token_counts(cfg, tokenizer, len(tokenizer))
    expected = tokenizer("Blue<|im_end|>Blue sea", add_special_tokens=False)["input_ids"]
    assert int(counts.sum()) == len(expected)
    for t in set(expected):
        assert int(counts[t]) == expected.count(t)
    empty = TrainConfig(data=DataConfig(regenerate=True, answers_dir=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="^data.answers_dir: .* holds no smollm2-135m-sharegpt-train answers"):
        answer_token_counts(empty, tokenizer, len(tokenizer))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(regen_temperature=0.7), "regen_temperature"),
        (dict(regenerate=True, regen_sample=1), "regen_sample"),
        (dict(regenerate=True, regen_temperature=-0.1), "regen_temperature"),
    ],
)
def test_sampled_pass_fields_are_checked(fields, message):
    from pydantic import ValidationError

    from eyas.training.config import DataConfig

    with pytest.raises(ValidationError, match=message):
        DataConfig(**fields)
