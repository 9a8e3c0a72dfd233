// zp/async_file.hpp: large transfers between memory and a file, asynchronous, through io_uring
// (liburing; component zp::aio). The I/O layer of ZeRO-Infinity's NVMe offload (issue #21): a
// transfer is cut into requests of Options::block_bytes, at most Options::queue_depth of them in
// flight, and several transfers may be in flight at once (read the next piece while the last
// one is written back). A transfer runs from the call that starts it, while the caller computes:
// a thread of the File hands its requests to the kernel as queue_depth chains (each request
// starts when the one before it in its chain ends) and reaps them, so the kernel's work for them
// runs on that thread, not on the caller's.
//
//   zp::aio::File f("swap/master.bin", zp::aio::Mode::read_write, {.queue_depth = 32});
//   zp::aio::AlignedBuffer buf(bytes);                          // 4096-byte aligned
//   f.write(buf.span(), 0);                                     // returns once written
//   zp::aio::Transfer t = f.read_async(buf.span(), 0);          // ... other work ...
//   f.wait(t);
//
// Where the system refuses io_uring (a seccomp profile such as Docker's and containerd's default
// ones, the sysctl kernel.io_uring_disabled, a kernel built without it) or its io_uring cannot
// read and write (before Linux 5.6), the transfers run on threads of the File instead,
// min(queue_depth, max_threads) of them, each a pread or pwrite of one request at a time
// (Engine::threads; engine() says which runs, and the first such File of the process says so on
// stderr): the same requests in flight, at the cost of a thread's wake-up per request
// (bench/RESULTS.md, zp_bench_aio's threads rows).
//
// O_DIRECT (no page cache) where the file system allows it; where it refuses (tmpfs, some network
// file systems) the file is opened without it and direct() says so. In direct mode a buffer's
// address, an offset and a length must be multiples of `alignment` (4096 bytes): anything else is
// an Errc::invalid_argument naming the value. Every failure of the system (ENOSPC, EIO, EFBIG, a
// read that meets the end of the file) is an Errc::io naming the file, the call, the offset and
// the length; a transfer's error is thrown by the wait() that finishes it.
//
// A File is used by one thread at a time.
#pragma once

#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "zp/error.hpp"

namespace zp::aio {

// What O_DIRECT needs of addresses, offsets and lengths on the file systems zp meets (4 KiB
// logical blocks; a multiple of 512-byte sectors).
inline constexpr std::size_t alignment = 4096;

enum class Mode { read, read_write };  // read_write creates the file if it is missing

// What moves the bytes: io_uring, or threads running pread and pwrite. automatic: io_uring, or
// threads where the system refuses io_uring (io_uring_setup fails with EPERM, EACCES, ENOSYS, or
// ENOMEM: a locked-memory limit too small for the ring, before Linux 5.12) or its io_uring lacks
// the plain read and write operations (before Linux 5.6, e.g. Ubuntu 20.04's 5.4).
enum class Engine { automatic, io_uring, threads };

inline const char* name(Engine e) noexcept {
  return e == Engine::io_uring ? "io_uring" : e == Engine::threads ? "threads" : "automatic";
}

// The threads engine's threads per File at most.
inline constexpr unsigned max_threads = 64;

struct Options {
  unsigned queue_depth = 32;                       // requests of one transfer in flight at most
  std::size_t block_bytes = std::size_t(1) << 20;  // bytes of one request
  bool direct = true;  // try O_DIRECT (kept only where the file system allows)
  Engine engine = Engine::automatic;
};

// Heap memory aligned for O_DIRECT, its size rounded up to a multiple of `alignment`.
class AlignedBuffer {
 public:
  explicit AlignedBuffer(std::size_t bytes)
      : size_(bytes),
        p_(static_cast<std::byte*>(
            std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment))) {
    if (!p_ && bytes)
      throw Error(Errc::out_of_memory,
                  detail::cat("aio: cannot allocate an aligned buffer of ", bytes, " bytes"));
  }
  std::span<std::byte> span() const noexcept { return {p_.get(), size_}; }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept { std::free(p); }
  };
  std::size_t size_;
  std::unique_ptr<std::byte, Free> p_;
};

// An asynchronous transfer in flight; File::wait() finishes it.
struct Transfer {
  std::uint64_t id = 0;
};

class File {
 public:
  File(std::filesystem::path path, Mode mode, Options opt = {})
      : path_(std::move(path)), opt_(opt) {
    ZP_EXPECT(opt.queue_depth >= 1 && opt.queue_depth <= 4096, "aio: queue_depth ", opt.queue_depth,
              " is not in [1, 4096]");
    ZP_EXPECT(opt.block_bytes >= alignment && opt.block_bytes % alignment == 0 &&
                  opt.block_bytes <= std::size_t(1) << 30,
              "aio: block_bytes ", opt.block_bytes, " is not a multiple of ", alignment, " in [",
              alignment, ", 1 GiB]");
    const int flags = (mode == Mode::read ? O_RDONLY : O_RDWR | O_CREAT) | O_CLOEXEC;
    direct_ = opt.direct;
    fd_ = direct_ ? ::open(path_.c_str(), flags | O_DIRECT, 0644) : -1;
    if (fd_ < 0 && direct_ && errno == EINVAL) direct_ = false;  // the file system refuses it
    if (fd_ < 0 && !direct_) fd_ = ::open(path_.c_str(), flags, 0644);
    if (fd_ < 0) throw io_error("open", 0, 0, errno);
    try {
      start(opt.engine);
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    try {
      while (in_flight_ > 0) reap_one();  // the kernel must not write into freed buffers
    } catch (...) {
    }
    movers_.reset();
    ::close(fd_);
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  bool direct() const noexcept { return direct_; }
  Engine engine() const noexcept { return engine_; }  // io_uring or threads
  int native_handle() const noexcept { return fd_; }
  std::uint64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw io_error("fstat", 0, 0, errno);
    return std::uint64_t(st.st_size);
  }

  Transfer read_async(std::span<std::byte> dst, std::uint64_t offset) {
    return submit(false, dst.data(), dst.size(), offset);
  }
  Transfer write_async(std::span<const std::byte> src, std::uint64_t offset) {
    return submit(true, const_cast<std::byte*>(src.data()), src.size(), offset);
  }
  // Runs the queue until t is finished; throws the error of its failed request at the lowest
  // offset, whatever order they failed in. A finished or unknown t returns.
  void wait(Transfer t) {
    auto it = transfers_.find(t.id);
    while (it != transfers_.end() && it->second.requests_left > 0) {
      pump();
      it = transfers_.find(t.id);
    }
    if (it == transfers_.end()) return;
    const std::string error = std::move(it->second.error);
    const int code = it->second.code;
    transfers_.erase(it);
    if (!error.empty()) throw Error(Errc::io, error, code);
  }
  // Sets the file's size to `bytes` with every block allocated, so a full file system is an
  // error here rather than in the middle of a later write.
  void resize(std::uint64_t bytes) {
    if (::ftruncate(fd_, off_t(bytes)) != 0) throw io_error("ftruncate", 0, bytes, errno);
    if (bytes == 0) return;
    if (const int e = ::posix_fallocate(fd_, 0, off_t(bytes)); e != 0)
      throw io_error("posix_fallocate", 0, bytes, e);
  }
  // Makes the data of the transfers already waited for durable (fdatasync).
  void sync() {
    if (::fdatasync(fd_) != 0) throw io_error("fdatasync", 0, 0, errno);
  }
  void read(std::span<std::byte> dst, std::uint64_t offset) { wait(read_async(dst, offset)); }
  void write(std::span<const std::byte> src, std::uint64_t offset) {
    wait(write_async(src, offset));
  }

 private:
  struct Request {
    std::uint64_t transfer;
    bool write;
    std::byte* buf;
    std::uint64_t offset;
    std::size_t len, done = 0;
    Request* next = nullptr;  // the movers' queues
    int result = 0;           // bytes moved, or -errno
    bool first = false;       // the first of a batch the movers were handed (Ring's chains)
  };

  // Requests in order, linked through Request::next: queued without allocating, so handing one
  // to the movers cannot fail half-way.
  struct Fifo {
    Request* head = nullptr;
    Request** tail = &head;  // (so never copied)
    Fifo() = default;
    Fifo(const Fifo&) = delete;
    Fifo& operator=(const Fifo&) = delete;
    void push(Request* r) noexcept {
      r->next = nullptr;
      *tail = r;
      tail = &r->next;
    }
    Request* pop() noexcept {
      Request* r = head;
      if (r && !(head = r->next)) tail = &head;
      return r;
    }
  };

  // The threads of a File that move its requests, so that the kernel's work for them (issuing,
  // completing) runs beside the caller's computation rather than interrupting it: run() queues a
  // batch (linked requests, taken whole), finished() waits for one that ended, its `result` set
  // (bytes moved, or -errno), and returns null if the movers failed (failure() says why).
  class Movers {
   public:
    Movers() = default;
    Movers(const Movers&) = delete;
    Movers& operator=(const Movers&) = delete;
    virtual ~Movers() = default;  // each kind stops its threads in its own destructor

    void run(Fifo& batch) noexcept {
      if (batch.head) batch.head->first = true;
      {
        const std::lock_guard lk(m_);
        while (Request* r = batch.pop()) queued_.push(r);
      }
      wake();
    }
    Request* finished() noexcept {  // waits for one
      std::unique_lock lk(m_);
      done_.wait(lk, [&] { return finished_.head != nullptr || failure_ != 0; });
      return finished_.pop();
    }
    int failure() const noexcept { return failure_; }

   protected:
    static Error start_error(int e) {
      return Error(Errc::io, detail::cat("aio: cannot start the I/O threads: ", std::strerror(e)),
                   e);
    }
    void start(unsigned count) {
      threads_.reserve(count);  // so that no thread starts that the vector cannot hold
      pthread_attr_t attr;
      if (const int e = ::pthread_attr_init(&attr); e != 0) throw start_error(e);
      // A loop around pread or io_uring_enter needs little stack; the default (8 MiB of address
      // space a thread) would count against a `ulimit -v`.
      ::pthread_attr_setstacksize(&attr, std::size_t(1) << 18);
      int e = 0;
      for (unsigned i = 0; i < count && e == 0; ++i) {
        pthread_t t;
        if ((e = ::pthread_create(&t, &attr, &Movers::main, this)) == 0) threads_.push_back(t);
      }
      ::pthread_attr_destroy(&attr);
      if (e != 0) {
        stop();
        throw start_error(e);
      }
    }
    void stop() noexcept {  // the File has reaped every request first
      {
        const std::lock_guard lk(m_);
        stopping_ = true;
      }
      wake();
      for (pthread_t t : threads_) ::pthread_join(t, nullptr);
      threads_.clear();
    }
    void finish(Fifo& done) noexcept {
      {
        const std::lock_guard lk(m_);
        while (Request* r = done.pop()) finished_.push(r);
      }
      done_.notify_all();
    }
    void fail(int e) noexcept {
      {
        const std::lock_guard lk(m_);
        failure_ = e;
      }
      done_.notify_all();
    }

    std::mutex m_;
    Fifo queued_;
    bool stopping_ = false;

   private:
    static void* main(void* self) {
      static_cast<Movers*>(self)->loop();
      return nullptr;
    }
    virtual void loop() noexcept = 0;
    virtual void wake() noexcept = 0;  // after queued_ or stopping_ changed

    std::condition_variable done_;
    Fifo finished_;
    int failure_ = 0;
    std::vector<pthread_t> threads_;
  };

  // Engine::threads: each thread takes the oldest queued request, moves it with one pread or
  // pwrite (as an io_uring entry does: a short count comes back for the File to go on), and
  // queues it as finished.
  class Workers final : public Movers {
   public:
    Workers(int fd, unsigned count) : fd_(fd) { start(count); }
    ~Workers() override { stop(); }

   private:
    void wake() noexcept override { wake_.notify_all(); }
    void loop() noexcept override {
      std::unique_lock lk(m_);
      for (;;) {
        wake_.wait(lk, [&] { return stopping_ || queued_.head != nullptr; });
        Request* r = queued_.pop();
        if (!r) return;  // stopping, nothing queued
        lk.unlock();
        const off_t at = off_t(r->offset + r->done);
        ssize_t got;
        do
          got = r->write ? ::pwrite(fd_, r->buf + r->done, r->len - r->done, at)
                         : ::pread(fd_, r->buf + r->done, r->len - r->done, at);
        while (got < 0 && errno == EINTR);
        r->result = got < 0 ? -errno : int(got);  // requests are at most 1 GiB
        Fifo done;
        done.push(r);
        finish(done);
        lk.lock();
      }
    }

    int fd_;
    std::condition_variable wake_;
  };

  // Engine::io_uring: one thread owns the ring (taken over, made by File::start). It hands each
  // batch to the kernel as up to queue_depth chains, request i in chain i % depth, so the
  // requests in flight stay near each other in the file and each starts when the one before it
  // in its chain ends; hard links, so a short or failed request does not cancel the rest of its
  // chain. It waits in the ring for completions and for an eventfd that run() and stop() write.
  // Being the submitter, this thread is also where the kernel completes the requests and issues
  // each chain's next one: on the caller's thread that work interrupted its computation
  // (bench/RESULTS.md, zp_bench_swap's overlap rows).
  class Ring final : public Movers {
   public:
    Ring(int fd, const io_uring& ring, unsigned depth) : fd_(fd), ring_(ring), depth_(depth) {
      try {
        if ((wake_fd_ = ::eventfd(0, EFD_CLOEXEC)) < 0) throw start_error(errno);
        batch_.reserve(ring_entries);
        start(1);
      } catch (...) {
        if (wake_fd_ >= 0) ::close(wake_fd_);
        io_uring_queue_exit(&ring_);
        throw;
      }
    }
    ~Ring() override {
      stop();
      io_uring_queue_exit(&ring_);  // cancels the eventfd's read
      ::close(wake_fd_);
    }

   private:
    void wake() noexcept override {
      const std::uint64_t one = 1;
      (void)!::write(wake_fd_, &one, sizeof one);
    }
    void loop() noexcept override {
      Fifo held;           // taken from queued_, not yet in the ring (no room)
      std::size_t in = 0;  // requests in the ring
      bool armed = false;  // the eventfd's read is in the ring
      for (;;) {
        {
          const std::lock_guard lk(m_);
          if (stopping_ && in == 0 && !queued_.head && !held.head) return;
          while (Request* r = queued_.pop()) held.push(r);
        }
        if (!armed) {  // the ring always has room for it: `in` stays below its size
          io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
          io_uring_prep_read(sqe, wake_fd_, &woken_, sizeof woken_, 0);
          io_uring_sqe_set_data(sqe, nullptr);  // (prep leaves an entry's earlier user data)
          armed = true;
        }
        while (const std::size_t n = hand_over(held, in)) in += n;  // each batch that fits
        const int e = io_uring_submit_and_wait(&ring_, 1);
        if (e < 0 && e != -EINTR && e != -EAGAIN && e != -EBUSY) return fail(-e);
        Fifo done;
        unsigned head, seen = 0;
        io_uring_cqe* cqe;
        io_uring_for_each_cqe(&ring_, head, cqe) {
          ++seen;
          if (auto* r = static_cast<Request*>(io_uring_cqe_get_data(cqe))) {
            r->result = cqe->res;
            done.push(r);
            --in;
          } else {
            armed = false;
          }
        }
        io_uring_cq_advance(&ring_, seen);
        if (done.head) finish(done);
      }
    }
    // Prepares entries for held's first batch (up to the next request marked first), as much
    // of it as the ring has room for, `in` requests being in it; returns how many (0: none
    // held, or no room).
    std::size_t hand_over(Fifo& held, std::size_t in) noexcept {
      const std::size_t room = std::min<std::size_t>(
          io_uring_sq_space_left(&ring_),
          ring_.cq.ring_entries - 1 - std::min<std::size_t>(in, ring_.cq.ring_entries - 1));
      batch_.clear();
      while (held.head && batch_.size() < room && (batch_.empty() || !held.head->first))
        batch_.push_back(held.pop());
      if (held.head) held.head->first = true;  // the rest: chains of its own, later
      const std::size_t n = batch_.size(), chains = std::min<std::size_t>(depth_, n);
      for (std::size_t c = 0; c < chains; ++c)
        for (std::size_t i = c; i < n; i += chains) {
          io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
          Request& r = *batch_[i];
          if (r.write)
            io_uring_prep_write(sqe, fd_, r.buf + r.done, unsigned(r.len - r.done),
                                r.offset + r.done);
          else
            io_uring_prep_read(sqe, fd_, r.buf + r.done, unsigned(r.len - r.done),
                               r.offset + r.done);
          if (i + chains < n) sqe->flags |= IOSQE_IO_HARDLINK;
          io_uring_sqe_set_data(sqe, &r);
        }
      return n;
    }

    int fd_;
    io_uring ring_;
    std::size_t depth_;
    int wake_fd_ = -1;
    std::uint64_t woken_ = 0;      // the eventfd's count, read by the ring
    std::vector<Request*> batch_;  // hand_over's, reserved so that it never allocates
  };
  struct State {
    std::size_t requests_left = 0;
    std::string error;  // the failure at the lowest offset (completions come in any order)
    int code = 0;
    std::uint64_t error_at = 0;
  };

  std::string io_message(const char* call, std::uint64_t offset, std::size_t len,
                         const std::string& why) const {
    return detail::cat("aio: ", call, " of '", path_.string(), "'",
                       len ? detail::cat(" at offset ", offset, " (", len, " bytes)") : "", ": ",
                       why);
  }
  Error io_error(const char* call, std::uint64_t offset, std::size_t len, int err) const {
    return Error(Errc::io, io_message(call, offset, len, std::strerror(err)), err);
  }

  // The engine `e` asks for, or for automatic the one the system allows.
  void start(Engine e) {
    if (e != Engine::threads) {
      io_uring ring{};
      const int r = io_uring_queue_init(std::max(opt_.queue_depth, ring_entries), &ring, 0);
      const bool refused = r == -EPERM || r == -EACCES || r == -ENOSYS || r == -ENOMEM;
      if (r != 0 && !refused)
        throw Error(Errc::io, io_message("io_uring_queue_init", 0, 0, std::strerror(-r)), -r);
      // Why io_uring cannot move the bytes here ("" where it can). Before Linux 5.6 it has no
      // IORING_OP_READ/WRITE (each request would fail with EINVAL) and cannot list its
      // operations either (IORING_REGISTER_PROBE came with them).
      std::string why;
      if (r != 0) {
        why = detail::cat("io_uring_queue_init: ", std::strerror(-r),
                          r == -ENOSYS   ? " (a kernel without io_uring)"
                          : r == -ENOMEM ? " (a locked-memory limit too small for the ring)"
                                         : " (a seccomp profile such as Docker's default, or the "
                                           "sysctl kernel.io_uring_disabled)");
      } else {
        io_uring_probe* probe = io_uring_get_probe_ring(&ring);
        const bool ops = probe && io_uring_opcode_supported(probe, IORING_OP_READ) &&
                         io_uring_opcode_supported(probe, IORING_OP_WRITE);
        if (probe) io_uring_free_probe(probe);
        if (ops) {
          movers_ = std::make_unique<Ring>(fd_, ring, opt_.queue_depth);
          engine_ = Engine::io_uring;
          return;
        }
        io_uring_queue_exit(&ring);
        why =
            "this kernel's io_uring has no IORING_OP_READ and IORING_OP_WRITE (Linux 5.6 added "
            "them)";
      }
      if (e == Engine::io_uring)
        throw Error(Errc::io,
                    io_message("io_uring", 0, 0,
                               detail::cat("not usable here: ", why,
                                           "; Engine::threads or automatic runs without it")),
                    r != 0 ? -r : EINVAL);
      static std::atomic<bool> said{false};
      if (!said.exchange(true))
        std::fprintf(stderr,
                     "zp: aio: io_uring is not usable here: %s; file transfers run on threads "
                     "with pread and pwrite instead\n",
                     why.c_str());
    }
    movers_ = std::make_unique<Workers>(fd_, std::min(opt_.queue_depth, max_threads));
    engine_ = Engine::threads;
  }

  Transfer submit(bool write, std::byte* buf, std::size_t len, std::uint64_t offset) {
    const char* what = write ? "write" : "read";
    if (direct_) {
      ZP_EXPECT(reinterpret_cast<std::uintptr_t>(buf) % alignment == 0, "aio: ", what, " of '",
                path_.string(), "': buffer address ", static_cast<const void*>(buf),
                " is not a multiple of ", alignment, " (O_DIRECT; use AlignedBuffer)");
      ZP_EXPECT(offset % alignment == 0 && len % alignment == 0, "aio: ", what, " of '",
                path_.string(), "': offset ", offset, " and length ", len, " must be multiples of ",
                alignment, " (O_DIRECT)");
    }
    const std::uint64_t id = ++last_id_;
    try {
      State& st = transfers_[id];
      for (std::size_t at = 0; at < len; at += opt_.block_bytes) {
        pending_.push_back(
            {id, write, buf + at, offset + at, std::min(opt_.block_bytes, len - at)});
        ++st.requests_left;
      }
      if (st.requests_left == 0) transfers_.erase(id);  // nothing to move
      launch();
    } catch (...) {  // none of its requests went out (launch throws before any does): none will
      std::erase_if(pending_, [&](const Request& r) { return r.transfer == id; });
      transfers_.erase(id);
      throw;
    }
    return {id};
  }

  // Hands the pending requests to the movers, as one batch. Throws nothing once a request is
  // handed over: its transfer is the caller's to wait for, so its buffer lives until then.
  void launch() {
    if (pending_.empty()) return;
    std::vector<std::unique_ptr<Request>> slots;  // allocated before any is queued
    slots.reserve(pending_.size());
    for (const Request& r : pending_) {
      slots.push_back(std::make_unique<Request>(r));
      slots.back()->first = false;  // (a short request's rest comes back marked)
    }
    Fifo batch;
    for (auto& r : slots) batch.push(r.release());
    in_flight_ += pending_.size();
    pending_.clear();
    movers_->run(batch);
  }

  // Hands over what is pending, then reaps one completion.
  void pump() {
    launch();
    reap_one();
  }

  void reap_one() {
    Request* const done = movers_->finished();
    if (!done) throw io_error("io_uring_submit_and_wait", 0, 0, movers_->failure());
    const std::unique_ptr<Request> r(done);
    const int res = r->result;
    --in_flight_;
    State& st = transfers_[r->transfer];
    const char* call = r->write ? "write" : "read";
    const std::uint64_t at = r->offset + r->done;  // the part this completion was for
    const std::size_t left = r->len - r->done;
    const auto fail = [&](std::string why, int code) {
      if (st.error.empty() || at < st.error_at)
        st.error = std::move(why), st.code = code, st.error_at = at;
      --st.requests_left;
    };
    if (res < 0) return fail(io_message(call, at, left, std::strerror(-res)), -res);
    if (res == 0)
      return fail(io_message(call, at, left, r->write ? "no bytes written" : "the file ends there"),
                  0);
    r->done += std::size_t(res);
    if (r->done < r->len)
      pending_.push_front(*r);  // a short transfer: the rest goes again
    else
      --st.requests_left;
  }

  // Submission entries: a transfer of up to this many requests (4 GiB in 1 MiB blocks) goes to
  // the kernel at once; a larger one's rest when the first ones end.
  static constexpr unsigned ring_entries = 4096;

  std::filesystem::path path_;
  Options opt_;
  int fd_ = -1;
  bool direct_ = true;
  Engine engine_ = Engine::automatic;
  std::unique_ptr<Movers> movers_;
  std::size_t in_flight_ = 0;  // submitted, not reaped
  std::deque<Request> pending_;
  std::map<std::uint64_t, State> transfers_;
  std::uint64_t last_id_ = 0;
};

}  // namespace zp::aio
