"""Two builds of Eyas's CPU kernels against each other, in one process, on the same arguments.

Each build is compiled under a module name of its own (``eyas_k_<tag>``): Python hands back the first
extension module loaded under a name, so two builds loaded under one name both run the first (an
earlier A/B here measured nothing that way). The base build is the kernel sources at a git revision;
the other is the working tree's. The gguf target's ``forward_layers`` arguments are captured once
(verifies of 1, 2, 4 and 8 rows at ``--context``, and a 128-row prefill chunk) and each build runs
them in blocks of calls, the builds' order rotated every repetition; the medians are printed, with
the largest difference of the two builds' outputs (0: bit for bit the same).

    .venv/bin/python bench/kernel_ab.py --base HEAD~1 --context 300 --repeats 10
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def build(tag: str, sources: Path, out: Path):
    """The kernel sources in ``sources`` compiled as module ``eyas_k_<tag>`` under ``out``."""
    from torch.utils.cpp_extension import load

    from eyas import kernels

    isa = kernels.isa()
    folder = out / tag
    folder.mkdir(parents=True, exist_ok=True)
    load(
        name=f"eyas_k_{tag}",
        sources=[str(sources / p.name) for p in kernels.SOURCES],
        extra_cflags=kernels.CFLAGS + dict((n, f) for n, _, f in kernels.BUILDS)[isa],
        extra_ldflags=["-fopenmp"],
        build_directory=str(folder),
        verbose=False,
    )
    spec = importlib.util.spec_from_file_location(f"eyas_k_{tag}", folder / f"eyas_k_{tag}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sources_at(rev: str, into: Path) -> Path:
    """The kernel folder's files at git revision ``rev``, written under ``into``."""
    from eyas import kernels

    folder = Path(kernels.SOURCES[0]).parent
    rel = folder.relative_to(ROOT)
    into.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, f"{rel}/"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    for name in names:
        if name.endswith((".cpp", ".h")):
            text = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, check=True, capture_output=True).stdout
            (into / Path(name).name).write_bytes(text)
    return into


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="git revision of the base build's kernel sources")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import roofline
    import torch

    from eyas import kernels
    from eyas.runtime import Eyas, set_threads
    from eyas.target import quantized

    set_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="eyas-kernel-ab-") as tmp:
        print(f"building the base ({args.base}) and the working tree's kernels ...", file=sys.stderr, flush=True)
        builds = {
            "base": build("base", sources_at(args.base, Path(tmp) / "base-src"), Path(tmp)),
            "head": build("head", Path(kernels.SOURCES[0]).parent, Path(tmp)),
        }
        eyas = Eyas(precision="gguf")
        captured: dict[int, tuple] = {}
        call = quantized.FusedForward.__call__

        def spy(self, x, *a, **k):
            captured.setdefault(x.shape[0], (self, x, a, k))
            return call(self, x, *a, **k)

        quantized.FusedForward.__call__ = spy
        try:
            roofline.time_verifies(eyas, (), (1, 2, 4, 8), args.context, 1)
            roofline.time_prefill(eyas, (), 128, 1)
        finally:
            quantized.FusedForward.__call__ = call
        times: dict[tuple[int, str], list[float]] = {}
        outs: dict[tuple[int, str], torch.Tensor] = {}
        for rep in range(args.repeats):
            for n, (fused, x, a, k) in sorted(captured.items()):
                order = list(builds.items())
                order = order[rep % 2 :] + order[: rep % 2]
                for tag, module in order:
                    fused.kernels = module
                    block = []
                    for _ in range(6 if n <= 8 else 3):
                        t0 = time.perf_counter()
                        out = fused(x, *a, **k)
                        block.append(1000 * (time.perf_counter() - t0))
                    times.setdefault((n, tag), []).append(statistics.median(block[1:]))
                    outs[(n, tag)] = out[0]
        print(
            f"\nforward_layers at context {args.context}, {args.threads} threads, {kernels.isa()}; medians of {args.repeats}"
        )
        print(f"{'rows':>5} {'base ms':>9} {'head ms':>9} {'head/base':>10} {'max |diff|':>11}")
        for n in sorted(captured):
            b, h = statistics.median(times[(n, "base")]), statistics.median(times[(n, "head")])
            diff = (outs[(n, "base")] - outs[(n, "head")]).abs().max().item()
            print(f"{n:>5} {b:>9.2f} {h:>9.2f} {h / b:>10.3f} {diff:>11.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
