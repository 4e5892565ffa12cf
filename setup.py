"""Build flashqla: the Python package plus the sm_90a CUDA extension flashqla._C.

    pip install --no-build-isolation -e .

Environment:
  FLASHQLA_REQUIRE_CUDA=1   fail if the CUDA extension cannot be built (CI sets it)
  FLASHQLA_SKIP_CUDA=1      build the pure-Python package only (runs the fallback)
  CUTLASS_INCLUDE_DIR       CUTLASS include/ directory (default: the nvidia-cutlass wheel)
  MAX_JOBS                  parallel compile jobs (ninja)
The kernels are built for sm_90a only; any other device target is refused at
compile time (csrc/flashqla/common.h).
"""
import glob
import importlib.util
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "third_party"))
from cutlass import find_cutlass_include  # noqa: E402

REQUIRE = os.environ.get("FLASHQLA_REQUIRE_CUDA") == "1"
SKIP = os.environ.get("FLASHQLA_SKIP_CUDA") == "1"


def _fingerprint_source():
    """build/generated/flashqla_fingerprint.cpp: the digest of csrc/ compiled into the extension (benchmark
    records carry it; flashqla/_fingerprint.py). Rewritten only when the digest changes, so that ninja rebuilds
    this one file and nothing else."""
    spec = importlib.util.spec_from_file_location("_fingerprint", os.path.join(ROOT, "flashqla", "_fingerprint.py"))
    fp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fp)
    rel = os.path.join("build", "generated", "flashqla_fingerprint.cpp")
    path, text = os.path.join(ROOT, rel), fp.source_file(fp.tree_fingerprint(ROOT))
    old = open(path).read() if os.path.exists(path) else None
    if old != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    return rel


def _find_cuda_home():
    # /usr/local/bin/nvcc can be a shim whose parent lacks include/: prefer a real toolkit root
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if cand and os.path.isfile(os.path.join(cand, "bin", "nvcc")) and \
                os.path.isfile(os.path.join(cand, "include", "cuda_runtime.h")):
            return cand
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


def _extensions():
    if SKIP:
        return [], {}
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        msg = "flashqla: no CUDA toolkit found; building the pure-Python package (fallback only)"
        if REQUIRE:
            raise RuntimeError(msg.replace("; building", "; FLASHQLA_REQUIRE_CUDA=1 forbids"))
        print(msg, file=sys.stderr)
        return [], {}
    os.environ["CUDA_HOME"] = cuda_home
    # torch's arch detection needs a GPU and would pick sm_90 (no wgmma): name the target
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sources = sorted(glob.glob("csrc/flashqla/*.cu") + glob.glob("csrc/flashqla/*.cpp")
                     + glob.glob("csrc/torch/*.cpp")) + [_fingerprint_source()]
    nvcc = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
            "--expt-extended-lambda", "-lineinfo", "-DNDEBUG", "-Xptxas=--warn-on-spills"]
    ext = CUDAExtension(
        name="flashqla._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc"), find_cutlass_include()],
        extra_compile_args={"cxx": ["-O3", "-std=c++20", "-DNDEBUG"], "nvcc": nvcc},
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="flashqla",
    version="0.1.0",
    description="Gated DeltaNet chunked-prefill kernels for NVIDIA Hopper (sm_90a)",
    packages=find_packages(include=["flashqla", "flashqla.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy"],
    extras_require={"bench": ["matplotlib"], "test": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
