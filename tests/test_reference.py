"""The two reference implementations agree in float64 (outputs, final state and
autograd gradients of every input), over awkward shapes."""
import pytest
import torch

from flashqla.reference import chunk_gdn_bwd_torch, chunk_gdn_torch, chunk_local_cumsum_torch, recurrent_gdn
from conftest import rel_l2
from util import make_inputs

TOL = 1e-10

CASES = [
    # B, T, H_qk, H_v, K, V, cu_seqlens, h0, strong decay, l2norm
    (2, 130, 2, 2, 16, 32, None, True, False, False),          # T not a multiple of 64, GVA 1
    (1, 40, 1, 2, 32, 16, None, False, False, False),          # T < 64, GVA 2, no h0
    (1, 200, 1, 3, 16, 16, [0, 0, 70, 70, 150, 190], True, False, False),  # zero-length seqs, tail past cu[-1], GVA 3
    (1, 100, 2, 8, 16, 16, None, True, True, False),           # GVA 4, strong decay, a g = 0 head
    (1, 150, 2, 4, 16, 16, [0, 64, 65, 150], True, True, True),  # exact-chunk, 1-token seq, l2norm in kernel
    (3, 64, 1, 1, 16, 16, None, True, False, False),           # exactly one chunk
]


@pytest.mark.parametrize("B,T,Hq,Hv,K,V,cu,h0,strong,l2", CASES)
def test_chunked_matches_recurrence_float64(B, T, Hq, Hv, K, V, cu, h0, strong, l2):
    n = None if cu is None else len(cu) - 1
    d = make_inputs(B, T, Hq, Hv, K, V, n_seqs=n, h0=h0, strong_decay=strong, seed=T + Hv)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    names = [x for x in ("q", "k", "v", "g", "beta", "initial_state") if d[x] is not None]
    leaves_a = {x: d[x].clone().requires_grad_(True) for x in names}
    leaves_b = {x: d[x].clone().requires_grad_(True) for x in names}
    kw = dict(output_final_state=True, cu_seqlens=cu_t, use_qk_l2norm_in_kernel=l2, scale=0.3)
    o_r, s_r = recurrent_gdn(**{**d, **leaves_a}, **kw)
    o_c, s_c = chunk_gdn_torch(**{**d, **leaves_b}, **kw)
    assert o_c.dtype == torch.float64 and s_c.dtype == torch.float64
    assert rel_l2(o_c, o_r) < TOL
    assert rel_l2(s_c, s_r) < TOL
    if cu is not None and cu[-1] < T:
        assert torch.all(o_c[:, cu[-1]:] == 0)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(s_r.shape, generator=gen, dtype=torch.float64)
    ga = torch.autograd.grad((o_r * do).sum() + (s_r * dht).sum(), [leaves_a[x] for x in names])
    gb = torch.autograd.grad((o_c * do).sum() + (s_c * dht).sum(), [leaves_b[x] for x in names])
    for name, a, b in zip(names, ga, gb):
        assert torch.isfinite(b).all(), name
        assert rel_l2(b, a) < TOL, name


@pytest.mark.parametrize("B,T,Hq,Hv,K,V,cu,h0,strong,l2", CASES)
def test_explicit_backward_matches_autograd_of_recurrence(B, T, Hq, Hv, K, V, cu, h0, strong, l2):
    n = None if cu is None else len(cu) - 1
    d = make_inputs(B, T, Hq, Hv, K, V, n_seqs=n, h0=h0, strong_decay=strong, seed=T + Hv + 1)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64)
    names = [x for x in ("q", "k", "v", "g", "beta", "initial_state") if d[x] is not None]
    leaves = {x: d[x].clone().requires_grad_(True) for x in names}
    kw = dict(cu_seqlens=cu_t, use_qk_l2norm_in_kernel=l2, scale=0.3)
    o_r, s_r = recurrent_gdn(**{**d, **leaves}, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(o_r.shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(s_r.shape, generator=gen, dtype=torch.float64)
    ref = dict(zip(names, torch.autograd.grad((o_r * do).sum() + (s_r * dht).sum(), [leaves[x] for x in names])))
    got = dict(zip(("q", "k", "v", "g", "beta", "initial_state"), chunk_gdn_bwd_torch(**d, do=do, dht=dht, **kw)))
    for name in names:
        assert got[name].dtype == d[name].dtype
        assert rel_l2(got[name], ref[name]) < TOL, name
    if d["initial_state"] is None:
        assert got["initial_state"] is None
    if cu is not None and cu[-1] < T:
        for name in ("q", "k", "v", "g", "beta"):
            assert torch.all(got[name][:, cu[-1]:] == 0), name


def test_zero_length_sequence_keeps_its_state():
    d = make_inputs(1, 50, 1, 2, 16, 16, n_seqs=3, seed=3)
    cu = torch.tensor([0, 50, 50, 50])
    _, s = chunk_gdn_torch(**d, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(s[1], d["initial_state"][1]) and torch.equal(s[2], d["initial_state"][2])


def test_gradcheck_chunked_float64():
    d = make_inputs(1, 20, 1, 2, 16, 16, n_seqs=2, seed=11)
    cu = torch.tensor([0, 7, 20])
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    xs = [d[n].clone().requires_grad_(True) for n in names]

    def f(*args):
        o, s = chunk_gdn_torch(*args[:5], initial_state=args[5], output_final_state=True, cu_seqlens=cu)
        return o, s

    assert torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-7, rtol=1e-5)


def _naive_cumsum(g, C, reverse, cu):
    B, T, H = g.shape
    out = torch.zeros(B, T, H, dtype=torch.float64)
    bounds = [(b, 0, T) for b in range(B)] if cu is None else [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    for b, s, e in bounds:
        for c0 in range(s, e, C):
            c1 = min(c0 + C, e)
            seg = g[b, c0:c1].double()
            out[b, c0:c1] = seg.flip(0).cumsum(0).flip(0) if reverse else seg.cumsum(0)
    return out


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("C", [16, 64])
@pytest.mark.parametrize("cu", [None, [0, 0, 30, 100, 100, 170]])
def test_chunk_local_cumsum_reference(reverse, C, cu):
    B = 2 if cu is None else 1
    g = torch.randn(B, 180, 5, dtype=torch.float64)
    out = chunk_local_cumsum_torch(g, C, reverse, None, None if cu is None else torch.tensor(cu))
    assert rel_l2(out, _naive_cumsum(g, C, reverse, cu)) < 1e-14


@pytest.mark.parametrize("seg", [1, 2, 3, 7])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3], CASES[4]])
def test_segment_scan_is_exact(seg, case):
    """Exact context parallelism (gdn-algorithm.md section 3): the two-level segment scan of the
    state chain, forward and reverse, equals the chunk-by-chunk chain."""
    B, T, Hq, Hv, K, V, cu, h0, strong, l2 = case
    n = None if cu is None else len(cu) - 1
    d = make_inputs(B, T, Hq, Hv, K, V, n_seqs=n, h0=h0, strong_decay=strong, seed=seg + T)
    kw = dict(cu_seqlens=None if cu is None else torch.tensor(cu), use_qk_l2norm_in_kernel=l2)
    o1, s1 = chunk_gdn_torch(**d, output_final_state=True, **kw)
    o2, s2 = chunk_gdn_torch(**d, output_final_state=True, segment_chunks=seg, **kw)
    assert rel_l2(o2, o1) < 1e-12 and rel_l2(s2, s1) < 1e-12
    do, dht = torch.randn_like(o1), torch.randn_like(s1)
    g1 = chunk_gdn_bwd_torch(**d, do=do, dht=dht, **kw)
    g2 = chunk_gdn_bwd_torch(**d, do=do, dht=dht, segment_chunks=seg, **kw)
    for a, b in zip(g1, g2):
        if a is not None:
            assert rel_l2(b, a) < 1e-12


def test_backward_state_chain_is_two_products_per_chunk():
    # The kernel form of the reverse chain (the blueprint of the backward dS kernel): per chunk
    #   dS = gamma_C dS' - R (K dS') + D,  R = K^T diag(gamma beta) M^T diag(gamma_C / gamma),
    #   D = scale Q^T diag(gamma) dO - K^T diag(gamma beta) M^T (scale P^T dO),   M = Gamma * A, P = Q K^T * Gamma:
    # the forward's chain (K S, then X^T Y) with R for X^T and D added; R and D do not depend on dS.
    from flashqla.reference import _gather_chunks, _prepare, chunk_gdn_bwd_torch
    d = make_inputs(1, 300, 2, 4, 16, 16, seed=5)
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(d["initial_state"].shape, generator=gen, dtype=torch.float64)
    dh0 = chunk_gdn_bwd_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], do, dht,
                              initial_state=d["initial_state"])[-1]
    P = _prepare(d["q"], d["k"], d["v"], d["g"], d["beta"], None, d["initial_state"], None, False, 64)
    dOc = _gather_chunks(do.reshape(300, 4, 16), P.tok_idx).permute(0, 2, 1, 3)
    Pm = (P.Qc @ P.Kc.transpose(-1, -2)) * P.Gamma
    U1 = P.scale * Pm.transpose(-1, -2) @ dOc
    T1 = P.scale * P.Qc.transpose(-1, -2) @ (P.gamma[..., None] * dOc)
    KtGbMt = P.Kc.transpose(-1, -2) @ ((P.gamma * P.bc)[..., :, None] * P.M.transpose(-1, -2))
    R = KtGbMt * P.dte[..., None, :]
    D = T1 - KtGbMt @ U1
    dS = dht[0]
    for c in reversed(range(P.NC)):
        dS = P.gamma_C[c][..., None] * dS - R[c] @ (P.Kc[c] @ dS) + D[c]
    assert (dS - dh0[0]).abs().max() < 1e-10


def test_chunk_state_grads_match_autograd():
    # chunk_state_grads_torch, the reference of the backward's dS kernel (chunk_gdn_bwd_dh): dh0 is autograd's
    # gradient of the initial state, dh[c] the gradient of the state at chunk c's end (the initial-state
    # gradient of the rest of its sequence), dh = dht on each sequence's last chunk, zero past the last chunk
    from flashqla.reference import chunk_state_grads_torch
    lens = [0, 70, 1, 200, 0, 129]
    d = make_inputs(1, sum(lens), 2, 4, 16, 16, n_seqs=len(lens), seed=31)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    gen = torch.Generator().manual_seed(32)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(d["initial_state"].shape, generator=gen, dtype=torch.float64)
    h0 = d["initial_state"].clone().requires_grad_(True)
    o, ht = recurrent_gdn(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0, output_final_state=True,
                          cu_seqlens=cu)
    (g_h0,) = torch.autograd.grad((o, ht), (h0,), (do, dht))
    dh, dh0 = chunk_state_grads_torch(d["q"], d["k"], d["g"], d["beta"], do, dht, cu_seqlens=cu)
    assert (dh0 - g_h0).abs().max() < 1e-10
    chunks = [-(-n // 64) for n in lens]
    first = [sum(chunks[:n]) for n in range(len(lens))]
    for n, c in enumerate(chunks):
        if c:
            assert torch.equal(dh[first[n] + c - 1], dht[n])
    assert dh[sum(chunks):].abs().max() == 0
    # sequence 3 (200 tokens): the state after its chunk 1 (token 128) drives tokens 128..199
    a, b = int(cu[3]) + 128, int(cu[4])
    sl = lambda x: x[:, a:b]  # noqa: E731
    s = torch.zeros(1, 4, 16, 16, dtype=torch.float64, requires_grad=True)
    o2, ht2 = recurrent_gdn(sl(d["q"]), sl(d["k"]), sl(d["v"]), sl(d["g"]), sl(d["beta"]), initial_state=s,
                            output_final_state=True)
    (g_s,) = torch.autograd.grad((o2, ht2), (s,), (sl(do), dht[3:4]))
    assert (dh[first[3] + 1] - g_s[0]).abs().max() < 1e-10


def test_backward_from_given_states_equals_the_explicit_backward():
    # the kernel path's contract: the chunk-start states and chunk-end state gradients in the kernels' layout
    # (chunks of all sequences in order, extra rows ignored even when garbage) give the explicit backward
    from flashqla.reference import (_prepare, _state_chain, chunk_gdn_bwd_from_states, chunk_gdn_bwd_torch,
                                    chunk_state_grads_torch)
    lens = [130, 0, 64, 1, 250]
    d = make_inputs(1, sum(lens), 2, 4, 16, 16, n_seqs=len(lens), seed=41)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    gen = torch.Generator().manual_seed(42)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(d["initial_state"].shape, generator=gen, dtype=torch.float64)
    P = _prepare(d["q"], d["k"], d["v"], d["g"], d["beta"], None, d["initial_state"], cu, False, 64)
    count = sum(-(-n // 64) for n in lens)
    states = _state_chain(P)[0][:count + 2].clone()
    states[count:] = float("nan")                                   # rows past the last chunk: ignored
    dh, dh0 = chunk_state_grads_torch(d["q"], d["k"], d["g"], d["beta"], do, dht, cu_seqlens=cu)
    got = chunk_gdn_bwd_from_states(d["q"], d["k"], d["v"], d["g"], d["beta"], do, states, dh[:count], dh0, dht,
                                    initial_state=d["initial_state"], cu_seqlens=cu)
    ref = chunk_gdn_bwd_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], do, dht, initial_state=d["initial_state"],
                              cu_seqlens=cu)
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.parametrize("v_blocks", [2, 4, 8])
def test_gradient_step_v_split_is_exact(v_blocks):
    # the fused reverse kernel's premise (NOTES, end of session 16): every V-dependent term of the chunk-local
    # step is a sum over V columns, so V blocks computed apart (their dV, and shares of dq, dk, dg, dbeta and the
    # C x C tiles dP, dM) and added give the unsplit step to float64 rounding. Packed sequences, GVA 2,
    # strong decay with a g = 0 head, states and state gradients from the reference chains
    from flashqla.reference import chunk_gdn_bwd_step, chunk_state_grads_torch, chunk_states_torch
    lens = [130, 0, 64, 200]
    d = make_inputs(1, sum(lens), 2, 4, 16, 32, n_seqs=len(lens), strong_decay=True, seed=7)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    do = torch.randn(d["v"].shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], do)
    states = chunk_states_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                cu_seqlens=cu)
    dh, _ = chunk_state_grads_torch(d["q"], d["k"], d["g"], d["beta"], do, None, cu_seqlens=cu)
    whole = chunk_gdn_bwd_step(*args, states, dh, cu_seqlens=cu)
    split = chunk_gdn_bwd_step(*args, states, dh, cu_seqlens=cu, v_blocks=v_blocks)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta"), split, whole):
        assert a.shape == b.shape
        assert rel_l2(a, b) < 1e-12, name


def _grad_kernel_phases(Q, K, V, dO, g, beta, S0, dS, scale):
    """csrc/flashqla/gdn_bwd_grad.cuh's phases for one 64-row chunk of one value head (zero-padded rows,
    g = beta = 0 there), in the kernel's order and forms, without rounding: (dq, dk, dv, dg, dbeta)."""
    G = g.cumsum(0)
    gamma, dte = G.exp(), (G[-1] - G).exp()
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    Gam = torch.where(mask, (G[:, None] - G[None, :]).masked_fill(~mask, 0).exp(), torch.zeros(()).double())
    KK, QK = K @ K.T, Q @ K.T
    A = torch.linalg.inv(torch.eye(64, dtype=Q.dtype) + (beta[:, None] * KK).tril(-1))
    M, P = Gam * A, QK * Gam
    KS = K @ S0                                                     # phase 3
    R = V - gamma[:, None] * KS
    Y = beta[:, None] * R
    Vn, dW = M @ Y, K @ dS                                          # phase 4
    dVn = scale * P.T @ dO + dte[:, None] * dW
    d_dte = (dW * Vn).sum(1)
    dK = dte[:, None] * (Vn @ dS.T)                                 # phase 5
    dP, dM = scale * dO @ Vn.T, dVn @ Y.T                           # phase 6
    dY = M.T @ dVn                                                  # phase 7
    dR = beta[:, None] * dY
    dbeta, d_gamma = (dY * R).sum(1), -(dR * KS).sum(1)
    dK = dK + (-gamma[:, None] * dR) @ S0.T                         # phase 8
    t = dO @ S0.T
    d_gamma = d_gamma + scale * (Q * t).sum(1)
    dQ = scale * gamma[:, None] * t
    H = Gam * (dP * QK + dM * A)                                    # phase 9
    dQK, dA = dP * Gam, dM * Gam
    dQ, dK = dQ + dQK @ K, dK + dQK.T @ Q                           # phase 10
    dL = -(A.T @ (dA @ A.T))                                        # phases 10-11
    dbeta = dbeta + (dL.tril(-1) * KK).sum(1)                       # phase 12
    dKK = beta[:, None] * dL.tril(-1)
    dK = dK + (dKK + dKK.T) @ K                                     # phase 13
    dG = gamma * d_gamma - dte * d_dte + H.sum(1) - H.sum(0)
    dG[-1] += (dte * d_dte).sum() + gamma[-1] * (S0 * dS).sum()
    return dQ, dK, dR, dG.flip(0).cumsum(0).flip(0), dbeta


def test_gradient_kernel_phase_algebra():
    # the gradient kernel's decomposition (d_gamma's Q S0 term as a row dot with dO S0^T, dte applied after
    # Vn dS'^T, dKK^T's symmetric sum, the gate chain) equals the reference's chunk-parallel step, float64
    from flashqla.reference import chunk_gdn_bwd_from_states, chunk_state_grads_torch, chunk_states_torch
    lens, Hq, Hv, D = [130, 64, 37], 1, 2, 16
    d = make_inputs(1, sum(lens), Hq, Hv, D, D, n_seqs=len(lens), seed=51)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    gen = torch.Generator().manual_seed(52)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    scale = 0.3
    states = chunk_states_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=scale,
                                initial_state=d["initial_state"], cu_seqlens=cu)
    dh, dh0 = chunk_state_grads_torch(d["q"], d["k"], d["g"], d["beta"], do, None, scale=scale, cu_seqlens=cu)
    ref = chunk_gdn_bwd_from_states(d["q"], d["k"], d["v"], d["g"], d["beta"], do, states, dh, dh0, None,
                                    scale=scale, initial_state=d["initial_state"], cu_seqlens=cu)
    T = sum(lens)
    out = [torch.zeros(1, T, Hv, D).double(), torch.zeros(1, T, Hv, D).double(), torch.zeros(1, T, Hv, D).double(),
           torch.zeros(1, T, Hv).double(), torch.zeros(1, T, Hv).double()]
    chunk = 0
    for s, n in enumerate(lens):
        t0 = int(cu[s])
        for c0 in range(0, n, 64):
            rows = min(64, n - c0)
            sl = slice(t0 + c0, t0 + c0 + rows)
            for h in range(Hv):
                pad = lambda x: torch.cat([x, x.new_zeros((64 - rows,) + tuple(x.shape[1:]))])  # noqa: E731
                hq = h // (Hv // Hq)
                res = _grad_kernel_phases(pad(d["q"][0, sl, hq]), pad(d["k"][0, sl, hq]), pad(d["v"][0, sl, h]),
                                          pad(do[0, sl, h]), pad(d["g"][0, sl, h]), pad(d["beta"][0, sl, h]),
                                          states[chunk, h], dh[chunk, h], scale)
                for o, r in zip(out, res):
                    o[0, sl, h] = r[:rows]
            chunk += 1
    dq, dk = (x.view(1, T, Hq, Hv // Hq, D).sum(3) for x in out[:2])
    for got, want in zip((dq, dk, out[2], out[3], out[4]), ref[:5]):
        assert (got - want).abs().max() < 1e-9
