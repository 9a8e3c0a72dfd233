// zp/engine_config.hpp: what an Engine is configured with and reports, apart from the engine
// itself, so code that only builds or reads configurations (ds_config, tools, a trainer's
// option parsing) need not compile the engine: the batch triad (BatchConfig, resolve_batch),
// EngineConfig, and a step's result and timings (StepResult, StepTimes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "zp/dtype.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/precision.hpp"
#include "zp/quantize.hpp"

namespace zp {

// Where and how an offloaded optimizer's state lives on NVMe; DeepSpeed's keys and defaults
// (offload_optimizer's nvme_path, buffer_count, pipeline_read, pipeline_write;
// zero_optimization.sub_group_size; aio.queue_depth and aio.block_size).
struct NvmeOptions {
  std::filesystem::path path;                     // an existing, writable directory
  int buffer_count = 4;                           // sub-group buffers in host memory (>= 2)
  bool pipeline_read = false;                     // read ahead while a sub-group is stepped
  bool pipeline_write = false;                    // write behind while the next one is stepped
  std::size_t sub_group_size = 1'000'000'000;     // elements of a sub-group (at most the shard)
  unsigned queue_depth = 8;                       // I/O requests of a transfer in flight
  std::size_t block_size = std::size_t(1) << 20;  // bytes of one request (a multiple of 4 KiB)

  void check() const {
    ZP_EXPECT(!path.empty(), "offload to nvme: nvme_path is empty; name a directory on the drive");
    ZP_EXPECT(buffer_count >= 2 && buffer_count <= 64, "offload to nvme: buffer_count ",
              buffer_count, " is not in [2, 64]");
    ZP_EXPECT(sub_group_size >= 1, "offload to nvme: sub_group_size must be >= 1");
    ZP_EXPECT(queue_depth >= 1 && queue_depth <= 4096, "offload to nvme: queue_depth ", queue_depth,
              " is not in [1, 4096]");
    ZP_EXPECT(block_size >= 4096 && block_size % 4096 == 0 && block_size <= (std::size_t(1) << 30),
              "offload to nvme: block_size ", block_size,
              " is not a multiple of 4096 in [4096, 1 GiB]");
  }
};

// DeepSpeed's batch triad: train_batch_size = micro_batch_per_rank * gradient_accumulation_steps
// * ranks. 0 means "not given"; any two determine the third; with only one batch size the
// accumulation is 1.
struct BatchConfig {
  std::int64_t train_batch_size = 0;
  std::int64_t micro_batch_per_rank = 0;
  std::int64_t gradient_accumulation_steps = 0;
};

// Completes and checks a batch configuration for `ranks` data-parallel ranks.
inline BatchConfig resolve_batch(BatchConfig b, int ranks) {
  auto describe = [&] {
    return detail::cat(
        "train_batch_size=", b.train_batch_size, ", micro_batch_per_rank=", b.micro_batch_per_rank,
        ", gradient_accumulation_steps=", b.gradient_accumulation_steps, ", ranks=", ranks);
  };
  ZP_EXPECT(ranks >= 1, "batch: ranks must be >= 1, got ", ranks);
  ZP_EXPECT(
      b.train_batch_size >= 0 && b.micro_batch_per_rank >= 0 && b.gradient_accumulation_steps >= 0,
      "batch: sizes must be positive (0 = not given): ", describe());
  const std::int64_t n = ranks;
  const bool t = b.train_batch_size > 0, m = b.micro_batch_per_rank > 0,
             g = b.gradient_accumulation_steps > 0;
  ZP_EXPECT(t || m, "batch: give train_batch_size or micro_batch_per_rank (or both): ", describe());
  // Every product below is of factors that are each at most this one, so none can wrap.
  std::int64_t product = 0;
  ZP_EXPECT(
      !__builtin_mul_overflow(std::max<std::int64_t>(b.micro_batch_per_rank, 1),
                              std::max<std::int64_t>(b.gradient_accumulation_steps, 1), &product) &&
          !__builtin_mul_overflow(product, n, &product),
      "batch: micro_batch_per_rank * gradient_accumulation_steps * ranks overflows a 64-bit "
      "integer: ",
      describe());
  BatchConfig r = b;
  if (t && m && g) {
    ZP_EXPECT(
        b.train_batch_size == b.micro_batch_per_rank * b.gradient_accumulation_steps * n,
        "batch: train_batch_size must equal micro_batch_per_rank * gradient_accumulation_steps * "
        "ranks, but ",
        b.micro_batch_per_rank, " * ", b.gradient_accumulation_steps, " * ", n, " = ",
        b.micro_batch_per_rank * b.gradient_accumulation_steps * n, ": ", describe());
  } else if (t && m) {
    ZP_EXPECT(b.train_batch_size % (b.micro_batch_per_rank * n) == 0,
              "batch: train_batch_size is not a multiple of micro_batch_per_rank * ranks = ",
              b.micro_batch_per_rank * n, ": ", describe());
    r.gradient_accumulation_steps = b.train_batch_size / (b.micro_batch_per_rank * n);
  } else if (t && g) {
    ZP_EXPECT(b.train_batch_size % (b.gradient_accumulation_steps * n) == 0,
              "batch: train_batch_size is not a multiple of gradient_accumulation_steps * ranks = ",
              b.gradient_accumulation_steps * n, ": ", describe());
    r.micro_batch_per_rank = b.train_batch_size / (b.gradient_accumulation_steps * n);
  } else if (t) {
    ZP_EXPECT(b.train_batch_size % n == 0,
              "batch: train_batch_size is not a multiple of ranks: ", describe());
    r.gradient_accumulation_steps = 1;
    r.micro_batch_per_rank = b.train_batch_size / n;
  } else {
    if (!g) r.gradient_accumulation_steps = 1;
    r.train_batch_size = b.micro_batch_per_rank * r.gradient_accumulation_steps * n;
  }
  return r;
}

// qwZ's format when a ds_config (or a trainer's flag) turns it on: int8, a scale per 2048 values.
inline constexpr quant::Format zero_quantized_weights{.bits = quant::Bits::int8, .block = 2048};
// ... and qgZ's: int8, a scale per 512 values (DeepSpeed sends int4; zp_gpt's default run,
// 300 steps at stage 3 on 2 nodes of 2 ranks, ended at loss 2.556 with int4, 2.411 with int8,
// 2.414 unquantized).
inline constexpr quant::Format zero_quantized_gradients{.bits = quant::Bits::int8, .block = 512};

struct EngineConfig {
  BatchConfig batch{.micro_batch_per_rank = 1};
  // Gradient bucket size (DDP uses 25 MiB; DeepSpeed's 5e8 elements is its top memory
  // complaint) and the smaller first bucket, so the first reduction starts early.
  std::size_t bucket_bytes = std::size_t(16) << 20;
  std::size_t first_bucket_bytes = std::size_t(1) << 20;
  std::size_t align = 16;   // elements; shard pieces are multiples of it
  float max_grad_norm = 0;  // clip by global L2 norm; <= 0: no clipping
  LossScaler loss_scaler = LossScaler::none();
  // Stage 3: most gathered non-persistent parameter elements at once (0: twice the largest
  // module, room for one module and its prefetch, or the modules kept after forward if more);
  // modules with at most persist_threshold elements stay gathered until the next optimizer
  // step; prefetch: parameter elements gathered ahead (DeepSpeed's stage3_prefetch_bucket_size:
  // the modules of the guards the last micro-step ran next, in order, until they hold this
  // many, within max_live_params; 0: none, 1: the next guard's module only).
  std::size_t max_live_params = 0;
  std::size_t persist_threshold = 0;
  std::size_t prefetch = 1;
  // Stage 3 (FSDP2's reshard_after_forward): false keeps a module's gathered parameters from
  // its forward guard until its backward guard ends, so backward gathers nothing (stage 3's
  // traffic 2 Psi a micro-step, not 3 Psi) and the gathered model lives from forward to
  // backward; under a max_live_params cap, the kept modules backward needs last go first.
  bool reshard_after_forward = true;
  // Stage 3 (DeepSpeed's stage3_max_reuse_distance, in parameter elements): a module is kept
  // gathered from forward to backward, as above, when fewer elements are gathered between its
  // two uses: those of the guards between its last forward guard and its backward guard, in
  // the order the last micro-step ran them (before the first, the layout's: the modules after
  // it, once in forward and again in backward). The module forward runs last has distance 0,
  // so any positive value keeps it: the default 1 keeps it only (its backward starts as its
  // forward ends, so the gathered peak is unchanged and its second gather saved; FSDP2 keeps
  // its root module so); 0 keeps none (stage 3's 3 Psi); DeepSpeed's default 1e9 keeps every
  // module of a model under 5e8 elements. Only where reshard_after_forward is true; ignored
  // below stage 3.
  std::size_t max_reuse_distance = 1;
  // ZeRO++'s qwZ (DeepSpeed's zero_quantized_weights; stage 3, every backend): the parameter
  // gathers send int8 codes with one fp32 scale per `block` elements of a rank's piece instead
  // of T (param_coordinator.hpp), about a quarter (fp32) or half (16-bit) of the bytes; every
  // rank computes with the same dequantized weights, while shards, master weights and optimizer
  // state stay exact. ds_config's zero_quantized_weights: true gives zero_quantized_weights.
  std::optional<quant::Format> quantized_weights = std::nullopt;
  // ZeRO++'s hpZ (DeepSpeed's zero_hpz_partition_size; stage 3, every backend): ranks per node,
  // consecutive ranks forming a node. Above 1, each rank also keeps 1/hpz of every module it
  // gathered until the next step (MemoryReport::secondary, 2 Psi / hpz bytes at 16 bits), and
  // gathers after the first (backward, later micro-batches) run inside the node. Bitwise the
  // same results. Must divide the data-parallel size.
  int hpz_partition_size = 1;
  // ZeRO++'s qgZ (DeepSpeed's zero_quantized_gradients; stages 2 and 3, every backend): each
  // bucket's reduce_scatter quantized, in two hops: inside nodes of ranks_per_node consecutive
  // data-parallel ranks (0: the backend's node layout where it has one, as the mpi backend's
  // node_layout(), under hybrid sharding as far as it divides the shard group; else one node of
  // all), then across nodes among ranks of the same local index, summing in fp32 between and
  // after (quantized_collectives.hpp). The same bits on every backend; the gradients within the
  // quantization's bounds of the exact average.
  std::optional<quant::Format> quantized_gradients = std::nullopt;
  int ranks_per_node = 0;
  // Hybrid sharding (DeepSpeed's MiCS, mics_shard_size; PyTorch FSDP2's HSDP; stages 1-3): ZeRO
  // shards over groups of shard_group_size consecutive data-parallel ranks (a node, say) and
  // replicates over the groups. Each group's gathers and reduce_scatters stay inside it, as
  // ZeRO over shard_group_size ranks (memory per rank too); at the accumulation boundary each
  // rank's gradient piece is averaged with its replicas' (all_reduces of P / shard_group_size
  // elements in all over data-parallel size / shard_group_size ranks, a bucket's as soon as its
  // piece is final: stages 2 and 3 overlap backward) before the norm and the update, in the
  // type the gradients accumulate in at stages 2 and 3 (grad_accum_dtype) and the reduction's at
  // stage 1. 0: the whole data-parallel group (plain ZeRO). Must divide the data-parallel size.
  int shard_group_size = 0;
  // Stage 2/3 scratch buckets kept (at least a module's segments + 1, at most the layout's
  // segments + 1); more while buckets wait for ones before them in the launch order (bucket.hpp).
  std::size_t bucket_slots = 2;
  optim::cpu::Options optimizer_options{};
  // Rank 0's initial values win; else each rank's own (under hybrid sharding each shard rank's
  // own in the first group, which its replicas take).
  bool broadcast_initial_params = true;
  // ZeRO-Init (DeepSpeed's zero.Init; FSDP2's meta-device initialisation): where set, each rank
  // asks it for the initial values of only the elements it keeps (at stage 3 its shard; below,
  // the whole model, which those stages keep), rounded to the model's type as a model holding
  // them would, instead of reading the model's value views, which may then be unbound: at stage
  // 3 no rank's memory ever holds the whole model, the model's included. It must give an element
  // the same value on every rank that asks (a function of the name and index, as a seeded
  // initialisation is) and write every element it is asked for (NaN left behind is an error);
  // broadcast_initial_params is then unused. An exception from it is an error on every rank.
  // Under hybrid sharding each shard group asks for its elements.
  Initializer initializer = nullptr;
  // ZeRO-Offload (DeepSpeed's offload_optimizer: cpu): the fp32 master weights and optimizer
  // state live in host memory and the CPU step (optim/cpu.hpp) updates them, segment by segment,
  // from the gradient shard copied to the host, copying the updated T shard back. A device
  // backend then holds only the T parameters and gradients (and buckets) in device memory;
  // MemoryReport::offloaded says how many bytes moved to the host. Results equal the engine
  // without offload (the CPU and CUDA steps share their element math). On a device the copies
  // go through pinned double buffers (OffloadStaging), so they overlap the CPU work; the host
  // waits for each segment's gradient (those waits count in device::sync_count).
  bool offload_optimizer = false;
  // ZeRO-Infinity (DeepSpeed's offload_optimizer: nvme): the offloaded master weights and
  // optimizer state live in a swap file per rank under optimizer_nvme->path instead of host
  // memory (swap.hpp; implies offload_optimizer); host memory holds buffer_count sub-groups.
  // MemoryReport::nvme says how many bytes are there. Results equal offload to host memory.
  std::optional<NvmeOptions> optimizer_nvme = std::nullopt;
  // DeepSpeed's offload_param: cpu (stage 3): the 16-bit parameter shard in host memory, where
  // the host backends keep it anyway; a device backend keeps it page-locked, copies a module's
  // pieces up before its gathers and steps it in place (the device's kernels write it there, or
  // the CPU with offload_optimizer). Results equal stage 3 on the device.
  bool offload_param = false;
  // ZeRO-Infinity's offload_param (nvme, stage 3; on a device backend with the optimizer
  // offloaded too): each rank's 16-bit parameter shard in a swap file, read for each module's
  // gather and written by the optimizer step (in the optimizer swap's sub-groups when both are
  // on NVMe). Results equal stage 3 in memory.
  std::optional<NvmeOptions> param_nvme = std::nullopt;
  // Gradient precision for 16-bit T (DeepSpeed's data_types.grad_accum_dtype and
  // communication_data_type; f32 or T's dtype). Accumulation over micro-steps, by default in T
  // except bf16 at stage 0, which accumulates in fp32 (as DeepSpeed); the reduction across
  // ranks, by default in T. fp32 keeps one fp32 gradient buffer (stage 0/1: full; stage 2/3: the
  // shard) and fp32 reductions move twice the bytes. Without accumulation (one micro-step per
  // step) the accumulation dtype changes nothing and costs nothing.
  std::optional<DType> grad_accum_dtype = std::nullopt;
  std::optional<DType> communication_dtype = std::nullopt;
  // Which parameters the optimizer's weight decay applies to, by the name the model's
  // for_each_parameter gives (PyTorch's param groups with weight_decay 0 for the others;
  // Megatron-LM's no_weight_decay_cond); empty: all of them. GPT practice (GPT-2, nanoGPT,
  // Megatron-LM) decays the matrices, not the biases and the norms' gains. It must choose alike on
  // every rank (the engine checks that the data-parallel ranks agree); a checkpoint does not keep
  // it: it is the program's, as the model is.
  std::function<bool(std::string_view name)> weight_decay_filter = nullptr;
  // DeepSpeed's: rank 0 prints StepResult::times every steps_per_print optimizer steps.
  bool wall_clock_breakdown = false;
  int steps_per_print = 10;

  // The settings' own checks, for the engine to run before it lays out or allocates anything (the
  // batch, layout, scaler and optimizer check their own).
  void check() const {
    ZP_EXPECT(!std::isnan(max_grad_norm),
              "engine: max_grad_norm is NaN; use a positive norm to clip, or 0 for "
              "no clipping");
    ZP_EXPECT(steps_per_print >= 1, "engine: steps_per_print must be >= 1, got ", steps_per_print);
    ZP_EXPECT(hpz_partition_size >= 1, "engine: hpz_partition_size must be >= 1, got ",
              hpz_partition_size);
    ZP_EXPECT(shard_group_size >= 0,
              "engine: shard_group_size must be >= 0 (0: the whole data-parallel group), got ",
              shard_group_size);
    ZP_EXPECT(ranks_per_node >= 0,
              "engine: ranks_per_node must be >= 0 (0: the backend's node layout), got ",
              ranks_per_node);
    ZP_EXPECT(optimizer_options.threads >= 1,
              "engine: optimizer_options.threads must be >= 1, got ", optimizer_options.threads);
    // A forced instruction set this rank's CPU lacks (a mixed cluster) fails here, agreed on,
    // not at the first step on this rank alone.
    (void)optim::cpu::detail::resolve(optimizer_options);
    if (quantized_weights) quantized_weights->check();
    if (quantized_gradients) quantized_gradients->check();
    if (optimizer_nvme) optimizer_nvme->check();
    if (param_nvme) param_nvme->check();
  }
};

// The layout an engine's config asks for, for elements of `elem_bytes` bytes, on a grid of `tp`
// tensor-parallel ranks (ZeRO++'s quantization there cuts segments by kind: layout.hpp).
inline LayoutOptions layout_options(const EngineConfig& c, std::size_t elem_bytes, int tp) {
  ZP_EXPECT(c.bucket_bytes >= elem_bytes && c.first_bucket_bytes >= elem_bytes,
            "engine: bucket_bytes (", c.bucket_bytes, ") and first_bucket_bytes (",
            c.first_bucket_bytes, ") must each hold at least one element (", elem_bytes, " bytes)");
  return {.bucket_elems = c.bucket_bytes / elem_bytes,
          .first_bucket_elems = c.first_bucket_bytes / elem_bytes,
          .align = c.align,
          .by_tp_kind = tp > 1 && (c.quantized_weights || c.quantized_gradients)};
}

// Where training stands: what a checkpoint (checkpoint.hpp) saves besides the buffers.
struct EngineProgress {
  std::int64_t step = 0;        // optimizer updates applied
  std::int64_t micro_step = 0;  // micro-steps done in the current accumulation window
  LossScaler::State scaler{};
};

// Where one optimizer step's wall time went, in seconds, over every micro-step of its window.
// The phases partition the time the engine sees; untracked() is the rest (the model's loss, data
// loading: whatever runs outside guards and step()).
struct StepTimes {
  double total = 0;           // from the end of the previous optimizer step to the end of this one
  double forward = 0;         // inside forward guards: the model's forward (gather waits excluded)
  double backward = 0;        // inside backward guards: the model's backward, launching reductions
  double gather_wait = 0;     // entering forward/backward guards: waiting for stage 3 gathers
  double reduce_wait = 0;     // in step(): launching the last buckets and waiting for reductions
  double statistics = 0;      // in step(): gradient norm and overflow check, their all_reduce
  double optimizer = 0;       // in step(): the update of this rank's shard (and the rest of step())
  double gather = 0;          // in step(): stage 1/2 all_gather of the updated parameters
  double reduce_span = 0;     // first reduction launched to last completed, summed over micro-steps
  double reduce_exposed = 0;  // the part of reduce_span that step() waited through

  // Sums and means over several steps.
  StepTimes& operator+=(const StepTimes& o) noexcept {
    return each([&](double StepTimes::*f) { this->*f += o.*f; });
  }
  StepTimes& operator*=(double k) noexcept {
    return each([&](double StepTimes::*f) { this->*f *= k; });
  }

  double untracked() const noexcept {
    return total - forward - backward - gather_wait - reduce_wait - statistics - optimizer - gather;
  }
  // The share of reduction time hidden behind backward (not waited for in step()).
  double hidden() const noexcept {
    return reduce_span > 0 ? std::clamp(1.0 - reduce_exposed / reduce_span, 0.0, 1.0) : 0.0;
  }
  // One line for logs: milliseconds per phase.
  std::string describe() const {
    auto ms = [](double x) { return std::round(x * 1e5) / 100; };
    return detail::cat("total ", ms(total), " ms | forward ", ms(forward), " | backward ",
                       ms(backward), " | gather wait ", ms(gather_wait), " | reduce wait ",
                       ms(reduce_wait), " (", std::round(hidden() * 100),
                       "% of reductions hidden) | statistics ", ms(statistics), " | optimizer ",
                       ms(optimizer), " | gather ", ms(gather), " | untracked ", ms(untracked()));
  }
  // The same as JSON object members ("total_ms": ..., ...), for JSON-lines logs.
  std::string json_fields() const {
    return detail::cat(
        "\"total_ms\":", total * 1e3, ",\"forward_ms\":", forward * 1e3,
        ",\"gather_wait_ms\":", gather_wait * 1e3, ",\"backward_ms\":", backward * 1e3,
        ",\"reduce_wait_ms\":", reduce_wait * 1e3, ",\"statistics_ms\":", statistics * 1e3,
        ",\"optimizer_ms\":", optimizer * 1e3, ",\"gather_ms\":", gather * 1e3,
        ",\"untracked_ms\":", untracked() * 1e3, ",\"reduce_span_ms\":", reduce_span * 1e3,
        ",\"hidden\":", hidden());
  }

 private:
  template <class F>
  StepTimes& each(F&& f) noexcept {
    for (double StepTimes::*p :
         {&StepTimes::total, &StepTimes::forward, &StepTimes::backward, &StepTimes::gather_wait,
          &StepTimes::reduce_wait, &StepTimes::statistics, &StepTimes::optimizer,
          &StepTimes::gather, &StepTimes::reduce_span, &StepTimes::reduce_exposed})
      f(p);
    return *this;
  }
};

// What step() did.
struct StepResult {
  bool boundary = false;  // this micro-step ended an accumulation window
  bool applied = false;   // the optimizer update ran (boundary and no overflow)
  bool overflow = false;  // an inf/nan gradient on some rank: skipped everywhere
  float loss_scale = 1;   // the scale to use from now on
  double grad_norm = 0;   // global L2 norm of the unscaled, averaged gradient (before clipping)
  std::int64_t step = 0;  // optimizer updates applied so far
  StepTimes times;        // at a boundary: the whole optimizer step's (its window's) phases
};

}  // namespace zp
