#!/usr/bin/env bash
# Installs, from Debian's packages, whatever zp's build, tests, benchmarks and demo need and is
# missing. The CUDA toolkit (optional) is expected in /usr/local/cuda.
set -euo pipefail
pkgs=(cmake ninja-build g++ make doctest-dev libbenchmark-dev libopenmpi-dev openmpi-bin)
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
