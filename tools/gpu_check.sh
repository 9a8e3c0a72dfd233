#!/usr/bin/env bash
# Everything zp checks and measures on a GPU (issue #7's "on a GPU" list): the gpu tests (the
# optimizer, cuda_threads, nccl, the device engine, the GPU demo and its resume from a checkpoint,
# bitwise; the trainers' signal, config and flag tests with the GPU demo as the device demo),
# the same tests under compute-sanitizer memcheck (racecheck and synccheck too:
# cuda_threads and the optimizer), zp_bench_optim_cuda (AdamW against a device-to-device copy),
# zp_bench_collectives_cuda (the cuda_threads collectives' busbw against the same copy),
# zp_bench_zero_cuda (the device engine's step per stage and rank count against its bare kernels,
# offload against the device step), the GPU demo's tokens/s and loss, and bench/torch_adamw.py
# (PyTorch's clip_grad_norm_ + fused AdamW on the same sizes). Logs and JSON go to $OUT (default
# build/gpu-out); a summary is printed as it goes.
#
#   bash tools/gpu_check.sh [all|PHASE[,PHASE...]]   # on the GPU machine, from the repository root
#   [ZP_GPU_BASE=REV] bash tools/gpu_check.sh binaries  # on the build machine: build them there
#
# test: the gpu tests; memcheck: them under compute-sanitizer's memcheck, racecheck, synccheck;
# bench: the measurements; all (default): the three. ab: the benchmarks against their build at
# ZP_GPU_BASE (in $ZP_GPU_BIN/base), alternating, by tools/bench_ab.py (ZP_AB_ROUNDS rounds,
# every run's JSON kept): before/after figures from one machine. test and memcheck run side by
# side (neither is timed), every test and sanitizer run at once, each bounded (ZP_TEST_TIMEOUT,
# ZP_SANITIZE_TIMEOUT, ZP_BENCH_TIMEOUT seconds); ab and bench run alone after them.
#
# The device machine lends 15 minutes a session and 600 s a call, and sends back at most 8
# files: `ZP_GPU_BIN=build/gpu-bin bash tools/gpu_check.sh test,memcheck` ends inside one call
# (tests 240 s, sanitizer runs 300 s at most, side by side); bench and ab take a call of their
# own. Everything but summary.txt is packed into $OUT/logs.tar.gz on exit, also when stopped.
#
# Binaries: `binaries` builds every target below on the build machine (the CUDA toolkit needs no
# GPU) into ${ZP_GPU_BIN:-build/gpu-bin}, with the CUDA runtime and Google Benchmark beside them;
# carry that folder and run with ZP_GPU_BIN=build/gpu-bin, and nothing is built on the GPU
# machine (where a library they need is missing there, it builds after all). Otherwise the phases
# configure a Release build for Hopper there and build what they run, with doctest, Google
# Benchmark and nlohmann/json from build/gpu-deps (tools/gpu_deps.sh; carry it along: that
# machine cannot download). NCCL comes from CMake's search or PyTorch's nvidia-nccl wheel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu-out}
PHASE=${1:-all}
[[ $PHASE != all ]] || PHASE=test,memcheck,bench
for p in ${PHASE//,/ }; do
  case "$p" in test|memcheck|bench|ab|binaries) ;; *) echo "usage: $0 [all|test|memcheck|bench|ab|binaries] (phases joined by commas)" >&2; exit 2 ;; esac
done
run_phase() { [[ ,$PHASE, == *,$1,* ]]; }
GPU_TESTS="optim.gpu.cuda backend.cuda_threads.cuda quantize_device.cuda backend.nccl engine_device.cuda"  # zp.test.<name>
GPU_BENCHES="zp_bench_optim_cuda zp_bench_collectives_cuda zp_bench_zero_cuda"
mkdir -p "$OUT"
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"
pack() {  # every log but the summary into one file (of at most 8 that come back)
  (cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name logs.tar.gz -printf '%P\n' |
     tar czf logs.tar.gz --remove-files -T -) || true
}
if [[ $PHASE != binaries ]]; then trap 'pack' EXIT; trap 'log "stopped (SIGTERM)"; exit 143' TERM; fi

[[ $PHASE == binaries ]] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
if [[ -z "${NCCL_ROOT:-}" ]]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null || true)
  export NCCL_ROOT
fi
log "NCCL_ROOT=${NCCL_ROOT:-<cmake search>}"
if [[ -n "${NCCL_ROOT:-}" && -d "$NCCL_ROOT/lib" ]]; then export LD_LIBRARY_PATH="$NCCL_ROOT/lib:${LD_LIBRARY_PATH:-}"; fi

if [[ -n "${ZP_GPU_BIN:-}" && $PHASE != binaries ]]; then
  # Prebuilt: the CUDA runtime and Google Benchmark from its lib/, NCCL and cuBLAS from this
  # machine (PyTorch's wheels, else its toolkit).
  BUILD=$ZP_GPU_BIN
  CUBLAS_LIB=$(python3 -c 'import nvidia.cublas, os; print(os.path.dirname(nvidia.cublas.__file__) + "/lib")' 2>/dev/null || true)
  export LD_LIBRARY_PATH="$(cd "$BUILD" && pwd)/lib:${CUBLAS_LIB:+$CUBLAS_LIB:}/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
  missing=$(ldd "$BUILD"/tests/* "$BUILD"/bench/* "$BUILD"/examples/* 2>&1 | grep "not found" | sort -u)
  if [[ -z $missing ]]; then log "prebuilt binaries from $BUILD"; else
    log "prebuilt binaries miss libraries here, building instead:"; echo "$missing" | tee -a "$OUT/summary.txt"
    unset ZP_GPU_BIN
  fi
fi
# build_tree SOURCE BUILD_DIR TARGETS...: a Release build for Hopper of the tree at SOURCE.
build_tree() {
  local src=$1 dir=$2 deps=(); shift 2
  if [[ -d build/gpu-deps ]]; then  # where tools/gpu_deps.sh filled it, else the system's packages
    deps=(-Ddoctest_DIR="$PWD/build/gpu-deps/lib/cmake/doctest"
          -Dbenchmark_DIR="$PWD/build/gpu-deps/lib/x86_64-linux-gnu/cmake/benchmark"
          -Dnlohmann_json_DIR="$PWD/build/gpu-deps/share/cmake/nlohmann_json")
  fi
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" "${deps[@]}" \
    -DZP_ENABLE_MPI=OFF -DZP_BUILD_BENCH=ON -DZP_BUILD_EXAMPLES=ON -DZP_BUILD_TOOLS=OFF \
    ${NCCL_ROOT:+-DNCCL_ROOT="$NCCL_ROOT"} > "$OUT/configure.log" 2>&1 || { log "configure of $src FAILED"; tail -30 "$OUT/configure.log"; exit 1; }
  grep -E "zp::(cuda|nccl)|NCCL|CUDA" "$OUT/configure.log" | head -5
  cmake --build "$dir" --target "$@" > "$OUT/build.log" 2>&1 || { log "build of $src FAILED"; grep -E "error" -A5 "$OUT/build.log" | head -60; exit 1; }
  log "build of $src ok ($*)"
}
if [[ -z "${ZP_GPU_BIN:-}" || $PHASE == binaries ]]; then
  BUILD=build/gpu
  targets="zp_demo_gpu"
  if run_phase test || run_phase memcheck || run_phase binaries; then
    for t in $GPU_TESTS; do targets="$targets zp.test.$t"; done
    targets="$targets zp_demo zp_gpt"  # the trainer tests' other trainers
  fi
  if run_phase bench || run_phase binaries; then targets="$targets $GPU_BENCHES"; fi
  # shellcheck disable=SC2086  # a list of targets
  build_tree . "$BUILD" $targets
fi
if [[ $PHASE == binaries ]]; then  # the binaries and the libraries the GPU machine's image may lack
  G=${ZP_GPU_BIN:-build/gpu-bin}
  rm -rf "$G" && mkdir -p "$G/tests" "$G/bench" "$G/examples" "$G/lib"
  for t in $GPU_TESTS; do cp "$BUILD/tests/zp.test.$t" "$G/tests/"; done
  for b in $GPU_BENCHES; do cp "$BUILD/bench/$b" "$G/bench/"; done
  for e in zp_demo_gpu zp_demo zp_gpt; do cp "$BUILD/examples/$e" "$G/examples/"; done
  copy_lib() { cp -L "$(ldd "$1" | awk -v l="$2" '$1 == l { print $3 }')" "$G/lib/"; }
  for lib in libcudart.so.13 libbenchmark.so.1debian; do copy_lib "$G/bench/zp_bench_optim_cuda" $lib; done
  # zp_demo and zp_gpt link liburing (zp::aio) where this machine has it.
  if ldd "$G/examples/zp_demo" | grep -q "liburing.so.2 "; then copy_lib "$G/examples/zp_demo" liburing.so.2; fi
  if [[ -n "${ZP_GPU_BASE:-}" ]]; then  # the benchmarks as they were at that revision, for ab
    base=$(mktemp -d)
    git worktree add -q --detach "$base/src" "$ZP_GPU_BASE" || { log "no revision $ZP_GPU_BASE"; exit 1; }
    # shellcheck disable=SC2086  # a list of targets
    (build_tree "$base/src" "$base/build" $GPU_BENCHES) || exit 1
    mkdir -p "$G/base" && for b in $GPU_BENCHES; do cp "$base/build/bench/$b" "$G/base/"; done
    git worktree remove --force "$base/src" && rm -rf "$base"
    echo "$ZP_GPU_BASE $(git rev-parse "$ZP_GPU_BASE")" > "$G/base/REVISION"
  fi
  log "binaries in $G ($(du -sh "$G" | cut -f1)): carry it and run ZP_GPU_BIN=$G bash tools/gpu_check.sh there"
  exit 0
fi

# One test: name, seconds, command... Exit 77 is a test's "no CUDA device": here, a failure.
gpu_test() {
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" > "$OUT/test_$name.log" 2>&1
  local rc=$?
  case $rc in 0) log "PASS $name" ;; 124) log "TIMEOUT $name (stopped after $secs s)" ;; *) log "FAIL $name (exit $rc)" ;; esac
  return $rc
}
# The GPU demo's checkpoints: 60 steps saved at 30 and 60, then the same 60 resumed from step 30
# (written into `latest`, as README says to load an older tag) export the same bytes.
demo_resume() {
  local secs=$1 d=$OUT/demo_resume demo=$BUILD/examples/zp_demo_gpu
  local args=(--ranks 2 --stage 3 --steps 60 --log-every 1000 --checkpoint-dir "$OUT/demo_resume/ckpt")
  rm -rf "$d" && mkdir -p "$d"
  timeout "$secs" "$demo" "${args[@]}" --save-every 30 --export "$d/straight" > "$d/straight.log" 2>&1 &&
    echo step30 > "$d/ckpt/latest" &&
    timeout "$secs" "$demo" "${args[@]}" --resume --export "$d/resumed" > "$d/resumed.log" 2>&1 &&
    grep -q "resumed from $d/ckpt/step30 at step 30" "$d/resumed.log" &&
    cmp "$d/straight/model.safetensors" "$d/resumed/model.safetensors" &&
    rm -rf "$d/ckpt" "$d/straight" "$d/resumed"  # what failed stays, for the logs
}
test_phase() {
  local pids=() rc=0 t secs=${ZP_TEST_TIMEOUT:-240}
  for t in $GPU_TESTS; do
    gpu_test "$t" "$secs" "$BUILD/tests/zp.test.$t" & pids+=($!)
  done
  gpu_test demo_gpu "$secs" "$BUILD/examples/zp_demo_gpu" --steps 60 --log-every 20 --ranks 4 --stage 3 & pids+=($!)
  ( if demo_resume "$secs"; then log "PASS demo_gpu checkpoint resume (bitwise)"
    else log "FAIL demo_gpu checkpoint resume (logs in $OUT/demo_resume)"; exit 1; fi ) & pids+=($!)
  # The trainers' tests (as ctest runs them, the GPU demo in the simulated one's place): stopped
  # by a signal and resumed bitwise, a ds_config, the flags' errors.
  local e=$BUILD/examples
  for t in trainer_signal trainer_config trainer_flags; do
    gpu_test "$t" "$secs" bash "tests/$t.sh" "$e/zp_demo" "$e/zp_gpt" "$e/zp_demo_gpu" "$OUT" & pids+=($!)
  done
  for t in "${pids[@]}"; do wait "$t" || rc=1; done
  return $rc
}

# A sanitizer report counts unless it is NCCL probing its own kernels (ncclInitKernelsForDevice
# calls cudaFuncGetAttributes on kernels built for other architectures, then cudaGetLastError,
# and handles the cudaErrorNoKernelImageForDevice each returns: 64 reports, 32 of each, in the
# engine test on an H200) or the test's exit status (its outcome, reported apart). zp checks
# every CUDA call's return itself, so API errors of its own still fail the test.
real_errors() {
  awk 'function keep(r) { return !(r ~ /cudaErrorNoKernelImageForDevice/ && r ~ /cudaFuncGetAttributes|cudaGetLastError/ && r ~ /ncclInitKernelsForDevice/) && r !~ /Target application returned an error/ }
       /^========= [A-Z]/ && !/COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY/ { if (rec != "") n += keep(rec); rec = $0; next }
       /^========= *$/ { if (rec != "") n += keep(rec); rec = ""; next }
       rec != "" { rec = rec "\n" $0 }
       END { if (rec != "") n += keep(rec); print n + 0 }' "$1"
}
sanitize() {  # tool test seconds
  local tool=$1 t=$2 log="$OUT/$1_$2.log"
  timeout "$3" compute-sanitizer --tool "$tool" "$BUILD/tests/zp.test.$t" > "$log" 2>&1
  local rc=$? n
  if grep -q "Device not supported" "$log"; then  # gVisor's runtime: the tool, not zp
    log "$tool zp.test.$t: compute-sanitizer cannot use this machine's GPU (Device not supported): not checked"
    return 1
  fi
  n=$(real_errors "$log")
  log "$tool zp.test.$t: test exit $rc, $n error(s) ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1))"
  [[ $rc -ne 124 ]] || log "  (stopped after $3 s: inconclusive)"
  [[ $rc -eq 0 && $n -eq 0 ]]
}
memcheck_phase() {
  local pids=() rc=0 t tool secs=${ZP_SANITIZE_TIMEOUT:-300}
  for t in engine_device.cuda backend.cuda_threads.cuda quantize_device.cuda optim.gpu.cuda; do sanitize memcheck "$t" "$secs" & pids+=($!); done
  # The kernels with shared memory and block-level synchronisation: the optimizer's reductions
  # and the cuda_threads collectives.
  for tool in racecheck synccheck; do
    for t in backend.cuda_threads.cuda optim.gpu.cuda; do sanitize "$tool" "$t" "$secs" & pids+=($!); done
  done
  for t in "${pids[@]}"; do wait "$t" || rc=1; done
  return $rc
}

bench() {  # name, then the command: bounded by ZP_BENCH_TIMEOUT, output to $OUT/name.txt
  local name=$1; shift
  timeout "${ZP_BENCH_TIMEOUT:-300}" "$@" > "$OUT/$name.txt" 2>&1
  local rc=$?
  [[ $rc -eq 0 ]] || log "$name: exit $rc$([[ $rc -ne 124 ]] || echo ' (stopped by ZP_BENCH_TIMEOUT)')"
  return $rc
}
bench_phase() {
  local rc=0 args
  bench optim_cuda "$BUILD/bench/zp_bench_optim_cuda" --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
    --benchmark_out="$OUT/optim_cuda.json" --benchmark_out_format=json || rc=1
  log "zp_bench_optim_cuda (median of 3):"
  grep -E "median" "$OUT/optim_cuda.txt" | tee -a "$OUT/summary.txt"
  bench collectives_cuda "$BUILD/bench/zp_bench_collectives_cuda" --benchmark_out="$OUT/collectives_cuda.json" \
    --benchmark_out_format=json || rc=1
  log "zp_bench_collectives_cuda (cuda_threads busbw; copy_fraction against a device copy):"
  grep -E "^cuda_threads" "$OUT/collectives_cuda.txt" | tee -a "$OUT/summary.txt"
  bench zero_cuda "$BUILD/bench/zp_bench_zero_cuda" --benchmark_out="$OUT/zero_cuda.json" --benchmark_out_format=json || rc=1
  log "zp_bench_zero_cuda (engine step vs its bare kernels; offload vs device step):"
  grep -E "^zero_" "$OUT/zero_cuda.txt" | tee -a "$OUT/summary.txt"
  log "GPU demo (tokens/s and loss):"
  local steps="--steps 200 --log-every 100"
  # A size that fills the GPU (#16): 71M parameters, 8192 rows a step, so 6 x 71M x 8192 = 3.5
  # TFLOP of matrix products a step (not yet run), in fp32 (the demo's cublasSgemm on fp32 copies
  # of its bf16 weights): FP32 rates, not bf16 tensor-core ones.
  local fill="--hidden 8192 --precision bf16 --steps 50 --log-every 25"
  for args in "--ranks 1 --stage 0 $steps" "--ranks 4 --stage 3 $steps" \
              "--ranks 4 --stage 3 --offload-optimizer cpu $steps" \
              "--ranks 4 --stage 3 --offload-param cpu $steps" \
              "--ranks 1 --stage 2 --hidden 4096 --micro-batch 1024 --steps 100 --log-every 50" \
              "$fill --ranks 1 --stage 2 --micro-batch 8192" "$fill --ranks 4 --stage 3 --micro-batch 2048"; do
    # shellcheck disable=SC2086  # the demo's arguments
    bench demo_gpu "$BUILD/examples/zp_demo_gpu" $args || rc=1
    echo "zp_demo_gpu $args: $(grep -E '^summary' "$OUT/demo_gpu.txt")" | tee -a "$OUT/summary.txt"
  done
  bench torch_adamw python3 bench/torch_adamw.py || rc=1
  log "PyTorch clip_grad_norm_ + AdamW(fused=True):"
  tee -a "$OUT/summary.txt" < "$OUT/torch_adamw.txt"
  return $rc
}

# Each benchmark against its build in $BUILD/base (binaries with ZP_GPU_BASE), alternating: the
# ratio table, then the counters of the new build's first round.
ab_phase() {
  local rc=0 b e
  [[ -d $BUILD/base ]] || { log "ab: no $BUILD/base (build it: ZP_GPU_BASE=REV tools/gpu_check.sh binaries)"; return 1; }
  log "ab: new/old times against $(cat "$BUILD/base/REVISION"), ${ZP_AB_ROUNDS:-2} rounds (> 1: the new build is slower)"
  for b in $GPU_BENCHES; do
    timeout "${ZP_BENCH_TIMEOUT:-300}" python3 tools/bench_ab.py "$BUILD/base/$b" "$BUILD/bench/$b" --filter . \
      --rounds "${ZP_AB_ROUNDS:-2}" --reps 1 --save "$OUT/ab_$b" > "$OUT/ab_$b.txt" 2>&1
    e=$?
    [[ $e -eq 0 ]] || { rc=1; log "ab $b: exit $e$([[ $e -ne 124 ]] || echo ' (stopped by ZP_BENCH_TIMEOUT)')"; }
    grep -v "^bench_ab: round" "$OUT/ab_$b.txt" | tee -a "$OUT/summary.txt"
    python3 - "$OUT/ab_$b/new.1.json" <<'PY' 2>/dev/null | tee -a "$OUT/summary.txt"
import json, sys
skip = {"family_index", "per_family_instance_index", "run_name", "run_type", "repetitions", "repetition_index",
        "threads", "iterations", "real_time", "cpu_time", "time_unit", "name", "label"}
for r in json.load(open(sys.argv[1]))["benchmarks"]:
    print(r["name"], " ".join(f"{k}={v:.4g}" for k, v in r.items() if k not in skip and isinstance(v, (int, float))))
PY
  done
  return $rc
}

status=0
pids=()
if run_phase test; then test_phase & pids+=($!); fi
if run_phase memcheck; then memcheck_phase & pids+=($!); fi
for p in "${pids[@]}"; do wait "$p" || status=1; done
if run_phase ab; then ab_phase || status=1; fi
if run_phase bench; then bench_phase || status=1; fi
log "exit status $status"
exit $status
