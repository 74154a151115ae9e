// C API of the pagedgraph kernels: plain C types, so ctypes (tests), the MindSpore AOT wrappers and
// the ONNX Runtime custom ops call the same functions. Each returns 0, or non-zero with pg_last_error() set.
#pragma once
#include <cstddef>
#include <cstdint>

extern "C" {

struct pg_attention_dims {
  int64_t head_num;
  int64_t kv_head_num;
  int64_t head_dim;
  float qk_scale;
};

const char *pg_last_error();

// Threads of every later kernel call in this process; 0 restores OpenMP's default.
void pg_set_threads(int count);

// A host's thread pool: runs body(ctx, item) once for every item in [0, items), concurrently, and
// returns when all are done. Passing one lets a kernel share its host's threads (ONNX Runtime's
// intra-op pool) instead of starting OpenMP's beside them; NULL means OpenMP (pg_set_threads).
struct pg_runner {
  void (*parallel_for)(void *pool, void (*body)(void *ctx, size_t item), void *ctx, size_t items);
  void *pool;
};

int pg_reshape_and_cache(const float *key, const float *value, float *k_cache, float *v_cache,
                         const int64_t *slot_mapping, int64_t tokens, int64_t width, int64_t num_slots,
                         const pg_runner *runner);

int pg_paged_attention(const float *query, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                       const int32_t *context_lens, const int32_t *cu_seqlens_q, float *out, int64_t tokens,
                       int64_t batch, int64_t max_blocks, int64_t num_slots, pg_attention_dims dims,
                       int64_t block_size, const pg_runner *runner);

int pg_self_attention(const float *query, const float *key, const float *value, const int32_t *cu_seqlens_q,
                      float *out, int64_t tokens, int64_t batch, pg_attention_dims dims, const pg_runner *runner);

// Rotate-half rope of x [tokens, heads * head_dim] with per-token cos/sin [tokens, head_dim] (halves
// duplicated, as graphs/rope_tables builds them) into out; head_dim a multiple of 16.
int pg_rope(const float *x, const float *cos, const float *sin, float *out, int64_t tokens, int64_t heads,
            int64_t head_dim, const pg_runner *runner);

// out [tokens, width] = silu(gate) * up for x = [gate | up] [tokens, 2 * width]; width a multiple of 8.
int pg_swiglu(const float *x, float *out, int64_t tokens, int64_t width, const pg_runner *runner);
}
