// Fuzz target: zp::ds::parse over arbitrary text, and describe() of what it accepts, as read and
// with its precision filled for each element type (fill_precision).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz.hpp"
#include "zp/ds_config.hpp"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  zp::fuzz::seed("zero3.json", R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
      "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000,
      "warmup_num_steps": 100}},
    "zero_optimization": {"stage": 3, "overlap_comm": true, "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": 5e7, "stage3_max_reuse_distance": 1e9,
      "zero_quantized_weights": true, "zero_hpz_partition_size": 2,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 4},
      "offload_param": {"device": "cpu"}}})");
  zp::fuzz::seed("fp16.json", R"({"train_batch_size": "auto", "fp16": {"enabled": "auto",
    "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
    "min_loss_scale": 1}, "zero_optimization": {"stage": 2, "zero_quantized_gradients": true},
    "aio": {"block_size": 1048576, "queue_depth": 8}, "activation_checkpointing": {},
    "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"})");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  zp::fuzz::refused_or_read([&] {
    const auto c =
        zp::ds::parse(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz");
    (void)zp::ds::describe(c);
    using zp::ds::Precision;
    for (const Precision p : {Precision::fp32, Precision::fp16, Precision::bf16})
      zp::fuzz::refused_or_read([&] {
        auto filled = c;
        zp::ds::fill_precision(filled, p);
        (void)zp::ds::describe(filled);
      });
  });
  return 0;
}
