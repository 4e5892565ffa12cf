// The C API: validates parameter structs, checks the device, dispatches to the
// launchers and turns failures into status codes plus a per-thread message.
#include <cstdarg>
#include <cstdio>
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
    if (p->batch != 1)
      return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "cu_seqlens requires batch == 1 (got %lld)", (long long)p->batch);
    if (p->num_seqs < 1)
      return fail(FLASHQLA_ERROR_INVALID_ARGUMENT, "num_seqs must be >= 1 with cu_seqlens (got %lld)",
                  (long long)p->num_seqs);
    if (p->cu_seqlens_dtype != FLASHQLA_INT32 && p->cu_seqlens_dtype != FLASHQLA_INT64)
      return fail(FLASHQLA_ERROR_UNSUPPORTED, "cu_seqlens dtype must be int32 or int64");
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
