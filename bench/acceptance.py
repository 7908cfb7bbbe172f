"""Acceptance of the shipped drafters: tau, acceptance by depth and wall-clock speedup, in ONE run.

What it measures, on the same prompts (all greedy, one precision, fp32 unless named otherwise):

    target                    Eyas target-only decoding: the speed baseline
    <folder>                  every drafter under drafters/ (a folder with manifest.json and
                              model.safetensors), on an EAGLE-2 dynamic tree: the manifest's
                              tree_abi.default_tree unless --tree-width/--tree-depth/--tree-budget
    <folder>-chain            each eagle1-architecture drafter (EAGLE-1 or HASS trained) on a chain
                              as deep as its dynamic tree
    random-init-eagle1/3      only when no drafter folder exists yet: the untrained drafters that
    random-init-eagle1-chain  Eyas falls back to (their numbers say nothing about a trained one)

Per method:
    tau        mean tokens per target forward, the frontier token included, as the EAGLE papers
               count it: sum of the rounds' new tokens / number of rounds, over speculation rounds
               only (the prefill's first token is not a round)
    accept@k   the fraction of rounds that accepted >= k drafted tokens, k = 1..tree depth
    tok/s      new tokens / wall seconds (prefill and session set-up included), and the speedup:
               tok/s / target-only tok/s in this same run
    identical  prompts whose greedy output equals target-only's (speculative decoding must be exact)

Methods are interleaved per prompt in a rotating order, so the noise of a shared machine hits them
alike; only the ratios against the target-only baseline of the same run mean something.

Run:
    .venv/bin/python bench/acceptance.py --limit 8                        # MT-bench first turns
    .venv/bin/python bench/acceptance.py --json bench/out/acceptance.json --threads 4
    .venv/bin/python bench/acceptance.py --prompts my.jsonl --tree-width 8 --tree-depth 6 --tree-budget 32
    .venv/bin/python bench/acceptance.py --methods smollm2-135m-eagle3,smollm2-135m-eagle1-chain
    .venv/bin/python bench/acceptance.py --drafters runs/candidates      # drafters from another folder

Prints a table, a ready-to-paste Markdown table and a summary line; ``--json OUT.json`` writes every
number; the plot (tau and speedup bars, acceptance-by-depth lines) goes to ``--plot``, by default next
to the JSON or bench/out/acceptance.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import WARMUP_NEW_TOKENS, fmt_ratio, load_prompts, placement_refused, trim_after_eos  # noqa: E402

from eyas.drafting.manifest import MANIFEST_FILE, WEIGHTS_FILE, read_manifest  # noqa: E402
from eyas.protocol.schema import parse_request  # noqa: E402
from eyas.runtime import REPO_DRAFTERS, Eyas, set_threads  # noqa: E402
from eyas.target.loader import PRECISIONS  # noqa: E402

TABLE_DEPTHS = 5  # accept@1..5 in the printed table (the JSON holds every depth)
MARKDOWN_DEPTHS = 3  # accept@1..3 in the Markdown table
DEFAULT_PLOT = Path(__file__).resolve().parent / "out" / "acceptance.png"


# --- methods ------------------------------------------------------------------------------------
@dataclass
class Method:
    name: str
    request: dict = field(default_factory=dict)  # parse_request fields (method, drafter, tree_*)
    drafter: str | None = None  # checkpoint folder, "random-init", None for target
    trained_as: str | None = None  # the manifest's recipe.trained_as
    depth: int = 0  # the tree's max depth (0 for target)
    baseline: str = "target"  # the target-only method its speedup and identity are measured against

    @property
    def is_speculative(self) -> bool:
        return self.request["method"] != "target"


def find_drafters(root: Path = REPO_DRAFTERS) -> tuple[list[tuple[Path, object]], list[str]]:
    """Drafter folders under ``root`` (manifest.json + model.safetensors), sorted; and notes on skipped ones."""
    found, notes = [], []
    if not root.is_dir():
        return found, notes
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        if not (folder / MANIFEST_FILE).exists() or not (folder / WEIGHTS_FILE).exists():
            continue  # e.g. a training run that has not exported yet
        try:
            found.append((folder, read_manifest(folder)))
        except (ValueError, OSError) as err:
            notes.append(f"skipped {folder}: {err}")
    return found, notes


def parse_trees(text: str | None) -> list[dict]:
    """``--trees 2/2/4,3/4/4@0.06/0.45``: width/depth/budget triples, each with optional value floors
    ``@min_value/expand_min_value`` (without them: 0 and 0, plain EAGLE-2), or ``default`` (the
    drafter's own default tree at this precision) -> tree override dicts ([] when not given)."""
    if not text:
        return []
    out = []
    for item in text.split(","):
        if item.strip() == "default":
            out.append({})
            continue
        shape, _, floors = item.strip().partition("@")
        parts = shape.split("/")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"--trees: {item!r} is not width/depth/budget (positive integers)")
        w, d, b = map(int, parts)
        try:
            lo, hi = (float(x) for x in floors.split("/")) if floors else (0.0, 0.0)
        except ValueError:
            raise ValueError(f"--trees: {item!r}: value floors are @min_value/expand_min_value") from None
        if not (0 <= lo <= 1 and 0 <= hi <= 1):
            raise ValueError(f"--trees: {item!r}: value floors lie in [0, 1]")
        out.append(
            {"tree_width": w, "tree_depth": d, "tree_budget": b, "tree_min_value": lo, "tree_expand_min_value": hi}
        )
    return out


def tree_label(tree: dict) -> str:
    """``w/d/b``, with ``@min/expand`` when a value floor is set; ``default`` for the drafter's own."""
    if not tree:
        return "default"
    label = f"{tree['tree_width']}/{tree['tree_depth']}/{tree['tree_budget']}"
    lo, hi = tree.get("tree_min_value", 0.0), tree.get("tree_expand_min_value", 0.0)
    return label + (f"@{lo:g}/{hi:g}" if lo or hi else "")


def build_methods(
    eyas: Eyas, tree_overrides: dict, root: Path = REPO_DRAFTERS, trees: list[dict] | None = None
) -> tuple[list[Method], list[str]]:
    """target, then each drafter on a dynamic tree (and eagle1-architecture ones on a chain too);
    with ``trees``, each drafter once per tree, named ``<drafter>@w/d/b`` (one baseline for all)."""
    methods = [Method("target", {"method": "target"})]
    drafters, notes = find_drafters(root)
    entries = [(f.name, f.resolve(), m.method, m.recipe.get("trained_as", m.method)) for f, m in drafters]
    if not entries:
        entries = [(f"random-init-{m}", None, m, None) for m in ("eagle1", "eagle3")]
    for name, path, method, trained_as in entries:
        try:
            handle = eyas.drafter(method, str(path) if path else None)  # loads it now: errors surface here
        except (ValueError, OSError) as err:
            notes.append(f"skipped {path}: {err}")
            continue
        depth = tree_overrides.get("tree_depth", handle.default_tree.max_depth)
        common = {"method": method, "drafter": str(path) if path else None}
        for tree in trees or []:
            label = tree_label(tree)
            methods.append(
                Method(
                    f"{name}@{label}",
                    {**common, "tree_kind": "dynamic", **tree},
                    handle.source,
                    trained_as,
                    tree.get("tree_depth", handle.default_tree.max_depth),
                )
            )
        if trees:
            continue
        methods.append(
            Method(name, {**common, "tree_kind": "dynamic", **tree_overrides}, handle.source, trained_as, depth)
        )
        if method == "eagle1":
            methods.append(
                Method(
                    f"{name}-chain",
                    {**common, "tree_kind": "chain", "tree_depth": depth},
                    handle.source,
                    trained_as,
                    depth,
                )
            )
    return methods, notes


# --- one generation -----------------------------------------------------------------------------
def run(eyas: Eyas, m: Method, ids: list[int], max_new_tokens: int) -> dict:
    req = parse_request(prompt_ids=ids, max_new_tokens=max_new_tokens, **m.request)
    t0 = time.perf_counter()
    result, report = eyas.generate(req)
    wall = time.perf_counter() - t0  # as decode_speed.py: prefill and session set-up included
    return {
        "token_ids": list(result.token_ids),
        "new_tokens": len(result.token_ids),
        "wall_s": wall,
        "target_forwards": result.target_forwards,
        "tree": report["tree"],
        "accept_lengths": [r.accept_length for r in result.rounds],
        "round_new_tokens": [r.new_tokens for r in result.rounds],
    }


def bench(
    eyas: Eyas, methods: list[Method], prompt_ids: list[list[int]], max_new_tokens: int, shared_suffix: int = 0
) -> list[dict]:
    """Every method on every prompt, the order rotated per prompt. ``shared_suffix``: each method keeps
    its own cache of its earlier answers (this many tokens) that its suffix drafts may copy from, as a
    serving loop does (0: none); the prompts then run in order, so a later one may copy an earlier answer."""
    from tqdm import tqdm

    from eyas.drafting.suffix import SharedSuffixCache

    for m in methods:  # warm-up, not timed
        run(eyas, m, prompt_ids[0], WARMUP_NEW_TOKENS)
    caches = {m.name: SharedSuffixCache(shared_suffix) for m in methods} if shared_suffix else {}
    records = []
    bar = tqdm(total=len(prompt_ids) * len(methods), desc="acceptance", unit="gen", file=sys.stderr)
    for p, ids in enumerate(prompt_ids):
        shift = p % len(methods)  # rotate the order so no method always runs first or last
        for m in methods[shift:] + methods[:shift]:
            bar.set_postfix_str(f"prompt {p} {m.name}")
            eyas.shared_suffix = caches.get(m.name)  # the method's own earlier answers (None: none)
            records.append(
                {"prompt": p, "method": m.name, "prompt_tokens": len(ids), **run(eyas, m, ids, max_new_tokens)}
            )
            bar.update()
    bar.close()
    return records


# --- statistics ---------------------------------------------------------------------------------
def summarize(methods: list[Method], records: list[dict], eos_ids: set[int]) -> dict[str, dict]:
    by = {(r["method"], r["prompt"]): r for r in records}
    prompts = sorted({r["prompt"] for r in records})
    out = {}
    for m in methods:
        rows = [by[(m.name, p)] for p in prompts]
        tokens = sum(r["new_tokens"] for r in rows)
        wall = sum(r["wall_s"] for r in rows)
        accepts = [a for r in rows for a in r["accept_lengths"]]
        rounds = len(accepts)
        round_tokens = sum(n for r in rows for n in r["round_new_tokens"])
        for p in prompts:
            by[(m.name, p)]["identical"] = trim_after_eos(by[(m.name, p)]["token_ids"], eos_ids) == trim_after_eos(
                by[(m.baseline, p)]["token_ids"], eos_ids
            )
        same = sum(by[(m.name, p)]["identical"] for p in prompts)
        out[m.name] = {
            "tau": round_tokens / rounds if rounds else None,
            "speedup": None,  # filled in below
            "accept_by_depth": (
                [sum(a >= k for a in accepts) / rounds if rounds else 0.0 for k in range(1, m.depth + 1)]
                if m.is_speculative
                else []
            ),
            "tokens_per_s": tokens / wall if wall else 0.0,
            "identical": f"{same}/{len(prompts)}",
            "identical_count": same,
            "drafter": m.drafter,
            "trained_as": m.trained_as,
            "method": m.request["method"],
            "request": {k: v for k, v in m.request.items() if k != "method"},
            "tree": rows[0]["tree"] if rows else None,
            "new_tokens": tokens,
            "wall_s": wall,
            "rounds": rounds,
            "round_new_tokens": round_tokens,
            "target_forwards": sum(r["target_forwards"] for r in rows),
            "accept_length_mean": sum(accepts) / rounds if rounds else None,
            "prompts": len(prompts),
        }
    for m in methods:
        base = out[m.baseline]["tokens_per_s"]
        out[m.name]["speedup"] = out[m.name]["tokens_per_s"] / base if base else None
    return out


def paired_ratio(records: list[dict], a: str, b: str, draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """tok/s of method ``a`` over method ``b`` on the same prompts, with a 95 % paired-bootstrap interval
    (prompts drawn with replacement, each draw's ratio of summed tokens over summed wall time)."""
    import random

    by = {(r["method"], r["prompt"]): r for r in records}
    prompts = sorted({r["prompt"] for r in records})
    pairs = [
        ((by[(a, p)]["new_tokens"], by[(a, p)]["wall_s"]), (by[(b, p)]["new_tokens"], by[(b, p)]["wall_s"]))
        for p in prompts
    ]

    def ratio(sample):
        rate = [sum(x[i][0] for x in sample) / sum(x[i][1] for x in sample) for i in (0, 1)]
        return rate[0] / rate[1]

    rng = random.Random(seed)
    boot = sorted(ratio([rng.choice(pairs) for _ in pairs]) for _ in range(draws))
    return ratio(pairs), boot[int(0.025 * draws)], boot[int(0.975 * draws) - 1]


def hybrid_intervals(methods: list[Method], records: list[dict]) -> dict[str, dict]:
    """Each ``<method>+suffix`` against its drafter alone and suffix drafts alone (:func:`paired_ratio`)."""
    names = {m.name for m in methods}
    out = {}
    for m in methods:
        if m.name.endswith("+suffix") and m.name[: -len("+suffix")] in names and "suffix" in names:
            out[m.name] = {
                other: dict(zip(("ratio", "lo", "hi"), paired_ratio(records, m.name, other)))
                for other in (m.name[: -len("+suffix")], "suffix")
            }
    return out


def with_suffix(methods: list[Method]) -> list[Method]:
    """Suffix drafts beside the drafters (eyas.drafting.suffix): ``suffix`` (alone, no drafter) and, for
    each dynamic-tree drafter method, ``<method>+suffix`` (suffix candidates grafted into its tree)."""
    from eyas.drafting.suffix import SuffixSpec

    spec = SuffixSpec()
    out = list(methods) + [Method("suffix", {"method": "suffix"}, "suffix", None, spec.max_depth)]
    for m in methods:
        if m.is_speculative and m.request.get("tree_kind") == "dynamic":
            out.append(
                Method(
                    f"{m.name}+suffix",
                    {**m.request, "suffix_drafts": True},
                    m.drafter,
                    m.trained_as,
                    max(m.depth, spec.max_depth),
                    m.baseline,
                )
            )
    return out


def with_processors(methods: list[Method], processors: dict, tag: str = "proc") -> list[Method]:
    """Each method twice: as it is, and with the request fields ``processors`` (logits processors, a
    ``response_format``) on every request (named ``<method>+<tag>``, measured against
    ``target+<tag>``), alternating in the same run."""
    twins = [
        Method(f"{m.name}+{tag}", {**m.request, **processors}, m.drafter, m.trained_as, m.depth, f"target+{tag}")
        for m in methods
    ]
    return methods + twins


# --- output -------------------------------------------------------------------------------------
def pct(fracs: list[float], k: int) -> str:
    return f"{100 * fracs[k - 1]:.1f}%" if k <= len(fracs) else "-"


def print_table(methods: list[Method], summary: dict[str, dict]) -> None:
    head = ["method", "trained_as", "tau", "speedup", "tok/s", "identical"] + [
        f"acc@{k}" for k in range(1, TABLE_DEPTHS + 1)
    ]
    rows = []
    for m in methods:
        s = summary[m.name]
        trained = "-" if not m.is_speculative else (s["trained_as"] or m.drafter or "-")
        rows.append(
            [
                m.name,
                trained,
                "-" if s["tau"] is None else f"{s['tau']:.2f}",
                fmt_ratio(s["speedup"]),
                f"{s['tokens_per_s']:.1f}",
                "ref" if m.name == "target" else s["identical"],
            ]
            + [pct(s["accept_by_depth"], k) for k in range(1, TABLE_DEPTHS + 1)]
        )
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]

    def line(r):
        return "  ".join(c.ljust(w) if i in (0, 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    print(line(head))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print(line(r))


def print_markdown(methods: list[Method], summary: dict[str, dict]) -> None:
    print("| method | τ | speedup | " + " | ".join(f"accept@{k}" for k in range(1, MARKDOWN_DEPTHS + 1)) + " |")
    print("|---|---:|---:|" + "---:|" * MARKDOWN_DEPTHS)
    for m in methods:
        s = summary[m.name]
        tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
        cells = [pct(s["accept_by_depth"], k) for k in range(1, MARKDOWN_DEPTHS + 1)]
        print(f"| {m.name} | {tau} | {fmt_ratio(s['speedup'])} | " + " | ".join(cells) + " |")


def plot(methods: list[Method], summary: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [m.name for m in methods]
    x = range(len(names))
    taus = [summary[n]["tau"] or 0.0 for n in names]
    speed = [summary[n]["speedup"] or 0.0 for n in names]
    w = 0.4
    b1 = ax1.bar([i - w / 2 for i in x], taus, w, label="τ (tokens / target forward)", color="tab:orange")
    b2 = ax1.bar([i + w / 2 for i in x], speed, w, label="speedup vs target-only (wall clock)", color="tab:blue")
    ax1.bar_label(b1, labels=[f"{v:.2f}" for v in taus], fontsize=7)
    ax1.bar_label(b2, labels=[f"{v:.2f}" for v in speed], fontsize=7)
    ax1.axhline(1.0, color="black", lw=0.8, ls="--")
    ax1.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    ax1.set_title("τ and speedup per method (greedy)")
    ax1.legend(fontsize=8)
    for m in methods:
        fracs = summary[m.name]["accept_by_depth"]
        if fracs:
            ax2.plot(
                range(1, len(fracs) + 1),
                [100 * f for f in fracs],
                marker="o",
                ls="--" if m.request.get("tree_kind") == "chain" else "-",
                label=m.name,
            )
    depth = max((len(summary[m.name]["accept_by_depth"]) for m in methods), default=0)
    ax2.set_xticks(list(range(1, depth + 1)))
    ax2.set_xlabel("depth k")
    ax2.set_ylabel("% of rounds accepting >= k drafted tokens")
    ax2.set_ylim(0, 100)
    ax2.set_title("acceptance by depth")
    if ax2.lines:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main -----------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", help='a .jsonl file, one {"prompt": ...} per line (default: MT-bench first turns)')
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype at precision fp32 (target and drafters)",
    )
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (precision fp32; target and drafters)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: EYAS_THREADS or all cores)")
    p.add_argument("--json", help="write every number to this .json file")
    p.add_argument("--plot", help="the plot's .png (default: next to --json, else bench/out/acceptance.png)")
    p.add_argument("--tree-width", type=int, help="dynamic tree: nodes expanded per depth (default: the manifest's)")
    p.add_argument("--tree-depth", type=int, help="dynamic tree and chain depth (default: the manifest's)")
    p.add_argument("--tree-budget", type=int, help="dynamic tree: candidate rows verified (default: the manifest's)")
    p.add_argument("--tree-min-value", type=float, help="dynamic tree: a verified node's path-value floor")
    p.add_argument("--tree-expand-min-value", type=float, help="dynamic tree: an expanded node's path-value floor")
    p.add_argument(
        "--trees",
        help="dynamic trees width/depth/budget[@min_value/expand_min_value] or default, comma-separated "
        "(e.g. default,2/2/4,3/4/4@0.06/0.45): each drafter runs on each, against one target-only baseline",
    )
    p.add_argument(
        "--suffix",
        action="store_true",
        help="also suffix drafts alone (method suffix) and grafted into each drafter's tree (<method>+suffix)",
    )
    p.add_argument(
        "--shared-suffix",
        type=int,
        default=0,
        metavar="TOKENS",
        help="suffix drafts may also copy each method's own earlier answers (a cache of this many tokens, as a "
        "serving loop keeps); 0: each request's own history only",
    )
    p.add_argument(
        "--processors",
        help="logits processors as JSON, e.g. '{\"frequency_penalty\": 0.5}': every method runs with and without "
        "them in the same run (the twins named <method>+proc, against target+proc)",
    )
    p.add_argument(
        "--json-schema",
        help="structured output: a JSON schema (JSON text or @FILE) every twin request answers in "
        "(response_format json_schema; the twins named <method>+json, against target+json)",
    )
    p.add_argument("--drafters", help="the folder of drafter folders to bench (default: the repository's drafters/)")
    p.add_argument(
        "--methods",
        help="comma-separated method names to run (default: all; target always runs), "
        "e.g. smollm2-135m-eagle3,smollm2-135m-eagle1-chain",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if placement_refused(args.device, args.dtype, args.precision):
        return 2
    try:
        trees = parse_trees(args.trees)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    set_threads(args.threads)
    prompts = load_prompts(args.prompts, args.limit)
    tree_overrides = {
        k: v
        for k, v in (
            ("tree_width", args.tree_width),
            ("tree_depth", args.tree_depth),
            ("tree_budget", args.tree_budget),
            ("tree_min_value", args.tree_min_value),
            ("tree_expand_min_value", args.tree_expand_min_value),
        )
        if v is not None
    }

    print(f"loading the target ({args.precision}) and the drafters ...", file=sys.stderr, flush=True)
    eyas = Eyas(precision=args.precision, dtype=args.dtype, device=args.device)
    from eyas.target.loader import encode_messages

    prompt_ids = [eyas.encode(p) if isinstance(p, str) else encode_messages(eyas.tokenizer, p) for p in prompts]
    eos_ids = set(eyas.cfg.eos_token_ids) | {eyas.tokenizer.eos_token_id}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="no trained .* drafter")  # reported as "random-init"
        methods, notes = build_methods(
            eyas, tree_overrides, Path(args.drafters) if args.drafters else REPO_DRAFTERS, trees
        )
        if args.methods:
            wanted = {n.strip() for n in args.methods.split(",") if n.strip()}
            unknown = wanted - {m.name for m in methods}
            if unknown:
                print(
                    f"error: --methods: unknown {sorted(unknown)}; available {[m.name for m in methods]}",
                    file=sys.stderr,
                )
                return 2
            methods = [m for m in methods if m.name == "target" or m.name in wanted]
        if args.suffix:
            methods = with_suffix(methods)
        extra, tags = {}, []
        if args.processors:
            extra.update(json.loads(args.processors))
            tags.append("proc")
        if args.json_schema:
            text = Path(args.json_schema[1:]).read_text() if args.json_schema.startswith("@") else args.json_schema
            extra["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "bench", "schema": json.loads(text)},
            }
            tags.append("json")
        if extra:
            methods = with_processors(methods, extra, "+".join(tags))
        records = bench(eyas, methods, prompt_ids, args.max_new_tokens, args.shared_suffix)
    summary = summarize(methods, records, eos_ids)

    print(
        f"\n{len(prompts)} prompts, max_new_tokens={args.max_new_tokens}, greedy, {args.precision}, "
        f"{torch.get_num_threads()} torch threads; speedup = tok/s / target-only tok/s in this same run\n"
    )
    print_table(methods, summary)
    for m in methods:
        if m.is_speculative and not m.name.endswith("-chain"):
            tree = summary[m.name]["tree"]
            print(
                f"  {m.name}: drafter {m.drafter}; tree {tree['kind']} width {tree['expand_width']} "
                f"depth {tree['max_depth']} budget {tree['verify_budget']} value floors "
                f"{tree.get('min_value', 0):g}/{tree.get('expand_min_value', 0):g}"
            )
    intervals = hybrid_intervals(methods, records)
    for name, against in intervals.items():
        print(
            f"  {name} tok/s over "
            + ", ".join(f"{o}'s: {v['ratio']:.3f}x [{v['lo']:.3f}, {v['hi']:.3f}]" for o, v in against.items())
            + " (95 % paired bootstrap over prompts)"
        )
    gates = {f"{method}:{drafter or 'default'}": g.stats() for (method, drafter), g in eyas.drafter_gates.items()}
    for name, stats in gates.items():
        print(f"  drafter gate {name}: {stats}")
    for note in notes:
        print(f"note: {note}")
    if any(m.drafter == "random-init" for m in methods):
        print(
            "note: no trained drafter under drafters/ yet: the random-init drafters are untrained, so their "
            "tau, acceptance and speed say nothing about a trained one"
        )
    print("\nMarkdown:\n")
    print_markdown(methods, summary)

    config = {
        "prompts": args.prompts or "mt-bench first turns",
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "precision": args.precision,
        "dtype": args.dtype,
        "device": args.device,
        "greedy": True,
        "processors": json.loads(args.processors) if args.processors else None,
        "json_schema": args.json_schema,
        "suffix": args.suffix,
        "shared_suffix": args.shared_suffix,
        "threads": torch.get_num_threads(),
        "tree_overrides": tree_overrides or None,
        "trees": args.trees,
        "warmup_new_tokens": WARMUP_NEW_TOKENS,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "order": [m.name for m in methods],
    }
    written = []
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "methods": summary,
                    "hybrid_intervals": intervals,
                    "drafter_gates": gates,
                    "config": config,
                    "notes": notes,
                    "records": records,
                },
                indent=1,
            )
        )
        written.append(str(out))
    plot_path = Path(args.plot) if args.plot else (Path(args.json).with_suffix(".png") if args.json else DEFAULT_PLOT)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(methods, summary, plot_path)
    written.append(str(plot_path))

    spec = [m for m in methods if m.is_speculative]
    exact = all(summary[m.name]["identical_count"] == len(prompts) for m in methods)
    if spec:
        best_tau = max(spec, key=lambda m: summary[m.name]["tau"] or 0.0)
        best_speed = max(spec, key=lambda m: summary[m.name]["speedup"] or 0.0)
        bt, bs = summary[best_tau.name], summary[best_speed.name]
        head = (
            f"highest tau {best_tau.name} ({bt['trained_as'] or best_tau.drafter}) "
            f"{bt['tau'] or 0:.2f} (accept@1 {pct(bt['accept_by_depth'], 1)}); fastest {best_speed.name} "
            f"{bs['tokens_per_s']:.1f} tok/s = {fmt_ratio(bs['speedup'])} target-only "
            f"({summary['target']['tokens_per_s']:.1f} tok/s)"
        )
    else:
        head = "no drafter could be loaded: target-only only"
    print(
        f"\nsummary: {len(prompts)} prompts, {head}; greedy outputs "
        f"{'all identical to' if exact else 'NOT all identical to'} target-only; wrote {', '.join(written)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
