// What every kernel source shares: errors, the thread setting, the parallel loop, 8-float vectors.
#pragma once
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "kernels.h"

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace pg {

// Records `message` for pg_last_error() (and stderr); returns the non-zero status to pass on.
int fail(const std::string &message);

// OpenMP threads for kernels called without a runner (pg_set_threads).
int threads();

// body(item) for every item in [0, items): on the host's pool when one is given, else OpenMP.
template <class Body>
void parallel_for(const pg_runner *runner, int64_t items, const Body &body) {
  if (items <= 0) return;
  if (runner != nullptr) {
    auto call = [](void *ctx, size_t item) { (*static_cast<const Body *>(ctx))(static_cast<int64_t>(item)); };
    runner->parallel_for(runner->pool, call, const_cast<Body *>(&body), static_cast<size_t>(items));
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads()) if (items > 1)
  for (int64_t item = 0; item < items; ++item) body(item);
}

// row(r) for r in [0, rows) of `width` elements each: on the calling thread when the whole is small
// (a decode step's few rows: waking the pool would cost more than the rows), else parallel_for.
template <class Row>
void for_rows(const pg_runner *runner, int64_t rows, int64_t width, const Row &row) {
  constexpr int64_t kInline = 1 << 16;  // elements
  if (rows * width < kInline) {
    for (int64_t r = 0; r < rows; ++r) row(r);
  } else {
    parallel_for(runner, rows, row);
  }
}

// Eight floats as one value (GCC/Clang vector extension: AVX on x86, two NEON registers on ARM).
typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline f32x8 load8(const float *p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store8(float *p, f32x8 v) { std::memcpy(p, &v, sizeof v); }

// KV-cache elements other than float32 (kernels.h's pg_cache_dtype): bfloat16 as its bits, IEEE
// half as the compiler's _Float16, int8 as the quantized value. Each converts to float exactly.
struct bf16 {
  uint16_t bits;
};
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef _Float16 f16x8 __attribute__((vector_size(16)));

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(_Float16 x) { return static_cast<float>(x); }
inline float to_float(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16); }

// On x86 the widening loads are the AVX2/F16C instructions themselves: GCC 12 turns the generic
// conversions of int8 and half vectors into a scalar convert per element.
#if defined(__AVX2__) && defined(__F16C__)
inline __m128i load_bytes16(const void *p) { return _mm_loadu_si128(static_cast<const __m128i *>(p)); }
inline __m128i load_bytes8(const void *p) { return _mm_loadl_epi64(static_cast<const __m128i *>(p)); }

inline f32x8 load8(const int8_t *p) { return (f32x8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p))); }

inline f32x8 load8(const _Float16 *p) { return (f32x8)_mm256_cvtph_ps(load_bytes16(p)); }

inline f32x8 load8(const bf16 *p) { return (f32x8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_bytes16(p)), 16); }
#else
inline f32x8 load8(const int8_t *p) {
  i8x8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, f32x8);
}

inline f32x8 load8(const _Float16 *p) {
  f16x8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_convertvector(v, f32x8);
}

inline f32x8 load8(const bf16 *p) {
  u16x8 v;
  std::memcpy(&v, p, sizeof v);
  return __builtin_bit_cast(f32x8, __builtin_convertvector(v, i32x8) << 16);
}
#endif

// float -> a 16-bit cache element, rounding to nearest even (as ONNX Cast and ml_dtypes do).
inline void from_float(float x, float &out) { out = x; }
inline void from_float(float x, _Float16 &out) { out = static_cast<_Float16>(x); }
inline void from_float(float x, bf16 &out) {
  const uint32_t u = __builtin_bit_cast(uint32_t, x);
  out.bits = (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>((u >> 16) | 0x40u)  // NaN stays NaN
                                              : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// exp(x), vectorized (libm's expf is not), for x clamped to [-87, 88]: x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its degree-7 Taylor polynomial (relative error < 1e-8 before rounding), 2^n from the exponent bits.
inline f32x8 exp8(f32x8 x) {
  x = x < -87.f ? f32x8{} - 87.f : x;
  x = x > 88.f ? f32x8{} + 88.f : x;
  const f32x8 n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 drops the fraction
  const f32x8 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  f32x8 p = f32x8{} + 1.f / 5040;
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = p * r + c;
  const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  return p * __builtin_bit_cast(f32x8, bits);
}

}  // namespace pg
