// zp/engine.hpp: Engine<Backend, T, Stage, Optimizer>, ZeRO data parallelism for a model that
// brings its own forward and backward.
//
//   zp::Engine<zp::backend::Threads, zp::bf16, 3> engine(comm, model, config, zp::optim::AdamW{});
//   for (;;) {                                  // one micro-step
//     for (int m = 0; m < M; ++m)      { auto g = engine.forward(m);  model.forward(m, batch); }
//     for (int m = M - 1; m >= 0; --m) { auto g = engine.backward(m); model.backward(m, engine.loss_scale()); }
//     engine.step();                            // applies the update at the accumulation boundary
//   }
//
// The guards mark module boundaries. forward(m)/backward(m) make module m's parameters readable
// (stage 3: gathered, waiting for the prefetch issued while the previous module ran, and
// prefetching the one the last micro-step ran next); backward(m) also points m's gradient views
// at bucket memory. When a backward guard ends, m's buckets are complete and launch their
// reductions asynchronously (stage 0/1 only at the accumulation boundary). Stage 0/1 work without
// guards too (all reductions then start in step()); stage 2/3 need the backward guards, stage 3
// also the forward ones. Every rank must run the same sequence of guards and steps (SPMD), as with
// any collective.
//
// step(), called after every micro-step's backward, at the accumulation boundary: waits for the
// buckets, one all_reduce of the step's statistics (step_gate.hpp: the squared gradient norm,
// the count of non-finite pieces, the cross-rank hyper-parameter check), unscale + clip +
// optimizer update of this rank's shard (apply_update: ShardStep<S>::update), writes the T shard,
// then stage 1/2 all_gather the parameters (stage 3 gathers lazily in the next forward).
// An overflow anywhere skips the update on every rank and changes nothing but the loss scaler.
// Built from a ProcessGrid, the engine shards over the DP group and sums the statistics over
// the replica's TP x PP ranks as well (the norm of the whole model, replicated parameters once).
//
// Averaging: buckets reduce with ReduceOp::avg (sum in rank order, one division, one rounding to
// T), and the 1/(loss_scale * accumulation_steps * clip) factor is folded into the optimizer's
// grad_mul (exact when accumulation_steps and the loss scale are powers of two). The model's loss
// is the mean over its micro-batch, multiplied by loss_scale() before backward.
//
// Communication per optimizer step (elements of T, nccl-tests bus bytes, P = padded parameters):
//   stage 0: all_reduce P                          -> 2(N-1)/N P
//   stage 1/2: reduce_scatter P + all_gather P    -> 2(N-1)/N P   (stage 2: GAS reduce_scatters)
//   stage 3: all_gather P twice + reduce_scatter P -> 3(N-1)/N P   (persistent modules and
//            modules kept after forward, by default the last, gather once)
// plus the statistics all_reduce (statistics_count doubles). Under hybrid sharding
// (EngineConfig::shard_group_size S) N is S, and the replicas add one all_reduce of P / S.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zp/bucket.hpp"
#include "zp/collective.hpp"
#include "zp/config.hpp"
#include "zp/engine_agreement.hpp"
#include "zp/engine_config.hpp"
#include "zp/error.hpp"
#include "zp/grid.hpp"
#include "zp/memory.hpp"
#include "zp/model.hpp"
#include "zp/module_guard.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/param_coordinator.hpp"
#include "zp/partition.hpp"
#include "zp/precision.hpp"
#include "zp/shard_step.hpp"
#include "zp/step_gate.hpp"
#include "zp/step_timer.hpp"
#include "zp/whole_model.hpp"

namespace zp {

template <Backend B, class T, int Stage, optim::Optimizer Opt = optim::AdamW>
class Engine {
  static_assert(Stage >= 0 && Stage <= 3, "ZeRO stage must be 0, 1, 2 or 3");
  static constexpr MemorySpace S = B::memory;
  using Clock = StepTimer::Clock;
  using Work = typename Collective<B>::Work;
  using Part = Partitioned<T, Stage, S>;   // what each rank keeps (partition.hpp)
  using MemoryPeers = zp::MemoryPeers<B>;  // counted in the memory check (engine_agreement.hpp)

 public:
  static constexpr int stage = Stage;
  static constexpr MemorySpace memory_space = S;  // where the engine's buffers live (the backend's)
  using value_type = T;
  using optimizer_type = Opt;

  // RAII module boundary (see the top of this file and module_guard.hpp).
  using ModuleGuard = zp::ModuleGuard<Engine>;

  // Takes over the model's parameters: lays them out, checks the layout is identical on every
  // rank (one all_reduce), copies the initial values (broadcast from rank 0 unless disabled) and
  // rebinds the model's views into zp memory. Collective. The model must not move while the
  // engine lives.
  template <Model<T> M>
  Engine(Collective<B>& comm, M& model, EngineConfig config = {}, Opt optimizer = {})
      : Engine(MemoryPeers{}, 1, comm, model, std::move(config), optimizer) {}

  // 3D parallelism (grid.hpp): ZeRO over the grid's DP group; the model holds one TP x PP part
  // of the network (its TP-split parameters marked TensorParallel::split), and the gradient
  // norm, the overflow check and the hyper-parameter check span the whole replica
  // (model_parallel(): the statistics are summed over it too, replicated parameters counted on
  // TP rank 0 only). The grid must outlive the engine. Collective over the world.
  template <Model<T> M>
  Engine(ProcessGrid<B>& grid, M& model, EngineConfig config = {}, Opt optimizer = {})
      : Engine(MemoryPeers{&grid.model_parallel(), grid.world_rank()}, grid.shape().tp, grid.dp(),
               model, std::move(config), optimizer) {
    if (grid.model_parallel().size() > 1) {
      mp_ = &grid.model_parallel();
      grid_ = grid.shape();
      coords_ = grid.coords();
      grid_.dp = comm_->size();  // a replica's grid under hybrid sharding
      coords_.dp = comm_->rank();
      // The replica's ranks clip, scale and skip a step together: settings agreed over it too.
      expect_same_engine_everywhere(*mp_, part_.layout(), Stage, dtype_of<T>, config_, batch_,
                                    precision_, opt_, std::span<const char>(decays_),
                                    S == MemorySpace::device, true);
    }
    if (grid.shape().tp > 1) expect_quantized_alike(grid);
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

 private:
  // The constructor over the data-parallel group `comm` of a grid of `tp` tensor-parallel ranks;
  // `peers`: the ranks besides it whose memory the check before allocating counts too
  // (expect_memory).
  template <Model<T> M>
  Engine(MemoryPeers peers, int tp, Collective<B>& comm, M& model, EngineConfig config,
         Opt optimizer)
      : shard_(
            hybrid_group(comm, checked(comm, peers.mp, config, optimizer).shard_group_size, true)),
        replicas_(hybrid_group(comm, config.shard_group_size, false)),
        dp_(&comm),
        comm_(shard_ ? &*shard_ : &comm),
        config_(with_nodes(std::move(config), comm, shard_)),
        batch_(resolve_batch(config_.batch, comm.size())),
        opt_(optimizer),
        bound_(bind_parameters<T>(model)),
        precision_(GradPrecision::resolve(dtype_of<T>, Stage, config_.grad_accum_dtype,
                                          config_.communication_dtype,
                                          batch_.gradient_accumulation_steps)),
        part_(
            with_room(Layout(bound_.params, comm_->size(), layout_options(config_, sizeof(T), tp)),
                      peers),
            comm_->rank(), optim::state_slots<Opt>, precision_.f32_buffer(Stage),
            config_.offload_optimizer, nvme(config_.optimizer_nvme), nvme(config_.param_nvme),
            config_.offload_param),
        buckets_(*comm_, part_, config_.bucket_slots, precision_),
        mods_(part_.layout().module_count()) {
    // Where a rank keeps its optimizer state need not agree on a host backend (the results do;
    // on a device ZeRO-Offload's step is agreed on, so expect_same_engine_everywhere compares
    // it), but a swap that failed to open on one rank is an error on all.
    on_every_rank(*dp_, [&] { part_.expect_swap_opened(); });
    const Layout& L = part_.layout();
    if (config_.weight_decay_filter) {  // empty where every parameter decays
      for (const auto& p : L.params()) decays_.push_back(config_.weight_decay_filter(p.name));
      if (std::count(decays_.begin(), decays_.end(), 1) == std::ptrdiff_t(decays_.size()))
        decays_.clear();
    }
    expect_same_engine_everywhere(*dp_, L, Stage, dtype_of<T>, config_, batch_, precision_, opt_,
                                  std::span<const char>(decays_), S == MemorySpace::device);
    load_initial_values(*dp_, part_, std::span<View<T>* const>(bound_.values),
                        config_.broadcast_initial_params, replicas_ ? &*replicas_ : nullptr,
                        config_.initializer, stats_.word());
    bind_views(part_, bound_);
    // hpZ's node: hpz_partition_size consecutive ranks. qgZ's two hops: inside nodes of
    // ranks_per_node consecutive ranks, then across them.
    Collective<B>& zero = *comm_;  // ZeRO++'s groups are inside the shard group
    const auto nodes_of = [&](int h, const char* what) {
      check_nodes(h, what, zero.size(), shard_.has_value());
      return zero.split(zero.rank() / h, zero.rank() % h);
    };
    if (config_.hpz_partition_size > 1)
      hpz_node_.emplace(nodes_of(config_.hpz_partition_size, "hpz_partition_size"));
    if (config_.quantized_gradients) {
      const int h = config_.ranks_per_node > 0 ? config_.ranks_per_node : zero.size();
      qgz_node_.emplace(nodes_of(h, "ranks_per_node"));
      qgz_peers_.emplace(zero.split(zero.rank() % h, zero.rank() / h));
      buckets_.quantize_gradients(*qgz_node_, *qgz_peers_, *config_.quantized_gradients);
    }
    if (replicas_) buckets_.average_over(*replicas_);
    if constexpr (Stage == 3)
      params_.emplace(zero, part_, std::span<View<T>* const>(bound_.values),
                      config_.persist_threshold, config_.max_live_params, config_.quantized_weights,
                      hpz_node_ ? &*hpz_node_ : nullptr,
                      config_.reshard_after_forward ? config_.max_reuse_distance : SIZE_MAX);
    buckets_.begin_micro_step(batch_.gradient_accumulation_steps == 1, true);
    mark_ = comm_->stats();
    timer_ = StepTimer{};  // the first window starts now
  }

 public:
  // Completes every reduction and gather still in flight before any memory goes (also while an
  // exception unwinds the training loop), then leaves the model's views that point into this
  // engine's memory pointing at nothing rather than at freed memory (views a newer engine on the
  // model has bound stay: `engine = std::make_unique<E>(...)` builds the new one first).
  ~Engine() {
    *self_ = nullptr;  // guards still open end doing nothing
    buckets_.wait_all_quietly();
    params_.reset();  // waits for gathers in flight
    unbind_views(part_, bound_);
  }

  // ---- the training loop ----------------------------------------------------------------------

  ModuleGuard forward(int m) {
    rethrow_pending();
    mods_.check(m);
    const auto t = timer_.stamp();
    enter(m, false);
    timer_.open(StepTimer::forward, t);
    mods_.opened(m, false);
    return ModuleGuard(self_, m, false);
  }

  ModuleGuard backward(int m) {
    rethrow_pending();
    mods_.check(m);
    mods_.expect_first_backward(m, [&] { return where(); });
    const auto t = timer_.stamp();
    enter(m, true);
    mods_.ran_backward(m);
    if constexpr (!Part::whole(Field::grad)) {  // the module's gradients go to bucket memory
      const Layout& L = part_.layout();
      const auto& mod = L.module(m);
      try {
        for (int s = mod.first_segment; s < mod.end_segment; ++s) {
          std::span<T> mem;
          in_context("backward()", [&] { mem = buckets_.acquire(s); });
          bind_segment<T>(L, s, bound_.grads, mem.data());
        }
      } catch (const std::exception& e) {  // the module is entered and its backward counted
        mark_unusable(detail::cat("backward(", m, ") failed (", detail::message_of(e), ")"));
        throw;
      }
    }
    timer_.open(StepTimer::backward, t);
    mods_.opened(m, true);
    return ModuleGuard(self_, m, true);
  }

  // Ends a micro-step (call it after every backward). At the accumulation boundary it runs the
  // optimizer step described at the top of this file. Collective.
  StepResult step() {
    rethrow_pending();
    mods_.end_micro_step([&] { return where(); }, micro_ + 1 == batch_.gradient_accumulation_steps,
                         !Part::whole(Field::grad));
    if constexpr (Stage == 3) params_->end_micro_step();
    timer_.begin_step();
    finish_reductions();
    timer_.phase(&StepTimes::reduce_wait);
    const std::int64_t gas = batch_.gradient_accumulation_steps;
    if (micro_ + 1 < gas) {
      ++micro_;
      buckets_.begin_micro_step(micro_ + 1 == gas, false);
      timer_.phase(&StepTimes::reduce_wait);
      StepResult r;
      r.loss_scale = config_.loss_scaler.scale();
      r.step = step_;
      return r;
    }
    micro_ = 0;
    try {
      const float unscale = reduce_statistics();
      timer_.phase(&StepTimes::statistics);
      return end_step(update_shards(), unscale);
    } catch (...) {
      // The window ends either way, so a caller that goes on after an error that skipped the
      // step everywhere (hyper-parameters that differ) accumulates the next one from zero.
      try {
        begin_window();
      } catch (...) {  // the first error is the one to report
      }
      throw;
    }
  }

  // ---- state and accounting ----------------------------------------------------------------

  // The per-step statistics all_reduce over the data-parallel group: doubles (the eight terms of
  // the bucket order's check, the squared norm, the overflow count, and the four terms of the
  // cross-rank hyper-parameter check), bytes = statistics_count * 8; over the replica's tensor x
  // pipeline group, the last grid_statistics_count of them. With the step gate, stats_slots
  // doubles of memory (step_gate.hpp).
  static constexpr std::size_t statistics_count = StepStatistics<S>::count;
  static constexpr std::size_t grid_statistics_count =
      StepStatistics<S>::count - StepStatistics<S>::order_terms;
  static constexpr std::size_t stats_slots = StepStatistics<S>::slots;

  // Multiply the loss (the gradient seeding backward) by this.
  float loss_scale() const noexcept { return config_.loss_scaler.scale(); }
  const LossScaler& loss_scaler() const noexcept { return config_.loss_scaler; }
  Opt& optimizer() noexcept { return opt_; }  // e.g. to set the learning rate of a schedule
  const BatchConfig& batch() const noexcept { return batch_; }
  std::int64_t steps() const noexcept { return step_; }
  const Layout& layout() const noexcept { return part_.layout(); }
  const Part& partition() const noexcept { return part_; }
  // The group ZeRO shards over: the data-parallel group, or this rank's shard group under hybrid
  // sharding (EngineConfig::shard_group_size), whose replicas() average the gradients.
  Collective<B>& comm() noexcept { return *comm_; }
  Collective<B>& data_parallel() noexcept { return *dp_; }
  // Hybrid sharding: the ranks holding this rank's shard in the other shard groups (rank() is
  // the shard group's index), with their own counters; else null.
  Collective<B>* replicas() noexcept { return replicas_ ? &*replicas_ : nullptr; }
  // The replica's TP x PP group (engines built from a grid with tp * pp > 1), else null.
  Collective<B>* model_parallel() noexcept { return mp_; }
  // The grid this engine is one rank of ({dp, 1, 1} without TP or PP; under hybrid sharding dp
  // is the shard group's size: one replica's grid) and its place in it.
  const GridShape& grid_shape() const noexcept { return grid_; }
  const GridCoords& grid_coords() const noexcept { return coords_; }
  // The model's parameters as it described them (names, modules, sizes, placements).
  const std::vector<ParamInfo>& params() const noexcept { return bound_.params; }
  // Whether params()[i] takes weight decay, and the filter that says so of any name (a
  // checkpoint's whole model): EngineConfig::weight_decay_filter.
  bool decays(std::size_t i) const noexcept { return decays_.empty() || decays_[i]; }
  const auto& weight_decay_filter() const noexcept { return config_.weight_decay_filter; }
  using Progress = EngineProgress;  // where training stands (engine_config.hpp)
  Progress progress() const noexcept { return {step_, micro_, config_.loss_scaler.state()}; }
  // Continues from `p` (after a checkpoint's buffers were written into partition()); stage 3's
  // gathered copies are dropped, they would be stale. Only at an accumulation boundary. It does
  // not communicate: every rank calls it with the same `p`, inside the caller's agreement on
  // the load (load_checkpoint's ckpt::writing), so a refusal is every rank's.
  void restore(const Progress& p) {
    expect_at_boundary("restore()");
    ZP_EXPECT(p.step >= 0 && p.micro_step == 0,
              "engine: restore(): progress must be at an "
              "accumulation boundary with step >= 0, got step ",
              p.step, ", micro-step ", p.micro_step);
    check_unscale(p.scaler.scale, batch_.gradient_accumulation_steps);
    config_.loss_scaler.load(p.scaler);
    step_ = p.step;
    if constexpr (Stage == 3) params_->release_all();
  }
  // Makes every later call throw, naming `why`: for a caller that failed halfway through
  // writing partition()'s buffers (load_checkpoint, load_safetensors), leaving no whole state.
  void mark_unusable(std::string why) {
    if (broken_.empty()) broken_ = std::move(why);
  }
  // Throws unless the engine is usable, at an accumulation boundary and outside every guard:
  // the only moment its buffers hold a complete training state.
  void expect_at_boundary(const char* what) {
    rethrow_pending();
    ZP_EXPECT(micro_ == 0, "engine: ", what, " in ", where(),
              "; only at an accumulation boundary "
              "(after the step() that ends a window), where no gradient is half accumulated");
    mods_.expect_idle(what);
  }

  // The sub-groups of ZeRO++, each with its own counters (CommStats) beside the data-parallel
  // group's, else null: hpZ's node (the gathers after a module's first), qgZ's node (its first
  // hop) and qgZ's group across nodes (its second hop: the only bytes that cross nodes).
  Collective<B>* hpz_group() noexcept { return hpz_node_ ? &*hpz_node_ : nullptr; }
  Collective<B>* qgz_node_group() noexcept { return qgz_node_ ? &*qgz_node_ : nullptr; }
  Collective<B>* qgz_cross_group() noexcept { return qgz_peers_ ? &*qgz_peers_ : nullptr; }

  // Stage 3: the live-parameter cap in elements (0 for other stages).
  std::size_t max_live_params() const noexcept { return params_ ? params_->max_live_params() : 0; }
  // Stage 3: whether module m stays gathered from its forward guard to its backward guard
  // (EngineConfig's reshard_after_forward and max_reuse_distance); false for other stages.
  bool keeps_after_forward(int m) const { return params_ && params_->keeps_after_forward(m); }

  // What the engine checked its ranks had room for before it allocated (expect_memory), by
  // space: the model states, the buckets' first slots, stage 3's least working set (every
  // persistent module and the most the first forward gathers at once in the layout's order,
  // prefetch included; hpZ's secondary shards).
  MemoryPlan memory_plan() const { return plan(part_.layout()); }

  // What an engine of this type would check and allocate per rank (memory_plan()) for `model`
  // on `ranks` data-parallel ranks with `config`, with no communicator and nothing allocated:
  // to size a job before starting it (DeepSpeed's estimate_zero*_model_states_mem_needs). Its
  // qgZ scratch takes ranks_per_node 0 as one node (the backend's layout is not known here). On
  // a grid: `model` is one TP x PP part, `ranks` the DP ranks, `tp` the grid's TP ranks.
  template <Model<T> M>
  static MemoryPlan estimate_memory(M& model, int ranks, const EngineConfig& config, int tp = 1) {
    ZP_EXPECT(ranks >= 1 && tp >= 1, "engine: estimate_memory for ", ranks, " ranks and tp ", tp,
              "; expected at least 1 of each");
    check_config(config, Opt{}, ranks);
    const int zero = config.shard_group_size > 0 ? config.shard_group_size : ranks;
    const BatchConfig batch = resolve_batch(config.batch, ranks);
    const GradPrecision p =
        GradPrecision::resolve(dtype_of<T>, Stage, config.grad_accum_dtype,
                               config.communication_dtype, batch.gradient_accumulation_steps);
    return plan(Layout(describe_parameters<T>(model), zero, layout_options(config, sizeof(T), tp)),
                config, p, zero);
  }

  // This rank's bytes by category, with the stage 3 gathered working set (now and peak).
  MemoryReport memory() const {
    MemoryReport r = part_.memory();
    r.buckets = buckets_.scratch_bytes();
    if constexpr (Stage == 3) params_->account(r);
    return r;
  }

  // The communicator's counters over the last optimizer step (from the previous accumulation
  // boundary to the last one: every micro-step's reductions, gathers and the statistics).
  const CommStats& last_step_comm() const noexcept { return last_; }

  // The parameters (T), fp32 master weights or optimizer state array k (AdamW: 0 = m, 1 = v) of
  // the whole model, unpadded, in forward order (whole_model.hpp). Collective for sharded buffers.
  std::vector<T> gather_params() {
    rethrow_pending();  // an engine whose state is half written has no model to give
    return gather_whole<Field::param>(*comm_, part_);
  }
  std::vector<float> gather_master() {
    rethrow_pending();
    return gather_whole<Field::master>(*comm_, part_);
  }
  std::vector<float> gather_state(int k) {
    rethrow_pending();
    ZP_EXPECT(k >= 0 && k < part_.state_slots(), "engine: gather_state(", k,
              "): the optimizer has state arrays [0, ", part_.state_slots(), ")");
    return gather_whole<Field::state>(*comm_, part_, k);
  }

 private:
  friend ModuleGuard;

  // An optional NvmeOptions as the partition takes it (null: not on NVMe).
  static const NvmeOptions* nvme(const std::optional<NvmeOptions>& o) noexcept {
    return o ? &*o : nullptr;
  }
  // c with qgZ's nodes resolved: where not given, the backend's own layout (mpi: its
  // shared-memory split, or ZP_RANKS_PER_NODE), which every rank of the group found alike; a
  // shard group inside a node is one node.
  static EngineConfig with_nodes(EngineConfig c, Collective<B>& comm,
                                 const std::optional<Collective<B>>& shard) {
    if constexpr (requires { comm.backend().node_layout(); })
      if (c.ranks_per_node == 0) {
        const int per_node = comm.backend().node_layout().per_node;
        c.ranks_per_node = shard ? std::gcd(per_node, shard->size()) : per_node;
      }
    return c;
  }
  // What a rank of a `zero`-rank ZeRO group (the shard group) with config c and precision p
  // allocates for layout L, by space: the partition's model states, the buckets' first slots
  // (and qgZ's scratch) and stage 3's least working set.
  static MemoryPlan plan(const Layout& L, const EngineConfig& c, const GradPrecision& p, int zero) {
    MemoryPlan m =
        Part::memory_plan(L, optim::state_slots<Opt>, p.f32_buffer(Stage), c.offload_optimizer,
                          nvme(c.optimizer_nvme), nvme(c.param_nvme), c.offload_param);
    MemoryReport& in_s = S == MemorySpace::host ? m.host : m.device;
    in_s.buckets =
        GradBuckets<T, B, S>::first_scratch_bytes(L, reduction_of(Stage), c.bucket_slots, p);
    const int node = c.ranks_per_node > 0 ? c.ranks_per_node : zero;  // qgZ's
    if (c.quantized_gradients && Stage >= 2 && node > 0)
      in_s.buckets += GradBuckets<T, B, S>::quantized_scratch_bytes(L, zero, zero / node,
                                                                    *c.quantized_gradients);
    if constexpr (Stage == 3) {
      const MemoryReport least = ParamCoordinator<T, B>::least_working_set(
          L, c.persist_threshold, std::size_t(c.hpz_partition_size), c.prefetch, c.max_live_params,
          c.reshard_after_forward ? c.max_reuse_distance : SIZE_MAX, c.param_nvme.has_value());
      in_s.gathered = least.gathered;
      in_s.persistent = least.persistent;
      in_s.secondary = least.secondary;
    }
    return m;
  }
  MemoryPlan plan(const Layout& L) const { return plan(L, config_, precision_, comm_->size()); }
  // L, once the ranks (and `peers`) have found room for plan(L) (expect_memory): collective,
  // before any rank allocates it.
  Layout with_room(Layout L, MemoryPeers peers) {
    if constexpr (S == MemorySpace::device) {
      const DeviceRoom device = Allocator<S>::room();
      expect_memory(*dp_, plan(L), &device, peers);
    } else {
      expect_memory(*dp_, plan(L), nullptr, peers);
    }
    return L;
  }

  void rethrow_pending() {
    ZP_EXPECT(broken_.empty(), "engine: unusable since ", broken_,
              "; destroy it (and build a new one from a checkpoint or the model) to go on");
    if (pending_) std::rethrow_exception(std::exchange(pending_, nullptr));
  }

  // The settings' own checks (the constructor runs them agreed on by every rank, before anything
  // is laid out or allocated; estimate_memory too).
  static void check_settings(const EngineConfig& c, const Opt& opt) {
    c.check();
    ZP_EXPECT(c.hpz_partition_size == 1 || Stage == 3,
              "engine: a secondary partition (zero_hpz_partition_size ", c.hpz_partition_size,
              ") needs ZeRO stage 3 (below it no parameters are gathered), got stage ", Stage);
    ZP_EXPECT(!c.quantized_gradients || Stage >= 2,
              "engine: quantized gradients (zero_quantized_gradients) need ZeRO stage 2 or 3 (a "
              "reduce_scatter to quantize), got stage ",
              Stage);
    ZP_EXPECT(c.reshard_after_forward || Stage == 3,
              "engine: keeping parameters gathered after forward (reshard_after_forward = false) "
              "needs ZeRO stage 3 (below it no parameters are gathered), got stage ",
              Stage);
    ZP_EXPECT(!c.quantized_weights || Stage == 3,
              "engine: quantized weight gathers (zero_quantized_weights) need ZeRO stage 3 (below "
              "it no parameters are gathered), got stage ",
              Stage);
    ZP_EXPECT((!c.offload_param && !c.param_nvme) || Stage == 3,
              "engine: parameters offloaded (offload_param: ", c.param_nvme ? "nvme" : "cpu",
              ") need ZeRO stage 3 (each rank keeps only its shard of them), got stage ", Stage);
    (void)GradPrecision::resolve(dtype_of<T>, Stage, c.grad_accum_dtype, c.communication_dtype, 1);
    // On a device the swapped shard is stepped by the CPU, so the master weights and state must
    // be in host memory too.
    ZP_EXPECT(!c.param_nvme || S == MemorySpace::host || c.offload_optimizer || c.optimizer_nvme,
              "engine: parameters on NVMe (offload_param: nvme) on a device backend need the "
              "optimizer offloaded too (offload_optimizer: cpu or nvme): the CPU steps the "
              "swapped shard");
    optim::validate(opt);
  }
  // ZeRO++ on a tensor-parallel grid keeps the replicated parameters alike only if every TP rank
  // quantizes them alike: the same formats and, with the segments cut by kind (layout.hpp), the
  // same replicated segments, pieces and qgZ nodes. Not so where a split parameter is whole on
  // some TP ranks (so replicated) and left out on others (its slice empty), or bucket sizes,
  // align, the shard group or the nodes differ between the TP ranks (each DP group agreeing
  // inside). Compared over each TP group; the verdict agreed over the grid (its DP groups, then
  // the replicas' TP x PP groups: every rank), so every rank names it.
  void expect_quantized_alike(ProcessGrid<B>& grid) {
    const Layout& L = part_.layout();
    detail::Fnv1a h;
    h.all(quantization_fingerprint(config_), L.options().by_tp_kind);
    if (L.options().by_tp_kind) {
      h.all(comm_->size(), config_.quantized_gradients ? config_.ranks_per_node : 0);
      for (const auto& g : L.segments()) {
        if (bound_.params[std::size_t(g.params.front())].tp != TensorParallel::replicated) continue;
        h.all(g.used, g.size, g.piece);
        for (int p : g.params) {
          const auto& lp = L.params()[std::size_t(p)];
          h.all(std::string_view(lp.name), lp.size, lp.offset - g.offset);
        }
      }
    }
    const bool mine = !same_on_every_rank(grid.tp(), h.value());
    std::int64_t differ = mine;
    all_reduce_host(grid.dp(), std::span<std::int64_t>(&differ, 1), ReduceOp::max);
    all_reduce_host(grid.model_parallel(), std::span<std::int64_t>(&differ, 1), ReduceOp::max);
    ZP_EXPECT(differ == 0, "engine: ZeRO++'s quantization on a tensor-parallel grid (tp ",
              grid.shape().tp,
              ") needs every TP rank to quantize the replicated parameters alike, and ",
              mine ? "this rank's TP group (world rank " + std::to_string(grid.world_rank()) + ")"
                   : std::string("another rank's TP group"),
              " differs: in the quantization settings, or in how its ranks lay out the "
              "replicated parameters (the same replicated parameters in each module, and the "
              "same bucket_bytes, first_bucket_bytes, align, shard_group_size and, with qgZ, "
              "ranks_per_node, on every TP rank); else they would drift apart");
  }
  // check_config over the data-parallel group `comm` and, on a grid, the model-parallel one `mp`:
  // a setting refused on any rank is an error on every rank of the grid, naming the value there
  // (raised on the job's every rank at once, an MPI job ends with it, not an abort).
  static const EngineConfig& checked(Collective<B>& comm, Collective<B>* mp, const EngineConfig& c,
                                     const Opt& opt) {
    detail::on_every_rank_of({&comm, mp}, [&] { check_config(c, opt, comm.size()); });
    return c;
  }
  // What the settings c need of `ranks` data-parallel ranks, and of each other: the groups
  // (shard group, hpZ's and qgZ's nodes given) must divide them, the loss scale must unscale.
  static void check_config(const EngineConfig& c, const Opt& opt, int ranks) {
    check_settings(c, opt);
    check_shard_group(c.shard_group_size, ranks);
    const int zero = c.shard_group_size > 0 ? c.shard_group_size : ranks;
    if (c.hpz_partition_size > 1)
      check_nodes(c.hpz_partition_size, "hpz_partition_size", zero, zero != ranks);
    if (c.quantized_gradients && c.ranks_per_node > 0)
      check_nodes(c.ranks_per_node, "ranks_per_node", zero, zero != ranks);
    check_unscale(c.loss_scaler.scale(), resolve_batch(c.batch, ranks).gradient_accumulation_steps);
  }
  // The gradients are unscaled by the loss scale times the accumulation steps, in fp32.
  static void check_unscale(double scale, std::int64_t gas) {
    ZP_EXPECT(scale * double(gas) <= std::numeric_limits<float>::max(), "engine: the loss scale ",
              scale, " x gradient_accumulation_steps ", gas,
              " is past fp32's range: the gradients cannot be unscaled; use a smaller scale");
  }

  // A shard group of `size` >= 0 ranks out of `dp` (0: all of them).
  static void check_shard_group(int size, int dp) {
    ZP_EXPECT(size == 0 || Stage >= 1, "engine: hybrid sharding (shard_group_size ", size,
              ") needs ZeRO stage 1, 2 or 3 (stage 0 shards nothing), got stage ", Stage);
    ZP_EXPECT(size == 0 || dp % size == 0, "engine: shard_group_size ", size,
              " does not divide the ", dp, " data-parallel ranks");
  }
  // ZeRO++'s nodes of h ranks (`what` names the setting) in the `zero` ranks ZeRO shards over.
  static void check_nodes(int h, const char* what, int zero, bool shard_group) {
    ZP_EXPECT(h >= 1 && zero % h == 0, "engine: ", what, " ", h, " does not divide the ", zero,
              shard_group ? " ranks of the shard group" : " data-parallel ranks");
  }

  // Hybrid sharding's groups of the data-parallel group dp: a shard group (shard_group_size
  // consecutive ranks) or the replicas (the ranks of this one's index in every shard group);
  // none where the size is 0 or the whole group. Every rank first learns every rank's size, so
  // a difference is an error on all of them, not a split that some ranks never join.
  static std::optional<Collective<B>> hybrid_group(Collective<B>& dp, int size, bool shards) {
    if (shards) {
      const std::int64_t mine = size;
      const Spread s = spread(dp, std::span<const std::int64_t>(&mine, 1))[0];
      ZP_EXPECT(s.same(), "engine: the ranks' shard_group_size differ (from ", s.lo, " to ", s.hi,
                "; rank ", dp.rank(), " has ", size,
                "); every rank must build the same model with the same zp configuration");
      check_shard_group(size, dp.size());
    }
    if (size == 0 || size == dp.size()) return std::nullopt;
    return shards ? dp.split(dp.rank() / size, dp.rank() % size)
                  : dp.split(dp.rank() % size, dp.rank() / size);
  }

  // "optimizer step k (micro-step j)", for messages.
  std::string where() const {
    return detail::cat("optimizer step ", step_ + 1, " (micro-step ", micro_ + 1, " of ",
                       batch_.gradient_accumulation_steps, ")");
  }

  // Runs communication, naming the engine call and the step in any error it raises (keeping
  // the category): a rank that skipped step() or ran other guards shows up as mismatched or
  // aborted collectives, which alone do not say which engine call diverged.
  template <class F>
  void in_context(const char* call, F&& f) {
    detail::with_context(f, [&](const std::string& m) {
      return detail::cat(
          "engine: ", call, " at ", where(), " on rank ", dp_->rank(), ": ", m,
          " (every rank must run the same guards and call step() after every micro-step)");
    });
  }
  // A guard's start (m already checked): stage 3 gathers module m (waiting for its prefetch) and
  // prefetches the module expected next (param_coordinator.hpp: the last micro-step's order).
  // A failure here (a collective, a swap file's read, the live-parameter cap, which may have
  // released modules) leaves the gathers half done: the engine unusable.
  void enter(int m, bool backward) {
    if constexpr (Stage == 3) {
      const char* call = backward ? "backward()" : "forward()";
      try {
        in_context(call, [&] {
          timer_.add_gather_wait(params_->use(m, backward));
          params_->prefetch(config_.prefetch);
        });
      } catch (const std::exception& e) {
        mark_unusable(detail::cat("the gathers of ", call, " for module ", m, " failed (",
                                  detail::message_of(e), ")"));
        throw;
      }
    }
  }

  // A guard ended (ModuleGuard): errors wait for the engine's next call.
  void guard_ended(int m, bool backward, bool by_exception) noexcept {
    try {
      exit_module(m, backward, by_exception);
    } catch (...) {
      if (!pending_) pending_ = std::current_exception();
    }
  }

  void exit_module(int m, bool backward, bool by_exception) {
    const Layout& L = part_.layout();
    const auto& mod = L.module(m);
    mods_.closed(m, backward);
    // The guard's own work (releasing a gather, launching its buckets, which waits for the
    // peers' launch on mpi) is the guard's phase, whatever way this returns.
    struct Close {
      StepTimer& timer;
      StepTimer::Guard g;
      ~Close() { timer.close(g); }
    } close{timer_, backward ? StepTimer::backward : StepTimer::forward};
    if constexpr (Stage == 3) params_->unuse(m, backward);
    if (backward) {
      if constexpr (!Part::whole(Field::grad))
        for (int s = mod.first_segment; s < mod.end_segment; ++s)
          bind_segment<T>(L, s, bound_.grads, nullptr);
      if (by_exception) {
        mark_unusable(detail::cat("an exception ended the backward guard of module ", m, " in ",
                                  where(), ", so that micro-step's gradients are incomplete"));
        return;
      }
      for (int s = mod.first_segment; s < mod.end_segment; ++s) buckets_.ready(s);
    }
  }

  // ---- step()'s phases ---------------------------------------------------------------------

  // Launches the buckets no guard launched and waits for every reduction of the micro-step.
  void finish_reductions() {
    in_context("step()", [&] {
      buckets_.launch_all();
      const auto first = std::min(buckets_.first_launch(), Clock::now());
      buckets_.finish();
      timer_.reductions(first, Clock::now());
    });
  }

  // The global statistics and the step gate (step_gate.hpp), into stats_; returns the unscale
  // factor. Under tensor parallelism, TP ranks other than 0 leave out their replicated
  // parameters: TP rank 0 counts them (norm and overflow) for the group, whose copies are equal.
  // Under hybrid sharding the first shard group counts the norm, the others' pieces are equal.
  // The unscale factor fits fp32: check_unscale passed the scale at construction and restore(),
  // and a dynamic scale grows only up to 2^64 (times any int64 accumulation count, < 2e38).
  float reduce_statistics() {
    const double unscale =
        double(config_.loss_scaler.scale()) * double(batch_.gradient_accumulation_steps);
    // A hyper-parameter invalid on some ranks only must not leave the others waiting in the
    // all_reduce: the gate makes every rank skip the step, and end_step() throws everywhere.
    invalid_.clear();
    try {
      optim::validate(opt_);
    } catch (const Error& e) {
      invalid_ = e.message();
    }
    stats_.begin(optim::fingerprint(opt_), !invalid_.empty(), buckets_.proposal_fingerprint());
    const int counted = replicas_ && replicas_->rank() > 0 ? 0 : part_.layout().segment_count();
    const auto add = [&]<Field F>() {  // every segment's piece in one call
      using G = typename Part::template elem<F>;
      std::vector<std::span<const G>> grads;
      for (int s = 0; s < counted; ++s) {
        const Owned<G> piece = part_.template owned<F>(s, Extent::piece);
        if (!mp_ || coords_.tp == 0)
          grads.emplace_back(piece.span);
        else
          stats_.select(
              part_.layout(), s, piece.offset, std::span<const G>(piece.span),
              [&](int p) { return bound_.params[std::size_t(p)].tp == TensorParallel::split; },
              grads);
      }
      stats_.add(std::span(std::as_const(grads)), config_.optimizer_options);
    };
    if (precision_.f32_result(Stage))
      add.template operator()<Field::grad_f32>();
    else
      add.template operator()<Field::grad>();
    // Over the DP group (the shard group, then the replicas), then, but for the bucket order's
    // terms, over the replica's TP x PP ranks: every rank of the world ends with the same
    // statistics (each group's are equal, and each later sum runs in one order).
    in_context("step()", [&] {
      comm_->all_reduce(stats_.sums(), ReduceOp::sum);
      if (replicas_) replicas_->all_reduce(stats_.sums(), ReduceOp::sum);
      if (mp_) mp_->all_reduce(stats_.shared_sums(), ReduceOp::sum);
    });
    stats_.decide(double(dp_->size()) * (mp_ ? double(mp_->size()) : 1.0), float(unscale),
                  config_.max_grad_norm);  // exact for powers of two
    return float(unscale);
  }

  // The optimizer update of this rank's shard as the gate says, then stage 1/2's all_gather of
  // the parameters (unchanged ones too, when the step is skipped). Returns the statistics and
  // the gate in host memory: the step's one synchronisation (offloaded, the CPU step reads the
  // gate on the host, so it comes first). A step that applies counts as update step_ + 1.
  std::array<double, stats_slots> update_shards() {
    // The shards change (or not): gathered copies are stale either way, and no gather may still
    // read a shard.
    if constexpr (Stage == 3) params_->release_all();
    std::array<double, stats_slots> host{};
    const bool read = part_.offloaded();
    if (read) host = stats_.read();
    const double* gate = read ? host.data() + statistics_count : stats_.gate();
    const optim::StepScalars scalars{step_ + 1, 1.0f};
    const auto& o = config_.optimizer_options;
    const auto update = [&] {
      if (!invalid_.empty()) return;  // the gate skips the step: nothing to validate again
      if (precision_.f32_result(Stage))
        apply_update<true>(part_, opt_, scalars, o, gate, offload_, decays_);
      else
        apply_update<false>(part_, opt_, scalars, o, gate, offload_, decays_);
    };
    // On NVMe an I/O failure, and on a device ZeRO-Offload's copies and page-locked staging, may
    // fail on one rank and leave its shard half updated: every rank stops.
    const bool nvme = part_.swap() || part_.param_swap();
    if (!nvme && (S == MemorySpace::host || !read)) {
      update();
    } else {
      try {
        in_context("step()", [&] { on_every_grid_rank(*this, update, stats_.word()); });
      } catch (const std::exception& e) {  // a std::bad_alloc too: the shard is half updated
        mark_unusable(detail::cat("the optimizer step ", nvme ? "on NVMe" : "offloaded to the CPU",
                                  " failed (", detail::message_of(e), ")"));
        throw;
      }
    }
    timer_.phase(&StepTimes::optimizer);
    if constexpr (Part::whole(Field::param) &&
                  !Part::whole(Field::master)) {  // pieces updated, all kept
      in_context("step()", [&] {
        std::vector<Work> works;
        works.reserve(std::size_t(part_.layout().segment_count()));
        for (int s = 0; s < part_.layout().segment_count(); ++s)
          works.push_back(
              comm_->all_gather_async(part_.template owned<Field::param>(s, Extent::kept).span));
        for (auto& w : works) w.wait();
      });
      timer_.phase(&StepTimes::gather);
    }
    if (!read) host = stats_.read();
    return host;
  }

  // The outcome on the host: the loss scaler, the counters, the result, the next window.
  StepResult end_step(const std::array<double, stats_slots>& host, float unscale) {
    // First, before any rank may throw: every rank of the DP group decides alike.
    if (stats_.same_order(host, double(dp_->size()))) buckets_.follow_proposal();
    const double gate = host[statistics_count + 1];
    if (!invalid_.empty())
      throw Error(Errc::invalid_argument,
                  detail::cat(invalid_, " (at ", where(), "; the step was skipped on every rank)"));
    ZP_EXPECT(gate != detail::StepGate::differ,
              "engine: the optimizer's hyper-parameters differ between ranks at ", where(),
              " (rank ", dp_->rank(), " has ", optim::describe(opt_),
              "; a rank whose values are invalid names them); every rank must set them "
              "identically, e.g. from the same schedule (the step was skipped everywhere)");
    StepResult r;
    r.boundary = true;
    r.overflow = gate == detail::StepGate::overflow;
    r.grad_norm = std::sqrt(StepStatistics<S>::norm2(host)) / double(unscale);
    r.applied = config_.loss_scaler.update(r.overflow);
    r.loss_scale = config_.loss_scaler.scale();
    if (r.applied) ++step_;
    r.step = step_;
    const CommStats now = comm_->stats();
    for (std::size_t i = 0; i < coll_op_count; ++i) (last_.ops[i] = now.ops[i]) -= mark_.ops[i];
    mark_ = now;
    begin_window();
    timer_.phase(&StepTimes::optimizer);
    r.times = timer_.end_window();
    if (config_.wall_clock_breakdown && dp_->rank() == 0 && step_ % config_.steps_per_print == 0 &&
        r.applied)
      std::printf("zp: step %lld: %s\n", static_cast<long long>(step_), r.times.describe().c_str());
    return r;
  }

  // The next accumulation window starts from zero gradients.
  void begin_window() {
    if constexpr (Part::whole(Field::grad)) {
      Memory<S>::zero(part_.template buffer<Field::grad>());
      Memory<S>::zero(part_.template buffer<Field::grad_f32>());
    }
    buckets_.begin_micro_step(batch_.gradient_accumulation_steps == 1, true);
  }

  // Hybrid sharding: this rank's shard group and its replicas, else none (declared first: the
  // partition is laid out over the shard group).
  std::optional<Collective<B>> shard_, replicas_;
  Collective<B>* dp_;            // the data-parallel group
  Collective<B>* comm_;          // the group ZeRO shards over (shard_, else dp_)
  Collective<B>* mp_ = nullptr;  // the replica's TP x PP group when it has more than one rank
  GridShape grid_{comm_->size(), 1, 1};
  GridCoords coords_{comm_->rank(), 0, 0};
  EngineConfig config_;
  BatchConfig batch_;
  Opt opt_;
  BoundParameters<T> bound_;  // the model's parameter list and views
  GradPrecision precision_;
  Part part_;
  GradBuckets<T, B, S> buckets_;
  ModuleTracker mods_;
  std::optional<Collective<B>> hpz_node_;  // hpZ: this rank's node
  // qgZ: this rank's node, and the ranks of its local index (one a node)
  std::optional<Collective<B>> qgz_node_, qgz_peers_;
  std::optional<ParamCoordinator<T, B>> params_;  // stage 3: gathers, prefetches, releases
  StepStatistics<S> stats_;                       // step()'s all_reduce and gate
  OffloadStaging<S> offload_;  // ZeRO-Offload's host copies (device: pinned, double-buffered)
  std::vector<char> decays_;   // per parameter of the layout: takes weight decay (empty: all)
  std::int64_t micro_ = 0, step_ = 0;
  std::string broken_;   // why the engine refuses further calls ("" while usable)
  std::string invalid_;  // this step's hyper-parameter error on this rank ("" if valid)
  StepTimer timer_;
  CommStats mark_{}, last_{};
  std::exception_ptr pending_;
  std::shared_ptr<Engine*> self_ = std::make_shared<Engine*>(this);  // shared with the guards
};

}  // namespace zp
