"""A prototype fp16-weight linear for the CPU, measured against fbgemm's in the real target (not used
by Eyas yet).

At ``fp16w`` every target linear is fbgemm's dynamic fp16 GEMM (``torch.ops.quantized.
linear_dynamic_fp16``). This bench builds a small AVX2/F16C kernel of its own (``KERNEL`` below,
compiled once with ``torch.utils.cpp_extension.load_inline``; it needs g++ and an x86 CPU with AVX2,
FMA and F16C) that streams the fp16 weights once per call, packed so that every four outputs are
one sequential stream, and multiplies up to M rows against them in fp32:

- *batch-invariant*: each (row, output) pair accumulates in its own register, over k in the same
  order whatever the number of rows, so a verify row's result is bit for bit the one-row decode's
  (fbgemm's differs in the last bits, which Eyas's greedy identity has tolerated so far);
- for 3 rows and more the four outputs' weights are converted to fp32 once into an L1 buffer and
  every row reads them from there.

It then loads the default target twice at ``fp16w``, swaps one copy's linears (target and EAGLE-3
drafter) for the kernel, and runs target-only and EAGLE-3 on MT-bench first turns with both
copies interleaved per prompt; it also measures both verify latency curves (ms of a verify of R
rows after a 300-token context). Every speed is a ratio against a baseline of the same run.

    .venv/bin/python bench/f16w_stream.py --limit 16 --threads 2 --json bench/results/f16w_stream.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

from eyas.protocol.messages import AcceptDecision
from eyas.protocol.schema import parse_request
from eyas.protocol.tree import DraftTree
from eyas.runtime import Eyas, set_threads
from eyas.training.data import mtbench_questions

KERNEL = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// W [N, K] fp16 -> [N/4, K/8, 4, 8]: the 4 outputs of a quad, 8 k at a time (one sequential stream)
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kHalf, "w: [N, K] float16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 4 == 0 && K % 8 == 0, "w: N % 4 == 0 and K % 8 == 0");
  return w.reshape({N / 4, 4, K / 8, 8}).permute({0, 2, 1, 3}).contiguous();
}

static inline float hsum8(__m256 v) {  // one fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x1));
  return _mm_cvtss_f32(s);
}

template <int MR>  // one or two rows straight from the fp16 stream
static inline void quad_stream(const float* x, int64_t K, const uint16_t* p, float* y, int64_t N, int64_t n) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 8; s++) {
    const uint16_t* q = p + s * 32;
    _mm_prefetch(reinterpret_cast<const char*>(q + 512), _MM_HINT_T0);
    __m256 w[4];
    for (int j = 0; j < 4; j++) w[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * j)));
    for (int i = 0; i < MR; i++) {
      __m256 xv = _mm256_loadu_ps(x + i * K + s * 8);
      for (int j = 0; j < 4; j++) acc[i][j] = _mm256_fmadd_ps(w[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) y[i * N + n + j] = hsum8(acc[i][j]);
}

template <int MR>  // up to three rows from the quad's weights converted to fp32 (in L1)
static inline void quad_buf(const float* x, int64_t K, const float* buf, float* y, int64_t N, int64_t m0, int64_t n,
                            const uint16_t* next) {
  __m256 acc[MR][4];
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < K / 8; s++) {
    const float* b = buf + s * 32;
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + s * 32), _MM_HINT_T0);
    for (int i = 0; i < MR; i++) {
      __m256 xv = _mm256_loadu_ps(x + (m0 + i) * K + s * 8);
      for (int j = 0; j < 4; j++) acc[i][j] = _mm256_fmadd_ps(_mm256_load_ps(b + 8 * j), xv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; i++)
    for (int j = 0; j < 4; j++) y[(m0 + i) * N + n + j] = hsum8(acc[i][j]);
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kHalf, "packed: [N/4, K/8, 4, 8] float16");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 4;
  TORCH_CHECK(packed.size(1) * 8 == K, "x: K does not match the weights");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 4, 16, [&](int64_t q0, int64_t q1) {
    float* buf = M > 2 ? static_cast<float*>(aligned_alloc(64, ((K * 16 + 63) / 64) * 64)) : nullptr;
    for (int64_t qd = q0; qd < q1; qd++) {
      const uint16_t* p = pp + qd * K * 4;
      const int64_t n = qd * 4;
      if (M <= 2) {
        if (M == 1) quad_stream<1>(xp, K, p, yp, N, n); else quad_stream<2>(xp, K, p, yp, N, n);
        continue;
      }
      for (int64_t s = 0; s < K / 8; s++)
        for (int j = 0; j < 4; j++)
          _mm256_store_ps(buf + s * 32 + j * 8,
                          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + s * 32 + j * 8))));
      const uint16_t* next = qd + 1 < q1 ? p + K * 4 : nullptr;  // streams in during this quad's FMAs
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) quad_buf<3>(xp, K, buf, yp, N, m, n, m == 0 ? next : nullptr);
      if (M - m == 2) quad_buf<2>(xp, K, buf, yp, N, m, n, m == 0 ? next : nullptr);
      else if (M - m == 1) quad_buf<1>(xp, K, buf, yp, N, m, n, m == 0 ? next : nullptr);
    }
    free(buf);
  });
  return y;
}
"""


def build():
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="eyas_bench_f16w_stream",
        cpp_sources=KERNEL,
        functions=["pack", "linear"],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


class StreamLinear(nn.Module):
    """A drop-in for a ``torch.ao`` dynamic fp16 Linear: the same fp16 weights, the bench's kernel."""

    def __init__(self, kernel, q: nn.Module):
        super().__init__()
        w, b = q._packed_params._weight_bias()
        self.kernel, self.out_features, self.bias = kernel, w.shape[0], b
        self.register_buffer("packed", kernel.pack(w.half().contiguous()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.linear(x.reshape(-1, x.shape[-1]).contiguous(), self.packed)
        y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def swap_linears(kernel, module: nn.Module) -> int:
    """Every fbgemm fp16 Linear under ``module`` whose shape the kernel takes -> a StreamLinear."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

    swapped = 0
    for name, child in list(module.named_children()):
        if isinstance(child, DynamicLinear) and child.in_features % 8 == 0 and child.out_features % 4 == 0:
            setattr(module, name, StreamLinear(kernel, child))
            swapped += 1
        else:
            swapped += swap_linears(kernel, child)
    return swapped


def verify_curve(eyas: Eyas, taps, rows=(1, 2, 3, 4, 5, 6, 7, 9), prefix: int = 300, repeats: int = 3) -> dict:
    engine = eyas.target_engine(taps)
    ids = [(7 * i + 3) % eyas.cfg.vocab_size for i in range(prefix)]
    out: dict[int, list[float]] = {}
    for _ in range(repeats):
        for r in rows:
            engine.open_session("curve", ids, 20, r)
            try:
                v = engine.prefill("curve")
                engine.publish("curve", v.round, AcceptDecision(torch.arange(prefix), torch.tensor(ids[1:]), 1))
                n = r - 1
                tree = (
                    DraftTree(
                        torch.full((n,), 2), torch.arange(-1, n - 1), torch.arange(1, n + 1), torch.full((n,), 0.5)
                    )
                    if n
                    else DraftTree.empty()
                )
                times = []
                for _ in range(6):
                    t0 = time.perf_counter()
                    v = engine.verify("curve", tree)
                    times.append(1000 * (time.perf_counter() - t0))
                    engine.publish(
                        "curve", v.round, AcceptDecision(torch.tensor([0]), torch.tensor([], dtype=torch.int64), 5)
                    )
                out.setdefault(r, []).append(statistics.median(times))
            finally:
                engine.close_session("curve")
    return {r: statistics.median(v) for r, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=16, help="MT-bench first turns")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int)
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    set_threads(args.threads)
    print("building the kernel (g++, once per torch build) ...", file=sys.stderr, flush=True)
    kernel = build()
    fbgemm, stream = Eyas(precision="fp16w"), Eyas(precision="fp16w")
    swapped = swap_linears(kernel, stream.model) + swap_linears(kernel, stream.drafter("eagle3").engine.drafter)
    taps = stream.drafter("eagle3").taps
    fbgemm.drafter("eagle3")
    curves = {"fbgemm": verify_curve(fbgemm, taps), "stream": verify_curve(stream, taps)}
    prompts = [q["turns"][0] for q in mtbench_questions()][: args.limit]
    arms = [(name, e, m) for name, e in (("fbgemm", fbgemm), ("stream", stream)) for m in ("target", "eagle3")]
    for _name, e, m in arms:  # warm-up, not timed
        e.generate(parse_request(prompt=prompts[0], method=m, max_new_tokens=4))
    records: dict[str, list[tuple[list[int], float, int]]] = {f"{n}/{m}": [] for n, _, m in arms}
    for i, prompt in enumerate(prompts):
        for name, e, m in arms[i % len(arms) :] + arms[: i % len(arms)]:
            t0 = time.perf_counter()
            r, _ = e.generate(parse_request(prompt=prompt, method=m, max_new_tokens=args.max_new_tokens))
            records[f"{name}/{m}"].append((r.token_ids, time.perf_counter() - t0, len(r.rounds)))
    base = records["fbgemm/target"]
    base_rate = sum(len(t) for t, _, _ in base) / sum(w for _, w, _ in base)
    print(f"\n{len(prompts)} MT-bench first turns, {args.max_new_tokens} tokens, fp16w, {swapped} linears swapped\n")
    print(f"{'arm':<15} {'tok/s':>6} {'vs fbgemm target':>16} {'vs own target':>13} {'tau':>5} {'= own target':>12}")
    summary = {}
    for key, rs in records.items():
        own = records[key.split("/")[0] + "/target"]
        rate = sum(len(t) for t, _, _ in rs) / sum(w for _, w, _ in rs)
        own_rate = sum(len(t) for t, _, _ in own) / sum(w for _, w, _ in own)
        tau = sum(len(t) for t, _, _ in rs) / sum(n for _, _, n in rs)
        same = sum(a == b for (a, _, _), (b, _, _) in zip(rs, own))  # greedy identity within one kernel
        summary[key] = dict(tok_s=rate, vs_fbgemm_target=rate / base_rate, vs_own_target=rate / own_rate, tau=tau)
        print(
            f"{key:<15} {rate:>6.1f} {rate / base_rate:>15.2f}x {rate / own_rate:>12.2f}x {tau:>5.2f} {same:>8}/{len(rs)}"
        )
    same_text = sum(a == b for (a, _, _), (b, _, _) in zip(records["stream/target"], base))
    print(f"stream target-only's tokens equal fbgemm target-only's on {same_text}/{len(base)} prompts")
    print("\nverify ms after a 300-token context (x the same kernel's 1 row):")
    for name, c in curves.items():
        print(f"  {name:<7}" + "  ".join(f"{r}: {ms:.1f} ({ms / c[1]:.2f})" for r, ms in c.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "summary": summary, "curves": curves}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
