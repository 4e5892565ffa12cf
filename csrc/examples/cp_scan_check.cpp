// Links libflashqla through its C header only and checks flashqla_gdn_cp_scan (exact context parallelism's
// scan over segment summaries) against a host loop in double: three sequences of 3, 1 and 2 segments, with and
// without initial states. Exit codes: 0 pass, 1 fail, 77 skipped (no sm_90 GPU).
#include "example_util.h"

namespace {

constexpr int64_t kD = 128;  // K = V

// init[first] = h0 (or 0), init[i + 1] = Phi_i init[i] + B_i along each sequence's segments
std::vector<double> host_scan(const std::vector<float>& phi, const std::vector<float>& b, const float* h0,
                              const std::vector<int64_t>& last, int64_t H) {
  const int64_t tile = kD * kD;
  std::vector<double> init(b.size(), 0.0), s(tile), next(tile);
  int64_t first = 0;
  for (size_t n = 0; n < last.size(); ++n) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t e = 0; e < tile; ++e) s[e] = h0 ? h0[(n * H + h) * tile + e] : 0.0;
      for (int64_t i = first; i <= last[n]; ++i) {
        for (int64_t e = 0; e < tile; ++e) init[(i * H + h) * tile + e] = s[e];
        if (i == last[n]) break;
        const float* P = &phi[(i * H + h) * tile];
        const float* B = &b[(i * H + h) * tile];
        for (int64_t r = 0; r < kD; ++r)
          for (int64_t c = 0; c < kD; ++c) {
            double acc = B[r * kD + c];
            for (int64_t k = 0; k < kD; ++k) acc += double(P[r * kD + k]) * s[k * kD + c];
            next[r * kD + c] = acc;
          }
        s.swap(next);
      }
    }
    first = last[n] + 1;
  }
  return init;
}

}  // namespace

int main() {
  if (!have_sm90_device()) return kExitSkip;
  const std::vector<int64_t> last = {2, 3, 5};  // segments 0-2, 3, 4-5
  const int64_t N = static_cast<int64_t>(last.size()), S = 6, H = 2, tile = kD * kD;
  std::mt19937 rng(77);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> phi(S * H * tile), b(S * H * tile), h0(N * H * tile), out(S * H * tile);
  for (auto& x : phi) x = dist(rng) * 0.08f;  // ~unit-norm maps (128^-1/2 scale)
  for (auto& x : b) x = dist(rng);
  for (auto& x : h0) x = dist(rng);

  float *d_phi = nullptr, *d_b = nullptr, *d_h0 = nullptr, *d_init = nullptr;
  int64_t* d_last = nullptr;
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_phi), phi.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_b), b.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_h0), h0.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_init), out.size() * sizeof(float)));
  CUDA_OK(cudaMalloc(reinterpret_cast<void**>(&d_last), last.size() * sizeof(int64_t)));
  CUDA_OK(cudaMemcpy(d_phi, phi.data(), phi.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_b, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_h0, h0.data(), h0.size() * sizeof(float), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_last, last.data(), last.size() * sizeof(int64_t), cudaMemcpyHostToDevice));

  // phi, b, h0 (set below), init, last, last_dtype, num_seqs, segments, heads, head_dim_k, head_dim_v
  flashqla_gdn_cp_scan_params_t p{d_phi, d_b, nullptr, d_init, d_last, FLASHQLA_INT64, N, S, H, kD, kD};
  int fails = 0;
  for (int with_h0 = 0; with_h0 < 2; ++with_h0) {
    p.h0 = with_h0 ? d_h0 : nullptr;
    CUDA_OK(cudaMemset(d_init, 0xff, out.size() * sizeof(float)));  // poison: NaN bit pattern
    const flashqla_status_t st = flashqla_gdn_cp_scan(&p, nullptr);
    if (st != FLASHQLA_SUCCESS) {
      std::fprintf(stderr, "flashqla_gdn_cp_scan: %s: %s\n", flashqla_status_string(st), flashqla_last_error());
      return 1;
    }
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(out.data(), d_init, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < out.size(); ++i)
      if (!std::isfinite(out[i])) {
        std::fprintf(stderr, "FAIL: element %zu not written (%f)\n", i, out[i]);
        return 1;
      }
    const std::vector<double> ref = host_scan(phi, b, with_h0 ? h0.data() : nullptr, last, H);
    const double rel = rel_l2(ref, out);
    std::printf("cp scan (%s h0): rel. L2 %.2e\n", with_h0 ? "with" : "without", rel);
    if (!(rel < 1e-5)) ++fails;
  }
  // A bad parameter comes back as a status plus a message, not a crash.
  p.last_dtype = FLASHQLA_INT32;
  const bool rejects = flashqla_gdn_cp_scan(&p, nullptr) == FLASHQLA_ERROR_UNSUPPORTED;
  if (!rejects) std::fprintf(stderr, "FAIL: an int32 'last' was not rejected\n");
  cudaFree(d_phi);
  cudaFree(d_b);
  cudaFree(d_h0);
  cudaFree(d_init);
  cudaFree(d_last);
  return fails == 0 && rejects ? 0 : 1;
}
