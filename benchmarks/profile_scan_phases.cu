// Where does a step of exact parallelism's scan go? Builds cp_scan_kernel with FLASHQLA_SCAN_TIMERS (thread 0 of
// every CTA adds clock64() deltas per phase of the walk), runs it on one sequence of S segments and H value heads
// (random maps; the library's slice width and forms, or FLASHQLA_SCAN_COLS / _TMA / _ROWS as for the library), and
// prints cycles per CTA: the prologue, each phase of a step (summed over the steps and per step) and the tail, with
// the event time of the timed build.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -Icsrc/include -Icsrc -I<cutlass include> benchmarks/profile_scan_phases.cu -o /tmp/scan_phases
//   /tmp/scan_phases [S] [H] [seqs]  (default 8 8 1: TP8 1 x 8192's plan, 8 segments of 8 heads)
#define FLASHQLA_SCAN_TIMERS 1
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "flashqla/cp_scan.cu"
#include "profile_util.cuh"

int main(int argc, char** argv) {
  const int64_t S = argc > 1 ? atoll(argv[1]) : 8, H = argc > 2 ? atoll(argv[2]) : 8,
                N = argc > 3 ? atoll(argv[3]) : 1, D = 128;
  if (S < N || N < 1) {
    std::fprintf(stderr, "need 1 <= seqs <= segments\n");
    return 1;
  }
  flashqla_gdn_cp_scan_params_t p{};
  // maps of small norm (a decayed transition's scale), any B and h0: the timing does not depend on the values
  p.phi = device_random<float>(S * H * D * D, -0.01f, 0.01f, 11);
  p.b = device_random<float>(S * H * D * D, -1.f, 1.f, 12);
  p.h0 = device_random<float>(N * H * D * D, -1.f, 1.f, 13);
  float* init = nullptr;
  CUDA_OK(cudaMalloc(&init, S * H * D * D * sizeof(float)));
  p.init = init;
  std::vector<int64_t> last(N);  // the segments split as evenly as they go among the sequences
  for (int64_t n = 0; n < N; ++n) last[n] = (n + 1) * S / N - 1;
  int64_t* d_last = nullptr;
  CUDA_OK(cudaMalloc(&d_last, N * sizeof(int64_t)));
  CUDA_OK(cudaMemcpy(d_last, last.data(), N * sizeof(int64_t), cudaMemcpyHostToDevice));
  p.last = d_last;
  p.last_dtype = FLASHQLA_INT64;
  p.num_seqs = N;
  p.segments = S;
  p.heads = H;
  p.head_dim_k = p.head_dim_v = D;

  namespace fq = flashqla;
  const float ms = warm_then_time([&] { return fq::launch_gdn_cp_scan(p, nullptr); },
                                  [] { zero_symbol(fq::g_scan_cycles); });
  unsigned long long cyc[fq::kScanMarks];
  CUDA_OK(cudaMemcpyFromSymbol(cyc, fq::g_scan_cycles, sizeof(cyc)));
  int clk_khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&clk_khz, cudaDevAttrClockRate, 0));
  // (the CTAs that walked, as the kernel counted them: every sequence has a segment here, so all of them)
  const double ctas = double(cyc[fq::kScanCtas]), steps = cyc[fq::kScanSteps] / ctas;
  std::printf("scan (timed build), %lld segments, %lld heads, %lld sequences, %.0f columns a CTA (%.0f CTAs): %.1f us,"
              " %.1f steps a CTA\n",
              (long long)S, (long long)H, (long long)N, double(N) * H * D / ctas, ctas, 1000.0 * ms, steps);
  const char* names[fq::kScanSteps] = {"prologue: h0, B, the first Phi issued", "init out, slice to shared memory",
                                       "B and Phi ahead issued", "wait: Phi_i landed", "barrier 1",
                                       "FMAs: B_i + Phi_i S_i", "barrier 2", "last init out, exit"};
  std::printf("%-44s %12s %12s\n", "phase (thread 0, cycles a CTA)", "in all", "a step");
  double tot = 0;
  for (int i = 0; i < fq::kScanSteps; ++i) {
    const double c = cyc[i] / ctas;
    tot += c;
    const bool per_step = i != fq::kScanPrologue && i != fq::kScanLast;
    if (per_step && steps > 0)
      std::printf("%-44s %12.0f %12.0f\n", names[i], c, c / steps);
    else
      std::printf("%-44s %12.0f %12s\n", names[i], c, "");
  }
  std::printf("%-44s %12.0f %12s  (%.2f us at %d MHz)\n", "total", tot, "", tot / (clk_khz / 1000.0), clk_khz / 1000);
  return 0;
}
