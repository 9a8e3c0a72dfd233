#!/usr/bin/env bash
# Installs, from Debian's packages, whatever zp's build, tests, benchmarks and demo need and is
# missing; with the argument `tests`, also the Python environment of the tests' cross-checks
# (below). The CUDA toolkit (optional) is expected in /usr/local/cuda.
set -euo pipefail
pkgs=(cmake ninja-build g++ make clang-format doctest-dev libbenchmark-dev libopenmpi-dev openmpi-bin
      nlohmann-json3-dev liburing-dev python3-numpy python3-venv)
# The sanitizer builds of the tests (tests/run.sh): Clang 16's, faster than GCC's to build (ASan)
# and to run (TSan); SIMDe, whose AVX-512 emulation runs the AVX-512 loops' tests on any CPU.
[ "${1:-}" = tests ] && pkgs+=(clang-16 libclang-rt-16-dev libsimde-dev)
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

# The Python cross-checks run the reference implementations from PyPI in a virtual environment
# at this fixed place, which tests/CMakeLists.txt also names: ${XDG_CACHE_HOME:-~/.cache}/zp/venv.
# zp.test.safetensors.python reads zp's files with `safetensors`; zp.test.gpt.hf loads zp_gpt's
# exports with transformers' GPT2LMHeadModel (on torch) and reads GPT-2s that transformers saved.
# PyPI's torch is its CUDA build: about 5.5 GB installed, a minute or two to fetch; it runs on the
# CPU here. The environment is built on Debian's python3 (not whatever python3 comes first on
# PATH) so --system-site-packages brings the numpy installed above. Offline, this only warns: the
# rest of zp builds, and those two tests fail saying what is missing. tests/run.sh asks for it.
venv="${XDG_CACHE_HOME:-$HOME/.cache}/zp/venv"
if [ "${1:-}" = tests ] &&
   ! "$venv/bin/python" -c "import numpy, safetensors, torch, transformers" 2>/dev/null; then
  echo "zp: installing safetensors, torch and transformers into $venv"
  if ! { /usr/bin/python3 -m venv --system-site-packages "$venv" &&
         "$venv/bin/python" -m pip install -q --disable-pip-version-check safetensors torch \
           transformers; }; then
    echo "zp: warning: could not install the Python test helpers into $venv (offline?);" \
         "zp.test.safetensors.python and zp.test.gpt.hf will fail until this script succeeds" >&2
  fi
fi
