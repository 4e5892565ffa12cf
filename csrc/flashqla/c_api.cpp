// The C API: validates parameter structs, checks the device, dispatches to the
// launchers and turns failures into status codes plus a per-thread message.
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"
#include "kernels.h"

namespace {

thread_local std::string g_last_error;

flashqla_status_t fail(flashqla_status_t status, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  g_last_error = buf;
  return status;
}

flashqla_status_t ok() {
  g_last_error.clear();
  return FLASHQLA_SUCCESS;
}

flashqla_status_t from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ok();
  return fail(FLASHQLA_ERROR_CUDA, "%s: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

// Packed sequences (cu_seqlens given): batch 1, at least min_seqs sequences, an int32 / int64 index. The values
// themselves are the kernels' to clamp (they are on the device).
flashqla_status_t check_packed(int64_t batch, flashqla_dtype_t dtype, int64_t num_seqs, int64_t min_seqs) {
  if (batch != 1)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "cu_seqlens requires batch == 1 (got %lld)", (long long)batch);
  if (num_seqs < min_seqs)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "num_seqs must be >= %lld with cu_seqlens (got %lld)",
                (long long)min_seqs, (long long)num_seqs);
  if (dtype != FLASHQLA_INT32 && dtype != FLASHQLA_INT64)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "cu_seqlens dtype must be int32 or int64");
  return FLASHQLA_SUCCESS;
}

bool is_float_dtype(flashqla_dtype_t d) {
  return d == FLASHQLA_FLOAT32 || d == FLASHQLA_BFLOAT16 || d == FLASHQLA_FLOAT16;
}

// The device the stream's work runs on is the current device.
flashqla_status_t check_current_device() {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return from_cuda(err, "cudaGetDevice");
  return flashqla_check_device(dev);
}

}  // namespace

extern "C" {

const char* flashqla_version(void) { return "0.1.0"; }

const char* flashqla_status_string(flashqla_status_t status) {
  switch (status) {
    case FLASHQLA_SUCCESS: return "success";
    case FLASHQLA_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case FLASHQLA_ERROR_UNSUPPORTED: return "unsupported";
    case FLASHQLA_ERROR_NO_DEVICE: return "no sm_90 device";
    case FLASHQLA_ERROR_CUDA: return "CUDA error";
  }
  return "unknown status";
}

const char* flashqla_last_error(void) { return g_last_error.c_str(); }

flashqla_status_t flashqla_check_device(int device) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return fail(FLASHQLA_ERROR_NO_DEVICE, "device %d is not usable: %s", device, cudaGetErrorString(err));
  }
  if (major != 9 || minor != 0)
    return fail(FLASHQLA_ERROR_NO_DEVICE, "device %d has compute capability %d.%d; flashqla kernels need 9.0 (H100/H200)",
                device, major, minor);
  return ok();
}

flashqla_status_t flashqla_chunk_local_cumsum(const flashqla_chunk_cumsum_params_t* p, cudaStream_t stream) {
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "negative size: batch=%lld seqlen=%lld heads=%lld",
                (long long)p->batch, (long long)p->seqlen, (long long)p->heads);
  if (p->heads > 65535LL * 32)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "heads=%lld is larger than supported (%lld)", (long long)p->heads,
                65535LL * 32);
  if (!is_float_dtype(p->g_dtype))
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "g dtype must be float32, bfloat16 or float16");
  if (p->chunk_size != 16 && p->chunk_size != 32 && p->chunk_size != 64 && p->chunk_size != 128)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "chunk_size=%d; supported: 16, 32, 64, 128", p->chunk_size);
  if (p->reverse != 0 && p->reverse != 1)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "reverse must be 0 or 1");
  if (p->cu_seqlens != nullptr) {
    const flashqla_status_t st = check_packed(p->batch, p->cu_seqlens_dtype, p->num_seqs, 1);
    if (st != FLASHQLA_SUCCESS) return st;
  }
  const bool empty = p->batch * p->seqlen == 0 || p->heads == 0;
  if (!empty && (p->g == nullptr || p->out == nullptr))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "g and out must not be NULL");
  if (empty) return ok();
  flashqla_status_t st = check_current_device();
  if (st != FLASHQLA_SUCCESS) return st;
  return from_cuda(flashqla::launch_chunk_local_cumsum(*p, stream), "chunk_local_cumsum launch");
}

}  // extern "C"

namespace {
// The checks shared by the forward and the backward entries; FLASHQLA_SUCCESS with *run = false: nothing to do.
flashqla_status_t validate_gdn(const flashqla_gdn_fwd_params_t* p, bool* run) {
  *run = false;
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  if (p->batch < 0 || p->seqlen < 0 || p->heads_qk <= 0 || p->heads_v <= 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "bad sizes: batch=%lld seqlen=%lld heads_qk=%lld heads_v=%lld",
                (long long)p->batch, (long long)p->seqlen, (long long)p->heads_qk, (long long)p->heads_v);
  if (p->heads_v % p->heads_qk != 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "heads_v=%lld must be a multiple of heads_qk=%lld",
                (long long)p->heads_v, (long long)p->heads_qk);
  if (p->head_dim_k != 128 || p->head_dim_v != 128)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "head dims K=%lld, V=%lld are not supported; supported: K = V = 128",
                (long long)p->head_dim_k, (long long)p->head_dim_v);
  if (p->qkv_dtype != FLASHQLA_BFLOAT16 && p->qkv_dtype != FLASHQLA_FLOAT16)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "q/k/v dtype must be bfloat16 or float16");
  if (p->g_dtype != FLASHQLA_FLOAT32 && p->g_dtype != FLASHQLA_BFLOAT16)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "g dtype must be float32 or bfloat16");
  if (!is_float_dtype(p->beta_dtype))
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "beta dtype must be float32, bfloat16 or float16");
  int64_t num_seqs = p->batch;
  if (p->cu_seqlens != nullptr) {
    const flashqla_status_t st = check_packed(p->batch, p->cu_seqlens_dtype, p->num_seqs, 1);
    if (st != FLASHQLA_SUCCESS) return st;
    num_seqs = p->num_seqs;
  } else if (p->num_seqs != p->batch) {
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "num_seqs (%lld) must equal batch (%lld) without cu_seqlens",
                (long long)p->num_seqs, (long long)p->batch);
  }
  if (num_seqs * p->heads_v * 2 + 32 > 0x7fffffffLL)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "too many sequences x heads for one launch");
  if (flashqla_gdn_chunk_bound(p) > 0x7fffffffLL || p->heads_v > 65535)  // the chunk-parallel grids
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "too many chunks or value heads for one launch");
  if (num_seqs == 0) return ok();  // *run stays false
  // 16-byte vector accesses: aligned bases, contiguous last dim (implied), strides in multiples of 8 elements.
  // With no tokens (T == 0) only the states are touched, and empty tensors may have NULL data.
  const bool has_tokens = p->batch * p->seqlen > 0;
  const void* ptrs[] = {p->q, p->k};
  for (const void* ptr : ptrs)
    if (has_tokens && (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0))
      return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "q and k must be non-NULL and 16-byte aligned");
  if (has_tokens && p->v == nullptr && p->o != nullptr)  // NULL v (zeros) only for summaries
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "v may be NULL (zeros) only with o = NULL");
  if (p->v != nullptr && reinterpret_cast<uintptr_t>(p->v) % 16 != 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "v must be 16-byte aligned");
  if (p->o != nullptr && reinterpret_cast<uintptr_t>(p->o) % 16 != 0)  // NULL: summaries only
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "o must be 16-byte aligned");
  const int64_t strides[] = {p->q_stride_batch, p->q_stride_time, p->q_stride_head, p->k_stride_batch,
                             p->k_stride_time,  p->k_stride_head, p->v_stride_batch, p->v_stride_time,
                             p->v_stride_head,  p->o_stride_batch, p->o_stride_time, p->o_stride_head};
  for (int64_t s : strides)
    if (s % 8 != 0)
      return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "q/k/v/o strides must be multiples of 8 elements (got %lld)",
                  (long long)s);
  if (has_tokens && (p->g == nullptr || p->beta == nullptr))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "g and beta must not be NULL");
  if ((p->initial_state && reinterpret_cast<uintptr_t>(p->initial_state) % 32) ||
      (p->final_state && reinterpret_cast<uintptr_t>(p->final_state) % 32) ||
      (p->chunk_states && reinterpret_cast<uintptr_t>(p->chunk_states) % 32))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "initial_state, final_state and chunk_states must be 32-byte aligned");
  if (p->workspace && reinterpret_cast<uintptr_t>(p->workspace) % 16)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "workspace must be 16-byte aligned");
  if (p->prep_ready < 0 || p->prep_ready > 2)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "prep_ready must be 0, 1 or 2 (got %d)", (int)p->prep_ready);
  if (p->prep_ready && (p->workspace == nullptr || p->workspace_bytes < flashqla_gdn_fwd_workspace_bytes(p) +
                                                                           (p->prep_ready == 2
                                                                                ? flashqla_gdn_fwd_gates_workspace_bytes(p)
                                                                                : 0)))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "prep_ready needs the workspace of the call that filled it (2: with the gates after X and W)");
  if (p->prep_workers < 0 || p->prep_workers > 4096)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "prep_workers must be in [0, 4096] (got %d)", (int)p->prep_workers);
  if (p->seq_order && reinterpret_cast<uintptr_t>(p->seq_order) % 4)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "seq_order must be 4-byte aligned");
  flashqla_status_t st = check_current_device();
  if (st != FLASHQLA_SUCCESS) return st;
  *run = true;
  return ok();
}
bool aligned16(const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; }
// FLASHQLA_FWD_KERNEL=simple selects the v1 kernel (the correctness baseline), read once.
bool simple_forward() {
  static const bool simple = [] {
    const char* e = std::getenv("FLASHQLA_FWD_KERNEL");
    return e != nullptr && std::strcmp(e, "simple") == 0;
  }();
  return simple;
}
}  // namespace

extern "C" {

flashqla_status_t flashqla_gdn_fwd(const flashqla_gdn_fwd_params_t* p, cudaStream_t stream) {
  bool run = false;
  const flashqla_status_t vs = validate_gdn(p, &run);
  if (vs != FLASHQLA_SUCCESS || !run) return vs;
  const bool simple = simple_forward();
  if (simple && p->o == nullptr)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "o = NULL (summaries only) needs the default forward kernel (FLASHQLA_FWD_KERNEL=simple is set)");
  if (simple && p->chunk_states != nullptr)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "chunk_states needs the default forward kernel (FLASHQLA_FWD_KERNEL=simple is set)");
  const bool bf16 = p->qkv_dtype == FLASHQLA_BFLOAT16;
  const cudaError_t err = simple ? (bf16 ? flashqla::launch_gdn_fwd_simple_bf16(*p, stream)
                                         : flashqla::launch_gdn_fwd_simple_fp16(*p, stream))
                                 : (bf16 ? flashqla::launch_gdn_fwd_mma_bf16(*p, stream)
                                         : flashqla::launch_gdn_fwd_mma_fp16(*p, stream));
  return from_cuda(err, "gdn_fwd launch");
}

static flashqla_status_t cp_summaries(const flashqla_gdn_fwd_params_t* p, const float* transition_initial,
                                      float* transition_final, flashqla::ChainMerge merge, cudaStream_t stream) {
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  // (o: only as a merge's source, whose B pass writes O in the walks that may merge)
  if ((p->o != nullptr && merge.checkpoints == nullptr) || p->chunk_states != nullptr)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "cp_summaries: o and chunk_states must be NULL (summaries only)");
  if (p->final_state == nullptr || transition_final == nullptr)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "cp_summaries: final_state and transition_final must not be NULL");
  if (p->v == nullptr && p->batch * p->seqlen > 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "cp_summaries: v must not be NULL");
  flashqla_gdn_fwd_params_t t = *p;  // the transition pass: v = 0, its own initial and final states, no o
  t.v = nullptr;
  t.o = nullptr;
  t.initial_state = transition_initial;
  t.final_state = transition_final;
  bool run = false;
  flashqla_status_t vs = validate_gdn(p, &run);
  if (vs == FLASHQLA_SUCCESS && run) vs = validate_gdn(&t, &run);
  if (vs != FLASHQLA_SUCCESS || !run) return vs;
  if (simple_forward())
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "cp_summaries needs the default forward kernel (FLASHQLA_FWD_KERNEL=simple is set)");
  const bool bf16 = p->qkv_dtype == FLASHQLA_BFLOAT16;
  const cudaError_t err = bf16 ? flashqla::launch_gdn_fwd_summaries_bf16(*p, t, stream, merge)
                               : flashqla::launch_gdn_fwd_summaries_fp16(*p, t, stream, merge);
  if (err == cudaErrorNotSupported && merge.checkpoints != nullptr)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "cp_summaries_merge_source: the paired summaries launch cannot run here");
  return from_cuda(err, "gdn_fwd_cp_summaries launch");
}

flashqla_status_t flashqla_gdn_fwd_cp_summaries(const flashqla_gdn_fwd_params_t* p, const float* transition_initial,
                                                float* transition_final, cudaStream_t stream) {
  return cp_summaries(p, transition_initial, transition_final, {}, stream);
}

size_t flashqla_gdn_fwd_merge_bytes(const flashqla_gdn_fwd_params_t* p) {
  return p == nullptr || simple_forward() ? 0 : flashqla::gdn_fwd_merge_bytes(*p);
}

flashqla_status_t flashqla_gdn_fwd_cp_summaries_merge_source(const flashqla_gdn_fwd_params_t* p,
                                                             const float* transition_initial, float* transition_final,
                                                             void* chunk_states, float* checkpoints,
                                                             cudaStream_t stream) {
  if (checkpoints == nullptr || !aligned16(checkpoints) || reinterpret_cast<uintptr_t>(chunk_states) % 32 ||
      (p != nullptr && (chunk_states == nullptr) == (p->o == nullptr)))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "cp_summaries_merge_source: checkpoints (16-byte aligned) and either chunk_states (32-byte aligned) "
                "or params->o must be given");
  return cp_summaries(p, transition_initial, transition_final, {chunk_states, checkpoints, nullptr}, stream);
}

flashqla_status_t flashqla_gdn_fwd_merge(const flashqla_gdn_fwd_params_t* p, float* checkpoints,
                                         const float* source_final, cudaStream_t stream) {
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  if (checkpoints == nullptr || !aligned16(checkpoints))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "merge: checkpoints must be non-NULL and 16-byte aligned");
  const bool recompute = p->o == nullptr && p->chunk_states != nullptr && p->final_state == nullptr;
  const bool last_pass = p->o != nullptr && p->chunk_states == nullptr;
  if (!p->prep_ready || !(recompute || last_pass))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "merge: prep_ready, and either the state recompute (o and final_state NULL, chunk_states set) or the "
                "last pass (o set, chunk_states NULL)");
  if (p->final_state != nullptr && (source_final == nullptr || !aligned16(source_final)))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "merge: final_state needs the source's (source_final, 16-byte aligned)");
  bool run = false;
  const flashqla_status_t vs = validate_gdn(p, &run);
  if (vs != FLASHQLA_SUCCESS || !run) return vs;
  if (simple_forward())
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "merge needs the default forward kernel (FLASHQLA_FWD_KERNEL=simple is set)");
  const bool bf16 = p->qkv_dtype == FLASHQLA_BFLOAT16;
  const flashqla::ChainMerge merge{nullptr, checkpoints, source_final};
  const cudaError_t err = bf16 ? flashqla::launch_gdn_fwd_mma_bf16(*p, stream, merge)
                               : flashqla::launch_gdn_fwd_mma_fp16(*p, stream, merge);
  return from_cuda(err, "gdn_fwd_merge launch");
}

int64_t flashqla_gdn_chunk_bound(const flashqla_gdn_fwd_params_t* p) {
  return p == nullptr ? 0 : flashqla::chunk_bound(*p);
}

flashqla_status_t flashqla_gdn_bwd_grad(const flashqla_gdn_bwd_grad_params_t* p, cudaStream_t stream) {
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  flashqla_gdn_fwd_params_t f = p->fwd;
  f.o = nullptr;  // not written
  f.initial_state = nullptr;
  f.final_state = nullptr;
  f.chunk_states = nullptr;
  f.prep_ready = 0;
  if (f.v == nullptr && f.batch * f.seqlen > 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "v must not be NULL");
  bool run = false;
  const flashqla_status_t vs = validate_gdn(&f, &run);
  if (vs != FLASHQLA_SUCCESS || !run) return vs;
  if (flashqla_gdn_chunk_bound(&f) == 0) return ok();
  const void* need16[] = {p->dout, p->states, p->dh, p->dq, p->dk, p->dv};
  for (const void* ptr : need16)
    if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dout, states, dh, dq, dk and dv must be non-NULL and 16-byte aligned");
  if (p->dg == nullptr || p->dbeta == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dg and dbeta must not be NULL");
  if (p->dqk_dtype != FLASHQLA_FLOAT32 && p->dqk_dtype != f.qkv_dtype)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dqk_dtype must be FLOAT32 or qkv_dtype");
  if (f.use_qk_l2norm && p->dqk_dtype != FLASHQLA_FLOAT32)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "with use_qk_l2norm, dqk_dtype must be FLOAT32 (the l2norm backward, flashqla_l2norm_bwd, takes them)");
  if (reinterpret_cast<uintptr_t>(p->a) % 16 != 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "a must be 16-byte aligned");
  const int64_t strides[] = {p->dout_stride_batch, p->dout_stride_time, p->dout_stride_head};
  for (int64_t st : strides)
    if (st % 8 != 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dout strides must be multiples of 8 elements");
  const cudaError_t err = f.qkv_dtype == FLASHQLA_BFLOAT16 ? flashqla::launch_gdn_bwd_grad_bf16(*p, stream)
                                                           : flashqla::launch_gdn_bwd_grad_fp16(*p, stream);
  return from_cuda(err, "gdn_bwd_grad launch");
}

flashqla_status_t flashqla_l2norm_bwd(const flashqla_l2norm_bwd_params_t* p, cudaStream_t stream) {
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  if (p->batch < 0 || p->seqlen < 0 || p->heads < 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "negative size: batch=%lld seqlen=%lld heads=%lld",
                (long long)p->batch, (long long)p->seqlen, (long long)p->heads);
  if (p->x_dtype != FLASHQLA_BFLOAT16 && p->x_dtype != FLASHQLA_FLOAT16)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "x dtype must be bfloat16 or float16");
  if (p->cu_seqlens != nullptr) {  // (no sequence at all: every row is past the end, zeros)
    const flashqla_status_t st = check_packed(p->batch, p->cu_seqlens_dtype, p->num_seqs, 0);
    if (st != FLASHQLA_SUCCESS) return st;
  }
  if (p->batch * p->seqlen * p->heads == 0) return ok();
  if (p->x == nullptr || p->dy == nullptr || p->out == nullptr)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "x, dy and out must not be NULL");
  if (reinterpret_cast<uintptr_t>(p->x) % 8 != 0 || reinterpret_cast<uintptr_t>(p->out) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p->dy) % 16 != 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "x and out must be 8-byte aligned, dy 16-byte aligned");
  const int64_t strides[] = {p->x_stride_batch, p->x_stride_time, p->x_stride_head};
  for (int64_t st : strides)
    if (st % 4 != 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "x strides must be multiples of 4 elements");
  if (p->batch * p->seqlen * p->heads > (int64_t(1) << 33))  // (8 rows a block, at most 2^31 - 1 blocks)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "too many rows (%lld)", (long long)(p->batch * p->seqlen * p->heads));
  flashqla_status_t st = check_current_device();
  if (st != FLASHQLA_SUCCESS) return st;
  return from_cuda(flashqla::launch_l2norm_bwd(*p, stream), "l2norm_bwd launch");
}

// The forward's struct the dS chain's kernels read (v = dO, initial_state = dht, final_state = dh0, o unused),
// validated; *run false: nothing to do.
static flashqla_status_t bwd_dh_view(const flashqla_gdn_bwd_dh_params_t* p, flashqla_gdn_fwd_params_t* f, bool* run) {
  *run = false;
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  *f = p->fwd;
  // NULL dout is dO = 0 (exact parallelism's transition pass): then U = 0 too, so only W' comes from a prep's
  // workspace, which must exist (the prep reads dO)
  if (p->dout == nullptr && f->batch * f->seqlen > 0 && !f->prep_ready)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dout must not be NULL (NULL, dO = 0, needs fwd.prep_ready = 1)");
  f->v = p->dout;  // validated as v: alignment, strides
  f->v_stride_batch = p->dout_stride_batch;
  f->v_stride_time = p->dout_stride_time;
  f->v_stride_head = p->dout_stride_head;
  f->o = nullptr;
  f->initial_state = p->dht;
  f->final_state = p->dh0;
  f->chunk_states = nullptr;
  f->prep_ready = 0;  // the forward's workspace rule does not apply: checked against the dS chain's size below
  const flashqla_status_t vs = validate_gdn(f, run);
  if (vs != FLASHQLA_SUCCESS || !*run) return vs;
  if (reinterpret_cast<uintptr_t>(p->a) % 16 != 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "a must be 16-byte aligned");
  f->prep_ready = p->fwd.prep_ready;
  return ok();
}

static bool bwd_workspace_ok(const flashqla_gdn_bwd_dh_params_t* p) {
  return p->fwd.workspace != nullptr && p->fwd.workspace_bytes >= flashqla_gdn_bwd_dh_workspace_bytes(p);
}

static flashqla_status_t bwd_dh(const flashqla_gdn_bwd_dh_params_t* p, flashqla::DhMerge merge, cudaStream_t stream) {
  flashqla_gdn_fwd_params_t f;
  bool run = false;
  const flashqla_status_t vs = bwd_dh_view(p, &f, &run);
  if (vs != FLASHQLA_SUCCESS || !run) return vs;
  if (reinterpret_cast<uintptr_t>(p->dh) % 32) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dh must be 32-byte aligned");
  if (f.prep_ready && !bwd_workspace_ok(p))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "fwd.prep_ready needs the workspace flashqla_gdn_bwd_prep filled "
                                                 "(at least flashqla_gdn_bwd_dh_workspace_bytes)");
  const cudaError_t err = f.qkv_dtype == FLASHQLA_BFLOAT16
                              ? flashqla::launch_gdn_bwd_dh_bf16(f, p->dh, p->a, merge, stream)
                              : flashqla::launch_gdn_bwd_dh_fp16(f, p->dh, p->a, merge, stream);
  return from_cuda(err, "gdn_bwd_dh launch");
}

flashqla_status_t flashqla_gdn_bwd_dh(const flashqla_gdn_bwd_dh_params_t* p, cudaStream_t stream) {
  return bwd_dh(p, {}, stream);
}

flashqla_status_t flashqla_gdn_bwd_dh_merge_source(const flashqla_gdn_bwd_dh_params_t* p, cudaStream_t stream) {
  return bwd_dh(p, {true, nullptr}, stream);
}

flashqla_status_t flashqla_gdn_bwd_dh_merge(const flashqla_gdn_bwd_dh_params_t* p, const float* other_dh0,
                                            cudaStream_t stream) {
  if (p != nullptr && (other_dh0 == nullptr || !aligned16(other_dh0) ||
                       (p->dh == nullptr && p->fwd.batch * p->fwd.seqlen > 0)))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "merge: other_dh0 must be non-NULL and 16-byte aligned, and dh must hold the other run's dS'");
  return bwd_dh(p, {false, other_dh0}, stream);
}

flashqla_status_t flashqla_gdn_bwd_prep(const flashqla_gdn_bwd_dh_params_t* p, void* states_workspace,
                                        size_t states_workspace_bytes, cudaStream_t stream) {
  flashqla_gdn_fwd_params_t f;
  bool run = false;
  const flashqla_status_t vs = bwd_dh_view(p, &f, &run);
  if (vs != FLASHQLA_SUCCESS || !run) return vs;
  if (p->dout == nullptr && f.batch * f.seqlen > 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "dout must not be NULL");
  if (flashqla_gdn_chunk_bound(&f) == 0) return ok();
  if (!bwd_workspace_ok(p))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "fwd.workspace must hold at least flashqla_gdn_bwd_dh_workspace_bytes "
                                                 "(%zu): the prep's products stay there for flashqla_gdn_bwd_dh",
                flashqla_gdn_bwd_dh_workspace_bytes(p));
  if (states_workspace != nullptr &&
      (reinterpret_cast<uintptr_t>(states_workspace) % 16 != 0 ||
       states_workspace_bytes < flashqla::prep_workspace_bytes(f, flashqla::kFwdPrepCols)))
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT,
                "states_workspace must be 16-byte aligned and hold at least flashqla_gdn_fwd_workspace_bytes (%zu)",
                flashqla::prep_workspace_bytes(f, flashqla::kFwdPrepCols));
  // a states_workspace with room for the gates too gets them after X (flashqla_gdn_fwd's prep_ready = 2)
  const size_t xw = flashqla::prep_workspace_bytes(f, flashqla::kFwdPrepCols);
  float* gates = states_workspace != nullptr && states_workspace_bytes >= xw + flashqla::fwd_gate_workspace_bytes(f)
                     ? reinterpret_cast<float*>(static_cast<char*>(states_workspace) + xw)
                     : nullptr;
  const cudaError_t err = f.qkv_dtype == FLASHQLA_BFLOAT16
                              ? flashqla::launch_gdn_bwd_prep_bf16(f, p->a, states_workspace, gates, stream)
                              : flashqla::launch_gdn_bwd_prep_fp16(f, p->a, states_workspace, gates, stream);
  return from_cuda(err, "gdn_bwd_prep launch");
}

flashqla_status_t flashqla_gdn_cp_scan(const flashqla_gdn_cp_scan_params_t* p, cudaStream_t stream) {
  if (p == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "params is NULL");
  if (p->num_seqs < 0 || p->segments < 0 || p->heads < 0)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "negative size: num_seqs=%lld segments=%lld heads=%lld",
                (long long)p->num_seqs, (long long)p->segments, (long long)p->heads);
  if (p->head_dim_k != 128 || p->head_dim_v != 128)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "head dims K=%lld, V=%lld are not supported; supported: K = V = 128",
                (long long)p->head_dim_k, (long long)p->head_dim_v);
  if (p->last_dtype != FLASHQLA_INT64) return fail(FLASHQLA_ERROR_UNSUPPORTED, "last must be int64");
  if (p->reverse != 0 && p->reverse != 1)
    return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "reverse must be 0 or 1, got %d", (int)p->reverse);
  if (p->num_seqs * p->heads > 0x7fffffffLL)
    return fail(FLASHQLA_ERROR_UNSUPPORTED, "too many sequences x heads for one launch");
  if (p->num_seqs == 0 || p->heads == 0 || p->segments == 0) return ok();
  const void* ptrs[] = {p->phi, p->b, p->init};
  for (const void* ptr : ptrs)
    if (ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 != 0)
      return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "phi, b and init must be non-NULL and 16-byte aligned");
  if (reinterpret_cast<uintptr_t>(p->h0) % 16 != 0) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "h0 must be 16-byte aligned");
  if (p->last == nullptr) return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "last must not be NULL");
  flashqla_status_t st = check_current_device();
  if (st != FLASHQLA_SUCCESS) return st;
  return from_cuda(flashqla::launch_gdn_cp_scan(*p, stream), "gdn_cp_scan launch");
}

size_t flashqla_gdn_fwd_workspace_bytes(const flashqla_gdn_fwd_params_t* p) {
  if (p == nullptr || !flashqla::fwd_split_mode()) return 0;
  return flashqla::prep_workspace_bytes(*p, flashqla::kFwdPrepCols);
}

size_t flashqla_gdn_fwd_gates_workspace_bytes(const flashqla_gdn_fwd_params_t* p) {
  if (p == nullptr || !flashqla::fwd_split_mode()) return 0;
  return flashqla::fwd_gate_workspace_bytes(*p);
}

size_t flashqla_gdn_bwd_dh_workspace_bytes(const flashqla_gdn_bwd_dh_params_t* p) {
  return p == nullptr ? 0 : flashqla::prep_workspace_bytes(p->fwd, flashqla::kBwdPrepCols);
}

}  // extern "C"
