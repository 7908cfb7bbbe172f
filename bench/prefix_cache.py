"""The prefix cache through ``eyas serve``: multi-turn chats and a shared system prompt, cache off
against cache on, in one run.

Workloads (greedy, the real ``openai`` client streaming ``/v1/chat/completions``):

    multi-turn      ``--conversations`` ShareGPT conversations (the train split, MT-bench excluded)
                    replayed turn by turn, ``--clients`` at a time: turn t sends the system prompt,
                    the earlier user turns with the model's *own* earlier answers, and the next user
                    message, so every turn after the first starts with the previous turn's prompt
                    and answer (what the cache can reuse)
                    (``--multi-system-repeat`` makes its system prompt an app's long one)
    system-prompt   one long system prompt (``--system-tokens``) before ``--questions`` MT-bench
                    first turns, ``--clients`` at a time

For each workload and cache setting (``prefix_cache_bytes`` 0, then the serve default) a fresh local
Ray and application are started. Reported per workload and setting:

    TTFT p50 / p99   request start -> first streamed token, over turns >= 2 (multi-turn) or all
                     requests after the first (system prompt)
    TTFT p50 long    multi-turn: over the later turns whose history (the previous turn's prompt and
                     answer, what the cache can hold) is at least ``--long-history`` tokens
    tok/s            generated tokens / the workload's wall time
    prefill rows     prompt tokens the target computed (prompt - cached), and the hit rate
                     (cached / prompt tokens)
    identical        answers equal to the cache-off run's, and tau (tokens per target forward,
                     from each response's ``eyas`` object) equal

    routing         the multi-turn conversations on two target replicas (target-only, no drafter),
                    sent turn by turn across conversations (every conversation's turn t before any
                    turn t + 1: users read before they write again; each turn's conversations in a
                    seeded random order, as users do not arrive in a fixed one),
                    Ray Serve's default router (power of two choices) against routing by prefix
                    (``target_router: prefix``): the hit rate each gets, the share of later turns'
                    histories reused (history hit rate), and its TTFT and tok/s

Run:
    .venv/bin/python bench/prefix_cache.py --json bench/results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import load_prompts  # noqa: E402
from serve_load import HTTP_PORT, MODEL, start_local  # noqa: E402

from eyas.experiments.sim import percentile  # noqa: E402
from eyas.serve.client import EyasClient  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM = (
    "You are Eyas, a helpful assistant for a travel company. Follow these rules in every answer. "
    "Be accurate and say so when you are unsure. Prefer short paragraphs and plain words. "
    "When a question is about prices, give ranges rather than exact figures. "
    "When a question is about safety, recommend official sources. "
)


def conversations(n: int, turns: int, max_user_chars: int, min_chars: int = 0) -> list[list[str]]:
    """The user messages of the first ``n`` ShareGPT train conversations with at least ``turns`` user
    turns whose first ``turns`` messages hold at least ``min_chars`` characters together."""
    from eyas.training.data import conversations as sharegpt

    out = []
    for _, msgs in sharegpt("train"):
        users = [m["content"][:max_user_chars] for m in msgs if m["role"] == "user"]
        if len(users) >= turns and sum(map(len, users[:turns])) >= min_chars:
            out.append(users[:turns])
        if len(out) >= n:
            break
    return out


def client_for():
    """A fresh OpenAI client of the local app (one per thread)."""
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key="x", max_retries=0, timeout=1800)


def chat(client, messages: list[dict], max_tokens: int, method: str) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage, extra = None, [], None, {}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"method": method},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
            extra = (chunk.model_extra or {}).get("eyas", {})
    return {
        "text": "".join(text),
        "ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
        "wall_s": time.perf_counter() - t0,
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": usage.prompt_tokens_details.cached_tokens,
        "completion_tokens": usage.completion_tokens,
        "tau": extra.get("mean_acceptance_length"),
    }


def with_history(records: list[dict]) -> list[dict]:
    """Each multi-turn record with ``history_tokens``: its previous turn's prompt and answer tokens
    (what the cache can hold for it; 0 on a first turn)."""
    last = {}
    for r in sorted(records, key=lambda r: (r["conversation"], r["turn"])):
        prev = last.get(r["conversation"])
        r["history_tokens"] = prev["prompt_tokens"] + prev["completion_tokens"] if prev else 0
        last[r["conversation"]] = r
    return records


def run_multi_turn(
    client_for, convs: list[list[str]], clients: int, max_tokens: int, method: str, system: str = SYSTEM
) -> list[dict]:
    def one(ci: int) -> list[dict]:
        client = client_for()
        messages = [{"role": "system", "content": system}]
        out = []
        for t, user in enumerate(convs[ci]):
            messages.append({"role": "user", "content": user})
            r = chat(client, messages, max_tokens, method)
            messages.append({"role": "assistant", "content": r["text"]})
            out.append(dict(r, conversation=ci, turn=t))
        return out

    with ThreadPoolExecutor(clients) as pool:
        return with_history([r for rs in pool.map(one, range(len(convs))) for r in rs])


def run_turn_by_turn(
    client_for, convs: list[list[str]], clients: int, max_tokens: int, method: str, seed: int = 0
) -> list[dict]:
    """Every conversation's turn t, ``clients`` at a time, before any conversation's turn t + 1: users
    who read an answer before they write again, while other users' requests run. (In a closed loop,
    where a client sends its next turn the moment its answer ends, power of two choices tends to
    send it to the replica that has just freed a slot: the one that served its previous turn.)"""
    history = [[{"role": "system", "content": SYSTEM}] for _ in convs]
    out: list[dict] = []

    def one(ci: int, t: int) -> dict:
        messages = history[ci] + [{"role": "user", "content": convs[ci][t]}]
        r = chat(client_for(), messages, max_tokens, method)
        history[ci] = messages + [{"role": "assistant", "content": r["text"]}]
        return dict(r, conversation=ci, turn=t)

    with ThreadPoolExecutor(clients) as pool:
        for t in range(len(convs[0])):
            order = list(range(len(convs)))
            random.Random(seed * 1000 + t).shuffle(order)
            out += list(pool.map(lambda ci, t=t: one(ci, t), order))
    return with_history(out)


def run_system_prompt(client_for, system: str, questions: list[str], clients: int, max_tokens: int, method: str):
    def one(qi: int) -> dict:
        r = chat(
            client_for(),
            [{"role": "system", "content": system}, {"role": "user", "content": questions[qi]}],
            max_tokens,
            method,
        )
        return dict(r, question=qi)

    first = one(0)  # the first request fills the cache (or not)
    with ThreadPoolExecutor(clients) as pool:
        return [first, *pool.map(one, range(1, len(questions)))]


def summarize(records: list[dict], wall: float, later: list[dict], long_history: int | None = None) -> dict:
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    ttft = [r["ttft_s"] for r in later]
    extra = {}
    if long_history is not None:
        long = [r["ttft_s"] for r in later if r["history_tokens"] >= long_history]
        history = sum(r["history_tokens"] for r in later)
        extra = {
            "long_history": long_history,
            "long_turns": len(long),
            "ttft_p50_long_s": statistics.median(long) if long else None,
            "mean_history_tokens_later": statistics.mean(r["history_tokens"] for r in later) if later else None,
            # the share of later turns' histories (previous prompt and answer) that came from the cache
            "history_hit_rate": min(sum(r["cached_tokens"] for r in later), history) / history if history else 0.0,
        }
    return {
        "requests": len(records),
        "ttft_p50_s": statistics.median(ttft) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "tok_s": sum(r["completion_tokens"] for r in records) / wall,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_rows": prompt - cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "mean_prompt_tokens_later": statistics.mean(r["prompt_tokens"] for r in later) if later else None,
        "wall_s": wall,
        **extra,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-user-chars", type=int, default=1500)
    p.add_argument(
        "--min-chars", type=int, default=0, help="conversations whose user turns hold at least this many characters"
    )
    p.add_argument("--questions", type=int, default=16)
    p.add_argument("--system-repeat", type=int, default=8, help="the system prompt's text repeated this often")
    p.add_argument(
        "--multi-system-repeat",
        type=int,
        default=1,
        help="the multi-turn workload's system prompt repeated this often (an app's long system prompt)",
    )
    p.add_argument(
        "--long-history",
        type=int,
        default=1000,
        help="TTFT p50 long: later turns with at least this many history tokens",
    )
    p.add_argument("--seed", type=int, default=0, help="the routing runs' arrival order")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--method", default="eagle3", choices=("target", "eagle3", "eagle1"))
    p.add_argument("--precision", default="fp16w")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the target replica")
    p.add_argument(
        "--routing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the multi-turn workload on two target replicas, default router against prefix routing",
    )
    p.add_argument("--imbalance", type=float, default=2.0, help="prefix_router_imbalance of the routing runs")
    p.add_argument("--cache-ab", action=argparse.BooleanOptionalAction, default=True, help="run the cache off/on part")
    p.add_argument("--json", default=str(RESULTS / "prefix_cache.json"))
    args = p.parse_args(argv)

    convs = conversations(args.conversations, args.turns, args.max_user_chars, args.min_chars)
    system = SYSTEM * args.system_repeat
    questions = load_prompts(None, args.questions)
    runs: dict[str, dict] = {}
    for setting, cache_bytes in (("off", 0), ("on", None)) if args.cache_ab else ():
        config = {
            "precision": args.precision,
            "torch_threads": args.threads,
            "methods": ["eagle3"],
            "target_replicas": 1,
            "drafter_replicas": 1,
            "max_batch": 16,
            # one fixed tree per request: tau with the cache on can then be compared with it off (the
            # tree-work scheduler picks trees from measured timings, which the cache itself changes)
            "scheduler": "prompt-length",
        }
        if cache_bytes is not None:
            config["prefix_cache_bytes"] = cache_bytes
        print(f"starting the app, prefix cache {setting} ...", flush=True)
        _, stop = start_local(config)
        try:
            chat(client_for(), [{"role": "user", "content": "Hi"}], 4, args.method)  # warm-up, not measured
            t0 = time.perf_counter()
            multi = run_multi_turn(
                client_for, convs, args.clients, args.max_new_tokens, args.method, SYSTEM * args.multi_system_repeat
            )
            multi_wall = time.perf_counter() - t0
            t0 = time.perf_counter()
            shared = run_system_prompt(client_for, system, questions, args.clients, args.max_new_tokens, args.method)
            shared_wall = time.perf_counter() - t0
        finally:
            stop()
        runs[setting] = {
            "multi_turn": {
                "summary": summarize(multi, multi_wall, [r for r in multi if r["turn"] >= 1], args.long_history),
                "records": multi,
            },
            "system_prompt": {"summary": summarize(shared, shared_wall, shared[1:]), "records": shared},
        }
    routing: dict[str, dict] = {}
    for router in ("power-of-two", "prefix") if args.routing else ():
        config = {
            "precision": args.precision,
            "torch_threads": 1,
            "methods": [],
            "target_replicas": 2,
            "drafter_replicas": 0,
            "max_batch": 16,
            "target_router": router,
            "prefix_router_imbalance": args.imbalance,
        }
        print(f"starting the app, two target replicas, router {router} ...", flush=True)
        address, stop = start_local(config)
        try:
            for _ in range(2):  # warm-up, not measured (a prompt no conversation starts with)
                chat(client_for(), [{"role": "user", "content": "Hi"}], 4, "target")
            t0 = time.perf_counter()
            multi = run_turn_by_turn(client_for, convs, args.clients, args.max_new_tokens, "target", args.seed)
            wall = time.perf_counter() - t0
            with EyasClient(address, timeout_s=120) as c:  # where the requests went: each replica's cache
                replicas = c.stats()["prefix_cache"]
        finally:
            stop()
        later = [r for r in multi if r["turn"] >= 1]
        routing[router] = {
            "summary": summarize(multi, wall, later, args.long_history),
            "records": multi,
            "replicas": replicas,
        }
    out = {"config": vars(args), "runs": runs, "routing": routing, "identical": {}, "ratios": {}}
    print(
        f"\nprefix cache off vs on: {args.method}, {args.precision}, {args.clients} clients, greedy, "
        f"{args.max_new_tokens} new tokens\n"
    )
    print(
        f"{'workload':<14} {'cache':<5} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} {'prefill rows':>12} "
        f"{'hit rate':>8} {'prompt (later)':>14}"
    )
    for wl in ("multi_turn", "system_prompt") if runs else ():
        for setting in ("off", "on"):
            s = runs[setting][wl]["summary"]
            print(
                f"{wl:<14} {setting:<5} {s['ttft_p50_s']:>8.2f}s {s['ttft_p99_s']:>8.2f}s {s['tok_s']:>7.1f} "
                f"{s['prefill_rows']:>12,} {s['hit_rate']:>7.0%} {s['mean_prompt_tokens_later']:>14.0f}"
            )
        off, on = runs["off"][wl], runs["on"][wl]
        keys = ("conversation", "turn") if wl == "multi_turn" else ("question",)
        by = {tuple(r[k] for k in keys): r for r in off["records"]}
        same = sum(by[tuple(r[k] for k in keys)]["text"] == r["text"] for r in on["records"])
        same_tau = sum(by[tuple(r[k] for k in keys)]["tau"] == r["tau"] for r in on["records"])
        out["identical"][wl] = {"text": f"{same}/{len(on['records'])}", "tau": f"{same_tau}/{len(on['records'])}"}
        out["ratios"][wl] = {
            "ttft_p50_on_over_off": on["summary"]["ttft_p50_s"] / off["summary"]["ttft_p50_s"],
            "tok_s_on_over_off": on["summary"]["tok_s"] / off["summary"]["tok_s"],
        }
        long = ""
        if on["summary"].get("ttft_p50_long_s") and off["summary"].get("ttft_p50_long_s"):
            ratio = on["summary"]["ttft_p50_long_s"] / off["summary"]["ttft_p50_long_s"]
            out["ratios"][wl]["ttft_p50_long_on_over_off"] = ratio
            long = (
                f" (at {args.long_history:,}+ history tokens, {on['summary']['long_turns']} turns: "
                f"{off['summary']['ttft_p50_long_s']:.2f} -> {on['summary']['ttft_p50_long_s']:.2f} s, {ratio:.2f}x)"
            )
        print(
            f"  {wl}: TTFT p50 on/off {out['ratios'][wl]['ttft_p50_on_over_off']:.2f}x{long}, tok/s on/off "
            f"{out['ratios'][wl]['tok_s_on_over_off']:.2f}x; answers identical {same}/{len(on['records'])}, "
            f"tau equal {same_tau}/{len(on['records'])}"
        )
    if routing:
        print("\nmulti-turn, turn by turn across conversations, two target replicas, target-only, by router\n")
        print(
            f"{'router':<14} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>7} {'prefill rows':>12} {'hit rate':>8} "
            f"{'history hit rate':>16}"
        )
        for router, r in routing.items():
            s = r["summary"]
            print(
                f"{router:<14} {s['ttft_p50_s']:>8.2f}s {s['ttft_p99_s']:>8.2f}s {s['tok_s']:>7.1f} "
                f"{s['prefill_rows']:>12,} {s['hit_rate']:>7.0%} {s['history_hit_rate']:>15.0%}"
            )
        base, pref = routing["power-of-two"]["summary"], routing["prefix"]["summary"]
        out["ratios"]["routing"] = {
            "hit_rate_prefix_over_default": pref["hit_rate"] / base["hit_rate"] if base["hit_rate"] else None,
            "history_hit_rate_prefix_over_default": (
                pref["history_hit_rate"] / base["history_hit_rate"] if base["history_hit_rate"] else None
            ),
            "ttft_p50_prefix_over_default": pref["ttft_p50_s"] / base["ttft_p50_s"],
        }
        print(
            f"  hit rate prefix / default: {pref['hit_rate']:.0%} / {base['hit_rate']:.0%}; "
            f"history hit rate {pref['history_hit_rate']:.0%} / {base['history_hit_rate']:.0%}"
        )
        for router, r in routing.items():
            print(
                f"  {router}: prompt tokens each replica was asked for: {[v['queries'] for v in r['replicas'].values()]}"
            )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    plot(out, Path(args.json).with_suffix(".png"))
    print(f"wrote {args.json} and its .png")
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routing = out.get("routing") or {}
    fig, axes = plt.subplots(1, 3 if routing else 2, figsize=(15 if routing else 10, 3.6))
    if routing:
        ax = axes[2]
        names = list(routing)
        ax.bar(names, [routing[n]["summary"]["hit_rate"] for n in names], color=["tab:grey", "tab:blue"][: len(names)])
        ax.set_ylabel("prefix-cache hit rate")
        ax.set_title("multi-turn, two target replicas")
    for ax, wl in zip(axes, ("multi_turn", "system_prompt") if out["runs"] else ()):
        for setting, color in (("off", "tab:grey"), ("on", "tab:blue")):
            recs = out["runs"][setting][wl]["records"]
            xs = [r["prompt_tokens"] for r in recs]
            ys = [r["ttft_s"] for r in recs]
            ax.scatter(xs, ys, s=12, color=color, label=f"cache {setting}")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(wl.replace("_", " "))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
