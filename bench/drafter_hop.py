"""The drafter hop: what a speculative round pays to reach the drafter through Ray Serve.

One ``RoundLoop`` in this process drives the in-process target (a ``TargetWorker``) twice over the
same requests, greedy, with a fixed dynamic tree:

    local   the drafter is a ``DrafterWorker`` in this process (a plain method call)
    serve   the drafter is an ``EyasDrafter`` Serve replica on a local Ray (the deployed path)

Per speculative round it reports the propose call's wall time, the verify time and the hop (the
round's wall time outside the workers' own compute), as medians, with the serve/local ratio of the
same run. It also times a bare Serve call (``propose_batch([])``) and the cloudpickle round trips
of one round's arguments (seeds) and results (draft trees), which bound what Ray's transport and
serialization cost. Both runs must give the same tokens.

Run:
    .venv/bin/python bench/drafter_hop.py                      # fp32, tree 2/2/4, 3 requests of 48 tokens
    .venv/bin/python bench/drafter_hop.py --precision fp16w --requests 4

Writes bench/results/drafter_hop.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Count from 1 to 300, one number per line, and say nothing else."


def _median_ms(values) -> float:
    return 1000 * statistics.median(values) if values else 0.0


def drive(target, drafter_calls, info, ids, tree, requests: int, max_new_tokens: int, label: str, bar) -> dict:
    """Run ``requests`` greedy requests through one RoundLoop; per-round medians of the later ones
    (the first warms up the path)."""
    from eyas.protocol.sampling_params import SamplingParams
    from eyas.scheduler.latency import LatencyCurve
    from eyas.scheduler.policy import Budgets, PromptLengthPolicy
    from eyas.serve.round_loop import RoundLoop, WorkerCalls

    curve = LatencyCurve.from_points({1: 50.0, 16: 55.0, 64: 70.0})  # the fixed-tree policy ignores it
    loop = RoundLoop(WorkerCalls(target, 120, local=True), drafter_calls, info, PromptLengthPolicy(Budgets()), curve)
    results = []
    try:
        for i in range(requests):
            results.append(
                loop.submit(f"{label}-{i}", ids, max_new_tokens, "eagle3", tree, SamplingParams(), 0).result(
                    timeout=600
                )
            )
            bar.update(1)
    finally:
        loop.close()
    rounds = [s for r in results[1:] for s in r.rounds if s.tree_nodes]
    return {
        "rounds": len(rounds),
        "propose_ms": _median_ms([s.draft_s for s in rounds]),
        "verify_ms": _median_ms([s.verify_s for s in rounds]),
        "hop_ms": _median_ms([s.hop_s for s in rounds]),
        "tokens": [r.token_ids for r in results],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--precision", choices=("fp32", "fp16w"), default="fp32")
    ap.add_argument("--requests", type=int, default=3, help="requests per path (the first warms up)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--tree", type=int, nargs=3, default=[2, 2, 4], metavar=("WIDTH", "DEPTH", "BUDGET"))
    ap.add_argument("--calls", type=int, default=30, help="bare Serve calls timed")
    ap.add_argument("--json", default=str(RESULTS / "drafter_hop.json"))
    args = ap.parse_args(argv)
    if args.requests < 2:
        ap.error("--requests: at least 2 (the first warms up)")
    warnings.filterwarnings("ignore")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import torch
    from tqdm import tqdm

    from eyas.actors.drafter_worker import DrafterWorker
    from eyas.actors.target_worker import TargetWorker
    from eyas.drafting.engine import TreeSpec
    from eyas.serve.deployments import _Locked
    from eyas.serve.round_loop import WorkerCalls
    from eyas.target.loader import encode_prompt, load_tokenizer

    torch.set_num_threads(1)  # as the deployments run (torch_threads: 1)
    tree = TreeSpec("dynamic", *args.tree)
    print(f"loading the target and the EAGLE-3 drafter ({args.precision}) ...", flush=True)
    target = _Locked(TargetWorker.load("smollm2-135m", args.precision, 1), threading.Lock())
    ids = encode_prompt(load_tokenizer(), PROMPT)
    local = DrafterWorker.load("smollm2-135m", ("eagle3",), threads=1, precision=args.precision)
    local.measure_costs(1)

    import ray
    import ray.cloudpickle as cloudpickle
    from ray import serve

    from eyas.experiments.experiment import free_port
    from eyas.serve.deployments import EyasDrafter, ServeCalls

    rows = {}
    with tqdm(total=2 * args.requests + args.calls, desc="hop", unit="call") as bar:
        local_calls = WorkerCalls(_Locked(local, threading.Lock()), 120, local=True, drafter=True)
        rows["local"] = drive(
            target, local_calls, local.info(), ids, tree, args.requests, args.max_new_tokens, "local", bar
        )
        bar.set_postfix_str("starting Ray and the drafter replica")
        ray.init(
            address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=160 * 1024**2
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
            handle = serve.run(
                EyasDrafter.bind({"methods": ["eagle3"], "precision": args.precision, "torch_threads": 1}),
                name="hop",
                route_prefix=None,
            )
            remote = ServeCalls(handle, "bench", 120)
            captured = []

            def capturing(method, *call_args):
                out = remote(method, *call_args)
                if method == "propose_batch" and call_args[0]:
                    captured.append((call_args, out))
                return out

            bar.set_postfix_str("")
            rows["serve"] = drive(
                target, capturing, remote("info"), ids, tree, args.requests, args.max_new_tokens, "serve", bar
            )
            bare = []
            for _ in range(args.calls):
                t0 = time.perf_counter()
                remote("propose_batch", [])
                bare.append(time.perf_counter() - t0)
                bar.update(1)
            call_args, out = captured[len(captured) // 2]
            pickle_ms = {}
            for name, obj in (("seeds", call_args), ("trees", out)):
                t0 = time.perf_counter()
                for _ in range(100):
                    blob = cloudpickle.dumps(obj)
                    cloudpickle.loads(blob)
                pickle_ms[name] = {"ms": (time.perf_counter() - t0) * 10, "bytes": len(blob)}
        finally:
            serve.shutdown()
            ray.shutdown()

    same = rows["local"]["tokens"] == rows["serve"]["tokens"]
    lo, se = rows["local"], rows["serve"]
    print(f"\n{'path':<6} {'rounds':>6} {'propose ms':>10} {'verify ms':>9} {'hop ms':>7}")
    for name, r in rows.items():
        print(f"{name:<6} {r['rounds']:>6} {r['propose_ms']:>10.1f} {r['verify_ms']:>9.1f} {r['hop_ms']:>7.1f}")
    print(
        f"serve/local: propose {se['propose_ms'] / max(lo['propose_ms'], 1e-9):.2f}x, "
        f"verify {se['verify_ms'] / max(lo['verify_ms'], 1e-9):.2f}x"
    )
    print(
        f"bare Serve call p50 {_median_ms(bare):.1f} ms; cloudpickle round trip: seeds "
        f"{pickle_ms['seeds']['ms']:.2f} ms ({pickle_ms['seeds']['bytes']} B), trees "
        f"{pickle_ms['trees']['ms']:.2f} ms ({pickle_ms['trees']['bytes']} B)"
    )
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "precision": args.precision,
        "tree": args.tree,
        "requests": args.requests,
        "max_new_tokens": args.max_new_tokens,
        "same_tokens": same,
        "bare_serve_call_ms": _median_ms(bare),
        "pickle": pickle_ms,
        "paths": {k: {x: v for x, v in r.items() if x != "tokens"} for k, r in rows.items()},
    }
    out_path.write_text(json.dumps(doc, indent=1))
    plot(doc, out_path.with_suffix(".png"))
    unexplained = se["hop_ms"] - _median_ms(bare) - pickle_ms["seeds"]["ms"] - pickle_ms["trees"]["ms"]
    print(
        f"\nsummary: the Serve hop costs {se['hop_ms']:.1f} ms a speculative round (local {lo['hop_ms']:.1f}): "
        f"bare call {_median_ms(bare):.1f} + pickling {pickle_ms['seeds']['ms'] + pickle_ms['trees']['ms']:.1f} "
        f"+ {unexplained:.1f} ms other; tokens {'identical' if same else 'DIFFERENT'}; wrote {out_path} and "
        f"{out_path.with_suffix('.png')}"
    )
    return 0 if same else 1


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(doc["paths"])
    parts = ("propose_ms", "verify_ms", "hop_ms")
    for i, part in enumerate(parts):
        ax.bar(
            [x + 0.27 * (i - 1) for x in range(len(names))],
            [doc["paths"][n][part] for n in names],
            0.27,
            label=part.removesuffix("_ms"),
        )
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ms per speculative round (median)")
    ax.set_title(f"drafter hop, {doc['precision']}, tree {'/'.join(map(str, doc['tree']))}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
