// zp/partition.hpp: the buffers each ZeRO stage keeps on one rank for a model's layout
// (Partitioned<T, Stage>, over Layout from layout.hpp), and the ZeRO memory formulas.
//
// What each stage keeps per rank (P = padded total, N = ranks, K = 4 + 4 * state slots: the
// bytes of fp32 master and state per element):
//   stage | 16-bit params | gradients (T)      | fp32 master | optimizer state
//   0     | P             | P                  | P           | (K-4)/4 * P
//   1     | P             | P                  | P/N         | (K-4)/4 * P/N
//   2     | P             | P/N (+ buckets)    | P/N         | (K-4)/4 * P/N
//   3     | P/N (+ gathered modules) | P/N (+ buckets) | P/N | (K-4)/4 * P/N
// which is the ZeRO paper's (Rajbhandari et al., SC 2020, Figure 1) (2 + 2 + K)Psi,
// 4Psi + KPsi/N, 2Psi + (2 + K)Psi/N, (2 + 2 + K)Psi/N for 16-bit T with Psi replaced by the
// padded P.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "zp/collective.hpp"
#include "zp/error.hpp"
#include "zp/layout.hpp"
#include "zp/memory.hpp"
#include "zp/model.hpp"
#include "zp/optim/optimizer.hpp"
#include "zp/swap.hpp"

namespace zp {

// Bytes per rank by category. model_states() is what the ZeRO formulas count.
struct MemoryReport {
  std::size_t params = 0;           // the model's 16-bit (T) parameters kept between steps
  std::size_t grads = 0;            // gradients kept between micro-steps (full or shard)
  std::size_t master = 0;           // fp32 master weights
  std::size_t optimizer_state = 0;  // fp32 optimizer state (AdamW: m and v)
  std::size_t buckets = 0;          // gradient bucket scratch (stage 2/3)
  std::size_t gathered = 0;         // stage 3: gathered parameters live now
  std::size_t gathered_peak = 0;    // stage 3: most gathered non-persistent bytes at once
  std::size_t persistent = 0;       // stage 3: gathered modules kept across uses (<= threshold)
  std::size_t gather_cache = 0;     // stage 3: released gather and qwZ buffers kept
  std::size_t secondary = 0;        // stage 3 with hpZ: the secondary shards of the modules
  // Of the model states, the bytes offloaded to host memory: ZeRO-Offload's master and state;
  // on a device backend, offload_param's parameters too.
  std::size_t offloaded = 0;
  std::size_t nvme =
      0;  // of params + master + optimizer_state, the bytes in swap files (ZeRO-Infinity)
  std::size_t swap_buffers = 0;  // host memory the swaps move them through (swap.hpp; stage 3's
                                 // parameter reads too)

  std::size_t model_states() const noexcept { return params + grads + master + optimizer_state; }
  // Bytes in memory (the model states less those on NVMe, and the scratch).
  std::size_t total() const noexcept {
    return model_states() - nvme + buckets + gathered + gather_cache + secondary + swap_buffers;
  }
};

// A rank's memory before it is allocated, by where it will be: host memory (page-locked beside
// a device included) and the device's (empty on a host backend). Stage 3's gathers (gathered,
// secondary) are the least they will hold at once; activations are the model's, not in it.
struct MemoryPlan {
  MemoryReport host, device;
};

// The ZeRO paper's per-rank model-state bytes (Figure 1): params, gradients (both elem bytes each), fp32
// master and `state_slots` fp32 state arrays, for `psi` elements on `ranks` ranks.
constexpr std::size_t zero_model_state_bytes(int stage, std::size_t psi, int ranks,
                                             std::size_t elem, int state_slots) {
  const std::size_t n = std::size_t(ranks), k = 4 + 4 * std::size_t(state_slots);
  switch (stage) {
    case 0: return (2 * elem + k) * psi;
    case 1: return 2 * elem * psi + k * psi / n;
    case 2: return elem * psi + (elem + k) * psi / n;
    default: return (2 * elem + k) * psi / n;
  }
}

// A model-state field of a partition (the columns of the table at the top of this file).
enum class Field : std::uint8_t { param, grad, grad_f32, master, state };

// Which of a segment's elements an ownership query is about.
enum class Extent : std::uint8_t {
  kept,  // all the rank keeps: the whole segment where the stage keeps the field whole, else its piece
  updated,  // what the rank's optimizer step updates: the whole segment at stage 0 (every rank
            // updates the replicated model), else the rank's piece
  piece,    // the rank's piece, 1/N of the segment, whatever the stage (e.g. the norm's share)
};

// An ownership query's answer: the elements, and the full-layout index of the first.
template <class U>
struct Owned {
  std::span<U> span;
  std::size_t offset;
};

// Whether an access to a field reads its values or overwrites every one of them.
enum class Access : std::uint8_t { read, write };

// A run of a segment's updated elements inside one sub-group of the NVMe swap (swap.hpp):
// elements [first, first + count) of what Extent::updated names of the segment.
struct SwapPiece {
  int segment;
  std::size_t first, count, sub_group;
};

// The buffers of one rank for a ZeRO stage; see the table at the top of this file. Owns memory,
// knows no communicator: the engine moves data between ranks, this class says where it lives.
template <class T, int Stage, MemorySpace S = MemorySpace::host>
class Partitioned {
  static_assert(Stage >= 0 && Stage <= 3, "ZeRO stage must be 0, 1, 2 or 3");

 public:
  static constexpr int stage = Stage;
  static constexpr MemorySpace memory_space = S;
  using value_type = T;

  // grads_f32: also an fp32 gradient buffer of the gradients' extent (fp32 accumulation or
  // reduction of 16-bit gradients, bucket.hpp). offload: the fp32 master weights and optimizer
  // state in host memory whatever S is (ZeRO-Offload: the CPU updates them); nvme: in a swap
  // file there instead (ZeRO-Infinity; the CPU updates them through swap.hpp's buffers);
  // param_nvme (stage 3): the 16-bit parameter shard in a swap file too, in the optimizer
  // swap's sub-groups when both are swapped; else param_host (stage 3): the shard in host memory
  // whatever S is (offload_param: cpu; page-locked beside a device, offload_space<S>).
  Partitioned(Layout layout, int rank, int state_slots, bool grads_f32 = false,
              bool offload = false, const NvmeOptions* nvme = nullptr,
              const NvmeOptions* param_nvme = nullptr, bool param_host = false)
      : layout_(std::move(layout)),
        rank_(rank),
        slots_(state_slots),
        offload_(offload || nvme),
        param_host_(params_in_host(param_host, param_nvme)) {
    ZP_EXPECT((!param_nvme && !param_host) || Stage == 3,
              "partition: parameters offloaded to NVMe or host memory need ZeRO stage 3 (each "
              "rank keeps only its shard of them), got stage ",
              Stage);
    ZP_EXPECT(rank >= 0 && rank < layout_.ranks(), "partition: rank ", rank, " not in [0, ",
              layout_.ranks(), ")");
    ZP_EXPECT(state_slots >= 0 && state_slots <= 2, "partition: 0 to 2 state slots, got ",
              state_slots);
    const Extents x = extents(layout_, grads_f32, offload, nvme, param_nvme, param_host);
    const std::size_t shard = layout_.shard(), m = x.master;
    try {
      params_host_ =
          Buffer<T, offload_space<S>>(x.params_host, "partition: parameters (host, offloaded)");
      params_ = Buffer<T, S>(x.params, "partition: parameters");
      grads_ = Buffer<T, S>(x.grads, "partition: gradients");
      grads32_ = Buffer<float, S>(x.grads32, "partition: fp32 gradients");
      try {  // errors for every rank to learn (expect_swap_opened)
        if (nvme)
          swap_ = std::make_unique<Swap<float>>(*nvme, m, 1 + slots_,
                                                detail::cat("the optimizer state of rank ", rank));
        if (param_nvme)
          param_swap_ = std::make_unique<Swap<T>>(param_swap_options(*param_nvme, nvme), shard, 1,
                                                  detail::cat("the parameters of rank ", rank));
      } catch (const Error&) {
        swap_failed_ = std::current_exception();
      }
      master_host_ = Buffer<float, MemorySpace::host>(
          x.master_host, "partition: fp32 master weights (host, offloaded)");
      master_ = Buffer<float, S>(x.master_dev, "partition: fp32 master weights");
      for (std::size_t k = 0; k < std::size_t(slots_); ++k) {
        state_host_[k] = Buffer<float, MemorySpace::host>(
            x.master_host, "partition: optimizer state (host, offloaded)");
        state_[k] = Buffer<float, S>(x.master_dev, "partition: optimizer state");
      }
    } catch (const Error& e) {
      if (e.category() != Errc::out_of_memory) throw;
      const auto& ps = layout_.params();
      const auto big = std::max_element(
          ps.begin(), ps.end(), [](const auto& a, const auto& b) { return a.size < b.size; });
      throw Error(
          Errc::out_of_memory,
          detail::cat(e.message(), " for ", ps.size(), " parameters of ", layout_.used(),
                      " elements in all (ZeRO stage ", Stage, ", ", layout_.ranks(),
                      " ranks); the largest is '", big->name, "' with ", big->size, " elements"));
    }
    Memory<S>::zero(params_.span());
    Memory<MemorySpace::host>::zero(params_host_.span());
    Memory<S>::zero(grads_.span());
    Memory<S>::zero(grads32_.span());
    Memory<S>::zero(master_.span());
    Memory<MemorySpace::host>::zero(master_host_.span());
    for (int k = 0; k < slots_; ++k) {
      Memory<S>::zero(state_[std::size_t(k)].span());
      Memory<MemorySpace::host>::zero(state_host_[std::size_t(k)].span());
    }
  }

  // The memory a partition of these settings (the constructor's) allocates, by space and
  // category, nvme 0: the engine's ranks check it against the room they have before they
  // allocate it (engine_agreement.hpp). On a host backend `device` is empty; on a device one
  // `host` holds what is offloaded (page-locked) and the swap buffers.
  static MemoryPlan memory_plan(const Layout& layout, int state_slots, bool grads_f32, bool offload,
                                const NvmeOptions* nvme, const NvmeOptions* param_nvme,
                                bool param_host) {
    const Extents e = extents(layout, grads_f32, offload, nvme, param_nvme, param_host);
    const std::size_t states = 1 + std::size_t(state_slots);
    MemoryPlan p;
    MemoryReport& in_s = S == MemorySpace::host ? p.host : p.device;
    p.host.params = e.params_host * sizeof(T);
    p.host.master = e.master_host * sizeof(float);
    p.host.offloaded = p.host.params + e.master_host * states * sizeof(float);
    in_s.params += e.params * sizeof(T);
    in_s.grads = e.grads * sizeof(T) + e.grads32 * sizeof(float);
    in_s.master += e.master_dev * sizeof(float);
    for (MemoryReport* r : {&p.host, &p.device}) r->optimizer_state = (states - 1) * r->master;
    if (nvme) p.host.swap_buffers += Swap<float>::host_bytes(*nvme, e.master, int(states));
    if (param_nvme)
      p.host.swap_buffers +=
          Swap<T>::host_bytes(param_swap_options(*param_nvme, nvme), layout.shard(), 1);
    return p;
  }

  // Master weights and state are in host memory or on NVMe (whatever S is), stepped by the CPU.
  bool offloaded() const noexcept { return offload_; }
  // Whether field f lives in host memory whatever S is (offloaded master weights and state, or
  // parameters; swapped ones are accessed through host memory).
  bool on_host(Field f) const noexcept {
    return f == Field::param ? param_host_ : offload_ && (f == Field::master || f == Field::state);
  }
  // The NVMe swap of the master weights and state, or null when they are in memory; of the
  // parameter shard (stage 3), or null.
  Swap<float>* swap() const noexcept { return swap_.get(); }
  Swap<T>* param_swap() const noexcept { return param_swap_.get(); }
  // Writes back what the swaps hold only in their caches: a writing step (a load) ends with it,
  // so the errors of those writes are the step's, agreed on, not a later read's on one rank (with
  // O_DIRECT; through the page cache the kernel may still report one later).
  void flush_swaps() const {
    if (swap_) swap_->flush();
    if (param_swap_) param_swap_->flush();
  }
  // Whether field f lives in a swap file (access() reaches it, owned() does not).
  bool swapped(Field f) const noexcept {
    return f == Field::param ? bool(param_swap_)
                             : swap_ && (f == Field::master || f == Field::state);
  }
  // Throws the error that kept the swap from opening (a missing or full nvme_path): the engine
  // calls it on every rank at once, so that one rank's failure is every rank's error.
  void expect_swap_opened() const {
    if (swap_failed_) std::rethrow_exception(swap_failed_);
  }

  const Layout& layout() const noexcept { return layout_; }
  int rank() const noexcept { return rank_; }
  int ranks() const noexcept { return layout_.ranks(); }
  int state_slots() const noexcept { return slots_; }

  // The element type of field F: T for the parameters and their gradients, else fp32.
  template <Field F>
  using elem = std::conditional_t<F == Field::param || F == Field::grad, T, float>;

  // Whether this stage keeps field f whole on every rank (the full, padded layout) rather than
  // only this rank's shard; see the table at the top of this file.
  static constexpr bool whole(Field f) noexcept {
    return f == Field::param                          ? Stage < 3
           : f == Field::grad || f == Field::grad_f32 ? Stage < 2
                                                      : Stage < 1;
  }

  // Field F's whole buffer (full space where whole(F), else shard space); k: the state array.
  // grad_f32 is empty unless kept.
  template <Field F>
  std::span<elem<F>> buffer(int k = 0) const {
    if constexpr (F == Field::param)
      return param_host_ ? params_host_.span() : params_.span();
    else if constexpr (F == Field::grad)
      return grads_.span();
    else if constexpr (F == Field::grad_f32)
      return grads32_.span();
    else if constexpr (F == Field::master)
      return offload_ ? master_host_.span() : master_.span();
    else {
      ZP_EXPECT(k >= 0 && k < slots_, "partition: optimizer state ", k, " not in [0, ", slots_,
                ")");
      return offload_ ? state_host_[std::size_t(k)].span() : state_[std::size_t(k)].span();
    }
  }

  // The ownership query: field F's elements of segment s that `e` names, and where the first
  // of them sits in the full (padded) layout. Every stage-dependent choice of which span of
  // which buffer a rank reads or writes comes from here.
  // Swapped fields (master and state, and stage 3's parameters, on NVMe) have no span: access()
  // reaches them.
  template <Field F>
  Owned<elem<F>> owned(int s, Extent e, int k = 0) const {
    ZP_ASSERT(!swapped(F), "partition: field ", int(F), " is on NVMe; use access()");
    const std::span<elem<F>> b = buffer<F>(k);
    const Place p = place<F>(s, e);
    ZP_ASSERT(p.at + p.n <= b.size(), "partition: field ", int(F), " of segment ", s,
              " is not kept here (", b.size(), " elements, ", p.at + p.n, " needed)");
    return {b.subspan(p.at, p.n), p.offset};
  }

  // Runs fn(Owned<elem<F>>, whether it is in host memory) on what owned<F>(s, e, k) names,
  // wherever it lives: in place, or, swapped to NVMe, through a host copy read from the swap
  // (Access::read) or written to it afterwards (Access::write: fn sets every element).
  template <Field F, class Fn>
  void access(int s, Extent e, int k, Access a, Fn&& fn) const {
    if constexpr (F == Field::param || F == Field::master || F == Field::state) {
      if (swapped(F)) {
        auto* sw = swap_of<F>();
        const Place p = place<F>(s, e);
        std::vector<elem<F>> copy(p.n);
        const int f = F == Field::state ? 1 + k : 0;
        if (a == Access::read) sw->read(f, p.at, std::span<elem<F>>(copy));
        fn(Owned<elem<F>>{std::span<elem<F>>(copy), p.offset}, true);
        if (a == Access::write) sw->write(f, p.at, std::span<const elem<F>>(copy));
        return;
      }
    }
    fn(owned<F>(s, e, k), on_host(F));
  }

  // Swapped parameters (stage 3): starts reading this rank's pieces of segments [first, end),
  // which lie side by side in the shard, into `into` (param_swap()->finish(into) gives them).
  void read_param_pieces(int first, int end, typename Swap<T>::Ahead& into) const {
    if (end <= first) return param_swap_->read_ahead(0, 0, into);
    const std::size_t at = place<Field::param>(first, Extent::piece).at,
                      to = place<Field::param>(end - 1, Extent::piece).at +
                           layout_.segment(end - 1).piece;
    param_swap_->read_ahead(at, to - at, into);
  }

  // The full-layout index of the first element of segment s this rank updates.
  std::size_t updated_offset(int s) const {
    return place<Field::master>(s, Extent::updated).offset;
  }
  // The optimizer's view of the elements of segment s this rank updates; F32: the gradient from
  // the fp32 gradient buffer.
  template <bool F32>
  optim::ShardView<T, std::conditional_t<F32, float, T>> update_view(int s) const {
    optim::ShardView<T, std::conditional_t<F32, float, T>> v;
    v.grad = owned < F32 ? Field::grad_f32 : Field::grad > (s, Extent::updated).span;
    if (!param_swap_) v.param = owned<Field::param>(s, Extent::updated).span;
    if (swap_) return v;  // what is swapped: swap_view()
    v.master = owned<Field::master>(s, Extent::updated).span;
    for (int k = 0; k < slots_; ++k)
      v.state[std::size_t(k)] = owned<Field::state>(s, Extent::updated, k).span;
    return v;
  }

  // Swapped: the runs of every segment's updated elements, each inside one sub-group, in
  // sub-group order (the order the swaps stream them; both swaps have the same sub-groups).
  std::vector<SwapPiece> swap_pieces() const {
    std::vector<SwapPiece> out;
    const std::size_t C = swap_ ? swap_->sub_group() : param_swap_->sub_group();
    for (int s = 0; s < layout_.segment_count(); ++s) {
      const Place p = place<Field::master>(s, Extent::updated);
      for (std::size_t i = 0; i < p.n;) {
        const std::size_t at = p.at + i, n = std::min(C - at % C, p.n - i);
        out.push_back({s, i, n, at / C});
        i += n;
      }
    }
    std::stable_sort(out.begin(), out.end(), [](const SwapPiece& a, const SwapPiece& b) {
      return a.sub_group < b.sub_group;
    });
    return out;
  }
  // The optimizer's view of piece q, what is swapped in the swaps' buffers (valid between
  // the swaps' enter(q.sub_group) and leave(q.sub_group)).
  template <bool F32>
  optim::ShardView<T, std::conditional_t<F32, float, T>> swap_view(const SwapPiece& q) const {
    auto v = update_view<F32>(q.segment);
    const std::size_t at = place<Field::master>(q.segment, Extent::updated).at + q.first;
    v.grad = v.grad.subspan(q.first, q.count);
    if (param_swap_)
      v.param = {param_swap_->slot(q.sub_group, 0) + at % param_swap_->sub_group(), q.count};
    else
      v.param = v.param.subspan(q.first, q.count);
    if (swap_) {
      v.master = {swap_->slot(q.sub_group, 0) + at % swap_->sub_group(), q.count};
      for (int k = 0; k < slots_; ++k)
        v.state[std::size_t(k)] = {swap_->slot(q.sub_group, 1 + k) + at % swap_->sub_group(),
                                   q.count};
    } else {
      v.master = v.master.subspan(q.first, q.count);
      for (int k = 0; k < slots_; ++k)
        v.state[std::size_t(k)] = v.state[std::size_t(k)].subspan(q.first, q.count);
    }
    return v;
  }

  // Model-state bytes by category (buckets and gathered parameters are the engine's).
  MemoryReport memory() const {
    MemoryReport r;
    r.params = params_.bytes() + params_host_.bytes();
    r.offloaded = params_host_.bytes();
    r.grads = grads_.bytes() + grads32_.bytes();
    r.master = master_elements() * sizeof(float);
    r.optimizer_state = std::size_t(slots_) * r.master;
    if (param_swap_) {
      r.params = layout_.shard() * sizeof(T);
      r.nvme += r.params;
      r.swap_buffers += param_swap_->host_bytes();
    }
    if (swap_) {
      r.nvme += r.master + r.optimizer_state;
      r.swap_buffers += swap_->host_bytes();
    } else if (offload_) {
      r.offloaded += r.master + r.optimizer_state;
    }
    return r;
  }

 private:
  // The elements of each buffer the constructor allocates (0: none). master: the master
  // weights' extent wherever they are; master_host / master_dev: the same where they are in
  // host memory (offloaded) / in S, each state array alike.
  struct Extents {
    std::size_t params, params_host, grads, grads32, master, master_host, master_dev;
  };
  static Extents extents(const Layout& layout, bool grads_f32, bool offload,
                         const NvmeOptions* nvme, const NvmeOptions* param_nvme,
                         bool param_host) noexcept {
    const std::size_t full = layout.total(), shard = layout.shard();
    const bool host_params = params_in_host(param_host, param_nvme);
    const std::size_t grads = whole(Field::grad) ? full : shard,
                      master = whole(Field::master) ? full : shard;
    return {host_params || param_nvme ? 0
            : whole(Field::param)     ? full
                                      : shard,
            host_params ? shard : 0,
            grads,
            grads_f32 ? grads : 0,
            master,
            !nvme && offload ? master : 0,
            !nvme && !offload ? master : 0};
  }
  // offload_param: cpu puts the parameter shard in host memory beside a device (on a host
  // backend it is there already); nvme takes precedence.
  static constexpr bool params_in_host(bool param_host, const NvmeOptions* param_nvme) noexcept {
    return param_host && !param_nvme && S != MemorySpace::host;
  }
  // Stage 3's parameter swap walks the optimizer swap's sub-groups where both are swapped.
  static NvmeOptions param_swap_options(NvmeOptions o, const NvmeOptions* nvme) {
    if (nvme) o.sub_group_size = nvme->sub_group_size;
    return o;
  }

  // Where owned<F>(s, e) is: elements [at, at + n) of F's buffer, at full-layout index offset.
  struct Place {
    std::size_t at, n, offset;
  };
  template <Field F>
  Place place(int s, Extent e) const {
    const auto& g = layout_.segment(s);
    const std::size_t mine = g.offset + std::size_t(rank_) * g.piece;
    const bool segment = e == Extent::kept ? whole(F) : e == Extent::updated && Stage == 0;
    return {segment    ? g.offset
            : whole(F) ? mine
                       : g.shard_offset,
            segment ? g.size : g.piece, segment ? g.offset : mine};
  }
  template <Field F>
  auto* swap_of() const noexcept {
    if constexpr (F == Field::param)
      return param_swap_.get();
    else
      return swap_.get();
  }
  std::size_t master_elements() const noexcept {
    return whole(Field::master) ? layout_.total() : layout_.shard();
  }

  Layout layout_;
  int rank_;
  int slots_;
  Buffer<T, S> params_, grads_;
  Buffer<float, S> grads32_;
  bool offload_;
  bool param_host_;
  Buffer<T, offload_space<S>> params_host_;  // offloaded parameters (params_ empty then)
  Buffer<float, S> master_;
  std::array<Buffer<float, S>, 2> state_;
  // Offloaded (host) master and state; the S ones above stay empty then.
  Buffer<float, MemorySpace::host> master_host_;
  std::array<Buffer<float, MemorySpace::host>, 2> state_host_;
  std::unique_ptr<Swap<float>> swap_;    // master and state on NVMe (the buffers above empty)
  std::unique_ptr<Swap<T>> param_swap_;  // stage 3's parameter shard on NVMe (params_ empty)
  std::exception_ptr swap_failed_;
};

}  // namespace zp
