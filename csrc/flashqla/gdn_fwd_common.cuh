// Device helpers shared by the forward kernels (torch-free): element
// conversions, runtime-dtype scalar loads, sequence bounds and the zeroing of
// output rows past the last sequence.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "flashqla/flashqla.h"

namespace flashqla {

constexpr int kTailBlocks = 32;  // extra CTAs that zero o past cu_seqlens[-1]

template <typename T> CUTLASS_DEVICE float to_f(T x);
template <> CUTLASS_DEVICE float to_f<float>(float x) { return x; }
template <> CUTLASS_DEVICE float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> CUTLASS_DEVICE float to_f<__half>(__half x) { return __half2float(x); }
template <typename T> CUTLASS_DEVICE T from_f(float x);
template <> CUTLASS_DEVICE __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> CUTLASS_DEVICE __half from_f<__half>(float x) { return __float2half_rn(x); }

CUTLASS_DEVICE float load_scalar(const void* p, flashqla_dtype_t dt, int64_t off) {
  switch (dt) {
    case FLASHQLA_BFLOAT16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[off]);
    case FLASHQLA_FLOAT16: return __half2float(static_cast<const __half*>(p)[off]);
    default: return static_cast<const float*>(p)[off];
  }
}

// Sequence n's token range and batch row. cu_seqlens values are clamped to
// [0, seqlen] and a decreasing pair reads as an empty sequence, so malformed
// values give wrong bounds, never out-of-bounds accesses.
template <typename IndexT>
CUTLASS_DEVICE void sequence_bounds(const flashqla_gdn_fwd_params_t& p, int64_t n, int64_t& b, int64_t& bos,
                                    int64_t& eos) {
  if (p.cu_seqlens == nullptr) {
    b = n; bos = 0; eos = p.seqlen;
    return;
  }
  const IndexT* cu = static_cast<const IndexT*>(p.cu_seqlens);
  auto clampT = [&](int64_t x) { return x < 0 ? int64_t(0) : (x > p.seqlen ? p.seqlen : x); };
  b = 0;
  bos = clampT(static_cast<int64_t>(cu[n]));
  eos = clampT(static_cast<int64_t>(cu[n + 1]));
  if (eos < bos) eos = bos;
}

// Sequence s of the host's start order (flashqla_gdn_fwd_params_t::seq_order; clamped so that a malformed order
// reads nothing out of range).
CUTLASS_DEVICE int64_t ordered_seq(const int32_t* order, int64_t s, int64_t num_seqs) {
  return min(max(static_cast<int64_t>(__ldg(order + s)), int64_t(0)), num_seqs - 1);
}

// The chunk-parallel kernels' grid (the forward's and the backward's preps, the gradient kernel): a CTA per (chunk
// of all sequences, head tile), in one of two launch orders.
// - Head-major, (tiles, chunks over y then z, each at most 65535): the head tiles of one chunk run together, so the
//   value heads of a GVA group read their shared K and Q rows at about the same time, once from memory and then from
//   L2. The preps take it where K and Q are larger than L2 (session 49: prep -4..-12% on those rows).
// - Chunk-major, (chunks, 1, tiles): a head's chunks run together. Where K and Q fit in L2 the heads share them either
//   way, and this order measured faster (the 1024x8 rows' prep, +5..+13% head-major); the gradient kernel (no K, Q
//   shared between its CTAs) keeps it.
// chunk_grid makes a chunk-major grid only with two chunks and two tiles or more (with one of either the orders are
// the same), so gridDim.y == 1 with gridDim.z > 1 names it.
constexpr int64_t kGridYMax = 65535;
inline dim3 chunk_grid(int64_t chunks, int64_t head_tiles, bool heads_major) {
  if (!heads_major && chunks > 1 && head_tiles > 1)
    return dim3(static_cast<unsigned>(chunks), 1u, static_cast<unsigned>(head_tiles));
  const int64_t y = chunks < kGridYMax ? chunks : kGridYMax;
  return dim3(static_cast<unsigned>(head_tiles), static_cast<unsigned>(y), static_cast<unsigned>((chunks + y - 1) / y));
}
CUTLASS_DEVICE bool grid_chunk_major() { return gridDim.y == 1 && gridDim.z > 1; }
// This CTA's chunk of all sequences (may be past the last: the z split rounds up) and head tile, under chunk_grid.
CUTLASS_DEVICE int64_t grid_chunk() {
  return grid_chunk_major() ? int64_t(blockIdx.x) : int64_t(blockIdx.z) * gridDim.y + blockIdx.y;
}
CUTLASS_DEVICE int64_t grid_head_tile() { return grid_chunk_major() ? blockIdx.z : blockIdx.x; }
CUTLASS_DEVICE int64_t grid_head_tiles() { return grid_chunk_major() ? gridDim.z : gridDim.x; }

// What one forward CTA works on: V block vb (of `block_v` columns) of value head h of sequence n.
struct CtaTile {
  int vb;
  int64_t h, n, hq;     // value head, sequence, its q/k head
  int64_t b, bos, eos;  // batch row and token range
  int64_t col0;         // first V column
};
template <typename IndexT>
CUTLASS_DEVICE CtaTile decode_cta(const flashqla_gdn_fwd_params_t& p, int64_t block, int vblocks, int block_v) {
  CtaTile c;
  c.vb = static_cast<int>(block % vblocks);
  c.h = (block / vblocks) % p.heads_v;
  c.n = block / (vblocks * p.heads_v);
  if (p.seq_order != nullptr) c.n = ordered_seq(p.seq_order, c.n, p.num_seqs);
  c.hq = c.h / (p.heads_v / p.heads_qk);
  sequence_bounds<IndexT>(p, c.n, c.b, c.bos, c.eos);
  c.col0 = int64_t(c.vb) * block_v;
  return c;
}

// Column `col` (< 16) of (I + L)^-1 for the 16 x 16 strictly lower block L (fp32, row-major, leading
// dimension ld; rows 16-byte aligned; only the strictly lower part is used), by forward substitution in
// registers, reading each row of L four floats per (broadcast) load.
CUTLASS_DEVICE void unit_lower16_inverse_column(const float* L, int ld, int col, float (&x)[16]) {
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    float acc = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (4 * q >= r) continue;
      const float4 l4 = *reinterpret_cast<const float4*>(L + r * ld + 4 * q);
      acc += l4.x * x[4 * q];
      if (4 * q + 1 < r) acc += l4.y * x[4 * q + 1];
      if (4 * q + 2 < r) acc += l4.z * x[4 * q + 2];
      if (4 * q + 3 < r) acc += l4.w * x[4 * q + 3];
    }
    x[r] = r == col ? 1.f : (r < col ? 0.f : -acc);
  }
}

// Tail CTA `tail` of `tails`: zero every row of o past the last sequence
// (varlen with T > cu_seqlens[-1]), 16 bytes per store.
template <typename T, typename IndexT>
CUTLASS_DEVICE void zero_rows_past_end(const flashqla_gdn_fwd_params_t& p, int64_t tail, int tails, int tid,
                                       int threads) {
  int64_t b, bos, end;
  sequence_bounds<IndexT>(p, p.num_seqs - 1, b, bos, end);
  const int64_t vec_per_row = p.head_dim_v / 8;
  const int64_t total = (p.seqlen - end) * p.heads_v * vec_per_row;
  const uint4 zero{0u, 0u, 0u, 0u};  // (make_uint4 here compiled to two 8-byte stores once other code used it)
  for (int64_t i = tail * threads + tid; i < total; i += int64_t(tails) * threads) {
    const int64_t t = end + i / (p.heads_v * vec_per_row);
    const int64_t h = (i / vec_per_row) % p.heads_v, c = i % vec_per_row;
    *reinterpret_cast<uint4*>(static_cast<T*>(p.o) + t * p.o_stride_time + h * p.o_stride_head + c * 8) = zero;
  }
}

using GdnFwdKernel = void (*)(flashqla_gdn_fwd_params_t);

// Launches one CTA per (sequence, value head, V block) plus, for packed batches, the tail CTAs; the
// int64 instantiation reads int64 cu_seqlens.
inline cudaError_t launch_fwd(const flashqla_gdn_fwd_params_t& p, GdnFwdKernel k32, GdnFwdKernel k64, int vblocks,
                              int threads, size_t smem, cudaStream_t stream) {
  const int64_t blocks = p.num_seqs * p.heads_v * vblocks + (p.cu_seqlens != nullptr ? kTailBlocks : 0);
  if (blocks == 0) return cudaSuccess;
  const GdnFwdKernel kernel = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64 ? k64 : k32;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashqla
