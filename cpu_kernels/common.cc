// The process-wide kernel state behind common.h and the C API's error and thread calls.
#include "common.h"

#include <atomic>
#include <cstdio>

namespace {

thread_local std::string last_error;
std::atomic<int> thread_limit{0};  // 0: OpenMP's default (OMP_NUM_THREADS or all cores)

}  // namespace

namespace pg {

int fail(const std::string &message) {
  last_error = message;
  std::fprintf(stderr, "pagedgraph kernel: %s\n", message.c_str());
  return 1;
}

int threads() {
  const int limit = thread_limit.load(std::memory_order_relaxed);
  return limit > 0 ? limit : omp_get_max_threads();
}

}  // namespace pg

extern "C" {

const char *pg_last_error() { return last_error.c_str(); }

void pg_set_threads(int count) { thread_limit.store(count, std::memory_order_relaxed); }

}  // extern "C"
