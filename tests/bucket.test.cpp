#include "zp/bucket.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "random.hpp"
#include "zp/backend/threads.hpp"
#include "zp/step_gate.hpp"
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

// qgZ: the buckets' two-hop reductions run two at a time, their hops started at later buckets'
// launches. Each bucket must still come out bitwise as the blocking two-hop reduction of its own
// gradients (quant::reduce_scatter, then the average), in every node layout of 4 ranks, with the
// buckets launched one by one (ready in bucket order) or all at once (ready in reverse).
TEST_CASE("quantized buckets (qgZ) in flight together each equal the blocking reduction") {
  const zp::quant::Format f{.bits = zp::quant::Bits::int8, .block = 4};
  const std::uint64_t seed = zp::test::fresh_seed();
  for (int h : {1, 2, 4})
    for (bool in_order : {true, false}) {
      CAPTURE(h);
      CAPTURE(in_order);
      run_threads(4, [&](Collective<Threads>& comm) {
        const int n = comm.size(), r = comm.rank();
        auto node = comm.split(r / h, r % h);
        auto peers = comm.split(r % h, r / h);
        const Layout L = test_layout(n);
        REQUIRE(L.segment_count() >= 4);  // more buckets than run at once
        std::vector<float> acc(L.shard(), std::numeric_limits<float>::quiet_NaN());
        GradBuckets<float, Threads> buckets(comm, L, Reduction::scatter_accumulate, {},
                                            std::span<float>(acc), L.segment_count());
        buckets.quantize_gradients(node, peers, f);
        std::vector<std::vector<float>> grads;  // this rank's, by segment (zero past `used`)
        for (int s = 0; s < L.segment_count(); ++s) {
          std::mt19937_64 rng(seed + std::uint64_t(r * 100 + s));
          std::normal_distribution<float> normal(0.0f, 1.0f);
          grads.emplace_back(L.segment(s).size, 0.0f);
          for (std::size_t i = 0; i < L.segment(s).used; ++i) grads.back()[i] = normal(rng);
        }
        buckets.begin_micro_step(true, true);
        for (int k = 0; k < L.segment_count(); ++k) {
          const int s = in_order ? k : L.segment_count() - 1 - k;
          auto mem = buckets.acquire(s);
          std::copy(grads[std::size_t(s)].begin(), grads[std::size_t(s)].end(), mem.begin());
          buckets.ready(s);
        }
        buckets.finish();
        for (int s = 0; s < L.segment_count(); ++s) {
          const auto& g = L.segment(s);
          std::vector<float> want(g.piece);
          zp::quant::reduce_scatter(node, peers, std::span<const float>(grads[std::size_t(s)]),
                                    std::span(want), f);
          for (float& x : want) x /= float(n);
          CAPTURE(s);
          CHECK(std::memcmp(acc.data() + g.shard_offset, want.data(), g.piece * sizeof(float)) ==
                0);
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

// Buckets made ready out of launch order wait (and take scratch slots past bucket_slots); once
// the ranks follow the order the last micro-step made them ready in, each launches as it becomes
// ready, within bucket_slots. The ranks follow an order only where every one proposed it: one
// rank's different order keeps all of them in theirs. The reductions are the same either way.
TEST_CASE("buckets follow the readiness order every rank proposed") {
  run_threads(3, [&](Collective<Threads>& comm) {
    const int n = comm.size(), r = comm.rank();
    const Layout L = test_layout(n);
    std::vector<float> acc(L.shard(), -1.0f);
    GradBuckets<float, Threads> buckets(comm, L, Reduction::scatter_accumulate, {},
                                        std::span<float>(acc), 2);
    const std::size_t kept = buckets.scratch_bytes();
    const int count = buckets.count();
    REQUIRE(count >= 4);
    REQUIRE(kept < std::size_t(count) * L.largest_segment() * sizeof(float));
    std::vector<int> backward;  // the readiness order: the launch order backwards
    for (int s = count - 1; s >= 0; --s) backward.push_back(s);
    const auto launched = [&] { return comm.stats()[zp::CollOp::reduce_scatter].calls; };
    // A micro-step readying the buckets in `order`; the launches after each ready().
    const auto micro_step = [&](std::span<const int> order, bool first) {
      std::vector<std::uint64_t> launches;
      const auto before = launched();
      buckets.begin_micro_step(true, first);
      for (int s : order) {
        auto mem = buckets.acquire(s);
        for (std::size_t i = 0; i < L.segment(s).used; ++i)
          mem[i] += grad(r, L.segment(s).offset + i);
        buckets.ready(s);
        launches.push_back(launched() - before);
      }
      CHECK(buckets.scratch_bytes() >= kept);
      buckets.launch_all();
      buckets.finish();
      CHECK(std::ranges::equal(buckets.proposal(), order));
      return launches;
    };
    // Whether every rank proposed the same order, as the engine's step statistics compare them.
    const auto agreed = [&] {
      zp::StepStatistics<zp::MemorySpace::host> stats;
      stats.begin(0, false, buckets.proposal_fingerprint());
      comm.all_reduce(stats.sums(), zp::ReduceOp::sum);
      return stats.same_order(stats.read(), double(n));
    };
    // In the launch order: nothing launches before the last ready() (bucket 0), and the waiting
    // buckets hold a slot each.
    auto launches = micro_step(backward, true);
    CHECK(std::count(launches.begin(), launches.end(), 0u) == count - 1);
    CHECK(buckets.scratch_bytes() == std::size_t(count) * L.largest_segment() * sizeof(float));
    // Rank 2 proposes another order (two buckets swapped): no rank follows any.
    std::vector<int> other = backward;
    std::swap(other[0], other[1]);
    micro_step(r == 2 ? other : backward, false);
    CHECK(!agreed());
    launches = micro_step(backward, false);
    CHECK(launches.back() == std::uint64_t(count));
    CHECK(launches[std::size_t(count) - 2] == 0u);
    // Every rank proposes `backward`: followed, each bucket launches at its ready(), the slots
    // allocated past bucket_slots freed, and none allocated again.
    REQUIRE(agreed());
    buckets.follow_proposal();
    CHECK(buckets.scratch_bytes() == kept);
    launches = micro_step(backward, false);
    for (int k = 0; k < count; ++k) CHECK(launches[std::size_t(k)] == std::uint64_t(k + 1));
    CHECK(buckets.scratch_bytes() == kept);
    // Four micro-steps accumulated: the ranks' average (summed in rank order, divided once)
    // added up four times, wherever the buckets launched.
    for (int s = 0; s < L.segment_count(); ++s) {
      const auto& g = L.segment(s);
      for (std::size_t i = 0; i < g.piece; ++i) {
        const std::size_t at = L.piece_offset(s, r) + i;
        float sum = 0;
        for (int q = 0; q < n; ++q) sum += at - g.offset < g.used ? grad(q, at) : 0.0f;
        const float avg = sum / float(n);
        float want = avg;
        for (int k = 1; k < 4; ++k) want += avg;
        CHECK(acc[g.shard_offset + i] == want);
      }
    }
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
