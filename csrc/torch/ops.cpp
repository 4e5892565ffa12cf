// The only torch-facing C++ file: registers the flashqla ops with the PyTorch
// dispatcher (TORCH_LIBRARY) and forwards them to the torch-free C API. Python
// validates arguments first (flashqla/_validate.py); the checks here are a
// backstop that turns any C API failure into a Python exception.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "flashqla/flashqla.h"

namespace {

flashqla_dtype_t to_flashqla_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return FLASHQLA_FLOAT32;
    case at::kBFloat16: return FLASHQLA_BFLOAT16;
    case at::kHalf: return FLASHQLA_FLOAT16;
    case at::kInt: return FLASHQLA_INT32;
    case at::kLong: return FLASHQLA_INT64;
    default: TORCH_CHECK(false, "flashqla: unsupported dtype ", t, " for ", name);
  }
}

void check_status(flashqla_status_t st, const char* op) {
  TORCH_CHECK(st == FLASHQLA_SUCCESS, "flashqla.", op, " failed (", flashqla_status_string(st), "): ",
              flashqla_last_error());
}

at::Tensor chunk_local_cumsum_cuda(const at::Tensor& g, int64_t chunk_size, bool reverse, double scale,
                                   const std::optional<at::Tensor>& cu_seqlens) {
  TORCH_CHECK(g.is_cuda() && g.dim() == 3, "flashqla.chunk_local_cumsum: g must be a CUDA tensor [B, T, H]");
  c10::cuda::CUDAGuard guard(g.device());
  auto out = at::empty(g.sizes(), g.options().dtype(at::kFloat));
  flashqla_chunk_cumsum_params_t p{};
  p.g = g.data_ptr();
  p.g_dtype = to_flashqla_dtype(g.scalar_type(), "g");
  p.g_stride_batch = g.stride(0);
  p.g_stride_time = g.stride(1);
  p.g_stride_head = g.stride(2);
  p.out = out.data_ptr<float>();
  p.batch = g.size(0);
  p.seqlen = g.size(1);
  p.heads = g.size(2);
  if (cu_seqlens.has_value()) {
    const auto& cu = *cu_seqlens;
    TORCH_CHECK(cu.device() == g.device() && cu.dim() == 1 && cu.is_contiguous(),
                "flashqla.chunk_local_cumsum: cu_seqlens must be a contiguous 1-D tensor on g's device");
    p.cu_seqlens = cu.data_ptr();
    p.cu_seqlens_dtype = to_flashqla_dtype(cu.scalar_type(), "cu_seqlens");
    p.num_seqs = cu.numel() - 1;
  }
  p.chunk_size = static_cast<int32_t>(chunk_size);
  p.reverse = reverse ? 1 : 0;
  p.scale = static_cast<float>(scale);
  check_status(flashqla_chunk_local_cumsum(&p, c10::cuda::getCurrentCUDAStream(g.device().index()).stream()),
               "chunk_local_cumsum");
  return out;
}

}  // namespace

// Schemas are defined in Python (flashqla/_library.py) so that fake-tensor and
// CPU implementations exist even where this extension is not built.
TORCH_LIBRARY_IMPL(flashqla, CUDA, m) {
  m.impl("chunk_local_cumsum", &chunk_local_cumsum_cuda);
}

// `import flashqla._C` loads the library, which runs the registrations above.
static struct PyModuleDef flashqla_module = {PyModuleDef_HEAD_INIT, "_C", "flashqla CUDA kernels", -1, nullptr};
PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&flashqla_module); }
