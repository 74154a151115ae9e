// ONNX Runtime custom ops of domain `atb`: PagedAttention, ReshapeAndCache, SelfAttention, Rope, SwiGLU,
// BlockMinimum, DynamicQuant and GroupedMatmulNBits, each ONE call into our kernels instead of the standard ops of
// its model-local function body (~25 and Ifs for an attention, 16 for a rope, 4 for a SwiGLU or a block minimum, 8
// for a per-token quantize, a loop dequantizing whole experts for the quantized grouped matmul);
// GroupedMatmul (float32 and bfloat16 experts), whose body loops over the experts in ORT; with oneDNN
// (PG_WITH_ONEDNN), Linear.bfloat16 too, whose body's Cast + Gemm would run ORT's float32 GEMM on widened weights
// (ORT has no bf16 GEMM on x86).
//
// ONNX Runtime prefers a registered kernel to a model-local function of the same domain and name, so
// exported graphs keep their portable bodies and registering this library is a pure speed-up. Only the
// C API is used: it is versioned, so a library built against an older header loads in a newer runtime.
// Kernels run on ORT's intra-op pool (KernelContext_ParallelFor), never on OpenMP threads competing
// with ORT's spinning workers. Bad inputs become an OrtStatus (ORT_INVALID_ARGUMENT), never a crash.
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "onnxruntime_c_api.h"
#ifdef PG_WITH_ONEDNN
#include "onednn_linear.h"
#endif

#if ORT_API_VERSION < 17
#error "onnxruntime_c_api.h predates ORT_API_VERSION 17 (KernelContext_ParallelFor): use onnxruntime 1.17 or newer"
#endif

#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    if (OrtStatus *status_ = (expr)) return status_; \
  } while (0)

namespace {

const OrtApi *api = nullptr;

constexpr auto F32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr auto F16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr auto I32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
constexpr auto I64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr auto BF16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
constexpr auto U8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
constexpr auto ANY = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // a KV pool: any cache dtype, read per call

OrtStatus *invalid(const std::string &message) { return api->CreateStatus(ORT_INVALID_ARGUMENT, message.c_str()); }

OrtStatus *kernel_status(int rc) { return rc ? invalid(pg_last_error()) : nullptr; }

// A tensor shape held inline: a step calls these kernels ~150 times, none of them allocates.
struct Shape {
  static constexpr size_t kMaxRank = 4;
  int64_t dims[kMaxRank] = {};
  size_t rank = 0;
  Shape() = default;
  Shape(std::initializer_list<int64_t> list) : rank(list.size()) { std::copy(list.begin(), list.end(), dims); }
  int64_t operator[](size_t i) const { return dims[i]; }
  size_t size() const { return rank; }
};

std::string shape_text(const Shape &shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// An input: its data, shape and element type. ORT has already checked the type against the op's
// declaration (ANY inputs: checked by the op). An absent optional input has no data.
template <class T>
struct Input {
  const T *data = nullptr;
  Shape shape;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
};

template <class T>
OrtStatus *get_input(OrtKernelContext *context, size_t index, Input<T> &out) {
  const OrtValue *value = nullptr;
  size_t count = 0;
  RETURN_IF_ERROR(api->KernelContext_GetInputCount(context, &count));
  if (index < count) RETURN_IF_ERROR(api->KernelContext_GetInput(context, index, &value));
  if (value == nullptr) return nullptr;  // an optional input left out
  OrtTensorTypeAndShapeInfo *info;
  RETURN_IF_ERROR(api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus *status = api->GetTensorElementType(info, &out.type);
  if (status == nullptr) status = api->GetDimensionsCount(info, &rank);
  if (status == nullptr && rank > Shape::kMaxRank)
    status = invalid("input " + std::to_string(index) + " has rank " + std::to_string(rank) + ", at most " +
                     std::to_string(Shape::kMaxRank) + " expected");
  if (status == nullptr) {
    out.shape.rank = rank;
    status = api->GetDimensions(info, out.shape.dims, rank);
  }
  api->ReleaseTensorTypeAndShapeInfo(info);
  RETURN_IF_ERROR(status);
  void *data;  // the C API has no const accessor; inputs are only read
  RETURN_IF_ERROR(api->GetTensorMutableData(const_cast<OrtValue *>(value), &data));
  out.data = static_cast<const T *>(data);
  return nullptr;
}

// The node's inputs 0, 1, ... into `inputs`, in order; the first failure is returned.
template <class... T>
OrtStatus *get_inputs(OrtKernelContext *context, Input<T> &...inputs) {
  size_t index = 0;
  OrtStatus *status = nullptr;
  ((status = status ? status : get_input(context, index++, inputs)), ...);
  return status;
}

template <class T>
OrtStatus *get_output(OrtKernelContext *context, size_t index, const Shape &shape, T *&out) {
  OrtValue *value;
  RETURN_IF_ERROR(api->KernelContext_GetOutput(context, index, shape.dims, shape.rank, &value));
  void *data;
  RETURN_IF_ERROR(api->GetTensorMutableData(value, &data));
  out = static_cast<T *>(data);
  return nullptr;
}

// `name` must have shape `want`; -1 in `want` matches any extent.
OrtStatus *check_shape(const char *name, const Shape &shape, const Shape &want) {
  bool ok = shape.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) ok = want[i] < 0 || shape[i] == want[i];
  if (ok) return nullptr;
  return invalid(std::string(name) + " has shape " + shape_text(shape) + ", expected " + shape_text(want));
}

// The pools' cache dtype (both the same type) and element size.
OrtStatus *cache_dtype(const Input<void> &k_cache, const Input<void> &v_cache, pg_kv_cache &cache, size_t &itemsize) {
  if (k_cache.type != v_cache.type) return invalid("k_cache and v_cache must have one element type");
  switch (k_cache.type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: cache.dtype = PG_CACHE_FLOAT32, itemsize = 4; return nullptr;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: cache.dtype = PG_CACHE_BFLOAT16, itemsize = 2; return nullptr;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: cache.dtype = PG_CACHE_FLOAT16, itemsize = 2; return nullptr;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: cache.dtype = PG_CACHE_INT8, itemsize = 1; return nullptr;
    default:
      return invalid("KV cache element type " + std::to_string(k_cache.type) +
                     " is not one of float32, bfloat16, float16, int8");
  }
}

// pg_runner over ORT's intra-op pool. Every item must run, so a refused ParallelFor runs them here.
void ort_parallel_for(void *pool, void (*body)(void *ctx, size_t item), void *ctx, size_t items) {
  const auto *context = static_cast<const OrtKernelContext *>(pool);
  if (OrtStatus *status = api->KernelContext_ParallelFor(context, body, items, 0, ctx)) {
    api->ReleaseStatus(status);
    for (size_t item = 0; item < items; ++item) body(ctx, item);
  }
}

pg_runner runner_of(OrtKernelContext *context) { return {ort_parallel_for, context}; }

// head_num, kv_head_num, head_dim, qk_scale: the attention ops' attributes, read once per node, as every
// lowering gets them. Artifacts exported before head_dim was an attribute have none: head_dim is then 0
// here and taken from the query's width per call.
OrtStatus *read_dims(const OrtKernelInfo *info, pg_attention_dims &dims) {
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "head_num", &dims.head_num));
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "kv_head_num", &dims.kv_head_num));
  RETURN_IF_ERROR(api->KernelInfoGetAttribute_float(info, "qk_scale", &dims.qk_scale));
  if (OrtStatus *absent = api->KernelInfoGetAttribute_int64(info, "head_dim", &dims.head_dim)) {
    api->ReleaseStatus(absent);
    dims.head_dim = 0;
  }
  if (dims.head_num <= 0 || dims.kv_head_num <= 0 || dims.head_num % dims.kv_head_num)
    return invalid("head_num " + std::to_string(dims.head_num) + ", kv_head_num " + std::to_string(dims.kv_head_num) +
                   ": both must be positive, head_num a multiple of kv_head_num");
  return nullptr;
}

// `dims` with its head_dim checked against (or, without the attribute, taken from) the query's width:
// the query must be [tokens, head_num * head_dim].
OrtStatus *with_head_dim(pg_attention_dims dims, const Shape &query, pg_attention_dims &out) {
  const bool fits = query.size() == 2 && (dims.head_dim ? query[1] == dims.head_num * dims.head_dim
                                                        : query[1] % dims.head_num == 0);
  if (!fits)
    return invalid("query has shape " + shape_text(query) + ", expected [tokens, head_num * head_dim] with head_num " +
                   std::to_string(dims.head_num) + (dims.head_dim ? ", head_dim " + std::to_string(dims.head_dim) : ""));
  if (!dims.head_dim) dims.head_dim = query[1] / dims.head_num;
  out = dims;
  return nullptr;
}

// Inputs 6-9 (int8 caches only): k_scale, k_offset, v_scale, v_offset (ATB's kDescale, kOffset, vDescale, vOffset).
struct PagedAttention {
  static constexpr const char *name = "PagedAttention";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, ANY, ANY, I32, I32, I32, F32, I32, F32, I32};
  static constexpr size_t required = 6;
  static constexpr ONNXTensorElementDataType outputs[] = {F32};
  pg_attention_dims dims{};
  int64_t block_size = 0;

  OrtStatus *init(const OrtKernelInfo *info) {
    RETURN_IF_ERROR(read_dims(info, dims));
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "block_size", &block_size));
    return block_size > 0 ? nullptr : invalid("block_size must be positive");
  }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> query, k_scale, v_scale;
    Input<void> k_cache, v_cache;
    Input<int32_t> tables, context_lens, cu, k_offset, v_offset;
    RETURN_IF_ERROR(get_inputs(context, query, k_cache, v_cache, tables, context_lens, cu, k_scale, k_offset, v_scale,
                               v_offset));
    pg_attention_dims d;
    RETURN_IF_ERROR(with_head_dim(dims, query.shape, d));
    pg_kv_cache cache{};
    size_t itemsize;
    RETURN_IF_ERROR(cache_dtype(k_cache, v_cache, cache, itemsize));
    const int64_t width = d.kv_head_num * d.head_dim;
    if (cache.dtype == PG_CACHE_INT8) {
      RETURN_IF_ERROR(check_shape("k_scale", k_scale.shape, {width}));
      RETURN_IF_ERROR(check_shape("v_scale", v_scale.shape, {width}));
      RETURN_IF_ERROR(check_shape("v_offset", v_offset.shape, {width}));
      cache.k_scale = k_scale.data, cache.v_scale = v_scale.data, cache.v_offset = v_offset.data;
    }
    RETURN_IF_ERROR(check_shape("k_cache", k_cache.shape, {-1, width}));
    RETURN_IF_ERROR(check_shape("v_cache", v_cache.shape, k_cache.shape));
    RETURN_IF_ERROR(check_shape("block_tables", tables.shape, {-1, -1}));
    const int64_t batch = tables.shape[0];
    RETURN_IF_ERROR(check_shape("context_lens", context_lens.shape, {batch}));
    RETURN_IF_ERROR(check_shape("cu_seqlens_q", cu.shape, {batch + 1}));
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, query.shape, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_paged_attention(query.data, k_cache.data, v_cache.data, tables.data, context_lens.data,
                                            cu.data, out, query.shape[0], batch, tables.shape[1], k_cache.shape[0],
                                            d, block_size, cache, &runner));
  }
};

struct SelfAttention {
  static constexpr const char *name = "SelfAttention";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, F32, F32, I32};
  static constexpr ONNXTensorElementDataType outputs[] = {F32};
  pg_attention_dims dims{};

  OrtStatus *init(const OrtKernelInfo *info) { return read_dims(info, dims); }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> query, key, value;
    Input<int32_t> cu;
    RETURN_IF_ERROR(get_inputs(context, query, key, value, cu));
    pg_attention_dims d;
    RETURN_IF_ERROR(with_head_dim(dims, query.shape, d));
    const int64_t tokens = query.shape[0];
    RETURN_IF_ERROR(check_shape("key", key.shape, {tokens, d.kv_head_num * d.head_dim}));
    RETURN_IF_ERROR(check_shape("value", value.shape, key.shape));
    if (cu.shape.size() != 1 || cu.shape[0] < 1)
      return invalid("cu_seqlens_q has shape " + shape_text(cu.shape) + ", expected [batch + 1]");
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, query.shape, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(
        pg_self_attention(query.data, key.data, value.data, cu.data, out, tokens, cu.shape[0] - 1, d, &runner));
  }
};

// Writes the new rows into the pools. The runtime binds each pool OrtValue as both the input and its
// output (IOBinding), so ORT hands this kernel the input's own buffer and only the rows are written;
// with separate outputs (a plain session.run) the pool is copied first, as the function body would.
// Inputs 5-8 (int8 caches only): k_inv_scale, k_offset, v_inv_scale, v_offset, the quantization's.
struct ReshapeAndCache {
  static constexpr const char *name = "ReshapeAndCache";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, F32, ANY, ANY, I64, F32, I32, F32, I32};
  static constexpr size_t required = 5;
  static constexpr ONNXTensorElementDataType outputs[] = {ANY, ANY};

  // The pools' outputs have their inputs' type and shape (ORT needs this for ANY-typed outputs).
  static OrtStatus *infer(OrtShapeInferContext *context) {
    for (size_t i = 0; i < 2; ++i) {
      OrtTensorTypeAndShapeInfo *info;  // owned by the context
      RETURN_IF_ERROR(api->ShapeInferContext_GetInputTypeShape(context, 2 + i, &info));
      RETURN_IF_ERROR(api->ShapeInferContext_SetOutputTypeShape(context, i, info));
    }
    return nullptr;
  }

  OrtStatus *init(const OrtKernelInfo *) { return nullptr; }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> key, value, k_inv_scale, v_inv_scale;
    Input<void> k_cache, v_cache;
    Input<int64_t> slots;
    Input<int32_t> k_offset, v_offset;
    RETURN_IF_ERROR(get_inputs(context, key, value, k_cache, v_cache, slots, k_inv_scale, k_offset, v_inv_scale, v_offset));
    RETURN_IF_ERROR(check_shape("key", key.shape, {-1, -1}));
    const int64_t tokens = key.shape[0], width = key.shape[1];
    pg_kv_cache cache{};
    size_t itemsize;
    RETURN_IF_ERROR(cache_dtype(k_cache, v_cache, cache, itemsize));
    if (cache.dtype == PG_CACHE_INT8) {
      for (const auto &[label, shape] : {std::pair{"k_inv_scale", k_inv_scale.shape}, std::pair{"k_offset", k_offset.shape},
                                         std::pair{"v_inv_scale", v_inv_scale.shape}, std::pair{"v_offset", v_offset.shape}})
        RETURN_IF_ERROR(check_shape(label, shape, {width}));
      cache.k_inv_scale = k_inv_scale.data, cache.k_offset = k_offset.data;
      cache.v_inv_scale = v_inv_scale.data, cache.v_offset = v_offset.data;
    }
    RETURN_IF_ERROR(check_shape("value", value.shape, key.shape));
    RETURN_IF_ERROR(check_shape("k_cache", k_cache.shape, {-1, width}));
    RETURN_IF_ERROR(check_shape("v_cache", v_cache.shape, k_cache.shape));
    RETURN_IF_ERROR(check_shape("slot_mapping", slots.shape, {tokens}));
    void *k_out, *v_out;
    RETURN_IF_ERROR(get_output(context, 0, k_cache.shape, k_out));
    RETURN_IF_ERROR(get_output(context, 1, v_cache.shape, v_out));
    const size_t pool_bytes = itemsize * k_cache.shape[0] * width;
    if (k_out != k_cache.data) std::memcpy(k_out, k_cache.data, pool_bytes);
    if (v_out != v_cache.data) std::memcpy(v_out, v_cache.data, pool_bytes);
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_reshape_and_cache(key.data, value.data, k_out, v_out, slots.data, tokens, width,
                                              k_cache.shape[0], cache, &runner));
  }
};

// Rotate-half rope of query and key with per-token cos/sin rows (head_dim = their width).
struct Rope {
  static constexpr const char *name = "Rope";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, F32, F32, F32};
  static constexpr ONNXTensorElementDataType outputs[] = {F32, F32};

  OrtStatus *init(const OrtKernelInfo *) { return nullptr; }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> query, key, cos, sin;
    RETURN_IF_ERROR(get_inputs(context, query, key, cos, sin));
    RETURN_IF_ERROR(check_shape("cos", cos.shape, {-1, -1}));
    const int64_t tokens = cos.shape[0], head_dim = cos.shape[1];
    RETURN_IF_ERROR(check_shape("sin", sin.shape, cos.shape));
    const pg_runner runner = runner_of(context);
    for (const auto &[index, x] : {std::pair{0, &query}, std::pair{1, &key}}) {
      RETURN_IF_ERROR(check_shape(index ? "key" : "query", x->shape, {tokens, -1}));
      if (x->shape[1] % head_dim)
        return invalid(std::string(index ? "key" : "query") + " width " + std::to_string(x->shape[1]) +
                       " is not a multiple of head_dim " + std::to_string(head_dim));
      float *out;
      RETURN_IF_ERROR(get_output(context, index, x->shape, out));
      RETURN_IF_ERROR(kernel_status(
          pg_rope(x->data, cos.data, sin.data, out, tokens, x->shape[1] / head_dim, head_dim, &runner)));
    }
    return nullptr;
  }
};

// silu(gate) * up of x = [gate | up].
struct SwiGLU {
  static constexpr const char *name = "SwiGLU";
  static constexpr ONNXTensorElementDataType inputs[] = {F32};
  static constexpr ONNXTensorElementDataType outputs[] = {F32};

  OrtStatus *init(const OrtKernelInfo *) { return nullptr; }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> x;
    RETURN_IF_ERROR(get_inputs(context, x));
    RETURN_IF_ERROR(check_shape("x", x.shape, {-1, -1}));
    if (x.shape[1] % 2) return invalid("x width " + std::to_string(x.shape[1]) + " is odd, expected [gate | up]");
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, {x.shape[0], x.shape[1] / 2}, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_swiglu(x.data, out, x.shape[0], x.shape[1] / 2, &runner));
  }
};

// y + blocksum(x) @ minimum_t: the minimum term of a Q4_1 / Q4_K linear beside MatMulNBits; minimum_t float16
// or float32.
struct BlockMinimum {
  static constexpr const char *name = "BlockMinimum";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, F32, ANY};
  static constexpr ONNXTensorElementDataType outputs[] = {F32};
  static constexpr bool in_place = true;  // out over y: the kernel reads each y element before writing it
  int64_t block_size = 0;

  OrtStatus *init(const OrtKernelInfo *info) {
    return api->KernelInfoGetAttribute_int64(info, "block_size", &block_size);
  }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> y, x;
    Input<void> minimum_t;
    RETURN_IF_ERROR(get_inputs(context, y, x, minimum_t));
    if (minimum_t.type != F32 && minimum_t.type != F16)
      return invalid("minimum_t has element type " + std::to_string(minimum_t.type) +
                     ", expected float16 or float32 (graphs/quant.pack_minimum)");
    RETURN_IF_ERROR(check_shape("y", y.shape, {-1, -1}));
    const int64_t tokens = y.shape[0], n = y.shape[1];
    RETURN_IF_ERROR(check_shape("x", x.shape, {tokens, -1}));
    if (block_size <= 0 || x.shape[1] % block_size)
      return invalid("x width " + std::to_string(x.shape[1]) + " is not a multiple of block_size " +
                     std::to_string(block_size));
    RETURN_IF_ERROR(check_shape("minimum_t", minimum_t.shape, {x.shape[1] / block_size, n}));
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, y.shape, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(
        pg_block_minimum(y.data, x.data, minimum_t.data, minimum_t.type == F16 ? PG_CACHE_FLOAT16 : PG_CACHE_FLOAT32,
                         out, tokens, n, x.shape[1], block_size, &runner));
  }
};

// GroupedMatmul (graphs/ops/grouped_matmul.py), float32 or bfloat16 experts: each expert's rows of x [M, K] times its
// weight of the stack [E, N, K] (cpu_kernels/grouped_matmul.cc).
struct GroupedMatmul {
  static constexpr const char *name = "GroupedMatmul";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, ANY, I64};
  static constexpr ONNXTensorElementDataType outputs[] = {F32};
  int64_t group_list_type = 0;

  OrtStatus *init(const OrtKernelInfo *info) {
    return api->KernelInfoGetAttribute_int64(info, "group_list_type", &group_list_type);
  }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> x;
    Input<void> weight;
    Input<int64_t> group_list;
    RETURN_IF_ERROR(get_inputs(context, x, weight, group_list));
    if (weight.type != F32 && weight.type != BF16)
      return invalid("weight has element type " + std::to_string(weight.type) + ", expected float32 or bfloat16");
    RETURN_IF_ERROR(check_shape("weight", weight.shape, {-1, -1, -1}));
    const int64_t experts = weight.shape[0], n = weight.shape[1], k = weight.shape[2];
    RETURN_IF_ERROR(check_shape("x", x.shape, {-1, k}));
    RETURN_IF_ERROR(check_shape("group_list", group_list.shape, {experts}));
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, {x.shape[0], n}, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_grouped_matmul(x.data, weight.data, weight.type == BF16, group_list.data, group_list_type,
                                           out, x.shape[0], k, n, experts, &runner));
  }
};

// GroupedMatmul.block_quantized as the ONNX lowering emits it (exporter/onnx/moe.py): every part present, a form
// without zero points or minima given their defaults, under the ORT-side name GroupedMatmulNBits (as
// Linear.block_quantized runs as MatMulNBits).
struct GroupedMatmulNBits {
  static constexpr const char *name = "GroupedMatmulNBits";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, U8, F32, U8, ANY, I64};
  static constexpr ONNXTensorElementDataType outputs[] = {F32};
  int64_t k = 0, n = 0, bits = 0, block_size = 0, group_list_type = 0, accuracy_level = 0;

  OrtStatus *init(const OrtKernelInfo *info) {
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "K", &k));
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "N", &n));
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "bits", &bits));
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "block_size", &block_size));
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "accuracy_level", &accuracy_level));
    return api->KernelInfoGetAttribute_int64(info, "group_list_type", &group_list_type);
  }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> x, scales;
    Input<uint8_t> codes, zero_points;
    Input<void> minimum_t;
    Input<int64_t> group_list;
    RETURN_IF_ERROR(get_inputs(context, x, codes, scales, zero_points, minimum_t, group_list));
    if (minimum_t.type != F32 && minimum_t.type != F16)
      return invalid("minimum_t has element type " + std::to_string(minimum_t.type) + ", expected float16 or float32");
    if (bits != 4 && bits != 8) return invalid("bits = " + std::to_string(bits) + ", expected 4 or 8");
    if (block_size <= 0 || k % block_size)
      return invalid("block_size " + std::to_string(block_size) + " does not divide K = " + std::to_string(k));
    const int64_t experts = codes.shape[0], blocks = k / block_size;
    RETURN_IF_ERROR(check_shape("x", x.shape, {-1, k}));
    RETURN_IF_ERROR(check_shape("codes", codes.shape, {experts, n, blocks, block_size * bits / 8}));
    RETURN_IF_ERROR(check_shape("scales", scales.shape, {experts, n, blocks}));
    // zero points and minima: one per expert, or one [1, ...] entry for all (a form's defaults)
    const int64_t zero_experts = zero_points.shape.size() ? zero_points.shape[0] : 0;
    const int64_t minimum_experts = minimum_t.shape.size() ? minimum_t.shape[0] : 0;
    if ((zero_experts != experts && zero_experts != 1) || (minimum_experts != experts && minimum_experts != 1))
      return invalid("zero_points and minimum_t hold " + std::to_string(zero_experts) + " and " +
                     std::to_string(minimum_experts) + " experts' entries, expected " + std::to_string(experts) +
                     " or 1");
    RETURN_IF_ERROR(
        check_shape("zero_points", zero_points.shape, {zero_experts, n, bits == 8 ? blocks : (blocks + 1) / 2}));
    RETURN_IF_ERROR(check_shape("minimum_t", minimum_t.shape, {minimum_experts, blocks, n}));
    RETURN_IF_ERROR(check_shape("group_list", group_list.shape, {experts}));
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, {x.shape[0], n}, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_grouped_matmul_nbits(
        x.data, codes.data, scales.data, zero_points.data, zero_experts == experts, minimum_t.data,
        minimum_t.type == F16 ? PG_CACHE_FLOAT16 : PG_CACHE_FLOAT32, minimum_experts == experts, group_list.data,
        group_list_type, out, x.shape[0], k, n, experts, bits, block_size, static_cast<int32_t>(accuracy_level),
        &runner));
  }
};

// Per-token int8 of Linear.w8a8's input: codes + 128 as uint8 [T, K] and the row scales [T, 1].
struct DynamicQuant {
  static constexpr const char *name = "DynamicQuant";
  static constexpr ONNXTensorElementDataType inputs[] = {F32};
  static constexpr ONNXTensorElementDataType outputs[] = {U8, F32};

  OrtStatus *init(const OrtKernelInfo *) { return nullptr; }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> x;
    RETURN_IF_ERROR(get_inputs(context, x));
    RETURN_IF_ERROR(check_shape("x", x.shape, {-1, -1}));
    uint8_t *codes;
    float *row_scale;
    RETURN_IF_ERROR(get_output(context, 0, x.shape, codes));
    RETURN_IF_ERROR(get_output(context, 1, {x.shape[0], 1}, row_scale));
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_dynamic_quant(x.data, codes, row_scale, x.shape[0], x.shape[1], &runner));
  }
};

#ifdef PG_WITH_ONEDNN
// Linear.bfloat16 (graphs/ops/linear_bf16.py): y = bf16(x) @ weight^T, weight bfloat16 [N, K], on oneDNN's
// matmul (cpu_kernels/onednn_linear.cc: ORT's threads; an initializer's weights are prepacked once).
struct Linear {
  static constexpr const char *name = "Linear";
  static constexpr ONNXTensorElementDataType inputs[] = {F32, BF16};
  static constexpr ONNXTensorElementDataType outputs[] = {F32};
  int64_t k = 0, n = 0;
  pg_bf16_linear *linear = nullptr;

  Linear() = default;
  Linear(const Linear &) = delete;
  Linear &operator=(const Linear &) = delete;
  ~Linear() { pg_bf16_linear_destroy(linear); }

  OrtStatus *init(const OrtKernelInfo *info) {
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "K", &k));
    RETURN_IF_ERROR(api->KernelInfoGetAttribute_int64(info, "N", &n));
    int constant = 0;
    const OrtValue *weight;
    RETURN_IF_ERROR(api->KernelInfoGetConstantInput_tensor(info, 1, &constant, &weight));
    linear = pg_bf16_linear_create(k, n, constant != 0);
    return linear ? nullptr : invalid(pg_last_error());
  }

  OrtStatus *compute(OrtKernelContext *context) const {
    Input<float> x;
    Input<uint16_t> weight;
    RETURN_IF_ERROR(get_inputs(context, x, weight));
    RETURN_IF_ERROR(check_shape("x", x.shape, {-1, k}));
    RETURN_IF_ERROR(check_shape("weight", weight.shape, {n, k}));
    float *out;
    RETURN_IF_ERROR(get_output(context, 0, {x.shape[0], n}, out));
    const pg_runner runner = runner_of(context);
    return kernel_status(pg_bf16_linear_run(linear, x.data, x.shape[0], weight.data, out, &runner));
  }
};

#endif

// How many leading inputs of `Kernel` are required: `Kernel::required` where it has optional trailing ones.
template <class Kernel, class = void>
struct Required {
  static constexpr size_t value = std::size(Kernel::inputs);
};
template <class Kernel>
struct Required<Kernel, std::void_t<decltype(Kernel::required)>> {
  static constexpr size_t value = Kernel::required;
};

// Whether `Kernel` infers its outputs' types (`Kernel::infer`), as ops with ANY-typed outputs must.
template <class Kernel, class = void>
struct HasInfer : std::false_type {};
template <class Kernel>
struct HasInfer<Kernel, std::void_t<decltype(&Kernel::infer)>> : std::true_type {};

// Whether `Kernel` may write output 0 over input 0 (`Kernel::in_place`): then ORT's allocation planner can give the
// output the input's buffer where nothing else reads it, one activation less at the step's peak.
template <class Kernel, class = void>
struct InPlace : std::false_type {};
template <class Kernel>
struct InPlace<Kernel, std::void_t<decltype(Kernel::in_place)>> : std::bool_constant<Kernel::in_place> {};

// The OrtCustomOp of `Kernel`: its name and types, and callbacks that create, run and destroy it.
template <class Kernel>
struct CustomOp : OrtCustomOp {
  CustomOp() : OrtCustomOp{} {
    version = ORT_API_VERSION;
    GetName = [](const OrtCustomOp *) { return Kernel::name; };
    GetExecutionProviderType = [](const OrtCustomOp *) -> const char * { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp *) { return std::size(Kernel::inputs); };
    GetInputType = [](const OrtCustomOp *, size_t i) { return Kernel::inputs[i]; };
    GetOutputTypeCount = [](const OrtCustomOp *) { return std::size(Kernel::outputs); };
    GetOutputType = [](const OrtCustomOp *, size_t i) { return Kernel::outputs[i]; };
    GetInputCharacteristic = [](const OrtCustomOp *, size_t i) {
      return i < Required<Kernel>::value ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp *, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp *, size_t) { return OrtMemTypeDefault; };
    GetStartVersion = [](const OrtCustomOp *) { return 1; };
    GetEndVersion = [](const OrtCustomOp *) { return 1; };  // the `atb` opset the exporter writes
    CreateKernelV2 = [](const OrtCustomOp *, const OrtApi *, const OrtKernelInfo *info, void **kernel) -> OrtStatus * {
      auto *created = new Kernel();
      if (OrtStatus *status = created->init(info)) {
        delete created;
        return status;
      }
      *kernel = created;
      return nullptr;
    };
    KernelComputeV2 = [](void *kernel, OrtKernelContext *context) -> OrtStatus * {
      return static_cast<const Kernel *>(kernel)->compute(context);
    };
    KernelDestroy = [](void *kernel) { delete static_cast<Kernel *>(kernel); };
    if constexpr (HasInfer<Kernel>::value)
      InferOutputShapeFn = [](const OrtCustomOp *, OrtShapeInferContext *context) { return Kernel::infer(context); };
#if ORT_API_VERSION >= 18  // GetMayInplace's version
    if constexpr (InPlace<Kernel>::value) {
      GetMayInplace = [](int **input_index, int **output_index) -> size_t {
        *input_index = new int[1]{0};
        *output_index = new int[1]{0};
        return 1;
      };
      ReleaseMayInplace = [](int *input_index, int *output_index) {
        delete[] input_index;
        delete[] output_index;
      };
    }
#endif
  }
};

CustomOp<PagedAttention> paged_attention_op;
CustomOp<ReshapeAndCache> reshape_and_cache_op;
CustomOp<SelfAttention> self_attention_op;
CustomOp<Rope> rope_op;
CustomOp<SwiGLU> swiglu_op;
CustomOp<BlockMinimum> block_minimum_op;
CustomOp<DynamicQuant> dynamic_quant_op;
CustomOp<GroupedMatmul> grouped_matmul_op;
CustomOp<GroupedMatmulNBits> grouped_matmul_nbits_op;
#ifdef PG_WITH_ONEDNN
CustomOp<Linear> linear_op;
#endif

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus *RegisterCustomOps(OrtSessionOptions *options,
                                                                               const OrtApiBase *base) {
  api = base->GetApi(ORT_API_VERSION);
  if (api == nullptr)
    return base->GetApi(1)->CreateStatus(
        ORT_FAIL, ("onnxruntime " + std::string(base->GetVersionString()) + " predates C API version " +
                   std::to_string(ORT_API_VERSION) + ", the header this library was built with")
                      .c_str());
  // The domain must outlive every session made from `options`: it is kept for the process.
  OrtCustomOpDomain *domain;
  RETURN_IF_ERROR(api->CreateCustomOpDomain("atb", &domain));
  std::vector<OrtCustomOp *> ops = {&paged_attention_op, &reshape_and_cache_op, &self_attention_op, &rope_op,
                                    &swiglu_op, &block_minimum_op, &dynamic_quant_op, &grouped_matmul_op,
                                    &grouped_matmul_nbits_op};
#ifdef PG_WITH_ONEDNN
  if (pg_bf16_linear_supported()) ops.push_back(&linear_op);  // else ORT runs Linear.bfloat16's function body
#endif
  for (OrtCustomOp *op : ops) {
    if (OrtStatus *status = api->CustomOpDomain_Add(domain, op)) {
      api->ReleaseCustomOpDomain(domain);
      return status;
    }
  }
  return api->AddCustomOpDomain(options, domain);
}

// The oneDNN implementations Linear.bf16's primitives use so far and oneDNN's version ("" before the first
// run, or without oneDNN): `pagedgraph bench` records it as the kernel that ran (runtime/bench/kernels.py).
// Whether Linear.bfloat16 runs as oneDNN's bf16 matmul here (false: no bf16 matmul on this CPU, or no oneDNN).
extern "C" __attribute__((visibility("default"))) bool PgBf16LinearSupported() {
#ifdef PG_WITH_ONEDNN
  return pg_bf16_linear_supported();
#else
  return false;
#endif
}

extern "C" __attribute__((visibility("default"))) const char *PgBf16LinearImplementations() {
#ifdef PG_WITH_ONEDNN
  return pg_bf16_linear_implementations();
#else
  return "";
#endif
}
