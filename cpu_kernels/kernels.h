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

// The pools' element type (graphs/kv_cache.py). Rows are written converted to it (int8: quantized per
// channel, clamp(round(x * inv_scale + offset))) and read back as float32 inside the attention
// ((q - offset) * scale, ATB's kDescale/kOffset and vDescale/vOffset).
enum pg_cache_dtype { PG_CACHE_FLOAT32 = 0, PG_CACHE_BFLOAT16 = 1, PG_CACHE_FLOAT16 = 2, PG_CACHE_INT8 = 3 };

// A layer's pools: their dtype and, for int8, the per-channel parameters, each [kv_heads * head_dim].
// A zero-initialised struct is a float32 cache.
struct pg_kv_cache {
  int32_t dtype;  // pg_cache_dtype
  const float *k_scale, *k_inv_scale, *v_scale, *v_inv_scale;
  const int32_t *k_offset, *v_offset;
};

int pg_reshape_and_cache(const float *key, const float *value, void *k_cache, void *v_cache,
                         const int64_t *slot_mapping, int64_t tokens, int64_t width, int64_t num_slots,
                         pg_kv_cache cache, const pg_runner *runner);

int pg_paged_attention(const float *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                       const int32_t *context_lens, const int32_t *cu_seqlens_q, float *out, int64_t tokens,
                       int64_t batch, int64_t max_blocks, int64_t num_slots, pg_attention_dims dims,
                       int64_t block_size, pg_kv_cache cache, const pg_runner *runner);

int pg_self_attention(const float *query, const float *key, const float *value, const int32_t *cu_seqlens_q,
                      float *out, int64_t tokens, int64_t batch, pg_attention_dims dims, const pg_runner *runner);

// Rotate-half rope of x [tokens, heads * head_dim] with per-token cos/sin [tokens, head_dim] (halves
// duplicated, as graphs/rope_tables builds them) into out; head_dim a multiple of 16.
int pg_rope(const float *x, const float *cos, const float *sin, float *out, int64_t tokens, int64_t heads,
            int64_t head_dim, const pg_runner *runner);

// out [tokens, width] = silu(gate) * up for x = [gate | up] [tokens, 2 * width]; width a multiple of 8.
int pg_swiglu(const float *x, float *out, int64_t tokens, int64_t width, const pg_runner *runner);

// out [tokens, n] = y + (x [tokens, k] summed over blocks of block_size) @ minimum_t [k / block_size, n]
// (the minimum term of a GGUF Q4_1 / Q4_K linear); at most 1,024 blocks. minimum_dtype is a pg_cache_dtype
// code: PG_CACHE_FLOAT16 or PG_CACHE_FLOAT32.
int pg_block_minimum(const float *y, const float *x, const void *minimum_t, int32_t minimum_dtype, float *out,
                     int64_t tokens, int64_t n, int64_t k, int64_t block_size, const pg_runner *runner);

// GroupedMatmul: y [m, n] = each expert group's rows of x [m, k] (group_list: counts for type 1, a running sum for
// type 0) times that expert's weight [n, k] of the stack [experts, n, k], float32 or (`bfloat16`) bfloat16 bits with
// x rounded to bfloat16; k a multiple of 16. Rows past the groups are zero; each element independent of the other
// rows (batch-invariant).
int pg_grouped_matmul(const float *x, const void *weight, int32_t bfloat16, const int64_t *group_list,
                      int64_t group_list_type, float *y, int64_t m, int64_t k, int64_t n, int64_t experts,
                      const pg_runner *runner);
// GroupedMatmul.block_quantized: y [m, n] = each expert group's rows of x [m, k] (group_list: counts for type 1,
// a running sum for type 0) times that expert's block-quantized weight, MatMulNBits' layout with a leading expert
// axis: codes [experts, n, k / block_size, block_size * bits / 8], scales [experts, n, blocks], zero_points
// [experts, n, Z] (bytes, or two 4-bit points a byte), minimum_t [experts, blocks, n] (minimum_dtype: a
// pg_cache_dtype code, PG_CACHE_FLOAT16 or PG_CACHE_FLOAT32); zero points and minima not `per_expert` hold one
// entry for every expert. Rows past the groups are zero. accuracy_level 0: float32 compute; 4: int8 inputs per
// chunk of 32 with VNNI where the CPU has it and the blocks are multiples of 32 (else float32). Each element
// independent of the other rows (batch-invariant).
int pg_grouped_matmul_nbits(const float *x, const uint8_t *codes, const float *scales, const uint8_t *zero_points,
                            int32_t zero_points_per_expert, const void *minimum_t, int32_t minimum_dtype,
                            int32_t minimum_per_expert, const int64_t *group_list, int64_t group_list_type, float *y,
                            int64_t m, int64_t k, int64_t n, int64_t experts, int64_t bits, int64_t block_size,
                            int32_t accuracy_level, const pg_runner *runner);
// Per-token int8 of x [tokens, k] (Linear.w8a8's input): row_scale [tokens] = max(max |x[t]|, 1e-8) / 127 and
// codes [tokens, k] = round_half_even(x / row_scale) + 128 (uint8, the ONNX body's exact values).
int pg_dynamic_quant(const float *x, uint8_t *codes, float *row_scale, int64_t tokens, int64_t k,
                     const pg_runner *runner);
}
