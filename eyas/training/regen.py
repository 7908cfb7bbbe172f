"""Regenerate training answers with the target itself, batched (the EAGLE-3 data practice).

A drafter is scored on how well it predicts *the target's* next token. ShareGPT's answers were
written by another model; the target's own greedy answers to the same questions are the data it
will be asked to draft at serving time. This module answers the first user turn of each
conversation with the target, many prompts per forward on Eyas's own target model
(:func:`answer_batch`: right-aligned prompts in one K/V cache, one slot a step), and appends the
results to a JSONL file so that a killed run resumes where it stopped.

The batched forward runs the target's weights in ``dtype``: bfloat16 by default (AVX-512 BF16 runs
it several times faster than float32), with the K/V cache and attention in float32 and the
head's best candidates rescored in float32. Neither rounds exactly like Eyas's one-request decode
at the served precision, so a regenerated answer can differ from Eyas's greedy answer after a
near-tie. That is harmless for training data: the text is still the target's distribution.

With ``features_dir`` the same forwards also record every fed token's feature taps, so the answers
arrive with their training features (a feature cache, :class:`eyas.training.features.FeatureCache`)
and a run trains on them without a target forward of its own (``data.train_cache``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.target.config import FeatureTap
from eyas.target.layers import KVCache
from eyas.target.loader import DTYPES
from eyas.target.model import TargetModel

END_OF_TURN = "<|im_end|>"
REGEN_DTYPES = {name: DTYPES[name] for name in ("bfloat16", "float32")}  # the loader's; no fp16 on a CPU


def sample_rows(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of ``probs`` ([B, V], rows summing to about 1) -> token ids [B] int64.

    Inverse-CDF sampling: one uniform a row against the row's float64 cumulative sum, so a draw
    costs a pass over the row instead of ``torch.multinomial``'s exponential variate for every
    vocabulary entry (155 ms a step for 128 rows of 49,152 on a 2-core CPU, a fifth of a float32
    decode step). A token of probability 0 is never drawn (its cell of the CDF is empty)."""
    assert probs.dim() == 2, "probs: [B, V]"
    cdf = probs.double().cumsum(-1)  # [B, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)  # [B, 1]
    ids = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [B, 1] the first cell whose CDF exceeds u
    return ids.clamp_(max=probs.shape[-1] - 1)[:, 0]


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


@dataclass(frozen=True)
class Answer:
    """One prompt's continuation (:func:`answer_batch`)."""

    ids: list[int]  # the generated tokens, the end-of-turn token last when the answer ended
    ended: bool  # False: cut at max_new_tokens
    features: torch.Tensor | None  # [len(prompt) + len(ids), F] at the taps, every token fed (None: no taps)


RESCORE_TOP = 4  # candidates of the low-precision head rescored in float32 (answer_batch)
PREFILL_GROUP = 16  # prompts prefilled in one forward (answer_batch)
COMPACT_AT = 1 / 8  # the batch drops its finished rows once they are this share of it (answer_batch)


@torch.inference_mode()
def answer_batch(
    model: TargetModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    end_id: int,
    taps: tuple[FeatureTap, ...] = (),
    head_weight: torch.Tensor | None = None,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[Answer]:
    """Continuations of ``prompts`` in one batch on ``model`` (its own dtype and device), greedy, or
    with ``temperature`` > 0 sampled from the target's distribution at that temperature (drawn with
    ``generator``: the same batch and seed give the same answers), and
    each sample's features at ``taps``: the forward that picks each token records them, so the
    features of prompt and answer come without a forward of their own.

    Prompts are right-aligned in one K/V cache (row b's prompt in slots ``[P - n_b, P)``, positions
    from 0) and each step feeds every row's last token into the next slot; a pad slot is masked for
    every query, and a pad query sees only itself (finite, never read). A row whose answer has ended
    and fed its last token is dropped from the batch (its K/V rows too) once such rows are
    ``COMPACT_AT`` of it; until then it is fed and ignored. ``head_weight`` ([V, d] float32):
    the token is the best of the head's ``RESCORE_TOP`` candidates rescored in float32 from the
    LM-head input (a bfloat16 head ties logits within 1/128 of their size); None: the head's argmax.
    """
    assert prompts and all(prompts), "prompts: non-empty token lists"
    dev = model.embed.weight.device
    B, P = len(prompts), max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)  # [B]
    offset = P - lengths  # [B] each row's first prompt slot
    tokens = torch.zeros(B, P, dtype=torch.int64, device=dev)
    for b, p in enumerate(prompts):
        tokens[b, P - len(p) :] = torch.tensor(p, dtype=torch.int64)
    slot = torch.arange(P + max_new_tokens, device=dev)  # [S]
    key_valid = slot[None] >= offset[:, None]  # [B, S] pad slots are never attended to
    positions = (slot[None, :P] - offset[:, None]).clamp(min=0)  # [B, P]
    prefill_mask = (slot[None, :P, None] >= slot[None, None, :P]) & key_valid[:, None, :P]  # [B, P, P]
    prefill_mask |= torch.eye(P, dtype=torch.bool, device=dev)[None]
    d = model.cfg.hidden_size
    # the LM-head input is what picks the token: tap it beside the caller's taps
    head_tap = FeatureTap(model.cfg.num_layers, True)
    all_taps = tuple(taps) + (() if head_tap in taps else (head_tap,))
    final_at = all_taps.index(head_tap) * d
    c = model.cfg  # K/V in float32: torch's fused CPU attention runs a batch of one-row bfloat16
    # decodes about 4x slower than float32 (and float32 attention rounds less)
    cache = KVCache.allocate(c.num_layers, B, c.num_kv_heads, P + max_new_tokens, c.head_dim, torch.float32, dev)

    def pick(out_logits: torch.Tensor, final: torch.Tensor) -> torch.Tensor:  # [B, V], [B, d] -> [B]
        if temperature > 0:
            return sample_rows(torch.softmax(out_logits.float() / temperature, dim=-1), generator)
        if head_weight is None:
            return out_logits.argmax(-1)
        top = out_logits.topk(RESCORE_TOP, dim=-1).indices  # [B, k]
        exact = torch.einsum("bkd,bd->bk", head_weight[top], final.float())  # [B, k]
        return top.gather(1, exact.argmax(-1, keepdim=True))[:, 0]

    # the prefill in groups of similar lengths (the prompts come sorted), each padded only to its own
    # longest: one group's forward writes its rows' slots [P - P_g, P) through a view of the cache
    grid = torch.empty(B, P, model.cfg.hidden_size * len(all_taps), dtype=model.embed.weight.dtype, device=dev)
    for g0 in range(0, B, PREFILL_GROUP):
        rows = slice(g0, min(g0 + PREFILL_GROUP, B))
        Pg = int(lengths[rows].max())
        view = KVCache(cache.k[:, rows], cache.v[:, rows])
        out = model(
            tokens[rows, P - Pg :],
            positions[rows, P - Pg :],
            view,
            P - Pg,
            prefill_mask[rows, P - Pg :],
            all_taps,
            logits_rows="none",
        )
        grid[rows, P - Pg :] = out.features
    final = grid[:, -1, final_at : final_at + d]  # [B, d]
    nxt = pick(model.lm_head(final).float(), final)  # [B] the token fed next, one per live row
    gen = torch.full((B, max_new_tokens), end_id, dtype=torch.int64, device=dev)  # [B, N] by original row
    gen[:, 0] = nxt
    fed = torch.zeros(B, max_new_tokens, grid.shape[-1], dtype=grid.dtype, device=dev) if taps else None  # [B, N, F]
    length = torch.where(nxt == end_id, 1, max_new_tokens)  # [B] tokens each answer has (so far, if unended)
    live = torch.arange(B, device=dev)  # [b] original row of each row of the batch
    for t in range(max_new_tokens):  # step t feeds each live row's token t into slot P + t
        done = length[live] <= t  # rows whose last token was fed: dropped once there are enough of them
        if bool(done.all()):
            break
        if int(done.sum()) >= max(COMPACT_AT * live.numel(), 1):
            keep = (~done).nonzero()[:, 0]
            live, nxt, key_valid = live[keep], nxt[keep], key_valid[keep]
            cache = KVCache(cache.k.index_select(1, keep), cache.v.index_select(1, keep))
        last = t == max_new_tokens - 1 or bool((length[live] <= t + 1).all())  # no token is picked after it
        out = model(
            nxt[:, None],
            (lengths[live] + t)[:, None],
            cache,
            P + t,
            key_valid[:, None, : P + t + 1],
            all_taps,
            logits_rows="none" if last else "all",
        )
        if fed is not None:
            fed[live, t] = out.features[:, 0]
        if last:
            break
        nxt = pick(out.logits[:, -1], out.features[:, -1, final_at : final_at + d])
        unended = length[live] == max_new_tokens
        gen[live[unended], t + 1] = nxt[unended]
        length[live[unended & (nxt == end_id)]] = t + 2
    answers = []
    for b in range(B):
        n = int(length[b])
        ids = gen[b, :n].tolist()
        f = None
        if taps:
            f = torch.cat([grid[b, int(offset[b]) :], fed[b, :n]])  # [n_b + n, F]
            f = f if head_tap in taps else f[:, :-d]
        answers.append(Answer(ids, ids[-1] == end_id, f))
    return answers


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
    features_dir: str | Path | None = None,
    temperature: float = 0.0,
    sample: int = 0,
) -> RegenSummary:
    """Answer the first user turn of up to ``limit`` conversations with the target at ``model_folder``
    (a checkpoint folder or ``.gguf``: ``eyas.target.loader.load_target``), greedy, ``batch_size``
    at a time (:func:`answer_batch`), on ``device`` in ``dtype`` (``"bfloat16"`` or
    ``"float32"``); append one JSON line per answer to ``out_path``; skip ids already there.

    ``features_dir``: also write each answered sample's training features (its prompt and answer
    tokens exactly as fed, the trainer's taps) into the feature cache there, one shard a batch, made
    by the same forwards that chose the tokens. A shard is durable before its answers are appended,
    and a shard whose answers never reached ``out_path`` (a run killed between the two) is dropped on
    resume, so the cache holds exactly the answers made with it.

    ``temperature`` > 0: each answer is sampled at that temperature (:func:`answer_batch`), its
    record id the conversation's with the pass ``sample`` (:func:`record_id`): passes with other
    ``sample`` numbers answer the same first turns afresh, into the same file or another (``limit``
    and ``resumed`` count the pass's own answers)."""
    from eyas.target.loader import load_target
    from eyas.training.features import FeatureBatch, FeatureCache, training_taps

    if batch_size < 1:
        raise ValueError("batch_size: must be >= 1")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens: must be >= 1")
    if dtype not in REGEN_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {sorted(REGEN_DTYPES)}")
    if not temperature >= 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {r["id"] for r in read_regenerated(out_path)}
    suffix = record_id("", temperature, sample)
    mine = sum(1 for rid in done if (rid.endswith(suffix) if suffix else "~" not in rid))  # this pass's
    if mine >= limit:  # the file already holds enough answers (a run stopped early and cut to size)
        return RegenSummary(0, mine, 0, 0, 0.0)
    loaded = load_target(model_folder, "fp32", device=device)
    tok = loaded.tokenizer
    todo = [
        p
        for p in first_turn_prompts(items, tok, max_prompt_tokens, limit)
        if record_id(p[0], temperature, sample) not in done
    ]
    todo.sort(key=lambda p: p[2])  # similar lengths share a batch: less padding
    if not todo:
        return RegenSummary(0, mine, 0, 0, 0.0)
    model = loaded.model
    head_weight = None
    if REGEN_DTYPES[dtype] != torch.float32:
        head_weight = model.lm_head.weight.detach().clone()  # [V, d] float32: rescores the head's candidates
        model = model.to(REGEN_DTYPES[dtype])
    taps = training_taps(model) if features_dir is not None else ()
    cache = manifest = None
    if features_dir is not None:
        cache = FeatureCache(features_dir)
        info = {"split": "regen", "source": "sharegpt-v3", "answers": out_path.name, "dtype": dtype}
        info |= {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens}
        manifest = cache.begin(loaded.fingerprint.to_dict(), taps, info, keep=done)
    end_id = tok.convert_tokens_to_ids(END_OF_TURN)
    generator = torch.Generator(device=device).manual_seed(sample) if temperature > 0 else None
    t0, new_tokens, truncated = time.perf_counter(), 0, 0
    bar = tqdm(total=len(todo), desc=desc, unit="prompt", dynamic_ncols=True)
    with out_path.open("a") as f:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            prompts = [_prompt_ids(tok, user) for _, user, _ in chunk]
            answers = answer_batch(model, prompts, max_new_tokens, end_id, taps, head_weight, temperature, generator)
            if cache is not None:
                cache.write_shard(
                    manifest,
                    [
                        FeatureBatch(
                            record_id(sid, temperature, sample),
                            torch.tensor(p + a.ids, dtype=torch.int64),
                            torch.tensor([False] * len(p) + [True] * len(a.ids)),
                            a.features,
                        )
                        for (sid, _, _), p, a in zip(chunk, prompts, answers)
                    ],
                )
            for (sid, user, _), a in zip(chunk, answers):
                ids = a.ids[:-1] if a.ended else a.ids
                new_tokens += len(a.ids)
                truncated += int(not a.ended)
                answer = tok.decode(ids, skip_special_tokens=True)
                record = {
                    "id": record_id(sid, temperature, sample),
                    "messages": user + [{"role": "assistant", "content": answer}],
                    "new_tokens": len(ids),
                    "truncated": not a.ended,
                }
                if temperature > 0:
                    record |= {"temperature": temperature, "sample": sample}
                f.write(json.dumps(record) + "\n")
            f.flush()
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    if cache is not None:
        cache.finish(manifest)
    summary = RegenSummary(len(todo), mine, new_tokens, truncated, time.perf_counter() - t0)
    print(
        f"{desc}: {summary.prompts} answers ({summary.resumed} resumed), {summary.new_tokens} tokens in "
        f"{summary.wall_s:.0f} s ({summary.tokens_per_s:.0f} tok/s), {summary.truncated} cut at {max_new_tokens}"
    )
    return summary


def record_id(conversation_id: str, temperature: float, sample: int) -> str:
    """An answer's id in the JSONL and the feature cache: the conversation's for a greedy answer,
    with ``~t<temperature>s<sample>`` for a sampled one."""
    return conversation_id if temperature == 0 else f"{conversation_id}~t{temperature:g}s{sample}"


def _prompt_ids(tokenizer, user: list[dict]) -> list[int]:
    """The templated first turn with the assistant header, as token ids."""
    ids = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


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
    ap.add_argument(
        "--features",
        default=None,
        help="also write each answer's training features (the taps its own decoding recorded) into the "
        "feature cache in this folder; train on it with data.train_cache",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="sample the answers (default 0: greedy)")
    ap.add_argument("--sample", type=int, default=0, help="the sampling pass (seed and id suffix) with --temperature")
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
        features_dir=os.path.expanduser(args.features) if args.features else None,
        temperature=args.temperature,
        sample=args.sample,
    )
    print(
        f"regenerate: {total.prompts} new answers, {total.new_tokens} tokens in {total.wall_s:.0f} s "
        f"({total.tokens_per_s:.1f} tok/s), {total.truncated} cut; {len(read_regenerated(args.out))} in {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
