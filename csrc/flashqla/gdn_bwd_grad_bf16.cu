// One instantiation per file so builds parallelise.
#include "gdn_bwd_grad.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_bwd_grad_bf16(const flashqla_gdn_bwd_grad_params_t& p, cudaStream_t stream) {
  return gdn_bwd_grad::launch<__nv_bfloat16>(p, stream);
}
}  // namespace flashqla
