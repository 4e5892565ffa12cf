// One instantiation per file so builds parallelise.
#include "gdn_fwd_mma.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_fwd_mma_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream, ChainMerge merge) {
  return gdn_fwd_mma::launch<__nv_bfloat16>(p, stream, nullptr, nullptr, merge.checkpoints, merge.final);
}
cudaError_t launch_gdn_fwd_summaries_bf16(const flashqla_gdn_fwd_params_t& p, const flashqla_gdn_fwd_params_t& pt,
                                          cudaStream_t stream, ChainMerge merge) {
  return gdn_fwd_mma::launch<__nv_bfloat16>(p, stream, &pt, merge.states, merge.checkpoints);
}
// (dtype-free; defined once, here)
size_t gdn_fwd_merge_bytes(const flashqla_gdn_fwd_params_t& p) { return gdn_fwd_mma::merge_bytes(p); }
}  // namespace flashqla
