// Does compute-sanitizer's synccheck accept the O-beside chain's stage protocol by itself? (session 30: synccheck
// stopped the library's first O-beside launch with "Barrier error detected. Divergent thread(s) in block" at the
// loader's bar.sync on an empty-stage barrier; the SASS has WARPSYNC.ALL right before it, so the warp is converged.)
// This kernel keeps only the protocol, on the kernel's counts: 512 threads = state warps 0-3, O warps 4-7, two aux
// groups (warps 8-11, 12-15) taking alternate chunks. Per chunk c: the chunk's aux group fills stage c % 3 after
// syncing on empty barrier kEmpty + (c - 3) % 6 (state + O + one aux group: 384 threads), then arrives on full
// barrier kFull + c % 3 (+ state + O: 384), which the state and O warps sync on; they read the stage and, while
// c + 3 < n, arrive on kEmpty + c % 6 (mode 0, the kernel's forward) or the O warps sync there instead (mode 1, the
// kernel's summaries pass, whose O warps only keep the barriers in step). Mode 2 is mode 0 with a deliberate
// mismatch (the O warps arrive for every chunk, three arrivals too many at the end): synccheck should report that one.
// Mode 3: every consumer syncs on the empty barriers (no bar.arrive there), the control the tool must accept.
// Session 31's first run: synccheck reported "Divergent thread(s)" on modes 3 and 1 (more than one code site
// syncing on one barrier) and nothing on 0 and 2. Modes 4 and 5 are 3 and 1 with the non-aligned barrier.sync
// (no claim that the whole warp arrives at that instruction together): does the report go with .aligned?
// Mode 6: 3 with bar.sync on the full barriers too (no bar.arrive anywhere): racecheck reported hazards between the
// stage's writes and reads on modes 3 and 0 (0 wrong reads); are they gone when every barrier is a bar.sync?
// Every thread checks the values it read: a protocol fault shows as a wrong sum even without the sanitizer.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a benchmarks/synccheck_probe.cu -o /tmp/fq_sync_probe
//   compute-sanitizer --tool synccheck /tmp/fq_sync_probe <mode> <chunks> <blocks>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

namespace {
constexpr int kStages = 3, kRole = 128, kThreads = 4 * kRole;
enum : unsigned { kFull = 1, kEmpty = kFull + kStages, kIds = kEmpty + 6 };
static_assert(kIds <= 16, "named barrier ids");
constexpr unsigned kCount = 3 * kRole;  // state + O + one aux group, for both kinds of barrier

__device__ __forceinline__ void bar_sync(unsigned id, unsigned n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_sync_any(unsigned id, unsigned n) { asm volatile("barrier.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(unsigned id, unsigned n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__global__ void __launch_bounds__(kThreads, 1) probe(int mode, int n, unsigned* bad) {
  __shared__ int stage[kStages][kRole];
  const bool any = mode == 4 || mode == 5;  // modes 4, 5: 3, 1 with barrier.sync
  if (any) mode -= 2;
  const bool all_sync = mode == 6;  // mode 6: 3 with the aux groups syncing on the full barriers too (no arrive)
  if (all_sync) mode = 3;
  const int tid = threadIdx.x, role = tid / kRole, t = tid % kRole;
  unsigned wrong = 0;
  if (role >= 2) {  // the aux groups: chunks role - 2, role, ...
    for (int c = role - 2; c < n; c += 2) {
      if (c >= kStages) any ? bar_sync_any(kEmpty + (c - kStages) % 6, kCount) : bar_sync(kEmpty + (c - kStages) % 6, kCount);
      stage[c % kStages][t] = c * 1000 + t + blockIdx.x;
      if (all_sync) bar_sync(kFull + c % kStages, kCount);
      else bar_arrive(kFull + c % kStages, kCount);
    }
  } else {  // state (0) and O (1) warps
    for (int c = 0; c < n; ++c) {
      any ? bar_sync_any(kFull + c % kStages, kCount) : bar_sync(kFull + c % kStages, kCount);
      const int v = stage[c % kStages][(t * 7 + role) % kRole];
      if (v != c * 1000 + (t * 7 + role) % kRole + static_cast<int>(blockIdx.x)) ++wrong;
      if (c + kStages < n || mode == 2) {
        if ((mode == 1 && role == 1) || mode == 3)
          any ? bar_sync_any(kEmpty + c % 6, kCount) : bar_sync(kEmpty + c % 6, kCount);
        else bar_arrive(kEmpty + c % 6, kCount);
      }
    }
  }
  if (wrong) atomicAdd(bad, wrong);
}
}  // namespace

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0, n = argc > 2 ? std::atoi(argv[2]) : 37,
            blocks = argc > 3 ? std::atoi(argv[3]) : 16;
  unsigned* bad = nullptr;
  unsigned h = 0;
  if (cudaMalloc(&bad, sizeof(unsigned)) != cudaSuccess || cudaMemset(bad, 0, sizeof(unsigned)) != cudaSuccess) return 2;
  probe<<<blocks, kThreads>>>(mode, n, bad);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err == cudaSuccess) err = cudaMemcpy(&h, bad, sizeof(unsigned), cudaMemcpyDeviceToHost);
  std::printf("synccheck probe mode %d, %d chunks, %d blocks: %s, %u wrong reads\n", mode, n, blocks,
              cudaGetErrorString(err), h);
  return err == cudaSuccess && h == 0 ? 0 : 1;
}
