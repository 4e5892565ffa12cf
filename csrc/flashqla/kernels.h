// Launchers the C API dispatches to (torch-free). Parameters arrive validated.
#pragma once

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"

namespace flashqla {

cudaError_t launch_chunk_local_cumsum(const flashqla_chunk_cumsum_params_t& p, cudaStream_t stream);
cudaError_t launch_gdn_fwd_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
cudaError_t launch_gdn_fwd_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);

}  // namespace flashqla
