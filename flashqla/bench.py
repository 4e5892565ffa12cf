"""Benchmark harness: flashqla's chunked Gated DeltaNet against FLA (Triton) and FlashQLA (TileLang).

    python -m flashqla.bench [run] [--cases anchors|flashqla|smoke[,...]] [--fwd-only|--bwd-only]
                                   [--no-graph] [--libs flashqla,fla_triton,flash_qla_tilelang]
                                   [--device auto|cuda|cpu] [--out PATH] [--plot PATH] [--table PATH]
    python -m flashqla.bench readme [--record PATH] [--readme README.md]
    python -m flashqla.bench merge A.json B.json [--out PATH]     (runs split with --match, same tree/device)

Case sets: ``anchors`` (the 24 forward + 4 backward cases of the H200 anchors),
``flashqla`` (FlashQLA's published H200 lists: 171 forward, 32 backward) and ``smoke``
(tiny; the only set run on CPU). Inputs: bf16 l2-normalised q/k, bf16 v, fp32
g = logsigmoid(randn)/16, fp32 beta = sigmoid(rand), fp32 h0, do, dht; varlen B = 1
with int32 cu_seqlens; K = V = 128. The ``flashqla`` set also zeroes g on a quarter of
the value heads as FlashQLA's published benchmark does; the ``anchors`` set does not,
like shared/tools/anchor_bench.py (g = 0 heads defeat FlashQLA's context-parallel
warm-up early exit and cost it 24-58% on its CP cases, so the two protocols differ).

On a GPU each library call is timed by ``triton.testing.do_bench`` (eager: CUDA events,
warmup=25 ms, rep=100 ms, median) and ``do_bench_cudagraph`` (replay, rep=100 ms,
median). Without an sm_90 GPU the smoke set runs on the CPU fallback and is timed with
time.perf_counter medians: those are CPU fallback timings, written to ``cpu-*`` records
that the README generator never reads.

Backward: every library runs its low-level backward (flashqla.chunk_gdn_bwd, which
needs only the forward's inputs; FLA and FlashQLA given their own forward's
intermediates). flashqla's chunk_gdn_bwd runs both state chains and the chunk-parallel
gradient step on the sm_90a kernels (FLASHQLA_BWD_GRAD=0: the step in PyTorch;
FLASHQLA_BWD_KERNEL=0: all PyTorch); the record's label says which.

Heavy modules (triton, fla, flash_qla, matplotlib) are imported lazily.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import _fingerprint

SCHEMA_VERSION = 1
CHUNK = 64
HEAD_DIM = 128
LIBS = ("flashqla", "fla_triton", "flash_qla_tilelang")
COMPETITORS = LIBS[1:]
LABELS = {"flashqla": "flashqla", "fla_triton": "FLA", "flash_qla_tilelang": "FlashQLA"}
MODES = ("eager", "graph")
# case directions: the forward, the low-level backward (given the forward's saved tensors), and forward +
# backward end to end through each library's autograd API
DIRECTIONS = {"fwd": "Forward", "bwd": "Backward", "e2e": "Forward + backward through autograd"}
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"
REPO_ROOT = Path(__file__).resolve().parents[1]
DIRTY_PATHS = ("csrc", "flashqla", "setup.py", "CMakeLists.txt", "benchmarks")
ACCURACY_KEYS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")

# --------------------------------------------------------------------------- FLOP model
FLOP_MODEL = (
    "Per 64-token chunk (C = 64; a sequence of L tokens has ceil(L/C) chunks, partial ones counted whole) and per "
    "value head, with head dims K and V. Forward = 4C^2K + 4C^2V + 6CKV + C^3/3: K K^T and Q K^T (2C^2K each), the "
    "V_new and O intra-chunk products (2C^2V each), K S, Q S and the state update K^T V_new (2CKV each) and the "
    "64x64 unit-triangular inverse (C^3/3); 10.57 MFLOP at K = V = 128. Backward = 8C^2K + 8C^2V + 16CKV + 4C^3 "
    "(gradients: two products per forward product, the inverse's backward -A^T dA A^T, and the dS chain's two "
    "extra CKV products; 26.2 MFLOP) + 4CKV + 2C^2V (recomputing the chunk-start states: K S, V_new, K^T V_new; "
    "5.2 MFLOP) = 31.5 MFLOP at K = V = 128; forward + backward end to end = the sum, 42.0 MFLOP. TFLOP/s = "
    "model FLOPs / measured time; the same model is used for every library, whatever it actually computes.")


def flops_per_chunk(direction: str, K: int = HEAD_DIM, V: int = HEAD_DIM, C: int = CHUNK) -> float:
    """Model FLOPs of one chunk of one value head (see FLOP_MODEL)."""
    fwd = 4 * C * C * K + 4 * C * C * V + 6 * C * K * V + C ** 3 / 3
    if direction == "fwd":
        return float(fwd)
    if direction == "bwd":
        return float(bwd_main_flops(K, V, C) + bwd_recompute_flops(K, V, C))
    if direction == "e2e":
        return float(fwd + bwd_main_flops(K, V, C) + bwd_recompute_flops(K, V, C))
    raise ValueError(f"direction must be one of {', '.join(DIRECTIONS)}, got {direction!r}")


def bwd_main_flops(K: int = HEAD_DIM, V: int = HEAD_DIM, C: int = CHUNK) -> float:
    return float(8 * C * C * K + 8 * C * C * V + 16 * C * K * V + 4 * C ** 3)


def bwd_recompute_flops(K: int = HEAD_DIM, V: int = HEAD_DIM, C: int = CHUNK) -> float:
    return float(4 * C * K * V + 2 * C * C * V)


def case_flops(direction, seqlens, h_v, K=HEAD_DIM, V=HEAD_DIM, C=CHUNK) -> float:
    chunks = sum(-(-int(n) // C) for n in seqlens)
    return chunks * h_v * flops_per_chunk(direction, K, V, C)


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    direction: str      # "fwd" | "bwd" | "e2e" (DIRECTIONS)
    model: str          # e.g. "TP1 (16/64)" or "hk16_hv32"
    h_qk: int
    h_v: int
    name: str           # seqlens name, e.g. "1x32768", "28672+4096", "8k_4seq"
    seqlens: tuple
    no_decay_heads: bool = False  # g = 0 on a quarter of the value heads (FlashQLA's published inputs)

    @property
    def tokens(self) -> int:
        return sum(self.seqlens)


def _seq_by_name(name: str) -> list:
    """'1x32768' -> [32768], '8192x4' -> [8192]*4, '28672+4096' -> [28672, 4096]."""
    if "+" in name:
        return [int(x) for x in name.split("+")]
    a, b = (int(x) for x in name.split("x"))
    return [b] if a == 1 else [a] * b


def random_split(n: int, total: int, seed: int = 42) -> list:
    """Split `total` tokens into `n` sequences at n-1 random cut points (a seeded permutation of 1..total-1);
    FlashQLA's published backward cases are built this way."""
    if n <= 1:
        return [total]
    import torch
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(total - 1, generator=gen)[: n - 1] + 1).tolist())
    edges = [0] + cuts + [total]
    return [edges[i + 1] - edges[i] for i in range(n)]


_ANCHOR_FWD_MODELS = [("TP8", 2, 8), ("TP4", 4, 16), ("TP2", 8, 32), ("TP1", 16, 64), ("35B", 16, 32)]
_ANCHOR_SEQS_FULL = ["1x32768", "1x8192", "1x2048", "28672+4096", "8192x4", "1024x8"]
_ANCHOR_SEQS_BIG = ["1x32768", "1x8192", "8192x4"]           # TP1 and 35B rows of the anchors
_ANCHOR_BWD_MODELS = [("hk16_hv32", 16, 32), ("hk4_hv8", 4, 8)]
_ANCHOR_BWD_SEQS = [("8k_4seq", [2048, 3000, 1000, 2144]), ("32k_1seq", [32768])]

_QLA_FWD_MODELS = [("397B/122B TP8", 2, 8), ("397B/122B TP4", 4, 16), ("397B/122B TP2", 8, 32),
                   ("397B/122B TP1", 16, 64), ("35B/9B/4B TP1", 16, 32), ("27B TP2", 8, 24), ("27B TP1", 16, 48),
                   ("2B/0.8B TP1", 16, 16), ("Sym h32", 32, 32)]
_QLA_FWD_SEQS = ["1x32768", "1x16384", "1x8192", "1x4096", "1x2048", "28672+4096", "24576+8192", "16384+16384",
                 "8192+24576", "4096+28672", "12288+4096", "6144+2048", "4096+4096", "2048+6144", "1024+7168",
                 "8192x4", "4096x8", "2048x4", "1024x8"]
_QLA_BWD_MODELS = [("hk16_hv32", 16, 32), ("hk8_hv16", 8, 16), ("hk4_hv8", 4, 8), ("hk2_hv4", 2, 4)]
_QLA_BWD_SEQS = [(f"{t // 1024}k_{n}seq", n, t) for t in (8192, 32768) for n in (1, 2, 4, 8)]

CASE_SETS = ("anchors", "flashqla", "smoke", "e2e")


def cases_for(set_name: str, fwd: bool = True, bwd: bool = True) -> list:
    out = []
    if set_name == "anchors":
        if fwd:
            for m, hq, hv in _ANCHOR_FWD_MODELS:
                for s in (_ANCHOR_SEQS_BIG if hq == 16 else _ANCHOR_SEQS_FULL):
                    out.append(Case("fwd", f"{m} ({hq}/{hv})", hq, hv, s, tuple(_seq_by_name(s))))
        if bwd:
            for m, hq, hv in _ANCHOR_BWD_MODELS:
                for s, sl in _ANCHOR_BWD_SEQS:
                    out.append(Case("bwd", m, hq, hv, s, tuple(sl)))
    elif set_name == "flashqla":
        if fwd:
            for m, hq, hv in _QLA_FWD_MODELS:
                for s in _QLA_FWD_SEQS:
                    out.append(Case("fwd", f"{m} ({hq}/{hv})", hq, hv, s, tuple(_seq_by_name(s)), True))
        if bwd:
            for m, hq, hv in _QLA_BWD_MODELS:
                for s, n, t in _QLA_BWD_SEQS:
                    out.append(Case("bwd", m, hq, hv, s, tuple(random_split(n, t)), True))
    elif set_name == "smoke":
        if fwd:
            out += [Case("fwd", "tiny (2/4)", 2, 4, "1x256", (256,)),
                    Case("fwd", "tiny (2/4)", 2, 4, "100+156", (100, 156)),
                    Case("fwd", "tiny (4/4)", 4, 4, "1x192", (192,))]
        if bwd:
            out += [Case("bwd", "hk2_hv4", 2, 4, "1x256", (256,)),
                    Case("bwd", "hk2_hv4", 2, 4, "100+156", (100, 156)),
                    Case("e2e", "hk2_hv4", 2, 4, "100+156", (100, 156))]
    elif set_name == "e2e":   # the anchors' backward configurations, forward + backward through autograd
        if bwd:
            for m, hq, hv in _ANCHOR_BWD_MODELS:
                for s, sl in _ANCHOR_BWD_SEQS:
                    out.append(Case("e2e", m, hq, hv, s, tuple(sl)))
    else:
        raise ValueError(f"unknown case set {set_name!r}; choose from {', '.join(CASE_SETS)}")
    return out


# --------------------------------------------------------------------------- record metadata
def _git(args, cwd):
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def git_info(repo_root=REPO_ROOT) -> tuple:
    """(commit, dirty) of the tree at repo_root. FLASHQLA_COMMIT / FLASHQLA_DIRTY win when set: the H200
    machine receives a copy of the tree whose .git, if any, can be stale. Else git; else ("unknown", None)."""
    if os.environ.get("FLASHQLA_COMMIT", "").strip():
        dirty = {"0": False, "1": True}.get(os.environ.get("FLASHQLA_DIRTY", "").strip())
        return os.environ["FLASHQLA_COMMIT"].strip(), dirty
    head = _git(["rev-parse", "HEAD"], repo_root) if (Path(repo_root) / ".git").exists() else None
    if head and len(head.strip()) == 40:
        status = _git(["status", "--porcelain", "--untracked-files=no", "--", *DIRTY_PATHS], repo_root)
        return head.strip(), (bool(status.strip()) if status is not None else None)
    return "unknown", None


def _dist_version(*names):
    from importlib import metadata
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _driver_version():
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import pynvml
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else v
    except Exception:
        return None


def record_meta(device: str | None = None) -> dict:
    """commit, dirty, gpu, sm_count, driver, date, versions (no heavy imports beyond torch)."""
    import torch
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    commit, dirty = git_info()
    meta = {"commit": commit, "dirty": dirty, "gpu": None, "sm_count": None, "driver": None,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        meta.update(gpu=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    driver=_driver_version())
    fqla = sys.modules.get("flashqla")
    meta["versions"] = {
        "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
        "triton": _dist_version("triton"), "fla": _dist_version("flash-linear-attention", "fla-core"),
        "flash_qla": _dist_version("flash-qla", "flash_qla"), "tilelang": _dist_version("tilelang"),
        "flashqla": getattr(fqla, "__version__", None) or _dist_version("flashqla"),
    }
    # the digest of the kernel sources the timed extension was built from (flashqla/_fingerprint.py; None for the
    # fallback or a build from before the mark): `python -m flashqla.bench fingerprint --record` checks it
    ext = getattr(sys.modules.get("flashqla._C"), "__file__", None)
    meta["kernel_sources"] = _fingerprint.extension_fingerprint(ext) if ext else None
    # switches that change what flashqla runs (context parallelism, kernel choice, fallback)
    meta["env"] = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith("FLASHQLA_") and k not in ("FLASHQLA_COMMIT", "FLASHQLA_DIRTY")}
    return meta


# --------------------------------------------------------------------------- inputs and libraries
def make_inputs(case: Case, device: str, seed: int = 0, strong_decay: bool = False) -> dict:
    import torch
    import torch.nn.functional as F
    gen = torch.Generator(device=device).manual_seed(seed)
    T, N, hq, hv, K, V = case.tokens, len(case.seqlens), case.h_qk, case.h_v, HEAD_DIM, HEAD_DIM
    rnd = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    q = F.normalize(rnd(1, T, hq, K), dim=-1).bfloat16()
    k = F.normalize(rnd(1, T, hq, K), dim=-1).bfloat16()
    v = rnd(1, T, hv, V).bfloat16()
    if strong_decay:  # g down to -5 per token, and one head that never decays
        g = -5 * torch.rand(1, T, hv, device=device, generator=gen)
        g[:, :, 0] = 0.0
    else:
        g = F.logsigmoid(rnd(1, T, hv)) / 16
        if case.no_decay_heads:  # as FlashQLA's benchmark: a quarter of the value heads (rounded down)
            n_keep = math.ceil(0.75 * hv)
            no_decay = torch.randperm(hv, device=device, generator=gen)[n_keep:]
            g[:, :, no_decay] = 0.0
    beta = torch.rand(1, T, hv, device=device, generator=gen).sigmoid()
    h0 = rnd(N, hv, K, V)
    do = rnd(1, T, hv, V).bfloat16()
    dht = rnd(N, hv, K, V) / 8
    cu_cpu = torch.tensor([0] + [sum(case.seqlens[: i + 1]) for i in range(N)], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta, h0=h0, do=do, dht=dht, cu=cu_cpu.to(device), cu_cpu=cu_cpu,
                scale=K ** -0.5)


def load_libs(requested, device: str) -> dict:
    """lib -> dict of callables, or a string with the reason it is unavailable."""
    out = {}
    for lib in requested:
        if lib == "flashqla":
            import flashqla
            import torch
            out[lib] = {"api": flashqla.chunk_gdn, "bwd": flashqla.chunk_gdn_bwd,
                        "kernels": flashqla.kernels_available(torch.device(device))}
            continue
        if device != "cuda":
            out[lib] = "needs a CUDA GPU (Triton/TileLang kernels); this run is on the CPU fallback"
            continue
        try:
            if lib == "fla_triton":
                os.environ["FLA_FLASH_QLA"] = "0"   # FLA's own Triton path, not its FlashQLA dispatch
                import fla
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule as api
                from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd as bwd
                from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd as fwd
                out[lib] = {"api": api, "fwd": fwd, "bwd": bwd, "version": getattr(fla, "__version__", None)}
            elif lib == "flash_qla_tilelang":
                os.environ.setdefault("FLA_FLASH_QLA", "0")
                import flash_qla
                from flash_qla import chunk_gated_delta_rule_bwd as bwd
                from flash_qla import chunk_gated_delta_rule_fwd as fwd
                out[lib] = {"api": getattr(flash_qla, "chunk_gated_delta_rule", None), "fwd": fwd, "bwd": bwd,
                            "version": getattr(flash_qla, "__version__", None)}
            else:
                out[lib] = f"unknown library {lib!r}"
        except Exception as e:  # ImportError, or a broken install
            out[lib] = f"not importable: {type(e).__name__}: {str(e)[:200]}"
    return out


def _e2e_l2norm() -> bool:
    """FLASHQLA_BENCH_L2NORM=1: the e2e cases call every library's autograd API with use_qk_l2norm_in_kernel=True
    (the l2norm's forward and backward inside each library, as Qwen3-Next calls the rule; q, k as drawn). Recorded
    in the record's env like every FLASHQLA_ switch."""
    return os.environ.get("FLASHQLA_BENCH_L2NORM", "0").strip() == "1"


def _flashqla_call(api, d, q, k, v, g, beta, h0, l2norm=False):
    # cu_seqlens_cpu lets flashqla check cu_seqlens without a device sync
    return api(q, k, v, g, beta, scale=d["scale"], initial_state=h0, output_final_state=True, cu_seqlens=d["cu"],
               cu_seqlens_cpu=d["cu_cpu"], use_qk_l2norm_in_kernel=l2norm)


_LEAVES = ("q", "k", "v", "g", "beta", "h0")


def _autograd_forward(lib: str, impl: dict, d: dict, leaves):
    """(o, final state) from `lib`'s autograd API on `leaves` (q, k, v, g, beta, h0) and the rest of `d`."""
    l2norm = _e2e_l2norm()
    if lib == "flashqla":
        return _flashqla_call(impl["api"], d, *leaves, l2norm=l2norm)
    if impl.get("api") is None:
        raise RuntimeError(f"{lib} has no autograd API in this install")
    kw = dict(use_qk_l2norm_in_kernel=True) if l2norm else {}  # (both competitors' APIs take it)
    return impl["api"](*leaves[:5], scale=d["scale"], initial_state=leaves[5], output_final_state=True,
                       cu_seqlens=d["cu"], **kw)


def build_fn(lib: str, impl: dict, case: Case, d: dict):
    """A no-argument callable running `lib`'s forward, backward or both (e2e) for `case` on inputs `d`."""
    q, k, v, g, beta, h0, do, dht, cu, scale = (d[n] for n in ("q", "k", "v", "g", "beta", "h0", "do", "dht",
                                                               "cu", "scale"))
    if case.direction == "e2e":
        import torch
        leaves = [d[n].detach().clone().requires_grad_(True) for n in _LEAVES]

        def e2e():
            with torch.enable_grad():
                o, ht = _autograd_forward(lib, impl, d, leaves)
                return torch.autograd.grad((o, ht), leaves, (do, dht))
        return e2e
    if lib == "flashqla":
        if case.direction == "fwd":
            return lambda: _flashqla_call(impl["api"], d, q, k, v, g, beta, h0)
        # the low-level backward, as for the competitors (autograd would replay on the stream of a forward
        # run outside the capture and invalidate do_bench_cudagraph's side-stream capture)
        return lambda: impl["bwd"](q, k, v, g, beta, do, dht, scale=scale, initial_state=h0, cu_seqlens=cu,
                                   cu_seqlens_cpu=d["cu_cpu"])
    fwd_kw = dict(scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    if lib == "fla_triton":
        if case.direction == "fwd":
            return lambda: impl["fwd"](q, k, v, g, beta, **fwd_kw)
        r = impl["fwd"](q, k, v, g, beta, **fwd_kw)        # (g_cumsum, o, A, final_state, ...)
        g_c, A = r[0], r[2]
        return lambda: impl["bwd"](q, k, v, g_c, beta, A, scale, h0, do, dht, cu_seqlens=cu)
    if lib == "flash_qla_tilelang":
        if case.direction == "fwd":
            return lambda: impl["fwd"](q, k, v, g, beta, **fwd_kw)
        r = impl["fwd"](q, k, v, g, beta, is_train=True, **fwd_kw)   # (g_cumsum, A, o, ...)
        g_c, A = r[0], r[1]
        return lambda: impl["bwd"](q, k, v, g_c, beta, A, do, dht, scale=scale, initial_state=h0, cu_seqlens=cu)
    raise ValueError(lib)


# --------------------------------------------------------------------------- timing
def time_gpu(fn, mode: str) -> float:
    import triton.testing as tt
    if mode == "graph":
        return float(tt.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(tt.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_cpu(fn, warmup: int = 1, reps: int = 5) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def case_entry(case: Case, ms: dict, errors: list, notes: dict | None = None, clocks: dict | None = None) -> dict:
    """Record entry of one case: ms per library (only measured ones), TFLOP/s, speed-ups, errors; clocks: the SM
    clock and board power sampled while each time was taken (flashqla._nvml), where NVML answered."""
    flop = case_flops(case.direction, case.seqlens, case.h_v)
    tflops = {lib: {m: flop / (t * 1e-3) / 1e12 for m, t in modes.items() if t > 0} for lib, modes in ms.items()}
    speedup = {}
    base = ms.get("flashqla", {})
    for comp in COMPETITORS:
        r = {m: ms[comp][m] / base[m] for m in MODES if m in base and m in ms.get(comp, {}) and base[m] > 0}
        if r:
            speedup[comp] = r
    e = {"direction": case.direction, "model": case.model, "h_qk": case.h_qk, "h_v": case.h_v, "name": case.name,
         "seqlens": list(case.seqlens), "tokens": case.tokens,
         "chunks": sum(-(-n // CHUNK) for n in case.seqlens), "flop": flop,
         "ms": ms, "tflops": tflops, "speedup": speedup, "errors": errors}
    if notes:
        e["notes"] = notes
    if clocks:
        e["clocks"] = clocks
    return e


def run_case(case: Case, libs: dict, device: str, graph: bool, cpu_reps: int = 5) -> dict:
    import torch
    from flashqla._nvml import Sampler
    ms, errors, clocks = {}, [], {}
    for lib, impl in libs.items():
        if isinstance(impl, str):
            errors.append({"lib": lib, "stage": "import", "error": impl})
    d = make_inputs(case, device)
    for lib, impl in libs.items():
        if isinstance(impl, str):
            continue
        fn = None
        try:
            t0 = time.perf_counter()
            fn = build_fn(lib, impl, case, d)
            fn()    # first call: JIT / TileLang compile happens here, once per case
            if device == "cuda":
                torch.cuda.synchronize()
            print(f"    {lib}: first call {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as e:
            errors.append({"lib": lib, "stage": "setup", "error": _short(e)})
            print(f"    {lib}: FAILED setup: {_short(e)}", flush=True)
            fn = None
        if fn is not None:
            modes = {}
            for mode in (MODES if (graph and device == "cuda") else ("eager",)):
                try:
                    if device == "cuda":
                        with Sampler(torch.cuda.current_device()) as s:
                            t = time_gpu(fn, mode)
                        if (clock := s.summary()) is not None:
                            clocks.setdefault(lib, {})[mode] = clock
                    else:
                        t = time_cpu(fn, reps=cpu_reps)
                    if not (t > 0 and math.isfinite(t)):
                        raise RuntimeError(f"timer returned {t}")
                    modes[mode] = t
                except Exception as e:
                    errors.append({"lib": lib, "stage": mode, "error": _short(e)})
                    print(f"    {lib}: FAILED {mode}: {_short(e)}", flush=True)
                    if device == "cuda":
                        try:
                            torch.cuda.synchronize()
                        except Exception:
                            pass
            if modes:
                ms[lib] = modes
        del fn
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    del d
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    kernels = libs.get("flashqla", {}).get("kernels", False) if isinstance(libs.get("flashqla"), dict) else False
    notes = ({"flashqla": flashqla_bwd_label(kernels)} if case.direction == "bwd" else
             {"flashqla": "torch.autograd.grad through flashqla.chunk_gdn: " + flashqla_bwd_label(kernels)}
             if case.direction == "e2e" else None)
    return case_entry(case, ms, errors, notes, clocks)


# --------------------------------------------------------------------------- prewarm
# FLA (Triton) and FlashQLA (TileLang) compile on their first call of each configuration: ~35 s per
# head configuration for FLA and 15-130 s per kernel for FlashQLA, which ran the anchors set past a device
# call's 10 minutes. Both compile through on-disk caches that are safe for concurrent processes, so
# compiling every configuration once in parallel worker processes (one per library and group of cases
# sharing head counts and direction) before the timed loop moves that work onto the CPU cores at once.
# Workers run FLA with FLA_CACHE_RESULTS=0: its autotuner's choices, made while workers share the GPU,
# are not persisted, so the timed process still autotunes alone (on compiled kernels).
def prewarm_groups(cases, libs, accuracy_case: bool) -> list:
    """[(lib, [case dicts], accuracy?)]: one job per library and (h_qk, h_v, direction)."""
    from dataclasses import asdict
    groups = {}
    for c in cases:
        groups.setdefault((c.h_qk, c.h_v, c.direction), []).append(asdict(c))
    jobs = []
    for lib in libs:
        jobs += [(lib, cs, False) for cs in groups.values()]
        if accuracy_case:
            jobs.append((lib, [], True))
    return jobs


def prewarm(cases, libs, accuracy_case: bool, jobs: int) -> float:
    """Compile the competitors' kernels for `cases` in up to `jobs` parallel processes; returns seconds."""
    t0 = time.perf_counter()
    todo = prewarm_groups(cases, libs, accuracy_case)
    n_jobs = len(todo)
    env = dict(os.environ, FLA_CACHE_RESULTS="0")
    running, failed = [], 0
    while todo or running:
        while todo and len(running) < max(1, jobs):
            lib, cs, acc = todo.pop(0)
            spec = json.dumps({"lib": lib, "cases": cs, "accuracy": acc})
            log = tempfile.TemporaryFile(mode="w+")   # compilers log a lot: a pipe could fill and block
            running.append((subprocess.Popen([sys.executable, "-m", "flashqla.bench", "prewarm-worker", spec],
                                             env=env, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(0.5)
        for pr, log in [r for r in running if r[0].poll() is not None]:
            running.remove((pr, log))
            if pr.returncode != 0:
                failed += 1
                log.seek(0)
                print(f"    prewarm worker failed (rc {pr.returncode}): {log.read()[-400:]}", flush=True)
            log.close()
    dt = time.perf_counter() - t0
    print(f"prewarm: {n_jobs} jobs in {dt:.0f} s ({failed} failed; "
          "a failure only means that library compiles in the timed loop)", flush=True)
    return dt


def prewarm_worker(spec: str) -> int:
    import torch
    s = json.loads(spec)
    libs = load_libs([s["lib"]], "cuda")
    impl = libs[s["lib"]]
    if isinstance(impl, str):
        return 0                                  # not installed: nothing to compile
    for cd in s["cases"]:
        case = Case(**{**cd, "seqlens": tuple(cd["seqlens"])})
        build_fn(s["lib"], impl, case, make_inputs(case, "cuda"))()
        torch.cuda.synchronize()
    if s["accuracy"]:                             # the accuracy step runs each library's autograd API
        accuracy({s["lib"]: impl}, "cuda")
    return 0


# --------------------------------------------------------------------------- accuracy
def _rel(a, r) -> float:
    a, r = a.detach().double().cpu(), r.detach().double().cpu()
    n = float(r.norm())
    return float((a - r).norm()) / n if n > 0 else float((a - r).norm())


def accuracy(libs: dict, device: str, seqlens=(300,), h_qk: int = 2, h_v: int = 4, strong_decay: bool = False) -> tuple:
    """Relative L2 errors against the float64 token recurrence (o, final state, and gradients with random do,
    dht). Returns ({lib: {key: err}}, [errors]). Under FLASHQLA_BENCH_L2NORM=1 the libraries normalise q, k in the
    kernel, and so does the reference (dq, dk are then the gradients with respect to the raw rows)."""
    import torch
    from flashqla.reference import recurrent_gdn
    case = Case("fwd", "accuracy", h_qk, h_v, "+".join(map(str, seqlens)), tuple(seqlens), no_decay_heads=True)
    d = make_inputs(case, device, seed=1, strong_decay=strong_decay)
    ref_leaves = [d[n].detach().cpu().double().requires_grad_(True) for n in _LEAVES]
    with torch.enable_grad():
        o_r, ht_r = recurrent_gdn(*ref_leaves[:5], scale=d["scale"], initial_state=ref_leaves[5],
                                  output_final_state=True, cu_seqlens=d["cu_cpu"],
                                  use_qk_l2norm_in_kernel=_e2e_l2norm())
        grads_r = torch.autograd.grad((o_r, ht_r), ref_leaves, (d["do"].cpu().double(), d["dht"].cpu().double()))
    res, errs = {}, []
    for lib, impl in libs.items():
        if isinstance(impl, str) or impl.get("api") is None:
            continue
        try:
            leaves = [d[n].detach().clone().requires_grad_(True) for n in _LEAVES]
            with torch.enable_grad():
                o, ht = _autograd_forward(lib, impl, d, leaves)
                grads = torch.autograd.grad((o, ht), leaves, (d["do"], d["dht"]), allow_unused=True)
            row = {"o": _rel(o, o_r), "final_state": _rel(ht, ht_r)}
            for n, gr, gref in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_r):
                if gr is not None:
                    row[n] = _rel(gr, gref)
            bad = [k for k, x in row.items() if not math.isfinite(x)]
            if bad:
                raise RuntimeError(f"non-finite error for {bad}")
            res[lib] = row
        except Exception as e:
            errs.append({"lib": lib, "stage": "accuracy" + ("_strong_decay" if strong_decay else ""),
                         "error": _short(e)})
    return res, errs


# --------------------------------------------------------------------------- record
REQUIRED_KEYS = ("commit", "dirty", "gpu", "case_set", "versions", "cases", "accuracy", "sm_count", "driver",
                 "date", "flop_model", "errors")
CASE_KEYS = ("direction", "model", "h_qk", "h_v", "name", "seqlens", "ms", "tflops", "speedup", "errors")


def validate_record(rec: dict) -> dict:
    """Raise ValueError if `rec` misses a key other tools read, or holds a non-positive/non-finite time."""
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if missing:
        raise ValueError(f"record misses keys {missing}")
    for i, c in enumerate(rec["cases"]):
        miss = [k for k in CASE_KEYS if k not in c]
        if miss:
            raise ValueError(f"case {i} misses keys {miss}")
        if c["direction"] not in DIRECTIONS:
            raise ValueError(f"case {i}: bad direction {c['direction']!r}")
        for lib, modes in c["ms"].items():
            if not modes:
                raise ValueError(f"case {i}: empty ms for {lib}")
            for m, t in modes.items():
                if m not in MODES or not isinstance(t, (int, float)) or not (t > 0 and math.isfinite(t)):
                    raise ValueError(f"case {i}: bad time {lib}.{m} = {t!r}")
    json.dumps(rec, allow_nan=False)
    return rec


def _gpu_slug(rec: dict) -> str:
    if rec.get("device") != "cuda" or not rec.get("gpu"):
        return "cpu"
    name = rec["gpu"].lower().replace("nvidia", "").strip()
    return "".join(ch if ch.isalnum() else "-" for ch in name.split()[0] if ch) if name else "gpu"


def results_dir() -> Path:
    root = REPO_ROOT if (REPO_ROOT / "benchmarks").is_dir() else Path.cwd()
    return root / "benchmarks" / "results"


def default_out(rec: dict) -> Path:
    stamp = rec["date"].replace("-", "").replace(":", "")
    sets = rec["case_set"].replace(",", "+")
    prefix = _gpu_slug(rec) if rec.get("device") == "cuda" else "cpu-fallback"
    return results_dir() / f"{prefix}-{sets}-{stamp}.json"


# --------------------------------------------------------------------------- rendering
def _f(x, nd=3):
    return "–" if x is None else f"{x:.{nd}f}"


def _libs_in(rec):
    """Libraries measured on at least one case (flashqla always listed first)."""
    seen = {"flashqla"}
    for c in rec["cases"]:
        seen |= set(c["ms"])
    return [lib for lib in LIBS if lib in seen]


def flashqla_bwd_label(kernels: bool) -> str:
    """What flashqla.chunk_gdn_bwd runs in this process (FLASHQLA_BWD_KERNEL=0: the all-PyTorch backward)."""
    if kernels and os.environ.get("FLASHQLA_BWD_KERNEL", "1").strip() != "0":
        if os.environ.get("FLASHQLA_BWD_GRAD", "1").strip() != "0":
            return ("flashqla.chunk_gdn_bwd (both state chains and the chunk-parallel gradient step on the sm_90a "
                    "kernels; with use_qk_l2norm_in_kernel, the l2norm backward by its own kernel)")
        return ("flashqla.chunk_gdn_bwd (both state chains on the sm_90a kernels, the chunk-parallel gradient "
                "step in PyTorch)")
    return "flashqla.chunk_gdn_bwd (the PyTorch chunked backward on the GPU; no backward kernel)"


def _bwd_label(rec) -> str:
    """How flashqla's backward was run in `rec` (older records timed autograd through chunk_gdn)."""
    return rec.get("labels", {}).get("flashqla", {}).get("bwd") or "torch.autograd.grad through flashqla.chunk_gdn"


def _bwd_short(rec) -> str:
    return "autograd through chunk_gdn" if "autograd" in _bwd_label(rec) else "chunk_gdn_bwd"


def render_markdown(rec: dict, heading_level: int = 3) -> str:
    """Markdown tables (forward, backward), then the footer (timing, FLOP model, errors)."""
    libs, h = _libs_in(rec), "#" * heading_level
    comps = [c for c in COMPETITORS if c in libs]
    cpu = rec.get("device") != "cuda"
    lines = []
    if rec.get("partial"):
        lines += [f"**Partial record**: the run stopped at its time limit after {len(rec['cases'])} cases; the cases "
                  "not listed were not measured in it.", ""]
    if cpu:
        lines += ["**CPU fallback timings** (time.perf_counter medians of the PyTorch implementation): these are "
                  "not kernel timings, which need a Hopper (sm_90) GPU.", ""]
    for direction, title in DIRECTIONS.items():
        cs = [c for c in rec["cases"] if c["direction"] == direction]
        if not cs:
            continue
        modes = ("eager",) if cpu else MODES
        hdr = ["model (h_qk/h_v)" if direction == "fwd" else "heads", "seqlens"]
        for lib in libs:
            hdr += [f"{LABELS[lib]} {m} ms" for m in modes]
        hdr += [f"vs {LABELS[c]}" for c in comps] + ["flashqla TFLOP/s"]
        lines += [f"{h} {title}" + (f" (flashqla = {_bwd_short(rec)})" if direction == "bwd" else ""), "",
                  "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for c in cs:
            row = [c["model"], c["name"]]
            for lib in libs:
                row += [_f(c["ms"].get(lib, {}).get(m)) for m in modes]
            for comp in comps:
                sp = c["speedup"].get(comp, {})
                row.append(" / ".join(f"{sp[m]:.2f}x" if m in sp else "–" for m in modes))
            tf = c["tflops"].get("flashqla", {})
            row.append(_f(tf.get("graph", tf.get("eager")), 1 if not cpu else 3))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    n_err = sum(len(c["errors"]) for c in rec["cases"]) + len(rec.get("errors", []))
    ac = rec.get("accuracy_case", {})
    for key, what in (("accuracy", "g = logsigmoid(randn)/16"),
                      ("accuracy_strong_decay", "strong decay: g = -5 U(0, 1) per token, one head g = 0")):
        acc = rec.get(key) or {}
        if not acc:
            continue
        keys = [k for k in ACCURACY_KEYS if any(k in r for r in acc.values())]
        lines += [f"{h} Accuracy: relative L2 error vs float64 recurrence "
                  f"(seqlens {ac.get('seqlens')}, h_qk={ac.get('h_qk')}, h_v={ac.get('h_v')}, with h0 and dht; {what})",
                  "", "| library | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
        for lib in LIBS:
            if lib in acc:
                lines.append(f"| {LABELS[lib]} | " + " | ".join(
                    f"{acc[lib][k]:.1e}" if k in acc[lib] else "–" for k in keys) + " |")
        lines.append("")
    v = rec.get("versions", {})
    timing = ("time.perf_counter median on CPU" if cpu else
              "eager = triton.testing.do_bench(warmup=25, rep=100) median over CUDA events; graph = "
              "do_bench_cudagraph(rep=100) median of CUDA-graph replays")
    where = (f"{rec.get('gpu')} ({rec.get('sm_count') or '?'} SMs, driver {rec.get('driver') or '?'})"
             if not cpu else "CPU fallback")
    lines += [f"{where}, "
              f"{rec['date']}, commit {str(rec['commit'])[:12]}{' (dirty)' if rec.get('dirty') else ''}, "
              f"case set `{rec['case_set']}`; torch {v.get('torch')}, triton {v.get('triton')}, "
              f"FLA {v.get('fla') or 'not installed'}, FlashQLA {v.get('flash_qla') or 'not installed'}; flashqla path: {rec.get('flashqla_path', '?')}.",
              "",
              f"Times in ms ({timing}). 'vs X' = X's time / flashqla's time (eager / graph; > 1: flashqla faster). "
              "FLA = FLA Triton path (FLA_FLASH_QLA=0); FlashQLA = flash_qla (TileLang). Backward: FLA and FlashQLA "
              "run their low-level backward given their own forward's intermediates; flashqla's backward is "
              f"{_bwd_label(rec)}."
              + (" Forward + backward: each library's autograd API, the forward then torch.autograd.grad of o and "
                 "the final state." if any(c["direction"] == "e2e" for c in rec["cases"]) else "")
              + " '–' = not measured"
              + (f" ({n_err} errors in the record)." if n_err else "."),
              "", f"FLOP model: {rec.get('flop_model', FLOP_MODEL)}", ""]
    return "\n".join(lines)


def render_console(rec: dict) -> str:
    """Short plain-text table for stdout: best time per library (graph if measured, else eager) and speed-ups."""
    libs = _libs_in(rec)
    comps = [c for c in COMPETITORS if c in libs]
    out = [f"{'dir':3} {'model':24} {'seqlens':12} " + " ".join(f"{LABELS[lib][:9]:>9}" for lib in libs)
           + "".join(f" {'vs ' + LABELS[c][:6]:>9}" for c in comps)]
    best = lambda m: m.get("graph", m.get("eager")) if m else None  # noqa: E731
    for c in rec["cases"]:
        b = {lib: best(c["ms"].get(lib)) for lib in libs}
        sp = "".join(f" {b[cp] / b['flashqla']:>8.2f}x" if b.get(cp) and b.get("flashqla") else f" {'–':>9}"
                     for cp in comps)
        out.append(f"{c['direction']:3} {c['model'][:24]:24} {c['name'][:12]:12} "
                   + " ".join(f"{b[lib]:9.3f}" if b[lib] else f"{'–':>9}" for lib in libs) + sp)
    for direction in DIRECTIONS:
        for cp in comps:
            r = [c["ms"][cp].get("graph", c["ms"][cp]["eager"]) / c["ms"]["flashqla"].get(
                 "graph", c["ms"]["flashqla"]["eager"]) for c in rec["cases"]
                 if c["direction"] == direction and cp in c["ms"] and "flashqla" in c["ms"]]
            if r:
                gm = math.exp(sum(math.log(x) for x in r) / len(r))
                out.append(f"geomean {direction} {LABELS[cp]}/flashqla: {gm:.2f}x over {len(r)} cases")
    return "\n".join(out)


def make_plot(rec: dict, path) -> Path:
    """Latency per case (graph replay where measured, hatched bars = eager), grouped by head configuration,
    one panel per direction."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    libs = _libs_in(rec)
    dirs = [d for d in DIRECTIONS if any(c["direction"] == d for c in rec["cases"])]
    n_max = max([sum(c["direction"] == d for c in rec["cases"]) for d in dirs] or [1])
    fig, axes = plt.subplots(len(dirs) or 1, 1, figsize=(min(60, max(8, 2 + 0.16 * n_max * len(libs))),
                                                         4.2 * max(1, len(dirs))), squeeze=False)
    colors = {"flashqla": "#d62728", "fla_triton": "#1f77b4", "flash_qla_tilelang": "#2ca02c"}
    width = 0.8 / max(1, len(libs))
    for ax, d in zip(axes[:, 0], dirs):
        cs = [c for c in rec["cases"] if c["direction"] == d]
        for j, lib in enumerate(libs):
            for i, c in enumerate(cs):
                m = c["ms"].get(lib)
                if not m:
                    continue
                t, eager = (m["graph"], False) if "graph" in m else (m["eager"], True)
                ax.bar(i + (j - (len(libs) - 1) / 2) * width, t, width, color=colors[lib],
                       hatch="//" if eager else None, edgecolor="white" if eager else None,
                       label=LABELS[lib] if i == 0 or not any(cc["ms"].get(lib) for cc in cs[:i]) else None)
        ax.set_xticks(range(len(cs)))
        ax.set_xticklabels([c["name"] for c in cs], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms (lower is better)")
        ts = [t for c in cs for m in c["ms"].values() for t in m.values()]
        if ts and max(ts) / min(ts) > 30:
            ax.set_yscale("log")
        start = 0
        for i in range(1, len(cs) + 1):   # head-configuration groups
            if i == len(cs) or cs[i]["model"] != cs[start]["model"]:
                if i < len(cs):
                    ax.axvline(i - 0.5, color="grey", lw=0.6)
                ax.text((start + i - 1) / 2, 1.01, cs[start]["model"], transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=7)
                start = i
        ax.set_xlim(-0.6, len(cs) - 0.4)
        title = f"Backward (flashqla: {_bwd_short(rec)})" if d == "bwd" else DIRECTIONS[d]
        sub = ("bars: CUDA-graph replay, hatched: eager" if rec.get("device") == "cuda" else
               "CPU fallback timings (perf_counter), not kernel timings")
        ax.set_title(f"{title} - {rec.get('gpu') or 'CPU'} - {sub}", fontsize=9, pad=14)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- README
def newest_record(directory=None) -> Path:
    """Newest complete GPU record (by its 'date', then file mtime) under benchmarks/results/; CPU records are
    ignored; records cut short by a time limit ('partial'), subset runs (--match), runs of fewer libraries
    (--libs: A/B runs) and runs of one direction count only when there is no complete one."""
    best = None
    for p in Path(directory or results_dir()).glob("*.json"):
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or rec.get("device", "cuda") != "cuda" or "cases" not in rec:
            continue
        dirs = {c.get("direction") for c in rec["cases"]}
        key = (not rec.get("partial", False), not rec.get("match"), set(LIBS) <= set(rec.get("libs") or LIBS),
               {"fwd", "bwd"} <= dirs, str(rec.get("date", "")), p.stat().st_mtime)
        if best is None or key > best[0]:
            best = (key, p)
    if best is None:
        raise FileNotFoundError(f"no GPU benchmark record under {directory or results_dir()}")
    return best[1]


def readme_section(rec: dict, source: str | None = None) -> str:
    src = f" (`{source}`)" if source else ""
    return (f"<!-- generated by `python -m flashqla.bench readme` from {rec['date']}'s record{src}; "
            f"do not edit by hand -->\n\n" + render_markdown(rec, heading_level=3).rstrip() + "\n")


def update_readme(readme, record_path=None) -> Path:
    """Rewrite the text between README_START and README_END in `readme` from a record (default: newest)."""
    readme = Path(readme)
    record_path = Path(record_path) if record_path else newest_record()
    rec = validate_record(json.loads(record_path.read_text()))
    text = readme.read_text()
    i, j = text.find(README_START), text.find(README_END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"{readme} lacks the markers {README_START} ... {README_END}")
    try:
        src = record_path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        src = record_path.name
    new = text[: i + len(README_START)] + "\n" + readme_section(rec, src) + text[j:]
    readme.write_text(new)
    return readme


def merge_records(recs: list) -> dict:
    """One record from several runs of the same tree on the same device (e.g. a case set split with --match to fit
    a time limit): cases and errors concatenated, the first non-empty accuracy, the first run's metadata."""
    if not recs:
        raise ValueError("nothing to merge")
    for r in recs[1:]:
        for key in ("device", "gpu", "commit", "flashqla_path"):
            if r.get(key) != recs[0].get(key):
                raise ValueError(f"cannot merge records with different {key}: {recs[0].get(key)!r} vs {r.get(key)!r}")
    out = json.loads(json.dumps(recs[0]))
    sets = []
    for r in recs:
        sets += [x for x in r["case_set"].split(",") if x not in sets]
    out["case_set"] = ",".join(sets)
    out["cases"] = [c for r in recs for c in r["cases"]]
    out["errors"] = [e for r in recs for e in r.get("errors", [])]
    out["accuracy"] = next((r["accuracy"] for r in recs if r.get("accuracy")), {})
    strong = next((r["accuracy_strong_decay"] for r in recs if r.get("accuracy_strong_decay")), None)
    if strong:
        out["accuracy_strong_decay"] = strong
    acc_case = next((r.get("accuracy_case") for r in recs if r.get("accuracy")), None)
    if acc_case:
        out["accuracy_case"] = acc_case
    out["merged_from"] = [r["date"] for r in recs]
    out.pop("match", None)
    return validate_record(out)


# --------------------------------------------------------------------------- anchor check
ANCHORS_JSON = REPO_ROOT.parent / "shared" / "anchors" / "h200-2026-11-30.json"
_ANCHOR_LIBS = {"fla_triton": "fla", "flash_qla_tilelang": "flashqla"}


def compare_anchors(rec: dict, anchors: dict, tol: float = 0.15) -> str:
    """Markdown: each competitor time in `rec` divided by the same case's time in the shared anchors file
    (issue 3's check: within `tol`, else the protocol differs)."""
    rows, n_ok, n_all, outliers = [], 0, 0, []
    for c in rec["cases"]:
        if c["direction"] not in ("fwd", "bwd"):   # the anchors have no end-to-end figures
            continue
        key = "forward_ms" if c["direction"] == "fwd" else "backward_ms"
        model = c["model"].split(" ")[0]
        match = [a for a in anchors.get(key, []) if a["model"] == model and a["seqs"] == c["name"]]
        if not match:
            continue
        a = match[0]
        cells = []
        for lib, alib in _ANCHOR_LIBS.items():
            for mode in MODES:
                ours, ref = c["ms"].get(lib, {}).get(mode), a.get(f"{alib}_{mode}")
                if ours is None or ref is None:
                    cells.append("–")
                    continue
                r = ours / ref
                n_all += 1
                ok = abs(r - 1) <= tol
                n_ok += ok
                if not ok:
                    outliers.append(f"{c['direction']} {c['model']} {c['name']} {LABELS[lib]} {mode}")
                cells.append(f"{r:.2f}" + ("" if ok else " *"))
        rows.append(f"| {c['direction']} | {c['model']} | {c['name']} | " + " | ".join(cells) + " |")
    hdr = [f"{LABELS[lib]} {m}" for lib in _ANCHOR_LIBS for m in MODES]
    out = [f"Record {rec.get('date')} (commit {str(rec.get('commit'))[:12]}) against the shared anchors: "
           f"time in the record / time in the anchors; * = outside +-{tol:.0%}.", "",
           "| dir | model | seqlens | " + " | ".join(hdr) + " |", "|" + "---|" * (3 + len(hdr))] + rows
    out += ["", f"{n_ok} of {n_all} figures within +-{tol:.0%}."]
    if outliers:
        out += ["", "Outside: " + "; ".join(outliers) + "."]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- CLI
def _pick_device(arg: str) -> str:
    import torch
    if arg != "auto":
        return arg
    return "cuda" if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) else "cpu"


def run(args) -> dict:
    import torch
    import flashqla
    device = _pick_device(args.device)
    sets = [s.strip() for s in (args.cases or ("anchors" if device == "cuda" else "smoke")).split(",") if s.strip()]
    for s in sets:
        if s not in CASE_SETS:
            raise SystemExit(f"unknown case set {s!r}; choose from {', '.join(CASE_SETS)}")
    if device == "cpu":
        print("No sm_90 (Hopper) GPU in use: running the 'smoke' set on the CPU fallback. These are CPU timings of "
              "the PyTorch implementation, not kernel timings; kernel timings need a Hopper GPU (H100/H200).",
              flush=True)
        if sets != ["smoke"]:
            print(f"  (case sets {sets} are GPU sets; replaced by 'smoke')", flush=True)
            sets = ["smoke"]
    elif torch.cuda.get_device_capability() != (9, 0):
        print(f"warning: {torch.cuda.get_device_name()} is not sm_90; competitor and flashqla paths may differ",
              flush=True)
    requested = [x.strip() for x in args.libs.split(",") if x.strip()]
    bad = [x for x in requested if x not in LIBS]
    if bad or "flashqla" not in requested:
        raise SystemExit(f"--libs must include flashqla and only names from {','.join(LIBS)} (got {args.libs})")
    libs = load_libs(requested, device)
    for lib, impl in libs.items():
        if isinstance(impl, str):
            print(f"skipping {lib}: {impl}", flush=True)
    meta = record_meta(device)
    kernels = flashqla.kernels_available(torch.device(device))
    rec = {"schema": SCHEMA_VERSION, **meta, "device": device, "case_set": ",".join(sets), "libs": requested,
           "flashqla_path": ("sm90a kernels" if kernels else
                             "PyTorch chunked implementation" + (" on the GPU" if device == "cuda" else
                                                                 " (CPU fallback)")),
           "timing": ({"eager": "triton.testing.do_bench(fn, warmup=25, rep=100, return_mode='median') [ms]",
                       "graph": "triton.testing.do_bench_cudagraph(fn, rep=100, return_mode='median') [ms]",
                       "clocks": "per case, library and mode where NVML answers: the SM clock's median and minimum "
                                 "[MHz] and the board power's median [W], sampled every 20 ms while that time was "
                                 "taken (flashqla._nvml)"}
                      if device == "cuda" else
                      {"eager": f"CPU fallback: time.perf_counter median of {args.cpu_reps} calls after 1 warm-up "
                                "[ms]; not a kernel timing"}),
           "labels": {"flashqla": {"fwd": "flashqla.chunk_gdn",
                                   "bwd": flashqla_bwd_label(kernels)},
                      "fla_triton": {"fwd": "fla chunk_gated_delta_rule_fwd (FLA_FLASH_QLA=0)",
                                     "bwd": "fla chunk_gated_delta_rule_bwd given its forward's g cumsum and A"},
                      "flash_qla_tilelang": {"fwd": "flash_qla.chunk_gated_delta_rule_fwd",
                                             "bwd": "flash_qla.chunk_gated_delta_rule_bwd given its forward's "
                                                    "g cumsum and A"}},
           "inputs": "bf16 l2-normalised q/k, bf16 v, fp32 g = logsigmoid(randn)/16 with a quarter of the value "
                     "heads at g = 0, fp32 beta = sigmoid(rand), fp32 h0, do (bf16), dht = randn/8, varlen B = 1, "
                     "int32 cu_seqlens, K = V = 128, seed 0 per case",
           "flop_model": FLOP_MODEL,
           "flop_per_chunk_head": {"fwd": flops_per_chunk("fwd"), "bwd": flops_per_chunk("bwd"),
                                   "bwd_main": bwd_main_flops(), "bwd_recompute": bwd_recompute_flops()},
           "cases": [], "accuracy": {}, "errors": [
               {"lib": lib, "stage": "import", "error": impl} for lib, impl in libs.items() if isinstance(impl, str)]}
    for lib in ("fla_triton", "flash_qla_tilelang"):
        impl = libs.get(lib)
        if isinstance(impl, dict) and impl.get("version"):
            rec["versions"]["fla" if lib == "fla_triton" else "flash_qla"] = impl["version"]
    cases = [c for s in sets for c in cases_for(s, fwd=not args.bwd_only, bwd=not args.fwd_only)]
    if args.match:
        import re
        pat = re.compile(args.match)
        cases = [c for c in cases if pat.search(f"{c.direction} {c.model} {c.name}")]
        rec["match"] = args.match
    print(f"{len(cases)} cases on {rec['gpu'] or 'CPU'}; libs: "
          f"{[lib for lib, i in libs.items() if not isinstance(i, str)]}; flashqla path: {rec['flashqla_path']}",
          flush=True)
    t_start = time.perf_counter()
    warm = [lib for lib in COMPETITORS if isinstance(libs.get(lib), dict)]
    if args.prewarm > 0 and device == "cuda" and warm:
        rec["prewarm_s"] = round(prewarm(cases, warm, not args.no_accuracy, args.prewarm), 1)
    if args.prewarm_only:
        return None  # (the compile caches are warm: a later run in this machine's life times at once)
    for i, c in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {c.direction} {c.model} {c.name} (h_qk={c.h_qk}, h_v={c.h_v}, "
              f"T={c.tokens})", flush=True)
        entry = run_case(c, libs, device, graph=not args.no_graph, cpu_reps=args.cpu_reps)
        rec["cases"].append(entry)
        _checkpoint(rec, args)
        print("    " + "  ".join(f"{lib} " + "/".join(f"{t:.3f}" for t in m.values()) for lib, m in
                                 entry["ms"].items()) + " ms", flush=True)
        if entry.get("clocks"):  # (the SM clock's median while each time was taken: eager / graph)
            print("    SM MHz " + "  ".join(f"{lib} " + "/".join(f"{v['sm_mhz']:.0f}" for v in m.values())
                                          for lib, m in entry["clocks"].items()), flush=True)
    if not args.no_accuracy:
        print("accuracy vs float64 recurrence (T=300, h_qk=2, h_v=4) ...", flush=True)
        rec["accuracy_case"] = {"seqlens": [300], "h_qk": 2, "h_v": 4, "reference": "flashqla.reference."
                                "recurrent_gdn in float64 on CPU, autograd for gradients"}
        rec["accuracy"], acc_err = accuracy(libs, device)
        rec["errors"] += acc_err
        print("accuracy under strong decay (g = -5 U(0, 1) per token, one head g = 0) ...", flush=True)
        rec["accuracy_strong_decay"], acc_err = accuracy(libs, device, strong_decay=True)
        rec["errors"] += acc_err
    rec["wall_s"] = round(time.perf_counter() - t_start, 1)
    validate_record(rec)
    return rec


def _checkpoint(rec, args):
    """Write the record so far (marked partial) after every case, so a run cut short by a
    time limit still leaves its measured cases in the record file and in $OUT."""
    part = dict(rec, partial=True)
    out = Path(args.out) if args.out else default_out(rec)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(part, indent=1, allow_nan=False) + "\n"
    out.write_text(text)
    dest = os.environ.get("OUT")
    if dest and Path(dest).resolve() != out.parent.resolve():
        (Path(dest) / out.name).write_text(text)


def _save(rec, args):
    out = Path(args.out) if args.out else default_out(rec)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1, allow_nan=False) + "\n")
    table = Path(args.table) if args.table else out.with_suffix(".md")
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text(render_markdown(rec, heading_level=2))
    written = [out, table]
    try:
        written.append(make_plot(rec, args.plot or out.with_suffix(".png")))
    except ImportError as e:
        print(f"no plot: {e} (pip install matplotlib)", flush=True)
    dest = os.environ.get("OUT")
    if dest:
        for p in written:
            target = Path(dest) / p.name
            try:
                if target.exists() and target.samefile(p):
                    continue
                shutil.copy2(p, target)
            except OSError as e:
                print(f"could not copy {p} to $OUT: {e}", flush=True)
    return written


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = (argv.pop(0) if argv and argv[0] in ("run", "readme", "merge", "anchors-check", "fingerprint", "prewarm-worker")
           else "run")
    if cmd == "prewarm-worker":
        return prewarm_worker(argv[0])
    if cmd == "fingerprint":
        ap = argparse.ArgumentParser(prog="python -m flashqla.bench fingerprint",
                                     description="The digest of the kernel sources (csrc/): of the working tree, a "
                                                 "commit, a built extension, or a record checked against its commit.")
        g = ap.add_mutually_exclusive_group()
        g.add_argument("--rev", help="a commit (git)")
        g.add_argument("--so", help="a built extension (flashqla/_C*.so)")
        g.add_argument("--record", help="a record: exit 1 unless its kernel_sources match its commit's")
        a = ap.parse_args(argv)
        if a.record:
            rec = json.loads(Path(a.record).read_text())
            want, got = _fingerprint.commit_fingerprint(str(rec.get("commit")), REPO_ROOT), rec.get("kernel_sources")
            ok = want is not None and got == want
            print(f"{a.record}: commit {str(rec.get('commit'))[:12]} sources {want}, timed extension {got}: "
                  + ("match" if ok else "MISMATCH (or unknown)"))
            return 0 if ok else 1
        fp = (_fingerprint.commit_fingerprint(a.rev, REPO_ROOT) if a.rev
              else _fingerprint.extension_fingerprint(a.so) if a.so else _fingerprint.tree_fingerprint(REPO_ROOT))
        print(fp)
        return 0 if fp else 1
    if cmd == "anchors-check":
        ap = argparse.ArgumentParser(prog="python -m flashqla.bench anchors-check",
                                     description="Compare a record's FLA/FlashQLA times with the shared anchors.")
        ap.add_argument("record")
        ap.add_argument("--anchors", default=str(ANCHORS_JSON))
        ap.add_argument("--out", help="also write the markdown here")
        a = ap.parse_args(argv)
        text = compare_anchors(json.loads(Path(a.record).read_text()), json.loads(Path(a.anchors).read_text()))
        print(text, end="")
        if a.out:
            Path(a.out).write_text(text)
        return 0
    if cmd == "merge":
        ap = argparse.ArgumentParser(prog="python -m flashqla.bench merge",
                                     description="Merge records of split runs (same tree, same device) into one.")
        ap.add_argument("records", nargs="+")
        ap.add_argument("--out")
        ap.add_argument("--plot")
        ap.add_argument("--table")
        a = ap.parse_args(argv)
        rec = merge_records([json.loads(Path(p).read_text()) for p in a.records])
        print(render_console(rec))
        print("wrote " + ", ".join(str(p) for p in _save(rec, a)), flush=True)
        return 0
    if cmd == "readme":
        ap = argparse.ArgumentParser(prog="python -m flashqla.bench readme",
                                     description="Regenerate README.md's benchmark section from a record.")
        ap.add_argument("--record", help="record JSON (default: newest GPU record under benchmarks/results/)")
        ap.add_argument("--readme", default=str(REPO_ROOT / "README.md"))
        a = ap.parse_args(argv)
        p = update_readme(a.readme, a.record)
        print(f"updated {p}")
        return 0
    ap = argparse.ArgumentParser(prog="python -m flashqla.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None, help="comma list of anchors, flashqla, smoke "
                                                  "(default: anchors on an sm_90 GPU, else smoke)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--fwd-only", action="store_true")
    g.add_argument("--bwd-only", action="store_true")
    ap.add_argument("--match", help="only cases whose '<dir> <model> <seqlens>' matches this regex, "
                                    "e.g. 'fwd TP1' or 'bwd hk4_hv8 8k'")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the accuracy check")
    ap.add_argument("--libs", default=",".join(LIBS))
    ap.add_argument("--prewarm", type=int, default=0, metavar="N",
                    help="compile FLA's and FlashQLA's kernels for the chosen cases in N parallel processes "
                         "before timing (GPU only; 0 = compile on first call in the timed loop)")
    ap.add_argument("--prewarm-only", action="store_true",
                    help="compile as --prewarm does, then stop: no timing, no record (h200.sh runs it beside the "
                         "GPU tests, so that the record's own call finds the caches warm)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--cpu-reps", type=int, default=5, help="timed calls per case on CPU")
    ap.add_argument("--out", help="record path (default benchmarks/results/<gpu>-<sets>-<UTC time>.json)")
    ap.add_argument("--plot", help="PNG path (default: next to the record)")
    ap.add_argument("--table", help="markdown path (default: next to the record)")
    a = ap.parse_args(argv)
    rec = run(a)
    if rec is None:  # --prewarm-only
        return 0
    written = _save(rec, a)
    print("\n" + render_console(rec))
    if rec["accuracy"]:
        for lib, r in rec["accuracy"].items():
            print(f"accuracy {lib}: " + " ".join(f"{k}={x:.1e}" for k, x in r.items()))
    n_err = sum(len(c["errors"]) for c in rec["cases"]) + len(rec["errors"])
    if n_err:
        print(f"{n_err} errors recorded (see 'errors' in the record)")
    if rec["device"] != "cuda":
        print("CPU fallback timings only: kernel timings need a Hopper GPU (run there: python -m flashqla.bench).")
    print("wrote " + ", ".join(str(p) for p in written), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
