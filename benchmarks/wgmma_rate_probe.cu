// Probe for the fused reverse kernel's budget (NOTES, "The fused reverse kernel: the plan"): how many cycles does a
// C x 128-deep bf16 product (64 rows x N columns, eight k16 steps of wgmma m64nNk16, both operands 128-byte
// swizzled K-major tiles in shared memory, as the gradient kernel's products) take on one SM
//  - alone, issued and waited for (the latency a serial chain of products sees), and
//  - with several products in flight per warpgroup (depth) and several warpgroups issuing at once (the rate
//    the SM's tensor cores sustain for that shape)?
// N = 32 is a V block of 32 columns (the V split in four), N = 64 the gradient kernel's column groups. Also the
// tf32 m64n32k8 product of the same depth in fp32 (the tf32 pair). Standalone (no torch; the operands' values
// do not matter, they are small and finite):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc/include -Icsrc -I<cutlass include> \
//        benchmarks/wgmma_rate_probe.cu -o /tmp/wgmma_rate && /tmp/wgmma_rate
// Prints, per shape, warpgroups and depth: cycles per product per warpgroup (median over warpgroups of the
// timed loop's average) and the SM's bf16 / tf32 FLOP per cycle (against ~4096 dense bf16 at the H200's peak).
#include <algorithm>
#include <cstdio>
#include <vector>

#include "examples/example_util.h"  // CUDA_OK

#include "flashqla/warp_mma.cuh"
#include "flashqla/wgmma.cuh"

using bf16 = __nv_bfloat16;
namespace gmma = flashqla::gmma;

constexpr int kRows = 64, kDepthK = 128;            // a product: 64 x N over 128 (eight k16 / sixteen k8 steps)
constexpr int kReps = 256;                          // timed products per slot
constexpr int kMaxN = 64;
constexpr int kABytes = kRows * kDepthK * 4;        // room for fp32 operands too (the tf32 product)
constexpr int kBBytes = kMaxN * kDepthK * 4;
constexpr int kSmem = kABytes + kBBytes + 1024;     // + the slack align_smem_1024 takes

// One k-step's descriptor of a K-major swizzled tile (rows of 128 bytes in blocks of `block` bytes, 8-row
// groups 1024 bytes apart): the step's bytes `step_bytes` apart within a 128-byte row.
__device__ uint64_t kmajor_step(const unsigned char* tile, int step, int steps_per_block, int step_bytes, int block) {
  return gmma::make_desc_sw128(tile + (step / steps_per_block) * block + (step % steps_per_block) * step_bytes, 16,
                               1024);
}

// kTf32: m64n32k8 in tf32 (N must be 32); else bf16 m64nNk16.
template <int N, bool kTf32, int kDepth>
__global__ void __launch_bounds__(384, 1) rate_kernel(long long* cycles, float* sink) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = gmma::align_smem_1024(smem_raw);
  unsigned char* a = base;
  unsigned char* b = base + kABytes;
  for (int i = threadIdx.x; i < (kABytes + kBBytes) / 4; i += blockDim.x) {
    const float x = 1.0f / 64 + (i % 7) * (1.0f / 1024);
    if (kTf32) {
      reinterpret_cast<float*>(base)[i] = x;
    } else {
      reinterpret_cast<bf16*>(base)[2 * i] = __float2bfloat16(x);
      reinterpret_cast<bf16*>(base)[2 * i + 1] = __float2bfloat16(-x);
    }
  }
  gmma::fence_async_smem();
  __syncthreads();
  // bf16: 64 elements (128 bytes) a row per block, k16 steps 32 bytes apart, 4 a block, 8 steps;
  // tf32: 32 elements a row per block, k8 steps 32 bytes apart, 4 a block, 16 steps
  constexpr int kSteps = kTf32 ? kDepthK / 8 : kDepthK / 16;
  const int wg = threadIdx.x / 128;
  float acc[kDepth][N / 2];
  long long t0 = 0;
  for (int rep = -8; rep < kReps; ++rep) {  // 8 untimed rounds first
    if (rep == 0) t0 = clock64();
#pragma unroll
    for (int d = 0; d < kDepth; ++d)
#pragma unroll
      for (int i = 0; i < N / 2; ++i) acc[d][i] = 0.f;
    gmma::fence();
#pragma unroll
    for (int d = 0; d < kDepth; ++d) gmma::pin(acc[d]);
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const uint64_t da = kmajor_step(a, s, 4, 32, kRows * 128);
        const uint64_t db = kmajor_step(b, s, 4, 32, N * 128);
        if constexpr (kTf32) {
          static_assert(N == 32, "tf32 is m64n32k8 here");
          gmma::wgmma_ss_tf32_n32(acc[d], da, db);
        } else {
          gmma::wgmma_ss<N, bf16>(acc[d], da, db);
        }
      }
    }
    gmma::commit();
    gmma::wait_all();
#pragma unroll
    for (int d = 0; d < kDepth; ++d) gmma::pin(acc[d]);
  }
  const long long t1 = clock64();
  float s = 0.f;
#pragma unroll
  for (int d = 0; d < kDepth; ++d)
#pragma unroll
    for (int i = 0; i < N / 2; ++i) s += acc[d][i];
  sink[threadIdx.x] = s;
  if (threadIdx.x % 128 == 0) cycles[wg] = t1 - t0;
}

template <int N, bool kTf32, int kDepth>
int run(int wgs) {
  auto kernel = rate_kernel<N, kTf32, kDepth>;
  CUDA_OK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  long long* d_cycles;
  float* d_sink;
  CUDA_OK(cudaMalloc(&d_cycles, 3 * sizeof(long long)));
  CUDA_OK(cudaMalloc(&d_sink, 384 * sizeof(float)));
  kernel<<<1, 128 * wgs, kSmem>>>(d_cycles, d_sink);  // (warm-up: module load, first-touch)
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  // the same launch timed by events too: session 18's figures exceeded the SM's peak, so the clock64 reading is
  // checked against wall time (kernel time covers the untimed rounds and the launch: an upper bound)
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  CUDA_OK(cudaEventRecord(e0));
  kernel<<<1, 128 * wgs, kSmem>>>(d_cycles, d_sink);
  CUDA_OK(cudaEventRecord(e1));
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaDeviceSynchronize());
  float ms = 0.f;
  CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
  CUDA_OK(cudaEventDestroy(e0));
  CUDA_OK(cudaEventDestroy(e1));
  std::vector<long long> cyc(wgs);
  CUDA_OK(cudaMemcpy(cyc.data(), d_cycles, wgs * sizeof(long long), cudaMemcpyDeviceToHost));
  std::sort(cyc.begin(), cyc.end());
  const double per_product = double(cyc[wgs / 2]) / (double(kReps) * kDepth);
  const double flop = 2.0 * kRows * N * kDepthK * kDepth * kReps * wgs;
  std::printf("%-5s m64n%-3d  warpgroups %d  depth %d  %7.0f cycles a product (per warpgroup)  %6.0f FLOP/cycle (SM)"
              "  kernel %.1f us (clock64 says %.1f us at 1980 MHz)\n",
              kTf32 ? "tf32" : "bf16", N, wgs, kDepth, per_product, flop / double(cyc.back()), 1000.0 * ms,
              double(cyc.back()) / 1980.0);
  CUDA_OK(cudaFree(d_cycles));
  CUDA_OK(cudaFree(d_sink));
  return 0;
}

template <int N, bool kTf32>
int sweep() {
  for (int wgs = 1; wgs <= 3; ++wgs)
    if (run<N, kTf32, 1>(wgs) || run<N, kTf32, 2>(wgs) || run<N, kTf32, 4>(wgs)) return 1;
  return 0;
}

int main() {
  int count = 0;
  cudaDeviceProp prop{};
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || cudaGetDeviceProperties(&prop, 0) != cudaSuccess ||
      prop.major != 9) {
    std::printf("SKIP: no sm_90 GPU\n");
    return 0;
  }
  return sweep<32, false>() || sweep<64, false>() || sweep<32, true>();
}
