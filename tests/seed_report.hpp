// A doctest listener for the tests' mains: a failed test case prints the seeds fresh_seed drew
// in it (random.hpp), each with its call site and the command line that repeats it.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <mutex>

#include "random.hpp"

namespace zp::test {

struct SeedReport : doctest::IReporter {
  explicit SeedReport(const doctest::ContextOptions&) {}
  void test_case_start(const doctest::TestCaseData& t) override {
    name = t.m_name;
    DrawnSeeds& d = drawn_seeds();
    std::lock_guard lk(d.m);
    d.seeds.clear();
  }
  void test_case_end(const doctest::CurrentTestCaseStats& s) override {
    if (s.testCaseSuccess) return;
    DrawnSeeds& d = drawn_seeds();
    std::lock_guard lk(d.m);
    for (const DrawnSeed& x : d.seeds)
      std::printf(
          "seed drawn at %s:%u: %llu (ZP_TEST_SEED=%llu <program> --test-case=\"%s\" "
          "repeats it)\n",
          x.at.file_name(), unsigned(x.at.line()), (unsigned long long)x.seed,
          (unsigned long long)x.seed, name);
    std::fflush(stdout);
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}

  const char* name = "";
};

}  // namespace zp::test

REGISTER_LISTENER("seeds", 1, zp::test::SeedReport);
