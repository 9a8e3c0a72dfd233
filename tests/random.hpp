// Test inputs: a counter-based hash (splitmix64's finaliser) so every rank can derive any
// element of any rank's input from (seed, index), and a fresh seed per run.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <source_location>
#include <vector>

namespace zp::test {

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from (seed, index).
inline float hash_uniform(std::uint64_t seed, std::uint64_t i) {
  const std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + i * 0xbf58476d1ce4e5b9ull;
  return float(
      double(mix(x + 0x94d049bb133111ebull - 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

// The seeds fresh_seed drew during the running test case, with their call sites: a failed test
// case prints them (seed_report.hpp, in the tests' mains).
struct DrawnSeed {
  std::source_location at;
  std::uint64_t seed;
};
struct DrawnSeeds {
  std::mutex m;
  std::vector<DrawnSeed> seeds;  // the first 32 of the test case
};
inline DrawnSeeds& drawn_seeds() {
  static DrawnSeeds d;
  return d;
}

// A new seed every call, or ZP_TEST_SEED's value to repeat a failing one.
inline std::uint64_t fresh_seed(std::source_location at = std::source_location::current()) {
  std::uint64_t v;
  if (const char* e = std::getenv("ZP_TEST_SEED")) {
    v = std::strtoull(e, nullptr, 10);
  } else {
    std::random_device rd;
    v = (std::uint64_t(rd()) << 32) | rd();
  }
  DrawnSeeds& d = drawn_seeds();
  std::lock_guard lk(d.m);
  if (d.seeds.size() < 32) d.seeds.push_back({at, v});
  return v;
}

// A drawn seed this process replaced by another's (an MPI test takes rank 0's draw): the report
// names the one that repeats the run.
inline void redrawn(std::uint64_t drawn, std::uint64_t used) {
  DrawnSeeds& d = drawn_seeds();
  std::lock_guard lk(d.m);
  for (DrawnSeed& x : d.seeds)
    if (x.seed == drawn) x.seed = used;
}

// The seed of this test program's run (fresh_seed), printed once with how to repeat the run.
inline std::uint64_t run_seed(const char* program) {
  static const std::uint64_t s = [program] {
    const std::uint64_t v = fresh_seed();
    std::printf("%s: seed %llu (ZP_TEST_SEED=%llu repeats this run)\n", program,
                (unsigned long long)v, (unsigned long long)v);
    return v;
  }();
  return s;
}

}  // namespace zp::test
