#!/bin/sh
# Each rank in a PID namespace of its own, as ranks in containers of their own on one machine
# are: a pid names another process there, or none, so the node's shared segment (opened, and its
# peers watched, through their pids) must be refused on every rank naming the cause, and the
# collectives must run without it. Skipped (77) where no PID namespace can be made (not root).
#   mpi_pid_namespaces.sh MPIEXEC MPI_FAILURE_BINARY
set -u
mpiexec=$1 bin=$2
if ! unshare --pid --fork --mount-proc true 2> /dev/null; then
  echo "skipped: cannot make a PID namespace here (unshare --pid --fork --mount-proc)"
  exit 77
fi
# tcp: OpenMPI's own shared-memory transport reaches its peers by pid too (CMA).
out=$("$mpiexec" -n 2 --mca btl tcp,self unshare --pid --fork --mount-proc "$bin" pid_namespaces \
  2>&1)
rc=$?
printf '%s\n' "$out"
fail() { echo "FAIL: $*"; exit 1; }
[ "$rc" -eq 0 ] || fail "the job exited $rc"
cause="the ranks of its node run in different PID namespaces"
named=$(printf '%s\n' "$out" | grep -c "^refused: .*$cause")
[ "$named" -eq 2 ] || fail "$named ranks named the cause, not 2"
ran=$(printf '%s\n' "$out" | grep -c "^without the segment: all_reduce ok")
[ "$ran" -eq 2 ] || fail "$ran ranks ran the all_reduce without the segment, not 2"
