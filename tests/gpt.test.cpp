// examples/gpt.hpp: the transformer's hand-written backward against finite differences, its
// causal mask, and the loss of an untrained model.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "expect_error.hpp"
#include "gpt.hpp"
#include "gpt_matmul_by_row.hpp"
#include "random.hpp"
#include "zp/dtype.hpp"

namespace {

// vocab 11, d 8, 2 heads, 2 layers, context 5; batch 2.
const gpt::Config tiny{.vocab = 11, .context = 5, .d_model = 8, .heads = 2, .layers = 2};
constexpr int tiny_batch = 2;

// One fresh seed per run, printed once; each test derives its own from it.
std::uint64_t seed_for(std::uint64_t test) {
  static const std::uint64_t run = [] {
    const std::uint64_t s = zp::test::fresh_seed();
    std::printf("gpt.test: seed %llu (ZP_TEST_SEED=%llu repeats this run)\n", (unsigned long long)s,
                (unsigned long long)s);
    return s;
  }();
  return zp::test::mix(run + test);
}

template <class F>
void random_tokens(gpt::Activations<F>& a, int vocab, std::uint64_t seed) {
  for (std::size_t i = 0; i < a.tokens.size(); ++i) {
    a.tokens[i] = int(zp::test::mix(seed + 2 * i) % std::uint64_t(vocab));
    a.targets[i] = int(zp::test::mix(seed + 2 * i + 1) % std::uint64_t(vocab));
  }
}

// Each parameter's value and gradient storage, for a model used without zp.
template <class T>
struct Storage {
  std::vector<std::string> names;
  std::vector<zp::View<T>*> values, grads;
  std::vector<std::vector<T>> grad_mem;
};
template <class T, class F>
Storage<T> bind(gpt::Model<T, F>& m) {
  Storage<T> s;
  zp::visit_parameters<T>(m, [&](std::string_view name, int, zp::View<T>& v, zp::View<T>& g) {
    s.names.emplace_back(name);
    s.values.push_back(&v);
    s.grads.push_back(&g);
    s.grad_mem.emplace_back(v.size(), T(0));
  });
  for (std::size_t k = 0; k < s.grads.size(); ++k) s.grads[k]->rebind(s.grad_mem[k].data());
  return s;
}

template <class T, class F>
F forward_loss(gpt::Model<T, F>& m, gpt::Activations<F>& a, int from = 0) {
  for (int k = from; k < m.modules(); ++k) m.forward(k, a);
  return m.loss(a, 1.0f);
}
template <class T, class F>
void backward_all(gpt::Model<T, F>& m, gpt::Activations<F>& a) {
  for (int k = m.modules() - 1; k >= 0; --k) m.backward(k, a);
}

// Which elements of an n-element tensor to check: all of them up to 200, else 200 at random.
std::vector<std::size_t> pick(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> idx;
  if (n <= 200) {
    for (std::size_t i = 0; i < n; ++i) idx.push_back(i);
  } else {
    for (std::size_t i = 0; i < 200; ++i) idx.push_back(zp::test::mix(seed + i) % n);
  }
  return idx;
}

// The derivative of loss() in v by central differences in double at h and h / 2, extrapolated
// (Richardson): their h^2 error terms cancel. With weights far from the linear regime, h^2 |f'''|
// alone reached 2e-9 at h = 1e-5 (a seed failed the bound below); what is left is rounding,
// ~ eps |loss| / h ~ 1e-10. So a correct backward agrees to well under 1e-9 absolute; 1e-6
// relative (with a 1e-9 absolute floor for gradients that are nearly 0) still catches any wrong
// term, which is off by far more than that.
constexpr double fd_h = 1e-5, fd_rel = 1e-6, fd_abs = 1e-9;

template <class Loss>
double slope(double& v, Loss&& loss) {
  const double keep = v;
  const auto central = [&](double h) {
    v = keep + h;
    const double up = loss();
    v = keep - h;
    const double down = loss();
    v = keep;
    return (up - down) / (2 * h);
  };
  const double coarse = central(fd_h), fine = central(fd_h / 2);
  return (4 * fine - coarse) / 3;
}

bool close(double analytic, double numeric) {
  return std::abs(analytic - numeric) <=
         fd_rel * std::max(std::abs(analytic), std::abs(numeric)) + fd_abs;
}

}  // namespace

TEST_CASE(
    "the transformer's backward matches float64 central differences for every parameter and the "
    "input") {
  const std::uint64_t seed = seed_for(1);
  gpt::Model<double, double> m(tiny, seed);
  Storage<double> s = bind(m);
  // Weights far from GPT-2's small initialisation, so attention is not uniform and every
  // nonlinearity works away from its linear regime.
  for (std::size_t k = 0; k < s.values.size(); ++k) {
    const bool gain =
        s.names[k].find("ln_") != std::string::npos && s.names[k].ends_with(".weight");
    for (std::size_t i = 0; i < s.values[k]->size(); ++i)
      (*s.values[k])[i] = (gain ? 1.0 : 0.0) + 0.5 * zp::test::hash_uniform(seed + 1000 + k, i);
  }
  gpt::Activations<double> a(tiny, tiny_batch);
  random_tokens(a, tiny.vocab, seed);
  const double loss = forward_loss(m, a);
  INFO("loss ", loss);
  backward_all(m, a);
  const std::vector<double> dx0 = a.dx[0];

  SUBCASE("every parameter") {
    std::size_t checked = 0, bad = 0;
    double worst = 0;  // largest |error| / (|gradient| + fd_abs / fd_rel), for the log
    for (std::size_t k = 0; k < s.values.size(); ++k) {
      zp::View<double>& v = *s.values[k];
      for (std::size_t i = 0; i < v.size(); ++i) REQUIRE(std::isfinite((*s.grads[k])[i]));
      for (std::size_t i : pick(v.size(), seed + 7 * k)) {
        const double numeric = slope(v[i], [&] { return forward_loss(m, a); }),
                     analytic = (*s.grads[k])[i];
        ++checked;
        worst =
            std::max(worst, std::abs(analytic - numeric) / (std::abs(numeric) + fd_abs / fd_rel));
        if (!close(analytic, numeric) && ++bad <= 10)
          FAIL_CHECK(s.names[k], "[", i, "]: backward ", analytic, ", finite differences ",
                     numeric);
      }
    }
    MESSAGE(checked, " parameter elements checked, ", bad, " wrong; worst relative error ", worst);
    CHECK(bad == 0);
    CHECK(s.names.size() == std::size_t(2 + 12 * tiny.layers + 3));
  }

  SUBCASE("the input embeddings (the first block's input)") {
    m.forward(0, a);
    for (std::size_t i = 0; i < a.x[0].size(); ++i) {
      const double numeric = slope(a.x[0][i], [&] { return forward_loss(m, a, 1); });
      if (!close(dx0[i], numeric))
        FAIL_CHECK("dx[0][", i, "]: backward ", dx0[i], ", finite differences ", numeric);
    }
  }

  SUBCASE("gradients accumulate: a second backward doubles them") {
    std::vector<std::vector<double>> once = s.grad_mem;
    backward_all(m, a);
    for (std::size_t k = 0; k < once.size(); ++k)
      for (std::size_t i = 0; i < once[k].size(); ++i)
        if (s.grad_mem[k][i] != 2 * once[k][i]) {
          FAIL_CHECK(s.names[k], "[", i, "]: ", s.grad_mem[k][i], " after two backwards, ",
                     once[k][i], " after one");
          break;
        }
  }
}

// Activation checkpointing recomputes each block's forward in its backward: the same code on the
// same inputs and weights, so every gradient is bitwise the one of keeping each block's
// activations, and the set holds one block's activations instead of one a layer.
TEST_CASE(
    "recompute: bitwise the gradients of keeping every block's activations, one block's memory") {
  const std::uint64_t seed = seed_for(6);
  const gpt::Config c{.vocab = 11, .context = 5, .d_model = 8, .heads = 2, .layers = 4};
  std::vector<std::vector<float>> grads[2], dx0[2];
  std::size_t bytes[2] = {};
  for (const bool recompute : {false, true}) {
    gpt::Model<float> m(c, seed);
    Storage<float> s = bind(m);
    gpt::Activations<float> a(c, tiny_batch, recompute);
    // Two micro-batches into the same set, gradients accumulating: the second forward must
    // replace what the first left, the recomputed activations too.
    for (std::uint64_t micro = 0; micro < 2; ++micro) {
      random_tokens(a, c.vocab, seed + micro);
      forward_loss(m, a);
      backward_all(m, a);
      dx0[recompute].push_back(a.dx[0]);
    }
    grads[recompute] = s.grad_mem;
    bytes[recompute] = a.bytes();
  }
  REQUIRE(grads[0].size() == grads[1].size());
  std::size_t differ = 0, nonzero = 0;
  for (std::size_t k = 0; k < grads[0].size(); ++k)
    for (std::size_t i = 0; i < grads[0][k].size(); ++i) {
      differ += grads[0][k][i] != grads[1][k][i];
      nonzero += grads[0][k][i] != 0;
    }
  CHECK(differ == 0);
  CHECK(nonzero > 0);
  CHECK(dx0[0] == dx0[1]);
  // Per block: ln_1, the residual after attention and ln_2 [rows, d], four row statistics, q k v
  // and the heads' output [rows, 4d], the attention probabilities [batch, heads, T, T], c_fc's
  // output before and after GELU [rows, 4d]; recomputing adds one block output [rows, d].
  const std::size_t rows = std::size_t(tiny_batch) * std::size_t(c.context),
                    d = std::size_t(c.d_model), T = std::size_t(c.context);
  const std::size_t block = 3 * rows * d + 4 * rows + 4 * rows * d +
                            std::size_t(tiny_batch) * std::size_t(c.heads) * T * T +
                            2 * rows * 4 * d;
  CHECK(bytes[0] - bytes[1] == (std::size_t(c.layers - 1) * block - rows * d) * sizeof(float));
}

// The blocked matmuls against one row at a time, the loops they replaced: bitwise, on shapes on
// both sides of the row and column blocks, with and without a bias and dx.
TEST_CASE("the matmuls equal the one-row-at-a-time loops bit for bit") {
  std::mt19937_64 rng(seed_for(40));
  std::normal_distribution<float> normal;
  auto fill = [&](std::size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const int R = gpt::matmul_rows, C = gpt::matmul_cols;
  for (int rows : {1, R - 1, R, R + 1, 3 * R + 5})
    for (int in : {1, 7, 33})
      for (int out : {1, 9, C, C + 3, 2 * C + 17}) {
        CAPTURE(rows);
        CAPTURE(in);
        CAPTURE(out);
        const auto x = fill(std::size_t(rows * in)), w = fill(std::size_t(in * out)),
                   b = fill(std::size_t(out)), dy = fill(std::size_t(rows * out)),
                   dw0 = fill(std::size_t(in * out)), db0 = fill(std::size_t(out));
        for (const float* bias : {b.data(), static_cast<const float*>(nullptr)}) {
          std::vector<float> y(std::size_t(rows * out), std::nanf("")), ref(y.size());
          gpt::matmul_forward(y.data(), x.data(), w.data(), bias, rows, in, out);
          gpt::by_row::matmul_forward(ref.data(), x.data(), w.data(), bias, rows, in, out);
          CHECK(std::memcmp(y.data(), ref.data(), y.size() * sizeof(float)) == 0);
        }
        std::vector<float> dx(std::size_t(rows * in), std::nanf("")), dw = dw0, db = db0;
        std::vector<float> rdx(dx.size()), rdw = dw0, rdb = db0;
        gpt::matmul_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), rows,
                             in, out);
        gpt::by_row::matmul_backward(rdx.data(), rdw.data(), rdb.data(), dy.data(), x.data(),
                                     w.data(), rows, in, out);
        CHECK(std::memcmp(dx.data(), rdx.data(), dx.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(dw.data(), rdw.data(), dw.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(db.data(), rdb.data(), db.size() * sizeof(float)) == 0);
        std::vector<float> dw2 = dw0;  // no dx, no db: dW alone
        gpt::matmul_backward(static_cast<float*>(nullptr), dw2.data(), static_cast<float*>(nullptr),
                             dy.data(), x.data(), w.data(), rows, in, out);
        CHECK(std::memcmp(dw2.data(), rdw.data(), dw2.size() * sizeof(float)) == 0);
      }
}

// GPT-2's weight decay rule by name picks the tensors of two dimensions (nanoGPT's rule by shape).
TEST_CASE("is_matrix names exactly the two-dimensional tensors") {
  const gpt::Model<float> m(tiny, 1);
  std::size_t matrices = 0;
  for (const auto& t : m.tensors()) {
    CAPTURE(t.name);
    CHECK(gpt::is_matrix(t.name) == (t.rows > 1 && t.cols > 1));
    matrices += gpt::is_matrix(t.name);
  }
  CHECK(matrices == std::size_t(2 + 4 * tiny.layers + 1));  // wte, wpe, 4 a block, lm_head
}

TEST_CASE("the attention is causal: a later token does not change earlier positions' logits") {
  const std::uint64_t seed = seed_for(2);
  gpt::Model<float> m(tiny, seed);
  gpt::Activations<float> a(tiny, tiny_batch);
  random_tokens(a, tiny.vocab, seed);
  for (int p = 0; p < tiny.context; ++p) {
    CAPTURE(p);
    forward_loss(m, a);
    const std::vector<float> before = a.logits;
    const int b = 1, r = b * tiny.context + p;  // change token p of the second sequence
    a.tokens[std::size_t(r)] = (a.tokens[std::size_t(r)] + 1) % tiny.vocab;
    forward_loss(m, a);
    const std::size_t V = std::size_t(tiny.vocab);
    for (int q = 0; q < tiny_batch * tiny.context; ++q) {
      const bool may_change = q / tiny.context == b && q % tiny.context >= p;
      bool same = true;
      for (std::size_t v = 0; v < V; ++v)
        same = same && a.logits[std::size_t(q) * V + v] == before[std::size_t(q) * V + v];
      if (may_change)
        CHECK_MESSAGE(!same, "position ", q, " ignored token ", r);
      else
        CHECK_MESSAGE(same, "position ", q, " saw token ", r);
    }
  }
}

TEST_CASE_TEMPLATE("an untrained model's loss is close to ln(vocab)", T, float, zp::bf16,
                   zp::fp16) {
  const std::uint64_t seed = seed_for(3);
  gpt::Model<T> m(tiny, seed);
  gpt::Activations<float> a(tiny, 40);
  random_tokens(a, tiny.vocab, seed);
  const float loss = forward_loss(m, a);
  // Logits have a standard deviation of about 0.02 sqrt(d) = 0.06: that raises the expected loss
  // by ~0.002, and the mean over 200 random targets scatters by ~0.06 / sqrt(200) = 0.004.
  CHECK(std::abs(loss - std::log(float(tiny.vocab))) < 0.03f);
}

TEST_CASE("initialisation is deterministic and follows GPT-2") {
  const gpt::Config c{.vocab = 50, .context = 16, .d_model = 32, .heads = 4, .layers = 3};
  gpt::Model<float> a(c, 42), b(c, 42), other(c, 43);
  std::vector<std::vector<float>> va, vb, vo;
  std::vector<std::string> names;
  auto collect = [](gpt::Model<float>& m, std::vector<std::vector<float>>& out,
                    std::vector<std::string>* n) {
    zp::visit_parameters<float>(
        m, [&](std::string_view name, int, zp::View<float>& v, zp::View<float>&) {
          out.emplace_back(v.begin(), v.end());
          if (n) n->emplace_back(name);
        });
  };
  collect(a, va, &names);
  collect(b, vb, nullptr);
  collect(other, vo, nullptr);
  CHECK(va == vb);
  CHECK(va != vo);
  for (std::size_t k = 0; k < names.size(); ++k) {
    CAPTURE(names[k]);
    const auto& v = va[k];
    double s = 0, s2 = 0;
    for (float x : v) {
      s += x;
      s2 += double(x) * x;
    }
    const double mean = s / double(v.size()), sd = std::sqrt(s2 / double(v.size()) - mean * mean);
    const bool gain = names[k].find("ln_") != std::string::npos && names[k].ends_with(".weight");
    if (gain)
      CHECK((mean == 1.0 && sd == 0.0));
    else if (names[k].ends_with(".bias"))
      CHECK((mean == 0.0 && sd == 0.0));
    else {
      const double want =
          names[k].ends_with("c_proj.weight") ? 0.02 / std::sqrt(2.0 * c.layers) : 0.02;
      CHECK(sd == doctest::Approx(want).epsilon(0.15));
      CHECK(std::abs(mean) < 4 * want / std::sqrt(double(v.size())) + 1e-4);
    }
  }
  CHECK(names.front() == "wte.weight");
  CHECK(names[2] == "h.0.ln_1.weight");
  CHECK(names[4] == "h.0.attn.c_attn.weight");
  CHECK(names.back() == "lm_head.weight");
  CHECK(zp::describe_parameters<float>(a).back().module == c.layers + 1);
}

TEST_CASE(
    "targets equal to zp::tp::ignore_index are left out of the loss; other indices outside the "
    "vocabulary are errors") {
  const std::uint64_t seed = seed_for(5);
  gpt::Model<double, double> m(tiny, seed);
  Storage<double> s = bind(m);
  gpt::Activations<double> a(tiny, tiny_batch);
  random_tokens(a, tiny.vocab, seed);
  for (std::size_t i = 1; i < a.targets.size(); i += 3) a.targets[i] = zp::tp::ignore_index;
  const double loss = forward_loss(m, a);
  // float64 reference from the logits: the mean over the positions that are not ignored.
  const std::size_t V = std::size_t(tiny.vocab);
  double want = 0;
  int kept = 0;
  for (std::size_t r = 0; r < a.targets.size(); ++r) {
    if (a.targets[r] == -100) {
      for (std::size_t v = 0; v < V; ++v) CHECK(a.dlogits[r * V + v] == 0.0);
      continue;
    }
    const double* z = &a.logits[r * V];
    double mx = z[0], se = 0;
    for (std::size_t v = 1; v < V; ++v) mx = std::max(mx, z[v]);
    for (std::size_t v = 0; v < V; ++v) se += std::exp(z[v] - mx);
    want += std::log(se) + mx - z[a.targets[r]];
    ++kept;
  }
  CHECK(kept == 7);
  CHECK(loss == doctest::Approx(want / kept).epsilon(1e-12));
  // Every position ignored: loss 0 and no gradient anywhere.
  std::fill(a.targets.begin(), a.targets.end(), zp::tp::ignore_index);
  CHECK(forward_loss(m, a) == 0.0);
  backward_all(m, a);
  for (std::size_t k = 0; k < s.grad_mem.size(); ++k)
    for (double g : s.grad_mem[k]) CHECK(g == 0.0);
  // Anything else outside [0, vocab) names the index, its position and the vocabulary.
  a.targets[3] = tiny.vocab;
  zp::test::expect_invalid([&] { (void)m.loss(a, 1.0f); }, {"target 11 at position 3", "[0, 11)"});
  a.targets[3] = -1;
  zp::test::expect_invalid([&] { (void)m.loss(a, 1.0f); }, {"target -1 at position 3"});
  a.tokens[7] = zp::tp::ignore_index;  // tokens have no ignore index
  zp::test::expect_invalid([&] { m.forward(0, a); }, {"token -100 at position 7", "[0, 11)"});
}

TEST_CASE("draw: the softmax of logits / temperature over the top k, inverted at u") {
  std::mt19937_64 rng(seed_for(7));
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> logits(7);
    for (auto& x : logits) x = normal(rng);
    gpt::SampleOptions o;
    o.temperature = std::array{0.25, 1.0, 3.0}[trial % 3];
    o.top_k = std::array{0, 1, 3, 7}[(trial / 3) % 4];
    // Reference in long double: indices by descending logit, the first k, cumulative softmax.
    std::vector<int> order{0, 1, 2, 3, 4, 5, 6};
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return logits[std::size_t(a)] > logits[std::size_t(b)]; });
    const std::size_t k = o.top_k ? std::size_t(o.top_k) : order.size();
    std::vector<long double> p(k);
    long double total = 0;
    for (std::size_t j = 0; j < k; ++j)
      total += p[j] = std::exp((long double)logits[std::size_t(order[j])] / o.temperature);
    const double u = uniform(rng);
    long double acc = 0;
    int want = order[k - 1];
    for (std::size_t j = 0; j < k; ++j)
      if ((acc += p[j] / total) > u) {
        want = order[j];
        break;
      }
    CAPTURE(o.temperature);
    CAPTURE(o.top_k);
    CAPTURE(u);
    CHECK(gpt::draw(std::span<const float>(logits), o, u) == want);
    o.temperature = 0;  // the most likely token, whatever u
    CHECK(gpt::draw(std::span<const float>(logits), o, u) == order[0]);
  }
}

TEST_CASE("greedy sampling continues with the argmax of a forward over the prefix alone") {
  const std::uint64_t seed = seed_for(8);
  gpt::Model<float> m(tiny, seed);
  std::vector<int> prompt{1, 4, 2};
  gpt::SampleOptions o;
  o.count = tiny.context + 3;  // past the context: the window slides
  o.temperature = 0;
  const std::vector<int> got = gpt::sample(m, prompt, o);
  REQUIRE(got.size() == std::size_t(o.count));
  // Reference: the prefix in a batch of one, padded with another token than sample()'s.
  gpt::Activations<float> a(tiny, 1);
  std::vector<int> seq = prompt;
  const std::size_t V = std::size_t(tiny.vocab);
  for (int n = 0; n < o.count; ++n) {
    const std::size_t len = std::min(seq.size(), std::size_t(tiny.context));
    std::fill(a.tokens.begin(), a.tokens.end(), (seq.back() + 1) % tiny.vocab);
    std::copy(seq.end() - std::ptrdiff_t(len), seq.end(), a.tokens.begin());
    for (int mod = 0; mod < m.modules(); ++mod) m.forward(mod, a);
    const auto row = a.logits.begin() + std::ptrdiff_t((len - 1) * V);
    const int want = int(std::max_element(row, row + std::ptrdiff_t(V)) - row);
    CAPTURE(n);
    CHECK(got[std::size_t(n)] == want);
    seq.push_back(want);
  }
  // The same seed draws the same tokens; a token outside the vocabulary is an error.
  o.temperature = 1;
  o.seed = seed;
  CHECK(gpt::sample(m, prompt, o) == gpt::sample(m, prompt, o));
  zp::test::expect_invalid([&] { gpt::sample(m, {tiny.vocab}, o); },
                           {"prompt token", "not in the vocabulary"});
}
