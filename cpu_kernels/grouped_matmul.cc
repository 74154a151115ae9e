// GroupedMatmul (graphs/ops/grouped_matmul.py) in its three forms, float32, bfloat16 and block-quantized: each
// expert's consecutive rows of x [M, K] times that expert's weight [N, K] of the stack, so a decode step reads the
// k chosen experts' weights once and nothing else. ONNX Runtime has no grouped MatMulNBits (its QMoE measured
// slower than float32 at B = 1, docs/performance.md), and a library GEMM per group (oneDNN's sgemm, tried first)
// computes a row differently as a group's row count changes, which made a token's output depend on its batch.
//
// Here every output element is computed by the same sequence of operations whatever else runs (how many rows its
// expert received, which rows share a tile, how columns are shared out): one vector accumulator per row and
// column over K, its lanes summed in one fixed order (docs/performance.md, "Batch invariance"). Block-quantized:
//   y[r, n] = sum over blocks b of scale[n, b] * sum_j x[r, j] * (code[n, j] - zero_point[n, b])
//             + minimum[n, b] * sum_j x[r, j]                                    (j over block b's inputs)
// the codes minus their zero point exact integers, converted to float32 (the op's accuracy_level 0). bfloat16:
// x rounded to bfloat16 as it is read, the weights widened exactly.
//
// Work items are (expert group, chunk of kChunk columns); an item walks its group's rows in tiles of up to kRows,
// reading each weight vector once for the tile. Nothing is allocated per call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kMaxGroups = 1024;  // experts per layer (DeepSeek-V3 routes over 256)
constexpr int64_t kMaxBlocks = 2048;  // blocks per input row (K / block_size)
constexpr int64_t kChunk = 64;        // output columns per work item
constexpr int kRows = 4;              // rows per tile

// One vector of kWidth floats: 16 (a zmm register) with AVX-512, else 8. Loads, the widening of bfloat16 weights
// and 4/8-bit codes, as the target's own instructions (GCC turns generic conversions of narrow integers into a
// scalar convert per element).
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kWidth = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
using Zero = __m512i;
inline Zero zero_vector(int z) { return _mm512_set1_epi32(z); }
inline vf loadv(const float *p) { return (vf)_mm512_loadu_ps(p); }
inline vf bf16v(const uint16_t *p) {
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p))), 16);
}
inline vf ints(__m128i bytes, Zero zero) { return (vf)_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), zero)); }
#elif defined(__AVX2__)
constexpr int64_t kWidth = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
using Zero = __m256i;
inline Zero zero_vector(int z) { return _mm256_set1_epi32(z); }
inline vf loadv(const float *p) { return (vf)_mm256_loadu_ps(p); }
inline vf bf16v(const uint16_t *p) {
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p))), 16);
}
inline vf ints(__m128i bytes, Zero zero) { return (vf)_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), zero)); }
#else
constexpr int64_t kWidth = 8;
typedef float vf __attribute__((vector_size(32)));
typedef int32_t vi __attribute__((vector_size(32)));
using Zero = int;
inline Zero zero_vector(int z) { return z; }
inline vf loadv(const float *p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf bf16v(const uint16_t *p) {
  vf v;
  for (int j = 0; j < kWidth; ++j) v[j] = pg::to_float(pg::bf16{p[j]});
  return v;
}
#endif

// kWidth codes minus the zero point, as floats: 8-bit codes a byte each, 4-bit ones two a byte (low nibble first).
template <int Bits>
inline vf codesv(const uint8_t *p, Zero zero) {
#if defined(__AVX2__)
  __m128i bytes;
  if constexpr (Bits == 8) {
    bytes = kWidth == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i *>(p))
                         : _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
  } else {
    __m128i b;
    if constexpr (kWidth == 16) {
      b = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
    } else {
      int32_t packed;
      std::memcpy(&packed, p, sizeof packed);
      b = _mm_cvtsi32_si128(packed);
    }
    const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    bytes = _mm_unpacklo_epi8(low, high);
  }
  return ints(bytes, zero);
#else
  vf v;
  for (int j = 0; j < kWidth; ++j)
    v[j] = static_cast<float>((Bits == 8 ? p[j] : (p[j / 2] >> (4 * (j & 1))) & 0x0F) - zero);
  return v;
#endif
}

// The lanes of v summed in one fixed order (halves added until one lane is left).
inline float sumv(vf v) {
  float lanes[kWidth];
  std::memcpy(lanes, &v, sizeof lanes);
  for (int64_t half = kWidth / 2; half > 0; half /= 2)
    for (int64_t i = 0; i < half; ++i) lanes[i] += lanes[i + half];
  return lanes[0];
}

// Inputs rounded to bfloat16 (to nearest even, as ml_dtypes) for a bfloat16 expert; float32 ones as they are.
inline vf round_bf16(vf v) {
  const vi u = __builtin_bit_cast(vi, v);
  return __builtin_bit_cast(vf, (u + 0x7fff + ((u >> 16) & 1)) & ~0xffff);
}
inline vf weightv(const float *p) { return loadv(p); }
inline vf weightv(const uint16_t *p) { return bf16v(p); }
inline vf inputv(const float *p, const float *) { return loadv(p); }
inline vf inputv(const float *p, const uint16_t *) { return round_bf16(loadv(p)); }

// Columns per step: a one-row tile (decode) takes four (eight accumulator chains), wider tiles two (at most sixteen
// accumulators, within the 32 vector registers of AVX-512).
template <int Rows>
constexpr int kCols = Rows == 1 ? 4 : 2;

// Rows [0, Rows) of a tile times columns [col, col + Cols) of a float32 or bfloat16 expert [N, K]. Each element has
// two accumulators (the even and the odd vectors of its row: independent chains keep the FMA units busy when a
// tile is one row), summed at the end; the same operations for every element whatever Rows and Cols are.
template <class W, int Rows, int Cols>
void dense_columns(const float *x, const W *w, int64_t k, int64_t n, int64_t col, float *y) {
  vf even[Rows][Cols] = {}, odd[Rows][Cols] = {};
  auto step = [&](int64_t j, vf (&into)[Rows][Cols]) {
    vf wv[Cols];
    for (int c = 0; c < Cols; ++c) wv[c] = weightv(w + (col + c) * k + j);
    for (int r = 0; r < Rows; ++r) {
      const vf xv = inputv(x + r * k + j, w);
      for (int c = 0; c < Cols; ++c) into[r][c] += xv * wv[c];
    }
  };
  int64_t j = 0;
  for (; j + 2 * kWidth <= k; j += 2 * kWidth) {
    step(j, even);
    step(j + kWidth, odd);
  }
  if (j < k) step(j, even);
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) y[r * n + col + c] = sumv(even[r][c] + odd[r][c]);
}

template <class W, int Rows>
void dense_tile(const float *x, const W *w, int64_t k, int64_t n, int64_t c0, int64_t c1, float *y) {
  int64_t col = c0;
  for (; col + kCols<Rows> <= c1; col += kCols<Rows>) dense_columns<W, Rows, kCols<Rows>>(x, w, k, n, col, y);
  for (; col < c1; ++col) dense_columns<W, Rows, 1>(x, w, k, n, col, y);
}

// One expert's block-quantized parts in the op's layout (MatMulNBits' with a leading expert axis).
struct Quantized {
  const uint8_t *codes;        // [N, blocks, block_size * bits / 8]
  const float *scales;         // [N, blocks]
  const uint8_t *zero_points;  // [N, Z]: one byte each (8 bits) or two a byte, the even block low (4 bits)
  const void *minimum_t;       // [blocks, N], float16 or float32
  int64_t k, n, block_size, blocks, zero_width;
  bool minimum_f16;

  int zero_point(int64_t col, int64_t b, int bits) const {
    const uint8_t byte = zero_points[col * zero_width + (bits == 8 ? b : b / 2)];
    return bits == 8 ? byte : (b & 1 ? byte >> 4 : byte & 0x0F);
  }

  float minimum(int64_t col, int64_t b) const {
    const int64_t at = b * n + col;
    return minimum_f16 ? pg::to_float(static_cast<const _Float16 *>(minimum_t)[at])
                       : static_cast<const float *>(minimum_t)[at];
  }
};

// The minimum's term of rows [0, Rows) and columns [c0, c1): sum over blocks b of minimum[b, col] * the row's
// inputs summed over b, block by block across the columns (minimum_t holds a block's columns side by side).
template <int Rows, class Sums>
void minimum_terms(const Quantized &e, const Sums &sums, int64_t c0, int64_t c1, float (&out)[Rows][kChunk]) {
  for (int r = 0; r < Rows; ++r) std::fill(out[r], out[r] + (c1 - c0), 0.f);
  const int64_t vectors = (c1 - c0) / pg::kLanes * pg::kLanes;
  for (int64_t b = 0; b < e.blocks; ++b) {
    const int64_t at = b * e.n + c0;
    for (int64_t c = 0; c < vectors; c += pg::kLanes) {  // eight minima widened at once (F16C for float16)
      const pg::f32x8 low = e.minimum_f16 ? pg::load8(static_cast<const _Float16 *>(e.minimum_t) + at + c)
                                          : pg::load8(static_cast<const float *>(e.minimum_t) + at + c);
      for (int r = 0; r < Rows; ++r) pg::store8(out[r] + c, pg::load8(out[r] + c) + low * sums(r, b));
    }
    for (int64_t c = vectors; c < c1 - c0; ++c)
      for (int r = 0; r < Rows; ++r) out[r][c] += e.minimum(c0 + c, b) * sums(r, b);
  }
}

// Rows [0, Rows) of a tile (their block sums in `sums`) times columns [col, col + Cols) of a block-quantized expert.
// Within a block each element has two accumulators (even and odd vectors), their sum times the block's scale added
// into the element's running vector; the same operations for every element whatever Rows and Cols are.
template <int Bits, int Rows, int Cols>
void quantized_columns(const float *x, const Quantized &e, const float (*minimum)[kChunk], int64_t c0, int64_t col,
                       float *y) {
  constexpr int64_t kBytes = kWidth * Bits / 8;  // bytes of one vector's codes
  const int64_t block_bytes = e.block_size * Bits / 8;
  vf acc[Rows][Cols] = {};
  for (int64_t b = 0; b < e.blocks; ++b) {
    Zero zero[Cols];
    const uint8_t *codes[Cols];
    for (int c = 0; c < Cols; ++c) {
      zero[c] = zero_vector(e.zero_point(col + c, b, Bits));
      codes[c] = e.codes + ((col + c) * e.blocks + b) * block_bytes;
    }
    vf even[Rows][Cols] = {}, odd[Rows][Cols] = {};
    const float *xb = x + b * e.block_size;
    auto step = [&](int64_t j, vf (&into)[Rows][Cols]) {
      vf wv[Cols];
      for (int c = 0; c < Cols; ++c) wv[c] = codesv<Bits>(codes[c] + j / kWidth * kBytes, zero[c]);
      for (int r = 0; r < Rows; ++r) {
        const vf xv = loadv(xb + r * e.k + j);
        for (int c = 0; c < Cols; ++c) into[r][c] += xv * wv[c];
      }
    };
    int64_t j = 0;
    for (; j + 2 * kWidth <= e.block_size; j += 2 * kWidth) {
      step(j, even);
      step(j + kWidth, odd);
    }
    if (j < e.block_size) step(j, even);
    for (int c = 0; c < Cols; ++c) {
      const float scale = e.scales[(col + c) * e.blocks + b];
      for (int r = 0; r < Rows; ++r) acc[r][c] += (even[r][c] + odd[r][c]) * scale;
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) y[r * e.n + col + c] = sumv(acc[r][c]) + minimum[r][col + c - c0];
}

template <int Bits, int Rows>
void quantized_tile(const float *x, const Quantized &e, int64_t c0, int64_t c1, float *y) {
  float sums[Rows][kMaxBlocks];  // each row's inputs summed per block (the minimum's term)
  for (int r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < e.blocks; ++b) {
      vf acc{};
      for (int64_t j = 0; j < e.block_size; j += kWidth) acc += loadv(x + r * e.k + b * e.block_size + j);
      sums[r][b] = sumv(acc);
    }
  float minimum[Rows][kChunk];
  minimum_terms<Rows>(e, [&](int r, int64_t b) { return sums[r][b]; }, c0, c1, minimum);
  int64_t col = c0;
  for (; col + kCols<Rows> <= c1; col += kCols<Rows>)
    quantized_columns<Bits, Rows, kCols<Rows>>(x, e, minimum, c0, col, y);
  for (; col < c1; ++col) quantized_columns<Bits, Rows, 1>(x, e, minimum, c0, col, y);
}

// accuracy_level 4 (MatMulNBits' int8 compute): each row's inputs quantized to int8 per chunk of 32 (scale
// max |x| / 127), each chunk's products with the codes summed exactly in int32 by VNNI (u8 codes x s8 inputs), then
//   y[r, n] = sum over chunks q of (scale[n, b(q)] * xscale[q]) * dot_q
//             - sum over blocks b of (scale[n, b] * zero_point[n, b]) * zero_term[b] + minimum[n, b] * sum_j x[r, j]
// with b(q) the block of chunk q and zero_term[b] the sum over b's chunks of xscale[q] * xsum_q (the chunk's int8
// inputs summed). The codes of one column are contiguous over K, so two chunks fill a 512-bit vpdpbusd (lanes 0-7
// chunk q, 8-15 chunk q + 1, whatever blocks they belong to), converted and scaled once per pair; the zero point's
// term is taken 16 blocks at a time. 4-bit codes are used as the bytes hold them (the chunk's low nibbles, then its
// high ones): each chunk of the row's int8 inputs is stored in that order instead. Blocks of a multiple of 32
// inputs; other forms, and CPUs without AVX-512 VNNI, compute in float32 (quantized_tile).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr bool kInt8Dot = true;
#else
constexpr bool kInt8Dot = false;
#endif
constexpr int64_t kChunkK = 32;      // inputs per int8 chunk
constexpr int64_t kScaleLanes = 8;   // each chunk's scale repeated over the int32 lanes of its products
constexpr int64_t kBlockGroup = 16;  // blocks whose zero point terms are taken at once (one zmm of floats)

// Every row of x as int8 chunks, quantized once per call before the tiles read them: codes in the weight's byte
// order, each chunk's scale (repeated over its lanes), and per weight block the terms of the zero point and of the
// minimum.
struct Int8Inputs {
  int64_t k, chunks, blocks;
  int8_t *q;          // [M, K]
  float *scale;       // [M, chunks, kScaleLanes]
  float *zero_term;   // [M, blocks]: sum over the block's chunks of scale * the chunk's int8 sum
  float *sums;        // [M, blocks]: the float inputs summed (the minimum's term)

  // Rows' storage in one buffer kept by the calling thread and grown to the largest call (reused, never freed).
  static Int8Inputs of(int64_t m, int64_t k, int64_t blocks) {
    thread_local std::vector<float> buffer;
    const int64_t chunks = k / kChunkK, floats = m * (k / 4 + chunks * kScaleLanes + 2 * blocks);
    if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
    float *at = buffer.data();
    Int8Inputs in{k, chunks, blocks, reinterpret_cast<int8_t *>(at), nullptr, nullptr, nullptr};
    at += m * k / 4;
    in.scale = at;
    in.zero_term = at + m * chunks * kScaleLanes;
    in.sums = in.zero_term + m * blocks;
    return in;
  }

  // Row r of x: 4-bit codes (byte i holds inputs 2i, low nibble, and 2i + 1) get each chunk's even inputs, then its
  // odd ones, the order the kernel unpacks the codes in.
  void quantize(const float *row, int64_t r, int bits, int64_t block_size) {
    const int64_t per_block = block_size / kChunkK;
    for (int64_t b = 0; b < blocks; ++b) {
      float zero = 0.f, total = 0.f;
      for (int64_t c = b * per_block; c < (b + 1) * per_block; ++c) {
        const float *chunk = row + c * kChunkK;
        float peak = 0.f, sum = 0.f;
        for (int64_t j = 0; j < kChunkK; ++j) {
          peak = std::max(peak, std::abs(chunk[j]));
          sum += chunk[j];
        }
        const float step = peak > 0.f ? peak / 127.f : 1.f;
        int32_t qsum = 0;
        for (int64_t j = 0; j < kChunkK; ++j) {
          const int8_t v = static_cast<int8_t>(std::nearbyint(chunk[j] / step));
          qsum += v;
          q[r * k + c * kChunkK + (bits == 8 ? j : (j % 2) * (kChunkK / 2) + j / 2)] = v;
        }
        std::fill_n(scale + (r * chunks + c) * kScaleLanes, kScaleLanes, step);
        zero += step * static_cast<float>(qsum);
        total += sum;
      }
      zero_term[r * blocks + b] = zero;
      sums[r * blocks + b] = total;
    }
  }
};

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Two chunks' codes (64 unsigned bytes) in the order Int8Inputs stored the inputs; `half` when only the first exists.
template <int Bits>
inline __m512i codes64(const uint8_t *p, bool half) {
  if constexpr (Bits == 8) return _mm512_maskz_loadu_epi8(half ? 0xFFFFFFFFull : ~0ull, p);
  const __m256i b = _mm256_maskz_loadu_epi8(half ? 0xFFFFu : 0xFFFFFFFFu, p);
  const __m512i twice = _mm512_shuffle_i64x2(_mm512_castsi256_si512(b), _mm512_castsi256_si512(b), 0x50);  // A A B B
  const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0, 0x0004000400040004,
                                          0x0004000400040004, 0, 0);  // low nibbles of A and B, then the high ones
  return _mm512_and_si512(_mm512_srlv_epi16(twice, shifts), _mm512_set1_epi8(0x0F));
}

// The 16 lanes of v summed in one fixed order (halves added until one lane is left).
inline float sum16(__m512 v) {
  float lanes[16];
  _mm512_storeu_ps(lanes, v);
  for (int half = 8; half > 0; half /= 2)
    for (int i = 0; i < half; ++i) lanes[i] += lanes[i + half];
  return lanes[0];
}

// Zero points of blocks [b, b + count) of column col as floats (count <= 16; the rest 0).
template <int Bits>
inline __m512 zero_points16(const Quantized &e, int64_t col, int64_t b, int64_t count) {
  const uint8_t *row = e.zero_points + col * e.zero_width;
  __m128i bytes;
  if constexpr (Bits == 8) {
    bytes = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << count) - 1), row + b);
  } else {  // b is even: bytes b / 2.. hold blocks b, b + 1 (low, high nibble), ...
    const __m128i packed = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << ((count + 1) / 2)) - 1), row + b / 2);
    const __m128i mask = _mm_set1_epi8(0x0F);
    bytes = _mm_unpacklo_epi8(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
    bytes = _mm_maskz_mov_epi8(static_cast<__mmask16>((1u << count) - 1), bytes);
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
}

// The zero point's terms of rows [row, row + Rows) and columns [col, col + Cols), 16 blocks at a time.
template <int Bits, int Rows, int Cols>
void zero_terms(const Int8Inputs &in, int64_t row, const Quantized &e, int64_t col, __m512 (&out)[Rows][Cols]) {
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) out[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < e.blocks; b += kBlockGroup) {
    const int64_t count = std::min(kBlockGroup, e.blocks - b);
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    __m512 terms[Rows];
    for (int r = 0; r < Rows; ++r) terms[r] = _mm512_maskz_loadu_ps(mask, in.zero_term + (row + r) * in.blocks + b);
    for (int c = 0; c < Cols; ++c) {
      const __m512 weighted = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, e.scales + (col + c) * e.blocks + b),
                                            zero_points16<Bits>(e, col + c, b, count));
      for (int r = 0; r < Rows; ++r) out[r][c] = _mm512_fmadd_ps(weighted, terms[r], out[r][c]);
    }
  }
}

// Rows [row, row + Rows) times columns [col, col + Cols), from the rows' int8 chunks. Per element: one accumulator
// over chunk pairs (blocks of an even number of chunks: a block's pairs scaled by the rows' chunk scales into a
// partial sum, which is scaled by the block's; others: each pair scaled by both at once, lane by lane), one over the
// zero point's terms, summed in fixed orders; the same operations whatever Rows and Cols are. Each pair's code load
// prefetches the next step's columns at the same offset: without it the kernel waits on memory at decode, where every
// weight byte is read once (most of the gain of this form, docs/performance.md).
template <int Bits, int Rows, int Cols>
void int8_columns(const Int8Inputs &in, int64_t row, const Quantized &e, const float (*minimum)[kChunk], int64_t c0,
                  int64_t col, float *y) {
  constexpr int64_t kPairBytes = 2 * kChunkK * Bits / 8;
  const int64_t per_block = e.block_size / kChunkK, column_bytes = e.k * Bits / 8;
  const uint8_t *codes = e.codes + col * column_bytes;
  const float *scales = e.scales + col * e.blocks;
  const int8_t *xq = in.q + row * in.k;
  const float *xscale = in.scale + row * in.chunks * kScaleLanes;
  __m512 acc[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
  // dot products of chunks q, q + 1 (`half`: q alone), as floats, handed to add(r, c, products, row's chunk scales)
  auto pair = [&](int64_t q, bool half, auto add) {
    __m512i w[Cols];
    for (int c = 0; c < Cols; ++c) {
      const uint8_t *at = codes + c * column_bytes + q / 2 * kPairBytes;
      _mm_prefetch(reinterpret_cast<const char *>(at + Cols * column_bytes), _MM_HINT_T0);
      w[c] = codes64<Bits>(at, half);
    }
    for (int r = 0; r < Rows; ++r) {
      const __m512i x = _mm512_maskz_loadu_epi8(half ? 0xFFFFFFFFull : ~0ull, xq + r * in.k + q * kChunkK);
      const __m512 xs = _mm512_maskz_loadu_ps(half ? 0x00FF : 0xFFFF, xscale + (r * in.chunks + q) * kScaleLanes);
      for (int c = 0; c < Cols; ++c)
        add(r, c, _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[c], x)), xs);
    }
  };
  if (per_block % 2) {
    for (int64_t q = 0; q < in.chunks; q += 2) {
      const bool half = q + 1 == in.chunks;
      const int64_t b0 = per_block == 1 ? q : q / per_block;
      const int64_t b1 = half ? b0 : per_block == 1 ? q + 1 : (q + 1) / per_block;
      __m512 ws[Cols];
      for (int c = 0; c < Cols; ++c)
        ws[c] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(scales[c * e.blocks + b0]),
                                     _mm512_set1_ps(scales[c * e.blocks + b1]));
      pair(q, half, [&](int r, int c, __m512 dot, __m512 xs) {
        acc[r][c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(xs, ws[c]), acc[r][c]);
      });
    }
  } else {  // an even number of chunks a block: they pair up
    for (int64_t b = 0; b < e.blocks; ++b) {
      __m512 part[Rows][Cols];
      for (int r = 0; r < Rows; ++r)
        for (int c = 0; c < Cols; ++c) part[r][c] = _mm512_setzero_ps();
      for (int64_t q = b * per_block; q < (b + 1) * per_block; q += 2)
        pair(q, false, [&](int r, int c, __m512 dot, __m512 xs) { part[r][c] = _mm512_fmadd_ps(dot, xs, part[r][c]); });
      for (int c = 0; c < Cols; ++c) {
        const __m512 ws = _mm512_set1_ps(scales[c * e.blocks + b]);
        for (int r = 0; r < Rows; ++r) acc[r][c] = _mm512_fmadd_ps(part[r][c], ws, acc[r][c]);
      }
    }
  }
  __m512 zero[Rows][Cols];
  zero_terms<Bits, Rows, Cols>(in, row, e, col, zero);
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      y[r * e.n + col + c] = (sum16(acc[r][c]) - sum16(zero[r][c])) + minimum[r][col + c - c0];
}

template <int Bits, int Rows>
void int8_tile(const Int8Inputs &in, int64_t row, const Quantized &e, int64_t c0, int64_t c1, float *y) {
  float minimum[Rows][kChunk];
  minimum_terms<Rows>(e, [&](int r, int64_t b) { return in.sums[(row + r) * in.blocks + b]; }, c0, c1, minimum);
  int64_t col = c0;
  for (; col + kCols<Rows> <= c1; col += kCols<Rows>)
    int8_columns<Bits, Rows, kCols<Rows>>(in, row, e, minimum, c0, col, y);
  for (; col < c1; ++col) int8_columns<Bits, Rows, 1>(in, row, e, minimum, c0, col, y);
}
#else
template <int Bits, int Rows>
void int8_tile(const Int8Inputs &, int64_t, const Quantized &, int64_t, int64_t, float *) {}
#endif

// The groups of `group_list` as row bounds, and the experts that received rows; 0, or pg::fail's status.
int groups_of(const int64_t *group_list, int64_t group_list_type, int64_t experts, int64_t m, int64_t *bounds,
              int64_t *used, int64_t &groups) {
  if (experts <= 0 || experts > kMaxGroups || group_list_type < 0 || group_list_type > 1)
    return pg::fail("grouped matmul: " + std::to_string(experts) + " experts (1.." + std::to_string(kMaxGroups) +
                    "), group_list_type " + std::to_string(group_list_type) + " (0 cumsum, 1 counts)");
  bounds[0] = 0;
  groups = 0;
  for (int64_t e = 0; e < experts; ++e) {
    bounds[e + 1] = group_list_type == 1 ? bounds[e] + group_list[e] : group_list[e];
    if (bounds[e + 1] < bounds[e] || bounds[e + 1] > m)
      return pg::fail("grouped matmul: group list entry " + std::to_string(e) + " = " + std::to_string(group_list[e]) +
                      (group_list_type == 1 ? " (counts)" : " (cumsum)") + " does not split " + std::to_string(m) +
                      " rows into consecutive groups");
    if (bounds[e + 1] > bounds[e]) used[groups++] = e;
  }
  return 0;
}

// tile(rows, expert, rows of x, c0, c1, rows of y) over every (group, column chunk): the group's rows in tiles of
// kRows, then of two, then one (`rows` an integral_constant); rows past the groups are zeroed.
template <class Tile>
int run(const int64_t *group_list, int64_t group_list_type, int64_t experts, const float *x, float *y, int64_t m,
        int64_t k, int64_t n, const pg_runner *runner, const Tile &tile) {
  int64_t bounds[kMaxGroups + 1], used[kMaxGroups], groups = 0;
  if (int rc = groups_of(group_list, group_list_type, experts, m, bounds, used, groups)) return rc;
  if (bounds[experts] < m) std::memset(y + bounds[experts] * n, 0, sizeof(float) * (m - bounds[experts]) * n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  pg::parallel_for(runner, groups * chunks, [&](int64_t work) {
    const int64_t e = used[work / chunks], c0 = (work % chunks) * kChunk, c1 = std::min(n, c0 + kChunk);
    int64_t r = bounds[e];
    for (; r + kRows <= bounds[e + 1]; r += kRows) tile(std::integral_constant<int, kRows>{}, e, x + r * k, c0, c1, y + r * n);
    if (r + 2 <= bounds[e + 1]) {  // two rows (a decode's row and its padding copy) read the weights once
      tile(std::integral_constant<int, 2>{}, e, x + r * k, c0, c1, y + r * n);
      r += 2;
    }
    if (r < bounds[e + 1]) tile(std::integral_constant<int, 1>{}, e, x + r * k, c0, c1, y + r * n);
  });
  return 0;
}

}  // namespace

extern "C" {

int pg_grouped_matmul(const float *x, const void *weight, int32_t bfloat16, const int64_t *group_list,
                      int64_t group_list_type, float *y, int64_t m, int64_t k, int64_t n, int64_t experts,
                      const pg_runner *runner) {
  if (k % kWidth)
    return pg::fail("grouped matmul: K = " + std::to_string(k) + " is not a multiple of " + std::to_string(kWidth));
  auto dense = [&](const auto *w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    return run(group_list, group_list_type, experts, x, y, m, k, n, runner,
               [&](auto rows, int64_t e, const float *rx, int64_t c0, int64_t c1, float *ry) {
                 dense_tile<W, decltype(rows)::value>(rx, w + e * n * k, k, n, c0, c1, ry);
               });
  };
  return bfloat16 ? dense(static_cast<const uint16_t *>(weight)) : dense(static_cast<const float *>(weight));
}

int pg_grouped_matmul_nbits(const float *x, const uint8_t *codes, const float *scales, const uint8_t *zero_points,
                            int32_t zero_points_per_expert, const void *minimum_t, int32_t minimum_dtype,
                            int32_t minimum_per_expert, const int64_t *group_list, int64_t group_list_type, float *y,
                            int64_t m, int64_t k, int64_t n, int64_t experts, int64_t bits, int64_t block_size,
                            int32_t accuracy_level, const pg_runner *runner) {
  if ((bits != 4 && bits != 8) || block_size <= 0 || block_size % 16 || k % block_size ||
      k / block_size > kMaxBlocks || (minimum_dtype != PG_CACHE_FLOAT16 && minimum_dtype != PG_CACHE_FLOAT32))
    return pg::fail("grouped matmul (block-quantized): " + std::to_string(bits) + " bits (4 or 8), blocks of " +
                    std::to_string(block_size) + " (a multiple of 16 dividing K = " + std::to_string(k) +
                    ", at most " + std::to_string(kMaxBlocks) + " blocks), minimum dtype " +
                    std::to_string(minimum_dtype) + " (float16 or float32)");
  const int64_t blocks = k / block_size, zero_width = bits == 8 ? blocks : (blocks + 1) / 2;
  const int64_t minimum_size = minimum_dtype == PG_CACHE_FLOAT16 ? 2 : 4;
  auto expert = [&](int64_t e) {
    return Quantized{codes + e * n * blocks * block_size * bits / 8, scales + e * n * blocks,
                     zero_points + (zero_points_per_expert ? e : 0) * n * zero_width,
                     static_cast<const char *>(minimum_t) + (minimum_per_expert ? e : 0) * blocks * n * minimum_size,
                     k, n, block_size, blocks, zero_width, minimum_dtype == PG_CACHE_FLOAT16};
  };
  const bool int8 = kInt8Dot && accuracy_level == 4 && block_size % kChunkK == 0;
  Int8Inputs in{};
  if (int8) {  // every row quantized once, before the tiles
    in = Int8Inputs::of(m, k, blocks);
    pg::parallel_for(runner, m, [&](int64_t r) { in.quantize(x + r * k, r, static_cast<int>(bits), block_size); });
  }
  return run(group_list, group_list_type, experts, x, y, m, k, n, runner,
             [&](auto rows, int64_t e, const float *rx, int64_t c0, int64_t c1, float *ry) {
               constexpr int kTile = decltype(rows)::value;
               if (int8 && bits == 8)
                 int8_tile<8, kTile>(in, (rx - x) / k, expert(e), c0, c1, ry);
               else if (int8)
                 int8_tile<4, kTile>(in, (rx - x) / k, expert(e), c0, c1, ry);
               else if (bits == 8)
                 quantized_tile<8, kTile>(rx, expert(e), c0, c1, ry);
               else
                 quantized_tile<4, kTile>(rx, expert(e), c0, c1, ry);
             });
}
}
