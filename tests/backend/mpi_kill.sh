#!/bin/sh
# A rank killed mid-collective (mpi_failure kill): the job must fail within seconds (the
# watchdog's timeout there is 20 s), naming rank 1, and leave no shared segment behind (zp's
# segments have no name; any zp-* name in /dev/shm that the job made is one left behind).
#   mpi_kill.sh MPIEXEC NP MPI_FAILURE_BINARY [own]
# own: OpenMPI's --enable-recovery keeps mpiexec from ending the job when rank 1 dies, so only
# zp's own check of its node's processes can end it early; its message must be the one seen.
set -u
mpiexec=$1 np=$2 bin=$3 own=${4:-}
before=$(ls /dev/shm 2>/dev/null | grep '^zp-' || true)
start=$(date +%s)
if [ "$own" = own ]; then
  out=$("$mpiexec" --enable-recovery -n "$np" "$bin" kill 2>&1)
else
  out=$("$mpiexec" -n "$np" "$bin" kill 2>&1)
fi
rc=$?
took=$(($(date +%s) - start))
printf '%s\n' "$out"
fail() { echo "FAIL: $*"; exit 1; }
# (Under --enable-recovery OpenMPI's mpiexec exits 0 even after MPI_Abort: the message decides.)
[ "$rc" -ne 0 ] || [ "$own" = own ] || fail "the job exited 0"
[ "$took" -lt 15 ] || fail "the job took ${took} s to end (the watchdog's 20 s timeout must not be what ends it)"
zp_named="rank [0-9]+ of $np \(world rank [0-9]+\) in all_reduce \(call #3, count=1000, dtype=f32, op=sum\): rank 1 of its node \(pid [0-9]+\) is gone"
if [ "$own" = own ]; then
  printf '%s\n' "$out" | grep -Eq "$zp_named" || fail "zp's own message does not name rank 1"
else  # either zp's check of its node's processes or mpiexec itself names the killed rank first
  printf '%s\n' "$out" | grep -Eq "$zp_named|rank 1 with PID [0-9]+ .*(signal 9|Killed)" ||
    fail "no message names rank 1"
fi
for f in /dev/shm/zp-*; do
  [ -e "$f" ] || continue
  printf '%s\n' "$before" | grep -qxF "${f#/dev/shm/}" ||
    fail "shared segment $f outlived its job"
done
echo "PASS: the job ended in ${took} s naming rank 1; no segment left"
