// The fused ops of graphs/ops as C++ kernels (float32 compute, CPU): ReshapeAndCache, PagedAttention, SelfAttention.
//
// The KV pools may hold float32, bfloat16, float16 or int8 (pg_kv_cache): ReshapeAndCache converts the new
// rows before the write, and PagedAttention reads the cache directly, widening each row as it loads it.
// int8 is dequantized without a pass of its own: K's per-channel scale is folded into the query
// (q . (s * (k - o)) = (q * s) . k - const, and softmax ignores a per-query constant, so K's offset drops
// out), and V's scale and offset apply once per output row (sum_j p_j s (v_j - o) = s (sum_j p_j v_j - o)
// for probabilities p that sum to one). On AVX-512 VNNI, int8 decode rows score keys in integers
// (see "int8 decode rows on AVX-512 VNNI").
//
// Contracts are those of the numpy references in graphs/ops: pools are [num_slots, kv_heads * head_dim]
// rows, block tables map a sequence's block index to a pool block, and query rows are packed per
// cu_seqlens_q (sequence b owns rows cu[b]..cu[b+1]); rows outside every sequence come back as zeros.
// Every index is checked before anything is read or written: a bad slot or block id is an error,
// never a write outside the pool.
//
// Attention is flash-style: a work item is a tile of up to kTileRows query rows of one sequence against
// one kv head (prefill), or one query row against all of them (decode), so every query head of the
// item shares each key and value row while it is in L1, and softmax runs online over chunks of keys,
// so no score row longer than a chunk is ever stored.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace {

using pg::bf16, pg::exp8, pg::f32x8, pg::fail, pg::kLanes, pg::load8, pg::store8, pg::to_float;

constexpr int64_t kTileRows = 16;  // query rows of one sequence per work item
constexpr int64_t kChunk = 24;     // keys per online-softmax step

// K/V rows of one sequence, addressed by position in that sequence; Elem is the pools' element type.
template <class C>
struct PagedRows {
  using Elem = C;
  const C *k_cache, *v_cache;
  const int32_t *table;
  int64_t block_size, width;
  int64_t row(int64_t j) const { return (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * width; }
  const C *k(int64_t j) const { return k_cache + row(j); }
  const C *v(int64_t j) const { return v_cache + row(j); }
};

struct PackedRows {
  using Elem = float;
  const float *key, *value;
  int64_t first, width;
  const float *k(int64_t j) const { return key + (first + j) * width; }
  const float *v(int64_t j) const { return value + (first + j) * width; }
};

// A prefill work item: `rows` query rows of one sequence, `stride` floats apart, against one kv head k;
// row i sees keys 0..first_limit + i. Head h = i * group + g is query head k * group + g of row i.
struct TileShape {
  int64_t rows, stride, first_limit, group, head_dim;
  float scale;
  int64_t heads() const { return rows * group; }
  // Head vectors per score tile: two for tall tiles, one for a few rows.
  int64_t head_vectors() const { return heads() > kLanes ? 2 : 1; }
  // Heads padded to whole score tiles (zero queries, ignored outputs).
  int64_t padded() const {
    const int64_t step = head_vectors() * kLanes;
    return (heads() + step - 1) / step * step;
  }
  // Query (and output) offset of head h, from the item's first row and kv head.
  int64_t offset_of(int64_t h) const { return (h / group) * stride + (h % group) * head_dim; }
};

// A prefill item's softmax state and buffers. Scores and softmax state are head-minor ([key][head],
// [head]), so the online softmax runs across heads in vectors; queries are stored transposed
// ([D][head]) for the same reason.
struct HeadState {
  float *query_t, *acc, *scores, *peak, *total, *last_key, *correction;
};

// Per-thread floats, grown on demand and reused by every later item on that thread; one buffer per Slot.
template <int Slot = 0>
float *scratch(size_t size) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

HeadState head_state(int64_t padded, int64_t head_dim) {
  float *p = scratch(padded * (2 * head_dim + kChunk + 4));
  HeadState s;
  s.query_t = p, p += head_dim * padded;
  s.acc = p, p += padded * head_dim;
  s.scores = p, p += kChunk * padded;
  s.peak = p, s.total = p + padded, s.last_key = p + 2 * padded, s.correction = p + 3 * padded;
  return s;
}

// Asks for the rows of keys [begin, end) (the next chunk) while this one is computed: the block table
// knows where they are, the hardware prefetcher does not (blocks are scattered over the pool).
template <class Rows>
void prefetch(const Rows &kv, int64_t begin, int64_t end, int64_t offset, int64_t width) {
  constexpr int64_t kLine = 64 / sizeof(typename Rows::Elem);
  for (int64_t j = begin; j < end; ++j) {
    const auto *k = kv.k(j) + offset, *v = kv.v(j) + offset;
    for (int64_t x = 0; x < width; x += kLine) {
      __builtin_prefetch(k + x);
      __builtin_prefetch(v + x);
    }
  }
}

// scores[j][h] = q_h . k_{j0+j} for the n keys of a chunk, in register tiles of 6 keys x 2 vectors of heads
// (12 accumulators keep both FMA pipes busy; docs/performance.md, "Kernel and graph choices") or 8 keys x 1 for
// short tiles: each key element is broadcast once per tile, each query vector loaded once per d.
template <int64_t HV, class Rows>
void chunk_scores(const HeadState &s, const TileShape &t, const Rows &kv, int64_t offset, int64_t j0, int64_t n) {
  constexpr int64_t kKeys = HV == 2 ? 6 : 8;
  static_assert(kChunk % kKeys == 0, "key tiles must not straddle a chunk");
  const int64_t dim = t.head_dim, padded = t.padded();
  const typename Rows::Elem *keys[kChunk];
  for (int64_t j = 0; j < kChunk; ++j) keys[j] = kv.k(j0 + std::min(j, n - 1)) + offset;  // j >= n: masked later
  for (int64_t h = 0; h < padded; h += HV * kLanes) {
    for (int64_t j = 0; j < n; j += kKeys) {
      f32x8 acc[kKeys][HV] = {};
      for (int64_t d = 0; d < dim; ++d) {
        f32x8 q[HV];
        for (int64_t v = 0; v < HV; ++v) q[v] = load8(&s.query_t[d * padded + h + v * kLanes]);
        for (int64_t i = 0; i < kKeys; ++i)
          for (int64_t v = 0; v < HV; ++v) acc[i][v] += to_float(keys[j + i][d]) * q[v];
      }
      for (int64_t i = 0; i < kKeys; ++i)
        for (int64_t v = 0; v < HV; ++v) store8(&s.scores[(j + i) * padded + h + v * kLanes], acc[i][v]);
    }
  }
}

// Online softmax over one chunk, in vectors of heads: scores become exp(score - running peak), 0 past
// each head's last visible key, and `correction[h]` rescales what head h accumulated before.
void chunk_softmax(const HeadState &s, const TileShape &t, int64_t j0, int64_t n) {
  const int64_t padded = t.padded();
  for (int64_t h = 0; h < padded; h += kLanes) {
    const f32x8 last = load8(&s.last_key[h]), peak = load8(&s.peak[h]);
    f32x8 top = peak;
    for (int64_t j = 0; j < n; ++j) {
      const f32x8 score = load8(&s.scores[j * padded + h]);
      top = static_cast<float>(j0 + j) <= last && score > top ? score : top;
    }
    const f32x8 correction = exp8(peak - top);
    f32x8 total = load8(&s.total[h]) * correction;
    for (int64_t j = 0; j < n; ++j) {
      float *row = &s.scores[j * padded + h];
      const f32x8 p = static_cast<float>(j0 + j) <= last ? exp8(load8(row) - top) : f32x8{};
      store8(row, p);
      total += p;
    }
    store8(&s.peak[h], top);
    store8(&s.total[h], total);
    store8(&s.correction[h], correction);
  }
}

// acc_h = acc_h * correction_h + sum_j p[j][h] v_{j0+j}, in register tiles of kHeads heads x W
// vectors of D (compile-time sizes, so the tile stays in registers).
template <int64_t W, class Rows>
void chunk_values(const HeadState &s, const TileShape &t, const Rows &kv, int64_t offset, int64_t j0, int64_t n) {
  constexpr int64_t kHeads = 4;
  const int64_t dim = t.head_dim, padded = t.padded();
  const typename Rows::Elem *values[kChunk];
  for (int64_t j = 0; j < n; ++j) values[j] = kv.v(j0 + j) + offset;
  for (int64_t h = 0; h < t.heads(); h += kHeads) {
    for (int64_t d = 0; d < dim; d += W * kLanes) {
      f32x8 tile[kHeads][W];
      for (int64_t i = 0; i < kHeads; ++i)
        for (int64_t w = 0; w < W; ++w) tile[i][w] = load8(&s.acc[(h + i) * dim + d + w * kLanes]) * s.correction[h + i];
      for (int64_t j = 0; j < n; ++j) {
        const float *p = &s.scores[j * padded + h];
        for (int64_t w = 0; w < W; ++w) {
          const f32x8 v = load8(values[j] + d + w * kLanes);
          for (int64_t i = 0; i < kHeads; ++i) tile[i][w] += p[i] * v;
        }
      }
      for (int64_t i = 0; i < kHeads; ++i)
        for (int64_t w = 0; w < W; ++w) store8(&s.acc[(h + i) * dim + d + w * kLanes], tile[i][w]);
    }
  }
}

// The chunk's n key and value rows of one kv head (`dim` elements at `offset`) widened to float32 once,
// as rows addressed by key index from j0: a tile's score and value loops then read floats, as for a
// float32 cache, instead of widening each key element once per tile of head vectors and each value
// element once per 4 heads. The widening is exact, so the results equal widening in the loops bit for bit.
template <class Rows>
PackedRows widen_chunk(const Rows &kv, int64_t offset, int64_t j0, int64_t n, int64_t dim) {
  float *k = scratch<1>(2 * kChunk * dim), *v = k + kChunk * dim;  // beside the tile's own scratch
  for (int64_t j = 0; j < n; ++j) {
    const auto *key = kv.k(j0 + j) + offset, *value = kv.v(j0 + j) + offset;
    for (int64_t d = 0; d < dim; d += kLanes) {
      store8(k + j * dim + d, load8(key + d));
      store8(v + j * dim + d, load8(value + d));
    }
  }
  return PackedRows{k, v, -j0, dim};
}

// A prefill tile against one kv head (at `offset` in the K/V rows); query and out point at its first
// row's first head of that kv head. `k_scale` (int8 caches, else null): that kv head's K scales.
// Caches of 16-bit or int8 elements are widened a chunk at a time (widen_chunk).
template <class Rows>
void attend_tile(const float *query, float *out, const TileShape &t, const Rows &kv, int64_t offset,
                 const float *k_scale) {
  const int64_t heads = t.heads(), padded = t.padded(), dim = t.head_dim;
  const HeadState s = head_state(padded, dim);
  for (int64_t h = 0; h < padded; ++h) {
    const float *q = h < heads ? query + t.offset_of(h) : nullptr;
    for (int64_t d = 0; d < dim; ++d) s.query_t[d * padded + h] = q ? q[d] * t.scale * (k_scale ? k_scale[d] : 1.f) : 0.f;
    s.last_key[h] = static_cast<float>(t.first_limit + std::min(h, heads - 1) / t.group);
  }
  std::fill(s.acc, s.acc + padded * dim, 0.f);
  std::fill(s.peak, s.peak + padded, -INFINITY);
  std::fill(s.total, s.total + padded, 0.f);
  const int64_t keys = t.first_limit + t.rows;
  for (int64_t j0 = 0; j0 < keys; j0 += kChunk) {
    const int64_t n = std::min(kChunk, keys - j0);
    prefetch(kv, j0 + kChunk, std::min(keys, j0 + 2 * kChunk), offset, dim);
    const auto chunk = [&](const auto &rows, int64_t at) {
      if (t.head_vectors() == 2) {
        chunk_scores<2>(s, t, rows, at, j0, n);
      } else {
        chunk_scores<1>(s, t, rows, at, j0, n);
      }
      chunk_softmax(s, t, j0, n);
      if (dim % (2 * kLanes)) {
        chunk_values<1>(s, t, rows, at, j0, n);
      } else {
        chunk_values<2>(s, t, rows, at, j0, n);
      }
    };
    if constexpr (std::is_same_v<typename Rows::Elem, float>) {
      chunk(kv, offset);
    } else {
      chunk(widen_chunk(kv, offset, j0, n, dim), 0);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float *o = out + t.offset_of(h);
    const float inv = 1.f / s.total[h];
    for (int64_t d = 0; d < dim; ++d) o[d] = s.acc[h * dim + d] * inv;
  }
}

// -- Decode rows ----------------------------------------------------------------------------------
// A decode row has only `group` query heads per kv head (3 for SmolLM2), too few to fill a vector of
// heads, so its scores are kept key-minor instead ([head][key]): dot products run along D and are
// reduced across lanes, and the softmax runs over whole vectors of keys.

constexpr int64_t kDecodeChunk = 2 * kLanes;  // keys per online-softmax step
constexpr int64_t kKeyTile = 4;               // keys per score tile
constexpr int64_t kHeadTile = 3;              // heads per score and value tile (3 x 4 accumulators)

typedef float f32x4 __attribute__((vector_size(16)));

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (AVX's hadd)
inline f32x8 pair_sums(f32x8 a, f32x8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// out[i] = the sum of v[i]'s lanes, for four vectors.
inline void store_sums4(const f32x8 *v, float *out) {
  const f32x8 u = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));  // [0 1 2 3] low halves, then high
  const f32x4 sums = __builtin_shufflevector(u, u, 0, 1, 2, 3) + __builtin_shufflevector(u, u, 4, 5, 6, 7);
  std::memcpy(out, &sums, sizeof sums);
}

inline float max_of(f32x8 v) {
  float top = v[0];
  for (int64_t i = 1; i < kLanes; ++i) top = std::max(top, v[i]);
  return top;
}

// One decode row's state: queries (scaled), unnormalized outputs, one chunk's scores and, per head,
// the running peak, total (kept as a vector of lane sums until the end) and this chunk's correction.
struct RowState {
  float *query, *acc, *scores, *peak, *total, *correction;
};

RowState row_state(int64_t heads, int64_t head_dim) {
  const int64_t padded = (heads + kLanes - 1) / kLanes * kLanes;
  float *p = scratch(2 * heads * head_dim + heads * (kDecodeChunk + kLanes) + 2 * padded);
  RowState s;
  s.query = p, p += heads * head_dim;
  s.acc = p, p += heads * head_dim;
  s.scores = p, p += heads * kDecodeChunk;
  s.total = p, p += heads * kLanes;
  s.peak = p, s.correction = p + padded;
  return s;
}

// scores[h][j] = q_h . k_j for HB heads and the chunk's n keys (rows in `keys`), in tiles of HB heads x
// kKeyTile keys whose accumulators run along D.
template <int64_t HB, class C>
void row_scores(const float *query, const C *const *keys, int64_t offset, int64_t n, int64_t dim, float *scores) {
  for (int64_t j = 0; j < n; j += kKeyTile) {
    const C *k[kKeyTile];
    for (int64_t i = 0; i < kKeyTile; ++i) k[i] = keys[std::min(j + i, n - 1)] + offset;  // past n: masked later
    f32x8 acc[HB][kKeyTile] = {};
    for (int64_t d = 0; d < dim; d += kLanes) {
      f32x8 q[HB];
      for (int64_t h = 0; h < HB; ++h) q[h] = load8(query + h * dim + d);
      for (int64_t i = 0; i < kKeyTile; ++i) {
        const f32x8 key = load8(k[i] + d);
        for (int64_t h = 0; h < HB; ++h) acc[h][i] += q[h] * key;
      }
    }
    for (int64_t h = 0; h < HB; ++h) store_sums4(acc[h], scores + h * kDecodeChunk + j);
  }
}

// acc_h = acc_h * correction_h + sum_j p[h][j] v_j for HB heads, in tiles of HB heads x W vectors of D.
template <int64_t HB, int64_t W, class C>
void row_values(const RowState &s, int64_t head, const C *const *values, int64_t offset, int64_t n, int64_t dim) {
  for (int64_t d = 0; d < dim; d += W * kLanes) {
    f32x8 tile[HB][W];
    for (int64_t h = 0; h < HB; ++h)
      for (int64_t w = 0; w < W; ++w) tile[h][w] = load8(s.acc + (head + h) * dim + d + w * kLanes) * s.correction[head + h];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t w = 0; w < W; ++w) {
        const f32x8 v = load8(values[j] + offset + d + w * kLanes);
        for (int64_t h = 0; h < HB; ++h) tile[h][w] += s.scores[(head + h) * kDecodeChunk + j] * v;
      }
    for (int64_t h = 0; h < HB; ++h)
      for (int64_t w = 0; w < W; ++w) store8(s.acc + (head + h) * dim + d + w * kLanes, tile[h][w]);
  }
}

// Online softmax of every head over the chunk's n keys: scores become exp(score - running peak) (0 past
// n), `correction[h]` rescales what head h accumulated before.
void row_softmax(const RowState &s, int64_t heads, int64_t n) {
  const f32x8 lane = {0, 1, 2, 3, 4, 5, 6, 7};
  float *const top = s.correction;  // this chunk's peaks, until the corrections replace them
  for (int64_t h = 0; h < heads; ++h) {
    f32x8 best = f32x8{} - INFINITY;
    for (int64_t v = 0; v < kDecodeChunk; v += kLanes) {
      f32x8 score = load8(s.scores + h * kDecodeChunk + v);
      score = lane + static_cast<float>(v) < static_cast<float>(n) ? score : f32x8{} - INFINITY;
      store8(s.scores + h * kDecodeChunk + v, score);
      best = score > best ? score : best;
    }
    top[h] = std::max(s.peak[h], max_of(best));
  }
  for (int64_t h = 0; h < heads; h += kLanes) {  // corrections in vectors of heads
    const f32x8 peak = load8(s.peak + h), next = load8(top + h);
    store8(s.peak + h, next);
    store8(s.correction + h, exp8(peak - next));
  }
  for (int64_t h = 0; h < heads; ++h) {
    f32x8 total = load8(s.total + h * kLanes) * s.correction[h];
    for (int64_t v = 0; v < kDecodeChunk; v += kLanes) {
      float *row = s.scores + h * kDecodeChunk + v;
      const f32x8 p = exp8(load8(row) - s.peak[h]);
      store8(row, p);
      total += p;
    }
    store8(s.total + h * kLanes, total);
  }
}

// Runs body(head, HB) over head tiles of a kv head's `group` heads starting at `first`.
template <class Body>
void for_head_tiles(int64_t first, int64_t group, const Body &body) {
  for (int64_t g = 0; g < group; g += kHeadTile) {
    const int64_t left = group - g;
    if (left >= 3) {
      body(first + g, std::integral_constant<int64_t, 3>{});
    } else if (left == 2) {
      body(first + g, std::integral_constant<int64_t, 2>{});
    } else {
      body(first + g, std::integral_constant<int64_t, 1>{});
    }
  }
}

// -- int8 decode rows on AVX-512 VNNI -------------------------------------------------------------
// Widening every int8 key to float costs more than reading it, so with VNNI the scores stay integer:
// each head's query (K's scale already folded in) is quantized to int8 in kQueryLevels levels, each
// level quantizing what the ones before left over (q = sum_l step_l q_l, relative error ~ 254^-levels,
// float32's own for 3), and a score is sum_l step_l (q_l . k) from exact int32 dot products, vpdpbusd
// taking 64 key bytes at a time. vpdpbusd multiplies unsigned by signed bytes: keys are read as k + 128
// (their sign bit flipped), and each level's accumulator starts at -128 sum(q_l) to take that off again.
// A chunk's 16 key lines are transposed to 16 vectors of one 4-channel group of all 16 keys, so a
// vpdpbusd against a broadcast query group yields 16 keys' partial scores and needs no horizontal sum.
// The library is built for the machine it runs on (build.py: -march=native, CPU flags in the cache key),
// so CPUs without VNNI compile the float path below instead.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PG_INT8_VNNI 1
constexpr int64_t kQueryLevels = 3;
constexpr int64_t kLineBytes = 64;  // one zmm of key bytes: 16 groups of 4 channels
static_assert(kDecodeChunk == 16, "a chunk's keys are one vector of int32 scores");

// One decode row's query in int8 levels: q[head][level][d] (d padded with zeros to whole lines),
// step[head][level], and start[head][level] = -128 sum_d q_l[d].
struct Int8Query {
  const int8_t *q;
  const float *step;
  const int32_t *start;
  int64_t padded_dim;
};

Int8Query int8_query(const float *query, int64_t heads, int64_t dim) {
  const int64_t padded = (dim + kLineBytes - 1) / kLineBytes * kLineBytes;
  thread_local std::vector<int8_t> levels;
  thread_local std::vector<float> steps;  // then what the levels so far leave of the query
  thread_local std::vector<int32_t> starts;
  levels.assign(heads * kQueryLevels * padded, 0);
  steps.resize(heads * kQueryLevels + dim);
  starts.resize(heads * kQueryLevels);
  float *left = steps.data() + heads * kQueryLevels;
  // In vectors of 8 channels (head_dim is a multiple of 8): once per decode row, but scalar it showed in the profile.
  const __m256 limit = _mm256_set1_ps(127.f), sign = _mm256_set1_ps(-0.f);
  for (int64_t h = 0; h < heads; ++h) {
    std::copy(query + h * dim, query + (h + 1) * dim, left);
    for (int64_t l = 0; l < kQueryLevels; ++l) {
      __m256 peak = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += kLanes) peak = _mm256_max_ps(peak, _mm256_andnot_ps(sign, _mm256_loadu_ps(left + d)));
      float top = 0.f;
      for (int64_t i = 0; i < kLanes; ++i) top = std::max(top, peak[i]);
      const float step = top / 127.f, inv = top > 0.f ? 127.f / top : 0.f;
      int8_t *q = levels.data() + (h * kQueryLevels + l) * padded;
      __m256i sum = _mm256_setzero_si256();
      for (int64_t d = 0; d < dim; d += kLanes) {
        const __m256 x = _mm256_loadu_ps(left + d);
        // clamp, then round half to even (the MXCSR default): the same integers as clamp(nearbyint(x)).
        const __m256i code = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(inv)),
                                                                           -limit), limit));
        _mm_storel_epi64(reinterpret_cast<__m128i *>(q + d), _mm256_cvtepi32_epi8(code));
        sum = _mm256_add_epi32(sum, code);
        _mm256_storeu_ps(left + d, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(code), _mm256_set1_ps(step), x));
      }
      int32_t lanes[kLanes], total = 0;
      _mm256_storeu_si256(reinterpret_cast<__m256i *>(lanes), sum);
      for (const int32_t lane : lanes) total += lane;
      steps[h * kQueryLevels + l] = step;
      starts[h * kQueryLevels + l] = -128 * total;
    }
  }
  return {levels.data(), steps.data(), starts.data(), padded};
}

// t[g] = [r[0].g, ..., r[15].g]: the 16 x 16 transpose of 32-bit groups (unpack 32, unpack 64, two
// 128-bit shuffles); the last stage's outputs land at groups e, 8 + e, 4 + e, 12 + e.
inline void transpose_groups(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  for (int b = 0; b < 16; b += 4) {  // u[b + e]: lane L holds group 4L + e of keys b..b+3
    u[b] = _mm512_unpacklo_epi64(t[b], t[b + 2]), u[b + 1] = _mm512_unpackhi_epi64(t[b], t[b + 2]);
    u[b + 2] = _mm512_unpacklo_epi64(t[b + 1], t[b + 3]), u[b + 3] = _mm512_unpackhi_epi64(t[b + 1], t[b + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88), w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xdd);
    r[e] = _mm512_shuffle_i32x4(v0, w0, 0x88), r[8 + e] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[4 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88), r[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

// scores[h][j] = q_h . k_j for HB heads from `head` and the chunk's n keys (rows past n repeat the last:
// masked later), in int32 per query level, then combined in float.
template <int64_t HB>
void int8_scores(const Int8Query &query, int64_t head, const int8_t *const *keys, int64_t offset, int64_t n,
                 int64_t dim, float *scores) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[HB][kQueryLevels];
  for (int64_t h = 0; h < HB; ++h)
    for (int64_t l = 0; l < kQueryLevels; ++l) acc[h][l] = _mm512_set1_epi32(query.start[(head + h) * kQueryLevels + l]);
  for (int64_t d = 0; d < dim; d += kLineBytes) {
    const __mmask64 mask = dim - d >= kLineBytes ? ~__mmask64{0} : (__mmask64{1} << (dim - d)) - 1;
    __m512i t[kDecodeChunk];
    for (int64_t j = 0; j < kDecodeChunk; ++j)
      t[j] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, keys[std::min(j, n - 1)] + offset + d), flip);
    transpose_groups(t);
    for (int64_t g = 0; g < kDecodeChunk; ++g)
      for (int64_t h = 0; h < HB; ++h)
        for (int64_t l = 0; l < kQueryLevels; ++l) {
          int32_t group;
          std::memcpy(&group, query.q + ((head + h) * kQueryLevels + l) * query.padded_dim + d + 4 * g, sizeof group);
          acc[h][l] = _mm512_dpbusd_epi32(acc[h][l], t[g], _mm512_set1_epi32(group));
        }
  }
  for (int64_t h = 0; h < HB; ++h) {
    const float *step = query.step + (head + h) * kQueryLevels;
    __m512 score = _mm512_setzero_ps();
    for (int64_t l = 0; l < kQueryLevels; ++l)
      score = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][l]), _mm512_set1_ps(step[l]), score);
    _mm512_storeu_ps(scores + h * kDecodeChunk, score);
  }
}
#endif

// One query row (every head, `stride`-free: query and out point at the row) against keys [begin, end),
// all visible. A split row's part leaves its softmax state in `partial` (see Partials) instead.
template <class Rows>
void attend_row(const float *query, float *out, const Rows &kv, const pg_attention_dims &dims, int64_t begin,
                int64_t end, float *partial, const float *k_scale) {
  const int64_t heads = dims.head_num, group = heads / dims.kv_head_num, dim = dims.head_dim;
  const RowState s = row_state(heads, dim);
  const int64_t padded = (heads + kLanes - 1) / kLanes * kLanes;
  for (int64_t h = 0; h < heads; ++h) {  // per head, so no division per element finds a head's K scales
    const float *q = query + h * dim, *scale = k_scale ? k_scale + h / group * dim : nullptr;
    float *scaled = s.query + h * dim;
    if (scale) {
      for (int64_t d = 0; d < dim; ++d) scaled[d] = q[d] * dims.qk_scale * scale[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) scaled[d] = q[d] * dims.qk_scale;
    }
  }
  std::fill(s.acc, s.acc + heads * dim, 0.f);
  std::fill(s.total, s.total + heads * kLanes, 0.f);
  std::fill(s.peak, s.peak + padded, -INFINITY);
  std::fill(s.correction, s.correction + padded, -INFINITY);
#ifdef PG_INT8_VNNI
  Int8Query int8{};
  if constexpr (std::is_same_v<typename Rows::Elem, int8_t>) int8 = int8_query(s.query, heads, dim);
#endif
  const int64_t width = dims.kv_head_num * dim;
  const typename Rows::Elem *keys[kDecodeChunk], *values[kDecodeChunk];
  for (int64_t j0 = begin; j0 < end; j0 += kDecodeChunk) {
    const int64_t n = std::min(kDecodeChunk, end - j0);
    prefetch(kv, j0 + kDecodeChunk, std::min(end, j0 + 2 * kDecodeChunk), 0, width);
    for (int64_t j = 0; j < n; ++j) keys[j] = kv.k(j0 + j), values[j] = kv.v(j0 + j);
    for (int64_t k = 0; k < dims.kv_head_num; ++k)
      for_head_tiles(k * group, group, [&](int64_t head, auto tile) {
#ifdef PG_INT8_VNNI
        if constexpr (std::is_same_v<typename Rows::Elem, int8_t>) {
          int8_scores<decltype(tile)::value>(int8, head, keys, k * dim, n, dim, s.scores + head * kDecodeChunk);
          return;
        }
#endif
        row_scores<decltype(tile)::value>(s.query + head * dim, keys, k * dim, n, dim, s.scores + head * kDecodeChunk);
      });
    row_softmax(s, heads, n);
    for (int64_t k = 0; k < dims.kv_head_num; ++k)
      for_head_tiles(k * group, group, [&](int64_t head, auto tile) {
        if (dim % (4 * kLanes)) {
          row_values<decltype(tile)::value, 1>(s, head, values, k * dim, n, dim);
        } else {
          row_values<decltype(tile)::value, 4>(s, head, values, k * dim, n, dim);
        }
      });
  }
  for (int64_t h = 0; h < heads; ++h) {
    const f32x8 lanes = load8(s.total + h * kLanes);
    float total = 0.f;
    for (int64_t i = 0; i < kLanes; ++i) total += lanes[i];
    const float *acc = s.acc + h * dim;
    if (partial) {
      float *state = partial + h * (dim + 2);
      std::copy(acc, acc + dim, state);
      state[dim] = s.peak[h], state[dim + 1] = total;
      continue;
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = acc[d] * inv;
  }
}

int check_heads(const pg_attention_dims &dims) {
  if (dims.head_num <= 0 || dims.kv_head_num <= 0 || dims.head_num % dims.kv_head_num)
    return fail("head_num " + std::to_string(dims.head_num) + " must be a positive multiple of kv_head_num " +
                std::to_string(dims.kv_head_num));
  if (dims.head_dim <= 0 || dims.head_dim % kLanes)
    return fail("head_dim " + std::to_string(dims.head_dim) + " must be a positive multiple of " + std::to_string(kLanes));
  return 0;
}

int check_cu(const int32_t *cu, int64_t batch, int64_t tokens) {
  if (cu[0] < 0 || cu[batch] > tokens) return fail("cu_seqlens_q must lie within [0, tokens]");
  for (int64_t b = 0; b < batch; ++b)
    if (cu[b + 1] < cu[b]) return fail("cu_seqlens_q must be non-decreasing (at sequence " + std::to_string(b) + ")");
  return 0;
}

// Rows outside [cu[0], cu[batch]) are padding: zero them, as the references do.
void zero_padding(float *out, const int32_t *cu, int64_t batch, int64_t tokens, int64_t width) {
  std::memset(out, 0, sizeof(float) * cu[0] * width);
  std::memset(out + cu[batch] * width, 0, sizeof(float) * (tokens - cu[batch]) * width);
}

// A work item: a prefill tile of rows of one sequence against kv head `kv_head` (see TileShape), or
// one row against every kv head and keys [key_begin, key_end) (attend_row).
struct Item {
  int64_t seq, first_row, rows, kv_head, key_begin, key_end;
  int64_t part;  // >= 0: one of `parts` key ranges of a split decode row, its slot in Partials
  int64_t parts;
};

constexpr int64_t kMaxParts = 8;     // a decode row's keys are split into at most this many parts
constexpr int64_t kSplitKeys = 256;  // keys per part, at least

// Every sequence's query rows cut into tiles of one sequence each. A prefill tile is one item per kv
// head (parallel work for long prompts); a decode row is one item over all kv heads, so each key and
// value row is read whole and once, in order (decode is bound by moving the context). A decode row's
// keys are split into parts the pool runs at once (single-stream decode has one row), their softmax
// states merged afterwards (merge_parts); `split_parts` counts them.
// Batch invariance (docs/performance.md, "Batch invariance"): how a row is computed depends on that row alone,
// never on the other rows of the step. The parts of a decode row follow from its own context length, and every
// row of a sequence with several queries is a tile row (attend_tile), a tile of one row included, so a prompt
// row gives the same result in any chunking and any tile; only a sequence with one query is a decode row.
template <class RowsOf>
const std::vector<Item> &items_of(const int32_t *cu, int64_t batch, int64_t kv_heads, RowsOf rows_of,
                                  int64_t &split_parts) {
  thread_local std::vector<Item> items;
  items.clear();
  int64_t next_part = 0;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = cu[b]; r < cu[b + 1]; r += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, cu[b + 1] - r), keys = rows_of(b, r).second + rows;
      if (cu[b + 1] - cu[b] > 1) {
        for (int64_t k = 0; k < kv_heads; ++k) items.push_back({b, r, rows, k, 0, keys, -1, 1});
        continue;
      }
      const int64_t parts = std::max<int64_t>(1, std::min(kMaxParts, keys / kSplitKeys));
      for (int64_t p = 0; p < parts; ++p)
        items.push_back({b, r, 1, 0, keys * p / parts, keys * (p + 1) / parts, parts > 1 ? next_part + p : -1, parts});
      next_part += parts > 1 ? parts : 0;
    }
  split_parts = next_part;
  return items;
}

// Per part of a split decode row, per query head: acc [D] (unnormalized), peak, total.
using Partials = std::vector<float>;

// out = sum_p e^(peak_p - m) acc_p / sum_p e^(peak_p - m) total_p over each split row's parts (m: their max).
void merge_parts(const std::vector<Item> &items, const Partials &partials, float *out, int64_t q_width,
                 int64_t heads, int64_t dim) {
  for (const Item &item : items) {
    if (item.part < 0 || item.key_begin != 0) continue;  // each split row once, at its first part
    for (int64_t h = 0; h < heads; ++h) {
      const auto state = [&](int64_t p) { return partials.data() + ((item.part + p) * heads + h) * (dim + 2); };
      float top = -INFINITY;
      for (int64_t p = 0; p < item.parts; ++p) top = std::max(top, state(p)[dim]);
      float *o = out + item.first_row * q_width + h * dim;
      std::fill(o, o + dim, 0.f);
      float total = 0.f;
      for (int64_t p = 0; p < item.parts; ++p) {
        const float weight = std::exp(state(p)[dim] - top);
        total += weight * state(p)[dim + 1];
        for (int64_t d = 0; d < dim; ++d) o[d] += weight * state(p)[d];
      }
      for (int64_t d = 0; d < dim; ++d) o[d] /= total;
    }
  }
}

// int8 caches: out = (out - v_offset) * v_scale per channel of each head's kv head, on every real row.
void dequantize_values(float *out, const int32_t *cu, int64_t batch, const pg_attention_dims &dims,
                       const float *v_scale, const int32_t *v_offset) {
  const int64_t group = dims.head_num / dims.kv_head_num, dim = dims.head_dim, width = dims.head_num * dim;
  for (int64_t r = cu[0]; r < cu[batch]; ++r)
    for (int64_t h = 0; h < dims.head_num; ++h) {
      float *o = out + r * width + h * dim;
      const int64_t channel = h / group * dim;
      for (int64_t d = 0; d < dim; ++d)
        o[d] = (o[d] - static_cast<float>(v_offset[channel + d])) * v_scale[channel + d];
    }
}

// Attention for every item, in parallel. `rows_of(b, r)` gives the K/V rows of sequence b and the last
// key index its packed row r may see. `k_scale` (int8 caches, else null): K's per-channel scales.
template <class RowsOf>
void for_each_item(const float *query, float *out, const int32_t *cu, int64_t batch, int64_t tokens,
                   const pg_attention_dims &dims, const pg_runner *runner, RowsOf rows_of,
                   const float *k_scale = nullptr) {
  const int64_t group = dims.head_num / dims.kv_head_num, q_width = dims.head_num * dims.head_dim;
  zero_padding(out, cu, batch, tokens, q_width);
  int64_t split_parts;
  const std::vector<Item> &items = items_of(cu, batch, dims.kv_head_num, rows_of, split_parts);
  thread_local Partials partials;
  partials.resize(split_parts * dims.head_num * (dims.head_dim + 2));
  float *const partial_base = partials.data();  // the pool's threads each have their own thread_locals
  pg::parallel_for(runner, static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item &item = items[i];
    const auto [rows, first_limit] = rows_of(item.seq, item.first_row);
    if (cu[item.seq + 1] - cu[item.seq] == 1) {
      float *partial = item.part < 0 ? nullptr : partial_base + item.part * dims.head_num * (dims.head_dim + 2);
      const int64_t row = item.first_row * q_width;
      attend_row(query + row, out + row, rows, dims, item.key_begin, item.key_end, partial, k_scale);
      return;
    }
    const TileShape shape{item.rows, q_width, first_limit, group, dims.head_dim, dims.qk_scale};
    const int64_t offset = item.first_row * q_width + item.kv_head * group * dims.head_dim;
    attend_tile(query + offset, out + offset, shape, rows, item.kv_head * dims.head_dim,
                k_scale ? k_scale + item.kv_head * dims.head_dim : nullptr);
  });
  merge_parts(items, partials, out, q_width, dims.head_num, dims.head_dim);
}

// Row t of key/value into slot slot_mapping[t], converted to the pools' element type C.
template <class C>
void write_rows(const float *key, const float *value, C *k_cache, C *v_cache, const int64_t *slot_mapping,
                int64_t tokens, int64_t width, const pg_runner *runner) {
  pg::for_rows(runner, tokens, 2 * width, [&](int64_t t) {
    for (const auto &[src, dst] : {std::pair{key, k_cache}, std::pair{value, v_cache}}) {
      const float *x = src + t * width;
      C *row = dst + slot_mapping[t] * width;
      if constexpr (std::is_same_v<C, float>) {
        std::memcpy(row, x, sizeof(float) * width);
      } else {
        for (int64_t c = 0; c < width; ++c) pg::from_float(x[c], row[c]);
      }
    }
  });
}

// clamp(round(x * inv_scale + offset)), rounding half to even. Not contracted into an FMA, so the result
// is bit-equal to the references' separate multiply and add.
__attribute__((optimize("fp-contract=off"))) void quantize_row(const float *x, const float *inv_scale,
                                                               const int32_t *offset, int8_t *row, int64_t width) {
  for (int64_t c = 0; c < width; ++c) {
    const float q = std::nearbyint(x[c] * inv_scale[c] + static_cast<float>(offset[c]));
    row[c] = static_cast<int8_t>(std::clamp(q, -128.f, 127.f));
  }
}

int check_int8(const pg_kv_cache &cache, bool attention) {
  const bool missing = attention ? !cache.k_scale || !cache.v_scale || !cache.v_offset
                                 : !cache.k_inv_scale || !cache.v_inv_scale || !cache.k_offset || !cache.v_offset;
  return missing ? fail(std::string("an int8 KV cache needs its per-channel ") +
                        (attention ? "k_scale, v_scale and v_offset" : "k_inv_scale, k_offset, v_inv_scale and v_offset"))
                 : 0;
}

}  // namespace

extern "C" {

int pg_reshape_and_cache(const float *key, const float *value, void *k_cache, void *v_cache,
                         const int64_t *slot_mapping, int64_t tokens, int64_t width, int64_t num_slots,
                         pg_kv_cache cache, const pg_runner *runner) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots)
      return fail("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot_mapping[t]) +
                  " is outside the pool of " + std::to_string(num_slots) + " slots");
  switch (cache.dtype) {
    case PG_CACHE_FLOAT32:
      write_rows(key, value, static_cast<float *>(k_cache), static_cast<float *>(v_cache), slot_mapping, tokens, width, runner);
      return 0;
    case PG_CACHE_BFLOAT16:
      write_rows(key, value, static_cast<bf16 *>(k_cache), static_cast<bf16 *>(v_cache), slot_mapping, tokens, width, runner);
      return 0;
    case PG_CACHE_FLOAT16:
      write_rows(key, value, static_cast<_Float16 *>(k_cache), static_cast<_Float16 *>(v_cache), slot_mapping, tokens,
                 width, runner);
      return 0;
    case PG_CACHE_INT8: {
      if (int rc = check_int8(cache, false)) return rc;
      auto *k = static_cast<int8_t *>(k_cache), *v = static_cast<int8_t *>(v_cache);
      pg::for_rows(runner, tokens, 2 * width, [&](int64_t t) {
        quantize_row(key + t * width, cache.k_inv_scale, cache.k_offset, k + slot_mapping[t] * width, width);
        quantize_row(value + t * width, cache.v_inv_scale, cache.v_offset, v + slot_mapping[t] * width, width);
      });
      return 0;
    }
  }
  return fail("unknown KV cache dtype " + std::to_string(cache.dtype));
}

int pg_paged_attention(const float *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                       const int32_t *context_lens, const int32_t *cu_seqlens_q, float *out, int64_t tokens,
                       int64_t batch, int64_t max_blocks, int64_t num_slots, pg_attention_dims dims,
                       int64_t block_size, pg_kv_cache cache, const pg_runner *runner) {
  if (int rc = check_heads(dims)) return rc;
  if (int rc = check_cu(cu_seqlens_q, batch, tokens)) return rc;
  if (cache.dtype == PG_CACHE_INT8)
    if (int rc = check_int8(cache, true)) return rc;
  const int64_t num_blocks = num_slots / block_size;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = cu_seqlens_q[b + 1] - cu_seqlens_q[b], ctx = context_lens[b];
    if (q_len == 0) continue;
    if (ctx < q_len || ctx > max_blocks * block_size)
      return fail("context_lens[" + std::to_string(b) + "] = " + std::to_string(ctx) + " must cover its " +
                  std::to_string(q_len) + " queries and fit " + std::to_string(max_blocks) + " blocks");
    for (int64_t i = 0; i < (ctx + block_size - 1) / block_size; ++i) {
      const int32_t block = block_tables[b * max_blocks + i];
      if (block < 0 || block >= num_blocks)
        return fail("block_tables[" + std::to_string(b) + ", " + std::to_string(i) + "] = " + std::to_string(block) +
                    " is outside the pool of " + std::to_string(num_blocks) + " blocks");
    }
  }
  const int64_t kv_width = dims.kv_head_num * dims.head_dim;
  const auto attend = [&](const auto *k, const auto *v, const float *k_scale) {
    using C = std::remove_cv_t<std::remove_pointer_t<decltype(k)>>;
    for_each_item(query, out, cu_seqlens_q, batch, tokens, dims, runner, [&](int64_t b, int64_t r) {
      const PagedRows<C> rows{k, v, block_tables + b * max_blocks, block_size, kv_width};
      return std::make_pair(rows, context_lens[b] - (cu_seqlens_q[b + 1] - r));  // position of query row r
    }, k_scale);
  };
  switch (cache.dtype) {
    case PG_CACHE_FLOAT32:
      attend(static_cast<const float *>(k_cache), static_cast<const float *>(v_cache), nullptr);
      return 0;
    case PG_CACHE_BFLOAT16:
      attend(static_cast<const bf16 *>(k_cache), static_cast<const bf16 *>(v_cache), nullptr);
      return 0;
    case PG_CACHE_FLOAT16:
      attend(static_cast<const _Float16 *>(k_cache), static_cast<const _Float16 *>(v_cache), nullptr);
      return 0;
    case PG_CACHE_INT8:
      attend(static_cast<const int8_t *>(k_cache), static_cast<const int8_t *>(v_cache), cache.k_scale);
      dequantize_values(out, cu_seqlens_q, batch, dims, cache.v_scale, cache.v_offset);
      return 0;
  }
  return fail("unknown KV cache dtype " + std::to_string(cache.dtype));
}

int pg_self_attention(const float *query, const float *key, const float *value, const int32_t *cu_seqlens_q,
                      float *out, int64_t tokens, int64_t batch, pg_attention_dims dims, const pg_runner *runner) {
  if (int rc = check_heads(dims)) return rc;
  if (int rc = check_cu(cu_seqlens_q, batch, tokens)) return rc;
  const int64_t kv_width = dims.kv_head_num * dims.head_dim;
  for_each_item(query, out, cu_seqlens_q, batch, tokens, dims, runner, [&](int64_t b, int64_t r) {
    return std::make_pair(PackedRows{key, value, cu_seqlens_q[b], kv_width}, r - cu_seqlens_q[b]);
  });
  return 0;
}

}  // extern "C"
