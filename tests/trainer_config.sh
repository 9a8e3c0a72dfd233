#!/usr/bin/env bash
# zp_demo, zp_gpt and the device demo --config (issue #20): a DeepSpeed ds_config.json sets the
# stage, precision, batch (its "auto" micro-batch from --micro-batch), optimizer, scheduler and
# clipping, on a dp 2 x pp 2 grid for zp_gpt; the run prints what it read, uses it, and trains;
# Hugging Face's "auto" keys come from the flags and the model; a misspelt key is refused naming the key it
# meant. zp_gpt trains the same with either pipeline
# schedule, then resumes from a checkpoint saved with the config.
#   trainer_config.sh <zp_demo> <zp_gpt> <zp_demo_sim> <work dir>
set -euo pipefail
demo=$1 gpt=$2 sim=$3 dir=$4/trainer-config
rm -rf "$dir" && mkdir -p "$dir"
cat > "$dir/ds.json" <<'JSON'
{
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": 2,
  "bf16": {"enabled": true},
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 65536},
  "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 2e-3}},
  "gradient_clipping": 0.5
}
JSON
gpt_args=(--config "$dir/ds.json" --ranks 4 --pp 2 --steps 20 --log-every 10 --layers 2
          --d-model 32 --heads 4 --context 16 --micro-batch 4)
"$gpt" "${gpt_args[@]}" --checkpoint-dir "$dir/ckpt" --save-every 10 > "$dir/gpt.log"
grep -q "optimizer: AdamW(lr=0.002, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0.01)" "$dir/gpt.log"
grep -q "scheduler: WarmupLR(warmup_min_lr=0, warmup_max_lr=0.002, warmup_num_steps=5" "$dir/gpt.log"
grep -q "grid dp 2 x tp 1 x pp 2 (1f1b, 2 activation sets on stage 0), ZeRO stage 2 over dp, backend threads, bf16" "$dir/gpt.log"
grep -q "micro-batch 4 x micro-batches 2 x dp 2 = 16 sequences/step" "$dir/gpt.log"
grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in 20 steps" "$dir/gpt.log"
# The other pipeline schedule (--schedule gpipe: every forward, then every backward) trains the
# same: the same loss at every logged step (the micro-batches' gradients add up in the same
# order).
"$gpt" "${gpt_args[@]}" --schedule gpipe > "$dir/gpipe.log"
grep -q "grid dp 2 x tp 1 x pp 2 (gpipe, 2 activation sets on stage 0)" "$dir/gpipe.log"
cmp <(awk '/^step /{print $2, $4}' "$dir/gpt.log") <(awk '/^step /{print $2, $4}' "$dir/gpipe.log")
grep -q "^step *20 " "$dir/gpipe.log"
printf step10 > "$dir/ckpt/latest"
"$gpt" "${gpt_args[@]}" --checkpoint-dir "$dir/ckpt" --resume > "$dir/gpt-resumed.log"
grep -q "resumed from $dir/ckpt/step10 at step 10" "$dir/gpt-resumed.log"
echo "zp_gpt --config: stage, precision, batch, optimizer and schedule from ds_config.json; resumed"

"$demo" --config "$dir/ds.json" --ranks 2 --steps 20 --log-every 10 --micro-batch 8 > "$dir/demo.log"
grep -q "ZeRO stage 2, backend threads, 2 ranks, bf16, micro-batch 8 x accumulation 2 x ranks 2 = 32 sequences/step" "$dir/demo.log"
grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in 20 steps" "$dir/demo.log"
echo "zp_demo --config: the same"

# The device demo (simulated device) with the config, --log-json and --wall-clock-breakdown: each
# step's JSON loss is its progress line's (the loss read from the device every step).
"$sim" --config "$dir/ds.json" --ranks 2 --steps 10 --log-every 1 --micro-batch 4 --embed 8 \
  --context 8 --hidden 32 --log-json "$dir/sim.json" --wall-clock-breakdown > "$dir/sim.log"
grep -q "ZeRO stage 2, backend cuda_threads, 2 ranks, bf16, micro-batch 4 x accumulation 2" "$dir/sim.log"
grep -q "scheduler: WarmupLR(warmup_min_lr=0, warmup_max_lr=0.002, warmup_num_steps=5" "$dir/sim.log"
grep -q "^zp: step 10: total [0-9.]* ms | forward" "$dir/sim.log"
grep -q "^time per step (rank 0, mean of 9): total" "$dir/sim.log"
awk '/^step /{printf "%d %s\n", $2, $4}' "$dir/sim.log" > "$dir/sim.lines"
sed -E 's/^\{"step":([0-9]+),"loss":([0-9.]+),"grad_norm":[0-9.e+-]+,"total_ms".*/\1 \2/' "$dir/sim.json" |
  awk '{printf "%d %.4f\n", $1, $2}' > "$dir/sim.json.lines"
test "$(wc -l < "$dir/sim.lines")" = 10
cmp "$dir/sim.lines" "$dir/sim.json.lines"
echo "the device demo --config: the same, with its per-step JSON log"

# Hugging Face's "auto" keys, filled from the flags as its Trainer fills them: the batch, the
# optimizer's lr and the schedule's warmup and total steps (5% of --steps, --steps); a
# WarmupCosineLR starts from the optimizer's lr. An "auto" the trainers do not fill is refused.
cat > "$dir/auto.json" <<'JSON'
{
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "zero_optimization": {"stage": 1},
  "optimizer": {"type": "AdamW",
                "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR",
                "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                           "warmup_num_steps": "auto", "total_num_steps": "auto"}}
}
JSON
auto_args=(--ranks 2 --log-every 20 --micro-batch 4 --accum 2 --lr 0.004)
"$demo" --config "$dir/auto.json" "${auto_args[@]}" --steps 40 > "$dir/auto.log"
grep -q "optimizer: AdamW(lr=0.004, beta1=0.9, beta2=0.999, eps=1e-08, weight_decay=0)" "$dir/auto.log"
grep -q "scheduler: WarmupDecayLR(warmup_min_lr=0, warmup_max_lr=0.004, warmup_num_steps=2, total_num_steps=40," "$dir/auto.log"
grep -q "micro-batch 4 x accumulation 2 x ranks 2 = 16 sequences/step" "$dir/auto.log"
sed -e 's/"WarmupDecayLR"/"WarmupCosineLR"/' -e 's/"warmup_min_lr": "auto", "warmup_max_lr": "auto",//' \
  "$dir/auto.json" > "$dir/cosine.json"
"$demo" --config "$dir/cosine.json" "${auto_args[@]}" --steps 4 > "$dir/cosine.log"
grep -q "scheduler: WarmupCosineLR(base_lr=0.004, total_num_steps=4," "$dir/cosine.log"
sed 's/"total_num_steps": "auto"/"total_num_steps": 40, "cos_min_ratio": "auto"/' "$dir/cosine.json" \
  > "$dir/unfilled.json"
if "$demo" --config "$dir/unfilled.json" "${auto_args[@]}" --steps 4 > "$dir/unfilled.log" 2>&1; then
  echo "zp_demo accepted an \"auto\" it does not fill"
  exit 1
fi
grep -q "unfilled.json: scheduler.params.cos_min_ratio is \"auto\", which zp_demo does not fill" "$dir/unfilled.log"
echo "zp_demo --config: \"auto\" keys filled from the flags, others refused"

# Hugging Face's ZeRO-3 example: the precision from --precision (the trainer's bf16 without it),
# clipping at the flags' 1, and the ZeRO sizes from the model's width (zp_gpt's --d-model 32:
# reduce_bucket_size 32^2, stage3_prefetch_bucket_size 0.9 x 32^2, persistence 10 x 32).
cat > "$dir/hf.json" <<'JSON'
{
  "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 500,
           "initial_scale_power": 12, "hysteresis": 2, "min_loss_scale": 1},
  "bf16": {"enabled": "auto"},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                        "stage3_prefetch_bucket_size": "auto",
                        "stage3_param_persistence_threshold": "auto"},
  "gradient_clipping": "auto",
  "train_batch_size": "auto",
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto"
}
JSON
hf_args=(--config "$dir/hf.json" --ranks 2 --steps 4 --log-every 2 --layers 1 --d-model 32
         --heads 4 --context 16 --micro-batch 2)
"$gpt" "${hf_args[@]}" --precision fp16 > "$dir/hf-fp16.log"
grep -q "precision: fp16, dynamic loss scale (initial 4096, window 500, hysteresis 2," "$dir/hf-fp16.log"
grep -q "zero: stage 3, reduce_bucket_size 1024 elements" "$dir/hf-fp16.log"
grep -q "param_persistence_threshold 320, .*prefetch_bucket_size 921 " "$dir/hf-fp16.log"
grep -q "gradient_clipping: 1$" "$dir/hf-fp16.log"
grep -q "ZeRO stage 3 over dp, backend threads, f16$" "$dir/hf-fp16.log"
grep -Eq "summary: loss [0-9.]+ -> [0-9.]+ in 4 steps" "$dir/hf-fp16.log"
"$gpt" "${hf_args[@]}" > "$dir/hf-bf16.log"
grep -q "precision: bf16$" "$dir/hf-bf16.log"
grep -q "ZeRO stage 3 over dp, backend threads, bf16$" "$dir/hf-bf16.log"
# --precision where the config writes the precision is refused.
if "$gpt" --config "$dir/ds.json" --ranks 2 --steps 2 --precision fp32 > "$dir/written.log" 2>&1; then
  echo "zp_gpt took --precision beside a config that sets it"
  exit 1
fi
grep -q -- "--precision with --config $dir/ds.json: the config sets the precision" "$dir/written.log"
# So are --accum and --lr where the config's value differs (as written, or DeepSpeed's default lr
# without an optimizer section), and --micro-batch where the batch it completes differs; equal
# values are accepted.
echo '{"train_batch_size": 16, "gradient_accumulation_steps": 2}' > "$dir/batch.json"
for bad in "--accum 4|$dir/ds.json|gradient_accumulation_steps is 2" \
           "--lr 0.01|$dir/ds.json|optimizer lr is 0.002;" \
           "--lr 0.01|$dir/batch.json|optimizer lr is 0.001 (DeepSpeed's default" \
           "--micro-batch 3|$dir/batch.json|train_micro_batch_size_per_gpu is 4 at 2"; do
  IFS='|' read -r flag config says <<< "$bad"
  # shellcheck disable=SC2086  # the flag and its value
  if "$demo" --config "$config" --ranks 2 --steps 2 $flag > "$dir/differs.log" 2>&1; then
    echo "zp_demo took $flag beside $config, which differs"
    exit 1
  fi
  grep -qF -- "$flag with --config $config: the config's $says" "$dir/differs.log" ||
    { cat "$dir/differs.log"; exit 1; }
done
"$demo" --config "$dir/batch.json" --ranks 2 --steps 2 --micro-batch 4 --accum 2 --lr 0.001 \
  > "$dir/agrees.log"
# Without a scheduler section the flags' schedule runs, peaking at the config's lr.
grep -q "scheduler: WarmupCosineLR(base_lr=0.001, total_num_steps=2," "$dir/agrees.log"
echo "zp_gpt --config: Hugging Face's ZeRO-3 example, its precision, clipping and sizes filled"

sed 's/zero_optimization/zero_optimisation/' "$dir/ds.json" > "$dir/bad.json"
for prog in "$demo" "$gpt" "$sim"; do
  if "$prog" --config "$dir/bad.json" --ranks 2 --steps 2 > "$dir/bad.log" 2>&1; then
    echo "$prog accepted a misspelt key"
    exit 1
  fi
  grep -q "zero_optimisation: unknown key; did you mean zero_optimization?" "$dir/bad.log"
done
rm -rf "$dir"
echo "trainer configs: ok"
