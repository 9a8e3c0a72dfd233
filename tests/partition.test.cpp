#include "zp/partition.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "random.hpp"
#include "temp_dir.hpp"
#include "zero_mlp.hpp"
#include "zp/tensor_parallel.hpp"

using zp::Extent;
using zp::Field;
using zp::Layout;
using zp::ParamInfo;

namespace {

std::vector<ParamInfo> params_of(const std::vector<std::vector<std::size_t>>& modules) {
  std::vector<ParamInfo> out;
  for (std::size_t m = 0; m < modules.size(); ++m)
    for (std::size_t i = 0; i < modules[m].size(); ++i)
      out.push_back({"m" + std::to_string(m) + ".p" + std::to_string(i), int(m), modules[m][i]});
  return out;
}

void check_invariants(const Layout& L, const zp::LayoutOptions& o) {
  const std::size_t n = std::size_t(L.ranks());
  CHECK(L.total() == n * L.shard());
  std::size_t offset = 0, shard = 0, used = 0;
  for (int s = 0; s < L.segment_count(); ++s) {
    const auto& g = L.segment(s);
    CHECK(g.offset == offset);       // segments tile the buffer
    CHECK(g.shard_offset == shard);  // pieces tile every shard
    CHECK(g.size == n * g.piece);    // equal pieces
    CHECK(g.piece % o.align == 0);
    CHECK(g.used <= g.size);
    CHECK(g.size - g.used < n * o.align + (g.used == 0 ? n * o.align : 0));
    if (s > 0) CHECK(g.module <= L.segment(s - 1).module);  // backward order
    // whole parameters, packed, of one module; the bucket cap holds unless one parameter is larger
    std::size_t at = g.offset;
    for (int p : g.params) {
      const auto& P = L.params()[std::size_t(p)];
      CHECK(P.module == g.module);
      CHECK(P.segment == s);
      CHECK(P.offset == at);
      at += P.size;
    }
    const std::size_t cap = s == 0 ? o.first_bucket_elems : o.bucket_elems;
    CHECK((g.used <= cap || g.params.size() == 1));
    offset += g.size;
    shard += g.piece;
    used += g.used;
  }
  CHECK(offset == L.total());
  CHECK(used == L.used());
  CHECK(L.total() - L.used() < std::size_t(L.segment_count()) * n * o.align);
  for (int m = 0; m < L.module_count(); ++m) {
    const auto& M = L.module(m);
    std::size_t size = 0;
    for (int s = M.first_segment; s < M.end_segment; ++s) {
      CHECK(L.segment(s).module == m);
      size += L.segment(s).size;
    }
    CHECK(M.offset == L.segment(M.first_segment).offset);
    CHECK(M.size == size);
  }
  // every rank's pieces are disjoint and cover the buffer exactly once
  std::vector<int> owners(L.total(), 0);
  for (int r = 0; r < L.ranks(); ++r)
    for (int s = 0; s < L.segment_count(); ++s)
      for (std::size_t i = 0; i < L.segment(s).piece; ++i) ++owners[L.piece_offset(s, r) + i];
  CHECK(std::count(owners.begin(), owners.end(), 1) == std::ptrdiff_t(L.total()));
}

}  // namespace

TEST_CASE(
    "shards are equal, disjoint and cover the buffer for sizes 0, 1, primes and rank counts 1-5") {
  const std::vector<std::vector<std::size_t>> model = {
      {0, 1, 7}, {4099, 13}, {1, 1, 1, 1}, {65537}, {2, 3, 5, 11}};
  for (int ranks : {1, 2, 3, 4, 5})
    for (zp::LayoutOptions o :
         {zp::LayoutOptions{},
          zp::LayoutOptions{.bucket_elems = 100, .first_bucket_elems = 10, .align = 1},
          zp::LayoutOptions{.bucket_elems = 5000, .first_bucket_elems = 3, .align = 16}}) {
      CAPTURE(ranks);
      CAPTURE(o.bucket_elems);
      const Layout L(params_of(model), ranks, o);
      check_invariants(L, o);
      CHECK(L.used() == 0 + 1 + 7 + 4099 + 13 + 4 + 65537 + 21);
      CHECK(L.segment(0).module == 4);  // the last module first
    }
}

// ZeRO++ on a tensor-parallel grid: each TP rank lays out its own part, whose split parameters'
// slices may differ in size (a vocabulary of 13 over 2 ranks: 7 and 6). With by_tp_kind a segment
// holds one kind only, and every segment holding replicated parameters is the same on every TP
// rank (parameters, padding, pieces), so their quantization blocks are too.
TEST_CASE(
    "by_tp_kind: a replicated parameter's segment is the same on every tensor-parallel rank") {
  const std::uint64_t seed = zp::test::fresh_seed();
  std::uint64_t draws = 0;
  const auto below = [&](std::uint64_t n) { return zp::test::mix(seed + ++draws) % n; };
  for (int trial = 0; trial < 200; ++trial) {
    CAPTURE(trial);
    const int ranks = 1 + int(below(4)), tp = 2 + int(below(3));
    const zp::LayoutOptions o{.bucket_elems = 8 + below(64),
                              .first_bucket_elems = 1 + below(32),
                              .align = 1 + below(4),
                              .by_tp_kind = true};
    // The model: modules of parameters of random kinds and sizes; a split one has a part of
    // its full size on each TP rank, the first n % tp parts one larger (none empty).
    std::vector<ParamInfo> whole;
    const int modules = 1 + int(below(4));
    for (int m = 0; m < modules; ++m)
      for (std::size_t i = 0, n = 1 + below(6); i < n; ++i)
        whole.push_back({"m" + std::to_string(m) + ".p" + std::to_string(i), m,
                         std::size_t(tp) + below(40),
                         below(2) ? zp::TensorParallel::split : zp::TensorParallel::replicated});
    std::vector<Layout> parts;
    for (int r = 0; r < tp; ++r) {
      std::vector<ParamInfo> part = whole;
      for (auto& p : part)
        if (p.tp == zp::TensorParallel::split) p.size = zp::tp::split(p.size, tp, r).size();
      parts.emplace_back(part, ranks, o);
      check_invariants(parts.back(), o);
      for (const auto& g : parts.back().segments())
        for (int p : g.params)
          CHECK(part[std::size_t(p)].tp == part[std::size_t(g.params.front())].tp);
    }
    // A replicated parameter's segment, by the names it holds, its used, padded and piece sizes
    // and the parameter's place in it, on each TP rank.
    const auto segment_of = [](const Layout& L, const std::string& name) {
      for (const auto& p : L.params())
        if (p.name == name) {
          const auto& g = L.segment(p.segment);
          std::vector<std::string> names;
          for (int q : g.params) names.push_back(L.params()[std::size_t(q)].name);
          return std::tuple(names, g.used, g.size, g.piece, p.offset - g.offset);
        }
      FAIL("no parameter ", name);
      return std::tuple(std::vector<std::string>{}, 0ul, 0ul, 0ul, 0ul);
    };
    for (const auto& p : whole)
      if (p.tp == zp::TensorParallel::replicated)
        for (int r = 1; r < tp; ++r)
          CHECK(segment_of(parts[std::size_t(r)], p.name) == segment_of(parts[0], p.name));
  }
}

TEST_CASE("the layout fingerprint changes with any name, size, module or rank count") {
  const auto base = params_of({{10, 20}, {30}});
  const std::uint64_t h = Layout(base, 2).hash();
  CHECK(Layout(base, 2).hash() == h);
  CHECK(Layout(base, 3).hash() != h);
  auto renamed = base;
  renamed[1].name = "other";
  CHECK(Layout(renamed, 2).hash() != h);
  auto resized = base;
  resized[2].size = 31;
  CHECK(Layout(resized, 2).hash() != h);
  auto moved = base;
  moved[1].module = 1;
  CHECK(Layout(moved, 2).hash() != h);
}

TEST_CASE("each stage keeps the buffers of the ZeRO table") {
  zp::test::Mlp<zp::bf16> mlp;
  const Layout L(zp::describe_parameters<zp::bf16>(mlp), 4,
                 {.bucket_elems = 1000, .first_bucket_elems = 100, .align = 8});
  const std::size_t P = L.total(), S = L.shard();
  auto check = [&](auto part, std::size_t params, std::size_t grads, std::size_t master) {
    const auto mem = part.memory();
    CHECK(mem.params == params * 2);
    CHECK(mem.grads == grads * 2);
    CHECK(mem.master == master * 4);
    CHECK(mem.optimizer_state == master * 8);
    CHECK(mem.model_states() == zp::zero_model_state_bytes(decltype(part)::stage, P, 4, 2, 2));
  };
  check(zp::Partitioned<zp::bf16, 0>(L, 1, 2), P, P, P);
  check(zp::Partitioned<zp::bf16, 1>(L, 1, 2), P, P, S);
  check(zp::Partitioned<zp::bf16, 2>(L, 1, 2), P, S, S);
  check(zp::Partitioned<zp::bf16, 3>(L, 1, 2), S, S, S);
  // pieces: full-space buffers at segment.offset + rank * piece, shard-space at shard_offset
  zp::Partitioned<zp::bf16, 1> p1(L, 3, 2);
  const int s = 2;
  CHECK(p1.owned<Field::grad>(s, Extent::piece).span.data() ==
        p1.buffer<Field::grad>().data() + L.piece_offset(s, 3));
  CHECK(p1.owned<Field::master>(s, Extent::piece).span.data() ==
        p1.buffer<Field::master>().data() + L.segment(s).shard_offset);
  // REFERENCE.md's 7.5B on 64 ranks, K = 12: 120, 31.4, 16.6, 1.9 GB
  const std::size_t psi = 7'500'000'000ull;
  CHECK(zp::zero_model_state_bytes(0, psi, 64, 2, 2) == 120'000'000'000ull);
  CHECK(double(zp::zero_model_state_bytes(1, psi, 64, 2, 2)) ==
        doctest::Approx(31.4e9).epsilon(0.01));
  CHECK(double(zp::zero_model_state_bytes(2, psi, 64, 2, 2)) ==
        doctest::Approx(16.6e9).epsilon(0.01));
  CHECK(double(zp::zero_model_state_bytes(3, psi, 64, 2, 2)) ==
        doctest::Approx(1.875e9).epsilon(0.01));
}

namespace {
// Partitioned::memory_plan (the plan the engine checks before allocating) against what a
// partition of the same settings allocates: its report, and the host allocator's count.
template <int Stage>
void check_host_plan(const Layout& L, std::uint64_t seed, const std::filesystem::path& nvme_dir) {
  using P = zp::Partitioned<zp::bf16, Stage>;
  for (int trial = 0; trial < 24; ++trial) {
    const std::uint64_t x = zp::test::mix(seed + std::uint64_t(Stage * 100 + trial));
    const int slots = int(x % 3);
    const bool f32 = x >> 2 & 1, offload = x >> 3 & 1;
    zp::NvmeOptions o;
    o.path = nvme_dir;
    o.buffer_count = 2 + int(x >> 8 & 3);
    o.sub_group_size = 1 + (x >> 12) % 20000;
#if defined(ZP_WITH_AIO)
    const bool nvme = x >> 4 & 1, param_nvme = Stage == 3 && (x >> 5 & 1);
#else
    const bool nvme = false, param_nvme = false;
#endif
    const bool param_host = Stage == 3 && (x >> 6 & 1);
    CAPTURE(trial);
    CAPTURE(slots);
    CAPTURE(f32);
    CAPTURE(offload);
    CAPTURE(nvme);
    CAPTURE(param_nvme);
    const zp::MemoryPlan both = P::memory_plan(L, slots, f32, offload, nvme ? &o : nullptr,
                                               param_nvme ? &o : nullptr, param_host);
    CHECK(both.device.total() == 0);  // a host backend's partition has no device part
    const zp::MemoryReport& plan = both.host;
    const std::int64_t before = zp::memory_use<zp::MemorySpace::host>().current;
    const P part(L, 0, slots, f32, offload, nvme ? &o : nullptr, param_nvme ? &o : nullptr,
                 param_host);
    part.expect_swap_opened();
    const zp::MemoryReport got = part.memory();
    CHECK(plan.nvme == 0);
    CHECK(plan.total() == got.total());  // on a host backend, every byte is in host memory
    CHECK(plan.swap_buffers == got.swap_buffers);
    CHECK(plan.model_states() == got.model_states() - got.nvme);
    CHECK(zp::memory_use<zp::MemorySpace::host>().current - before ==
          std::int64_t(plan.total() - plan.swap_buffers));
    CHECK((plan.swap_buffers > 0) == (nvme || param_nvme));
  }
}
}  // namespace

TEST_CASE("memory_plan is what a partition of those settings allocates in host memory") {
  const std::uint64_t seed = zp::test::run_seed("partition.test");
  zp::test::TempDir dir("host-plan");
  const Layout L(params_of({{7000, 3}, {40}, {1, 1, 1900}}), 3,
                 {.bucket_elems = 1000, .first_bucket_elems = 100, .align = 8});
  check_host_plan<0>(L, seed, dir.path);
  check_host_plan<1>(L, seed, dir.path);
  check_host_plan<2>(L, seed, dir.path);
  check_host_plan<3>(L, seed, dir.path);
}

namespace {
// Writes, through the ownership query, each element's full-layout index into field F's buffer of
// every segment; the buffer must then hold the ZeRO table's layout, element by element: the
// full buffer where the stage keeps the field whole, else the concatenation of this rank's
// pieces. Returns the number of elements written.
template <Field F, class P>
std::size_t check_owned(const P& part, Extent e, int k = 0) {
  const Layout& L = part.layout();
  const auto buf = part.template buffer<F>(k);
  std::fill(buf.begin(), buf.end(), -1.0f);
  std::size_t written = 0;
  for (int s = 0; s < L.segment_count(); ++s) {
    const auto o = part.template owned<F>(s, e, k);
    REQUIRE(o.span.data() >= buf.data());
    REQUIRE(o.span.data() + o.span.size() <= buf.data() + buf.size());
    for (std::size_t i = 0; i < o.span.size(); ++i) o.span[i] = float(o.offset + i);
    written += o.span.size();
  }
  const int r = part.rank(), stage = P::stage;
  const bool whole = F == Field::param                          ? stage < 3
                     : F == Field::grad || F == Field::grad_f32 ? stage < 2
                                                                : stage < 1;
  const bool segments = e == Extent::kept ? whole : e == Extent::updated && stage == 0;
  std::size_t at = 0;  // the serial reference: walk the segments as the table says
  for (int s = 0; s < L.segment_count(); ++s) {
    const auto& g = L.segment(s);
    for (std::size_t i = 0; i < g.size; ++i) {
      const bool mine = i / g.piece == std::size_t(r);
      if (!whole && !mine) continue;  // a shard-space buffer holds only this rank's pieces
      const float want = segments || mine ? float(g.offset + i) : -1.0f;
      if (buf[at] != want) {
        FAIL_CHECK("field ", int(F), " extent ", int(e), " stage ", stage, " rank ", r,
                   ": element ", at, " holds ", buf[at], ", expected ", want);
        return written;
      }
      ++at;
    }
  }
  CHECK(at == buf.size());
  return written;
}
}  // namespace

TEST_CASE("the ownership query names exactly the elements each stage keeps, updates and counts") {
  const auto ps = params_of({{7, 3}, {40}, {1, 1, 19}});
  for (int ranks : {1, 2, 3, 4}) {
    const Layout L(ps, ranks, {.bucket_elems = 16, .first_bucket_elems = 8, .align = 2});
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(ranks);
      CAPTURE(r);
      auto check_stage = [&](auto part) {
        constexpr int stage = decltype(part)::stage;
        for (Extent e : {Extent::kept, Extent::updated, Extent::piece}) {
          const std::size_t piece = L.shard(), full = L.total();
          const std::size_t n = e == Extent::piece     ? piece
                                : e == Extent::updated ? (stage == 0 ? full : piece)
                                                       : 0;
          check_owned<Field::param>(part, e);
          check_owned<Field::grad>(part, e);
          const std::size_t got =
              check_owned<Field::master>(part, e) + check_owned<Field::state>(part, e, 1);
          if (e != Extent::kept) CHECK(got == 2 * n);
          check_owned<Field::grad_f32>(part, e);
        }
      };
      check_stage(zp::Partitioned<float, 0>(L, r, 2, true));
      check_stage(zp::Partitioned<float, 1>(L, r, 2, true));
      check_stage(zp::Partitioned<float, 2>(L, r, 2, true));
      check_stage(zp::Partitioned<float, 3>(L, r, 2, true));
      // T fields: checked through float partitions above, here their placement in a bf16 one
      const zp::Partitioned<zp::bf16, 3> p3(L, r, 2);
      for (int s = 0; s < L.segment_count(); ++s) {
        CHECK(p3.owned<Field::param>(s, Extent::kept).span.data() ==
              p3.buffer<Field::param>().data() + L.segment(s).shard_offset);
        CHECK(p3.owned<Field::param>(s, Extent::kept).offset == L.piece_offset(s, r));
      }
      // a field the partition does not keep is zp's own error, never a span into nothing
      const zp::Partitioned<float, 1> no32(L, r, 2, false);
      CHECK_THROWS_AS(no32.owned<Field::grad_f32>(0, Extent::kept), zp::Error);
    }
  }
}

TEST_CASE("sizes that would wrap around are errors naming the values, never a small buffer") {
  const std::vector<zp::ParamInfo> one = {{"w", 0, 100}};
  // ranks * align wraps: the old layout padded to a multiple of 0 and wrote through a null buffer.
  CHECK_THROWS_WITH_AS(Layout(one, 4, {.align = std::size_t(1) << 62}),
                       doctest::Contains("layout: ranks * align"), zp::Error);
  // the padded total of two huge parameters wraps
  const std::vector<zp::ParamInfo> huge = {{"a", 0, std::size_t(1) << 63},
                                           {"b", 1, std::size_t(1) << 63}};
  CHECK_THROWS_WITH_AS(Layout(huge, 1), doctest::Contains("overflows a 64-bit size"), zp::Error);
  // ... and within one module, naming the parameter that does it
  const std::vector<zp::ParamInfo> one_module = {{"a", 0, std::size_t(1) << 63},
                                                 {"b", 0, std::size_t(1) << 63}};
  CHECK_THROWS_WITH_AS(Layout(one_module, 1), doctest::Contains("module 0 with parameter 'a'"),
                       zp::Error);
  // Modules out of order (a manifest's, or a model's visit) are named, not laid out in part:
  // parameters of a module seen before the last one used to be left at offset 0.
  const std::vector<zp::ParamInfo> back = {{"x", 0, 4}, {"y", 1, 4}, {"z", 0, 4}};
  CHECK_THROWS_WITH_AS(
      Layout(back, 2),
      doctest::Contains("parameter 'z' (#2) is in module 0 after a parameter of module 1"),
      zp::Error);
  const std::vector<zp::ParamInfo> far = {{"x", 0, 4}, {"y", 2147483646, 4}};
  CHECK_THROWS_WITH_AS(Layout(far, 2),
                       doctest::Contains("parameter 'y' (#1) is in module 2147483646"), zp::Error);
  // n * sizeof(T) wraps
  CHECK_THROWS_WITH_AS((zp::Buffer<double>(std::size_t(1) << 62, "test buffer")),
                       doctest::Contains("test buffer: 4611686018427387904 elements of 8 bytes"),
                       zp::Error);
  // An allocation that cannot succeed names what and how much, and the largest parameter. The
  // sanitizers' operator new aborts on such a request instead of throwing bad_alloc, so this
  // part runs in the plain builds only.
#if !ZP_ASAN && !ZP_TSAN
  const std::vector<zp::ParamInfo> big = {{"small", 0, 10},
                                          {"enormous.weight", 1, std::size_t(1) << 60}};
  try {
    zp::Partitioned<float, 0> p(Layout(big, 1), 0, 2);
    FAIL_CHECK("expected out_of_memory");
  } catch (const zp::Error& e) {
    CHECK(e.category() == zp::Errc::out_of_memory);
    CHECK_MESSAGE(
        std::string(e.what()).find("partition: parameters: cannot allocate") != std::string::npos,
        std::string(e.what()));
    CHECK(std::string(e.what()).find(
              "the largest is 'enormous.weight' with 1152921504606846976 elements") !=
          std::string::npos);
  }
#endif
}
