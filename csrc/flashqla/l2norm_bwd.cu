// The backward of the in-kernel l2norm of q and k (use_qk_l2norm_in_kernel): from the gradient dy with respect to
// the normalised rows y = x rstd, rstd = 1 / sqrt(sum x^2 + 1e-6) (the forward's), the gradient with respect to
// the raw rows, rstd (dy - y <y, dy>), in x's dtype. One pass over the rows, one warp a row (four values a lane,
// sums by a fixed butterfly: deterministic): it reads x (16-bit) and dy (fp32) once and writes the result once,
// where the PyTorch form it replaces made eleven passes over fp32 tensors of the rows' size. Rows past the last
// packed sequence (cu_seqlens) are written as zeros, whatever x holds there.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "kernels.h"
#include "warp_mma.cuh"  // pack2, unpack2

namespace flashqla {
namespace {

CUTLASS_DEVICE float warp_allsum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// x_row: the row's first value (8-byte aligned); dy: this lane's four values of dy (4 lane .. 4 lane + 3).
// Returns this lane's four results, packed.
template <typename T>
CUTLASS_DEVICE uint2 l2norm_bwd_row(const T* x_row, float4 dy, int lane) {
  const uint2 xv = *(reinterpret_cast<const uint2*>(x_row) + lane);
  const float2 x01 = warp::unpack2<T>(xv.x), x23 = warp::unpack2<T>(xv.y);
  const float rstd =
      rsqrtf(warp_allsum(x01.x * x01.x + x01.y * x01.y + x23.x * x23.x + x23.y * x23.y) + kL2NormEps);
  const float y0 = x01.x * rstd, y1 = x01.y * rstd, y2 = x23.x * rstd, y3 = x23.y * rstd;
  const float dot = warp_allsum(y0 * dy.x + y1 * dy.y + y2 * dy.z + y3 * dy.w);
  return make_uint2(warp::pack2<T>(rstd * (dy.x - y0 * dot), rstd * (dy.y - y1 * dot)),
                    warp::pack2<T>(rstd * (dy.z - y2 * dot), rstd * (dy.w - y3 * dot)));
}

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
