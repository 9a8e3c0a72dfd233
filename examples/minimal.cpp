// zp_example_minimal: the smallest complete use of zp (README, "Wrapping a model"). A two-layer
// regression model with hand-written forward and backward, trained with ZeRO stage 3 on 4
// thread-ranks. Prints the loss before and after; exits 1 if it did not fall.
#include <zp/zp.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

// Your model: it owns its activations and its forward/backward; zp owns where its parameters
// and gradients live. Each zp::Param is a {value, grad} pair of views that zp rebinds.
struct Net {
  static constexpr int in = 8, hidden = 32;
  zp::Param<float> w1{hidden * in}, w2{hidden};
  std::vector<float> init1, init2;     // initial weights; zp copies rank 0's once
  std::vector<float> x, h, y, dy, dh;  // this micro-batch: activations and their gradients

  Net() : init1(hidden * in), init2(hidden) {
    for (std::size_t i = 0; i < init1.size(); ++i) init1[i] = 0.3f * std::sin(float(i));
    for (std::size_t i = 0; i < init2.size(); ++i) init2[i] = 0.3f * std::cos(float(i));
    w1.value = zp::View<float>(init1.data(), init1.size());
    w2.value = zp::View<float>(init2.data(), init2.size());
  }

  // Module 0: h = tanh(W1 x). Module 1: y = w2 . h.
  void forward(int module, int batch) {
    if (module == 0) {
      h.assign(std::size_t(batch * hidden), 0.0f);
      for (int b = 0; b < batch; ++b)
        for (int j = 0; j < hidden; ++j) {
          float a = 0;
          for (int i = 0; i < in; ++i)
            a += w1.value[std::size_t(j * in + i)] * x[std::size_t(b * in + i)];
          h[std::size_t(b * hidden + j)] = std::tanh(a);
        }
    } else {
      y.assign(std::size_t(batch), 0.0f);
      for (int b = 0; b < batch; ++b)
        for (int j = 0; j < hidden; ++j)
          y[std::size_t(b)] += w2.value[std::size_t(j)] * h[std::size_t(b * hidden + j)];
    }
  }
  // Backward adds (+=) into the gradient views, which point into zp's gradient buckets. Each
  // module's backward uses only its own parameters (stage 3 gathers one module at a time), so
  // module 1 also computes the gradient of its input for module 0.
  void backward(int module, int batch) {
    if (module == 1) {
      dh.assign(std::size_t(batch * hidden), 0.0f);
      for (int b = 0; b < batch; ++b)
        for (int j = 0; j < hidden; ++j) {
          w2.grad[std::size_t(j)] += dy[std::size_t(b)] * h[std::size_t(b * hidden + j)];
          dh[std::size_t(b * hidden + j)] = dy[std::size_t(b)] * w2.value[std::size_t(j)];
        }
    } else {
      for (int b = 0; b < batch; ++b)
        for (int j = 0; j < hidden; ++j) {
          const float hj = h[std::size_t(b * hidden + j)];
          const float da = dh[std::size_t(b * hidden + j)] * (1 - hj * hj);
          for (int i = 0; i < in; ++i)
            w1.grad[std::size_t(j * in + i)] += da * x[std::size_t(b * in + i)];
        }
    }
  }
};

// The one thing zp asks of a model, found by argument-dependent lookup: name, module, param.
template <class Visit>
void for_each_parameter(Net& n, Visit&& visit) {
  visit("layer1.weight", 0, n.w1);
  visit("layer2.weight", 1, n.w2);
}

// Samples [first, first + batch) of a synthetic task: the target is a smooth function of x.
void load_batch(Net& net, long first, int batch, std::vector<float>& target) {
  net.x.resize(std::size_t(batch * Net::in));
  target.resize(std::size_t(batch));
  for (int b = 0; b < batch; ++b) {
    float t = 0;
    for (int i = 0; i < Net::in; ++i) {
      const float v = std::sin(0.37f * float(first + b) + 1.3f * float(i));
      net.x[std::size_t(b * Net::in + i)] = v;
      t += (i % 2 ? 0.5f : -0.25f) * v;
    }
    target[std::size_t(b)] = std::tanh(t);
  }
}

int main() {
  constexpr int ranks = 4, micro_batch = 16, steps = 200;
  float first_loss = 0, last_loss = 0;
  zp::backend::run_threads(ranks, [&](zp::Collective<zp::backend::Threads>& comm) {
    Net net;
    zp::EngineConfig cfg{
        .batch = {.micro_batch_per_rank = micro_batch, .gradient_accumulation_steps = 1},
        .max_grad_norm = 1.0f};
    zp::Engine<zp::backend::Threads, float, /*stage*/ 3> engine(comm, net, cfg,
                                                                zp::optim::AdamW{.lr = 1e-2f});
    std::vector<float> target;
    for (int step = 0; step < steps; ++step) {
      load_batch(net, long(step * ranks + comm.rank()) * micro_batch, micro_batch, target);
      for (int m = 0; m < 2; ++m) {  // forward: the guard gathers module m (and prefetches m+1)
        auto guard = engine.forward(m);
        net.forward(m, micro_batch);
      }
      float loss = 0;  // mean squared error; its gradient is seeded with the loss scale
      net.dy.resize(micro_batch);
      for (int b = 0; b < micro_batch; ++b) {
        const float e = net.y[std::size_t(b)] - target[std::size_t(b)];
        loss += 0.5f * e * e / micro_batch;
        net.dy[std::size_t(b)] = e / micro_batch * engine.loss_scale();
      }
      for (int m = 1; m >= 0; --m) {  // backward: the guard binds m's gradients to a bucket
        auto guard = engine.backward(m);
        net.backward(m, micro_batch);
      }               // leaving the guard launches the bucket's reduce_scatter
      engine.step();  // stats all_reduce, clip, AdamW on this rank's shard
      // the loss over every rank's micro-batch
      comm.all_reduce(std::span<float>(&loss, 1), zp::ReduceOp::avg);
      if (comm.rank() == 0 && step == 0) first_loss = loss;
      if (comm.rank() == 0) last_loss = loss;
    }
    if (comm.rank() == 0) {
      const zp::MemoryReport mem = engine.memory();
      std::printf(
          "model states per rank: %zu bytes (params %zu, grads %zu, master %zu, optimizer %zu)\n",
          mem.model_states(), mem.params, mem.grads, mem.master, mem.optimizer_state);
    }
  });
  std::printf("loss %.3g -> %.3g after %d steps on %d ranks\n", first_loss, last_loss, steps,
              ranks);
  return last_loss < 0.5f * first_loss ? 0 : 1;
}
