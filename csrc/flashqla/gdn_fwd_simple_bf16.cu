// One instantiation per file so builds parallelise.
#include "gdn_fwd_simple.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_fwd_simple_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream) {
  return gdn_fwd_simple::launch<__nv_bfloat16>(p, stream);
}
}  // namespace flashqla
