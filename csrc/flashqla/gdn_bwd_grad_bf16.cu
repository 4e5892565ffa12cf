// One instantiation per file so builds parallelise.
#include "gdn_bwd_grad.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_bwd_grad_bf16(const flashqla_gdn_bwd_grad_params_t& p, cudaStream_t stream) {
  using T = __nv_bfloat16;
  const gdn_bwd_grad::GradOut<T> out{static_cast<const T*>(p.dout), p.dout_stride_batch, p.dout_stride_time,
                                     p.dout_stride_head, p.states, p.dh, p.dq, p.dk, static_cast<T*>(p.dv), p.dg,
                                     p.dbeta};
  return gdn_bwd_grad::launch<T>(p.fwd, out, stream);
}
}  // namespace flashqla
