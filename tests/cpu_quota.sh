#!/usr/bin/env bash
# Runs a command in a new cgroup whose CPU quota is 1 CPU, as `docker --cpus=1` or a Kubernetes
# CPU limit of 1 would (cgroup v1's cpu.cfs_quota_us, or v2's cpu.max), with ZP_TEST_CPU_QUOTA=1
# saying so; exits 77 (skipped) where no such cgroup can be made (not root, a read-only cgroupfs,
# v2 without the cpu controller), saying why.
#   cpu_quota.sh COMMAND [ARG ...]
set -u
name=zp-cpu-quota-$$
v1=$(awk '$3 == "cgroup" && $4 ~ /(^|,)cpu(,|$)/ { print $2; exit }' /proc/mounts)
v2=$(awk '$3 == "cgroup2" { print $2; exit }' /proc/mounts)
if [[ -n $v1 ]]; then
  dir=$v1/$name
  set_quota() { echo 100000 > "$dir/cpu.cfs_period_us" && echo 100000 > "$dir/cpu.cfs_quota_us"; }
elif [[ -n $v2 ]] && grep -qw cpu "$v2/cgroup.subtree_control" 2> /dev/null; then
  dir=$v2/$name
  set_quota() { echo "100000 100000" > "$dir/cpu.max"; }
else
  echo "skipped: no cgroup hierarchy with the cpu controller here (v1: none mounted; v2: cpu not" \
    "in $v2/cgroup.subtree_control)"
  exit 77
fi
if ! mkdir "$dir" 2> /dev/null; then
  echo "skipped: cannot make the cgroup $dir (needs root and a writable cgroupfs)"
  exit 77
fi
if ! set_quota 2> /dev/null; then
  rmdir "$dir"
  echo "skipped: cannot set a CPU quota on $dir"
  exit 77
fi
(
  if ! echo "$BASHPID" > "$dir/cgroup.procs" 2> /dev/null; then
    echo "skipped: cannot move a process into $dir"
    exit 77
  fi
  exec env ZP_TEST_CPU_QUOTA=1 "$@"
)
rc=$?
rmdir "$dir"  # empty again: its only process has ended
exit $rc
