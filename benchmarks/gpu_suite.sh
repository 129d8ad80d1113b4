#!/usr/bin/env bash
# The GPU checks of issue 13 as one run (sized for one H200; not yet run on one; every stage has a timeout,
# 9.5 minutes in all):
#   1. benchmarks/rng.py --device cuda         (also compiles the rng kernels into Triton's cache)
#   2. pytest -m cuda                          (tests/test_cuda.py: the CUDA test suite)
#   3. benchmarks/optim.py --device cuda       (fp32, then bf16)
#   4. benchmarks/step.py --device cuda
#   5. examples/quickstart.py and examples/toy2d.py --quick on the GPU (smoke runs)
# Usage: bash benchmarks/gpu_suite.sh [OUT_DIR]    (default: $OUT, else outputs/gpu_suite)
# Each stage writes its output to OUT_DIR/<stage>.txt; OUT_DIR/summary.txt lists each stage's exit
# status and time. A failing stage does not stop the later ones; the script exits non-zero if any
# stage failed. Runs the checkout's purestep (src/ first on PYTHONPATH), not an installed one.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-outputs/gpu_suite}}"
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
summary="$out/summary.txt"
: > "$summary"
failed=0

stage() {  # stage NAME TIMEOUT_S CMD...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$summary"
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  [ "$rc" -ne 0 ] && failed=1
  echo "   exit $rc after $((SECONDS - t0)) s (limit $limit s) -> $out/$name.txt" | tee -a "$summary"
  tail -n 3 "$out/$name.txt" | sed 's/^/   | /' | tee -a "$summary"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  python - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for name in ("torch", "triton", "tensordict", "attrs", "hypothesis", "pytest"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # a missing package is reported, the stages that need it fail
        print(name, "MISSING:", type(e).__name__, e)
import torch
print("cuda available:", torch.cuda.is_available(), torch.version.cuda)
EOF
} > "$out/environment.txt" 2>&1
cat "$out/environment.txt" | tee -a "$summary"

stage rng 60 python benchmarks/rng.py --device cuda
stage cuda_tests 240 python -m pytest -m cuda -q -p no:cacheprovider -ra tests/test_cuda.py
stage optim_fp32 50 python benchmarks/optim.py --device cuda --dtype fp32
stage optim_bf16 50 python benchmarks/optim.py --device cuda --dtype bf16
stage step 90 python benchmarks/step.py --device cuda
stage quickstart 40 python examples/quickstart.py --device cuda --steps 300 --out "$out/quickstart"
stage toy2d_quick 40 python examples/toy2d.py --device cuda --quick --no-progress --out "$out/toy2d"
echo "tables and logs in $out" | tee -a "$summary"
exit "$failed"
