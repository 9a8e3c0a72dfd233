// zp/whole_model.hpp: the whole model to and from one rank's partition (Partitioned<T, Stage>):
// the model's initial values scattered into each stage's buffers, and a field (parameters,
// master weights, an optimizer state array) visited segment by segment as the whole model, for
// whole-model copies and exports. Where a field lives and what a rank keeps of it come from the
// partition's ownership query; nothing here depends on the stage.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <exception>
#include <limits>
#include <span>
#include <vector>

#include "zp/agreement.hpp"
#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/memory.hpp"
#include "zp/model.hpp"
#include "zp/partition.hpp"

namespace zp {

// Fills [first, first + n) of segment s's full-layout range (at `out`, in host memory) from
// `initializer` (EngineConfig::initializer), naming the parameter when it throws or leaves an
// element unwritten (NaN).
inline void fill_from_initializer(const Layout& L, int s, std::size_t first, std::span<float> out,
                                  const Initializer& initializer) {
  std::ranges::fill(out, 0.0f);  // the padding
  L.for_each_param_in(s, first, out.size(), [&](int p, std::size_t b, std::size_t e) {
    const Layout::Param& lp = L.params()[std::size_t(p)];
    const std::span<float> mine = out.subspan(b - first, e - b);
    std::ranges::fill(mine, std::numeric_limits<float>::quiet_NaN());
    const auto failed = [&](const char* what) {
      return Error(Errc::invalid_argument,
                   detail::cat("engine: the initializer failed on parameter '", lp.name,
                               "' elements [", b - lp.offset, ", ", e - lp.offset, "): ", what));
    };
    try {
      initializer(lp.name, b - lp.offset, mine);
    } catch (const std::exception& x) {
      throw failed(x.what());
    } catch (...) {
      throw failed("an exception not derived from std::exception");
    }
    const auto nan = std::ranges::find_if(mine, [](float v) { return std::isnan(v); });
    ZP_EXPECT(nan == mine.end(), "engine: the initializer left element ",
              b - lp.offset + std::size_t(nan - mine.begin()), " of parameter '", lp.name,
              "' NaN (asked for elements [", b - lp.offset, ", ", e - lp.offset,
              ")); it must write every element it is asked for");
  });
}

// Writes the model's initial values into part's parameters and fp32 master weights: from the
// model's bound value views (by parameter index) or, where given, from `initializer` for only
// the elements this rank keeps (EngineConfig::initializer). broadcast: rank 0's values go to every
// rank (the other ranks' views may be unbound); else every rank's views must hold them, and where
// hybrid sharding has `replicas` they take their first group's (the replicas must be one model).
// One segment at a time, so that no rank ever holds the whole model (stage 3's models need not
// fit one device). Collective: a rank's failure is recorded and agreed on after the last
// broadcast, so no rank leaves the others waiting in one; `word` as on_every_rank's (the
// engine's, so that the agreements allocate nothing beside the segment).
template <class T, int Stage, MemorySpace S, Backend B>
void load_initial_values(Collective<B>& comm, const Partitioned<T, Stage, S>& part,
                         std::span<View<T>* const> values, bool broadcast, Collective<B>* replicas,
                         const Initializer& initializer, std::span<double> word) {
  const Layout& L = part.layout();
  const auto& ps = L.params();
  Buffer<T, S> init;
  on_every_rank(
      comm,
      [&] {  // a rank without values or memory: an error on every rank
        for (std::size_t p = 0; p < ps.size() && !initializer; ++p)
          ZP_EXPECT(values[p]->bound() || (broadcast && comm.rank() != 0), "engine: parameter '",
                    ps[p].name, "' has no initial values on rank ", comm.rank(),
                    " (its value view is unbound); point it at the model's initial weights");
        init = Buffer<T, S>(L.largest_segment(), "engine: a segment's initial values");
      },
      word);
  Collective<B>* from_first = initializer ? nullptr : broadcast ? &comm : replicas;
  if (from_first && from_first->size() == 1) from_first = nullptr;  // whose rank 0's values win
  const bool own = !from_first || from_first->rank() == 0;
  std::vector<T> staged, staged_t;
  std::vector<float> given;
  std::exception_ptr failed;
  const auto unless_failed = [&](auto&& f) {
    if (failed) return;
    try {
      f();
    } catch (...) {
      failed = std::current_exception();
    }
  };
  for (int s = 0; s < L.segment_count(); ++s) {
    const auto& seg = L.segment(s);
    const std::span<T> segment = init.span(0, seg.size);
    unless_failed([&] {
      // The parameters' kept extent holds the master weights' kept extent.
      const bool whole = part.whole(Field::param);
      const std::size_t first = whole ? seg.offset : L.piece_offset(s, part.rank()),
                        n = whole ? seg.size : seg.piece;
      Memory<S>::zero(segment);  // the padding
      if (initializer) {
        given.resize(n);
        fill_from_initializer(L, s, first, given, initializer);
        staged_t.resize(n);
        std::ranges::transform(given, staged_t.begin(), [](float v) { return T(v); });
        Memory<S>::from_host(segment.subspan(first - seg.offset, n), std::span<const T>(staged_t));
      } else if (own) {
        for (int p : seg.params)
          Memory<S>::from_host(
              segment.subspan(ps[std::size_t(p)].offset - seg.offset, ps[std::size_t(p)].size),
              std::span<const T>(values[std::size_t(p)]->span()));
      }
    });
    if (from_first) from_first->broadcast(segment, 0);
    unless_failed([&] {
      part.template access<Field::param>(
          s, Extent::kept, 0, Access::write, [&](Owned<T> param, bool host) {
            const auto from =
                std::span<const T>(segment).subspan(param.offset - seg.offset, param.span.size());
            if (host)
              std::ranges::copy(host_view<S>(from, false, staged_t), param.span.begin());
            else
              Memory<S>::copy(param.span, from);
          });
      part.template access<Field::master>(
          s, Extent::kept, 0, Access::write, [&](Owned<float> master, bool host) {
            const auto from =
                std::span<const T>(segment).subspan(master.offset - seg.offset, master.span.size());
            if (host)
              Memory<MemorySpace::host>::convert(master.span, host_view<S>(from, false, staged));
            else
              Memory<S>::convert(master.span, from);
          });
    });
  }
  unless_failed([&] { part.flush_swaps(); });
  init = Buffer<T, S>();
  on_every_rank(
      comm,
      [&] {  // a swap file, the initializer or a copy that failed on any rank
        if (failed) std::rethrow_exception(failed);
      },
      word);
}

// Points the views of segment s's parameters (views: by parameter index) into memory holding
// the segment (`base`: its first element), or at nothing (null).
template <class T>
void bind_segment(const Layout& L, int s, std::span<View<T>* const> views, T* base) {
  const auto& seg = L.segment(s);
  for (int p : seg.params)
    views[std::size_t(p)]->rebind(base ? base + (L.params()[std::size_t(p)].offset - seg.offset)
                                       : nullptr);
}

// Points the model's value and gradient views at the partition's parameters and gradients where
// the stage keeps them whole, else at nothing: stage 3's gathers and stage 2/3's buckets point
// them while a module runs.
template <class T, int Stage, MemorySpace S>
void bind_views(const Partitioned<T, Stage, S>& part, const BoundParameters<T>& bound) {
  const Layout& L = part.layout();
  for (int s = 0; s < L.segment_count(); ++s) {
    const std::size_t at = L.segment(s).offset;
    T* values =
        part.whole(Field::param) ? part.template buffer<Field::param>().data() + at : nullptr;
    T* grads = part.whole(Field::grad) ? part.template buffer<Field::grad>().data() + at : nullptr;
    bind_segment<T>(L, s, bound.values, values);
    bind_segment<T>(L, s, bound.grads, grads);
  }
}

// Points at nothing the views that still point where bind_views put them (an engine going away):
// one that an engine built on the model since has pointed into its own memory stays there.
template <class T, int Stage, MemorySpace S>
void unbind_views(const Partitioned<T, Stage, S>& part, const BoundParameters<T>& bound) {
  const Layout& L = part.layout();
  const auto unbind = [&](std::span<View<T>* const> views, std::span<const T> whole) {
    for (std::size_t p = 0; p < L.params().size(); ++p)
      if (views[p]->data() == whole.data() + L.params()[p].offset) views[p]->rebind(nullptr);
  };
  if (part.whole(Field::param)) unbind(bound.values, part.template buffer<Field::param>());
  if (part.whole(Field::grad)) unbind(bound.grads, part.template buffer<Field::grad>());
}

// Visits field F (k: the optimizer state array) of the whole model one segment at a time, in
// segment order: fn(s, the whole segment s, in host memory if `host` else in S, host). A field
// the stage keeps whole is read in place; a sharded one is all-gathered, one segment buffer at a
// time, so no rank holds more than one segment of it. Collective where F is sharded: every rank
// visits every segment, and a rank whose own piece cannot be read (a swap file's I/O error)
// still joins every gather and calls fn no more: its error is returned, for the caller to agree
// on (the others' fn saw that rank's piece unwritten), where a throw would leave them waiting.
template <Field F, class T, int Stage, MemorySpace S, Backend B, class Fn>
[[nodiscard]] std::exception_ptr for_each_whole_segment(Collective<B>& comm,
                                                        const Partitioned<T, Stage, S>& part, int k,
                                                        Fn&& fn) {
  using U = typename Partitioned<T, Stage, S>::template elem<F>;
  const Layout& L = part.layout();
  Buffer<U, S> segment, staged;
  std::exception_ptr failed;
  for (int s = 0; s < L.segment_count(); ++s) {
    const std::size_t size = L.segment(s).size;
    if constexpr (Partitioned<T, Stage, S>::whole(F)) {
      part.template access<F>(s, Extent::kept, k, Access::read, [&](Owned<U> whole, bool host) {
        fn(s, std::span<const U>(whole.span), host);
      });
    } else {
      if (segment.size() < size)
        segment = Buffer<U, S>(L.largest_segment(), "whole model: one segment");
      bool gathered = false;
      if (!failed) {
        try {
          part.template access<F>(
              s, Extent::piece, k, Access::read, [&](Owned<U> piece, bool host) {
                const auto in = space_view<S>(std::span<const U>(piece.span), host, staged);
                gathered = true;  // from here on a failure is the collective's, on every rank
                comm.all_gather(in, segment.span(0, size));
              });
        } catch (...) {
          if (gathered) throw;
          failed = std::current_exception();
        }
      }
      if (!gathered) {  // this rank's slot, in place: the others get what it holds
        const std::size_t piece = L.segment(s).piece;
        comm.all_gather(std::span<const U>(segment.span(std::size_t(comm.rank()) * piece, piece)),
                        segment.span(0, size));
      }
      if (!failed) fn(s, std::span<const U>(segment.span(0, size)), false);
    }
  }
  return failed;
}

// Field F of the whole model on every rank, unpadded, in forward order (the concatenation of the
// parameters as the model visits them). Collective where F is sharded; then a piece that one
// rank could not read is an error on every rank.
template <Field F, class T, int Stage, MemorySpace S, Backend B>
auto gather_whole(Collective<B>& comm, const Partitioned<T, Stage, S>& part, int k = 0) {
  using U = typename Partitioned<T, Stage, S>::template elem<F>;
  const Layout& L = part.layout();
  std::vector<U> out(L.used()), staged;
  std::vector<std::size_t> at(L.params().size());  // each parameter's place in forward order
  for (std::size_t p = 1; p < at.size(); ++p) at[p] = at[p - 1] + L.params()[p - 1].size;
  const std::exception_ptr failed =
      for_each_whole_segment<F>(comm, part, k, [&](int s, std::span<const U> values, bool host) {
        const auto& seg = L.segment(s);
        const std::span<const U> h = host_view<S>(values, host, staged);
        for (int p : seg.params) {
          const auto& lp = L.params()[std::size_t(p)];
          std::copy_n(h.begin() + std::ptrdiff_t(lp.offset - seg.offset), lp.size,
                      out.begin() + std::ptrdiff_t(at[std::size_t(p)]));
        }
      });
  if constexpr (!Partitioned<T, Stage, S>::whole(F))  // a piece one rank could not read
    on_every_rank(comm, [&] {
      if (failed) std::rethrow_exception(failed);
    });
  return out;
}

}  // namespace zp
