"""The online learner offline: what a learner config gains on served code and loses on chat, per step,
with no serving beside it (the model to check before an hour of ``eyas experiment learn``).

Stages:

    capture  serves prompts through the serving round loop at ``--precision`` with capture on (what a
             target replica keeps for the learner) and saves the captured samples: ``--train`` wheel
             stubs (the experiment's traffic, ``eyas.experiments.learn.wheel_stub_prompts``), the 48
             stubs the experiment holds out, 41 HumanEval prompts (the ``learn`` extra) and all 80
             MT-bench first turns
    train    an ``OnlineLearner`` (the learner's own code: replay, warmup, decay branches) on the
             captured stubs; every ``--every`` steps the mean chain estimate (``eyas.learning.learner``)
             of the candidate as it is (stable) and after its decay branch (what a verdict judges), on
             the held-out stubs, HumanEval, MT-bench and the replay window

A chain estimate is not τ (a tree drafts more than a chain): it is the guard's measure, cheap and
paired; the experiment measures τ.

Run:
    .venv/bin/python bench/online_study.py capture --out /tmp/cap --train 400
    .venv/bin/python bench/online_study.py train --cap /tmp/cap --steps 160 --tag base --warmup 0 --decay 0
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def capture(args) -> None:
    from eyas.experiments.learn import Served, traffic_split
    from eyas.training.data import mtbench_questions

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stub_held, stub_traffic = traffic_split("stubs")  # the experiment's own split
    groups = {"stub_held": stub_held, "mt": [q["turns"][0] for q in mtbench_questions()]}
    try:
        groups["he_held"] = traffic_split("humaneval")[0]
    except ValueError:
        print("HumanEval is not installed (the learn extra): skipped")
    groups["stub_train"] = stub_traffic[: args.train]
    served = Served(args.target, args.precision, args.threads, args.max_new_tokens)
    try:
        for name, prompts in groups.items():
            t0, samples, tokens, forwards = time.perf_counter(), [], 0, 0
            for i in range(0, len(prompts), 10):  # the capture buffer is bounded in bytes: take it often
                r = served.run(prompts[i : i + 10], learn=True)
                samples += served.target.take_captured()
                tokens, forwards = tokens + r["tokens"], forwards + r["forwards"]
            torch.save(samples, out / f"{name}.pt")
            print(
                f"{name}: {len(prompts)} prompts, {len(samples)} samples, τ {tokens / max(forwards, 1):.3f}, "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    finally:
        served.close()


def train(args) -> None:
    from dataclasses import asdict

    from eyas.learning.learner import LearnConfig, OnlineLearner
    from eyas.learning.loop import replay_sets
    from eyas.runtime import DEFAULT_DRAFTER_DIRS, REPO_DRAFTERS
    from eyas.target.loader import load_target

    torch.set_num_threads(args.threads)
    loaded = load_target(args.target)
    model = loaded.model.requires_grad_(False)
    config = LearnConfig(
        lr=args.lr,
        replay_fraction=args.replay_fraction,
        warmup_steps=args.warmup,
        decay_steps=args.decay,
        dtype=args.dtype,
        batch_samples=args.batch,
    )
    learner = OnlineLearner(
        model,
        asdict(loaded.fingerprint),
        REPO_DRAFTERS / DEFAULT_DRAFTER_DIRS["eagle3"],
        Path(args.cap) / "study" / args.tag,
        config,
        *replay_sets(args.target, model, config, args.replay),
    )
    sets = {
        p.stem: torch.load(p, weights_only=False) for p in sorted(Path(args.cap).glob("*.pt")) if p.stem != "stub_train"
    }
    sets["replay_window"] = learner.replay_window
    learner.pool = list(torch.load(Path(args.cap) / "stub_train.pt", weights_only=False))

    def mean(state, samples) -> float:
        return sum(learner.chain_estimates(state, samples)) / len(samples)

    rows, t0 = [], time.perf_counter()
    while True:
        decayed = learner.decayed()
        row = {"step": learner.stats.steps, "train_s": round(time.perf_counter() - t0, 1)}
        row.update({f"stable_{k}": mean(None, v) for k, v in sets.items() if k in ("stub_held", "mt")})
        row.update({f"judged_{k}": mean(decayed, v) for k, v in sets.items()})
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if learner.stats.steps >= args.steps:
            break
        learner.train(args.every)
    first = rows[0]
    print(f"\n{'step':>5} " + " ".join(f"{k.removeprefix('judged_'):>14}" for k in first if k.startswith("judged_")))
    for row in rows:
        print(f"{row['step']:>5} " + " ".join(f"{row[k] - first[k]:>+14.3f}" for k in first if k.startswith("judged_")))
    print("(the judged candidate's mean chain estimate minus the shipped drafter's after its own decay branch)")
    out = Path(args.json or ROOT / "bench" / "results" / "learn" / f"study-{args.tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "config": asdict(config), "rows": rows}, indent=1))
    print(f"wrote {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="stage", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--out", required=True)
    c.add_argument("--train", type=int, default=400, help="wheel stubs to serve for the learner's pool")
    c.add_argument("--precision", default="gguf")
    c.add_argument("--max-new-tokens", type=int, default=128)
    t = sub.add_parser("train")
    t.add_argument("--cap", required=True, help="the capture stage's --out")
    t.add_argument("--steps", type=int, default=160)
    t.add_argument("--every", type=int, default=40)
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--warmup", type=int, default=40)
    t.add_argument("--decay", type=int, default=10)
    t.add_argument("--replay", type=int, default=1024)
    t.add_argument("--replay-fraction", type=float, default=0.5)
    t.add_argument("--batch", type=int, default=4)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--tag", default="default")
    t.add_argument("--json")
    for p in (c, t):
        p.add_argument("--target", default="smollm2-135m")
        p.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    capture(args) if args.stage == "capture" else train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
