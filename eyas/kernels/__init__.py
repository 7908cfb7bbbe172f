"""Eyas's own CPU kernels for the ``fp16w`` precision: an fp16-weight linear and an attention, both
*row-invariant* (``cpu.cpp``).

Terms:
- *row-invariant*: a row's result depends on its own inputs only, computed in one fixed order,
  whatever other rows share the call. A speculative verify feeds several rows (the frontier and the
  tree's candidates) where target-only decoding feeds one; with row-invariant linears and attention,
  each verify row's logits are bit for bit the one-row decode's, so greedy speculative output equals
  target-only output by construction, not only up to the last bits of a GEMM.
- *streaming linear*: ``linear_f16w`` reads the fp16 weights once per call as one sequential stream
  (packed two outputs at a time, ``pack_f16w``) and multiplies up to six rows against each pass in
  fp32 (FMA). One row runs at the speed of memory (the weights do not fit in cache), and a few more
  rows ride the same stream: on this project's 2-core AVX2 machine the target's linears took
  9.6 / 9.3 / 10.7 / 13.6 ms for 1 / 3 / 4 / 6 rows, against fbgemm's fp16 GEMM's 12.7 / 14.3 /
  14.6 / 16.5 (``bench/f16w_stream.py``, docs/benchmarks.md). Every call takes this kernel, however
  many rows (a prompt's prefill chunk too, about 1.3x fbgemm's time there), so that a decode row
  that shares a forward with a prefill chunk is still computed as it is alone.
- *attention*: ``attend`` computes each query row over only the keys its mask shows, in slot order
  (the committed prefix, then its tree ancestors, then itself), exactly as a one-row decode of that
  token attends over its context; PyTorch's fused CPU attention costs 39 µs a layer for one row and
  102 µs for two masked rows here, this kernel a fraction of either.

The kernels are C++ (AVX2, FMA, F16C), compiled once per torch build with ``torch.utils.
cpp_extension`` into ``$EYAS_CACHE/kernels`` (``make setup`` builds them; the first call otherwise,
about 30 s). Where they cannot run (not x86 with those instructions, no C++ compiler, or
``EYAS_CPU_KERNELS=0``) :func:`load` says why once and returns None, and ``fp16w`` computes with
fbgemm and PyTorch's attention as before: the same precision, only its last bits and speed differ.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from eyas.cache import cache_root

log = logging.getLogger("eyas.kernels")

SWITCH_ENV = "EYAS_CPU_KERNELS"  # "0": never use the kernels
ISA_ENV = "EYAS_CPU_ISA"  # "avx2": the baseline build even on a CPU with AVX-512 (benches compare the two)
SOURCES = [Path(__file__).with_name("cpu.cpp"), Path(__file__).with_name("quant.cpp")]
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
# The builds, best first: (name, the CPU flags it needs beyond NEEDED_CPU_FLAGS, its extra compiler flags).
# Both compute the same bits (quant.cpp sums the same integers either way); AVX-512 VNNI takes one
# instruction for the integer dot product where AVX2 takes two. (AMX's tile instructions were tried on a
# Sapphire-Rapids-class Xeon: with a scale every 32 inputs each block's tile result must be stored and
# scaled before the next, and a verify's 2-8 rows ran 0.62-0.75x the VNNI path's speed; not kept.)
BUILDS = (
    (
        "avx512-vnni",
        ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
        ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    ),
    ("avx2", (), []),
)

_lock = threading.Lock()
_loaded: object | None = None
_why_not: str | None = None
_preferred = True
_built: str | None = None  # the build load() made: isa()'s, or the next one down where that did not compile


def prefer(use: bool) -> None:
    """Whether fp16w models built from now on in this process use the kernels where they can run
    (``quantize_fp16_weights``'s default); benches turn them off to measure fbgemm beside them."""
    global _preferred
    _preferred = bool(use)


def preferred() -> bool:
    return _preferred


def cpu_flags() -> list[str]:
    """The CPU's instruction-set flags (/proc/cpuinfo; [] where unknown)."""
    try:
        return next(
            line.split(":", 1)[1].split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return []


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None: they can, as far as can be told before building)."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return f"{SWITCH_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    flags = cpu_flags()
    if not flags:
        return "the CPU's instruction sets are unknown (no /proc/cpuinfo)"
    missing = [f for f in NEEDED_CPU_FLAGS if f not in flags]
    return f"the CPU lacks {', '.join(missing)}" if missing else None


def isa() -> str:
    """The build this CPU runs: the best of :data:`BUILDS` whose flags it has (``EYAS_CPU_ISA`` may
    ask for a lesser one)."""
    flags, wanted = set(cpu_flags()), os.environ.get(ISA_ENV)
    if _built is not None and wanted is None:
        return _built
    names = [name for name, _, _ in BUILDS]
    if wanted is not None and wanted not in names:
        raise ValueError(f"{ISA_ENV}: {wanted!r} is not one of {names}")
    for name, needs, _ in BUILDS[names.index(wanted) if wanted else 0 :]:
        if set(needs) <= flags:
            return name
    return BUILDS[-1][0]


def build_directory(build: str | None = None) -> Path:
    tag = f"torch-{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    return cache_root() / "kernels" / tag / (build or isa())


def load():
    """The compiled kernels module, or None where they cannot run (logged once, with the reason)."""
    global _loaded, _why_not, _built
    with _lock:
        if _loaded is not None or _why_not is not None:
            return _loaded
        _why_not = unavailable_reason()
        if _why_not is None:
            from torch.utils.cpp_extension import load as build

            names, flags = [n for n, _, _ in BUILDS], set(cpu_flags())
            for name, needs, cflags in BUILDS[names.index(isa()) :]:  # one the compiler cannot make: the next one down
                if not set(needs) <= flags:
                    continue
                try:
                    folder = build_directory(name)
                    folder.mkdir(parents=True, exist_ok=True)
                    _loaded = build(
                        name="eyas_cpu_kernels_" + name.replace("-", "_"),
                        sources=[str(p) for p in SOURCES],
                        extra_cflags=CFLAGS + cflags,
                        extra_ldflags=["-fopenmp"],
                        build_directory=str(folder),
                        verbose=False,
                    )
                    _why_not, _built = None, name
                    break
                except Exception as err:  # noqa: BLE001 - a build failure means the next build, or the fallback
                    _why_not = f"the build failed ({type(err).__name__}: {str(err).strip().splitlines()[-1][:200]})"
                    log.warning("Eyas's %s kernels did not build (%s)", name, _why_not)
        if _why_not is not None:
            log.warning("Eyas's CPU kernels are off (%s): fp16w uses fbgemm and PyTorch's attention", _why_not)
        return _loaded


def why_not() -> str | None:
    """After :func:`load`: the reason the kernels are off, or None when they are on."""
    load()
    return _why_not


class F16WLinear(torch.nn.Module):
    """``fp16w``'s linear with the kernels: the weights rounded to fp16 (as fbgemm's), packed for
    ``linear_f16w``; fp32 in, fp32 out, row-invariant. Inference only: no parameters."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):  # [N, K] fp16-representable, [N]
        super().__init__()
        kernels = load()
        assert kernels is not None, "F16WLinear needs the kernels (eyas.kernels.load)"
        self.kernels = kernels
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("packed", kernels.pack_f16w(weight.detach().to(torch.float16)), persistent=False)
        self.bias = None if bias is None else bias.detach().float()

    @staticmethod
    def fits(module: torch.nn.Module) -> bool:
        """Whether a linear's shape suits the kernel (an even number of outputs, inputs a multiple of 8)."""
        return module.out_features % 2 == 0 and module.in_features % 8 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        y = self.kernels.linear_f16w(x.reshape(-1, x.shape[-1]).float().contiguous(), self.packed)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
