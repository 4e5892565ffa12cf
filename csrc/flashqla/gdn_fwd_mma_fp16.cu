// One instantiation per file so builds parallelise.
#include "gdn_fwd_mma.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_fwd_mma_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream, ChainMerge merge) {
  return gdn_fwd_mma::launch<__half>(p, stream, nullptr, nullptr, merge.checkpoints, merge.final);
}
cudaError_t launch_gdn_fwd_summaries_fp16(const flashqla_gdn_fwd_params_t& p, const flashqla_gdn_fwd_params_t& pt,
                                          cudaStream_t stream, ChainMerge merge) {
  return gdn_fwd_mma::launch<__half>(p, stream, &pt, merge.states, merge.checkpoints);
}
}  // namespace flashqla
