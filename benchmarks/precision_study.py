"""Where may a kernel round to bf16? Emulates the forward's per-chunk arithmetic on
the CPU with bf16 rounding at chosen points (fp32 accumulation elsewhere), for
v1's three-product chain and v2's two-product chain
    v1: S' = gamma_C S + K^T bf16(diag(gamma_C/gamma) V_new)
    v2: S' = gamma_C S + bf16(X)^T bf16(bf16(diag(gamma_C/gamma) V) - gamma_C K S),  X = diag(beta) A^T K
and prints relative L2 errors of o and the final state against the float64
recurrence (the issue-4 bars: o <= 3.2e-3, final state <= 3.0e-3, FLA's).
    python benchmarks/precision_study.py [T ...]
"kept fp32" names the intermediates left unrounded in a variant (see ROUNDED).
"""
import sys

import torch
import torch.nn.functional as F

from flashqla.reference import recurrent_gdn

C, D = 64, 128
bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731


def tf32(x):
    """Round fp32 to tf32 (10 mantissa bits, nearest even), as a tf32 tensor-core operand is."""
    i = x.float().contiguous().view(torch.int32)
    i = (i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF
    return i.view(torch.float32)


def inputs(T, H, strong, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = bf(F.normalize(r(1, T, H, D), dim=-1))
    k = bf(F.normalize(r(1, T, H, D), dim=-1))
    v = bf(r(1, T, H, D))
    g = -5 * torch.rand(1, T, H, generator=gen) if strong else F.logsigmoid(r(1, T, H)) / 16
    if strong:
        g[..., 0] = 0
    beta = torch.rand(1, T, H, generator=gen).sigmoid()
    h0 = r(1, H, D, D)
    return q, k, v, g, beta, h0


ROUNDED = ("S", "M", "P", "Y", "Vn", "Z", "X", "Vdec", "Yp")
# rounded to bf16 only where a variant names them (fp32 in every kernel so far): "A", the gate-free inverse as
# FlashQLA's kkt_solve stores it (bf16) for its chain kernel to gate
OPT_ROUNDED = ("A",)


def emulate(q, k, v, g, beta, h0, chain, keep_fp32=(), scale=D ** -0.5, as_tf32=(), as_bf16=()):
    """chain: "v1" or "v2"; keep_fp32: names from ROUNDED left in fp32; as_tf32: names rounded to tf32; as_bf16:
    names from OPT_ROUNDED rounded to bf16."""
    assert set(as_bf16) <= set(OPT_ROUNDED), f"as_bf16 names come from {OPT_ROUNDED}"
    r = {name: (lambda x: x) if name in keep_fp32 else (tf32 if name in as_tf32 else bf) for name in ROUNDED}
    r.update({name: bf if name in as_bf16 else (lambda x: x) for name in OPT_ROUNDED})
    T, H = q.shape[1], q.shape[2]
    o = torch.zeros(T, H, D)
    S = h0[0].clone()                                      # [H, K, V] fp32
    mask = torch.ones(C, C, dtype=torch.bool).tril()
    for c0 in range(0, T, C):
        n = min(C, T - c0)
        pad = lambda x: torch.cat([x, x.new_zeros((C - n,) + x.shape[1:])], 0)  # noqa: E731
        Q, K, V = (pad(x[0, c0:c0 + n]).transpose(0, 1) for x in (q, k, v))   # [H, C, D]
        G = pad(g[0, c0:c0 + n]).t().cumsum(-1)                                # [H, C]
        b = pad(beta[0, c0:c0 + n]).t()
        gam, gC = G.exp(), G[:, -1:].exp()
        dte = (G[:, -1:] - G).exp()
        Gam = torch.where(mask, (G[:, :, None] - G[:, None, :]).masked_fill(~mask, 0).exp(), torch.zeros(()))
        KK = K @ K.transpose(-1, -2)
        L = (b[:, :, None] * KK).tril(-1)
        eye = torch.eye(C).expand_as(L)
        A = r["A"](torch.linalg.solve_triangular(eye + L, eye, upper=False, unitriangular=True))  # fp32
        M, P = r["M"](Gam * A), r["P"](Q @ K.transpose(-1, -2) * Gam)
        Sb = r["S"](S)
        KS, QS = K @ Sb, Q @ Sb
        Vn = M @ r["Y"](b[..., None] * (V - gam[..., None] * KS))
        O = scale * (gam[..., None] * QS + P @ r["Vn"](Vn))
        o[c0:c0 + n] = O.transpose(0, 1)[:n]
        if chain == "v1":
            S = gC[..., None] * S + K.transpose(-1, -2) @ r["Z"](dte[..., None] * Vn)
        else:
            X = r["X"](b[..., None] * (A.transpose(-1, -2) @ K))
            Yp = r["Yp"](r["Vdec"](dte[..., None] * V) - gC[..., None] * KS)
            S = gC[..., None] * S + X.transpose(-1, -2) @ Yp
    return o[None], S[None]


VARIANTS = [("v1", (), ()), ("v2", (), ()), ("v2", ("Yp",), ()), ("v2", ("Yp", "Vdec"), ()), ("v2", ("P",), ()),
            ("v2", ("Vn",), ()), ("v2", ("M",), ()), ("v2", ("Y",), ()), ("v2", ("S",), ()),
            ("v2", ("P", "Vn", "Yp"), ()), ("v2", ("Vdec",), ("X", "Yp")), ("v2", ("Vdec",), ("X", "Yp", "P", "Vn")),
            # a four-role chain kernel in FlashQLA's form (v1's three products; NOTES, session 46): its update's
            # operand Z in hi + lo (kept fp32), A as a kkt_solve-sized prep would store it (bf16) or in fp32
            ("v1", (), (), ("A",)), ("v1", ("Z",), ()), ("v1", ("Z",), (), ("A",)), ("v1", ("Z", "S"), ()),
            # our two-product chain with M formed from a bf16 inverse (a prep that writes only A's operand, the chain
            # gating it: M rounded twice; NOTES, session 47)
            ("v2", (), (), ("A",))]


def main():
    lengths = [int(x) for x in sys.argv[1:]] or [300, 2048]
    print(f"{'case':23s} {'variant (operands kept fp32 / rounded to tf32)':36s} {'o':>9s} {'final':>9s}")
    for T in lengths:
        for strong in (False, True):
            x = inputs(T, 2, strong)
            ro, rs = recurrent_gdn(*(t.double() for t in x[:5]), initial_state=x[5].double(),
                                   output_final_state=True)
            for chain, keep, t32, *opt in VARIANTS:
                b16 = opt[0] if opt else ()
                o, s = emulate(*x, chain, keep, as_tf32=t32, as_bf16=b16)
                eo = float((o.double() - ro).norm() / ro.norm())
                es = float((s.double() - rs).norm() / rs.norm())
                name = chain + ("" if not keep else " fp32:" + "+".join(keep)) + \
                    ("" if not t32 else " tf32:" + "+".join(t32)) + ("" if not b16 else " bf16:" + "+".join(b16))
                print(f"T={T:<6d} {'strong decay' if strong else 'g=logsig/16':16s} {name:36s} "
                      f"{eo:9.2e} {es:9.2e}", flush=True)

if __name__ == "__main__":
    main()
