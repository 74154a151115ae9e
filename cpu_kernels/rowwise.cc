// The row-wise fused ops of graphs/ops/elementwise.py as C++ kernels (float32, CPU): Rope, SwiGLU.
//
// Each is one pass over its rows instead of the 4 (SwiGLU) to 8 (Rope, per tensor) standard ops
// of their ONNX bodies; a decode step runs them once per layer on a handful of rows, where the
// per-op cost is what counts.
#include <cstdint>
#include <string>

#include "common.h"

using pg::exp8, pg::f32x8, pg::kLanes, pg::load8, pg::store8;

extern "C" {

int pg_rope(const float *x, const float *cos, const float *sin, float *out, int64_t tokens, int64_t heads,
            int64_t head_dim, const pg_runner *runner) {
  if (head_dim <= 0 || head_dim % (2 * kLanes))
    return pg::fail("rope head_dim " + std::to_string(head_dim) + " must be a positive multiple of " +
                    std::to_string(2 * kLanes));
  const int64_t half = head_dim / 2, width = heads * head_dim;
  pg::for_rows(runner, tokens, width, [&](int64_t t) {
    const float *c = cos + t * head_dim, *s = sin + t * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float *in = x + t * width + h * head_dim;
      float *o = out + t * width + h * head_dim;
      for (int64_t d = 0; d < half; d += kLanes) {  // rotate-half: (a, b) -> (a cos - b sin, b cos + a sin)
        const f32x8 a = load8(in + d), b = load8(in + half + d);
        store8(o + d, a * load8(c + d) - b * load8(s + d));
        store8(o + half + d, b * load8(c + half + d) + a * load8(s + half + d));
      }
    }
  });
  return 0;
}

int pg_swiglu(const float *x, float *out, int64_t tokens, int64_t width, const pg_runner *runner) {
  if (width <= 0 || width % kLanes)
    return pg::fail("swiglu output width " + std::to_string(width) + " must be a positive multiple of " +
                    std::to_string(kLanes));
  pg::for_rows(runner, tokens, 2 * width, [&](int64_t t) {
    const float *gate = x + t * 2 * width, *up = gate + width;
    for (int64_t f = 0; f < width; f += kLanes) {
      const f32x8 g = load8(gate + f);
      store8(out + t * width + f, g / (1.f + exp8(-g)) * load8(up + f));
    }
  });
  return 0;
}

}  // extern "C"
