"""The public API on the fallback path: runs anywhere, matches float64, warns once,
and its ops have fake-tensor implementations (torch.compile / FakeTensor)."""
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashqla
from flashqla.reference import recurrent_gdn
from conftest import rel_l2
from util import make_inputs


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fallback_matches_float64(dtype, tol):
    d = make_inputs(1, 150, 2, 4, 32, 32, n_seqs=3, seed=5)
    cu = torch.tensor([0, 20, 20, 140], dtype=torch.int32)
    ref_o, ref_s = recurrent_gdn(**d, output_final_state=True, cu_seqlens=cu)
    x = {k: (v.to(dtype) if k in ("q", "k", "v") else v) for k, v in d.items()}
    if dtype != torch.float64:
        x["initial_state"] = x["initial_state"].float()
    o, s = flashqla.chunk_gated_delta_rule(**x, output_final_state=True, cu_seqlens=cu)
    assert o.dtype == dtype and o.shape == (1, 150, 4, 32)
    assert rel_l2(o, ref_o) < tol and rel_l2(s, ref_s) < tol
    assert torch.all(o[:, 140:] == 0)


def test_fallback_gradients_flow():
    d = make_inputs(2, 70, 1, 2, 16, 16, dtype=torch.float32, seed=2)
    leaves = {k: v.clone().requires_grad_(True) for k, v in d.items()}
    o, s = flashqla.chunk_gdn(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (o.square().sum() + s.sum()).backward()
    for k, v in leaves.items():
        assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0, k


def test_defaults_match_fla():
    d = make_inputs(1, 33, 1, 1, 16, 16, dtype=torch.float64, h0=False)
    o, s = flashqla.chunk_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"])
    assert s is None
    ref, _ = recurrent_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=16 ** -0.5)
    assert rel_l2(o, ref) < 1e-10


def test_fallback_warns_once():
    import flashqla._backend as b
    b._warned.clear()
    d = make_inputs(1, 10, 1, 1, 16, 16, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        flashqla.chunk_gdn(**d)
        flashqla.chunk_gdn(**d)
    msgs = [str(x.message) for x in w if "flashqla" in str(x.message)]
    assert len(msgs) == 1 and "PyTorch reference implementation" in msgs[0]


def test_fake_tensor_shapes():
    with FakeTensorMode():
        g = torch.empty(1, 1000, 8, dtype=torch.bfloat16)
        out = torch.ops.flashqla.chunk_local_cumsum(g, 64, False, 1.0, None)
        assert out.shape == (1, 1000, 8) and out.dtype == torch.float32


def test_cumsum_cpu_op_matches_reference():
    g = torch.randn(1, 300, 3)
    cu = torch.tensor([0, 100, 100, 250])
    a = torch.ops.flashqla.chunk_local_cumsum(g, 64, True, 2.0, cu)
    b = flashqla.chunk_local_cumsum(g, 64, reverse=True, scale=2.0, cu_seqlens=cu)
    assert torch.equal(a, b) and torch.all(a[:, 250:] == 0)


def test_fake_tensor_shapes_of_forward_op():
    with FakeTensorMode():
        q = torch.empty(1, 100, 2, 128, dtype=torch.bfloat16, device="cpu")
        v = torch.empty(1, 100, 4, 128, dtype=torch.bfloat16, device="cpu")
        g = torch.empty(1, 100, 4, device="cpu")
        cu = torch.empty(4, dtype=torch.int32, device="cpu")
        o, s = torch.ops.flashqla.chunk_gdn_fwd(q, q, v, g, g, 0.1, None, True, cu, False)
        assert o.shape == v.shape and s.shape == (3, 4, 128, 128)


@pytest.mark.parametrize("varlen", [False, True])
def test_empty_sequence_axis(varlen):
    # T == 0: no tokens, the final state is the initial state
    d = make_inputs(2, 0, 1, 2, 16, 16, dtype=torch.float32)
    cu = None
    if varlen:
        d = {k: (v[:1] if k != "initial_state" else v) for k, v in d.items()}
        cu = torch.tensor([0, 0, 0])
    o, s = flashqla.chunk_gdn(**d, output_final_state=True, cu_seqlens=cu)
    assert o.shape[1] == 0 and torch.equal(s, d["initial_state"])
