// BlockMinimum (graphs/ops/block_minimum.py) as one C++ kernel (float32 activations, CPU): out = y + blocksum(x) @
// minimum_t, the exact minimum term of a GGUF Q4_1 / Q4_K linear beside ONNX Runtime's MatMulNBits.
//
// Its work is 1 / block_size of the linear's, but as standard ops it is four nodes per linear, a third of a
// B = 1 decode step. Tokens go in tiles of up to 4: their block sums once, then 32 or 64 output columns at
// a time, each column vector accumulating one row of minimum_t per block. At B = 1 the step streams the minima
// from memory, so they come as float16 where that is exact (Q4_1's own), widened by F16C (common.h's load8).
#include <algorithm>
#include <cstdint>
#include <string>

#include "common.h"

using pg::f32x8, pg::kLanes, pg::load8, pg::store8;

namespace {

constexpr int64_t kMaxBlocks = 1024;  // inputs up to 32,768 at blocks of 32
constexpr int kTokens = 4;            // tokens per tile

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
void tile(const float *y, const M *minimum_t, const float *sums, float *out, int64_t n, int64_t blocks) {
  constexpr int groups = Rows <= 2 ? 8 : 4;  // column vectors per step: up to 16 accumulators in flight
  int64_t c = 0;
  for (; c + groups * kLanes <= n; c += groups * kLanes)
    columns<Rows, groups>(y, minimum_t, sums, out, c, n, blocks);
  for (; c + kLanes <= n; c += kLanes) columns<Rows, 1>(y, minimum_t, sums, out, c, n, blocks);
  for (; c < n; ++c)
    for (int r = 0; r < Rows; ++r) {
      float acc = y[r * n + c];
      for (int64_t b = 0; b < blocks; ++b) acc += sums[r * blocks + b] * pg::to_float(minimum_t[b * n + c]);
      out[r * n + c] = acc;
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

template <class M>
void block_minimum(const float *y, const float *x, const M *minimum_t, float *out, int64_t tokens, int64_t n,
                   int64_t k, int64_t block_size, const pg_runner *runner) {
  const int64_t blocks = k / block_size, tiles = (tokens + kTokens - 1) / kTokens;
  pg::for_rows(runner, tiles, n * blocks / kLanes, [&](int64_t index) {
    const int64_t first = index * kTokens;
    const int rows = static_cast<int>(std::min<int64_t>(kTokens, tokens - first));
    float sums[kTokens * kMaxBlocks];
    for (int r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b)
        sums[r * blocks + b] = block_sum(x + (first + r) * k + b * block_size, block_size);
    const float *y_rows = y + first * n;
    float *out_rows = out + first * n;
    switch (rows) {
      case 4: tile<4>(y_rows, minimum_t, sums, out_rows, n, blocks); break;
      case 3: tile<3>(y_rows, minimum_t, sums, out_rows, n, blocks); break;
      case 2: tile<2>(y_rows, minimum_t, sums, out_rows, n, blocks); break;
      default: tile<1>(y_rows, minimum_t, sums, out_rows, n, blocks); break;
    }
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
