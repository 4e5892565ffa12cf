"""The chunk-local cumsum kernel on an sm_90 GPU against the float64 reference."""
import pytest
import torch

import flashqla
from flashqla.reference import chunk_local_cumsum_torch
from conftest import gpu, rel_l2

pytestmark = gpu
DEV = "cuda"


def poisoned_call(g, *args, **kw):
    """Fill the block the op will allocate with NaN first, so an unwritten element shows."""
    nbytes_like = torch.empty(g.shape, dtype=torch.float32, device=DEV)
    ptr = nbytes_like.data_ptr()
    nbytes_like.fill_(float("nan"))
    del nbytes_like
    out = flashqla.chunk_local_cumsum(g, *args, **kw)
    assert out.data_ptr() == ptr, "allocator did not reuse the poisoned block"
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("C", [16, 32, 64, 128])
def test_dense(dtype, reverse, C):
    g = (torch.nn.functional.logsigmoid(torch.randn(3, 517, 7, device=DEV)) / 4).to(dtype)
    out = poisoned_call(g, chunk_size=C, reverse=reverse, scale=1.4426950408889634)
    ref = chunk_local_cumsum_torch(g.double(), C, reverse, 1.4426950408889634)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_l2(out, ref) < 1e-6


@pytest.mark.parametrize("idx", [torch.int32, torch.int64])
@pytest.mark.parametrize("reverse", [False, True])
def test_varlen_boundaries(idx, reverse):
    lens = [0, 1, 63, 64, 65, 0, 200, 128, 7]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=idx, device=DEV)
    T = int(cu[-1]) + 37  # tail past cu[-1] must be zero
    g = torch.randn(1, T, 33, device=DEV)
    out = poisoned_call(g, reverse=reverse, cu_seqlens=cu)
    ref = chunk_local_cumsum_torch(g.double(), 64, reverse, None, cu)
    assert torch.isfinite(out).all()
    assert rel_l2(out, ref) < 1e-6
    assert torch.all(out[:, int(cu[-1]):] == 0)
    # first element of every chunk (forward) is g itself: chunks restart at sequence starts
    if not reverse:
        starts = [s + j for s, n in zip(cu[:-1].tolist(), lens) for j in range(0, n, 64)]
        assert torch.equal(out[0, starts], g[0, starts])


def test_strided_input_no_copy():
    base = torch.randn(2, 300, 16, device=DEV)
    g = base[:, :, ::2]  # non-contiguous head stride
    assert not g.is_contiguous()
    out = poisoned_call(g)
    assert rel_l2(out, chunk_local_cumsum_torch(g.double())) < 1e-6


def test_long_sequence_many_heads():
    g = torch.nn.functional.logsigmoid(torch.randn(1, 32768 * 3, 64, device=DEV)) / 16
    cu = torch.tensor([0, 32768, 65536, 98304], dtype=torch.int32, device=DEV)
    out = poisoned_call(g, cu_seqlens=cu)
    assert rel_l2(out, chunk_local_cumsum_torch(g.double(), 64, False, None, cu)) < 1e-6


def test_bad_cu_seqlens_values_stay_in_bounds(monkeypatch):
    # values are not checked on the hot path: the kernel must clamp, never fault
    monkeypatch.delenv("FLASHQLA_DEBUG", raising=False)
    g = torch.randn(1, 100, 4, device=DEV)
    for cu in ([0, 500, 50, 100], [-7, 30, 1 << 30], [5, 3, 1, 0]):
        out = torch.ops.flashqla.chunk_local_cumsum(g, 64, False, 1.0, torch.tensor(cu, device=DEV))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()


def test_debug_switch_checks_values(monkeypatch):
    monkeypatch.setenv("FLASHQLA_DEBUG", "1")
    with pytest.raises(ValueError, match="non-decreasing"):
        flashqla.chunk_local_cumsum(torch.randn(1, 100, 4, device=DEV), cu_seqlens=torch.tensor([0, 50, 40], device=DEV))


def test_deterministic_and_graph_capturable():
    g = torch.randn(1, 5000, 32, device=DEV)
    cu = torch.tensor([0, 1000, 4321, 5000], device=DEV)
    a = flashqla.chunk_local_cumsum(g, cu_seqlens=cu)
    b = flashqla.chunk_local_cumsum(g, cu_seqlens=cu)
    assert torch.equal(a, b)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flashqla.chunk_local_cumsum(g, cu_seqlens=cu)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashqla.chunk_local_cumsum(g, cu_seqlens=cu)
    g.copy_(torch.randn_like(g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, flashqla.chunk_local_cumsum(g, cu_seqlens=cu))
