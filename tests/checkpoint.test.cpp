#include "zp/checkpoint.hpp"

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "zp/backend/threads.hpp"
#include "expect_error.hpp"
#include "temp_dir.hpp"
#include "zero_mlp.hpp"

using zp::Collective;
using zp::EngineConfig;
using zp::backend::run_threads;
using zp::backend::Threads;
using zp::test::Mlp;
using zp::test::TempDir;
namespace fs = std::filesystem;

namespace {

EngineConfig config(int gas, zp::LossScaler scaler = zp::LossScaler::none()) {
  EngineConfig c;
  c.batch = {.micro_batch_per_rank = 2, .gradient_accumulation_steps = gas};
  c.bucket_bytes = 4096;  // several buckets per module, pieces that split parameters
  c.first_bucket_bytes = 512;
  c.align = 4;
  c.loss_scaler = scaler;
  return c;
}

// Trains optimizer steps [t0, t1) of one global data order (independent of the rank count:
// step t, micro-step i, data-parallel rank r of n reads samples from ((t * gas + i) * n + r) * 2).
template <class E, class T>
void train(E& e, Mlp<T>& m, std::int64_t t0, std::int64_t t1) {
  const auto gas = e.batch().gradient_accumulation_steps;
  const int n = e.data_parallel().size(), r = e.data_parallel().rank();
  for (std::int64_t t = t0; t < t1; ++t)
    for (std::int64_t i = 0; i < gas; ++i)
      zp::test::micro_step(e, m, ((t * gas + i) * n + r) * 2, 2);
}

// Everything an engine's training state holds, gathered (rank 0 keeps it).
template <class T>
struct Snapshot {
  std::vector<T> params;
  std::vector<float> master, s0, s1;
  zp::LossScaler::State scaler;
  std::int64_t steps = 0;
};
template <class E>
Snapshot<typename E::value_type> snapshot(E& e) {
  Snapshot<typename E::value_type> s{e.gather_params(), e.gather_master(),       e.gather_state(0),
                                     e.gather_state(1), e.loss_scaler().state(), e.steps()};
  return s;
}
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}
template <class T>
void check_same(const Snapshot<T>& a, const Snapshot<T>& b) {
  CHECK(same_bits(a.params, b.params));
  CHECK(same_bits(a.master, b.master));
  CHECK(same_bits(a.s0, b.s0));
  CHECK(same_bits(a.s1, b.s1));
  CHECK(a.scaler == b.scaler);
  CHECK(a.steps == b.steps);
}

// Calls f(std::integral_constant<int, s>) for a stage known at run time.
template <class F>
void with_stage(int s, F&& f) {
  switch (s) {
    case 0: f(std::integral_constant<int, 0>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 3>{}); break;
  }
}

std::vector<std::byte> bytes_of(std::int64_t x) {
  std::vector<std::byte> b(sizeof x);
  std::memcpy(b.data(), &x, sizeof x);
  return b;
}
std::int64_t int_of(const std::vector<std::byte>& b) {
  std::int64_t x = -1;
  REQUIRE(b.size() == sizeof x);
  std::memcpy(&x, b.data(), sizeof x);
  return x;
}

// Weight decay on every parameter but two, one of which starts a module and one ends one: the
// checkpoint keeps which (and the load checks it).
bool decays_most(std::string_view name) { return name != "layer0.bias" && name != "layer1.weight"; }

// nvme: the optimizer state in swap files there (sub-groups of 2048 elements, pipelined), and at
// stage 3 the parameter shard too.
template <class T, int Stage>
void check_resume(zp::LossScaler scaler, const fs::path* nvme = nullptr) {
  constexpr int ranks = 2, gas = 2, k = 3;
  using E = zp::Engine<Threads, T, Stage>;
  EngineConfig cfg = config(gas, scaler);
  cfg.weight_decay_filter = decays_most;
  if (nvme) {
    cfg.optimizer_nvme = zp::NvmeOptions{
        .path = *nvme, .pipeline_read = true, .pipeline_write = true, .sub_group_size = 1024};
    if (Stage == 3) cfg.param_nvme = zp::NvmeOptions{.path = *nvme};
  }
  TempDir dir("resume");
  Snapshot<T> straight, resumed;
  run_threads(ranks, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, cfg, zp::optim::AdamW{.lr = 1e-2f});
    train(e, model, 0, 2 * k);
    auto s = snapshot(e);
    if (comm.rank() == 0) straight = std::move(s);
  });
  run_threads(ranks, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, cfg, zp::optim::AdamW{.lr = 1e-2f});
    train(e, model, 0, k);
    zp::save_checkpoint(e, dir.path, "half", bytes_of(k));
  });
  run_threads(ranks, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, cfg, zp::optim::AdamW{.lr = 5.0f});  // the checkpoint's hyper-parameters win
    const std::int64_t t = int_of(zp::load_checkpoint(e, dir.path));
    CHECK(t == k);
    CHECK(e.optimizer().lr == 1e-2f);
    train(e, model, t, 2 * k);
    auto s = snapshot(e);
    if (comm.rank() == 0) resumed = std::move(s);
  });
  check_same(straight, resumed);
}

template <class T>
void check_resume_all_stages(zp::LossScaler scaler, const fs::path* nvme = nullptr) {
  check_resume<T, 0>(scaler, nvme);
  check_resume<T, 1>(scaler, nvme);
  check_resume<T, 2>(scaler, nvme);
  check_resume<T, 3>(scaler, nvme);
}

}  // namespace

TEST_CASE("resume is exact: 2k steps equal k steps, save, a fresh engine, load and k more") {
  SUBCASE("fp32") { check_resume_all_stages<float>(zp::LossScaler::none()); }
  SUBCASE("bf16") { check_resume_all_stages<zp::bf16>(zp::LossScaler::none()); }
  // A scale so high that the first steps overflow and are skipped: the scaler's state (scale,
  // hysteresis, skipped count) must survive the checkpoint for the runs to agree.
  SUBCASE("fp16 with a dynamic loss scale") {
    check_resume_all_stages<zp::fp16>(
        zp::LossScaler::dynamic({.initial_scale = 0x1p24f, .window = 2, .hysteresis = 2}));
  }
}

#if defined(ZP_WITH_AIO)
// Checkpoints read and write the state where it is, a segment piece at a time; the swap files
// are scratch, never part of the checkpoint.
TEST_CASE(
    "with the optimizer state on NVMe, resume is exact and checkpoints move to and from memory") {
  TempDir drive("nvme");
  SUBCASE("fp32") { check_resume_all_stages<float>(zp::LossScaler::none(), &drive.path); }
  SUBCASE("bf16") { check_resume_all_stages<zp::bf16>(zp::LossScaler::none(), &drive.path); }
  SUBCASE("saved on NVMe at stage 2, loaded in memory at stage 3 and back on NVMe at stage 1") {
    TempDir dir("ckpt");
    EngineConfig on_nvme = config(1);
    on_nvme.optimizer_nvme = zp::NvmeOptions{.path = drive.path, .sub_group_size = 3000};
    Snapshot<zp::bf16> saved, in_memory, back;
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      zp::Engine<Threads, zp::bf16, 2> e(comm, model, on_nvme);
      train(e, model, 0, 3);
      zp::save_checkpoint(e, dir.path, "a");
      auto s = snapshot(e);
      if (comm.rank() == 0) saved = std::move(s);
    });
    for (const auto& f : fs::recursive_directory_iterator(dir.path))  // no swap file in it
      CHECK(f.path().extension() != ".swap");
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      zp::Engine<Threads, zp::bf16, 3> e(comm, model, config(1));
      zp::load_checkpoint(e, dir.path, "a");
      auto s = snapshot(e);
      if (comm.rank() == 0) in_memory = std::move(s);
      zp::save_checkpoint(e, dir.path, "b");
    });
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      zp::Engine<Threads, zp::bf16, 1> e(comm, model, on_nvme);
      zp::load_checkpoint(e, dir.path, "b");
      auto s = snapshot(e);
      if (comm.rank() == 0) back = std::move(s);
    });
    check_same(saved, in_memory);
    check_same(saved, back);
  }
  CHECK(drive.entries().empty());
}
#endif

// Every save (N, S) loads at every M; S' = (S + M) mod 4, so that over the saves of one N every
// (S, S') and every (M, S') pair occurs too (the format is the same for every stage: which stage
// saved does not change what a load at M ranks reads). 64 loads instead of all 256.
TEST_CASE(
    "a checkpoint saved at N ranks and stage S loads at M ranks and stage S', bitwise, and "
    "training goes on") {
  using T = zp::bf16;
  for (int n = 1; n <= 4; ++n)
    for (int s = 0; s <= 3; ++s) {
      TempDir dir("reshard");
      Snapshot<T> saved;
      with_stage(s, [&]<int S>(std::integral_constant<int, S>) {
        run_threads(n, [&](Collective<Threads>& comm) {
          Mlp<T> model;
          zp::Engine<Threads, T, S> e(comm, model, config(1), zp::optim::AdamW{.lr = 1e-2f});
          train(e, model, 0, 2);
          zp::save_checkpoint(e, dir.path, "t2");
          auto snap = snapshot(e);
          if (comm.rank() == 0) saved = std::move(snap);
        });
      });
      for (int m = 1; m <= 4; ++m) {
        const int s2 = (s + m) % 4;
        CAPTURE(n);
        CAPTURE(s);
        CAPTURE(m);
        CAPTURE(s2);
        Snapshot<T> loaded;
        std::atomic<int> applied{0};
        with_stage(s2, [&]<int S>(std::integral_constant<int, S>) {
          run_threads(m, [&](Collective<Threads>& comm) {
            Mlp<T> model;
            zp::Engine<Threads, T, S> e(comm, model, config(1), zp::optim::AdamW{});
            zp::load_checkpoint(e, dir.path, "t2");
            auto snap = snapshot(e);
            if (comm.rank() == 0) loaded = std::move(snap);
            const auto r = zp::test::micro_step(e, model, 4 * 64 + comm.rank() * 2, 2);
            applied += r.applied && e.steps() == 3;
          });
        });
        check_same(saved, loaded);
        CHECK(applied == m);
      }
    }
}

// Hybrid sharding (4 ranks, shard groups of 2): the first shard group writes the checkpoint, one
// replica's grid of 2 files, and the model's export; every replica loads it. Resume is exact
// there, and the checkpoint loads bitwise at a plain single rank and back; a failed write is an
// error on every rank.
TEST_CASE("hybrid sharding: one shard group saves, every replica loads, and resume is exact") {
  using T = zp::bf16;
  using E = zp::Engine<Threads, T, 3>;
  constexpr int k = 2;
  EngineConfig hybrid = config(2);
  hybrid.shard_group_size = 2;
  hybrid.weight_decay_filter = decays_most;
  TempDir dir("hybrid");
  const auto adamw = zp::optim::AdamW{.lr = 1e-2f};
  std::vector<Snapshot<T>> straight(4), saved(4), resumed(4);
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, hybrid, adamw);
    train(e, model, 0, 2 * k);
    straight[std::size_t(comm.rank())] = snapshot(e);
  });
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, hybrid, adamw);
    train(e, model, 0, k);
    zp::save_checkpoint(e, dir.path, "half", bytes_of(k));
    zp::export_safetensors(e, dir.path / "export");
    saved[std::size_t(comm.rank())] = snapshot(e);
  });
  const auto m = zp::ckpt::Reader(dir.path, "half").manifest();
  CHECK(m.world_size == 2);
  CHECK(m.grid.dp == 2);
  CHECK(m.files.size() == 2);
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, hybrid, zp::optim::AdamW{.lr = 5.0f});
    CHECK(int_of(zp::load_checkpoint(e, dir.path)) == k);
    train(e, model, k, 2 * k);
    resumed[std::size_t(comm.rank())] = snapshot(e);
  });
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    check_same(straight[0], straight[std::size_t(r)]);
    check_same(saved[0], saved[std::size_t(r)]);
    check_same(straight[0], resumed[std::size_t(r)]);
  }
  Snapshot<T> one;
  std::vector<T> exported;
  run_threads(1, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    auto c = config(2);
    c.weight_decay_filter = decays_most;
    zp::Engine<Threads, T, 1> e(comm, model, c, adamw);
    zp::load_checkpoint(e, dir.path, "half");
    one = snapshot(e);
    zp::save_checkpoint(e, dir.path, "one");
    zp::load_safetensors(e, dir.path / "export");
    exported = e.gather_params();
  });
  check_same(saved[0], one);
  CHECK(same_bits(exported, saved[0].params));
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, hybrid, adamw);
    zp::load_checkpoint(e, dir.path, "one");
    check_same(saved[0], snapshot(e));
  });
  // A write failing on a rank of the first group is an error on every rank, the other group's
  // too, and publishes nothing.
  std::atomic<int> failed{0};
  run_threads(4, [&](Collective<Threads>& comm) {
    Mlp<T> model;
    E e(comm, model, hybrid, adamw);
    comm.barrier();
    if (comm.rank() == 0) zp::detail::io_fault_countdown() = 1;
    comm.barrier();
    try {
      zp::save_checkpoint(e, dir.path, "faulty");
    } catch (const zp::Error& err) {
      CHECK(err.category() == zp::Errc::io);
      ++failed;
    }
  });
  zp::detail::io_fault_countdown() = -1;
  CHECK(failed == 4);
  CHECK(!fs::exists(dir.path / "faulty"));
  CHECK(zp::ckpt::Reader::read_latest(dir.path) == "one");
}

namespace {

using E2 = zp::Engine<Threads, float, 2>;

// Runs f(engine, model) on 2 thread ranks with a freshly built stage 2 fp32 engine.
template <class F>
void on_two_ranks(F&& f, EngineConfig cfg = config(1)) {
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    E2 e(comm, model, cfg, zp::optim::AdamW{.lr = 1e-2f});
    f(e, model);
  });
}

// save_checkpoint with the k-th durable file step from here failing (k > 0; every rank calls
// it): the error's message on this rank, "" if the save succeeded. The caller resets the
// countdown once every rank is done.
std::string save_with_fault(E2& e, const fs::path& dir, const std::string& tag, std::int64_t k,
                            const zp::SaveOptions& options = {}) {
  e.comm().barrier();
  if (e.comm().rank() == 0) zp::detail::io_fault_countdown() = k;
  e.comm().barrier();
  try {
    zp::save_checkpoint(e, dir, tag, {}, options);
  } catch (const zp::Error& err) {
    CHECK(err.category() == zp::Errc::io);
    return err.what();
  }
  return {};
}

void flip_byte(const fs::path& p, std::uintmax_t at) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(at));
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x10);
  f.seekp(std::streamoff(at));
  f.write(&c, 1);
}

}  // namespace

// The count of overflowing steps in a row is training state: a run that saves in the middle of a
// run of overflows stops where the uninterrupted run would.
TEST_CASE("overflows in a row before a save count on after the load") {
  TempDir dir("in-row");
  const EngineConfig cfg = config(1, zp::LossScaler::none(4));
  auto overflowing_step = [](E2& e, Mlp<float>& m, std::int64_t t) {
    m.poison = e.comm().rank() == 1;
    zp::test::micro_step(e, m, (t * 2 + e.comm().rank()) * 2, 2);
    m.poison = false;
  };
  on_two_ranks(
      [&](E2& e, Mlp<float>& m) {
        train(e, m, 0, 1);
        overflowing_step(e, m, 1);
        overflowing_step(e, m, 2);
        zp::save_checkpoint(e, dir.path, "two-skipped");
      },
      cfg);
  CHECK(zp::ckpt::Reader(dir.path).manifest().scaler.skipped_in_row == 2);
  on_two_ranks(
      [&](E2& e, Mlp<float>& m) {
        zp::load_checkpoint(e, dir.path);
        CHECK(e.loss_scaler().state().skipped_in_row == 2);
        overflowing_step(e, m, 3);
        zp::test::expect_invalid([&] { overflowing_step(e, m, 4); },
                                 {"loss scaler: 4 steps in a row had inf/nan gradients"});
      },
      cfg);
}

TEST_CASE(
    "a save that fails after any file operation leaves a directory the same command line resumes "
    "from") {
  TempDir base("crash");
  Snapshot<float> first;
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 2);
    zp::save_checkpoint(e, base.path, "a");
    auto s = snapshot(e);
    if (e.comm().rank() == 0) first = std::move(s);
  });
  Snapshot<float> second;  // what each attempted save holds
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 3);
    auto s = snapshot(e);
    if (e.comm().rank() == 0) second = std::move(s);
  });
  // The training program: resume from `latest` (step 2 or 3), train to step 3, save "b" (with
  // the k-th durable file step failing when k > 0). Returns how many ranks failed; `place` gets
  // where the fault hit ("write of <dir>/.b.partial/rank-00001-of-00002.safetensors").
  std::string place;
  auto run = [&](const fs::path& dir, std::int64_t k) {
    std::atomic<int> failed{0};
    std::string errors[2];
    place.clear();
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      zp::load_checkpoint(e, dir);
      auto s = snapshot(e);
      if (e.comm().rank() == 0) check_same(e.steps() == 2 ? first : second, s);
      train(e, m, e.steps(), 3);
      if (e.steps() == 3 && zp::ckpt::Reader::read_latest(dir) == "b") return;  // already saved
      errors[e.comm().rank()] = save_with_fault(e, dir, "b", k);
      if (!errors[e.comm().rank()].empty()) ++failed;
    });
    zp::detail::io_fault_countdown() = -1;
    const std::string at = "injected fault before ";
    for (const std::string& e : errors)
      if (const auto i = e.find(at); i != std::string::npos) {
        place = e.substr(i + at.size());
        place = place.substr(0, place.find(' ', place.find(" of ") + 4));
      }
    return failed.load();
  };
  int faults = 0;
  std::set<std::string> places;  // with the directory's name left out
  for (std::int64_t k = 1;; ++k) {
    CAPTURE(k);
    TempDir dir("crash-k");
    fs::copy(base.path, dir.path, fs::copy_options::recursive);
    const int failed = run(dir.path, k);
    CHECK((failed == 0 || failed == 2));  // a fault on one rank is an error on every rank
    if (failed == 0) break;
    ++faults;
    // The previous checkpoint, or (a fault after `latest` was renamed) the complete new one.
    const std::string latest = zp::ckpt::Reader::read_latest(dir.path);
    CHECK((latest == "a" || latest == "b"));
    // A step of an operation an earlier k faulted already (the 7th write of a rank file after its
    // 6th) leaves what that one left, and that one was resumed from below.
    const auto name_at = place.find(dir.path.string());
    REQUIRE_MESSAGE(name_at != std::string::npos, "the fault hit: ", place);
    if (!places.insert(place.replace(name_at, dir.path.string().size(), "DIR")).second) continue;
    // The same program again, with no fault: it resumes, and its save of "b" succeeds (removing
    // a "b" that the crash published but never named in `latest`).
    CHECK(run(dir.path, 0) == 0);
    CHECK(zp::ckpt::Reader::read_latest(dir.path) == "b");
    on_two_ranks([&](E2& e, Mlp<float>&) {
      zp::load_checkpoint(e, dir.path);
      auto s = snapshot(e);
      if (e.comm().rank() == 0) check_same(second, s);
    });
    // Nothing is left behind but the two checkpoints, `latest` and the lock file (and, after a
    // fault in its very last step, the note of a publish that `latest` shows complete).
    auto names = dir.entries();
    std::erase_if(names, [&](const std::string& n) {
      return n == ".zp-publishing" && zp::detail::read_whole_file(dir.path / n, 256) == "b";
    });
    std::sort(names.begin(), names.end());
    CHECK(names == std::vector<std::string>{".zp-save.lock", "a", "b", "latest"});
    REQUIRE(k < 1000);
  }
  // At least: the staging directory, two rank files' steps, the manifest, the intent, the
  // rename, `latest` and the intent's removal.
  CHECK(faults >= 8);
  CHECK(places.size() >= 8);
}

TEST_CASE(
    "what a killed save left (temporaries named for this pid, a staging directory, a note) "
    "blocks no later save, which removes it") {
  TempDir dir("leftovers");
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 1);
    zp::save_checkpoint(e, dir.path, "a");
  });
  // Saves killed by SIGKILL in a process with this pid (a container's pid 1 restarted): the
  // temporaries of `latest` and of the publish note under the names the next save takes, and
  // another tag's staging directory.
  const std::string pid = std::to_string(::getpid());
  const std::uint64_t next = zp::detail::AtomicFile::serial().load();
  for (std::uint64_t k = next; k < next + 64; ++k)
    for (const char* f : {"latest", ".zp-publishing"})
      std::ofstream(dir.path / (std::string(f) + ".tmp." + pid + "." + std::to_string(k)));
  fs::create_directory(dir.path / ".c.partial");
  std::ofstream(dir.path / ".c.partial" / "rank-00000-of-00002.safetensors") << "half";
  // A publish note that names no tag (empty; zp writes it atomically) rolls nothing back.
  std::ofstream(dir.path / ".zp-publishing").flush();
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    zp::load_checkpoint(e, dir.path);
    train(e, m, e.steps(), 2);
    zp::save_checkpoint(e, dir.path, "b");
  });
  CHECK(zp::ckpt::Reader::read_latest(dir.path) == "b");
  auto names = dir.entries();
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{".zp-save.lock", "a", "b", "latest"});
}

namespace {

// The checkpoints of `dir`, sorted: every entry but the lock and `latest`.
std::vector<std::string> tags_in(const TempDir& dir) {
  auto names = dir.entries();
  std::erase_if(names, [](const std::string& n) { return n == ".zp-save.lock" || n == "latest"; });
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("keep_last keeps the newest checkpoints before the new one and removes the older") {
  TempDir dir("keep");
  using Tags = std::vector<std::string>;
  const zp::SaveOptions keep2{.keep_last = 2};
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    for (int t = 1; t <= 4; ++t) {
      train(e, m, t - 1, t);
      zp::save_checkpoint(e, dir.path, "s" + std::to_string(t), {}, keep2);
    }
  });
  CHECK(tags_in(dir) == Tags{"s3", "s4"});
  // A save at an earlier step (a run resumed from s3) keeps s4, which is past it, and does not
  // count it; a directory whose manifest does not read is never removed.
  fs::create_directory(dir.path / "junk");
  std::ofstream(dir.path / "junk" / "manifest.json") << "{";
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::load_checkpoint(e, dir.path, "s3");
    zp::save_checkpoint(e, dir.path, "r3", {}, {.keep_last = 1});  // s3: the same step, kept
  });
  CHECK(tags_in(dir) == Tags{"junk", "r3", "s3", "s4"});
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    zp::load_checkpoint(e, dir.path);  // r3
    train(e, m, 3, 4);
    zp::save_checkpoint(e, dir.path, "r4", {}, keep2);  // r3 the newer of r3 and s3 (equal steps)
  });
  CHECK(tags_in(dir) == Tags{"junk", "r3", "r4", "s4"});
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    zp::load_checkpoint(e, dir.path);
    train(e, m, 4, 5);
    zp::save_checkpoint(e, dir.path, "r5", {}, keep2);
  });
  CHECK(tags_in(dir) == Tags{"junk", "r4", "r5"});
  // keep_last 0 (the default) keeps everything.
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    zp::load_checkpoint(e, dir.path);
    train(e, m, 5, 6);
    zp::save_checkpoint(e, dir.path, "r6");
  });
  CHECK(tags_in(dir) == Tags{"junk", "r4", "r5", "r6"});
}

// A fault at the last steps of a save that prunes, and at each step of the pruning (a crash
// there): the save fails on every rank or is complete, no tag is ever half removed, and the next
// save leaves exactly the checkpoints it keeps.
TEST_CASE("a save with keep_last that fails while it prunes leaves a loadable directory") {
  TempDir base("keep-crash");
  const zp::SaveOptions keep2{.keep_last = 2};
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    for (int t = 1; t <= 2; ++t) {
      train(e, m, t - 1, t);
      zp::save_checkpoint(e, base.path, "s" + std::to_string(t), {}, keep2);
    }
  });
  // The save's own steps are faulted one by one in the test above: count them (a save that keeps
  // everything), then fault the last two and every step of the pruning after them.
  std::int64_t save_steps = 0;
  {
    TempDir dir("keep-count");
    fs::copy(base.path, dir.path, fs::copy_options::recursive);
    constexpr std::int64_t many = 1'000'000;
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      zp::load_checkpoint(e, dir.path);
      train(e, m, 2, 3);
      CHECK(save_with_fault(e, dir.path, "s3", many).empty());
    });
    save_steps = many - zp::detail::io_fault_countdown();
    zp::detail::io_fault_countdown() = -1;
    REQUIRE(save_steps > 8);
  }
  int in_prune = 0;
  for (std::int64_t k = save_steps - 1;; ++k) {
    CAPTURE(k);
    TempDir dir("keep-crash-k");
    fs::copy(base.path, dir.path, fs::copy_options::recursive);
    std::atomic<int> failed{0};
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      zp::load_checkpoint(e, dir.path);
      train(e, m, 2, 3);
      if (!save_with_fault(e, dir.path, "s3", k, keep2).empty()) ++failed;
    });
    const bool fired = zp::detail::io_fault_countdown() == 0;
    zp::detail::io_fault_countdown() = -1;
    CHECK((failed == 0 || failed == 2));
    if (!fired) break;
    // Every tag left reads, and `latest` names one.
    for (const auto& t : tags_in(dir))
      if (!t.starts_with(".")) CHECK_NOTHROW(zp::ckpt::Reader(dir.path, t).verify());
    const std::string latest = zp::ckpt::Reader::read_latest(dir.path);
    if (failed == 0) {  // the fault hit the removal of s1: s1 whole or aside, the save complete
      CHECK(latest == "s3");
      ++in_prune;
    }
    // The same program again, then one more step: what is left is exactly s3 and s4.
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      zp::load_checkpoint(e, dir.path);
      if (e.steps() == 2) {
        train(e, m, 2, 3);
        zp::save_checkpoint(e, dir.path, "s3", {}, keep2);
      }
      train(e, m, 3, 4);
      zp::save_checkpoint(e, dir.path, "s4", {}, keep2);
    });
    CHECK(tags_in(dir) == std::vector<std::string>{"s3", "s4"});
    REQUIRE(k < 1000);
  }
  CHECK(in_prune == 3);  // before the rename of s1, the directory's fsync, the removal
}

TEST_CASE("a save makes the directories it needs durable: each new one synced into its parent") {
  TempDir base("made");
  const fs::path dir = base.path / "new" / "deeper";
  // The first durable steps of a save into missing directories, deepest first: "deeper" synced
  // into "new", then "new" into base. A fault at either is an error on every rank.
  for (std::int64_t k : {1, 2}) {
    CAPTURE(k);
    std::string errors[2];
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      train(e, m, 0, 1);
      errors[e.comm().rank()] = save_with_fault(e, dir, "a", k);
    });
    zp::detail::io_fault_countdown() = -1;
    const fs::path synced = k == 1 ? base.path / "new" : base.path;
    CHECK_MESSAGE(errors[0].find("injected fault before directory fsync of " + synced.string()) !=
                      std::string::npos,
                  errors[0]);
    CHECK(!errors[1].empty());
    fs::remove_all(base.path / "new");
  }
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 1);
    zp::save_checkpoint(e, dir, "a");
  });
  CHECK(zp::ckpt::Reader::read_latest(dir) == "a");
}

TEST_CASE(
    "a corrupt, truncated, missing or foreign checkpoint is an error naming the file or "
    "parameter") {
  TempDir dir("corrupt");
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 1);
    zp::save_checkpoint(e, dir.path, "good");
  });
  const fs::path good = dir.path / "good";
  auto copy_to = [&](const std::string& tag) {
    fs::copy(good, dir.path / tag, fs::copy_options::recursive);
    return dir.path / tag;
  };
  auto expect_load_error = [&](const std::string& tag, std::initializer_list<std::string> needles,
                               zp::Errc c = zp::Errc::io) {
    on_two_ranks([&](E2& e, Mlp<float>&) {
      zp::test::expect_error(
          c, [&] { zp::load_checkpoint(e, dir.path, tag); }, needles);
    });
  };
  const std::string file1 = "rank-00001-of-00002.safetensors";

  flip_byte(copy_to("flipped") / file1, fs::file_size(good / file1) - 3);
  expect_load_error("flipped", {file1, "CRC-32C", "corrupt"});

  fs::resize_file(copy_to("truncated") / file1, fs::file_size(good / file1) - 100);
  expect_load_error("truncated", {file1, "truncated", std::to_string(fs::file_size(good / file1))});

  fs::remove(copy_to("missing") / file1);
  expect_load_error("missing", {file1, "is missing"});

  fs::remove(copy_to("no-manifest") / "manifest.json");
  expect_load_error("no-manifest", {"manifest.json"});

  expect_load_error("absent", {"absent"}, zp::Errc::invalid_argument);

  // A corrupt `latest` names the checkpoints that could be loaded instead (those with a
  // manifest); a tag asked for by name does not.
  const auto load_says = [&](const std::string& tag) {
    std::string said;
    on_two_ranks([&](E2& e, Mlp<float>&) {
      try {
        zp::load_checkpoint(e, dir.path, tag);
      } catch (const zp::Error& x) {
        if (e.comm().rank() == 0) said = x.what();
      }
    });
    CHECK(said.find("CRC-32C") != std::string::npos);
    return said;
  };
  std::ofstream(dir.path / "latest", std::ios::trunc) << "flipped\n";
  const std::string said = load_says("latest");
  const auto others = said.find("the other checkpoints in " + dir.path.string());
  REQUIRE(others != std::string::npos);
  for (const char* t : {"good", "truncated", "missing"})
    CHECK(said.find(t, others) != std::string::npos);
  CHECK(said.find("no-manifest", others) == std::string::npos);
  CHECK(said.find("flipped", others) == std::string::npos);
  CHECK(load_says("flipped").find("the other checkpoints") == std::string::npos);
  std::ofstream(dir.path / "latest", std::ios::trunc) << "good\n";

  // Another model's checkpoint: a layer of another width.
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> other({Mlp<float>::inputs, 61, 60, 53, Mlp<float>::classes});
    E2 e(comm, other, config(1));
    zp::save_checkpoint(e, dir.path, "other");
  });
  expect_load_error("other", {"layer1.weight", std::to_string(61 * 60), std::to_string(61 * 67)},
                    zp::Errc::invalid_argument);
  // Its manifest next to this model's files: the sizes and checksums no longer match.
  fs::copy_file(dir.path / "other" / "manifest.json", copy_to("foreign-manifest") / "manifest.json",
                fs::copy_options::overwrite_existing);
  expect_load_error("foreign-manifest", {"layer1.weight"}, zp::Errc::invalid_argument);

  // Another element type, another optimizer.
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<zp::bf16> model;
    zp::Engine<Threads, zp::bf16, 2> e(comm, model, config(1));
    zp::test::expect_error(zp::Errc::invalid_argument,
                           [&] { zp::load_checkpoint(e, dir.path, "good"); }, {"f32", "bf16"});
  });
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    zp::Engine<Threads, float, 2, zp::optim::Sgd> e(comm, model, config(1));
    zp::test::expect_error(zp::Errc::invalid_argument,
                           [&] { zp::load_checkpoint(e, dir.path, "good"); }, {"AdamW", "Sgd"});
  });

  // Saving: an existing tag, a bad tag, inside an accumulation window.
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, "good"); },
                             {"good", "already exists"});
    zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, "a/b"); }, {"a/b"});
    const std::string mine = e.comm().rank() == 0 ? "x0" : "x1";
    zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, mine); },
                             {"different tags", "'" + mine + "'"});
  });
  on_two_ranks(
      [&](E2& e, Mlp<float>& m) {
        zp::test::micro_step(e, m, e.comm().rank() * 2, 2);
        zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, "mid"); },
                                 {"micro-step 2 of 2", "accumulation boundary"});
        zp::test::micro_step(e, m, 4 + e.comm().rank() * 2, 2);
        zp::save_checkpoint(e, dir.path, "after");
      },
      config(2));
}

namespace {

// A Progress's calls, which must count up to the bytes written: each `done` larger than the
// last, the same `total` in each, the last `done` equal to it.
struct ProgressLog {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> calls;
  zp::ckpt::Progress fn() {
    return [this](std::uint64_t done, std::uint64_t total) { calls.emplace_back(done, total); };
  }
  void check(std::uint64_t written) const {
    REQUIRE(!calls.empty());
    for (std::size_t i = 0; i < calls.size(); ++i) {
      CHECK(calls[i].second == written);
      if (i) CHECK(calls[i].first > calls[i - 1].first);
    }
    CHECK(calls.back().first == written);
  }
};

// The bytes of the tensors of the safetensors files in `files` (but the user data).
std::uint64_t tensor_bytes(const std::vector<fs::path>& files) {
  std::uint64_t n = 0;
  for (const auto& f : files) {
    const zp::safetensors::Reader r(f);
    for (const auto& t : r.tensors())
      if (t.name != "user/blob") n += t.bytes();
  }
  return n;
}

}  // namespace

TEST_CASE("an offline reshard reports its progress, and a reader verifies each file once") {
  TempDir dir("reshard-progress");
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 1);
    zp::save_checkpoint(e, dir.path, "good");
  });
  zp::ckpt::Reader rd(dir.path, "good");
  ProgressLog log;
  zp::ckpt::reshard(rd, dir.path, "three", 3, log.fn());
  std::vector<fs::path> files;
  for (int r = 0; r < 3; ++r) files.push_back(dir.path / "three" / zp::ckpt::rank_file_name(r, 3));
  log.check(tensor_bytes(files));
  CHECK(log.calls.size() > 3);  // a call per slice, not per file
  zp::ckpt::Reader(dir.path, "three").verify();

  // Once verify_file passed, verify() (the one export and reshard call) does not read that file
  // again: a byte changed since goes unseen by that reader, and a fresh one names it.
  const std::string file1 = "rank-00001-of-00002.safetensors";
  zp::ckpt::Reader once(dir.path, "good");
  std::uint64_t read = 0;  // what verify_file reports reading: every byte of the file
  CHECK(once.verify_file(1, [&](std::uint64_t n) { read += n; }).empty());
  CHECK(read == fs::file_size(dir.path / "good" / file1));
  flip_byte(dir.path / "good" / file1, fs::file_size(dir.path / "good" / file1) - 3);
  CHECK_NOTHROW(once.verify());
  zp::test::expect_error(zp::Errc::io, [&] { zp::ckpt::Reader(dir.path, "good").verify(); },
                         {file1, "CRC-32C"});
}

// bf16 and fp16: each field dtype an offline export reads (fp32 for the master).
TEST_CASE_TEMPLATE(
    "safetensors export: from a live engine and offline from a checkpoint, split, and loaded back "
    "by name",
    T, zp::bf16, zp::fp16) {
  TempDir dir("export");
  Snapshot<T> ref;
  std::vector<std::string> names;
  ProgressLog live[3];  // per rank: only rank 0 writes
  with_stage(3, [&]<int S>(std::integral_constant<int, S>) {
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<T> model;
      zp::Engine<Threads, T, S> e(comm, model, config(1));
      train(e, model, 0, 2);
      zp::export_safetensors(e, dir.path / "live", {.progress = live[comm.rank()].fn()});
      zp::export_safetensors(e, dir.path / "live-master", {.master = true});
      zp::export_safetensors(e, dir.path / "split", {.max_file_bytes = 8000});
      zp::save_checkpoint(e, dir.path / "ckpt", "t2");
      auto s = snapshot(e);
      if (comm.rank() == 0) {
        ref = std::move(s);
        for (const auto& p : e.layout().params()) names.push_back(p.name);
      }
    });
  });
  // Every tensor by name holds the gathered values, bitwise, in every form of the export.
  zp::ckpt::Reader ck(dir.path / "ckpt");
  ProgressLog offline;
  zp::export_safetensors(ck, dir.path / "offline", {.progress = offline.fn()});
  zp::export_safetensors(ck, dir.path / "offline-master", {.master = true});
  // The progress of an export counts its tensors' bytes, on rank 0 alone in an engine's.
  const std::uint64_t exported = tensor_bytes({dir.path / "live" / "model.safetensors"});
  CHECK(exported == ref.params.size() * sizeof(T));
  live[0].check(exported);
  CHECK(live[1].calls.empty());
  CHECK(live[2].calls.empty());
  offline.check(exported);
  auto check_dir = [&]<class U>(const fs::path& d, const std::vector<U>& want) {
    const auto files = zp::ckpt::safetensors_files(d);
    CHECK(files.size() == names.size());
    std::size_t at = 0;
    for (const auto& name : names) {
      zp::safetensors::Reader r(files.at(name));
      std::vector<U> got(r.at(name).elements());
      r.read_elements(name, 0, std::span<U>(got));
      CHECK(std::memcmp(got.data(), want.data() + at, got.size() * sizeof(U)) == 0);
      at += got.size();
    }
    CHECK(at == want.size());
  };
  check_dir(dir.path / "live", ref.params);
  check_dir(dir.path / "offline", ref.params);
  check_dir(dir.path / "split", ref.params);
  check_dir(dir.path / "live-master", ref.master);
  check_dir(dir.path / "offline-master", ref.master);
  CHECK(fs::exists(dir.path / "split" / "model.safetensors.index.json"));
  CHECK(zp::safetensors::read_index(dir.path / "split" / "model.safetensors.index.json")
            .weight_map.size() == names.size());

  // Loaded back by name at another rank count and stage: T exports give the parameters (and
  // master = the parameters widened), fp32 exports the master (and parameters = it rounded).
  for (const char* d : {"split", "live-master"}) {
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<T> model;
      zp::Engine<Threads, T, 1> e(comm, model, config(1));
      zp::load_safetensors(e, dir.path / d);
      const auto p = e.gather_params();
      const auto m = e.gather_master();
      CHECK(same_bits(p, ref.params));
      std::vector<float> widened(p.size());
      for (std::size_t i = 0; i < p.size(); ++i) widened[i] = float(p[i]);
      CHECK(same_bits(m, std::string(d) == "live-master" ? ref.master : widened));
    });
  }
  // A model that lacks a tensor, or has another size, is named.
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<T> other({Mlp<T>::inputs, 61, 60, 53, Mlp<T>::classes});
    zp::Engine<Threads, T, 1> e(comm, other, config(1));
    zp::test::expect_invalid([&] { zp::load_safetensors(e, dir.path / "live"); },
                             {"layer1.weight", "elements"});
  });
}

// ---- hostile directories and calls -------------------------------------------------------------

namespace {

void put_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// A manifest edited on purpose, with its own checksum made to match again.
nlohmann::json sealed(nlohmann::json m) {
  m["manifest_crc32c"] = zp::ckpt::manifest_crc32c(m);
  return m;
}

// A saved checkpoint "good" (2 ranks, 1 step, user data 8 bytes) in a fresh directory.
struct Saved {
  TempDir dir{"hostile"};
  Saved() {
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      train(e, m, 0, 1);
      zp::save_checkpoint(e, dir.path, "good", bytes_of(1));
    });
  }
};

}  // namespace

// PyTorch refuses an optimizer state of other param groups; a checkpoint here refuses a filter
// that names other parameters than the one it was trained with, before anything is read.
TEST_CASE(
    "a checkpoint keeps which parameters take weight decay; a load with another filter fails") {
  TempDir dir("decay");
  EngineConfig most = config(1), every = config(1), fewer = config(1);
  most.weight_decay_filter = decays_most;
  fewer.weight_decay_filter = [](std::string_view n) {
    return decays_most(n) && n != "layer2.bias";
  };
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    E2 e(comm, model, most, zp::optim::AdamW{.lr = 1e-2f});
    train(e, model, 0, 2);
    zp::save_checkpoint(e, dir.path, "most");
  });
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 2);
    zp::save_checkpoint(e, dir.path, "every");
  });
  CHECK(zp::ckpt::Reader(dir.path, "most").manifest().no_weight_decay ==
        std::vector<std::string>{"layer0.bias", "layer1.weight"});
  CHECK(zp::ckpt::Reader(dir.path, "every").manifest().no_weight_decay.empty());
  CHECK(nlohmann::json::parse(zp::detail::read_whole_file(dir.path / "most" / "manifest.json",
                                                          1 << 20))["optimizer"]["no_weight_decay"]
            .size() == 2);
  auto refused = [&](const EngineConfig& cfg, const std::string& tag,
                     std::initializer_list<std::string> needles) {
    on_two_ranks(
        [&](E2& e, Mlp<float>& m) {
          train(e, m, 0, 1);
          const auto before = snapshot(e);
          zp::test::expect_invalid([&] { zp::load_checkpoint(e, dir.path, tag); }, needles);
          check_same(before, snapshot(e));  // nothing of the checkpoint was read into it
        },
        cfg);
  };
  refused(every, "most",
          {"most", "trained with weight decay off for parameter 'layer0.bias'",
           "which this engine's weight_decay_filter decays", "2 of the checkpoint's"});
  refused(fewer, "most", {"weight decay on for parameter 'layer2.bias'", "exempts"});
  refused(most, "every", {"weight decay on for parameter 'layer0.bias'", "exempts"});
  on_two_ranks([&](E2& e, Mlp<float>&) { CHECK_NOTHROW(zp::load_checkpoint(e, dir.path, "most")); },
               most);
}

TEST_CASE("tags and `latest`: only plain names, never a path out of the directory") {
  Saved s;
  const fs::path& d = s.dir.path;
  // Saving under a tag that is not a plain name is refused on every rank, naming the tag.
  for (const std::string& bad :
       std::vector<std::string>{"a/b", "..", ".hidden", "step1 ", " step1", "x\ty", "new\nline",
                                "latest", "", std::string(201, 'x'), "caf\xc3\xa9", "a\\b"})
    on_two_ranks([&](E2& e, Mlp<float>&) {
      CAPTURE(bad);
      zp::test::expect_invalid([&] { zp::save_checkpoint(e, d, bad); },
                               {"is not a checkpoint tag"});
    });
  CHECK(!fs::exists(d / "step1 "));
  // Loading one: a tag given explicitly, or what `latest` holds, is checked the same way.
  TempDir outside("outside");  // a sibling of d: "../<its name>" leads out of d
  const std::string up = "../" + outside.path.filename().string();
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_invalid([&] { zp::load_checkpoint(e, d, up); },
                             {"'" + up + "'", "not a checkpoint tag"});
  });
  auto latest_is = [&](const std::string& text, std::initializer_list<std::string> needles,
                       zp::Errc c = zp::Errc::invalid_argument) {
    fs::remove_all(d / "latest");
    put_text(d / "latest", text);
    CAPTURE(text);
    on_two_ranks([&](E2& e, Mlp<float>&) {
      zp::test::expect_error(
          c, [&] { zp::load_checkpoint(e, d); }, needles);
    });
  };
  latest_is("../good\n", {"latest holds", "'../good'", "'/'"});
  latest_is(d.string() + "/good", {"latest holds", "'/'"});
  latest_is("good\r\n", {"latest holds", "0x0d"});
  latest_is("good \n", {"latest holds", "' '"});
  latest_is("good\n\n", {"latest holds", "0x0a"});
  latest_is("", {"latest holds", "''"});
  latest_is(std::string(300, 'g'), {"latest", "300 bytes", "256-byte limit"}, zp::Errc::io);
  // A trailing newline is what zp (and DeepSpeed) write; none at all is accepted too.
  for (const char* ok : {"good\n", "good"}) {
    put_text(d / "latest", ok);
    on_two_ranks([&](E2& e, Mlp<float>&) { CHECK(int_of(zp::load_checkpoint(e, d)) == 1); });
  }
  // A directory or a FIFO as `latest` is an error, not a hang.
  fs::remove(d / "latest");
  fs::create_directory(d / "latest");
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_error(zp::Errc::io, [&] { zp::load_checkpoint(e, d); },
                           {"latest", "not a regular file (a directory)"});
  });
  fs::remove(d / "latest");
  REQUIRE(::mkfifo((d / "latest").c_str(), 0644) == 0);
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_error(zp::Errc::io, [&] { zp::load_checkpoint(e, d); },
                           {"latest", "not a regular file (a FIFO)"});
  });
}

TEST_CASE("a FIFO or directory where a checkpoint file should be is an error, never a hang") {
  Saved s;
  const fs::path tag = s.dir.path / "good";
  const std::string file1 = "rank-00001-of-00002.safetensors";
  fs::rename(tag / file1, s.dir.path / "saved-file");
  REQUIRE(::mkfifo((tag / file1).c_str(), 0644) == 0);
  zp::ckpt::Reader rd(s.dir.path);
  CHECK(rd.verify_file(1).find("not a regular file (a FIFO)") !=
        std::string::npos);  // zp_ckpt verify
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_error(zp::Errc::io, [&] { zp::load_checkpoint(e, s.dir.path); },
                           {file1, "a FIFO"});
  });
  fs::remove(tag / "manifest.json");
  REQUIRE(::mkfifo((tag / "manifest.json").c_str(), 0644) == 0);
  zp::test::expect_error(zp::Errc::io, [&] { zp::ckpt::Reader r(s.dir.path); },
                         {"manifest.json", "a FIFO"});
}

// A link inside a hostile checkpoint would make the load read a file outside it: a link is
// refused even where it points at the very file it replaces. The tag's directory may be a link.
TEST_CASE("a symbolic link among a checkpoint's files is refused; a linked tag directory loads") {
  Saved s;
  const fs::path tag = s.dir.path / "good";
  const std::string file1 = "rank-00001-of-00002.safetensors";
  fs::rename(tag / file1, s.dir.path / "saved-file");
  fs::create_symlink(s.dir.path / "saved-file", tag / file1);
  zp::test::expect_error(zp::Errc::io, [&] { zp::ckpt::Reader r(s.dir.path); },
                         {(tag / file1).string(), "is a symbolic link"});
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_error(zp::Errc::io, [&] { zp::load_checkpoint(e, s.dir.path); },
                           {file1, "is a symbolic link"});
  });
  fs::remove(tag / file1);
  fs::rename(s.dir.path / "saved-file", tag / file1);
  fs::rename(tag / "manifest.json", s.dir.path / "saved-manifest");
  fs::create_symlink(s.dir.path / "saved-manifest", tag / "manifest.json");
  zp::test::expect_error(zp::Errc::io, [&] { zp::ckpt::Reader r(s.dir.path); },
                         {"manifest.json is a symbolic link"});
  fs::remove(tag / "manifest.json");
  fs::rename(s.dir.path / "saved-manifest", tag / "manifest.json");
  TempDir elsewhere("linked");
  fs::create_directory_symlink(tag, elsewhere.path / "good");
  put_text(elsewhere.path / "latest", "good");
  zp::ckpt::Reader(elsewhere.path).verify();
  on_two_ranks([&](E2& e, Mlp<float>&) { zp::load_checkpoint(e, elsewhere.path); });
}

TEST_CASE(
    "two jobs saving into one directory at once: one saves, the other fails and publishes "
    "nothing") {
  TempDir dir("race");
  // The lock is the contract: while another writer holds it past lock_wait, a save fails on
  // every rank.
  {
    zp::detail::DirectoryLock other(dir.path, ".zp-save.lock", "checkpoint save");
    on_two_ranks([&](E2& e, Mlp<float>&) {
      zp::test::expect_error(zp::Errc::io,
                             [&] {
                               zp::save_checkpoint(e, dir.path, "t0", {},
                                                   {.lock_wait = std::chrono::milliseconds(100)});
                             },
                             {".zp-save.lock is held, waited 100 ms",
                              "only one may write into a directory at a time"});
    });
    CHECK(!fs::exists(dir.path / "t0"));
    CHECK(!fs::exists(dir.path / "latest"));
  }
  // A writer that lets go within lock_wait (zp_ckpt prune beside a training run): the save
  // waits for it and completes. Rank 0 takes the lock just before it saves, so the save finds
  // it held.
  {
    std::optional<zp::detail::DirectoryLock> other;
    std::thread release;
    on_two_ranks([&](E2& e, Mlp<float>&) {
      const bool lead = e.comm().rank() == 0;
      if (lead) {
        other.emplace(dir.path, ".zp-save.lock", "checkpoint save");
        release = std::thread([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          other.reset();
        });
      }
      const auto start = std::chrono::steady_clock::now();
      zp::save_checkpoint(e, dir.path, "t0");
      if (lead) CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(250));
    });
    release.join();
    CHECK(zp::ckpt::Reader::read_latest(dir.path) == "t0");
    zp::ckpt::Reader(dir.path).verify();
  }
  // Real races: two 2-rank jobs, trained to different steps, save the same tag at the same time.
  for (int round = 0; round < 4; ++round) {
    const std::string tag = "t" + std::to_string(round + 1);
    std::atomic<int> saved{0}, refused{0};
    Snapshot<float> winner[2];
    std::vector<std::thread> jobs;
    for (int job = 0; job < 2; ++job)
      jobs.emplace_back([&, job] {
        on_two_ranks([&](E2& e, Mlp<float>& m) {
          train(e, m, 0, 1 + job);
          try {
            zp::save_checkpoint(e, dir.path, tag);
            auto s = snapshot(e);
            if (e.comm().rank() == 0) winner[job] = std::move(s), ++saved;
          } catch (const zp::Error& err) {
            const std::string w = err.what();
            CHECK((w.find("is locked") != std::string::npos ||
                   w.find("already exists") != std::string::npos));
            if (e.comm().rank() == 0) ++refused;
          }
        });
      });
    for (auto& j : jobs) j.join();
    CHECK(saved + refused == 2);
    REQUIRE(saved >= 1);
    // Whoever saved, `latest` names a checkpoint that verifies and holds one job's state whole.
    CHECK(zp::ckpt::Reader::read_latest(dir.path) == tag);
    zp::ckpt::Reader(dir.path).verify();
    on_two_ranks([&](E2& e, Mlp<float>&) {
      zp::load_checkpoint(e, dir.path);
      auto s = snapshot(e);
      if (e.comm().rank() == 0) check_same(winner[e.steps() == 1 ? 0 : 1], s);
    });
  }
}

// Every rank must save into one directory that all of them see. A rank given another one is an
// error on every rank, and nothing is published: with a leftover staging directory there, the
// rank's own check passes and it writes its file into it; rank 0 then finds its file missing.
TEST_CASE("ranks that save into different directories fail together and publish nothing") {
  TempDir a("save-a"), b("save-b");
  fs::create_directories(b.path / ".q.partial");  // a crashed save's leftover
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 1);
    zp::save_checkpoint(e, a.path, "p");
    const auto saved = snapshot(e);
    train(e, m, 1, 2);
    const bool first = e.comm().rank() == 0;
    zp::test::expect_invalid(
        [&] { zp::save_checkpoint(e, first ? a.path : a.path / "elsewhere", "q"); },
        {"rank 1 does not see the staging directory",
         (a.path / "elsewhere" / ".q.partial").string(), "same directory"});
    zp::test::expect_error(zp::Errc::io,
                           [&] { zp::save_checkpoint(e, first ? a.path : b.path, "q"); },
                           {"not publishing", "rank 1's file", "is missing", "same directory"});
    CHECK(!fs::exists(a.path / "q"));
    CHECK(zp::ckpt::Reader::read_latest(a.path) == "p");
    zp::ckpt::Reader(a.path).verify();
    zp::load_checkpoint(e, a.path);
    auto loaded = snapshot(e);
    if (first) check_same(saved, loaded);
  });
}

TEST_CASE("ranks that would load different checkpoints fail together before reading anything") {
  TempDir a("agree-a"), b("agree-b");
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 1);
    zp::save_checkpoint(e, a.path, "p");
    train(e, m, 1, 2);
    zp::save_checkpoint(e, a.path, "q");
  });
  // A node-local directory per rank whose `latest` differs: b is a's copy pointing at "p".
  fs::copy(a.path, b.path, fs::copy_options::recursive);
  put_text(b.path / "latest", "p\n");
  on_two_ranks([&](E2& e, Mlp<float>&) {
    const auto before = snapshot(e);
    zp::test::expect_invalid(
        [&] { zp::load_checkpoint(e, e.comm().rank() == 0 ? a.path : b.path); },
        {"the ranks are loading different checkpoints", "latest"});
    // Tags passed differently per rank.
    zp::test::expect_invalid(
        [&] { zp::load_checkpoint(e, a.path, e.comm().rank() == 0 ? "p" : "q"); },
        {"different checkpoints", e.comm().rank() == 0 ? "step 1" : "step 2"});
    auto after = snapshot(e);
    if (e.comm().rank() == 0) check_same(before, after);  // nothing was read
  });
}

// Every integer of a real manifest set to values around the limits of the types it could land
// in, one at a time: reading the checkpoint (as load and zp_ckpt do) either works or is a
// zp::Error naming the manifest; never a crash, a std::bad_alloc or a silent wrap.
TEST_CASE(
    "generated manifests: out-of-range integers, nesting and duplicate keys are named errors") {
  Saved s;
  const fs::path manifest = s.dir.path / "good" / "manifest.json";
  const std::string original = zp::detail::read_whole_file(manifest, 1 << 20);
  const auto j = nlohmann::json::parse(original);
  std::vector<nlohmann::json::json_pointer> numbers;
  std::function<void(const nlohmann::json&, const nlohmann::json::json_pointer&)> walk =
      [&](const nlohmann::json& v, const nlohmann::json::json_pointer& at) {
        if (v.is_number()) numbers.push_back(at);
        if (v.is_object())
          for (const auto& [k, x] : v.items()) walk(x, at / k);
        if (v.is_array())
          for (std::size_t i = 0; i < v.size(); ++i) walk(v[i], at / i);
      };
  walk(j, nlohmann::json::json_pointer());
  CHECK(numbers.size() >= 20);
  // Reads everything a load reads: verification, every field of every parameter, the user data.
  auto read_all = [&] {
    zp::ckpt::Reader rd(s.dir.path);
    rd.verify();
    const auto& m = rd.manifest();
    for (std::size_t f = 0; f < m.fields.size(); ++f)
      for (std::size_t p = 0; p < m.params.size(); ++p) {
        std::vector<std::byte> buf(m.params[p].size * zp::size_of(m.field_dtype(f)));
        rd.read_bytes(f, p, 0, buf);
      }
    (void)rd.user_blob();
  };
  read_all();
  const nlohmann::json extremes[] = {-1,
                                     0,
                                     1,
                                     2147483647LL,
                                     2147483648LL,
                                     4294967298LL,
                                     9223372036854775807LL,
                                     18446744073709551615ULL,
                                     1e300,
                                     -1e300,
                                     0.5,
                                     "7",
                                     nullptr};
  int rejected = 0;
  for (const auto& at : numbers)
    for (const auto& x : extremes) {
      auto m = j;
      m[at] = x;
      // Sealed, so that the readers behind the checksum meet the value (but the checksum's own).
      put_text(manifest, (at.to_string() == "/manifest_crc32c" ? m : sealed(m)).dump());
      CAPTURE(at.to_string());
      CAPTURE(x.dump());
      try {
        read_all();
      } catch (const zp::Error& e) {
        ++rejected;
        CHECK(std::string(e.what()).find("good") != std::string::npos);  // names the checkpoint
      }
    }
  CHECK(rejected > int(numbers.size()) * 8);
  // The specific wraps and traps the review found.
  auto rejects = [&](const std::string& text, std::initializer_list<std::string> needles) {
    put_text(manifest, text);
    CAPTURE(text.substr(0, 200));
    zp::test::expect_error(zp::Errc::io, read_all, needles);
  };
  auto with = [&](const std::string& pointer, const nlohmann::json& x) {
    auto m = j;
    m[nlohmann::json::json_pointer(pointer)] = x;
    return sealed(m).dump();
  };
  rejects(with("/world_size", 4294967298LL),
          {"world_size", "expected an integer in [1, 16777216], got 4294967298"});
  rejects(with("/params/2/module", 2147483646), {"params[2].module", "2147483646"});
  rejects(with("/params/0/module", 1), {"params[0].module"});
  rejects(with("/params/3/module", 0),
          {"params", "module 0 after a parameter of module 1"});  // decreasing
  {
    auto m = j;
    m["params"][0]["size"] = 1LL << 47;
    m["params"][0]["shape"] = {1LL << 47};
    rejects(sealed(m).dump(), {"fewer than the", "parameter elements need"});
  }
  rejects(with("/files/0/crc32c", 4294967296LL), {"files[0].crc32c"});
  rejects(with("/user_bytes", 7), {"user data has 7 bytes", "holds 8"});
  rejects(with("/user_bytes", 0), {"user data has 0 bytes", "holds 8"});
  rejects(with("/tag", "../evil"), {"tag", "not a checkpoint tag"});
  rejects(with("/fields/2", "master"), {"fields", "appears twice"});
  rejects(with("/params/1/name", j["params"][0]["name"]), {"params[1].name", "appears twice"});
  rejects(with("/optimizer/no_weight_decay", 3), {"optimizer.no_weight_decay", "an array"});
  rejects(with("/optimizer/no_weight_decay", {"layer0.bias", 5}),
          {"optimizer.no_weight_decay[1]", "expected a parameter name, got 5"});
  rejects(with("/optimizer/no_weight_decay", {"layer9.bias"}),
          {"optimizer.no_weight_decay[0]", "names no parameter", "layer9.bias"});
  rejects(with("/optimizer/no_weight_decay", {"layer0.bias", "layer0.bias"}),
          {"optimizer.no_weight_decay[1]", "appears twice"});
  // Duplicate keys at any level, and nesting far deeper than a manifest has.
  std::string dup = original;
  dup.insert(dup.find("\"world_size\""), "\"world_size\": 1,");
  rejects(dup, {"world_size: duplicate key"});
  dup = original;
  dup.insert(dup.find("\"kind\""), "\"kind\": 0,");
  rejects(dup, {"progress.loss_scaler.kind: duplicate key"});
  rejects("{\"format\":" + std::string(1'000'000, '['),
          {"manifest.json", "nesting deeper than 32 levels"});
  // The engine's load reports the same, on every rank, and leaves its state alone.
  rejects(with("/world_size", 4294967298LL), {"world_size"});
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_error(zp::Errc::io, [&] { zp::load_checkpoint(e, s.dir.path); },
                           {"world_size", "4294967298"});
  });
  // Hyper-parameters are read by the engine: a value no float holds is named, not converted.
  put_text(manifest, with("/optimizer/params/lr", 1e300));
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_invalid([&] { zp::load_checkpoint(e, s.dir.path); },
                             {"optimizer.params.lr", "32-bit float", "1e+300"});
  });
  // ... and one the optimizer refuses names the checkpoint too.
  put_text(manifest, with("/optimizer/params/lr", -1.0));
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_invalid([&] { zp::load_checkpoint(e, s.dir.path); },
                             {"checkpoint ", ": optimizer.params: ", "lr", "-1"});
  });
}

// A manifest is checked against its own checksum: one bit flipped anywhere is refused, naming
// the checkpoint, unless the JSON still holds the same values (a flip that only changes how a
// number is written); a reformatted manifest loads; versions 5, 4 and 2 (before the checksum)
// load.
TEST_CASE("a manifest whose values changed is refused by its own checksum") {
  Saved s;
  const fs::path manifest = s.dir.path / "good" / "manifest.json";
  const std::string original = zp::detail::read_whole_file(manifest, 1 << 20);
  const auto j = nlohmann::json::parse(original);
  const auto values = zp::ckpt::to_json(zp::ckpt::Reader(s.dir.path).manifest());
  const std::uint64_t seed = zp::test::run_seed("checkpoint.test");
  int refused = 0;
  constexpr int flips = 300;  // at random places: every place costs 15 s under ASan
  for (int k = 0; k < flips; ++k) {
    const std::uint64_t r = zp::test::mix(seed + std::uint64_t(k));
    const std::size_t i = (r >> 3) % original.size();
    std::string text = original;
    text[i] = char(text[i] ^ (1 << (r & 7)));
    put_text(manifest, text);
    CAPTURE(i);
    CAPTURE(text.substr(i < 40 ? 0 : i - 40, 80));
    try {
      zp::ckpt::Reader rd(s.dir.path);
      CHECK(zp::ckpt::to_json(rd.manifest()) == values);
    } catch (const zp::Error& e) {
      CHECK(std::string(e.what()).find("good") != std::string::npos);
      ++refused;
    }
  }
  CHECK(refused > flips * 9 / 10);
  // In range, each of these would load as a different training state without the checksum.
  for (const auto& [at, x] : {std::pair<const char*, nlohmann::json>{"/progress/step", 2},
                              {"/optimizer/params/lr", 0.5},
                              {"/progress/loss_scaler/skipped", 1},
                              {"/files/0/crc32c", 7}}) {
    auto m = j;
    m[nlohmann::json::json_pointer(at)] = x;
    put_text(manifest, m.dump(1));
    CAPTURE(at);
    zp::test::expect_error(zp::Errc::io, [&] { zp::ckpt::Reader rd(s.dir.path); },
                           {"good", "manifest_crc32c", "(the manifest is corrupt)"});
  }
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_error(zp::Errc::io, [&] { zp::load_checkpoint(e, s.dir.path); },
                           {"manifest_crc32c"});
  });
  put_text(manifest, j.dump(4));
  zp::ckpt::Reader(s.dir.path).verify();
  auto v5 = j;  // before ZeRO++ on tensor-parallel grids: no segments cut by kind
  v5["version"] = 5;
  v5["layout"].erase("by_tp_kind");
  put_text(manifest, sealed(v5).dump());
  on_two_ranks([&](E2& e, Mlp<float>&) { zp::load_checkpoint(e, s.dir.path); });
  auto v4 = j;  // before the weight decay rule: every parameter took it
  v4["version"] = 4;
  v4["optimizer"].erase("no_weight_decay");
  put_text(manifest, sealed(v4).dump());
  on_two_ranks([&](E2& e, Mlp<float>&) { zp::load_checkpoint(e, s.dir.path); });
  auto v2 = j;
  v2["version"] = 2;
  v2.erase("manifest_crc32c");
  v2["progress"]["loss_scaler"].erase("skipped_in_row");
  put_text(manifest, v2.dump());
  on_two_ranks([&](E2& e, Mlp<float>&) { zp::load_checkpoint(e, s.dir.path); });
}

namespace {

// A manifest as the writer makes it, built by hand (no engine, no files): 3 parameters in 2
// modules over 2 ranks, bf16, AdamW with one state.
zp::ckpt::Manifest small_manifest() {
  zp::ckpt::Manifest m;
  m.tag = "t1";
  m.world_size = 2;
  m.stage = 2;
  m.dtype = zp::DType::bf16;
  m.layout = {.bucket_elems = 64, .first_bucket_elems = 16, .align = 4};
  m.grid = {2, 1, 1};
  m.params = {{"a", 0, 10}, {"b", 0, 7}, {"c", 1, 5}};
  m.parts = zp::ckpt::data_parallel_parts(m.params);
  m.fields = {"param", "master", "exp_avg"};
  m.optimizer = "AdamW";
  m.hyper = {{"lr", 0.001}};
  m.step = 3;
  m.micro_step = 6;
  m.scaler_kind = 2;
  m.scaler = {.scale = 1024.0f, .iter = 5, .last_overflow = 2, .hysteresis = 2, .skipped = 1};
  m.batch = {.train_batch_size = 8, .micro_batch_per_rank = 2, .gradient_accumulation_steps = 2};
  m.files = {{zp::ckpt::rank_file_name(0, 2), 4096, 123},
             {zp::ckpt::rank_file_name(1, 2), 4096, 0xffffffffu}};
  m.user_bytes = 8;
  return m;
}

// Every key of a manifest below the root, as a JSON pointer and as messages name it
// ("params[1].size"), with whether it is an array item. The optimizer's params (free-form, the
// engine reads them) and zp_version (not read) are left out.
struct ManifestKeyPath {
  nlohmann::json::json_pointer at;
  std::string name;
  bool item = false;
};
void key_paths(const nlohmann::json& v, const nlohmann::json::json_pointer& at,
               const std::string& name, std::vector<ManifestKeyPath>& out) {
  if (v.is_object() && name != "optimizer.params")
    for (const auto& [k, x] : v.items()) {
      if (k == "zp_version") continue;
      const std::string n = name.empty() ? k : name + "." + k;
      out.push_back({at / k, n});
      key_paths(x, at / k, n, out);
    }
  if (v.is_array())
    for (std::size_t i = 0; i < v.size(); ++i) {
      const std::string n = name + "[" + std::to_string(i) + "]";
      out.push_back({at / i, n, true});
      key_paths(v[i], at / i, n, out);
    }
}

}  // namespace

TEST_CASE(
    "a manifest with any key missing, of the wrong type or out of range is an error naming that "
    "key") {
  using nlohmann::json;
  const zp::ckpt::Manifest good = small_manifest();
  const json j = zp::ckpt::to_json(good);
  const std::string src = "test/manifest.json";
  // What the writer writes reads back as it was, and keys this zp does not know are skipped (a
  // newer writer may add some).
  CHECK(zp::ckpt::to_json(zp::ckpt::manifest_from_json(j, src)) == j);
  json newer = j;
  newer["written_by_a_newer_zp"] = {1, 2};
  newer["progress"]["loss_scaler"]["new_counter"] = 7;
  newer["files"][1]["sha256"] = "abc";
  CHECK(zp::ckpt::to_json(zp::ckpt::manifest_from_json(sealed(newer), src)) == j);

  auto rejects = [&](const json& m, std::initializer_list<std::string> needles) {
    CAPTURE(m.dump());
    zp::test::expect_error(
        zp::Errc::io, [&] { (void)zp::ckpt::manifest_from_json(m, src); }, needles);
    zp::test::expect_error(zp::Errc::io, [&] { (void)zp::ckpt::manifest_from_json(m, src); },
                           {"checkpoint manifest " + src + ": "});
  };
  std::vector<ManifestKeyPath> paths;
  key_paths(j, json::json_pointer(), "", paths);
  CHECK(paths.size() >= 40);
  for (const auto& p : paths) {
    CAPTURE(p.name);
    json m = j;
    // Missing: every key is required (an array item is not a key: removing one is a count error).
    if (!p.item) {
      m[p.at.parent_pointer()].erase(p.at.back());
      rejects(m, {p.name + ": missing"});
    }
    // The wrong type: a number for a string, a string for anything else. An item of "fields" is
    // named by its array.
    m = j;
    m[p.at] = j[p.at].is_string() ? json(5) : json("x");
    const bool field = p.name.starts_with("fields[");
    rejects(m,
            {(field ? std::string("fields") : p.name) + ": ", j[p.at].is_string() ? "5" : "\"x\""});
  }
  // Out of range, for every key with a range: each names the key.
  struct Bad {
    const char* at;
    json value;
    const char* key;
  };
  const Bad out_of_range[] = {
      {"/format", "zp-checkpoint-rank", "format"},
      {"/version", 0, "version"},
      {"/tag", "../up", "tag"},
      {"/tag", "latest", "tag"},
      {"/world_size", 0, "world_size"},
      {"/world_size", (1 << 24) + 1, "world_size"},
      {"/world_size", 2.0, "world_size"},
      {"/stage", 4, "stage"},
      {"/stage", -1, "stage"},
      {"/dtype", "f64", "dtype"},
      {"/layout/bucket_elems", 0, "layout.bucket_elems"},
      {"/layout/bucket_elems", (1LL << 48) + 1, "layout.bucket_elems"},
      {"/layout/first_bucket_elems", 0, "layout.first_bucket_elems"},
      {"/layout/align", 0, "layout.align"},
      {"/layout/align", (1 << 20) + 1, "layout.align"},
      {"/params", json::array(), "params"},
      {"/params/0/module", -1, "params[0].module"},
      {"/params/1/module", 2, "params[1].module"},
      {"/params/0/size", 0, "params[0].size"},
      {"/params/0/size", (1LL << 48) + 1, "params[0].size"},
      {"/params/0/size", 0.5, "params[0].size"},
      {"/params/2/name", "a", "params[2].name"},
      {"/params/0/shape", json::array({3, 3}), "params[0].shape"},
      {"/params/0/shape", json::array(), "params[0].shape"},
      {"/params/0/shape/0", 0, "params[0].shape[0]"},
      {"/grid/dp", 3, "grid"},
      {"/grid/tp", 0, "grid.tp"},
      {"/parts", json::array(), "parts"},
      {"/parts/0", json::array(), "parts[0]"},
      {"/parts/0/0/name", "zz", "parts[0][0].name"},
      {"/parts/0/1/name", "a", "parts[0][1].name"},
      {"/parts/0/0/module", 1, "parts[0][0].module"},
      {"/parts/0/0/end", json::array({11}), "parts[0][0]"},
      {"/parts/0/0/begin", json::array({10}), "parts[0][0]"},
      {"/parts/0/0/begin", json::array({0, 0}), "parts[0][0]"},
      {"/fields", json::array({"param"}), "fields"},
      {"/fields/2", "master", "fields"},
      {"/fields/2", "a/b", "fields"},
      {"/fields/2", "", "fields"},
      {"/fields/0", "master0", "fields"},
      {"/optimizer/params", json::array(), "optimizer.params"},
      {"/progress/step", -1, "progress.step"},
      {"/progress/micro_step", -1, "progress.micro_step"},
      {"/progress/loss_scaler/kind", 3, "progress.loss_scaler.kind"},
      {"/progress/loss_scaler/scale", 0, "progress.loss_scaler.scale"},
      {"/progress/loss_scaler/scale", -1, "progress.loss_scaler.scale"},
      {"/progress/loss_scaler/scale", 1e39, "progress.loss_scaler.scale"},
      {"/progress/loss_scaler/iter", -1, "progress.loss_scaler.iter"},
      {"/progress/loss_scaler/last_overflow", -2, "progress.loss_scaler.last_overflow"},
      {"/progress/loss_scaler/hysteresis", 0, "progress.loss_scaler.hysteresis"},
      {"/progress/loss_scaler/hysteresis", 2147483648LL, "progress.loss_scaler.hysteresis"},
      {"/progress/loss_scaler/skipped", -1, "progress.loss_scaler.skipped"},
      {"/progress/loss_scaler/skipped_in_row", -1, "progress.loss_scaler.skipped_in_row"},
      {"/batch/train_batch_size", -1, "batch.train_batch_size"},
      {"/batch/micro_batch_per_rank", -1, "batch.micro_batch_per_rank"},
      {"/batch/gradient_accumulation_steps", -1, "batch.gradient_accumulation_steps"},
      {"/files", json::array(), "files"},
      {"/files/1/name", "rank-00000-of-00002.safetensors", "files[1].name"},
      {"/files/0/bytes", 7, "files[0].bytes"},
      {"/files/0/bytes", (1LL << 56) + 1, "files[0].bytes"},
      {"/files/0/crc32c", -1, "files[0].crc32c"},
      {"/files/0/crc32c", 4294967296LL, "files[0].crc32c"},
      {"/user_bytes", -1, "user_bytes"},
      {"/user_bytes", 4097, "user_bytes"}};
  for (const Bad& b : out_of_range) {
    CAPTURE(b.at);
    json m = j;
    m[json::json_pointer(b.at)] = b.value;
    rejects(m, {std::string(b.key) + ": "});
  }
  // The specific messages: the range, the value, what the key must be.
  auto with = [&](const char* pointer, const json& x) {
    json m = j;
    m[json::json_pointer(pointer)] = x;
    return m;
  };
  rejects(with("/world_size", 2.0), {"world_size: expected an integer in [1, 16777216], got 2.0"});
  rejects(with("/version", 7), {"version: format version 7; this zp reads versions 1 to 6"});
  rejects(with("/grid/dp", 1), {"grid: dp x tp x pp = 1 x 1 x 1 is not world_size 2"});
  rejects(with("/parts/0/0/end", json::array({11})),
          {"parts[0][0]: the part: dimension 0 of the Placement is [0, 11), not a non-empty range "
           "inside [0, 10)"});
  // Version 1 (before grids): no grid, parts or shapes; it reads as a data-parallel grid.
  json v1 = with("/version", 1);
  v1.erase("grid");
  v1.erase("parts");
  for (auto& p : v1["params"]) p.erase("shape");
  v1["progress"]["loss_scaler"].erase("skipped_in_row");
  CHECK(zp::ckpt::to_json(zp::ckpt::manifest_from_json(v1, src)) == j);
  rejects(with("/format", "pt"), {"format: expected \"zp-checkpoint\"", "got \"pt\""});
  rejects(with("/params/1/module", 2), {"params[1].module: expected an integer in [0, 1], got 2"});
  rejects(with("/files/0/crc32c", 4294967296LL),
          {"files[0].crc32c: expected an integer in [0, 4294967295]"});
  rejects(with("/user_bytes", 4097), {"user_bytes: expected an integer in [0, 4096], got 4097"});
  rejects(with("/dtype", "f64"), {"dtype: expected f32, bf16 or f16, got \"f64\""});
  rejects(with("/files/1/name", "x"),
          {"files[1].name: expected rank-00001-of-00002.safetensors, got x"});
  json small = with("/files/0/bytes", 100);
  small["files"][1]["bytes"] = 100;
  rejects(small, {"files: the files hold 200 bytes in all, fewer than the 22 parameter elements "
                  "need (10 bytes"});
  rejects(with("/tag", "../up"), {"tag: ", "not a checkpoint tag"});
  rejects(json::array(), {"expected an object {...}"});
}
