"""Regenerate training answers with the target itself, batched (the EAGLE-3 data practice).

A drafter is scored on how well it predicts *the target's* next token. ShareGPT's answers were
written by another model; the target's own greedy answers to the same questions are the data it
will be asked to draft at serving time. This module answers the first user turn of each
conversation with the target, many prompts per forward (transformers ``generate``, left padding,
greedy), and appends the results to a JSONL file so that a killed run resumes where it stopped.

The batched forward is the target's own weights in fp32, but padded batches do not round exactly
like Eyas's one-request decode, so a regenerated answer can differ from Eyas's greedy answer after
a near-tie. That is harmless for training data: the text is still the target's distribution.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from tqdm import tqdm

END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class RegenSummary:
    prompts: int              # answered in this call
    resumed: int              # already in the file
    new_tokens: int           # generated in this call
    truncated: int            # answers cut at max_new_tokens
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall_s, 1e-9)


def read_regenerated(path: str | Path) -> list[dict]:
    """The records of a regeneration file: ``{"id", "messages", "new_tokens", "truncated"}``."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a run killed mid-write leaves at most one partial last line
    return out


def first_turn_prompts(items: Iterable[tuple[str, list[dict]]], tokenizer, max_prompt_tokens: int,
                       limit: int) -> list[tuple[str, list[dict], int]]:
    """(id, [first user message], prompt length) for up to ``limit`` conversations whose templated
    first turn fits in ``max_prompt_tokens``."""
    out = []
    for sid, msgs in items:
        user = [m for m in msgs[:1] if m["role"] == "user"]
        if not user:
            continue
        ids = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        if len(ids) > max_prompt_tokens:
            continue
        out.append((sid, user, len(ids)))
        if len(out) >= limit:
            break
    return out


def regenerate_batched(model_folder: str | Path, items: Iterable[tuple[str, list[dict]]], out_path: str | Path,
                       limit: int, batch_size: int = 64, max_new_tokens: int = 192,
                       max_prompt_tokens: int = 256, desc: str = "regenerate") -> RegenSummary:
    """Answer the first user turn of up to ``limit`` conversations with the target at ``model_folder``
    (an HF checkpoint folder: ``eyas.target.loader.checkpoint_folder``), greedy, ``batch_size`` at a
    time; append one JSON line per answer to ``out_path``; skip ids already there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if batch_size < 1:
        raise ValueError("batch_size: must be >= 1")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens: must be >= 1")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_regenerated(out_path)}
    if len(done) >= limit:  # the file already holds enough answers (a run stopped early and cut to size)
        return RegenSummary(0, len(done), 0, 0, 0.0)
    tok = AutoTokenizer.from_pretrained(model_folder)
    tok.padding_side = "left"
    todo = [p for p in first_turn_prompts(items, tok, max_prompt_tokens, limit) if p[0] not in done]
    todo.sort(key=lambda p: p[2])     # similar lengths share a batch: less padding
    if not todo:
        return RegenSummary(0, len(done), 0, 0, 0.0)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    end_id = tok.convert_tokens_to_ids(END_OF_TURN)
    t0, new_tokens, truncated = time.perf_counter(), 0, 0
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", dynamic_ncols=True)
    with out_path.open("a") as f:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start:start + batch_size]
            texts = [tok.apply_chat_template(u, add_generation_prompt=True, tokenize=False) for _, u, _ in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     eos_token_id=end_id, pad_token_id=tok.pad_token_id)
            gen = out[:, enc["input_ids"].shape[1]:]                                  # [B, <= max_new]
            for (sid, user, _), row in zip(chunk, gen):
                ids = row.tolist()
                ended = end_id in ids
                ids = ids[:ids.index(end_id)] if ended else ids
                new_tokens += len(ids) + int(ended)
                truncated += int(not ended)
                answer = tok.decode(ids, skip_special_tokens=True)
                f.write(json.dumps({"id": sid, "messages": user + [{"role": "assistant", "content": answer}],
                                    "new_tokens": len(ids), "truncated": not ended}) + "\n")
            f.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    summary = RegenSummary(len(todo), len(done), new_tokens, truncated, time.perf_counter() - t0)
    print(f"{desc}: {summary.prompts} answers ({summary.resumed} resumed), {summary.new_tokens} tokens in "
          f"{summary.wall_s:.0f} s ({summary.tokens_per_s:.0f} tok/s), {summary.truncated} cut at {max_new_tokens}")
    return summary
