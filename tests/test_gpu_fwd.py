"""The sm_90a forward kernel against the float64 recurrence on an H100/H200."""
import pytest
import torch
import torch.nn.functional as F

import flashqla
from flashqla.reference import chunk_gdn_torch, recurrent_gdn
from conftest import count_calls, gpu, rel_l2

pytestmark = gpu
DEV = "cuda"
D = 128


def make(seqlens, hq, hv, dtype=torch.bfloat16, strong=False, dense_B=None, seed=0, g_dtype=torch.float32,
         beta_dtype=torch.float32):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    B = dense_B or 1
    T = seqlens[0] if dense_B else sum(seqlens)
    r = lambda *s: torch.randn(*s, device=DEV, generator=gen)  # noqa: E731
    q = F.normalize(r(B, T, hq, D), dim=-1).to(dtype)
    k = F.normalize(r(B, T, hq, D), dim=-1).to(dtype)
    v = r(B, T, hv, D).to(dtype)
    g = (-5 * torch.rand(B, T, hv, device=DEV, generator=gen)) if strong else F.logsigmoid(r(B, T, hv)) / 16
    g[..., 0] = 0.0 if strong else g[..., 0]
    beta = torch.rand(B, T, hv, device=DEV, generator=gen).sigmoid()
    N = B if dense_B else len(seqlens)
    h0 = r(N, hv, D, D)
    cu = None if dense_B else torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), device=DEV,
                                          dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g.to(g_dtype), beta=beta.to(beta_dtype), initial_state=h0, cu_seqlens=cu)


def run_ours(d, **kw):
    """Poison the output block first: every element must be written by the kernel. Where the op's workspace took the
    poisoned block (the caching allocator may carve it from a larger free block the workspace then takes whole), the
    block the output took is poisoned and the call repeated (the same allocations land in the same blocks); failing
    that, the same after the cache is emptied."""
    target = None  # the block to poison: a fresh one, or the one the last call's output took
    for attempt in range(4):
        if attempt == 2:
            torch.cuda.empty_cache()
            target = None
        poison = torch.full(d["v"].shape, float("nan"), dtype=d["v"].dtype, device=DEV)
        ptr = poison.data_ptr()
        del poison
        if target is not None and ptr != target:
            continue
        o, s = flashqla.chunk_gdn(**d, output_final_state=True, **kw)
        if o.data_ptr() == ptr:
            torch.cuda.synchronize()
            return o, s
        target = o.data_ptr()
        del o, s
    raise AssertionError("allocator did not reuse the poisoned block")


def captured(fn):
    """fn run once on a side stream (the caches a capture needs filled outside it), then captured: (graph, fn()'s
    outputs in the graph's memory)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def ref64(d, **kw):
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    return recurrent_gdn(**x, output_final_state=True, **kw)


def test_kernel_is_used():
    d = make([100], 1, 1)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any fallback warning fails the test
        flashqla.chunk_gdn(**d)


def test_anchor_case_accuracy():
    d = make([300], 2, 4, seed=1)
    o, s = run_ours(d)
    ro, rs = ref64(d)
    eo, es = rel_l2(o, ro), rel_l2(s, rs)
    print(f"anchor: o {eo:.2e} final {es:.2e}")
    assert eo <= 3.2e-3 and es <= 3.0e-3


def test_strong_decay():
    d = make([100, 37, 200], 2, 8, strong=True, seed=2)
    o, s = run_ours(d)
    ro, rs = ref64(d)
    assert rel_l2(o, ro) <= 3.2e-3 and rel_l2(s, rs) <= 3.0e-3


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
def test_gva_ratios(ratio):
    d = make([130], 2, 2 * ratio, seed=ratio)
    o, s = run_ours(d)
    ro, rs = ref64(d)
    assert rel_l2(o, ro) <= 4e-3 and rel_l2(s, rs) <= 4e-3


@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
def test_varlen_boundaries_and_tail(idx):
    lens = [0, 1, 63, 64, 65, 0, 129, 7]
    d = make(lens, 1, 2, seed=3)
    d["cu_seqlens"] = d["cu_seqlens"].to(idx)
    T = sum(lens)
    extra = 40  # positions past cu_seqlens[-1] must come out as zeros
    for name in ("q", "k", "v", "g", "beta"):
        x = d[name]
        d[name] = torch.cat([x, torch.randn((1, extra) + tuple(x.shape[2:]), device=DEV, dtype=x.dtype)], 1)
    o, s = run_ours(d)
    ro, rs = ref64(d)
    assert torch.all(o[:, T:] == 0)
    assert rel_l2(o, ro) <= 4e-3 and rel_l2(s, rs) <= 4e-3
    assert torch.equal(s[0], d["initial_state"][0]) and torch.equal(s[5], d["initial_state"][5])


# Packed sequences do not see each other: NaN in every input of one sequence reaches no other sequence's o or
# state. (The prep's TMA loads bring the next packed sequence's tokens into a partial chunk's tail rows, which it
# must zero as cp.async's zero fill did.) Each clean sequence alone gives bitwise the same o rows and state.
@pytest.mark.parametrize("l2norm", [False, True])
def test_packed_sequences_are_isolated(monkeypatch, l2norm):
    monkeypatch.setenv("FLASHQLA_CP", "0")
    lens = [100, 37, 200, 64]
    d = make(lens, 2, 4, seed=71)
    kw = {"use_qk_l2norm_in_kernel": l2norm}
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist()
    bad = slice(bounds[1], bounds[2])  # the second sequence: the tail rows of the first one's last chunk
    for name in ("q", "k", "v", "g", "beta"):
        d[name][:, bad] = float("nan")
    o, s = run_ours(d, **kw)
    for n in (0, 2, 3):
        a, b = bounds[n], bounds[n + 1]
        one = {name: d[name][:, a:b] for name in ("q", "k", "v", "g", "beta")}
        one.update(initial_state=d["initial_state"][n:n + 1], cu_seqlens=None)
        o1, s1 = run_ours(one, **kw)
        assert torch.isfinite(o[:, a:b]).all() and torch.isfinite(s[n]).all()
        assert torch.equal(o[:, a:b], o1) and torch.equal(s[n], s1[0])


def test_dense_batch_fp16_bf16_gates_no_h0():
    d = make([200], 2, 4, dtype=torch.float16, dense_B=3, seed=4, g_dtype=torch.bfloat16, beta_dtype=torch.float16)
    d["initial_state"] = None
    o, s = run_ours(d)
    ro, rs = ref64(d)
    assert o.dtype == torch.float16
    assert rel_l2(o, ro) <= 4e-3 and rel_l2(s, rs) <= 4e-3


def test_l2norm_in_kernel():
    d = make([150], 2, 4, seed=5)
    d["q"] = (d["q"].float() * 3).to(torch.bfloat16)
    d["k"] = (d["k"].float() * 0.5).to(torch.bfloat16)
    o, s = run_ours(d, use_qk_l2norm_in_kernel=True)
    ro, rs = ref64(d, use_qk_l2norm_in_kernel=True)
    assert rel_l2(o, ro) <= 4e-3 and rel_l2(s, rs) <= 4e-3


def test_strided_views_of_a_fused_projection():
    d = make([180], 2, 4, seed=6)
    T = 180
    fused = torch.randn(1, T, 2 * 2 + 4, D, device=DEV, dtype=torch.bfloat16)
    fused[:, :, 0:2] = d["q"]
    fused[:, :, 2:4] = d["k"]
    fused[:, :, 4:8] = d["v"]
    x = dict(d, q=fused[:, :, 0:2], k=fused[:, :, 2:4], v=fused[:, :, 4:8])
    assert not x["q"].is_contiguous()
    o, s = flashqla.chunk_gdn(**x, output_final_state=True)
    o2, s2 = flashqla.chunk_gdn(**d, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)


def test_head_major_views():
    # q, k, v stored [B, H, T, D] and passed as their [B, T, H, D] transposes (time stride D, head stride T D): the
    # strides the prep's TMA maps describe differ from the usual layout; the outputs must equal the contiguous
    # inputs' bit for bit
    d = make([200], 2, 4, dense_B=2, seed=9)
    x = dict(d)
    for name in ("q", "k", "v"):
        x[name] = d[name].transpose(1, 2).contiguous().transpose(1, 2)
        assert not x[name].is_contiguous() and x[name].stride(1) == D
    o, s = flashqla.chunk_gdn(**x, output_final_state=True)
    o2, s2 = flashqla.chunk_gdn(**d, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)


def test_many_short_sequences():
    gen = torch.Generator().manual_seed(8)
    lens = torch.randint(0, 40, (2000,), generator=gen).tolist()
    d = make(lens, 1, 2, seed=8)
    o, s = run_ours(d)
    ro = chunk_gdn_torch(**{k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                            for k, v in d.items()}, output_final_state=True)
    assert rel_l2(o, ro[0]) <= 4e-3 and rel_l2(s, ro[1]) <= 4e-3


@pytest.mark.parametrize("order", ["heads", "chunks"])
def test_more_chunks_than_a_grid_dimension_holds(monkeypatch, order):
    # the preps' head-major grid spreads the chunks of all sequences over the grid's y and z (at most 65535 each):
    # 65600 packed sequences of 0-4 tokens need both (the chunk-major grid, and the gradient kernel's, put them in
    # x). The first and the last 40 sequences' outputs, final states and gradients (head-major: the last ones from
    # CTAs with blockIdx.z = 1) against float64 autograd of the recurrence on those sequences alone (the forward on
    # a poisoned output block, run_ours; the gradients through autograd).
    from flashqla.reference import recurrent_gdn
    monkeypatch.setenv("FLASHQLA_PREP_ORDER", order)
    n = 65600
    lens = [(1, 3, 0, 4)[i % 4] for i in range(n)]
    d = make(lens, 1, 2, seed=14)
    d["initial_state"] = None
    o, fs = run_ours(d)
    names = ["q", "k", "v", "g", "beta"]
    leaves = {k: d[k].clone().requires_grad_(True) for k in names}
    o_ad, _ = flashqla.chunk_gdn(**leaves, cu_seqlens=d["cu_seqlens"])
    gen = torch.Generator(device=DEV).manual_seed(15)
    do = torch.randn(o.shape, device=DEV, generator=gen).to(o.dtype)
    got = torch.autograd.grad((o_ad.float() * do.float()).sum(), [leaves[k] for k in names])
    assert torch.isfinite(o).all() and torch.isfinite(fs).all() and all(torch.isfinite(x).all() for x in got)
    cu = d["cu_seqlens"].tolist()
    for s0, s1 in ((0, 40), (n - 40, n)):
        t0, t1 = cu[s0], cu[s1]
        x = {k: d[k][:, t0:t1].double().cpu().requires_grad_(True) for k in names}
        sub_cu = torch.tensor([c - t0 for c in cu[s0:s1 + 1]])
        ro, rs = recurrent_gdn(**x, cu_seqlens=sub_cu, output_final_state=True)
        ref = torch.autograd.grad((ro * do[:, t0:t1].double().cpu()).sum(), [x[k] for k in names])
        assert rel_l2(o[:, t0:t1], ro) <= 4e-3 and rel_l2(o_ad[:, t0:t1], ro) <= 4e-3, (s0, "o")
        assert rel_l2(fs[s0:s1], rs) <= 4e-3, (s0, "final state")
        for k, a, r in zip(names, got, ref):
            e = rel_l2(a[:, t0:t1], r)
            print(f"sequences {s0}-{s1} d{k}: {e:.2e}")
            assert e <= 6e-3, (s0, k)


@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_prep_launch_orders_give_the_same_bits(monkeypatch, case):
    # FLASHQLA_PREP_ORDER: the preps' CTAs in head-major or chunk-major launch order (chunk_grid; the rule picks by
    # the size of K and Q against L2) compute the same tiles, so o, the final state and every gradient are bitwise
    # equal. Packed sequences with empty and partial chunks, a dense batch, fp16 with l2norm and GVA 4.
    monkeypatch.setenv("FLASHQLA_CP", "0")
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")  # (the prep kernel, not the workers beside the chain)
    d, kw = three_forms(case, 71)
    modes_agree_bitwise(monkeypatch, "FLASHQLA_PREP_ORDER", ("chunks", "heads"), d, kw)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    gen = torch.Generator(device=DEV).manual_seed(72)
    do = torch.randn(d["v"].shape, device=DEV, generator=gen).to(d["v"].dtype)
    grads = []
    for order in ("chunks", "heads"):
        monkeypatch.setenv("FLASHQLA_PREP_ORDER", order)
        leaves = {k: d[k].clone().requires_grad_(True) for k in names}
        o, _ = flashqla.chunk_gdn(**leaves, cu_seqlens=d["cu_seqlens"], **kw)
        grads.append(torch.autograd.grad((o.float() * do.float()).sum(), [leaves[k] for k in names]))
    for k, a, b in zip(names, *grads):
        assert torch.isfinite(a).all() and torch.equal(a, b), k


def test_long_sequence_against_float64_chunked():
    d = make([32768], 1, 2, seed=9)
    o, s = run_ours(d)
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, rs = chunk_gdn_torch(**x, output_final_state=True)
    eo, es = rel_l2(o, ro), rel_l2(s, rs)
    print(f"T=32768: o {eo:.2e} final {es:.2e}")
    assert eo <= 5e-3 and es <= 5e-3


def test_context_parallel_forward(monkeypatch):
    # context parallelism (FLASHQLA_CP=1, the default) on a TP8-like shape (2/8 heads, one long sequence + one short): the segmented forward
    # against the float64 chunked reference, no worse than the plain kernel; graph capture after a warm-up
    from flashqla import _cp
    d = make([12288, 1000], 2, 8, seed=13)
    cu_cpu = d["cu_seqlens"].cpu()
    monkeypatch.setenv("FLASHQLA_CP", "0")
    plain_o, plain_s = run_ours(d, cu_seqlens_cpu=cu_cpu)
    monkeypatch.setenv("FLASHQLA_CP", "1")
    calls = count_calls(monkeypatch, _cp, "forward")
    o, s = flashqla.chunk_gdn(**d, output_final_state=True, cu_seqlens_cpu=cu_cpu)
    assert calls, "the plan did not choose segments"
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, rs = chunk_gdn_torch(**x, output_final_state=True)
    eo, es, po, ps = rel_l2(o, ro), rel_l2(s, rs), rel_l2(plain_o, ro), rel_l2(plain_s, rs)
    print(f"CP: o {eo:.2e} final {es:.2e} (plain: o {po:.2e} final {ps:.2e})")
    assert eo <= max(1.25 * po, 3.2e-3) and es <= max(1.25 * ps, 3.0e-3)
    graph, (go, gs) = captured(lambda: flashqla.chunk_gdn(**d, output_final_state=True, cu_seqlens_cpu=cu_cpu))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(go, o) and torch.equal(gs, s)


def _merge_off_and_on(monkeypatch, strong, with_h0, seed):
    """The forward through segments (a long sequence cut into 64-chunk segments and a short one) with
    FLASHQLA_CP_MERGE=0 and =1, outputs poisoned: the inputs and {"0": (o, final), "1": (o, final)}."""
    from flashqla import _cp
    d = make([24576, 1000], 2, 8, strong=strong, seed=seed)
    if not with_h0:
        d["initial_state"] = None
    cu_cpu = d["cu_seqlens"].cpu()
    calls = count_calls(monkeypatch, _cp, "forward")
    out = {}
    for merge in ("0", "1"):
        monkeypatch.setenv("FLASHQLA_CP_MERGE", merge)
        n = len(calls)  # (run_ours may repeat the call)
        out[merge] = run_ours(d, cu_seqlens_cpu=cu_cpu)
        assert len(calls) > n, "the plan did not choose segments"
    return d, out


@pytest.mark.parametrize("strong,with_h0", [(False, True), (True, True), (True, False)])
def test_context_parallel_merge_gives_the_full_walks_bits(monkeypatch, strong, with_h0):
    # FLASHQLA_CP_MERGE=1 (opt-in): the summaries' B pass also writes O where its walk may merge (the
    # segment's first half of gates sums to at most -50), and the last pass stops where its fp32 state equals B's at
    # a checkpoint, leaving B's O and final state: o and the final states bitwise the full last pass's (=0) on the
    # same chain form (FLASHQLA_WGMMA=1: O by the state warps, as the merging pass and the paired chain form it; the
    # default O-beside chain orders O's products otherwise). A long sequence cut into 64-chunk segments (the anchors'
    # gates merge after ~11 chunks) and a short one; under strong decay after a chunk; without h0 the first segment
    # merges at once. Outputs poisoned (run_ours).
    monkeypatch.setenv("FLASHQLA_WGMMA", "1")
    d, out = _merge_off_and_on(monkeypatch, strong, with_h0, seed=14)
    assert torch.isfinite(out["1"][0].float()).all()
    assert torch.equal(out["1"][0], out["0"][0]) and torch.equal(out["1"][1], out["0"][1])


@pytest.mark.parametrize("strong,with_h0", [(False, True), (True, True), (True, False)])
def test_context_parallel_merge_o_beside(monkeypatch, strong, with_h0):
    # FLASHQLA_CP_MERGE=1 with FLASHQLA_CP_MERGE_OB=1, the default chain form otherwise: the merging last pass runs O
    # beside the chain (its O warps end at the state warps' stop, and so do its loaders); the chunks after the merge
    # keep the B pass's O, another product order: the final states bitwise the unmerged pass's (the two forms' state
    # arithmetic is the same), o equal to rounding and as close to float64. Under strong decay head 0 (g = 0) never
    # merges: its CTAs walk in full beside merging ones. Outputs poisoned (run_ours).
    monkeypatch.delenv("FLASHQLA_WGMMA", raising=False)
    monkeypatch.setenv("FLASHQLA_CP_MERGE_OB", "1")
    d, out = _merge_off_and_on(monkeypatch, strong, with_h0, seed=15)
    (o1, s1), (o0, s0) = out["1"], out["0"]
    assert torch.isfinite(o1.float()).all() and torch.equal(s1, s0)
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, _ = chunk_gdn_torch(**x, output_final_state=True)
    e1, e0, d10 = rel_l2(o1, ro), rel_l2(o0, ro), rel_l2(o1, o0)
    print(f"CP merge, O beside: o {e1:.2e} (unmerged {e0:.2e}), merged against unmerged {d10:.2e}")
    assert d10 < 4e-3 and e1 <= 1.1 * e0 + 1e-4


def test_deterministic_and_cuda_graph():
    d = make([1000, 3000], 2, 4, seed=10)
    a = flashqla.chunk_gdn(**d, output_final_state=True)
    b = flashqla.chunk_gdn(**d, output_final_state=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flashqla.chunk_gdn(**d, output_final_state=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashqla.chunk_gdn(**d, output_final_state=True)
    d["v"].copy_(torch.randn_like(d["v"]))
    graph.replay()
    torch.cuda.synchronize()
    ref = flashqla.chunk_gdn(**d, output_final_state=True)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_low_level_backward_captures_in_a_cuda_graph():
    # the GPU backward (PyTorch chunked, until the kernels exist) must not sync with the host either
    d = make([300, 700], 2, 4, seed=12)
    do = torch.randn_like(d["v"])
    dht = torch.randn_like(d["initial_state"])
    call = lambda: flashqla.chunk_gdn_bwd(d["q"], d["k"], d["v"], d["g"], d["beta"], do, dht,  # noqa: E731
                                          initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"])
    graph, out = captured(call)
    do.copy_(torch.randn_like(do))
    graph.replay()
    torch.cuda.synchronize()
    ref = call()
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_no_tokens_keeps_states():
    d = make([0, 0], 1, 2, seed=11)
    o, s = flashqla.chunk_gdn(**d, output_final_state=True)
    assert o.shape[1] == 0 and torch.equal(s, d["initial_state"])


def test_gradients_through_chunk_gdn_on_gpu():
    # autograd through chunk_gdn on the GPU: the sm_90a forward, the backward's chains on the kernels
    d = make([300], 2, 4, seed=12)
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    leaves = {n: d[n].clone().requires_grad_(True) for n in names}
    o, s = flashqla.chunk_gdn(**leaves, cu_seqlens=d["cu_seqlens"], output_final_state=True)
    gen = torch.Generator(device=DEV).manual_seed(3)
    do = torch.randn(o.shape, device=DEV, generator=gen).to(o.dtype)
    dht = torch.randn(s.shape, device=DEV, generator=gen) / 8
    got = torch.autograd.grad((o.float() * do.float()).sum() + (s * dht).sum(), [leaves[n] for n in names])
    x = {n: d[n].double().cpu().requires_grad_(True) for n in names}
    ro, rs = recurrent_gdn(**x, cu_seqlens=d["cu_seqlens"].cpu(), output_final_state=True)
    ref = torch.autograd.grad((ro * do.double().cpu()).sum() + (rs * dht.double().cpu()).sum(), [x[n] for n in names])
    limits = dict(q=4.0e-3, k=5.0e-3, v=3.5e-3, g=2.9e-3, beta=2.7e-3, initial_state=0.8e-3)  # FLA's, anchors
    for n, a, b in zip(names, ref, got):
        e = rel_l2(b.cpu(), a)
        print(f"d{n}: {e:.2e}")
        assert e <= limits[n], n


def test_torch_compile_kernel_path():
    d = make([500, 300], 2, 4, seed=13)
    f = torch.compile(flashqla.chunk_gdn)
    o, s = f(**d, output_final_state=True)
    o2, s2 = flashqla.chunk_gdn(**d, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(s, s2)


def three_forms(case, seed):
    """The forms' comparison cases: varlen (zero-length sequences, tails, one long sequence, GVA 2), dense (B = 3),
    GVA 4 fp16 with in-kernel l2norm on rows that are not unit length."""
    if case == "varlen":
        return make([0, 65, 1, 700, 0, 130, 2300], 2, 4, seed=seed), {}
    if case == "dense":
        return make([333], 1, 3, dense_B=3, seed=seed + 1), {}
    d = make([64, 191, 1500], 2, 8, dtype=torch.float16, seed=seed + 2)
    d["q"], d["k"] = d["q"] * 3, d["k"] * 0.5   # not unit rows: the kernels normalise them
    return d, {"use_qk_l2norm_in_kernel": True}


def modes_agree_bitwise(monkeypatch, var, modes, d, kw, kernels=None):
    """The forward under each value of the environment variable var: o and the final state bitwise equal, and
    the last mode's within 5e-3 of the float64 chunked reference. kernels(mode, names): given, each call runs under
    the profiler and it checks the names of the GPU kernels that mode launched."""
    out = [None, None]
    for i, mode in enumerate(modes):
        monkeypatch.setenv(var, mode)
        if kernels is None:
            out[i] = run_ours(d, **kw)
        else:
            kernels(mode, gpu_kernel_names(lambda: out.__setitem__(i, run_ours(d, **kw))))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, rs = chunk_gdn_torch(**x, output_final_state=True, **kw)
    assert rel_l2(out[1][0], ro) < 5e-3 and rel_l2(out[1][1], rs) < 5e-3


@pytest.mark.parametrize("prep_heads", ["1", "8"])
@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_split_and_fused_forward_agree_bitwise(monkeypatch, case, prep_heads):
    # the split mode (prep kernel + loading recurrent kernel, FLASHQLA_FWD_SPLIT=1, the default) computes the
    # same X and W in the same dtype as the fused mode, only through global memory: outputs must be identical,
    # also when one prep CTA serves a whole GVA group (FLASHQLA_PREP_HEADS=8: groups of 2, 3 and 4 heads here)
    monkeypatch.setenv("FLASHQLA_PREP_HEADS", prep_heads)
    monkeypatch.setenv("FLASHQLA_KSPLIT", "0")  # the fused kernel's chain (the K-split one sums KS^T in halves,
    monkeypatch.setenv("FLASHQLA_WGMMA", "0")   # wgmma in its own order)
    d, kw = three_forms(case, 21)
    monkeypatch.setenv("FLASHQLA_CP", "0")
    modes_agree_bitwise(monkeypatch, "FLASHQLA_FWD_SPLIT", ("0", "1"), d, kw)


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_chain_loads_by_tma_are_the_copies_bitwise(monkeypatch, case, overlap):
    # the O-beside chain's K, Q, X and W by TMA (the default where the tensor maps can be made) against its
    # cp.async loads (FLASHQLA_CHAIN_TMA=0): the same tiles, so the same bits. Packed sequences with empty and
    # partial chunks (rows past each end arrive holding the next sequence's data and are zeroed), dense batches,
    # fp16 with l2norm; on the separate prep kernel's X and W, and (overlap 1) with the prep beside the chain, whose
    # X and W the TMA reads once each chunk's flag is set. FLASHQLA_CHAIN_TMA=2 makes the launch fail where the
    # maps cannot be made, so the TMA side cannot silently be the copies.
    for name in ("FLASHQLA_KSPLIT", "FLASHQLA_PREP_HEADS", "FLASHQLA_PREP_WG", "FLASHQLA_FWD_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_WGMMA", "2")    # the O-beside chain, whatever the rule would pick here
    monkeypatch.setenv("FLASHQLA_CP", "0")
    monkeypatch.setenv("FLASHQLA_OVERLAP", overlap)
    d, kw = three_forms(case, 31)
    modes_agree_bitwise(monkeypatch, "FLASHQLA_CHAIN_TMA", ("0", "2"), d, kw)


@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_gates_from_the_prep_are_the_chains_bitwise(monkeypatch, case):
    # FLASHQLA_GATES_FROM_PREP (on by default): the wgmma prep kernel writes each chunk's gamma and decay and the
    # O-beside chain's TMA loader copies them instead of computing them (the same function on the same inputs),
    # so o and the final state are bitwise those of =0. Packed sequences with empty and partial chunks (the
    # padding rows' gates), dense batches, fp16 with l2norm and fp32 gates. =2 makes the launch fail where the
    # gates cannot come from the prep, so that side cannot silently compute them.
    for name in ("FLASHQLA_KSPLIT", "FLASHQLA_PREP_HEADS", "FLASHQLA_PREP_WG", "FLASHQLA_FWD_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_WGMMA", "2")      # the O-beside chain
    monkeypatch.setenv("FLASHQLA_CHAIN_TMA", "2")  # its TMA form
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")    # on the prep kernel (the prep beside the chain has no copy)
    monkeypatch.setenv("FLASHQLA_CP", "0")
    d, kw = three_forms(case, 51)
    modes_agree_bitwise(monkeypatch, "FLASHQLA_GATES_FROM_PREP", ("0", "2"), d, kw)


@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_paired_chain_is_the_wgmma_chains_bitwise(monkeypatch, case):
    # FLASHQLA_CHAIN_PAIR (the default where the O-beside chain would need two waves): one CTA per (sequence,
    # value head), its two state warpgroups each running the wgmma chain with O (FLASHQLA_WGMMA=1's state role) on
    # one of the V halves of a shared stage that a TMA producer fills, with the gates the prep kernel wrote. The same products in the same
    # order on the same operands: o and the final state bitwise those of FLASHQLA_WGMMA=1 (two CTAs a head, its
    # loaders computing the gates and copying the tiles). Packed sequences with empty and partial chunks (the zeroed
    # rows past a sequence's end), a dense batch, and fp16 with the in-kernel l2norm (the producer's). =2 makes the
    # launch fail where the paired chain cannot run.
    for name in ("FLASHQLA_KSPLIT", "FLASHQLA_PREP_HEADS", "FLASHQLA_PREP_WG", "FLASHQLA_FWD_SPLIT",
                 "FLASHQLA_CHAIN_TMA", "FLASHQLA_GATES_FROM_PREP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")  # (on the prep kernel: the prep beside the chain has no gates copy)
    monkeypatch.setenv("FLASHQLA_CP", "0")
    d, kw = three_forms(case, 61)
    monkeypatch.setenv("FLASHQLA_WGMMA", "1")
    monkeypatch.setenv("FLASHQLA_CHAIN_PAIR", "0")
    o1, s1 = run_ours(d, **kw)
    monkeypatch.delenv("FLASHQLA_WGMMA")
    monkeypatch.setenv("FLASHQLA_CHAIN_PAIR", "2")
    o2, s2 = run_ours(d, **kw)
    assert torch.equal(o1, o2) and torch.equal(s1, s2)
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, rs = chunk_gdn_torch(**x, output_final_state=True, **kw)
    assert rel_l2(o2, ro) < 5e-3 and rel_l2(s2, rs) < 5e-3


def test_paired_chain_names_its_kernel(monkeypatch):
    # the switch reaches the kernel (a test above that compared a form with itself would pass)
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")
    monkeypatch.setenv("FLASHQLA_CP", "0")
    monkeypatch.setenv("FLASHQLA_CHAIN_PAIR", "2")
    d, kw = three_forms("varlen", 62)
    names = gpu_kernel_names(lambda: run_ours(d, **kw))
    assert any("gdn_fwd_pair_kernel" in n for n in names), names


@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_paired_chain_o_store_forms_bitwise(monkeypatch, case):
    # FLASHQLA_O_TMA: the paired chain's warps stage O the same way and store whole chunks by one TMA box each (=2:
    # that form or a failed launch, so the comparison cannot be of a form with itself) or every chunk by lane
    # stores (=0). The same bits, including the partial chunks at sequence ends (lane stores in both: the next
    # packed sequence's rows follow) and the poisoned positions run_ours checks.
    for name in ("FLASHQLA_KSPLIT", "FLASHQLA_PREP_HEADS", "FLASHQLA_PREP_WG", "FLASHQLA_FWD_SPLIT",
                 "FLASHQLA_CHAIN_TMA", "FLASHQLA_GATES_FROM_PREP", "FLASHQLA_WGMMA", "FLASHQLA_PREP_AB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")
    monkeypatch.setenv("FLASHQLA_CP", "0")
    monkeypatch.setenv("FLASHQLA_CHAIN_PAIR", "2")
    d, kw = three_forms(case, 64)
    modes_agree_bitwise(monkeypatch, "FLASHQLA_O_TMA", ("0", "2"), d, kw)


@pytest.mark.parametrize("chain", ["pair", "obeside"])
@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_paired_chain_forms_x_from_the_preps_operand_bitwise(monkeypatch, case, chain):
    # FLASHQLA_PREP_AB (on where the paired chain runs on the op's own workspace): the prep kernel (its kAb
    # instantiation) writes X's 64-column 16-bit operand instead of X (8 KB a chunk-head for 16) and the pair's
    # producer forms X from it with K; the same operands in the same product order, so o and the final state are
    # bitwise those of the prep's X (=0). The instantiations that ran are checked by name (a comparison of a form with
    # itself would pass). Where the O-beside chain runs (FLASHQLA_CHAIN_PAIR=0) the prep writes X either way.
    for name in ("FLASHQLA_KSPLIT", "FLASHQLA_PREP_HEADS", "FLASHQLA_PREP_WG", "FLASHQLA_FWD_SPLIT",
                 "FLASHQLA_CHAIN_TMA", "FLASHQLA_GATES_FROM_PREP", "FLASHQLA_WGMMA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")
    monkeypatch.setenv("FLASHQLA_CP", "0")
    monkeypatch.setenv("FLASHQLA_CHAIN_PAIR", "2" if chain == "pair" else "0")
    d, kw = three_forms(case, 63)

    def kernels(mode, names):
        prep = [n for n in names if "gdn_prep_kernel<" in n]
        assert len(prep) == 1 and template_flag(prep[0], "gdn_prep_kernel") == (mode == "1" and chain == "pair"), names
        pair = [n for n in names if "gdn_fwd_pair_kernel<" in n]
        if chain == "pair":
            assert len(pair) == 1 and template_flag(pair[0], "gdn_fwd_pair_kernel") == (mode == "1"), names
        else:
            assert not pair and any("gdn_fwd_mma_kernel<" in n for n in names), names
    modes_agree_bitwise(monkeypatch, "FLASHQLA_PREP_AB", ("0", "1"), d, kw, kernels)


def template_flag(name, kernel, index=-1):
    """A bool template argument of a kernel's demangled name (true / false or (bool)1 / (bool)0); default the last."""
    args = name.split(kernel + "<", 1)[1].split(">", 1)[0].split(",")
    return args[index].strip() in ("true", "(bool)1")


def gpu_kernel_names(fn):
    """The names of the GPU kernels fn launches (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def is_wg_prep(name):
    """gdn_prep_kernel's kWg instantiation: its fifth template argument."""
    return template_flag(name, "gdn_prep_kernel", 4)


# the wgmma prep (the default, in the prep kernel and in the workers beside the chain; FLASHQLA_PREP_WG=0: mma.sync): the
# mma.sync prep's products with K K^T, Q K^T, W = P M and X as wgmma, so X and W can differ from that prep's in
# rounding only (accumulation order): outputs close to its outputs, as accurate against float64, deterministic;
# the workers of the prep beside the chain run it too (bitwise the same)
@pytest.mark.parametrize("case", ["varlen", "dense", "l2norm_fp16"])
def test_wgmma_prep_matches_the_mma_prep(monkeypatch, case):
    for name in ("FLASHQLA_WGMMA", "FLASHQLA_KSPLIT", "FLASHQLA_PREP_HEADS", "FLASHQLA_FWD_SPLIT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_CP", "0")
    monkeypatch.setenv("FLASHQLA_OVERLAP", "0")  # (the prep beside the chain has its own, mma.sync, prep)
    d, kw = three_forms(case, 61)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("FLASHQLA_PREP_WG", mode)
        names = gpu_kernel_names(lambda: out.__setitem__(mode, run_ours(d, **kw)))
        # the form asked for ran (the products can round as the mma.sync ones do: Hopper's tensor cores sum
        # each k16 step alike, so equal outputs alone would not tell which prep ran)
        preps = [n for n in names if "gdn_prep_kernel<" in n]
        assert preps and all(is_wg_prep(n) == (mode == "1") for n in preps), preps
    assert rel_l2(out["1"][0], out["0"][0]) < 2e-3 and rel_l2(out["1"][1], out["0"][1]) < 2e-3
    monkeypatch.delenv("FLASHQLA_PREP_WG")  # the default: the wgmma form
    again = {}
    preps = [n for n in gpu_kernel_names(lambda: again.update(enumerate(run_ours(d, **kw)))) if "gdn_prep_kernel<" in n]
    assert preps and all(map(is_wg_prep, preps)), preps
    assert torch.equal(again[0], out["1"][0]) and torch.equal(again[1], out["1"][1])
    monkeypatch.setenv("FLASHQLA_OVERLAP", "1")  # the same prep by the workers beside the chain: the same bits
    beside = run_ours(d, **kw)
    assert torch.equal(beside[0], out["1"][0]) and torch.equal(beside[1], out["1"][1])
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, rs = chunk_gdn_torch(**x, output_final_state=True, **kw)
    for mode in ("0", "1"):
        assert rel_l2(out[mode][0], ro) < 5e-3 and rel_l2(out[mode][1], rs) < 5e-3


@pytest.mark.parametrize("l2norm", [False, True])
def test_states_recompute_prep_agrees_bitwise(monkeypatch, l2norm):
    # the backward's state recompute (chunk_gdn_fwd_states: chunk states, no o) runs a prep kernel that computes
    # X alone (no Q, Q K^T, M or W); its chunk states and final states equal, bit for bit, the fused mode's,
    # whose aux warps compute every product
    monkeypatch.setenv("FLASHQLA_KSPLIT", "0")  # the fused kernel's chain (the K-split one sums KS^T in halves,
    monkeypatch.setenv("FLASHQLA_WGMMA", "0")   # wgmma in its own order)
    d = make([64, 191, 1500, 0, 77], 2, 8, dtype=torch.float16, seed=26)
    if l2norm:
        d["q"], d["k"] = d["q"] * 3, d["k"] * 0.5
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], D ** -0.5, d["initial_state"], d["cu_seqlens"], l2norm)
    out = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("FLASHQLA_FWD_SPLIT", mode)
        out[mode] = torch.ops.flashqla.chunk_gdn_fwd_states(*args)
    n = sum(-(-x // 64) for x in (64, 191, 1500, 0, 77))
    assert torch.equal(out["0"][:n], out["1"][:n]) and torch.isfinite(out["1"][:n].float()).all()


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("counts", [[9, 1, 4, 2], [6]])  # 16 and 8 columns per CTA (few sequences x heads)
@pytest.mark.parametrize("h0", [True, False])
def test_cp_scan_kernel_against_float64(h0, counts, reverse):
    # the scan kernel (chunk_gdn_cp_scan on the GPU) against the same recursion in float64 on the CPU: sequences
    # of 1 to 9 segments, 3 heads; every entry of the output compared (a missed write would show as garbage); and
    # the reverse walk (Phi read transposed in place, each sequence from its last segment back)
    S, H = sum(counts), 3
    gen = torch.Generator(device=DEV).manual_seed(31)
    # maps of norm ~1 (decayed transitions), as the summaries passes give them
    phi = torch.linalg.qr(torch.randn(S, H, D, D, device=DEV, generator=gen))[0] * 0.9
    b = torch.randn(S, H, D, D, device=DEV, generator=gen)
    h = torch.randn(len(counts), H, D, D, device=DEV, generator=gen) if h0 else None
    last = torch.tensor(counts, device=DEV).cumsum(0) - 1
    got = torch.ops.flashqla.chunk_gdn_cp_scan(phi.contiguous(), b, h, last, reverse)
    ref = torch.ops.flashqla.chunk_gdn_cp_scan(phi.double().cpu(), b.double().cpu(), None if h is None else h.double().cpu(),
                                               last.cpu(), reverse)
    err = rel_l2(got, ref)
    print(f"cp scan: rel. L2 {err:.2e}")
    assert torch.isfinite(got).all() and err < 1e-5
    with pytest.raises(RuntimeError, match="last must be a contiguous int64"):
        torch.ops.flashqla.chunk_gdn_cp_scan(phi.contiguous(), b, h, last.int())


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cols", ["8", "16", "32"])
def test_cp_scan_tma_is_the_copies_bitwise(monkeypatch, cols, reverse):
    # FLASHQLA_SCAN_TMA (on by default): Phi_i arrives as four swizzled 128 x 32 boxes by TMA instead of every
    # thread's cp.async into padded rows; the FMAs read the same values in the same order, so the states are
    # bitwise those of =0, for every slice width, on sequences of 1 to 9 segments with and without h0, and within
    # 1e-5 of float64
    S, H, counts = 17, 3, [9, 1, 4, 2, 1]
    gen = torch.Generator(device=DEV).manual_seed(32)
    phi = (torch.linalg.qr(torch.randn(S, H, D, D, device=DEV, generator=gen))[0] * 0.9).contiguous()
    b = torch.randn(S, H, D, D, device=DEV, generator=gen)
    last = torch.tensor(counts, device=DEV).cumsum(0) - 1
    monkeypatch.setenv("FLASHQLA_SCAN_COLS", cols)
    for h in (torch.randn(len(counts), H, D, D, device=DEV, generator=gen), None):
        out = {}
        for mode in ("0", "1", "1-rows2"):  # (and two rows a thread, FLASHQLA_SCAN_ROWS=2: the same FMA order)
            monkeypatch.setenv("FLASHQLA_SCAN_TMA", mode[0])
            monkeypatch.setenv("FLASHQLA_SCAN_ROWS", "2" if mode.endswith("rows2") else "1")
            out[mode] = torch.ops.flashqla.chunk_gdn_cp_scan(phi, b, h, last, reverse)
        assert torch.equal(out["0"], out["1"]) and torch.equal(out["0"], out["1-rows2"])
        ref = torch.ops.flashqla.chunk_gdn_cp_scan(phi.double().cpu(), b.double().cpu(),
                                                   None if h is None else h.double().cpu(), last.cpu(), reverse)
        assert rel_l2(out["1"], ref) < 1e-5
        if reverse:  # the reverse walk is the forward one over the reversed, transposed copy, bit for bit
            rev = torch.cat([torch.arange(e, e - n, -1) for n, e in zip(counts, last.tolist())]).to(DEV)
            fwd = torch.ops.flashqla.chunk_gdn_cp_scan(phi.transpose(2, 3)[rev].contiguous(), b[rev].contiguous(),
                                                       h, last)[rev]
            assert torch.equal(out["1"], fwd)


@pytest.mark.parametrize("summary_ob", ["1", "1-copies", "0"])
@pytest.mark.parametrize("split", ["1", "0"])
def test_cp_pass_summaries_and_shared_chunk_products(monkeypatch, split, summary_ob):
    # exact parallelism's pass op: summaries only (no o) leaves the state chain bitwise unchanged, zero_v equals
    # a zero v, and a pass
    # reusing the chunk products an earlier pass left in the workspace (other v, other h0) equals a fresh call;
    # with the summaries on the O-beside chain's kernel (FLASHQLA_SUMMARY_OB=1, its TMA loads without Q and W, and
    # without V for zero_v; or its copies) as on the wgmma chain's (=0)
    from flashqla._library import fwd_workspace_bytes
    monkeypatch.setenv("FLASHQLA_FWD_SPLIT", split)
    monkeypatch.setenv("FLASHQLA_SUMMARY_OB", summary_ob[0])
    if summary_ob == "1-copies":  # (the O-beside kernel's copy form: its loaders' cp.async, no tensor maps)
        monkeypatch.setenv("FLASHQLA_CHAIN_TMA", "0")
    d = make([0, 65, 700, 1, 1300], 2, 4, seed=24)
    q, k, v, g, beta, h0, cu = (d[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    scale = D ** -0.5
    full = torch.ops.flashqla.chunk_gdn_fwd(q, k, v, g, beta, scale, h0, True, cu, False)
    ws = torch.full((fwd_workspace_bytes(1, q.shape[1], v.shape[2]),), 0xFF, dtype=torch.uint8, device=DEV)
    op = torch.ops.flashqla.chunk_gdn_fwd_pass
    o0, s0 = op(q, k, v, g, beta, scale, h0, cu, False, ws, False, False, False)
    assert o0.numel() == 0 and torch.equal(s0, full[1])
    # zero_v: v taken as zeros without reading it, as a real zero v
    zeros = torch.ops.flashqla.chunk_gdn_fwd(q, k, torch.zeros_like(v), g, beta, scale, h0, True, cu, False)
    _, sz = op(q, k, v, g, beta, scale, h0, cu, False, ws, True, False, True)
    assert torch.equal(sz, zeros[1])
    gen = torch.Generator(device=DEV).manual_seed(25)
    v2 = torch.randn(v.shape, device=DEV, generator=gen).to(v.dtype)
    h2 = torch.randn(h0.shape, device=DEV, generator=gen)
    fresh = torch.ops.flashqla.chunk_gdn_fwd(q, k, v2, g, beta, scale, h2, True, cu, False)
    o1, s1 = op(q, k, v2, g, beta, scale, h2, cu, False, ws, True, True, False)
    assert torch.equal(o1, fresh[0]) and torch.equal(s1, fresh[1])


@pytest.mark.parametrize("case", ["bf16", "fp16_l2norm_int64"])
def test_cp_summaries_pair_equals_the_two_passes(monkeypatch, case):
    # chunk_gdn_cp_summaries: the B chain and the transition chain as one launch of the paired kernel
    # (FLASHQLA_SUMMARY_PAIR=2: that launch or an error) bitwise equal to the two passes (=0: the O-beside kernel
    # twice; the same state arithmetic, the prep's gates the same bits as the loaders'), outputs poisoned first;
    # the chunk products it leaves serve a prep_ready pass with o as a fresh call; without the gates' room in the
    # workspace =2 fails and =1 falls back to the two passes
    from flashqla._library import fwd_gates_workspace_bytes, fwd_workspace_bytes
    fp16 = case.startswith("fp16")
    lens = [0, 65, 700, 1, 1300, 128]
    d = make(lens, 2, 4, dtype=torch.float16 if fp16 else torch.bfloat16, seed=26)
    q, k, v, g, beta, cu = (d[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens"))
    if fp16:
        cu = cu.long()
    l2 = fp16
    scale, N, H, T = D ** -0.5, len(lens), v.shape[2], q.shape[1]
    gen = torch.Generator(device=DEV).manual_seed(27)
    eye = torch.eye(D, device=DEV).expand(N, H, D, D).contiguous()
    eye += 1e-2 * torch.randn(eye.shape, device=DEV, generator=gen)  # (any initial states: not only the identity)
    xw, gates = fwd_workspace_bytes(1, T, H), fwd_gates_workspace_bytes(1, T, H, cu)
    op = torch.ops.flashqla.chunk_gdn_cp_summaries
    out = {}
    for mode in ("0", "2", "1"):
        monkeypatch.setenv("FLASHQLA_SUMMARY_PAIR", mode)
        ws = torch.full((xw + gates,), 0xFF, dtype=torch.uint8, device=DEV)
        poison = [torch.full((N, H, D, D), float("nan"), device=DEV) for _ in range(2)]
        ptrs = {t.data_ptr() for t in poison}
        del poison  # (the two outputs come from the blocks just freed)
        b_end, phi = op(q, k, v, g, beta, scale, cu, l2, ws, eye)
        torch.cuda.synchronize()
        assert {b_end.data_ptr(), phi.data_ptr()} == ptrs, "allocator did not reuse the poisoned blocks"
        assert torch.isfinite(b_end).all() and torch.isfinite(phi).all()
        out[mode] = (b_end, phi, ws)
    for mode in ("2", "1"):
        assert torch.equal(out[mode][0], out["0"][0]) and torch.equal(out[mode][1], out["0"][1])
    # against plain calls: B from zeros with v, Phi from eye with v = 0
    plain_b = torch.ops.flashqla.chunk_gdn_fwd(q, k, v, g, beta, scale, None, True, cu, l2)[1]
    plain_phi = torch.ops.flashqla.chunk_gdn_fwd(q, k, torch.zeros_like(v), g, beta, scale, eye, True, cu, l2)[1]
    assert torch.equal(out["2"][0], plain_b) and torch.equal(out["2"][1], plain_phi)
    # the last pass on the chunk products the paired launch left (its gates not read there)
    h2 = torch.randn(N, H, D, D, device=DEV, generator=gen)
    o1, s1 = torch.ops.flashqla.chunk_gdn_fwd_pass(q, k, v, g, beta, scale, h2, cu, l2, out["2"][2], True, True,
                                                   False)
    fresh = torch.ops.flashqla.chunk_gdn_fwd(q, k, v, g, beta, scale, h2, True, cu, l2)
    assert torch.equal(o1, fresh[0]) and torch.equal(s1, fresh[1])
    # no room for the gates: the paired launch cannot run
    small = torch.empty((xw,), dtype=torch.uint8, device=DEV)
    monkeypatch.setenv("FLASHQLA_SUMMARY_PAIR", "2")
    with pytest.raises(RuntimeError):
        op(q, k, v, g, beta, scale, cu, l2, small, eye)
    torch.cuda.synchronize()
    monkeypatch.setenv("FLASHQLA_SUMMARY_PAIR", "1")
    b1, p1 = op(q, k, v, g, beta, scale, cu, l2, small, eye)
    assert torch.equal(b1, plain_b) and torch.equal(p1, plain_phi)


# the variants of the prepared chain: FLASHQLA_KSPLIT=1 (K split over warp pairs, the default at few sequences
# x heads: KS^T and QS^T summed as two K halves), FLASHQLA_WGMMA=1 (the products as wgmma on swizzled stages, the
# default elsewhere) and FLASHQLA_WGMMA=2 (wgmma, O formed by a warpgroup beside the chain, three stages), each
# against the plain mma.sync chain and the float64 chunked form: the same products in another order, so close, not
# bitwise; the chunk states of the backward's recompute too (=2 runs them as =1: no O there)
@pytest.mark.parametrize("variant", ["FLASHQLA_KSPLIT=1", "FLASHQLA_WGMMA=1", "FLASHQLA_WGMMA=2"])
@pytest.mark.parametrize("case", ["varlen", "dense_fp16_l2norm_no_h0", "gva4_strong"])
def test_chain_variants_against_float64(monkeypatch, variant, case):
    switch, value = variant.split("=")
    monkeypatch.setenv("FLASHQLA_CP", "0")
    for other in ("FLASHQLA_KSPLIT", "FLASHQLA_WGMMA"):
        monkeypatch.setenv(other, "0")
    kw = {}
    if case == "varlen":   # zero-length sequences, partial chunks, one long sequence
        lens = [0, 65, 1, 700, 0, 130, 2300]
        d = make(lens, 2, 4, seed=31)
    elif case == "dense_fp16_l2norm_no_h0":
        lens = [333] * 3
        d = make([333], 1, 3, dense_B=3, dtype=torch.float16, seed=32)
        d["q"], d["k"], d["initial_state"] = d["q"] * 3, d["k"] * 0.5, None
        kw = {"use_qk_l2norm_in_kernel": True}
    else:
        lens = [1000, 200]
        d = make(lens, 2, 8, strong=True, seed=33)
    n = sum(-(-t // 64) for t in lens)  # chunks: the states' rows that hold a chunk's start
    out, states = {}, {}
    for mode in ("0", "1"):
        monkeypatch.setenv(switch, "0" if mode == "0" else value)
        out[mode] = run_ours(d, **kw)
        args = (d["q"], d["k"], d["v"], d["g"], d["beta"], D ** -0.5, d["initial_state"], d["cu_seqlens"],
                bool(kw))
        states[mode] = torch.ops.flashqla.chunk_gdn_fwd_states(*args)[:n].float()
    x = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}
    ro, rs = chunk_gdn_torch(**x, output_final_state=True, **kw)
    for mode in ("0", "1"):
        o, s = out[mode]
        eo, es = rel_l2(o, ro), rel_l2(s, rs)
        print(f"{case} {switch}={'0' if mode == '0' else value}: o {eo:.2e} final {es:.2e}")
        assert eo < 5e-3 and es < 5e-3
    assert rel_l2(out["1"][0], out["0"][0]) < 2e-3 and rel_l2(out["1"][1], out["0"][1]) < 2e-3
    assert torch.isfinite(states["1"]).all() and rel_l2(states["1"], states["0"]) < 2e-3
    again = run_ours(d, **kw)  # the variant is deterministic (its pipeline orders nothing by timing)
    assert torch.equal(again[0], out["1"][0]) and torch.equal(again[1], out["1"][1])


# the prep beside the chain (one launch whose first CTAs prepare X and W, the chain's loaders waiting for each
# chunk's flag; FLASHQLA_OVERLAP=1 forces it, the default takes it where it gains): the same X, W and chain as the
# separate prep kernel, so bitwise the same outputs; deterministic, and captured in a CUDA graph (the flags are
# zeroed inside the graph on every replay)
@pytest.mark.parametrize("case", ["one_long", "varlen", "gva4_fp16_l2norm", "dense"])
def test_prep_beside_the_chain_matches_the_prep_kernel(monkeypatch, case):
    monkeypatch.setenv("FLASHQLA_CP", "0")
    for name in ("FLASHQLA_WGMMA", "FLASHQLA_KSPLIT"):
        monkeypatch.delenv(name, raising=False)  # the default: O beside the chain, which the overlap needs
    kw = {}
    if case == "one_long":   # 4 chain CTAs, ~128 prep CTAs
        d = make([4000], 1, 2, seed=41)
    elif case == "varlen":   # zero-length sequences, partial chunks, 56 chain CTAs
        d = make([0, 65, 1, 700, 0, 130, 2300], 2, 4, seed=42)
    elif case == "dense":    # 3 x 2 chain CTAs; the workers' chunk-position order over the batch
        d = make([1100], 1, 1, dense_B=3, seed=44)
    else:
        d = make([64, 191, 1500], 2, 8, dtype=torch.float16, seed=43)
        d["q"], d["k"] = d["q"] * 3, d["k"] * 0.5
        kw = {"use_qk_l2norm_in_kernel": True}
    out = {}
    for mode in ("0", "1", None):  # (None: the default, which takes the overlap on some of these)
        if mode is None:
            monkeypatch.delenv("FLASHQLA_OVERLAP")
        else:
            monkeypatch.setenv("FLASHQLA_OVERLAP", mode)
        names = gpu_kernel_names(lambda: out.__setitem__(mode, run_ours(d, **kw)))
        # the workers ran: with the overlap no prep kernel is launched, so X and W came from them
        if mode is not None:
            assert any("gdn_prep_kernel<" in n for n in names) == (mode == "0"), names
    for mode in ("1", None):
        assert torch.equal(out["0"][0], out[mode][0]) and torch.equal(out["0"][1], out[mode][1])
    monkeypatch.setenv("FLASHQLA_OVERLAP", "1")
    again = run_ours(d, **kw)
    assert torch.equal(again[0], out["1"][0]) and torch.equal(again[1], out["1"][1])
    # the workers paced by the chain (FLASHQLA_PREP_AHEAD: a worker waits until the chain has taken the chunk
    # `ahead` chunks back): a schedule only, so the same bits, however tight the pace
    for ahead in ("0", "1", "3"):  # (0: free; the default paces only where X and W outgrow L2, not these cases)
        monkeypatch.setenv("FLASHQLA_PREP_AHEAD", ahead)
        paced = run_ours(d, **kw)
        assert torch.equal(paced[0], out["1"][0]) and torch.equal(paced[1], out["1"][1])
    monkeypatch.delenv("FLASHQLA_PREP_AHEAD")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashqla.chunk_gdn(**d, output_final_state=True, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, gs = flashqla.chunk_gdn(**d, output_final_state=True, **kw)
    for _ in range(2):  # a replay must not see the previous replay's flags
        go.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, out["1"][0]) and torch.equal(gs, out["1"][1])


# A packed batch of one long sequence and short ones (flashqla._cp.overlap_plan, from host-known lengths): the long
# sequence's chains start first beside prep workers, the others' chains take the workers' SMs when the prep is
# done. A schedule only: bitwise the default's outputs, whatever the order and the worker count the op is given
# (few workers: the chains wait longer for their chunks; more workers than SMs: every chain starts after them);
# captured in a CUDA graph after a warm-up call; a malformed schedule is a clear error.
def test_packed_schedule_is_the_default_bitwise(monkeypatch):
    from flashqla import _cp
    from flashqla.api import _sms
    for name in ("FLASHQLA_WGMMA", "FLASHQLA_KSPLIT", "FLASHQLA_OVERLAP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FLASHQLA_CP", "0")  # (8 heads: context parallelism would take this batch; the schedule runs here)
    seqlens, hq, hv = [300, 8000, 0, 100], 2, 8
    d = make(seqlens, hq, hv, seed=51)
    cpu = d["cu_seqlens"].cpu()
    sms = _sms(torch.device(DEV))
    sched = _cp.overlap_plan(seqlens, hv, sms)
    assert sched is not None and sched[0] == (1, 0, 3, 2), sched
    monkeypatch.setenv("FLASHQLA_SEQ_ORDER", "0")
    base = {}
    base_names = gpu_kernel_names(lambda: base.update(enumerate(run_ours(d, cu_seqlens_cpu=cpu))))
    assert any("gdn_prep_kernel<" in n for n in base_names), base_names  # the default: the prep kernel first
    monkeypatch.setenv("FLASHQLA_SEQ_ORDER", "1")
    out = {}
    names = gpu_kernel_names(lambda: out.update(enumerate(run_ours(d, cu_seqlens_cpu=cpu))))
    assert not any("gdn_prep_kernel<" in n for n in names), names  # the workers made X and W
    assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])
    ro, rs = ref64(d)
    assert rel_l2(out[0], ro) <= 4e-3 and rel_l2(out[1], rs) <= 4e-3
    # the op with other schedules: any permutation, any worker count, the same bits
    op = torch.ops.flashqla.chunk_gdn_fwd
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], D ** -0.5, d["initial_state"], True, d["cu_seqlens"], False)
    plain = op(*args)
    assert torch.equal(plain[0], base[0]) and torch.equal(plain[1], base[1])
    for order, workers in (([3, 2, 1, 0], 3), ([1, 0, 3, 2], 1000), ([0, 1, 2, 3], 0), ([2, 3, 1, 0], 5)):
        o, s = op(*args, torch.tensor(order, dtype=torch.int32, device=DEV), workers)
        torch.cuda.synchronize()
        assert torch.equal(o, base[0]) and torch.equal(s, base[1]), (order, workers)
    # CUDA graph: the plan's device order is cached by the warm-up call above
    graph, (go, gs) = captured(lambda: flashqla.chunk_gdn(**d, output_final_state=True, cu_seqlens_cpu=cpu))
    for _ in range(2):
        go.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(go, base[0]) and torch.equal(gs, base[1])
    order = torch.tensor([1, 0, 3, 2], dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="seq_order"):
        op(*args, order.long(), 10)
    with pytest.raises(RuntimeError, match="seq_order"):
        op(*args, order[:3], 10)
    with pytest.raises(RuntimeError, match="prep_workers"):
        op(*args, order, -1)
