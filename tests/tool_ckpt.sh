#!/usr/bin/env bash
# zp_ckpt on checkpoints of zp_demo: info, verify, export, reshard (the demo then resumes from
# the resharded copy), verify naming a corrupted file, list, prune, and usage mistakes refused;
# info on zp_gpt's checkpoint of a run with --decay matrices lists the parameters without decay.
#   tool_ckpt.sh <zp_ckpt> <zp_demo> <zp_gpt> <work dir>
set -euo pipefail
tool=$1 demo=$2 gpt=$3
dir=$4/tool-ckpt
rm -rf "$dir"
"$demo" --steps 6 --micro-batch 4 --save-every 3 --log-every 3 --ranks 2 --stage 1 --checkpoint-dir "$dir/ckpt" > /dev/null
"$tool" info "$dir/ckpt" | tee "$dir.info"
grep -q "saved by 2 ranks (dp 2 x tp 1 x pp 1) at ZeRO stage 1, bf16 parameters, optimizer AdamW" "$dir.info"
grep -q "step 6" "$dir.info"
if grep -q "no weight decay" "$dir.info"; then echo "zp_demo decays every parameter"; exit 1; fi
"$gpt" --steps 2 --layers 2 --d-model 32 --context 16 --ranks 2 --decay matrices \
  --checkpoint-dir "$dir/gpt" --save-every 2 > /dev/null
"$tool" info "$dir/gpt" > "$dir.gpt.info"
grep -q "no weight decay on 18 of them: h.0.ln_1.weight h.0.ln_1.bias h.0.attn.c_attn.bias \
h.0.attn.c_proj.bias h.0.ln_2.weight h.0.ln_2.bias h.0.mlp.c_fc.bias h.0.mlp.c_proj.bias \
... (10 more)" "$dir.gpt.info"
"$tool" verify "$dir/ckpt" --tag step3 > "$dir.verify"
test "$(grep -c "^ok" "$dir.verify")" = 2
"$tool" export "$dir/ckpt" "$dir/export" --master --max-file-bytes 200000
test -s "$dir/export/model.safetensors.index.json"
# Again as one file into the same folder: the split files go (their index would shadow it).
"$tool" export "$dir/ckpt" "$dir/export" --master
test -s "$dir/export/model.safetensors"
test ! -e "$dir/export/model.safetensors.index.json"
if ls "$dir/export"/model-*-of-*.safetensors 2> /dev/null; then echo "an earlier export's shards stayed"; exit 1; fi
"$tool" reshard "$dir/ckpt" --ranks 3
test "$(cat "$dir/ckpt/latest")" = step6-3ranks
# A copy of an older checkpoint does not move latest back to it.
"$tool" reshard "$dir/ckpt" --tag step3 --ranks 3 | tee "$dir.reshard"
grep -q "latest names another checkpoint and stays" "$dir.reshard"
test "$(cat "$dir/ckpt/latest")" = step6-3ranks
"$tool" info "$dir/ckpt" > "$dir.info"
grep -q "saved by 3 ranks" "$dir.info"
"$demo" --steps 8 --micro-batch 4 --log-every 4 --ranks 3 --stage 3 --checkpoint-dir "$dir/ckpt" --resume > "$dir.demo"
grep -q "resumed from $dir/ckpt/step6-3ranks at step 6" "$dir.demo"
# A flipped byte is named, with a failing exit status.
f="$dir/ckpt/step6/rank-00001-of-00002.safetensors"
printf '\xff' | dd of="$f" bs=1 seek=100 conv=notrunc status=none
if "$tool" verify "$dir/ckpt" --tag step6 > "$dir.verify"; then echo "verify passed a corrupt file"; exit 1; fi
grep -q "FAILED  checkpoint file $f has CRC-32C" "$dir.verify"
# A FIFO where a rank file should be is named, not waited on (timeout: a hang fails the test).
f="$dir/ckpt/step3/rank-00000-of-00002.safetensors"
rm "$f" && mkfifo "$f"
if timeout 20 "$tool" verify "$dir/ckpt" --tag step3 > "$dir.verify"; then echo "verify passed a FIFO"; exit 1; fi
grep -q "FAILED  cannot read $f: not a regular file (a FIFO)" "$dir.verify"
# Numbers out of range are refused, naming the flag and the range (4294967297 used to wrap to 1).
for bad in 4294967297 0 -1 3x 99999999999999999999; do
  if "$tool" reshard "$dir/ckpt" --ranks "$bad" 2> "$dir.err"; then echo "reshard took --ranks $bad"; exit 1; fi
  grep -q -- "--ranks expects an integer in \[1, 16777216\], got '$bad'" "$dir.err"
done
# list: by step (equal steps by time), latest marked, an unreadable manifest last, then what an
# unfinished save left.
p=$dir/prune
"$demo" --steps 12 --micro-batch 4 --save-every 3 --log-every 12 --ranks 2 --stage 1 --checkpoint-dir "$p" > /dev/null
"$tool" reshard "$p" --tag step6 --ranks 3 --out-tag copy6 > /dev/null
mkdir "$p/.step15.partial" "$p/.$(printf 'x\033[2J')y.partial"  # (that name's escape sequence printed escaped)
echo '{' > "$p/step3/manifest.json"
"$tool" list "$p" | tee "$dir.list"
test "$(awk 'NR > 1 {printf "%s ", $1}' "$dir.list")" = 'step6 copy6 step9 step12 step3 .step15.partial: .x\x1b[2Jy.partial: '
grep -q "^5 checkpoints in $p$" "$dir.list"
grep -q "^  copy6   step 6 .* 3 ranks  stage 1  bf16 .* UTC$" "$dir.list"
grep -q "^  step12 .*(latest)$" "$dir.list"
grep -q "^  step3  .*unreadable: checkpoint manifest $p/step3/manifest.json" "$dir.list"
# prune refuses while a save holds the directory, touching nothing.
if flock "$p/.zp-save.lock" "$tool" prune "$p" --keep 2 2> "$dir.err"; then echo "prune ran beside a save"; exit 1; fi
grep -q "$p is locked by another checkpoint save" "$dir.err"
test -d "$p/.step15.partial"
test -d "$p/step6"
# It keeps the two newest up to latest, keeps the unreadable one, and removes the leftover.
"$tool" prune "$p" --keep 2 | tee "$dir.prune"
grep -qx "removed $p/.step15.partial (left by a save that did not finish)" "$dir.prune"
grep -qxF "removed $p/.x\x1b[2Jy.partial (left by a save that did not finish)" "$dir.prune"
grep -qx "removed $p/step6" "$dir.prune"
grep -qx "removed $p/copy6" "$dir.prune"
grep -qx "pruned $p: 2 checkpoints removed" "$dir.prune"
test "$(find "$p" -mindepth 1 -maxdepth 1 -printf '%f\n' | LC_ALL=C sort | tr '\n' ' ')" = ".zp-save.lock latest step12 step3 step9 "
# A step past latest's stays; a latest that does not read removes nothing, with status 1.
echo step9 > "$p/latest"
"$tool" prune "$p" --keep 1 | grep -qx "pruned $p: 0 checkpoints removed"
test -d "$p/step12"
echo step3 > "$p/latest"
if "$tool" prune "$p" --keep 1 > /dev/null 2> "$dir.err"; then echo "prune passed an unreadable latest"; exit 1; fi
grep -q "$p/step3: .latest. names it but its manifest does not read; nothing removed" "$dir.err"
test -d "$p/step9"
test -d "$p/step12"
if "$tool" prune "$dir/none" --keep 1 2> "$dir.err"; then echo "prune passed a missing directory"; exit 1; fi
grep -q "checkpoint: $dir/none: No such file or directory" "$dir.err"
if "$tool" prune "$p/latest" --keep 1 2> "$dir.err"; then echo "prune passed a file"; exit 1; fi
grep -q "checkpoint: $p/latest is not a directory" "$dir.err"
# Usage mistakes: status 2 and what was wrong; --help: status 0.
usage_error() {  # <message> <arguments...>
  local msg=$1 rc=0
  shift
  "$tool" "$@" 2> "$dir.err" || rc=$?
  [ "$rc" = 2 ] || { echo "zp_ckpt $*: exit status $rc, expected 2"; exit 1; }
  grep -qF -- "$msg" "$dir.err" || { echo "zp_ckpt $*: no '$msg' in:"; cat "$dir.err"; exit 1; }
}
usage_error "verify does not take --ranks" verify "$dir/ckpt" --ranks 2
usage_error "info does not take --master" info "$dir/ckpt" --master
usage_error "export's OUT $dir/ckpt/step3/ is inside DIR $dir/ckpt, whose entries are checkpoints" \
  export "$dir/ckpt" "$dir/ckpt/step3/"
test ! -e "$dir/ckpt/step3/model.safetensors"
usage_error "--tag is given twice" info "$dir/ckpt" --tag step3 --tag step6
usage_error "--tag expects a value, got an empty one" info "$dir/ckpt" --tag ""
usage_error "--out-tag expects a value, got the flag '--ranks'" reshard "$dir/ckpt" --out-tag --ranks 2
usage_error "unknown command 'bogus'" bogus "$dir/ckpt"
usage_error "no checkpoint directory" info
usage_error "prune takes DIR and --keep N" prune "$p"
usage_error "--keep expects an integer in [1, 2147483647], got '0'" prune "$p" --keep 0
usage_error "list does not take --tag" list "$p" --tag step9
usage_error "list takes one directory" list "$p" "$p"
"$tool" --help > "$dir.err"
grep -q "usage: zp_ckpt list    DIR" "$dir.err"
grep -q "zp_ckpt prune   DIR --keep N" "$dir.err"
rm -rf "$dir" "$dir.info" "$dir.verify" "$dir.demo" "$dir.err" "$dir.list" "$dir.prune" "$dir.reshard"
echo "zp_ckpt: ok"
