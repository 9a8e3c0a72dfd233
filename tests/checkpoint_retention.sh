# Sourced by the kill-loop tests: keep_latest_tags <checkpoint dir> is retention as a user's
# script would do it: it drops the step<N> tags older than the one `latest` names (a tag newer
# than it is left alone: it is what a kill between publishing and naming leaves).
keep_latest_tags() {
  local dir=$1 latest d
  [ -f "$dir/latest" ] || return 0
  latest=$(cat "$dir/latest")
  for d in "$dir"/step*; do
    if [ -d "$d" ] && [ "${d##*/step}" -lt "${latest#step}" ]; then rm -rf "$d"; fi
  done
}
