"""Random inputs shared by the tests (never zeros)."""
import torch
import torch.nn.functional as F


def make_inputs(B, T, H_qk, H_v, K, V, dtype=torch.float64, device="cpu", n_seqs=None, h0=True,
                strong_decay=False, zero_gate_head=True, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = r(B, T, H_qk, K)
    k = F.normalize(r(B, T, H_qk, K), dim=-1)
    v = r(B, T, H_v, V)
    if strong_decay:
        g = -5.0 * torch.rand(B, T, H_v, generator=gen, dtype=torch.float64)
    else:
        g = F.logsigmoid(r(B, T, H_v)) / 4
    if zero_gate_head:
        g[..., 0] = 0.0  # a head that never decays
    beta = torch.rand(B, T, H_v, generator=gen, dtype=torch.float64).sigmoid()
    N = B if n_seqs is None else n_seqs
    s0 = r(N, H_v, K, V) if h0 else None
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), g=cast(g), beta=cast(beta),
                initial_state=None if s0 is None else s0.to(device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32))
