// zp/tensor_parallel.hpp: split ranges tile a dimension; the vocabulary-parallel embedding and
// cross-entropy on 1-4 thread ranks equal a float64 computation over the whole vocabulary, on
// fresh random inputs, with splits that do not divide evenly.
#include "zp/tensor_parallel.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "expect_error.hpp"
#include "random.hpp"
#include "zp/backend/threads.hpp"

using zp::Collective;
using zp::backend::Threads;
using zp::tp::Range;

namespace {

std::uint64_t seed() { return zp::test::run_seed("tensor_parallel.test"); }

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

TEST_CASE("vocabulary-parallel embedding and cross-entropy equal the whole-vocabulary float64 computation") {
  const int V = 11, d = 5, rows = 7;
  const float scale = 4.0f;
  // The whole problem, from the seed: table [V, d], logits [rows, V], tokens and targets.
  std::vector<double> table(V * d), logits(rows * V);
  std::vector<int> tokens(rows), targets(rows);
  for (int i = 0; i < V * d; ++i) table[std::size_t(i)] = zp::test::hash_uniform(seed(), std::uint64_t(i));
  for (int i = 0; i < rows * V; ++i) logits[std::size_t(i)] = 8.0 * zp::test::hash_uniform(seed() + 1, std::uint64_t(i));
  for (int r = 0; r < rows; ++r) {
    tokens[std::size_t(r)] = int(zp::test::mix(seed() + 2 + std::uint64_t(r)) % V);
    targets[std::size_t(r)] = int(zp::test::mix(seed() + 3 + std::uint64_t(r)) % V);
  }
  // float64 reference: the loss, its gradient, and the embedding's output and table gradient
  // for an output gradient g[r][k] = r + k.
  double loss = 0;
  std::vector<double> dlogits(rows * V), emb(rows * d), dtable(V * d, 0.0);
  for (int r = 0; r < rows; ++r) {
    const double* z = &logits[std::size_t(r * V)];
    double mx = z[0], se = 0;
    for (int v = 1; v < V; ++v) mx = std::max(mx, z[v]);
    for (int v = 0; v < V; ++v) se += std::exp(z[v] - mx);
    loss += (std::log(se) + mx - z[targets[std::size_t(r)]]) / rows;
    for (int v = 0; v < V; ++v)
      dlogits[std::size_t(r * V + v)] = (std::exp(z[v] - mx) / se - (v == targets[std::size_t(r)])) * scale / rows;
    for (int k = 0; k < d; ++k) {
      emb[std::size_t(r * d + k)] = table[std::size_t(tokens[std::size_t(r)] * d + k)];
      dtable[std::size_t(tokens[std::size_t(r)] * d + k)] += r + k;
    }
  }
  for (int P = 1; P <= 4; ++P) {
    CAPTURE(P);
    zp::backend::run_threads(P, [&](Collective<Threads>& comm) {
      const zp::tp::Group<float> g(comm);
      const Range vocab = zp::tp::split(V, P, g.rank());
      const std::size_t n = vocab.size();
      // This rank's rows of the table and columns of the logits.
      std::vector<float> w(n * d), z(rows * n), dz(rows * n, -1.0f), out(rows * d, -1.0f), dw(n * d, 0.0f),
          gout(rows * d);
      for (std::size_t v = 0; v < n; ++v)
        for (int k = 0; k < d; ++k) w[v * d + std::size_t(k)] = float(table[(vocab.begin + v) * d + std::size_t(k)]);
      for (int r = 0; r < rows; ++r)
        for (std::size_t v = 0; v < n; ++v) z[std::size_t(r) * n + v] = float(logits[std::size_t(r * V) + vocab.begin + v]);
      for (int r = 0; r < rows; ++r)
        for (int k = 0; k < d; ++k) gout[std::size_t(r * d + k)] = float(r + k);

      const float l = zp::tp::cross_entropy(g, vocab, std::span<const float>(z), std::span<const int>(targets),
                                            std::span<float>(dz), scale);
      CHECK(l == doctest::Approx(loss).epsilon(1e-6));
      for (int r = 0; r < rows; ++r)
        for (std::size_t v = 0; v < n; ++v)
          CHECK(dz[std::size_t(r) * n + v] ==
                doctest::Approx(dlogits[std::size_t(r * V) + vocab.begin + v]).epsilon(1e-5).scale(1e-6));
      zp::tp::embedding_forward(g, vocab, std::span<const float>(w), std::span<const int>(tokens), d, std::span<float>(out));
      for (int i = 0; i < rows * d; ++i) CHECK(out[std::size_t(i)] == float(emb[std::size_t(i)]));  // one nonzero term: exact
      zp::tp::embedding_backward(vocab, std::span<float>(dw), std::span<const int>(tokens), d, std::span<const float>(gout));
      for (std::size_t v = 0; v < n; ++v)
        for (int k = 0; k < d; ++k) CHECK(dw[v * d + std::size_t(k)] == float(dtable[(vocab.begin + v) * d + std::size_t(k)]));
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
      [&] { zp::tp::embedding_forward(one, {0, 3}, std::span<const float>(w), std::span<const int>(tok), 3, std::span<float>(out)); },
      {"out 4", "2 tokens x 3"});
  zp::test::expect_invalid(
      [&] { (void)zp::tp::cross_entropy(one, {0, 3}, std::span<const float>(z), std::span<const int>(tok), std::span<float>(dz), 1.0f); },
      {"dlogits 5", "2 rows x 3"});
}
