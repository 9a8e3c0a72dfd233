// zp/safetensors.hpp: reads and writes the safetensors format of Hugging Face weights, and the
// index of a model split over several files. Needs zp::io (nlohmann_json).
//
// A file is an 8-byte little-endian header length N, N bytes of JSON naming each tensor's dtype,
// shape and byte range [begin, end) within the data that follows, then the data: tensors
// contiguous, row-major, little-endian. The reference implementation is the `safetensors` Python
// package; tests/safetensors_check.py checks that each side reads the other's files bitwise.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "zp/detail/file.hpp"
#include "zp/detail/json.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"

// The format is little-endian and zp moves elements as raw bytes.
static_assert(std::endian::native == std::endian::little,
              "zp/safetensors.hpp assumes a little-endian host");

namespace zp::safetensors {

// ---- Element types -----------------------------------------------------------------------------

// Every dtype string of the format, with its size in bytes.
struct ElementType {
  std::string_view name;
  std::size_t bytes;
};
inline constexpr std::array<ElementType, 15> element_types{{
    {"BOOL", 1},
    {"U8", 1},
    {"I8", 1},
    {"U16", 2},
    {"I16", 2},
    {"U32", 4},
    {"I32", 4},
    {"U64", 8},
    {"I64", 8},
    {"F16", 2},
    {"BF16", 2},
    {"F32", 4},
    {"F64", 8},
    {"F8_E4M3", 1},
    {"F8_E5M2", 1},
}};

// The size of one element of `dtype`, or nothing when the format has no such dtype.
inline std::optional<std::size_t> element_size(std::string_view dtype) noexcept {
  for (const ElementType& e : element_types)
    if (e.name == dtype) return e.bytes;
  return std::nullopt;
}

// The dtype string of a zp element type ("F32", "BF16", ...).
inline const char* dtype_name(DType t) noexcept {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
  }
  return "?";
}

// The zp element type stored as `dtype`, or nothing for dtypes zp does not compute in (U8, ...).
inline std::optional<DType> to_zp(std::string_view dtype) noexcept {
  for (DType t : {DType::f32, DType::f64, DType::i32, DType::i64, DType::bf16, DType::f16})
    if (dtype == dtype_name(t)) return t;
  return std::nullopt;
}

// Readers of the format refuse larger headers (it bounds what a corrupt length can allocate).
inline constexpr std::uint64_t max_header_bytes = 100'000'000;

// One tensor of a file: begin and end are byte offsets relative to the start of the data section.
struct TensorInfo {
  std::string name;
  std::string dtype;
  std::vector<std::uint64_t> shape;  // [] is a scalar (one element)
  std::uint64_t begin = 0, end = 0;

  // The product of the shape (an overflow is an error naming the tensor).
  std::uint64_t elements() const {
    std::uint64_t n = 1;
    for (std::uint64_t d : shape)
      n = zp::detail::checked_mul(n, d, "tensor '", name, "'");  // (a file's: refused on reading)
    return n;
  }
  std::uint64_t bytes() const noexcept { return end - begin; }
};

// What a Writer wrote: the whole file's size and CRC-32C (for a checkpoint's manifest).
struct Summary {
  std::uint64_t bytes;
  std::uint32_t crc32c;
};

namespace detail {
using json = nlohmann::json;

inline std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// product(shape) * element size, or nothing when it does not fit in 64 bits.
inline std::optional<std::uint64_t> byte_size(const std::vector<std::uint64_t>& shape,
                                              std::size_t element) {
  std::uint64_t n = element;
  for (std::uint64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  return n;
}

using zp::detail::json_excerpt;
using zp::detail::text_excerpt;  // a name from a file, for a message

inline std::string known_dtypes() {
  std::string s;
  for (const ElementType& e : element_types) s += (s.empty() ? "" : ", ") + std::string(e.name);
  return s;
}

// Parses the JSON `what` ("header", "index") of `file` strictly (zp/detail/json.hpp): syntax,
// depth and repeated keys are an Errc::io naming the file.
inline json parse_json(const std::filesystem::path& file, std::string_view text, const char* what) {
  return zp::detail::parse_json(text, zp::detail::cat(file.native(), ": ", what), Errc::io);
}
}  // namespace detail

// What the typed write() takes: anything that is its bytes.
template <class T>
concept Plain = std::is_trivially_copyable_v<T>;

// ---- Writer ------------------------------------------------------------------------------------

// Writes one file, streaming: the constructor lays the tensors out in the order given and writes
// the header, write() appends data in that order (any chunking), commit() publishes the file
// atomically and durably (zp::detail::AtomicFile). Destroyed before commit(), it leaves nothing
// under `path`. Memory: the header only, never the data. Put larger elements first (F64, F32,
// then 16-bit) to keep every tensor aligned to its element size; the format does not require it.
class Writer {
 public:
  // `tensors` give name, dtype and shape; their offsets are computed here. Checks that names are
  // unique and non-empty, dtypes known and sizes representable (Errc::invalid_argument).
  Writer(std::filesystem::path path, std::vector<TensorInfo> tensors,
         std::map<std::string, std::string> metadata = {})
      : path_(std::move(path)), tensors_(std::move(tensors)) {
    const std::string& f = path_.native();
    std::set<std::string_view> names;
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < tensors_.size(); ++i) {
      TensorInfo& t = tensors_[i];
      ZP_EXPECT(!t.name.empty(), f, ": tensor #", i, " has an empty name");
      ZP_EXPECT(t.name != "__metadata__", f,
                ": '__metadata__' is reserved and cannot name a tensor");
      const bool first = names.insert(t.name).second;
      ZP_EXPECT(first, f, ": tensor '", detail::text_excerpt(t.name), "' is declared twice");
      const auto size = element_size(t.dtype);
      ZP_EXPECT(size, f, ": tensor '", detail::text_excerpt(t.name), "': unknown dtype '",
                detail::text_excerpt(t.dtype), "' (the format has ", detail::known_dtypes(), ")");
      const auto bytes = detail::byte_size(t.shape, *size);
      const bool fits = bytes && !__builtin_add_overflow(at, *bytes, &t.end);
      ZP_EXPECT(fits, f, ": tensor '", detail::text_excerpt(t.name), "': shape ",
                detail::shape_text(t.shape), " of ", t.dtype, " does not fit in a 64-bit file");
      t.begin = std::exchange(at, t.end);
    }
    total_ = at;
    // The tensors in data order, after the metadata, so the header reads like the file.
    nlohmann::ordered_json h = nlohmann::ordered_json::object();
    if (!metadata.empty()) h["__metadata__"] = metadata;
    for (const TensorInfo& t : tensors_)
      h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
    std::string header;
    try {
      header = h.dump();
    } catch (const nlohmann::json::exception& e) {
      throw Error(
          Errc::invalid_argument,
          zp::detail::cat(f, ": tensor names and metadata must be valid UTF-8: ", e.what()));
    }
    header.resize((header.size() + 7) / 8 * 8, ' ');  // the data starts 8-byte aligned
    ZP_EXPECT(header.size() <= max_header_bytes, f, ": the header takes ", header.size(),
              " bytes, more than readers accept (", max_header_bytes, ")");
    std::array<std::byte, 8> length;
    for (std::size_t i = 0; i < 8; ++i)
      length[i] = std::byte(std::uint64_t(header.size()) >> (8 * i));
    file_.emplace(path_);
    file_->write(length);
    file_->write(std::as_bytes(std::span(header)));
  }

  // Appends data: the next bytes of the tensors in the order given. Writing past the last
  // tensor's end is an error that writes nothing.
  void write(std::span<const std::byte> data) {
    ZP_EXPECT(!committed_, path_.native(), ": write after commit");
    ZP_EXPECT(data.size() <= total_ - written_, path_.native(), ": writing ", data.size(),
              " bytes at data offset ", written_, " runs past the end of ",
              tensors_.empty()
                  ? std::string("the data (no tensors are declared)")
                  : "the last tensor '" + detail::text_excerpt(tensors_.back().name) + "'",
              " at ", total_);
    file_->write(data);
    written_ += data.size();
  }
  // Typed form: for a zp element type, also checks that every tensor it reaches stores T.
  template <Plain T>
  void write(std::span<const T> data) {
    if constexpr (Element<T>) {
      const std::uint64_t stop =
          written_ + std::min<std::uint64_t>(data.size_bytes(), total_ - written_);
      for (auto t = first_unfinished(); t != tensors_.end() && t->begin < stop; ++t)
        ZP_EXPECT(t->bytes() == 0 || t->dtype == dtype_name(dtype_of<T>), path_.native(),
                  ": tensor '", detail::text_excerpt(t->name), "' stores ", t->dtype, ", not ",
                  dtype_name(dtype_of<T>), " (the elements written)");
    }
    write(std::as_bytes(data));
  }

  // Checks every declared byte was written, then publishes the file. Returns its size and CRC.
  Summary commit() {
    ZP_EXPECT(!committed_, path_.native(), ": commit called twice");
    if (written_ != total_) {
      const TensorInfo& t = *first_unfinished();
      throw Error(Errc::invalid_argument,
                  zp::detail::cat(path_.native(), ": tensor '", detail::text_excerpt(t.name),
                                  "' is incomplete: ", written_ - t.begin, " of its ", t.bytes(),
                                  " bytes were written"));
    }
    file_->commit();
    committed_ = true;
    return {file_->bytes(), file_->crc32c()};
  }

  // The tensors with their offsets, in data order.
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  // The first tensor not completely written yet (tensors_.end() once all are).
  std::vector<TensorInfo>::const_iterator first_unfinished() const {
    return std::partition_point(tensors_.begin(), tensors_.end(),
                                [&](const TensorInfo& t) { return t.end <= written_; });
  }

  std::filesystem::path path_;
  std::vector<TensorInfo> tensors_;
  std::uint64_t total_ = 0, written_ = 0;
  bool committed_ = false;
  std::optional<zp::detail::AtomicFile> file_;  // created once the header is known to be valid
};

// ---- Reader ------------------------------------------------------------------------------------

// Opens a file and validates its whole header, so that every range it reports lies in the file:
// a corrupt or hostile file is an Errc::io naming the file, the tensor and the values in
// conflict, never a crash or an allocation beyond the file's size. Tensor data is read on demand
// (pread), never the whole file. Memory: the header.
class Reader {
 public:
  explicit Reader(std::filesystem::path path) : file_(std::move(path)) {
    const std::uint64_t size = file_.size();
    if (size < 8)
      throw corrupt("the file has ", size, " bytes, fewer than the 8 of the header length");
    std::array<std::byte, 8> length;
    file_.read_at(0, length);
    std::uint64_t n = 0;
    for (std::size_t i = 0; i < 8; ++i) n |= std::uint64_t(length[i]) << (8 * i);
    if (n > max_header_bytes)
      throw corrupt("header length ", n, " is more than the limit of ", max_header_bytes);
    if (n > size - 8)
      throw corrupt("header length ", n, " runs past the end of the file (", size, " bytes)");
    std::string header(std::size_t(n), '\0');
    file_.read_at(8, std::as_writable_bytes(std::span(header)));
    data_start_ = 8 + n;
    parse(detail::parse_json(this->path(), header, "header"), size - data_start_);
  }

  const std::filesystem::path& path() const noexcept { return file_.path(); }
  // The tensors in file order (by offset).
  const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }
  // The tensor called `name`; a missing one is an error naming the file and the name.
  const TensorInfo& at(std::string_view name) const {
    const auto it = index_.find(name);
    ZP_EXPECT(it != index_.end(), path().native(), ": no tensor named '",
              detail::text_excerpt(name), "'");
    return tensors_[it->second];
  }
  // The "__metadata__" entries (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
  // Where the data section starts in the file (8 + the header length).
  std::uint64_t data_start() const noexcept { return data_start_; }

  // Reads out.size() bytes of tensor `name` from `byte_offset` on; the range must lie in it.
  void read(std::string_view name, std::uint64_t byte_offset, std::span<std::byte> out) const {
    const TensorInfo& t = at(name);
    ZP_EXPECT(byte_offset <= t.bytes() && out.size() <= t.bytes() - byte_offset, path().native(),
              ": tensor '", detail::text_excerpt(name), "' holds ", t.bytes(),
              " bytes; cannot read ", out.size(), " bytes at byte offset ", byte_offset);
    file_.read_at(data_start_ + t.begin + byte_offset, out);
  }
  // Reads out.size() elements of tensor `name` from element `first_element` on; the tensor must
  // store T (no conversions) and hold the range.
  template <Element T, std::size_t Extent>
  void read_elements(std::string_view name, std::uint64_t first_element,
                     std::span<T, Extent> out) const {
    const TensorInfo& t = at(name);
    const char* want = dtype_name(dtype_of<T>);
    ZP_EXPECT(t.dtype == want, path().native(), ": tensor '", detail::text_excerpt(name),
              "' stores ", t.dtype, ", not ", want, " (the element type asked for)");
    const std::uint64_t n = t.elements();
    ZP_EXPECT(first_element <= n && out.size() <= n - first_element, path().native(), ": tensor '",
              detail::text_excerpt(name), "' has ", n, " elements; cannot read ", out.size(),
              " from element ", first_element);
    read(name, first_element * sizeof(T), std::as_writable_bytes(out));
  }

 private:
  template <class... A>
  Error corrupt(const A&... a) const {
    return Error(Errc::io, zp::detail::cat(path().native(), ": ", a...));
  }

  void parse(const detail::json& h, std::uint64_t data_bytes) {
    using detail::json_excerpt;
    if (!h.is_object()) throw corrupt("header is not a JSON object but ", json_excerpt(h));
    for (const auto& [name, v] : h.items()) {
      if (name == "__metadata__") {
        if (!v.is_object()) throw corrupt("__metadata__ is not an object but ", json_excerpt(v));
        for (const auto& [k, s] : v.items()) {
          if (!s.is_string())
            throw corrupt("__metadata__ entry '", detail::text_excerpt(k), "' is not a string but ",
                          json_excerpt(s));
          metadata_[k] = s.get<std::string>();
        }
        continue;
      }
      tensors_.push_back(tensor(name, v));
    }
    // Contiguous from 0 to the end of the file, sorted by offset: no byte is read as two tensors
    // and no byte is unaccounted for. An empty tensor sorts before a tensor at the same offset;
    // names break the remaining ties, so the order does not depend on the sort.
    std::sort(tensors_.begin(), tensors_.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
    });
    std::uint64_t at = 0;
    const TensorInfo* prev = nullptr;
    for (const TensorInfo& t : tensors_) {
      const std::string range = zp::detail::cat("data_offsets [", t.begin, ", ", t.end, ")");
      if (t.begin < at)
        throw corrupt("tensor '", detail::text_excerpt(t.name), "': ", range, " overlap tensor '",
                      detail::text_excerpt(prev->name), "' at [", prev->begin, ", ", prev->end,
                      ")");
      if (t.begin > at)
        throw corrupt("tensor '", detail::text_excerpt(t.name), "': ", range, " leave a gap after ",
                      prev ? "tensor '" + detail::text_excerpt(prev->name) + "'"
                           : std::string("the start of the data"),
                      " at ", at);
      at = t.end;
      prev = &t;
    }
    if (at != data_bytes)
      throw corrupt("the tensors end at data offset ", at, " but the data section holds ",
                    data_bytes, " bytes (file size minus 8 minus header length ", data_start_ - 8,
                    ")");
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  // One header entry, checked on its own.
  TensorInfo tensor(const std::string& name, const detail::json& v) const {
    using detail::json_excerpt;
    if (!v.is_object())
      throw corrupt("tensor '", detail::text_excerpt(name), "': entry is not an object but ",
                    json_excerpt(v));
    for (const auto& [k, x] : v.items())
      if (k != "dtype" && k != "shape" && k != "data_offsets")
        throw corrupt("tensor '", detail::text_excerpt(name), "': unexpected field '",
                      detail::text_excerpt(k), "' (an entry has dtype, shape and data_offsets)");
    const auto field = [&](const char* k) -> const detail::json& {
      const auto it = v.find(k);
      if (it == v.end())
        throw corrupt("tensor '", detail::text_excerpt(name), "': missing field '", k, "'");
      return *it;
    };
    const auto unsigned_array = [&](const char* k, const detail::json& a) {
      std::vector<std::uint64_t> r;
      if (a.is_array())
        for (const detail::json& x : a) {
          if (!x.is_number_unsigned()) break;
          r.push_back(x.get<std::uint64_t>());
        }
      if (!a.is_array() || r.size() != a.size())
        throw corrupt("tensor '", detail::text_excerpt(name), "': ", k,
                      " is not an array of non-negative integers but ", json_excerpt(a));
      return r;
    };
    TensorInfo t;
    t.name = name;
    const detail::json& dtype = field("dtype");
    if (!dtype.is_string())
      throw corrupt("tensor '", detail::text_excerpt(name), "': dtype is not a string but ",
                    json_excerpt(dtype));
    t.dtype = dtype.get<std::string>();
    const auto size = element_size(t.dtype);
    if (!size)
      throw corrupt("tensor '", detail::text_excerpt(name), "': unknown dtype '",
                    detail::text_excerpt(t.dtype), "'");
    t.shape = unsigned_array("shape", field("shape"));
    const auto offsets = unsigned_array("data_offsets", field("data_offsets"));
    if (offsets.size() != 2)
      throw corrupt("tensor '", detail::text_excerpt(name), "': data_offsets has ", offsets.size(),
                    " entries, not [begin, end]");
    t.begin = offsets[0];
    t.end = offsets[1];
    if (t.begin > t.end)
      throw corrupt("tensor '", detail::text_excerpt(name), "': data_offsets [", t.begin, ", ",
                    t.end, ") end before they begin");
    const auto bytes = detail::byte_size(t.shape, *size);
    if (!bytes)
      throw corrupt("tensor '", detail::text_excerpt(name), "': shape ",
                    detail::shape_text(t.shape), " of ", t.dtype, " holds more than 2^64 bytes");
    if (*bytes != t.bytes())
      throw corrupt("tensor '", detail::text_excerpt(name), "': data_offsets [", t.begin, ", ",
                    t.end, ") hold ", t.bytes(), " bytes but shape ", detail::shape_text(t.shape),
                    " of ", t.dtype, " needs ", *bytes);
    return t;
  }

  zp::detail::InputFile file_;
  std::uint64_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// ---- Split models ------------------------------------------------------------------------------

// The name of shard i (1-based) of n: "model-00001-of-00003.safetensors".
inline std::string shard_file_name(int i, int n) {
  ZP_EXPECT(1 <= i && i <= n, "shard_file_name: shard ", i, " of ", n, " is not in [1, ", n, "]");
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", i, n);
  return buf;
}

// model.safetensors.index.json: which file holds each tensor of a split model, and the total
// size of the tensor data.
struct Index {
  std::uint64_t total_size = 0;
  std::map<std::string, std::string> weight_map;  // tensor name -> file name, in the index's folder
};

// Writes an index atomically: {"metadata": {"total_size": N}, "weight_map": {...}}.
inline void write_index(const std::filesystem::path& index_path, std::uint64_t total_size,
                        const std::map<std::string, std::string>& weight_map) {
  nlohmann::ordered_json j;
  j["metadata"] = {{"total_size", total_size}};
  j["weight_map"] = weight_map;
  std::string text;
  try {
    text = j.dump(2) + "\n";
  } catch (const nlohmann::json::exception& e) {
    throw Error(Errc::invalid_argument,
                zp::detail::cat(index_path.native(), ": names must be valid UTF-8: ", e.what()));
  }
  zp::detail::write_file_atomic(index_path, std::as_bytes(std::span(text)));
}

// Reads and validates an index: metadata.total_size a non-negative integer, weight_map an object
// of tensor names to plain file names (no directories: an index names files next to itself).
inline Index read_index(const std::filesystem::path& path) {
  using detail::json_excerpt;
  const std::string& f = path.native();
  const detail::json j =
      detail::parse_json(path, zp::detail::read_whole_file(path, max_header_bytes), "index");
  const auto bad = [&](const auto&... a) {
    return Error(Errc::io, zp::detail::cat(f, ": ", a...));
  };
  if (!j.is_object()) throw bad("the index is not a JSON object but ", json_excerpt(j));
  const auto meta = j.find("metadata");
  if (meta == j.end() || !meta->is_object()) throw bad("the index has no \"metadata\" object");
  const auto total = meta->find("total_size");
  if (total == meta->end() || !total->is_number_unsigned())
    throw bad("metadata.total_size is not a non-negative integer but ",
              total == meta->end() ? "missing" : json_excerpt(*total));
  const auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object()) throw bad("the index has no \"weight_map\" object");
  Index index{total->get<std::uint64_t>(), {}};
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string())
      throw bad("weight_map entry '", detail::text_excerpt(name), "' is not a file name but ",
                json_excerpt(file));
    const std::string s = file.get<std::string>();
    // (nor one with a control character: the name reaches messages whole, in its file's path)
    if (s.empty() || s == "." || s == ".." || s.find('/') != std::string::npos ||
        detail::text_excerpt(s, SIZE_MAX) != s)
      throw bad("weight_map entry '", detail::text_excerpt(name), "' names '",
                detail::text_excerpt(s), "', not a file next to the index");
    index.weight_map.emplace(name, s);
  }
  return index;
}

}  // namespace zp::safetensors
