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

// ZeRO++'s quantization formats' fingerprint (none: 0s).
inline std::uint64_t quantization_fingerprint(const EngineConfig& c) {
  return detail::Fnv1a()
      .all(c.quantized_weights ? c.quantized_weights->block : std::size_t(0),
           c.quantized_gradients ? c.quantized_gradients->block : std::size_t(0),
           c.quantized_gradients ? int(c.quantized_gradients->bits) : 0)
      .value();
}

// Everything that must agree across ranks, as fingerprints compared in one all_reduce
// (first_difference), so a difference names what differs, on every rank. `model_parallel`: comm
// is a replica's TP x PP group, whose ranks hold different parts of the model, each gathered
// and reduced over its own data-parallel group: their layouts and stage 3, bucket and ZeRO++
// settings are not compared (a tensor-parallel grid's engine compares what ZeRO++ needs alike
// over its TP ranks), the rest (stepped together: one norm, one skip) is. `device`: the engine's
// buffers are device memory (where ZeRO-Offload's step is agreed on, as the NVMe one is).
template <Backend B, class Opt>
void expect_same_engine_everywhere(Collective<B>& comm, const Layout& L, int stage, DType dtype,
                                   const EngineConfig& c, const BatchConfig& batch,
                                   const GradPrecision& precision, const Opt& opt,
                                   std::span<const char> decays, bool device,
                                   bool model_parallel = false) {
  const LossScaler& ls = c.loss_scaler;
  const DynamicScale& d = ls.config();
  // ZeRO++'s quantization first: on a tensor-parallel grid it changes the layout too, and the
  // setting is what to name.
  const std::string parts[] = {
      detail::cat("ZeRO++ quantization (this rank: quantized weights block ",
                  c.quantized_weights ? c.quantized_weights->block : 0,
                  ", quantized gradients block ",
                  c.quantized_gradients ? c.quantized_gradients->block : 0, " of ",
                  c.quantized_gradients ? int(c.quantized_gradients->bits) : 0, " bits)"),
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
                  c.initializer ? "set" : "unset", ", hpz_partition_size=", c.hpz_partition_size,
                  ", ranks_per_node=", c.ranks_per_node, ")"),
      // The NVMe step, and ZeRO-Offload's on a device, add an agreement to every step: all ranks
      // or none.
      detail::cat("optimizer state or parameters on NVMe, or the optimizer offloaded on a device "
                  "backend (this rank: ",
                  c.optimizer_nvme ? "state" : "no state", ", ",
                  c.param_nvme ? "params" : "no params", " on NVMe, ",
                  device && c.offload_optimizer ? "offloaded" : "not offloaded", ")"),
      detail::cat("parameters that take weight decay (this rank: ",
                  decays.empty() ? L.params().size()
                                 : std::size_t(std::count(decays.begin(), decays.end(), 1)),
                  " of ", L.params().size(), ", EngineConfig::weight_decay_filter)")};
  const std::uint64_t h[] = {
      model_parallel ? 0 : quantization_fingerprint(c),
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
                     c.initializer != nullptr, c.hpz_partition_size, c.ranks_per_node)
                .value(),
      detail::Fnv1a()
          .all(c.optimizer_nvme.has_value(), c.param_nvme.has_value(),
               device && c.offload_optimizer)
          .value(),
      model_parallel ? 0 : decay_hash(decays)};
  const std::size_t k = first_difference(comm, std::span<const std::uint64_t>(h));
  if (k == 1) detail::throw_layout_difference(comm, L, c);
  if (k < std::size(h))
    throw Error(
        Errc::invalid_argument,
        detail::cat("engine: the ranks' configurations differ in their ", parts[k], " on rank ",
                    comm.rank(),
                    "; every rank must build the same model with the same zp configuration"));
}

namespace detail {
// A rank's record in the memory check: the identity and room of its memory cgroup, its machine
// and its device (0 identity: no limit found, or no device), and its needs in host and device
// memory.
struct Room {
  enum : std::size_t {
    cgroup_id,
    cgroup_room,
    machine_id,
    machine_room,
    device_id,
    device_room,
    host_need,
    device_need,
    rank,  // the rank's world rank, to name it by
    fields
  };
};

// What a group of ranks shares: a memory cgroup, a machine or a device.
enum class Limit : std::uint8_t { cgroup, machine, device };

// Ranks that share a limit and need more than it leaves them.
struct ShortOfRoom {
  Limit limit = Limit::cgroup;
  std::vector<int> ranks;
  std::int64_t need = 0, room = 0;
};

// The first such group in `table` (Room::fields values a rank), cgroups before machines before
// devices, in the order of their lowest ranks. A group's need is the sum of its ranks', its room
// the least any of them read: the last read comes after every rank of the group allocated what
// it holds before its engine (thread ranks' activations), which is then counted.
inline std::optional<ShortOfRoom> short_of_room(std::span<const std::int64_t> table) {
  const std::size_t ranks = table.size() / Room::fields;
  const auto at = [&](std::size_t r, std::size_t f) { return table[r * Room::fields + f]; };
  for (const Limit limit : {Limit::cgroup, Limit::machine, Limit::device}) {
    const std::size_t id = limit == Limit::cgroup    ? Room::cgroup_id
                           : limit == Limit::machine ? Room::machine_id
                                                     : Room::device_id,
                      room = id + 1,
                      need = limit == Limit::device ? Room::device_need : Room::host_need;
    std::vector<std::pair<std::int64_t, int>> by_id;  // sorted: each group's ranks in a run
    for (std::size_t r = 0; r < ranks; ++r)
      if (at(r, id) != 0) by_id.emplace_back(at(r, id), int(r));
    std::sort(by_id.begin(), by_id.end());
    std::optional<ShortOfRoom> first;
    for (std::size_t i = 0, end; i < by_id.size(); i = end) {
      ShortOfRoom s{limit, {}, 0, no_memory_limit};
      for (end = i; end < by_id.size() && by_id[end].first == by_id[i].first; ++end) {
        const auto r = std::size_t(by_id[end].second);
        s.ranks.push_back(int(r));
        s.need = std::min(s.need + at(r, need), no_memory_limit);  // each is at most it
        s.room = std::min(s.room, at(r, room));
      }
      if (s.need > s.room && (!first || s.ranks[0] < first->ranks[0])) first = std::move(s);
    }
    if (first) return first;
  }
  return std::nullopt;
}

// "parameters 1.0 MiB, gradients 2.0 MiB, ...": r's categories that are not 0.
inline std::string memory_parts(const MemoryReport& r) {
  std::string parts;
  for (const auto& [bytes, what] : {std::pair{r.params, "parameters"},
                                    {r.grads, "gradients"},
                                    {r.master, "fp32 master weights"},
                                    {r.optimizer_state, "optimizer state"},
                                    {r.swap_buffers, "NVMe swap buffers"},
                                    {r.buckets, "gradient buckets"},
                                    {r.gathered, "gathered parameters (at least)"},
                                    {r.secondary, "hpZ secondary shards"}})
    if (bytes > 0) parts += cat(parts.empty() ? "" : ", ", what, " ", mib(std::int64_t(bytes)));
  return parts;
}
}  // namespace detail

// The ranks besides a data-parallel group whose memory its check counts too: its
// model-parallel peers (a ProcessGrid's model_parallel(): the other groups' ranks of the same dp
// coordinate), and this rank's world rank to name it by (-1: its rank in the group).
template <Backend B>
struct MemoryPeers {
  Collective<B>* mp = nullptr;
  int world_rank = -1;
};

// Before the engine's ranks allocate: `need` is this rank's memory by space (the partition's
// model states, the buckets' first slots, stage 3's least working set), and the ranks that
// share a memory cgroup, or a machine, must have room for the sum of their host memory
// (detail::host_memory_room, which counts page cache and swap as free), or the kernel kills the
// process as it fills them, naming nothing; the ranks that share a device (`device`: this
// rank's, on a device backend), for the sum of their device memory. One all_reduce of
// Room::fields words a rank (on a grid, one more over `peers.mp`); where a group is short, every
// rank throws Errc::out_of_memory, the group's ranks naming the limit and the figures.
template <Backend B>
void expect_memory(Collective<B>& comm, const MemoryPlan& need, const DeviceRoom* device = nullptr,
                   MemoryPeers<B> peers = {}) {
  const detail::HostRoom here = detail::host_memory_room();
  const bool grid = peers.mp && peers.mp->size() > 1;
  const std::size_t groups = grid ? std::size_t(peers.mp->size()) : 1,
                    me = (grid ? std::size_t(peers.mp->rank()) : 0) * std::size_t(comm.size()) +
                         std::size_t(comm.rank());
  using detail::Room;
  const auto bytes = [](std::size_t b) {
    return std::int64_t(std::min<std::size_t>(b, detail::no_memory_limit));
  };
  std::vector<std::int64_t> table(groups * std::size_t(comm.size()) * Room::fields, 0);
  std::int64_t* const mine = &table[me * Room::fields];
  mine[Room::cgroup_id] = here.cgroup_id;
  mine[Room::cgroup_room] = here.cgroup.bytes;
  mine[Room::machine_id] = here.machine_id;
  mine[Room::machine_room] = here.machine.bytes;
  if (device && device->bytes >= 0) {
    mine[Room::device_id] =
        detail::limit_identity(detail::Fnv1a().all(std::string_view(device->device)));
    mine[Room::device_room] = std::min(device->bytes, detail::no_memory_limit);
  }
  mine[Room::host_need] = bytes(need.host.total());
  mine[Room::device_need] = bytes(need.device.total());
  mine[Room::rank] = peers.world_rank >= 0 ? peers.world_rank : comm.rank();
  // Each group fills its block of rows, then (a grid) each group's block goes to the others.
  all_reduce_host(comm, std::span<std::int64_t>(table), ReduceOp::sum);
  if (grid) all_reduce_host(*peers.mp, std::span<std::int64_t>(table), ReduceOp::sum);
  const auto s = detail::short_of_room(table);
  if (!s) return;
  std::vector<std::int64_t> named;  // the group's world ranks, in order
  for (const int row : s->ranks)
    named.push_back(table[std::size_t(row) * Room::fields + Room::rank]);
  std::sort(named.begin(), named.end());
  std::string ranks;
  for (std::size_t i = 0; i < named.size() && i < 8; ++i)
    ranks += detail::cat(i ? ", " : "", named[i]);
  if (named.size() > 8) ranks += detail::cat(" and ", named.size() - 8, " more");
  const bool member = std::find(s->ranks.begin(), s->ranks.end(), int(me)) != s->ranks.end();
  const bool on_device = s->limit == detail::Limit::device;
  const MemoryReport& mine_r = on_device ? need.device : need.host;
  const std::string where =
      !member ? detail::cat(s->limit == detail::Limit::cgroup ? "their memory cgroup"
                            : on_device                       ? "their device"
                                                              : "their machine",
                            " (rank ", named[0], "'s error names it)")
      : on_device                          ? device->device
      : s->limit == detail::Limit::machine ? here.machine.where
                                           : here.cgroup.where;
  throw Error(
      Errc::out_of_memory,
      detail::cat("engine: not enough ", on_device ? "device" : "host", " memory: rank",
                  s->ranks.size() > 1 ? "s " : " ", ranks,
                  s->ranks.size() > 1 ? " need " : " needs ", detail::mib(s->need),
                  ", more than the ", detail::mib(s->room), on_device ? " free on " : " left by ",
                  where, on_device ? "" : ", past which the kernel kills the process",
                  member ? detail::cat("; this rank's ", detail::mib(std::int64_t(mine_r.total())),
                                       ": ", detail::memory_parts(mine_r))
                         : std::string(),
                  on_device
                      ? ". Offload to the CPU or NVMe (offload_optimizer; at stage 3 offload_param "
                        "too), shard over more devices or at a higher ZeRO stage, or use a device "
                        "with more memory"
                      : ". Offload to NVMe (offload_optimizer: nvme; at stage 3 offload_param: "
                        "nvme too), shard over more ranks or at a higher ZeRO stage, or give the "
                        "job more memory"));
}

}  // namespace zp
