#!/usr/bin/env bash
# tools/coverage.sh: which lines of zp's headers, trainers and tools no test runs. Builds every
# test, example and tool with Clang 16's source-based coverage (-O1; no precompiled header, whose
# functions would carry no coverage mapping into the programs that reuse it), runs ctest (the gpu
# label excepted), and merges the counts of every program: a line counts as run if any program
# ran it. Each program's profiles are merged alone (matched by build ID): one header compiled
# under other macros in two programs is two functions of one name, which a single merged profile
# would mismatch and drop.
#   tools/coverage.sh [build dir, default build/coverage]
# Writes <dir>/coverage/summary.txt (files by lines never run) and uncovered.txt (each file's runs
# of such lines, with their text). The AVX-512 paths show as never run on a CPU without AVX-512,
# the CUDA and NCCL paths always, and constexpr functions evaluated only at compile time too.
# About 10 minutes to build and 8 to test on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash cmake/install-deps.sh tests  # Clang 16, and the Python the suite's cross-checks run
for t in llvm-profdata-16 llvm-cov-16 readelf; do
  command -v "$t" > /dev/null ||
    { echo "coverage: $t is missing (Debian's llvm-16 and binutils have them)" >&2; exit 2; }
done
root=$PWD
dir=${1:-build/coverage}
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S . -B "$dir" -G Ninja -DCMAKE_CXX_COMPILER=clang++-16 -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g0" -DCMAKE_CXX_FLAGS="-fprofile-instr-generate -fcoverage-mapping" \
  -DCMAKE_EXE_LINKER_FLAGS="-fprofile-instr-generate" -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON \
  -DZP_ENABLE_MPI=ON -DZP_ENABLE_CUDA=OFF -DZP_BUILD_BENCH=OFF -DZP_BUILD_EXAMPLES=ON \
  -DZP_BUILD_TOOLS=ON > /dev/null
cmake --build "$dir"
out=$(realpath "$dir")/coverage
rm -rf "$out" && mkdir -p "$out/raw" "$out/lcov"
LLVM_PROFILE_FILE="$out/raw/%p-%m.profraw" ctest --test-dir "$dir" -j "$(nproc)" -LE '^gpu$' \
  --output-on-failure || echo "coverage: some tests failed; their lines count as far as they ran"
# Each profile under the build ID of the program that wrote it; each program's profiles merged
# and exported alone.
for raw in "$out"/raw/*.profraw; do
  echo "$(llvm-profdata-16 show --binary-ids "$raw" | tail -1) $raw"
done > "$out/profiles"
find "$dir" -type f -perm -u+x ! -path '*/CMakeFiles/*' | while read -r bin; do
  id=$(readelf -n "$bin" 2> /dev/null | awk '/Build ID/ {print $3}')
  raws=$(awk -v id="$id" '$1 == id {print $2}' "$out/profiles")
  [ -n "$id" ] && [ -n "$raws" ] || continue
  name=$(basename "$bin")
  # shellcheck disable=SC2086  # one argument per profile
  llvm-profdata-16 merge -sparse $raws -o "$out/$name.profdata"
  llvm-cov-16 export -format=lcov -skip-functions -instr-profile="$out/$name.profdata" "$bin" \
    > "$out/lcov/$name.info"
done
python3 - "$root" "$out" <<'PY'
import collections, glob, os, sys
root, out = sys.argv[1], sys.argv[2]
ran = collections.defaultdict(dict)  # file -> line -> the most any program ran it
for info in glob.glob(os.path.join(out, 'lcov', '*.info')):
    src = None
    for line in open(info):
        if line.startswith('SF:'):
            src = line[3:].strip()
        elif line.startswith('DA:') and src:
            no, count = map(int, line[3:].split(',')[:2])
            ran[src][no] = max(ran[src].get(no, 0), count)
mine = {f: d for f, d in ran.items() if f.startswith(root + '/') and
        os.path.relpath(f, root).split('/')[0] in ('include', 'examples', 'tools')}
rows = sorted(((sum(c == 0 for c in d.values()), len(d), f) for f, d in mine.items()), reverse=True)
lines = sum(r[1] for r in rows); missed = sum(r[0] for r in rows)
with open(os.path.join(out, 'summary.txt'), 'w') as s:
    s.write(f'{lines - missed} of {lines} lines run ({100 * (lines - missed) / max(lines, 1):.1f}%)\n')
    for m, n, f in rows:
        s.write(f'{m:6d} of {n:6d} never run  {os.path.relpath(f, root)}\n')
with open(os.path.join(out, 'uncovered.txt'), 'w') as u:
    for m, n, f in rows:
        if not m:
            continue
        text = open(f).read().split('\n')
        never = sorted(no for no, c in mine[f].items() if c == 0)
        runs = []  # consecutive never-run lines, joined across lines with no count
        for no in never:
            if runs and all(k not in mine[f] for k in range(runs[-1][1] + 1, no)):
                runs[-1][1] = no
            else:
                runs.append([no, no])
        u.write(f'== {os.path.relpath(f, root)}: {m} lines never run\n')
        for a, b in runs:
            u.write(f'{a}-{b}: ' + ' / '.join(text[k - 1].strip() for k in range(a, b + 1))[:200] + '\n')
PY
head -1 "$out/summary.txt"
echo "coverage: $out/summary.txt, $out/uncovered.txt"
