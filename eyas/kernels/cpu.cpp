// Eyas's CPU kernels for the fp16w precision (x86 with AVX2, FMA and F16C): see eyas/kernels/__init__.py.
//
// Both are *row-invariant*: a row's result depends on its own inputs only, computed in one fixed order
// whatever else shares the call, so a verify row is bit for bit the one-row decode of the same token.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

// ---------------------------------------------------------------------------------------------------
// linear: y [M, N] = x [M, K] @ W^T, W fp16, fp32 arithmetic
// ---------------------------------------------------------------------------------------------------

constexpr int64_t kRowsPerPass = 6;   // rows multiplied against one pass of a pair's weights
constexpr int64_t kPairsPerBlock = 8;  // 16 outputs: their weights stay in cache across row chunks

// rows [m0, m0 + MR) against one pair of outputs [n, n + 2), whose weights p are [K/8, 2, 8] fp16
template <int MR>
inline void pair_rows(const float* x, int64_t K, const uint16_t* p, float* y, int64_t N, int64_t m0, int64_t n) {
  __m256 a0[MR], a1[MR];
  for (int i = 0; i < MR; i++) {
    a0[i] = _mm256_setzero_ps();
    a1[i] = _mm256_setzero_ps();
  }
  const float* xr = x + m0 * K;
  for (int64_t s = 0; s < K / 8; s++) {
    const uint16_t* q = p + s * 16;
    _mm_prefetch(reinterpret_cast<const char*>(q + 1024), _MM_HINT_T0);  // 2 KB ahead in the stream
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8)));
    for (int i = 0; i < MR; i++) {
      const __m256 xv = _mm256_loadu_ps(xr + i * K + s * 8);
      a0[i] = _mm256_fmadd_ps(w0, xv, a0[i]);
      a1[i] = _mm256_fmadd_ps(w1, xv, a1[i]);
    }
  }
  for (int i = 0; i < MR; i++) {
    y[(m0 + i) * N + n] = hsum8(a0[i]);
    y[(m0 + i) * N + n + 1] = hsum8(a1[i]);
  }
}

inline void pair_tail(int64_t rows, const float* x, int64_t K, const uint16_t* p, float* y, int64_t N, int64_t m0,
                      int64_t n) {
  switch (rows) {
    case 5: pair_rows<5>(x, K, p, y, N, m0, n); break;
    case 4: pair_rows<4>(x, K, p, y, N, m0, n); break;
    case 3: pair_rows<3>(x, K, p, y, N, m0, n); break;
    case 2: pair_rows<2>(x, K, p, y, N, m0, n); break;
    case 1: pair_rows<1>(x, K, p, y, N, m0, n); break;
    default: break;
  }
}

}  // namespace

// W [N, K] fp16 -> [N/2, K/8, 2, 8]: every pair of outputs, 8 inputs at a time, one sequential stream. The
// fp16 bits are held as int16, so that a module's .to(dtype) leaves them alone.
torch::Tensor pack_f16w(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kHalf, "weight: expected [N, K] float16");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 2 == 0 && K % 8 == 0, "weight: N must be even and K a multiple of 8, got ", N, " x ", K);
  return w.contiguous().reshape({N / 2, 2, K / 8, 8}).permute({0, 2, 1, 3}).contiguous().view(torch::kShort);
}

torch::Tensor linear_f16w(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: expected [M, K] float32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kShort && packed.size(2) == 2 &&
                  packed.size(3) == 8 && packed.is_contiguous(),
              "packed: expected pack_f16w's [N/2, K/8, 2, 8] fp16 bits");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 2;
  TORCH_CHECK(packed.size(1) * 8 == K, "x: ", K, " inputs, the weight takes ", packed.size(1) * 8);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  float* yp = y.data_ptr<float>();
  const int64_t pairs = N / 2;
  at::parallel_for(0, (pairs + kPairsPerBlock - 1) / kPairsPerBlock, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t q0 = b * kPairsPerBlock, q1 = std::min(pairs, q0 + kPairsPerBlock);
      int64_t m = 0;
      for (; m + kRowsPerPass <= M; m += kRowsPerPass)
        for (int64_t pr = q0; pr < q1; pr++) pair_rows<kRowsPerPass>(xp, K, pp + pr * K * 2, yp, N, m, pr * 2);
      for (int64_t pr = q0; pr < q1; pr++) pair_tail(M - m, xp, K, pp + pr * K * 2, yp, N, m, pr * 2);
    }
  });
  return y;
}

// ---------------------------------------------------------------------------------------------------
// attend: each query row over the keys its mask shows, in slot order
// ---------------------------------------------------------------------------------------------------

// q [B, H, T, D], keys/values [B, Hkv, S, D] (D a multiple of 8, stride 1 along D), mask [B, T, S] bool or
// None (every key visible) -> [B, H, T, D]. Query head h reads KV head h / (H / Hkv). A row with no visible
// key gives zeros (a padding cell of a query grid).
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> mask,
                     double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "q, keys, values: expected 4-D tensors");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && keys.scalar_type() == torch::kFloat &&
                  values.scalar_type() == torch::kFloat,
              "q, keys, values: expected float32");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = keys.size(1), S = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && values.sizes() == keys.sizes() && keys.size(3) == D, "keys, values: shapes");
  TORCH_CHECK(D % 8 == 0 && Hkv > 0 && H % Hkv == 0, "q: head_dim a multiple of 8 and heads a multiple of kv heads");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "keys, values: expected stride 1 along head_dim");
  TORCH_CHECK(D <= 128, "q: head_dim at most 128, got ", D);
  const bool* mp = nullptr;
  torch::Tensor m;
  if (mask.has_value()) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == torch::kBool && m.dim() == 3 && m.size(0) == B && m.size(1) == T &&
                    m.size(2) == S,
                "mask: expected [B, T, S] bool");
    mp = m.data_ptr<bool>();
  }
  auto qc = q.contiguous();
  auto out = torch::empty({B, H, T, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), ks2 = keys.stride(2);
  const int64_t vs0 = values.stride(0), vs1 = values.stride(1), vs2 = values.stride(2);
  const int64_t group = H / Hkv;
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, B * H * T, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> score(S + 8);
    std::vector<int32_t> visible(S);
    for (int64_t r = r0; r < r1; r++) {
      const int64_t b = r / (H * T), h = (r / T) % H, t = r % T, hk = h / group;
      const float* qv = qp + ((b * H + h) * T + t) * D;
      float* o = op + ((b * H + h) * T + t) * D;
      attend_masked(qv, kp + b * ks0 + hk * ks1, ks2, vp + b * vs0 + hk * vs1, vs2,
                    mp == nullptr ? nullptr : mp + (b * T + t) * S, S, D, fscale, visible.data(), score.data(), o);
    }
  });
  return out;
}

// A draft tree's verify rows in one call (eyas.protocol.tree.flatten_tree's FlatTree, and the verify's mask):
// tree tokens, parents (-1: the root row), depths [n] int64 and draft probabilities [n] float32, parents
// preceding children; the root row the frontier token at base_position; context: the committed slots every
// row also sees. -> {tokens, positions, parents (-1 for row 0), depths [R] int64, tree_mask [R, R] bool
// (ancestor or self), retrieve [leaves, max depth + 1] int64 (root->leaf rows, leaves in row order, -1 after
// the leaf), draft_probs [R] float32 (1 at the root), mask [R, context + R] bool (the context, then tree_mask)}
std::vector<torch::Tensor> flatten_tree(torch::Tensor tokens, torch::Tensor parents, torch::Tensor depths,
                                        torch::Tensor probs, int64_t frontier, int64_t base_position,
                                        int64_t context) {
  const int64_t n = tokens.numel(), R = n + 1;
  TORCH_CHECK(tokens.dim() == 1 && parents.sizes() == tokens.sizes() && depths.sizes() == tokens.sizes() &&
                  probs.sizes() == tokens.sizes() && tokens.scalar_type() == torch::kLong &&
                  parents.scalar_type() == torch::kLong && depths.scalar_type() == torch::kLong &&
                  probs.scalar_type() == torch::kFloat && context >= 0 && frontier >= 0 && base_position >= 0,
              "flatten_tree: tokens, parents, depths [n] int64, probs [n] float32, nonnegative frontier and positions");
  auto tc = tokens.contiguous(), pc = parents.contiguous(), dc = depths.contiguous(), qc = probs.contiguous();
  const int64_t *tp = tc.data_ptr<int64_t>(), *pp = pc.data_ptr<int64_t>(), *dp = dc.data_ptr<int64_t>();
  const float* qp = qc.data_ptr<float>();
  auto i64 = torch::TensorOptions().dtype(torch::kLong);
  auto out_tokens = torch::empty({R}, i64), out_pos = torch::empty({R}, i64), out_par = torch::empty({R}, i64),
       out_dep = torch::empty({R}, i64), out_prob = torch::empty({R}, torch::TensorOptions().dtype(torch::kFloat));
  auto mask = torch::zeros({R, context + R}, torch::TensorOptions().dtype(torch::kBool));
  int64_t *ot = out_tokens.data_ptr<int64_t>(), *op = out_pos.data_ptr<int64_t>(), *opar = out_par.data_ptr<int64_t>(),
          *od = out_dep.data_ptr<int64_t>();
  float* oq = out_prob.data_ptr<float>();
  bool* mp = mask.data_ptr<bool>();
  const int64_t width = context + R;
  ot[0] = frontier, op[0] = base_position, opar[0] = -1, od[0] = 0, oq[0] = 1.0f;
  std::fill(mp, mp + context, true);
  mp[context] = true;
  std::vector<char> has_child(R, 0);
  int64_t max_depth = 0;
  for (int64_t i = 1; i < R; i++) {
    const int64_t p = pp[i - 1] < 0 ? 0 : pp[i - 1] + 1;
    TORCH_CHECK(p < i, "parents: node ", i - 1, " has parent ", pp[i - 1], "; parents must precede children");
    ot[i] = tp[i - 1], op[i] = base_position + dp[i - 1], opar[i] = p, od[i] = dp[i - 1], oq[i] = qp[i - 1];
    has_child[p] = 1;
    max_depth = std::max(max_depth, dp[i - 1]);
    std::memcpy(mp + i * width, mp + p * width, width);  // the parent's row: its ancestors and itself
    mp[i * width + context + i] = true;
  }
  std::vector<int64_t> leaves;
  for (int64_t i = 0; i < R; i++)
    if (!has_child[i]) leaves.push_back(i);
  auto retrieve = torch::full({static_cast<int64_t>(leaves.size()), max_depth + 1}, -1, i64);
  int64_t* rp = retrieve.data_ptr<int64_t>();
  for (size_t l = 0; l < leaves.size(); l++) {
    std::vector<int64_t> path;
    for (int64_t walk = leaves[l]; walk != -1; walk = opar[walk]) path.push_back(walk);
    for (size_t j = 0; j < path.size(); j++) rp[l * (max_depth + 1) + j] = path[path.size() - 1 - j];
  }
  auto tree_mask = mask.narrow(1, context, R).contiguous();
  return {out_tokens, out_pos, out_par, out_dep, tree_mask, retrieve, out_prob, mask};
}

void register_quant(pybind11::module& m);  // quant.cpp: the gguf precision's kernels

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_f16w", &pack_f16w, "fp16 weights [N, K] packed for linear_f16w");
  m.def("linear_f16w", &linear_f16w, "x [M, K] float32 @ packed fp16 weights^T -> [M, N], row-invariant");
  m.def("attend", &attend, "attention of each query row over its visible keys, row-invariant");
  m.def("flatten_tree", &flatten_tree, "a draft tree's verify rows (FlatTree) and its verify mask in one call");
  register_quant(m);
}
