"""Every kind of forward against this machine's floor: the roofline account of Eyas's engine.

For each precision mode and each kind of forward -- a one-row decode, a verify of k rows (k = 2..16),
a prefill chunk, a drafter step (its layer, and its head with the top-k) -- it states the bytes the
forward must read (weights once; the request's K/V once), its FLOPs, its measured time, and the
*fraction of the floor* it reaches, where the floor is the larger of bytes / the measured read
bandwidth and FLOPs / the measured FMA rate. Both rates are measured here, by the kernels' own
probes (``probe_read`` over a buffer far larger than the caches, ``probe_fma``), not assumed. It also
counts the torch ops one decode dispatches and their share of its time (the profiler's self CPU time
of every op against the wall), since a forward bound by per-op overhead is not bound by bytes.

    .venv/bin/python bench/roofline.py --threads 2 --precision fp16w gguf [--agreement 2000]

Prints the table, writes ``bench/results/roofline.json`` and ``roofline.png``. ``--agreement N``
also measures each mode's top-1 agreement with fp32 over N positions of fixed text (MT-bench
questions, teacher-forced).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas import kernels  # noqa: E402
from eyas.protocol.messages import AcceptDecision  # noqa: E402
from eyas.protocol.tree import DraftTree  # noqa: E402
from eyas.runtime import Eyas, set_threads  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FLAGS_SHOWN = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni")


# --- the machine -----------------------------------------------------------------------------------
_BANDWIDTH: dict[int, float] = {}


def read_bandwidth(nbytes: int) -> float:
    """GB/s reading a buffer of ``nbytes`` (rounded up to 16 MiB) again and again, as a forward reads
    its weights token after token: from memory, or from a last-level cache that holds it. The best
    of 5 reads, each after one warm-up read."""
    k = kernels.load()
    size = max(16 << 20, -(-nbytes // (16 << 20)) * (16 << 20))
    if size not in _BANDWIDTH:
        buf = torch.ones(size, dtype=torch.uint8)
        k.probe_read(buf)
        reads = []
        for _ in range(5):
            t0 = time.perf_counter()
            k.probe_read(buf)
            reads.append(time.perf_counter() - t0)
        _BANDWIDTH[size] = size / min(reads) / 1e9
    return _BANDWIDTH[size]


def machine(threads: int) -> dict:
    k = kernels.load()
    assert k is not None, f"the kernels are off: {kernels.why_not()}"
    iters = 20_000_000
    k.probe_fma(1000)
    t0 = time.perf_counter()
    k.probe_fma(iters)
    fma_s = time.perf_counter() - t0
    k.probe_dot(1000)
    t0 = time.perf_counter()
    k.probe_dot(iters)
    dot_s = time.perf_counter() - t0
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    flags = set(kernels.cpu_flags())
    return {
        "cpu": model,
        "threads": threads,
        "flags": [f for f in FLAGS_SHOWN if f in flags],
        "kernel_build": kernels.isa(),
        "read_gb_s": read_bandwidth(512 << 20),  # far past any cache: DRAM
        "read_gb_s_by_mib": {16 * 2**i: read_bandwidth((16 << 20) * 2**i) for i in range(6)},
        "fma_gflop_s": iters * 8 * 8 * 2 * threads / fma_s / 1e9,
        "int8_gmac_s": iters * 8 * k.dot_macs() * threads / dot_s / 1e9,  # the gguf kernels' integer products
    }


# --- what a forward must read ---------------------------------------------------------------------
def linear_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(weight bytes a forward reads, multiply-adds per row) of a linear of any precision."""
    from eyas.target.quantized import QLinear

    if isinstance(module, QLinear):
        return module.weight_bytes, module.in_features * module.out_features
    if isinstance(module, kernels.F16WLinear):
        return module.packed.numel() * 2, module.in_features * module.out_features
    if isinstance(module, torch.nn.Linear):
        return module.weight.numel() * module.weight.element_size(), module.weight.numel()
    w = module.weight() if callable(getattr(module, "weight", None)) else None  # torch.ao dynamic (fbgemm)
    if w is not None:
        size = 2 if getattr(module, "_packed_params", None) is not None and w.dtype == torch.float16 else 4
        if w.is_quantized:
            size = 1
        return w.numel() * size, w.numel()
    return 0, 0


def linears(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    seen, out = set(), []
    for name, m in root.named_modules():
        if id(m) in seen or not name:
            continue
        b, _ = linear_bytes(m)
        if b and not any(name.startswith(p + ".") for p, _ in out):
            out.append((name, m))
            seen.add(id(m))
    return out


def target_account(eyas: Eyas) -> dict:
    parts = [linear_bytes(m) for _, m in linears(eyas.model)]
    cfg = eyas.cfg
    return {
        "weight_bytes": sum(b for b, _ in parts),
        "macs_per_row": sum(m for _, m in parts),
        "kv_bytes_per_slot": cfg.num_layers  # a key (as the store holds it: Q8 blocks at gguf) and a value a head
        * cfg.num_kv_heads
        * (eyas.model.key_layout[1] * eyas.model.key_layout[0].itemsize + cfg.head_dim * eyas.model.kv_dtype.itemsize),
        "attn_macs_per_row_slot": cfg.num_layers * 2 * cfg.num_heads * cfg.head_dim,
    }


# --- timed forwards --------------------------------------------------------------------------------
def time_verifies(eyas: Eyas, taps, rows: tuple[int, ...], context: int, repeats: int) -> tuple[dict, dict]:
    """ms of a verify of R rows (the frontier and a chain of R-1 candidates) after ``context`` committed
    tokens, every row count in its own session, the row counts taken in turn (one verify of each, then
    the next turn: a change of the host's speed between turns reaches every row count alike), 8 x
    ``repeats`` turns, the first two dropped. -> (the median ms per row count, and the median over the
    turns of each row count's ms over the 1-row verify's of the same turn)."""
    engine = eyas.target_engine(taps)
    ids = [(7 * i + 3) % eyas.cfg.vocab_size for i in range(context)]
    turns = 8 * repeats
    names = {r: f"roofline-{r}" for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    try:
        for r, name in names.items():
            engine.open_session(name, ids, turns + 8, r)
            v = engine.prefill(name)
            engine.publish(name, v.round, AcceptDecision(torch.arange(context), torch.tensor(ids[1:]), 1))
        trees = {r: DraftTree.chain([2] * (r - 1)) for r in rows}
        for _ in range(turns):
            for r, name in names.items():
                t0 = time.perf_counter()
                v = engine.verify(name, trees[r])
                times[r].append(1000 * (time.perf_counter() - t0))
                engine.publish(name, v.round, AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 5))
    finally:
        for name in names.values():
            engine.close_session(name)
    ms = {r: statistics.median(t[2:]) for r, t in times.items()}
    base = min(rows)
    paired = {r: statistics.median(a / b for a, b in zip(t[2:], times[base][2:])) for r, t in times.items()}
    return ms, paired


def time_prefill(eyas: Eyas, taps, rows: int, repeats: int) -> float:
    engine = eyas.target_engine(taps)
    samples = []
    for i in range(repeats + 1):
        ids = [(11 * j + 5 + i) % eyas.cfg.vocab_size for j in range(rows)]  # no prefix-cache hit
        engine.open_session("roofline-prefill", ids, 4, 1)
        try:
            t0 = time.perf_counter()
            engine.prefill("roofline-prefill")
            samples.append(1000 * (time.perf_counter() - t0))
        finally:
            engine.close_session("roofline-prefill")
    return statistics.median(samples[1:])


def drafter_account(eyas: Eyas, method: str) -> dict:
    """The drafter's step: its decoder layer and its head (what a drafting step reads; the fc fusion
    runs on context rows only), and the step's measured ms (the slope of ``measure_cost`` over depth)."""
    handle = eyas.drafter(method)
    d = handle.engine.drafter
    parts = {name: linear_bytes(m) for name, m in linears(d)}
    head = d.head if d.head is not None else eyas.model.lm_head
    head_bytes, head_macs = linear_bytes(head)
    layer = [(b, m) for name, (b, m) in parts.items() if not name.startswith(("fc", "head"))]
    points = handle.engine.measure_cost(handle.default_tree, depths=(1, 2, 3, 4), repeats=5, batch=1)
    depths = [p[0] for p in points]
    ms = [p[2] for p in points]
    slope = statistics.linear_regression(depths, ms).slope if len(points) > 1 else float("nan")
    # the head and its top-k alone, on one row
    h = torch.randn(1, eyas.cfg.hidden_size)
    handle.engine._top_children(h, 8)
    t = []
    for _ in range(20):
        t0 = time.perf_counter()
        handle.engine._top_children(h, 8)
        t.append(1000 * (time.perf_counter() - t0))
    return {
        "step_bytes": sum(b for b, _ in layer) + head_bytes,
        "step_macs": sum(m for _, m in layer) + head_macs,
        "step_ms": slope,
        "head_bytes": head_bytes,
        "head_macs": head_macs,
        "head_topk_ms": statistics.median(t),
        "cost_points": points,
    }


def dispatch_profile(eyas: Eyas, taps, context: int) -> dict:
    """One decode under the profiler: the torch ops it dispatches and their self CPU time against the wall."""
    from torch.profiler import ProfilerActivity, profile

    engine = eyas.target_engine(taps)
    ids = [(7 * i + 3) % eyas.cfg.vocab_size for i in range(context)]
    engine.open_session("roofline-prof", ids, 40, 1)
    try:
        v = engine.prefill("roofline-prof")
        engine.publish("roofline-prof", v.round, AcceptDecision(torch.arange(context), torch.tensor(ids[1:]), 1))
        for _ in range(3):
            v = engine.verify("roofline-prof", DraftTree.chain([]))
            engine.publish(
                "roofline-prof", v.round, AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 5)
            )
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            engine.verify("roofline-prof", DraftTree.chain([]))
            wall = time.perf_counter() - t0
    finally:
        engine.close_session("roofline-prof")
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    top = [e for e in events if e.cpu_parent is None]
    return {
        "ops": len(events),
        "top_level_ops": len(top),
        "wall_ms": 1000 * wall,
        "op_self_ms": sum(e.self_cpu_time_total for e in events) / 1000,
    }


def agreement(eyas: Eyas, reference: Eyas, positions: int) -> float:
    """Top-1 agreement with ``reference`` over teacher-forced positions of MT-bench questions."""
    from eyas.training.data import mtbench_questions

    same = total = 0
    for q in mtbench_questions():
        ids = eyas.encode(q["turns"][0])[:256]
        tokens = torch.tensor([ids])
        a = _logits(eyas, tokens)
        b = _logits(reference, tokens)
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
        if total >= positions:
            break
    return same / total


@torch.inference_mode()
def _logits(eyas: Eyas, tokens: torch.Tensor) -> torch.Tensor:  # [1, T] -> [T, V]: every position's
    m, t = eyas.model, tokens.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    return m(tokens, torch.arange(t)[None], m.allocate_cache(1, t), 0, mask, (), logits_rows="all").logits[0]


# --- the report --------------------------------------------------------------------------------------
def floor_ms(bytes_: float, macs: float, m: dict, gb_s: float, precision: str) -> float:
    """The larger of the bytes at ``gb_s`` and the multiply-adds at the machine's rate for the mode's
    arithmetic (gguf: the kernels' integer products; otherwise fp32 FMAs)."""
    rate = m["int8_gmac_s"] * 1e9 if precision == "gguf" else m["fma_gflop_s"] * 1e9 / 2
    return max(bytes_ / (gb_s * 1e9), macs / rate) * 1000


def run(args) -> dict:
    set_threads(args.threads)
    m = machine(args.threads)
    print(
        f"machine: {m['cpu']}, {args.threads} threads, flags {' '.join(m['flags'])}, kernels {m['kernel_build']}\n"
        f"  read bandwidth {m['read_gb_s']:.1f} GB/s from DRAM (512 MiB); by working set "
        + ", ".join(f"{mib} MiB {gb:.0f}" for mib, gb in m["read_gb_s_by_mib"].items())
        + f" GB/s; fp32 FMA {m['fma_gflop_s']:.0f} GFLOP/s, int8 products {m['int8_gmac_s']:.0f} GMAC/s (measured here)\n"
        "  floor: the bytes from DRAM or the arithmetic at the measured rate, whichever is slower; 'cache':\n"
        "  the same with the read bandwidth of a buffer as large as the forward's working set (weights and K/V)",
        flush=True,
    )
    out = {"machine": m, "context": args.context, "modes": {}}
    reference = Eyas(precision="fp32") if args.agreement else None
    for precision in args.precision:
        eyas = Eyas(precision=precision)
        taps = eyas.drafter("eagle3").taps
        acct = target_account(eyas)
        rows = (1, 2, 3, 4, 6, 8, 12, 16)
        verify, paired = time_verifies(eyas, taps, rows, args.context, args.repeats)
        prefill = time_prefill(eyas, taps, args.prefill_rows, args.repeats)
        drafter = drafter_account(eyas, "eagle3")
        prof = dispatch_profile(eyas, taps, args.context)
        kinds = []
        kv = acct["kv_bytes_per_slot"] * args.context
        for r, ms in verify.items():
            b = acct["weight_bytes"] + kv
            macs = acct["macs_per_row"] * r + acct["attn_macs_per_row_slot"] * args.context * r
            kinds.append(("decode (1 row)" if r == 1 else f"verify {r} rows", b, macs, ms))
        pb = acct["weight_bytes"] + acct["kv_bytes_per_slot"] * args.prefill_rows
        pm = acct["macs_per_row"] * args.prefill_rows + acct["attn_macs_per_row_slot"] * args.prefill_rows**2 / 2
        kinds.append((f"prefill chunk ({args.prefill_rows} rows)", pb, pm, prefill))
        kinds.append(("drafter step (layer + head)", drafter["step_bytes"], drafter["step_macs"], drafter["step_ms"]))
        kinds.append(
            ("drafter head + top-k (1 row)", drafter["head_bytes"], drafter["head_macs"], drafter["head_topk_ms"])
        )
        table = []
        working = acct["weight_bytes"] + kv  # what every target forward reads again
        for name, b, macs, ms in kinds:
            ws = drafter["step_bytes"] if name.startswith("drafter") else working
            fl = floor_ms(b, macs, m, m["read_gb_s"], precision)  # the bytes from DRAM: the floor
            cached = floor_ms(b, macs, m, read_bandwidth(int(ws)), precision)  # a cache as large as the working set
            table.append(
                {
                    "kind": name,
                    "mb": b / 1e6,
                    "gflop": 2 * macs / 1e9,
                    "ms": ms,
                    "floor_ms": fl,
                    "fraction": fl / ms,
                    "working_set_gb_s": read_bandwidth(int(ws)),
                    "cached_floor_ms": cached,
                    "cached_fraction": cached / ms,
                }
            )
        mode = {
            "account": acct,
            "kinds": table,
            "dispatch": prof,
            "drafter_points": drafter["cost_points"],
            "verify_over_decode_paired": paired,  # each turn's R-row verify over its 1-row (median)
        }
        if reference is not None:
            mode["top1_agreement_fp32"] = agreement(eyas, reference, args.agreement)
        out["modes"][precision] = mode
        print(f"\n{precision}: weights {acct['weight_bytes'] / 1e6:.1f} MB a forward")
        print(
            f"  {'kind':32} {'MB':>7} {'GFLOP':>7} {'ms':>7} {'floor':>7} {'of floor':>8}   "
            f"{'cache GB/s':>10} {'floor':>7} {'of floor':>8}"
        )
        for t in table:
            print(
                f"  {t['kind']:32} {t['mb']:7.1f} {t['gflop']:7.3f} {t['ms']:7.2f} {t['floor_ms']:7.2f} "
                f"{t['fraction']:8.2f}   {t['working_set_gb_s']:10.1f} {t['cached_floor_ms']:7.2f} {t['cached_fraction']:8.2f}"
            )
        one = verify[1]
        print(
            f"  verify of 4 rows / decode: {verify[4] / one:.2f}x (paired by turn: {paired[4]:.2f}x; 2 / 3 / 8 rows "
            f"{paired[2]:.2f} / {paired[3]:.2f} / {paired[8]:.2f}x); decode dispatches {prof['ops']} torch ops "
            f"({prof['top_level_ops']} top-level), their self time {prof['op_self_ms']:.1f} ms of {prof['wall_ms']:.1f} ms"
        )
        if "top1_agreement_fp32" in mode:
            print(f"  top-1 agreement with fp32: {mode['top1_agreement_fp32']:.4f}")
        del eyas
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    modes = list(out["modes"])
    kinds = [t["kind"] for t in out["modes"][modes[0]]["kinds"]]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        fr = [t["fraction"] for t in out["modes"][mode]["kinds"]]
        ax.bar([k + i * width for k in range(len(kinds))], fr, width, label=mode)
    ax.axhline(0.7, color="gray", linestyle="--", linewidth=1, label="goal 0.7")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(kinds))])
    ax.set_xticklabels(kinds, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("fraction of the floor (floor ms / measured ms)")
    m = out["machine"]
    ax.set_title(
        f"{m['cpu']}, {m['threads']} threads, {m['read_gb_s']:.0f} GB/s read, kernels {m['kernel_build']}", fontsize=9
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", nargs="+", default=["fp16w", "gguf"])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--prefill-rows", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--agreement", type=int, default=0, help="positions for top-1 agreement with fp32 (0: skip)")
    ap.add_argument("--json", type=Path, default=RESULTS / "roofline.json")
    args = ap.parse_args()
    out = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    plot(out, args.json.with_suffix(".png"))
    print(f"\nwrote {args.json} and {args.json.with_suffix('.png')}")


if __name__ == "__main__":
    main()
