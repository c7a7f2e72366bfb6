// cpu_executor.cpp — the Flow task graph driving the CPU Mixtral model (see cpu_executor.hpp).
#include "flow/cpu_executor.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include "core/error.hpp"
#include "core/host_resources.hpp"

namespace dmoe::flow {

namespace {

struct Segment {
  float* data = nullptr;
  int64_t numel = 0;
};

bool layer_dense(const ParamView& p, int layer) {
  return !p.is_expert && !p.is_gate && p.name.rfind(fmt::format("model.layers.{}.", layer), 0) == 0;
}

// The state the three threads share (one mutex: the tasks are coarse, milliseconds each).
struct Shared {
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<uint8_t> done;
  bool failed = false;
  bool alltoall_running = false;  // a real stage on the all-to-all thread
  size_t alltoall_next = 0;       // position in alltoall_order of the next task not yet started
  bool alltoall_finished = false, compute_finished = false;

  bool deps_done(const Task& t) const {
    for (int32_t d : t.deps)
      if (!done[size_t(d)]) return false;
    return true;
  }
  void check_failed() const {
    if (failed) DMOE_FAIL("flow executor: another thread of this rank failed");
  }
  void wait_deps(const Task& t) {
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return failed || deps_done(t); });
    check_failed();
  }
  void mark_done(int32_t id) {
    std::lock_guard<std::mutex> lock(mutex);
    done[size_t(id)] = 1;
    changed.notify_all();
  }
  void fail() {
    std::lock_guard<std::mutex> lock(mutex);
    failed = true;
    changed.notify_all();
  }
};

}  // namespace

int64_t mixtral_dense_grad_bytes_per_layer(const MixtralConfig& c) {
  const int64_t H = c.hidden_size;
  return 4 * (2 * H + 2 * c.q_size() * H + 2 * c.kv_size() * H);  // norms, q and o, k and v (f32)
}

int64_t mixtral_head_grad_bytes(const MixtralConfig& c) {
  const int64_t H = c.hidden_size;
  return 4 * (H + (c.tie_word_embeddings ? 0 : int64_t(c.vocab_size) * H));  // final norm, lm_head (f32)
}

int64_t mixtral_embed_grad_bytes(const MixtralConfig& c) { return 4 * int64_t(c.vocab_size) * c.hidden_size; }

void set_mixtral_grad_layout(GraphSpec& spec, const MixtralConfig& c, int64_t dense_grad_bytes_per_layer) {
  spec.dense_grad_bytes_per_layer = dense_grad_bytes_per_layer;
  spec.head_grad_bytes = mixtral_head_grad_bytes(c);
  spec.embed_grad_bytes = mixtral_embed_grad_bytes(c);
}

double run_cpu_flow_step(MixtralModel& model, Comm& ar_comm, const TaskGraph& g, const int32_t* tokens, int64_t batch,
                         int64_t seq, std::vector<ModelState>& states, std::vector<TraceEvent>* timeline) {
  const MixtralConfig& c = model.config();
  const int32_t L = c.num_hidden_layers, R = g.spec.micro_batches;
  DMOE_REQUIRE(g.spec.layers == L, "flow executor: graph layers {} but the model has {}", g.spec.layers, L);
  DMOE_REQUIRE(batch % R == 0, "flow executor: batch {} sequences do not split into micro_batches {}", batch, R);
  DMOE_REQUIRE(!c.tie_word_embeddings,
               "flow executor: tie_word_embeddings = true is not supported (head and embedding backward add into "
               "one tensor on one thread in another order than the sequential one)");
  DMOE_REQUIRE(g.spec.dense_grad_bytes_per_layer == mixtral_dense_grad_bytes_per_layer(c),
               "flow executor: graph dense_grad_bytes_per_layer {} but the model's layers hold {} bytes of all-reduced "
               "gradients", g.spec.dense_grad_bytes_per_layer, mixtral_dense_grad_bytes_per_layer(c));
  DMOE_REQUIRE(g.spec.head_grad_bytes == mixtral_head_grad_bytes(c) && g.spec.embed_grad_bytes == mixtral_embed_grad_bytes(c),
               "flow executor: graph head_grad_bytes {} and embed_grad_bytes {} but the model's head (final norm, "
               "lm_head) holds {} bytes of all-reduced gradients and its embedding {} (set_mixtral_grad_layout)",
               g.spec.head_grad_bytes, g.spec.embed_grad_bytes, mixtral_head_grad_bytes(c), mixtral_embed_grad_bytes(c));
  for (int32_t id : g.allreduce_order)
    DMOE_REQUIRE(g.tasks[size_t(id)].bytes % 4 == 0, "flow executor: chunk_bytes {}: must be a multiple of 4 (f32 "
                 "gradients)", g.spec.chunk_bytes);
  DMOE_REQUIRE(ar_comm.world() == model.world() && ar_comm.rank() == model.rank(),
               "flow executor: the all-reduce communicator is rank {} of {}, the model's rank {} of {}", ar_comm.rank(),
               ar_comm.world(), model.rank(), model.world());
  check_task_graph(g);

  // Point 1 of the deadlock argument (docs/flow.md): every rank runs the same graph, or their collectives would
  // not match. Rank 0's spec to every rank, each compares (the GPU executor's check, exact here: a broadcast).
  if (model.world() > 1) {
    const GraphSpec& sp = g.spec;
    const std::vector<int64_t> mine{sp.layers,       sp.micro_batches,  int64_t(sp.schedule), sp.dense_grad_bytes_per_layer,
                                    sp.chunk_bytes,  sp.head_grad_bytes, sp.embed_grad_bytes, batch, seq};
    std::vector<int64_t> root = mine;
    model.comm().broadcast(root.data(), int64_t(root.size()), DType::i64, 0, nullptr);
    DMOE_REQUIRE_INPUT(root == mine, "flow executor: rank {} runs another task graph or batch than rank 0 (layers, "
                       "micro-batches, schedule, dense bytes per layer, chunk bytes, head bytes, embedding bytes, sequences, sequence "
                       "length: {} here, "
                       "{} on rank 0)", model.rank(), fmt::join(mine, ", "), fmt::join(root, ", "));
  }
  const int64_t micro = batch / R;
  states.resize(size_t(R));
  for (int32_t r = 0; r < R; ++r) {
    model.begin_forward(tokens + r * micro * seq, micro, seq, states[size_t(r)]);
    model.prepare_engines(states[size_t(r)]);  // their config checks (collectives) here, before the threads start
  }
  std::vector<std::vector<float>> dresid(static_cast<size_t>(R)), dh(static_cast<size_t>(R));
  const double scale = 1.0 / R;

  // The replicated gradients in the graph's layout (ReplicatedLayout: the order backward completes them): the head
  // (final norm, lm_head), layers L−1 … 0 (norms, q/k/v/o), the embedding. The routers are EpEngine's (summed in
  // moe_collect_grads), the experts expert-parallel.
  std::vector<ParamView> views = parameter_views(model.grads(), c);
  auto view = [&](const std::string& name) -> const ParamView& {
    for (const ParamView& p : views)
      if (p.name == name) return p;
    DMOE_FAIL("flow executor: the model has no tensor {}", name);
  };
  std::vector<Segment> replicated;
  for (const char* name : {"model.norm.weight", "lm_head.weight"})
    replicated.push_back({view(name).data, view(name).numel});
  for (int l = L - 1; l >= 0; --l)
    for (const ParamView& p : views)
      if (layer_dense(p, l)) replicated.push_back({p.data, p.numel});
  replicated.push_back({view("model.embed_tokens.weight").data, view("model.embed_tokens.weight").numel});
  int64_t covered = 0;  // every replicated tensor once, none that is not
  for (const ParamView& p : views) covered += (p.is_expert || p.is_gate) ? 0 : p.numel;
  for (const Segment& s : replicated) covered -= s.numel;
  DMOE_REQUIRE(covered == 0, "flow executor: the replicated layout misses {} elements of the model's gradients", covered);
  auto allreduce_elements = [&](int64_t begin, int64_t end) {  // [begin, end) of the replicated layout
    int64_t offset = 0;
    for (const Segment& s : replicated) {
      const int64_t lo = std::max(begin, offset), hi = std::min(end, offset + s.numel);
      if (lo < hi) ar_comm.allreduce_sum(s.data + (lo - offset), hi - lo, DType::f32, nullptr);
      offset += s.numel;
    }
  };

  auto each_r = [&](const Task& t, auto&& fn) {
    if (t.micro_batch >= 0) return fn(t.micro_batch);
    for (int32_t r = 0; r < R; ++r) fn(r);
  };
  // The model's stages per task (the GPU executor's cut, src/flow/cuda/cuda_executor.cpp): compute tasks on the
  // compute thread, exchanges on the all-to-all thread, which also issues every other collective on the model's
  // communicator (the loss all-reduce in head_forward, the gate-gradient sums of moe_collect_grads) so that every
  // rank issues them in the same order.
  auto run_compute = [&](const Task& t) {
    const int l = t.layer;
    switch (t.kind) {
      case TaskKind::attention_fwd:
        each_r(t, [&](int32_t r) {
          ModelState& st = states[size_t(r)];
          if (l == 0) model.embed_forward(st);
          else model.moe_finish(l - 1, st);
          model.attention_forward(l, st);
          model.moe_route(l, st);
        });
        break;
      case TaskKind::expert_fwd: model.moe_experts(l, states[size_t(t.micro_batch)]); break;
      case TaskKind::expert_bwd: model.moe_backward_experts(l, states[size_t(t.micro_batch)]); break;
      case TaskKind::attention_bwd:
        each_r(t, [&](int32_t r) {
          ModelState& st = states[size_t(r)];
          model.moe_backward_finish(l, st, dresid[size_t(r)], dh[size_t(r)]);
          model.attention_backward(l, st, dh[size_t(r)], dresid[size_t(r)]);
          if (l == 0) {
            model.embed_backward(st, dresid[size_t(r)]);
            st.forward_done = false;
          }
        });
        break;
      default: DMOE_FAIL("flow executor: {} is not a compute task", g.describe(t.id));
    }
  };
  auto run_alltoall = [&](const Task& t) {
    const int l = t.layer;
    const int32_t r = t.micro_batch;
    ModelState& st = states[size_t(r)];
    switch (t.kind) {
      case TaskKind::dispatch_fwd: model.moe_dispatch(l, st); break;
      case TaskKind::combine_fwd: model.moe_combine(l, st); break;
      case TaskKind::combine_bwd:
        // C'[l, r]'s prelude: at the last layer the forward's end (the block output, the head and its loss
        // all-reduce) and the head's backward; below it, layer l + 1's MoE gradients, complete since AT'[l + 1, r]
        // (a dependency). Then the combine's backward and its exchange.
        if (l == L - 1) {
          model.moe_finish(l, st);
          model.head_forward(st);
          st.forward_done = true;
          model.head_backward(st, dresid[size_t(r)], scale);
        } else {
          model.moe_collect_grads(l + 1, st);
        }
        model.moe_backward_combine(l, st, dresid[size_t(r)], scale);
        model.moe_backward_dispatch(l, st);
        break;
      case TaskKind::dispatch_bwd: model.moe_backward_return(l, st); break;
      default: DMOE_FAIL("flow executor: {} is not an all-to-all task", g.describe(t.id));
    }
  };

  Shared sh;
  sh.done.assign(g.tasks.size(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto now_ms = [&] { return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count(); };
  if (timeline) timeline->clear();
  // Runs fn as task id, recording its start and end (the end before the task is marked done).
  auto timed = [&](int32_t id, auto&& fn) {
    const double start = now_ms();
    fn();
    if (!timeline) return;
    const double end = now_ms();
    std::lock_guard<std::mutex> lock(sh.mutex);
    timeline->push_back({id, start, end});
  };
  const int rank_for_errors = error_rank();
  std::exception_ptr compute_error, allreduce_error, alltoall_error;

  // Started under a try: a thread that cannot be had (ulimit -v, -u) ended the run in std::terminate when the other
  // one was already running (SIGABRT), or in "unexpected error: Resource temporarily unavailable".
  std::thread compute, allreduce;
  try {
    compute = std::thread([&] {
      error_rank() = rank_for_errors;
      try {
        for (int32_t id : g.compute_order) {
          const Task& t = g.tasks[size_t(id)];
          sh.wait_deps(t);
          timed(id, [&] { run_compute(t); });
          sh.mark_done(id);
        }
        std::lock_guard<std::mutex> lock(sh.mutex);
        sh.compute_finished = true;
        sh.changed.notify_all();
      } catch (...) {
        compute_error = std::current_exception();
        sh.fail();
      }
    });
    allreduce = std::thread([&] {
      error_rank() = rank_for_errors;
      try {
        for (int32_t id : g.allreduce_order) {
          const Task& t = g.tasks[size_t(id)];
          {
            // The priority rule: dependencies done, and no all-to-all stage running or ready.
            std::unique_lock<std::mutex> lock(sh.mutex);
            sh.changed.wait(lock, [&] {
              if (sh.failed) return true;
              if (!sh.deps_done(t)) return false;
              if (sh.alltoall_finished) return true;
              return !sh.alltoall_running &&
                     !sh.deps_done(g.tasks[size_t(g.alltoall_order[sh.alltoall_next])]);
            });
            sh.check_failed();
          }
          timed(id, [&] {
            if (model.world() > 1) allreduce_elements(t.offset / 4, (t.offset + t.bytes) / 4);
          });
          sh.mark_done(id);
        }
      } catch (...) {
        allreduce_error = std::current_exception();
        sh.fail();
      }
    });
  } catch (const std::system_error& e) {
    sh.fail();
    if (compute.joinable()) compute.join();
    fail_thread_start(e, "a thread of the CPU Flow executor (each simulated rank runs a compute and an all-reduce "
                         "thread besides its own)");
  }
  // The all-to-all thread is this one.
  try {
    for (size_t i = 0; i < g.alltoall_order.size(); ++i) {
      const int32_t id = g.alltoall_order[i];
      const Task& t = g.tasks[size_t(id)];
      sh.wait_deps(t);
      {
        std::lock_guard<std::mutex> lock(sh.mutex);
        sh.alltoall_running = true;
        sh.alltoall_next = i + 1;
      }
      timed(id, [&] { run_alltoall(t); });
      std::lock_guard<std::mutex> lock(sh.mutex);
      sh.alltoall_running = false;
      sh.alltoall_next = i + 1;
      sh.done[size_t(id)] = 1;
      if (sh.alltoall_next == g.alltoall_order.size()) sh.alltoall_finished = true;
      sh.changed.notify_all();
    }
    // Layer 0's MoE gradients (no C' below it collects them), once the compute thread has run every AT'[0, r]:
    // micro-batches in order, as the sequential backward adds them.
    {
      std::unique_lock<std::mutex> lock(sh.mutex);
      sh.changed.wait(lock, [&] { return sh.failed || sh.compute_finished; });
      sh.check_failed();
    }
    for (int32_t r = 0; r < R; ++r) model.moe_collect_grads(0, states[size_t(r)]);
  } catch (...) {
    alltoall_error = std::current_exception();
    sh.fail();
  }
  compute.join();
  allreduce.join();
  // The root cause first: an error of its own before the "another thread failed" ones it caused.
  std::exception_ptr first;
  for (const std::exception_ptr& e : {alltoall_error, compute_error, allreduce_error}) {
    if (!e || first) continue;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      if (std::string(x.what()).find("another thread of this rank failed") == std::string::npos) first = e;
    }
  }
  for (const std::exception_ptr& e : {alltoall_error, compute_error, allreduce_error})
    if (e && !first) first = e;
  if (first) std::rethrow_exception(first);
  double loss = 0;
  for (const ModelState& st : states) loss += st.loss / R;
  return loss;
}

CpuFlowMeasurement measure_cpu_flow(const MixtralConfig& c, const MixtralWeights& w, const std::vector<int32_t>& tokens,
                                    int64_t batch, int64_t seq, int32_t world, const GraphSpec& spec, int32_t steps,
                                    const std::function<void(int32_t, double)>& on_step) {
  DMOE_REQUIRE(steps >= 1, "--steps {}: must be >= 1", steps);
  DMOE_REQUIRE(int64_t(tokens.size()) == world * batch * seq, "measure: {} tokens for [{} x {}, {}]", tokens.size(),
               world, batch, seq);
  const TaskGraph g = build_task_graph(spec);
  CpuFlowMeasurement m;
  m.spec = spec;
  std::vector<double> times;
  auto ar_comms = make_thread_comms(world);
  run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
    MixtralModel model(c, comm);
    model.set_weights(slice_mixtral_experts(w, model.first_expert(), model.experts_per_rank()));
    std::vector<ModelState> states;
    std::vector<TraceEvent> timeline;
    for (int32_t s = 0; s < steps; ++s) {
      model.zero_grads();
      comm.barrier(nullptr);
      const auto t0 = std::chrono::steady_clock::now();
      run_cpu_flow_step(model, *ar_comms[size_t(rank)], g, tokens.data() + rank * batch * seq, batch, seq, states,
                        rank == 0 ? &timeline : nullptr);
      if (rank == 0) {
        times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        if (on_step) on_step(s + 1, times.back());
      }
    }
    if (rank == 0) m.timeline = std::move(timeline);
  });
  std::sort(times.begin(), times.end());
  m.step_ms = times[times.size() / 2];
  return m;
}

}  // namespace dmoe::flow
