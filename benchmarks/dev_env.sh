#!/usr/bin/env bash
# A development machine's set-up for the H200 workflow (shared/BUILDING.md), from nothing, in one command:
#   bash benchmarks/dev_env.sh            (~10 min; both venvs in parallel, then the competitors' wheels)
# - $VENVS/h200: Python 3.12 + torch 2.11.0 (the H200's versions), for builds whose .so loads there
#   (benchmarks/build_variants.sh) and for cuobjdump (triton's copy, see below);
# - $VENVS/ci311: Python 3.11 + torch 2.13.0, for CPU tests, pyflakes and `python -m flashqla.bench readme`;
# - .whl/{fla,qla,z3,build}: the wheels h200.sh installs on the H200 (../shared/tools/device-wheels.sh).
# Nothing here is needed by users or CI (the README's commands are theirs).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENVS=${VENVS:-/work/venvs}
PYENV=${PYENV_ROOT:-/root/.pyenv}/versions
mkdir -p "$VENVS"
make_venv() {  # name, python, torch version, extra packages
  local dir="$VENVS/$1"
  [ -x "$dir/bin/python" ] && "$dir/bin/python" -c "import torch" 2> /dev/null && { echo "$1: present"; return; }
  "$2" -m venv "$dir"
  "$dir/bin/pip" install -q "torch==$3" numpy ninja pytest $4
  "$dir/bin/pip" install -q --no-deps nvidia-cutlass==4.2.0.0
  echo "$1: ready ($("$dir/bin/python" -c 'import torch; print(torch.__version__)'))"
}
make_venv h200 "$PYENV/3.12.1/bin/python" 2.11.0 pybind11 > /tmp/dev_env-h200.log 2>&1 &
make_venv ci311 "$PYENV/3.11.7/bin/python" 2.13.0 "matplotlib pyflakes" > /tmp/dev_env-ci311.log 2>&1 &
(cd "$ROOT" && bash ../shared/tools/device-wheels.sh > /tmp/dev_env-wheels.log 2>&1) || echo "wheels: failed (see /tmp/dev_env-wheels.log)"
wait
tail -n 1 /tmp/dev_env-h200.log /tmp/dev_env-ci311.log
echo "cuobjdump: $VENVS/h200/lib/python3.12/site-packages/triton/backends/nvidia/bin/cuobjdump"
