// The backward of the in-kernel l2norm of q and k (use_qk_l2norm_in_kernel): from the gradient dy with respect to
// the normalised rows y = x rstd, rstd = 1 / sqrt(sum x^2 + 1e-6) (the forward's), the gradient with respect to
// the raw rows, rstd (dy - y <y, dy>), in x's dtype. One pass over the rows, one warp a row (four values a lane,
// sums by a fixed butterfly: deterministic): it reads x (16-bit) and dy (fp32) once and writes the result once,
// where the PyTorch form it replaces made eleven passes over fp32 tensors of the rows' size. Rows past the last
// packed sequence (cu_seqlens) are written as zeros, whatever x holds there.
#include "common.h"
#include "kernels.h"
#include "l2norm_bwd.cuh"

namespace flashqla {
namespace {

constexpr int kDim = 128;           // values a row (four a lane)
constexpr int kRowsPerBlock = 8;    // one warp a row

template <typename T, typename IndexT>
__global__ void __launch_bounds__(32 * kRowsPerBlock) l2norm_bwd_kernel(const flashqla_l2norm_bwd_params_t p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (threadIdx.x >> 5);
  const int64_t rows = p.batch * p.seqlen * p.heads;
  if (row >= rows) return;
  const int64_t h = row % p.heads, bt = row / p.heads, t = bt % p.seqlen, b = bt / p.seqlen;
  uint2* dst = reinterpret_cast<uint2*>(static_cast<T*>(p.out) + row * kDim) + lane;
  if (p.cu_seqlens != nullptr) {  // packed sequences (batch 1): rows from the last sequence's end on are zeros
    const IndexT* cu = static_cast<const IndexT*>(p.cu_seqlens);
    int64_t end = static_cast<int64_t>(cu[p.num_seqs]);
    end = end < 0 ? 0 : (end > p.seqlen ? p.seqlen : end);
    if (t >= end) {
      *dst = make_uint2(0u, 0u);
      return;
    }
  }
  const T* xr = static_cast<const T*>(p.x) + b * p.x_stride_batch + t * p.x_stride_time + h * p.x_stride_head;
  const float4 dy = *(reinterpret_cast<const float4*>(p.dy + row * kDim) + lane);
  *dst = l2norm_bwd_row<T>(xr, dy, lane);
}

template <typename T>
cudaError_t launch_typed(const flashqla_l2norm_bwd_params_t& p, cudaStream_t stream) {
  const int64_t rows = p.batch * p.seqlen * p.heads;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  auto kernel = p.cu_seqlens != nullptr && p.cu_seqlens_dtype == FLASHQLA_INT64 ? l2norm_bwd_kernel<T, int64_t>
                                                                                : l2norm_bwd_kernel<T, int32_t>;
  kernel<<<static_cast<unsigned>(blocks), 32 * kRowsPerBlock, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_l2norm_bwd(const flashqla_l2norm_bwd_params_t& p, cudaStream_t stream) {
  if (p.batch * p.seqlen * p.heads == 0) return cudaSuccess;
  return p.x_dtype == FLASHQLA_FLOAT16 ? launch_typed<__half>(p, stream) : launch_typed<__nv_bfloat16>(p, stream);
}

}  // namespace flashqla
