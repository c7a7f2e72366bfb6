// mixtral.hpp — a Mixtral (Transformer-MoE) causal language model on the CPU: forward, loss, backward,
// one rank's share of W data- and expert-parallel ranks.
//
//   x0 = embed(tokens)
//   block L (two stages):  attention:  a = RMSNorm(x; input_layernorm)
//                                      q, k, v = a·Wqᵀ, a·Wkᵀ, a·Wvᵀ; RoPE(q), RoPE(k)
//                                      h = x + o_proj(causal GQA attention(q, k, v))
//                                      m = RMSNorm(h; post_attention_layernorm)
//                          moe:        x' = h + MoE(m)   (dmoe's EpEngine on the CPU backend: router,
//                                      dispatch over the ranks, SwiGLU experts, combine)
//   logits = RMSNorm(x_L; norm) · lm_headᵀ (lm_head = embed_tokens when tied)
//   loss = mean over the B·(S−1) next-token predictions of cross-entropy(logits[b, s], tokens[b, s+1])
//          + router_aux_loss_coef · aux   (only when output_router_logits)
//   aux  = E · Σ_e F_e · P_e with F_e = (top-k assignments to e over all layers' tokens) / (L·N) and
//          P_e = (Σ over layers and tokens of softmax(router logits)_e) / (L·N): transformers'
//          load_balancing_loss_func for Mixtral (N = tokens per layer over all ranks; not divided by k).
//
// Distribution (W = comm.world()): each rank takes B/W whole sequences; dense parameters are replicated
// and their gradients summed over ranks by reduce_grads(); each layer's experts are sharded E/W per rank
// (the EpEngine's all-to-alls); the routers' gradients are summed by the EpEngine itself.
//
// State: everything a backward needs lives in the ModelState passed to forward() and backward(), one per
// micro-batch, never in the model — including the MoE layers, whose EpEngines (routing, dispatch plan,
// expert activations) are owned by the state's BlockStates. So R micro-batches may be in flight at once
// (Flow), each with its own state. Stages are public so a scheduler can interleave them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "engine/backend.hpp"
#include "engine/ep_engine.hpp"
#include "core/dtype.hpp"
#include "model/mixtral_config.hpp"
#include "model/mixtral_weights.hpp"

namespace dmoe {

constexpr int32_t kIgnoreIndex = -100;  // HF's ignore index for labels

// What one block keeps between its forward and its backward (n = batch·seq tokens of this rank).
struct BlockState {
  std::vector<float> x;            // [n, H] block input (residual stream)
  std::vector<float> xn1, rstd1;   // [n, H], [n] after input_layernorm
  std::vector<float> q, k, v;      // [n, heads·D], [n, kv·D] ×2; q and k after RoPE
  std::vector<float> attn, lse;    // [n, heads·D] attention output, [B, heads, S] its logsumexp
  std::vector<float> h;            // [n, H] x + o_proj(attn)
  std::vector<float> hn2, rstd2;   // [n, H], [n] after post_attention_layernorm (the MoE input)
  std::vector<float> moe_out;      // [n, H]
  // The MoE layer of this micro-batch: its engine keeps the routing and the experts' activations.
  std::unique_ptr<Backend> backend;
  std::unique_ptr<EpEngine> moe;
  uint64_t weights_version = 0;    // the model's weights the engine holds
};

struct ModelState {
  int64_t batch = 0, seq = 0;              // this rank's sequences and their length
  std::vector<int32_t> tokens, targets;    // [n]; targets[b, s] = tokens[b, s+1], kIgnoreIndex at s = S−1
  std::vector<float> resid;                // [n, H] the residual stream between stages
  std::vector<BlockState> blocks;
  std::vector<float> xf, xfn, rstdf;       // final norm: input, output, rstd
  std::vector<float> logits, lse;          // [n, V], [n]
  double ce_sum = 0;                       // this rank's Σ cross-entropy
  int64_t ce_count = 0;                    // predictions over all ranks
  double ce_loss = 0, aux_loss = 0, loss = 0;
  std::vector<double> expert_fraction;     // [E] F_e of the aux loss (all layers, all ranks)
  bool forward_done = false;
};

// What the CPU and the GPU model compute alike (model/mixtral.cpp, model/cuda/cuda_mixtral.cpp):
// Checks tokens [batch, seq] (batch >= 1, the sequence length against the config, every token in the vocabulary)
// and returns the next-token targets: targets[b, s] = tokens[b, s+1], kIgnoreIndex at s = seq − 1.
std::vector<int32_t> next_token_targets(const MixtralConfig& config, const int32_t* tokens, int64_t batch,
                                        int64_t seq);
// Mixtral's load-balancing loss pooled over the layers' engines (their statistics are over all ranks already):
// F_e = k/L · Σ_l f_e^l, P_e = 1/L · Σ_l P_e^l, aux = E · Σ_e F_e·P_e. Fills expert_fraction with F [E].
double pooled_load_balance_loss(const MixtralConfig& config, const std::vector<EpEngine*>& layers,
                                std::vector<double>& expert_fraction);
// d(loss_scale · coef · aux) / d probs[t, e] for every token of a layer with `tokens_all_ranks` tokens: the same
// for every token, coef · E · F_e / (L · N) (EpEngine::set_load_balance_grad).
std::vector<double> load_balance_prob_grad(const MixtralConfig& config, const std::vector<double>& expert_fraction,
                                           double tokens_all_ranks, double loss_scale);

class MixtralModel {
 public:
  MixtralModel(const MixtralConfig& config, Comm& comm);

  // This rank's share (slice_mixtral_experts(full, first_expert(), experts_per_rank())).
  void set_weights(MixtralWeights weights);
  MixtralWeights& weights() { return weights_; }
  // Call after changing weights() in place (an optimizer step): engines reload them before their next forward.
  void weights_changed() { ++weights_version_; }
  const MixtralWeights& grads() const { return grads_; }
  MixtralWeights& grads() { return grads_; }
  void zero_grads();

  // tokens [batch, seq] of this rank (row-major). Returns the loss over all ranks' predictions (collective).
  double forward(const int32_t* tokens, int64_t batch, int64_t seq, ModelState& state);
  // d(loss_scale · loss) / d parameters, added to grads() (dense gradients: this rank's part until
  // reduce_grads()). loss_scale = 1/R averages R equal micro-batches into one step's gradient.
  void backward(ModelState& state, double loss_scale = 1.0);
  // Sums the replicated parameters' gradients over ranks (not the experts'; not the routers', which
  // EpEngine sums). Collective; a no-op on one rank.
  void reduce_grads();

  // Checks tokens [batch, seq] and sets up the state (tokens, targets, blocks): what forward() does before
  // its stages, for a scheduler that runs the stages itself (then sets state.forward_done after head_forward).
  void begin_forward(const int32_t* tokens, int64_t batch, int64_t seq, ModelState& state);
  // The stages forward() and backward() run, in order: embed, then per layer attention and moe, then head;
  // backward: head, then per layer (last first) moe and attention, then embed.
  void embed_forward(ModelState& state);
  void attention_forward(int layer, ModelState& state);
  void moe_forward(int layer, ModelState& state);
  void head_forward(ModelState& state);
  void head_backward(ModelState& state, std::vector<float>& dresid, double loss_scale = 1.0);
  void moe_backward(int layer, ModelState& state, std::vector<float>& dresid, std::vector<float>& dh,
                    double loss_scale = 1.0);
  // moe_forward and moe_backward cut at the layer's all-to-alls (EpEngine's phases), for a scheduler that runs
  // compute and exchanges on different threads (Flow's CPU executor). moe_forward is exactly
  //   moe_route; moe_dispatch; moe_experts; moe_combine; moe_finish
  // and moe_backward is
  //   moe_backward_combine; moe_backward_dispatch; moe_backward_experts; moe_backward_return;
  //   moe_backward_finish; moe_collect_grads.
  // Collectives on the model's communicator: moe_dispatch, moe_combine, moe_backward_dispatch,
  // moe_backward_return and moe_collect_grads (the gate's gradient summed over ranks, then the layer's MoE
  // gradients added to grads()); the others compute only. moe_backward_finish leaves dh = d(block input).
  // Makes (or re-weights) every layer's EpEngine for this state's token count: their constructors check the
  // config across ranks (a collective), so a scheduler calls this on its collective-issuing thread before the
  // phases below run on other threads (moe_route would otherwise make them there).
  void prepare_engines(ModelState& state);
  void moe_route(int layer, ModelState& state);
  void moe_dispatch(int layer, ModelState& state);
  void moe_experts(int layer, ModelState& state);
  void moe_combine(int layer, ModelState& state);
  void moe_finish(int layer, ModelState& state);
  void moe_backward_combine(int layer, ModelState& state, const std::vector<float>& dresid, double loss_scale = 1.0);
  void moe_backward_dispatch(int layer, ModelState& state);
  void moe_backward_experts(int layer, ModelState& state);
  void moe_backward_return(int layer, ModelState& state);
  void moe_backward_finish(int layer, ModelState& state, const std::vector<float>& dresid, std::vector<float>& dh);
  void moe_collect_grads(int layer, ModelState& state);
  void attention_backward(int layer, ModelState& state, std::vector<float>& dh, std::vector<float>& dresid);
  void embed_backward(ModelState& state, const std::vector<float>& dresid);

  const MixtralConfig& config() const { return config_; }
  int32_t rank() const { return rank_; }
  int32_t world() const { return world_; }
  Comm& comm() const { return comm_; }  // the model's communicator (its collectives' order is the caller's to keep)
  int32_t first_expert() const { return rank_ * experts_per_rank(); }
  int32_t experts_per_rank() const { return config_.num_local_experts / world_; }

 private:
  // A weight gradient computed by a kernel into fp64 scratch (zeroed first), then added to grad.
  template <typename Fn>
  void accumulate(float* grad, int64_t numel, Fn&& kernel);
  void prepare_moe(BlockState& block, int64_t tokens, int layer);

  MixtralConfig config_;
  Comm& comm_;
  int32_t rank_ = 0, world_ = 1;
  MixtralWeights weights_, grads_;
  uint64_t weights_version_ = 1;
};

// A whole batch on W simulated ranks (threads + ThreadComm), as `dmoe eval` runs it.
struct EvalResult {
  std::vector<float> logits;       // [B, S, V]
  double loss = 0, ce_loss = 0, aux_loss = 0;
  MixtralWeights grads;            // all experts; when with_grad
  int32_t rank = 0;                // run_cuda_model in a job of W processes: only rank 0's result is filled
};
EvalResult run_cpu_model(const MixtralConfig& config, const MixtralWeights& weights, const std::vector<int32_t>& tokens,
                         int64_t batch, int64_t seq, int32_t world, bool with_grad);
// The same on this process's GPU (model/cuda/cuda_mixtral.hpp), the model in `storage` (f32 or bf16): alone, one
// rank; in a job of W processes (dmoe launch, mpirun, srun) this process is one of W ranks, the batch and the
// experts split as in training, and only rank 0's result holds the logits, losses and gradients (collective).
// Throws a clear error in a build without CUDA or on a machine without a GPU.
EvalResult run_cuda_model(const MixtralConfig& config, const MixtralWeights& weights, const std::vector<int32_t>& tokens,
                          int64_t batch, int64_t seq, DType storage, bool with_grad);

}  // namespace dmoe
