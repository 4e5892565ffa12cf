"""Which implementation runs: the sm_90a kernels (flashqla._C) or the PyTorch
fallback. The kernels need the built extension and a compute-capability 9.0 GPU;
FLASHQLA_FORCE_FALLBACK=1 disables them."""
from __future__ import annotations

import functools
import importlib
import os
import warnings

import torch

from . import _library  # noqa: F401  (op schemas must exist before _C registers kernels)

try:
    _C = importlib.import_module("flashqla._C")
    EXTENSION_ERROR = None
except ImportError as e:  # not built (no CUDA toolkit at install time) or wrong torch ABI
    _C = None
    EXTENSION_ERROR = e


def extension_loaded() -> bool:
    return _C is not None


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def kernels_available(device: torch.device) -> bool:
    """True when flashqla's own kernels can run on `device` (no host sync)."""
    if _C is None or device.type != "cuda" or os.environ.get("FLASHQLA_FORCE_FALLBACK", "0") not in ("", "0"):
        return False
    return _is_sm90(device.index if device.index is not None else torch.cuda.current_device())


def why_no_kernels(device: torch.device) -> str:
    if _C is None:
        return f"the CUDA extension is not built ({EXTENSION_ERROR})"
    if os.environ.get("FLASHQLA_FORCE_FALLBACK", "0") not in ("", "0"):
        return "FLASHQLA_FORCE_FALLBACK is set"
    if device.type != "cuda":
        return f"the inputs are on {device.type}, not an sm_90 GPU"
    return f"{torch.cuda.get_device_name(device)} is not an sm_90 (Hopper) GPU"


_warned = set()


def warn_once(key: str, message: str):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
