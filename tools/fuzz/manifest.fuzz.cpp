// Fuzz target: a checkpoint's manifest, as a hostile one would be written: with its checksum
// recomputed, so that every check behind it meets the value. The target saves a small stage 3
// checkpoint of 2 ranks once; each input replaces its manifest, and the reader then opens it,
// reads every field of every parameter from the rank files and verifies a file. The custom
// mutator changes the JSON's values (numbers at the limits, array entries dropped, repeated or
// swapped, names, keys removed, a parameter's size and shape together) three times in four, of
// the input or of the saved manifest, bytes otherwise.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz.hpp"
#include "zp/backend/threads.hpp"
#include "zp/checkpoint.hpp"
#include "zp/engine.hpp"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// Three modules, four parameters of sizes that split unevenly over 2 ranks.
struct Net {
  zp::Param<float> a_w{40}, a_b{7}, b_w{24}, c_w{5};
  std::vector<float> init = std::vector<float>(76);
  Net() {
    for (std::size_t i = 0; i < init.size(); ++i) init[i] = float(i) / 64;
    float* p = init.data();
    for (zp::Param<float>* q : {&a_w, &a_b, &b_w, &c_w}) {
      q->value = zp::View<float>(p, q->value.size());
      p += q->value.size();
    }
  }
};
template <class Visit>
void for_each_parameter(Net& n, Visit&& visit) {
  visit("a.weight", 0, n.a_w);
  visit("a.bias", 0, n.a_b);
  visit("b.weight", 1, n.b_w);
  visit("c.weight", 2, n.c_w);
}

json saved;  // the manifest the target saved: a base for edits, as most inputs are refused

const fs::path& checkpoints() {
  static const fs::path dir = zp::fuzz::scratch() / "checkpoints";
  return dir;
}

void collect(json& j, std::vector<json*>& out) {
  out.push_back(&j);
  if (j.is_object())
    for (auto& [k, v] : j.items()) collect(v, out);
  else if (j.is_array())
    for (auto& v : j) collect(v, out);
}

}  // namespace

extern "C" std::size_t LLVMFuzzerMutate(std::uint8_t* data, std::size_t size, std::size_t max);

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fs::remove_all(checkpoints());
  zp::backend::run_threads(2, [](zp::Collective<zp::backend::Threads>& comm) {
    Net net;
    zp::Engine<zp::backend::Threads, float, 3> engine(
        comm, net, {.batch = {.micro_batch_per_rank = 1, .gradient_accumulation_steps = 1}},
        zp::optim::AdamW{});
    const std::byte user[3] = {std::byte(1), std::byte(2), std::byte(3)};
    zp::save_checkpoint(engine, checkpoints(), "t", user);
  });
  const std::string text =
      zp::detail::read_whole_file(checkpoints() / "t" / "manifest.json", 1 << 20);
  saved = json::parse(text);
  zp::fuzz::seed("manifest.json", text);
  return 0;
}

extern "C" std::size_t LLVMFuzzerCustomMutator(std::uint8_t* data, std::size_t size,
                                               std::size_t max, unsigned seed) {
  std::mt19937_64 rng(seed);
  const unsigned how = unsigned(rng() % 4);
  if (how == 0) return LLVMFuzzerMutate(data, size, max);
  json j = json::parse(std::string_view(reinterpret_cast<const char*>(data), size), nullptr, false);
  if (how == 1 || j.is_discarded()) j = saved;
  static const std::int64_t limits[] = {0,
                                        1,
                                        -1,
                                        2,
                                        3,
                                        15,
                                        16,
                                        17,
                                        255,
                                        65536,
                                        (1ll << 31) - 1,
                                        1ll << 31,
                                        1ll << 32,
                                        1ll << 48,
                                        (1ll << 48) + 1,
                                        1ll << 62,
                                        INT64_MAX,
                                        INT64_MIN};
  static const char* const strings[] = {"",
                                        "a",
                                        "..",
                                        "../x",
                                        "param",
                                        "master",
                                        "exp_avg",
                                        "f32",
                                        "bf16",
                                        "f16",
                                        "a.weight",
                                        "b.weight",
                                        "rank-00000-of-00002.safetensors"};
  for (int round = 0, rounds = 1 + int(rng() % 3); round < rounds; ++round) {
    std::vector<json*> nodes;
    collect(j, nodes);
    json& x = *nodes[rng() % nodes.size()];
    const std::size_t n = x.is_structured() ? x.size() : 0;
    switch (rng() % 9) {
      case 0: x = limits[rng() % std::size(limits)]; break;
      case 1:
        if (x.is_number_integer())
          x = std::int64_t(std::uint64_t(x.get<std::int64_t>()) + rng() % 5 - 2);
        break;
      case 2: x = strings[rng() % std::size(strings)]; break;
      case 3:
        if (x.is_array() && n) x.erase(rng() % n);
        break;
      case 4:
        if (x.is_array() && n) x.push_back(json(x[rng() % n]));
        break;
      case 5:
        if (x.is_array() && n > 1) std::swap(x[rng() % n], x[rng() % n]);
        break;
      case 6:
        if (x.is_object() && n) x.erase(std::next(x.begin(), long(rng() % n)));
        break;
      case 7: x = 0.5; break;
      case 8: {  // a parameter (or part) whose size and shape agree, at another size
        std::vector<json*> sized;
        for (json* y : nodes)
          if (y->is_object() && y->contains("size") && y->contains("shape")) sized.push_back(y);
        if (sized.empty()) break;
        json& y = *sized[rng() % sized.size()];
        const std::int64_t v = limits[rng() % std::size(limits)];
        y["size"] = v;
        y["shape"] = {v};
        break;
      }
    }
  }
  const std::string text = j.dump();
  if (text.size() > max) return size;
  std::memcpy(data, text.data(), text.size());
  return text.size();
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  json j;
  try {
    j = zp::detail::parse_json(std::string_view(reinterpret_cast<const char*>(data), size), "fuzz",
                               zp::Errc::io);
  } catch (const zp::Error&) {
    return 0;
  }
  if (j.is_object()) j["manifest_crc32c"] = zp::ckpt::manifest_crc32c(j);
  zp::fuzz::write_file(checkpoints() / "t" / "manifest.json", j.dump());
  zp::fuzz::refused_or_read([&] {
    zp::ckpt::Reader r(checkpoints(), "t");
    const auto& m = r.manifest();
    // Every field of every parameter, a chunk at a time through one buffer, as zp_ckpt's export
    // reads them: until verify() has checked the files, a size is only what the manifest says
    // its files hold (a hostile one claims exabytes), so no buffer is sized by it.
    constexpr std::size_t chunk = 64;  // elements, a few reads for this checkpoint's parameters
    std::vector<std::byte> buf(chunk * sizeof(float));
    for (std::size_t p = 0; p < m.params.size(); ++p)
      for (std::size_t f = 0; f < m.fields.size(); ++f)
        zp::fuzz::refused_or_read([&] {
          const std::size_t bytes = zp::size_of(m.field_dtype(f));
          for (std::size_t at = 0; at < m.params[p].size; at += chunk) {
            const std::size_t n = std::min(chunk, m.params[p].size - at);
            r.read_bytes(f, p, at, std::span<std::byte>(buf).first(n * bytes));
          }
        });
    zp::fuzz::refused_or_read([&] { (void)r.user_blob(); });
    (void)r.verify_file(0);
  });
  return 0;
}
