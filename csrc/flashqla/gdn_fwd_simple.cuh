// Fused chunked gated-delta-rule forward, version 1 ("simple"): correct on
// every input the API accepts, written for clarity rather than speed. One CTA
// of 8 warps per (sequence, value head, 64-column V block) walks the sequence
// chunk by chunk (C = 64) with every operand in shared memory and the fp32
// state S (K x 64) in WMMA accumulator fragments. Tensor-core products use
// warp-level WMMA (mma.sync); the 64 x 64 unit-lower-triangular inverse is
// fp32 (16 x 16 diagonal blocks by forward substitution, merged 16 -> 32 -> 64).
// Math (gdn-algorithm.md section 2), per chunk with G = chunk-local cumsum of g:
//   A     = (I + StrictLower(diag(beta) K K^T))^-1
//   Y     = diag(beta) (V - diag(gamma) K S)
//   V_new = (Gamma * A) Y
//   O     = scale (diag(gamma) Q S + (Q K^T * Gamma) V_new)
//   S'    = gamma_C S + K^T diag(gamma_C / gamma) V_new
// The warp-specialised TMA/wgmma kernel replaces this one; it stays as the
// correctness baseline for it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <type_traits>

#include "gdn_fwd_common.cuh"

namespace flashqla {
namespace gdn_fwd_simple {

namespace wmma = nvcuda::wmma;

constexpr int kChunk = 64;
constexpr int kHeadDimK = 128;
constexpr int kHeadDimV = 128;
constexpr int kBlockV = 64;                  // V columns per CTA (exact split: columns are independent)
constexpr int kVBlocks = kHeadDimV / kBlockV;
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// Padded leading dimensions (elements) against bank conflicts; each keeps the
// 32-byte tile alignment WMMA needs.
constexpr int kLdK = kHeadDimK + 8;          // K, Q rows (16-bit)
constexpr int kLdH = 64 + 8;                 // 64-wide 16-bit tiles
constexpr int kLdF = 64 + 4;                 // 64-wide fp32 tiles
constexpr int kLdT = 32 + 4;                 // 32-wide fp32 temporaries

using FragAcc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Diagnostics only (benchmarks/profile_fwd_phases.cu): with FLASHQLA_PHASE_TIMERS,
// thread 0 of CTA 0 adds the cycles of each phase (barrier to barrier) to
// g_phase_cycles, so one run shows where a chunk's time goes.
enum Phase { kPhaseLoad, kPhaseGemm1, kPhaseElementwise, kPhaseInvDiag, kPhaseInvMerge, kPhaseGammaA,
             kPhaseVnew, kPhaseVnewCast, kPhasePvState, kPhaseOutput, kNumPhases };
#ifdef FLASHQLA_PHASE_TIMERS
__device__ unsigned long long g_phase_cycles[kNumPhases];
#define FLASHQLA_PHASE(ph)                                              \
  do {                                                                  \
    if (blockIdx.x == 0 && threadIdx.x == 0) {                          \
      const long long now_ = clock64();                                 \
      atomicAdd(&g_phase_cycles[ph], (unsigned long long)(now_ - t_mark)); \
      t_mark = now_;                                                    \
    }                                                                   \
  } while (0)
#else
#define FLASHQLA_PHASE(ph) do { } while (0)
#endif

template <typename T>
struct SharedStorage {
  alignas(128) T k[kChunk * kLdK];
  alignas(128) T q[kChunk * kLdK];
  alignas(128) T v[kChunk * kLdH];           // V, then Z = diag(gamma_C / gamma) V_new
  alignas(128) T s[kHeadDimK * kLdH];        // state rounded to T for the K S and Q S products
  alignas(128) T mt[kChunk * kLdH];          // Gamma * A
  alignas(128) T p[kChunk * kLdH];           // Q K^T * Gamma
  alignas(128) T y[kChunk * kLdH];           // Y, then V_new rounded to T
  alignas(128) float kk[kChunk * kLdF];      // K K^T, then L, then P V_new
  alignas(128) float qk[kChunk * kLdF];      // Q K^T, then V_new
  alignas(128) float ks[kChunk * kLdF];
  alignas(128) float qs[kChunk * kLdF];
  alignas(128) float a[kChunk * kLdF];       // the inverse A
  alignas(128) float tmp[32 * kLdT];
  alignas(128) float stage[kWarps][16 * 16]; // per-warp accumulator staging
  float G[kChunk], beta[kChunk], gamma[kChunk], decay_end[kChunk];
};

// acc += A[16 x K] * B[K x 16]; A and B point at the tile's first row / column.
template <int K, typename T, typename LayoutA, typename LayoutB>
CUTLASS_DEVICE void mma_tile(FragAcc& acc, const T* A, int lda, const T* B, int ldb) {
  constexpr bool kRowA = std::is_same<LayoutA, wmma::row_major>::value;
  constexpr bool kRowB = std::is_same<LayoutB, wmma::row_major>::value;
#pragma unroll
  for (int kk = 0; kk < K; kk += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, LayoutA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, LayoutB> fb;
    wmma::load_matrix_sync(fa, kRowA ? A + kk : A + kk * lda, lda);
    wmma::load_matrix_sync(fb, kRowB ? B + kk * ldb : B + kk, ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// C (64 x 64 fp32, ld kLdF) tile `tile` (0..15) = A (64 x K) * B (K x 64).
template <int K, typename T, typename LayoutA, typename LayoutB>
CUTLASS_DEVICE void gemm64_tile(int tile, const T* A, int lda, const T* B, int ldb, float* C) {
  constexpr bool kRowA = std::is_same<LayoutA, wmma::row_major>::value;
  constexpr bool kRowB = std::is_same<LayoutB, wmma::row_major>::value;
  const int tm = tile >> 2, tn = tile & 3;
  FragAcc acc;
  wmma::fill_fragment(acc, 0.f);
  mma_tile<K, T, LayoutA, LayoutB>(acc, kRowA ? A + tm * 16 * lda : A + tm * 16, lda,
                                   kRowB ? B + tn * 16 : B + tn * 16 * ldb, ldb);
  wmma::store_matrix_sync(C + tm * 16 * kLdF + tn * 16, acc, kLdF, wmma::mem_row_major);
}

template <typename T, typename IndexT>
__global__ void __launch_bounds__(kThreads, 1) gdn_fwd_simple_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<SharedStorage<T>*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t main_blocks = p.num_seqs * p.heads_v * kVBlocks;

  if (static_cast<int64_t>(blockIdx.x) >= main_blocks) {
    zero_rows_past_end<T, IndexT>(p, blockIdx.x - main_blocks, kTailBlocks, tid, kThreads);
    return;
  }

  const CtaTile ct = decode_cta<IndexT>(p, blockIdx.x, kVBlocks, kBlockV);
  const int64_t h = ct.h, n = ct.n, hq = ct.hq, b = ct.b, bos = ct.bos, eos = ct.eos, col0 = ct.col0;

  const T* qg = static_cast<const T*>(p.q) + b * p.q_stride_batch + hq * p.q_stride_head;
  const T* kg = static_cast<const T*>(p.k) + b * p.k_stride_batch + hq * p.k_stride_head;
  const T* vg = static_cast<const T*>(p.v) + b * p.v_stride_batch + h * p.v_stride_head + col0;
  T* og = static_cast<T*>(p.o) + b * p.o_stride_batch + h * p.o_stride_head + col0;
  const int64_t state_off = (n * p.heads_v + h) * int64_t(kHeadDimK) * kHeadDimV + col0;

  // The state: warp w owns rows [16w, 16w + 16) of S (K x 64), four 16 x 16 tiles.
  FragAcc s_frag[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (p.initial_state != nullptr)
      wmma::load_matrix_sync(s_frag[j], p.initial_state + state_off + warp * 16 * kHeadDimV + j * 16, kHeadDimV,
                             wmma::mem_row_major);
    else
      wmma::fill_fragment(s_frag[j], 0.f);
  }

  // S (fp32 fragments) -> sm.s rounded to T, through the warp's staging tile.
  auto publish_state = [&]() {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      wmma::store_matrix_sync(sm.stage[warp], s_frag[j], 16, wmma::mem_row_major);
      __syncwarp();
#pragma unroll
      for (int e = lane; e < 256; e += 32)
        sm.s[(warp * 16 + (e >> 4)) * kLdH + j * 16 + (e & 15)] = from_f<T>(sm.stage[warp][e]);
      __syncwarp();
    }
  };
  publish_state();

  const int64_t len = eos - bos;
#ifdef FLASHQLA_PHASE_TIMERS
  long long t_mark = clock64();
#endif
  for (int64_t c0 = 0; c0 < len; c0 += kChunk) {
    const int rows = static_cast<int>(len - c0 < kChunk ? len - c0 : kChunk);
    const int64_t t0 = bos + c0;

    // ---- load K, Q (optionally l2-normalised), V, g, beta; rows past the end are zero
#pragma unroll
    for (int it = 0; it < (kChunk * kHeadDimK / 8) / kThreads; ++it) {
      const int i = tid + it * kThreads, r = i >> 4, c8 = (i & 15) * 8;  // 16 lanes per row
      uint4 kv = make_uint4(0, 0, 0, 0), qv = make_uint4(0, 0, 0, 0);
      if (r < rows) {
        kv = *reinterpret_cast<const uint4*>(kg + (t0 + r) * p.k_stride_time + c8);
        qv = *reinterpret_cast<const uint4*>(qg + (t0 + r) * p.q_stride_time + c8);
      }
      if (p.use_qk_l2norm) {
        T* ke = reinterpret_cast<T*>(&kv);
        T* qe = reinterpret_cast<T*>(&qv);
        float sk = 0.f, sq = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          sk += to_f(ke[e]) * to_f(ke[e]);
          sq += to_f(qe[e]) * to_f(qe[e]);
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) {  // reduce over the row's 16 lanes
          sk += __shfl_xor_sync(0xffffffffu, sk, off);
          sq += __shfl_xor_sync(0xffffffffu, sq, off);
        }
        const float rk = rsqrtf(sk + kL2NormEps), rq = rsqrtf(sq + kL2NormEps);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          ke[e] = from_f<T>(to_f(ke[e]) * rk);
          qe[e] = from_f<T>(to_f(qe[e]) * rq);
        }
      }
      *reinterpret_cast<uint4*>(&sm.k[r * kLdK + c8]) = kv;
      *reinterpret_cast<uint4*>(&sm.q[r * kLdK + c8]) = qv;
    }
#pragma unroll
    for (int it = 0; it < (kChunk * kBlockV / 8) / kThreads; ++it) {
      const int i = tid + it * kThreads, r = i >> 3, c8 = (i & 7) * 8;
      uint4 vv = make_uint4(0, 0, 0, 0);
      if (r < rows) vv = *reinterpret_cast<const uint4*>(vg + (t0 + r) * p.v_stride_time + c8);
      *reinterpret_cast<uint4*>(&sm.v[r * kLdH + c8]) = vv;
    }
    if (tid < kChunk) {
      const bool ok = tid < rows;
      const int64_t t = t0 + tid;
      sm.G[tid] = ok ? load_scalar(p.g, p.g_dtype, b * p.g_stride_batch + t * p.g_stride_time + h * p.g_stride_head) : 0.f;
      sm.beta[tid] = ok ? load_scalar(p.beta, p.beta_dtype,
                                      b * p.beta_stride_batch + t * p.beta_stride_time + h * p.beta_stride_head) : 0.f;
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseLoad);

    // ---- chunk-local cumsum of g (warp 0), and K K^T, Q K^T, K S, Q S (all warps)
    if (warp == 0) {
      const float g0 = sm.G[2 * lane], g1 = sm.G[2 * lane + 1];
      float incl = g0 + g1;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += up;
      }
      const float excl = incl - (g0 + g1);
      const float Gc = __shfl_sync(0xffffffffu, incl, 31);  // padding has g = 0: the last real G
      const float G0 = excl + g0, G1 = incl;
      sm.G[2 * lane] = G0;
      sm.G[2 * lane + 1] = G1;
      sm.gamma[2 * lane] = gate_exp(G0);
      sm.gamma[2 * lane + 1] = gate_exp(G1);
      sm.decay_end[2 * lane] = gate_exp(Gc - G0);
      sm.decay_end[2 * lane + 1] = gate_exp(Gc - G1);
    }
    for (int t = warp; t < 64; t += kWarps) {
      const int which = t >> 4, tile = t & 15;
      if (which == 0)
        gemm64_tile<kHeadDimK, T, wmma::row_major, wmma::col_major>(tile, sm.k, kLdK, sm.k, kLdK, sm.kk);
      else if (which == 1)
        gemm64_tile<kHeadDimK, T, wmma::row_major, wmma::col_major>(tile, sm.q, kLdK, sm.k, kLdK, sm.qk);
      else if (which == 2)
        gemm64_tile<kHeadDimK, T, wmma::row_major, wmma::row_major>(tile, sm.k, kLdK, sm.s, kLdH, sm.ks);
      else
        gemm64_tile<kHeadDimK, T, wmma::row_major, wmma::row_major>(tile, sm.q, kLdK, sm.s, kLdH, sm.qs);
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseGemm1);

    // ---- L = StrictLower(diag(beta) K K^T); P = Q K^T * Gamma; Y = diag(beta)(V - diag(gamma) K S); A = 0
    for (int e = tid; e < kChunk * kChunk; e += kThreads) {
      const int i = e >> 6, j = e & 63;
      const float kkv = sm.kk[i * kLdF + j];
      sm.kk[i * kLdF + j] = j < i ? sm.beta[i] * kkv : 0.f;
      const float gam = j <= i ? gate_exp(sm.G[i] - sm.G[j]) : 0.f;
      sm.p[i * kLdH + j] = from_f<T>(sm.qk[i * kLdF + j] * gam);
      sm.y[i * kLdH + j] = from_f<T>(sm.beta[i] * (to_f(sm.v[i * kLdH + j]) - sm.gamma[i] * sm.ks[i * kLdF + j]));
      sm.a[i * kLdF + j] = 0.f;
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseElementwise);

    // ---- A = (I + L)^-1 in fp32. Diagonal 16 x 16 blocks: warp w < 4, lane c < 16 owns column c.
    if (warp < 4 && lane < 16) {
      const int o = warp * 16, c = lane;
      float x[16];
      unit_lower16_inverse_column(&sm.kk[o * kLdF + o], kLdF, c, x);
#pragma unroll
      for (int r = 0; r < 16; ++r) sm.a[(o + r) * kLdF + o + c] = x[r];
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseInvDiag);
    // 16 -> 32: for each 32-block pair q, A21 = -A22 (L21 A11)
    for (int e = tid; e < 2 * 256; e += kThreads) {
      const int pq = e >> 8, i = (e >> 4) & 15, j = e & 15, o = pq * 32;
      float acc = 0.f;
#pragma unroll
      for (int m = 0; m < 16; ++m) acc += sm.kk[(o + 16 + i) * kLdF + o + m] * sm.a[(o + m) * kLdF + o + j];
      sm.tmp[(pq * 16 + i) * kLdT + j] = acc;
    }
    __syncthreads();
    for (int e = tid; e < 2 * 256; e += kThreads) {
      const int pq = e >> 8, i = (e >> 4) & 15, j = e & 15, o = pq * 32;
      float acc = 0.f;
#pragma unroll
      for (int m = 0; m < 16; ++m) acc += sm.a[(o + 16 + i) * kLdF + o + 16 + m] * sm.tmp[(pq * 16 + m) * kLdT + j];
      sm.a[(o + 16 + i) * kLdF + o + j] = -acc;
    }
    __syncthreads();
    // 32 -> 64: A_bl = -A_bb (L_bl A_tt)
    for (int e = tid; e < 32 * 32; e += kThreads) {
      const int i = e >> 5, j = e & 31;
      float acc = 0.f;
#pragma unroll 8
      for (int m = 0; m < 32; ++m) acc += sm.kk[(32 + i) * kLdF + m] * sm.a[m * kLdF + j];
      sm.tmp[i * kLdT + j] = acc;
    }
    __syncthreads();
    for (int e = tid; e < 32 * 32; e += kThreads) {
      const int i = e >> 5, j = e & 31;
      float acc = 0.f;
#pragma unroll 8
      for (int m = 0; m < 32; ++m) acc += sm.a[(32 + i) * kLdF + 32 + m] * sm.tmp[m * kLdT + j];
      sm.a[(32 + i) * kLdF + j] = -acc;
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseInvMerge);
    for (int e = tid; e < kChunk * kChunk; e += kThreads) {
      const int i = e >> 6, j = e & 63;
      sm.mt[i * kLdH + j] = from_f<T>(j <= i ? gate_exp(sm.G[i] - sm.G[j]) * sm.a[i * kLdF + j] : 0.f);
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseGammaA);

    // ---- V_new = (Gamma * A) Y  (fp32, into qk)
    for (int t = warp; t < 16; t += kWarps)
      gemm64_tile<kChunk, T, wmma::row_major, wmma::row_major>(t, sm.mt, kLdH, sm.y, kLdH, sm.qk);
    __syncthreads();
    FLASHQLA_PHASE(kPhaseVnew);
    for (int e = tid; e < kChunk * kBlockV; e += kThreads) {
      const int i = e >> 6, j = e & 63;
      const float vn = sm.qk[i * kLdF + j];
      sm.y[i * kLdH + j] = from_f<T>(vn);
      sm.v[i * kLdH + j] = from_f<T>(sm.decay_end[i] * vn);
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhaseVnewCast);

    // ---- P V_new (into kk) and the state update S = gamma_C S + K^T Z (owner warps)
    for (int t = warp; t < 16; t += kWarps)
      gemm64_tile<kChunk, T, wmma::row_major, wmma::row_major>(t, sm.p, kLdH, sm.y, kLdH, sm.kk);
    {
      const float gamma_c = sm.gamma[kChunk - 1];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < s_frag[j].num_elements; ++e) s_frag[j].x[e] *= gamma_c;
        mma_tile<kChunk, T, wmma::col_major, wmma::row_major>(s_frag[j], sm.k + warp * 16, kLdK, sm.v + j * 16, kLdH);
      }
    }
    __syncthreads();
    FLASHQLA_PHASE(kPhasePvState);

    // ---- O = scale (diag(gamma) Q S + P V_new) for the real rows; publish the new state
#pragma unroll
    for (int it = 0; it < (kChunk * kBlockV / 8) / kThreads; ++it) {
      const int i = tid + it * kThreads, r = i >> 3, c8 = (i & 7) * 8;
      if (r < rows) {
        uint4 out;
        T* oe = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          oe[e] = from_f<T>(p.scale * (sm.gamma[r] * sm.qs[r * kLdF + c8 + e] + sm.kk[r * kLdF + c8 + e]));
        *reinterpret_cast<uint4*>(og + (t0 + r) * p.o_stride_time + c8) = out;
      }
    }
    publish_state();
    __syncthreads();
    FLASHQLA_PHASE(kPhaseOutput);
  }

  if (p.final_state != nullptr) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      wmma::store_matrix_sync(p.final_state + state_off + warp * 16 * kHeadDimV + j * 16, s_frag[j], kHeadDimV,
                              wmma::mem_row_major);
  }
}

template <typename T>
cudaError_t launch(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream) {
  return launch_fwd(p, gdn_fwd_simple_kernel<T, int32_t>, gdn_fwd_simple_kernel<T, int64_t>, kVBlocks, kThreads, sizeof(SharedStorage<T>),
                    stream);
}

}  // namespace gdn_fwd_simple
}  // namespace flashqla
