"""The build: extension present where CI requires it, sm_90a machine code only,
and the C API reachable from plain C (ctypes) with readable errors."""
import ctypes
import importlib.util
import os
import shutil
import subprocess

import pytest

import flashqla
import flashqla._backend as backend

def _cuobjdump():
    """The toolkit's cuobjdump, else the copy Triton's wheel carries."""
    cands = [shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    spec = importlib.util.find_spec("triton")
    if spec and spec.submodule_search_locations:
        cands.append(os.path.join(spec.submodule_search_locations[0], "backends", "nvidia", "bin", "cuobjdump"))
    return next((c for c in cands if c and os.path.exists(c)), None)


needs_ext = pytest.mark.skipif(not flashqla.extension_loaded(), reason="CUDA extension not built")


def test_extension_built_when_required():
    if os.environ.get("FLASHQLA_REQUIRE_CUDA") == "1":
        assert flashqla.extension_loaded(), f"extension failed to load: {backend.EXTENSION_ERROR}"


@needs_ext
def test_only_sm90a_code():
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not available")
    out = subprocess.run([tool, "--list-elf", backend._C.__file__], capture_output=True, text=True, check=True).stdout
    archs = {line.split(".")[-2] for line in out.splitlines() if line.strip().endswith(".cubin")}
    assert archs == {"sm_90a"}, out


@needs_ext
def test_c_api_errors_are_readable():
    lib = ctypes.CDLL(backend._C.__file__)
    lib.flashqla_last_error.restype = ctypes.c_char_p
    lib.flashqla_status_string.restype = ctypes.c_char_p
    lib.flashqla_version.restype = ctypes.c_char_p
    assert lib.flashqla_version().decode() == flashqla.__version__
    st = lib.flashqla_chunk_local_cumsum(None, None)
    assert st == 1 and lib.flashqla_status_string(st) == b"invalid argument"
    assert lib.flashqla_last_error() == b"params is NULL"
