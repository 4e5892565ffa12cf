// Links libflashqla through its C header only: the whole backward through the C API (the forward with
// chunk_states, flashqla_gdn_bwd_dh, flashqla_gdn_bwd_grad, which sums a GVA group's dq/dk itself) on a packed batch of a
// partial and a multi-chunk sequence, against the float64 token-level adjoint of the recurrence on the host:
//   forward per token: S = e^g S;  u = v - S^T k;  S += beta k u^T;  o = scale S^T q;
//   backward from the end with X = dS (dht at the start): X += scale q do^T, dq = scale S do, dbeta = k^T X u,
//   du = beta X^T k, dk = beta X u - S_mid du, dv = du, X = X - k du^T (the gradient of S_mid),
//   dg = <X, S_mid>, X = e^g X.
// Exit codes: 0 pass, 1 fail, 77 skipped (no sm_90 GPU).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"
#include "example_util.h"

int main() {
  if (!have_sm90_device()) return kExitSkip;
  GdnProblem pr({0, 40, 240}, 1, 2, 21);  // 40 tokens (one partial chunk), 200 tokens (four chunks)
  const int D = GdnProblem::D, Hq = pr.Hq, Hv = pr.Hv, T = pr.T, N = pr.N;
  const double scale = pr.scale();
  std::vector<uint16_t> dout;
  std::vector<float> dht;
  random_upstream_grads(pr, 22, dout, dht);

  // ---- host reference
  std::vector<double> rdq(size_t(T) * Hq * D, 0.0), rdk(size_t(T) * Hq * D, 0.0), rdv(pr.v.size()),
      rdg(pr.g.size()), rdb(pr.beta.size());
  std::vector<double> Sprev(size_t(T) * D * D);  // one head at a time: the state before each token
  for (int h = 0; h < Hv; ++h) {
    const int hq = h / (Hv / Hq);
    for (int n = 0; n < N; ++n) {
      std::vector<double> S(pr.h0.begin() + (size_t(n) * Hv + h) * D * D, pr.h0.begin() + (size_t(n) * Hv + h + 1) * D * D);
      for (int t = pr.cu[n]; t < pr.cu[n + 1]; ++t) {
        std::copy(S.begin(), S.end(), Sprev.begin() + size_t(t) * D * D);
        const double decay = std::exp(double(pr.g[t * Hv + h])), beta = pr.beta[t * Hv + h];
        for (auto& e : S) e *= decay;
        for (int b = 0; b < D; ++b) {
          double u = from_bf16(pr.v[(size_t(t) * Hv + h) * D + b]);
          for (int a = 0; a < D; ++a) u -= pr.kf(t, h, a) * S[a * D + b];
          for (int a = 0; a < D; ++a) S[a * D + b] += beta * pr.kf(t, h, a) * u;
        }
      }
      std::vector<double> X(dht.begin() + (size_t(n) * Hv + h) * D * D, dht.begin() + (size_t(n) * Hv + h + 1) * D * D);
      std::vector<double> Sm(D * D), Sa(D * D), u(D), du(D);
      for (int t = pr.cu[n + 1] - 1; t >= pr.cu[n]; --t) {
        const double decay = std::exp(double(pr.g[t * Hv + h])), beta = pr.beta[t * Hv + h];
        for (int i = 0; i < D * D; ++i) Sm[i] = decay * Sprev[size_t(t) * D * D + i];
        for (int b = 0; b < D; ++b) {
          u[b] = from_bf16(pr.v[(size_t(t) * Hv + h) * D + b]);
          for (int a = 0; a < D; ++a) u[b] -= pr.kf(t, h, a) * Sm[a * D + b];
        }
        for (int a = 0; a < D; ++a)
          for (int b = 0; b < D; ++b) Sa[a * D + b] = Sm[a * D + b] + beta * pr.kf(t, h, a) * u[b];
        const auto dob = [&](int b) { return double(from_bf16(dout[(size_t(t) * Hv + h) * D + b])); };
        for (int a = 0; a < D; ++a) {
          double s = 0;
          for (int b = 0; b < D; ++b) s += Sa[a * D + b] * dob(b);
          rdq[(size_t(t) * Hq + hq) * D + a] += scale * s;
          for (int b = 0; b < D; ++b) X[a * D + b] += scale * pr.qf(t, h, a) * dob(b);
        }
        double db = 0;
        for (int b = 0; b < D; ++b) {
          double kx = 0;
          for (int a = 0; a < D; ++a) kx += pr.kf(t, h, a) * X[a * D + b];
          db += kx * u[b];
          du[b] = beta * kx;
          rdv[(size_t(t) * Hv + h) * D + b] = du[b];
        }
        rdb[t * Hv + h] = db;
        for (int a = 0; a < D; ++a) {
          double xu = 0, sd = 0;
          for (int b = 0; b < D; ++b) { xu += X[a * D + b] * u[b]; sd += Sm[a * D + b] * du[b]; }
          rdk[(size_t(t) * Hq + hq) * D + a] += beta * xu - sd;
        }
        double dg = 0;
        for (int a = 0; a < D; ++a)
          for (int b = 0; b < D; ++b) {
            X[a * D + b] -= pr.kf(t, h, a) * du[b];
            dg += X[a * D + b] * Sm[a * D + b];
          }
        rdg[t * Hv + h] = dg;
        for (auto& e : X) e *= decay;
      }
    }
  }

  // ---- the C API: forward with chunk states, the reverse chain, the gradient step
  if (!pr.upload()) return 1;
  const size_t rowsK = size_t(T) * Hq * D;  // dq, dk: per q/k head
  void *d_out, *d_dout, *d_dv;
  float *d_dht, *d_dh, *d_dh0, *d_dq, *d_dk, *d_dg, *d_db;
  void* d_states;  // bf16, as q (dh: fp32)
  flashqla_gdn_fwd_params_t f = pr.params(nullptr);
  const int64_t bound = flashqla_gdn_chunk_bound(&f);
  const size_t state_bytes = size_t(bound) * Hv * D * D * 2, dh_bytes = 2 * state_bytes;
  CUDA_OK(cudaMalloc(&d_out, pr.v.size() * 2));
  CUDA_OK(cudaMalloc(&d_dout, dout.size() * 2));
  CUDA_OK(cudaMalloc(&d_dv, pr.v.size() * 2));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_dht), dht.size() * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_dh0), dht.size() * 4));
  CUDA_OK(cudaMalloc(&d_states, state_bytes));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_dh), dh_bytes));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_dq), rowsK * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_dk), rowsK * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_dg), size_t(T) * Hv * 4));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_db), size_t(T) * Hv * 4));
  CUDA_OK(cudaMemcpy(d_dout, dout.data(), dout.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_dht, dht.data(), dht.size() * 4, cudaMemcpyHostToDevice));
  for (void* x : {static_cast<void*>(d_dq), static_cast<void*>(d_dk), static_cast<void*>(d_dg),
                  static_cast<void*>(d_db), d_dv})
    CUDA_OK(cudaMemset(x, 0xff, x == d_dv ? pr.v.size() * 2 : (x == d_dg || x == d_db ? size_t(T) * Hv * 4 : rowsK * 4)));

  f.o = d_out;
  f.initial_state = pr.dh0;
  f.chunk_states = d_states;
  flashqla_status_t st = flashqla_gdn_fwd(&f, nullptr);
  flashqla_gdn_bwd_dh_params_t pd{};
  pd.fwd = pr.params(nullptr);
  set_bwd_dh_io(pd, d_dout, T, Hv, D, d_dht, d_dh, d_dh0);
  float* d_a = nullptr;  // the inverse's rows, for the second gradient run below
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_a), size_t(T) * Hv * 64 * 4));
  pd.a = d_a;
  if (st == FLASHQLA_SUCCESS) st = flashqla_gdn_bwd_dh(&pd, nullptr);
  flashqla_gdn_bwd_grad_params_t pg{};
  pg.fwd = pr.params(nullptr);
  pg.dout = d_dout;
  pg.dout_stride_batch = pd.dout_stride_batch;
  pg.dout_stride_time = pd.dout_stride_time;
  pg.dout_stride_head = pd.dout_stride_head;
  pg.states = d_states;
  pg.dh = d_dh;
  pg.dq = d_dq;
  pg.dk = d_dk;
  pg.dv = d_dv;
  pg.dg = d_dg;
  pg.dbeta = d_db;
  if (st == FLASHQLA_SUCCESS) st = flashqla_gdn_bwd_grad(&pg, nullptr);
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "backward through the C API: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> dq(rowsK), dk(rowsK), dg(size_t(T) * Hv), db(size_t(T) * Hv);
  std::vector<uint16_t> dvb(pr.v.size());
  CUDA_OK(cudaMemcpy(dq.data(), d_dq, rowsK * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dk.data(), d_dk, rowsK * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dg.data(), d_dg, dg.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(db.data(), d_db, db.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dvb.data(), d_dv, dvb.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> dv(dvb.size());
  for (size_t i = 0; i < dv.size(); ++i) dv[i] = from_bf16(dvb[i]);
  const double e[5] = {rel_l2(rdq, dq), rel_l2(rdk, dk), rel_l2(rdv, dv), rel_l2(rdg, dg), rel_l2(rdb, db)};
  const char* names[5] = {"dq", "dk", "dv", "dg", "dbeta"};
  bool ok = true;
  for (int i = 0; i < 5; ++i) {
    ok = ok && e[i] < 1e-2;  // NaN compares false: an unwritten output fails
    std::printf("%s rel L2 %.2e  ", names[i], e[i]);
  }
  std::printf("\n%s (limit 1e-2)\n", ok ? "PASS" : "FAIL");

  // the same step given flashqla_gdn_bwd_dh's inverse rows (loaded instead of recomputed): bitwise the same
  for (void* x : {static_cast<void*>(d_dq), static_cast<void*>(d_dk)}) CUDA_OK(cudaMemset(x, 0xff, rowsK * 4));
  for (void* x : {static_cast<void*>(d_dg), static_cast<void*>(d_db)}) CUDA_OK(cudaMemset(x, 0xff, size_t(T) * Hv * 4));
  CUDA_OK(cudaMemset(d_dv, 0xff, pr.v.size() * 2));
  pg.a = d_a;
  st = flashqla_gdn_bwd_grad(&pg, nullptr);
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "gradient step with a: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<float> dq2(rowsK), dk2(rowsK), dg2(dg.size()), db2(db.size());
  std::vector<uint16_t> dvb2(dvb.size());
  CUDA_OK(cudaMemcpy(dq2.data(), d_dq, rowsK * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dk2.data(), d_dk, rowsK * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dg2.data(), d_dg, dg.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(db2.data(), d_db, db.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dvb2.data(), d_dv, dvb.size() * 2, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(dq.data(), dq2.data(), rowsK * 4) == 0 && std::memcmp(dk.data(), dk2.data(), rowsK * 4) == 0 &&
                    std::memcmp(dg.data(), dg2.data(), dg.size() * 4) == 0 &&
                    std::memcmp(db.data(), db2.data(), db.size() * 4) == 0 &&
                    std::memcmp(dvb.data(), dvb2.data(), dvb.size() * 2) == 0;
  std::printf("with flashqla_gdn_bwd_dh's inverse rows: %s\n", same ? "bitwise the same (PASS)" : "DIFFERENT (FAIL)");
  ok = ok && same;

  // dq, dk in bf16 (dqk_dtype): each the fp32 output rounded to nearest, bit for bit; the rows past them untouched
  std::vector<uint16_t> poison(2 * rowsK, 0xffffu);
  for (void* x : {static_cast<void*>(d_dq), static_cast<void*>(d_dk)})
    CUDA_OK(cudaMemcpy(x, poison.data(), 2 * rowsK * 2, cudaMemcpyHostToDevice));
  pg.dqk_dtype = FLASHQLA_BFLOAT16;
  st = flashqla_gdn_bwd_grad(&pg, nullptr);
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "gradient step with bf16 dq, dk: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  std::vector<uint16_t> dqb(2 * rowsK), dkb(2 * rowsK);
  CUDA_OK(cudaMemcpy(dqb.data(), d_dq, 2 * rowsK * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(dkb.data(), d_dk, 2 * rowsK * 2, cudaMemcpyDeviceToHost));
  bool rounded = true;
  for (size_t i = 0; i < rowsK; ++i)
    rounded = rounded && dqb[i] == to_bf16(dq2[i]) && dkb[i] == to_bf16(dk2[i]) && dqb[rowsK + i] == 0xffffu &&
              dkb[rowsK + i] == 0xffffu;
  std::printf("dq, dk in bf16: %s\n", rounded ? "the fp32 outputs rounded, bit for bit (PASS)" : "DIFFERENT (FAIL)");
  ok = ok && rounded;
  // with use_qk_l2norm the caller's l2norm backward takes fp32 dq, dk: a 16-bit dqk_dtype is refused
  pg.fwd.use_qk_l2norm = 1;
  const bool refused = flashqla_gdn_bwd_grad(&pg, nullptr) == FLASHQLA_ERROR_INVALID_ARGUMENT;
  std::printf("bf16 dq, dk with use_qk_l2norm: %s\n", refused ? "refused (PASS)" : "NOT REFUSED (FAIL)");
  ok = ok && refused;
  pg.fwd.use_qk_l2norm = 0;
  pg.dqk_dtype = FLASHQLA_FLOAT32;

  // both chains from one prep (flashqla_gdn_bwd_prep, then the state recompute and the dS chain with prep_ready),
  // against each chain with its own prep: bitwise the same chunk states and dh
  int64_t chunks = 0;
  for (int n = 0; n < N; ++n) chunks += (pr.cu[n + 1] - pr.cu[n] + 63) / 64;
  const size_t s_used = size_t(chunks) * Hv * D * D * 2, h_used = 2 * s_used;
  std::vector<uint8_t> s1(s_used), h1(h_used), s2(s_used), h2(h_used);
  flashqla_gdn_fwd_params_t fs = f;  // the recompute: chunk states, no o
  fs.o = nullptr;
  st = flashqla_gdn_fwd(&fs, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(s1.data(), d_states, s_used, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(h1.data(), d_dh, h_used, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemset(d_states, 0xff, state_bytes));
  CUDA_OK(cudaMemset(d_dh, 0xff, dh_bytes));
  // (the states workspace with the gates' room: the prep writes the chunks' gates after X, for prep_ready = 2 below)
  const size_t nb = flashqla_gdn_bwd_dh_workspace_bytes(&pd),
               nx = flashqla_gdn_fwd_workspace_bytes(&fs) + flashqla_gdn_fwd_gates_workspace_bytes(&fs);
  void *ws_b = nullptr, *ws_x = nullptr;
  CUDA_OK(cudaMalloc(&ws_b, nb));
  CUDA_OK(cudaMalloc(&ws_x, nx));
  pd.fwd.workspace = ws_b;
  pd.fwd.workspace_bytes = nb;
  if (st == FLASHQLA_SUCCESS) st = flashqla_gdn_bwd_prep(&pd, ws_x, nx, nullptr);
  pd.fwd.prep_ready = 1;
  fs.workspace = ws_x;
  fs.workspace_bytes = nx;
  fs.prep_ready = 1;
  if (st == FLASHQLA_SUCCESS) st = flashqla_gdn_fwd(&fs, nullptr);
  if (st == FLASHQLA_SUCCESS) st = flashqla_gdn_bwd_dh(&pd, nullptr);
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "chains from one prep: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(s2.data(), d_states, s_used, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(h2.data(), d_dh, h_used, cudaMemcpyDeviceToHost));
  const bool shared = s1 == s2 && h1 == h2;
  std::printf("both chains from flashqla_gdn_bwd_prep: %s\n", shared ? "bitwise the same (PASS)" : "DIFFERENT (FAIL)");
  ok = ok && shared;

  // exact parallelism's summaries on that workspace: with prep_ready = 2 the paired launch copies the prep's gates
  // (FLASHQLA_SUMMARY_PAIR=2: that launch or a failure), with prep_ready = 1 two launches compute them
  // (FLASHQLA_SUMMARY_PAIR=0); the same bits (the same compute_gates; the pair's chains are the plain ones')
  const size_t sf = dht.size();
  std::vector<float> sum_bits[2][2];
  bool sum_ok = true;
  for (int ready = 1; ready <= 2; ++ready) {
    float *d_b = nullptr, *d_phi = nullptr;
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_b), sf * 4));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_phi), sf * 4));
    CUDA_OK(cudaMemset(d_b, 0xff, sf * 4));
    CUDA_OK(cudaMemset(d_phi, 0xff, sf * 4));
    flashqla_gdn_fwd_params_t fsum = fs;
    fsum.chunk_states = nullptr;
    fsum.initial_state = nullptr;
    fsum.final_state = d_b;
    fsum.prep_ready = ready;
    setenv("FLASHQLA_SUMMARY_PAIR", ready == 2 ? "2" : "0", 1);
    sum_ok = sum_ok && flashqla_gdn_fwd_cp_summaries(&fsum, d_dht, d_phi, nullptr) == FLASHQLA_SUCCESS;
    unsetenv("FLASHQLA_SUMMARY_PAIR");
    CUDA_OK(cudaDeviceSynchronize());
    sum_bits[ready - 1][0].resize(sf);
    sum_bits[ready - 1][1].resize(sf);
    CUDA_OK(cudaMemcpy(sum_bits[ready - 1][0].data(), d_b, sf * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(sum_bits[ready - 1][1].data(), d_phi, sf * 4, cudaMemcpyDeviceToHost));
    cudaFree(d_b);
    cudaFree(d_phi);
  }
  const bool gates_shared = sum_ok && std::memcmp(sum_bits[0][0].data(), sum_bits[1][0].data(), sf * 4) == 0 &&
                            std::memcmp(sum_bits[0][1].data(), sum_bits[1][1].data(), sf * 4) == 0;
  std::printf("summaries on the prep's gates (prep_ready = 2, one launch): %s\n",
              gates_shared ? "bitwise the two launches' (PASS)" : sum_ok ? "DIFFERENT (FAIL)" : flashqla_last_error());
  ok = ok && gates_shared;
  flashqla_gdn_fwd_params_t fbad = fs;
  fbad.prep_ready = 3;
  const bool bad_ready = flashqla_gdn_fwd(&fbad, nullptr) == FLASHQLA_ERROR_INVALID_ARGUMENT;
  fbad.prep_ready = 2;
  fbad.workspace_bytes = flashqla_gdn_fwd_workspace_bytes(&fs);  // (no room for the gates)
  const bool no_gates = flashqla_gdn_fwd(&fbad, nullptr) == FLASHQLA_ERROR_INVALID_ARGUMENT;
  std::printf("prep_ready = 3, and 2 without the gates' room: %s\n",
              bad_ready && no_gates ? "refused (PASS)" : "NOT REFUSED (FAIL)");
  ok = ok && bad_ready && no_gates;
  cudaFree(ws_b);
  cudaFree(ws_x);
  cudaFree(d_a);
  for (void* x : {d_out, d_dout, d_dv, static_cast<void*>(d_dht), static_cast<void*>(d_dh0), static_cast<void*>(d_states),
                  static_cast<void*>(d_dh), static_cast<void*>(d_dq), static_cast<void*>(d_dk), static_cast<void*>(d_dg),
                  static_cast<void*>(d_db)})
    cudaFree(x);
  return ok ? 0 : 1;
}
