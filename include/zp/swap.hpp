// zp/swap.hpp: ZeRO-Infinity's swap files (DeepSpeed's offload_optimizer and offload_param:
// nvme). An offloaded optimizer's fp32 master weights and state arrays, and at stage 3 the 16-bit
// parameter shard, live in swap files per rank under NvmeOptions::path instead of host memory,
// cut into sub-groups of C elements (sub_group_size, at most the shard's size, rounded up to 2048:
// whole 4 KiB pages of 16-bit values). Sub-group c's record holds every field's c-th run side by
// side, so one aligned transfer moves all the state a step of it needs:
//
//   record c = [ master c | state 0 c | state 1 c ]   at byte c * fields * C * sizeof(U)
//
// The optimizer step walks the sub-groups in order through buffer_count host buffers
// (enter/leave): with pipeline_read, the next sub-groups are read while one is stepped, and the
// next step's first ones from the end of a step on; with pipeline_write, a stepped sub-group is
// written back while the next one is stepped; with both the step costs about max(I/O, compute).
// Other accesses (initial values, checkpoints, whole-model copies) read() and write() element
// ranges through one bounce buffer of a sub-group's field, a one-entry write-back cache, so no
// access holds more than that.
//
// The swap file is scratch, never a checkpoint: named for the process and engine, locked
// (flock) while in use, removed by the destructor; a swap file left by a process that died is
// unlocked, and the next swap opened in the directory removes it. The I/O goes through zp::aio
// (io_uring, or threads where the system refuses it or it predates Linux 5.6; O_DIRECT where the
// file system allows it): a program that offloads to NVMe links zp::aio, whose target defines
// ZP_WITH_AIO; without it opening a swap is an error saying so.
#pragma once

#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "zp/engine_config.hpp"
#include "zp/error.hpp"

#if defined(ZP_WITH_AIO)
#include "zp/async_file.hpp"
#endif

namespace zp {

#if defined(ZP_WITH_AIO)

namespace detail {
// What every swap of the process shares, whatever its element type: the numbers in the file
// names, and the lock under which a new file is created and abandoned ones are removed.
struct SwapFiles {
  std::atomic<std::uint64_t> serial{0};
  std::mutex scanning;
};
inline SwapFiles& swap_files() {
  static SwapFiles s;
  return s;
}
}  // namespace detail

// `fields` arrays of U in one swap file (the optimizer's: fp32 master weights and state; stage
// 3's offloaded parameters: one array of the model's type).
template <class U>
class Swap {
 public:
  static_assert(sizeof(U) == 2 || sizeof(U) == 4, "swaps hold 16- or 32-bit values");
  // Sub-groups are multiples of 2048 elements, 4 KiB of 16-bit values, so that every run is
  // page-aligned and swaps of 16- and 32-bit values walk the same sub-groups.
  static constexpr std::size_t unit = aio::alignment / 2;

  // The sub-groups of a swap of `elements` values (`size` elements each, a multiple of unit),
  // and how many host buffers it keeps: no more than sub-groups, which the others would never
  // hold.
  struct Shape {
    std::size_t size, count, buffers;
  };
  static Shape shape(const NvmeOptions& o, std::size_t elements) noexcept {
    const std::size_t size = std::max<std::size_t>(
        unit,
        (std::min(o.sub_group_size, std::max<std::size_t>(elements, 1)) + unit - 1) / unit * unit);
    const std::size_t count = (elements + size - 1) / size;
    return {size, count,
            std::clamp<std::size_t>(count, 1, std::size_t(std::max(1, o.buffer_count)))};
  }
  // The host memory a swap of these settings keeps: its buffers of `fields` arrays' sub-groups
  // and one bounce buffer.
  static std::size_t host_bytes(const NvmeOptions& o, std::size_t elements, int fields) noexcept {
    const Shape s = shape(o, elements);
    return (s.buffers * std::size_t(fields) + 1) * s.size * sizeof(U);
  }

  // A swap of `fields` arrays of `elements` values each, all zero, for `who` (named in errors).
  Swap(const NvmeOptions& o, std::size_t elements, int fields, const std::string& who)
      : opt_(o), fields_(std::size_t(fields)) {
    o.check();
    namespace fs = std::filesystem;
    std::error_code ec;
    ZP_EXPECT(fs::is_directory(o.path, ec), "offload to nvme: nvme_path '", o.path.string(),
              "' is not an existing directory (", who, ")");
    const Shape shape = Swap::shape(o, elements);
    chunk_ = shape.size;
    chunks_ = shape.count;
    path_ =
        o.path / detail::cat("zp-swap-", ::getpid(), "-", detail::swap_files().serial++, ".swap");
    try {
      {
        // Created and locked before any rank of this process looks for abandoned files.
        const std::lock_guard<std::mutex> lock(detail::swap_files().scanning);
        remove_abandoned(o.path);
        file_.emplace(path_, aio::Mode::read_write,
                      aio::Options{.queue_depth = o.queue_depth, .block_bytes = o.block_size});
        if (::flock(file_->native_handle(), LOCK_EX | LOCK_NB) != 0)
          throw Error(Errc::io,
                      detail::cat("flock of '", path_.string(), "': ", std::strerror(errno)));
      }
      file_->resize(file_bytes());
      buffers_.reserve(shape.buffers);
      for (std::size_t b = 0; b < shape.buffers; ++b) buffers_.emplace_back(record_bytes());
      bounce_.emplace(chunk_ * sizeof(U));
      holds_.assign(buffers_.size(), none);
      io_.assign(buffers_.size(), std::nullopt);
      // All zero: the state arrays start so, and the master weights are written next.
      std::memset(buffers_[0].span().data(), 0, record_bytes());
      std::vector<aio::Transfer> ts;
      for (std::size_t c = 0; c < chunks_; ++c)
        ts.push_back(file_->write_async(record(0), c * record_bytes()));
      for (auto t : ts) file_->wait(t);
    } catch (const Error& e) {
      file_.reset();
      fs::remove(path_, ec);
      throw Error(e.category(),
                  detail::cat("offload to nvme (", who, ", nvme_path '", o.path.string(),
                              "', a swap file of ", file_bytes(), " bytes): ", e.message()),
                  e.native_code());
    }
  }
  Swap(const Swap&) = delete;
  Swap& operator=(const Swap&) = delete;
  ~Swap() {
    file_.reset();  // waits for transfers in flight
    std::error_code ec;
    std::filesystem::remove(path_, ec);  // scratch; already gone is fine
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  bool direct() const noexcept { return file_->direct(); }
  std::size_t sub_group() const noexcept { return chunk_; }  // C, elements
  std::size_t sub_groups() const noexcept { return chunks_; }
  std::size_t file_bytes() const noexcept { return chunks_ * record_bytes(); }
  std::size_t host_bytes() const noexcept {  // the buffers and the bounce buffer, as allocated
    return (buffers_.size() * fields_ + 1) * chunk_ * sizeof(U);
  }

  // ---- element ranges ----------------------------------------------------------------------

  // Field f's elements [at, at + out.size()).
  void read(int f, std::size_t at, std::span<U> out) {
    for (std::size_t done = 0; done < out.size();) {
      const std::size_t c = (at + done) / chunk_, i = (at + done) % chunk_;
      const std::size_t n = std::min(chunk_ - i, out.size() - done);
      const U* b = cached(f, c, true);
      std::copy_n(b + i, n, out.begin() + std::ptrdiff_t(done));
      done += n;
    }
  }
  // Writes field f's elements [at, at + in.size()) (held in the cache until flush()).
  void write(int f, std::size_t at, std::span<const U> in) {
    abandon();  // the sub-groups end_step read ahead may be the ones that change
    for (std::size_t done = 0; done < in.size();) {
      const std::size_t c = (at + done) / chunk_, i = (at + done) % chunk_;
      const std::size_t n = std::min(chunk_ - i, in.size() - done);
      U* b = cached(f, c, n < chunk_);  // a whole run is overwritten: nothing to read first
      std::copy_n(in.begin() + std::ptrdiff_t(done), n, b + i);
      dirty_ = true;
      done += n;
    }
  }
  // Writes the cached run back if it changed.
  void flush() {
    if (!dirty_) return;
    file_->write(bounce_->span(), offset(cached_f_, cached_c_));
    dirty_ = false;
  }
  bool dirty() const noexcept { return dirty_; }  // a run written only to the cache

  // ---- reading ahead (one field: element i lies at byte i * sizeof(U) of the file) ----------

  // A read in flight into a buffer of whole pages around the elements (kept for the next read).
  struct Ahead {
    aio::AlignedBuffer buffer{0};
    aio::Transfer transfer;
    std::size_t skip = 0, n = 0;  // the elements: from byte `skip` of the buffer, n of them
    std::size_t bytes() const noexcept { return buffer.span().size(); }
  };
  // Starts reading elements [at, at + n) into `into`; finish(into) gives them. The read runs
  // while the caller goes on (aio::File), from what write() left too.
  void read_ahead(std::size_t at, std::size_t n, Ahead& into) {
    ZP_ASSERT(fields_ == 1, "swap: reading ahead needs a swap of one field, this one has ",
              fields_);
    flush();
    const std::size_t page = aio::alignment, first = at * sizeof(U) / page * page,
                      end = ((at + n) * sizeof(U) + page - 1) / page * page;
    if (into.buffer.span().size() < end - first) into.buffer = aio::AlignedBuffer(end - first);
    into.skip = at * sizeof(U) - first;
    into.n = n;
    into.transfer = file_->read_async(into.buffer.span().first(end - first), first);
  }
  // The elements of `a` once its read is done (throws its error).
  std::span<const U> finish(Ahead& a) {
    file_->wait(a.transfer);  // kept until it returns: a failed wait leaves the read in flight
    a.transfer = {};
    return {reinterpret_cast<const U*>(a.buffer.span().data() + a.skip), a.n};
  }
  // Waits for `a`'s read, whose elements nobody needs now: its errors are dropped (a read that
  // needs them meets them again).
  void drop(Ahead& a) noexcept {
    try {
      file_->wait(a.transfer);
      a.transfer = {};
    } catch (...) {
    }
  }

  // ---- the optimizer step ------------------------------------------------------------------

  // Where field f of sub-group c is while it is stepped (between enter(c) and leave(c)).
  U* slot(std::size_t c, int f) const noexcept {
    return reinterpret_cast<U*>(buffers_[c % buffers_.size()].span().data()) +
           std::size_t(f) * chunk_;
  }
  void begin_step() {
    flush();
    cached_c_ = none;
  }
  // Sub-group c's state is in slot(c, *) once this returns (sub-groups in increasing order).
  void enter(std::size_t c) {
    const std::size_t b = c % buffers_.size();
    if (holds_[b] != c) fetch(c);
    finish(b);
    if (!opt_.pipeline_read) return;
    for (std::size_t n = c + 1; n < c + ahead() && n < chunks_; ++n)
      if (holds_[n % buffers_.size()] != n) fetch(n);
  }
  // Sub-group c is stepped: it goes back to the file (waited for now unless pipeline_write).
  void leave(std::size_t c) {
    const std::size_t b = c % buffers_.size();
    io_[b] = file_->write_async(record(b), c * record_bytes());
    if (!opt_.pipeline_write) finish(b);
  }
  // Every write of the step is done. With pipeline_read, the next step's first sub-groups are
  // read now, behind whatever runs until that step (a trainer's forward and backward); their
  // errors come at that step's enter. A write() before then drops them.
  void end_step() {
    for (std::size_t b = 0; b < buffers_.size(); ++b) finish(b);
    std::fill(holds_.begin(), holds_.end(), none);
    if (opt_.pipeline_read)
      for (std::size_t c = 0; c < std::min(chunks_, ahead()); ++c) fetch(c);
  }
  // After a failure in the middle of a step, or before the file changes: every transfer
  // finished (the buffers may be freed), errors dropped (the first one is on its way up, or
  // was of a read nobody needs), the buffers holding nothing.
  void abandon() noexcept {
    for (std::size_t b = 0; b < buffers_.size(); ++b) try {
        finish(b);
      } catch (...) {
      }
    std::fill(holds_.begin(), holds_.end(), none);
  }

 private:
  static constexpr std::size_t none = std::size_t(-1);

  // With pipeline_read, enter(c) has sub-groups c .. c + ahead() - 1 read or reading: the
  // buffers but the one written behind (pipeline_write), and at least c itself.
  std::size_t ahead() const noexcept {
    const std::size_t keep = opt_.pipeline_write ? 1 : 0;
    return std::max<std::size_t>(1, buffers_.size() - keep);
  }
  std::size_t record_bytes() const noexcept { return fields_ * chunk_ * sizeof(U); }
  std::span<std::byte> record(std::size_t b) const noexcept {
    return buffers_[b].span().first(record_bytes());
  }
  std::uint64_t offset(int f, std::size_t c) const noexcept {
    return c * record_bytes() + std::size_t(f) * chunk_ * sizeof(U);
  }
  // Starts reading sub-group c into its buffer once that buffer's last transfer is done.
  void fetch(std::size_t c) {
    const std::size_t b = c % buffers_.size();
    finish(b);
    holds_[b] = c;
    io_[b] = file_->read_async(record(b), c * record_bytes());
  }
  // io_[b] is kept until a wait on it returns: one that threw the transfer's error has ended it
  // (the next wait returns at once), one that failed itself has not, and the buffer stays busy.
  void finish(std::size_t b) {
    if (!io_[b]) return;
    file_->wait(*io_[b]);
    io_[b].reset();
  }
  // The bounce buffer holding field f's run of sub-group c (read from the file if `load`).
  U* cached(int f, std::size_t c, bool load) {
    U* b = reinterpret_cast<U*>(bounce_->span().data());
    if (cached_c_ == c && cached_f_ == f) return b;
    flush();
    cached_c_ = none;
    if (load) file_->read(bounce_->span(), offset(f, c));
    cached_c_ = c, cached_f_ = f;
    return b;
  }
  // Removes the swap files of processes that died in `dir`: their lock is free and, where the
  // name's pid is another process's, no such process runs here (a live one may have created its
  // file and not yet locked it: the mutex of the constructor covers only this process's).
  static void remove_abandoned(const std::filesystem::path& dir) {
    std::error_code ec;
    for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!name.starts_with("zp-swap-") || !name.ends_with(".swap")) continue;
      const long pid = std::strtol(name.c_str() + 8, nullptr, 10);  // LONG_MAX where too long
      if (pid > 0 && pid <= std::numeric_limits<pid_t>::max() && pid != ::getpid() &&
          (::kill(pid_t(pid), 0) == 0 || errno == EPERM))
        continue;
      const int fd = ::open(it->path().c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) continue;
      std::error_code gone;
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) std::filesystem::remove(it->path(), gone);
      ::close(fd);
    }
  }

  NvmeOptions opt_;
  std::size_t fields_, chunk_ = 0, chunks_ = 0;
  std::filesystem::path path_;
  std::optional<aio::File> file_;
  std::vector<aio::AlignedBuffer> buffers_;
  std::vector<std::size_t> holds_;  // the sub-group each buffer holds or is reading (none)
  std::vector<std::optional<aio::Transfer>> io_;  // each buffer's transfer in flight
  std::optional<aio::AlignedBuffer> bounce_;
  std::size_t cached_c_ = none;
  int cached_f_ = 0;
  bool dirty_ = false;
};

#else

// Without zp::aio: the type exists so that engines compile, and opening one says what is missing.
template <class U>
class Swap {
 public:
  Swap(const NvmeOptions&, std::size_t, int, const std::string& who) {
    throw Error(Errc::invalid_argument,
                detail::cat("offload to nvme (", who,
                            "): this program was built without zp::aio (io_uring); link the "
                            "zp::aio component (Debian: liburing-dev) to offload to NVMe"));
  }
  const std::filesystem::path& path() const noexcept { return path_; }
  bool direct() const noexcept { return false; }
  std::size_t sub_group() const noexcept { return 1; }
  std::size_t sub_groups() const noexcept { return 0; }
  std::size_t file_bytes() const noexcept { return 0; }
  std::size_t host_bytes() const noexcept { return 0; }
  static std::size_t host_bytes(const NvmeOptions&, std::size_t, int) noexcept { return 0; }
  void read(int, std::size_t, std::span<U>) {}
  void write(int, std::size_t, std::span<const U>) {}
  void flush() {}
  struct Ahead {
    std::size_t bytes() const noexcept { return 0; }
  };
  void read_ahead(std::size_t, std::size_t, Ahead&) {}
  std::span<const U> finish(Ahead&) { return {}; }
  void drop(Ahead&) noexcept {}
  U* slot(std::size_t, int) const noexcept { return nullptr; }
  void begin_step() {}
  void enter(std::size_t) {}
  void leave(std::size_t) {}
  void end_step() {}
  void abandon() noexcept {}

 private:
  std::filesystem::path path_;
};

#endif

}  // namespace zp
