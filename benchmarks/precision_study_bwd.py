"""What the backward's gradient kernel (csrc/flashqla/gdn_bwd_grad.cuh) costs in accuracy, before it runs on a
GPU: its phases re-stated in float64 (tests/test_reference.py::_grad_kernel_phases' algebra) with rounding at
the kernel's rounding points (bf16 operand tiles, tf32 for dL's products, bf16 outputs where the inputs are
bf16), fed with exact chunk states and state gradients, so the errors are the step's own. Prints relative L2
errors against the float64 backward next to FLA's on the anchor case (shared/anchors: dq 4.0e-3, dk 5.0e-3,
dv 3.5e-3, dg 2.9e-3, dbeta 2.7e-3).
    python benchmarks/precision_study_bwd.py [T ...]
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from flashqla.reference import chunk_gdn_bwd_torch, chunk_state_grads_torch, chunk_states_torch  # noqa: E402
from precision_study import bf, inputs, tf32  # noqa: E402

C, D = 64, 128
ROUNDED = ("S0", "dS", "M", "P", "Y", "Vn", "dVn", "dVnY", "dKS", "dQK", "sym", "tf32", "out")
# rounded only where a variant names them (fp32 / hi + lo in the kernels so far), for a fused reverse kernel in
# FlashQLA's form (NOTES, session 46): "A", the inverse in bf16 as a kkt_solve-sized prep stores it (every product
# that reads A, dL's included, then reads the rounded one); "dVnY1", dY's operand dVn as one bf16 part, not hi + lo.
# dG_C's term gamma_C <S0, dS'> (fp64 S0 and dS' unless named): "dot" with S0 in bf16 and dS' in fp32, as the
# kernel computes it; "dotb" with dS' in bf16 too; "doth" with dS' as stored in fp16 with a power-of-two scale per
# chunk-head tile (its largest magnitude to [2^14, 2^15)): what storing dS' in 16 bits instead of fp32 would cost
OPT_ROUNDED = ("A", "dVnY1", "dot", "dotb", "doth")


def fp16_scaled(x):
    """x through fp16 with one power-of-two scale for the whole tile (largest magnitude into [2^14, 2^15))."""
    m = float(x.abs().max())
    if m == 0.0:
        return x
    e = 15 - math.frexp(m)[1]  # (m = f 2^E, f in [0.5, 1): m 2^e = f 2^15)
    return (x * 2.0 ** e).half().double() * 2.0 ** -e


def step(Q, K, V, dO, g, beta, S0, dS, scale, r, dot=None):
    """One chunk of one value head, zero-padded to 64 rows; r[name] rounds an operand (identity: kept)."""
    G = g.cumsum(0)
    gamma, dte = G.exp(), (G[-1] - G).exp()
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    Gam = torch.where(mask, (G[:, None] - G[None, :]).masked_fill(~mask, 0).exp(), torch.zeros((), dtype=G.dtype))
    KK, QK = K @ K.T, Q @ K.T
    A = r["A"](torch.linalg.inv(torch.eye(C, dtype=Q.dtype) + (beta[:, None] * KK).tril(-1)))
    M, P = r["M"](Gam * A), r["P"](QK * Gam)
    S0b, dSb = r["S0"](S0), r["dS"](dS)
    KS = K @ S0b
    R = V - gamma[:, None] * KS
    Y = r["Y"](beta[:, None] * R)
    Vn, dW = M @ Y, K @ dSb
    dVn = scale * P.T @ dO + dte[:, None] * dW
    d_dte = (dW * Vn).sum(1)
    Vnb, dVnb, dVnY = r["Vn"](Vn), r["dVn"](dVn), r["dVnY"](dVn)
    dK = dte[:, None] * (Vnb @ dSb.T)
    dP, dM = scale * dO @ Vnb.T, dVnb @ Y.T
    dY = M.T @ dVnY  # dVn as hi + lo in the kernel
    dR = beta[:, None] * dY
    dbeta, d_gamma = (dY * R).sum(1), -(dR * KS).sum(1)
    dK = dK + r["dKS"](-gamma[:, None] * dR) @ S0b.T
    t = dO @ S0b.T
    d_gamma = d_gamma + scale * (Q * t).sum(1)
    dQ = scale * gamma[:, None] * t
    H = Gam * (dP * QK + dM * A)
    dQK, dA = r["dQK"](dP * Gam), dM * Gam
    dQ, dK = dQ + dQK @ K, dK + dQK.T @ Q
    t32 = r["tf32"]
    dL = -(t32(A.T) @ t32(t32(dA) @ t32(A.T)))
    dbeta = dbeta + (dL.tril(-1) * KK).sum(1)
    dKK = beta[:, None] * dL.tril(-1)
    dK = dK + r["sym"](dKK + dKK.T) @ K
    dG = gamma * d_gamma - dte * d_dte + H.sum(1) - H.sum(0)
    dG[-1] += (dte * d_dte).sum() + gamma[-1] * (dot(S0, dS) if dot else (S0 * dS).sum())
    return dQ, dK, dR, dG.flip(0).cumsum(0).flip(0), dbeta


def run(T, strong, keep=(), seed=0, opt=()):
    assert set(opt) <= set(OPT_ROUNDED), f"opt names come from {OPT_ROUNDED}"
    q, k, v, g, beta, h0 = (x.double() for x in inputs(T, 2, strong, seed))
    gen = torch.Generator().manual_seed(seed + 1)
    do = bf(torch.randn(1, T, 2, D, generator=gen)).double()
    dht = (torch.randn(1, 2, D, D, generator=gen) / 8).double()
    scale = D ** -0.5
    cu = torch.tensor([0, T])
    states = chunk_states_torch(q, k, v, g, beta, scale=scale, initial_state=h0, cu_seqlens=cu)
    dh, _ = chunk_state_grads_torch(q, k, g, beta, do, dht, scale=scale, cu_seqlens=cu)
    ref = chunk_gdn_bwd_torch(q, k, v, g, beta, do, dht, scale=scale, initial_state=h0, cu_seqlens=cu)
    hilo = lambda x: bf(x) + bf(x - bf(x))  # noqa: E731  (an operand split into two bf16 parts)
    rnd = {n: (lambda x: x) if n in keep else (tf32 if n == "tf32" else
                                               hilo if n == "dVnY" and "dVnY1" not in opt else bf)
           for n in ROUNDED}
    rnd["A"] = bf if "A" in opt else (lambda x: x)
    r = {n: (lambda f: lambda x: f(x.float()).double())(f) for n, f in rnd.items()}
    dot = None
    if {"dot", "dotb", "doth"} & set(opt):
        ds16 = (lambda x: x.float().double()) if "dot" in opt else \
            (lambda x: bf(x.float()).double()) if "dotb" in opt else fp16_scaled
        dot = lambda s0, ds: (bf(s0.float()).double() * ds16(ds)).sum()  # noqa: E731
    outs = [torch.zeros(T, 2, D).double(), torch.zeros(T, 2, D).double(), torch.zeros(T, 2, D).double(),
            torch.zeros(T, 2).double(), torch.zeros(T, 2).double()]
    for ci, c0 in enumerate(range(0, T, C)):
        n = min(C, T - c0)
        pad = lambda x: torch.cat([x, x.new_zeros((C - n,) + tuple(x.shape[1:]))])  # noqa: E731
        for h in range(2):
            res = step(pad(q[0, c0:c0 + n, h]), pad(k[0, c0:c0 + n, h]), pad(v[0, c0:c0 + n, h]),
                       pad(do[0, c0:c0 + n, h]), pad(g[0, c0:c0 + n, h]), pad(beta[0, c0:c0 + n, h]),
                       states[ci, h], dh[ci, h], scale, r, dot)
            for o, x in zip(outs, res):
                o[c0:c0 + n, h] = x[:n]
    errs = []
    for i, (o, want) in enumerate(zip(outs, ref[:5])):
        got = r["out"](o) if i < 3 else o  # dq, dk, dv leave in the inputs' bf16; dg, dbeta in fp32
        errs.append(float((got - want[0]).norm() / want[0].norm()))
    return errs


def main():
    lengths = [int(x) for x in sys.argv[1:]] or [300]
    print(f"{'case':22s} {'kept in fp32/fp64':18s} " + " ".join(f"{n:>9s}" for n in ("dq", "dk", "dv", "dg", "dbeta")))
    for T in lengths:
        for strong in (False, True):
            for keep, opt in (((), ()), (("out",), ()), (("S0", "dS"), ()), (("Y", "Vn", "dVn"), ()),
                              (("dKS", "dQK", "sym", "M", "P"), ()), (ROUNDED, ()),
                              ((), ("A",)), ((), ("dVnY1",)), ((), ("A", "dVnY1")),
                              ((), ("dot",)), ((), ("dotb",)), ((), ("doth",))):
                e = run(T, strong, keep, opt=opt)
                name = f"T={T} {'strong decay' if strong else 'g=logsig/16'}"
                label = ("+".join(keep) if keep != ROUNDED else "all") + ("" if not opt else " bf16:" + "+".join(opt))
                print(f"{name:22s} {label:18s} " + " ".join(f"{x:9.2e}" for x in e))


if __name__ == "__main__":
    main()
