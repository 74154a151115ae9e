// MindSpore `ops.Custom(func_type="aot")` entry points around the C API in kernels.h.
//
// MindSpore calls f(nparam, params, ndims, shapes, dtypes, stream, extra) with the inputs then the
// outputs. Attributes travel as trailing constant inputs (int64 dims, float32 scale), the way
// MindSpore's own PagedAttention stores head_num/scale_value in MINDIR, so no MindSpore header is
// needed. ReshapeAndCache writes its pool inputs in place (the Custom op carries side_effect_mem)
// and returns a one-element token that orders later readers after the write.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>

#include "common.h"
#include "kernels.h"

namespace {

bool dtype_is(const char **dtypes, int i, const char *want) { return std::strcmp(dtypes[i], want) == 0; }

int check_dtypes(const char *op, const char **dtypes, std::initializer_list<const char *> want) {
  int i = 0;
  for (const char *w : want) {
    if (!dtype_is(dtypes, i, w)) {
      std::string message = std::string(op) + " input " + std::to_string(i) + " is " + dtypes[i] + ", expected " + w;
      std::fprintf(stderr, "pagedgraph kernel: %s\n", message.c_str());
      return 1;
    }
    ++i;
  }
  return 0;
}

// The attention dims from the constant inputs: int64 dims (head_num, kv_head_num, ..., head_dim last,
// `with_head_dim`; graphs exported before head_dim travelled have none: then from the query's width) and
// the float32 scale. Returns non-zero, with the error recorded, when head_dim and the query disagree.
int attention_dims(void **params, int64_t **shapes, int dims_at, bool with_head_dim, pg_attention_dims &out) {
  const int64_t *dims = static_cast<const int64_t *>(params[dims_at]);
  const float scale = *static_cast<const float *>(params[dims_at + 1]);
  const int64_t width = shapes[0][1];
  const int64_t head_dim = with_head_dim ? dims[shapes[dims_at][0] - 1] : dims[0] > 0 ? width / dims[0] : 0;
  if (dims[0] * head_dim != width)
    return pg::fail("query width " + std::to_string(width) + " is not head_num " + std::to_string(dims[0]) +
                   " * head_dim " + std::to_string(head_dim));
  out = pg_attention_dims{dims[0], dims[1], head_dim, scale};
  return 0;
}

}  // namespace

extern "C" {

// key, value [T, W]; k_cache, v_cache [S, W]; slot_mapping [T] int64 -> token [1] float32.
int ReshapeAndCache(int, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (check_dtypes("ReshapeAndCache", dtypes, {"float32", "float32", "float32", "float32", "int64"})) return 1;
  *static_cast<float *>(params[5]) = 0.f;
  return pg_reshape_and_cache(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                              static_cast<float *>(params[2]), static_cast<float *>(params[3]),
                              static_cast<const int64_t *>(params[4]), shapes[0][0], shapes[0][1], shapes[2][0],
                              pg_kv_cache{}, nullptr);
}

// query [T, H*D], k/v_cache [S, KV*D], block_tables [B, M], context_lens [B], cu_seqlens_q [B+1],
// dims int64 [head_num, kv_head_num, block_size, head_dim] (older graphs: no head_dim), scale float32 [1]
// -> out [T, H*D].
int PagedAttention(int, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (check_dtypes("PagedAttention", dtypes,
                   {"float32", "float32", "float32", "int32", "int32", "int32", "int64", "float32"}))
    return 1;
  const int64_t block_size = static_cast<const int64_t *>(params[6])[2];
  pg_attention_dims dims;
  if (attention_dims(params, shapes, 6, shapes[6][0] > 3, dims)) return 1;
  return pg_paged_attention(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                            static_cast<const float *>(params[2]), static_cast<const int32_t *>(params[3]),
                            static_cast<const int32_t *>(params[4]), static_cast<const int32_t *>(params[5]),
                            static_cast<float *>(params[8]), shapes[0][0], shapes[3][0], shapes[3][1], shapes[1][0],
                            dims, block_size, pg_kv_cache{}, nullptr);
}

// query [T, H*D], key/value [T, KV*D], cu_seqlens_q [B+1], dims int64 [head_num, kv_head_num, head_dim]
// (older graphs: no head_dim), scale float32 [1] -> out [T, H*D].
int SelfAttention(int, void **params, int *, int64_t **shapes, const char **dtypes, void *, void *) {
  if (check_dtypes("SelfAttention", dtypes, {"float32", "float32", "float32", "int32", "int64", "float32"})) return 1;
  pg_attention_dims dims;
  if (attention_dims(params, shapes, 4, shapes[4][0] > 2, dims)) return 1;
  return pg_self_attention(static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
                           static_cast<const float *>(params[2]), static_cast<const int32_t *>(params[3]),
                           static_cast<float *>(params[6]), shapes[0][0], shapes[3][0] - 1, dims, nullptr);
}

}  // extern "C"
