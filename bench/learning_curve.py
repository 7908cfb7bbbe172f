"""The EAGLE-3 learning curve: held-out top-1 and MT-bench tau against supervised training tokens.

Each point is a training config under ``configs/curve/`` (one recipe; only the data size differs:
the first N of the target's own answers in ``data/regen``, every point reading one feature cache).

Stages:

    train    trains every point that has not exported a drafter yet, smallest first; each is
             ``eyas train --config ...`` and resumes from its own trainer_state.pt when stopped
    report   benches every finished point (and the shipped drafters/smollm2-135m-eagle3 as a
             reference) in ONE ``bench/acceptance.py`` run, so one target-only baseline serves all;
             prints the table and the extrapolation; writes bench/results/learning_curve.{json,png}
    compare  one acceptance JSON's methods against one of them: τ difference and speed ratio, each
             with a paired bootstrap 95 % interval over the prompts (the test a point ships on)

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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "configs" / "curve"
RESULTS = REPO / "bench" / "results"
REFERENCE_DRAFTER = REPO / "drafters" / "smollm2-135m-eagle3"
GOAL_TAU = 2.5
# Measured stage throughputs on the 2-core CPU (docs/benchmarks.md), used unless given:
REGEN_TOK_S = 80.0  # the target's own answers, HF generate over batches of 64, one thread (56-106)
FEATURE_TOK_S = 454.0  # frozen-target feature extraction (every token of a sample)


def points(folder: Path = CONFIGS) -> list[dict]:
    """The curve's configs, smallest first: {"config", "out", "train_samples", "finished"}."""
    from eyas.training.config import load_config

    out = []
    for path in sorted(folder.glob("*.yaml")):
        cfg = load_config(path)
        run = REPO / cfg.out
        out.append(
            {
                "config": path,
                "out": run,
                "train_samples": cfg.data.train_samples,
                "epochs": cfg.epochs,
                "finished": (run / "manifest.json").exists() and (run / "model.safetensors").exists(),
            }
        )
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


# --- the old fit: tau as a straight line in log-data (kept, labelled, for comparison) ---------------
MAX_DOUBLINGS = 1000  # 2 ** 1024 overflows a float


def extrapolate(rows: list[dict], goal: float, regen_tok_s: float, feature_tok_s: float) -> dict:
    """tau = a * log2(supervised tokens) + b over the points; the tokens and CPU hours for ``goal``.
    This is the fit that put tau 2.5 at ~584 M tokens: it treats tau, a convex function of the
    per-step acceptances, as if it were linear in log-data (see :func:`acceptance_fit`)."""
    xs = [math.log2(r["supervised_tokens"]) for r in rows]
    a, b = fit_line(xs, [r["tau"] for r in rows])
    residuals = [r["tau"] - (a * x + b) for r, x in zip(rows, xs)]
    out = {"tau_per_doubling": a, "intercept": b, "residuals": residuals, "goal_tau": goal}
    doublings = (goal - b) / a if a > 0 else math.inf
    # None: never on this slope (flat or falling), or beyond what a float holds (a nearly flat one)
    out["supervised_tokens_for_goal"] = 2**doublings if doublings < MAX_DOUBLINGS else None
    return out


# --- the new fit: per-step acceptance linear in log-data, composed through a tree -------------------
SHAPES = ((2, 2, 4), (1, 3, 3), (1, 4, 4), (2, 3, 6), (2, 4, 6), (2, 4, 8), (3, 5, 12), (4, 5, 16))


def cumulative_topk(point: dict) -> list[dict[int, float]]:
    """Per rollout step, {k: held-out top-k accuracy} from a point's ``heldout`` (top-1..8 when the
    run measured them, else top-1 and top-3)."""
    h = point["heldout"]
    if h.get("topk"):
        return [{k + 1: v for k, v in enumerate(row)} for row in h["topk"]]
    return [{1: t1, 3: t3} for t1, t3 in zip(h["top1"], h["top3"])]


def rank_rates(topk: list[dict[int, float]]) -> list[list[float]]:
    """Rank rates per depth (``eyas.scheduler.cost.expected_accepted``) from cumulative top-k; where
    only top-1 and top-3 are known, ranks 2 and 3 share the difference evenly."""
    from eyas.scheduler.cost import rank_rates_from_topk

    rows = []
    for step in topk:
        ks = sorted(step)
        dense = []
        for k in range(1, ks[-1] + 1):
            if k in step:
                dense.append(step[k])
            else:  # between two known ks: linear in k
                lo = max(x for x in ks if x < k)
                hi = min(x for x in ks if x > k)
                dense.append(step[lo] + (step[hi] - step[lo]) * (k - lo) / (hi - lo))
        rows.append(dense)
    return rank_rates_from_topk(rows)


def tau_model(topk: list[dict[int, float]], shape: tuple[int, int, int], calibration: float = 1.0) -> float:
    """1 + expected accepted tokens of a best-first tree of ``shape`` (width, depth, budget) whose rank
    rates are the held-out ones scaled by ``calibration`` (served prompts are not held-out text, and
    EAGLE-2 orders nodes by the drafter's own confidence: the factor is fitted to measured tau)."""
    from eyas.scheduler.cost import TreeShape, expected_accepted

    rates = [[min(calibration * r, 1.0) for r in row] for row in rank_rates(topk)]
    rates = [[r / max(sum(row), 1.0) for r in row] for row in rates]
    return 1.0 + expected_accepted(rates, TreeShape(*shape))


def fit_calibration(points: list[dict], shape: tuple[int, int, int]) -> float | None:
    """The factor on held-out rank rates that best reproduces the points' measured tau on ``shape``
    (least squares, golden-section over [0.2, 1.5]); None without a measured point."""
    measured = [p for p in points if p.get("tau")]
    if not measured:
        return None

    def err(c):
        return sum((tau_model(cumulative_topk(p), shape, c) - p["tau"]) ** 2 for p in measured)

    lo, hi = 0.2, 1.5
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if err(a) < err(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


def acceptance_fit(points: list[dict]) -> dict:
    """Per rollout step and k, held-out top-k = slope * log2(supervised tokens) + intercept, over the
    points (k where every point measured it)."""
    xs = [math.log2(p["supervised_tokens"]) for p in points]
    tops = [cumulative_topk(p) for p in points]
    steps = min(len(t) for t in tops)
    ks = sorted(set.intersection(*[set(t[s]) for t in tops for s in range(steps)]))
    lines = [{k: fit_line(xs, [t[s][k] for t in tops]) for k in ks} for s in range(steps)]
    residuals = [
        [round(t[s][1] - (lines[s][1][0] * x + lines[s][1][1]), 4) for t, x in zip(tops, xs)] for s in range(steps)
    ]
    return {"lines": lines, "ks": ks, "steps": steps, "top1_residuals": residuals}


def predict_topk(fit: dict, tokens: float) -> list[dict[int, float]]:
    x = math.log2(tokens)
    out = []
    for line in fit["lines"]:
        row, prev = {}, 0.0
        for k in sorted(line):
            a, b = line[k]
            prev = row[k] = min(max(a * x + b, prev), 0.99)
        out.append(row)
    return out


def prediction(points: list[dict], tokens: list[int], shape: tuple[int, int, int], basis: str) -> dict:
    """What the acceptance fit over ``points`` says at each of ``tokens``: top-1 per step and tau on
    every shape of :data:`SHAPES` (calibrated on the points' measured tau on ``shape``)."""
    fit = acceptance_fit(points)
    c = fit_calibration(points, shape) or 1.0
    out = {
        "made": time.strftime("%Y-%m-%d %H:%M"),
        "basis": basis,
        "points": [p["name"] for p in points],
        "calibration": c,
        "bench_shape": list(shape),
        "at": {},
    }
    for t in tokens:
        topk = predict_topk(fit, t)
        out["at"][str(t)] = {
            "top1": [round(r[1], 4) for r in topk],
            "tau": {"/".join(map(str, sh)): round(tau_model(topk, sh, c), 3) for sh in SHAPES},
        }
    return out


def old_curve_points() -> list[dict]:
    """The first learning curve (bench/results/learning_curve.json, committed): 2 epochs over the
    first N of the target's own answers, float32, 32 held-out answers, tau on 20 prompts x 64 tokens.
    Its points are placed at the supervised tokens they saw (2N): a one-epoch run of the same size
    measured 0.27 held-out top-1 where the 2-epoch point of half its data saw as many tokens and
    reached 0.29 (docs/benchmarks.md), so it is tokens seen, not unique tokens, that the curve is in."""
    path = RESULTS / "learning_curve.json"
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    rows = data.get("old_curve", data)["points"]
    # x is supervised tokens *seen* (2 epochs over N answers saw 2N), the unit of a one-pass stream
    return [
        {
            "name": r["name"],
            "family": "old",
            "supervised_tokens": int(r["supervised_tokens"] * r["epochs"]),
            "unique_supervised_tokens": r["supervised_tokens"],
            "epochs": r["epochs"],
            "heldout": {
                "top1": r["heldout_top1"],
                "top3": r["heldout_top3"],
                **({"topk": r["heldout_topk"]} if r.get("heldout_topk") else {}),
            },
            "tau": r["tau"],
            "speedup": r["speedup"],
            "identical": r["identical"],
        }
        for r in rows
    ]


def stream_points(run: Path) -> list[dict]:
    """The decay points of a wsd run (``out/points.json``), smallest first."""
    path = run / "points.json"
    if not path.exists():
        return []
    done = json.loads(path.read_text())
    return sorted(
        (
            {
                "name": f"{run.name}@{k}",
                "family": run.name,
                "supervised_tokens": int(k),
                "epochs": 1.0,
                "heldout": v["heldout"],
                "drafter": v["drafter"],
                "wall_s": v.get("wall_s"),
            }
            for k, v in done.items()
        ),
        key=lambda p: p["supervised_tokens"],
    )


def cmd_predict(args) -> int:
    """Record what the fit over the measured points predicts for data sizes not yet trained."""
    points = old_curve_points() if args.family == "old" else stream_points(Path(args.family))
    if len(points) < 2:
        print(f"error: --family {args.family}: {len(points)} points; a fit needs two", file=sys.stderr)
        return 2
    shape = tuple(args.shape)
    pred = prediction(points, args.tokens, shape, args.family)
    path = RESULTS / "learning_curve-predictions.json"
    stored = json.loads(path.read_text()) if path.exists() else []
    stored.append(pred)
    path.write_text(json.dumps(stored, indent=1))
    print_prediction(pred)
    print(f"appended to {path.relative_to(REPO)}")
    return 0


def print_prediction(pred: dict) -> None:
    print(
        f"prediction of {pred['made']} from {pred['basis']} ({len(pred['points'])} points), calibration "
        f"{pred['calibration']:.3f} on the {'/'.join(map(str, pred['bench_shape']))} tree"
    )
    shapes = list(next(iter(pred["at"].values()))["tau"])
    print(f"{'tokens':>10} {'top-1 by step':<32} " + " ".join(f"{s:>7}" for s in shapes))
    for t, v in pred["at"].items():
        print(f"{int(t):>10,} {str(v['top1']):<32} " + " ".join(f"{v['tau'][s]:>7.2f}" for s in shapes))


def paired_tau_difference(
    records: list[dict], base: str, other: str, draws: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """τ(other) - τ(base) over the prompts both ran, and its paired bootstrap 95 % interval: the
    prompts are resampled with replacement, the same sample for both (``records``: acceptance.py's
    per-prompt records; τ = new tokens / target forwards, pooled over the sample)."""
    tau, _ = paired_bootstrap(records, base, other, draws, seed)
    return tau


def paired_bootstrap(
    records: list[dict], base: str, other: str, draws: int = 4000, seed: int = 0
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """Two paired comparisons of ``other`` against ``base`` on one sample of prompts, each as (whole,
    2.5 %, 97.5 %): τ(other) - τ(base), and speed(other) / speed(base) (speed: new tokens / wall
    seconds, pooled over the sample). The prompts both ran are resampled with replacement ``draws``
    times, the same sample for both methods and both statistics. -> ((τ diff), (speed ratio))."""
    import random

    by: dict[str, dict] = {}
    for r in records:
        by.setdefault(r["method"], {})[r["prompt"]] = r

    def made(x) -> int:
        return sum(x["round_new_tokens"]) if isinstance(x["round_new_tokens"], list) else x["round_new_tokens"]

    def tau(rows) -> float:
        rows = list(rows)
        return sum(made(x) for x in rows) / sum(x["target_forwards"] for x in rows)

    def speed(rows) -> float:
        rows = list(rows)
        return sum(x["new_tokens"] for x in rows) / sum(x["wall_s"] for x in rows)

    prompts = sorted(set(by[base]) & set(by[other]))
    rng = random.Random(seed)
    diffs, ratios = [], []
    for _ in range(draws):
        sample = [rng.choice(prompts) for _ in prompts]
        diffs.append(tau(by[other][q] for q in sample) - tau(by[base][q] for q in sample))
        ratios.append(speed(by[other][q] for q in sample) / speed(by[base][q] for q in sample))
    lo, hi = int(0.025 * draws), int(0.975 * draws) - 1
    diffs.sort()
    ratios.sort()
    whole_tau = tau(by[other][q] for q in prompts) - tau(by[base][q] for q in prompts)
    whole_speed = speed(by[other][q] for q in prompts) / speed(by[base][q] for q in prompts)
    return (whole_tau, diffs[lo], diffs[hi]), (whole_speed, ratios[lo], ratios[hi])


def cmd_compare(args) -> int:
    """Every method of one ``bench/acceptance.py`` JSON against ``--reference``, paired over prompts."""
    bench = json.loads(Path(args.json).read_text())
    methods = bench["methods"]
    if args.reference not in methods:
        print(
            f"error: --reference: {args.reference!r} is not a method of {args.json} ({', '.join(methods)})",
            file=sys.stderr,
        )
        return 2
    c = bench["config"]
    print(
        f"{args.json}: {c['num_prompts']} prompts, {c['max_new_tokens']} new tokens, {c['precision']}; paired "
        f"bootstrap over prompts ({args.draws} draws, 95 %) against {args.reference}"
    )
    print(f"{'method':<36} {'tau':>5} {'- reference [95 %]':>26} {'speedup':>8} {'speed / reference [95 %]':>26}")
    for name, m in methods.items():
        if name == "target":
            continue
        line = f"{name:<36} {m['tau']:>5.3f} "
        if name == args.reference:
            line += f"{'(reference)':>26} {m['speedup']:>7.3f}x"
        else:
            (d, dl, dh), (r, rl, rh) = paired_bootstrap(bench["records"], args.reference, name, args.draws)
            line += (
                f"{f'{d:+.3f} [{dl:+.3f}, {dh:+.3f}]':>26} {m['speedup']:>7.3f}x {f'{r:.3f} [{rl:.3f}, {rh:.3f}]':>26}"
            )
        print(line)
    return 0


def made_for(pred: dict, run: Path) -> bool:
    """Whether a recorded prediction speaks of ``run``: one that names its run (``run``, or a run
    folder as its basis) speaks only of that run; one from the old curve speaks of every run."""
    if pred.get("run"):
        return Path(pred["run"].split()[0]).name == run.name
    return pred["basis"] == "old" or Path(pred["basis"]).name == run.name


def cmd_report(args) -> int:
    run = Path(args.run)
    new = stream_points(run)
    old = old_curve_points()
    if not new:
        print(f"error: --run {run}: no decay point has finished yet", file=sys.stderr)
        return 2
    RESULTS.mkdir(parents=True, exist_ok=True)
    acceptance_json = RESULTS / f"learning_curve-{run.name}-acceptance.json"
    if not args.skip_bench:
        with tempfile.TemporaryDirectory() as tmp:
            for p in new:
                (Path(tmp) / p["name"].replace("@", "-")).symlink_to(Path(p["drafter"]).resolve())
            if REFERENCE_DRAFTER.exists():
                (Path(tmp) / REFERENCE_DRAFTER.name).symlink_to(REFERENCE_DRAFTER)
            cmd = [
                sys.executable,
                str(REPO / "bench" / "acceptance.py"),
                "--drafters",
                tmp,
                "--precision",
                args.precision,
                "--max-new-tokens",
                str(args.max_new_tokens),
                "--json",
                str(acceptance_json),
            ]
            cmd += ["--limit", str(args.limit)] if args.limit else []
            cmd += ["--threads", str(args.threads)] if args.threads else []
            for flag, value in (
                ("--tree-width", args.tree_width),
                ("--tree-depth", args.tree_depth),
                ("--tree-budget", args.tree_budget),
                ("--tree-min-value", args.tree_min_value),
                ("--tree-expand-min-value", args.tree_expand_min_value),
            ):
                cmd += [flag, str(value)] if value is not None else []
            if subprocess.run(cmd, cwd=REPO).returncode != 0:
                print("error: the acceptance run failed", file=sys.stderr)
                return 1
    bench = json.loads(acceptance_json.read_text())
    for p in new:
        m = bench["methods"].get(p["name"].replace("@", "-"))
        if m:
            p.update(tau=m["tau"], speedup=m["speedup"], identical=m["identical"], accept_by_depth=m["accept_by_depth"])
    reference = bench["methods"].get(REFERENCE_DRAFTER.name)
    any_spec = next(m for k, m in bench["methods"].items() if k != "target")
    tree = any_spec["tree"]
    shape = (tree["expand_width"], tree["max_depth"], tree["verify_budget"])
    if tree.get("min_value") or tree.get("expand_min_value"):
        print(
            "error: the curve's tau model is for plain EAGLE-2 trees, and this bench ran a cost-aware one "
            "(the fp16w default); pass --tree-width W --tree-depth D --tree-budget B "
            "--tree-min-value 0 --tree-expand-min-value 0",
            file=sys.stderr,
        )
        return 2
    preds_path = RESULTS / "learning_curve-predictions.json"
    preds = json.loads(preds_path.read_text()) if preds_path.exists() else []

    print(
        f"\nEAGLE-3 learning curve, {run.name}: {bench['config']['num_prompts']} MT-bench first turns, "
        f"{bench['config']['max_new_tokens']} new tokens, greedy, {bench['config']['precision']}, tree "
        f"{'/'.join(map(str, shape))}; speedup against target-only in the same run\n"
    )
    steps = len(new[-1]["heldout"]["top1"])
    print(
        f"{'point':<22} {'sup. tokens':>11} "
        + " ".join(f"{'top1@' + str(s + 1):>7}" for s in range(steps))
        + f" {'tau':>5} {'speedup':>7} {'identical':>9}   predicted before (top-1@1, tau)"
    )
    for p in new:
        before = [
            q
            for q in preds
            if str(p["supervised_tokens"]) in q["at"] and p["name"] not in q["points"] and made_for(q, run)
        ]
        guess = before[-1]["at"][str(p["supervised_tokens"])] if before else None
        key = "/".join(map(str, shape))
        said = (
            f"{guess['top1'][0]:.3f}, {guess['tau'].get(key, float('nan')):.2f} ({before[-1]['basis']}, "
            f"{before[-1]['made']})"
            if guess
            else "-"
        )
        print(
            f"{p['name']:<22} {p['supervised_tokens']:>11,} "
            + " ".join(f"{x:>7.3f}" for x in p["heldout"]["top1"])
            + f" {p.get('tau') or float('nan'):>5.2f} {p.get('speedup') or float('nan'):>6.2f}x "
            f"{p.get('identical', '-'):>9}   {said}"
        )
    if reference:
        print(
            f"{'shipped':<22} (drafters/{REFERENCE_DRAFTER.name}) tau {reference['tau']:.2f}, "
            f"{reference['speedup']:.2f}x, identical {reference['identical']}"
        )
        for p in new:  # a point ships only where this interval excludes zero
            name = p["name"].replace("@", "-")
            if name in bench["methods"]:
                diff, low, high = paired_tau_difference(bench["records"], REFERENCE_DRAFTER.name, name)
                p["tau_vs_shipped"] = {"difference": diff, "ci95": [low, high]}
                print(f"{p['name']:<22} tau - shipped {diff:+.3f}, paired bootstrap 95 % CI [{low:+.3f}, {high:+.3f}]")

    fits = {}
    for name, pts in (("old curve (2 epochs, float32, 32 held-out)", old), (run.name, new)):
        if len(pts) < 2:
            continue
        fit = acceptance_fit(pts)
        slopes = [round(line[1][0], 4) for line in fit["lines"]]
        print(
            f"\nacceptance fit, {name}: held-out top-1 per doubling by step {slopes}; residuals {fit['top1_residuals']}"
        )
        fits[name] = {"top1_per_doubling": slopes, "residuals": fit["top1_residuals"]}
        if all(p.get("tau") for p in pts):
            line = extrapolate(
                [{"supervised_tokens": p["supervised_tokens"], "tau": p["tau"]} for p in pts], args.goal, 0, 0
            )
            fits[name]["old_tau_line"] = line
            print(
                f"old fit (tau linear in log2 tokens, the one that said ~584 M): tau = "
                f"{line['tau_per_doubling']:.3f} * log2 T + {line['intercept']:.2f}; tau {args.goal} at "
                f"{line['supervised_tokens_for_goal'] or float('nan'):,.0f} tokens"
            )
    if len(new) >= 2:
        last = new[-1]["supervised_tokens"]
        pred = prediction(new, [last * 2, last * 4, last * 8], shape, run.name)
        print()
        print_prediction(pred)
        fits["next"] = pred
        if args.record:
            preds.append(pred)
            preds_path.write_text(json.dumps(preds, indent=1))
            print(f"(recorded in {preds_path.relative_to(REPO)})")
    out = RESULTS / f"learning_curve-{run.name}.json"
    out.write_text(
        json.dumps(
            {
                "points": new,
                "old_points": old,
                "reference": reference and {k: reference[k] for k in ("tau", "speedup", "identical")},
                "fits": fits,
                "bench": bench["config"],
            },
            indent=1,
            default=str,
        )
    )
    plot(new, old, reference, preds, shape, RESULTS / f"learning_curve-{run.name}.png")
    print(f"wrote {out.relative_to(REPO)} and its .png, {acceptance_json.relative_to(REPO)}")
    return 0


def plot(new: list[dict], old: list[dict], reference: dict | None, preds: list[dict], shape, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pts, style, label in ((old, "s--", "old curve"), (new, "o-", new[0]["family"])):
        if not pts:
            continue
        xs = [p["supervised_tokens"] for p in pts]
        for s in range(len(pts[0]["heldout"]["top1"])):
            ax1.plot(
                xs,
                [p["heldout"]["top1"][s] for p in pts],
                style,
                label=f"{label}, step {s + 1}",
                alpha=0.5 if pts is old else 1.0,
            )
        ax2.plot(xs, [p.get("tau") or float("nan") for p in pts], style, label=f"{label} (measured)")
    key = "/".join(map(str, shape))
    if preds:
        last = preds[-1]
        xs = sorted(int(t) for t in last["at"])
        ax2.plot(
            xs,
            [last["at"][str(t)]["tau"].get(key, float("nan")) for t in xs],
            "x:",
            label=f"predicted ({last['basis']}, {last['made']})",
        )
    if reference:
        ax2.axhline(reference["tau"], color="tab:red", linestyle="-.", alpha=0.6, label="shipped before")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("supervised tokens seen")
    ax1.set_ylabel("held-out top-1")
    ax1.set_title("held-out top-1 by training-time-test step")
    ax1.legend(fontsize=6)
    ax2.set_ylabel(f"tau on MT-bench ({key} tree)")
    ax2.set_title("tau against data")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heldout_of(drafter: Path, heldout_samples: int = 128, threads: int | None = None) -> dict:
    """A drafter folder's held-out top-k per rollout step on the target's own answers to the first
    ``heldout_samples`` held-out first turns (the training runs' own evaluation and labels)."""
    from eyas.drafting.manifest import read_manifest
    from eyas.runtime import Eyas, set_threads
    from eyas.training.config import validated
    from eyas.training.prepare import prepare_features
    from eyas.training.trainer import DrafterTrainer

    set_threads(threads)
    manifest = read_manifest(drafter)
    dcfg = manifest.drafter_config
    cfg = validated(
        {
            "method": "eagle3",
            "layout": dcfg.get("layout", "eyas-v1"),
            "fc_norm": dcfg.get("fc_norm", False),
            "init_from": str(drafter),
            "draft_vocab_size": dcfg["draft_vocab_size"],
            "out": "/dev/null",
            "ttt_steps": 4,
            "data": {
                "train_samples": 1,
                "heldout_samples": heldout_samples,
                "regenerate": True,
                "answers_dir": "data/regen",
                "features": "online",
            },
        }
    )
    eyas = Eyas(cfg.target, "fp32")
    train, heldout = prepare_features(cfg, eyas)
    trainer = DrafterTrainer(cfg, eyas.model, eyas.loaded.fingerprint.to_dict(), train, heldout)
    return trainer.evaluate()


def cmd_heldout(args) -> int:
    out = heldout_of(Path(args.drafter), args.heldout_samples, args.threads)
    print(json.dumps({"drafter": args.drafter, "heldout_samples": args.heldout_samples, "heldout": out}))
    print(
        f"{args.drafter}: held-out top-1 by step {[round(x, 3) for x in out['top1']]}, "
        f"top-3 {[round(x, 3) for x in out['top3']]}"
    )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="stage", required=True)
    t = sub.add_parser("train", help="train every unfinished point of the old curve (configs/curve; resumable)")
    t.add_argument("--threads", type=int, help="torch CPU threads per training run (default: the config's)")
    r = sub.add_parser("report", help="bench a wsd run's decay points in one run; table, fits, predictions, plot")
    r.add_argument("--run", default="runs/stream-eagle3", help="the wsd run's folder (its points.json)")
    r.add_argument("--limit", type=int, default=0, help="MT-bench first turns (default all 80)")
    r.add_argument("--max-new-tokens", type=int, default=40)
    r.add_argument("--precision", default="fp16w")
    r.add_argument("--threads", type=int)
    r.add_argument("--tree-width", type=int)
    r.add_argument("--tree-depth", type=int)
    r.add_argument("--tree-budget", type=int)
    r.add_argument("--tree-min-value", type=float, help="0 with --tree-*: plain EAGLE-2 at fp16w (the curve's tree)")
    r.add_argument("--tree-expand-min-value", type=float)
    r.add_argument("--goal", type=float, default=GOAL_TAU)
    r.add_argument("--skip-bench", action="store_true", help="reuse the last acceptance JSON of this run")
    r.add_argument("--record", action="store_true", help="record the fit's prediction for the next doublings")
    q = sub.add_parser("predict", help="record what a fit predicts for data sizes not yet trained")
    q.add_argument("--family", default="old", help="'old' (the committed first curve) or a wsd run's folder")
    q.add_argument("--tokens", type=int, nargs="+", required=True)
    q.add_argument("--shape", type=int, nargs=3, default=[2, 2, 4], help="the bench tree: width depth budget")
    c = sub.add_parser("compare", help="paired tau and speed of one acceptance JSON's methods against one of them")
    c.add_argument("--json", required=True, help="a bench/acceptance.py result (its per-prompt records)")
    c.add_argument("--reference", default=REFERENCE_DRAFTER.name, help="the method the others are compared with")
    c.add_argument("--draws", type=int, default=4000)
    h = sub.add_parser("heldout", help="a drafter folder's held-out top-k per step (the runs' own evaluation)")
    h.add_argument("--drafter", required=True)
    h.add_argument("--heldout-samples", type=int, default=128)
    h.add_argument("--threads", type=int)
    args = p.parse_args(argv)
    return {
        "train": cmd_train,
        "report": cmd_report,
        "predict": cmd_predict,
        "heldout": cmd_heldout,
        "compare": cmd_compare,
    }[args.stage](args)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
