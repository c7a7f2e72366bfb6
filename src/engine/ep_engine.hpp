// ep_engine.hpp — EpEngine: host-orchestrated vanilla expert parallelism over any Backend and Comm.
//
// One rank's view. Forward:
//   router (logits, softmax, top-k) → send plan (capacity, canonical order) → gather rows into the
//   expert-major send buffer → all-to-all of row counts → all-to-all of rows (exact sizes, no padding)
//   → source-major receive buffer → expert-major batch → grouped expert FFN → back to source-major →
//   all-to-all back → combine y[t] = Σ_j w[t,j]·out[t,j].
// Backward mirrors it and adds the router (and auxiliary-loss) gradients; the router's weight gradient
// is summed over ranks (the gate is replicated), the experts' gradients stay with their owners.
//
// The same code runs on the CPU backend with ThreadComm (the reference engine) and on CUDA with NCCL or
// NVSHMEM, so there is one implementation of the algorithm.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm.hpp"
#include "core/config.hpp"
#include "core/dispatch_plan.hpp"
#include "engine/backend.hpp"
#include "engine/buffer.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

// How the engine moves rows (the layer's results do not depend on it).
struct EpOptions {
  // Capacity mode only: send every (rank, expert) segment padded to the capacity C with zero rows, as
  // Megatron/Tutel-style systems do (fixed shapes: no count exchange, the experts also compute on the
  // padding). Off: exact row counts on the wire, as in dropless mode.
  bool pad_to_capacity = true;
  // Pad each local expert's batch with zero rows to a multiple of this (1 = no padding): local padding
  // to the GEMM tile height, so every expert product splits into whole tiles.
  int32_t batch_row_multiple = 1;
  // A train forward at W = 1, dropless, whose expert products can take their offsets in backend memory
  // (Backend::expert_ffn_forward_takes_device_offsets: the CPU always, CUDA bf16 on the own Hopper GEMM) leaves
  // its counts and router statistics on the device and reads them when they are first needed — the backward,
  // losses() and the accessors below, the next forward — instead of waiting for the GPU inside the forward. A
  // forward then never waits for the GPU, so a caller's work queued behind it (a PyTorch model's next layers) is
  // not held back (docs/architecture.md, "Deferred routing reads"). Inference forwards defer only inside a
  // CUDA-graph capture, which needs it (or always, defer_inference_reads). Off: every forward reads them at once,
  // and none can be captured.
  bool defer_routing_reads = true;
  // Inference forwards defer outside a capture too. Off by default: on the H200 the deferred forward's GPU time was
  // 2-4 % longer than the forward that reads its counts (its products run without the host's counts: device-built
  // tile tables, a grid for the worst case; docs/perf.md, fifteenth session), and an inference forward has no
  // backward whose wait the deferral would remove.
  bool defer_inference_reads = false;
};

// What a forward keeps. train: everything backward() needs (the experts' pre-activations, the routing) and
// the router's auxiliary losses. inference: the experts' pre-activations are not stored — the GPU's fused
// up-projection then writes only the activation, a third of the bytes for SwiGLU — the auxiliary losses are
// not computed, and backward() and losses() refuse to run until a train forward.
enum class ForwardMode { train, inference };

// Weights owned by the caller (EpEngine::set_weight_views): backend memory in the storage dtype, row-major,
// the layouts of MoeWeights — gate [E, H], w1 and w3 [Le, I, H] (w3 null unless SwiGLU), w2 [Le, H, I] for this
// rank's Le experts. The engine reads them in every forward and backward and never writes or frees them.
struct WeightViews {
  const void* gate = nullptr;
  const void* w1 = nullptr;
  const void* w3 = nullptr;
  const void* w2 = nullptr;
};

// Gradient accumulators owned by the caller (EpEngine::set_grad_views): backend memory of
// Backend::grad_accum_dtype() (f32 on CUDA, f64 on the CPU), the weights' shapes. The engine writes and adds
// to them as it does to its own accumulators (zero_grads, backward) and never frees them.
struct GradViews {
  void* gate = nullptr;
  void* w1 = nullptr;
  void* w3 = nullptr;
  void* w2 = nullptr;
  // w1/w3/w2 in the weights' storage dtype (bf16 on the CUDA backend) instead of grad_accum_dtype(): written
  // by the one backward after set_grad_views() or zero_grads(), never added to (LayerSession, for bf16 PyTorch
  // parameters, and CudaMixtralModel's bf16 expert gradients: half the bytes of f32 gradients and no cast after).
  // The gate's stays grad_accum_dtype().
  bool experts_in_storage_dtype = false;
};

// The routing of the last forward in backend memory (EpEngine::routing_views): logits and probs [T, E] f32,
// ids [T, k] i32, weights [T, k] f32 (the gate weights the combine used; a dropped assignment keeps its weight).
struct RoutingViews {
  const float* logits = nullptr;
  const float* probs = nullptr;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
};

// Told where the engine's stages begin (mark(name)) and where the last one ends (mark(nullptr)), in the order
// the engine issues them; a profiler (the GPU model's stage times) records events there. Names are literals.
class StageObserver {
 public:
  virtual ~StageObserver() = default;
  virtual void mark(const char* stage) = 0;
};

struct RouterLosses {
  double load_balance = 0;  // E · Σ_e f_e · P_e over all ranks' tokens
  double z_loss = 0;        // mean over all tokens of logsumexp(logits)²
};

// The losses from the partial sums of router_aux_partials summed over all ranks (stats: prob_sum [E], assigned
// [E], z_sum [1]) of `tokens` tokens; also f_e and P_e ([E] each) where the pointers are given.
RouterLosses router_losses_from_stats(const double* stats, int32_t experts, int32_t top_k, double tokens,
                                      double* expert_fraction = nullptr, double* prob_mean = nullptr);

class EpEngine {
 public:
  // config.world must equal comm.world(); config.tokens is this rank's token count.
  EpEngine(const MoeConfig& config, Backend& backend, Comm& comm, const EpOptions& options = {});

  // Gate [E, H] and this rank's experts (weights.first_expert == config.first_expert(rank)), copied into
  // the engine's memory (converted to the storage dtype). Gradients go back to the engine's own accumulators.
  void set_weights(const MoeWeights& weights);
  // The same weights borrowed instead of copied (see WeightViews): no copy, the caller keeps them alive and
  // unchanged while a forward or backward that reads them runs. Does not touch the gradients and allocates
  // no accumulators: before a backward, set_grad_views() (or set_weights()) must have given some.
  void set_weight_views(const WeightViews& views);
  // Gradients into the caller's memory from now on (see GradViews); set_weights() returns to the engine's
  // own. The accumulators' state is as after zero_grads() (call it before a backward to use them).
  void set_grad_views(const GradViews& views);
  // Where the gradients accumulate now (the engine's own accumulators or the caller's), grad_accum_dtype().
  // Device pointers: read them on the backend's stream. The gate's is this rank's share (see reduce_gate_grad);
  // the experts' hold nothing until a backward has run after zero_grads() (expert_grads_written()).
  GradViews grad_views() const;
  // The next backward adds the experts' gradients to the accumulators as they hold them (instead of writing
  // them, as the first backward after zero_grads() does): for a caller whose accumulators were zeroed or
  // written by another engine — a model's micro-batches, each with its own engine, sharing one gradient.
  void accumulate_grads();
  bool expert_grads_written() const { return !expert_grads_zero_; }
  // Sums the gate's gradient over the ranks in place (collective; nothing to do with one rank). grads() does
  // the same on a copy; after this, grads() would count the other ranks twice.
  void reduce_gate_grad();
  // Changes this rank's token count (config.tokens, and the capacity with it) for the following forwards;
  // with W > 1 collective (the ranks check again that they agree). Forgets the last forward: backward() needs
  // a forward after it.
  void set_tokens(int64_t tokens);

  // x, y: [T, H] in backend memory (storage dtype). train: keeps what backward needs. The outputs are
  // the same in both modes.
  void forward(const void* x, void* y, ForwardMode mode = ForwardMode::train);
  // dy, dx: [T, H] in backend memory. Accumulates parameter gradients (see zero_grads / grads()).
  void backward(const void* dy, void* dx);

  // The same two passes cut at their all-to-alls, for a caller that issues the phases on different streams
  // (Flow's GPU executor, src/flow/cuda_executor.hpp). forward(x, y, mode) is exactly
  //   forward_route(x, mode); forward_dispatch(s); forward_experts(); forward_combine(s); forward_finish(y);
  // and backward(dy, dx) is
  //   backward_combine(dy); backward_dispatch(s); backward_experts(); backward_return(s); backward_finish(dx);
  // with s = backend().stream(). Compute phases (route, experts, finish; backward's combine, experts, finish)
  // issue kernels on the backend's stream; exchange phases (dispatch, combine, backward's dispatch and return)
  // issue only collectives on the engine's communicator and their small host transfers, on `lane`. The caller
  // orders the streams (events): each phase reads what the previous one wrote. Phases must come in this order
  // (checked). Host waits (the only ones): forward_route waits for the backend's stream twice (the send plan's
  // counts; in train mode the router statistics), except for a forward with deferred routing reads (EpOptions),
  // which waits nowhere — its reads wait for the point of the stream behind its router (not for the stream) when
  // the backward, losses() or an accessor of the counts first needs them; forward_dispatch waits for `lane` when it reads the peers'
  // row counts (W > 1 without padding) and the summed router statistics (W > 1, train). The other phases never
  // wait. Collectives, in this order on every rank: dispatch: counts (W > 1, unpadded), router statistics
  // (W > 1, train), rows; combine: rows; backward dispatch: rows; backward return: rows (none at W = 1).
  void forward_route(const void* x, ForwardMode mode = ForwardMode::train);
  void forward_dispatch(Stream lane);
  void forward_experts();
  void forward_combine(Stream lane);
  void forward_finish(void* y);
  void backward_combine(const void* dy);
  void backward_dispatch(Stream lane);
  void backward_experts();
  void backward_return(Stream lane);
  void backward_finish(void* dx);

  // Gradients start over: the next backward's gradients are the only ones (the experts' are then written
  // rather than added to zeros, see expert_grads_zero_); set_weights() does this too.
  void zero_grads();
  // Gradients on the host: gate (summed over ranks) and this rank's experts, same shapes as the weights.
  MoeWeights grads();

  // Results of the last forward, copied to the host.
  std::vector<int32_t> expert_ids();      // [T, k]
  std::vector<float> expert_weights();    // [T, k]
  // The same (and the logits and probabilities) without a copy, valid until the next forward.
  RoutingViews routing_views() const;
  // The router's auxiliary losses of the last train forward (an inference forward does not compute them).
  // This and the accessors of the routing's counts below read a deferred forward's counts first (settle_routing).
  RouterLosses losses();
  // Over all ranks' tokens, of the last train forward: f_e = assigned_e / (N·k) and P_e = mean_t probs[t, e]
  // ([E] each), the two factors of the load-balance loss.
  const std::vector<double>& expert_fraction() { return host_routing("expert_fraction"), expert_fraction_; }
  const std::vector<double>& prob_mean() { return host_routing("prob_mean"), prob_mean_; }
  // Replaces the config's load-balance term in the following backward passes: ∂L/∂probs[t, e] =
  // dloss_dprob[e] for every token, whatever aux_loss_coef says. For losses that pool the routing statistics
  // of several layers, as transformers' Mixtral load_balancing_loss_func does (src/model/mixtral.cpp).
  // An empty vector returns to the config's term.
  void set_load_balance_grad(std::vector<double> dloss_dprob);
  const std::vector<int64_t>& routed_counts() { return host_routing("routed_counts"), routed_; }  // [E], pre-capacity
  const std::vector<int64_t>& kept_counts() { return host_routing("kept_counts"), kept_; }         // [E] this rank
  int64_t rows_received() { return host_routing("rows_received"), layout_.rows(); }  // batch rows (padding included)
  int64_t rows_sent() const;                                           // rows on the wire, all peers
  int64_t rows_sent_to(int32_t rank) const { return wire_rows_[rank]; }
  bool padded() const { return padded_; }
  const ExpertBatchLayout& layout() { return host_routing("layout"), layout_; }
  // A deferred forward's counts (and a train forward's router statistics) read and checked now (a token with NaN
  // router logits is reported here: its forward's output is not valid); no-op when none is pending. Waits only for
  // the point of the stream behind that forward's router.
  void settle_routing();
  // Whether the last forward was captured in a CUDA graph: its counts stay on the device (every replay writes
  // them), so the accessors of the counts refuse until a forward runs outside a capture.
  bool captured() const { return captured_; }
  bool routing_pending() const { return routing_pending_; }

  const MoeConfig& config() const { return config_; }
  Backend& backend() { return backend_; }
  // Stage marks for a profiler from now on (null: none). The observer outlives the engine's calls.
  void set_stage_observer(StageObserver* observer) { observer_ = observer; }

 private:
  void check_ranks_agree(const EpOptions& options);
  void exchange_counts(Stream lane);
  void exchange_rows(const void* send, const std::vector<int64_t>& send_rows, void* recv,
                     const std::vector<int64_t>& recv_rows, int64_t width, Stream lane);
  // The router statistics: partial sums on this rank (forward_route), summed over ranks (forward_dispatch).
  void router_partials();
  void compute_losses(Stream lane);
  // Where the phases are (forward_* and backward_* must come in order; `what` names the caller).
  enum class Phase : uint8_t { none, routed, dispatched, experts, combined, done };
  void expect_forward(Phase at, const char* what) const;
  void expect_backward(Phase at, const char* what) const;
  Phase fwd_phase_ = Phase::none, bwd_phase_ = Phase::none;
  // Compact expert-major rows [S, H] <-> the padded wire layout [E·C, H] (zero rows fill each expert's
  // segment up to C). Only in padded mode.
  void pad_rows(const void* compact, void* padded);
  void unpad_rows(const void* padded, void* compact);

  void mark(const char* stage) {
    if (observer_) observer_->mark(stage);
  }

  MoeConfig config_;
  StageObserver* observer_ = nullptr;
  Backend& backend_;
  Comm& comm_;
  int32_t rank_ = 0;
  int32_t local_experts_ = 0;
  size_t elem_ = 4;  // bytes per stored activation element

  // Weights (backend memory): the engine's copies (set_weights) or the caller's (set_weight_views);
  // wg_ptr_ .. w2_ptr_ point at the ones in use.
  Buffer wg_, w1_, w3_, w2_;
  const void* wg_ptr_ = nullptr;
  const void* w1_ptr_ = nullptr;
  const void* w3_ptr_ = nullptr;
  const void* w2_ptr_ = nullptr;
  bool has_weights_ = false;
  EpOptions options_;
  // zero_grads() leaves the experts' gradient buffers alone and sets this: the next backward writes them
  // (accumulate = false) instead of adding to zeros, which saves the memset and, in the weight-gradient
  // GEMMs, reading every f32 gradient back (the dominant traffic of those products, docs/perf.md).
  bool expert_grads_zero_ = false;
  // Gradient accumulators (grad_accum_dtype): the engine's own, or the caller's (set_grad_views); grad_
  // points at the ones in use.
  Buffer dwg_, dw1_, dw3_, dw2_;
  GradViews grad_;
  bool has_grads_ = false;
  void ensure_own_grads();

  // Forward state.
  const void* x_ = nullptr;
  bool kept_for_backward_ = false;  // the last forward ran in ForwardMode::train
  bool keep_ = false;               // the forward under way runs in ForwardMode::train
  std::vector<double> stats_;       // [2E + 1] router statistics of the forward under way (router_partials)
  Buffer logits_, probs_, ids_, weights_, lse_;
  Buffer slot_, row_token_, row_choice_;
  Buffer send_, recv_, batch_, pre1_, pre3_, h_, out_batch_, out_recv_, ret_;
  Buffer counts_dev_, recv_counts_dev_, stats_dev_;
  std::vector<int64_t> routed_, kept_;
  std::vector<int64_t> wire_rows_, recv_rows_;  // [W] rows on the wire to / from each peer
  int64_t send_rows_total_ = 0;                   // S: kept rows of this rank (compact send buffer)
  bool padded_ = false;                           // capacity mode with EpOptions::pad_to_capacity
  int32_t row_multiple_ = 1;                      // EpOptions::batch_row_multiple
  std::vector<int64_t> compact_offsets_, padded_offsets_;  // [E] for pad_rows / unpad_rows
  ExpertBatchLayout layout_;
  std::vector<double> expert_fraction_;  // [E] f_e over all ranks
  std::vector<double> prob_mean_;        // [E] P_e over all ranks
  std::vector<double> lb_grad_override_; // [E] set_load_balance_grad; empty: the config's term
  RouterLosses losses_;
  int64_t global_tokens_ = 0;
  bool local_only_ = false;         // one rank: the send buffer is the expert batch (no exchange)
  void* batch_rows_ = nullptr;      // [N, H] the experts' input rows of the last forward
  void* returned_rows_ = nullptr;   // [S, H] expert outputs in send order, of the last forward

  // Backward scratch.
  // Deferred routing reads (EpOptions::defer_routing_reads): this forward's counts and statistics stay on the
  // device (routing_dev_: a PlanCountsBlock then an AuxPartialsBlock) and come back through readback_.
  bool deferred_ = false;         // the forward under way (or the last one) defers them
  bool routing_pending_ = false;  // read back, not yet settled
  bool pending_train_ = false;    // the pending read is a train forward's (its block holds router statistics)
  bool captured_ = false;         // the last forward was captured in a CUDA graph: nothing read back
  void host_routing(const char* what);  // the counts on the host: settle_routing, refused after a capture
  bool routing_failed_ = false;   // settling found a bad expert id: that forward has no backward or losses
  Buffer routing_dev_;
  std::unique_ptr<HostReadback> readback_;
  bool defer_this_forward(int64_t rows, bool capturing);

  Buffer dret_, drecv_, dbatch_, dx_batch_, dx_recv_, dsend_, dweights_, dlogits_, dx_router_;
  // Padded mode only: the wire-layout copies of the send rows and of the row gradients, and the
  // compact copies of what comes back.
  Buffer send_wire_, ret_compact_, dret_wire_, dsend_compact_;
};

}  // namespace dmoe
