// layer_session.cpp — see layer_session.hpp.
#include "engine/layer_session.hpp"

#include <algorithm>
#include <utility>

#include "comm/process_env.hpp"
#include "core/error.hpp"

#if defined(DMOE_WITH_CUDA)
#include <cuda_runtime.h>

#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "cuda/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "flash/flash_engine.hpp"
#endif

namespace dmoe {

// One set of engine state: W simulated ranks (cpu: backends, ThreadComms and engines of their own) or this
// process's rank (ep: the session's backend and communicator).
struct LayerSession::Slot {
  std::vector<std::unique_ptr<Backend>> backends;  // cpu: one per rank
  std::vector<std::unique_ptr<Comm>> comms;        // cpu: make_thread_comms(W)
  std::vector<std::unique_ptr<EpEngine>> engines;  // per rank held here
  std::vector<Buffer> gate_grads;                  // cpu: ranks 1.. reduce their gate gradient here
  bool busy = false;                               // a train forward waits for its backward
};

namespace {

// Makes the session's GPU current for one call and restores the caller's (torch keeps its own current device;
// the engines' cudaMalloc and launches must go to the session's). No-op for the CPU engine (device -1).
class DeviceGuard {
 public:
  // quiet: never throws (destructors); a failure then shows in the next CUDA call.
  explicit DeviceGuard(int32_t device, bool quiet = false) {
#if defined(DMOE_WITH_CUDA)
    if (device < 0) return;
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) {
      const bool ok = cudaSetDevice(device) == cudaSuccess;
      DMOE_REQUIRE(ok || quiet, "LayerSession: cannot make CUDA device {} current", device);
    } else {
      previous_ = -1;
    }
#else
    (void)device;
#endif
  }
  ~DeviceGuard() {
#if defined(DMOE_WITH_CUDA)
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
#endif
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace

#if defined(DMOE_WITH_CUDA)
struct LayerSession::FlashState {
  std::map<int64_t, std::unique_ptr<FlashEngine>> engines;  // inference, by rows per forward
  // Train engines (their forwards keep the backward's state): one per pending train forward, reused once its
  // backward has run or its ticket was released.
  struct Trainer {
    int64_t rows = 0;
    std::unique_ptr<FlashEngine> engine;
    bool busy = false;
    RouterLosses losses;
  };
  std::vector<std::unique_ptr<Trainer>> trainers;
  std::map<int64_t, Trainer*> tickets;
  // The backward's order against the caller's stream, on the device (events, not host waits): its stream waits for
  // the caller's (dy written), the caller's for its end (dx and the gradients).
  cudaEvent_t caller_ready = nullptr, backward_done = nullptr;
  ~FlashState() {
    if (caller_ready) cudaEventDestroy(caller_ready);
    if (backward_done) cudaEventDestroy(backward_done);
  }
};
#else
struct LayerSession::FlashState {};
#endif

LayerSession::LayerSession(const MoeConfig& config, const SessionOptions& options)
    : config_(config), options_(options) {
  if (config_.tokens < 1) config_.tokens = 1;  // set per call
  config_.validate();
  DMOE_REQUIRE_INPUT(options_.ep.batch_row_multiple >= 1, "batch_row_multiple = {} is invalid; must be >= 1",
                     options_.ep.batch_row_multiple);
  if (options_.engine == EngineKind::cpu) return;
#if defined(DMOE_WITH_CUDA)
  DMOE_REQUIRE_INPUT(options_.max_tokens >= 1, "max_tokens = {} is invalid; must be >= 1", options_.max_tokens);
  if (options_.engine == EngineKind::flash) {
    // The engines' own checks (dtype, drop policy).
    MoeEngineOptions checked;
    const std::string why = moe_engine_unusable_reason(EngineKind::flash, config_, checked);
    DMOE_REQUIRE_INPUT(why.empty(), "{}", why);
    flash_ = std::make_unique<FlashState>();
  }
  const ProcessEnv env = detect_process_env();
  // world = 1 is a layer of this process alone, whatever job it is part of (e.g. data parallel ranks that each
  // hold every expert); world > 1 is the job's ranks.
  DMOE_REQUIRE_INPUT(config_.world == 1 || env.world == config_.world,
                     "world = {} but this process was started as one of {} ranks (launcher: {}); with engine '{}' "
                     "every rank is a process: start world processes (dmoe launch, mpirun, srun, or torchrun) or "
                     "pass world = {}", config_.world, env.world, env.launcher, engine_kind_name(options_.engine),
                     env.world);
  rank_ = config_.world == 1 ? 0 : env.rank;
  // Making the backend selects its GPU: the caller's current device (torch's) is restored on the way out.
  struct RestoreDevice {
    int device = -1;
    RestoreDevice() {
      if (cudaGetDevice(&device) != cudaSuccess) device = -1;
    }
    ~RestoreDevice() {
      if (device >= 0) (void)cudaSetDevice(device);
    }
  } restore;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  DMOE_REQUIRE_INPUT(count > 0, "engine '{}' needs a CUDA GPU, and none is visible; use engine 'cpu'",
                     engine_kind_name(options_.engine));
  if (config_.world == 1) {
    device_ = options_.device >= 0 ? options_.device : choose_device(env, count);
    DMOE_REQUIRE_INPUT(device_ < count, "device = {} does not exist; {} GPUs are visible", device_, count);
    backend_ = make_cuda_backend(config_.dtype, device_);
    comm_ = make_local_comm();
  } else {
    device_ = select_device(env);
    DMOE_REQUIRE_INPUT(options_.device < 0 || options_.device == device_,
                       "device = {} was asked for, but rank {}'s GPU is {} (DMOE_DEVICE, else local rank % visible "
                       "GPUs); set DMOE_DEVICE to choose it", options_.device, rank_, device_);
    backend_ = make_cuda_backend(config_.dtype, device_);
    const int64_t H = config_.hidden, k = config_.top_k, Le = config_.experts_per_rank();
    const size_t per_peer = size_t(std::max(options_.max_tokens * k, options_.max_tokens * Le)) * size_t(H) *
                            dtype_size(config_.dtype);
    const CommKind kind = options_.engine == EngineKind::flash ? CommKind::nvshmem : parse_comm_kind(options_.comm);
    comm_ = make_gpu_comm(env, kind, per_peer, static_cast<cudaStream_t>(backend_->stream()));
  }
#else
  DMOE_FAIL_INPUT("engine '{}' needs the CUDA engines, and this dmoe was built without CUDA (DMOE_CUDA=OFF or no "
                  "nvcc); use engine 'cpu'", engine_kind_name(options_.engine));
#endif
}

LayerSession::~LayerSession() {
  const DeviceGuard guard(device_, /*quiet=*/true);
  // Engines before the backend and communicator they use.
  slots_.clear();
  flash_.reset();
}

int32_t LayerSession::first_expert() const {
  return options_.engine == EngineKind::cpu ? 0 : config_.first_expert(rank_);
}

int32_t LayerSession::held_experts() const {
  return options_.engine == EngineKind::cpu ? config_.experts : config_.experts_per_rank();
}

DType LayerSession::grad_dtype() const { return options_.engine == EngineKind::cpu ? DType::f64 : DType::f32; }

const char* LayerSession::comm_name() const { return comm_ ? comm_->name() : "thread"; }

void LayerSession::set_stream(Stream stream) {
  const DeviceGuard guard(device_);
  stream_ = stream;
  have_stream_ = true;
#if defined(DMOE_WITH_CUDA)
  // Flash launches on stream_ itself; its backend stays on its own stream, so that setting a stream that is
  // capturing a CUDA graph queues nothing on it (the switch's event would join the capture).
  if (backend_ && options_.engine == EngineKind::ep) set_cuda_backend_stream(*backend_, stream);
#endif
}

int64_t LayerSession::pending() const {
  int64_t n = int64_t(tickets_.size());
#if defined(DMOE_WITH_CUDA)
  if (flash_) n += int64_t(flash_->tickets.size());
#endif
  return n;
}

int64_t LayerSession::engines() const {
  int64_t n = int64_t(slots_.size());
#if defined(DMOE_WITH_CUDA)
  if (flash_) n += int64_t(flash_->engines.size() + flash_->trainers.size());
#endif
  return n;
}

LayerSession::Slot& LayerSession::take_slot() {
  for (auto& s : slots_)
    if (!s->busy) return *s;
  auto slot = std::make_unique<Slot>();
  const int32_t ranks = options_.engine == EngineKind::cpu ? config_.world : 1;
  slot->engines.resize(size_t(ranks));
  if (options_.engine == EngineKind::cpu) {
    for (int32_t r = 0; r < ranks; ++r) slot->backends.push_back(make_cpu_backend(config_.dtype));
    slot->comms = make_thread_comms(ranks);
    for (int32_t r = 0; r < ranks; ++r) slot->gate_grads.emplace_back(*slot->backends[size_t(r)]);
  }
  slots_.push_back(std::move(slot));
  return *slots_.back();
}

void LayerSession::run_ranks(Slot& slot, const std::function<void(int32_t, EpEngine&)>& fn) {
  MoeConfig c = config_;
  if (options_.engine != EngineKind::cpu) {
    if (!slot.engines[0]) slot.engines[0] = std::make_unique<EpEngine>(c, *backend_, *comm_, options_.ep);
    fn(rank_, *slot.engines[0]);
    return;
  }
  const auto body = [&](int32_t r, Comm& comm) {
    if (!slot.engines[size_t(r)])
      slot.engines[size_t(r)] = std::make_unique<EpEngine>(c, *slot.backends[size_t(r)], comm, options_.ep);
    fn(r, *slot.engines[size_t(r)]);
  };
  if (config_.world == 1) {
    body(0, *slot.comms[0]);
    return;
  }
  try {
    run_thread_ranks(slot.comms, body);
  } catch (...) {
    // The thread group is poisoned: this slot's communicators cannot be used again.
    for (auto it = tickets_.begin(); it != tickets_.end();)
      it = it->second == &slot ? tickets_.erase(it) : std::next(it);
    slots_.erase(std::find_if(slots_.begin(), slots_.end(), [&](const auto& s) { return s.get() == &slot; }));
    throw;
  }
}

namespace {

const char* offset(const void* p, int64_t bytes) { return p ? static_cast<const char*>(p) + bytes : nullptr; }
char* offset(void* p, int64_t bytes) { return p ? static_cast<char*>(p) + bytes : nullptr; }

}  // namespace

int64_t LayerSession::forward(const SessionForward& f) {
  const DeviceGuard guard(device_);
  DMOE_REQUIRE_INPUT(f.rows >= 1, "forward: rows = {} is invalid; the input needs at least one token", f.rows);
  DMOE_REQUIRE(f.x && f.y, "forward: x and y must not be null");
  DMOE_REQUIRE(f.weights.gate && f.weights.w1 && f.weights.w2, "forward: the weights must not be null");
  if (options_.engine == EngineKind::flash) return flash_forward(f);
  const bool cpu = options_.engine == EngineKind::cpu;
  // Before a slot (an engine, its allocations) is taken: an allocation would invalidate the caller's capture.
  DMOE_REQUIRE_INPUT(cpu || !f.train || !backend_->stream_capturing(),
                     "forward: a train forward cannot be captured in a CUDA graph with engine 'ep' (its backward reads "
                     "the routing counts on the host); capture inference forwards only (torch.no_grad())");
  const int32_t ranks = cpu ? config_.world : 1;
  DMOE_REQUIRE_INPUT(f.rows % ranks == 0,
                     "forward: {} rows cannot be split over world = {} simulated ranks; the CPU engine gives every "
                     "rank the same number of tokens: pass a multiple of {}", f.rows, ranks, ranks);
  DMOE_REQUIRE_INPUT(cpu || config_.world == 1 || f.rows <= options_.max_tokens,
                     "forward: {} tokens on this rank, more than max_tokens = {}, which sized the communicator's "
                     "buffers; make the layer with a larger max_tokens", f.rows, options_.max_tokens);
  const int64_t T = f.rows / ranks, H = config_.hidden, I = config_.ffn, E = config_.experts, k = config_.top_k;
  const int32_t Le = config_.experts_per_rank();
  const size_t elem = dtype_size(config_.dtype);
  Slot& slot = take_slot();
  run_ranks(slot, [&](int32_t r, EpEngine& engine) {
    const int32_t local = cpu ? r : 0;  // index of this rank's share in what the caller holds
    if (engine.config().tokens != T) engine.set_tokens(T);
    const int64_t expert_bytes = int64_t(local) * Le * I * H * int64_t(elem);
    WeightViews w;
    w.gate = f.weights.gate;
    w.w1 = offset(f.weights.w1, expert_bytes);
    w.w3 = offset(f.weights.w3, expert_bytes);
    w.w2 = offset(f.weights.w2, expert_bytes);
    engine.set_weight_views(w);
    const int64_t row0 = int64_t(local) * T;
    engine.forward(offset(f.x, row0 * H * int64_t(elem)), offset(f.y, row0 * H * int64_t(elem)),
                   f.train ? ForwardMode::train : ForwardMode::inference);
    const RoutingViews rv = engine.routing_views();
    Backend& be = engine.backend();
    if (f.expert_ids) be.copy(f.expert_ids + row0 * k, rv.ids, size_t(T * k) * sizeof(int32_t));
    if (f.expert_weights) be.copy(f.expert_weights + row0 * k, rv.weights, size_t(T * k) * sizeof(float));
    if (f.router_logits) be.copy(f.router_logits + row0 * E, rv.logits, size_t(T * E) * sizeof(float));
  });
  if (!f.train) return -1;
  // The losses are read when asked for (losses()): a forward with deferred routing reads waits for nothing.
  slot.busy = true;
  const int64_t ticket = next_ticket_++;
  tickets_[ticket] = &slot;
  return ticket;
}

void LayerSession::backward(const SessionBackward& b) {
  const DeviceGuard guard(device_);
  DMOE_REQUIRE_INPUT(!b.grads.experts_in_storage_dtype || (options_.engine != EngineKind::cpu && config_.dtype == DType::bf16),
                     "backward: expert gradients in the weights' dtype need engine ep or flash with bf16 weights (this "
                     "layer: engine {}, {})", engine_kind_name(options_.engine), dtype_name(config_.dtype));
  if (options_.engine == EngineKind::flash) return flash_backward(b);
  const auto it = tickets_.find(b.ticket);
  DMOE_REQUIRE_INPUT(it != tickets_.end(),
                     "backward: ticket {} is not a pending train forward of this layer (already backward()ed or "
                     "released, or from an inference forward)", b.ticket);
  DMOE_REQUIRE(b.dy && b.dx && b.grads.gate && b.grads.w1 && b.grads.w2, "backward: null pointers");
  Slot& slot = *it->second;
  const bool cpu = options_.engine == EngineKind::cpu;
  const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts;
  const int32_t Le = config_.experts_per_rank();
  const size_t elem = dtype_size(config_.dtype), acc = dtype_size(grad_dtype());
  // Whatever happens, this forward's state is used up.
  tickets_.erase(it);
  slot.busy = false;
  run_ranks(slot, [&](int32_t r, EpEngine& engine) {
    const int32_t local = cpu ? r : 0;
    const int64_t T = engine.config().tokens;
    const int64_t expert_elems = int64_t(local) * Le * I * H;
    GradViews g;
    g.gate = local == 0 ? b.grads.gate : slot.gate_grads[size_t(r)].ensure(size_t(E * H) * acc);
    g.w1 = offset(b.grads.w1, expert_elems * int64_t(acc));
    g.w3 = offset(b.grads.w3, expert_elems * int64_t(acc));
    g.w2 = offset(b.grads.w2, expert_elems * int64_t(acc));
    g.experts_in_storage_dtype = b.grads.experts_in_storage_dtype;
    engine.set_grad_views(g);  // zeroes the gate's; the experts' are written by the backward
    const int64_t row0 = int64_t(local) * T;
    engine.backward(offset(b.dy, row0 * H * int64_t(elem)), offset(b.dx, row0 * H * int64_t(elem)));
    engine.reduce_gate_grad();
  });
}

void LayerSession::release(int64_t ticket) noexcept {
#if defined(DMOE_WITH_CUDA)
  if (flash_) {
    const auto ft = flash_->tickets.find(ticket);
    if (ft != flash_->tickets.end()) {
      ft->second->busy = false;
      flash_->tickets.erase(ft);
      return;
    }
  }
#endif
  const auto it = tickets_.find(ticket);
  if (it == tickets_.end()) return;
  it->second->busy = false;
  tickets_.erase(it);
}

RouterLosses LayerSession::losses(int64_t ticket) {
#if defined(DMOE_WITH_CUDA)
  if (flash_) {
    const auto ft = flash_->tickets.find(ticket);
    if (ft != flash_->tickets.end()) return ft->second->losses;
  }
#endif
  const auto it = tickets_.find(ticket);
  DMOE_REQUIRE_INPUT(it != tickets_.end(), "losses: ticket {} is not a pending train forward of this layer", ticket);
  // Rank 0's engine (cpu: the simulated ranks' first; ep: this rank's only one): the losses are over all ranks.
  const DeviceGuard guard(device_);
  return it->second->engines.front()->losses();
}

int64_t LayerSession::flash_forward(const SessionForward& f) {
#if defined(DMOE_WITH_CUDA)
  DMOE_REQUIRE_INPUT(!f.router_logits, "engine 'flash' does not output router logits; use engine 'ep'");
  const auto stream = static_cast<cudaStream_t>(have_stream_ ? stream_ : backend_->stream());
  FlashEngine* engine = nullptr;
  FlashState::Trainer* trainer = nullptr;
  MoeConfig c = config_;
  c.tokens = f.rows;
  if (f.train) {
    for (auto& t : flash_->trainers)
      if (!t->busy && t->rows == f.rows) trainer = t.get();
    if (!trainer) {
      flash_->trainers.push_back(std::make_unique<FlashState::Trainer>());
      trainer = flash_->trainers.back().get();
      trainer->rows = f.rows;
      trainer->engine = std::make_unique<FlashEngine>(c, *comm_, /*train=*/true);
    }
    engine = trainer->engine.get();
  } else {
    auto& e = flash_->engines[f.rows];
    if (!e) e = std::make_unique<FlashEngine>(c, *comm_);
    engine = e.get();
  }
  engine->set_weight_views(f.weights.gate, f.weights.w1, f.weights.w3, f.weights.w2);
  engine->forward(f.x, f.y, stream);
  if (f.expert_ids || f.expert_weights) {  // a host round trip: Flash keeps its routing in its own layout
    const std::vector<int32_t> ids = engine->expert_ids(stream);
    const std::vector<float> weights = engine->expert_weights(stream);
    if (f.expert_ids) backend_->upload(f.expert_ids, ids.data(), ids.size() * sizeof(int32_t));
    if (f.expert_weights) backend_->upload(f.expert_weights, weights.data(), weights.size() * sizeof(float));
    backend_->synchronize();  // the host vectors go out of scope
  }
  if (!f.train) return -1;
  // The router's auxiliary losses (the forward is then done; its counts are read for the backward too).
  trainer->losses = flash_train_losses(*engine, *backend_, *comm_, stream);
  // The forward's flags (a token with NaN router logits; the epoch count), read now that the losses have waited for
  // it: an error names the forward that made it, and the backward needs no host wait of its own.
  engine->check(stream);
  trainer->busy = true;
  const int64_t ticket = next_ticket_++;
  flash_->tickets[ticket] = trainer;
  return ticket;
#else
  (void)f;
  DMOE_FAIL("flash_forward without CUDA");
#endif
}

void LayerSession::flash_backward(const SessionBackward& b) {
#if defined(DMOE_WITH_CUDA)
  const auto it = flash_->tickets.find(b.ticket);
  DMOE_REQUIRE_INPUT(it != flash_->tickets.end(),
                     "backward: ticket {} is not a pending train forward of this layer (already backward()ed or "
                     "released, or from an inference forward)", b.ticket);
  DMOE_REQUIRE(b.dy && b.dx && b.grads.gate && b.grads.w1 && b.grads.w2, "backward: null pointers");
  FlashState::Trainer& t = *it->second;
  flash_->tickets.erase(it);  // whatever happens, this forward's state is used up
  t.busy = false;
  // The Flash backward runs on the backend's kernels and stream (cuda::flash_backward), after the caller's stream
  // has reached this point (dy written); the caller's stream then waits for it (dx, gradients). Both orders are
  // events: a host wait here drained the caller's queue (torch's), whose next kernels then waited for the host.
  const auto caller = static_cast<cudaStream_t>(have_stream_ ? stream_ : backend_->stream());
  const auto own = static_cast<cudaStream_t>(backend_->stream());
  if (!flash_->caller_ready) {
    DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&flash_->caller_ready, cudaEventDisableTiming));
    DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&flash_->backward_done, cudaEventDisableTiming));
  }
  if (caller != own) {
    DMOE_CHECK_CUDA(cudaEventRecord(flash_->caller_ready, caller));
    DMOE_CHECK_CUDA(cudaStreamWaitEvent(own, flash_->caller_ready, 0));
  }
  // The caller's stream waits for whatever was issued, also when a step below throws after issuing work (torch
  // could otherwise reuse dx or the gradients while kernels still write them).
  struct JoinCaller {
    cudaStream_t caller, own;
    cudaEvent_t done;
    ~JoinCaller() {
      if (caller != own && cudaEventRecord(done, own) == cudaSuccess) (void)cudaStreamWaitEvent(caller, done, 0);
    }
  } join{caller, own, flash_->backward_done};
  const int64_t E = config_.experts, H = config_.hidden;
  backend_->zero(b.grads.gate, size_t(E * H) * sizeof(float));  // written, not added to
  FlashGradViews g{b.grads.gate, b.grads.w1, b.grads.w3, b.grads.w2, b.grads.experts_in_storage_dtype};
  t.engine->backward(b.dy, b.dx, g, /*accumulate=*/false, *backend_, own);
  if (config_.world > 1) comm_->allreduce_sum(b.grads.gate, E * H, DType::f32, backend_->stream());
  // No host wait: the forward's flags were checked with its losses (on the flagged rank only: with W > 1 its peers
  // then stop at their backward's bounded wait for its rows), and the backward's waits are bounded on the device:
  // a time-out stops its kernel, dmoe's next CUDA call on this process reports the wait record, and a
  // synchronisation of the caller's own (torch's) reports only that a kernel failed.
#else
  (void)b;
  DMOE_FAIL("flash_backward without CUDA");
#endif
}

}  // namespace dmoe
