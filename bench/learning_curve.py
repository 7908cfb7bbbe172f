"""The EAGLE-3 learning curve: held-out top-1 and MT-bench tau against supervised training tokens.

Each point is a training config under ``configs/curve/`` (one recipe; only the data size differs:
the first N of the target's own answers in ``data/regen``, every point reading one feature cache).

Stages:

    train    trains every point that has not exported a drafter yet, smallest first; each is
             ``eyas train --config ...`` and resumes from its own trainer_state.pt when stopped
    report   benches every finished point (and the shipped drafters/smollm2-135m-eagle3 as a
             reference) in ONE ``bench/acceptance.py`` run, so one target-only baseline serves all;
             prints the table and the extrapolation; writes bench/results/learning_curve.{json,png}

Terms:

    supervised tokens   answer tokens with a loss (the loss mask), per epoch
    top-1 @s            held-out top-1 of training-time-test step s (step 1 = the first drafted token)
    tau                 tokens per target forward on MT-bench first turns (bench/acceptance.py)

Extrapolation: a least-squares line of tau on log2(supervised tokens) over the points, solved for
the goal tau; the CPU hours to reach it at the stage throughputs (regeneration, feature extraction,
training) measured by the runs. A straight line in log-data is an assumption: the points say how
well it holds (the residuals are printed).

Run:
    nice -n 10 .venv/bin/python bench/learning_curve.py train --threads 1
    .venv/bin/python bench/learning_curve.py report --limit 20 --max-new-tokens 64 --precision fp16w
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs" / "curve"
RESULTS = REPO / "bench" / "results"
REFERENCE_DRAFTER = REPO / "drafters" / "smollm2-135m-eagle3"
GOAL_TAU = 2.5
# Measured stage throughputs on the 2-core CPU (docs/benchmarks.md), used unless given:
REGEN_TOK_S = 80.0       # the target's own answers, HF generate over batches of 64, one thread (56-106)
FEATURE_TOK_S = 454.0    # frozen-target feature extraction (every token of a sample)


def points(folder: Path = CONFIGS) -> list[dict]:
    """The curve's configs, smallest first: {"config", "out", "train_samples", "finished"}."""
    from eyas.training.config import load_config

    out = []
    for path in sorted(folder.glob("*.yaml")):
        cfg = load_config(path)
        run = REPO / cfg.out
        out.append({"config": path, "out": run, "train_samples": cfg.data.train_samples, "epochs": cfg.epochs,
                    "finished": (run / "manifest.json").exists() and (run / "model.safetensors").exists()})
    return sorted(out, key=lambda p: p["train_samples"])


def cmd_train(args) -> int:
    todo = [p for p in points() if not p["finished"]]
    print(f"learning curve: {len(points()) - len(todo)} points finished, {len(todo)} to train", flush=True)
    for i, p in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {p['config'].relative_to(REPO)} -> {p['out'].relative_to(REPO)}", flush=True)
        cmd = [sys.executable, "-m", "eyas.cli", "train", "--config", str(p["config"])]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            print(f"error: training {p['config'].name} failed; rerun to resume it", file=sys.stderr)
            return 1
    print("learning curve: every point trained; next: bench/learning_curve.py report")
    return 0


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a * x + b."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return a, my - a * mx


def extrapolate(rows: list[dict], goal: float, regen_tok_s: float, feature_tok_s: float) -> dict:
    """tau = a * log2(supervised tokens) + b over the points; the tokens and CPU hours for ``goal``."""
    xs = [math.log2(r["supervised_tokens"]) for r in rows]
    a, b = fit_line(xs, [r["tau"] for r in rows])
    residuals = [r["tau"] - (a * x + b) for r, x in zip(rows, xs)]
    out = {"tau_per_doubling": a, "intercept": b, "residuals": residuals, "goal_tau": goal}
    if a <= 0:
        out.update(supervised_tokens_for_goal=None, cpu_hours_for_goal=None)
        return out
    need = 2 ** ((goal - b) / a)
    last = rows[-1]
    all_per_supervised = last["train_tokens"] / last["supervised_tokens"]   # prompt + template tokens too
    train_tok_s = last["supervised_tokens"] * last["epochs"] / last["train_wall_s"]
    hours = {"regenerate": need / regen_tok_s / 3600,
             "features": need * all_per_supervised / feature_tok_s / 3600,
             "train": need * last["epochs"] / train_tok_s / 3600}
    out.update(supervised_tokens_for_goal=need, doublings_past_last=math.log2(need / last["supervised_tokens"]),
               cpu_hours_for_goal=hours, train_supervised_tok_s=train_tok_s)
    return out


def cmd_report(args) -> int:
    finished = [p for p in points() if p["finished"]]
    if len(finished) < 2:
        print(f"error: {len(finished)} finished points; train them first (bench/learning_curve.py train)",
              file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    acceptance_json = RESULTS / "learning_curve-acceptance.json"
    with tempfile.TemporaryDirectory() as tmp:
        names = []
        for p in finished:
            (Path(tmp) / p["out"].name).symlink_to(p["out"])
            names.append(p["out"].name)
        if REFERENCE_DRAFTER.exists():
            (Path(tmp) / REFERENCE_DRAFTER.name).symlink_to(REFERENCE_DRAFTER)
        cmd = [sys.executable, str(REPO / "bench" / "acceptance.py"), "--drafters", tmp, "--precision", args.precision,
               "--max-new-tokens", str(args.max_new_tokens), "--json", str(acceptance_json)]
        cmd += ["--limit", str(args.limit)] if args.limit else []
        cmd += ["--threads", str(args.threads)] if args.threads else []
        if subprocess.run(cmd, cwd=REPO).returncode != 0:
            print("error: the acceptance run failed", file=sys.stderr)
            return 1
    bench = json.loads(acceptance_json.read_text())
    rows = []
    for p in finished:
        recipe = json.loads((p["out"] / "manifest.json").read_text())["recipe"]
        m = bench["methods"][p["out"].name]
        rows.append({"name": p["out"].name, "train_samples": recipe["train_samples"],
                     "supervised_tokens": recipe["train_supervised_tokens"], "train_tokens": recipe["train_tokens"],
                     "epochs": recipe["epochs"], "steps": recipe["steps"], "train_wall_s": recipe["wall_s"],
                     "heldout_top1": recipe["heldout"]["top1"], "heldout_top3": recipe["heldout"]["top3"],
                     "tau": m["tau"], "speedup": m["speedup"], "identical": m["identical"]})
    reference = bench["methods"].get(REFERENCE_DRAFTER.name)
    fit = extrapolate(rows, args.goal, args.regen_tok_s, args.feature_tok_s)
    print_report(rows, reference, fit, bench["config"])
    out = RESULTS / "learning_curve.json"
    out.write_text(json.dumps({"points": rows, "reference": reference and {k: reference[k] for k in
                                                                          ("tau", "speedup", "identical")},
                               "fit": fit, "bench": bench["config"],
                               "stage_tok_s": {"regenerate": args.regen_tok_s, "features": args.feature_tok_s}},
                              indent=1))
    plot(rows, reference, fit, RESULTS / "learning_curve.png")
    print(f"wrote {out.relative_to(REPO)}, bench/results/learning_curve.png, {acceptance_json.relative_to(REPO)}")
    return 0


def print_report(rows: list[dict], reference: dict | None, fit: dict, bench: dict) -> None:
    steps = len(rows[0]["heldout_top1"])
    print(f"\nEAGLE-3 learning curve: {bench['num_prompts']} MT-bench first turns, {bench['max_new_tokens']} new "
          f"tokens, greedy, {bench['precision']}; speedup against target-only in the same run\n")
    head = f"{'point':<12} {'samples':>7} {'sup. tokens':>11} {'steps':>5} " + " ".join(
        f"{'top1@' + str(s + 1):>7}" for s in range(steps)) + f" {'tau':>5} {'speedup':>7} {'identical':>9}"
    print(head)
    for r in rows:
        print(f"{r['name']:<12} {r['train_samples']:>7} {r['supervised_tokens']:>11,} {r['steps']:>5} "
              + " ".join(f"{x:>7.3f}" for x in r["heldout_top1"])
              + f" {r['tau']:>5.2f} {r['speedup']:>6.2f}x {r['identical']:>9}")
    if reference:
        print(f"{'shipped':<12} (drafters/{REFERENCE_DRAFTER.name}, another recipe) tau {reference['tau']:.2f}, "
              f"{reference['speedup']:.2f}x")
    print(f"\nfit: tau = {fit['tau_per_doubling']:.3f} * log2(supervised tokens) + {fit['intercept']:.2f}; "
          f"residuals {[round(x, 3) for x in fit['residuals']]}")
    if fit.get("supervised_tokens_for_goal"):
        h = fit["cpu_hours_for_goal"]
        print(f"tau {fit['goal_tau']} needs about {fit['supervised_tokens_for_goal']:,.0f} supervised tokens "
              f"({fit['doublings_past_last']:.1f} doublings past the largest point): CPU hours at the measured "
              f"rates: regenerate {h['regenerate']:.0f}, features {h['features']:.0f}, train {h['train']:.0f} "
              f"(total {sum(h.values()):.0f})")
    else:
        print(f"tau does not rise with data over these points: no data size reaches {fit['goal_tau']}")


def plot(rows: list[dict], reference: dict | None, fit: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r["supervised_tokens"] for r in rows]
    for s in range(len(rows[0]["heldout_top1"])):
        ax1.plot(xs, [r["heldout_top1"][s] for r in rows], "o-", label=f"TTT step {s + 1}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("supervised tokens (per epoch)")
    ax1.set_ylabel("held-out top-1")
    ax1.set_title("held-out top-1 by training-time-test step")
    ax1.legend()
    ax2.plot(xs, [r["tau"] for r in rows], "o", label="points")
    if fit["tau_per_doubling"] > 0:
        end = max(fit.get("supervised_tokens_for_goal") or xs[-1], xs[-1])
        line_x = [xs[0], end]
        ax2.plot(line_x, [fit["tau_per_doubling"] * math.log2(x) + fit["intercept"] for x in line_x], "--",
                 label=f"fit: {fit['tau_per_doubling']:.3f} per doubling")
    ax2.axhline(fit["goal_tau"], color="grey", linestyle=":", label=f"goal tau {fit['goal_tau']}")
    if reference:
        ax2.axhline(reference["tau"], color="tab:red", linestyle="-.", alpha=0.6, label="shipped drafter")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("supervised tokens (per epoch)")
    ax2.set_ylabel("tau on MT-bench")
    ax2.set_title("tau (greedy) against data")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("train", help="train every unfinished point (resumable)")
    t.add_argument("--threads", type=int, help="torch CPU threads per training run (default: the config's)")
    r = sub.add_parser("report", help="bench the finished points in one run; table, fit, plot")
    r.add_argument("--limit", type=int, default=20, help="MT-bench first turns (default 20; 0 = all 80)")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--precision", default="fp16w")
    r.add_argument("--threads", type=int)
    r.add_argument("--goal", type=float, default=GOAL_TAU)
    r.add_argument("--regen-tok-s", type=float, default=REGEN_TOK_S, help="regeneration tokens/s for the costing")
    r.add_argument("--feature-tok-s", type=float, default=FEATURE_TOK_S, help="extraction tokens/s for the costing")
    args = p.parse_args(argv)
    return cmd_train(args) if args.stage == "train" else cmd_report(args)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
