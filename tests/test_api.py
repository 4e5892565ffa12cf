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


@pytest.mark.parametrize("final", [True, False])
def test_chunk_gdn_gradients_match_recurrence_float64(final):
    d = make_inputs(1, 150, 2, 4, 16, 16, n_seqs=3, seed=21, strong_decay=True)
    cu = torch.tensor([0, 40, 40, 130])
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    la = {n: d[n].clone().requires_grad_(True) for n in names}
    lb = {n: d[n].clone().requires_grad_(True) for n in names}
    o_r, s_r = recurrent_gdn(**la, output_final_state=True, cu_seqlens=cu)
    o, s = flashqla.chunk_gdn(**lb, output_final_state=final, cu_seqlens=cu)
    do = torch.randn_like(o_r)
    dht = torch.randn_like(s_r) if final else torch.zeros_like(s_r)
    ref = torch.autograd.grad((o_r * do).sum() + (s_r * dht).sum(), [la[n] for n in names])
    loss = (o * do).sum() + ((s * dht).sum() if final else 0)
    got = torch.autograd.grad(loss, [lb[n] for n in names])
    for n, a, b in zip(names, ref, got):
        assert rel_l2(b, a) < 1e-10, n


def test_gradcheck_through_public_api():
    d = make_inputs(1, 20, 1, 2, 16, 16, n_seqs=2, seed=12)
    cu = torch.tensor([0, 9, 20])
    xs = [d[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    f = lambda *a: flashqla.chunk_gdn(*a[:5], initial_state=a[5], output_final_state=True, cu_seqlens=cu,  # noqa
                                      use_qk_l2norm_in_kernel=True)
    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_low_level_pair_matches_autograd():
    d = make_inputs(2, 90, 1, 2, 32, 16, dtype=torch.bfloat16, seed=13)
    d["initial_state"] = d["initial_state"].float()
    o, s = flashqla.chunk_gdn_fwd(**d, output_final_state=True)
    assert not o.requires_grad
    do, dht = torch.randn_like(o), torch.randn_like(s)
    grads = flashqla.chunk_gdn_bwd(**d, do=do, dht=dht)
    leaves = {n: x.clone().requires_grad_(True) for n, x in d.items()}
    o2, s2 = flashqla.chunk_gdn(**leaves, output_final_state=True)
    auto = torch.autograd.grad((o2.float() * do.float()).sum() + (s2 * dht).sum(), list(leaves.values()))
    assert torch.equal(o, o2.detach()) and torch.equal(s, s2.detach())
    for (n, x), a, b in zip(d.items(), auto, grads):
        assert b.dtype == x.dtype and b.shape == x.shape and torch.isfinite(b.float()).all(), n
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match=r"do must have shape \(2, 90, 2, 16\)"):
        flashqla.chunk_gdn_bwd(**d, do=do[:, :10])
    with pytest.raises(ValueError, match=r"dht must have shape \(2, 2, 32, 16\)"):
        flashqla.chunk_gdn_bwd(**d, do=do, dht=dht[:1])


def test_torch_compile_fallback():
    d = make_inputs(1, 70, 1, 2, 16, 16, dtype=torch.float32, seed=3)
    f = torch.compile(flashqla.chunk_gdn)
    o, s = f(**d, output_final_state=True)
    o2, s2 = flashqla.chunk_gdn(**d, output_final_state=True)
    assert rel_l2(o, o2) < 1e-5 and rel_l2(s, s2) < 1e-5
    leaves = {k: v.clone().requires_grad_(True) for k, v in d.items()}
    o, s = f(**leaves, output_final_state=True)
    (o.sum() + s.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves.values())


def test_unsupported_head_dims_raise_on_the_kernel_gpu(monkeypatch):
    # where the sm_90a kernels run, K or V != 128 is a clear error (naming the escape hatch), not a slow fallback
    from flashqla import _backend, api
    monkeypatch.setattr(_backend, "kernels_available", lambda dev: True)
    d = make_inputs(1, 70, 2, 2, 64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"K = V = 128, got K = 64, V = 64.*FLASHQLA_FORCE_FALLBACK"):
        api.chunk_gdn(**d)


def test_bwd_dh_op_cpu_and_fake_shapes():
    # the backward's first op: the CPU implementation is the reference, the fake one has the same shapes
    # (a shape-only chunk bound: ceil(T / 64) + sequences for packed batches)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flashqla.reference import chunk_state_grads_torch
    gen = torch.Generator().manual_seed(3)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = r(1, 200, 2, 16), torch.nn.functional.normalize(r(1, 200, 2, 16), dim=-1)
    g, beta = torch.nn.functional.logsigmoid(r(1, 200, 4)), torch.rand(1, 200, 4, generator=gen, dtype=torch.float64)
    do, dht, cu = r(1, 200, 4, 16), r(2, 4, 16, 16), torch.tensor([0, 70, 200])
    dh, dh0, a = torch.ops.flashqla.chunk_gdn_bwd_dh(q, k, g, beta, do, dht, 0.25, cu, False, True, True)
    assert dh.shape == (6, 4, 16, 16) and dh0.shape == (2, 4, 16, 16) and a.shape == (1, 200, 4, 64)
    rdh, rdh0 = chunk_state_grads_torch(q, k, g, beta, do, dht, scale=0.25, cu_seqlens=cu)
    assert torch.equal(dh, rdh[:6]) and torch.equal(dh0, rdh0)
    # a: each chunk's (I + StrictLower(diag(beta) K K^T))^-1 by token row; here the second sequence's three
    # chunks (64, 64 and 2 rows) of value head 0 (which reads q/k head 0), against torch.linalg.inv
    for t0, n in ((70, 64), (134, 64), (198, 2)):
        kk, b = k[0, t0:t0 + n, 0], beta[0, t0:t0 + n, 0]
        L = torch.tril(b[:, None] * (kk @ kk.T), -1)
        A = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + L)
        assert (a[0, t0:t0 + n, 0, :n] - A).abs().max() < 1e-12 and not a[0, t0:t0 + n, 0, n:].any()
    with FakeTensorMode() as mode:
        f = mode.from_tensor
        fdh, fdh0, fa = torch.ops.flashqla.chunk_gdn_bwd_dh(f(q), f(k), f(g), f(beta), f(do), None, 0.25, f(cu),
                                                            False, False)
        assert fdh.shape == dh.shape and fdh0.shape == (0,) and fa.shape == (0,)
        # 16-bit inputs: the forward's chunk states in q's dtype, dh, dh0 and a fp32
        b = lambda t: f(t).bfloat16()  # noqa: E731
        bdh, bdh0, ba = torch.ops.flashqla.chunk_gdn_bwd_dh(b(q), b(k), f(g).float(), f(beta).float(), b(do),
                                                            f(dht).float(), 0.25, f(cu), False, True, True)
        st = torch.ops.flashqla.chunk_gdn_fwd_states(b(q), b(k), b(do), f(g).float(), f(beta).float(), 0.25, None,
                                                     f(cu), False)
        assert (bdh.dtype, bdh0.dtype, ba.dtype, st.dtype) == (torch.float32, torch.float32, torch.float32,
                                                               torch.bfloat16)
        assert st.shape == dh.shape


def test_fwd_pass_op_cpu_and_fake_shapes():
    # exact parallelism's pass op: the CPU implementation is the reference (v taken as zeros with zero_v; o
    # empty without write_o), the fake one has the same shapes
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flashqla.reference import chunk_gdn_torch
    d = make_inputs(1, 150, 2, 4, 16, 16, n_seqs=2, seed=23)
    cu = torch.tensor([0, 70, 150])
    ws = torch.empty(0, dtype=torch.uint8)
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25, d["initial_state"], cu, False, ws)
    o, s = torch.ops.flashqla.chunk_gdn_fwd_pass(*args, False, True, False)
    ro, rs = chunk_gdn_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=0.25, initial_state=d["initial_state"],
                             output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o, ro) and torch.equal(s, rs)
    o0, s0 = torch.ops.flashqla.chunk_gdn_fwd_pass(*args, True, False, True)
    _, rz = chunk_gdn_torch(d["q"], d["k"], torch.zeros_like(d["v"]), d["g"], d["beta"], scale=0.25,
                            initial_state=d["initial_state"], output_final_state=True, cu_seqlens=cu)
    assert o0.numel() == 0 and torch.equal(s0, rz)
    with FakeTensorMode() as mode:
        f = mode.from_tensor
        fo, fs = torch.ops.flashqla.chunk_gdn_fwd_pass(*(f(x) if isinstance(x, torch.Tensor) else x for x in args),
                                                       True, False, True)
        assert fo.shape == (0,) and fs.shape == s.shape


def test_cp_summaries_op_cpu_and_fake_shapes():
    # exact parallelism's two summaries in one op: on the CPU the reference's B (from zeros, v) and Phi (from eye,
    # v = 0); its schema and fake implementation pass opcheck
    from flashqla.reference import chunk_gdn_torch
    d = make_inputs(1, 150, 2, 4, 16, 16, n_seqs=2, seed=29)
    cu = torch.tensor([0, 70, 150])
    eye = torch.eye(16, dtype=torch.float64).expand(2, 4, 16, 16).contiguous()
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25, cu, True, torch.empty(0, dtype=torch.uint8), eye)
    b, phi = torch.ops.flashqla.chunk_gdn_cp_summaries(*args)
    kw = dict(scale=0.25, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    _, rb = chunk_gdn_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], **kw)
    _, rphi = chunk_gdn_torch(d["q"], d["k"], torch.zeros_like(d["v"]), d["g"], d["beta"], initial_state=eye, **kw)
    assert torch.equal(b, rb) and torch.equal(phi, rphi)
    res = torch.library.opcheck(torch.ops.flashqla.chunk_gdn_cp_summaries.default, args,
                                test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in res.values()), res


def _packed_bwd_case(seed):
    """Two packed sequences (70 + 80 tokens: a partial chunk each), 2/4 heads of 16: the inputs, cu_seqlens,
    an output gradient and a final-state gradient (float64)."""
    d = make_inputs(1, 150, 2, 4, 16, 16, n_seqs=2, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(d["v"].shape, generator=gen, dtype=d["v"].dtype)
    dht = torch.randn(2, 4, 16, 16, generator=gen, dtype=torch.float64) / 8
    return d, torch.tensor([0, 70, 150]), do, dht


def test_bwd_grad_op_cpu_and_fake_shapes():
    # the backward's gradient step: the CPU implementation is the reference's step (dq, dk per q/k head, summed
    # over each GVA group, before the l2norm backward), the fake one has the same shapes and dtypes
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flashqla import reference
    d, cu, do, dht = _packed_bwd_case(29)
    for l2 in (False, True):
        states = torch.ops.flashqla.chunk_gdn_fwd_states(d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25,
                                                         d["initial_state"], cu, l2)
        dh, dh0, a = torch.ops.flashqla.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], do, dht, 0.25, cu, l2,
                                                         True, True)
        out = torch.ops.flashqla.chunk_gdn_bwd_grad(d["q"], d["k"], d["v"], d["g"], d["beta"], do, states, dh, 0.25,
                                                    cu, l2, a)
        assert [t.shape for t in out] == [d["q"].shape, d["k"].shape, d["v"].shape, d["g"].shape, d["beta"].shape]
        dq, dk = out[0], out[1]
        if l2:  # the caller's l2norm backward, as flashqla.api does
            dq, dk = reference._l2norm_bwd(d["q"], dq), reference._l2norm_bwd(d["k"], dk)
        ref = reference.chunk_gdn_bwd_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], do, dht, scale=0.25,
                                            initial_state=d["initial_state"], cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=l2)
        for a, b in zip((dq, dk) + tuple(out[2:]), ref[:5]):
            assert (a - b).abs().max() < 1e-10
    half = [d[n].bfloat16() for n in ("q", "k", "v")] + [d["g"].float(), d["beta"].float(), do.bfloat16(),
                                                         states.bfloat16(), dh.float()]
    with FakeTensorMode() as mode:
        f = mode.from_tensor
        fo = torch.ops.flashqla.chunk_gdn_bwd_grad(*(f(d[n]) for n in ("q", "k", "v", "g", "beta")), f(do), f(states),
                                                   f(dh), 0.25, f(cu), True)
        assert [(t.shape, t.dtype) for t in fo] == [(t.shape, t.dtype) for t in out]
        # 16-bit inputs: dq, dk come in q's dtype, or in fp32 for the caller's l2norm backward
        h = [f(x) for x in half]
        for l2, want in ((False, torch.bfloat16), (True, torch.float32)):
            fo = torch.ops.flashqla.chunk_gdn_bwd_grad(*h, 0.25, f(cu), l2)
            assert [t.dtype for t in fo] == [want, want, torch.bfloat16, torch.float32, torch.float32]


def test_ops_pass_opcheck():
    # every op's schema (mutation and aliasing annotations) and its fake implementation against the CPU one,
    # through torch.library.opcheck, on a packed case with a partial chunk and GVA
    d, cu, do, dht = _packed_bwd_case(31)
    ops = torch.ops.flashqla
    base = (d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25)
    states = ops.chunk_gdn_fwd_states(*base, d["initial_state"], cu, True)
    dh, dh0, a = ops.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], do, dht, 0.25, cu, True, True, True)
    chains_args = (*base[:5], do, dht, 0.25, d["initial_state"], cu, True, True, True)
    # the two chains from one op: the same four tensors as the two ops, in that order
    for x, y in zip(ops.chunk_gdn_bwd_chains(*chains_args), (states, dh, dh0, a)):
        assert torch.equal(x, y)
    cases = [
        (ops.chunk_gdn_bwd_chains, chains_args),
        (ops.chunk_gdn_fwd, (*base, d["initial_state"], True, cu, True)),
        (ops.chunk_gdn_fwd_states, (*base, d["initial_state"], cu, True)),
        (ops.chunk_gdn_fwd_pass, (*base, d["initial_state"], cu, True, torch.empty(0, dtype=torch.uint8), False,
                                  True, False)),
        (ops.chunk_gdn_bwd_dh, (d["q"], d["k"], d["g"], d["beta"], do, dht, 0.25, cu, True, True, True)),
        (ops.chunk_gdn_bwd_grad, (*base[:5], do, states, dh, 0.25, cu, True, a)),
        (ops.chunk_local_cumsum, (d["g"], 64, False, 1.0, cu)),
        (ops.l2norm_bwd, (d["q"], torch.randn(d["q"].shape, dtype=torch.float64), cu)),
    ]
    for op, args in cases:
        res = torch.library.opcheck(op.default, args, test_utils=("test_schema", "test_faketensor"))
        assert all(v == "SUCCESS" for v in res.values()), (op, res)


def test_l2norm_bwd_op_cpu():
    # the l2norm backward's op (CPU: the reference's formula) against autograd through reference.l2norm in
    # float64, rows past cu_seqlens[-1] zeros whatever x holds there, and the fake implementation's shape and dtype
    from torch._subclasses.fake_tensor import FakeTensorMode
    from flashqla import reference
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 40, 3, 128, generator=gen, dtype=torch.float64)
    dy = torch.randn(1, 40, 3, 128, generator=gen, dtype=torch.float64)
    xr = x.clone().requires_grad_(True)
    (reference.l2norm(xr) * dy).sum().backward()
    cu = torch.tensor([0, 17, 33])
    x[:, 33:] = float("nan")
    out = torch.ops.flashqla.l2norm_bwd(x, dy, cu)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.allclose(out[:, :33], xr.grad[:, :33], rtol=1e-10, atol=1e-12)
    assert torch.equal(out[:, 33:], torch.zeros_like(out[:, 33:]))
    xb, dyf = x.bfloat16(), dy.float()
    with FakeTensorMode() as mode:
        fo = torch.ops.flashqla.l2norm_bwd(mode.from_tensor(xb), mode.from_tensor(dyf), None)
        assert fo.shape == x.shape and fo.dtype == torch.bfloat16
