// Probe for the chain's loaders (session 11: the O-beside chain is bound by its loader groups, ~6.4k cycles a
// chunk each, also with 16 CTAs on an idle GPU): how long does one chunk's 64 KB (K, Q, X: two 64-column blocks
// each; W; this CTA's 64 V columns) take to land in shared memory
//   A  the kernel's way: 128 threads, 32 cp.async of 16 bytes each into the 128-byte swizzled tiles, wait_all;
//   B  TMA: one thread issues eight 64 x 64 boxes (cp.async.bulk.tensor, SWIZZLE_128B) on an mbarrier;
//   C  TMA with the next chunk's boxes issued before waiting for this one's (two stages in flight);
// at 16 CTAs (TP8-like) and 128 CTAs (TP1-like), and does TMA's 128-byte swizzle put every byte where the
// kernel's gmma::sw128_off does (K, Q, X, W tiles compared byte for byte, V decoded)? Standalone (no torch):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icsrc/include -Icsrc -I<cutlass include> \
//        benchmarks/tma_load_probe.cu -o /tmp/tma_probe && /tmp/tma_probe
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "examples/example_util.h"  // CUDA_OK

#include "flashqla/tma.cuh"
#include "flashqla/warp_mma.cuh"
#include "flashqla/wgmma.cuh"

using bf16 = __nv_bfloat16;
using flashqla::gmma::sw128_off;
using flashqla::warp::smem_addr;
constexpr int kC = 64, kD = 128, kT = 8192, kChunks = kT / kC;
constexpr uint32_t kChunkBytes = 8 * kC * 64 * sizeof(bf16);  // eight 64 x 64 boxes

struct alignas(1024) Stage {
  bf16 k[2][kC * 64], q[2][kC * 64], x[2][kC * 64], w[kC * 64], v[kC * 64];  // all 128-byte swizzled
};
struct Maps {
  CUtensorMap k, q, x, w, v;
};
struct Problem {
  const bf16 *k, *q, *x, *w, *v;
  int hq, hv;
};

using flashqla::tma::mbar_expect_tx;
using flashqla::tma::mbar_init;
using flashqla::tma::mbar_wait;
__device__ __forceinline__ void tma3(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(map), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// chunk c of the CTA's (head, V half): K and Q of the group's q/k head, X, W and V of the value head
__device__ void issue_tma(Stage& s, const Maps& m, uint64_t* bar, int c, int hq, int h, int vb) {
  mbar_expect_tx(bar, kChunkBytes);
  const int t0 = c * kC;
  for (int b = 0; b < 2; ++b) {
    tma3(s.k[b], &m.k, bar, 64 * b, hq, t0);
    tma3(s.q[b], &m.q, bar, 64 * b, hq, t0);
    tma3(s.x[b], &m.x, bar, 64 * b, h, t0);
  }
  tma3(s.w, &m.w, bar, 0, h, t0);
  tma3(s.v, &m.v, bar, 64 * vb, h, t0);
}
__device__ void issue_cp_async(Stage& s, const Problem& pr, int c, int hq, int h, int vb) {
  const int64_t t0 = int64_t(c) * kC;
  for (int i = threadIdx.x; i < kC * kD / 8; i += blockDim.x) {
    const int r = i >> 4, c8 = (i & 15) * 8, b = c8 >> 6;
    const int64_t row_qk = ((t0 + r) * pr.hq + hq) * kD, row_v = ((t0 + r) * pr.hv + h) * kD;
    flashqla::warp::cp_async_16(reinterpret_cast<char*>(s.k[b]) + sw128_off(r, c8 & 63), pr.k + row_qk + c8, true);
    flashqla::warp::cp_async_16(reinterpret_cast<char*>(s.q[b]) + sw128_off(r, c8 & 63), pr.q + row_qk + c8, true);
    flashqla::warp::cp_async_16(reinterpret_cast<char*>(s.x[b]) + sw128_off(r, c8 & 63), pr.x + row_v + c8, true);
  }
  for (int i = threadIdx.x; i < kC * 64 / 8; i += blockDim.x) {
    const int r = i >> 3, c8 = (i & 7) * 8;
    flashqla::warp::cp_async_16(reinterpret_cast<char*>(s.w) + sw128_off(r, c8),
                                pr.w + ((t0 + r) * pr.hv + h) * 64 + c8, true);
    flashqla::warp::cp_async_16(reinterpret_cast<char*>(s.v) + sw128_off(r, c8),
                                pr.v + ((t0 + r) * pr.hv + h) * kD + 64 * vb + c8, true);
  }
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// mode 0: cp.async (A), 1: TMA one at a time (B), 2: TMA two in flight (C). cycles[blockIdx]: thread 0's cycles
// from the first issue to the last chunk landed. dump (CTA 0, chunk 0 of mode's stage 0) for the layout check.
__global__ void __launch_bounds__(128, 1) probe(const __grid_constant__ Maps m, const Problem pr, int mode,
                                                long long* cycles, Stage* dump) {
  extern __shared__ __align__(1024) unsigned char raw[];
  Stage* st = reinterpret_cast<Stage*>(flashqla::gmma::align_smem_1024(raw));  // (as shared memory, not generic)
  __shared__ uint64_t bars[2];
  const int h = blockIdx.x % pr.hv, vb = (blockIdx.x / pr.hv) & 1, hq = h / (pr.hv / pr.hq);
  if (threadIdx.x == 0) {
    mbar_init(&bars[0]);
    mbar_init(&bars[1]);
  }
  __syncthreads();
  const long long t_start = clock64();
  if (mode == 0) {
    for (int c = 0; c < kChunks; ++c) {
      issue_cp_async(st[0], pr, c, hq, h, vb);
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      __syncthreads();
      if (c == 0 && blockIdx.x == 0)
        for (int i = threadIdx.x; i < int(sizeof(Stage) / 16); i += blockDim.x)
          reinterpret_cast<uint4*>(dump)[i] = reinterpret_cast<const uint4*>(st)[i];
      __syncthreads();
    }
  } else {
    const int inflight = mode == 2 ? 2 : 1;
    if (threadIdx.x == 0)
      for (int c = 0; c < inflight; ++c) issue_tma(st[c], m, &bars[c], c, hq, h, vb);
    for (int c = 0; c < kChunks; ++c) {
      const int s = c % inflight;
      mbar_wait(&bars[s], (c / inflight) & 1);
      if (c == 0 && blockIdx.x == 0)
        for (int i = threadIdx.x; i < int(sizeof(Stage) / 16); i += blockDim.x)
          reinterpret_cast<uint4*>(dump)[i] = reinterpret_cast<const uint4*>(st)[i];
      __syncthreads();  // every thread is done with stage s before it is refilled
      if (threadIdx.x == 0 && c + inflight < kChunks) issue_tma(st[s], m, &bars[s], c + inflight, hq, h, vb);
    }
  }
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - t_start;
}

// [T, heads, cols] bf16 rows, boxes of 64 rows x 64 columns of one head, 128-byte swizzle, zero fill past the end
static CUtensorMap make_map(PFN_cuTensorMapEncodeTiled_v12000 enc, const void* base, int heads, int cols) {
  CUtensorMap m;
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(heads), cuuint64_t(kT)};
  const cuuint64_t strides[2] = {cuuint64_t(cols) * 2, cuuint64_t(cols) * 2 * heads};
  const cuuint32_t box[3] = {64, 1, 64}, estr[3] = {1, 1, 1};
  const CUresult r = enc(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box, estr,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return m;
}

int main() {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = flashqla::tma::encode_fn();  // (the library's entry point)
  if (enc == nullptr) {
    std::printf("cuTensorMapEncodeTiled not available\n");
    return 1;
  }
  int clk_khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  const int configs[2][2] = {{2, 8}, {16, 64}};  // (hq, hv): 16 CTAs (TP8-like), 128 CTAs (TP1-like)
  Stage* dump[3];
  for (auto& d : dump) CUDA_OK(cudaMalloc(&d, sizeof(Stage)));
  long long* cycles = nullptr;
  CUDA_OK(cudaMalloc(&cycles, sizeof(long long) * 256));
  const size_t smem = 2 * sizeof(Stage) + 1024;
  CUDA_OK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  int bad = 0;
  for (const auto& cfg : configs) {
    const int hq = cfg[0], hv = cfg[1], ctas = 2 * hv;
    const size_t n_qk = size_t(kT) * hq * kD, n_v = size_t(kT) * hv * kD, n_w = size_t(kT) * hv * 64;
    std::vector<bf16> host(n_v);
    bf16 *k, *q, *x, *w, *v;
    CUDA_OK(cudaMalloc(&k, n_qk * 2));
    CUDA_OK(cudaMalloc(&q, n_qk * 2));
    CUDA_OK(cudaMalloc(&x, n_v * 2));
    CUDA_OK(cudaMalloc(&w, n_w * 2));
    CUDA_OK(cudaMalloc(&v, n_v * 2));
    for (size_t i = 0; i < n_v; ++i) host[i] = __float2bfloat16(float(int(i * 2654435761u % 2001) - 1000) / 256.f);
    CUDA_OK(cudaMemcpy(k, host.data(), n_qk * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(q, host.data() + 7, n_qk * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(x, host.data(), n_v * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(w, host.data() + 3, n_w * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(v, host.data() + 11, n_v * 2 - 22, cudaMemcpyHostToDevice));
    const Maps m{make_map(enc, k, hq, kD), make_map(enc, q, hq, kD), make_map(enc, x, hv, kD), make_map(enc, w, hv, 64),
                 make_map(enc, v, hv, kD)};
    const Problem pr{k, q, x, w, v, hq, hv};
    const char* names[3] = {"cp.async, 128 threads (the kernel's)", "TMA, one chunk in flight", "TMA, two chunks in flight"};
    for (int mode = 0; mode < 3; ++mode) {
      for (int rep = 0; rep < 2; ++rep) probe<<<ctas, 128, smem>>>(m, pr, mode, cycles, dump[mode]);  // (warm, timed)
      CUDA_OK(cudaGetLastError());
      CUDA_OK(cudaDeviceSynchronize());
      std::vector<long long> cyc(ctas);
      CUDA_OK(cudaMemcpy(cyc.data(), cycles, sizeof(long long) * ctas, cudaMemcpyDeviceToHost));
      double mean = 0;
      for (long long c : cyc) mean += double(c) / ctas;
      std::printf("%3d CTAs (%2d/%2d heads) %-38s %7.0f cycles a chunk (%.2f us), %5.1f B/cycle per CTA\n", ctas, hq, hv,
                  names[mode], mean / kChunks, mean / kChunks / (clk_khz / 1000.0), kChunkBytes / (mean / kChunks));
    }
    // the layout check: TMA's 128-byte swizzle against sw128_off (the cp.async dump), byte for byte
    std::vector<unsigned char> a(sizeof(Stage)), b(sizeof(Stage));
    CUDA_OK(cudaMemcpy(a.data(), dump[0], sizeof(Stage), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(b.data(), dump[1], sizeof(Stage), cudaMemcpyDeviceToHost));
    size_t diff = 0;
    for (size_t i = 0; i < a.size(); ++i) diff += a[i] != b[i];
    std::printf("%3d CTAs: TMA's SWIZZLE_128B tiles against sw128_off: %zu of %zu bytes differ %s\n", ctas, diff, a.size(),
                diff == 0 ? "OK" : "BAD");
    bad += diff != 0;
    for (bf16* ptr : {k, q, x, w, v}) CUDA_OK(cudaFree(ptr));
  }
  return bad != 0;
}
