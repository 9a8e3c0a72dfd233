// zp/layout.hpp: the flat, padded, sharded layout of a model's parameters (Layout): pure index
// math, beneath the buffers (partition.hpp), the backends and the checkpoint format.
//
// Layout. The parameters are laid out in backward order (last module first) in one flat buffer
// of T, cut into segments: a segment holds whole parameters of one module, at most
// bucket_elems of them (the first segment at most first_bucket_elems, so the first reduction
// starts early), unless a single parameter is larger. Each segment is padded to a multiple of
// ranks * align and cut into `ranks` equal contiguous pieces, piece r at segment.offset + r *
// piece: that is the ZeRO layout of Collective's in-place reduce_scatter and all_gather, so a
// segment is reduced and gathered in place with one call. Rank r's shard is the concatenation
// of its pieces (shard space, `shard` elements, piece of segment s at segment.shard_offset).
// With by_tp_kind a segment also holds parameters of one TensorParallel kind only: ZeRO++ on a
// tensor-parallel grid quantizes each piece in blocks, and a block that mixed a replicated
// parameter with this TP rank's slice of a split one would give the replicated one a scale, so
// values, that differ between the TP ranks. Cut so, a replicated run's segments are the same on
// every TP rank (whatever the split slices' sizes before them), and so are its blocks.
// Shards are disjoint, cover the buffer and have equal sizes. Padding per segment is less than
// ranks * align elements, so total - Psi < segments * ranks * align.
//
// A segment is also a gradient bucket (bucket.hpp) and a unit of stage 3's gather, so a module
// is one or more whole segments and its parameters occupy one contiguous range.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "zp/detail/hash.hpp"
#include "zp/error.hpp"
#include "zp/model.hpp"

namespace zp {

// The shape of a DP x TP x PP grid of ranks and Megatron-LM's rank order over it (tp fastest,
// then dp, then pp): the index math of grid.hpp's groups and of checkpoints saved on a grid.
struct GridShape {
  int dp = 1, tp = 1, pp = 1;
  int size() const noexcept { return dp * tp * pp; }
};

// One rank's coordinates in a grid.
struct GridCoords {
  int dp = 0, tp = 0, pp = 0;
  friend bool operator==(const GridCoords&, const GridCoords&) = default;
};

// Megatron's order; inverse of coords_of.
constexpr int grid_rank(const GridShape& s, const GridCoords& c) noexcept {
  return c.tp + s.tp * (c.dp + s.dp * c.pp);
}
constexpr GridCoords coords_of(const GridShape& s, int rank) noexcept {
  return {(rank / s.tp) % s.dp, rank % s.tp, rank / (s.tp * s.dp)};
}

struct LayoutOptions {
  std::size_t bucket_elems = std::size_t(1) << 23;        // per segment (bucket), at most
  std::size_t first_bucket_elems = std::size_t(1) << 19;  // the first bucket in backward order
  std::size_t align = 16;                                 // piece sizes are multiples of this
  bool by_tp_kind = false;  // segments keep to one TensorParallel kind (see the top)
};

class Layout {
 public:
  struct Param {
    std::string name;
    int module = 0;
    std::size_t size = 0;
    std::size_t offset = 0;  // in the full buffer
    int segment = 0;
  };
  struct Segment {
    int module = 0;
    std::size_t offset = 0;        // in the full buffer
    std::size_t size = 0;          // padded: ranks * piece
    std::size_t used = 0;          // parameter elements, the rest is padding
    std::size_t piece = 0;         // per rank
    std::size_t shard_offset = 0;  // of every rank's piece, in its shard
    std::vector<int> params;       // indices into params(), in layout order
  };
  struct Module {
    int first_segment = 0, end_segment = 0;  // segments [first, end)
    std::size_t offset = 0, size = 0;        // contiguous range in the full buffer (padded)
    std::size_t used = 0;                    // parameter elements
  };

  Layout() = default;

  // Lays out `params` (forward order, as describe_parameters returns them) for `ranks` ranks
  // (by_tp_kind: by each one's tp).
  Layout(std::span<const ParamInfo> params, int ranks, const LayoutOptions& opt = {})
      : ranks_(ranks), options_(opt) {
    ZP_EXPECT(ranks >= 1, "layout: ranks must be >= 1, got ", ranks);
    ZP_EXPECT(opt.align >= 1, "layout: align must be >= 1");
    ZP_EXPECT(opt.bucket_elems >= 1 && opt.first_bucket_elems >= 1,
              "layout: bucket sizes must be >= 1 element, got ", opt.bucket_elems, " and ",
              opt.first_bucket_elems);
    expect_forward_order(params);
    const int modules = params.back().module + 1;
    params_.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i)
      params_[i] = {params[i].name, params[i].module, params[i].size, 0, 0};
    modules_.resize(std::size_t(modules));
    // Sizes are checked as they add up: a wrapped total would allocate too little and then be
    // written past (an align so large that ranks * align wraps, parameters summing past 2^64).
    const std::size_t quantum =
        detail::checked_mul(std::size_t(ranks), opt.align, "layout: ranks * align");
    auto close = [&](Segment& s) {
      const std::size_t quanta = s.used / quantum + (s.used % quantum != 0);
      s.size = std::max<std::size_t>(
          quantum,
          detail::checked_mul(quanta, quantum, "layout: padded segment of module ", s.module));
      s.piece = s.size / std::size_t(ranks);
      s.shard_offset = shard_;
      shard_ += s.piece;
      total_ = detail::checked_add(total_, s.size, "layout: total elements with module ", s.module);
      used_ += s.used;
      segments_.push_back(std::move(s));
    };
    // Backward order: modules from last to first, parameters from last to first.
    std::size_t i = params.size();
    for (int m = modules - 1; m >= 0; --m) {
      Module& mod = modules_[std::size_t(m)];
      mod.first_segment = int(segments_.size());
      mod.offset = total_;
      Segment seg;
      seg.module = m;
      seg.offset = total_;
      bool any = false;
      while (i > 0 && params[i - 1].module == m) {
        --i;
        const std::size_t cap = segments_.empty() ? opt.first_bucket_elems : opt.bucket_elems;
        const bool other_kind =
            opt.by_tp_kind && any && params[i].tp != params[std::size_t(seg.params.back())].tp;
        if (any && (seg.used + params[i].size > cap || other_kind)) {
          close(seg);
          seg = Segment{};
          seg.module = m;
          seg.offset = total_;
        }
        Param& p = params_[i];
        p.offset = seg.offset + seg.used;
        p.segment = int(segments_.size());
        seg.used = detail::checked_add(seg.used, p.size, "layout: module ", m, " with parameter '",
                                       p.name, "'");
        seg.params.push_back(int(i));
        any = true;
      }
      ZP_EXPECT(any, "layout: module ", m, " has no parameters; number modules without gaps");
      close(seg);
      mod.end_segment = int(segments_.size());
      mod.size = total_ - mod.offset;
      for (int s = mod.first_segment; s < mod.end_segment; ++s)
        mod.used += segments_[std::size_t(s)].used;
    }
    hash_ = compute_hash();
  }

  int ranks() const noexcept { return ranks_; }
  const LayoutOptions& options() const noexcept { return options_; }
  std::size_t total() const noexcept { return total_; }  // padded elements, ranks * shard
  std::size_t shard() const noexcept { return shard_; }  // per rank
  std::size_t used() const noexcept { return used_; }    // Psi, the parameter elements
  const std::vector<Param>& params() const noexcept { return params_; }
  const std::vector<Segment>& segments() const noexcept { return segments_; }
  const std::vector<Module>& modules() const noexcept { return modules_; }
  int segment_count() const noexcept { return int(segments_.size()); }
  int module_count() const noexcept { return int(modules_.size()); }
  const Segment& segment(int s) const { return segments_.at(std::size_t(s)); }
  // Calls f(p, b, e) for each parameter p of segment s that holds elements of the full-layout
  // range [first, first + n), [b, e) being those elements, in layout order.
  template <class F>
  void for_each_param_in(int s, std::size_t first, std::size_t n, F&& f) const {
    for (int p : segment(s).params) {
      const Param& lp = params_[std::size_t(p)];
      const std::size_t b = std::max(first, lp.offset),
                        e = std::min(first + n, lp.offset + lp.size);
      if (b < e) f(p, b, e);
    }
  }
  const Module& module(int m) const { return modules_.at(std::size_t(m)); }
  std::size_t largest_segment() const noexcept {
    std::size_t n = 0;
    for (const auto& s : segments_) n = std::max(n, s.size);
    return n;
  }
  // Offset in the full buffer of rank r's piece of segment s.
  std::size_t piece_offset(int s, int r) const {
    const Segment& g = segment(s);
    return g.offset + std::size_t(r) * g.piece;
  }
  // A fingerprint of everything that must agree across ranks (names, modules, sizes, offsets).
  std::uint64_t hash() const noexcept { return hash_; }

 private:
  // Forward order: modules 0, 1, 2, ... each a contiguous run of parameters.
  static void expect_forward_order(std::span<const ParamInfo> params) {
    ZP_EXPECT(!params.empty(), "layout: no parameters");
    for (std::size_t i = 0; i < params.size(); ++i) {
      const int prev = i ? params[i - 1].module : 0;
      ZP_EXPECT(params[i].module == prev || params[i].module == prev + 1, "layout: parameter '",
                params[i].name, "' (#", i, ") is in module ", params[i].module, " after ",
                i ? "a parameter of module " + std::to_string(prev) : std::string("none"),
                "; modules must be numbered 0, 1, 2, ... in forward order, each a contiguous run "
                "of parameters");
    }
  }
  std::uint64_t compute_hash() const {
    detail::Fnv1a h;
    h.add(std::uint64_t(ranks_));
    for (const auto& p : params_)
      h.all(std::string_view(p.name), std::uint64_t(p.module), p.size, p.offset);
    for (const auto& s : segments_) h.add(s.size);
    return h.value();
  }

  int ranks_ = 1;
  LayoutOptions options_;
  std::size_t total_ = 0, shard_ = 0, used_ = 0;
  std::vector<Param> params_;
  std::vector<Segment> segments_;
  std::vector<Module> modules_;
  std::uint64_t hash_ = 0;
};

}  // namespace zp
