// SIMD helpers shared by Eyas's CPU kernels (cpu.cpp, quant.cpp): each computes in one fixed order, so
// that a kernel built on them stays row-invariant.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

inline float hsum8(__m256 v) {  // one fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 0x1));
  return _mm_cvtss_f32(s);
}

// exp for x <= 0 (scores minus their max): Cephes' range reduction and polynomial, 8 lanes
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  x = _mm256_max_ps(x, lo);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 c1 = _mm256_set1_ps(0.693359375f), c2 = _mm256_set1_ps(-2.12194440e-4f);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, c1));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, c2));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// One query row q [D] over the n visible slots of a K/V row (keys + visible[i] * key_stride, likewise values),
// in slot order: scores, their max, exp 8 at a time (padding lanes 0), the weighted values, then one
// multiply by 1 / sum. score: scratch of at least n + 8 floats. D a multiple of 8, at most 128.
inline void attend_visible(const float* q, const float* keys, int64_t key_stride, const float* values,
                           int64_t value_stride, const int32_t* visible, int64_t n, int64_t D, float scale, float* score,
                           float* out) {
  const int64_t lanes = D / 8;
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; i++) {  // scores, in slot order
    const float* kr = keys + visible[i] * key_stride;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t l = 0; l < lanes; l++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * l), _mm256_loadu_ps(kr + 8 * l), acc);
    score[i] = hsum8(acc) * scale;
    top = std::max(top, score[i]);
  }
  for (int64_t i = n; i < ((n + 7) / 8) * 8; i++) score[i] = -std::numeric_limits<float>::infinity();
  const __m256 topv = _mm256_set1_ps(top), ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sumv = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {  // unnormalised probabilities, 8 at a time; padding lanes 0
    const __m256 sv = _mm256_loadu_ps(&score[i]);
    const __m256 ev = _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(sv, topv)), _mm256_cmp_ps(sv, ninf, _CMP_NEQ_OQ));
    _mm256_storeu_ps(&score[i], ev);
    sumv = _mm256_add_ps(sumv, ev);
  }
  const float inv = 1.0f / hsum8(sumv);
  __m256 acc[16];  // D <= 128
  for (int64_t l = 0; l < lanes; l++) acc[l] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i++) {  // the weighted values, in slot order
    const float* vr = values + visible[i] * value_stride;
    const __m256 pw = _mm256_set1_ps(score[i]);
    for (int64_t l = 0; l < lanes; l++) acc[l] = _mm256_fmadd_ps(pw, _mm256_loadu_ps(vr + 8 * l), acc[l]);
  }
  const __m256 invv = _mm256_set1_ps(inv);
  for (int64_t l = 0; l < lanes; l++) _mm256_storeu_ps(out + 8 * l, _mm256_mul_ps(acc[l], invv));
}

// One query row over the slots [0, S) its mask row shows (mask: nullptr = every slot), in slot order
// (attend_visible); a row that sees no slot gets zeros. visible: scratch of S ints; score: of S + 8 floats.
inline void attend_masked(const float* q, const float* keys, int64_t key_stride, const float* values,
                          int64_t value_stride, const bool* mask, int64_t S, int64_t D, float scale, int32_t* visible,
                          float* score, float* out) {
  int64_t n = 0;
  for (int64_t s = 0; s < S; s++)
    if (mask == nullptr || mask[s]) visible[n++] = static_cast<int32_t>(s);
  if (n == 0) {
    std::fill(out, out + D, 0.0f);
    return;
  }
  attend_visible(q, keys, key_stride, values, value_stride, visible, n, D, scale, score, out);
}

}  // namespace
