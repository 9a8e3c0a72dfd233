// zp/bucket.hpp: gradient buckets. Gradients are written by the model's backward straight into
// bucket memory (the model's grad views point into it); a bucket launches its reduction, async,
// as soon as every gradient in it is written, so communication overlaps the rest of backward.
//
// One bucket per Layout segment, numbered in backward order. Buckets launch strictly in one
// order, the same on every rank: a bucket that becomes ready early waits for the ones before it,
// so the ranks' collective sequences agree even if their gradients become ready in different
// orders. That order starts as the buckets' numbering and then follows the model: each
// micro-step records the order its buckets became ready in (proposal()), and where every rank of
// the group recorded the same one at an optimizer step (the engine compares fingerprints in the
// step's statistics all_reduce) all follow it from the next micro-step (follow_proposal()). So a
// backward that runs modules out of the layout's order overlaps its reductions from the second
// step on. While buckets wait for ones before them, scatter_accumulate may run out of scratch
// slots: it then allocates one more, and following an agreed order frees the extras again.
//
// Reductions (ReduceOp::avg over ranks; the sum runs in rank order in the threads backend):
//   Reduction::all_reduce           stage 0: the whole bucket, in place in the full gradient buffer
//   Reduction::scatter_in_place     stage 1: reduce_scatter in place in the full gradient buffer;
//                                   this rank's piece holds the result (half all_reduce's bytes)
//   Reduction::scatter_accumulate   stage 2/3: the bucket lives in a scratch slot from a small
//                                   pool; after the reduce_scatter this rank's piece is copied
//                                   (first micro-step of an accumulation window) or added (later
//                                   ones) into the shard accumulator and the slot is recycled.
// Stage 0/1 reduce only at the accumulation boundary (sync on); in between, gradients accumulate
// locally in the full buffer without communication.
//
// Quantized (ZeRO++'s qgZ, quantize_gradients(); scatter_accumulate): a bucket's
// reduce_scatter is quantized_collectives.hpp's two-hop one, in flight while backward goes on:
// bucket k's hop 1 starts when it launches, its hop 2 when bucket k + 1 launches, and it ends
// when bucket k + 2 launches (or at finish()), so each hop overlaps about one bucket's backward.
// Those points are the same on every rank, so every rank issues the hops in one order. Two run
// at once, each in a scratch set of its own. Its completion writes the fp32 average to this
// rank's piece of the slot (rounded to the reduction's type) and folds as usual.
//
// Hybrid sharding (average_over(): the engine's replicas): at the accumulation boundary each
// bucket's piece, once final (scatter_accumulate: folded on the window's last micro-step, while
// backward goes on; scatter_in_place: its reduce_scatter waited for in finish()), is averaged
// with the replicas' by an all_reduce of its own, and finish() waits for those too.
//
// Precision (GradPrecision, DeepSpeed's grad_accum_dtype and communication_data_type): the model
// always writes T. With fp32 accumulation, stage 0/1 add each micro-step's T gradients into a
// full fp32 buffer (and zero the T ones) when a bucket is complete, stage 2/3 keep an fp32 shard
// accumulator; with fp32 communication a bucket is widened to fp32 before its reduction (stage
// 0/1 in the fp32 buffer, stage 2/3 in fp32 scratch slots). Otherwise fp32 sums are rounded to
// T once before a T reduction.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

#include "zp/collective.hpp"
#include "zp/detail/hash.hpp"
#include "zp/dtype.hpp"
#include "zp/error.hpp"
#include "zp/memory.hpp"
#include "zp/partition.hpp"
#include "zp/quantized_collectives.hpp"

namespace zp {

enum class Reduction : std::uint8_t { all_reduce, scatter_in_place, scatter_accumulate };

struct GradPrecision {
  bool accumulate_f32 = false;  // accumulate micro-steps in fp32 (else in T)
  bool reduce_f32 = false;      // reduce across ranks in fp32 (else in T)

  // DeepSpeed's data_types.grad_accum_dtype and communication_data_type for a model of type t
  // at a stage with `gas` micro-steps per optimizer step; unset: DeepSpeed's defaults (bf16 at
  // stage 0 accumulates in fp32, everything else in t).
  static GradPrecision resolve(DType t, int stage, std::optional<DType> accumulate,
                               std::optional<DType> reduce, std::int64_t gas) {
    const DType acc = accumulate.value_or(t == DType::bf16 && stage == 0 ? DType::f32 : t);
    const DType red = reduce.value_or(t);
    ZP_EXPECT(acc == t || acc == DType::f32, "engine: grad_accum_dtype must be f32 or the model's ",
              name(t), ", got ", name(acc));
    ZP_EXPECT(red == t || red == DType::f32,
              "engine: communication_dtype must be f32 or the model's ", name(t), ", got ",
              name(red));
    return {t != DType::f32 && acc == DType::f32 && gas > 1, t != DType::f32 && red == DType::f32};
  }
  // Whether a stage keeps an fp32 gradient buffer beside the T one (Partitioned's grad_f32).
  bool f32_buffer(int stage) const noexcept {
    return stage < 2 ? accumulate_f32 || reduce_f32 : accumulate_f32;
  }
  // Whether the optimizer reads the averaged gradient in fp32: reduced (stage 0/1) or
  // accumulated (stage 2/3) in fp32.
  bool f32_result(int stage) const noexcept { return stage < 2 ? reduce_f32 : accumulate_f32; }
};

// The reduction of each ZeRO stage (the table at the top of this file).
constexpr Reduction reduction_of(int stage) noexcept {
  return stage == 0   ? Reduction::all_reduce
         : stage == 1 ? Reduction::scatter_in_place
                      : Reduction::scatter_accumulate;
}

namespace detail {
// x[i] /= n (qgZ's average: a division, as a reduction's avg does).
struct DivideBy {
  float* x;
  float n;
  ZP_HOST_DEVICE void operator()(std::size_t i) const { x[i] /= n; }
};
}  // namespace detail

// The state of one bucket within a micro-step.
template <class Work>
struct GradBucket {
  enum class State : std::uint8_t { idle, filling, ready, launched };
  int segment = 0;
  State state = State::idle;
  int slot = -1;        // scratch slot (scatter_accumulate), -1 otherwise
  bool folded = false;  // stage 0/1 fp32 accumulation: this micro-step's T gradients added
  Work work{};
};

// All buckets of one rank. Holds references to the communicator and the gradient memory; the
// owner (the engine) keeps both alive.
template <class T, Backend B, MemorySpace S = B::memory>
class GradBuckets {
 public:
  using Work = typename Collective<B>::Work;
  using Bucket = GradBucket<Work>;

  // full_grads: the full gradient buffer (all_reduce, scatter_in_place); shard_accumulator: the
  // shard-space gradient (scatter_accumulate); the fp32 ones where GradPrecision uses fp32 (stage
  // 0/1: a full buffer when accumulating or reducing in fp32; stage 2/3: the shard accumulator
  // when accumulating in fp32). slots: scratch buckets for scatter_accumulate (at least the
  // largest number of segments in one module, plus one for overlap).
  GradBuckets(Collective<B>& comm, const Layout& layout, Reduction reduction,
              std::span<T> full_grads, std::span<T> shard_accumulator, std::size_t slots,
              GradPrecision precision = {}, std::span<float> full_grads_f32 = {},
              std::span<float> shard_accumulator_f32 = {})
      : comm_(&comm),
        layout_(&layout),
        reduction_(reduction),
        precision_(precision),
        full_(full_grads),
        acc_(shard_accumulator),
        full32_(full_grads_f32),
        acc32_(shard_accumulator_f32) {
    buckets_.resize(std::size_t(layout.segment_count()));
    for (int s = 0; s < layout.segment_count(); ++s) {
      buckets_[std::size_t(s)].segment = s;
      order_.push_back(s);
    }
    proposal_ = order_;
    if (reduction_ == Reduction::scatter_accumulate) {
      kept_slots_ = kept_slots(layout, slots);
      while (slots_.size() < kept_slots_) add_slot();
      ZP_EXPECT((precision_.accumulate_f32 ? acc32_.size() : acc_.size()) == layout.shard(),
                "buckets: the shard accumulator does not hold ", layout.shard(), " elements");
    } else {
      ZP_EXPECT(full_.size() == layout.total(), "buckets: the full gradient buffer has ",
                full_.size(), " elements, the layout ", layout.total());
      ZP_EXPECT(
          !(precision_.accumulate_f32 || precision_.reduce_f32) || full32_.size() == layout.total(),
          "buckets: fp32 accumulation or reduction needs a full fp32 gradient buffer of ",
          layout.total(), " elements");
    }
  }
  // The buckets of a stage's partition: its reduction, and its gradient buffers where it keeps them.
  template <int Stage>
  GradBuckets(Collective<B>& comm, const Partitioned<T, Stage, S>& part, std::size_t slots,
              GradPrecision precision)
      : GradBuckets(comm, part.layout(), reduction_of(Stage),
                    whole_or_none<Field::grad>(part, true), whole_or_none<Field::grad>(part, false),
                    slots, precision, whole_or_none<Field::grad_f32>(part, true),
                    whole_or_none<Field::grad_f32>(part, false)) {}
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;
  // Completes every reduction still in flight before the scratch slots (and the gradient memory
  // the owner frees next) go: a reduction must never outlive the memory it writes.
  ~GradBuckets() { wait_all_quietly(); }

  // Waits for every launched reduction, dropping errors (teardown and unwinding paths).
  void wait_all_quietly() noexcept {
    for (auto& b : buckets_) b.work = Work{};
    replica_works_.clear();
    if (qgz_)  // each hop in flight waited for (every rank started it); no hop started here
      for (auto& set : qgz_->sets) set.op.reset();
  }

  // Reduces every bucket from now on with qgZ's quantized two-hop reduce_scatter over nodes
  // (`node`: this rank's node, `peers`: the ranks of its local index, one per node).
  void quantize_gradients(Collective<B>& node, Collective<B>& peers, const quant::Format& f) {
    f.check();
    ZP_EXPECT(reduction_ == Reduction::scatter_accumulate,
              "engine: quantized gradients (zero_quantized_gradients) need ZeRO stage 2 or 3");
    ZP_EXPECT(node.size() * peers.size() == comm_->size() &&
                  comm_->rank() == peers.rank() * node.size() + node.rank(),
              "buckets: nodes of ", node.size(), " ranks x ", peers.size(),
              " nodes do not lay out the ", comm_->size(), " ranks");
    const std::size_t piece = qgz_piece(*layout_, comm_->size());
    const auto need =
        quant::reduce_scratch(f, std::size_t(comm_->size()), std::size_t(peers.size()), piece);
    qgz_.emplace(Quantized{&node, &peers, f, {}});
    for (auto& set : qgz_->sets)
      set = {Buffer<std::int32_t, S>(need.records, "buckets: quantized records"),
             Buffer<std::int32_t, S>(need.records, "buckets: quantized records"),
             Buffer<float, S>(need.partial + piece, "buckets: quantized partial sums"), nullptr,
             -1};
  }
  // The scratch quantize_gradients allocates for `ranks` ranks in `nodes` nodes.
  static std::size_t quantized_scratch_bytes(const Layout& layout, int ranks, int nodes,
                                             const quant::Format& f) {
    f.check();
    const std::size_t piece = qgz_piece(layout, ranks);
    const auto need = quant::reduce_scratch(f, std::size_t(ranks), std::size_t(nodes), piece);
    return std::tuple_size_v<decltype(Quantized::sets)> *
           (2 * need.records * sizeof(std::int32_t) + (need.partial + piece) * sizeof(float));
  }

  // Hybrid sharding: averages every bucket's final piece over `replicas` (this rank's peers in
  // the other shard groups) as it completes at the accumulation boundary.
  void average_over(Collective<B>& replicas) {
    ZP_EXPECT(reduction_ != Reduction::all_reduce,
              "engine: hybrid sharding needs ZeRO stage 1, 2 or 3 (stage 0 shards nothing)");
    replicas_ = &replicas;
  }

  // The scratch the constructor allocates for these settings (scratch_bytes() then): the
  // slots kept between micro-steps, each the largest segment (and its fp32 twin).
  static std::size_t first_scratch_bytes(const Layout& layout, Reduction reduction,
                                         std::size_t slots, GradPrecision precision) {
    if (reduction != Reduction::scatter_accumulate) return 0;
    return kept_slots(layout, slots) * layout.largest_segment() *
           (sizeof(T) + (precision.reduce_f32 ? sizeof(float) : 0));
  }

  int count() const noexcept { return int(buckets_.size()); }
  Reduction reduction() const noexcept { return reduction_; }
  // Bytes of scratch bucket memory (stage 2/3; 0 when buckets are the full gradient buffer).
  std::size_t scratch_bytes() const noexcept {
    std::size_t b = 0;
    for (const auto& s : slots_) b += s.bytes();
    for (const auto& s : slots32_) b += s.bytes();
    if (qgz_)
      for (const auto& set : qgz_->sets)
        b += set.send.bytes() + set.recv.bytes() + set.sums.bytes();
    return b;
  }

  // Whether this micro-step reduces (stage 0/1: only at the accumulation boundary), and whether
  // it is the first of its accumulation window (scatter_accumulate copies instead of adding).
  void begin_micro_step(bool sync, bool first_in_window) {
    ZP_ASSERT(inflight_.empty() && next_ == 0 && replica_works_.empty(),
              "buckets: a micro-step began before the last one finished");
    seen_.clear();
    last_ = sync;
    sync_ = sync || reduction_ == Reduction::scatter_accumulate;
    first_ = first_in_window;
  }

  // The memory the model writes bucket s's gradients into (full-space segment layout: parameter
  // p at p.offset - segment.offset). scatter_accumulate takes a zeroed scratch slot, waiting for
  // the oldest in-flight bucket if none is free, or, with none in flight (the others filled wait
  // for a bucket before them in the launch order), allocating one more.
  std::span<T> acquire(int s) {
    Bucket& b = at(s);
    if (reduction_ != Reduction::scatter_accumulate) return segment_span(s);
    if (b.state == Bucket::State::idle) {
      while (free_.empty()) {
        if (inflight_.empty())
          add_slot();
        else
          complete(inflight_.front());
      }
      b.slot = free_.back();
      free_.pop_back();
      b.state = Bucket::State::filling;
      Memory<S>::zero(slot_span(b));
    }
    ZP_EXPECT(
        b.state == Bucket::State::filling, "buckets: segment ", s,
        " was already reduced in this micro-step; each module's backward runs once per micro-step");
    return slot_span(b);
  }

  // Bucket s's gradients are all written. Launches every ready bucket in bucket order (when this
  // micro-step reduces).
  void ready(int s) {
    Bucket& b = at(s);
    ZP_EXPECT(b.state != Bucket::State::launched, "buckets: segment ", s,
              " was written after its reduction started in this micro-step; each module's backward "
              "runs once per micro-step");
    if (reduction_ == Reduction::scatter_accumulate)
      ZP_ASSERT(b.state == Bucket::State::filling, "buckets: segment ", s,
                " marked ready without memory");
    if (b.state != Bucket::State::ready) seen_.push_back(s);
    b.state = Bucket::State::ready;
    fold(b);
    if (sync_) launch_ready();
  }

  // Launches every bucket not launched yet (their untouched gradients count as written: an
  // unused parameter contributes zero, it does not hang the step), in order.
  void launch_all() {
    for (std::size_t k = sync_ ? next_ : 0; k < order_.size(); ++k) {
      Bucket& b = at(order_[k]);
      if (b.state == Bucket::State::launched) continue;
      if (b.state != Bucket::State::ready) seen_.push_back(b.segment);  // last in the proposal
      if (!sync_) {  // stage 0/1 between boundaries: only the fp32 accumulation
        fold(b);
        continue;
      }
      if (b.state == Bucket::State::idle && reduction_ == Reduction::scatter_accumulate)
        acquire(b.segment);
      b.state = Bucket::State::ready;
      fold(b);
      launch_ready();  // one at a time, so scratch slots recycle
    }
  }

  // The order the last finished micro-step's buckets became ready in (those its backward left
  // untouched last, in launch order), and its fingerprint, for the ranks to compare.
  std::span<const int> proposal() const noexcept { return proposal_; }
  std::uint64_t proposal_fingerprint() const noexcept {
    detail::Fnv1a h;
    for (int s : proposal_) h.add(s);
    return h.value();
  }
  // Every rank of the group proposed the same order: launch in it from the next micro-step, and
  // free the scratch slots allocated past bucket_slots (all are free between micro-steps).
  void follow_proposal() {
    ZP_ASSERT(inflight_.empty() && next_ == 0, "buckets: the order changed inside a micro-step");
    order_ = proposal_;
    while (slots_.size() > kept_slots_) {
      const int last = int(slots_.size()) - 1;
      std::erase(free_, last);
      slots_.pop_back();
      if (!slots32_.empty()) slots32_.pop_back();
    }
    ZP_ASSERT(free_.size() == slots_.size(),
              "buckets: a scratch slot is in use between micro-steps");
  }

  // When this micro-step's first reduction was launched (none yet: time_point::max()), for the
  // engine's timers.
  std::chrono::steady_clock::time_point first_launch() const noexcept { return first_launch_; }

  // Waits for every launched bucket and folds scratch buckets into the accumulator; the
  // micro-step's bucket bookkeeping starts over.
  void finish() {
    while (!inflight_.empty()) complete(inflight_.front());
    for (auto& b : buckets_) {
      if (b.state == Bucket::State::launched) {
        b.work.wait();
        if (reduction_ == Reduction::scatter_in_place && replicas_) {
          const auto& g = layout_->segment(b.segment);
          const std::size_t at = std::size_t(comm_->rank()) * g.piece;
          if (precision_.reduce_f32)
            replicate(segment32_span(b.segment).subspan(at, g.piece));
          else
            replicate(segment_span(b.segment).subspan(at, g.piece));
        }
      }
      ZP_ASSERT(b.slot < 0, "buckets: segment ", b.segment, " still holds scratch memory");
      b.state = Bucket::State::idle;
      b.folded = false;
    }
    for (auto& w : replica_works_) w.wait();
    replica_works_.clear();
    // Every bucket was readied (or launch_all forced it): the micro-step's order is whole.
    if (seen_.size() == buckets_.size()) proposal_.swap(seen_);
    seen_.clear();
    next_ = 0;
    first_launch_ = std::chrono::steady_clock::time_point::max();
  }

 private:
  // part's buffer of field F if it is kept whole (full: true) or sharded (full: false), else empty.
  template <Field F, int Stage>
  static auto whole_or_none(const Partitioned<T, Stage, S>& part, bool full) {
    using U = typename Partitioned<T, Stage, S>::template elem<F>;
    return Partitioned<T, Stage, S>::whole(F) == full ? part.template buffer<F>() : std::span<U>{};
  }
  // qgZ's piece of a bucket: the largest segment's a rank.
  static std::size_t qgz_piece(const Layout& layout, int ranks) {
    return layout.largest_segment() / std::size_t(ranks);
  }
  // At least the most segments of one module (a module's backward fills them all before the
  // guard launches them), plus one for overlap.
  static std::size_t kept_slots(const Layout& layout, std::size_t slots) {
    int most = 1;
    for (const auto& m : layout.modules()) most = std::max(most, m.end_segment - m.first_segment);
    // No more than one a segment (each holds one bucket's): a larger `slots` would only waste.
    return std::min(std::max<std::size_t>(slots, std::size_t(most) + 1),
                    std::size_t(layout.segment_count()) + 1);
  }
  void add_slot() {
    free_.push_back(int(slots_.size()));
    slots_.emplace_back(layout_->largest_segment(), "buckets: scratch slot");
    if (precision_.reduce_f32)
      slots32_.emplace_back(layout_->largest_segment(), "buckets: fp32 scratch slot");
  }
  Bucket& at(int s) {
    ZP_ASSERT(s >= 0 && s < count(), "buckets: no segment ", s, " (", count(), " buckets)");
    return buckets_[std::size_t(s)];
  }
  std::span<T> segment_span(int s) const {
    const auto& g = layout_->segment(s);
    return full_.subspan(g.offset, g.size);
  }
  std::span<T> slot_span(const Bucket& b) const {
    return slots_[std::size_t(b.slot)].span(0, layout_->segment(b.segment).size);
  }
  std::span<float> slot32_span(const Bucket& b) const {
    return slots32_[std::size_t(b.slot)].span(0, layout_->segment(b.segment).size);
  }
  std::span<float> segment32_span(int s) const {
    const auto& g = layout_->segment(s);
    return full32_.subspan(g.offset, g.size);
  }

  // Stage 0/1 with fp32 accumulation: adds this micro-step's T gradients of bucket b into the
  // fp32 buffer and zeroes them (the model adds into them again next micro-step).
  void fold(Bucket& b) {
    if (!precision_.accumulate_f32 || reduction_ == Reduction::scatter_accumulate || b.folded)
      return;
    const auto w = segment_span(b.segment);
    Memory<S>::accumulate(segment32_span(b.segment), std::span<const T>(w));
    Memory<S>::zero(w);
    b.folded = true;
  }

  // Stage 0/1: the buffer bucket s reduces in, converted into it from the other precision.
  template <class F>
  Work launch_full(int s, F&& reduce) {
    if (precision_.reduce_f32) {
      if (!precision_.accumulate_f32)
        Memory<S>::convert(segment32_span(s), std::span<const T>(segment_span(s)));
      return reduce(segment32_span(s));
    }
    if (precision_.accumulate_f32)
      Memory<S>::convert(segment_span(s), std::span<const float>(segment32_span(s)));
    return reduce(segment_span(s));
  }

  void launch_ready() {
    if (next_ == 0 && !order_.empty() && at(order_[0]).state == Bucket::State::ready)
      first_launch_ = std::chrono::steady_clock::now();
    while (next_ < order_.size() && at(order_[next_]).state == Bucket::State::ready) {
      const int s = order_[next_];
      Bucket& b = at(s);
      switch (reduction_) {
        case Reduction::all_reduce:
          b.work =
              launch_full(s, [&](auto seg) { return comm_->all_reduce_async(seg, ReduceOp::avg); });
          break;
        case Reduction::scatter_in_place:
          b.work = launch_full(
              s, [&](auto seg) { return comm_->reduce_scatter_async(seg, ReduceOp::avg); });
          break;
        case Reduction::scatter_accumulate:
          if (qgz_) {
            start_quantized(b);
          } else if (precision_.reduce_f32) {
            Memory<S>::convert(slot32_span(b), std::span<const T>(slot_span(b)));
            b.work = comm_->reduce_scatter_async(slot32_span(b), ReduceOp::avg);
          } else {
            b.work = comm_->reduce_scatter_async(slot_span(b), ReduceOp::avg);
          }
          inflight_.push_back(s);
          break;
      }
      b.state = Bucket::State::launched;
      ++next_;
    }
  }

  // qgZ: a scratch set's partial sums, then this rank's piece of the reduction.
  std::size_t partial_sums(const auto& set) const {
    return set.sums.size() - layout_->largest_segment() / std::size_t(comm_->size());
  }
  std::span<float> reduced_piece(const auto& set, const Bucket& b) const {
    return set.sums.span(partial_sums(set), layout_->segment(b.segment).piece);
  }
  auto* set_of(int s) {
    for (auto& set : qgz_->sets)
      if (set.bucket == s) return &set;
    return static_cast<typename Quantized::Set*>(nullptr);
  }

  // qgZ: starts bucket b's reduction in a free scratch set (completing the oldest bucket in
  // flight while none is free), after moving the others on to hop 2.
  void start_quantized(Bucket& b) {
    Quantized& q = *qgz_;
    while (!set_of(-1)) complete(inflight_.front());
    for (int s : inflight_) set_of(s)->op->advance();
    auto& set = *set_of(-1);
    set.op = std::make_unique<quant::ReduceScatter<B, T>>(
        *q.node, *q.peers, std::span<const T>(slot_span(b)), reduced_piece(set, b), q.format,
        set.send.span(), set.recv.span(), set.sums.span(0, partial_sums(set)));
    set.op->start();
    set.bucket = b.segment;
  }
  // qgZ: bucket b's reduction finished; its average into this rank's piece of its slot.
  void finish_quantized(Bucket& b) {
    auto& set = *set_of(b.segment);
    const auto op = std::move(set.op);  // the set is free once this returns, or throws
    set.bucket = -1;
    op->finish();
    const auto& g = layout_->segment(b.segment);
    const std::span<float> mine = reduced_piece(set, b);
    Memory<S>::for_each(mine.size(), detail::DivideBy{mine.data(), float(comm_->size())});
    const std::size_t at = std::size_t(comm_->rank()) * g.piece;
    if (precision_.reduce_f32)
      Memory<S>::copy(slot32_span(b).subspan(at, g.piece), std::span<const float>(mine));
    else
      Memory<S>::convert(slot_span(b).subspan(at, g.piece), std::span<const float>(mine));
  }

  // Waits for bucket s (scatter_accumulate) and folds this rank's piece into the accumulator.
  void complete(int s) {
    Bucket& b = at(s);
    ZP_ASSERT(!inflight_.empty() && inflight_.front() == s, "buckets: completion out of order");
    inflight_.pop_front();
    if (qgz_)
      finish_quantized(b);
    else
      b.work.wait();
    const auto& g = layout_->segment(s);
    const std::size_t at = std::size_t(comm_->rank()) * g.piece;
    const auto dst = acc_.subspan(g.shard_offset, g.piece);
    const auto dst32 = acc32_.subspan(g.shard_offset, g.piece);
    if (precision_.reduce_f32) {
      const auto mine = slot32_span(b).subspan(at, g.piece);
      if (precision_.accumulate_f32)
        fold_piece(dst32, mine);
      else
        fold_piece(dst, mine);
    } else {
      const auto mine = slot_span(b).subspan(at, g.piece);
      if (precision_.accumulate_f32)
        fold_piece(dst32, mine);
      else
        fold_piece(dst, mine);
    }
    if (replicas_ && last_) {
      if (precision_.accumulate_f32)
        replicate(dst32);
      else
        replicate(dst);
    }
    free_.push_back(b.slot);
    b.slot = -1;
    b.state = Bucket::State::idle;
  }

  // Hybrid sharding: starts the replicas' average of a final piece (in rank order, as the
  // buckets' own avg), waited for in finish().
  template <class U>
  void replicate(std::span<U> piece) {
    replica_works_.push_back(replicas_->all_reduce_async(piece, ReduceOp::avg));
  }

  // Copies (first micro-step of a window) or adds this rank's reduced piece into the accumulator.
  template <class To, class From>
  void fold_piece(std::span<To> dst, std::span<From> mine) {
    if (!first_)
      Memory<S>::accumulate(dst, std::span<const From>(mine));
    else if constexpr (std::is_same_v<To, From>)
      Memory<S>::copy(dst, std::span<const From>(mine));
    else
      Memory<S>::convert(dst, std::span<const From>(mine));
  }

  Collective<B>* comm_;
  const Layout* layout_;
  Reduction reduction_;
  GradPrecision precision_;
  std::span<T> full_, acc_;
  std::span<float> full32_, acc32_;
  std::vector<Bucket> buckets_;
  std::vector<Buffer<T, S>> slots_;
  std::vector<Buffer<float, S>> slots32_;  // fp32 reduction: slot i widened
  std::size_t kept_slots_ = 0;  // scratch slots kept between micro-steps under a followed order
  std::vector<int> free_;
  std::deque<int> inflight_;   // scatter_accumulate buckets launched, in launch order
  std::vector<int> order_;     // the launch order: order_[k] launches k-th
  std::vector<int> seen_;      // this micro-step's buckets, in the order they became ready
  std::vector<int> proposal_;  // the last micro-step's order (proposal())
  struct Quantized {
    Collective<B>*node, *peers;
    quant::Format format;
    struct Set {
      Buffer<std::int32_t, S> send, recv;
      Buffer<float, S> sums;  // the node's partial sums, then this rank's piece
      std::unique_ptr<quant::ReduceScatter<B, T>> op;  // after what it uses: destroyed first
      int bucket = -1;                                 // the segment reduced in it, or -1
    };
    std::array<Set, 2> sets;
  };
  std::optional<Quantized> qgz_;
  Collective<B>* replicas_ = nullptr;  // hybrid sharding's (average_over)
  std::vector<Work> replica_works_;    // their averages in flight
  std::size_t next_ = 0;               // the next bucket to launch: order_[next_]
  bool sync_ = true, first_ = true;
  bool last_ = true;  // the accumulation window's last micro-step
  std::chrono::steady_clock::time_point first_launch_ =
      std::chrono::steady_clock::time_point::max();
};

}  // namespace zp
