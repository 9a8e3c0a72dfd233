// zp/detail/json.hpp: the one strict JSON reader behind every JSON file zp reads (checkpoint
// manifests, safetensors headers and indexes, ds_config). Files come from strangers, so on top
// of nlohmann's syntax checks:
//  - nesting is bounded (nlohmann builds and destroys documents recursively: a file of a million
//    '[' overflows the stack), checked while parsing, before the depth exists in memory;
//  - a key repeated in any object is an error naming its path (a parser keeps one of the two
//    values, and which one is meant would be a guess);
//  - errors name the source, line and column (syntax) or the key path.
// Needs nlohmann/json (zp::io).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "zp/error.hpp"

namespace zp::detail {

// Deeper than any file zp reads (a ds_config is 4 levels, a manifest 5, a safetensors header 3).
inline constexpr std::size_t json_max_depth = 32;

// A key or value for a message: its first most - 3 bytes and "..." past `most` (cut before a
// UTF-8 character, not inside one), so a hostile multi-MiB key stays short; control characters
// (C0, DEL and UTF-8's C1) as \xNN, so a NUL does not end the message and no escape sequence
// from a file reaches the terminal (the result is then up to 4 times as long). `most` >= 6.
inline std::string text_excerpt(std::string_view s, std::size_t most = 60) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(s[i]); };
  std::size_t n = s.size();
  if (n > most)
    for (n = most - 3; n > most - 6 && (byte(n) & 0xc0) == 0x80;) --n;  // s[n] continues one
  constexpr char hex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char u = byte(i);
    const bool c1 = u == 0xc2 && i + 1 < n && byte(i + 1) >= 0x80 && byte(i + 1) < 0xa0;
    if (u >= 0x20 && u != 0x7f && !c1) {
      out += char(u);
      continue;
    }
    for (std::size_t k = i; k <= i + c1; ++k)
      out += {'\\', 'x', hex[byte(k) >> 4], hex[byte(k) & 15]};
    i += c1;
  }
  return n < s.size() ? out + "..." : out;
}
// A JSON value as it appears in a message: its text (strings quoted), shortened.
inline std::string json_excerpt(const nlohmann::json& v) {
  return text_excerpt(v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

// Follows the parse to name a key by its full path ("zero_optimization.stage", "params[3].name")
// and raises the depth and duplicate errors.
class JsonTracker {
 public:
  using json = nlohmann::json;
  JsonTracker(std::string_view source, Errc errc) : source_(source), errc_(errc) {}

  bool operator()(int, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        element();
        if (frames_.size() >= json_max_depth)
          fail(cat("nesting deeper than ", json_max_depth, " levels"));
        frames_.push_back(Frame{event == E::object_start, {}, -1, {}});
        break;
      case E::object_end:
      case E::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case E::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second)
          fail(
              "duplicate key (a JSON parser keeps only one of the two values; which one is meant "
              "would be a guess)");
        break;
      }
      case E::value: element(); break;
    }
    return true;
  }

 private:
  struct Frame {
    bool object;
    std::string key;
    std::int64_t index;
    std::set<std::string, std::less<>> keys;
  };
  void element() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
  }
  [[noreturn]] void fail(const std::string& what) const {
    std::string p;
    for (const Frame& f : frames_) {
      if (f.object) {
        if (!p.empty()) p += '.';
        p += text_excerpt(f.key);
      } else {
        p += cat('[', f.index, ']');
      }
    }
    throw Error(errc_, p.empty() ? cat(source_, ": ", what) : cat(source_, ": ", p, ": ", what));
  }

  std::string source_;
  Errc errc_;
  std::vector<Frame> frames_;
};

// Parses `text` strictly (see the top of this file). Errors are Error(errc) starting with
// `source`: "<source>:<line>:<column>: invalid JSON: <why>" for syntax, "<source>: <key path>:
// <why>" for nesting and duplicates. No comments, no trailing commas, UTF-8 only.
inline nlohmann::json parse_json(std::string_view text, std::string_view source, Errc errc) {
  using json = nlohmann::json;
  // nlohmann's text after "[json.exception.parse_error.101] parse error at line 1, column 2: ".
  auto reason = [](std::string what) {
    if (const auto p = what.find("] ");
        what.starts_with("[json.exception.") && p != std::string::npos)
      what = what.substr(p + 2);
    if (what.starts_with("parse error"))
      if (const auto p = what.find(": "); p != std::string::npos) what = what.substr(p + 2);
    return what;
  };
  try {
    JsonTracker tracker(source, errc);
    return json::parse(text.begin(), text.end(), std::ref(tracker), /*allow_exceptions=*/true,
                       /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    // e.byte is the 1-based index of the last byte read.
    const std::size_t end = std::min(text.size(), e.byte > 0 ? e.byte - 1 : 0);
    std::size_t line = 1, column = 1;
    for (std::size_t i = 0; i < end; ++i) {
      if (text[i] == '\n')
        ++line, column = 1;
      else
        ++column;
    }
    throw Error(errc, cat(source, ":", line, ":", column, ": invalid JSON: ", reason(e.what())));
  } catch (const json::exception& e) {  // e.g. a number too large for a double
    throw Error(errc, cat(source, ": invalid JSON: ", reason(e.what())));
  }
}

}  // namespace zp::detail
