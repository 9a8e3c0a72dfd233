// zp/error.hpp: the one exception type zp throws, and the argument checks that raise it.
#pragma once

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstddef>
#include <exception>
#include <limits>
#include <source_location>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
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
  out_of_memory,     // an allocation failed; the message names what was being allocated
  internal,          // an invariant of zp itself broke: a bug in zp, not in the caller's input
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
    case Errc::out_of_memory: return "out of memory";
    case Errc::internal: return "internal error (a bug in zp; please report it)";
  }
  return "unknown error";
}

namespace detail {
// The newest zp::Error made on this thread, and how many exceptions were in flight then. The
// MPI backend names it when an exception propagating through a communicator's destructor makes
// it abort the job: a destructor cannot see that exception, and the abort ends the process
// before any handler could print it. every_rank: an agreement (agreement.hpp) found that every
// rank of the job raises it at once, so no rank waits for another and nothing need be aborted.
struct NewestError {
  std::string what;
  int in_flight = 0;
  bool every_rank = false;
};
inline NewestError& newest_error() noexcept {
  thread_local NewestError e;
  return e;
}
// Records that the exception of what() `what`, about to be thrown, is raised on every rank of
// the job at once.
inline void raised_on_every_rank(const char* what) noexcept {
  try {
    newest_error() = {what, std::uncaught_exceptions(), true};
  } catch (...) {  // no memory for the copy: the job is then aborted, as before
  }
}
// Forgets such a record: called where communication goes on, so the error was handled.
inline void every_rank_handled() noexcept { newest_error().every_rank = false; }
// Whether the exception now propagating (caught: `caught`, else the one in flight) is one that
// every rank of the job raises at once (the newest zp::Error so recorded, and no exception came
// after it). The next agreement or checked MPI call clears the record (every_rank_handled), so
// only a non-zp exception thrown after such an error was handled and before any collective
// could be taken for it: the job then ends at the other ranks' timeout, not at once.
inline bool every_rank_raises(const std::exception* caught = nullptr) noexcept {
  const NewestError& e = newest_error();
  return e.every_rank &&
         (caught ? e.in_flight == std::uncaught_exceptions() && e.what == caught->what()
                 : e.in_flight + 1 == std::uncaught_exceptions());
}
}  // namespace detail

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
        where_(where) {
    try {
      detail::newest_error() = {what(), std::uncaught_exceptions()};
    } catch (...) {  // no memory for the copy: the error itself still goes out
    }
  }

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
// Floats in their shortest exact form (1.0000001f is not "1"); anything else as streamed.
template <class T>
void put(std::ostringstream& os, const T& x) {
  if constexpr (std::is_floating_point_v<T>) {
    char buf[32];
    const auto r = std::to_chars(buf, buf + sizeof buf, x);
    os.write(buf, r.ptr - buf);
  } else {
    os << x;
  }
}

// Concatenates anything streamable: messages name the offending values.
template <class... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (put(os, args), ...);
  return os.str();
}

// Runs f; a zp::Error it raises comes out with the same category, native code and source
// location, its message replaced by wrap(message) (called only then: saying which call failed).
template <class F, class Wrap>
decltype(auto) with_context(F&& f, Wrap&& wrap) {
  try {
    return f();
  } catch (const Error& e) {
    throw Error(e.category(), wrap(e.message()), e.native_code(), e.where());
  }
}

// What `e` says: a zp::Error's message (its what() adds the category and source location).
inline std::string message_of(const std::exception& e) {
  const auto* z = dynamic_cast<const Error*>(&e);
  return z ? z->message() : std::string(e.what());
}

// A destructor (or another path that cannot throw) met an error it has to drop: it says so on
// stderr instead of losing it silently. `where` names the code that dropped it.
inline void log_dropped(const char* where, const char* what) noexcept {
  std::fprintf(stderr, "zp: %s dropped an error it cannot report: %s\n", where, what);
}

// Size arithmetic that cannot wrap: an overflow is an invalid_argument naming `what` and both
// operands (a wrapped size would allocate a small buffer and then write past it).
template <class... Ctx>
std::size_t checked_mul(std::size_t a, std::size_t b, const Ctx&... what) {
  std::size_t r;
  if (__builtin_mul_overflow(a, b, &r)) [[unlikely]]
    throw Error(Errc::invalid_argument,
                cat(what..., ": ", a, " * ", b, " overflows a 64-bit size"));
  return r;
}
template <class... Ctx>
std::size_t checked_add(std::size_t a, std::size_t b, const Ctx&... what) {
  std::size_t r;
  if (__builtin_add_overflow(a, b, &r)) [[unlikely]]
    throw Error(Errc::invalid_argument,
                cat(what..., ": ", a, " + ", b, " overflows a 64-bit size"));
  return r;
}

// A setting that must be a finite, non-negative number (learning rates, decay rates): NaN fails.
inline void expect_finite_non_negative(double x, const char* who, const char* field) {
  if (!(std::isfinite(x) && x >= 0.0)) [[unlikely]]
    throw Error(Errc::invalid_argument, cat(who, ": ", field, " must be finite and >= 0, got ", x));
}

// The deadline `timeout` from now; time_point::max() ("never") for timeouts so long that
// now() + timeout would overflow (milliseconds::max() means "never").
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  using clock = std::chrono::steady_clock;
  const auto now = clock::now();
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(clock::time_point::max() - now);
  return timeout >= room ? clock::time_point::max() : now + timeout;
}
}  // namespace detail

}  // namespace zp

// Always-on check of a user-supplied value (never compiled out): throws
// zp::Error(Errc::invalid_argument) whose message is the concatenation of the arguments.
#define ZP_EXPECT(cond, ...)                                                           \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      throw ::zp::Error(::zp::Errc::invalid_argument, ::zp::detail::cat(__VA_ARGS__)); \
  } while (0)

// Always-on check of zp's own invariants (never compiled out): throws
// zp::Error(Errc::internal), so a broken invariant is not reported as the caller's mistake.
#define ZP_ASSERT(cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) [[unlikely]]                                                  \
      throw ::zp::Error(::zp::Errc::internal, ::zp::detail::cat(__VA_ARGS__)); \
  } while (0)
