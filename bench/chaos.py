"""Chaos soak: streaming clients while target and drafter replicas are killed, one after another.

Starts a local Ray and the Eyas app (``--target-replicas``, one drafter replica), computes each prompt's
greedy target-only answer in-process (the exactness reference), then for ``--duration`` seconds runs
``--clients`` threads that stream greedy answers one after another, over gRPC (``EyasClient.stream``)
and over SSE (the official ``openai`` client) in turn, while a killer thread kills a replica every
``--kill-every`` seconds with ``ray.kill`` (the actor's process dies at once, as with SIGKILL): the
target and the drafter in turn (``--kill target drafter``; ``proxy`` adds Serve's HTTP/gRPC proxy).

Every finished stream is classified:
    ok          every token, in order, equal to the reference
    wrong       the tokens differ from the reference (a token the target did not decide, or past the end)
    duplicated  a chunk repeated tokens already received (gRPC: its first_token_index is below the count)
    lost        the stream ended in an error after some tokens
    refused     the stream ended in an error before any token
and a *stall* is a gap between two chunks of one stream longer than ``--stall-s`` (its length is kept).
Every request is appended to ``--log`` (JSONL) as it finishes, so a run cut short keeps its records and
``--resume`` adds a new run's to them (the plot draws the last run; the counts cover all); at
the end the leak invariant is checked (no session, no K/V slot on any worker), the counts are printed as
a table and a timeline plot (requests by outcome, kills, stalls) is written beside ``--json``.

    .venv/bin/python bench/chaos.py --duration 360 --clients 8 --kill-every 30     # the issue's soak
    .venv/bin/python bench/chaos.py --duration 300 --target-replicas 2             # a standby target
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import load_prompts  # noqa: E402
from serve_load import HTTP_PORT, start_local  # noqa: E402
from soak import reference_answers  # noqa: E402

from eyas.experiments.sim import percentile  # noqa: E402

OUTCOMES = ("ok", "wrong", "duplicated", "lost", "refused")
MODEL = "smollm2-135m"


class Record:
    """One request's stream as the client saw it."""

    def __init__(self, api: str, method: str, prompt: str, start: float):
        self.api, self.method, self.prompt, self.start = api, method, prompt, start
        self.tokens: list[int] = []
        self.text = ""
        self.arrivals: list[float] = []
        self.duplicated = False
        self.error: str | None = None
        self.finish: str | None = None

    def chunk(self, now: float) -> None:
        self.arrivals.append(now)

    def outcome(self, reference: list[int], want_text: str) -> str:
        if self.error is not None:
            return "lost" if self.tokens or self.text else "refused"
        if self.duplicated:
            return "duplicated"
        if self.api == "grpc":
            return "ok" if self.tokens == reference else "wrong"
        return "ok" if self.text == want_text else "wrong"

    def stalls(self, stall_s: float) -> list[float]:
        times = [self.start, *self.arrivals]
        return [b - a for a, b in zip(times, times[1:]) if b - a > stall_s]


def grpc_stream(address: str, prompt: str, method: str, n: int, rec: Record) -> None:
    from eyas.serve.client import EyasClient

    with EyasClient(address, timeout_s=600) as client:
        call = client.stub.GenerateStream(
            client.request(prompt=prompt, method=method, max_new_tokens=n), metadata=client.metadata, timeout=600
        )
        for chunk in call:
            rec.chunk(time.monotonic())
            if chunk.token_ids and chunk.first_token_index < len(rec.tokens):
                rec.duplicated = True
            rec.tokens.extend(chunk.token_ids)
            rec.text += chunk.text
            if chunk.finish_reason:
                rec.finish = chunk.finish_reason
                if chunk.finish_reason == "error":
                    rec.error = chunk.text[:160]


def sse_stream(http_url: str, prompt: str, method: str, n: int, rec: Record) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{http_url}/v1", api_key="unused", max_retries=0, timeout=600)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=n,
        temperature=0,
        stream=True,
        extra_body={"method": method},
    )
    for chunk in stream:
        rec.chunk(time.monotonic())
        if chunk.choices:
            rec.text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].finish_reason:
                rec.finish = chunk.choices[0].finish_reason


def killer(kinds: list[str], every_s: float, deadline: float, kills: list[dict], stop: threading.Event, address: str):
    """Kill a replica of each kind in turn every ``every_s`` seconds until the deadline."""
    import ray

    from eyas.serve.client import EyasClient

    k = 0
    while not stop.wait(every_s) and time.monotonic() < deadline:
        kind = kinds[k % len(kinds)]
        k += 1
        try:
            if kind == "proxy":
                names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ProxyActor" in a["name"]]
                victim = random.choice(names)
                actor = ray.get_actor(victim["name"], namespace=victim["namespace"])
            else:
                with EyasClient(address, timeout_s=30) as client:
                    workers = [w for w in client.stats()["workers"] if w["kind"] == kind and w.get("ok")]
                alive = []
                for w in workers:
                    try:
                        alive.append(ray.get_actor(w["actor_name"], namespace=w["namespace"]))
                    except ValueError:
                        continue
                if not alive:
                    kills.append({"t": time.monotonic(), "kind": kind, "skipped": "no live replica"})
                    continue
                actor = random.choice(alive)
            ray.kill(actor)
            kills.append({"t": time.monotonic(), "kind": kind})
            print(f"  killed a {kind} replica", flush=True)
        except Exception as err:  # noqa: BLE001 - a kill that could not be made is recorded, the soak goes on
            kills.append({"t": time.monotonic(), "kind": kind, "skipped": f"{type(err).__name__}: {err}"[:160]})


def client_loop(index, args, address, http_url, prompts, texts, reference, deadline, records, lock, log):
    k = index
    while time.monotonic() < deadline:
        prompt, method = prompts[k % len(prompts)], args.methods[k % len(args.methods)]
        api = args.apis[k % len(args.apis)]
        k += 1
        rec = Record(api, method, prompt, time.monotonic())
        try:
            if api == "grpc":
                grpc_stream(address, prompt, method, args.max_new_tokens, rec)
            else:
                sse_stream(http_url, prompt, method, args.max_new_tokens, rec)
        except Exception as err:  # noqa: BLE001 - classified below
            rec.error = f"{type(err).__name__}: {str(err)[:160]}"
        outcome = rec.outcome(reference[prompt], texts[prompt])
        row = {
            "api": api,
            "method": method,
            "start": rec.start,
            "end": time.monotonic(),
            "outcome": outcome,
            "tokens": len(rec.tokens),
            "stalls_s": rec.stalls(args.stall_s),
            "error": rec.error,
            "finish": rec.finish,
        }
        with lock:
            records.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=360.0)
    ap.add_argument("--kill-every", type=float, default=30.0)
    ap.add_argument("--kill", nargs="+", default=["target", "drafter"], choices=("target", "drafter", "proxy"))
    ap.add_argument("--target-replicas", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--methods", nargs="+", default=["eagle3"])
    ap.add_argument("--apis", nargs="+", default=["grpc", "sse"], choices=("grpc", "sse"))
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--stall-s", type=float, default=2.0, help="a gap between chunks longer than this is a stall")
    ap.add_argument("--settle-s", type=float, default=180.0, help="how long the leak invariant may take to hold")
    ap.add_argument("--resume", action="store_true", help="count the requests an interrupted run left in --log")
    ap.add_argument("--json", type=Path, default=Path(__file__).resolve().parent / "results" / "chaos.json")
    ap.add_argument(
        "--log", type=Path, help="every request as JSONL, appended as it finishes (default: next to --json)"
    )
    args = ap.parse_args(argv)
    prompts = load_prompts(None, args.limit)
    print(f"reference answers for {len(prompts)} prompts ({args.precision}, in-process) ...", flush=True)
    reference = reference_answers(prompts, args.max_new_tokens, args.precision)
    from eyas.protocol.text import AnswerText
    from eyas.target.loader import load_tokenizer

    tok = load_tokenizer()
    texts = {p: AnswerText.of(tok, ids) for p, ids in reference.items()}
    print("starting a local Ray and the Eyas application ...", flush=True)
    address, stop_app = start_local(
        {
            "methods": [m for m in ("eagle3", "eagle1") if m in args.methods],
            "precision": args.precision,
            "target_replicas": args.target_replicas,
            "drafter_replicas": 1,
        }
    )
    http_url = f"http://127.0.0.1:{HTTP_PORT}"
    records: list[dict] = []
    kills: list[dict] = []
    lock = threading.Lock()
    log_path = args.log or args.json.with_suffix(".jsonl")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if args.resume and log_path.exists():  # an earlier, interrupted run's requests count toward this report
        records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
        print(f"resuming: {len(records)} requests from {log_path}", flush=True)
    elif log_path.exists():
        log_path.unlink()
    leaks = None
    try:
        with open(log_path, "a") as log:
            start = time.monotonic()
            deadline = start + args.duration
            stop = threading.Event()
            k = threading.Thread(target=killer, args=(args.kill, args.kill_every, deadline, kills, stop, address))
            k.start()
            threads = [
                threading.Thread(
                    target=client_loop,
                    daemon=True,
                    args=(i, args, address, http_url, prompts, texts, reference, deadline, records, lock, log),
                )
                for i in range(args.clients)
            ]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                time.sleep(min(30.0, max(deadline - time.monotonic(), 10.0)))  # past the deadline: every 10 s
                with lock:
                    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
                print(
                    f"{time.monotonic() - start:6.0f} s: {len(records)} requests {counts}, {len(kills)} kills",
                    flush=True,
                )
                if time.monotonic() > deadline + 600:
                    print("clients still running 10 minutes past the deadline: counted as stalled", flush=True)
                    break
            stop.set()
            k.join(timeout=60)
        from eyas.serve.client import EyasClient

        with EyasClient(address, timeout_s=60) as client:
            t_idle = time.monotonic()
            while time.monotonic() - t_idle < args.settle_s:  # stranded sessions are reclaimed after a grace
                try:
                    workers = client.stats()["workers"]
                    leaks = [w for w in workers if w.get("live_sessions") or w.get("kv_slots_allocated", 0)]
                    if not leaks:
                        break
                except Exception as err:  # noqa: BLE001 - a replica still restarting: ask again
                    print(f"  waiting for the replicas to settle ({type(err).__name__})", flush=True)
                time.sleep(2.0)
        for w in leaks or []:
            print(f"  leak: {json.dumps(w, default=str)[:600]}", flush=True)
    finally:
        stop_app()
    return report(args, records, kills, leaks, start)


def report(args, records: list[dict], kills: list[dict], leaks, start: float) -> int:
    counts = {o: sum(r["outcome"] == o for r in records) for o in OUTCOMES}
    stalls = [s for r in records for s in r["stalls_s"]]
    made = [k for k in kills if "skipped" not in k]
    print(
        f"\nchaos: {args.clients} clients, {args.duration:.0f} s, a kill every {args.kill_every:.0f} s of {args.kill}, "
        f"{args.target_replicas} target replica(s), {args.precision}, {args.methods}, {args.apis}"
    )
    print(f"{'requests':>9} " + " ".join(f"{o:>10}" for o in OUTCOMES) + f" {'kills':>6} {'stalls':>7} {'worst':>7}")
    print(
        f"{len(records):9d} "
        + " ".join(f"{counts[o]:10d}" for o in OUTCOMES)
        + f" {len(made):6d} {len(stalls):7d} {max(stalls, default=0):6.1f}s"
    )
    for api in args.apis:
        rs = [r for r in records if r["api"] == api]
        print(f"  {api}: " + ", ".join(f"{o} {sum(r['outcome'] == o for r in rs)}" for o in OUTCOMES))
    for r in [r for r in records if r["outcome"] != "ok"][:8]:
        print(f"  {r['outcome']}: {r['api']} {r['method']} {r['tokens']} tokens, {r['error'] or r['finish']}")
    print(
        f"leak invariant: {'held' if leaks == [] else 'not checked' if leaks is None else f'{len(leaks)} workers hold sessions'}"
    )
    summary = {
        "clients": args.clients,
        "duration_s": args.duration,
        "kill_every_s": args.kill_every,
        "kill": args.kill,
        "target_replicas": args.target_replicas,
        "precision": args.precision,
        "requests": len(records),
        "counts": counts,
        "kills": len(made),
        "stalls": len(stalls),
        "worst_stall_s": max(stalls, default=0.0),
        "p99_stall_s": percentile(sorted(stalls), 99) if stalls else 0.0,
        "leaks": None if leaks is None else len(leaks),
        "not_ok": [r for r in records if r["outcome"] != "ok"][:20],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary, indent=1))
    plot([r for r in records if r["start"] >= start], kills, start, args.json.with_suffix(".png"))  # this run
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    bad = counts["wrong"] + counts["duplicated"] + counts["lost"]
    return 0 if bad == 0 and leaks == [] else 1


def plot(records: list[dict], kills: list[dict], start: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"ok": "tab:green", "wrong": "tab:red", "duplicated": "tab:purple", "lost": "tab:orange", "refused": "k"}
    fig, ax = plt.subplots(figsize=(11, 4))
    for i, r in enumerate(sorted(records, key=lambda r: r["start"])):
        ax.plot([r["start"] - start, r["end"] - start], [i, i], color=colors[r["outcome"]], linewidth=1.2)
    for k in kills:
        if "skipped" not in k:
            ax.axvline(
                k["t"] - start, color="gray" if k["kind"] == "drafter" else "tab:blue", linestyle="--", linewidth=0.8
            )
    ax.set_xlabel("seconds (dashed: a replica killed; blue target, gray drafter)")
    ax.set_ylabel("request")
    ax.set_title("chaos soak: each request's stream, colored by outcome", fontsize=9)
    handles = [plt.Line2D([], [], color=c, label=o) for o, c in colors.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    raise SystemExit(main())
