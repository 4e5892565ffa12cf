// One instantiation per file so builds parallelise.
#include "gdn_bwd_dh.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_bwd_dh_bf16(const flashqla_gdn_fwd_params_t& p, float* dh, float* a, DhMerge merge,
                                   cudaStream_t stream) {
  return gdn_bwd_dh::launch<__nv_bfloat16>(p, dh, a, stream, merge);
}
cudaError_t launch_gdn_bwd_prep_bf16(const flashqla_gdn_fwd_params_t& p, float* a, void* states_x, float* states_gates,
                                     cudaStream_t stream) {
  return gdn_bwd_dh::launch_prep<__nv_bfloat16>(p, p.workspace, a, states_x, states_gates, stream);
}
}  // namespace flashqla
