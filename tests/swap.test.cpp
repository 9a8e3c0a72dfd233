// zp/swap.hpp: the optimizer state on NVMe. The swap against a plain array (element ranges
// written and read at random, steps over every sub-group, each buffer count and pipeline, every
// element read back checked), a checkpoint loaded over what a step's end read ahead (against a
// fresh engine loading it), and the faults an engine meets: nvme_path missing, not a
// directory or not writable on one rank, a file system too small for the swap, a swap file
// (the optimizer state's or stage 3's parameters') truncated under a running job (an error
// naming the path on every rank, the engine unusable after a failed optimizer step or gather,
// the last checkpoint loading bitwise) or deleted under it (nothing lost), a checkpoint load
// failing halfway (the engine unusable), and the swap files of a process that died.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "temp_dir.hpp"
#include "zero_mlp.hpp"
#include "zp/backend/threads.hpp"
#include "zp/checkpoint.hpp"
#include "zp/engine.hpp"
#include "zp/swap.hpp"

namespace {

namespace fs = std::filesystem;
using zp::Collective;
using zp::EngineConfig;
using zp::NvmeOptions;
using zp::Swap;
using zp::backend::run_threads;
using zp::backend::Threads;
using zp::test::Mlp;
using zp::test::TempDir;

std::vector<std::string> swap_files(const fs::path& dir) {
  std::vector<std::string> r;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".swap") r.push_back(e.path().string());
  return r;
}

EngineConfig nvme_config(const fs::path& dir) {
  EngineConfig c;
  c.batch = {.micro_batch_per_rank = 2, .gradient_accumulation_steps = 1};
  c.bucket_bytes = 4096;
  c.first_bucket_bytes = 512;
  c.optimizer_nvme = NvmeOptions{
      .path = dir, .pipeline_read = true, .pipeline_write = true, .sub_group_size = 2048};
  return c;
}

template <class E, class T>
void train(E& e, Mlp<T>& m, std::int64_t t0, std::int64_t t1) {
  const int n = e.comm().size(), r = e.comm().rank();
  for (std::int64_t t = t0; t < t1; ++t) zp::test::micro_step(e, m, (t * n + r) * 2, 2);
}

}  // namespace

TEST_CASE("the swap holds what was written: ranges at random and steps over every sub-group") {
  TempDir dir("swap");
  const std::uint64_t seed = zp::test::fresh_seed();
  std::mt19937_64 rng(seed);
  for (int buffers : {1, 2, 3, 5})
    for (int pipe = 0; pipe < 4; ++pipe) {
      CAPTURE(buffers);
      CAPTURE(pipe);
      const int fields = 1 + int(rng() % 3);
      const std::size_t n = 3000 + rng() % 9000, sub = 1 + rng() % 3000;
      Swap<float> swap(NvmeOptions{.path = dir.path,
                                   .buffer_count = std::max(2, buffers),
                                   .pipeline_read = (pipe & 1) != 0,
                                   .pipeline_write = (pipe & 2) != 0,
                                   .sub_group_size = sub,
                                   .queue_depth = 3,
                                   .block_size = 8192},
                       n, fields, "the test");
      CHECK(swap.sub_group() % 2048 == 0);
      CHECK(swap.sub_groups() * swap.sub_group() >= n);
      std::vector<std::vector<float>> ref(std::size_t(fields), std::vector<float>(n, 0.0f));
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      auto check_all = [&] {
        for (int f = 0; f < fields; ++f) {
          std::vector<float> got(n, std::nanf(""));
          swap.read(f, 0, got);
          CHECK(std::memcmp(got.data(), ref[std::size_t(f)].data(), n * 4) == 0);
        }
      };
      check_all();  // all zero at first
      for (int round = 0; round < 3; ++round) {
        // Ranges written, some spanning sub-groups; after a step, over the sub-groups its end
        // read ahead for the next one (pipeline_read), which the writes must drop.
        for (int w = 0; w < 20; ++w) {
          const int f = int(rng() % std::uint64_t(fields));
          const std::size_t at = rng() % n, len = 1 + rng() % std::min<std::size_t>(n - at, 5000);
          std::vector<float> v(len);
          for (auto& x : v) x = u(rng);
          swap.write(f, at, v);
          std::copy(v.begin(), v.end(), ref[std::size_t(f)].begin() + std::ptrdiff_t(at));
          std::vector<float> back(len);
          const std::size_t b = rng() % (n - at);
          back.resize(std::min(len, n - at - b));
          swap.read(f, at + b, back);
          CHECK(std::equal(back.begin(), back.end(),
                           ref[std::size_t(f)].begin() + std::ptrdiff_t(at + b)));
        }
        // A step: every sub-group entered in order, each element x becomes 2x + f + 1.
        swap.begin_step();
        const std::size_t C = swap.sub_group();
        std::size_t wrong = 0;
        for (std::size_t c = 0; c < swap.sub_groups(); ++c) {
          swap.enter(c);
          for (int f = 0; f < fields; ++f) {
            float* s = swap.slot(c, f);
            for (std::size_t i = c * C; i < std::min(n, (c + 1) * C); ++i) {
              wrong += s[i - c * C] != ref[std::size_t(f)][i];
              s[i - c * C] = 2 * s[i - c * C] + float(f + 1);
              ref[std::size_t(f)][i] = 2 * ref[std::size_t(f)][i] + float(f + 1);
            }
          }
          swap.leave(c);
        }
        swap.end_step();
        CHECK(wrong == 0);  // what each step saw
        check_all();
      }
    }
  CHECK(swap_files(dir.path).empty());  // removed with the swap
}

TEST_CASE("a missing nvme_path, or one that is a file, is an error naming it on every rank") {
  TempDir dir("swap");
  const fs::path missing = dir.path / "no-such-dir", file = dir.path / "a-file";
  std::FILE* fp = std::fopen(file.c_str(), "w");
  REQUIRE(fp);
  std::fclose(fp);
  for (const fs::path& bad : {missing, file}) {
    std::vector<std::string> errors(2);
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<float> model;
      // Only rank 1's path is bad: rank 0 learns it from rank 1.
      const EngineConfig cfg = nvme_config(comm.rank() == 1 ? bad : dir.path);
      try {
        zp::Engine<Threads, float, 2> e(comm, model, cfg);
      } catch (const zp::Error& e) {
        errors[std::size_t(comm.rank())] = e.what();
      }
    });
    for (const auto& e : errors) {
      INFO(e);
      CHECK(e.find("nvme_path '" + bad.string() + "' is not an existing directory") !=
            std::string::npos);
    }
    CHECK(errors[0].find("rank 1 failed") != std::string::npos);
  }
  CHECK(swap_files(dir.path).empty());
}

// Permission bits do not stop root (CI runs tests as root), but nobody creates files in sysfs.
TEST_CASE("an nvme_path nobody can write to is an error naming it on every rank") {
  TempDir dir("swap");
  const fs::path unwritable = "/sys";
  REQUIRE(fs::is_directory(unwritable));
  std::vector<std::string> errors(2);
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    try {
      zp::Engine<Threads, float, 2> e(comm, model,
                                      nvme_config(comm.rank() == 1 ? unwritable : dir.path));
    } catch (const zp::Error& e) {
      errors[std::size_t(comm.rank())] = e.what();
    }
  });
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("nvme_path '/sys'") != std::string::npos);
    CHECK(e.find("Permission denied") != std::string::npos);
  }
  CHECK(errors[0].find("rank 1 failed") != std::string::npos);
  CHECK(swap_files(dir.path).empty());  // rank 0's swap removed with its engine
}

TEST_CASE("a file system too small for the swap is an error naming the path at construction") {
  TempDir dir("swap");
  ::signal(SIGXFSZ, SIG_IGN);  // the limit is then EFBIG, not a signal
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  rlimit small = old;
  small.rlim_cur = 16 << 10;  // smaller than each rank's swap file (~50 KiB)
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::vector<std::string> errors(2);
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    try {
      zp::Engine<Threads, float, 1> e(comm, model, nvme_config(dir.path));
    } catch (const zp::Error& e) {
      errors[std::size_t(comm.rank())] = e.what();
    }
  });
  ::setrlimit(RLIMIT_FSIZE, &old);
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e.find("nvme_path '" + dir.path.string() + "'") != std::string::npos);
    CHECK(e.find("File too large") != std::string::npos);
  }
  CHECK(swap_files(dir.path).empty());  // nothing left behind
}

// The optimizer state's swap (its step fails) and stage 3's parameter swap (a module's gather,
// read ahead or not, fails): the engine unusable after either.
TEST_CASE(
    "a swap file truncated under a running job: an error on every rank, the checkpoint loads") {
  for (const bool params : {false, true}) {
    CAPTURE(params);
    TempDir drive("swap"), ckpt("ckpt");
    EngineConfig cfg = nvme_config(drive.path);
    if (params) std::swap(cfg.param_nvme, cfg.optimizer_nvme);
    struct Snap {
      std::vector<float> params, master, m, v;
    };
    auto snap = [](auto& e) {
      return Snap{e.gather_params(), e.gather_master(), e.gather_state(0), e.gather_state(1)};
    };
    Snap saved, loaded;
    std::vector<std::string> errors(2);
    std::vector<int> unusable(2, 0);
    // A gather's failure on one rank reaches the others through the communicator: the rank
    // leaves with it (as a trainer's would), and those waiting for it learn its cause.
    const auto job = [&](auto&& rank) {
      try {
        run_threads(2, rank);
      } catch (const zp::Error&) {
        CHECK(params);
      }
    };
    job([&](Collective<Threads>& comm) {
      Mlp<float> model;
      zp::Engine<Threads, float, 3> e(comm, model, cfg);
      train(e, model, 0, 2);
      zp::save_checkpoint(e, ckpt.path, "good");
      auto s = snap(e);
      if (comm.rank() == 0) saved = std::move(s);
      comm.barrier();
      // (The optimizer state's swap has 3 sub-groups a rank: the last step's end read the
      // first 2 ahead, the third's read fails.)
      if (comm.rank() == 1) fs::resize_file(swap_files(drive.path).at(0), 4096);
      comm.barrier();
      try {
        train(e, model, 2, 3);
      } catch (const zp::Error& x) {
        errors[std::size_t(comm.rank())] = x.what();
      }
      try {  // a failed step, or a module's failed gathers: the engine says why it is unusable
        train(e, model, 3, 4);
      } catch (const zp::Error& x) {
        unusable[std::size_t(comm.rank())] =
            std::string(x.what()).find(
                params ? "unusable since the gathers of forward() for module"
                       : "unusable since the optimizer step on NVMe failed") != std::string::npos;
        if (params) throw;
      }
    });
    for (std::size_t r = 0; r < 2; ++r) {
      INFO(errors[r]);
      CHECK(errors[r].find(".swap'") != std::string::npos);  // the file, as the reader saw it
      CHECK(errors[r].find(drive.path.string()) != std::string::npos);
      CHECK(unusable[r]);
    }
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<float> model;
      zp::Engine<Threads, float, 3> e(comm, model, cfg);
      zp::load_checkpoint(e, ckpt.path);
      auto s = snap(e);
      if (comm.rank() == 0) loaded = std::move(s);
    });
    CHECK(loaded.params == saved.params);
    CHECK(loaded.master == saved.master);
    CHECK(loaded.m == saved.m);
    CHECK(loaded.v == saved.v);
    CHECK(swap_files(drive.path).empty());
  }
}

// A step's end reads the next step's first sub-groups ahead (pipeline_read); a checkpoint loaded
// before that step changes them in the file, and the step must see the loaded state.
TEST_CASE("a checkpoint loaded into a running job replaces what the last step read ahead") {
  TempDir drive("swap"), ckpt("ckpt");
  for (const bool params : {false, true}) {
    CAPTURE(params);
    EngineConfig cfg = nvme_config(drive.path);
    if (params) cfg.param_nvme = cfg.optimizer_nvme;
    const std::string tag = params ? "with-params" : "state";
    std::vector<float> resumed, fresh;
    for (const bool running : {true, false})
      run_threads(2, [&](Collective<Threads>& comm) {
        Mlp<float> model;
        zp::Engine<Threads, float, 3> e(comm, model, cfg);
        // A writing step (the initial values, a load) ends with its writes on the drive: their
        // errors are its own, agreed on.
        const auto written = [&] {
          CHECK(!e.partition().swap()->dirty());
          if (params) CHECK(!e.partition().param_swap()->dirty());
        };
        written();
        if (running) {
          train(e, model, 0, 1);
          zp::save_checkpoint(e, ckpt.path, tag);
          train(e, model, 1, 3);  // state in the swap and read ahead: that of step 3
        }
        zp::load_checkpoint(e, ckpt.path, tag);
        written();
        train(e, model, 1, 3);
        auto m = e.gather_master(), v = e.gather_state(1), p = e.gather_params();
        m.insert(m.end(), v.begin(), v.end());
        m.insert(m.end(), p.begin(), p.end());
        if (comm.rank() == 0) (running ? resumed : fresh) = std::move(m);
      });
    CHECK(!fresh.empty());
    CHECK(resumed == fresh);
  }
  CHECK(swap_files(drive.path).empty());
}

// A load writes the swapped state through the swap, which reads a sub-group's record before it
// writes part of it: with the swap files truncated, the load fails after it began to write, and
// the half-loaded engine refuses to go on (on every rank); a new engine loads the checkpoint.
TEST_CASE("a checkpoint load that fails halfway leaves the engine unusable on every rank") {
  TempDir drive("swap"), ckpt("ckpt");
  std::vector<std::string> failed(2), after(2);
  std::vector<float> saved, loaded;
  run_threads(2, [&](Collective<Threads>& comm) {
    const std::size_t r = std::size_t(comm.rank());
    Mlp<float> model;
    zp::Engine<Threads, float, 2> e(comm, model, nvme_config(drive.path));
    train(e, model, 0, 2);
    zp::save_checkpoint(e, ckpt.path, "good");
    auto m = e.gather_master();
    if (r == 0) saved = std::move(m);
    comm.barrier();
    if (r == 0)
      for (const auto& f : swap_files(drive.path)) fs::resize_file(f, 4096);
    comm.barrier();
    try {
      zp::load_checkpoint(e, ckpt.path);
    } catch (const zp::Error& x) {
      failed[r] = x.what();
    }
    try {
      train(e, model, 2, 3);
    } catch (const zp::Error& x) {
      after[r] = x.what();
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    INFO(failed[r]);
    INFO(after[r]);
    CHECK(failed[r].find(".swap'") != std::string::npos);
    CHECK(after[r].find("unusable since load_checkpoint() of " + (ckpt.path / "good").string() +
                        " failed after it began to write the state") != std::string::npos);
  }
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    zp::Engine<Threads, float, 2> e(comm, model, nvme_config(drive.path));
    zp::load_checkpoint(e, ckpt.path);
    auto m = e.gather_master();
    if (comm.rank() == 0) loaded = std::move(m);
  });
  CHECK(!saved.empty());
  CHECK(loaded == saved);
}

// A whole-model gather reads each rank's piece from its swap: where one rank's read fails, that
// rank still joins every gather, and every rank gets its error naming the file, even where the
// caller catches it and goes on (before, the others waited in the gather it never joined). The
// ranks' swaps are on two drives, and rank 1's files are truncated.
TEST_CASE("a swap read failing on one rank in a whole-model gather is an error on every rank") {
  TempDir drive0("swap0"), drive1("swap1"), out("export");
  std::vector<std::string> gathered(2), exported(2), split(2);
  run_threads(2, [&](Collective<Threads>& comm) {
    const std::size_t r = std::size_t(comm.rank());
    Mlp<float> model;
    zp::Engine<Threads, float, 2> e(comm, model, nvme_config(r ? drive1.path : drive0.path));
    train(e, model, 0, 2);
    comm.barrier();
    if (r == 1)
      for (const auto& f : swap_files(drive1.path)) fs::resize_file(f, 4096);
    comm.barrier();
    try {
      (void)e.gather_master();
    } catch (const zp::Error& x) {
      gathered[r] = x.what();
    }
    try {
      zp::export_safetensors(e, out.path, {.master = true});
    } catch (const zp::Error& x) {
      exported[r] = x.what();
    }
    try {  // split into files of one tensor each: none is published either
      zp::export_safetensors(e, out.path, {.master = true, .max_file_bytes = 1});
    } catch (const zp::Error& x) {
      split[r] = x.what();
    }
    comm.barrier();  // both came back: neither waits in a gather
  });
  for (std::size_t r = 0; r < 2; ++r)
    for (const std::string& what : {gathered[r], exported[r], split[r]}) {
      INFO(what);
      CHECK(what.find(".swap'") != std::string::npos);
      CHECK((r == 1 || what.find("rank 1 failed: ") != std::string::npos));
    }
  CHECK(fs::is_empty(out.path));  // nothing published
}

// Unlinked, a file lives on while it is open: the job keeps its state and trains on unchanged.
TEST_CASE("a swap file deleted under a running job loses nothing") {
  TempDir drive("swap");
  std::vector<float> straight, deleted;
  for (bool remove : {false, true})
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<float> model;
      zp::Engine<Threads, float, 2> e(comm, model, nvme_config(drive.path));
      train(e, model, 0, 2);
      comm.barrier();
      if (remove && comm.rank() == 0)
        for (const auto& f : swap_files(drive.path)) fs::remove(f);
      comm.barrier();
      train(e, model, 2, 4);
      auto m = e.gather_master(), v = e.gather_state(1);
      m.insert(m.end(), v.begin(), v.end());
      if (comm.rank() == 0) (remove ? deleted : straight) = std::move(m);
    });
  CHECK(!straight.empty());
  CHECK(deleted == straight);
}

TEST_CASE("swap files of a process that died are removed; those in use are not") {
  TempDir dir("swap");
  // `starting`: another live process's (pid 1's) file, created and not yet locked.
  const fs::path dead = dir.path / "zp-swap-999999-0.swap",
                 alive = dir.path / "zp-swap-999998-0.swap", other = dir.path / "notes.swap",
                 starting = dir.path / "zp-swap-1-0.swap";
  REQUIRE(::kill(999999, 0) != 0);
  for (const auto& p : {dead, alive, other, starting}) {
    std::FILE* f = std::fopen(p.c_str(), "w");
    REQUIRE(f);
    std::fputs("x", f);
    std::fclose(f);
  }
  const int held = ::open(alive.c_str(), O_RDWR | O_CLOEXEC);  // as its live owner would
  REQUIRE(held >= 0);
  REQUIRE(::flock(held, LOCK_EX | LOCK_NB) == 0);
  {
    Swap<float> swap(NvmeOptions{.path = dir.path}, 100, 2, "the test");
    CHECK_FALSE(fs::exists(dead));
    CHECK(fs::exists(alive));
    CHECK(fs::exists(other));
    CHECK(fs::exists(starting));
    CHECK(fs::exists(swap.path()));
  }
  ::close(held);
  CHECK(fs::exists(alive));
  CHECK(swap_files(dir.path).size() == 3);  // alive, other and starting
}
