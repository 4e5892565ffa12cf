// Kernel launches with programmatic dependent launch (PDL, sm_90): a kernel launched through launch_kernel may be
// scheduled while the grid before it in the stream is still finishing, so that its CTAs are resident on the SMs
// that grid frees and start the moment it completes, instead of after the launch latency (~1-3 us a kernel
// boundary: the forward is two to four kernels, a short call ~50-100 us).
//
// The contract, for every kernel launched this way: its first statement is pdl_begin(), before any read or write
// of global memory, so nothing it touches can race with the grid before it (whoever launched that: a torch kernel,
// another flashqla kernel). Kernels launched with <<<>>> keep the plain stream order; pdl_begin() is a no-op there.
#pragma once

#include <cstdlib>
#include <utility>

#include <cuda_runtime.h>

#include <cutlass/cutlass.h>

namespace flashqla {

// griddepcontrol.wait: until every grid this one depends on has completed and its memory is visible;
// launch_dependents: the next grid may now be scheduled (its CTAs wait in their own pdl_begin, taking only
// resources this grid no longer needs: all of this grid's CTAs are resident by the time every one has issued it).
CUTLASS_DEVICE void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// FLASHQLA_PDL=0 launches every kernel in plain stream order (read per launch, like the other switches).
inline bool pdl_mode() {
  const char* e = std::getenv("FLASHQLA_PDL");
  return !(e != nullptr && e[0] == '0');
}

// kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute (pdl_mode); the launch's error, as
// cudaGetLastError would give it.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_mode() ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace flashqla
