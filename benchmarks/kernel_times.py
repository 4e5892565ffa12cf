"""Where flashqla's time goes: GPU time per kernel (torch.profiler) of one forward and one backward call on
a few anchor cases, so a change can be aimed at the kernel that costs most.

    python benchmarks/kernel_times.py [--match REGEX] [--reps N] [--launches] [--host] [--l2norm] [--lib LIB]
                                      [--plain N]

Prints, per case, each kernel's summed GPU time per call (ms) and its share; the case's total is the sum of
kernel times (launch gaps excluded). Needs an sm_90 GPU. --lib fla_triton / flash_qla_tilelang profiles a
competitor's call the way the benchmark times it (FlashQLA's backward: its CP passes, state recompute and
reverse kernel), to read where its time goes beside ours. --plain N only calls each matched case N times, with
no profiler (a driver for Nsight Compute: h200.sh's ncucase stage).
"""
import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from flashqla import bench  # noqa: E402

DEFAULT = r"^(fwd (TP1|35B|TP4|TP8) .*1x32768|fwd TP8 .*1x8192|bwd hk16_hv32 32k_1seq)$"


def kernel_times(fn, reps: int) -> dict:
    """{kernel name: GPU ms per call} over `reps` profiled calls after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name] += e.device_time_total / 1e3 / reps
    return dict(out)


def launches(fn) -> list:
    """[(kernel, start us, end us, stream)] of one call in start order, times from the first kernel's start."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    return [(short(e.name), e.time_range.start - t0, e.time_range.end - t0, getattr(e, "device_resource_id", "?"))
            for e in evs]


def host_cost(fn, calls: int = 20) -> tuple:
    """(host us per call, [(op, self CPU us per call)]): the CPU time of enqueueing `calls` calls after a sync
    (no sync inside, few enough calls that the launch queue never blocks the host), the median of 5 such
    loops; and one profiled call's CPU ops by self time. An eager call is host-bound where the first figure
    exceeds its GPU time."""
    import statistics
    import time
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    ops = sorted(((e.key, e.self_cpu_time_total / calls, e.count // calls) for e in prof.key_averages()),
                 key=lambda x: -x[1])
    return statistics.median(per), ops


def short(name: str) -> str:
    name = re.sub(r"<.*", "", name)            # template arguments
    name = re.sub(r"\(.*", "", name)
    return name.split("::")[-1][:60]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--match", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--launches", action="store_true",
                    help="also list one call's kernels in start order: start and end (us) and stream")
    ap.add_argument("--host", action="store_true",
                    help="also the host time per eager call and its CPU ops by self time (is the call host-bound?)")
    ap.add_argument("--l2norm", action="store_true",
                    help="flashqla with use_qk_l2norm_in_kernel=True (the anchors' q, k come normalised: the same "
                         "values, plus the l2norm's forward and backward)")
    ap.add_argument("--plain", type=int, default=0, metavar="N",
                    help="call each matched case N times and nothing else (no torch.profiler: for ncu)")
    ap.add_argument("--lib", default="flashqla", choices=bench.LIBS,
                    help="whose calls to profile (a competitor: the call the benchmark times)")
    args = ap.parse_args()
    if args.l2norm and args.lib != "flashqla":
        ap.error("--l2norm profiles flashqla only")
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("kernel_times: needs an sm_90 GPU")
        return 0
    libs = bench.load_libs([args.lib], "cuda")
    if isinstance(libs[args.lib], str):
        print(f"kernel_times: {args.lib} unavailable: {libs[args.lib]}")
        return 1
    rx = re.compile(args.match)
    for case in bench.cases_for("anchors"):
        label = f"{case.direction} {case.model} {case.name}"
        if not rx.search(label):
            continue
        d = bench.make_inputs(case, "cuda")
        fn = bench.build_fn(args.lib, libs[args.lib], case, d)
        if args.l2norm and case.direction in ("fwd", "bwd"):
            impl, args5 = libs["flashqla"], tuple(d[n] for n in ("q", "k", "v", "g", "beta"))
            fn = ((lambda: bench._flashqla_call(impl["api"], d, *args5, d["h0"], l2norm=True))
                  if case.direction == "fwd" else
                  (lambda: impl["bwd"](*args5, d["do"], d["dht"], scale=d["scale"], initial_state=d["h0"],
                                       cu_seqlens=d["cu"], cu_seqlens_cpu=d["cu_cpu"], use_qk_l2norm_in_kernel=True)))
            label += " (l2norm in kernel)"
        if args.plain > 0:
            for _ in range(args.plain):
                fn()
            torch.cuda.synchronize()
            print(f"{label}: {args.plain} calls")
            continue
        times = kernel_times(fn, args.reps)
        merged = defaultdict(float)
        for k, t in times.items():
            merged[short(k)] += t
        total = sum(merged.values())
        print(f"{label}{'' if args.lib == 'flashqla' else ' [' + bench.LABELS[args.lib] + ']'}: "
              f"{total:.3f} ms of kernel time per call")
        for k, t in sorted(merged.items(), key=lambda kv: -kv[1])[:12]:
            print(f"  {t:8.3f} ms {100 * t / total:5.1f}%  {k}")
        if args.launches:  # one call's timeline: which kernels overlap (the backward's two chains run on two streams)
            ls = launches(fn)
            span = max((e for _, _, e, _ in ls), default=0)
            print(f"  one call: first start to last end {span:.0f} us")
            for k, a, b, st in ls:
                print(f"    {a:9.1f} {b:9.1f} us  stream {st}  {k or '?'}")
        if args.host:
            us, ops = host_cost(fn)
            print(f"  host: {us:.1f} us per call (GPU kernel time {1e3 * total:.1f} us); CPU ops by self time per call "
                  f"(sum {sum(t for _, t, _ in ops):.1f} us, under the profiler; the rest of the host time is Python):")
            for name, t, n in ops[:14]:
                print(f"    {t:8.1f} us  x{n:<3d} {name[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
