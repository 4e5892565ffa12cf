"""Locate the CUTLASS/CuTe headers flashqla compiles against.

CUTLASS is a dependency, not vendored. Pinned to the nvidia-cutlass wheel
(headers under cutlass_library/source/include); install it with
    pip install --no-deps nvidia-cutlass==4.2.0.0
or point CUTLASS_INCLUDE_DIR at a CUTLASS checkout's include/ directory.
Run as a script it prints the directory (CMakeLists.txt uses that).
"""
import importlib.util
import os
import sys

CUTLASS_PIN = "nvidia-cutlass==4.2.0.0"
_PROBE = os.path.join("cute", "tensor.hpp")


def find_cutlass_include():
    """Return the include directory, or raise RuntimeError saying how to get one."""
    env = os.environ.get("CUTLASS_INCLUDE_DIR")
    if env:
        if os.path.isfile(os.path.join(env, _PROBE)):
            return os.path.abspath(env)
        raise RuntimeError(f"CUTLASS_INCLUDE_DIR={env} has no {_PROBE}")
    spec = importlib.util.find_spec("cutlass_library")  # locates without importing
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            inc = os.path.join(base, "source", "include")
            if os.path.isfile(os.path.join(inc, _PROBE)):
                return inc
    raise RuntimeError(
        "CUTLASS/CuTe headers not found: run `pip install --no-deps " + CUTLASS_PIN + "` "
        "or set CUTLASS_INCLUDE_DIR to a CUTLASS include/ directory")


if __name__ == "__main__":
    try:
        print(find_cutlass_include())
    except RuntimeError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
