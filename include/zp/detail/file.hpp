// zp/detail/file.hpp: the file primitives checkpoints and safetensors stand on. A file written
// through AtomicFile appears under its name complete and durable, or not at all; InputFile reads
// byte ranges without loading a file whole; crc32c fingerprints what was written and read.
// POSIX only (open, write, pread, fsync, rename).
#pragma once

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>

#include "zp/error.hpp"

// The SSE4.2 CRC on x86 hosts (not in nvcc's device pass, which only parses this header).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDA_ARCH__)
#define ZP_FILE_X86 1
#include <nmmintrin.h>
#else
#define ZP_FILE_X86 0
#endif

namespace zp::detail {

// ---- CRC-32C (Castagnoli) ----------------------------------------------------------------------
// Where the CPU has SSE4.2 (checked once, at run time: nothing is compiled for the build
// machine), its crc32 instruction, which computes exactly this CRC, 8 bytes a step, over three
// interleaved streams (the instruction's latency is three steps), joined as shown below. Elsewhere
// slicing-by-8 (Kounavis and Berry, "A Systematic Approach to Building High Performance
// Software-based CRC Generators", 2005): table k advances a byte k positions, so eight bytes cost
// eight independent lookups instead of a chain of eight. Both give the same bits.

// The register times x, mod the polynomial (held reflected, as the register: bit 31 is x^0): one
// bit of the CRC's division.
constexpr std::uint32_t crc32c_times_x(std::uint32_t a) noexcept {
  return (a >> 1) ^ (0x82F63B78u & (0u - (a & 1u)));
}

inline constexpr std::array<std::array<std::uint32_t, 256>, 8> crc32c_tables = [] {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = crc32c_times_x(c);
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  return t;
}();

// crc32c's portable path (about 1-2 GB/s per core).
inline std::uint32_t crc32c_portable(std::span<const std::byte> data,
                                     std::uint32_t crc = 0) noexcept {
  const auto& t = crc32c_tables;
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  crc = ~crc;
  for (; n >= 8; p += 8, n -= 8) {
    // Bytes assembled explicitly, so the result does not depend on the host's byte order.
    const std::uint32_t lo = crc ^ (std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 |
                                    std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24);
    crc = t[7][lo & 0xffu] ^ t[6][(lo >> 8) & 0xffu] ^ t[5][(lo >> 16) & 0xffu] ^ t[4][lo >> 24] ^
          t[3][p[4]] ^ t[2][p[5]] ^ t[1][p[6]] ^ t[0][p[7]];
  }
  for (; n > 0; ++p, --n) crc = (crc >> 8) ^ t[0][(crc ^ *p) & 0xffu];
  return ~crc;
}

#if ZP_FILE_X86
// The CRC's register (before its final inversion) is linear in it and in the data: run over
// bytes D from register r it is r x^(8|D|) + (D's from 0), mod the polynomial P. So streams
// computed apart join as first x^(8 |bytes after it|) + second.
//
// a b mod P.
constexpr std::uint32_t crc32c_mulmod(std::uint32_t a, std::uint32_t b) noexcept {
  std::uint32_t r = 0;
  for (int j = 0; j < 32; ++j, b = crc32c_times_x(b)) r ^= b & (0u - ((a >> (31 - j)) & 1u));
  return r;
}
// x^k mod P.
constexpr std::uint32_t crc32c_xpow(std::uint64_t k) noexcept {
  std::uint32_t r = 1u << 31, x2 = 1u << 30;  // x^0, x^1, then x^2, x^4, ...
  for (; k > 0; k >>= 1, x2 = crc32c_mulmod(x2, x2))
    if (k & 1) r = crc32c_mulmod(r, x2);
  return r;
}

// The bytes of each of the SSE4.2 path's three streams: the joins' 64 multiply steps are a few
// percent of a round.
inline constexpr std::size_t crc32c_stream_bytes = 8192;

// crc32c's SSE4.2 path; call only where crc32c_sse42_supported().
[[gnu::target("sse4.2")]] inline std::uint32_t crc32c_sse42(std::span<const std::byte> data,
                                                            std::uint32_t crc = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  std::size_t n = data.size();
  std::uint64_t c = ~crc;
  auto load = [](const unsigned char* q) {
    std::uint64_t v;  // x86 is little-endian: the first byte is the lowest, as the CRC takes them
    std::memcpy(&v, q, 8);
    return v;
  };
  constexpr std::size_t s = crc32c_stream_bytes;
  constexpr std::uint32_t shift1 = crc32c_xpow(8 * s), shift2 = crc32c_xpow(16 * s);
  for (; n >= 3 * s; p += 3 * s, n -= 3 * s) {
    std::uint64_t c1 = 0, c2 = 0;
    for (std::size_t i = 0; i < s; i += 8) {
      c = _mm_crc32_u64(c, load(p + i));
      c1 = _mm_crc32_u64(c1, load(p + s + i));
      c2 = _mm_crc32_u64(c2, load(p + 2 * s + i));
    }
    c = crc32c_mulmod(shift2, std::uint32_t(c)) ^ crc32c_mulmod(shift1, std::uint32_t(c1)) ^
        std::uint32_t(c2);
  }
  for (; n >= 8; p += 8, n -= 8) c = _mm_crc32_u64(c, load(p));
  auto c32 = std::uint32_t(c);
  for (; n > 0; ++p, --n) c32 = _mm_crc32_u8(c32, *p);
  return ~c32;
}
inline bool crc32c_sse42_supported() noexcept {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

// The CRC-32C of `data`; pass the previous result as `crc` to continue it over the next bytes
// (crc32c(b, crc32c(a)) == crc32c(a followed by b)).
inline std::uint32_t crc32c(std::span<const std::byte> data, std::uint32_t crc = 0) noexcept {
#if ZP_FILE_X86
  if (crc32c_sse42_supported()) return crc32c_sse42(data, crc);
#endif
  return crc32c_portable(data, crc);
}

// ---- Fault injection ---------------------------------------------------------------------------

// Crash-consistency tests set this to k > 0: the k-th durable step from then on (an AtomicFile
// write, its fsync, its rename, the directory's fsync) throws instead of running, as if the
// process had died there. -1 (the default) and 0 mean off. Process-wide.
inline std::atomic<std::int64_t>& io_fault_countdown() noexcept {
  static std::atomic<std::int64_t> countdown{-1};
  return countdown;
}

// Called before each durable step; counts down and throws when the countdown hits zero.
inline void io_step(const char* what, const std::filesystem::path& path) {
  auto& c = io_fault_countdown();
  std::int64_t v = c.load(std::memory_order_relaxed);
  while (v > 0 && !c.compare_exchange_weak(v, v - 1, std::memory_order_relaxed)) {
  }
  if (v == 1) throw Error(Errc::io, cat("injected fault before ", what, " of ", path.native()));
}

// An Errc::io naming the operation, the path and errno's text (errno is the native code).
[[noreturn]] inline void throw_io(const char* op, const std::filesystem::path& path, int err) {
  throw Error(Errc::io, cat("cannot ", op, " ", path.native(), ": ", std::strerror(err)), err);
}

// ---- Writing -----------------------------------------------------------------------------------

// Makes the entries of directory `dir` ("" = the current one) durable: renames into it survive a
// power cut once this returns.
inline void sync_directory(std::filesystem::path dir) {
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0) throw_io("open directory", dir, errno);
  const int rc = ::fsync(dfd), err = errno;
  ::close(dfd);
  if (rc != 0) throw_io("fsync directory", dir, err);
}

// Writes a new version of a file so that, whatever happens (an exception, a crash, a power cut
// after commit() returned), the final name holds either the previous version or the whole new
// one. The bytes go to `<final>.tmp.<pid>.<n>` in the same directory (rename is atomic only
// within a file system); commit() makes them durable (fsync), renames the temporary over the final
// name and makes the rename durable (fsync of the directory). Without commit() the destructor
// deletes the temporary. Memory: none beyond the object; each write() is one or more write(2).
class AtomicFile {
 public:
  // The n of the process's next temporary name.
  static std::atomic<std::uint64_t>& serial() noexcept {
    static std::atomic<std::uint64_t> n{0};
    return n;
  }

  explicit AtomicFile(std::filesystem::path final_path) : final_(std::move(final_path)) {
    // A process killed while writing leaves its temporary; one restarted with its pid (pid 1 in
    // a container) takes the next name rather than failing on it.
    for (int tries = 0; fd_ < 0; ++tries) {
      tmp_ = final_;
      tmp_ += cat(".tmp.", ::getpid(), ".", serial().fetch_add(1));
      fd_ = ::open(tmp_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0644);
      if (fd_ < 0 && (errno != EEXIST || tries == 1 << 16)) throw_io("create", tmp_, errno);
    }
  }
  AtomicFile(AtomicFile&& o) noexcept
      : final_(std::move(o.final_)),
        tmp_(std::move(o.tmp_)),
        fd_(std::exchange(o.fd_, -1)),
        renamed_(std::exchange(o.renamed_, true)),
        crc_(o.crc_),
        bytes_(o.bytes_) {}
  AtomicFile& operator=(AtomicFile&&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(tmp_.c_str());
  }

  // Appends `data` (retrying partial writes and EINTR).
  void write(std::span<const std::byte> data) {
    ZP_EXPECT(fd_ >= 0, "AtomicFile ", final_.native(), ": write after commit");
    io_step("write", final_);
    for (std::span<const std::byte> rest = data; !rest.empty();) {
      // Linux writes at most 0x7ffff000 bytes per call anyway; asking for less keeps it portable.
      const ::ssize_t n = ::write(fd_, rest.data(), std::min<std::size_t>(rest.size(), 1u << 30));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw_io("write", tmp_, errno);
      }
      rest = rest.subspan(std::size_t(n));
    }
    crc_ = detail::crc32c(data, crc_);
    bytes_ += data.size();
  }

  // Bytes written so far and their CRC-32C.
  std::uint64_t bytes() const noexcept { return bytes_; }
  std::uint32_t crc32c() const noexcept { return crc_; }
  const std::filesystem::path& path() const noexcept { return final_; }

  // Publishes the file under its final name, durably. Call once; afterwards the object only
  // answers bytes() and crc32c().
  void commit() {
    ZP_EXPECT(fd_ >= 0, "AtomicFile ", final_.native(), ": commit called twice");
    io_step("fsync", final_);
    if (::fsync(fd_) != 0) throw_io("fsync", tmp_, errno);
    const int fd = std::exchange(fd_, -1);
    // A failed close can report a deferred write error (NFS): the data may not be there.
    if (::close(fd) != 0) throw_io("close", tmp_, errno);
    io_step("rename", final_);
    if (::rename(tmp_.c_str(), final_.c_str()) != 0)
      throw_io(cat("rename ", tmp_.native(), " to").c_str(), final_, errno);
    renamed_ = true;
    // Until the directory entry is on disk, a power cut can bring back the previous version.
    io_step("directory fsync", final_);
    sync_directory(final_.parent_path());
  }

 private:
  std::filesystem::path final_, tmp_;
  int fd_ = -1;
  bool renamed_ = false;  // the temporary name no longer exists (or never did, when moved from)
  std::uint32_t crc_ = 0;
  std::uint64_t bytes_ = 0;
};

// Replaces `path` with `data` atomically and durably (see AtomicFile).
inline void write_file_atomic(const std::filesystem::path& path, std::span<const std::byte> data) {
  AtomicFile f(path);
  f.write(data);
  f.commit();
}

// ---- Reading -----------------------------------------------------------------------------------

// A regular file open for reading byte ranges (pread: no shared file position, so concurrent
// read_at calls on one InputFile are safe). Memory: none beyond the caller's buffers.
class InputFile {
 public:
  // Only a regular file opens: a directory, a FIFO, a socket or a device is an error naming
  // it. O_NONBLOCK keeps open() itself from waiting for a FIFO's writer that never comes; it is
  // cleared once the file is known to be regular (where it has no effect anyway).
  explicit InputFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd_ < 0) throw_io("open", path_, errno);
    struct stat st {};
    if (::fstat(fd_, &st) != 0) {
      const int err = errno;
      ::close(fd_);
      throw_io("stat", path_, err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw Error(Errc::io, cat("cannot read ", path_.native(), ": not a regular file (",
                                S_ISDIR(st.st_mode)    ? "a directory"
                                : S_ISFIFO(st.st_mode) ? "a FIFO"
                                : S_ISSOCK(st.st_mode) ? "a socket"
                                                       : "a device",
                                ")"));
    }
    if (const int fl = ::fcntl(fd_, F_GETFL);
        fl == -1 || ::fcntl(fd_, F_SETFL, fl & ~O_NONBLOCK) == -1) {
      const int err = errno;
      ::close(fd_);
      throw_io("set blocking mode on", path_, err);
    }
    size_ = std::uint64_t(st.st_size);
  }
  InputFile(InputFile&& o) noexcept
      : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)), size_(o.size_) {}
  InputFile& operator=(InputFile&&) = delete;
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  // The size when the file was opened.
  std::uint64_t size() const noexcept { return size_; }

  // Fills `out` with the bytes at [offset, offset + out.size()); a file that ends sooner is an
  // error naming the range and the file's size.
  void read_at(std::uint64_t offset, std::span<std::byte> out) const {
    std::uint64_t end;
    if (__builtin_add_overflow(offset, std::uint64_t(out.size()), &end)) [[unlikely]]
      throw Error(Errc::invalid_argument, cat("file ", path_.native(), ": reading ", out.size(),
                                              " bytes at offset ", offset, " overflows"));
    for (std::size_t done = 0; done < out.size();) {
      const ::ssize_t n =
          ::pread(fd_, out.data() + done, std::min<std::size_t>(out.size() - done, 1u << 30),
                  ::off_t(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw_io("read", path_, errno);
      }
      if (n == 0) {  // end of file: report its size now, which may differ from size()
        struct stat st {};
        const std::uint64_t now =
            ::fstat(fd_, &st) == 0 ? std::uint64_t(st.st_size) : offset + done;
        throw Error(Errc::io, cat("file ", path_.native(), " is truncated: wanted bytes [", offset,
                                  ", ", end, ") but it has ", now, " bytes"));
      }
      done += std::size_t(n);
    }
  }

  // The CRC-32C of the whole file (size() bytes), read `buffer_bytes` at a time, calling
  // on_read(n) after each n bytes (a long check's progress). The buffer is no larger than the
  // file and never zeroed: a checkpoint's many small files each paid for clearing a megabyte
  // (under TSan, a fault per page of its shadow).
  std::uint32_t crc32c_of_all(std::size_t buffer_bytes = std::size_t(1) << 20,
                              const std::function<void(std::uint64_t)>& on_read = {}) const {
    const auto bytes =
        std::size_t(std::clamp<std::uint64_t>(size_, 1, std::max<std::size_t>(buffer_bytes, 1)));
    const auto buf = std::make_unique_for_overwrite<std::byte[]>(bytes);
    std::uint32_t crc = 0;
    for (std::uint64_t at = 0; at < size_;) {
      const auto n = std::size_t(std::min<std::uint64_t>(bytes, size_ - at));
      const std::span chunk(buf.get(), n);
      read_at(at, chunk);
      crc = detail::crc32c(chunk, crc);
      at += n;
      if (on_read) on_read(n);
    }
    return crc;
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// The whole of a small regular file (a manifest, a config, an index, `latest`); a larger one
// is an error naming both sizes, so a hostile file cannot make the reader allocate at will.
inline std::string read_whole_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  const InputFile f(path);
  if (f.size() > max_bytes)
    throw Error(Errc::io, cat(path.native(), ": ", f.size(), " bytes is more than the ", max_bytes,
                              "-byte limit for this kind of file"));
  std::string s(std::size_t(f.size()), '\0');
  f.read_at(0, std::as_writable_bytes(std::span(s)));
  return s;
}

// Whether `path` is `dir` or lies under it, both resolved as far as they exist (symbolic links,
// "..", a trailing '/'); false where either does not resolve.
inline bool is_within(const std::filesystem::path& path, const std::filesystem::path& dir) {
  bool ok = true;
  const auto resolved = [&](const std::filesystem::path& p) {
    std::error_code ec;
    std::filesystem::path q = std::filesystem::absolute(p, ec);
    if (!ec) q = std::filesystem::weakly_canonical(q, ec);
    ok = ok && !ec && !q.empty();
    return q.has_filename() ? q : q.parent_path();
  };
  const std::filesystem::path d = resolved(dir), p = resolved(path);
  return ok && std::mismatch(d.begin(), d.end(), p.begin(), p.end()).first == d.end();
}

// Renames `from` to `to` only if `to` does not exist (atomically where the file system supports
// it: renameat2's RENAME_NOREPLACE); EEXIST otherwise. Callers that may run where it is not
// supported hold a DirectoryLock, under which the check and the rename cannot race.
inline void rename_no_replace(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return;
  int err = errno;
  if (err == EINVAL || err == ENOSYS) {  // not supported here
    struct stat st {};
    if (::lstat(to.c_str(), &st) == 0)
      err = EEXIST;
    else if (::rename(from.c_str(), to.c_str()) == 0)
      return;
    else
      err = errno;
  }
  throw_io(cat("rename ", from.native(), " to").c_str(), to, err);
}

// An exclusive advisory lock on <dir>/<name> (created if missing), held until destroyed or the
// process dies (flock: the kernel drops it with the last descriptor, so a killed holder never
// leaves a stale lock). A lock held elsewhere, by another process or by another DirectoryLock of
// this one, is waited for up to `wait` (polled: a short job such as zp_ckpt prune finishes),
// then an Errc::io naming the lock file.
class DirectoryLock {
 public:
  DirectoryLock(const std::filesystem::path& dir, const char* name, const char* what,
                std::chrono::milliseconds wait = {})
      : path_(dir / name) {
    fd_ = ::open(path_.c_str(), O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd_ < 0) throw_io("create lock file", path_, errno);
    const auto until = deadline_after(wait);
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK && std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      ::close(fd_);
      if (err == EWOULDBLOCK)
        throw Error(Errc::io,
                    cat(what, ": ", dir.native(), " is locked by another ", what, " (",
                        path_.native(), " is held",
                        wait.count() > 0 ? cat(", waited ", wait.count(), " ms") : std::string(),
                        "); only one may write into a directory at a time"));
      throw_io("lock", path_, err);
    }
  }
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock() { ::close(fd_); }  // closing releases the lock

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace zp::detail
