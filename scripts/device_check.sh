#!/usr/bin/env bash
# The GPU check in one command, from the repository root of a bare GPU machine running the
# device image (Python 3.12, torch 2.11, Triton 3.6, transformers 5.17; no Ray, llguidance,
# gguf or pydantic), with .whl/ and .device/ from scripts/device_wheels.sh carried along:
#
#   bash scripts/device_check.sh              # on the GPU machine
#   bash scripts/device_check.sh --rehearse   # the same steps on a CPU machine
#
# Steps, each run whatever became of the ones before it, each within its own time budget:
#   1. install .whl/ into a temporary directory put on PYTHONPATH (the image has no registry);
#   2. print the versions, nvidia-smi and the device;
#   3. check that the engine, the offline API and bench.gpu import without Ray;
#   4. the GPU tests (tests/test_gpu_path.py, tests/test_quantized_linear.py,
#      tests/test_triton_attention.py, tests/test_lora_kernels.py, tests/test_gpu_decoder.py,
#      tests/test_flex_decode.py, tests/test_gpu_group_linear.py): past their budget the
#      rest are skipped, not started (tests/conftest.py), so the log and the JUnit XML name
#      what ran;
#   5. python -m bench.gpu, which keeps its own budget and writes its JSON after every part;
#   6. python -m bench.quantized_gemm: 4-bit (GPTQ), int8 and fp8 weights against bf16
#      (GEMMs, then the engine), likewise.
# On an H200 steps 1-5 took 6 minutes; step 6 is held to 4 more (it writes and loads a 4-bit
# checkpoint of the 1B-shaped model besides its bf16, int8 and fp8 engines).
#
# Output, under $OUT when set (the device tool sets it), else ${TMPDIR:-/tmp}/kvserve-device-check
# (rehearsal: ${TMPDIR:-/tmp}/kvserve-device-rehearsal): device_check.log (versions, each
# step's status and time), pytest.log, pytest_gpu_path.xml and pytest_triton.xml (JUnit),
# gpu_<gpu>.json, gpu_bench.log, quantized_gemm_<gpu>.json and quantized_gemm.log. The
# JSONs are the results to commit under bench/results/; the logs stay out of it. The exit
# code is 0 only if every step passed.
#
# --rehearse proves on a CPU machine that the import closure, the carried files and the
# versions are enough: a venv (.venv-device) holds the image's versions where they install
# on Python 3.11 (scripts/device_image.txt) and nothing the image lacks
# (scripts/device_image_packages.txt); only .whl/ is added, as on the GPU machine. The
# Triton tests run under TRITON_INTERPRET=1, CUDA-only tests skip with their reasons, and
# the benchmarks run with --smoke.
# shellcheck disable=SC2317  # the steps' functions run through `bash -c`
set -uo pipefail
cd "$(dirname "$0")/.." || exit

REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1
if [ $REHEARSE -eq 1 ]; then
  if [ -z "${OUT:-}" ]; then
    OUT=${TMPDIR:-/tmp}/kvserve-device-rehearsal
    rm -rf "$OUT"  # the last rehearsal's
  fi
  TESTS_BUDGET_S=${TESTS_BUDGET_S:-900}
  BENCH_ARGS=(--smoke --interpret-triton)
  BENCH_HARD_S=${BENCH_HARD_S:-180}
  QUANT_ARGS=(--smoke)
  QUANT_HARD_S=${QUANT_HARD_S:-120}
  export TRITON_INTERPRET=1
else
  OUT=${OUT:-${TMPDIR:-/tmp}/kvserve-device-check}
  TESTS_BUDGET_S=${TESTS_BUDGET_S:-140}
  BENCH_ARGS=(--budget-s "${BENCH_BUDGET_S:-210}")
  BENCH_HARD_S=${BENCH_HARD_S:-285}
  QUANT_ARGS=(--budget-s "${QUANT_BUDGET_S:-100}")
  QUANT_HARD_S=${QUANT_HARD_S:-230}
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG=$OUT/device_check.log
: >"$LOG"
SUMMARY=()
FAILED=0

log() { echo "$*" | tee -a "$LOG"; }

# step NAME PARTIAL_PATTERN LOGFILE HARD_LIMIT_S COMMAND...: run COMMAND (a program:
# `timeout` runs no shell function, so those go through `bash -c` after `export -f`), its
# output to the terminal and LOGFILE; interrupted, then killed, at HARD_LIMIT_S. It
# passed if it exited 0; output matching PARTIAL_PATTERN means a budget cut it short.
step() {
  local name=$1 partial=$2 logfile=$3 hard=$4 start=$SECONDS rc status
  shift 4
  log "== $name"
  timeout -s INT -k 15 "$hard" "$@" 2>&1 | tee "$logfile"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status="FAILED: killed at its hard limit of ${hard} s"
  elif [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc)"
  else
    status=passed
  fi
  if [ -n "$partial" ] && grep -q -- "$partial" "$logfile"; then
    status="$status, partial: its time budget ran out"
  fi
  [ "$rc" -eq 0 ] || FAILED=1
  SUMMARY+=("$name: $status ($((SECONDS - start)) s)")
  log "== $name: $status"
}

if [ $REHEARSE -eq 1 ]; then
  VENV=${REHEARSAL_VENV:-.venv-device}
  want=$(cat scripts/device_image.txt scripts/device_image_packages.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$VENV/.image" 2>/dev/null)" != "$want" ]; then
    log "== building $VENV: the image's versions (scripts/device_image.txt)"
    rm -rf "$VENV"
    python3 -m venv "$VENV" && "$VENV/bin/python" -m pip install --quiet -r scripts/device_image.txt || exit 1
    # Dependencies the image lacks go: the GPU machine would not have them either.
    extra=$("$VENV/bin/python" - <<'PY'
import re
from importlib.metadata import distributions

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
image = {norm(line.strip()) for line in open("scripts/device_image_packages.txt") if line.strip() and not line.startswith("#")}
print(" ".join(sorted({norm(d.metadata["Name"]) for d in distributions()} - image)))
PY
)
    if [ -n "$extra" ]; then
      log "removing what the image lacks: $extra"
      # shellcheck disable=SC2086
      "$VENV/bin/python" -m pip uninstall --quiet -y $extra || exit 1
    fi
    echo "$want" >"$VENV/.image"
  fi
  PYTHON=$VENV/bin/python
else
  PYTHON=${PYTHON:-python3}
fi

SITE=$(mktemp -d)
install_wheels() {
  shopt -s nullglob
  local wheels=(.whl/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in .whl/: run scripts/device_wheels.sh where the registry is reachable, and carry .whl and .device"
    return 1
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" &&
    echo "installed: ${wheels[*]##*/}"
}
export PYTHON SITE
export -f install_wheels
step "install .whl/" "" "$OUT/install.log" 120 bash -c install_wheels
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

versions() {
  "$PYTHON" - <<'PY'
import platform
import sys

import torch

print(f"python {platform.python_version()} ({sys.executable})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
for name in ("triton", "transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate", "numpy", "llguidance", "flash_attn"):
    try:
        print(f"{name} {__import__(name).__version__}")
    except ImportError:
        print(f"{name}: not installed")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device (CPU)")
PY
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
}
export -f versions
step "versions" "" "$OUT/versions.log" 60 bash -c versions
cat "$OUT/versions.log" >>"$LOG"

imports() {
  "$PYTHON" - <<'PY'
import sys

import bench.gpu  # noqa: F401
import bench.quantized_gemm  # noqa: F401
import replica.attention.triton_backend  # noqa: F401
from kvserve import LLM  # noqa: F401

assert "ray" not in sys.modules, "the engine, LLM or bench.gpu imported Ray"
print("the engine, LLM, the attention backends and bench.gpu import without Ray")
PY
}
export -f imports
step "imports" "" "$OUT/imports.log" 120 bash -c imports
cat "$OUT/imports.log" >>"$LOG"

# The engine's GPU tests first, then the Triton kernels' across several processes (with
# pytest-xdist, where installed): on a fresh machine compiling each kernel variant is most
# of their time. The KV-sizing test reads free GPU memory, so its file runs alone.
gpu_tests() {
  local parallel=() rc=0
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    parallel=(-n "$(($(nproc) < 8 ? $(nproc) : 8))")
  fi
  "$PYTHON" -m pytest -p no:cacheprovider -q -rs --junitxml="$OUT/pytest_gpu_path.xml" \
    tests/test_gpu_path.py tests/test_quantized_linear.py || rc=$?
  "$PYTHON" -m pytest -p no:cacheprovider -q -rs --junitxml="$OUT/pytest_triton.xml" "${parallel[@]}" \
    tests/test_triton_attention.py tests/test_lora_kernels.py tests/test_gpu_decoder.py tests/test_flex_decode.py \
    tests/test_gpu_group_linear.py || rc=$?
  return "$rc"
}
# KVSERVE_DEVICE_KIT: the image lacks Ray and gguf, which a full run requires (tests/run_checks.py).
export OUT KVSERVE_DEVICE_KIT=1 KVSERVE_TESTS_DEADLINE=$(($(date +%s) + TESTS_BUDGET_S))
export -f gpu_tests
step "GPU tests" "test budget ran out" "$OUT/pytest.log" $((TESTS_BUDGET_S + 30)) bash -c gpu_tests

step "bench.gpu" "cut short:" "$OUT/gpu_bench.log" "$BENCH_HARD_S" \
  "$PYTHON" -m bench.gpu --out-dir "$OUT" "${BENCH_ARGS[@]}"

step "bench.quantized_gemm" "" "$OUT/quantized_gemm.log" "$QUANT_HARD_S" \
  "$PYTHON" -m bench.quantized_gemm --out-dir "$OUT" "${QUANT_ARGS[@]}"

rm -rf "$SITE" "$OUT/install.log" "$OUT/versions.log" "$OUT/imports.log"
log ""
log "device check ($([ $REHEARSE -eq 1 ] && echo rehearsal on CPU || echo GPU)), results in $OUT:"
for line in "${SUMMARY[@]}"; do log "  $line"; done
grep -h "^SKIPPED" "$OUT/pytest.log" | sed 's/^/  /' | tee -a "$LOG"
exit $FAILED
