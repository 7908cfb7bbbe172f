// The `gguf` precision's kernels: a checkpoint's own quantized blocks (GGUF Q4_0, Q4_1, Q8_0), computed
// the way llama.cpp computes them -- each activation row quantized to 8 bits per block of 32 (Q8), the
// products of a weight block and an activation block summed in integers, then scaled in fp32 -- and the
// per-layer glue (RMSNorm, rotary, SiLU x up, residual adds) fused around them, so that a decoder layer is
// two calls and an attention. See eyas/kernels/__init__.py.
//
// Every kernel is *row-invariant*: a row's result depends on its own inputs only, in one fixed order,
// however many rows share the call (a verify row is bit for bit the one-row decode of its token).
//
// One source, two builds (eyas.kernels picks one at run time by the CPU's flags): AVX2 + FMA + F16C (the
// baseline), and AVX-512 with VNNI (`__AVX512VNNI__`), whose integer dot product is one instruction where
// AVX2 takes two. Both sum the same integers exactly, so the two builds compute the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <immintrin.h>

#include <cmath>
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace eyas_quant {

// GGML's type ids and block sizes (bytes per block of 32 weights)
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
constexpr int64_t kBlock = 32;

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // fp16 d, 16 bytes of nibbles: w = d * (q - 8)
    case kQ4_1: return 20;  // fp16 d, fp16 m, 16 bytes of nibbles: w = d * q + m
    case kQ8_0: return 34;  // fp16 d, 32 int8: w = d * q
    default: return 0;
  }
}

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One activation block: x ~= d * q, q in [-127, 127]; isum = sum(q), s = d * isum.
struct ActBlock {
  float d;
  float s;
  int32_t isum;
  int8_t q[32];
};

// rows [M, K] float32 -> Q8 blocks [M, K/32], each block scaled by its absolute maximum / 127, rounded to
// nearest (ties to even)
inline void quantize_row(const float* x, int64_t K, ActBlock* out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < K / kBlock; b++) {
    const float* xb = x + b * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 0x1));
    const float top = _mm_cvtss_f32(m);
    const float d = top / 127.0f;
    const __m256 id = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++)
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    // pack 32 int32 -> 32 int8 in order
    const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);  // lanes interleaved by 128-bit halves
    const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    out[b].d = d;
    out[b].isum = _mm_cvtsi128_si32(s4);
    out[b].s = d * static_cast<float>(out[b].isum);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q), p);
  }
}

// --- weights repacked for SIMD, once at load ------------------------------------------------------
// Outputs are interleaved in groups of kGroup (one SIMD lane each), so that a weight block's products
// with one activation block land in the lanes of their outputs: no horizontal sum. A group's block is
//   d [G] fp16, (m [G] fp16 for Q4_1), then the quantized values, in 4-input steps: byte 4 j + t of a
//   step holds output j's input 4 s + t (Q8_0: 8 steps of 4 G bytes; Q4: 4 registers of 4 G bytes whose
//   low nibbles are inputs 4 r + t and high nibbles inputs 16 + 4 r + t, GGUF's own nibble pairing).
// Each lane computes, block by block: isum = the exact integer dot product; acc = fma(isum, dw * dx, acc);
// (Q4_1) acc = fma(mw, sx, acc): the same arithmetic for any group width, so both builds give the same bits.
#if defined(__AVX512VNNI__)
constexpr int64_t kGroup = 16;
#else
constexpr int64_t kGroup = 8;
#endif

inline int64_t group_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return kGroup * 18;
    case kQ4_1: return kGroup * 20;
    case kQ8_0: return kGroup * 34;
    default: return 0;
  }
}

inline int64_t quant_bytes_offset(int64_t qtype) { return qtype == kQ4_1 ? 4 * kGroup : 2 * kGroup; }

#if defined(__AVX512VNNI__)
using VecI = __m512i;
using VecF = __m512;
inline VecI vzero_i() { return _mm512_setzero_si512(); }
inline VecF vzero_f() { return _mm512_setzero_ps(); }
inline VecI vload_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VecI vbcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline VecI vdot(VecI acc, VecI u, VecI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VecI vand(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI vsrl4(VecI a) { return _mm512_srli_epi16(a, 4); }
inline VecI vset1_8(int8_t v) { return _mm512_set1_epi8(v); }
inline VecI vabs8(VecI a) { return _mm512_abs_epi8(a); }
inline VecI vsign8(VecI x, VecI w) {  // x * sign(w), 0 where w is 0
  const __mmask64 neg = _mm512_movepi8_mask(w), zero = _mm512_testn_epi8_mask(w, w);
  return _mm512_maskz_mov_epi8(~zero, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}
inline VecI vsub_i32(VecI a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline VecF vhalf(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VecF vcvt(VecI a) { return _mm512_cvtepi32_ps(a); }
inline VecF vset1_f(float v) { return _mm512_set1_ps(v); }
inline VecF vmul(VecF a, VecF b) { return _mm512_mul_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm512_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VecF v, int64_t n) {
  if (n == kGroup)
    _mm512_storeu_ps(p, v);
  else
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
inline VecF vload_f(const float* p, int64_t n) {
  return n == kGroup ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
#else
using VecI = __m256i;
using VecF = __m256;
inline VecI vzero_i() { return _mm256_setzero_si256(); }
inline VecF vzero_f() { return _mm256_setzero_ps(); }
inline VecI vload_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VecI vbcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline VecI vdot(VecI acc, VecI u, VecI s) {  // exact: |a pair's sum| < 2^15
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
inline VecI vand(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI vsrl4(VecI a) { return _mm256_srli_epi16(a, 4); }
inline VecI vset1_8(int8_t v) { return _mm256_set1_epi8(v); }
inline VecI vabs8(VecI a) { return _mm256_abs_epi8(a); }
inline VecI vsign8(VecI x, VecI w) { return _mm256_sign_epi8(x, w); }
inline VecI vsub_i32(VecI a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline VecF vhalf(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VecF vcvt(VecI a) { return _mm256_cvtepi32_ps(a); }
inline VecF vset1_f(float v) { return _mm256_set1_ps(v); }
inline VecF vmul(VecF a, VecF b) { return _mm256_mul_ps(a, b); }
inline VecF vfma(VecF a, VecF b, VecF c) { return _mm256_fmadd_ps(a, b, c); }
inline VecF vadd(VecF a, VecF b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VecF v, int64_t n) {
  if (n == kGroup) {
    _mm256_storeu_ps(p, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    std::memcpy(p, t, sizeof(float) * n);
  }
}
inline VecF vload_f(const float* p, int64_t n) {
  if (n == kGroup) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {0};
  std::memcpy(t, p, sizeof(float) * n);
  return _mm256_load_ps(t);
}
#endif

constexpr int64_t kPrefetchBytes = 4096;

// MR rows x one group of kGroup outputs over its nb weight blocks
template <int MR, int64_t QT>
inline void group_rows(const uint8_t* gp, int64_t nb, const ActBlock* const* act, VecF* out) {
  constexpr int64_t GB = QT == kQ4_0 ? kGroup * 18 : (QT == kQ4_1 ? kGroup * 20 : kGroup * 34);
  constexpr int64_t QOFF = QT == kQ4_1 ? 4 * kGroup : 2 * kGroup;
  constexpr int64_t STEP = 4 * kGroup;  // bytes of one 4-input step (one register)
  VecF acc[MR];
  for (int i = 0; i < MR; i++) acc[i] = vzero_f();
  const VecI m4 = vset1_8(0x0F);
  for (int64_t b = 0; b < nb; b++) {
    const uint8_t* blk = gp + b * GB;
    const uint8_t* qs = blk + QOFF;
    for (int64_t o = 0; o < GB; o += 64)  // the stream kPrefetchBytes ahead: past page ends and into the next group
      _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + o), _MM_HINT_T0);
    VecI isum[MR];
    for (int i = 0; i < MR; i++) isum[i] = vzero_i();
    if constexpr (QT == kQ8_0) {
#if defined(__AVX512VNNI__)
      // VNNI sums u8 x s8 products without saturating: the weights offset to unsigned once per step for every
      // row (w ^ 0x80 == w + 128 as a u8), the offset's 128 * sum(q) taken off each row's sum below -- the
      // same integer as |w| . sign(w) x, without a per-row sign fix (three instructions a row a step)
      const VecI offset = vset1_8(static_cast<int8_t>(0x80));
      for (int64_t st = 0; st < 8; st++) {
        const VecI u = _mm512_xor_si512(vload_i(qs + st * STEP), offset);
        for (int i = 0; i < MR; i++) isum[i] = vdot(isum[i], u, vbcast4(act[i][b].q + 4 * st));
      }
#else
      // AVX2's maddubs saturates a pair at 2^15: |w| (<= 128) times the row signed by w keeps it exact
      for (int64_t st = 0; st < 8; st++) {
        const VecI w = vload_i(qs + st * STEP);
        const VecI wabs = vabs8(w);
        for (int i = 0; i < MR; i++) isum[i] = vdot(isum[i], wabs, vsign8(vbcast4(act[i][b].q + 4 * st), w));
      }
#endif
    } else {
      for (int64_t r = 0; r < 4; r++) {
        const VecI raw = vload_i(qs + r * STEP);
        const VecI lo = vand(raw, m4), hi = vand(vsrl4(raw), m4);
        for (int i = 0; i < MR; i++) {
          isum[i] = vdot(isum[i], lo, vbcast4(act[i][b].q + 4 * r));
          isum[i] = vdot(isum[i], hi, vbcast4(act[i][b].q + 16 + 4 * r));
        }
      }
    }
    const VecF dw = vhalf(blk);
    for (int i = 0; i < MR; i++) {
      const ActBlock& a = act[i][b];
      if constexpr (QT == kQ4_0) isum[i] = vsub_i32(isum[i], 8 * a.isum);
#if defined(__AVX512VNNI__)
      if constexpr (QT == kQ8_0) isum[i] = vsub_i32(isum[i], 128 * a.isum);
#endif
      acc[i] = vfma(vcvt(isum[i]), vmul(dw, vset1_f(a.d)), acc[i]);
      if constexpr (QT == kQ4_1) acc[i] = vfma(vhalf(blk + 2 * kGroup), vset1_f(a.s), acc[i]);
    }
  }
  for (int i = 0; i < MR; i++) out[i] = acc[i];
}

#if defined(__AVX512VNNI__)
constexpr int kRowsPerPass = 8;
#else
constexpr int kRowsPerPass = 4;
#endif

template <int64_t QT>
inline void rows_pass(int64_t rows, const uint8_t* gp, int64_t nb, const ActBlock* const* act, VecF* out) {
  switch (rows) {
#if defined(__AVX512VNNI__)
    case 8: group_rows<8, QT>(gp, nb, act, out); break;
    case 7: group_rows<7, QT>(gp, nb, act, out); break;
    case 6: group_rows<6, QT>(gp, nb, act, out); break;
    case 5: group_rows<5, QT>(gp, nb, act, out); break;
#endif
    case 4: group_rows<4, QT>(gp, nb, act, out); break;
    case 3: group_rows<3, QT>(gp, nb, act, out); break;
    case 2: group_rows<2, QT>(gp, nb, act, out); break;
    case 1: group_rows<1, QT>(gp, nb, act, out); break;
    default: break;
  }
}

// groups [g0, g1) of kGroup outputs of y [M, N] = act @ W^T (+ residual)
template <int64_t QT>
void matmul_groups_t(const ActBlock* act, int64_t M, int64_t nb, const uint8_t* w, int64_t N, float* y,
                     const float* residual, int64_t g0, int64_t g1) {
  const int64_t gbytes = nb * group_block_bytes(QT);
  // each pass's row pointers written once, before the groups: filled at every pass (as one 512-bit store) and
  // read back 8 bytes at a time, they stalled store forwarding at every group (~7 % of an 8-row verify's
  // products on a Xeon)
  constexpr int64_t kHoisted = 64;  // passes whose pointers are written ahead (512 rows); past them, at each pass
  const int64_t passes = M > 1 ? (M + kRowsPerPass - 1) / kRowsPerPass : 0;  // (one row: as it was, measured)
  const ActBlock* rowsets[kHoisted][kRowsPerPass];
  for (int64_t p = 0; p < std::min(passes, kHoisted); p++)
    for (int64_t i = 0; i < kRowsPerPass; i++) rowsets[p][i] = act + std::min(p * kRowsPerPass + i, M - 1) * nb;
  const ActBlock* rows[kRowsPerPass];
  VecF out[kRowsPerPass];
  for (int64_t g = g0; g < g1; g++) {
    const int64_t n0 = g * kGroup, n = std::min(kGroup, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kRowsPerPass) {
      const int64_t mr = std::min<int64_t>(kRowsPerPass, M - m0), p = m0 / kRowsPerPass;
      const bool hoisted = p < std::min(passes, kHoisted);
      if (!hoisted)
        for (int64_t i = 0; i < mr; i++) rows[i] = act + (m0 + i) * nb;
      rows_pass<QT>(mr, w + g * gbytes, nb, hoisted ? rowsets[p] : rows, out);
      for (int64_t i = 0; i < mr; i++) {
        float* yr = y + (m0 + i) * N + n0;
        vstore(yr, residual ? vadd(vload_f(residual + (m0 + i) * N + n0, n), out[i]) : out[i], n);
      }
    }
  }
}

// groups [g0, g1) of y [M, N] = act @ W^T (+ residual [M, N]); W repacked by repack_q
void matmul_groups(const ActBlock* act, int64_t M, int64_t K, const torch::Tensor& w, int64_t qtype, int64_t N,
                   float* y, const float* residual, int64_t g0, int64_t g1) {
  const int64_t nb = K / kBlock;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  switch (qtype) {
    case kQ4_0: matmul_groups_t<kQ4_0>(act, M, nb, wp, N, y, residual, g0, g1); break;
    case kQ4_1: matmul_groups_t<kQ4_1>(act, M, nb, wp, N, y, residual, g0, g1); break;
    case kQ8_0: matmul_groups_t<kQ8_0>(act, M, nb, wp, N, y, residual, g0, g1); break;
    default: TORCH_CHECK(false, "qtype: ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  }
}

inline int64_t output_groups(int64_t N) { return (N + kGroup - 1) / kGroup; }

// y [M, N] = act @ W^T (+ residual [M, N]), the output groups over the threads
void matmul(const ActBlock* act, int64_t M, int64_t K, const torch::Tensor& w, int64_t qtype, int64_t N,
            float* y, const float* residual = nullptr) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ8_0, "qtype: ", qtype,
              " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  at::parallel_for(0, output_groups(N), 1, [&](int64_t g0, int64_t g1) {
    matmul_groups(act, M, K, w, qtype, N, y, residual, g0, g1);
  });
}

void check_raw(const torch::Tensor& w, int64_t qtype, int64_t K, const char* name) {
  TORCH_CHECK(block_bytes(qtype) > 0, name, ": qtype ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous(), name,
              ": expected [N, K/32 * block bytes] uint8 blocks");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * block_bytes(qtype), name, ": ", w.size(1),
              " bytes a row, but ", K, " inputs take ", K / kBlock * block_bytes(qtype));
}

// raw GGUF blocks [N, K/32 * block bytes] -> [ceil(N / kGroup), K/32 * group block bytes] (padding outputs 0)
torch::Tensor repack(torch::Tensor raw, int64_t qtype, int64_t K) {
  check_raw(raw, qtype, K, "weight");
  const int64_t bs = block_bytes(qtype), gbb = group_block_bytes(qtype), qoff = quant_bytes_offset(qtype);
  const int64_t N = raw.size(0), nb = K / kBlock, groups = (N + kGroup - 1) / kGroup;
  auto out = torch::zeros({groups, nb * gbb}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t g = 0; g < groups; g++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t* dst = op + g * nb * gbb + b * gbb;
      for (int64_t j = 0; j < kGroup && g * kGroup + j < N; j++) {
        const uint8_t* src = rp + (g * kGroup + j) * nb * bs + b * bs;
        std::memcpy(dst + 2 * j, src, 2);                                       // d
        if (qtype == kQ4_1) std::memcpy(dst + 2 * kGroup + 2 * j, src + 2, 2);  // m
        const uint8_t* q = src + (qtype == kQ4_1 ? 4 : 2);
        const int64_t steps = qtype == kQ8_0 ? 8 : 4;
        for (int64_t st = 0; st < steps; st++)
          for (int64_t t = 0; t < 4; t++) dst[qoff + st * 4 * kGroup + 4 * j + t] = q[4 * st + t];
      }
    }
  return out;
}

void check_packed(const torch::Tensor& w, int64_t qtype, int64_t K, int64_t N, const char* name) {
  TORCH_CHECK(block_bytes(qtype) > 0, name, ": qtype ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kByte && w.is_contiguous(), name,
              ": expected repack()'s [groups, blocks] uint8");
  TORCH_CHECK(K % kBlock == 0 && w.size(1) == K / kBlock * group_block_bytes(qtype), name, ": ", w.size(1),
              " bytes a group, but ", K, " inputs take ", K / kBlock * group_block_bytes(qtype));
  TORCH_CHECK(N > 0 && w.size(0) == (N + kGroup - 1) / kGroup, name, ": ", w.size(0), " groups of ", kGroup,
              " cannot hold ", N, " outputs");
}

std::vector<ActBlock> quantize_rows(const float* x, int64_t M, int64_t K) {
  std::vector<ActBlock> act(M * (K / kBlock));
  for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, act.data() + m * (K / kBlock));
  return act;
}

// A buffer of this thread's own, reused across calls (grown, never shrunk, never cleared: every caller writes
// what it reads). ``Slot`` tells a caller's buffers apart. A fresh std::vector a layer a call zeroed (and, past
// malloc's mmap threshold, page-faulted) megabytes of it for a prefill chunk.
template <typename T, int Slot>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// rows at least this many go over the threads (each row alone, the same code: row-invariant); fewer run inline
constexpr int64_t kRowGrain = 16;

// rows [M, K] -> this thread's Q8 scratch (its Slot-th), valid until the next call with that slot
template <int Slot>
const ActBlock* quantize_scratch(const float* x, int64_t M, int64_t K) {
  ActBlock* act = scratch<ActBlock, Slot>(M * (K / kBlock));
  at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) quantize_row(x + m * K, K, act + m * (K / kBlock));
  });
  return act;
}

// 1 / sqrt(mean(x^2) + eps) of one row [K], in one fixed order
inline float rms_inv(const float* xr, int64_t K, double eps) {
  __m256 ss = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(xr + k);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  float sum = hsum8(ss);
  for (; k < K; k++) sum += xr[k] * xr[k];
  return 1.0f / std::sqrt(sum / static_cast<float>(K) + static_cast<float>(eps));
}

// RMSNorm of each row, in one fixed order: w * (x / sqrt(mean(x^2) + eps))
void rms_norm_rows(const float* x, int64_t M, int64_t K, const float* w, double eps, float* out) {
  at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) {
      const float* xr = x + m * K;
      const float inv = rms_inv(xr, K, eps);
      for (int64_t k = 0; k < K; k++) out[m * K + k] = w[k] * (xr[k] * inv);
    }
  });
}

torch::Tensor as_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, name, ": expected [M, K] float32");
  return x.contiguous();
}

}  // namespace eyas_quant

using namespace eyas_quant;

// RMSNorm of each row of x [M, K] float32 with weight w [K] float32 -> [M, K] (rms_norm_rows' order)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = as_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == K && w.scalar_type() == torch::kFloat && w.is_contiguous(), "weight: expected [",
              K, "] float32, contiguous");
  auto y = torch::empty({M, K}, x.options());
  if (M) rms_norm_rows(x.data_ptr<float>(), M, K, w.data_ptr<float>(), eps, y.data_ptr<float>());
  return y;
}

// x [M, K] float32 @ W^T, W [N, K] in GGUF blocks of `qtype` repacked by repack() -> [M, N] float32
torch::Tensor linear_q(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N) {
  x = as_rows(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(w, qtype, K, N, "weight");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto act = quantize_rows(x.data_ptr<float>(), M, K);
  matmul(act.data(), M, K, w, qtype, N, y.data_ptr<float>());
  return y;
}

namespace eyas_quant {

// The first maximal index of one row [N] as torch.argmax picks it: a NaN counts as the maximum (the first
// NaN wins); else the first index holding the row's largest value (-0.0 and 0.0 compare equal).
int64_t argmax_row(const float* y, int64_t N) {
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m256 v = _mm256_loadu_ps(y + n);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  float best = lanes[0];
  for (int i = 1; i < 8; i++) best = std::max(best, lanes[i]);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; n < N; n++) {
    if (std::isnan(y[n])) any_nan = true;
    else best = std::max(best, y[n]);
  }
  for (int64_t i = 0; i < N; i++) {
    if (any_nan ? std::isnan(y[i]) : y[i] == best) return i;
  }
  return 0;  // every value -inf: the first
}

}  // namespace eyas_quant

// each row's first maximal index of y [M, N] float32 (argmax_row; N >= 1) -> [M] int64
torch::Tensor argmax_rows(torch::Tensor y) {
  y = as_rows(y, "y");
  const int64_t M = y.size(0), N = y.size(1);
  TORCH_CHECK(N >= 1, "y: expected at least one column");
  auto ids = torch::empty({M}, y.options().dtype(torch::kLong));
  const float* yp = y.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t m = 0; m < M; m++) ip[m] = argmax_row(yp + m * N, N);
  return ids;
}

// linear_q and each row's argmax (torch.argmax's choice: see argmax_row): the logits of a vocabulary head and
// the greedy token of each row in one call -> (y [M, N], ids [M] int64)
std::vector<torch::Tensor> linear_q_argmax(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t N) {
  auto y = linear_q(x, w, qtype, N);
  return {y, argmax_rows(y)};
}

namespace eyas_quant {

// one head's rotary (HF's rotate-half layout): out = in * cos + rotate_half(in) * sin, cos/sin the row's [hd]
inline void rotate_half_row(const float* in, const float* cm, const float* sm, int64_t hd, float* out) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; j++) {
    out[j] = in[j] * cm[j] + (-in[j + half]) * sm[j];
    out[j + half] = in[j + half] * cm[j + half] + in[j] * sm[j + half];
  }
}

// q, k, v [M, H|Hkv, hd] of RMSNorm(x) through the fused q/k/v weights, rotary applied to q and k
void layer_qkv(const float* x, int64_t M, int64_t d, const float* norm_w, double eps, const torch::Tensor& wqkv,
               int64_t qtype, const float* cos, const float* sin, int64_t heads, int64_t kv_heads, int64_t hd, float* q,
               float* k, float* v) {
  const int64_t N = (heads + 2 * kv_heads) * hd;
  float* h = scratch<float, 0>(norm_w != nullptr ? M * d : 0);
  float* qkv = scratch<float, 1>(M * N);
  if (norm_w != nullptr) rms_norm_rows(x, M, d, norm_w, eps, h);  // none: x comes normed (a drafter's)
  matmul(quantize_scratch<0>(norm_w != nullptr ? h : x, M, d), M, d, wqkv, qtype, N, qkv);
  at::parallel_for(0, M, kRowGrain, [&](int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; m++) {
    const float* row = qkv + m * N;
    const float* cm = cos + m * hd;
    const float* sm = sin + m * hd;
    for (int64_t i = 0; i < heads; i++) rotate_half_row(row + i * hd, cm, sm, hd, q + (m * heads + i) * hd);
    for (int64_t i = 0; i < kv_heads; i++)
      rotate_half_row(row + (heads + i) * hd, cm, sm, hd, k + (m * kv_heads + i) * hd);
    std::memcpy(v + m * kv_heads * hd, row + (heads + kv_heads) * hd, sizeof(float) * kv_heads * hd);
  }
  });
}

// silu(g) * u, 8 at a time: g * sigmoid(g), sigmoid from e = exp(-|g|) (never above 1) as 1 / (1 + e) for g >= 0
// and e / (1 + e) below; the last n % 8 through the same lanes (a zero-padded copy): every element computed alike
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));
  const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_mul_ps(g, _mm256_blendv_ps(r, _mm256_mul_ps(e, r), g)), u);
}

inline void silu_mul_row(const float* g, const float* u, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(out + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  if (j < n) {
    alignas(32) float tg[8] = {0}, tu[8] = {0}, to[8];
    std::memcpy(tg, g + j, sizeof(float) * (n - j));
    std::memcpy(tu, u + j, sizeof(float) * (n - j));
    _mm256_store_ps(to, silu_mul8(_mm256_load_ps(tg), _mm256_load_ps(tu)));
    std::memcpy(out + j, to, sizeof(float) * (n - j));
  }
}

// out [M, d] = x1 + down(silu(gate) * up) of RMSNorm(x1), where x1 = x + wo(a)
void layer_out_mlp(const float* x, const float* a, int64_t M, int64_t d, int64_t ha, const torch::Tensor& wo,
                   int64_t wo_type, const float* norm_w, double eps, const torch::Tensor& w_gate_up, int64_t gate_up_type,
                   const torch::Tensor& w_down, int64_t down_type, int64_t ffn, float* out) {
  float* x1 = scratch<float, 2>(M * d);
  float* h = scratch<float, 3>(M * d);
  float* gu = scratch<float, 4>(M * 2 * ffn);
  float* act = scratch<float, 5>(M * ffn);
  matmul(quantize_scratch<1>(a, M, ha), M, ha, wo, wo_type, d, x1, x);
  rms_norm_rows(x1, M, d, norm_w, eps, h);
  matmul(quantize_scratch<1>(h, M, d), M, d, w_gate_up, gate_up_type, 2 * ffn, gu);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) silu_mul_row(gu + m * 2 * ffn, gu + m * 2 * ffn + ffn, ffn, act + m * ffn);
  });
  matmul(quantize_scratch<1>(act, M, ffn), M, ffn, w_down, down_type, d, out, x1);
}

}  // namespace eyas_quant

// A decoder layer's attention input: q, k, v of RMSNorm(x) (norm_w empty: of x as it is) through the fused
// q/k/v weights (repacked), with rotary position embedding (HF's rotate-half layout) on q and k. x [M, d];
// cos, sin [M, hd].
std::vector<torch::Tensor> attn_in(torch::Tensor x, torch::Tensor norm_w, double eps, torch::Tensor wqkv,
                                   int64_t qtype, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                   int64_t kv_heads, int64_t head_dim) {
  x = as_rows(x, "x");
  const int64_t M = x.size(0), d = x.size(1), hd = head_dim;
  check_packed(wqkv, qtype, d, (heads + 2 * kv_heads) * hd, "wqkv");
  TORCH_CHECK((norm_w.numel() == d || norm_w.numel() == 0) && norm_w.scalar_type() == torch::kFloat,
              "norm_w: expected [d] float32 (or empty: no norm)");
  cos = as_rows(cos, "cos");
  sin = as_rows(sin, "sin");
  TORCH_CHECK(cos.size(0) == M && cos.size(1) == hd && sin.sizes() == cos.sizes(), "cos, sin: expected [M, hd]");
  auto q = torch::empty({M, heads, hd}, x.options());
  auto k = torch::empty({M, kv_heads, hd}, x.options());
  auto v = torch::empty({M, kv_heads, hd}, x.options());
  if (M == 0) return {q, k, v};
  auto nw = norm_w.contiguous();
  layer_qkv(x.data_ptr<float>(), M, d, nw.numel() ? nw.data_ptr<float>() : nullptr, eps, wqkv, qtype, cos.data_ptr<float>(),
            sin.data_ptr<float>(), heads, kv_heads, hd, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>());
  return {q, k, v};
}

// The rest of a decoder layer after attention: x + wo(a), then + down(silu(gate) * up) of its RMSNorm.
// x [M, d], a [M, heads * hd] (the attention output) -> [M, d]; weights repacked, gate/up fused [2 ffn, d].
torch::Tensor attn_out_mlp(torch::Tensor x, torch::Tensor a, torch::Tensor wo, int64_t wo_type, torch::Tensor norm_w,
                           double eps, torch::Tensor w_gate_up, int64_t gate_up_type, torch::Tensor w_down,
                           int64_t down_type, int64_t ffn) {
  x = as_rows(x, "x");
  a = as_rows(a, "a");
  const int64_t M = x.size(0), d = x.size(1), ha = a.size(1);
  TORCH_CHECK(a.size(0) == M, "a: ", a.size(0), " rows, x has ", M);
  check_packed(wo, wo_type, ha, d, "wo");
  check_packed(w_gate_up, gate_up_type, d, 2 * ffn, "w_gate_up");
  check_packed(w_down, down_type, ffn, d, "w_down");
  TORCH_CHECK(norm_w.numel() == d && norm_w.scalar_type() == torch::kFloat, "norm_w: expected [d] float32");
  auto out = torch::empty({M, d}, x.options());
  if (M == 0) return out;
  layer_out_mlp(x.data_ptr<float>(), a.data_ptr<float>(), M, d, ha, wo, wo_type, norm_w.contiguous().data_ptr<float>(),
                eps, w_gate_up, gate_up_type, w_down, down_type, ffn, out.data_ptr<float>());
  return out;
}

namespace eyas_quant {

// One row of logits [N] -> its k largest (ids, in decreasing order, a tie to the lower id) and their softmax
// probabilities exp(l - max) / sum(exp(l - max)), the sum over the whole row 8 lanes at a time (the tail
// through zero-padded lanes).
void row_topk(const float* logits, int64_t N, int64_t k, int64_t* ids, float* conf) {
  // the largest value, NaN ignored (std::max(top, l) keeps top against a NaN; max_ps(l, acc) returns acc);
  // max is exact in any order (a zero's sign may differ, and l - top is the same either way)
  float top = -INFINITY;
  int64_t j0 = 0;
  {
    __m256 acc = _mm256_set1_ps(-INFINITY);
    for (; j0 + 8 <= N; j0 += 8) acc = _mm256_max_ps(_mm256_loadu_ps(logits + j0), acc);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (int i = 0; i < 8; i++) top = std::max(top, lanes[i]);
  }
  for (int64_t j = j0; j < N; j++) top = std::max(top, logits[j]);
  const __m256 topv = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= N; j += 8) acc = _mm256_add_ps(acc, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(logits + j), topv)));
  float sum = hsum8(acc);
  if (j < N) {
    alignas(32) float tail[8], e[8];
    for (int i = 0; i < 8; i++) tail[i] = j + i < N ? logits[j + i] - top : -INFINITY;
    _mm256_store_ps(e, exp_nonpositive(_mm256_load_ps(tail)));
    for (int i = 0; i < 8 && j + i < N; i++) sum += e[i];
  }
  // the k best so far, best first
  std::vector<int64_t> best;
  best.reserve(k + 1);
  auto consider = [&](int64_t v) {
    const float l = logits[v];
    if (static_cast<int64_t>(best.size()) == k && !(l > logits[best.back()])) return;
    auto at = best.end();
    while (at != best.begin() && l > logits[*(at - 1)]) --at;
    best.insert(at, v);
    if (static_cast<int64_t>(best.size()) > k) best.pop_back();
  };
  int64_t v = 0;
  for (; v < N && static_cast<int64_t>(best.size()) < k; v++) consider(v);
  // once k are held, only a value above the k-th can enter: 8 values at a time are skipped when none is
  // (an ordered compare: a NaN never enters, as in the scalar test); the rest one by one, in order
  for (; v + 8 <= N; v += 8) {
    const __m256 kth = _mm256_set1_ps(logits[best.back()]);
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(logits + v), kth, _CMP_GT_OQ)) == 0) continue;
    for (int64_t i = v; i < v + 8; i++) consider(i);
  }
  for (; v < N; v++) consider(v);
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < k; i++) {
    alignas(32) float d[8] = {logits[best[i]] - top, 0, 0, 0, 0, 0, 0, 0}, e[8];
    _mm256_store_ps(e, exp_nonpositive(_mm256_load_ps(d)));
    ids[i] = best[i];
    conf[i] = e[0] * inv;
  }
}

}  // namespace eyas_quant

// A drafter's children in one call: RMSNorm of x (norm_w empty: x as it is), the vocabulary head (GGUF
// blocks, repacked), then each row's top k with their softmax probabilities. x [P, d] -> (ids [P, k] int64,
// conf [P, k] float32).
std::vector<torch::Tensor> head_topk(torch::Tensor x, torch::Tensor norm_w, double eps, torch::Tensor w, int64_t qtype,
                                     int64_t N, int64_t k) {
  x = as_rows(x, "x");
  const int64_t P = x.size(0), d = x.size(1);
  check_packed(w, qtype, d, N, "weight");
  TORCH_CHECK((norm_w.numel() == d || norm_w.numel() == 0) && norm_w.scalar_type() == torch::kFloat,
              "norm_w: expected [d] float32 (or empty: no norm)");
  TORCH_CHECK(k >= 1 && k <= N, "k: ", k, " is not in [1, ", N, "]");
  auto ids = torch::empty({P, k}, x.options().dtype(torch::kLong));
  auto conf = torch::empty({P, k}, x.options());
  if (P == 0) return {ids, conf};
  auto nw = norm_w.contiguous();
  const float* in = x.data_ptr<float>();
  float* h = scratch<float, 0>(P * d);
  if (nw.numel()) {
    rms_norm_rows(in, P, d, nw.data_ptr<float>(), eps, h);
    in = h;
  }
  float* logits = scratch<float, 6>(P * N);
  matmul(quantize_scratch<0>(in, P, d), P, d, w, qtype, N, logits);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; p++)
      row_topk(logits + p * N, N, k, ids.data_ptr<int64_t>() + p * k, conf.data_ptr<float>() + p * k);
  });
  return {ids, conf};
}

namespace eyas_quant {

// --- attention of one request's rows, per K/V head, reading its K/V once --------------------------------
// Every (row, query head) is computed exactly as alone, in one fixed order: a key's score is q . key as one
// 8-lane FMA chain reduced as ((x0+x1)+(x2+x3)) + ((x4+x5)+(x6+x7)) (four keys at a time or one, the same sum
// for each); the scores' max; exp 8 at a time over the row's visible list with padding lanes 0; the weighted
// values in visible order; one multiply by 1 / sum. Grouping rows and heads changes only which of them read a
// key while it is in L1: the committed prefix (slots 0..P-1, visible to every row of the request) is walked
// in tiles, every row and head of the group scoring a tile before the next is read.

// A stored K/V element: fp32, or fp16 (llama.cpp's default cache type: half the bytes a decode reads), 8 at a
// time as fp32 (exact: every fp16 is an fp32)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
#endif

// hd fp32 values (a multiple of 8) into the store: as they are, or each rounded to the nearest fp16
inline void store_row(const float* src, float* dst, int64_t hd) { std::memcpy(dst, src, sizeof(float) * hd); }
inline void store_row(const float* src, uint16_t* dst, int64_t hd) {
  for (int64_t j = 0; j < hd; j += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
}

template <int lanes, typename T>
inline __m128 key_dots4(const __m256* qv, const T* k0, const T* k1, const T* k2, const T* k3) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t l = 0; l < lanes; l++) {
    a0 = _mm256_fmadd_ps(qv[l], load8(k0 + 8 * l), a0);
    a1 = _mm256_fmadd_ps(qv[l], load8(k1 + 8 * l), a1);
    a2 = _mm256_fmadd_ps(qv[l], load8(k2 + 8 * l), a2);
    a3 = _mm256_fmadd_ps(qv[l], load8(k3 + 8 * l), a3);
  }
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// eight consecutive keys k, k + stride, ... (each exactly as key_dots4 / key_dot sum it)
template <int lanes, typename T>
inline void key_dots8(const __m256* qv, const T* k, int64_t stride, __m128* lo, __m128* hi) {
  __m256 a[8];
  for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
  for (int l = 0; l < lanes; l++)
    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv[l], load8(k + j * stride + 8 * l), a[j]);
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  *lo = _mm_add_ps(_mm256_castps256_ps128(h0), _mm256_extractf128_ps(h0, 1));
  *hi = _mm_add_ps(_mm256_castps256_ps128(h1), _mm256_extractf128_ps(h1, 1));
}

template <int lanes, typename T>
inline float key_dot(const __m256* qv, const T* k) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t l = 0; l < lanes; l++) a = _mm256_fmadd_ps(qv[l], load8(k + 8 * l), a);
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

constexpr int64_t kKeyTile = 32;  // keys of the shared prefix read once into L1 for every row and head

// --- keys in Q8 blocks (llama.cpp's `-ctk q8_0`) -----------------------------------------------------
// A stored key of hd values is hd int8 (blocks of 32, each scaled by its absolute maximum / 127, rounded to
// nearest: quantize_row) then hd / 32 fp32 scales: key_width(hd) bytes. A query row is quantized the same way,
// and a score is its integer dot products block by block, each scaled in fp32, added in block order:
//   score = fma(isum[nb-1], dk[nb-1] * dq[nb-1], ... fma(isum[0], dk[0] * dq[0], 0))
// The same arithmetic for every key in every path (a tile of the shared prefix or a row's own tail), so a
// verify row's scores are bit for bit its one-row decode's; the integers are exact on both builds.
inline int64_t key_width(int64_t hd) { return hd + 4 * (hd / kBlock); }

inline void store_key_q8(const float* src, uint8_t* dst, int64_t hd) {
  ActBlock blocks[4];
  quantize_row(src, hd, blocks);
  for (int64_t b = 0; b < hd / kBlock; b++) {
    std::memcpy(dst + b * kBlock, blocks[b].q, kBlock);
    std::memcpy(dst + hd + 4 * b, &blocks[b].d, 4);
  }
}

// one key's score against a quantized query (qa: its hd / 32 blocks), the gathered path
inline float key_dot_q8(const ActBlock* qa, const uint8_t* key, int64_t hd) {
  float acc = 0.0f;
  for (int64_t b = 0; b < hd / kBlock; b++) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + b * kBlock));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa[b].q));
    const __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(k)),
                                         _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
    const __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(k, 1)),
                                         _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
    __m256i s = _mm256_add_epi32(lo, hi);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    float dk;
    std::memcpy(&dk, key + hd + 4 * b, 4);
    acc = std::fma(static_cast<float>(_mm_cvtsi128_si32(s4)), dk * qa[b].d, acc);
  }
  return acc;
}

#if defined(__AVX512VNNI__)
// r[16]: one vector a key (its 16 lanes of 4-input dot products) -> each key's two 32-input block sums, as two
// vectors over the 16 keys (lanes 0-7 of a key's vector are its first block, 8-15 its second)
inline void block_sums16(const __m512i* r, __m512i* b0, __m512i* b1) {
  __m512i s1[8], s2[4];
  for (int p = 0; p < 8; p++)
    s1[p] = _mm512_add_epi32(_mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]), _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]));
  for (int g = 0; g < 4; g++)  // s2[g], 128-bit lane c: keys 4g..4g+3, each summed over its lanes 4c..4c+3
    s2[g] = _mm512_add_epi32(_mm512_unpacklo_epi64(s1[2 * g], s1[2 * g + 1]), _mm512_unpackhi_epi64(s1[2 * g], s1[2 * g + 1]));
  const __m512i lo = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i hi = _mm512_add_epi32(_mm512_shuffle_i32x4(s2[2], s2[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_i32x4(s2[2], s2[3], _MM_SHUFFLE(3, 1, 3, 1)));
  *b0 = _mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
  *b1 = _mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
}

// group_scores_q8 for head_dim 64 without the transposing gathers: each key's whole row in one product a unit
// and a reduction; cheaper where a task has few units (a decode, a small tree). The same integers, the same
// scaling in the same order: the same bits.
inline void group_scores_q8_rows(const uint8_t* keys, int64_t W, int64_t n, const ActBlock* qa, const uint8_t* qu,
                                 int64_t units, float* const* sc, const int64_t* run, int64_t i0) {
  __m512i k[16], r[16];
  alignas(64) float d0[16], d1[16];
  for (int j = 0; j < 16; j++) {
    const uint8_t* key = keys + (j < n ? j : 0) * W;
    k[j] = _mm512_loadu_si512(key);
    std::memcpy(d0 + j, key + 64, 4);
    std::memcpy(d1 + j, key + 68, 4);
  }
  const VecF dk0 = _mm512_load_ps(d0), dk1 = _mm512_load_ps(d1);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i ksum0, ksum1;
  for (int j = 0; j < 16; j++) r[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, k[j]);
  block_sums16(r, &ksum0, &ksum1);
  ksum0 = _mm512_slli_epi32(ksum0, 7);  // 128 * sum: the offset of the query's unsigned form
  ksum1 = _mm512_slli_epi32(ksum1, 7);
  for (int64_t u = 0; u < units; u++) {
    const int64_t m = std::min<int64_t>(n, run[u] - i0);
    if (m <= 0) continue;
    const __m512i qv = _mm512_loadu_si512(qu + u * 64);
    for (int j = 0; j < 16; j++) r[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qv, k[j]);
    __m512i is0, is1;
    block_sums16(r, &is0, &is1);
    const ActBlock* a = qa + u * 2;
    VecF acc = vfma(vcvt(_mm512_sub_epi32(is0, ksum0)), vmul(dk0, vset1_f(a[0].d)), vzero_f());
    acc = vfma(vcvt(_mm512_sub_epi32(is1, ksum1)), vmul(dk1, vset1_f(a[1].d)), acc);
    vstore(sc[u] + i0, acc, m);
  }
}
#endif
// a task of at most this many units scores by rows (head_dim 64): VNNI's rows path pays a transposing reduction a
// unit, its gathers a task; AVX2's costs less than its gathers up to a tree's units (a prompt chunk's gather)
#if defined(__AVX512VNNI__)
constexpr int64_t kRowsPathUnits = 8;
#else
constexpr int64_t kRowsPathUnits = 32;
#endif

#if !defined(__AVX512VNNI__)
// 8 int32 vectors -> one vector of their horizontal sums (lane j: the sum of v[j]'s lanes); integers: exact
inline __m256i hsums8(const __m256i* v) {
  const __m256i t01 = _mm256_hadd_epi32(v[0], v[1]), t23 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t45 = _mm256_hadd_epi32(v[4], v[5]), t67 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t01, t23), u1 = _mm256_hadd_epi32(t45, t67);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// group_scores_q8 for head_dim 64 on the AVX2 build without gathers: each key's two 32-byte blocks as they lie,
// one product per (unit, key, block) (|k| times q signed by k, in int16 pairs: |sum| <= 2 * 127 * 127), the
// eight keys' sums by one transposing reduction; the same integers, scaled in the same order: the same bits
inline void group_scores_q8_rows(const uint8_t* keys, int64_t W, int64_t n, const ActBlock* qa, int64_t units,
                                 float* const* sc, const int64_t* run, int64_t i0) {
  __m256i k[8][2], ka[8][2];
  alignas(32) float d0[8], d1[8];
  for (int j = 0; j < 8; j++) {
    const uint8_t* key = keys + (j < n ? j : 0) * W;
    for (int b = 0; b < 2; b++) {
      k[j][b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(key + kBlock * b));
      ka[j][b] = _mm256_abs_epi8(k[j][b]);
    }
    std::memcpy(d0 + j, key + 64, 4);
    std::memcpy(d1 + j, key + 68, 4);
  }
  const VecF dk0 = _mm256_load_ps(d0), dk1 = _mm256_load_ps(d1);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t u = 0; u < units; u++) {
    const int64_t m = std::min<int64_t>(n, run[u] - i0);
    if (m <= 0) continue;
    const ActBlock* a = qa + u * 2;
    __m256i is[2];
    for (int b = 0; b < 2; b++) {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[b].q));
      __m256i p[8];
      for (int j = 0; j < 8; j++)
        p[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(ka[j][b], _mm256_sign_epi8(qv, k[j][b])), ones);
      is[b] = hsums8(p);
    }
    VecF acc = vfma(vcvt(is[0]), vmul(dk0, vset1_f(a[0].d)), vzero_f());
    acc = vfma(vcvt(is[1]), vmul(dk1, vset1_f(a[1].d)), acc);
    vstore(sc[u] + i0, acc, m);
  }
}
#endif

// kGroup consecutive keys (n of them real; the rest repeat the first and are not stored) against every unit's
// quantized query: scores into sc[u] + i0 for the keys of the group below run[u] (the unit's run of visible
// slots 0, 1, 2, ...). keys: the first key's bytes; W: key_width(hd).
template <int nb>
inline void group_scores_q8(const uint8_t* keys, int64_t W, int64_t n, const ActBlock* qa, const uint8_t* qu,
                            int64_t units, float* const* sc, const int64_t* run, int64_t i0) {
  constexpr int64_t hd = nb * kBlock;
  alignas(64) int32_t idx[kGroup];
  for (int64_t j = 0; j < kGroup; j++) idx[j] = static_cast<int32_t>((j < n ? j : 0) * W);
  VecI reg[nb][8];
  VecF dk[nb];
#if defined(__AVX512VNNI__)
  const __m512i vidx = _mm512_load_si512(idx);
  VecI ksum[nb];
  const VecI ones = vset1_8(1);
  for (int b = 0; b < nb; b++) {
    ksum[b] = vzero_i();
    for (int st = 0; st < 8; st++) {
      reg[b][st] = _mm512_i32gather_epi32(vidx, keys + b * kBlock + 4 * st, 1);
      ksum[b] = vdot(ksum[b], ones, reg[b][st]);  // each lane's sum of its key's block
    }
    ksum[b] = _mm512_slli_epi32(ksum[b], 7);  // 128 * sum: the offset of the query's unsigned form
    dk[b] = _mm512_i32gather_ps(vidx, keys + hd + 4 * b, 1);
  }
  for (int64_t u = 0; u < units; u++) {
    const int64_t m = std::min<int64_t>(n, run[u] - i0);  // this unit's keys in the group
    if (m <= 0) continue;
    const ActBlock* a = qa + u * nb;
    VecF acc = vzero_f();
    const int8_t* q8u = reinterpret_cast<const int8_t*>(qu + u * hd);
    for (int b = 0; b < nb; b++) {
      VecI isum = vzero_i();
      for (int st = 0; st < 8; st++) isum = vdot(isum, vbcast4(q8u + b * kBlock + 4 * st), reg[b][st]);
      isum = _mm512_sub_epi32(isum, ksum[b]);
      acc = vfma(vcvt(isum), vmul(dk[b], vset1_f(a[b].d)), acc);
    }
    vstore(sc[u] + i0, acc, m);
  }
#else
  const __m256i vidx = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
  VecI kabs[nb][8];
  for (int b = 0; b < nb; b++) {
    for (int st = 0; st < 8; st++) {
      reg[b][st] = _mm256_i32gather_epi32(reinterpret_cast<const int*>(keys + b * kBlock + 4 * st), vidx, 1);
      kabs[b][st] = vabs8(reg[b][st]);
    }
    dk[b] = _mm256_i32gather_ps(reinterpret_cast<const float*>(keys + hd + 4 * b), vidx, 1);
  }
  for (int64_t u = 0; u < units; u++) {
    const int64_t m = std::min<int64_t>(n, run[u] - i0);  // this unit's keys in the group
    if (m <= 0) continue;
    const ActBlock* a = qa + u * nb;
    VecF acc = vzero_f();
    for (int b = 0; b < nb; b++) {
      VecI isum = vzero_i();
      for (int st = 0; st < 8; st++) isum = vdot(isum, kabs[b][st], vsign8(vbcast4(a[b].q + 4 * st), reg[b][st]));
      acc = vfma(vcvt(isum), vmul(dk[b], vset1_f(a[b].d)), acc);
    }
    vstore(sc[u] + i0, acc, m);
  }
#endif
}

// rows: the request's packed rows; each sees visible[n] (the first P slots 0..P-1 shared by all of them). q [*, H,
// hd]; heads [h0, h1) all read K/V head j, whose slots are keys/values + slot * hd. Writes out [*, H, hd].
// lanes: head_dim / 8, a constant of the compiled code so that the accumulators stay in registers
template <int lanes, typename TK, typename T>
void attend_request_t(const std::vector<int64_t>& rows, const std::vector<std::vector<int32_t>>& visible, int64_t P,
                      const float* q, int64_t H, int64_t h0, int64_t h1, const TK* keys, const T* values,
                      float scale, float* out) {
  constexpr int64_t hd = 8 * lanes;
  constexpr bool q8_keys = std::is_same_v<TK, uint8_t>;  // keys in Q8 blocks (key_width(hd) bytes a key)
  const int64_t nh = h1 - h0, nr = static_cast<int64_t>(rows.size());
  const int64_t units = nr * nh;  // (row, head) pairs
  // this thread's buffers (eyas_quant::scratch: no allocation, zeroing or page faults a call), each written
  // before it is read
  int64_t* offset = scratch<int64_t, 20>(units + 1);
  offset[0] = 0;
  for (int64_t u = 0; u < units; u++) {
    const int64_t n = static_cast<int64_t>(visible[rows[u / nh]].size());
    offset[u + 1] = offset[u] + ((n + 7) / 8) * 8 + 8;
  }
  float* score = scratch<float, 22>(offset[units]);
  auto qrow = [&](int64_t u) { return q + (rows[u / nh] * H + h0 + u % nh) * hd; };
  // 1. scores: the shared prefix in tiles, then each row's own tail
  float* qf = scratch<float, 23>(units * hd);
  for (int64_t u = 0; u < units; u++) std::memcpy(qf + u * hd, qrow(u), sizeof(float) * hd);
  auto qvec = [&](int64_t u, __m256* qv) {
    for (int l = 0; l < lanes; l++) qv[l] = _mm256_loadu_ps(qf + u * hd + 8 * l);
  };
  if constexpr (q8_keys) {
    constexpr int nb = static_cast<int>(hd / kBlock);
    const int64_t W = key_width(hd);
    ActBlock* qa = scratch<ActBlock, 24>(units * nb);
    uint8_t* qu = scratch<uint8_t, 25>(units * hd);  // each query's q + 128, unsigned (the VNNI build's form)
    float** sc = scratch<float*, 26>(units);
    for (int64_t u = 0; u < units; u++) {
      quantize_row(qf + u * hd, hd, qa + u * nb);
#if defined(__AVX512VNNI__)
      for (int64_t j = 0; j < hd; j++) qu[u * hd + j] = static_cast<uint8_t>(qa[u * nb + j / kBlock].q[j % kBlock]) ^ 0x80;
#endif
      sc[u] = score + offset[u];
    }
    // each unit's run of visible slots 0, 1, 2, ...: the shared prefix and, for a prompt chunk's rows, the
    // chunk's rows up to its own; scored kGroup keys at a time for every unit whose run reaches them
    int64_t* run = scratch<int64_t, 27>(units);
    int64_t longest = 0;
    for (int64_t u = 0; u < units; u++) {
      const auto& vis = visible[rows[u / nh]];
      int64_t c = P;
      while (c < static_cast<int64_t>(vis.size()) && vis[c] == c) c++;
      run[u] = c;
      longest = std::max(longest, c);
    }
    for (int64_t i0 = 0; i0 < longest; i0 += kGroup) {
      for (int64_t o = 0; o < kGroup * W; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(keys + (i0 + 2 * kGroup) * W) + o, _MM_HINT_T0);
      for (int64_t o = 0; o < kGroup * hd * static_cast<int64_t>(sizeof(T)); o += 64)  // its values, into L2
        _mm_prefetch(reinterpret_cast<const char*>(values + i0 * hd) + o, _MM_HINT_T1);
      if (hd == 64 && units <= kRowsPathUnits) {
#if defined(__AVX512VNNI__)
        group_scores_q8_rows(keys + i0 * W, W, std::min<int64_t>(kGroup, longest - i0), qa, qu, units, sc, run, i0);
#else
        group_scores_q8_rows(keys + i0 * W, W, std::min<int64_t>(kGroup, longest - i0), qa, units, sc, run, i0);
#endif
        continue;
      }
      group_scores_q8<nb>(keys + i0 * W, W, std::min<int64_t>(kGroup, longest - i0), qa, qu, units, sc, run, i0);
    }
    for (int64_t u = 0; u < units; u++) {  // the rest of each row's keys: its tree ancestors, itself
      const auto& vis = visible[rows[u / nh]];
      for (int64_t i = run[u]; i < static_cast<int64_t>(vis.size()); i++)
        sc[u][i] = key_dot_q8(qa + u * nb, keys + vis[i] * W, hd);
    }
  } else {
  const int64_t P4 = P / 4 * 4;
  for (int64_t t0 = 0; t0 < P4; t0 += kKeyTile) {
    const int64_t t1 = std::min(P4, t0 + kKeyTile);
    // the next tile's keys into L1 and this tile's values into L2 while this one is scored: the K/V rows
    // come from memory, and the hardware prefetchers stop at every page end
    for (int64_t o = 0; o < kKeyTile * hd * static_cast<int64_t>(sizeof(T)); o += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(keys + (t0 + kKeyTile) * hd) + o, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(values + t0 * hd) + o, _MM_HINT_T1);
    }
    for (int64_t u = 0; u < units; u++) {
      float* sc = score + offset[u];
      __m256 qv[lanes];
      qvec(u, qv);
      int64_t i = t0;
      for (; i + 8 <= t1; i += 8) {  // two groups of four, interleaved: eight independent FMA chains
        const T* k = keys + i * hd;
        __m128 lo, hi;
        key_dots8<lanes>(qv, k, hd, &lo, &hi);
        _mm_storeu_ps(sc + i, lo);
        _mm_storeu_ps(sc + i + 4, hi);
      }
      for (; i < t1; i += 4) {
        const T* k = keys + i * hd;
        _mm_storeu_ps(sc + i, key_dots4<lanes>(qv, k, k + hd, k + 2 * hd, k + 3 * hd));
      }
    }
  }
  for (int64_t u = 0; u < units; u++) {
    const auto& vis = visible[rows[u / nh]];
    const int64_t n = static_cast<int64_t>(vis.size());
    float* sc = score + offset[u];
    __m256 qv[lanes];
    qvec(u, qv);
    int64_t i = P4;
    for (; i + 4 <= n; i += 4)
      _mm_storeu_ps(sc + i, key_dots4<lanes>(qv, keys + vis[i] * hd, keys + vis[i + 1] * hd, keys + vis[i + 2] * hd,
                                             keys + vis[i + 3] * hd));
    for (; i < n; i++) sc[i] = key_dot<lanes>(qv, keys + vis[i] * hd);
  }
  }
  // 2. each (row, head): scale, max, exp 8 at a time, the sum
  float* inv = scratch<float, 29>(units);
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t u = 0; u < units; u++) {
    const int64_t n = static_cast<int64_t>(visible[rows[u / nh]].size());
    float* sc = score + offset[u];
    for (int64_t i = n; i < ((n + 7) / 8) * 8; i++) sc[i] = ninf;
    const __m256 scalev = _mm256_set1_ps(scale), ninfv = _mm256_set1_ps(ninf);
    __m256 topv8 = ninfv;
    for (int64_t i = 0; i < n; i += 8) {  // scaled (padding stays -inf), and their max (exact in any order)
      const __m256 sv = _mm256_mul_ps(_mm256_loadu_ps(sc + i), scalev);
      _mm256_storeu_ps(sc + i, sv);
      topv8 = _mm256_max_ps(topv8, sv);
    }
    __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(topv8), _mm256_extractf128_ps(topv8, 1));
    t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
    t4 = _mm_max_ss(t4, _mm_shuffle_ps(t4, t4, 0x1));
    const __m256 topv = _mm256_set1_ps(_mm_cvtss_f32(t4));
    __m256 sumv = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
      const __m256 sv = _mm256_loadu_ps(sc + i);
      const __m256 ev = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(sv, topv)), _mm256_cmp_ps(sv, ninfv, _CMP_NEQ_OQ));
      _mm256_storeu_ps(sc + i, ev);
      sumv = _mm256_add_ps(sumv, ev);
    }
    inv[u] = 1.0f / hsum8(sumv);
  }
  // 3. the weighted values: the shared prefix in tiles (each accumulator carried across them), then the tails
  float* acc = scratch<float, 28>(units * hd);
  std::fill(acc, acc + units * hd, 0.0f);
  // au [hd] += sc[i] * the value row row(i), for i in [i0, i1) in order; 16 lanes an instruction where the CPU has
  // them (each lane's FMA chain the 8-lane code's: the same bits)
  auto weigh = [&](float* au, const float* sc, int64_t i0, int64_t i1, auto row) {
#if defined(__AVX512F__)
    if constexpr (lanes % 2 == 0) {
      __m512 a[lanes / 2];
      for (int l = 0; l < lanes / 2; l++) a[l] = _mm512_loadu_ps(au + 16 * l);
      for (int64_t i = i0; i < i1; i++) {
        const T* vr = row(i);
        const __m512 pw = _mm512_set1_ps(sc[i]);
        for (int l = 0; l < lanes / 2; l++) a[l] = _mm512_fmadd_ps(pw, load16(vr + 16 * l), a[l]);
      }
      for (int l = 0; l < lanes / 2; l++) _mm512_storeu_ps(au + 16 * l, a[l]);
      return;
    }
#endif
    __m256 a[lanes];
    for (int l = 0; l < lanes; l++) a[l] = _mm256_loadu_ps(au + 8 * l);
    for (int64_t i = i0; i < i1; i++) {
      const T* vr = row(i);
      const __m256 pw = _mm256_set1_ps(sc[i]);
      for (int l = 0; l < lanes; l++) a[l] = _mm256_fmadd_ps(pw, load8(vr + 8 * l), a[l]);
    }
    for (int l = 0; l < lanes; l++) _mm256_storeu_ps(au + 8 * l, a[l]);
  };
  for (int64_t t0 = 0; t0 < P; t0 += kKeyTile)
    for (int64_t u = 0; u < units; u++)
      weigh(acc + u * hd, score + offset[u], t0, std::min(P, t0 + kKeyTile), [&](int64_t i) { return values + i * hd; });
  for (int64_t u = 0; u < units; u++) {
    const auto& vis = visible[rows[u / nh]];
    const int64_t n = static_cast<int64_t>(vis.size());
    weigh(acc + u * hd, score + offset[u], P, n, [&](int64_t i) { return values + vis[i] * hd; });
    const __m256 invv = _mm256_set1_ps(inv[u]);
    float* o = out + (rows[u / nh] * H + h0 + u % nh) * hd;
    if (n == 0) {
      std::fill(o, o + hd, 0.0f);
      continue;
    }
    for (int l = 0; l < lanes; l++) _mm256_storeu_ps(o + 8 * l, _mm256_mul_ps(_mm256_loadu_ps(acc + u * hd + 8 * l), invv));
  }
}

template <typename TK, typename T>
void attend_request(const std::vector<int64_t>& rows, const std::vector<std::vector<int32_t>>& visible, int64_t P,
                    const float* q, int64_t H, int64_t h0, int64_t h1, int64_t hd, const TK* keys, const T* values,
                    float scale, float* out) {
  switch (hd) {
    case 64: return attend_request_t<8, TK, T>(rows, visible, P, q, H, h0, h1, keys, values, scale, out);
    case 128: return attend_request_t<16, TK, T>(rows, visible, P, q, H, h0, h1, keys, values, scale, out);
    case 32: return attend_request_t<4, TK, T>(rows, visible, P, q, H, h0, h1, keys, values, scale, out);
    case 96: return attend_request_t<12, TK, T>(rows, visible, P, q, H, h0, h1, keys, values, scale, out);
    default: TORCH_CHECK(false, "head_dim: ", hd, " is not 32, 64, 96 or 128 (the fused attention's)");
  }
}

}  // namespace eyas_quant

// Every decoder layer of a plain Llama (RMSNorm, fused q/k/v, rotary, attention, o, SiLU-gated MLP) over N packed
// rows, in one call: per layer, the rows' q/k/v, their K/V written into the store at (kv_rows[n], slots[n]), each
// row's attention over the slots of its K/V row its mask shows (in slot order: the committed prefix, then its
// tree ancestors or earlier prompt rows, then itself), and the output projection and MLP.
//   x [N, d] (the embeddings), cos/sin [N, hd]; per layer (lists of L): the two norms' weights and the four
//   repacked weights, their qtypes (qkv, o, gate/up, down for each layer, 4 L); kv_k/kv_v [L, R, Hkv, S, hd];
//   kv_rows, slots [N] int64; mask [N, key_len] bool; taps: the layer counts after which x is kept.
// -> {x after the last layer [N, d], the kept x's [len(taps), N, d]}
std::vector<torch::Tensor> forward_layers(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                          std::vector<torch::Tensor> attn_norm, std::vector<torch::Tensor> mlp_norm,
                                          std::vector<torch::Tensor> wqkv, std::vector<torch::Tensor> wo,
                                          std::vector<torch::Tensor> w_gate_up, std::vector<torch::Tensor> w_down,
                                          std::vector<int64_t> qtypes, double eps, int64_t heads, int64_t kv_heads,
                                          int64_t head_dim, int64_t ffn, torch::Tensor kv_k, torch::Tensor kv_v,
                                          torch::Tensor kv_rows, torch::Tensor slots, torch::Tensor mask,
                                          std::vector<int64_t> taps) {
  x = as_rows(x, "x");
  const int64_t N = x.size(0), d = x.size(1), hd = head_dim, L = static_cast<int64_t>(wqkv.size());
  TORCH_CHECK(L > 0 && attn_norm.size() == wqkv.size() && mlp_norm.size() == wqkv.size() && wo.size() == wqkv.size() &&
                  w_gate_up.size() == wqkv.size() && w_down.size() == wqkv.size() &&
                  static_cast<int64_t>(qtypes.size()) == 4 * L,
              "layers: one of each weight and norm per layer, and 4 qtypes a layer");
  TORCH_CHECK((hd == 32 || hd == 64 || hd == 96 || hd == 128) && kv_heads > 0 && heads % kv_heads == 0,
              "head_dim: 32, 64, 96 or 128, and heads a multiple of kv_heads");
  for (int64_t l = 0; l < L; l++) {
    check_packed(wqkv[l], qtypes[4 * l], d, (heads + 2 * kv_heads) * hd, "wqkv");
    check_packed(wo[l], qtypes[4 * l + 1], heads * hd, d, "wo");
    check_packed(w_gate_up[l], qtypes[4 * l + 2], d, 2 * ffn, "w_gate_up");
    check_packed(w_down[l], qtypes[4 * l + 3], ffn, d, "w_down");
    TORCH_CHECK(attn_norm[l].numel() == d && mlp_norm[l].numel() == d && attn_norm[l].scalar_type() == torch::kFloat &&
                    mlp_norm[l].scalar_type() == torch::kFloat && attn_norm[l].is_contiguous() &&
                    mlp_norm[l].is_contiguous(),
                "norms: expected [d] float32, contiguous");
  }
  const bool q8k = kv_k.scalar_type() == torch::kByte;  // keys in Q8 blocks (key_width(hd) bytes), values fp16
  const bool half = kv_v.scalar_type() == torch::kHalf;
  TORCH_CHECK(kv_v.dim() == 5 && (half || kv_v.scalar_type() == torch::kFloat) && kv_v.is_contiguous() &&
                  kv_v.size(0) == L && kv_v.size(2) == kv_heads && kv_v.size(4) == hd && kv_k.dim() == 5 &&
                  kv_k.is_contiguous() && kv_k.sizes().slice(0, 4) == kv_v.sizes().slice(0, 4) &&
                  (q8k ? half && kv_k.size(4) == key_width(hd) : kv_k.scalar_type() == kv_v.scalar_type() &&
                                                                    kv_k.size(4) == hd),
              "kv_k, kv_v: expected the store's [L, R, Hkv, S, hd] float32 or float16 (both alike), or keys in Q8 "
              "blocks [L, R, Hkv, S, hd + hd / 8] uint8 with float16 values, contiguous");
  const int64_t R = kv_k.size(1), S = kv_k.size(3);
  cos = as_rows(cos, "cos");
  sin = as_rows(sin, "sin");
  TORCH_CHECK(cos.size(0) == N && cos.size(1) == hd && sin.sizes() == cos.sizes(), "cos, sin: expected [N, hd]");
  kv_rows = kv_rows.contiguous();
  slots = slots.contiguous();
  mask = mask.contiguous();
  TORCH_CHECK(kv_rows.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong && kv_rows.numel() == N &&
                  slots.numel() == N,
              "kv_rows, slots: expected [N] int64");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.dim() == 2 && mask.size(0) == N && mask.size(1) <= S,
              "mask: expected [N, key_len] bool, key_len within the store's slots");
  const int64_t* rp = kv_rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  const int64_t key_len = mask.size(1);
  std::vector<std::vector<int32_t>> visible(N);
  for (int64_t n = 0; n < N; n++) {
    TORCH_CHECK(rp[n] >= 0 && rp[n] < R && sp[n] >= 0 && sp[n] < S, "kv_rows, slots: row ", n, " is outside the store");
    for (int64_t s = 0; s < key_len; s++)
      if (mp[n * key_len + s]) visible[n].push_back(static_cast<int32_t>(s));
  }
  for (auto t : taps) TORCH_CHECK(t >= 1 && t <= L, "taps: layer counts in [1, ", L, "], got ", t);
  // the requests (packed rows by K/V row), each one's shared visible prefix 0..P-1, and the attention's tasks
  std::vector<std::vector<int64_t>> requests;
  std::vector<int64_t> request_row, prefix;
  for (int64_t n = 0; n < N; n++) {
    auto it = std::find(request_row.begin(), request_row.end(), rp[n]);
    if (it == request_row.end()) {
      request_row.push_back(rp[n]);
      requests.emplace_back();
      it = request_row.end() - 1;
    }
    requests[it - request_row.begin()].push_back(n);
  }
  for (const auto& rows : requests) {
    int64_t P = std::numeric_limits<int64_t>::max();
    for (int64_t n : rows) {
      int64_t p = 0;
      while (p < static_cast<int64_t>(visible[n].size()) && visible[n][p] == p) p++;
      P = std::min(P, p);
    }
    prefix.push_back(P);
  }
  struct AttnTask {
    int64_t request, kv_row, h0, h1;
    std::vector<int64_t> rows;  // some of the request's rows
  };
  std::vector<AttnTask> tasks;
  const int64_t group_heads = heads / kv_heads;
  // a K/V head's query heads together (each key read once for all of them); when there are too few such tasks to
  // keep every thread busy, a request's rows are split into parts (every part still reads the shared prefix once)
  const int64_t nreq = static_cast<int64_t>(requests.size()), want = 2 * at::get_num_threads();
  for (int64_t r = 0; r < nreq; r++) {
    const int64_t nr = static_cast<int64_t>(requests[r].size());
    const int64_t parts = std::min(nr, std::max<int64_t>(1, (want + nreq * kv_heads - 1) / (nreq * kv_heads)));
    for (int64_t j = 0; j < kv_heads; j++)
      for (int64_t p = 0; p < parts; p++) {  // every parts-th row: a prompt chunk's causal rows, short and long
        std::vector<int64_t> part;             // alike in each part, so that the parts weigh the same
        for (int64_t i = p; i < nr; i += parts) part.push_back(requests[r][i]);
        tasks.push_back({r, request_row[r], j * group_heads, (j + 1) * group_heads, std::move(part)});
      }
  }
  auto h = x.clone();
  auto tapped = torch::empty({static_cast<int64_t>(taps.size()), N, d}, x.options());
  if (N == 0) return {h, tapped};
  const int64_t qkv_n = (heads + 2 * kv_heads) * hd, ha = heads * hd;
  const int64_t nbd = d / kBlock, nba = ha / kBlock, nbf = ffn / kBlock, hb = hd / kBlock;
  TORCH_CHECK(d % kBlock == 0 && ffn % kBlock == 0, "d, ffn: multiples of ", kBlock);
  // every buffer of the forward, the calling thread's own (shared by the region's threads)
  float* q = scratch<float, 6>(N * heads * hd);
  float* qkv = scratch<float, 7>(N * qkv_n);
  float* kr = scratch<float, 8>(N * kv_heads * hd);
  float* att = scratch<float, 9>(N * ha);
  float* x1 = scratch<float, 10>(N * d);
  float* gu = scratch<float, 11>(N * 2 * ffn);
  ActBlock* act_d = scratch<ActBlock, 12>(N * nbd);  // the normed rows (attention's, then the MLP's input)
  ActBlock* act_a = scratch<ActBlock, 13>(N * nba);  // the attention output
  ActBlock* act_f = scratch<ActBlock, 14>(N * nbf);  // silu(gate) * up
  const int64_t group = group_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const int64_t kw = q8k ? key_width(hd) : hd;  // a stored key's elements
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  // One parallel region for every layer: each step's work split over the threads in fixed shares (every
  // element computed as it is alone: row-invariant), a barrier between steps; no fork and join per step, and
  // a row's glue (norms, quantizing, rotary, SiLU) goes over the threads whatever the number of rows.
  auto norm_quantize = [&](const float* xs, const float* w, int t, int nt) {  // RMSNorm then Q8, block by block
    const int64_t u0 = N * nbd * t / nt, u1 = N * nbd * (t + 1) / nt;
    alignas(32) float tmp[kBlock];
    int64_t row = -1;
    float inv = 0.0f;
    for (int64_t u = u0; u < u1; u++) {
      const int64_t m = u / nbd, b = u % nbd;
      const float* xr = xs + m * d;
      if (m != row) inv = rms_inv(xr, d, eps), row = m;
      for (int64_t k = 0; k < kBlock; k++) tmp[k] = w[b * kBlock + k] * (xr[b * kBlock + k] * inv);
      quantize_row(tmp, kBlock, act_d + u);
    }
  };
  auto groups_of = [&](int64_t Nout, int t, int nt) {
    const int64_t g = output_groups(Nout);
    return std::pair<int64_t, int64_t>(g * t / nt, g * (t + 1) / nt);
  };
  auto run_layers = [&](auto* kp, auto* vp, int t, int nt) {
    constexpr bool q8 = std::is_same_v<std::remove_cv_t<std::remove_pointer_t<decltype(kp)>>, uint8_t>;
    for (int64_t l = 0; l < L; l++) {
      norm_quantize(hp, attn_norm[l].data_ptr<float>(), t, nt);
#pragma omp barrier
      {
        auto [g0, g1] = groups_of(qkv_n, t, nt);
        matmul_groups(act_d, N, d, wqkv[l], qtypes[4 * l], qkv_n, qkv, nullptr, g0, g1);
      }
#pragma omp barrier
      {  // rotary on q and k (HF's rotate-half: x * cos + rotate_half(x) * sin); K/V into the store
        const int64_t per = heads + kv_heads, u0 = N * per * t / nt, u1 = N * per * (t + 1) / nt;
        for (int64_t u = u0; u < u1; u++) {
          const int64_t m = u / per, i = u % per;
          const float* row = qkv + m * qkv_n;
          const float* cm = cp + m * hd;
          const float* sm = snp + m * hd;
          const float* in = row + i * hd;
          float* o = i < heads ? q + (m * heads + i) * hd : kr + (m * kv_heads + (i - heads)) * hd;
          rotate_half_row(in, cm, sm, hd, o);
          if (i >= heads) {
            const int64_t j = i - heads, at = ((l * R + rp[m]) * kv_heads + j) * S + sp[m];
            if constexpr (q8)
              store_key_q8(o, kp + at * kw, hd);
            else
              store_row(o, kp + at * kw, hd);
            store_row(row + (heads + kv_heads + j) * hd, vp + at * hd, hd);
          }
        }
      }
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t a = 0; a < ntasks; a++) {  // one request's rows, the query heads [h0, h1) of one K/V head
        const AttnTask& task = tasks[a];
        const int64_t base = ((l * R + task.kv_row) * kv_heads + task.h0 / group) * S;
        attend_request(task.rows, visible, prefix[task.request], q, heads, task.h0, task.h1, hd, kp + base * kw,
                       vp + base * hd, scale, att);
        for (int64_t n : task.rows)  // its own heads' blocks of the output, quantized (hd is whole blocks)
          for (int64_t hh = task.h0; hh < task.h1; hh++)
            quantize_row(att + (n * heads + hh) * hd, hd, act_a + n * nba + hh * hb);
      }  // (the loop's barrier)
      {
        auto [g0, g1] = groups_of(d, t, nt);
        matmul_groups(act_a, N, ha, wo[l], qtypes[4 * l + 1], d, x1, hp, g0, g1);  // x1 = x + wo(a)
      }
#pragma omp barrier
      norm_quantize(x1, mlp_norm[l].data_ptr<float>(), t, nt);
#pragma omp barrier
      {
        auto [g0, g1] = groups_of(2 * ffn, t, nt);
        matmul_groups(act_d, N, d, w_gate_up[l], qtypes[4 * l + 2], 2 * ffn, gu, nullptr, g0, g1);
      }
#pragma omp barrier
      {  // silu(gate) * up, then Q8, block by block
        const int64_t u0 = N * nbf * t / nt, u1 = N * nbf * (t + 1) / nt;
        alignas(32) float tmp[kBlock];
        for (int64_t u = u0; u < u1; u++) {
          const int64_t m = u / nbf, b = u % nbf;
          const float* g = gu + m * 2 * ffn + b * kBlock;
          silu_mul_row(g, g + ffn, kBlock, tmp);
          quantize_row(tmp, kBlock, act_f + u);
        }
      }
#pragma omp barrier
      {
        auto [g0, g1] = groups_of(d, t, nt);
        matmul_groups(act_f, N, ffn, w_down[l], qtypes[4 * l + 3], d, hp, x1, g0, g1);  // x = x1 + down(...)
      }
#pragma omp barrier
      for (size_t k = 0; k < taps.size(); k++)
        if (taps[k] == l + 1) {
          const int64_t r0 = N * t / nt, r1 = N * (t + 1) / nt;
          std::memcpy(tapped.data_ptr<float>() + (k * N + r0) * d, hp + r0 * d, sizeof(float) * (r1 - r0) * d);
        }
    }
  };
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    if (q8k)
      run_layers(kv_k.data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(kv_v.data_ptr<at::Half>()), t, nt);
    else if (half)
      run_layers(reinterpret_cast<uint16_t*>(kv_k.data_ptr<at::Half>()),
                 reinterpret_cast<uint16_t*>(kv_v.data_ptr<at::Half>()), t, nt);
    else
      run_layers(kv_k.data_ptr<float>(), kv_v.data_ptr<float>(), t, nt);
  }
  return {h, tapped};
}

// w [N, K] float32 -> GGUF blocks of `qtype` (llama.cpp's reference quantizers), for checkpoints that hold no
// quantized blocks of their own and for the tests
torch::Tensor quantize_weight(torch::Tensor w, int64_t qtype) {
  w = as_rows(w, "w");
  const int64_t N = w.size(0), K = w.size(1), nb = K / kBlock, bs = block_bytes(qtype);
  TORCH_CHECK(bs > 0, "qtype: ", qtype, " is not Q4_0 (2), Q4_1 (3) or Q8_0 (8)");
  TORCH_CHECK(K % kBlock == 0, "w: ", K, " inputs, not a multiple of ", kBlock);
  auto out = torch::zeros({N, nb * bs}, torch::TensorOptions().dtype(torch::kByte));
  const float* wp = w.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  auto put_f16 = [](uint8_t* p, float f) {
    const uint16_t h = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(p, &h, 2);
  };
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < nb; b++) {
      const float* x = wp + n * K + b * kBlock;
      uint8_t* blk = op + (n * nb + b) * bs;
      if (qtype == kQ8_0) {
        float amax = 0.0f;
        for (int j = 0; j < kBlock; j++) amax = std::max(amax, std::fabs(x[j]));
        const float d = amax / 127.0f, id = d ? 1.0f / d : 0.0f;
        put_f16(blk, d);
        for (int j = 0; j < kBlock; j++) blk[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(std::roundf(x[j] * id)));
      } else if (qtype == kQ4_1) {
        float lo = x[0], hi = x[0];
        for (int j = 1; j < kBlock; j++) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
        const float d = (hi - lo) / 15.0f, id = d ? 1.0f / d : 0.0f;
        put_f16(blk, d);
        put_f16(blk + 2, lo);
        for (int j = 0; j < kBlock / 2; j++) {
          const int a = std::min(15, static_cast<int>((x[j] - lo) * id + 0.5f));
          const int c = std::min(15, static_cast<int>((x[j + 16] - lo) * id + 0.5f));
          blk[4 + j] = static_cast<uint8_t>(a | (c << 4));
        }
      } else {  // Q4_0
        float amax = 0.0f, mx = 0.0f;
        for (int j = 0; j < kBlock; j++)
          if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), mx = x[j];
        const float d = mx / -8.0f, id = d ? 1.0f / d : 0.0f;
        put_f16(blk, d);
        for (int j = 0; j < kBlock / 2; j++) {
          const int a = std::min(15, static_cast<int>(x[j] * id + 8.5f));
          const int c = std::min(15, static_cast<int>(x[j + 16] * id + 8.5f));
          blk[2 + j] = static_cast<uint8_t>(a | (c << 4));
        }
      }
    }
  return out;
}

// GGUF blocks [N, K/32 * block bytes] -> [N, K] float32 (what transformers' GGUF loader gives)
torch::Tensor dequantize_weight(torch::Tensor w, int64_t qtype, int64_t K) {
  check_raw(w, qtype, K, "w");
  const int64_t N = w.size(0), nb = K / kBlock, bs = block_bytes(qtype);
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t* blk = wp + (n * nb + b) * bs;
      float* o = op + n * K + b * kBlock;
      const float d = f16(blk);
      if (qtype == kQ8_0) {
        for (int j = 0; j < kBlock; j++) o[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
      } else if (qtype == kQ4_1) {
        const float m = f16(blk + 2);
        for (int j = 0; j < kBlock / 2; j++) {
          o[j] = d * static_cast<float>(blk[4 + j] & 0x0F) + m;
          o[j + 16] = d * static_cast<float>(blk[4 + j] >> 4) + m;
        }
      } else {
        for (int j = 0; j < kBlock / 2; j++) {
          o[j] = d * static_cast<float>((blk[2 + j] & 0x0F) - 8);
          o[j + 16] = d * static_cast<float>((blk[2 + j] >> 4) - 8);
        }
      }
    }
  return out;
}

// --- probes for bench/roofline.py: what this machine can do, measured rather than assumed ---------------

// Reads every byte of `buf` (streamed from memory when it is larger than the caches), split over the
// threads as the kernels split their weights. -> a checksum, so that nothing is optimized away.
int64_t probe_read(torch::Tensor buf) {
  TORCH_CHECK(buf.is_contiguous() && buf.numel() * buf.element_size() % 32 == 0, "buf: contiguous, 32-byte multiple");
  const auto* p = reinterpret_cast<const __m256i*>(buf.data_ptr());
  const int64_t n = buf.numel() * buf.element_size() / 32;
  std::vector<int64_t> sums(at::get_num_threads() * 8, 0);
  at::parallel_for(0, n, 4096, [&](int64_t a, int64_t b) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    int64_t i = a;
    for (; i + 2 <= b; i += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 128), _MM_HINT_T0);  // 4 KB ahead, as the kernels read
      acc0 = _mm256_xor_si256(acc0, _mm256_load_si256(p + i));
      acc1 = _mm256_xor_si256(acc1, _mm256_load_si256(p + i + 1));
    }
    for (; i < b; i++) acc0 = _mm256_xor_si256(acc0, _mm256_load_si256(p + i));
    acc0 = _mm256_xor_si256(acc0, acc1);
    sums[at::get_thread_num() * 8] ^= _mm256_extract_epi64(acc0, 0) ^ _mm256_extract_epi64(acc0, 3);
  });
  int64_t out = 0;
  for (auto v : sums) out ^= v;
  return out;
}

// `iters` rounds of 8 independent 8-lane fp32 FMAs per thread (16 flops each): the FMA rate
double probe_fma(int64_t iters) {
  std::vector<float> sink(at::get_num_threads() * 16, 0.0f);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) {
      __m256 acc[8];
      for (int i = 0; i < 8; i++) acc[i] = _mm256_set1_ps(0.001f * (i + 1));
      const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(0.0001f);
      for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
      __m256 s = acc[0];
      for (int i = 1; i < 8; i++) s = _mm256_add_ps(s, acc[i]);
      sink[at::get_thread_num() * 16] += hsum8(s);
    }
  });
  double out = 0;
  for (auto v : sink) out += v;
  return out;
}

// `iters` rounds of 8 independent integer dot products a thread, each 32 (AVX2) or 64 (AVX-512) u8 x s8
// products: the rate of the gguf kernels' arithmetic (returns a checksum)
int64_t probe_dot(int64_t iters) {
  std::vector<int64_t> sink(at::get_num_threads() * 8, 0);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; t++) {
      VecI acc[8];
      for (int i = 0; i < 8; i++) acc[i] = vzero_i();
      const VecI u = vset1_8(3), s = vset1_8(-2);
      for (int64_t it = 0; it < iters; it++)
        for (int i = 0; i < 8; i++) acc[i] = vdot(acc[i], u, s);
      int32_t out[sizeof(VecI) / 4];
      for (int i = 0; i < 8; i++) {  // every accumulator read, so that none is optimized away
        std::memcpy(out, &acc[i], sizeof(VecI));
        sink[at::get_thread_num() * 8] += out[0];
      }
    }
  });
  int64_t out = 0;
  for (auto v : sink) out += v;
  return out;
}

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> mask,
                     double scale);  // cpu.cpp

// A reference-layout EAGLE-3 drafter's step over one request's rows in one call, with no interpreter between
// its kernels: the rows' states (rows [N, d]; or their target features [N, taps * d] through fc when the
// weights carry one), x = [RMSNorm(E(token)); RMSNorm(state)], q/k/v with rotary at the rows' positions, their
// K/V written at slots [start, start + N) of the request's store row (keys, values [Hkv, S, hd] float32) and
// the attention over the slots the mask shows (mask [N, start + N] bool; None: one row that sees every slot up
// to its own), then o + state, the MLP, and for the last topk_rows rows the final RMSNorm, the draft head and
// the top k mapped to target ids through d2t. The same kernels the step's Python path calls one by one
// (linear_q, attn_in, attend, attn_out_mlp, head_topk), so the same arithmetic but the two input norms.
// w: {fc (empty: rows are states), embed_norm, state_norm, wqkv, wo, mlp_norm, w_gate_up, w_down, norm, head,
// d2t [V] int64, embed [vocab, d], cos, sin [positions, hd]}; qtypes: {fc, wqkv, wo, gate_up, down, head};
// dims: {heads, kv_heads, head_dim, ffn, draft vocab, k, topk_rows}.
// -> {hidden [N, d], ids [topk_rows, k] target ids, conf [topk_rows, k] float32}
std::vector<torch::Tensor> draft_step(torch::Tensor rows, torch::Tensor tokens, torch::Tensor positions,
                                      torch::Tensor keys, torch::Tensor values, int64_t start,
                                      c10::optional<torch::Tensor> mask, std::vector<torch::Tensor> w,
                                      std::vector<int64_t> qtypes, std::vector<int64_t> dims, double eps) {
  TORCH_CHECK(w.size() == 14 && qtypes.size() == 6 && dims.size() == 7, "draft_step: 14 weights, 6 qtypes, 7 dims");
  const int64_t H = dims[0], Hkv = dims[1], hd = dims[2], ffn = dims[3], V = dims[4], k = dims[5], R = dims[6];
  rows = as_rows(rows, "rows");
  const int64_t N = rows.size(0);
  TORCH_CHECK(N >= 1 && tokens.dim() == 1 && tokens.size(0) == N && positions.sizes() == tokens.sizes() &&
                  tokens.scalar_type() == torch::kLong && positions.scalar_type() == torch::kLong,
              "tokens, positions: expected [N] int64 each");
  TORCH_CHECK(R >= 0 && R <= N, "topk_rows: ", R, " is not in [0, ", N, "]");
  TORCH_CHECK(keys.dim() == 3 && keys.size(0) == Hkv && keys.size(2) == hd && values.sizes() == keys.sizes() &&
                  keys.scalar_type() == torch::kFloat && values.scalar_type() == torch::kFloat &&
                  start >= 0 && start + N <= keys.size(1),
              "keys, values: expected the request's store row [Hkv, S, hd] float32 with room for the rows");
  const torch::Tensor& fc = w[0];
  torch::Tensor state = fc.numel() ? linear_q(rows, fc, qtypes[0], w[2].numel()) : rows;
  const int64_t d = state.size(1), qkv_in = 2 * d, ha = H * hd;
  const torch::Tensor &embed = w[11], &cos_table = w[12], &sin_table = w[13], &d2t = w[10];
  TORCH_CHECK(embed.dim() == 2 && embed.size(1) == d && w[1].numel() == d && w[2].numel() == d &&
                  w[1].scalar_type() == torch::kFloat && w[2].scalar_type() == torch::kFloat &&
                  w[1].is_contiguous() && w[2].is_contiguous(),
              "embed, norms: expected [vocab, d] and [d] float32");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) == hd && cos_table.scalar_type() == torch::kFloat &&
                  cos_table.is_contiguous() && sin_table.sizes() == cos_table.sizes() &&
                  sin_table.scalar_type() == torch::kFloat && sin_table.is_contiguous(),
              "cos, sin: expected [positions, head_dim] float32");
  TORCH_CHECK(d2t.dim() == 1 && d2t.scalar_type() == torch::kLong && d2t.is_contiguous() && d2t.size(0) == V,
              "d2t: expected [draft vocab] int64");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "keys, values: expected stride 1 along head_dim");
  check_packed(w[3], qtypes[1], qkv_in, (H + 2 * Hkv) * hd, "wqkv");
  check_packed(w[4], qtypes[2], ha, d, "wo");
  check_packed(w[6], qtypes[3], d, 2 * ffn, "w_gate_up");
  check_packed(w[7], qtypes[4], ffn, d, "w_down");
  TORCH_CHECK(w[5].numel() == d && w[5].scalar_type() == torch::kFloat && w[5].is_contiguous(),
              "mlp_norm: expected [d] float32");
  const auto tok = tokens.contiguous(), pos = positions.contiguous();
  const int64_t* tp = tok.data_ptr<int64_t>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; n++) {
    TORCH_CHECK(tp[n] >= 0 && tp[n] < embed.size(0), "tokens: ", tp[n], " is outside the embedding's ", embed.size(0));
    TORCH_CHECK(pp[n] >= 0 && pp[n] < cos_table.size(0), "positions: ", pp[n], " is outside the rotary table's ",
                cos_table.size(0));
  }
  // Every buffer of the step is this thread's (eyas_quant::scratch), written before it is read; the kernels'
  // own functions over raw rows, so the arithmetic is attn_in's, attend's and attn_out_mlp's, without the
  // tensors, gathers and copies between them (a step is a few rows: ATen's per-op cost was the step's glue).
  // x = [RMSNorm(E(token)); RMSNorm(state)], a row at a time (rms_norm_rows computes each row alone)
  float* x = scratch<float, 40>(N * qkv_in);
  {
    torch::Tensor gathered;
    const float* ep = nullptr;
    if (embed.scalar_type() == torch::kFloat && embed.is_contiguous()) {
      ep = embed.data_ptr<float>();
    } else {  // an embedding kept in another dtype: its rows as float32 first
      gathered = embed.index_select(0, tok).to(torch::kFloat).contiguous();
    }
    const float* sp = state.data_ptr<float>();
    for (int64_t n = 0; n < N; n++) {
      const float* e = ep != nullptr ? ep + tp[n] * d : gathered.data_ptr<float>() + n * d;
      rms_norm_rows(e, 1, d, w[1].data_ptr<float>(), eps, x + n * qkv_in);
      rms_norm_rows(sp + n * d, 1, d, w[2].data_ptr<float>(), eps, x + n * qkv_in + d);
    }
  }
  float* cs = scratch<float, 41>(N * hd);
  float* sn = scratch<float, 42>(N * hd);
  for (int64_t n = 0; n < N; n++) {
    std::memcpy(cs + n * hd, cos_table.data_ptr<float>() + pp[n] * hd, sizeof(float) * hd);
    std::memcpy(sn + n * hd, sin_table.data_ptr<float>() + pp[n] * hd, sizeof(float) * hd);
  }
  float* q = scratch<float, 43>(N * ha);
  float* kn = scratch<float, 44>(N * Hkv * hd);
  float* vn = scratch<float, 45>(N * Hkv * hd);
  layer_qkv(x, N, qkv_in, nullptr, eps, w[3], qtypes[1], cs, sn, H, Hkv, hd, q, kn, vn);
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  const int64_t ks0 = keys.stride(0), ks1 = keys.stride(1), vs0 = values.stride(0), vs1 = values.stride(1);
  for (int64_t n = 0; n < N; n++)  // the rows' K/V into the request's store row at slots start + n
    for (int64_t j = 0; j < Hkv; j++) {
      std::memcpy(kp + j * ks0 + (start + n) * ks1, kn + (n * Hkv + j) * hd, sizeof(float) * hd);
      std::memcpy(vp + j * vs0 + (start + n) * vs1, vn + (n * Hkv + j) * hd, sizeof(float) * hd);
    }
  torch::Tensor m;
  const bool* mp = nullptr;
  const int64_t S = start + N;  // the slots a row may see
  if (mask.has_value()) {
    TORCH_CHECK(mask->dim() == 2 && mask->size(0) == N && mask->size(1) == S && mask->scalar_type() == torch::kBool,
                "mask: expected [N, start + N] bool");
    m = mask->contiguous();
    mp = m.data_ptr<bool>();
  } else {
    TORCH_CHECK(N == 1, "mask: required for more than one row");
  }
  // each (row, head) over the slots its mask shows, in slot order (attend's arithmetic), into a [N, H * hd]
  float* a = scratch<float, 46>(N * ha);
  const int64_t group = H / Hkv;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  at::parallel_for(0, H * N, 1, [&](int64_t r0, int64_t r1) {
    float* score = scratch<float, 47>(S + 8);
    int32_t* visible = scratch<int32_t, 48>(S);
    for (int64_t r = r0; r < r1; r++) {
      const int64_t h = r / N, t = r % N, hk = h / group;
      attend_masked(q + (t * H + h) * hd, kp + hk * ks0, ks1, vp + hk * vs0, vs1, mp == nullptr ? nullptr : mp + t * S,
                    S, hd, scale, visible, score, a + (t * H + h) * hd);
    }
  });
  auto hidden = torch::empty({N, d}, state.options());
  layer_out_mlp(state.data_ptr<float>(), a, N, d, ha, w[4], qtypes[2], w[5].data_ptr<float>(), eps, w[6], qtypes[3],
                w[7], qtypes[4], ffn, hidden.data_ptr<float>());
  auto top = head_topk(hidden.narrow(0, N - R, R), w[8], eps, w[9], qtypes[5], V, k);
  int64_t* ids = top[0].data_ptr<int64_t>();  // draft ids -> target ids, in place
  const int64_t* map = d2t.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * k; i++) ids[i] = map[ids[i]];
  return {hidden, top[0], top[1]};
}

// A reference EAGLE-3 drafter's whole EAGLE-2 dynamic tree for one request in one call (design terms in
// eyas/drafting/tree.py): the seed's context rows through draft_step (fc of the target features; the last row's
// top k), then step by step the top `width` nodes of the newest layer by the ranking key (-log path value,
// depth, build order), each at the expansion floor, as provisional rows at slots [base, base + written) that
// see the context and their tree ancestors, each proposing its top k (k = width); at most `max_depth` layers.
// The selection is the global top `budget` nodes by the same key, those at the value floor, in that order
// (parents first). The same bookkeeping as DynamicTreeBuilder over the same draft_step calls as the Python
// loop (_grow_fused), so the same tree: log path values in double, log(max(c, 1e-12)) of each float32
// confidence. rows [A, taps * d] (the seed's target features), tokens [A], keys, values, w, qtypes as
// draft_step's; the seed's rows at slots and positions [start, start + A), each seeing the slots up to its own;
// dims: {heads, kv_heads, head_dim, ffn, draft vocab}; tree: {width, max_depth, budget};
// floors: {log min_value, log expand_min_value} (-inf: none).
// -> {tokens [n] int64, parents [n] int64 (-1: the seed), depths [n] int64, confidences [n] float32,
//     written [1] int64: the provisional rows written}
std::vector<torch::Tensor> draft_tree(torch::Tensor rows, torch::Tensor tokens, torch::Tensor keys,
                                      torch::Tensor values, int64_t start, std::vector<torch::Tensor> w,
                                      std::vector<int64_t> qtypes, std::vector<int64_t> dims,
                                      std::vector<int64_t> tree, std::vector<double> floors, double eps) {
  TORCH_CHECK(dims.size() == 5 && tree.size() == 3 && floors.size() == 2, "draft_tree: 5 dims, 3 tree numbers, 2 floors");
  const int64_t W = tree[0], D = tree[1], B = tree[2];
  TORCH_CHECK(W >= 1 && D >= 0 && B >= 0, "tree: width >= 1, depth and budget >= 0");
  // the seed's rows sit at slots and positions start, start + 1, ... each seeing the slots up to its own
  const int64_t A = rows.size(0), base = start + A, last_position = base - 1;
  TORCH_CHECK(A >= 1, "rows: at least one seed row");
  auto positions = torch::arange(start, base, torch::TensorOptions().dtype(torch::kLong));
  c10::optional<torch::Tensor> mask;
  if (A > 1) {
    auto causal = torch::zeros({A, base}, torch::TensorOptions().dtype(torch::kBool));
    bool* cp = causal.data_ptr<bool>();
    for (int64_t i = 0; i < A; i++) std::fill(cp + i * base, cp + i * base + start + i + 1, true);
    mask = causal;
  }
  const double min_log = floors[0], expand_min_log = floors[1];
  constexpr int64_t kRoot = -1;
  const bool grows = B > 0 && D > 0;
  auto step_dims = [&](int64_t k, int64_t topk_rows) {
    return std::vector<int64_t>{dims[0], dims[1], dims[2], dims[3], dims[4], k, topk_rows};
  };
  auto ctx = draft_step(rows, tokens, positions, keys, values, start, mask, w, qtypes, step_dims(grows ? W : 1, grows ? 1 : 0), eps);
  auto tree_of = [&](int64_t n, int64_t written) {  // {tokens, parents, depths, confidences [n], written [1]}
    auto i64 = torch::TensorOptions().dtype(torch::kLong);
    return std::vector<torch::Tensor>{torch::empty({n}, i64), torch::empty({n}, i64), torch::empty({n}, i64),
                                      torch::empty({n}, torch::TensorOptions().dtype(torch::kFloat)),
                                      torch::full({1}, written, i64)};
  };
  if (!grows) return tree_of(0, 0);
  std::vector<torch::Tensor> state_w = w;
  state_w[0] = torch::empty({0}, w[1].options());  // tree rows are states: no fc
  struct Node {
    int64_t parent, token, depth;
    float conf;
    double logv;
    int64_t state_step, state_row, slot;
  };
  std::vector<Node> nodes;
  std::vector<torch::Tensor> hidden{ctx[0]};  // each step's output rows [P, d]: its nodes' children's states
  auto key_less = [&](int64_t a, int64_t b) {  // the ranking key (-log value, depth, node id)
    const Node &x = nodes[a], &y = nodes[b];
    if (x.logv != y.logv) return x.logv > y.logv;
    if (x.depth != y.depth) return x.depth < y.depth;
    return a < b;
  };
  std::vector<int64_t> parents{kRoot};
  std::vector<std::pair<int64_t, int64_t>> parent_rows{{0, ctx[0].size(0) - 1}};  // (step, row) of each parent's output
  torch::Tensor ids = ctx[1], conf = ctx[2];
  int64_t written = 0, steps = 0;
  while (true) {
    const int64_t k = ids.size(1);
    auto idp = ids.accessor<int64_t, 2>();
    auto cfp = conf.accessor<float, 2>();
    std::vector<int64_t> frontier;
    for (size_t i = 0; i < parents.size(); i++) {
      const int64_t p = parents[i];
      const double plog = p == kRoot ? 0.0 : nodes[p].logv;
      const int64_t pdepth = p == kRoot ? 0 : nodes[p].depth;
      for (int64_t c = 0; c < k; c++) {
        const float cf = cfp[i][c];
        nodes.push_back(Node{p, idp[i][c], pdepth + 1, cf, plog + std::log(std::max(static_cast<double>(cf), 1e-12)),
                             parent_rows[i].first, parent_rows[i].second, -1});
        frontier.push_back(static_cast<int64_t>(nodes.size()) - 1);
      }
    }
    steps++;
    if (steps >= D) break;
    std::sort(frontier.begin(), frontier.end(), key_less);
    std::vector<int64_t> next;
    for (int64_t i = 0; i < std::min<int64_t>(W, frontier.size()); i++)
      if (nodes[frontier[i]].logv >= expand_min_log) next.push_back(frontier[i]);
    if (next.empty()) break;
    const int64_t P = next.size(), first = base + written;
    for (int64_t i = 0; i < P; i++) nodes[next[i]].slot = first + i;
    auto m = torch::zeros({P, first + P}, torch::TensorOptions().dtype(torch::kBool));
    auto tok = torch::empty({P}, torch::TensorOptions().dtype(torch::kLong));
    auto pos = torch::empty({P}, torch::TensorOptions().dtype(torch::kLong));
    auto st = torch::empty({P, ctx[0].size(1)}, ctx[0].options());
    bool* mp = m.data_ptr<bool>();
    for (int64_t i = 0; i < P; i++) {
      bool* row = mp + i * (first + P);
      std::fill(row, row + base, true);
      for (int64_t walk = next[i]; walk != kRoot; walk = nodes[walk].parent) row[nodes[walk].slot] = true;
      const Node& n = nodes[next[i]];
      tok.data_ptr<int64_t>()[i] = n.token;
      pos.data_ptr<int64_t>()[i] = last_position + n.depth;
      std::memcpy(st.data_ptr<float>() + i * st.size(1), hidden[n.state_step].data_ptr<float>() + n.state_row * st.size(1),
                  sizeof(float) * st.size(1));
    }
    auto out = draft_step(st, tok, pos, keys, values, first, m, state_w, qtypes, step_dims(W, P), eps);
    hidden.push_back(out[0]);
    written += P;
    parents = next;
    parent_rows.clear();
    for (int64_t i = 0; i < P; i++) parent_rows.emplace_back(static_cast<int64_t>(hidden.size()) - 1, i);
    ids = out[1];
    conf = out[2];
  }
  std::vector<int64_t> ranked(nodes.size());
  for (size_t i = 0; i < ranked.size(); i++) ranked[i] = static_cast<int64_t>(i);
  std::sort(ranked.begin(), ranked.end(), key_less);
  std::vector<int64_t> selected;
  for (int64_t i = 0; i < std::min<int64_t>(B, ranked.size()); i++)
    if (nodes[ranked[i]].logv >= min_log) selected.push_back(ranked[i]);
  const int64_t n = selected.size();
  auto out = tree_of(n, written);
  std::vector<int64_t> at(nodes.size(), kRoot);
  for (int64_t i = 0; i < n; i++) {
    const Node& x = nodes[selected[i]];
    at[selected[i]] = i;
    TORCH_CHECK(x.parent == kRoot || (at[x.parent] != kRoot && at[x.parent] < i), "draft_tree: selection not ancestor-closed");
    out[0].data_ptr<int64_t>()[i] = x.token;
    out[1].data_ptr<int64_t>()[i] = x.parent == kRoot ? kRoot : at[x.parent];
    out[2].data_ptr<int64_t>()[i] = x.depth;
    out[3].data_ptr<float>()[i] = x.conf;
  }
  return out;
}

void register_quant(pybind11::module& m) {
  m.def("probe_dot", &probe_dot, "iters x 8 integer dot-product instructions a thread (int8 MAC-rate probe)");
  m.def("dot_macs", []() { return static_cast<int64_t>(sizeof(VecI)); }, "u8 x s8 products one probe_dot instruction does");
  m.def("probe_read", &probe_read, "read every byte of a buffer over the threads (bandwidth probe)");
  m.def("probe_fma", &probe_fma, "iters x 8 x 8-lane FMAs a thread (FMA-rate probe)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row [M, K] float32 in one fixed order, row-invariant");
  m.def("argmax_rows", &argmax_rows, "each row's first maximal index, NaN first (torch.argmax's choice)");
  m.def("linear_q_argmax", &linear_q_argmax, "linear_q and each row's first maximal index (torch.argmax's choice)");
  m.def("linear_q", &linear_q, "x [M, K] float32 @ repacked GGUF-block weights^T -> [M, N], Q8 activations, row-invariant");
  m.def("repack", &repack, "GGUF blocks [N, K/32 * block bytes] -> the kernels' output-interleaved groups");
  m.def("group_size", []() { return kGroup; }, "outputs a repacked group interleaves (one SIMD lane each)");
  m.def("head_topk", &head_topk, "RMSNorm, a vocabulary head (GGUF blocks) and each row's top k with softmax probabilities");
  m.def("attn_in", &attn_in, "RMSNorm, fused q/k/v (GGUF blocks) and rotary: q [M, H, hd], k, v [M, Hkv, hd]");
  m.def("attn_out_mlp", &attn_out_mlp, "x + wo(a), then + down(silu(gate) * up) of its RMSNorm (GGUF blocks)");
  m.def("draft_tree", &draft_tree, "a reference EAGLE-3 drafter's whole EAGLE-2 dynamic tree for one request");
  m.def("draft_step", &draft_step, "a reference EAGLE-3 drafter's step over one request's rows, top k included");
  m.def("forward_layers", &forward_layers, "every plain Llama decoder layer over packed rows, K/V written, in one call");
  m.def("quantize_weight", &quantize_weight, "float32 [N, K] -> GGUF blocks (Q4_0, Q4_1, Q8_0)");
  m.def("dequantize_weight", &dequantize_weight, "GGUF blocks -> float32 [N, K]");
  m.def("isa", []() {
#if defined(__AVX512VNNI__)
    return std::string("avx512-vnni");
#else
    return std::string("avx2");
#endif
  });
}
