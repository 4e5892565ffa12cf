// Links libflashqla through its C header only: runs the fused forward on a
// packed batch of two sequences with an initial state (the serving case:
// continue from cached states) and checks o and the final states against a
// float64 host recurrence. Exit codes: 0 pass, 1 fail, 77 skipped (no sm_90 GPU).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"
#include "example_util.h"

int main() {
  if (!have_sm90_device()) return kExitSkip;
  GdnProblem pr({0, 70, 150}, 1, 2, 7);
  const int D = GdnProblem::D, Hv = pr.Hv, T = pr.T, N = pr.N;

  // float64 recurrence: S = e^g S; S += beta k (v - S^T k)^T; o = scale S^T q
  std::vector<double> o_ref(size_t(T) * Hv * D, 0.0), s_ref(pr.h0.begin(), pr.h0.end());
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < Hv; ++h) {
      double* S = &s_ref[(size_t(n) * Hv + h) * D * D];
      for (int t = pr.cu[n]; t < pr.cu[n + 1]; ++t) {
        const double decay = std::exp(double(pr.g[t * Hv + h])), b = pr.beta[t * Hv + h];
        for (int i = 0; i < D * D; ++i) S[i] *= decay;
        std::vector<double> u(D);
        for (int j = 0; j < D; ++j) {
          double acc = 0;
          for (int i = 0; i < D; ++i) acc += S[i * D + j] * pr.kf(t, h, i);
          u[j] = b * (from_bf16(pr.v[(size_t(t) * Hv + h) * D + j]) - acc);
        }
        for (int i = 0; i < D; ++i)
          for (int j = 0; j < D; ++j) S[i * D + j] += pr.kf(t, h, i) * u[j];
        for (int j = 0; j < D; ++j) {
          double acc = 0;
          for (int i = 0; i < D; ++i) acc += S[i * D + j] * pr.qf(t, h, i);
          o_ref[(size_t(t) * Hv + h) * D + j] = pr.scale() * acc;
        }
      }
    }

  if (!pr.upload()) return 1;
  void* dout;
  float* dht;
  CUDA_OK(cudaMalloc(&dout, pr.v.size() * 2));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dht), pr.h0.size() * 4));
  CUDA_OK(cudaMemset(dout, 0xff, pr.v.size() * 2));  // poison: NaN bit patterns
  CUDA_OK(cudaMemset(dht, 0xff, pr.h0.size() * 4));
  flashqla_gdn_fwd_params_t p = pr.params(dout);
  p.initial_state = pr.dh0;
  p.final_state = dht;
  flashqla_status_t st = flashqla_gdn_fwd(&p, nullptr);  // workspace NULL: allocated inside, stream-ordered
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "flashqla_gdn_fwd: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> o_bits(pr.v.size());
  std::vector<float> o(pr.v.size()), ht(pr.h0.size());
  CUDA_OK(cudaMemcpy(o_bits.data(), dout, o_bits.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(ht.data(), dht, ht.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < o.size(); ++i) o[i] = from_bf16(o_bits[i]);
  const double eo = rel_l2(o_ref, o), es = rel_l2(s_ref, ht);
  // again in a caller's workspace of the minimum plus the optional gates' bytes: the same bits
  const size_t ws_bytes = flashqla_gdn_fwd_workspace_bytes(&p) + flashqla_gdn_fwd_gates_workspace_bytes(&p);
  void* ws = nullptr;
  CUDA_OK(cudaMalloc(&ws, ws_bytes > 0 ? ws_bytes : 1));
  CUDA_OK(cudaMemset(dout, 0xff, pr.v.size() * 2));
  p.workspace = ws;
  p.workspace_bytes = ws_bytes;
  st = flashqla_gdn_fwd(&p, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> o_bits2(pr.v.size());
  CUDA_OK(cudaMemcpy(o_bits2.data(), dout, o_bits2.size() * 2, cudaMemcpyDeviceToHost));
  const bool same = st == FLASHQLA_SUCCESS && o_bits2 == o_bits;
  // exact parallelism's summaries (flashqla_gdn_fwd_cp_summaries, one launch with the gates' room): B (from zeros,
  // with v) and the transition (from dh0 here, v = 0) as two plain summaries calls give them, bit for bit; then a
  // prep_ready call with o on the workspace it left gives the first call's o
  const size_t state_floats = pr.h0.size();
  float *db = nullptr, *dphi = nullptr, *db2 = nullptr, *dphi2 = nullptr;
  for (float** d : {&db, &dphi, &db2, &dphi2}) {
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(d), state_floats * 4));
    CUDA_OK(cudaMemset(*d, 0xff, state_floats * 4));
  }
  flashqla_gdn_fwd_params_t ps = pr.params(nullptr);
  ps.final_state = db;
  ps.workspace = ws;
  ps.workspace_bytes = ws_bytes;
  const bool sum_ok = flashqla_gdn_fwd_cp_summaries(&ps, pr.dh0, dphi, nullptr) == FLASHQLA_SUCCESS;
  flashqla_gdn_fwd_params_t pb = pr.params(nullptr), pt = pr.params(nullptr);
  pb.final_state = db2;
  pt.v = nullptr;  // v = 0
  pt.initial_state = pr.dh0;
  pt.final_state = dphi2;
  const bool two_ok = flashqla_gdn_fwd(&pb, nullptr) == FLASHQLA_SUCCESS && flashqla_gdn_fwd(&pt, nullptr) == FLASHQLA_SUCCESS;
  CUDA_OK(cudaMemset(dout, 0xff, pr.v.size() * 2));
  flashqla_gdn_fwd_params_t pr_o = p;  // (p: o, h0, the final states, this workspace)
  pr_o.prep_ready = 1;
  const bool ready_ok = flashqla_gdn_fwd(&pr_o, nullptr) == FLASHQLA_SUCCESS;
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> b1(state_floats), b2(state_floats), f1(state_floats), f2(state_floats);
  CUDA_OK(cudaMemcpy(b1.data(), db, state_floats * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(b2.data(), db2, state_floats * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(f1.data(), dphi, state_floats * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(f2.data(), dphi2, state_floats * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(o_bits2.data(), dout, o_bits2.size() * 2, cudaMemcpyDeviceToHost));
  const bool summaries = sum_ok && two_ok && ready_ok && std::memcmp(b1.data(), b2.data(), state_floats * 4) == 0 &&
                         std::memcmp(f1.data(), f2.data(), state_floats * 4) == 0 && o_bits2 == o_bits;
  ps.o = dout;  // o is not for the summaries: a status and a message
  const bool sum_rejects = flashqla_gdn_fwd_cp_summaries(&ps, pr.dh0, dphi, nullptr) == FLASHQLA_ERROR_INVALID_ARGUMENT;
  for (float* d : {db, dphi, db2, dphi2}) cudaFree(d);
  p.head_dim_v = 64;  // an unsupported size comes back as a status and a message
  const bool rejects = flashqla_gdn_fwd(&p, nullptr) == FLASHQLA_ERROR_UNSUPPORTED;
  // NaN compares false (an unwritten output fails); the poisoned states' NaN bits would differ from the plain calls'
  const bool ok = eo < 5e-3 && es < 5e-3 && same && rejects && summaries && sum_rejects;
  std::printf("%s: o rel L2 %.2e, final state %.2e (limit 5e-3); a caller's workspace (%zu bytes) gives the same "
              "bits: %s; cp_summaries equal to two summaries calls and its workspace serves a prep_ready call: %s, "
              "with o rejected: %s; V = 64 rejected: %s (%s)\n", ok ? "PASS" : "FAIL", eo, es, ws_bytes,
              same ? "yes" : "no", summaries ? "yes" : "no", sum_rejects ? "yes" : "no", rejects ? "yes" : "no",
              flashqla_last_error());
  cudaFree(ws);
  cudaFree(dout);
  cudaFree(dht);
  return ok ? 0 : 1;
}
