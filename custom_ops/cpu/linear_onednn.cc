#include "linear_onednn.h"

#include <omp.h>

#ifdef BS_ONEDNN
#include <immintrin.h>
#include <oneapi/dnnl/dnnl.h>

#include <dlfcn.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>
#endif

namespace bs::linear {

#ifdef BS_ONEDNN
namespace {

namespace avx512_bf16 {  // the namespace names the instruction set (test_custom_ops.py reads the disassembly)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bf16")
#include "bf16_pairs.h"

// out[0..k) = x[0..k) rounded to bf16 (nearest even, as the BF16 kernels round x); k even.
static void row_to_bf16(const float* x, int64_t k, uint16_t* out) {
  to_bf16_pairs(x, k, reinterpret_cast<uint32_t*>(out));
}
#pragma GCC pop_options
}  // namespace avx512_bf16

// One GEMM shape's matmul: its primitive and its operands' descriptions (dst's rows `ld` floats apart). It runs
// from several threads at once, each with its own scratch (user scratchpad) and stream.
struct Matmul {
  dnnl_primitive_t primitive = nullptr;
  dnnl_memory_desc_t src = nullptr, weights = nullptr, bias = nullptr, dst = nullptr;
  const_dnnl_memory_desc_t scratch = nullptr;  // owned by the primitive's description
  dnnl_primitive_desc_t description = nullptr;
  bool brgemm = false;  // oneDNN's kernel for the shape is a brgemm; a reference loop is not taken

  ~Matmul() {
    if (primitive != nullptr) dnnl_primitive_destroy(primitive);
    if (description != nullptr) dnnl_primitive_desc_destroy(description);
    for (dnnl_memory_desc_t md : {src, weights, bias, dst}) {
      if (md != nullptr) dnnl_memory_desc_destroy(md);
    }
  }
};

template <class T>
T* thread_buffer(size_t bytes) {
  thread_local std::vector<T> storage;
  const size_t count = (bytes + sizeof(T) - 1) / sizeof(T) + 64 / sizeof(T);
  if (storage.size() < count) storage.resize(count);
  const auto address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<T*>((address + 63) & ~static_cast<uintptr_t>(63));
}

// The process's oneDNN engine and its matmuls by shape (a prompt chunk's rows vary: at most kMaxShapes kept, all
// dropped when full; oneDNN's own primitive cache makes a shape seen before quick to create again).
class OneDnn {
 public:
  // The first call caps oneDNN's instructions, before its first primitive: with AMX only where that call's isa
  // allows it (BLOCKSERVE_CPU_ISA caps oneDNN as it caps these kernels). Paddle's own oneDNN calls, if made before,
  // keep the setting they found; a later call whose isa has no AMX is then not taken by a oneDNN that has it.
  // Never destroyed: at exit, oneDNN's own statics may already be gone when this library's destructors run.
  static OneDnn& instance(const Isa& first) {
    static OneDnn* const one = new OneDnn(first);
    return *one;
  }
  bool ready() const { return ready_; }
  bool has_amx() const { return has_amx_; }

  // dst[m, columns] (rows ld apart) = src[m, k] (bf16) @ weights (BF16 panels of `columns`) + bias (may be null), on
  // the calling thread's stream; false if oneDNN has no brgemm for the shape or a call fails.
  bool run(int64_t m, int64_t k, int64_t columns, int64_t ld, const uint16_t* src, const uint8_t* weights,
           const float* bias, float* dst) {
    const std::shared_ptr<Matmul> matmul = find(m, k, columns, ld, bias != nullptr);
    thread_local dnnl_stream_t stream = nullptr;  // a stream serves one thread; kept until the process ends
    if (!matmul->brgemm || (stream == nullptr && dnnl_stream_create(&stream, engine_, dnnl_stream_default_flags) !=
                                                     dnnl_success)) {
      return false;
    }
    const size_t scratch_bytes = dnnl_memory_desc_get_size(matmul->scratch);
    void* scratch = scratch_bytes > 0 ? static_cast<void*>(thread_buffer<uint8_t>(scratch_bytes)) : nullptr;
    dnnl_memory_t memories[5] = {};
    const std::pair<const_dnnl_memory_desc_t, const void*> operands[5] = {
        {matmul->src, src}, {matmul->weights, weights}, {matmul->dst, dst}, {matmul->scratch, scratch},
        {matmul->bias, bias}};
    const int args[5] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST, DNNL_ARG_SCRATCHPAD, DNNL_ARG_BIAS};
    dnnl_exec_arg_t exec_args[5];
    int count = 0;
    bool ok = true;
    for (int i = 0; i < 5 && ok; ++i) {
      if (i == 4 && bias == nullptr) break;
      ok = dnnl_memory_create(&memories[i], operands[i].first, engine_, const_cast<void*>(operands[i].second)) ==
           dnnl_success;
      exec_args[count++] = {args[i], memories[i]};
    }
    ok = ok && dnnl_primitive_execute(matmul->primitive, stream, count, exec_args) == dnnl_success &&
         dnnl_stream_wait(stream) == dnnl_success;
    for (dnnl_memory_t memory : memories) {
      if (memory != nullptr) dnnl_memory_destroy(memory);
    }
    return ok;
  }

 private:
  static constexpr size_t kMaxShapes = 256;

  explicit OneDnn(const Isa& first) {
    if (!onednn_available()) return;
    if (!first.amx) dnnl_set_max_cpu_isa(dnnl_cpu_isa_avx512_core_bf16);
    if (dnnl_engine_create(&engine_, dnnl_cpu, 0) != dnnl_success) return;
    const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
    has_amx_ = (isa & dnnl_cpu_isa_avx512_core_amx) == dnnl_cpu_isa_avx512_core_amx;
    ready_ = true;
  }

  std::shared_ptr<Matmul> find(int64_t m, int64_t k, int64_t columns, int64_t ld, bool with_bias) {
    const auto key = std::make_tuple(m, k, columns, ld, with_bias);
    std::lock_guard<std::mutex> hold(lock_);
    auto found = shapes_.find(key);
    if (found != shapes_.end()) return found->second;
    if (shapes_.size() >= kMaxShapes) shapes_.clear();
    auto made = create(m, k, columns, ld, with_bias);
    shapes_.emplace(key, made);
    return made;
  }

  std::shared_ptr<Matmul> create(int64_t m, int64_t k, int64_t columns, int64_t ld, bool with_bias) {
    auto made = std::make_shared<Matmul>();
    const dnnl_dims_t src_dims = {m, k}, weight_dims = {k, columns}, bias_dims = {1, columns};
    const dnnl_dims_t dst_dims = {m, columns}, dst_strides = {ld, 1};
    if (dnnl_memory_desc_create_with_tag(&made->src, 2, src_dims, dnnl_bf16, dnnl_ab) != dnnl_success ||
        dnnl_memory_desc_create_with_tag(&made->weights, 2, weight_dims, dnnl_bf16, dnnl_BA16a16b2a) != dnnl_success ||
        dnnl_memory_desc_create_with_strides(&made->dst, 2, dst_dims, dnnl_f32, dst_strides) != dnnl_success ||
        (with_bias &&
         dnnl_memory_desc_create_with_tag(&made->bias, 2, bias_dims, dnnl_f32, dnnl_ab) != dnnl_success)) {
      return made;
    }
    dnnl_primitive_attr_t attr = nullptr;
    if (dnnl_primitive_attr_create(&attr) != dnnl_success) return made;
    dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    const dnnl_status_t described = dnnl_matmul_primitive_desc_create(&made->description, engine_, made->src,
                                                                      made->weights, made->bias, made->dst, attr);
    dnnl_primitive_attr_destroy(attr);
    if (described != dnnl_success) return made;
    const char* implementation = nullptr;
    dnnl_primitive_desc_query(made->description, dnnl_query_impl_info_str, 0, &implementation);
    if (implementation == nullptr || std::strncmp(implementation, "brg", 3) != 0) return made;
    made->scratch = dnnl_primitive_desc_query_md(made->description, dnnl_query_scratchpad_md, 0);
    made->brgemm = dnnl_primitive_create(&made->primitive, made->description) == dnnl_success;
    return made;
  }

  bool ready_ = false, has_amx_ = false;
  dnnl_engine_t engine_ = nullptr;
  std::mutex lock_;
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, bool>, std::shared_ptr<Matmul>> shapes_;
};

// oneDNN kept to the calling thread while it lives. Paddle's oneDNN runs on the OpenMP of Intel's libiomp5 (Paddle
// loads it first), these kernels on GCC's libgomp: two pools of threads on the same cores, each spinning while the
// other computes (a 512 x 576 x 960 GEMM took 2.6-4.0 ms on oneDNN's own threads between these kernels' calls,
// against 1.5 with both pools told to sleep at once, on a 2-core Zen 4). So each of these kernels' threads runs a
// part of the GEMM on oneDNN with one thread: libiomp5's thread count for this thread is set to 1 and restored.
class OneThreadOfOneDnn {
 public:
  OneThreadOfOneDnn() {
    if (iomp().set == nullptr) return;
    saved_ = iomp().get();
    iomp().set(1);
  }
  ~OneThreadOfOneDnn() {
    if (iomp().set != nullptr) iomp().set(saved_);
  }

 private:
  // libiomp5's omp_get_max_threads and omp_set_num_threads where Paddle loaded it (else null: oneDNN on libgomp runs
  // nested in these kernels' threads, one thread each, as nested regions are off).
  struct Iomp {
    int (*get)() = nullptr;
    void (*set)(int) = nullptr;
  };
  static const Iomp& iomp() {
    static const Iomp found = [] {
      Iomp functions;
      void* library = dlopen("libiomp5.so", RTLD_NOW | RTLD_NOLOAD);
      if (library == nullptr) return functions;
      functions.get = reinterpret_cast<int (*)()>(dlsym(library, "omp_get_max_threads"));
      if (functions.get != nullptr) {
        functions.set = reinterpret_cast<void (*)(int)>(dlsym(library, "omp_set_num_threads"));
      }
      return functions;
    }();
    return found;
  }
  int saved_ = 1;
};

}  // namespace

bool onednn_available() {
  static const bool available = [] {
    const dnnl_version_t* version = dnnl_version();  // touches no ISA setting
    return version != nullptr && version->major == DNNL_VERSION_MAJOR;
  }();
  return available;
}

int onednn_version() {
  const dnnl_version_t* version = dnnl_version();
  return version == nullptr ? 0 : version->major * 10000 + version->minor * 100 + version->patch;
}

bool onednn_routes(const Isa& isa, Format format, int64_t m, int64_t k) {
  return format == Format::kBF16 && isa.bf16 && isa.onednn_rows > 0 && m >= isa.onednn_rows && k % 16 == 0 &&
         !omp_in_parallel() && onednn_available();
}

bool onednn_gemm(const Isa& isa, Format format, const float* x, int64_t m, int64_t k, const uint8_t* packed,
                 int64_t n, const float* bias, float* y) {
  if (!onednn_routes(isa, format, m, k)) return false;
  OneDnn& one = OneDnn::instance(isa);
  if (!one.ready() || (one.has_amx() && !isa.amx)) return false;
  uint16_t* src = thread_buffer<uint16_t>(static_cast<size_t>(m * k) * sizeof(uint16_t));
  const int64_t panels = num_panels(n), panel = panel_bytes(Format::kBF16, k);
  bool failed = false;
#pragma omp parallel reduction(|| : failed)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < m; ++r) avx512_bf16::row_to_bf16(x + r * k, k, src + r * k);
    // The panels split evenly over the threads, each thread's on a matmul of its own (oneDNN one-threaded in it).
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t first = panels * t / threads, end = panels * (t + 1) / threads;
    if (first < end) {
      const int64_t n0 = first * kPanelWidth, columns = (end * kPanelWidth < n ? end * kPanelWidth : n) - n0;
      const OneThreadOfOneDnn one_thread;
      failed = !one.run(m, k, columns, n, src, packed + first * panel, bias == nullptr ? nullptr : bias + n0, y + n0);
    }
  }
  return !failed;
}

#else  // built without oneDNN: every GEMM stays on these kernels

bool onednn_available() { return false; }
int onednn_version() { return 0; }
bool onednn_routes(const Isa&, Format, int64_t, int64_t) { return false; }
bool onednn_gemm(const Isa&, Format, const float*, int64_t, int64_t, const uint8_t*, int64_t, const float*, float*) {
  return false;
}

#endif

}  // namespace bs::linear
