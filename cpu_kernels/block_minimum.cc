// BlockMinimum (graphs/ops/block_minimum.py) as one C++ kernel (float32 activations, CPU): out = y + blocksum(x) @
// minimum_t, the exact minimum term of a GGUF Q4_1 / Q4_K linear beside ONNX Runtime's MatMulNBits.
//
// Its work is 1 / block_size of the linear's, but as standard ops it is four nodes per linear, a third of a
// B = 1 decode step. Tokens go in tiles of up to 4: their block sums once, then 32 or 64 output columns at
// a time, each column vector accumulating one row of minimum_t per block. At B = 1 the step streams the minima
// from memory, so they come as float16 where that is exact (Q4_1's own), widened by F16C (common.h's load8),
// and a decode step's single tile is split by columns across the pool: one thread alone does not reach the
// memory bandwidth two do (docs/performance.md, "Kernel and graph choices").
#include <algorithm>
#include <cstdint>
#include <string>

#include "common.h"

using pg::f32x8, pg::kLanes, pg::load8, pg::store8;

namespace {

constexpr int64_t kMaxBlocks = 1024;  // inputs up to 32,768 at blocks of 32
constexpr int kTokens = 4;            // tokens per tile
// One tile (a decode step of up to 4 tokens) is shared out by slices of kSlice output columns (a multiple of
// the widest column step, 8 vectors) once it has kSliceWork vector multiply-adds: below, waking the pool costs more.
constexpr int64_t kSlice = 64;
constexpr int64_t kSliceWork = 1024;

// Columns [c, c + groups * 8) of the tile's rows: y plus the block sums times minimum_t's rows.
template <int Rows, int Groups, class M>
void columns(const float *y, const M *minimum_t, const float *sums, float *out, int64_t c, int64_t n,
             int64_t blocks) {
  f32x8 acc[Rows][Groups];
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < Groups; ++g) acc[r][g] = load8(y + r * n + c + g * kLanes);
  for (int64_t b = 0; b < blocks; ++b) {
    f32x8 m[Groups];
    for (int g = 0; g < Groups; ++g) m[g] = load8(minimum_t + b * n + c + g * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float s = sums[r * blocks + b];
      for (int g = 0; g < Groups; ++g) acc[r][g] += s * m[g];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int g = 0; g < Groups; ++g) store8(out + r * n + c + g * kLanes, acc[r][g]);
}

template <int Rows, class M>
void tile(const float *y, const M *minimum_t, const float *sums, float *out, int64_t n, int64_t blocks,
          int64_t begin, int64_t end) {
  constexpr int groups = Rows <= 2 ? 8 : 4;  // column vectors per step: up to 16 accumulators in flight
  int64_t c = begin;
  for (; c + groups * kLanes <= end; c += groups * kLanes)
    columns<Rows, groups>(y, minimum_t, sums, out, c, n, blocks);
  for (; c + kLanes <= end; c += kLanes) columns<Rows, 1>(y, minimum_t, sums, out, c, n, blocks);
  for (; c < end; ++c)
    for (int r = 0; r < Rows; ++r) {
      float acc = y[r * n + c];
      for (int64_t b = 0; b < blocks; ++b) acc += sums[r * blocks + b] * pg::to_float(minimum_t[b * n + c]);
      out[r * n + c] = acc;
    }
}

// Columns [begin, end) of a tile of `rows` tokens.
template <class M>
void tile_columns(int rows, const float *y, const M *minimum_t, const float *sums, float *out, int64_t n,
                  int64_t blocks, int64_t begin, int64_t end) {
  switch (rows) {
    case 4: tile<4>(y, minimum_t, sums, out, n, blocks, begin, end); break;
    case 3: tile<3>(y, minimum_t, sums, out, n, blocks, begin, end); break;
    case 2: tile<2>(y, minimum_t, sums, out, n, blocks, begin, end); break;
    default: tile<1>(y, minimum_t, sums, out, n, blocks, begin, end); break;
  }
}

float block_sum(const float *x, int64_t block_size) {
  f32x8 acc{};
  int64_t j = 0;
  for (; j + kLanes <= block_size; j += kLanes) acc += load8(x + j);
  float sum = 0.f;
  for (; j < block_size; ++j) sum += x[j];
  for (int64_t lane = 0; lane < kLanes; ++lane) sum += acc[lane];
  return sum;
}

// The block sums of `rows` tokens of x into sums[r * blocks + b].
void tile_sums(const float *x, int rows, int64_t k, int64_t blocks, int64_t block_size, float *sums) {
  for (int r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) sums[r * blocks + b] = block_sum(x + r * k + b * block_size, block_size);
}

template <class M>
void block_minimum(const float *y, const float *x, const M *minimum_t, float *out, int64_t tokens, int64_t n,
                   int64_t k, int64_t block_size, const pg_runner *runner) {
  const int64_t blocks = k / block_size, tiles = (tokens + kTokens - 1) / kTokens;
  if (tiles == 1) {  // a small decode batch: its one tile's columns in slices across the pool
    const int rows = static_cast<int>(tokens);
    float sums[kTokens * kMaxBlocks];
    tile_sums(x, rows, k, blocks, block_size, sums);
    const int64_t slices = (n + kSlice - 1) / kSlice;
    const auto slice = [&](int64_t s) {
      tile_columns(rows, y, minimum_t, sums, out, n, blocks, s * kSlice, std::min(n, (s + 1) * kSlice));
    };
    if (rows * n * blocks / kLanes < kSliceWork)
      for (int64_t s = 0; s < slices; ++s) slice(s);
    else
      pg::parallel_for(runner, slices, slice);
    return;
  }
  pg::for_rows(runner, tiles, n * blocks / kLanes, [&](int64_t index) {
    const int64_t first = index * kTokens;
    const int rows = static_cast<int>(std::min<int64_t>(kTokens, tokens - first));
    float sums[kTokens * kMaxBlocks];
    tile_sums(x + first * k, rows, k, blocks, block_size, sums);
    tile_columns(rows, y + first * n, minimum_t, sums, out + first * n, n, blocks, 0, n);
  });
}

}  // namespace

extern "C" {

int pg_block_minimum(const float *y, const float *x, const void *minimum_t, int32_t minimum_dtype, float *out,
                     int64_t tokens, int64_t n, int64_t k, int64_t block_size, const pg_runner *runner) {
  if (block_size <= 0 || k <= 0 || k % block_size || k / block_size > kMaxBlocks)
    return pg::fail("block_minimum: K " + std::to_string(k) + " must be a positive multiple of block_size " +
                    std::to_string(block_size) + " with at most " + std::to_string(kMaxBlocks) + " blocks");
  if (minimum_dtype == PG_CACHE_FLOAT16)
    block_minimum(y, x, static_cast<const _Float16 *>(minimum_t), out, tokens, n, k, block_size, runner);
  else if (minimum_dtype == PG_CACHE_FLOAT32)
    block_minimum(y, x, static_cast<const float *>(minimum_t), out, tokens, n, k, block_size, runner);
  else
    return pg::fail("block_minimum: minimum_t dtype code " + std::to_string(minimum_dtype) +
                    " is not float16 (2) or float32 (0)");
  return 0;
}

}  // extern "C"
