// zp/detail/json_keys.hpp: reads a JSON object against a table that declares each of its keys
// once: its name (and an alias), whether it is read, ignored, unsupported or misplaced, the type
// and range of its value, its default, and where the value goes. One walker does for every table
//  - unknown keys: an error naming the closest declared key ("did you mean stage?") or, with none
//    close, the keys that are read (or skipped, where the Ctx says: a format newer writers extend);
//  - types and ranges: an error naming the full key path and what was expected;
//  - defaults: an absent key (or null, where null means absent) stores its declared default, so
//    a key declared as read is always read;
//  - placeholders (Hugging Face's "auto") where a key accepts one, recorded by path; a key given
//    under both its name and its alias; required keys;
//  - ignored keys (type still checked) and unsupported keys (an error unless they hold the value
//    that means "off").
// Every error is zp::Error(ctx.errc): "<source>: <key path>: <what>". Syntax, nesting depth and
// duplicate keys are parse_json's (detail/json.hpp). No schema here: ds_config.hpp declares
// DeepSpeed's keys; a file format with a JSON header can declare its own.
// Needs nlohmann/json (zp::io).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "zp/detail/json.hpp"
#include "zp/error.hpp"

namespace zp::detail::keys {

using json = nlohmann::json;

inline std::string lower(std::string_view s) {
  std::string r(s);
  for (char& ch : r)
    if (ch >= 'A' && ch <= 'Z') ch = char(ch - 'A' + 'a');
  return r;
}

// Levenshtein distance, case-insensitive (for "did you mean"). It is at least the lengths'
// difference, so a pair whose lengths differ by more than `limit` is not compared: its distance
// is reported as limit + 1 (a hostile multi-MiB key costs nothing).
inline std::size_t edit_distance(std::string_view a0, std::string_view b0, std::size_t limit = 3) {
  if ((a0.size() > b0.size() ? a0.size() - b0.size() : b0.size() - a0.size()) > limit)
    return limit + 1;
  const std::string a = lower(a0), b = lower(b0);
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j)
      cur[j] =
          std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
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
  const std::string k = text_excerpt(key);
  return path.empty() ? k : std::string(path) + "." + k;
}

// A value for a message: JSON text (strings quoted), shortened; nan and inf by name.
inline std::string show(const json& v) {
  if (v.is_number_float() && !std::isfinite(v.get<double>())) return cat(v.get<double>());
  return json_excerpt(v);
}

// Where errors come from and what they are; the placeholder a table may accept.
struct Ctx {
  std::string source;
  Errc errc = Errc::invalid_argument;
  // A string that stands for "the program fills this in" (Hugging Face's "auto"), accepted
  // where a key or a table allows it: it reads as absent and its path is appended to
  // *placeholders. Elsewhere it is a wrong value, and `placeholder_hint` follows the message.
  std::string_view placeholder;
  std::vector<std::string>* placeholders = nullptr;
  std::string_view placeholder_hint;
  // Whose keys the unsupported ones are, for "known <foreign> key that zp does not support".
  std::string_view foreign = "foreign";
  // Keys no table declares are skipped, not errors: for a file format whose newer writers may
  // add keys that an older reader does not need.
  bool skip_unknown = false;
  // JSON floats with a whole value (5e8) read as integers; a format that writes integers only
  // turns this off.
  bool whole_floats = true;

  template <class... Args>
  [[noreturn]] void fail(std::string_view path, const Args&... msg) const {
    throw Error(errc,
                path.empty() ? cat(source, ": ", msg...) : cat(source, ": ", path, ": ", msg...));
  }
  bool is_placeholder(const json& v) const {
    return !placeholder.empty() && v.is_string() && v.get_ref<const std::string&>() == placeholder;
  }
  // "expected <what>, got <value>", with the hint when the value is a placeholder out of place.
  [[noreturn]] void expected(std::string_view path, std::string_view what, const json& v) const {
    fail(path, "expected ", what, ", got ", show(v),
         is_placeholder(v) ? placeholder_hint : std::string_view());
  }
  void note_placeholder(std::string path) const {
    if (placeholders) placeholders->push_back(std::move(path));
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

inline std::string_view as_string(const Ctx& c, const json& v, std::string_view path,
                                  std::string_view what) {
  if (!v.is_string()) c.expected(path, what, v);
  return v.get_ref<const std::string&>();
}

// An integer in [lo, hi]; `what` says so in messages ("" for "an integer in [lo, hi]"). JSON
// floats with an integral value (5e8) count where the Ctx allows: configs write sizes that way.
inline std::int64_t as_int(const Ctx& c, const json& v, std::string_view path, std::int64_t lo,
                           std::int64_t hi, std::string_view what) {
  const auto bad = [&](std::string_view why = {}) {
    const std::string range =
        what.empty() ? cat("an integer in [", lo, ", ", hi, "]") : std::string(what);
    c.fail(path, "expected ", range, ", got ", show(v), why,
           c.is_placeholder(v) ? c.placeholder_hint : std::string_view());
  };
  std::int64_t x = 0;
  if (v.is_number_unsigned()) {
    const std::uint64_t u = v.get<std::uint64_t>();
    if (u > std::uint64_t(std::numeric_limits<std::int64_t>::max())) bad();
    x = std::int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<std::int64_t>();
  } else if (v.is_number_float() && c.whole_floats) {
    const double d = v.get<double>();
    if (!std::isfinite(d)) bad();
    if (d != std::floor(d)) bad(" (not a whole number)");
    if (!(d >= -0x1p63 && d < 0x1p63)) bad();
    x = std::int64_t(d);
  } else {
    bad();
  }
  if (x < lo || x > hi) bad();
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

// As as_real, for a value used as a float: one that overflows a float, or that is not zero but
// rounds to zero (a gradient clipping of 1e-50 would silently turn clipping off), is an error.
inline float as_float(const Ctx& c, const json& v, std::string_view path, Real r) {
  const double d = as_real(c, v, path, r);
  if (std::fabs(d) > double(std::numeric_limits<float>::max()) || (d != 0 && float(d) == 0))
    c.fail(path, "expected ", real_what(r),
           " that a 32-bit float holds (magnitude 1.4e-45 to 3.4e38, or 0), got ", show(v));
  return float(d);
}

// ---- what a key's value is ------------------------------------------------------------------

enum class Kind : std::uint8_t {
  boolean,   // true or false
  integer,   // an integer in [lo, hi]
  real,      // a number (Real says which), kept as a double
  real_f32,  // the same, and one a float holds (kept as written: a float target rounds it)
  text,      // a string
  choice,    // one of `choices` (a string), stored as its value
  pair,      // an array of two numbers (Real, each one a float holds)
  any,       // any JSON value, stored as a pointer into the document
  object,    // a nested object, read by the key's `section`
};

struct Choice {
  std::string_view name;
  std::int64_t value;
};

// A checked value (or a default): the member its kind uses.
struct Value {
  bool null = false;  // null where the key allows it: optional targets become empty
  bool b = false;
  std::int64_t i = 0;
  double x = 0, y = 0;
  std::string_view s;
  const json* j = nullptr;
};

struct Spec {
  Kind kind = Kind::any;
  std::string_view what;  // what a valid value is, for messages (real: from Real)
  std::int64_t lo = 0, hi = std::numeric_limits<std::int64_t>::max();
  Real real = Real::finite;
  std::span<const Choice> choices;
  bool any_case = false;        // choice: names compared case-insensitively
  Value def;                    // stored when absent
  bool null_ok = false;         // null reads as absent
  bool placeholder_ok = false;  // the Ctx's placeholder reads as absent (and is recorded)
  bool if_given = false;        // object: absent leaves the target alone (else it reads as {})
  std::string_view required;    // non-empty: absent is an error with this text

  constexpr Spec or_null() const {
    Spec s = *this;
    s.null_ok = true;
    return s;
  }
  constexpr Spec or_placeholder() const {
    Spec s = *this;
    s.placeholder_ok = true;
    return s;
  }
  constexpr Spec require(std::string_view message) const {
    Spec s = *this;
    s.required = message;
    return s;
  }
};

constexpr Spec boolean(bool def = false) {
  Spec s;
  s.kind = Kind::boolean;
  s.def.b = def;
  return s;
}
constexpr Spec integer(std::int64_t def, std::int64_t lo, std::int64_t hi, std::string_view what) {
  Spec s;
  s.kind = Kind::integer;
  s.what = what;
  s.lo = lo;
  s.hi = hi;
  s.def.i = def;
  return s;
}
constexpr Spec count(std::int64_t def = 0) {
  return integer(def, 0, std::numeric_limits<std::int64_t>::max(), "a non-negative integer");
}
constexpr Spec real(double def, Real r) {
  Spec s;
  s.kind = Kind::real;
  s.real = r;
  s.def.x = def;
  return s;
}
constexpr Spec real_f32(double def, Real r) {
  Spec s = real(def, r);
  s.kind = Kind::real_f32;
  return s;
}
constexpr Spec text(std::string_view what, std::string_view def = {}) {
  Spec s;
  s.kind = Kind::text;
  s.what = what;
  s.def.s = def;
  return s;
}
// def: the value stored when absent. choice_or_null: null or absent stores null (an empty
// optional).
constexpr Spec choice(std::span<const Choice> choices, std::string_view what, std::int64_t def,
                      bool any_case = false) {
  Spec s;
  s.kind = Kind::choice;
  s.what = what;
  s.choices = choices;
  s.any_case = any_case;
  s.def.i = def;
  return s;
}
constexpr Spec choice_or_null(std::span<const Choice> choices, std::string_view what) {
  Spec s = choice(choices, what, 0).or_null();
  s.def.null = true;
  return s;
}
constexpr Spec pair(double first, double second, Real r, std::string_view what) {
  Spec s;
  s.kind = Kind::pair;
  s.what = what;
  s.real = r;
  s.def.x = first;
  s.def.y = second;
  return s;
}
constexpr Spec any() {
  return Spec{};  // Kind::any
}

// The integer and enum targets of store() and load() (bool has its own overloads).
template <class I>
concept Integer = std::is_integral_v<I> && !std::is_same_v<I, bool>;
template <class E>
concept Enum = std::is_enum_v<E>;

// Where a checked value goes: one overload per target type.
inline void store(bool& d, const Value& v) { d = v.b; }
template <Integer I>
void store(I& d, const Value& v) {
  d = I(v.i);
}
template <Enum E>
void store(E& d, const Value& v) {
  d = E(v.i);
}
inline void store(float& d, const Value& v) { d = float(v.x); }
inline void store(double& d, const Value& v) { d = v.x; }
inline void store(std::string& d, const Value& v) { d = std::string(v.s); }
inline void store(const json*& d, const Value& v) { d = v.j; }
inline void store(std::tuple<float&, float&> d, const Value& v) {
  std::get<0>(d) = float(v.x);
  std::get<1>(d) = float(v.y);
}
template <class T>
void store(std::optional<T>& d, const Value& v) {
  if (v.null) {
    d.reset();
    return;
  }
  T t{};
  store(t, v);
  d = t;
}

// The other way: a stored value read back as a Value (for descriptions), one overload per type.
inline Value load(bool d) {
  Value v;
  v.b = d;
  return v;
}
template <Integer I>
Value load(I d) {
  Value v;
  v.i = std::int64_t(d);
  return v;
}
template <Enum E>
Value load(E d) {
  Value v;
  v.i = std::int64_t(d);
  return v;
}
inline Value load(double d) {
  Value v;
  v.x = d;
  return v;
}
inline Value load(float d) { return load(double(d)); }
inline Value load(const std::string& d) {  // a view of d: read it while d lives
  Value v;
  v.s = d;
  return v;
}
inline Value load(const json* d) {
  Value v;
  v.j = d;
  return v;
}
template <class A, class B>
Value load(const std::tuple<A, B>& d) {
  Value v;
  v.x = double(std::get<0>(d));
  v.y = double(std::get<1>(d));
  return v;
}
template <class T>
Value load(const std::optional<T>& d) {
  if (d) return load(*d);
  Value v;
  v.null = true;
  return v;
}

// A value as a description shows it, in JSON's spelling: strings and choices quoted, a pair as
// [a, b], a value kept as a float (real_f32, pair) at a float's precision.
inline std::string show(const Spec& s, const Value& v) {
  if (v.null) return "null";
  switch (s.kind) {
    case Kind::boolean: return v.b ? "true" : "false";
    case Kind::integer: return cat(v.i);
    case Kind::real: return cat(v.x);
    case Kind::real_f32: return cat(float(v.x));
    case Kind::text:
      return json(std::string(v.s)).dump(-1, ' ', false, json::error_handler_t::replace);
    case Kind::choice:
      for (const Choice& ch : s.choices)
        if (ch.value == v.i) return cat('"', ch.name, '"');
      return cat(v.i);
    case Kind::pair: return cat('[', float(v.x), ", ", float(v.y), ']');
    case Kind::any: return v.j ? json_excerpt(*v.j) : "null";
    case Kind::object: break;
  }
  return "{...}";
}

// One line of a description: a key's full path and its value as show() writes it.
struct Shown {
  std::string path, value;
};
using Listing = std::vector<Shown>;

// ---- keys -----------------------------------------------------------------------------------

enum class Use : std::uint8_t {
  read,         // checked, and stored (or its default) in the target
  ignored,      // accepted with no effect; its type is still checked
  unsupported,  // known (to the format's author), not done by zp: an error unless `off`
  misplaced,    // known elsewhere: an error whose message is the hint
};
// The value of an unsupported key that means "off" (accepted, nothing to do).
enum class Off : std::uint8_t {
  never,
  is_false,
  is_true,
  is_null,
  number,
  null_or_number,
  not_enabled
};

template <class S>
struct Key;
template <class S, std::size_t N>
void read_object(const Ctx& c, const json& j, const std::string& path, const Key<S> (&keys)[N],
                 S& target, bool placeholders = false);
template <class S, std::size_t N>
void list_object(const Key<S> (&keys)[N], const S& target, const std::string& path, Listing& out);

// One key of a table that reads into a target of type S.
template <class S>
struct Key {
  std::string_view name;
  Use use = Use::read;
  Spec spec{};
  std::string_view alias{}, alias_word{};  // another name for the key ("alias", "older name")
  Off off = Off::never;                    // unsupported
  double off_number = 0;
  std::string_view hint{};                  // misplaced
  void (*put)(S&, const Value&) = nullptr;  // read: stores a value in the target
  Value (*get)(const S&) = nullptr;         // read: the stored value, back (for list_object)
  void (*section)(const Ctx&, const json&, const std::string&, S&) = nullptr;  // read object
  // read object (or custom): appends the lines that describe what it stored (list_object).
  void (*list)(const S&, const std::string&, Listing&) = nullptr;

  // A value (spec) that goes where at(target) says: at is a lambda without captures returning
  // the target's member (or a std::tie of two floats, for a pair).
  template <class At>
  static constexpr Key read(std::string_view name, Spec spec, At) {
    Key k = make(name, Use::read);
    k.spec = spec;
    k.put = +[](S& t, const Value& v) { store(At{}(t), v); };
    if constexpr (std::is_invocable_v<At, const S&>)  // at(target) reads a const target too
      k.get = +[](const S& t) { return load(At{}(t)); };
    return k;
  }
  // A nested object, read by `fn(ctx, value, path, target)` (absent: read as {}, unless
  // .if_given()).
  static constexpr Key object(std::string_view name,
                              void (*fn)(const Ctx&, const json&, const std::string&, S&)) {
    Key k = make(name, Use::read);
    k.spec.kind = Kind::object;
    k.section = fn;
    return k;
  }
  // Any value (an array, a value whose range depends on keys read before it, in the table's
  // order), read and checked by `fn` as object(name, fn) reads an object.
  static constexpr Key custom(std::string_view name,
                              void (*fn)(const Ctx&, const json&, const std::string&, S&)) {
    return object(name, fn);
  }
  // A nested object read against table `Table` into at(target).
  template <const auto& Table, class At>
  static constexpr Key object(std::string_view name, At) {
    return object(
               name, +[](const Ctx& c, const json& v, const std::string& p,
                         S& t) { read_object(c, v, p, Table, At{}(t)); })
        .template listed<Table>(At{});
  }
  // How list_object describes an object or custom key: by `fn(target, path, out)`, ...
  constexpr Key listed(void (*fn)(const S&, const std::string&, Listing&)) const {
    Key k = *this;
    k.list = fn;
    return k;
  }
  // ... or by table `Table` over view(target) (a lambda without captures returning the member
  // the key was read into, or a value rebuilt from what the target holds).
  // (An at or view that takes only a non-const target lists nothing: list_object says "(not
  // shown)" for the key.)
  template <const auto& Table, class View>
  constexpr Key listed(View) const {
    if constexpr (std::is_invocable_v<View, const S&>)
      return listed(+[](const S& t, const std::string& p, Listing& out) {
        list_object(Table, View{}(t), p, out);
      });
    else
      return *this;
  }
  static constexpr Key ignored(std::string_view name, Spec spec) {
    Key k = make(name, Use::ignored);
    k.spec = spec;
    return k;
  }
  static constexpr Key unsupported(std::string_view name, Off off = Off::never, double x = 0) {
    Key k = make(name, Use::unsupported);
    k.off = off;
    k.off_number = x;
    return k;
  }
  static constexpr Key misplaced(std::string_view name, std::string_view hint) {
    Key k = make(name, Use::misplaced);
    k.hint = hint;
    return k;
  }

  static constexpr Key make(std::string_view name, Use use) {
    Key k;
    k.name = name;
    k.use = use;
    return k;
  }
  constexpr Key or_alias(std::string_view a, std::string_view word = "alias") const {
    Key k = *this;
    k.alias = a;
    k.alias_word = word;
    return k;
  }
  constexpr Key or_null() const {
    Key k = *this;
    k.spec.null_ok = true;
    return k;
  }
  constexpr Key if_given() const {
    Key k = *this;
    k.spec.if_given = true;
    return k;
  }
  // Absent is an error with this text (for objects and custom keys; a value's Spec says it).
  constexpr Key require(std::string_view message) const {
    Key k = *this;
    k.spec.required = message;
    return k;
  }
};

inline bool is_off(Off off, double number, const json& v) {
  switch (off) {
    case Off::never: return false;
    case Off::is_false: return v.is_boolean() && !v.get<bool>();
    case Off::is_true: return v.is_boolean() && v.get<bool>();
    case Off::is_null: return v.is_null();
    case Off::number: return v.is_number() && v.get<double>() == number;
    case Off::null_or_number: return v.is_null() || (v.is_number() && v.get<double>() == number);
    case Off::not_enabled: {
      if (!v.is_object()) return false;
      const auto it = v.find("enabled");
      return it == v.end() || (it->is_boolean() && !it->get<bool>());
    }
  }
  return false;
}

inline std::string off_text(Off off, double number) {
  switch (off) {
    case Off::never: return "";
    case Off::is_false: return " (accepted only as false)";
    case Off::is_true: return " (accepted only as true)";
    case Off::is_null: return " (accepted only as null)";
    case Off::number: return cat(" (accepted only as ", number, ")");
    case Off::null_or_number: return cat(" (accepted only as null or ", number, ")");
    case Off::not_enabled: return " (accepted only with \"enabled\": false)";
  }
  return "";
}

// Checks a value against a spec (not an object's: its section reads it).
inline Value check(const Ctx& c, const Spec& s, const json& v, const std::string& path) {
  Value x;
  switch (s.kind) {
    case Kind::boolean: x.b = as_bool(c, v, path); break;
    case Kind::integer: x.i = as_int(c, v, path, s.lo, s.hi, s.what); break;
    case Kind::real: x.x = as_real(c, v, path, s.real); break;
    case Kind::real_f32:
      (void)as_float(c, v, path, s.real);
      x.x = v.get<double>();
      break;
    case Kind::text: x.s = as_string(c, v, path, s.what); break;
    case Kind::choice: {
      const std::string_view t = as_string(c, v, path, s.what);
      const auto it = std::find_if(s.choices.begin(), s.choices.end(), [&](const Choice& ch) {
        return s.any_case ? lower(ch.name) == lower(t) : ch.name == t;
      });
      if (it == s.choices.end()) c.expected(path, s.what, v);
      x.i = it->value;
      break;
    }
    case Kind::pair:
      if (!v.is_array() || v.size() != 2) c.expected(path, s.what, v);
      x.x = as_float(c, v[0], path + "[0]", s.real);
      x.y = as_float(c, v[1], path + "[1]", s.real);
      break;
    case Kind::any:
    case Kind::object: x.j = &v; break;
  }
  return x;
}

// The error for a key the table does not declare: the closest declared name, or with none close,
// the keys that are read.
template <class S, std::size_t N>
[[noreturn]] void unknown_key(const Ctx& c, const Key<S> (&keys)[N], const std::string& path,
                              const std::string& name) {
  std::vector<std::string_view> names;
  for (const Key<S>& x : keys) {
    names.push_back(x.name);
    if (!x.alias.empty()) names.push_back(x.alias);
  }
  const std::string_view near = closest(name, names);
  std::string msg = near.empty() ? std::string() : cat("; did you mean ", near, "?");
  if (near.empty()) {
    msg = "; zp reads";
    const char* sep = " ";
    for (const Key<S>& x : keys)
      if (x.use == Use::read) {
        msg += cat(sep, x.name, x.alias.empty() ? "" : ", ", x.alias);
        sep = ", ";
      }
  }
  c.fail(join(path, name), "unknown key", msg,
         " (zp rejects keys it does not know, at every level)");
}

// Reads object j (at `path`) into target: checks every key it holds against the table (in the
// document's order), then reads every key the table declares as read (in the table's order: the
// order placeholders are recorded in), storing the value or its default. `placeholders`: every
// read key of the table accepts the Ctx's placeholder.
template <class S, std::size_t N>
void read_object(const Ctx& c, const json& j, const std::string& path, const Key<S> (&keys)[N],
                 S& target, bool placeholders) {
  if (!j.is_object()) c.expected(path, "an object {...}", j);
  auto declared = [&](std::string_view name) -> const Key<S>* {
    for (const Key<S>& k : keys)
      if (k.name == name || (!k.alias.empty() && k.alias == name)) return &k;
    return nullptr;
  };
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    const Key<S>* k = declared(name);
    if (!k && c.skip_unknown) continue;
    if (!k) unknown_key(c, keys, path, name);
    switch (k->use) {
      case Use::read: break;
      case Use::ignored: (void)check(c, k->spec, v, join(path, name)); break;
      case Use::unsupported:
        if (!is_off(k->off, k->off_number, v))
          c.fail(join(path, name), "known ", c.foreign, " key that zp does not support",
                 off_text(k->off, k->off_number), ", got ", show(v));
        break;
      case Use::misplaced: c.fail(join(path, name), k->hint);
    }
  }
  auto find = [&](std::string_view name) -> const json* {
    if (name.empty()) return nullptr;
    const auto it = j.find(std::string(name));
    return it == j.end() ? nullptr : &*it;
  };
  for (const Key<S>& k : keys) {
    if (k.use != Use::read) continue;
    const json* by_name = find(k.name);
    const json* by_alias = find(k.alias);
    if (by_name && by_alias)
      c.fail(join(path, k.alias), "both ", k.name, " and its ", k.alias_word, " ", k.alias,
             " are given; keep one");
    const json* v = by_name ? by_name : by_alias;
    const std::string p = join(path, by_alias ? k.alias : k.name);
    if (!v && !k.spec.required.empty()) c.fail(p, k.spec.required);
    if (v && (placeholders || k.spec.placeholder_ok) && c.is_placeholder(*v)) {
      c.note_placeholder(p);
      v = nullptr;
    }
    if (v && v->is_null() && k.spec.null_ok) v = nullptr;
    if (k.spec.kind == Kind::object) {
      static const json empty = json::object();
      if (v || !k.spec.if_given) k.section(c, v ? *v : empty, p, target);
    } else {
      k.put(target, v ? check(c, k.spec, *v, p) : k.spec.def);
    }
  }
}

// Describes target as read against the table: a line per key declared as read, in the table's
// order, with its full path (by its name, not its alias) and its value as stored, read back by
// the key's get (show(spec, value)); an object or custom key adds the lines of its `list` (a
// nested table's keys), or without one a line "(not shown)". A key declared in a table is so
// described with no code of its own.
template <class S, std::size_t N>
void list_object(const Key<S> (&keys)[N], const S& target, const std::string& path, Listing& out) {
  for (const Key<S>& k : keys) {
    if (k.use != Use::read) continue;
    const std::string p = join(path, k.name);
    if (k.list)
      k.list(target, p, out);
    else if (k.get)
      out.push_back({p, show(k.spec, k.get(target))});
    else
      out.push_back({p, "(not shown)"});
  }
}
template <class S, std::size_t N>
Listing list_object(const Key<S> (&keys)[N], const S& target, const std::string& path = {}) {
  Listing out;
  list_object(keys, target, path, out);
  return out;
}

// Every key a table declares as read, with its alias, in order (for tests and descriptions).
template <class S, std::size_t N>
std::vector<const Key<S>*> read_keys(const Key<S> (&keys)[N]) {
  std::vector<const Key<S>*> out;
  for (const Key<S>& k : keys)
    if (k.use == Use::read) out.push_back(&k);
  return out;
}

}  // namespace zp::detail::keys
