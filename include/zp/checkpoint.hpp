// zp/checkpoint.hpp: sharded checkpoints of an engine that load at any grid (DP x TP x PP) and
// ZeRO stage, and the model's weights to and from safetensors files (component zp::io: needs
// nlohmann_json). The format, and what works offline on saved checkpoints, is
// checkpoint_format.hpp.
//
//   zp::save_checkpoint(engine, "ckpt", "step1000", user_state);   // collective
//   auto user_state = zp::load_checkpoint(engine, "ckpt");         // "latest"; any ranks/stage
//   zp::export_safetensors(engine, "out");                          // out/model.safetensors
//
// Rank 0 of the grid publishes a checkpoint only after every rank wrote its file; loading
// verifies every file's size and CRC-32C (each rank checks a share of the files) before reading
// anything. The directory must be one file system that every rank sees (a shared one across
// nodes).
//
// Errors: every function here is collective (over the engine's whole grid); a failure on one rank
// (an unwritable directory, a corrupt file) becomes an Error on every rank naming the rank, the
// file and the values.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "zp/agreement.hpp"
#include "zp/checkpoint_format.hpp"
#include "zp/engine.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/safetensors.hpp"
#include "zp/whole_model.hpp"

namespace zp {

namespace ckpt {
// The whole-model safetensors files name whole tensors; under tensor or pipeline parallelism a
// rank holds parts of the model (checkpoints hold those; load one at a data-parallel grid to
// export it).
template <class E>
void expect_data_parallel(E& engine, const char* what) {
  ZP_EXPECT(engine.model_parallel() == nullptr, what,
            ": the engine spans a tensor/pipeline-parallel grid (",
            engine.model_parallel() ? engine.model_parallel()->size() : 1,
            " model-parallel ranks); save a checkpoint and load it at --tp 1 --pp 1 (any grid "
            "loads any checkpoint) to export or import whole tensors");
}

// The engine's grid (its DP group: the shard group, then the replicas; then its replica's TP x
// PP group) as one communicator for the checkpoint's agreements: the groups are the axes of one
// product, so a reduction over each in turn reaches every rank.
template <class E>
void reduce_over_grid(E& engine, std::span<std::int64_t> v, ReduceOp op) {
  for (auto* g : {&engine.comm(), engine.replicas(), engine.model_parallel()})
    if (g) all_reduce_host(*g, v, op);
}
// Under hybrid sharding every shard group holds the whole state; the first one writes it.
template <class E>
bool first_replica(E& engine) {
  return !engine.replicas() || engine.replicas()->rank() == 0;
}
template <class E>
bool same_over_grid(E& engine, std::uint64_t h) {
  std::int64_t v[2] = {std::int64_t(h), ~std::int64_t(h)};  // min(~x) = ~max(x)
  reduce_over_grid(engine, std::span<std::int64_t>(v), ReduceOp::min);
  return v[0] == ~v[1];
}
// The engine's rank in its grid (Megatron's order; one replica's, under hybrid sharding): the
// file it writes.
template <class E>
int grid_rank_of(E& engine) {
  return grid_rank(engine.grid_shape(), engine.grid_coords());
}

// Every rank's parameter list (names, local modules, sizes, placements) at every rank, by the
// replica's model-parallel rank tp + TP * pp. Collective over the grid.
template <class E>
std::vector<std::vector<ParamInfo>> gather_parts(E& engine) {
  auto* mp = engine.model_parallel();
  if (!mp) return {engine.params()};
  nlohmann::json mine = nlohmann::json::array();
  for (const auto& p : engine.params())
    mine.push_back(
        {p.name, p.module, p.size, int(p.tp), p.place.shape, p.place.begin, p.place.end});
  const std::string text = mine.dump();
  const std::size_t n = std::size_t(mp->size()), me = std::size_t(mp->rank());
  std::vector<std::int64_t> sizes(n, 0);
  sizes[me] = std::int64_t(text.size());
  all_reduce_host(*mp, std::span<std::int64_t>(sizes), ReduceOp::sum);
  std::vector<std::size_t> at(n + 1, 0);
  for (std::size_t i = 0; i < n; ++i) at[i + 1] = at[i] + std::size_t(sizes[i]);
  std::vector<std::int64_t> chars(at[n], 0);
  for (std::size_t i = 0; i < text.size(); ++i) chars[at[me] + i] = std::uint8_t(text[i]);
  all_reduce_host(*mp, std::span<std::int64_t>(chars), ReduceOp::sum);
  std::vector<std::vector<ParamInfo>> parts(n);
  for (std::size_t g = 0; g < n; ++g) {
    std::string t(at[g + 1] - at[g], '\0');
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = char(chars[at[g] + i]);
    for (const auto& e : nlohmann::json::parse(t))
      parts[g].push_back(
          {e[0].get<std::string>(),
           e[1].get<int>(),
           e[2].get<std::size_t>(),
           TensorParallel(e[3].get<int>()),
           {e[4].get<std::vector<std::size_t>>(), e[5].get<std::vector<std::size_t>>(),
            e[6].get<std::vector<std::size_t>>()}});
  }
  return parts;
}

// The full model from its parts (gather_parts; by tp + TP * pp): the manifest's params (each
// tensor once, forward order, modules numbered over the whole model, full shapes) and parts
// (boxes in those shapes). A split tensor needs its Placement; parts of one tensor must agree
// on its shape.
inline void describe_grid(Manifest& m, std::vector<std::vector<ParamInfo>> parts) {
  const GridShape& grid = m.grid;
  std::map<std::string, std::size_t> index;
  int base = 0;  // the first module of the stage, in the whole model
  for (int pp = 0; pp < grid.pp; ++pp) {
    int modules = 0;
    for (int tp = 0; tp < grid.tp; ++tp)
      for (ParamInfo& p : parts[std::size_t(tp + grid.tp * pp)]) {
        ZP_EXPECT(!(p.place.shape.empty() && p.tp == TensorParallel::split && grid.tp > 1),
                  "checkpoint: parameter '", p.name, "' is split over the ", grid.tp,
                  " tensor-parallel ranks but the model gave no zp::Placement for it; a "
                  "checkpoint of this grid needs to know where each rank's slice sits "
                  "(model.hpp)");
        modules = std::max(modules, p.module + 1);
        const std::size_t full = p.place.shape.empty() ? p.size : p.place.full_size();
        auto [it, added] = index.emplace(p.name, m.params.size());
        if (added) {
          ParamInfo whole{p.name, base + p.module, full, TensorParallel::replicated, {}};
          whole.place = whole_of(ParamInfo{p.name, 0, full, {}, p.place});
          m.params.push_back(std::move(whole));
        }
        const ParamInfo& w = m.params[it->second];
        if (p.place.shape.empty()) p.place = w.place;
        ZP_EXPECT(p.place.shape == w.place.shape && w.size == full, "checkpoint: parameter '",
                  p.name, "' is of the shape ", dims_text(p.place.shape), " (", full,
                  " elements) on one rank and ", dims_text(w.place.shape), " (", w.size,
                  " elements) on another");
      }
    base += modules;
  }
  m.parts = std::move(parts);
}

// The partition's field of manifest field f (0: the parameters, 1: the master weights, 2 + k:
// optimizer state k).
inline Field field_of(std::size_t f) {
  return f == 0 ? Field::param : f == 1 ? Field::master : Field::state;
}
// Runs part.access(..., a, fn) on manifest field f of segment s.
template <class P, class Fn>
void with_field(const P& part, std::size_t f, int s, Extent e, Access a, Fn&& fn) {
  if (f == 0)
    part.template access<Field::param>(s, e, 0, a, fn);
  else if (f == 1)
    part.template access<Field::master>(s, e, 0, a, fn);
  else
    part.template access<Field::state>(s, e, int(f) - 2, a, fn);
}

// Verifies every file of the checkpoint (size and CRC-32C), each rank of the grid a share; a
// failure is an error on every rank naming the file. Collective over the grid.
template <class E>
void verify_everywhere(E& engine, const Reader& rd) {
  const std::size_t F = rd.manifest().files.size();
  std::vector<std::int64_t> bad(F, 0);
  const auto* rep = engine.replicas();
  const std::size_t G = std::size_t(engine.grid_shape().size()),
                    R = std::size_t(rep ? rep->size() : 1), r = std::size_t(rep ? rep->rank() : 0);
  for (std::size_t i = std::size_t(grid_rank_of(engine)) + G * r; i < F; i += G * R)
    bad[i] = rd.verify_file(int(i)).empty() ? 0 : 1;
  reduce_over_grid(engine, std::span<std::int64_t>(bad), ReduceOp::sum);
  on_every_grid_rank(engine, [&] {
    for (std::size_t i = 0; i < F; ++i)
      if (bad[i]) {
        const std::string why = rd.verify_file(int(i));  // the checking rank's result, re-derived
        throw Error(Errc::io, why.empty()
                                  ? detail::cat("checkpoint file ", rd.file_path(int(i)).string(),
                                                " failed verification on another rank")
                                  : why);
      }
  });
}

// Runs f, which writes the engine's buffers (a load, after its checks passed), then writes back
// what the swaps cached, on every rank of the grid. A failure on any rank leaves the state half
// written: it makes the engine unusable on every rank as it is thrown there.
template <class E>
void writing(E& engine, const char* call, const std::filesystem::path& from,
             detail::FunctionRef<void()> f) {
  try {
    on_every_grid_rank(engine, [&] {
      f();
      engine.partition().flush_swaps();
    });
  } catch (const std::exception& e) {
    engine.mark_unusable(detail::cat(call, " of ", from.string(),
                                     " failed after it began to write the state (",
                                     detail::message_of(e), ")"));
    throw;
  }
}

// The manifest's params (describe_grid) that the engine's filter exempts from weight decay.
template <class E>
void describe_decay(Manifest& m, const E& engine) {
  if (const auto& decays = engine.weight_decay_filter())
    for (const auto& p : m.params)
      if (!decays(p.name)) m.no_weight_decay.push_back(p.name);
}

// A checkpoint trained with weight decay on other parameters than the engine's filter names is
// refused, as PyTorch refuses an optimizer state of other param groups: its moments would go on
// under another update rule.
template <class E>
void check_decay(const E& engine, const Manifest& m, const std::string& where) {
  const std::set<std::string_view> off(m.no_weight_decay.begin(), m.no_weight_decay.end());
  const auto& ps = engine.params();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const bool saved = !off.contains(ps[i].name);
    ZP_EXPECT(saved == engine.decays(i), "checkpoint ", where, " was trained with weight decay ",
              saved ? "on" : "off", " for parameter '", ps[i].name,
              "', which this engine's weight_decay_filter ", saved ? "exempts" : "decays", " (",
              m.no_weight_decay.size(), " of the checkpoint's ", m.params.size(),
              " parameters take none); load it with the filter it was trained with");
  }
}

// What save_checkpoint writes into manifest.json for the engine's state now.
template <class E>
Manifest manifest_of(E& engine, const std::string& tag, std::size_t user_bytes) {
  const auto& opt = engine.optimizer();
  Manifest m;
  m.tag = tag;
  m.grid = engine.grid_shape();
  m.world_size = m.grid.size();
  m.stage = E::stage;
  m.dtype = dtype_of<typename E::value_type>;
  m.layout = engine.layout().options();
  m.fields = {"param", "master"};
  for (int k = 0; k < optim::state_slots<typename E::optimizer_type>; ++k)
    m.fields.push_back(optim::state_name(opt, k));
  m.optimizer = optim::detail::type_name(opt);
  optim::detail::for_each_field(opt, [&](const char* key, auto x) { m.hyper[key] = x; });
  const auto prog = engine.progress();
  m.step = prog.step;
  m.micro_step = prog.micro_step;
  m.scaler = prog.scaler;
  m.scaler_kind = int(engine.loss_scaler().kind());
  m.batch = engine.batch();
  m.user_bytes = user_bytes;
  return m;
}
}  // namespace ckpt

// What a save does besides writing the checkpoint (rank 0's options are the ones that count).
struct SaveOptions {
  // Retention: after the save, keep this many checkpoints in the directory, the new one and the
  // newest before it (by position in training), and remove the older ones (ckpt::DirectoryWriter::
  // prune: never one at or past the new one's step, nor one whose manifest does not read). A
  // removal that fails is a warning on stderr, not an error: the save is complete. 0: keep all.
  std::size_t keep_last = 0;
  // How long rank 0 waits for another writer of the directory (zp_ckpt prune, a reshard) to let
  // go of it before the save fails naming the lock (a second job saving there still fails). The
  // other ranks wait meanwhile in the save's agreement, which the communicator's timeout bounds:
  // keep it below that (a wait past it is a timeout error, or an MPI job's abort).
  std::chrono::milliseconds lock_wait{10000};
};

// Saves the engine's complete training state under <dir>/<tag> (checkpoint_format.hpp), with
// an opaque user blob (data position, RNG, schedule state; rank 0's is kept). Collective over the
// engine's grid (every DP, TP and PP rank); only at an accumulation boundary. A tag that already
// exists is an error (checkpoints are never overwritten in place). Each rank writes its own part
// of the model (a tensor-parallel slice with its Placement, a pipeline stage's modules; under
// hybrid sharding the first shard group's ranks, whose replicas hold the same), so the
// checkpoint loads at any grid. Extra memory: none for a host engine's fields in memory (files are
// written straight from its buffers); swapped fields and a device engine's pieces pass through
// host memory one piece at a time.
template <class E>
void save_checkpoint(E& engine, const std::filesystem::path& dir, const std::string& tag,
                     std::span<const std::byte> user = {}, const SaveOptions& options = {}) {
  using T = typename E::value_type;
  engine.expect_at_boundary("save_checkpoint()");
  const auto& part = engine.partition();
  const Layout& L = engine.layout();
  const int w = ckpt::grid_rank_of(engine);
  const bool writes = ckpt::first_replica(engine);
  const std::filesystem::path staging = ckpt::staging_dir(dir, tag);
  ckpt::Manifest m = ckpt::manifest_of(engine, tag, user.size());

  // Every rank must save under the same tag (DeepSpeed's tag_validation "Fail", always on).
  ZP_EXPECT(ckpt::same_over_grid(engine, detail::Fnv1a().all(std::string_view(tag)).value()),
            "checkpoint: the ranks passed different tags to save_checkpoint() (rank ", w, ": '",
            detail::text_excerpt(tag), "'); every rank must save under the same tag");
  ckpt::check_tag(tag);
  std::vector<std::vector<ParamInfo>> parts = ckpt::gather_parts(engine);

  // Rank 0 describes the grid's model, locks the directory and prepares an empty staging
  // directory; every rank learns the description's verdict.
  std::optional<ckpt::Publisher> pub;
  on_every_grid_rank(engine, [&] {
    ckpt::describe_grid(m, std::move(parts));
    ckpt::describe_decay(m, engine);
    if (w == 0 && writes) pub.emplace(dir, tag, options.lock_wait);
  });

  // Every rank writes its pieces straight from the engine's buffers (a swapped field's and a
  // device engine's through a host copy of the piece being written, field by field and segment
  // by segment).
  safetensors::Summary mine{};
  std::vector<std::byte> copy;
  std::span<const std::byte> viewed;  // the current piece in host memory
  std::size_t first = 0;              // its first element's full-layout index
  std::pair<std::size_t, int> current{std::size_t(-1), -1};  // its (field, segment)
  on_every_grid_rank(engine, [&] {
    if (!writes) return;
    std::error_code ec;
    ZP_EXPECT(std::filesystem::is_directory(staging, ec), "checkpoint: rank ", w,
              " does not see the staging directory that rank 0 made for this save: it looked for ",
              staging.string(),
              "; every rank must pass the same directory, on a file system all ranks share");
    mine = ckpt::write_rank_file(
        staging / ckpt::rank_file_name(w, m.world_size), m, L, w, user,
        [&](std::size_t f, std::size_t p, ckpt::Slice s) -> std::span<const std::byte> {
          const auto& lp = L.params()[p];
          const std::size_t elem = f == 0 ? sizeof(T) : sizeof(float);
          if (current != std::pair{f, lp.segment}) {
            ckpt::with_field(
                part, f, lp.segment, Extent::piece, Access::read, [&](auto piece, bool host) {
                  const auto bytes = std::as_bytes(piece.span);
                  if (part.swapped(ckpt::field_of(f)))  // access()'s copy ends with the call
                    copy.assign(bytes.begin(), bytes.end()), viewed = copy;
                  else
                    viewed = host_view<E::memory_space>(bytes, host, copy);
                  first = piece.offset;
                });
            current = {f, lp.segment};
          }
          return viewed.subspan((lp.offset + s.first - first) * elem, s.count * elem);
        });
  });

  // Rank 0 learns every file's size and checksum (the writers'), then publishes.
  std::vector<std::int64_t> sums(2 * std::size_t(m.world_size), 0);
  sums[2 * std::size_t(w)] = std::int64_t(mine.bytes);
  sums[2 * std::size_t(w) + 1] = std::int64_t(mine.crc32c);
  ckpt::reduce_over_grid(engine, std::span<std::int64_t>(sums), ReduceOp::sum);
  for (int i = 0; i < m.world_size; ++i)
    m.files.push_back({ckpt::rank_file_name(i, m.world_size),
                       std::uint64_t(sums[2 * std::size_t(i)]),
                       std::uint32_t(sums[2 * std::size_t(i) + 1])});
  on_every_grid_rank(engine, [&] {
    if (pub) pub->publish(m);
  });
  if (pub)
    for (const std::string& why : pub->prune(options.keep_last).failed)
      std::fprintf(stderr,
                   "zp: checkpoint: saved %s, but an older checkpoint stays (keep_last %zu): %s\n",
                   (dir / tag).c_str(), options.keep_last, why.c_str());
}

namespace ckpt {

// Fills [first, first + out.size()) of the full buffer of layout L (padding zeroed) from
// read(param index, first element, span) by walking L's parameters in that range.
template <class U, class Read>
void fill_range(const Layout& L, std::size_t first, std::span<U> out, Read&& read) {
  std::fill(out.begin(), out.end(), U{});
  const std::size_t end = first + out.size();
  for (int s = 0; s < L.segment_count(); ++s) {
    const auto& seg = L.segment(s);
    if (seg.offset >= end || seg.offset + seg.size <= first) continue;
    for (int pi : seg.params) {
      const auto& p = L.params()[std::size_t(pi)];
      const std::size_t lo = std::max(first, p.offset), hi = std::min(end, p.offset + p.size);
      if (lo < hi) read(std::size_t(pi), lo - p.offset, out.subspan(lo - first, hi - lo));
    }
  }
}

// This rank's parameters against a checkpoint's, by name: a parameter the checkpoint lacks, or
// of another shape or size, is an error naming it and both values. Returns, per parameter, its
// index in the checkpoint and the part to read (its Placement, or the whole tensor).
struct Match {
  std::size_t index = 0;
  Placement part;
};
inline std::vector<Match> match_params(std::span<const ParamInfo> ps, const Reader& rd) {
  const auto& m = rd.manifest();
  const std::string where = rd.path().string();
  std::vector<Match> out;
  for (const auto& p : ps) {
    const int i = rd.find(p.name);
    ZP_EXPECT(i >= 0, "checkpoint ", where, " has no parameter '", p.name,
              "' (the model has it, with ", p.size, " elements; the checkpoint has ",
              m.params.size(), " parameters)");
    const ParamInfo& q = m.params[std::size_t(i)];
    if (p.place.shape.empty() || p.place.is_whole()) {
      ZP_EXPECT(
          q.size == p.size, "checkpoint ", where, ": parameter '", p.name, "' has ", q.size,
          " elements (shape ", dims_text(q.place.shape), ") in the checkpoint but ", p.size,
          " in the model",
          p.tp == TensorParallel::split ? " (a split parameter without a zp::Placement)" : "");
      out.push_back({std::size_t(i), q.place});
    } else {
      // A 1-D checkpoint tensor (version 1, or a model that gave no shape) is the same row-major
      // elements as any shape of its size.
      ZP_EXPECT(q.place.shape == p.place.shape ||
                    (q.place.shape.size() == 1 && q.size == p.place.full_size()),
                "checkpoint ", where, ": parameter '", p.name, "' is of the shape ",
                dims_text(q.place.shape), " in the checkpoint but ", dims_text(p.place.shape),
                " in the model");
      out.push_back({std::size_t(i), p.place});
    }
  }
  return out;
}

// Every parameter of the checkpoint is somewhere in the engine's replica. Collective over the
// grid.
template <class E>
void expect_every_param_loaded(E& engine, const Reader& rd, std::span<const Match> mine) {
  const auto& m = rd.manifest();
  std::vector<std::int64_t> held(m.params.size(), 0);
  for (const Match& x : mine) held[x.index] = 1;
  reduce_over_grid(engine, std::span<std::int64_t>(held), ReduceOp::max);
  on_every_grid_rank(engine, [&] {
    for (std::size_t i = 0; i < held.size(); ++i)
      ZP_EXPECT(held[i], "checkpoint ", rd.path().string(), " has parameter '",
                detail::text_excerpt(m.params[i].name), "' (", m.params[i].size,
                " elements), which the model does not have");
  });
}

// Sets an optimizer's fields from a checkpoint's, by name.
template <class O>
void load_hyper(O& o, const Manifest& m, const std::string& where) {
  ZP_EXPECT(m.optimizer == optim::detail::type_name(o), "checkpoint ", where,
            " was saved with optimizer ", detail::text_excerpt(m.optimizer), ", the engine uses ",
            optim::detail::type_name(o));
  optim::detail::for_each_field(o, [&](const char* key, auto& x) {
    const auto it = m.hyper.find(key);
    ZP_EXPECT(it != m.hyper.end(), "checkpoint ", where, ": optimizer.params has no '", key, "'");
    using V = std::remove_reference_t<decltype(x)>;
    if constexpr (std::is_same_v<V, bool>)
      ZP_EXPECT(it->is_boolean(), "checkpoint ", where, ": optimizer.params.", key,
                " must be a boolean");
    else  // the saved value is a float widened to double: it must narrow back without overflow
      ZP_EXPECT(
          it->is_number() &&
              std::fabs(it->template get<double>()) <= double(std::numeric_limits<V>::max()) &&
              (it->template get<double>() == 0 || V(it->template get<double>()) != 0),
          "checkpoint ", where, ": optimizer.params.", key, " must be a number that a ",
          sizeof(V) * 8, "-bit float holds, got ", detail::json_excerpt(*it));
    x = it->template get<V>();
  });
  detail::with_context([&] { optim::validate(o); },
                       [&](const std::string& why) {
                         return detail::cat("checkpoint ", where, ": optimizer.params: ", why);
                       });
}

}  // namespace ckpt

// Loads <dir>/<tag> ("latest": the newest complete one) into the engine, whatever grid (DP x TP x
// PP) and stage saved it and whatever grid and stage the engine has: parameters, master weights,
// optimizer state and hyper-parameters, step counters and loss scaler; returns the user blob.
// Each rank reads exactly its own part's elements, from whichever files hold them. Collective
// over the engine's grid; only at an accumulation boundary.
// Every file is verified (size and CRC-32C) before anything is read; a mismatch between the
// checkpoint and the model (parameter names or sizes, element type, optimizer) is an error
// naming both values, and leaves the engine's state as it was. A failure after the writing began
// (a file that changed since it was verified, a swap file's I/O) leaves the engine unusable.
template <class E>
std::vector<std::byte> load_checkpoint(E& engine, const std::filesystem::path& dir,
                                       std::string tag = "latest") {
  using T = typename E::value_type;
  using Opt = typename E::optimizer_type;
  engine.expect_at_boundary("load_checkpoint()");
  const Layout& L = engine.layout();
  std::optional<ckpt::Reader> rd;
  std::vector<ckpt::Match> idx;
  Opt opt = engine.optimizer();
  // A `latest` whose files are corrupt or missing names the checkpoints that could be loaded.
  try {
    on_every_grid_rank(engine, [&] {
      rd.emplace(dir, tag);
      const auto& m = rd->manifest();
      const std::string where = rd->path().string();
      ZP_EXPECT(m.dtype == dtype_of<T>, "checkpoint ", where, " holds ", name(m.dtype),
                " parameters, the engine's are ", name(dtype_of<T>));
      ZP_EXPECT(m.micro_step == 0, "checkpoint ", where,
                " was saved inside an accumulation window");
      ZP_EXPECT(m.scaler_kind == int(engine.loss_scaler().kind()), "checkpoint ", where,
                " was saved with loss scaler kind ", m.scaler_kind, ", the engine's is ",
                int(engine.loss_scaler().kind()), " (0 none, 1 fixed, 2 dynamic)");
      ckpt::load_hyper(opt, m, where);
      ckpt::check_decay(engine, m, where);
      ZP_EXPECT(m.fields.size() == std::size_t(2 + optim::state_slots<Opt>), "checkpoint ", where,
                " has ", m.fields.size() - 2, " optimizer state arrays, ",
                optim::detail::type_name(opt), " needs ", optim::state_slots<Opt>);
      idx = ckpt::match_params(engine.params(), *rd);
    });
    // Every rank must read the same checkpoint: a `latest` local to each node, or tags passed
    // differently per rank, would leave the replicas different without any error.
    const std::string tag_read = rd->path().filename().string();
    ZP_EXPECT(
        ckpt::same_over_grid(
            engine, detail::Fnv1a().all(rd->manifest_hash(), std::string_view(tag_read)).value()),
        "checkpoint: the ranks are loading different checkpoints (rank ",
        ckpt::grid_rank_of(engine), ": ", rd->path().string(), ", step ", rd->manifest().step,
        "); every rank must load the same tag of the same directory (is `latest` "
        "local to each node?)");

    ckpt::expect_every_param_loaded(engine, *rd, idx);
    ckpt::verify_everywhere(engine, *rd);
  } catch (const Error& e) {
    if (tag != "latest" || e.category() != Errc::io) throw;
    throw Error(Errc::io, e.message() + ckpt::other_checkpoints(dir), e.native_code(), e.where());
  }
  const auto& m = rd->manifest();

  // Read this rank's ranges, field by field, in the engine's layout.
  const auto& part = engine.partition();
  std::vector<std::byte> user;
  ckpt::writing(engine, "load_checkpoint()", rd->path(), [&] {
    for (int s = 0; s < L.segment_count(); ++s)
      for (std::size_t f = 0; f < m.fields.size(); ++f)
        ckpt::with_field(
            part, f, s, Extent::kept, Access::write, [&]<class U>(Owned<U> dst, bool host) {
              fill_via_host<E::memory_space>(dst.span, host, [&](std::span<U> h) {
                ckpt::fill_range<U>(L, dst.offset, h,
                                    [&](std::size_t p, std::size_t at, std::span<U> out) {
                                      rd->read_part(f, idx[p].index, idx[p].part, at, out);
                                    });
              });
            });
    user = rd->user_blob();
    // Its own checks too (a loss scale too large for this engine's accumulation): after the
    // buffers, so that a failure leaves the engine unusable, not half loaded.
    engine.optimizer() = opt;
    engine.restore({m.step, 0, m.scaler});
  });
  return user;
}

// Writes the whole model (T parameters, or fp32 master weights) by parameter name into
// <dir>/model.safetensors, or split files with an index (see ExportOptions). Collective: the
// model is gathered one segment at a time and rank 0 writes (of the first shard group, under
// hybrid sharding), so no rank holds more than one segment. Tensors appear in the layout's
// (backward) order.
template <class E>
void export_safetensors(E& engine, const std::filesystem::path& dir, const ExportOptions& o = {}) {
  using T = typename E::value_type;
  auto& comm = engine.comm();
  engine.expect_at_boundary("export_safetensors()");
  ckpt::expect_data_parallel(engine, "export_safetensors()");
  const Layout& L = engine.layout();
  const auto& part = engine.partition();
  const bool master = o.master;
  const char* dtype = safetensors::dtype_name(master ? DType::f32 : dtype_of<T>);
  const bool writes = comm.rank() == 0 && ckpt::first_replica(engine);
  std::optional<ckpt::ConsolidatedWriter> out;
  on_every_grid_rank(engine, [&] {
    if (!writes) return;
    std::vector<safetensors::TensorInfo> tensors;
    for (const auto& seg : L.segments())
      for (int pi : seg.params) {
        const auto& p = L.params()[std::size_t(pi)];
        tensors.push_back({p.name, dtype, ckpt::shape_of(o, p.name, p.size)});
      }
    out.emplace(dir, std::move(tensors), o.max_file_bytes, o.progress);
  });
  std::exception_ptr err;  // rank 0's write failure; gathering goes on so no rank waits forever
  auto emit = [&]<class U>(int s, std::span<const U> values, bool host) {
    if (!writes || err) return;
    try {
      std::vector<U> copy;
      const std::span<const U> h = host_view<E::memory_space>(values, host, copy);
      const auto& seg = L.segment(s);
      for (int pi : seg.params) {
        const auto& p = L.params()[std::size_t(pi)];
        out->write(std::as_bytes(h.subspan(p.offset - seg.offset, p.size)));
      }
    } catch (...) {
      err = std::current_exception();
    }
  };
  const std::exception_ptr unread =  // this rank's piece, unread: the gathers went on
      master ? for_each_whole_segment<Field::master>(comm, part, 0, emit)
             : for_each_whole_segment<Field::param>(comm, part, 0, emit);
  on_every_grid_rank(engine, [&] {  // agreed first: rank 0 wrote that rank's piece unread
    if (unread) std::rethrow_exception(unread);
  });
  on_every_grid_rank(engine, [&] {
    if (err) std::rethrow_exception(err);
    if (out) out->finish();
  });
}

// Sets the engine's parameters and fp32 master weights, by name, from safetensors weights (a
// file, an index JSON, or a directory holding model.safetensors or an index), stored as the
// engine's T or as F32 (rounded to T for the parameters). Optimizer state and counters are left
// alone. Collective; every rank reads only its own ranges. A missing or mismatched tensor on any
// rank is an error on all that changes nothing; a failure after the writing began leaves the
// engine unusable.
template <class E>
void load_safetensors(E& engine, const std::filesystem::path& path) {
  using T = typename E::value_type;
  engine.expect_at_boundary("load_safetensors()");
  ckpt::expect_data_parallel(engine, "load_safetensors()");
  const Layout& L = engine.layout();
  const auto& part = engine.partition();
  std::map<std::filesystem::path, safetensors::Reader> open;
  std::vector<std::pair<safetensors::Reader*, const safetensors::TensorInfo*>> src;
  on_every_grid_rank(engine, [&] {  // every rank's checks pass before any rank writes
    const auto files = ckpt::safetensors_files(path);
    for (const auto& p : L.params()) {
      const auto it = files.find(p.name);
      ZP_EXPECT(it != files.end(), "load_safetensors: ", path.string(), " has no tensor '", p.name,
                "'");
      auto r = open.find(it->second);
      if (r == open.end()) r = open.emplace(it->second, safetensors::Reader(it->second)).first;
      const auto& t = r->second.at(p.name);
      ZP_EXPECT(t.elements() == p.size, "load_safetensors: tensor '", p.name, "' in ",
                it->second.string(), " has ", t.elements(), " elements, the model's parameter ",
                p.size);
      ZP_EXPECT(t.dtype == "F32" || t.dtype == safetensors::dtype_name(dtype_of<T>),
                "load_safetensors: tensor '", p.name, "' in ", it->second.string(), " is ", t.dtype,
                "; expected F32 or ", safetensors::dtype_name(dtype_of<T>));
      src.emplace_back(&r->second, &t);
    }
  });
  ckpt::writing(engine, "load_safetensors()", path, [&] {
    // Reads elements of parameter p as U, converting from the stored type.
    auto read = [&]<class U>(std::size_t p, std::size_t first, std::span<U> out) {
      auto& [file, t] = src[p];
      if (t->dtype == safetensors::dtype_name(dtype_of<U>))
        return file->read_elements(t->name, first, out);
      if constexpr (std::is_same_v<U, float>) {
        std::vector<T> tmp(out.size());
        file->read_elements(t->name, first, std::span<T>(tmp));
        Memory<MemorySpace::host>::convert(out, std::span<const T>(tmp));
      } else {
        std::vector<float> tmp(out.size());
        file->read_elements(t->name, first, std::span<float>(tmp));
        Memory<MemorySpace::host>::convert(out, std::span<const float>(tmp));
      }
    };
    for (int s = 0; s < L.segment_count(); ++s)
      for (std::size_t f : {0, 1})  // the parameters and the master weights
        ckpt::with_field(part, f, s, Extent::kept, Access::write,
                         [&]<class U>(Owned<U> dst, bool host) {
                           fill_via_host<E::memory_space>(dst.span, host, [&](std::span<U> h) {
                             ckpt::fill_range<U>(L, dst.offset, h, read);
                           });
                         });
  });
  engine.restore(engine.progress());  // stage 3: drop gathered copies of the old values
}

}  // namespace zp
