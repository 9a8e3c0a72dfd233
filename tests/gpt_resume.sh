#!/usr/bin/env bash
# zp_gpt's checkpoints (issue #20): 20 steps saving at 10 and 20, then a resume from step10 at
# the same grid exports the same model bytes and vocabulary and logs the same losses as the
# uninterrupted run; a resume at another rank count and stage finishes; the same on a
# dp 2 x tp 2 x pp 2 grid (same losses), whose checkpoint then resumes at tp 1 pp 1 (and at
# tp 4) and trains on with the loss falling; the grid's export and sample equal those of its
# checkpoint loaded on one rank, bit for bit, and --init-from of that export on other grids
# exports the same bytes; a --resume into a directory with no checkpoint yet starts at step 0
# and says so; a checkpoint resumed with another text is refused naming both vocabularies. The
# grid trains with --decay matrices, which its checkpoint keeps: a resume without it is refused.
# Hybrid sharding (shard groups of 2 of dp 4, x tp 2) resumes exactly and exports its checkpoint,
# and so does ZeRO++ (qwZ and qgZ) on a dp 2 x tp 2 grid.
#   gpt_resume.sh <zp_gpt> <work dir>
set -euo pipefail
gpt=$1 dir=$2/gpt-resume
rm -rf "$dir" && mkdir -p "$dir"
args=(--layers 2 --d-model 32 --heads 4 --context 16 --micro-batch 4 --log-every 10)
args20=("${args[@]}" --steps 20)

"$gpt" "${args20[@]}" --ranks 2 --stage 3 --checkpoint-dir "$dir/ckpt" --save-every 10 \
  --export "$dir/full" --log-json "$dir/full.jsonl" > "$dir/full.log"
cp -r "$dir/ckpt" "$dir/ckpt10"
printf step10 > "$dir/ckpt10/latest"
"$gpt" "${args20[@]}" --ranks 2 --stage 3 --checkpoint-dir "$dir/ckpt10" --resume \
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

"$gpt" "${args20[@]}" --ranks 4 --stage 1 --checkpoint-dir "$dir/ckpt10" --resume > "$dir/other.log"
grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in 10 steps" "$dir/other.log"
echo "another grid: resumed at 4 ranks, stage 1, and finished"

# A 2 x 2 x 2 grid: resume at the same grid logs the same losses; at tp 1 pp 1 and at tp 4 it
# trains on from the grid's checkpoint (the loss falls) and exports.
grid=(--ranks 8 --tp 2 --pp 2 --stage 2 --decay matrices)
"$gpt" "${args20[@]}" "${grid[@]}" --checkpoint-dir "$dir/g" --save-every 10 \
  --log-json "$dir/g.jsonl" --export "$dir/g-grid" --sample 40 > "$dir/g.log"
cp -r "$dir/g" "$dir/g10"
printf step10 > "$dir/g10/latest"
"$gpt" "${args20[@]}" "${grid[@]}" --checkpoint-dir "$dir/g10" --resume \
  --log-json "$dir/g-resumed.jsonl" > "$dir/g-resumed.log"
diff <(losses "$dir/g.jsonl") <(losses "$dir/g-resumed.jsonl")
[ "$(losses "$dir/g.jsonl" | wc -l)" -eq 10 ]
echo "2 x 2 x 2 grid: resume from step 10 logs the uninterrupted run's losses"
"$gpt" "${args20[@]}" --ranks 1 --stage 0 --decay matrices --checkpoint-dir "$dir/g" --resume \
  --export "$dir/g-one" --sample 40 > "$dir/g-one.log"
cmp "$dir/g-grid/model.safetensors" "$dir/g-one/model.safetensors"
sample() { sed -n '/^sample (/,$p' "$1" | sed '/^summary/,$d' | sed '/^$/d'; }
[ -n "$(sample "$dir/g-one.log")" ]
diff <(sample "$dir/g.log") <(sample "$dir/g-one.log")
for g in "--ranks 4 --tp 2 --pp 2" "--ranks 4 --tp 4 --stage 1"; do
  # shellcheck disable=SC2086  # the grid's flags split into words on purpose
  "$gpt" "${args[@]}" $g --steps 0 --init-from "$dir/g-grid" --export "$dir/g-again" > /dev/null
  cmp "$dir/g-grid/model.safetensors" "$dir/g-again/model.safetensors"
done
echo "the grid's export and sample equal its checkpoint's on one rank; --init-from on grids"
# Hybrid sharding on a grid (dp 4 in shard groups of 2, x tp 2): a resume from step 10 logs the
# uninterrupted run's losses, and its export equals its checkpoint's loaded on one rank.
hy=(--ranks 8 --tp 2 --stage 3 --shard-group-size 2)
"$gpt" "${args20[@]}" "${hy[@]}" --checkpoint-dir "$dir/h" --save-every 10 \
  --log-json "$dir/h.jsonl" --export "$dir/h-grid" > "$dir/h.log"
grep -q "hybrid sharding: ZeRO over groups of 2 data-parallel ranks" "$dir/h.log"
cp -r "$dir/h" "$dir/h10"
printf step10 > "$dir/h10/latest"
"$gpt" "${args20[@]}" "${hy[@]}" --checkpoint-dir "$dir/h10" --resume \
  --log-json "$dir/h-resumed.jsonl" > "$dir/h-resumed.log"
diff <(losses "$dir/h.jsonl") <(losses "$dir/h-resumed.jsonl")
[ "$(losses "$dir/h.jsonl" | wc -l)" -eq 10 ]
"$gpt" "${args20[@]}" --ranks 1 --checkpoint-dir "$dir/h" --resume --export "$dir/h-one" \
  > "$dir/h-one.log"
cmp "$dir/h-grid/model.safetensors" "$dir/h-one/model.safetensors"
echo "hybrid sharding on a grid: resume logs the same losses; export equals the checkpoint's"
# ZeRO++ (qwZ, qgZ over 2 nodes of 1) on a dp 2 x tp 2 grid, whose segments are cut by kind: a
# resume from step 10 logs the uninterrupted run's losses and exports its bytes, and the
# checkpoint loaded on one rank (another layout) exports them too.
zq=(--ranks 4 --tp 2 --stage 3 --zero-quantized-weights --zero-quantized-gradients
  --ranks-per-node 1)
"$gpt" "${args20[@]}" "${zq[@]}" --checkpoint-dir "$dir/q" --save-every 10 \
  --log-json "$dir/q.jsonl" --export "$dir/q-grid" > "$dir/q.log"
cp -r "$dir/q" "$dir/q10"
printf step10 > "$dir/q10/latest"
"$gpt" "${args20[@]}" "${zq[@]}" --checkpoint-dir "$dir/q10" --resume \
  --log-json "$dir/q-resumed.jsonl" --export "$dir/q-resumed" > "$dir/q-resumed.log"
diff <(losses "$dir/q.jsonl") <(losses "$dir/q-resumed.jsonl")
[ "$(losses "$dir/q.jsonl" | wc -l)" -eq 10 ]
cmp "$dir/q-grid/model.safetensors" "$dir/q-resumed/model.safetensors"
"$gpt" "${args20[@]}" --ranks 1 --checkpoint-dir "$dir/q" --resume --export "$dir/q-one" \
  > "$dir/q-one.log"
cmp "$dir/q-grid/model.safetensors" "$dir/q-one/model.safetensors"
echo "ZeRO++ on a tensor-parallel grid: resume is bitwise; export equals the checkpoint's"

if "$gpt" "${args[@]}" --steps 40 --ranks 2 --checkpoint-dir "$dir/g" --resume \
  > "$dir/g-decay.log" 2>&1; then
  echo "a checkpoint trained with --decay matrices was resumed with weight decay on everything"
  exit 1
fi
grep -q "trained with weight decay off for parameter 'h.0.ln_1.weight', which this engine's \
weight_decay_filter decays" "$dir/g-decay.log"
"$gpt" "${args[@]}" --steps 40 --ranks 2 --stage 3 --decay matrices --checkpoint-dir "$dir/g" \
  --resume > "$dir/g-dp.log"
grep -q "resumed from $dir/g/step20 at step 20 (20 updates applied)" "$dir/g-dp.log"
"$gpt" "${args[@]}" --steps 40 --ranks 4 --tp 4 --stage 1 --decay matrices --checkpoint-dir \
  "$dir/g" --resume > "$dir/g-tp4.log"
for log in "$dir/g-dp.log" "$dir/g-tp4.log"; do
  first=$(grep -Eo 'summary: loss [0-9.]+' "$log" | grep -Eo '[0-9.]+$')
  last=$(grep -Eo 'summary: loss [0-9.]+ -> [0-9.]+' "$log" | grep -Eo '[0-9.]+$')
  awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'
done
echo "the grid's checkpoint resumed at dp 2 and at tp 4: the loss falls; without its decay: refused"

"$gpt" "${args20[@]}" --ranks 2 --checkpoint-dir "$dir/fresh" --resume > "$dir/fresh.log"
grep -q "no checkpoint in $dir/fresh yet: starting at step 0" "$dir/fresh.log"

printf 'abcabcabcabc%.0s' $(seq 100) > "$dir/other.txt"
if "$gpt" "${args20[@]}" --ranks 2 --checkpoint-dir "$dir/ckpt10" --resume --text "$dir/other.txt" \
  > "$dir/vocab.log" 2>&1; then
  echo "a checkpoint of another vocabulary was loaded"
  exit 1
fi
grep -Eq "the checkpoint's vocabulary \($n characters\) is not the training text's \(4 characters\): token id [0-9]+ is ('.'|byte 0x[0-9a-f]{2}) in the checkpoint and ('.'|byte 0x[0-9a-f]{2}) in the text" \
  "$dir/vocab.log"
# As many characters (a newline and n - 1 from '!' on), other ones: the first token id whose
# character differs is named.
awk -v n="$n" 'BEGIN { for (k = 0; k < 40; ++k) { for (i = 1; i < n; ++i) printf "%c", 32 + i; print "" } }' \
  > "$dir/same_size.txt"
if "$gpt" "${args20[@]}" --ranks 2 --checkpoint-dir "$dir/ckpt10" --resume \
  --text "$dir/same_size.txt" > "$dir/same_size.log" 2>&1; then
  echo "a checkpoint of another vocabulary of the same size was loaded"
  exit 1
fi
grep -Eq "the checkpoint's vocabulary \($n characters\) is not the training text's \($n characters\): token id [0-9]+ is ('.'|byte 0x[0-9a-f]{2}) in the checkpoint and '.' in the text" \
  "$dir/same_size.log"
rm -rf "$dir"
echo "zp_gpt checkpoints: ok"
