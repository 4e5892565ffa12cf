// TMA (cp.async.bulk.tensor) loads of q/k tiles for the forward's prep kernel: the tensor maps (host) and the
// mbarrier and copy instructions (device). Torch-free. A map describes one [batch, seqlen, heads, 128] q or k
// tensor in 64 x 64 boxes (64 tokens x 64 columns of one head) with the 128-byte swizzle, which puts every byte
// where gmma::sw128_off does (benchmarks/tma_load_probe.cu checked it byte for byte on the H200). Rows past the
// tensor's end arrive as zeros; rows past a packed sequence's end hold the next sequence's tokens, which the
// caller zeroes.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstdint>

#include "common.h"
#include "kernels.h"
#include "warp_mma.cuh"

namespace flashqla {
namespace tma {

// The prep kernel's maps (a kernel parameter: unused by the prep forms that load by cp.async): K and Q, and X
// ([rows, heads_v, 128] in 64 x 64 boxes, as ChainMaps' x) and W ([rows, heads_v, 64], as ChainMaps' w) for its
// TMA stores.
struct QkMaps {
  CUtensorMap k;
  CUtensorMap q;
  CUtensorMap x;
  CUtensorMap w;
};
// The O-beside chain's (gdn_fwd_mma_kernel; a parameter of every form, read by its TMA instantiation only): K and
// Q as QkMaps, the prep's X [rows, heads_v, 128] and W [rows, heads_v, 64] in 64 x 64 boxes (64 rows x 64
// columns of one head), and V ([batch, seqlen, heads_v, 128], as K).
struct ChainMaps {
  CUtensorMap k;
  CUtensorMap q;
  CUtensorMap x;
  CUtensorMap w;
  CUtensorMap v;
  CUtensorMap states;  // the state recompute's chunk states (encode_state_rows), for its TMA stores
  CUtensorMap o;       // the paired chain's O (encode_o), for its TMA stores where o_tma
  int o_tma;
};

CUTLASS_DEVICE void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(warp::smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");  // (visible to the async proxy)
}
CUTLASS_DEVICE void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(warp::smem_addr(bar)), "r"(bytes)
               : "memory");
}
CUTLASS_DEVICE void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}\n" ::"r"(
          warp::smem_addr(bar)),
      "r"(phase)
      : "memory");
}
// One 64 x 64 box at (column c0, head, token t, batch b) into dst (1024-byte aligned), completing on bar.
CUTLASS_DEVICE void load_box(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int head, int t, int b) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          warp::smem_addr(dst)),
      "l"(map), "r"(warp::smem_addr(bar)), "r"(c0), "r"(head), "r"(t), "r"(b)
      : "memory");
}

// One box of a 2D map (as encode_state_rows': 128 rows x 128 bytes) at (column c0, row) into dst (1024-byte aligned),
// on bar.
CUTLASS_DEVICE void load_box2(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int row) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::"r"(
          warp::smem_addr(dst)),
      "l"(map), "r"(warp::smem_addr(bar)), "r"(c0), "r"(row)
      : "memory");
}

// One 64 x 64 box from src (1024-byte aligned, as load_box3 leaves it) to (column c0, head, row) of a
// [rows, heads, cols] map, in the issuing thread's bulk group (bulk_commit, then bulk_wait_read before src changes).
CUTLASS_DEVICE void store_box3(const CUtensorMap* map, const void* src, int c0, int head, int row) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(map),
               "r"(warp::smem_addr(src)), "r"(c0), "r"(head), "r"(row)
               : "memory");
}

// One box of a 4-D map (as encode_o's) from src (aligned to its swizzle's span) to (column c0, head, token t,
// batch b), in the issuing thread's bulk group.
CUTLASS_DEVICE void store_box4(const CUtensorMap* map, const void* src, int c0, int head, int t, int b) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(map),
               "r"(warp::smem_addr(src)), "r"(c0), "r"(head), "r"(t), "r"(b)
               : "memory");
}

// One box of a state-rows map (encode_state_rows: 128 K rows x 128 bytes of V) from src (1024-byte aligned, in the
// map's 128-byte swizzle) to (V column c0, row) of the [rows, 128] buffer, in the issuing thread's bulk group.
CUTLASS_DEVICE void store_box2(const CUtensorMap* map, const void* src, int c0, int row) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(map),
               "r"(warp::smem_addr(src)), "r"(c0), "r"(row)
               : "memory");
}

// A contiguous run of bytes (a multiple of 16, both addresses 16-byte aligned) from global into shared memory,
// completing on bar (no tensor map: for tiles stored contiguously, the gradient kernel's state slots)
CUTLASS_DEVICE void load_bulk(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   warp::smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(warp::smem_addr(bar))
               : "memory");
}

// One 64 x 64 box at (column c0, head, row) of a [rows, heads, cols] map into dst (1024-byte aligned), on bar.
CUTLASS_DEVICE void load_box3(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int head, int row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(
          warp::smem_addr(dst)),
      "l"(map), "r"(warp::smem_addr(bar)), "r"(c0), "r"(head), "r"(row)
      : "memory");
}

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link to libcuda); nullptr if unavailable.
inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A tiled map of rank <= 4 with unit element strides (dims and box innermost first, byte strides of dims
// 1..rank-1), the 128-byte swizzle unless told; false where the driver entry point is missing or refuses it.
inline bool encode_tiled(CUtensorMap& map, const void* base, CUtensorMapDataType dtype, cuuint32_t rank,
                         const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                         CUtensorMapL2promotion l2, CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  const PFN_cuTensorMapEncodeTiled_v12000 enc = encode_fn();
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  return enc != nullptr && enc(&map, dtype, rank, const_cast<void*>(base), dims, strides, box, estr,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, l2,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

inline CUtensorMapDataType map_dtype16(flashqla_dtype_t dtype) {
  return dtype == FLASHQLA_FLOAT16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A 16-bit map of rank 3 or 4 in 64 x 1 x 64 (x 1) boxes (encode_tiled); false where the driver refuses it.
inline bool encode_boxes(CUtensorMap& map, const void* base, flashqla_dtype_t dtype, cuuint32_t rank,
                         const cuuint64_t* dims, const cuuint64_t* strides) {
  const cuuint32_t box[4] = {64, 1, 64, 1};
  return encode_tiled(map, base, map_dtype16(dtype), rank, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_L2_128B);
}

// A [batch, seqlen, heads, 128] 16-bit tensor with element strides as a 4-D map (128, heads, seqlen, batch) in
// `box` boxes; false where TMA cannot describe it (a base or stride that is not a multiple of 16 bytes, or no
// driver entry point).
inline bool encode_bthc(CUtensorMap& map, const void* base, flashqla_dtype_t dtype, int64_t batch, int64_t seqlen,
                        int64_t heads, int64_t stride_batch, int64_t stride_time, int64_t stride_head,
                        const cuuint32_t (&box)[4], CUtensorMapSwizzle swizzle) {
  const auto ok16 = [](int64_t bytes) { return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t(1) << 40); };
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || !ok16(2 * stride_head) ||
      !ok16(2 * stride_time) || (batch > 1 && !ok16(2 * stride_batch)) || seqlen <= 0 || batch <= 0 ||
      seqlen >= (int64_t(1) << 31) || heads >= (int64_t(1) << 31) || batch >= (int64_t(1) << 31))
    return false;
  const cuuint64_t dims[4] = {128, cuuint64_t(heads), cuuint64_t(seqlen), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {cuuint64_t(2 * stride_head), cuuint64_t(2 * stride_time),
                                 cuuint64_t(2 * (batch > 1 ? stride_batch : seqlen * stride_time))};
  return encode_tiled(map, base, map_dtype16(dtype), 4, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                      swizzle);
}

// The map of a q or k tensor (encode_bthc) in 64 x 1 x 64 x 1 boxes with the 128-byte swizzle.
inline bool encode_qk(CUtensorMap& map, const void* base, flashqla_dtype_t dtype, int64_t batch, int64_t seqlen,
                      int64_t heads, int64_t stride_batch, int64_t stride_time, int64_t stride_head) {
  return encode_bthc(map, base, dtype, batch, seqlen, heads, stride_batch, stride_time, stride_head, {64, 1, 64, 1},
                     CU_TENSOR_MAP_SWIZZLE_128B);
}

// The map of o (encode_bthc) in boxes of 16 columns x 64 tokens, one warp's piece of a chunk's O, with the 32-byte
// swizzle: a 32-byte token row's two 16-byte halves swapped on tokens 4..7 mod 8, as warp_store_o stages them.
inline bool encode_o(CUtensorMap& map, const void* base, flashqla_dtype_t dtype, int64_t batch, int64_t seqlen,
                     int64_t heads, int64_t stride_batch, int64_t stride_time, int64_t stride_head) {
  return encode_bthc(map, base, dtype, batch, seqlen, heads, stride_batch, stride_time, stride_head, {16, 1, 64, 1},
                     CU_TENSOR_MAP_SWIZZLE_32B);
}

// The map of a contiguous [rows, heads, cols] 16-bit buffer (the prep's X or W) in 64 x 64 boxes; false where
// TMA cannot describe it.
inline bool encode_rows(CUtensorMap& map, const void* base, flashqla_dtype_t dtype, int64_t rows, int64_t heads,
                        int64_t cols) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || rows <= 0 || heads <= 0 || cols % 64 != 0 ||
      rows >= (int64_t(1) << 31) || heads >= (int64_t(1) << 31) || 2 * cols * heads >= (int64_t(1) << 40))
    return false;
  const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(2 * cols), cuuint64_t(2 * cols * heads)};
  return encode_boxes(map, base, dtype, 3, dims, strides);
}

// The map of a chain's per-chunk states, [slots, heads_v, 128 K, 128 V] in 16-bit or fp32 elements, as [rows, 128]
// with rows = slots * heads_v * 128, in boxes of 128 rows x 128 bytes with the 128-byte swizzle (64 V columns of a
// 16-bit state, 32 of an fp32 one): a chain CTA's 64-column block of one chunk's state is one box or two. False
// where TMA cannot describe it (row coordinates are 32-bit).
inline bool encode_state_rows(CUtensorMap& map, const void* base, CUtensorMapDataType dtype, int elem_bytes,
                              int64_t rows) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || rows <= 0 || rows >= (int64_t(1) << 31) ||
      (elem_bytes != 2 && elem_bytes != 4))
    return false;
  const cuuint64_t dims[2] = {128, cuuint64_t(rows)};
  const cuuint64_t strides[1] = {cuuint64_t(128 * elem_bytes)};
  const cuuint32_t box[2] = {cuuint32_t(128 / elem_bytes), 128};
  return encode_tiled(map, base, dtype, 2, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

}  // namespace tma
}  // namespace flashqla
