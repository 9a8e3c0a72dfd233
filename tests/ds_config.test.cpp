#include "zp/ds_config.hpp"

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <typeindex>
#include <vector>

#include "zp/backend/threads.hpp"
#include "expect_error.hpp"
#include "random.hpp"
#include "temp_dir.hpp"
#include "zero_mlp.hpp"

using nlohmann::json;
using zp::Collective;
using zp::backend::run_threads;
using zp::backend::Threads;
using zp::ds::Config;
using zp::ds::Precision;
using zp::optim::AdamW;
using zp::optim::Sgd;
using zp::test::expect_invalid;

namespace {

// The three example configs of REFERENCE.md ("DeepSpeed's ds_config.json"), verbatim.
const char* const example1 =
    R"({ "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
  "fp16": { "enabled": true, "loss_scale": 0, "initial_scale_power": 16 },
  "zero_optimization": { "stage": 2, "allgather_partitions": true, "reduce_scatter": true,
                         "offload_optimizer": { "device": "cpu", "pin_memory": true },
                         "offload_param": { "device": "none" } },
  "optimizer": { "type": "AdamW", "params": { "lr": "auto", "betas": [0.9, 0.999], "eps": 1e-8 } },
  "scheduler": { "type": "WarmupLR", "params": { "warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto" } },
  "steps_per_print": 100, "wall_clock_breakdown": false })";

const char* const example2 =
    R"({ "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0,
  "bf16": { "enabled": true },
  "zero_optimization": { "stage": 3, "overlap_comm": true, "contiguous_gradients": true,
                         "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7,
                         "stage3_param_persistence_threshold": 1e5, "stage3_max_live_parameters": 1e9 },
  "optimizer": { "type": "AdamW", "params": { "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "scheduler": { "type": "WarmupCosineLR", "params": { "total_num_steps": 10000, "warmup_num_steps": 500 } },
  "data_types": { "grad_accum_dtype": "fp32" }, "steps_per_print": 50 })";

const char* const example3 =
    R"({ "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2,
  "zero_optimization": { "stage": 1 },
  "optimizer": { "type": "SGD", "params": { "lr": 0.1, "momentum": 0.9, "nesterov": true } },
  "scheduler": { "type": "WarmupDecayLR", "params": { "warmup_max_lr": 0.1, "warmup_num_steps": 100,
                                                      "total_num_steps": 2000, "warmup_type": "linear" } } })";

Config parse_text(const std::string& text) {
  return zp::ds::parse(std::string_view(text), "ds_config.json");
}

// ---- with_engine, compiled for 2 x 2 x 2 combinations ---------------------------------------
// Only two of them build and run an engine (each Engine instantiation costs seconds of compile
// time); the others are only named, which is enough to check the dispatch.

using TestTypes = zp::ds::Types<float, zp::bf16>;
using TestStages = zp::ds::Stages<1, 3>;
using TestOptimizers = zp::ds::Optimizers<AdamW, Sgd>;

struct Picked {
  std::type_index engine = typeid(void);
  int stage = -1;
  zp::DType dtype = zp::DType::i32;
  std::string optimizer;
  float lr = 0;
  zp::EngineConfig ec;
  bool ran = false;         // one of the two combinations that build an engine
  zp::BatchConfig batch{};  // the engine's, after construction
  std::size_t max_live = 0;
  std::int64_t steps = 0;
  float loss_scale = 0;
};

Picked dispatch(const Config& c, int world) {
  std::vector<Picked> out(static_cast<std::size_t>(world));
  run_threads(world, [&](Collective<Threads>& comm) {
    out[std::size_t(comm.rank())] =
        zp::ds::with_engine<Threads, TestTypes, TestStages, TestOptimizers>(
            c, comm.size(),
            [&]<class E>(std::type_identity<E>, zp::EngineConfig ec,
                         typename E::optimizer_type opt) -> Picked {
              using T = typename E::value_type;
              using O = typename E::optimizer_type;
              Picked p;
              p.engine = typeid(E);
              p.stage = E::stage;
              p.dtype = zp::dtype_of<T>;
              p.optimizer = zp::optim::detail::type_name(opt);
              p.lr = opt.lr;
              p.ec = ec;
              if constexpr ((E::stage == 3 && std::is_same_v<T, zp::bf16> &&
                             std::is_same_v<O, AdamW>) ||
                            (E::stage == 1 && std::is_same_v<T, float> && std::is_same_v<O, Sgd>)) {
                zp::test::Mlp<T> model;
                E engine(comm, model, ec, opt);
                const int mb = int(engine.batch().micro_batch_per_rank);
                for (std::int64_t i = 0; i < engine.batch().gradient_accumulation_steps; ++i)
                  zp::test::micro_step(engine, model, (i * comm.size() + comm.rank()) * mb, mb);
                p.ran = true;
                p.batch = engine.batch();
                p.max_live = engine.max_live_params();
                p.steps = engine.steps();
                p.loss_scale = engine.loss_scale();
              }
              return p;
            });
  });
  return out[0];
}

// ---- a Config as named fields, to see which ones a key changes ---------------------------------

using Fields = std::map<std::string, std::string>;

template <class X>
std::string str(const X& x) {
  return zp::detail::cat(x);
}

void add_schedule(const zp::schedule::Any& s, Fields& f) {
  namespace sc = zp::schedule;
  auto type = [](sc::Warmup w) { return w == sc::Warmup::log ? "log" : "linear"; };
  std::visit(
      [&](const auto& x) {
        using S = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<S, sc::WarmupLR> || std::is_same_v<S, sc::WarmupDecayLR>) {
          f["scheduler.type"] = std::is_same_v<S, sc::WarmupLR> ? "WarmupLR" : "WarmupDecayLR";
          f["scheduler.warmup_min_lr"] = str(x.warmup_min_lr);
          f["scheduler.warmup_max_lr"] = str(x.warmup_max_lr);
          f["scheduler.warmup_num_steps"] = str(x.warmup_num_steps);
          f["scheduler.warmup_type"] = type(x.warmup_type);
          if constexpr (std::is_same_v<S, sc::WarmupDecayLR>)
            f["scheduler.total_num_steps"] = str(x.total_num_steps);
        } else if constexpr (std::is_same_v<S, sc::WarmupCosineLR>) {
          f["scheduler.type"] = "WarmupCosineLR";
          f["scheduler.base_lr"] = str(x.base_lr);
          f["scheduler.total_num_steps"] = str(x.total_num_steps);
          f["scheduler.warmup_min_ratio"] = str(x.warmup_min_ratio);
          f["scheduler.warmup_num_steps"] = str(x.warmup_num_steps);
          f["scheduler.cos_min_ratio"] = str(x.cos_min_ratio);
          f["scheduler.warmup_type"] = type(x.warmup_type);
        } else if constexpr (std::is_same_v<S, sc::OneCycle>) {
          f["scheduler.type"] = "OneCycle";
          f["scheduler.cycle_min_lr"] = str(x.cycle_min_lr);
          f["scheduler.cycle_max_lr"] = str(x.cycle_max_lr);
          f["scheduler.decay_lr_rate"] = str(x.decay_lr_rate);
          f["scheduler.cycle_first_step_size"] = str(x.cycle_first_step_size);
          f["scheduler.cycle_second_step_size"] = str(x.cycle_second_step_size);
          f["scheduler.decay_step_size"] = str(x.decay_step_size);
          f["scheduler.cycle_momentum"] = str(x.cycle_momentum);
          f["scheduler.cycle_min_mom"] = str(x.cycle_min_mom);
          f["scheduler.cycle_max_mom"] = str(x.cycle_max_mom);
          f["scheduler.decay_mom_rate"] = str(x.decay_mom_rate);
        } else {
          f["scheduler.type"] = "Constant";
        }
      },
      s);
}

Fields fields(const Config& c) {
  Fields f;
  f["batch.train_batch_size"] = str(c.batch.train_batch_size);
  f["batch.micro_batch_per_rank"] = str(c.batch.micro_batch_per_rank);
  f["batch.gradient_accumulation_steps"] = str(c.batch.gradient_accumulation_steps);
  f["precision"] = str(int(c.precision));
  f["stage"] = str(c.stage);
  const zp::EngineConfig& e = c.engine;
  f["engine.max_grad_norm"] = str(e.max_grad_norm);
  f["engine.max_live_params"] = str(e.max_live_params);
  f["engine.persist_threshold"] = str(e.persist_threshold);
  f["engine.max_reuse_distance"] = str(e.max_reuse_distance);
  f["engine.prefetch"] = str(e.prefetch);
  f["engine.bucket_bytes"] = str(e.bucket_bytes);
  f["engine.first_bucket_bytes"] = str(e.first_bucket_bytes);
  f["engine.align"] = str(e.align);
  f["engine.bucket_slots"] = str(e.bucket_slots);
  f["engine.broadcast_initial_params"] = str(e.broadcast_initial_params);
  // The engine's loss scaler and the fp16 section's (kept for an "auto" fp16.enabled).
  for (const auto& [name, ls] :
       {std::pair{"scaler", &e.loss_scaler}, {"fp16_scaler", &c.fp16_scaler}}) {
    const std::string k = name;
    f[k + ".kind"] = str(int(ls->kind()));
    f[k + ".scale"] = str(ls->scale());
    f[k + ".initial_scale"] = str(ls->config().initial_scale);
    f[k + ".window"] = str(ls->config().window);
    f[k + ".hysteresis"] = str(ls->config().hysteresis);
    f[k + ".consecutive_hysteresis"] = str(ls->config().consecutive_hysteresis);
    f[k + ".min_scale"] = str(ls->config().min_scale);
  }
  f["reduce_bucket_size"] = str(c.reduce_bucket_size);
  f["offload.device"] = str(int(c.offload_optimizer.device));
  f["offload.pin_memory"] = str(c.offload_optimizer.pin_memory);
  f["offload.nvme_path"] = c.offload_optimizer.nvme_path;
  f["offload.buffer_count"] = str(c.offload_optimizer.buffer_count);
  f["offload.pipeline_read"] = str(c.offload_optimizer.pipeline_read);
  f["offload.pipeline_write"] = str(c.offload_optimizer.pipeline_write);
  f["offload_param.device"] = str(int(c.offload_param.device));
  f["offload_param.pin_memory"] = str(c.offload_param.pin_memory);
  f["offload_param.nvme_path"] = c.offload_param.nvme_path;
  f["offload_param.buffer_count"] = str(c.offload_param.buffer_count);
  f["sub_group_size"] = str(c.sub_group_size);
  f["zero_quantized_weights"] = str(c.zero_quantized_weights);
  f["zero_quantized_gradients"] = str(c.zero_quantized_gradients);
  f["engine.hpz_partition_size"] = str(c.engine.hpz_partition_size);
  f["mics_shard_size"] = str(c.mics_shard_size);
  f["aio.block_size"] = str(c.aio.block_size);
  f["aio.queue_depth"] = str(c.aio.queue_depth);
  std::visit(
      [&](const auto& o) {
        f["optimizer.type"] = zp::optim::detail::type_name(o);
        zp::optim::detail::for_each_field(
            o, [&](const char* name, auto x) { f[std::string("optimizer.") + name] = str(x); });
      },
      c.optimizer);
  f["optimizer_given"] = str(c.optimizer_given);
  if (c.scheduler) add_schedule(*c.scheduler, f);
  f["steps_per_print"] = str(c.steps_per_print);
  f["wall_clock_breakdown"] = str(c.wall_clock_breakdown);
  f["grad_accum_dtype"] = c.grad_accum_dtype ? zp::name(*c.grad_accum_dtype) : "null";
  f["communication_data_type"] =
      c.communication_data_type ? zp::name(*c.communication_data_type) : "null";
  f["tag_validation"] = str(int(c.tag_validation));
  std::string autos;
  for (const auto& k : c.auto_keys) autos += k + ";";
  f["auto_keys"] = autos;
  f["source"] = c.source;
  return f;
}

std::set<std::string> changed(const Fields& a, const Fields& b) {
  std::set<std::string> out;
  for (const auto& [k, v] : a)
    if (!b.count(k) || b.at(k) != v) out.insert(k);
  for (const auto& [k, v] : b)
    if (!a.count(k)) out.insert(k);
  return out;
}

std::string show(const std::set<std::string>& s) {
  std::string r = "{";
  for (const auto& x : s) r += (r.size() > 1 ? ", " : "") + x;
  return r + "}";
}

}  // namespace

TEST_CASE("the example configs of REFERENCE.md parse to the values they state") {
  SUBCASE("1: fp16, stage 2, offload_optimizer cpu, auto keys") {
    const Config c = parse_text(example1);
    CHECK(c.source == "ds_config.json");
    CHECK(c.batch.train_batch_size == 0);  // "auto": not given
    CHECK(c.batch.micro_batch_per_rank == 4);
    CHECK(c.batch.gradient_accumulation_steps == 4);
    CHECK(c.auto_keys == std::vector<std::string>{"train_batch_size", "optimizer.params.lr",
                                                  "scheduler.params.warmup_min_lr",
                                                  "scheduler.params.warmup_max_lr",
                                                  "scheduler.params.warmup_num_steps"});
    CHECK(c.is_auto("optimizer.params.lr"));
    CHECK(!c.is_auto("optimizer.params.eps"));
    CHECK(c.precision == Precision::fp16);
    CHECK(c.dtype() == zp::DType::f16);
    const zp::LossScaler& ls = c.engine.loss_scaler;
    CHECK(ls.kind() == zp::LossScaler::Kind::dynamic);
    CHECK(ls.scale() == 65536.0f);
    CHECK(ls.config().window == 1000);
    CHECK(ls.config().hysteresis == 2);
    CHECK(!ls.config().consecutive_hysteresis);
    CHECK(ls.config().min_scale == 1.0f);
    CHECK(c.stage == 2);
    CHECK(c.reduce_bucket_size == 500'000'000u);
    CHECK(c.offload_optimizer.device == zp::ds::OffloadDevice::cpu);
    CHECK(c.offload_optimizer.pin_memory);
    REQUIRE(std::holds_alternative<AdamW>(c.optimizer));
    const auto& o = std::get<AdamW>(c.optimizer);
    CHECK(o.lr == 1e-3f);  // "auto": DeepSpeed's default, for the program to fill
    CHECK(o.beta1 == 0.9f);
    CHECK(o.beta2 == 0.999f);
    CHECK(o.eps == 1e-8f);
    CHECK(o.weight_decay == 0.0f);  // DeepSpeed's default, not zp's 0.01
    REQUIRE(c.scheduler);
    const auto& s = std::get<zp::schedule::WarmupLR>(*c.scheduler);
    CHECK(s.warmup_min_lr == 0.0);
    CHECK(s.warmup_max_lr == 1e-3);
    CHECK(s.warmup_num_steps == 1000);
    CHECK(s.warmup_type == zp::schedule::Warmup::log);
    CHECK(c.steps_per_print == 100);
    CHECK(!c.wall_clock_breakdown);
    // offload_optimizer cpu is ZeRO-Offload; nvme the optimizer swap, with DeepSpeed's defaults.
    CHECK(zp::ds::describe(c).find("offload_optimizer: cpu") != std::string::npos);
    CHECK(zp::ds::engine_config<zp::fp16>(c, 2).offload_optimizer);
    json j = json::parse(example1);
    j["fp16"]["enabled"] = false;  // a precision the test's with_engine compiles in
    j["bf16"] = {{"enabled", true}};
    j["zero_optimization"]["stage"] = 3;
    j["optimizer"]["params"]["lr"] = 1e-3;
    CHECK(dispatch(zp::ds::parse(j, "ds_config.json"), 2).ec.offload_optimizer);
    CHECK(!dispatch(zp::ds::parse(j, "ds_config.json"), 2).ec.optimizer_nvme);
    j["zero_optimization"]["offload_optimizer"]["device"] = "nvme";
    expect_invalid(
        [&] { zp::ds::parse(j, "ds_config.json"); },
        {"ds_config.json: zero_optimization.offload_optimizer.nvme_path: ", "needs nvme_path"});
    zp::test::TempDir drive("ds-nvme");
    j["zero_optimization"]["offload_optimizer"]["nvme_path"] = drive.path.string();
    auto nvme =
        zp::ds::engine_config<zp::bf16>(zp::ds::parse(j, "ds_config.json"), 2).optimizer_nvme;
    REQUIRE(nvme);
    CHECK(nvme->path == drive.path);
    CHECK(nvme->buffer_count == 4);
    CHECK(!nvme->pipeline_read);
    CHECK(!nvme->pipeline_write);
    CHECK(nvme->sub_group_size == 1'000'000'000);
    CHECK(nvme->queue_depth == 8);
    CHECK(nvme->block_size == 1'048'576);
    j["zero_optimization"]["offload_optimizer"]["buffer_count"] = 5;
    j["zero_optimization"]["offload_optimizer"]["pipeline_read"] = true;
    j["zero_optimization"]["offload_optimizer"]["pipeline_write"] = true;
    j["zero_optimization"]["sub_group_size"] = 1e6;
    j["aio"] = {{"block_size", 262144}, {"queue_depth", 32}, {"thread_count", 1}};
    const Config cn = zp::ds::parse(j, "ds_config.json");
    CHECK(zp::ds::describe(cn).find(" buffer_count 5, pipeline_read 1, pipeline_write 1") !=
          std::string::npos);
#if defined(ZP_WITH_AIO)
    nvme = dispatch(cn, 2).ec.optimizer_nvme;  // and a step trained with it
#else
    expect_invalid([&] { dispatch(cn, 2); }, {"built without zp::aio"});
    nvme = zp::ds::engine_config<zp::bf16>(cn, 2).optimizer_nvme;
#endif
    REQUIRE(nvme);
    CHECK(nvme->buffer_count == 5);
    CHECK(nvme->pipeline_read);
    CHECK(nvme->pipeline_write);
    CHECK(nvme->sub_group_size == 1'000'000);
    CHECK(nvme->queue_depth == 32);
    CHECK(nvme->block_size == 262144);
    // offload_param to nvme: the parameters' swap, with the aio settings and pipelining
    j["zero_optimization"]["stage"] = 3;
    j["zero_optimization"]["offload_param"] = {
        {"device", "nvme"}, {"nvme_path", drive.path.string()}, {"buffer_count", 6}};
    const Config cp = zp::ds::parse(j, "ds_config.json");
    const zp::EngineConfig ep = zp::ds::engine_config<zp::bf16>(cp, 2);
    REQUIRE(ep.param_nvme);
    CHECK(ep.offload_param);
    CHECK(ep.param_nvme->path == drive.path);
    CHECK(ep.param_nvme->buffer_count == 6);
    CHECK(ep.param_nvme->queue_depth == 32);
    CHECK(ep.param_nvme->pipeline_write);
    CHECK(zp::ds::describe(cp).find("offload_param: nvme (nvme_path ") != std::string::npos);
#if defined(ZP_WITH_AIO)
    CHECK(dispatch(cp, 2).ran);  // stage 3, bf16: a step with both on NVMe
#endif
    // ZeRO++'s quantized weight gathers: int8 in blocks of 2048
    CHECK(!ep.quantized_weights);
    j["zero_optimization"]["zero_quantized_weights"] = true;
    const Config cq = zp::ds::parse(j, "ds_config.json");
    const zp::EngineConfig eq = zp::ds::engine_config<zp::bf16>(cq, 2);
    REQUIRE(eq.quantized_weights);
    CHECK(eq.quantized_weights->bits == zp::quant::Bits::int8);
    CHECK(eq.quantized_weights->block == 2048);
    CHECK(zp::ds::describe(cq).find("zero_quantized_weights 1") != std::string::npos);
    // ... and hpZ's secondary partition over 2 ranks a node
    CHECK(eq.hpz_partition_size == 1);
    j["zero_optimization"]["zero_hpz_partition_size"] = 2;
    const Config ch = zp::ds::parse(j, "ds_config.json");
    CHECK(zp::ds::engine_config<zp::bf16>(ch, 2).hpz_partition_size == 2);
    CHECK(zp::ds::describe(ch).find("zero_hpz_partition_size 2") != std::string::npos);
    // MiCS's shard groups: hybrid sharding over groups of 2 (-1, the default: none), which a
    // 4-rank step runs with
    CHECK(ch.mics_shard_size == -1);
    CHECK(zp::ds::engine_config<zp::bf16>(ch, 2).shard_group_size == 0);
    CHECK(zp::ds::describe(ch).find("mics_shard_size: -1\n") != std::string::npos);
    auto jm = j;
    jm["zero_optimization"]["mics_shard_size"] = 2;
    const Config cm = zp::ds::parse(jm, "ds_config.json");
    CHECK(zp::ds::engine_config<zp::bf16>(cm, 4).shard_group_size == 2);
    CHECK(zp::ds::describe(cm).find("mics_shard_size: 2 (ZeRO over groups of that many ranks") !=
          std::string::npos);
    const Picked pm = dispatch(cm, 4);
    CHECK(pm.ran);
    CHECK(pm.ec.shard_group_size == 2);
    // ... and qgZ: int8 in blocks of 512
    j["zero_optimization"]["zero_quantized_gradients"] = true;
    const zp::EngineConfig eg =
        zp::ds::engine_config<zp::bf16>(zp::ds::parse(j, "ds_config.json"), 2);
    REQUIRE(eg.quantized_gradients);
    CHECK(eg.quantized_gradients->bits == zp::quant::Bits::int8);
    CHECK(eg.quantized_gradients->block == 512);
#if defined(ZP_WITH_AIO)
    CHECK(dispatch(cq, 2).ran);  // quantized gathers of the pieces read from NVMe
#endif
  }
  SUBCASE("2: bf16, stage 3, WarmupCosineLR, grad_accum_dtype fp32") {
    const Config c = parse_text(example2);
    CHECK(c.batch.train_batch_size == 256);
    CHECK(c.batch.micro_batch_per_rank == 8);
    CHECK(c.batch.gradient_accumulation_steps == 0);
    CHECK(c.auto_keys.empty());
    CHECK(c.precision == Precision::bf16);
    CHECK(c.engine.loss_scaler.kind() == zp::LossScaler::Kind::none);
    CHECK(c.engine.max_grad_norm == 1.0f);
    CHECK(c.stage == 3);
    CHECK(c.reduce_bucket_size == 50'000'000u);
    CHECK(c.engine.prefetch == 50'000'000u);
    CHECK(c.engine.persist_threshold == 100'000u);
    CHECK(c.engine.max_live_params == 1'000'000'000u);
    const auto& o = std::get<AdamW>(c.optimizer);
    CHECK(o.lr == 3e-4f);
    CHECK(o.beta1 == 0.9f);
    CHECK(o.beta2 == 0.95f);
    CHECK(o.eps == 1e-8f);
    CHECK(o.weight_decay == 0.1f);
    const auto& s = std::get<zp::schedule::WarmupCosineLR>(*c.scheduler);
    CHECK(s.base_lr == double(3e-4f));  // the optimizer's lr
    CHECK(s.total_num_steps == 10000);
    CHECK(s.warmup_num_steps == 500);
    CHECK(s.warmup_min_ratio == 0.0);
    CHECK(s.cos_min_ratio == 1e-4);
    CHECK(s.warmup_type == zp::schedule::Warmup::log);
    CHECK(c.grad_accum_dtype == zp::DType::f32);
    CHECK(!c.communication_data_type);
    CHECK(c.steps_per_print == 50);
    // The engine config for 4 ranks: accumulation completed, bucket elements in bytes of bf16.
    const zp::EngineConfig ec = zp::ds::engine_config<zp::bf16>(c, 4);
    CHECK(ec.batch.gradient_accumulation_steps == 8);
    CHECK(ec.bucket_bytes == 100'000'000u);
    CHECK(zp::ds::engine_config<float>(c, 4).bucket_bytes == 200'000'000u);
    expect_invalid(
        [&] { zp::ds::engine_config<zp::bf16>(c, 3); },
        {"ds_config.json: "
         "train_batch_size/train_micro_batch_size_per_gpu/gradient_accumulation_steps at "
         "world size 3: ",
         "not a multiple"});
    // The fp32 accumulation asked for reaches the engine; fp16 accumulation of a bf16 model cannot.
    CHECK(ec.grad_accum_dtype == zp::DType::f32);
    CHECK(!ec.communication_dtype);
    json j = json::parse(example2);
    j["data_types"]["grad_accum_dtype"] = "fp16";
    expect_invalid(
        [&] { dispatch(zp::ds::parse(j, "ds_config.json"), 2); },
        {"ds_config.json: data_types.grad_accum_dtype: fp16 is not supported", "bf16 here"});
  }
  SUBCASE("3: fp32, stage 1, SGD with Nesterov, WarmupDecayLR") {
    const Config c = parse_text(example3);
    CHECK(c.batch.train_batch_size == 0);
    CHECK(c.batch.micro_batch_per_rank == 16);
    CHECK(c.batch.gradient_accumulation_steps == 2);
    CHECK(c.precision == Precision::fp32);
    CHECK(c.stage == 1);
    const auto& o = std::get<Sgd>(c.optimizer);
    CHECK(o.lr == 0.1f);
    CHECK(o.momentum == 0.9f);
    CHECK(o.dampening == 0.0f);
    CHECK(o.weight_decay == 0.0f);
    CHECK(o.nesterov);
    const auto& s = std::get<zp::schedule::WarmupDecayLR>(*c.scheduler);
    CHECK(s.warmup_min_lr == 0.0);
    CHECK(s.warmup_max_lr == 0.1);
    CHECK(s.warmup_num_steps == 100);
    CHECK(s.total_num_steps == 2000);
    CHECK(s.warmup_type == zp::schedule::Warmup::linear);
    CHECK(c.steps_per_print == 10);
    CHECK(c.tag_validation == zp::ds::TagValidation::warn);
    CHECK(zp::ds::engine_config<float>(c, 3).batch.train_batch_size == 96);
  }
}

TEST_CASE("without a section, DeepSpeed's defaults apply (not zp's struct defaults)") {
  const Config c = parse_text(R"({"train_batch_size": 8})");
  CHECK(c.precision == Precision::fp32);
  CHECK(c.stage == 0);
  CHECK(c.reduce_bucket_size == 500'000'000u);
  CHECK(c.engine.max_live_params == 1'000'000'000u);
  CHECK(c.engine.persist_threshold == 100'000u);
  CHECK(c.engine.max_reuse_distance == 1'000'000'000u);
  CHECK(c.engine.prefetch == 50'000'000u);
  CHECK(!c.optimizer_given);
  CHECK(std::get<AdamW>(c.optimizer).weight_decay == 0.0f);
  CHECK(!c.scheduler);
  CHECK(c.engine.max_grad_norm == 0.0f);
  CHECK(c.steps_per_print == 10);
  const auto lion = std::get<zp::optim::Lion>(
      parse_text(R"({"train_batch_size": 8, "optimizer": {"type": "lion"}})").optimizer);
  CHECK(lion.lr == 1e-3f);
  CHECK(lion.beta2 == 0.999f);  // DeepSpeed's, not the paper's 0.99
  const auto sgd = std::get<Sgd>(
      parse_text(R"({"train_batch_size": 8, "optimizer": {"type": "sgd"}})").optimizer);
  CHECK(sgd.lr == 1e-3f);  // torch.optim.SGD's
  const auto adam_l2 = parse_text(R"({"train_batch_size": 8,
      "optimizer": {"type": "Adam", "params": {"adam_w_mode": false, "weight_decay": 0.5}}})");
  CHECK(std::get<zp::optim::Adam>(adam_l2.optimizer).weight_decay == 0.5f);
  const auto one_cycle = parse_text(R"({"train_batch_size": 8,
      "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3}}})");
  const auto& oc = std::get<zp::schedule::OneCycle>(*one_cycle.scheduler);
  CHECK(oc.cycle_first_step_size == 2000);
  CHECK(oc.second() == 2000);
  CHECK(oc.cycle_momentum);
  CHECK(oc.cycle_min_mom == 0.8);
  CHECK(oc.cycle_max_mom == 0.9);
  // describe() names every setting on its own line.
  const std::string d = zp::ds::describe(c);
  for (std::string line :
       {"batch: train_batch_size 8", "precision: fp32", "zero: stage 0", "optimizer: AdamW(",
        "DeepSpeed's Adam defaults", "scheduler: none", "gradient_clipping: 0 (off)",
        "checkpoint: tag_validation Warn", "steps_per_print: 10"})
    CHECK_MESSAGE(d.find(line) != std::string::npos, "missing \"", line, "\" in\n", d);
  // A Constant schedule is a program's (no ds_config names it), and is described as set.
  Config constant = c;
  constant.scheduler = zp::schedule::Constant{.value = 0.0123};
  const std::string dc = zp::ds::describe(constant);
  for (std::string line : {"scheduler: Constant(value=0.0123)", "scheduler.type: \"Constant\"",
                           "scheduler.params.value: 0.0123"})
    CHECK_MESSAGE(dc.find(line) != std::string::npos, "missing \"", line, "\" in\n", dc);
}

TEST_CASE("each supported key changes exactly the field it maps to") {
  const json base = {{"train_micro_batch_size_per_gpu", 1}};
  struct Row {
    const char* context;  // merged into base for both configs
    const char* change;   // merged on top for the second
    std::set<std::string> fields;
  };
  const char* const fp16 = R"({"fp16": {"enabled": true}})";
  const char* const adamw = R"({"optimizer": {"type": "AdamW"}})";
  const char* const sgd = R"({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}})";
  const char* const lion = R"({"optimizer": {"type": "Lion"}})";
  const char* const warmup = R"({"scheduler": {"type": "WarmupLR"}})";
  const char* const decay =
      R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}})";
  const char* const cosine =
      R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}})";
  const char* const cycle =
      R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})";
  const Row rows[] = {
      {"{}", R"({"train_batch_size": 8})", {"batch.train_batch_size"}},
      {"{}", R"({"train_micro_batch_size_per_gpu": 2})", {"batch.micro_batch_per_rank"}},
      {"{}", R"({"gradient_accumulation_steps": 4})", {"batch.gradient_accumulation_steps"}},
      {"{}", R"({"train_batch_size": "auto"})", {"auto_keys"}},
      {"{}", R"({"gradient_accumulation_steps": "auto"})", {"auto_keys"}},
      {"{}", fp16, {"precision", "scaler.kind", "scaler.scale", "scaler.initial_scale"}},
      {"{}",
       R"({"fp16": {"enabled": false, "loss_scale": 8}})",
       {"fp16_scaler.kind", "fp16_scaler.scale", "fp16_scaler.initial_scale"}},
      {"{}", R"({"fp16": {"enabled": "auto"}})", {"auto_keys"}},
      {fp16,
       R"({"fp16": {"loss_scale": 128}})",
       {"scaler.kind", "scaler.scale", "scaler.initial_scale", "fp16_scaler.kind",
        "fp16_scaler.scale", "fp16_scaler.initial_scale"}},
      {fp16, R"({"fp16": {"loss_scale": 0}})", {}},
      {fp16,
       R"({"fp16": {"initial_scale_power": 8}})",
       {"scaler.scale", "scaler.initial_scale", "fp16_scaler.scale", "fp16_scaler.initial_scale"}},
      {fp16, R"({"fp16": {"loss_scale_window": 500}})", {"scaler.window", "fp16_scaler.window"}},
      {fp16, R"({"fp16": {"hysteresis": 4}})", {"scaler.hysteresis", "fp16_scaler.hysteresis"}},
      {fp16,
       R"({"fp16": {"consecutive_hysteresis": true}})",
       {"scaler.consecutive_hysteresis", "fp16_scaler.consecutive_hysteresis"}},
      {fp16, R"({"fp16": {"min_loss_scale": 2}})", {"scaler.min_scale", "fp16_scaler.min_scale"}},
      {fp16, R"({"fp16": {"auto_cast": false, "fp16_master_weights_and_grads": false}})", {}},
      {"{}", R"({"bf16": {"enabled": true}})", {"precision"}},
      {"{}", R"({"bfloat16": {"enabled": true}})", {"precision"}},
      {"{}", R"({"zero_optimization": {"stage": 3}})", {"stage"}},
      {"{}", R"({"zero_optimization": {"reduce_bucket_size": 1e6}})", {"reduce_bucket_size"}},
      {"{}", R"({"zero_optimization": {"stage3_prefetch_bucket_size": 0}})", {"engine.prefetch"}},
      {"{}", R"({"zero_optimization": {"prefetch_bucket_size": 123}})", {"engine.prefetch"}},
      {"{}",
       R"({"zero_optimization": {"stage3_param_persistence_threshold": 10}})",
       {"engine.persist_threshold"}},
      {"{}",
       R"({"zero_optimization": {"param_persistence_threshold": 10}})",
       {"engine.persist_threshold"}},
      {"{}",
       R"({"zero_optimization": {"stage3_max_live_parameters": 1e6}})",
       {"engine.max_live_params"}},
      {"{}", R"({"zero_optimization": {"max_live_parameters": 1e6}})", {"engine.max_live_params"}},
      {"{}",
       R"({"zero_optimization": {"stage3_max_reuse_distance": 0}})",
       {"engine.max_reuse_distance"}},
      {"{}",
       R"({"zero_optimization": {"max_reuse_distance": 5e8}})",
       {"engine.max_reuse_distance"}},
      {"{}",
       R"({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})",
       {"offload.device"}},
      {"{}",
       R"({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}}})",
       {"offload.device", "offload.nvme_path"}},
      {"{}",
       R"({"zero_optimization": {"offload_optimizer": {"pin_memory": true}}})",
       {"offload.pin_memory"}},
      {"{}",
       R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 8, "pipeline_read": true,
                 "pipeline_write": true}, "sub_group_size": 5e8}})",
       {"offload.buffer_count", "offload.pipeline_read", "offload.pipeline_write",
        "sub_group_size"}},
      {"{}",
       R"({"aio": {"block_size": 65536, "queue_depth": 16, "single_submit": false,
                 "overlap_events": true, "thread_count": 2}})",
       {"aio.block_size", "aio.queue_depth"}},
      {"{}",
       R"({"zero_optimization": {"offload_optimizer": null, "offload_param": {"device": "none"}}})",
       {}},
      // Accepted and ignored: how to communicate, not what.
      {"{}",
       R"({"zero_optimization": {"overlap_comm": false, "contiguous_gradients": false, "reduce_scatter": true,
                 "allgather_partitions": true, "round_robin_gradients": true, "allgather_bucket_size": 2e8,
                 "sub_group_size": 1e9,
                 "stage3_gather_16bit_weights_on_model_save": true}})",
       {}},
      // Hugging Face's template: how checkpoints are kept, none asked of zp.
      {"{}",
       R"({"activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false,
                 "contiguous_memory_optimization": false, "number_checkpoints": null,
                 "synchronize_checkpoint_boundary": false, "profile": false}})",
       {}},
      {"{}",
       R"({"memory_breakdown": true, "tensorboard": {"enabled": false, "output_path": "x"}, "amp": {"enabled": false},
                 "zero_allow_untested_optimizer": false, "gradient_predivide_factor": 1.0})",
       {}},
      {"{}", adamw, {"optimizer_given"}},
      {adamw, R"({"optimizer": {"type": "adam"}})", {}},  // DeepSpeed's Adam is AdamW
      {adamw,
       R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})",
       {"optimizer.type"}},
      {adamw, R"({"optimizer": {"params": {"lr": 0.01}}})", {"optimizer.lr"}},
      {adamw, R"({"optimizer": {"params": {"lr": "auto"}}})", {"auto_keys"}},
      {adamw,
       R"({"optimizer": {"params": {"betas": [0.8, 0.9]}}})",
       {"optimizer.beta1", "optimizer.beta2"}},
      {adamw, R"({"optimizer": {"params": {"eps": 1e-6}}})", {"optimizer.eps"}},
      {adamw, R"({"optimizer": {"params": {"weight_decay": 0.1}}})", {"optimizer.weight_decay"}},
      {adamw,
       R"({"optimizer": {"params": {"torch_adam": true, "amsgrad": false, "bias_correction": true}}})",
       {}},
      {sgd, R"({"optimizer": {"params": {"lr": 0.5}}})", {"optimizer.lr"}},
      {sgd, R"({"optimizer": {"params": {"momentum": 0.9}}})", {"optimizer.momentum"}},
      {sgd, R"({"optimizer": {"params": {"dampening": 0.1}}})", {"optimizer.dampening"}},
      {sgd, R"({"optimizer": {"params": {"weight_decay": 0.1}}})", {"optimizer.weight_decay"}},
      {sgd, R"({"optimizer": {"params": {"nesterov": true}}})", {"optimizer.nesterov"}},
      {lion, R"({"optimizer": {"params": {"lr": 1e-4}}})", {"optimizer.lr"}},
      {lion,
       R"({"optimizer": {"params": {"betas": [0.95, 0.98]}}})",
       {"optimizer.beta1", "optimizer.beta2"}},
      {lion, R"({"optimizer": {"params": {"weight_decay": 0.1}}})", {"optimizer.weight_decay"}},
      {warmup,
       R"({"scheduler": {"params": {"warmup_min_lr": 1e-5}}})",
       {"scheduler.warmup_min_lr"}},
      {warmup,
       R"({"scheduler": {"params": {"warmup_max_lr": 1e-2}}})",
       {"scheduler.warmup_max_lr"}},
      {warmup,
       R"({"scheduler": {"params": {"warmup_num_steps": 10}}})",
       {"scheduler.warmup_num_steps"}},
      {warmup,
       R"({"scheduler": {"params": {"warmup_type": "linear"}}})",
       {"scheduler.warmup_type"}},
      {warmup, R"({"scheduler": {"params": {"last_batch_iteration": -1}}})", {}},
      {decay,
       R"({"scheduler": {"params": {"total_num_steps": 6000}}})",
       {"scheduler.total_num_steps"}},
      {decay, R"({"scheduler": {"params": {"warmup_max_lr": 1e-2}}})", {"scheduler.warmup_max_lr"}},
      {decay, R"({"scheduler": {"params": {"warmup_min_lr": 1e-5}}})", {"scheduler.warmup_min_lr"}},
      {decay,
       R"({"scheduler": {"params": {"warmup_num_steps": 10}}})",
       {"scheduler.warmup_num_steps"}},
      {decay, R"({"scheduler": {"params": {"warmup_type": "linear"}}})", {"scheduler.warmup_type"}},
      {cosine,
       R"({"scheduler": {"params": {"total_num_steps": 6000}}})",
       {"scheduler.total_num_steps"}},
      {cosine,
       R"({"scheduler": {"params": {"warmup_min_ratio": 0.1}}})",
       {"scheduler.warmup_min_ratio"}},
      {cosine,
       R"({"scheduler": {"params": {"warmup_num_steps": 10}}})",
       {"scheduler.warmup_num_steps"}},
      {cosine,
       R"({"scheduler": {"params": {"cos_min_ratio": 0.01}}})",
       {"scheduler.cos_min_ratio"}},
      {cosine,
       R"({"scheduler": {"params": {"warmup_type": "linear"}}})",
       {"scheduler.warmup_type"}},
      {cosine,
       R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})",
       {"optimizer.lr", "optimizer_given", "scheduler.base_lr"}},
      {cycle, R"({"scheduler": {"params": {"cycle_min_lr": 1e-5}}})", {"scheduler.cycle_min_lr"}},
      {cycle, R"({"scheduler": {"params": {"cycle_max_lr": 1e-2}}})", {"scheduler.cycle_max_lr"}},
      {cycle, R"({"scheduler": {"params": {"decay_lr_rate": 0.1}}})", {"scheduler.decay_lr_rate"}},
      {cycle,
       R"({"scheduler": {"params": {"cycle_first_step_size": 100}}})",
       {"scheduler.cycle_first_step_size"}},
      {cycle,
       R"({"scheduler": {"params": {"cycle_second_step_size": 100}}})",
       {"scheduler.cycle_second_step_size"}},
      {cycle, R"({"scheduler": {"params": {"cycle_second_step_size": null}}})", {}},
      {cycle,
       R"({"scheduler": {"params": {"decay_step_size": 100}}})",
       {"scheduler.decay_step_size"}},
      {cycle,
       R"({"scheduler": {"params": {"cycle_momentum": false}}})",
       {"scheduler.cycle_momentum"}},
      {cycle, R"({"scheduler": {"params": {"cycle_min_mom": 0.7}}})", {"scheduler.cycle_min_mom"}},
      {cycle, R"({"scheduler": {"params": {"cycle_max_mom": 0.95}}})", {"scheduler.cycle_max_mom"}},
      {cycle,
       R"({"scheduler": {"params": {"decay_mom_rate": 0.1}}})",
       {"scheduler.decay_mom_rate"}},
      {"{}", R"({"gradient_clipping": 1.0})", {"engine.max_grad_norm"}},
      {"{}", R"({"gradient_clipping": "auto"})", {"auto_keys"}},
      {"{}", R"({"steps_per_print": 1})", {"steps_per_print"}},
      {"{}", R"({"wall_clock_breakdown": true})", {"wall_clock_breakdown"}},
      {"{}", R"({"communication_data_type": "bf16"})", {"communication_data_type"}},
      {"{}", R"({"communication_data_type": null})", {}},
      {"{}", R"({"data_types": {"grad_accum_dtype": "fp32"}})", {"grad_accum_dtype"}},
      {"{}", R"({"checkpoint": {"tag_validation": "Fail"}})", {"tag_validation"}},
      {"{}",
       R"({"checkpoint": {"tag_validation": "ignore", "load_universal": false, "use_node_local_storage": false}})",
       {"tag_validation"}},
  };
  for (const Row& row : rows) {
    const std::string context = row.context, change = row.change;
    CAPTURE(context);
    CAPTURE(change);
    json a = base;
    a.merge_patch(json::parse(row.context));
    json b = a;
    b.merge_patch(json::parse(row.change));
    const Fields fa = fields(zp::ds::parse(a, "ds_config.json"));
    const Fields fb = fields(zp::ds::parse(b, "ds_config.json"));
    // The text path gives the same result as the JSON path.
    CHECK(fields(parse_text(b.dump())) == fb);
    const std::set<std::string> got = changed(fa, fb);
    CHECK_MESSAGE(got == row.fields, "changed ", show(got), ", expected ", show(row.fields));
  }
}

TEST_CASE("malformed configs are errors naming the key path and what was expected") {
  struct Bad {
    const char* text;
    std::initializer_list<std::string> needles;
  };
  const Bad bad[] = {
      // misspelt keys, with the closest known key at that level
      {R"({"train_batch_size": 8, "zero_optimisation": {"stage": 2}})",
       {"ds_config.json: zero_optimisation: unknown key", "did you mean zero_optimization?"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stge": 1}})",
       {"ds_config.json: zero_optimization.stge: unknown key", "did you mean stage?"}},
      {R"({"train_batch_size": 8, "fp16": {"enable": true}})",
       {"fp16.enable: unknown key", "did you mean enabled?"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas1": [0.9, 0.99]}}})",
       {"optimizer.params.betas1: unknown key", "did you mean betas?"}},
      {R"({"train_batch_size": 8, "Train_Micro_Batch_Size_Per_GPU": 2})",
       {"Train_Micro_Batch_Size_Per_GPU: unknown key",
        "did you mean train_micro_batch_size_per_gpu?"}},
      {R"({"train_batch_size": 8, "something_else": 1})",
       {"something_else: unknown key", "zp reads train_batch_size"}},
      // wrong types
      {R"({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_parameters": "many"}})",
       {R"(ds_config.json: zero_optimization.stage3_max_live_parameters: expected a non-negative integer, got "many")"}},
      {R"({"train_batch_size": "8"})",
       {R"(train_batch_size: expected a positive integer or "auto", got "8")"}},
      {R"({"train_batch_size": 8, "wall_clock_breakdown": "yes"})",
       {R"(wall_clock_breakdown: expected true or false, got "yes")"}},
      {R"({"train_batch_size": 8, "fp16": true})", {"fp16: expected an object {...}, got true"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"overlap_comm": 1}})",
       {"zero_optimization.overlap_comm: expected true or false, got 1"}},
      {R"({"train_batch_size": 8, "steps_per_print": "auto"})",
       {R"(steps_per_print: expected a non-negative integer, got "auto")",
        "accepted only for the batch sizes"}},
      {R"([{"train_batch_size": 8}])",
       {"ds_config.json: expected a JSON object {...} at the top level"}},
      // numbers
      {R"({"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": 1.5}})",
       {"zero_optimization.reduce_bucket_size: expected a positive integer (elements), got 1.5 "
        "(not a whole number)"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage3_param_persistence_threshold": -1}})",
       {"zero_optimization.stage3_param_persistence_threshold: expected a non-negative integer, "
        "got -1"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_parameters": 1e30}})",
       {"zero_optimization.stage3_max_live_parameters: expected a non-negative integer, got "
        "1e+30"}},
      {R"({"train_batch_size": 0})",
       {R"(train_batch_size: expected a positive integer or "auto", got 0)"}},
      {R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4294967296, "gradient_accumulation_steps": 4294967296})",
       {"train_batch_size: train_micro_batch_size_per_gpu (4294967296) * "
        "gradient_accumulation_steps (4294967296) overflows a 64-bit integer"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 5}})",
       {"zero_optimization.stage: expected a ZeRO stage 0, 1, 2 or 3, got 5"}},
      {R"({"train_batch_size": 8, "gradient_clipping": 1e999})",
       {"ds_config.json: invalid JSON", "number overflow"}},
      {R"({"train_batch_size": 8, "gradient_clipping": NaN})",
       {"ds_config.json:1:46: invalid JSON"}},
      {R"({"train_batch_size": 8, "gradient_clipping": 1e39})",
       {"gradient_clipping: expected a finite number >= 0 that a 32-bit float holds", "got 1e+39"}},
      // precision
      {R"({"train_batch_size": 8, "fp16": {"enabled": true}, "bf16": {"enabled": true}})",
       {"ds_config.json: bf16.enabled: fp16 and bf16 are both enabled"}},
      {R"({"train_batch_size": 8, "bf16": {"enabled": false}, "bfloat16": {"enabled": true}})",
       {"bfloat16: both bf16 and its older name bfloat16 are given"}},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 4, "min_loss_scale": 32}})",
       {"fp16.min_loss_scale: must be <= the initial scale 2^initial_scale_power = 16, got 32"}},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true, "hysteresis": 0}})",
       {"fp16.hysteresis: expected a positive integer, got 0"}},
      // duplicates and syntax
      {R"({"train_batch_size": 8, "train_batch_size": 16})",
       {"ds_config.json: train_batch_size: duplicate key"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "overlap_comm": true, "stage": 2}})",
       {"ds_config.json: zero_optimization.stage: duplicate key"}},
      {"{\n  \"train_batch_size\": 8,\n}", {"ds_config.json:3:1: invalid JSON", "syntax error"}},
      {"{\"train_batch_size\": 8 // comment\n}", {"ds_config.json:1:24: invalid JSON"}},
      {"", {"ds_config.json:1:1: invalid JSON", "unexpected end of input"}},
      {R"({"train_batch_size": 8, "a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]})",
       {"nesting deeper than 32 levels"}},
      // the batch triad
      {R"({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2})",
       {"ds_config.json: train_batch_size: train_batch_size (30) must equal "
        "train_micro_batch_size_per_gpu (4) * "
        "gradient_accumulation_steps (2) * the world size",
        "not a multiple of 8"}},
      {R"({"gradient_accumulation_steps": 2})",
       {"train_batch_size: give train_batch_size or train_micro_batch_size_per_gpu"}},
      // zero_optimization
      {R"({"train_batch_size": 8, "zero_optimization": {"offload_param": {"device": "cpu"}}})",
       {"zero_optimization.offload_param.device: offloading the parameters needs stage 3, got "
        "stage 0"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
       {"zero_optimization.offload_param.nvme_path: offload_param to \"nvme\" needs nvme_path"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
       {R"(zero_optimization.offload_optimizer.device: expected "none", "cpu" or "nvme", got "gpu")"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"buffer_count": 1}}})",
       {"zero_optimization.offload_optimizer.buffer_count: expected an integer in [2, 64], got 1"}},
      {R"({"train_batch_size": 8, "aio": {"queue_depth": 0}})",
       {"aio.queue_depth: expected an integer in [1, 4096], got 0"}},
      {R"({"train_batch_size": 8, "aio": {"use_gds": true}})",
       {"aio.use_gds: known DeepSpeed key that zp does not support"}},
      {R"({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": true}})",
       {"activation_checkpointing.cpu_checkpointing: known DeepSpeed key that zp does not "
        "support"}},
      {R"({"train_batch_size": 8, "activation_checkpointing": {"number_checkpoints": -1}})",
       {"activation_checkpointing.number_checkpoints: expected"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage3_max_live_parameters": 1, "max_live_parameters": 2}})",
       {"zero_optimization.max_live_parameters: both stage3_max_live_parameters and its alias "
        "max_live_parameters"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 2, "zero_quantized_weights": true}})",
       {"zero_optimization.zero_quantized_weights: quantized weight gathers need stage 3, got "
        "stage 2"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "zero_hpz_partition_size": 4}})",
       {"zero_optimization.zero_hpz_partition_size: a secondary partition needs stage 3, got "
        "stage 1"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": 0}})",
       {"zero_optimization.mics_shard_size: expected -1 (off) or a positive integer (ranks per "
        "shard group), got 0"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "mics_shard_size": -2}})",
       {"zero_optimization.mics_shard_size: expected -1 (off) or a positive integer (ranks per "
        "shard group), got -2"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"mics_shard_size": 2}})",
       {"zero_optimization.mics_shard_size: hybrid sharding needs stage 1, 2 or 3, got stage 0"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}})",
       {"zero_optimization.zero_hpz_partition_size: expected a positive integer (ranks per node)"}},
      {R"({"train_batch_size": 8, "zero_optimization": {"stage": 1, "zero_quantized_gradients": true}})",
       {"zero_optimization.zero_quantized_gradients: quantized gradients need stage 2 or 3, got "
        "stage 1"}},
      // known DeepSpeed keys zp does not do
      {R"({"train_batch_size": 8, "amp": {"enabled": true}})",
       {"amp: known DeepSpeed key that zp does not support"}},
      {R"({"train_batch_size": 8, "zero_allow_untested_optimizer": true})",
       {"zero_allow_untested_optimizer: known DeepSpeed key that zp does not support (accepted "
        "only as false)"}},
      {R"({"train_batch_size": 8, "checkpoint": {"load_universal": true}})",
       {"checkpoint.load_universal: known DeepSpeed key that zp does not support (accepted only as "
        "false)"}},
      {R"({"train_batch_size": 8, "checkpoint": {"tag_validation": "Maybe"}})",
       {R"(checkpoint.tag_validation: expected "Warn", "Ignore" or "Fail", got "Maybe")"}},
      {R"({"train_batch_size": 8, "communication_data_type": "fp8"})",
       {R"(communication_data_type: expected null, "fp32", "fp16" or "bf16", got "fp8")"}},
      // optimizer
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamWW"}})",
       {R"(optimizer.type: unknown optimizer "AdamWW"; did you mean AdamW?)"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "Lamb"}})",
       {R"(optimizer.type: "Lamb" is known to DeepSpeed, not supported by zp)"}},
      {R"({"train_batch_size": 8, "optimizer": {"params": {"lr": 0.1}}})",
       {"optimizer.type: required"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}})",
       {"optimizer.params.max_grad_norm: max_grad_norm is not an optimizer parameter",
        "gradient_clipping"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})",
       {"optimizer.params.betas: expected an array of two numbers [beta1, beta2], got [0.9]"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}})",
       {"optimizer.params.betas[1]: expected a number in [0, 1), got 1.0"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})",
       {"optimizer.params.adam_w_mode: AdamW always decouples weight decay"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"nesterov": true}}})",
       {"ds_config.json: optimizer.params: Sgd: Nesterov momentum requires a momentum"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": -0.1}}})",
       {"optimizer.params.lr: expected a finite number >= 0, got -0.1"}},
      // scheduler
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}})",
       {R"(scheduler.params.warmup_type: expected "log" or "linear", got "cosine")"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLRR"}})",
       {R"(scheduler.type: unknown scheduler "WarmupLRR"; did you mean WarmupLR?)"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "LRRangeTest"}})",
       {R"(scheduler.type: "LRRangeTest" is known to DeepSpeed, not supported by zp)"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}})",
       {"scheduler.params.total_num_steps: required by WarmupDecayLR"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10,
          "warmup_num_steps": 100}}})",
       {"ds_config.json: scheduler.params: schedule: WarmupDecayLR: total_num_steps (10) must be "
        ">= warmup_num_steps (100)"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}})",
       {"scheduler.params.cycle_max_lr: required by OneCycle"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 100}}})",
       {"scheduler.params.last_batch_iteration: known DeepSpeed key that zp does not support "
        "(accepted only as -1)"}},
      // values zp would ignore, or could not represent (a float that rounds to 0 or overflows)
      {R"({"train_batch_size": 8, "zero_optimization": {"offload_optimizer": {"device": "cpu", "ratio": 0.5}}})",
       {"zero_optimization.offload_optimizer.ratio: known DeepSpeed key that zp does not support "
        "(accepted only as 1), got 0.5"}},
      {R"({"train_batch_size": 8, "gradient_clipping": 1e-50})",
       {"gradient_clipping: expected a finite number >= 0 that a 32-bit float holds", "got 1e-50"}},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": 1e-46}})",
       {"fp16.loss_scale: expected a finite number >= 0 that a 32-bit float holds", "got 1e-46"}},
      {R"({"train_batch_size": 8, "fp16": {"enabled": true, "min_loss_scale": 1e-46}})",
       {"fp16.min_loss_scale", "got 1e-46"}},
      {R"({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"eps": 1e-60}}})",
       {"optimizer.params.eps", "got 1e-60"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-50}}})",
       {"scheduler.params.warmup_max_lr", "got 1e-50"}},
      {R"({"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e39}}})",
       {"scheduler.params.cycle_max_lr", "got 1e+39"}},
  };
  CHECK(std::size(bad) >= 25);
  for (const Bad& b : bad) {
    const std::string text = b.text;
    CAPTURE(text);
    expect_invalid([&] { parse_text(b.text); }, b.needles);
  }
}

TEST_CASE("\"auto\" is a placeholder the program fills: recorded, defaulted, not cross-checked") {
  // Hugging Face style: the Trainer fills these from its own arguments.
  const Config c =
      parse_text(R"({"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
      "optimizer": {"type": "SGD", "params": {"lr": "auto", "momentum": "auto", "nesterov": true}},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 20000}}})");
  CHECK(c.auto_keys == std::vector<std::string>{"train_batch_size",
                                                "train_micro_batch_size_per_gpu",
                                                "optimizer.params.lr", "optimizer.params.momentum",
                                                "scheduler.params.total_num_steps"});
  CHECK(std::get<Sgd>(c.optimizer).lr == 1e-3f);
  CHECK(std::get<zp::schedule::WarmupDecayLR>(*c.scheduler).total_num_steps == 10000);
  CHECK(zp::ds::describe(c).find("\"auto\" (for the program to fill): train_batch_size, ") !=
        std::string::npos);
  // Unfilled batch keys are an error once the world size is known.
  expect_invalid([&] { zp::ds::engine_config<float>(c, 2); },
                 {"at world size 2", "give train_batch_size or micro_batch_per_rank"});
  // The program fills them; the filled config dispatches.
  Config filled = c;
  filled.batch.micro_batch_per_rank = 2;
  std::get<Sgd>(filled.optimizer).momentum = 0.9f;
  CHECK(zp::ds::engine_config<float>(filled, 2).batch.train_batch_size == 4);
  // "auto" stays an error where the program has no say.
  expect_invalid(
      [&] { parse_text(R"({"train_batch_size": 8, "zero_optimization": {"stage": "auto"}})"); },
      {R"(zero_optimization.stage: expected a ZeRO stage 0, 1, 2 or 3, got "auto")",
       "accepted only for the batch sizes"});
  expect_invalid(
      [&] { parse_text(R"({"train_batch_size": 8, "fp16": {"loss_scale_window": "auto"}})"); },
      {R"(fp16.loss_scale_window: expected a positive integer, got "auto")",
       "accepted only for the batch sizes"});
}

TEST_CASE(
    "Hugging Face's other \"auto\" keys: clipping and the ZeRO sizes keep DeepSpeed's "
    "defaults, the precision is fp32 until fill_precision") {
  // Hugging Face's ZeRO-3 example, with a dynamic scale of its own.
  const Config c = parse_text(R"({"fp16": {"enabled": "auto", "loss_scale": 0,
      "loss_scale_window": 500, "initial_scale_power": 12, "hysteresis": 3, "min_loss_scale": 2},
      "bf16": {"enabled": "auto"}, "gradient_clipping": "auto", "train_batch_size": "auto",
      "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"}})");
  for (const char* k :
       {"fp16.enabled", "bf16.enabled", "gradient_clipping", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold"})
    CHECK_MESSAGE(c.is_auto(k), k);
  CHECK(c.auto_keys.size() == 9);
  CHECK(c.engine.max_grad_norm == 0.0f);
  CHECK(c.reduce_bucket_size == 500'000'000u);
  CHECK(c.engine.prefetch == 50'000'000u);
  CHECK(c.engine.persist_threshold == 100'000u);
  CHECK(c.precision == Precision::fp32);
  CHECK(c.engine.loss_scaler.kind() == zp::LossScaler::Kind::none);
  const std::string described = zp::ds::describe(c);
  CHECK(described.find("  precision: fp32\n") != std::string::npos);
  CHECK(described.find("    fp16.loss_scale_window: 500 (unused: fp16 is off)\n") !=
        std::string::npos);
  // The fp16 section's scaler is kept for the program's fill.
  const zp::LossScaler& kept = c.fp16_scaler;
  REQUIRE(kept.kind() == zp::LossScaler::Kind::dynamic);
  CHECK(kept.scale() == 4096.0f);
  CHECK(kept.config().window == 500);
  CHECK(kept.config().hysteresis == 3);
  CHECK(kept.config().min_scale == 2.0f);

  Config fp16 = c;
  CHECK(zp::ds::fill_precision(fp16, Precision::fp16));
  CHECK(fp16.precision == Precision::fp16);
  CHECK(fp16.dtype() == zp::DType::f16);
  REQUIRE(fp16.engine.loss_scaler.kind() == zp::LossScaler::Kind::dynamic);
  CHECK(fp16.engine.loss_scaler.scale() == 4096.0f);
  CHECK(fp16.engine.loss_scaler.config().window == 500);
  CHECK(zp::ds::engine_config<zp::fp16>(
            [&] {
              Config b = fp16;
              b.batch.micro_batch_per_rank = 1;
              return b;
            }(),
            2)
            .loss_scaler.config()
            .hysteresis == 3);
  for (const Precision p : {Precision::bf16, Precision::fp32}) {
    Config x = fp16;  // filled again: the "auto" keys still decide
    zp::ds::fill_precision(x, p);
    CHECK(x.precision == p);
    CHECK(x.engine.loss_scaler.kind() == zp::LossScaler::Kind::none);
  }
  // A key written true or false (or not given) must agree with the program's precision, as
  // Hugging Face's Trainer checks it.
  const Config written = parse_text(R"({"train_batch_size": 8, "fp16": {"enabled": true},
      "bfloat16": {"enabled": "auto"}})");
  CHECK(written.is_auto("bfloat16.enabled"));
  Config agreed = written;
  zp::ds::fill_precision(agreed, Precision::fp16);
  CHECK(agreed.precision == Precision::fp16);
  CHECK(agreed.engine.loss_scaler.scale() == 65536.0f);
  for (const Precision p : {Precision::bf16, Precision::fp32}) {
    Config x = written;
    expect_invalid([&] { zp::ds::fill_precision(x, p); },
                   {"ds_config.json: fp16.enabled: is true, which the program's precision ",
                    "(filling the \"auto\" one) contradicts: write \"auto\" there too, or false"});
  }
  Config absent = parse_text(R"({"train_batch_size": 8, "fp16": {"enabled": "auto"}})");
  expect_invalid([&] { zp::ds::fill_precision(absent, Precision::bf16); },
                 {"bf16.enabled: is false (or not given), which the program's precision bf16"});
  zp::ds::fill_precision(absent, Precision::fp32);
  CHECK(absent.precision == Precision::fp32);
  Config bf16 = parse_text(R"({"train_batch_size": 8, "bf16": {"enabled": true}})");
  CHECK(!zp::ds::fill_precision(bf16, Precision::fp16));  // nothing "auto": as written
  CHECK(bf16.precision == Precision::bf16);
  CHECK(bf16.engine.loss_scaler.kind() == zp::LossScaler::Kind::none);
}

TEST_CASE("NaN and infinity in a JSON value built by the program are errors too") {
  json j = json::parse(example3);
  j["gradient_clipping"] = std::nan("");
  expect_invalid([&] { zp::ds::parse(j, "cfg"); },
                 {"cfg: gradient_clipping: expected a finite number >= 0, got nan"});
  j = json::parse(example3);
  j["zero_optimization"]["reduce_bucket_size"] = INFINITY;
  expect_invalid([&] { zp::ds::parse(j); }, {"ds_config: zero_optimization.reduce_bucket_size: "
                                             "expected a positive integer (elements), got inf"});
  j = json::parse(example3);
  j["optimizer"]["params"]["lr"] = -INFINITY;
  expect_invalid([&] { zp::ds::parse(j); },
                 {"optimizer.params.lr: expected a finite number >= 0, got -inf"});
}

TEST_CASE("load reads a file and names it in errors; a missing file is an I/O error") {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("zp_ds_config_test_" + std::to_string(zp::test::fresh_seed()));
  std::filesystem::create_directories(dir);
  const auto good = dir / "ds_config.json", bad = dir / "bad.json";
  std::ofstream(good) << example3;
  std::ofstream(bad) << R"({"train_batch_size": 8, "zero_optimization": {"stage": "two"}})";
  const Config c = zp::ds::load(good);
  CHECK(c.source == good.string());
  CHECK(c.stage == 1);
  expect_invalid([&] { zp::ds::load(bad); },
                 {bad.string() +
                  ": zero_optimization.stage: expected a ZeRO stage 0, 1, 2 or 3, got \"two\""});
  try {
    zp::ds::load(dir / "absent.json");
    FAIL_CHECK("no error for a missing file");
  } catch (const zp::Error& e) {
    CHECK(e.category() == zp::Errc::io);
    CHECK(std::string(e.what()).find("absent.json") != std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("with_engine builds the engine type the config selects, with the config's settings") {
  SUBCASE("example 2 without grad_accum_dtype: stage 3, bf16, AdamW") {
    json j = json::parse(example2);
    j.erase("data_types");
    j["zero_optimization"]["stage3_max_live_parameters"] = 5000;
    j["zero_optimization"]["stage3_param_persistence_threshold"] = 0;
    j["train_batch_size"] = 4;
    j["train_micro_batch_size_per_gpu"] = 2;
    const Config c = zp::ds::parse(j, "ds_config.json");
    const Picked p = dispatch(c, 2);
    CHECK(p.engine == std::type_index(typeid(zp::Engine<Threads, zp::bf16, 3, AdamW>)));
    CHECK(p.stage == 3);
    CHECK(p.dtype == zp::DType::bf16);
    CHECK(p.optimizer == "AdamW");
    CHECK(p.lr == 3e-4f);
    CHECK(p.ec.batch.gradient_accumulation_steps == 1);
    CHECK(p.ec.bucket_bytes == 100'000'000u);  // 5e7 elements of bf16
    CHECK(p.ec.max_live_params == 5000u);
    CHECK(p.ec.persist_threshold == 0u);
    CHECK(p.ec.max_reuse_distance == 1'000'000'000u);  // DeepSpeed's default: every module kept
    CHECK(p.ec.prefetch == 50'000'000u);
    CHECK(p.ec.max_grad_norm == 1.0f);
    CHECK(p.ec.loss_scaler.kind() == zp::LossScaler::Kind::none);
    REQUIRE(p.ran);
    CHECK(p.batch.micro_batch_per_rank == 2);
    CHECK(p.max_live == 5000u);
    CHECK(p.steps == 1);
  }
  SUBCASE("example 3: stage 1, fp32, SGD") {
    const Config c = parse_text(example3);
    const Picked p = dispatch(c, 2);
    CHECK(p.engine == std::type_index(typeid(zp::Engine<Threads, float, 1, Sgd>)));
    CHECK(p.dtype == zp::DType::f32);
    CHECK(p.optimizer == "Sgd");
    CHECK(p.lr == 0.1f);
    CHECK(p.ec.batch.train_batch_size == 64);
    CHECK(p.ec.bucket_bytes == 2'000'000'000u);  // DeepSpeed's 5e8 elements of float
    REQUIRE(p.ran);
    CHECK(p.batch.gradient_accumulation_steps == 2);
    CHECK(p.steps == 1);
  }
  SUBCASE("the other compiled-in combinations are picked without building an engine") {
    json j = json::parse(example3);
    j["bf16"] = {{"enabled", true}};
    j["optimizer"] = {{"type", "AdamW"}, {"params", {{"lr", 0.25}}}};
    Picked p = dispatch(zp::ds::parse(j), 2);
    CHECK(p.engine == std::type_index(typeid(zp::Engine<Threads, zp::bf16, 1, AdamW>)));
    CHECK(p.lr == 0.25f);
    CHECK(!p.ran);
    j["zero_optimization"]["stage"] = 3;
    j.erase("bf16");
    j["optimizer"] = {{"type", "SGD"}};
    p = dispatch(zp::ds::parse(j), 2);
    CHECK(p.engine == std::type_index(typeid(zp::Engine<Threads, float, 3, Sgd>)));
    CHECK(!p.ran);
  }
  SUBCASE("a combination not compiled in is an error naming it and what was compiled") {
    json j = json::parse(example3);
    j["zero_optimization"]["stage"] = 2;
    expect_invalid([&] { dispatch(zp::ds::parse(j), 2); },
                   {"ds_config: zero_optimization.stage: config asks for stage 2, this program was "
                    "built with stages {1, 3}"});
    j = json::parse(example3);
    j["fp16"] = {{"enabled", true}};
    expect_invalid([&] { dispatch(zp::ds::parse(j), 2); },
                   {"fp16.enabled: config asks for precision fp16, this program was built with "
                    "element types {fp32, bf16}"});
    j = json::parse(example3);
    j["optimizer"] = {{"type", "Lion"}};
    expect_invalid([&] { dispatch(zp::ds::parse(j), 2); },
                   {"optimizer.type: config asks for optimizer Lion, this program was built with "
                    "optimizers {AdamW, Sgd}"});
    j = json::parse(example3);
    j["communication_data_type"] = "bf16";
    expect_invalid([&] { dispatch(zp::ds::parse(j), 2); },
                   {"communication_data_type: bf16 is not supported", "fp32 here"});
    j = json::parse(example3);
    j["train_batch_size"] = 96;  // fits 3 ranks (16 * 2 * 3), not 2
    expect_invalid(
        [&] { dispatch(zp::ds::parse(j), 2); },
        {"at world size 2: ",
         "train_batch_size must equal micro_batch_per_rank * gradient_accumulation_steps * ranks"});
  }
}

TEST_CASE("random mutations of the example configs parse or throw zp::Error, never anything else") {
  const std::uint64_t seed = zp::test::fresh_seed();
  std::printf("ds_config fuzz: seed %llu (ZP_TEST_SEED=%llu repeats this run)\n",
              (unsigned long long)seed, (unsigned long long)seed);
  std::mt19937_64 rng(seed);
  auto below = [&](std::size_t n) { return n ? std::size_t(rng() % n) : 0; };
  const std::string seeds[] = {example1, example2, example3};
  const char* const tokens[] = {"\"auto\"",
                                "1.5",
                                "-1",
                                "0",
                                "1e999",
                                "1e308",
                                "null",
                                "true",
                                "false",
                                "[",
                                "]",
                                "{",
                                "}",
                                ",",
                                ":",
                                "\"stage\": 3,",
                                "9223372036854775808",
                                "-0",
                                "1e-400",
                                "\"\\u0000\"",
                                "\"\\ud800\"",
                                "\"fp16\": {\"enabled\": true},",
                                "[0.9, 0.999]",
                                "\"\xff\"",
                                "{}",
                                "\"enabled\": true",
                                "\"zero_optimization\": {},"};
  const char bytes[] = "{}[]\",:0123456789.eE+-tfnaul \\\n";
  std::size_t ok = 0, rejected = 0, not_json = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 3000; ++i) {
    std::string s = seeds[below(3)];
    const int edits = 1 + int(below(2));
    for (int e = 0; e < edits && !s.empty(); ++e) {
      // Half the edits keep the text JSON-shaped (swaps, number and token replacements), so the
      // checks behind the JSON parser get exercised too.
      switch (below(12)) {
        case 0: s[below(s.size())] = bytes[below(sizeof bytes - 1)]; break;
        case 1: s[below(s.size())] = char(rng() & 0xff); break;
        case 2: s.erase(below(s.size()), 1 + below(8)); break;
        case 3: s.insert(below(s.size() + 1), tokens[below(std::size(tokens))]); break;
        case 4: s.resize(below(s.size())); break;
        case 5: {  // swap two quoted strings (keys or values)
          std::vector<std::pair<std::size_t, std::size_t>> q;
          for (std::size_t p = s.find('"'); p != std::string::npos;) {
            const std::size_t end = s.find('"', p + 1);
            if (end == std::string::npos) break;
            q.emplace_back(p, end + 1 - p);
            p = s.find('"', end + 1);
          }
          if (q.size() < 2) break;
          auto a = q[below(q.size())], b = q[below(q.size())];
          if (a.first > b.first) std::swap(a, b);
          if (a.first == b.first) break;
          const std::string sa = s.substr(a.first, a.second), sb = s.substr(b.first, b.second);
          s.replace(b.first, b.second, sa);
          s.replace(a.first, a.second, sb);
          break;
        }
        case 6:
        case 7:
        case 8: {  // replace a number with another
          std::vector<std::size_t> nums;
          for (std::size_t p = 0; p < s.size(); ++p)
            if ((s[p] >= '0' && s[p] <= '9') &&
                (p == 0 || s[p - 1] == ' ' || s[p - 1] == ':' || s[p - 1] == '['))
              nums.push_back(p);
          if (nums.empty()) break;
          const std::size_t p = nums[below(nums.size())];
          std::size_t end = p;
          while (end < s.size() &&
                 std::string_view("0123456789.eE+-").find(s[end]) != std::string_view::npos)
            ++end;
          s.replace(p, end - p, tokens[below(std::size(tokens))]);
          break;
        }
        default: {  // replace a quoted string (key or value) with another's text or a token
          std::vector<std::size_t> quotes;
          for (std::size_t p = s.find('"'); p != std::string::npos; p = s.find('"', p + 1))
            quotes.push_back(p);
          if (quotes.size() < 2) break;
          const std::size_t k = below(quotes.size() / 2) * 2;
          const std::size_t a = quotes[k], len = quotes[k + 1] + 1 - a;
          s.replace(a, len,
                    below(2) ? std::string(tokens[below(std::size(tokens))])
                             : "\"stage3_max_live_parameters\"");
        }
      }
    }
    try {
      const Config c = parse_text(s);
      CHECK(!zp::ds::describe(c).empty());
      (void)zp::ds::engine_config<zp::bf16>(c, 1 + int(below(4)));
      ++ok;
    } catch (const zp::Error& e) {
      if (e.category() != zp::Errc::invalid_argument)
        FAIL_CHECK("category ", int(e.category()), ": ", e.what());
      ++(std::string(e.what()).find("invalid JSON") != std::string::npos ? not_json : rejected);
    } catch (const std::exception& e) {
      FAIL_CHECK("not a zp::Error: ", e.what(), "\ninput:\n", s);
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("ds_config fuzz: %zu parsed, %zu rejected by the checks, %zu not JSON, in %.2f s\n",
              ok, rejected, not_json, seconds);
  CHECK(ok > 0);
  CHECK(rejected > 0);
  CHECK(not_json > 0);
}

TEST_CASE("an unknown key megabytes long is refused at once, with a short message") {
  // The "did you mean" search used to run a full edit distance of the key against every known
  // key (over 10 s for 4 MiB); keys whose lengths differ by more than 3 are not compared now.
  const std::string key(std::size_t(4) << 20, 'k');
  try {
    parse_text("{\"train_batch_size\": 8, \"" + key + "\": 1}");
    FAIL("accepted an unknown key");
  } catch (const zp::Error& e) {
    const std::string w = e.what();
    CHECK(w.find("unknown key") != std::string::npos);
    CHECK(w.find("kkk...") != std::string::npos);
    CHECK(w.size() < 2000);
  }
  CHECK(zp::ds::detail::edit_distance(key, "stage") == 4);  // "more than 3", without comparing
  CHECK(zp::ds::detail::edit_distance("stgae", "stage") == 2);
}

TEST_CASE("a ds_config that is not a regular file is an error, not a hang") {
  zp::test::TempDir dir;
  const auto fifo = dir.path / "ds_config.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  zp::test::expect_error(zp::Errc::io, [&] { (void)zp::ds::load(fifo); },
                         {"ds_config.json", "a FIFO"});
  zp::test::expect_error(zp::Errc::io, [&] { (void)zp::ds::load(dir.path); }, {"a directory"});
}

namespace {

namespace keys = zp::detail::keys;

// A valid value of the key other than its default (the "other" of a choice is its first other
// name), and the default itself as JSON (null when the default is not a value the key takes:
// the key is then left out).
keys::Value other_value(const keys::Spec& s) {
  keys::Value v = s.def;
  v.null = false;
  const keys::Real r = s.real;
  auto other = [&](double d) {
    return d != 0 ? d / 2 : r == keys::Real::unit_open || r == keys::Real::unit_closed ? 0.5 : 1.5;
  };
  switch (s.kind) {
    case keys::Kind::boolean: v.b = !s.def.b; break;
    case keys::Kind::integer:
      v.i = s.def.i < s.hi ? std::max(s.def.i + 1, s.lo) : s.def.i - 1;
      break;
    case keys::Kind::real:
    case keys::Kind::real_f32: v.x = other(s.def.x); break;
    case keys::Kind::text: v.s = "/some/where"; break;
    case keys::Kind::choice:
      for (const keys::Choice& c : s.choices)
        if (s.def.null || c.value != s.def.i) {
          v.i = c.value;
          break;
        }
      break;
    case keys::Kind::pair:
      v.x = other(s.def.x);
      v.y = other(s.def.y);
      break;
    case keys::Kind::any:
    case keys::Kind::object: break;
  }
  return v;
}

json to_json(const keys::Spec& s, const keys::Value& v) {
  if (v.null) return nullptr;
  switch (s.kind) {
    case keys::Kind::boolean: return v.b;
    case keys::Kind::integer: return v.i;
    case keys::Kind::real:
    case keys::Kind::real_f32: return v.x;
    case keys::Kind::text: return std::string(v.s);
    case keys::Kind::choice:
      for (const keys::Choice& c : s.choices)
        if (c.value == v.i) return std::string(c.name);
      break;
    case keys::Kind::pair: return json::array({v.x, v.y});
    case keys::Kind::any:
    case keys::Kind::object: break;
  }
  return nullptr;
}

// The JSON pointer of a dotted key path ("scheduler.params" -> "/scheduler/params"; "" -> the root).
json::json_pointer pointer(const std::string& path) {
  json::json_pointer p;
  for (std::size_t i = 0; !path.empty() && i <= path.size();) {
    const std::size_t end = std::min(path.find('.', i), path.size());
    p /= path.substr(i, end - i);
    i = end + 1;
  }
  return p;
}

struct KeyCheck {
  std::size_t checked = 0;
  std::vector<std::string> unwired;  // keys that changed nothing
};

// For each key `table` declares as read (by its name and by its alias), a config that sets it to
// a value other than its default parses to a Config other than the one with the default.
template <class S, std::size_t N>
void check_table(const zp::detail::keys::Key<S> (&table)[N], const std::string& path,
                 const json& context, KeyCheck& out,
                 const std::map<std::string, json>& values = {}) {
  for (const auto* k : keys::read_keys(table)) {
    if (k->spec.kind == keys::Kind::object || k->spec.kind == keys::Kind::any)
      continue;  // their own tables
    for (std::string_view name : {k->name, k->alias}) {
      if (name.empty()) continue;
      const std::string key_path =
          path.empty() ? std::string(name) : path + "." + std::string(name);
      CAPTURE(key_path);
      const keys::Value def = k->spec.def;
      const bool def_valid = def.null ? k->spec.null_ok
                                      : k->spec.kind != keys::Kind::integer ||
                                            (def.i >= k->spec.lo && def.i <= k->spec.hi);
      json a = context, b = context;
      const json::json_pointer at = pointer(path) / std::string(name);
      if (def_valid)
        a[at] = to_json(k->spec, def);
      else if (a.contains(at))
        a[pointer(path)].erase(std::string(name));
      const auto v = values.find(key_path);
      b[at] = v != values.end() ? v->second : to_json(k->spec, other_value(k->spec));
      const std::string text_a = a.dump(), text_b = b.dump();
      CAPTURE(text_a);
      CAPTURE(text_b);
      std::set<std::string> got;
      try {
        got = changed(fields(zp::ds::parse(a, "ds_config.json")),
                      fields(zp::ds::parse(b, "ds_config.json")));
      } catch (const zp::Error& e) {
        FAIL_CHECK("a valid value was refused: ", e.what());
        continue;
      }
      ++out.checked;
      if (got.empty()) out.unwired.push_back(key_path);
    }
  }
}

}  // namespace

TEST_CASE(
    "every key declared as read changes the Config when set to a value other than its default") {
  // A key declared (and so accepted) but stored nowhere would pass every parse silently; each
  // table of ds_config.hpp is walked here with a context that makes its keys matter (fp16's
  // loss-scaler keys only act with fp16 enabled, a schedule's keys only under its type).
  namespace d = zp::ds::detail;
  const json batch = {{"train_batch_size", "auto"}, {"train_micro_batch_size_per_gpu", "auto"}};
  auto with = [&](const char* extra) {
    json j = batch;
    j.merge_patch(json::parse(extra));
    return j;
  };
  KeyCheck out;
  check_table(d::root_keys, "", batch, out);
  check_table(d::fp16_keys, "fp16", with(R"({"fp16": {"enabled": true}})"), out);
  check_table(d::bf16_keys, "bf16", batch, out);
  check_table(d::bf16_keys, "bfloat16", batch, out);
  check_table(d::zero_keys, "zero_optimization", with(R"({"zero_optimization": {"stage": 3}})"),
              out, {{"zero_optimization.mics_shard_size", 2}});  // 0, the default + 1, is refused
  check_table(d::offload_keys, "zero_optimization.offload_optimizer", batch, out);
  check_table(d::offload_param_keys, "zero_optimization.offload_param",
              with(R"({"zero_optimization": {"stage": 3}})"), out);
  check_table(d::aio_keys, "aio", batch, out);
  check_table(d::data_type_keys, "data_types", batch, out);
  check_table(d::checkpoint_keys, "checkpoint", batch, out);
  check_table(d::adam_keys, "optimizer.params", with(R"({"optimizer": {"type": "Adam"}})"), out);
  check_table(d::lion_keys, "optimizer.params", with(R"({"optimizer": {"type": "Lion"}})"), out);
  check_table(d::sgd_keys, "optimizer.params",
              with(R"({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}})"), out);
  check_table(d::warmup_keys, "scheduler.params", with(R"({"scheduler": {"type": "WarmupLR"}})"),
              out);
  check_table(
      d::decay_keys, "scheduler.params",
      with(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}})"),
      out);
  check_table(
      d::cosine_keys, "scheduler.params",
      with(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}})"),
      out);
  check_table(
      d::cycle_keys, "scheduler.params",
      with(
          R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})"),
      out, {{"scheduler.params.cycle_max_mom", 0.95}});  // stays >= cycle_min_mom
  CHECK_MESSAGE(out.unwired.empty(), "declared as read but stored nowhere: ",
                show({out.unwired.begin(), out.unwired.end()}));
  CHECK(out.checked >= 60);
  // The optimizer's and scheduler's "type" select a table; each type is a different Config.
  std::set<std::string> seen;
  for (const char* t : {"Adam", "AdamW", "SGD", "Lion"}) {
    json j = batch;
    j["optimizer"] = {{"type", t}};
    if (std::string(t) == "Adam") j["optimizer"]["params"] = {{"adam_w_mode", false}};
    seen.insert(zp::ds::describe(zp::ds::parse(j)));
  }
  for (const char* t : {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"}) {
    json j = batch;
    j["scheduler"] = {
        {"type", t},
        {"params", {{"total_num_steps", 5000}, {"cycle_min_lr", 0}, {"cycle_max_lr", 1}}}};
    if (std::string(t) == "WarmupLR") j["scheduler"]["params"] = json::object();
    if (std::string(t) != "OneCycle")
      j["scheduler"]["params"].erase("cycle_min_lr"),
          j["scheduler"]["params"].erase("cycle_max_lr");
    else
      j["scheduler"]["params"].erase("total_num_steps");
    seen.insert(zp::ds::describe(zp::ds::parse(j)));
  }
  CHECK(seen.size() == 8);
}

TEST_CASE(
    "a default Config holds what parsing gives for a config that sets nothing but the batch") {
  // Config's member defaults restate the declared defaults of ds_config.hpp's tables; they must agree.
  Fields parsed = fields(parse_text(R"({"train_batch_size": "auto"})"));
  Fields made = fields(Config{});
  for (const char* k : {"auto_keys", "source", "optimizer_given"}) parsed.erase(k), made.erase(k);
  CHECK_MESSAGE(parsed == made, "differ: ", show(changed(parsed, made)));
}

namespace {
// Every read key of `table` (by its name, under `path`) has a line "    <path>: " in d.
template <class S, std::size_t N>
std::size_t check_described(const std::string& d, const zp::detail::keys::Key<S> (&table)[N],
                            const std::string& path) {
  std::size_t n = 0;
  for (const auto* k : zp::detail::keys::read_keys(table)) {
    const std::string key_path =
        path.empty() ? std::string(k->name) : path + "." + std::string(k->name);
    const bool nested = k->spec.kind == zp::detail::keys::Kind::object ||
                        k->spec.kind == zp::detail::keys::Kind::any;
    // An object's own keys follow its path ("zero_optimization.stage"); a value has "path: value".
    CHECK_MESSAGE(d.find("    " + key_path + (nested ? "" : ": ")) != std::string::npos,
                  "describe() lacks ", key_path, " in\n", d);
    ++n;
  }
  return n;
}
}  // namespace

TEST_CASE("describe() lists every key declared as read, from the declarations") {
  namespace d = zp::ds::detail;
  // A default Config: every table it reaches (AdamW's params, no scheduler).
  const std::string def = zp::ds::describe(Config{});
  std::size_t n = 0;
  n += check_described(def, d::root_keys, "");
  n += check_described(def, d::fp16_keys, "fp16");
  n += check_described(def, d::bf16_keys, "bf16");
  n += check_described(def, d::zero_keys, "zero_optimization");
  n += check_described(def, d::offload_keys, "zero_optimization.offload_optimizer");
  n += check_described(def, d::offload_param_keys, "zero_optimization.offload_param");
  n += check_described(def, d::aio_keys, "aio");
  n += check_described(def, d::data_type_keys, "data_types");
  n += check_described(def, d::checkpoint_keys, "checkpoint");
  n += check_described(def, d::optimizer_keys, "optimizer");
  n += check_described(def, d::adam_keys, "optimizer.params");
  CHECK(n >= 35);
  CHECK(def.find("    scheduler: null\n") != std::string::npos);
  // The tables a type selects: each optimizer's and scheduler's params.
  const json batch = {{"train_batch_size", 8}};
  auto with = [&](const char* extra) {
    json j = batch;
    j.merge_patch(json::parse(extra));
    return zp::ds::describe(zp::ds::parse(j));
  };
  check_described(with(R"({"optimizer": {"type": "SGD"}})"), d::sgd_keys, "optimizer.params");
  check_described(with(R"({"optimizer": {"type": "Lion"}})"), d::lion_keys, "optimizer.params");
  check_described(with(R"({"scheduler": {"type": "WarmupLR"}})"), d::warmup_keys,
                  "scheduler.params");
  check_described(
      with(R"({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5000}}})"),
      d::decay_keys, "scheduler.params");
  check_described(
      with(R"({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}})"),
      d::cosine_keys, "scheduler.params");
  const std::string cycle = with(
      R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})");
  check_described(cycle, d::cycle_keys, "scheduler.params");
  check_described(cycle, d::scheduler_keys, "scheduler");
  // Values as the Config keeps them, in ds_config's spelling; "auto" marked.
  const std::string s = with(R"({"train_micro_batch_size_per_gpu": "auto", "fp16": {"enabled": true,
      "loss_scale_window": 500}, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
      "optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.95], "adam_w_mode": false, "lr": "auto"}},
      "communication_data_type": "bfp16", "checkpoint": {"tag_validation": "fail"}})");
  for (const char* line :
       {"    train_batch_size: 8\n", "    train_micro_batch_size_per_gpu: 0 (\"auto\")\n",
        "    fp16.enabled: true\n", "    fp16.loss_scale_window: 500\n",
        "    fp16.initial_scale_power: 16\n", "    zero_optimization.stage: 3\n",
        "    zero_optimization.offload_optimizer.device: \"cpu\"\n",
        "    optimizer.type: \"Adam\"\n", "    optimizer.params.betas: [0.8, 0.95]\n",
        "    optimizer.params.adam_w_mode: false\n", "    optimizer.params.lr: 0.001 (\"auto\")\n",
        "    communication_data_type: \"bf16\"\n", "    data_types.grad_accum_dtype: null\n",
        "    checkpoint.tag_validation: \"Fail\"\n"})
    CHECK_MESSAGE(s.find(line) != std::string::npos, "missing \"", line, "\" in\n", s);
  // The summary lines stay above the listing.
  CHECK(s.find("  zero: stage 3") < s.find("    zero_optimization.stage: 3"));
}

TEST_CASE("list_object describes any table: each read key by its declaration, in order") {
  namespace keys = zp::detail::keys;
  struct T {
    int a = 0;
    std::optional<zp::DType> t;
    std::string name;
    float lo = 0, hi = 0;
  };
  static constexpr keys::Choice types[] = {{"fp32", std::int64_t(zp::DType::f32)},
                                           {"bf16", std::int64_t(zp::DType::bf16)}};
  using K = keys::Key<T>;
  static constexpr K table[] = {
      K::read(
          "a", keys::count(3), [](auto& x) -> auto& { return x.a; }),
      K::ignored("skipped", keys::boolean()),
      K::unsupported("no"),
      K::read(
          "t", keys::choice_or_null(types, "a type"), [](auto& x) -> auto& { return x.t; }),
      K::read(
          "name", keys::text("a name"), [](auto& x) -> auto& { return x.name; }),
      K::read("range", keys::pair(0, 1, keys::Real::finite, "two numbers"),
              [](auto& x) { return std::tie(x.lo, x.hi); })};
  T x{.a = 7, .t = zp::DType::bf16, .name = "q\"r", .lo = 0.5f, .hi = 2};
  const keys::Listing got = keys::list_object(table, x, "top");
  REQUIRE(got.size() == 4);
  CHECK(got[0].path == "top.a");
  CHECK(got[0].value == "7");
  CHECK(got[1].path == "top.t");
  CHECK(got[1].value == "\"bf16\"");
  CHECK(got[2].value == "\"q\\\"r\"");
  CHECK(got[3].path == "top.range");
  CHECK(got[3].value == "[0.5, 2]");
  x.t.reset();
  CHECK(keys::list_object(table, x)[1].path == "t");
  CHECK(keys::list_object(table, x)[1].value == "null");
  // get reads back what put stored.
  for (const K* k : keys::read_keys(table)) {
    T y;
    k->put(y, k->spec.def);
    CHECK(keys::show(k->spec, k->get(y)) == keys::show(k->spec, k->spec.def));
  }
}
