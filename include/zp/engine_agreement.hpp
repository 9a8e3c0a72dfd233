// zp/engine_agreement.hpp: the checks the ranks make together as they build an engine. That
// every rank built the same engine: the same model and layout, stage, element type, batch,
// precision, optimizer, clipping and loss scaling, and stage 3 and bucket settings (one
// all_reduce of fingerprints, agreement.hpp; when one differs, every rank throws an error
// naming it, with this rank's values). And, before any rank allocates its model states, that
// the ranks sharing a memory limit have the host memory for them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "zp/agreement.hpp"
#include "zp/bucket.hpp"
#include "zp/collective.hpp"
#include "zp/detail/cgroup.hpp"
#include "zp/detail/hash.hpp"
#include "zp/dtype.hpp"
#include "zp/engine_config.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/partition.hpp"

namespace zp {

namespace detail {
// The slow path of a layout difference: names the first parameter that differs (name, module
// or size), or says that only the bucket layout does. Every rank throws.
template <Backend B>
[[noreturn]] void throw_layout_difference(Collective<B>& comm, const Layout& L,
                                          const EngineConfig& c) {
  const auto& ps = L.params();
  const std::int64_t count = std::int64_t(ps.size());
  const auto most = std::size_t(spread(comm, std::span<const std::int64_t>(&count, 1))[0].hi);
  // A missing parameter's fingerprint is 0; a present one's has bit 2 set, so it is not 0 in the
  // 62 bits compared.
  std::vector<std::uint64_t> h(most, 0);
  for (std::size_t i = 0; i < ps.size(); ++i)
    h[i] = detail::Fnv1a().all(std::string_view(ps[i].name), ps[i].module, ps[i].size).value() | 4;
  const std::size_t i = first_difference(comm, std::span<const std::uint64_t>(h));
  const std::string head =
      detail::cat("engine: the models differ between ranks (rank ", comm.rank(), " has ", ps.size(),
                  " parameters, ", L.used(), " elements): ");
  const std::string tail = "; every rank must build the same model with the same zp configuration";
  if (i == most)
    throw Error(
        Errc::invalid_argument,
        detail::cat(head, "the parameters agree but their bucket layout does not (this rank: ",
                    L.segment_count(), " buckets from bucket_bytes=", c.bucket_bytes,
                    ", first_bucket_bytes=", c.first_bucket_bytes, ", align=", c.align, ")", tail));
  if (i >= ps.size())
    throw Error(Errc::invalid_argument, detail::cat(head, "the first difference is parameter #", i,
                                                    ", which this rank does not have", tail));
  throw Error(
      Errc::invalid_argument,
      detail::cat(head, "the first parameter that differs is #", i, ", on this rank '", ps[i].name,
                  "' (module ", ps[i].module, ", ", ps[i].size, " elements)", tail));
}
}  // namespace detail

// The weight decay flags' fingerprint (empty: every parameter decays).
inline std::uint64_t decay_hash(std::span<const char> decays) {
  detail::Fnv1a h;
  for (const char d : decays) h.add(d != 0);
  return h.value();
}

// Everything that must agree across ranks, as fingerprints compared in one all_reduce
// (first_difference), so a difference names what differs, on every rank. `model_parallel`: comm
// is a replica's TP x PP group, whose ranks hold different parts of the model, each gathered
// and reduced over its own data-parallel group: their layouts and stage 3 and bucket settings
// are not compared, the rest (stepped together: one norm, one skip) is.
template <Backend B, class Opt>
void expect_same_engine_everywhere(Collective<B>& comm, const Layout& L, int stage, DType dtype,
                                   const EngineConfig& c, const BatchConfig& batch,
                                   const GradPrecision& precision, const Opt& opt,
                                   std::span<const char> decays, bool model_parallel = false) {
  const LossScaler& ls = c.loss_scaler;
  const DynamicScale& d = ls.config();
  const std::string parts[] = {
      "the model's parameters and their layout",
      detail::cat("ZeRO stage and element type (this rank: stage ", stage, ", ", name(dtype), ")"),
      detail::cat("batch or gradient precision (this rank: micro_batch_per_rank=",
                  batch.micro_batch_per_rank, ", gradient_accumulation_steps=",
                  batch.gradient_accumulation_steps, ", fp32 accumulation ",
                  precision.accumulate_f32, ", fp32 reduction ", precision.reduce_f32, ")"),
      detail::cat("optimizer (this rank: ", optim::describe(opt), ")"),
      detail::cat("clipping or loss scaling (this rank: max_grad_norm=", c.max_grad_norm,
                  ", loss scaler kind ", int(ls.kind()), ", scale ", ls.scale(), ")"),
      detail::cat("stage 3 gathering or buckets (this rank: max_live_params=", c.max_live_params,
                  ", persist_threshold=", c.persist_threshold, ", prefetch=", c.prefetch,
                  ", reshard_after_forward=", c.reshard_after_forward,
                  ", max_reuse_distance=", c.max_reuse_distance, ", bucket_slots=", c.bucket_slots,
                  ", broadcast_initial_params=", c.broadcast_initial_params, ", initializer ",
                  c.initializer ? "set" : "unset", ", quantized weights block ",
                  c.quantized_weights ? c.quantized_weights->block : 0,
                  ", hpz_partition_size=", c.hpz_partition_size, ", quantized gradients block ",
                  c.quantized_gradients ? c.quantized_gradients->block : 0,
                  ", ranks_per_node=", c.ranks_per_node, ")"),
      // The NVMe step adds an agreement to every step: all ranks or none.
      detail::cat("optimizer state or parameters on NVMe (this rank: ",
                  c.optimizer_nvme ? "state" : "no state", ", ",
                  c.param_nvme ? "params" : "no params", ")"),
      detail::cat("parameters that take weight decay (this rank: ",
                  decays.empty() ? L.params().size()
                                 : std::size_t(std::count(decays.begin(), decays.end(), 1)),
                  " of ", L.params().size(), ", EngineConfig::weight_decay_filter)")};
  const std::uint64_t h[] = {
      model_parallel ? 0 : L.hash(),
      detail::Fnv1a().all(stage, dtype).value(),
      detail::Fnv1a()
          .all(batch.micro_batch_per_rank, batch.gradient_accumulation_steps,
               precision.accumulate_f32, precision.reduce_f32)
          .value(),
      optim::fingerprint(opt),
      detail::Fnv1a()
          .all(c.max_grad_norm, ls.kind(), ls.scale(), d.initial_scale, d.window, d.hysteresis,
               d.consecutive_hysteresis, d.min_scale, d.factor, d.error_at_min_scale,
               ls.max_skipped_in_row())
          .value(),
      model_parallel
          ? 0
          : detail::Fnv1a()
                .all(c.max_live_params, c.persist_threshold, c.prefetch, c.reshard_after_forward,
                     c.max_reuse_distance, c.bucket_slots, c.broadcast_initial_params,
                     c.initializer != nullptr,
                     c.quantized_weights ? c.quantized_weights->block : std::size_t(0),
                     c.hpz_partition_size,
                     c.quantized_gradients ? c.quantized_gradients->block : std::size_t(0),
                     c.quantized_gradients ? int(c.quantized_gradients->bits) : 0, c.ranks_per_node)
                .value(),
      detail::Fnv1a().all(c.optimizer_nvme.has_value(), c.param_nvme.has_value()).value(),
      model_parallel ? 0 : decay_hash(decays)};
  const std::size_t k = first_difference(comm, std::span<const std::uint64_t>(h));
  if (k == 0) detail::throw_layout_difference(comm, L, c);
  if (k < std::size(h))
    throw Error(
        Errc::invalid_argument,
        detail::cat("engine: the ranks' configurations differ in their ", parts[k], " on rank ",
                    comm.rank(),
                    "; every rank must build the same model with the same zp configuration"));
}

namespace detail {
// A rank's record in the host memory check: its memory cgroup's identity and room, its
// machine's, and its need (0 identity: no limit found).
struct Room {
  enum : std::size_t { cgroup_id, cgroup_room, machine_id, machine_room, need, fields };
};

// Ranks that share a memory limit (a cgroup, or a machine) and need more than it leaves them.
struct ShortOfRoom {
  bool machine = false;  // the machine's limit, else a cgroup's
  std::vector<int> ranks;
  std::int64_t need = 0, room = 0;
};

// The first such group in `table` (Room::fields values a rank), cgroups before machines, in the
// order of their lowest ranks. A group's room is the most any of its ranks read (the reads are
// moments apart), its need the sum of theirs.
inline std::optional<ShortOfRoom> short_of_room(std::span<const std::int64_t> table) {
  const std::size_t ranks = table.size() / Room::fields;
  const auto at = [&](std::size_t r, std::size_t f) { return table[r * Room::fields + f]; };
  for (const bool machine : {false, true}) {
    const std::size_t id = machine ? Room::machine_id : Room::cgroup_id, room = id + 1;
    std::vector<std::pair<std::int64_t, int>> by_id;  // sorted: each group's ranks in a run
    for (std::size_t r = 0; r < ranks; ++r)
      if (at(r, id) != 0) by_id.emplace_back(at(r, id), int(r));
    std::sort(by_id.begin(), by_id.end());
    std::optional<ShortOfRoom> first;
    for (std::size_t i = 0, end; i < by_id.size(); i = end) {
      ShortOfRoom s{machine, {}, 0, 0};
      for (end = i; end < by_id.size() && by_id[end].first == by_id[i].first; ++end) {
        const auto r = std::size_t(by_id[end].second);
        s.ranks.push_back(int(r));
        s.need = std::min(s.need + at(r, Room::need), no_memory_limit);  // each is at most it
        s.room = std::max(s.room, at(r, room));
      }
      if (s.need > s.room && (!first || s.ranks[0] < first->ranks[0])) first = std::move(s);
    }
    if (first) return first;
  }
  return std::nullopt;
}
}  // namespace detail

// Before the engine's ranks allocate their model states: `need` is this rank's host memory
// (Partitioned::host_memory), and the ranks that share a memory cgroup, or a machine, must
// have room for the sum of theirs (detail::host_memory_room, which counts page cache and swap
// as free), or the kernel kills the process as it fills them, naming nothing. One all_reduce of
// Room::fields words a rank; where a group is short, every rank throws Errc::out_of_memory, the
// group's ranks naming the limit and the figures.
template <Backend B>
void expect_host_memory(Collective<B>& comm, const MemoryReport& need) {
  const detail::HostRoom here = detail::host_memory_room();
  const std::size_t me = std::size_t(comm.rank());
  using detail::Room;
  std::vector<std::int64_t> table(std::size_t(comm.size()) * Room::fields, 0);
  std::int64_t* const mine = &table[me * Room::fields];
  mine[Room::cgroup_id] = here.cgroup_id;
  mine[Room::cgroup_room] = here.cgroup.bytes;
  mine[Room::machine_id] = here.machine_id;
  mine[Room::machine_room] = here.machine.bytes;
  mine[Room::need] = std::int64_t(std::min<std::size_t>(need.total(), detail::no_memory_limit));
  all_reduce_host(comm, std::span<std::int64_t>(table), ReduceOp::sum);
  const auto s = detail::short_of_room(table);
  if (!s) return;
  std::string ranks;
  for (std::size_t i = 0; i < s->ranks.size() && i < 8; ++i)
    ranks += detail::cat(i ? ", " : "", s->ranks[i]);
  if (s->ranks.size() > 8) ranks += detail::cat(" and ", s->ranks.size() - 8, " more");
  const bool member = std::find(s->ranks.begin(), s->ranks.end(), int(me)) != s->ranks.end();
  std::string parts;
  for (const auto& [bytes, what] : {std::pair{need.params, "parameters"},
                                    {need.grads, "gradients"},
                                    {need.master, "fp32 master weights"},
                                    {need.optimizer_state, "optimizer state"},
                                    {need.swap_buffers, "NVMe swap buffers"}})
    if (bytes > 0)
      parts += detail::cat(parts.empty() ? "" : ", ", what, " ", detail::mib(std::int64_t(bytes)));
  const detail::MemoryRoom& limit = s->machine ? here.machine : here.cgroup;
  throw Error(
      Errc::out_of_memory,
      detail::cat(
          "engine: not enough host memory for the model states: rank",
          s->ranks.size() > 1 ? "s " : " ", ranks, s->ranks.size() > 1 ? " need " : " needs ",
          detail::mib(s->need), ", more than the ", detail::mib(s->room), " left by ",
          member ? limit.where
                 : detail::cat(s->machine ? "their machine" : "their memory cgroup", " (rank ",
                               s->ranks[0], "'s error names it)"),
          ", past which the kernel kills the process",
          member
              ? detail::cat("; this rank's ", detail::mib(std::int64_t(need.total())), ": ", parts)
              : std::string(),
          ". Offload to NVMe (offload_optimizer: nvme; at stage 3 offload_param: nvme too), "
          "shard over more ranks or at a higher ZeRO stage, or give the job more memory"));
}

}  // namespace zp
