#!/bin/sh
# A rank killed mid-collective (mpi_failure kill): the job must fail within seconds (the
# watchdog's timeout there is 20 s), naming rank 1, and leave no shared segment behind.
#   mpi_kill.sh MPIEXEC NP MPI_FAILURE_BINARY
set -u
mpiexec=$1 np=$2 bin=$3
start=$(date +%s)
out=$("$mpiexec" -n "$np" "$bin" kill 2>&1)
rc=$?
took=$(($(date +%s) - start))
printf '%s\n' "$out"
fail() { echo "FAIL: $*"; exit 1; }
[ "$rc" -ne 0 ] || fail "the job exited 0"
[ "$took" -lt 15 ] || fail "the job took ${took} s to end (the watchdog's 20 s timeout must not be what ends it)"
# Either zp's check of its node's processes or mpiexec itself names the killed rank first.
printf '%s\n' "$out" | grep -Eq "rank 1 of its node \(pid [0-9]+\) is gone|rank 1 with PID [0-9]+ .*(signal 9|Killed)" ||
  fail "no message names rank 1"
for f in /dev/shm/zp-*; do
  [ -e "$f" ] || continue
  pid=${f#/dev/shm/zp-}
  pid=${pid%%-*}
  kill -0 "$pid" 2>/dev/null || fail "shared segment $f outlived its job"
done
echo "PASS: the job ended in ${took} s naming rank 1; no segment left"
