"""Exact context parallelism for the forward on one GPU (gdn-algorithm.md section 3).

When sequences x value heads cannot fill the GPU (a few long sequences, few
heads per GPU under tensor parallelism), each long sequence is cut into
segments that run as separate sequences of one kernel call. Per segment the
chunk recurrence is affine, S_end = Phi S_start + B, so:

1. B   = the segment's final state from a zero initial state (the real v);
   Phi = the segment's final state from the identity with v = 0 (K = V);
2. a short scan over each sequence's segments gives every segment its true
   initial state (S_{p+1} = Phi_p S_p + B_p, starting from the sequence's h0);
3. one more call from those initial states gives o and the final states.

No truncation: the result is the same algebra as the unsegmented chain (the
kernel's rounding of S differs only in where the chain restarts). It costs
three passes of the state chain; on the kernels the first two are summaries
only (no o) and run as one launch (about one chunk step for both), and all
three share one computation of the chunk products (the prep kernel runs once). It only runs where the
plan predicts a gain. Planning reads host-known sequence lengths only (dense shapes or
cu_seqlens_cpu): no device sync. The device copies of the plan are cached per
plan, so a warm-up call before CUDA-graph capture makes capture work; during
capture an uncached plan falls back to the unsegmented call.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

CHUNK = 64
MIN_SEGMENT_CHUNKS = 8
V_BLOCKS = 2          # CTAs per (sequence, value head) in the forward kernel
GAIN = 0.75           # run CP when its predicted time is below this fraction of the plain call's
# Measured on the H200 (benchmarks/kernel_times.py --launches, TP8/TP4 1 x 32768): a full chunk step ~2.5 us,
# a summaries-only one (no Q S^T, no O) 0.7 of it. The scan: ~25 us per rank as eight small kernels (session
# 4); as one batched GEMM per rank 5.3 us of kernel time (session 5, TP8 1 x 32768: 0.037 ms for 7 ranks),
# ~6-7 us with the launch gap in a graph: ~3 chunk steps (unmeasured as a plan input: with it the TP8/TP4
# 1 x 8192 rows and TP4 28672+4096 get plans, which the next H200 run must confirm against FLASHQLA_CP=0).
# Since session 8 the scan is one kernel for all ranks (chunk_gdn_cp_scan): measured ~3.7 us per rank plus ~7 us
# per launch (TP8/TP4 1 x 8192), i.e. still ~1.5 chunk steps per rank, and with a lower constant (1) the 1 x 2048
# rows get plans that measured no better (TP8 0.094 -> 0.091 ms, TP4 0.107 -> 0.113): the constant stays.
# FLASHQLA_CP_RANK_STEP overrides it for such A/Bs.
# Since session 28 the two summaries passes run as one launch (chunk_gdn_cp_summaries: the B and transition chains
# as the two halves of the paired kernel): TP8 1 x 32768 112 us against the last pass's 104 us over 64 chunks, i.e.
# both summaries together ~1.07 full chunk steps (they were 2 x 0.7, and are again under FLASHQLA_SUMMARY_PAIR=0 or
# where the paired launch cannot run). No anchor row's plan changes with it.
# Since session 29 the scan brings Phi by TMA: at TP8 1 x 8192 its phase table went 22.8 -> 16.5 us for 7 ranks
# (~2.4 us a rank, ~1 chunk step). Measured again in session 30 (`h200-ab-20261202T1910Z-ee63332-rankstep*.json`):
# =1 or 1.5 plan the 1 x 2048 rows as four 8-chunk segments, TP8 0.0591 -> 0.0559 ms but TP4 0.0640 -> 0.0673 (its
# 128 CTAs fill the GPU; the model's one wave misses that), =2 plans as 3; so RANK_STEP stays at 3.
SUMMARIES_STEP = 1.07
RANK_STEP = 3.0       # in chunk steps


def _rank_step() -> float:
    e = os.environ.get("FLASHQLA_CP_RANK_STEP", "").strip()
    return float(e) if e else RANK_STEP


def mode() -> str:
    """FLASHQLA_CP: 1 (the default: on where the plan predicts a gain; measured on the H200 at 1.4-2.0x on
    the TP8 single-sequence rows, exact), 0 (off)."""
    return os.environ.get("FLASHQLA_CP", "1").strip() or "1"


@dataclass(frozen=True)
class Plan:
    cu: tuple             # segment boundaries (token offsets), len = segments + 1
    seq_of: tuple         # sequence of each segment
    rank_of: tuple        # position of each segment within its sequence
    last_of_seq: tuple    # each sequence's last segment
    segment_chunks: int

    @property
    def segments(self) -> int:
        return len(self.cu) - 1


def _waves(ctas: int, sms: int) -> int:
    return -(-ctas // sms)


def plan(lengths, heads_v: int, sms: int, chunk: int = CHUNK):
    """A Plan, or None when segments would not help. lengths: host ints (tokens per sequence). Cached per
    arguments: an eager call's host time before its first launch is exposed on the GPU (the planning loop
    was ~30 us of it)."""
    if len(lengths) * heads_v * V_BLOCKS * 2 > sms:  # the sequences alone fill the GPU (checked before the O(N)
        return None                                   # key: thousands of short sequences)
    return _plan(tuple(int(x) for x in lengths), int(heads_v), int(sms), int(chunk), _rank_step())


@functools.lru_cache(maxsize=256)
def _plan(lengths: tuple, heads_v: int, sms: int, chunk: int, rank_step: float):
    chunks = [-(-n // chunk) for n in lengths]
    longest = max(chunks, default=0)
    per_seq = heads_v * V_BLOCKS
    if longest < 2 * MIN_SEGMENT_CHUNKS:
        return None
    plain = longest * _waves(len(lengths) * per_seq, sms)
    best = None
    seg = MIN_SEGMENT_CHUNKS
    while seg < longest:
        segs = sum(max(1, -(-c // seg)) for c in chunks)
        # B and Phi: summaries only over `segs` segments (one launch for both); then one full call; the scan per rank
        ranks = max(-(-c // seg) for c in chunks)
        t = seg * _waves(segs * per_seq, sms) * (SUMMARIES_STEP + 1) + rank_step * ranks
        if best is None or t <= best[0]:  # ties: the longer segments (fewer of them)
            best = (t, seg)
        seg *= 2
    if best is None or best[0] >= GAIN * plain:
        return None
    return _cut(lengths, best[1], chunk)


def _cut(lengths: tuple, seg: int, chunk: int) -> Plan:
    """The Plan cutting each sequence into segments of `seg` chunks (its last one shorter)."""
    chunks = [-(-n // chunk) for n in lengths]
    cu, seq_of, rank_of, last = [0], [], [], []
    start = 0
    for s, (n, c) in enumerate(zip(lengths, chunks)):
        pieces = max(1, -(-c // seg))
        for r in range(pieces):
            end = min(start + (r + 1) * seg * chunk, start + n)
            cu.append(end)
            seq_of.append(s)
            rank_of.append(r)
        last.append(len(seq_of) - 1)
        start += n
    return Plan(tuple(cu), tuple(seq_of), tuple(rank_of), tuple(last), seg)


PREP_UNITS = 4         # per-head preps a worker CTA runs at once (the C++ kPrepUnits)


def overlap_mode() -> str:
    """FLASHQLA_SEQ_ORDER: 1 (the default) = overlap_plan's schedule for packed batches where it applies, 0 = off."""
    return os.environ.get("FLASHQLA_SEQ_ORDER", "1").strip() or "1"


def overlap_plan(lengths, heads_v: int, sms: int, chunk: int = CHUNK):
    """A schedule for a packed batch of one long sequence and short ones, or None: (order, workers), the
    sequences in the order their chains start (longest first) and the prep workers beside them. Without it
    (flashqla_gdn_fwd's default for several sequences) the prep kernel runs on the whole GPU first, then every
    chain, and the short sequences' chains leave their SMs idle for most of the long one's (TP2 28672+4096: 64
    of 128 chain CTAs done after 64 of 448 chunk steps). With it the long sequence's chains start at once beside
    the workers, which prep its chunks first, and the short ones' chains take the workers' SMs when the prep is
    done, well inside the long chain's time. Taken where: the longest sequence's chains leave a quarter of the
    SMs to the workers (as for single sequences); the others' chains fit on the workers' SMs in one wave and are
    at most half as long; the prep is at least two waves of the workers' units."""
    if len(lengths) < 2 or overlap_mode() == "0":
        return None
    return _overlap_plan(tuple(int(x) for x in lengths), int(heads_v), int(sms), int(chunk))


@functools.lru_cache(maxsize=256)
def _overlap_plan(lengths: tuple, heads_v: int, sms: int, chunk: int):
    chunks = [-(-n // chunk) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda s: (-chunks[s], s))
    per_seq = heads_v * V_BLOCKS
    workers = sms - per_seq
    if per_seq > sms - sms // 4:
        return None
    rest = order[1:]
    if (len(lengths) - 1) * per_seq > workers or 2 * max(chunks[s] for s in rest) > chunks[order[0]]:
        return None
    if sum(chunks) * heads_v < 2 * workers * PREP_UNITS:
        return None
    return tuple(order), workers


def device_order(order: tuple, device: torch.device):
    """overlap_plan's order as a device int32 tensor (cached; None during capture without a cached copy)."""
    return _plan_tensors(("order", order, str(device)), device,
                         lambda: torch.tensor(order, dtype=torch.int32).to(device))


_DEVICE_PLANS: dict = {}
_CONSTANTS: dict = {}
_PINNED: set = set()  # cache keys a CUDA graph captured: their tensors must outlive every replay


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _evict(cache: dict, limit: int):
    """Drops the unpinned entries of `cache` once it holds `limit` (a graph that captured an entry keeps
    reading its memory: evicting it would hand that memory to other tensors under the graph)."""
    if len(cache) >= limit:
        for key in [k for k in cache if k not in _PINNED]:
            del cache[key]


def _cached(key, make, device):
    """A read-only device constant (the identity states, the zero v row) made once per shape: each would be
    an allocation and a launch per call. Made during CUDA-graph capture it is not kept (its values exist only
    in the graph's replays); used during capture it is pinned."""
    hit = _CONSTANTS.get(key)
    if hit is None:
        hit = make()
        if _capturing(device):
            return hit
        _evict(_CONSTANTS, 8)
        _CONSTANTS[key] = hit
    elif _capturing(device):
        _PINNED.add(key)
    return hit


def _zero_v(v):
    """The transition pass's v: one zero row broadcast to v's shape (stride 0), the view itself cached (its expand
    cost a few us of every call)."""
    key = ("zero_v", tuple(v.shape), v.dtype, str(v.device))
    return _cached(key, lambda: v.new_zeros(v.shape[3]).expand(v.shape), v.device)


def _plan_tensors(key, device, make):
    """Device index tensors of a plan, made once (make() -> a tuple of them) and cached. During CUDA-graph
    capture only a cached copy can be used (a copy from the host cannot be captured): None when there is none;
    a copy used during capture is pinned."""
    hit = _DEVICE_PLANS.get(key)
    if _capturing(device):
        if hit is not None:
            _PINNED.add(key)
        return hit
    if hit is None:
        _evict(_DEVICE_PLANS, 64)
        hit = _DEVICE_PLANS[key] = make()
    return hit


def _first_segments(p: Plan) -> list:
    """Each sequence's first segment (a sequence's segments follow the previous sequence's last one)."""
    return [0] + [last + 1 for last in p.last_of_seq[:-1]]


def _as_long(x, device):
    return torch.tensor(x, dtype=torch.long).to(device)


def device_plan(p: Plan, device: torch.device, index_dtype=torch.int32):
    """Device tensors of a plan (cached; None during capture without a cached copy): the segments' cu_seqlens
    and each sequence's last segment (int64; chunk_gdn_cp_scan and the final states read it)."""
    def make():
        return torch.tensor(p.cu, dtype=index_dtype).to(device), _as_long(p.last_of_seq, device)
    return _plan_tensors((p, str(device), index_dtype), device, make)


def _initial_states(fwd, q, k, v, g, beta, scale, initial_state, p: Plan, l2norm, index_dtype, fwd_pass):
    """Passes 1 and 2 and the scan: every segment's initial state [segments, H_v, K, V], and the pass runner
    (run(v, h0, prep_ready, write_o) -> (o, final)) for a last pass over the same segments. None when the
    plan's device copies are unavailable."""
    dp = device_plan(p, q.device, index_dtype)
    if dp is None:
        return None
    cu, last = dp
    H, K = v.shape[2], k.shape[3]
    NS = p.segments
    # v = 0 for the transition pass: one zero row broadcast over tokens and heads (stride 0; the kernels' pass
    # op reads none of it)
    zero_v = _zero_v(v)
    if fwd_pass is not None:
        from ._library import fwd_workspace_bytes
        ws = torch.empty(fwd_workspace_bytes(q.shape[0], q.shape[1], H), dtype=torch.uint8, device=q.device)
        # the transition pass reads no v (zero_v): a stride-0 v would send every CTA to one L2 line (measured:
        # that pass took 4.5x the other summaries pass)
        run = lambda v_, h0, ready, write_o: fwd_pass(q, k, v_, g, beta, scale, h0, cu, l2norm, ws,  # noqa: E731
                                                     ready, write_o, v_ is zero_v)
    else:
        run = lambda v_, h0, ready, write_o: fwd(q, k, v_, g, beta, scale, h0, True, cu, l2norm)  # noqa: E731
    _, b_end = run(v, None, False, False)
    sd = b_end.dtype  # the op's state dtype (fp32 on the GPU)
    eye = _cached(("eye", NS, H, K, sd, str(q.device)),
                  lambda: torch.eye(K, dtype=sd, device=q.device).expand(NS, H, K, K).contiguous(), q.device)
    _, phi = run(zero_v, eye, True, False)
    # the scan along each sequence's segments, S_{i+1} = Phi_i S_i + B_i (one kernel on the GPU)
    h0 = None if initial_state is None else initial_state.to(sd).contiguous()
    return torch.ops.flashqla.chunk_gdn_cp_scan(phi, b_end, h0, last), run


_cp_fwd_op = None  # the op once found (the dispatcher query cost ~10 us a call)


def _cp_op():
    """torch.ops.flashqla.chunk_gdn_cp_fwd where the built extension provides it (the passes and the scan
    issued from C++), else None; FLASHQLA_CP_CPP=0 keeps the steps in Python."""
    if os.environ.get("FLASHQLA_CP_CPP", "1").strip() == "0":
        return None
    global _cp_fwd_op
    if _cp_fwd_op is None:
        try:
            has = torch._C._dispatch_has_kernel_for_dispatch_key("flashqla::chunk_gdn_cp_fwd",
                                                                 "CompositeExplicitAutograd")
        except (AttributeError, RuntimeError):
            has = False
        if has:  # (a miss is not remembered: the extension may load later)
            _cp_fwd_op = torch.ops.flashqla.chunk_gdn_cp_fwd
    return _cp_fwd_op


def forward(fwd, q, k, v, g, beta, scale, initial_state, p: Plan, l2norm: bool, index_dtype=torch.int32,
            fwd_pass=None):
    """o and the final states [N, H_v, K, V] through segments. `fwd` has the signature of the chunk_gdn_fwd
    op: (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm) -> (o, final).
    `fwd_pass`, when given, is the chunk_gdn_fwd_pass op: the first two passes then skip o and all three
    share one workspace, so the chunk products are computed once (and with the built extension the steps run
    as one op, chunk_gdn_cp_fwd). q/k/v/g/beta are packed ([1, T, ...]); returns None when the plan's device
    copies are unavailable."""
    op = _cp_op() if fwd_pass is not None else None
    if op is not None:
        dp = device_plan(p, q.device, index_dtype)
        if dp is None:
            return None
        from ._library import _state_dtype, fwd_gates_workspace_bytes, fwd_workspace_bytes
        H, K = v.shape[2], k.shape[3]
        sd = _state_dtype(q)
        eye = _cached(("eye", p.segments, H, K, sd, str(q.device)),
                      lambda: torch.eye(K, dtype=sd, device=q.device).expand(p.segments, H, K, K).contiguous(),
                      q.device)
        # (the gates' room lets the two summaries passes run as one launch: chunk_gdn_cp_summaries)
        B, T = q.shape[0], q.shape[1]
        ws = torch.empty(fwd_workspace_bytes(B, T, H) + fwd_gates_workspace_bytes(B, T, H, dp[0])
                         if q.is_cuda else 0, dtype=torch.uint8, device=q.device)
        single_last = p.last_of_seq[0] if len(p.last_of_seq) == 1 else -1
        return op(q, k, v, g, beta, scale, initial_state, *dp, single_last, l2norm, ws, eye)
    got = _initial_states(fwd, q, k, v, g, beta, scale, initial_state, p, l2norm, index_dtype, fwd_pass)
    if got is None:
        return None
    init, run = got
    o, final = run(v, init, True, True)
    if len(p.last_of_seq) == 1:
        return o, final[p.last_of_seq[0]:]
    return o, final.index_select(0, device_plan(p, q.device, index_dtype)[1])


KSPLIT_BLOCKS = 4      # the plain backward chains' CTAs per sequence and value head (the C++ kVBlocksK)
LONG_SEGMENT_CHUNKS = 128  # segments this long pay for the backward even where the plain chains fill the GPU once


def backward_plan(lengths, heads_v: int, sms: int, chunk: int = CHUNK):
    """The backward's segments (the chunk_gdn_bwd_chains_cp op), or None. FLASHQLA_BWD_CP=1: wherever the forward's
    planner cuts; 0: never; unset: there, where the plain chains (side by side, K split) hold at most half of the
    SMs, or at most all of them with segments of LONG_SEGMENT_CHUNKS or more. Segments cost each chain about two
    passes of work where one did (its summaries and its last pass; the dS chain's L is the states' Phi^T), less where
    the passes merge (long segments whose gates decay), so they pay on SMs the plain chains leave idle, or over long
    segments. Measured on the H200 (session 34, with a third dS pass for L then:
    `h200-ab-20261205T1710Z-597ab77-qlalist-*`): hk2_hv4 32k_1seq 1.558 -> 0.856 ms, hk4_hv8 32k_1seq 1.995 -> 1.502,
    hk4_hv8 32k_2seq -4% (128-chunk segments), but hk8_hv16 8k_1seq 0.763 -> 0.819 (32-chunk segments, 128 plain
    CTAs); on an H100 with both merges and the reverse scan (session 38, `h100-ab-20261206T0500Z-10d7652-bwd{1,4}`):
    hk8_hv16 32k_1seq (128-chunk segments) 2.879 -> 2.702. The segment lengths it picks were the best of 32 / 64 /
    128, or within 0.2% of it, on the H200 (session 39, `h200-ab-20261206T0725Z-aa86434-bwdseg-*`): hk2_hv4 32k_1seq
    (32) 0.753 against 0.789 / 1.153, hk4_hv8 (64) 1.244 against 1.389 / 1.270, hk8_hv16 (128) 2.536 against 2.658 /
    2.533."""
    m = os.environ.get("FLASHQLA_BWD_CP", "").strip()
    if m == "0" or mode() == "0":
        return None
    forced = os.environ.get("FLASHQLA_BWD_CP_SEGMENT_CHUNKS", "").strip()
    if forced:  # (measurements: segments of this length wherever a sequence is longer than one, planner or not)
        seg = int(forced)
        if seg < MIN_SEGMENT_CHUNKS or seg & (seg - 1):
            raise ValueError(f"FLASHQLA_BWD_CP_SEGMENT_CHUNKS must be a power of two >= {MIN_SEGMENT_CHUNKS}, got {forced}")
        lengths = tuple(int(x) for x in lengths)
        if max(lengths, default=0) <= seg * chunk:
            return None
        return _cut(lengths, seg, chunk)
    p = plan(lengths, heads_v, sms, chunk)
    if p is None:
        return None
    plain = 2 * len(lengths) * heads_v * KSPLIT_BLOCKS
    if m != "1" and plain > sms // 2 and (plain > sms or p.segment_chunks < LONG_SEGMENT_CHUNKS):
        return None
    return p


def _first_plan(p: Plan, device: torch.device):
    """Each sequence's first segment as a device index (dh0 is gathered from there), cached like device_plan."""
    return _plan_tensors(("first", p, str(device)), device, lambda: (_as_long(_first_segments(p), device),))


def backward_chains(ops, q, k, v, g, beta, do, dht, scale, initial_state, p: Plan, l2norm: bool,
                    output_dh0: bool, output_a: bool, index_dtype=torch.int32):
    """The backward's two serial chains through segments (FLASHQLA_BWD_CP=1; the chunk_gdn_bwd_chains_cp op):
    (states, dh, dh0, a) as chunk_gdn_fwd_states and chunk_gdn_bwd_dh give them for the unsegmented call
    (the chunk-indexed buffers hold at least as many chunks; the chunks are the same, in the same order, since
    segments start on chunk boundaries). `ops` is torch.ops.flashqla. The states: the forward's passes 1-2
    and scan, then the states pass from each segment's initial state. The dS chain is affine backwards too,
    dS_start = L dS_end + B per segment: B from the real dO with zero end gradients, and L = Phi^T (K = V), the
    transpose of the forward's transition over the segment, since the dS chain is the state chain's adjoint (no
    pass of its own); a reverse scan over each sequence's segments starting from dht, then the chain pass from
    each segment's true end gradient. None when a plan's device copies are unavailable (CUDA-graph capture of an
    uncached plan)."""
    dp = device_plan(p, q.device, index_dtype)
    rp = _first_plan(p, q.device)
    if dp is None or rp is None:
        return None
    from ._library import _state_dtype
    H, K = v.shape[2], k.shape[3]
    sd = _state_dtype(q)
    eye = _cached(("eye", p.segments, H, K, sd, str(q.device)),
                  lambda: torch.eye(K, dtype=sd, device=q.device).expand(p.segments, H, K, K).contiguous(), q.device)
    return ops.chunk_gdn_bwd_chains_cp(q, k, v, g, beta, do, dht, scale, initial_state, *dp, *rp, eye, l2norm,
                                       output_dh0, output_a)


def backward_chain_passes(ops, q, k, v, g, beta, do, dht, scale, initial_state, cu, last, first, eye,
                          l2norm: bool, output_dh0: bool, output_a: bool):
    """chunk_gdn_bwd_chains_cp's steps op by op (its CPU implementation; the GPU's runs them in C++ from one prep):
    the states from the forward's summaries passes, scan and states pass; the dS chain's B pass (zero end
    gradients), reverse scan with L = Phi^T, and last pass."""
    sd = eye.dtype
    zero_v = _zero_v(v)
    _, b_end = ops.chunk_gdn_fwd(q, k, v, g, beta, scale, None, True, cu, l2norm)
    _, phi = ops.chunk_gdn_fwd(q, k, zero_v, g, beta, scale, eye, True, cu, l2norm)
    h0 = None if initial_state is None else initial_state.to(sd).contiguous()
    init = ops.chunk_gdn_cp_scan(phi, b_end, h0, last)
    states = ops.chunk_gdn_fwd_states(q, k, v, g, beta, scale, init, cu, l2norm)
    _, b_start, _ = ops.chunk_gdn_bwd_dh(q, k, g, beta, do, None, scale, cu, l2norm, True, False)
    # E_last = dht, E_{i-1} = L_i E_i + B_i with L_i = Phi_i^T (the dS chain is the state chain's adjoint), from
    # each sequence's last segment back: the scan's reverse walk
    dht_ = None if dht is None else dht.to(sd).contiguous()
    ends = ops.chunk_gdn_cp_scan(phi, b_start, dht_, last, True)
    dh, dh0_seg, a = ops.chunk_gdn_bwd_dh(q, k, g, beta, do, ends, scale, cu, l2norm, True, output_a)
    dh0 = dh0_seg.index_select(0, first) if output_dh0 else dh0_seg.new_empty((0,))
    return states, dh, dh0, a
