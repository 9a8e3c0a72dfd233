#!/usr/bin/env bash
# Builds zp's demo (optimized) and runs it: ZeRO stage 3 on 4 thread-ranks by default, no GPU
# needed. Extra arguments go to the demo (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
cmake --preset release >/dev/null
cmake --build --preset release --target zp_demo
exec build/release/examples/zp_demo "$@"
