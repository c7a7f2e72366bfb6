// flow/cuda/cuda_executor.cpp — the Flow task graph driving the GPU Mixtral model (see flow/cuda_executor.hpp).
#include "flow/cuda_executor.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"
#include "flow/cpu_executor.hpp"
#include "model/cuda/cuda_mixtral.hpp"

namespace dmoe::flow {

namespace {

struct Segment {
  int64_t offset = 0, numel = 0;  // elements of the model's gradient buffer
};

// The replicated gradients of layer l in the GPU model's flat layout (the graph's per-layer bytes, in order).
std::vector<Segment> layer_segments(const MixtralConfig& c, const ParamLayout& p, int l) {
  const int64_t H = c.hidden_size, Q = c.q_size(), KV = c.kv_size(), E = c.num_local_experts;
  const ParamLayout::Layer& w = p.layers[size_t(l)];
  return {{w.input_layernorm, H}, {w.post_attention_layernorm, H}, {w.q_proj, Q * H}, {w.k_proj, KV * H},
          {w.v_proj, KV * H},     {w.o_proj, H * Q},               {w.gate, E * H}};
}

cudaStream_t as_stream(dmoe::Stream s) { return static_cast<cudaStream_t>(s); }

}  // namespace

struct CudaFlowExecutor::Impl {
  CudaMixtralModel& model;
  Comm* own_ar_comm;                      // ArComm::own's communicator; nullptr in ArComm::model
  ArComm mode;
  int32_t chunks_per_gap = 1;             // ArComm::model: single_comm_issue_order's parameter
  cudaStream_t compute = nullptr, a2a = nullptr, ar = nullptr;
  std::vector<cudaEvent_t> done;          // per task: recorded at its end on its stream (no timing)
  std::vector<cudaEvent_t> begin, end;    // per task: the timeline's (timing events)
  cudaEvent_t step_begin = nullptr, prelude = nullptr;
  GraphSpec checked;                      // the last spec every rank was checked to share
  bool has_checked = false;

  Impl(CudaMixtralModel& m, Comm* c) : model(m), own_ar_comm(c), mode(c ? ArComm::own : ArComm::model) {}
  // The chunks' communicator and stream: in ArComm::model the all-to-all stream, where every collective of the
  // model's communicator goes (NvshmemComm's calls must be ordered on one stream: its scratch, receive sets and
  // world barriers are shared by all its collectives).
  Comm& ar_comm() { return own_ar_comm ? *own_ar_comm : model.comm(); }
  cudaStream_t ar_stream() const { return mode == ArComm::model ? a2a : ar; }
  ~Impl() {
    // Quietly: a stream that cannot finish (a dead peer) keeps its events and streams until process exit.
    const bool idle = (!a2a || cuda::wait_stream_quietly(a2a)) && (!ar || cuda::wait_stream_quietly(ar));
    if (!idle) return;
    for (auto* v : {&done, &begin, &end})
      for (cudaEvent_t e : *v) (void)cudaEventDestroy(e);
    if (step_begin) (void)cudaEventDestroy(step_begin);
    if (prelude) (void)cudaEventDestroy(prelude);
    if (a2a) (void)cudaStreamDestroy(a2a);
    if (ar) (void)cudaStreamDestroy(ar);
  }

  void ensure_events(size_t n) {
    while (done.size() < n) {
      cudaEvent_t d, b, e;
      DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&d, cudaEventDisableTiming));
      DMOE_CHECK_CUDA(cudaEventCreate(&b));
      DMOE_CHECK_CUDA(cudaEventCreate(&e));
      done.push_back(d);
      begin.push_back(b);
      end.push_back(e);
    }
  }

  // Point 1 of the deadlock argument (docs/flow.md): every rank builds the same graph. One all-reduce of the
  // spec on the model's communicator, on the all-to-all stream (where all its collectives go).
  void check_spec(const GraphSpec& s) {
    // Field by field: memcmp would read GraphSpec's padding, which can differ between ranks and skip the check
    // (a collective) on some ranks only.
    if (model.world() == 1 || (has_checked && same_spec(checked, s))) return;
    // The mode and chunks_per_gap too: they decide the model communicator's collective order.
    const std::vector<int64_t> mine{s.layers,          s.micro_batches,    int64_t(s.schedule), s.dense_grad_bytes_per_layer,
                                    s.chunk_bytes,     int64_t(mode),      chunks_per_gap,      s.head_grad_bytes,
                                    s.embed_grad_bytes};
    const size_t bytes = mine.size() * sizeof(int64_t);
    Backend& be = model.backend();
    // After every collective the caller issued on the compute stream (one order per communicator).
    DMOE_CHECK_CUDA(cudaEventRecord(prelude, compute));
    DMOE_CHECK_CUDA(cudaStreamWaitEvent(a2a, prelude, 0));
    void* dev = be.allocate(bytes);
    std::vector<int64_t> sum(mine.size());
    try {
      be.upload_on(dev, mine.data(), bytes, a2a);
      model_comm().allreduce_sum(dev, int64_t(mine.size()), DType::i64, a2a);
      be.download_on(sum.data(), dev, bytes, a2a);
    } catch (...) {
      be.release(dev);
      throw;
    }
    be.release(dev);
    for (size_t i = 0; i < mine.size(); ++i)
      DMOE_REQUIRE_INPUT(sum[i] == mine[i] * model.world(),
                         "flow: the {} ranks do not all run the same task graph (field {} of (layers, micro-batches, "
                         "schedule, dense bytes per layer, chunk bytes, AR communicator, chunks per gap, head bytes, "
                         "embedding bytes) differs; this rank: {}, {}, {}, {}, {}, {} (DMOE_FLOW_AR_COMM), {} "
                         "(DMOE_FLOW_CHUNKS_PER_GAP), {}, {})",
                         model.world(), i, s.layers, s.micro_batches, schedule_name(s.schedule),
                         s.dense_grad_bytes_per_layer, s.chunk_bytes, ar_comm_name(mode), chunks_per_gap,
                         s.head_grad_bytes, s.embed_grad_bytes);
    checked = s;
    has_checked = true;
  }
  Comm& model_comm();
};

Comm& CudaFlowExecutor::Impl::model_comm() { return model.comm(); }

CudaFlowExecutor::CudaFlowExecutor(CudaMixtralModel& model, Comm* allreduce_comm)
    : impl_(std::make_unique<Impl>(model, allreduce_comm)) {
  if (allreduce_comm)
    DMOE_REQUIRE(allreduce_comm->world() == model.world() && allreduce_comm->rank() == model.rank(),
                 "flow executor: the all-reduce communicator is rank {} of {}, the model's rank {} of {}",
                 allreduce_comm->rank(), allreduce_comm->world(), model.rank(), model.world());
  else
    impl_->chunks_per_gap = chunks_per_gap_from_env(std::getenv("DMOE_FLOW_CHUNKS_PER_GAP"));
  DMOE_REQUIRE_INPUT(!model.config().tie_word_embeddings,
                     "flow executor: tie_word_embeddings = true is not supported (head and embedding backward add into "
                     "one tensor in another order than the sequential one)");
  Impl& x = *impl_;
  x.compute = as_stream(model.backend().stream());
  DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&x.a2a, cudaStreamNonBlocking));
  DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&x.ar, cudaStreamNonBlocking));
  DMOE_CHECK_CUDA(cudaEventCreate(&x.step_begin));
  DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&x.prelude, cudaEventDisableTiming));
}

CudaFlowExecutor::~CudaFlowExecutor() = default;
ArComm CudaFlowExecutor::ar_comm() const { return impl_->mode; }

double CudaFlowExecutor::step(const TaskGraph& g, const int32_t* tokens, int64_t batch, int64_t seq,
                              std::vector<CudaModelState>& states, std::vector<TraceEvent>* timeline) {
  Impl& x = *impl_;
  CudaMixtralModel& model = x.model;
  const MixtralConfig& c = model.config();
  const int32_t L = c.num_hidden_layers, R = g.spec.micro_batches;
  DMOE_REQUIRE_INPUT(g.spec.layers == L, "flow executor: graph layers {} but the model has {}", g.spec.layers, L);
  DMOE_REQUIRE_INPUT(batch % R == 0, "flow executor: batch {} sequences do not split into micro_batches {}", batch, R);
  // Micro-batches add into the expert gradients, which a model with bf16 ones refuses mid-step (EpEngine): say it first.
  DMOE_REQUIRE(!model.bf16_expert_grads() || R == 1, "flow executor: the model keeps bf16 expert gradients, which one "
               "backward writes and none adds to, and the graph has {} micro-batches; make the model without "
               "bf16_expert_grads (dmoe train does so for a Flow schedule)", R);
  DMOE_REQUIRE_INPUT(g.spec.dense_grad_bytes_per_layer == cuda_mixtral_dense_grad_bytes_per_layer(c),
                     "flow executor: graph dense_grad_bytes_per_layer {} but the GPU model's layers hold {} bytes of "
                     "all-reduced gradients", g.spec.dense_grad_bytes_per_layer,
                     cuda_mixtral_dense_grad_bytes_per_layer(c));
  DMOE_REQUIRE_INPUT(g.spec.head_grad_bytes == mixtral_head_grad_bytes(c) &&
                         g.spec.embed_grad_bytes == mixtral_embed_grad_bytes(c),
                     "flow executor: graph head_grad_bytes {} and embed_grad_bytes {} but the GPU model's head (final "
                     "norm, lm_head) holds {} bytes of all-reduced gradients and its embedding {} "
                     "(set_mixtral_grad_layout)", g.spec.head_grad_bytes, g.spec.embed_grad_bytes,
                     mixtral_head_grad_bytes(c), mixtral_embed_grad_bytes(c));
  for (int32_t id : g.allreduce_order)
    DMOE_REQUIRE_INPUT(g.tasks[size_t(id)].bytes % 4 == 0,
                       "flow executor: chunk_bytes {}: must be a multiple of 4 (f32 gradients)", g.spec.chunk_bytes);
  check_task_graph(g);
  x.check_spec(g.spec);
  x.ensure_events(g.tasks.size());

  const int64_t micro = batch / R;
  const double scale = 1.0 / R;
  states.resize(size_t(R));
  for (int32_t r = 0; r < R; ++r) {
    model.begin_forward(tokens + r * micro * seq, micro, seq, states[size_t(r)]);
    model.prepare_engines(states[size_t(r)]);  // their config checks before the streams diverge
  }
  // The other streams start after what the caller and the set-up issued on the compute stream.
  DMOE_CHECK_CUDA(cudaEventRecord(x.step_begin, x.compute));
  DMOE_CHECK_CUDA(cudaStreamWaitEvent(x.a2a, x.step_begin, 0));
  DMOE_CHECK_CUDA(cudaStreamWaitEvent(x.ar, x.step_begin, 0));

  // The replicated gradients in the graph's layout (ReplicatedLayout: the order backward completes them): the head
  // (final norm, lm_head: written by C'[L−1, r]'s prelude), layers L−1 … 0 (norms, q/k/v/o, router), the embedding
  // (written by AT'[0, r]). Every byte of it is in some chunk: nothing is all-reduced outside the graph's tasks.
  const ParamLayout& lay = model.layout();
  DMOE_REQUIRE(lay.lm_head >= 0, "flow executor: the GPU model has no lm_head (tied embeddings are refused)");
  std::vector<Segment> replicated{{lay.norm, c.hidden_size}, {lay.lm_head, int64_t(c.vocab_size) * c.hidden_size}};
  for (int l = L - 1; l >= 0; --l)
    for (const Segment& s : layer_segments(c, lay, l)) replicated.push_back(s);
  replicated.push_back({lay.embed_tokens, int64_t(c.vocab_size) * c.hidden_size});
  float* grads = model.gradients();
  Comm& ar_comm = x.ar_comm();
  const cudaStream_t ar_stream = x.ar_stream();
  auto allreduce_elements = [&](int64_t first, int64_t last) {  // [first, last) of the replicated layout
    int64_t at = 0;
    for (const Segment& s : replicated) {
      const int64_t lo = std::max(first, at), hi = std::min(last, at + s.numel);
      if (lo < hi) ar_comm.allreduce_sum(grads + s.offset + (lo - at), hi - lo, DType::f32, ar_stream);
      at += s.numel;
    }
  };

  std::vector<uint8_t> issued(g.tasks.size(), 0);
  auto stream_of_task = [&](const Task& t) { return t.stream == flow::Stream::compute ? x.compute
                                                    : t.stream == flow::Stream::alltoall ? x.a2a : ar_stream; };
  // The task's stream waits for its dependencies on other streams (same-stream ones are ordered already).
  auto wait_deps = [&](const Task& t, cudaStream_t on) {
    for (int32_t d : t.deps) {
      DMOE_REQUIRE(issued[size_t(d)], "flow executor: {} issued before its dependency {}", g.describe(t.id),
                   g.describe(d));
      if (stream_of_task(g.tasks[size_t(d)]) != on) DMOE_CHECK_CUDA(cudaStreamWaitEvent(on, x.done[size_t(d)], 0));
    }
  };
  auto complete = [&](int32_t id) { return issued[size_t(id)] && cudaEventQuery(x.done[size_t(id)]) == cudaSuccess; };
  auto each_r = [&](const Task& t, auto&& fn) {
    if (t.micro_batch >= 0) return fn(t.micro_batch);
    for (int32_t r = 0; r < R; ++r) fn(r);
  };
  const dmoe::Stream a2a_lane = x.a2a;

  auto run = [&](const Task& t) {
    const int l = t.layer;
    switch (t.kind) {
      case TaskKind::attention_fwd:
        each_r(t, [&](int32_t r) {
          CudaModelState& st = states[size_t(r)];
          if (l == 0) model.embed_forward(st);
          else model.moe_finish(l - 1, st);
          model.attention_forward(l, st);
          model.moe_route(l, st);
        });
        break;
      case TaskKind::dispatch_fwd: model.moe_dispatch(l, states[size_t(t.micro_batch)], a2a_lane); break;
      case TaskKind::expert_fwd: model.moe_experts(l, states[size_t(t.micro_batch)]); break;
      case TaskKind::combine_fwd: model.moe_combine(l, states[size_t(t.micro_batch)], a2a_lane); break;
      case TaskKind::combine_bwd: model.moe_backward_dispatch(l, states[size_t(t.micro_batch)], a2a_lane); break;
      case TaskKind::expert_bwd: model.moe_backward_experts(l, states[size_t(t.micro_batch)]); break;
      case TaskKind::dispatch_bwd: model.moe_backward_return(l, states[size_t(t.micro_batch)], a2a_lane); break;
      case TaskKind::attention_bwd:
        each_r(t, [&](int32_t r) {
          CudaModelState& st = states[size_t(r)];
          model.moe_backward_finish(l, st);
          model.attention_backward(l, st);
          if (l == 0) model.embed_backward(st);
        });
        break;
      case TaskKind::allreduce: break;
    }
  };
  // C'[l, r]'s compute prelude: the gradient of the layer's output rows (and for l = L−1 the head, folded into
  // this task by the graph), on the compute stream after C'[l, r]'s dependencies; the exchange waits for it.
  auto prelude = [&](const Task& t) {
    CudaModelState& st = states[size_t(t.micro_batch)];
    wait_deps(t, x.compute);
    if (t.layer == L - 1) {
      model.moe_finish(L - 1, st);
      model.head_forward(st, a2a_lane);  // the loss all-reduce on the all-to-all stream; waits for the loss
      model.head_backward(st, scale);
    }
    model.moe_backward_combine(t.layer, st, scale);
    DMOE_CHECK_CUDA(cudaEventRecord(x.prelude, x.compute));
    DMOE_CHECK_CUDA(cudaStreamWaitEvent(x.a2a, x.prelude, 0));
  };
  auto issue = [&](int32_t id) {
    const Task& t = g.tasks[size_t(id)];
    cudaStream_t on = stream_of_task(t);
    if (t.kind == TaskKind::combine_bwd) prelude(t);
    wait_deps(t, on);
    if (timeline) DMOE_CHECK_CUDA(cudaEventRecord(x.begin[size_t(id)], on));
    if (t.kind == TaskKind::allreduce) {
      if (model.world() > 1) allreduce_elements(t.offset / 4, (t.offset + t.bytes) / 4);
    } else {
      run(t);
    }
    if (timeline) DMOE_CHECK_CUDA(cudaEventRecord(x.end[size_t(id)], on));
    DMOE_CHECK_CUDA(cudaEventRecord(x.done[size_t(id)], on));
    issued[size_t(id)] = 1;
  };

  if (x.mode == ArComm::model) {
    // One communicator: every task, the chunks included, in the static order; a chunk waits on the all-to-all
    // stream behind the all-to-alls issued before it (non-preemptive) and never delays one of them.
    for (int32_t id : single_comm_issue_order(g, x.chunks_per_gap)) issue(id);
  } else {
    // The priority rule on the host: the next chunk goes once its dependencies are complete on the GPU, the
    // previous chunk is complete, and no all-to-all is ready or running — the first incomplete all-to-all of the
    // order (issued or not) does not have all its dependencies complete. An issued all-to-all whose inputs are not
    // there yet only sits in its stream: it is neither ready nor running.
    size_t next_ar = 0, next_a2a_done = 0;
    auto poll_allreduce = [&](bool) {
      while (next_ar < g.allreduce_order.size()) {
        const Task& chunk = g.tasks[size_t(g.allreduce_order[next_ar])];
        for (const int32_t d : chunk.deps)
          if (!complete(d)) return;
        if (next_ar > 0 && !complete(g.allreduce_order[next_ar - 1])) return;
        while (next_a2a_done < g.alltoall_order.size() && complete(g.alltoall_order[next_a2a_done])) ++next_a2a_done;
        if (next_a2a_done < g.alltoall_order.size()) {
          const Task& a = g.tasks[size_t(g.alltoall_order[next_a2a_done])];
          bool ready = true;
          for (const int32_t d : a.deps) ready = ready && complete(d);
          if (ready) return;
        }
        issue(chunk.id);
        ++next_ar;
      }
    };

    for (int32_t id : merged_issue_order(g)) {
      issue(id);
      poll_allreduce(false);
    }
    // Everything but the chunks is issued: poll until the rule has let every chunk go. Bounded: the issued work
    // finishes (or a stream fails), after which the rule holds for every chunk; the limit is the communicators'
    // (DMOE_COMM_TIMEOUT_S), for a peer that died with collectives in flight.
    const auto t0 = std::chrono::steady_clock::now();
    const double limit_s = host_wait_timeout_seconds();
    while (next_ar < g.allreduce_order.size()) {
      poll_allreduce(true);
      if (next_ar == g.allreduce_order.size()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      for (cudaStream_t st : {x.a2a, x.compute, x.ar}) {
        const cudaError_t q = cudaStreamQuery(st);
        if (q != cudaSuccess && q != cudaErrorNotReady) DMOE_CHECK_CUDA(q);
      }
      DMOE_REQUIRE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < limit_s,
                   "flow executor: AR chunk {} of {} still waits for the priority rule after {} s (DMOE_COMM_TIMEOUT_S): "
                   "the GPU did not finish the issued work (a peer rank stopped?)", next_ar, g.allreduce_order.size(),
                   limit_s);
    }
  }
  // The compute stream (the model's) continues after the step only once the gradients are summed.
  DMOE_CHECK_CUDA(cudaEventRecord(x.prelude, x.ar));
  DMOE_CHECK_CUDA(cudaStreamWaitEvent(x.compute, x.prelude, 0));
  DMOE_CHECK_CUDA(cudaEventRecord(x.prelude, x.a2a));
  DMOE_CHECK_CUDA(cudaStreamWaitEvent(x.compute, x.prelude, 0));
  cuda::wait_stream(x.ar, "flow executor: the all-reduce stream");
  cuda::wait_stream(x.a2a, "flow executor: the all-to-all stream");
  cuda::wait_stream(x.compute, "flow executor: the compute stream");

  if (timeline) {
    timeline->clear();
    for (size_t id = 0; id < g.tasks.size(); ++id) {
      float b = 0, e = 0;
      DMOE_CHECK_CUDA(cudaEventElapsedTime(&b, x.step_begin, x.begin[id]));
      DMOE_CHECK_CUDA(cudaEventElapsedTime(&e, x.step_begin, x.end[id]));
      timeline->push_back({int32_t(id), double(b), double(e)});
    }
    std::sort(timeline->begin(), timeline->end(),
              [](const TraceEvent& a, const TraceEvent& b) { return a.end_ms < b.end_ms; });
  }
  double loss = 0;
  for (const CudaModelState& st : states) loss += st.loss / R;
  return loss;
}

// ---- measurement ---------------------------------------------------------------------------------------------

struct CudaFlowJob {
  CudaRank rank;
  std::unique_ptr<Comm> ar_comm;
  std::unique_ptr<CudaMixtralModel> model;
  std::unique_ptr<CudaFlowExecutor> executor;
  std::vector<CudaModelState> states;
  ~CudaFlowJob() {
    states.clear();  // engines before the model's backend and the communicators
    executor.reset();
    model.reset();
  }
};

std::unique_ptr<Comm> open_cuda_allreduce_comm(const Comm& model_comm) {
  const int32_t world = model_comm.world();
  const ProcessEnv env = detect_process_env();
  DMOE_REQUIRE(env.world == world, "flow: the job has {} ranks, the model {}", env.world, world);
  int visible = 0;
  DMOE_CHECK_CUDA(cudaGetDeviceCount(&visible));
  std::string why;
  const bool shared = world > 1 && gpus_are_shared(env, visible, &why);
  if (choose_ar_comm(std::getenv("DMOE_FLOW_AR_COMM"), world, shared, model_comm.name()) == ArComm::model)
    return nullptr;
  if (world == 1) return make_local_comm();
  // A communicator of its own for the chunks (docs/flow.md): NCCL, whatever the model's is. Two NvshmemComms
  // would share NVSHMEM's world barriers, and those of concurrent streams would pair up wrongly.
  DMOE_REQUIRE_INPUT(!shared,
                     "flow on the GPU: DMOE_FLOW_AR_COMM=own puts the all-reduce on a NCCL communicator, which needs "
                     "one GPU per rank, and ranks share GPUs here ({}); leave DMOE_FLOW_AR_COMM unset (auto) or set "
                     "it to model", why);
  return make_nccl_comm(env);
}

CudaFlowSession::CudaFlowSession(const MixtralConfig& config, const MixtralWeights& full, DType storage,
                                 int64_t max_tokens)
    : job_(std::make_unique<CudaFlowJob>()) {
  CudaFlowJob& j = *job_;
  j.rank = open_cuda_rank(config, storage, max_tokens);
  j.ar_comm = open_cuda_allreduce_comm(*j.rank.comm);
  j.model = std::make_unique<CudaMixtralModel>(config, storage, *j.rank.comm, std::move(j.rank.backend));
  j.model->set_weights(slice_mixtral_experts(full, j.model->first_expert(), j.model->experts_per_rank()));
  j.executor = std::make_unique<CudaFlowExecutor>(*j.model, j.ar_comm.get());
}

CudaFlowSession::~CudaFlowSession() = default;
int32_t CudaFlowSession::rank() const { return job_->rank.rank; }
int32_t CudaFlowSession::world() const { return job_->rank.world; }
ArComm CudaFlowSession::ar_comm() const { return job_->executor->ar_comm(); }

CudaFlowMeasurement CudaFlowSession::measure(const GraphSpec& spec, const int32_t* tokens, int64_t batch, int64_t seq,
                                             int32_t steps, ResourceProbe* probe) {
  DMOE_REQUIRE_INPUT(steps >= 1, "--steps {}: must be >= 1", steps);
  CudaFlowJob& j = *job_;
  const TaskGraph g = build_task_graph(spec);
  CudaFlowMeasurement m;
  m.spec = spec;
  std::vector<double> times;
  Comm& comm = *j.rank.comm;
  for (int32_t s = 0; s <= steps; ++s) {  // step 0 warms up (allocations, cuBLAS and cuDNN plans)
    j.model->zero_grads();
    if (comm.world() > 1) comm.barrier(j.model->backend().stream());
    j.model->backend().synchronize();
    if (probe && s == 1) probe->start();
    const auto t0 = std::chrono::steady_clock::now();
    m.loss = j.executor->step(g, tokens, batch, seq, j.states, j.rank.rank == 0 && s == steps ? &m.timeline : nullptr);
    if (s > 0) times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  if (probe) {
    j.model->backend().synchronize();
    m.resources = probe->finish(steps);
  }
  std::sort(times.begin(), times.end());
  m.step_ms = times[times.size() / 2];
  return m;
}

}  // namespace dmoe::flow
