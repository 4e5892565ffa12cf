"""Reference implementations of chunked Gated DeltaNet (no custom kernels).

Two implementations of the same function (see ``shared/design/gdn-algorithm.md``):

* :func:`recurrent_gdn` - the token-by-token recurrence, in whatever dtype it is
  given (the tests run it in float64: it is the ground truth).
* :func:`chunk_gdn_torch` - the chunked, gate-free-inverse form (section 2),
  vectorised over chunks and heads with one short serial loop over chunk slots
  for the state chain. Differentiable through autograd. It is the fallback that
  ``flashqla.chunk_gdn`` runs where the sm_90a kernels cannot.

Both take the public layout: q, k ``[B, T, H_qk, K]``, v ``[B, T, H_v, V]``,
g, beta ``[B, T, H_v]``, initial_state ``[N, H_v, K, V]``, optional
``cu_seqlens`` ``[N + 1]`` with ``B == 1``. Value head ``h`` reads q/k head
``h // (H_v // H_qk)``. Positions past ``cu_seqlens[-1]`` produce zeros.

Neither synchronises with the device: sequence boundaries are turned into
gather indices with device-side ops whose sizes depend on shapes only.
"""
from __future__ import annotations

import torch

CHUNK = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's convention)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _compute_dtype(*xs) -> torch.dtype:
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def _expand_groups(x: torch.Tensor, h_v: int) -> torch.Tensor:
    """[..., H_qk, D] -> [..., H_v, D]: value head h reads q/k head h // r."""
    r = h_v // x.shape[-2]
    return x if r == 1 else x.repeat_interleave(r, dim=-2)


def _dense_cu_seqlens(B: int, T: int, device) -> torch.Tensor:
    return torch.arange(B + 1, device=device, dtype=torch.int64) * T


# ----------------------------------------------------------------------------
# (a) token-by-token recurrence
# ----------------------------------------------------------------------------
def recurrent_gdn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """Token-by-token gated delta rule. Computes in the inputs' promoted dtype
    (float32 for 16-bit inputs). Loops in Python over tokens: for tests only."""
    B, T, H_qk, K = q.shape
    H_v, V = v.shape[2], v.shape[3]
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q, k = _expand_groups(q, H_v), _expand_groups(k, H_v)
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in cu_seqlens.tolist()]
        bounds = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    zero = torch.zeros(H_v, V, dtype=dt, device=v.device)
    rows = [[zero] * T for _ in range(B)]  # positions outside every sequence stay zero
    finals = []
    for n, (b, s, e) in enumerate(bounds):
        S = (initial_state[n].to(dt) if initial_state is not None
             else torch.zeros(H_v, K, V, dtype=dt, device=v.device))
        for t in range(s, e):
            S = S * g[b, t].exp()[:, None, None]
            kt = k[b, t]
            u = (v[b, t] - torch.einsum("hk,hkv->hv", kt, S)) * beta[b, t][:, None]
            S = S + kt[:, :, None] * u[:, None, :]
            rows[b][t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, S)
        finals.append(S)
    o = torch.stack([torch.stack(r) if T else zero.new_zeros(0, H_v, V) for r in rows])
    final = torch.stack(finals) if output_final_state else None
    return o, final


# ----------------------------------------------------------------------------
# chunk bookkeeping shared by the chunked reference and the GPU fallback path
# ----------------------------------------------------------------------------
def chunk_layout(cu: torch.Tensor, T_total: int, chunk: int = CHUNK):
    """Map packed tokens to chunk slots without a host sync.

    Returns (tok_idx [NC, chunk], slot_seq [NC], slot_valid [NC], first [NC],
    inv_idx [T_total], last_slot [N], seq_len [N]), where NC = T_total // chunk + N + 1
    is a shape-only upper bound on the number of chunks. tok_idx points at
    T_total (a zero pad row) for padding, inv_idx at NC * chunk for tokens past
    cu[-1]. Out-of-range cu values are clamped so indices stay in bounds.
    """
    dev = cu.device
    cu = cu.to(torch.int64).clamp(0, T_total)
    cu = torch.cummax(cu, 0).values  # monotone even for bad input: never out of bounds
    N = cu.numel() - 1
    NC = T_total // chunk + N + 1
    seq_len = cu[1:] - cu[:-1]
    nchunks = (seq_len + chunk - 1) // chunk
    coff = torch.zeros(N + 1, dtype=torch.int64, device=dev)
    coff[1:] = torch.cumsum(nchunks, 0)
    c = torch.arange(NC, device=dev)
    slot_seq = torch.searchsorted(coff[1:], c, right=True).clamp(max=max(N - 1, 0))
    slot_valid = c < coff[N]
    j = c - coff[slot_seq]
    first = slot_valid & (j == 0)
    p = torch.arange(chunk, device=dev)
    tok = cu[slot_seq][:, None] + j[:, None] * chunk + p[None, :]
    tok_ok = slot_valid[:, None] & (tok < cu[slot_seq + 1][:, None])
    tok_idx = torch.where(tok_ok, tok, torch.full_like(tok, T_total))
    t = torch.arange(T_total, device=dev)
    t_seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=max(N - 1, 0))
    rel = t - cu[t_seq]
    inv = (coff[t_seq] + rel // chunk) * chunk + rel % chunk
    inv_idx = torch.where(t < cu[N], inv, torch.full_like(inv, NC * chunk))
    last_slot = (coff[1:] - 1).clamp(min=0)
    return tok_idx, slot_seq, slot_valid, first, inv_idx, last_slot, seq_len


def _gather_chunks(x: torch.Tensor, tok_idx: torch.Tensor) -> torch.Tensor:
    """[T, ...] -> [NC, chunk, ...] with zeros for padding."""
    pad = torch.cat([x, x.new_zeros((1,) + x.shape[1:])], 0)
    return pad[tok_idx]


def chunk_local_cumsum_torch(g, chunk_size=CHUNK, reverse=False, scale=None, cu_seqlens=None):
    """Chunk-local (inclusive) cumulative sum of g over T in fp32 (fp64 for fp64 input).

    g: [B, T, H]. Chunks restart at every sequence start. reverse=True sums from
    each position to the end of its chunk. Positions past cu_seqlens[-1] are zero.
    """
    B, T, H = g.shape
    dt = _compute_dtype(g)
    cu = cu_seqlens if cu_seqlens is not None else _dense_cu_seqlens(B, T, g.device)
    gf = g.to(dt).reshape(B * T, H)
    tok_idx, *_, inv_idx, _, _ = chunk_layout(cu, B * T, chunk_size)
    gc = _gather_chunks(gf, tok_idx)  # [NC, C, H]
    # padding rows are zero, so a reversed cumsum over the whole slot is chunk-exact
    out = gc.flip(1).cumsum(1).flip(1) if reverse else gc.cumsum(1)
    if scale is not None:
        out = out * scale
    out = torch.cat([out.reshape(-1, H), out.new_zeros(1, H)], 0)[inv_idx]
    return out.reshape(B, T, H)


# ----------------------------------------------------------------------------
# (b) chunked form (gate-free inverse), differentiable
# ----------------------------------------------------------------------------
def chunk_gdn_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=CHUNK):
    """Chunked gated delta rule, section 2 of gdn-algorithm.md.

    Per chunk (positions i, j, G = chunk-local cumsum of g, gamma = e^G, A =
    (I + StrictLower(diag(beta) K K^T))^-1, X = diag(beta) A^T K):
        S'    = gamma_C S + X^T (diag(gamma_C / gamma) V - gamma_C K S)
        V_new = (Gamma * A) diag(beta) (V - diag(gamma) K S)
        O     = scale (diag(gamma) Q S + (Q K^T * Gamma) V_new)
    Computes in float64 if any input is float64, else float32; o is returned in
    v's dtype, the final state in float32 (float64 for float64 inputs).
    """
    B, T, H_qk, K = q.shape
    H_v, V = v.shape[2], v.shape[3]
    C = chunk_size
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    dev = v.device
    cu = cu_seqlens if cu_seqlens is not None else _dense_cu_seqlens(B, T, dev)
    N = cu.numel() - 1
    BT = B * T
    tok_idx, slot_seq, slot_valid, first, inv_idx, last_slot, seq_len = chunk_layout(cu, BT, C)
    NC = tok_idx.shape[0]

    qf, kf = q.to(dt), k.to(dt)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    qf = _expand_groups(qf, H_v).reshape(BT, H_v, K)
    kf = _expand_groups(kf, H_v).reshape(BT, H_v, K)
    # chunked tensors, heads first: [NC, H, C, D]
    Qc = _gather_chunks(qf, tok_idx).permute(0, 2, 1, 3)
    Kc = _gather_chunks(kf, tok_idx).permute(0, 2, 1, 3)
    Vc = _gather_chunks(v.to(dt).reshape(BT, H_v, V), tok_idx).permute(0, 2, 1, 3)
    gc = _gather_chunks(g.to(dt).reshape(BT, H_v), tok_idx).permute(0, 2, 1)  # [NC, H, C]
    bc = _gather_chunks(beta.to(dt).reshape(BT, H_v), tok_idx).permute(0, 2, 1)

    G = gc.cumsum(-1)                       # padding has g = 0: repeats the last real G
    G_C = G[..., -1:]                       # [NC, H, 1]
    gamma = G.exp()
    gamma_C = G_C.exp()
    decay_to_end = (G_C - G).exp()          # gamma_C / gamma, <= 1
    mask_incl = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    # mask before exp (not clamp: clamp has no gradient at 0, which a g = 0 head hits)
    zero = torch.zeros((), dtype=dt, device=dev)
    Gamma = torch.where(mask_incl, torch.where(mask_incl, G[..., :, None] - G[..., None, :], zero).exp(), zero)
    KKt = Kc @ Kc.transpose(-1, -2)
    Lmat = (bc[..., :, None] * KKt).tril(-1)
    eye = torch.eye(C, dtype=dt, device=dev).expand_as(Lmat)
    A = torch.linalg.solve_triangular(eye + Lmat, eye, upper=False, unitriangular=True)
    X = bc[..., :, None] * (A.transpose(-1, -2) @ Kc)            # [NC, H, C, K]
    Vdec = decay_to_end[..., None] * Vc                            # diag(gamma_C/gamma) V

    # serial state chain over chunk slots (slots of one sequence are consecutive)
    if initial_state is not None:
        h0 = initial_state.to(dt)
    else:
        h0 = torch.zeros(N, H_v, K, V, dtype=dt, device=dev)
    S = torch.zeros(H_v, K, V, dtype=dt, device=dev)
    starts, ends = [], []
    for c in range(NC):
        # index_select with a device index: no host sync (h0[t] with a tensor t may sync)
        S = torch.where(first[c], torch.index_select(h0, 0, slot_seq[c:c + 1])[0], S)
        starts.append(S)
        KS = Kc[c] @ S                                               # [H, C, V]
        S_new = gamma_C[c][..., None] * S + X[c].transpose(-1, -2) @ (Vdec[c] - gamma_C[c][..., None] * KS)
        S = torch.where(slot_valid[c], S_new, S)
        ends.append(S)
    S0 = torch.stack(starts)                                         # [NC, H, K, V]

    KS = Kc @ S0
    Vnew = (Gamma * A) @ (bc[..., None] * (Vc - gamma[..., None] * KS))
    QKt = (Qc @ Kc.transpose(-1, -2)) * Gamma
    O = scale * (gamma[..., None] * (Qc @ S0) + QKt @ Vnew)        # [NC, H, C, V]
    O = O.permute(0, 2, 1, 3).reshape(NC * C, H_v, V)
    o = torch.cat([O, O.new_zeros(1, H_v, V)], 0)[inv_idx].reshape(B, T, H_v, V)

    final = None
    if output_final_state:
        if N > 0:
            ends = torch.stack(ends)[last_slot]
            final = torch.where((seq_len > 0)[:, None, None, None], ends, h0)
        else:
            final = h0
        if dt != torch.float64:
            final = final.float()
    return o.to(v.dtype), final
