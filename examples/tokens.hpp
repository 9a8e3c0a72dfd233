// examples/tokens.hpp: zp_gpt's training data as token ids (a text's, one id a byte, or llm.c's
// token files) and the windows a step trains on.
//
// llm.c's token file (what its dev/data scripts write for tinyshakespeare, fineweb and the rest,
// GPT-2's tokens): a header of 256 little-endian int32, of which the first three are 20240520,
// the version 1 (tokens of 2 bytes) and the token count, then the tokens as little-endian uint16.
// A file is checked whole when opened: the header, a size of exactly 1024 + 2 x count bytes and
// every token below the vocabulary, each an error naming the file (and the token's position).
// Training then reads each window with pread as it is drawn, so a data set larger than memory
// trains from the page cache, and a file cut short under a running job is an error naming it.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "zp/detail/file.hpp"
#include "zp/error.hpp"

namespace examples {

static_assert(std::endian::native == std::endian::little,
              "llm.c's token files are little-endian; this reader takes them as they lie");

class TokenFile {
 public:
  static constexpr std::int32_t magic = 20240520, version = 1;
  static constexpr std::size_t header_bytes = 256 * sizeof(std::int32_t);

  // Opens and checks `path`: every token must be below `vocab`.
  TokenFile(const std::string& path, int vocab) : file_(path) {
    if (file_.size() < header_bytes)
      fail(zp::detail::cat("is ", file_.size(), " bytes, shorter than the ", header_bytes,
                           "-byte header of a token file"));
    std::int32_t header[3];
    file_.read_at(0, std::as_writable_bytes(std::span(header)));
    if (header[0] != magic)
      fail(zp::detail::cat("starts with ", header[0], ", not llm.c's token file magic ", magic));
    if (header[1] != version)
      fail(zp::detail::cat("is version ", header[1], "; only version ", version,
                           " (tokens of 2 bytes) is read"));
    if (header[2] < 0) fail(zp::detail::cat("has a negative token count (", header[2], ")"));
    count_ = std::size_t(header[2]);
    const std::uint64_t want = header_bytes + 2 * std::uint64_t(count_);
    if (file_.size() != want)
      fail(zp::detail::cat("is ", file_.size(), " bytes, but its header's ", count_,
                           " tokens make ", want));
    std::vector<std::uint16_t> chunk(std::size_t(1) << 19);
    for (std::size_t at = 0; at < count_; at += chunk.size()) {
      const std::span part(chunk.data(), std::min(chunk.size(), count_ - at));
      read_raw(at, part);
      const auto big = std::find_if(part.begin(), part.end(), [&](auto t) { return t >= vocab; });
      if (big != part.end())
        fail(zp::detail::cat("has the token ", *big, " at position ",
                             at + std::size_t(big - part.begin()), ", not below the vocabulary (",
                             vocab, ")"));
    }
  }

  const std::string& path() const noexcept { return file_.path().native(); }
  std::size_t size() const noexcept { return count_; }

  // Every token, as ids.
  std::vector<int> ids() const {
    std::vector<int> out(count_);
    read(0, out);
    return out;
  }

  // Tokens [first, first + out.size()) as ids.
  void read(std::size_t first, std::span<int> out) const {
    std::uint16_t raw[1024];
    for (std::size_t done = 0; done < out.size();) {
      const std::span part(raw, std::min(std::size(raw), out.size() - done));
      read_raw(first + done, part);
      std::copy(part.begin(), part.end(), out.begin() + std::ptrdiff_t(done));
      done += part.size();
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw zp::Error(zp::Errc::invalid_argument, "token file " + path() + " " + what);
  }
  void read_raw(std::size_t first, std::span<std::uint16_t> out) const {
    file_.read_at(header_bytes + 2 * std::uint64_t(first), std::as_writable_bytes(out));
  }

  zp::detail::InputFile file_;
  std::size_t count_ = 0;
};

// Windows of `length` consecutive ids from a text's ids or from token files: window k is the
// k-th in order over the sequences (the text, or each file in turn), and none crosses from one
// file into the next.
class Windows {
 public:
  Windows(std::vector<int> text, int length)
      : length_(std::size_t(length)), text_(std::move(text)) {
    ZP_EXPECT(text_.size() >= length_, "the training text is ", text_.size(),
              " characters, shorter than a window (", length_, ")");
    ends_.push_back(text_.size() - length_ + 1);
  }
  Windows(std::vector<TokenFile> files, int length)
      : length_(std::size_t(length)), files_(std::move(files)) {
    ZP_EXPECT(!files_.empty(), "no token file to draw windows from");
    std::size_t windows = 0;
    for (const TokenFile& f : files_) {
      if (f.size() < length_)
        throw zp::Error(
            zp::Errc::invalid_argument,
            zp::detail::cat("token file ", f.path(), " has ", f.size(),
                            " tokens, fewer than a window of --context + 1 (", length_, ")"));
      ends_.push_back(windows += f.size() - length_ + 1);
    }
  }

  std::size_t count() const noexcept { return ends_.back(); }
  std::size_t length() const noexcept { return length_; }
  std::size_t tokens() const noexcept {
    std::size_t n = text_.size();
    for (const TokenFile& f : files_) n += f.size();
    return n;
  }
  std::size_t files() const noexcept { return files_.size(); }

  // Window k's ids into out (length() of them).
  void read(std::size_t k, std::span<int> out) const {
    ZP_EXPECT(k < count() && out.size() == length_, "window ", k, " of ", count(), " into ",
              out.size(), " ids (a window is ", length_, ")");
    if (files_.empty()) {
      std::copy_n(text_.begin() + std::ptrdiff_t(k), length_, out.begin());
      return;
    }
    const std::size_t f =
        std::size_t(std::upper_bound(ends_.begin(), ends_.end(), k) - ends_.begin());
    files_[f].read(k - (f ? ends_[f - 1] : 0), out);
  }

 private:
  std::size_t length_;
  std::vector<int> text_;
  std::vector<TokenFile> files_;
  std::vector<std::size_t> ends_;  // windows in the sequences up to and including each
};

}  // namespace examples
