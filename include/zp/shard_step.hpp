// zp/shard_step.hpp: the optimizer's operations on one rank's shard in the memory space where it
// lives (ShardStep<S>): the gradient statistics that decide the step, and the fused update. The
// host's are here (optim/cpu.hpp, SIMD and threads); a device's are in zp/device/memory.hpp
// (optim/gpu.hpp on the rank's compute stream). Both compute the same bits.
#pragma once

#include <span>

#include "zp/memory.hpp"
#include "zp/optim/cpu.hpp"
#include "zp/optim/optimizer.hpp"

namespace zp {

template <MemorySpace S>
struct ShardStep;

template <>
struct ShardStep<MemorySpace::host> {
  // stats[0] += the squared L2 norm of each of `grads` (as stored), stats[1] += 1 for each with
  // an inf or nan; stats: 2 doubles in this space.
  template <class G>
  static void statistics(std::span<const std::span<const G>> grads, double* stats,
                         const optim::cpu::Options& o) {
    for (const std::span<const G> g : grads) {
      const optim::GradStats st = optim::cpu::grad_stats(g, o);
      stats[0] += st.sumsq;
      if (!st.finite) stats[1] += 1;
    }
  }
  // One optimizer step over shards (a rank's segments), gated by two doubles in this space (the
  // engine's step gate, computed where the statistics are): gate[1] nonzero skips it, gate[0]
  // multiplies s.grad_mul.
  template <class Opt, class T, class G>
  static void update(const Opt& opt, optim::StepScalars s,
                     std::span<const optim::ShardView<T, G>> shards, const optim::cpu::Options& o,
                     const double* gate) {
    if (gate[1] != 0) return;
    s.grad_mul *= float(gate[0]);
    for (const auto& shard : shards) optim::cpu::step(opt, s, shard, o);
  }
};

}  // namespace zp
