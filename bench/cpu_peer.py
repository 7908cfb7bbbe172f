"""Eyas against llama.cpp on the same GGUF, the same prompts and threads, in ONE run.

Arms, interleaved per prompt in a rotating order (the noise of a shared machine hits them alike):

    llama.cpp              llama-cpp-python plain greedy decoding of the GGUF file Eyas serves
    eyas <mode> target     Eyas target-only decoding at each precision mode (default: gguf, fp16w)
    eyas <mode> eagle3     Eyas EAGLE-3 at that mode (its default cost-aware tree)

Every arm gets the same prompt token ids (the target tokenizer's chat template over an MT-bench first
turn) and produces the same number of new tokens: Eyas's target-only answer at the first mode runs
to EOS or ``--max-new-tokens``, and every other arm produces exactly that many (llama.cpp is asked
for them, EOS or not; Eyas's arms stop at the same EOS, so they produce them too). tok/s counts new
tokens over the wall time of the whole call, prefill included; llama.cpp's KV cache is reset before
each prompt and Eyas's prefix cache is off, so no arm reuses another's prompt. Each EAGLE-3 output is
checked against its own mode's target-only output (speculation must be exact); llama.cpp's greedy
tokens are compared with Eyas gguf's (two implementations of the same 4-bit arithmetic, agreement
reported, not required).

    pip install llama-cpp-python        # builds llama.cpp from source (~6 min here); a bench extra only
    .venv/bin/python bench/cpu_peer.py --limit 80 --max-new-tokens 128 --threads 2

Prints the table with the CPU's flags, writes ``bench/results/cpu_peer.json`` and ``cpu_peer.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas import kernels  # noqa: E402
from eyas.protocol.schema import parse_request  # noqa: E402
from eyas.runtime import Eyas, set_threads  # noqa: E402
from eyas.target.loader import default_gguf_path  # noqa: E402
from eyas.training.data import mtbench_questions  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FLAGS_SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni")


class LlamaCpp:
    def __init__(self, path: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=4096, verbose=False)

    def generate(self, ids: list[int], n: int) -> list[int]:
        self.llm.reset()
        out = []
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out


def peer_decodes(path: Path, threads: int) -> str | None:
    """Whether llama.cpp decodes here, tried in a child process (a crash inside llama.cpp would end this
    one). -> None, or what went wrong. llama-cpp-python 0.3.36 built for the host (pip's default,
    GGML_NATIVE) died of a segmentation fault at its first decode on a Xeon with AMX; built without the
    AMX paths it runs (the command below)."""
    probe = (
        "import sys\n"
        "from llama_cpp import Llama\n"
        "llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=256, verbose=False)\n"
        "for i, _ in enumerate(llm.generate([1, 2, 3], top_k=1, temp=0.0)):\n"
        "    if i == 2: break\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(path), str(threads)], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
    return (
        f"llama.cpp failed to decode on this CPU ({how}). Build it without its AMX paths and run again:\n"
        '  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON '
        '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \\\n'
        "  pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["gguf", "fp16w"])
    ap.add_argument("--json", type=Path, default=RESULTS / "cpu_peer.json")
    args = ap.parse_args()
    set_threads(args.threads)
    flags = set(kernels.cpu_flags())
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        "?",
    )
    print(
        f"CPU: {cpu}; flags: {' '.join(f for f in FLAGS_SHOWN if f in flags)}; kernels: {kernels.isa()}; threads {args.threads}"
    )
    gguf = default_gguf_path()
    broken = peer_decodes(gguf, args.threads)
    if broken is not None:
        sys.exit(broken)
    peer = LlamaCpp(gguf, args.threads)
    engines = {mode: Eyas(precision=mode) for mode in args.modes}
    prompts = [q["turns"][0] for q in mtbench_questions()][: args.limit]
    arms = ["llama.cpp"] + [f"eyas {m} {method}" for m in args.modes for method in ("target", "eagle3")]
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    warm = engines[args.modes[0]].prompt_ids(parse_request(prompt="Hello", max_new_tokens=4))
    peer.generate(warm, 4)
    for e in engines.values():
        for method in ("target", "eagle3"):
            e.generate(parse_request(prompt="Hello", method=method, max_new_tokens=8))
    for i, prompt in enumerate(prompts):
        first_mode = args.modes[0]
        ref = engines[first_mode]
        ids = ref.prompt_ids(parse_request(prompt=prompt, max_new_tokens=args.max_new_tokens))
        t0 = time.perf_counter()
        base, _ = ref.generate(parse_request(prompt_ids=ids, method="target", max_new_tokens=args.max_new_tokens))
        base_s = time.perf_counter() - t0
        n = len(base.token_ids)
        outputs = {f"eyas {first_mode} target": base.token_ids}
        rows[f"eyas {first_mode} target"].append({"tokens": n, "s": base_s})
        order = [a for a in arms if a != f"eyas {first_mode} target"]
        order = order[i % len(order) :] + order[: i % len(order)]
        for arm in order:
            t0 = time.perf_counter()
            if arm == "llama.cpp":
                out = peer.generate(ids, n)
            else:
                _, mode, method = arm.split()
                r, _ = engines[mode].generate(
                    parse_request(prompt_ids=ids, method=method, max_new_tokens=args.max_new_tokens)
                )
                out = r.token_ids
            s = time.perf_counter() - t0
            outputs[arm] = out
            rows[arm].append({"tokens": len(out), "s": s})
        for mode in args.modes:
            if f"eyas {mode} target" not in outputs:
                continue
            rows[f"eyas {mode} eagle3"][-1]["identical"] = (
                outputs[f"eyas {mode} eagle3"] == outputs[f"eyas {mode} target"]
            )
        peer_out, ours = outputs["llama.cpp"], outputs.get("eyas gguf target", base.token_ids)
        same = next((j for j, (a, b) in enumerate(zip(peer_out, ours)) if a != b), min(len(peer_out), len(ours)))
        rows["llama.cpp"][-1]["agree_prefix"] = same
        rows["llama.cpp"][-1]["identical"] = peer_out[: len(ours)] == ours
        line = "  ".join(f"{a}: {r[-1]['tokens'] / r[-1]['s']:.1f}" for a, r in rows.items())
        print(f"[{i + 1}/{len(prompts)}] {n} tokens  {line}", flush=True)
    summary = {}
    peer_rate = sum(r["tokens"] for r in rows["llama.cpp"]) / sum(r["s"] for r in rows["llama.cpp"])
    print(f"\n{'arm':22} {'tok/s':>7} {'vs llama.cpp':>12} {'vs own target':>13} {'identical':>10}")
    for arm, rs in rows.items():
        rate = sum(r["tokens"] for r in rs) / sum(r["s"] for r in rs)
        own = None
        if arm.startswith("eyas") and arm.endswith("eagle3"):
            t = rows[arm.replace("eagle3", "target")]
            own = rate / (sum(r["tokens"] for r in t) / sum(r["s"] for r in t))
        ident = [r["identical"] for r in rs if "identical" in r]
        summary[arm] = {
            "tok_s": rate,
            "vs_llama_cpp": rate / peer_rate,
            "vs_own_target": own,
            "identical": f"{sum(ident)}/{len(ident)}" if ident else None,
            "per_prompt_tok_s_median": statistics.median(r["tokens"] / r["s"] for r in rs),
        }
        print(
            f"{arm:22} {rate:7.1f} {rate / peer_rate:11.2f}x {'' if own is None else f'{own:.2f}x':>13} "
            f"{summary[arm]['identical'] or '':>10}"
        )
    agree = statistics.mean(r["agree_prefix"] for r in rows["llama.cpp"])
    print(
        f"llama.cpp's greedy tokens equal Eyas gguf's on {summary['llama.cpp']['identical']} prompts (mean agreeing prefix {agree:.1f} tokens)"
    )
    out = {
        "cpu": cpu,
        "flags": sorted(flags & set(FLAGS_SHOWN)),
        "kernels": kernels.isa(),
        "threads": args.threads,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
        "gguf": str(gguf),
        "summary": summary,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    plot(out, args.json.with_suffix(".png"))
    print(f"wrote {args.json} and {args.json.with_suffix('.png')}")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(out["summary"])
    rates = [out["summary"][a]["tok_s"] for a in arms]
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar(arms, rates, color=["gray"] + ["tab:blue", "tab:orange"] * ((len(arms) - 1) // 2))
    for b, a in zip(bars, arms):
        ax.text(
            b.get_x() + b.get_width() / 2,
            b.get_height(),
            f"{out['summary'][a]['vs_llama_cpp']:.2f}x",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylabel("tokens / s (prefill included)")
    ax.set_title(
        f"{out['cpu']}, {out['threads']} threads, {out['prompts']} MT-bench prompts, kernels {out['kernels']}",
        fontsize=9,
    )
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
