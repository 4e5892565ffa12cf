// Does compute-sanitizer racecheck order accesses across __syncthreads when some warps synchronised among
// themselves with a named barrier (bar.sync id, count) before? The gradient kernel does that (its aux warps,
// phases 1-2); racecheck reported hazards between its later __syncthreads-separated phases. Kernel `mixed`
// has that shape, `plain` is the same without the named barrier. Run under racecheck: a hazard reported in
// `mixed` and none in `plain` means racecheck misreads the pattern. Both check their result.
#include <cstdio>
#include <cuda_runtime.h>

template <bool kNamed>
__global__ void probe(float* out) {
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

int main() {
  float* d = nullptr;
  float h[256];
  if (cudaMalloc(&d, sizeof(h)) != cudaSuccess) return 2;
  int bad = 0;
  for (int named = 0; named < 2; ++named) {
    if (named) probe<true><<<1, 256>>>(d);
    else probe<false><<<1, 256>>>(d);
    if (cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost) != cudaSuccess) return 2;
    for (int t = 0; t < 256; ++t) {
      const int u = (t + 1) % 256, s = t % 128;
      const float want = 2.f * (255 - u) + 1.f + float(named ? 127 - s : s);
      bad += h[t] != want;
    }
    printf("racecheck probe %s: %s\n", named ? "mixed (named barrier, then __syncthreads)" : "plain",
           bad ? "WRONG RESULT" : "result ok");
  }
  cudaFree(d);
  return bad ? 1 : 0;
}
