// Shared by the C++ examples: CUDA error checks and the "no sm_90 GPU" skip.
#pragma once

#include <cstdio>

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
