// examples/common.hpp: what the example trainers (zp_demo, zp_gpt, the device demo) share: the
// training text as character ids, the command-line flags of the training loop with their checks,
// and launching the ranks on the chosen backend.
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <fcntl.h>     // open
#include <signal.h>    // sigaction
#include <sys/stat.h>  // fstat
#include <unistd.h>    // read

#include "zp/backend/threads.hpp"
#include "zp/dispatch.hpp"
#include "zp/engine.hpp"
#include "zp/error.hpp"
#if ZP_DEMO_MPI
#include "zp/backend/mpi.hpp"
#endif

namespace examples {

// ---- data -----------------------------------------------------------------------------------

// The training text as ids, one per byte; ids are numbered in order of first appearance.
struct Corpus {
  std::vector<int> ids;
  std::vector<char> chars;  // id -> character

  // `text` as token ids; a character the training text lacks is an error naming it and `what`.
  std::vector<int> encode(std::string_view text, std::string_view what) const {
    std::vector<int> out;
    out.reserve(text.size());
    for (char ch : text) {
      const auto at = std::find(chars.begin(), chars.end(), ch);
      if (at == chars.end())
        throw zp::Error(zp::Errc::invalid_argument,
                        std::string(what) + ": the character '" + std::string(1, ch) + "' (byte " +
                            std::to_string(int(static_cast<unsigned char>(ch))) +
                            ") is not in the training text's vocabulary");
      out.push_back(int(at - chars.begin()));
    }
    return out;
  }
};

// The whole of the file at `path`: a regular file or a pipe (`--text <(zcat a.gz)`); a device
// such as /dev/zero, which would never end, or a socket is an error. `what` names it in errors.
inline std::string read_text(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    throw zp::Error(zp::Errc::io, what + " '" + path + "' is a directory, not a file");
  const auto fail = [&](const std::string& why) {
    throw zp::Error(zp::Errc::io, "cannot read " + what + " '" + path + "': " + why);
  };
  // O_NONBLOCK: a FIFO's open() does not wait for a writer (without one, the text is empty).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) fail(std::strerror(errno));
  struct stat st {};
  const int fl = ::fstat(fd, &st) == 0 ? ::fcntl(fd, F_GETFL) : -1;
  std::string why = fl < 0 || ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0 ? std::strerror(errno)
                    : S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode)         ? ""
                                                                          : "not a file or a pipe";
  std::string text;
  char buf[1 << 16];
  for (ssize_t n = 1; why.empty() && n != 0;) {
    n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno != EINTR) why = std::strerror(errno);
    if (n > 0) text.append(buf, std::size_t(n));
  }
  ::close(fd);
  if (!why.empty()) fail(why);
  return text;
}

// The files concatenated, each followed by a newline.
inline Corpus load_corpus(const std::vector<std::string>& paths) {
  std::string text;
  for (const auto& p : paths) text += read_text(p, "text file") + '\n';
  int map[256];
  std::fill(std::begin(map), std::end(map), -1);
  Corpus c;
  for (unsigned char ch : text) {
    if (map[ch] < 0) {
      map[ch] = int(c.chars.size());
      c.chars.push_back(char(ch));
    }
    c.ids.push_back(map[ch]);
  }
  return c;
}

// ---- command line ---------------------------------------------------------------------------

// The program's name and usage text (usage, then more: flags shared with another program),
// which every command-line error prints.
struct Program {
  const char* name;
  const char* usage;
  const char* more = "";
};

[[noreturn]] inline void bad(const Program& p, const std::string& msg) {
  std::fprintf(stderr, "%s: %s\n\n%s%s", p.name, msg.c_str(), p.usage, p.more);
  std::exit(2);
}

// Whether `flag` is among the flags given (parse_args' result).
inline bool gave(const std::vector<std::string>& given, std::string_view flag) {
  return std::find(given.begin(), given.end(), flag) != given.end();
}

// Walks argv: --help prints the usage and exits 0; a flag in one of the `switches` lists (no
// value) and every other "--flag value" pair go to on_flag(flag, value) (value "" for a switch),
// which returns false for a flag it does not know: an error naming it, as is a flag without its
// value, an empty value, a value that is another flag ("--export --resume": the path forgotten)
// and a flag given twice (only --text and --tokens repeat). Returns the flags given, in order.
template <class OnFlag, class... Switches>
std::vector<std::string> parse_args(const Program& p, int argc, char** argv, OnFlag&& on_flag,
                                    const Switches&... switches) {
  std::vector<std::string> given;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(p.usage, stdout);
      std::fputs(p.more, stdout);
      std::exit(0);
    }
    const bool is_switch =
        ((std::find(switches.begin(), switches.end(), a) != switches.end()) || ...);
    if (!is_switch && i + 1 >= argc) bad(p, "unknown flag or missing value: '" + a + "'");
    const std::string v = is_switch ? std::string() : std::string(argv[++i]);
    if (!on_flag(a, v)) bad(p, "unknown flag '" + a + "'");
    if (!is_switch && (v.empty() || v.starts_with("--")))
      bad(p, a + " expects a value, got " + (v.empty() ? "an empty one" : "the flag '" + v + "'"));
    if (a != "--text" && a != "--tokens" && gave(given, a)) bad(p, a + " is given twice");
    given.push_back(a);
  }
  return given;
}

inline int to_int(const Program& p, const std::string& flag, const std::string& v, int lo, int hi) {
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);  // which skips spaces and takes a '+'
  const bool digits = !v.empty() && (std::isdigit(static_cast<unsigned char>(v[0])) || v[0] == '-');
  if (!digits || *end != '\0' || x < lo || x > hi)
    bad(p, flag + " expects an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
               "], got '" + v + "'");
  return int(x);
}

// The flags of the training loop; a program sets its own defaults before parsing.
struct TrainFlags {
  int stage = 3, ranks = 4, accum = 1, steps = 600, micro_batch = 32, log_every = 50;
  std::string backend = "threads", precision = "bf16";
  // The flags on the command line (parse_args'): a --config takes --micro-batch, --accum, --lr
  // and --precision only for its "auto" keys, and a value it writes must agree with a flag given
  // (run_control.hpp).
  std::vector<std::string> given;
  float lr = 3e-3f;
  std::uint64_t init_seed = 1;  // --init-seed: the initial weights' random draw
  bool offload = false;  // --offload-optimizer cpu: ZeRO-Offload (EngineConfig::offload_optimizer)
  std::string nvme;  // --offload-optimizer nvme:DIR: ZeRO-Infinity (EngineConfig::optimizer_nvme)
  bool offload_param = false;  // --offload-param cpu (EngineConfig::offload_param)
  std::string param_nvme;      // --offload-param nvme:DIR (EngineConfig::param_nvme)
  std::vector<std::string> text;

  bool was_given(std::string_view flag) const { return gave(given, flag); }
  // The element type --precision names (fp32, bf16 or fp16), for zp::dispatch.
  zp::DType dtype() const {
    return precision == "fp32"   ? zp::DType::f32
           : precision == "fp16" ? zp::DType::f16
                                 : zp::DType::bf16;
  }
};

// The largest --micro-batch and --accum (and the largest a config may give): the trainers count
// sequences and micro-batches in int.
inline constexpr int max_micro_batch = 65536, max_accum = 1024;

// Takes flag a with value v if it is one of TrainFlags' (--stage, --ranks, --accum, --steps,
// --micro-batch, --log-every, --backend, --precision, --lr, --init-seed, --offload-optimizer,
// --offload-param, --text); false if not.
inline bool parse_train_flag(const Program& p, TrainFlags& o, const std::string& a,
                             const std::string& v) {
  if (a == "--stage")
    o.stage = to_int(p, a, v, 0, 3);
  else if (a == "--ranks")
    o.ranks = to_int(p, a, v, 1, 256);
  else if (a == "--accum")
    o.accum = to_int(p, a, v, 1, max_accum);
  else if (a == "--steps")
    o.steps = to_int(p, a, v, 1, 10000000);
  else if (a == "--micro-batch")
    o.micro_batch = to_int(p, a, v, 1, max_micro_batch);
  else if (a == "--log-every")
    o.log_every = to_int(p, a, v, 1, 10000000);
  else if (a == "--backend") {
    if (v != "threads" && v != "mpi") bad(p, "--backend expects threads or mpi, got '" + v + "'");
    o.backend = v;
  } else if (a == "--precision") {
    if (v != "fp32" && v != "bf16" && v != "fp16")
      bad(p, "--precision expects fp32, bf16 or fp16, got '" + v + "'");
    o.precision = v;
  } else if (a == "--lr") {
    char* end = nullptr;
    o.lr = std::strtof(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(o.lr > 0.0f) || o.lr > 1.0f)
      bad(p, "--lr expects a number in (0, 1], got '" + v + "'" +
                 (!v.empty() && *end == '\0' && o.lr == 0.0f && std::strtod(v.c_str(), nullptr) != 0
                      ? " (0 as a float)"
                      : ""));
  } else if (a == "--offload-optimizer" || a == "--offload-param") {
    const bool nvme = v.starts_with("nvme:") && v.size() > 5;
    if (v != "cpu" && v != "none" && !nvme)
      bad(p, a + " expects none, cpu or nvme:DIR (a directory on the drive), got '" + v + "'");
    (a == "--offload-param" ? o.offload_param : o.offload) = v != "none";
    (a == "--offload-param" ? o.param_nvme : o.nvme) = nvme ? v.substr(5) : "";
  } else if (a == "--init-seed") {
    o.init_seed = std::uint64_t(to_int(p, a, v, 0, 2147483647));
  } else if (a == "--text") {
    o.text.push_back(v);
  } else {
    return false;
  }
  return true;
}

// Without --text: every file of /usr/share/common-licenses (every Debian machine has them), sorted.
inline void default_text(const Program& p, std::vector<std::string>& text) {
  if (!text.empty()) return;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/usr/share/common-licenses", ec))
    if (e.is_regular_file()) text.push_back(e.path().string());
  std::sort(text.begin(), text.end());
  if (text.empty()) bad(p, "no --text given and /usr/share/common-licenses has no files");
}

inline double mib(std::size_t bytes) { return double(bytes) / double(1 << 20); }

// ---- progress output ------------------------------------------------------------------------

// all_reduce of a few host values over comm's ranks, on any backend. A device backend's
// collectives take device memory: the device trainer (charlm_device.cpp) defines
// device_all_reduce, which stages x through a device buffer.
template <class Comm, class X>
void device_all_reduce(Comm& comm, std::span<X> x, zp::ReduceOp op);
template <class Comm, class X>
void all_reduce_host(Comm& comm, std::span<X> x, zp::ReduceOp op) {
  if constexpr (Comm::memory == zp::MemorySpace::host)
    comm.all_reduce(x, op);
  else
    device_all_reduce(comm, x, op);
}

// The mean of x over comm's ranks.
template <class Comm>
double mean_over_ranks(Comm& comm, double x) {
  all_reduce_host(comm, std::span<double>(&x, 1), zp::ReduceOp::avg);
  return x;
}

// What the engine's own communicators moved (hybrid sharding's shard group and replicas, ZeRO++'s
// nodes), in nccl-tests' S bytes: the trainers add it to their communicators' counters.
template <class Engine>
std::uint64_t engine_group_bytes(Engine& e) {
  std::uint64_t b = 0;
  for (auto* c : {e.replicas() ? &e.comm() : nullptr, e.replicas(), e.hpz_group(),
                  e.qgz_node_group(), e.qgz_cross_group()})
    if (c) b += c->stats().total().bytes;
  return b;
}

// The trainers' progress line every log_every steps (the global mean loss of the steps since the
// last line, tokens/s, loss scale, skipped steps, model-state MiB, communicated GB, the last
// step's gradient norm) and the loss trend for the summary. Collective: every rank calls step()
// each optimizer step.
class Progress {
 public:
  Progress(int log_every, int first_step, int last_step)
      : every_(log_every),
        first_step_(first_step),
        last_step_(last_step),
        t_log_(std::chrono::steady_clock::now()) {}

  // comm_bytes: what the run has communicated so far (default: comm's own counters and the
  // engine's groups').
  template <class Comm, class Engine>
  void step(Comm& comm, Engine& engine, int step, double loss, const zp::StepResult& res,
            std::int64_t tokens, std::optional<std::uint64_t> comm_bytes = std::nullopt) {
    skipped_ += res.overflow;
    window_loss_ += loss;
    ++window_steps_;
    window_tokens_ += tokens;
    if (!logs(step)) return;
    const double mean = mean_over_ranks(comm, window_loss_ / window_steps_);
    const auto now = std::chrono::steady_clock::now();
    const double dt = std::chrono::duration<double>(now - t_log_).count();
    if (first_loss_ < 0) first_loss_ = mean;
    last_loss_ = mean;
    if (comm.rank() == 0)
      std::printf(
          "step %5d  loss %.4f  tokens/s %8.0f  loss-scale %-7g skipped %llu  model-state/rank "
          "%.2f MiB  comm %.3f GB  grad-norm %.4g\n",
          step + 1, mean, double(window_tokens_) / dt, double(res.loss_scale),
          static_cast<unsigned long long>(skipped_), mib(engine.memory().model_states()),
          double(comm_bytes.value_or(comm.stats().total().bytes + engine_group_bytes(engine))) /
              1e9,
          res.grad_norm);
    std::fflush(stdout);
    t_log_ = now;
    window_loss_ = 0;
    window_steps_ = 0;
    window_tokens_ = 0;
  }

  // Whether step() prints a line at this step (a trainer that keeps its loss on a device reads
  // it only then, passing the window's sum of per-step losses and 0 otherwise).
  bool logs(int step) const noexcept {
    return (step + 1) % every_ == 0 || step == first_step_ || step + 1 == last_step_;
  }
  double first_loss() const noexcept { return first_loss_; }
  double last_loss() const noexcept { return last_loss_; }
  std::uint64_t skipped() const noexcept { return skipped_; }

 private:
  int every_, first_step_, last_step_;
  std::chrono::steady_clock::time_point t_log_;
  double window_loss_ = 0, first_loss_ = -1, last_loss_ = 0;
  int window_steps_ = 0;
  std::int64_t window_tokens_ = 0;
  std::uint64_t skipped_ = 0;
};

// The summary's line of where a step's time went: `sum` over `steps` steps (none: no line).
inline void print_step_times(const zp::StepTimes& sum, int steps) {
  if (steps < 1) return;
  std::printf("time per step (rank 0, mean of %d): %s; untracked %.1f%% of the step\n", steps,
              (zp::StepTimes(sum) *= 1.0 / double(steps)).describe().c_str(),
              100.0 * sum.untracked() / sum.total);
}

// The summary's memory line.
inline void print_memory(const zp::MemoryReport& m) {
  std::printf(
      "memory per rank (MiB): params %.3f  grads %.3f  fp32 master %.3f  optimizer state %.3f  "
      "= model states %.3f; buckets %.3f  gathered peak %.3f\n",
      mib(m.params), mib(m.grads), mib(m.master), mib(m.optimizer_state), mib(m.model_states()),
      mib(m.buckets), mib(m.gathered_peak));
  if (m.offloaded)
    std::printf("        of which offloaded to host memory: %.3f MiB\n", mib(m.offloaded));
  if (m.nvme)
    std::printf(
        "        of which on NVMe (ZeRO-Infinity): %.3f MiB, through %.3f MiB of host buffers\n",
        mib(m.nvme), mib(m.swap_buffers));
  if (m.secondary) std::printf("        secondary shards (hpZ): %.3f MiB\n", mib(m.secondary));
  // The process's peaks (all ranks of this process), from /proc/self/status, in MiB.
  std::ifstream status("/proc/self/status");
  double rss = 0, vm = 0;
  for (std::string line; std::getline(status, line);) {
    if (line.starts_with("VmHWM:")) rss = std::atof(line.c_str() + 6) / 1024;
    if (line.starts_with("VmPeak:")) vm = std::atof(line.c_str() + 7) / 1024;
  }
  std::printf("process peak (MiB): resident %.1f  virtual %.1f\n", rss, vm);
}

// The training text, or the exit status 1 with the error printed.
inline Corpus load_corpus_or_exit(const Program& p, const std::vector<std::string>& paths,
                                  std::size_t at_least) {
  Corpus c;
  try {
    c = load_corpus(paths);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", p.name, e.what());
    std::exit(1);
  }
  if (c.ids.size() < at_least)
    bad(p, "the training text is too short (" + std::to_string(c.ids.size()) +
               " characters, at least " + std::to_string(at_least) + " needed)");
  return c;
}

// ---- stopping on a signal ---------------------------------------------------------------------

// SIGTERM (a scheduler's notice before it ends a job, `kill`) and SIGINT (Ctrl-C) ask a trainer
// to stop after the step in flight: its ranks agree on the step (run_control.hpp: end_step), save
// it where --checkpoint-dir is given, and the process exits with 128 + the signal's number. The
// handler gives both signals back their default action, so a second one of either kind ends the
// process at once.
namespace stop_signal {
inline volatile std::sig_atomic_t received = 0;
inline std::atomic<int> stopped_for{0};  // the signal a trainer stopped for (exit_status)
inline std::atomic<int> handled{0};      // lock-free, so async-signal-safe
static_assert(std::atomic<int>::is_always_lock_free);
inline void on_signal(int sig) {
  struct sigaction dfl {};  // sigaction and raise are async-signal-safe
  dfl.sa_handler = SIG_DFL;
  // The second signal can reach another thread while the first one's handler runs: it ends the
  // process as soon as this handler returns (the signal is blocked until then).
  if (handled.exchange(sig) != 0) {
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);
    return;
  }
  received = sig;
  for (int s : {SIGTERM, SIGINT}) ::sigaction(s, &dfl, nullptr);
}
// From here on the signals stop the run (once per process; the trainers call it before their
// first step, so a signal during start-up still ends the process at once).
inline void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);  // the other one waits for the handler, then finds it fatal
    for (int s : {SIGTERM, SIGINT}) sigaddset(&sa.sa_mask, s);
    sa.sa_flags = SA_RESTART;  // no EINTR in the I/O
    for (int s : {SIGTERM, SIGINT}) ::sigaction(s, &sa, nullptr);
  });
}
inline const char* name(int sig) {
  return sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "a signal";
}
// A trainer's exit status after its ranks returned: 128 + the signal's number for a run stopped
// by one, else 0.
inline int exit_status() {
  const int sig = stopped_for;
  return sig ? 128 + sig : 0;
}
}  // namespace stop_signal

// ---- launching ------------------------------------------------------------------------------

// Under an MPI launcher the processes are the ranks: a --ranks given must be their count. False
// (said on rank 0) where it is not; every rank finds it alike, so each returns without an abort.
inline bool ranks_match_job(const char* name, const TrainFlags& t, const char* backend,
                            int processes, int rank) {
  if (!t.was_given("--ranks") || t.ranks == processes) return true;
  if (rank == 0)
    std::fprintf(stderr,
                 "%s: --ranks %d with --backend %s: the job has %d processes (mpirun -n sets "
                 "them; leave --ranks out)\n",
                 name, t.ranks, backend, processes);
  return false;
}

// Runs train(comm) on every rank: one MPI process per rank (--backend mpi, under mpirun, whose
// process count a --ranks given must equal) or --ranks threads. Returns the exit status (128 +
// the signal's number for a run stopped by one; 1 after an error); errors are printed, on MPI
// by each rank before its exception leaves the communicator (that aborts the job; where train's
// own communicators, a ProcessGrid's, go first, the abort gives the text of a zp::Error itself),
// or once where every rank of the job raised it together.
template <class Train>
int launch(const Program& p, int& argc, char**& argv, const TrainFlags& t, Train&& train) {
  try {
    if (t.backend == "mpi") {
#if ZP_DEMO_MPI
      zp::backend::MpiEnvironment env(&argc, &argv);
      zp::Collective<zp::backend::Mpi> comm(env.world());
      if (!ranks_match_job(p.name, t, "mpi", comm.size(), comm.rank())) return 2;
      try {
        train(comm);
      } catch (const std::exception& e) {
        // An error every rank raised together (a configuration the engine refused): said once,
        // and MPI ends normally. Any other: each rank says its own, and the job is aborted.
        if (zp::detail::every_rank_raises(&e)) {
          if (comm.rank() == 0) std::fprintf(stderr, "%s: %s\n", p.name, e.what());
          return 1;
        }
        std::fprintf(stderr, "%s: rank %d: %s\n", p.name, comm.rank(), e.what());
        throw;
      }
#else
      (void)argc, (void)argv;
      bad(p, std::string("this ") + p.name +
                 " was built without MPI (zp::mpi was not found at configure time)");
#endif
    } else {
      zp::backend::run_threads(t.ranks,
                               [&](zp::Collective<zp::backend::Threads>& comm) { train(comm); });
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", p.name, e.what());
    return 1;
  }
  return stop_signal::exit_status();
}

}  // namespace examples
