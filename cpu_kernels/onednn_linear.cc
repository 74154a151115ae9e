// Linear.bfloat16 on oneDNN's matmul primitive (graphs/ops/linear_bf16.py is the contract and the reference).
//
// Threads: ONNX Runtime's intra-op pool, never oneDNN's own. The output columns are split into one chunk
// per hardware thread; each chunk is one matmul primitive over its slice of the weights, run on a pool
// thread with OpenMP's team size set to 1 for the call, so oneDNN (an OpenMP build on Debian) runs inline on
// that thread and no OpenMP team spins beside ORT's workers.
// Layout: oneDNN 2.6's brgemm kernel (brg:avx512_core_bf16) takes only a dense destination (a column slice
// of y falls back to gemm:jit, several times slower), so a chunk computes up to kRowBlock rows at a time
// into its own dense buffer, small enough to stay in cache, and copies them into its columns of y.
// Memory: each node's weights (an initializer) are reordered once (first call) into the blocked layout the
// primitive wants (oneDNN allocates it; in our processes those allocations already sit on transparent huge
// pages, docs/bench/history.md, "Tried, not kept"); primitives are created once per (rows, chunk width) and shared by
// every node of that shape; scratchpads, row buffers and the bfloat16 copy of x live in process-wide buffers
// that only grow. A step allocates nothing once every gear has run once.
#include "onednn_linear.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "common.h"
#include "onednn_threads.h"

namespace {

using dnnl::memory;
using Dims = memory::dims;

constexpr int64_t kMinChunk = 64;    // columns: oneDNN's bf16 weight blocks are 64 wide
constexpr int64_t kRowBlock = 64;    // rows per primitive call: the dense buffer of a chunk stays in L2

const dnnl::engine &cpu() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

using pg::OneThread;  // oneDNN's OpenMP team size: 1 while a chunk runs, restored after

// What every node shares, under `mutex`: the primitives by shape, the buffers, one stream per chunk.
struct Shared {
  std::mutex mutex;
  std::map<std::tuple<int64_t, int64_t, int64_t>, dnnl::matmul::primitive_desc> descs;
  std::vector<uint16_t> x;                       // bfloat16 x [tokens, K]
  std::vector<std::vector<uint8_t>> scratchpads;  // one per chunk index
  std::vector<std::vector<float>> rows;          // one per chunk index: [kRowBlock, width] of y
  std::vector<dnnl::stream> streams;             // one per chunk index
  std::set<std::string> implementations;
  std::string report;
};

Shared &shared() {
  static Shared *state = new Shared();  // never destroyed: nodes may outlive static destruction order
  return *state;
}

int64_t chunk_count(int64_t n) {
  const int64_t threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
  return std::max<int64_t>(1, std::min(threads, n / kMinChunk));
}

memory::desc plain(const Dims &dims, memory::data_type type, const Dims &strides) {
  return memory::desc(dims, type, strides);
}

// The matmul [rows, K] x [K, width] -> [rows, width], bfloat16 in, float32 out; `weights` is the packed
// layout (format any when choosing it).
dnnl::matmul::primitive_desc make_desc(int64_t rows, int64_t k, int64_t width, const memory::desc &weights) {
  using dt = memory::data_type;
  const auto src = plain({rows, k}, dt::bf16, {k, 1});
  const auto dst = plain({rows, width}, dt::f32, {width, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
#if DNNL_VERSION_MAJOR >= 3
  return dnnl::matmul::primitive_desc(cpu(), src, weights, dst, attr);
#else
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(src, weights, dst), attr, cpu());
#endif
}

// One chunk of output columns: its packed weights and, per row count (1..kRowBlock), its primitive and arguments.
struct Chunk {
  int64_t first = 0, width = 0;
  memory packed, user;    // the blocked weights; the node's own [width, K] rows
  dnnl::reorder packing;  // user -> packed, created once
  struct Step {
    dnnl::matmul primitive;
    memory src, dst, scratchpad;
    size_t scratchpad_bytes = 0;
  };
  std::map<int64_t, Step> steps;
};

}  // namespace

struct pg_bf16_linear {
  int64_t k = 0, n = 0;
  bool constant_weight = false;
  const uint16_t *packed_from = nullptr;
  std::vector<Chunk> chunks;
  std::vector<Chunk::Step *> steps;      // this call's steps of each chunk: full row blocks, the tail
  std::vector<dnnl_status_t> statuses;  // and its result

  pg_bf16_linear(int64_t k_, int64_t n_, bool constant) : k(k_), n(n_), constant_weight(constant) {
    const int64_t count = chunk_count(n);
    const int64_t width = (n + count - 1) / count;
    for (int64_t first = 0; first < n; first += width) chunks.push_back(Chunk{first, std::min(width, n - first)});
    steps.resize(2 * chunks.size());
    statuses.resize(chunks.size());
  }

  // The primitive of (rows, chunk) with these weights' packed layout, created once per shape.
  dnnl::matmul::primitive_desc desc(Shared &s, int64_t rows, const Chunk &c, const memory::desc &weights) const {
    const auto key = std::make_tuple(rows, k, c.width);
    auto found = s.descs.find(key);
    if (found == s.descs.end()) {
      found = s.descs.emplace(key, make_desc(rows, k, c.width, weights)).first;
      if (s.implementations.insert(found->second.impl_info_str()).second) {
        const dnnl_version_t *v = dnnl_version();
        s.report.clear();
        for (const auto &name : s.implementations) s.report += (s.report.empty() ? "" : ",") + name;
        s.report += "; oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." +
                    std::to_string(v->patch);
      }
    }
    return found->second;
  }

  // The chunks' packed memory and their reorders: once per node.
  void layout(Shared &s) {
    for (Chunk &c : chunks) {
      const auto any = memory::desc({k, c.width}, memory::data_type::bf16, memory::format_tag::any);
      c.packed = memory(desc(s, kRowBlock, c, any).weights_desc(), cpu());
      c.user = memory(plain({k, c.width}, memory::data_type::bf16, {1, k}), cpu(), DNNL_MEMORY_NONE);
      c.packing = dnnl::reorder(c.user, c.packed);
    }
  }

  void pack(Shared &s, const uint16_t *weight) {
    if (!chunks.front().packed) layout(s);
    for (Chunk &c : chunks) {
      c.user.set_data_handle(const_cast<uint16_t *>(weight + c.first * k));
      c.packing.execute(s.streams[0], c.user, c.packed);
      s.streams[0].wait();
    }
    packed_from = weight;
  }

  Chunk::Step &step(Shared &s, Chunk &c, int64_t rows) {
    auto found = c.steps.find(rows);
    if (found != c.steps.end()) return found->second;
    const auto pd = desc(s, rows, c, c.packed.get_desc());
    Chunk::Step st{dnnl::matmul(pd), memory(pd.src_desc(), cpu(), DNNL_MEMORY_NONE),
                   memory(pd.dst_desc(), cpu(), DNNL_MEMORY_NONE),
                   memory(pd.scratchpad_desc(), cpu(), DNNL_MEMORY_NONE), pd.scratchpad_desc().get_size()};
    return c.steps.emplace(rows, std::move(st)).first->second;
  }
};

extern "C" {

pg_bf16_linear *pg_bf16_linear_create(int64_t k, int64_t n, bool constant_weight) {
  if (k <= 0 || n <= 0) {
    pg::fail("bf16 linear: K " + std::to_string(k) + " and N " + std::to_string(n) + " must be positive");
    return nullptr;
  }
  return new pg_bf16_linear(k, n, constant_weight);
}

void pg_bf16_linear_destroy(pg_bf16_linear *linear) { delete linear; }

int pg_bf16_linear_run(pg_bf16_linear *linear, const float *x, int64_t tokens, const uint16_t *weight, float *y,
                       const pg_runner *runner) {
  if (tokens == 0) return 0;
  Shared &s = shared();
  std::lock_guard<std::mutex> guard(s.mutex);
  const int64_t k = linear->k, n = linear->n, chunks = static_cast<int64_t>(linear->chunks.size());
  const int64_t block = std::min(tokens, kRowBlock), tail = tokens % block;
  std::vector<Chunk::Step *> &steps = linear->steps;  // [chunk][0]: full blocks, [chunk][1]: the tail
  std::vector<dnnl_status_t> &status = linear->statuses;
  try {
    OneThread one;  // primitive creation reads the team size too
    if (s.streams.size() < static_cast<size_t>(chunks)) {
      s.scratchpads.resize(chunks);
      s.rows.resize(chunks);
      while (s.streams.size() < static_cast<size_t>(chunks)) s.streams.emplace_back(cpu());
    }
    if (!linear->constant_weight || linear->packed_from != weight) linear->pack(s, weight);
    if (s.x.size() < static_cast<size_t>(tokens * k)) s.x.resize(tokens * k);
    for (int64_t i = 0; i < chunks; ++i) {
      Chunk &c = linear->chunks[i];
      if (s.rows[i].size() < static_cast<size_t>(block * c.width)) s.rows[i].resize(block * c.width);
      for (int64_t j = 0; j < 2; ++j) {
        Chunk::Step *st = j == 0 || tail ? &linear->step(s, c, j == 0 ? block : tail) : nullptr;
        if (st && s.scratchpads[i].size() < st->scratchpad_bytes) s.scratchpads[i].resize(st->scratchpad_bytes);
        steps[2 * i + j] = st;
      }
    }
  } catch (const std::exception &e) {  // dnnl::error, or std::bad_alloc from oneDNN's C++ API
    return pg::fail(std::string("bf16 linear (oneDNN): ") + e.what());
  }
  uint16_t *xb = s.x.data();
  pg::for_rows(runner, tokens, k, [&](int64_t r) {
    pg::bf16 *out = reinterpret_cast<pg::bf16 *>(xb + r * k);
    for (int64_t j = 0; j < k; ++j) pg::from_float(x[r * k + j], out[j]);
  });
  pg::parallel_for(runner, chunks, [&](int64_t i) {
    OneThread one;
    const Chunk &c = linear->chunks[i];
    status[i] = dnnl_success;
    for (int64_t first = 0; first < tokens && status[i] == dnnl_success; first += block) {
      const int64_t rows = std::min(block, tokens - first);
      const Chunk::Step &st = *steps[2 * i + (rows == block ? 0 : 1)];
      // The C API: a fixed argument array, where the C++ one would build a map per call.
      // One row is already dense where it lies in y (a [1, width] slice's row stride is never read), so it is
      // written in place; more rows go through the chunk's buffer.
      float *dense = rows == 1 ? y + first * n + c.first : s.rows[i].data();
      status[i] = dnnl_memory_set_data_handle(st.src.get(), xb + first * k);
      if (status[i] == dnnl_success) status[i] = dnnl_memory_set_data_handle(st.dst.get(), dense);
      if (status[i] == dnnl_success) status[i] = dnnl_memory_set_data_handle(st.scratchpad.get(), s.scratchpads[i].data());
      const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, st.src.get()}, {DNNL_ARG_WEIGHTS, c.packed.get()},
                                      {DNNL_ARG_DST, st.dst.get()}, {DNNL_ARG_SCRATCHPAD, st.scratchpad.get()}};
      if (status[i] == dnnl_success) status[i] = dnnl_primitive_execute(st.primitive.get(), s.streams[i].get(), 4, args);
      if (status[i] == dnnl_success) status[i] = dnnl_stream_wait(s.streams[i].get());
      if (rows > 1)  // one row was written in place
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(y + (first + r) * n + c.first, dense + r * c.width, c.width * sizeof(float));
    }
  });
  for (int64_t i = 0; i < chunks; ++i)
    if (status[i] != dnnl_success)
      return pg::fail("bf16 linear (oneDNN): matmul of chunk " + std::to_string(i) + " failed with status " +
                      std::to_string(status[i]));
  return 0;
}

bool pg_bf16_linear_supported() {
  static const bool supported = [] {
    try {
      const auto any = memory::desc({kMinChunk, kMinChunk}, memory::data_type::bf16, memory::format_tag::any);
      make_desc(1, kMinChunk, kMinChunk, any);
      return true;
    } catch (const dnnl::error &) {
      return false;
    }
  }();
  return supported;
}

const char *pg_bf16_linear_implementations() {
  Shared &s = shared();
  std::lock_guard<std::mutex> guard(s.mutex);
  return s.report.c_str();
}
}
