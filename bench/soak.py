"""Soak: many streaming clients against the Eyas Serve app for minutes; every answer checked.

Starts a local Ray and the app (or uses ``--server``), computes each prompt's greedy target-only
answer in-process first (the exactness reference), then runs ``--clients`` threads for
``--duration`` seconds. Each thread streams greedy requests (MT-bench first turns, methods rotating
over ``--methods``) through ``EyasClient.stream``, one after another, and every answer is compared
token for token with the reference. At the end the leak invariant is checked (no session left on
any worker).

Prints, every 30 s and at the end: requests done, errors (with their first messages), mismatches,
tokens/s, p50/p99 latency; exits 1 if any request failed or differed. ``--json`` writes the summary.

Run:
    .venv/bin/python bench/soak.py                                   # 64 clients, 5 minutes, fp16w
    .venv/bin/python bench/soak.py --clients 16 --duration 60 --precision fp32
    .venv/bin/python bench/soak.py --server 127.0.0.1:9000           # a running `eyas serve`
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import load_prompts, placement_refused  # noqa: E402
from serve_load import start_local  # noqa: E402

from eyas.experiments.sim import percentile  # noqa: E402


def reference_answers(
    prompts: list[str], max_new_tokens: int, precision: str, dtype: str = "float32", device: str = "cpu"
) -> dict[str, list[int]]:
    """Greedy target-only tokens of each prompt, in-process, at the served precision, dtype and device."""
    from eyas.protocol.schema import parse_request
    from eyas.runtime import Eyas

    eyas = Eyas(precision=precision, dtype=dtype, device=device)
    return {
        p: eyas.generate(parse_request(prompt=p, method="target", max_new_tokens=max_new_tokens))[1]["token_ids"]
        for p in prompts
    }


class Tally:
    """The soak's counts; one lock, written by every client thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.done = self.tokens = 0
        self.errors: list[str] = []
        self.mismatches: list[str] = []
        self.latencies: list[float] = []

    def add(self, latency: float, tokens: int, error: str | None, mismatch: str | None) -> None:
        with self.lock:
            self.done += 1
            self.tokens += tokens
            self.latencies.append(latency)
            if error:
                self.errors.append(error)
            if mismatch:
                self.mismatches.append(mismatch)

    def line(self, elapsed: float) -> str:
        with self.lock:
            lat = sorted(self.latencies)
            return (
                f"{elapsed:6.0f} s: {self.done} requests, {len(self.errors)} errors, {len(self.mismatches)} "
                f"mismatches, {self.tokens / max(elapsed, 1e-9):.1f} tok/s, latency p50 "
                f"{percentile(lat, 50):.1f} s p99 {percentile(lat, 99):.1f} s"
            )


def client_loop(
    address: str,
    index: int,
    prompts: list[str],
    methods: list[str],
    reference: dict,
    n: int,
    deadline: float,
    tally: Tally,
) -> None:
    from eyas.serve.client import EyasClient

    k = index
    with EyasClient(address, timeout_s=600) as client:
        while time.monotonic() < deadline:
            prompt, method = prompts[k % len(prompts)], methods[k % len(methods)]
            k += 1
            t0 = time.monotonic()
            tokens, error = [], None
            try:
                chunks = list(client.stream(prompt=prompt, method=method, max_new_tokens=n))
                tokens = [t for c in chunks for t in c.token_ids]
                if chunks and chunks[-1].finish_reason == "error":
                    error = f"{method}: finish_reason error: {chunks[-1].text[:120]}"
            except Exception as err:  # noqa: BLE001 - counted, printed at the end
                error = f"{method}: {type(err).__name__}: {str(err)[:120]}"
            mismatch = None
            if error is None and tokens != reference[prompt]:
                mismatch = f"{method} on {prompt[:40]!r}: {len(tokens)} tokens, differs from target-only"
            tally.add(time.monotonic() - t0, len(tokens), error, mismatch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--server", help="HOST:PORT of a running Eyas gRPC ingress (default: start a local one)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--limit", type=int, default=16, help="MT-bench prompts to cycle through")
    ap.add_argument("--methods", nargs="+", default=["eagle3", "target", "eagle1"])
    ap.add_argument("--precision", choices=("fp32", "fp16w", "int8"), default="fp16w")
    ap.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="compute dtype at precision fp32 (half precision is not exact on a real model)",
    )
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (precision fp32), the local app's device")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)

    prompts = load_prompts(None, args.limit)
    if placement_refused(args.device, args.dtype, args.precision):
        return 2
    print(f"reference answers for {len(prompts)} prompts ({args.precision}, in-process) ...", flush=True)
    reference = reference_answers(prompts, args.max_new_tokens, args.precision, args.dtype, args.device)
    stop, address = None, args.server
    if address is None:
        print("starting a local Ray and the Eyas application ...", flush=True)
        address, stop = start_local(
            {
                "methods": [m for m in ("eagle3", "eagle1") if m in args.methods],
                "precision": args.precision,
                "dtype": args.dtype,
                "device": args.device,
            }
        )
    tally = Tally()
    try:
        start = time.monotonic()
        deadline = start + args.duration
        threads = [
            threading.Thread(
                target=client_loop,
                daemon=True,
                args=(address, i, prompts, args.methods, reference, args.max_new_tokens, deadline, tally),
            )
            for i in range(args.clients)
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=30)
                if t.is_alive():
                    break
            print(tally.line(time.monotonic() - start), flush=True)
        elapsed = time.monotonic() - start
        from eyas.serve.client import EyasClient

        with EyasClient(address, timeout_s=60) as client:
            t_idle = time.monotonic()
            while not client.idle() and time.monotonic() - t_idle < 60:
                time.sleep(0.5)
            workers = client.stats()["workers"]
        leaks = [w for w in workers if w["live_sessions"] or w.get("kv_slots_allocated", 0)]
    finally:
        if stop is not None:
            stop()
    print(f"\nsoak: {args.clients} clients, {args.duration:.0f} s, {args.precision}, methods {args.methods}")
    print(tally.line(elapsed))
    for msg in tally.errors[:5] + tally.mismatches[:5]:
        print(f"  {msg}")
    print(f"leak invariant: {'held' if not leaks else f'{len(leaks)} workers hold sessions'}")
    summary = {
        "clients": args.clients,
        "duration_s": args.duration,
        "precision": args.precision,
        "methods": args.methods,
        "requests": tally.done,
        "errors": len(tally.errors),
        "mismatches": len(tally.mismatches),
        "tokens_per_s": tally.tokens / max(elapsed, 1e-9),
        "p50_latency_s": percentile(sorted(tally.latencies), 50),
        "p99_latency_s": percentile(sorted(tally.latencies), 99),
        "leaks": len(leaks),
        "first_errors": tally.errors[:5],
        "first_mismatches": tally.mismatches[:5],
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0 if not tally.errors and not tally.mismatches and not leaks else 1


if __name__ == "__main__":
    raise SystemExit(main())
