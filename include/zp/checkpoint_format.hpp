// zp/checkpoint_format.hpp: zp's checkpoint format, offline: the manifest, reading and
// verifying a checkpoint (ckpt::Reader), writing rank files and publishing them atomically
// (ckpt::Publisher), pruning old ones (ckpt::DirectoryWriter), resharding, and exporting the
// weights as safetensors. No engine and no communicator: the tool zp_ckpt builds on this alone;
// checkpoint.hpp saves and loads engines with it.
//
// Layout on disk: <dir>/<tag>/rank-00000-of-00004.safetensors ... one file per saving rank (of
// the whole DP x TP x PP grid, Megatron's rank order, layout.hpp), and <dir>/<tag>/manifest.json;
// <dir>/latest holds the tag of the newest complete checkpoint. Rank r's file holds, for every
// parameter of its part of the model, the elements of that part that lie in r's ZeRO pieces
// (its data-parallel group's layout), as one tensor per field: "param/<name>" (T),
// "master/<name>" (F32) and one per optimizer state ("exp_avg/<name>", ...); rank 0's also
// "user/blob" (U8). A part that is the whole tensor (replicated over the tensor-parallel group)
// is written by TP rank 0 only. The format is the same for every stage (each rank writes its own
// pieces even where a stage replicates them).
//
// The manifest says where every element is: the grid, the full model's tensors (name, module in
// the whole model, size, shape), and per model-parallel rank (tp + TP * pp) its part: each
// tensor's local module and its box in the full shape (model.hpp's Placement), whose layout over
// the DP ranks gives each file's ranges. A load at any grid and stage reads, for each element
// of its own part, from whichever file holds it: resharding, across DP, TP and PP alike, is a
// read pattern, not a conversion. (Version 1 manifests, data-parallel only, read as a grid of
// world_size x 1 x 1.)
//
// Durability: every file is written under a temporary name, fsynced and renamed; the rank files
// and the manifest go into <dir>/.<tag>.partial, which is renamed to <dir>/<tag> only after
// every rank file is complete; `latest` changes last. A crash at any moment therefore leaves the
// previous checkpoint complete and `latest` pointing at it. Reading verifies the manifest against
// its own checksum (manifest_crc32c), and every file's size and CRC-32C against the manifest
// before using it.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "zp/config.hpp"
#include "zp/detail/file.hpp"
#include "zp/detail/hash.hpp"
#include "zp/detail/json.hpp"
#include "zp/detail/json_keys.hpp"
#include "zp/dtype.hpp"
#include "zp/engine_config.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/precision.hpp"
#include "zp/safetensors.hpp"

namespace zp {

namespace ckpt {

// Version 6 added layout.by_tp_kind, 5 optimizer.no_weight_decay, 4 the loss scaler's
// skipped_in_row, 3 the manifest's own checksum; 5, 4, 3, 2 (without it) and 1 (no grid either)
// are read.
inline constexpr int format_version = 6;
inline constexpr const char* format_name = "zp-checkpoint";

inline std::string rank_file_name(int rank, int ranks) {
  char b[64];
  std::snprintf(b, sizeof b, "rank-%05d-of-%05d.safetensors", rank, ranks);
  return b;
}

// Rank r's elements of parameter p: [first, first + count) of the parameter (count may be 0).
struct Slice {
  std::size_t first = 0, count = 0;
};
inline Slice slice_of(const Layout& L, const Layout::Param& p, int r) {
  const auto& seg = L.segment(p.segment);
  const std::size_t lo = std::max(p.offset, seg.offset + std::size_t(r) * seg.piece);
  const std::size_t hi = std::min(p.offset + p.size, seg.offset + std::size_t(r + 1) * seg.piece);
  return hi > lo ? Slice{lo - p.offset, hi - lo} : Slice{};
}

// [2, 3, 4]
inline std::string dims_text(const std::vector<std::size_t>& d) {
  std::string t = "[";
  for (std::size_t k = 0; k < d.size(); ++k) t += (k ? ", " : "") + std::to_string(d[k]);
  return t + "]";
}

// Whether the rank at tensor-parallel coordinate `tp` writes its part `p` of a parameter: a
// replicated (whole) part only once per TP group.
inline bool writes(const ParamInfo& p, int tp) { return tp == 0 || !p.place.is_whole(); }

// The whole tensor of `p` (its place.shape, or 1-D) as a Placement.
inline Placement whole_of(const ParamInfo& p) {
  Placement w;
  w.shape = p.place.shape.empty() ? std::vector<std::size_t>{p.size} : p.place.shape;
  w.begin.assign(w.shape.size(), 0);
  w.end = w.shape;
  return w;
}

// Everything a checkpoint says besides the tensors.
struct Manifest {
  int version = format_version;  // as read (version 1 has no grid, parts or shapes)
  std::string tag;
  int world_size = 1;  // grid.size(): one file each
  GridShape grid;
  int stage = 0;
  DType dtype = DType::f32;
  LayoutOptions layout;
  // The full model's tensors, forward order: name, module of the whole model, size, and the
  // shape in place.shape (begin/end: the whole).
  std::vector<ParamInfo> params;
  // Per model-parallel rank tp + TP * pp, its parameters as its engine laid them out: name,
  // local module, local size, place (the box in the full shape).
  std::vector<std::vector<ParamInfo>> parts;
  std::vector<std::string> fields;  // "param", "master", then the optimizer state names
  std::string optimizer;            // type name, e.g. "AdamW"
  nlohmann::json hyper = nlohmann::json::object();  // its fields by name
  // The params that take no weight decay (EngineConfig::weight_decay_filter); empty: every one
  // does, as in checkpoints before version 5.
  std::vector<std::string> no_weight_decay;
  std::int64_t step = 0, micro_step = 0;
  int scaler_kind = 0;
  LossScaler::State scaler;
  BatchConfig batch;
  struct File {
    std::string name;
    std::uint64_t bytes = 0;
    std::uint32_t crc32c = 0;
  };
  std::vector<File> files;  // one per rank, rank order
  std::uint64_t user_bytes = 0;

  // Group g's data-parallel layout: file of world rank (tp, dp, pp) holds dp's slices of it.
  Layout layout_of(int g) const { return Layout(parts.at(std::size_t(g)), grid.dp, layout); }
  int group_of(const GridCoords& c) const { return c.tp + grid.tp * c.pp; }
  DType field_dtype(std::size_t f) const { return f == 0 ? dtype : DType::f32; }
};

// The parts of a data-parallel grid: every tensor whole, modules of the whole model.
inline std::vector<std::vector<ParamInfo>> data_parallel_parts(const std::vector<ParamInfo>& ps) {
  std::vector<ParamInfo> all = ps;
  for (auto& p : all) p.place = whole_of(p);
  return {std::move(all)};
}

// The manifest's own checksum (format version 3): CRC-32C of its compact JSON without this key.
// The files' sizes and checksums are in the manifest, so a value changed there (a step counter, a
// hyper-parameter) would otherwise load unnoticed; a manifest only reformatted keeps its values.
inline std::uint32_t manifest_crc32c(nlohmann::json j) {
  j.erase("manifest_crc32c");
  const std::string text = j.dump();
  return detail::crc32c(std::as_bytes(std::span<const char>(text)));
}

inline nlohmann::json to_json(const Manifest& m) {
  using nlohmann::json;
  json j;
  j["format"] = format_name;
  j["version"] = format_version;
  j["zp_version"] = detail::cat(ZP_VERSION_MAJOR, '.', ZP_VERSION_MINOR, '.', ZP_VERSION_PATCH);
  j["tag"] = m.tag;
  j["world_size"] = m.world_size;
  j["grid"] = {{"dp", m.grid.dp}, {"tp", m.grid.tp}, {"pp", m.grid.pp}};
  j["stage"] = m.stage;
  j["dtype"] = name(m.dtype);
  j["layout"] = {{"bucket_elems", m.layout.bucket_elems},
                 {"first_bucket_elems", m.layout.first_bucket_elems},
                 {"align", m.layout.align},
                 {"by_tp_kind", m.layout.by_tp_kind}};
  json ps = json::array();
  for (const auto& p : m.params)
    ps.push_back(
        {{"name", p.name}, {"module", p.module}, {"size", p.size}, {"shape", whole_of(p).shape}});
  j["params"] = std::move(ps);
  json parts = json::array();
  for (const auto& g : m.parts) {
    json part = json::array();
    for (const auto& p : g)
      part.push_back(
          {{"name", p.name}, {"module", p.module}, {"begin", p.place.begin}, {"end", p.place.end}});
    parts.push_back(std::move(part));
  }
  j["parts"] = std::move(parts);
  j["fields"] = m.fields;
  j["optimizer"] = {
      {"type", m.optimizer}, {"params", m.hyper}, {"no_weight_decay", m.no_weight_decay}};
  j["progress"] = {{"step", m.step},
                   {"micro_step", m.micro_step},
                   {"loss_scaler",
                    {{"kind", m.scaler_kind},
                     {"scale", m.scaler.scale},
                     {"iter", m.scaler.iter},
                     {"last_overflow", m.scaler.last_overflow},
                     {"hysteresis", m.scaler.hysteresis},
                     {"skipped", m.scaler.skipped},
                     {"skipped_in_row", m.scaler.skipped_in_row}}}};
  j["batch"] = {{"train_batch_size", m.batch.train_batch_size},
                {"micro_batch_per_rank", m.batch.micro_batch_per_rank},
                {"gradient_accumulation_steps", m.batch.gradient_accumulation_steps}};
  json fs = json::array();
  for (const auto& f : m.files)
    fs.push_back({{"name", f.name}, {"bytes", f.bytes}, {"crc32c", f.crc32c}});
  j["files"] = std::move(fs);
  j["user_bytes"] = m.user_bytes;
  j["manifest_crc32c"] = manifest_crc32c(j);
  return j;
}

// Checks a tag is usable as a directory name on every system and in every message: 1 to 200
// characters from [A-Za-z0-9._+-], not starting with '.' (hidden and "..", and zp's staging
// names), not "latest". Applies to saved tags, loaded tags and what `latest` holds.
inline void check_tag(std::string_view tag, std::string_view where = "tag") {
  auto ok_char = [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-' || c == '+';
  };
  std::string bad;
  for (char c : tag)
    if (!ok_char(c) && bad.empty())
      bad = c >= 0x20 && c < 0x7f
                ? detail::cat(" (it contains '", c, "')")
                : detail::cat(" (it contains the byte 0x", "0123456789abcdef"[(c >> 4) & 15],
                              "0123456789abcdef"[c & 15], ")");
  ZP_EXPECT(
      !tag.empty() && tag.size() <= 200 && tag.front() != '.' && tag != "latest" && bad.empty(),
      "checkpoint: ", where, " '", detail::text_excerpt(tag), "'", bad,
      " is not a checkpoint tag: expected 1 to 200 of the characters A-Z a-z 0-9 . _ - +, not "
      "starting with "
      "'.', and not 'latest'");
}

// The largest values a manifest may hold: beyond any real run, small enough that no arithmetic
// on them overflows (ranks * align, elements * bytes).
inline constexpr std::int64_t max_ranks = std::int64_t(1) << 24;
inline constexpr std::int64_t max_elements = std::int64_t(1) << 48;

// ---- reading a manifest: its keys, each declared once ------------------------------------------
// A table per JSON object of the manifest, walked by detail/json_keys.hpp (types, ranges,
// "missing", the key path in every message); the functions here read the arrays and check what
// spans keys (names unique, modules in order, the files large enough for the parameters). Every
// key is required but those version 1 lacks (grid, parts, a parameter's shape), versions 1-3
// (skipped_in_row), 1-4 (no_weight_decay) and 1-5 (by_tp_kind), which the readers require from
// the version that added them once the tables are read; keys no table declares (zp_version, or
// one a newer zp adds) are skipped, and manifest_crc32c (version 3) is checked last. The integers
// are JSON integers (zp writes no others), each in the range of the member it lands in.
namespace schema {

using namespace zp::detail::keys;  // the strict reader: Key, Spec, read_object, ...
using json = nlohmann::json;

inline constexpr std::int64_t int_max = std::numeric_limits<int>::max();
inline constexpr std::int64_t i64_max = std::numeric_limits<std::int64_t>::max();

// A required integer in [lo, hi] ("expected an integer in [lo, hi]"), a required string.
constexpr Spec whole(std::int64_t lo, std::int64_t hi = i64_max) {
  return integer(0, lo, hi, {}).require("missing");
}
constexpr Spec str() { return text("a string").require("missing"); }

// format and version, read before anything else: another format or version is named as such.
struct Header {
  int format = 0;
  std::int64_t version = 0;
};
inline constexpr Choice formats[] = {{format_name, 1}};
using HeaderKey = Key<Header>;
inline constexpr HeaderKey header_keys[] = {
    HeaderKey::read(
        "format",
        choice(formats, "\"zp-checkpoint\" (a zp checkpoint manifest)", 0).require("missing"),
        [](auto& h) -> auto& { return h.format; }),
    HeaderKey::read(
        "version", whole(1), [](auto& h) -> auto& { return h.version; })};

// A list of 1 to 8 integers in [lo, max_elements] (a shape, a box's corner).
inline std::vector<std::size_t> read_dims(const Ctx& c, const json& v, const std::string& path,
                                          std::int64_t lo) {
  if (!v.is_array() || v.empty() || v.size() > 8)
    c.fail(path, "expected an array of 1 to 8 integers, got ", show(v));
  std::vector<std::size_t> d;
  for (std::size_t k = 0; k < v.size(); ++k)
    d.push_back(std::size_t(as_int(c, v[k], detail::cat(path, "[", k, "]"), lo, max_elements, {})));
  return d;
}

using ParamKey = Key<ParamInfo>;
inline constexpr ParamKey param_keys[] = {
    ParamKey::read(
        "name", str(), [](auto& p) -> auto& { return p.name; }),
    ParamKey::read(
        "module", whole(0, int_max), [](auto& p) -> auto& { return p.module; }),
    ParamKey::read(
        "size", whole(1, max_elements), [](auto& p) -> auto& { return p.size; }),
    ParamKey::custom("shape", [](const Ctx& c, const json& v, const std::string& path,
                                 ParamInfo& p) {
      p.place.shape = read_dims(c, v, path, 1);
    }).if_given()};

// A part of a grid: the tensor's name, its module in the part, its box.
inline constexpr ParamKey part_keys[] = {
    ParamKey::read(
        "name", str(), [](auto& p) -> auto& { return p.name; }),
    ParamKey::read(
        "module", whole(0, int_max), [](auto& p) -> auto& { return p.module; }),
    ParamKey::custom("begin", [](const Ctx& c, const json& v, const std::string& path,
                                 ParamInfo& p) { p.place.begin = read_dims(c, v, path, 0); })
        .require("missing"),
    ParamKey::custom("end", [](const Ctx& c, const json& v, const std::string& path, ParamInfo& p) {
      p.place.end = read_dims(c, v, path, 1);
    }).require("missing")};

using GridKey = Key<GridShape>;
inline constexpr GridKey grid_keys[] = {
    GridKey::read(
        "dp", whole(1, max_ranks), [](auto& g) -> auto& { return g.dp; }),
    GridKey::read(
        "tp", whole(1, max_ranks), [](auto& g) -> auto& { return g.tp; }),
    GridKey::read(
        "pp", whole(1, max_ranks), [](auto& g) -> auto& { return g.pp; })};

using FileKey = Key<Manifest::File>;
inline constexpr FileKey file_keys[] = {
    FileKey::read(
        "name", str(), [](auto& f) -> auto& { return f.name; }),
    FileKey::read(
        "bytes", whole(8, std::int64_t(1) << 56), [](auto& f) -> auto& { return f.bytes; }),
    FileKey::read(
        "crc32c", whole(0, 0xffffffffLL), [](auto& f) -> auto& { return f.crc32c; })};

using LayoutKey = Key<LayoutOptions>;
inline constexpr LayoutKey layout_keys[] = {
    LayoutKey::read(
        "bucket_elems", whole(1, max_elements), [](auto& o) -> auto& { return o.bucket_elems; }),
    LayoutKey::read(
        "first_bucket_elems", whole(1, max_elements),
        [](auto& o) -> auto& { return o.first_bucket_elems; }),
    LayoutKey::read(
        "align", whole(1, std::int64_t(1) << 20), [](auto& o) -> auto& { return o.align; }),
    LayoutKey::read(  // absent: false, which only versions before 6 may be (manifest_from_json)
        "by_tp_kind", boolean(false), [](auto& o) -> auto& { return o.by_tp_kind; })};

using BatchKey = Key<BatchConfig>;
inline constexpr BatchKey batch_keys[] = {
    BatchKey::read(
        "train_batch_size", whole(0), [](auto& b) -> auto& { return b.train_batch_size; }),
    BatchKey::read(
        "micro_batch_per_rank", whole(0), [](auto& b) -> auto& { return b.micro_batch_per_rank; }),
    BatchKey::read(
        "gradient_accumulation_steps", whole(0),
        [](auto& b) -> auto& { return b.gradient_accumulation_steps; })};

// The tag: a string that check_tag accepts.
inline void read_tag(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  m.tag = as_string(c, v, path, "a string");
  c.checked(path, [&] { check_tag(m.tag); });
}

// The parameters, forward order: each named once, modules counting up from 0 in steps of 0 or 1
// (the layout's rule, so none exceeds its index), at most max_elements elements in all.
inline void read_params(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  if (!v.is_array() || v.empty()) c.fail(path, "expected a non-empty array, got ", show(v));
  std::set<std::string, std::less<>> names;
  std::int64_t elements = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string at = detail::cat(path, "[", i, "]");
    ParamInfo p;
    read_object(c, v[i], at, param_keys, p);
    if (std::size_t(p.module) > i)
      c.fail(join(at, "module"), "expected an integer in [0, ", i, "], got ", p.module);
    if (!names.insert(p.name).second)
      c.fail(join(at, "name"), "the parameter ", detail::text_excerpt(p.name), " appears twice");
    if (m.version >= 2 && p.place.shape.empty()) c.fail(join(at, "shape"), "missing");
    std::size_t n = 1;  // the shape's elements, stopping before any overflow
    for (std::size_t d : p.place.shape) n = n > p.size ? n : n * d;
    if (!p.place.shape.empty() && n != p.size)
      c.fail(join(at, "shape"), "the shape does not hold ", p.size, " elements (size)");
    p.place = whole_of(p);
    elements += std::int64_t(p.size);
    if (elements > max_elements)
      c.fail(join(at, "size"), "the parameters add up to more than ", max_elements, " elements");
    m.params.push_back(std::move(p));
  }
}

// The grid (version 1: absent, world_size x 1 x 1): its ranks must be world_size.
inline void read_grid(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  read_object(c, v, path, grid_keys, m.grid);
  if (std::int64_t(m.grid.dp) * m.grid.tp * m.grid.pp != m.world_size)
    c.fail(path, "dp x tp x pp = ", m.grid.dp, " x ", m.grid.tp, " x ", m.grid.pp,
           " is not world_size ", m.world_size);
}

// Each model-parallel rank's part (params, read before): tp x pp lists of tensors the params name,
// each at most once per part, with a box inside the tensor's shape; modules as read_params checks.
inline void read_parts(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  const std::size_t groups = std::size_t(m.grid.tp) * std::size_t(m.grid.pp);
  if (!v.is_array() || v.size() != groups)
    c.fail(path, "expected ", groups, " parts (tp x pp), got ",
           v.is_array() ? detail::cat(v.size()) : show(v));
  std::map<std::string, std::size_t, std::less<>> index;
  for (std::size_t i = 0; i < m.params.size(); ++i) index.emplace(m.params[i].name, i);
  for (std::size_t g = 0; g < groups; ++g) {
    const std::string gp = detail::cat(path, "[", g, "]");
    if (!v[g].is_array() || v[g].empty())
      c.fail(gp, "expected a non-empty array, got ", show(v[g]));
    std::set<std::string, std::less<>> names;
    std::vector<ParamInfo> part;
    for (std::size_t i = 0; i < v[g].size(); ++i) {
      const std::string at = detail::cat(gp, "[", i, "]");
      ParamInfo p;
      read_object(c, v[g][i], at, part_keys, p);
      const auto it = index.find(p.name);
      if (it == index.end())
        c.fail(join(at, "name"), "no parameter ", detail::text_excerpt(p.name), " in params");
      if (!names.insert(p.name).second)
        c.fail(join(at, "name"), "the parameter ", detail::text_excerpt(p.name), " appears twice");
      if (std::size_t(p.module) > i)
        c.fail(join(at, "module"), "expected an integer in [0, ", i, "], got ", p.module);
      p.place.shape = m.params[it->second].place.shape;
      c.checked(at, [&] { p.place.check("the part"); });
      p.size = p.place.size();
      // As the engine's model gave it (a grid's split parameters have their Placement), for the
      // layout (LayoutOptions::by_tp_kind).
      p.tp = p.place.is_whole() ? TensorParallel::replicated : TensorParallel::split;
      part.push_back(std::move(p));
    }
    m.parts.push_back(std::move(part));
  }
}

// The fields: "param", "master", then the optimizer's states; 2 to 16 distinct names, each one a
// tensor name prefix (no '/').
inline void read_fields(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  if (!v.is_array() || v.size() < 2 || v.size() > 16)
    c.fail(path, "expected [\"param\", \"master\", ...] (2 to 16 names), got ",
           v.is_array() ? detail::cat(v.size(), " names") : show(v));
  for (const json& f : v) {
    if (!f.is_string() || f.get_ref<const std::string&>().empty() ||
        f.get_ref<const std::string&>().find('/') != std::string::npos)
      c.fail(path, "expected non-empty names without '/', got ", show(f));
    if (std::find(m.fields.begin(), m.fields.end(), f.get_ref<const std::string&>()) !=
        m.fields.end())
      c.fail(path, "the name ", show(f), " appears twice");
    m.fields.push_back(f.get<std::string>());
  }
  if (m.fields[0] != "param" || m.fields[1] != "master")
    c.fail(path, "expected [\"param\", \"master\", ...]");
}

// The optimizer's hyper-parameters by name: an object (the engine's load reads its keys).
inline void read_hyper(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  if (!v.is_object()) c.fail(path, "expected an object, got ", show(v));
  m.hyper = v;
}

// Names of params (read before), each once.
inline void read_no_decay(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  if (!v.is_array()) c.fail(path, "expected an array of parameter names, got ", show(v));
  std::set<std::string_view> names, seen;
  for (const auto& p : m.params) names.insert(p.name);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string at = detail::cat(path, "[", i, "]");
    if (!v[i].is_string()) c.fail(at, "expected a parameter name, got ", show(v[i]));
    const auto& name = v[i].get_ref<const std::string&>();
    if (!names.contains(name)) c.fail(at, "names no parameter of the checkpoint: ", show(v[i]));
    if (!seen.insert(name).second) c.fail(at, "the parameter ", show(v[i]), " appears twice");
    m.no_weight_decay.push_back(name);
  }
}

// One file per rank (world_size, read before), each named for its rank. The count is checked
// before any entry is read.
inline void read_files(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  if (!v.is_array() || v.size() != std::size_t(m.world_size))
    c.fail(path, "expected ", m.world_size, " entries (one per rank), got ",
           v.is_array() ? detail::cat(v.size()) : show(v));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const std::string at = detail::cat(path, "[", i, "]");
    Manifest::File f;
    read_object(c, v[i], at, file_keys, f);
    const std::string expected = rank_file_name(int(i), m.world_size);
    if (f.name != expected)
      c.fail(join(at, "name"), "expected ", expected, ", got ", detail::text_excerpt(f.name));
    m.files.push_back(std::move(f));
  }
}

// The user data is in rank 0's file (files, read before): at most that file's size.
inline void read_user_bytes(const Ctx& c, const json& v, const std::string& path, Manifest& m) {
  m.user_bytes = std::uint64_t(as_int(c, v, path, 0, std::int64_t(m.files.at(0).bytes), {}));
}

// Errors are Errc::io (a checkpoint is data read from disk) and name the manifest file; unknown
// keys are skipped and integers are JSON integers.
inline Ctx context(const std::string& source) {
  Ctx c;
  c.source = "checkpoint manifest " + source;
  c.errc = Errc::io;
  c.skip_unknown = true;
  c.whole_floats = false;
  return c;
}

using ManifestKey = Key<Manifest>;
constexpr auto whole_manifest = [](Manifest& m) -> Manifest& { return m; };
inline constexpr ManifestKey optimizer_keys[] = {
    ManifestKey::read(
        "type", str(), [](auto& m) -> auto& { return m.optimizer; }),
    ManifestKey::custom("params", read_hyper).require("missing"),
    ManifestKey::custom("no_weight_decay", read_no_decay).if_given()};
inline constexpr ManifestKey loss_scaler_keys[] = {
    ManifestKey::read(
        "kind", whole(0, 2), [](auto& m) -> auto& { return m.scaler_kind; }),
    ManifestKey::read(
        "scale", real_f32(1, Real::positive).require("missing"),
        [](auto& m) -> auto& { return m.scaler.scale; }),
    ManifestKey::read(
        "iter", whole(0), [](auto& m) -> auto& { return m.scaler.iter; }),
    ManifestKey::read(
        "last_overflow", whole(-1), [](auto& m) -> auto& { return m.scaler.last_overflow; }),
    ManifestKey::read(
        "hysteresis", whole(1, int_max), [](auto& m) -> auto& { return m.scaler.hysteresis; }),
    ManifestKey::read(
        "skipped", whole(0), [](auto& m) -> auto& { return m.scaler.skipped; }),
    ManifestKey::read(  // -1: absent, which only versions before 4 may be (manifest_from_json)
        "skipped_in_row", integer(-1, 0, i64_max, {}),
        [](auto& m) -> auto& { return m.scaler.skipped_in_row; })};
inline constexpr ManifestKey progress_keys[] = {
    ManifestKey::read(
        "step", whole(0), [](auto& m) -> auto& { return m.step; }),
    ManifestKey::read(
        "micro_step", whole(0), [](auto& m) -> auto& { return m.micro_step; }),
    ManifestKey::object<loss_scaler_keys>("loss_scaler", whole_manifest).require("missing")};

inline constexpr Choice dtypes[] = {{"f32", std::int64_t(DType::f32)},
                                    {"bf16", std::int64_t(DType::bf16)},
                                    {"f16", std::int64_t(DType::f16)}};

// After format and version, in the order a manifest is checked (a key's reader may use the keys
// above it).
inline constexpr ManifestKey manifest_keys[] = {
    ManifestKey::custom("tag", read_tag).require("missing"),
    ManifestKey::read(
        "world_size", whole(1, max_ranks), [](auto& m) -> auto& { return m.world_size; }),
    ManifestKey::custom("grid", read_grid).if_given(),
    ManifestKey::read(
        "stage", whole(0, 3), [](auto& m) -> auto& { return m.stage; }),
    ManifestKey::read(
        "dtype", choice(dtypes, "f32, bf16 or f16", 0).require("missing"),
        [](auto& m) -> auto& { return m.dtype; }),
    ManifestKey::object<layout_keys>(
        "layout", [](auto& m) -> auto& { return m.layout; })
        .require("missing"),
    ManifestKey::custom("params", read_params).require("missing"),
    ManifestKey::custom("parts", read_parts).if_given(),
    ManifestKey::custom("fields", read_fields).require("missing"),
    ManifestKey::object<optimizer_keys>("optimizer", whole_manifest).require("missing"),
    ManifestKey::object<progress_keys>("progress", whole_manifest).require("missing"),
    ManifestKey::object<batch_keys>(
        "batch", [](auto& m) -> auto& { return m.batch; })
        .require("missing"),
    ManifestKey::custom("files", read_files).require("missing"),
    ManifestKey::custom("user_bytes", read_user_bytes).require("missing")};

// What spans the tables: every element of every field is in some rank's file, so the files must
// be at least that large (checked before anything is allocated for them), and the parameter list
// must lay out.
inline void check_sizes(const Ctx& c, Manifest& m) {
  if (m.parts.empty()) {  // version 1
    if (m.version >= 2) c.fail("parts", "missing");
    m.parts = data_parallel_parts(m.params);
  }
  std::uint64_t elements = 0, file_bytes = 0;
  for (const auto& p : m.params) elements += p.size;  // at most max_elements (read_params)
  for (const auto& f : m.files)
    file_bytes = std::min<std::uint64_t>(file_bytes + f.bytes, std::uint64_t(1)
                                                                   << 62);  // saturates, no wrap
  const std::uint64_t per_element = size_of(m.dtype) + sizeof(float) * (m.fields.size() - 1);
  if (elements * per_element + m.user_bytes > file_bytes)
    c.fail("files", "the files hold ", file_bytes, " bytes in all, fewer than the ", elements,
           " parameter elements need (", per_element, " bytes each over the fields)");
  c.checked("params", [&] { (void)Layout(m.params, 1, m.layout); });  // modules numbered
  for (int g = 0; g < int(m.parts.size()); ++g)                       // and in each part
    c.checked(detail::cat("parts[", g, "]"), [&] { (void)m.layout_of(g); });
}

}  // namespace schema

// Parses a manifest, naming the file and the key of anything missing, malformed or out of range
// (zp::Error(io): "checkpoint manifest <source>: <key path>: <what>"). Every integer must fit the
// field it lands in; sizes are checked against each other (the files must be able to hold the
// parameters) before anything is allocated for them.
inline Manifest manifest_from_json(const nlohmann::json& j, const std::string& source) {
  const schema::Ctx c = schema::context(source);
  schema::Header h;
  schema::read_object(c, j, "", schema::header_keys, h);
  if (h.version > format_version)
    c.fail("version", "format version ", h.version, "; this zp reads versions 1 to ",
           format_version);
  Manifest m;
  m.version = int(h.version);
  m.grid.dp = 0;  // "grid" absent (version 1): data-parallel
  schema::read_object(c, j, "", schema::manifest_keys, m);
  if (m.grid.dp == 0) {
    if (m.version >= 2) c.fail("grid", "missing");
    m.grid = {m.world_size, 1, 1};
  }
  if (m.scaler.skipped_in_row < 0) {
    if (m.version >= 4) c.fail("progress.loss_scaler.skipped_in_row", "missing");
    m.scaler.skipped_in_row = 0;  // not counted before version 4
  }
  if (m.version >= 5 && !j.at("optimizer").contains("no_weight_decay"))
    c.fail("optimizer.no_weight_decay", "missing");
  if (m.version >= 6 && !j.at("layout").contains("by_tp_kind"))
    c.fail("layout.by_tp_kind", "missing");
  schema::check_sizes(c, m);
  if (m.version >= 3) {  // last: a value out of range is named as such, not as a checksum
    const auto it = j.find("manifest_crc32c");
    if (it == j.end()) c.fail("manifest_crc32c", "missing");
    const std::uint32_t crc = manifest_crc32c(j);
    if (!it->is_number_unsigned() || it->get<std::uint64_t>() != crc)
      c.fail("manifest_crc32c", "the manifest's checksum is ", crc, ", the key says ", it->dump(),
             " (the manifest is corrupt)");
  }
  return m;
}

// A saved checkpoint, read without an engine (offline tools, exports, the engine's load): parses
// and checks the manifest, verifies files, and reads any range of any parameter's field by name
// from whichever rank files hold it. Until verify() passes, the manifest's sizes are bounded only
// by the bytes it says its files hold: size buffers by them after it (as reshard does), or read
// in chunks (as the export does).
class Reader {
 public:
  // tag "latest" follows <dir>/latest. Tags follow check_tag, so a load never leaves `dir`.
  Reader(std::filesystem::path dir, std::string tag = "latest") {
    if (tag == "latest") tag = read_latest(dir);
    check_tag(tag);
    path_ = dir / tag;
    const auto manifest = path_ / "manifest.json";
    std::error_code ec;
    ZP_EXPECT(std::filesystem::is_directory(path_, ec), "checkpoint: ", path_.string(),
              " is not a directory (no checkpoint with tag '", tag, "' in ", dir.string(), ")");
    expect_no_link(manifest);
    const std::string text = detail::read_whole_file(manifest, std::uint64_t(1) << 28);
    manifest_hash_ = detail::Fnv1a().all(std::string_view(text)).value();
    m_ = manifest_from_json(
        detail::parse_json(text, "checkpoint manifest " + manifest.string(), Errc::io),
        manifest.string());
    for (std::size_t i = 0; i < m_.params.size(); ++i) by_name_.emplace(m_.params[i].name, i);
    for (const auto& f : m_.files) expect_no_link(path_ / f.name);
    files_.resize(m_.files.size());
    verified_.assign(m_.files.size(), false);
    // Which file holds which elements: every rank's slices of its group's layout.
    sources_.resize(m_.params.size());
    for (int g = 0; g < int(m_.parts.size()); ++g) {
      const Layout L = m_.layout_of(g);
      const GridCoords at{0, g % m_.grid.tp, g / m_.grid.tp};
      for (std::size_t j = 0; j < L.params().size(); ++j) {
        const ParamInfo& part = m_.parts[std::size_t(g)][j];
        if (!writes(part, at.tp)) continue;
        for (int dp = 0; dp < m_.grid.dp; ++dp)
          if (const Slice sl = slice_of(L, L.params()[j], dp); sl.count)
            sources_[by_name_.at(part.name)].push_back(
                {grid_rank(m_.grid, {dp, at.tp, at.pp}), g, j, sl});
      }
    }
  }

  // A checkpoint's files are the ones its save wrote, never links: a link in a hostile
  // checkpoint would make the load read a file outside it. (The tag's directory may be a link.)
  static void expect_no_link(const std::filesystem::path& p) {
    std::error_code ec;
    if (std::filesystem::is_symlink(std::filesystem::symlink_status(p, ec)))
      throw Error(Errc::io, detail::cat("checkpoint file ", p.string(),
                                        " is a symbolic link; a checkpoint's files are the ones "
                                        "its save wrote, never links"));
  }

  // The tag <dir>/latest names: a regular file holding a tag (check_tag), optionally followed by
  // one newline; anything else is an error saying what it holds.
  static std::string read_latest(const std::filesystem::path& dir) {
    const auto p = dir / "latest";
    std::error_code ec;
    ZP_EXPECT(std::filesystem::exists(std::filesystem::symlink_status(p, ec)), "checkpoint: no ",
              p.string(), " (no complete checkpoint in ", dir.string(), " yet)");
    std::string tag = detail::read_whole_file(p, 256);
    if (tag.ends_with('\n')) tag.pop_back();
    check_tag(tag, p.string() + " holds");
    return tag;
  }

  // A fingerprint of the manifest's bytes: ranks that read the same checkpoint agree on it.
  std::uint64_t manifest_hash() const noexcept { return manifest_hash_; }

  const Manifest& manifest() const noexcept { return m_; }
  const std::filesystem::path& path() const noexcept { return path_; }
  std::filesystem::path file_path(int rank) const {
    return path_ / m_.files.at(std::size_t(rank)).name;
  }

  // Checks file `rank` against the manifest: size, then CRC-32C of every byte (`on_read(n)`
  // after each n bytes read). Returns "" or what is wrong, naming the file and both values. A
  // file that passes is not read again by verify().
  std::string verify_file(int rank, const std::function<void(std::uint64_t)>& on_read = {}) const {
    const auto& f = m_.files.at(std::size_t(rank));
    const auto p = file_path(rank);
    std::error_code ec;
    if (!std::filesystem::exists(p, ec))
      return detail::cat("checkpoint file ", p.string(), " is missing");
    try {
      detail::InputFile in(p);
      if (in.size() != f.bytes)
        return detail::cat("checkpoint file ", p.string(), " has ", in.size(),
                           " bytes, the manifest says ", f.bytes,
                           in.size() < f.bytes ? " (truncated)" : "");
      const std::uint32_t crc = in.crc32c_of_all(std::size_t(1) << 20, on_read);
      if (crc != f.crc32c)
        return detail::cat("checkpoint file ", p.string(), " has CRC-32C ", crc,
                           ", the manifest says ", f.crc32c, " (the file is corrupt)");
    } catch (const Error& e) {
      return e.message();
    }
    verified_.at(std::size_t(rank)) = true;
    return {};
  }

  // Index of parameter `name` in the manifest, or -1.
  int find(std::string_view name) const {
    const auto it = by_name_.find(std::string(name));
    return it == by_name_.end() ? -1 : int(it->second);
  }

  // Elements [first, first + out.size()) of field f of parameter p (a manifest index), U being
  // the field's stored type.
  template <class U>
  void read(std::size_t f, std::size_t p, std::size_t first, std::span<U> out) {
    read_part(f, p, m_.params.at(p).place, first, out);
  }

  // The same of a part of parameter p (its box in p's shape; empty or whole: the whole tensor),
  // elements [first, first + out.size()) of the part, row-major, from whichever files hold them:
  // contiguous runs in both the part and a file become one read.
  template <class U>
  void read_part(std::size_t f, std::size_t p, const Placement& part, std::size_t first,
                 std::span<U> out) {
    const ParamInfo& param = m_.params.at(p);
    const Placement& want =
        part.shape.empty() || (part.is_whole() && part.full_size() == param.size) ? param.place
                                                                                  : part;
    // Element indices are the full tensor's, row-major: shapes that differ only by a 1-D
    // checkpoint tensor (version 1) address the same elements.
    ZP_EXPECT(want.shape == param.place.shape ||
                  (param.place.shape.size() == 1 && want.full_size() == param.size),
              "checkpoint ", path_.string(), ": parameter '", param.name, "' has the shape ",
              dims_text(param.place.shape),
              " in the checkpoint; the part asked for is of the shape ", dims_text(part.shape));
    ZP_EXPECT(first + out.size() <= want.size(), "checkpoint: read of elements [", first, ", ",
              first + out.size(), ") of a part of parameter '", param.name, "' with ", want.size());
    const std::string tensor = m_.fields.at(f) + "/" + param.name;
    struct Pending {  // the read being extended: file, element in its tensor, output, count
      int file = -1;
      std::size_t at = 0, out = 0, n = 0;
    } run;
    auto flush = [&] {
      if (run.n) file(run.file).read_elements(tensor, run.at, out.subspan(run.out, run.n));
      run.n = 0;
    };
    want.for_each_run(first, out.size(), [&](std::size_t full, std::size_t local, std::size_t n) {
      for (std::size_t done = 0; done < n;) {
        const auto [src, at, len] = find_source(p, full + done, n - done);
        const std::size_t o = local - first + done;
        if (run.n && run.file == src && run.at + run.n == at && run.out + run.n == o)
          run.n += len;
        else
          flush(), run = {src, at, o, len};
        done += len;
      }
    });
    flush();
  }

  // The same into raw bytes of the field's stored type (out.size() / its size elements).
  void read_bytes(std::size_t f, std::size_t p, std::size_t first, std::span<std::byte> out) {
    const DType dt = m_.field_dtype(f);
    const std::size_t n = out.size() / size_of(dt);
    switch (dt) {
      case DType::f32:
        return read(f, p, first, std::span<float>(reinterpret_cast<float*>(out.data()), n));
      case DType::bf16:
        return read(f, p, first, std::span<bf16>(reinterpret_cast<bf16*>(out.data()), n));
      case DType::f16:
        return read(f, p, first, std::span<fp16>(reinterpret_cast<fp16*>(out.data()), n));
      default: throw Error(Errc::io, detail::cat("checkpoint: unexpected field dtype ", name(dt)));
    }
  }

  // The user blob saved with the checkpoint: rank 0's "user/blob" tensor (U8), whose size must
  // be the manifest's user_bytes.
  std::vector<std::byte> user_blob() {
    auto& f = file(0);
    const std::uint64_t stored = f.contains("user/blob") ? f.at("user/blob").bytes() : 0;
    if (stored != m_.user_bytes || (stored && f.at("user/blob").dtype != "U8"))
      throw Error(Errc::io, detail::cat("checkpoint ", path_.string(),
                                        ": the manifest says the user data has ", m_.user_bytes,
                                        " bytes, ", file_path(0).string(), " holds ", stored,
                                        stored ? " as " + f.at("user/blob").dtype : std::string()));
    std::vector<std::byte> b(m_.user_bytes);
    if (!b.empty()) f.read("user/blob", 0, std::span<std::byte>(b));
    return b;
  }

  // Verifies every file this reader has not yet seen pass (verify_file), so a tool that checks
  // each file before an export or a reshard reads none twice; the first failure is an Errc::io.
  void verify() const {
    for (int r = 0; r < int(m_.files.size()); ++r) {
      if (verified_[std::size_t(r)]) continue;
      if (std::string why = verify_file(r); !why.empty()) throw Error(Errc::io, std::move(why));
    }
  }

 private:
  safetensors::Reader& file(int r) {
    auto& f = files_.at(std::size_t(r));
    if (!f) f.emplace(file_path(r));
    return *f;
  }

  // Where file `rank` holds elements of a parameter: those of its part (`place`) in `slice`.
  struct Source {
    int rank = 0, group = 0;
    std::size_t part = 0;  // in m_.parts[group]
    Slice slice;
  };
  struct Found {
    int rank = 0;
    std::size_t at = 0, count = 0;  // at: element of the file's tensor
  };
  // The file holding full element `full` of parameter p, and how many of the elements from there
  // on (at most `most`, along one row of the shape) it holds in a row.
  Found find_source(std::size_t p, std::size_t full, std::size_t most) const {
    for (const Source& s : sources_[p]) {
      const Placement& b = m_.parts[std::size_t(s.group)][s.part].place;
      std::size_t local = 0, rest = full, row = 0;  // row: elements left in the box's row
      bool inside = true;
      for (std::size_t k = b.shape.size(); k-- > 0 && inside;) {
        const std::size_t x = rest % b.shape[k];
        rest /= b.shape[k];
        inside = x >= b.begin[k] && x < b.end[k];
        if (k + 1 == b.shape.size()) row = b.end[k] - x;
        std::size_t stride = 1;
        for (std::size_t q = k + 1; q < b.shape.size(); ++q) stride *= b.end[q] - b.begin[q];
        local += (x - b.begin[k]) * stride;
      }
      if (!inside || local < s.slice.first || local >= s.slice.first + s.slice.count) continue;
      return {s.rank, local - s.slice.first,
              std::min({most, row, s.slice.first + s.slice.count - local})};
    }
    throw Error(Errc::io,
                detail::cat("checkpoint ", path_.string(), ": no file holds element ", full,
                            " of parameter '", detail::text_excerpt(m_.params[p].name), "'"));
  }

  std::filesystem::path path_;
  std::uint64_t manifest_hash_ = 0;
  Manifest m_;
  std::map<std::string, std::size_t> by_name_;
  std::vector<std::vector<Source>> sources_;  // per parameter
  std::vector<std::optional<safetensors::Reader>> files_;
  mutable std::vector<bool> verified_;  // per file: verify_file passed
};

// Writes the file of world rank w of m's grid (L: its group's layout, m.layout_of): for every
// field and every parameter it writes (ckpt::writes), its slice, in that order, taking the bytes
// from `source(field, param, slice)` (a span of the slice's elements). Returns the file's size
// and CRC-32C.
template <class Source>
safetensors::Summary write_rank_file(const std::filesystem::path& path, const Manifest& m,
                                     const Layout& L, int w, std::span<const std::byte> user,
                                     Source&& source) {
  const GridCoords at = coords_of(m.grid, w);
  const auto& part = m.parts.at(std::size_t(m.group_of(at)));
  ZP_ASSERT(part.size() == L.params().size(), "checkpoint: rank ", w, "'s layout has ",
            L.params().size(), " parameters, its part ", part.size());
  // fp32 fields first, the 16-bit parameters last: every tensor stays aligned to its element.
  std::vector<std::size_t> order;
  for (std::size_t f = 1; f < m.fields.size(); ++f) order.push_back(f);
  order.push_back(0);
  const auto& ps = L.params();
  auto slice = [&](std::size_t p) {
    return writes(part[p], at.tp) ? slice_of(L, ps[p], at.dp) : Slice{};
  };
  std::vector<safetensors::TensorInfo> tensors;
  for (std::size_t f : order)
    for (std::size_t p = 0; p < ps.size(); ++p)
      if (const Slice s = slice(p); s.count)
        tensors.push_back(
            {m.fields[f] + "/" + ps[p].name, safetensors::dtype_name(m.field_dtype(f)), {s.count}});
  if (w == 0 && !user.empty()) tensors.push_back({"user/blob", "U8", {user.size()}});
  safetensors::Writer out(path, std::move(tensors),
                          {{"format", "zp-checkpoint-rank"},
                           {"rank", std::to_string(w)},
                           {"ranks", std::to_string(m.world_size)},
                           {"tag", m.tag}});
  for (std::size_t f : order)
    for (std::size_t p = 0; p < ps.size(); ++p)
      if (const Slice s = slice(p); s.count) out.write(source(f, p, s));
  if (w == 0 && !user.empty()) out.write(user);
  return out.commit();
}

// Creates `dir` and its missing parents, each new entry made durable in its parent: a checkpoint
// published into a directory made for it survives a power cut with that directory.
inline void create_directories_durably(const std::filesystem::path& dir, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = dir.lexically_normal();
  if (p.has_parent_path() && !p.has_filename()) p = p.parent_path();  // "a/b/": "a/b"
  std::vector<fs::path> made;
  for (fs::path q = p; !q.empty() && !fs::exists(fs::symlink_status(q, ec)); q = q.parent_path()) {
    made.push_back(q);
    if (q == q.parent_path()) break;
  }
  fs::create_directories(p, ec);
  if (ec)
    throw Error(Errc::io, detail::cat(what, ": cannot create ", dir.string(), ": ", ec.message()));
  for (const auto& q : made) {  // the deepest first: each parent then holds a durable child
    detail::io_step("directory fsync", q.parent_path());
    detail::sync_directory(q.parent_path());
  }
}

// The directories of `dir` named as tags that hold a manifest.json, with that file's time, newest
// first. Listing errors leave names out (the callers only add to a message or remove less).
inline std::vector<std::pair<std::filesystem::file_time_type, std::string>> checkpoint_tags(
    const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<std::pair<fs::file_time_type, std::string>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    std::string tag = it->path().filename().string();
    std::error_code e2;
    const auto when = fs::last_write_time(it->path() / "manifest.json", e2);
    if (e2 || !fs::is_directory(it->path(), e2)) continue;
    try {
      check_tag(tag);
    } catch (const Error&) {
      continue;
    }
    found.emplace_back(when, std::move(tag));
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  return found;
}

// A checkpoint of a directory as retention sees it: its manifest, or why that does not read.
struct Listed {
  std::string tag;
  std::filesystem::file_time_type when;  // the manifest's
  std::optional<Manifest> manifest;
  std::string error;  // where the manifest does not read
  bool link = false;  // the tag's directory is a symbolic link
};

// The checkpoints of `dir` (checkpoint_tags) in the order of training: by the loss scaler's count
// of optimizer steps, then the manifest's time, then the tag; those whose manifest does not read
// last. Retention (DirectoryWriter::prune) and zp_ckpt list both take this order.
inline std::vector<Listed> checkpoints_in_order(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<Listed> out;
  for (auto& [when, tag] : checkpoint_tags(dir)) {
    Listed c;
    c.tag = std::move(tag), c.when = when;
    std::error_code ec;
    c.link = fs::is_symlink(fs::symlink_status(dir / c.tag, ec));
    try {
      c.manifest = Reader(dir, c.tag).manifest();
    } catch (const Error& e) {
      c.error = e.message();
    }
    out.push_back(std::move(c));
  }
  const auto key = [](const Listed& c) {
    return std::tuple<bool, std::int64_t, fs::file_time_type, const std::string&>(
        !c.manifest, c.manifest ? c.manifest->scaler.iter : 0, c.when, c.tag);
  };
  std::sort(out.begin(), out.end(),
            [&](const Listed& a, const Listed& b) { return key(a) < key(b); });
  return out;
}

// For the error of a load of `latest` that failed on a corrupt or missing file: the other
// checkpoints of `dir` (checkpoint_tags), newest manifest first, at most `most`; "" when there
// are none. Which older step to resume from is the caller's choice, never made silently.
inline std::string other_checkpoints(const std::filesystem::path& dir, std::size_t most = 5) {
  std::string latest;
  try {
    latest = Reader::read_latest(dir);
  } catch (const Error&) {
  }
  auto found = checkpoint_tags(dir);
  std::erase_if(found, [&](const auto& f) { return f.second == latest; });
  if (found.empty()) return "";
  std::string out = detail::cat("; the other checkpoints in ", dir.string(), ", newest first: ");
  for (std::size_t i = 0; i < std::min(most, found.size()); ++i)
    out += (i ? ", " : "") + found[i].second;
  if (found.size() > most) out += detail::cat(" (and ", found.size() - most, " more)");
  return out + " (load one by its tag, or write its tag into " + (dir / "latest").string() +
         " to resume from it)";
}

// Removes every entry of `dir` whose file name `match` accepts (a directory with what it holds),
// durably; `what` begins the error messages.
template <class Match>
void remove_matching(const std::filesystem::path& dir, Match match, const char* what) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::vector<fs::path> gone;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (match(it->path().filename().string())) gone.push_back(it->path());
  if (ec)
    throw Error(Errc::io, detail::cat(what, ": cannot list ", dir.string(), ": ", ec.message()));
  for (const auto& p : gone) {
    fs::remove_all(p, ec);
    if (ec)
      throw Error(Errc::io, detail::cat(what, ": cannot remove ", p.string(), ": ", ec.message()));
  }
  if (!gone.empty()) detail::sync_directory(dir);
}

// Where the files of a save of <dir>/<tag> are written until it is published.
inline std::filesystem::path staging_dir(const std::filesystem::path& dir, const std::string& tag) {
  return dir / ("." + tag + ".partial");
}

// The one writer of a checkpoint directory (a save, a reshard, zp_ckpt's prune): it holds
// <dir>/.zp-save.lock while it lives, so writers never interleave (a second waits up to
// `lock_wait` for the first, then fails naming the lock). Taking the directory completes what
// crashed writers left: a tag published but not named in `latest` (see Publisher) is removed,
// and so are staging directories and temporaries.
class DirectoryWriter {
 public:
  // `dir` must exist.
  explicit DirectoryWriter(std::filesystem::path dir, std::chrono::milliseconds lock_wait = {})
      : dir_(std::move(dir)) {
    std::error_code ec;
    const bool is_dir = std::filesystem::is_directory(dir_, ec);
    ZP_EXPECT(is_dir, "checkpoint: ", dir_.string(),
              ec ? ": " + ec.message() : std::string(" is not a directory"));
    lock_.emplace(dir_, ".zp-save.lock", "checkpoint save", lock_wait);
    roll_back_unnamed();
    remove_leftovers();
  }

  const std::filesystem::path& dir() const noexcept { return dir_; }
  // The publishing intent's file name (Publisher): a tag published but not yet in `latest`,
  // which the next writer removes.
  static constexpr std::string_view intent_name = ".zp-publishing";
  // What taking the directory removed (file names), for a tool to report.
  const std::vector<std::string>& cleaned() const noexcept { return cleaned_; }
  // Whether a file name in a checkpoint directory is what a writer leaves only while it runs or
  // when it crashed: a staging directory (`.<tag>.partial`), a temporary of `latest`, the
  // publishing intent or its temporary.
  static bool unfinished(std::string_view name) noexcept {
    return (name.starts_with(".") && name.ends_with(".partial") && name.size() > 9) ||
           name.starts_with("latest.tmp.") || name.starts_with(intent_name);
  }
  // The tag a crashed publish left unnamed in `dir` (its .zp-publishing note, which the next
  // writer removes with the tag unless `latest` names it); "" where there is no note or it
  // names no tag (not zp's: it writes the note atomically). A note that does not read is an
  // error.
  static std::string publishing(const std::filesystem::path& dir) {
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::symlink_status(dir / intent_name, ec))) return "";
    const detail::InputFile note(dir / intent_name);
    if (note.size() > 256) return "";
    std::string tag(std::size_t(note.size()), '\0');
    note.read_at(0, std::as_writable_bytes(std::span(tag)));
    try {
      check_tag(tag);
    } catch (const Error&) {
      return "";
    }
    return tag;
  }

  struct Pruned {
    std::vector<std::string> removed;  // tags
    std::vector<std::string> failed;   // "path: why", one per tag left in place
  };
  // Keeps `keep` checkpoints, the one `latest` names and the newest of those before it, and
  // removes the older ones (each renamed to its staging name first, so a crash leaves what the
  // next writer removes). Older means an earlier position in training (the loss scaler's count of
  // optimizer steps; the manifest's time between equals). A checkpoint at or past `latest`'s
  // position (a copy of it, a run abandoned for an earlier step), one whose manifest does not
  // read, and a link are never removed, nor counted. Nothing is removed without a readable
  // `latest` (failed says why). A failed removal leaves that tag loadable and goes on.
  Pruned prune(std::size_t keep) {
    Pruned out;
    if (keep == 0) return out;
    std::string latest;
    try {
      latest = Reader::read_latest(dir_);
    } catch (const Error& e) {
      out.failed.push_back(e.message());
      return out;
    }
    const auto all = checkpoints_in_order(dir_);
    const auto counted = [](const Listed& c) { return c.manifest && !c.link; };
    const auto named =
        std::find_if(all.begin(), all.end(), [&](const Listed& c) { return c.tag == latest; });
    if (named == all.end() || !counted(*named)) {
      out.failed.push_back(detail::cat((dir_ / latest).string(), ": `latest` names it but ",
                                       named != all.end() && named->link
                                           ? "it is a symbolic link"
                                           : "its manifest does not read",
                                       "; nothing removed"));
      return out;
    }
    std::size_t kept = 1;                                // latest's
    for (auto c = all.rbegin(); c != all.rend(); ++c) {  // the newest first
      if (!counted(*c) || c->manifest->scaler.iter >= named->manifest->scaler.iter) continue;
      if (kept++ < keep) continue;
      try {
        remove_tag(c->tag);
        out.removed.push_back(c->tag);
      } catch (const Error& e) {
        out.failed.push_back(e.message());
      }
    }
    return out;
  }

 protected:
  std::filesystem::path intent() const { return dir_ / intent_name; }

  static void remove(const std::filesystem::path& p) {
    std::error_code ec;
    std::filesystem::remove_all(p, ec);
    if (ec)
      throw Error(Errc::io,
                  detail::cat("checkpoint: cannot remove ", p.string(), ": ", ec.message()));
  }

 private:
  // What crashed writers left (the lock says none runs; roll_back_unnamed has taken the intent
  // itself): staging directories and temporaries. Tags are never touched.
  void remove_leftovers() {
    remove_matching(
        dir_,
        [this](const std::string& name) {
          if (!unfinished(name)) return false;
          cleaned_.push_back(name);
          return true;
        },
        "checkpoint");
  }

  // Completes what a crashed publish left: its tag, if `latest` does not name it, is removed.
  // A note that names no tag (written atomically, so not by zp) rolls nothing back and goes too.
  void roll_back_unnamed() {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(intent(), ec))) return;
    const std::string tag = publishing(dir_);
    const bool named = tag.empty() || (fs::exists(fs::symlink_status(dir_ / "latest", ec)) &&
                                       Reader::read_latest(dir_) == tag);
    if (!named && fs::exists(fs::symlink_status(dir_ / tag, ec))) {
      remove_tag(tag);
      cleaned_.push_back(tag);
    }
    remove(intent());
    cleaned_.push_back(intent().filename().string());
  }

  // Removes <dir>/<tag>, renamed to its staging name first, so a crash leaves only what the next
  // writer removes (remove_leftovers), never a tag half removed.
  void remove_tag(const std::string& tag) {
    const auto aside = staging_dir(dir_, tag);
    remove(aside);
    detail::io_step("rename", dir_ / tag);
    detail::rename_no_replace(dir_ / tag, aside);
    detail::io_step("directory fsync", dir_);
    detail::sync_directory(dir_);
    detail::io_step("remove", aside);
    remove(aside);
  }

  std::filesystem::path dir_;
  std::optional<detail::DirectoryLock> lock_;
  std::vector<std::string> cleaned_;
};

// One save into <dir>/<tag> (created, with its parents, if missing), from preparing its staging
// directory to naming it in `latest`, as the directory's writer.
//
// A save that did not reach `latest` did not happen. Publishing writes <dir>/.zp-publishing
// (the tag) before renaming the staging directory to the tag and removes it after `latest` names
// the tag, so a crash between the rename and `latest` leaves a complete tag that nothing names
// but that file. The next writer of the directory removes such a tag, as it removes staging
// directories: the run that resumed from `latest` trains to that step again and saves the same
// tag, with the same command line.
class Publisher : public DirectoryWriter {
 public:
  Publisher(const std::filesystem::path& dir, const std::string& tag,
            std::chrono::milliseconds lock_wait = {})
      : DirectoryWriter(made(dir), lock_wait), tag_(tag) {
    namespace fs = std::filesystem;
    std::error_code ec;
    ZP_EXPECT(!fs::exists(fs::symlink_status(dir / tag, ec)), "checkpoint: ", (dir / tag).string(),
              " already exists; save under a new tag (checkpoints are never overwritten)");
    staging_ = staging_dir(dir, tag);
    fs::create_directory(staging_, ec);
    if (ec)
      throw Error(Errc::io,
                  detail::cat("checkpoint: cannot create ", staging_.string(), ": ", ec.message()));
  }

  const std::filesystem::path& staging() const noexcept { return staging_; }

  // The last act of a save: the manifest into the staging directory, the intent noted, the
  // directory renamed to its tag, `latest` pointed at it, the intent removed. With `if_latest`
  // (a copy of that tag), `latest` moves only if it still names that tag (read under the lock):
  // a copy of an older checkpoint, or one made while a newer was saved, never moves it back.
  // Returns whether `latest` names the new tag.
  bool publish(const Manifest& m, const std::optional<std::string>& if_latest = std::nullopt) {
    expect_files(m);
    const std::string text = to_json(m).dump(1);
    detail::write_file_atomic(staging_ / "manifest.json",
                              std::as_bytes(std::span<const char>(text)));
    detail::write_file_atomic(intent(), std::as_bytes(std::span<const char>(tag_)));
    const auto final = dir() / tag_;
    detail::io_step("rename", final);
    detail::rename_no_replace(staging_, final);
    detail::io_step("directory fsync", final);
    detail::sync_directory(dir());
    std::error_code ec;
    const bool move = !if_latest || (std::filesystem::exists(dir() / "latest", ec) &&
                                     Reader::read_latest(dir()) == *if_latest);
    if (move) {
      const std::string latest = tag_ + "\n";
      detail::write_file_atomic(dir() / "latest", std::as_bytes(std::span<const char>(latest)));
    }
    detail::io_step("remove", intent());
    remove(intent());
    return move;
  }

 private:
  static std::filesystem::path made(const std::filesystem::path& dir) {
    create_directories_durably(dir, "checkpoint");
    return dir;
  }

  // Every file the manifest lists is in the staging directory at its size: a rank that wrote
  // its file elsewhere (another directory, a file system this one does not share) never leaves
  // a published checkpoint without it.
  void expect_files(const Manifest& m) const {
    for (std::size_t r = 0; r < m.files.size(); ++r) {
      const auto p = staging_ / m.files[r].name;
      std::error_code ec;
      const auto st = std::filesystem::symlink_status(p, ec);
      const bool file = !ec && std::filesystem::is_regular_file(st);
      const std::uintmax_t size = file ? std::filesystem::file_size(p, ec) : 0;
      if (!file || ec || size != m.files[r].bytes)
        throw Error(Errc::io,
                    detail::cat("checkpoint: not publishing ", (dir() / tag_).string(), ": rank ",
                                r, "'s file ", p.string(),
                                !file ? std::string(" is missing")
                                      : detail::cat(" has ", size, " bytes, not the ",
                                                    m.files[r].bytes, " that rank wrote"),
                                "; every rank must save into the same directory, on a file "
                                "system all ranks share"));
    }
  }

  std::string tag_;
  std::filesystem::path staging_;
};

// What a long operation over a whole model (reshard, an export) reports as it writes: the
// parameter bytes written so far and their total, after each piece.
using Progress = std::function<void(std::uint64_t done, std::uint64_t total)>;

// Writes a copy of a checkpoint laid out for `ranks` data-parallel ranks (of any grid: the
// whole model on each) as <dir>/<tag>, returning whether `latest` names it (offline: no engine,
// no communicator), copying one rank slice at a time (`progress`: after each). Loading it needs
// no resharding, so it suits tools that expect one file per rank; zp itself loads the original
// at any rank count.
inline bool reshard(Reader& rd, const std::filesystem::path& dir, const std::string& tag, int ranks,
                    const Progress& progress = {}) {
  check_tag(tag);
  ZP_EXPECT(ranks >= 1 && ranks <= max_ranks, "reshard: ranks must be in [1, ", max_ranks,
            "], got ", ranks);
  rd.verify();  // sizes and checksums hold, so the buffers below are as large as real data
  Manifest m = rd.manifest();
  m.tag = tag;
  m.world_size = ranks;
  m.grid = {ranks, 1, 1};
  m.parts = data_parallel_parts(m.params);
  m.layout.by_tp_kind = false;  // a data-parallel grid: every part whole
  m.files.clear();
  const Layout L = m.layout_of(0);
  Publisher pub(dir, tag);
  const std::filesystem::path staging = pub.staging();
  const std::vector<std::byte> user = rd.user_blob();
  std::size_t most = 0;
  for (const auto& g : L.segments()) most = std::max(most, g.piece);
  std::vector<std::byte> buf(most * sizeof(float));
  std::uint64_t done = 0, total = 0;  // every element of every field is in one rank's slice
  for (std::size_t f = 0; f < m.fields.size(); ++f)
    for (const auto& p : m.params) total += p.size * size_of(m.field_dtype(f));
  for (int r = 0; r < ranks; ++r) {
    const auto sum = write_rank_file(
        staging / rank_file_name(r, ranks), m, L, r, user,
        [&](std::size_t f, std::size_t p, Slice s) -> std::span<const std::byte> {
          const auto bytes = std::span<std::byte>(buf).first(s.count * size_of(m.field_dtype(f)));
          rd.read_bytes(f, p, s.first, bytes);
          if (progress) progress(done += bytes.size(), total);
          return bytes;
        });
    m.files.push_back({rank_file_name(r, ranks), sum.bytes, sum.crc32c});
  }
  // Into the source's directory, `latest` moves only from the source (never back to an older
  // step); into another, it names the copy.
  std::error_code ec;
  const bool same = std::filesystem::equivalent(rd.path().parent_path(), dir, ec);
  return pub.publish(m, same ? std::optional<std::string>(rd.manifest().tag) : std::nullopt);
}

}  // namespace ckpt

// ---- the model's weights as safetensors ---------------------------------------------------------

struct ExportOptions {
  bool master = false;  // the fp32 master weights instead of the T parameters
  std::uint64_t max_file_bytes =
      0;  // above this, model-0000k-of-n files and an index (0: one file)
  // Each tensor's shape (default: 1-D, the parameter's size); its product must be the size.
  std::function<std::vector<std::uint64_t>(const std::string& name, std::size_t size)> shape = {};
  ckpt::Progress progress = {};  // after each piece written (an engine's export: on rank 0)
};

namespace ckpt {

// Writes whole tensors, in a fixed order, into <dir>/model.safetensors or, above
// max_file_bytes, into <dir>/model-0000k-of-n.safetensors and model.safetensors.index.json. Each
// file is atomic; the index comes last. Holds one file's header, never the data.
class ConsolidatedWriter {
 public:
  ConsolidatedWriter(std::filesystem::path dir, std::vector<safetensors::TensorInfo> tensors,
                     std::uint64_t max_file_bytes, Progress progress = {})
      : dir_(std::move(dir)), tensors_(std::move(tensors)), progress_(std::move(progress)) {
    create_directories_durably(dir_, "export");
    std::uint64_t in_file = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      const std::uint64_t b =
          tensors_[i].elements() * *safetensors::element_size(tensors_[i].dtype);
      if (i == 0 || (max_file_bytes && in_file > 0 && in_file + b > max_file_bytes)) {
        first_.push_back(i);
        in_file = 0;
      }
      in_file += b;
      total_ += b;
    }
    first_.push_back(tensors_.size());
    remove_earlier_export(first_.size() > 2);
  }

  // The next tensor's bytes (whole tensor, or consecutive pieces of it).
  void write(std::span<const std::byte> bytes) {
    if (!w_) open(file_ + 1);
    w_->write(bytes);
    left_ -= std::min<std::uint64_t>(left_, bytes.size());
    if (left_ == 0) next_tensor();
    written_ += bytes.size();
    if (progress_) progress_(written_, total_);
  }

  // Commits the files, in order, and writes the index (split exports). Every tensor must be
  // written. Nothing is published before: an export that fails (on any rank) leaves no file.
  void finish() {
    while (tensor_ < tensors_.size() && tensors_[tensor_].elements() == 0) next_tensor();
    ZP_EXPECT(tensor_ == tensors_.size(), "export: tensor '",
              tensors_[std::min(tensor_, tensors_.size() - 1)].name, "' was not written");
    if (w_) complete_.push_back(std::move(w_));
    for (auto& w : complete_) w->commit();
    complete_.clear();
    const int n = int(first_.size()) - 1;
    if (n > 1) {
      std::map<std::string, std::string> map;
      for (int f = 0; f < n; ++f)
        for (std::size_t i = first_[std::size_t(f)]; i < first_[std::size_t(f) + 1]; ++i)
          map[tensors_[i].name] = safetensors::shard_file_name(f + 1, n);
      safetensors::write_index(dir_ / "model.safetensors.index.json", total_, map);
    }
  }

 private:
  void open(std::size_t f) {
    const int n = int(first_.size()) - 1;
    file_ = f;
    std::vector<safetensors::TensorInfo> mine(tensors_.begin() + std::ptrdiff_t(first_[f - 1]),
                                              tensors_.begin() + std::ptrdiff_t(first_[f]));
    w_ = std::make_unique<safetensors::Writer>(
        dir_ /
            (n == 1 ? std::string("model.safetensors") : safetensors::shard_file_name(int(f), n)),
        std::move(mine), std::map<std::string, std::string>{{"format", "pt"}});
    left_ = tensor_bytes(tensor_);
  }
  std::uint64_t tensor_bytes(std::size_t i) const {
    return tensors_[i].elements() * *safetensors::element_size(tensors_[i].dtype);
  }
  // An earlier export's split files go first (durably): its index would name its own shards over
  // a new single file, and a crash halfway through a new split export would leave it naming a
  // mix of both. Before a split export its single file goes too (readers that look for
  // model.safetensors first would take it); a single file is replaced atomically.
  void remove_earlier_export(bool split) {
    remove_matching(
        dir_,
        [split](const std::string& name) {
          int i = 0, n = 0;
          char rest = 0;
          return name == "model.safetensors.index.json" || (split && name == "model.safetensors") ||
                 (std::sscanf(name.c_str(), "model-%5d-of-%5d.safetensor%c", &i, &n, &rest) == 3 &&
                  rest == 's' && 1 <= i && i <= n && name == safetensors::shard_file_name(i, n));
        },
        "export");
  }
  void next_tensor() {
    ++tensor_;
    if (tensor_ == first_[file_]) {  // that file is complete: committed in finish()
      complete_.push_back(std::move(w_));
      return;
    }
    left_ = tensor_bytes(tensor_);
  }

  std::filesystem::path dir_;
  std::vector<safetensors::TensorInfo> tensors_;
  std::vector<std::size_t> first_;  // first tensor of each file, then tensors_.size()
  std::uint64_t total_ = 0, left_ = 0, written_ = 0;
  std::size_t tensor_ = 0, file_ = 0;
  std::unique_ptr<safetensors::Writer> w_;                      // the file being written
  std::vector<std::unique_ptr<safetensors::Writer>> complete_;  // written, not yet committed
  Progress progress_;
};

inline std::vector<std::uint64_t> shape_of(const ExportOptions& o, const std::string& name,
                                           std::size_t size) {
  if (!o.shape) return {size};
  std::vector<std::uint64_t> s = o.shape(name, size);
  std::uint64_t n = 1;
  for (auto d : s) n *= d;
  ZP_EXPECT(n == size, "export: the shape given for '", name, "' has ", n,
            " elements, the parameter ", size);
  return s;
}

// Where a safetensors model lives: a file, an index, or a directory holding either (both:
// model.safetensors, as transformers' from_pretrained takes it). Maps each tensor name to its
// file.
inline std::map<std::string, std::filesystem::path> safetensors_files(
    const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = path;
  if (fs::is_directory(p, ec))
    p = fs::exists(p / "model.safetensors", ec) ||
                !fs::exists(p / "model.safetensors.index.json", ec)
            ? p / "model.safetensors"
            : p / "model.safetensors.index.json";
  std::map<std::string, fs::path> files;
  if (p.extension() == ".json") {
    const auto idx = safetensors::read_index(p);
    for (const auto& [name, file] : idx.weight_map) files[name] = p.parent_path() / file;
  } else {
    safetensors::Reader r(p);
    for (const auto& t : r.tensors()) files[t.name] = p;
  }
  return files;
}

}  // namespace ckpt

// Writes a saved checkpoint's parameters (T, or fp32 master weights) by name as safetensors,
// like export_safetensors(engine, ...) (checkpoint.hpp) but offline (no engine, no
// communicator), reading one parameter chunk at a time.
inline void export_safetensors(ckpt::Reader& rd, const std::filesystem::path& dir,
                               const ExportOptions& o = {}) {
  rd.verify();
  const auto& m = rd.manifest();
  const std::size_t f = o.master ? 1 : 0;
  const DType dt = m.field_dtype(f);
  std::vector<safetensors::TensorInfo> tensors;
  for (const auto& p : m.params)
    tensors.push_back({p.name, safetensors::dtype_name(dt), ckpt::shape_of(o, p.name, p.size)});
  ckpt::ConsolidatedWriter out(dir, std::move(tensors), o.max_file_bytes, o.progress);
  constexpr std::size_t chunk = std::size_t(1) << 22;  // elements per read
  std::vector<std::byte> buf(chunk * size_of(dt));
  for (std::size_t p = 0; p < m.params.size(); ++p)
    for (std::size_t at = 0; at < m.params[p].size; at += chunk) {
      const std::size_t n = std::min(chunk, m.params[p].size - at);
      const auto bytes = std::span<std::byte>(buf).first(n * size_of(dt));
      rd.read_bytes(f, p, at, bytes);
      out.write(bytes);
    }
  out.finish();
}

}  // namespace zp
