// The forward's exact context parallelism (flashqla/_cp.py, gdn-algorithm.md section 3) as one op: the two
// summaries-only passes, the scan over each sequence's segments and the last pass, issued from C++ so that an
// eager call pays one Python-to-dispatcher crossing instead of one per step (a CP call's host time was about
// its GPU time on the short rows). The passes and the scan go through the dispatcher
// (flashqla::chunk_gdn_fwd_pass, flashqla::chunk_gdn_cp_scan), so the op runs wherever those have an
// implementation (the CPU reference in the CPU tests). Python keeps the
// planning and the caches of the plan's device tensors and constants, and passes them in.
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/index_select.h>
#include <torch/library.h>

// The same steps with the merge (ops.cpp): o and each segment's final states, or nullopt where it does not run
std::optional<std::tuple<at::Tensor, at::Tensor>> chunk_gdn_cp_fwd_merged(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    double scale, const std::optional<at::Tensor>& initial_state, const at::Tensor& seg_cu, const at::Tensor& last,
    bool use_qk_l2norm, at::Tensor& workspace, const at::Tensor& eye);

namespace {

using PassFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, double,
                                                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                                  bool, at::Tensor&, bool, bool, bool);

using SummariesFn = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                                                       bool, at::Tensor&, const at::Tensor&);

using ScanFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, bool);

// seg_cu: the segments' cu_seqlens; last: each sequence's last segment (int64, _cp.device_plan); single_last >= 0:
// one sequence (its last segment: the final state is a slice then), else -1; eye [segments, H_v, K, K]: the
// transition pass's initial states; workspace: the passes' shared chunk products (and the gates:
// fwd_gates_workspace_bytes).
std::tuple<at::Tensor, at::Tensor> chunk_gdn_cp_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const at::Tensor& g, const at::Tensor& beta, double scale,
                                                    const std::optional<at::Tensor>& initial_state,
                                                    const at::Tensor& seg_cu, const at::Tensor& last, int64_t single_last,
                                                    bool use_qk_l2norm, at::Tensor& workspace, const at::Tensor& eye) {
  static auto pass = c10::Dispatcher::singleton().findSchemaOrThrow("flashqla::chunk_gdn_fwd_pass", "").typed<PassFn>();
  static auto summaries = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("flashqla::chunk_gdn_cp_summaries", "")
                               .typed<SummariesFn>();
  static auto scan = c10::Dispatcher::singleton().findSchemaOrThrow("flashqla::chunk_gdn_cp_scan", "").typed<ScanFn>();
  auto out = chunk_gdn_cp_fwd_merged(q, k, v, g, beta, scale, initial_state, seg_cu, last, use_qk_l2norm, workspace,
                                     eye);
  if (!out) {
    const std::optional<at::Tensor> cu(seg_cu);
    // 1. B: each segment's final state from zero (the real v); 2. Phi: from the identity with v = 0 (one op: on the
    // GPU one prep and, where the workspace holds the gates too, one launch for both chains)
    at::Tensor b_end, phi;
    std::tie(b_end, phi) = summaries.call(q, k, v, g, beta, scale, seg_cu, use_qk_l2norm, workspace, eye);
    // 3. the scan along each sequence's segments, S_{i+1} = Phi_i S_i + B_i (one kernel on the GPU)
    at::Tensor init = scan.call(phi, b_end, initial_state, last, false);
    // 4. o and the final states from every segment's true initial state
    out = pass.call(q, k, v, g, beta, scale, std::optional<at::Tensor>(init), cu, use_qk_l2norm, workspace, true, true,
                    false);
  }
  at::Tensor final_states = std::get<1>(*out);
  // each sequence's from its last segment's (a fresh tensor either way: an op's output may not be a view into its own
  // temporaries)
  final_states = single_last >= 0 ? final_states.slice(0, single_last).clone() : at::index_select(final_states, 0, last);
  return {std::get<0>(*out), final_states};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashqla, CompositeExplicitAutograd, m) { m.impl("chunk_gdn_cp_fwd", &chunk_gdn_cp_fwd); }
