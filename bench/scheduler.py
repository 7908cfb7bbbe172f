"""Scheduler policies under a mixed workload: target-only batching vs prompt-length vs tree-work.

In one process, on the real default target (fp32 unless --precision fp16w|int8) and the shipped EAGLE-3
drafter, a closed loop keeps C requests in flight (C = 1, 4, 16): whenever one finishes the next is
submitted. The loop is the serving replica's own ``RoundLoop`` over an in-process ``TargetWorker`` and
``DrafterWorker`` (the same messages and calls as an ``EyasTarget`` replica, without Ray): every round
runs ONE batched target forward over the planned requests' rows. Each request asks for what serving
gives it, the drafter's default tree (4/5/16 at fp32, 2/2/4 at fp16w), and a policy's tree is capped by
it. The workload mixes short and long prompts and chatty (MT-bench first turns) and repetitive text
(prompts that ask to repeat or continue a list), so acceptance varies between requests.

Policies, in the same run and on the same requests (rotating order per level):
    target-only      continuous batching, no drafting (every request 1 row a round)
    prompt-length    batches of similar prompt lengths, one fixed EAGLE-2 tree (width 4, depth 5,
                     budget 16, within the request's tree)
    tree-work        the Eyas policy: batch and per-request trees chosen from the latency curve and
                     each request's recent acceptance (eyas/scheduler/policy.py)

The latency curve (verify ms against total rows) is measured at start-up on this machine and updated
from live rounds; it is printed and plotted. So is the draft cost (ms of one drafting call per deepest
depth and draft row, ``DrafterEngine.measure_cost``), which the tree-work policy starts from.

Every round is ONE target forward that carries the prompts' next prefill chunks (at most
--max-prefill-rows rows, all requests together) beside the decode and verify rows. Also measured in
the same run: the forward-bound rate at 16 rows (one request's 16-row verify, and 16 requests' 1-row
decodes in one batched forward, each over the workload's mean context; once before the policies and
three times after, the medians), against which target-only at C=16 is reported (its rate over the
rounds that prefilled nothing: tokens / those rounds' wall time, and over those of them in which all
16 requests decoded); the same 16-request forward at the contexts of one such full round (ragged,
so the store's one attention call reads every row as far as the longest), against which the full
rounds are reported too: that ratio is the loop's own overhead; and the long-prompt
case (a short request sent beside a --long-prompt-token prompt: its rounds and seconds to its first
token, chunked and with the prompt prefilled whole).

Reported per (policy, concurrency): throughput (tokens/s), goodput (tokens/s of requests that met
the latency target: mean time per output token <= --slo-ms-per-token, time to first token
excluded), p50/p99 per-token latency, rounds, mean batch, mean verify rows, and the ratio of goodput
to the prompt-length policy's.

Run:
    .venv/bin/python bench/scheduler.py                               # C = 1, 4, 16
    .venv/bin/python bench/scheduler.py --concurrency 4 16 --requests 24 --max-new-tokens 48
    .venv/bin/python bench/scheduler.py --concurrency 1 --policies target-only tree-work --requests 16

Writes bench/results/scheduler.json and .png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import load_prompts, placement_refused  # noqa: E402

from eyas import compute  # noqa: E402
from eyas.actors.drafter_worker import DrafterWorker  # noqa: E402
from eyas.actors.target_worker import TargetWorker  # noqa: E402
from eyas.drafting.engine import TreeSpec  # noqa: E402
from eyas.experiments.sim import percentile  # noqa: E402
from eyas.generate import generate  # noqa: E402
from eyas.protocol.sampling_params import SamplingParams  # noqa: E402
from eyas.runtime import Eyas, set_threads  # noqa: E402
from eyas.scheduler.cost import DEFAULT_PREFILL_CHUNK  # noqa: E402
from eyas.scheduler.latency import DraftCost, LatencyCurve  # noqa: E402
from eyas.scheduler.policy import Budgets, PromptLengthPolicy, TreeWorkPolicy  # noqa: E402
from eyas.serve.round_loop import RoundLoop, WorkerCalls  # noqa: E402
from eyas.target.loader import PRECISIONS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("target-only", "prompt-length", "tree-work")
REPETITIVE = [
    "Repeat the following list exactly three times: apple, banana, cherry, date, elderberry, fig.",
    "Count from 1 to 40, separated by commas.",
    "Write the alphabet in capital letters, one letter per line.",
    "Continue the pattern: red blue green red blue green red blue green",
]


def workload(n: int, limit: int) -> list[str]:
    chatty = load_prompts(None, limit)
    long_ctx = [
        p + "\n\nContext: " + " ".join(chatty[(i + 3) % len(chatty)].split()[:150]) for i, p in enumerate(chatty)
    ]
    mix = []
    for i in range(n):
        kind = i % 4
        mix.append(
            chatty[i % len(chatty)]
            if kind == 0
            else REPETITIVE[i % len(REPETITIVE)]
            if kind == 1
            else long_ctx[i % len(long_ctx)]
            if kind == 2
            else REPETITIVE[(i + 1) % len(REPETITIVE)]
        )
    return mix


def measure(worker: TargetWorker, taps) -> LatencyCurve:
    """Verify latency against total rows, at a 128-token committed prefix, on this machine."""
    return LatencyCurve.from_points(
        worker.measure_latency((1, 2, 4, 8, 16, 32, 64, 128), repeats=3, prefix=128, taps=taps)
    )


def forward_bound(
    worker: TargetWorker, taps, batch: int = 16, prefix: int = 128, repeats: int = 5, prefixes: list[int] | None = None
) -> dict:
    """The forward-bound rates of a ``batch``-row round, measured here: the median ms of (a) one
    request's ``batch``-row verify (the latency curve's point) and (b) ``batch`` requests' 1-row
    decodes in one batched forward (each over its own ``prefix``-token context, or over
    ``prefixes[i]`` tokens when given: what a target-only round at concurrency ``batch`` computes),
    and the tokens/s each would give."""
    from eyas.protocol.messages import AcceptDecision
    from eyas.protocol.tree import DraftTree

    engine = worker.engine_for(tuple(taps))
    rids = [f"__bound_{i}__" for i in range(batch)]
    prefixes = prefixes or [prefix] * batch
    assert len(prefixes) == batch, (len(prefixes), batch)
    try:
        for i, rid in enumerate(rids):
            ids = [(7 * j + 11 * i + 3) % worker.vocab_size for j in range(prefixes[i])]
            engine.open_session(rid, ids, 8, 1)
            v = engine.prefill(rid)
            engine.publish(rid, v.round, AcceptDecision(torch.arange(len(ids)), torch.tensor(ids[1:]), 1))
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            engine.verify_batch([(rid, DraftTree.empty()) for rid in rids])
            times.append(1000 * (time.perf_counter() - t0))
            for rid in rids:
                engine.sessions[rid].pending = None  # measured only: nothing is published
    finally:
        for rid in rids:
            engine.close_session(rid)
    batch_ms = statistics.median(times[1:])
    one_ms = worker.measure_latency((batch,), repeats=repeats, prefix=prefix, taps=taps)[batch]
    return {
        "batch": batch,
        "prefix": round(statistics.fmean(prefixes)),
        "one_request_rows_ms": one_ms,
        "batched_requests_ms": batch_ms,
        "one_request_rows_tok_s": 1000 * batch / one_ms,
        "batched_requests_tok_s": 1000 * batch / batch_ms,
    }


def _median_bound(runs: list[dict]) -> dict:
    """One bound from several ``forward_bound`` runs: the median ms of each kind, and its tokens/s."""
    out = dict(runs[0])
    for kind in ("one_request_rows", "batched_requests"):
        out[f"{kind}_ms"] = statistics.median(r[f"{kind}_ms"] for r in runs)
        out[f"{kind}_tok_s"] = 1000 * out["batch"] / out[f"{kind}_ms"]
    return out


class _CountingCalls:
    """Target calls that count the round calls and run ``hook(call number)`` before each."""

    def __init__(self, calls: WorkerCalls, hook):
        self.calls, self.hook, self.rounds = calls, hook, 0

    def __call__(self, method: str, *args):
        if method == "step":  # the round's one target call (TargetWorker.step)
            self.rounds += 1
            self.hook(self.rounds)
        return self.calls(method, *args)


def long_prompt_case(eyas: Eyas, target: WorkerCalls, long_tokens: int, chunk: int | None, max_new_tokens: int) -> dict:
    """A short request sent beside a ``long_tokens``-token prompt (it arrives while the long one's
    first round runs): how many of its own rounds, and how long, until its first token; with chunked
    prefill (``chunk`` prompt rows a round) or with each prompt prefilled whole (``chunk`` None)."""
    text = " ".join(load_prompts(None, 80))
    long_ids = (eyas.encode(text) * (1 + long_tokens // 1000))[:long_tokens]
    short_ids = eyas.encode(REPETITIVE[1])
    seen: dict[str, tuple[float, int]] = {}
    state: dict = {}

    def first(rid):
        def on_tokens(tokens):
            if tokens and rid not in seen:
                seen[rid] = (time.perf_counter(), counting.rounds)
            return False

        return on_tokens

    def arrive(call):
        if call == 1 and "short" not in state:
            state["short"] = (
                time.perf_counter(),
                call,
                loop.submit(
                    "short", short_ids, max_new_tokens, "target", TreeSpec(), SamplingParams(), 0, first("short")
                ),
            )

    counting = _CountingCalls(target, arrive)
    loop = RoundLoop(
        counting,
        None,
        {},
        TreeWorkPolicy(Budgets(), speculate=False),
        LatencyCurve.from_points({1: 1.0}),
        max_prefill_rows=chunk,
    )
    try:
        t0 = time.perf_counter()
        long_out = loop.submit(
            "long", long_ids, max_new_tokens, "target", TreeSpec(), SamplingParams(), 0, first("long")
        ).result(timeout=1200)
        sent, call, fut = state["short"]
        short_out = fut.result(timeout=1200)
    finally:
        loop.close()
    return {
        "long_tokens": len(long_ids),
        "max_prefill_rows": chunk,
        "short_first_token_rounds": seen["short"][1] - call + 1,
        "short_ttft_s": seen["short"][0] - sent,
        "long_ttft_s": seen["long"][0] - t0,
        "long_tokens_out": len(long_out.token_ids),
        "short_tokens_out": short_out.token_ids,
    }


def run_policy(
    eyas: Eyas,
    policy: str,
    concurrency: int,
    prompts: list[str],
    max_new_tokens: int,
    curve,
    workers: tuple,
    bar,
    draft_points: list,
    max_prefill_rows: int | None = DEFAULT_PREFILL_CHUNK,
) -> dict:
    """One (policy, concurrency) level through the serving loop (``RoundLoop``) over in-process workers."""
    target, drafter, info = workers
    budgets = Budgets(max_batch=max(concurrency, 1), max_verify_rows=256)
    pol = {
        "target-only": lambda: TreeWorkPolicy(budgets, speculate=False),
        "prompt-length": lambda: PromptLengthPolicy(budgets),
        "tree-work": lambda: TreeWorkPolicy(budgets),
    }[policy]()
    speculative = policy != "target-only"
    method = "eagle3" if speculative else "target"
    tree = info["eagle3"]["default_tree"] if speculative else TreeSpec()  # what serving gives a request
    rounds: dict[int, list[int]] = {}  # round start -> each published request's verify rows
    first: dict[str, float] = {}
    finished_at: dict[str, float] = {}

    decode_rounds: dict[int, list] = {}  # rounds that prefilled nothing: start -> [wall s, tokens, requests]

    def on_round(rec) -> None:
        rounds.setdefault(rec.start_ns, []).append(rec.flat.num_rows if rec.flat is not None else 1)
        if not loop.last_prefill_rows:
            wall = rec.draft_s + rec.pack_s + rec.verify_s + rec.publish_s
            r = decode_rounds.setdefault(rec.start_ns, [wall, 0, 0, []])
            r[1] += rec.decision.num_new_tokens
            r[2] += 1
            live = loop.live[rec.request_id]
            r[3].append(len(live.prompt_ids) + len(live.out))  # the context this row decoded over

    loop = RoundLoop(
        target,
        drafter if speculative else None,
        info if speculative else {},
        pol,
        curve,
        on_round=on_round,
        on_finish=lambda rid, _: finished_at.setdefault(rid, time.perf_counter()),
        draft_cost=DraftCost.from_points(draft_points) if policy == "tree-work" else DraftCost(),
        max_prefill_rows=max_prefill_rows,
    )
    queue = [(f"{policy}-{concurrency}-{i}", eyas.encode(p)) for i, p in enumerate(prompts)]
    futures: dict[concurrent.futures.Future, str] = {}
    results = {}

    def submit() -> None:
        rid, ids = queue.pop(0)

        def on_tokens(tokens: list[int]) -> bool:
            if tokens:
                first.setdefault(rid, time.perf_counter())
            return False

        futures[loop.submit(rid, ids, max_new_tokens, method, tree, SamplingParams(), 0, on_tokens)] = rid

    t0 = time.perf_counter()
    try:
        while queue and len(futures) < concurrency:
            submit()
        while futures:  # closed loop: whenever one finishes, the next is submitted
            done, _ = concurrent.futures.wait(list(futures), return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                results[futures.pop(f)] = f.result()
                bar.update(1)
                if queue:
                    submit()
    finally:
        loop.close()
    wall = time.perf_counter() - t0
    per_tok = [1000 * (finished_at[rid] - first[rid]) / max(len(r.token_ids) - 1, 1) for rid, r in results.items()]
    tokens = sum(len(r.token_ids) for r in results.values())
    batches = list(rounds.values())
    decode_s = sum(w for w, _, _, _ in decode_rounds.values())
    full = [(w, t, c) for w, t, n, c in decode_rounds.values() if n == concurrency]  # every request decoding
    full_s = sum(w for w, _, _ in full)
    # the contexts of the full round whose longest context is the median one (for the bound at them)
    full_contexts = sorted((c for _, _, c in full), key=max)[len(full) // 2] if full else None
    return {
        "policy": policy,
        "decode_rounds": len(decode_rounds),
        "full_decode_rounds": len(full),
        "full_decode_tok_s": sum(t for _, t, _ in full) / full_s if full_s else 0.0,
        "full_decode_contexts": full_contexts,
        "decode_tok_s": sum(t for _, t, _, _ in decode_rounds.values()) / decode_s if decode_s else 0.0,
        "decode_mean_batch": statistics.fmean(n for _, _, n, _ in decode_rounds.values()) if decode_rounds else 0.0,
        "concurrency": concurrency,
        "requests": len(results),
        "wall_s": wall,
        "tokens": tokens,
        "throughput": tokens / wall,
        "per_token_ms": per_tok,
        "lengths": [len(r.token_ids) for r in results.values()],
        "per_token_p50_ms": percentile(per_tok, 50),
        "per_token_p99_ms": percentile(per_tok, 99),
        "rounds": len(batches),
        "mean_batch": statistics.fmean(len(b) for b in batches),
        "mean_verify_rows": statistics.fmean(sum(b) for b in batches),
        "speculative_rounds": sum(1 for r in results.values() for x in r.rounds if x.tree_nodes),
        "tree": [tree.expand_width, tree.max_depth, tree.verify_budget] if speculative else None,
        "curve_end": loop.curve.to_dict(),
        "draft_cost_end": loop.draft_cost.to_dict(),
        "outputs": {rid.split("-")[-1]: r.token_ids for rid, r in results.items()},
    }


def plot(rows: list[dict], curve: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    axes[0].plot(curve["rows"], curve["ms"], "o-")
    axes[0].set(title="verify latency curve", xlabel="total verify rows", ylabel="ms", xscale="log")
    for p in POLICIES:
        rs = [r for r in rows if r["policy"] == p]
        axes[1].plot([r["concurrency"] for r in rs], [r["goodput"] for r in rs], "o-", label=p)
        axes[2].plot([r["concurrency"] for r in rs], [r["per_token_p99_ms"] for r in rs], "o-", label=p)
    axes[1].set(title="goodput (tokens/s within the SLO)", xlabel="concurrency", xscale="log")
    axes[2].set(title="p99 per-token latency (ms)", xlabel="concurrency", xscale="log")
    for ax in axes[1:]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, help="requests per level (default: 2 x concurrency, at least 4)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=24, help="MT-bench prompts in the mix")
    ap.add_argument(
        "--slo-ms-per-token",
        type=float,
        help="the latency target of goodput: mean ms per output token after the first "
        "(default: 8x the target-only p50 at the lowest concurrency of this run)",
    )
    ap.add_argument(
        "--policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help="a subset to run (target-only always runs: it is the baseline)",
    )
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS)
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="compute dtype at precision fp32"
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (precision fp32)")
    ap.add_argument("--threads", type=int)
    ap.add_argument(
        "--max-prefill-rows",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help="prompt rows a round prefills, all requests together (chunked prefill)",
    )
    ap.add_argument(
        "--long-prompt",
        type=int,
        default=2000,
        help="the long-prompt case: a short request beside a prompt this long (0: skip)",
    )
    ap.add_argument("--json", default=str(RESULTS / "scheduler.json"))
    args = ap.parse_args(argv)
    from tqdm import tqdm

    if placement_refused(args.device, args.dtype, args.precision):
        return 2

    warnings.filterwarnings("ignore")
    set_threads(args.threads)
    # every load, measurement and round runs on the process's one compute thread (eyas.compute)
    eyas = compute.run(Eyas, precision=args.precision, dtype=args.dtype, device=args.device)
    handle = compute.run(eyas.drafter, "eagle3")
    target_worker = TargetWorker(eyas.model)
    print("measuring the verify latency curve ...", flush=True)
    curve = compute.run(measure, target_worker, handle.taps)
    print("curve (rows: ms): " + ", ".join(f"{r}: {m:.0f}" for r, m in zip(curve.rows, curve.ms)), flush=True)
    # the forward bound over contexts as long as the workload's: its mean prompt plus half an answer
    context = int(statistics.fmean(len(eyas.encode(p)) for p in workload(32, args.limit))) + args.max_new_tokens // 2
    bound = compute.run(forward_bound, target_worker, (), prefix=context)
    bounds = [bound]
    print(
        f"forward bound at 16 rows, {context}-token contexts: one request's 16-row verify {bound['one_request_rows_ms']:.1f} ms "
        f"({bound['one_request_rows_tok_s']:.0f} tok/s); 16 requests' 1-row decodes in one forward "
        f"{bound['batched_requests_ms']:.1f} ms ({bound['batched_requests_tok_s']:.0f} tok/s)",
        flush=True,
    )
    start_curve = curve.to_dict()
    print("measuring the draft cost ...", flush=True)
    draft_points = compute.run(handle.engine.measure_cost, handle.default_tree, depths=(1, 2, 3, 4, 5), batch=8)
    start_draft = DraftCost.from_points(draft_points)
    print(
        "draft cost (depth, draft rows: ms): "
        + ", ".join(f"({d}, {r}): {m:.0f}" for d, r, m in draft_points)
        + f"; fit {start_draft.to_dict()}",
        flush=True,
    )
    drafter_worker = DrafterWorker(
        {"eagle3": handle.engine}, eyas.model.cfg.vocab_size, {"eagle3": handle.source}, {"eagle3": handle.default_tree}
    )
    drafter_worker.draft_points["eagle3"] = draft_points
    workers = (
        WorkerCalls(target_worker, 600, local=True),
        WorkerCalls(drafter_worker, 600, local=True, drafter=True),
        drafter_worker.info(),
    )
    policies = [p for p in POLICIES if p == "target-only" or p in args.policies]
    levels = [(c, args.requests or max(4, 2 * c)) for c in args.concurrency]
    rows = []
    with tqdm(total=len(policies) * sum(n for _, n in levels), desc="requests", unit="req") as bar:
        for i, (c, n) in enumerate(levels):
            prompts = workload(n, args.limit)
            order = policies[i % len(policies) :] + policies[: i % len(policies)]
            for p in order:
                rows.append(
                    run_policy(
                        eyas,
                        p,
                        c,
                        prompts,
                        args.max_new_tokens,
                        curve.copy(),
                        workers,
                        bar,
                        draft_points,
                        args.max_prefill_rows,
                    )
                )
    # the bound three times more after the policies ran, alternating with the same forward at the
    # contexts of one of target-only's full 16-request decode rounds (ragged, so padded to the
    # longest in the store's one attention call); the ratios use the medians (this machine's forward
    # time drifts by a fifth); every measurement is printed and saved
    own_contexts = next(
        (
            r["full_decode_contexts"]
            for r in rows
            if r["policy"] == "target-only" and r["concurrency"] == 16 and r["full_decode_contexts"]
        ),
        None,
    )
    owns = []
    for _ in range(3):
        bounds.append(compute.run(forward_bound, target_worker, (), prefix=context))
        if own_contexts:
            owns.append(compute.run(forward_bound, target_worker, (), prefixes=own_contexts))
    bound, own = _median_bound(bounds), _median_bound(owns) if owns else None
    rows.sort(key=lambda r: (r["concurrency"], POLICIES.index(r["policy"])))
    low = min(c for c, _ in levels)
    slo = (
        args.slo_ms_per_token
        or 8 * next(r for r in rows if r["concurrency"] == low and r["policy"] == "target-only")["per_token_p50_ms"]
    )
    for r in rows:  # goodput: tokens/s of the requests that met the latency target
        met = [n for n, ms in zip(r["lengths"], r["per_token_ms"]) if ms <= slo]
        r["goodput"], r["slo_met"] = sum(met) / r["wall_s"], len(met)
    identical = {}
    for c, _ in levels:
        base = next(r for r in rows if r["concurrency"] == c and r["policy"] == "target-only")["outputs"]
        for r in rows:
            if r["concurrency"] == c:
                r["identical_to_target_only"] = sum(r["outputs"][k] == base[k] for k in base)
                to = next(x for x in rows if x["concurrency"] == c and x["policy"] == "target-only")
                r["throughput_vs_target_only"] = r["throughput"] / to["throughput"]
                pl = next((x for x in rows if x["concurrency"] == c and x["policy"] == "prompt-length"), None)
                r["goodput_vs_prompt_length"] = (
                    None if pl is None else r["goodput"] / pl["goodput"] if pl["goodput"] else float("inf")
                )
                r["throughput_vs_prompt_length"] = None if pl is None else r["throughput"] / pl["throughput"]
        identical[c] = all(r["identical_to_target_only"] == r["requests"] for r in rows if r["concurrency"] == c)

    def ratio(x):
        return "     -" if x is None else f"{x:>5.2f}x"

    print(
        f"\n{'policy':<14} {'C':>3} {'req':>4} {'tok/s':>7} {'vs TO':>6} {'vs PL':>6} {'goodput':>8} {'vs PL':>6} "
        f"{'p50 ms/t':>9} {'p99 ms/t':>9} {'batch':>6} {'rows':>6} {'spec rd':>7} {'same':>5}"
    )
    for r in rows:
        print(
            f"{r['policy']:<14} {r['concurrency']:>3} {r['requests']:>4} {r['throughput']:>7.1f} "
            f"{ratio(r['throughput_vs_target_only'])} {ratio(r['throughput_vs_prompt_length'])} {r['goodput']:>8.1f} "
            f"{ratio(r['goodput_vs_prompt_length'])} {r['per_token_p50_ms']:>9.0f} {r['per_token_p99_ms']:>9.0f} "
            f"{r['mean_batch']:>6.1f} {r['mean_verify_rows']:>6.1f} {r['speculative_rounds']:>7} "
            f"{r['identical_to_target_only']:>2}/{r['requests']}"
        )
    print(
        f"\nforward-bound rate at 16 rows, the median of one run before and three after: {bound['one_request_rows_tok_s']:.0f} tok/s "
        f"(one request's 16-row verify; "
        + " and ".join(f"{b['one_request_rows_tok_s']:.0f}" for b in bounds)
        + f"), {bound['batched_requests_tok_s']:.0f} tok/s (16 requests in one forward; "
        + " and ".join(f"{b['batched_requests_tok_s']:.0f}" for b in bounds)
        + ")"
    )
    for r in rows:
        if r["policy"] == "target-only" and r["concurrency"] == 16:
            r["vs_forward_bound"] = {
                "one_request_rows": r["decode_tok_s"] / bound["one_request_rows_tok_s"],
                "batched_requests": r["decode_tok_s"] / bound["batched_requests_tok_s"],
                "full_one_request_rows": r["full_decode_tok_s"] / bound["one_request_rows_tok_s"],
                "full_batched_requests": r["full_decode_tok_s"] / bound["batched_requests_tok_s"],
            }
            print(
                f"target-only at C=16, rounds that prefilled nothing ({r['decode_rounds']}, mean batch "
                f"{r['decode_mean_batch']:.1f}): {r['decode_tok_s']:.1f} tok/s = "
                f"{r['vs_forward_bound']['one_request_rows']:.2f}x and {r['vs_forward_bound']['batched_requests']:.2f}x "
                f"of them (all rounds, prefills included: {r['throughput']:.1f} tok/s)"
            )
            print(
                f"  of those, the {r['full_decode_rounds']} rounds in which all 16 requests decoded: "
                f"{r['full_decode_tok_s']:.1f} tok/s = {r['vs_forward_bound']['full_one_request_rows']:.2f}x and "
                f"{r['vs_forward_bound']['full_batched_requests']:.2f}x"
            )
            if own is not None and r["full_decode_contexts"] is own_contexts:
                # what is left of the gap at the round's own contexts is the loop's
                r["forward_at_own_contexts"], r["forward_at_own_contexts_runs"] = own, owns
                r["vs_forward_bound"]["full_at_own_contexts"] = r["full_decode_tok_s"] / own["batched_requests_tok_s"]
                print(
                    f"  16 requests' decodes in one forward at such a round's contexts ({min(own_contexts)}"
                    f"-{max(own_contexts)} tokens, mean {own['prefix']}): {own['batched_requests_ms']:.1f} ms, the "
                    f"median of "
                    + ", ".join(f"{b['batched_requests_ms']:.1f}" for b in owns)
                    + f" ({own['batched_requests_tok_s']:.0f} tok/s); the full rounds ran at "
                    f"{r['vs_forward_bound']['full_at_own_contexts']:.2f}x of it"
                )
    long_cases = []
    if args.long_prompt:
        print(f"\nlong-prompt case: a short request beside a {args.long_prompt}-token prompt", flush=True)
        for chunk in (args.max_prefill_rows, None):
            case = long_prompt_case(eyas, workers[0], args.long_prompt, chunk, args.max_new_tokens)
            base = compute.run(
                generate, eyas.target_engine(()), eyas.encode(REPETITIVE[1]), max_new_tokens=args.max_new_tokens
            )
            case["short_identical_to_target_only"] = case.pop("short_tokens_out") == base.token_ids
            long_cases.append(case)
            print(
                f"  max_prefill_rows {str(chunk):>5}: the short request's first token after "
                f"{case['short_first_token_rounds']} of its rounds, {case['short_ttft_s']:.2f} s "
                f"(the long prompt's first token at {case['long_ttft_s']:.1f} s); identical to target-only: "
                f"{case['short_identical_to_target_only']}",
                flush=True,
            )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("outputs")
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "precision": args.precision,
                "dtype": args.dtype,
                "device": args.device,
                "slo_ms_per_token": slo,
                "max_new_tokens": args.max_new_tokens,
                "max_prefill_rows": args.max_prefill_rows,
                "forward_bound": bound,
                "forward_bounds": bounds,
                "long_prompt": long_cases,
                "curve_at_start": start_curve,
                "draft_points_at_start": draft_points,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, curve.to_dict(), out.with_suffix(".png"))
    print(f"goodput latency target: {slo:.0f} ms per output token")
    parts = []
    for c, _ in levels:
        tw = next((r for r in rows if r["concurrency"] == c and r["policy"] == "tree-work"), None)
        if tw is not None:
            vs_pl = (
                ""
                if tw["goodput_vs_prompt_length"] is None
                else f", goodput {tw['goodput_vs_prompt_length']:.2f}x prompt-length's"
            )
            parts.append(f"C={c}: tree-work throughput {tw['throughput_vs_target_only']:.2f}x target-only's{vs_pl}")
    print(
        f"\nsummary: {'; '.join(parts) or 'tree-work not run'}; greedy outputs identical to target-only at "
        f"every level: {all(identical.values())}; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
