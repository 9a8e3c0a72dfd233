// An engine's memory as its allocator counted it (zp::memory_use of the engine's memory space,
// on this thread, i.e. this rank) against the engine's MemoryReport and the ZeRO formulas; for
// the host engine's tests and the device engine's gpu tests alike.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>

#include "zp/memory.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/partition.hpp"

namespace zp::test {

// Counts around one engine: construct before the engine, start() after its constructor, check()
// after some steps.
template <MemorySpace S>
struct MeasuredMemory {
  std::int64_t base = memory_use<S>().current;
  MeasuredMemory() { reset_peak_memory<S>(); }
  // The constructor held no more than it keeps and one segment of initial values in passing
  // (not the whole model).
  template <class E>
  void start(const E& engine) const {
    const MemoryUse use = memory_use<S>();
    const auto staging =
        std::int64_t(engine.layout().largest_segment() * sizeof(typename E::value_type));
    INFO("the constructor's peak ", use.peak - base, " bytes, it holds ", use.current - base,
         ", a segment ", staging, " of a model of ", engine.layout().total(), " elements");
    CHECK(use.peak - use.current <= staging);
    // What the engine checked its ranks had room for before it allocated: what it holds now,
    // and check() finds training's peak at least all of it.
    const MemoryPlan plan = engine.memory_plan();
    planned = S == MemorySpace::host ? plan.host : plan.device;
    const MemoryReport now = engine.memory();
    INFO("planned: model states ", planned.model_states(), ", buckets ", planned.buckets,
         ", gathered ", planned.gathered, ", secondary ", planned.secondary, ", swap buffers ",
         planned.swap_buffers, "; the report's buckets ", now.buckets);
    CHECK(planned.nvme == 0);
    CHECK(now.buckets == planned.buckets);
    CHECK(use.current - base ==
          std::int64_t(planned.model_states() + planned.buckets) + stats_bytes<E>());
    CHECK(plan.host.swap_buffers == now.swap_buffers);  // host memory, whatever S is
    if constexpr (S != MemorySpace::host)  // the host part: what is offloaded, and the swap's
      CHECK(plan.host.total() == now.offloaded + now.swap_buffers);
    else
      CHECK(plan.device.total() == 0);
    reset_peak_memory<S>();
  }
  // Runs f (a checkpoint: its staging is transient, not training's) without counting its peak.
  template <class F>
  void outside(F&& f) const {
    const std::int64_t peak = memory_use<S>().peak;
    f();
    zp::detail::memory_use<S>().peak = std::max(peak, memory_use<S>().current);
  }

  // Every byte the engine holds is in its report, the report's model states are the ZeRO
  // formula's for `ranks` (unless the gradients have an fp32 copy, which the formula leaves out),
  // and training never held more than the model states, the buckets and, at stage 3, the
  // live-parameter cap, the persistent modules and the (at most 2) cached gather buffers, plus
  // `scratch` bytes the caller expects on top (stage 3's quantized gathers: their records).
  template <class E>
  void check(const E& engine, int ranks, bool fp32_grads = false, std::int64_t scratch = 0) const {
    using T = typename E::value_type;
    const MemoryReport mem = engine.memory();
    const MemoryUse use = memory_use<S>();
    const std::int64_t stats = stats_bytes<E>();
    // offloaded model states (master and optimizer state; stage 3's parameters) live in host
    // memory, whatever S is, or on NVMe; the swap's buffers are its own (aligned for O_DIRECT),
    // not the allocator's
    const std::int64_t offloaded =
        (S == MemorySpace::host ? 0 : std::int64_t(mem.offloaded)) + std::int64_t(mem.nvme);
    const std::int64_t held = use.current - base, peak = use.peak - base;
    INFO("stage ", E::stage, ": allocator holds ", held, " bytes (peak in training ", peak,
         "), report total ", mem.total(), ", model states ", mem.model_states());
    CHECK(held == std::int64_t(mem.model_states() + mem.buckets + mem.gathered + mem.gather_cache +
                               mem.secondary) -
                      offloaded + stats);
    const auto& L = engine.layout();
    if (!fp32_grads)
      CHECK(mem.model_states() ==
            zero_model_state_bytes(E::stage, L.total(), ranks, sizeof(T),
                                   optim::state_slots<typename E::optimizer_type>));
    std::int64_t bound = std::int64_t(mem.model_states() + mem.buckets + mem.secondary) -
                         offloaded + stats + scratch;
    if constexpr (E::stage == 3) {
      std::size_t largest = 0;
      for (int m = 0; m < L.module_count(); ++m) largest = std::max(largest, L.module(m).size);
      bound += std::int64_t((engine.max_live_params() + 2 * largest) * sizeof(T) + mem.persistent);
      CHECK(mem.gathered_peak <= engine.max_live_params() * sizeof(T));
      CHECK(planned.gathered >= largest * sizeof(T));  // the largest module, persistent or not
    } else {
      CHECK(peak == held);  // nothing allocated and freed per step
    }
    CHECK(peak <= bound);
    CHECK(peak >= std::int64_t(planned.total() - planned.swap_buffers) + stats);
    CHECK(mem.secondary == planned.secondary);  // hpZ's shards, kept once made
  }

 private:
  template <class E>
  static std::int64_t stats_bytes() {  // statistics and step gate
    return std::int64_t(E::stats_slots * sizeof(double));
  }
  mutable MemoryReport planned;  // start()'s, of the engine's memory space
};

}  // namespace zp::test
