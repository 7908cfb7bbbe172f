"""Regenerate training answers with the target itself, batched (the EAGLE-3 data practice).

A drafter is scored on how well it predicts *the target's* next token. ShareGPT's answers were
written by another model; the target's own greedy answers to the same questions are the data it
will be asked to draft at serving time. This module answers the first user turn of each
conversation with the target, many prompts per forward (transformers ``generate``, left padding,
greedy), and appends the results to a JSONL file so that a killed run resumes where it stopped.

The batched forward runs the target's own weights in ``dtype``: bfloat16 by default, which on a CPU
with AVX-512 BF16 answered 533-692 tok/s (two threads, batch 128) where fp32 gave 60-143. Neither
rounds exactly like Eyas's one-request decode, so a regenerated answer can differ from Eyas's greedy
answer after a near-tie. That is harmless for training data: the text is still the target's
distribution.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.target.loader import DTYPES

END_OF_TURN = "<|im_end|>"
REGEN_DTYPES = {name: DTYPES[name] for name in ("bfloat16", "float32")}  # the loader's; no fp16 on a CPU


@dataclass(frozen=True)
class RegenSummary:
    prompts: int  # answered in this call
    resumed: int  # already in the file
    new_tokens: int  # generated in this call
    truncated: int  # answers cut at max_new_tokens
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


def first_turn_prompts(
    items: Iterable[tuple[str, list[dict]]], tokenizer, max_prompt_tokens: int, limit: int
) -> list[tuple[str, list[dict], int]]:
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


def regenerate_batched(
    model_folder: str | Path,
    items: Iterable[tuple[str, list[dict]]],
    out_path: str | Path,
    limit: int,
    batch_size: int = 64,
    max_new_tokens: int = 192,
    max_prompt_tokens: int = 256,
    desc: str = "regenerate",
    device: str = "cpu",
    dtype: str = "bfloat16",
) -> RegenSummary:
    """Answer the first user turn of up to ``limit`` conversations with the target at ``model_folder``
    (an HF checkpoint folder: ``eyas.target.loader.checkpoint_folder``), greedy, ``batch_size`` at a
    time, on ``device`` in ``dtype`` (``"bfloat16"`` or ``"float32"``); append one JSON line per answer to ``out_path``; skip ids already there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if batch_size < 1:
        raise ValueError("batch_size: must be >= 1")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens: must be >= 1")
    if dtype not in REGEN_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(REGEN_DTYPES)}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_regenerated(out_path)}
    if len(done) >= limit:  # the file already holds enough answers (a run stopped early and cut to size)
        return RegenSummary(0, len(done), 0, 0, 0.0)
    tok = AutoTokenizer.from_pretrained(model_folder)
    tok.padding_side = "left"
    todo = [p for p in first_turn_prompts(items, tok, max_prompt_tokens, limit) if p[0] not in done]
    todo.sort(key=lambda p: p[2])  # similar lengths share a batch: less padding
    if not todo:
        return RegenSummary(0, len(done), 0, 0, 0.0)
    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=REGEN_DTYPES[dtype]).to(device).eval()
    end_id = tok.convert_tokens_to_ids(END_OF_TURN)
    t0, new_tokens, truncated = time.perf_counter(), 0, 0
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", dynamic_ncols=True)
    with out_path.open("a") as f:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            texts = [tok.apply_chat_template(u, add_generation_prompt=True, tokenize=False) for _, u, _ in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=end_id,
                    pad_token_id=tok.pad_token_id,
                )
            gen = out[:, enc["input_ids"].shape[1] :]  # [B, <= max_new]
            for (sid, user, _), row in zip(chunk, gen):
                ids = row.tolist()
                ended = end_id in ids
                ids = ids[: ids.index(end_id)] if ended else ids
                new_tokens += len(ids) + int(ended)
                truncated += int(not ended)
                answer = tok.decode(ids, skip_special_tokens=True)
                f.write(
                    json.dumps(
                        {
                            "id": sid,
                            "messages": user + [{"role": "assistant", "content": answer}],
                            "new_tokens": len(ids),
                            "truncated": not ended,
                        }
                    )
                    + "\n"
                )
            f.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    summary = RegenSummary(len(todo), len(done), new_tokens, truncated, time.perf_counter() - t0)
    print(
        f"{desc}: {summary.prompts} answers ({summary.resumed} resumed), {summary.new_tokens} tokens in "
        f"{summary.wall_s:.0f} s ({summary.tokens_per_s:.0f} tok/s), {summary.truncated} cut at {max_new_tokens}"
    )
    return summary


def regenerate_in_chunks(
    model_folder: str | Path, items, out_path: str | Path, limit: int, chunk: int, desc: str = "regenerate", **kwargs
) -> RegenSummary:
    """:func:`regenerate_batched` over the first ``chunk``, ``2 chunk``, ... conversations up to
    ``limit``: ``items()`` yields them afresh for each chunk. A run stopped anywhere leaves a file whose
    answers are those of a prefix of the conversations (each chunk sorted by length inside)."""
    if chunk < 1:
        raise ValueError("chunk: must be >= 1")
    total = RegenSummary(0, 0, 0, 0, 0.0)
    for upto in range(chunk, limit + chunk, chunk):
        upto = min(upto, limit)
        s = regenerate_batched(model_folder, items(), out_path, limit=upto, desc=f"{desc} <= {upto}", **kwargs)
        total = RegenSummary(
            total.prompts + s.prompts,
            max(total.resumed, s.resumed),
            total.new_tokens + s.new_tokens,
            total.truncated + s.truncated,
            total.wall_s + s.wall_s,
        )
        if upto >= limit:
            break
    return total


def main(argv: list[str] | None = None) -> int:
    """``python -m eyas.training.regen``: answer ShareGPT first turns with the target, resumably.

    Works through the split in chunks of ``--chunk`` conversations (in the data's own order, sorted
    by length inside a chunk), so a run stopped at any time leaves a file whose answers are a prefix
    of the split's conversations, not its shortest prompts; a rerun resumes where it stopped.
    """
    import argparse

    from eyas.target.loader import DEFAULT_TARGET, checkpoint_folder
    from eyas.training.data import conversations

    ap = argparse.ArgumentParser(prog="python -m eyas.training.regen", description=main.__doc__)
    ap.add_argument("--out", required=True, help="the answers JSONL (appended to; resumed)")
    ap.add_argument("--split", default="train", choices=("train", "heldout"))
    ap.add_argument("--limit", type=int, required=True, help="answer this many conversations in all")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(REGEN_DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    args = ap.parse_args(argv)
    if args.limit < 1 or args.chunk < 1:
        ap.error("--limit and --chunk must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from eyas.compute import keep_freed_memory

    keep_freed_memory()  # each decode step's temporaries reuse freed memory (eyas.compute)
    total = regenerate_in_chunks(
        checkpoint_folder(args.target),
        lambda: conversations(args.split),
        args.out,
        limit=args.limit,
        chunk=args.chunk,
        batch_size=args.batch,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        dtype=args.dtype,
        desc=f"regenerate {args.split}",
    )
    print(
        f"regenerate: {total.prompts} new answers, {total.new_tokens} tokens in {total.wall_s:.0f} s "
        f"({total.tokens_per_s:.1f} tok/s), {total.truncated} cut; {len(read_regenerated(args.out))} in {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
