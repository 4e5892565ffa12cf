"""Argument checks for the public API. Every failure is a ValueError / TypeError
that names the argument and what was expected. Shape/dtype/device checks read
only metadata; checks of cu_seqlens *values* read the data and so run only where
that costs no host sync on the GPU hot path (see check_cu_seqlens_values)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
BETA_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 16


def debug_enabled() -> bool:
    return os.environ.get("FLASHQLA_DEBUG", "0") not in ("", "0")


@dataclass(frozen=True)
class GDNShape:
    B: int
    T: int
    H_qk: int
    H_v: int
    K: int
    V: int
    N: int            # number of sequences (B, or len(cu_seqlens) - 1)
    varlen: bool


def _name_dtypes(ds) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in ds)


def _tensor(x, name: str, ndim: int, layout: str):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")
    return x


def check_head_dim(name: str, d: int):
    if d < HEAD_DIM_MULTIPLE or d > MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE:
        raise ValueError(f"{name} = {d} is not supported: head dims must be multiples of "
                         f"{HEAD_DIM_MULTIPLE} between {HEAD_DIM_MULTIPLE} and {MAX_HEAD_DIM}")


def check_cu_seqlens(cu_seqlens, B: int, device) -> int:
    """Metadata checks; returns the number of sequences N."""
    if cu_seqlens is None:
        return B
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor [N + 1] of int32/int64, got {type(cu_seqlens).__name__}")
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size B == 1 (pack the sequences along T), got B = {B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in INDEX_DTYPES:
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}: all inputs must share a device")
    return cu_seqlens.numel() - 1


def check_cu_seqlens_values(cu, total: int, name: str = "cu_seqlens"):
    """Value checks: reads the data (a host sync for a device tensor)."""
    c = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    if c[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {c[0]}")
    for i in range(1, len(c)):
        if c[i] < c[i - 1]:
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i}] = {c[i]} < {name}[{i - 1}] = {c[i - 1]}")
    if c[-1] > total:
        raise ValueError(f"{name}[-1] = {c[-1]} exceeds the number of tokens T = {total}")


def maybe_check_values(cu_seqlens, cu_seqlens_cpu, total: int, fallback: bool):
    """Value checks where they are free (host tensors) or asked for (fallback, FLASHQLA_DEBUG=1)."""
    if cu_seqlens is None:
        return
    # reading a device tensor during CUDA-graph capture would invalidate the capture: skip what needs it
    capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
    if cu_seqlens_cpu is not None:
        if not isinstance(cu_seqlens_cpu, torch.Tensor) or cu_seqlens_cpu.device.type != "cpu" \
                or cu_seqlens_cpu.shape != cu_seqlens.shape:
            raise ValueError(f"cu_seqlens_cpu must be a CPU tensor shaped like cu_seqlens {tuple(cu_seqlens.shape)}")
        check_cu_seqlens_values(cu_seqlens_cpu, total, "cu_seqlens_cpu")
        if debug_enabled() and not capturing and not torch.equal(cu_seqlens_cpu.to(torch.int64), cu_seqlens.cpu().to(torch.int64)):
            raise ValueError("cu_seqlens_cpu differs from cu_seqlens")
    elif cu_seqlens.device.type == "cpu" or ((fallback or debug_enabled()) and not capturing):
        check_cu_seqlens_values(cu_seqlens, total)


def check_like(x, name: str, like, shape=None, device=None):
    """A gradient argument: a floating tensor with `like`'s shape and device (or the given ones)."""
    shape = tuple(like.shape) if like is not None else tuple(shape)
    device = like.device if like is not None else device
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape}, got {type(x).__name__}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}: all inputs must share a device")


def validate_gdn(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> GDNShape:
    _tensor(q, "q", 4, "[B, T, H_qk, K]")
    _tensor(k, "k", 4, "[B, T, H_qk, K]")
    _tensor(v, "v", 4, "[B, T, H_v, V]")
    _tensor(g, "g", 3, "[B, T, H_v]")
    _tensor(beta, "beta", 3, "[B, T, H_v]")
    B, T, H_qk, K = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape [B, T, H_qk, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must be [B, T, H_v, V] with q's B = {B} and T = {T}, got {tuple(v.shape)}")
    H_v, V = v.shape[2], v.shape[3]
    if H_qk == 0 or H_v % H_qk:
        raise ValueError(f"the number of value heads H_v = {H_v} must be a multiple of the q/k heads H_qk = {H_qk}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, T, H_v):
            raise ValueError(f"{name} must be [B, T, H_v] = {(B, T, H_v)}, got {tuple(x.shape)}")
    check_head_dim("K (q/k head dim)", K)
    check_head_dim("V (v head dim)", V)

    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be one of {_name_dtypes(FLOAT_DTYPES)}, got {q.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if g.dtype not in GATE_DTYPES:
        raise ValueError(f"g must be one of {_name_dtypes(GATE_DTYPES)} (natural-log decay), got {g.dtype}")
    if beta.dtype not in BETA_DTYPES:
        raise ValueError(f"beta must be one of {_name_dtypes(BETA_DTYPES)}, got {beta.dtype}")

    dev = q.device
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != dev:
            raise ValueError(f"{name} is on {x.device} but q is on {dev}: all inputs must share a device")

    N = check_cu_seqlens(cu_seqlens, B, dev)
    if initial_state is not None:
        _tensor(initial_state, "initial_state", 4, "[N, H_v, K, V]")
        if tuple(initial_state.shape) != (N, H_v, K, V):
            what = "len(cu_seqlens) - 1" if cu_seqlens is not None else "B"
            raise ValueError(f"initial_state must be [N, H_v, K, V] = {(N, H_v, K, V)} with N = {what}, "
                             f"got {tuple(initial_state.shape)}")
        allowed = (torch.float32, torch.float64) if q.dtype == torch.float64 else (torch.float32,)
        if initial_state.dtype not in allowed:
            raise ValueError(f"initial_state must be float32, got {initial_state.dtype}")
        if initial_state.device != dev:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {dev}: "
                             "all inputs must share a device")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale \
                or scale in (float("inf"), float("-inf")):
            raise ValueError(f"scale must be a finite number or None (default K ** -0.5), got {scale!r}")
    return GDNShape(B, T, H_qk, H_v, K, V, N, cu_seqlens is not None)
