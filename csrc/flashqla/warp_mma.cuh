// Warp-level tensor-core and copy primitives for sm_80+ instruction forms
// (mma.sync, ldmatrix, cp.async, named barriers), used where a product's
// operand must come from registers another product just produced: the
// accumulator layout of mma.m16n8k16 is its A-operand layout, so chained
// products stay in registers with no shared-memory round trip.
//
// Fragment layouts (g = lane / 4, t = lane % 4), m16n8k16:
//   A (16 x 16): a[0] = (g, 2t..2t+1) a[1] = (g+8, 2t..) a[2] = (g, 8+2t..) a[3] = (g+8, 8+2t..)
//   B (16 x 8):  b[0] = (k 2t..2t+1, n g)  b[1] = (k 8+2t.., n g)
//   C (16 x 8):  c[0..1] = (g, 2t..2t+1)   c[2..3] = (g+8, 2t..2t+1)
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"

namespace flashqla {
namespace warp {

CUTLASS_DEVICE uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// v as lane 0 has it, with kUniform: a value ptxas can prove warp-uniform. The wgmma chains need it for branches
// near their products: one it cannot prove uniform made it serialise every wgmma of the kernel (C7518).
template <bool kUniform>
CUTLASS_DEVICE bool uniform(bool v) {
  return kUniform ? __shfl_sync(0xffffffffu, v, 0) != 0 : v;
}

// Four 8 x 8 16-bit matrices; lane l supplies the row address of matrix l / 8.
CUTLASS_DEVICE void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
CUTLASS_DEVICE void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// Row/column offsets lane l supplies to ldsm_x4(_trans) so that the four
// registers come out as one operand fragment (see the layouts above).
struct LdsmOffsets {
  int a_row, a_col;    // A, row-major [m][k] (non-trans): one 16 x 16 A fragment
  int at_row, at_col;  // A, stored [k][m] (trans): one 16 x 16 A fragment
  int b_row, b_col;    // B, stored [n][k] (non-trans): two n-tiles (regs 0-1, 2-3) of one k16 step
  int bt_row, bt_col;  // B, stored [k][n] (trans): two n-tiles of one k16 step
  CUTLASS_DEVICE explicit LdsmOffsets(int lane) {
    const int r8 = lane & 7, m1 = (lane >> 3) & 1, m2 = lane >> 4;
    a_row = r8 + 8 * m1;  a_col = 8 * m2;
    at_row = r8 + 8 * m2; at_col = 8 * m1;
    b_row = r8 + 8 * m2;  b_col = 8 * m1;
    bt_row = r8 + 8 * m1; bt_col = 8 * m2;
  }
};

template <typename T> CUTLASS_DEVICE uint32_t pack2(float lo, float hi);
template <> CUTLASS_DEVICE uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> CUTLASS_DEVICE uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <typename T> CUTLASS_DEVICE float2 unpack2(uint32_t v);
template <> CUTLASS_DEVICE float2 unpack2<__nv_bfloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
template <> CUTLASS_DEVICE float2 unpack2<__half>(uint32_t v) { return __half22float2(*reinterpret_cast<__half2*>(&v)); }
// (x0, x1) as a packed pair plus the packed pair of what that rounding lost: an operand split this way
// makes two mma's product as exact as ~16 mantissa bits (used on the state chains' fp32 operands)
template <typename T> CUTLASS_DEVICE void split_hi_lo(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack2<T>(x0, x1);
  const float2 r = unpack2<T>(hi);
  lo = pack2<T>(x0 - r.x, x1 - r.y);
}

// The A fragment of one k16 step from the two adjacent 16 x 8 C tiles c0 (k 0-7) and c1 (k 8-15), rounded
// to T: a product's accumulators feed the next product without leaving registers.
template <typename T>
CUTLASS_DEVICE void c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// d += a * b, m16n8k16, fp32 accumulation.
template <typename T> CUTLASS_DEVICE void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> CUTLASS_DEVICE void mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> CUTLASS_DEVICE void mma<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc[2 np], acc[2 np + 1] += a * (the two n-tiles of b).
// Zero a set of mma accumulators.
template <int N>
CUTLASS_DEVICE void zero_acc(float (&acc)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[i][e] = 0.f;
}

template <typename T, int N>
CUTLASS_DEVICE void mma_pair(float (&acc)[N][4], int np, const uint32_t (&a)[4], const uint32_t (&b)[4]) {
  mma<T>(acc[2 * np], a, b[0], b[1]);
  mma<T>(acc[2 * np + 1], a, b[2], b[3]);
}

// Calls f(kk, np, b) for each k16 step kk < KS and pair np < NP of 8-column n-tiles of a B operand in
// shared memory, b being that pair's fragments: B stored [n][k] (kTrans false) or [k][n] (true), leading
// dimension ld elements. The caller's f issues the products, so one B load serves several of them.
template <int KS, int NP, bool kTrans, typename T, typename F>
CUTLASS_DEVICE void for_b_fragments(const T* B, int ld, const LdsmOffsets& o, F&& f) {
#pragma unroll
  for (int kk = 0; kk < KS; ++kk)
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      uint32_t b[4];
      if constexpr (kTrans)
        ldsm_x4_trans(b, B + (16 * kk + o.bt_row) * ld + 16 * np + o.bt_col);
      else
        ldsm_x4(b, B + (16 * np + o.b_row) * ld + 16 * kk + o.b_col);
      f(kk, np, b);
    }
}

// acc (16 rows from m0, NT 8-column tiles from n0) += A B over the k16 steps [ks0, ks1), operands in shared
// memory: A stored [m][k] (kAT false) or [k][m] (true), B stored [n][k] (kBT false) or [k][n] (true),
// leading dimensions in elements.
template <typename T, int NT, bool kAT, bool kBT>
CUTLASS_DEVICE void gemm_rows16(float (&acc)[NT][4], const T* A, int lda, int m0, const T* B, int ldb, int n0,
                                int ks0, int ks1, const LdsmOffsets& ld) {
  static_assert(NT % 2 == 0, "pairs of n-tiles");
  for (int ks = ks0; ks < ks1; ++ks) {
    uint32_t a[4];
    if constexpr (kAT)
      ldsm_x4_trans(a, A + (16 * ks + ld.at_row) * lda + m0 + ld.at_col);
    else
      ldsm_x4(a, A + (m0 + ld.a_row) * lda + 16 * ks + ld.a_col);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      if constexpr (kBT)
        ldsm_x4_trans(b, B + (16 * ks + ld.bt_row) * ldb + n0 + 16 * np + ld.bt_col);
      else
        ldsm_x4(b, B + (n0 + 16 * np + ld.b_row) * ldb + 16 * ks + ld.b_col);
      mma_pair<T>(acc, np, a, b);
    }
  }
}

CUTLASS_DEVICE uint32_t to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// c[nt] += A (16 x 8ks) * B (8ks x 16), nt = the two 8-column halves; fp32
// operands in shared memory (row-major, leading dimensions in floats), tf32
// m16n8k8 products with fp32 accumulation.
CUTLASS_DEVICE void mma16x16_tf32(float (&c)[2][4], const float* A, int lda, const float* B, int ldb, int ks,
                                  int lane) {
  const int g = lane >> 2, t = lane & 3;
  for (int k = 0; k < ks; ++k) {
    const float* a = A + 8 * k;
    const uint32_t af[4] = {to_tf32(a[g * lda + t]), to_tf32(a[(g + 8) * lda + t]), to_tf32(a[g * lda + t + 4]),
                            to_tf32(a[(g + 8) * lda + t + 4])};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float* b = B + 8 * k * ldb + 8 * nt + g;
      const uint32_t b0 = to_tf32(b[t * ldb]), b1 = to_tf32(b[(t + 4) * ldb]);
      asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(c[nt][0]), "+f"(c[nt][1]), "+f"(c[nt][2]), "+f"(c[nt][3])
                   : "r"(af[0]), "r"(af[1]), "r"(af[2]), "r"(af[3]), "r"(b0), "r"(b1));
    }
  }
}

// Stores a 16 x 16 fp32 C fragment pair times `mul` to row-major shared memory.
CUTLASS_DEVICE void store16x16(float* C, int ldc, const float (&c)[2][4], float mul, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    *reinterpret_cast<float2*>(C + g * ldc + 8 * nt + 2 * t) = make_float2(mul * c[nt][0], mul * c[nt][1]);
    *reinterpret_cast<float2*>(C + (g + 8) * ldc + 8 * nt + 2 * t) = make_float2(mul * c[nt][2], mul * c[nt][3]);
  }
}

// Stores NT consecutive 16 x 8 C tiles (a 16 x 8NT block) rounded to T into row-major shared memory at
// `dst` (leading dimension ld elements), two elements per 32-bit store.
template <typename T, int NT>
CUTLASS_DEVICE void store_c_tiles(T* dst, int ld, const float (&c)[NT][4], int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    *reinterpret_cast<uint32_t*>(dst + g * ld + 8 * nt + 2 * t) = pack2<T>(c[nt][0], c[nt][1]);
    *reinterpret_cast<uint32_t*>(dst + (g + 8) * ld + 8 * nt + 2 * t) = pack2<T>(c[nt][2], c[nt][3]);
  }
}

// Four 8x8 b16 matrices from C-fragment pairs (r[j]: row lane / 4, columns 2 (lane % 4), +1 of matrix j), stored
// transposed: lane l gives the address of row l % 8 of matrix l / 8 as stored (= column l % 8 of the fragment), a
// 16-byte row of 8 values.
CUTLASS_DEVICE void stsm_x4_trans(void* row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row_addr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// The same four matrices stored as they are (not transposed): lane l gives the address of row l % 8 of matrix l / 8;
// with the mma A-fragment order (a0..a3) and lane l at row l % 16, column 8 (l / 16) of a 16 x 16 block, the
// block is stored as ldsm_x4 reads it back.
CUTLASS_DEVICE void stsm_x4(void* row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row_addr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// 16-byte global -> shared copy; pred false fills the destination with zeros.
CUTLASS_DEVICE void cp_async_16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(pred ? 16 : 0));
}
CUTLASS_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Bulk copies shared -> global (the async proxy; no registers, no load/store-unit instructions per element):
// bytes a multiple of 16, both addresses 16-byte aligned. The source must have been made visible to the async
// proxy (fence.proxy.async after the shared-memory writes, then a barrier when other threads wrote it), and
// stays in use until bulk_wait_read() by the issuing thread.
CUTLASS_DEVICE void bulk_store(void* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst), "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
CUTLASS_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// this thread's bulk copies have read their sources (the shared memory may be rewritten), all but its
// kPending most recent commit groups
template <int kPending = 0>
CUTLASS_DEVICE void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// this thread's bulk copies are complete (their global writes performed)
CUTLASS_DEVICE void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
CUTLASS_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Named barriers (ids 1-15; 0 is __syncthreads). The memory clobber keeps the
// compiler from moving shared-memory accesses across them.
CUTLASS_DEVICE void bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The non-aligned form, for a barrier that warps reach from different instructions (PTX: bar.sync is
// barrier.sync.aligned, which promises that every participating thread of the CTA executes the same instruction;
// compute-sanitizer's synccheck reports the aligned form synced from two sites, and accepts this one:
// benchmarks/synccheck_probe.cu, NOTES session 31).
CUTLASS_DEVICE void bar_sync_sites(uint32_t id, uint32_t threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
CUTLASS_DEVICE void bar_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// bar.sync of `threads` threads at barrier id that also ANDs their predicates: true on every one of them where pred
// holds on all.
CUTLASS_DEVICE bool bar_red_and(uint32_t id, uint32_t threads, bool pred) {
  uint32_t all;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(all)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}

}  // namespace warp
}  // namespace flashqla
