// DynamicQuant (graphs/ops/linear_w8a8.py) as one C++ kernel: per-token symmetric int8 of Linear.w8a8's input.
//
// Per row: scale = max(max |x|, 1e-8) / 127, codes = round_half_even(x / scale) + 128 as uint8, exactly the op's
// ONNX body (a true division, not a reciprocal product, so every code equals the body's). Two passes over the
// row, which a linear's input keeps in L1/L2; as standard ops the same work is eight nodes, each a pass over
// memory of its own. With AVX-512 a row goes 16 floats at a time; elsewhere the compiler's own loop.
#include <cmath>
#include <cstdint>
#include <string>

#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PG_QUANT_AVX512 1
#endif

namespace {

constexpr float kRowMaxFloor = 1e-8f;  // graphs/ops/linear_w8a8.py ROW_MAX_FLOOR

inline uint8_t code(float x, float scale) { return static_cast<uint8_t>(std::nearbyint(x / scale) + 128.f); }

#ifdef PG_QUANT_AVX512
float row_max(const float *x, int64_t k) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) acc = _mm512_max_ps(acc, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
  if (j < k) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (k - j)) - 1);
    acc = _mm512_max_ps(acc, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, x + j)));
  }
  return _mm512_reduce_max_ps(acc);
}

void row_codes(const float *x, uint8_t *codes, int64_t k, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  const __m512i shift = _mm512_set1_epi32(128);
  int64_t j = 0;
  for (; j + 16 <= k; j += 16) {
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + j), s),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i *>(codes + j), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, shift)));
  }
  for (; j < k; ++j) codes[j] = code(x[j], scale);
}
#else
float row_max(const float *x, int64_t k) {
  float m = 0.f;
  for (int64_t j = 0; j < k; ++j) m = std::fmax(m, std::fabs(x[j]));
  return m;
}

void row_codes(const float *x, uint8_t *codes, int64_t k, float scale) {
  for (int64_t j = 0; j < k; ++j) codes[j] = code(x[j], scale);
}
#endif

}  // namespace

extern "C" {

int pg_dynamic_quant(const float *x, uint8_t *codes, float *row_scale, int64_t tokens, int64_t k,
                     const pg_runner *runner) {
  if (k <= 0) return pg::fail("dynamic_quant: K " + std::to_string(k) + " must be positive");
  pg::for_rows(runner, tokens, k, [&](int64_t t) {
    const float *row = x + t * k;
    const float scale = std::fmax(row_max(row, k), kRowMaxFloor) / 127.f;
    row_scale[t] = scale;
    row_codes(row, codes + t * k, k, scale);
  });
  return 0;
}

}  // extern "C"
