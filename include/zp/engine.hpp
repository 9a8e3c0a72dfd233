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
// prefetching the next one); backward(m) also points m's gradient views at bucket memory. When a
// backward guard ends, m's buckets are complete and launch their reductions asynchronously
// (stage 0/1 only at the accumulation boundary). Stage 0/1 work without guards too (all
// reductions then start in step()); stage 2/3 need the backward guards, stage 3 also the forward
// ones. Every rank must run the same sequence of guards and steps (SPMD), as with any collective.
//
// step(), called after every micro-step's backward, at the accumulation boundary: waits for the
// buckets, one all_reduce of two doubles (sum of squared gradient norms and count of non-finite
// shards), unscale + clip + optimizer update of this rank's shard (Ops<S>::step), writes the
// T shard, then stage 1/2 all_gather the parameters (stage 3 gathers lazily in the next forward).
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
//   stage 3: all_gather P twice + reduce_scatter P -> 3(N-1)/N P   (persistent modules gather once)
// plus the 16-byte statistics all_reduce.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
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
#include "zp/optim/cpu.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/param_coordinator.hpp"
#include "zp/partition.hpp"
#include "zp/precision.hpp"
#include "zp/step_timer.hpp"

namespace zp {

namespace detail {
// An optimizer step's decision from its all-reduced statistics, taken where they live
// (Ops::invoke: host and device compute the same bits). s[0..6): the squared norm, the count of
// non-finite pieces, and the sums of the hyper-parameter fingerprint's halves and their squares
// (this rank's halves h0, h1: every rank's iff the sums are `ranks` times them); writes s[6] =
// grad_mul (unscale and clip) and s[7] = apply, overflow, or differ (skip, and the host throws).
// Outside Engine: nvcc takes no private member type as a kernel's template argument.
struct StepGate {
  static constexpr std::size_t statistics = 6;
  static constexpr double apply = 0, overflow = 1, differ = 2;
  double ranks, h0, h1;
  float unscale, max_norm;
  ZP_HOST_DEVICE void operator()(double* s) const {
    const bool same = s[2] == ranks * h0 && s[3] == ranks * h0 * h0 && s[4] == ranks * h1 && s[5] == ranks * h1 * h1;
    const bool finite = s[1] == 0 && s[0] <= 1.7976931348623157e308;  // not inf, not nan
    const float clip = finite ? optim::clip_coef(s[0], unscale, max_norm) : 1.0f;
    s[statistics] = double(optim::grad_mul(unscale, clip));
    s[statistics + 1] = !same ? differ : !finite ? overflow : apply;
  }
};
}  // namespace detail

template <Backend B, class T, int Stage, class Opt = optim::AdamW>
  requires optim::Optimizer<Opt>
class Engine {
  static_assert(Stage >= 0 && Stage <= 3, "ZeRO stage must be 0, 1, 2 or 3");
  static constexpr MemorySpace S = B::memory;
  using Clock = StepTimer::Clock;
  using Work = typename Collective<B>::Work;
  using Mem = Ops<S>;  // every operation on zp's buffers (memory.hpp)

 public:
  static constexpr int stage = Stage;
  static constexpr MemorySpace memory_space = S;  // where the engine's buffers live (the backend's)
  using value_type = T;
  using optimizer_type = Opt;

  // RAII module boundary (see the top of this file). Move-only; errors raised when it ends are
  // rethrown by the engine's next call.
  // A backward guard ended by an exception (unwinding) does not launch its buckets: the module's
  // gradients are incomplete, so the engine refuses every later call but destruction.
  class [[nodiscard]] ModuleGuard {
   public:
    ModuleGuard(ModuleGuard&& o) noexcept
        : e_(std::exchange(o.e_, nullptr)), m_(o.m_), backward_(o.backward_), unwinding_(o.unwinding_) {}
    ModuleGuard& operator=(ModuleGuard&&) = delete;
    ~ModuleGuard() { end(std::uncaught_exceptions() > unwinding_); }
    // Ends the module early (the destructor then does nothing).
    void release() { end(false); }

   private:
    friend class Engine;
    ModuleGuard(Engine* e, int m, bool backward)
        : e_(e), m_(m), backward_(backward), unwinding_(std::uncaught_exceptions()) {}
    void end(bool by_exception) noexcept {
      if (!e_) return;
      Engine* e = std::exchange(e_, nullptr);
      try {
        e->exit_module(m_, backward_, by_exception);
      } catch (...) {
        if (!e->pending_) e->pending_ = std::current_exception();
      }
    }
    Engine* e_;
    int m_;
    bool backward_;
    int unwinding_;
  };

  // Takes over the model's parameters: lays them out, checks the layout is identical on every
  // rank (one all_reduce), copies the initial values (broadcast from rank 0 unless disabled) and
  // rebinds the model's views into zp memory. Collective. The model must not move while the
  // engine lives.
  template <class M>
    requires Model<M, T>
  Engine(Collective<B>& comm, M& model, EngineConfig config = {}, Opt optimizer = {})
      : comm_(&comm),
        config_(std::move(config)),
        batch_(resolve_batch(config_.batch, comm.size())),
        opt_(optimizer),
        bound_(bind_parameters<T>(model)),
        precision_(grad_precision(config_, batch_)),
        part_(make_layout(bound_.params, comm.size(), config_), comm.rank(), optim::state_slots<Opt>,
              Stage < 2 ? precision_.accumulate_f32 || precision_.reduce_f32 : precision_.accumulate_f32,
              config_.offload_optimizer),
        buckets_(comm, part_.layout(), Stage == 0 ? Reduction::all_reduce
                                       : Stage == 1 ? Reduction::scatter_in_place
                                                    : Reduction::scatter_accumulate,
                 Stage < 2 ? part_.grads() : std::span<T>{}, Stage < 2 ? std::span<T>{} : part_.grads(),
                 config_.bucket_slots, precision_, Stage < 2 ? part_.grads_f32() : std::span<float>{},
                 Stage < 2 ? std::span<float>{} : part_.grads_f32()) {
    ZP_EXPECT(config_.prefetch == 0 || config_.prefetch == 1, "engine: prefetch must be 0 or 1, got ",
              config_.prefetch);
    ZP_EXPECT(!std::isnan(config_.max_grad_norm), "engine: max_grad_norm is NaN; use a positive norm to "
              "clip, or 0 for no clipping");
    optim::validate(opt_);
    const Layout& L = part_.layout();
    expect_same_engine_everywhere(*comm_, L, Stage, dtype_of<T>, config_, batch_, precision_, opt_);
    load_initial_values(L);
    mods_.resize(std::size_t(L.module_count()));
    if constexpr (Stage == 3)
      params_.emplace(comm, part_, std::span<View<T>* const>(bound_.values), config_.persist_threshold,
                      config_.max_live_params);
    ZP_EXPECT(config_.steps_per_print >= 1, "engine: steps_per_print must be >= 1, got ", config_.steps_per_print);
    buckets_.begin_micro_step(batch_.gradient_accumulation_steps == 1, true);
    mark_ = comm_->stats();
    timer_ = StepTimer{};  // the first window starts now
  }

  // 3D parallelism (grid.hpp): ZeRO over the grid's DP group; the model holds one TP x PP part
  // of the network (its TP-split parameters marked TensorParallel::split), and the gradient
  // norm, the overflow check and the hyper-parameter check span the whole replica
  // (model_parallel(): the statistics are summed over it too, replicated parameters counted on
  // TP rank 0 only). The grid must outlive the engine. Collective over the world.
  template <class M>
    requires Model<M, T>
  Engine(ProcessGrid<B>& grid, M& model, EngineConfig config = {}, Opt optimizer = {})
      : Engine(grid.dp(), model, std::move(config), optimizer) {
    if (grid.model_parallel().size() > 1) {
      mp_ = &grid.model_parallel();
      tp_rank_ = grid.coords().tp;
    }
  }

  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Completes every reduction and gather still in flight before any memory goes (also while an
  // exception unwinds the training loop), then leaves the model's views pointing at nothing
  // rather than at freed memory.
  ~Engine() {
    buckets_.wait_all_quietly();
    params_.reset();  // waits for gathers in flight
    for (auto* v : bound_.values) v->rebind(nullptr);
    for (auto* g : bound_.grads) g->rebind(nullptr);
  }

  // ---- the training loop ----------------------------------------------------------------------

  ModuleGuard forward(int m) {
    check_module(m);
    const auto t = timer_.stamp();
    enter(m, m + 1);
    timer_.open(StepTimer::forward, t);
    ++mods_[std::size_t(m)].forward_open;
    return ModuleGuard(this, m, false);
  }

  ModuleGuard backward(int m) {
    check_module(m);
    ZP_EXPECT(!mods_[std::size_t(m)].backward_done, "engine: backward(", m, ") entered a second time in ",
              where(), "; each module's backward runs once per micro-step (call step() after every micro-step)");
    const auto t = timer_.stamp();
    enter(m, m - 1);
    mods_[std::size_t(m)].backward_done = true;
    if constexpr (Stage >= 2) {
      const Layout& L = part_.layout();
      const auto& mod = L.module(m);
      for (int s = mod.first_segment; s < mod.end_segment; ++s) {
        std::span<T> mem;
        in_context("backward()", [&] { mem = buckets_.acquire(s); });
        const auto& seg = L.segment(s);
        for (int p : seg.params) bound_.grads[std::size_t(p)]->rebind(mem.data() + (L.params()[std::size_t(p)].offset - seg.offset));
      }
    }
    timer_.open(StepTimer::backward, t);
    ++mods_[std::size_t(m)].backward_open;
    return ModuleGuard(this, m, true);
  }

  // Ends a micro-step (call it after every backward). At the accumulation boundary it runs the
  // optimizer step described at the top of this file. Collective.
  StepResult step() {
    expect_guards_ended();
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
    const float unscale = reduce_statistics();
    timer_.phase(&StepTimes::statistics);
    return end_step(update_shards(), unscale);
  }

  // ---- state and accounting ----------------------------------------------------------------

  // The per-step statistics all_reduce: doubles (squared norm, overflow count, and the four
  // terms of the cross-rank hyper-parameter check), bytes = statistics_count * 8.
  static constexpr std::size_t statistics_count = detail::StepGate::statistics;
  // The statistics buffer: the all-reduced statistics, then the step gate (detail::StepGate).
  static constexpr std::size_t stats_slots = statistics_count + 2;

  // Multiply the loss (the gradient seeding backward) by this.
  float loss_scale() const noexcept { return config_.loss_scaler.scale(); }
  const LossScaler& loss_scaler() const noexcept { return config_.loss_scaler; }
  Opt& optimizer() noexcept { return opt_; }  // e.g. to set the learning rate of a schedule
  const BatchConfig& batch() const noexcept { return batch_; }
  std::int64_t steps() const noexcept { return step_; }
  const Layout& layout() const noexcept { return part_.layout(); }
  const Partitioned<T, Stage, S>& partition() const noexcept { return part_; }
  Collective<B>& comm() noexcept { return *comm_; }  // the data-parallel group
  // The replica's TP x PP group (engines built from a grid with tp * pp > 1), else null.
  Collective<B>* model_parallel() noexcept { return mp_; }
  // Where training stands: what a checkpoint (checkpoint.hpp) saves besides the buffers.
  struct Progress {
    std::int64_t step = 0;        // optimizer updates applied
    std::int64_t micro_step = 0;  // micro-steps done in the current accumulation window
    LossScaler::State scaler{};
  };
  Progress progress() const noexcept { return {step_, micro_, config_.loss_scaler.state()}; }
  // Continues from `p` (after a checkpoint's buffers were written into partition()); stage 3's
  // gathered copies are dropped, they would be stale. Only at an accumulation boundary.
  void restore(const Progress& p) {
    expect_at_boundary("restore()");
    ZP_EXPECT(p.step >= 0 && p.micro_step == 0, "engine: restore(): progress must be at an accumulation "
              "boundary with step >= 0, got step ", p.step, ", micro-step ", p.micro_step);
    config_.loss_scaler.load(p.scaler);
    step_ = p.step;
    if constexpr (Stage == 3) params_->release_all();
  }
  // Throws unless the engine is usable, at an accumulation boundary and outside every guard:
  // the only moment its buffers hold a complete training state.
  void expect_at_boundary(const char* what) {
    rethrow_pending();
    ZP_EXPECT(micro_ == 0, "engine: ", what, " in ", where(), "; only at an accumulation boundary (after the "
              "step() that ends a window), where no gradient is half accumulated");
    for (int m = 0; m < part_.layout().module_count(); ++m) {
      const ModuleState& st = mods_[std::size_t(m)];
      ZP_EXPECT(st.in_use() == 0 && !st.backward_done, "engine: ", what, " while module ", m,
                " is inside a guard or has run backward without step()");
    }
  }

  // Stage 3: the live-parameter cap in elements (0 for other stages).
  std::size_t max_live_params() const noexcept {
    if constexpr (Stage == 3) return params_->max_live_params();
    else return 0;
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

  // The parameters (T) or fp32 master weights of the whole model, unpadded, in forward order
  // (the concatenation of the parameters as visited). Collective for sharded buffers.
  std::vector<T> gather_params() {
    if constexpr (Stage < 3) return extract<T>(part_.params());
    else return extract<T>(gather_pieces<T>([&](int s) { return part_.param_piece(s); }).span());
  }
  std::vector<float> gather_master() {
    return gather_fp32(part_.master(), [&](int s) { return part_.master_piece(s); });
  }
  // Optimizer state array k (AdamW: 0 = m, 1 = v) of the whole model, like gather_master().
  std::vector<float> gather_state(int k) {
    return gather_fp32(part_.state(k), [&](int s) { return part_.state_piece(k, s); });
  }

 private:
  struct ModuleState {
    int forward_open = 0, backward_open = 0;  // guards of this module not ended yet
    bool backward_done = false;               // backward(m) ran in this micro-step
    int in_use() const noexcept { return forward_open + backward_open; }
  };

  static Layout make_layout(const std::vector<ParamInfo>& params, int ranks, const EngineConfig& c) {
    LayoutOptions o;
    o.bucket_elems = std::max<std::size_t>(1, c.bucket_bytes / sizeof(T));
    o.first_bucket_elems = std::max<std::size_t>(1, c.first_bucket_bytes / sizeof(T));
    o.align = c.align;
    return Layout(params, ranks, o);
  }

  void rethrow_pending() {
    ZP_EXPECT(broken_.empty(), "engine: unusable since ", broken_,
              "; destroy it (and build a new one from a checkpoint or the model) to go on");
    if (pending_) std::rethrow_exception(std::exchange(pending_, nullptr));
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
    try {
      f();
    } catch (const Error& e) {
      throw Error(e.category(),
                  detail::cat("engine: ", call, " at ", where(), " on rank ", comm_->rank(), ": ", e.message(),
                              " (every rank must run the same guards and call step() after every micro-step)"),
                  e.native_code());
    }
  }
  // A guard's start (m already checked): stage 3 gathers module m (waiting for its prefetch) and
  // prefetches the module that runs next (m + 1 in forward, m - 1 in backward).
  void enter(int m, int next) {
    if constexpr (Stage == 3) {
      in_context(next > m ? "forward()" : "backward()", [&] {
        timer_.add_gather_wait(params_->use(m));
        if (config_.prefetch) params_->prefetch(next);
      });
    }
  }

  void check_module(int m) {
    rethrow_pending();
    ZP_EXPECT(m >= 0 && m < part_.layout().module_count(), "engine: module ", m, " is not in [0, ",
              part_.layout().module_count(), ")");
  }

  void load_initial_values(const Layout& L) {
    Buffer<T, S> init(L.total(), "engine: initial parameter values");
    Mem::zero(init.span());
    const auto& ps = L.params();
    for (std::size_t p = 0; p < ps.size(); ++p) {
      View<T>& v = *bound_.values[p];
      if (v.bound()) {
        Mem::from_host(init.span(ps[p].offset, ps[p].size), std::span<const T>(v.span()));  // the model's own memory
      } else {
        ZP_EXPECT(config_.broadcast_initial_params && comm_->rank() != 0, "engine: parameter '", ps[p].name,
                  "' has no initial values on rank ", comm_->rank(),
                  " (its value view is unbound); point it at the model's initial weights");
      }
    }
    if (config_.broadcast_initial_params && comm_->size() > 1) comm_->broadcast(init.span(), 0);
    for (int s = 0; s < L.segment_count(); ++s) {
      const auto& g = L.segment(s);
      const std::size_t mine = g.offset + std::size_t(comm_->rank()) * g.piece;
      if constexpr (Stage < 3)
        Mem::copy(part_.param_segment(s), std::span<const T>(init.span(g.offset, g.size)));
      else
        Mem::copy(part_.param_piece(s), std::span<const T>(init.span(mine, g.piece)));
      const std::span<const T> from = Stage < 1 ? init.span(g.offset, g.size) : init.span(mine, g.piece);
      const std::span<float> master = Stage < 1 ? part_.master_segment(s) : part_.master_piece(s);
      if (!part_.offloaded()) {
        Mem::convert(master, from);
      } else {  // the master weights are on the host
        std::vector<T> staged;
        Ops<MemorySpace::host>::convert(master, host_view<S>(from, false, staged));
      }
    }
    for (std::size_t p = 0; p < ps.size(); ++p) {
      bound_.values[p]->rebind(Stage < 3 ? part_.params().data() + ps[p].offset : nullptr);
      bound_.grads[p]->rebind(Stage < 2 ? part_.grads().data() + ps[p].offset : nullptr);
    }
  }

  // Where the optimizer reads the averaged gradient: fp32 when it was reduced (stage 0/1) or
  // accumulated (stage 2/3) in fp32, else T.
  bool f32_grads() const noexcept { return Stage < 2 ? precision_.reduce_f32 : precision_.accumulate_f32; }

  static GradPrecision grad_precision(const EngineConfig& c, const BatchConfig& b) {
    constexpr DType t = dtype_of<T>;
    const DType acc = c.grad_accum_dtype.value_or(t == DType::bf16 && Stage == 0 ? DType::f32 : t);
    const DType red = c.communication_dtype.value_or(t);
    ZP_EXPECT(acc == t || acc == DType::f32, "engine: grad_accum_dtype must be f32 or the model's ", name(t),
              ", got ", name(acc));
    ZP_EXPECT(red == t || red == DType::f32, "engine: communication_dtype must be f32 or the model's ", name(t),
              ", got ", name(red));
    return {t != DType::f32 && acc == DType::f32 && b.gradient_accumulation_steps > 1,
            t != DType::f32 && red == DType::f32};
  }

  // The optimizer's view of shard s; F32: the gradient from the fp32 gradient buffer.
  template <bool F32>
  optim::ShardView<T, std::conditional_t<F32, float, T>> shard_view(int s) const {
    optim::ShardView<T, std::conditional_t<F32, float, T>> v;
    auto grad = [&](auto t32, auto t) {
      if constexpr (F32) return t32;
      else return t;
    };
    if constexpr (Stage == 0) {  // replicated: every rank updates the whole segment
      v.master = part_.master_segment(s);
      v.grad = grad(part_.grad_f32_segment(s), part_.grad_segment(s));
      v.param = part_.param_segment(s);
      for (int k = 0; k < part_.state_slots(); ++k) v.state[std::size_t(k)] = part_.state_segment(k, s);
    } else {
      v.master = part_.master_piece(s);
      v.grad = grad(part_.grad_f32_piece(s), part_.grad_piece(s));
      v.param = part_.param_piece(s);
      for (int k = 0; k < part_.state_slots(); ++k) v.state[std::size_t(k)] = part_.state_piece(k, s);
    }
    return v;
  }

  void exit_module(int m, bool backward, bool by_exception) {
    const Layout& L = part_.layout();
    const auto& mod = L.module(m);
    ModuleState& st = mods_[std::size_t(m)];
    --(backward ? st.backward_open : st.forward_open);
    timer_.close(backward ? StepTimer::backward : StepTimer::forward);
    if constexpr (Stage == 3) params_->unuse(m);
    if (backward) {
      if constexpr (Stage >= 2)
        for (int s = mod.first_segment; s < mod.end_segment; ++s)
          for (int p : L.segment(s).params) bound_.grads[std::size_t(p)]->rebind(nullptr);
      if (by_exception) {
        if (broken_.empty())
          broken_ = detail::cat("an exception ended the backward guard of module ", m, " in ", where(),
                                ", so that micro-step's gradients are incomplete");
        return;
      }
      for (int s = mod.first_segment; s < mod.end_segment; ++s) buckets_.ready(s);
    }
  }

  // ---- step()'s phases ---------------------------------------------------------------------

  // Every guard has ended; backward may run again in the next micro-step.
  void expect_guards_ended() {
    rethrow_pending();
    for (int m = 0; m < part_.layout().module_count(); ++m) {
      const ModuleState& st = mods_[std::size_t(m)];
      ZP_EXPECT(st.forward_open == 0 && st.backward_open == 0, "engine: step() called in ", where(),
                " while the ", st.backward_open ? "backward" : "forward", " guard of module ", m,
                " is still open; end every guard (let it leave its scope, or call release()) before step()");
    }
    for (auto& st : mods_) st.backward_done = false;
  }

  // Launches the buckets no guard launched and waits for every reduction of the micro-step.
  void finish_reductions() {
    in_context("step()", [&] {
      buckets_.launch_all();
      const auto first = std::min(buckets_.first_launch(), Clock::now());
      buckets_.finish();
      timer_.reductions(first, Clock::now());
    });
  }

  // The global statistics and the step gate, into stats_; returns the unscale factor.
  // Each rank sums over its own pieces, so the norm is computed once overall. The same
  // all_reduce checks that every rank runs this step with the same optimizer hyper-parameters
  // (a rank whose lr differs would update its shard differently): the 32-bit fingerprint, as
  // two 16-bit halves h, is summed with h^2, exactly in double; the ranks agree iff sum(h) = N h
  // and sum(h^2) = N h^2 on every rank (the variance is then zero), and when they do not, every
  // rank sees it. The statistics live where the gradients do, and so does the decision they
  // lead to (detail::StepGate: skip on overflow or differing hyper-parameters, else unscale and
  // clip), so a device runs the whole step, gathers included, without the host.
  float reduce_statistics() {
    optim::validate(opt_);
    const std::uint64_t fp = optim::fingerprint(opt_);
    const double h0 = double(fp & 0xffffu), h1 = double((fp >> 16) & 0xffffu);
    const double n = double(comm_->size()) * (mp_ ? double(mp_->size()) : 1.0);
    const float unscale = float(double(config_.loss_scaler.scale()) *
                                double(batch_.gradient_accumulation_steps));  // exact for powers of two
    const double init[stats_slots] = {0.0, 0.0, h0, h0 * h0, h1, h1 * h1, 0.0, 0.0};
    Mem::from_host(stats_.span(), std::span<const double>(init));
    for (int s = 0; s < part_.layout().segment_count(); ++s) {
      if (f32_grads()) add_piece_stats(s, std::span<const float>(part_.grad_f32_piece(s)));
      else add_piece_stats(s, std::span<const T>(part_.grad_piece(s)));
    }
    // Over the DP group, then over the replica's TP x PP ranks: every rank of the world ends
    // with the same sums (each DP group's are equal, and the second sum runs in one order).
    in_context("step()", [&] {
      comm_->all_reduce(stats_.span(0, statistics_count), ReduceOp::sum);
      if (mp_) mp_->all_reduce(stats_.span(0, statistics_count), ReduceOp::sum);
    });
    Mem::invoke(detail::StepGate{n, h0, h1, unscale, config_.max_grad_norm}, stats_.data());
    return unscale;
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
    if (read) Mem::to_host(std::span<double>(host), std::span<const double>(stats_.span()));
    const double* gate = (read ? host.data() : stats_.data()) + statistics_count;
    const optim::StepScalars scalars{step_ + 1, 1.0f};
    if (f32_grads()) update<true>(scalars, gate);
    else update<false>(scalars, gate);
    timer_.phase(&StepTimes::optimizer);
    if constexpr (Stage == 1 || Stage == 2) {
      in_context("step()", [&] {
        std::vector<Work> works;
        works.reserve(std::size_t(part_.layout().segment_count()));
        for (int s = 0; s < part_.layout().segment_count(); ++s)
          works.push_back(comm_->all_gather_async(part_.param_segment(s)));
        for (auto& w : works) w.wait();
      });
      timer_.phase(&StepTimes::gather);
    }
    if (!read) Mem::to_host(std::span<double>(host), std::span<const double>(stats_.span()));
    return host;
  }

  // The outcome on the host: the loss scaler, the counters, the result, the next window.
  StepResult end_step(const std::array<double, stats_slots>& host, float unscale) {
    const double gate = host[statistics_count + 1];
    ZP_EXPECT(gate != detail::StepGate::differ, "engine: the optimizer's hyper-parameters differ between ranks at ",
              where(), " (rank ", comm_->rank(), " has ", optim::describe(opt_), "); every rank must set them "
              "identically, e.g. from the same schedule (the step was skipped everywhere)");
    StepResult r;
    r.boundary = true;
    r.overflow = gate == detail::StepGate::overflow;
    r.grad_norm = std::sqrt(host[0]) / double(unscale);
    r.applied = config_.loss_scaler.update(r.overflow);
    r.loss_scale = config_.loss_scaler.scale();
    if (r.applied) ++step_;
    r.step = step_;
    if constexpr (Stage < 2) {
      Mem::zero(part_.grads());
      Mem::zero(part_.grads_f32());
    }
    const CommStats now = comm_->stats();
    for (std::size_t i = 0; i < coll_op_count; ++i) (last_.ops[i] = now.ops[i]) -= mark_.ops[i];
    mark_ = now;
    buckets_.begin_micro_step(batch_.gradient_accumulation_steps == 1, true);
    timer_.phase(&StepTimes::optimizer);
    r.times = timer_.end_window();
    if (config_.wall_clock_breakdown && comm_->rank() == 0 && step_ % config_.steps_per_print == 0 && r.applied)
      std::printf("zp: step %lld: %s\n", static_cast<long long>(step_), r.times.describe().c_str());
    return r;
  }

  // Adds the gradient statistics of this rank's piece of segment s into stats_[0..1]. Under
  // tensor parallelism, TP ranks other than 0 leave out their replicated parameters: TP rank 0
  // counts them (norm and overflow) for the group, whose copies are identical.
  template <class G>
  void add_piece_stats(int s, std::span<const G> piece) {
    if (!mp_ || tp_rank_ == 0) return Mem::grad_stats(piece, stats_.data(), config_.optimizer_options);
    const Layout& L = part_.layout();
    const std::size_t begin = L.piece_offset(s, comm_->rank()), end = begin + piece.size();
    for (int p : L.segment(s).params) {
      const auto& lp = L.params()[std::size_t(p)];
      const std::size_t b = std::max(begin, lp.offset), e = std::min(end, lp.offset + lp.size);
      if (b < e && bound_.params[std::size_t(p)].tp == TensorParallel::split)
        Mem::grad_stats(piece.subspan(b - begin, e - b), stats_.data(), config_.optimizer_options);
    }
  }

  // ---- whole-model views -------------------------------------------------------------------

  // host_pieces: the pieces are in host memory (offloaded fp32 state); a device backend gathers
  // them through a device copy (space_view).
  template <class U, class Piece>
  Buffer<U, S> gather_pieces(Piece&& piece, bool host_pieces = false) {
    const Layout& L = part_.layout();
    Buffer<U, S> full(L.total()), staged;
    for (int s = 0; s < L.segment_count(); ++s) {
      const auto& g = L.segment(s);
      comm_->all_gather(space_view<S>(std::span<const U>(piece(s)), host_pieces, staged), full.span(g.offset, g.size));
    }
    return full;
  }
  // The master weights or a state array, whole model, wherever they live.
  template <class Piece>
  std::vector<float> gather_fp32(std::span<float> whole, Piece&& piece) {
    const bool host = part_.offloaded();
    if constexpr (Stage < 1) return extract<float>(whole, host);
    else return extract<float>(gather_pieces<float>(piece, host).span());
  }

  // The optimizer update of every segment's shard: in the memory space, or, offloaded, by the
  // CPU on host copies of the gradient and the new T values (master and state are on the host).
  // gate: the step gate, in the memory space (host memory when offloaded).
  template <bool F32>
  void update(const optim::StepScalars& scalars, const double* gate) {
    const int segments = part_.layout().segment_count();
    if (!part_.offloaded()) {
      for (int s = 0; s < segments; ++s) Mem::step(opt_, scalars, shard_view<F32>(s), config_.optimizer_options, gate);
      return;
    }
    if (gate[1] != 0) return;
    offload_.run(segments, [&](int s) { return shard_view<F32>(s); }, [&](const auto& v) {
      Ops<MemorySpace::host>::step(opt_, scalars, v, config_.optimizer_options, gate);
    });
  }
  // The parameters' elements of a whole-model buffer (in S, or in host memory when `host`),
  // unpadded, in forward order.
  template <class U>
  std::vector<U> extract(std::span<const U> full, bool host = false) const {
    std::vector<U> staged, out;
    const std::span<const U> h = host_view<S>(full, host, staged);
    out.reserve(part_.layout().used());
    for (const auto& p : part_.layout().params())
      out.insert(out.end(), h.begin() + std::ptrdiff_t(p.offset), h.begin() + std::ptrdiff_t(p.offset + p.size));
    return out;
  }

  Collective<B>* comm_;
  Collective<B>* mp_ = nullptr;  // the replica's TP x PP group when it has more than one rank
  int tp_rank_ = 0;
  EngineConfig config_;
  BatchConfig batch_;
  Opt opt_;
  BoundParameters<T> bound_;  // the model's parameter list and views
  GradPrecision precision_;
  Partitioned<T, Stage, S> part_;
  GradBuckets<T, B, S> buckets_;
  std::vector<ModuleState> mods_;
  std::optional<ParamCoordinator<T, B>> params_;  // stage 3: gathers, prefetches, releases
  Buffer<double, S> stats_{stats_slots, "engine: step statistics"};  // step()'s all_reduce and gate
  OffloadStaging<S> offload_;  // ZeRO-Offload's host copies (device: pinned, double-buffered)
  std::int64_t micro_ = 0, step_ = 0;
  std::string broken_;  // why the engine refuses further calls ("" while usable)
  StepTimer timer_;
  CommStats mark_{}, last_{};
  std::exception_ptr pending_;
};

}  // namespace zp
