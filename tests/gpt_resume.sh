#!/usr/bin/env bash
# zp_gpt's checkpoints (issue #20, data-parallel grids): 20 steps saving at 10 and 20, then a
# resume from step10 at the same grid exports the same model bytes and vocabulary and logs the
# same losses as the uninterrupted run; a resume at another rank count and stage finishes; a
# --resume into a directory with no checkpoint yet starts at step 0 and says so; a checkpoint
# resumed with another text is refused naming both vocabularies; checkpoints of a TP grid are
# refused at the command line.
#   gpt_resume.sh <zp_gpt> <work dir>
set -euo pipefail
gpt=$1 dir=$2/gpt-resume
rm -rf "$dir" && mkdir -p "$dir"
args=(--layers 2 --d-model 32 --heads 4 --context 16 --micro-batch 4 --log-every 10 --steps 20)

"$gpt" "${args[@]}" --ranks 2 --stage 3 --checkpoint-dir "$dir/ckpt" --save-every 10 \
  --export "$dir/full" --log-json "$dir/full.jsonl" > "$dir/full.log"
cp -r "$dir/ckpt" "$dir/ckpt10"
printf step10 > "$dir/ckpt10/latest"
"$gpt" "${args[@]}" --ranks 2 --stage 3 --checkpoint-dir "$dir/ckpt10" --resume \
  --export "$dir/resumed" --log-json "$dir/resumed.jsonl" > "$dir/resumed.log"
grep -q "resumed from $dir/ckpt10/step10 at step 10 (10 updates applied)" "$dir/resumed.log"
cmp "$dir/full/model.safetensors" "$dir/resumed/model.safetensors"
cmp "$dir/full/vocab.json" "$dir/resumed/vocab.json"
cmp "$dir/full/config.json" "$dir/resumed/config.json"
grep -q '"architectures": \[' "$dir/full/config.json"
# The losses of steps 11-20, as logged (the phase times differ).
losses() { grep -Eo '"step":(1[1-9]|20),"loss":[0-9.]+' "$1"; }
diff <(losses "$dir/full.jsonl") <(losses "$dir/resumed.jsonl")
[ "$(losses "$dir/full.jsonl" | wc -l)" -eq 10 ]
# vocab.json maps each id to its byte: as many entries as the vocabulary the run printed.
n=$(grep -Eo 'vocabulary [0-9]+' "$dir/full.log" | grep -Eo '[0-9]+')
[ "$(grep -o ',' "$dir/full/vocab.json" | wc -l)" -eq $((n - 1)) ]
echo "same grid: resume from step 10 equals the uninterrupted run bit for bit"

"$gpt" "${args[@]}" --ranks 4 --stage 1 --checkpoint-dir "$dir/ckpt10" --resume > "$dir/other.log"
grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in 10 steps" "$dir/other.log"
echo "another grid: resumed at 4 ranks, stage 1, and finished"

"$gpt" "${args[@]}" --ranks 2 --checkpoint-dir "$dir/fresh" --resume > "$dir/fresh.log"
grep -q "no checkpoint in $dir/fresh yet: starting at step 0" "$dir/fresh.log"

printf 'abcabcabcabc%.0s' $(seq 100) > "$dir/other.txt"
if "$gpt" "${args[@]}" --ranks 2 --checkpoint-dir "$dir/ckpt10" --resume --text "$dir/other.txt" \
  > "$dir/vocab.log" 2>&1; then
  echo "a checkpoint of another vocabulary was loaded"
  exit 1
fi
grep -q "the checkpoint's vocabulary ($n characters) is not the training text's (4 characters)" \
  "$dir/vocab.log"
if "$gpt" "${args[@]}" --ranks 2 --tp 2 --export "$dir/tp" > "$dir/tp.log" 2>&1; then
  echo "an export of a TP grid was accepted"
  exit 1
fi
grep -q -- "--checkpoint-dir, --export, --init-from and --sample need --tp 1 --pp 1 for now" "$dir/tp.log"
rm -rf "$dir"
echo "zp_gpt checkpoints: ok"
