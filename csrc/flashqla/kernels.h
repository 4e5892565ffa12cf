// Launchers the C API dispatches to (torch-free). Parameters arrive validated.
#pragma once

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"

namespace flashqla {

cudaError_t launch_chunk_local_cumsum(const flashqla_chunk_cumsum_params_t& p, cudaStream_t stream);
// v2, warp-specialised with the state chain in registers (gdn_fwd_mma.cuh): the default
cudaError_t launch_gdn_fwd_mma_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
cudaError_t launch_gdn_fwd_mma_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
// v1 (gdn_fwd_simple.cuh): the correctness baseline, FLASHQLA_FWD_KERNEL=simple
cudaError_t launch_gdn_fwd_simple_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
cudaError_t launch_gdn_fwd_simple_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
// backward, the reverse state-gradient chain (gdn_bwd_dh.cuh); p.v = dO, p.initial_state = dht, p.final_state = dh0
cudaError_t launch_gdn_bwd_dh_bf16(const flashqla_gdn_fwd_params_t& p, float* dh, cudaStream_t stream);
cudaError_t launch_gdn_bwd_dh_fp16(const flashqla_gdn_fwd_params_t& p, float* dh, cudaStream_t stream);

}  // namespace flashqla
