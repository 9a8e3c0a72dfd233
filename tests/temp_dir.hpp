// tests/temp_dir.hpp: a fresh directory per test, removed with its contents at the end.
#pragma once

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

namespace zp::test {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name = "test") {
    static std::atomic<int> n{0};
    path = std::filesystem::temp_directory_path() /
           ("zp-" + name + "-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  TempDir(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  // The names in the directory (unordered).
  std::vector<std::string> entries() const {
    std::vector<std::string> r;
    for (const auto& e : std::filesystem::directory_iterator(path))
      r.push_back(e.path().filename().string());
    return r;
  }
};

}  // namespace zp::test
