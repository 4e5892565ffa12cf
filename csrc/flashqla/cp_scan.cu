// Exact context parallelism's scan (gdn-algorithm.md section 3, flashqla/_cp.py): a sequence cut into
// segments first..last has, per segment, the affine map S_end = Phi S_start + B (from the summaries passes);
// every segment's true initial state follows along the sequence,
//   init[first] = h0 (zeros without one),   init[i + 1] = Phi_i init[i] + B_i,
// in fp32 FMAs (or, reversed, the backward's end gradients: out[last] = h0, out[i - 1] = Phi_i^T out[i] + B_i). One CTA per (sequence, value head, kCols-column slice of V) walks its sequence's segments,
// so the whole scan is one launch. (It was two launches per rank, a copy and a cuBLAS GEMM, issued by the
// host one after the other: on TP8 1 x 8192, ~50 us of a 0.21 ms graph and ~130 us of host time per eager
// call.) Phi_{i+1} streams into shared memory (double-buffered) while Phi_i is applied: by TMA, four 128-row x
// 32-column boxes in the 128-byte swizzle issued by one thread (kTma, where the map can be made), or by cp.async
// from every thread into padded rows. (The phase timers, session 29: at TP8 1 x 8192 a step was ~5.8k cycles, of
// them ~1.2k issuing the 16 copies a thread and ~1.1k in the init / slice stores behind them, ~3.2k the FMAs.)
#include <cstdlib>

#include "common.h"
#include "kernels.h"
#include "tma.cuh"
#include "warp_mma.cuh"
#include "wgmma.cuh"  // align_smem_1024

namespace flashqla {
namespace {

constexpr int kDim = 128;           // K = V
constexpr int kThreads = 256;       // thread t: row t / 2, columns kCols / 2 * (t % 2) .. + kCols / 2
constexpr int kLdPhi = kDim + 4;    // padded Phi rows: a warp's 16 rows fall on distinct bank quads in pairs
constexpr int kPhiChunks = kDim * kDim / 4 / kThreads;  // 16-byte copies per thread per Phi

// kCols V columns per CTA: 16 (8 CTAs per sequence and head), or 8 where twice the CTAs still fit on the
// SMs (the per-step work halves; every CTA still streams the whole Phi_i)
template <int kCols>
struct alignas(1024) ScanSmem {
  // Phi_i and Phi_{i+1}: padded rows (cp.async), or four swizzled [128][32] boxes (TMA; 64 KB of the 66, each
  // buffer 1024-byte aligned: 66 KB is a multiple of 1 KB)
  float phi[2][kDim * kLdPhi];
  float s[kDim * kCols];            // the running state's slice, [K][kCols]
  uint64_t full[2];                 // (TMA) Phi's arrival in buffer b, one phase a fill
};
static_assert(sizeof(float) * kDim * kLdPhi % 1024 == 0, "the second Phi buffer 1024-byte aligned");
constexpr int kPhiBoxCols = 32;     // fp32 columns of a 128-byte swizzled box (tma::encode_state_rows)

// FLASHQLA_SCAN_TIMERS (benchmarks/profile_scan_phases.cu only): thread 0 of every CTA adds clock64() deltas per
// phase of the walk into g_scan_cycles (kScanMarks slots), slot kScanSteps counts the steps and kScanCtas the CTAs
// that walked (the tool divides by it). The library's build has none of it.
enum ScanMark : int {
  kScanPrologue,   // kernel start -> the loop: h0, B_first, the first Phi's issue
  kScanStore,      // init_i out, the state slice into shared memory
  kScanIssue,      // B_{i+1}'s load and Phi_{i+1}'s copies issued
  kScanWaitPhi,    // Phi_i landed: this thread's copies (cp.async.wait_group) or the TMA's mbarrier
  kScanBar1,       // the barrier before the products (everyone's copies and slice stores)
  kScanFma,        // acc = B_i + Phi_i S_i
  kScanBar2,       // the barrier after them
  kScanLast,       // the last init store and the exit's copy wait
  kScanSteps,
  kScanCtas,
  kScanMarks
};
#ifdef FLASHQLA_SCAN_TIMERS
__device__ unsigned long long g_scan_cycles[kScanMarks];
#define FLASHQLA_SCAN_MARK(m)                                                    \
  do {                                                                           \
    if (tid == 0) {                                                              \
      const long long now_ = clock64();                                          \
      atomicAdd(&g_scan_cycles[m], static_cast<unsigned long long>(now_ - t_mark)); \
      t_mark = now_;                                                             \
    }                                                                            \
  } while (0)
#else
#define FLASHQLA_SCAN_MARK(m) \
  do {                        \
  } while (0)
#endif

CUTLASS_DEVICE void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
CUTLASS_DEVICE void cp_wait_prior1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

CUTLASS_DEVICE void load_phi(float* dst, const float* src, int tid) {
#pragma unroll
  for (int j = 0; j < kPhiChunks; ++j) {
    const int e = (tid + j * kThreads) * 4, r = e / kDim, c = e % kDim;
    warp::cp_async_16(dst + r * kLdPhi + c, src + e, true);
  }
}

// (TMA) Phi of tile row0 (its first row in the [segments * heads * 128, 128] map) into buf, by one thread.
CUTLASS_DEVICE void tma_phi(float* buf, const CUtensorMap* map, uint64_t* full, int64_t row0) {
  tma::mbar_expect_tx(full, kDim * kDim * sizeof(float));
#pragma unroll
  for (int b = 0; b < kDim / kPhiBoxCols; ++b)
    tma::load_box2(buf + b * kDim * kPhiBoxCols, map, full, b * kPhiBoxCols, static_cast<int>(row0));
}

// kRev: the adjoint walk, for the backward's dS chain (its segments' end gradients): each sequence from its last
// segment back, out[last] = h0, out[i - 1] = Phi_i^T out[i] + B_i, Phi_i read transposed where it lies (so the
// op needs no reversed, transposed copy of Phi and of B; the same FMAs in the same order as the forward walk over
// such a copy, hence the same bits). The walk is the same loop over steps n = 0, 1, ... with segment seg(n).
// kRows (TMA only): rows of the slice per thread, kThreads / kRows threads a CTA. With 2, a thread's rows r and r + 64
// share each load of the state slice: half the slice's shared loads per FMA (its 128 LDS.128 a step served 512
// FFMAs; the loop was ~2.9k of a step's ~4.2k cycles, session 29), at half the warps.
template <int kCols, bool kTma, int kRows = 1, bool kRev = false>
__global__ void __launch_bounds__(kThreads / kRows, 1)
cp_scan_kernel(const flashqla_gdn_cp_scan_params_t p, const __grid_constant__ CUtensorMap phi_map) {
  constexpr int kPer = kCols / 2;  // outputs per thread and row
  static_assert(kDim * kCols == kPer * kThreads && kPer % 4 == 0, "whole float4s per thread");
  static_assert(kRows == 1 || (kRows == 2 && kTma), "two rows a thread: the TMA form (one thread issues the loads)");
  constexpr int kRowStep = kDim / kRows;  // a thread's rows: row, row + kRowStep, ...
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<ScanSmem<kCols>*>(gmma::align_smem_1024(smem_raw));
  const int tid = threadIdx.x;
  long long t_mark = 0;
#ifdef FLASHQLA_SCAN_TIMERS
  t_mark = clock64();
#endif
  (void)t_mark;
  const int64_t seq = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const int col0 = blockIdx.y * kCols;
  const int64_t* last = static_cast<const int64_t*>(p.last);
  // segments first..end of this sequence, clamped so a malformed `last` cannot send a read or write out of
  // bounds (it can only give wrong states)
  int64_t first = seq == 0 ? 0 : last[seq - 1] + 1, end = last[seq];
  first = first < 0 ? 0 : first;
  end = end >= p.segments ? p.segments - 1 : end;
  if (first > end) return;
  const int row = tid >> 1, cs = (tid & 1) * kPer;  // this thread's row and first column in the slice
  const int64_t head_kv = int64_t(kDim) * kDim;  // elements of one (segment, head) tile
  auto tile = [&](int64_t seg) { return (seg * p.heads + h) * head_kv; };
  const int64_t steps = end - first;  // the walk's products; step n maps segment seg(n) to seg(n + 1)
  auto seg = [&](int64_t n) { return kRev ? end - n : first + n; };

  if constexpr (kTma) {
    if (tid < 2) tma::mbar_init(&sm.full[tid]);
    __syncthreads();  // the barriers initialised before anyone waits on them
    if (tid == 0 && steps > 0) tma_phi(sm.phi[0], &phi_map, &sm.full[0], tile(seg(0)) / kDim);
  } else {
    if (steps > 0) load_phi(sm.phi[0], p.phi + tile(seg(0)), tid);
    cp_commit();
  }
  // (TMA) this thread's first Phi row in each buffer's boxes, and its 16-byte pieces' swizzled offsets: piece c of a
  // box row lands at piece c ^ (row % 8) (the same for its other rows: kRowStep is a multiple of 8)
  int piece_off[kPhiBoxCols / 4];
#pragma unroll
  for (int c = 0; c < kPhiBoxCols / 4; ++c) piece_off[c] = row * kPhiBoxCols + 4 * (c ^ (row & 7));
  // (kRev, TMA) Phi[k][r] for this thread's rows r (column r of Phi): box r / 32, row k of it, piece
  // ((r % 32) / 4) ^ (k % 8), word r % 4; tcol_off[m] is all of it but k * 32, for k % 8 = m. Without TMA: the padded
  // rows' k * kLdPhi + r. A warp's 16 rows read 16 distinct words of one box row (or padded row): no bank conflict.
  int tcol_off[kRows][8];
#pragma unroll
  for (int q = 0; q < kRows; ++q) {
    const int r = row + q * kRowStep;
#pragma unroll
    for (int m = 0; m < 8; ++m) tcol_off[q][m] = (r / kPhiBoxCols) * kDim * kPhiBoxCols + 4 * (((r % kPhiBoxCols) / 4) ^ m) + r % 4;
  }
  (void)tcol_off;
  // init[first] = h0 (or zeros); this thread's kPer values a row in registers
  float4 acc[kRows][kPer / 4];
#pragma unroll
  for (int q = 0; q < kRows; ++q) {
    const float4* src = p.h0 != nullptr ? reinterpret_cast<const float4*>(p.h0 + (seq * p.heads + h) * head_kv +
                                                                         int64_t(row + q * kRowStep) * kDim + col0 + cs)
                                        : nullptr;
#pragma unroll
    for (int j = 0; j < kPer / 4; ++j) acc[q][j] = src ? src[j] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float4 bnext[kRows][kPer / 4];
  auto load_b = [&](int64_t seg) {
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      const float4* src =
          reinterpret_cast<const float4*>(p.b + tile(seg) + int64_t(row + q * kRowStep) * kDim + col0 + cs);
#pragma unroll
      for (int j = 0; j < kPer / 4; ++j) bnext[q][j] = src[j];
    }
  };
  if (steps > 0) load_b(seg(0));
#ifdef FLASHQLA_SCAN_TIMERS
  if (tid == 0) atomicAdd(&g_scan_cycles[kScanCtas], 1ull);
#endif
  FLASHQLA_SCAN_MARK(kScanPrologue);
  for (int64_t n = 0;; ++n) {
#pragma unroll
    for (int q = 0; q < kRows; ++q) {
      float4* out = reinterpret_cast<float4*>(p.init + tile(seg(n)) + int64_t(row + q * kRowStep) * kDim + col0 + cs);
#pragma unroll
      for (int j = 0; j < kPer / 4; ++j) out[j] = acc[q][j];
    }
    if (n == steps) break;
#pragma unroll
    for (int q = 0; q < kRows; ++q)
#pragma unroll
      for (int j = 0; j < kPer / 4; ++j)
        *reinterpret_cast<float4*>(&sm.s[(row + q * kRowStep) * kCols + cs + 4 * j]) = acc[q][j];
    FLASHQLA_SCAN_MARK(kScanStore);
    // acc = B_i + Phi_i S_i. B_i was loaded a step ahead, and B_{i+1}'s loads are issued now: ncu measured the
    // first FMA waiting on B_i's load (long scoreboard, 36% of the stalls) when it was issued here
    float4 bv[kRows][kPer / 4];
#pragma unroll
    for (int q = 0; q < kRows; ++q)
#pragma unroll
      for (int j = 0; j < kPer / 4; ++j) bv[q][j] = bnext[q][j];
    if (n + 1 < steps) load_b(seg(n + 1));
    const int buf = static_cast<int>(n & 1);
    // the next Phi, while this one is applied (into the buffer the previous step's left: read before the last barrier)
    if constexpr (kTma) {
      if (tid == 0 && n + 1 < steps) tma_phi(sm.phi[buf ^ 1], &phi_map, &sm.full[buf ^ 1], tile(seg(n + 1)) / kDim);
    } else {
      if (n + 1 < steps) load_phi(sm.phi[buf ^ 1], p.phi + tile(seg(n + 1)), tid);
      cp_commit();
    }
    FLASHQLA_SCAN_MARK(kScanIssue);
    if constexpr (kTma)
      tma::mbar_wait(&sm.full[buf], static_cast<uint32_t>((n >> 1) & 1));  // buffer buf's fill n / 2
    else
      cp_wait_prior1();  // Phi_i has landed (this thread's copies), then everyone's, and the state slice
    FLASHQLA_SCAN_MARK(kScanWaitPhi);
    __syncthreads();
    FLASHQLA_SCAN_MARK(kScanBar1);
#pragma unroll
    for (int q = 0; q < kRows; ++q)
#pragma unroll
      for (int j = 0; j < kPer / 4; ++j) acc[q][j] = bv[q][j];
    const float* ph = kTma || kRev ? sm.phi[buf] : &sm.phi[buf][row * kLdPhi];
#pragma unroll (kTma ? 32 : 4)
    for (int k = 0; k < kDim; k += 4) {
      // (TMA: box k / 32, piece (k % 32) / 4 of this thread's rows: offsets known at compile time but the row's)
      float av[kRows][4];
#pragma unroll
      for (int q = 0; q < kRows; ++q) {
        if constexpr (kRev) {  // Phi^T's row: Phi's column, one word a k
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            if constexpr (kTma) av[q][kk] = ph[(k + kk) * kPhiBoxCols + tcol_off[q][(k + kk) & 7]];
            else av[q][kk] = ph[(k + kk) * kLdPhi + row + q * kRowStep];
        } else {
          const float4 a = *reinterpret_cast<const float4*>(
              kTma ? ph + (k / kPhiBoxCols) * kDim * kPhiBoxCols + q * kRowStep * kPhiBoxCols +
                         piece_off[(k % kPhiBoxCols) / 4]
                   : ph + k);
          av[q][0] = a.x, av[q][1] = a.y, av[q][2] = a.z, av[q][3] = a.w;
        }
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int j = 0; j < kPer / 4; ++j) {
          const float4 sv = *reinterpret_cast<const float4*>(&sm.s[(k + kk) * kCols + cs + 4 * j]);
#pragma unroll
          for (int q = 0; q < kRows; ++q) {  // (the same k order for every output as with one row a thread)
            acc[q][j].x = fmaf(av[q][kk], sv.x, acc[q][j].x); acc[q][j].y = fmaf(av[q][kk], sv.y, acc[q][j].y);
            acc[q][j].z = fmaf(av[q][kk], sv.z, acc[q][j].z); acc[q][j].w = fmaf(av[q][kk], sv.w, acc[q][j].w);
          }
        }
    }
#ifdef FLASHQLA_SCAN_TIMERS
    // (the marks read the results first: otherwise the FMAs can be scheduled past the clock read)
    if (tid == 0) asm volatile("" ::"f"(acc[0][0].x), "f"(acc[kRows - 1][kPer / 4 - 1].w));
#endif
    FLASHQLA_SCAN_MARK(kScanFma);
    __syncthreads();  // every read of the state slice and of Phi_i is done before they are rewritten
    FLASHQLA_SCAN_MARK(kScanBar2);
#ifdef FLASHQLA_SCAN_TIMERS
    if (tid == 0) atomicAdd(&g_scan_cycles[kScanSteps], 1ull);
#endif
  }
  warp::cp_async_wait_all();
  FLASHQLA_SCAN_MARK(kScanLast);
}

// FLASHQLA_SCAN_TMA=0: Phi by cp.async everywhere; else (1, unset) by TMA where the map can be made (the same
// values in the same FMA order: bitwise the same states). Rows a thread in the TMA form (the same FMAs in the same
// order again): FLASHQLA_SCAN_ROWS=1 or 2; unset, two at 8-column slices (TP8 1 x 8192 -2.3%, the scan 16.8 -> 13.8
// us), one at 16 (TP4 1 x 8192 +1.4% with two: half the warps for twice a thread's FMAs; session 30's A/B).
template <int kCols, bool kRev>
cudaError_t launch_cols(const flashqla_gdn_cp_scan_params_t& p, cudaStream_t stream) {
  const char* e = std::getenv("FLASHQLA_SCAN_TMA");
  CUtensorMap map{};
  const bool use_tma = !(e != nullptr && e[0] == '0') &&
                       tma::encode_state_rows(map, p.phi, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4,
                                              p.segments * p.heads * kDim);
  const char* r = std::getenv("FLASHQLA_SCAN_ROWS");
  const int rows = !use_tma ? 1 : r != nullptr && (r[0] == '1' || r[0] == '2') ? r[0] - '0' : kCols == 8 ? 2 : 1;
  const auto kernel = !use_tma ? cp_scan_kernel<kCols, false, 1, kRev>
                      : rows == 2 ? cp_scan_kernel<kCols, true, 2, kRev> : cp_scan_kernel<kCols, true, 1, kRev>;
  const int smem = static_cast<int>(sizeof(ScanSmem<kCols>) + 1024);  // (+ align_smem_1024's slack)
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.num_seqs * p.heads), kDim / kCols);
  kernel<<<grid, kThreads / rows, smem, stream>>>(p, map);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gdn_cp_scan(const flashqla_gdn_cp_scan_params_t& p, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.heads == 0 || p.segments == 0) return cudaSuccess;
  int dev = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  // FLASHQLA_SCAN_COLS (8, 16, 32; measurements): the slice width, else 8 where those CTAs fit on the SMs, else 16
  const char* e = std::getenv("FLASHQLA_SCAN_COLS");
  const int cols = e != nullptr ? std::atoi(e) : (p.num_seqs * p.heads * (kDim / 8) <= sms ? 8 : 16);
  if (p.reverse)
    return cols == 32 ? launch_cols<32, true>(p, stream) : cols == 8 ? launch_cols<8, true>(p, stream)
                                                                 : launch_cols<16, true>(p, stream);
  return cols == 32 ? launch_cols<32, false>(p, stream) : cols == 8 ? launch_cols<8, false>(p, stream)
                                                                : launch_cols<16, false>(p, stream);
}

}  // namespace flashqla
