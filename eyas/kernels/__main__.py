"""``python -m eyas.kernels``: build Eyas's CPU kernels now (``make setup`` does), and say whether they run."""

from __future__ import annotations

from eyas import kernels

if kernels.load() is None:
    print(f"Eyas's CPU kernels: off ({kernels.why_not()}); fp16w computes with fbgemm and PyTorch's attention")
else:
    print(f"Eyas's CPU kernels: on (built in {kernels.build_directory()})")
