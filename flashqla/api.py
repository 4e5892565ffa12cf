"""Public entry points. Thin: validate, choose the implementation, call it."""
from __future__ import annotations

import functools
import os

import torch

from . import _backend, _cp, _validate, reference

__all__ = ["chunk_gdn", "chunk_gated_delta_rule", "chunk_gdn_fwd", "chunk_gdn_bwd", "chunk_local_cumsum"]


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int = 64, reverse: bool = False, scale: float | None = None,
                       cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Chunk-local cumulative sum of a log-decay ``g`` [B, T, H] over T, in fp32.

    Chunks of ``chunk_size`` tokens restart at every sequence start (``cu_seqlens``,
    B == 1); ``reverse`` sums from each position to the end of its chunk; ``scale``
    multiplies the result. Positions past ``cu_seqlens[-1]`` are 0.
    """
    _validate._tensor(g, "g", 3, "[B, T, H]")
    if g.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise ValueError(f"g must be float32, bfloat16, float16 or float64, got {g.dtype}")
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be one of 16, 32, 64, 128, got {chunk_size}")
    _validate.check_cu_seqlens(cu_seqlens, g.shape[0], g.device)
    use_kernel = _backend.kernels_available(g.device) and g.dtype != torch.float64
    _validate.maybe_check_values(cu_seqlens, None, g.shape[0] * g.shape[1], fallback=not use_kernel)
    if use_kernel:
        return torch.ops.flashqla.chunk_local_cumsum(g, chunk_size, reverse, 1.0 if scale is None else float(scale),
                                                     cu_seqlens)
    return reference.chunk_local_cumsum_torch(g, chunk_size, reverse, scale, cu_seqlens)


def chunk_gdn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None,
              head_first: bool = False):
    r"""Chunked Gated DeltaNet (gated delta rule), FLA's ``chunk_gated_delta_rule`` API.

    Per value head, token t: ``S_t = e^{g_t} (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
    ``o_t = scale * S_t^T q_t``.

    Args:
        q, k: ``[B, T, H_qk, K]`` (bf16, fp16, fp32; fp64 on the fallback).
        v: ``[B, T, H_v, V]``, same dtype; ``H_v % H_qk == 0`` (value head h reads q/k head
            ``h // (H_v // H_qk)``).
        g: ``[B, T, H_v]`` natural-log decay (fp32 or bf16).
        beta: ``[B, T, H_v]`` write strength (fp32, bf16 or fp16).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H_v, K, V]`` fp32, N = B or ``len(cu_seqlens) - 1``.
        output_final_state: also return the fp32 final state ``[N, H_v, K, V]``.
        use_qk_l2norm_in_kernel: l2-normalise q and k (over K) first.
        cu_seqlens: int32/int64 ``[N + 1]`` offsets of packed sequences; needs B == 1.
        cu_seqlens_cpu: optional host copy of cu_seqlens (lets its values be checked without a sync).
        head_first: not supported (FLA removed it too); must be False.

    Returns:
        ``(o, final_state)``: o ``[B, T, H_v, V]`` in v's dtype; final_state or None.
        Differentiable in q, k, v, g, beta and initial_state.
    """
    if head_first:
        raise ValueError("head_first=True is not supported: pass [B, T, H, D] tensors")
    shape = _checked(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    lengths = _host_lengths(shape, cu_seqlens, cu_seqlens_cpu)
    args = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in args):
        return _ChunkGDN.apply(q, k, v, g, beta, initial_state, scale, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, shape, lengths)
    return _forward(shape, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                    cu_seqlens, lengths)


chunk_gated_delta_rule = chunk_gdn


def chunk_gdn_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    """Low-level forward for frameworks with their own autograd: ``(o, final_state)``, no graph.

    The backward (:func:`chunk_gdn_bwd`) needs only this call's inputs: it recomputes
    the chunk states, so nothing else is kept between the two (less than FLA keeps).
    """
    shape = _checked(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    with torch.no_grad():
        return _forward(shape, q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens, _host_lengths(shape, cu_seqlens, cu_seqlens_cpu))


def chunk_gdn_bwd(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, use_qk_l2norm_in_kernel=False,
                  cu_seqlens=None, cu_seqlens_cpu=None):
    """Low-level backward: given the forward's inputs, ``do`` (o's gradient, shaped like v) and
    ``dht`` (the final state's gradient or None), returns ``(dq, dk, dv, dg, dbeta, dh0)`` in the
    inputs' dtypes (dh0 fp32; None without initial_state). dg is the gradient of the raw
    per-token log-decay g. Positions past cu_seqlens[-1] get zero gradients."""
    shape = _checked(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu)
    _validate.check_like(do, "do", v)
    if dht is not None:
        _validate.check_like(dht, "dht", None, (shape.N, shape.H_v, shape.K, shape.V), q.device)
    return _backward(shape, q, k, v, g, beta, do, dht, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                     _host_lengths(shape, cu_seqlens, cu_seqlens_cpu))


class _ChunkGDN(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, l2norm, cu_seqlens, shape, lengths):
        o, final = _forward(shape, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens,
                            lengths)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.l2norm, ctx.shape, ctx.lengths = scale, l2norm, shape, lengths
        return o, final

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dbeta, dh0 = _backward(ctx.shape, q, k, v, g, beta, do, dht, ctx.scale, initial_state,
                                               ctx.l2norm, cu_seqlens, ctx.lengths)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None, None


def _checked(q, k, v, g, beta, scale, initial_state, cu_seqlens, cu_seqlens_cpu):
    """The shape of a validated call; cu_seqlens values checked where that is free (see maybe_check_values)."""
    shape = _validate.validate_gdn(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    _validate.maybe_check_values(cu_seqlens, cu_seqlens_cpu, shape.B * shape.T,
                                 fallback=not _backend.kernels_available(q.device))
    return shape


def _host_lengths(shape, cu_seqlens, cu_seqlens_cpu):
    """Sequence lengths known on the host without a sync (for context parallelism and a packed batch's
    schedule), else None."""
    if _cp.mode() == "0" and _cp.overlap_mode() == "0":
        return None
    if cu_seqlens is None:
        return [shape.T] if shape.B == 1 else None
    if cu_seqlens_cpu is not None:
        c = cu_seqlens_cpu.tolist()  # a CPU tensor: no device sync
        return [b - a for a, b in zip(c[:-1], c[1:])]
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sms(dev: torch.device) -> int:
    """The SMs the context-parallel planner fills (an H200's 132 off the GPU, where the CPU tests plan)."""
    if dev.type != "cuda":
        return 132
    return _sm_count(dev.index if dev.index is not None else torch.cuda.current_device())


def _forward(shape, q, k, v, g, beta, scale, initial_state, output_final_state, l2norm, cu_seqlens, lengths=None):
    dev = q.device
    hopper = _backend.kernels_available(dev)
    why = _why_not_kernel(shape, q, g) if hopper else _backend.why_no_kernels(dev)
    if why is None:
        scale = shape.K ** -0.5 if scale is None else float(scale)
        q, k, v = (_vector_ready(x) for x in (q, k, v))
        h0 = None if initial_state is None else initial_state.contiguous()
        cu = None if cu_seqlens is None else cu_seqlens.contiguous()
        if lengths is not None and shape.K == shape.V and _cp.mode() != "0":
            plan = _cp.plan(lengths, shape.H_v, _sms(dev))
            if plan is not None:
                out = _cp.forward(torch.ops.flashqla.chunk_gdn_fwd, q, k, v, g, beta, scale, h0, plan, l2norm,
                                  index_dtype=cu.dtype if cu is not None else torch.int32,
                                  fwd_pass=None if os.environ.get("FLASHQLA_FWD_KERNEL") == "simple"
                                  else torch.ops.flashqla.chunk_gdn_fwd_pass)  # v1 has no summaries-only mode
                if out is not None:
                    return out[0], (out[1] if output_final_state else None)
        order, workers = None, 0
        if lengths is not None and cu is not None:  # a packed batch: the schedule of one long sequence and short ones
            sched = _cp.overlap_plan(lengths, shape.H_v, _sms(dev))
            if sched is not None:
                order = _cp.device_order(sched[0], dev)
                workers = sched[1] if order is not None else 0
        o, final = torch.ops.flashqla.chunk_gdn_fwd(q, k, v, g, beta, scale, h0, output_final_state, cu, l2norm,
                                                    order, workers)
        return o, (final if output_final_state else None)
    _warn_fallback(hopper, dev, why, "forward")
    return reference.chunk_gdn_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                     use_qk_l2norm_in_kernel=l2norm, segment_chunks=_segments(shape, dev))


def _backward(shape, q, k, v, g, beta, do, dht, scale, initial_state, l2norm, cu_seqlens, lengths=None):
    dev = q.device
    hopper = _backend.kernels_available(dev)
    why = _why_not_kernel(shape, q, g) if hopper else _backend.why_no_kernels(dev)
    if why is None and os.environ.get("FLASHQLA_BWD_KERNEL", "1").strip() != "0":
        return _kernel_backward(shape, q, k, v, g, beta, do, dht, scale, initial_state, l2norm, cu_seqlens, lengths)
    _warn_fallback(hopper, dev, why or "FLASHQLA_BWD_KERNEL=0", "backward")
    return reference.chunk_gdn_bwd_torch(q, k, v, g, beta, do, dht, scale=scale, initial_state=initial_state,
                                         cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=l2norm,
                                         segment_chunks=_segments(shape, dev))


def _kernel_backward(shape, q, k, v, g, beta, do, dht, scale, initial_state, l2norm, cu_seqlens, lengths=None):
    """Both serial chains on the sm_90a kernels (the chunk-start states from the forward kernel, the
    chunk-end state gradients from chunk_gdn_bwd_dh), then the chunk-parallel gradient step on its kernel
    (chunk_gdn_bwd_grad; FLASHQLA_BWD_GRAD=0: in PyTorch, reference.chunk_gdn_bwd_from_states)."""
    sc = shape.K ** -0.5 if scale is None else float(scale)
    qv, kv, vv = (_vector_ready(x) for x in (q, k, v))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    cu = None if cu_seqlens is None else cu_seqlens.contiguous()
    dov = _vector_ready(do.to(v.dtype))
    dht_ = None if dht is None else dht.float().contiguous()
    grad_kernel = os.environ.get("FLASHQLA_BWD_GRAD", "1").strip() != "0"  # the gradient kernel (0: the PyTorch step)
    # the dS chain's prep computes the chunk-local inverse anyway: it hands its rows to the gradient kernel, which
    # then skips its own (FLASHQLA_BWD_A=0 recomputes it there; the gradients are bitwise the same)
    pass_a = grad_kernel and os.environ.get("FLASHQLA_BWD_A", "1").strip() != "0"
    chains = None
    # both chains through segments where the plain ones leave most SMs idle (few sequences x heads) or the segments
    # are long (_cp.backward_plan says where; FLASHQLA_BWD_CP=0 / 1 turns it off / on wherever the forward's planner
    # cuts)
    if lengths is not None and shape.K == shape.V:
        plan = _cp.backward_plan(lengths, shape.H_v, _sms(q.device))
        if plan is not None:
            chains = _cp.backward_chains(torch.ops.flashqla, qv, kv, vv, g, beta, dov, dht_, sc, h0, plan, l2norm,
                                         initial_state is not None, pass_a,
                                         index_dtype=cu.dtype if cu is not None else torch.int32)
    if chains is not None:
        states, dh, dh0, a = chains
    else:
        # one prep for both chains (the Gram products and the inverse once); the op runs the two chains side by
        # side on two streams, joined before it returns
        states, dh, dh0, a = torch.ops.flashqla.chunk_gdn_bwd_chains(qv, kv, vv, g, beta, dov, dht_, sc, h0, cu, l2norm,
                                                                     initial_state is not None, pass_a)
    if grad_kernel:
        dq, dk, dv, dg, dbeta = torch.ops.flashqla.chunk_gdn_bwd_grad(qv, kv, vv, g, beta, dov, states, dh, sc, cu,
                                                                       l2norm, a if pass_a else None)
        # dq, dk come per q/k head (the kernel sums each GVA group's value heads in fp32, in head order), in q's
        # dtype, or in fp32 for the l2norm backward: one pass a tensor by its kernel (the PyTorch form took ~11
        # passes over fp32 rows, 3.1 ms at hk16_hv32 32k against 0.27 for both kernels; session 18)
        if l2norm:
            dq, dk = torch.ops.flashqla.l2norm_bwd(qv, dq, cu), torch.ops.flashqla.l2norm_bwd(kv, dk, cu)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dbeta.to(beta.dtype),
                dh0.to(initial_state.dtype) if initial_state is not None else None)
    return reference.chunk_gdn_bwd_from_states(q, k, v, g, beta, do, states, dh,
                                               dh0 if initial_state is not None else None, dht, scale=scale,
                                               initial_state=initial_state, cu_seqlens=cu_seqlens,
                                               use_qk_l2norm_in_kernel=l2norm)


def _segments(shape, dev):
    """On a GPU, run the PyTorch state chains as the exact segment scan (about 3 sqrt(chunks)
    serial steps instead of one per chunk: far fewer launches); on the CPU chunk by chunk."""
    if dev.type != "cuda":
        return None
    slots = shape.B * shape.T // reference.CHUNK + shape.N + 1
    return max(1, round(slots ** 0.5))


def _warn_fallback(hopper, dev, why, what):
    if hopper:
        _backend.warn_once(f"no-kernel:{what}:{why}",
                           f"flashqla: running the PyTorch chunked {what} on the GPU because {why}")
    else:
        _backend.warn_once(f"fallback:{dev.type}",
                           f"flashqla: running the PyTorch reference implementation because {why}; "
                           "this is slow and meant for portability and testing")


KERNEL_HEAD_DIM = 128


def _why_not_kernel(shape, q, g):
    """None if the sm_90a forward kernel takes these inputs, else the reason (a fallback with a warning).
    Head dims it cannot take are an error: a 20x slower path would be worse on the GPU the kernels are for."""
    if shape.K != KERNEL_HEAD_DIM or shape.V != KERNEL_HEAD_DIM:
        raise ValueError(f"flashqla's sm_90a kernels support head dims K = V = {KERNEL_HEAD_DIM}, got K = {shape.K}, "
                         f"V = {shape.V}; set FLASHQLA_FORCE_FALLBACK=1 to run the (slow) PyTorch implementation")
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the sm_90a forward kernel takes bfloat16 or float16 q/k/v (got {q.dtype})"
    if g.dtype == torch.float64:
        return "the sm_90a forward kernel takes float32 or bfloat16 g"
    return None


def _vector_ready(x):
    """The kernel reads rows with 16-byte vectors: last dim contiguous, other strides multiples of 8
    elements, 16-byte aligned base. Views of fused projections usually qualify (no copy); others are copied."""
    # torch allocations are 256-byte aligned, so the storage offset decides the base alignment
    if x.stride(-1) == 1 and (x.storage_offset() * x.element_size()) % 16 == 0 and \
            all(s % 8 == 0 for s in x.stride()[:-1]):
        return x
    return x.contiguous()

chunk_gated_delta_rule = chunk_gdn
