/*
 * flashqla: Gated DeltaNet kernels for NVIDIA Hopper (sm_90a).
 *
 * Plain C API. Every entry point takes a parameter struct of raw device
 * pointers, element strides and sizes plus a cudaStream_t, launches
 * asynchronously on that stream, and returns a status code. It never
 * synchronises with the host and never allocates, so calls can be captured in
 * CUDA graphs. On failure, flashqla_last_error() returns a readable message
 * for the calling thread.
 *
 * Layout conventions (as in the PyTorch API, FLA's layout): tensors are
 * indexed [batch, time, head, dim]; strides are in elements. Packed
 * variable-length batches use batch = 1 and cu_seqlens [num_seqs + 1]
 * (int32 or int64); chunks restart at every sequence start.
 */
#ifndef FLASHQLA_FLASHQLA_H_
#define FLASHQLA_FLASHQLA_H_

#include <stdint.h>
#include <cuda_runtime_api.h>

#if defined(_WIN32)
#define FLASHQLA_API __declspec(dllexport)
#else
#define FLASHQLA_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define FLASHQLA_VERSION_MAJOR 0
#define FLASHQLA_VERSION_MINOR 1
#define FLASHQLA_VERSION_PATCH 0

typedef enum flashqla_status {
  FLASHQLA_SUCCESS = 0,
  FLASHQLA_ERROR_INVALID_ARGUMENT = 1, /* a parameter is malformed (null pointer, bad size, ...) */
  FLASHQLA_ERROR_UNSUPPORTED = 2,      /* well formed, but not supported (dtype, head dim, ...) */
  FLASHQLA_ERROR_NO_DEVICE = 3,        /* the current device is not an sm_90 GPU */
  FLASHQLA_ERROR_CUDA = 4              /* a CUDA runtime call failed; see flashqla_last_error() */
} flashqla_status_t;

typedef enum flashqla_dtype {
  FLASHQLA_FLOAT32 = 0,
  FLASHQLA_BFLOAT16 = 1,
  FLASHQLA_FLOAT16 = 2,
  FLASHQLA_INT32 = 3,
  FLASHQLA_INT64 = 4
} flashqla_dtype_t;

/* "0.1.0" */
FLASHQLA_API const char* flashqla_version(void);
/* Short name of a status code. */
FLASHQLA_API const char* flashqla_status_string(flashqla_status_t status);
/* Detailed message of the last failing call made by this thread ("" if none). */
FLASHQLA_API const char* flashqla_last_error(void);
/* FLASHQLA_SUCCESS if `device` is an sm_90 GPU the kernels were built for. */
FLASHQLA_API flashqla_status_t flashqla_check_device(int device);

/*
 * Chunk-local cumulative sum of the log-decay g, in fp32:
 *   forward: out[t] = scale * sum_{s = chunk_start(t)}^{t} g[s]
 *   reverse: out[t] = scale * sum_{s = t}^{chunk_end(t) - 1} g[s]
 * Chunks are chunk_size tokens long, aligned to each sequence's start; the
 * last chunk of a sequence may be partial. Positions that belong to no
 * sequence (past cu_seqlens[num_seqs]) are written as 0. Out-of-range
 * cu_seqlens values never cause out-of-bounds accesses.
 */
typedef struct flashqla_chunk_cumsum_params {
  const void* g;               /* [batch, seqlen, heads] */
  flashqla_dtype_t g_dtype;    /* FLOAT32, BFLOAT16 or FLOAT16 */
  int64_t g_stride_batch;
  int64_t g_stride_time;
  int64_t g_stride_head;
  float* out;                  /* [batch, seqlen, heads], contiguous */
  int64_t batch;
  int64_t seqlen;
  int64_t heads;
  const void* cu_seqlens;      /* NULL for dense batches; else [num_seqs + 1], batch must be 1 */
  flashqla_dtype_t cu_seqlens_dtype; /* INT32 or INT64 */
  int64_t num_seqs;
  int32_t chunk_size;          /* 16, 32, 64 or 128 */
  int32_t reverse;             /* 0 or 1 */
  float scale;                 /* 1.0f for a plain cumsum */
} flashqla_chunk_cumsum_params_t;

FLASHQLA_API flashqla_status_t flashqla_chunk_local_cumsum(const flashqla_chunk_cumsum_params_t* params,
                                                           cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FLASHQLA_FLASHQLA_H_ */
