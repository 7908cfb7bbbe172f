"""Structured output's two candidate engines on the shipped tokenizer: xgrammar (what Eyas uses) and
outlines-core, on the same JSON schemas and the same answer tokens.

For each engine and schema: the one-time cost (the tokenizer's vocabulary read in; the schema
compiled, or its regex built and indexed over the vocabulary), then per answer token the cost of
the work a round does (accept the token, produce the next allowed mask as a [V] boolean), and for
xgrammar one call that masks a whole 16-node draft tree. Ratios are against xgrammar in this run.

    python bench/grammar_engines.py [--repeats 5] [--json bench/results/grammar_engines.json]

Both engines must be installed (`pip install outlines-core` beside Eyas's own xgrammar).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eyas.target.loader import load_tokenizer  # noqa: E402
from eyas.verification.grammar import allowed_rows  # noqa: E402

V = 49152
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
        "required": ["name", "age", "city"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                },
            },
            "express": {"type": "boolean"},
        },
        "required": ["id", "items", "express"],
    },
}
ANSWERS = {
    "person": '{"name": "Ada Lovelace", "age": 36, "city": "London"}',
    "order": '{"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}], "express": true}',
}


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` calls, and the last result."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def xgrammar_arm(tok, schema: dict, ids: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    info_s, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), 1)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_s, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(schema)), repeats)

    def walk():
        m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
        bitmask = xgr.allocate_token_bitmask(1, V)
        for t in ids:
            m.fill_next_token_bitmask(bitmask, 0)
            allowed = allowed_rows(bitmask, V)[0]
            assert allowed[t], "the answer is the schema's"
            assert m.accept_token(t)

    walk_s, _ = timed(walk, repeats)
    m = xgr.GrammarMatcher(compiled, max_rollback_tokens=64)
    m.accept_token(ids[0])
    tree = 16  # a chain of the answer's next 15 tokens under the root
    tokens = torch.tensor(ids[:tree], dtype=torch.int64)
    first = torch.tensor([*range(1, tree), -1], dtype=torch.int64)
    sibling = torch.full((tree,), -1, dtype=torch.int64)
    bitmask = xgr.allocate_token_bitmask(tree, V)
    tree_s, _ = timed(lambda: m.traverse_draft_tree(first, sibling, tokens, bitmask), repeats * 20)
    return {
        "vocabulary_s": info_s,
        "compile_s": compile_s,
        "per_token_ms": 1e3 * walk_s / len(ids),
        "tree16_ms": 1e3 * tree_s,
    }


def byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's alphabet (GPT-2's): printable bytes stand for themselves, the others for the
    code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_vocabulary(tok) -> tuple[dict[bytes, list[int]], int]:
    """outlines-core's vocabulary: each token's bytes (the byte-level BPE alphabet mapped back to
    bytes, as GPT-2's ``bytes_to_unicode`` maps them); special tokens other than EOS left out."""
    back = {c: b for b, c in byte_alphabet().items()}
    special = set(tok.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for text, i in tok.get_vocab().items():
        if i in special or i >= V:
            continue
        try:
            key = bytes(back[c] for c in text)
        except KeyError:  # not a byte-level token (an added token)
            continue
        vocab.setdefault(key, []).append(i)
    return vocab, tok.eos_token_id


def outlines_arm(tok, schema: dict, ids: list[int], repeats: int) -> dict:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    vocab, eos = byte_vocabulary(tok)
    vocab_s, vocabulary = timed(lambda: oc.Vocabulary(eos, vocab), 1)
    regex = build_regex_from_schema(json.dumps(schema))
    compile_s, index = timed(lambda: oc.Index(regex, vocabulary), max(1, repeats // 2))

    def walk():
        state = index.get_initial_state()
        for t in ids:
            allowed = torch.zeros(V, dtype=torch.bool)
            allowed[torch.tensor(index.get_allowed_tokens(state), dtype=torch.int64)] = True
            assert allowed[t], "the answer is the schema's regex's"
            state = index.get_next_state(state, t)

    try:
        walk_s, _ = timed(walk, repeats)
        per_token = 1e3 * walk_s / len(ids)
    except AssertionError:  # its default whitespace differs from the answer's
        per_token = None
    return {"vocabulary_s": vocab_s, "compile_s": compile_s, "per_token_ms": per_token, "tree16_ms": None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=str(ROOT / "bench/results/grammar_engines.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tok = load_tokenizer()
    rows = []
    for name, schema in SCHEMAS.items():
        ids = tok.encode(ANSWERS[name], add_special_tokens=False) + [tok.eos_token_id]
        for engine, arm in (("xgrammar", xgrammar_arm), ("outlines-core", outlines_arm)):
            print(f"{name}: {engine} ...", file=sys.stderr, flush=True)
            rows.append(
                {"schema": name, "engine": engine, "answer_tokens": len(ids), **arm(tok, schema, ids, args.repeats)}
            )
    cpu = platform.processor() or platform.machine()
    print(f"\n{cpu}, {args.threads} thread(s), vocabulary {V}; medians of {args.repeats}\n")
    head = f"{'schema':<8} {'engine':<14} {'vocab s':>8} {'compile s':>10} {'per token ms':>13} {'16-node tree ms':>16}"
    print(head)
    for r in rows:

        def f(x, spec):
            return "-" if x is None else format(x, spec)

        print(
            f"{r['schema']:<8} {r['engine']:<14} {f(r['vocabulary_s'], '8.3f')} {f(r['compile_s'], '10.4f')} "
            f"{f(r['per_token_ms'], '13.4f')} {f(r['tree16_ms'], '16.4f')}"
        )
    for name in SCHEMAS:
        x, o = (
            next(r for r in rows if r["schema"] == name and r["engine"] == e) for e in ("xgrammar", "outlines-core")
        )
        print(
            f"{name}: outlines-core / xgrammar: compile {o['compile_s'] / x['compile_s']:.0f}x"
            + ("" if o["per_token_ms"] is None else f", per token {o['per_token_ms'] / x['per_token_ms']:.1f}x")
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "threads": args.threads, "rows": rows}, indent=1) + "\n")
    _plot(rows, out.with_suffix(".png"))
    print(f"\nwritten: {out}, {out.with_suffix('.png')}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "compile_s", "compile + index (s)"), (axes[1], "per_token_ms", "per token (ms)")):
        names = [f"{r['schema']}\n{r['engine']}" for r in rows]
        ax.bar(
            names, [np.nan if r[key] is None else r[key] for r in rows], color=["tab:blue", "tab:orange"] * len(SCHEMAS)
        )
        ax.set_yscale("log")
        ax.set_title(label)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
