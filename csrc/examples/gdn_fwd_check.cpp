// Links libflashqla through its C header only: runs the fused forward on a
// packed batch of two sequences with an initial state (the serving case:
// continue from cached states) and checks o and the final states against a
// float64 host recurrence. Exit codes: 0 pass, 1 fail, 77 skipped (no sm_90 GPU).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"
#include "example_util.h"

namespace {

uint16_t to_bf16(float x) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

double rel_l2(const std::vector<double>& ref, const std::vector<float>& got) {
  double e = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e += (got[i] - ref[i]) * (got[i] - ref[i]);
    n += ref[i] * ref[i];
  }
  return std::sqrt(e / n);
}

}  // namespace

int main() {
  if (!have_sm90_device()) return kExitSkip;
  const int D = 128, Hq = 1, Hv = 2;
  const std::vector<int32_t> cu = {0, 70, 150};
  const int T = cu.back(), N = static_cast<int>(cu.size()) - 1;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<uint16_t> q(T * Hq * D), k(T * Hq * D), v(T * Hv * D);
  std::vector<float> g(T * Hv), beta(T * Hv), h0(size_t(N) * Hv * D * D);
  auto unit_rows = [&](std::vector<uint16_t>& x) {  // l2-normalised rows, as models feed them
    for (size_t r = 0; r < x.size() / D; ++r) {
      std::vector<float> row(D);
      double s = 0;
      for (auto& e : row) { e = nd(rng); s += e * e; }
      for (int d = 0; d < D; ++d) x[r * D + d] = to_bf16(static_cast<float>(row[d] / std::sqrt(s)));
    }
  };
  unit_rows(q);
  unit_rows(k);
  for (auto& e : v) e = to_bf16(nd(rng));
  for (auto& e : g) e = -0.1f * ud(rng);
  for (auto& e : beta) e = ud(rng);
  for (auto& e : h0) e = nd(rng);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));

  // float64 recurrence: S = e^g S; S += beta k (v - S^T k)^T; o = scale S^T q
  std::vector<double> o_ref(size_t(T) * Hv * D, 0.0), s_ref(h0.begin(), h0.end());
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < Hv; ++h) {
      double* S = &s_ref[(size_t(n) * Hv + h) * D * D];
      const int hq = h / (Hv / Hq);
      for (int t = cu[n]; t < cu[n + 1]; ++t) {
        const double decay = std::exp(double(g[t * Hv + h])), b = beta[t * Hv + h];
        for (int i = 0; i < D * D; ++i) S[i] *= decay;
        std::vector<double> u(D);
        for (int j = 0; j < D; ++j) {
          double acc = 0;
          for (int i = 0; i < D; ++i) acc += S[i * D + j] * from_bf16(k[(t * Hq + hq) * D + i]);
          u[j] = b * (from_bf16(v[(t * Hv + h) * D + j]) - acc);
        }
        for (int i = 0; i < D; ++i)
          for (int j = 0; j < D; ++j) S[i * D + j] += from_bf16(k[(t * Hq + hq) * D + i]) * u[j];
        for (int j = 0; j < D; ++j) {
          double acc = 0;
          for (int i = 0; i < D; ++i) acc += S[i * D + j] * from_bf16(q[(t * Hq + hq) * D + i]);
          o_ref[(size_t(t) * Hv + h) * D + j] = scale * acc;
        }
      }
    }

  void *dq, *dk, *dv, *dout, *dcu;
  float *dg, *dbeta, *dh0, *dht;
  CUDA_OK(cudaMalloc(&dq, q.size() * 2));
  CUDA_OK(cudaMalloc(&dk, k.size() * 2));
  CUDA_OK(cudaMalloc(&dv, v.size() * 2));
  CUDA_OK(cudaMalloc(&dout, v.size() * 2));
  CUDA_OK(cudaMalloc(&dcu, cu.size() * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dg), g.size() * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dbeta), beta.size() * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dh0), h0.size() * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dht), h0.size() * 4));
  CUDA_OK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dcu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dg, g.data(), g.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dbeta, beta.data(), beta.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dh0, h0.data(), h0.size() * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(dout, 0xff, v.size() * 2));  // poison: NaN bit patterns
  CUDA_OK(cudaMemset(dht, 0xff, h0.size() * 4));

  flashqla_gdn_fwd_params_t p{};
  p.q = dq; p.k = dk; p.v = dv; p.o = dout;
  p.qkv_dtype = FLASHQLA_BFLOAT16;
  p.q_stride_batch = p.k_stride_batch = int64_t(T) * Hq * D;
  p.q_stride_time = p.k_stride_time = Hq * D;
  p.q_stride_head = p.k_stride_head = D;
  p.v_stride_batch = p.o_stride_batch = int64_t(T) * Hv * D;
  p.v_stride_time = p.o_stride_time = Hv * D;
  p.v_stride_head = p.o_stride_head = D;
  p.g = dg; p.g_dtype = FLASHQLA_FLOAT32; p.g_stride_batch = T * Hv; p.g_stride_time = Hv; p.g_stride_head = 1;
  p.beta = dbeta; p.beta_dtype = FLASHQLA_FLOAT32;
  p.beta_stride_batch = T * Hv; p.beta_stride_time = Hv; p.beta_stride_head = 1;
  p.initial_state = dh0; p.final_state = dht;
  p.batch = 1; p.seqlen = T; p.heads_qk = Hq; p.heads_v = Hv; p.head_dim_k = D; p.head_dim_v = D;
  p.cu_seqlens = dcu; p.cu_seqlens_dtype = FLASHQLA_INT32; p.num_seqs = N;
  p.scale = scale;
  flashqla_status_t st = flashqla_gdn_fwd(&p, nullptr);
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "flashqla_gdn_fwd: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> o_bits(v.size());
  std::vector<float> o(v.size()), ht(h0.size());
  CUDA_OK(cudaMemcpy(o_bits.data(), dout, o_bits.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(ht.data(), dht, ht.size() * 4, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < o.size(); ++i) o[i] = from_bf16(o_bits[i]);
  const double eo = rel_l2(o_ref, o), es = rel_l2(s_ref, ht);
  p.head_dim_v = 64;  // an unsupported size comes back as a status and a message
  const bool rejects = flashqla_gdn_fwd(&p, nullptr) == FLASHQLA_ERROR_UNSUPPORTED;
  const bool ok = eo < 5e-3 && es < 5e-3 && rejects;  // NaN compares false: unwritten output fails
  std::printf("%s: o rel L2 %.2e, final state %.2e (limit 5e-3); V = 64 rejected: %s (%s)\n", ok ? "PASS" : "FAIL",
              eo, es, rejects ? "yes" : "no", flashqla_last_error());
  cudaFree(dq); cudaFree(dk); cudaFree(dv); cudaFree(dout); cudaFree(dcu);
  cudaFree(dg); cudaFree(dbeta); cudaFree(dh0); cudaFree(dht);
  return ok ? 0 : 1;
}
