#!/usr/bin/env bash
# zp_gpt --sample (issue #20): trained on a repeating text, greedy sampling continues the
# pattern; the same sample comes from the checkpoint (--resume with no steps left), there
# loaded on a dp 1 x tp 2 x pp 2 grid too; a prompt character outside the vocabulary is refused
# with its reason, before any training; --eval-every prints a falling validation loss.
#   gpt_sample.sh <zp_gpt> <work dir>
set -euo pipefail
gpt=$1 dir=$2/gpt-sample
rm -rf "$dir" && mkdir -p "$dir"
printf 'abcdefgh%.0s' $(seq 400) > "$dir/pattern.txt"
args=(--text "$dir/pattern.txt" --layers 1 --d-model 32 --heads 4 --context 16 --micro-batch 8
      --lr 1e-2 --steps 150 --log-every 50 --sample 24 --temperature 0)
"$gpt" "${args[@]}" --ranks 2 --prompt cde --checkpoint-dir "$dir/ckpt" --save-every 150 \
  --eval "$dir/pattern.txt" --eval-every 50 > "$dir/train.log"
want=cdefghabcdefghabcdefghabcde
grep -qx "$want" "$dir/train.log"
# --eval-every: a validation loss every 50 steps, falling; the last one is the final model's.
evals=$(sed -n 's/^eval: step \([0-9]*\) loss \([0-9.]*\)$/\1 \2/p' "$dir/train.log" | tr '\n' ' ')
final=$(sed -n 's/^eval: loss \([0-9.]*\) over .*/\1/p' "$dir/train.log")
read -r s1 l1 s2 _ s3 l3 rest <<< "$evals"
if [ "$s1 $s2 $s3" != "50 100 150" ] || [ -n "$rest" ] || [ "$l3" != "$final" ] ||
   ! awk -v a="$l1" -v b="$l3" 'BEGIN { exit !(b < a) }'; then
  echo "--eval-every 50: got '$evals', final eval '$final'"; exit 1
fi
echo "validation loss every 50 steps: $evals(final $final)"
"$gpt" "${args[@]}" --ranks 2 --prompt cde --checkpoint-dir "$dir/ckpt" --resume > "$dir/resumed.log"
grep -q "resumed from $dir/ckpt/step150 at step 150" "$dir/resumed.log"
grep -qx "$want" "$dir/resumed.log"
if grep -q "summary:" "$dir/resumed.log"; then echo "a run with no steps left printed a summary"; exit 1; fi
echo "greedy sample after training and from the checkpoint: $want"
if "$gpt" "${args[@]}" --prompt cdx > "$dir/bad.log" 2>&1; then echo "an unknown prompt character was accepted"; exit 1; fi
grep -q "the character 'x' (byte 120) is not in the training text's vocabulary" "$dir/bad.log"
if grep -q "^step" "$dir/bad.log"; then echo "the prompt was refused only after training"; exit 1; fi
"$gpt" "${args[@]}" --prompt cde --ranks 4 --tp 2 --pp 2 --checkpoint-dir "$dir/ckpt" --resume > "$dir/grid.log"
grep -qx "$want" "$dir/grid.log"
echo "the same sample from the checkpoint loaded on a 1 x 2 x 2 grid"
rm -rf "$dir"
echo "zp_gpt sampling: ok"
