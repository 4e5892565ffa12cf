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
#include <string>

#include "flashqla/gdn_bwd_dh.cuh"
#include "flashqla/gdn_fwd_mma.cuh"
#include "flashqla/gdn_fwd_simple.cuh"
#include "profile_util.cuh"


namespace fs = flashqla::gdn_fwd_simple;
namespace fm = flashqla::gdn_fwd_mma;

// One role's table: its phases in program order (order[k] indexes cyc and names), cycles per unit of `per`
// (chunks), each phase's share, and the total.
static void print_phases(const char* head, const char* const* names, const int* order, int n,
                         const unsigned long long* cyc, double per) {
  unsigned long long tot = 0;
  for (int i = 0; i < n; ++i) tot += cyc[i];
  std::printf("%-32s %12s %8s\n", head, "cycles", "share");
  for (int k = 0; k < n; ++k)
    std::printf("%-32s %12.0f %7.1f%%\n", names[order[k]], cyc[order[k]] / per, tot ? 100.0 * cyc[order[k]] / tot : 0.0);
  std::printf("%-32s %12.0f\n", "total", tot / per);
}

// The state role's phases (state_role's StatePhase slots) with O formed by the state warps, in program order
static const char* const kStNames[fm::kStPhases] = {"wait full", "KS^T + QS^T", "gates, V^T, Z, Y", "O^T += Z^T W^T",
                                                    "S^T update (hi + lo)", "O store", "S->bf16"};
static const int kStOrder[fm::kStPhases] = {0, 6, 1, 2, 3, 4, 5};

// The prep kernel's phases (thread 0 of the middle value head's CTAs, g_time_prep) on the launch `fwd`
template <typename Launch>
static int prep_table(Launch&& fwd, double chunks) {
  const int on = 1, off = 0;
  CUDA_OK(cudaMemcpyToSymbol(fm::g_time_prep, &on, sizeof(on)));
  const float pms = warm_then_time(fwd, [] { zero_symbol(fm::g_prep_cycles); });
  CUDA_OK(cudaMemcpyToSymbol(fm::g_time_prep, &off, sizeof(off)));
  unsigned long long pc[8];
  CUDA_OK(cudaMemcpyFromSymbol(pc, fm::g_prep_cycles, sizeof(pc)));
  const char* prep_names[fm::kAuxPhases] = {"store X", "loads + cumsum", "l2norm", "KK^T, QK^T, L, P",
                                            "inverse diagonal", "inverse merges", "M", "W, X"};
  const int order[fm::kAuxPhases] = {1, 2, 3, 4, 5, 6, 7, 0};  // in program order
  std::printf("\nprep kernel (same call, %.3f ms with the chain), thread 0 of the middle value head's CTAs\n", pms);
  print_phases("phase (per chunk)", prep_names, order, fm::kAuxPhases, pc, chunks);
  return 0;
}

// `fq_phases pair B T hq hv`: the paired chain at a dense B x T shape (TP1 8192x4: `pair 4 8192 16 64`) as the
// library launches it (the prep kernel, then the pair), with FLASHQLA_PREP_AB on (the prep writes X's operand and the
// producer forms X; the op's own workspace) and off: state warpgroup 0's phases and the producer's (its thread 0:
// the TMA issue), per chunk of CTA 0, then the prep kernel's. Whose time is a step: the state warpgroups' products,
// or their "wait full" on the producer, and of the producer's, its TMA wait (the bytes) or its own work?
static int pair_tables(int64_t B, int64_t T, int64_t hq, int64_t hv) {
  flashqla_gdn_fwd_params_t p = dense_bf16_batch(B, T, hq, hv);
  p.workspace_private = 1;  // (the torch op's own workspace: the operand mode where FLASHQLA_PREP_AB allows it)
  const double chunks = double(T / fm::kChunk);
  const int producer = 2 * fm::kStateThreads, fallback = -1, first = 0;
  CUDA_OK(cudaMemcpyToSymbol(fm::g_timed_aux_thread, &producer, sizeof(producer)));
  CUDA_OK(cudaMemcpyToSymbol(fm::g_timed_block, &first, sizeof(first)));
  // the producer's phases in AuxPhase's slots (pair_producer), in program order
  const char* prod_names[fm::kAuxPhases] = {"wait empty (the stage back)", "TMA wait (the boxes land)",
                                            "zero rows, l2norm, barrier", "TMA issue, gates", "-", "-",
                                            "form X (operand mode)", "-"};
  const int prod_order[] = {0, 3, 1, 2, 6};
  const auto fwd = [&] { return fm::launch<__nv_bfloat16>(p, nullptr); };
  for (const char* ab : {"1", "0"}) {
    setenv("FLASHQLA_PREP_AB", ab, 1);
    const float ms = warm_then_time(fwd, [] { zero_symbol(fm::g_role_cycles); });
    unsigned long long rc[2][8];
    CUDA_OK(cudaMemcpyFromSymbol(rc, fm::g_role_cycles, sizeof(rc)));
    std::printf("\npaired chain, %lld x %lld tokens, %lld/%lld heads, FLASHQLA_PREP_AB=%s: %.3f ms (prep + pair)\n",
                (long long)B, (long long)T, (long long)hq, (long long)hv, ab, ms);
    print_phases("state warpgroup 0 (per chunk)", kStNames, kStOrder, fm::kStPhases, rc[0], chunks);
    print_phases("producer (per chunk)", prod_names, prod_order, 5, rc[1], chunks);
    if (rc[1][fm::kAuxLoad] == 0) std::printf("(no producer phases: the paired chain did not run at this shape)\n");
    if (prep_table(fwd, chunks) != 0) return 1;
  }
  unsetenv("FLASHQLA_PREP_AB");
  CUDA_OK(cudaMemcpyToSymbol(fm::g_timed_aux_thread, &fallback, sizeof(fallback)));
  return 0;
}

// `fq_phases shape T hq hv`: only the O-beside chain's role tables at that dense shape, as the library launches it
// (the prep beside the chain where overlap_prep_ctas allows), then with FLASHQLA_OVERLAP=0 (the prep kernel first):
// what the chain's step costs beside the prep workers and alone (session 30: ~3.8k against ~3.0k cycles at 35B).
int main(int argc, char** argv) {
  if (argc >= 6 && std::string(argv[1]) == "pair")
    return pair_tables(std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5]));
  const bool shape = argc >= 5 && std::string(argv[1]) == "shape";
  const int64_t T = shape ? std::atoll(argv[2]) : 8192, Hq = shape ? std::atoll(argv[3]) : 16,
                Hv = shape ? std::atoll(argv[4]) : 64, D = 128;
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
  // the chain kernels' aux warps only load (split mode): their slots 3 and 4 time the copies' issue and the gates
  // (warp 0, the timed one) apart from the wait for the copies; slot 5 the TMA chain's box issue (thread 0, before
  // its V copies); slots 6-7 stay empty
  const char* aux_names[fm::kAuxPhases] = {"wait empty", "wait for the copies", "l2norm", "issue the copies",
                                           "gates (warp 0)", "TMA issue (thread 0)", "-", "-"};
  // the role tables of one timed launch: state warp 0 and aux warp 0 of CTA 0 (st: the state phases' names)
  const auto roles = [&](const char* what, const char* const* st, auto&& launch) -> int {  // (CUDA_OK returns 1)
    // the first chain CTA (a prep-beside-chain launch puts its prep workers first)
    const int timed = fm::overlap_prep_ctas(p);
    CUDA_OK(cudaMemcpyToSymbol(fm::g_timed_block, &timed, sizeof(timed)));
    if (timed > 0) std::printf("\n(the prep beside the chain: %d worker CTAs first, CTA %d timed)", timed, timed);
    ms = warm_then_time(launch, [] { zero_symbol(fm::g_role_cycles); });
    unsigned long long rc[2][8];
    CUDA_OK(cudaMemcpyFromSymbol(rc, fm::g_role_cycles, sizeof(rc)));
    std::printf("\n%s, 1 x %lld tokens, %lld/%lld heads: %.3f ms (%.2f us per chunk per CTA)\n", what, (long long)T,
                (long long)p.heads_qk, (long long)p.heads_v, ms, 1000.0 * ms / chunks);
    print_phases("state warp 0 (CTA 0, per chunk)", st, kStOrder, fm::kStPhases, rc[0], chunks);
    // the timed aux warp belongs to group 0, which prepares every kAuxGroups-th chunk
    const int aux_order[fm::kAuxPhases] = {0, 5, 3, 4, 1, 2, 6, 7};  // program order
    print_phases("aux warp 0 (CTA 0, per own chunk)", aux_names, aux_order, fm::kAuxPhases, rc[1],
                 chunks / fm::kAuxGroups);
    return 0;
  };
  const auto fwd = [&] { return fm::launch<__nv_bfloat16>(p, nullptr); };
  const char* ob_names[fm::kStPhases] = {"wait full", "KS^T", "gates, V^T, Z, Y, publish",
                                         "(O beside)", "S^T update (hi + lo)", "(O beside)",
                                         "S->bf16, wait free, publish"};
  if (shape) {
    if (roles("forward as launched (O beside the chain)", ob_names, fwd) != 0) return 1;
    setenv("FLASHQLA_OVERLAP", "0", 1);
    if (roles("forward, FLASHQLA_OVERLAP=0 (the prep kernel first; its time included)", ob_names, fwd) != 0) return 1;
    unsetenv("FLASHQLA_OVERLAP");
    return 0;
  }
  // O beside the chain (FLASHQLA_WGMMA=2): the state warps' phases without O (ob_names), and the publishing of S^T, Z^T
  setenv("FLASHQLA_WGMMA", "0", 1);
  if (roles("v2 forward (TP1-like, the GPU full, mma.sync chain)", kStNames, fwd) != 0) return 1;
  setenv("FLASHQLA_WGMMA", "1", 1);  // the same with the chain's products as wgmma (swizzled stages)
  if (roles("v2 forward (TP1-like, wgmma chain)", kStNames, fwd) != 0) return 1;
  setenv("FLASHQLA_WGMMA", "2", 1);
  if (roles("v2 forward (TP1-like, wgmma chain, O beside, 3 stages)", ob_names, fwd) != 0) return 1;
  unsetenv("FLASHQLA_WGMMA");

  // The split forward's chunk-parallel prep kernel on the same call: thread 0 of each CTA of the middle value head,
  // per chunk (the prep holds ~half the TP1 forward's SM time: which phase of it?). The middle head's CTAs run
  // mid-launch, among CTAs at every phase; head 0's (timed up to session 13) all ran in the first wave, where
  // every CTA loads at once.
  if (prep_table(fwd, chunks) != 0) return 1;

  // The backward's two chains at 16/32 heads (64 CTAs each; in the backward they run side by side), each alone:
  // the state recompute (chunk states, no o) and the dS chain (v = dO), to see which part of their ~3 us step is
  // the products and which the loads
  {
    const int64_t hq = 16, hv = 32;
    flashqla_gdn_fwd_params_t b = dense_bf16_problem(T, hq, hv);
    const int64_t bound = flashqla::chunk_bound(b);
    void* states = nullptr;
    float* dh = nullptr;
    CUDA_OK(cudaMalloc(&states, size_t(bound) * hv * D * D * 2));
    CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&dh), size_t(bound) * hv * D * D * 4));
    flashqla_gdn_fwd_params_t rs = b;
    rs.o = nullptr;
    rs.chunk_states = states;
    const char* rs_names[fm::kStPhases] = {"wait full", "KS^T", "gates, V^T, Z, Y", "(no O)",
                                           "S^T update (hi + lo)", "(no O store)", "S->bf16 + state store"};
    // (the wgmma chain: dS' out and the dO operand, all three products issued / KdS^T waited for, Z formed /
    // Z^T W' issued and every product waited for)
    const char* dh_names[fm::kStPhases] = {"wait full", "dS' store, K dS'^T | +issues", "dO^T Q | KdS^T wait, Z",
                                           "Z^T W' | wait all", "release the stage", "-", "-"};
    std::swap(p, b);  // roles() prints p's heads
    // each chain alone with the K split, then without (the backward runs them side by side: unsplit there at
    // 16/32 heads, since two chains of 32 heads x 4 CTAs would not fit on the GPU together)
    int bad = 0;
    for (int variant = 0; variant < 3; ++variant) {  // K split, unsplit, the products as wgmma
      setenv("FLASHQLA_KSPLIT", variant == 0 ? "1" : "0", 1);
      setenv("FLASHQLA_WGMMA", variant == 2 ? "1" : "0", 1);
      const std::string tag = variant == 0 ? " (K-split chain)" : variant == 1 ? " (unsplit chain)" : " (wgmma chain)";
      if (bad == 0)
        bad = roles(("backward state recompute" + tag).c_str(), rs_names,
                    [&] { return fm::launch<__nv_bfloat16>(rs, nullptr); });
      if (bad == 0)
        bad = roles(("backward dS chain" + tag).c_str(), dh_names,
                    [&] { return flashqla::gdn_bwd_dh::launch<__nv_bfloat16>(rs, dh, nullptr, nullptr); });
    }
    unsetenv("FLASHQLA_KSPLIT");
    unsetenv("FLASHQLA_WGMMA");
    std::swap(p, b);
    cudaFree(states);
    cudaFree(dh);
    if (bad != 0) return 1;
  }
  p.heads_qk = 2; p.heads_v = 8;
  p.q_stride_batch = p.k_stride_batch = T * 2 * D; p.q_stride_time = p.k_stride_time = 2 * D;
  p.v_stride_batch = p.o_stride_batch = T * 8 * D; p.v_stride_time = p.o_stride_time = 8 * D;
  p.g_stride_batch = p.beta_stride_batch = T * 8; p.g_stride_time = p.beta_stride_time = 8;
  // the K-split chain (the default here: 32 CTAs of 32 V columns), then the unsplit one (16 CTAs of 64)
  if (roles("v2 forward (TP8-like, K-split chain, 32 CTAs)", kStNames, fwd) != 0) return 1;
  setenv("FLASHQLA_KSPLIT", "0", 1);
  setenv("FLASHQLA_WGMMA", "0", 1);
  if (roles("v2 forward (TP8-like, unsplit chain, 16 CTAs)", kStNames, fwd) != 0) return 1;
  unsetenv("FLASHQLA_KSPLIT");
  setenv("FLASHQLA_WGMMA", "1", 1);
  if (roles("v2 forward (TP8-like, wgmma chain, 16 CTAs)", kStNames, fwd) != 0) return 1;
  setenv("FLASHQLA_WGMMA", "2", 1);
  if (roles("v2 forward (TP8-like, wgmma chain, O beside, 3 stages, 16 CTAs)", ob_names, fwd) != 0) return 1;
  unsetenv("FLASHQLA_WGMMA");
  return 0;
}
