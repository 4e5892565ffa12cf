"""Exact context parallelism (flashqla._cp): plans, and the segmented forward against the plain one in
float64 on the CPU (through the chunk_gdn_fwd op's reference implementation)."""
import pytest
import torch

import flashqla
from flashqla import _backend, _cp, reference
from conftest import count_calls
from util import make_inputs


def test_plan_only_where_segments_help():
    assert _cp.plan([32768], 64, 132) is None          # 128 CTAs already fill the GPU
    assert _cp.plan([2048], 8, 132) is None            # too short to cut
    p = _cp.plan([32768], 8, 132)                      # TP8 1 x 32768: 16 CTAs
    assert p is not None and p.segments > 1 and p.cu[0] == 0 and p.cu[-1] == 32768
    assert all((b - a) % 64 == 0 for a, b in zip(p.cu[:-2], p.cu[1:-1]))   # segments start on chunks


def test_plan_covers_every_sequence_in_order(monkeypatch):
    monkeypatch.setattr(_cp, "RANK_STEP", 0.0)  # a plan for these lengths, whatever the scan costs
    lengths = [28672, 0, 4096, 130]
    p = _cp.plan(lengths, 8, 132)
    assert p is not None and p.cu[-1] == sum(lengths)
    assert list(p.cu) == sorted(p.cu)
    starts = [0, 28672, 28672, 32768]
    for s, n in enumerate(lengths):
        segs = [i for i in range(p.segments) if p.seq_of[i] == s]
        assert segs and p.cu[segs[0]] == starts[s] and p.cu[segs[-1] + 1] == starts[s] + n
        assert [p.rank_of[i] for i in segs] == list(range(len(segs))) and p.last_of_seq[s] == segs[-1]


def _op(q, k, v, g, beta, scale, h0, ofs, cu, l2):
    return torch.ops.flashqla.chunk_gdn_fwd(q, k, v, g, beta, scale, h0, ofs, cu, l2)


@pytest.mark.parametrize("lengths", [[700, 0, 333, 64], [1000]])  # one sequence: the gathers are skipped
@pytest.mark.parametrize("l2norm", [False, True])
def test_segmented_forward_equals_plain_float64(monkeypatch, l2norm, lengths):
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(_cp, "RANK_STEP", 0.0)  # tiny cases: plan as if the scan were free
    d = make_inputs(1, sum(lengths) + 10, 1, 2, 16, 16, n_seqs=len(lengths), seed=3)   # and a tail
    d["cu_seqlens"] = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
    p = _cp.plan(lengths, 2, 64)
    assert p is not None and p.segments > len(lengths)
    o, final = _cp.forward(_op, d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25, d["initial_state"], p, l2norm,
                           index_dtype=torch.int64)
    ro, rf = reference.chunk_gdn_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=0.25,
                                       initial_state=d["initial_state"], output_final_state=True,
                                       cu_seqlens=d["cu_seqlens"], use_qk_l2norm_in_kernel=l2norm)
    assert (o - ro).abs().max() < 1e-10 and (final - rf).abs().max() < 1e-10


def test_api_takes_the_segmented_path(monkeypatch):
    # the kernel path with FLASHQLA_CP=1 on host-known lengths, run on the CPU through the op's reference
    monkeypatch.setenv("FLASHQLA_CP", "1")
    monkeypatch.setattr(_backend, "kernels_available", lambda dev: True)
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(_cp, "RANK_STEP", 0.0)  # tiny cases: plan as if the scan were free
    monkeypatch.setattr(flashqla.api, "KERNEL_HEAD_DIM", 16)
    monkeypatch.setattr(flashqla.api, "_why_not_kernel", lambda shape, q, g: None)
    calls = count_calls(monkeypatch, _cp, "forward")
    d = make_inputs(1, 640, 1, 1, 16, 16, h0=True, seed=4)
    o, final = flashqla.chunk_gdn(**d, output_final_state=True)
    ro, rf = reference.chunk_gdn_torch(**d, output_final_state=True)
    assert calls and (o - ro).abs().max() < 1e-10 and (final - rf).abs().max() < 1e-10


def test_caches_keep_what_a_graph_captured(monkeypatch):
    # a captured CUDA graph keeps reading the plan tensors and constants it used: evicting them would hand
    # their memory to other tensors under the graph's replays. Capture is simulated (a CPU device).
    monkeypatch.setattr(_cp, "_DEVICE_PLANS", {})
    monkeypatch.setattr(_cp, "_CONSTANTS", {})
    monkeypatch.setattr(_cp, "_PINNED", set())
    dev = torch.device("cpu")
    p0 = _cp.plan([32768], 8, 132)
    first = _cp.device_plan(p0, dev)
    eye = _cp._cached(("eye", 1), lambda: torch.eye(4), dev)
    monkeypatch.setattr(_cp, "_capturing", lambda device: True)
    assert _cp.device_plan(p0, dev) is first                                  # served from the cache, pinned
    assert _cp._cached(("eye", 1), lambda: torch.zeros(4), dev) is eye
    assert _cp.device_plan(_cp.plan([32768 + 64], 8, 132), dev) is None      # nothing is made under capture
    made = _cp._cached(("eye", 2), lambda: torch.eye(4), dev)
    assert ("eye", 2) not in _cp._CONSTANTS and made.shape == (4, 4)       # made for the graph, not kept
    monkeypatch.setattr(_cp, "_capturing", lambda device: False)
    for n in range(70):                                                       # past both caches' limits
        assert _cp.device_plan(_cp.plan([20000 + 64 * n], 8, 132), dev) is not None
        _cp._cached(("eye", 10 + n), lambda: torch.eye(2), dev)
    assert _cp.device_plan(p0, dev) is first and _cp._cached(("eye", 1), lambda: None, dev) is eye
    assert len(_cp._DEVICE_PLANS) <= 64 and len(_cp._CONSTANTS) <= 8


@pytest.mark.parametrize("lengths", [[700, 0, 333, 64], [1000]])
@pytest.mark.parametrize("l2norm", [False, True])
def test_segmented_backward_chains_equal_plain_float64(monkeypatch, l2norm, lengths):
    # the backward's two chains through segments (FLASHQLA_BWD_CP=1) against the unsegmented ops, through the
    # ops' reference implementations in float64: the chunk-start states, the chunk-end state gradients (the
    # same chunks in the same order), dh0 and the inverse rows
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(_cp, "RANK_STEP", 0.0)
    d = make_inputs(1, sum(lengths) + 10, 1, 2, 16, 16, n_seqs=len(lengths), seed=5)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
    gen = torch.Generator().manual_seed(6)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(len(lengths), 2, 16, 16, generator=gen, dtype=torch.float64) / 8
    p = _cp.plan(lengths, 2, 64)
    assert p is not None and p.segments > len(lengths)
    ops = torch.ops.flashqla
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"])
    for h0, dh_t in ((d["initial_state"], dht), (None, None)):
        states, dh, dh0, a = _cp.backward_chains(ops, *args, do, dh_t, 0.25, h0, p, l2norm, True, True,
                                                 index_dtype=torch.int64)
        rs = ops.chunk_gdn_fwd_states(*args, 0.25, h0, cu, l2norm)
        rdh, rdh0, ra = ops.chunk_gdn_bwd_dh(d["q"], d["k"], d["g"], d["beta"], do, dh_t, 0.25, cu, l2norm, True, True)
        n = rs.shape[0]   # chunk slots of the plain call; the segmented buffers hold at least as many
        valid = sum(-(-x // 64) for x in lengths)
        assert states.shape[0] >= n and dh.shape[0] >= rdh.shape[0]
        assert (states[:valid] - rs[:valid]).abs().max() < 1e-10
        assert (dh[:valid] - rdh[:valid]).abs().max() < 1e-10
        assert (dh0 - rdh0).abs().max() < 1e-10 and torch.equal(a, ra)


def test_api_backward_takes_the_segmented_chains(monkeypatch):
    # chunk_gdn_bwd with FLASHQLA_BWD_CP=1 on host-known lengths goes through backward_chains; run on the CPU
    # through the ops' reference implementations, its gradients equal the reference backward's
    monkeypatch.setenv("FLASHQLA_BWD_CP", "1")
    monkeypatch.setattr(_backend, "kernels_available", lambda dev: True)
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(_cp, "RANK_STEP", 0.0)
    monkeypatch.setattr(flashqla.api, "KERNEL_HEAD_DIM", 16)
    monkeypatch.setattr(flashqla.api, "_why_not_kernel", lambda shape, q, g: None)
    calls = count_calls(monkeypatch, _cp, "backward_chains")
    d = make_inputs(1, 700, 1, 2, 16, 16, h0=True, n_seqs=2, seed=7)
    cu = torch.tensor([0, 500, 700])
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(2, 2, 16, 16, generator=gen, dtype=torch.float64) / 8
    # the kernel path hands h0 and dht to the ops in fp32: values fp32 holds exactly keep the comparison exact
    d["initial_state"], dht = d["initial_state"].float().double(), dht.float().double()
    got = flashqla.chunk_gdn_bwd(d["q"], d["k"], d["v"], d["g"], d["beta"], do, dht,
                                 initial_state=d["initial_state"], cu_seqlens=cu, cu_seqlens_cpu=cu)
    ref = reference.chunk_gdn_bwd_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], do, dht,
                                        initial_state=d["initial_state"], cu_seqlens=cu)
    assert calls
    for a, b in zip(got, ref):
        assert (a - b).abs().max() < 1e-10


@pytest.mark.skipif(not flashqla.extension_loaded(), reason="CUDA extension not built")
@pytest.mark.parametrize("lengths", [[700, 0, 333, 64], [1000]])
def test_cp_op_equals_the_python_steps(monkeypatch, lengths):
    # chunk_gdn_cp_fwd (csrc/torch/cp.cpp: the passes and the scan issued from C++, through the dispatcher, here
    # to the pass op's CPU reference) against the same steps in Python (FLASHQLA_CP_CPP=0): bitwise equal, and
    # equal to the plain chunked forward in float64
    monkeypatch.setattr(_cp, "MIN_SEGMENT_CHUNKS", 1)
    monkeypatch.setattr(_cp, "RANK_STEP", 0.0)
    d = make_inputs(1, sum(lengths) + 10, 1, 2, 16, 16, n_seqs=len(lengths), seed=9)
    cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
    p = _cp.plan(lengths, 2, 64)
    args = (_op, d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25, d["initial_state"], p, True)
    kw = dict(index_dtype=torch.int64, fwd_pass=torch.ops.flashqla.chunk_gdn_fwd_pass)
    assert _cp._cp_op() is not None
    calls = []
    real = torch.ops.flashqla.chunk_gdn_cp_fwd
    monkeypatch.setattr(_cp, "_cp_op", lambda: (lambda *a: calls.append(a) or real(*a)))
    o, final = _cp.forward(*args, **kw)
    monkeypatch.setattr(_cp, "_cp_op", lambda: None)   # the Python steps
    po, pfinal = _cp.forward(*args, **kw)
    assert calls and torch.equal(o, po) and torch.equal(final, pfinal)
    res = torch.library.opcheck(real.default, calls[0], test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in res.values()), res
    ro, rf = reference.chunk_gdn_torch(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=0.25,
                                       initial_state=d["initial_state"], output_final_state=True, cu_seqlens=cu,
                                       use_qk_l2norm_in_kernel=True)
    assert (o - ro).abs().max() < 1e-10 and (final - rf).abs().max() < 1e-10


def _scan_inputs(seg_counts, H=2, K=8, seed=10, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    S = sum(seg_counts)
    phi = (torch.randn(S, H, K, K, generator=gen, dtype=dtype) / K ** 0.5).to(device)
    b = torch.randn(S, H, K, K, generator=gen, dtype=dtype).to(device)
    h0 = torch.randn(len(seg_counts), H, K, K, generator=gen, dtype=dtype).to(device)
    last = (torch.tensor(seg_counts).cumsum(0) - 1).to(device)
    return phi, b, h0, last


def _scan_by_hand(phi, b, h0, seg_counts):
    out, i = [], 0
    for s, n in enumerate(seg_counts):
        state = h0[s] if h0 is not None else torch.zeros_like(b[0])
        for r in range(n):
            out.append(state)
            state = phi[i] @ state + b[i]
            i += 1
    return torch.stack(out)


@pytest.mark.parametrize("h0", [True, False])
def test_cp_scan_op_walks_each_sequence(h0):
    # chunk_gdn_cp_scan's CPU implementation: init[first] = h0 (or zeros), init[i + 1] = Phi_i init[i] + B_i
    # along each sequence's own segments, never across sequences (one-segment sequences take h0 unchanged)
    counts = [3, 1, 4, 2]
    phi, b, h, last = _scan_inputs(counts)
    h = h if h0 else None
    got = torch.ops.flashqla.chunk_gdn_cp_scan(phi, b, h, last)
    assert (got - _scan_by_hand(phi, b, h, counts)).abs().max() < 1e-12
    res = torch.library.opcheck(torch.ops.flashqla.chunk_gdn_cp_scan.default, (phi, b, h, last),
                                test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in res.values()), res


@pytest.mark.parametrize("h0", [True, False])
def test_cp_scan_op_reverse_walks_each_sequence_back(h0):
    # reverse=True, the backward's end gradients: out[last] = h0 (or zeros), out[i - 1] = Phi_i^T out[i] + B_i along
    # each sequence's segments from its last one back; the same as the forward walk over each sequence's segments
    # in reversed order with Phi transposed (what the op ran before the kernel had a reverse walk)
    counts = [3, 1, 4, 2]
    phi, b, h, last = _scan_inputs(counts)
    h = h if h0 else None
    rev = torch.cat([torch.arange(e, e - n, -1) for n, e in zip(counts, last.tolist())])
    got = torch.ops.flashqla.chunk_gdn_cp_scan(phi, b, h, last, True)
    flipped = torch.ops.flashqla.chunk_gdn_cp_scan(phi.transpose(2, 3)[rev], b[rev], h, last)[rev]
    assert (got - flipped).abs().max() < 1e-12
    # by hand, the last sequence: out[9] = h0[3], out[8] = Phi_9^T h0[3] + B_9
    top = h[3] if h0 else torch.zeros_like(b[9])
    assert (got[9] - top).abs().max() == 0
    assert (got[8] - (phi[9].transpose(1, 2) @ top + b[9])).abs().max() < 1e-12
    res = torch.library.opcheck(torch.ops.flashqla.chunk_gdn_cp_scan.default, (phi, b, h, last, True),
                                test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_overlap_plan_only_for_one_long_sequence_and_short_ones(monkeypatch):
    monkeypatch.delenv("FLASHQLA_SEQ_ORDER", raising=False)
    # TP2 28672+4096: the long sequence's 64 chain CTAs first, 68 prep workers, the short one's chains after them
    assert _cp.overlap_plan([28672, 4096], 32, 132) == ((0, 1), 68)
    assert _cp.overlap_plan([4096, 28672], 32, 132) == ((1, 0), 68)          # longest first, whatever the packing
    assert _cp.overlap_plan([300, 8000, 0, 100], 8, 132) == ((1, 0, 3, 2), 116)  # ties and empty ones in order
    assert _cp.overlap_plan([8192] * 4, 32, 132) is None     # equal sequences: the prep kernel, then the chains
    assert _cp.overlap_plan([28672, 4096], 64, 132) is None  # 128 chain CTAs for the long one: no room for workers
    assert _cp.overlap_plan([28672, 16384], 32, 132) is None  # the second one is more than half as long
    assert _cp.overlap_plan([8000, 100, 100, 100], 32, 132) is None  # three short ones do not fit on 68 SMs
    assert _cp.overlap_plan([2000, 300], 32, 132) == ((0, 1), 68)
    assert _cp.overlap_plan([600, 64], 32, 132) is None      # too little prep for two waves of the workers
    assert _cp.overlap_plan([32768], 32, 132) is None        # one sequence: the kernel's own rule
    monkeypatch.setenv("FLASHQLA_SEQ_ORDER", "0")
    assert _cp.overlap_plan([28672, 4096], 32, 132) is None


def test_backward_plan_only_where_the_plain_chains_leave_half_the_sms(monkeypatch):
    # unset: segments for one 32k sequence at 4 or 8 value heads (the plain chains' 32 / 64 K-split CTAs leave
    # half of 132 SMs idle); where the plain chains fill the GPU once (128 CTAs: 16 heads, or two sequences of 8),
    # only over 128-chunk segments (32k at 16 heads, 2 x 32k at 8), not 32-chunk ones (8k at 16 heads); none at 32
    # heads (256 CTAs); FLASHQLA_BWD_CP=1 cuts wherever the forward's planner does, 0 (or FLASHQLA_CP=0) never
    monkeypatch.delenv("FLASHQLA_BWD_CP", raising=False)
    assert _cp.backward_plan([32768], 4, 132) is not None and _cp.backward_plan([32768], 8, 132) is not None
    assert _cp.backward_plan([32768], 16, 132) is not None and _cp.backward_plan([32768, 32768], 8, 132) is not None
    assert _cp.backward_plan([32768], 16, 132).segment_chunks == 128
    assert _cp.backward_plan([8192], 16, 132) is None and _cp.plan([8192], 16, 132) is not None
    assert _cp.backward_plan([32768, 32768, 32768, 32768], 8, 132) is None
    assert _cp.plan([32768], 16, 132) is not None
    monkeypatch.setenv("FLASHQLA_BWD_CP", "1")
    assert _cp.backward_plan([32768], 16, 132) == _cp.plan([32768], 16, 132)
    monkeypatch.setenv("FLASHQLA_BWD_CP", "0")
    assert _cp.backward_plan([32768], 4, 132) is None
    monkeypatch.delenv("FLASHQLA_BWD_CP")
    monkeypatch.setenv("FLASHQLA_CP", "0")
    assert _cp.backward_plan([32768], 4, 132) is None


def test_backward_segment_length_knob(monkeypatch):
    # FLASHQLA_BWD_CP_SEGMENT_CHUNKS (measurements): segments of that many chunks instead of the planner's, also where
    # the planner does not cut (many heads), unless no sequence is longer than one segment; the cuts cover each
    # sequence and start on chunk boundaries; a bad value is a clear error
    monkeypatch.delenv("FLASHQLA_BWD_CP", raising=False)
    lengths = [32768, 5000]
    base = _cp.backward_plan(lengths, 4, 132)
    assert base is not None
    for seg in (16, 64, 256):
        monkeypatch.setenv("FLASHQLA_BWD_CP_SEGMENT_CHUNKS", str(seg))
        p = _cp.backward_plan(lengths, 4, 132)
        assert p.segment_chunks == seg and p.cu[-1] == sum(lengths)
        assert p.segments == -(-512 // seg) + -(-79 // seg)
        assert all(b % 64 == 0 for b in p.cu[1:p.last_of_seq[0] + 1])
        assert p.cu[p.last_of_seq[0] + 1] == 32768
    assert _cp.plan([32768], 64, 132) is None  # (the planner does not cut at 64 heads; the knob does)
    p = _cp.backward_plan([32768], 64, 132)
    assert p.segment_chunks == 256 and p.segments == 2 and p.cu == (0, 16384, 32768)
    assert _cp.backward_plan([256 * 64, 100], 64, 132) is None  # no sequence longer than a segment
    monkeypatch.setenv("FLASHQLA_BWD_CP_SEGMENT_CHUNKS", "48")
    with pytest.raises(ValueError, match="power of two"):
        _cp.backward_plan(lengths, 4, 132)


def test_merge_handover_model_finds_no_hang():
    # benchmarks/handover_model.py: the merging dS chain's exit (csrc/flashqla/gdn_bwd_dh.cuh) under random schedules
    # of a named-barrier model never hangs; the first exit (arrive at once) does, so the model can tell
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "handover_model.py"
    spec = importlib.util.spec_from_file_location("handover_model", path)
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    cases = [(n, m, seed) for n in range(10) for m in [None] + list(range(n)) for seed in range(100)]
    assert all(model.walk(n, m, 2, seed, naive=False) == "ok" for n, m, seed in cases)
    assert any(model.walk(n, m, 2, seed, naive=True) != "ok" for n, m, seed in cases)
