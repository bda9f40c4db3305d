// A CPU emulation of the CUDA subset in simt.cuh, for tests on machines without a GPU.
//
// A launch runs the grid's blocks one after another; the threads of a block are fibers (ucontext) on
// the calling thread, taking turns: each runs until it reaches __syncthreads() or returns, and a
// round of turns ends only when every thread of the block has, so __syncthreads() is a barrier.
// Shared memory is one buffer the block's threads share. Warp reductions go through a per-block
// array between two barriers, which is why they must be reached by the whole block. (OpenMP threads
// before: on a 2-core machine, the barriers of 128-thread blocks spent their time switching threads,
// and the kernels' own arithmetic was under 1% of a check's profile.) Types: __nv_bfloat16 and __half
// are 16-bit patterns with CUDA's round-to-nearest-even conversions. Never built by nvcc.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __global__
#define __launch_bounds__(...)
#define BS_HOST_DEVICE
#define BS_DEVICE inline
#define BS_LAUNCH(kernel, grid, block, shared_bytes, stream, ...) \
  ((void)(stream), ::bs::gpu::emu::launch(kernel, (grid), (block), (shared_bytes), __VA_ARGS__))
#define BS_DYNAMIC_SHARED(name) unsigned char* name = ::bs::gpu::emu::shared_memory()

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct __nv_bfloat16 {
  uint16_t bits;
};

struct __half {
  uint16_t bits;
};

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};

struct alignas(16) float4 {
  float x, y, z, w;
};

inline float __bfloat162float(__nv_bfloat16 value) {
  const uint32_t bits = static_cast<uint32_t>(value.bits) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

inline __nv_bfloat16 __float2bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return {static_cast<uint16_t>((bits >> 16) | 0x40)};  // stays a (quiet) NaN
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest, ties to even
  return {static_cast<uint16_t>(bits >> 16)};
}

inline float __half2float(__half value) {
  _Float16 half;
  std::memcpy(&half, &value.bits, sizeof(half));
  return static_cast<float>(half);
}

inline __half __float2half(float value) {
  const _Float16 half = static_cast<_Float16>(value);  // IEEE round to nearest, ties to even
  __half result;
  std::memcpy(&result.bits, &half, sizeof(half));
  return result;
}

// CUDA's float intrinsics that the kernels use where a result must be bit-exact (never contracted into an FMA):
// IEEE round-to-nearest-even, as plain C++ float arithmetic is (built with -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float value) { return static_cast<int>(std::nearbyint(value)); }  // ties to even

inline float __uint_as_float(unsigned bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline unsigned __float_as_uint(float value) {
  unsigned bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

namespace bs::gpu {

using Status = int;
using Stream = void*;
constexpr Status kSuccess = 0;
constexpr Status kInvalidArgument = 1;

inline const char* status_text(Status status) { return status == kSuccess ? "success" : "invalid argument"; }

namespace emu {

struct Index3 {
  unsigned x, y, z;
};

inline Index3 thread_index;  // the running fiber's
inline Index3 block_index, block_dim, grid_dim;

struct BlockMemory {
  unsigned char* shared = nullptr;
  float* lanes = nullptr;  // one float per thread: the warp shuffles' exchange
};
inline BlockMemory block_memory;

inline unsigned char* shared_memory() { return block_memory.shared; }

inline Status last_status = kSuccess;

// The block's threads as fibers: each with its own stack, run in turns from `scheduler`.
struct Fibers {
  // Each fiber's stack, its lowest page a guard: a kernel that overflows its stack faults instead of writing over
  // the next fiber's. Mapped once for the most threads a launch has had; only the pages a fiber touches are backed.
  static constexpr size_t kStackBytes = 256 * 1024, kGuardBytes = 4096;
  struct Fiber {
    ucontext_t context;
    bool done;
  };
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  size_t stack_count = 0;
  int running = 0;
  void (*body)(void*) = nullptr;  // the kernel's call, the same for every thread of the launch
  void* call = nullptr;
};
inline Fibers fibers;

inline void fiber_entry() {
  fibers.body(fibers.call);
  fibers.fibers[fibers.running].done = true;  // returning resumes the scheduler (uc_link)
}

// Back to the scheduler until every thread of the block has reached a barrier or returned.
inline void yield_to_block() { swapcontext(&fibers.fibers[fibers.running].context, &fibers.scheduler); }

// One block: every thread from its start, in turns from one barrier to the next, until all have returned.
inline void run_block(int threads) {
  if (fibers.stack_count < static_cast<size_t>(threads)) {
    if (fibers.stacks != nullptr) munmap(fibers.stacks, fibers.stack_count * Fibers::kStackBytes);
    void* mapped = mmap(nullptr, threads * Fibers::kStackBytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapped == MAP_FAILED) std::abort();
    fibers.stacks = static_cast<char*>(mapped);
    fibers.stack_count = threads;
    for (int i = 0; i < threads; ++i) mprotect(fibers.stacks + i * Fibers::kStackBytes, Fibers::kGuardBytes, PROT_NONE);
  }
  fibers.fibers.resize(threads);
  for (int i = 0; i < threads; ++i) {
    Fibers::Fiber& fiber = fibers.fibers[i];
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fibers.stacks + i * Fibers::kStackBytes;
    fiber.context.uc_stack.ss_size = Fibers::kStackBytes;
    fiber.context.uc_link = &fibers.scheduler;
    fiber.done = false;
    makecontext(&fiber.context, fiber_entry, 0);
  }
  for (bool waiting = true; waiting;) {  // one round: each thread that has not returned, to its next barrier
    waiting = false;
    for (int i = 0; i < threads; ++i) {
      if (fibers.fibers[i].done) continue;
      fibers.running = i;
      thread_index = {static_cast<unsigned>(i), 0, 0};
      swapcontext(&fibers.scheduler, &fibers.fibers[i].context);
      waiting = waiting || !fibers.fibers[i].done;
    }
  }
}

// Runs kernel(args...) for every block of `grid`, each with `block.x` threads.
template <class Kernel, class... Args>
Status launch(Kernel kernel, dim3 grid, dim3 block, size_t shared_bytes, Args... args) {
  const int threads = static_cast<int>(block.x);
  if (block.y != 1 || block.z != 1 || threads % 32 != 0 || threads > 1024) return last_status = kInvalidArgument;
  struct alignas(16) Chunk {
    unsigned char bytes[16];
  };
  std::vector<Chunk> shared(shared_bytes / sizeof(Chunk) + 1);
  std::vector<float> lanes(threads);
  block_memory = {shared.front().bytes, lanes.data()};
  block_dim = {block.x, 1, 1};
  grid_dim = {grid.x, grid.y, grid.z};
  auto call = [&] { kernel(args...); };
  fibers.body = [](void* of) { (*static_cast<decltype(call)*>(of))(); };
  fibers.call = &call;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        block_index = {x, y, z};
        run_block(threads);
      }
    }
  }
  return last_status = kSuccess;
}

}  // namespace emu

inline int multiprocessor_count(int) { return 1; }

inline Status launch_status() {
  const Status status = emu::last_status;
  emu::last_status = kSuccess;
  return status;
}

template <class Kernel>
Status allow_shared_memory(Kernel, size_t) {
  return kSuccess;
}

inline void __syncthreads_emulated() { emu::yield_to_block(); }

// A warp's butterfly reduction: every lane publishes its value, then each replays the 32-lane
// butterfly of its warp in CUDA's order (round by round, value op partner), so all lanes end with
// the same bits as __shfl_xor_sync would give them. Two barriers instead of two per round.
template <class Op>
inline float warp_butterfly(float value, Op op) {
  const unsigned me = emu::thread_index.x, first_lane = me / 32 * 32;
  emu::block_memory.lanes[me] = value;
  __syncthreads_emulated();
  float lanes[32];
  for (int lane = 0; lane < 32; ++lane) lanes[lane] = emu::block_memory.lanes[first_lane + lane];
  __syncthreads_emulated();
  for (int offset = 16; offset > 0; offset /= 2) {
    float next[32];
    for (int lane = 0; lane < 32; ++lane) next[lane] = op(lanes[lane], lanes[lane ^ offset]);
    std::memcpy(lanes, next, sizeof(lanes));
  }
  return lanes[me - first_lane];
}

inline float warp_sum(float value) {
  return warp_butterfly(value, [](float a, float b) { return a + b; });
}

inline float warp_max(float value) {
  return warp_butterfly(value, [](float a, float b) { return std::fmax(a, b); });
}

}  // namespace bs::gpu

#define threadIdx (::bs::gpu::emu::thread_index)
#define blockIdx (::bs::gpu::emu::block_index)
#define blockDim (::bs::gpu::emu::block_dim)
#define gridDim (::bs::gpu::emu::grid_dim)
#define __syncthreads ::bs::gpu::__syncthreads_emulated
