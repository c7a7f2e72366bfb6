// flash/flash_engine.cpp — see flash_engine.hpp.
#include "flash/flash_engine.hpp"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "core/error.hpp"
#include "cuda/check.hpp"
#include "engine/backend.hpp"
#include "engine/buffer.hpp"
#include "engine/ep_engine.hpp"
#include "cuda/sm90_host.hpp"
#include "flash/flash_kernel.hpp"

namespace dmoe {

namespace {

void* upload_bf16(const std::vector<float>& v) {
  std::vector<bfloat16> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = float_to_bf16(v[i]);
  void* d = cuda::device_malloc(std::max<size_t>(h.size() * 2, 16), "Flash weights");
  if (!h.empty()) DMOE_CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}

// Ranks that disagree on the config would wait for counts and rows that never come: one sum over ranks of a
// fingerprint makes every rank see the mismatch (as EpEngine does).
void check_ranks_agree(const MoeConfig& c, Comm& comm) {
  const auto bits = [](double v) {
    uint64_t u;
    std::memcpy(&u, &v, sizeof(u));
    return int64_t(u >> 20);
  };
  const std::vector<int64_t> mine{c.tokens, c.hidden, c.ffn, c.experts, c.top_k, int64_t(c.activation),
                                  int64_t(c.renormalize), c.capacity(), bits(c.capacity_factor),
                                  int64_t(c.drop_policy), int64_t(c.dtype)};
  const size_t bytes = mine.size() * sizeof(int64_t);
  void* d = nullptr;
  DMOE_CHECK_CUDA(cudaMalloc(&d, bytes));
  DMOE_CHECK_CUDA(cudaMemcpy(d, mine.data(), bytes, cudaMemcpyHostToDevice));
  comm.allreduce_sum(d, int64_t(mine.size()), DType::i64, nullptr);
  std::vector<int64_t> sum(mine.size());
  cuda::wait_stream(nullptr, "FlashEngine: the config check across ranks");
  DMOE_CHECK_CUDA(cudaMemcpy(sum.data(), d, bytes, cudaMemcpyDeviceToHost));
  DMOE_CHECK_CUDA(cudaFree(d));
  for (size_t i = 0; i < mine.size(); ++i)
    DMOE_REQUIRE(sum[i] == mine[i] * c.world,
                 "FlashEngine: the {} ranks do not all use the same layer config (field {} of the fingerprint "
                 "differs; this rank: {})", c.world, i, c.summary());
}

}  // namespace

FlashEngine::FlashEngine(const MoeConfig& config, Comm& comm, bool train) : config_(config), rank_(comm.rank()) {
  config_.validate();
  DMOE_REQUIRE(config_.world == comm.world(), "FlashEngine: config.world = {} but the communicator has {} ranks",
               config_.world, comm.world());
  DMOE_REQUIRE(config_.dtype == DType::bf16,
               "FlashEngine: dtype = {}; Flash runs bf16 only (f32 layers run on the EP engine: --engine ep)",
               dtype_name(config_.dtype));
  DMOE_REQUIRE(config_.dropless() || config_.drop_policy == DropPolicy::latest_tokens,
               "FlashEngine: drop_policy = {} is not supported; Flash keeps each expert's earliest tokens "
               "(latest-tokens)", drop_policy_name(config_.drop_policy));
  shape_ = flash::make_shape(config_, 1);
  shape_.train = train;
  const std::string why = cuda::flash_unusable_reason(shape_);
  DMOE_REQUIRE(why.empty(), "FlashEngine: {} ({})", why, config_.summary());
  shape_.grid = cuda::flash_grid_blocks(shape_);
  shape_.split_gate = cuda::flash_split_gate(shape_);
  shape_.spread_combine = cuda::flash_spread_combine();
  shape_.prefetch_down = cuda::flash_prefetch_down();
  if (config_.world > 1) check_ranks_agree(config_, comm);
  sl_ = flash::symmetric_layout(shape_);
  ll_ = flash::local_layout(shape_);
  symmetric_ = allocate_symmetric(rank_, config_.world, sl_.bytes, "Flash receive buffers and signals");
  local_bytes_ = ll_.bytes;
  void* p = cuda::device_malloc(local_bytes_, "Flash's local buffers (expert batches, h, routing)");
  local_ = static_cast<char*>(p);
  DMOE_CHECK_CUDA(cudaMemset(local_, 0, local_bytes_));
  std::vector<uint64_t> peers(symmetric_.peers.size());
  for (size_t i = 0; i < peers.size(); ++i) peers[i] = reinterpret_cast<uint64_t>(symmetric_.peers[i]);
  DMOE_CHECK_CUDA(cudaMemcpy(local_ + ll_.peers, peers.data(), peers.size() * sizeof(uint64_t), cudaMemcpyHostToDevice));
}

FlashEngine::~FlashEngine() {
  if (!cuda::synchronize_device_quietly()) return;  // hung or failed GPU work: left to process exit
  if (owns_weights_)  // borrowed weights (set_weight_views) belong to the caller
    for (void* p : {gate_, w1_, w3_, w2_}) cuda::free_quietly(p);
  for (void* p : {static_cast<void*>(local_), static_cast<void*>(profile_)}) cuda::free_quietly(p);
  for (cudaEvent_t e : stage_events_) cudaEventDestroy(e);
  free_symmetric(symmetric_);
}

void FlashEngine::set_weights(const MoeWeights& w) {
  const int32_t Le = config_.experts_per_rank();
  DMOE_REQUIRE(w.hidden == config_.hidden && w.ffn == config_.ffn && w.experts == config_.experts,
               "FlashEngine: weights are for H={} I={} E={}; config has H={} I={} E={}", w.hidden, w.ffn, w.experts,
               config_.hidden, config_.ffn, config_.experts);
  DMOE_REQUIRE(w.first_expert == config_.first_expert(rank_) && w.num_experts == Le,
               "FlashEngine: rank {} owns experts [{}, {}); the weights hold [{}, {})", rank_,
               config_.first_expert(rank_), config_.first_expert(rank_) + Le, w.first_expert,
               w.first_expert + w.num_experts);
  DMOE_REQUIRE(w.activation == config_.activation, "FlashEngine: weights are for activation {}; config has {}",
               activation_name(w.activation), activation_name(config_.activation));
  release_weights();
  gate_ = upload_bf16(w.gate);
  w1_ = upload_bf16(w.w1);
  if (config_.activation == Activation::swiglu) w3_ = upload_bf16(w.w3);
  w2_ = upload_bf16(w.w2);
  owns_weights_ = true;
  has_weights_ = true;
}

void FlashEngine::release_weights() {
  if (has_weights_) DMOE_CHECK_CUDA(cudaDeviceSynchronize());  // a forward in flight may still read the old weights
  for (void** p : {&gate_, &w1_, &w3_, &w2_}) {
    if (*p && owns_weights_) DMOE_CHECK_CUDA(cudaFree(*p));
    *p = nullptr;
  }
  owns_weights_ = false;
  has_weights_ = false;
}

void FlashEngine::set_weight_views(const void* gate, const void* w1, const void* w3, const void* w2) {
  const bool swiglu = config_.activation == Activation::swiglu;
  DMOE_REQUIRE(gate && w1 && w2, "FlashEngine::set_weight_views: the gate, w1 and w2 pointers must not be null");
  DMOE_REQUIRE((w3 != nullptr) == swiglu,
               "FlashEngine::set_weight_views: w3 is {} but the activation is {}; w3 is given exactly for swiglu",
               w3 ? "given" : "null", activation_name(config_.activation));
  for (const void* p : {gate, w1, w3, w2})
    DMOE_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 "FlashEngine::set_weight_views: weight pointers must be 16-byte aligned (TMA loads)");
  if (gate == gate_ && w1 == w1_ && w3 == w3_ && w2 == w2_ && !owns_weights_) return;  // the same views
  release_weights();
  gate_ = const_cast<void*>(gate);
  w1_ = const_cast<void*>(w1);
  w3_ = const_cast<void*>(w3);
  w2_ = const_cast<void*>(w2);
  has_weights_ = true;
}

flash::Params FlashEngine::params(const void* x, void* y) const {
  flash::Params p;
  p.shape = shape_;
  p.rank = rank_;
  p.x = x;
  p.gate = gate_;
  p.w1 = w1_;
  p.w3 = w3_;
  p.w2 = w2_;
  p.y = y;
  p.symmetric = symmetric_.local;
  p.local = local_;
  p.timeout_ns = cuda::wait_timeout_ns();
  p.skip_lag_ns = skip_lag_ns_;
  return p;
}

void FlashEngine::forward(const void* x, void* y, cudaStream_t stream) {
  DMOE_REQUIRE(has_weights_, "FlashEngine::forward: set_weights() first");
  DMOE_REQUIRE(reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0,
               "FlashEngine::forward: x and y must be 16-byte aligned device pointers");
  flash::Params p = params(x, y);
  p.profile = profile_;
  cuda::flash_forward(p, stream);
  ++forwards_;
  last_x_ = x;
  backward_pending_ = shape_.train;
}

void FlashEngine::backward(const void* dy, void* dx, const FlashGradViews& g, bool accumulate, Backend& backend,
                           cudaStream_t stream) {
  DMOE_REQUIRE(shape_.train, "FlashEngine::backward: this engine was made without train (its forwards keep nothing "
               "for a backward); make it with train = true");
  DMOE_REQUIRE(backward_pending_, "FlashEngine::backward: {}", forwards_ == 0
                   ? "no forward has run"
                   : "the last forward's backward has already run (one backward per forward, before the next forward)");
  DMOE_REQUIRE(dy && dx && g.gate && g.w1 && g.w2 && ((g.w3 != nullptr) == (config_.activation == Activation::swiglu)),
               "FlashEngine::backward: null pointers (w3 is given exactly for swiglu)");
  DMOE_REQUIRE(reinterpret_cast<uintptr_t>(dy) % 16 == 0 && reinterpret_cast<uintptr_t>(dx) % 16 == 0,
               "FlashEngine::backward: dy and dx must be 16-byte aligned device pointers");
  flash::BackwardParams b;
  b.forward = params(last_x_, nullptr);
  b.dy = dy;
  b.dx = dx;
  b.dgate = g.gate;
  b.dw1 = g.w1;
  b.dw3 = g.w3;
  b.dw2 = g.w2;
  b.accumulate = accumulate;
  DMOE_REQUIRE(!g.experts_bf16 || !accumulate,
               "FlashEngine::backward: bf16 expert gradients are written, never added to (accumulate must be false)");
  b.experts_bf16 = g.experts_bf16;
  b.aux_loss_coef = config_.aux_loss_coef;
  b.z_loss_coef = config_.z_loss_coef;
  b.stage_events = stage_events_.empty() ? nullptr : stage_events_.data();
  if (host_inbox_forward_ == forwards_ && !host_inbox_.empty()) {  // read with this forward's losses
    b.inbox_host = host_inbox_.data();
    b.inbox_epoch = uint32_t(forwards_);
  }
  backward_pending_ = false;  // also when it throws: the forward's state may be half used
  cuda::flash_backward(b, backend, stream);
}

void FlashEngine::read_counts(cudaStream_t stream) {
  DMOE_REQUIRE(forwards_ > 0, "FlashEngine::read_counts: no forward has run");
  cuda::wait_stream(stream, "FlashEngine::read_counts");
  const int32_t W = config_.world, E = config_.experts;
  host_inbox_.resize(size_t(W) * E);
  DMOE_CHECK_CUDA(cudaMemcpy(host_inbox_.data(), symmetric_.local + sl_.counts + size_t(forwards_ & 1) * W * E * sizeof(uint64_t),
                             host_inbox_.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  host_inbox_forward_ = forwards_;
}

RouterLosses flash_train_losses(FlashEngine& engine, Backend& backend, Comm& comm, cudaStream_t stream) {
  const MoeConfig& c = engine.config();
  const int32_t E = c.experts;
  cuda::wait_stream(stream, "flash_train_losses: the Flash train forward");
  engine.read_counts(stream);  // the forward is done: its backward then needs no wait of its own
  std::vector<double> stats(size_t(2 * E + 1), 0.0);
  backend.router_aux_partials(engine.probs(), engine.lse(), engine.ids(), c.tokens, E, c.top_k, stats.data(),
                              stats.data() + E, stats.data() + 2 * E);
  if (c.world > 1) {
    Buffer dev(backend);
    dev.ensure(stats.size() * sizeof(double));
    backend.upload(dev.data(), stats.data(), stats.size() * sizeof(double));
    comm.allreduce_sum(dev.data(), int64_t(stats.size()), DType::f64, backend.stream());
    backend.download(stats.data(), dev.data(), stats.size() * sizeof(double));
  }
  return router_losses_from_stats(stats.data(), E, c.top_k, double(c.tokens) * c.world);
}

void FlashEngine::set_backward_timing(bool on) {
  if (on && stage_events_.empty()) {
    stage_events_.resize(flash::kBackwardStages + 1);
    for (auto& e : stage_events_) DMOE_CHECK_CUDA(cudaEventCreate(&e));
  } else if (!on) {
    DMOE_CHECK_CUDA(cudaDeviceSynchronize());
    for (auto& e : stage_events_) cudaEventDestroy(e);
    stage_events_.clear();
  }
}

std::vector<double> FlashEngine::backward_stage_ms(cudaStream_t stream) {
  DMOE_REQUIRE(!stage_events_.empty(), "FlashEngine::backward_stage_ms: set_backward_timing(true) before the backward");
  cuda::wait_stream(stream, "FlashEngine::backward_stage_ms");
  std::vector<double> ms(flash::kBackwardStages);
  for (int32_t i = 0; i < flash::kBackwardStages; ++i) {
    float t = 0;
    DMOE_CHECK_CUDA(cudaEventElapsedTime(&t, stage_events_[i], stage_events_[i + 1]));
    ms[i] = t;
  }
  return ms;
}

const float* FlashEngine::probs() const {
  DMOE_REQUIRE(shape_.train, "FlashEngine::probs: only train engines keep the router's probabilities");
  return reinterpret_cast<const float*>(local_ + ll_.probs);
}
const float* FlashEngine::lse() const {
  DMOE_REQUIRE(shape_.train, "FlashEngine::lse: only train engines keep the router's log-sum-exp");
  return reinterpret_cast<const float*>(local_ + ll_.lse);
}
const int32_t* FlashEngine::ids() const { return reinterpret_cast<const int32_t*>(local_ + ll_.ids); }

void FlashEngine::check(cudaStream_t stream) {
  cuda::wait_stream(stream, "FlashEngine: the forward on this rank's stream");
  flash::Control c{};
  DMOE_CHECK_CUDA(cudaMemcpy(&c, local_ + ll_.control, sizeof(c), cudaMemcpyDeviceToHost));
  if (c.error == flash::kErrorNanRouting) {
    const uint32_t zero[2] = {0, 0};
    DMOE_CHECK_CUDA(cudaMemcpy(local_ + ll_.control + offsetof(flash::Control, error), zero, sizeof(zero),
                               cudaMemcpyHostToDevice));
    DMOE_FAIL("FlashEngine (rank {}): token {} has router logits with a NaN (x or the gate holds a NaN or Inf): "
              "no expert can be chosen for it and its output row is wrong", rank_, c.error_detail);
  }
  DMOE_REQUIRE(c.epoch == forwards_, "FlashEngine (rank {}): {} forwards issued but the kernel counted {}", rank_,
               forwards_, c.epoch);
}

void FlashEngine::set_profiling(bool on) {
  if (on && profile_ == nullptr) {
    void* p = nullptr;
    DMOE_CHECK_CUDA(cudaMalloc(&p, size_t(shape_.grid) * flash::kProfileSlots * sizeof(uint64_t)));
    DMOE_CHECK_CUDA(cudaMemset(p, 0, size_t(shape_.grid) * flash::kProfileSlots * sizeof(uint64_t)));
    profile_ = static_cast<uint64_t*>(p);
  } else if (!on && profile_ != nullptr) {
    DMOE_CHECK_CUDA(cudaDeviceSynchronize());
    DMOE_CHECK_CUDA(cudaFree(profile_));
    profile_ = nullptr;
  }
}

std::vector<uint64_t> FlashEngine::profile(cudaStream_t stream) {
  DMOE_REQUIRE(profile_ != nullptr, "FlashEngine::profile: set_profiling(true) before the forward");
  cuda::wait_stream(stream, "FlashEngine::profile");
  std::vector<uint64_t> v(size_t(shape_.grid) * flash::kProfileSlots);
  DMOE_CHECK_CUDA(cudaMemcpy(v.data(), profile_, v.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  return v;
}

FlashProfileSummary summarize_flash_profile(const std::vector<uint64_t>& prof, int32_t grid) {
  using namespace flash;
  FlashProfileSummary s;
  auto at = [&](int32_t b, int32_t slot) { return prof[size_t(b) * kProfileSlots + slot]; };
  auto median_max = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return std::pair<double, double>{v.empty() ? 0 : v[v.size() / 2], v.empty() ? 0 : v.back()};
  };
  static const char* names[] = {"gate: logits of own tokens", "gate: softmax, top-k, ranks", "grid barrier (all blocks routed)",
                                "counts (all ranks' counts, tables)", "dispatch (send own rows)",
                                "to first task", "tasks (first to last)", "wait for all outputs", "combine"};
  uint64_t first = ~0ull, last = 0;
  double busy = 0;
  for (int32_t b = 0; b < grid; ++b) {
    first = std::min<uint64_t>(first, at(b, kStampStart));
    last = std::max<uint64_t>(last, at(b, kStampCombined));
    busy += double(at(b, kStampTasksDone) - at(b, kStampFirstTask));
  }
  s.span_ms = double(last - first) * 1e-6;
  s.processors_busy = s.span_ms > 0 ? busy * 1e-6 / (double(grid) * s.span_ms) : 0;
  for (int32_t ph = 0; ph < 9; ++ph) {
    std::vector<double> d;
    for (int32_t b = 0; b < grid; ++b) d.push_back(double(at(b, ph + 1) - at(b, ph)) * 1e-6);
    const auto [med, mx] = median_max(d);
    s.phases.push_back({names[ph], med, mx});
  }
  std::vector<double> waits, tasks;
  for (int32_t b = 0; b < grid; ++b) {
    waits.push_back(double(at(b, kProducerWaitNs)) * 1e-6);
    tasks.push_back(double(at(b, kTasksRun)));
  }
  std::tie(s.producer_wait_median_ms, s.producer_wait_max_ms) = median_max(waits);
  s.tasks_per_block_median = median_max(tasks).first;
  return s;
}

std::vector<int32_t> FlashEngine::expert_ids(cudaStream_t stream) {
  cuda::wait_stream(stream, "FlashEngine::expert_ids");
  std::vector<int32_t> v(size_t(config_.tokens * config_.top_k));
  DMOE_CHECK_CUDA(cudaMemcpy(v.data(), local_ + ll_.ids, v.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return v;
}

std::vector<float> FlashEngine::expert_weights(cudaStream_t stream) {
  cuda::wait_stream(stream, "FlashEngine::expert_weights");
  std::vector<float> v(size_t(config_.tokens * config_.top_k));
  DMOE_CHECK_CUDA(cudaMemcpy(v.data(), local_ + ll_.weights, v.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return v;
}

std::vector<int64_t> FlashEngine::expert_rows(cudaStream_t stream) {
  cuda::wait_stream(stream, "FlashEngine::expert_rows");
  const int32_t W = config_.world, E = config_.experts, Le = config_.experts_per_rank();
  std::vector<uint64_t> counts(size_t(W) * E);
  const uint32_t parity = uint32_t(forwards_) & 1;
  DMOE_CHECK_CUDA(cudaMemcpy(counts.data(), symmetric_.local + sl_.counts + size_t(parity) * W * E * sizeof(uint64_t),
                             counts.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  std::vector<int64_t> rows(size_t(Le), 0);
  for (int32_t le = 0; le < Le; ++le)
    for (int32_t s = 0; s < W; ++s) {
      const int64_t n = flash::signal_value(counts[size_t(s) * E + rank_ * Le + le]);
      rows[le] += shape_.capacity < 0 ? n : std::min<int64_t>(n, shape_.capacity);
    }
  return rows;
}

}  // namespace dmoe
