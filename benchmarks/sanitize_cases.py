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

# forward kernel: varlen with zero-length sequences and a tail, l2norm, malformed cu_seqlens values
import torch.nn.functional as F  # noqa: E402

T, D = 300, 128
q = F.normalize(torch.randn(1, T, 1, D, device=dev), dim=-1).bfloat16()
k = F.normalize(torch.randn(1, T, 1, D, device=dev), dim=-1).bfloat16()
v = torch.randn(1, T, 2, D, device=dev).bfloat16()
g = F.logsigmoid(torch.randn(1, T, 2, device=dev)) / 16
beta = torch.rand(1, T, 2, device=dev)
for cu in ([0, 0, 65, 65, 200, 260], [0, 900, 20, 300], [-5, 3, 1 << 30]):
    cut = torch.tensor(cu, device=dev, dtype=torch.int32)
    h0 = torch.randn(len(cu) - 1, 2, D, D, device=dev)
    torch.ops.flashqla.chunk_gdn_fwd(q, k, v, g, beta, 0.088, h0, True, cut, True)
    # exact parallelism's passes: summaries only, then a full pass on the chunk products left in the workspace
    ws = torch.empty(T * 2 * 192 * 2, dtype=torch.uint8, device=dev)
    torch.ops.flashqla.chunk_gdn_fwd_pass(q, k, v, g, beta, 0.088, h0, cut, True, ws, False, False, False)
    torch.ops.flashqla.chunk_gdn_fwd_pass(q, k, v, g, beta, 0.088, h0, cut, True, ws, True, False, True)
    torch.ops.flashqla.chunk_gdn_fwd_pass(q, k, v, g, beta, 0.088, h0, cut, True, ws, True, True, False)
torch.cuda.synchronize()
print("forward sanitize cases ran")

# the chain's forms on prepared chunks (mma.sync, wgmma, wgmma with O beside it: its three stages and six empty
# barriers need more than six chunks), on the malformed cu_seqlens values too
import os  # noqa: E402

T2 = 1000
q2, k2 = (F.normalize(torch.randn(1, T2, 1, D, device=dev), dim=-1).bfloat16() for _ in range(2))
v2 = torch.randn(1, T2, 2, D, device=dev).bfloat16()
g2, beta2 = F.logsigmoid(torch.randn(1, T2, 2, device=dev)) / 16, torch.rand(1, T2, 2, device=dev)
for form in ("0", "1", "2", "overlap", "prepwg", "overlapwg", "pair", "pairwalks"):  # (overlap: the default form
    # with the prep beside the chain; prepwg: the default form after the wgmma prep; overlapwg: the wgmma prep beside
    # the chain; pair: the paired chain, FLASHQLA_CHAIN_PAIR=2, on the wgmma prep's output and gates; pairwalks: the
    # same with about three walks a CTA, FLASHQLA_PAIR_PERSIST=2, where the build has it)
    pair = form in ("pair", "pairwalks")
    os.environ["FLASHQLA_WGMMA"] = "2" if form in ("overlap", "prepwg", "overlapwg") or pair else form
    os.environ["FLASHQLA_OVERLAP"] = "1" if form in ("overlap", "overlapwg") else "0"
    os.environ["FLASHQLA_PREP_WG"] = "1" if form in ("prepwg", "overlapwg") or pair else "0"
    os.environ["FLASHQLA_CHAIN_PAIR"] = "2" if pair else "0"
    os.environ["FLASHQLA_PAIR_PERSIST"] = "2" if form == "pairwalks" else "0"
    for cu in ([0, 0, 65, 65, 700, 1000], [0, 900, 20, 300], [-5, 3, 1 << 30]):
        cut = torch.tensor(cu, device=dev, dtype=torch.int32)
        h0 = torch.randn(len(cu) - 1, 2, D, D, device=dev)
        torch.ops.flashqla.chunk_gdn_fwd(q2, k2, v2, g2, beta2, 0.088, h0, True, cut, True)
        torch.cuda.synchronize()
    print("chain form", form, "ran", flush=True)
del os.environ["FLASHQLA_WGMMA"], os.environ["FLASHQLA_OVERLAP"], os.environ["FLASHQLA_PREP_WG"]
del os.environ["FLASHQLA_CHAIN_PAIR"], os.environ["FLASHQLA_PAIR_PERSIST"]
# exact parallelism's two summaries as one launch of the paired kernel (FLASHQLA_SUMMARY_PAIR=2: its producer's
# zeroed V block, no Q and W boxes), then the last pass on the chunk products it left
os.environ["FLASHQLA_SUMMARY_PAIR"] = "2"
for cu in ([0, 0, 65, 65, 700, 1000], [0, 900, 20, 300], [-5, 3, 1 << 30]):
    cut = torch.tensor(cu, device=dev, dtype=torch.int32)
    N = len(cu) - 1
    eye = torch.eye(D, device=dev).expand(N, 2, D, D).contiguous()
    ws = torch.empty(T2 * 2 * 192 * 2 + (T2 // 64 + 1 + N) * 2 * 512, dtype=torch.uint8, device=dev)
    torch.ops.flashqla.chunk_gdn_cp_summaries(q2, k2, v2, g2, beta2, 0.088, cut, True, ws, eye)
    h0 = torch.randn(N, 2, D, D, device=dev)
    torch.ops.flashqla.chunk_gdn_fwd_pass(q2, k2, v2, g2, beta2, 0.088, h0, cut, True, ws, True, True, False)
    torch.cuda.synchronize()
print("summaries pair ran", flush=True)
del os.environ["FLASHQLA_SUMMARY_PAIR"]

# exact parallelism's scan, 8 and 16 columns per CTA (2 and 9 heads), well-formed and malformed `last`
# (non-ascending, past the segments, negative): clamped, never out of bounds
S = 5
for H in (2, 9):
    phi = torch.randn(S, H, D, D, device=dev) / D ** 0.5
    bs = torch.randn(S, H, D, D, device=dev)
    for last in ([1, 4], [4], [3, 1, 9], [-2, 2]):
        lt = torch.tensor(last, device=dev)
        torch.ops.flashqla.chunk_gdn_cp_scan(phi, bs, torch.randn(len(last), H, D, D, device=dev), lt)
        torch.ops.flashqla.chunk_gdn_cp_scan(phi, bs, None, lt)
        torch.cuda.synchronize()
        print("cp scan ran", H, last, flush=True)

# backward: the reverse state-gradient chain (prep + recurrent kernels) and the forward's chunk states, on the
# same inputs and malformed cu_seqlens values
do = torch.randn(1, T, 2, D, device=dev).bfloat16()
for cu in ([0, 0, 65, 65, 200, 260], [0, 900, 20, 300], [-5, 3, 1 << 30]):
    cut = torch.tensor(cu, device=dev, dtype=torch.int32)
    dht = torch.randn(len(cu) - 1, 2, D, D, device=dev)
    # a sync and a line after each op: a fault names its op in the report
    dh, _, a = torch.ops.flashqla.chunk_gdn_bwd_dh(q, k, g, beta, do, dht, 0.088, cut, True, True, True)
    torch.cuda.synchronize()
    print("bwd_dh ran", cu, flush=True)
    states = torch.ops.flashqla.chunk_gdn_fwd_states(q, k, v, g, beta, 0.088, None, cut, True)
    torch.cuda.synchronize()
    print("fwd_states ran", cu, flush=True)
    # both chains from one prep (the recompute's X written by the backward's prep, the chains on two streams)
    torch.ops.flashqla.chunk_gdn_bwd_chains(q, k, v, g, beta, do, dht, 0.088, None, cut, True, True, True)
    torch.cuda.synchronize()
    print("bwd_chains ran", cu, flush=True)
    torch.ops.flashqla.chunk_gdn_bwd_grad(q, k, v, g, beta, do, states, dh, 0.088, cut, True)
    torch.cuda.synchronize()
    print("bwd_grad ran", cu, flush=True)
    torch.ops.flashqla.chunk_gdn_bwd_grad(q, k, v, g, beta, do, states, dh, 0.088, cut, True, a)
    torch.cuda.synchronize()
    print("bwd_grad with the inverse rows ran", cu, flush=True)
    # (without the l2norm: dq and dk leave in q's dtype, their 16-bit TMA boxes where the build stores by TMA)
    torch.ops.flashqla.chunk_gdn_bwd_grad(q, k, v, g, beta, do, states, dh, 0.088, cut, False)
    torch.cuda.synchronize()
    print("bwd_grad with 16-bit dq, dk ran", cu, flush=True)
torch.cuda.synchronize()
print("backward sanitize cases ran")

# the backward's wgmma chains (at this size the rule picks the K split), whose chunk states and dS' leave by TMA
# stores, on the same malformed cu_seqlens values
os.environ["FLASHQLA_WGMMA"] = "1"
for cu in ([0, 0, 65, 65, 200, 260], [0, 900, 20, 300], [-5, 3, 1 << 30]):
    cut = torch.tensor(cu, device=dev, dtype=torch.int32)
    dht = torch.randn(len(cu) - 1, 2, D, D, device=dev)
    torch.ops.flashqla.chunk_gdn_bwd_chains(q, k, v, g, beta, do, dht, 0.088, None, cut, True, True, True)
    torch.cuda.synchronize()
    print("bwd_chains (wgmma) ran", cu, flush=True)
del os.environ["FLASHQLA_WGMMA"]
print("wgmma chains sanitize cases ran")

# exact parallelism's backward chains through segments with both merges (the last dS pass against the B pass, the
# states pass against the summaries' B half: their stops and the loaders' exits), under strong decay so that the
# walks merge; one sequence cut into 8-chunk segments, and packed sequences with a zero-length one
from flashqla import _cp  # noqa: E402

_cp.MIN_SEGMENT_CHUNKS = 4
os.environ["FLASHQLA_KSPLIT"] = "0"  # (the merging forms: the wgmma chains; at 2 heads the rule would split K)
for lengths in ([4096], [3000, 0, 1100, 70]):
    Tm = sum(lengths)
    qm = F.normalize(torch.randn(1, Tm, 1, D, device=dev), dim=-1).bfloat16()
    km = F.normalize(torch.randn(1, Tm, 1, D, device=dev), dim=-1).bfloat16()
    vm = torch.randn(1, Tm, 2, D, device=dev).bfloat16()
    gm = -5 * torch.rand(1, Tm, 2, device=dev)
    bm = torch.rand(1, Tm, 2, device=dev)
    dom = torch.randn(1, Tm, 2, D, device=dev).bfloat16()
    plan = _cp.plan(lengths, 2, 132)
    _cp.backward_chains(torch.ops.flashqla, qm, km, vm, gm, bm, dom, torch.randn(len(lengths), 2, D, D, device=dev),
                        0.088, None, plan, False, True, True)
    torch.cuda.synchronize()
    print("segmented bwd chains with merges ran", lengths, plan.segments, flush=True)
del os.environ["FLASHQLA_KSPLIT"]

# exact parallelism's forward with the merge (FLASHQLA_CP_MERGE=1): the summaries' B pass writing O, the last pass's
# checkpoints and stop (the wgmma chain's form, and with FLASHQLA_CP_MERGE_OB=1 O beside the chain, its O warps and
# loaders ending at the stop), under strong decay with head 1 at g = 0 (never merges); one sequence and packed ones with a
# zero-length one
os.environ["FLASHQLA_CP_MERGE"] = "1"
for ob, lengths in (("1", [8192]), ("1", [6000, 0, 1100]), ("0", [8192]), ("0", [6000, 0, 1100])):
    os.environ["FLASHQLA_CP_MERGE_OB"] = ob
    Tm = sum(lengths)
    cm = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    qm = F.normalize(torch.randn(1, Tm, 1, D, device=dev), dim=-1).bfloat16()
    km = F.normalize(torch.randn(1, Tm, 1, D, device=dev), dim=-1).bfloat16()
    vm = torch.randn(1, Tm, 2, D, device=dev).bfloat16()
    gm = -5 * torch.rand(1, Tm, 2, device=dev)
    gm[..., 1] = 0.0
    bm = torch.rand(1, Tm, 2, device=dev)
    flashqla.chunk_gdn(qm, km, vm, gm, bm, initial_state=torch.randn(len(lengths), 2, D, D, device=dev),
                       output_final_state=True, cu_seqlens=cm.to(dev), cu_seqlens_cpu=cm)
    torch.cuda.synchronize()
    print("segmented forward with the merge ran", "O beside" if ob == "1" else "wgmma", lengths,
          _cp.plan(lengths, 2, 132).segments, flush=True)
del os.environ["FLASHQLA_CP_MERGE"], os.environ["FLASHQLA_CP_MERGE_OB"]
