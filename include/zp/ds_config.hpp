// zp/ds_config.hpp: reads a DeepSpeed ds_config.json and runs the zp::Engine it describes.
// Needs nlohmann/json (CMake target zp::io).
//
//   const zp::ds::Config cfg = zp::ds::load("ds_config.json");   // parsed, checked, defaulted
//   std::printf("%s", zp::ds::describe(cfg).c_str());
//   zp::ds::with_engine<zp::backend::Threads>(cfg, comm.size(),
//       [&]<class E>(std::type_identity<E>, zp::EngineConfig ec, typename E::optimizer_type opt) {
//         MyModel<typename E::value_type> model;
//         E engine(comm, model, ec, opt);
//         ...                                // the training loop of engine.hpp
//       });
//
// What is read (DeepSpeed's configuration JSON, deepspeed.ai/docs/config-json; defaults are DeepSpeed's, which
// differ from zp's own struct defaults in places, e.g. AdamW's weight_decay 0 rather than 0.01):
// the batch triad, fp16 (with its loss scaler) / bf16 / fp32, zero_optimization (stage, bucket
// and stage 3 sizes, offload_optimizer, offload_param, sub_group_size, ZeRO++'s hpZ, qwZ and
// qgZ), aio, optimizer (Adam, AdamW, SGD, Lion), scheduler (WarmupLR, WarmupDecayLR,
// WarmupCosineLR, OneCycle), gradient_clipping, steps_per_print, wall_clock_breakdown,
// communication_data_type, data_types.grad_accum_dtype, checkpoint.
//
// Strictness. zp is deliberately stricter than DeepSpeed, which ignores unknown top-level keys
// (a typo such as "zero_optimisation" there silently trains without ZeRO): every key at every
// level must be one zp knows, and a misspelt one names the closest known key. Each key is
// declared once, in a table per JSON object (detail::root_keys, zero_keys, ... below), and the
// strict reader of detail/json_keys.hpp walks the tables: the checks, "did you mean" and the
// defaults all come from that one declaration. Each key is one of
//  - read: it changes the Config (the declaration names its type, range, default and member);
//  - ignored: DeepSpeed accepts it and for zp it is a harmless no-op, a choice of how (not what)
//    to communicate: overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions,
//    allgather_bucket_size, round_robin_gradients, ignore_unused_parameters,
//    stage3_gather_16bit_weights_on_model_save (zp has no 16-bit model save), memory_breakdown,
//    ...; its type is still checked;
//  - unsupported: DeepSpeed knows it, zp does not do it (amp, tensorboard,
//    zero_allow_untested_optimizer, ...). It is an error unless it holds the value that means
//    "off" (false, "none", {"enabled": false}, ...).
// Duplicate keys, wrong types, 1.5 for an integer (5e8 is fine: sizes are written as floats),
// negative sizes, NaN or infinite numbers, fp16 and bf16 both enabled and a batch triad that no
// world size fits are errors too. Every error is a zp::Error(invalid_argument) whose message
// names the source, the full key path and what was expected:
//   ds_config.json: zero_optimization.stage3_max_live_parameters: expected a non-negative integer, got "many"
//
// "auto" (Hugging Face's placeholder) is accepted where its Trainer fills values from its own
// arguments and the model: the batch keys ("auto" = not given; resolve_batch completes the triad
// for the world size), the optimizer's and scheduler's params, gradient_clipping,
// reduce_bucket_size, stage3_prefetch_bucket_size and stage3_param_persistence_threshold (the
// DeepSpeed default is kept) and fp16.enabled / bf16.enabled (off until fill_precision). Each such
// key's path is listed in Config::auto_keys so the program can fill it, e.g. from its own flags.
//
// What a Config may hold but zp's engine does not do yet (with_engine raises the error, so the
// value stays visible in describe()): a grad_accum_dtype or communication_data_type other than
// fp32 or the model's element type. offload_optimizer "cpu" is ZeRO-Offload
// (EngineConfig::offload_optimizer), "nvme" ZeRO-Infinity's optimizer swap
// (EngineConfig::optimizer_nvme, which needs zp::aio).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "zp/detail/file.hpp"
#include "zp/detail/json.hpp"
#include "zp/detail/json_keys.hpp"
#include "zp/dispatch.hpp"
#include "zp/dtype.hpp"
#include "zp/engine.hpp"
#include "zp/error.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/precision.hpp"
#include "zp/schedule.hpp"

namespace zp::ds {

// The model's element type: fp32 (float), fp16 (zp::fp16, dynamic or fixed loss scaling) or
// bf16 (zp::bf16, no loss scaling).
enum class Precision : std::uint8_t { fp32, fp16, bf16 };
// checkpoint.tag_validation: what loading does when the ranks' checkpoint tags differ.
enum class TagValidation : std::uint8_t { warn, ignore, fail };
enum class OffloadDevice : std::uint8_t { none, cpu, nvme };

// zero_optimization.offload_optimizer, kept as read: "cpu" sets EngineConfig::offload_optimizer,
// "nvme" also EngineConfig::optimizer_nvme (with sub_group_size and the aio section).
struct OffloadOptimizer {
  OffloadDevice device = OffloadDevice::none;
  bool pin_memory = false;  // zp pins its staging buffers either way (speed, not results)
  std::string nvme_path;
  int buffer_count = 4;
  bool pipeline_read = false, pipeline_write = false;
};
// zero_optimization.offload_param, kept as read: "cpu" sets EngineConfig::offload_param,
// "nvme" also EngineConfig::param_nvme; stage 3 only.
struct OffloadParam {
  OffloadDevice device = OffloadDevice::none;
  bool pin_memory = false;
  std::string nvme_path;
  int buffer_count = 5;
};
// The "aio" section: how the swap's I/O runs (zp::aio).
struct AioSection {
  std::int64_t block_size = 1'048'576;
  std::int64_t queue_depth = 8;
};

// The optimizers zp runs, with DeepSpeed's names: "Adam" (decoupled decay unless
// adam_w_mode is false) and "AdamW" -> AdamW, "Adam" with adam_w_mode false -> Adam (L2),
// "SGD" -> Sgd, "Lion" -> Lion.
using AnyOptimizer = std::variant<optim::AdamW, optim::Adam, optim::Sgd, optim::Lion>;

// A parsed, checked ds_config with DeepSpeed's defaults filled in.
struct Config {
  std::string source = "ds_config";  // file name (or the name given to parse), for messages

  // train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps as written;
  // 0 = absent or "auto". with_engine completes them for the world size (resolve_batch).
  BatchConfig batch{};
  Precision precision = Precision::fp32;
  int stage = 0;  // zero_optimization.stage

  // What maps onto zp::EngineConfig: loss_scaler (fp16), max_grad_norm (gradient_clipping),
  // max_live_params (stage3_max_live_parameters; 0 = zp's automatic cap), persist_threshold
  // (stage3_param_persistence_threshold), max_reuse_distance (stage3_max_reuse_distance),
  // prefetch (stage3_prefetch_bucket_size).
  // batch and bucket_bytes are set by engine_config<T>(), which knows the world size and T.
  EngineConfig engine = defaults();
  // The loss scaler the fp16 section describes, enabled or not (DeepSpeed's dynamic scale from
  // 2^16 without one): engine.loss_scaler while the precision is fp16, and what fill_precision
  // turns on for an "auto" fp16.enabled.
  LossScaler fp16_scaler = LossScaler::dynamic({});
  // zero_optimization.reduce_bucket_size, in elements.
  std::uint64_t reduce_bucket_size = 500'000'000;
  OffloadOptimizer offload_optimizer{};
  OffloadParam offload_param{};
  std::uint64_t sub_group_size = 1'000'000'000;  // zero_optimization.sub_group_size (NVMe swap)
  // zero_optimization.zero_quantized_weights (ZeRO++'s qwZ, stage 3): EngineConfig's
  // quantized_weights = zp::zero_quantized_weights (int8 in blocks of 2048).
  bool zero_quantized_weights = false;
  // zero_optimization.zero_quantized_gradients (ZeRO++'s qgZ, stages 2 and 3): EngineConfig's
  // quantized_gradients = zp::zero_quantized_gradients (int8 in blocks of 512).
  bool zero_quantized_gradients = false;
  // zero_optimization.mics_shard_size (MiCS: hybrid sharding, stages 1-3): EngineConfig's
  // shard_group_size; -1 (DeepSpeed's default) shards over the whole data-parallel group.
  int mics_shard_size = -1;
  AioSection aio{};

  // The "optimizer" section; without one, DeepSpeed's Adam defaults (AdamW, lr 1e-3, betas
  // 0.9/0.999, eps 1e-8, weight_decay 0) and optimizer_given false.
  AnyOptimizer optimizer =
      optim::AdamW{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
  bool optimizer_given = false;
  // The "scheduler" section (WarmupCosineLR's base_lr is the optimizer's lr as read: fill both
  // when optimizer.params.lr is "auto"). Schedules step once per applied optimizer step.
  std::optional<schedule::Any> scheduler;

  std::int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  // null = the model's element type (DeepSpeed's default); with_engine rejects all but fp32 and it.
  std::optional<DType> grad_accum_dtype;         // data_types.grad_accum_dtype
  std::optional<DType> communication_data_type;  // communication_data_type
  TagValidation tag_validation = TagValidation::warn;

  // Paths of the keys written as "auto", in the key tables' order, e.g. "optimizer.params.lr".
  std::vector<std::string> auto_keys;

  // The element type the precision selects: f32, bf16 or f16.
  DType dtype() const noexcept {
    return precision == Precision::bf16   ? DType::bf16
           : precision == Precision::fp16 ? DType::f16
                                          : DType::f32;
  }
  bool is_auto(std::string_view key_path) const {
    return std::find(auto_keys.begin(), auto_keys.end(), key_path) != auto_keys.end();
  }

  // DeepSpeed's defaults for what an EngineConfig holds (stage 3: 1e9 live parameters, 1e5
  // persistence threshold, 1e9 reuse distance, 5e7 elements prefetched).
  static EngineConfig defaults() {
    EngineConfig e;
    e.max_live_params = 1'000'000'000;
    e.max_reuse_distance = 1'000'000'000;
    e.persist_threshold = 100'000;
    e.prefetch = 50'000'000;
    e.max_grad_norm = 0;
    e.loss_scaler = LossScaler::none();
    return e;
  }
};

// The precision that selects element type t (Config::dtype's inverse).
inline Precision precision_of(DType t) noexcept {
  return t == DType::bf16 ? Precision::bf16 : t == DType::f16 ? Precision::fp16 : Precision::fp32;
}

namespace detail {

using json = nlohmann::json;
using namespace zp::detail::keys;  // the strict reader: Key, Spec, read_object, ...

// "fp32", "fp16", "bf16": the spelling of ds_config.json.
inline const char* ds_name(DType t) noexcept {
  return t == DType::f32    ? "fp32"
         : t == DType::f16  ? "fp16"
         : t == DType::bf16 ? "bf16"
                            : zp::name(t);
}
inline const char* ds_name(Precision p) noexcept {
  return p == Precision::fp16 ? "fp16" : p == Precision::bf16 ? "bf16" : "fp32";
}
inline const char* ds_name(TagValidation t) noexcept {
  return t == TagValidation::warn ? "Warn" : t == TagValidation::ignore ? "Ignore" : "Fail";
}
inline const char* ds_name(OffloadDevice d) noexcept {
  return d == OffloadDevice::cpu ? "cpu" : d == OffloadDevice::nvme ? "nvme" : "none";
}

// Errors name the config; "auto" is the placeholder, recorded in Config::auto_keys.
inline Ctx context(const std::string& source, std::vector<std::string>* auto_keys) {
  return Ctx{.source = source,
             .errc = Errc::invalid_argument,
             .placeholder = "auto",
             .placeholders = auto_keys,
             .placeholder_hint =
                 " (\"auto\" is accepted only for the batch sizes, the optimizer's and "
                 "scheduler's params, gradient_clipping, fp16/bf16.enabled and the three ZeRO "
                 "sizes Hugging Face fills from the hidden size)",
             .foreign = "DeepSpeed"};
}

// ---- the keys, each declared once ---------------------------------------------------------------
// A table per JSON object: each key read (its type, range and default, and the member it goes
// to), ignored (a no-op for zp, type checked), unsupported (accepted only as its "off" value) or
// misplaced. read_object (detail/json_keys.hpp) walks a table; the sections below add the
// checks that span several keys.

constexpr std::int64_t max_i64 = std::numeric_limits<std::int64_t>::max();

// fp16, as written; read_fp16 makes it the loss scaler.
struct Fp16Section {
  bool enabled = false;
  float loss_scale = 0;  // > 0: fixed scale; 0: dynamic
  std::int64_t initial_scale_power = 16, loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  float min_loss_scale = 1;
};
using Fp16Key = Key<Fp16Section>;
inline constexpr Fp16Key fp16_keys[] = {
    Fp16Key::read(
        "enabled", boolean(false).or_placeholder(), [](auto& s) -> auto& { return s.enabled; }),
    Fp16Key::read(
        "loss_scale", real_f32(0, Real::non_negative),
        [](auto& s) -> auto& { return s.loss_scale; }),
    Fp16Key::read(
        "initial_scale_power", integer(16, 0, 127, "an integer in [0, 127] (the scale is 2^power)"),
        [](auto& s) -> auto& { return s.initial_scale_power; }),
    Fp16Key::read(
        "loss_scale_window", integer(1000, 1, max_i64, "a positive integer"),
        [](auto& s) -> auto& { return s.loss_scale_window; }),
    Fp16Key::read(
        "hysteresis", integer(2, 1, std::numeric_limits<int>::max(), "a positive integer"),
        [](auto& s) -> auto& { return s.hysteresis; }),
    Fp16Key::read(
        "consecutive_hysteresis", boolean(false),
        [](auto& s) -> auto& { return s.consecutive_hysteresis; }),
    Fp16Key::read(
        "min_loss_scale", real_f32(1, Real::positive),
        [](auto& s) -> auto& { return s.min_loss_scale; }),
    Fp16Key::unsupported("auto_cast", Off::is_false),
    Fp16Key::unsupported("fp16_master_weights_and_grads", Off::is_false)};

struct Bf16Section {
  bool enabled = false;
};
using Bf16Key = Key<Bf16Section>;
inline constexpr Bf16Key bf16_keys[] = {Bf16Key::read(
    "enabled", boolean(false).or_placeholder(), [](auto& s) -> auto& { return s.enabled; })};

inline constexpr Choice offload_devices[] = {{"none", std::int64_t(OffloadDevice::none)},
                                             {"cpu", std::int64_t(OffloadDevice::cpu)},
                                             {"nvme", std::int64_t(OffloadDevice::nvme)}};
using OffloadKey = Key<OffloadOptimizer>;
inline constexpr OffloadKey offload_keys[] = {
    OffloadKey::read(
        "device", choice(offload_devices, "\"none\", \"cpu\" or \"nvme\"", 0).or_null(),
        [](auto& o) -> auto& { return o.device; }),
    OffloadKey::read(
        "nvme_path", text("a path string").or_null(), [](auto& o) -> auto& { return o.nvme_path; }),
    OffloadKey::read(
        "pin_memory", boolean(false), [](auto& o) -> auto& { return o.pin_memory; }),
    OffloadKey::read(
        "buffer_count", integer(4, 2, 64, "an integer in [2, 64]"),
        [](auto& o) -> auto& { return o.buffer_count; }),
    OffloadKey::read(
        "pipeline_read", boolean(false), [](auto& o) -> auto& { return o.pipeline_read; }),
    OffloadKey::read(
        "pipeline_write", boolean(false), [](auto& o) -> auto& { return o.pipeline_write; }),
    // Partial offload: zp offloads all of the optimizer or none.
    OffloadKey::unsupported("ratio", Off::number, 1), OffloadKey::ignored("fast_init", boolean()),
    OffloadKey::ignored("pipeline", boolean())};

using OffloadParamKey = Key<OffloadParam>;
inline constexpr OffloadParamKey offload_param_keys[] = {
    OffloadParamKey::read(
        "device", choice(offload_devices, "\"none\", \"cpu\" or \"nvme\"", 0).or_null(),
        [](auto& o) -> auto& { return o.device; }),
    OffloadParamKey::read(
        "nvme_path", text("a path string").or_null(), [](auto& o) -> auto& { return o.nvme_path; }),
    OffloadParamKey::read(
        "pin_memory", boolean(false), [](auto& o) -> auto& { return o.pin_memory; }),
    OffloadParamKey::read(
        "buffer_count", integer(5, 2, 64, "an integer in [2, 64]"),
        [](auto& o) -> auto& { return o.buffer_count; }),
    // How much of the parameters DeepSpeed keeps in host memory: zp keeps none (the module's
    // pieces while it is gathered).
    OffloadParamKey::ignored("buffer_size", count()),
    OffloadParamKey::ignored("max_in_cpu", count())};

using AioKey = Key<AioSection>;
inline constexpr AioKey aio_keys[] = {
    AioKey::read(
        "block_size", integer(1'048'576, 4096, std::int64_t(1) << 30, "bytes in [4096, 1 GiB]"),
        [](auto& a) -> auto& { return a.block_size; }),
    AioKey::read(
        "queue_depth", integer(8, 1, 4096, "an integer in [1, 4096]"),
        [](auto& a) -> auto& { return a.queue_depth; }),
    // How libaio is driven in DeepSpeed; zp::aio's engines need none of them.
    AioKey::ignored("thread_count", count()), AioKey::ignored("single_submit", boolean()),
    AioKey::ignored("overlap_events", boolean()), AioKey::ignored("intra_op_parallelism", count()),
    AioKey::unsupported("use_gds", Off::is_false)};

using ConfigKey = Key<Config>;
inline constexpr ConfigKey zero_keys[] = {
    ConfigKey::read(
        "stage", integer(0, 0, 3, "a ZeRO stage 0, 1, 2 or 3"),
        [](auto& c) -> auto& { return c.stage; }),
    ConfigKey::read(
        "reduce_bucket_size",
        integer(500'000'000, 1, max_i64, "a positive integer (elements)").or_placeholder(),
        [](auto& c) -> auto& { return c.reduce_bucket_size; }),
    ConfigKey::read(
        "stage3_prefetch_bucket_size", count(50'000'000).or_placeholder(),
        [](auto& c) -> auto& { return c.engine.prefetch; })
        .or_alias("prefetch_bucket_size"),
    ConfigKey::read(
        "stage3_param_persistence_threshold", count(100'000).or_placeholder(),
        [](auto& c) -> auto& { return c.engine.persist_threshold; })
        .or_alias("param_persistence_threshold"),
    ConfigKey::read(
        "stage3_max_live_parameters", count(1'000'000'000),
        [](auto& c) -> auto& { return c.engine.max_live_params; })
        .or_alias("max_live_parameters"),
    ConfigKey::read(
        "stage3_max_reuse_distance", count(1'000'000'000),
        [](auto& c) -> auto& { return c.engine.max_reuse_distance; })
        .or_alias("max_reuse_distance"),
    ConfigKey::read(
        "zero_hpz_partition_size", integer(1, 1, 1 << 20, "a positive integer (ranks per node)"),
        [](auto& c) -> auto& { return c.engine.hpz_partition_size; }),
    ConfigKey::read(
        "mics_shard_size",
        integer(-1, -1, 1 << 20, "-1 (off) or a positive integer (ranks per shard group)"),
        [](auto& c) -> auto& { return c.mics_shard_size; }),
    ConfigKey::read(
        "zero_quantized_gradients", boolean(false),
        [](auto& c) -> auto& { return c.zero_quantized_gradients; }),
    ConfigKey::read(
        "zero_quantized_weights", boolean(false),
        [](auto& c) -> auto& { return c.zero_quantized_weights; }),
    ConfigKey::object<offload_keys>(
        "offload_optimizer", [](auto& c) -> auto& { return c.offload_optimizer; })
        .or_null(),
    ConfigKey::object<offload_param_keys>(
        "offload_param", [](auto& c) -> auto& { return c.offload_param; })
        .or_null(),
    // How, not what, to communicate: no effect on zp.
    ConfigKey::ignored("contiguous_gradients", boolean()),
    ConfigKey::ignored("reduce_scatter", boolean()),
    ConfigKey::ignored("allgather_partitions", boolean()),
    ConfigKey::ignored("overlap_comm", boolean()),
    ConfigKey::ignored("round_robin_gradients", boolean()),
    ConfigKey::ignored("allgather_bucket_size", count()),
    ConfigKey::read(
        "sub_group_size", integer(1'000'000'000, 1, max_i64, "a positive integer (elements)"),
        [](auto& c) -> auto& { return c.sub_group_size; }),
    ConfigKey::ignored("ignore_unused_parameters", boolean()),
    ConfigKey::ignored("load_from_fp32_weights", boolean()),
    ConfigKey::ignored("stage3_gather_16bit_weights_on_model_save", boolean()),
    ConfigKey::ignored("gather_16bit_weights_on_model_save", boolean()),
    ConfigKey::ignored("stage3_gather_fp16_weights_on_model_save", boolean()),
    ConfigKey::ignored("memory_efficient_linear", boolean()),
    ConfigKey::ignored("override_module_apply", boolean()),
    ConfigKey::ignored("use_multi_rank_bucket_allreduce", boolean()),
    ConfigKey::ignored("log_trace_cache_warnings", boolean()),
    // Known to DeepSpeed, not done by zp.
    ConfigKey::unsupported("cpu_offload", Off::is_false),
    ConfigKey::unsupported("cpu_offload_params", Off::is_false),
    ConfigKey::unsupported("cpu_offload_use_pin_memory", Off::is_false),
    ConfigKey::unsupported("elastic_checkpoint", Off::is_false),
    ConfigKey::unsupported("legacy_stage1", Off::is_false),
    ConfigKey::unsupported("zero_quantized_nontrainable_weights", Off::is_false),
    ConfigKey::unsupported("mics_hierarchical_params_gather", Off::is_false),
    ConfigKey::unsupported("stage3_model_persistence_threshold"),
    ConfigKey::unsupported("model_persistence_threshold"),
    ConfigKey::unsupported("stage3_use_all_reduce_for_fetch_params", Off::is_false),
    ConfigKey::unsupported("use_all_reduce_for_fetch_params", Off::is_false),
    ConfigKey::unsupported("pipeline_loading_checkpoint", Off::is_false),
    ConfigKey::unsupported("zeropp_loco_param", Off::is_null)};

// "optimizer" and "scheduler": a type that selects the table of "params".
struct TypedSection {
  std::string type;
  const json* params = nullptr;  // null or absent: {} (every param at its default)
};
using TypedKey = Key<TypedSection>;
inline constexpr TypedKey optimizer_keys[] = {
    TypedKey::read(
        "type",
        text("an optimizer name (Adam, AdamW, SGD, Lion)")
            .require("required (one of Adam, AdamW, SGD, Lion)"),
        [](auto& s) -> auto& { return s.type; }),
    TypedKey::read(
        "params", any().or_null(), [](auto& s) -> auto& { return s.params; }),
    TypedKey::ignored("legacy_fusion", boolean())};
inline constexpr TypedKey scheduler_keys[] = {
    TypedKey::read(
        "type",
        text("a scheduler name (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)")
            .require("required (one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)"),
        [](auto& s) -> auto& { return s.type; }),
    TypedKey::read(
        "params", any().or_null(), [](auto& s) -> auto& { return s.params; })};

// DeepSpeed's optimizer defaults (deepspeed/ops/adam, deepspeed/ops/lion): lr 1e-3 for all; Adam(W)
// betas 0.9/0.999, eps 1e-8, weight_decay 0; Lion betas 0.9/0.999; SGD as torch.optim.SGD.
inline constexpr std::string_view max_grad_norm_hint =
    "max_grad_norm is not an optimizer parameter in DeepSpeed; clip with the top-level "
    "\"gradient_clipping\"";
struct AdamSection {
  optim::AdamW w;
  bool adam_w_mode = true;  // false: Adam with L2 regularisation
};
using AdamKey = Key<AdamSection>;
inline constexpr AdamKey adam_keys[] = {
    AdamKey::read(
        "lr", real_f32(1e-3, Real::non_negative), [](auto& s) -> auto& { return s.w.lr; }),
    AdamKey::read("betas",
                  pair(0.9, 0.999, Real::unit_open, "an array of two numbers [beta1, beta2]"),
                  [](auto& s) { return std::tie(s.w.beta1, s.w.beta2); }),
    AdamKey::read(
        "eps", real_f32(1e-8, Real::non_negative), [](auto& s) -> auto& { return s.w.eps; }),
    AdamKey::read(
        "weight_decay", real_f32(0, Real::non_negative),
        [](auto& s) -> auto& { return s.w.weight_decay; }),
    AdamKey::read(
        "adam_w_mode", boolean(true), [](auto& s) -> auto& { return s.adam_w_mode; }),
    AdamKey::ignored("torch_adam", boolean()),
    AdamKey::unsupported("bias_correction", Off::is_true),
    AdamKey::unsupported("amsgrad", Off::is_false),
    AdamKey::misplaced("max_grad_norm", max_grad_norm_hint)};
using LionKey = Key<optim::Lion>;
inline constexpr LionKey lion_keys[] = {
    LionKey::read(
        "lr", real_f32(1e-3, Real::non_negative), [](auto& o) -> auto& { return o.lr; }),
    LionKey::read("betas",
                  pair(0.9, 0.999, Real::unit_closed, "an array of two numbers [beta1, beta2]"),
                  [](auto& o) { return std::tie(o.beta1, o.beta2); }),
    LionKey::read(
        "weight_decay", real_f32(0, Real::non_negative),
        [](auto& o) -> auto& { return o.weight_decay; }),
    LionKey::misplaced("max_grad_norm", max_grad_norm_hint)};
using SgdKey = Key<optim::Sgd>;
inline constexpr SgdKey sgd_keys[] = {
    SgdKey::read(
        "lr", real_f32(1e-3, Real::non_negative), [](auto& o) -> auto& { return o.lr; }),
    SgdKey::read(
        "momentum", real_f32(0, Real::non_negative), [](auto& o) -> auto& { return o.momentum; }),
    SgdKey::read(
        "dampening", real_f32(0, Real::unit_closed), [](auto& o) -> auto& { return o.dampening; }),
    SgdKey::read(
        "weight_decay", real_f32(0, Real::non_negative),
        [](auto& o) -> auto& { return o.weight_decay; }),
    SgdKey::read(
        "nesterov", boolean(false), [](auto& o) -> auto& { return o.nesterov; }),
    SgdKey::unsupported("maximize", Off::is_false),
    SgdKey::misplaced("max_grad_norm", max_grad_norm_hint)};

// The schedules (deepspeed/runtime/lr_schedules.py, its defaults). Schedules step once per
// applied optimizer step; last_batch_iteration (resuming mid-schedule) is zp's step count.
inline constexpr Choice warmup_types[] = {{"log", std::int64_t(schedule::Warmup::log)},
                                          {"linear", std::int64_t(schedule::Warmup::linear)}};
constexpr Spec warmup_type =
    choice(warmup_types, "\"log\" or \"linear\"", std::int64_t(schedule::Warmup::log));
using WarmupKey = Key<schedule::WarmupLR>;
inline constexpr WarmupKey warmup_keys[] = {
    WarmupKey::read(
        "warmup_min_lr", real_f32(0, Real::non_negative),
        [](auto& s) -> auto& { return s.warmup_min_lr; }),
    WarmupKey::read(
        "warmup_max_lr", real_f32(1e-3, Real::non_negative),
        [](auto& s) -> auto& { return s.warmup_max_lr; }),
    WarmupKey::read(
        "warmup_num_steps", count(1000), [](auto& s) -> auto& { return s.warmup_num_steps; }),
    WarmupKey::read(
        "warmup_type", warmup_type, [](auto& s) -> auto& { return s.warmup_type; }),
    WarmupKey::unsupported("last_batch_iteration", Off::number, -1)};
using DecayKey = Key<schedule::WarmupDecayLR>;
inline constexpr DecayKey decay_keys[] = {
    DecayKey::read(
        "warmup_min_lr", real_f32(0, Real::non_negative),
        [](auto& s) -> auto& { return s.warmup_min_lr; }),
    DecayKey::read(
        "warmup_max_lr", real_f32(1e-3, Real::non_negative),
        [](auto& s) -> auto& { return s.warmup_max_lr; }),
    DecayKey::read(
        "warmup_num_steps", count(1000), [](auto& s) -> auto& { return s.warmup_num_steps; }),
    DecayKey::read(
        "warmup_type", warmup_type, [](auto& s) -> auto& { return s.warmup_type; }),
    DecayKey::read(
        "total_num_steps", count(10000).require("required by WarmupDecayLR"),
        [](auto& s) -> auto& { return s.total_num_steps; }),
    DecayKey::unsupported("last_batch_iteration", Off::number, -1)};
using CosineKey = Key<schedule::WarmupCosineLR>;
inline constexpr CosineKey cosine_keys[] = {
    CosineKey::read(
        "total_num_steps", count(10000).require("required by WarmupCosineLR"),
        [](auto& s) -> auto& { return s.total_num_steps; }),
    CosineKey::read(
        "warmup_min_ratio", real(0, Real::unit_closed),
        [](auto& s) -> auto& { return s.warmup_min_ratio; }),
    CosineKey::read(
        "warmup_num_steps", count(1000), [](auto& s) -> auto& { return s.warmup_num_steps; }),
    CosineKey::read(
        "cos_min_ratio", real(1e-4, Real::unit_closed),
        [](auto& s) -> auto& { return s.cos_min_ratio; }),
    CosineKey::read(
        "warmup_type", warmup_type, [](auto& s) -> auto& { return s.warmup_type; }),
    CosineKey::unsupported("last_batch_iteration", Off::number, -1)};
using CycleKey = Key<schedule::OneCycle>;
inline constexpr CycleKey cycle_keys[] = {
    CycleKey::read(
        "cycle_min_lr", real_f32(1e-4, Real::non_negative).require("required by OneCycle"),
        [](auto& s) -> auto& { return s.cycle_min_lr; }),
    CycleKey::read(
        "cycle_max_lr", real_f32(1e-3, Real::non_negative).require("required by OneCycle"),
        [](auto& s) -> auto& { return s.cycle_max_lr; }),
    CycleKey::read(
        "decay_lr_rate", real(0, Real::non_negative),
        [](auto& s) -> auto& { return s.decay_lr_rate; }),
    CycleKey::read(
        "cycle_first_step_size", integer(2000, 1, max_i64, "a positive integer"),
        [](auto& s) -> auto& { return s.cycle_first_step_size; }),
    // 0 (null or absent): equal to the first step size.
    CycleKey::read(
        "cycle_second_step_size",
        integer(0, 1, max_i64, "a positive integer, or null for the first step size").or_null(),
        [](auto& s) -> auto& { return s.cycle_second_step_size; }),
    CycleKey::read(
        "decay_step_size", count(0), [](auto& s) -> auto& { return s.decay_step_size; }),
    CycleKey::read(
        "cycle_momentum", boolean(true), [](auto& s) -> auto& { return s.cycle_momentum; }),
    CycleKey::read(
        "cycle_min_mom", real_f32(0.8, Real::non_negative),
        [](auto& s) -> auto& { return s.cycle_min_mom; }),
    CycleKey::read(
        "cycle_max_mom", real_f32(0.9, Real::non_negative),
        [](auto& s) -> auto& { return s.cycle_max_mom; }),
    CycleKey::read(
        "decay_mom_rate", real(0, Real::finite), [](auto& s) -> auto& { return s.decay_mom_rate; }),
    CycleKey::unsupported("cycle_first_stair_count", Off::number, 0),
    CycleKey::unsupported("cycle_second_stair_count", Off::null_or_number, 0),
    CycleKey::unsupported("last_batch_iteration", Off::number, -1)};

// null, "fp32", "fp16" or "bf16" (communication_data_type also takes DeepSpeed's "bfp16").
inline constexpr Choice dtypes[] = {{"fp32", std::int64_t(DType::f32)},
                                    {"fp16", std::int64_t(DType::f16)},
                                    {"bf16", std::int64_t(DType::bf16)}};
inline constexpr Choice comm_dtypes[] = {{"fp32", std::int64_t(DType::f32)},
                                         {"fp16", std::int64_t(DType::f16)},
                                         {"bf16", std::int64_t(DType::bf16)},
                                         {"bfp16", std::int64_t(DType::bf16)}};
inline constexpr const char* dtype_what = "null, \"fp32\", \"fp16\" or \"bf16\"";
inline constexpr ConfigKey data_type_keys[] = {ConfigKey::read(
    "grad_accum_dtype", choice_or_null(dtypes, dtype_what),
    [](auto& c) -> auto& { return c.grad_accum_dtype; })};

inline constexpr Choice tag_validations[] = {{"Warn", std::int64_t(TagValidation::warn)},
                                             {"Ignore", std::int64_t(TagValidation::ignore)},
                                             {"Fail", std::int64_t(TagValidation::fail)}};
inline constexpr ConfigKey checkpoint_keys[] = {
    ConfigKey::read(
        "tag_validation",
        choice(tag_validations, "\"Warn\", \"Ignore\" or \"Fail\"",
               std::int64_t(TagValidation::warn),
               /*any_case=*/true),
        [](auto& c) -> auto& { return c.tag_validation; }),
    ConfigKey::unsupported("load_universal", Off::is_false),
    ConfigKey::unsupported("use_node_local_storage", Off::is_false),
    ConfigKey::unsupported("parallel_write")};

// DeepSpeed's activation checkpointing, which a model's own code asks for (zp_gpt: --recompute,
// recomputing each block from its input); the section only says how the checkpoints are kept.
inline constexpr ConfigKey activation_keys[] = {
    ConfigKey::unsupported("partition_activations", Off::is_false),
    ConfigKey::unsupported("cpu_checkpointing", Off::is_false),
    ConfigKey::unsupported("profile", Off::is_false),
    // How DeepSpeed lays its checkpoint buffers out and synchronises around them.
    ConfigKey::ignored("contiguous_memory_optimization", boolean()),
    ConfigKey::ignored("number_checkpoints", count().or_null()),
    ConfigKey::ignored("synchronize_checkpoint_boundary", boolean())};

void read_fp16(const Ctx& c, const json& j, const std::string& path, Config& cfg);
void read_bf16(const Ctx& c, const json& j, const std::string& path, Config& cfg);
void read_zero(const Ctx& c, const json& j, const std::string& path, Config& cfg);
void read_optimizer(const Ctx& c, const json& j, const std::string& path, Config& cfg);
void read_scheduler(const Ctx& c, const json& j, const std::string& path, Config& cfg);
// What describe() lists for the sections read by a function (list_object walks the tables).
inline void list_fp16(const Config& cfg, const std::string& path, Listing& out);
inline void list_optimizer(const Config& cfg, const std::string& path, Listing& out);
inline void list_scheduler(const Config& cfg, const std::string& path, Listing& out);

// The three batch keys: "auto" or absent = 0 (not given).
constexpr Spec batch_size =
    integer(0, 1, max_i64, "a positive integer or \"auto\"").or_placeholder();
inline constexpr ConfigKey root_keys[] = {
    ConfigKey::read(
        "train_batch_size", batch_size, [](auto& c) -> auto& { return c.batch.train_batch_size; }),
    ConfigKey::read(
        "train_micro_batch_size_per_gpu", batch_size,
        [](auto& c) -> auto& { return c.batch.micro_batch_per_rank; }),
    ConfigKey::read(
        "gradient_accumulation_steps", batch_size,
        [](auto& c) -> auto& { return c.batch.gradient_accumulation_steps; }),
    ConfigKey::object("fp16", read_fp16).listed(list_fp16),
    ConfigKey::object("bf16", read_bf16)
        .or_alias("bfloat16", "older name")
        .listed<bf16_keys>(
            [](const Config& c) { return Bf16Section{.enabled = c.precision == Precision::bf16}; }),
    ConfigKey::object("zero_optimization", read_zero).listed<zero_keys>([](auto& c) -> auto& {
      return c;
    }),
    ConfigKey::object("optimizer", read_optimizer).if_given().listed(list_optimizer),
    ConfigKey::object("scheduler", read_scheduler).if_given().listed(list_scheduler),
    ConfigKey::read(
        "gradient_clipping", real_f32(0, Real::non_negative).or_placeholder(),
        [](auto& c) -> auto& { return c.engine.max_grad_norm; }),
    ConfigKey::read(
        "steps_per_print", count(10), [](auto& c) -> auto& { return c.steps_per_print; }),
    ConfigKey::read(
        "wall_clock_breakdown", boolean(false),
        [](auto& c) -> auto& { return c.wall_clock_breakdown; }),
    ConfigKey::read(
        "communication_data_type", choice_or_null(comm_dtypes, dtype_what),
        [](auto& c) -> auto& { return c.communication_data_type; }),
    ConfigKey::object<data_type_keys>(
        "data_types", [](auto& c) -> auto& { return c; }),
    ConfigKey::object<checkpoint_keys>(
        "checkpoint", [](auto& c) -> auto& { return c; }),
    ConfigKey::ignored("memory_breakdown", boolean()),
    ConfigKey::ignored("zero_force_ds_cpu_optimizer", boolean()),
    ConfigKey::unsupported("amp", Off::not_enabled),
    ConfigKey::unsupported("zero_allow_untested_optimizer", Off::is_false),
    ConfigKey::unsupported("prescale_gradients", Off::is_false),
    ConfigKey::unsupported("gradient_predivide_factor", Off::number, 1),
    ConfigKey::unsupported("sparse_gradients", Off::is_false),
    ConfigKey::unsupported("fp32_allreduce", Off::is_false),
    ConfigKey::unsupported("disable_allgather", Off::is_false),
    ConfigKey::unsupported("dump_state", Off::is_false),
    ConfigKey::unsupported("dataloader_drop_last", Off::is_false),
    ConfigKey::unsupported("graph_harvesting", Off::is_false),
    ConfigKey::object<activation_keys>(
        "activation_checkpointing", [](auto& c) -> auto& { return c; })
        .listed(+[](const Config&, const std::string& path, Listing& out) {
          out.push_back({path, "the model's to do (zp_gpt: --recompute); nothing asked of zp"});
        }),
    ConfigKey::unsupported("pipeline"),
    ConfigKey::object<aio_keys>(
        "aio", [](auto& c) -> auto& { return c.aio; }),
    ConfigKey::unsupported("sparse_attention"),
    ConfigKey::unsupported("compression_training"),
    ConfigKey::unsupported("flops_profiler", Off::not_enabled),
    ConfigKey::unsupported("tensorboard", Off::not_enabled),
    ConfigKey::unsupported("wandb", Off::not_enabled),
    ConfigKey::unsupported("csv_monitor", Off::not_enabled),
    ConfigKey::unsupported("comms_logger", Off::not_enabled),
    ConfigKey::unsupported("autotuning", Off::not_enabled),
    ConfigKey::unsupported("elasticity", Off::not_enabled),
    ConfigKey::unsupported("curriculum_learning", Off::not_enabled),
    ConfigKey::unsupported("data_efficiency", Off::not_enabled),
    ConfigKey::unsupported("nebula", Off::not_enabled),
    ConfigKey::unsupported("eigenvalue", Off::not_enabled),
    ConfigKey::unsupported("progressive_layer_drop", Off::not_enabled),
    ConfigKey::unsupported("quantize_training", Off::not_enabled),
    ConfigKey::unsupported("hybrid_engine", Off::not_enabled),
    ConfigKey::unsupported("torch_autocast", Off::not_enabled)};

// ---- the checks that span keys ------------------------------------------------------------------

inline void read_fp16(const Ctx& c, const json& j, const std::string& path, Config& cfg) {
  Fp16Section s;
  read_object(c, j, path, fp16_keys, s);
  const double initial = std::ldexp(1.0, int(s.initial_scale_power));
  if (s.min_loss_scale > initial)
    c.fail(join(path, "min_loss_scale"),
           "must be <= the initial scale 2^initial_scale_power = ", initial, ", got ",
           s.min_loss_scale);
  cfg.fp16_scaler = c.checked(path, [&] {
    return s.loss_scale > 0 ? LossScaler::fixed(s.loss_scale)
                            : LossScaler::dynamic(
                                  DynamicScale{.initial_scale = float(initial),
                                               .window = s.loss_scale_window,
                                               .hysteresis = s.hysteresis,
                                               .consecutive_hysteresis = s.consecutive_hysteresis,
                                               .min_scale = s.min_loss_scale});
  });
  if (!s.enabled) return;
  cfg.precision = Precision::fp16;
  cfg.engine.loss_scaler = cfg.fp16_scaler;
}

// path: "bf16" or its older name "bfloat16", whichever is given.
inline void read_bf16(const Ctx& c, const json& j, const std::string& path, Config& cfg) {
  Bf16Section s;
  read_object(c, j, path, bf16_keys, s);
  if (!s.enabled) return;
  if (cfg.precision == Precision::fp16)
    c.fail(join(path, "enabled"), "fp16 and ", path,
           " are both enabled; enable one (bf16 needs no loss scaling)");
  cfg.precision = Precision::bf16;
}

inline void read_zero(const Ctx& c, const json& j, const std::string& path, Config& cfg) {
  read_object(c, j, path, zero_keys, cfg);
  if (cfg.offload_optimizer.device == OffloadDevice::nvme &&
      cfg.offload_optimizer.nvme_path.empty())
    c.fail(join(path, "offload_optimizer.nvme_path"),
           "offload_optimizer to \"nvme\" needs nvme_path, a directory on the drive");
  if (cfg.offload_param.device == OffloadDevice::nvme && cfg.offload_param.nvme_path.empty())
    c.fail(join(path, "offload_param.nvme_path"),
           "offload_param to \"nvme\" needs nvme_path, a directory on the drive");
  if (cfg.offload_param.device != OffloadDevice::none && cfg.stage != 3)
    c.fail(join(path, "offload_param.device"),
           "offloading the parameters needs stage 3, got stage ", cfg.stage,
           " (below it every rank keeps all of them)");
  if (cfg.engine.hpz_partition_size > 1 && cfg.stage != 3)
    c.fail(join(path, "zero_hpz_partition_size"), "a secondary partition needs stage 3, got stage ",
           cfg.stage, " (below it no parameters are gathered)");
  if (cfg.zero_quantized_gradients && cfg.stage < 2)
    c.fail(join(path, "zero_quantized_gradients"),
           "quantized gradients need stage 2 or 3, got stage ", cfg.stage,
           " (below it the gradients are all-reduced, not reduce-scattered)");
  if (cfg.zero_quantized_weights && cfg.stage != 3)
    c.fail(join(path, "zero_quantized_weights"),
           "quantized weight gathers need stage 3, got stage ", cfg.stage,
           " (below it no parameters are gathered)");
  if (cfg.mics_shard_size == 0)
    c.fail(join(path, "mics_shard_size"),
           "expected -1 (off) or a positive integer (ranks per shard group), got 0");
  if (cfg.mics_shard_size > 0 && cfg.stage == 0)
    c.fail(join(path, "mics_shard_size"), "hybrid sharding needs stage 1, 2 or 3, got stage 0",
           " (stage 0 shards nothing)");
}

inline float optimizer_lr(const AnyOptimizer& o) {
  return std::visit([](const auto& x) { return x.lr; }, o);
}

// "type" is the name of one of `supported` (any case), else an error naming the closest one,
// or saying that DeepSpeed has it and zp does not.
template <std::size_t N>
std::string type_of(const Ctx& c, const TypedSection& s, const std::string& path,
                    std::string_view what, const std::string_view (&supported)[N],
                    std::span<const std::string_view> deepspeed_only) {
  const std::string low = lower(s.type);
  for (std::string_view n : supported)
    if (lower(n) == low) return low;
  std::string list;
  for (std::string_view n : supported) list += zp::detail::cat(list.empty() ? "" : ", ", n);
  for (std::string_view n : deepspeed_only)
    if (lower(n) == low)
      c.fail(join(path, "type"), "\"", s.type,
             "\" is known to DeepSpeed, not supported by zp (zp has ", list, ")");
  const std::string_view near = closest(s.type, supported);
  c.fail(join(path, "type"), "unknown ", what, " ", show(json(s.type)),
         near.empty() ? "" : "; did you mean ", near, near.empty() ? "" : "?", " (zp has ", list,
         ")");
}

inline void read_optimizer(const Ctx& c, const json& j, const std::string& path, Config& cfg) {
  static constexpr std::string_view supported[] = {"Adam", "AdamW", "SGD", "Lion"};
  static constexpr std::string_view deepspeed_only[] = {
      "Lamb",    "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad",   "MuAdam",
      "MuAdamW", "MuSGD",      "Adadelta",    "Adamax",     "ASGD",      "LBFGS",
      "NAdam",   "RAdam",      "RMSprop",     "Rprop",      "SparseAdam"};
  TypedSection s;
  read_object(c, j, path, optimizer_keys, s);
  const std::string type = type_of(c, s, path, "optimizer", supported, deepspeed_only);
  const std::size_t autos_before = c.placeholders ? c.placeholders->size() : 0;
  const json empty = json::object();
  const json& params = s.params ? *s.params : empty;
  const std::string pp = join(path, "params");
  cfg.optimizer_given = true;
  if (type == "adam" || type == "adamw") {
    AdamSection a;
    read_object(c, params, pp, adam_keys, a, /*placeholders=*/true);
    if (type == "adamw" && !a.adam_w_mode)
      c.fail(join(pp, "adam_w_mode"),
             "AdamW always decouples weight decay; for L2 regularisation use \"type\": "
             "\"Adam\" with \"adam_w_mode\": false");
    if (a.adam_w_mode)
      cfg.optimizer = a.w;
    else
      cfg.optimizer = optim::Adam{.lr = a.w.lr,
                                  .beta1 = a.w.beta1,
                                  .beta2 = a.w.beta2,
                                  .eps = a.w.eps,
                                  .weight_decay = a.w.weight_decay};
  } else if (type == "lion") {
    optim::Lion l;
    read_object(c, params, pp, lion_keys, l, true);
    cfg.optimizer = l;
  } else {
    optim::Sgd o;
    read_object(c, params, pp, sgd_keys, o, true);
    cfg.optimizer = o;
  }
  // Cross-field rules (e.g. Nesterov needs a momentum) wait while "auto" placeholders stand in
  // for values the program fills; the engine validates the optimizer it is given anyway.
  if (!c.placeholders || c.placeholders->size() == autos_before)
    c.checked(pp, [&] { std::visit([](const auto& x) { optim::validate(x); }, cfg.optimizer); });
}

inline void read_scheduler(const Ctx& c, const json& j, const std::string& path, Config& cfg) {
  static constexpr std::string_view supported[] = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
                                                   "OneCycle"};
  static constexpr std::string_view deepspeed_only[] = {"LRRangeTest"};
  TypedSection s;
  read_object(c, j, path, scheduler_keys, s);
  const std::string type = type_of(c, s, path, "scheduler", supported, deepspeed_only);
  const std::size_t autos_before = c.placeholders ? c.placeholders->size() : 0;
  const json empty = json::object();
  const json& params = s.params ? *s.params : empty;
  const std::string pp = join(path, "params");
  auto read = [&](auto sched, const auto& keys) {
    read_object(c, params, pp, keys, sched, /*placeholders=*/true);
    cfg.scheduler = sched;
  };
  if (type == "warmuplr")
    read(schedule::WarmupLR{}, warmup_keys);
  else if (type == "warmupdecaylr")
    read(schedule::WarmupDecayLR{}, decay_keys);
  else if (type == "warmupcosinelr")
    read(schedule::WarmupCosineLR{.base_lr = double(optimizer_lr(cfg.optimizer))}, cosine_keys);
  else
    read(schedule::OneCycle{}, cycle_keys);
  // As for the optimizer: "auto" placeholders (e.g. total_num_steps) are not checked against the
  // other settings; the schedule's lr() checks the values the program filled in.
  if (!c.placeholders || c.placeholders->size() == autos_before)
    c.checked(pp, [&] { std::visit([](const auto& x) { x.check(); }, *cfg.scheduler); });
}

// ---- what describe() lists for the sections read by a function -----------------------------------

// fp16 as the Config holds it: enabled (the precision) and the section's loss scaler. The dynamic
// scaler's keys are kept only without a fixed loss_scale (otherwise their defaults show); each
// key the run does not use is marked so.
inline Fp16Section fp16_of(const Config& cfg) {
  Fp16Section s;
  s.enabled = cfg.precision == Precision::fp16;
  const LossScaler& ls = cfg.fp16_scaler;
  if (ls.kind() == LossScaler::Kind::fixed) s.loss_scale = ls.scale();
  if (ls.kind() == LossScaler::Kind::dynamic) {
    const DynamicScale& d = ls.config();
    s.initial_scale_power = std::ilogb(d.initial_scale);
    s.loss_scale_window = d.window;
    s.hysteresis = d.hysteresis;
    s.consecutive_hysteresis = d.consecutive_hysteresis;
    s.min_loss_scale = d.min_scale;
  }
  return s;
}
inline void list_fp16(const Config& cfg, const std::string& path, Listing& out) {
  const std::size_t first = out.size();
  list_object(fp16_keys, fp16_of(cfg), path, out);
  const bool off = cfg.precision != Precision::fp16;
  if (!off && cfg.fp16_scaler.kind() == LossScaler::Kind::dynamic) return;
  for (std::size_t i = first; i < out.size(); ++i)
    if (out[i].path != join(path, "enabled") && (off || out[i].path != join(path, "loss_scale")))
      out[i].value += off ? " (unused: fp16 is off)" : " (unused: no dynamic loss scaling)";
}

// "optimizer" and "scheduler": their table's keys, with "params" replaced by the lines of the
// table the type selects.
template <std::size_t N>
void list_typed(const TypedKey (&keys)[N], std::string_view type, const std::string& path,
                const Listing& params, Listing& out) {
  const TypedSection s{.type = std::string(type)};
  for (Shown& line : list_object(keys, s, path)) {
    if (line.path == join(path, "params"))
      out.insert(out.end(), params.begin(), params.end());
    else
      out.push_back(std::move(line));
  }
}

inline void list_optimizer(const Config& cfg, const std::string& path, Listing& out) {
  const std::string pp = join(path, "params");
  std::visit(
      [&](const auto& o) {
        using O = std::decay_t<decltype(o)>;
        if constexpr (std::is_same_v<O, optim::AdamW> || std::is_same_v<O, optim::Adam>) {
          constexpr bool w = std::is_same_v<O, optim::AdamW>;
          const AdamSection a{.w = {.lr = o.lr,
                                    .beta1 = o.beta1,
                                    .beta2 = o.beta2,
                                    .eps = o.eps,
                                    .weight_decay = o.weight_decay},
                              .adam_w_mode = w};
          list_typed(optimizer_keys, w ? "AdamW" : "Adam", path, list_object(adam_keys, a, pp),
                     out);
        } else if constexpr (std::is_same_v<O, optim::Lion>) {
          list_typed(optimizer_keys, "Lion", path, list_object(lion_keys, o, pp), out);
        } else {
          static_assert(std::is_same_v<O, optim::Sgd>,
                        "list_optimizer: an optimizer without a table");
          list_typed(optimizer_keys, "SGD", path, list_object(sgd_keys, o, pp), out);
        }
      },
      cfg.optimizer);
}

inline void list_scheduler(const Config& cfg, const std::string& path, Listing& out) {
  if (!cfg.scheduler) {
    out.push_back({path, "null"});
    return;
  }
  const std::string pp = join(path, "params");
  std::visit(
      [&](const auto& x) {
        using S = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<S, schedule::WarmupLR>)
          list_typed(scheduler_keys, "WarmupLR", path, list_object(warmup_keys, x, pp), out);
        else if constexpr (std::is_same_v<S, schedule::WarmupDecayLR>)
          list_typed(scheduler_keys, "WarmupDecayLR", path, list_object(decay_keys, x, pp), out);
        else if constexpr (std::is_same_v<S, schedule::WarmupCosineLR>)
          list_typed(scheduler_keys, "WarmupCosineLR", path, list_object(cosine_keys, x, pp), out);
        else if constexpr (std::is_same_v<S, schedule::OneCycle>)
          list_typed(scheduler_keys, "OneCycle", path, list_object(cycle_keys, x, pp), out);
        else  // Constant: set by a program, not read from a ds_config
          list_typed(scheduler_keys, "Constant", path,
                     {{join(pp, "value"), zp::detail::cat(x.value)}}, out);
      },
      *cfg.scheduler);
}

// What can be checked before the world size is known: some world size must fit.
inline void check_batch(const Ctx& c, const Config& cfg) {
  const BatchConfig& b = cfg.batch;
  const std::int64_t t = b.train_batch_size, m = b.micro_batch_per_rank,
                     g = b.gradient_accumulation_steps;
  if (!t && !m) {
    const bool auto_seen = cfg.is_auto("train_batch_size") ||
                           cfg.is_auto("train_micro_batch_size_per_gpu") ||
                           cfg.is_auto("gradient_accumulation_steps");
    if (!auto_seen)
      c.fail("train_batch_size",
             "give train_batch_size or train_micro_batch_size_per_gpu (or both, or \"auto\" "
             "for the program to fill)");
    return;
  }
  if (!t) return;
  std::int64_t per_rank = 0;
  if (m && g && __builtin_mul_overflow(m, g, &per_rank))
    c.fail("train_batch_size", "train_micro_batch_size_per_gpu (", m,
           ") * gradient_accumulation_steps (", g, ") overflows a 64-bit integer");
  const std::int64_t unit = m && g ? per_rank : m ? m : g ? g : 1;
  if (t % unit != 0)
    c.fail("train_batch_size", "train_batch_size (", t,
           ") must equal train_micro_batch_size_per_gpu",
           m ? zp::detail::cat(" (", m, ")") : std::string(" (not given)"),
           " * gradient_accumulation_steps",
           g ? zp::detail::cat(" (", g, ")") : std::string(" (not given)"),
           " * the world size, but it is not a multiple of ", unit, ", so no world size fits");
}

inline Config parse_root(const json& j, std::string_view source) {
  Config cfg;
  cfg.source = std::string(source);
  const Ctx c = context(cfg.source, &cfg.auto_keys);
  if (!j.is_object()) c.expected("", "a JSON object {...} at the top level", j);
  read_object(c, j, "", root_keys, cfg);
  check_batch(c, cfg);
  return cfg;
}

}  // namespace detail

// Checks a parsed JSON document and fills DeepSpeed's defaults. Throws zp::Error(invalid_argument)
// naming `source_name`, the key path and what was expected.
template <std::same_as<nlohmann::json> Json>
Config parse(const Json& j, std::string_view source_name = "ds_config") {
  return detail::parse_root(j, source_name);
}

// Parses ds_config.json text: invalid JSON (named with line and column), nesting deeper than 32
// levels, duplicate keys and everything parse(json) rejects are errors.
inline Config parse(std::string_view text, std::string_view source_name) {
  return detail::parse_root(zp::detail::parse_json(text, source_name, Errc::invalid_argument),
                            source_name);
}

// Reads and parses a file; the source name in messages is the path as given. A file that cannot
// be read (missing, not a regular file, over 16 MiB) is Errc::io.
inline Config load(const std::filesystem::path& path) {
  return parse(zp::detail::read_whole_file(path, std::uint64_t(16) << 20), path.string());
}

// Fills fp16.enabled and bf16.enabled where c writes "auto", for a program whose model is of
// precision p, as Hugging Face's Trainer fills them from its --fp16 and --bf16: the precision
// becomes p (fp16 with the fp16 section's loss scaler). As the Trainer's, a key written true or
// false (or not given: false) must agree with p, else it is an error naming it. Without an "auto"
// one, c is left as written and the result is false.
inline bool fill_precision(Config& c, Precision p) {
  const char* bf16_key = c.is_auto("bfloat16.enabled") ? "bfloat16.enabled" : "bf16.enabled";
  const bool fp16_auto = c.is_auto("fp16.enabled"), bf16_auto = c.is_auto(bf16_key);
  if (!fp16_auto && !bf16_auto) return false;
  const auto agree = [&](bool is_auto, const char* key, Precision of) {
    const bool on = c.precision == of;  // as written
    if (!is_auto && on != (p == of))
      detail::context(c.source, nullptr)
          .fail(key, "is ", on ? "true" : "false (or not given)",
                ", which the program's precision ", detail::ds_name(p),
                " (filling the \"auto\" one) contradicts: write \"auto\" there "
                "too, or ",
                p == of ? "true" : "false");
  };
  agree(fp16_auto, "fp16.enabled", Precision::fp16);
  agree(bf16_auto, bf16_key, Precision::bf16);
  c.precision = p;
  c.engine.loss_scaler = p == Precision::fp16 ? c.fp16_scaler : LossScaler::none();
  return true;
}

// ---- describe --------------------------------------------------------------------------------

namespace detail {
inline std::string describe_schedule(const schedule::Any& s) {
  using zp::detail::cat;
  auto type = [](schedule::Warmup w) { return w == schedule::Warmup::log ? "log" : "linear"; };
  return std::visit(
      [&](const auto& x) -> std::string {
        using S = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<S, schedule::Constant>)
          return cat("Constant(value=", x.value, ")");
        else if constexpr (std::is_same_v<S, schedule::WarmupLR>)
          return cat("WarmupLR(warmup_min_lr=", x.warmup_min_lr,
                     ", warmup_max_lr=", x.warmup_max_lr, ", warmup_num_steps=", x.warmup_num_steps,
                     ", warmup_type=", type(x.warmup_type), ")");
        else if constexpr (std::is_same_v<S, schedule::WarmupDecayLR>)
          return cat("WarmupDecayLR(warmup_min_lr=", x.warmup_min_lr,
                     ", warmup_max_lr=", x.warmup_max_lr, ", warmup_num_steps=", x.warmup_num_steps,
                     ", total_num_steps=", x.total_num_steps, ", warmup_type=", type(x.warmup_type),
                     ")");
        else if constexpr (std::is_same_v<S, schedule::WarmupCosineLR>)
          return cat("WarmupCosineLR(base_lr=", x.base_lr, ", total_num_steps=", x.total_num_steps,
                     ", warmup_min_ratio=", x.warmup_min_ratio,
                     ", warmup_num_steps=", x.warmup_num_steps, ", cos_min_ratio=", x.cos_min_ratio,
                     ", warmup_type=", type(x.warmup_type), ")");
        else
          return cat("OneCycle(cycle_min_lr=", x.cycle_min_lr, ", cycle_max_lr=", x.cycle_max_lr,
                     ", decay_lr_rate=", x.decay_lr_rate,
                     ", cycle_first_step_size=", x.cycle_first_step_size,
                     ", cycle_second_step_size=", x.second(),
                     ", decay_step_size=", x.decay_step_size,
                     ", cycle_momentum=", x.cycle_momentum ? "true" : "false",
                     ", cycle_min_mom=", x.cycle_min_mom, ", cycle_max_mom=", x.cycle_max_mom,
                     ", decay_mom_rate=", x.decay_mom_rate, ")");
      },
      s);
}
}  // namespace detail

// A summary, a line per setting, then every key zp reads with its value as the Config keeps it
// ("zero_optimization.stage: 3"), listed from the same declarations the reader walks: for a
// program's startup print.
inline std::string describe(const Config& c) {
  using zp::detail::cat;
  auto batch = [&](std::int64_t v, const char* key) {
    return v ? cat(v) : c.is_auto(key) ? "auto" : "not given";
  };
  const LossScaler& ls = c.engine.loss_scaler;
  std::string precision = detail::ds_name(c.precision);
  if (ls.kind() == LossScaler::Kind::fixed) precision += cat(", fixed loss scale ", ls.scale());
  if (ls.kind() == LossScaler::Kind::dynamic) {
    const DynamicScale& d = ls.config();
    precision += cat(", dynamic loss scale (initial ", d.initial_scale, ", window ", d.window,
                     ", hysteresis ", d.hysteresis, ", consecutive_hysteresis ",
                     d.consecutive_hysteresis ? "true" : "false", ", min ", d.min_scale, ")");
  }
  auto dtype = [](const std::optional<DType>& t) {
    return t ? detail::ds_name(*t) : "null (the model's)";
  };
  std::string out = cat("ds_config ", c.source, ":\n");
  out += cat("  batch: train_batch_size ", batch(c.batch.train_batch_size, "train_batch_size"),
             ", train_micro_batch_size_per_gpu ",
             batch(c.batch.micro_batch_per_rank, "train_micro_batch_size_per_gpu"),
             ", gradient_accumulation_steps ",
             batch(c.batch.gradient_accumulation_steps, "gradient_accumulation_steps"),
             " (completed for the world size)\n");
  out += cat("  precision: ", precision, "\n");
  out +=
      cat("  zero: stage ", c.stage, ", reduce_bucket_size ", c.reduce_bucket_size, " elements\n");
  out += cat("  stage 3: max_live_parameters ", c.engine.max_live_params,
             ", param_persistence_threshold ", c.engine.persist_threshold, ", max_reuse_distance ",
             c.engine.max_reuse_distance, ", prefetch_bucket_size ", c.engine.prefetch,
             c.engine.prefetch ? " (elements gathered ahead)" : " (no prefetch)",
             ", zero_quantized_weights ", c.zero_quantized_weights, ", zero_hpz_partition_size ",
             c.engine.hpz_partition_size, ", zero_quantized_gradients ", c.zero_quantized_gradients,
             "\n");
  if (c.mics_shard_size > 0)
    out += cat("  mics_shard_size: ", c.mics_shard_size,
               " (ZeRO over groups of that many ranks, replicated across them)\n");
  out += cat("  offload_optimizer: ", detail::ds_name(c.offload_optimizer.device), "\n");
  out += cat("  offload_param: ", detail::ds_name(c.offload_param.device),
             c.offload_param.device == OffloadDevice::nvme
                 ? cat(" (nvme_path ", c.offload_param.nvme_path, ", buffer_count ",
                       c.offload_param.buffer_count, ")")
                 : std::string(),
             "\n");
  if (c.offload_optimizer.device == OffloadDevice::nvme)
    out += cat("  nvme: nvme_path ", c.offload_optimizer.nvme_path, ", buffer_count ",
               c.offload_optimizer.buffer_count, ", pipeline_read ",
               c.offload_optimizer.pipeline_read, ", pipeline_write ",
               c.offload_optimizer.pipeline_write, ", sub_group_size ", c.sub_group_size,
               ", aio block_size ", c.aio.block_size, ", queue_depth ", c.aio.queue_depth, "\n");
  out += cat(
      "  optimizer: ", std::visit([](const auto& o) { return optim::describe(o); }, c.optimizer),
      c.optimizer_given ? "" : " (no optimizer section: DeepSpeed's Adam defaults)", "\n");
  out += cat("  scheduler: ",
             c.scheduler ? detail::describe_schedule(*c.scheduler) : std::string("none"), "\n");
  out += cat("  gradient_clipping: ", c.engine.max_grad_norm,
             c.engine.max_grad_norm > 0 ? "" : " (off)", "\n");
  out += cat("  grad_accum_dtype: ", dtype(c.grad_accum_dtype),
             ", communication_data_type: ", dtype(c.communication_data_type), "\n");
  out += cat("  checkpoint: tag_validation ", detail::ds_name(c.tag_validation), "\n");
  out += cat("  steps_per_print: ", c.steps_per_print,
             ", wall_clock_breakdown: ", c.wall_clock_breakdown ? "true" : "false", "\n");
  if (!c.auto_keys.empty()) {
    out += "  \"auto\" (for the program to fill):";
    for (std::size_t i = 0; i < c.auto_keys.size(); ++i) out += (i ? ", " : " ") + c.auto_keys[i];
    out += "\n";
  }
  // Then every key zp reads, from its declaration (detail::root_keys and the tables under it).
  out += "  as read (each key zp reads, as the Config keeps it):\n";
  for (const detail::Shown& line : detail::list_object(detail::root_keys, c))
    out +=
        cat("    ", line.path, ": ", line.value, c.is_auto(line.path) ? " (\"auto\")" : "", "\n");
  return out;
}

// ---- the dispatch ----------------------------------------------------------------------------

// The element types, stages and optimizers a program compiles in for with_engine (dispatch.hpp).
// Every combination is one Engine instantiation (seconds of compile time each): list only what
// the program's configs use.
using zp::Optimizers;
using zp::Stages;
using zp::Types;

// The EngineConfig for element type T at `world_size` ranks: the batch triad completed
// (resolve_batch; an inconsistent triad names the config's keys and all four numbers) and
// reduce_bucket_size converted from elements to bytes of T.
template <class T>
EngineConfig engine_config(const Config& c, int world_size) {
  const detail::Ctx ctx = detail::context(c.source, nullptr);
  EngineConfig e = c.engine;
  e.batch = ctx.checked(
      zp::detail::cat("train_batch_size/train_micro_batch_size_per_gpu/gradient_accumulation_steps "
                      "at world size ",
                      world_size),
      [&] { return resolve_batch(c.batch, world_size); });
  e.bucket_bytes = ctx.checked("zero_optimization.reduce_bucket_size", [&] {
    return zp::detail::checked_mul(std::size_t(c.reduce_bucket_size), sizeof(T),
                                   "bytes of the bucket");
  });
  e.first_bucket_bytes = std::min(e.first_bucket_bytes, e.bucket_bytes);
  e.wall_clock_breakdown = c.wall_clock_breakdown;
  e.offload_optimizer = c.offload_optimizer.device != OffloadDevice::none;
  if (c.offload_optimizer.device == OffloadDevice::nvme)
    e.optimizer_nvme = NvmeOptions{.path = c.offload_optimizer.nvme_path,
                                   .buffer_count = c.offload_optimizer.buffer_count,
                                   .pipeline_read = c.offload_optimizer.pipeline_read,
                                   .pipeline_write = c.offload_optimizer.pipeline_write,
                                   .sub_group_size = std::size_t(c.sub_group_size),
                                   .queue_depth = unsigned(c.aio.queue_depth),
                                   .block_size = std::size_t(c.aio.block_size)};
  e.offload_param = c.offload_param.device != OffloadDevice::none;
  if (c.offload_param.device == OffloadDevice::nvme)
    // DeepSpeed's offload_param has no pipeline keys: its swap is read and written in the
    // optimizer step's walk (beside the optimizer's swap when both are on NVMe), so it takes
    // offload_optimizer's.
    e.param_nvme = NvmeOptions{.path = c.offload_param.nvme_path,
                               .buffer_count = c.offload_param.buffer_count,
                               .pipeline_read = c.offload_optimizer.pipeline_read,
                               .pipeline_write = c.offload_optimizer.pipeline_write,
                               .sub_group_size = std::size_t(c.sub_group_size),
                               .queue_depth = unsigned(c.aio.queue_depth),
                               .block_size = std::size_t(c.aio.block_size)};
  if (c.zero_quantized_weights) e.quantized_weights = zero_quantized_weights;
  if (c.zero_quantized_gradients) e.quantized_gradients = zero_quantized_gradients;
  e.shard_group_size = std::max(c.mics_shard_size, 0);
  e.grad_accum_dtype = c.grad_accum_dtype;
  e.communication_dtype = c.communication_data_type;
  e.steps_per_print =
      int(std::min<std::int64_t>(c.steps_per_print, std::numeric_limits<int>::max()));
  return e;
}

namespace detail {
template <class V>
std::string braces(const std::vector<V>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += zp::detail::cat(i ? ", " : "", v[i]);
  return s + "}";
}
inline std::string braces(const std::vector<DType>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += zp::detail::cat(i ? ", " : "", ds_name(v[i]));
  return s + "}";
}
}  // namespace detail

// Calls f(std::type_identity<Engine<B, T, Stage, Opt>>{}, engine_config, optimizer) for the
// one combination the config selects (T from the precision: float, bf16 or fp16) and returns
// what f returns; f must return the same type for every combination compiled in. Throws
// zp::Error(invalid_argument) before calling f when the config asks for something this program
// did not compile in (naming what it did), for what zp's engine does not do yet
// (a grad_accum_dtype or communication_data_type other than fp32 or the model's type), and
// when the batch triad does not fit world_size.
template <Backend B, class TypeList = AllTypes, class StageList = AllStages,
          class OptList = AllOptimizers, class F>
decltype(auto) with_engine(const Config& c, int world_size, F&& f) {
  static_assert(zp::detail::non_empty_list<TypeList> && zp::detail::non_empty_list<StageList> &&
                    zp::detail::non_empty_list<OptList>,
                "with_engine<B, Types<T...>, Stages<S...>, Optimizers<O...>>: each list names at "
                "least one entry");
  const detail::Ctx ctx = detail::context(c.source, nullptr);
  const DType t = c.dtype();
  if (!contains(TypeList{}, t))
    ctx.fail(c.precision == Precision::fp32   ? ""
             : c.precision == Precision::fp16 ? "fp16.enabled"
                                              : "bf16.enabled",
             "config asks for precision ", detail::ds_name(c.precision),
             ", this program was built with element types ", detail::braces(values(TypeList{})));
  if (!contains(StageList{}, c.stage))
    ctx.fail("zero_optimization.stage", "config asks for stage ", c.stage,
             ", this program was built with stages ", detail::braces(values(StageList{})));
  if (!contains(OptList{}, c.optimizer))
    ctx.fail("optimizer.type", "config asks for optimizer ",
             zp::detail::optimizer_name(c.optimizer), ", this program was built with optimizers ",
             detail::braces(values(OptList{})));
  if (c.grad_accum_dtype && *c.grad_accum_dtype != t && *c.grad_accum_dtype != DType::f32)
    ctx.fail("data_types.grad_accum_dtype", detail::ds_name(*c.grad_accum_dtype),
             " is not supported: zp accumulates gradients in fp32 or the model's element type (",
             detail::ds_name(t), " here)");
  if (c.communication_data_type && *c.communication_data_type != t &&
      *c.communication_data_type != DType::f32)
    ctx.fail("communication_data_type", detail::ds_name(*c.communication_data_type),
             " is not supported: zp reduces gradients in fp32 or the model's element type (",
             detail::ds_name(t), " here)");
  return dispatch_type<TypeList>(t, [&]<class T>(std::type_identity<T>) -> decltype(auto) {
    const EngineConfig ec = engine_config<T>(c, world_size);
    return dispatch_stage<StageList>(
        c.stage, [&]<int S>(std::integral_constant<int, S>) -> decltype(auto) {
          return dispatch_optimizer<OptList>(
              c.optimizer, [&]<class O>(const O& opt) -> decltype(auto) {
                return f(std::type_identity<Engine<B, T, S, O>>{}, ec, opt);
              });
        });
  });
}

}  // namespace zp::ds
