// zp/grid.hpp: a world of DP x PP x TP ranks as three sets of sub-communicators ("3D
// parallelism"): tensor-parallel groups split each layer's matrix products, pipeline-parallel
// groups chain the model's stages, data-parallel groups hold replicas that ZeRO shards over.
//
// Rank order is Megatron-LM's default (tp fastest, then dp, then pp):
//   world rank = tp + TP * (dp + DP * pp)
// so a TP group is TP adjacent ranks (one node when TP <= GPUs per node: its all_reduces, one per
// layer and micro-batch, stay on the fastest links), and PP stages are the farthest apart (their
// point-to-point traffic is the smallest).
//
//   zp::ProcessGrid grid(world, {.dp = 2, .tp = 2, .pp = 2});
//   zp::Engine<B, bf16, 2> engine(grid, model, ...);   // ZeRO over the DP group only
//   grid.tp().all_reduce(...);                          // a row-parallel layer's output
//
// A fourth group, model_parallel(), holds the TP x PP ranks of one replica (the same dp
// coordinate): together they hold the whole model once, so the engine sums its gradient norm
// and overflow check over it (engine.hpp).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "zp/agreement.hpp"
#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"

namespace zp {

// Splits `world` into the groups. Collective over world (an all_reduce of 6 integers that checks
// every rank passed the same shape, then four splits, in the same order on every rank). The
// world must outlive the grid only as far as the backend requires; the groups are
// communicators of their own.
template <Backend B>
class ProcessGrid {
 public:
  ProcessGrid(Collective<B>& world, GridShape shape) : shape_(shape), world_rank_(world.rank()) {
    agree(world, shape);
    ZP_EXPECT(shape.dp >= 1 && shape.tp >= 1 && shape.pp >= 1,
              "grid: dp, tp and pp must be >= 1, got dp=", shape.dp, ", tp=", shape.tp,
              ", pp=", shape.pp);
    const std::int64_t dp_tp =
        std::int64_t(shape.dp) * shape.tp;  // 64-bit: no int overflow on the way
    ZP_EXPECT(dp_tp <= world.size() && dp_tp * shape.pp == world.size(),
              "grid: dp x tp x pp = ", shape.dp, " x ", shape.tp, " x ", shape.pp,
              " does not factor the world of ", world.size(),
              " ranks; the product must equal the world size");
    me_ = coords_of(shape, world.rank());
    // Colour: the coordinates a group shares; key: the coordinate along the group.
    tp_.emplace(world.split(me_.dp + shape.dp * me_.pp, me_.tp));
    dp_.emplace(world.split(me_.tp + shape.tp * me_.pp, me_.dp));
    pp_.emplace(world.split(me_.tp + shape.tp * me_.dp, me_.pp));
    mp_.emplace(world.split(me_.dp, me_.tp + shape.tp * me_.pp));
  }

  const GridShape& shape() const noexcept { return shape_; }
  const GridCoords& coords() const noexcept { return me_; }
  int world_rank() const noexcept { return world_rank_; }
  // The world rank of the rank at other coordinates.
  int rank_of(const GridCoords& c) const {
    ZP_EXPECT(c.dp >= 0 && c.dp < shape_.dp && c.tp >= 0 && c.tp < shape_.tp && c.pp >= 0 &&
                  c.pp < shape_.pp,
              "grid: coordinates (dp ", c.dp, ", tp ", c.tp, ", pp ", c.pp,
              ") are outside the grid ", shape_.dp, " x ", shape_.tp, " x ", shape_.pp);
    return grid_rank(shape_, c);
  }

  // The groups this rank belongs to; rank() in each is the coordinate along it.
  Collective<B>& dp() noexcept { return *dp_; }
  Collective<B>& tp() noexcept { return *tp_; }
  Collective<B>& pp() noexcept { return *pp_; }
  // One replica's TP x PP ranks; rank() = tp + TP * pp.
  Collective<B>& model_parallel() noexcept { return *mp_; }
  bool first_stage() const noexcept { return me_.pp == 0; }
  bool last_stage() const noexcept { return me_.pp == shape_.pp - 1; }

 private:
  // Ranks with different shapes would split into groups that do not match: the shape's spread
  // over the world, before anything else, so that a disagreement, or a shape that is wrong the
  // same way everywhere, throws on every rank.
  static void agree(Collective<B>& world, const GridShape& s) {
    const std::int64_t v[3] = {s.dp, s.tp, s.pp};
    const std::vector<Spread> d = spread(world, std::span<const std::int64_t>(v));
    ZP_EXPECT(d[0].same() && d[1].same() && d[2].same(),
              "grid: the ranks disagree on the shape: this rank ", "(world rank ", world.rank(),
              ") has dp x tp x pp = ", s.dp, " x ", s.tp, " x ", s.pp,
              ", but across the world dp ranges over [", d[0].lo, ", ", d[0].hi, "], tp over [",
              d[1].lo, ", ", d[1].hi, "], pp over [", d[2].lo, ", ", d[2].hi,
              "]; every rank must build the same grid");
  }

  GridShape shape_;
  int world_rank_;
  GridCoords me_;
  std::optional<Collective<B>> tp_, dp_, pp_, mp_;
};

}  // namespace zp
