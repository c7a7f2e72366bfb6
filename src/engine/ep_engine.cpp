#include "engine/ep_engine.hpp"

#include <cmath>
#include <cstring>
#include <utility>

#include "core/env.hpp"
#include "core/error.hpp"
#include "core/routing_block.hpp"

namespace dmoe {

EpEngine::EpEngine(const MoeConfig& config, Backend& backend, Comm& comm, const EpOptions& options)
    : config_(config), backend_(backend), comm_(comm), options_(options) {
  config_.validate();
  DMOE_REQUIRE(config_.world == comm_.world(),
               "EpEngine: config world = {} but the communicator has {} ranks", config_.world, comm_.world());
  rank_ = comm_.rank();
  local_experts_ = config_.experts_per_rank();
  elem_ = dtype_size(backend_.storage_dtype());
  for (Buffer* b : {&wg_, &w1_, &w3_, &w2_, &dwg_, &dw1_, &dw3_, &dw2_, &logits_, &probs_, &ids_,
                    &weights_, &lse_, &slot_, &row_token_, &row_choice_, &send_, &recv_, &batch_,
                    &pre1_, &pre3_, &h_, &out_batch_, &out_recv_, &ret_, &counts_dev_,
                    &recv_counts_dev_, &stats_dev_, &dret_, &drecv_, &dbatch_, &dx_batch_, &dx_recv_,
                    &dsend_, &dweights_, &dlogits_, &dx_router_, &send_wire_, &ret_compact_, &dret_wire_,
                    &dsend_compact_, &routing_dev_})
    b->bind(backend_);
  wire_rows_.assign(config_.world, 0);
  recv_rows_.assign(config_.world, 0);
  global_tokens_ = config_.tokens * config_.world;
  local_only_ = config_.world == 1;
  padded_ = !config_.dropless() && options.pad_to_capacity;
  DMOE_REQUIRE(options.batch_row_multiple >= 1, "EpEngine: batch_row_multiple = {} is invalid; must be >= 1",
               options.batch_row_multiple);
  row_multiple_ = options.batch_row_multiple;
  if (config_.world > 1) check_ranks_agree(options);
  if (padded_) {
    padded_offsets_.resize(config_.experts);
    for (int32_t e = 0; e < config_.experts; ++e) padded_offsets_[e] = int64_t(e) * config_.capacity();
  }
}

void EpEngine::check_ranks_agree(const EpOptions& options) {
  // Ranks that disagree on shapes, capacity or options would exchange mismatched sizes (a hang or
  // garbage on NCCL/NVSHMEM). One sum over ranks of a fingerprint: every rank sees the mismatch.
  // Doubles enter as their top 44 bits (sign, exponent, 31 mantissa bits): W copies sum without overflow.
  const auto bits = [](double v) {
    uint64_t u;
    std::memcpy(&u, &v, sizeof(u));
    return int64_t(u >> 20);
  };
  const MoeConfig& c = config_;
  const std::vector<int64_t> mine{c.tokens, c.hidden, c.ffn, c.experts, c.top_k, int64_t(c.activation),
                                  int64_t(c.renormalize), c.capacity(), bits(c.capacity_factor),
                                  int64_t(c.drop_policy), int64_t(c.dtype), bits(c.aux_loss_coef),
                                  bits(c.z_loss_coef), int64_t(options.pad_to_capacity), options.batch_row_multiple};
  const size_t bytes = mine.size() * sizeof(int64_t);
  Buffer dev(backend_);
  backend_.upload(dev.ensure(bytes), mine.data(), bytes);
  fault_point(comm_, FaultStage::allreduce);
  comm_.allreduce_sum(dev.data(), int64_t(mine.size()), DType::i64, backend_.stream());
  std::vector<int64_t> sum(mine.size());
  backend_.download(sum.data(), dev.data(), bytes);
  for (size_t i = 0; i < mine.size(); ++i)
    DMOE_REQUIRE(sum[i] == mine[i] * c.world,
                 "EpEngine: the {} ranks do not all use the same layer config and engine options (field {} of "
                 "the fingerprint differs; this rank: {}); every rank needs the same tokens per rank, shapes, "
                 "capacity, dtype, loss coefficients and options", c.world, i, c.summary());
}

void EpEngine::set_weights(const MoeWeights& w) {
  const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts, Le = local_experts_;
  DMOE_REQUIRE(w.hidden == H && w.ffn == I && w.experts == E,
               "EpEngine: weights are for H={} I={} E={}; config has H={} I={} E={}", w.hidden, w.ffn,
               w.experts, H, I, E);
  DMOE_REQUIRE(w.activation == config_.activation, "EpEngine: weights are for activation {}; config has {}",
               activation_name(w.activation), activation_name(config_.activation));
  DMOE_REQUIRE(w.first_expert == config_.first_expert(rank_) && w.num_experts == Le,
               "EpEngine: rank {} owns experts [{}, {}) but was given [{}, {})", rank_,
               config_.first_expert(rank_), config_.first_expert(rank_) + Le, w.first_expert,
               w.first_expert + w.num_experts);
  const bool swiglu = config_.activation == Activation::swiglu;
  DMOE_REQUIRE(int64_t(w.gate.size()) == E * H && int64_t(w.w1.size()) == Le * I * H &&
                   int64_t(w.w2.size()) == Le * H * I && int64_t(w.w3.size()) == (swiglu ? Le * I * H : 0),
               "EpEngine: weight arrays have the wrong sizes for the config");
  backend_.upload_f32(wg_.ensure(E * H * elem_), w.gate.data(), E * H);
  backend_.upload_f32(w1_.ensure(Le * I * H * elem_), w.w1.data(), Le * I * H);
  backend_.upload_f32(w2_.ensure(Le * H * I * elem_), w.w2.data(), Le * H * I);
  if (swiglu) backend_.upload_f32(w3_.ensure(Le * I * H * elem_), w.w3.data(), Le * I * H);
  wg_ptr_ = wg_.data();
  w1_ptr_ = w1_.data();
  w2_ptr_ = w2_.data();
  w3_ptr_ = swiglu ? w3_.data() : nullptr;
  ensure_own_grads();
  has_weights_ = true;
  zero_grads();
}

void EpEngine::ensure_own_grads() {
  const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts, Le = local_experts_;
  const bool swiglu = config_.activation == Activation::swiglu;
  const size_t acc = dtype_size(backend_.grad_accum_dtype());
  grad_.gate = dwg_.ensure(E * H * acc);
  grad_.w1 = dw1_.ensure(Le * I * H * acc);
  grad_.w2 = dw2_.ensure(Le * H * I * acc);
  grad_.w3 = swiglu ? dw3_.ensure(Le * I * H * acc) : nullptr;
  grad_.experts_in_storage_dtype = false;
  has_grads_ = true;
}

void EpEngine::set_weight_views(const WeightViews& v) {
  const bool swiglu = config_.activation == Activation::swiglu;
  DMOE_REQUIRE(v.gate && v.w1 && v.w2, "EpEngine::set_weight_views: the gate, w1 and w2 pointers must not be null");
  DMOE_REQUIRE((v.w3 != nullptr) == swiglu,
               "EpEngine::set_weight_views: w3 is {} but the activation is {}; w3 is given exactly for swiglu",
               v.w3 ? "given" : "null", activation_name(config_.activation));
  wg_ptr_ = v.gate;
  w1_ptr_ = v.w1;
  w3_ptr_ = v.w3;
  w2_ptr_ = v.w2;
  has_weights_ = true;
}

void EpEngine::set_grad_views(const GradViews& v) {
  const bool swiglu = config_.activation == Activation::swiglu;
  DMOE_REQUIRE(v.gate && v.w1 && v.w2, "EpEngine::set_grad_views: the gate, w1 and w2 pointers must not be null");
  DMOE_REQUIRE((v.w3 != nullptr) == swiglu,
               "EpEngine::set_grad_views: w3 is {} but the activation is {}; w3 is given exactly for swiglu",
               v.w3 ? "given" : "null", activation_name(config_.activation));
  DMOE_REQUIRE(!v.experts_in_storage_dtype || (backend_.on_device() && backend_.storage_dtype() == DType::bf16),
               "EpEngine::set_grad_views: expert gradients in the storage dtype need bf16 weights on a device backend "
               "(this one: {}, {})", backend_.name(), dtype_name(backend_.storage_dtype()));
  grad_ = v;
  has_grads_ = true;
  zero_grads();
}

void EpEngine::accumulate_grads() {
  DMOE_REQUIRE(!grad_.experts_in_storage_dtype,
               "EpEngine::accumulate_grads: the expert gradients are bf16 views, which a backward writes and never adds "
               "to; give f32 views (grad_accum_dtype) to accumulate");
  expert_grads_zero_ = false;
}

GradViews EpEngine::grad_views() const {
  DMOE_REQUIRE(has_grads_, "EpEngine::grad_views: no gradient accumulators (set_weights() or set_grad_views() "
               "was not called)");
  return grad_;
}

void EpEngine::reduce_gate_grad() {
  DMOE_REQUIRE(has_grads_, "EpEngine::reduce_gate_grad: no gradient accumulators (set_weights() or "
               "set_grad_views() was not called)");
  if (config_.world == 1) return;
  fault_point(comm_, FaultStage::allreduce);
  comm_.allreduce_sum(grad_.gate, config_.experts * config_.hidden, backend_.grad_accum_dtype(), backend_.stream());
}

void EpEngine::set_tokens(int64_t tokens) {
  settle_routing();  // a pending forward's error is reported, not lost with its state
  MoeConfig next = config_;
  next.tokens = tokens;
  next.validate();
  config_ = next;
  global_tokens_ = config_.tokens * config_.world;
  x_ = nullptr;
  kept_for_backward_ = false;
  fwd_phase_ = bwd_phase_ = Phase::none;
  if (config_.world > 1) check_ranks_agree(options_);
  if (padded_)
    for (int32_t e = 0; e < config_.experts; ++e) padded_offsets_[e] = int64_t(e) * config_.capacity();
}

void EpEngine::zero_grads() {
  DMOE_REQUIRE(has_grads_, "EpEngine::zero_grads: no gradient accumulators (set_weights() or set_grad_views() "
               "was not called)");
  const int64_t H = config_.hidden, E = config_.experts;
  const size_t acc = dtype_size(backend_.grad_accum_dtype());
  backend_.zero(grad_.gate, E * H * acc);
  expert_grads_zero_ = true;  // dw1/dw2/dw3: written by the next backward (see the member)
}

void EpEngine::exchange_counts(Stream lane) {
  const int32_t W = config_.world, Le = local_experts_, E = config_.experts;
  if (padded_) {  // fixed shapes: every (source, expert) segment is C rows; nothing to exchange
    const std::vector<int64_t> counts(int64_t(W) * Le, config_.capacity());
    layout_ = build_expert_batch_layout(counts.data(), W, Le, row_multiple_);
    for (int32_t p = 0; p < W; ++p) recv_rows_[p] = layout_.source_counts[p];
    return;
  }
  if (W == 1) {  // nothing to exchange: this rank's counts are the layout
    layout_ = build_expert_batch_layout(kept_.data(), 1, Le, row_multiple_);
    recv_rows_[0] = layout_.source_counts[0];
    return;
  }
  // kept_ is [E] = [W, Le]: segment d holds the counts for rank d's experts, as the all-to-all wants.
  backend_.upload_on(counts_dev_.ensure(E * sizeof(int64_t)), kept_.data(), E * sizeof(int64_t), lane);
  void* recv = recv_counts_dev_.ensure(int64_t(W) * Le * sizeof(int64_t));
  fault_point(comm_, FaultStage::alltoall);
  comm_.alltoall(counts_dev_.data(), recv, Le, DType::i64, lane);
  std::vector<int64_t> counts(int64_t(W) * Le);
  backend_.download_on(counts.data(), recv, counts.size() * sizeof(int64_t), lane);
  layout_ = build_expert_batch_layout(counts.data(), W, Le, row_multiple_);
  for (int32_t p = 0; p < W; ++p) recv_rows_[p] = layout_.source_counts[p];
}

void EpEngine::exchange_rows(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                             const std::vector<int64_t>& recv_rows, int64_t width, Stream lane) {
  std::vector<int64_t> sc(send_rows.size()), rc(recv_rows.size());
  for (size_t p = 0; p < sc.size(); ++p) {
    sc[p] = send_rows[p] * width;
    rc[p] = recv_rows[p] * width;
  }
  fault_point(comm_, FaultStage::alltoall);
  comm_.alltoallv(send, sc.data(), recv, rc.data(), backend_.storage_dtype(), lane);
}

namespace {
const char* phase_name(int p) {
  static const char* names[] = {"none", "route", "dispatch", "experts", "combine", "finish"};
  return names[p];
}
}  // namespace

void EpEngine::expect_forward(Phase at, const char* what) const {
  DMOE_REQUIRE(fwd_phase_ == at, "EpEngine::{}: the forward's phases must run in order (route, dispatch, experts, "
               "combine, finish); the last one that ran is {}", what, phase_name(int(fwd_phase_)));
}

void EpEngine::expect_backward(Phase at, const char* what) const {
  DMOE_REQUIRE(bwd_phase_ == at, "EpEngine::{}: the backward's phases must run in order (combine, dispatch, experts, "
               "return, finish); the last one that ran is {}", what, phase_name(int(bwd_phase_)));
}

void EpEngine::forward(const void* x, void* y, ForwardMode mode) {
  const Stream s = backend_.stream();
  forward_route(x, mode);
  forward_dispatch(s);
  forward_experts();
  forward_combine(s);
  forward_finish(y);
  mark(nullptr);
}

void EpEngine::forward_route(const void* x, ForwardMode mode) {
  DMOE_REQUIRE(has_weights_, "EpEngine::forward: set_weights() was not called");
  // In a CUDA-graph capture only stream work may be queued: no host wait, no event that a later host wait would
  // find recorded in the capture. A pending inference forward's reads are dropped there (nothing depends on them).
  const bool capturing = backend_.stream_capturing();
  if (capturing && routing_pending_ && !pending_train_) routing_pending_ = false;
  settle_routing();  // the last forward's pending reads: its errors are reported, not overwritten
  routing_failed_ = false;
  captured_ = false;
  const int64_t T = config_.tokens, H = config_.hidden;
  const int32_t E = config_.experts, k = config_.top_k, W = config_.world, Le = local_experts_;
  x_ = x;
  keep_ = mode == ForwardMode::train;
  // Refused before anything is queued or allocated (an allocation would invalidate the caller's capture).
  DMOE_REQUIRE_INPUT(!capturing || !keep_, "EpEngine::forward: a train forward cannot be captured in a CUDA graph "
                     "(its backward reads the routing counts on the host); capture inference forwards (no autograd) "
                     "only");
  deferred_ = defer_this_forward(T * k, capturing);
  if (capturing) {
    DMOE_REQUIRE_INPUT(deferred_, "EpEngine::forward: this forward cannot be captured in a CUDA graph: it reads the "
                       "routing counts on the host. Capturable: world = 1, dropless (capacity_factor 0), bf16 weights with "
                       "the expert products on the own Hopper GEMM (sm90; up to 16 G multiply-adds per expert, beyond "
                       "that cuBLAS needs the counts), DMOE_DEFER_ROUTING not 0; this layer: world {}, capacity_factor "
                       "{}, {} on {}", W, config_.capacity_factor, dtype_name(config_.dtype), backend_.name());
  }
  kept_for_backward_ = false;  // until this forward has stored everything
  bwd_phase_ = Phase::none;

  // 1. Router: logits, softmax, top-k, gate weights.  logits, probs: [T, E]; ids, weights: [T, k].
  mark("MoE fwd router + send plan");
  float* logits = static_cast<float*>(logits_.ensure(T * E * sizeof(float)));
  float* probs = static_cast<float*>(probs_.ensure(T * E * sizeof(float)));
  int32_t* ids = static_cast<int32_t*>(ids_.ensure(T * k * sizeof(int32_t)));
  float* weights = static_cast<float*>(weights_.ensure(T * k * sizeof(float)));
  float* lse = static_cast<float*>(lse_.ensure(T * sizeof(float)));
  backend_.router_forward(x, wg_ptr_, logits, probs, ids, weights, lse, T, H, E, k, config_.renormalize);

  // 2. Send plan: which assignments travel (capacity), in canonical order.
  SendPlanBuffers plan;
  plan.slot = static_cast<int32_t*>(slot_.ensure(T * k * sizeof(int32_t)));
  plan.row_token = static_cast<int32_t*>(row_token_.ensure(T * k * sizeof(int32_t)));
  plan.row_choice = static_cast<int32_t*>(row_choice_.ensure(T * k * sizeof(int32_t)));
  routed_.assign(E, 0);
  kept_.assign(E, 0);
  if (deferred_) {
    // Dropless at W = 1: every assignment is a row (S = T·k), only its expert's share is unknown here. A token
    // with NaN logits (reported by settle_routing) leaves rows unwritten: zeros keep their gather inside x.
    backend_.zero(plan.row_token, size_t(T * k) * sizeof(int32_t));
    backend_.plan_send_on_device(ids, T, k, E, config_.capacity(), plan, routing_dev_.as<int64_t>());
    send_rows_total_ = T * k;
    wire_rows_[0] = T * k;
  } else {
    backend_.plan_send(ids, weights, T, k, E, config_.capacity(), config_.drop_policy, plan, routed_.data(),
                       kept_.data());
    send_rows_total_ = 0;
    compact_offsets_.assign(E, 0);
    for (int32_t d = 0; d < W; ++d) {
      wire_rows_[d] = 0;
      for (int32_t e = d * Le; e < (d + 1) * Le; ++e) {
        compact_offsets_[e] = send_rows_total_;
        send_rows_total_ += kept_[e];
        wire_rows_[d] += padded_ ? config_.capacity() : kept_[e];
      }
    }
  }
  const int64_t S = send_rows_total_;

  // 3. send [S, H] = x rows in expert-major order; in padded mode the wire carries [E·C, H].
  mark("MoE fwd gather");
  fault_point(comm_, FaultStage::before_dispatch);
  backend_.gather_rows(x, plan.row_token, send_.ensure(S * H * elem_), S, H);
  if (padded_) pad_rows(send_.data(), send_wire_.ensure(E * config_.capacity() * H * elem_));
  // The router's auxiliary losses are training terms: an inference forward skips their kernels and the
  // host read they end with. The partial sums are read here, on the backend's stream, so that the exchange
  // phase only sums them.
  if (deferred_) {
    size_t block = PlanCountsBlock::bytes(E);
    if (keep_) {
      void* stats = routing_dev_.as<char>() + block;
      backend_.router_aux_partials_on_device(probs_.as<float>(), lse_.as<float>(), ids_.as<int32_t>(), T, E, k, stats);
      block += AuxPartialsBlock::bytes(E);
    }
    if (capturing) {
      captured_ = true;  // read nothing back: a replay rewrites the block, and its event would be a captured one
    } else {
      if (!readback_) readback_ = backend_.make_readback();
      readback_->start(routing_dev_.data(), block);
      routing_pending_ = true;
      pending_train_ = keep_;
    }
  } else if (keep_) {
    router_partials();
  }
  fwd_phase_ = Phase::routed;
}

bool EpEngine::defer_this_forward(int64_t rows, bool capturing) {
  if (!options_.defer_routing_reads || !local_only_ || !config_.dropless() || row_multiple_ != 1 ||
      !defer_routing_reads_allowed())
    return false;
  // The buffers the expert products will use (forward_experts asks for the same sizes: the same blocks).
  const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts;
  const bool swiglu = config_.activation == Activation::swiglu;
  void* x = send_.ensure(rows * H * elem_);
  void* pre1 = keep_ ? pre1_.ensure(rows * I * elem_) : nullptr;  // inference: the activation only
  void* pre3 = keep_ && swiglu ? pre3_.ensure(rows * I * elem_) : nullptr;
  void* h = h_.ensure(rows * I * elem_);
  void* out = out_batch_.ensure(rows * H * elem_);
  if (!backend_.expert_ffn_forward_takes_device_offsets(x, w1_ptr_, swiglu ? w3_ptr_ : nullptr, w2_ptr_, pre1, pre3,
                                                        h, out, rows, local_experts_, H, I, config_.activation))
    return false;
  // Also for an eager inference forward that reads at once: a capture after it (whose forward defers) must find
  // every buffer allocated, or its allocation would invalidate the capture.
  routing_dev_.ensure(PlanCountsBlock::bytes(int32_t(E)) + AuxPartialsBlock::bytes(int32_t(E)));
  return keep_ || capturing || options_.defer_inference_reads;
}

void EpEngine::host_routing(const char* what) {
  DMOE_REQUIRE_INPUT(!captured_, "EpEngine::{}: the last forward was captured in a CUDA graph, so its routing counts "
                     "stay on the device (each replay rewrites them); run a forward outside the capture to read them",
                     what);
  settle_routing();
}

void EpEngine::settle_routing() {
  if (!routing_pending_) return;
  routing_pending_ = false;
  const int32_t E = config_.experts, k = config_.top_k;
  const char* block = static_cast<const char*>(readback_->wait(
      pending_train_ ? "EpEngine: reading the routing counts and router statistics of the last train forward"
                     : "EpEngine: reading the routing counts of the last inference forward"));
  const int32_t bad = PlanCountsBlock::read_bad(block, E);
  if (bad != kNoBadAssignment) {
    kept_for_backward_ = false;  // its output is not valid: no backward, no losses
    routing_failed_ = true;
    int32_t id = 0;
    backend_.download(&id, ids_.as<int32_t>() + bad, sizeof(id));
    DMOE_REQUIRE_INPUT(false, "routing: token {} choice {} of the last {} forward has expert id {}; allowed [0, {}) "
                       "(id -1: the token's router logits are NaN: check the input for non-finite values); that "
                       "forward's output is not valid", bad / k, bad % k, pending_train_ ? "train" : "inference", id,
                       E);
  }
  const auto* counts = reinterpret_cast<const int64_t*>(block);
  routed_.assign(counts, counts + E);
  kept_.assign(counts + E, counts + 2 * E);
  compact_offsets_.assign(counts + 2 * E, counts + 3 * E);
  layout_ = build_expert_batch_layout(kept_.data(), 1, local_experts_, row_multiple_);
  recv_rows_[0] = layout_.source_counts[0];
  if (!pending_train_) return;  // an inference forward computes no router statistics
  stats_.assign(2 * size_t(E) + 1, 0.0);
  AuxPartialsBlock::decode(block + PlanCountsBlock::bytes(E), E, stats_.data(), stats_.data() + E,
                           stats_.data() + 2 * E);
  compute_losses(backend_.stream());  // W = 1: no collective
}

void EpEngine::forward_dispatch(Stream lane) {
  expect_forward(Phase::routed, "forward_dispatch");
  const int64_t H = config_.hidden;
  // 4. Counts, then rows, to the experts' owners.  recv: [R, H] source-major (R = rows received);
  // batch: [N, H] expert-major (N = R plus any tile padding of the experts' batches).
  // NOTE: with one rank and no tile padding the send buffer already is the expert batch (expert-major,
  // token order), so the all-to-alls and permutes would be copies onto the same layout: skipped.
  mark("MoE fwd dispatch (all-to-all)");
  if (!deferred_) {  // deferred: W = 1, settle_routing builds the layout and the losses later
    exchange_counts(lane);
    if (keep_) compute_losses(lane);
  }
  const void* wire = padded_ ? send_wire_.data() : send_.data();
  if (!local_only_) {
    const int64_t R = layout_.source_offsets.back();
    exchange_rows(wire, wire_rows_, recv_.ensure(R * H * elem_), recv_rows_, H, lane);
  }
  fwd_phase_ = Phase::dispatched;
}

void EpEngine::forward_experts() {
  expect_forward(Phase::dispatched, "forward_experts");
  const int64_t H = config_.hidden, I = config_.ffn;
  const int32_t W = config_.world, Le = local_experts_;
  const bool swiglu = config_.activation == Activation::swiglu;
  // Deferred: the layout is not known on the host yet; S = T·k rows, one rank, no tile padding.
  const int64_t N = deferred_ ? send_rows_total_ : layout_.rows();
  const int64_t R = deferred_ ? N : layout_.source_offsets.back();
  const int64_t segments = int64_t(W) * Le;
  const bool aliased = local_only_ && (deferred_ || !layout_.padded());
  void* wire = padded_ ? send_wire_.data() : send_.data();
  batch_rows_ = wire;
  if (!aliased) {
    const void* recv = local_only_ ? wire : recv_.data();
    void* batch = batch_.ensure(N * H * elem_);
    if (layout_.padded()) backend_.zero(batch, size_t(N * H) * elem_);  // padding rows stay zero
    backend_.permute_segments(recv, batch, layout_.recv_offsets.data(), layout_.batch_offsets.data(),
                              layout_.counts.data(), segments, H);
    batch_rows_ = batch;
  }

  // 5. Grouped expert FFN, then back to source-major order.
  mark("MoE fwd experts");
  fault_point(comm_, FaultStage::expert_gemm);
  if (deferred_)  // the offsets from the plan's block on the device (PlanCountsBlock::offsets: W = 1, Le = E)
    backend_.expert_ffn_forward_device_offsets(
        batch_rows_, w1_ptr_, swiglu ? w3_ptr_ : nullptr, w2_ptr_, keep_ ? pre1_.ensure(N * I * elem_) : nullptr,
        keep_ && swiglu ? pre3_.ensure(N * I * elem_) : nullptr, h_.ensure(N * I * elem_), out_batch_.ensure(N * H * elem_),
        PlanCountsBlock::offsets(routing_dev_.data(), config_.experts), N, Le, H, I, config_.activation);
  else
    backend_.expert_ffn_forward(batch_rows_, w1_ptr_, swiglu ? w3_ptr_ : nullptr, w2_ptr_,
                                keep_ ? pre1_.ensure(N * I * elem_) : nullptr,
                                keep_ && swiglu ? pre3_.ensure(N * I * elem_) : nullptr,
                                h_.ensure(N * I * elem_), out_batch_.ensure(N * H * elem_),
                                layout_.expert_offsets.data(), Le, H, I, config_.activation);
  mark("MoE fwd combine (permute, all-to-all, combine)");
  returned_rows_ = out_batch_.data();
  if (!aliased) {
    // With one rank the source-major order is the wire order: permute straight into ret_.
    const int64_t wire_total = rows_sent();
    void* out_recv = local_only_ ? ret_.ensure(wire_total * H * elem_) : out_recv_.ensure(R * H * elem_);
    backend_.permute_segments(out_batch_.data(), out_recv, layout_.batch_offsets.data(),
                              layout_.recv_offsets.data(), layout_.counts.data(), segments, H);
    returned_rows_ = ret_.data();
  }
  fwd_phase_ = Phase::experts;
}

void EpEngine::forward_combine(Stream lane) {
  expect_forward(Phase::experts, "forward_combine");
  // 6. Results back to the tokens' ranks (same segments, reversed).
  const int64_t H = config_.hidden;
  if (!local_only_) {
    exchange_rows(out_recv_.data(), recv_rows_, ret_.ensure(rows_sent() * H * elem_), wire_rows_, H, lane);
    returned_rows_ = ret_.data();  // ensure() may have moved it
  }
  fwd_phase_ = Phase::combined;
}

void EpEngine::forward_finish(void* y) {
  expect_forward(Phase::combined, "forward_finish");
  const int64_t T = config_.tokens, H = config_.hidden, S = send_rows_total_;
  if (padded_) {
    unpad_rows(returned_rows_, ret_compact_.ensure(S * H * elem_));
    returned_rows_ = ret_compact_.data();
  }
  // The weighted combine.
  fault_point(comm_, FaultStage::combine);
  backend_.combine(returned_rows_, slot_.as<int32_t>(), weights_.as<float>(), y, T, config_.top_k, H);
  fwd_phase_ = Phase::done;
  kept_for_backward_ = keep_;
}

RouterLosses EpEngine::losses() {
  settle_routing();
  DMOE_REQUIRE_INPUT(!routing_failed_, "EpEngine::losses: the last train forward's routing was invalid (an expert id "
                     "outside [0, E), reported when its counts were read); run a forward on valid input first");
  DMOE_REQUIRE(kept_for_backward_, "EpEngine::losses: the last forward ran in ForwardMode::inference, which does "
               "not compute the router's auxiliary losses; run forward(x, y, ForwardMode::train) (the default)");
  return losses_;
}

void EpEngine::router_partials() {
  mark("MoE fwd router statistics (aux loss)");
  const int32_t E = config_.experts;
  // Partial sums [prob_sum (E), assigned (E), z_sum (1)], summed over ranks in f64 (compute_losses).
  stats_.assign(2 * E + 1, 0.0);
  backend_.router_aux_partials(probs_.as<float>(), lse_.as<float>(), ids_.as<int32_t>(), config_.tokens, E,
                               config_.top_k, stats_.data(), stats_.data() + E, stats_.data() + 2 * E);
}

void EpEngine::compute_losses(Stream lane) {
  const int32_t E = config_.experts;
  std::vector<double>& stats = stats_;
  if (config_.world > 1) {
    void* dev = stats_dev_.ensure(stats.size() * sizeof(double));
    backend_.upload_on(dev, stats.data(), stats.size() * sizeof(double), lane);
    fault_point(comm_, FaultStage::allreduce);
    comm_.allreduce_sum(dev, int64_t(stats.size()), DType::f64, lane);
    backend_.download_on(stats.data(), dev, stats.size() * sizeof(double), lane);
  }
  expert_fraction_.assign(E, 0.0);
  prob_mean_.assign(E, 0.0);
  losses_ = router_losses_from_stats(stats.data(), E, config_.top_k, double(global_tokens_), expert_fraction_.data(),
                                     prob_mean_.data());
}

RouterLosses router_losses_from_stats(const double* stats, int32_t experts, int32_t top_k, double tokens,
                                      double* expert_fraction, double* prob_mean) {
  const int32_t E = experts;
  const double n = tokens;
  RouterLosses l;
  for (int32_t e = 0; e < E; ++e) {
    const double f = stats[E + e] / (n * top_k);
    if (expert_fraction) expert_fraction[e] = f;
    if (prob_mean) prob_mean[e] = stats[e] / n;
    l.load_balance += f * (stats[e] / n);
  }
  l.load_balance *= E;
  l.z_loss = stats[2 * E] / n;
  return l;
}

void EpEngine::backward(const void* dy, void* dx) {
  const Stream s = backend_.stream();
  backward_combine(dy);
  backward_dispatch(s);
  backward_experts();
  backward_return(s);
  backward_finish(dx);
  mark(nullptr);
}

void EpEngine::backward_combine(const void* dy) {
  settle_routing();  // the layout, the counts and the load-balance term of a deferred forward
  DMOE_REQUIRE_INPUT(!routing_failed_, "EpEngine::backward: the last train forward's routing was invalid (an expert "
                     "id outside [0, E), reported when its counts were read); run a forward on valid input first");
  DMOE_REQUIRE(x_ != nullptr, "EpEngine::backward: forward() must run first");
  DMOE_REQUIRE(has_grads_, "EpEngine::backward: there are no gradient accumulators; set_weight_views() borrows "
               "none: call set_grad_views() first (set_weights() makes the engine's own)");
  DMOE_REQUIRE(kept_for_backward_,
               "EpEngine::backward: the last forward ran in ForwardMode::inference and kept nothing for the "
               "backward pass; run forward(x, y, ForwardMode::train) (the default) first");
  const int64_t T = config_.tokens, H = config_.hidden;
  const int32_t E = config_.experts, k = config_.top_k;
  const int64_t S = send_rows_total_;
  fault_point(comm_, FaultStage::backward);

  // 1. Combine backward: gradient of each returned row and of each gate weight.
  mark("MoE bwd combine + row gradients to the experts");
  float* dweights = static_cast<float*>(dweights_.ensure(T * k * sizeof(float)));
  backend_.combine_backward(dy, returned_rows_, slot_.as<int32_t>(), weights_.as<float>(),
                            dret_.ensure(S * H * elem_), dweights, T, k, H);
  if (padded_) pad_rows(dret_.data(), dret_wire_.ensure(E * config_.capacity() * H * elem_));
  bwd_phase_ = Phase::routed;
}

void EpEngine::backward_dispatch(Stream lane) {
  expect_backward(Phase::routed, "backward_dispatch");
  // 2. Row gradients to the experts (the dispatch pattern again).
  const int64_t H = config_.hidden;
  const void* dwire = padded_ ? dret_wire_.data() : dret_.data();
  if (!local_only_) {
    const int64_t R = layout_.source_offsets.back();
    exchange_rows(dwire, wire_rows_, drecv_.ensure(R * H * elem_), recv_rows_, H, lane);
  }
  bwd_phase_ = Phase::dispatched;
}

void EpEngine::backward_experts() {
  expect_backward(Phase::dispatched, "backward_experts");
  const int64_t H = config_.hidden, I = config_.ffn;
  const int32_t W = config_.world, Le = local_experts_;
  const bool swiglu = config_.activation == Activation::swiglu;
  const int64_t N = layout_.rows(), segments = int64_t(W) * Le;
  const int64_t R = layout_.source_offsets.back();
  const bool aliased = local_only_ && !layout_.padded();
  void* dwire = padded_ ? dret_wire_.data() : dret_.data();
  void* dbatch = dwire;
  if (!aliased) {
    const void* drecv = local_only_ ? dwire : drecv_.data();
    dbatch = dbatch_.ensure(N * H * elem_);
    if (layout_.padded()) backend_.zero(dbatch, size_t(N * H) * elem_);  // no gradient on padding rows
    backend_.permute_segments(drecv, dbatch, layout_.recv_offsets.data(), layout_.batch_offsets.data(),
                              layout_.counts.data(), segments, H);
  }

  // 3. Expert FFN backward: input gradients and accumulated weight gradients.
  mark("MoE bwd experts");
  fault_point(comm_, FaultStage::expert_gemm);
  DMOE_REQUIRE(!grad_.experts_in_storage_dtype || expert_grads_zero_,
               "EpEngine::backward: the expert gradients are bf16 views, written by one backward and never added to; "
               "call set_grad_views() again before another backward");
  backend_.expert_ffn_backward(batch_rows_, w1_ptr_, swiglu ? w3_ptr_ : nullptr, w2_ptr_,
                               pre1_.data(), swiglu ? pre3_.data() : nullptr, h_.data(), dbatch,
                               dx_batch_.ensure(N * H * elem_), grad_.w1, swiglu ? grad_.w3 : nullptr,
                               grad_.w2, layout_.expert_offsets.data(), Le, H, I, config_.activation,
                               /*accumulate=*/!expert_grads_zero_,
                               grad_.experts_in_storage_dtype ? backend_.storage_dtype() : backend_.grad_accum_dtype());
  expert_grads_zero_ = false;

  // 4. Input gradients back to source-major order (the exchange is backward_return).
  mark("MoE bwd dispatch back + router");
  if (!aliased) {
    void* dx_recv = local_only_ ? dsend_.ensure(rows_sent() * H * elem_) : dx_recv_.ensure(R * H * elem_);
    backend_.permute_segments(dx_batch_.data(), dx_recv, layout_.batch_offsets.data(),
                              layout_.recv_offsets.data(), layout_.counts.data(), segments, H);
  }
  bwd_phase_ = Phase::experts;
}

void EpEngine::backward_return(Stream lane) {
  expect_backward(Phase::experts, "backward_return");
  const int64_t H = config_.hidden;
  if (!local_only_) exchange_rows(dx_recv_.data(), recv_rows_, dsend_.ensure(rows_sent() * H * elem_), wire_rows_, H, lane);
  bwd_phase_ = Phase::combined;
}

void EpEngine::backward_finish(void* dx) {
  expect_backward(Phase::combined, "backward_finish");
  const int64_t T = config_.tokens, H = config_.hidden, S = send_rows_total_;
  const int32_t E = config_.experts, k = config_.top_k;
  const bool aliased = local_only_ && !layout_.padded();
  void* dsend = aliased ? dx_batch_.data() : dsend_.data();
  if (padded_) {
    unpad_rows(dsend, dsend_compact_.ensure(S * H * elem_));
    dsend = dsend_compact_.data();
  }

  // 5. Router backward (gate weights, auxiliary losses) and the sum of all contributions to dx.
  const double n = double(global_tokens_);
  const bool lb = config_.aux_loss_coef > 0, z = config_.z_loss_coef > 0;
  float* dlogits = static_cast<float*>(dlogits_.ensure(T * E * sizeof(float)));
  float* dx_router = static_cast<float*>(dx_router_.ensure(T * H * sizeof(float)));
  cpu::RouterAuxGrad aux;
  aux.expert_fraction = lb ? expert_fraction_.data() : nullptr;
  aux.lb_scale = config_.aux_loss_coef * E / n;
  if (!lb_grad_override_.empty()) {
    aux.expert_fraction = lb_grad_override_.data();
    aux.lb_scale = 1.0;
  }
  aux.lse = z ? lse_.as<float>() : nullptr;
  aux.z_scale = 2.0 * config_.z_loss_coef / n;
  backend_.router_backward(x_, wg_ptr_, probs_.as<float>(), ids_.as<int32_t>(), weights_.as<float>(),
                           dweights_.as<float>(), aux, dlogits, dx_router, grad_.gate, T, H, E, k, config_.renormalize);
  backend_.scatter_back(dsend, slot_.as<int32_t>(), dx_router, dx, T, k, H);
  bwd_phase_ = Phase::done;
}

void EpEngine::set_load_balance_grad(std::vector<double> dloss_dprob) {
  DMOE_REQUIRE(dloss_dprob.empty() || int64_t(dloss_dprob.size()) == config_.experts,
               "EpEngine::set_load_balance_grad: {} values given; expected one per expert ({}) or none",
               dloss_dprob.size(), config_.experts);
  lb_grad_override_ = std::move(dloss_dprob);
}

int64_t EpEngine::rows_sent() const {
  int64_t total = 0;
  for (int64_t r : wire_rows_) total += r;
  return total;
}

void EpEngine::pad_rows(const void* compact, void* padded) {
  const int64_t C = config_.capacity(), E = config_.experts, H = config_.hidden;
  backend_.zero(padded, size_t(E * C * H) * elem_);
  backend_.permute_segments(compact, padded, compact_offsets_.data(), padded_offsets_.data(), kept_.data(), E, H);
}

void EpEngine::unpad_rows(const void* padded, void* compact) {
  backend_.permute_segments(padded, compact, padded_offsets_.data(), compact_offsets_.data(), kept_.data(),
                            config_.experts, config_.hidden);
}

namespace {

std::vector<float> download_accum(Backend& backend, const void* src, int64_t count) {
  std::vector<float> out(count);
  if (backend.grad_accum_dtype() == DType::f64) {
    std::vector<double> tmp(count);
    backend.download(tmp.data(), src, count * sizeof(double));
    for (int64_t i = 0; i < count; ++i) out[i] = float(tmp[i]);
  } else {
    backend.download(out.data(), src, count * sizeof(float));
  }
  return out;
}

}  // namespace

MoeWeights EpEngine::grads() {
  DMOE_REQUIRE(has_grads_, "EpEngine::grads: no gradient accumulators (set_weights() or set_grad_views() was not "
               "called)");
  DMOE_REQUIRE(!grad_.experts_in_storage_dtype,
               "EpEngine::grads: the expert gradients are the caller's bf16 views; read them there");
  const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts, Le = local_experts_;
  MoeWeights g = make_moe_weights(config_, config_.first_expert(rank_), Le);
  // The gate is replicated: its gradient is the sum over ranks (reduced on a copy, so grads() can be
  // called again without double counting). Collective: every rank must call grads().
  const DType acc = backend_.grad_accum_dtype();
  Buffer reduced(backend_);
  void* dwg = reduced.ensure(E * H * dtype_size(acc));
  backend_.copy(dwg, grad_.gate, E * H * dtype_size(acc));
  if (config_.world > 1) {
    fault_point(comm_, FaultStage::allreduce);
    comm_.allreduce_sum(dwg, E * H, acc, backend_.stream());
  }
  g.gate = download_accum(backend_, dwg, E * H);
  if (expert_grads_zero_) {  // no backward since zero_grads(): the buffers were never written
    g.w1.assign(size_t(Le * I * H), 0.f);
    g.w2.assign(size_t(Le * H * I), 0.f);
    if (config_.activation == Activation::swiglu) g.w3.assign(size_t(Le * I * H), 0.f);
    return g;
  }
  g.w1 = download_accum(backend_, grad_.w1, Le * I * H);
  g.w2 = download_accum(backend_, grad_.w2, Le * H * I);
  if (config_.activation == Activation::swiglu) g.w3 = download_accum(backend_, grad_.w3, Le * I * H);
  return g;
}

RoutingViews EpEngine::routing_views() const {
  DMOE_REQUIRE(x_ != nullptr, "EpEngine::routing_views: forward() has not run");
  return RoutingViews{logits_.as<float>(), probs_.as<float>(), ids_.as<int32_t>(), weights_.as<float>()};
}

std::vector<int32_t> EpEngine::expert_ids() {
  DMOE_REQUIRE(x_ != nullptr, "EpEngine::expert_ids: forward() has not run");
  std::vector<int32_t> out(config_.tokens * config_.top_k);
  backend_.download(out.data(), ids_.data(), out.size() * sizeof(int32_t));
  return out;
}

std::vector<float> EpEngine::expert_weights() {
  DMOE_REQUIRE(x_ != nullptr, "EpEngine::expert_weights: forward() has not run");
  std::vector<float> out(config_.tokens * config_.top_k);
  backend_.download(out.data(), weights_.data(), out.size() * sizeof(float));
  return out;
}

}  // namespace dmoe
