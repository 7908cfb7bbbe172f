"""What capturing served traffic for the online learner costs a target replica (docs/benchmarks.md,
"Online learning").

The same greedy EAGLE-3 requests through the serving round loop over in-process workers, twice per
prompt, alternating: a target worker without capture, and one with capture on (every forward also
taps the LM-head input; every learning session keeps its committed rows' features and becomes a
sample when it closes). Prints tok/s of each arm, their ratio, the ms a round of each, and the bytes
a captured token takes.

    .venv/bin/python bench/capture_cost.py --limit 12 --precision gguf
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    from eyas import kernels
    from eyas.experiments.learn import Served
    from eyas.training.data import mtbench_questions

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=12, help="MT-bench first turns")
    ap.add_argument("--precision", default="gguf", choices=["fp32", "fp16w", "gguf"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", default="bench/results/capture_cost.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = [q["turns"][0] for q in mtbench_questions()][: args.limit]
    on = Served("smollm2-135m", args.precision, args.threads, args.max_new_tokens, capture=True)
    off = Served("smollm2-135m", args.precision, args.threads, args.max_new_tokens, capture=False)
    on.run(prompts[:2], learn=True), off.run(prompts[:2], learn=True)  # warm-up
    on.target.take_captured()
    arms = {"capture off": [], "capture on": []}
    for p in prompts:
        for name, served in (("capture off", off), ("capture on", on)):
            arms[name].append(served.run([p], learn=True))
    samples = on.target.take_captured()
    tokens = sum(int(s.input_ids.numel()) for s in samples)
    nbytes = sum(s.features.numel() * 2 + s.input_ids.numel() * 9 for s in samples)
    rows = []
    for name, runs in arms.items():
        t = sum(r["tokens"] for r in runs)
        s = sum(r["seconds"] for r in runs)
        f = sum(r["forwards"] for r in runs)
        rows.append({"arm": name, "tokens": t, "seconds": round(s, 2), "tok_s": t / s, "ms_per_round": 1000 * s / f})
    ratio = rows[1]["tok_s"] / rows[0]["tok_s"]
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f in kernels.cpu_flags()]
    print(
        f"{platform.processor() or platform.machine()}, flags {' '.join(flags)}, {args.threads} threads, {args.precision}"
    )
    print(f"{'arm':<14}{'tokens':>8}{'s':>8}{'tok/s':>8}{'ms/round':>10}")
    for r in rows:
        print(f"{r['arm']:<14}{r['tokens']:>8}{r['seconds']:>8}{r['tok_s']:>8.1f}{r['ms_per_round']:>10.2f}")
    print(
        f"capture on / off: {ratio:.3f}x; {len(samples)} samples, {tokens} tokens, {nbytes / max(tokens, 1):.0f} bytes a token"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "rows": rows,
                "ratio": ratio,
                "bytes_per_token": nbytes / max(tokens, 1),
                "flags": flags,
                "precision": args.precision,
                "threads": args.threads,
                "time": time.strftime("%Y-%m-%d %H:%M"),
            },
            indent=1,
        )
    )
    on.close(), off.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
