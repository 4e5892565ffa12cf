"""H200 record for the chunk-local cumsum kernel (the first kernel: proves build,
load, call and compare). For each case: relative L2 error against the float64
reference for flashqla and FLA, and median eager / CUDA-graph times for both
(FLA given precomputed chunk_indices, so its host-side planning is not timed).
Writes benchmarks/results/h200-cumsum-<UTC>.json (and a copy under --out-dir)."""
import argparse
import datetime
import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("FLA_FLASH_QLA", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashqla  # noqa: E402
from flashqla.bench import record_meta, time_gpu  # noqa: E402
from flashqla.reference import chunk_local_cumsum_torch  # noqa: E402

CASES = [  # name, B, seqlens (None: dense B x T), T, H
    ("dense 1x32768 H64", 1, None, 32768, 64),
    ("dense 4x8192 H32", 4, None, 8192, 32),
    ("varlen 8192x4 H32", 1, [8192] * 4, None, 32),
    ("varlen 8k_4seq H8", 1, [2048, 3000, 1000, 2144], None, 8),
    ("varlen 1024x8 H8", 1, [1024] * 8, None, 8),
]


def rel(a, r):
    return float((a.double() - r).norm() / r.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=os.environ.get("OUT"))
    args = ap.parse_args()
    try:
        from fla.ops.utils.cumsum import chunk_local_cumsum as fla_cumsum
        from fla.ops.utils.index import prepare_chunk_indices
    except Exception as e:  # noqa: BLE001
        print("FLA unavailable:", e)
        fla_cumsum = None
    dev = "cuda"
    rows = []
    for name, B, seqlens, T, H in CASES:
        for reverse in (False, True):
            torch.manual_seed(0)
            if seqlens is None:
                cu = None
            else:
                T = sum(seqlens)
                cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
            g = F.logsigmoid(torch.randn(B, T, H, device=dev)) / 16
            ref = chunk_local_cumsum_torch(g.double(), 64, reverse, None, cu)
            row = {"case": name, "reverse": reverse, "B": B, "T": T, "H": H, "seqlens": seqlens,
                   "ms": {}, "rel_l2": {}, "errors": []}
            ours = lambda: flashqla.chunk_local_cumsum(g, 64, reverse=reverse, cu_seqlens=cu)  # noqa: E731
            row["rel_l2"]["flashqla"] = rel(ours(), ref)
            row["ms"]["flashqla"] = {m: time_gpu(ours, m) for m in ("eager", "graph")}
            if fla_cumsum is not None:
                try:
                    ci = prepare_chunk_indices(cu, 64) if cu is not None else None
                    fla = lambda: fla_cumsum(g, 64, reverse=reverse, cu_seqlens=cu, chunk_indices=ci)  # noqa: E731
                    row["rel_l2"]["fla_triton"] = rel(fla(), ref)
                    row["ms"]["fla_triton"] = {m: time_gpu(fla, m) for m in ("eager", "graph")}
                except Exception as e:  # noqa: BLE001
                    row["errors"].append(f"fla_triton: {type(e).__name__}: {str(e)[:200]}")
            n = B * T * H
            row["GBps_flashqla_graph"] = 8 * n / row["ms"]["flashqla"]["graph"] / 1e6  # read g fp32 + write fp32
            rows.append(row)
            fl = row["ms"].get("fla_triton", {})
            print(f"{name:22s} rev={int(reverse)} flashqla {row['ms']['flashqla']['eager']:.4f}/"
                  f"{row['ms']['flashqla']['graph']:.4f} ms  FLA {fl.get('eager', float('nan')):.4f}/"
                  f"{fl.get('graph', float('nan')):.4f} ms  err {row['rel_l2']['flashqla']:.1e} "
                  f"(FLA {row['rel_l2'].get('fla_triton', float('nan')):.1e})", flush=True)
    worst = max(r["rel_l2"]["flashqla"] for r in rows)
    rec = dict(record_meta(), case_set="cumsum", kernel="chunk_local_cumsum (chunk 64, fp32 out)",
               method="median of triton.testing.do_bench (eager) and do_bench_cudagraph (graph), ms; "
                      "rel_l2 against the float64 reference (flashqla.reference.chunk_local_cumsum_torch)",
               cases=rows, worst_rel_l2_flashqla=worst, passed=worst < 1e-6)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = os.path.join(ROOT, "benchmarks", "results", f"h200-cumsum-{stamp}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    if args.out_dir:
        shutil.copy(path, args.out_dir)
    print(f"worst flashqla rel L2 {worst:.2e}; record {path}")
    return 0 if rec["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
