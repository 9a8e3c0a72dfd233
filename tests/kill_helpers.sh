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

# keep_latest_tags <checkpoint dir> is retention as a user's script would do it: it drops the
# step<N> tags older than the one `latest` names (a tag newer than it is left alone: it is what a
# kill between publishing and naming leaves).
keep_latest_tags() {
  local dir=$1 latest d
  [ -f "$dir/latest" ] || return 0
  latest=$(cat "$dir/latest")
  for d in "$dir"/step*; do
    if [ -d "$d" ] && [ "${d##*/step}" -lt "${latest#step}" ]; then rm -rf "$d"; fi
  done
}
