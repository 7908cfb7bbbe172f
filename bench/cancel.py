"""Cancellation: how soon a client that leaves mid-answer frees its request's sessions.

One run starts a local Ray and the Eyas application (fixed-tree scheduler, eagle3), optionally with
``--busy`` busy-loop processes beside it (a loaded machine), then alternates two ways of leaving a
long answer ("Count from 1 to 300 ...", 400 tokens) after its first two chunks:

    close         the client only cancels its gRPC call (what a plain gRPC client does); the signal
                  goes client -> Serve's gRPC proxy -> ingress -> target replica
    close+Cancel  ``EyasClient.stream``: the call is cancelled *and* the ``Cancel`` RPC names the
                  request (ingress -> registry -> the target replica's next report)

Per trial: seconds from leaving until no worker holds a session, and whether the cancel was lost:
the request finished by itself, or not within ``--wait-s`` (the bench then stops it by name so that
it does not load the next trials). With 2 busy-loop processes on a 2-core machine even a cancel that
arrives takes 10-17 s to free the sessions, too close to ``--wait-s`` to tell; with 1 it takes ~1 s.
Printed as a table with each mode's lost fraction and median free time as a ratio of the ``close``
baseline of the same run.

Run:
    .venv/bin/python bench/cancel.py                    # 20 trials per mode, 1 busy-loop process
    .venv/bin/python bench/cancel.py --trials 6 --busy 0

Writes bench/results/cancel.json and .png (free time per trial and mode).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import start_local  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Count from 1 to 300, one number per line, and say nothing else."
MAX_NEW_TOKENS = 400
MODES = ("close", "close+Cancel")


def wait_finished(client, before: dict, since: float, wait_s: float) -> tuple[float | None, str | None]:
    """(seconds from ``since`` until every session is free, the new finish reason), or Nones at ``wait_s``."""
    freed_s = None
    while time.monotonic() - since < wait_s:
        if freed_s is None and client.idle():
            freed_s = time.monotonic() - since
        after = client.finish_counts()
        new = {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
        if new and freed_s is not None:
            return freed_s, max(new, key=new.get)
        time.sleep(0.1)
    return None, None


def one_trial(client, mode: str, wait_s: float) -> dict:
    """Leave after two chunks; wait until the request's finish is recorded and every session is free."""
    before = client.finish_counts()
    name = uuid.uuid4().hex
    if mode == "close":
        request = client.request(prompt=PROMPT, method="eagle3", max_new_tokens=MAX_NEW_TOKENS, request_id=name)
        call = client.stub.GenerateStream(request, metadata=client.metadata, timeout=600)
        next(call), next(call)
        left = time.monotonic()
        call.cancel()
    else:
        stream = client.stream(prompt=PROMPT, method="eagle3", max_new_tokens=MAX_NEW_TOKENS, request_id=name)
        next(stream), next(stream)
        left = time.monotonic()
        stream.close()
    freed_s, finish = wait_finished(client, before, left, wait_s)
    if finish is None:  # lost: stop it by name so that it does not load the next trials
        client.cancel(name)
        wait_finished(client, before, time.monotonic(), 600.0)
    return {"mode": mode, "freed_s": freed_s, "finish": finish, "lost": finish != "cancelled"}


def plot(trials: list[dict], wait_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, mode in enumerate(MODES):
        ts = [t for t in trials if t["mode"] == mode]
        ys = [t["freed_s"] if t["freed_s"] is not None else wait_s for t in ts]  # lost: drawn at wait_s
        jitter = [0.3 * (k / max(len(ts) - 1, 1) - 0.5) for k in range(len(ts))]  # spread the points
        ax.scatter([i + j for j in jitter], ys, c=["tab:red" if t["lost"] else "tab:blue" for t in ts], s=18)
    ax.set_xticks(range(len(MODES)), MODES)
    ax.set_yscale("log")
    ax.set_ylabel("seconds until sessions are free")
    ax.set_title(f"leaving mid-answer (red: cancel lost, not stopped within {wait_s:g} s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per mode (alternating)")
    ap.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the server")
    ap.add_argument(
        "--wait-s",
        type=float,
        default=20.0,
        help="a request not finished this long after its client left counts as lost",
    )
    ap.add_argument("--json", default=str(RESULTS / "cancel.json"))
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from eyas.serve.client import EyasClient

    print("starting a local Ray and the Eyas application ...", flush=True)
    address, stop = start_local({"methods": ["eagle3"], "scheduler": "prompt-length", "torch_threads": 1})
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    trials = []
    try:
        with (
            EyasClient(address, timeout_s=600) as client,
            tqdm(total=2 * args.trials, desc="trials", unit="trial") as bar,
        ):
            client.generate(prompt="Hi!", method="eagle3", max_new_tokens=4)  # warm-up
            for i in range(args.trials):
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    trials.append(one_trial(client, mode, args.wait_s))
                    bar.update()
    finally:
        for p in busy:
            p.kill()
        stop()
    rows = []
    for mode in MODES:
        ts = [t for t in trials if t["mode"] == mode]
        freed = [t["freed_s"] for t in ts if t["freed_s"] is not None]
        rows.append(
            {
                "mode": mode,
                "trials": len(ts),
                "lost": sum(t["lost"] for t in ts),
                "freed_p50_s": statistics.median(freed) if freed else None,
                "freed_max_s": max(freed) if freed else None,
                "never_freed": len(ts) - len(freed),
            }
        )
    base = rows[0]
    print(f"\n{'mode':<13} {'trials':>6} {'lost':>5} {'free p50 s':>10} {'free max s':>10} {'p50 vs close':>12}")
    for r in rows:
        ratio = (r["freed_p50_s"] / base["freed_p50_s"]) if r["freed_p50_s"] and base["freed_p50_s"] else float("nan")
        r["p50_vs_close"] = ratio
        print(
            f"{r['mode']:<13} {r['trials']:>6} {r['lost']:>5} {r['freed_p50_s'] or float('nan'):>10.2f} "
            f"{r['freed_max_s'] or float('nan'):>10.2f} {ratio:>11.2f}x"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "cpus": os.cpu_count(),
                "busy": args.busy,
                "wait_s": args.wait_s,
                "rows": rows,
                "trials": trials,
            },
            indent=1,
        )
    )
    plot(trials, args.wait_s, out.with_suffix(".png"))
    print(
        f"\nsummary: {rows[0]['lost']}/{rows[0]['trials']} bare closes and {rows[1]['lost']}/{rows[1]['trials']} "
        f"close+Cancel lost their cancel (not stopped within --wait-s); wrote {out} and {out.with_suffix('.png')}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
