// GroupedMatmul on oneDNN's sgemm: one call per (expert group, column chunk), so the work follows the routing: a
// decode step reads only the experts its tokens chose, whatever the number of experts in the layer.
//
// Threads: ONNX Runtime's intra-op pool, never oneDNN's own (pg::OneThread: each sgemm runs inline on its pool
// thread). Work items are the groups' column chunks, wide enough for sgemm's blocking and numerous enough that a
// decode step's few one-row groups still spread over every thread. Nothing is allocated per call.
#include "onednn_grouped_matmul.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include <oneapi/dnnl/dnnl.h>

#include "common.h"
#include "onednn_threads.h"

namespace {

constexpr int64_t kMinChunk = 64;     // columns: one AVX-512 sgemm panel and more
constexpr int64_t kMaxGroups = 1024;  // experts per layer (DeepSeek-V3 routes over 256)

}  // namespace

extern "C" {

int pg_grouped_matmul(const float *x, const float *weight, const int64_t *group_list, int64_t group_list_type,
                      float *y, int64_t m, int64_t k, int64_t n, int64_t experts, const pg_runner *runner) {
  if (experts <= 0 || experts > kMaxGroups || group_list_type < 0 || group_list_type > 1)
    return pg::fail("grouped matmul: " + std::to_string(experts) + " experts (1.." + std::to_string(kMaxGroups) +
                    "), group_list_type " + std::to_string(group_list_type) + " (0 cumsum, 1 counts)");
  int64_t bounds[kMaxGroups + 1] = {0};
  int64_t used[kMaxGroups];
  int64_t groups = 0;
  for (int64_t e = 0; e < experts; ++e) {
    bounds[e + 1] = group_list_type == 1 ? bounds[e] + group_list[e] : group_list[e];
    if (bounds[e + 1] < bounds[e] || bounds[e + 1] > m)
      return pg::fail("grouped matmul: group list entry " + std::to_string(e) + " = " + std::to_string(group_list[e]) +
                      (group_list_type == 1 ? " (counts)" : " (cumsum)") + " does not split " + std::to_string(m) +
                      " rows into consecutive groups");
    if (bounds[e + 1] > bounds[e]) used[groups++] = e;
  }
  const int64_t total = bounds[experts];
  if (total < m) std::memset(y + total * n, 0, sizeof(float) * (m - total) * n);
  const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t wanted = (4 * threads + groups - 1) / std::max<int64_t>(groups, 1);  // chunks per group
  const int64_t width = std::max(kMinChunk, (n / std::max<int64_t>(wanted, 1) + kMinChunk - 1) / kMinChunk * kMinChunk);
  const int64_t chunks = (n + width - 1) / width;
  dnnl_status_t status[kMaxGroups];
  std::fill(status, status + groups, dnnl_success);
  pg::parallel_for(runner, groups * chunks, [&](int64_t item) {
    pg::OneThread one;
    const int64_t e = used[item / chunks], first = (item % chunks) * width;
    const int64_t rows = bounds[e + 1] - bounds[e], cols = std::min(width, n - first);
    const dnnl_status_t s = dnnl_sgemm('N', 'T', rows, cols, k, 1.0f, x + bounds[e] * k, k,
                                       weight + (e * n + first) * k, k, 0.0f, y + bounds[e] * n + first, n);
    if (s != dnnl_success) status[item / chunks] = s;
  });
  for (int64_t g = 0; g < groups; ++g)
    if (status[g] != dnnl_success)
      return pg::fail("grouped matmul (oneDNN sgemm): expert " + std::to_string(used[g]) + " failed with status " +
                      std::to_string(status[g]));
  return 0;
}
}
