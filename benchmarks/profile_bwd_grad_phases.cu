// Where does the gradient kernel's time go? Builds gdn_bwd_grad_kernel with FLASHQLA_GRAD_TIMERS (thread 0,
// an aux warp, and thread 128, a loader warp in phases 1-2, of every CTA add clock64() deltas per phase and
// per block barrier), runs it on a dense 1 x T problem with hq/hv heads (random inputs, states and dS'), and
// prints cycles per value head and phase, the barrier waits beside them, and the event time (the timed build,
// slower than the library's by the atomics).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Icsrc/include -Icsrc -I<cutlass include> benchmarks/profile_bwd_grad_phases.cu -o /tmp/grad_phases
//   /tmp/grad_phases [T] [hq] [hv] [a]  (default 8192 16 32: the hk16_hv32 backward case at a quarter length;
//                                        a = 1: the inverse's rows given, as flashqla_gdn_bwd_dh's `a`, random here)
#define FLASHQLA_GRAD_TIMERS 1
#include <cstdio>
#include <cstdlib>

#include "flashqla/gdn_bwd_grad.cuh"
#include "profile_util.cuh"

namespace fg = flashqla::gdn_bwd_grad;

int main(int argc, char** argv) {
  const int64_t T = argc > 1 ? atoll(argv[1]) : 8192, hq = argc > 2 ? atoll(argv[2]) : 16,
                hv = argc > 3 ? atoll(argv[3]) : 32, D = 128;
  flashqla_gdn_bwd_grad_params_t gp{};
  gp.fwd = dense_bf16_problem(T, hq, hv);
  const int64_t chunks = flashqla::chunk_bound(gp.fwd);
  gp.dout = device_random<__nv_bfloat16>(T * hv * D, -1.f, 1.f, 6);
  gp.dout_stride_batch = T * hv * D; gp.dout_stride_time = hv * D; gp.dout_stride_head = D;
  gp.states = device_random<__nv_bfloat16>(chunks * hv * D * D, -0.1f, 0.1f, 7);  // S0 in q's dtype, dS' fp32
  gp.dh = device_random<float>(chunks * hv * D * D, -0.1f, 0.1f, 8);
  CUDA_OK(cudaMalloc(&gp.dq, T * hq * D * 4));
  CUDA_OK(cudaMalloc(&gp.dk, T * hq * D * 4));
  CUDA_OK(cudaMalloc(&gp.dv, T * hv * D * 2));
  CUDA_OK(cudaMalloc(&gp.dg, T * hv * 4));
  CUDA_OK(cudaMalloc(&gp.dbeta, T * hv * 4));
  const bool with_a = argc > 4 && atoi(argv[4]) != 0;
  if (with_a) gp.a = device_random<float>(T * hv * 64, -0.1f, 0.1f, 9);

  const float ms = warm_then_time([&] { return fg::launch<__nv_bfloat16>(gp, nullptr); },
                                  [] {
                                    zero_symbol(fg::g_grad_cycles);
                                    zero_symbol(fg::g_grad_at);
                                  });
  unsigned long long cyc[2][fg::kGradMarks];
  CUDA_OK(cudaMemcpyFromSymbol(cyc, fg::g_grad_cycles, sizeof(cyc)));

  const char* names[fg::kGradMarks / 2] = {
      "1-2 aux: loads, Gram, inverse, P, M | S0, dS' loads", "3 KS, Y", "4 Vn, dW, U1, dVn", "5 dK = dte Vn dS'^T",
      "6 dP, dM, QK^T, dQK, dA, H, dVn lo", "7a (none: dVn lo in phase 6)", "7 dY, KS, dV", "8 dKS S0^T, dO S0^T",
      "9 (none: A^T read in place)",
      "10 dQK K, dQK^T Q, dA A^T", "11 dL", "12 KK^T, dbeta, dKK^T", "13 dK += .. K, dq/dk staged",
      "13b dq/dk bulk copies (t0); gates (t128)"};  // (phases 1-2 inside: g_grad_at, below)
  const double heads = double(chunks) * hv;  // CTA-heads
  int clk_khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  std::printf("gradient kernel (timed build), 1 x %lld tokens, %lld/%lld heads%s: %.3f ms, %.2f us per CTA-head\n",
              (long long)T, (long long)hq, (long long)hv, with_a ? ", A rows given" : "", ms, 1000.0 * ms * 132 / heads);
  std::printf("%-52s %10s %10s %10s %10s\n", "phase (cycles per value head)", "t0 work", "t0 wait", "t128 work",
              "t128 wait");
  double tot[2] = {0, 0};
  for (int i = 0; i < fg::kGradMarks / 2; ++i) {
    std::printf("%-52s %10.0f %10.0f %10.0f %10.0f\n", names[i], cyc[0][2 * i] / heads, cyc[0][2 * i + 1] / heads,
                cyc[1][2 * i] / heads, cyc[1][2 * i + 1] / heads);
    for (int t = 0; t < 2; ++t) tot[t] += (cyc[t][2 * i] + cyc[t][2 * i + 1]) / heads;
  }
  std::printf("%-52s %21.0f %21.0f  (%.2f us at %d MHz)\n", "total", tot[0], tot[1], tot[0] / (clk_khz / 1000.0),
              clk_khz / 1000);
  // inside phases 1-2: cycles from the head's start to each point, the group's first heads apart from its others
  unsigned long long at[2][2][fg::kGradPoints];
  CUDA_OK(cudaMemcpyFromSymbol(at, fg::g_grad_at, sizeof(at)));
  const char* pts[2][fg::kGradPoints] = {
      {"aux: K, Q, gates (+ A issued)", "aux: A landed, group sync", "aux: Gram done", "aux: P stored",
       "aux: copies issued / earlier copies read", "13b reached (thread 0; the group's last head)", "",
       "13b: its warp's copies issued"},
      {"loaders: aux copies issued", "loaders: dO issued", "loaders: S0, dS' stored", "loaders: dO landed",
       "loaders: S0 / dS' piece 0 landed", "loaders: piece 1 landed", "loaders: piece 2 landed",
       "loaders: piece 3 landed"}};
  const double firsts = double(chunks) * hq, laters = double(chunks) * (hv - hq);
  std::printf("%-52s %10s %10s\n", "points (cycles from the head's start)", "1st head", "later");
  for (int t = 0; t < 2; ++t)
    for (int i = 0; i < fg::kGradPoints; ++i)
      if (pts[t][i][0] != '\0')
        std::printf("%-52s %10.0f %10.0f\n", pts[t][i], at[t][0][i] / firsts, laters > 0 ? at[t][1][i] / laters : 0.0);
  return 0;
}
