// GroupedMatmul (graphs/ops/grouped_matmul.py): y [M, N] float32, each expert's consecutive rows of x [M, K] times
// its weight [N, K] of the stack [E, N, K], on oneDNN's sgemm. Built into the ONNX Runtime custom-op library only,
// and only where oneDNN's headers are found (cpu_kernels/build.py: PG_WITH_ONEDNN).
#pragma once
#include <cstdint>

#include "kernels.h"

extern "C" {

// group_list [E]: rows per expert (group_list_type 1) or their running sum (0); rows past the groups' total are
// written as zeros. Fails (pg_last_error) on a group list that does not split the M rows into consecutive groups.
int pg_grouped_matmul(const float *x, const float *weight, const int64_t *group_list, int64_t group_list_type,
                      float *y, int64_t m, int64_t k, int64_t n, int64_t experts, const pg_runner *runner);
}
