#include "zp/model.hpp"

#include "zp/dtype.hpp"

#include <doctest/doctest.h>

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
