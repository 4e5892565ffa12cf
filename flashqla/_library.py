"""Schemas of the flashqla custom ops, their fake (meta) implementations for
torch.compile / FakeTensor, and CPU implementations from the reference.

The CUDA implementations are registered by flashqla._C (csrc/torch/ops.cpp)."""
import torch

from . import reference

_lib = torch.library.Library("flashqla", "DEF")
_lib.define("chunk_local_cumsum(Tensor g, int chunk_size, bool reverse, float scale, Tensor? cu_seqlens) -> Tensor")


@torch.library.register_fake("flashqla::chunk_local_cumsum")
def _chunk_local_cumsum_fake(g, chunk_size, reverse, scale, cu_seqlens):
    return g.new_empty(g.shape, dtype=torch.float32)


@torch.library.impl("flashqla::chunk_local_cumsum", "cpu")
def _chunk_local_cumsum_cpu(g, chunk_size, reverse, scale, cu_seqlens):
    out = reference.chunk_local_cumsum_torch(g, chunk_size, reverse, scale, cu_seqlens)
    return out.float()
