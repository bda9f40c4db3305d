// C entry points to every kernel, for the standalone harness (tests/gpu/, ctypes over device
// pointers) and, compiled as C++ with the SIMT emulation, for the CPU tests (host pointers). No
// Paddle here; the Paddle ops (*_ops.cu) are another thin layer over the same launchers.
//
// Every function returns 0 on success and otherwise an error code, with bs_last_error() saying why.
// dtype: 0 float32, 1 bfloat16, 2 float16 (numeric.cuh's Dtype). cache_dtype, the KV cache's: the dtype's own,
// 3 int8 or 4 fp8 e4m3 (8-bit rows of uint8 bytes: kv_rows.cuh).
#include <string>

#include "activation_kernels.cuh"
#include "attention_kernels.cuh"
#include "norm_kernels.cuh"
#include "rope_cache_kernels.cuh"
#include "step_input_kernels.cuh"

namespace {

using namespace bs::gpu;

thread_local std::string last_error;

int report(Status status, const char* problem = nullptr) {
  if (problem != nullptr) {
    last_error = problem;
    return static_cast<int>(kInvalidArgument);
  }
  last_error = status == kSuccess ? "" : status_text(status);
  return static_cast<int>(status);
}

template <class Body>
int with_dtype(int dtype, Body body) {
  if (dtype < 0 || dtype > static_cast<int>(Dtype::kFloat16)) {
    return report(kInvalidArgument, "dtype must be 0 (float32), 1 (bfloat16) or 2 (float16)");
  }
  return report(dispatch_dtype(static_cast<Dtype>(dtype), body));
}

// body(T{}, Cache{}) for the activations' dtype and the cache's.
template <class Body>
int with_kv_dtypes(int dtype, int cache_dtype, Body body) {
  const bool cache_known = cache_dtype == dtype || cache_dtype == static_cast<int>(Dtype::kInt8) ||
                           cache_dtype == static_cast<int>(Dtype::kFp8E4M3);
  if (dtype < 0 || dtype > static_cast<int>(Dtype::kFloat16) || !cache_known) {
    return report(kInvalidArgument,
                  "dtype must be 0 (float32), 1 (bfloat16) or 2 (float16), cache_dtype the dtype, 3 (int8) or 4 "
                  "(fp8 e4m3)");
  }
  return report(dispatch_kv_dtypes(static_cast<Dtype>(dtype), static_cast<Dtype>(cache_dtype), body));
}

AttentionShape attention_shape(int64_t num_tokens, int64_t num_requests, int64_t table_width, int num_heads,
                               int num_kv_heads, int head_dim, int block_size, int64_t sliding_window) {
  return {num_tokens, num_requests, table_width, num_heads, num_kv_heads, head_dim, block_size, sliding_window};
}

}  // namespace

extern "C" {

const char* bs_last_error() { return last_error.c_str(); }

int bs_add_rms_norm(int dtype, const void* x, const void* residual, const void* weight, void* out, void* summed,
                    int64_t rows, int64_t width, float eps, void* stream) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const AddRmsNormParams<T> p{static_cast<const T*>(x), static_cast<const T*>(residual),
                                static_cast<const T*>(weight), static_cast<T*>(out), static_cast<T*>(summed),
                                rows, width, eps};
    return launch_add_rms_norm(p, static_cast<Stream>(stream));
  });
}

int bs_silu_and_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t width, void* stream) {
  return with_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const SiluAndMulParams<T> p{static_cast<const T*>(gate_up), static_cast<T*>(out), rows, width};
    return launch_silu_and_mul(p, static_cast<Stream>(stream));
  });
}

int bs_rope_write_kv(int dtype, int cache_dtype, const void* qkv, const int64_t* positions, const float* cos,
                     const float* sin, const int64_t* slot_mapping, void* key_cache, void* value_cache, void* query,
                     int64_t tokens, int64_t num_slots, int64_t max_position, int num_heads, int num_kv_heads,
                     int head_dim, void* stream) {
  return with_kv_dtypes(dtype, cache_dtype, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using Cache = decltype(cache_tag);
    const RopeWriteKvParams<T, Cache> p{static_cast<const T*>(qkv), positions, cos, sin, slot_mapping,
                                        static_cast<Cache*>(key_cache), static_cast<Cache*>(value_cache),
                                        static_cast<T*>(query), tokens, num_slots, max_position, num_heads,
                                        num_kv_heads, head_dim};
    return launch_rope_write_kv(p, static_cast<Stream>(stream));
  });
}

// plan_out: query_tile, split_keys, max_splits, workspace_floats, shared_bytes.
int bs_plan_attention(int64_t num_tokens, int64_t num_requests, int64_t table_width, int num_heads, int num_kv_heads,
                      int head_dim, int block_size, int64_t sliding_window, int query_tile, int num_sms,
                      int64_t* plan_out) {
  const AttentionShape shape = attention_shape(num_tokens, num_requests, table_width, num_heads, num_kv_heads,
                                               head_dim, block_size, sliding_window);
  if (const char* problem = attention_shape_problem(shape)) return report(kInvalidArgument, problem);
  const AttentionPlan plan = plan_attention(shape, query_tile, num_sms);
  plan_out[0] = plan.query_tile;
  plan_out[1] = plan.split_keys;
  plan_out[2] = plan.max_splits;
  plan_out[3] = plan.workspace_floats;
  plan_out[4] = static_cast<int64_t>(plan.shared_bytes);
  return report(kSuccess);
}

// workspace: the plan's workspace_floats floats (may be null when that is 0). sliding_window and
// softcap: 0 for none (the op's attributes).
int bs_paged_attention(int dtype, int cache_dtype, const void* query, const void* key_cache, const void* value_cache,
                       const int64_t* query_start, const int64_t* context_lens, const int64_t* block_table, void* out,
                       float* workspace, int64_t num_tokens, int64_t num_requests, int64_t table_width, int num_heads,
                       int num_kv_heads, int head_dim, int block_size, int64_t sliding_window, float softcap,
                       int query_tile, int num_sms, void* stream) {
  const AttentionShape shape = attention_shape(num_tokens, num_requests, table_width, num_heads, num_kv_heads,
                                               head_dim, block_size, sliding_window);
  if (const char* problem = attention_shape_problem(shape)) return report(kInvalidArgument, problem);
  if (const char* problem = softcap_problem(softcap)) return report(kInvalidArgument, problem);
  const AttentionPlan plan = plan_attention(shape, query_tile, num_sms);
  return with_kv_dtypes(dtype, cache_dtype, [&](auto tag, auto cache_tag) {
    using T = decltype(tag);
    using Cache = decltype(cache_tag);
    const PagedAttentionParams<T, Cache> p{static_cast<const T*>(query), static_cast<const Cache*>(key_cache),
                                           static_cast<const Cache*>(value_cache), query_start, context_lens,
                                           block_table, static_cast<T*>(out), workspace, shape, plan,
                                           1.0f / sqrtf(static_cast<float>(head_dim)), softcap};
    return launch_paged_attention(p, static_cast<Stream>(stream));
  });
}

int bs_prepare_step_inputs(const int64_t* delta, int64_t num_requests, int64_t num_tokens, int64_t* block_tables,
                           int64_t table_stride, int64_t num_slots, const int64_t* last_sampled, int64_t block_size,
                           int64_t table_width, int64_t* input_ids, int64_t* positions, int64_t* slot_mapping,
                           int64_t* query_start, int64_t* context_lens, int64_t* block_table, void* stream) {
  const StepInputParams p{delta,        num_requests, num_tokens,   block_tables, table_stride, num_slots,
                          last_sampled, block_size,   table_width,  input_ids,    positions,    slot_mapping,
                          query_start,  context_lens, block_table};
  return report(launch_prepare_step_inputs(p, static_cast<Stream>(stream)));
}

}  // extern "C"
