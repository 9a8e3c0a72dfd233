// tools/fuzz/fuzz.hpp: what the fuzz targets share (tools/fuzz.sh builds and runs them). Each
// target feeds its input to one of zp's readers of untrusted bytes, which must accept it or
// throw zp::Error, never crash, hang, leak or read out of bounds (ASan and UBSan watch).
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string_view>

#include "zp/error.hpp"

namespace zp::fuzz {

// Where a target keeps its files: $ZP_FUZZ_SCRATCH (tools/fuzz.sh: under build/fuzz), made once.
inline const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = [] {
    const char* s = std::getenv("ZP_FUZZ_SCRATCH");
    std::filesystem::path p = s && *s ? s : std::filesystem::temp_directory_path() / "zp_fuzz";
    std::filesystem::create_directories(p);
    return p;
  }();
  return dir;
}

// A plain write: an input a run, so not detail::write_file_atomic's fsync and rename.
inline void write_file(const std::filesystem::path& p, std::string_view bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), std::streamsize(bytes.size()));
}

// Seeds the corpus: writes `bytes` as $ZP_FUZZ_SEEDS/<name> when tools/fuzz.sh asks for seeds.
inline void seed(const char* name, std::string_view bytes) {
  if (const char* d = std::getenv("ZP_FUZZ_SEEDS"); d && *d)
    write_file(std::filesystem::path(d) / name, bytes);
}

// Runs f; a zp::Error is a refusal, the outcome every malformed input must have.
template <class F>
void refused_or_read(F&& f) {
  try {
    f();
  } catch (const zp::Error&) {
  }
}

}  // namespace zp::fuzz
