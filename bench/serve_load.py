"""Serving load: N concurrent clients (gRPC, the OpenAI API, or both) against the Eyas Serve app, speculative vs target-only.

One run starts a local Ray and the application of ray_configs/serve.yaml's defaults (or uses
``--server HOST:PORT``), then for each concurrency level (1, 4, 16 by default) and each method
(``target``: target-only decoding on the same TargetWorker; ``eagle3``: speculative) it sends
``--requests`` streaming requests over MT-bench first turns from that many concurrent clients
(threads, each with its own gRPC channel or ``openai`` client), in a rotating method order so that the
noise of a shared machine hits both alike. Greedy, ``--max-new-tokens`` tokens each. ``--api`` picks
the front doors: ``grpc`` (``EyasClient.stream``), ``openai`` (the real ``openai`` client streaming
``/v1/chat/completions``, ``extra_body={"method": ...}``), or both (the default), in one run.

Per (method, concurrency):
    p50 / p99 latency     request start -> last chunk, seconds
    p50 / p99 TTFT        request start -> first chunk (the prompt's prefill and its first token)
    p50 / p99 per-token   latency / new tokens
    tok/s                 all new tokens / the level's wall time (throughput)
    tau                   new tokens per target forward (from the server's stats)
    hop ms/round          time per round outside the draft and verify forwards: the Ray calls, the
                          message encoding and the scheduling of this replica (server stats)
    speedup               tok/s against target-only at the same concurrency, in this run

Run:
    .venv/bin/python bench/serve_load.py                               # 1, 4, 16 clients, 32 tokens
    .venv/bin/python bench/serve_load.py --concurrency 1 4 --requests 8 --max-new-tokens 64
    .venv/bin/python bench/serve_load.py --server 127.0.0.1:9000 --http-url http://127.0.0.1:8000  # `eyas serve`
    .venv/bin/python bench/serve_load.py --api openai                   # the OpenAI API only
    .venv/bin/python bench/serve_load.py --precision fp16w --json bench/results/serve_load-fp16w.json

Writes bench/results/serve_load.json and .png (latency, TTFT and throughput against concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import load_prompts  # noqa: E402

from eyas.experiments.sim import percentile  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("target", "eagle3")
APIS = ("grpc", "openai")
HTTP_PORT = 8765  # Serve's HTTP proxy of the local app (the OpenAI API)
MODEL = "smollm2-135m"


def one_request(address: str, prompt: str, method: str, max_new_tokens: int) -> dict:
    from eyas.serve.client import EyasClient

    with EyasClient(address, timeout_s=1800) as client:
        t0 = time.perf_counter()
        first = None
        tokens = 0
        stats = None
        for chunk in client.stream(prompt=prompt, method=method, max_new_tokens=max_new_tokens):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - t0
            tokens += len(chunk.token_ids)
            if chunk.finish_reason:
                stats = chunk.stats
        latency = time.perf_counter() - t0
    return {
        "latency_s": latency,
        "ttft_s": first or latency,
        "new_tokens": tokens,
        "tau": stats.tau if stats else 0.0,
        "rounds": stats.rounds if stats else 0,
        "hop_ms": stats.hop_ms if stats else 0.0,
        "fallback": bool(stats and stats.drafter_fallback),
    }


def one_openai_request(http_url: str, prompt: str, method: str, max_new_tokens: int) -> dict:
    """The same request through the real openai client, streamed, with the usage chunk."""
    import openai

    client = openai.OpenAI(
        base_url=f"{http_url}/v1", api_key=os.environ.get("EYAS_API_KEY", "unused"), max_retries=0, timeout=1800
    )
    t0 = time.perf_counter()
    first = None
    last = None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_new_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"method": method},
    ):
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        last = chunk
    latency = time.perf_counter() - t0
    spec = (last.model_extra or {}).get("eyas", {}) if last is not None else {}
    tokens = last.usage.completion_tokens if last is not None and last.usage else 0
    return {
        "latency_s": latency,
        "ttft_s": first or latency,
        "new_tokens": tokens,
        "tau": spec.get("tokens_per_target_forward", 0.0),
        "rounds": spec.get("target_forwards", 0),
        "hop_ms": 0.0,
        "fallback": bool(spec.get("drafter_fallback")),
    }


def run_level(
    address: str,
    prompts: list[str],
    method: str,
    concurrency: int,
    requests: int,
    max_new_tokens: int,
    bar,
    api: str = "grpc",
    http_url: str | None = None,
) -> dict:
    jobs = [prompts[i % len(prompts)] for i in range(requests)]
    lock = threading.Lock()

    def job(p):
        r = (
            one_request(address, p, method, max_new_tokens)
            if api == "grpc"
            else one_openai_request(http_url, p, method, max_new_tokens)
        )
        with lock:
            bar.update(1)
        return r

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(job, jobs))
    wall = time.perf_counter() - t0
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results]
    per_tok = [r["latency_s"] / max(r["new_tokens"], 1) for r in results]
    rounds = sum(r["rounds"] for r in results)
    return {
        "api": api,
        "method": method,
        "concurrency": concurrency,
        "requests": requests,
        "wall_s": wall,
        "tokens": sum(r["new_tokens"] for r in results),
        "tokens_per_s": sum(r["new_tokens"] for r in results) / wall,
        "latency_p50_s": percentile(lat, 50),
        "latency_p99_s": percentile(lat, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "per_token_p50_ms": 1000 * percentile(per_tok, 50),
        "per_token_p99_ms": 1000 * percentile(per_tok, 99),
        "tau": statistics.fmean(r["tau"] for r in results),
        "hop_ms_per_round": sum(r["hop_ms"] for r in results) / max(rounds, 1),
        "fallbacks": sum(r["fallback"] for r in results),
    }


def start_local(config: dict) -> tuple[str, callable]:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import socket

    import ray
    from ray import serve

    from eyas.serve.app import GRPC_SERVICER_FUNCTIONS, build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=256 * 1024**2,
        num_cpus=max(4, os.cpu_count() or 1),
    )
    serve.start(
        http_options={"host": "127.0.0.1", "port": HTTP_PORT},
        grpc_options={"port": port, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS},
    )
    serve.run(build_app(config), name="eyas", route_prefix="/")

    def stop():
        serve.shutdown()
        ray.shutdown()

    return f"127.0.0.1:{port}", stop


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for api, method in sorted({(r["api"], r["method"]) for r in rows}):
        rs = [r for r in rows if r["method"] == method and r["api"] == api]
        c = [r["concurrency"] for r in rs]
        name = f"{api} {method}"
        axes[0].plot(c, [r["latency_p50_s"] for r in rs], "o-", label=f"{name} p50")
        axes[0].plot(c, [r["latency_p99_s"] for r in rs], "x--", label=f"{name} p99")
        axes[1].plot(c, [r["ttft_p50_s"] for r in rs], "o-", label=f"{name} p50")
        axes[1].plot(c, [r["ttft_p99_s"] for r in rs], "x--", label=f"{name} p99")
        axes[2].plot(c, [r["tokens_per_s"] for r in rs], "o-", label=name)
    for ax, title in zip(axes, ("request latency (s)", "time to first token (s)", "throughput (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", help="HOST:PORT of a running Eyas gRPC ingress (default: start a local one)")
    ap.add_argument(
        "--http-url",
        help="the running app's HTTP address for --api openai (default: the local "
        "app's, or http://127.0.0.1:8000 with --server)",
    )
    ap.add_argument("--api", nargs="+", choices=APIS, default=list(APIS), help="front doors to drive (default: both)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, help="requests per level (default: max(4, concurrency))")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=16, help="MT-bench prompts to cycle through")
    ap.add_argument("--prompts", help='a .jsonl of {"prompt": ...} instead of MT-bench')
    ap.add_argument("--target-replicas", type=int, default=1)
    ap.add_argument("--drafter-replicas", type=int, default=1)
    ap.add_argument(
        "--precision",
        choices=("fp32", "fp16w", "int8"),
        default="fp32",
        help="the served target precision of the local app (both methods run at it)",
    )
    ap.add_argument("--json", default=str(RESULTS / "serve_load.json"))
    args = ap.parse_args(argv)

    from tqdm import tqdm

    prompts = load_prompts(args.prompts, args.limit)
    stop = None
    address = args.server
    http_url = args.http_url or (f"http://127.0.0.1:{HTTP_PORT}" if address is None else "http://127.0.0.1:8000")
    if address is None:
        print("starting a local Ray and the Eyas application ...", flush=True)
        address, stop = start_local(
            {
                "methods": ["eagle3"],
                "target_replicas": args.target_replicas,
                "drafter_replicas": args.drafter_replicas,
                "precision": args.precision,
            }
        )
    try:
        for method in METHODS:  # warm-up: first forwards, lazy engine set-up
            one_request(address, prompts[0], method, 4)
            if "openai" in args.api:
                one_openai_request(http_url, prompts[0], method, 4)
        levels = [(c, args.requests or max(4, c)) for c in args.concurrency]
        rows = []
        with tqdm(total=2 * len(args.api) * sum(n for _, n in levels), desc="requests", unit="req") as bar:
            for i, (c, n) in enumerate(levels):
                order = METHODS if i % 2 == 0 else METHODS[::-1]
                for api in args.api:
                    for method in order:
                        rows.append(run_level(address, prompts, method, c, n, args.max_new_tokens, bar, api, http_url))
    finally:
        if stop:
            stop()
    rows.sort(key=lambda r: (APIS.index(r["api"]), r["concurrency"], METHODS.index(r["method"])))
    base = {(r["api"], r["concurrency"]): r["tokens_per_s"] for r in rows if r["method"] == "target"}
    for r in rows:
        r["speedup_vs_target"] = r["tokens_per_s"] / base[r["api"], r["concurrency"]]
    head = (
        f"{'api':<6} {'method':<8} {'clients':>7} {'req':>4} {'tok/s':>7} {'speedup':>7} {'lat p50':>8} "
        f"{'lat p99':>8} {'ttft p50':>8} {'ttft p99':>8} {'ms/tok p50':>10} {'tau':>5} {'hop ms/rd':>9}"
    )
    print("\n" + head)
    for r in rows:
        print(
            f"{r['api']:<6} {r['method']:<8} {r['concurrency']:>7} {r['requests']:>4} {r['tokens_per_s']:>7.1f} "
            f"{r['speedup_vs_target']:>6.2f}x {r['latency_p50_s']:>8.2f} {r['latency_p99_s']:>8.2f} "
            f"{r['ttft_p50_s']:>8.2f} {r['ttft_p99_s']:>8.2f} {r['per_token_p50_ms']:>10.0f} {r['tau']:>5.2f} "
            f"{r['hop_ms_per_round']:>9.1f}"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "server": args.server,
                "precision": args.precision,
                "max_new_tokens": args.max_new_tokens,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, out.with_suffix(".png"))
    hop = (
        statistics.fmean(r["hop_ms_per_round"] for r in rows if r["method"] == "eagle3" and r["api"] == "grpc")
        if "grpc" in args.api
        else float("nan")
    )
    print(
        f"\nsummary: {len(rows)} levels; Ray hop cost {hop:.1f} ms per speculative round; "
        f"wrote {out} and {out.with_suffix('.png')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
