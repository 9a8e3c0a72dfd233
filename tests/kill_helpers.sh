# shellcheck shell=bash
# Sourced by the kill tests.
#
# kill_naming <text>: SIGKILL every process whose command line holds <text> (mpiexec and its
# ranks too), scanning again until a scan finds none: a launcher the scan reached late may have
# started a rank behind it, which would live on beside the next run.
kill_naming() {
  local found=1 scans=0 p
  while [ "$found" -eq 1 ] && [ "$scans" -lt 100 ]; do
    found=0 scans=$((scans + 1))
    for p in /proc/[0-9]*; do
      if tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -qF -- "$1"; then
        if kill -9 "${p#/proc/}" 2>/dev/null; then found=1; fi
      fi
    done
  done
}
