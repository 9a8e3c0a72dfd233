#!/bin/sh
# The node's shared segment larger than the memory cgroup the job runs in (tests/in_cgroup.sh:
# 128 MiB; the segment 2 ranks x 2 areas of 64 MiB): refused on every rank, local rank 0 naming
# the cgroup, where reserving it (posix_fallocate) got the job killed. Skipped (77) where no
# memory cgroup can be made.
#   mpi_segment_cgroup.sh MPIEXEC MPI_FAILURE_BINARY
set -u
out=$(bash "$(dirname "$0")/../in_cgroup.sh" memory=134217728 "$1" -n 2 "$2" segment 2>&1)
rc=$?
printf '%s\n' "$out"
[ "$rc" -eq 77 ] && exit 77
fail() { echo "FAIL: $*"; exit 1; }
[ "$rc" -eq 0 ] || fail "the job exited $rc"
refused=$(printf '%s\n' "$out" | grep -c "^refused: ")
[ "$refused" -eq 2 ] || fail "$refused ranks refused the segment, not 2"
printf '%s\n' "$out" | grep -q "^refused: .*the node's shared segment of [0-9]* bytes (2 local ranks x 2 areas of 67108864 bytes) is more than the [0-9.]* MiB left by the memory cgroup /" ||
  fail "no rank named the memory cgroup"
