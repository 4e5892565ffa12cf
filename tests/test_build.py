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
    # each cubin's ELF header names its arch ("arch = sm_90a"); --list-elf's file names do not say it reliably (the
    # cuobjdump of Triton's wheel, CUDA 12.8, lists sm_90a cubins as *.sm_90.cubin). No PTX either.
    listing = subprocess.run([tool, "--list-elf", "--list-ptx", backend._C.__file__], capture_output=True, text=True,
                             check=True).stdout
    cubins = [line for line in listing.splitlines() if line.strip().endswith(".cubin")]
    assert cubins and not any(line.strip().endswith(".ptx") for line in listing.splitlines()), listing
    archs = []
    with subprocess.Popen([tool, "-elf", backend._C.__file__], stdout=subprocess.PIPE, text=True) as proc:
        archs = [line.split("=", 1)[1].strip() for line in proc.stdout if line.startswith("arch = ")]
    assert proc.returncode == 0 and len(archs) == len(cubins) and set(archs) == {"sm_90a"}, (archs, listing)


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


@needs_ext
def test_merge_entries_reject_bad_arguments_before_the_device():
    # the merges' C entries (exact parallelism's summaries as the source, the state recompute or the last pass as
    # the merging run): a missing or misaligned checkpoint buffer, a source with neither chunk states nor o, or
    # params that are neither merging run, are argument errors with a message, found before any device call
    lib = ctypes.CDLL(backend._C.__file__)
    lib.flashqla_last_error.restype = ctypes.c_char_p
    lib.flashqla_gdn_fwd_merge_bytes.restype = ctypes.c_size_t
    assert lib.flashqla_gdn_fwd_merge_bytes(None) == 0
    params = ctypes.create_string_buffer(4096)  # a zeroed flashqla_gdn_fwd_params_t (no o, no chunk states)
    assert lib.flashqla_gdn_fwd_merge_bytes(params) == 0  # (neither merging run)
    buf = ctypes.create_string_buffer(128)
    aligned = ctypes.c_void_p((ctypes.addressof(buf) + 31) // 32 * 32)
    cases = [
        (lib.flashqla_gdn_fwd_merge, (None, aligned, None, None), b"params is NULL"),
        (lib.flashqla_gdn_fwd_merge, (params, None, None, None), b"merge: checkpoints must be non-NULL"),
        (lib.flashqla_gdn_fwd_merge, (params, ctypes.c_void_p(aligned.value + 4), None, None),
         b"merge: checkpoints must be non-NULL"),
        (lib.flashqla_gdn_fwd_merge, (params, aligned, None, None), b"merge: prep_ready, and either"),
        (lib.flashqla_gdn_fwd_cp_summaries_merge_source, (params, None, None, None, None, None),
         b"cp_summaries_merge_source: checkpoints"),
        (lib.flashqla_gdn_fwd_cp_summaries_merge_source, (params, None, None, None, aligned, None),
         b"cp_summaries_merge_source: checkpoints"),  # (neither chunk_states nor o)
    ]
    for fn, args, message in cases:
        assert fn(*args) == 1, message  # FLASHQLA_ERROR_INVALID_ARGUMENT
        assert lib.flashqla_last_error().startswith(message), (lib.flashqla_last_error(), message)
