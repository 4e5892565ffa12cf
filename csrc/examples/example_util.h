// Shared by the C++ examples: CUDA error checks and the "no sm_90 GPU" skip.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "flashqla/flashqla.h"

// ctest treats this exit code as "skipped" (SKIP_RETURN_CODE in CMakeLists.txt).
constexpr int kExitSkip = 77;

#define CUDA_OK(x)                                                                  \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s failed: %s\n", #x, cudaGetErrorString(e_));          \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

// Without a GPU cudaGetDeviceCount returns an error (no driver), not 0 devices: both mean skip.
inline bool have_sm90_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0 || flashqla_check_device(0) != FLASHQLA_SUCCESS) {
    std::printf("SKIP: no sm_90 GPU (%s)\n", flashqla_last_error());
    return false;
  }
  return true;
}

inline uint16_t to_bf16(float x) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
template <typename F>
inline double rel_l2(const std::vector<double>& ref, const std::vector<F>& got) {
  double e = 0, n = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e += (got[i] - ref[i]) * (got[i] - ref[i]);
    n += ref[i] * ref[i];
  }
  return std::sqrt(e / n);
}

// The dS chain's own fields of flashqla_gdn_bwd_dh_params_t for a packed [1, T, Hv, D] dO (its fwd part is
// the caller's): dO with its strides, dht in, dh and dh0 out.
inline void set_bwd_dh_io(flashqla_gdn_bwd_dh_params_t& p, const void* dout, int64_t T, int64_t Hv, int64_t D,
                          const float* dht, float* dh, float* dh0) {
  p.dout = dout;
  p.dout_stride_batch = T * Hv * D;
  p.dout_stride_time = Hv * D;
  p.dout_stride_head = D;
  p.dht = dht;
  p.dh = dh;
  p.dh0 = dh0;
}

// A packed batch for the GDN examples: host inputs (bf16 q/k/v with l2-normalised q/k rows, fp32 g, beta and
// a per-sequence state), their device copies, and the forward's parameter struct over them.
struct GdnProblem {
  static constexpr int D = 128;
  int Hq, Hv, T, N;
  std::vector<int32_t> cu;
  std::vector<uint16_t> q, k, v;
  std::vector<float> g, beta, h0;
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dcu = nullptr;
  float *dg = nullptr, *dbeta = nullptr, *dh0 = nullptr;

  GdnProblem(std::vector<int32_t> cu_, int hq, int hv, unsigned seed)
      : Hq(hq), Hv(hv), T(cu_.back()), N(static_cast<int>(cu_.size()) - 1), cu(std::move(cu_)),
        q(size_t(T) * Hq * D), k(size_t(T) * Hq * D), v(size_t(T) * Hv * D), g(size_t(T) * Hv),
        beta(size_t(T) * Hv), h0(size_t(N) * Hv * D * D) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::uniform_real_distribution<float> ud(0.f, 1.f);
    for (auto* x : {&q, &k})  // l2-normalised rows, as models feed them
      for (size_t r = 0; r < x->size() / D; ++r) {
        std::vector<float> row(D);
        double s = 0;
        for (auto& e : row) { e = nd(rng); s += e * e; }
        for (int d = 0; d < D; ++d) (*x)[r * D + d] = to_bf16(static_cast<float>(row[d] / std::sqrt(s)));
      }
    for (auto& e : v) e = to_bf16(nd(rng));
    for (auto& e : g) e = -0.1f * ud(rng);
    for (auto& e : beta) e = ud(rng);
    for (auto& e : h0) e = nd(rng);
  }
  float scale() const { return 1.f / std::sqrt(static_cast<float>(D)); }
  double kf(int t, int h, int i) const { return from_bf16(k[(size_t(t) * Hq + h / (Hv / Hq)) * D + i]); }
  double qf(int t, int h, int i) const { return from_bf16(q[(size_t(t) * Hq + h / (Hv / Hq)) * D + i]); }

  // Device copies; false on a CUDA error (printed).
  bool upload() {
    auto put = [](void** d, const void* h, size_t bytes) {
      cudaError_t e = cudaMalloc(d, bytes);
      if (e == cudaSuccess) e = cudaMemcpy(*d, h, bytes, cudaMemcpyHostToDevice);
      if (e != cudaSuccess) std::fprintf(stderr, "upload: %s\n", cudaGetErrorString(e));
      return e == cudaSuccess;
    };
    return put(&dq, q.data(), q.size() * 2) && put(&dk, k.data(), k.size() * 2) && put(&dv, v.data(), v.size() * 2) &&
           put(&dcu, cu.data(), cu.size() * 4) && put(reinterpret_cast<void**>(&dg), g.data(), g.size() * 4) &&
           put(reinterpret_cast<void**>(&dbeta), beta.data(), beta.size() * 4) &&
           put(reinterpret_cast<void**>(&dh0), h0.data(), h0.size() * 4);
  }
  ~GdnProblem() {
    for (void* x : {dq, dk, dv, dcu, static_cast<void*>(dg), static_cast<void*>(dbeta), static_cast<void*>(dh0)})
      cudaFree(x);
  }

  // The forward's struct over the device copies (o: `out`, v-shaped bf16; states left NULL).
  flashqla_gdn_fwd_params_t params(void* out) const {
    flashqla_gdn_fwd_params_t p{};
    p.q = dq; p.k = dk; p.v = dv; p.o = out;
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
    p.batch = 1; p.seqlen = T; p.heads_qk = Hq; p.heads_v = Hv; p.head_dim_k = D; p.head_dim_v = D;
    p.cu_seqlens = dcu; p.cu_seqlens_dtype = FLASHQLA_INT32; p.num_seqs = N;
    p.scale = scale();
    return p;
  }
};

// The backward examples' upstream gradients for `pr`: dO (bf16, v's layout) ~ N(0, 1), dht ~ N(0, 1) / 8.
inline void random_upstream_grads(const GdnProblem& pr, unsigned seed, std::vector<uint16_t>& dout,
                                  std::vector<float>& dht) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  dout.resize(pr.v.size());
  dht.resize(pr.h0.size());
  for (auto& e : dout) e = to_bf16(nd(rng));
  for (auto& e : dht) e = nd(rng) / 8;
}
