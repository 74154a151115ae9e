// Linear.bfloat16 through oneDNN's matmul primitive: y [T, N] float32 = bf16(x) [T, K] @ W^T, W bfloat16
// [N, K] (ATB's layout), float32 accumulation. Built into the ONNX Runtime custom-op library only, and only
// where oneDNN's headers are found (cpu_kernels/build.py: PG_WITH_ONEDNN).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels.h"

extern "C" {

struct pg_bf16_linear;

// One per graph node: it keeps the node's packed weights and one primitive per row count. A
// `constant_weight` (an initializer: same address, same values for the node's life) is reordered into
// oneDNN's blocked layout on the first call only; any other weight is reordered on every call.
pg_bf16_linear *pg_bf16_linear_create(int64_t k, int64_t n, bool constant_weight);
void pg_bf16_linear_destroy(pg_bf16_linear *linear);

int pg_bf16_linear_run(pg_bf16_linear *linear, const float *x, int64_t tokens, const uint16_t *weight, float *y,
                       const pg_runner *runner);

// Whether oneDNN has a bfloat16 matmul on this CPU (AVX-512 BF16 or AMX; none on AVX2): where it has not, the
// custom-op library leaves Linear.bfloat16 unregistered and ONNX Runtime runs the op's float32 function body.
bool pg_bf16_linear_supported();

// The oneDNN implementations the primitives created so far use ("brg:avx512_core_bf16", ...),
// comma-separated, and the library's version: what the bench records as the kernel that ran.
const char *pg_bf16_linear_implementations();
}
