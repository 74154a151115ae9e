// oneDNN (an OpenMP build on Debian) called from a host pool's worker: its OpenMP team size is this thread's
// nthreads-var, so a call made under OneThread runs inline on that worker and no OpenMP team spins beside the
// host's threads (ONNX Runtime's intra-op pool).
#pragma once
#include <omp.h>

namespace pg {

class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }
  OneThread(const OneThread &) = delete;
  OneThread &operator=(const OneThread &) = delete;

 private:
  int saved_;
};

}  // namespace pg
