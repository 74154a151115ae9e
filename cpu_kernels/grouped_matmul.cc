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
#include <cstdint>
#include <string>
#include <type_traits>

#include "common.h"

using pg::f32x8, pg::kLanes, pg::load8;

namespace {

constexpr int64_t kMaxGroups = 1024;  // experts per layer (DeepSeek-V3 routes over 256)
constexpr int64_t kMaxBlocks = 2048;  // blocks per input row (K / block_size)
constexpr int64_t kChunk = 64;        // output columns per work item
constexpr int kRows = 4;              // rows per tile

// The lanes of v summed in one fixed order.
inline float sum8(f32x8 v) {
  const float a = (v[0] + v[4]) + (v[1] + v[5]), b = (v[2] + v[6]) + (v[3] + v[7]);
  return a + b;
}

// Eight bfloat16 weights widened, and eight inputs rounded to bfloat16 (to nearest even, as ml_dtypes).
inline f32x8 bf16_8(const uint16_t *p) { return load8(reinterpret_cast<const pg::bf16 *>(p)); }

inline f32x8 round_bf16(f32x8 v) {
  const pg::i32x8 u = __builtin_bit_cast(pg::i32x8, v);
  const pg::i32x8 rounded = (u + 0x7fff + ((u >> 16) & 1)) & ~0xffff;
  return __builtin_bit_cast(f32x8, rounded);
}

// Eight weights of a float32 or bfloat16 expert row, and the input they multiply (rounded for bfloat16).
inline f32x8 weight8(const float *p) { return load8(p); }
inline f32x8 weight8(const uint16_t *p) { return bf16_8(p); }
inline f32x8 input8(const float *p, const float *) { return load8(p); }
inline f32x8 input8(const float *p, const uint16_t *) { return round_bf16(load8(p)); }

// Rows [0, Rows) of a tile times columns [col, col + Cols) of a float32 or bfloat16 expert [N, K]. Each element has
// two accumulators (the even and the odd vectors of its row: independent chains keep the FMA units busy when a
// tile is one row), summed at the end; the same operations for every element whatever Rows and Cols are.
template <class W, int Rows, int Cols>
void dense_columns(const float *x, const W *w, int64_t k, int64_t n, int64_t col, float *y) {
  f32x8 even[Rows][Cols] = {}, odd[Rows][Cols] = {};
  for (int64_t j = 0; j < k; j += 2 * kLanes) {
    f32x8 w0[Cols], w1[Cols];
    for (int c = 0; c < Cols; ++c) {
      w0[c] = weight8(w + (col + c) * k + j);
      w1[c] = weight8(w + (col + c) * k + j + kLanes);
    }
    for (int r = 0; r < Rows; ++r) {
      const f32x8 x0 = input8(x + r * k + j, w), x1 = input8(x + r * k + j + kLanes, w);
      for (int c = 0; c < Cols; ++c) {
        even[r][c] += x0 * w0[c];
        odd[r][c] += x1 * w1[c];
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) y[r * n + col + c] = sum8(even[r][c] + odd[r][c]);
}

// Columns per step: a one-row tile (decode) takes four (eight accumulator chains), a four-row tile two (sixteen
// accumulators, within AVX-512's 32 vector registers).
template <int Rows>
constexpr int kCols = Rows == 1 ? 4 : 2;

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

// Eight codes minus the zero point, as floats: 8-bit codes from 8 bytes, 4-bit ones from 4 bytes (low nibble first).
#if defined(__AVX2__)
using Zero = __m256i;
inline Zero zero_vector(int z) { return _mm256_set1_epi32(z); }

template <int Bits>
inline f32x8 codes8(const uint8_t *p, Zero zero) {
  __m128i bytes;
  if constexpr (Bits == 8) {
    bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i *>(p));
  } else {
    int32_t packed;
    std::memcpy(&packed, p, sizeof packed);
    const __m128i b = _mm_cvtsi32_si128(packed);
    const __m128i low = _mm_and_si128(b, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
    bytes = _mm_unpacklo_epi8(low, high);
  }
  return (f32x8)_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), zero));
}
#else
using Zero = int;
inline Zero zero_vector(int z) { return z; }

template <int Bits>
inline f32x8 codes8(const uint8_t *p, Zero zero) {
  f32x8 v;
  for (int j = 0; j < 8; ++j) v[j] = static_cast<float>((Bits == 8 ? p[j] : (p[j / 2] >> (4 * (j & 1))) & 0x0F) - zero);
  return v;
}
#endif

// Rows [0, Rows) of a tile (their block sums in `sums`) times columns [col, col + Cols) of a block-quantized expert.
// Within a block each element has two accumulators (even and odd vectors), their sum times the block's scale added
// into the element's running vector; the same operations for every element whatever Rows and Cols are.
template <int Bits, int Rows, int Cols>
void quantized_columns(const float *x, const Quantized &e, const float (*sums)[kMaxBlocks], int64_t col, float *y) {
  constexpr int64_t kBytes8 = Bits;  // bytes of eight codes
  const int64_t block_bytes = e.block_size * Bits / 8;
  f32x8 acc[Rows][Cols] = {};
  float extra[Rows][Cols] = {};
  for (int64_t b = 0; b < e.blocks; ++b) {
    Zero zero[Cols];
    const uint8_t *codes[Cols];
    for (int c = 0; c < Cols; ++c) {
      zero[c] = zero_vector(e.zero_point(col + c, b, Bits));
      codes[c] = e.codes + ((col + c) * e.blocks + b) * block_bytes;
    }
    f32x8 even[Rows][Cols] = {}, odd[Rows][Cols] = {};
    const float *xb = x + b * e.block_size;
    for (int64_t j = 0; j < e.block_size; j += 2 * kLanes) {
      f32x8 w0[Cols], w1[Cols];
      for (int c = 0; c < Cols; ++c) {
        w0[c] = codes8<Bits>(codes[c] + j / kLanes * kBytes8, zero[c]);
        w1[c] = codes8<Bits>(codes[c] + (j / kLanes + 1) * kBytes8, zero[c]);
      }
      for (int r = 0; r < Rows; ++r) {
        const f32x8 x0 = load8(xb + r * e.k + j), x1 = load8(xb + r * e.k + j + kLanes);
        for (int c = 0; c < Cols; ++c) {
          even[r][c] += x0 * w0[c];
          odd[r][c] += x1 * w1[c];
        }
      }
    }
    for (int c = 0; c < Cols; ++c) {
      const float scale = e.scales[(col + c) * e.blocks + b], low = e.minimum(col + c, b);
      for (int r = 0; r < Rows; ++r) {
        acc[r][c] += (even[r][c] + odd[r][c]) * scale;
        extra[r][c] += low * sums[r][b];
      }
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) y[r * e.n + col + c] = sum8(acc[r][c]) + extra[r][c];
}

template <int Bits, int Rows>
void quantized_tile(const float *x, const Quantized &e, int64_t c0, int64_t c1, float *y) {
  float sums[Rows][kMaxBlocks];  // each row's inputs summed per block (the minimum's term)
  for (int r = 0; r < Rows; ++r)
    for (int64_t b = 0; b < e.blocks; ++b) {
      f32x8 acc{};
      for (int64_t j = 0; j < e.block_size; j += kLanes) acc += load8(x + r * e.k + b * e.block_size + j);
      sums[r][b] = sum8(acc);
    }
  int64_t col = c0;
  for (; col + kCols<Rows> <= c1; col += kCols<Rows>) quantized_columns<Bits, Rows, kCols<Rows>>(x, e, sums, col, y);
  for (; col < c1; ++col) quantized_columns<Bits, Rows, 1>(x, e, sums, col, y);
}

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

// tile(rows of x, expert, c0, c1, rows of y) over every (group, column chunk), rows in tiles of kRows then one by
// one; rows past the groups are zeroed.
template <class Tile, class OneRow>
int run(const int64_t *group_list, int64_t group_list_type, int64_t experts, const float *x, float *y, int64_t m,
        int64_t k, int64_t n, const pg_runner *runner, const Tile &tile, const OneRow &one_row) {
  int64_t bounds[kMaxGroups + 1], used[kMaxGroups], groups = 0;
  if (int rc = groups_of(group_list, group_list_type, experts, m, bounds, used, groups)) return rc;
  if (bounds[experts] < m) std::memset(y + bounds[experts] * n, 0, sizeof(float) * (m - bounds[experts]) * n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  pg::parallel_for(runner, groups * chunks, [&](int64_t work) {
    const int64_t e = used[work / chunks], c0 = (work % chunks) * kChunk, c1 = std::min(n, c0 + kChunk);
    int64_t r = bounds[e];
    for (; r + kRows <= bounds[e + 1]; r += kRows) tile(e, x + r * k, c0, c1, y + r * n);
    for (; r < bounds[e + 1]; ++r) one_row(e, x + r * k, c0, c1, y + r * n);
  });
  return 0;
}

}  // namespace

extern "C" {

int pg_grouped_matmul(const float *x, const void *weight, int32_t bfloat16, const int64_t *group_list,
                      int64_t group_list_type, float *y, int64_t m, int64_t k, int64_t n, int64_t experts,
                      const pg_runner *runner) {
  if (k % (2 * kLanes)) return pg::fail("grouped matmul: K = " + std::to_string(k) + " is not a multiple of 16");
  auto dense = [&](const auto *w) {
    using W = std::remove_cv_t<std::remove_pointer_t<decltype(w)>>;
    return run(group_list, group_list_type, experts, x, y, m, k, n, runner,
               [&](int64_t e, const float *rx, int64_t c0, int64_t c1, float *ry) {
                 dense_tile<W, kRows>(rx, w + e * n * k, k, n, c0, c1, ry);
               },
               [&](int64_t e, const float *rx, int64_t c0, int64_t c1, float *ry) {
                 dense_tile<W, 1>(rx, w + e * n * k, k, n, c0, c1, ry);
               });
  };
  return bfloat16 ? dense(static_cast<const uint16_t *>(weight)) : dense(static_cast<const float *>(weight));
}

int pg_grouped_matmul_nbits(const float *x, const uint8_t *codes, const float *scales, const uint8_t *zero_points,
                            int32_t zero_points_per_expert, const void *minimum_t, int32_t minimum_dtype,
                            int32_t minimum_per_expert, const int64_t *group_list, int64_t group_list_type, float *y,
                            int64_t m, int64_t k, int64_t n, int64_t experts, int64_t bits, int64_t block_size,
                            const pg_runner *runner) {
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
  auto tiles = [&](auto rows) {
    return [&, rows](int64_t e, const float *rx, int64_t c0, int64_t c1, float *ry) {
      constexpr int kTile = decltype(rows)::value;
      if (bits == 8)
        quantized_tile<8, kTile>(rx, expert(e), c0, c1, ry);
      else
        quantized_tile<4, kTile>(rx, expert(e), c0, c1, ry);
    };
  };
  return run(group_list, group_list_type, experts, x, y, m, k, n, runner, tiles(std::integral_constant<int, kRows>{}),
             tiles(std::integral_constant<int, 1>{}));
}
}
