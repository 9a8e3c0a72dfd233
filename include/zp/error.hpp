// zp/error.hpp: the one exception type zp throws, and the argument checks that raise it.
#pragma once

#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace zp {

// What went wrong, coarsely, so callers can branch without parsing messages.
enum class Errc {
  invalid_argument,  // a user mistake: bad size, mismatched layout, inconsistent config
  backend,           // a backend failed in a way that has no more specific category
  cuda,              // a CUDA runtime call failed; native_code() is the cudaError_t
  nccl,              // an NCCL call failed; native_code() is the ncclResult_t
  mpi,               // an MPI call failed; native_code() is the MPI error code
  timeout,           // a peer did not arrive within the communicator's timeout
  aborted,           // another rank failed, so this communicator was poisoned
  io,                // a file could not be read or written
};

inline const char* to_string(Errc c) noexcept {
  switch (c) {
    case Errc::invalid_argument: return "invalid argument";
    case Errc::backend: return "backend error";
    case Errc::cuda: return "CUDA error";
    case Errc::nccl: return "NCCL error";
    case Errc::mpi: return "MPI error";
    case Errc::timeout: return "timeout";
    case Errc::aborted: return "aborted";
    case Errc::io: return "I/O error";
  }
  return "unknown error";
}

// Carries the category, the native error code of the failing library (0 if none) and the
// source location of the check that raised it. what() is "zp: <category>: <message> [file:line]".
class Error : public std::runtime_error {
 public:
  Error(Errc category, const std::string& message, int native_code = 0,
        std::source_location where = std::source_location::current())
      : std::runtime_error(format(category, message, where)),
        category_(category),
        native_code_(native_code),
        message_(message),
        where_(where) {}

  Errc category() const noexcept { return category_; }
  int native_code() const noexcept { return native_code_; }
  // The message without the category prefix and location.
  const std::string& message() const noexcept { return message_; }
  const std::source_location& where() const noexcept { return where_; }

 private:
  static std::string format(Errc c, const std::string& m, const std::source_location& w) {
    std::string file = w.file_name();
    if (auto pos = file.rfind("include/zp/"); pos != std::string::npos) file = file.substr(pos + 8);
    return std::string("zp: ") + to_string(c) + ": " + m + " [" + file + ":" +
           std::to_string(w.line()) + "]";
  }

  Errc category_;
  int native_code_;
  std::string message_;
  std::source_location where_;
};

namespace detail {
// Concatenates anything streamable: messages name the offending values.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace zp

// Always-on check of a user-supplied value (never compiled out): throws
// zp::Error(Errc::invalid_argument) whose message is the concatenation of the arguments.
#define ZP_EXPECT(cond, ...)                                                         \
  do {                                                                               \
    if (!(cond)) [[unlikely]]                                                        \
      throw ::zp::Error(::zp::Errc::invalid_argument, ::zp::detail::cat(__VA_ARGS__)); \
  } while (0)
