// The forward's exact context parallelism (flashqla/_cp.py, gdn-algorithm.md section 3) as one op: the two
// summaries-only passes, the scan over each sequence's segments and the last pass, issued from C++ so that an
// eager call pays one Python-to-dispatcher crossing instead of one per step (a CP call's host time was about
// its GPU time on the short rows). The passes go through the dispatcher (flashqla::chunk_gdn_fwd_pass), so
// the op runs wherever that op has an implementation (the CPU reference in the CPU tests). Python keeps the
// planning and the caches of the plan's device tensors and constants, and passes them in.
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <torch/library.h>

namespace {

using PassFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, double,
                                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                  bool, at::Tensor&, bool, bool, bool);

// seg_cu: the segments' cu_seqlens; gather / cell / last: the scan grid's indices (_cp.device_plan); ranks:
// the most segments of one sequence; single_last >= 0: one sequence (its last segment; the gathers are
// identities then), else -1; eye [segments, H_v, K, K] and zero_v (v's shape, any strides): the transition
// pass's initial states and values; workspace: the passes' shared chunk products.
std::tuple<at::Tensor, at::Tensor> chunk_gdn_cp_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& g, const at::Tensor& beta, double scale,
                                                    const std::optional<at::Tensor>& initial_state,
                                                    const at::Tensor& seg_cu, const at::Tensor& gather,
                                                    const at::Tensor& cell, const at::Tensor& last, int64_t ranks,
                                                    int64_t single_last, bool use_qk_l2norm, at::Tensor& workspace,
                                                    const at::Tensor& eye, const at::Tensor& zero_v) {
  static auto pass = c10::Dispatcher::singleton().findSchemaOrThrow("flashqla::chunk_gdn_fwd_pass", "").typed<PassFn>();
  const std::optional<at::Tensor> cu(seg_cu);
  // 1. B: each segment's final state from zero (the real v); 2. Phi: from the identity with v = 0
  auto b_end = std::get<1>(pass.call(q, k, v, g, beta, scale, std::nullopt, cu, use_qk_l2norm, workspace, false, false,
                                     false));
  auto phi = std::get<1>(pass.call(q, k, zero_v, g, beta, scale, std::optional<at::Tensor>(eye), cu, use_qk_l2norm,
                                   workspace, true, false, true));
  // 3. the scan, S_{r+1} = Phi_r S_r + B_r, rank by rank on the [ranks, sequences] grid
  const bool single = single_last >= 0;
  const int64_t N = last.size(0), H = v.size(2), K = k.size(3), V = v.size(3);
  at::Tensor grid = at::empty({ranks, N * H, K, V}, b_end.options());
  if (initial_state.has_value())
    grid[0].copy_(initial_state->reshape({N * H, K, V}));
  else
    grid[0].zero_();
  at::Tensor phi_g = (single ? phi : at::index_select(phi, 0, gather)).view({ranks, N * H, K, K});
  at::Tensor b_g = (single ? b_end : at::index_select(b_end, 0, gather)).view({ranks, N * H, K, V});
  for (int64_t r = 0; r + 1 < ranks; ++r) {
    at::Tensor next = grid[r + 1];
    at::baddbmm_out(next, b_g[r], phi_g[r], grid[r]);
  }
  at::Tensor init = grid.view({ranks * N, H, K, V});
  if (!single) init = at::index_select(init, 0, cell);
  // 4. o and the final states from every segment's true initial state
  auto out = pass.call(q, k, v, g, beta, scale, std::optional<at::Tensor>(init), cu, use_qk_l2norm, workspace, true,
                       true, false);
  at::Tensor final_states = std::get<1>(out);
  // (a fresh tensor either way: an op's output may not be a view into its own temporaries)
  final_states = single ? final_states.slice(0, single_last).clone() : at::index_select(final_states, 0, last);
  return {std::get<0>(out), final_states};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashqla, CompositeExplicitAutograd, m) { m.impl("chunk_gdn_cp_fwd", &chunk_gdn_cp_fwd); }
