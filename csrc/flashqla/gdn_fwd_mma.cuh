// Fused chunked gated-delta-rule forward, version 2: warp-specialised, with
// the serial state chain kept entirely in registers.
//
// One CTA per (sequence, value head, 64-column V block), two roles:
//  * 2 aux warpgroups, on alternate chunks (group g fills stage g); in each,
//    4 warps (one 16-row block of the chunk each) load the chunk (cp.async)
//    and compute everything that does not
//    depend on the state: the cumsum of g, K K^T and Q K^T, the fp32 inverse
//    A = (I + StrictLower(diag(beta) K K^T))^-1 (tf32 block merges),
//    X = diag(beta) A^T K and W = (Q K^T * Gamma)(Gamma * A) diag(beta).
//  * 4 state warps (16 V columns each) hold S^T (64 x 128 per CTA, fp32) in
//    mma accumulators and run, per chunk, only what needs S:
//      KS^T = S^T K^T,  QS^T = S^T Q^T                        (one pass over S)
//      Z^T  = V^T - KS^T diag(gamma)
//      Y^T  = V^T diag(gamma_C / gamma) - gamma_C KS^T
//      O^T  = scale (QS^T diag(gamma) + Z^T W^T)
//      S^T  = gamma_C S^T + Y^T X                              (Y^T as bf16 hi + lo)
//    Because an mma accumulator has the layout of the next mma's A operand,
//    S^T -> KS^T -> Y^T -> S^T never leaves registers, and the four warps
//    never talk to each other on the chain (V columns are independent).
// The roles hand stages over through named barriers (full / empty per stage),
// so the aux groups load and prepare chunks c + 1 and c + 2 while the state
// warps run chunk c. setmaxnreg gives the state warps 232 registers.
// Math: gdn-algorithm.md section 2 (S' = gamma_C S + X^T Y, O through K S).
#pragma once

#include "gdn_fwd_common.cuh"
#include "kernels.h"
#include "tma.cuh"
#include "warp_mma.cuh"
#include "wgmma.cuh"

#include <cutlass/arch/reg_reconfig.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

namespace flashqla {
namespace gdn_fwd_mma {

constexpr int kChunk = 64;
constexpr int kDimK = 128;
constexpr int kDimV = 128;
constexpr int kBlockV = 64;                       // V columns per CTA
constexpr int kVBlocks = kDimV / kBlockV;
constexpr int kStateWarps = kBlockV / 16;         // 16 V columns (rows of S^T) each
constexpr int kAuxWarps = kChunk / 16;            // per aux group: 16 chunk rows each
constexpr int kAuxGroups = 2;                     // aux warpgroups, on alternate chunks
constexpr int kStateThreads = kStateWarps * 32;
constexpr int kAuxThreads = kAuxWarps * 32;       // per group
constexpr int kThreads = kStateThreads + kAuxGroups * kAuxThreads;
constexpr int kHandoffThreads = kStateThreads + kAuxThreads;  // a stage changes hands between the state warps and one group
// Registers per thread after setmaxnreg: the state warps hold S^T (64 fp32) plus the chunk's
// products; the aux warps make do with 136. 128 x 232 + 256 x 136 <= 64 K.
constexpr int kStateRegs = 232;
constexpr int kAuxRegs = 136;
constexpr int kStages = kAuxGroups;               // aux group g fills stage g
constexpr int kLdK = kDimK + 8;                   // 272-byte rows: the 8 rows of an ldmatrix hit distinct banks
constexpr int kLdC = kChunk + 8;                  // 64-wide 16-bit tiles
constexpr int kLdF = kChunk + 4;                  // 64-wide fp32 tiles
constexpr int kLdS = 32 + 4;                      // 32-wide fp32 scratch

enum Barrier : uint32_t {
  kBarFull = 1,                  // + stage: aux -> state, the stage holds a chunk's operands
  kBarEmpty = kBarFull + kStages,  // + stage: state -> aux, the stage may be refilled
  kBarAux = kBarEmpty + kStages,   // + group: among one aux group's warps
  kBarState = kBarAux + kAuxGroups,  // among the state warps
  kBarPair = kBarState + 1,          // + V group: the two state warps of the K-split chain that share V rows
};

// O beside the chain (the forward's default, see chain_form; the wgmma chain only): a fourth warpgroup forms O
// from the S^T and Z^T the state warps publish each chunk, so Q S^T, Z^T W^T and the O store leave the serial
// path. With the state step shorter, two stages no longer hide the loads (a group needs ~6k cycles a chunk, and a
// stage now stays busy until the O warps are done with it; NOTES, session 11): three stages, filled by the two loader groups in turn (chunk c: stage c % 3,
// group c % 2). The empty barrier of chunk c's stage is waited by the loader of chunk c + 3; with one id per
// c % 6 each id always has the same loader group, so no group can arrive at another's barrier generation.
constexpr int kOThreads = 128;
constexpr int kObStages = 3;
constexpr int kObThreads = kStateThreads + kOThreads + kAuxGroups * kAuxThreads;
// Registers: the state warps (no O accumulators) fit in 200; the O warps hold S^T, Z^T and O^T fragments and need
// 120 (at 96 or 104 ptxas spilled and serialised their wgmmas); the loaders only copy here.
constexpr int kObStateRegs = 200, kObORegs = 120, kObLoadRegs = 96;
static_assert(kObStateRegs * kStateThreads + kObORegs * kOThreads + kObLoadRegs * kAuxGroups * kAuxThreads <= 64 * 1024,
              "the O-beside kernel's registers");
namespace ob {
enum Barrier : uint32_t {
  // state -> O: the chunk's S^T is published (Z^T not yet). Id 0 is __syncthreads' barrier; the kernel's only
  // __syncthreads is before the roles split, so after it the id is free for a counted barrier.
  kPubS = 0,
  kFull = 1,                    // + stage (3): loader -> state
  kEmpty = kFull + kObStages,   // + chunk % 6: state and O -> the loader of chunk + 3
  kAux = kEmpty + 6,            // + group
  kState = kAux + kAuxGroups,   // among the state warps
  kPub = kState + 1,            // state -> O: the chunk's Z^T is published (S^T at kPubS)
  kFree = kPub + 1,             // O -> state: read, may be overwritten
  kOWarps = kFree + 1,          // among the O warps
};
static_assert(kOWarps <= 15, "16 named barriers");
constexpr int kEmptyThreads = kStateThreads + kOThreads + kAuxThreads;
constexpr int kPubThreads = kStateThreads + kOThreads;
}  // namespace ob

// Diagnostics only (benchmarks/profile_fwd_phases.cu): with FLASHQLA_PHASE_TIMERS,
// lane 0 of the first warp of each role in CTA 0 adds the cycles of each phase
// (including the barrier wait that ends it) to g_role_cycles[role][phase].
enum AuxPhase { kAuxWaitEmpty, kAuxLoad, kAuxL2norm, kAuxGram, kAuxInvDiag, kAuxInvMerge, kAuxMX, kAuxW, kAuxPhases };
// (kStPub, last in the array, comes second in program order: S to 16 bits and its publish or chunk-state store)
enum StatePhase { kStWaitFull, kStKsQs, kStZY, kStO, kStUpdate, kStStore, kStPub, kStPhases };
// FLASHQLA_V2_EXPERIMENT (diagnostics, profiler builds only): 1 = the aux warps only load and hand over
// stages, 2 = the state warps only take and return them; the other role's time is then its own.
#ifndef FLASHQLA_V2_EXPERIMENT
#define FLASHQLA_V2_EXPERIMENT 0
#endif
// FLASHQLA_OB_EXPERIMENT (diagnostics, profiler builds only): 1 = the O-beside kernel's O warps only read the
// published tiles and keep the barriers (no products, no O stores): what the O role costs the state warps.
#ifndef FLASHQLA_OB_EXPERIMENT
#define FLASHQLA_OB_EXPERIMENT 0
#endif
#ifdef FLASHQLA_PHASE_TIMERS
__device__ unsigned long long g_role_cycles[2][8];
// The CTA whose state warp 0 and first loader thread are timed: the first chain CTA (the profiler sets it past the
// prep workers of a prep-beside-chain launch, whose block 0 is a worker and would otherwise be timed).
__device__ int g_timed_block;
// The chunk-parallel prep kernels (128-thread CTAs) run the aux phases too: with g_time_prep set, thread 0 of
// every CTA of the middle head tile (chunk_grid's) adds them to
// g_prep_cycles (atomically: many CTAs), slot kAuxWaitEmpty holding the store of X and W (no stage to wait for).
__device__ unsigned long long g_prep_cycles[8];
__device__ int g_time_prep;
// The timed role-1 (loader / producer) thread of g_timed_block: -1, the aux groups' first (blockDim.x - kAuxGroups x
// kAuxThreads: the fused, O-beside and summaries kernels); the profiler sets the paired chain's producer's first
// (2 x kStateThreads), whose CTA has the fused kernel's 384 threads but another layout.
__device__ int g_timed_aux_thread = -1;
#define FLASHQLA_ROLE_PHASE(role, ph)                                                                    \
  do {                                                                                                   \
    if (blockDim.x == kAuxThreads) {                                                                     \
      if ((role) == 1 && g_time_prep && grid_head_tile() == grid_head_tiles() / 2 && threadIdx.x == 0) { \
        const long long now_ = clock64();                                                                \
        atomicAdd(&g_prep_cycles[ph], (unsigned long long)(now_ - t_mark));                              \
        t_mark = now_;                                                                                   \
      }                                                                                                  \
    } else if (blockIdx.x == g_timed_block &&                                                            \
               threadIdx.x == ((role) == 0                 ? 0                                                \
                               : g_timed_aux_thread >= 0   ? g_timed_aux_thread                              \
                                                           : blockDim.x - kAuxGroups * kAuxThreads)) {      \
      const long long now_ = clock64();                                                                  \
      atomicAdd(&g_role_cycles[role][ph], (unsigned long long)(now_ - t_mark)); /* (a RED: no load to wait for) */ \
      t_mark = now_;                                                                                     \
    }                                                                                                    \
  } while (0)
#define FLASHQLA_ROLE_TIMER long long t_mark = clock64()
#else
#define FLASHQLA_ROLE_PHASE(role, ph) do { } while (0)
#define FLASHQLA_ROLE_TIMER do { } while (0)
#endif

template <typename T>
struct alignas(128) Stage {
  T k[kChunk * kLdK];   // K rows (l2-normalised when asked)
  T q[kChunk * kLdK];
  T x[kChunk * kLdK];   // X = diag(beta) A^T K
  T v[kChunk * kLdC];   // this CTA's V columns
  T w[kChunk * kLdC];   // W = (Q K^T * Gamma)(Gamma * A) diag(beta), lower triangular
  float gamma[kChunk];  // e^{G_i}
  float decay[kChunk];  // e^{G_C - G_i}
};

// One aux group's private buffers.
template <typename T>
struct AuxScratch {
  alignas(16) float la[kChunk * kLdF];  // L = StrictLower(diag(beta) K K^T), inverted in place into A = (I + L)^-1
  alignas(16) float scratch[32 * kLdS]; // inverse merge products
  alignas(16) T m[kChunk * kLdC];       // (Gamma * A) diag(beta)
  float G[kChunk], beta[kChunk];
};

template <typename T>
struct SharedStorage {
  Stage<T> stage[kStages];
  AuxScratch<T> aux[kAuxGroups];
  alignas(16) T o[2][kChunk * kLdC];    // output tiles on their way out (state warps)
};
// The state warps stage half a chunk state (64 K rows x 16 V per warp, bf16) in the O buffer the chunk's O does
// not use.
static_assert(kStateWarps * 64 * 16 <= kChunk * kLdC, "state staging fits in an O buffer");

// The stage of the chain whose products are wgmma (split mode, FLASHQLA_WGMMA=1): K, Q and X [tokens][K dim] as
// two 64-column blocks each and W [tokens][tokens] as one, in the 128-byte swizzled layout wgmma reads
// (gmma::sw128_off; the stage 1024-byte aligned); V (this CTA's 64 columns) in kVElems elements: padded as in
// Stage (StageSw), or swizzled as well in the O-beside chain's TMA form, so that one TMA box brings it too
// (StageSwV). The state warps read V by ldmatrix.trans (tile16 picks the layout by the array's size), conflict
// free in either.
template <typename T, int kVElems>
struct alignas(1024) StageSwOf {
  T k[2][kChunk * 64];
  T q[2][kChunk * 64];
  T x[2][kChunk * 64];
  T w[kChunk * 64];
  T v[kVElems];
  float gamma[kChunk];
  float decay[kChunk];
};
template <typename T>
using StageSw = StageSwOf<T, kChunk * kLdC>;
template <typename T>
using StageSwV = StageSwOf<T, kChunk * 64>;
// The dS chain's (gdn_bwd_dh.cuh): K, Q and W' swizzled; dO and U (this CTA's columns) padded, since the state
// warps read both by ldmatrix.trans.
template <typename T>
struct alignas(1024) StageSwBwd {
  T k[2][kChunk * 64];
  T q[2][kChunk * 64];
  T x[2][kChunk * 64];
  T w[kChunk * kLdC];
  T v[kChunk * kLdC];
  float gamma[kChunk];
  float decay[kChunk];
};
// A merging walk's shared scratch (the merging chains: state_role's and dh_state_role's kMerge): stop, the state
// warps' word to the loaders (aux_role's kStop); sum, walk_may_merge's per-warp sums.
struct MergeScratch {
  int stop;
  float sum[kStateWarps];
};
template <typename StageT, typename T>
struct SharedStorageOf {
  StageT stage[kStages];
  AuxScratch<T> aux[kAuxGroups];
  alignas(16) T o[2][kChunk * kLdC];
  MergeScratch merge;  // (the forward's merge, its last pass)
};
template <typename T>
using SharedStorageSw = SharedStorageOf<StageSw<T>, T>;
template <typename T>
using SharedStorageSwBwd = SharedStorageOf<StageSwBwd<T>, T>;
static_assert(sizeof(SharedStorageSw<__nv_bfloat16>) + 1024 <= 227 * 1024 &&
                  sizeof(SharedStorageSwBwd<__nv_bfloat16>) + 1024 <= 227 * 1024,
              "the swizzled storage, aligned, fits");
// The O-beside kernel's: three stages; S^T (64 V rows x 128 K, two 64-column blocks) and Z^T (64 V rows x 64
// tokens) as the state warps publish them for the O warps (bf16, swizzled: stmatrix in, ldmatrix out, conflict
// free); of the loaders' scratch only the gates (they compute no products in split mode). The O warps stage their
// output tile in the stage's Q, dead once their products are done.
struct GateScratch {
  float G[kChunk], beta[kChunk];
};
template <typename T, typename StageT>
struct SharedStorageObOf {
  StageT stage[kObStages];
  alignas(1024) T pub_s[2][kChunk * 64];
  alignas(1024) T pub_z[kChunk * 64];
  GateScratch aux[kAuxGroups];
  uint64_t tma_bar[kObStages];  // a stage's K, Q, X and W by TMA (tma::ChainMaps), one phase per fill
  MergeScratch merge;           // (the forward's merging last pass in this form)
};
template <typename T>
using SharedStorageOb = SharedStorageObOf<T, StageSw<T>>;   // (the copy forms)
template <typename T>
using SharedStorageObTma = SharedStorageObOf<T, StageSwV<T>>;  // (the TMA form)
// The paired chain (FLASHQLA_CHAIN_PAIR; gdn_fwd_pair_kernel): one CTA a (sequence, value head), two state
// warpgroups each forming its V half's chain and O (state_role as FLASHQLA_WGMMA=1 runs it) on one stage they share,
// filled by one producer warpgroup by TMA (both V halves; the gates copied from the prep). Two stages: a stage
// holds K, Q, X (two blocks each), W and V (two blocks), 72 KB, and ab (kAb: the 8 KB operand X is formed from).
template <typename T>
struct alignas(1024) StagePairSw {
  T k[2][kChunk * 64];
  T q[2][kChunk * 64];
  T x[2][kChunk * 64];
  T w[kChunk * 64];
  T v[2][kChunk * 64];  // (V's 128 columns as two swizzled blocks: warpgroup h reads block h)
  T ab[kChunk * 64];    // (kAb: X's operand, from which the producer forms x)
  float gamma[kChunk];
  float decay[kChunk];
};
template <typename T>
struct SharedStoragePair {
  StagePairSw<T> stage[kStages];
  alignas(16) T o[2][2][kChunk * kLdC];  // each half's O tiles (state_role's sm.o)
  uint64_t tma_bar[kStages];            // a stage's boxes, one phase per fill
  MergeScratch merge;                   // (a merge's source: walk_may_merge's sums)
};
template <typename Storage>
constexpr bool kPairStorage = false;
template <typename T>
constexpr bool kPairStorage<SharedStoragePair<T>> = true;
static_assert(sizeof(SharedStoragePair<__nv_bfloat16>) + 1024 <= 227 * 1024, "the paired chain's storage, aligned, fits");
static_assert(offsetof(SharedStoragePair<__nv_bfloat16>, o) % 256 == 0 && kChunk * kLdC * 2 % 256 == 0,
              "each warp's O piece on the 256-byte span of encode_o's 32-byte swizzle");
constexpr int kPairThreads = 2 * kStateThreads + kAuxThreads;
// Registers: each state warpgroup as the wgmma chain with O (kStateRegs); the producer only issues boxes, zeroes
// rows past a sequence's end and releases stages.
constexpr int kPairProdRegs = 40;
// kAb: the producer also forms X (form_x: 32 accumulators), in registers the state warpgroups give up. setmaxnreg.inc
// takes registers only from those the CTA's setmaxnreg.dec released, so the sum stays at the launch's 3 x 168 = 504
// a thread slot (CUTLASS's and FA3's splits stay there too): at 512 (224 / 64) the first paired launch hung in the
// GPU tests, at 216 / 72 they pass (session 47).
constexpr int kPairAbStateRegs = 216, kPairAbProdRegs = 72;
static_assert(2 * kPairAbStateRegs + kPairAbProdRegs <= 504 && 2 * kStateRegs + kPairProdRegs <= 504,
              "the pairs' registers, as the launch allocates them (3 x 168)");
namespace pr {
enum Barrier : uint32_t {
  // + 2 stage + half: producer -> one state warpgroup (one each: a barrier both waited on would hold the two
  // halves in step, their products then contending for the tensor cores and their epilogues leaving them idle)
  kFull = 1,
  kEmpty = kFull + 2 * kStages,  // + stage: both state warpgroups -> producer
  kState = kEmpty + kStages,     // + half: among one state warpgroup
  kProd = kState + 2,            // among the producer's warps
  // + 2 stage + half (kAb): producer -> one state warpgroup, X formed. The stage's other tiles are handed over
  // at kFull, before form_x, so a state step's K S^T, Z, Y and O products need not wait for X (its last operand).
  // Measured (NOTES, session 50): +5% on the pair alone (form_x then contends with those wgmma), -4..-8% together
  // with the O store by TMA; without it, beside the TMA store, is benchmarks/pending/no-xbar.patch
  kFullX = kProd + 1,
};
static_assert(kFullX + 2 * kStages <= 16, "16 named barriers");
constexpr int kFullThreads = kStateThreads + kAuxThreads;
constexpr int kHandoffThreads = kPairThreads;
}  // namespace pr

// The chains whose per-chunk states leave by TMA (tma::encode_state_rows; launched where the map exists): the
// loaders compute no products, so of their scratch only the gates, and no O tiles; instead two state boxes, one
// being stored while the next chunk's is written. The state recompute's (the wgmma chain on prepared chunks
// without o): its 16-bit states, one 128 K x 64 V box a chunk. The dS chain's (gdn_bwd_dh.cuh): dS' in fp32, two
// 128 K x 32 V boxes a chunk.
template <typename T>
struct SharedStorageSwSt {
  StageSwV<T> stage[kStages];  // (K, X and V by TMA: V swizzled too)
  GateScratch aux[kAuxGroups];
  alignas(1024) T st_box[2][kDimK * 64];
  uint64_t tma_bar[kStages];  // a stage's K, X and V, one phase per fill
  MergeScratch merge;  // (the states merge)
};
template <typename T>
struct SharedStorageSwBwdSt {
  StageSwBwd<T> stage[kStages];
  GateScratch aux[kAuxGroups];
  alignas(1024) float st_box[2][kDimK * 64];
  MergeScratch merge;  // (the merging dS chain, gdn_bwd_dh's kMerge)
};
template <typename Storage>
constexpr bool kStatesByTma = false;
template <typename T>
constexpr bool kStatesByTma<SharedStorageSwSt<T>> = true;
template <typename T>
constexpr bool kStatesByTma<SharedStorageSwBwdSt<T>> = true;
static_assert(sizeof(SharedStorageSwSt<__nv_bfloat16>) + 1024 <= 227 * 1024 &&
                  sizeof(SharedStorageSwBwdSt<__nv_bfloat16>) + 1024 <= 227 * 1024,
              "the state-box storages, aligned, fit");
// The O warps start Q S^T when S^T is published (ob::kPubS), not with Z^T: in the TMA form only (session 20:
// -0.4..-3% there with its loads; +1.5..+2.3% in the prep-beside-chain kernel, whose loaders bind first).
template <typename Storage>
constexpr bool kEarlyQs = false;
template <typename T>
constexpr bool kEarlyQs<SharedStorageObTma<T>> = true;
static_assert(sizeof(SharedStorageOb<__nv_bfloat16>) + 1024 <= 227 * 1024 &&
                  sizeof(SharedStorageObTma<__nv_bfloat16>) <= sizeof(SharedStorageOb<__nv_bfloat16>),
              "the O-beside storage, aligned, fits (the TMA form's is no larger: the launch sizes it as the copies')");
// The 16 bytes at (row r, column c, a multiple of 8) of a stage tile, in either layout (the swizzled form also
// for the gradient kernel's 128-row state tiles; from any c, the bytes up to the next multiple of 8).
template <typename T>
CUTLASS_DEVICE T* tile16(T (&t)[kChunk * kLdK], int r, int c) { return &t[r * kLdK + c]; }
template <typename T>
CUTLASS_DEVICE T* tile16(T (&t)[kChunk * kLdC], int r, int c) { return &t[r * kLdC + c]; }
template <typename T, int N>
CUTLASS_DEVICE T* tile16(T (&t)[2][N], int r, int c) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(t[c >> 6]) + gmma::sw128_off(r, c & 63));
}
template <typename T, int N>
CUTLASS_DEVICE const T* tile16(const T (&t)[2][N], int r, int c) {
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(t[c >> 6]) + gmma::sw128_off(r, c & 63));
}
template <typename T>
CUTLASS_DEVICE T* tile16(T (&t)[kChunk * 64], int r, int c) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(t) + gmma::sw128_off(r, c));
}
template <typename T>
CUTLASS_DEVICE const T* tile16(const T (&t)[kChunk * 64], int r, int c) {
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(t) + gmma::sw128_off(r, c));
}
template <typename T>
CUTLASS_DEVICE const T* tile16(const T (&t)[kChunk * kLdC], int r, int c) { return &t[r * kLdC + c]; }
template <typename StageT>
constexpr bool kSwizzledStage = false;
template <typename T, int kVElems>
constexpr bool kSwizzledStage<StageSwOf<T, kVElems>> = true;
template <typename T>
constexpr bool kSwizzledStage<StageSwBwd<T>> = true;
template <typename T>
constexpr bool kSwizzledStage<StagePairSw<T>> = true;

// Where one CTA's work lives.
static_assert(kChunk == 64, "chunk_bound (kernels.h) counts 64-token chunks");

template <typename T>
struct Work {
  const T* q;   // row 0 of the sequence, this head
  const T* k;
  const T* v;   // ... and this CTA's first V column
  T* o;
  int64_t b, h, t0, len, state_off;
  int64_t num_chunks;
  int64_t flat0;  // b * seqlen + t0: the row of the prepared X / W buffers holding this sequence's first token
  int64_t col0;   // this CTA's first V column
  int64_t chunk0; // the backward: this sequence's first chunk in the chunks of all sequences
};

// Split mode (FLASHQLA_FWD_SPLIT, default on): a chunk-parallel kernel (gdn_prep_kernel) computes every
// chunk's X and W into these buffers, [batch * seqlen, heads_v, 128] and [batch * seqlen, heads_v, 64]
// (row = token), and the recurrent kernel's aux warps only load them. The fused mode computes them in
// the recurrent kernel, on the critical path of each CTA.
template <typename T>
struct PrepBuffers {
  T* x;
  T* w;
  float* a = nullptr;  // backward prep only: the inverse's rows for the gradient kernel (flashqla_gdn_bwd_dh's a)
  // Prep beside the chain (gdn_fwd_mma_kernel's kOverlap): one flag per (chunk of all sequences, value head), set
  // once that chunk's X and W are in x and w; chunks at or past ready_chunks are never waited for. prep_ctas: the
  // launch's first CTAs, which do the prep.
  int* ready = nullptr;
  int64_t ready_chunks = 0;
  int prep_ctas = 0;
  // The workers' pace (prep_ahead's rule; 0 = free): a worker starts chunk c of a sequence once the chain has
  // taken chunk c - ahead of that head (its loader marks the flag 2), so X and W are still in L2 when the chain
  // loads them. A bounded wait (kAheadWaitNs): a chain that is not resident cannot stall the workers.
  int ahead = 0;
  // Not null (gates_from_prep): the wgmma prep kernel also writes each chunk's gamma and decay here, [chunk of all
  // sequences, heads_v, 128] fp32 (gamma's 64 then decay's 64, as a stage holds them), and the O-beside chain's
  // TMA loader brings them with one 512-byte copy instead of computing them (compute_gates: ~2k cycles of its
  // warp 0 a chunk, mostly the latency of g's and beta's strided loads)
  float* gates = nullptr;
  // The states merge (state_role's kMerge): kStateMergeCheckpoints fp32 state tiles per (segment, value head), or
  // NULL: the summaries' B half writes them, the state recompute compares with them
  float* merge_ckpt = nullptr;
  // The forward's merge (the last pass with o): the source's final states, a merged walk's own
  const float* merge_final = nullptr;
  // X's operand instead of X where the paired chain runs (launch: the op's own workspace, workspace_private;
  // FLASHQLA_PREP_AB): the wgmma prep kernel (its kAb) writes, in X's first 64 columns, the operand X is formed from
  // (row i: beta_i A[m][i] over m, the same 16-bit values its own X product would read), and the pair's producer
  // (its kAb) forms X = that operand times K itself (form_x; the same bits): 8 KB a chunk-head where X took 16,
  // once written and once read.
  bool ab_only = false;
};
// The ready flags' two sides: the writer's threads each fence their X / W stores and meet at a barrier before one
// of them releases the flag; the reader acquires it and its group meets at a barrier before copying. A wait that
// outlasts any prep (~2^26 polls, seconds) traps: an error instead of a hang.
CUTLASS_DEVICE void release_flag(int* f) { asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(f), "r"(1) : "memory"); }
// The chain's loader has taken the chunk (its TMA copies of X and W are issued): the workers' pace (pb.ahead)
CUTLASS_DEVICE void mark_taken(int* f) { asm volatile("st.relaxed.gpu.global.s32 [%0], %1;\n" ::"l"(f), "r"(2) : "memory"); }
// A worker's wait for the chain to take a chunk: a hint, not a dependency (X and W never depend on it), so it
// gives up after kAheadWaitNs (false; the worker then stops pacing itself): workers never wait long on chain CTAs
// that are not running (the sanitizers run CTAs one at a time; other kernels may hold the SMs).
constexpr uint64_t kAheadWaitNs = 20000;
CUTLASS_DEVICE uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
CUTLASS_DEVICE bool wait_taken(const int* f) {
  const uint64_t t0 = global_ns();
  for (;;) {
    int v;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
    if (v == 2) return true;
    if (global_ns() - t0 > kAheadWaitNs) return false;
    __nanosleep(128);
  }
}
CUTLASS_DEVICE void wait_flag(const int* f) {
  for (long long n = 0;; ++n) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(f) : "memory");
    if (v != 0) return;
    if (n > (1LL << 26)) __trap();
    __nanosleep(64);
  }
}
// The chain's loader taking chunk `chunk` (of all sequences) of head h: waits for its flag, then (paced workers)
// marks it taken
template <typename T>
CUTLASS_DEVICE void take_ready_chunk(const PrepBuffers<T>& pb, int64_t chunk, int64_t heads, int64_t h) {
  if (chunk >= pb.ready_chunks) return;  // (never prepared as a flagged chunk: malformed cu_seqlens' extra chunks)
  int* flag = pb.ready + chunk * heads + h;
  wait_flag(flag);
  if (pb.ahead > 0) mark_taken(flag);
}
// A state tile in the state warps' registers: S^T (or dS^T), 16 V rows x 8 NT K columns per warp as NT C tiles
// (NT = 16: all 128 K; 8: one half, the K-split chain); in memory [K][V] rows of kDimV floats (states, their
// gradients), src / dst at the tile's first K row. This thread's V columns: v0, v0 + 8.
template <int NT>
CUTLASS_DEVICE void load_state_tile(float (&acc)[NT][4], const float* src, int tq, int v0) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      acc[j][e] = src != nullptr ? src[int64_t(8 * j + 2 * tq + (e & 1)) * kDimV + v0 + 8 * (e >> 1)] : 0.f;
}
// C tiles j0, j0 + 1 of it (K columns 8 j0 .. 8 j0 + 15)
template <int NT>
CUTLASS_DEVICE void store_state_tiles(float* dst, const float (&acc)[NT][4], int j0, int tq, int v0) {
#pragma unroll
  for (int j = j0; j < j0 + 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dst[int64_t(8 * j + 2 * tq + (e & 1)) * kDimV + v0 + 8 * (e >> 1)] = acc[j][e];
}
template <int NT>
CUTLASS_DEVICE void store_state_tile(float* dst, const float (&acc)[NT][4], int tq, int v0) {
#pragma unroll
  for (int j = 0; j < NT; j += 2) store_state_tiles(dst, acc, j, tq, v0);
}

// 64 K rows of the same tile in T (the chunk states, which the backward's products read rounded to T anyway),
// from the chain's A-operand form of it (c_to_a: sa[kq][r] packs K rows 16 kq + 8 (r / 2) + 2 tq and the next
// one, V column 8 (r % 2) + tq's group of the warp's 16): no conversion of its own (converting value by value cost
// the chain ~8%, measured). dst: the first of the 64 K rows at the warp's first V column; stage: the warp's 2 KB
// of shared memory. stmatrix.trans turns the fragments into [K][16 V] rows of 32 bytes (the two 16-byte halves
// swapped on rows 4..7 mod 8, so an stmatrix's 8 rows hit distinct banks), then each lane stores 16-byte pieces,
// 16 rows per instruction. Stored straight from the fragments (2-byte stores, 4 rows per instruction, 64 per
// lane) the state took ~2.5k of the recompute chain's ~5.6k cycles a step (phase tables, session 10).
template <typename T>
CUTLASS_DEVICE void store_state_rows64(T* dst, const uint32_t (&sa)[4][4], T* stage, int lane) {
  const int m = lane >> 3;  // the stmatrix matrix whose row this lane addresses
  __syncwarp();  // the previous rows' reads of stage are done
#pragma unroll
  for (int kq = 0; kq < 4; ++kq) {
    const int row = 16 * kq + 8 * (m >> 1) + (lane & 7);
    warp::stsm_x4_trans(stage + row * 16 + 8 * ((m & 1) ^ ((row >> 2) & 1)), sa[kq]);
  }
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int q = 32 * it + lane, row = q >> 1, hv = q & 1;
    *reinterpret_cast<uint4*>(dst + int64_t(row) * kDimV + 8 * hv) =
        *reinterpret_cast<const uint4*>(stage + row * 16 + 8 * (hv ^ ((row >> 2) & 1)));
  }
}
// All 128 K rows (the full chain's tile), 64 at a time through the same 2 KB.
template <typename T>
CUTLASS_DEVICE void store_state_tile(T* dst, const uint32_t (&sa)[8][4], T* stage, int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half)
    store_state_rows64(dst + int64_t(64 * half) * kDimV, reinterpret_cast<const uint32_t(&)[4][4]>(sa[4 * half]), stage,
                       lane);
}

// A chain CTA's state tile into the box(es) of a state-rows map (tma::encode_state_rows: rows of 128 bytes, the
// 16-byte piece p of K row k at piece p ^ (k % 8)), for one thread's TMA store: through the copy engine the
// 64 x 128 tile of a step costs the state warps a few shared-memory writes, where their scattered global stores
// (32 bytes of a K row per warp and instruction) took ~1.5k cycles of the step (session 22's phase tables).
// 16-bit, from the A fragments of S^T (sa, as store_state_rows64 reads them): one box of 64 V columns; warp s
// writes its 16 columns, pieces 2 s and 2 s + 1 of every row, stmatrix rows on 8 distinct pieces.
template <typename T>
CUTLASS_DEVICE void stage_state_box(T* box, const uint32_t (&sa)[8][4], int s, int lane) {
  const int m = lane >> 3;  // the stmatrix matrix whose row this lane addresses
#pragma unroll
  for (int kq = 0; kq < 8; ++kq) {
    const int k = 16 * kq + 8 * (m >> 1) + (lane & 7);
    warp::stsm_x4_trans(box + k * 64 + 8 * ((2 * s + (m & 1)) ^ (k & 7)), sa[kq]);
  }
}
// fp32, from the accumulators of S^T (element e of C tile j: V column v0 + 8 (e / 2), K row 8 j + 2 tq + e % 2):
// two boxes of 32 V columns, warp s writing into box s / 2; a store's 32 lanes hit 32 distinct banks.
CUTLASS_DEVICE void stage_state_box(float* boxes, const float (&acc)[16][4], int s, int lane) {
  float* box = boxes + (s >> 1) * (kDimK * 32);
  const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int k = 8 * j + 2 * tq + (e & 1), vl = 16 * (s & 1) + gq + 8 * (e >> 1);
      box[k * 32 + 4 * ((vl >> 2) ^ (k & 7)) + (vl & 3)] = acc[j][e];
    }
}
// One chunk's state out by TMA from box (of a SharedStorage*St's two, alternating by chunk): thread 0 waits until
// the box's previous store (two chunks back) has read it, the state warps write it, and thread 0 stores it to the
// rows of slot `slot` (chunk and value head), V columns col0 .. col0 + 63. The caller waits for every store
// (bulk_wait) before the CTA exits.
template <typename E, typename Frag>
CUTLASS_DEVICE void store_state_by_tma(const CUtensorMap* map, E* box, const Frag& frag, int64_t slot, int col0,
                                       uint32_t bar, int tid) {
  const int s = tid >> 5, lane = tid & 31;
  if (tid == 0) warp::bulk_wait_read<1>();
  warp::bar_sync(bar, kStateThreads);
  stage_state_box(box, frag, s, lane);
  warp::fence_async_smem();  // (the writes, then the async proxy's read)
  warp::bar_sync(bar, kStateThreads);
  if (tid == 0) {
    constexpr int kBoxCols = 128 / static_cast<int>(sizeof(E));
    const int row = static_cast<int>(slot * kDimK);
#pragma unroll
    for (int b = 0; b < kBlockV / kBoxCols; ++b) tma::store_box2(map, box + b * (kDimK * kBoxCols), col0 + b * kBoxCols, row);
    warp::bulk_commit();
  }
}

// Per-lane fragment indices of an aux warp w (16 chunk rows each): the two rows of its C fragments.
struct AuxLane {
  int w, lane, gq, tq, i0, i1;
  warp::LdsmOffsets ld;
  CUTLASS_DEVICE explicit AuxLane(int tid)
      : w(tid >> 5), lane(tid & 31), gq((tid & 31) >> 2), tq(tid & 3), i0(16 * (tid >> 5) + ((tid & 31) >> 2)),
        i1(16 * (tid >> 5) + ((tid & 31) >> 2) + 8), ld(tid & 31) {}
};

// The Work of one CTA tile: V columns [col0, col0 + kBlockV) of value head ct.h of sequence ct.n (the prep
// kernels pass col0 = 0 and read all columns); v and o point at row 0 of the sequence.
template <typename T>
CUTLASS_DEVICE Work<T> make_work(const flashqla_gdn_fwd_params_t& p, const CtaTile& ct) {
  Work<T> wk;
  const int64_t b = ct.b, bos = ct.bos;
  wk.q = static_cast<const T*>(p.q) + b * p.q_stride_batch + bos * p.q_stride_time + ct.hq * p.q_stride_head;
  wk.k = static_cast<const T*>(p.k) + b * p.k_stride_batch + bos * p.k_stride_time + ct.hq * p.k_stride_head;
  wk.v = p.v == nullptr ? nullptr  // v = 0 (the transition pass of exact parallelism): nothing read
                        : static_cast<const T*>(p.v) + b * p.v_stride_batch + bos * p.v_stride_time + ct.h * p.v_stride_head + ct.col0;
  wk.o = p.o == nullptr ? nullptr  // summaries only (exact parallelism's first passes)
                        : static_cast<T*>(p.o) + b * p.o_stride_batch + bos * p.o_stride_time + ct.h * p.o_stride_head + ct.col0;
  wk.b = b;
  wk.h = ct.h;
  wk.t0 = bos;
  wk.len = ct.eos - bos;
  wk.num_chunks = (wk.len + kChunk - 1) / kChunk;
  wk.state_off = (ct.n * p.heads_v + ct.h) * int64_t(kDimK) * kDimV + ct.col0;
  wk.flat0 = b * p.seqlen + bos;
  wk.col0 = ct.col0;
  wk.chunk0 = 0;
  return wk;
}

// kFused: load and compute in the recurrent kernel; kLoadPrepared: load K, Q, V, X, W (split mode);
// kInputsOnly: load K, Q, gates and l2norm only (the prep kernels, which then compute the products themselves).
// kLoadBwd (gdn_bwd_dh.cuh): the backward's recurrent loader, chunks in reverse: K, Q, dO (in v), W' (in x) and
// U (in w, this CTA's columns).
// kPrepStates: the prep kernel for a recurrence without o (the backward's state recompute): X only (no Q, no
// Q K^T, no M, no W: they serve O alone).
enum class AuxMode { kFused, kLoadPrepared, kInputsOnly, kLoadBwd, kPrepStates };

// ---- The chunk's products (K K^T, Q K^T, L, P, the inverse A, M, W, X) from the loaded K, Q, G and beta.

// The raw Gram products (no gates): K K^T for row block 3 - w in kk, Q K^T for row block w in qk, column tiles
// up to the diagonal: 4 - w plus w + 1 tiles, five per warp (one row block for both gave warp 3 four times
// warp 0's work). The value heads of a GVA group share them (gdn_prep_kernel).
// (kKK false: Q K^T only, kk untouched; kQK false: K K^T only, qk untouched and Q not read)
template <typename T, bool kKK = true, bool kQK = true, typename StageT>
CUTLASS_DEVICE void aux_gram_raw(const StageT& S, int tid, float (&kk)[8][4], float (&qk)[8][4]) {
  using namespace warp;
  static_assert(kKK || kQK, "at least one product");
  const AuxLane al(tid);
  const int w = al.w;
  const LdsmOffsets& ld = al.ld;
  const int r = kKK ? 3 - w : -1;
  const int wq = kQK ? w : -1;
  if constexpr (kKK) zero_acc(kk);
  if constexpr (kQK) zero_acc(qk);
  // (swizzled stages through tile16; the padded ones' addressing kept as first written, which their SASS rests on)
  constexpr bool kSw = kSwizzledStage<StageT>;
#pragma unroll
  for (int ks = 0; ks < kDimK / 16; ++ks) {
    uint32_t ak[4], aq[4];
    if constexpr (kKK && kSw) ldsm_x4(ak, tile16(S.k, 16 * r + ld.a_row, 16 * ks + ld.a_col));
    if constexpr (kQK && kSw) ldsm_x4(aq, tile16(S.q, 16 * w + ld.a_row, 16 * ks + ld.a_col));
    if constexpr (kKK && !kSw) ldsm_x4(ak, &S.k[(16 * r + ld.a_row) * kLdK + 16 * ks + ld.a_col]);
    if constexpr (kQK && !kSw) ldsm_x4(aq, &S.q[(16 * w + ld.a_row) * kLdK + 16 * ks + ld.a_col]);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      if (np > r && np > wq) continue;
      uint32_t b[4];
      if constexpr (kSw)
        ldsm_x4(b, tile16(S.k, 16 * np + ld.b_row, 16 * ks + ld.b_col));
      else
        ldsm_x4(b, &S.k[(16 * np + ld.b_row) * kLdK + 16 * ks + ld.b_col]);
      if (kKK && np <= r) mma_pair<T>(kk, np, ak, b);
      if constexpr (kQK)
        if (np <= w) mma_pair<T>(qk, np, aq, b);
    }
  }
}

// P = Q K^T * Gamma (masked lower) of C tile nt in this warp's rows [16w, 16w + 16), from the raw Q K^T tile
// and this head's G (ax.G).
template <typename T, typename Ax>
CUTLASS_DEVICE void gate_p_tile(const Ax& ax, const AuxLane& al, int nt, const float (&raw)[4],
                                float (&out)[4]) {
  const int j = 8 * nt + 2 * al.tq, i0 = al.i0, i1 = al.i1;
  const float G0 = ax.G[i0], G1 = ax.G[i1], Gj0 = ax.G[j], Gj1 = ax.G[j + 1];
  out[0] = j <= i0 ? raw[0] * gate_exp(G0 - Gj0) : 0.f;
  out[1] = j + 1 <= i0 ? raw[1] * gate_exp(G0 - Gj1) : 0.f;
  out[2] = j <= i1 ? raw[2] * gate_exp(G1 - Gj0) : 0.f;
  out[3] = j + 1 <= i1 ? raw[3] * gate_exp(G1 - Gj1) : 0.f;
}

// From the raw K K^T and this head's gates (ax.G, ax.beta): L = StrictLower(diag(beta) K K^T) to ax.la, then
// the inverse A = (I + L)^-1 in ax.la (fp32). Only A's 16 x 16 blocks on and below the diagonal are written
// (the diagonal blocks with zeros above the diagonal); the blocks above keep whatever was there: A is lower
// triangular, and readers that touch that region mask it (the gradient kernel's A^T did not, see NOTES).
// kk_block: the row block of K K^T this warp holds (aux_gram_raw's 3 - w, the wgmma Gram's w).
template <typename T, typename Ax>
CUTLASS_DEVICE void aux_gates_inverse(Ax& ax, int tid, uint32_t bar_aux, long long& t_mark,
                                      const float (&kk)[8][4], int kk_block = -1) {
  using namespace warp;
  (void)t_mark;
  const AuxLane al(tid);
  const int w = al.w, lane = al.lane, tq = al.tq;
  const int r = kk_block >= 0 ? kk_block : 3 - w;
  // L = StrictLower(diag(beta) K K^T) rows of block r to shared memory
  {
    const int k0 = 16 * r + al.gq, k1 = k0 + 8;
    const float bk0 = ax.beta[k0], bk1 = ax.beta[k1];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      if (nt > 2 * r + 1) continue;
      const int j = 8 * nt + 2 * tq;
      ax.la[k0 * kLdF + j] = j < k0 ? bk0 * kk[nt][0] : 0.f;
      ax.la[k0 * kLdF + j + 1] = j + 1 < k0 ? bk0 * kk[nt][1] : 0.f;
      ax.la[k1 * kLdF + j] = j < k1 ? bk1 * kk[nt][2] : 0.f;
      ax.la[k1 * kLdF + j + 1] = j + 1 < k1 ? bk1 * kk[nt][3] : 0.f;
    }
  }
  bar_sync(bar_aux, kAuxThreads);
  FLASHQLA_ROLE_PHASE(1, kAuxGram);

  // ---- A = (I + L)^-1, fp32. Diagonal 16 x 16 blocks by forward substitution: lane < 16 owns a column.
  float x[16];
  if (lane < 16) {
    const int o = 16 * w;
    unit_lower16_inverse_column(&ax.la[o * kLdF + o], kLdF, lane, x);
  }
  __syncwarp();  // every lane has read the L block: A's diagonal block overwrites it
  if (lane < 16) {
    const int o = 16 * w;
#pragma unroll
    for (int r = 0; r < 16; ++r) ax.la[(o + r) * kLdF + o + lane] = x[r];
  }
  bar_sync(bar_aux, kAuxThreads);
  FLASHQLA_ROLE_PHASE(1, kAuxInvDiag);
  // 16 -> 32 (warps 1 and 3): A21 = -A22 (L21 A11)
  if (w & 1) {
    const int o = 16 * (w - 1);
    float* tmp = &ax.scratch[o / 2 * kLdS];
    float t[2][4] = {};
    mma16x16_tf32(t, &ax.la[(o + 16) * kLdF + o], kLdF, &ax.la[o * kLdF + o], kLdF, 2, lane);
    store16x16(tmp, kLdS, t, 1.f, lane);
    __syncwarp();
    float r[2][4] = {};
    mma16x16_tf32(r, &ax.la[(o + 16) * kLdF + o + 16], kLdF, tmp, kLdS, 2, lane);
    store16x16(&ax.la[(o + 16) * kLdF + o], kLdF, r, -1.f, lane);
  }
  bar_sync(bar_aux, kAuxThreads);
  // 32 -> 64: T = L_bl A_tl (warp w: 16 x 16 block (w / 2, w % 2)), then A_bl = -A_br T
  {
    const int rb = w >> 1, cb = w & 1;
    float t[2][4] = {};
    for (int kb = cb; kb < 2; ++kb)
      mma16x16_tf32(t, &ax.la[(32 + 16 * rb) * kLdF + 16 * kb], kLdF, &ax.la[16 * kb * kLdF + 16 * cb], kLdF, 2, lane);
    store16x16(&ax.scratch[16 * rb * kLdS + 16 * cb], kLdS, t, 1.f, lane);
    bar_sync(bar_aux, kAuxThreads);
    float r[2][4] = {};
    for (int kb = 0; kb <= rb; ++kb)
      mma16x16_tf32(r, &ax.la[(32 + 16 * rb) * kLdF + 32 + 16 * kb], kLdF, &ax.scratch[16 * kb * kLdS + 16 * cb], kLdS,
                    2, lane);
    store16x16(&ax.la[(32 + 16 * rb) * kLdF + 16 * cb], kLdF, r, -1.f, lane);
  }
  bar_sync(bar_aux, kAuxThreads);
  FLASHQLA_ROLE_PHASE(1, kAuxInvMerge);
}

// K K^T, Q K^T, L, P and the inverse: A = (I + L)^-1 in ax.la (fp32), P = Q K^T * Gamma (masked lower) for
// rows [16w, 16w + 16) in `qk` (C fragments). The forward's and the backward's products both start here.
template <typename T, typename StageT, typename Ax>
CUTLASS_DEVICE void aux_gram_inverse(StageT& S, Ax& ax, int tid, uint32_t bar_aux, long long& t_mark,
                                     float (&qk)[8][4]) {
  float kk[8][4];
  aux_gram_raw<T>(S, tid, kk, qk);
  aux_gates_inverse<T>(ax, tid, bar_aux, t_mark, kk);  // K K^T dies here, before P is formed
  const AuxLane al(tid);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)  // tiles past the diagonal block stay zero
    if (nt <= 2 * al.w + 1) gate_p_tile<T>(ax, al, nt, qk[nt], qk[nt]);
}

// The same from a swizzled stage (the wgmma prep, PrepStorageWg): K K^T and Q K^T as two 64 x 64 x 128 wgmma
// products with both operands in shared memory, warp w holding row block w of each (all 64 columns: the
// blocks above the diagonal are computed and masked, 16 instructions in all against ~300 mma.sync and their
// ldmatrix). The caller has made the tiles visible to the async proxy (fence_async_smem, then a barrier). Ends
// with P in qk and M = (Gamma * A) diag(beta) in S.m (swizzled; not yet fenced for the wgmma).
template <typename T, typename StageT, typename Ax>
CUTLASS_DEVICE void aux_gram_inverse_wg(StageT& S, Ax& ax, int tid, uint32_t bar_aux, long long& t_mark,
                                        float (&qk)[8][4]) {
  using namespace gmma;
  float kk[8][4];
  warp::zero_acc(kk);
  warp::zero_acc(qk);
  auto& k32 = reinterpret_cast<float(&)[32]>(kk);
  auto& q32 = reinterpret_cast<float(&)[32]>(qk);
  const auto desc = [](const T (&tile)[2][kChunk * 64], int ks) {  // k16 step ks: 32 bytes a step in its block
    return make_desc_sw128(reinterpret_cast<const char*>(tile[ks >> 2]) + 32 * (ks & 3), 16, 1024);
  };
  fence();
  pin(k32);
  pin(q32);
#pragma unroll
  for (int ks = 0; ks < kDimK / 16; ++ks) {
    wgmma_ss<64, T>(k32, desc(S.k, ks), desc(S.k, ks));
    wgmma_ss<64, T>(q32, desc(S.q, ks), desc(S.k, ks));
  }
  commit();
  wait_all();
  pin(k32);
  pin(q32);
  const AuxLane al(tid);
  warp::bar_sync(bar_aux, kAuxThreads);  // every warp's products have read Q: L is written over it (PrepStorageWg)
  aux_gates_inverse<T>(ax, tid, bar_aux, t_mark, kk, al.w);
  // P = Q K^T * Gamma and M = (Gamma * A) diag(beta) in this warp's rows, from one Gamma an element (gate_p_tile's
  // and lower_piece8's products, in their order: the same bits), M out by stmatrix 128-byte swizzled, all four
  // 16 x 16 blocks of the row block (W = P M reads every block as wgmma's B: zeros right of the diagonal). P's and
  // M's tiles past the diagonal block are zero. The inverse's scratch, which M's space held, died at its last
  // barrier. aux_mwx_wg makes M visible to the wgmma.
  const float G0 = ax.G[al.i0], G1 = ax.G[al.i1];
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    uint32_t a[4];  // M's A-order fragment of block (w, kb) (warp::c_to_a's packing), tile by tile
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mc[4];
      const int nt = 2 * kb + h, j = 8 * nt + 2 * al.tq;
      if (kb <= al.w) {
        const float2 gj = *reinterpret_cast<const float2*>(&ax.G[j]);
        const float2 bj = *reinterpret_cast<const float2*>(&ax.beta[j]);
        const float2 a0 = *reinterpret_cast<const float2*>(&ax.la[al.i0 * kLdF + j]);
        const float2 a1 = *reinterpret_cast<const float2*>(&ax.la[al.i1 * kLdF + j]);
        const float e[4] = {gate_exp(G0 - gj.x), gate_exp(G0 - gj.y), gate_exp(G1 - gj.x), gate_exp(G1 - gj.y)};
        const float av[4] = {a0.x, a0.y, a1.x, a1.y}, bv[2] = {bj.x, bj.y};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const bool low = j + (q & 1) <= (q < 2 ? al.i0 : al.i1);
          qk[nt][q] = low ? qk[nt][q] * e[q] : 0.f;
          mc[q] = low ? e[q] * av[q] * bv[q & 1] : 0.f;
        }
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) qk[nt][q] = mc[q] = 0.f;
      }
      a[2 * h] = warp::pack2<T>(mc[0], mc[1]);
      a[2 * h + 1] = warp::pack2<T>(mc[2], mc[3]);
    }
    warp::stsm_x4(tile16(S.m, 16 * al.w + al.ld.a_row, 16 * kb + al.ld.a_col), a);
  }
}

// X = diag(beta) A^T K (the state update's right factor), rows [16w, 16w + 16) of this warp, K columns
// [64 half, 64 half + 64), from A in ax.la (fp32) and K in S.k: A operand (i, m) = beta_i A[m][i], m >= 16w;
// b0, b1 = beta of this thread's rows al.i0, al.i1. The forward's prep and the backward's shared prep both form X
// here (bitwise the same X).
template <typename T, typename StageT, typename Ax>
CUTLASS_DEVICE void x_half(const StageT& S, const Ax& ax, const AuxLane& al, int half, float b0, float b1,
                           float (&xa)[8][4]) {
  using namespace warp;
  const int w = al.w, tq = al.tq, i0 = al.i0, i1 = al.i1;
  const LdsmOffsets& ld = al.ld;
  zero_acc(xa);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    if (ks < w) continue;
    const int m0 = 16 * ks + 2 * tq;
    const float* A = ax.la;
    const uint32_t af[4] = {pack2<T>(b0 * A[m0 * kLdF + i0], b0 * A[(m0 + 1) * kLdF + i0]),
                            pack2<T>(b1 * A[m0 * kLdF + i1], b1 * A[(m0 + 1) * kLdF + i1]),
                            pack2<T>(b0 * A[(m0 + 8) * kLdF + i0], b0 * A[(m0 + 9) * kLdF + i0]),
                            pack2<T>(b1 * A[(m0 + 8) * kLdF + i1], b1 * A[(m0 + 9) * kLdF + i1])};
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t b[4];
      ldsm_x4_trans(b, &S.k[(16 * ks + ld.bt_row) * kLdK + 64 * half + 16 * np + ld.bt_col]);
      mma_pair<T>(xa, np, af, b);
    }
  }
}

// Where W = P M goes: the stage's w (default), or a caller's sink (the prep kernel stores it to global memory
// straight from the fragments).
struct WToStage {
  template <typename StageT>
  CUTLASS_DEVICE void operator()(StageT& S, int w, const float (&wa)[8][4], int lane) const {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(S.w[0])>>;
    warp::store_c_tiles<T>(&S.w[16 * w * kLdC], kLdC, wa, lane);
  }
};
// Where the wgmma prep's X goes (aux_mwx_wg), one 64-column half at a time: the stage's padded x (default; the
// workers beside the chain store its rows from there), or XToSwizzledQ: Q's two 64 x 64 blocks (dead by then),
// 128-byte swizzled by stmatrix, as one TMA store box each (the prep kernel's).
struct XToStage {
  template <typename StageT>
  CUTLASS_DEVICE void operator()(StageT& S, int w, int half, const float (&xa)[8][4], int lane) const {
    using T = std::remove_cv_t<std::remove_reference_t<decltype(S.x[0])>>;
    warp::store_c_tiles<T>(&S.x[16 * w * kLdK + 64 * half], kLdK, xa, lane);
  }
};
// Whether aux_mwx_wg hands W to its sink after the barrier that follows W's product (WToSwizzledM, below).
template <typename Sink>
constexpr bool kSinkAfterBarrier = false;
// A warpgroup's 64 x 64 fp32 C tile (warp w: rows 16 w ..) into a 128-byte swizzled 16-bit tile, as a TMA box of
// it lies, by stmatrix (the A-fragment order of each 16 x 16 block is stmatrix's, warp::stsm_x4)
template <typename T>
CUTLASS_DEVICE void store_c_swizzled(T (&tile)[kChunk * 64], int w, const float (&c)[8][4], int lane) {
  const warp::LdsmOffsets ld(lane);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[4];
    warp::c_to_a<T>(a, c[2 * kk], c[2 * kk + 1]);
    warp::stsm_x4(tile16(tile, 16 * w + ld.a_row, 16 * kk + ld.a_col), a);
  }
}
struct XToSwizzledQ {
  template <typename StageT>
  CUTLASS_DEVICE void operator()(StageT& S, int w, int half, const float (&xa)[8][4], int lane) const {
    store_c_swizzled(S.q[half], w, xa, lane);
  }
};
// A layout whose M shares memory with X (the prep kernel's, PrepStorage below): X waits for every warp's W.
template <typename StageT>
constexpr bool kMSharesX = false;
template <typename T>
struct PrepStorage;
template <typename T>
constexpr bool kMSharesX<PrepStorage<T>> = true;
template <typename T>
struct PrepStorageWg;  // (the wgmma prep's, swizzled; its M has a space of its own)
template <typename T>
constexpr bool kSwizzledStage<PrepStorageWg<T>> = true;

// Row i, columns [j0, j0 + 8) of a lower-triangular 64 x 64 tile in 16-bit, packed for one 16-byte store:
// element (i, j) = lead * A_ij (* beta_j with kBeta) for j <= i, else 0; lead = e^(G_i - G_j) with kGated, else
// row_lead. A's row and the gates are read as float4 (per element, four shared loads and a 2-byte store cost
// nearly half a prep CTA's shared-memory instructions); the products and their rounding as per element.
template <typename T, bool kGated, bool kBeta, typename Ax>
CUTLASS_DEVICE uint4 lower_piece8(const Ax& ax, int i, int j0, float row_lead = 1.f) {
  static_assert(offsetof(Ax, G) % 16 == 0 && offsetof(Ax, beta) % 16 == 0 && offsetof(Ax, la) % 16 == 0,
                "float4 rows and gates");
  if (j0 > i) return make_uint4(0u, 0u, 0u, 0u);
  const float gi = kGated ? ax.G[i] : 0.f;
  float v[8];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const float4 a = reinterpret_cast<const float4*>(&ax.la[i * kLdF + j0])[q];
    const float4 g = reinterpret_cast<const float4*>(&ax.G[j0])[q];
    const float4 b = reinterpret_cast<const float4*>(&ax.beta[j0])[q];
    const float av[4] = {a.x, a.y, a.z, a.w}, gv[4] = {g.x, g.y, g.z, g.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = (kGated ? gate_exp(gi - gv[e]) : row_lead) * av[e];
      if constexpr (kBeta) x *= bv[e];
      v[4 * q + e] = j0 + 4 * q + e <= i ? x : 0.f;
    }
  }
  return make_uint4(warp::pack2<T>(v[0], v[1]), warp::pack2<T>(v[2], v[3]), warp::pack2<T>(v[4], v[5]),
                    warp::pack2<T>(v[6], v[7]));
}

// The forward's products after the inverse: M, W = P M and X into the stage. qk holds P, or with kRawQK the
// raw Q K^T, gated here tile by tile (the prep kernel keeps it for all heads of a GVA group). kW false: X
// alone (M and W serve O only; qk is not read).
template <typename T, bool kRawQK = false, bool kW = true, typename StageT, typename Ax, typename WSink = WToStage>
CUTLASS_DEVICE void aux_mwx(StageT& S, Ax& ax, int tid, uint32_t bar_aux, long long& t_mark,
                            const float (&qk)[8][4], WSink w_sink = WSink{}) {
  using namespace warp;
  (void)t_mark;
  const AuxLane al(tid);
  const int w = al.w, lane = al.lane;
  const LdsmOffsets& ld = al.ld;
  if constexpr (kW) {

  // ---- M = (Gamma * A) diag(beta) (shared, T): only the 10 16 x 16 blocks on and below the diagonal, the ones
  // W = P M reads (the blocks above keep whatever was there). Element e of block b: 256 b + e; thread tid's
  // iteration it (unrolled) lands in block it / 2, at 128 (it % 2) + tid of it. (Built by 16-byte pieces, as the
  // wgmma prep's M was until it moved into aux_gram_inverse_wg, the rows served by the workers beside the chain ran
  // 2% slower in session 13, against a record from another machine start: within what such comparisons vary, so
  // the workers keep the code that was measured.)
#pragma unroll
  for (int it = 0; it < 20; ++it) {
    constexpr unsigned char kBlocks[10] = {0x00, 0x10, 0x11, 0x20, 0x21, 0x22, 0x30, 0x31, 0x32, 0x33};
    const int blk = kBlocks[it >> 1], e = 128 * (it & 1) + tid;
    const int i = 16 * (blk >> 4) + (e >> 4), j = 16 * (blk & 15) + (e & 15);
    const float val = j <= i ? gate_exp(ax.G[i] - ax.G[j]) * ax.la[i * kLdF + j] * ax.beta[j] : 0.f;
    ax.m[i * kLdC + j] = from_f<T>(val);
  }
  bar_sync(bar_aux, kAuxThreads);  // M complete
  FLASHQLA_ROLE_PHASE(1, kAuxMX);

  // ---- W = P M, rows [16w, 16w + 16); P from registers, M lower triangular
  {
    float wa[8][4];
    zero_acc(wa);
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) {
      if (kb > w) continue;
      uint32_t pa[4];
      if constexpr (kRawQK) {
        float p0[4], p1[4];
        gate_p_tile<T>(ax, al, 2 * kb, qk[2 * kb], p0);
        gate_p_tile<T>(ax, al, 2 * kb + 1, qk[2 * kb + 1], p1);
        c_to_a<T>(pa, p0, p1);
      } else {
        c_to_a<T>(pa, qk[2 * kb], qk[2 * kb + 1]);
      }
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        if (np > kb) continue;
        uint32_t b[4];
        ldsm_x4_trans(b, &ax.m[(16 * kb + ld.bt_row) * kLdC + 16 * np + ld.bt_col]);
        mma_pair<T>(wa, np, pa, b);
      }
    }
    w_sink(S, w, wa, lane);
  }
  if constexpr (kMSharesX<StageT>) bar_sync(bar_aux, kAuxThreads);  // every warp has read M
  }  // kW
  // ---- X = diag(beta) A^T K, rows [16w, 16w + 16), in two 64-column halves (half the accumulators)
  const float b0 = ax.beta[al.i0], b1 = ax.beta[al.i1];
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    float xa[8][4];
    x_half<T>(S, ax, al, half, b0, b1, xa);
    store_c_tiles<T>(&S.x[16 * w * kLdK + 64 * half], kLdK, xa, lane);
  }
  FLASHQLA_ROLE_PHASE(1, kAuxW);
}

// aux_mwx for the wgmma prep (PrepStorageWg), after aux_gram_inverse_wg wrote M 128-byte swizzled, all 16 blocks
// (wgmma reads every block of W = P M's B, so the 6 above the diagonal are zeros, not left over): W = P M as 4
// wgmma m64n64k16 (A: P
// from registers, zero past the warp's diagonal block; B: M, MN-major) and X = diag(beta) A^T K as 2 x 4 (A: the
// operand x_half builds, zeros for the k blocks above the warp's rows; B: K's 64-column halves, MN-major).
// k16 step ks of an MN-major 64-column block (128-byte swizzled, 64 rows): 16 rows, as wgmma's B
template <typename T>
CUTLASS_DEVICE uint64_t mn_desc_sw128(const T* block, int ks) {
  return gmma::make_desc_sw128(reinterpret_cast<const char*>(block) + 2048 * ks, kChunk * 64 * sizeof(T), 1024);
}
// X = (A operand) K in K's two 64-column halves (the prep's X, the pair's form_x): per half, four k16 steps
// step(acc, ks, B descriptor) as one wgmma group, then sink(half, acc)
template <typename T, typename Step, typename Sink>
CUTLASS_DEVICE void x_products(const T (&k)[2][kChunk * 64], Step step, Sink sink) {
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    float xa[8][4];
    warp::zero_acc(xa);
    gmma::wg_chain([&] {
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) step(xa, ks, mn_desc_sw128(k[half], ks));
    }, xa);
    sink(half, xa);
  }
}

template <typename T, typename Ax, typename WSink, typename XSink = XToStage>
CUTLASS_DEVICE void aux_mwx_wg(PrepStorageWg<T>& S, Ax& ax, int tid, uint32_t bar_aux, long long& t_mark,
                               const float (&qk)[8][4], WSink w_sink, XSink x_sink = XSink{}, bool ab_out = false) {
  using namespace gmma;
  (void)t_mark;
  const AuxLane al(tid);
  const int w = al.w, lane = al.lane, tq = al.tq, i0 = al.i0, i1 = al.i1;
  const auto mn_desc = [](const T* block, int ks) { return mn_desc_sw128(block, ks); };
  // (M = (Gamma * A) diag(beta) is in S.m: aux_gram_inverse_wg stored it beside P)
  fence_async_smem();
  warp::bar_sync(bar_aux, kAuxThreads);  // M complete
  FLASHQLA_ROLE_PHASE(1, kAuxMX);
  // X's A operand now, from A in la: X is staged over la (PrepStorageWg), after the barrier below
  const float b0 = ax.beta[i0], b1 = ax.beta[i1];
  uint32_t af[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {  // A operand (i, m) = beta_i A[m][i]: zero where m < 16 w (A lower triangular)
    const int m0 = 16 * ks + 2 * tq;
    const float* A = ax.la;
    const bool on = ks >= w;  // (the diagonal block's upper half holds zeros; the blocks above hold anything)
    af[ks][0] = warp::pack2<T>(on ? b0 * A[m0 * kLdF + i0] : 0.f, on ? b0 * A[(m0 + 1) * kLdF + i0] : 0.f);
    af[ks][1] = warp::pack2<T>(on ? b1 * A[m0 * kLdF + i1] : 0.f, on ? b1 * A[(m0 + 1) * kLdF + i1] : 0.f);
    af[ks][2] = warp::pack2<T>(on ? b0 * A[(m0 + 8) * kLdF + i0] : 0.f, on ? b0 * A[(m0 + 9) * kLdF + i0] : 0.f);
    af[ks][3] = warp::pack2<T>(on ? b1 * A[(m0 + 8) * kLdF + i1] : 0.f, on ? b1 * A[(m0 + 9) * kLdF + i1] : 0.f);
  }
  {
    float wa[8][4];
    warp::zero_acc(wa);
    uint32_t pa[4][4];
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) warp::c_to_a<T>(pa[kb], qk[2 * kb], qk[2 * kb + 1]);
    auto& w32 = reinterpret_cast<float(&)[32]>(wa);
    fence();
    pin(w32);
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) wgmma_rs<64, T, 1>(w32, pa[kb], mn_desc(S.m, kb));
    commit();
    wait_all();
    pin(w32);
    if constexpr (!kSinkAfterBarrier<WSink>) w_sink(S, w, wa, lane);
    warp::bar_sync(bar_aux, kAuxThreads);  // every warp has read A (X's operand) and M (W): X is staged over A
    if constexpr (kSinkAfterBarrier<WSink>) w_sink(S, w, wa, lane);  // (over M)
  }
  if (ab_out) {  // (PrepBuffers::ab_only) X's operand instead of X, 128-byte swizzled in Q's first block
    const warp::LdsmOffsets ld(lane);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) warp::stsm_x4(tile16(S.q[0], 16 * w + ld.a_row, 16 * ks + ld.a_col), af[ks]);
    FLASHQLA_ROLE_PHASE(1, kAuxW);
    return;
  }
  x_products<T>(
      S.k, [&](float(&xa)[8][4], int ks, uint64_t b) { wgmma_rs<64, T, 1>(flat(xa), af[ks], b); },
      [&](int half, const float(&xa)[8][4]) { x_sink(S, w, half, xa, lane); });
  FLASHQLA_ROLE_PHASE(1, kAuxW);
}

// The forward's products: the inverse (aux_gram_inverse), then M, W and X into the stage; kW false (no o):
// K K^T, the inverse and X alone.
template <typename T, bool kW = true, typename StageT, typename Ax>
CUTLASS_DEVICE void aux_products(StageT& S, Ax& ax, int tid, uint32_t bar_aux, long long& t_mark) {
  float qk[8][4];
  if constexpr (kW) {
    aux_gram_inverse<T>(S, ax, tid, bar_aux, t_mark, qk);
  } else {
    float kk[8][4];
    aux_gram_raw<T, true, false>(S, tid, kk, qk);
    aux_gates_inverse<T>(ax, tid, bar_aux, t_mark, kk);
  }
  aux_mwx<T, false, kW>(S, ax, tid, bar_aux, t_mark, qk);
}

// One chunk's gates by warp 0 of a group: the chunk-local cumsum G of g, beta, gamma = e^G and decay = e^(G_C - G)
// (rows past the end: g = beta = 0); lane holds rows 2 lane, 2 lane + 1. G and beta are skipped when null.
template <typename T>
CUTLASS_DEVICE void compute_gates(const flashqla_gdn_fwd_params_t& p, const Work<T>& wk, int64_t c, int lane,
                                  float* G, float* beta, float* gamma, float* decay) {
  const int64_t g_off = wk.b * p.g_stride_batch + wk.h * p.g_stride_head;
  const int64_t beta_off = wk.b * p.beta_stride_batch + wk.h * p.beta_stride_head;
  const int64_t t0 = wk.t0 + c * kChunk;
  const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
  float gv[2], bv[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * lane + e;
    const int64_t t = t0 + r;
    gv[e] = r < rows ? load_scalar(p.g, p.g_dtype, g_off + t * p.g_stride_time) : 0.f;
    bv[e] = r < rows && beta != nullptr ? load_scalar(p.beta, p.beta_dtype, beta_off + t * p.beta_stride_time) : 0.f;
  }
  float incl = gv[0] + gv[1];
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float up = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += up;
  }
  const float Gc = __shfl_sync(0xffffffffu, incl, 31);  // padding has g = 0: the last real G
  const float G1 = incl, G0 = incl - gv[1];
  if (G != nullptr) {
    G[2 * lane] = G0;
    G[2 * lane + 1] = G1;
  }
  if (beta != nullptr) {
    beta[2 * lane] = bv[0];
    beta[2 * lane + 1] = bv[1];
  }
  gamma[2 * lane] = gate_exp(G0);
  gamma[2 * lane + 1] = gate_exp(G1);
  decay[2 * lane] = gate_exp(Gc - G0);
  decay[2 * lane + 1] = gate_exp(Gc - G1);
}
template <typename T, typename StageT, typename Ax>
CUTLASS_DEVICE void load_gates(const flashqla_gdn_fwd_params_t& p, StageT& S, Ax& ax, const Work<T>& wk,
                               int64_t c, int lane) {
  compute_gates(p, wk, c, lane, ax.G, ax.beta, S.gamma, S.decay);
}
// The loader-only chains' gates a chunk ahead (aux_role): warp 0 of a group computes the next chunk's gamma and
// decay right after handing a stage over, while the stage it will fill is still in use, and parks them in the
// group's G / beta scratch (which nothing reads in those modes); aux_chunk moves them into the stage once it is
// free. The g loads' latency (the gates' ~2k cycles a chunk in session 19's phase table) then passes under the
// wait for the stage, and nothing extra stays in the loaders' 96 registers across that wait.
template <typename T, typename Ax>
CUTLASS_DEVICE void park_gates(const flashqla_gdn_fwd_params_t& p, Ax& ax, const Work<T>& wk, int64_t c, int lane) {
  compute_gates(p, wk, c, lane, nullptr, nullptr, ax.G, ax.beta);
}
// Where the gates go ahead (session 19's A/B): the prep-beside-chain loaders, which also wait for the ready flags
// (35B / TP2 single sequences -4..-6.5%), and the backward's chains (hk4_hv8 32k -3.4%, 8k +1.3%, hk16_hv32 within
// 0.3%); the forward's other chains measured 5-10.5% slower with them (the TP1 and multi-sequence rows: there the
// gates already overlap the TMA transfer they follow), so there warp 0 computes them after the loads' issue.
template <AuxMode kMode, bool kReady>
constexpr bool kGatesAhead = kMode == AuxMode::kLoadBwd || (kMode == AuxMode::kLoadPrepared && kReady);
template <typename StageT, typename Ax>
CUTLASS_DEVICE void unpark_gates(StageT& S, const Ax& ax, int lane) {
  *reinterpret_cast<float2*>(&S.gamma[2 * lane]) = *reinterpret_cast<const float2*>(&ax.G[2 * lane]);
  *reinterpret_cast<float2*>(&S.decay[2 * lane]) = *reinterpret_cast<const float2*>(&ax.beta[2 * lane]);
}

// K and Q of the wgmma prep by TMA (defined with PrepStorageWg): wait for them, zero the rows past the chunk's end.
template <typename StageT>
CUTLASS_DEVICE void tma_qk_landed(StageT& S, int rows, int tid);

// One chunk's aux work on `S` by one 128-thread group: loads (K, Q, g, beta; V in the recurrent kernels; X and W
// when kLoadPrepared), the gates, l2norm, and with kFused or kPrepStates the products (aux_products). Ends before the
// group's closing sync (the callers do it). issued() runs once the tiles' copies are issued (before the gates).
// kReady (the prep beside the chain's loaders only, so the other kernels carry no branch for it): wait for the
// chunk's ready flag before copying X and W.
struct NoHook {
  CUTLASS_DEVICE void operator()() const {}
};
// use_qk_l2norm: one thread a row of the stage, 64 K rows then 64 Q rows (Q's threads idle when Q was not
// loaded), each row scaled to unit length in place (the kernels' l2norm: fp32 sum of squares, rsqrt, back to T).
template <typename T, typename StageT>
CUTLASS_DEVICE void l2norm_stage_rows(StageT& S, int tid, bool want_q) {
  using namespace warp;
  T* row = nullptr;
  if constexpr (!kSwizzledStage<StageT>) row = tid < kChunk ? &S.k[tid * kLdK] : &S.q[(tid - kChunk) * kLdK];
  const int r = tid < kChunk ? tid : tid - kChunk;
  const auto piece = [&](int j) -> T* {
    if constexpr (kSwizzledStage<StageT>)
      return tid < kChunk ? tile16(S.k, r, j) : tile16(S.q, r, j);
    else
      return row + j;
  };
  if (tid < kChunk || want_q) {
    float ss = 0.f;
#pragma unroll 4
    for (int j = 0; j < kDimK; j += 8) {
      const uint4 u = *reinterpret_cast<const uint4*>(piece(j));
      const uint32_t* pw = reinterpret_cast<const uint32_t*>(&u);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(pw[e]);
        ss += f.x * f.x + f.y * f.y;
      }
    }
    const float rn = rsqrtf(ss + kL2NormEps);
#pragma unroll 4
    for (int j = 0; j < kDimK; j += 8) {
      uint4 u = *reinterpret_cast<const uint4*>(piece(j));
      uint32_t* pw = reinterpret_cast<uint32_t*>(&u);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack2<T>(pw[e]);
        pw[e] = pack2<T>(f.x * rn, f.y * rn);
      }
      *reinterpret_cast<uint4*>(piece(j)) = u;
    }
  }
}

// PrepBuffers::ab_only (the paired chain's producer): X = (the prep's operand) K, as the prep's X product forms it
// (A: the operand's 16-bit values, here from shared memory, K-major; B: K's 64-column halves, MN-major; the same
// products in the same order), into the stage's x 128-byte swizzled, as the TMA box of X would have put it, by one
// warpgroup. op: the operand's tile, 64 x 64 swizzled. The caller has fenced and synchronised the tiles.
// (The O-beside chain's loaders forming X the same way, the operand in x[1], measured +15..17% on that chain in
// session 47: its loaders bind there.)
template <typename T, typename StageT>
CUTLASS_DEVICE void form_x(StageT& S, const T* op, int tid) {
  using namespace gmma;
  x_products<T>(
      S.k,
      [&](float(&xa)[8][4], int ks, uint64_t b) {
        wgmma_ss<64, T, 0, 1>(flat(xa), make_desc_sw128(reinterpret_cast<const char*>(op) + 32 * ks, 16, 1024), b);
      },
      [&](int half, const float(&xa)[8][4]) { store_c_swizzled(S.x[half], tid >> 5, xa, tid & 31); });
}

// kTmaQk (the wgmma prep kernel's; PrepStorageWg): K and Q arrive by TMA, issued by the caller on S.tma_bar.
// kTmaChain (the O-beside chain's TMA instantiation and the state recompute's, launched where the maps exist): K, Q,
// X, W and V by TMA on tma_bar (phase tma_parity; without o only K, X and V), issued by the group's warp 1 (lane 0):
// one instruction a 64 x 64 box, where 128 threads issued 3584 16-byte copies (the chain's state warps waited ~1k
// cycles a chunk for them: session 18's phase table).
// kNoO (with kTmaChain: the state recompute's): K, X and V only.
template <typename T, AuxMode kMode, int kBV = kBlockV, bool kReady = false, bool kTmaQk = false,
          bool kTmaChain = false, bool kNoO = false, typename StageT, typename Ax, typename Issued = NoHook>
CUTLASS_DEVICE void aux_chunk(const flashqla_gdn_fwd_params_t& p, StageT& S, Ax& ax, const Work<T>& wk,
                              int64_t c, int tid, uint32_t bar_aux, const PrepBuffers<T>& pb, long long& t_mark,
                              Issued issued = Issued{}, const tma::ChainMaps* cmaps = nullptr,
                              uint64_t* tma_bar = nullptr, uint32_t tma_parity = 0) {
  using namespace warp;
  (void)t_mark;
  (void)pb;
  const int w = tid >> 5, lane = tid & 31;
  const int64_t t0 = wk.t0 + c * kChunk;
  const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);

  // ---- loads: K, Q, V rows (zero past the end), g and beta (0 past the end). The prepared recurrent kernel
  // without o (summaries: the CP passes, the backward's states) reads Q only for Q S^T and O: not loaded
  const bool want_q = !(kMode == AuxMode::kLoadPrepared && wk.o == nullptr) && kMode != AuxMode::kPrepStates;
  static_assert(!kTmaQk || kMode == AuxMode::kInputsOnly, "TMA: the prep's K and Q");
  static_assert(!kTmaChain || (kMode == AuxMode::kLoadPrepared && kSwizzledStage<StageT>),
                "TMA: the O-beside chain's stage");
  constexpr bool tma_on = kTmaChain;  // (the copy loops below compile away: the cp.async form is main's code)
  if constexpr (kTmaChain) {
    // issued from warp 1, so that warp 0 starts the gates at once (thread 0 spent ~1.6k cycles a chunk issuing
    // before them: session 19's phase table). All eight boxes, V's too (the TMA form's stage holds it swizzled);
    // the O-beside chain's summaries (no o) without Q and W, and without V where v is NULL
    // (kNoO, the state recompute: K, X and V only, five boxes)
    if (tid == 32) {
      const int hq = static_cast<int>(wk.h / (p.heads_v / p.heads_qk)), t = static_cast<int>(t0);
      const int b = static_cast<int>(wk.b), h = static_cast<int>(wk.h);
      const int row0 = static_cast<int>(wk.flat0 + c * kChunk);
      // (the O-beside chain's summaries, the passes of exact parallelism: no Q or W without o, no V without v,
      // whose tile the group zeroes instead; the prep beside the chain always has both)
      const bool with_o = !kNoO && (kReady || wk.o != nullptr), with_v = kNoO || kReady || wk.v != nullptr;
      // (gates_from_prep, the O-beside chain on the prep kernel's output: gamma and decay as 512 bytes more; the
      // prep wrote chunk_bound's chunks: malformed cu_seqlens can name more, whose gates warp 0 computes)
      const bool gates = with_o && !kReady && pb.gates != nullptr && wk.chunk0 + c < chunk_bound(p);
      tma::mbar_expect_tx(tma_bar, static_cast<uint32_t>((4 + (with_o ? 3 : 0) + (with_v ? 1 : 0)) * kChunk * 64 * sizeof(T) +
                                                         (gates ? 2 * kChunk * sizeof(float) : 0)));
      if (gates) {
        static_assert(offsetof(StageT, decay) == offsetof(StageT, gamma) + kChunk * sizeof(float), "gamma, decay");
        tma::load_bulk(S.gamma, pb.gates + ((wk.chunk0 + c) * p.heads_v + wk.h) * 2 * kChunk,
                       2 * kChunk * sizeof(float), tma_bar);
      }
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        tma::load_box(S.k[blk], &cmaps->k, tma_bar, 64 * blk, hq, t, b);
        if (with_o) tma::load_box(S.q[blk], &cmaps->q, tma_bar, 64 * blk, hq, t, b);
      }
      if (with_v) tma::load_box(S.v, &cmaps->v, tma_bar, static_cast<int>(wk.col0), h, t, b);
      if constexpr (kReady) {  // prep beside the chain: X and W once the workers' flag says they are written
        take_ready_chunk(pb, wk.chunk0 + c, p.heads_v, wk.h);
        // (the workers wrote them through the generic proxy; the TMA reads through the async one)
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
      }
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) tma::load_box3(S.x[blk], &cmaps->x, tma_bar, 64 * blk, h, row0);
      if (with_o) tma::load_box3(S.w, &cmaps->w, tma_bar, 0, h, row0);
    }
  }
  for (int i = tid; i < kChunk * kDimK / 8 && !kTmaQk && !tma_on; i += kAuxThreads) {
    const int r = i >> 4, c8 = (i & 15) * 8;
    const bool ok = r < rows;
    cp_async_16(tile16(S.k, r, c8), ok ? wk.k + (t0 - wk.t0 + r) * p.k_stride_time + c8 : wk.k, ok);
    if (want_q) cp_async_16(tile16(S.q, r, c8), ok ? wk.q + (t0 - wk.t0 + r) * p.q_stride_time + c8 : wk.q, ok);
  }
  if constexpr (kMode == AuxMode::kFused || kMode == AuxMode::kLoadPrepared || kMode == AuxMode::kLoadBwd) {
    for (int i = tid; i < kChunk * kBV / 8 && !tma_on; i += kAuxThreads) {  // (kBV: the CTA's V columns)
      const int r = i / (kBV / 8), c8 = (i % (kBV / 8)) * 8;
      const bool ok = r < rows && wk.v != nullptr;  // else zero-filled, no read
      cp_async_16(&S.v[r * kLdC + c8], ok ? wk.v + (t0 - wk.t0 + r) * p.v_stride_time + c8 : wk.k, ok);
    }
  }
  if constexpr (kMode == AuxMode::kLoadPrepared || kMode == AuxMode::kLoadBwd) {
    // from the prep kernel: X (forward) or W' (backward), 128 wide, into x; W (forward, 64 wide) or this CTA's
    // 64 columns of U (backward, rows 128 wide) into w
    const int64_t row0 = wk.flat0 + c * kChunk;
    if constexpr (kReady && !kTmaChain) {  // prep beside the chain: X, W may be on the way (TMA: waited above)
      if (tid == 0) take_ready_chunk(pb, wk.chunk0 + c, p.heads_v, wk.h);
      bar_sync(bar_aux, kAuxThreads);
    }
    const T* xs = pb.x + row0 * p.heads_v * kDimK + wk.h * kDimK;
    constexpr int64_t kWRow = kMode == AuxMode::kLoadBwd ? kDimV : kChunk;
    const T* ws = pb.w + row0 * p.heads_v * kWRow + wk.h * kWRow + (kMode == AuxMode::kLoadBwd ? wk.col0 : 0);
    for (int i = tid; i < kChunk * kDimK / 8 && !tma_on; i += kAuxThreads) {
      const int r = i >> 4, c8 = (i & 15) * 8;
      const bool ok = r < rows;
      cp_async_16(tile16(S.x, r, c8), ok ? xs + int64_t(r) * p.heads_v * kDimK + c8 : xs, ok);
    }
    constexpr int kWCols = kMode == AuxMode::kLoadBwd ? kBV : kChunk;  // U: this CTA's columns only
    for (int i = tid; i < kChunk * kWCols / 8 && (kMode == AuxMode::kLoadBwd || wk.o != nullptr) && !tma_on;
         i += kAuxThreads) {
      const int r = i / (kWCols / 8), c8 = (i % (kWCols / 8)) * 8;
      // (the backward with dO = 0, NULL: U = scale P^T dO is 0 too, zero-filled, whatever dO the prep had)
      const bool ok = r < rows && (kMode != AuxMode::kLoadBwd || wk.v != nullptr);
      cp_async_16(tile16(S.w, r, c8), ok ? ws + int64_t(r) * p.heads_v * kWRow + c8 : ws, ok);
    }
  }
  issued();
  // (the loader-only modes time the copies' issue and the gates apart, in slots their products never use)
  constexpr bool kLoaderOnly = kMode == AuxMode::kLoadPrepared || kMode == AuxMode::kLoadBwd;
  if constexpr (kLoaderOnly) FLASHQLA_ROLE_PHASE(1, kAuxGram);
  constexpr bool kAhead = kGatesAhead<kMode, kReady>;
  // (gates_from_prep: they come with the TMA above)
  const bool gates_copied = kTmaChain && !kNoO && !kReady && pb.gates != nullptr && wk.chunk0 + c < chunk_bound(p);
  if (w == 0 && !gates_copied) {
    if constexpr (kAhead)
      unpark_gates(S, ax, lane);  // (aux_role parked them)
    else
      load_gates<T>(p, S, ax, wk, c, lane);
  }
  if constexpr (kLoaderOnly) FLASHQLA_ROLE_PHASE(1, kAuxInvDiag);
  cp_async_wait_all();
  if constexpr (kTmaQk) tma_qk_landed(S, rows, tid);
  if constexpr (kTmaChain) {
    {
      tma::mbar_wait(tma_bar, tma_parity);
      // rows past the chunk's end: zeros, as cp.async's zero fill (TMA brings the next packed sequence's tokens
      // and X / W rows the prep never wrote); K, Q, X (two blocks each), W and V, 128 bytes a row (a row's 16-byte
      // pieces all zero, so the swizzle does not matter)
      for (int i = tid; i < (kChunk - rows) * 8 * 8; i += kAuxThreads) {
        const int r = rows + i / 64, blk = (i / 8) % 8, piece = i & 7;
        char* tile = reinterpret_cast<char*>(blk < 2   ? S.k[blk]
                                             : blk < 4 ? S.q[blk - 2]
                                             : blk < 6 ? S.x[blk - 4]
                                             : blk < 7 ? S.w
                                                       : S.v);
        *reinterpret_cast<uint4*>(tile + r * 128 + 16 * piece) = make_uint4(0u, 0u, 0u, 0u);
      }
      if (!kNoO && !kReady && wk.v == nullptr)  // (the transition pass: V = 0, no box loaded; 64 rows of 128 bytes)
        for (int i = tid; i < kChunk * 8; i += kAuxThreads)
          *reinterpret_cast<uint4*>(reinterpret_cast<char*>(S.v) + 16 * i) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  bar_sync(bar_aux, kAuxThreads);
  FLASHQLA_ROLE_PHASE(1, kAuxLoad);

#if FLASHQLA_V2_EXPERIMENT != 1
  if (p.use_qk_l2norm) {
    l2norm_stage_rows<T>(S, tid, want_q);
    bar_sync(bar_aux, kAuxThreads);
  }
  FLASHQLA_ROLE_PHASE(1, kAuxL2norm);
  if constexpr (kMode == AuxMode::kFused) aux_products<T>(S, ax, tid, bar_aux, t_mark);
  if constexpr (kMode == AuxMode::kPrepStates) aux_products<T, false>(S, ax, tid, bar_aux, t_mark);
#endif
}

// kOb: the O-beside kernel's pipeline (three stages, its barrier ids; see ob::Barrier).
// kTmaChain (kLoadPrepared; with kOb, or the state recompute's wgmma chain): the stages' K, Q, X, W and V by TMA on
// cmaps' maps (aux_chunk; with kReady, X and W after the chunk's ready flag).
// kStop (the merging runs: gdn_bwd_dh's kMerge, state_role's kMerge): after each wait for an empty stage the group
// reads *stop and ends its walk where the state warps set it (they release every stage a group may wait for when
// they stop; the group's copies are all landed by then: aux_chunk waits for them before the hand-over).
template <typename T, AuxMode kMode, int kBV = kBlockV, bool kOb = false, bool kReady = false,
          bool kTmaChain = false, bool kStop = false, typename Storage>
CUTLASS_DEVICE void aux_role(const flashqla_gdn_fwd_params_t& p, Storage& sm, const Work<T>& wk, int group,
                             const PrepBuffers<T>& pb, const tma::ChainMaps* cmaps = nullptr,
                             const volatile int* stop = nullptr) {
  using namespace warp;
  const int tid = threadIdx.x % kAuxThreads;
  auto& ax = sm.aux[group];
  const uint32_t bar_aux = (kOb ? ob::kAux : kBarAux) + group;
  long long t_mark = 0;
#ifdef FLASHQLA_PHASE_TIMERS
  t_mark = clock64();
#endif

  constexpr bool kAhead = kGatesAhead<kMode, kReady>;
  const auto chunk_of = [&](int64_t it) { return kMode == AuxMode::kLoadBwd ? wk.num_chunks - 1 - it : it; };
  if (kAhead && tid < 32 && group < wk.num_chunks) park_gates(p, ax, wk, chunk_of(group), tid);
  for (int64_t it = group; it < wk.num_chunks; it += kAuxGroups) {
    const int64_t c = chunk_of(it);  // the backward runs in reverse
    const int st = kOb ? static_cast<int>(it % kObStages) : group;
    auto& S = sm.stage[st];
    if constexpr (kOb) {
      // (non-aligned: a summaries pass's O warps sync here too, from o_role)
      if (it >= kObStages) {
        bar_sync_sites(ob::kEmpty + (it - kObStages) % 6, ob::kEmptyThreads);
        if constexpr (kStop) {
          if (*stop != 0) break;
        }
      }
    } else {
      if (it >= kStages) {
        bar_sync(kBarEmpty + st, kHandoffThreads);
        if constexpr (kStop) {
          if (*stop != 0) break;
        }
      }
    }
    FLASHQLA_ROLE_PHASE(1, kAuxWaitEmpty);
    if constexpr (kTmaChain)  // (stage st's barrier completes once a fill: its (it / stages)-th phase)
      aux_chunk<T, kMode, kBV, kReady, false, true, !kOb>(p, S, ax, wk, c, tid, bar_aux, pb, t_mark, NoHook{}, cmaps,
                                                    &sm.tma_bar[st],
                                                    static_cast<uint32_t>((it / (kOb ? kObStages : kStages)) & 1));
    else
      aux_chunk<T, kMode, kBV, kReady>(p, S, ax, wk, c, tid, bar_aux, pb, t_mark);
    // the wgmma chain reads the tiles through the async proxy: this thread's copies and l2norm stores first
    if constexpr (kSwizzledStage<std::remove_reference_t<decltype(S)>>) fence_async_smem();
    // bar.arrive orders this thread's stores before the state warps' bar.sync (PTX), but
    // compute-sanitizer's racecheck does not model that and flags W and X; one group-wide sync
    // first (the group's warps finish within a few cycles of each other) keeps racecheck usable.
    bar_sync(bar_aux, kAuxThreads);
    bar_arrive((kOb ? ob::kFull : kBarFull) + st, kHandoffThreads);
    if (kAhead && tid < 32 && it + kAuxGroups < wk.num_chunks) park_gates(p, ax, wk, chunk_of(it + kAuxGroups), tid);
  }
}

// The state warps' walk over a chunk tile stored [kChunk][kLdC] or 128-byte swizzled (V, or the backward's dO and
// U: chunk rows, this CTA's 64 columns) as transposed A fragments of warp s's 16 columns: f(kb, r, nt, e, col, pair) for
// k block kb and register r, which holds elements e, e + 1 of C tile nt = 2 kb + r / 2, i.e. chunk columns
// col, col + 1.
template <typename T, typename Tile, typename F>
CUTLASS_DEVICE void for_vt_pairs(const Tile& tile, int s, int tq, const warp::LdsmOffsets& ld, F&& f) {
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    uint32_t vr[4];
    warp::ldsm_x4_trans(vr, tile16<T>(tile, 16 * kb + ld.at_row, 16 * s + ld.at_col));
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int nt = 2 * kb + (r >> 1);
      f(kb, r, nt, 2 * (r & 1), 8 * nt + 2 * tq, warp::unpack2<T>(vr[r]));
    }
  }
}

// ---- The chain with K split over warp pairs (split mode, few sequences x value heads)
// One CTA per (sequence, value head, 32-column V block): state warp s owns V rows 16 (s / 2) .. + 15 of the
// block's S^T and K columns 64 (s % 2) .. + 63 (32 fp32 per thread instead of 64). Per chunk each warp forms its
// K half's share of KS^T and QS^T (half the products), the pair adds the two shares through shared memory (the
// loader groups' product scratch, unused in split mode), each then updates its own K half of S^T (half the
// products again) and forms O for half of the chunk's columns: ~150 mma per warp a chunk instead of ~290. At
// these sizes the extra CTAs find idle SMs. Measured (NOTES, session 10): the step -7% (TP8-like), the dS chain's
// -11%, not the -30% the products predicted: the step is bound more by the shared-memory operand reads (every
// warp reads whole K, Q and X tiles as B fragments) than by the tensor pipe.
constexpr int kBlockVK = 32;  // V columns per CTA of the K-split chain
constexpr int kVBlocksK = kDimV / kBlockVK;
constexpr int kKHalf = kDimK / 2;
static_assert(kStateWarps == 2 * (kBlockVK / 16), "two K halves per 16 V rows");
// The pair's exchange of shares (8 C tiles a slot, fragment by fragment as lane-major float4s: 512 contiguous
// bytes a store) through the product scratch of loader group vg: warp kh puts its shares in its half, the pair
// meets at kBarPair + vg, and each adds the partner's. A + b is the same float either way round, so both warps
// hold the same sums. The partner's reads of a chunk end before the next chunk's full barrier, which both pass
// before putting again.
struct PairShares {
  static constexpr int kSlots = 2;  // KS^T and QS^T (the dS chain: KdS^T alone)
  float4* mine;
  const float4* theirs;
  CUTLASS_DEVICE PairShares(float* la, int kh)
      : mine(reinterpret_cast<float4*>(la) + kh * (kSlots * 8 * 32)),
        theirs(reinterpret_cast<const float4*>(la) + (kh ^ 1) * (kSlots * 8 * 32)) {}
  CUTLASS_DEVICE void put(const float (&acc)[8][4], int slot, int lane) const {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) mine[(8 * slot + nt) * 32 + lane] = make_float4(acc[nt][0], acc[nt][1], acc[nt][2], acc[nt][3]);
  }
  CUTLASS_DEVICE void add(float (&acc)[8][4], int slot, int lane) const {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float4 a = theirs[(8 * slot + nt) * 32 + lane];
      acc[nt][0] += a.x; acc[nt][1] += a.y; acc[nt][2] += a.z; acc[nt][3] += a.w;
    }
  }
};
static_assert(2 * PairShares::kSlots * 8 * 4 * 32 <= kChunk * kLdF, "a pair's shares fit in a loader group's la");

// ---- The chain's products as wgmma (split mode, 64-column CTAs; session 11: the step -4..-5% against
// mma.sync): the four state warps are one warpgroup whose registers hold S^T, and per warp the A fragment of
// wgmma m64nNk16 is the mma.sync A fragment of its 16 rows and the accumulator its N / 8 mma.sync C tiles
// (benchmarks/wgmma_chain_probe.cu). B comes from the swizzled stage (StageSw), read once for the warpgroup
// instead of once per warp. Each call waits for its products (the next step needs them).
// acc (64 rows x 64 chunk columns) += A B^T over K: 8 k16 steps, A = the state warps' registers (sa), B = a
// [tokens][K dim] tile K-major (K, Q). Issue only: the caller fences, commits and waits.
template <typename T>
CUTLASS_DEVICE void wg_issue_rows64(float (&acc)[8][4], const uint32_t (&sa)[8][4], const T (&tile)[2][kChunk * 64]) {
  auto& a32 = reinterpret_cast<float(&)[32]>(acc);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)  // k16 step kk: 32 bytes a step within its 64-column block
    gmma::wgmma_rs<64, T, 0>(a32, sa[kk],
                             gmma::make_desc_sw128(reinterpret_cast<const char*>(tile[kk >> 2]) + 32 * (kk & 3), 16, 1024));
}
// One such product, waited for: acc += S^T tile^T (the O-beside chain's KS^T, its O warps' QS^T).
template <typename T>
CUTLASS_DEVICE void wg_rows64(float (&acc)[8][4], const uint32_t (&sa)[8][4], const T (&tile)[2][kChunk * 64]) {
  auto& a32 = reinterpret_cast<float(&)[32]>(acc);
  gmma::fence();
  gmma::pin(a32);
  wg_issue_rows64<T>(acc, sa, tile);
  gmma::commit();
  gmma::wait_all();
  gmma::pin(a32);
}
// KS^T and QS^T = S^T K^T, S^T Q^T in one commit group.
template <typename T, typename StageT>
CUTLASS_DEVICE void wg_ks_qs(const StageT& S, const uint32_t (&sa)[8][4], float (&ks)[8][4], float (&os)[8][4],
                             bool want_o) {
  using namespace gmma;
  auto& k32 = reinterpret_cast<float(&)[32]>(ks);
  auto& o32 = reinterpret_cast<float(&)[32]>(os);
  fence();
  pin(k32);
  pin(o32);
  wg_issue_rows64<T>(ks, sa, S.k);
  if (want_o) wg_issue_rows64<T>(os, sa, S.q);
  commit();
  wait_all();
  pin(k32);
  pin(o32);
}
// O^T += Z^T W^T: 4 k16 steps over the chunk, B = W (K-major; its blocks above the diagonal hold zeros).
template <typename T, typename StageT>
CUTLASS_DEVICE void wg_o(const StageT& S, const uint32_t (&za)[4][4], float (&os)[8][4]) {
  using namespace gmma;
  auto& o32 = reinterpret_cast<float(&)[32]>(os);
  fence();
  pin(o32);
#pragma unroll
  for (int kb = 0; kb < 4; ++kb)
    wgmma_rs<64, T, 0>(o32, za[kb], make_desc_sw128(reinterpret_cast<const char*>(S.w) + 32 * kb, 16, 1024));
  commit();
  wait_all();
  pin(o32);
}
// sacc (64 rows x 128 K) += (hi + lo) B: 4 k16 steps over the chunk, B = a [tokens][K dim] tile MN-major
// (transpose-B; two 64-column blocks kChunk * 64 elements apart, a k16 step = two 1024-byte atoms): the
// forward's S^T += Y^T X, the dS chain's dO^T Q and Z^T W'.
// Issue only: the caller fences, commits and waits.
template <typename T>
CUTLASS_DEVICE void wg_issue_update(const T (&tile)[2][kChunk * 64], const uint32_t (&hi)[4][4],
                                    const uint32_t (&lo)[4][4], float (&sacc)[16][4]) {
  auto& s64 = reinterpret_cast<float(&)[64]>(sacc);
  constexpr int kBlockBytes = kChunk * 64 * sizeof(T);
#pragma unroll
  for (int kb = 0; kb < 4; ++kb) {
    const uint64_t d = gmma::make_desc_sw128(reinterpret_cast<const char*>(tile[0]) + 2048 * kb, kBlockBytes, 1024);
    gmma::wgmma_rs<128, T, 1>(s64, hi[kb], d);
    gmma::wgmma_rs<128, T, 1>(s64, lo[kb], d);
  }
}
template <typename T>
CUTLASS_DEVICE void wg_update(const T (&tile)[2][kChunk * 64], const uint32_t (&hi)[4][4], const uint32_t (&lo)[4][4],
                              float (&sacc)[16][4]) {
  using namespace gmma;
  auto& s64 = reinterpret_cast<float(&)[64]>(sacc);
  fence();
  pin(s64);
  wg_issue_update<T>(tile, hi, lo, sacc);
  commit();
  wait_all();
  pin(s64);
}

// The chains' hi + lo updates, sacc (this warp's S^T or dS^T columns, from K column kcol) += (hi + lo) B over
// the chunk with B a [tokens][K dim] stage tile: wgmma (swizzled, unsplit) or mma.sync (padded).
template <typename T, bool kWg, int kNT, typename Tile>
CUTLASS_DEVICE void update_hi_lo(const Tile& tile, int kcol, const warp::LdsmOffsets& ld, const uint32_t (&hi)[4][4],
                                 const uint32_t (&lo)[4][4], float (&sacc)[kNT][4]) {
  if constexpr (kWg) {
    wg_update<T>(tile, hi, lo, sacc);
  } else {
    warp::for_b_fragments<4, kNT / 2, true>(tile + kcol, kLdK, ld, [&](int kb, int np, const uint32_t (&b)[4]) {
      warp::mma_pair<T>(sacc, np, hi[kb], b);
      warp::mma_pair<T>(sacc, np, lo[kb], b);
    });
  }
}

// One warp's O rows staged: its O^T C tiles (V rows gq, gq + 8 of the warp's 16; tokens 8 nt + 2 tq, + 1), times
// scale, transposed by stmatrix into stg (2 KB of the warp's own: [token][16 V] rows of 32 bytes, the two 16-byte
// halves swapped on tokens 4..7 mod 8 so that an stmatrix's 8 rows hit distinct banks: the 32-byte swizzle, which
// encode_o's TMA store reads). Warp-local: stg must be free of the warp's earlier reads.
template <typename T>
CUTLASS_DEVICE T* o_piece(T* stg, int tok, int half) {
  return stg + tok * 16 + 8 * (half ^ ((tok >> 2) & 1));
}
template <typename T>
CUTLASS_DEVICE void warp_stage_o(T* stg, const float (&os)[8][4], float scale, int lane) {
  using namespace warp;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t r[4] = {pack2<T>(scale * os[2 * j][0], scale * os[2 * j][1]),
                           pack2<T>(scale * os[2 * j][2], scale * os[2 * j][3]),
                           pack2<T>(scale * os[2 * j + 1][0], scale * os[2 * j + 1][1]),
                           pack2<T>(scale * os[2 * j + 1][2], scale * os[2 * j + 1][3])};
    const int m = lane >> 3;  // matrix m: tokens 8 (2 j + m / 2) .., V half m % 2
    stsm_x4_trans(o_piece(stg, 8 * (2 * j + (m >> 1)) + (lane & 7), m & 1), r);
  }
}
// ... then the first `rows` tokens as 16-byte pieces to o (the warp's first V column of the chunk's first token).
template <typename T>
CUTLASS_DEVICE void warp_store_o(T* stg, const float (&os)[8][4], float scale, T* o, int64_t stride, int rows,
                                 int lane) {
  warp_stage_o(stg, os, scale, lane);
  __syncwarp();
#pragma unroll
  for (int it = 0; it < 4; ++it) {
    const int i = lane + 32 * it, tok = i >> 1, half = i & 1;
    if (tok < rows)
      *reinterpret_cast<uint4*>(o + tok * stride + 8 * half) = *reinterpret_cast<const uint4*>(o_piece(stg, tok, half));
  }
}
// ... or all 64 tokens as one TMA store (encode_o's box at V column col, head, token t, batch b) issued by lane 0,
// in its bulk group: stg stays in use until lane 0's bulk_wait_read (warp_o_stage_free).
template <typename T>
CUTLASS_DEVICE void warp_store_o_tma(T* stg, const float (&os)[8][4], float scale, const CUtensorMap* map, int col,
                                     int head, int t, int b, int lane) {
  warp_stage_o(stg, os, scale, lane);
  warp::fence_async_smem();  // (each lane's stmatrix writes, before the async proxy reads them)
  __syncwarp();
  if (lane == 0) {
    tma::store_box4(map, stg, col, head, t, b);
    warp::bulk_commit();
  }
}
// Before a warp rewrites its staging piece: lane 0's TMA store of it (two chunks back; the newest, of the other
// piece, may still be reading) has read it.
CUTLASS_DEVICE void warp_o_stage_free(int lane) {
  if (lane == 0) warp::bulk_wait_read<1>();
  __syncwarp();
}

// ---- Merging walks: exact parallelism's passes that repeat another run's walk over the same chunks from another
// start (the backward's last dS pass against its B pass, gdn_bwd_dh.cuh; the backward's states pass against the
// summaries' B half, state_role's kMerge). Where the two runs' fp32 states agree bit for bit at a step, every later
// step repeats the other run's instructions on the same operands, so the later run may stop there and take the rest
// of the walk from the other.
// The checkpoints: steps 0 (equal from the start: a last segment without dht, a first one without h0), 4, 8, 12, 16,
// then 24, 32, 48, 64, 96, ... (powers of two and 1.5 times them). A comparison reads the CTA's state tile of the
// other run (32 or 64 KB) and waits for it, about a step's time; the anchors' gates merge at step ~10-11
// (benchmarks/merge_steps.py), so a walk stops at 12 after 4 comparisons, and where none merges it makes
// ~2 log2(chunks).
CUTLASS_DEVICE bool merge_checkpoint(int64_t it) {
  if (it == 0) return true;
  if (it % 4 != 0) return false;
  const int64_t q = it / 4, third = q % 3 == 0 ? q / 3 : 0;
  return q <= 4 || (q & (q - 1)) == 0 || (third > 0 && (third & (third - 1)) == 0);
}
// The gate test of a merging pair: a walk may merge only where the gates of its first half (in walk order: the
// segment's first ceil(chunks / 2) chunks going forward, its last going in reverse) sum to at most kMergeLogDecay.
// benchmarks/merge_steps.py puts the dS merge where the walk's summed log-decay reaches about -35 (3.2 a chunk) to
// -49 (1.3 a chunk), and a merge pays (the source run's stores, ~0.4 of a step each, against the steps saved) only
// in the first half; walks that fail it (a g = 0 head, slow decay, short segments) neither store in the source run
// nor compare in the merging run. Both runs sum the same values in the same order, so they agree. scratch:
// kStateWarps floats of shared memory; bar: the state warps' barrier.
constexpr float kMergeLogDecay = -50.f;
template <bool kReverse, typename T>
CUTLASS_DEVICE bool walk_may_merge(const flashqla_gdn_fwd_params_t& p, const Work<T>& wk, float* scratch, uint32_t bar,
                                   int tid) {
  // the half's tokens [first, end)
  const int64_t first = kReverse ? (wk.num_chunks - (wk.num_chunks + 1) / 2) * kChunk : 0;
  const int64_t end = kReverse || (wk.num_chunks + 1) / 2 * kChunk > wk.len ? wk.len : (wk.num_chunks + 1) / 2 * kChunk;
  const int64_t g_off = wk.b * p.g_stride_batch + wk.h * p.g_stride_head;
  float sum = 0.f;
  for (int64_t t = first + tid; t < end; t += kStateThreads)
    sum += load_scalar(p.g, p.g_dtype, g_off + (wk.t0 + t) * p.g_stride_time);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);  // (every lane the same bits)
  if ((tid & 31) == 0) scratch[tid >> 5] = sum;
  warp::bar_sync(bar, kStateThreads);
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kStateWarps; ++w) total += scratch[w];
  return total <= kMergeLogDecay;
}
// Whether this thread's fragments of the state tile equal src's (as load_state_tile reads it), bit for bit.
template <int NT>
CUTLASS_DEVICE bool state_tile_equals(const float (&acc)[NT][4], const float* src, int tq, int v0) {
  bool eq = true;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      eq &= __float_as_uint(acc[j][e]) ==
            __float_as_uint(src[int64_t(8 * j + 2 * tq + (e & 1)) * kDimV + v0 + 8 * (e >> 1)]);  // (not .nc: written
                                                                                                   // by this launch's
                                                                                                   // kind of kernel)
  return eq;
}
// The releases after a merging walk's stop before step it of n: each stage the loader groups may still wait for,
// once, as the walk would have released it after chunks it .. it + stages - 1 (each group's next wait returns and it
// reads the stop). kOb: the O-beside kernel's slots (a chunk's slot, chunk % 6, was last waited for by the loader of
// chunk it + d - 3 < it: the new arrivals start a fresh phase); the state warps and the O warps each arrive there.
template <bool kOb>
CUTLASS_DEVICE void release_after_stop(int64_t it, int64_t n) {
  constexpr int kSt = kOb ? kObStages : kStages, kSlots = kOb ? 6 : kStages;
  constexpr uint32_t kEmpty = kOb ? static_cast<uint32_t>(ob::kEmpty) : static_cast<uint32_t>(kBarEmpty);
#pragma unroll
  for (int d = 0; d < kSt; ++d)
    if (it + d + kSt < n)
      warp::bar_arrive(kEmpty + static_cast<uint32_t>((it + d) % kSlots), kOb ? ob::kEmptyThreads : kHandoffThreads);
}
// A merging walk's stop before step it of n (the chains whose loader groups read sm.merge.stop: aux_role's kStop).
// Take the fills of the chunks the groups may still be loading (it .. it + stages - 1: their loads land before the
// CTA ends, and each group has then used up the state warps' earlier release of its stage: a second arrival on a
// stage barrier the group has not yet waited at would complete it without the group), set the stop, then release
// (release_after_stop). kOb (the O-beside form): the O warps, waiting for chunk it's S^T, are woken too; they read
// the stop, make the same releases and end (their last O was chunk it - 1's).
template <bool kOb = false, typename Storage>
CUTLASS_DEVICE void stop_walk(Storage& sm, int64_t it, int64_t n, int tid) {
  constexpr int kSt = kOb ? kObStages : kStages;
  constexpr uint32_t kFull = kOb ? static_cast<uint32_t>(ob::kFull) : static_cast<uint32_t>(kBarFull);
#pragma unroll
  for (int d = 0; d < kSt; ++d)
    if (it + d < n) warp::bar_sync(kFull + static_cast<uint32_t>((it + d) % kSt), kHandoffThreads);
  if (tid == 0) sm.merge.stop = 1;
  if constexpr (kOb) warp::bar_arrive(kEarlyQs<Storage> ? ob::kPubS : ob::kPub, ob::kPubThreads);
  release_after_stop<kOb>(it, n);
}

// The forward chain's merges (kMerge; flashqla_gdn_fwd_cp_summaries_merge_source and flashqla_gdn_fwd_merge): fp32
// states at the first kStateMergeCheckpoints checkpoint steps of each walk, [checkpoint, segment, heads_v, K, V] (a
// merge past step 48 would save little of a segment).
constexpr int kStateMergeCheckpoints = 8;
// The summaries pair's B half stores its chunk states by TMA through two 16-bit boxes laid over the O tiles (the
// backward's states merge: no O then; 1024-byte aligned: the stages before them are).
template <typename T>
CUTLASS_DEVICE T* pair_state_box(SharedStoragePair<T>& sm, int i) {
  static_assert(sizeof(SharedStoragePair<T>::o) >= 2 * kDimK * 64 * sizeof(T) &&
                    offsetof(SharedStoragePair<T>, o) % 1024 == 0,
                "two state boxes over the O tiles");
  return reinterpret_cast<T*>(&sm.o[0][0][0]) + i * (kDimK * 64);
}

// The state warps' chain. kKSplit false: warp s owns V rows 16 s .. 16 s + 15 of the CTA's 64 columns and all
// 128 K columns of S^T. kKSplit true (above): V rows 16 (s / 2) .. of 32 columns and one K half. kWg: the
// products as wgmma on the swizzled stage (unsplit only). kOb (with kWg): O beside the chain: the state warps
// publish S^T and Z^T for the O warps (o_role) and form no O themselves.
// kStatesByTma<Storage> (the state recompute, SharedStorageSwSt): the chunk states by TMA on cmaps->states.
// kPairStorage<Storage> (the paired chain, with kWg): warpgroup `half` of the two, its V half's columns of the
// shared stage (V block half), its own O tiles and barrier, the producer's handoff.
// kMerge (the states merge; merge_ckpt, kStateMergeCheckpoints tiles): in a walk that may merge (walk_may_merge,
// forward), the summaries pair's B half (kPair, the source run) stores every chunk state by TMA on cmaps->states
// and its fp32 state at each checkpoint step into merge_ckpt; the state recompute (kStatesByTma, the merging run,
// after the source) compares its state there with the checkpoint and, once every thread's are equal, stops (the
// loaders through sm.merge.stop): the rest of the walk's chunk states are already the source's, the same bits.
template <typename T, bool kKSplit, bool kWg = false, bool kOb = false, bool kMerge = false, bool kSplitX = false,
          typename Storage>
CUTLASS_DEVICE void state_role(const flashqla_gdn_fwd_params_t& p, Storage& sm, const Work<T>& wk,
                               const tma::ChainMaps* cmaps = nullptr, int half = 0, float* merge_ckpt = nullptr,
                               const float* merge_final = nullptr) {
  static_assert(!(kWg && kKSplit), "the wgmma chain is unsplit");
  static_assert(!kOb || kWg, "O beside the wgmma chain");
  constexpr bool kPair = kPairStorage<Storage>;
  static_assert(!kPair || (kWg && !kOb), "the paired chain: two wgmma chains with O");
  static_assert(!kMerge || kWg, "the merges: the wgmma chains (the pair, the recompute, the last pass)");
  static_assert(!(kMerge && kOb) || kEarlyQs<Storage>, "the O-beside merge: the TMA form");
  static_assert(!kSplitX || kPair, "X's own handoff: the paired chain's kAb producer");
  using namespace warp;
  constexpr int kNT = kKSplit ? kDimK / 16 : kDimK / 8;  // C tiles of S^T per warp (8 K columns each)
  constexpr int kKS = kNT / 2;                            // k16 steps over this warp's K columns
  constexpr int kOShift = kKSplit ? 2 : 3;                // log2 of the 16-byte pieces in an O tile row
  constexpr uint32_t kFullBar = kOb ? ob::kFull : kBarFull;  // (the paired chain: one a half, pr::kFull)
  constexpr uint32_t kEmptyBar = kPair ? pr::kEmpty : kBarEmpty;
  constexpr int kHandoff = kPair ? pr::kHandoffThreads : kHandoffThreads;
  const uint32_t state_bar = kPair ? pr::kState + half : kBarState;
  const int tid = threadIdx.x - (kPair ? kStateThreads * half : 0), s = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;
  const int vg = kKSplit ? s >> 1 : s, kh = kKSplit ? s & 1 : 0;
  const int kcol = kKHalf * kh;  // this warp's first K column
  const LdsmOffsets ld(lane);
  const int v0 = 16 * vg + gq;  // this thread's V columns (within the CTA block): v0 and v0 + 8
  FLASHQLA_ROLE_TIMER;

  float sacc[kNT][4];  // S^T (this warp's K columns)
  load_state_tile(sacc, p.initial_state != nullptr ? p.initial_state + wk.state_off + int64_t(kcol) * kDimV : nullptr,
                  tq, v0);
  // else the chain alone: no Q S^T, no intra-chunk O, no O store (warp-uniform for ptxas in the wgmma chain)
  // (kOb: the O warps form O from the published S^T and Z^T; without o, the passes of exact parallelism, nothing
  // is published and the O warps only keep the stage barriers; the host launches it without chunk states)
  bool merge_walk = false, merged = false;
  int ck = 0;  // (the checkpoints passed)
  // (the state warps' barrier: the O-beside kernel numbers its barriers otherwise)
  const uint32_t merge_bar = kOb ? static_cast<uint32_t>(ob::kState) : state_bar;
  (void)merge_bar;
  if constexpr (kMerge) {
    if constexpr (!kPair) {
      if (tid == 0) sm.merge.stop = 0;  // (read by the loaders only after a stage release, which follows this store)
    }
    // (uniform: every thread reads the same sums; the O-beside form only with o, whose O warps take the stop)
    merge_walk = merge_ckpt != nullptr && (!kOb || wk.o != nullptr) &&
                 walk_may_merge<false>(p, wk, sm.merge.sum, merge_bar, tid);
  }
  const bool has_o = uniform<kWg>(wk.o != nullptr);
  // (the merge's source, the pair's B half with o: O only in the walks that may merge, for the merging pass)
  const bool want_o = !kOb && has_o && (!(kPair && kMerge) || merge_walk), ob_pub = kOb && has_o;
  float* pair_scratch = nullptr;  // (the K split)
  if constexpr (kKSplit) pair_scratch = sm.aux[vg].la;
  const PairShares pair(pair_scratch, kh);
  // the O products and rows of this warp: all (unsplit), n pairs {0, 3} (kh 0) or {1, 2} (kh 1) of the chunk's
  // columns (K-split: five products each, W being lower triangular)
  const auto own_np = [&](int np) { return !kKSplit || (np == 1 || np == 2) == (kh == 1); };

  constexpr int kSt = kOb ? kObStages : kStages;
  for (int64_t c = 0; c < wk.num_chunks; ++c) {
    const int st = static_cast<int>(c % kSt);
    const auto& S = sm.stage[st];
    const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
    if constexpr (kMerge) {  // S_c, the state at the chunk's start, against (or into) the checkpoint
      if (merge_walk && ck < kStateMergeCheckpoints && merge_checkpoint(c)) {
        float* const ckp = merge_ckpt + int64_t(ck) * p.num_seqs * p.heads_v * kDimK * kDimV + wk.state_off;
        ++ck;
        if constexpr (kPair) {
          store_state_tile(ckp, sacc, tq, v0);
        } else if (bar_red_and(merge_bar, kStateThreads, state_tile_equals(sacc, ckp, tq, v0))) {
          merged = true;
          stop_walk<kOb>(sm, c, wk.num_chunks, tid);
          break;
        }
      }
    }
    if constexpr (kPair)
      bar_sync(pr::kFull + 2 * st + half, pr::kFullThreads);
    else
      bar_sync(kFullBar + st, kHandoffThreads);
    FLASHQLA_ROLE_PHASE(0, kStWaitFull);

#if FLASHQLA_V2_EXPERIMENT != 2
    // S^T as the A operand (k = K dimension), rounded once per chunk
    uint32_t sa[kKS][4];
#pragma unroll
    for (int kk = 0; kk < kKS; ++kk) c_to_a<T>(sa[kk], sacc[2 * kk], sacc[2 * kk + 1]);
    if constexpr (kOb) {  // publish S^T for the O warps (once they have read the previous chunk's)
      if (ob_pub) {
        if (c > 0) bar_sync(ob::kFree, ob::kPubThreads);
#pragma unroll
        for (int kk = 0; kk < kKS; ++kk) stsm_x4(tile16(sm.pub_s, 16 * s + ld.a_row, 16 * kk + ld.a_col), sa[kk]);
        if constexpr (kEarlyQs<Storage>) {
          // the O warps may start Q S^T now, beside this chunk's K S^T and epilogue (racecheck: sync first, as
          // below)
          bar_sync(ob::kState, kStateThreads);
          bar_arrive(ob::kPubS, ob::kPubThreads);
        }
      }
    }
    if constexpr (kStatesByTma<Storage>) {  // (launched only with chunk states and without o)
      if (uniform<true>(wk.chunk0 + c < chunk_bound(p)))
        store_state_by_tma(&cmaps->states, sm.st_box[c & 1], sa, (wk.chunk0 + c) * p.heads_v + wk.h,
                           static_cast<int>(wk.col0), kBarState, tid);
    } else if constexpr (kPair && kMerge) {  // (the states merge's source: the B half's chunk states)
      if (uniform<true>(merge_walk && p.chunk_states != nullptr && wk.chunk0 + c < chunk_bound(p)))
        store_state_by_tma(&cmaps->states, pair_state_box(sm, static_cast<int>(c & 1)), sa,
                           (wk.chunk0 + c) * p.heads_v + wk.h, static_cast<int>(wk.col0), state_bar, tid);
    } else if constexpr (!kOb && !kPair) {  // (the paired chain runs without chunk states)
      if (p.chunk_states != nullptr && wk.chunk0 + c < chunk_bound(p)) {  // the state at the chunk's start, in T
        // staged in the O buffer chunk c does not use (chunk c - 1's tile went out before this chunk's full barrier)
        T* const dst = static_cast<T*>(p.chunk_states) + ((wk.chunk0 + c) * p.heads_v + wk.h) * int64_t(kDimK) * kDimV +
                       int64_t(kcol) * kDimV + wk.col0 + 16 * vg;
        if constexpr (kKSplit)
          store_state_rows64(dst, sa, sm.o[(c + 1) & 1] + s * 64 * 16, lane);
        else
          store_state_tile(dst, sa, sm.o[(c + 1) & 1] + s * 64 * 16, lane);
      }
    }
    FLASHQLA_ROLE_PHASE(0, kStPub);
    // KS^T and QS^T (16 V rows x 64 chunk columns; K-split: this K half's shares)
    float ks[8][4], os[8][4];
    zero_acc(ks);
    zero_acc(os);
    if constexpr (kWg) {
      if constexpr (kOb)
        wg_rows64<T>(ks, sa, S.k);  // (QS^T: the O warps)
      else
        wg_ks_qs<T>(S, sa, ks, os, want_o);
    } else {
      for_b_fragments<kKS, 4, false>(S.k + kcol, kLdK, ld, [&](int kk, int np, const uint32_t (&b)[4]) {
        mma_pair<T>(ks, np, sa[kk], b);
      });
      if (want_o)
        for_b_fragments<kKS, 4, false>(S.q + kcol, kLdK, ld, [&](int kk, int np, const uint32_t (&b)[4]) {
          mma_pair<T>(os, np, sa[kk], b);
        });
    }
    if constexpr (kKSplit) {  // the pair adds its shares
      pair.put(ks, 0, lane);
      if (want_o) pair.put(os, 1, lane);
      bar_sync(kBarPair + vg, 64);
      pair.add(ks, 0, lane);
      if (want_o) pair.add(os, 1, lane);
    }
    FLASHQLA_ROLE_PHASE(0, kStKsQs);

    // Z^T = V^T - KS^T diag(gamma), Y^T = V^T diag(decay) - gamma_C KS^T, O^T = QS^T diag(gamma)
    const float gamma_c = S.gamma[kChunk - 1];
    uint32_t za[4][4], yh[4][4], yl[4][4];
    for_vt_pairs<T>(S.v, vg + (kPair ? 4 * half : 0), tq, ld, [&](int kb, int r, int nt, int e, int col, float2 vv) {
      const float2 gm = *reinterpret_cast<const float2*>(&S.gamma[col]);
      const float2 dc = *reinterpret_cast<const float2*>(&S.decay[col]);
      const float z0 = vv.x - gm.x * ks[nt][e], z1 = vv.y - gm.y * ks[nt][e + 1];
      const float y0 = dc.x * vv.x - gamma_c * ks[nt][e], y1 = dc.y * vv.y - gamma_c * ks[nt][e + 1];
      os[nt][e] *= gm.x;
      os[nt][e + 1] *= gm.y;
      za[kb][r] = pack2<T>(z0, z1);
      split_hi_lo<T>(y0, y1, yh[kb][r], yl[kb][r]);
    });
    if constexpr (kOb) {  // publish Z^T: the O warps may start on this chunk
      if (ob_pub) {
#pragma unroll
        for (int kb = 0; kb < 4; ++kb) stsm_x4(tile16(sm.pub_z, 16 * s + ld.a_row, 16 * kb + ld.a_col), za[kb]);
        bar_sync(ob::kState, kStateThreads);  // (for racecheck, as before the aux groups' full arrive)
        bar_arrive(ob::kPub, ob::kPubThreads);
      }
    }
    // O^T += Z^T W^T  (W lower triangular: k block kb <= n block np)
    FLASHQLA_ROLE_PHASE(0, kStZY);
    if constexpr (kWg) {
      if (want_o) wg_o<T>(S, za, os);
    } else {
#pragma unroll
      for (int kb = 0; kb < 4 && want_o; ++kb) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          if (np < kb || !own_np(np)) continue;
          uint32_t b[4];
          ldsm_x4(b, &S.w[(16 * np + ld.b_row) * kLdC + 16 * kb + ld.b_col]);
          mma_pair<T>(os, np, za[kb], b);
        }
      }
    }
    // S^T = gamma_C S^T + Y^T X  (this warp's K columns of X)
    FLASHQLA_ROLE_PHASE(0, kStO);
    if constexpr (kSplitX) {  // X, formed by the producer after the stage's other tiles were handed over
      bar_sync(pr::kFullX + 2 * st + half, pr::kFullThreads);
      FLASHQLA_ROLE_PHASE(0, kStWaitFull);
    }
#pragma unroll
    for (int j = 0; j < kNT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sacc[j][e] *= gamma_c;
    update_hi_lo<T, kWg>(S.x, kcol, ld, yh, yl, sacc);
#else
    if constexpr (kSplitX) bar_sync(pr::kFullX + 2 * st + half, pr::kFullThreads);  // (the producer arrives at it)
#endif
    if (c + kSt < wk.num_chunks) {
      // the stage's last reads are consumed by the mma's above, so bar.arrive alone releases it; the state
      // warps' sync first is for racecheck, which flags the aux group's refill otherwise (the mirror of the
      // aux group's sync before its full arrive)
      if constexpr (kOb) {
        bar_sync(ob::kState, kStateThreads);
        bar_arrive(ob::kEmpty + c % 6, ob::kEmptyThreads);
      } else {
        bar_sync(state_bar, kStateThreads);
        bar_arrive(kEmptyBar + st, kHandoff);
      }
    }
    FLASHQLA_ROLE_PHASE(0, kStUpdate);

#if FLASHQLA_V2_EXPERIMENT != 2
    if constexpr (!kOb && !kStatesByTma<Storage>) {  // (else the O warps store O, or there is none)
      if (want_o) {
        // O tile: this warp's rows transposed through shared memory, then 16-byte pieces of the rows to global
        if constexpr (kPair) {
          // (the paired chain: warp-local, each warp's 16 V columns through its own 2 KB of the half's O tile, so
          // no barrier of the warpgroup's, which would hold the warps in step with the other half's)
          // whole chunks by TMA where the map was made (a partial chunk's rows past its end belong to the next
          // packed sequence); the piece written two chunks back must have been read first
          T* const stg = sm.o[half][c & 1] + s * (kChunk * 16);
          if (cmaps->o_tma) warp_o_stage_free(lane);
          if (cmaps->o_tma && rows == kChunk)
            warp_store_o_tma<T>(stg, os, p.scale, &cmaps->o, static_cast<int>(wk.col0) + 16 * s, static_cast<int>(wk.h),
                                static_cast<int>(wk.t0 + c * kChunk), static_cast<int>(wk.b), lane);
          else
            warp_store_o<T>(stg, os, p.scale, wk.o + c * kChunk * p.o_stride_time + 16 * s, p.o_stride_time, rows,
                            lane);
        } else {
          T* const ot = sm.o[c & 1];
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            if (!own_np(nt >> 1)) continue;
#pragma unroll
            for (int e = 0; e < 4; ++e)
              ot[(8 * nt + 2 * tq + (e & 1)) * kLdC + v0 + 8 * (e >> 1)] = from_f<T>(p.scale * os[nt][e]);
          }
          bar_sync(state_bar, kStateThreads);
          const int64_t t0 = c * kChunk;
#pragma unroll
          for (int it = 0; it < (kChunk << kOShift) / kStateThreads; ++it) {
            const int i = tid + it * kStateThreads, r = i >> kOShift, c8 = (i & ((1 << kOShift) - 1)) * 8;
            if (r < rows)
              *reinterpret_cast<uint4*>(wk.o + (t0 + r) * p.o_stride_time + c8) =
                  *reinterpret_cast<const uint4*>(&ot[r * kLdC + c8]);
          }
        }
      }
    }
#endif
    FLASHQLA_ROLE_PHASE(0, kStStore);
  }

  // (a merged walk's final state is the source's: merge_final's tile; the states merge runs without one)
  if (p.final_state != nullptr) {
    if (merged) load_state_tile(sacc, merge_final + wk.state_off + int64_t(kcol) * kDimV, tq, v0);
    store_state_tile(p.final_state + wk.state_off + int64_t(kcol) * kDimV, sacc, tq, v0);
  }
  if constexpr (kStatesByTma<Storage> || (kPair && kMerge)) {
    if (tid == 0) bulk_wait();  // (the boxes must outlive their stores' reads)
  }
  if constexpr (kPair) {
    if (cmaps->o_tma && lane == 0) bulk_wait();  // (each warp's O stores, likewise)
  }
}

// The O warps of the O-beside kernel: per chunk, once the state warps have published S^T (the state at the chunk's
// start) and Z^T, O^T = scale (S^T Q^T diag(gamma) + Z^T W^T) as two wgmma products with A from registers (read
// back from the published tiles) and B the stage's Q and W, then the O rows out: each warp's 16 V columns x 64
// tokens transposed by stmatrix into 2 KB of the stage's Q (dead by then) and stored as 16-byte pieces. The stage
// is released after that; the published tiles as soon as they are in registers.
// kMerge: the merging last pass; where the state warps stop (stop_walk<true>) these warps find sm.merge.stop set at the
// chunk's publish barrier and end.
template <typename T, bool kMerge = false, typename Storage>
CUTLASS_DEVICE void o_role(const flashqla_gdn_fwd_params_t& p, Storage& sm, const Work<T>& wk) {
  using namespace warp;
  const int tid = threadIdx.x - kStateThreads, w = tid >> 5, lane = tid & 31, tq = lane & 3;
  const LdsmOffsets ld(lane);
  if (wk.o == nullptr) {  // a summaries pass: no O; the stage barriers still count these warps (bar.sync: in step)
    for (int64_t c = 0; c + kObStages < wk.num_chunks; ++c) bar_sync_sites(ob::kEmpty + c % 6, ob::kEmptyThreads);
    return;
  }
  for (int64_t c = 0; c < wk.num_chunks; ++c) {
    auto& S = sm.stage[c % kObStages];
    const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
    // kEarlyQs: Q S^T as soon as S^T is published (the state warps then still form K S^T and Z^T), Z^T once it is;
    // else both once Z^T is
    constexpr bool kEarly = kEarlyQs<Storage>;
    bar_sync(kEarly ? ob::kPubS : ob::kPub, ob::kPubThreads);
    if constexpr (kMerge) {
      if (*reinterpret_cast<volatile int*>(&sm.merge.stop) != 0) {
        release_after_stop<true>(c, wk.num_chunks);
        return;
      }
    }
    uint32_t sa[8][4], za[4][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) ldsm_x4(sa[kk], tile16(sm.pub_s, 16 * w + ld.a_row, 16 * kk + ld.a_col));
    float os[8][4];
    if constexpr (kEarly) {
      zero_acc(os);
#if FLASHQLA_OB_EXPERIMENT != 1
      wg_rows64<T>(os, sa, S.q);
#endif
      bar_sync(ob::kPub, ob::kPubThreads);
    }
#pragma unroll
    for (int kb = 0; kb < 4; ++kb) ldsm_x4(za[kb], tile16(sm.pub_z, 16 * w + ld.a_row, 16 * kb + ld.a_col));
    bar_sync(ob::kOWarps, kOThreads);  // (for racecheck: bar.arrive orders the reads, racecheck does not model it)
    bar_arrive(ob::kFree, ob::kPubThreads);
#if FLASHQLA_OB_EXPERIMENT == 1
    // diagnostics only (the phase profiler's builds): the O warps keep the barriers and skip their products and
    // stores, so the state warps' step shows what the O role costs them
    if (c + kObStages < wk.num_chunks) {
      bar_sync(ob::kOWarps, kOThreads);
      bar_arrive(ob::kEmpty + c % 6, ob::kEmptyThreads);
    }
    if (sa[0][0] == 0x7fffffffu && za[0][0] == 0x7fffffffu) wk.o[0] = T(0.f);  // (keeps the reads)
    continue;
#endif

    if constexpr (!kEarly) {
      zero_acc(os);
      wg_rows64<T>(os, sa, S.q);
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const float2 gm = *reinterpret_cast<const float2*>(&S.gamma[8 * nt + 2 * tq]);
      os[nt][0] *= gm.x;
      os[nt][1] *= gm.y;
      os[nt][2] *= gm.x;
      os[nt][3] *= gm.y;
    }
    wg_o<T>(S, za, os);
    bar_sync(ob::kOWarps, kOThreads);  // every warp's product has read Q: its tile may take the O rows

    warp_store_o<T>(reinterpret_cast<T*>(S.q[0]) + w * (kChunk * 16), os, p.scale,
                    wk.o + c * kChunk * p.o_stride_time + 16 * w, p.o_stride_time, rows, lane);
    if (c + kObStages < wk.num_chunks) {
      bar_sync(ob::kOWarps, kOThreads);  // (racecheck, as above)
      bar_arrive(ob::kEmpty + c % 6, ob::kEmptyThreads);
    }
  }
}

// Chunks of the sequences before n (all chunks of all sequences in order index dh); every lane of the warp
// calls it and gets the sum.
template <typename IndexT>
CUTLASS_DEVICE int64_t chunk_offset(const flashqla_gdn_fwd_params_t& p, int64_t n, int lane) {
  if (p.cu_seqlens == nullptr) return n * ((p.seqlen + kChunk - 1) / kChunk);
  int64_t base = 0;
  for (int64_t s0 = 0; s0 < n; s0 += 32) {
    const int64_t s = s0 + lane;
    int64_t cnt = 0;
    if (s < n) {
      int64_t b, bos, eos;
      sequence_bounds<IndexT>(p, s, b, bos, eos);
      cnt = (eos - bos + kChunk - 1) / kChunk;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, off);
    base += cnt;
  }
  return base;
}

// kKSplit: the K-split chain (32-column V blocks, state_role<T, true>); kWg: the products as wgmma (swizzled
// stages, SharedStorageSw, 1 KB of alignment slack in the launch); both split mode only (the K split borrows the
// loader groups' product scratch; the fused mode's aux products read the padded tiles).
template <typename T, typename IndexT, bool kStoreBoxes, typename PrepS>
CUTLASS_DEVICE void prep_worker(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, PrepS& sm, int unit,
                                const tma::ChainMaps* cmaps);

// kOb (with kWg): O beside the chain (o_role; 512 threads: state, O, two loader groups). kOverlap (with kOb): the
// first pb.prep_ctas CTAs are prep workers (prep_worker), the chain waits for their flags; kPrepWg: the workers
// run the wgmma prep (prep_head_wg; the default, FLASHQLA_PREP_WG=0 turns it off: prep_wg).
// kMerge (the wgmma chain on prepared chunks): a merging run (state_role's kMerge; pb.merge_ckpt, pb.merge_final): the
// state recompute's TMA form, or the last pass with o in the O-beside TMA form or the wgmma chain's copy form.
template <typename T, typename IndexT, AuxMode kMode, bool kKSplit = false, bool kWg = false, bool kOb = false,
          bool kOverlap = false, bool kPrepWg = false, bool kTma = false, bool kMerge = false>
__global__ void __launch_bounds__(kOb ? kObThreads : kThreads, 1)
    gdn_fwd_mma_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p, const PrepBuffers<T> pb,
                       const __grid_constant__ tma::ChainMaps cmaps) {
  static_assert(!kKSplit || kMode == AuxMode::kLoadPrepared, "the K-split chain runs on prepared chunks");
  static_assert(!kWg || (kMode == AuxMode::kLoadPrepared && !kKSplit), "the wgmma chain: prepared, unsplit");
  static_assert(!kOb || kWg, "O beside the wgmma chain");
  static_assert(!kOverlap || kOb, "prep beside the O-beside chain");
  static_assert(!kPrepWg || kOverlap, "the workers' wgmma prep");
  constexpr int kVB = kKSplit ? kVBlocksK : kVBlocks, kBV = kKSplit ? kBlockVK : kBlockV;
  constexpr int kCtaThreads = kOb ? kObThreads : kThreads;
  // the O-beside chain's loads by TMA (where the host made the maps)
  constexpr bool kTmaChain = kTma && kOb && kMode == AuxMode::kLoadPrepared;
  // the state recompute's chunk states by TMA stores and its loads by TMA (the wgmma chain without O; where the
  // host made the maps)
  constexpr bool kTmaStates = kTma && kWg && !kOb;
  static_assert(!kMerge || (kWg && !kOverlap && kMode == AuxMode::kLoadPrepared && (!kOb || kTmaChain)),
                "the merging runs: the wgmma chain on prepared chunks (the recompute's TMA form, the last pass's copies "
                "or the O-beside TMA form)");
  using ObStorage = std::conditional_t<kTmaChain, SharedStorageObTma<T>, SharedStorageOb<T>>;
  using SwStorage = std::conditional_t<kTmaStates, SharedStorageSwSt<T>, SharedStorageSw<T>>;
  using Storage = std::conditional_t<kOb, ObStorage, std::conditional_t<kWg, SwStorage, SharedStorage<T>>>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = smem_raw;
  if constexpr (kWg || kOb) base = gmma::align_smem_1024(smem_raw);
  auto& sm = *reinterpret_cast<Storage*>(base);
  int64_t block = blockIdx.x;
  if constexpr (kOverlap) {
    if (block < pb.prep_ctas) {
      const int unit = __shfl_sync(0xffffffffu, threadIdx.x / kAuxThreads, 0);
      using PrepS = std::conditional_t<kPrepWg, PrepStorageWg<T>, PrepStorage<T>>;  // (base: 1024-byte aligned)
      // (the wgmma workers of the TMA form store X and W as the prep kernel does, by boxes on the chain's maps)
      prep_worker<T, IndexT, kPrepWg && kTmaChain>(p, pb, reinterpret_cast<PrepS*>(base)[unit], unit, &cmaps);
      return;
    }
    block -= pb.prep_ctas;
  }
  const int64_t main_blocks = p.num_seqs * p.heads_v * kVB;
  if (block >= main_blocks) {
    if (p.o != nullptr) zero_rows_past_end<T, IndexT>(p, block - main_blocks, kTailBlocks, threadIdx.x, kCtaThreads);
    return;
  }
  const CtaTile ct = decode_cta<IndexT>(p, block, kVB, kBV);
  Work<T> wk = make_work<T>(p, ct);
  // the TMA forms' stage barriers, before any role runs
  if constexpr (kTmaChain || kTmaStates) {
    if (threadIdx.x < (kOb ? kObStages : kStages)) tma::mbar_init(&sm.tma_bar[threadIdx.x]);
    __syncthreads();
  }

  // (the wgmma chain: the role test made warp-uniform for ptxas, as CUTLASS does, or it serialises the wgmmas)
  const int role = kWg ? __shfl_sync(0xffffffffu, threadIdx.x / kStateThreads, 0) : (threadIdx.x < kStateThreads ? 0 : 1);
  if (role == 0) {
    cutlass::arch::warpgroup_reg_alloc<kOb ? kObStateRegs : kStateRegs>();
    if (p.chunk_states != nullptr) wk.chunk0 = chunk_offset<IndexT>(p, ct.n, threadIdx.x & 31);
    state_role<T, kKSplit, kWg, kOb, kMerge>(p, sm, wk, &cmaps, 0, pb.merge_ckpt, pb.merge_final);
  } else if (kOb && role == 1) {
    cutlass::arch::warpgroup_reg_dealloc<kObORegs>();
    if constexpr (kOb) o_role<T, kMerge>(p, sm, wk);
  } else {
    constexpr int kFirstLoader = kCtaThreads - kAuxGroups * kAuxThreads;
    cutlass::arch::warpgroup_reg_dealloc<kOb ? kObLoadRegs : kAuxRegs>();
    // (the ready flags' index; gates_from_prep's)
    if (kOverlap || (kTmaChain && pb.gates != nullptr)) wk.chunk0 = chunk_offset<IndexT>(p, ct.n, threadIdx.x & 31);
    if constexpr (kMerge)
      aux_role<T, kMode, kBV, kOb, kOverlap, kTmaChain || kTmaStates, true>(
          p, sm, wk, (threadIdx.x - kFirstLoader) / kAuxThreads, pb, &cmaps, &sm.merge.stop);
    else
      aux_role<T, kMode, kBV, kOb, kOverlap, kTmaChain || kTmaStates>(p, sm, wk, (threadIdx.x - kFirstLoader) / kAuxThreads,
                                                                       pb, &cmaps);
  }
}

// ---- split mode: the chunk-parallel prep kernel
constexpr int kPrepThreads = kAuxThreads;
// Latency-bound CTAs of 4 warps (104 registers): four share an SM (three before session 11, at ~75 KB of shared
// memory each); the GVA-group kernel (168 registers) stays at three.
constexpr int kPrepCtasPerSm = 4;
constexpr int kPrepWgCtasPerSm = 5;  // (the wgmma prep: PrepStorageWg)
constexpr int kPrepGroupCtasPerSm = 3;
// The prep kernel's stage and scratch in one (~52 KB): no V; Q's space serves in turn Q, the inverse's merge
// products (Q is dead once Q K^T is in registers), M, and X (written once every warp's W has read M); W goes to
// global memory from the fragments.
template <typename T>
struct alignas(128) PrepStorage {
  T k[kChunk * kLdK];
  union {
    T q[kChunk * kLdK];
    T x[kChunk * kLdK];
    float scratch[32 * kLdS];
    T m[kChunk * kLdC];
  };
  float gamma[kChunk];
  float decay[kChunk];
  alignas(16) float la[kChunk * kLdF];  // L, then A = (I + L)^-1
  float G[kChunk], beta[kChunk];
  int64_t seq, chunk;  // what this CTA works on (-1: nothing)
};

// The wgmma prep's (prep_head_wg): K, Q and M 128-byte swizzled (two 64-column blocks, as
// StageSw); 1024-byte aligned (the launch adds the slack). Sized for five CTAs an SM (kPrepWgCtasPerSm), where
// PrepStorage's layout allows four: L / A lives in Q's space once the Gram products have read Q, and X is staged
// over A once X's A operand is in registers (aux_gram_inverse_wg and aux_mwx_wg order those reuses); the
// inverse's merge scratch and then M share a second space.
template <typename T>
struct alignas(1024) PrepStorageWg {
  T k[2][kChunk * 64];
  union {
    T q[2][kChunk * 64];
    float la[kChunk * kLdF];  // L, then A = (I + L)^-1
    T x[kChunk * kLdK];       // (XToStage, the workers' form; the prep kernel stages X in q)
  };
  union {
    float scratch[32 * kLdS];
    T m[kChunk * 64];  // M, 128-byte swizzled (W = P M reads it as wgmma's B)
  };
  float gamma[kChunk];
  float decay[kChunk];
  float G[kChunk], beta[kChunk];
  int64_t seq, chunk;
  uint64_t tma_bar;  // K and Q's arrival (the prep kernel with tensor maps)
};

// The prep kernel's K and Q of chunk c (wk: its sequence; value head wk.h's q/k head) as four 64 x 64 TMA boxes
// on S.tma_bar, by one thread (the kernel initialised the barrier before its first __syncthreads).
template <typename T>
CUTLASS_DEVICE void tma_qk_issue(const flashqla_gdn_fwd_params_t& p, const tma::QkMaps& maps, PrepStorageWg<T>& S,
                                 const Work<T>& wk, int64_t c) {
  tma::mbar_expect_tx(&S.tma_bar, 4 * kChunk * 64 * sizeof(T));
  const int hq = static_cast<int>(wk.h / (p.heads_v / p.heads_qk)), t = static_cast<int>(wk.t0 + c * kChunk);
  const int b = static_cast<int>(wk.b);
#pragma unroll
  for (int blk = 0; blk < 2; ++blk) {
    tma::load_box(S.k[blk], &maps.k, &S.tma_bar, 64 * blk, hq, t, b);
    tma::load_box(S.q[blk], &maps.q, &S.tma_bar, 64 * blk, hq, t, b);
  }
}
template <typename StageT>
CUTLASS_DEVICE void tma_qk_landed(StageT& S, int rows, int tid) {
  tma::mbar_wait(&S.tma_bar, 0);  // (one chunk per CTA: the barrier's first phase)
  // rows past the chunk's end: zeros, as cp.async's zero fill (TMA brings the next packed sequence's tokens there)
  for (int i = tid; i < (kChunk - rows) * 32; i += kAuxThreads) {
    const int r = rows + (i >> 5), blk = (i >> 3) & 3, piece = i & 7;
    char* tile = reinterpret_cast<char*>(blk < 2 ? S.k[blk] : S.q[blk - 2]);
    *reinterpret_cast<uint4*>(tile + r * 128 + 16 * piece) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Chunk `k` (over all sequences, in order) -> (sequence, chunk within it); (-1, -1) past the last chunk.
// Varlen: one warp scans the sequences' chunk counts 32 at a time; with `order` (varlen only: a permutation of
// the sequences, clamped as decode_cta does) k counts the chunks of order[0], order[1], ... instead.
template <typename IndexT>
CUTLASS_DEVICE void locate_chunk(const flashqla_gdn_fwd_params_t& p, int64_t k, int lane, int64_t& seq,
                                 int64_t& chunk, const int32_t* order = nullptr) {
  seq = -1;
  chunk = -1;
  if (p.cu_seqlens == nullptr) {
    const int64_t per = (p.seqlen + kChunk - 1) / kChunk;
    if (per > 0 && k < p.batch * per) {
      seq = k / per;
      chunk = k % per;
    }
    return;
  }
  int64_t base = 0;
  for (int64_t s0 = 0; s0 < p.num_seqs; s0 += 32) {
    int64_t s = s0 + lane;
    int64_t cnt = 0;
    if (s < p.num_seqs) {
      if (order != nullptr) s = ordered_seq(order, s, p.num_seqs);
      int64_t b, bos, eos;
      sequence_bounds<IndexT>(p, s, b, bos, eos);
      cnt = (eos - bos + kChunk - 1) / kChunk;
    }
    int64_t incl = cnt;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t up = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += up;
    }
    const bool mine = k >= base + incl - cnt && k < base + incl;  // at most one lane
    const unsigned hit = __ballot_sync(0xffffffffu, mine);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      seq = __shfl_sync(0xffffffffu, s, src);
      chunk = __shfl_sync(0xffffffffu, k - (base + incl - cnt), src);
      return;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
}

// A prep kernel CTA's tile (chunk_grid): chunk grid_chunk() of all sequences' chunks, value heads [hpc t, hpc (t + 1))
// for head tile t (one GVA group's), all V columns; false when the chunk is past the last.
// seq_slot and chunk_slot are shared-memory scratch.
template <typename IndexT>
CUTLASS_DEVICE bool prep_tile(const flashqla_gdn_fwd_params_t& p, int64_t& seq_slot, int64_t& chunk_slot, CtaTile& ct,
                              int64_t& chunk, int hpc = 1) {
  if (threadIdx.x < 32) {
    int64_t seq, ch;
    locate_chunk<IndexT>(p, grid_chunk(), threadIdx.x, seq, ch);
    if (threadIdx.x == 0) {
      seq_slot = seq;
      chunk_slot = ch;
    }
  }
  __syncthreads();
  if (seq_slot < 0) return false;
  ct.vb = 0;
  ct.h = grid_head_tile() * hpc;
  ct.n = seq_slot;
  ct.hq = ct.h / (p.heads_v / p.heads_qk);
  sequence_bounds<IndexT>(p, ct.n, ct.b, ct.bos, ct.eos);
  ct.col0 = 0;
  chunk = chunk_slot;
  return true;
}

// The prep kernel's X of value head h for the chunk's rows, from the stage (rows past the sequence's end are not
// written: the recurrent kernel zero-fills them on load). Unrolled with the row bound as a predicate, so that each
// thread's shared-memory reads issue back to back. src(r, c8): the staged 16 bytes at row r, column c8 (by default
// the stage's padded x).
struct StagedX {
  template <typename Storage>
  CUTLASS_DEVICE auto operator()(const Storage& S, int r, int c8) const { return &S.x[r * kLdK + c8]; }
};
template <typename T, typename Storage, typename Src = StagedX>
CUTLASS_DEVICE void store_prep_x(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, const Storage& S,
                                 int64_t row0, int rows, int64_t h, int tid, Src src = Src{}) {
  T* xd = pb.x + row0 * p.heads_v * kDimK + h * kDimK;
#pragma unroll
  for (int it = 0; it < kChunk * (kDimK / 8) / kPrepThreads; ++it) {
    const int i = tid + it * kPrepThreads, r = i >> 4, c8 = (i & 15) * 8;
    if (r < rows)
      *reinterpret_cast<uint4*>(xd + int64_t(r) * p.heads_v * kDimK + c8) = *reinterpret_cast<const uint4*>(src(S, r, c8));
  }
}
// W of value head h straight from warp w's fragments (rows 16 w .. + 15): a WSink of aux_mwx.
template <typename T>
struct WToGlobal {
  T* wd;     // row 0 of the chunk, head h
  int64_t ld;  // elements between rows
  int rows;
  template <typename Storage>
  CUTLASS_DEVICE void operator()(const Storage&, int w, const float (&wa)[8][4], int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int r = 16 * w + g + 8 * hf;
        if (r < rows)
          *reinterpret_cast<uint32_t*>(wd + int64_t(r) * ld + 8 * nt + 2 * t) = warp::pack2<T>(wa[nt][2 * hf], wa[nt][2 * hf + 1]);
      }
  }
};

// W = P M into M's space (the prep kernel's: dead once every warp's product has read it), 128-byte swizzled by
// stmatrix, for one TMA store box; a chunk that ends early stores its rows straight from the fragments (a box
// would write the next sequence's rows). aux_mwx_wg calls it after the barrier that follows W (kSinkAfterBarrier).
template <typename T>
struct WToSwizzledM {
  WToGlobal<T> direct;
  template <typename StageT>
  CUTLASS_DEVICE void operator()(StageT& S, int w, const float (&wa)[8][4], int lane) const {
    if (direct.rows < kChunk) return direct(S, w, wa, lane);
    store_c_swizzled(S.m, w, wa, lane);
  }
};
template <typename T>
constexpr bool kSinkAfterBarrier<WToSwizzledM<T>> = true;
// The per-head prep of chunk c (wk: its sequence and value head) by one 128-thread unit whose named barrier is
// bar: K, Q, the gates and l2norm, the products, W to global memory from the fragments, X through the stage.
template <typename T>
CUTLASS_DEVICE void prep_head(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, PrepStorage<T>& sm,
                              const Work<T>& wk, int64_t c, int tid, uint32_t bar, long long& t_mark) {
  const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
  const int64_t row0 = wk.flat0 + c * kChunk;
  aux_chunk<T, AuxMode::kInputsOnly>(p, sm, sm, wk, c, tid, bar, pb, t_mark);  // K, Q, gates, l2norm
  float qk[8][4];
  aux_gram_inverse<T>(sm, sm, tid, bar, t_mark, qk);
  aux_mwx<T>(sm, sm, tid, bar, t_mark, qk,
             WToGlobal<T>{pb.w + row0 * p.heads_v * kChunk + wk.h * kChunk, p.heads_v * kChunk, rows});
  warp::bar_sync(bar, kPrepThreads);
  store_prep_x<T>(p, pb, sm, row0, rows, wk.h, tid);
}
// Its wgmma form (gdn_prep_kernel's kWg, the default there: prep_wg): K, Q and M swizzled, K K^T, Q K^T, W = P M and X
// as wgmma (aux_gram_inverse_wg, aux_mwx_wg), the inverse as there. Outputs that differ from prep_head's in
// rounding only (the products' accumulation order). (A separate function: folded into prep_head by an
// if constexpr on the storage, the mma.sync form's code changed.)
// kKernel (the prep kernel's: one chunk per CTA, and no flag waits for its X; maps holds K's, Q's, X's and W's
// tensor maps): K and Q by TMA on the barrier's first phase, X staged swizzled in Q's blocks and W in M's, out as
// three TMA store boxes from one thread, where 64 threads each issued a 256-byte bulk copy for X (~3k cycles a
// CTA: the copies issue one at a time; session 20's phase table) and every thread 16 4-byte stores for W. A chunk
// that ends early (a sequence's last) stores its rows from the staged X tile and W's fragments instead: a box
// would write the next sequence's first rows. Otherwise (the workers beside the chain,
// which loop over chunks and release a flag once X is written): cp.async and stores, or with kStoreBoxes (the
// workers of the chain's TMA form, on the chain's X and W maps) the kernel's box stores, waited for in full by
// their issuing thread (the flag is released after them). x_map, w_map: the maps the boxes go to (kStoreBoxes).
template <typename T, bool kKernel = false, bool kStoreBoxes = kKernel, bool kAb = false>
CUTLASS_DEVICE void prep_head_wg(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, PrepStorageWg<T>& sm,
                                 const Work<T>& wk, int64_t c, int tid, uint32_t bar, long long& t_mark,
                                 const tma::QkMaps* maps = nullptr, const CUtensorMap* x_map = nullptr,
                                 const CUtensorMap* w_map = nullptr) {
  const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
  const int64_t row0 = wk.flat0 + c * kChunk;
  if constexpr (kKernel) {
    if (tid == 0) tma_qk_issue<T>(p, *maps, sm, wk, c);
  }
  aux_chunk<T, AuxMode::kInputsOnly, kBlockV, false, kKernel>(p, sm, sm, wk, c, tid, bar, pb, t_mark);  // K, Q, gates, l2norm
  if constexpr (kKernel) {  // (the chunk's gates for the chain's loader: the prep kernel's chunk is grid_chunk())
    static_assert(kPrepThreads == 2 * kChunk, "a thread a gate value");
    if (pb.gates != nullptr)
      pb.gates[(grid_chunk() * p.heads_v + wk.h) * 2 * kChunk + tid] =
          tid < kChunk ? sm.gamma[tid] : sm.decay[tid - kChunk];
  }
  warp::fence_async_smem();  // the copies and l2norm's stores, before the wgmma read the tiles
  warp::bar_sync(bar, kPrepThreads);
  float qk[8][4];
  aux_gram_inverse_wg<T>(sm, sm, tid, bar, t_mark, qk);
  const WToGlobal<T> w_out{pb.w + row0 * p.heads_v * kChunk + wk.h * kChunk, p.heads_v * kChunk, rows};
  if constexpr (kStoreBoxes) {
    constexpr bool ab = kKernel && kAb;  // (PrepBuffers::ab_only: X's operand in X's first 64 columns)
    aux_mwx_wg<T>(sm, sm, tid, bar, t_mark, qk, WToSwizzledM<T>{w_out}, XToSwizzledQ{}, ab);
    warp::fence_async_smem();  // this thread's stores of X and W, before the TMA (the async proxy) reads them
    warp::bar_sync(bar, kPrepThreads);
    if (rows == kChunk) {
      if (tid == 0) {
#pragma unroll
        for (int half = 0; half < 2; ++half)
          if (half == 0 || !ab)
            tma::store_box3(x_map, sm.q[half], 64 * half, static_cast<int>(wk.h), static_cast<int>(row0));
        tma::store_box3(w_map, sm.m, 0, static_cast<int>(wk.h), static_cast<int>(row0));
        warp::bulk_commit();
        if constexpr (kKernel)
          warp::bulk_wait_read();  // the tile lives until the boxes have been read
        else
          warp::bulk_wait();  // a worker: written, before this thread's fences and the chunk's flag
      }
    } else if (ab) {  // the operand's rows, 64 columns
      T* const xd = pb.x + row0 * p.heads_v * kDimK + wk.h * kDimK;
#pragma unroll
      for (int it = 0; it < kChunk * 8 / kPrepThreads; ++it) {
        const int i = tid + it * kPrepThreads, r = i >> 3, c8 = (i & 7) * 8;
        if (r < rows)
          *reinterpret_cast<uint4*>(xd + int64_t(r) * p.heads_v * kDimK + c8) =
              *reinterpret_cast<const uint4*>(tile16(sm.q[0], r, c8));
      }
    } else {  // the staged tile's rows (rows past the sequence's end are not written)
      store_prep_x<T>(p, pb, sm, row0, rows, wk.h, tid, [](const PrepStorageWg<T>& S, int r, int c8) {
        return tile16(S.q[c8 >> 6], r, c8 & 63);
      });
    }
  } else {
    aux_mwx_wg<T>(sm, sm, tid, bar, t_mark, qk, w_out);
    warp::bar_sync(bar, kPrepThreads);
    store_prep_x<T>(p, pb, sm, row0, rows, wk.h, tid);
  }
}

// One CTA per (chunk, value head), or with kGroup per (chunk, hpc value heads of one GVA group): then K, Q,
// their l2norm and the raw Gram products K K^T, Q K^T once (the group's heads share them), and per value head
// its gates, the inverse and M, W, X. No recurrence, so the whole GPU works on them at once. The per-head
// form is its own instantiation: the group loop keeps the raw products live across heads (144 bytes of spills)
// and measured 5-11% slower per head, which the sharing only won back (NOTES, session 5).
// kStatesOnly (per-head form only): for a recurrence without o (the backward's state recompute), X alone.
// kWg (per-head form only; the default there, prep_wg): prep_head_wg, whose storage is 1024-byte aligned (the
// launch adds the slack), K and Q by TMA on `maps` (the host takes the mma.sync form where it cannot make them).
template <typename T, typename IndexT, bool kGroup, bool kStatesOnly = false, bool kWg = false, bool kAb = false>
__global__ void __launch_bounds__(kPrepThreads, kGroup ? kPrepGroupCtasPerSm : kWg ? kPrepWgCtasPerSm : kPrepCtasPerSm)
    gdn_prep_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p, const PrepBuffers<T> pb, int hpc,
                    const __grid_constant__ tma::QkMaps maps) {
  static_assert(!(kGroup && kStatesOnly), "the group form computes W");
  static_assert(!kWg || (!kGroup && !kStatesOnly), "the wgmma form: per head, with W");
  static_assert(!kAb || kWg, "X's operand (PrepBuffers::ab_only): the wgmma form");
  using Storage = std::conditional_t<kWg, PrepStorageWg<T>, PrepStorage<T>>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* base = smem_raw;
  if constexpr (kWg) base = gmma::align_smem_1024(smem_raw);
  auto& sm = *reinterpret_cast<Storage*>(base);
  // (an SM's 228 KB hold per CTA its dynamic shared memory, the launch's 1024 bytes of alignment slack in the wgmma
  // form, and 1 KB the system reserves)
  static_assert((kWg ? kPrepWgCtasPerSm : kPrepCtasPerSm) * (sizeof(Storage) + (kWg ? 1024 : 0) + 1024) <= 228 * 1024,
                "the prep CTAs an SM fit");
  const int tid = threadIdx.x;
  if constexpr (kWg) {
    if (tid == 0) tma::mbar_init(&sm.tma_bar);  // (before prep_tile's __syncthreads; kWg runs only with maps)
  }
  CtaTile ct;
  int64_t c;
  if (!prep_tile<IndexT>(p, sm.seq, sm.chunk, ct, c, kGroup ? hpc : 1)) return;
  Work<T> wk = make_work<T>(p, ct);
  long long t_mark = 0;
#ifdef FLASHQLA_PHASE_TIMERS
  t_mark = clock64();
#endif
  const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
  const int64_t row0 = wk.flat0 + c * kChunk;
  const auto w_out = [&](int64_t h) {
    return WToGlobal<T>{pb.w + row0 * p.heads_v * kChunk + h * kChunk, p.heads_v * kChunk, rows};
  };
  if constexpr (kStatesOnly) {
    aux_chunk<T, AuxMode::kPrepStates>(p, sm, sm, wk, c, tid, kBarAux, pb, t_mark);
    __syncthreads();
    store_prep_x<T>(p, pb, sm, row0, rows, ct.h, tid);
    FLASHQLA_ROLE_PHASE(1, kAuxWaitEmpty);  // (the prep's slot for its stores)
  } else if constexpr (kWg) {
    prep_head_wg<T, true, true, kAb>(p, pb, sm, wk, c, tid, kBarAux, t_mark, &maps, &maps.x, &maps.w);
    FLASHQLA_ROLE_PHASE(1, kAuxWaitEmpty);  // (the prep's slot for its stores)
  } else if constexpr (!kGroup) {
    prep_head<T>(p, pb, sm, wk, c, tid, kBarAux, t_mark);
    FLASHQLA_ROLE_PHASE(1, kAuxWaitEmpty);  // (the prep's slot for its stores)
  } else {
    aux_chunk<T, AuxMode::kInputsOnly>(p, sm, sm, wk, c, tid, kBarAux, pb, t_mark);  // gates of head ct.h
    float kk[8][4], qk[8][4];
    aux_gram_raw<T>(sm, tid, kk, qk);
    for (int j = 0; j < hpc; ++j) {
      if (j > 0) {  // the next head's gates (the previous head's readers finished at the sync below)
        wk.h = ct.h + j;
        if (tid < 32) load_gates<T>(p, sm, sm, wk, c, tid);
        warp::bar_sync(kBarAux, kAuxThreads);
      }
      aux_gates_inverse<T>(sm, tid, kBarAux, t_mark, kk);
      aux_mwx<T, true>(sm, sm, tid, kBarAux, t_mark, qk, w_out(wk.h));
      __syncthreads();
      store_prep_x<T>(p, pb, sm, row0, rows, wk.h, tid);
      __syncthreads();  // X, A and M are rewritten for the next head
    }
  }
}

// ---- Prep beside the chain (overlap_prep_ctas says where). Where the O-beside chain's CTAs leave SMs
// idle (35B / TP2 single sequences: 64 chain CTAs on 132 SMs), one launch runs both: its first pb.prep_ctas CTAs
// are prep workers (kPrepUnits units of 128 threads, each the per-head prep in its own PrepStorage, items in
// chunk-major order so that every head's early chunks come first), the rest the chain, whose loaders wait for a
// chunk's flag before copying its X and W. The workers come first in blockIdx, are dispatched first and wait for
// nothing, so the chain's waits end also when the CTAs run one at a time (compute-sanitizer) or on fewer SMs.
constexpr int kPrepUnits = kObThreads / kPrepThreads;
// kStoreBoxes (wgmma workers of the chain's TMA form): X and W leave as the prep kernel's boxes, on cmaps' X and W
// maps (the chain's loads use the same encoding: kqx_maps, w_map).
template <typename T, typename IndexT, bool kStoreBoxes, typename PrepS>
CUTLASS_DEVICE void prep_worker(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, PrepS& sm, int unit,
                                const tma::ChainMaps* cmaps) {
  const int tid = threadIdx.x % kPrepThreads;
  const uint32_t bar = 1 + unit;
  long long t_mark = 0;
  // (32-bit item arithmetic: the host takes this path only below 2^31 items)
  const int heads = static_cast<int>(p.heads_v), items = static_cast<int>(pb.ready_chunks * p.heads_v);
  const int step = pb.prep_ctas * kPrepUnits;
  const int per = static_cast<int>((p.seqlen + kChunk - 1) / kChunk), bh = static_cast<int>(p.batch) * heads;
  bool paced = pb.ahead > 0;  // (thread 0's: off for good once a wait runs out)
  for (int item = blockIdx.x * kPrepUnits + unit; item < items; item += step) {
    // item -> (chunk k of all sequences, head): dense batches by chunk position first (chunk c of every sequence
    // before any chunk c + 1: ordered by k, the chains of the later sequences waited for the earlier sequences'
    // whole prep, measured 0.40 -> 0.52 ms at TP8 8192x4); varlen in k's order (the same for one sequence), or
    // with the host's p.seq_order the chunks of its sequences in that order (the chains that start first, first)
    const int k = p.cu_seqlens == nullptr ? (item % bh) / heads * per + item / bh : item / heads;
    const int32_t* order = p.cu_seqlens != nullptr ? p.seq_order : nullptr;
    if (tid < 32) {
      int64_t seq, ch;
      locate_chunk<IndexT>(p, k, tid, seq, ch, order);
      if (tid == 0) {
        sm.seq = seq;
        sm.chunk = ch;
        // the pace: chunk ch - ahead of this sequence and head taken by the chain (without seq_order, which
        // prep_ahead excludes, k is the chunk's flag index and a sequence's flags are consecutive)
        if (paced && seq >= 0 && ch >= pb.ahead)
          paced = wait_taken(pb.ready + (k - pb.ahead) * heads + item % heads);
      }
    }
    warp::bar_sync(bar, kPrepThreads);
    if (sm.seq >= 0) {  // (else past the last chunk: the flag is set all the same)
      CtaTile ct;
      ct.vb = 0;
      ct.h = item % heads;
      ct.n = sm.seq;
      ct.hq = ct.h / (p.heads_v / p.heads_qk);
      sequence_bounds<IndexT>(p, ct.n, ct.b, ct.bos, ct.eos);
      ct.col0 = 0;
      if constexpr (kSwizzledStage<PrepS> && kStoreBoxes)
        prep_head_wg<T, false, true>(p, pb, sm, make_work<T>(p, ct), sm.chunk, tid, bar, t_mark, nullptr, &cmaps->x,
                                     &cmaps->w);
      else if constexpr (kSwizzledStage<PrepS>)
        prep_head_wg<T>(p, pb, sm, make_work<T>(p, ct), sm.chunk, tid, bar, t_mark);
      else
        prep_head<T>(p, pb, sm, make_work<T>(p, ct), sm.chunk, tid, bar, t_mark);
    }
    // this thread's X and W stores, before the flag; the chain's TMA form reads them through the async proxy
    // (it fences after its acquire too)
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
    __threadfence();
    // the flag of the chunk's index over all sequences in order (the chain's wk.chunk0 + c); past the last
    // chunk, k itself (no chain waits there)
    int64_t flag_k = k;
    if (order != nullptr && tid < 32) {
      const int64_t seq = sm.seq;  // (warp-uniform: the warp's calls to chunk_offset stay collective)
      if (seq >= 0) flag_k = chunk_offset<IndexT>(p, seq, tid) + sm.chunk;
    }
    warp::bar_sync(bar, kPrepThreads);  // (also: all have read sm.seq / sm.chunk before the next item's)
    if (tid == 0) release_flag(pb.ready + flag_k * heads + item % heads);
  }
}

// Value heads per prep CTA: 1 (the per-head kernel) unless FLASHQLA_PREP_HEADS=n (n > 1; 0 = automatic)
// asks for the group kernel: then as many of a GVA group's heads (a divisor of the group size, at most n) as
// n allows, or with 0 as keeps two full waves of prep CTAs on the GPU. Off by default: the group kernel
// measured no faster than the per-head one on the H200 anchors (NOTES, session 5).
// An attribute of the first device asked, read once per process (the launch rules run on the host every call;
// a hint for launch shapes and schedules, not a correctness input); kFallback where the runtime cannot say.
template <cudaDeviceAttr kAttr, int kFallback>
inline int device_attribute() {
  static int value = 0;
  if (value == 0) {
    int dev = 0, n = 0;
    value = cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&n, kAttr, dev) == cudaSuccess && n > 0
                ? n : kFallback;
  }
  return value;
}
inline int device_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount, 132>(); }
inline int64_t device_l2_bytes() { return device_attribute<cudaDevAttrL2CacheSize, 50 << 20>(); }
// The preps' launch order (chunk_grid): head-major where the K and Q rows of the call (16-bit) are larger than L2.
// FLASHQLA_PREP_ORDER=heads / chunks forces one (A/B and tests; read per call like the other switches).
inline bool prep_heads_major(const flashqla_gdn_fwd_params_t& p) {
  if (const char* e = std::getenv("FLASHQLA_PREP_ORDER"); e != nullptr && (e[0] == 'h' || e[0] == 'c')) return e[0] == 'h';
  const double kq_bytes = 2.0 * static_cast<double>(p.batch) * static_cast<double>(p.seqlen) *
                          static_cast<double>(p.heads_qk) * kDimK * 2;
  return kq_bytes > static_cast<double>(device_l2_bytes());
}
inline int prep_heads_per_cta(const flashqla_gdn_fwd_params_t& p, int64_t chunks) {
  const int group = static_cast<int>(p.heads_v / p.heads_qk);
  const char* e = std::getenv("FLASHQLA_PREP_HEADS");
  if (e == nullptr || *e == '\0' || std::atoi(e) == 1) return 1;
  const int cap = std::atoi(e) > 0 ? std::atoi(e) : 0;
  const int sms = device_sm_count();
  for (int d = group; d > 1; --d) {
    if (group % d != 0) continue;
    if (cap > 0 ? d <= cap : chunks * (p.heads_v / d) >= 2LL * kPrepCtasPerSm * sms) return d;
  }
  return 1;
}

// The wgmma prep (gdn_prep_kernel's kWg, and the workers beside the chain storing X and W as TMA boxes) or the
// mma.sync one? FLASHQLA_PREP_WG=0: mma.sync everywhere; unset or 1: wgmma everywhere (read per call, like the other
// forms' switches). Session 13: the prep kernel 0.94 -> 0.86 ms at TP1 1x32768. Session 31: the workers' wgmma form
// with TMA-box stores -10..-15% on 35B / TP2 1x8192 and 1x2048 (h200-ab-20261205T0512Z-*-prepwg*.json).
inline bool prep_wg() {
  const char* e = std::getenv("FLASHQLA_PREP_WG");
  return e == nullptr || *e == '\0' || e[0] == '1';
}

// The caller's workspace when it is large enough, else a stream-ordered allocation (a graph allocation node
// under capture) that release() frees on the same stream.
struct Workspace {
  void* ptr = nullptr;
  bool owned = false;
  cudaError_t acquire(const flashqla_gdn_fwd_params_t& p, size_t bytes, cudaStream_t stream) {
    if (p.workspace != nullptr && p.workspace_bytes >= bytes) {
      ptr = p.workspace;
      return cudaSuccess;
    }
    owned = true;
    return cudaMallocAsync(&ptr, bytes, stream);
  }
  cudaError_t release(cudaError_t err, cudaStream_t stream) {
    if (owned && ptr != nullptr) {
      const cudaError_t e = cudaFreeAsync(ptr, stream);
      if (err == cudaSuccess) err = e;
    }
    return err;
  }
};

// The chains with K split over warp pairs (state_role<T, true>, and the backward's dh_state_role<T, true>)?
// FLASHQLA_KSPLIT=0 never, 1 always, unset when their 32-column CTAs (four per sequence and value head) all fit
// on the GPU at once: then a chain is bound by each state warp's products and SMs are idle (TP8 / TP4 single
// sequences, the backward at hk4_hv8). side_by_side: chains that run at the same time (the backward's state
// recompute and dS chain, one CTA per SM each): with twice the CTAs of the unsplit pair they would no longer
// fit together and would run one after the other.
inline bool use_ksplit(const flashqla_gdn_fwd_params_t& p, int side_by_side = 1) {
  const char* e = std::getenv("FLASHQLA_KSPLIT");
  if (e != nullptr && *e != '\0') return e[0] != '0';
  return side_by_side * p.num_seqs * p.heads_v * kVBlocksK <= device_sm_count();
}

// A three-way switch of the environment: 0 (the old form), 2 (tests: the new form or a failed launch), else 1 (the
// new form where it can run).
inline int switch_012(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && (e[0] == '0' || e[0] == '2') ? e[0] - '0' : 1;
}

// FLASHQLA_CHAIN_TMA: 0 the O-beside chain's loaders copy by cp.async (as before session 18); 2 (tests) TMA or
// the launch fails (cudaErrorNotSupported); else (1, unset) TMA where the maps can be made.
inline int chain_tma_mode() {
  return switch_012("FLASHQLA_CHAIN_TMA");
}

// Chunk states without o: the backward's state recompute (its prep computes X alone, and it runs beside the
// dS chain).
inline bool states_only(const flashqla_gdn_fwd_params_t& p) { return p.o == nullptr && p.chunk_states != nullptr; }

// FLASHQLA_STATES_TMA=0: the wgmma chains' per-chunk states (the state recompute's, the dS chain's dS') by the
// state warps' own global stores, as before session 23; 2 (tests) by TMA or the launch fails
// (cudaErrorNotSupported); else (1, unset) by TMA where the map can be made.
inline int states_tma_mode() {
  return switch_012("FLASHQLA_STATES_TMA");
}
// The state-rows map of a chain's per-chunk states at base, [chunk_bound(p), heads_v, 128, 128] in the inputs'
// 16-bit type or fp32 (tma::encode_state_rows); false where it cannot be made.
inline bool state_map(const flashqla_gdn_fwd_params_t& p, const void* base, bool fp32, CUtensorMap& map) {
  const CUtensorMapDataType dt = fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : tma::map_dtype16(p.qkv_dtype);
  const int64_t slots = chunk_bound(p) * p.heads_v;
  return base != nullptr && slots > 0 && slots < (int64_t(1) << 24) &&
         tma::encode_state_rows(map, base, dt, fp32 ? 4 : 2, slots * kDimK);
}

// The maps of K, Q and the prep's X ([rows, heads_v, 128]) that the prep kernel and the O-beside chain both use;
// false where one cannot be made.
template <typename T>
inline bool kqx_maps(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, CUtensorMap& k, CUtensorMap& q,
                     CUtensorMap& x) {
  return pb.x != nullptr &&
         tma::encode_qk(k, p.k, p.qkv_dtype, p.batch, p.seqlen, p.heads_qk, p.k_stride_batch, p.k_stride_time,
                        p.k_stride_head) &&
         tma::encode_qk(q, p.q, p.qkv_dtype, p.batch, p.seqlen, p.heads_qk, p.q_stride_batch, p.q_stride_time,
                        p.q_stride_head) &&
         tma::encode_rows(x, pb.x, p.qkv_dtype, p.batch * p.seqlen, p.heads_v, kDimK);
}
// The prep's W ([rows, heads_v, 64], as X's); false where it cannot be made.
template <typename T>
inline bool w_map(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, CUtensorMap& w) {
  return pb.w != nullptr && tma::encode_rows(w, pb.w, p.qkv_dtype, p.batch * p.seqlen, p.heads_v, kChunk);
}
// V's map ([batch, seqlen, heads_v, 128], as K's); false without v or where it cannot be made.
inline bool v_map(const flashqla_gdn_fwd_params_t& p, CUtensorMap& v) {
  return p.v != nullptr && tma::encode_qk(v, p.v, p.qkv_dtype, p.batch, p.seqlen, p.heads_v, p.v_stride_batch,
                                          p.v_stride_time, p.v_stride_head);
}

// The O-beside chain's tensor maps (tma::ChainMaps) of K, Q, the prep's X, W and V; false where one cannot be made
// (its TMA form loads all of them with o; a summaries pass, without o, neither Q nor W, and without v no V).
template <typename T>
inline bool chain_maps(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, tma::ChainMaps& m) {
  return kqx_maps(p, pb, m.k, m.q, m.x) && w_map(p, pb, m.w) &&
         (p.v == nullptr ? p.o == nullptr : v_map(p, m.v));
}

// The state recompute's (states_only; the TMA form of the wgmma chain without O): K, Q (unused), the prep's X, V
// and the chunk states.
template <typename T>
inline bool states_chain_maps(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, tma::ChainMaps& m) {
  return state_map(p, p.chunk_states, false, m.states) && kqx_maps(p, pb, m.k, m.q, m.x) && v_map(p, m.v);
}

template <typename T, AuxMode kMode, bool kKSplit = false, bool kWg = false, bool kOb = false, bool kOverlap = false,
          bool kPrepWg = false>
cudaError_t launch_recurrent(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, cudaStream_t stream) {
  const int64_t blocks = p.num_seqs * p.heads_v * (kKSplit ? kVBlocksK : kVBlocks) +
                         (p.cu_seqlens != nullptr ? kTailBlocks : 0) + (kOverlap ? pb.prep_ctas : 0);
  if (blocks == 0) return cudaSuccess;
  // the O-beside chain's TMA loads: their own instantiation (the copy form stays the code it was)
  constexpr bool kTmaForm = kOb && kMode == AuxMode::kLoadPrepared;
  tma::ChainMaps cmaps{};
  bool use_tma = false;
  if constexpr (kTmaForm) {
    const int mode = chain_tma_mode();
    use_tma = mode != 0 && chain_maps(p, pb, cmaps);
    if (!use_tma && mode == 2) return cudaErrorNotSupported;
  }
  // the state recompute's chunk states by TMA: the wgmma chain without O (FLASHQLA_STATES_TMA=0: its stores)
  constexpr bool kStatesForm = kWg && !kOb && kMode == AuxMode::kLoadPrepared;
  if constexpr (kStatesForm) {
    const int mode = states_tma_mode();
    use_tma = mode != 0 && states_only(p) && states_chain_maps(p, pb, cmaps);
    if (!use_tma && mode == 2 && states_only(p)) return cudaErrorNotSupported;
  }
  const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
  auto kernel = ix64 ? gdn_fwd_mma_kernel<T, int64_t, kMode, kKSplit, kWg, kOb, kOverlap, kPrepWg>
                     : gdn_fwd_mma_kernel<T, int32_t, kMode, kKSplit, kWg, kOb, kOverlap, kPrepWg>;
  if constexpr (kTmaForm || kStatesForm) {
    if (use_tma)
      kernel = ix64 ? gdn_fwd_mma_kernel<T, int64_t, kMode, kKSplit, kWg, kOb, kOverlap, kPrepWg, true>
                    : gdn_fwd_mma_kernel<T, int32_t, kMode, kKSplit, kWg, kOb, kOverlap, kPrepWg, true>;
  }
  if constexpr (kTmaForm && !kKSplit && !kOverlap && !kPrepWg) {  // the forward's merging last pass, O beside
    if (pb.merge_ckpt != nullptr && p.o != nullptr) {
      if (!use_tma) return cudaErrorNotSupported;  // (the caller runs the wgmma chain's form)
      kernel = ix64 ? gdn_fwd_mma_kernel<T, int64_t, kMode, false, true, true, false, false, true, true>
                    : gdn_fwd_mma_kernel<T, int32_t, kMode, false, true, true, false, false, true, true>;
    }
  }
  if constexpr (kStatesForm && !kKSplit && !kOverlap && !kPrepWg) {  // the merging runs
    if (use_tma && pb.merge_ckpt != nullptr)  // (the state recompute)
      kernel = ix64 ? gdn_fwd_mma_kernel<T, int64_t, kMode, false, true, false, false, false, true, true>
                    : gdn_fwd_mma_kernel<T, int32_t, kMode, false, true, false, false, false, true, true>;
    if (!use_tma && pb.merge_ckpt != nullptr && p.o != nullptr)  // (the forward's last pass)
      kernel = ix64 ? gdn_fwd_mma_kernel<T, int64_t, kMode, false, true, false, false, false, false, true>
                    : gdn_fwd_mma_kernel<T, int32_t, kMode, false, true, false, false, false, false, true>;
  }
  constexpr size_t kPrepUnitsBytes =
      kPrepUnits * (kPrepWg ? sizeof(PrepStorageWg<T>) : sizeof(PrepStorage<T>)) + 1024;
  const size_t smem = kOb ? std::max(sizeof(SharedStorageOb<T>) + 1024, kOverlap ? kPrepUnitsBytes : size_t(0))
                      : kWg ? (use_tma ? sizeof(SharedStorageSwSt<T>) : sizeof(SharedStorageSw<T>)) + 1024
                            : sizeof(SharedStorage<T>);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), kOb ? kObThreads : kThreads, smem, stream>>>(p, pb, cmaps);
  return cudaGetLastError();
}

// ---- The paired chain (FLASHQLA_CHAIN_PAIR): both V halves of a (sequence, value head) in one CTA, so that the
// two chains' latencies hide under each other on one SM (NOTES, session 25: the whole step's products at two
// warpgroups a CTA take 1.37x one's, against 2x as two CTAs on two SMs).

// The producer warpgroup: per chunk, once both state warpgroups released the stage, thread 0 brings K, Q, X, W and
// V's two blocks by TMA and the chunk's gates from the prep kernel's copy (chunks the prep never saw, past
// chunk_bound on malformed cu_seqlens, get unit gates: any finite values; such a call's output is not defined);
// then all zero the rows past the sequence's end (TMA brings the next packed sequence's tokens there), apply the
// l2norm where asked, and hand the stage over.
template <typename T, bool kSum = false, bool kMergeSource = false, bool kAb = false>
CUTLASS_DEVICE void pair_producer(const flashqla_gdn_fwd_params_t& p, SharedStoragePair<T>& sm, const Work<T>& wk,
                                  const PrepBuffers<T>& pb, const tma::ChainMaps& cm) {
  using namespace warp;
  const int tid = threadIdx.x - 2 * kStateThreads;
  const int hq = static_cast<int>(wk.h / (p.heads_v / p.heads_qk)), h = static_cast<int>(wk.h);
  const int b = static_cast<int>(wk.b);
  constexpr uint32_t kBoxBytes = kChunk * 64 * sizeof(T);
  // (profiler builds: the producer's phases, in AuxPhase's slots; benchmarks/profile_fwd_phases.cu's pair mode)
  FLASHQLA_ROLE_TIMER;
  // kSum (gdn_fwd_pair_summaries_kernel): no o, so no Q and no W; V block 0 is this CTA's V columns, block 1 the
  // transition chain's v = 0, zeroed once here (no box ever lands there; the first full barrier orders the stores).
  // With o (kMergeSource: the forward merge's source, the B chain's O where its walk may merge) Q and W too.
  const bool qw = !kSum || (kMergeSource && p.o != nullptr);
  static_assert(!(kAb && kSum), "kAb: the forward's pair");
  const int boxes = kSum ? (qw ? 8 : 5) : kAb ? 8 : 9;  // (kAb: the operand's one box for X's two)
  if constexpr (kSum) {
    for (int i = tid; i < kStages * kChunk * 8; i += kAuxThreads)
      reinterpret_cast<uint4*>(sm.stage[i / (kChunk * 8)].v[1])[i % (kChunk * 8)] = make_uint4(0u, 0u, 0u, 0u);
  }
  for (int64_t c = 0; c < wk.num_chunks; ++c) {
    const int st = static_cast<int>(c % kStages);
    auto& S = sm.stage[st];
    uint64_t* bar = &sm.tma_bar[st];
    if (c >= kStages) bar_sync(pr::kEmpty + st, pr::kHandoffThreads);
    FLASHQLA_ROLE_PHASE(1, kAuxWaitEmpty);
    const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
    const bool gates = wk.chunk0 + c < chunk_bound(p);
    if (tid == 0) {
      const int t = static_cast<int>(wk.t0 + c * kChunk), row0 = static_cast<int>(wk.flat0 + c * kChunk);
      tma::mbar_expect_tx(bar, boxes * kBoxBytes + (gates ? 2 * kChunk * sizeof(float) : 0));
      if (gates) {
        static_assert(offsetof(StagePairSw<T>, decay) == offsetof(StagePairSw<T>, gamma) + kChunk * sizeof(float),
                      "gamma, decay");
        tma::load_bulk(S.gamma, pb.gates + ((wk.chunk0 + c) * p.heads_v + wk.h) * 2 * kChunk,
                       2 * kChunk * sizeof(float), bar);
      }
#pragma unroll
      for (int blk = 0; blk < 2; ++blk) {
        tma::load_box(S.k[blk], &cm.k, bar, 64 * blk, hq, t, b);
        if (qw) tma::load_box(S.q[blk], &cm.q, bar, 64 * blk, hq, t, b);
        if constexpr (!kSum) tma::load_box(S.v[blk], &cm.v, bar, 64 * blk, h, t, b);
        if constexpr (!kAb) tma::load_box3(S.x[blk], &cm.x, bar, 64 * blk, h, row0);
      }
      if constexpr (kAb) tma::load_box3(S.ab, &cm.x, bar, 0, h, row0);
      if constexpr (kSum) tma::load_box(S.v[0], &cm.v, bar, static_cast<int>(wk.col0), h, t, b);
      if (qw) tma::load_box3(S.w, &cm.w, bar, 0, h, row0);
    }
    if (!gates && tid < kChunk) {  // (generic stores, read by the state warps' generic loads after the handoff)
      S.gamma[tid] = 1.f;
      S.decay[tid] = 1.f;
    }
    FLASHQLA_ROLE_PHASE(1, kAuxGram);
    tma::mbar_wait(bar, static_cast<uint32_t>((c / kStages) & 1));
    FLASHQLA_ROLE_PHASE(1, kAuxLoad);
    // rows past the chunk's end: zeros (K, Q, X, V two blocks each, W one; kAb: the operand's block for X's,
    // whose rows the product then makes zero; 128 bytes a row, so the swizzle does not matter)
    constexpr int kZeroBlocks = kAb ? 8 : 9;
    for (int i = tid; i < (kChunk - rows) * kZeroBlocks * 8; i += kAuxThreads) {
      const int r = rows + i / (kZeroBlocks * 8), blk = (i / 8) % kZeroBlocks, piece = i & 7;
      char* tile = reinterpret_cast<char*>(blk < 2   ? S.k[blk]
                                           : blk < 4 ? S.q[blk - 2]
                                           : blk < 6 ? S.v[blk - 4]
                                           : blk < 7 ? S.w
                                           : kAb     ? S.ab
                                                     : S.x[blk - 7]);
      *reinterpret_cast<uint4*>(tile + r * 128 + 16 * piece) = make_uint4(0u, 0u, 0u, 0u);
    }
    if (p.use_qk_l2norm) {  // (K and Q rows to unit length, as the O-beside chain's loaders do)
      bar_sync(pr::kProd, kAuxThreads);
      l2norm_stage_rows<T>(S, tid, qw);
    }
    fence_async_smem();  // (the zeros and l2norm's stores, before the wgmma read the tiles through the async proxy)
    bar_sync(pr::kProd, kAuxThreads);  // (racecheck: bar.arrive orders the stores, racecheck does not model it)
    FLASHQLA_ROLE_PHASE(1, kAuxL2norm);
    bar_arrive(pr::kFull + 2 * st, pr::kFullThreads);
    bar_arrive(pr::kFull + 2 * st + 1, pr::kFullThreads);
    if constexpr (kAb) {  // (X last: the state warpgroups read it last, in the state update)
      form_x<T>(S, S.ab, tid);
      fence_async_smem();  // (X's stores, before the state warpgroups' wgmma read them)
      bar_sync(pr::kProd, kAuxThreads);
      FLASHQLA_ROLE_PHASE(1, kAuxMX);
      bar_arrive(pr::kFullX + 2 * st, pr::kFullThreads);
      bar_arrive(pr::kFullX + 2 * st + 1, pr::kFullThreads);
    }
  }
}

template <typename T, typename IndexT, bool kAb = false>
__global__ void __launch_bounds__(kPairThreads, 1)
    gdn_fwd_pair_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p, const PrepBuffers<T> pb,
                        const __grid_constant__ tma::ChainMaps cmaps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<SharedStoragePair<T>*>(gmma::align_smem_1024(smem_raw));
  const int64_t main_blocks = p.num_seqs * p.heads_v;
  if (static_cast<int64_t>(blockIdx.x) >= main_blocks) {
    if (p.o != nullptr) zero_rows_past_end<T, IndexT>(p, blockIdx.x - main_blocks, kTailBlocks, threadIdx.x, kPairThreads);
    return;
  }
  if (threadIdx.x < kStages) tma::mbar_init(&sm.tma_bar[threadIdx.x]);
  __syncthreads();
  // warpgroups 0 and 1: the V halves' chains; 2: the producer (warp-uniform for ptxas, as in gdn_fwd_mma_kernel)
  const int role = __shfl_sync(0xffffffffu, threadIdx.x / kStateThreads, 0);
  const CtaTile ct = decode_cta<IndexT>(p, 2 * static_cast<int64_t>(blockIdx.x) + (role < 2 ? role : 0), kVBlocks,
                                        kBlockV);
  Work<T> wk = make_work<T>(p, ct);
  if (role < 2) {
    cutlass::arch::warpgroup_reg_alloc<kAb ? kPairAbStateRegs : kStateRegs>();
    state_role<T, false, true, false, false, kAb>(p, sm, wk, &cmaps, role);
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kAb ? kPairAbProdRegs : kPairProdRegs>();
    wk.chunk0 = chunk_offset<IndexT>(p, ct.n, threadIdx.x & 31);  // (the gates' index)
    pair_producer<T, false, false, kAb>(p, sm, wk, pb, cmaps);
  }
}

// Exact parallelism's two summaries passes as one launch (FLASHQLA_SUMMARY_PAIR): one CTA a (segment, value head,
// V block); state warpgroup 0 runs the B chain (p: v, from p.initial_state into p.final_state), warpgroup 1 the
// transition chain of the same V columns (pt: v = 0, the stage's second V block; from pt.initial_state into
// pt.final_state), both on the stage the producer fills once (K, X, this block's V, the prep's gates; no o, so no Q
// and no W). The two chains overlap on the SM as the pair's halves do (NOTES, session 28).
// kMergeSource: the B chain is also a merge's source (state_role's kMerge; pb.merge_ckpt): its chunk states
// (p.chunk_states, cmaps.states) or its O (p.o; the producer then loads Q and W too).
template <typename T, typename IndexT, bool kMergeSource = false>
__global__ void __launch_bounds__(kPairThreads, 1)
    gdn_fwd_pair_summaries_kernel(const __grid_constant__ flashqla_gdn_fwd_params_t p,
                                  const __grid_constant__ flashqla_gdn_fwd_params_t pt, const PrepBuffers<T> pb,
                                  const __grid_constant__ tma::ChainMaps cmaps) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<SharedStoragePair<T>*>(gmma::align_smem_1024(smem_raw));
  if (threadIdx.x < kStages) tma::mbar_init(&sm.tma_bar[threadIdx.x]);
  __syncthreads();
  const int role = __shfl_sync(0xffffffffu, threadIdx.x / kStateThreads, 0);
  const CtaTile ct = decode_cta<IndexT>(p, blockIdx.x, kVBlocks, kBlockV);
  Work<T> wk = make_work<T>(p, ct);
  if (role < 2) {
    cutlass::arch::warpgroup_reg_alloc<kStateRegs>();
    if constexpr (kMergeSource) {
      wk.chunk0 = chunk_offset<IndexT>(p, ct.n, threadIdx.x & 31);  // (the chunk states' slots)
      state_role<T, false, true, false, true>(role == 0 ? p : pt, sm, wk, &cmaps, role,
                                              role == 0 ? pb.merge_ckpt : nullptr);
    } else {
      state_role<T, false, true, false>(role == 0 ? p : pt, sm, wk, &cmaps, role);
    }
  } else {
    cutlass::arch::warpgroup_reg_dealloc<kPairProdRegs>();
    wk.chunk0 = chunk_offset<IndexT>(p, ct.n, threadIdx.x & 31);  // (the gates' index)
    pair_producer<T, true, kMergeSource>(p, sm, wk, pb, cmaps);
  }
}

// FLASHQLA_CHAIN_PAIR: 0 = off; 1 (unset) = where the O-beside chain's CTAs would come in more than one wave
// (there the pair's fewer SMs a head win: -5..-7% on the multi-wave forward rows, NOTES session 26; in one wave
// its longer step loses, +30..+58%) and it runs (the O-beside chain's TMA form on the prep kernel's output with its
// gates, o and v, no chunk states); 2 (tests) = wherever it runs, else the launch fails; 3 (measurements) =
// wherever it runs, else the O-beside chain.
inline int chain_pair_mode() {
  const char* e = std::getenv("FLASHQLA_CHAIN_PAIR");
  return e != nullptr && e[0] >= '0' && e[0] <= '3' ? e[0] - '0' : 1;
}

// The paired kernels' dynamic shared memory (SharedStoragePair, aligned to 1024 bytes inside), allowed on `kernel`.
template <typename T, typename Kernel>
cudaError_t pair_smem(Kernel kernel, size_t& smem) {
  smem = sizeof(SharedStoragePair<T>) + 1024;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

// Where launch_prepared tries the paired chain first (chain_pair_mode; its form is the O-beside chain's)
inline bool pair_chain_wanted(const flashqla_gdn_fwd_params_t& p) {
  const int pair = chain_pair_mode();
  return pair >= 2 || (pair == 1 && p.num_seqs * p.heads_v * kVBlocks > device_sm_count());
}
// FLASHQLA_PREP_AB=0: the prep kernel writes X as before; else (1, unset) X's operand alone where launch allows it
// (PrepBuffers::ab_only: the paired chain reads it and forms X).
inline bool prep_ab_mode() {
  const char* e = std::getenv("FLASHQLA_PREP_AB");
  return !(e != nullptr && e[0] == '0');
}

// FLASHQLA_O_TMA=0: the paired chain stores O by lane stores; else (1, unset) its whole chunks by TMA where o's map
// can be made; 2: by TMA or not at all (cudaErrorNotSupported: the tests' proof that the TMA form ran).
inline int o_tma_mode() {
  return switch_012("FLASHQLA_O_TMA");
}

// The paired chain on prepared chunks; cudaErrorNotSupported where it does not run (the caller falls back).
template <typename T>
cudaError_t launch_pair(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, cudaStream_t stream) {
  tma::ChainMaps cmaps{};
  if (pb.gates == nullptr || p.o == nullptr || p.chunk_states != nullptr || !chain_maps(p, pb, cmaps))
    return cudaErrorNotSupported;
  const int o_mode = o_tma_mode();
  cmaps.o_tma = o_mode != 0 && tma::encode_o(cmaps.o, p.o, p.qkv_dtype, p.batch, p.seqlen, p.heads_v,
                                             p.o_stride_batch, p.o_stride_time, p.o_stride_head);
  if (o_mode == 2 && !cmaps.o_tma) return cudaErrorNotSupported;
  const int64_t blocks = p.num_seqs * p.heads_v + (p.cu_seqlens != nullptr ? kTailBlocks : 0);
  if (blocks == 0) return cudaSuccess;
  const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
  auto kernel = ix64 ? gdn_fwd_pair_kernel<T, int64_t> : gdn_fwd_pair_kernel<T, int32_t>;
  if (pb.ab_only) kernel = ix64 ? gdn_fwd_pair_kernel<T, int64_t, true> : gdn_fwd_pair_kernel<T, int32_t, true>;
  size_t smem = 0;
  if (const cudaError_t err = pair_smem<T>(kernel, smem); err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), kPairThreads, smem, stream>>>(p, pb, cmaps);
  return cudaGetLastError();
}

// Which chain runs on prepared chunks: p's (the forward's passes, the backward's state recompute), or with
// ds_chain the backward's dS chain on p. FLASHQLA_WGMMA: 0 = mma.sync (K-split or not, as use_ksplit says), 1 = the
// wgmma chain, 2 = the wgmma chain with O beside it where there is an O to form (else 1). Unset: for the forward's
// passes O beside the wgmma chain, or without an O the wgmma chain, whose state arithmetic is the same bit for bit
// (exact parallelism's summaries-only passes must leave the chain as a full pass does); for the backward's two
// chains, which run side by side, the K split where use_ksplit chooses it, else the wgmma chain. Session 11's A/B
// on the anchors: O beside the chain -3..-12% on every forward row against the best of the others (also against
// the K split on the 1 x 2048 rows); the wgmma chain -1..-4% against mma.sync on the forward, the backward's chains
// within 1% (FLASHQLA_WGMMA=1 there loses 19% at hk4_hv8 32k_1seq, where the K split fits).
enum class ChainForm { kMma, kKSplit, kWgmma, kWgmmaOb };
// FLASHQLA_SUMMARY_OB: 1 (unset) = the summaries passes of exact parallelism (no o, no chunk states) run the O-beside
// chain's kernel with its O warps idle (its three stages and TMA loads; nothing published), 0 = the wgmma chain's
// copy form, as before (NOTES, session 27).
inline bool summary_ob_mode() {
  const char* e = std::getenv("FLASHQLA_SUMMARY_OB");
  return !(e != nullptr && e[0] == '0');
}
inline ChainForm chain_form(const flashqla_gdn_fwd_params_t& p, bool ds_chain = false) {
  const bool backward = ds_chain || states_only(p);
  const bool with_o = !ds_chain && p.o != nullptr && p.chunk_states == nullptr;
  const bool summary = !ds_chain && p.o == nullptr && p.chunk_states == nullptr;
  const char* e = std::getenv("FLASHQLA_WGMMA");
  const int mode = e != nullptr && *e != '\0' ? std::atoi(e) : -1;
  if (mode == 2 || (mode < 0 && !backward))
    return with_o || (summary && summary_ob_mode()) ? ChainForm::kWgmmaOb : ChainForm::kWgmma;
  if (mode == 1) return ChainForm::kWgmma;
  if (use_ksplit(p, backward ? 2 : 1)) return ChainForm::kKSplit;
  return mode == 0 ? ChainForm::kMma : ChainForm::kWgmma;
}

// FLASHQLA_CP_MERGE_OB=1: the forward's merging last pass in the O-beside chain's TMA form where the plain last pass
// runs that form (the chunks after the merge keep the source's O, another product order: o equal to rounding, the
// final states bitwise; measured in session 39: faster than the wgmma form everywhere, see chunk_gdn_cp_fwd_merged);
// else (0, unset) as the wgmma chain with O (its O is the source's product order, so o is bitwise the unmerged wgmma
// chain's).
inline bool merge_ob_mode() {
  const char* e = std::getenv("FLASHQLA_CP_MERGE_OB");
  return e != nullptr && e[0] == '1';
}

// A merging run's checkpoint bytes (kStateMergeCheckpoints fp32 tiles per segment and value head): the state
// recompute p, or 0 where its chain would not merge (the K split, or the states by the warps' own stores); the last
// pass with o (the O-beside or the wgmma chain's form when merging).
inline size_t merge_bytes(const flashqla_gdn_fwd_params_t& p) {
  const size_t bytes = size_t(kStateMergeCheckpoints) * static_cast<size_t>(p.num_seqs * p.heads_v) * kDimK * kDimV *
                       sizeof(float);
  if (!fwd_split_mode() || p.num_seqs * p.heads_v == 0) return 0;
  if (p.o != nullptr) return p.chunk_states == nullptr ? bytes : 0;
  return states_only(p) && chain_form(p) == ChainForm::kWgmma && states_tma_mode() != 0 ? bytes : 0;
}

// FLASHQLA_GATES_FROM_PREP=0: the chain's loaders compute the gates; else (1, unset) where the wgmma prep kernel
// feeds the O-beside chain's TMA form, the prep writes them and the loaders copy them (PrepBuffers::gates; the same
// compute_gates on the same inputs, so the same bits); 2 (tests): there, or the launch fails.
inline int gates_from_prep_mode() {
  return switch_012("FLASHQLA_GATES_FROM_PREP");
}

// The split mode's chain on prepared X and W (chain_form).
template <typename T>
cudaError_t launch_prepared(const flashqla_gdn_fwd_params_t& p, const PrepBuffers<T>& pb, cudaStream_t stream) {
  constexpr AuxMode kM = AuxMode::kLoadPrepared;
  switch (chain_form(p)) {
    case ChainForm::kWgmmaOb:
      if (pair_chain_wanted(p)) {
        const cudaError_t err = launch_pair<T>(p, pb, stream);
        // (ab_only: launch chose it where the pair runs, and no other chain forms X from the operand)
        if (err != cudaErrorNotSupported || chain_pair_mode() == 2 || pb.ab_only) return err;
      }
      return launch_recurrent<T, kM, false, true, true>(p, pb, stream);
    case ChainForm::kWgmma: return launch_recurrent<T, kM, false, true>(p, pb, stream);
    case ChainForm::kKSplit: return launch_recurrent<T, kM, true>(p, pb, stream);
    default: return launch_recurrent<T, kM>(p, pb, stream);
  }
}

// FLASHQLA_SUMMARY_PAIR: 1 (unset) = exact parallelism's two summaries passes (launch's pt) as one launch of
// gdn_fwd_pair_summaries_kernel where it runs (the prep's gates in the workspace, TMA maps for K, X and V); 0 = two
// launches of the O-beside kernel, as before; 2 (tests) = the one launch, or the call fails.
inline int summary_pair_mode() {
  return switch_012("FLASHQLA_SUMMARY_PAIR");
}

// The two summaries passes on prepared chunks: p (the B pass) and pt (the transition pass: v = 0), which differ
// only in v, initial_state and final_state.
// pb.merge_ckpt: the B pass is also a merge's source (state_role's kMerge): its chunk states into merge_states (the
// backward's states merge) or its O into p.o (the forward's), in the walks that may merge, and the checkpoints; the
// paired launch only (else cudaErrorNotSupported: the caller runs the plain passes).
template <typename T>
cudaError_t launch_summaries(const flashqla_gdn_fwd_params_t& p, const flashqla_gdn_fwd_params_t& pt,
                             const PrepBuffers<T>& pb, cudaStream_t stream, void* merge_states = nullptr) {
  const int mode = summary_pair_mode();
  tma::ChainMaps cmaps{};  // (Q's map is made and not read without o; W's made only with o)
  const bool source = pb.merge_ckpt != nullptr;
  flashqla_gdn_fwd_params_t pk = p;  // (the kernel's B params: the source's chunk states)
  pk.chunk_states = merge_states;
  if (source && ((merge_states != nullptr && !state_map(p, merge_states, false, cmaps.states)) ||
                 (p.o != nullptr && !w_map(p, pb, cmaps.w))))
    return cudaErrorNotSupported;
  if (mode != 0 && pb.gates != nullptr && chain_tma_mode() != 0 && kqx_maps(p, pb, cmaps.k, cmaps.q, cmaps.x) &&
      v_map(p, cmaps.v)) {
    const int64_t blocks = p.num_seqs * p.heads_v * kVBlocks;
    if (blocks == 0) return cudaSuccess;
    const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
    auto kernel = ix64 ? gdn_fwd_pair_summaries_kernel<T, int64_t> : gdn_fwd_pair_summaries_kernel<T, int32_t>;
    if (source)
      kernel = ix64 ? gdn_fwd_pair_summaries_kernel<T, int64_t, true> : gdn_fwd_pair_summaries_kernel<T, int32_t, true>;
    size_t smem = 0;
    if (const cudaError_t err = pair_smem<T>(kernel, smem); err != cudaSuccess) return err;
    kernel<<<static_cast<unsigned>(blocks), kPairThreads, smem, stream>>>(pk, pt, pb, cmaps);
    return cudaGetLastError();
  }
  if (mode == 2 || source) return cudaErrorNotSupported;
  cudaError_t err = launch_prepared<T>(p, pb, stream);
  return err == cudaSuccess ? launch_prepared<T>(pt, pb, stream) : err;
}

// Prep beside the chain (prep_worker), where the O-beside chain's CTAs leave at least a quarter of the SMs to
// the prep workers: their count, or 0. FLASHQLA_OVERLAP=0: never; =1: wherever that holds; unset: there, for
// dense batches and single sequences (the workers' chunk-position order feeds their chains evenly; with several
// varlen sequences the later chains wait for the earlier ones' prep) whose prep takes at least two waves of the
// workers (one wave ends all at once, so the chain starts no earlier and the flags cost a memset: TP8 1x2048
// measured 0.082 -> 0.094 ms).
// The O-beside chain's CTAs (V blocks of every sequence and value head; the varlen tail CTAs not counted)
inline int64_t chain_ctas(const flashqla_gdn_fwd_params_t& p) { return p.num_seqs * p.heads_v * kVBlocks; }
inline int overlap_prep_ctas(const flashqla_gdn_fwd_params_t& p) {
  const char* e = std::getenv("FLASHQLA_OVERLAP");
  const bool forced = e != nullptr && e[0] == '1';
  if ((e != nullptr && e[0] == '0') || p.o == nullptr || chain_form(p) != ChainForm::kWgmmaOb) return 0;
  const int sms = device_sm_count();
  const int64_t chain = chain_ctas(p), items = chunk_bound(p) * p.heads_v;
  if (items >= (int64_t(1) << 31)) return 0;  // (the workers count items in 32 bits)
  // the host's plan for a packed batch (flashqla/_cp.py, overlap_plan): its worker count, however many chain CTAs
  // wait for SMs behind them (the workers come first and wait for nothing)
  if (p.prep_workers > 0) return p.prep_workers;
  if (chain > sms - sms / 4) return 0;
  const int workers = static_cast<int>(sms - chain);
  if (forced) return workers;
  const bool even = p.cu_seqlens == nullptr || p.num_seqs == 1;
  return even && items >= 2LL * workers * kPrepUnits ? workers : 0;
}

// The workers' pace (PrepBuffers::ahead) beside prep_ctas workers: kPrepAhead chunks where X and W do not fit in
// L2 (where they do, they stay there unpaced and the waits only cost: TP2 1x2048 +8% on an H100),
// FLASHQLA_PREP_AHEAD=n another everywhere (0: free). Fewer starve the chain (4: +40% on an H100), more let X and W
// leave L2 before the chain reads them (32 gives back most of 8's gain). Only where every chain CTA runs beside the
// workers from the start (a chain CTA waiting for a worker's SM would leave the workers waiting out their budget;
// the varlen tail CTAs come after the chain's and wait for nothing), and without seq_order (the workers' wait reads
// the flag index off their item).
constexpr int kPrepAhead = 8;
inline int prep_ahead(const flashqla_gdn_fwd_params_t& p, int prep_ctas) {
  const char* e = std::getenv("FLASHQLA_PREP_AHEAD");
  const bool spills = static_cast<int64_t>(prep_workspace_bytes(p, kFwdPrepCols)) > device_l2_bytes();
  const int n = e != nullptr ? std::atoi(e) : spills ? kPrepAhead : 0;
  return n > 0 && p.seq_order == nullptr && chain_ctas(p) + prep_ctas <= device_sm_count() ? n : 0;
}

// pt (flashqla_gdn_fwd_cp_summaries): p is exact parallelism's B pass (o and chunk states NULL) and pt its
// transition pass on the same chunks; both run after the one prep (launch_summaries).
// The merges (merge_ckpt: their checkpoints; split mode only). With pt, the B pass as the source
// (flashqla_gdn_fwd_cp_summaries_merge_source): its chunk states into merge_states, or its O into p.o. Without, p is
// the merging run on prepared chunks (flashqla_gdn_fwd_merge): the state recompute, or the last pass with o: the
// O-beside chain's TMA form where the plain last pass would run it (merge_ob_mode), else the wgmma chain (whose O
// is the paired chain's, bit for bit); merge_final the source's final states.
template <typename T>
cudaError_t launch(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream,
                   const flashqla_gdn_fwd_params_t* pt = nullptr, void* merge_states = nullptr,
                   float* merge_ckpt = nullptr, const float* merge_final = nullptr) {
  const int64_t chunks = chunk_bound(p);
  // the chains after the prep: p's, or with pt both summaries passes
  const auto chains = [&](const PrepBuffers<T>& pb) {
    if (pt != nullptr) return launch_summaries<T>(p, *pt, pb, stream, merge_states);
    if (pb.merge_ckpt != nullptr && p.o != nullptr) {  // the merging last pass: O beside where it runs
      if (merge_ob_mode() && chain_form(p) == ChainForm::kWgmmaOb) {
        const cudaError_t e = launch_recurrent<T, AuxMode::kLoadPrepared, false, true, true>(p, pb, stream);
        if (e != cudaErrorNotSupported) return e;
      }
      return launch_recurrent<T, AuxMode::kLoadPrepared, false, true>(p, pb, stream);
    }
    return launch_prepared<T>(p, pb, stream);
  };
  if (merge_ckpt != nullptr && (!fwd_split_mode() || (pt == nullptr && !p.prep_ready)))
    return cudaErrorNotSupported;
  if (!fwd_split_mode() || chunks == 0 || p.num_seqs == 0) {
    const PrepBuffers<T> none{nullptr, nullptr};
    const cudaError_t err = launch_recurrent<T, AuxMode::kFused>(p, none, stream);
    return err == cudaSuccess && pt != nullptr ? launch_recurrent<T, AuxMode::kFused>(*pt, none, stream) : err;
  }
  static_assert(kFwdPrepCols == kDimK + kChunk && sizeof(T) == 2, "workspace layout");
  Workspace ws;  // X and W for every token row (and with gates_from_prep the chunks' gates after them)
  const size_t xw_bytes = prep_workspace_bytes(p, kFwdPrepCols);
  const size_t gate_bytes = fwd_gate_workspace_bytes(p);  // (chunk_bound's chunks, 2 x 64 fp32 gates each)
  static_assert(kChunk == 64, "fwd_gate_workspace_bytes: 2 x 64 gates a chunk");
  const int gmode = gates_from_prep_mode();
  // (the plain forward on the prep kernel: not CP's prepared passes nor the prep beside the chain; a caller's
  // workspace sized for X and W alone keeps the gates in the chain)
  // (with o only: the summaries passes run the O-beside kernel too, whose loaders copy the prep's gates only with o)
  // (and for the summaries pair, whose producer only copies them)
  const bool gates_wanted = gmode != 0 && !p.prep_ready &&
                            (pt != nullptr ? summary_pair_mode() != 0
                                           : p.o != nullptr && overlap_prep_ctas(p) == 0 &&
                                                 chain_form(p) == ChainForm::kWgmmaOb) &&
                            chain_tma_mode() != 0 &&
                            (p.workspace == nullptr || p.workspace_bytes >= xw_bytes + gate_bytes);
  cudaError_t err = ws.acquire(p, xw_bytes + (gates_wanted ? gate_bytes : 0), stream);
  if (err != cudaSuccess) return err;
  const size_t rows = static_cast<size_t>(p.batch) * static_cast<size_t>(p.seqlen);
  PrepBuffers<T> pb{static_cast<T*>(ws.ptr), static_cast<T*>(ws.ptr) + rows * p.heads_v * kDimK};
  pb.merge_ckpt = merge_ckpt;
  pb.merge_final = merge_final;
  if (p.prep_ready && !ws.owned) {  // X, W in place (prep_ready = 2: and the chunks' gates after them)
    if (p.prep_ready == 2 && gmode != 0 && p.workspace_bytes >= xw_bytes + gate_bytes)
      pb.gates = reinterpret_cast<float*>(static_cast<char*>(ws.ptr) + xw_bytes);
    return chains(pb);
  }
  // one launch: the prep beside the chain (not for the summaries: a merge's source has o)
  if (const int prep_ctas = pt == nullptr ? overlap_prep_ctas(p) : 0; prep_ctas > 0) {
    Workspace flags;  // (always its own, zeroed: a flag per chunk and value head)
    flags.owned = true;
    const size_t bytes = static_cast<size_t>(chunks) * static_cast<size_t>(p.heads_v) * sizeof(int);
    err = cudaMallocAsync(&flags.ptr, bytes, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(flags.ptr, 0, bytes, stream);
    if (err == cudaSuccess) {
      pb.ready = static_cast<int*>(flags.ptr);
      pb.ready_chunks = chunks;
      pb.prep_ctas = prep_ctas;
      pb.ahead = prep_ahead(p, prep_ctas);
      err = prep_wg() ? launch_recurrent<T, AuxMode::kLoadPrepared, false, true, true, true, true>(p, pb, stream)
                      : launch_recurrent<T, AuxMode::kLoadPrepared, false, true, true, true>(p, pb, stream);
    }
    return ws.release(flags.release(err, stream), stream);
  }
  const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
  // the state recompute's workspace then holds no W (a later prep_ready call with o needs a workspace filled by
  // a call with o)
  const int hpc = states_only(p) ? 1 : prep_heads_per_cta(p, chunks);
  tma::QkMaps maps{};  // (the wgmma prep's K, Q, X and W by TMA: strides TMA can describe, else the mma.sync prep)
  const bool wg = !states_only(p) && hpc == 1 && prep_wg() && kqx_maps(p, pb, maps.k, maps.q, maps.x) &&
                  w_map(p, pb, maps.w);
  // (the chain's TMA form must run too: chain_maps' K, Q, X and W maps are wg's, just made; V's decides)
  CUtensorMap v_probe{};
  if (gates_wanted && wg && v_map(p, v_probe))
    pb.gates = reinterpret_cast<float*>(static_cast<char*>(ws.ptr) + xw_bytes);
  if (gmode == 2 && pb.gates == nullptr) return ws.release(cudaErrorNotSupported, stream);
  // the operand alone where only the paired chain reads this prep (a workspace no later call reads; the plain
  // forward with o; launch_pair's conditions: the gates and maps made above)
  pb.ab_only = prep_ab_mode() && p.workspace_private != 0 && pt == nullptr && merge_ckpt == nullptr && wg &&
               pb.gates != nullptr && p.o != nullptr && p.chunk_states == nullptr &&
               chain_form(p) == ChainForm::kWgmmaOb && pair_chain_wanted(p);
  auto prep = states_only(p) ? (ix64 ? gdn_prep_kernel<T, int64_t, false, true> : gdn_prep_kernel<T, int32_t, false, true>)
              : hpc > 1   ? (ix64 ? gdn_prep_kernel<T, int64_t, true> : gdn_prep_kernel<T, int32_t, true>)
              : pb.ab_only ? (ix64 ? gdn_prep_kernel<T, int64_t, false, false, true, true>
                                   : gdn_prep_kernel<T, int32_t, false, false, true, true>)
              : wg        ? (ix64 ? gdn_prep_kernel<T, int64_t, false, false, true> : gdn_prep_kernel<T, int32_t, false, false, true>)
                          : (ix64 ? gdn_prep_kernel<T, int64_t, false> : gdn_prep_kernel<T, int32_t, false>);
  const size_t smem = wg ? sizeof(PrepStorageWg<T>) + 1024 : sizeof(PrepStorage<T>);
  err = cudaFuncSetAttribute(prep, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err == cudaSuccess) {
    prep<<<chunk_grid(chunks, p.heads_v / hpc, prep_heads_major(p)), kPrepThreads, smem, stream>>>(
        p, pb, hpc, maps);
    err = cudaGetLastError();
  }
  if (err == cudaSuccess) err = chains(pb);
  return ws.release(err, stream);
}

}  // namespace gdn_fwd_mma
}  // namespace flashqla
