"""fp16w with Eyas's CPU kernels (``eyas/kernels``) against fp16w on fbgemm and PyTorch's attention,
on the real default target, in ONE process.

It loads the default target twice at ``fp16w`` -- once with the kernels (the default where they
run), once without (``eyas.kernels.prefer(False)``: fbgemm's fp16 GEMM and PyTorch's fused
attention) -- each with the shipped EAGLE-3 drafter, and:

- measures both verify latency curves: ms of a verify of R rows (the frontier and R-1 candidates)
  after a 300-token context, the median of 6 verifies in each of ``--repeats`` sessions;
- runs target-only and EAGLE-3 (the drafter's default tree at fp16w) on MT-bench first turns, all
  four arms interleaved per prompt in a rotating order, and prints tokens/s against fbgemm's
  target-only, against each build's own target-only, τ, and whether each speculative output equals
  its own target-only output (greedy identity), and whether the two target-only outputs agree.

    .venv/bin/python bench/cpu_kernels.py --limit 20 --threads 2 --json bench/results/cpu_kernels.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from eyas import kernels
from eyas.protocol.messages import AcceptDecision
from eyas.protocol.schema import parse_request
from eyas.protocol.tree import DraftTree
from eyas.runtime import Eyas, set_threads
from eyas.training.data import mtbench_questions


def verify_curve(eyas: Eyas, taps, rows: tuple[int, ...], prefix: int = 300, repeats: int = 3) -> dict[int, float]:
    """ms of one verify of R rows (a chain) after a ``prefix``-token committed context, per R."""
    engine = eyas.target_engine(taps)
    ids = [(7 * i + 3) % eyas.cfg.vocab_size for i in range(prefix)]
    out: dict[int, list[float]] = {}
    for _ in range(repeats):
        for r in rows:
            engine.open_session("curve", ids, 20, r)
            try:
                v = engine.prefill("curve")
                engine.publish("curve", v.round, AcceptDecision(torch.arange(prefix), torch.tensor(ids[1:]), 1))
                tree = DraftTree.chain([2] * (r - 1))
                times = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    v = engine.verify("curve", tree)
                    times.append(1000 * (time.perf_counter() - t0))
                    frontier_only = AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 5)
                    engine.publish("curve", v.round, frontier_only)
                out.setdefault(r, []).append(statistics.median(times))
            finally:
                engine.close_session("curve")
    return {r: statistics.median(v) for r, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=20, help="MT-bench first turns")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7, 9])
    p.add_argument("--repeats", type=int, default=3, help="sessions per point of the verify curves")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    if kernels.load() is None:
        print(f"error: Eyas's CPU kernels do not run here: {kernels.why_not()}", file=sys.stderr)
        return 2
    set_threads(args.threads)
    kernels.prefer(False)
    fbgemm = Eyas(precision="fp16w")
    fbgemm.drafter("eagle3")
    kernels.prefer(True)
    eyas = Eyas(precision="fp16w")
    taps = eyas.drafter("eagle3").taps
    builds = {"fbgemm": fbgemm, "kernels": eyas}
    curves = {name: verify_curve(e, taps, tuple(args.rows), repeats=args.repeats) for name, e in builds.items()}
    prompts = [q["turns"][0] for q in mtbench_questions()][: args.limit]
    arms = [(name, e, m) for name, e in builds.items() for m in ("target", "eagle3")]
    for _name, e, m in arms:  # warm-up, not timed
        e.generate(parse_request(prompt=prompts[0], method=m, max_new_tokens=4))
    records: dict[str, list[tuple[list[int], float, int]]] = {f"{n}/{m}": [] for n, _, m in arms}
    for i, prompt in enumerate(prompts):
        for name, e, m in arms[i % len(arms) :] + arms[: i % len(arms)]:
            t0 = time.perf_counter()
            r, _ = e.generate(parse_request(prompt=prompt, method=m, max_new_tokens=args.max_new_tokens))
            records[f"{name}/{m}"].append((r.token_ids, time.perf_counter() - t0, len(r.rounds)))

    def rate(rs):
        return sum(len(t) for t, _, _ in rs) / sum(w for _, w, _ in rs)

    base = rate(records["fbgemm/target"])
    print(
        f"\n{len(prompts)} MT-bench first turns, {args.max_new_tokens} tokens, greedy, fp16w, {torch.get_num_threads()} threads\n"
    )
    print(f"{'arm':<15} {'tok/s':>6} {'vs fbgemm target':>16} {'vs own target':>13} {'tau':>5} {'= own target':>12}")
    summary = {}
    for key, rs in records.items():
        own = records[key.split("/")[0] + "/target"]
        tau = sum(len(t) for t, _, _ in rs) / sum(n for _, _, n in rs)
        same = sum(a == b for (a, _, _), (b, _, _) in zip(rs, own))
        summary[key] = dict(
            tok_s=rate(rs),
            vs_fbgemm_target=rate(rs) / base,
            vs_own_target=rate(rs) / rate(own),
            tau=tau,
            identical=same,
        )
        print(
            f"{key:<15} {rate(rs):>6.1f} {rate(rs) / base:>15.2f}x {rate(rs) / rate(own):>12.2f}x {tau:>5.2f} {same:>8}/{len(rs)}"
        )
    agree = sum(a == b for (a, _, _), (b, _, _) in zip(records["kernels/target"], records["fbgemm/target"]))
    print(f"target-only outputs of the two builds agree on {agree}/{len(prompts)} prompts")
    print("\nverify ms after a 300-token context (x the same build's 1 row):")
    for name, c in curves.items():
        print(f"  {name:<8}" + "  ".join(f"{r}: {ms:.1f} ({ms / c[min(c)]:.2f})" for r, ms in c.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"config": vars(args), "summary": summary, "curves": curves, "targets_agree": agree}, indent=1)
        )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
