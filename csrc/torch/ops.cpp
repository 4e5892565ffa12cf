// The only torch-facing C++ file: registers the flashqla ops with the PyTorch
// dispatcher (TORCH_LIBRARY) and forwards them to the torch-free C API. Python
// validates arguments first (flashqla/_validate.py); the checks here are a
// backstop that turns any C API failure into a Python exception.
#include <Python.h>

#include <cstdlib>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flashqla/flashqla.h"

namespace {

flashqla_dtype_t to_flashqla_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return FLASHQLA_FLOAT32;
    case at::kBFloat16: return FLASHQLA_BFLOAT16;
    case at::kHalf: return FLASHQLA_FLOAT16;
    case at::kInt: return FLASHQLA_INT32;
    case at::kLong: return FLASHQLA_INT64;
    default: TORCH_CHECK(false, "flashqla: unsupported dtype ", t, " for ", name);
  }
}

void check_status(flashqla_status_t st, const char* op) {
  TORCH_CHECK(st == FLASHQLA_SUCCESS, "flashqla.", op, " failed (", flashqla_status_string(st), "): ",
              flashqla_last_error());
}

void cuda_check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "flashqla.", op, ": ", cudaGetErrorString(err));
}

// cu_seqlens (or none: dense batches) into a parameter struct's cu_seqlens, cu_seqlens_dtype and num_seqs, checked
// against the inputs' device (the value checks are the C API's)
template <typename P>
void set_cu_seqlens(P& p, const std::optional<at::Tensor>& cu_seqlens, const at::Device& device, const char* op,
                    const char* input) {
  if (!cu_seqlens.has_value()) return;
  const at::Tensor& cu = *cu_seqlens;
  TORCH_CHECK(cu.device() == device && cu.dim() == 1 && cu.numel() >= 1 && cu.is_contiguous(), "flashqla.", op,
              ": cu_seqlens must be a contiguous non-empty 1-D tensor on ", input, "'s device");
  p.cu_seqlens = cu.data_ptr();
  p.cu_seqlens_dtype = to_flashqla_dtype(cu.scalar_type(), "cu_seqlens");
  p.num_seqs = cu.numel() - 1;
}

// An environment switch (the FLASHQLA_* knobs): its first character, or `otherwise` where it is unset or empty.
char env_switch(const char* name, char otherwise) {
  const char* e = std::getenv(name);
  return e != nullptr && e[0] != '\0' ? e[0] : otherwise;
}

// Exact parallelism's transition passes' initial states: the identity per segment and value head, [segments, H_v,
// K, K] fp32 (K = V), contiguous on q's device.
void check_eye(const at::Tensor& eye, const at::Tensor& q, int64_t segments, int64_t heads_v, int64_t k,
               const char* op) {
  TORCH_CHECK(eye.device() == q.device() && eye.scalar_type() == at::kFloat && eye.is_contiguous() &&
                  eye.sizes() == at::IntArrayRef({segments, heads_v, k, k}),
              "flashqla.", op, ": eye must be contiguous float32 [segments, H_v, K, K] = [", segments, ", ", heads_v,
              ", ", k, ", ", k, "] on q's device");
}

at::Tensor chunk_local_cumsum_cuda(const at::Tensor& g, int64_t chunk_size, bool reverse, double scale,
                                   const std::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK(g.is_cuda() && g.dim() == 3, "flashqla.chunk_local_cumsum: g must be a CUDA tensor [B, T, H]");
  c10::cuda::CUDAGuard guard(g.device());
  auto out = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  flashqla_chunk_cumsum_params_t p{};
  p.g = g.data_ptr();
  p.g_dtype = to_flashqla_dtype(g.scalar_type(), "g");
  p.g_stride_batch = g.stride(0);
  p.g_stride_time = g.stride(1);
  p.g_stride_head = g.stride(2);
  p.out = out.data_ptr<float>();
  p.batch = g.size(0);
  p.seqlen = g.size(1);
  p.heads = g.size(2);
  set_cu_seqlens(p, cu_seqlens, g.device(), "chunk_local_cumsum", "g");
  p.chunk_size = static_cast<int32_t>(chunk_size);
  p.reverse = reverse ? 1 : 0;
  p.scale = static_cast<float>(scale);
  check_status(flashqla_chunk_local_cumsum(&p, c10::cuda::getCurrentCUDAStream(g.device().index()).stream()),
               "chunk_local_cumsum");
  return out;
}

// The l2norm backward (use_qk_l2norm_in_kernel): x [B, T, H, 128] 16-bit (last dimension contiguous), dy fp32
// of x's shape (the gradient with respect to the normalised rows) -> the gradient with respect to x, in x's dtype;
// rows past cu_seqlens[-1] zeros. See flashqla_l2norm_bwd.
at::Tensor l2norm_bwd_cuda(const at::Tensor& x, const at::Tensor& dy, const std::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.size(3) == 128 && x.stride(3) == 1,
              "flashqla.l2norm_bwd: x must be a CUDA tensor [B, T, H, 128] with a contiguous last dimension");
  TORCH_CHECK(dy.device() == x.device() && dy.scalar_type() == at::kFloat && dy.sizes() == x.sizes(),
              "flashqla.l2norm_bwd: dy must be a float32 tensor of x's shape on x's device");
  c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xv = x.storage_offset() % 4 == 0 && x.stride(0) % 4 == 0 && x.stride(1) % 4 == 0 &&
                                x.stride(2) % 4 == 0 ? x : x.contiguous();
  const at::Tensor dyc = dy.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  flashqla_l2norm_bwd_params_t p{};
  p.x = xv.data_ptr();
  p.x_dtype = to_flashqla_dtype(x.scalar_type(), "x");
  p.x_stride_batch = xv.stride(0);
  p.x_stride_time = xv.stride(1);
  p.x_stride_head = xv.stride(2);
  p.dy = dyc.data_ptr<float>();
  p.out = out.data_ptr();
  p.batch = x.size(0);
  p.seqlen = x.size(1);
  p.heads = x.size(2);
  set_cu_seqlens(p, cu_seqlens, x.device(), "l2norm_bwd", "x");
  check_status(flashqla_l2norm_bwd(&p, c10::cuda::getCurrentCUDAStream(x.device().index()).stream()), "l2norm_bwd");
  return out;
}

// The inputs part of the parameter struct every GDN entry point starts from: q, k, the v-shaped tensor
// (v, or dout for the state-gradient chain), g, beta, shapes, cu_seqlens, scale, use_qk_l2norm.
flashqla_gdn_fwd_params_t input_params(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& g, const at::Tensor& beta, double scale,
                                       const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && g.dim() == 3 && beta.dim() == 3,
              "flashqla.", op, ": expected CUDA q, k, v/dout [B, T, H, D] and g, beta [B, T, H]");
  TORCH_CHECK(q.scalar_type() == v.scalar_type() && k.scalar_type() == v.scalar_type(),
              "flashqla.", op, ": q, k, v/dout must share a dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "flashqla.", op, ": the last dimension of q, k, v/dout must be contiguous");
  flashqla_gdn_fwd_params_t p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.qkv_dtype = to_flashqla_dtype(v.scalar_type(), "v");
  p.q_stride_batch = q.stride(0); p.q_stride_time = q.stride(1); p.q_stride_head = q.stride(2);
  p.k_stride_batch = k.stride(0); p.k_stride_time = k.stride(1); p.k_stride_head = k.stride(2);
  p.v_stride_batch = v.stride(0); p.v_stride_time = v.stride(1); p.v_stride_head = v.stride(2);
  p.g = g.data_ptr();
  p.g_dtype = to_flashqla_dtype(g.scalar_type(), "g");
  p.g_stride_batch = g.stride(0); p.g_stride_time = g.stride(1); p.g_stride_head = g.stride(2);
  p.beta = beta.data_ptr();
  p.beta_dtype = to_flashqla_dtype(beta.scalar_type(), "beta");
  p.beta_stride_batch = beta.stride(0); p.beta_stride_time = beta.stride(1); p.beta_stride_head = beta.stride(2);
  p.batch = q.size(0); p.seqlen = q.size(1); p.heads_qk = q.size(2); p.heads_v = v.size(2);
  p.head_dim_k = q.size(3); p.head_dim_v = v.size(3);
  p.num_seqs = q.size(0);
  set_cu_seqlens(p, cu_seqlens, q.device(), op, "q");
  p.scale = static_cast<float>(scale);
  p.use_qk_l2norm = use_qk_l2norm ? 1 : 0;
  return p;
}

// A caller's workspace for the forward's chunk products (exact parallelism's passes share one), checked.
void use_workspace(flashqla_gdn_fwd_params_t& p, const at::Tensor& ws, const at::Tensor& q, const char* op) {
  const int64_t need = static_cast<int64_t>(flashqla_gdn_fwd_workspace_bytes(&p));
  TORCH_CHECK(ws.is_cuda() && ws.device() == q.device() && ws.is_contiguous() && ws.scalar_type() == at::kByte &&
                  ws.numel() >= need,
              "flashqla.", op, ": workspace must be a contiguous uint8 tensor on q's device of at least ", need, " bytes");
  p.workspace = ws.numel() > 0 ? ws.data_ptr() : nullptr;
  p.workspace_bytes = static_cast<size_t>(ws.numel());
}

// The forward; with_states also writes the state at the start of every chunk (the backward's recompute).
// workspace: the caller's (exact parallelism's passes share one: prep_ready skips recomputing X and W);
// write_o = false: summaries only (o not computed, an empty o returned).
std::tuple<at::Tensor, at::Tensor, at::Tensor> gdn_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       const at::Tensor& g, const at::Tensor& beta, double scale,
                                                       const std::optional<at::Tensor>& initial_state,
                                                       bool output_final_state,
                                                       const std::optional<at::Tensor>& cu_seqlens,
                                                       bool use_qk_l2norm, bool with_states,
                                                       const at::Tensor* workspace = nullptr, bool prep_ready = false,
                                                       bool write_o = true, bool zero_v = false,
                                                       const at::Tensor* seq_order = nullptr, int64_t prep_workers = 0) {
  c10::cuda::CUDAGuard guard(q.device());
  flashqla_gdn_fwd_params_t p = input_params("chunk_gdn_fwd", q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm);
  const int64_t N = p.num_seqs;
  auto o = write_o ? at::empty(v.sizes(), v.options()) : at::empty({0}, v.options());
  at::Tensor final_state = output_final_state
      ? at::empty({N, v.size(2), k.size(3), v.size(3)}, v.options().dtype(at::kFloat))
      : at::empty({0}, v.options().dtype(at::kFloat));
  if (zero_v) p.v = nullptr;  // zero_v: v's shape only, its values taken as 0 (nothing read)
  TORCH_CHECK(!(zero_v && write_o), "flashqla.chunk_gdn_fwd_pass: zero_v needs write_o = false");
  if (write_o) {
    p.o = o.data_ptr();
    p.o_stride_batch = o.stride(0); p.o_stride_time = o.stride(1); p.o_stride_head = o.stride(2);
  }
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->is_contiguous() && initial_state->scalar_type() == at::kFloat,
                "flashqla.chunk_gdn_fwd: initial_state must be contiguous float32");
    p.initial_state = initial_state->data_ptr<float>();
  }
  p.final_state = output_final_state ? final_state.data_ptr<float>() : nullptr;
  // the chunk states in q's dtype (the C API's layout), fp32 only as the empty placeholder
  at::Tensor states = with_states
      ? at::empty({flashqla_gdn_chunk_bound(&p), v.size(2), k.size(3), v.size(3)}, q.options())
      : at::empty({0}, v.options().dtype(at::kFloat));
  p.chunk_states = with_states ? states.data_ptr() : nullptr;
  // workspace from PyTorch's caching allocator (graph pools included), not an allocation inside the call
  const int64_t need = static_cast<int64_t>(flashqla_gdn_fwd_workspace_bytes(&p));
  // (an own workspace also holds the chunks' gates after X and W; a caller's sized for X and W alone keeps the
  // gates in the chain)
  const int64_t gates = static_cast<int64_t>(flashqla_gdn_fwd_gates_workspace_bytes(&p));
  at::Tensor ws = workspace != nullptr ? *workspace : at::empty({need + gates}, v.options().dtype(at::kByte));
  use_workspace(p, ws, q, "chunk_gdn_fwd_pass");
  p.prep_ready = prep_ready ? 1 : 0;
  p.workspace_private = workspace == nullptr ? 1 : 0;  // (our own: no later call reads it)
  // the planner's schedule for a packed batch (flashqla/_cp.py, overlap_plan): a start order and prep workers
  if (seq_order != nullptr) {
    TORCH_CHECK(seq_order->is_cuda() && seq_order->device() == q.device() && seq_order->scalar_type() == at::kInt &&
                    seq_order->dim() == 1 && seq_order->size(0) == N && seq_order->is_contiguous(),
                "flashqla.chunk_gdn_fwd: seq_order must be a contiguous int32 tensor of ", N,
                " sequence indices on q's device");
    p.seq_order = seq_order->data_ptr<int32_t>();
  }
  TORCH_CHECK(prep_workers >= 0 && prep_workers <= 4096, "flashqla.chunk_gdn_fwd: prep_workers must be in [0, 4096], got ",
              prep_workers);
  p.prep_workers = static_cast<int32_t>(prep_workers);
  check_status(flashqla_gdn_fwd(&p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream()), "chunk_gdn_fwd");
  return {o, final_state, states};
}

std::tuple<at::Tensor, at::Tensor> chunk_gdn_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                      const at::Tensor& g, const at::Tensor& beta, double scale,
                                                      const std::optional<at::Tensor>& initial_state,
                                                      bool output_final_state,
                                                      const std::optional<at::Tensor>& cu_seqlens,
                                                      bool use_qk_l2norm, const std::optional<at::Tensor>& seq_order,
                                                      int64_t prep_workers) {
  auto r = gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm, false, nullptr,
                   false, true, false, seq_order.has_value() ? &*seq_order : nullptr, prep_workers);
  return {std::get<0>(r), std::get<1>(r)};
}

// One pass of exact context parallelism (flashqla/_cp.py): the final states, o only when write_o.
std::tuple<at::Tensor, at::Tensor> chunk_gdn_fwd_pass_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& g, const at::Tensor& beta, double scale,
                                                           const std::optional<at::Tensor>& initial_state,
                                                           const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm,
                                                           at::Tensor& workspace, bool prep_ready, bool write_o,
                                                           bool zero_v) {
  auto r = gdn_fwd(q, k, v, g, beta, scale, initial_state, true, cu_seqlens, use_qk_l2norm, false, &workspace,
                   prep_ready, write_o, zero_v);
  return {std::get<0>(r), std::get<1>(r)};
}

// Exact parallelism's two summaries passes after one prep (flashqla_gdn_fwd_cp_summaries): (B, Phi), each
// [segments, H_v, K, V] fp32; eye: the transition pass's initial states (Phi's shape); workspace: as the passes'.
std::tuple<at::Tensor, at::Tensor> chunk_gdn_cp_summaries_cuda(const at::Tensor& q, const at::Tensor& k,
                                                               const at::Tensor& v, const at::Tensor& g,
                                                               const at::Tensor& beta, double scale,
                                                               const at::Tensor& cu_seqlens, bool use_qk_l2norm,
                                                               at::Tensor& workspace, const at::Tensor& eye) {
  c10::cuda::CUDAGuard guard(q.device());
  const std::optional<at::Tensor> cu(cu_seqlens);
  flashqla_gdn_fwd_params_t p = input_params("chunk_gdn_cp_summaries", q, k, v, g, beta, scale, cu, use_qk_l2norm);
  at::Tensor b_end = at::empty({p.num_seqs, v.size(2), k.size(3), v.size(3)}, v.options().dtype(at::kFloat));
  at::Tensor phi = at::empty_like(b_end);
  check_eye(eye, q, p.num_seqs, v.size(2), k.size(3), "chunk_gdn_cp_summaries");
  p.final_state = b_end.data_ptr<float>();
  use_workspace(p, workspace, q, "chunk_gdn_cp_summaries");
  check_status(flashqla_gdn_fwd_cp_summaries(&p, eye.data_ptr<float>(), phi.data_ptr<float>(),
                                             c10::cuda::getCurrentCUDAStream(q.device().index()).stream()),
               "chunk_gdn_cp_summaries");
  return {b_end, phi};
}

// The backward's recompute: the chunk-start states only (summaries mode: no o, no output products).
at::Tensor chunk_gdn_fwd_states_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                     const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
                                     const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm) {
  auto r = gdn_fwd(q, k, v, g, beta, scale, initial_state, false, cu_seqlens, use_qk_l2norm, true, nullptr, false,
                   /*write_o=*/false);
  return std::get<2>(r);
}

// The dS chain's C API params and outputs: dh (fp32 [chunk bound, H_v, K, V]), dh0 ([N, H_v, K, V] or empty),
// a (the inverse's rows [B, T, H_v, 64] or empty); the workspace is the caller's to set.
struct BwdDh {
  flashqla_gdn_bwd_dh_params_t p{};
  at::Tensor dh, dh0, a;
};
BwdDh bwd_dh_setup(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& beta,
                   const at::Tensor& dout, const std::optional<at::Tensor>& dht, double scale,
                   const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, bool output_dh0, bool output_a) {
  BwdDh r;
  flashqla_gdn_bwd_dh_params_t& p = r.p;
  p.fwd = input_params(op, q, k, dout, g, beta, scale, cu_seqlens, use_qk_l2norm);
  p.fwd.v = nullptr;  // the chain reads dout, not v
  const flashqla_gdn_fwd_params_t& f = p.fwd;
  const int64_t N = f.num_seqs;
  p.dout = dout.data_ptr();
  p.dout_stride_batch = dout.stride(0); p.dout_stride_time = dout.stride(1); p.dout_stride_head = dout.stride(2);
  if (dht.has_value()) {
    TORCH_CHECK(dht->is_contiguous() && dht->scalar_type() == at::kFloat, "flashqla.", op,
                ": dht must be contiguous float32");
    p.dht = dht->data_ptr<float>();
  }
  auto fopts = dout.options().dtype(at::kFloat);
  r.dh = at::empty({flashqla_gdn_chunk_bound(&f), f.heads_v, f.head_dim_k, f.head_dim_v}, fopts);
  r.dh0 = output_dh0 ? at::empty({N, f.heads_v, f.head_dim_k, f.head_dim_v}, fopts) : at::empty({0}, fopts);
  p.dh = r.dh.data_ptr<float>();
  p.dh0 = output_dh0 ? r.dh0.data_ptr<float>() : nullptr;
  // the inverse's rows for chunk_gdn_bwd_grad (rows past the sequences are not written)
  r.a = output_a ? at::empty({q.size(0), q.size(1), f.heads_v, 64}, fopts) : at::empty({0}, fopts);
  p.a = output_a && r.a.numel() > 0 ? r.a.data_ptr<float>() : nullptr;
  return r;
}

at::Tensor byte_workspace(size_t bytes, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunk_gdn_bwd_dh_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& beta, const at::Tensor& dout,
    const std::optional<at::Tensor>& dht, double scale, const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm,
    bool output_dh0, bool output_a) {
  c10::cuda::CUDAGuard guard(q.device());
  BwdDh r = bwd_dh_setup("chunk_gdn_bwd_dh", q, k, g, beta, dout, dht, scale, cu_seqlens, use_qk_l2norm, output_dh0,
                         output_a);
  at::Tensor ws = byte_workspace(flashqla_gdn_bwd_dh_workspace_bytes(&r.p), dout);
  r.p.fwd.workspace = ws.numel() > 0 ? ws.data_ptr() : nullptr;
  r.p.fwd.workspace_bytes = static_cast<size_t>(ws.numel());
  check_status(flashqla_gdn_bwd_dh(&r.p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream()),
               "chunk_gdn_bwd_dh");
  return {r.dh, r.dh0, r.a};
}

// A pool stream forked from `main` where it is made and joined back into it by join(), by events (a graph capture
// turns them into edges; destroying an event once recorded and waited on is safe: CUDA releases it when its work
// completes). The events are destroyed on every exit, exceptions included.
struct ForkedStream {
  struct Event {
    cudaEvent_t e = nullptr;
    explicit Event(const char* op) { cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op); }
    ~Event() { if (e != nullptr) cudaEventDestroy(e); }
  };
  c10::cuda::CUDAStream main, side;
  const char* op;
  Event forked, joined;
  ForkedStream(c10::cuda::CUDAStream m, c10::DeviceIndex dev, const char* op_)
      : main(m), side(c10::cuda::getStreamFromPool(false, dev)), op(op_), forked(op_), joined(op_) {
    cuda_check(cudaEventRecord(forked.e, main.stream()), op);
    cuda_check(cudaStreamWaitEvent(side.stream(), forked.e, 0), op);
  }
  void join() {
    cuda_check(cudaEventRecord(joined.e, side.stream()), op);
    cuda_check(cudaStreamWaitEvent(main.stream(), joined.e, 0), op);
  }
};

// Both of the backward's chains from one prep (flashqla_gdn_bwd_prep: the Gram products and the inverse once):
// (states as chunk_gdn_fwd_states, dh, dh0, a as chunk_gdn_bwd_dh). The state recompute runs on a pool stream
// beside the dS chain, forked after the prep and joined before returning (also under CUDA-graph capture), so
// every tensor here is used on the current stream's order only after the join.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_gdn_bwd_chains_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& dout, const std::optional<at::Tensor>& dht, double scale,
    const std::optional<at::Tensor>& initial_state, const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm,
    bool output_dh0, bool output_a) {
  c10::cuda::CUDAGuard guard(q.device());
  const char* op = "chunk_gdn_bwd_chains";
  BwdDh r = bwd_dh_setup(op, q, k, g, beta, dout, dht, scale, cu_seqlens, use_qk_l2norm, output_dh0, output_a);
  flashqla_gdn_fwd_params_t f = input_params(op, q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm);
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->is_contiguous() && initial_state->scalar_type() == at::kFloat,
                "flashqla.", op, ": initial_state must be contiguous float32");
    f.initial_state = initial_state->data_ptr<float>();
  }
  at::Tensor states = at::empty({flashqla_gdn_chunk_bound(&f), v.size(2), k.size(3), v.size(3)}, q.options());
  f.chunk_states = states.data_ptr();
  at::Tensor ws_b = byte_workspace(flashqla_gdn_bwd_dh_workspace_bytes(&r.p), dout);
  r.p.fwd.workspace = ws_b.numel() > 0 ? ws_b.data_ptr() : nullptr;
  r.p.fwd.workspace_bytes = static_cast<size_t>(ws_b.numel());
  // the recompute's X from the same prep; none in the fused forward (FLASHQLA_FWD_SPLIT=0: no workspace)
  at::Tensor ws_f = byte_workspace(flashqla_gdn_fwd_workspace_bytes(&f), dout);
  const bool share = ws_f.numel() > 0;
  f.workspace = share ? ws_f.data_ptr() : nullptr;
  f.workspace_bytes = static_cast<size_t>(ws_f.numel());
  const c10::DeviceIndex dev = q.device().index();
  c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream(dev);
  if (ws_b.numel() > 0) {  // (no token rows: nothing to prepare, both chains only pass dht / h0 through)
    check_status(flashqla_gdn_bwd_prep(&r.p, f.workspace, f.workspace_bytes, main.stream()), op);
    r.p.fwd.prep_ready = 1;
    f.prep_ready = share ? 1 : 0;
  }
  ForkedStream fork(main, dev, op);
  const flashqla_status_t fs = flashqla_gdn_fwd(&f, fork.side.stream());
  const flashqla_status_t ds = fs == FLASHQLA_SUCCESS ? flashqla_gdn_bwd_dh(&r.p, main.stream()) : fs;
  fork.join();  // (also after a failed launch)
  check_status(fs, op);
  check_status(ds, op);
  return {states, r.dh, r.dh0, r.a};
}

at::Tensor chunk_gdn_cp_scan_cuda(const at::Tensor& phi, const at::Tensor& b, const std::optional<at::Tensor>& initial_state,
                                  const at::Tensor& last, bool reverse);

// Both of the backward's chains through exact parallelism's segments (flashqla/_cp.py, backward_chains; the
// returns of chunk_gdn_bwd_chains) from one prep, as chunk_gdn_bwd_chains shares it: the Gram products, the inverse,
// the dS chain's W' and U and the recompute's X once for every pass. seg_cu: the segments' cu_seqlens; last: each
// sequence's last segment, first: each sequence's first segment (int64, _cp.device_plan and _cp._first_plan);
// eye [segments, H_v, K, K] fp32.
// On a side stream, the states: the two summaries passes (B from zero, the transition Phi from eye with v = 0), the
// scan from initial_state, the states pass. On the current stream, the dS chain, affine backwards too
// (dS_start = L dS_end + B per segment): B from the real dO with zero end gradients (dh written only as a merge's
// source); L is Phi^T (the dS chain is the adjoint of the state chain, whose transition over a segment is Phi), so
// no pass of its own: the current stream waits for the side stream's summaries; then the scan over each sequence's
// segments from its last back, starting from dht (the scan's reverse walk), and the pass from each segment's true end
// gradient. Joined before returning.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_gdn_bwd_chains_cp_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& dout, const std::optional<at::Tensor>& dht, double scale,
    const std::optional<at::Tensor>& initial_state, const at::Tensor& seg_cu, const at::Tensor& last,
    const at::Tensor& first, const at::Tensor& eye, bool use_qk_l2norm, bool output_dh0,
    bool output_a) {
  c10::cuda::CUDAGuard guard(q.device());
  const char* op = "chunk_gdn_bwd_chains_cp";
  const std::optional<at::Tensor> cu(seg_cu);
  // the dS chain's params on the segments; dh0 here is each segment's B (start gradient from zero end gradients)
  BwdDh r = bwd_dh_setup(op, q, k, g, beta, dout, std::nullopt, scale, cu, use_qk_l2norm, true, output_a);
  flashqla_gdn_fwd_params_t f = input_params(op, q, k, v, g, beta, scale, cu, use_qk_l2norm);
  const int64_t NS = r.p.fwd.num_seqs;
  const int64_t H = v.size(2), K = k.size(3), V = v.size(3);
  auto fopts = dout.options().dtype(at::kFloat);
  check_eye(eye, q, NS, H, K, op);
  for (const at::Tensor* t : {&last, &first})
    TORCH_CHECK(t->device() == q.device() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "flashqla.", op, ": last and first must be contiguous int64 vectors on q's device");
  at::Tensor states = at::empty({flashqla_gdn_chunk_bound(&f), H, K, V}, q.options());
  at::Tensor ws_b = byte_workspace(flashqla_gdn_bwd_dh_workspace_bytes(&r.p), dout);
  // the recompute's X and the chunks' gates (the summaries passes' paired launch copies them: prep_ready = 2)
  const size_t x_bytes = flashqla_gdn_fwd_workspace_bytes(&f);
  at::Tensor ws_f = byte_workspace(x_bytes > 0 ? x_bytes + flashqla_gdn_fwd_gates_workspace_bytes(&f) : 0, dout);
  TORCH_CHECK(ws_f.numel() > 0 || ws_b.numel() == 0, "flashqla.", op,
              ": needs the split forward (FLASHQLA_FWD_SPLIT=0 is set)");
  r.p.fwd.workspace = ws_b.numel() > 0 ? ws_b.data_ptr() : nullptr;
  r.p.fwd.workspace_bytes = static_cast<size_t>(ws_b.numel());
  f.workspace = ws_f.numel() > 0 ? ws_f.data_ptr() : nullptr;
  f.workspace_bytes = static_cast<size_t>(ws_f.numel());
  const c10::DeviceIndex dev = q.device().index();
  c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream(dev);
  if (ws_b.numel() > 0) {  // (no token rows: nothing to prepare; the passes only carry dht / h0 through)
    check_status(flashqla_gdn_bwd_prep(&r.p, f.workspace, f.workspace_bytes, main.stream()), op);
    r.p.fwd.prep_ready = 1;
    f.prep_ready = 1;
  }
  at::Tensor b_end = at::empty({NS, H, K, V}, fopts), phi = at::empty({NS, H, K, K}, fopts);
  at::Tensor h0;
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->is_contiguous() && initial_state->scalar_type() == at::kFloat,
                "flashqla.", op, ": initial_state must be contiguous float32");
    h0 = *initial_state;
  }
  // The states merge (on unless FLASHQLA_BWD_CP_STATES_MERGE=0): the summaries' B pass (from zero) also writes the
  // chunk states of the walks whose gates decay enough to merge, and fp32 checkpoints, and the states pass stops where
  // its walk merges with B's (flashqla_gdn_fwd_cp_summaries_merge_source, flashqla_gdn_fwd_merge): the same states,
  // the states pass only over the chunks until the initial state's part has decayed out of fp32. H100, session 38:
  // hk4_hv8 32k_1seq -1..-2%, the other segmented rows unchanged (the states side is not the longer one).
  flashqla_gdn_fwd_params_t fp = f;  // the states pass (its initial states come from the scan)
  fp.chunk_states = states.data_ptr();
  const size_t ckpt_bytes =
      env_switch("FLASHQLA_BWD_CP_STATES_MERGE", '1') != '0' ? flashqla_gdn_fwd_merge_bytes(&fp) : 0;
  at::Tensor ckpt = at::empty({static_cast<int64_t>(ckpt_bytes / sizeof(float))}, fopts);
  ForkedStream fork(main, dev, op);
  c10::cuda::CUDAStream side = fork.side;
  ForkedStream::Event phi_ready(op);
  // the dS chain's B pass (zero end gradients, dh0 = B), on the current stream: issued before the states' passes
  // with FLASHQLA_BWD_CP_ORDER=1, so that the block scheduler hands it the SMs first (by default the states'
  // summaries take them and B waits: it started 175 us after the prep in session 34's H200 timeline, and the dS side
  // is the longer one). With the merge (FLASHQLA_BWD_CP_MERGE, on unless 0) B also writes its chunks' dS' into dh
  // where the segment's gates decay enough for a merge (flashqla_gdn_bwd_dh_merge_source), and the last pass stops
  // where its walk merges with B's (flashqla_gdn_bwd_dh_merge): the same results, and only the chunks until the true
  // end gradients' part has decayed out of the fp32 state.
  const bool merge = env_switch("FLASHQLA_BWD_CP_MERGE", '1') != '0';
  flashqla_gdn_bwd_dh_params_t pb = r.p;
  pb.dht = nullptr;
  pb.dh = merge ? r.dh.data_ptr<float>() : nullptr;
  pb.a = nullptr;
  pb.dh0 = r.dh0.data_ptr<float>();
  const bool b_first = env_switch("FLASHQLA_BWD_CP_ORDER", '0') == '1';
  // (the merging pair's source: dS' only in the walks that may merge)
  const auto b_pass = [&] { return merge ? flashqla_gdn_bwd_dh_merge_source(&pb, main.stream())
                                         : flashqla_gdn_bwd_dh(&pb, main.stream()); };
  flashqla_status_t ds = b_first ? b_pass() : FLASHQLA_SUCCESS;
  // the states, on the side stream; its tensors were all allocated above on the current stream, which waits for
  // the side stream before anything else can reuse them
  flashqla_status_t fs = ds;
  if (fs == FLASHQLA_SUCCESS) {
    c10::cuda::CUDAStreamGuard on_side(side);
    flashqla_gdn_fwd_params_t fb = f;
    fb.final_state = b_end.data_ptr<float>();
    if (fb.prep_ready) fb.prep_ready = 2;
    bool states_merge = ckpt.numel() > 0;
    if (states_merge) {
      fs = flashqla_gdn_fwd_cp_summaries_merge_source(&fb, eye.data_ptr<float>(), phi.data_ptr<float>(),
                                                      states.data_ptr(), ckpt.data_ptr<float>(), side.stream());
      states_merge = fs != FLASHQLA_ERROR_UNSUPPORTED;  // (nothing launched: the plain passes)
    }
    if (!states_merge)
      fs = flashqla_gdn_fwd_cp_summaries(&fb, eye.data_ptr<float>(), phi.data_ptr<float>(), side.stream());
    if (fs == FLASHQLA_SUCCESS) {
      cuda_check(cudaEventRecord(phi_ready.e, side.stream()), op);  // (the dS chain's reverse scan reads Phi^T)
      at::Tensor init = chunk_gdn_cp_scan_cuda(phi, b_end, initial_state.has_value() ? std::optional<at::Tensor>(h0)
                                                                                       : std::nullopt, last, false);
      fp.initial_state = init.data_ptr<float>();
      fs = states_merge ? flashqla_gdn_fwd_merge(&fp, ckpt.data_ptr<float>(), nullptr, side.stream())
                        : flashqla_gdn_fwd(&fp, side.stream());
      // (init was allocated on the side stream: its memory is not reused before the side stream's work is done)
    }
  }
  // the rest of the dS chain, on the current stream
  if (!b_first || fs != FLASHQLA_SUCCESS) ds = fs == FLASHQLA_SUCCESS ? b_pass() : fs;
  at::Tensor dh0;
  if (ds == FLASHQLA_SUCCESS) {
    cuda_check(cudaStreamWaitEvent(main.stream(), phi_ready.e, 0), op);
    // each segment's true end gradient, from each sequence's last segment back: E_last = dht, E_{i-1} = L_i E_i + B_i
    // with L_i = Phi_i^T (the dS chain is the state chain's adjoint) and B_i the B pass's dh0; the scan kernel's
    // reverse walk reads Phi transposed in place (it replaced three gathers around a forward walk: -2% at hk4_hv8
    // and -7% at hk2_hv4 32k_1seq on an H100, session 38)
    at::Tensor ends = chunk_gdn_cp_scan_cuda(phi, r.dh0, dht, last, true);
    flashqla_gdn_bwd_dh_params_t pr = r.p;  // the pass from each segment's true end gradient
    pr.dht = ends.data_ptr<float>();
    pr.a = nullptr;
    at::Tensor dh0_seg = output_dh0 ? at::empty({NS, H, K, V}, fopts) : at::Tensor();
    pr.dh0 = output_dh0 ? dh0_seg.data_ptr<float>() : nullptr;
    ds = merge ? flashqla_gdn_bwd_dh_merge(&pr, r.dh0.data_ptr<float>(), main.stream())
               : flashqla_gdn_bwd_dh(&pr, main.stream());
    dh0 = output_dh0 ? at::index_select(dh0_seg, 0, first) : at::empty({0}, fopts);
  }
  fork.join();  // (also after a failed launch)
  check_status(fs, op);
  check_status(ds, op);
  return {states, r.dh, dh0, r.a};
}

// The chunk-parallel gradient step: (dq, dk [B, T, H_qk, K] summed over each GVA group, in q's dtype, or fp32
// with use_qk_l2norm (the caller's l2norm backward takes them), dv like v, dg,
// dbeta fp32 [B, T, H_v]); rows past cu_seqlens[-1] are zeros. See flashqla_gdn_bwd_grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_gdn_bwd_grad_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& dout, const at::Tensor& states, const at::Tensor& dh, double scale,
    const std::optional<at::Tensor>& cu_seqlens, bool use_qk_l2norm, const std::optional<at::Tensor>& a) {
  c10::cuda::CUDAGuard guard(q.device());
  flashqla_gdn_bwd_grad_params_t p{};
  p.fwd = input_params("chunk_gdn_bwd_grad", q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm);
  TORCH_CHECK(dout.sizes() == v.sizes() && dout.scalar_type() == v.scalar_type() && dout.stride(3) == 1,
              "flashqla.chunk_gdn_bwd_grad: dout must have v's shape and dtype, last dimension contiguous");
  const int64_t bound = flashqla_gdn_chunk_bound(&p.fwd), H = v.size(2), K = k.size(3), V = v.size(3);
  for (const at::Tensor* t : {&states, &dh})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == (t == &states ? q.scalar_type() : at::kFloat) &&
                    t->device() == q.device() && t->dim() == 4 && t->size(0) >= bound && t->size(1) == H &&
                    t->size(2) == K && t->size(3) == V,
                "flashqla.chunk_gdn_bwd_grad: states (in q's dtype) and dh (float32) must be contiguous [>= chunk "
                "bound, H_v, K, V] on q's device (chunk_gdn_fwd_states and chunk_gdn_bwd_dh give them)");
  p.dout = dout.data_ptr();
  p.dout_stride_batch = dout.stride(0); p.dout_stride_time = dout.stride(1); p.dout_stride_head = dout.stride(2);
  p.states = states.data_ptr();
  p.dh = dh.data_ptr<float>();
  if (a.has_value() && a->numel() > 0) {
    TORCH_CHECK(a->is_contiguous() && a->scalar_type() == at::kFloat && a->device() == q.device() &&
                    a->sizes() == at::IntArrayRef({q.size(0), q.size(1), H, 64}),
                "flashqla.chunk_gdn_bwd_grad: a must be chunk_gdn_bwd_dh's contiguous float32 [B, T, H_v, 64] on q's device");
    p.a = a->data_ptr<float>();
  }
  auto f32 = v.options().dtype(at::kFloat);
  const int64_t B = q.size(0), T = q.size(1);
  const int64_t Hq = q.size(2);  // dq, dk per q/k head: the kernel sums each GVA group
  // no fill: the kernels write every row (zeros past the last sequence); with no sequence at all nothing
  // is launched, and every row is past the end
  auto out = [&](at::IntArrayRef sizes, const at::TensorOptions& o) {
    return p.fwd.num_seqs == 0 ? at::zeros(sizes, o) : at::empty(sizes, o);
  };
  // dq, dk in q's dtype straight from the kernel (no cast pass), or fp32 for the caller's l2norm backward
  const auto dqk_opts = use_qk_l2norm ? f32 : q.options();
  at::Tensor dq = out({B, T, Hq, K}, dqk_opts), dk = out({B, T, Hq, K}, dqk_opts);
  at::Tensor dv = out({B, T, H, V}, v.options());
  at::Tensor dg = out({B, T, H}, f32), dbeta = out({B, T, H}, f32);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dqk_dtype = use_qk_l2norm ? FLASHQLA_FLOAT32 : p.fwd.qkv_dtype;
  p.dv = dv.data_ptr();
  p.dg = dg.data_ptr<float>();
  p.dbeta = dbeta.data_ptr<float>();
  check_status(flashqla_gdn_bwd_grad(&p, c10::cuda::getCurrentCUDAStream(q.device().index()).stream()),
               "chunk_gdn_bwd_grad");
  return {dq, dk, dv, dg, dbeta};
}

// Exact context parallelism's scan: every segment's initial state [segments, H_v, K, V] from the summaries
// phi [segments, H_v, K, K] and b [segments, H_v, K, V] (fp32), h0 [N, H_v, K, V] or None, and each
// sequence's last segment (int64 [N]); reverse: the adjoint walk (Phi^T, each sequence from its last segment
// back); see flashqla_gdn_cp_scan.
at::Tensor chunk_gdn_cp_scan_cuda(const at::Tensor& phi, const at::Tensor& b, const std::optional<at::Tensor>& initial_state,
                                  const at::Tensor& last, bool reverse) {
  c10::cuda::CUDAGuard guard(b.device());
  TORCH_CHECK(b.is_cuda() && b.dim() == 4 && b.scalar_type() == at::kFloat && b.is_contiguous(),
              "flashqla.chunk_gdn_cp_scan: b must be a contiguous float32 CUDA tensor [segments, H_v, K, V]");
  const int64_t S = b.size(0), H = b.size(1), K = b.size(2), V = b.size(3), N = last.numel();
  TORCH_CHECK(phi.device() == b.device() && phi.scalar_type() == at::kFloat && phi.is_contiguous() &&
                  phi.sizes() == at::IntArrayRef({S, H, K, K}),
              "flashqla.chunk_gdn_cp_scan: phi must be contiguous float32 [segments, H_v, K, K] on b's device");
  TORCH_CHECK(last.device() == b.device() && last.scalar_type() == at::kLong && last.dim() == 1 && last.is_contiguous(),
              "flashqla.chunk_gdn_cp_scan: last must be a contiguous int64 [N] tensor on b's device");
  flashqla_gdn_cp_scan_params_t p{};
  if (initial_state.has_value()) {
    TORCH_CHECK(initial_state->device() == b.device() && initial_state->scalar_type() == at::kFloat &&
                    initial_state->is_contiguous() && initial_state->sizes() == at::IntArrayRef({N, H, K, V}),
                "flashqla.chunk_gdn_cp_scan: initial_state must be contiguous float32 [N, H_v, K, V] on b's device");
    p.h0 = initial_state->data_ptr<float>();
  }
  at::Tensor init = at::empty_like(b);
  p.phi = phi.data_ptr<float>();
  p.b = b.data_ptr<float>();
  p.init = init.data_ptr<float>();
  p.last = last.data_ptr();
  p.last_dtype = FLASHQLA_INT64;
  p.num_seqs = N; p.segments = S; p.heads = H; p.head_dim_k = K; p.head_dim_v = V;
  p.reverse = reverse ? 1 : 0;
  check_status(flashqla_gdn_cp_scan(&p, c10::cuda::getCurrentCUDAStream(b.device().index()).stream()), "chunk_gdn_cp_scan");
  return init;
}

}  // namespace


// The forward's exact parallelism with the merge (FLASHQLA_CP_MERGE=1, opt-in; called by chunk_gdn_cp_fwd, cp.cpp):
// the summaries' B pass (from zero) also writes O and fp32 checkpoints in the walks whose
// gates decay enough to merge (flashqla_gdn_fwd_cp_summaries_merge_source), and the last pass from the true initial
// states stops where its walk merges with B's (flashqla_gdn_fwd_merge: the wgmma chain with O, whose O is the paired
// chain's bit for bit; FLASHQLA_CP_MERGE_OB=1 the O-beside chain, whose O warps end at the stop): the same final
// states, o the same bits (to rounding in the O-beside form), the last pass only over the chunks until the initial
// state's part has decayed out of fp32. (o, each segment's final states), or nullopt where it does not run (the
// caller then runs the plain steps; either way it picks the sequences' final states).
std::optional<std::tuple<at::Tensor, at::Tensor>> chunk_gdn_cp_fwd_merged(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    double scale, const std::optional<at::Tensor>& initial_state, const at::Tensor& seg_cu, const at::Tensor& last,
    bool use_qk_l2norm, at::Tensor& workspace, const at::Tensor& eye) {
  // Opt-in. Its last pass is the wgmma chain with O, ~1.6x slower a chunk than the default O-beside chain, and a walk
  // that cannot merge (a head whose gates decay slowly) runs all of it in that form, so one slow head sets the pass's
  // time. H100, session 38, graph ms on / off, the anchors' gates (every head decays): 128-chunk segments (TP4
  // 1x32768) 0.569 / 0.640; 32 and 16 (TP4 / TP8 1x8192: nothing merges) 0.241 / 0.179, 0.128 / 0.109. The O-beside
  // form (FLASHQLA_CP_MERGE_OB=1) is faster but still not a default: H200, session 39, graph ms off / on, the anchors'
  // gates: TP4 1x32768 0.614 / 0.533, TP8 1x32768 0.321 / 0.308, TP4 1x8192 0.172 / 0.203; FlashQLA's inputs (a
  // quarter of the heads at g = 0): TP4 1x32768 0.617 / 0.697, TP8 1x32768 0.321 / 0.371. A head that cannot merge
  // walks in full after a B pass made slower by O, and the call waits for it; which heads merge is known only on the
  // device, so the choice is the caller's (h200-ab-20261206T0722Z-aa86434-fwdmerge-*).
  if (env_switch("FLASHQLA_CP_MERGE", '0') != '1' || !q.is_cuda()) return std::nullopt;
  c10::cuda::CUDAGuard guard(q.device());
  const char* op = "chunk_gdn_cp_fwd";
  const std::optional<at::Tensor> cu(seg_cu);
  flashqla_gdn_fwd_params_t f = input_params(op, q, k, v, g, beta, scale, cu, use_qk_l2norm);
  use_workspace(f, workspace, q, op);
  const int64_t NS = f.num_seqs, H = v.size(2), K = k.size(3), V = v.size(3);
  auto fopts = v.options().dtype(at::kFloat);
  check_eye(eye, q, NS, H, K, op);
  at::Tensor o = at::empty(v.sizes(), v.options());
  f.o = o.data_ptr();
  f.o_stride_batch = o.stride(0); f.o_stride_time = o.stride(1); f.o_stride_head = o.stride(2);
  flashqla_gdn_fwd_params_t fl = f;  // the last pass (its initial states come from the scan)
  fl.prep_ready = 1;
  const size_t ckpt_bytes = flashqla_gdn_fwd_merge_bytes(&fl);
  if (ckpt_bytes == 0) return std::nullopt;
  at::Tensor ckpt = at::empty({static_cast<int64_t>(ckpt_bytes / sizeof(float))}, fopts);
  at::Tensor b_end = at::empty({NS, H, K, V}, fopts), phi = at::empty({NS, H, K, V}, fopts);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(q.device().index()).stream();
  flashqla_gdn_fwd_params_t fb = f;  // B (and O where its walk may merge), from zero, after the prep
  fb.final_state = b_end.data_ptr<float>();
  const flashqla_status_t st = flashqla_gdn_fwd_cp_summaries_merge_source(&fb, eye.data_ptr<float>(),
                                                                          phi.data_ptr<float>(), nullptr,
                                                                          ckpt.data_ptr<float>(), stream);
  if (st == FLASHQLA_ERROR_UNSUPPORTED) return std::nullopt;  // (the prep may have run: the plain steps redo it)
  check_status(st, op);
  at::Tensor init = chunk_gdn_cp_scan_cuda(phi, b_end, initial_state, last, false);
  at::Tensor finals = at::empty({NS, H, K, V}, fopts);
  fl.initial_state = init.data_ptr<float>();
  fl.final_state = finals.data_ptr<float>();
  check_status(flashqla_gdn_fwd_merge(&fl, ckpt.data_ptr<float>(), b_end.data_ptr<float>(), stream), op);
  return std::make_tuple(o, finals);
}

// Schemas are defined in Python (flashqla/_library.py) so that fake-tensor and
// CPU implementations exist even where this extension is not built.
TORCH_LIBRARY_IMPL(flashqla, CUDA, m) {
  m.impl("chunk_local_cumsum", &chunk_local_cumsum_cuda);
  m.impl("chunk_gdn_fwd", &chunk_gdn_fwd_cuda);
  m.impl("chunk_gdn_fwd_states", &chunk_gdn_fwd_states_cuda);
  m.impl("chunk_gdn_fwd_pass", &chunk_gdn_fwd_pass_cuda);
  m.impl("chunk_gdn_cp_summaries", &chunk_gdn_cp_summaries_cuda);
  m.impl("chunk_gdn_bwd_dh", &chunk_gdn_bwd_dh_cuda);
  m.impl("chunk_gdn_bwd_chains", &chunk_gdn_bwd_chains_cuda);
  m.impl("chunk_gdn_bwd_chains_cp", &chunk_gdn_bwd_chains_cp_cuda);
  m.impl("chunk_gdn_bwd_grad", &chunk_gdn_bwd_grad_cuda);
  m.impl("l2norm_bwd", &l2norm_bwd_cuda);
  m.impl("chunk_gdn_cp_scan", &chunk_gdn_cp_scan_cuda);
}

// `import flashqla._C` loads the library, which runs the registrations above.
static struct PyModuleDef flashqla_module = {PyModuleDef_HEAD_INIT, "_C", "flashqla CUDA kernels", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&flashqla_module); }
