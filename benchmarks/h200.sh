#!/usr/bin/env bash
# One call on the H200 machine does the whole job: install the carried wheels,
# build flashqla, run the GPU tests and compute-sanitizer, and run the
# benchmarks. Everything it writes goes to $OUT (default ./out): at most 8 files
# (h200.log, build.log, tests.log, the cumsum record, the bench record, table,
# plot and log), the most the device tool brings back.
#
#   FLASHQLA_COMMIT=<40-hex sha> FLASHQLA_SOURCES=<digest> bash benchmarks/h200.sh   (carry .whl/build and .whl/fla[,qla];
#   the digest: `python -m flashqla.bench fingerprint --rev <sha>` here)
# Put the sha in the command literally (expand it on the machine that has the checkout): the H200's copy of
# the tree can carry a stale .git whose HEAD is another commit. When that .git knows the commit, the tree is
# checked against it here and a difference marks the record dirty.
#
# REQUIRE_GPU=H200 makes the script stop (exit 3) on any other card, before any stage.
# Stages (STAGES, comma-separated; default build,test,cmake,phases,probe,cumsum,bench,sanitize, run in this order):
#   z3        install .whl/z3 into $SITE only (FlashQLA needs it; it does not fit in one carry with the rest)
# Kernel caches: TileLang (FlashQLA compiles each shape, ~15 s) and Triton (FLA) compile into /tmp/kcache,
# which survives between calls while the machine is warm. Any stage first unpacks carried caches,
# .whl/kcache/*.tar.{gz,xz}; CACHE_SAVE=1 packs /tmp/kcache at the end, one xz tarball per cache
# ($OUT/kcache-tilelang.tar.xz, kcache-triton.tar.xz: the device tool brings back files of 16 MiB at most, and
# session 13's one gzip tarball of both was 42 MB), for a later session to carry (in the z3 call, whose 28 MB
# of wheels leave ~36 MB).
#   build     pip-install carried wheels into $SITE, build the extension (MAX_JOBS=16), unless a carried build (or
#             one an earlier call of this machine start left in /tmp/flashqla-build) has FLASHQLA_SOURCES' digest
#   test      pytest tests (GPU tests run here)
#   cmake     libflashqla + the C++ examples through CMake, run by ctest on the GPU
#   sanitize  compute-sanitizer memcheck + racecheck on small kernel calls
#   phases    per-phase cycle counts of the forward kernels and the backward's chains (benchmarks/profile_fwd_phases.cu;
#             PHASE_DEFS="-DX=1;-DX=0" builds and runs it once per flag set; PHASE_ARGS="shape T hq hv": the O-beside
#             chain alone at that dense shape, beside the prep workers and with FLASHQLA_OVERLAP=0; "pair B T hq hv":
#             the paired chain's state warpgroup and producer at a dense B x T batch, operand mode on and off; the
#             variants stage's phases step passes PHASE_ARGS too)
#   gradphases  per-phase cycle counts of the backward's gradient kernel (benchmarks/profile_bwd_grad_phases.cu;
#             GRAD_PHASE_DEFS="-DX=1;-DX=0" builds and runs it once per flag set)
#   scanphases  per-phase cycle counts of exact parallelism's scan (benchmarks/profile_scan_phases.cu; SCAN_PHASE_ARGS)
#   probe     the state chain with wgmma vs mma.sync (benchmarks/wgmma_chain_probe.cu), and a chunk's loads by cp.async
#             vs TMA with the swizzles compared (benchmarks/tma_load_probe.cu)
#   syncprobe compute-sanitizer synccheck (and racecheck) on the O-beside chain's stage protocol alone
#             (benchmarks/synccheck_probe.cu): do the tools accept the kernel's bar.arrive / bar.sync pattern?
#             (SAN_TOOLS=synccheck runs synccheck on the library)
#   rate      wgmma m64n32 / m64n64 (bf16) and m64n32k8 (tf32) products of depth 128 on one SM: latency alone and the
#             rate with several in flight (benchmarks/wgmma_rate_probe.cu; the fused reverse kernel's budget)
#   cumsum    the cumsum kernel record (benchmarks/bench_cumsum.py)
#   bench     python -m flashqla.bench run --cases $CASES --prewarm $PREWARM $BENCH_ARGS (default anchors; the
#             competitors' kernels compile first in $PREWARM (16) parallel processes, not case by case; with the
#             test stage in the same call, that compile runs beside the tests)
#   ktimes    GPU time per kernel of flashqla's forward and backward on a few anchor cases (benchmarks/kernel_times.py
#             $KTIMES_ARGS, e.g. "--match 'bwd hk16' --launches" for one call's timeline)
#   ncu       Nsight Compute on the v2 forward kernel of the phase profiler: scheduler and warp-state
#             sections, and the source lines with the most stall samples (benchmarks/ncu_source_top.py)
#   ncuscan   the same for exact parallelism's scan kernel (cp_scan_kernel) on a TP8 1 x 8192 forward
#   ncugrad   the same for the backward's gradient kernel (a 1 x 8192, 16/32-head backward on the torch path)
#   ncuprep   the same for the split forward's prep kernel (torch path, TP1 1 x 8192: 16/64 heads)
#   ncucase   Nsight Compute on one kernel of any library's call of an anchor case (NCU_CASE_LIB, NCU_CASE_MATCH,
#             NCU_CASE_KERNEL, NCU_CASE_NAME; ';'-lists run in turn): e.g. FlashQLA's fused forward beside our chain
#   ncuflow   Nsight Compute speed-of-light and memory sections of the split forward's prep and recurrent
#             kernels on the torch path (TP1 1 x 8192): is the recurrent kernel L2-bound? (see NOTES)
#   cp        the TP8/TP4 single-sequence forward cases with FLASHQLA_CP=1 against FLA (record cp-*.json)
#   ab        flashqla alone under each of AB_ENVS's environment variants (';'-separated), one record each
#             (ab-<n>.json, the variant in its env field), e.g. AB_ENVS="FLASHQLA_BWD_GRAD=0;FLASHQLA_BWD_GRAD=1"
#   variants  for each prebuilt variants/<name>/ (benchmarks/build_variants.sh; carry `variants`): swap its
#             _C into flashqla/, run the forward GPU tests, its phase profiler and the benchmark with
#             $VARIANT_BENCH_ARGS (VARIANT_STEPS picks among test,digest,phases,gradphases,ktimes,bench,memcheck,racecheck;
#             gradphases runs the variant's fq_grad_phases (build_variants.sh GRADPHASES=1) with $GRAD_PHASE_ARGS; the test step
#             runs $VARIANT_TEST_PATHS, default tests/test_gpu_fwd.py; digest prints benchmarks/bwd_digest.py's
#             bit-exact fingerprints, to compare builds that should agree); one record per variant, one log
#             (variants.log) for all (not in the default stages). A variant with a SO_FROM file (an earlier
#             variant's name; they run in name order) runs that variant's build: a second sample or another ENV.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out}
SITE=${SITE:-/tmp/site}
STAGES=${STAGES:-build,test,cmake,phases,probe,cumsum,bench,sanitize}
CASES=${CASES:-anchors}
mkdir -p "$OUT" "$SITE"
export PYTHONUNBUFFERED=1 PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/kcache/tilelang} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/kcache/triton}
LOG="$OUT/h200.log"
has() { [[ ",$STAGES," == *",$1,"* ]]; }
say() { echo "== $*" | tee -a "$LOG"; }
# xz without relying on the xz tool being installed there: Python's lzma (one thread) where it is missing
unxz_file() {  # file.xz -> file
  if command -v xz > /dev/null; then xz -d -f "$1"; else
    python3 -c 'import lzma, os, shutil, sys; s = sys.argv[1]; shutil.copyfileobj(lzma.open(s), open(s[:-3], "wb")); os.remove(s)' "$1"; fi
}
tar_xz() {  # output.tar.xz, directory, name inside
  if command -v xz > /dev/null; then tar cf - -C "$2" "$3" | xz -T0 -6 > "$1"; else
    python3 -c 'import sys, tarfile; t = tarfile.open(sys.argv[1], "w:xz", preset=3); t.add(sys.argv[2] + "/" + sys.argv[3], arcname=sys.argv[3]); t.close()' "$1" "$2" "$3"; fi
}
status=0
# A standalone CUDA tool of benchmarks/ (torch-free, sm_90a): source, binary.
cuda_tool() {  # source, binary, extra nvcc flags (e.g. -D switches)
  # (a stage without `build` before it has no CUTLASS headers yet: take them from the carried wheel)
  python3 third_party/cutlass.py > /dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile \
    --target "$SITE" .whl/build/nvidia_cutlass-*.whl 2>&1 | grep -v "^WARNING: Target directory" | tail -2
  nvcc -O3 -lineinfo -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc/include -Icsrc \
       -I"$(python3 third_party/cutlass.py)" ${3:-} "$1" -o "$2" 2>&1 | grep -v "spill" | tail -5 | tee -a "$LOG"
}

# Nsight Compute on one launch of the kernels matching $1 under the command "${@:3}": scheduler, warp-state,
# memory and source sections, the source lines with the most stall samples (benchmarks/ncu_source_top.py), to
# $OUT/$2.txt; the headline figures to the log.
ncu_stalls() {
  local kre=$1 name=$2 ncu
  shift 2
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # the full set: its source page carries the per-line stall sampling the named sections alone did not give
  timeout ${NCU_TIMEOUT:-240} "$ncu" --set full --import-source yes -k regex:"$kre" --launch-count 1 \
    -f -o "/tmp/$name" "$@" > "/tmp/$name-run.log" 2>&1 || { tail -20 "/tmp/$name-run.log" | tee -a "$LOG"; status=1; }
  { "$ncu" -i "/tmp/$name.ncu-rep" --print-summary none --section SchedulerStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters 2>&1 | grep -vE "^\s*$"
    # stall reasons, cycles per issued instruction each
    "$ncu" -i "/tmp/$name.ncu-rep" --page raw --csv 2>/dev/null | python3 -c "
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) >= 3:
    pick = [(h, u, v) for h, u, v in zip(rows[0], rows[1], rows[2])
            if h.startswith('smsp__average_warps_issue_stalled_') and h.endswith('_per_issue_active.ratio')]
    for h, u, v in sorted(pick, key=lambda x: -float(x[2].replace(',', '') or 0))[:14]:
        print('stall %-28s %s' % (h[len('smsp__average_warps_issue_stalled_'):-len('_per_issue_active.ratio')], v))"
    "$ncu" -i "/tmp/$name.ncu-rep" --page source --csv --print-source cuda > "/tmp/$name-source.csv" 2> "/tmp/$name-source.err"
    python3 benchmarks/ncu_source_top.py "/tmp/$name-source.csv" 2>&1 || cat "/tmp/$name-source.err"
    echo "-- SASS instructions with the most stall samples"
    "$ncu" -i "/tmp/$name.ncu-rep" --page source --csv --print-source sass > "/tmp/$name-sass.csv" 2> /dev/null
    python3 benchmarks/ncu_source_top.py "/tmp/$name-sass.csv" 50 2>&1 | head -60
    # (by SASS: the CUDA source page carried no metrics for the kernels' header, session 21)
    echo "-- SASS instructions with the most shared-memory wavefronts lost to bank conflicts"
    python3 benchmarks/ncu_source_top.py "/tmp/$name-sass.csv" 30 "Shared Excessive" 2>&1 | head -35
  } > "$OUT/$name.txt" 2>&1
  grep -E "Duration|Issued Warp|Eligible Warps|Active Warps|Warp Cycles Per Issued|Issue Slots Busy|Memory Throughput|^stall " \
    "$OUT/$name.txt" | tee -a "$LOG"
}

say "$(date -u +%FT%TZ) commit=${FLASHQLA_COMMIT:-unknown} stages=$STAGES"
if [ -n "${FLASHQLA_COMMIT:-}" ] && git cat-file -e "${FLASHQLA_COMMIT}^{commit}" 2>/dev/null; then
  if git diff --quiet "$FLASHQLA_COMMIT" -- csrc flashqla setup.py CMakeLists.txt benchmarks 2>/dev/null; then
    say "tree matches $FLASHQLA_COMMIT"
  else
    export FLASHQLA_DIRTY=1; say "WARNING: the tree differs from FLASHQLA_COMMIT=$FLASHQLA_COMMIT: records marked dirty"
  fi
elif [ -n "${FLASHQLA_COMMIT:-}" ]; then
  say "commit $FLASHQLA_COMMIT unknown to this copy's .git: not checked"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$LOG"
# REQUIRE_GPU=H200: stop at once (exit 3) on any other card. A call that names the H200 kind may get an H100, and a
# record that backs an issue must come from the H200; stopping here spends seconds, not the stages' minutes.
if [ -n "${REQUIRE_GPU:-}" ] && ! nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q "$REQUIRE_GPU"; then
  say "REQUIRE_GPU=$REQUIRE_GPU: this card is not one; nothing run"
  exit 3
fi

for t in .whl/kcache/*.tar.gz .whl/kcache/*.tar.xz; do  # (Python's tarfile reads both without the xz tool)
  [ -f "$t" ] && mkdir -p /tmp/kcache && python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
    "$t" /tmp/kcache && say "unpacked kernel caches $t"
done

if has z3; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/z3/*.whl 2>&1 | tail -2 | tee -a "$LOG"
fi

if has build; then
  say "install carried wheels"
  whls=$(ls .whl/build/*.whl .whl/fla/*.whl .whl/qla/*.whl 2>/dev/null)
  [ -n "$whls" ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" $whls \
    2>&1 | grep -v "^WARNING: Target directory" | tail -3 | tee -a "$LOG"
  # A build made on the development machine and carried (flashqla/_C*.so), or kept in /tmp/flashqla-build by an
  # earlier call of the same machine start (a later call's carry may lack room for it), is used as it is when its
  # digest is FLASHQLA_SOURCES: the compile costs ~84 s of device time
  # (a carried build may come xz-compressed, .whl/so/_C.so.xz: 23 MB -> ~5 MB, room in the carry for the z3 wheels)
  if [ -f .whl/so/_C.so.xz ] && ! ls flashqla/_C.cpython-312-*.so > /dev/null 2>&1; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      .whl/so/_C.so.xz flashqla/_C.cpython-312-x86_64-linux-gnu.so && say "unpacked the carried build .whl/so/_C.so.xz"
  fi
  so=$(ls flashqla/_C.cpython-312-*.so 2>/dev/null | head -1)
  if [ -z "$so" ] && [ -n "${FLASHQLA_SOURCES:-}" ] && ls /tmp/flashqla-build/_C.cpython-312-*.so > /dev/null 2>&1; then
    cp /tmp/flashqla-build/_C.cpython-312-*.so flashqla/ && so=$(ls flashqla/_C.cpython-312-*.so | head -1)
  fi
  carried=""
  [ -n "$so" ] && [ -n "${FLASHQLA_SOURCES:-}" ] && \
    [ "$(python3 -m flashqla.bench fingerprint --so "$so" 2>&1 | tail -1)" = "$FLASHQLA_SOURCES" ] && carried=1
  if [ -n "$carried" ]; then
    say "carried build $so (sources $FLASHQLA_SOURCES): not compiled here"
  else
    say "build"
    t0=$(date +%s)
    MAX_JOBS=16 FLASHQLA_REQUIRE_CUDA=1 python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 \
      || { tail -40 "$OUT/build.log" | tee -a "$LOG"; say "BUILD FAILED"; exit 1; }
    grep -iE "warning|spill" "$OUT/build.log" | grep -v "^W1" | head -20 | tee -a "$LOG"
    say "build took $(( $(date +%s) - t0 )) s"
  fi
  mkdir -p /tmp/flashqla-build && cp flashqla/_C.cpython-312-*.so /tmp/flashqla-build/
  python3 -c "import flashqla, torch; assert flashqla.kernels_available(torch.device('cuda')), 'kernels unavailable'; print('flashqla kernels available on', torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
  # the digest of csrc/ compiled into the extension (records carry it as kernel_sources; compare it here with
  # `python -m flashqla.bench fingerprint --rev <commit>` before trusting a record's commit)
  built=$(python3 -m flashqla.bench fingerprint --so flashqla/_C.cpython-312-*.so 2>&1 | tail -1)
  say "kernel sources $built"
  # FLASHQLA_SOURCES (`python -m flashqla.bench fingerprint --rev <sha>` of FLASHQLA_COMMIT, computed where the
  # checkout is and written into the command): a build from other sources marks the records dirty, as the .git
  # check above does where the copy's .git knows the commit
  if [ -n "${FLASHQLA_SOURCES:-}" ] && [ "$built" != "$FLASHQLA_SOURCES" ]; then
    export FLASHQLA_DIRTY=1; say "WARNING: built from sources $built, not FLASHQLA_SOURCES=$FLASHQLA_SOURCES: records marked dirty"
  fi
fi

warm_pid=""
if has test && has bench && [ "${PREWARM:-16}" -gt 0 ]; then
  # the competitors' compiles (~300 s of CPU on a fresh machine) beside the GPU tests, which time nothing; the bench
  # stage waits for them and then times with warm caches
  say "prewarm $CASES beside the tests"
  timeout ${BENCH_TIMEOUT:-300} python3 -m flashqla.bench run --cases "$CASES" --prewarm ${PREWARM:-16} ${BENCH_ARGS:-} \
    --prewarm-only > /tmp/prewarm.log 2>&1 &
  warm_pid=$!
fi
if has test; then
  say "pytest"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest ${TEST_PATHS:-tests} -q -rs -p no:cacheprovider -s > "$OUT/tests.log" 2>&1
  rc=$?; grep -E "^(FAILED|ERROR)|passed|failed|anchor:|T=32768" "$OUT/tests.log" | tail -30 | tee -a "$LOG"
  [ $rc -eq 0 ] || status=1
fi

if has cmake; then
  say "cmake + ctest"
  { cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release -DPython3_EXECUTABLE="$(command -v python3)" > /dev/null \
    && cmake --build build/cmake -j 16 >> "$OUT/build.log" 2>&1 \
    && ctest --test-dir build/cmake --output-on-failure; } 2>&1 | tail -12 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has phases; then
  # PHASE_DEFS: ';'-separated nvcc flag sets, one build and run each (as GRAD_PHASE_DEFS below)
  IFS=';' read -ra defsets <<< "${PHASE_DEFS:-}"
  [ ${#defsets[@]} -eq 0 ] && defsets=("")
  for defs in "${defsets[@]}"; do
    say "forward v1 phase timers ${defs}"
    cuda_tool benchmarks/profile_fwd_phases.cu /tmp/fq_phases "$defs"
    timeout ${PHASES_TIMEOUT:-150} /tmp/fq_phases ${PHASE_ARGS:-} 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi

if has gradphases; then
  # GRAD_PHASE_DEFS: ';'-separated nvcc flag sets, one build and table each (an A/B of compile-time switches)
  IFS=';' read -ra defsets <<< "${GRAD_PHASE_DEFS:-}"
  [ ${#defsets[@]} -eq 0 ] && defsets=("")
  for defs in "${defsets[@]}"; do
    say "gradient kernel phase timers (GRAD_PHASE_ARGS: T hq hv [a]) ${defs}"
    cuda_tool benchmarks/profile_bwd_grad_phases.cu /tmp/fq_grad_phases "$defs"
    /tmp/fq_grad_phases ${GRAD_PHASE_ARGS:-} 2>&1 | tee -a "$LOG"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi

if has scanphases; then
  # SCAN_PHASE_ARGS: segments heads sequences (default 8 8 1, TP8 1 x 8192's plan); FLASHQLA_SCAN_COLS in the
  # environment picks the slice width as it does for the library
  say "exact parallelism's scan, phase timers (SCAN_PHASE_ARGS: S H seqs) ${SCAN_PHASE_ARGS:-}"
  cuda_tool benchmarks/profile_scan_phases.cu /tmp/fq_scan_phases
  /tmp/fq_scan_phases ${SCAN_PHASE_ARGS:-} 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has probe; then
  say "wgmma chain probe"
  cuda_tool benchmarks/wgmma_chain_probe.cu /tmp/fq_probe
  timeout 60 /tmp/fq_probe 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  say "TMA load probe (a chunk's 64 KB by cp.async or TMA; TMA's 128-byte swizzle against sw128_off)"
  cuda_tool benchmarks/tma_load_probe.cu /tmp/fq_tma_probe
  timeout 60 /tmp/fq_tma_probe 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
if has rate; then
  say "wgmma rate probe (a 64 x N x 128 product: latency alone, rate with products and warpgroups in flight)"
  cuda_tool benchmarks/wgmma_rate_probe.cu /tmp/fq_rate_probe
  timeout 60 /tmp/fq_rate_probe 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has syncprobe; then
  say "synccheck probe (the O-beside stage protocol alone; mode 3 syncs only, 2 is a deliberate mismatch)"
  cuda_tool benchmarks/synccheck_probe.cu /tmp/fq_sync_probe
  for mode in 3 0 1 2 4 5 6; do
    timeout 60 /tmp/fq_sync_probe "$mode" 2>&1 | tee -a "$LOG"
    timeout 120 compute-sanitizer --tool synccheck --print-limit 4 /tmp/fq_sync_probe "$mode" 2>&1 | grep -v "Host Frame" | tail -12 | tee -a "$LOG"
  done
  # and racecheck on the same protocol: does it order a stage's writes and reads through bar.arrive -> bar.sync?
  for mode in 3 0 6; do
    timeout 120 compute-sanitizer --tool racecheck --print-limit 4 /tmp/fq_sync_probe "$mode" 2>&1 | grep -v "Host Frame" | tail -12 | tee -a "$LOG"
  done
fi

if has cumsum; then
  say "cumsum record"
  python3 benchmarks/bench_cumsum.py --out-dir "$OUT" 2>&1 | tail -30 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if has bench; then
  bench_warm=${PREWARM:-16}
  if [ -n "$warm_pid" ]; then
    wait "$warm_pid" && bench_warm=0  # (warm: the timed run compiles nothing; else its own prewarm compiles again)
    tail -2 /tmp/prewarm.log | tee -a "$LOG"
  fi
  say "benchmark $CASES"
  timeout ${BENCH_TIMEOUT:-300} python3 -m flashqla.bench run --cases "$CASES" --prewarm $bench_warm ${BENCH_ARGS:-} \
    --table "$OUT/bench-$CASES.md" --plot "$OUT/bench-$CASES.png" > "$OUT/bench.log" 2>&1
  [ $? -eq 0 ] || status=1
  tail -60 "$OUT/bench.log"
  newest=$(ls -t "$OUT"/*-"${CASES//,/+}"-*.json 2>/dev/null | head -1)
  if [ -n "$newest" ] && [[ ",$CASES," == *",anchors,"* ]] && [ -f ../shared/anchors/h200-2026-11-30.json ]; then
    python3 -m flashqla.bench anchors-check "$newest" 2>&1 | tee -a "$LOG"   # issue 3's +-15% check
  fi
fi
if has ktimes; then
  say "kernel times"
  timeout ${KTIMES_TIMEOUT:-120} python3 benchmarks/kernel_times.py ${KTIMES_ARGS:-} 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
# A python -c script: flashqla.chunk_gdn on random inputs (l2-normalised q, k) of $1 tokens and $2/$3 heads,
# $4 times (default once).
fwd_call_py() {
  cat <<EOF
import torch, torch.nn.functional as F, flashqla
T, hq, hv = $1, $2, $3
q, k = (F.normalize(torch.randn(1, T, hq, 128, device='cuda'), dim=-1).bfloat16() for _ in range(2))
v = torch.randn(1, T, hv, 128, device='cuda').bfloat16()
g = F.logsigmoid(torch.randn(1, T, hv, device='cuda')) / 16
beta = torch.rand(1, T, hv, device='cuda')
for _ in range(${4:-1}): flashqla.chunk_gdn(q, k, v, g, beta, output_final_state=True)
torch.cuda.synchronize()
EOF
}

if has ncu; then
  say "ncu: v2 forward kernel (1 x 8192 tokens, 16/64 heads)"
  [ -x /tmp/fq_phases ] || cuda_tool benchmarks/profile_fwd_phases.cu /tmp/fq_phases  # the phases stage's binary
  ncu_stalls gdn_fwd_mma_kernel ncu /tmp/fq_phases
fi

if has ncuscan; then
  say "ncu: exact parallelism's scan kernel (TP8 1 x 8192: 2/8 heads, 8 segments)"
  ncu_stalls cp_scan_kernel ncuscan python3 -c "$(fwd_call_py 8192 2 8)"
fi
if has ncugrad; then
  say "ncu: the backward's gradient kernel (1 x 8192 tokens, 16/32 heads)"
  ncu_stalls gdn_bwd_grad_kernel ncugrad python3 -c "
import torch, torch.nn.functional as F, flashqla
T, hq, hv = 8192, 16, 32
q, k = (F.normalize(torch.randn(1, T, hq, 128, device='cuda'), dim=-1).bfloat16() for _ in range(2))
v, do = (torch.randn(1, T, hv, 128, device='cuda').bfloat16() for _ in range(2))
g = F.logsigmoid(torch.randn(1, T, hv, device='cuda')) / 16
beta = torch.rand(1, T, hv, device='cuda')
flashqla.chunk_gdn_bwd(q, k, v, g, beta, do)
torch.cuda.synchronize()"
fi

if has ncuprep; then
  say "ncu: the split forward's prep kernel (1 x 8192 tokens, 16/64 heads)"
  ncu_stalls gdn_prep_kernel ncuprep python3 -c "$(fwd_call_py 8192 16 64)"
fi

if has ncucase; then
  # Nsight Compute (ncu_stalls' sections and stall tables) on one kernel of an anchor case, any library's call as the
  # benchmark makes it: NCU_CASE_LIB (flashqla, fla_triton, flash_qla_tilelang), NCU_CASE_MATCH (kernel_times.py's
  # --match), NCU_CASE_KERNEL (ncu's kernel regex), NCU_CASE_NAME (the $OUT file's name); ';'-separated lists of the
  # same length run one after another (e.g. FlashQLA's fused forward kernel and our pair chain on one shape)
  IFS=';' read -ra c_libs <<< "${NCU_CASE_LIB:-flashqla}"
  IFS=';' read -ra c_kern <<< "${NCU_CASE_KERNEL:-gdn_fwd_pair_kernel}"
  IFS=';' read -ra c_names <<< "${NCU_CASE_NAME:-ncucase}"
  c_match=${NCU_CASE_MATCH:-^fwd TP1 .*8192x4}
  if [ "${#c_libs[@]}" -ne "${#c_kern[@]}" ] || [ "${#c_libs[@]}" -ne "${#c_names[@]}" ]; then
    say "ncucase: NCU_CASE_LIB, NCU_CASE_KERNEL and NCU_CASE_NAME must list as many entries each; nothing run"
    status=1
    c_libs=()
  fi
  for i in "${!c_libs[@]}"; do
    say "ncu: ${c_kern[$i]} of ${c_libs[$i]}'s call ($c_match)"
    # (one call outside ncu first: a competitor compiles its kernels there, not under the profiler)
    timeout 300 python3 benchmarks/kernel_times.py --lib "${c_libs[$i]}" --match "$c_match" --plain 1 2>&1 | tail -1 | tee -a "$LOG"
    ncu_stalls "${c_kern[$i]}" "${c_names[$i]}" python3 benchmarks/kernel_times.py --lib "${c_libs[$i]}" --match "$c_match" --plain 2
  done
fi

if has ncuflow; then
  say "ncu: throughput of the split forward's two kernels (torch path, TP1 1 x 8192)"
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  # (and the tensor pipe's busy share, NCUFLOW_METRICS: is the chain bound by its products' throughput? A metric
  # name this ncu does not know fails the run: it is then repeated without it. NCUFLOW_EXTRA: more ncu options,
  # e.g. "--section MemoryWorkloadAnalysis_Tables" for the shared-memory table in the text file)
  ncuflow_run() {
    timeout ${NCU_TIMEOUT:-240} "$NCU" --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
      ${NCUFLOW_EXTRA:-} "$@" -k regex:"gdn_fwd_mma_kernel|gdn_prep_kernel" --launch-skip 2 --launch-count 2 -f -o /tmp/fq_ncuflow \
      python3 -c "$(fwd_call_py 8192 16 64 3)" > /tmp/ncuflow-run.log 2>&1
  }
  ncuflow_run --metrics "${NCUFLOW_METRICS:-sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active}" ||
    { tail -5 /tmp/ncuflow-run.log | tee -a "$LOG"; ncuflow_run; } || { tail -20 /tmp/ncuflow-run.log | tee -a "$LOG"; status=1; }
  "$NCU" -i /tmp/fq_ncuflow.ncu-rep --print-summary none 2>&1 | grep -vE "^\s*$" > "$OUT/ncuflow.txt"
  grep -E "gdn_|Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Throughput|pipe_tensor|Issue Slots Busy|SM Busy|Executed Ipc Active" \
    "$OUT/ncuflow.txt" | tee -a "$LOG"
fi

if has ab; then
  # A/B of environment switches in one process each, flashqla only (no competitor compiles): AB_ENVS lists the
  # variants separated by ';', each a space-separated list of KEY=VALUE (e.g. "FLASHQLA_BWD_GRAD=0;FLASHQLA_BWD_GRAD=1");
  # AB_ARGS are the harness's options (default: the anchors' forward and backward, no accuracy)
  IFS=';' read -ra variants <<< "${AB_ENVS:-FLASHQLA_CP=1}"
  n=0
  for venv in "${variants[@]}"; do
    n=$((n + 1))
    say "A/B variant $n: $venv"
    env OUT= $venv timeout ${BENCH_TIMEOUT:-300} python3 -m flashqla.bench run --cases anchors --libs flashqla --prewarm 0 \
      ${AB_ARGS:---no-accuracy} --out "$OUT/ab-$n.json" --table /tmp/ab-$n.md --plot /tmp/ab-$n.png > /tmp/ab-$n.log 2>&1 || status=1
    grep -E "^(fwd|bwd) " /tmp/ab-$n.log | tee -a "$LOG"
  done
fi

if has cp; then
  say "context parallelism (FLASHQLA_CP=1) on the single-sequence TP8/TP4 rows"
  FLASHQLA_CP=1 timeout ${BENCH_TIMEOUT:-300} python3 -m flashqla.bench run --cases anchors --fwd-only --prewarm ${PREWARM:-16} \
    --libs flashqla,fla_triton --no-accuracy --match '^fwd TP[48] .*(1x32768|1x8192|28672\+4096)$' \
    --out "$OUT/cp-anchors.json" --table /tmp/cp.md --plot /tmp/cp.png > /tmp/cp.log 2>&1 || status=1
  tail -12 /tmp/cp.log | tee -a "$LOG"
fi

if has variants; then
  cp flashqla/_C.cpython-312-*.so /tmp/own_C.so 2>/dev/null || true
  for vdir in variants/*/; do
    name=$(basename "$vdir"); vlog="$OUT/variants.log"   # one log for all: $OUT brings back 8 files at most
    say "variant $name ($(cat "$vdir/COMMIT"))"
    for z in "$vdir"/*.xz; do [ -f "$z" ] && unxz_file "$z"; done  # (build_variants.sh packs them)
    chmod +x "$vdir/fq_phases" "$vdir/fq_grad_phases" 2>/dev/null
    # variants/<name>/SO_FROM (optional): the name of an earlier variant whose build this one runs (a second sample,
    # or another ENV, without a second copy in the carry)
    sodir=$vdir; [ -f "$vdir/SO_FROM" ] && sodir="variants/$(cat "$vdir/SO_FROM")/"
    cp "$sodir"/_C.cpython-312-*.so flashqla/
    # variants/<name>/ENV (optional): KEY=VALUE lines set for this variant only (e.g. FLASHQLA_FWD_SPLIT=0)
    venv=$( [ -f "$vdir/ENV" ] && grep -E '^[A-Z_][A-Z0-9_]*=' "$vdir/ENV" | tr '\n' ' ' )
    # (the call's own values of those keys, restored after this variant: an ENV's VARIANT_STEPS must not unset the
    # call's for the variants after it, as it did in session 48)
    vsaved=$(for kv in $venv; do k=${kv%%=*}; [ -n "${!k+x}" ] && printf '%s=%q ' "$k" "${!k}"; done)
    { echo "== $name $(cat "$vdir/COMMIT") ${venv} kernel sources $(python3 -m flashqla.bench fingerprint --so "$sodir"/_C.cpython-312-*.so 2>&1 | tail -1)"
      [ -n "$venv" ] && export $venv
      # a variant that fails (or hangs in) the GPU tests is not timed: a hung kernel would eat the call
      steps=",${VARIANT_STEPS:-test,phases,bench},"
      for tool in memcheck racecheck; do
        # (where the reports point: source lines by count, so that known hazards tell apart from new ones)
        [[ $steps == *,$tool,* ]] && { timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool $tool --print-limit 200 \
          --error-exitcode 3 python3 benchmarks/sanitize_cases.py > /tmp/vsan-$tool.txt 2>&1
          grep -oE "[A-Za-z_0-9]+\.(cuh|cu|h):[0-9]+" /tmp/vsan-$tool.txt | sort | uniq -c | sort -rn | head -16
          tail -3 /tmp/vsan-$tool.txt; }
      done
      # (without the test step the others run untested; a variant tested and failed runs nothing more)
      # (VARIANT_TEST_ARGS, one word, e.g. an ENV's --deselect=<node id> of a test the tree has for another build)
      if [[ $steps != *,test,* ]] || { timeout ${VARIANT_TEST_TIMEOUT:-90} python3 -m pytest ${VARIANT_TEST_PATHS:-tests/test_gpu_fwd.py} \
           ${VARIANT_TEST_ARGS:-} -q -x -p no:cacheprovider -s 2>&1 | tail -15; [ "${PIPESTATUS[0]}" -eq 0 ]; }; then
        [[ $steps == *,digest,* ]] && timeout 120 python3 benchmarks/bwd_digest.py 2>&1 | grep -E "^digest|Error"
        [[ $steps == *,phases,* && -x "$vdir/fq_phases" ]] && timeout 60 "$vdir/fq_phases" ${PHASE_ARGS:-} 2>&1  # (PHASES=0 builds have none)
        [[ $steps == *,gradphases,* && -x "$vdir/fq_grad_phases" ]] && timeout 60 "$vdir/fq_grad_phases" ${GRAD_PHASE_ARGS:-} 2>&1
        [[ $steps == *,ktimes,* ]] && timeout ${KTIMES_TIMEOUT:-120} python3 benchmarks/kernel_times.py ${KTIMES_ARGS:-} 2>&1
        [[ $steps == *,bench,* ]] && OUT= FLASHQLA_COMMIT=$(cat "$vdir/COMMIT") FLASHQLA_DIRTY=0 timeout ${BENCH_TIMEOUT:-300} python3 -m flashqla.bench \
          run --cases "$CASES" --prewarm ${PREWARM:-16} ${VARIANT_BENCH_ARGS:---fwd-only --libs flashqla,fla_triton --no-accuracy} \
          --out "$OUT/variant-$name.json" --table /tmp/variant-$name.md --plot /tmp/variant-$name.png 2>&1 | tail -40
      else
        echo "variant $name: GPU tests failed or timed out; not timed"
      fi
    } > /tmp/variant-$name.log 2>&1
    [ -n "$venv" ] && unset $(echo "$venv" | sed -E 's/=[^ ]*//g')
    [ -n "$vsaved" ] && eval export "$vsaved"
    cat /tmp/variant-$name.log >> "$vlog"
    grep -E "passed|failed|not timed|anchor:|T=32768|forward, 1 x|gradient kernel \(timed|flashqla .* ms|SUMMARY|^digest" /tmp/variant-$name.log | head -40 | tee -a "$LOG"
  done
  [ -f /tmp/own_C.so ] && cp /tmp/own_C.so flashqla/_C.cpython-312-x86_64-linux-gnu.so
fi

if has sanitize; then
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    say "compute-sanitizer $tool"
    # the whole report goes to sanitize.txt (the first errors name the kernel and the access); the log gets its tail
    timeout ${SAN_TIMEOUT:-120} compute-sanitizer --tool "$tool" --print-limit 12 --error-exitcode 3 python3 benchmarks/sanitize_cases.py \
      > /tmp/san-$tool.txt 2>&1
    [ $? -eq 0 ] || status=1
    { echo "== $tool"; head -c 60000 /tmp/san-$tool.txt; } >> "$OUT/sanitize.txt"
    tail -6 /tmp/san-$tool.txt | tee -a "$LOG"
  done
fi

if [ "${CACHE_SAVE:-0}" = 1 ] && [ -d /tmp/kcache ]; then
  for d in tilelang triton; do
    [ -d "/tmp/kcache/$d" ] || continue
    tar_xz "$OUT/kcache-$d.tar.xz" /tmp/kcache "$d" \
      && say "saved the $d kernel cache ($(du -h "$OUT/kcache-$d.tar.xz" | cut -f1); over 16 MiB does not come back)"
  done
fi
say "done status=$status"
# the device tool brings back 8 files at most: past that, logs travel as one tarball
if [ "$(ls "$OUT" | wc -l)" -gt 8 ]; then
  (cd "$OUT" && tar czf logs.tar.gz $(ls | grep -E "\.(log|txt)$" | grep -v "^h200.log$") && rm -f $(ls | grep -E "\.(log|txt)$" | grep -v "^h200.log$"))
fi
exit $status
