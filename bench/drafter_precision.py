"""The drafter's block type beside a ``gguf`` target: τ and speed of EAGLE-3 with its linears as Q8_0,
Q4_1 or Q4_0 blocks, against target-only, in one process.

A drafter's precision moves acceptance only, never an output (the target verifies every token); what it
buys is bytes: a drafter step reads its layer and its head from DRAM every round (the target's pass
evicts them), so fewer bytes a weight is a cheaper step. Each prompt runs every arm (target-only, then
one EAGLE-3 drafter per block type, built from the same shipped checkpoint), the order rotated per
prompt; greedy, so every arm's output must equal target-only's.

    .venv/bin/python bench/drafter_precision.py --limit 80 --qtypes Q8_0 Q4_1 Q4_0 --threads 2

Prints tok/s, its ratio to target-only, τ, drafting ms a round and the identical count per arm; writes
``--json`` (default ``bench/results/drafter_precision.json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas import kernels  # noqa: E402
from eyas.protocol.schema import parse_request  # noqa: E402
from eyas.runtime import Eyas, make_drafter, set_threads  # noqa: E402
from eyas.target import quantized  # noqa: E402
from eyas.training.data import mtbench_questions  # noqa: E402

QTYPES = {"Q8_0": quantized.Q8_0, "Q4_1": quantized.Q4_1, "Q4_0": quantized.Q4_0}


def drafter_with(eyas: Eyas, qtype: int):
    """The shipped EAGLE-3 drafter as ``make_drafter`` builds it at gguf, its linears as ``qtype`` blocks."""
    original = quantized.quantize_linears
    quantized.quantize_linears = lambda module, _=None: original(module, qtype)
    try:
        return make_drafter(
            "eagle3", None, eyas.cfg, eyas.loaded.fingerprint, eyas.model.embed, eyas.model.lm_head, "gguf"
        )
    finally:
        quantized.quantize_linears = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=80, help="MT-bench first turns")
    ap.add_argument("--qtypes", nargs="+", choices=list(QTYPES), default=["Q8_0", "Q4_1", "Q4_0"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "drafter_precision.json")
    args = ap.parse_args()
    set_threads(args.threads)
    eyas = Eyas(precision="gguf")
    prompts = [eyas.encode(q["turns"][0]) for q in mtbench_questions()[: args.limit]]
    handles = {name: drafter_with(eyas, QTYPES[name]) for name in args.qtypes}
    arms = ["target", *args.qtypes]
    totals = {a: {"tokens": 0, "rounds": 0, "wall_s": 0.0, "draft_s": 0.0, "identical": 0} for a in arms}
    for i, ids in enumerate(prompts):
        outputs = {}
        for a in arms[i % len(arms) :] + arms[: i % len(arms)]:
            if a == "target":
                req = parse_request(prompt_ids=ids, max_new_tokens=args.max_new_tokens, method="target")
            else:
                eyas._drafters[("eagle3", None)] = handles[a]
                req = parse_request(prompt_ids=ids, max_new_tokens=args.max_new_tokens, method="eagle3")
            t0 = time.perf_counter()
            result, _ = eyas.generate(req)
            wall = time.perf_counter() - t0
            t = totals[a]
            t["tokens"] += len(result.token_ids)
            t["rounds"] += len(result.rounds)
            t["wall_s"] += wall
            t["draft_s"] += sum(r.draft_s for r in result.rounds)
            outputs[a] = result.token_ids
        for a in arms:
            totals[a]["identical"] += outputs[a] == outputs["target"]
        print(f"  prompt {i + 1}/{len(prompts)}", end="\r", file=sys.stderr, flush=True)
    base = totals["target"]["tokens"] / totals["target"]["wall_s"]
    flags = " ".join(f for f in kernels.cpu_flags() if f.startswith(("avx2", "avx512", "avx_vnni", "fma")))
    print(
        f"\n{platform.processor() or platform.machine()}, {args.threads} threads, flags {flags}; {len(prompts)} prompts"
    )
    print(f"{'arm':8} {'tok/s':>8} {'x target':>9} {'tau':>7} {'draft ms/round':>15} {'identical':>10}")
    rows = {}
    for a in arms:
        t = totals[a]
        rows[a] = {
            **t,
            "tok_s": t["tokens"] / t["wall_s"],
            "speedup": t["tokens"] / t["wall_s"] / base,
            "tau": t["tokens"] / t["rounds"],
            "draft_ms_per_round": 1000 * t["draft_s"] / t["rounds"],
        }
        r = rows[a]
        print(
            f"{a:8} {r['tok_s']:8.1f} {r['speedup']:8.3f}x {r['tau']:7.4f} {r['draft_ms_per_round']:15.3f} "
            f"{t['identical']:>5}/{len(prompts)}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"prompts": len(prompts), "threads": args.threads, "flags": flags, "arms": rows}, indent=1)
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
