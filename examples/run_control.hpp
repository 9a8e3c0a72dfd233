// examples/run_control.hpp: what the trainers share beyond the training loop's flags. Every
// trainer (zp_demo, zp_gpt, the device demo): checkpoints every N steps, --resume, the stop on a
// signal and the export at the end (CheckpointFlags). The CPU trainers (RunFlags): also the engine
// the flags or a DeepSpeed --config describe and the JSON log. Configs, checkpoints and exports
// need zp::io (ZP_DEMO_IO); without it those flags are refused.
//
// A checkpoint's user data is the number of steps done followed by the vocabulary (the character
// of each id), so a resumed run continues the same data stream and refuses a text whose
// vocabulary differs. The export writes DIR/model.safetensors and DIR/vocab.json
// ({"byte_of_id": [...]}: the byte each token id stands for).
#pragma once

#include <fcntl.h>     // open
#include <sys/stat.h>  // stat
#include <unistd.h>    // access

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "common.hpp"
#include "zp/schedule.hpp"
#if ZP_DEMO_IO
#include "zp/checkpoint.hpp"
#include "zp/detail/file.hpp"
#include "zp/ds_config.hpp"
#endif

namespace examples {

// The flags of checkpoints and the export, which every trainer takes.
struct CheckpointFlags {
  std::string checkpoint_dir, export_dir;
  int save_every = 0;
  int keep_checkpoints = 0;  // --keep-checkpoints (SaveOptions::keep_last; 0: all)
  bool resume = false;
};

// The CPU trainers' flags: CheckpointFlags' and those of a config, the logs and ZeRO++.
struct RunFlags : CheckpointFlags {
  std::string log_json, config;
  bool breakdown = false;
  bool quantized_weights = false;    // --zero-quantized-weights (EngineConfig::quantized_weights)
  int hpz = 1;                       // --zero-hpz-partition-size (EngineConfig::hpz_partition_size)
  bool quantized_gradients = false;  // --zero-quantized-gradients (EngineConfig's)
  int ranks_per_node = 0;            // --ranks-per-node (EngineConfig::ranks_per_node)
  int shard_group = 0;               // --shard-group-size (EngineConfig::shard_group_size)
  bool no_reshard = false;  // --no-reshard-after-forward (EngineConfig::reshard_after_forward)
  int reuse = -1;           // --max-reuse-distance (EngineConfig::max_reuse_distance; -1: its own)
};

// The flags that take no value (examples::parse_args' switches) of CheckpointFlags and RunFlags.
inline constexpr std::initializer_list<const char*> checkpoint_switches = {"--resume"};
inline constexpr std::initializer_list<const char*> run_switches = {
    "--resume", "--wall-clock-breakdown", "--zero-quantized-weights", "--zero-quantized-gradients",
    "--no-reshard-after-forward"};

// The usage lines of CheckpointFlags' and RunFlags' flags (Program::more).
#define ZP_EXAMPLES_CHECKPOINT_USAGE                                                              \
  "  --checkpoint-dir D where checkpoints go (tags step<N>; D/latest names the newest); on\n"     \
  "                     SIGTERM or SIGINT the run saves the step in flight there and stops\n"     \
  "  --save-every N     save a checkpoint every N steps (needs --checkpoint-dir) (default 0: "    \
  "never)\n"                                                                                      \
  "  --keep-checkpoints N  after each save keep the N newest checkpoints in D, removing older\n"  \
  "                     ones (default 0: keep all)\n"                                             \
  "  --resume           continue from D/latest (any --ranks, --stage, --backend); a D without "   \
  "one\n"                                                                                         \
  "                     yet starts at step 0 and says so\n"                                       \
  "  --export DIR       at the end, write the trained model to DIR (model.safetensors; zp_gpt:\n" \
  "                     a Hugging Face GPT-2 directory) and its vocabulary as DIR/vocab.json\n"
inline constexpr const char* checkpoint_usage =
    ZP_EXAMPLES_CHECKPOINT_USAGE "  --help             this text\n";
inline constexpr const char* run_usage = ZP_EXAMPLES_CHECKPOINT_USAGE
    "  --wall-clock-breakdown  print where each logged step's time went (forward, backward, ...)\n"
    "  --log-json PATH    append one JSON line per step: the global batch's mean loss and phase "
    "times\n"
    "                     (tools/plot_timers.py)\n"
    "  --config FILE      a DeepSpeed ds_config.json: it sets the stage, precision, batch, "
    "optimizer\n"
    "                     (AdamW only here), scheduler, clipping, loss scaling, buckets, offload\n"
    "                     and ZeRO++ (--stage, --offload-*, --zero-*, --shard-group-size and\n"
    "                     --max-reuse-distance with it are errors); its \"auto\" keys are\n"
    "                     filled from --micro-batch, --accum, --lr, --steps, --precision and\n"
    "                     the model's width, as Hugging Face's Trainer fills them\n"
    "  --zero-quantized-weights  stage 3: gather the parameters as int8 with a scale per 2048\n"
    "                     (ZeRO++'s qwZ; in a --config: zero_quantized_weights)\n"
    "  --zero-hpz-partition-size N  stage 3: also keep 1/N of each gathered module, so gathers\n"
    "                     after a module's first of a step stay among N consecutive data-parallel\n"
    "                     ranks (ZeRO++'s hpZ; a --config: zero_hpz_partition_size) (default 1)\n"
    "  --zero-quantized-gradients  stage 2/3: reduce the gradients as int8 with a scale per 512,\n"
    "                     inside each node, then across nodes (ZeRO++'s qgZ; a --config:\n"
    "                     zero_quantized_gradients)\n"
    "  --ranks-per-node N data-parallel ranks per node, consecutive, for qgZ's two hops (default\n"
    "                     0: the backend's nodes; mpi: the machines, or ZP_RANKS_PER_NODE)\n"
    "  --shard-group-size N  stages 1-3: hybrid sharding, ZeRO over groups of N consecutive\n"
    "                     data-parallel ranks, replicated across the groups (MiCS, FSDP2's HSDP;\n"
    "                     a --config: mics_shard_size) (default 0: all of them)\n"
    "  --no-reshard-after-forward  stage 3: keep each module gathered from its forward to its\n"
    "                     backward, which then gathers nothing (FSDP2's reshard_after_forward;\n"
    "                     the gathered model is held in between; with a --config too)\n"
    "  --max-reuse-distance N  stage 3: keep a module gathered from its forward to its backward\n"
    "                     when fewer than N elements are gathered in between (DeepSpeed's\n"
    "                     stage3_max_reuse_distance) (default 1: the last module only; 0: none)\n"
    "  --help             this text\n";
#undef ZP_EXAMPLES_CHECKPOINT_USAGE

// Takes flag a with value v if it is one of CheckpointFlags'; false if not.
inline bool parse_checkpoint_flag(const Program& p, CheckpointFlags& o, const std::string& a,
                                  const std::string& v) {
  if (a == "--resume")
    o.resume = true;
  else if (a == "--save-every")
    o.save_every = to_int(p, a, v, 0, 10000000);
  else if (a == "--keep-checkpoints")
    o.keep_checkpoints = to_int(p, a, v, 0, 10000000);
  else if (a == "--checkpoint-dir")
    o.checkpoint_dir = v;
  else if (a == "--export")
    o.export_dir = v;
  else
    return false;
  return true;
}

// Takes flag a with value v if it is one of RunFlags'; false if not.
inline bool parse_run_flag(const Program& p, RunFlags& o, const std::string& a,
                           const std::string& v) {
  if (parse_checkpoint_flag(p, o, a, v))
    return true;
  else if (a == "--wall-clock-breakdown")
    o.breakdown = true;
  else if (a == "--zero-quantized-weights")
    o.quantized_weights = true;
  else if (a == "--zero-hpz-partition-size")
    o.hpz = to_int(p, a, v, 1, 1 << 20);
  else if (a == "--zero-quantized-gradients")
    o.quantized_gradients = true;
  else if (a == "--ranks-per-node")
    o.ranks_per_node = to_int(p, a, v, 0, 1 << 20);
  else if (a == "--shard-group-size")
    o.shard_group = to_int(p, a, v, 0, 1 << 20);
  else if (a == "--no-reshard-after-forward")
    o.no_reshard = true;
  else if (a == "--max-reuse-distance")
    o.reuse = to_int(p, a, v, 0, 2'000'000'000);
  else if (a == "--log-json")
    o.log_json = v;
  else if (a == "--config")
    o.config = v;
  else
    return false;
  return true;
}

#if !ZP_DEMO_IO
[[noreturn]] inline void refuse_io(const Program& p) {
  bad(p, std::string("this ") + p.name +
             " was built without zp::io (nlohmann_json was not found at configure time): no "
             "checkpoints, exports or configs");
}
#endif

inline void check_checkpoint_flags(const Program& p, const CheckpointFlags& o) {
  if ((o.save_every || o.resume || o.keep_checkpoints) && o.checkpoint_dir.empty())
    bad(p, "--save-every, --keep-checkpoints and --resume need --checkpoint-dir");
#if !ZP_DEMO_IO
  if (!o.checkpoint_dir.empty() || !o.export_dir.empty()) refuse_io(p);
#else
  // Checked before the training, not found by the first save or the export at its end: the
  // directory, or the nearest existing one it would be made in, must be a writable directory.
  for (const auto& [flag, dir] :
       {std::pair<std::string, const std::string*>{"--checkpoint-dir", &o.checkpoint_dir},
        {"--export", &o.export_dir}}) {
    if (dir->empty()) continue;
    std::error_code ec;
    std::filesystem::path at = std::filesystem::absolute(*dir, ec);
    while (!std::filesystem::exists(at, ec) && at.has_relative_path()) at = at.parent_path();
    const std::string where =
        at == std::filesystem::absolute(*dir, ec) ? "" : ": " + at.string() + ", where it goes,";
    if (!std::filesystem::is_directory(at, ec))
      bad(p, flag + " " + *dir + where + " is not a directory");
    if (::access(at.c_str(), W_OK | X_OK) != 0)
      bad(p, flag + " " + *dir + where + " is not writable: " + std::strerror(errno));
  }
  // (the export could take the name of a tag or `latest`, which the saves and prune manage)
  if (!o.export_dir.empty() && !o.checkpoint_dir.empty() &&
      zp::detail::is_within(o.export_dir, o.checkpoint_dir))
    bad(p, "--export " + o.export_dir + " is inside --checkpoint-dir " + o.checkpoint_dir +
               ", whose entries the saves manage; export elsewhere");
#endif
}

// `given`: the flags on the command line (parse_args). A flag for what --config sets is an error,
// not dropped in silence.
inline void check_run_flags(const Program& p, const RunFlags& o,
                            const std::vector<std::string>& given) {
  check_checkpoint_flags(p, o);
  static constexpr std::pair<const char*, const char*> config_sets[] = {
      {"--stage", "zero_optimization.stage"},
      {"--offload-optimizer", "zero_optimization.offload_optimizer"},
      {"--offload-param", "zero_optimization.offload_param"},
      {"--zero-quantized-weights", "zero_optimization.zero_quantized_weights"},
      {"--zero-hpz-partition-size", "zero_optimization.zero_hpz_partition_size"},
      {"--zero-quantized-gradients", "zero_optimization.zero_quantized_gradients"},
      {"--shard-group-size", "zero_optimization.mics_shard_size"},
      {"--max-reuse-distance", "zero_optimization.stage3_max_reuse_distance"}};
  if (!o.config.empty())
    for (const auto& [flag, key] : config_sets)
      if (gave(given, flag))
        bad(p, std::string(flag) + " with --config: the config sets it (" + key + ")");
  // The nodes are qgZ's alone (with --config, with_engine checks the config asks for it).
  if (o.config.empty() && o.ranks_per_node && !o.quantized_gradients)
    bad(p, "--ranks-per-node " + std::to_string(o.ranks_per_node) +
               " needs --zero-quantized-gradients (the nodes are its two hops')");
#if !ZP_DEMO_IO
  if (!o.config.empty()) refuse_io(p);
#endif
}

// Buckets for a model of a few hundred thousand parameters (zp_demo's, zp_gpt's defaults): several
// even so, and small tensors kept gathered. A model sized to fill a GPU keeps the engine's.
inline zp::EngineConfig small_model_buckets() {
  zp::EngineConfig ec;
  ec.bucket_bytes = std::size_t(256) << 10;
  ec.first_bucket_bytes = std::size_t(64) << 10;
  ec.persist_threshold = 10000;
  return ec;
}

// The gradient clipping of the flags (and of a config's "auto" gradient_clipping): Hugging Face's
// default max_grad_norm.
inline constexpr float flag_max_grad_norm = 1.0f;

// The engine settings of the training flags (without --config) on top of `ec` (its buckets):
// clipping at flag_max_grad_norm, fp16 with a dynamic scale.
inline zp::EngineConfig flag_config(const TrainFlags& t, const RunFlags& r, zp::EngineConfig ec) {
  ec.batch = {.micro_batch_per_rank = t.micro_batch, .gradient_accumulation_steps = t.accum};
  ec.max_grad_norm = flag_max_grad_norm;
  ec.steps_per_print = t.log_every;
  ec.wall_clock_breakdown = r.breakdown;
  ec.offload_optimizer = t.offload;
  ec.offload_param = t.offload_param;
  // NVMe: sub-groups of 256K elements (3 MiB of AdamW state), read ahead and written behind.
  const auto nvme = [](const std::string& dir) -> std::optional<zp::NvmeOptions> {
    if (dir.empty()) return std::nullopt;
    return zp::NvmeOptions{.path = dir,
                           .pipeline_read = true,
                           .pipeline_write = true,
                           .sub_group_size = std::size_t(1) << 18};
  };
  ec.optimizer_nvme = nvme(t.nvme);
  ec.param_nvme = nvme(t.param_nvme);
  if (r.quantized_weights) ec.quantized_weights = zp::zero_quantized_weights;
  ec.hpz_partition_size = r.hpz;
  if (r.quantized_gradients) ec.quantized_gradients = zp::zero_quantized_gradients;
  ec.ranks_per_node = r.ranks_per_node;
  ec.shard_group_size = r.shard_group;
  ec.reshard_after_forward = !r.no_reshard;
  ZP_EXPECT(r.reuse < 0 || t.stage == 3, "--max-reuse-distance ", r.reuse,
            " needs ZeRO stage 3 (below it no parameters are gathered), got stage ", t.stage);
  if (r.reuse >= 0) ec.max_reuse_distance = std::size_t(r.reuse);
  if (t.precision == "fp16")
    ec.loss_scaler = zp::LossScaler::dynamic({.initial_scale = 65536.0f, .window = 100});
  return ec;
}

// The learning rate of the flags: warmup over the first 5% of --steps to --lr, then cosine to 10%.
inline zp::schedule::Any flag_schedule(const TrainFlags& t) {
  return zp::schedule::WarmupCosineLR{.base_lr = t.lr,
                                      .total_num_steps = t.steps,
                                      .warmup_num_steps = std::max(1, t.steps / 20),
                                      .cos_min_ratio = 0.1,
                                      .warmup_type = zp::schedule::Warmup::linear};
}

#if ZP_DEMO_IO
// A config's "auto" keys, filled from the flags and the model as Hugging Face's Trainer fills them
// from its arguments: train_micro_batch_size_per_gpu (--micro-batch),
// gradient_accumulation_steps (--accum), gradient_clipping (the flags' max_grad_norm), fp16/bf16
// .enabled (--precision, zp::ds::fill_precision), the optimizer's lr (--lr; "auto" betas, eps and
// weight_decay keep their defaults, which are the Trainer's too), the schedule's warmup_min_lr
// (0), warmup_max_lr (--lr), warmup_num_steps (flag_schedule's: 5% of --steps) and
// total_num_steps (--steps), and from the model's width `hidden`: reduce_bucket_size hidden^2,
// stage3_prefetch_bucket_size 0.9 hidden^2 and stage3_param_persistence_threshold 10 hidden. A
// WarmupCosineLR's base_lr is the optimizer's lr; without a scheduler section it is
// flag_schedule's, peaking there. Any other "auto" is an error naming it, and so
// is --precision where the config writes the precision, and --lr given beside a config whose lr
// differs (with_engine checks --micro-batch and --accum against the completed batch).
inline void fill_auto(zp::ds::Config& dc, const TrainFlags& t, std::uint64_t hidden,
                      const char* program) {
  // A float lr as the decimal it was written as (0.004, not 0.004000000189989805).
  const auto decimal = [](float x) {
    char buf[32];
    double d = x;
    std::from_chars(buf, std::to_chars(buf, buf + sizeof buf, x).ptr, d);
    return d;
  };
  const auto from_flags = std::get<zp::schedule::WarmupCosineLR>(flag_schedule(t));
  constexpr std::string_view schedule_params = "scheduler.params.";
  for (const std::string& key : dc.auto_keys) {
    const std::string_view param = key.starts_with(schedule_params)
                                       ? std::string_view(key).substr(schedule_params.size())
                                       : "";
    constexpr std::string_view zero = "zero_optimization.";
    const std::string_view size =
        key.starts_with(zero) ? std::string_view(key).substr(zero.size()) : std::string_view();
    bool filled = key == "train_batch_size" || key == "optimizer.params.betas" ||
                  key == "optimizer.params.eps" || key == "optimizer.params.weight_decay" ||
                  key.ends_with("16.enabled");  // fp16, bf16 or bfloat16: fill_precision below
    if (key == "train_micro_batch_size_per_gpu") {
      dc.batch.micro_batch_per_rank = t.micro_batch;
      filled = true;
    } else if (key == "gradient_accumulation_steps") {
      dc.batch.gradient_accumulation_steps = t.accum;
      filled = true;
    } else if (key == "gradient_clipping") {
      dc.engine.max_grad_norm = flag_max_grad_norm;
      filled = true;
    } else if (size == "reduce_bucket_size") {
      dc.reduce_bucket_size = hidden * hidden;
      filled = true;
    } else if (size == "stage3_prefetch_bucket_size" || size == "prefetch_bucket_size") {
      dc.engine.prefetch = std::size_t(hidden * hidden * 9 / 10);
      filled = true;
    } else if (size == "stage3_param_persistence_threshold" ||
               size == "param_persistence_threshold") {
      dc.engine.persist_threshold = std::size_t(10 * hidden);
      filled = true;
    } else if (key == "optimizer.params.lr") {
      std::visit([&](auto& opt) { opt.lr = t.lr; }, dc.optimizer);
      filled = true;
    } else if (!param.empty() && dc.scheduler) {
      std::visit(
          [&](auto& x) {
            if constexpr (requires { x.warmup_max_lr; }) {
              if (param == "warmup_min_lr") x.warmup_min_lr = 0.0, filled = true;
              if (param == "warmup_max_lr") x.warmup_max_lr = decimal(t.lr), filled = true;
            }
            if constexpr (requires { x.warmup_num_steps; })
              if (param == "warmup_num_steps")
                x.warmup_num_steps = from_flags.warmup_num_steps, filled = true;
            if constexpr (requires { x.total_num_steps; })
              if (param == "total_num_steps") x.total_num_steps = t.steps, filled = true;
          },
          *dc.scheduler);
    }
    if (!filled)
      throw zp::Error(zp::Errc::invalid_argument,
                      zp::detail::cat(dc.source, ": ", key, " is \"auto\", which ", program,
                                      " does not fill (it fills the micro-batch, accumulation, "
                                      "learning rate, warmup/total steps, clipping and precision "
                                      "from its flags and the ZeRO sizes from the model)"));
  }
  const bool auto_precision = zp::ds::fill_precision(dc, zp::ds::precision_of(t.dtype()));
  if (t.was_given("--precision") && !auto_precision)
    throw zp::Error(zp::Errc::invalid_argument,
                    zp::detail::cat(program, ": --precision with --config ", dc.source,
                                    ": the config sets the precision (fp16.enabled, bf16.enabled); "
                                    "write \"auto\" there to take it from --precision"));
  // The config's lr is the one used (the peak of the flags' schedule without a scheduler
  // section): a --lr given must agree (to an ulp: the two parse the decimal differently).
  const float lr = std::visit([](const auto& opt) { return opt.lr; }, dc.optimizer);
  if (t.was_given("--lr") && lr != t.lr && std::nextafter(lr, t.lr) != t.lr)
    throw zp::Error(
        zp::Errc::invalid_argument,
        zp::detail::cat(program, ": --lr ", t.lr, " with --config ", dc.source,
                        ": the config's optimizer lr is ", lr,
                        dc.optimizer_given ? "" : " (DeepSpeed's default: it has no optimizer)",
                        "; write \"lr\": \"auto\" there to take it from --lr"));
  // Without a scheduler section, the flags' schedule around the config's optimizer, as Hugging
  // Face's Trainer makes its scheduler around a config's optimizer (its peak set below).
  if (!dc.scheduler) dc.scheduler = flag_schedule(t);
  if (auto* cosine = std::get_if<zp::schedule::WarmupCosineLR>(&*dc.scheduler))
    std::visit([&](const auto& opt) { cosine->base_lr = decimal(opt.lr); }, dc.optimizer);
  std::visit([](const auto& x) { x.check(); }, *dc.scheduler);
}
#endif

// Calls f(std::type_identity<E>, EngineConfig, AdamW, schedule) for the engine --config describes
// (its "auto" keys filled from the flags and the model's width `hidden`, fill_auto; described on
// the lead rank),
// or else the one the flags do (flag_config on top of `buckets`), of the element types TypeList
// (a config asking for another is an error naming them). `dp`: the data-parallel ranks the
// config's batch triad spans.
template <zp::Backend B, class TypeList = zp::AllTypes, class F>
void with_engine(const Program& p, const TrainFlags& t, const RunFlags& r, int dp, bool lead,
                 std::uint64_t hidden, const zp::EngineConfig& buckets, F&& f) {
#if ZP_DEMO_IO
  if (!r.config.empty()) {
    zp::ds::Config dc = zp::ds::load(r.config);
    fill_auto(dc, t, hidden, p.name);
    if (lead) std::printf("%s: %s\n%s", p.name, r.config.c_str(), zp::ds::describe(dc).c_str());
    const zp::schedule::Any sched = *dc.scheduler;  // fill_auto's, if the config has none
    using Stages = zp::ds::Stages<0, 1, 2, 3>;
    using Optimizers = zp::ds::Optimizers<zp::optim::AdamW>;  // the demos'; a user lists theirs
    zp::ds::with_engine<B, TypeList, Stages, Optimizers>(
        dc, dp,
        [&]<class E>(std::type_identity<E> e, zp::EngineConfig ec, typename E::optimizer_type o) {
          ZP_EXPECT(ec.batch.micro_batch_per_rank <= max_micro_batch &&
                        ec.batch.gradient_accumulation_steps <= max_accum,
                    r.config, ": a micro-batch of ", ec.batch.micro_batch_per_rank, " x ",
                    ec.batch.gradient_accumulation_steps, " accumulation steps; ", p.name,
                    " takes at most ", max_micro_batch, " x ", max_accum,
                    " (as --micro-batch and --accum)");
          // A batch flag given must agree with the config's batch (as written or completed).
          for (const auto& [flag, key, value, want] :
               {std::tuple{"--micro-batch", "train_micro_batch_size_per_gpu",
                           ec.batch.micro_batch_per_rank, std::int64_t(t.micro_batch)},
                {"--accum", "gradient_accumulation_steps", ec.batch.gradient_accumulation_steps,
                 std::int64_t(t.accum)}})
            ZP_EXPECT(!t.was_given(flag) || value == want, p.name, ": ", flag, " ", want,
                      " with --config ", r.config, ": the config's ", key, " is ", value, " at ",
                      dp, " data-parallel ranks; write \"auto\" there to take it from ", flag);
          ec.wall_clock_breakdown = ec.wall_clock_breakdown || r.breakdown;
          ZP_EXPECT(!r.ranks_per_node || ec.quantized_gradients, p.name, ": --ranks-per-node ",
                    r.ranks_per_node, " with --config ", r.config,
                    ": the config does not set zero_optimization.zero_quantized_gradients, whose "
                    "two hops the nodes are");
          ec.ranks_per_node = r.ranks_per_node;      // the launcher's knowledge, not the config's
          ec.reshard_after_forward = !r.no_reshard;  // no ds_config key says it
          f(e, ec, o, sched);
        });
    return;
  }
#endif
  (void)dp, (void)hidden;
  if (lead && r.quantized_weights)
    std::printf(
        "%s: stage 3's parameter gathers quantized to int8, a scale per %zu values "
        "(ZeRO++ qwZ)\n",
        p.name, zp::zero_quantized_weights.block);
  if (lead && r.quantized_gradients)
    std::printf("%s: gradients reduced as int%d, a scale per %zu values, in %s (ZeRO++ qgZ)\n",
                p.name, int(zp::zero_quantized_gradients.bits), zp::zero_quantized_gradients.block,
                r.ranks_per_node ? "nodes of --ranks-per-node, then across them"
                                 : "the backend's nodes, then across them");
  if (lead && r.hpz > 1)
    std::printf("%s: secondary partition over %d data-parallel ranks a node (ZeRO++ hpZ)\n", p.name,
                r.hpz);
  if (lead && r.no_reshard)
    std::printf(
        "%s: modules kept gathered from forward to backward (no resharding after forward)\n",
        p.name);
  if (lead && r.shard_group > 0)
    std::printf(
        "%s: hybrid sharding: ZeRO over groups of %d data-parallel ranks, replicated "
        "across the groups\n",
        p.name, r.shard_group);
  zp::dispatch<TypeList>(
      t.dtype(), t.stage,
      [&]<class T, int Stage>(std::type_identity<T>, std::integral_constant<int, Stage>) {
        f(std::type_identity<zp::Engine<B, T, Stage>>{}, flag_config(t, r, buckets),
          zp::optim::AdamW{.lr = t.lr, .weight_decay = 0.01f}, flag_schedule(t));
      });
}

// One JSON line per step on rank 0 (--log-json): the step, the loss, the gradient norm (before
// clipping; null where it is not finite) and the step's phase times. Each line is written out
// at once; a write that fails (a full disk) is said on stderr and ends the log, not the run.
class JsonLog {
 public:
  JsonLog(const RunFlags& o, bool lead) : path_(o.log_json) {
    if (!lead || path_.empty()) return;
    // O_NONBLOCK: a FIFO that no process reads is an error now, not an open() that never returns
    // (nor ends on SIGTERM); writes block again after.
    const int fd =
        ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0644);
    const int fl = fd < 0 ? -1 : ::fcntl(fd, F_GETFL);
    if (fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0 || !(f_ = ::fdopen(fd, "a"))) {
      const int err = errno;
      if (fd >= 0) ::close(fd);
      struct stat st {};
      const bool fifo = ::stat(path_.c_str(), &st) == 0 && S_ISFIFO(st.st_mode);
      throw zp::Error(zp::Errc::io, "cannot open --log-json " + path_ + ": " + std::strerror(err) +
                                        (fifo ? " (a FIFO that no process reads)" : ""));
    }
  }
  ~JsonLog() {
    if (f_ && std::fclose(f_) != 0) failed(errno);
  }
  JsonLog(const JsonLog&) = delete;
  JsonLog& operator=(const JsonLog&) = delete;
  void line(int step, double loss, const zp::StepResult& r) {
    if (!f_) return;
    char norm[32] = "null";  // JSON has no inf or NaN (an fp16 step that overflowed)
    if (std::isfinite(r.grad_norm)) std::snprintf(norm, sizeof norm, "%.6g", r.grad_norm);
    if (std::fprintf(f_, "{\"step\":%d,\"loss\":%.6f,\"grad_norm\":%s,%s}\n", step, loss, norm,
                     r.times.json_fields().c_str()) < 0 ||
        std::fflush(f_) != 0) {
      const int err = errno;
      std::fclose(f_);
      f_ = nullptr;
      failed(err, step);
    }
  }

 private:
  void failed(int err, int step = 0) const {
    std::fprintf(stderr, "warning: --log-json %s: %s failed (%s)%s\n", path_.c_str(),
                 step ? "a write" : "closing it", std::strerror(err),
                 step ? ("; the log ends before step " + std::to_string(step)).c_str() : "");
  }

  std::string path_;
  std::FILE* f_ = nullptr;
};

#if ZP_DEMO_IO
// The checkpoint's user data: the steps done, then the vocabulary.
inline std::vector<std::byte> run_state(std::int64_t steps, const Corpus& c) {
  std::vector<std::byte> b(sizeof steps + c.chars.size());
  std::memcpy(b.data(), &steps, sizeof steps);
  std::memcpy(b.data() + sizeof steps, c.chars.data(), c.chars.size());
  return b;
}

// The vocabulary in run_state's bytes; empty in checkpoints of older zp_demo versions, which hold
// the step count alone.
inline std::string vocabulary_of(std::span<const std::byte> state) {
  if (state.size() <= sizeof(std::int64_t)) return {};
  return std::string(reinterpret_cast<const char*>(state.data()) + sizeof(std::int64_t),
                     state.size() - sizeof(std::int64_t));
}

#endif

// Without zp::io the helpers below do nothing: check_run_flags refused their flags.

// --resume: loads D/latest and returns the step to go on from; 0 (said on rank 0) when D has no
// checkpoint yet, so one command line serves a job's first start and every restart (and said
// where the checkpoint is at or past `steps`, --steps: nothing to train). A checkpoint of another
// vocabulary is an error naming both. Collective.
template <class E, class Comm>
int latest_step(E& engine, Comm& comm, const Program& p, const CheckpointFlags& o,
                const Corpus& corpus, int steps) {
  if (!o.resume) return 0;
#if ZP_DEMO_IO
  std::error_code ec;  // an error (EACCES, ESTALE) counts as not seeing it
  const std::filesystem::path dir = o.checkpoint_dir;
  // 2: `latest`. 1: checkpoints that no `latest` names (it was removed, or a tag copied in
  // alone): a start from step 0 would fail at its first save of one of their tags, after the
  // training; a crashed save's unnamed tag is not one (its note has the next save remove it).
  // 0: no checkpoint.
  const auto tags = zp::ckpt::checkpoint_tags(dir);
  const std::int64_t here =
      std::filesystem::exists(dir / "latest", ec) ? 2
      : !tags.empty() && !std::filesystem::exists(dir / zp::ckpt::DirectoryWriter::intent_name, ec)
          ? 1
          : 0;
  std::int64_t seen[2] = {here, -here};  // max: what any rank sees, and whether all see it
  all_reduce_host(comm, std::span<std::int64_t>(seen), zp::ReduceOp::max);
  if (seen[0] != -seen[1])  // a start from step 0 here would drop the checkpoint the others see
    throw zp::Error(zp::Errc::invalid_argument,
                    zp::detail::cat("--resume: ", o.checkpoint_dir,
                                    "/latest or its checkpoints are seen by some ranks and not by "
                                    "others (rank ",
                                    comm.rank(), ": ",
                                    here == 2 ? "latest"
                                    : here    ? "checkpoints"
                                              : "nothing",
                                    "); the checkpoint directory must be one file system that "
                                    "every rank sees"));
  if (here == 1)
    throw zp::Error(
        zp::Errc::invalid_argument,
        zp::detail::cat("--resume: ", o.checkpoint_dir, " holds checkpoints (", tags.front().second,
                        tags.size() > 1 ? ", ..." : "",
                        ") but no `latest` naming one: write the tag to resume from "
                        "into ",
                        (dir / "latest").string(), ", or move them away to start at step 0"));
  if (!here) {
    if (comm.rank() == 0)
      std::printf("%s: no checkpoint in %s yet: starting at step 0\n", p.name,
                  o.checkpoint_dir.c_str());
    return 0;
  }
  const std::string text_vocab(corpus.chars.begin(), corpus.chars.end());
  // Names the first token id whose character differs (the sizes may be equal).
  const auto vocab_error = [&](const std::string& saved_vocab) {
    const auto [a, b] =
        std::mismatch(saved_vocab.begin(), saved_vocab.end(), text_vocab.begin(), text_vocab.end());
    const auto shown = [](auto it, auto end) {
      if (it == end) return std::string("none");
      const auto c = static_cast<unsigned char>(*it);
      char buf[16];
      std::snprintf(buf, sizeof buf, c >= 0x20 && c < 0x7f ? "'%c'" : "byte 0x%02x", c);
      return std::string(buf);
    };
    return zp::Error(zp::Errc::invalid_argument,
                     zp::detail::cat("the checkpoint's vocabulary (", saved_vocab.size(),
                                     " characters) is not the training text's (", text_vocab.size(),
                                     " characters): token id ", a - saved_vocab.begin(), " is ",
                                     shown(a, saved_vocab.end()), " in the checkpoint and ",
                                     shown(b, text_vocab.end()),
                                     " in the text; resume with the --text files it was "
                                     "trained on"));
  };
  std::vector<std::byte> blob;
  try {
    blob = zp::load_checkpoint(engine, o.checkpoint_dir);
  } catch (const zp::Error&) {
    // Another vocabulary changes the embedding's shape, which the load reports first: name the
    // cause when the checkpoint's own user data says so.
    std::string saved_vocab;
    try {
      saved_vocab = vocabulary_of(zp::ckpt::Reader(o.checkpoint_dir).user_blob());
    } catch (const std::exception&) {
    }
    if (!saved_vocab.empty() && saved_vocab != text_vocab) throw vocab_error(saved_vocab);
    throw;
  }
  std::int64_t done = 0;
  ZP_EXPECT(blob.size() >= sizeof done, "the checkpoint's user data (", blob.size(),
            " bytes) is not a step count and a vocabulary");
  std::memcpy(&done, blob.data(), sizeof done);
  // (a step count no run reaches, or fewer steps than updates, is a corrupt file's, not a start)
  ZP_EXPECT(done >= engine.steps() && done <= std::numeric_limits<int>::max(), "the checkpoint ",
            o.checkpoint_dir, "/", zp::ckpt::Reader::read_latest(o.checkpoint_dir),
            " says its run did ", done, " steps, not a count in [", engine.steps(),
            " (the updates it applied), ", std::numeric_limits<int>::max(),
            "]: its user data is corrupt");
  const std::string saved_vocab = vocabulary_of(blob);
  if (!saved_vocab.empty() && saved_vocab != text_vocab) throw vocab_error(saved_vocab);
  if (comm.rank() == 0)
    std::printf("resumed from %s/%s at step %lld (%lld updates applied)\n",
                o.checkpoint_dir.c_str(), zp::ckpt::Reader::read_latest(o.checkpoint_dir).c_str(),
                static_cast<long long>(done), static_cast<long long>(engine.steps()));
  if (comm.rank() == 0 && done >= steps)
    std::printf("%s: the checkpoint is at step %lld, not before --steps %d: nothing to train\n",
                p.name, static_cast<long long>(done), steps);
  return int(done);
#else
  (void)engine, (void)comm, (void)p, (void)corpus, (void)steps;
  return 0;
#endif
}

// The tags a run from step `first` to `steps` saves (step<N> where --save-every divides N) must
// not exist yet: a checkpoint is never overwritten, and the save that met one failed only after
// the training up to it (a later checkpoint left when `latest` was set back to an earlier one;
// a new run in a used directory).
inline void expect_saves_free(const CheckpointFlags& o, int first, int steps) {
#if ZP_DEMO_IO
  if (!o.save_every) return;
  namespace fs = std::filesystem;
  const fs::path dir = o.checkpoint_dir;
  // A crashed save's tag that `latest` does not name is removed by the next save.
  std::string unnamed = zp::ckpt::DirectoryWriter::publishing(dir);
  std::error_code ec;
  try {
    if (fs::exists(fs::symlink_status(dir / "latest", ec)) &&
        zp::ckpt::Reader::read_latest(dir) == unnamed)
      unnamed.clear();
  } catch (const zp::Error&) {  // (a `latest` the save replaces)
  }
  for (fs::directory_iterator it(dir, ec), last; !ec && it != last; it.increment(ec)) {
    const std::string tag = it->path().filename().string();  // (any entry: a save needs the name)
    if (tag == unnamed) continue;
    int n = 0;
    const char* end = tag.data() + tag.size();
    const auto [at, parse] =
        std::from_chars(tag.data() + std::min<std::size_t>(4, tag.size()), end, n);
    if (tag.starts_with("step") && parse == std::errc() && at == end &&
        tag == "step" + std::to_string(n) && n > first && n <= steps && n % o.save_every == 0)
      throw zp::Error(
          zp::Errc::invalid_argument,
          zp::detail::cat("--checkpoint-dir ", o.checkpoint_dir, " already holds ", tag,
                          ", which this run would save at step ", n, " (it starts at step ", first,
                          "); a checkpoint is never overwritten: remove it, or "
                          "write its tag into latest and --resume"));
  }
#else
  (void)o, (void)first, (void)steps;
#endif
}

// latest_step, then expect_saves_free over the steps left. Collective.
template <class E, class Comm>
int resume(E& engine, Comm& comm, const Program& p, const CheckpointFlags& o, const Corpus& corpus,
           int steps) {
  const int first = latest_step(engine, comm, p, o, corpus, steps);
  zp::on_every_rank(comm, [&] { expect_saves_free(o, first, steps); });
  return first;
}

// Saves the checkpoint "step<N>" when --save-every divides the steps done; returns whether it
// did. Collective.
template <class E>
bool save_if_due(E& engine, const CheckpointFlags& o, int steps_done, const Corpus& c, bool lead) {
  if (!o.save_every || steps_done % o.save_every != 0) return false;
#if ZP_DEMO_IO
  const std::string tag = "step" + std::to_string(steps_done);
  zp::save_checkpoint(engine, o.checkpoint_dir, tag, run_state(steps_done, c),
                      {.keep_last = std::size_t(o.keep_checkpoints)});
  if (lead) std::printf("saved %s/%s\n", o.checkpoint_dir.c_str(), tag.c_str());
#else
  (void)engine, (void)c, (void)lead;
#endif
  return true;
}

// After step `steps_done`, on every rank: the checkpoint --save-every asks for, then whether a
// stop signal (common.hpp: stop_signal) reached any rank. The ranks agree on that in one
// all_reduce, so all of them stop after the same step; they save it (unless just saved; with
// --checkpoint-dir) and return true. Collective.
template <class E, class Comm>
bool end_step(E& engine, Comm& comm, const Program& p, const CheckpointFlags& o, int steps_done,
              const Corpus& c, bool lead) {
  const bool saved = save_if_due(engine, o, steps_done, c, lead);
  std::int64_t sig = stop_signal::received;
  all_reduce_host(comm, std::span<std::int64_t>(&sig, 1), zp::ReduceOp::max);
  if (!sig) return false;
  std::string said = "nothing saved (no --checkpoint-dir)";
  if (!o.checkpoint_dir.empty()) {
    const std::string tag = "step" + std::to_string(steps_done);
#if ZP_DEMO_IO
    if (!saved)
      zp::save_checkpoint(engine, o.checkpoint_dir, tag, run_state(steps_done, c),
                          {.keep_last = std::size_t(o.keep_checkpoints)});
#else
    (void)saved;
#endif
    said = "saved " + o.checkpoint_dir + "/" + tag;
    said += ": the same command line with --resume continues from it";
  }
  if (lead)
    std::printf("%s: %s: stopped after step %d; %s\n", p.name, stop_signal::name(int(sig)),
                steps_done, said.c_str());
  stop_signal::stopped_for = int(sig);
  return true;
}

// dir/vocab.json, {"byte_of_id": [...]} (the byte each token id stands for), beside the model
// just exported there: the corpus's, or none (c null: token ids, no vocabulary). An earlier
// export's would describe another model, so where this one is not written (none, or its write
// failed) it goes; one that cannot be removed is an error.
inline void write_vocab(const std::string& dir, const Corpus* c) {
#if ZP_DEMO_IO
  const std::filesystem::path path = std::filesystem::path(dir) / "vocab.json";
  std::error_code ec;
  if (!c) {
    std::filesystem::remove(path, ec);
    if (ec)
      throw zp::Error(zp::Errc::io, "cannot remove " + path.string() +
                                        ", an earlier export's vocabulary: " + ec.message());
    return;
  }
  std::string json = "{\"byte_of_id\": [";
  for (std::size_t i = 0; i < c->chars.size(); ++i)
    json += (i ? ", " : "") + std::to_string(int(static_cast<unsigned char>(c->chars[i])));
  json += "]}\n";
  try {
    zp::detail::write_file_atomic(path, std::as_bytes(std::span<const char>(json)));
  } catch (...) {
    std::filesystem::remove(path, ec);  // (the write's error is the one to report)
    throw;
  }
#else
  (void)dir, (void)c;
#endif
}

// --export: DIR/model.safetensors (zp's names) and DIR/vocab.json. Collective.
template <class E>
void export_model(E& engine, const CheckpointFlags& o, const Corpus& c, bool lead) {
  if (o.export_dir.empty()) return;
#if ZP_DEMO_IO
  zp::export_safetensors(engine, o.export_dir);
  if (lead) {
    write_vocab(o.export_dir, &c);
    std::printf("exported %s/model.safetensors and vocab.json\n", o.export_dir.c_str());
  }
#else
  (void)engine, (void)c, (void)lead;
#endif
}

}  // namespace examples
