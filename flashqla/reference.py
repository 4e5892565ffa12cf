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

from types import SimpleNamespace

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
# (b) chunked form (gate-free inverse): forward differentiable through autograd,
#     and an explicit backward (gdn-algorithm.md section 4) with the structure the
#     backward kernels follow: state recompute, reverse dS chain, chunk-local grads.
# ----------------------------------------------------------------------------
def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, C):
    """Everything that does not depend on the state, per chunk slot [NC, H_v, C, ...]."""
    B, T, H_qk, K = q.shape
    H_v, V = v.shape[2], v.shape[3]
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    dev = v.device
    cu = cu_seqlens if cu_seqlens is not None else _dense_cu_seqlens(B, T, dev)
    N, BT = cu.numel() - 1, B * T
    tok_idx, slot_seq, slot_valid, first, inv_idx, last_slot, seq_len = chunk_layout(cu, BT, C)
    P = SimpleNamespace(B=B, T=T, H_qk=H_qk, H_v=H_v, K=K, V=V, N=N, C=C, NC=tok_idx.shape[0], dt=dt, dev=dev,
                        scale=K ** -0.5 if scale is None else scale, tok_idx=tok_idx, slot_seq=slot_seq,
                        slot_valid=slot_valid, first=first, inv_idx=inv_idx, last_slot=last_slot, seq_len=seq_len)
    qf, kf = q.to(dt), k.to(dt)
    if use_qk_l2norm_in_kernel:
        qf, kf = l2norm(qf), l2norm(kf)
    chunked = lambda x, D: _gather_chunks(_expand_groups(x, H_v).reshape(BT, H_v, D), tok_idx).permute(0, 2, 1, 3)
    P.Qc, P.Kc = chunked(qf, K), chunked(kf, K)                    # [NC, H, C, K]
    P.Vc = _gather_chunks(v.to(dt).reshape(BT, H_v, V), tok_idx).permute(0, 2, 1, 3)
    gc = _gather_chunks(g.to(dt).reshape(BT, H_v), tok_idx).permute(0, 2, 1)  # [NC, H, C]
    P.bc = _gather_chunks(beta.to(dt).reshape(BT, H_v), tok_idx).permute(0, 2, 1)

    P.G = gc.cumsum(-1)                      # padding has g = 0: repeats the last real G
    G_C = P.G[..., -1:]
    P.gamma, P.gamma_C = P.G.exp(), G_C.exp()  # [NC, H, C], [NC, H, 1]
    P.dte = (G_C - P.G).exp()                # gamma_C / gamma <= 1, a difference of cumsums
    P.mask = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    # mask before exp (not clamp: clamp has no gradient at 0, which a g = 0 head hits)
    zero = torch.zeros((), dtype=dt, device=dev)
    P.Gamma = torch.where(P.mask, torch.where(P.mask, P.G[..., :, None] - P.G[..., None, :], zero).exp(), zero)
    P.KKt = P.Kc @ P.Kc.transpose(-1, -2)
    Lmat = (P.bc[..., :, None] * P.KKt).tril(-1)
    eye = torch.eye(C, dtype=dt, device=dev).expand_as(Lmat)
    P.A = torch.linalg.solve_triangular(eye + Lmat, eye, upper=False, unitriangular=True)
    P.M = P.Gamma * P.A                      # T = (I + D L D^-1)^-1 = Gamma * A
    P.h0 = (initial_state.to(dt) if initial_state is not None
            else torch.zeros(N, H_v, K, V, dtype=dt, device=dev))
    return P


def _slot_h0(P, h0_like, c):
    # index_select with a device index: no host sync (x[t] with a tensor t may sync)
    return torch.index_select(h0_like, 0, P.slot_seq[c:c + 1])[0]


def _state_chain(P, segment_chunks=None):
    """Forward chain over chunk slots: S' = gamma_C S + X^T (diag(gamma_C/gamma) V - gamma_C K S),
    X = diag(beta) A^T K. Returns the chunk-start states [NC, H, K, V] and the per-slot end states.
    segment_chunks=None walks the slots one by one; an integer uses the exact two-level
    segment scan of gdn-algorithm.md section 3 (same result, ~3 sqrt(NC) serial steps)."""
    X = P.bc[..., :, None] * (P.A.transpose(-1, -2) @ P.Kc)
    Vdec = P.dte[..., None] * P.Vc
    if segment_chunks is not None:
        eye = torch.eye(P.K, dtype=P.dt, device=P.dev)
        Phi = P.gamma_C[..., None] * (eye - X.transpose(-1, -2) @ P.Kc)   # S' = Phi S + Bc
        Bc = X.transpose(-1, -2) @ Vdec
        init = torch.index_select(P.h0, 0, P.slot_seq)
        return affine_chain(Phi, Bc, init, P.first, P.slot_valid, segment_chunks)
    S = torch.zeros(P.H_v, P.K, P.V, dtype=P.dt, device=P.dev)
    starts, ends = [], []
    for c in range(P.NC):  # slots of one sequence are consecutive
        S = torch.where(P.first[c], _slot_h0(P, P.h0, c), S)
        starts.append(S)
        KS = P.Kc[c] @ S
        S_new = P.gamma_C[c][..., None] * S + X[c].transpose(-1, -2) @ (Vdec[c] - P.gamma_C[c][..., None] * KS)
        S = torch.where(P.slot_valid[c], S_new, S)
        ends.append(S)
    return torch.stack(starts), torch.stack(ends)


def affine_chain(Phi, Bc, init, reset, valid, segment_chunks):
    """Exact parallel form of the chain  X_c = init_c if reset_c else E_{c-1};  E_c = Phi_c X_c + Bc_c
    (invalid slots: E_c = E_{c-1}), over slots c = 0..NC-1. Returns (X, E), each [NC, ...].

    Resets are folded into the maps, (Phi, Bc) -> (0, Phi init + Bc), so the chain becomes a
    plain affine recurrence whose maps compose associatively: (P2, Q2) o (P1, Q1) = (P2 P1,
    P2 Q1 + Q2). Two levels, as the context-parallel kernels do it: compose each segment of
    `segment_chunks` slots (parallel over segments), scan the segment summaries (serial,
    short), then replay each segment from its true start (parallel over segments).
    """
    NC, L = Phi.shape[0], max(1, int(segment_chunks))
    eye = torch.eye(Phi.shape[-1], dtype=Phi.dtype, device=Phi.device).expand_as(Phi)
    r, v = reset[:, None, None, None], valid[:, None, None, None]
    Bf = torch.where(r, Phi @ init + Bc, Bc)
    Pf = torch.where(r, torch.zeros_like(Phi), Phi)
    Pf, Bf = torch.where(v, Pf, eye), torch.where(v, Bf, torch.zeros_like(Bf))
    nseg = -(-NC // L)
    pad = nseg * L - NC
    if pad:
        Pf = torch.cat([Pf, eye[:1].expand((pad,) + Pf.shape[1:])], 0)
        Bf = torch.cat([Bf, Bf.new_zeros((pad,) + Bf.shape[1:])], 0)
    Pf = Pf.reshape((nseg, L) + Pf.shape[1:])
    Bf = Bf.reshape((nseg, L) + Bf.shape[1:])
    Pseg, Qseg = Pf[:, 0], Bf[:, 0]
    for j in range(1, L):                       # 1. segment summaries, parallel over segments
        Pseg, Qseg = Pf[:, j] @ Pseg, Pf[:, j] @ Qseg + Bf[:, j]
    E_in = [torch.zeros_like(Qseg[0])]
    for s in range(nseg - 1):                   # 2. scan over segments
        E_in.append(Pseg[s] @ E_in[-1] + Qseg[s])
    E = torch.stack(E_in)
    ends = []
    for j in range(L):                          # 3. replay each segment from its true start
        E = Pf[:, j] @ E + Bf[:, j]
        ends.append(E)
    ends = torch.stack(ends, 1).reshape((nseg * L,) + Bc.shape[1:])[:NC]
    prev = torch.cat([torch.zeros_like(ends[:1]), ends[:-1]], 0)
    starts = torch.where(r, init, prev)
    return starts, ends


def _final_states(P, ends, h0):
    if P.N == 0:
        return h0
    last = ends[P.last_slot]
    return torch.where((P.seq_len > 0)[:, None, None, None], last, h0)


def _to_tokens(P, x):
    """[NC, H, C, D] chunk-slot layout -> [B, T, H, D] (zeros past cu_seqlens[-1])."""
    D = x.shape[-1]
    flat = x.permute(0, 2, 1, 3).reshape(P.NC * P.C, P.H_v, D)
    return torch.cat([flat, flat.new_zeros(1, P.H_v, D)], 0)[P.inv_idx].reshape(P.B, P.T, P.H_v, D)


def chunk_gdn_torch(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=CHUNK, segment_chunks=None):
    """Chunked gated delta rule, section 2 of gdn-algorithm.md.

    Per chunk (positions i, j, G = chunk-local cumsum of g, gamma = e^G, A =
    (I + StrictLower(diag(beta) K K^T))^-1, X = diag(beta) A^T K):
        S'    = gamma_C S + X^T (diag(gamma_C / gamma) V - gamma_C K S)
        V_new = (Gamma * A) diag(beta) (V - diag(gamma) K S)
        O     = scale (diag(gamma) Q S + (Q K^T * Gamma) V_new)
    Computes in float64 if any input is float64, else float32; o is returned in
    v's dtype, the final state in float32 (float64 for float64 inputs).
    Differentiable through autograd; chunk_gdn_bwd_torch is the explicit backward.
    segment_chunks: None walks the chunks one by one; an integer runs the state chain as the
    exact segment scan (gdn-algorithm.md section 3) with segments of that many chunks.
    """
    P = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    S0, ends = _state_chain(P, segment_chunks)
    KS = P.Kc @ S0
    Vnew = P.M @ (P.bc[..., None] * (P.Vc - P.gamma[..., None] * KS))
    QKt = (P.Qc @ P.Kc.transpose(-1, -2)) * P.Gamma
    O = P.scale * (P.gamma[..., None] * (P.Qc @ S0) + QKt @ Vnew)  # [NC, H, C, V]
    o = _to_tokens(P, O)
    final = None
    if output_final_state:
        final = _final_states(P, ends, P.h0)
        if P.dt != torch.float64:
            final = final.float()
    return o.to(v.dtype), final


def _l2norm_bwd(x, dy, eps=L2NORM_EPS):
    """Gradient of y = x / sqrt(sum x^2 + eps) (last dim): rstd (dy - y <y, dy>)."""
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    y = x * rstd
    return rstd * (dy - y * (y * dy).sum(-1, keepdim=True))


@torch.no_grad()
def _bwd_setup(P, do, dht):
    """dO per chunk slot, dht (zeros if None), Q K^T and U1 = scale P^T dO (the S-independent part of dV_new)."""
    dOc = _gather_chunks(do.to(P.dt).reshape(P.B * P.T, P.H_v, P.V), P.tok_idx).permute(0, 2, 1, 3)
    dht_ = dht.to(P.dt) if dht is not None else torch.zeros_like(P.h0)
    QKt = P.Qc @ P.Kc.transpose(-1, -2)
    U1 = P.scale * (QKt * P.Gamma).transpose(-1, -2) @ dOc
    return dOc, dht_, QKt, U1


def _reverse_chain(P, do, dht, segment_chunks=None):
    """The backward's reverse chain over chunk slots (see chunk_gdn_bwd_torch): dSp[c] = the gradient of the
    state after slot c, dS_first[c] = before it; with the S-independent pieces the chunk-local step reuses."""
    dt = P.dt
    dOc, dht_, QKt, U1 = _bwd_setup(P, do, dht)
    T1 = P.scale * P.Qc.transpose(-1, -2) @ (P.gamma[..., None] * dOc)
    gb = (P.gamma * P.bc)[..., None]

    # reverse chain: dSp[c] = gradient of the state after slot c, dS_first[c] = before it
    is_last = P.slot_valid & (torch.arange(P.NC, device=P.dev) == P.last_slot[P.slot_seq])
    if segment_chunks is not None:
        eye = torch.eye(P.K, dtype=dt, device=P.dev)
        X = P.bc[..., :, None] * (P.A.transpose(-1, -2) @ P.Kc)
        PhiT = P.gamma_C[..., None] * (eye - P.Kc.transpose(-1, -2) @ X)  # the forward's Phi, transposed
        D = T1 - P.Kc.transpose(-1, -2) @ (gb * (P.M.transpose(-1, -2) @ U1))
        init = torch.index_select(dht_, 0, P.slot_seq)
        dSp, dS_first = affine_chain(PhiT.flip(0), D.flip(0), init.flip(0), is_last.flip(0),
                                     P.slot_valid.flip(0), segment_chunks)
        dSp, dS_first = dSp.flip(0), dS_first.flip(0)
    else:
        dS = torch.zeros(P.H_v, P.K, P.V, dtype=dt, device=P.dev)
        dSp, dS_first = [None] * P.NC, [None] * P.NC
        for c in range(P.NC - 1, -1, -1):
            dS = torch.where(is_last[c], _slot_h0(P, dht_, c), dS)
            dSp[c] = dS
            dVn = U1[c] + P.dte[c][..., None] * (P.Kc[c] @ dS)
            dS_new = P.gamma_C[c][..., None] * dS + T1[c] - P.Kc[c].transpose(-1, -2) @ (
                gb[c] * (P.M[c].transpose(-1, -2) @ dVn))
            dS = torch.where(P.slot_valid[c], dS_new, dS)
            dS_first[c] = dS
        dSp, dS_first = torch.stack(dSp), torch.stack(dS_first)
    return dOc, dht_, QKt, U1, dSp, dS_first


def _initial_state_grad(P, dS_first, dht_):
    """Each sequence's dS before its first chunk (dht for an empty sequence)."""
    first_slot = P.last_slot + 1 - (P.seq_len + P.C - 1) // P.C  # exact for non-empty sequences
    return torch.where((P.seq_len > 0)[:, None, None, None], dS_first[first_slot.clamp(max=P.NC - 1)], dht_)


def _valid_slots(P, x):
    """x [slots, ...] with the slots past the last chunk zeroed."""
    return torch.where(P.slot_valid[:, None, None, None], x, torch.zeros((), dtype=P.dt, device=P.dev))


def chunk_states_torch(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                       use_qk_l2norm_in_kernel=False, chunk_size=CHUNK):
    """The state at the start of every chunk, as the forward kernel writes it for the backward: [chunk slots,
    H_v, K, V] over the chunks of all sequences in order (slots past the last chunk are zero)."""
    P = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    S0, _ = _state_chain(P)
    return _valid_slots(P, S0)


def chunk_state_grads_torch(q, k, g, beta, do, dht=None, scale=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                            chunk_size=CHUNK):
    """The backward's first step as flashqla.chunk_gdn_bwd_dh lays it out: (dh, dh0) with dh[c] the gradient
    of the state at the end of chunk c, over the chunks of all sequences in order ([chunk slots, H_v, K, V];
    slots past the last chunk are zero), and dh0 the gradient of each sequence's initial state."""
    P = _prepare(q, k, do, g, beta, scale, None, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    *_, dht_, _, _, dSp, dS_first = _reverse_chain(P, do, dht)
    return _valid_slots(P, dSp), _initial_state_grad(P, dS_first, dht_)


def chunk_inverse_rows(q, k, g, beta, cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=CHUNK):
    """The chunk-local inverse A = (I + StrictLower(diag(beta) K K^T))^-1 by token row, as flashqla.chunk_gdn_bwd_dh
    writes it for the gradient kernel: [B, T, H_v, chunk], row t holding row (t's position in its chunk) of its
    chunk's A (zeros above the diagonal; zero rows past cu_seqlens[-1])."""
    B, T, H_v = beta.shape
    P = _prepare(q, k, q.new_zeros(B, T, H_v, 1), g, beta, None, None, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    return _to_tokens(P, P.A)


def _v_block_partials(P, Vc, S0, dSp, dOc, U1):
    """The chunk-local step's V-dependent part for one block of V columns (S0, dSp [.., K, Vb], Vc, dOc, U1 [.., C, Vb]):
    dV of those columns, and the block's shares of everything else, each a sum over V columns, so that the shares of
    disjoint blocks add up to the whole (a V-split kernel sums them across its CTAs; the rest is V-independent)."""
    KS = P.Kc @ S0
    R = Vc - P.gamma[..., None] * KS
    Y = P.bc[..., None] * R
    Vn = P.M @ Y
    dW = P.Kc @ dSp                                                  # from S' = ... + K^T diag(dte) V_new
    dVn = U1 + P.dte[..., None] * dW
    dY = P.M.transpose(-1, -2) @ dVn
    dR = P.bc[..., None] * dY
    return SimpleNamespace(
        dV=dR,
        d_dte=(dW * Vn).sum(-1),
        d_gammaC=(S0 * dSp).sum((-1, -2)),                           # [NC, H]
        d_gamma=P.scale * (dOc * (P.Qc @ S0)).sum(-1) - (dR * KS).sum(-1),
        dbeta=(dY * R).sum(-1),
        dP=P.scale * dOc @ Vn.transpose(-1, -2),
        dM=dVn @ Y.transpose(-1, -2),
        # dK's and dQ's products with the states: dte Vn dS'^T + dKS S0^T (dKS = -gamma dR), scale gamma dO S0^T
        dK=(P.dte[..., None] * Vn) @ dSp.transpose(-1, -2) - (P.gamma[..., None] * dR) @ S0.transpose(-1, -2),
        dQ=P.scale * P.gamma[..., None] * (dOc @ S0.transpose(-1, -2)))


def _chunk_local_token_grads(P, S0, dSp, dOc, QKt, U1, v_blocks=1):
    """The backward's chunk-parallel step on the token rows, in the computation dtype, from the chunk-start
    states S0 and the chunk-end state gradients dSp ([slots, H_v, K, V]): (dq, dk) with respect to the
    (normalised) q and k rows, summed over each GVA group's value heads, then dv, dg, dbeta. v_blocks > 1 runs the
    V-dependent part per block of V columns and adds the blocks' shares (the fused reverse kernel's V split:
    exact, every share is linear in its columns)."""
    dt = P.dt
    vb = P.V // v_blocks
    assert vb * v_blocks == P.V, "V blocks of equal width"
    blocks = [slice(b * vb, (b + 1) * vb) for b in range(v_blocks)]
    parts = [_v_block_partials(P, P.Vc[..., c], S0[..., c], dSp[..., c], dOc[..., c], U1[..., c]) for c in blocks]
    total = lambda name: sum(getattr(x, name) for x in parts)
    dV = torch.cat([x.dV for x in parts], -1)
    d_dte, d_gammaC, d_gamma, dbeta = total("d_dte"), total("d_gammaC"), total("d_gamma"), total("dbeta")
    dP, dM, dK, dQ = total("dP"), total("dM"), total("dK"), total("dQ")
    # the V-independent rest, from the summed shares
    dQK = dP * P.Gamma
    dQ = dQ + dQK @ P.Kc
    dK = dK + dQK.transpose(-1, -2) @ P.Qc
    dGamma = dP * QKt + dM * P.A
    dA = dM * P.Gamma
    dL = -(P.A.transpose(-1, -2) @ dA @ P.A.transpose(-1, -2)).tril(-1)
    dKKt = P.bc[..., :, None] * dL
    dbeta = dbeta + (dL * P.KKt).sum(-1)
    dK = dK + (dKKt + dKKt.transpose(-1, -2)) @ P.Kc
    # gates: G_i through gamma_i, gamma_C / gamma_i, Gamma_ij = e^{G_i - G_j}; G_C is the chunk's last G
    H = torch.where(P.mask, P.Gamma * dGamma, torch.zeros((), dtype=dt, device=P.dev))
    dG = P.gamma * d_gamma - P.dte * d_dte + H.sum(-1) - H.sum(-2)
    dG_C = (P.dte * d_dte).sum(-1) + P.gamma_C[..., 0] * d_gammaC
    dG = torch.cat([dG[..., :-1], (dG[..., -1] + dG_C)[..., None]], -1)
    dg = dG.flip(-1).cumsum(-1).flip(-1)                             # G_i = sum_{j<=i} g_j

    # back to tokens; GVA: sum dq/dk over each group's value heads in the computation dtype
    r = P.H_v // P.H_qk
    group = lambda x: _to_tokens(P, x).reshape(P.B, P.T, P.H_qk, r, P.K).sum(3)
    scalar = lambda x: _to_tokens(P, x[..., None])[..., 0]
    return group(dQ), group(dK), _to_tokens(P, dV), scalar(dg), scalar(dbeta)


def _chunk_local_grads(P, S0, dSp, dh0, dOc, QKt, U1, q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel):
    """The backward's chunk-parallel step: from the chunk-start states S0 and the chunk-end state gradients dSp
    ([slots, H_v, K, V]), the gradients (dq, dk, dv, dg, dbeta, dh0) in the inputs' dtypes."""
    dq, dk, dv, dg_t, dbeta_t = _chunk_local_token_grads(P, S0, dSp, dOc, QKt, U1)
    if use_qk_l2norm_in_kernel:
        dq, dk = _l2norm_bwd(q.to(P.dt), dq), _l2norm_bwd(k.to(P.dt), dk)
    dh0 = dh0.to(initial_state.dtype) if initial_state is not None else None
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg_t.to(g.dtype), dbeta_t.to(beta.dtype), dh0)


def _kernel_slots(P, x):
    """The kernels' chunk rows ([chunk bound, H_v, K, V], chunks of all sequences in order) -> the reference's
    slots (same order; extra slots zero)."""
    x = x.to(P.dt)[: P.NC]
    if x.shape[0] < P.NC:
        x = torch.cat([x, x.new_zeros((P.NC - x.shape[0],) + tuple(x.shape[1:]))])
    return _valid_slots(P, x)


def chunk_gdn_bwd_step(q, k, v, g, beta, do, states, dh, scale=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                       chunk_size=CHUNK, v_blocks=1):
    """flashqla.chunk_gdn_bwd_grad's contract in PyTorch (its CPU implementation): from the chunk-start states
    and the chunk-end state gradients, (dq, dk, dv, dg, dbeta) in the computation dtype, dq and dk with respect
    to the normalised q and k rows (no l2norm backward) and summed over each GVA group. v_blocks: the V-dependent
    part per block of V columns, the blocks' shares added (see _chunk_local_token_grads)."""
    P = _prepare(q, k, v, g, beta, scale, None, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    dOc, _, QKt, U1 = _bwd_setup(P, do, None)
    return _chunk_local_token_grads(P, _kernel_slots(P, states), _kernel_slots(P, dh), dOc, QKt, U1, v_blocks)


def chunk_gdn_bwd_from_states(q, k, v, g, beta, do, states, dh, dh0=None, dht=None, scale=None, initial_state=None,
                              cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=CHUNK):
    """chunk_gdn_bwd_torch with both chains given, as the kernels produce them: states[c] the state at the start
    of chunk c and dh[c] the gradient of the state at its end, over the chunks of all sequences in order (rows
    past the last chunk are ignored), dh0 the initial states' gradient (None without initial_state). Only the
    chunk-parallel step runs here."""
    P = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    dOc, _, QKt, U1 = _bwd_setup(P, do, dht)
    return _chunk_local_grads(P, _kernel_slots(P, states), _kernel_slots(P, dh), dh0, dOc, QKt, U1, q, k, v, g, beta,
                              initial_state, use_qk_l2norm_in_kernel)


def chunk_gdn_bwd_torch(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
                        use_qk_l2norm_in_kernel=False, chunk_size=CHUNK, segment_chunks=None):
    """Explicit backward of chunk_gdn_torch (gdn-algorithm.md section 4), from the inputs alone.

    1. recompute the chunk-start states S (forward chain);
    2. reverse chain over chunks for dS' (gradient of each chunk's end state):
         dS = gamma_C dS' + scale Q^T diag(gamma) dO
              - K^T diag(gamma beta) M^T (scale P^T dO + diag(gamma_C/gamma) K dS'),
       M = Gamma * A, P = Q K^T * Gamma; dh0 = dS of each sequence's first chunk;
    3. chunk-local gradients from S and dS' (chunk-parallel), gates in the
       computation dtype throughout, GVA dq/dk summed over each group before the cast.
    The reverse chain is dS = Phi^T dS' + D with the forward's per-chunk transition Phi,
    so segment_chunks (as in chunk_gdn_torch) runs it as the same exact segment scan, reversed.
    Returns (dq, dk, dv, dg, dbeta, dh0) in the dtypes of q, k, v, g, beta and fp32 (dh0;
    None without initial_state).
    """
    P = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size)
    S0, _ = _state_chain(P, segment_chunks)
    dOc, dht_, QKt, U1, dSp, dS_first = _reverse_chain(P, do, dht, segment_chunks)

    dh0 = _initial_state_grad(P, dS_first, dht_) if initial_state is not None else None
    return _chunk_local_grads(P, S0, dSp, dh0, dOc, QKt, U1, q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
