// zp/ds_config.hpp: reads a DeepSpeed ds_config.json and runs the zp::Engine it describes.
// Needs nlohmann/json (CMake target zp::io).
//
//   const zp::ds::Config cfg = zp::ds::load("ds_config.json");   // parsed, checked, defaulted
//   std::printf("%s", zp::ds::describe(cfg).c_str());
//   zp::ds::with_engine<zp::backend::Threads>(cfg, comm.size(),
//       [&]<class E>(std::type_identity<E>, zp::EngineConfig ec, typename E::optimizer_type opt) {
//         MyModel<typename E::value_type> model;
//         E engine(comm, model, ec, opt);
//         ...                                // the training loop of engine.hpp
//       });
//
// What is read (DeepSpeed's configuration JSON, deepspeed.ai/docs/config-json; defaults are DeepSpeed's, which
// differ from zp's own struct defaults in places, e.g. AdamW's weight_decay 0 rather than 0.01):
// the batch triad, fp16 (with its loss scaler) / bf16 / fp32, zero_optimization (stage, bucket
// and stage 3 sizes, offload_optimizer), optimizer (Adam, AdamW, SGD, Lion), scheduler (WarmupLR,
// WarmupDecayLR, WarmupCosineLR, OneCycle), gradient_clipping, steps_per_print,
// wall_clock_breakdown, communication_data_type, data_types.grad_accum_dtype, checkpoint.
//
// Strictness. zp is deliberately stricter than DeepSpeed, which ignores unknown top-level keys
// (a typo such as "zero_optimisation" there silently trains without ZeRO): every key at every
// level must be one zp knows, and a misspelt one names the closest known key. Each key is one
// of
//  - read: it changes the Config;
//  - ignored: DeepSpeed accepts it and for zp it is a harmless no-op, a choice of how (not what)
//    to communicate: overlap_comm, contiguous_gradients, reduce_scatter, allgather_partitions,
//    allgather_bucket_size, round_robin_gradients, stage3_max_reuse_distance, sub_group_size,
//    ignore_unused_parameters, stage3_gather_16bit_weights_on_model_save (zp has no 16-bit model
//    save), memory_breakdown, ...; its type is still checked;
//  - unsupported: DeepSpeed knows it, zp does not do it (offload_param, amp, tensorboard,
//    zero_allow_untested_optimizer, ...). It is an error unless it holds the value that means
//    "off" (false, "none", {"enabled": false}, ...).
// Duplicate keys, wrong types, 1.5 for an integer (5e8 is fine: sizes are written as floats),
// negative sizes, NaN or infinite numbers, fp16 and bf16 both enabled and a batch triad that no
// world size fits are errors too. Every error is a zp::Error(invalid_argument) whose message
// names the source, the full key path and what was expected:
//   ds_config.json: zero_optimization.stage3_max_live_parameters: expected a non-negative integer, got "many"
//
// "auto" (Hugging Face's placeholder) is accepted where the launching program fills values: the
// batch keys ("auto" = not given; resolve_batch completes the triad for the world size) and the
// optimizer's and scheduler's params (the DeepSpeed default is kept). Each such key's path is
// listed in Config::auto_keys so the program can fill it, e.g. from its own flags.
//
// What a Config may hold but zp's engine does not do yet (with_engine raises the error, so the
// value stays visible in describe()): offload_optimizer to "nvme" ("cpu" is ZeRO-Offload,
// EngineConfig::offload_optimizer), and a grad_accum_dtype or communication_data_type other than
// fp32 or the model's element type.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <concepts>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "zp/detail/file.hpp"
#include "zp/detail/json.hpp"
#include "zp/dtype.hpp"
#include "zp/engine.hpp"
#include "zp/error.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/precision.hpp"
#include "zp/schedule.hpp"

namespace zp::ds {

// The model's element type: fp32 (float), fp16 (zp::fp16, dynamic or fixed loss scaling) or
// bf16 (zp::bf16, no loss scaling).
enum class Precision : std::uint8_t { fp32, fp16, bf16 };
// checkpoint.tag_validation: what loading does when the ranks' checkpoint tags differ.
enum class TagValidation : std::uint8_t { warn, ignore, fail };
enum class OffloadDevice : std::uint8_t { none, cpu, nvme };

// zero_optimization.offload_optimizer, kept as read; "cpu" sets EngineConfig::offload_optimizer,
// with_engine rejects "nvme".
struct OffloadOptimizer {
  OffloadDevice device = OffloadDevice::none;
  bool pin_memory = false;  // zp pins its staging buffers either way (speed, not results)
  std::string nvme_path;
};

// The optimizers zp runs, with DeepSpeed's names: "Adam" (decoupled decay unless
// adam_w_mode is false) and "AdamW" -> AdamW, "Adam" with adam_w_mode false -> Adam (L2),
// "SGD" -> Sgd, "Lion" -> Lion.
using AnyOptimizer = std::variant<optim::AdamW, optim::Adam, optim::Sgd, optim::Lion>;

// A parsed, checked ds_config with DeepSpeed's defaults filled in.
struct Config {
  std::string source = "ds_config";  // file name (or the name given to parse), for messages

  // train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps as written;
  // 0 = absent or "auto". with_engine completes them for the world size (resolve_batch).
  BatchConfig batch{};
  Precision precision = Precision::fp32;
  int stage = 0;  // zero_optimization.stage

  // What maps onto zp::EngineConfig: loss_scaler (fp16), max_grad_norm (gradient_clipping),
  // max_live_params (stage3_max_live_parameters; 0 = zp's automatic cap), persist_threshold
  // (stage3_param_persistence_threshold), prefetch (stage3_prefetch_bucket_size != 0).
  // batch and bucket_bytes are set by engine_config<T>(), which knows the world size and T.
  EngineConfig engine = defaults();
  // zero_optimization.reduce_bucket_size and stage3_prefetch_bucket_size, in elements.
  std::uint64_t reduce_bucket_size = 500'000'000;
  std::uint64_t prefetch_bucket_size = 50'000'000;
  OffloadOptimizer offload_optimizer{};

  // The "optimizer" section; without one, DeepSpeed's Adam defaults (AdamW, lr 1e-3, betas
  // 0.9/0.999, eps 1e-8, weight_decay 0) and optimizer_given false.
  AnyOptimizer optimizer = optim::AdamW{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
  bool optimizer_given = false;
  // The "scheduler" section (WarmupCosineLR's base_lr is the optimizer's lr as read: fill both
  // when optimizer.params.lr is "auto"). Schedules step once per applied optimizer step.
  std::optional<schedule::Any> scheduler;

  std::int64_t steps_per_print = 10;
  bool wall_clock_breakdown = false;
  // null = the model's element type (DeepSpeed's default); other values are rejected by with_engine.
  std::optional<DType> grad_accum_dtype;         // data_types.grad_accum_dtype
  std::optional<DType> communication_data_type;  // communication_data_type
  TagValidation tag_validation = TagValidation::warn;

  // Paths of the keys written as "auto", in document order, e.g. "optimizer.params.lr".
  std::vector<std::string> auto_keys;

  // The element type the precision selects: f32, bf16 or f16.
  DType dtype() const noexcept {
    return precision == Precision::bf16 ? DType::bf16 : precision == Precision::fp16 ? DType::f16 : DType::f32;
  }
  bool is_auto(std::string_view key_path) const {
    return std::find(auto_keys.begin(), auto_keys.end(), key_path) != auto_keys.end();
  }

  // DeepSpeed's defaults for what an EngineConfig holds (stage 3: 1e9 live parameters, 1e5
  // persistence threshold, prefetch on).
  static EngineConfig defaults() {
    EngineConfig e;
    e.max_live_params = 1'000'000'000;
    e.persist_threshold = 100'000;
    e.prefetch = 1;
    e.max_grad_norm = 0;
    e.loss_scaler = LossScaler::none();
    return e;
  }
};

namespace detail {

using json = nlohmann::json;

// "fp32", "fp16", "bf16": the spelling of ds_config.json.
inline const char* ds_name(DType t) noexcept {
  return t == DType::f32 ? "fp32" : t == DType::f16 ? "fp16" : t == DType::bf16 ? "bf16" : zp::name(t);
}
inline const char* ds_name(Precision p) noexcept {
  return p == Precision::fp16 ? "fp16" : p == Precision::bf16 ? "bf16" : "fp32";
}
inline const char* ds_name(TagValidation t) noexcept {
  return t == TagValidation::warn ? "Warn" : t == TagValidation::ignore ? "Ignore" : "Fail";
}
inline const char* ds_name(OffloadDevice d) noexcept {
  return d == OffloadDevice::cpu ? "cpu" : d == OffloadDevice::nvme ? "nvme" : "none";
}

inline std::string lower(std::string_view s) {
  std::string r(s);
  for (char& ch : r)
    if (ch >= 'A' && ch <= 'Z') ch = char(ch - 'A' + 'a');
  return r;
}

// Levenshtein distance, case-insensitive (for "did you mean"). The lengths differ by at least
// the distance, so a pair whose lengths differ by more than `limit` is not compared: its
// distance is reported as limit + 1 (a hostile multi-MiB key costs nothing).
inline std::size_t edit_distance(std::string_view a0, std::string_view b0, std::size_t limit = 3) {
  if ((a0.size() > b0.size() ? a0.size() - b0.size() : b0.size() - a0.size()) > limit) return limit + 1;
  const std::string a = lower(a0), b = lower(b0);
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// The closest candidate within edit distance 3 (and not a complete rewrite), or "".
template <class Names>
std::string_view closest(std::string_view word, const Names& names) {
  std::string_view best;
  std::size_t best_d = 4;
  for (std::string_view n : names) {
    const std::size_t d = edit_distance(word, n, 3);
    if (d < best_d && d < n.size()) {
      best = n;
      best_d = d;
    }
  }
  return best;
}

// A key path for messages; a key read from the file is shortened (it may be megabytes long).
inline std::string join(std::string_view path, std::string_view key) {
  const std::string k = zp::detail::text_excerpt(key);
  return path.empty() ? k : std::string(path) + "." + k;
}

// A value for a message: JSON text (strings quoted), shortened; nan and inf by name.
inline std::string show(const json& v) {
  if (v.is_number_float() && !std::isfinite(v.get<double>())) return zp::detail::cat(v.get<double>());
  return zp::detail::json_excerpt(v);
}

inline bool is_auto(const json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

// Where errors come from, and where "auto" keys are recorded.
struct Ctx {
  std::string source;
  std::vector<std::string>* auto_keys = nullptr;

  template <class... Args>
  [[noreturn]] void fail(std::string_view path, const Args&... msg) const {
    throw Error(Errc::invalid_argument,
                path.empty() ? zp::detail::cat(source, ": ", msg...) : zp::detail::cat(source, ": ", path, ": ", msg...));
  }
  // "expected <what>, got <value>", with a hint when the value is an "auto" placed where zp
  // cannot take one.
  [[noreturn]] void expected(std::string_view path, std::string_view what, const json& v) const {
    fail(path, "expected ", what, ", got ", show(v),
         is_auto(v) ? " (\"auto\" is accepted only for the batch sizes and the optimizer's and scheduler's params)"
                    : "");
  }
  void note_auto(std::string path) const {
    if (auto_keys) auto_keys->push_back(std::move(path));
  }
  // Runs f (a zp check), naming the source and key path in any zp::Error it raises.
  template <class F>
  decltype(auto) checked(std::string_view path, F&& f) const {
    try {
      return f();
    } catch (const Error& e) {
      fail(path, e.message());
    }
  }
};

// ---- scalar readers -------------------------------------------------------------------------

inline bool as_bool(const Ctx& c, const json& v, std::string_view path) {
  if (!v.is_boolean()) c.expected(path, "true or false", v);
  return v.get<bool>();
}

inline std::string_view as_string(const Ctx& c, const json& v, std::string_view path, std::string_view what) {
  if (!v.is_string()) c.expected(path, what, v);
  return v.get_ref<const std::string&>();
}

// An integer in [lo, hi]. JSON floats with an integral value (5e8) count: DeepSpeed configs
// write sizes that way.
inline std::int64_t as_int(const Ctx& c, const json& v, std::string_view path, std::int64_t lo, std::int64_t hi,
                           std::string_view what) {
  std::int64_t x = 0;
  if (v.is_number_unsigned()) {
    const std::uint64_t u = v.get<std::uint64_t>();
    if (u > std::uint64_t(std::numeric_limits<std::int64_t>::max())) c.fail(path, "expected ", what, ", got ", show(v));
    x = std::int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<std::int64_t>();
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    if (!std::isfinite(d)) c.fail(path, "expected ", what, ", got ", show(v));
    if (d != std::floor(d)) c.fail(path, "expected ", what, ", got ", show(v), " (not a whole number)");
    if (!(d >= -0x1p63 && d < 0x1p63)) c.fail(path, "expected ", what, ", got ", show(v));
    x = std::int64_t(d);
  } else {
    c.expected(path, what, v);
  }
  if (x < lo || x > hi) c.fail(path, "expected ", what, ", got ", show(v));
  return x;
}

enum class Real : std::uint8_t { finite, non_negative, positive, unit_open, unit_closed };

inline const char* real_what(Real r) noexcept {
  switch (r) {
    case Real::finite: return "a finite number";
    case Real::non_negative: return "a finite number >= 0";
    case Real::positive: return "a finite number > 0";
    case Real::unit_open: return "a number in [0, 1)";
    case Real::unit_closed: return "a number in [0, 1]";
  }
  return "a number";
}

inline double as_real(const Ctx& c, const json& v, std::string_view path, Real r) {
  if (!v.is_number()) c.expected(path, real_what(r), v);
  const double d = v.get<double>();
  bool ok = std::isfinite(d);
  switch (r) {
    case Real::finite: break;
    case Real::non_negative: ok = ok && d >= 0; break;
    case Real::positive: ok = ok && d > 0; break;
    case Real::unit_open: ok = ok && d >= 0 && d < 1; break;
    case Real::unit_closed: ok = ok && d >= 0 && d <= 1; break;
  }
  if (!ok) c.fail(path, "expected ", real_what(r), ", got ", show(v));
  return d;
}

// As as_real, for a value zp keeps as a float: one that overflows a float, or that is not zero
// but rounds to zero (gradient_clipping 1e-50 would silently turn clipping off), is an error.
inline float as_float(const Ctx& c, const json& v, std::string_view path, Real r) {
  const double d = as_real(c, v, path, r);
  if (std::fabs(d) > double(std::numeric_limits<float>::max()) || (d != 0 && float(d) == 0))
    c.fail(path, "expected ", real_what(r), " that a 32-bit float holds (magnitude 1.4e-45 to 3.4e38, or 0), got ",
           show(v));
  return float(d);
}

// ---- objects and their known keys -----------------------------------------------------------

enum class Use : std::uint8_t {
  read,          // the parser reads it
  ignore_bool,   // accepted, no effect on zp; must be true or false
  ignore_size,   // accepted, no effect on zp; must be a non-negative integer
  unsupported,   // known to DeepSpeed, not done by zp: an error unless `off`
  misplaced,     // known to DeepSpeed elsewhere: an error whose message is the hint
};
// The value of an unsupported key that means "off" (accepted, nothing to do).
enum class Off : std::uint8_t { never, is_false, is_true, is_null, number, null_or_number, not_enabled, device_none };

struct Key {
  std::string_view name;
  Use use = Use::read;
  Off off = Off::never;
  double off_number = 0;
  std::string_view hint = {};
};
constexpr Key reads(std::string_view n) { return {n}; }
constexpr Key ignores_bool(std::string_view n) { return {n, Use::ignore_bool}; }
constexpr Key ignores_size(std::string_view n) { return {n, Use::ignore_size}; }
constexpr Key unsupported(std::string_view n, Off off = Off::never, double x = 0) { return {n, Use::unsupported, off, x}; }

inline bool is_off(const Key& k, const json& v) {
  switch (k.off) {
    case Off::never: return false;
    case Off::is_false: return v.is_boolean() && !v.get<bool>();
    case Off::is_true: return v.is_boolean() && v.get<bool>();
    case Off::is_null: return v.is_null();
    case Off::number: return v.is_number() && v.get<double>() == k.off_number;
    case Off::null_or_number: return v.is_null() || (v.is_number() && v.get<double>() == k.off_number);
    case Off::not_enabled: {
      if (!v.is_object()) return false;
      const auto it = v.find("enabled");
      return it == v.end() || (it->is_boolean() && !it->get<bool>());
    }
    case Off::device_none: {
      if (v.is_null()) return true;
      if (!v.is_object()) return false;
      const auto it = v.find("device");
      return it == v.end() || it->is_null() || (it->is_string() && it->get_ref<const std::string&>() == "none");
    }
  }
  return false;
}

inline std::string off_text(const Key& k) {
  switch (k.off) {
    case Off::never: return "";
    case Off::is_false: return " (accepted only as false)";
    case Off::is_true: return " (accepted only as true)";
    case Off::is_null: return " (accepted only as null)";
    case Off::number: return zp::detail::cat(" (accepted only as ", k.off_number, ")");
    case Off::null_or_number: return zp::detail::cat(" (accepted only as null or ", k.off_number, ")");
    case Off::not_enabled: return " (accepted only with \"enabled\": false)";
    case Off::device_none: return " (accepted only with \"device\": \"none\")";
  }
  return "";
}

// One JSON object of the config: checks on construction that it is an object whose every key
// is in `keys` (ignored and unsupported keys are dealt with there), then reads values.
class Obj {
 public:
  Obj(const Ctx& c, const json& j, std::string path, std::span<const Key> keys, bool auto_ok = false)
      : c_(&c), j_(&j), path_(std::move(path)), keys_(keys), auto_ok_(auto_ok) {
    if (!j.is_object()) c.expected(path_, "an object {...}", j);
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& name = it.key();
      const json& v = it.value();
      const Key* k = known(name);
      if (!k) {
        std::vector<std::string_view> names;
        for (const Key& x : keys_) names.push_back(x.name);
        const std::string_view near = closest(name, names);
        std::string msg = near.empty() ? std::string() : zp::detail::cat("; did you mean ", near, "?");
        if (near.empty()) {
          msg = "; zp reads";
          const char* sep = " ";
          for (const Key& x : keys_)
            if (x.use == Use::read) {
              msg += sep;
              msg += x.name;
              sep = ", ";
            }
        }
        c.fail(join(path_, name), "unknown key", msg,
               " (zp rejects keys it does not know, at every level)");
      }
      switch (k->use) {
        case Use::read: break;
        case Use::ignore_bool: as_bool(c, v, join(path_, name)); break;
        case Use::ignore_size:
          as_int(c, v, join(path_, name), 0, std::numeric_limits<std::int64_t>::max(), "a non-negative integer");
          break;
        case Use::unsupported:
          if (!is_off(*k, v))
            c.fail(join(path_, name), "known DeepSpeed key that zp does not support", off_text(*k), ", got ",
                   show(v));
          break;
        case Use::misplaced: c.fail(join(path_, name), k->hint);
      }
    }
  }

  std::string path(std::string_view key) const { return join(path_, key); }
  const std::string& path() const noexcept { return path_; }

  // The value of a key (which must be in the table), or nullptr when absent.
  const json* find(std::string_view key) const {
    const auto it = j_->find(std::string(key));
    return it == j_->end() ? nullptr : &*it;
  }
  // As find, but an "auto" (where this object accepts one) is recorded and reads as absent.
  const json* value(std::string_view key) const {
    const json* v = find(key);
    if (v && auto_ok_ && is_auto(*v)) {
      c_->note_auto(path(key));
      return nullptr;
    }
    return v;
  }
  // The key given under one of two names (DeepSpeed's stage3_ aliases); both is an error.
  std::pair<const json*, std::string> either(std::string_view a, std::string_view b) const {
    const json* va = value(a);
    const json* vb = value(b);
    if (find(a) && find(b))
      c_->fail(path(b), "both ", a, " and its alias ", b, " are given; keep one");
    return va ? std::pair{va, path(a)} : std::pair{vb, path(b)};
  }

  bool boolean(std::string_view key, bool def) const {
    const json* v = value(key);
    return v ? as_bool(*c_, *v, path(key)) : def;
  }
  std::int64_t integer(std::string_view key, std::int64_t def, std::int64_t lo, std::int64_t hi,
                       std::string_view what) const {
    const json* v = value(key);
    return v ? as_int(*c_, *v, path(key), lo, hi, what) : def;
  }
  std::int64_t count(std::string_view key, std::int64_t def) const {
    return integer(key, def, 0, std::numeric_limits<std::int64_t>::max(), "a non-negative integer");
  }
  double real(std::string_view key, double def, Real r) const {
    const json* v = value(key);
    return v ? as_real(*c_, *v, path(key), r) : def;
  }
  // A double that becomes a float at run time (a schedule's learning rate or momentum): it is
  // kept as written, and must be one a float holds.
  double real_f32(std::string_view key, double def, Real r) const {
    const json* v = value(key);
    if (!v) return def;
    (void)as_float(*c_, *v, path(key), r);
    return v->get<double>();
  }
  float real32(std::string_view key, float def, Real r) const {
    const json* v = value(key);
    return v ? as_float(*c_, *v, path(key), r) : def;
  }
  // A key the schedule needs: absent is an error ("auto" is accepted and keeps the default).
  void require(std::string_view key, std::string_view by) const {
    if (!find(key)) c_->fail(path(key), "required by ", by);
  }

 private:
  const Key* known(std::string_view name) const {
    for (const Key& k : keys_)
      if (k.name == name) return &k;
    return nullptr;
  }

  const Ctx* c_;
  const json* j_;
  std::string path_;
  std::span<const Key> keys_;
  bool auto_ok_;
};

// ---- sections -------------------------------------------------------------------------------

inline void read_precision(const Ctx& c, const Obj& root, Config& cfg) {
  static constexpr Key fp16_keys[] = {
      reads("enabled"), reads("loss_scale"), reads("initial_scale_power"), reads("loss_scale_window"),
      reads("hysteresis"), reads("consecutive_hysteresis"), reads("min_loss_scale"),
      unsupported("auto_cast", Off::is_false), unsupported("fp16_master_weights_and_grads", Off::is_false)};
  static constexpr Key bf16_keys[] = {reads("enabled")};

  bool fp16 = false;
  if (const json* v = root.find("fp16")) {
    const Obj o(c, *v, "fp16", fp16_keys);
    fp16 = o.boolean("enabled", false);
    const float fixed = o.real32("loss_scale", 0.0f, Real::non_negative);
    const auto power = o.integer("initial_scale_power", 16, 0, 127, "an integer in [0, 127] (the scale is 2^power)");
    const auto window = o.integer("loss_scale_window", 1000, 1, std::numeric_limits<std::int64_t>::max(),
                                  "a positive integer");
    const auto hysteresis = o.integer("hysteresis", 2, 1, std::numeric_limits<int>::max(), "a positive integer");
    const bool consecutive = o.boolean("consecutive_hysteresis", false);
    const float min_scale = o.real32("min_loss_scale", 1.0f, Real::positive);
    const double initial = std::ldexp(1.0, int(power));
    if (min_scale > initial)
      c.fail(o.path("min_loss_scale"), "must be <= the initial scale 2^initial_scale_power = ", initial, ", got ",
             min_scale);
    if (fp16)
      cfg.engine.loss_scaler = c.checked("fp16", [&] {
        return fixed > 0 ? LossScaler::fixed(fixed)
                         : LossScaler::dynamic(DynamicScale{.initial_scale = float(initial),
                                                            .window = window,
                                                            .hysteresis = int(hysteresis),
                                                            .consecutive_hysteresis = consecutive,
                                                            .min_scale = min_scale});
      });
  }
  const json* bf = root.find("bf16");
  std::string bf_name = "bf16";
  if (const json* old = root.find("bfloat16")) {
    if (bf) c.fail("bfloat16", "both bf16 and its older name bfloat16 are given; keep one");
    bf = old;
    bf_name = "bfloat16";
  }
  bool bf16 = false;
  if (bf) bf16 = Obj(c, *bf, bf_name, bf16_keys).boolean("enabled", false);
  if (fp16 && bf16)
    c.fail(join(bf_name, "enabled"), "fp16 and ", bf_name, " are both enabled; enable one (bf16 needs no loss scaling)");
  cfg.precision = fp16 ? Precision::fp16 : bf16 ? Precision::bf16 : Precision::fp32;
}

inline void read_zero(const Ctx& c, const json& j, Config& cfg) {
  static constexpr Key offload_keys[] = {reads("device"), reads("nvme_path"), reads("pin_memory"),
                                         // Partial offload: zp offloads all of the optimizer or none.
                                         unsupported("ratio", Off::number, 1),
                                         ignores_size("buffer_count"), ignores_bool("fast_init"),
                                         ignores_bool("pipeline_read"), ignores_bool("pipeline_write"),
                                         ignores_bool("pipeline")};
  static constexpr Key keys[] = {
      reads("stage"), reads("reduce_bucket_size"), reads("stage3_prefetch_bucket_size"),
      reads("prefetch_bucket_size"), reads("stage3_param_persistence_threshold"),
      reads("param_persistence_threshold"), reads("stage3_max_live_parameters"), reads("max_live_parameters"),
      reads("offload_optimizer"),
      // How, not what, to communicate: no effect on zp.
      ignores_bool("contiguous_gradients"), ignores_bool("reduce_scatter"), ignores_bool("allgather_partitions"),
      ignores_bool("overlap_comm"), ignores_bool("round_robin_gradients"), ignores_size("allgather_bucket_size"),
      ignores_size("stage3_max_reuse_distance"), ignores_size("max_reuse_distance"), ignores_size("sub_group_size"),
      ignores_bool("ignore_unused_parameters"), ignores_bool("load_from_fp32_weights"),
      ignores_bool("stage3_gather_16bit_weights_on_model_save"), ignores_bool("gather_16bit_weights_on_model_save"),
      ignores_bool("stage3_gather_fp16_weights_on_model_save"), ignores_bool("memory_efficient_linear"),
      ignores_bool("override_module_apply"), ignores_bool("use_multi_rank_bucket_allreduce"),
      ignores_bool("log_trace_cache_warnings"),
      // Known to DeepSpeed, not done by zp.
      unsupported("offload_param", Off::device_none), unsupported("cpu_offload", Off::is_false),
      unsupported("cpu_offload_params", Off::is_false), unsupported("cpu_offload_use_pin_memory", Off::is_false),
      unsupported("elastic_checkpoint", Off::is_false), unsupported("legacy_stage1", Off::is_false),
      unsupported("zero_hpz_partition_size", Off::number, 1), unsupported("zero_quantized_weights", Off::is_false),
      unsupported("zero_quantized_nontrainable_weights", Off::is_false),
      unsupported("zero_quantized_gradients", Off::is_false), unsupported("mics_shard_size", Off::number, -1),
      unsupported("mics_hierarchical_params_gather", Off::is_false),
      unsupported("stage3_model_persistence_threshold"), unsupported("model_persistence_threshold"),
      unsupported("stage3_use_all_reduce_for_fetch_params", Off::is_false),
      unsupported("use_all_reduce_for_fetch_params", Off::is_false),
      unsupported("pipeline_loading_checkpoint", Off::is_false), unsupported("zeropp_loco_param", Off::is_null)};

  const Obj o(c, j, "zero_optimization", keys);
  cfg.stage = int(o.integer("stage", 0, 0, 3, "a ZeRO stage 0, 1, 2 or 3"));
  cfg.reduce_bucket_size = std::uint64_t(o.integer("reduce_bucket_size", std::int64_t(cfg.reduce_bucket_size), 1,
                                                   std::numeric_limits<std::int64_t>::max(),
                                                   "a positive integer (elements)"));
  auto size = [&](std::string_view a, std::string_view b, std::uint64_t def) {
    const auto [v, path] = o.either(a, b);
    return v ? std::uint64_t(as_int(c, *v, path, 0, std::numeric_limits<std::int64_t>::max(),
                                    "a non-negative integer"))
             : def;
  };
  cfg.prefetch_bucket_size = size("stage3_prefetch_bucket_size", "prefetch_bucket_size", cfg.prefetch_bucket_size);
  cfg.engine.prefetch = cfg.prefetch_bucket_size > 0 ? 1 : 0;
  cfg.engine.persist_threshold =
      std::size_t(size("stage3_param_persistence_threshold", "param_persistence_threshold", cfg.engine.persist_threshold));
  cfg.engine.max_live_params =
      std::size_t(size("stage3_max_live_parameters", "max_live_parameters", cfg.engine.max_live_params));

  if (const json* v = o.find("offload_optimizer"); v && !v->is_null()) {
    const Obj off(c, *v, o.path("offload_optimizer"), offload_keys);
    OffloadOptimizer& r = cfg.offload_optimizer;
    if (const json* d = off.find("device"); d && !d->is_null()) {
      const std::string_view s = as_string(c, *d, off.path("device"), "\"none\", \"cpu\" or \"nvme\"");
      if (s == "none") r.device = OffloadDevice::none;
      else if (s == "cpu") r.device = OffloadDevice::cpu;
      else if (s == "nvme") r.device = OffloadDevice::nvme;
      else c.expected(off.path("device"), "\"none\", \"cpu\" or \"nvme\"", *d);
    }
    if (const json* p = off.find("nvme_path"); p && !p->is_null())
      r.nvme_path = as_string(c, *p, off.path("nvme_path"), "a path string");
    r.pin_memory = off.boolean("pin_memory", false);
  }
}

// DeepSpeed's optimizer defaults (deepspeed/ops/adam, deepspeed/ops/lion): lr 1e-3 for all; Adam(W) betas 0.9/0.999, eps
// 1e-8, weight_decay 0; Lion betas 0.9/0.999; SGD as torch.optim.SGD.
inline void read_optimizer(const Ctx& c, const json& j, Config& cfg) {
  static constexpr Key keys[] = {reads("type"), reads("params"), ignores_bool("legacy_fusion")};
  static constexpr std::string_view hint =
      "max_grad_norm is not an optimizer parameter in DeepSpeed; clip with the top-level \"gradient_clipping\"";
  static constexpr Key adam_keys[] = {reads("lr"), reads("betas"), reads("eps"), reads("weight_decay"),
                                      reads("adam_w_mode"), ignores_bool("torch_adam"),
                                      unsupported("bias_correction", Off::is_true),
                                      unsupported("amsgrad", Off::is_false),
                                      {"max_grad_norm", Use::misplaced, Off::never, 0, hint}};
  static constexpr Key lion_keys[] = {reads("lr"), reads("betas"), reads("weight_decay"),
                                      {"max_grad_norm", Use::misplaced, Off::never, 0, hint}};
  static constexpr Key sgd_keys[] = {reads("lr"), reads("momentum"), reads("dampening"), reads("weight_decay"),
                                     reads("nesterov"), unsupported("maximize", Off::is_false),
                                     {"max_grad_norm", Use::misplaced, Off::never, 0, hint}};
  static constexpr std::string_view supported[] = {"Adam", "AdamW", "SGD", "Lion"};
  static constexpr std::string_view deepspeed_only[] = {
      "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "MuAdam", "MuAdamW", "MuSGD",
      "Adadelta", "Adamax", "ASGD", "LBFGS", "NAdam", "RAdam", "RMSprop", "Rprop", "SparseAdam"};

  const Obj o(c, j, "optimizer", keys);
  const std::size_t autos_before = cfg.auto_keys.size();
  const json* t = o.find("type");
  if (!t) c.fail(o.path("type"), "required (one of Adam, AdamW, SGD, Lion)");
  const std::string_view type = as_string(c, *t, o.path("type"), "an optimizer name (Adam, AdamW, SGD, Lion)");
  const std::string low = lower(type);
  const json empty = json::object();
  const json* pj = o.find("params");
  if (!pj || pj->is_null()) pj = &empty;

  auto betas = [&](const Obj& p, float& b1, float& b2, Real r) {
    const json* v = p.value("betas");
    if (!v) return;
    const std::string path = p.path("betas");
    if (!v->is_array() || v->size() != 2) c.expected(path, "an array of two numbers [beta1, beta2]", *v);
    b1 = as_float(c, (*v)[0], path + "[0]", r);
    b2 = as_float(c, (*v)[1], path + "[1]", r);
  };
  cfg.optimizer_given = true;
  if (low == "adam" || low == "adamw") {
    const Obj p(c, *pj, o.path("params"), adam_keys, true);
    optim::AdamW w{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
    w.lr = p.real32("lr", w.lr, Real::non_negative);
    betas(p, w.beta1, w.beta2, Real::unit_open);
    w.eps = p.real32("eps", w.eps, Real::non_negative);
    w.weight_decay = p.real32("weight_decay", w.weight_decay, Real::non_negative);
    const bool decoupled = p.boolean("adam_w_mode", true);
    if (low == "adamw" && !decoupled)
      c.fail(p.path("adam_w_mode"), "AdamW always decouples weight decay; for L2 regularisation use \"type\": "
                                    "\"Adam\" with \"adam_w_mode\": false");
    if (decoupled) cfg.optimizer = w;
    else cfg.optimizer = optim::Adam{.lr = w.lr, .beta1 = w.beta1, .beta2 = w.beta2, .eps = w.eps, .weight_decay = w.weight_decay};
  } else if (low == "lion") {
    const Obj p(c, *pj, o.path("params"), lion_keys, true);
    optim::Lion l{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .weight_decay = 0.0f};
    l.lr = p.real32("lr", l.lr, Real::non_negative);
    betas(p, l.beta1, l.beta2, Real::unit_closed);
    l.weight_decay = p.real32("weight_decay", l.weight_decay, Real::non_negative);
    cfg.optimizer = l;
  } else if (low == "sgd") {
    const Obj p(c, *pj, o.path("params"), sgd_keys, true);
    optim::Sgd s{.lr = 1e-3f, .momentum = 0.0f, .dampening = 0.0f, .weight_decay = 0.0f, .nesterov = false};
    s.lr = p.real32("lr", s.lr, Real::non_negative);
    s.momentum = p.real32("momentum", s.momentum, Real::non_negative);
    s.dampening = p.real32("dampening", s.dampening, Real::unit_closed);
    s.weight_decay = p.real32("weight_decay", s.weight_decay, Real::non_negative);
    s.nesterov = p.boolean("nesterov", s.nesterov);
    cfg.optimizer = s;
  } else {
    for (std::string_view n : deepspeed_only)
      if (lower(n) == low)
        c.fail(o.path("type"), "\"", type, "\" is known to DeepSpeed, not supported by zp (zp has Adam, AdamW, SGD, Lion)");
    const std::string_view near = closest(type, supported);
    c.fail(o.path("type"), "unknown optimizer ", show(*t), near.empty() ? "" : "; did you mean ", near,
           near.empty() ? "" : "?", " (zp has Adam, AdamW, SGD, Lion)");
  }
  // Cross-field rules (e.g. Nesterov needs a momentum) wait while "auto" placeholders stand in
  // for values the program fills; the engine validates the optimizer it is given anyway.
  if (cfg.auto_keys.size() == autos_before)
    c.checked(o.path("params"), [&] { std::visit([](const auto& x) { optim::validate(x); }, cfg.optimizer); });
}

inline schedule::Warmup read_warmup_type(const Ctx& c, const Obj& p, schedule::Warmup def) {
  const json* v = p.value("warmup_type");
  if (!v) return def;
  const std::string_view s = as_string(c, *v, p.path("warmup_type"), "\"log\" or \"linear\"");
  if (s == "log") return schedule::Warmup::log;
  if (s == "linear") return schedule::Warmup::linear;
  c.expected(p.path("warmup_type"), "\"log\" or \"linear\"", *v);
}

inline float optimizer_lr(const AnyOptimizer& o) {
  return std::visit([](const auto& x) { return x.lr; }, o);
}

inline void read_scheduler(const Ctx& c, const json& j, Config& cfg) {
  static constexpr Key keys[] = {reads("type"), reads("params")};
  static constexpr Key warmup_keys[] = {reads("warmup_min_lr"), reads("warmup_max_lr"), reads("warmup_num_steps"),
                                        reads("warmup_type"), unsupported("last_batch_iteration", Off::number, -1)};
  static constexpr Key decay_keys[] = {reads("warmup_min_lr"), reads("warmup_max_lr"), reads("warmup_num_steps"),
                                       reads("warmup_type"), reads("total_num_steps"),
                                       unsupported("last_batch_iteration", Off::number, -1)};
  static constexpr Key cosine_keys[] = {reads("total_num_steps"), reads("warmup_min_ratio"),
                                        reads("warmup_num_steps"), reads("cos_min_ratio"), reads("warmup_type"),
                                        unsupported("last_batch_iteration", Off::number, -1)};
  static constexpr Key cycle_keys[] = {
      reads("cycle_min_lr"), reads("cycle_max_lr"), reads("decay_lr_rate"), reads("cycle_first_step_size"),
      reads("cycle_second_step_size"), reads("decay_step_size"), reads("cycle_momentum"), reads("cycle_min_mom"),
      reads("cycle_max_mom"), reads("decay_mom_rate"), unsupported("cycle_first_stair_count", Off::number, 0),
      unsupported("cycle_second_stair_count", Off::null_or_number, 0),
      unsupported("last_batch_iteration", Off::number, -1)};
  static constexpr std::string_view supported[] = {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"};

  const Obj o(c, j, "scheduler", keys);
  const std::size_t autos_before = cfg.auto_keys.size();
  const json* t = o.find("type");
  if (!t) c.fail(o.path("type"), "required (one of WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)");
  const std::string_view type =
      as_string(c, *t, o.path("type"), "a scheduler name (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)");
  const std::string low = lower(type);
  const json empty = json::object();
  const json* pj = o.find("params");
  if (!pj || pj->is_null()) pj = &empty;
  const std::string pp = o.path("params");

  if (low == "warmuplr") {
    const Obj p(c, *pj, pp, warmup_keys, true);
    schedule::WarmupLR s;
    s.warmup_min_lr = p.real_f32("warmup_min_lr", 0.0, Real::non_negative);
    s.warmup_max_lr = p.real_f32("warmup_max_lr", 1e-3, Real::non_negative);
    s.warmup_num_steps = p.count("warmup_num_steps", 1000);
    s.warmup_type = read_warmup_type(c, p, schedule::Warmup::log);
    cfg.scheduler = s;
  } else if (low == "warmupdecaylr") {
    const Obj p(c, *pj, pp, decay_keys, true);
    p.require("total_num_steps", "WarmupDecayLR");
    schedule::WarmupDecayLR s;
    s.warmup_min_lr = p.real_f32("warmup_min_lr", 0.0, Real::non_negative);
    s.warmup_max_lr = p.real_f32("warmup_max_lr", 1e-3, Real::non_negative);
    s.warmup_num_steps = p.count("warmup_num_steps", 1000);
    s.total_num_steps = p.count("total_num_steps", s.total_num_steps);
    s.warmup_type = read_warmup_type(c, p, schedule::Warmup::log);
    cfg.scheduler = s;
  } else if (low == "warmupcosinelr") {
    const Obj p(c, *pj, pp, cosine_keys, true);
    p.require("total_num_steps", "WarmupCosineLR");
    schedule::WarmupCosineLR s;
    s.base_lr = double(optimizer_lr(cfg.optimizer));
    s.total_num_steps = p.count("total_num_steps", s.total_num_steps);
    s.warmup_min_ratio = p.real("warmup_min_ratio", 0.0, Real::unit_closed);
    s.warmup_num_steps = p.count("warmup_num_steps", 1000);
    s.cos_min_ratio = p.real("cos_min_ratio", 1e-4, Real::unit_closed);
    s.warmup_type = read_warmup_type(c, p, schedule::Warmup::log);
    cfg.scheduler = s;
  } else if (low == "onecycle") {
    const Obj p(c, *pj, pp, cycle_keys, true);
    p.require("cycle_min_lr", "OneCycle");
    p.require("cycle_max_lr", "OneCycle");
    schedule::OneCycle s;
    s.cycle_min_lr = p.real_f32("cycle_min_lr", s.cycle_min_lr, Real::non_negative);
    s.cycle_max_lr = p.real_f32("cycle_max_lr", s.cycle_max_lr, Real::non_negative);
    s.decay_lr_rate = p.real("decay_lr_rate", 0.0, Real::non_negative);
    s.cycle_first_step_size = p.integer("cycle_first_step_size", 2000, 1, std::numeric_limits<std::int64_t>::max(),
                                        "a positive integer");
    if (const json* v = p.value("cycle_second_step_size"); v && !v->is_null())
      s.cycle_second_step_size = as_int(c, *v, p.path("cycle_second_step_size"), 1,
                                        std::numeric_limits<std::int64_t>::max(),
                                        "a positive integer, or null for the first step size");
    s.decay_step_size = p.count("decay_step_size", 0);
    s.cycle_momentum = p.boolean("cycle_momentum", true);
    s.cycle_min_mom = p.real_f32("cycle_min_mom", 0.8, Real::non_negative);
    s.cycle_max_mom = p.real_f32("cycle_max_mom", 0.9, Real::non_negative);
    s.decay_mom_rate = p.real("decay_mom_rate", 0.0, Real::finite);
    cfg.scheduler = s;
  } else {
    if (low == "lrrangetest")
      c.fail(o.path("type"), "\"", type, "\" is known to DeepSpeed, not supported by zp (zp has WarmupLR, "
                             "WarmupDecayLR, WarmupCosineLR, OneCycle)");
    const std::string_view near = closest(type, supported);
    c.fail(o.path("type"), "unknown scheduler ", show(*t), near.empty() ? "" : "; did you mean ", near,
           near.empty() ? "" : "?", " (zp has WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)");
  }
  // As for the optimizer: "auto" placeholders (e.g. total_num_steps) are not checked against the
  // other settings; the schedule's lr() checks the values the program filled in.
  if (cfg.auto_keys.size() == autos_before)
    c.checked(pp, [&] { std::visit([](const auto& x) { x.check(); }, *cfg.scheduler); });
}

// null, "fp32", "fp16" or "bf16" (communication_data_type also takes DeepSpeed's "bfp16").
inline std::optional<DType> read_dtype(const Ctx& c, const json* v, std::string_view path, bool bfp16_alias) {
  if (!v || v->is_null()) return std::nullopt;
  const char* what = "null, \"fp32\", \"fp16\" or \"bf16\"";
  const std::string_view s = as_string(c, *v, path, what);
  if (s == "fp32") return DType::f32;
  if (s == "fp16") return DType::f16;
  if (s == "bf16" || (bfp16_alias && s == "bfp16")) return DType::bf16;
  c.expected(path, what, *v);
}

// The three batch keys: "auto" or absent = 0 (not given).
inline std::int64_t read_batch_key(const Ctx& c, const Obj& root, std::string_view key, bool& auto_seen) {
  const json* v = root.find(key);
  if (!v) return 0;
  if (is_auto(*v)) {
    c.note_auto(std::string(key));
    auto_seen = true;
    return 0;
  }
  return as_int(c, *v, key, 1, std::numeric_limits<std::int64_t>::max(), "a positive integer or \"auto\"");
}

// What can be checked before the world size is known: some world size must fit.
inline void check_batch(const Ctx& c, const BatchConfig& b, bool auto_seen) {
  const std::int64_t t = b.train_batch_size, m = b.micro_batch_per_rank, g = b.gradient_accumulation_steps;
  if (!t && !m) {
    if (!auto_seen)
      c.fail("train_batch_size", "give train_batch_size or train_micro_batch_size_per_gpu (or both, or \"auto\" "
                                 "for the program to fill)");
    return;
  }
  if (!t) return;
  std::int64_t per_rank = 0;
  if (m && g && __builtin_mul_overflow(m, g, &per_rank))
    c.fail("train_batch_size", "train_micro_batch_size_per_gpu (", m, ") * gradient_accumulation_steps (", g,
           ") overflows a 64-bit integer");
  const std::int64_t unit = m && g ? per_rank : m ? m : g ? g : 1;
  if (t % unit != 0)
    c.fail("train_batch_size", "train_batch_size (", t, ") must equal train_micro_batch_size_per_gpu",
           m ? zp::detail::cat(" (", m, ")") : std::string(" (not given)"), " * gradient_accumulation_steps",
           g ? zp::detail::cat(" (", g, ")") : std::string(" (not given)"), " * the world size, but it is not a multiple of ",
           unit, ", so no world size fits");
}

inline Config parse_root(const json& j, std::string_view source) {
  static constexpr Key keys[] = {
      reads("train_batch_size"), reads("train_micro_batch_size_per_gpu"), reads("gradient_accumulation_steps"),
      reads("fp16"), reads("bf16"), reads("bfloat16"), reads("zero_optimization"), reads("optimizer"),
      reads("scheduler"), reads("gradient_clipping"), reads("steps_per_print"), reads("wall_clock_breakdown"),
      reads("communication_data_type"), reads("data_types"), reads("checkpoint"),
      ignores_bool("memory_breakdown"), ignores_bool("zero_force_ds_cpu_optimizer"),
      unsupported("amp", Off::not_enabled), unsupported("zero_allow_untested_optimizer", Off::is_false),
      unsupported("prescale_gradients", Off::is_false), unsupported("gradient_predivide_factor", Off::number, 1),
      unsupported("sparse_gradients", Off::is_false), unsupported("fp32_allreduce", Off::is_false),
      unsupported("disable_allgather", Off::is_false), unsupported("dump_state", Off::is_false),
      unsupported("dataloader_drop_last", Off::is_false), unsupported("graph_harvesting", Off::is_false),
      unsupported("activation_checkpointing"), unsupported("pipeline"), unsupported("aio"),
      unsupported("sparse_attention"), unsupported("compression_training"),
      unsupported("flops_profiler", Off::not_enabled), unsupported("tensorboard", Off::not_enabled),
      unsupported("wandb", Off::not_enabled), unsupported("csv_monitor", Off::not_enabled),
      unsupported("comms_logger", Off::not_enabled), unsupported("autotuning", Off::not_enabled),
      unsupported("elasticity", Off::not_enabled), unsupported("curriculum_learning", Off::not_enabled),
      unsupported("data_efficiency", Off::not_enabled), unsupported("nebula", Off::not_enabled),
      unsupported("eigenvalue", Off::not_enabled), unsupported("progressive_layer_drop", Off::not_enabled),
      unsupported("quantize_training", Off::not_enabled), unsupported("hybrid_engine", Off::not_enabled),
      unsupported("torch_autocast", Off::not_enabled)};
  static constexpr Key data_type_keys[] = {reads("grad_accum_dtype")};
  static constexpr Key checkpoint_keys[] = {reads("tag_validation"), unsupported("load_universal", Off::is_false),
                                            unsupported("use_node_local_storage", Off::is_false),
                                            unsupported("parallel_write")};

  Config cfg;
  cfg.source = std::string(source);
  const Ctx c{cfg.source, &cfg.auto_keys};
  if (!j.is_object()) c.expected("", "a JSON object {...} at the top level", j);
  const Obj root(c, j, "", keys);

  bool auto_seen = false;
  cfg.batch.train_batch_size = read_batch_key(c, root, "train_batch_size", auto_seen);
  cfg.batch.micro_batch_per_rank = read_batch_key(c, root, "train_micro_batch_size_per_gpu", auto_seen);
  cfg.batch.gradient_accumulation_steps = read_batch_key(c, root, "gradient_accumulation_steps", auto_seen);
  check_batch(c, cfg.batch, auto_seen);

  read_precision(c, root, cfg);
  if (const json* v = root.find("zero_optimization")) read_zero(c, *v, cfg);
  if (const json* v = root.find("optimizer")) read_optimizer(c, *v, cfg);
  if (const json* v = root.find("scheduler")) read_scheduler(c, *v, cfg);

  cfg.engine.max_grad_norm = root.real32("gradient_clipping", 0.0f, Real::non_negative);
  cfg.steps_per_print = root.count("steps_per_print", 10);
  cfg.wall_clock_breakdown = root.boolean("wall_clock_breakdown", false);
  cfg.communication_data_type =
      read_dtype(c, root.find("communication_data_type"), "communication_data_type", true);
  if (const json* v = root.find("data_types")) {
    const Obj d(c, *v, "data_types", data_type_keys);
    cfg.grad_accum_dtype = read_dtype(c, d.find("grad_accum_dtype"), d.path("grad_accum_dtype"), false);
  }
  if (const json* v = root.find("checkpoint")) {
    const Obj k(c, *v, "checkpoint", checkpoint_keys);
    if (const json* t = k.find("tag_validation")) {
      const char* what = "\"Warn\", \"Ignore\" or \"Fail\"";
      const std::string low = lower(as_string(c, *t, k.path("tag_validation"), what));
      if (low == "warn") cfg.tag_validation = TagValidation::warn;
      else if (low == "ignore") cfg.tag_validation = TagValidation::ignore;
      else if (low == "fail") cfg.tag_validation = TagValidation::fail;
      else c.expected(k.path("tag_validation"), what, *t);
    }
  }
  return cfg;
}

}  // namespace detail

// Checks a parsed JSON document and fills DeepSpeed's defaults. Throws zp::Error(invalid_argument)
// naming `source_name`, the key path and what was expected.
template <class Json>
  requires std::same_as<Json, nlohmann::json>
Config parse(const Json& j, std::string_view source_name = "ds_config") {
  return detail::parse_root(j, source_name);
}

// Parses ds_config.json text: invalid JSON (named with line and column), nesting deeper than 32
// levels, duplicate keys and everything parse(json) rejects are errors.
inline Config parse(std::string_view text, std::string_view source_name) {
  return detail::parse_root(zp::detail::parse_json(text, source_name, Errc::invalid_argument), source_name);
}

// Reads and parses a file; the source name in messages is the path as given. A file that cannot
// be read (missing, not a regular file, over 16 MiB) is Errc::io.
inline Config load(const std::filesystem::path& path) {
  return parse(zp::detail::read_whole_file(path, std::uint64_t(16) << 20), path.string());
}

// ---- describe --------------------------------------------------------------------------------

namespace detail {
inline std::string describe_schedule(const schedule::Any& s) {
  using zp::detail::cat;
  auto type = [](schedule::Warmup w) { return w == schedule::Warmup::log ? "log" : "linear"; };
  return std::visit(
      [&](const auto& x) -> std::string {
        using S = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<S, schedule::Constant>) return cat("Constant(value=", x.value, ")");
        else if constexpr (std::is_same_v<S, schedule::WarmupLR>)
          return cat("WarmupLR(warmup_min_lr=", x.warmup_min_lr, ", warmup_max_lr=", x.warmup_max_lr,
                     ", warmup_num_steps=", x.warmup_num_steps, ", warmup_type=", type(x.warmup_type), ")");
        else if constexpr (std::is_same_v<S, schedule::WarmupDecayLR>)
          return cat("WarmupDecayLR(warmup_min_lr=", x.warmup_min_lr, ", warmup_max_lr=", x.warmup_max_lr,
                     ", warmup_num_steps=", x.warmup_num_steps, ", total_num_steps=", x.total_num_steps,
                     ", warmup_type=", type(x.warmup_type), ")");
        else if constexpr (std::is_same_v<S, schedule::WarmupCosineLR>)
          return cat("WarmupCosineLR(base_lr=", x.base_lr, ", total_num_steps=", x.total_num_steps,
                     ", warmup_min_ratio=", x.warmup_min_ratio, ", warmup_num_steps=", x.warmup_num_steps,
                     ", cos_min_ratio=", x.cos_min_ratio, ", warmup_type=", type(x.warmup_type), ")");
        else
          return cat("OneCycle(cycle_min_lr=", x.cycle_min_lr, ", cycle_max_lr=", x.cycle_max_lr,
                     ", decay_lr_rate=", x.decay_lr_rate, ", cycle_first_step_size=", x.cycle_first_step_size,
                     ", cycle_second_step_size=", x.second(), ", decay_step_size=", x.decay_step_size,
                     ", cycle_momentum=", x.cycle_momentum ? "true" : "false", ", cycle_min_mom=", x.cycle_min_mom,
                     ", cycle_max_mom=", x.cycle_max_mom, ", decay_mom_rate=", x.decay_mom_rate, ")");
      },
      s);
}
}  // namespace detail

// One line per setting, for a program's startup print.
inline std::string describe(const Config& c) {
  using zp::detail::cat;
  auto batch = [&](std::int64_t v, const char* key) { return v ? cat(v) : c.is_auto(key) ? "auto" : "not given"; };
  const LossScaler& ls = c.engine.loss_scaler;
  std::string precision = detail::ds_name(c.precision);
  if (ls.kind() == LossScaler::Kind::fixed) precision += cat(", fixed loss scale ", ls.scale());
  if (ls.kind() == LossScaler::Kind::dynamic) {
    const DynamicScale& d = ls.config();
    precision += cat(", dynamic loss scale (initial ", d.initial_scale, ", window ", d.window, ", hysteresis ",
                     d.hysteresis, ", consecutive_hysteresis ", d.consecutive_hysteresis ? "true" : "false",
                     ", min ", d.min_scale, ")");
  }
  auto dtype = [](const std::optional<DType>& t) { return t ? detail::ds_name(*t) : "null (the model's)"; };
  std::string out = cat("ds_config ", c.source, ":\n");
  out += cat("  batch: train_batch_size ", batch(c.batch.train_batch_size, "train_batch_size"),
             ", train_micro_batch_size_per_gpu ", batch(c.batch.micro_batch_per_rank, "train_micro_batch_size_per_gpu"),
             ", gradient_accumulation_steps ",
             batch(c.batch.gradient_accumulation_steps, "gradient_accumulation_steps"),
             " (completed for the world size)\n");
  out += cat("  precision: ", precision, "\n");
  out += cat("  zero: stage ", c.stage, ", reduce_bucket_size ", c.reduce_bucket_size, " elements\n");
  out += cat("  stage 3: max_live_parameters ", c.engine.max_live_params, ", param_persistence_threshold ",
             c.engine.persist_threshold, ", prefetch_bucket_size ", c.prefetch_bucket_size, " (prefetch ",
             c.engine.prefetch ? "on" : "off", ")\n");
  out += cat("  offload_optimizer: ", detail::ds_name(c.offload_optimizer.device), "\n");
  out += cat("  optimizer: ", std::visit([](const auto& o) { return optim::describe(o); }, c.optimizer),
             c.optimizer_given ? "" : " (no optimizer section: DeepSpeed's Adam defaults)", "\n");
  out += cat("  scheduler: ", c.scheduler ? detail::describe_schedule(*c.scheduler) : std::string("none"), "\n");
  out += cat("  gradient_clipping: ", c.engine.max_grad_norm, c.engine.max_grad_norm > 0 ? "" : " (off)", "\n");
  out += cat("  grad_accum_dtype: ", dtype(c.grad_accum_dtype), ", communication_data_type: ",
             dtype(c.communication_data_type), "\n");
  out += cat("  checkpoint: tag_validation ", detail::ds_name(c.tag_validation), "\n");
  out += cat("  steps_per_print: ", c.steps_per_print, ", wall_clock_breakdown: ",
             c.wall_clock_breakdown ? "true" : "false", "\n");
  if (!c.auto_keys.empty()) {
    out += "  \"auto\" (for the program to fill):";
    for (std::size_t i = 0; i < c.auto_keys.size(); ++i) out += (i ? ", " : " ") + c.auto_keys[i];
    out += "\n";
  }
  return out;
}

// ---- the dispatch ----------------------------------------------------------------------------

// The element types, stages and optimizers a program compiles in for with_engine. Every
// combination is one Engine instantiation (seconds of compile time each): list only what the
// program's configs use.
template <class... Ts>
struct Types {};
template <int... Ss>
struct Stages {};
template <class... Os>
struct Optimizers {};

// The EngineConfig for element type T at `world_size` ranks: the batch triad completed
// (resolve_batch; an inconsistent triad names the config's keys and all four numbers) and
// reduce_bucket_size converted from elements to bytes of T.
template <class T>
EngineConfig engine_config(const Config& c, int world_size) {
  const detail::Ctx ctx{c.source, nullptr};
  EngineConfig e = c.engine;
  e.batch = ctx.checked(zp::detail::cat("train_batch_size/train_micro_batch_size_per_gpu/gradient_accumulation_steps "
                                        "at world size ", world_size),
                        [&] { return resolve_batch(c.batch, world_size); });
  e.bucket_bytes = ctx.checked("zero_optimization.reduce_bucket_size", [&] {
    return zp::detail::checked_mul(std::size_t(c.reduce_bucket_size), sizeof(T), "bytes of the bucket");
  });
  e.first_bucket_bytes = std::min(e.first_bucket_bytes, e.bucket_bytes);
  e.wall_clock_breakdown = c.wall_clock_breakdown;
  e.offload_optimizer = c.offload_optimizer.device == OffloadDevice::cpu;
  e.grad_accum_dtype = c.grad_accum_dtype;
  e.communication_dtype = c.communication_data_type;
  e.steps_per_print = int(std::min<std::int64_t>(c.steps_per_print, std::numeric_limits<int>::max()));
  return e;
}

namespace detail {

template <class T, class... Ts>
inline constexpr bool one_of = (std::is_same_v<T, Ts> || ...);

// Lists with at least one entry (an empty one could select nothing).
template <class L>
inline constexpr bool non_empty = false;
template <class T0, class... Ts>
inline constexpr bool non_empty<Types<T0, Ts...>> = true;
template <int S0, int... Ss>
inline constexpr bool non_empty<Stages<S0, Ss...>> = true;
template <class O0, class... Os>
inline constexpr bool non_empty<Optimizers<O0, Os...>> = true;

template <class... Ts>
std::vector<DType> list(Types<Ts...>) { return {dtype_of<Ts>...}; }
template <int... Ss>
std::vector<int> list(Stages<Ss...>) { return {Ss...}; }
template <class... Os>
std::vector<std::string> list(Optimizers<Os...>) {
  static_assert((one_of<Os, optim::AdamW, optim::Adam, optim::Sgd, optim::Lion> && ...),
                "zp::ds::Optimizers lists only AdamW, Adam, Sgd, Lion");
  return {optim::detail::type_name(Os{})...};
}
template <class V>
std::string braces(const std::vector<V>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += zp::detail::cat(i ? ", " : "", v[i]);
  return s + "}";
}
inline std::string braces(const std::vector<DType>& v) {
  std::string s = "{";
  for (std::size_t i = 0; i < v.size(); ++i) s += zp::detail::cat(i ? ", " : "", ds_name(v[i]));
  return s + "}";
}

template <Backend B, class T, int S, class F, class O0, class... Os>
decltype(auto) pick_optimizer(Optimizers<O0, Os...>, const Config& c, const EngineConfig& ec, F& f) {
  if constexpr (sizeof...(Os) == 0) {
    return f(std::type_identity<Engine<B, T, S, O0>>{}, ec, std::get<O0>(c.optimizer));
  } else {
    if (std::holds_alternative<O0>(c.optimizer))
      return f(std::type_identity<Engine<B, T, S, O0>>{}, ec, std::get<O0>(c.optimizer));
    return pick_optimizer<B, T, S>(Optimizers<Os...>{}, c, ec, f);
  }
}

template <Backend B, class T, class OptList, class F, int S0, int... Ss>
decltype(auto) pick_stage(Stages<S0, Ss...>, const Config& c, const EngineConfig& ec, F& f) {
  if constexpr (sizeof...(Ss) == 0) {
    return pick_optimizer<B, T, S0>(OptList{}, c, ec, f);
  } else {
    if (c.stage == S0) return pick_optimizer<B, T, S0>(OptList{}, c, ec, f);
    return pick_stage<B, T, OptList>(Stages<Ss...>{}, c, ec, f);
  }
}

template <Backend B, class StageList, class OptList, class F, class T0, class... Ts>
decltype(auto) pick_type(Types<T0, Ts...>, const Config& c, int world_size, F& f) {
  if constexpr (sizeof...(Ts) == 0) {
    return pick_stage<B, T0, OptList>(StageList{}, c, engine_config<T0>(c, world_size), f);
  } else {
    if (c.dtype() == dtype_of<T0>) return pick_stage<B, T0, OptList>(StageList{}, c, engine_config<T0>(c, world_size), f);
    return pick_type<B, StageList, OptList>(Types<Ts...>{}, c, world_size, f);
  }
}

}  // namespace detail

// Calls f(std::type_identity<Engine<B, T, Stage, Opt>>{}, engine_config, optimizer) for the
// one combination the config selects (T from the precision: float, bf16 or fp16) and returns
// what f returns; f must return the same type for every combination compiled in. Throws
// zp::Error(invalid_argument) before calling f when the config asks for something this program
// did not compile in (naming what it did), for what zp's engine does not do yet
// (offload_optimizer to nvme, a grad_accum_dtype or communication_data_type other than fp32 or
// the model's type), and when the batch triad does not fit world_size.
template <Backend B, class TypeList = Types<float, bf16, fp16>, class StageList = Stages<0, 1, 2, 3>,
          class OptList = Optimizers<optim::AdamW, optim::Adam, optim::Sgd, optim::Lion>, class F>
decltype(auto) with_engine(const Config& c, int world_size, F&& f) {
  static_assert(detail::non_empty<TypeList> && detail::non_empty<StageList> && detail::non_empty<OptList>,
                "with_engine<B, Types<T...>, Stages<S...>, Optimizers<O...>>: each list names at least one entry");
  const detail::Ctx ctx{c.source, nullptr};
  const auto types = detail::list(TypeList{});
  const auto stages = detail::list(StageList{});
  const auto opts = detail::list(OptList{});
  if (c.offload_optimizer.device == OffloadDevice::nvme)
    ctx.fail("zero_optimization.offload_optimizer.device",
             "offload_optimizer to \"nvme\" is not supported (zp offloads the optimizer to host memory); use "
             "\"cpu\" or \"none\"");
  const DType t = c.dtype();
  if (std::find(types.begin(), types.end(), t) == types.end())
    ctx.fail(c.precision == Precision::fp32 ? "" : c.precision == Precision::fp16 ? "fp16.enabled" : "bf16.enabled",
             "config asks for precision ", detail::ds_name(c.precision), ", this program was built with element types ",
             detail::braces(types));
  if (std::find(stages.begin(), stages.end(), c.stage) == stages.end())
    ctx.fail("zero_optimization.stage", "config asks for stage ", c.stage, ", this program was built with stages ",
             detail::braces(stages));
  const std::string opt = std::visit([](const auto& o) { return std::string(optim::detail::type_name(o)); }, c.optimizer);
  if (std::find(opts.begin(), opts.end(), opt) == opts.end())
    ctx.fail("optimizer.type", "config asks for optimizer ", opt, ", this program was built with optimizers ",
             detail::braces(opts));
  if (c.grad_accum_dtype && *c.grad_accum_dtype != t && *c.grad_accum_dtype != DType::f32)
    ctx.fail("data_types.grad_accum_dtype", detail::ds_name(*c.grad_accum_dtype),
             " is not supported: zp accumulates gradients in fp32 or the model's element type (",
             detail::ds_name(t), " here)");
  if (c.communication_data_type && *c.communication_data_type != t && *c.communication_data_type != DType::f32)
    ctx.fail("communication_data_type", detail::ds_name(*c.communication_data_type),
             " is not supported: zp reduces gradients in fp32 or the model's element type (", detail::ds_name(t),
             " here)");
  return detail::pick_type<B, StageList, OptList>(TypeList{}, c, world_size, f);
}

}  // namespace zp::ds
