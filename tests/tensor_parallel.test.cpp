// zp/tensor_parallel.hpp: split ranges tile a dimension; the vocabulary-parallel embedding and
// cross-entropy on 1-4 thread ranks equal a float64 computation over the whole vocabulary, on
// fresh random inputs, with splits that do not divide evenly.
#include "zp/tensor_parallel.hpp"

#include <doctest/doctest.h>

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "zp/backend/threads.hpp"

using zp::Collective;
using zp::backend::Threads;
using zp::tp::Range;

namespace {

std::uint64_t seed() { return zp::test::run_seed("tensor_parallel.test"); }

// Logits in [-a, a) as float holds them, so the reference measures the computation, not the input's rounding.
std::vector<double> float_logits(int n, double a, std::uint64_t stream) {
  std::vector<double> z(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    z[std::size_t(i)] = float(a * zp::test::hash_uniform(stream, std::uint64_t(i)));
  return z;
}

// float64 cross-entropy over [rows, V] logits, the mean over the rows whose target is not
// ignore_index, with the bound on float's error for each gradient entry.
struct CrossEntropy {
  int kept = 0;  // rows whose target is not ignore_index
  double loss = 0;
  std::vector<double> dlogits, bound;
};

CrossEntropy reference_cross_entropy(const std::vector<double>& logits, int V,
                                     const std::vector<int>& targets, double scale) {
  const int rows = int(targets.size());
  CrossEntropy ce{0, 0, std::vector<double>(std::size_t(rows * V), 0.0),
                  std::vector<double>(std::size_t(rows * V), 0.0)};
  for (int t : targets) ce.kept += t != zp::tp::ignore_index;
  const int kept = ce.kept;
  for (int r = 0; r < rows; ++r) {
    const int t = targets[std::size_t(r)];
    if (t == zp::tp::ignore_index) continue;
    const double* z = &logits[std::size_t(r * V)];
    double mx = z[0], se = 0;
    for (int v = 1; v < V; ++v) mx = std::max(mx, z[v]);
    for (int v = 0; v < V; ++v) se += std::exp(z[v] - mx);
    ce.loss += (std::log(se) + mx - z[t]) / kept;
    for (int v = 0; v < V; ++v) {
      const double p = std::exp(z[v] - mx) / se, target = v == t;
      ce.dlogits[std::size_t(r * V + v)] = (p - target) * scale / kept;
      // In float, exp of z - max (|z - max| <= 16 here) and a sum of V terms leave p a relative
      // error under (17 + V + 2) eps < 64 eps; p - 1 at the target keeps p's absolute error.
      ce.bound[std::size_t(r * V + v)] = 64 * FLT_EPSILON * (p + target) * scale / kept;
    }
  }
  return ce;
}

}  // namespace

TEST_CASE("tp::split cuts n into parts contiguous ranges that differ by at most one") {
  for (std::size_t n : {0u, 1u, 5u, 13u, 64u, 1000u})
    for (int parts = 1; parts <= 7; ++parts) {
      std::size_t next = 0, lo = n, hi = 0;
      for (int i = 0; i < parts; ++i) {
        const Range r = zp::tp::split(n, parts, i);
        CHECK(r.begin == next);
        next = r.end;
        lo = std::min(lo, r.size());
        hi = std::max(hi, r.size());
      }
      CHECK(next == n);
      CHECK(hi - lo <= 1);
    }
  zp::test::expect_invalid([] { (void)zp::tp::split(10, 3, 3); }, {"part 3 of 3"});
  zp::test::expect_invalid([] { (void)zp::tp::split(10, 0, 0); }, {"of 0"});
}

TEST_CASE(
    "vocabulary-parallel embedding and cross-entropy equal the whole-vocabulary float64 "
    "computation") {
  const int V = 11, d = 5, rows = 7;
  const float scale = 4.0f;
  // The whole problem, from the seed: table [V, d], logits [rows, V], tokens and targets.
  std::vector<double> table(V * d);
  std::vector<int> tokens(rows), targets(rows);
  for (int i = 0; i < V * d; ++i)
    table[std::size_t(i)] = zp::test::hash_uniform(seed(), std::uint64_t(i));
  const std::vector<double> logits = float_logits(rows * V, 8.0, seed() + 1);
  for (int r = 0; r < rows; ++r) {
    tokens[std::size_t(r)] = int(zp::test::mix(seed() + 2 + std::uint64_t(r)) % V);
    targets[std::size_t(r)] = int(zp::test::mix(seed() + 3 + std::uint64_t(r)) % V);
  }
  // float64 reference: the loss and its gradient; the embedding's output and table gradient for
  // an output gradient g[r][k] = r + k.
  const CrossEntropy ce = reference_cross_entropy(logits, V, targets, scale);
  std::vector<double> emb(rows * d), dtable(V * d, 0.0);
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < d; ++k) {
      emb[std::size_t(r * d + k)] = table[std::size_t(tokens[std::size_t(r)] * d + k)];
      dtable[std::size_t(tokens[std::size_t(r)] * d + k)] += r + k;
    }
  for (int P = 1; P <= 4; ++P) {
    CAPTURE(P);
    zp::backend::run_threads(P, [&](Collective<Threads>& comm) {
      const zp::tp::Group<float> g(comm);
      const Range vocab = zp::tp::split(V, P, g.rank());
      const std::size_t n = vocab.size();
      // This rank's rows of the table and columns of the logits.
      std::vector<float> w(n * d), z(rows * n), dz(rows * n, -1.0f), out(rows * d, -1.0f),
          dw(n * d, 0.0f), gout(rows * d);
      for (std::size_t v = 0; v < n; ++v)
        for (int k = 0; k < d; ++k)
          w[v * d + std::size_t(k)] = float(table[(vocab.begin + v) * d + std::size_t(k)]);
      for (int r = 0; r < rows; ++r)
        for (std::size_t v = 0; v < n; ++v)
          z[std::size_t(r) * n + v] = float(logits[std::size_t(r * V) + vocab.begin + v]);
      for (int r = 0; r < rows; ++r)
        for (int k = 0; k < d; ++k) gout[std::size_t(r * d + k)] = float(r + k);

      const float l =
          zp::tp::cross_entropy(g, vocab, V, std::span<const float>(z),
                                std::span<const int>(targets), std::span<float>(dz), scale);
      CHECK(l == doctest::Approx(ce.loss).epsilon(64 * FLT_EPSILON));
      for (int r = 0; r < rows; ++r)
        for (std::size_t v = 0; v < n; ++v) {
          const std::size_t i = std::size_t(r * V) + vocab.begin + v;
          CAPTURE(i);
          CHECK(std::abs(dz[std::size_t(r) * n + v] - ce.dlogits[i]) <= ce.bound[i]);
        }
      zp::tp::embedding_forward(g, vocab, V, std::span<const float>(w),
                                std::span<const int>(tokens), d, std::span<float>(out));
      for (int i = 0; i < rows * d; ++i)
        CHECK(out[std::size_t(i)] == float(emb[std::size_t(i)]));  // one nonzero term: exact
      zp::tp::embedding_backward(vocab, V, std::span<float>(dw), std::span<const int>(tokens), d,
                                 std::span<const float>(gout));
      for (std::size_t v = 0; v < n; ++v)
        for (int k = 0; k < d; ++k)
          CHECK(dw[v * d + std::size_t(k)] ==
                float(dtable[(vocab.begin + v) * d + std::size_t(k)]));
      // Counters: two all_reduces for the loss (rows, 2 rows), one for the embedding (rows x d).
      const auto& s = comm.stats()[zp::CollOp::all_reduce];
      CHECK(s.calls == (P > 1 ? 3u : 0u));
      CHECK(s.bytes == (P > 1 ? (3 * rows + rows * d) * sizeof(float) : 0u));
    });
  }
}

TEST_CASE("tp functions name the sizes they expected") {
  const zp::tp::Group<float> one;
  std::vector<float> w(6), out(4), z(6), dz(5);
  std::vector<int> tok(2);
  zp::test::expect_invalid(
      [&] {
        zp::tp::embedding_forward(one, {0, 3}, 3, std::span<const float>(w),
                                  std::span<const int>(tok), 3, std::span<float>(out));
      },
      {"out 4", "2 tokens x 3"});
  zp::test::expect_invalid(
      [&] {
        (void)zp::tp::cross_entropy(one, {0, 3}, 3, std::span<const float>(z),
                                    std::span<const int>(tok), std::span<float>(dz), 1.0f);
      },
      {"dlogits 5", "2 rows x 3"});
}

TEST_CASE(
    "cross-entropy leaves out targets equal to tp::ignore_index: the mean is over the other rows") {
  static_assert(zp::tp::ignore_index == -100);  // PyTorch's default
  const int V = 7, rows = 9;
  const float scale = 2.0f;
  const std::vector<double> logits = float_logits(rows * V, 6.0, seed() + 5);
  // Some rows ignored; all of them (loss 0, no gradient); and no rows at all.
  std::vector<std::vector<int>> cases = {std::vector<int>(rows), std::vector<int>(rows, -100), {}};
  for (int r = 0; r < rows; ++r)
    cases[0][std::size_t(r)] =
        r % 3 == 1 ? -100 : int(zp::test::mix(seed() + 6 + std::uint64_t(r)) % V);
  for (const std::vector<int>& targets : cases) {
    const int n_rows = int(targets.size());
    const CrossEntropy ce = reference_cross_entropy(logits, V, targets, scale);
    const int kept = ce.kept;
    CAPTURE(n_rows);
    CAPTURE(kept);
    for (int P = 1; P <= 3; ++P) {
      CAPTURE(P);
      zp::backend::run_threads(P, [&](Collective<Threads>& comm) {
        const zp::tp::Group<float> g(comm);
        const Range vocab = zp::tp::split(V, P, g.rank());
        const std::size_t n = vocab.size();
        std::vector<float> z(std::size_t(n_rows) * n), dz(z.size(), -1.0f);
        for (int r = 0; r < n_rows; ++r)
          for (std::size_t v = 0; v < n; ++v)
            z[std::size_t(r) * n + v] = float(logits[std::size_t(r * V) + vocab.begin + v]);
        const float l =
            zp::tp::cross_entropy(g, vocab, V, std::span<const float>(z),
                                  std::span<const int>(targets), std::span<float>(dz), scale);
        CHECK(l == doctest::Approx(ce.loss).epsilon(64 * FLT_EPSILON));
        if (kept == 0) CHECK(l == 0.0f);
        for (int r = 0; r < n_rows; ++r)
          for (std::size_t v = 0; v < n; ++v) {
            const std::size_t i = std::size_t(r * V) + vocab.begin + v;
            CAPTURE(i);
            CHECK(std::abs(dz[std::size_t(r) * n + v] - ce.dlogits[i]) <= ce.bound[i]);
          }
      });
    }
  }
}

TEST_CASE(
    "a token or target outside the vocabulary is an error on every rank naming it, its position "
    "and V") {
  // The indices are replicated over the group, so every rank throws the same error before any
  // all_reduce; the group then still works (no rank was left inside a collective).
  const int V = 11, rows = 6, d = 3;
  zp::backend::run_threads(3, [&](Collective<Threads>& comm) {
    const zp::tp::Group<float> g(comm);
    const Range vocab = zp::tp::split(V, comm.size(), comm.rank());
    const std::size_t n = vocab.size();
    std::vector<float> w(n * d), out(rows * d), z(rows * n), dz(rows * n);
    for (const int bad : {V, -1, -100, 1 << 30}) {
      CAPTURE(bad);
      const std::vector<int> targets = {0, 5, -100, 10, bad, 1}, tokens = {0, 5, 3, 10, bad, 1};
      const std::string where =
          zp::detail::cat(bad, " at position 4 is outside the vocabulary [0, 11)");
      if (bad != -100)  // for a target, the ignore index
        zp::test::expect_invalid(
            [&] {
              (void)zp::tp::cross_entropy(g, vocab, V, std::span<const float>(z),
                                          std::span<const int>(targets), std::span<float>(dz),
                                          1.0f);
            },
            {"tp::cross_entropy: target " + where, "not ignore_index (-100)"});
      zp::test::expect_invalid(
          [&] {
            zp::tp::embedding_forward(g, vocab, V, std::span<const float>(w),
                                      std::span<const int>(tokens), d, std::span<float>(out));
          },
          {"tp::embedding_forward: token " + where});
      zp::test::expect_invalid(
          [&] {
            zp::tp::embedding_backward(vocab, V, std::span<float>(w), std::span<const int>(tokens),
                                       d, std::span<const float>(out));
          },
          {"tp::embedding_backward: token " + where});
      float x = 1.0f;
      g.all_reduce(std::span<float>(&x, 1));
      CHECK(x == 3.0f);
    }
    // This rank's part must lie inside the vocabulary.
    zp::test::expect_invalid(
        [&] {
          (void)zp::tp::cross_entropy(g, {0, 12}, V, std::span<const float>(z),
                                      std::span<const int>(), std::span<float>(dz), 1.0f);
        },
        {"vocabulary part [0, 12)", "[0, 11)"});
  });
}
