#include "zp/bucket.hpp"

#include <doctest/doctest.h>

#include <vector>

#include "zp/backend/threads.hpp"
#include "zero_mlp.hpp"

using zp::Collective;
using zp::GradBuckets;
using zp::Layout;
using zp::Reduction;
using zp::backend::run_threads;
using zp::backend::Threads;

namespace {

Layout test_layout(int ranks) {
  std::vector<zp::ParamInfo> ps = {
      {"a", 0, 37}, {"b", 0, 5}, {"c", 1, 100}, {"d", 1, 3}, {"e", 2, 11}};
  return Layout(ps, ranks, {.bucket_elems = 64, .first_bucket_elems = 8, .align = 2});
}

// Rank r's gradient of element i: small integers, so sums and averages over 1-4 ranks are exact.
float grad(int r, std::size_t i) { return float((int(i) * 7 + r * 3) % 11) * 0.25f; }

}  // namespace

TEST_CASE("each reduction leaves the rank-averaged gradient where its stage reads it") {
  for (int ranks : {1, 2, 3, 4})
    for (Reduction red :
         {Reduction::all_reduce, Reduction::scatter_in_place, Reduction::scatter_accumulate}) {
      CAPTURE(ranks);
      run_threads(ranks, [&](Collective<Threads>& comm) {
        const int n = comm.size(), r = comm.rank();
        const Layout L = test_layout(n);
        std::vector<float> full(L.total(), 0.0f), acc(L.shard(), -1.0f);
        GradBuckets<float, Threads> buckets(
            comm, L, red,
            red == Reduction::scatter_accumulate ? std::span<float>{} : std::span<float>(full),
            std::span<float>(acc), 2);
        const int micros = red == Reduction::scatter_accumulate ? 2 : 1;
        for (int micro = 0; micro < micros; ++micro) {
          buckets.begin_micro_step(true, micro == 0);
          // backward order, in reverse within the micro-step to exercise in-order launching
          for (int s = buckets.count() - 1; s >= 0; --s) {
            if (red == Reduction::scatter_accumulate && s < buckets.count() - 2) break;
            auto mem = buckets.acquire(s);
            for (std::size_t i = 0; i < L.segment(s).used; ++i)
              mem[i] += grad(r, L.segment(s).offset + i);
            buckets.ready(s);
          }
          buckets
              .launch_all();  // the rest: their memory is written here, zeros for scratch buckets
          buckets.finish();
        }
        for (int s = 0; s < L.segment_count(); ++s) {
          const auto& g = L.segment(s);
          for (std::size_t i = 0; i < g.piece; ++i) {
            const std::size_t at = L.piece_offset(s, r) + i;
            float want = 0;
            const bool written = at - g.offset < g.used;
            for (int q = 0; q < n; ++q) want += written ? grad(q, at) : 0.0f;
            want /= float(n);
            if (red == Reduction::scatter_accumulate) {
              const bool touched = s >= L.segment_count() - 2;
              CHECK(acc[g.shard_offset + i] == (touched ? 2 * want : 0.0f));
            } else {
              CHECK(full[at] == want);  // this rank's piece of the full buffer
            }
          }
        }
      });
    }
}

TEST_CASE("buckets launch in bucket order on every rank whatever order they become ready in") {
  run_threads(3, [&](Collective<Threads>& comm) {
    const Layout L = test_layout(3);
    std::vector<float> full(L.total(), 0.0f);
    GradBuckets<float, Threads> buckets(comm, L, Reduction::all_reduce, full, {}, 0);
    buckets.begin_micro_step(true, true);
    const int n = buckets.count();
    // rank-dependent readiness order: the threads backend would report mismatched calls (different
    // counts) if launches followed readiness
    std::vector<int> order;
    for (int s = 0; s < n; ++s) order.push_back((s + comm.rank()) % n);
    for (int s : order) {
      auto mem = buckets.acquire(s);
      for (auto& x : mem) x = 1.0f;
      buckets.ready(s);
    }
    buckets.finish();
    for (float x : full) CHECK(x == 1.0f);
  });
}

TEST_CASE("without sync (stage 0/1 between boundaries) nothing is communicated") {
  run_threads(2, [&](Collective<Threads>& comm) {
    const Layout L = test_layout(2);
    std::vector<float> full(L.total(), 0.0f);
    GradBuckets<float, Threads> buckets(comm, L, Reduction::scatter_in_place, full, {}, 0);
    buckets.begin_micro_step(false, true);
    for (int s = 0; s < buckets.count(); ++s) buckets.ready(s);
    buckets.launch_all();
    buckets.finish();
    CHECK(comm.stats().total().calls == 0);
    CHECK(buckets.scratch_bytes() == 0);
  });
}
