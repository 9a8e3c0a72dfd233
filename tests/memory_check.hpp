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
    const std::int64_t stats =
        std::int64_t(E::stats_slots * sizeof(double));  // statistics and step gate
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
    } else {
      CHECK(peak == held);  // nothing allocated and freed per step
    }
    CHECK(peak <= bound);
  }
};

}  // namespace zp::test
