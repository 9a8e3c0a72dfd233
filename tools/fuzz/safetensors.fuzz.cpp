// Fuzz target: zp::safetensors::Reader over arbitrary files, each tensor's first and last 4 KiB
// read too, so every range the header declares is checked against the file; and an input that
// starts with '{' as a split model's index (read_index).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz.hpp"
#include "zp/safetensors.hpp"

namespace st = zp::safetensors;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const auto p = zp::fuzz::scratch() / "seed.safetensors";
  st::Writer w(p,
               {{"a.weight", "F32", {2, 3}},
                {"a.bias", "BF16", {4}},
                {"scale", "F64", {}},
                {"ids", "I64", {2}},
                {"empty", "F16", {0, 5}}},
               {{"format", "pt"}});
  std::vector<std::byte> data(w.tensors().back().end);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::byte(i * 37);
  w.write(data);
  w.commit();
  zp::fuzz::seed("seed.safetensors", zp::detail::read_whole_file(p, 1 << 20));
  zp::fuzz::seed("index.json", R"({"metadata": {"total_size": 44},
    "weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b": "x.safetensors"}})");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (bytes.starts_with('{')) {
    const auto index = zp::fuzz::scratch() / "input.index.json";
    zp::fuzz::write_file(index, bytes);
    zp::fuzz::refused_or_read([&] { (void)st::read_index(index); });
    return 0;
  }
  const auto p = zp::fuzz::scratch() / "input.safetensors";
  zp::fuzz::write_file(p, bytes);
  zp::fuzz::refused_or_read([&] {
    const st::Reader r(p);
    std::vector<std::byte> buf(4096);
    for (const auto& t : r.tensors()) {
      const std::size_t n = std::size_t(std::min<std::uint64_t>(buf.size(), t.bytes()));
      r.read(t.name, 0, std::span(buf).first(n));
      r.read(t.name, t.bytes() - n, std::span(buf).first(n));
    }
  });
  return 0;
}
