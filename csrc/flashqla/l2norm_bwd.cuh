// The l2norm backward of one 128-value row by one warp (four values a lane): from dy, the gradient with respect
// to the normalised row y = x rstd, rstd = 1 / sqrt(sum x^2 + 1e-6) (the forward's l2norm), the gradient with
// respect to x, rstd (dy - y <y, dy>), in fp32, packed into x's 16-bit type. Sums by a fixed butterfly
// (deterministic). Shared by the standalone kernel (l2norm_bwd.cu) and the gradient kernel's last phase, which
// therefore agree bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.h"
#include "warp_mma.cuh"  // pack2, unpack2

namespace flashqla {

constexpr float kL2NormEps = 1e-6f;  // the forward's (gdn_fwd_mma.cuh's l2norm, reference.L2NORM_EPS)

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

}  // namespace flashqla
