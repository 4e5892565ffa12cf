"""Bad input gets a clear exception that names the argument."""
import re

import pytest
import torch

import flashqla
from util import make_inputs


def good(**over):
    d = make_inputs(1, 70, 2, 4, 32, 32, dtype=torch.bfloat16, seed=1)
    d["initial_state"] = d["initial_state"].float()
    d.update(over)
    return d


def call(**over):
    d = good(**over)
    kw = {k: d.pop(k) for k in list(d) if k not in ("q", "k", "v", "g", "beta")}
    return flashqla.chunk_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"], **kw)


def expect(match, exc=ValueError, **over):
    with pytest.raises(exc, match=match):
        call(**over)


def test_valid_call_runs():
    o, s = call(output_final_state=True)
    assert o.shape == (1, 70, 4, 32) and o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_rank_and_shape():
    d = good()
    expect(r"q must be 4-D", q=d["q"][0])
    expect(r"k must have q's shape", k=d["k"][:, :, :1])
    expect(r"v must be \[B, T, H_v, V\]", v=d["v"][:, :60])
    expect(r"g must be \[B, T, H_v\]", g=d["g"][..., :3])
    expect(r"beta must be 3-D", beta=d["beta"][..., None])
    expect(r"beta must be \[B, T, H_v\]", beta=d["beta"][:, :10])
    expect(r"q must be a torch.Tensor", TypeError, q=[1, 2])


def test_group_ratio():
    d = good()
    expect(r"H_v = 3 must be a multiple of the q/k heads H_qk = 2", v=d["v"][:, :, :3], g=d["g"][..., :3],
           beta=d["beta"][..., :3], initial_state=d["initial_state"][:, :3])


def test_head_dims():
    d = make_inputs(1, 10, 1, 1, 24, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"K \(q/k head dim\) = 24 is not supported: head dims must be multiples of 16"):
        flashqla.chunk_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"])
    d = make_inputs(1, 10, 1, 1, 32, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"V \(v head dim\) = 512 is not supported.*256"):
        flashqla.chunk_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"])


def test_dtypes():
    d = good()
    expect(r"k must have q's dtype torch.bfloat16", k=d["k"].half())
    expect(r"v must have q's dtype", v=d["v"].float())
    expect(r"q must be one of", q=d["q"].to(torch.int32), k=d["k"].to(torch.int32), v=d["v"].to(torch.int32))
    expect(r"g must be one of float32, bfloat16, float64", g=d["g"].half())
    expect(r"beta must be one of", beta=d["beta"].to(torch.int64))
    expect(r"initial_state must be float32, got torch.bfloat16", initial_state=d["initial_state"].bfloat16())


def test_devices():
    d = good()
    expect(r"g is on meta but q is on cpu", g=d["g"].to("meta"))
    expect(r"initial_state is on meta but q is on cpu", initial_state=d["initial_state"].to("meta"))
    expect(r"cu_seqlens is on meta", cu_seqlens=torch.tensor([0, 70], device="meta"))


def test_cu_seqlens_metadata():
    d = make_inputs(2, 30, 1, 1, 16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens requires batch size B == 1.*got B = 2"):
        flashqla.chunk_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=torch.tensor([0, 30]))
    expect(r"cu_seqlens must be int32 or int64, got torch.float32", cu_seqlens=torch.tensor([0.0, 70.0]))
    expect(r"cu_seqlens must be 1-D with N \+ 1 >= 2", cu_seqlens=torch.tensor([[0, 70]]))
    expect(r"cu_seqlens must be 1-D with N \+ 1 >= 2", cu_seqlens=torch.tensor([0]))
    expect(r"cu_seqlens must be a torch.Tensor", TypeError, cu_seqlens=[0, 70])


def test_cu_seqlens_values():
    s1 = good()["initial_state"]
    expect(r"cu_seqlens\[0\] must be 0, got 5", cu_seqlens=torch.tensor([5, 70], dtype=torch.int32))
    s2 = torch.cat([s1, s1])
    expect(r"cu_seqlens must be non-decreasing, but cu_seqlens\[2\] = 20 < cu_seqlens\[1\] = 40",
           cu_seqlens=torch.tensor([0, 40, 20]), initial_state=s2)
    expect(r"cu_seqlens\[-1\] = 80 exceeds the number of tokens T = 70", cu_seqlens=torch.tensor([0, 80]))
    expect(r"cu_seqlens_cpu\[-1\] = 90 exceeds", cu_seqlens=torch.tensor([0, 70]),
           cu_seqlens_cpu=torch.tensor([0, 90]))


def test_initial_state_shape():
    d = good()
    h = d["initial_state"]
    expect(re.escape("initial_state must be [N, H_v, K, V] = (2, 4, 32, 32) with N = len(cu_seqlens) - 1"),
           cu_seqlens=torch.tensor([0, 30, 70]), initial_state=h)
    expect(r"initial_state must be 4-D", initial_state=h[0])


def test_scale_and_head_first():
    expect(r"scale must be a finite number", scale=float("nan"))
    expect(r"scale must be a finite number", scale="0.1")
    expect(r"head_first=True is not supported", head_first=True)


def test_cumsum_validation():
    g = torch.randn(1, 10, 2)
    with pytest.raises(ValueError, match="chunk_size must be one of 16, 32, 64, 128"):
        flashqla.chunk_local_cumsum(g, chunk_size=48)
    with pytest.raises(ValueError, match=r"cu_seqlens requires batch size B == 1"):
        flashqla.chunk_local_cumsum(torch.randn(2, 10, 2), cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"g must be 3-D"):
        flashqla.chunk_local_cumsum(torch.randn(10, 2))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 11 exceeds"):
        flashqla.chunk_local_cumsum(g, cu_seqlens=torch.tensor([0, 11]))
