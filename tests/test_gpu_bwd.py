"""GPU tests of the backward kernels (sm_90a) against the float64 reference."""
import os

import pytest
import torch
import torch.nn.functional as F

from flashqla.reference import chunk_state_grads_torch
from conftest import count_calls, gpu, rel_l2

pytestmark = gpu
DEV = "cuda"
D = 128


def make(seqlens, hq, hv, dtype=torch.bfloat16, dense_B=None, strong=False, l2=False, dht=True, seed=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    B = dense_B or 1
    T = seqlens[0] if dense_B else sum(seqlens)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    q, k = r(B, T, hq, D), r(B, T, hq, D)
    if not l2:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = (-5 * torch.rand(B, T, hv, device=DEV, generator=gen)) if strong else F.logsigmoid(r(B, T, hv)) / 16
    g[..., 0] = 0.0
    beta = torch.rand(B, T, hv, device=DEV, generator=gen).sigmoid()
    N = B if dense_B else len(seqlens)
    cu = None if dense_B else torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), device=DEV,
                                          dtype=torch.int32)
    return dict(q=q.to(dtype), k=k.to(dtype), g=g, beta=beta, do=r(B, T, hv, D).to(dtype),
                dht=r(N, hv, D, D) / 8 if dht else None, cu=cu, l2=l2,
                chunks=(B * -(-T // 64)) if dense_B else sum(-(-n // 64) for n in seqlens))


def run_kernel(d):
    """Poison the block dh will reuse: every chunk's entry must be written."""
    n_total = (d["q"].shape[0] * -(-d["q"].shape[1] // 64) if d["cu"] is None
               else -(-d["q"].shape[1] // 64) + d["cu"].numel() - 1)
    poison = torch.full((n_total, d["do"].shape[2], D, D), float("nan"), device=DEV)
    ptr = poison.data_ptr()
    del poison
    dh, dh0, _ = torch.ops.flashqla.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], d["do"], d["dht"], D ** -0.5,
                                                     d["cu"], d["l2"], True)
    torch.cuda.synchronize()
    assert dh.data_ptr() == ptr, "allocator did not reuse the poisoned block"
    return dh[: d["chunks"]], dh0


# the dS chain with K split over warp pairs (the default at these sizes), unsplit, or with its products as wgmma
@pytest.mark.parametrize("variant", ["ksplit", "plain", "wgmma"])
@pytest.mark.parametrize("case", ["varlen", "dense", "gva4_fp16_l2norm", "strong_decay", "no_dht", "long"])
def test_state_grad_kernel_matches_float64(monkeypatch, case, variant):
    monkeypatch.setenv("FLASHQLA_KSPLIT", "1" if variant == "ksplit" else "0")
    monkeypatch.setenv("FLASHQLA_WGMMA", "1" if variant == "wgmma" else "0")
    d = {"varlen": lambda: make([0, 65, 1, 700, 0, 130, 1300], 2, 4, seed=1),
         "dense": lambda: make([333], 1, 3, dense_B=3, seed=2),
         "gva4_fp16_l2norm": lambda: make([64, 191, 900], 2, 8, dtype=torch.float16, l2=True, seed=3),
         "strong_decay": lambda: make([1000, 37], 2, 4, strong=True, seed=4),
         "no_dht": lambda: make([500, 260], 2, 2, dht=False, seed=5),
         "long": lambda: make([8192], 1, 2, seed=6)}[case]()
    dh, dh0 = run_kernel(d)
    assert torch.isfinite(dh).all() and torch.isfinite(dh0).all()
    x = lambda t: None if t is None else t.double().cpu()  # noqa: E731
    rdh, rdh0 = chunk_state_grads_torch(x(d["q"]), x(d["k"]), x(d["g"]), x(d["beta"]), x(d["do"]), x(d["dht"]),
                                        scale=D ** -0.5, cu_seqlens=None if d["cu"] is None else d["cu"].cpu(),
                                        use_qk_l2norm_in_kernel=d["l2"])
    e, e0 = rel_l2(dh, rdh[: d["chunks"]]), rel_l2(dh0, rdh0)
    print(f"{case}: dh {e:.2e} dh0 {e0:.2e}")
    assert e < 1e-2 and e0 < 1e-2


def test_state_grad_kernel_deterministic_and_graph_capturable():
    d = make([700, 90], 2, 4, seed=7)
    a = run_kernel(d)
    b = run_kernel(d)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    args = (d["q"], d["k"], d["g"], d["beta"], d["do"], d["dht"], D ** -0.5, d["cu"], False, True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.flashqla.chunk_gdn_bwd_dh(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.flashqla.chunk_gdn_bwd_dh(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0][: d["chunks"]], a[0]) and torch.equal(out[1], a[1])


def chains_case(case):
    """Inputs of the backward's two chains (chunk_gdn_bwd_chains): packed sequences with empty and partial chunks
    and l2norm, a dense fp16 batch with GVA 4, or int64 cu_seqlens; with v and an initial state."""
    if case == "dense_gva4_fp16":
        d = make([300], 2, 8, dtype=torch.float16, dense_B=2, seed=41)
    elif case == "varlen_l2norm":
        d = make([64, 191, 1500, 0, 77], 2, 4, l2=True, seed=42)
    else:
        d = make([700, 90, 5], 2, 4, seed=43)
        d["cu"] = d["cu"].long()
    gen = torch.Generator(device=DEV).manual_seed(44)
    v = torch.randn(d["do"].shape, device=DEV, generator=gen).to(d["do"].dtype)
    N = d["dht"].shape[0]
    h0 = torch.randn(N, d["do"].shape[2], D, D, device=DEV, generator=gen) / 8
    return d, v, h0


@pytest.mark.parametrize("case", ["varlen_l2norm", "dense_gva4_fp16", "varlen_int64", "fused_forward"])
def test_shared_prep_chains_equal_the_two_ops_bitwise(monkeypatch, case):
    # chunk_gdn_bwd_chains (one prep for both chains, the state recompute on a side stream) against
    # chunk_gdn_fwd_states + chunk_gdn_bwd_dh, each with its own prep: the same Gram products, inverse and X, so
    # the four outputs agree bit for bit; then the same op captured in a CUDA graph. fused_forward: with
    # FLASHQLA_FWD_SPLIT=0 the recompute computes its own products (no second workspace is shared)
    if case == "fused_forward":
        monkeypatch.setenv("FLASHQLA_FWD_SPLIT", "0")
    d, v, h0 = chains_case(case)
    sc, ops, n = D ** -0.5, torch.ops.flashqla, d["chunks"]
    states = ops.chunk_gdn_fwd_states(d["q"], d["k"], v, d["g"], d["beta"], sc, h0, d["cu"], d["l2"])
    dh, dh0, a = ops.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], d["do"], d["dht"], sc, d["cu"], d["l2"], True,
                                      True)
    args = (d["q"], d["k"], v, d["g"], d["beta"], d["do"], d["dht"], sc, h0, d["cu"], d["l2"], True, True)
    got = ops.chunk_gdn_bwd_chains(*args)
    torch.cuda.synchronize()
    want = (states[:n], dh[:n], dh0, a)
    for name, x, y in zip(("states", "dh", "dh0", "a"), (got[0][:n], got[1][:n], got[2], got[3]), want):
        assert torch.isfinite(y.float()).all() and torch.equal(x, y), name
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        ops.chunk_gdn_bwd_chains(*args)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.chunk_gdn_bwd_chains(*args)
    graph.replay()
    torch.cuda.synchronize()
    for name, x, y in zip(("states", "dh", "dh0", "a"), (out[0][:n], out[1][:n], out[2], out[3]), want):
        assert torch.equal(x, y), name + " (graph)"


@pytest.mark.parametrize("case", ["varlen_l2norm", "dense_gva4_fp16", "varlen_int64"])
def test_chain_states_by_tma_are_the_stores_bitwise(monkeypatch, case):
    # the wgmma chains' per-chunk states by TMA (the state recompute's 16-bit states, the dS chain's fp32 dS'; the
    # default where the maps can be made; the recompute's K, X and V loads by TMA too) against the state warps' own
    # stores and the loaders' copies (FLASHQLA_STATES_TMA=0): the same values to the same places, so the same bits. FLASHQLA_STATES_TMA=2 fails the launch where a map cannot be
    # made, so the TMA side cannot silently be the stores.
    monkeypatch.setenv("FLASHQLA_WGMMA", "1")  # the wgmma chains (at these sizes the rule picks the K split)
    d, v, h0 = chains_case(case)
    sc, ops, n = D ** -0.5, torch.ops.flashqla, d["chunks"]
    args = (d["q"], d["k"], v, d["g"], d["beta"], d["do"], d["dht"], sc, h0, d["cu"], d["l2"], True, True)
    outs = []
    for mode in ("0", "2"):
        monkeypatch.setenv("FLASHQLA_STATES_TMA", mode)
        out = ops.chunk_gdn_bwd_chains(*args)
        torch.cuda.synchronize()
        outs.append((out[0][:n].clone(), out[1][:n].clone(), out[2].clone(), out[3].clone()))
    for name, x, y in zip(("states", "dh", "dh0", "a"), *outs):
        assert torch.isfinite(x.float()).all() and torch.equal(x, y), name
    assert outs[0][0].abs().sum() > 0 and outs[0][1].abs().sum() > 0  # (not two sets of zeros)


def test_forward_chunk_states_match_float64():
    # the forward kernel's chunk-start states (the backward's recompute) against the float64 chain
    from flashqla.reference import chunk_states_torch
    d = make([0, 65, 700, 1, 300], 2, 4, seed=8)
    gen = torch.Generator(device=DEV).manual_seed(9)
    v = torch.randn(d["do"].shape, device=DEV, generator=gen).to(d["do"].dtype)
    h0 = torch.randn(5, 4, D, D, device=DEV, generator=gen)
    states = torch.ops.flashqla.chunk_gdn_fwd_states(d["q"], d["k"], v, d["g"], d["beta"], D ** -0.5, h0, d["cu"],
                                                     False)
    torch.cuda.synchronize()
    states = states[: d["chunks"]]
    assert torch.isfinite(states).all()
    x = lambda t: t.double().cpu()  # noqa: E731
    ref = chunk_states_torch(x(d["q"]), x(d["k"]), x(v), x(d["g"]), x(d["beta"]), scale=D ** -0.5,
                             initial_state=x(h0), cu_seqlens=d["cu"].cpu())[: d["chunks"]]
    e = rel_l2(states, ref)
    print(f"chunk states: {e:.2e}")
    assert e < 5e-3


@pytest.mark.parametrize("case", ["varlen_gva_l2norm", "strong_decay_fp16"])
def test_kernel_backward_matches_the_pytorch_backward(monkeypatch, case):
    # autograd's backward on the kernel path (FLASHQLA_BWD_KERNEL, default on) against the PyTorch chunked
    # backward on the same GPU inputs, both against float64 autograd: no worse than ~1.5x its error, or than
    # the floor that the kernel path's bf16 products allow. The PyTorch backward is fp32 end to end (errors
    # down to 1e-7), the gradient kernel rounds its operands to bf16 like FLA's: its floor is 6e-3, 1.2x FLA's
    # largest anchor error (dk 5.0e-3; this l2norm + GVA case measured dk 5.1e-3 on the H200, the anchor case
    # 4.2e-3 against FLA's 5.6e-3 in the same run)
    import flashqla
    from flashqla.reference import recurrent_gdn
    if case == "varlen_gva_l2norm":  # (the l2norm backward by its kernel, flashqla_l2norm_bwd)
        d, l2, dtype = make([0, 200, 1, 900], 2, 4, l2=True, seed=10), True, torch.bfloat16
    else:
        d, l2, dtype = make([700, 64], 2, 4, strong=True, dtype=torch.float16, seed=11), False, torch.float16
    gen = torch.Generator(device=DEV).manual_seed(12)
    N = d["cu"].numel() - 1
    inputs = dict(q=d["q"], k=d["k"], v=torch.randn(d["do"].shape, device=DEV, generator=gen).to(dtype),
                  g=d["g"], beta=d["beta"], initial_state=torch.randn(N, 4, D, D, device=DEV, generator=gen))
    names = list(inputs)
    do = d["do"]
    dht = torch.randn(N, 4, D, D, device=DEV, generator=gen) / 8
    grads = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FLASHQLA_BWD_KERNEL", mode)
        leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
        o, s = flashqla.chunk_gdn(**leaves, cu_seqlens=d["cu"], output_final_state=True, use_qk_l2norm_in_kernel=l2)
        grads[mode] = torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), [leaves[n] for n in names])
    x = {n: t.double().cpu().requires_grad_(True) for n, t in inputs.items()}
    ro, rs = recurrent_gdn(**x, cu_seqlens=d["cu"].cpu(), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    ref = torch.autograd.grad((ro * do.double().cpu()).sum() + (rs * dht.double().cpu()).sum(), [x[n] for n in names])
    floor = 6e-3 if os.environ.get("FLASHQLA_BWD_GRAD", "1").strip() != "0" else 5e-3
    for n, r, a, b in zip(names, ref, grads["1"], grads["0"]):
        ek, et = rel_l2(a.cpu(), r), rel_l2(b.cpu(), r)
        print(f"{case} d{n}: kernel path {ek:.2e}, PyTorch path {et:.2e}")
        assert torch.isfinite(a).all() and ek <= max(1.5 * et, floor), n


@pytest.mark.parametrize("case", ["varlen_gva_l2norm", "strong_decay_fp16", "dense_tail"])
def test_gradient_kernel_matches_the_pytorch_step(monkeypatch, case):
    # the chunk-parallel gradient kernel (FLASHQLA_BWD_GRAD=1) against the PyTorch step on the same kernel
    # chains, both against float64 autograd; deterministic; rows past cu_seqlens[-1] get zero gradients
    import flashqla
    from flashqla.reference import recurrent_gdn
    if case == "varlen_gva_l2norm":
        d, l2, dtype = make([0, 200, 1, 900], 2, 8, l2=True, seed=30), True, torch.bfloat16
    elif case == "strong_decay_fp16":
        d, l2, dtype = make([700, 64], 2, 4, strong=True, dtype=torch.float16, seed=31), False, torch.float16
    else:
        d, l2, dtype = make([333, 100], 1, 3, seed=32), False, torch.bfloat16
        d["cu"] = torch.tensor([0, 333, 400], device=DEV, dtype=torch.int32)  # 33 tail rows
    gen = torch.Generator(device=DEV).manual_seed(33)
    N, H = d["cu"].numel() - 1, d["do"].shape[2]
    inputs = dict(q=d["q"], k=d["k"], v=torch.randn(d["do"].shape, device=DEV, generator=gen).to(dtype),
                  g=d["g"], beta=d["beta"], initial_state=torch.randn(N, H, D, D, device=DEV, generator=gen))
    names = list(inputs)
    do = d["do"]
    dht = torch.randn(N, H, D, D, device=DEV, generator=gen) / 8
    grads = {}
    for mode in ("1", "1again", "1noA", "0"):
        monkeypatch.setenv("FLASHQLA_BWD_GRAD", mode[0])
        monkeypatch.setenv("FLASHQLA_BWD_A", "0" if mode == "1noA" else "1")  # the inverse recomputed in the kernel
        leaves = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
        o, s = flashqla.chunk_gdn(**leaves, cu_seqlens=d["cu"], output_final_state=True, use_qk_l2norm_in_kernel=l2)
        grads[mode] = torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), [leaves[n] for n in names])
    for a, b, c in zip(grads["1"], grads["1again"], grads["1noA"]):
        assert torch.equal(a, b), "gradient kernel not deterministic"
        assert torch.equal(a, c), "the dS chain's inverse rows give other gradients than the kernel's own inverse"
    end = int(d["cu"][-1])
    x = {n: t.double().cpu().requires_grad_(True) for n, t in inputs.items()}
    ro, rs = recurrent_gdn(**x, cu_seqlens=d["cu"].cpu(), output_final_state=True, use_qk_l2norm_in_kernel=l2)
    ref = torch.autograd.grad((ro[:, :end] * do[:, :end].double().cpu()).sum() + (rs * dht.double().cpu()).sum(),
                              [x[n] for n in names])
    for n, r, a, b in zip(names, ref, grads["1"], grads["0"]):
        if n != "initial_state":
            assert not a[:, end:].any(), f"d{n} past cu_seqlens[-1]"
        ek, et = rel_l2(a, r), rel_l2(b, r)
        print(f"{case} d{n}: gradient kernel {ek:.2e}, PyTorch step {et:.2e}")
        assert torch.isfinite(a).all() and ek <= max(1.5 * et, 5e-3), n


def test_inverse_rows_match_float64():
    # chunk_gdn_bwd_dh's A rows (for the gradient kernel) against the float64 inverse, partial chunks, GVA, l2norm;
    # rows past the sequences are not written (poisoned here, and left so)
    from flashqla.reference import chunk_inverse_rows
    d = make([0, 65, 1, 700, 130], 2, 4, l2=True, seed=40)
    torch.ops.flashqla.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], d["do"], d["dht"], D ** -0.5, d["cu"],
                                        True, True, True)  # warm-up: the next call's a reuses this block
    _, _, a = torch.ops.flashqla.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], d["do"], d["dht"], D ** -0.5,
                                                  d["cu"], True, True, True)
    assert a.shape == (1, d["q"].shape[1], 4, 64) and a.dtype == torch.float32
    x = lambda t: t.double().cpu()  # noqa: E731
    ref = chunk_inverse_rows(x(d["q"]), x(d["k"]), x(d["g"]), x(d["beta"]), cu_seqlens=d["cu"].cpu(),
                             use_qk_l2norm_in_kernel=True)
    e = rel_l2(a, ref)
    print(f"inverse rows: {e:.2e}")
    # the kernels merge the diagonal blocks' inverses with tf32 products (10-bit mantissas): 6.7e-4 measured here
    # (the first limit, 1e-4, had been set for fp32 products and failed on the H200)
    assert torch.isfinite(a).all() and e < 2e-3


def test_backward_context_parallelism_matches_float64(monkeypatch):
    # FLASHQLA_BWD_CP=1 (opt-in): a single sequence with few heads runs both chains through segments (8 of 8
    # chunks here); its gradients against the float64 explicit backward, no worse than ~1.5x the unsegmented
    # kernel path's (the segments' L maps are the forward's Phi, transposed: through the bf16 chain)
    import flashqla
    from flashqla import _cp
    from flashqla.reference import chunk_gdn_bwd_torch
    d = make([4096], 1, 2, dense_B=1, seed=50)
    gen = torch.Generator(device=DEV).manual_seed(51)
    v = torch.randn(d["do"].shape, device=DEV, generator=gen).bfloat16()
    h0 = torch.randn(1, 2, D, D, device=DEV, generator=gen)
    calls = count_calls(monkeypatch, _cp, "backward_chains")
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("FLASHQLA_BWD_CP", mode)
        out[mode] = flashqla.chunk_gdn_bwd(d["q"], d["k"], v, d["g"], d["beta"], d["do"], d["dht"], initial_state=h0)
    assert len(calls) == 1, "the segmented chains did not run"
    x = lambda t: t.double().cpu()  # noqa: E731
    ref = chunk_gdn_bwd_torch(x(d["q"]), x(d["k"]), x(v), x(d["g"]), x(d["beta"]), x(d["do"]), x(d["dht"]),
                              scale=D ** -0.5, initial_state=x(h0))
    for n, r, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ref, out["1"], out["0"]):
        ec, ep = rel_l2(a.cpu(), r), rel_l2(b.cpu(), r)
        print(f"backward CP {n}: segmented {ec:.2e}, unsegmented {ep:.2e}")
        assert torch.isfinite(a).all() and ec <= max(1.5 * ep, 6e-3), n


@pytest.mark.parametrize("order", ["0", "1"])
@pytest.mark.parametrize("lengths", [[4096], [3000, 0, 1100, 70]])
def test_segmented_chains_op_matches_the_plain_chains(monkeypatch, lengths, order):
    # chunk_gdn_bwd_chains_cp (one prep for every pass, the states on a side stream, the dS chain's B pass without
    # dh, its L maps the states' Phi transposed) against chunk_gdn_bwd_chains on the same inputs: the inverse rows
    # bitwise (the same prep), the states, dh and dh0 within the segments' rounding (the maps and the scans in fp32,
    # Phi through the chain's bf16 products). FLASHQLA_SUMMARY_PAIR=2: the states' summaries passes as one launch on
    # the backward prep's gates, or the call fails. FLASHQLA_BWD_CP_ORDER: the dS chain's first pass issued after the
    # states' passes (0) or before them (1), the same results
    from flashqla import _cp
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 4)
    monkeypatch.setenv("FLASHQLA_SUMMARY_PAIR", "2")
    monkeypatch.setenv("FLASHQLA_BWD_CP_ORDER", order)
    d = make(lengths, 2, 4, seed=60)
    gen = torch.Generator(device=DEV).manual_seed(61)
    v = torch.randn(d["do"].shape, device=DEV, generator=gen).bfloat16()
    h0 = torch.randn(len(lengths), 4, D, D, device=DEV, generator=gen) / 8
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=DEV, dtype=torch.int32)
    p = _cp.plan(lengths, 4, 132)
    assert p is not None and p.segments > len(lengths)
    args = (d["q"], d["k"], v, d["g"], d["beta"], d["do"], d["dht"], D ** -0.5, h0)
    ref = torch.ops.flashqla.chunk_gdn_bwd_chains(*args, cu, False, True, True)
    got = _cp.backward_chains(torch.ops.flashqla, *args[:6], d["dht"], D ** -0.5, h0, p, False, True, True)
    torch.cuda.synchronize()
    n = d["chunks"]
    assert torch.equal(got[3], ref[3]), "inverse rows"
    for name, a, b in (("states", got[0][:n], ref[0][:n]), ("dh", got[1][:n], ref[1][:n]), ("dh0", got[2], ref[2])):
        e = rel_l2(a, b)
        print(f"segmented chains {lengths} {name}: {e:.2e} against the plain op")
        assert torch.isfinite(a.float()).all() and e < 1e-2, name


@pytest.mark.parametrize("strong,with_dht,with_h0", [(False, True, True), (True, True, True), (True, False, False)])
@pytest.mark.parametrize("lengths", [[4096], [3000, 0, 1100, 70]])
def test_segmented_chains_merge_gives_the_full_walks_bits(monkeypatch, lengths, strong, with_dht, with_h0):
    # The merges of exact parallelism's backward give the full walks' bits. FLASHQLA_BWD_CP_MERGE: the last dS pass
    # stops where its walk merges with the B pass's (bitwise-equal dS' at a checkpoint; under strong decay after a
    # chunk or two, at once for a last segment without dht, never on head 0, whose g is 0) and takes the B pass's
    # dS' and dh0 from there. FLASHQLA_BWD_CP_STATES_MERGE: the states pass stops where its walk merges with the
    # summaries' B half (at once for a first segment without h0) and leaves B's chunk states from there (on by
    # until measured). Both on (=1) against both off (=0): the same bits.
    from flashqla import _cp
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 4)
    d = make(lengths, 2, 4, strong=strong, dht=with_dht, seed=62)
    gen = torch.Generator(device=DEV).manual_seed(63)
    v = torch.randn(d["do"].shape, device=DEV, generator=gen).bfloat16()
    h0 = torch.randn(len(lengths), 4, D, D, device=DEV, generator=gen) / 8 if with_h0 else None
    p = _cp.plan(lengths, 4, 132)
    assert p is not None and p.segments > len(lengths)
    out = {}
    for merge in ("0", "1"):
        monkeypatch.setenv("FLASHQLA_BWD_CP_MERGE", merge)
        monkeypatch.setenv("FLASHQLA_BWD_CP_STATES_MERGE", merge)
        out[merge] = _cp.backward_chains(torch.ops.flashqla, d["q"], d["k"], v, d["g"], d["beta"], d["do"], d["dht"],
                                         D ** -0.5, h0, p, False, True, True)
    torch.cuda.synchronize()
    n = d["chunks"]
    for name, a, b in (("states", out["1"][0][:n], out["0"][0][:n]), ("dh", out["1"][1][:n], out["0"][1][:n]),
                       ("dh0", out["1"][2], out["0"][2]), ("a", out["1"][3], out["0"][3])):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b), name


def test_gradient_step_names_the_tiles_it_needs():
    # the chunk-indexed tiles in the wrong dtype (e.g. fp32 states from an older caller) or of too few chunks:
    # a clear error naming them, not a kernel reading garbage
    d = make([130, 70], 2, 4, seed=12)
    v = torch.randn(d["do"].shape, device=DEV).to(d["do"].dtype)
    args = (d["q"], d["k"], v, d["g"], d["beta"], D ** -0.5, None, d["cu"], False)
    states = torch.ops.flashqla.chunk_gdn_fwd_states(*args)
    dh, _, _ = torch.ops.flashqla.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], d["do"], None, D ** -0.5,
                                                   d["cu"], False, False)
    assert states.dtype == d["q"].dtype
    base = (d["q"], d["k"], v, d["g"], d["beta"], d["do"])
    for bad_states, bad_dh in ((states.float(), dh), (states, dh[:1]), (states.transpose(2, 3), dh)):
        with pytest.raises(RuntimeError, match="states .* must be contiguous"):
            torch.ops.flashqla.chunk_gdn_bwd_grad(*base, bad_states, bad_dh, D ** -0.5, d["cu"], False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_l2norm_bwd_kernel_matches_float64(dtype):
    # the l2norm backward's kernel (flashqla_l2norm_bwd) against autograd through reference.l2norm in float64, on a
    # strided view of x (a fused projection's q), rows past cu_seqlens[-1] holding NaN (their gradient must be 0),
    # and bitwise equal across runs
    from flashqla import reference
    gen = torch.Generator(device=DEV).manual_seed(21)
    T, H = 333, 3
    fused = torch.randn(1, T, 2 * H, D, device=DEV, generator=gen).to(dtype)
    x = fused[:, :, :H]  # head stride 128, time stride 2 H 128
    dy = torch.randn(1, T, H, D, device=DEV, generator=gen)
    cu = torch.tensor([0, 100, 300], device=DEV, dtype=torch.int64)
    x[:, 300:] = float("nan")
    xr = x.double().clone().requires_grad_(True)
    (reference.l2norm(xr) * dy.double()).sum().backward()
    out = torch.ops.flashqla.l2norm_bwd(x, dy, cu)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    assert torch.equal(out[:, 300:], torch.zeros_like(out[:, 300:]))
    err = rel_l2(out[:, :300].double(), xr.grad[:, :300])
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err
    assert torch.equal(out, torch.ops.flashqla.l2norm_bwd(x, dy, cu))
    # dense rows (no cu_seqlens): every row computed
    xd = torch.randn(2, 70, H, D, device=DEV, generator=gen).to(dtype)
    dyd = torch.randn(2, 70, H, D, device=DEV, generator=gen)
    xr = xd.double().clone().requires_grad_(True)
    (reference.l2norm(xr) * dyd.double()).sum().backward()
    err = rel_l2(torch.ops.flashqla.l2norm_bwd(xd, dyd, None).double(), xr.grad)
    assert err < (4e-3 if dtype == torch.bfloat16 else 1e-3), err
