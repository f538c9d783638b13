#!/usr/bin/env bash
# The GPU check, in two stages that each fit one call of a lent GPU machine (torch, pytest,
# cmake, ninja preinstalled; no network):
#
#   scripts/gpu_check.sh quick   build for the local GPU, every CUDA test (the CPU-vs-CUDA bit
#                                comparison on a row of its own), compute-sanitizer
#                                memcheck + racecheck + synccheck + initcheck on small cases
#                                (<= 5 minutes on an H200 machine with 16 cores)
#   scripts/gpu_check.sh bench   the step benchmark, the host-overhead table and the fused AdamW
#                                step at 100M parameters against a device-to-device copy
#                                (<= 4 minutes; builds first unless the build is already there)
#   scripts/gpu_check.sh all     both, one after the other
#
# Each stage prints its own summary table last and exits 0 only if nothing failed. Logs and
# results go to $OUT if set (the device tool's folder that comes back), else
# build/gpu-check-logs. Without a GPU the build and the CPU part of the tests still run (the
# CUDA kernels compile for TORCH_CUDA_ARCH_LIST, default 9.0) and the GPU steps say "skipped".
#
# The build: fusedamp from source for the local GPU's architecture only, with every core, the
# way `make build` does (installing the library and _C into python/fusedamp, so that
# PYTHONPATH=python imports it), without Makefile's `deps` step (no network); then the ptxas
# report is checked for register spills.
#
# Environment: PYTHON (python3), GPU_CHECK_BUILD (build/gpu-check), GPU_CHECK_JOBS (nproc),
# GPU_CHECK_DEADLINE (seconds for the stage, default 300 for quick and 240 for bench: each step
# is cut at what is left), GPU_CHECK_BUILD_TIMEOUT (cap of the build step, default 200).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
STAGE=${1:-quick}
case $STAGE in
  quick|bench|all) ;;
  *) echo "usage: scripts/gpu_check.sh [quick|bench|all]" >&2; exit 2 ;;
esac
if [ "$STAGE" = all ]; then
  "$0" quick; q=$?
  "$0" bench; b=$?
  exit $(( q || b ))
fi
PY=${PYTHON:-python3}
BUILD=${GPU_CHECK_BUILD:-build/gpu-check}
JOBS=${GPU_CHECK_JOBS:-$(nproc)}
LOGS=${OUT:-build/gpu-check-logs}
DEFAULT_DEADLINE=$([ "$STAGE" = quick ] && echo 300 || echo 240)
DEADLINE=${GPU_CHECK_DEADLINE:-$DEFAULT_DEADLINE}
BUILD_CAP=${GPU_CHECK_BUILD_TIMEOUT:-200}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
T0=$(date +%s)
declare -a ROWS=()
FAILED=0

row() { ROWS+=("$(printf '%-30s %s' "$1" "$2")"); }
elapsed() { echo $(( $(date +%s) - T0 )); }
# Seconds a step may take: its own cap, or what is left before the deadline (at least 1:
# timeout 0 would mean no limit).
budget() {
  local left=$(( DEADLINE - $(elapsed) ))
  (( left < 1 )) && left=1
  (( left < $1 )) && echo "$left" || echo "$1"
}
log() { echo "[gpu_check $STAGE $(elapsed)s] $*"; }
fail_row() { row "$1" "$2"; FAILED=1; }

# ---- GPU present? ------------------------------------------------------------------------
GPU=0
GPU_NAME="no GPU"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
   "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GPU=1
  GPU_NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
  export TORCH_CUDA_ARCH_LIST="$CAP"
else
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
fi
if [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH="/usr/local/cuda/bin:$PATH" CUDACXX=${CUDACXX:-/usr/local/cuda/bin/nvcc}
fi
skip_reason() { (( GPU )) && echo "no build" || echo "no GPU"; }
PYT="$REPO/python"

# ---- the build (both stages; incremental when the build directory is already there) -------
build() {
  log "GPU: $GPU_NAME; building for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST with $JOBS jobs"
  local b0 ok=0
  b0=$(date +%s)
  timeout "$(budget "$BUILD_CAP")" make -o deps build BUILD="$BUILD" JOBS="$JOBS" PYTHON="$PY" \
    CMAKE_ARGS="-DFUSEDAMP_CUDA=ON -DFUSEDAMP_BUILD_TESTS=OFF" >"$LOGS/build.log" 2>&1 && ok=1
  local secs=$(( $(date +%s) - b0 ))
  [ -f "$BUILD/build.log" ] && cp "$BUILD/build.log" "$LOGS/build-full.log"
  if (( ok )); then
    row "build ($TORCH_CUDA_ARCH_LIST, -j$JOBS)" "ok (${secs}s)"
  else
    fail_row "build ($TORCH_CUDA_ARCH_LIST, -j$JOBS)" "FAILED after ${secs}s (see build.log)"
  fi
  BUILD_OK=$ok
}

spill_check() {
  [ -f "$LOGS/build-full.log" ] || return
  "$PY" scripts/check_spills.py "$LOGS/build-full.log" >"$LOGS/spills.log" 2>&1
  local rc=$? line
  line=$(tail -1 "$LOGS/spills.log")
  case $rc in
    0) row "ptxas register spills" "none (${line#check_spills: })" ;;
    1) fail_row "ptxas register spills" "SPILLS: ${line#check_spills: } (spills.log)" ;;
    *) row "ptxas register spills" "no ptxas report (already built; see an earlier build.log)" ;;
  esac
}

junit_counts() {  # file [filter] -> "passed failed skipped"
  "$PY" - "$@" <<'EOF'
import sys
import xml.etree.ElementTree as ET
path = sys.argv[1]
flt = sys.argv[2] if len(sys.argv) > 2 else ""
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except Exception:
    print("0 0 0")
    sys.exit(0)
p = f = s = 0
for c in cases:
    ident = c.get("classname", "") + "::" + c.get("name", "")
    if flt and flt not in ident:
        continue
    if c.find("failure") is not None or c.find("error") is not None:
        f += 1
    elif c.find("skipped") is not None:
        s += 1
    else:
        p += 1
print(p, f, s)
EOF
}

# ---- quick: every CUDA test -------------------------------------------------------------------
# Every test parametrised on "cuda", and every test of test_cuda*.py (the CUDA-only files, whose
# test names need not say cuda).
# Without a GPU they are all skipped, so the CPU variants of the op tests run instead: what the
# no-GPU mode can check.
# The CUDA kernels against the CPU's, file by file (the compute-sanitizer runs pick from these).
CUDA_KERNEL_TESTS=(tests/python/test_cuda_scaler_ops.py tests/python/test_cuda_optimizer_steps.py
                   tests/python/test_cuda_launches.py)
cuda_tests() {
  if (( ! BUILD_OK )); then row "pytest (CUDA tests)" "skipped (no build)"; return; fi
  local files=(tests/python) sel="cuda" name="pytest (CUDA tests)"
  if (( ! GPU )); then  # the script's own check: collection, and the bad-input cases on the CPU
    files=("${CUDA_KERNEL_TESTS[@]}" tests/python/test_cuda_same_bits.py
           tests/python/test_bad_input.py); sel="cpu or cuda"
    name="pytest (no GPU: bad input, CPU)"
  fi
  log "$name"
  PYTHONPATH="$PYT" timeout "$(budget 150)" "$PY" -m pytest -q "${files[@]}" -p no:cacheprovider \
    -k "$sel" --junitxml="$LOGS/pytest.xml" >"$LOGS/pytest.log" 2>&1
  local rc=$? P F S
  read -r P F S <<<"$(junit_counts "$LOGS/pytest.xml")"
  if (( rc == 124 )); then
    fail_row "$name" "TIMED OUT ($P passed, $F failed before; pytest.log)"
  elif (( rc != 0 )) && (( F == 0 )); then
    fail_row "$name" "FAILED (exit $rc; pytest.log)"
  else
    row "$name" "$P passed, $F failed, $S skipped"
    (( F > 0 )) && FAILED=1
    (( GPU )) && (( P == 0 )) && FAILED=1
  fi
}

# The bit comparison of CPU and CUDA (docs/engine.md, "Same bits everywhere"): its tests ran in
# cuda_tests; their count on a row of its own, so that the summary says whether it held.
same_bits() {
  local name="CPU vs CUDA bits" P F S
  if (( ! BUILD_OK )); then row "$name" "skipped (no build)"; return; fi
  read -r P F S <<<"$(junit_counts "$LOGS/pytest.xml" test_cuda_same_bits)"
  if (( ! GPU )); then row "$name" "skipped (no GPU; $S tests collected)"; return; fi
  row "$name" "$P passed, $F failed, $S skipped (test_cuda_same_bits.py)"
  (( F > 0 || P == 0 )) && FAILED=1
}

# ---- quick: compute-sanitizer -----------------------------------------------------------------
SAN=""
for c in compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
         /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if command -v "$c" >/dev/null 2>&1; then SAN=$(command -v "$c"); break; fi
done
# Small cases of every CUDA kernel. memcheck runs without torch's caching allocator (an
# out-of-bounds access inside a cached block would go unseen), which cannot allocate during a
# CUDA-graph capture, so the graph tests run under the other tools, with the allocator.
SMALL="unscale_and_grad_stats_match_cpu or (adam_matches_cpu and float16) or (sgd_matches_cpu and bfloat16) or more_tensors or misaligned or stream or (weight_stores_match_cpu and adam)"
GRAPHS="whole_step or captured"
sanitizer() {  # tool, selection, extra env
  local tool=$1 sel=$2 env=$3 name="compute-sanitizer $1"
  if (( ! GPU )); then row "$name" "skipped (no GPU)"; return; fi
  if [ -z "$SAN" ]; then row "$name" "skipped (compute-sanitizer not found)"; return; fi
  if (( ! BUILD_OK )); then row "$name" "skipped (no build)"; return; fi
  log "$name"
  env $env PYTHONPATH="$PYT" timeout "$(budget 60)" \
    "$SAN" --tool "$tool" --print-limit 20 "$PY" -m pytest -q -p no:cacheprovider \
    "${CUDA_KERNEL_TESTS[@]}" -k "$sel" --junitxml="$LOGS/sanitizer-$tool.xml" \
    >"$LOGS/sanitizer-$tool.log" 2>&1
  local rc=$? errs P F S
  errs=$(grep -Eo 'ERROR SUMMARY: [0-9]+' "$LOGS/sanitizer-$tool.log" | tail -1 | grep -Eo '[0-9]+$')
  read -r P F S <<<"$(junit_counts "$LOGS/sanitizer-$tool.xml")"
  if [ -z "$errs" ]; then
    fail_row "$name" "NO SUMMARY (exit $rc; sanitizer-$tool.log)"
  else
    row "$name" "$errs errors over $P passed / $F failed tests"
    (( errs > 0 || F > 0 || P == 0 )) && FAILED=1
  fi
}

# ---- bench --------------------------------------------------------------------------------------
bench_step() {
  if (( ! GPU || ! BUILD_OK )); then row "bench_step.py (cuda)" "skipped ($(skip_reason))"; return; fi
  log "benchmarks/bench_step.py"
  PYTHONPATH="$PYT" timeout "$(budget 120)" "$PY" benchmarks/bench_step.py --device cuda \
    --budget 0.3 --out "$LOGS" >"$LOGS/bench_step.log" 2>&1
  local rc=$?
  if (( rc == 0 )); then row "bench_step.py (cuda)" "ok: $(ls "$LOGS" | grep -E '^step_cuda' | tr '\n' ' ')"
  else fail_row "bench_step.py (cuda)" "FAILED (exit $rc; bench_step.log)"; fi
}

host_overhead() {
  if (( ! GPU || ! BUILD_OK )); then row "bench_host_overhead.py" "skipped ($(skip_reason))"; return; fi
  log "benchmarks/bench_host_overhead.py"
  PYTHONPATH="$PYT" timeout "$(budget 60)" "$PY" benchmarks/bench_host_overhead.py --device cuda \
    >"$LOGS/host_overhead.log" 2>&1
  local rc=$?
  if (( rc == 0 )); then row "bench_host_overhead.py" "ok (host_overhead.log)"
  else fail_row "bench_host_overhead.py" "FAILED (exit $rc; host_overhead.log)"; fi
}

bandwidth() {
  if (( ! GPU || ! BUILD_OK )); then row "AdamW step @100M params" "skipped ($(skip_reason))"; return; fi
  log "scripts/gpu_bandwidth.py"
  PYTHONPATH="$PYT" timeout "$(budget 60)" "$PY" scripts/gpu_bandwidth.py --params 100e6 \
    --json "$LOGS/bandwidth.json" >"$LOGS/bandwidth.log" 2>&1
  if [ -s "$LOGS/bandwidth.json" ]; then
    row "AdamW step @100M params" "$("$PY" -c "import json; r = json.load(open('$LOGS/bandwidth.json')); print(
      f\"{r['adam_gbps']:.0f} GB/s ({r['adam_ms']:.3f} ms) = {100 * r['adam_vs_copy']:.0f}% of \"
      f\"D2D copy {r['copy_gbps']:.0f} GB/s; whole step {r['step_gbps']:.0f} GB/s\")")"
  else
    fail_row "AdamW step @100M params" "FAILED (bandwidth.log)"
  fi
}

# ---- the stage ----------------------------------------------------------------------------------
BUILD_OK=0
build
if [ "$STAGE" = quick ]; then
  spill_check
  cuda_tests
  same_bits
  sanitizer memcheck "$SMALL" "PYTORCH_NO_CUDA_MEMORY_CACHING=1"
  sanitizer racecheck "$SMALL or $GRAPHS" ""
  sanitizer synccheck "$SMALL or $GRAPHS" ""
  sanitizer initcheck "$SMALL or $GRAPHS" ""
else
  bench_step
  host_overhead
  bandwidth
fi

{
  echo
  echo "=========== fusedamp GPU check ($STAGE): $GPU_NAME, $(elapsed)s of ${DEADLINE}s ==========="
  for r in "${ROWS[@]}"; do echo "$r"; done
  echo "logs: $LOGS"
  (( FAILED )) && echo "RESULT: FAILED" || echo "RESULT: ok"
} | tee "$LOGS/summary-$STAGE.txt"
exit $FAILED
