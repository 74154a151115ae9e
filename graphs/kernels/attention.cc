// The fused ops of graphs/ops as C++ kernels (float32, CPU): ReshapeAndCache, PagedAttention, SelfAttention.
//
// Contracts are those of the numpy references in graphs/ops: pools are [num_slots, kv_heads * head_dim]
// rows, block tables map a sequence's block index to a pool block, and query rows are packed per
// cu_seqlens_q (sequence b owns rows cu[b]..cu[b+1]); rows outside every sequence come back as zeros.
// Each query row and kv head is one work item (OpenMP), so the G query heads of a group read each
// K/V row once. Every index is checked before anything is read or written: a bad slot or block id
// is an error, never a write outside the pool.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

thread_local std::string last_error;
std::atomic<int> thread_limit{0};  // 0: OpenMP's default (OMP_NUM_THREADS or all cores)

int threads() {
  const int limit = thread_limit.load(std::memory_order_relaxed);
  return limit > 0 ? limit : omp_get_max_threads();
}

int fail(const std::string &message) {
  last_error = message;
  std::fprintf(stderr, "pagedgraph kernel: %s\n", message.c_str());
  return 1;
}

// K/V rows of one sequence, addressed by position in that sequence.
struct PagedRows {
  const float *k_cache, *v_cache;
  const int32_t *table;
  int64_t block_size, width;
  int64_t row(int64_t j) const { return (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * width; }
  const float *k(int64_t j) const { return k_cache + row(j); }
  const float *v(int64_t j) const { return v_cache + row(j); }
};

struct PackedRows {
  const float *key, *value;
  int64_t first, width;
  const float *k(int64_t j) const { return key + (first + j) * width; }
  const float *v(int64_t j) const { return value + (first + j) * width; }
};

// One query row, the `group` heads that share kv head `kv_head`: keys 0..limit inclusive.
template <class Rows>
void attend(const float *q, float *out, const Rows &rows, int64_t limit, int64_t kv_head, int64_t group,
            int64_t head_dim, float scale) {
  thread_local std::vector<float> scores;
  const int64_t keys = limit + 1, kv_off = kv_head * head_dim;
  if (static_cast<int64_t>(scores.size()) < group * keys) scores.resize(group * keys);
  for (int64_t j = 0; j < keys; ++j) {
    const float *k = rows.k(j) + kv_off;
    for (int64_t g = 0; g < group; ++g) {
      const float *qg = q + g * head_dim;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
      scores[g * keys + j] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float *s = scores.data() + g * keys;
    const float peak = *std::max_element(s, s + keys);
    float total = 0.f;
    for (int64_t j = 0; j < keys; ++j) total += (s[j] = std::exp(s[j] - peak));
    const float inv = 1.f / total;
    for (int64_t j = 0; j < keys; ++j) s[j] *= inv;
    std::fill(out + g * head_dim, out + (g + 1) * head_dim, 0.f);
  }
  for (int64_t j = 0; j < keys; ++j) {
    const float *v = rows.v(j) + kv_off;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * keys + j];
      float *o = out + g * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * v[d];
    }
  }
}

int check_heads(const pg_attention_dims &dims) {
  if (dims.head_num <= 0 || dims.kv_head_num <= 0 || dims.head_num % dims.kv_head_num)
    return fail("head_num " + std::to_string(dims.head_num) + " must be a positive multiple of kv_head_num " +
                std::to_string(dims.kv_head_num));
  if (dims.head_dim <= 0) return fail("head_dim must be positive");
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

// The sequence owning packed row r: the last b with cu[b] <= r (empty sequences skipped).
int64_t sequence_of(const int32_t *cu, int64_t batch, int64_t r) {
  return std::upper_bound(cu + 1, cu + batch + 1, r) - (cu + 1);
}

// Attention for every real query row and kv head, in parallel. `rows_of(r, b)` gives the K/V rows of
// sequence b and the last key index packed row r may see.
template <class RowsOf>
void for_each_query(const float *query, float *out, const int32_t *cu, int64_t batch, int64_t tokens,
                    const pg_attention_dims &dims, RowsOf rows_of) {
  const int64_t group = dims.head_num / dims.kv_head_num, q_width = dims.head_num * dims.head_dim;
  zero_padding(out, cu, batch, tokens, q_width);
  const int64_t first = cu[0], items = (cu[batch] - first) * dims.kv_head_num;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads())
  for (int64_t item = 0; item < items; ++item) {
    const int64_t r = first + item / dims.kv_head_num, kv_head = item % dims.kv_head_num;
    const auto [rows, limit] = rows_of(r, sequence_of(cu, batch, r));
    const int64_t offset = r * q_width + kv_head * group * dims.head_dim;
    attend(query + offset, out + offset, rows, limit, kv_head, group, dims.head_dim, dims.qk_scale);
  }
}

}  // namespace

extern "C" {

const char *pg_last_error() { return last_error.c_str(); }

void pg_set_threads(int count) { thread_limit.store(count, std::memory_order_relaxed); }

int pg_reshape_and_cache(const float *key, const float *value, float *k_cache, float *v_cache,
                         const int64_t *slot_mapping, int64_t tokens, int64_t width, int64_t num_slots) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots)
      return fail("slot_mapping[" + std::to_string(t) + "] = " + std::to_string(slot_mapping[t]) +
                  " is outside the pool of " + std::to_string(num_slots) + " slots");
#pragma omp parallel for if (tokens * width > (1 << 16)) num_threads(threads())
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(k_cache + slot_mapping[t] * width, key + t * width, sizeof(float) * width);
    std::memcpy(v_cache + slot_mapping[t] * width, value + t * width, sizeof(float) * width);
  }
  return 0;
}

int pg_paged_attention(const float *query, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                       const int32_t *context_lens, const int32_t *cu_seqlens_q, float *out, int64_t tokens,
                       int64_t batch, int64_t max_blocks, int64_t num_slots, pg_attention_dims dims,
                       int64_t block_size) {
  if (int rc = check_heads(dims)) return rc;
  if (int rc = check_cu(cu_seqlens_q, batch, tokens)) return rc;
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
  for_each_query(query, out, cu_seqlens_q, batch, tokens, dims, [&](int64_t r, int64_t b) {
    const PagedRows rows{k_cache, v_cache, block_tables + b * max_blocks, block_size, kv_width};
    return std::make_pair(rows, context_lens[b] - (cu_seqlens_q[b + 1] - r));  // position of query row r
  });
  return 0;
}

int pg_self_attention(const float *query, const float *key, const float *value, const int32_t *cu_seqlens_q,
                      float *out, int64_t tokens, int64_t batch, pg_attention_dims dims) {
  if (int rc = check_heads(dims)) return rc;
  if (int rc = check_cu(cu_seqlens_q, batch, tokens)) return rc;
  const int64_t kv_width = dims.kv_head_num * dims.head_dim;
  for_each_query(query, out, cu_seqlens_q, batch, tokens, dims, [&](int64_t r, int64_t b) {
    return std::make_pair(PackedRows{key, value, cu_seqlens_q[b], kv_width}, r - cu_seqlens_q[b]);
  });
  return 0;
}

}  // extern "C"
