// One instantiation per file so builds parallelise.
#include "gdn_fwd_simple.cuh"
#include "kernels.h"

namespace flashqla {
cudaError_t launch_gdn_fwd_simple_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream) {
  return gdn_fwd_simple::launch<__half>(p, stream);
}
}  // namespace flashqla
