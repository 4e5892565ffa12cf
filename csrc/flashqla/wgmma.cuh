// Hopper wgmma helpers (sm_90a): shared-memory matrix descriptors for the
// no-swizzle K-major core-matrix layout and the 128-byte swizzled layout, the register-A (RS) and shared-A (SS)
// shapes m64n32 / n64 (/ n128 RS) with either operand K-major or MN-major, tf32 m64n32 (SS, K-major), and the
// fence / commit / wait protocol.
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

// The bytes from shared address s to the next 1024-byte boundary.
CUTLASS_DEVICE uint32_t pad_to_1024(uint32_t s) { return (1024u - (s & 1023u)) & 1023u; }
// The first 1024-byte aligned byte of dynamic shared memory (swizzled wgmma tiles need 1024-byte atoms; the
// launches add 1024 bytes of slack). An offset on the array's own pointer, so the compiler still knows the
// storage is shared memory: aligned through uintptr_t it did not, and every access became a generic LD / ST
// (342 in the wgmma prep, 37 in the O-beside chain).
CUTLASS_DEVICE unsigned char* align_smem_1024(unsigned char* smem) {
  return smem + pad_to_1024(warp::smem_addr(smem));
}

// A descriptor's fields but the start address (bits 0-13, the shared address >> 4): leading byte offset (LBO,
// bits 16-29) and stride byte offset (SBO, bits 32-45), each >> 4; base offset 0; layout type (bits 62-63) 0,
// no swizzle, or kDescSw128.
CUTLASS_HOST_DEVICE constexpr uint64_t desc_fields(int lbo, int sbo) {
  return (uint64_t(lbo >> 4) << 16) | (uint64_t(sbo >> 4) << 32);
}
constexpr uint64_t kDescSw128 = uint64_t(1) << 62;  // layout type 1: 128-byte swizzle
// Descriptor of a no-swizzle tile at smem.
CUTLASS_DEVICE uint64_t make_desc(const void* smem, int lbo, int sbo) {
  const uint32_t a = warp::smem_addr(smem);
  return uint64_t((a & 0x3FFFF) >> 4) | desc_fields(lbo, sbo);
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
  return make_desc(smem, lbo, sbo) | kDescSw128;
}

CUTLASS_DEVICE void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
CUTLASS_DEVICE void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// all but the kPending most recent commit groups complete
template <int kPending>
CUTLASS_DEVICE void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
CUTLASS_DEVICE void wait_all() { wait<0>(); }
// Generic-proxy shared-memory writes (st.shared, cp.async) -> visible to wgmma (async proxy).
using warp::fence_async_smem;
// Keeps the compiler from moving accumulator reads/writes across fence / wait.
template <int N>
CUTLASS_DEVICE void pin(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// A warpgroup's C tiles (NT of 8 columns, 4 values each) as the flat register list a wgmma names
template <int NT>
CUTLASS_DEVICE float (&flat(float (&acc)[NT][4]))[4 * NT] {
  return reinterpret_cast<float(&)[4 * NT]>(acc);
}
// Runs issue() (wgmma_ss / wgmma_rs calls) as one committed group and waits for it; the accumulators are pinned
// around it so that the compiler moves none of their reads or writes across. RS A fragments are loaded before
// the call: wgmma.fence orders register writes before the products that read them.
template <typename F, int... NTs>
CUTLASS_DEVICE void wg_chain(F&& issue, float (&... acc)[NTs][4]) {
  fence();
  (pin(flat(acc)), ...);
  issue();
  commit();
  wait_all();
  (pin(flat(acc)), ...);
}

// D (64 x N, fp32) += A (64 x 16, registers: the mma.sync A fragment of each warp's 16 rows) * B (16 x N,
// K-major in shared memory). Always accumulates (scale-d = 1): zero D first where a product starts.
// imm-trans-b: 0 for a K-major B, 1 for an MN-major one (16-bit types only).
template <int N, typename T, int kTransB>
struct RsOp;
// The accumulator operands: 16 or 32 fp32 registers from d[o] (an m64n32 or m64n64 tile per warpgroup; m64n128 is
// two of the 32), and the matching PTX register lists.
#define FLASHQLA_GMMA_D16(d, o) "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15])
#define FLASHQLA_GMMA_D32(d, o) "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]), "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7]), "+f"(d[o + 8]), "+f"(d[o + 9]), "+f"(d[o + 10]), "+f"(d[o + 11]), "+f"(d[o + 12]), "+f"(d[o + 13]), "+f"(d[o + 14]), "+f"(d[o + 15]), "+f"(d[o + 16]), "+f"(d[o + 17]), "+f"(d[o + 18]), "+f"(d[o + 19]), "+f"(d[o + 20]), "+f"(d[o + 21]), "+f"(d[o + 22]), "+f"(d[o + 23]), "+f"(d[o + 24]), "+f"(d[o + 25]), "+f"(d[o + 26]), "+f"(d[o + 27]), "+f"(d[o + 28]), "+f"(d[o + 29]), "+f"(d[o + 30]), "+f"(d[o + 31])
#define FLASHQLA_GMMA_R16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define FLASHQLA_GMMA_R32 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define FLASHQLA_GMMA_R64 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// One specialisation per shape N and 16-bit type: the type's PTX name spliced into the instruction string, the
// register list REGS and the A / B / trans-b operand numbers TAIL after the accumulator, its operands after TAIL.
#define FLASHQLA_GMMA_RS(N, T, PTX, REGS, TAIL, ...) \
template <int kTransB> \
struct RsOp<N, T, kTransB> { \
  static CUTLASS_DEVICE void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) { \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " REGS TAIL \
                 : __VA_ARGS__ \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "n"(kTransB)); \
  } \
};
#define FLASHQLA_GMMA_RS_TYPES(T, PTX) \
FLASHQLA_GMMA_RS(32, T, PTX, FLASHQLA_GMMA_R16, ", {%16,%17,%18,%19}, %20, 1, 1, 1, %21;\n", FLASHQLA_GMMA_D16(d, 0)) \
FLASHQLA_GMMA_RS(64, T, PTX, FLASHQLA_GMMA_R32, ", {%32,%33,%34,%35}, %36, 1, 1, 1, %37;\n", FLASHQLA_GMMA_D32(d, 0)) \
FLASHQLA_GMMA_RS(128, T, PTX, FLASHQLA_GMMA_R64, ", {%64,%65,%66,%67}, %68, 1, 1, 1, %69;\n", \
                 FLASHQLA_GMMA_D32(d, 0), FLASHQLA_GMMA_D32(d, 32))
FLASHQLA_GMMA_RS_TYPES(__nv_bfloat16, "bf16")
FLASHQLA_GMMA_RS_TYPES(__half, "f16")
#undef FLASHQLA_GMMA_RS_TYPES
#undef FLASHQLA_GMMA_RS
template <int N, typename T, int kTransB = 0>
CUTLASS_DEVICE void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  RsOp<N, T, kTransB>::run(d, a, desc_b);
}

// D (64 x N, fp32) += A (64 x 16) * B (16 x N), both from shared memory (SS: the prep's Gram products, the
// gradient kernel's products whose A is a swizzled tile). imm-trans-a / -b: 0 K-major, 1 MN-major (16-bit types).
template <int N, typename T, int kTransA = 0, int kTransB = 0>
struct SsOp;
#define FLASHQLA_GMMA_SS(N, T, PTX, REGS, TAIL, ...) \
template <int kTransA, int kTransB> \
struct SsOp<N, T, kTransA, kTransB> { \
  static CUTLASS_DEVICE void run(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) { \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " REGS TAIL \
                 : __VA_ARGS__ \
                 : "l"(desc_a), "l"(desc_b), "n"(kTransA), "n"(kTransB)); \
  } \
};
#define FLASHQLA_GMMA_SS_TYPES(T, PTX) \
FLASHQLA_GMMA_SS(32, T, PTX, FLASHQLA_GMMA_R16, ", %16, %17, 1, 1, 1, %18, %19;\n", FLASHQLA_GMMA_D16(d, 0)) \
FLASHQLA_GMMA_SS(64, T, PTX, FLASHQLA_GMMA_R32, ", %32, %33, 1, 1, 1, %34, %35;\n", FLASHQLA_GMMA_D32(d, 0))
FLASHQLA_GMMA_SS_TYPES(__nv_bfloat16, "bf16")
FLASHQLA_GMMA_SS_TYPES(__half, "f16")
#undef FLASHQLA_GMMA_SS_TYPES
#undef FLASHQLA_GMMA_SS
// D (64 x 32, fp32) += A (64 x 8) * B (8 x 32) in tf32, both K-major in shared memory (tf32 has no MN-major
// operands: a transposed product needs its operand stored transposed). The tensor core reads an operand's top 19
// bits; callers store them rounded (cvt.rna), as mma.sync's tf32 path rounds its registers.
CUTLASS_DEVICE void wgmma_ss_tf32_n32(float (&d)[16], uint64_t desc_a, uint64_t desc_b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n32k8.f32.tf32.tf32 " FLASHQLA_GMMA_R16 ", %16, %17, 1, 1, 1;\n"
               : FLASHQLA_GMMA_D16(d, 0)
               : "l"(desc_a), "l"(desc_b));
}
#undef FLASHQLA_GMMA_D16
#undef FLASHQLA_GMMA_D32
#undef FLASHQLA_GMMA_R16
#undef FLASHQLA_GMMA_R32
#undef FLASHQLA_GMMA_R64
template <int N, typename T, int kTransA = 0, int kTransB = 0>
CUTLASS_DEVICE void wgmma_ss(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b) {
  SsOp<N, T, kTransA, kTransB>::run(d, desc_a, desc_b);
}

}  // namespace gmma
}  // namespace flashqla
