// Links libflashqla through its C header only and checks the chunk-local cumsum
// on a packed varlen batch against a host loop. Exit codes: 0 pass, 1 fail,
// 77 skipped (no sm_90 GPU), so ctest reports a skip on CPU-only machines.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"
#include "example_util.h"

int main() {
  if (!have_sm90_device()) return kExitSkip;
  const std::vector<int32_t> cu = {0, 0, 1, 64, 129, 400};
  const int64_t T = 420, H = 8, C = 64;  // tokens past cu.back() must come out as 0
  std::mt19937 rng(1234);
  std::normal_distribution<float> dist(-0.1f, 0.5f);
  std::vector<float> g(T * H), out(T * H), ref(T * H, 0.f);
  for (auto& x : g) x = dist(rng);
  for (size_t n = 0; n + 1 < cu.size(); ++n)
    for (int64_t h = 0; h < H; ++h) {
      double acc = 0;
      for (int64_t t = cu[n]; t < cu[n + 1]; ++t) {
        if ((t - cu[n]) % C == 0) acc = 0;
        acc += g[t * H + h];
        ref[t * H + h] = static_cast<float>(acc);
      }
    }

  float *d_g = nullptr, *d_out = nullptr;
  int32_t* d_cu = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_g), g.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_out), out.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_cu), cu.size() * sizeof(int32_t)));
  CUDA_OK(cudaMemcpy(d_g, g.data(), g.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_cu, cu.data(), cu.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemset(d_out, 0xff, out.size() * sizeof(float)));  // poison: NaN bit pattern

  flashqla_chunk_cumsum_params_t p{};
  p.g = d_g;
  p.g_dtype = FLASHQLA_FLOAT32;
  p.g_stride_batch = T * H;
  p.g_stride_time = H;
  p.g_stride_head = 1;
  p.out = d_out;
  p.batch = 1;
  p.seqlen = T;
  p.heads = H;
  p.cu_seqlens = d_cu;
  p.cu_seqlens_dtype = FLASHQLA_INT32;
  p.num_seqs = static_cast<int64_t>(cu.size()) - 1;
  p.chunk_size = static_cast<int32_t>(C);
  p.reverse = 0;
  p.scale = 1.0f;
  flashqla_status_t st = flashqla_chunk_local_cumsum(&p, nullptr);
  if (st != FLASHQLA_SUCCESS) {
    std::fprintf(stderr, "flashqla_chunk_local_cumsum: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
    return 1;
  }
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
  double err = 0, nrm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      std::fprintf(stderr, "FAIL: element %zu not written (%f)\n", i, out[i]);
      return 1;
    }
    err += (out[i] - ref[i]) * double(out[i] - ref[i]);
    nrm += double(ref[i]) * ref[i];
  }
  const double rel = std::sqrt(err / nrm);
  // A bad parameter comes back as a status plus a message, not a crash.
  p.chunk_size = 48;
  const bool rejects = flashqla_chunk_local_cumsum(&p, nullptr) == FLASHQLA_ERROR_UNSUPPORTED;
  cudaFree(d_g);
  cudaFree(d_out);
  cudaFree(d_cu);
  std::printf("%s: relative L2 error %.3e (limit 1e-6), bad chunk_size rejected: %s (%s)\n",
              rel < 1e-6 && rejects ? "PASS" : "FAIL", rel, rejects ? "yes" : "no", flashqla_last_error());
  return rel < 1e-6 && rejects ? 0 : 1;
}
