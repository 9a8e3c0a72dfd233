#!/usr/bin/env bash
# Installs, from Debian's packages, whatever zp's build, tests, benchmarks and demo need and is
# missing. The CUDA toolkit (optional) is expected in /usr/local/cuda.
set -euo pipefail
pkgs=(cmake ninja-build g++ make clang-format doctest-dev libbenchmark-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev liburing-dev python3-numpy python3-venv)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "zp: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The safetensors cross-check (ctest zp.test.safetensors.python) runs the reference reader, the
# `safetensors` package from PyPI, in a virtual environment at this fixed place, which
# tests/CMakeLists.txt also names: ${XDG_CACHE_HOME:-~/.cache}/zp/venv. It is built on Debian's
# python3 (not whatever python3 comes first on PATH) so --system-site-packages brings the numpy
# installed above. Offline, this only warns: the rest of zp builds, and that one test fails
# saying what is missing.
venv="${XDG_CACHE_HOME:-$HOME/.cache}/zp/venv"
if ! "$venv/bin/python" -c "import numpy, safetensors" 2>/dev/null; then
  echo "zp: installing safetensors into $venv"
  if ! { /usr/bin/python3 -m venv --system-site-packages "$venv" &&
         "$venv/bin/python" -m pip install -q --disable-pip-version-check safetensors; }; then
    echo "zp: warning: could not install safetensors into $venv (offline?);" \
         "zp.test.safetensors.python will fail until this script succeeds" >&2
  fi
fi

# ZP_WITH_TRANSFORMERS=1 adds torch and transformers to that environment (about 5 GB: PyPI's
# torch is the CUDA build), so zp.test.gpt.hf also compares zp_gpt's exports with
# GPT2LMHeadModel itself and reads a GPT-2 that transformers saved. Without them it compares
# with its float64 numpy GPT-2 only, and says so.
if [ "${ZP_WITH_TRANSFORMERS:-0}" = 1 ] &&
   ! "$venv/bin/python" -c "import torch, transformers" 2>/dev/null; then
  echo "zp: installing torch and transformers into $venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check torch transformers
fi
