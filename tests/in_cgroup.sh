#!/usr/bin/env bash
# Runs a command in a new cgroup that limits it as a container or a batch job would, and says so
# in the environment; exits 77 (skipped), saying why, where no such cgroup can be made (not root,
# a read-only cgroupfs, v2 without the controller, swap that cannot be limited).
#   in_cgroup.sh cpu COMMAND [ARG ...]          a CPU quota of 1 CPU (docker --cpus=1, a
#                                               Kubernetes CPU limit): ZP_TEST_CPU_QUOTA=1
#   in_cgroup.sh memory=BYTES COMMAND [ARG ...] a memory limit and no swap (docker --memory,
#                                               a Kubernetes memory limit): ZP_TEST_MEMORY_LIMIT
set -u
what=$1
shift
name=zp-test-$$
case $what in
  cpu) controller=cpu ;;
  memory=*) controller=memory bytes=${what#memory=} ;;
  *) echo "in_cgroup.sh: the first argument is cpu or memory=BYTES, got '$what'" >&2; exit 2 ;;
esac
v1=$(awk -v c="$controller" '$3 == "cgroup" && $4 ~ "(^|,)" c "(,|$)" { print $2; exit }' /proc/mounts)
v2=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
if [[ -n $v1 ]]; then
  dir=$v1/$name
elif [[ -n $v2 ]] && grep -qw "$controller" "$v2/cgroup.subtree_control" 2> /dev/null; then
  dir=$v2/$name
else
  echo "skipped: no cgroup hierarchy with the $controller controller here (v1: none mounted;" \
    "v2: $controller not in $v2/cgroup.subtree_control)"
  exit 77
fi
limit() {
  case $controller/$([[ -n $v1 ]] && echo v1 || echo v2) in
    cpu/v1) echo 100000 > "$dir/cpu.cfs_period_us" && echo 100000 > "$dir/cpu.cfs_quota_us" ;;
    cpu/v2) echo "100000 100000" > "$dir/cpu.max" ;;
    # No swap: past the limit the kernel kills, as where a machine has none (Kubernetes' nodes).
    memory/v1)
      echo "$bytes" > "$dir/memory.limit_in_bytes" || return 1
      if [[ -e $dir/memory.memsw.limit_in_bytes ]]; then
        echo "$bytes" > "$dir/memory.memsw.limit_in_bytes"
      else
        [[ $(awk '$1 == "SwapTotal:" { print $2 }' /proc/meminfo) == 0 ]]
      fi
      ;;
    memory/v2) echo "$bytes" > "$dir/memory.max" && echo 0 > "$dir/memory.swap.max" ;;
  esac
}
if ! mkdir "$dir" 2> /dev/null; then
  echo "skipped: cannot make the cgroup $dir (needs root and a writable cgroupfs)"
  exit 77
fi
if ! limit 2> /dev/null; then
  rmdir "$dir"
  echo "skipped: cannot set the $what limit on $dir (or its swap)"
  exit 77
fi
(
  if ! echo "$BASHPID" > "$dir/cgroup.procs" 2> /dev/null; then
    echo "skipped: cannot move a process into $dir"
    exit 77
  fi
  if [[ $controller == cpu ]]; then
    exec env ZP_TEST_CPU_QUOTA=1 "$@"
  else
    exec env ZP_TEST_MEMORY_LIMIT="$bytes" "$@"
  fi
)
rc=$?
# Empty again once its processes have gone (those of a killed job can take a moment).
for _ in 1 2 3 4 5 6 7 8 9 10; do
  rmdir "$dir" 2> /dev/null && break
  sleep 0.5
done
exit $rc
