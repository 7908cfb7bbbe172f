"""Peak host memory of loading a target, streamed (today) against the whole-state-dict load (before).

The bench builds a random Llama checkpoint of about ``--params`` parameters with transformers and
writes it with ``save_pretrained`` in bfloat16 (sharded, as published checkpoints are; not
committed: under ``--work``), then loads it at ``--dtype`` in a fresh process per method and reads that
process's peak resident memory (``ru_maxrss``):

    streamed   ``eyas.target.loader.load_target``: the model on the meta device, filled tensor by
               tensor at the served dtype (``build_target``)
    whole      the loader before it: every tensor of the checkpoint read into one state dict, the
               model built in float32 on the host, filled, then cast (reproduced here, for the ratio)

Each peak is reported against the checkpoint's size on disk. Prints a table, writes JSON and a plot.

Run:
    .venv/bin/python bench/load_memory.py --params 1.0e9 --json bench/results/load_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def build_checkpoint(folder: Path, params: float) -> None:
    """A random Llama of about ``params`` parameters (hidden 2048, SmolLM2's tokenizer), bf16, sharded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.target.loader import load_tokenizer

    hidden, ffn, vocab = 2048, 5632, 49152
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device="cpu").to(torch.bfloat16)  # bf16 from the start: never 4 bytes a weight
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02)
                if p.ndim > 1
                else torch.ones(p.shape)
            )
    model.save_pretrained(folder, max_shard_size="500MB")
    load_tokenizer().save_pretrained(folder)


def child(folder: str, method: str, dtype: str) -> None:
    """Load in this (fresh) process and print its peak RSS and the load's wall time as JSON."""
    import resource

    import torch

    t0 = time.perf_counter()
    if method == "baseline":  # the imports alone: what any load pays before its first tensor
        import safetensors.torch  # noqa: F401
        import transformers  # noqa: F401

        import eyas.target.loader  # noqa: F401

        params = 0
    elif method == "streamed":
        from eyas.target.loader import load_target

        loaded = load_target(folder, dtype=dtype)
        params = sum(p.numel() for p in loaded.model.parameters())
    else:
        from safetensors.torch import load_file

        from eyas.target.config import TargetConfig
        from eyas.target.loader import DTYPES
        from eyas.target.model import TargetModel

        sd = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            sd.update(load_file(str(f)))
        model = TargetModel(TargetConfig.from_hf(json.loads((Path(folder) / "config.json").read_text())))
        model.load_hf_state_dict(sd)
        del sd
        model.to(dtype=DTYPES[dtype])
        params = sum(p.numel() for p in model.parameters())
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "method": method,
                "peak_rss": peak,
                "wall_s": wall,
                "params": params,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=1.0e9)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--work", default=str(REPO / "bench" / "out" / "load_memory"))
    p.add_argument("--json", default=str(RESULTS / "load_memory.json"))
    p.add_argument("--child", nargs=2, metavar=("FOLDER", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.dtype)
        return 0
    folder = Path(args.work) / f"llama-{args.params:.1e}"
    if not (folder / "config.json").exists():
        print(f"building a random {args.params:.1e}-parameter bf16 checkpoint in {folder} ...", flush=True)
        build_checkpoint(folder, args.params)
    disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    rows = []
    for method in ("baseline", "streamed", "whole"):
        print(f"loading with {method} ...", flush=True)
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(folder), method, "--dtype", args.dtype],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            print(out.stderr[-2000:], file=sys.stderr)
            return 1
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row["peak_over_disk"] = row["peak_rss"] / disk
        rows.append(row)
    print(
        f"\ncheckpoint: {rows[1]['params'] / 1e9:.2f} B parameters, bf16 on disk {disk / 1e9:.2f} GB; "
        f"loaded at {args.dtype}\n"
    )
    print(f"{'method':<10} {'peak RSS (GB)':>14} {'peak / disk':>12} {'wall (s)':>9}")
    for r in rows:
        print(f"{r['method']:<10} {r['peak_rss'] / 1e9:>14.2f} {r['peak_over_disk']:>11.2f}x {r['wall_s']:>9.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"disk_bytes": disk, "dtype": args.dtype, "rows": rows}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar([r["method"] for r in rows], [r["peak_over_disk"] for r in rows])
    ax.axhline(1.3, color="grey", linestyle=":", label="goal 1.3x")
    ax.set_ylabel("peak host RSS / size on disk")
    ax.set_title(f"loading {rows[1]['params'] / 1e9:.2f} B params at {args.dtype}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(args.json).with_suffix(".png"), dpi=110)
    print(f"wrote {args.json} and its .png")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
