#include "zp/model.hpp"

#include "zp/dtype.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <csignal>
#include <string>
#include <vector>

#include "zero_mlp.hpp"

using zp::Param;
using zp::View;

namespace {

struct Tiny {
  std::vector<float> w0 = {1, 2, 3}, b0 = {4};
  View<float> w{w0.data(), 3}, gw{3}, b{b0.data(), 1}, gb{1};
  std::vector<int> modules = {0, 1};
  std::size_t grad_size = 3;

  template <class V>
  friend void for_each_parameter(Tiny& t, V&& visit) {
    t.gw = View<float>(t.grad_size);
    visit("w", t.modules[0], t.w, t.gw);
    visit("b", t.modules[1], t.b, t.gb);
  }
};

struct NotAModel {};

}  // namespace

static_assert(zp::Model<Tiny, float>);
static_assert(zp::Model<zp::test::Mlp<zp::bf16>, zp::bf16>);
static_assert(!zp::Model<NotAModel, float>);

TEST_CASE("a view reads and writes wherever it is bound and keeps its size when rebound") {
  std::vector<float> a = {1, 2, 3}, b = {7, 8, 9};
  View<float> v(a.data(), 3);
  v[1] = 5;
  CHECK(a[1] == 5);
  v.rebind(b.data());
  CHECK(v.size() == 3);
  CHECK(v[0] == 7);
  CHECK(std::span<float>(v).data() == b.data());
  v.rebind(nullptr);
  CHECK(!v.bound());
  CHECK(View<float>(4).size() == 4);
  Param<float> p(6);
  CHECK((p.value.size() == 6 && p.grad.size() == 6 && !p.value.bound()));
}

#ifndef NDEBUG
// Debug builds check every element access: the commonest stage 3 mistake (a view read outside
// its module's guard) ends the process with a message saying so, not with a null dereference.
TEST_CASE("a view used unbound or out of range ends the process naming the mistake (debug)") {
  const auto dies_with = [](auto&& use, const std::string& message) {
    int out[2];
    REQUIRE(::pipe(out) == 0);
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::dup2(out[1], 2);
      use();
      ::_exit(0);
    }
    ::close(out[1]);
    std::string said;
    char buf[512];
    for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) said.append(buf, std::size_t(n));
    ::close(out[0]);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT));
    CHECK_MESSAGE(said.find(message) != std::string::npos, said);
  };
  View<float> unbound(4);
  dies_with([&] { (void)unbound[0]; },
            "zp: a parameter view was used while unbound: with ZeRO stage 3 a module's values "
            "and gradients are bound only inside engine.forward(m) / engine.backward(m)");
  std::vector<float> a(3);
  View<float> v(a.data(), 3);
  dies_with([&] { (void)v[3]; }, "zp: parameter view index 3 out of range [0, 3)");
}
#endif

TEST_CASE("describe_parameters lists parameters in forward order with their modules") {
  Tiny t;
  const auto ps = zp::describe_parameters<float>(t);
  REQUIRE(ps.size() == 2);
  CHECK((ps[0].name == "w" && ps[0].module == 0 && ps[0].size == 3));
  CHECK((ps[1].name == "b" && ps[1].module == 1 && ps[1].size == 1));
  zp::test::Mlp<float> mlp;
  const auto mp = zp::describe_parameters<float>(mlp);
  CHECK(mp.size() == 8);
  CHECK(mp[2].name == "layer1.weight");
  CHECK(mp[2].size == 61u * 67u);
}

TEST_CASE("describe_parameters rejects broken module numbering and mismatched views") {
  Tiny gap;
  gap.modules = {0, 2};
  CHECK_THROWS_WITH_AS(zp::describe_parameters<float>(gap), doctest::Contains("without gaps"),
                       zp::Error);
  Tiny late;
  late.modules = {1, 1};
  CHECK_THROWS_WITH_AS(zp::describe_parameters<float>(late), doctest::Contains("numbered from 0"),
                       zp::Error);
  Tiny back;
  back.modules = {1, 0};
  CHECK_THROWS_AS(zp::describe_parameters<float>(back), zp::Error);
  Tiny sizes;
  sizes.grad_size = 2;
  CHECK_THROWS_WITH_AS(zp::describe_parameters<float>(sizes),
                       doctest::Contains("'w' has a value view of 3"), zp::Error);
}

namespace {
// A model that can misregister its parameters in the ways bind_parameters must catch.
struct Faulty {
  std::vector<float> w0 = {1, 2, 3};
  Param<float> p{3}, q{3};
  View<float> empty_value{0}, empty_grad{0};
  enum class Fault {
    none,
    same_param_twice,
    value_as_grad,
    grows,
    renames,
    empty
  } fault = Fault::none;
  int visits = 0;

  template <class V>
  friend void for_each_parameter(Faulty& m, V&& visit) {
    ++m.visits;
    visit("p", 0, m.p);
    switch (m.fault) {
      case Fault::none: visit("q", 0, m.q); break;
      case Fault::same_param_twice: visit("q", 0, m.p); break;
      case Fault::value_as_grad: visit("q", 0, m.q.value, m.q.value); break;
      case Fault::grows:  // one parameter more on every visit
        visit("q", 0, m.q);
        if (m.visits > 1) visit("r", 0, m.q);
        break;
      case Fault::renames: visit(m.visits > 1 ? "r" : "q", 0, m.q); break;
      case Fault::empty: visit("e", 0, m.empty_value, m.empty_grad); break;
    }
  }
};
}  // namespace

TEST_CASE(
    "bind_parameters names a model that registers views twice, changes between visits or has empty "
    "parameters") {
  using F = Faulty::Fault;
  auto fails = [](F f, std::initializer_list<const char*> parts) {
    Faulty m;
    m.fault = f;
    try {
      zp::bind_parameters<float>(m);
      FAIL_CHECK("no error for fault ", int(f));
    } catch (const zp::Error& e) {
      CHECK(e.category() == zp::Errc::invalid_argument);
      for (const char* p : parts)
        CHECK_MESSAGE(std::string(e.what()).find(p) != std::string::npos, std::string(e.what()));
    }
  };
  fails(F::same_param_twice, {"parameters 'p' and 'q' share one View object"});
  fails(F::value_as_grad, {"parameters 'q' and 'q' share one View object", "its own gradient"});
  fails(F::grows, {"visited 'r'", "it must visit the same parameters"});
  fails(F::renames,
        {"visited 'r' (module 0) as parameter #1 the second time, but 'q' the first time"});
  fails(F::empty, {"parameter 'e' has 0 elements"});
  Faulty ok;
  const auto bound = zp::bind_parameters<float>(ok);
  REQUIRE(bound.params.size() == 2);
  CHECK((bound.values[0] == &ok.p.value && bound.grads[1] == &ok.q.grad));
  CHECK(ok.visits == 2);  // visited twice: once to learn, once to check
}

namespace {
// A model holding parts of two tensors, described by Placements.
struct Placed {
  Param<float> a{6}, b{4};
  zp::Placement pa, pb;
  template <class V>
  friend void for_each_parameter(Placed& m, V&& visit) {
    visit("a", 0, m.a, m.pa);
    visit("b", 0, m.b.value, m.b.grad, m.pb);
  }
};
}  // namespace

TEST_CASE("a Placement maps each element of a part to the full tensor, run by run") {
  // The columns [2, 5) of a [3, 3, 7] tensor's rows 1..2, in every one of its 3 blocks.
  const zp::Placement p{{3, 3, 7}, {1, 0, 2}, {3, 3, 5}};
  p.check("p");
  CHECK(p.size() == 2 * 3 * 3);
  CHECK(p.full_size() == 63);
  CHECK_FALSE(p.is_whole());
  std::vector<std::size_t> naive;  // row-major over the box, the independent loop
  for (std::size_t i = 1; i < 3; ++i)
    for (std::size_t j = 0; j < 3; ++j)
      for (std::size_t k = 2; k < 5; ++k) naive.push_back((i * 3 + j) * 7 + k);
  for (std::size_t e = 0; e < naive.size(); ++e) CHECK(p.full_index(e) == naive[e]);
  for (std::size_t first : {std::size_t(0), std::size_t(1), std::size_t(4), std::size_t(17)})
    for (std::size_t count :
         {std::size_t(0), std::size_t(1), std::size_t(2), std::size_t(5), 18 - first}) {
      if (first + count > naive.size()) continue;
      std::size_t next = first;
      p.for_each_run(first, count, [&](std::size_t full, std::size_t local, std::size_t n) {
        CHECK(local == next);
        CHECK(n >= 1);
        for (std::size_t q = 0; q < n; ++q) CHECK(full + q == naive[local + q]);
        next += n;
      });
      CHECK(next == first + count);
    }
  CHECK(zp::Placement{{4, 5}, {0, 0}, {4, 5}}.is_whole());
  CHECK(zp::Placement{}.is_whole());
  CHECK(zp::Placement{}.full_index(9) == 9);
  std::vector<std::size_t> whole;  // the whole tensor: one run, the indices unchanged
  zp::Placement{}.for_each_run(3, 4, [&](std::size_t full, std::size_t local, std::size_t n) {
    whole.insert(whole.end(), {full, local, n});
  });
  zp::Placement{}.for_each_run(5, 0, [&](std::size_t, std::size_t, std::size_t) { FAIL("a run"); });
  CHECK(whole == std::vector<std::size_t>{3, 3, 4});
  CHECK_THROWS_WITH_AS(zp::Placement({{4, 5}, {0, 3}, {4, 3}}).check("t"),
                       doctest::Contains("t: dimension 1 of the Placement is [3, 3)"), zp::Error);
  CHECK_THROWS_WITH_AS(zp::Placement({{4, 5}, {0}, {4, 5}}).check("t"),
                       doctest::Contains("begin and end of the shape's 2 dimensions, got 1 and 2"),
                       zp::Error);
}

TEST_CASE("a parameter visited with a Placement is split unless the box is the whole tensor") {
  Placed m;
  m.pa = {{2, 6}, {1, 0}, {2, 6}};  // row 1 of 2
  m.pb = {{4}, {0}, {4}};           // the whole vector
  const auto ps = zp::describe_parameters<float>(m);
  CHECK(ps[0].tp == zp::TensorParallel::split);
  CHECK(ps[0].place.shape == std::vector<std::size_t>{2, 6});
  CHECK(ps[1].tp == zp::TensorParallel::replicated);
  // visit_parameters hands a callback that takes the kind but no Placement the kind alone.
  std::vector<zp::TensorParallel> kinds;
  zp::visit_parameters<float>(m, [&](std::string_view, int, View<float>&, View<float>&,
                                     zp::TensorParallel tp) { kinds.push_back(tp); });
  CHECK(kinds == std::vector{zp::TensorParallel::split, zp::TensorParallel::replicated});
  m.pa = {{2, 6}, {0, 0}, {2, 6}};  // 12 elements in the box, 6 in the view
  CHECK_THROWS_WITH_AS(zp::describe_parameters<float>(m),
                       doctest::Contains("'a' has 6 elements but its Placement's box holds 12"),
                       zp::Error);
  m.pa = {{2, 6}, {1, 0}, {3, 6}};
  CHECK_THROWS_WITH_AS(zp::describe_parameters<float>(m),
                       doctest::Contains("parameter 'a': dimension 0 of the Placement is [1, 3)"),
                       zp::Error);
}
