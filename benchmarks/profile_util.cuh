// Shared by the standalone profilers of benchmarks/ (no cuRAND, no torch): random device fills and a dense
// bf16 problem described by the forward's parameter struct.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "examples/example_util.h"  // CUDA_OK (for main)
#include "flashqla/flashqla.h"

// CUDA_OK returns from main; helpers exit instead
inline void exit_on_error(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

__device__ inline float hash_uniform(uint64_t i, uint32_t seed) {  // [0, 1)
  uint64_t x = i * 0x9E3779B97F4A7C15ull + seed;
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return (x >> 40) * (1.0f / 16777216.0f);
}
// p[i] = uniform in [lo, hi), converted to T
template <typename T>
__global__ void fill(T* p, int64_t n, float lo, float hi, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<T>(lo + (hi - lo) * hash_uniform(i, seed));
}

template <typename T>
T* device_random(int64_t n, float lo, float hi, uint32_t seed) {
  T* p = nullptr;
  exit_on_error(cudaMalloc(&p, n * sizeof(T)), "cudaMalloc");
  fill<<<1024, 256>>>(p, n, lo, hi, seed);
  exit_on_error(cudaGetLastError(), "fill");
  return p;
}

// B dense sequences of T tokens each, hq/hv heads, K = V = 128, bf16 q/k/v (and o), fp32 g (log-decays in
// [-0.08, 0)) and beta: random inputs, o allocated, everything contiguous [B, T, H, D].
inline flashqla_gdn_fwd_params_t dense_bf16_batch(int64_t B, int64_t T, int64_t hq, int64_t hv) {
  constexpr int64_t D = 128;
  const int64_t rows = B * T;
  flashqla_gdn_fwd_params_t p{};
  p.q = device_random<__nv_bfloat16>(rows * hq * D, -0.15f, 0.15f, 1);
  p.k = device_random<__nv_bfloat16>(rows * hq * D, -0.15f, 0.15f, 2);
  p.v = device_random<__nv_bfloat16>(rows * hv * D, -1.f, 1.f, 3);
  p.o = device_random<__nv_bfloat16>(rows * hv * D, 0.f, 0.f, 0);
  p.g = device_random<float>(rows * hv, -0.08f, 0.f, 4);
  p.beta = device_random<float>(rows * hv, 0.f, 1.f, 5);
  p.qkv_dtype = FLASHQLA_BFLOAT16;
  p.g_dtype = p.beta_dtype = FLASHQLA_FLOAT32;
  p.q_stride_batch = p.k_stride_batch = T * hq * D;
  p.q_stride_time = p.k_stride_time = hq * D;
  p.q_stride_head = p.k_stride_head = D;
  p.v_stride_batch = p.o_stride_batch = T * hv * D;
  p.v_stride_time = p.o_stride_time = hv * D;
  p.v_stride_head = p.o_stride_head = D;
  p.g_stride_batch = p.beta_stride_batch = T * hv;
  p.g_stride_time = p.beta_stride_time = hv;
  p.g_stride_head = p.beta_stride_head = 1;
  p.batch = B; p.seqlen = T; p.heads_qk = hq; p.heads_v = hv; p.head_dim_k = D; p.head_dim_v = D;
  p.num_seqs = B; p.scale = 0.08838834764831845f;
  return p;
}
// One dense sequence (the profilers' default problem)
inline flashqla_gdn_fwd_params_t dense_bf16_problem(int64_t T, int64_t hq, int64_t hv) {
  return dense_bf16_batch(1, T, hq, hv);
}

// Zero a __device__ counter array (the phase timers').
template <typename Symbol>
void zero_symbol(const Symbol& counters) {
  const std::vector<char> zeros(sizeof(Symbol), 0);
  exit_on_error(cudaMemcpyToSymbol(counters, zeros.data(), sizeof(Symbol)), "zeroing the counters");
}

// A warm-up call, then reset() (e.g. zero_symbol of the timers), then one call timed by CUDA events: its ms.
template <typename Launch, typename Reset>
float warm_then_time(Launch&& launch, Reset&& reset) {
  exit_on_error(launch(), "warm-up launch");
  exit_on_error(cudaDeviceSynchronize(), "warm-up");
  reset();
  cudaEvent_t e0, e1;
  exit_on_error(cudaEventCreate(&e0), "cudaEventCreate");
  exit_on_error(cudaEventCreate(&e1), "cudaEventCreate");
  exit_on_error(cudaEventRecord(e0), "cudaEventRecord");
  exit_on_error(launch(), "timed launch");
  exit_on_error(cudaEventRecord(e1), "cudaEventRecord");
  exit_on_error(cudaDeviceSynchronize(), "timed call");
  float ms = 0;
  exit_on_error(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}
