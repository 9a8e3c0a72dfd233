#include "zp/checkpoint.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
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
// step t, micro-step i, rank r of n reads samples from ((t * gas + i) * n + r) * 2).
template <class E, class T>
void train(E& e, Mlp<T>& m, std::int64_t t0, std::int64_t t1) {
  const auto gas = e.batch().gradient_accumulation_steps;
  const int n = e.comm().size(), r = e.comm().rank();
  for (std::int64_t t = t0; t < t1; ++t)
    for (std::int64_t i = 0; i < gas; ++i) zp::test::micro_step(e, m, ((t * gas + i) * n + r) * 2, 2);
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
  Snapshot<typename E::value_type> s{e.gather_params(), e.gather_master(), e.gather_state(0), e.gather_state(1),
                                     e.loss_scaler().state(), e.steps()};
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

template <class T, int Stage>
void check_resume(zp::LossScaler scaler) {
  constexpr int ranks = 2, gas = 2, k = 3;
  using E = zp::Engine<Threads, T, Stage>;
  const EngineConfig cfg = config(gas, scaler);
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
void check_resume_all_stages(zp::LossScaler scaler) {
  check_resume<T, 0>(scaler);
  check_resume<T, 1>(scaler);
  check_resume<T, 2>(scaler);
  check_resume<T, 3>(scaler);
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

TEST_CASE("a checkpoint saved at N ranks and stage S loads at M ranks and stage S', bitwise, and training goes on") {
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
      for (int m = 1; m <= 4; ++m)
        for (int s2 = 0; s2 <= 3; ++s2) {
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

TEST_CASE("a save that fails after any file operation leaves the previous checkpoint loading bitwise") {
  TempDir dir("crash");
  Snapshot<float> first;
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 2);
    zp::save_checkpoint(e, dir.path, "a");
    auto s = snapshot(e);
    if (e.comm().rank() == 0) first = std::move(s);
  });
  Snapshot<float> second;  // what each attempted save holds
  on_two_ranks([&](E2& e, Mlp<float>& m) {
    train(e, m, 0, 3);
    auto s = snapshot(e);
    if (e.comm().rank() == 0) second = std::move(s);
  });
  int faults = 0;
  for (std::int64_t k = 1;; ++k) {
    const std::string tag = "b" + std::to_string(k);
    std::atomic<int> failed{0};
    on_two_ranks([&](E2& e, Mlp<float>& m) {
      train(e, m, 0, 3);
      e.comm().barrier();
      if (e.comm().rank() == 0) zp::detail::io_fault_countdown() = k;
      e.comm().barrier();
      try {
        zp::save_checkpoint(e, dir.path, tag);
      } catch (const zp::Error& err) {
        ++failed;
        CHECK(err.category() == zp::Errc::io);
      }
    });
    zp::detail::io_fault_countdown() = -1;
    CAPTURE(k);
    CHECK((failed == 0 || failed == 2));  // a fault on one rank is an error on every rank
    if (failed == 0) break;
    ++faults;
    // The previous checkpoint, or (a fault after the rename of `latest`, before the directory's
    // fsync) the complete new one.
    const std::string latest = zp::ckpt::Reader::read_latest(dir.path);
    CHECK((latest == "a" || latest == tag));
    on_two_ranks([&](E2& e, Mlp<float>&) {
      zp::load_checkpoint(e, dir.path);
      auto s = snapshot(e);
      if (e.comm().rank() == 0) check_same(latest == "a" ? first : second, s);
    });
    REQUIRE(k < 1000);
  }
  CHECK(faults >= 6);  // at least: the staging directory, two rank files' steps, the manifest, rename, latest
  CHECK(zp::ckpt::Reader::read_latest(dir.path) == "b" + std::to_string(faults + 1));
}

TEST_CASE("a corrupt, truncated, missing or foreign checkpoint is an error naming the file or parameter") {
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
      zp::test::expect_error(c, [&] { zp::load_checkpoint(e, dir.path, tag); }, needles);
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
    zp::test::expect_error(zp::Errc::invalid_argument, [&] { zp::load_checkpoint(e, dir.path, "good"); },
                           {"f32", "bf16"});
  });
  run_threads(2, [&](Collective<Threads>& comm) {
    Mlp<float> model;
    zp::Engine<Threads, float, 2, zp::optim::Sgd> e(comm, model, config(1));
    zp::test::expect_error(zp::Errc::invalid_argument, [&] { zp::load_checkpoint(e, dir.path, "good"); },
                           {"AdamW", "Sgd"});
  });

  // Saving: an existing tag, a bad tag, inside an accumulation window.
  on_two_ranks([&](E2& e, Mlp<float>&) {
    zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, "good"); }, {"good", "already exists"});
    zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, "a/b"); }, {"a/b"});
    const std::string mine = e.comm().rank() == 0 ? "x0" : "x1";
    zp::test::expect_invalid([&] { zp::save_checkpoint(e, dir.path, mine); }, {"different tags", "'" + mine + "'"});
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

TEST_CASE("safetensors export: from a live engine and offline from a checkpoint, split, and loaded back by name") {
  TempDir dir("export");
  Snapshot<zp::bf16> ref;
  std::vector<std::string> names;
  with_stage(3, [&]<int S>(std::integral_constant<int, S>) {
    run_threads(3, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      zp::Engine<Threads, zp::bf16, S> e(comm, model, config(1));
      train(e, model, 0, 2);
      zp::export_safetensors(e, dir.path / "live");
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
  zp::export_safetensors(ck, dir.path / "offline");
  zp::export_safetensors(ck, dir.path / "offline-master", {.master = true});
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
  CHECK(zp::safetensors::read_index(dir.path / "split" / "model.safetensors.index.json").weight_map.size() ==
        names.size());

  // Loaded back by name at another rank count and stage: T exports give the parameters (and
  // master = the parameters widened), fp32 exports the master (and parameters = it rounded).
  for (const char* d : {"split", "live-master"}) {
    run_threads(2, [&](Collective<Threads>& comm) {
      Mlp<zp::bf16> model;
      zp::Engine<Threads, zp::bf16, 1> e(comm, model, config(1));
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
    Mlp<zp::bf16> other({Mlp<zp::bf16>::inputs, 61, 60, 53, Mlp<zp::bf16>::classes});
    zp::Engine<Threads, zp::bf16, 1> e(comm, other, config(1));
    zp::test::expect_invalid([&] { zp::load_safetensors(e, dir.path / "live"); }, {"layer1.weight", "elements"});
  });
}
