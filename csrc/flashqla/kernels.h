// Launchers the C API dispatches to (torch-free). Parameters arrive validated.
#pragma once

#include <cstddef>
#include <cstdlib>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"

namespace flashqla {

// FLASHQLA_FWD_SPLIT=0 runs the fused forward (aux products inside the recurrent kernel); otherwise, the
// default, the chunk-parallel prep kernel and then the recurrent kernel in loader mode. Read at each launch
// (a getenv is far cheaper than a launch), so tests and benchmarks can compare the two in one process.
inline bool fwd_split_mode() {
  const char* e = std::getenv("FLASHQLA_FWD_SPLIT");
  return !(e != nullptr && e[0] == '0');
}
// Chunks of all sequences, bounded from the shapes alone (cu_seqlens is not read): every sequence adds at most
// one partial 64-token chunk to ceil(total tokens / 64). Chunk-indexed buffers (chunk states, dh) are sized
// with it on the host (flashqla_gdn_chunk_bound) and the kernels guard their writes and size their grids with
// it: one definition for both, so they cannot disagree.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline int64_t chunk_bound(const flashqla_gdn_fwd_params_t& p) {
  if (p.batch < 0 || p.seqlen < 0) return 0;
  const int64_t per = (p.seqlen + 63) / 64;
  return p.cu_seqlens == nullptr ? p.batch * per : per + (p.num_seqs > 0 ? p.num_seqs : 0);
}
// Workspace of the prep kernels: `cols` 16-bit values per token row per value head (forward split: X 128 +
// W 64; backward: W' 128 + U 128).
constexpr int kFwdPrepCols = 128 + 64;
constexpr int kBwdPrepCols = 128 + 128;
inline size_t prep_workspace_bytes(const flashqla_gdn_fwd_params_t& p, int cols) {
  if (p.batch <= 0 || p.seqlen <= 0 || p.heads_v <= 0) return 0;
  return static_cast<size_t>(p.batch) * static_cast<size_t>(p.seqlen) * static_cast<size_t>(p.heads_v) *
         static_cast<size_t>(cols) * 2;
}
// After the forward's X and W, optionally: each chunk's gates (fp32 gamma and decay, 2 x 64 a chunk and value
// head) for the prep kernel to hand the chain (gates_from_prep).
inline size_t fwd_gate_workspace_bytes(const flashqla_gdn_fwd_params_t& p) {
  if (prep_workspace_bytes(p, kFwdPrepCols) == 0) return 0;
  return static_cast<size_t>(chunk_bound(p)) * static_cast<size_t>(p.heads_v) * 2 * 64 * sizeof(float);
}

cudaError_t launch_chunk_local_cumsum(const flashqla_chunk_cumsum_params_t& p, cudaStream_t stream);
// the l2norm backward (l2norm_bwd.cu)
cudaError_t launch_l2norm_bwd(const flashqla_l2norm_bwd_params_t& p, cudaStream_t stream);
// v2, warp-specialised with the state chain in registers (gdn_fwd_mma.cuh): the default
// The merges of exact parallelism (gdn_fwd_mma.cuh, state_role's kMerge): checkpoints (fp32, gdn_fwd_merge_bytes);
// the source (the summaries' B pass, flashqla_gdn_fwd_cp_summaries_merge_source) also writes its chunk states into
// states (the backward's states merge) or its O into p.o (the forward's); the merging run (flashqla_gdn_fwd_merge)
// takes final, the source's final states, where it merges
struct ChainMerge {
  void* states = nullptr;
  float* checkpoints = nullptr;
  const float* final = nullptr;
};
// merge.checkpoints: p is a merging run (the state recompute, or the last pass with o)
cudaError_t launch_gdn_fwd_mma_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream, ChainMerge merge = {});
cudaError_t launch_gdn_fwd_mma_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream, ChainMerge merge = {});
// exact parallelism's two summaries passes after one prep (flashqla_gdn_fwd_cp_summaries): p the B pass, pt the
// transition pass (p but for v, initial_state and final_state); merge.checkpoints: the B pass is a merge's source
cudaError_t launch_gdn_fwd_summaries_bf16(const flashqla_gdn_fwd_params_t& p, const flashqla_gdn_fwd_params_t& pt,
                                          cudaStream_t stream, ChainMerge merge = {});
cudaError_t launch_gdn_fwd_summaries_fp16(const flashqla_gdn_fwd_params_t& p, const flashqla_gdn_fwd_params_t& pt,
                                          cudaStream_t stream, ChainMerge merge = {});
// a merging run p's checkpoint bytes, or 0 where its chain would not merge (gdn_fwd_mma.cuh)
size_t gdn_fwd_merge_bytes(const flashqla_gdn_fwd_params_t& p);
// v1 (gdn_fwd_simple.cuh): the correctness baseline, FLASHQLA_FWD_KERNEL=simple
cudaError_t launch_gdn_fwd_simple_bf16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
cudaError_t launch_gdn_fwd_simple_fp16(const flashqla_gdn_fwd_params_t& p, cudaStream_t stream);
// backward, the reverse state-gradient chain (gdn_bwd_dh.cuh); p.v = dO, p.initial_state = dht, p.final_state = dh0;
// a: the chunk-local inverse rows (flashqla_gdn_bwd_dh_params_t::a) or NULL; merge: the run's part in a merging
// pair, if any: the source run (flashqla_gdn_bwd_dh_merge_source) or the merging one (other_dh0: the source's dh0,
// flashqla_gdn_bwd_dh_merge)
struct DhMerge {
  bool source = false;
  const float* other_dh0 = nullptr;
};
cudaError_t launch_gdn_bwd_dh_bf16(const flashqla_gdn_fwd_params_t& p, float* dh, float* a, DhMerge merge,
                                   cudaStream_t stream);
cudaError_t launch_gdn_bwd_dh_fp16(const flashqla_gdn_fwd_params_t& p, float* dh, float* a, DhMerge merge,
                                   cudaStream_t stream);
// its chunk-parallel prep alone (flashqla_gdn_bwd_prep): W', U into p.workspace, a, and the state recompute's X
// into states_x unless NULL, with it the chunks' gates into states_gates unless NULL
cudaError_t launch_gdn_bwd_prep_bf16(const flashqla_gdn_fwd_params_t& p, float* a, void* states_x, float* states_gates,
                                     cudaStream_t stream);
cudaError_t launch_gdn_bwd_prep_fp16(const flashqla_gdn_fwd_params_t& p, float* a, void* states_x, float* states_gates,
                                     cudaStream_t stream);
// backward, the chunk-parallel gradient step (gdn_bwd_grad.cuh)
cudaError_t launch_gdn_bwd_grad_bf16(const flashqla_gdn_bwd_grad_params_t& p, cudaStream_t stream);
cudaError_t launch_gdn_bwd_grad_fp16(const flashqla_gdn_bwd_grad_params_t& p, cudaStream_t stream);

// exact context parallelism's scan over segment summaries (cp_scan.cu)
cudaError_t launch_gdn_cp_scan(const flashqla_gdn_cp_scan_params_t& p, cudaStream_t stream);

}  // namespace flashqla
