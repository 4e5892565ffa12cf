#!/usr/bin/env bash
# Builds, on this (CPU) machine, the torch extension and the phase profiler of several git refs of the
# forward kernel, so that one H200 call can compare them (h200.sh STAGES=variants): the Python package is
# the same on every ref, only the kernels in _C differ, so each variant is its .so plus its profiler.
#
#   bash benchmarks/build_variants.sh v2=fwd-v2 v21=fwd-v2.1 v3=fwd-v3     (name=git-ref ...)
#
# Needs a venv that mirrors the H200 (Python 3.12, torch 2.11.0; see shared/BUILDING.md): $VENV
# (default /work/venvs/h200). Writes variants/<name>/{_C.cpython-312-x86_64-linux-gnu.so.xz,fq_phases.xz,COMMIT}
# (xz: a variant's .so is ~31 MB raw, ~3 MB compressed; h200.sh unpacks them); carry `variants` to the H200. A variant may also get an ENV file
# (KEY=VALUE lines) that h200.sh sets for it only: two names for one ref compare two runtime modes.
# PHASES=0: no phase profiler (its compile takes ~5 minutes on 2 cores; the variants stage's phases step then has
# nothing to run for that variant). GRADPHASES=1: also the gradient kernel's phase profiler (fq_grad_phases, for the
# variants stage's gradphases step; ~1 minute).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-/work/venvs/h200}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CUTLASS_INC=$("$VENV/bin/python" "$ROOT/third_party/cutlass.py")
for spec in "$@"; do
  name=${spec%%=*}; ref=${spec#*=}
  rm -rf "$ROOT/variants/$name"
  dir=$(mktemp -d /tmp/flashqla-variant-XXXX)
  git -C "$ROOT" worktree add -q --detach "$dir" "$ref"
  echo "== $name = $ref ($(git -C "$dir" rev-parse --short HEAD))"
  (cd "$dir" && MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py build_ext --inplace > build.log 2>&1) \
    || { tail -20 "$dir/build.log"; exit 1; }
  mkdir -p "$ROOT/variants/$name"
  cp "$dir"/flashqla/_C.cpython-312-*.so "$ROOT/variants/$name/"
  if [ "${PHASES:-1}" != 0 ]; then
    "$CUDA_HOME/bin/nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
      -I"$dir/csrc/include" -I"$dir/csrc" -I"$CUTLASS_INC" "$dir/benchmarks/profile_fwd_phases.cu" \
      -o "$ROOT/variants/$name/fq_phases"
  fi
  if [ "${GRADPHASES:-0}" = 1 ]; then
    "$CUDA_HOME/bin/nvcc" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
      -I"$dir/csrc/include" -I"$dir/csrc" -I"$CUTLASS_INC" "$dir/benchmarks/profile_bwd_grad_phases.cu" \
      -o "$ROOT/variants/$name/fq_grad_phases"
  fi
  packed=("$ROOT/variants/$name"/_C.cpython-312-*.so)
  for f in fq_phases fq_grad_phases; do [ -f "$ROOT/variants/$name/$f" ] && packed+=("$ROOT/variants/$name/$f"); done
  xz -T0 -6 -f "${packed[@]}"
  git -C "$dir" rev-parse HEAD > "$ROOT/variants/$name/COMMIT"
  git -C "$ROOT" worktree remove --force "$dir"
done
du -sh "$ROOT/variants"/*
