// Hopper wgmma helpers (sm_90a): shared-memory matrix descriptors for the
// no-swizzle K-major core-matrix layout and the 128-byte swizzled layout, the two
// register-A (RS) shapes the forward's state chain uses (B K-major or MN-major), the
// shared-A (SS) shape of the prep's Gram products,
// and the fence / commit / wait protocol.
//
// Layout: a K-major tile of n rows and `kt` columns of 16-bit elements is
// stored as 8 x 8 core matrices of 128 contiguous bytes (8 rows of 16 bytes),
// k-direction neighbours 128 bytes apart, n-direction neighbours kt / 8 * 128
// bytes apart. ldmatrix reads the same bytes (each 8 x 8 matrix is one core
// matrix), so the aux warps' mma.sync code and wgmma share the tiles.
#pragma once

#include <cstdint>

#include "common.h"
#include "warp_mma.cuh"

namespace flashqla {
namespace gmma {

// Byte offset of element (n, k) of a K-major tile with `kt` columns.
CUTLASS_HOST_DEVICE constexpr int kmaj_off(int n, int k, int kt) {
  return (n >> 3) * (kt / 8 * 128) + (k >> 3) * 128 + (n & 7) * 16 + (k & 7) * 2;
}
template <int KT, typename T>
CUTLASS_DEVICE T* kmaj(T* base, int n, int k) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(base) + kmaj_off(n, k, KT));
}
template <int KT, typename T>
CUTLASS_DEVICE const T* kmaj(const T* base, int n, int k) {
  return reinterpret_cast<const T*>(reinterpret_cast<const char*>(base) + kmaj_off(n, k, KT));
}

// The first 1024-byte aligned byte of dynamic shared memory (swizzled wgmma tiles need 1024-byte atoms; the
// launches add 1024 bytes of slack). An offset on the array's own pointer, so the compiler still knows the
// storage is shared memory: aligned through uintptr_t it did not, and every access became a generic LD / ST
// (342 in the wgmma prep, 37 in the O-beside chain).
CUTLASS_DEVICE unsigned char* align_smem_1024(unsigned char* smem) {
  const uint32_t s = warp::smem_addr(smem);
  return smem + ((1024u - (s & 1023u)) & 1023u);
}

// Descriptor of a no-swizzle tile: start address, leading byte offset (LBO) and stride byte offset (SBO),
// each >> 4; layout type 0 (no swizzle) and base offset 0.
CUTLASS_DEVICE uint64_t make_desc(const void* smem, int lbo, int sbo) {
  const uint32_t a = warp::smem_addr(smem);
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}
// The K-major operand of one k16 step at column k0 of a tile with `KT` columns. kLboAlongK: the
// leading byte offset is the k-direction core-matrix stride (128 B), the stride byte offset the n-direction
// one; benchmarks/wgmma_chain_probe.cu checks this reading against the hardware (both ways round).
#ifndef FLASHQLA_GMMA_LBO_ALONG_K
#define FLASHQLA_GMMA_LBO_ALONG_K 1
#endif
template <int KT, typename T>
CUTLASS_DEVICE uint64_t kmajor_desc(const T* tile, int k0) {
  constexpr int kAlongK = 128, kAlongN = KT / 8 * 128;
  return FLASHQLA_GMMA_LBO_ALONG_K ? make_desc(kmaj<KT>(tile, 0, k0), kAlongK, kAlongN)
                                   : make_desc(kmaj<KT>(tile, 0, k0), kAlongN, kAlongK);
}

// 128-byte swizzled canonical tiles (CUTLASS's SW128 atoms, the layout the next chain design uses): rows of 64
// 16-bit elements (128 bytes), the 16-byte chunk j of row r stored at chunk j ^ (r % 8), 8-row atoms of 1024
// bytes; the tile 1024-byte aligned, since the hardware applies the XOR to address bits 4-6 from bits 7-9. A
// K-major operand (n rows, k along a row) reads a k16 step at byte 32 (k0 % 64) / 16 of its 64-wide block, with
// the 8-row groups SBO = 1024 bytes apart (LBO unused). An MN-major operand (k rows, n along a row; wgmma's
// transpose-B) reads a k16 step at two 1024-byte atoms per step, with its 64-wide n blocks LBO bytes apart.
CUTLASS_HOST_DEVICE constexpr int sw128_off(int r, int c) {  // byte offset of element (r, c), c < 64
  return r * 128 + (((c >> 3) ^ (r & 7)) << 4) + (c & 7) * 2;
}
CUTLASS_DEVICE uint64_t make_desc_sw128(const void* smem, int lbo, int sbo) {
  return make_desc(smem, lbo, sbo) | (uint64_t(1) << 62);  // layout type 1: 128-byte swizzle
}

CUTLASS_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CUTLASS_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
CUTLASS_DEVICE void wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Generic-proxy shared-memory writes (st.shared, cp.async) -> visible to wgmma (async proxy).
using warp::fence_async_smem;
// Keeps the compiler from moving accumulator reads/writes across fence / wait.
template <int N>
CUTLASS_DEVICE void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D (64 x N, fp32) += A (64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) * B (16 x N,
// K-major in shared memory). Always accumulates (scale-d = 1): zero D first where a product starts.
// imm-trans-b: 0 for a K-major B, 1 for an MN-major one (16-bit types only).
template <int N, typename T, int kTransB>
struct RsOp;
// One specialisation per shape and 16-bit type: the operand list written once per shape, the type's PTX name
// spliced into the instruction string.
#define FLASHQLA_GMMA_RS64(T, PTX) \
template <int kTransB> \
struct RsOp<64, T, kTransB> { \
  static CUTLASS_DEVICE void run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc_b) { \
    asm volatile( \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, %37;\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB)); \
  } \
};
FLASHQLA_GMMA_RS64(__nv_bfloat16, "bf16")
FLASHQLA_GMMA_RS64(__half, "f16")
#undef FLASHQLA_GMMA_RS64
#define FLASHQLA_GMMA_RS128(T, PTX) \
template <int kTransB> \
struct RsOp<128, T, kTransB> { \
  static CUTLASS_DEVICE void run(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) { \
    asm volatile( \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." PTX "." PTX " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, 1, 1, 1, %69;\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB)); \
  } \
};
FLASHQLA_GMMA_RS128(__nv_bfloat16, "bf16")
FLASHQLA_GMMA_RS128(__half, "f16")
#undef FLASHQLA_GMMA_RS128
template <int N, typename T, int kTransB = 0>
CUTLASS_DEVICE void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  RsOp<N, T, kTransB>::run(d, a, desc_b);
}

// D (64 x N, fp32) += A (64 x 16) * B (16 x N), both K-major in shared memory (SS; the prep's Gram products).
template <int N, typename T>
struct SsOp;
#define FLASHQLA_GMMA_SS64(T, PTX) \
template <> \
struct SsOp<64, T> { \
  static CUTLASS_DEVICE void run(float (&d)[32], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile( \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX "." PTX " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, 1, 1, 1, 0, 0;\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(desc_a), "l"(desc_b)); \
  } \
};
FLASHQLA_GMMA_SS64(__nv_bfloat16, "bf16")
FLASHQLA_GMMA_SS64(__half, "f16")
#undef FLASHQLA_GMMA_SS64
template <int N, typename T>
CUTLASS_DEVICE void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
  SsOp<N, T>::run(d, desc_a, desc_b);
}

}  // namespace gmma
}  // namespace flashqla
