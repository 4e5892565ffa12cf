"""Small kernel calls for compute-sanitizer (memcheck, racecheck): dense, varlen
with zero-length sequences and a tail, reverse, and malformed cu_seqlens values
that the kernel must clamp without touching memory out of bounds."""
import torch

import flashqla

dev = "cuda"
g = torch.randn(2, 150, 6, device=dev)
flashqla.chunk_local_cumsum(g)
flashqla.chunk_local_cumsum(g.bfloat16(), reverse=True, chunk_size=32)
gv = torch.randn(1, 300, 6, device=dev)
for cu in ([0, 0, 65, 65, 200, 260], [0, 900, 20, 300], [-5, 3, 1 << 30]):
    for rev in (False, True):
        torch.ops.flashqla.chunk_local_cumsum(gv, 64, rev, 1.0, torch.tensor(cu, device=dev))
        torch.ops.flashqla.chunk_local_cumsum(gv, 64, rev, 1.0, torch.tensor(cu, device=dev, dtype=torch.int32))
torch.cuda.synchronize()
print("sanitize cases ran")
