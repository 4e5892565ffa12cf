// Internal helpers shared by the kernels and the C API (torch-free).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include <cutlass/cutlass.h>

// The kernels use sm_90a-only instructions (wgmma, setmaxnreg). A plain sm_90
// build would compile them to nothing, so refuse any other device target.
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "flashqla kernels must be built for sm_90a: -gencode=arch=compute_90a,code=sm_90a"
#endif

namespace flashqla {

// use_qk_l2norm's epsilon: x / sqrt(sum x^2 + eps), in every kernel that normalises q, k or differentiates that
// (the forward kernels' loaders, the l2norm backward); reference.L2NORM_EPS on the Python side.
constexpr float kL2NormEps = 1e-6f;

// e^x for every gate factor the kernels form (e^G, e^(G_C - G), e^(G_i - G_j)): __expf's ex2 with results under
// 2^-126 (x < -87.3) flushed to zero. Bitwise __expf elsewhere; its non-ftz form spends three more instructions an
// exponential (a compare and two predicated multiplies) on those tiny results, which vanish beside any O(1) term.
// One definition so that every form of a product (the preps, the chains, the backward) rounds alike.
CUTLASS_DEVICE float gate_exp(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x * 1.4426950408889634f));
  return r;
}

// Locates the sequence a flattened token belongs to. Dense batches are
// sequences of equal length; packed batches read cu_seqlens. Values are
// clamped so a malformed cu_seqlens can only produce wrong sequence bounds,
// never an out-of-bounds access.
template <typename IndexT>
struct SeqLocator {
  const IndexT* cu_seqlens;  // nullptr for dense
  int64_t num_seqs;
  int64_t seqlen;            // dense: tokens per sequence
  int64_t total;             // batch * seqlen

  CUTLASS_DEVICE int64_t bound(int64_t n) const {
    int64_t v = static_cast<int64_t>(cu_seqlens[n]);
    return v < 0 ? 0 : (v > total ? total : v);
  }

  // Returns false for a token outside every sequence.
  CUTLASS_DEVICE bool find(int64_t t, int64_t& start, int64_t& end) const {
    if (cu_seqlens == nullptr) {
      start = (t / seqlen) * seqlen;
      end = start + seqlen;
      return true;
    }
    // largest n in [0, num_seqs) with cu[n] <= t (skips zero-length sequences)
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
      int64_t mid = (lo + hi + 1) >> 1;
      if (bound(mid) <= t) lo = mid; else hi = mid - 1;
    }
    start = bound(lo);
    end = bound(lo + 1);
    return start <= t && t < end;
  }
};

}  // namespace flashqla
