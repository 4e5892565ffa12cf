// Does compute-sanitizer racecheck order accesses across __syncthreads when some warps synchronised among
// themselves with a named barrier (bar.sync id, count) first? The gradient kernel does that (its aux warps,
// phases 1-2), and racecheck reported hazards between its later __syncthreads-separated phases (2-byte
// stores of one phase against ldmatrix reads of a later one). Two shapes, each with and without the named
// barrier: `scalar` (4-byte stores, scalar reads) and `ldsm` (the gradient kernel's: 2-byte stores by warps
// 0-3, __syncthreads, ldmatrix.x4 reads by all eight warps). Run under racecheck: hazards only in the
// named variants mean racecheck misreads the pattern. Every variant checks its result.
#include <cstdio>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

constexpr int kLd = 72;  // halves per tile row (64 + 8 padding, as the kernels' kLdC)

template <bool kNamed>
__global__ void scalar_probe(float* out) {
  __shared__ float a[256], b[128];
  const int t = threadIdx.x;
  if (t < 128) {  // warps 0-3 only, as the gradient kernel's aux warps
    a[t] = float(t);
    if (kNamed) asm volatile("bar.sync 1, 128;" ::: "memory");
    else __syncwarp();
    b[t] = kNamed ? a[127 - t] : a[t];
    if (kNamed) asm volatile("bar.sync 1, 128;" ::: "memory");
  }
  __syncthreads();
  a[t] = 2.f * t;
  __syncthreads();
  const float x = a[255 - t];  // another warp's element
  __syncthreads();
  a[t] = x + 1.f;  // WAR against the read above, ordered by the barrier
  __syncthreads();
  out[t] = a[(t + 1) % 256] + b[t % 128];
}

template <bool kNamed>
__global__ void ldsm_probe(float* out) {
  __shared__ __align__(16) __half tile[64 * kLd];
  const int t = threadIdx.x, w = t >> 5, lane = t & 31;
  if (t < 128) {
    if (kNamed) asm volatile("bar.sync 1, 128;" ::: "memory");
    for (int e = t; e < 64 * 64; e += 128) tile[(e >> 6) * kLd + (e & 63)] = __int2half_rn(((e >> 6) + (e & 63)) % 64);
    if (kNamed) asm volatile("bar.sync 1, 128;" ::: "memory");
  }
  __syncthreads();
  // warp w reads the 16 x 16 block at rows 16 (w % 4), columns 16 (w / 4)
  const __half* p = &tile[(16 * (w & 3) + (lane & 15)) * kLd + 16 * (w >> 2) + 8 * (lane >> 4)];
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(p));
  unsigned r[4];
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  float s = 0.f;
  for (int i = 0; i < 4; ++i) {
    const __half2 h = *reinterpret_cast<const __half2*>(&r[i]);
    s += __half2float(h.x) + __half2float(h.y);
  }
  out[t] = s;
}

static int check_scalar(const float* h, bool named) {
  int bad = 0;
  for (int t = 0; t < 256; ++t) {
    const int u = (t + 1) % 256, s = t % 128;
    bad += h[t] != 2.f * (255 - u) + 1.f + float(named ? 127 - s : s);
  }
  return bad;
}

static int check_ldsm(const float* h) {
  int bad = 0;
  for (int t = 0; t < 256; ++t) {
    const int w = t >> 5, lane = t & 31, r0 = 16 * (w & 3), c0 = 16 * (w >> 2);
    float s = 0.f;
    for (int m = 0; m < 4; ++m)  // matrix m: rows + 8 (m & 1), columns + 8 (m >> 1); lane gets row lane / 4
      for (int e = 0; e < 2; ++e) {
        const int row = r0 + 8 * (m & 1) + lane / 4, col = c0 + 8 * (m >> 1) + 2 * (lane % 4) + e;
        s += float((row + col) % 64);
      }
    bad += h[t] != s;
  }
  return bad;
}

int main() {
  float* d = nullptr;
  float h[256];
  if (cudaMalloc(&d, sizeof(h)) != cudaSuccess) return 2;
  int bad_all = 0;
  for (int v = 0; v < 4; ++v) {
    const bool named = v & 1, ldsm = v >> 1;
    if (!ldsm) named ? scalar_probe<true><<<1, 256>>>(d) : scalar_probe<false><<<1, 256>>>(d);
    else named ? ldsm_probe<true><<<1, 256>>>(d) : ldsm_probe<false><<<1, 256>>>(d);
    if (cudaGetLastError() != cudaSuccess || cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess)
      return 2;
    const int bad = ldsm ? check_ldsm(h) : check_scalar(h, named);
    bad_all += bad;
    printf("racecheck probe %s, %s: %s\n", ldsm ? "ldsm" : "scalar", named ? "named barrier first" : "plain",
           bad ? "WRONG RESULT" : "result ok");
    fflush(stdout);
  }
  cudaFree(d);
  return bad_all ? 1 : 0;
}
