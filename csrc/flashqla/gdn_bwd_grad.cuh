// Backward, part 2: the chunk-parallel gradient step (reference._chunk_local_grads), v1.
//
// With S0 (the state at each chunk's start, the forward kernel's chunk_states) and dS' (the gradient of the
// state at its end, gdn_bwd_dh) every chunk's gradients are independent. One CTA (8 warps) per (chunk, q/k
// head) runs the step for each value head of the GVA group as a sequence of phases, each a set of tensor-core
// products over shared memory with an epilogue, separated by __syncthreads (the first two overlap: the aux
// warps' products while the others load S0 and dS'): every operand staged in shared memory, products
// recomputed where that saves a buffer. Each product is one wgmma chain per warpgroup: warpgroup w / 4 computes
// column half w / 4 of every C x 128 (64 columns) and C x C (32 columns) product, warp w its rows
// [16 (w % 4), +16); its row-wise intermediates stay in registers, what other warps read goes to shared memory
// as T (128-byte swizzled where a product reads it by descriptor). Row sums are reduced in a fixed order
// (deterministic). Products, C = 64:
//   KS = K S0, R = V - gamma KS, Y = beta R, Vn = M Y (M = Gamma * A), dW = K dS', U1 = scale P^T dO
//   (P = Q K^T * Gamma), dVn = U1 + dte dW, d_dte = rowsum(dW * Vn);
//   dK = dte (Vn dS'^T) + dKS S0^T + dQK^T Q + (dKK^T + dKK^T^T) K,  dQ = scale gamma (dO S0^T) + dQK K;
//   dP = scale dO Vn^T, dM = dVn Y^T, dY = M^T dVn (dVn hi + lo), dV = dR = beta dY, dKS = -gamma dR (applied to
//   dR S0^T), dbeta = rowsum(dY R)
//   + rowsum(dL * K K^T), d_gamma = scale rowsum(Q * dO S0^T) - rowsum(dR * KS);
//   dQK = dP * Gamma, dA = dM * Gamma, dL = -(A^T dA A^T) strictly lower (tf32), dKK^T = beta dL;
//   H = Gamma * (dP * Q K^T + dM * A) (lower), dG = gamma d_gamma - dte d_dte + rowsum(H) - colsum(H),
//   dG_C += sum(dte d_dte) + gamma_C <S0, dS'>, dg = the reverse cumsum of dG over the chunk.
// With flashqla_gdn_bwd_dh's `a` given (gp.a), the inverse's rows are loaded instead of recomputed.
// One CTA per (chunk, GVA group) runs the group's value heads in order: dq and dk come out per q/k head,
// summed over the group in fp32 registers in head order (the caller applies the l2norm backward); rows past
// the last sequence are zeroed by zero_tail_rows_kernel. dv (each head's) and dq, dk (after the group's last
// head) leave through shared memory by bulk copies, a few per warp (kCopyWarps), each thread waiting for its
// copies to have read shared memory before the next head's phases 1-2 let anything write there.
#pragma once

#include <cstddef>  // offsetof
#include "gdn_fwd_mma.cuh"

namespace flashqla {
namespace gdn_bwd_grad {
template <typename T>
struct GradStage;
}  // namespace gdn_bwd_grad
namespace gdn_fwd_mma {
// aux_chunk's l2norm addresses the gradient kernel's K and Q through tile16
template <typename T>
constexpr bool kSwizzledStage<gdn_bwd_grad::GradStage<T>> = true;
}  // namespace gdn_fwd_mma
namespace gdn_bwd_grad {

using namespace gdn_fwd_mma;

// warps 0-3 -> 4-7 in phases 1-2: the aux warps' copies (K, Q, A) are issued; the loaders' (dO, S0, dS': 112 KB)
// start after them, so that the aux chain's inputs are not queued behind the loaders'
constexpr uint32_t kBarAuxIssued = kBarState + 1;
constexpr uint32_t kBarLoaders = kBarAuxIssued + 1;  // among the loader warps: a staging slot converted
static_assert(kBarLoaders < 16, "named barrier ids");
// Warp w owns rows [16 (w % 4), +16) and column group w / 4 of every C x 128 and C x C product; warps 0-3 are
// also the aux warps of phases 1-2, the others load S0 and dS' there. (16 warps, each with half the tiles under a
// 128-register cap, measured 19% slower in session 14: spills, and A loaded by twice the warps.)
constexpr int kGradWarps = 8;
constexpr int kGradThreads = kGradWarps * 32;
constexpr int kColGroups = kGradWarps / 4;
constexpr int kNT = kDimV / 8 / kColGroups;     // 8-column tiles of a warp's C x 128 tile
constexpr int kNTc = kChunk / 8 / kColGroups;   // of its C x C tile
constexpr int kLoaderThreads = kGradThreads - kAuxThreads;
static_assert(kDimK == kDimV && kNTc % 2 == 0 && 8 * kNTc == 32, "square states; n-tile pairs; tf32 m64n32");
// The bulk copies out (dv's 64 rows in phase 8, dq's and dk's 128 in phase 13b) come from warps
// 0..kCopyWarps-1, copy i from lane i / kCopyWarps of warp i % kCopyWarps. Their cost is the copy engine's
// (~20-27 cycles per row copy, however many warps issue them: phase timers with 4 and 8 warps), and the
// issuing warps wait for it, so the fewest warps that keep it busy: the four aux warps, which wait for the
// loaders in phase 8 anyway (4: 45.4k cycles per head, 8: 46.3k).
#ifndef FLASHQLA_GRAD_COPY_WARPS
#define FLASHQLA_GRAD_COPY_WARPS 4
#endif
constexpr int kCopyWarps = FLASHQLA_GRAD_COPY_WARPS;
// S0 (T) and dS' (fp32) arrive by 1-D bulk copies in pieces of kPieceRows state rows, two pieces in flight in
// two staging slots (over Y, Vn / dR and dVn, free in phases 1-2), each converted by the loader warps as it lands
constexpr int kPieces = 4, kPieceRows = kDimK / kPieces;
// (only the aux warps copy out: their wait for the copies' reads, before the loaders may write the staging slots
// over dR and the tiles over dq_st / dk_st, covers every copy)
static_assert(kCopyWarps >= 1 && kCopyWarps <= kAuxThreads / 32 && 2 * kChunk / kCopyWarps <= 32, "copies per lane");
// The warp that computes the gates (dg, dbeta) in phase 13b: one that issues no bulk copies there, so the two
// overlap (warp 0 did both: the copies' issue, ~3k cycles, then the gates, while warps 4-7 waited).
// FLASHQLA_GRAD_GATE_WARP: a compile-time switch for the phase profiler's A/B.
#ifndef FLASHQLA_GRAD_GATE_WARP
#define FLASHQLA_GRAD_GATE_WARP (kCopyWarps < kGradWarps ? kCopyWarps : 0)
#endif
constexpr int kGateWarp = FLASHQLA_GRAD_GATE_WARP;
static_assert(kGateWarp >= 0 && kGateWarp < kGradWarps, "a warp of the CTA");
// this thread's copy index i among n (the mapping above), or -1
CUTLASS_DEVICE int copy_index(int tid, int n) {
  const int w = tid >> 5, lane = tid & 31;
  const int i = lane * kCopyWarps + w;
  return w < kCopyWarps && i < n ? i : -1;
}
enum RowSum { kSumDte, kSumDbeta, kSumDgamma, kSumH, kRowSums };
// fp32 C x 128 staging tiles for dq and dk (rows 16-byte aligned for the bulk copies; 136-float rows put a
// fragment's float2 stores at two wavefronts per warp) in the S0 and dS' tiles, dead by then
constexpr int kLdO = kDimK + 8;
static_assert(sizeof(float) * kChunk * kLdO <= 2 * kDimK * kLdK, "the staging tiles fit in S0's and dS' 16-bit tiles");
static_assert(kLdO * sizeof(float) % 16 == 0 && kLdK * 2 % 16 == 0, "16-byte aligned rows for the bulk copies");
constexpr int kLdO16 = kDimK + 8;  // the same tiles' rows when dq, dk leave in T (gp.dqk_dtype)
static_assert(kLdO16 * 2 % 16 == 0 && kLdO16 * 2 <= kLdO * 4, "16-bit staging rows: aligned, inside the fp32 tile");

// Diagnostics only (benchmarks/profile_bwd_grad_phases.cu): with FLASHQLA_GRAD_TIMERS, thread 0 (an aux warp)
// and thread 128 (a loader warp in phases 1-2) of every CTA add the cycles since their previous mark to
// g_grad_cycles[thread / 128][mark]: even marks end a phase's own work, odd marks the block barrier after it.
constexpr int kGradMarks = 28;
#ifdef FLASHQLA_GRAD_TIMERS
__device__ unsigned long long g_grad_cycles[2][kGradMarks];
#define FLASHQLA_GRAD_MARK(i)                                                                    \
  do {                                                                                           \
    if (threadIdx.x == 0 || threadIdx.x == 128) {                                                \
      const long long now_ = clock64();                                                          \
      atomicAdd(&g_grad_cycles[threadIdx.x >> 7][i], (unsigned long long)(now_ - t_grad));       \
      t_grad = now_;                                                                             \
    }                                                                                            \
  } while (0)
#define FLASHQLA_GRAD_TIMER_START \
  long long t_grad = clock64();   \
  const long long t_head = t_grad
// Points inside phases 1-2 (cycles since the head's start, not part of the phase totals), apart for the group's
// first head (K, Q loaded and normalised) and its later ones: g_grad_at[thread / 128][later head][point]
constexpr int kGradPoints = 8;
__device__ unsigned long long g_grad_at[2][2][kGradPoints];
#define FLASHQLA_GRAD_AT(i)                                                                                  \
  do {                                                                                                       \
    if (threadIdx.x == 0 || threadIdx.x == 128)                                                              \
      atomicAdd(&g_grad_at[threadIdx.x >> 7][vh > 0][i], (unsigned long long)(clock64() - t_head));         \
  } while (0)
#define FLASHQLA_GRAD_SYNC(i) \
  do {                        \
    FLASHQLA_GRAD_MARK(i);    \
    __syncthreads();          \
    FLASHQLA_GRAD_MARK(i + 1); \
  } while (0)
#else
#define FLASHQLA_GRAD_TIMER_START do { } while (0)
#define FLASHQLA_GRAD_MARK(i) do { } while (0)
#define FLASHQLA_GRAD_AT(i) do { } while (0)
#define FLASHQLA_GRAD_SYNC(i) __syncthreads()
#endif

// A C x 128 tile of chunk rows (K, Q, dO, Y, Vn, dVn) as two 64-column blocks, 128-byte swizzled (gmma::sw128_off;
// tile16 addresses it), so that wgmma reads it in shared memory as either operand: K-major (its rows as A's rows
// or as B^T's) and MN-major (its rows as B's k).
template <typename T>
using RowTile = T[2][kChunk * 64];

template <typename T>
struct alignas(1024) GradStage {  // the aux code's view (aux_chunk, aux_gram_raw): K, Q and the gates
  RowTile<T> k;
  RowTile<T> q;
  float gamma[kChunk];  // e^G
  float decay[kChunk];  // dte = e^(G_C - G)
};

template <typename T>
struct GradStorage {
  GradStage<T> in;
  alignas(1024) RowTile<T> dout;
  union alignas(1024) {  // S0 as T [K][V] (StateTile); once its products are done, A^T and X^T = A dA^T (F32Tiles,
                         // phases 10-11), at the end dq's staging tile (fp32 C x 128)
    T s0[2][kDimK * 64];
    float atx[2][kChunk * kChunk];  // A^T, X^T (tf32 operands)
    float dq_st[kChunk * kLdO];
  };
  union alignas(1024) {  // dS' as T [K][V] (StateTile); once its products are done, dVn's lo half (dpm[0], phases
                         // 6-7), dA (dpm[1], an F32Tile), A's lower triangle (dpm[0], an F32Tile, phases 8-10) and
                         // dL (dpm[0], padded rows); at the end dk's staging tile
    T ds[2][kDimK * 64];
    float dpm[2][kChunk * kLdF];
    float dk_st[kChunk * kLdO];
  };
  AuxScratch<T> ax;  // A = (I + L)^-1 (la, fp32), M = Gamma * A (m), G, beta
  alignas(1024) RowTile<T> y;
  union alignas(1024) {  // Vn; once dP is formed, dR (= dV: bulk-stored by rows, hence padded rows)
    RowTile<T> vn;
    T dr[kChunk * kLdK];
  };
  alignas(1024) RowTile<T> dvn;
  T pq[kChunk * kLdC];  // P, later dQK, later dKK^T + dKK^T^T (padded: only ever A, by ldmatrix)
  float rows[kRowSums][kColGroups][kChunk];  // row sums per column group (each row's from the warp of its rows)
  float cols[4][kChunk];                     // per-row-block column sums of H
  float red[kGradWarps];                     // <S0, dS'>
  uint64_t piece_bar[kPieces];               // a staging slot's piece landed (one phase a head)
  int64_t seq, chunk;
};
// dVn's lo half (a swizzled RowTile) over dpm[0] (fp32, C x 64 with kLdF rows; 1024-aligned in its union)
static_assert(sizeof(RowTile<__nv_bfloat16>) <= sizeof(float) * kChunk * kLdF, "dVn's lo half fits in dpm[0]");
template <typename T>
CUTLASS_DEVICE RowTile<T>& dvn_lo(GradStorage<T>& sm) {
  return *reinterpret_cast<RowTile<T>*>(sm.dpm[0]);
}
// The tf32 products' operands (X^T = A dA^T, dL = -A^T X: wgmma reads tf32 K-major only) are F32Tiles: C x C fp32
// as two 32-column blocks of 128-byte rows, 128-byte swizzled (16-byte chunk j of row r at j ^ (r % 8)), 1024-byte
// aligned; a k8 step is 32 bytes of a block, so desc_kmajor addresses them as it does the 16-bit RowTiles. (The
// offset is gmma::sw128_off(r, 2 (c % 32)) written for fp32; through sw128_off, ptxas spilled 24 more bytes.)
constexpr uint32_t kF32Block = kChunk * 128;
static_assert(kF32Block == kChunk * 64 * 2 && sizeof(float) * kChunk * kLdF % 1024 == 0, "F32Tile blocks; dpm[1] aligned");
CUTLASS_DEVICE float* f32_sw(float* tile, int r, int c) {  // element (r, c); c % 4 == 0 starts a 16-byte chunk
  return reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(tile) + (c >> 5) * kF32Block + r * 128 +
                                  ((((c & 31) >> 2) ^ (r & 7)) << 4) + (c & 3) * 4);
}
CUTLASS_DEVICE float tf32_round(float x) { return __uint_as_float(warp::to_tf32(x)); }

// A staging slot: a piece of S0 (T) then the same rows of dS' (fp32), both as stored ([K][V] rows)
template <typename T>
constexpr uint32_t kS0Piece = kPieceRows * kDimV * sizeof(T);
constexpr uint32_t kDsPiece = kPieceRows * kDimV * sizeof(float);
template <typename T>
constexpr uint32_t kSlotBytes = kS0Piece<T> + kDsPiece;
template <typename T>
CUTLASS_DEVICE unsigned char* staging_slot(GradStorage<T>& sm, int slot) {
  static_assert(offsetof(GradStorage<T>, dvn) + sizeof(RowTile<T>) - offsetof(GradStorage<T>, y) >= 2 * kSlotBytes<T>,
                "two staging slots fit over Y, Vn / dR and dVn");
  return reinterpret_cast<unsigned char*>(&sm.y) + slot * kSlotBytes<T>;
}

// Calls f(row, col, e_pair, v0, v1) for each pair of adjacent accumulator elements (row, col), (row, col + 1)
// of a warp tile (16 rows from m0, NT 8-column tiles from n0); e_pair 0: row g, 1: row g + 8.
template <int NT, typename F>
CUTLASS_DEVICE void for_pairs(float (&acc)[NT][4], int m0, int n0, int lane, F&& f) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h) f(m0 + g + 8 * h, n0 + 8 * nt + 2 * t, h, acc[nt][2 * h], acc[nt][2 * h + 1]);
}

// Calls f(nt, hh, row, col) for the accumulator pair (row, col), (row, col + 1) of a warp tile (16 rows from
// m0, NT 8-column tiles from n0) held in registers [nt][2 hh], [nt][2 hh + 1]: for epilogues that need the
// tile index (register arrays of their own beside the accumulators).
template <int NT, typename F>
CUTLASS_DEVICE void for_frag_pairs(int m0, int n0, int lane, F&& f) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) f(nt, hh, m0 + (lane >> 2) + 8 * hh, n0 + 8 * nt + 2 * (lane & 3));
}

// The state tiles S0 and dS' (T, K x V = 128 x 128) are stored as two 64-column blocks, 128-byte swizzled like
// the RowTiles.
template <typename T>
using StateTile = T[2][kDimK * 64];

// Every bf16 / fp16 product of the kernel is a warpgroup-wide wgmma chain: warpgroup ch (warps 4 ch..4 ch + 3)
// computes the 64 rows of its column group (64 columns of a C x 128 product, 32 of a C x C one), warp w's 16 rows
// m0 = 16 (w % 4) in the mma.sync C layout its epilogues use. Operands come from the swizzled tiles by descriptor
// (mma.sync had every warp load all of B for its own 16 rows: four times the shared-memory traffic, and eight
// mma instructions per warp for each wgmma); only the C x C tiles written by the epilogues (M, P, dQK, dKK^T) and
// dR stay padded, and are A through each warp's ldmatrix fragments (RS).
// Descriptors of the 128-byte swizzled tiles as the storage's shared address (>> 4) plus constants: a tile's byte
// offset in the storage (offsetof: known to the compiler), the k16 step's, the column group's (through three
// bases, one per stride of the column group: 256, 512, 1024 x 16 bytes). Each product's descriptor is then an add.
// (gmma::make_desc_sw128 from each tile's generic pointer cost ~12 instructions per wgmma, vector and uniform: more
// than the mma.sync code the products replaced had saved.) Shared addresses are below 2^18 bytes, so the 14-bit
// start field (bytes >> 4) never carries into LBO's field above it.
struct SwDesc {
  uint32_t base;   // the storage's start field
  uint32_t lo[3];  // + the column group's offset of 256 << i (in 16-byte units)
  CUTLASS_DEVICE SwDesc(uint32_t addr4, int wg) : base(addr4) {
#pragma unroll
    for (int i = 0; i < 3; ++i) lo[i] = addr4 + static_cast<uint32_t>(wg) * (256u << i);
  }
  // byte offset off in the storage (a multiple of 16), the column group's offset 256 << kW units (none for kW < 0),
  // the given LBO; SBO 1024 (8-row groups), 128-byte swizzle. (The LBO field added to the start field in 32 bits,
  // which cannot carry: the add folds it into the offset's constant; a 64-bit form grew the SASS by ~1k lines.)
  template <int kW>
  CUTLASS_DEVICE uint64_t at(uint32_t off, int lbo) const {
    const uint32_t b = kW < 0 ? base : lo[kW < 0 ? 0 : kW];
    return (gmma::desc_fields(0, 1024) | gmma::kDescSw128) |
           (b + (off >> 4) + static_cast<uint32_t>(gmma::desc_fields(lbo, 0)));
  }
};
// Storage offsets of the tiles the products read by descriptor
template <typename T>
struct GradOff {
  using S = GradStorage<T>;
  static constexpr uint32_t k = offsetof(S, in) + offsetof(GradStage<T>, k);
  static constexpr uint32_t q = offsetof(S, in) + offsetof(GradStage<T>, q);
  static constexpr uint32_t dout = offsetof(S, dout), s0 = offsetof(S, s0), ds = offsetof(S, ds);
  static constexpr uint32_t y = offsetof(S, y), vn = offsetof(S, vn), dvn = offsetof(S, dvn);
  static constexpr uint32_t dvn_lo = offsetof(S, dpm);
  // the tf32 operands: A's lower triangle (dpm[0]), dA (dpm[1]), A^T and X^T (over S0)
  static constexpr uint32_t am = offsetof(S, dpm), da = offsetof(S, dpm) + sizeof(float) * kChunk * kLdF;
  static constexpr uint32_t at = offsetof(S, atx), xt = offsetof(S, atx) + sizeof(float) * kChunk * kChunk;
};
// The operand of k16 step ks (< 8) of a two-block swizzled tile at byte offset X read K-major: the 8-row groups
// from row 0 (A's 64 rows, kW -1) or from the column group's rows (B^T's: 32 (kW 0) or 64 (kW 1) rows of 128 bytes
// per group), 1024 bytes apart, the step's 32 bytes within its block (blocks kBlock apart).
template <int kW, uint32_t kBlock>
CUTLASS_DEVICE uint64_t desc_kmajor(const SwDesc& sd, uint32_t X, int ks) {
  return sd.at<kW>(X + kBlock * (ks >> 2) + 32 * (ks & 3), 16);
}
// X read MN-major as B: k = X's rows 16 ks.., n = the 64 columns of the column group's block (kBlock bytes apart:
// 8192 for a RowTile, kW 1; 16384 for a state tile, kW 2; one block: LBO unused)
template <int kW, uint32_t kBlock>
CUTLASS_DEVICE uint64_t desc_mnmajor(const SwDesc& sd, uint32_t X, int ks) {
  return sd.at<kW>(X + 2048 * ks, kBlock);
}
constexpr uint32_t kRowBlock = kChunk * 64 * 2, kStateBlock = kDimK * 64 * 2;  // 16-bit T
using gmma::flat;
using gmma::wg_chain;
// acc += X S (kMn 1: S's columns 64 nb..) or X S^T (kMn 0: S's rows 64 nb..), X a RowTile as A (SS)
template <int kMn, typename T>
CUTLASS_DEVICE void issue_row_state(const SwDesc& sd, float (&acc)[kNT][4], uint32_t X, uint32_t S) {
  static_assert(kDimK == kDimV && 8 * kNT == 64, "square states; a warpgroup's 64 columns");
#pragma unroll
  for (int ks = 0; ks < kDimK / 16; ++ks)
    gmma::wgmma_ss<64, T, 0, kMn>(flat(acc), desc_kmajor<-1, kRowBlock>(sd, X, ks),
                                  kMn ? desc_mnmajor<2, kStateBlock>(sd, S, ks) : desc_kmajor<1, kStateBlock>(sd, S, ks));
}
// The A fragments of this warp's 16 rows from m0 of a padded tile (leading dimension ld), kSteps k16 steps:
// A[m][k] = P[m][k] (kTrans false) or P[k][m] (kTrans true)
template <int kSteps, bool kTrans, typename T>
CUTLASS_DEVICE void a_frags(uint32_t (&f)[kSteps][4], const T* P, int ld, int m0, const warp::LdsmOffsets& o) {
#pragma unroll
  for (int ks = 0; ks < kSteps; ++ks) {
    if constexpr (kTrans)
      warp::ldsm_x4_trans(f[ks], P + (16 * ks + o.at_row) * ld + m0 + o.at_col);
    else
      warp::ldsm_x4(f[ks], P + (m0 + o.a_row) * ld + 16 * ks + o.a_col);
  }
}
// acc += A X, A's fragments f (a C x C tile: 4 k16 steps), X a RowTile read MN-major (block nb) (RS)
template <typename T>
CUTLASS_DEVICE void issue_cc_rows(const SwDesc& sd, float (&acc)[kNT][4], const uint32_t (&f)[kChunk / 16][4],
                                  uint32_t X) {
#pragma unroll
  for (int ks = 0; ks < kChunk / 16; ++ks)
    gmma::wgmma_rs<8 * kNT, T, 1>(flat(acc), f[ks], desc_mnmajor<1, kRowBlock>(sd, X, ks));
}
// acc += X Z^T (C x C: this warpgroup's 32 columns, Z's rows n0c..), X and Z RowTiles (SS)
template <typename T>
CUTLASS_DEVICE void issue_rows_rows_t(const SwDesc& sd, float (&acc)[kNTc][4], uint32_t X, uint32_t Z) {
#pragma unroll
  for (int ks = 0; ks < kDimK / 16; ++ks)
    gmma::wgmma_ss<8 * kNTc, T, 0, 0>(flat(acc), desc_kmajor<-1, kRowBlock>(sd, X, ks),
                                      desc_kmajor<0, kRowBlock>(sd, Z, ks));
}

// The four lanes of a quad hold one row's columns: their sum, to the quad's first lane, into
// sums[g][row] (g: the warp's column group; += when accumulate).
CUTLASS_DEVICE void quad_row_sum(float (*sums)[kChunk], int g, int row, float x, int lane, bool accumulate) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  if ((lane & 3) == 0) sums[g][row] = accumulate ? sums[g][row] + x : x;
}

template <typename T>
CUTLASS_DEVICE float2 load_pair(const T* p) {
  return warp::unpack2<T>(*reinterpret_cast<const uint32_t*>(p));
}
template <typename T>
CUTLASS_DEVICE void store_pair(T* p, float a, float b) {
  *reinterpret_cast<uint32_t*>(p) = warp::pack2<T>(a, b);
}

// Outputs per flashqla_gdn_bwd_grad (flashqla.h); gp.fwd describes the inputs.
// kLoadA: gp.a is given (its own instantiation: a runtime branch cost the other path ~8% in registers).
template <typename T, typename IndexT, bool kLoadA>
__global__ void __launch_bounds__(kGradThreads, 1) gdn_bwd_grad_kernel(const __grid_constant__ flashqla_gdn_bwd_grad_params_t gp) {
  using namespace warp;
  const flashqla_gdn_fwd_params_t& p = gp.fwd;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<GradStorage<T>*>(gmma::align_smem_1024(smem_raw));  // the state tiles' swizzle atoms
  const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31;
  const int rb = w & 3, ch = w >> 2;  // warpgroup ch: the column group
  const int m0 = 16 * rb, n0 = 8 * kNT * ch, n0c = 8 * kNTc * ch;  // C x 128 and C x C warp tiles
  const LdsmOffsets ld(lane);
  // the products' descriptors: the storage's shared address as align_smem_1024 computes it (from smem_raw, the same on
  // every thread), the column group as a value ptxas can prove warp-uniform
  const uint32_t s_raw = smem_addr(smem_raw);
  const SwDesc sd((s_raw + gmma::pad_to_1024(s_raw)) >> 4, __shfl_sync(0xffffffffu, ch, 0));
  using Off = GradOff<T>;
  CtaTile ct;
  int64_t c;
  const int group = static_cast<int>(p.heads_v / p.heads_qk);
  if (tid < kPieces) tma::mbar_init(&sm.piece_bar[tid]);  // (before prep_tile's __syncthreads)
  if (!prep_tile<IndexT>(p, sm.seq, sm.chunk, ct, c, group)) return;
  const int64_t hq = ct.hq;
  long long t_mark = 0;
  const PrepBuffers<T> no_pb{nullptr, nullptr};

  // The value heads of the GVA group one after another. dQ and dK of the q/k head are summed over them in
  // registers (fp32, head order) and sent once, after the last (per-head fp32 reduce-adds at L2 cost thread 0's
  // warp ~3.3k cycles of copy issue a head, the others waiting at 13b's barrier; the sum in registers, 255
  // registers with ~50 bytes of spills, measured -1.9% on the backward at hk16_hv32 32k)
  float dk[kNT][4], dq[kNT][4];
  zero_acc(dq);
  zero_acc(dk);
  for (int vh = 0; vh < group; ++vh) {
    FLASHQLA_GRAD_TIMER_START;
    ct.h = hq * group + vh;
    Work<T> wk = make_work<T>(p, ct);
    const int64_t h = ct.h;
    const int rows = static_cast<int>(wk.len - c * kChunk < kChunk ? wk.len - c * kChunk : kChunk);
    const int64_t row0 = wk.flat0 + c * kChunk;  // the chunk's first token row
    const int64_t slot = (grid_chunk() * p.heads_v + h) * int64_t(kDimK) * kDimV;

    // ---- phases 1-2. Warps 0-3: K, Q, the gates, l2norm (the aux code; for the group's later heads only the
    // gates: K and Q, normalised, are still in shared memory, which no phase writes), then the raw Gram
    // products, L and the inverse A (ax.la) -- or, given gp.a, A's rows as the dS chain's prep computed them
    // (the same code on the same inputs: bitwise the same) and Q K^T alone --, P = Q K^T * Gamma to pq
    // (M = Gamma * A in phase 3). Warps 4.. meanwhile: dO (cp.async), S0 (T) and dS' (fp32) through registers into
    // their T tiles with <S0, dS'> in fp32 (96 KB per head, whose latency the aux work hides)
    if (tid < kAuxThreads) {
      if constexpr (kLoadA) {
        const float* ag = gp.a + (row0 * p.heads_v + h) * int64_t(kChunk);
        for (int e = tid; e < kChunk * kChunk / 4; e += kAuxThreads) {
          const int i = e >> 4, j = (e & 15) * 4;
          if (i < rows)
            cp_async_16(&sm.ax.la[i * kLdF + j], ag + int64_t(i) * p.heads_v * kChunk + j, true);
          else  // rows past the sequence: identity rows, as the inverse of their zero rows of L gives them
            *reinterpret_cast<float4*>(&sm.ax.la[i * kLdF + j]) =
                make_float4(j == i ? 1.f : 0.f, j + 1 == i ? 1.f : 0.f, j + 2 == i ? 1.f : 0.f, j + 3 == i ? 1.f : 0.f);
        }
      }
      const auto issued = [&] {
        FLASHQLA_GRAD_AT(4);  // (first head: K, Q and A's rows issued; later: the previous head's copies read)
        bar_arrive(kBarAuxIssued, kGradThreads);
      };
      if (vh == 0) {
        aux_chunk<T, AuxMode::kInputsOnly>(p, sm.in, sm.ax, wk, c, tid, kBarAux, no_pb, t_mark, issued);
      } else {
        // this thread's copies of the previous head read dq_st/dk_st (over s0, ds) and dr: done before the
        // loaders (after the barrier) and phase 3 write them
        bulk_wait_read();
        issued();
        if (w == 0) load_gates<T>(p, sm.in, sm.ax, wk, c, lane);
      }
      FLASHQLA_GRAD_AT(0);             // K, Q (first head: landed, normalised), the gates; A's rows issued
      cp_async_wait_all();             // A's rows (aux_chunk waited for its own loads)
      bar_sync(kBarAux, kAuxThreads);  // the aux group's closing sync: K, Q, the gates (and A) in shared memory
      FLASHQLA_GRAD_AT(1);
      float kk[8][4], qk[8][4];
      if constexpr (kLoadA) {
        aux_gram_raw<T, false>(sm.in, tid, kk, qk);
      } else {
        aux_gram_raw<T>(sm.in, tid, kk, qk);
        aux_gates_inverse<T>(sm.ax, tid, kBarAux, t_mark, kk);
      }
      FLASHQLA_GRAD_AT(2);
      const AuxLane al(tid);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        float pv[4] = {0.f, 0.f, 0.f, 0.f};
        if (nt <= 2 * al.w + 1) gate_p_tile<T>(sm.ax, al, nt, qk[nt], pv);
        const int j = 8 * nt + 2 * al.tq;
        store_pair<T>(&sm.pq[al.i0 * kLdC + j], pv[0], pv[1]);
        store_pair<T>(&sm.pq[al.i1 * kLdC + j], pv[2], pv[3]);
      }
      FLASHQLA_GRAD_AT(3);
    } else {
      bar_sync(kBarAuxIssued, kGradThreads);  // the aux warps' copies go first
      FLASHQLA_GRAD_AT(0);
      const int u = tid - kAuxThreads;
      const T* dop = static_cast<const T*>(gp.dout) + wk.b * gp.dout_stride_batch + wk.t0 * gp.dout_stride_time +
                     h * gp.dout_stride_head;
      for (int i = u; i < kChunk * kDimV / 8; i += kLoaderThreads) {
        const int r = i >> 4, c8 = (i & 15) * 8;
        const bool ok = r < rows;
        cp_async_16(tile16(sm.dout, r, c8), ok ? dop + (c * kChunk + r) * gp.dout_stride_time + c8 : dop, ok);
      }
      // (the aux warps' dV copies of the previous head, the only copies before the group's last head's dq / dk,
      // have read dR under the staging slots: they waited before the barrier above)
      FLASHQLA_GRAD_AT(1);
      // S0 arrives in T (the states chain rounds it once on the way out), dS' in fp32: <S0, dS'> (dG_C's term)
      // sums dS' unrounded (both rounded raised dg's error 2.1e-3 -> 3.3e-3 on the harness case), and the
      // products read both in T. Both by bulk copies (one thread issues them, the copy engine moves them): the
      // loaders' register loads of these 96 KB ran at ~8.5 bytes a cycle per SM (session 15's points), 12-16k
      // cycles of phases 1-2; the copies reach ~13, which with every CTA fetching in step is about the H200's
      // HBM rate (more bytes in flight, S0 by TMA, the next head's pieces early: all measured null). Each piece
      // is converted as it lands, the items in the register loads' order (item k of thread u: state row
      // 4 k + u / 32, columns 4 (u % 32)..), so the tiles and <S0, dS'> are bitwise theirs; the slot is refilled
      // with piece p + 2 once every loader has read piece p.
      const T* s0g = static_cast<const T*>(gp.states) + slot;
      const float* dsg = gp.dh + slot;
      const auto issue_piece = [&](int pc) {
        unsigned char* st = staging_slot(sm, pc & 1);
        tma::mbar_expect_tx(&sm.piece_bar[pc], kSlotBytes<T>);
        tma::load_bulk(st, s0g + pc * kPieceRows * kDimV, kS0Piece<T>, &sm.piece_bar[pc]);
        tma::load_bulk(st + kS0Piece<T>, dsg + pc * kPieceRows * kDimV, kDsPiece, &sm.piece_bar[pc]);
      };
      if (u == 0) {
        issue_piece(0);
        issue_piece(1);
      }
      constexpr int kPer = kDimK * kDimV / 4 / kLoaderThreads / kPieces;  // items per thread and piece
      static_assert(kLoaderThreads % 32 == 0 && kPieceRows % (kLoaderThreads / 32) == 0, "whole rows per piece");
      float dot = 0.f;
#pragma unroll 1
      for (int pc = 0; pc < kPieces; ++pc) {
        tma::mbar_wait(&sm.piece_bar[pc], static_cast<uint32_t>(vh & 1));
        FLASHQLA_GRAD_AT(4 + pc);  // (thread 128: piece pc landed)
        const unsigned char* st = staging_slot(sm, pc & 1);
        const T* s0s = reinterpret_cast<const T*>(st);
        const float* dss = reinterpret_cast<const float*>(st + kS0Piece<T>);
#pragma unroll
        for (int e = 0; e < kPer; ++e) {
          const int i = u + (kPer * pc + e) * kLoaderThreads, r = i >> 5, c4 = (i & 31) * 4;
          const int rl = r - kPieceRows * pc;
          const uint2 a = *reinterpret_cast<const uint2*>(s0s + rl * kDimV + c4);
          const float4 b = *reinterpret_cast<const float4*>(dss + rl * kDimV + c4);
          const float2 s01 = unpack2<T>(a.x), s23 = unpack2<T>(a.y);
          dot += s01.x * b.x + s01.y * b.y + s23.x * b.z + s23.y * b.w;
          *reinterpret_cast<uint2*>(tile16(sm.s0, r, c4)) = a;
          *reinterpret_cast<uint2*>(tile16(sm.ds, r, c4)) = make_uint2(pack2<T>(b.x, b.y), pack2<T>(b.z, b.w));
        }
        if (pc + 2 < kPieces) {
          bar_sync(kBarLoaders, kLoaderThreads);  // every loader has read slot pc & 1
          if (u == 0) issue_piece(pc + 2);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
      if (lane == 0) sm.red[w] = dot;
      FLASHQLA_GRAD_AT(2);
      cp_async_wait_all();  // dO
      FLASHQLA_GRAD_AT(3);
    }
    fence_async_smem();  // K, Q (copies, l2norm), dO, S0 and dS' -> wgmma (after the barrier)
    FLASHQLA_GRAD_SYNC(0);

    // This thread's V pairs (rows m0 + lane / 4 + 8 hh, columns n0 + 8 nt + 2 (lane % 4)), read from global
    // memory into registers before a phase's products so that their latency hides behind them (read pair by
    // pair inside the epilogues, each load waited for its own round trip)
    const T* vg = wk.v + c * kChunk * p.v_stride_time;  // this chunk's V rows (all 128 columns)
    uint32_t vraw[kNT][2];
    auto load_v = [&]() {
      for_frag_pairs<kNT>(m0, n0, lane, [&](int nt, int hh, int r, int col) {
        vraw[nt][hh] = r < rows ? __ldg(reinterpret_cast<const unsigned int*>(vg + r * p.v_stride_time + col)) : 0u;
      });
    };

    // ---- phase 3: KS = K S0; R = V - gamma KS; Y = beta R -> y. M = Gamma * A -> ax.m (for phase 4) by all
    // eight warps here: in phases 1-2 it lengthened the aux warps' chain, which bounds those phases
    {
      load_v();
      for (int item = tid; item < kChunk * kChunk / 8; item += kGradThreads) {  // 16-byte pieces
        const int i = item >> 3, j0 = (item & 7) * 8;
        *reinterpret_cast<uint4*>(&sm.ax.m[i * kLdC + j0]) = lower_piece8<T, true, false>(sm.ax, i, j0);
      }
      float ks[kNT][4];
      zero_acc(ks);
      wg_chain([&] { issue_row_state<1, T>(sd, ks, Off::k, Off::s0); }, ks);
      for_frag_pairs<kNT>(m0, n0, lane, [&](int nt, int hh, int r, int col) {
        const float2 v = unpack2<T>(vraw[nt][hh]);
        const float gm = sm.in.gamma[r], bt = sm.ax.beta[r];
        store_pair<T>(tile16(sm.y, r, col), bt * (v.x - gm * ks[nt][2 * hh]), bt * (v.y - gm * ks[nt][2 * hh + 1]));
      });
      fence_async_smem();  // Y -> wgmma
    }
    FLASHQLA_GRAD_SYNC(2);

    // ---- phase 4: Vn = M Y, dW = K dS', U1 = scale P^T dO; dVn = U1 + dte dW; d_dte = rowsum(dW * Vn).
    // dVn stays in registers (fp32) until phase 7 writes what its bf16 copy lost (dY's hi + lo operand)
    float u1[kNT][4];
    {
      float vn[kNT][4], dw[kNT][4];
      zero_acc(vn);
      zero_acc(dw);
      zero_acc(u1);
      uint32_t fm[kChunk / 16][4], fp[kChunk / 16][4];
      a_frags<kChunk / 16, false>(fm, sm.ax.m, kLdC, m0, ld);
      a_frags<kChunk / 16, true>(fp, sm.pq, kLdC, m0, ld);
      wg_chain(
          [&] {
            issue_cc_rows<T>(sd, vn, fm, Off::y);
            issue_row_state<1, T>(sd, dw, Off::k, Off::ds);
            issue_cc_rows<T>(sd, u1, fp, Off::dout);
          },
          vn, dw, u1);
      float s[2] = {0.f, 0.f};
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = m0 + (lane >> 2) + 8 * (e >> 1);
          s[e >> 1] += dw[nt][e] * vn[nt][e];
          u1[nt][e] = p.scale * u1[nt][e] + sm.in.decay[r] * dw[nt][e];  // dVn
        }
      quad_row_sum(sm.rows[kSumDte], ch, m0 + (lane >> 2), s[0], lane, false);
      quad_row_sum(sm.rows[kSumDte], ch, m0 + (lane >> 2) + 8, s[1], lane, false);
      for_pairs(vn, m0, n0, lane, [&](int r, int col, int, float a, float b) { store_pair<T>(tile16(sm.vn, r, col), a, b); });
      for_pairs(u1, m0, n0, lane, [&](int r, int col, int, float a, float b) { store_pair<T>(tile16(sm.dvn, r, col), a, b); });
      fence_async_smem();  // Vn, dVn -> wgmma
    }
    FLASHQLA_GRAD_SYNC(4);

    // ---- phase 5: dK = dte (Vn dS'^T)  (dK and dQ accumulate in registers from here on)
    {
      float t[kNT][4];
      zero_acc(t);
      wg_chain([&] { issue_row_state<0, T>(sd, t, Off::vn, Off::ds); }, t);
      for_frag_pairs<kNT>(m0, n0, lane, [&](int nt, int hh, int r, int) {
        dk[nt][2 * hh] += sm.in.decay[r] * t[nt][2 * hh];
        dk[nt][2 * hh + 1] += sm.in.decay[r] * t[nt][2 * hh + 1];
      });
    }
    FLASHQLA_GRAD_SYNC(6);  // dS' is dead: dpm takes its place

    // ---- phase 6: dP = scale dO Vn^T, dM = dVn Y^T and Q K^T (C x C, this warp's tile, in registers), and with
    // them at once: dQK = dP * Gamma -> pq (P is dead since phase 4), dA = dM * Gamma -> dpm[1] (fp32), H = Gamma
    // * (dP * QK^T + dM * A) (lower): row sums and per-row-block column sums. (dP and dM went through shared
    // memory to phase 9 before: the same values, one fp32 tile and a product's pass fewer.)
    {
      float a[kNTc][4], b[kNTc][4], qk[kNTc][4];
      zero_acc(a);
      zero_acc(b);
      zero_acc(qk);
      wg_chain(
          [&] {
            issue_rows_rows_t<T>(sd, a, Off::dout, Off::vn);
            issue_rows_rows_t<T>(sd, b, Off::dvn, Off::y);
            issue_rows_rows_t<T>(sd, qk, Off::q, Off::k);
          },
          a, b, qk);
      float hr[2] = {0.f, 0.f};
      float hc[kNTc][2] = {};
#pragma unroll
      for (int nt = 0; nt < kNTc; ++nt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int r = m0 + (lane >> 2) + 8 * hh, col = n0c + 8 * nt + 2 * (lane & 3);
          float dqk[2], da[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = col + e;
            const bool low = j <= r;
            const float gam = low ? gate_exp(sm.ax.G[r] - sm.ax.G[j]) : 0.f;
            const float dp = p.scale * a[nt][2 * hh + e], dm = b[nt][2 * hh + e], am = sm.ax.la[r * kLdF + j];
            const float hv = low ? gam * (dp * qk[nt][2 * hh + e] + dm * am) : 0.f;
            hr[hh] += hv;
            hc[nt][e] += hv;
            dqk[e] = dp * gam;
            da[e] = dm * gam;
          }
          store_pair<T>(&sm.pq[r * kLdC + col], dqk[0], dqk[1]);
          *reinterpret_cast<float2*>(f32_sw(sm.dpm[1], r, col)) = make_float2(tf32_round(da[0]), tf32_round(da[1]));
        }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) quad_row_sum(sm.rows[kSumH], ch, m0 + (lane >> 2) + 8 * hh, hr[hh], lane, false);
      // column sums over the warp's 16 rows: lanes with the same lane % 4 hold the same columns
#pragma unroll
      for (int nt = 0; nt < kNTc; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = hc[nt][e];
          x += __shfl_xor_sync(0xffffffffu, x, 4);
          x += __shfl_xor_sync(0xffffffffu, x, 8);
          x += __shfl_xor_sync(0xffffffffu, x, 16);
          if (lane < 4) sm.cols[rb][n0c + 8 * nt + 2 * lane + e] = x;
        }
    }
    // dVn's lo half (what its T copy lost; dY's second operand in phase 7) into dpm[0], free from here (dS' is dead,
    // dL comes in phase 11): here rather than in a phase of its own, which needed Vn dead and a barrier
    for_pairs(u1, m0, n0, lane, [&](int r, int col, int, float a, float b) {
      const float2 hi = load_pair<T>(tile16(sm.dvn, r, col));  // (this thread's own store of phase 4)
      store_pair<T>(tile16(dvn_lo(sm), r, col), a - hi.x, b - hi.y);
    });
    fence_async_smem();  // dVn's lo half -> wgmma
    FLASHQLA_GRAD_SYNC(8);

    // ---- phase 7: dY = M^T dVn with dVn as hi + lo (its bf16 rounding alone doubled dbeta's error in the
    // float64 emulation, benchmarks/precision_study_bwd.py); KS again for R; dV = dR = beta dY -> y (bulk-stored
    // in phase 8, which also applies dKS = -gamma dR after dR S0^T); dbeta = rowsum(dY R); d_gamma = -rowsum(dR KS)
    // (dVn's lo half was written in phase 6, into dpm[0]; mark 10 stays unused)
    {
      load_v();
      float dy[kNT][4], ks[kNT][4];
      zero_acc(dy);
      zero_acc(ks);
      uint32_t fmt[kChunk / 16][4];
      a_frags<kChunk / 16, true>(fmt, sm.ax.m, kLdC, m0, ld);
      wg_chain(
          [&] {
            issue_cc_rows<T>(sd, dy, fmt, Off::dvn);
            issue_cc_rows<T>(sd, dy, fmt, Off::dvn_lo);
            issue_row_state<1, T>(sd, ks, Off::k, Off::s0);
          },
          dy, ks);
      float sb[2] = {0.f, 0.f}, sg[2] = {0.f, 0.f};
      for_frag_pairs<kNT>(m0, n0, lane, [&](int nt, int hh, int r, int col) {
        const float2 v = unpack2<T>(vraw[nt][hh]);
        const float gm = sm.in.gamma[r], bt = sm.ax.beta[r];
        const float k0 = ks[nt][2 * hh], k1 = ks[nt][2 * hh + 1];
        const float r0 = v.x - gm * k0, r1 = v.y - gm * k1;
        const float y0 = dy[nt][2 * hh], y1 = dy[nt][2 * hh + 1];
        const float dr0 = bt * y0, dr1 = bt * y1;
        sb[hh] += y0 * r0 + y1 * r1;
        sg[hh] -= dr0 * k0 + dr1 * k1;
        store_pair<T>(&sm.dr[r * kLdK + col], dr0, dr1);  // over Vn, dead after phase 6
      });
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        quad_row_sum(sm.rows[kSumDbeta], ch, m0 + (lane >> 2) + 8 * hh, sb[hh], lane, false);
        quad_row_sum(sm.rows[kSumDgamma], ch, m0 + (lane >> 2) + 8 * hh, sg[hh], lane, false);
      }
      fence_async_smem();  // dR, for phase 8's bulk store
    }
    FLASHQLA_GRAD_SYNC(12);

    // ---- phase 8: dV out (a bulk store per row from y); dK += -gamma (dR S0^T); dQ = scale gamma (dO S0^T);
    // d_gamma += scale rowsum(Q * dO S0^T)
    {
      const int r = copy_index(tid, kChunk);
      if (r >= 0 && r < rows) {
        bulk_store(static_cast<T*>(gp.dv) + ((row0 + r) * p.heads_v + h) * int64_t(kDimV), &sm.dr[r * kLdK],
                   kDimV * sizeof(T));
        bulk_commit();
      }
      float t[kNT][4], u[kNT][4];
      zero_acc(t);
      zero_acc(u);
      uint32_t fr[kDimK / 16][4];
      a_frags<kDimK / 16, false>(fr, sm.dr, kLdK, m0, ld);
      wg_chain(
          [&] {
#pragma unroll
            for (int ks = 0; ks < kDimK / 16; ++ks)
              gmma::wgmma_rs<8 * kNT, T, 0>(flat(u), fr[ks], desc_kmajor<1, kStateBlock>(sd, Off::s0, ks));
            issue_row_state<0, T>(sd, t, Off::dout, Off::s0);
          },
          u, t);
      // A's lower triangle (la above it is stale) as phase 10's tf32 operand, into dpm[0] (dVn's lo half is dead)
      for (int item = tid; item < kChunk * kChunk / 4; item += kGradThreads) {
        const int i = item >> 4, j0 = (item & 15) * 4;
        const float4 a = *reinterpret_cast<const float4*>(&sm.ax.la[i * kLdF + j0]);
        *reinterpret_cast<float4*>(f32_sw(sm.dpm[0], i, j0)) =
            make_float4(j0 <= i ? tf32_round(a.x) : 0.f, j0 + 1 <= i ? tf32_round(a.y) : 0.f,
                        j0 + 2 <= i ? tf32_round(a.z) : 0.f, j0 + 3 <= i ? tf32_round(a.w) : 0.f);
      }
      fence_async_smem();  // A's lower triangle -> phase 10's wgmma
      float sg[2] = {0.f, 0.f};
      for_frag_pairs<kNT>(m0, n0, lane, [&](int nt, int hh, int r, int col) {
        dk[nt][2 * hh] -= sm.in.gamma[r] * u[nt][2 * hh];
        dk[nt][2 * hh + 1] -= sm.in.gamma[r] * u[nt][2 * hh + 1];
        const float2 qv = load_pair<T>(tile16(sm.in.q, r, col));
        sg[hh] += qv.x * t[nt][2 * hh] + qv.y * t[nt][2 * hh + 1];
        const float s = p.scale * sm.in.gamma[r];
        dq[nt][2 * hh] += s * t[nt][2 * hh];
        dq[nt][2 * hh + 1] += s * t[nt][2 * hh + 1];
      });
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        quad_row_sum(sm.rows[kSumDgamma], ch, m0 + (lane >> 2) + 8 * hh, p.scale * sg[hh], lane, true);
    }
    FLASHQLA_GRAD_SYNC(14);  // S0 is dead: A^T and X^T take its place
    // (phase 9 is gone; mark 16 stays unused)

    // ---- phase 10: dQ += dQK K, dK += dQK^T Q; tf32: X^T = A dA^T -> atx[1]; A^T -> atx[0] while they run.
    // (The tf32 pair X = dA A^T, dL = -A^T X ran on mma.sync with operands read element by element, A^T by
    // transposed reads: 6.3k cycles of phases 10-11 a head for 1 MFLOP. wgmma reads tf32 K-major only: X^T = A dA^T
    // reads A and dA as stored, dL = -A^T X reads A^T and X^T.)
    {
      uint32_t fq[kChunk / 16][4], fqt[kChunk / 16][4];
      a_frags<kChunk / 16, false>(fq, sm.pq, kLdC, m0, ld);
      a_frags<kChunk / 16, true>(fqt, sm.pq, kLdC, m0, ld);
      float xa[kNTc][4];
      zero_acc(xa);
      gmma::fence();
      gmma::pin(flat(dq));
      gmma::pin(flat(dk));
      gmma::pin(flat(xa));
      issue_cc_rows<T>(sd, dq, fq, Off::k);
      issue_cc_rows<T>(sd, dk, fqt, Off::q);
#pragma unroll
      for (int ks = 0; ks < kChunk / 8; ++ks)
        gmma::wgmma_ss_tf32_n32(flat(xa), desc_kmajor<-1, kF32Block>(sd, Off::am, ks),
                                desc_kmajor<0, kF32Block>(sd, Off::da, ks));
      gmma::commit();
      // A^T (zero below its diagonal) for phase 11, over S0 (dead since phase 8), while the products run
      for (int item = tid; item < kChunk * kChunk / 4; item += kGradThreads) {
        const int i = item >> 4, k0 = (item & 15) * 4;
        float a[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) a[e] = k0 + e >= i ? tf32_round(sm.ax.la[(k0 + e) * kLdF + i]) : 0.f;
        *reinterpret_cast<float4*>(f32_sw(sm.atx[0], i, k0)) = make_float4(a[0], a[1], a[2], a[3]);
      }
      gmma::wait_all();
      gmma::pin(flat(dq));
      gmma::pin(flat(dk));
      gmma::pin(flat(xa));
      for_pairs(xa, m0, n0c, lane, [&](int r, int col, int, float a, float b) {
        *reinterpret_cast<float2*>(f32_sw(sm.atx[1], r, col)) = make_float2(tf32_round(a), tf32_round(b));
      });
      fence_async_smem();  // A^T, X^T -> phase 11's wgmma
    }
    FLASHQLA_GRAD_SYNC(18);

    // ---- phase 11 (tf32): dL = -A^T X -> dpm[0] (padded rows: phase 12 reads it element by element)
    {
      float dl[kNTc][4];
      zero_acc(dl);
      wg_chain(
          [&] {
#pragma unroll
            for (int ks = 0; ks < kChunk / 8; ++ks)
              gmma::wgmma_ss_tf32_n32(flat(dl), desc_kmajor<-1, kF32Block>(sd, Off::at, ks),
                                      desc_kmajor<0, kF32Block>(sd, Off::xt, ks));
          },
          dl);
      for_pairs(dl, m0, n0c, lane, [&](int r, int col, int, float a, float b) {
        *reinterpret_cast<float2*>(&sm.dpm[0][r * kLdF + col]) = make_float2(-a, -b);
      });
    }
    FLASHQLA_GRAD_SYNC(20);

    // ---- phase 12: K K^T again: dbeta += rowsum(dL * K K^T) (strictly lower); dKK^T + its transpose -> pq
    {
      float kk[kNTc][4];
      zero_acc(kk);
      wg_chain([&] { issue_rows_rows_t<T>(sd, kk, Off::k, Off::k); }, kk);
      float sb[2] = {0.f, 0.f};
      for_pairs(kk, m0, n0c, lane, [&](int r, int col, int hh, float a, float b) {
        float sym[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = col + e;
          const float dl_rj = j < r ? sm.dpm[0][r * kLdF + j] : 0.f;
          const float dl_jr = r < j ? sm.dpm[0][j * kLdF + r] : 0.f;
          sb[hh] += dl_rj * (e == 0 ? a : b);
          sym[e] = sm.ax.beta[r] * dl_rj + sm.ax.beta[j] * dl_jr;
        }
        store_pair<T>(&sm.pq[r * kLdC + col], sym[0], sym[1]);
      });
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        quad_row_sum(sm.rows[kSumDbeta], ch, m0 + (lane >> 2) + 8 * hh, sb[hh], lane, true);
    }
    FLASHQLA_GRAD_SYNC(22);

    // ---- phase 13: dK += (dKK^T + dKK^T^T) K; after the group's last head, dq and dk (the group's sums) staged in
    // fp32 (over the dead S0 and dS' tiles) and sent by bulk copies, one row per thread (copy_index). (Each head's
    // went out as row copies, fp32 reduce-adds at L2 after the first, each waiting for the row's previous one:
    // thread 0 spent ~3.1k cycles a head in 13b while the others waited at the barrier.)
    {
      uint32_t fs[kChunk / 16][4];
      a_frags<kChunk / 16, false>(fs, sm.pq, kLdC, m0, ld);
      wg_chain([&] { issue_cc_rows<T>(sd, dk, fs, Off::k); }, dk);
    }
    if (vh + 1 == group) {
      // in T (gp.dqk_dtype): rounded once from the fp32 sums, as a cast of the fp32 rows would (no cast pass, half
      // the bytes); in fp32 for the caller's l2norm backward (flashqla_l2norm_bwd)
      const bool narrow = gp.dqk_dtype != FLASHQLA_FLOAT32;
      if (narrow) {
#pragma unroll
        for (int which = 0; which < 2; ++which)
          for_pairs(which == 0 ? dq : dk, m0, n0, lane, [&](int r, int col, int, float a, float b) {
            store_pair<T>(&reinterpret_cast<T*>(which == 0 ? sm.dq_st : sm.dk_st)[r * kLdO16 + col], a, b);
          });
      } else {
#pragma unroll
        for (int which = 0; which < 2; ++which)
          for_pairs(which == 0 ? dq : dk, m0, n0, lane, [&](int r, int col, int, float a, float b) {
            *reinterpret_cast<float2*>(&(which == 0 ? sm.dq_st : sm.dk_st)[r * kLdO + col]) = make_float2(a, b);
          });
      }
      fence_async_smem();  // (the bulk copies read the tiles)
      FLASHQLA_GRAD_SYNC(24);
      if (const int i = copy_index(tid, 2 * kChunk); i >= 0) {
        const int which = i / kChunk, r = i % kChunk;
        if (r < rows) {
          FLASHQLA_GRAD_AT(5);  // (thread 0: 13b reached)
          const uint32_t bytes = narrow ? kDimK * sizeof(T) : kDimK * sizeof(float);
          const float* st = which == 0 ? sm.dq_st : sm.dk_st;
          bulk_store(static_cast<char*>(which == 0 ? gp.dq : gp.dk) + ((row0 + r) * p.heads_qk + hq) * int64_t(bytes),
                     narrow ? static_cast<const void*>(reinterpret_cast<const T*>(st) + r * kLdO16)
                            : static_cast<const void*>(st + r * kLdO), bytes);
          bulk_commit();
          FLASHQLA_GRAD_AT(7);  // (thread 0: its warp's copies issued)
        }
      }
    }

    // ---- gates (warp kGateWarp): dG, then dg = the reverse cumsum over the chunk; dbeta
    if (w == kGateWarp) {
      float dG[2], dbeta[2], dte_sum = 0.f;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * lane + e;  // row i's sums, one per column group, added in order
        const auto sum = [&](int k) {
          float x = sm.rows[k][0][i];
#pragma unroll
          for (int g = 1; g < kColGroups; ++g) x += sm.rows[k][g][i];
          return x;
        };
        const float d_dte = sum(kSumDte);
        const float hcol = sm.cols[0][i] + sm.cols[1][i] + sm.cols[2][i] + sm.cols[3][i];
        dG[e] = sm.in.gamma[i] * sum(kSumDgamma) - sm.in.decay[i] * d_dte + sum(kSumH) - hcol;
        dbeta[e] = sum(kSumDbeta);
        dte_sum += sm.in.decay[i] * d_dte;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dte_sum += __shfl_xor_sync(0xffffffffu, dte_sum, off);
      float dot = 0.f;
      for (int k = 4; k < kGradWarps; ++k) dot += sm.red[k];  // the warps that loaded S0 and dS'
      if (lane == 31) dG[1] += dte_sum + sm.in.gamma[kChunk - 1] * dot;  // dG_C: the chunk's last position
      // reverse inclusive cumsum: lane holds rows 2 lane, 2 lane + 1
      float tail = dG[0] + dG[1];
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float dn = __shfl_down_sync(0xffffffffu, tail, off);
        if (lane + off < 32) tail += dn;
      }
      const float dg1 = tail - dG[0], dg0 = tail;  // sums over rows >= 2 lane + 1 and >= 2 lane
      const float dgs[2] = {dg0, dg1};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * lane + e;
        if (i < rows) {
          gp.dg[(row0 + i) * p.heads_v + h] = dgs[e];
          gp.dbeta[(row0 + i) * p.heads_v + h] = dbeta[e];
        }
      }
    }
    FLASHQLA_GRAD_SYNC(26);  // the next head's phase 1 rewrites what the gate warp read
  }
  bulk_wait();  // the bulk copies' shared-memory sources live as long as the CTA
}

// Token rows past the last sequence (packed inputs with cu_seqlens[-1] < T) get zero gradients, as the
// forward writes zeros to o there: a grid-stride pass over those rows of the five outputs (contiguous, row
// by row), so that the caller need not fill them first. Usually there are none and the CTAs only read
// cu_seqlens.
template <typename T, typename IndexT>
__global__ void zero_tail_rows_kernel(const __grid_constant__ flashqla_gdn_bwd_grad_params_t gp) {
  const flashqla_gdn_fwd_params_t& p = gp.fwd;
  int64_t b = 0, bos = 0, eos = 0;
  if (p.num_seqs > 0) sequence_bounds<IndexT>(p, p.num_seqs - 1, b, bos, eos);
  const int64_t end = b * p.seqlen + eos, tail = p.batch * p.seqlen - end;
  if (tail <= 0) return;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  void* const base[5] = {gp.dq, gp.dk, gp.dv, gp.dg, gp.dbeta};
  const int64_t dqk_words = gp.dqk_dtype == FLASHQLA_FLOAT32 ? p.heads_qk * p.head_dim_k
                                                             : p.heads_qk * p.head_dim_k * int64_t(sizeof(T)) / 4;
  const int64_t row_words[5] = {dqk_words, dqk_words,
                                p.heads_v * p.head_dim_v * int64_t(sizeof(T)) / 4, p.heads_v, p.heads_v};
#pragma unroll
  for (int o = 0; o < 5; ++o) {
    uint32_t* w = static_cast<uint32_t*>(base[o]) + end * row_words[o];
    for (int64_t i = first; i < tail * row_words[o]; i += stride) w[i] = 0u;
  }
}

template <typename T>
cudaError_t launch(const flashqla_gdn_bwd_grad_params_t& gp, cudaStream_t stream) {
  const flashqla_gdn_fwd_params_t& p = gp.fwd;
  const int64_t chunks = chunk_bound(p);
  const bool ix64 = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64;
  if (p.cu_seqlens != nullptr && p.batch * p.seqlen > 0) {  // dense batches have no rows past their sequences
    (ix64 ? zero_tail_rows_kernel<T, int64_t> : zero_tail_rows_kernel<T, int32_t>)<<<kTailBlocks, 256, 0, stream>>>(gp);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (chunks == 0 || p.num_seqs == 0) return cudaSuccess;
  // S0 and dS' arrive by bulk copies, whose sources must be 16-byte aligned (the library's own buffers are)
  if (reinterpret_cast<uintptr_t>(gp.states) % 16 != 0 || reinterpret_cast<uintptr_t>(gp.dh) % 16 != 0)
    return cudaErrorMisalignedAddress;
  auto kernel = gp.a != nullptr ? (ix64 ? gdn_bwd_grad_kernel<T, int64_t, true> : gdn_bwd_grad_kernel<T, int32_t, true>)
                                : (ix64 ? gdn_bwd_grad_kernel<T, int64_t, false> : gdn_bwd_grad_kernel<T, int32_t, false>);
  const size_t smem = sizeof(GradStorage<T>) + 1024;  // + the slack align_smem_1024 takes
  static_assert(sizeof(GradStorage<T>) + 1024 <= 227 * 1024, "one gradient CTA per SM");
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<chunk_grid(chunks, p.heads_qk, false), kGradThreads, smem, stream>>>(gp);
  return cudaGetLastError();
}

}  // namespace gdn_bwd_grad
}  // namespace flashqla
