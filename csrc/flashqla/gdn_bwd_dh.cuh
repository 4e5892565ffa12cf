// Backward, part 1: the reverse state-gradient chain (gdn-algorithm.md section 4), in the forward's form.
//
// Per chunk, from the gradient dS' of the chunk's end state to that of its start state:
//   dS = gamma_C dS' + scale Q^T diag(gamma) dO - W'^T (diag(rho) K dS' + U),
//   W' = (Gamma * A) diag(gamma beta) K = diag(gamma) A diag(beta) K,   U = scale P^T dO,   rho = gamma_C / gamma,
// with A, Gamma, P as in the forward (tests/test_reference.py::test_backward_state_chain_is_two_products_per_chunk
// checks this form against autograd in float64). W' and U do not depend on dS, so:
//  * gdn_bwd_prep_kernel (chunk-parallel, one CTA per chunk and value head) computes them, reusing the
//    forward's inverse (aux_gram_inverse), and writes them as [tokens, heads_v, 128] rows;
//  * gdn_bwd_dh_kernel is the forward's recurrent kernel run backwards: the loader groups bring K, Q, dO,
//    W' and U (reverse chunk order), and the state warps keep dS^T (64 V x 128 K per CTA) in registers:
//      KdS^T = dS'^T K^T,  Z^T = KdS^T diag(rho) + U^T,
//      dS^T  = gamma_C dS'^T + (scale dO^T diag(gamma)) Q - Z^T W'      (Z^T as hi + lo),
//    writing dS' of every chunk (in T, [chunks, heads_v, K, V]) for the chunk-parallel gradient step, and
//    the initial state's gradient at the end.
// The forward's parameter struct carries the problem: v = dO, initial_state = dht, final_state = dh0.
#pragma once

#include "gdn_fwd_mma.cuh"
#include "kernels.h"

namespace flashqla {
namespace gdn_bwd_dh {

using namespace gdn_fwd_mma;

// ---- prep: W' and U per (chunk, value head)
// Two 64 x 128 tiles (~67 KB with the aux scratch: three CTAs per SM, as the forward's prep): dO arrives in
// Q's space once Q K^T is in registers, so its load overlaps only the inverse's epilogue, not the Gram, and the
// outputs are staged over the dead inputs.
template <typename T>
struct alignas(128) BwdPrepStage {
  union {                 // W' staged over K (dead once W' is in registers)
    T k[kChunk * kLdK];
    T x[kChunk * kLdK];
  };
  union {                 // Q, then dO (all 128 columns of the head; Q is dead once Q K^T is in registers),
    T q[kChunk * kLdK];   // then U staged over dO (dead once U is in registers)
    T v[kChunk * kLdK];
    T w[kChunk * kLdK];
  };
  float gamma[kChunk];
  float decay[kChunk];
};
template <typename T>
struct BwdPrepStorage {
  BwdPrepStage<T> stage;
  AuxScratch<T> aux;
  int64_t seq, chunk;
};
constexpr int kBwdPrepCtasPerSm = 3;

// kStatesX: also the state recompute's X = diag(beta) A^T K into states_x (the forward's prep layout,
// [batch * seqlen, heads_v, 128]), so that the backward's two chains share one Gram product and one inverse
// (flashqla_gdn_bwd_prep); bitwise the X of the forward's states prep (same operands, same x_half). states_gates
// (kStatesX; NULL: not written): each chunk's gamma and decay as the forward's prep writes them
// (PrepBuffers::gates: the same compute_gates, so the same bits), for the summaries passes' paired launch.
template <typename T, typename IndexT, bool kStatesX = false>
__global__ void __launch_bounds__(kAuxThreads, kBwdPrepCtasPerSm)
    gdn_bwd_prep_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p, const PrepBuffers<T> pb, T* states_x,
                        float* states_gates) {
  using namespace warp;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<BwdPrepStorage<T>*>(smem_raw);
  static_assert(kBwdPrepCtasPerSm * sizeof(BwdPrepStorage<T>) <= 227 * 1024, "three backward prep CTAs per SM");
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  CtaTile ct;
  int64_t c;
  if (!prep_tile<IndexT>(p, sm.seq, sm.chunk, ct, c)) return;
  const int64_t h = ct.h;
  Work<T> wk = make_work<T>(p, ct);
  wk.o = nullptr;
  const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
  BwdPrepStage<T>& S = sm.stage;
  AuxScratch<T>& ax = sm.aux;

  long long t_mark = 0;
  aux_chunk<T, AuxMode::kInputsOnly>(p, S, ax, wk, c, tid, kBarAux, pb, t_mark);
  bar_sync(kBarAux, kAuxThreads);
  if constexpr (kStatesX) {  // (the chunk of all sequences is grid_chunk(), as in the forward's prep)
    static_assert(kAuxThreads == 2 * kChunk, "a thread a gate value");
    if (states_gates != nullptr)
      states_gates[(grid_chunk() * p.heads_v + h) * 2 * kChunk + tid] =
          tid < kChunk ? S.gamma[tid] : S.decay[tid - kChunk];
  }
  float qk[8][4];
  aux_gram_inverse<T>(S, ax, tid, kBarAux, t_mark, qk);
  // dO rows, all 128 columns, into Q's space: every thread read Q for the Gram products before the inverse's
  // first barrier, which this thread has passed (waited for before U's product)
  for (int i = tid; i < kChunk * kDimV / 8; i += kAuxThreads) {
    const int r = i >> 4, c8 = (i & 15) * 8;
    const bool ok = r < rows;
    cp_async_16(&S.v[r * kLdK + c8], ok ? wk.v + (c * kChunk + r) * p.v_stride_time + c8 : wk.v, ok);
  }

  if (pb.a != nullptr) {  // A's rows for the gradient kernel, zeros above the diagonal (la holds stale values there)
    float* ad = pb.a + ((wk.flat0 + c * kChunk) * p.heads_v + h) * kChunk;
    for (int e = tid; e < rows * (kChunk / 4); e += kAuxThreads) {
      const int i = e >> 4, j = (e & 15) * 4;
      const float* src = &ax.la[i * kLdF + j];
      *reinterpret_cast<float4*>(ad + int64_t(i) * p.heads_v * kChunk + j) =
          make_float4(j <= i ? src[0] : 0.f, j + 1 <= i ? src[1] : 0.f, j + 2 <= i ? src[2] : 0.f, j + 3 <= i ? src[3] : 0.f);
    }
  }

  if constexpr (kStatesX) {
    // X, 64 columns at a time: each warp stages its 16 rows in M's space (free until Mg) and copies them out
    // itself (16-byte rows pieces), so only the end needs the group's barrier (Mg overwrites every row)
    const AuxLane al(tid);
    T* xd = states_x + (wk.flat0 + c * kChunk) * p.heads_v * kDimK + h * kDimK;
    const float b0 = ax.beta[al.i0], b1 = ax.beta[al.i1];
#pragma unroll 1
    for (int half = 0; half < 2; ++half) {
      float xa[8][4];
      x_half<T>(S, ax, al, half, b0, b1, xa);
      store_c_tiles<T>(&ax.m[16 * w * kLdC], kLdC, xa, lane);
      __syncwarp();
#pragma unroll
      for (int i = lane; i < 16 * 8; i += 32) {
        const int r = 16 * w + (i >> 3), c8 = (i & 7) * 8;
        if (r < rows)
          *reinterpret_cast<uint4*>(xd + int64_t(r) * p.heads_v * kDimK + 64 * half + c8) =
              *reinterpret_cast<const uint4*>(&ax.m[r * kLdC + c8]);
      }
      __syncwarp();
    }
    bar_sync(kBarAux, kAuxThreads);
  }
  // Mg = diag(gamma) A diag(beta), lower triangular (T), into ax.m by 16-byte pieces
#pragma unroll
  for (int it = 0; it < kChunk * kChunk / 8 / kAuxThreads; ++it) {
    const int item = it * kAuxThreads + tid, i = item >> 3, j0 = (item & 7) * 8;
    *reinterpret_cast<uint4*>(&ax.m[i * kLdC + j0]) = lower_piece8<T, false, true>(ax, i, j0, S.gamma[i]);
  }
  bar_sync(kBarAux, kAuxThreads);  // A is no longer read: P^T goes into its space
  T* pt = reinterpret_cast<T*>(ax.la);
  static_assert(sizeof(ax.la) >= sizeof(T) * kChunk * kLdC, "P^T fits in A's buffer");
  const int gq = lane >> 2, tq = lane & 3;
  const int i0 = 16 * w + gq, i1 = i0 + 8;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) pt[(8 * nt + 2 * tq + (e & 1)) * kLdC + (e < 2 ? i0 : i1)] = from_f<T>(qk[nt][e]);
  cp_async_wait_all();             // this thread's dO copies; the barrier makes everyone's visible
  bar_sync(kBarAux, kAuxThreads);

  const LdsmOffsets ld(lane);
  // U rows [16w, 16w + 16): U[i][v] = scale sum_{j >= i} P^T[i][j] dO[j][v];
  // W' rows [16w, 16w + 16): W'[i][k] = sum_{j <= i} Mg[i][j] K[j][k]  (triangular: k blocks from / up to w)
  float ua[16][4], wa[16][4];
  zero_acc(ua);
  zero_acc(wa);
  gemm_rows16<T, 16, false, true>(ua, pt, kLdC, 16 * w, S.v, kLdK, 0, w, 4, ld);
  gemm_rows16<T, 16, false, true>(wa, ax.m, kLdC, 16 * w, S.k, kLdK, 0, 0, w + 1, ld);
#pragma unroll
  for (int nt = 0; nt < 16; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) ua[nt][e] *= p.scale;
  bar_sync(kBarAux, kAuxThreads);  // dO and K are dead: U and W' go there
  store_c_tiles<T>(&S.w[16 * w * kLdK], kLdK, ua, lane);
  store_c_tiles<T>(&S.x[16 * w * kLdK], kLdK, wa, lane);
  bar_sync(kBarAux, kAuxThreads);
  const int64_t row0 = wk.flat0 + c * kChunk;
  T* xd = pb.x + row0 * p.heads_v * kDimK + h * kDimK;
  T* ud = pb.w + row0 * p.heads_v * kDimV + h * kDimV;
  for (int i = tid; i < rows * (kDimK / 8); i += kAuxThreads) {
    const int r = i >> 4, c8 = (i & 15) * 8;
    *reinterpret_cast<uint4*>(xd + int64_t(r) * p.heads_v * kDimK + c8) = *reinterpret_cast<const uint4*>(&S.x[r * kLdK + c8]);
    *reinterpret_cast<uint4*>(ud + int64_t(r) * p.heads_v * kDimV + c8) = *reinterpret_cast<const uint4*>(&S.w[r * kLdK + c8]);
  }
}

// ---- the reverse chain
// kKSplit false: warp s owns V rows 16 s .. of the CTA's 64 columns and all 128 K columns of dS^T. kKSplit true
// (few sequences x value heads, as the forward's state_role): V rows 16 (s / 2) .. of 32 columns and K columns
// kKHalf (s % 2) ..; each warp forms its K half's share of KdS^T, the pair adds the shares through the loader
// groups' product scratch (unused here), and each updates its own K half (dO^T Q and Z^T W' on that half of
// Q's and W''s columns): ~160 mma per warp a chunk instead of ~320.
// kWg: the products as wgmma on the swizzled stage (StageSwBwd; unsplit only), as the forward's state_role.
// kStatesByTma<Storage> (SharedStorageSwBwdSt, with kWg): dS' leaves by TMA on ds_map (state_map of dh).
// kMerge (with kStatesByTma), a merging pair's runs; only walks that pass walk_may_merge take part. The source run
// (merge_dh0 NULL; exact parallelism's B pass, from zero) stores dS' only in those walks. The merging run: dh
// already holds the source run's dS' and merge_dh0 its dh0. At checkpoint steps (merge_checkpoint) the state warps
// compare their dS' with dh's, bit for bit; once every thread's are equal the rest of the walk would repeat the
// other run's instructions on the same operands, so its dh is already this run's: the warps stop, release the
// loaders (sm.merge.stop) and give merge_dh0's tile as dh0.
template <typename T, bool kKSplit, bool kWg = false, bool kMerge = false, typename Storage>
CUTLASS_DEVICE void dh_state_role(const flashqla_gdn_fwd_params_t& p, Storage& sm, const Work<T>& wk, float* dh,
                                  const CUtensorMap* ds_map, const float* merge_dh0 = nullptr) {
  static_assert(!(kWg && kKSplit), "the wgmma chain is unsplit");
  static_assert(!kMerge || kStatesByTma<Storage>, "the merging chain: the wgmma chain with dS' by TMA");
  using namespace warp;
  constexpr int kNT = kKSplit ? kDimK / 16 : kDimK / 8;  // C tiles of dS^T per warp
  constexpr int kKS = kNT / 2;
  const int tid = threadIdx.x, s = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int vg = kKSplit ? s >> 1 : s, kh = kKSplit ? s & 1 : 0;
  const int kcol = kKHalf * kh;                  // this warp's first K column
  const int64_t koff = int64_t(kcol) * kDimV;   // ... as a row offset in [K][V] memory
  const LdsmOffsets ld(lane);
  const int v0 = 16 * vg + gq;  // this thread's V columns (within the CTA block): v0 and v0 + 8
  FLASHQLA_ROLE_TIMER;  // (benchmarks/profile_fwd_phases.cu; the state phases' slots, named there)

  float sacc[kNT][4];  // dS^T, starting from dht
  load_state_tile(sacc, p.initial_state != nullptr ? p.initial_state + wk.state_off + koff : nullptr, tq, v0);
  float* pair_scratch = nullptr;  // (the K split)
  if constexpr (kKSplit) pair_scratch = sm.aux[vg].la;
  const PairShares pair(pair_scratch, kh);

  bool merged = false, may_merge = false;
  if constexpr (kMerge) {
    if (tid == 0) sm.merge.stop = 0;  // (read by the loaders only after a stage release, which follows this store)
    may_merge = walk_may_merge<true>(p, wk, sm.merge.sum, kBarState, tid);
  }
  const bool merging = kMerge && may_merge && merge_dh0 != nullptr;
  const bool source_skips = kMerge && !may_merge && merge_dh0 == nullptr;  // (the source run stores no dS' here)
  for (int64_t it = 0; it < wk.num_chunks; ++it) {
    const int64_t c = wk.num_chunks - 1 - it;
    const int st = static_cast<int>(it % kStages);
    if constexpr (kMerge) {
      if (merging && merge_checkpoint(it) && uniform<true>(dh != nullptr && wk.chunk0 + c < chunk_bound(p))) {
        const float* other = dh + ((wk.chunk0 + c) * p.heads_v + wk.h) * int64_t(kDimK) * kDimV + koff + wk.col0;
        if (bar_red_and(kBarState, kStateThreads, state_tile_equals(sacc, other, tq, v0))) {
          merged = true;
          stop_walk(sm, it, wk.num_chunks, tid);
          break;
        }
      }
    }
    const auto& S = sm.stage[st];
    bar_sync(kBarFull + st, kHandoffThreads);
    FLASHQLA_ROLE_PHASE(0, kStWaitFull);

    // dS' of chunk c: the gradient of its end state, [K][V] rows like the states, fp32 (the gradient kernel's
    // <S0, dS'> reads it unrounded)
    // (malformed cu_seqlens can name more chunks than dh has slots; uniform: the wgmma chain stores while its
    // products are in flight)
    // (dh NULL: exact parallelism's summaries passes, which want only dh0)
    const bool store_ds = uniform<kWg>(dh != nullptr && !source_skips && wk.chunk0 + c < chunk_bound(p));
    float* ds_dst = dh + ((wk.chunk0 + c) * p.heads_v + wk.h) * int64_t(kDimK) * kDimV + koff + wk.col0;

    uint32_t sa[kKS][4];
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) c_to_a<T>(sa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
    float kd[8][4];  // KdS^T, 16 V rows x 64 chunk columns (K-split: this K half's share)
    zero_acc(kd);
    const float gamma_c = S.gamma[kChunk - 1];
    // dS^T += (scale dO^T diag(gamma)) Q, the A operand as hi + lo: one bf16 rounding of it costs ~1.6e-3 of
    // dh0 (the term dominates it), twice FLA's error, which multiplies in tf32
    uint32_t dh_[4][4], dl[4][4];
    const auto form_do = [&] {
      for_vt_pairs<T>(S.v, vg, tq, ld, [&](int kb, int r, int, int, int col, float2 dd) {
        const float2 gm = *reinterpret_cast<const float2*>(&S.gamma[col]);
        split_hi_lo<T>(p.scale * gm.x * dd.x, p.scale * gm.y * dd.y, dh_[kb][r], dl[kb][r]);
      });
    };
    // dS^T -= Z^T W',  Z^T = KdS^T diag(rho) + U^T (hi + lo)
    uint32_t zh[4][4], zl[4][4];
    const auto form_z = [&] {
      for_vt_pairs<T>(S.w, vg, tq, ld, [&](int kb, int r, int nt, int e, int col, float2 uu) {
        const float2 rho = *reinterpret_cast<const float2*>(&S.decay[col]);
        split_hi_lo<T>(-(rho.x * kd[nt][e] + uu.x), -(rho.y * kd[nt][e + 1] + uu.y), zh[kb][r], zl[kb][r]);
      });
    };
    const auto scale_ds = [&] {
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[j][e] *= gamma_c;
    };
    if constexpr (kWg) {
      // dS' out first, the dO operand formed and dS^T scaled, then the products in three commit groups that the
      // tensor pipe runs back to back: KdS^T; dO^T Q into dS^T; and, once KdS^T is waited for and Z formed (while
      // dO^T Q runs), Z^T W' behind it into the same accumulators. dS^T takes gamma_C, dO^T Q and Z^T W' in that
      // order, as with one product at a time, so the bits are the same. (Staged while KdS^T ran, dS' cost a wait
      // that ptxas injected at its first read of dS^T: C7517.)
      auto& k32 = reinterpret_cast<float(&)[32]>(kd);
      auto& s64 = reinterpret_cast<float(&)[64]>(sacc);
      if constexpr (kStatesByTma<Storage>) {
        if (store_ds)
          store_state_by_tma(ds_map, sm.st_box[it & 1], sacc, (wk.chunk0 + c) * p.heads_v + wk.h,
                             static_cast<int>(wk.col0), kBarState, tid);
      } else if (store_ds) {
        store_state_tile(ds_dst, sacc, tq, v0);
      }
      form_do();
      scale_ds();
      gmma::pin(s64);  // (the scaling before the fence, not sunk past it)
      gmma::fence();
      gmma::pin(k32);
      gmma::pin(s64);
      wg_issue_rows64<T>(kd, sa, S.k);
      gmma::commit();
      wg_issue_update<T>(S.q, dh_, dl, sacc);
      gmma::commit();
      FLASHQLA_ROLE_PHASE(0, kStKsQs);
      gmma::wait<1>();
      gmma::pin(k32);
      form_z();
      FLASHQLA_ROLE_PHASE(0, kStZY);
      gmma::fence();
      wg_issue_update<T>(S.x, zh, zl, sacc);
      gmma::commit();
      gmma::wait_all();
      gmma::pin(s64);
    } else {
      for_b_fragments<kKS, 4, false>(S.k + kcol, kLdK, ld, [&](int kk, int np, const uint32_t (&b)[4]) {
        mma_pair<T>(kd, np, sa[kk], b);
        // dS' tiles 2 kk, 2 kk + 1 (K columns 16 kk ..), between this k step's products: the stores drain while
        // the tensor pipe works instead of all 64 ahead of it (sacc changes only after this loop). Measured
        // against all 64 up front (session 10): hk4_hv8 32k backward 2.73 -> 2.55 ms; through per-warp shared
        // staging the step was slower (5.8k -> 6.2k cycles).
        if (np == 3 && store_ds) store_state_tiles(ds_dst, sacc, 2 * kk, tq, v0);
      });
      if constexpr (kKSplit) {  // the pair adds its shares
        pair.put(kd, 0, lane);
        bar_sync(kBarPair + vg, 64);
        pair.add(kd, 0, lane);
      }
      FLASHQLA_ROLE_PHASE(0, kStKsQs);
      scale_ds();
      form_do();
      update_hi_lo<T, kWg>(S.q, kcol, ld, dh_, dl, sacc);
      FLASHQLA_ROLE_PHASE(0, kStZY);
      form_z();
      update_hi_lo<T, kWg>(S.x, kcol, ld, zh, zl, sacc);
    }
    FLASHQLA_ROLE_PHASE(0, kStO);
    if (it + kStages < wk.num_chunks) {
      // the stage's last reads are consumed by the mma's above, so bar.arrive alone releases it; the state
      // warps' sync first is for racecheck, which flags the aux group's refill otherwise (the mirror of the
      // aux group's sync before its full arrive)
      bar_sync(kBarState, kStateThreads);
      bar_arrive(kBarEmpty + st, kHandoffThreads);
    }
    FLASHQLA_ROLE_PHASE(0, kStUpdate);
  }

  if (p.final_state != nullptr) {  // dh0 (merged: the other run's, which this walk would have repeated)
    if (kMerge && merged) load_state_tile(sacc, merge_dh0 + wk.state_off + koff, tq, v0);
    store_state_tile(p.final_state + wk.state_off + koff, sacc, tq, v0);
  }
  if constexpr (kStatesByTma<Storage>) {
    if (tid == 0) bulk_wait();  // (the boxes must outlive their stores' reads)
  }
}

// kTma (with kWg): dS' by TMA on ds_map (state_map of dh), else ds_map is unused. kMerge (with kTma): a merging
// pair's run (dh_state_role; merge_dh0 NULL: the source run).
template <typename T, typename IndexT, bool kKSplit = false, bool kWg = false, bool kTma = false, bool kMerge = false>
__global__ void __launch_bounds__(kThreads, 1) gdn_bwd_dh_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p,
                                                                 const PrepBuffers<T> pb, float* dh,
                                                                 const __grid_constant__ CUtensorMap ds_map,
                                                                 const float* merge_dh0) {
  static_assert(!kTma || kWg, "dS' by TMA: the wgmma chain");
  static_assert(!kMerge || kTma, "the merging chain: dS' by TMA");
  constexpr int kVB = kKSplit ? kVBlocksK : kVBlocks, kBV = kKSplit ? kBlockVK : kBlockV;
  using SwStorage = std::conditional_t<kTma, SharedStorageSwBwdSt<T>, SharedStorageSwBwd<T>>;
  using Storage = std::conditional_t<kWg, SwStorage, SharedStorage<T>>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = smem_raw;
  if constexpr (kWg) base = gmma::align_smem_1024(smem_raw);
  auto& sm = *reinterpret_cast<Storage*>(base);
  const CtaTile ct = decode_cta<IndexT>(p, blockIdx.x, kVB, kBV);
  Work<T> wk = make_work<T>(p, ct);
  wk.o = nullptr;
  // (warp-uniform for ptxas in the wgmma chain, as in gdn_fwd_mma_kernel)
  const bool state_warps =
      kWg ? __shfl_sync(0xffffffffu, threadIdx.x / kStateThreads, 0) == 0 : threadIdx.x < kStateThreads;
  if (state_warps) {
    cutlass::arch::warpgroup_reg_alloc<kStateRegs>();
    wk.chunk0 = chunk_offset<IndexT>(p, ct.n, threadIdx.x & 31);
    dh_state_role<T, kKSplit, kWg, kMerge>(p, sm, wk, dh, &ds_map, merge_dh0);
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kAuxRegs>();
    if constexpr (kMerge)
      aux_role<T, AuxMode::kLoadBwd, kBV, false, false, false, true>(p, sm, wk, (threadIdx.x - kStateThreads) / kAuxThreads,
                                                                      pb, nullptr, &sm.merge.stop);
    else
      aux_role<T, AuxMode::kLoadBwd, kBV>(p, sm, wk, (threadIdx.x - kStateThreads) / kAuxThreads, pb);
  }
}

// W' and U in a prep workspace of kBwdPrepCols 16-bit values per token row and value head: W' (128 wide) for
// every row, then U; a: the inverse's rows (or NULL).
template <typename T>
PrepBuffers<T> bwd_prep_buffers(const flashqla_gdn_fwd_params_t& p, void* workspace, float* a) {
  static_assert(kBwdPrepCols == kDimK + kDimV && sizeof(T) == 2, "workspace layout");
  T* ws = static_cast<T*>(workspace);
  return PrepBuffers<T>{ws, ws + static_cast<size_t>(p.batch) * static_cast<size_t>(p.seqlen) * p.heads_v * kDimK, a};
}

// The prep alone: W' and U into `workspace` (at least prep_workspace_bytes(p, kBwdPrepCols)), the inverse's rows
// into a (NULL: not written) and, when states_x is not NULL, the state recompute's X there (the forward's
// workspace layout) and, when states_gates is not NULL too, the chunks' gates (fwd_gate_workspace_bytes, as the
// forward's gates_from_prep). p as for launch below.
template <typename T>
cudaError_t launch_prep(const flashqla_gdn_fwd_params_t& p, void* workspace, float* a, void* states_x,
                        float* states_gates, cudaStream_t stream) {
  const int64_t chunks = chunk_bound(p);
  if (chunks == 0 || p.num_seqs == 0 || p.heads_v == 0) return cudaSuccess;
  const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
  auto prep = states_x != nullptr ? (ix64 ? gdn_bwd_prep_kernel<T, int64_t, true> : gdn_bwd_prep_kernel<T, int32_t, true>)
                                  : (ix64 ? gdn_bwd_prep_kernel<T, int64_t> : gdn_bwd_prep_kernel<T, int32_t>);
  const size_t smem = sizeof(BwdPrepStorage<T>);
  const cudaError_t err = cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  prep<<<chunk_grid(chunks, p.heads_v, prep_heads_major(p)), kAuxThreads, smem, stream>>>(
      p, bwd_prep_buffers<T>(p, workspace, a), static_cast<T*>(states_x), states_x != nullptr ? states_gates : nullptr);
  return cudaGetLastError();
}

// p: the forward's struct with v = dO (and its strides), initial_state = dht or NULL, final_state = dh0 or
// NULL; o unused; prep_ready: p.workspace already holds launch_prep's W' and U (the prep is skipped, a is not
// written). dh: [chunk_bound(p), heads_v, 128, 128] fp32 (entries past the last chunk untouched). a: NULL
// or [batch * seqlen, heads_v, 64] fp32, the inverse's rows (flashqla_gdn_bwd_dh_params_t::a). merge: the run's
// part in a merging pair (DhMerge; dh_state_role's kMerge). The source run stores dS' only in the walks that may
// merge; the merging run (merge.other_dh0 set: dh holds the source run's dS', other_dh0 its dh0) may stop where its
// walk merges with the source's (the same results). Only the wgmma chain with dS' by TMA takes part; in the other
// forms the source stores every chunk and the merging run walks every chunk.
template <typename T>
cudaError_t launch(const flashqla_gdn_fwd_params_t& p, float* dh, float* a, cudaStream_t stream, DhMerge merge = {}) {
  const ChainForm form = chain_form(p, true);
  const bool wg = form == ChainForm::kWgmma, ksplit = form == ChainForm::kKSplit;
  const int64_t ctas = p.num_seqs * p.heads_v * (ksplit ? kVBlocksK : kVBlocks);
  if (ctas == 0) return cudaSuccess;
  const int64_t chunks = chunk_bound(p);
  const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
  cudaError_t err = cudaSuccess;
  Workspace ws;
  PrepBuffers<T> pb{nullptr, nullptr};
  if (chunks > 0) {  // W' and U for every token row
    err = ws.acquire(p, prep_workspace_bytes(p, kBwdPrepCols), stream);
    if (err != cudaSuccess) return err;
    pb = bwd_prep_buffers<T>(p, ws.ptr, a);
    if (!(p.prep_ready && !ws.owned)) err = launch_prep<T>(p, ws.ptr, a, nullptr, nullptr, stream);
  }
  if (err == cudaSuccess) {
    // dS' by TMA (FLASHQLA_STATES_TMA: states_tma_mode)
    CUtensorMap ds_map{};
    const int mode = states_tma_mode();
    const bool tma = wg && mode != 0 && dh != nullptr && state_map(p, dh, true, ds_map);
    if (wg && !tma && mode == 2 && dh != nullptr) return ws.release(cudaErrorNotSupported, stream);
    const bool merging = tma && (merge.source || merge.other_dh0 != nullptr);
    auto kernel = merging  ? (ix64 ? gdn_bwd_dh_kernel<T, int64_t, false, true, true, true>
                                   : gdn_bwd_dh_kernel<T, int32_t, false, true, true, true>)
                  : tma    ? (ix64 ? gdn_bwd_dh_kernel<T, int64_t, false, true, true> : gdn_bwd_dh_kernel<T, int32_t, false, true, true>)
                  : wg     ? (ix64 ? gdn_bwd_dh_kernel<T, int64_t, false, true> : gdn_bwd_dh_kernel<T, int32_t, false, true>)
                  : ksplit ? (ix64 ? gdn_bwd_dh_kernel<T, int64_t, true> : gdn_bwd_dh_kernel<T, int32_t, true>)
                           : (ix64 ? gdn_bwd_dh_kernel<T, int64_t> : gdn_bwd_dh_kernel<T, int32_t>);
    const size_t smem = tma  ? sizeof(SharedStorageSwBwdSt<T>) + 1024
                        : wg ? sizeof(SharedStorageSwBwd<T>) + 1024 : sizeof(SharedStorage<T>);
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err == cudaSuccess) {
      kernel<<<static_cast<unsigned>(ctas), kThreads, smem, stream>>>(p, pb, dh, ds_map, merge.other_dh0);
      err = cudaGetLastError();
    }
  }
  return ws.release(err, stream);
}

}  // namespace gdn_bwd_dh
}  // namespace flashqla
