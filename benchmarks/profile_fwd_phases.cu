// Where does a chunk's time go in the forward kernels (v1 "simple" and v2 "mma")? Builds the kernel with
// FLASHQLA_PHASE_TIMERS (thread 0 of CTA 0 accumulates clock64() deltas between
// the per-chunk barriers), runs one TP1-like call (1 x 8192 tokens, 16/64
// heads, so CTA 0 sees 128 chunks while the GPU is as busy as in the
// benchmark), and prints cycles per chunk and per phase, plus the event time.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Icsrc/include -Icsrc -I<cutlass include> benchmarks/profile_fwd_phases.cu -o /tmp/phases
#define FLASHQLA_PHASE_TIMERS 1
#include <cstdio>
#include <cstdlib>

#include "flashqla/gdn_fwd_mma.cuh"
#include "flashqla/gdn_fwd_simple.cuh"
#include "profile_util.cuh"


namespace fs = flashqla::gdn_fwd_simple;
namespace fm = flashqla::gdn_fwd_mma;

int main() {
  const int64_t T = 8192, Hq = 16, Hv = 64, D = 128;
  flashqla_gdn_fwd_params_t p = dense_bf16_problem(T, Hq, Hv);

  float ms = warm_then_time([&] { return fs::launch<__nv_bfloat16>(p, nullptr); },
                            [] { zero_symbol(fs::g_phase_cycles); });
  unsigned long long cyc[fs::kNumPhases];
  CUDA_OK(cudaMemcpyFromSymbol(cyc, fs::g_phase_cycles, sizeof(cyc)));
  const char* names[fs::kNumPhases] = {"load K/Q/V/g/beta", "cumsum + KK^T, QK^T, KS, QS", "L, P, Y, A=0",
                                       "inverse: 16x16 diagonal", "inverse: merges 16->32->64", "Gamma*A -> T",
                                       "V_new = (Gamma*A) Y", "V_new casts, Z", "P V_new + state update",
                                       "O store + publish S"};
  const double chunks = double(T / fs::kChunk);
  unsigned long long total = 0;
  for (int i = 0; i < fs::kNumPhases; ++i) total += cyc[i];
  int clk_khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  std::printf("v1 forward, 1 x %lld tokens, %lld/%lld heads: %.3f ms (%.2f us per chunk per CTA)\n", (long long)T,
              (long long)Hq, (long long)Hv, ms, 1000.0 * ms / chunks);
  std::printf("%-32s %12s %8s\n", "phase (CTA 0, per chunk)", "cycles", "share");
  for (int i = 0; i < fs::kNumPhases; ++i)
    std::printf("%-32s %12.0f %7.1f%%\n", names[i], cyc[i] / chunks, 100.0 * cyc[i] / total);
  std::printf("%-32s %12.0f  (= %.2f us at the %d MHz clock attribute)\n", "total", total / chunks,
              total / chunks / (clk_khz / 1000.0), clk_khz / 1000);

  // v2: per-role phases on the same problem, then at 2/8 heads (16 CTAs, TP8-like: is the chain bound by the
  // state warps or by the loader groups when the GPU is nearly idle?)
  const char* st_names[fm::kStPhases] = {"wait full", "S->bf16, KS^T + QS^T", "gates, V^T, Z, Y", "O^T += Z^T W^T",
                                         "S^T update (hi + lo)", "O store"};
  const char* aux_names[fm::kAuxPhases] = {"wait empty", "loads + cumsum", "l2norm", "KK^T, QK^T, L, P",
                                           "inverse diagonal", "inverse merges", "M", "W, X"};
  const auto roles = [&](const char* what) -> int {  // (CUDA_OK returns 1 on an error)
    ms = warm_then_time([&] { return fm::launch<__nv_bfloat16>(p, nullptr); }, [] { zero_symbol(fm::g_role_cycles); });
    unsigned long long rc[2][8];
    CUDA_OK(cudaMemcpyFromSymbol(rc, fm::g_role_cycles, sizeof(rc)));
    std::printf("\nv2 forward, 1 x %lld tokens, %lld/%lld heads (%s): %.3f ms (%.2f us per chunk per CTA)\n",
                (long long)T, (long long)p.heads_qk, (long long)p.heads_v, what, ms, 1000.0 * ms / chunks);
    for (int role = 0; role < 2; ++role) {
      const int n = role == 0 ? int(fm::kStPhases) : int(fm::kAuxPhases);
      unsigned long long tot = 0;
      for (int i = 0; i < n; ++i) tot += rc[role][i];
      // the timed aux warp belongs to group 0, which prepares every kAuxGroups-th chunk
      const double per = role == 0 ? chunks : chunks / fm::kAuxGroups;
      std::printf("%-32s %12s %8s\n", role == 0 ? "state warp 0 (CTA 0, per chunk)" : "aux warp 0 (CTA 0, per own chunk)",
                  "cycles", "share");
      for (int i = 0; i < n; ++i)
        std::printf("%-32s %12.0f %7.1f%%\n", role == 0 ? st_names[i] : aux_names[i], rc[role][i] / per,
                    tot ? 100.0 * rc[role][i] / tot : 0.0);
      std::printf("%-32s %12.0f\n", "total", tot / per);
    }
    return 0;
  };
  if (roles("TP1-like, the GPU full") != 0) return 1;
  p.heads_qk = 2; p.heads_v = 8;
  p.q_stride_batch = p.k_stride_batch = T * 2 * D; p.q_stride_time = p.k_stride_time = 2 * D;
  p.v_stride_batch = p.o_stride_batch = T * 8 * D; p.v_stride_time = p.o_stride_time = 8 * D;
  p.g_stride_batch = p.beta_stride_batch = T * 8; p.g_stride_time = p.beta_stride_time = 8;
  if (roles("TP8-like, 16 CTAs") != 0) return 1;
  return 0;
}
