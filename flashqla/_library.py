"""Schemas of the flashqla custom ops, their fake (meta) implementations for
torch.compile / FakeTensor, and CPU implementations from the reference.

The CUDA implementations are registered by flashqla._C (csrc/torch/ops.cpp)."""
import torch

from . import reference

_lib = torch.library.Library("flashqla", "DEF")
_lib.define("chunk_local_cumsum(Tensor g, int chunk_size, bool reverse, float scale, Tensor? cu_seqlens) -> Tensor")

# seq_order / prep_workers: a packed batch's schedule from _cp.overlap_plan (the chains' start order, int32 [N], and
# the prep workers beside them; None / 0: the library's default); the same results either way.
_lib.define("chunk_gdn_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
            "bool output_final_state, Tensor? cu_seqlens, bool use_qk_l2norm, Tensor? seq_order=None, "
            "int prep_workers=0) -> (Tensor, Tensor)")
# The backward's recompute: the state at the start of every chunk, [chunk bound, H_v, K, V] in q's dtype (no o:
# the kernel skips the output products and the o pass over HBM).
_lib.define("chunk_gdn_fwd_states(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
            "Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm) -> Tensor")
# One pass of exact context parallelism (flashqla._cp): the final states [N, H_v, K, V] and, when write_o, o
# (else an empty o: the kernel skips the output products); zero_v takes v as zeros without reading it (the
# transition pass; v then only gives the shapes, and write_o must be False). The passes of one call share `workspace`
# (fwd_workspace_bytes); prep_ready = True reuses the chunk products an earlier pass left there (same q, k, g,
# beta, cu_seqlens, scale, use_qk_l2norm).
_lib.define("chunk_gdn_fwd_pass(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, "
            "Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm, Tensor(a!) workspace, bool prep_ready, "
            "bool write_o, bool zero_v) -> (Tensor, Tensor)")
# Exact context parallelism's two summaries passes from one computation of the chunk products, which stay in
# `workspace` for a later chunk_gdn_fwd_pass with prep_ready: (B, Phi), each [segments, H_v, K, V], the segments'
# final states from zeros with v and from `eye` (the identity per segment and head, K = V) with v = 0; see the C
# API's flashqla_gdn_fwd_cp_summaries (one launch for both chains where the workspace also holds
# fwd_gates_workspace_bytes).
_lib.define("chunk_gdn_cp_summaries(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor cu_seqlens, "
            "bool use_qk_l2norm, Tensor(a!) workspace, Tensor eye) -> (Tensor, Tensor)")
# Exact context parallelism's scan: every segment's initial state [segments, H_v, K, V] from the segments' maps
# S_end = Phi S_start + B (phi [segments, H_v, K, K], b [segments, H_v, K, V]), the sequences' initial states
# [N, H_v, K, V] (None: zeros) and each sequence's last segment (int64 [N]; sequence s owns segments
# last[s - 1] + 1 .. last[s]); reverse=True: the adjoint walk of the backward's dS chain (each sequence from its
# last segment back, out[last] = initial_state, out[i - 1] = Phi_i^T out[i] + B_i); see the C API's
# flashqla_gdn_cp_scan.
_lib.define("chunk_gdn_cp_scan(Tensor phi, Tensor b, Tensor? initial_state, Tensor last, bool reverse=False) -> Tensor")
# The forward's exact context parallelism as one op (csrc/torch/cp.cpp, in the built extension only): the
# passes of chunk_gdn_fwd_pass and chunk_gdn_cp_scan over the segments of _cp.device_plan; (o, final states per
# sequence). The planning and the caches stay in flashqla/_cp.py.
_lib.define("chunk_gdn_cp_fwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, "
            "Tensor seg_cu, Tensor last, int single_last, bool use_qk_l2norm, Tensor(a!) workspace, Tensor eye) "
            "-> (Tensor, Tensor)")
# The backward's reverse chain: (dh [chunk bound, H_v, K, V] fp32, dh0 [N, H_v, K, V] or empty, a [B, T, H_v, 64] or
# empty: the chunk-local inverse's rows, which chunk_gdn_bwd_grad can load instead of recomputing); see
# reference.chunk_state_grads_torch, reference.chunk_inverse_rows and the C API's flashqla_gdn_bwd_dh.
_lib.define("chunk_gdn_bwd_dh(Tensor q, Tensor k, Tensor g, Tensor beta, Tensor dout, Tensor? dht, float scale, "
            "Tensor? cu_seqlens, bool use_qk_l2norm, bool output_dh0, bool output_a=False) -> (Tensor, Tensor, Tensor)")

# Both of the backward's chains from one chunk-parallel prep (the Gram products and the inverse computed once for
# both; the state recompute on a side stream beside the dS chain, joined before the op returns): (states as
# chunk_gdn_fwd_states, dh, dh0, a as chunk_gdn_bwd_dh); see the C API's flashqla_gdn_bwd_prep.
_lib.define("chunk_gdn_bwd_chains(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor dout, Tensor? dht, "
            "float scale, Tensor? initial_state, Tensor? cu_seqlens, bool use_qk_l2norm, bool output_dh0, "
            "bool output_a=False) -> (Tensor, Tensor, Tensor, Tensor)")

# The same through exact parallelism's segments (FLASHQLA_BWD_CP; flashqla/_cp.py, backward_chains): seg_cu, last,
# first from _cp.device_plan and _cp._first_plan, eye [segments, H_v, K, K] in the states' fp32; on the GPU one prep
# for every pass, the states on a side stream. dh0 per sequence (first's length).
_lib.define("chunk_gdn_bwd_chains_cp(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor dout, Tensor? dht, "
            "float scale, Tensor? initial_state, Tensor seg_cu, Tensor last, Tensor first, Tensor eye, "
            "bool use_qk_l2norm, bool output_dh0, bool output_a=False) -> (Tensor, Tensor, Tensor, Tensor)")

# The backward's chunk-parallel gradient step (the default; FLASHQLA_BWD_GRAD=0 runs it in PyTorch): from the
# chunk-start states and the chunk-end state gradients, (dq, dk [B, T, H_qk, K] summed over each GVA group in
# fp32, then in q's dtype, or in fp32 with use_qk_l2norm, whose backward the caller applies; dv like v, dg, dbeta
# fp32 [B, T, H_v]); see the C API's flashqla_gdn_bwd_grad. a: chunk_gdn_bwd_dh's inverse rows for the same
# inputs (or None); the results do not depend on it.
_lib.define("chunk_gdn_bwd_grad(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor dout, Tensor states, "
            "Tensor dh, float scale, Tensor? cu_seqlens, bool use_qk_l2norm, Tensor? a=None) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")

# The l2norm backward (use_qk_l2norm_in_kernel): x [B, T, H, 128], dy (fp32, x's shape: the gradient with respect
# to the normalised rows) -> the gradient with respect to x in x's dtype; rows past cu_seqlens[-1] zeros. See the
# C API's flashqla_l2norm_bwd.
_lib.define("l2norm_bwd(Tensor x, Tensor dy, Tensor? cu_seqlens) -> Tensor")


def chunk_bound(B: int, T: int, cu_seqlens, chunk: int = 64) -> int:
    """Chunks of all sequences, bounded from the shapes alone (as flashqla_gdn_chunk_bound)."""
    per = -(-T // chunk)
    return B * per if cu_seqlens is None else per + cu_seqlens.shape[0] - 1


def _state_dtype(q):
    """Final states are fp32 (float64 for float64 inputs, which only the CPU reference takes)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _tile_dtype(q):
    """The chunk-start states (chunk_gdn_fwd_states) come in q's dtype: the chain carries fp32 and rounds each
    chunk's tile once on the way out, as the gradient step's products read it. chunk_gdn_bwd_dh's dh stays
    fp32 (the gradient step's <S0, dS'> reads it unrounded)."""
    return q.dtype


@torch.library.register_fake("flashqla::chunk_gdn_fwd")
def _chunk_gdn_fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                        seq_order=None, prep_workers=0):
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    sd = _state_dtype(q)
    final = (v.new_empty((N, v.shape[2], k.shape[3], v.shape[3]), dtype=sd) if output_final_state
             else v.new_empty((0,), dtype=sd))
    return v.new_empty(v.shape), final


def fwd_workspace_bytes(B: int, T: int, H_v: int) -> int:
    """Bytes of the forward's workspace (as flashqla_gdn_fwd_workspace_bytes: X 128 + W 64 bf16 values per
    token row and value head)."""
    return B * T * H_v * (128 + 64) * 2


def fwd_gates_workspace_bytes(B: int, T: int, H_v: int, cu_seqlens=None) -> int:
    """Bytes the forward's workspace may hold past fwd_workspace_bytes (as flashqla_gdn_fwd_gates_workspace_bytes:
    each chunk's gates, 2 x 64 fp32 a chunk of chunk_bound and value head)."""
    return chunk_bound(B, T, cu_seqlens) * H_v * 2 * 64 * 4 if B * T * H_v > 0 else 0


@torch.library.register_fake("flashqla::chunk_gdn_cp_summaries")
def _chunk_gdn_cp_summaries_fake(q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm, workspace, eye):
    shape = (cu_seqlens.shape[0] - 1, v.shape[2], k.shape[3], v.shape[3])
    return v.new_empty(shape, dtype=_state_dtype(q)), v.new_empty(shape, dtype=_state_dtype(q))


@torch.library.register_fake("flashqla::chunk_gdn_fwd_pass")
def _chunk_gdn_fwd_pass_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, workspace,
                             prep_ready, write_o, zero_v):
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    final = v.new_empty((N, v.shape[2], k.shape[3], v.shape[3]), dtype=_state_dtype(q))
    return (v.new_empty(v.shape) if write_o else v.new_empty((0,))), final


@torch.library.register_fake("flashqla::chunk_gdn_cp_scan")
def _chunk_gdn_cp_scan_fake(phi, b, initial_state, last, reverse=False):
    return b.new_empty(b.shape)


@torch.library.register_fake("flashqla::chunk_gdn_cp_fwd")
def _chunk_gdn_cp_fwd_fake(q, k, v, g, beta, scale, initial_state, seg_cu, last, single_last, use_qk_l2norm,
                           workspace, eye):
    N = 1 if single_last >= 0 else last.shape[0]
    return v.new_empty(v.shape), v.new_empty((N, v.shape[2], k.shape[3], v.shape[3]), dtype=_state_dtype(q))


@torch.library.register_fake("flashqla::chunk_gdn_fwd_states")
def _chunk_gdn_fwd_states_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    H, K, V = v.shape[2], q.shape[3], v.shape[3]
    return v.new_empty((chunk_bound(q.shape[0], q.shape[1], cu_seqlens), H, K, V), dtype=_tile_dtype(q))


@torch.library.register_fake("flashqla::chunk_gdn_bwd_grad")
def _chunk_gdn_bwd_grad_fake(q, k, v, g, beta, dout, states, dh, scale, cu_seqlens, use_qk_l2norm, a=None):
    B, T, H, V = v.shape
    sd = _state_dtype(q)   # fp32 on the GPU
    dqk = q.new_empty(q.shape, dtype=sd if use_qk_l2norm else q.dtype)
    return dqk, torch.empty_like(dqk), v.new_empty(v.shape), v.new_empty((B, T, H), dtype=sd), \
        v.new_empty((B, T, H), dtype=sd)


@torch.library.register_fake("flashqla::l2norm_bwd")
def _l2norm_bwd_fake(x, dy, cu_seqlens):
    return x.new_empty(x.shape)


@torch.library.register_fake("flashqla::chunk_gdn_bwd_dh")
def _chunk_gdn_bwd_dh_fake(q, k, g, beta, dout, dht, scale, cu_seqlens, use_qk_l2norm, output_dh0, output_a=False):
    N = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    sd = _state_dtype(q)
    H, K, V = dout.shape[2], q.shape[3], dout.shape[3]
    dh = dout.new_empty((chunk_bound(q.shape[0], q.shape[1], cu_seqlens), H, K, V), dtype=sd)
    return (dh, (dout.new_empty((N, H, K, V), dtype=sd) if output_dh0 else dout.new_empty((0,), dtype=sd)),
            dout.new_empty((q.shape[0], q.shape[1], H, 64) if output_a else (0,), dtype=sd))


@torch.library.register_fake("flashqla::chunk_gdn_bwd_chains")
def _chunk_gdn_bwd_chains_fake(q, k, v, g, beta, dout, dht, scale, initial_state, cu_seqlens, use_qk_l2norm, output_dh0,
                               output_a=False):
    states = _chunk_gdn_fwd_states_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)
    return (states,) + _chunk_gdn_bwd_dh_fake(q, k, g, beta, dout, dht, scale, cu_seqlens, use_qk_l2norm, output_dh0,
                                              output_a)


@torch.library.register_fake("flashqla::chunk_gdn_bwd_chains_cp")
def _chunk_gdn_bwd_chains_cp_fake(q, k, v, g, beta, dout, dht, scale, initial_state, seg_cu, last, first, eye,
                                  use_qk_l2norm, output_dh0, output_a=False):
    states, dh, _, a = _chunk_gdn_bwd_chains_fake(q, k, v, g, beta, dout, dht, scale, initial_state, seg_cu,
                                                  use_qk_l2norm, False, output_a)
    H, K, V = v.shape[2], q.shape[3], v.shape[3]
    sd = _state_dtype(q)
    return states, dh, (dout.new_empty((first.shape[0], H, K, V), dtype=sd) if output_dh0
                        else dout.new_empty((0,), dtype=sd)), a


@torch.library.register_fake("flashqla::chunk_local_cumsum")
def _chunk_local_cumsum_fake(g, chunk_size, reverse, scale, cu_seqlens):
    return g.new_empty(g.shape, dtype=torch.float32)


@torch.library.impl("flashqla::chunk_gdn_fwd", "cpu")
def _chunk_gdn_fwd_cpu(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm,
                       seq_order=None, prep_workers=0):  # (a schedule: nothing to do here)
    o, final = reference.chunk_gdn_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm)
    sd = _state_dtype(q)
    return o, (final.to(sd) if output_final_state else v.new_empty((0,), dtype=sd))


@torch.library.impl("flashqla::chunk_gdn_fwd_pass", "cpu")
def _chunk_gdn_fwd_pass_cpu(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, workspace,
                            prep_ready, write_o, zero_v):
    # the reference has no chunk products to keep: the workspace is not used
    v = torch.zeros_like(v) if zero_v else v
    o, final = reference.chunk_gdn_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                         output_final_state=True, cu_seqlens=cu_seqlens,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm)
    return (o if write_o else v.new_empty((0,))), final.to(_state_dtype(q))


@torch.library.impl("flashqla::chunk_gdn_cp_summaries", "cpu")
def _chunk_gdn_cp_summaries_cpu(q, k, v, g, beta, scale, cu_seqlens, use_qk_l2norm, workspace, eye):
    run = torch.ops.flashqla.chunk_gdn_fwd_pass  # (its CPU implementation above: the two passes of the reference)
    _, b_end = run(q, k, v, g, beta, scale, None, cu_seqlens, use_qk_l2norm, workspace, False, False, False)
    _, phi = run(q, k, v, g, beta, scale, eye, cu_seqlens, use_qk_l2norm, workspace, True, False, True)
    return b_end, phi


@torch.library.impl("flashqla::chunk_gdn_cp_scan", "cpu")
def _chunk_gdn_cp_scan_cpu(phi, b, initial_state, last, reverse=False):
    init = torch.empty_like(b)
    first = 0
    for s, end in enumerate(last.tolist()):  # a CPU tensor: no device sync
        state = initial_state[s] if initial_state is not None else b.new_zeros(b.shape[1:])
        walk = range(end, first - 1, -1) if reverse else range(first, end + 1)
        for n, i in enumerate(walk):
            init[i] = state
            if n < end - first:
                state = torch.baddbmm(b[i], phi[i].transpose(1, 2) if reverse else phi[i], state)
        first = end + 1
    return init


@torch.library.impl("flashqla::chunk_gdn_fwd_states", "cpu")
def _chunk_gdn_fwd_states_cpu(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    states = reference.chunk_states_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                          cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm)
    return states[: chunk_bound(q.shape[0], q.shape[1], cu_seqlens)].to(_tile_dtype(q))


@torch.library.impl("flashqla::chunk_gdn_bwd_dh", "cpu")
def _chunk_gdn_bwd_dh_cpu(q, k, g, beta, dout, dht, scale, cu_seqlens, use_qk_l2norm, output_dh0, output_a=False):
    dh, dh0 = reference.chunk_state_grads_torch(q, k, g, beta, dout, dht, scale=scale, cu_seqlens=cu_seqlens,
                                                use_qk_l2norm_in_kernel=use_qk_l2norm)
    sd = _state_dtype(q)
    dh = dh[: chunk_bound(q.shape[0], q.shape[1], cu_seqlens)].to(sd)
    a = (reference.chunk_inverse_rows(q, k, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm).to(sd)
         if output_a else dout.new_empty((0,), dtype=sd))
    return dh, (dh0.to(sd) if output_dh0 else dout.new_empty((0,), dtype=sd)), a


@torch.library.impl("flashqla::chunk_gdn_bwd_chains", "cpu")
def _chunk_gdn_bwd_chains_cpu(q, k, v, g, beta, dout, dht, scale, initial_state, cu_seqlens, use_qk_l2norm, output_dh0,
                              output_a=False):
    ops = torch.ops.flashqla  # the two chains' own ops (their CPU implementations above)
    states = ops.chunk_gdn_fwd_states(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)
    return (states,) + tuple(ops.chunk_gdn_bwd_dh(q, k, g, beta, dout, dht, scale, cu_seqlens, use_qk_l2norm,
                                                  output_dh0, output_a))


@torch.library.impl("flashqla::chunk_gdn_bwd_chains_cp", "cpu")
def _chunk_gdn_bwd_chains_cp_cpu(q, k, v, g, beta, dout, dht, scale, initial_state, seg_cu, last, first, eye,
                                 use_qk_l2norm, output_dh0, output_a=False):
    from . import _cp  # (the passes op by op, through the ops' CPU implementations)
    return _cp.backward_chain_passes(torch.ops.flashqla, q, k, v, g, beta, dout, dht, scale, initial_state, seg_cu,
                                     last, first, eye, use_qk_l2norm, output_dh0, output_a)


@torch.library.impl("flashqla::chunk_gdn_bwd_grad", "cpu")
def _chunk_gdn_bwd_grad_cpu(q, k, v, g, beta, dout, states, dh, scale, cu_seqlens, use_qk_l2norm, a=None):
    # a only spares the kernel a recomputation: the reference computes the inverse itself
    dq, dk, dv, dg, dbeta = reference.chunk_gdn_bwd_step(q, k, v, g, beta, dout, states, dh, scale=scale,
                                                          cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm)
    sd = _state_dtype(q)
    dqk = sd if use_qk_l2norm else q.dtype
    return dq.to(dqk), dk.to(dqk), dv.to(v.dtype), dg.to(sd), dbeta.to(sd)


def _l2norm_bwd_ref(x, dy, cu_seqlens):
    out = reference._l2norm_bwd(x.to(dy.dtype), dy)
    if cu_seqlens is not None:  # rows past the last sequence: zeros (whatever x holds there)
        out[:, max(int(cu_seqlens[-1]), 0):] = 0
    return out.to(x.dtype)


@torch.library.impl("flashqla::l2norm_bwd", "cpu")
def _l2norm_bwd_cpu(x, dy, cu_seqlens):
    return _l2norm_bwd_ref(x, dy, cu_seqlens)


@torch.library.impl("flashqla::chunk_local_cumsum", "cpu")
def _chunk_local_cumsum_cpu(g, chunk_size, reverse, scale, cu_seqlens):
    out = reference.chunk_local_cumsum_torch(g, chunk_size, reverse, scale, cu_seqlens)
    return out.float()
