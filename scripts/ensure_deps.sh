#!/usr/bin/env bash
# Installs what the build and the tests need, once: Debian's catch2 (C++ tests) and the PyPI
# packages of requirements-dev.txt. Quick (a few imports) when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -f /usr/include/catch2/catch.hpp ]; then
  echo "ensure_deps: installing Debian package catch2 (Catch2 v2)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq catch2 cmake g++ >/dev/null
fi

stamp=build/.deps-$(sha1sum requirements-dev.txt | cut -c1-12)
if [ ! -f "$stamp" ] || ! "$PY" -c "import torch, numpy, pytest" 2>/dev/null; then
  # uv (from PyPI) downloads and unpacks the wheels in parallel: a fresh install of this list
  # (torch and its CUDA libraries, ~3 GB) took 46 s with it against 4 min 8 s with pip on the
  # project's 2-core Xeon. pip does it where uv cannot be had. --compile-bytecode writes the
  # .pyc files pip writes by default: without them, and with PYTHONDONTWRITEBYTECODE set, every
  # process the tests start compiles torch's Python anew (7.4 s to import torch.distributed
  # against 3.1 s), which added 1 min 51 s to pytest on a new machine.
  echo "ensure_deps: installing requirements-dev.txt"
  if "$PY" -m pip install -q uv && "$PY" -m uv pip install -q --compile-bytecode --python "$("$PY" -c "import sys; print(sys.executable)")" -r requirements-dev.txt; then
    :
  else
    echo "ensure_deps: uv unavailable or failed; pip install -r requirements-dev.txt"
    "$PY" -m pip install -q -r requirements-dev.txt
  fi
  mkdir -p build && touch "$stamp"
fi
