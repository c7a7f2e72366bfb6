// mixtral.cpp — the Mixtral model's stages on the CPU kernels and the EpEngine (see mixtral.hpp).
#include "model/mixtral.hpp"

#include <algorithm>
#include <mutex>

#include "core/error.hpp"
#include "cpu/model_kernels.hpp"

namespace dmoe {
namespace {

void add_into(std::vector<float>& dst, const std::vector<float>& src) {
  for (size_t i = 0; i < dst.size(); ++i) dst[i] += src[i];
}

}  // namespace

std::vector<int32_t> next_token_targets(const MixtralConfig& config, const int32_t* tokens, int64_t batch,
                                        int64_t seq) {
  DMOE_REQUIRE_INPUT(batch >= 1, "mixtral: batch = {} must be >= 1", batch);
  config.check_sequence(seq);
  DMOE_REQUIRE_INPUT(seq >= 2, "mixtral: sequence length {} leaves no next-token prediction (need >= 2)", seq);
  const int64_t n = batch * seq;
  for (int64_t t = 0; t < n; ++t)
    DMOE_REQUIRE_INPUT(tokens[t] >= 0 && tokens[t] < config.vocab_size,
                       "mixtral: token {} at [{}, {}] is outside the vocabulary [0, {})", tokens[t], t / seq, t % seq,
                       config.vocab_size);
  std::vector<int32_t> targets(n, kIgnoreIndex);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t s = 0; s + 1 < seq; ++s) targets[b * seq + s] = tokens[b * seq + s + 1];
  return targets;
}

double pooled_load_balance_loss(const MixtralConfig& config, const std::vector<EpEngine*>& layers,
                                std::vector<double>& expert_fraction) {
  const int32_t E = config.num_local_experts;
  const double L = double(layers.size());
  expert_fraction.assign(E, 0.0);
  std::vector<double> prob(E, 0.0);
  for (EpEngine* engine : layers)
    for (int32_t e = 0; e < E; ++e) {
      expert_fraction[e] += engine->expert_fraction()[e] * config.num_experts_per_tok / L;
      prob[e] += engine->prob_mean()[e] / L;
    }
  double aux = 0;
  for (int32_t e = 0; e < E; ++e) aux += expert_fraction[e] * prob[e];
  return aux * E;
}

std::vector<double> load_balance_prob_grad(const MixtralConfig& config, const std::vector<double>& expert_fraction,
                                           double tokens_all_ranks, double loss_scale) {
  const int32_t E = config.num_local_experts;
  std::vector<double> dprob(E);
  for (int32_t e = 0; e < E; ++e)
    dprob[e] = loss_scale * config.router_aux_loss_coef * E * expert_fraction[e] /
               (double(config.num_hidden_layers) * tokens_all_ranks);
  return dprob;
}

MixtralModel::MixtralModel(const MixtralConfig& config, Comm& comm)
    : config_(config), comm_(comm), rank_(comm.rank()), world_(comm.world()) {
  config_.validate();
  DMOE_REQUIRE_INPUT(config_.num_local_experts % world_ == 0,
               "mixtral: num_local_experts = {} is not divisible by world = {} (each rank owns E/W experts)",
               config_.num_local_experts, world_);
  grads_ = make_mixtral_weights(config_, first_expert(), experts_per_rank());
}

void MixtralModel::set_weights(MixtralWeights weights) {
  DMOE_REQUIRE(weights.first_expert == first_expert() && weights.num_experts == experts_per_rank(),
               "mixtral: rank {} owns experts [{}, {}) but was given [{}, {})", rank_, first_expert(),
               first_expert() + experts_per_rank(), weights.first_expert, weights.first_expert + weights.num_experts);
  parameter_views(weights, config_);  // checks every shape
  weights_ = std::move(weights);
  ++weights_version_;
}

void MixtralModel::zero_grads() {
  for (ParamView& p : parameter_views(grads_, config_)) std::fill(p.data, p.data + p.numel, 0.0f);
}

// NOTE: one scratch per thread, not per model: a Flow executor runs stages of one model on two threads at once
// (attention_backward on the compute thread, moe_backward on the communication thread).
template <typename Fn>
void MixtralModel::accumulate(float* grad, int64_t numel, Fn&& kernel) {
  static thread_local std::vector<double> scratch;
  scratch.assign(size_t(numel), 0.0);
  kernel(scratch.data());
  for (int64_t i = 0; i < numel; ++i) grad[i] = float(double(grad[i]) + scratch[i]);
}

// ---- forward ---------------------------------------------------------------------------------------

double MixtralModel::forward(const int32_t* tokens, int64_t batch, int64_t seq, ModelState& st) {
  begin_forward(tokens, batch, seq, st);
  embed_forward(st);
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    attention_forward(l, st);
    moe_forward(l, st);
  }
  head_forward(st);
  st.forward_done = true;
  return st.loss;
}

void MixtralModel::begin_forward(const int32_t* tokens, int64_t batch, int64_t seq, ModelState& st) {
  DMOE_REQUIRE(!weights_.layers.empty(), "mixtral: set_weights() was not called");
  st.targets = next_token_targets(config_, tokens, batch, seq);
  st.batch = batch;
  st.seq = seq;
  st.tokens.assign(tokens, tokens + batch * seq);
  st.blocks.resize(config_.num_hidden_layers);
  st.forward_done = false;
}

void MixtralModel::embed_forward(ModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  st.resid.resize(n * H);
  cpu::embedding_forward(st.tokens.data(), weights_.embed_tokens.data(), st.resid.data(), n, config_.vocab_size, H);
}

void MixtralModel::attention_forward(int layer, ModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, Q = config_.q_size(), KV = config_.kv_size();
  const int32_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t D = config_.head_size();
  const MixtralLayerWeights& w = weights_.layers[layer];
  BlockState& b = st.blocks[layer];
  b.x = st.resid;
  b.xn1.resize(n * H);
  b.rstd1.resize(n);
  cpu::rmsnorm_forward(b.x.data(), w.input_layernorm.data(), b.xn1.data(), b.rstd1.data(), n, H,
                       float(config_.rms_norm_eps));
  b.q.resize(n * Q);
  b.k.resize(n * KV);
  b.v.resize(n * KV);
  cpu::linear_forward(b.xn1.data(), w.q_proj.data(), b.q.data(), n, H, Q);
  cpu::linear_forward(b.xn1.data(), w.k_proj.data(), b.k.data(), n, H, KV);
  cpu::linear_forward(b.xn1.data(), w.v_proj.data(), b.v.data(), n, H, KV);
  cpu::rope_forward(b.q.data(), b.q.data(), n, st.seq, heads, D, config_.rope_theta);
  cpu::rope_forward(b.k.data(), b.k.data(), n, st.seq, kv_heads, D, config_.rope_theta);
  b.attn.resize(n * Q);
  b.lse.resize(st.batch * heads * st.seq);
  cpu::attention_forward(b.q.data(), b.k.data(), b.v.data(), b.attn.data(), b.lse.data(), st.batch, st.seq, heads,
                         kv_heads, D);
  b.h.resize(n * H);
  cpu::linear_forward(b.attn.data(), w.o_proj.data(), b.h.data(), n, Q, H);
  add_into(b.h, b.x);
  b.hn2.resize(n * H);
  b.rstd2.resize(n);
  cpu::rmsnorm_forward(b.h.data(), w.post_attention_layernorm.data(), b.hn2.data(), b.rstd2.data(), n, H,
                       float(config_.rms_norm_eps));
}

void MixtralModel::prepare_moe(BlockState& b, int64_t tokens, int layer) {
  if (!b.moe || b.moe->config().tokens != tokens) {
    b.moe.reset();
    b.backend = make_cpu_backend(DType::f32);
    b.moe = std::make_unique<EpEngine>(config_.moe_config(tokens, world_), *b.backend, comm_);
    b.weights_version = 0;
  }
  if (b.weights_version != weights_version_) {
    b.moe->set_weights(weights_.layers[layer].moe);
    b.weights_version = weights_version_;
  }
}

void MixtralModel::moe_forward(int layer, ModelState& st) {
  moe_route(layer, st);
  moe_dispatch(layer, st);
  moe_experts(layer, st);
  moe_combine(layer, st);
  moe_finish(layer, st);
}

void MixtralModel::prepare_engines(ModelState& st) {
  for (int l = 0; l < config_.num_hidden_layers; ++l) prepare_moe(st.blocks[size_t(l)], st.batch * st.seq, l);
}

void MixtralModel::moe_route(int layer, ModelState& st) {
  BlockState& b = st.blocks[layer];
  prepare_moe(b, st.batch * st.seq, layer);
  b.moe->forward_route(b.hn2.data(), ForwardMode::train);
}

void MixtralModel::moe_dispatch(int layer, ModelState& st) { st.blocks[layer].moe->forward_dispatch(nullptr); }

void MixtralModel::moe_experts(int layer, ModelState& st) { st.blocks[layer].moe->forward_experts(); }

void MixtralModel::moe_combine(int layer, ModelState& st) { st.blocks[layer].moe->forward_combine(nullptr); }

void MixtralModel::moe_finish(int layer, ModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  BlockState& b = st.blocks[layer];
  b.moe_out.resize(n * H);
  b.moe->forward_finish(b.moe_out.data());
  st.resid = b.h;
  add_into(st.resid, b.moe_out);
}

void MixtralModel::head_forward(ModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, V = config_.vocab_size;
  const int32_t L = config_.num_hidden_layers, E = config_.num_local_experts;
  st.xf = st.resid;
  st.xfn.resize(n * H);
  st.rstdf.resize(n);
  cpu::rmsnorm_forward(st.xf.data(), weights_.norm.data(), st.xfn.data(), st.rstdf.data(), n, H,
                       float(config_.rms_norm_eps));
  const float* lm_head = config_.tie_word_embeddings ? weights_.embed_tokens.data() : weights_.lm_head.data();
  st.logits.resize(n * V);
  cpu::linear_forward(st.xfn.data(), lm_head, st.logits.data(), n, H, V);
  st.lse.resize(n);
  int64_t count = 0;
  cpu::cross_entropy_forward(st.logits.data(), st.targets.data(), st.lse.data(), &st.ce_sum, &count, n, V,
                             kIgnoreIndex);
  double totals[2] = {st.ce_sum, double(count)};
  if (world_ > 1) comm_.allreduce_sum(totals, 2, DType::f64, nullptr);
  st.ce_count = int64_t(totals[1]);
  st.ce_loss = totals[0] / totals[1];

  // Mixtral's load-balancing loss pools all layers (the engines' statistics are already over all ranks).
  st.aux_loss = 0;
  st.expert_fraction.assign(E, 0.0);
  if (config_.output_router_logits) {
    std::vector<EpEngine*> engines;
    for (int l = 0; l < L; ++l) engines.push_back(st.blocks[l].moe.get());
    st.aux_loss = pooled_load_balance_loss(config_, engines, st.expert_fraction);
  }
  st.loss = st.ce_loss + (config_.output_router_logits ? config_.router_aux_loss_coef * st.aux_loss : 0.0);
}

// ---- backward --------------------------------------------------------------------------------------

void MixtralModel::backward(ModelState& st, double loss_scale) {
  DMOE_REQUIRE(st.forward_done, "mixtral: backward() needs a completed forward() on this state");
  std::vector<float> dresid, dh;
  head_backward(st, dresid, loss_scale);
  for (int l = config_.num_hidden_layers - 1; l >= 0; --l) {
    moe_backward(l, st, dresid, dh, loss_scale);
    attention_backward(l, st, dh, dresid);
  }
  embed_backward(st, dresid);
  st.forward_done = false;  // the engines' saved state may be reused by the next forward
}

void MixtralModel::head_backward(ModelState& st, std::vector<float>& dresid, double loss_scale) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, V = config_.vocab_size;
  std::vector<float> dlogits(n * V), dxfn(n * H);
  cpu::cross_entropy_backward(st.logits.data(), st.targets.data(), st.lse.data(), dlogits.data(), n, V,
                              kIgnoreIndex, loss_scale / double(st.ce_count));
  const bool tied = config_.tie_word_embeddings;
  const float* lm_head = tied ? weights_.embed_tokens.data() : weights_.lm_head.data();
  float* dlm_head = tied ? grads_.embed_tokens.data() : grads_.lm_head.data();
  accumulate(dlm_head, V * H, [&](double* dw) {
    cpu::linear_backward(st.xfn.data(), lm_head, dlogits.data(), dxfn.data(), dw, n, H, V);
  });
  dresid.resize(n * H);
  accumulate(grads_.norm.data(), H, [&](double* dw) {
    cpu::rmsnorm_backward(st.xf.data(), weights_.norm.data(), st.rstdf.data(), dxfn.data(), dresid.data(), dw, n, H);
  });
}

void MixtralModel::moe_backward(int layer, ModelState& st, std::vector<float>& dresid, std::vector<float>& dh,
                                double loss_scale) {
  moe_backward_combine(layer, st, dresid, loss_scale);
  moe_backward_dispatch(layer, st);
  moe_backward_experts(layer, st);
  moe_backward_return(layer, st);
  moe_backward_finish(layer, st, dresid, dh);
  moe_collect_grads(layer, st);
}

void MixtralModel::moe_backward_combine(int layer, ModelState& st, const std::vector<float>& dresid,
                                        double loss_scale) {
  BlockState& b = st.blocks[layer];
  // d(coef·aux)/d probs[t, e] = coef · E · F_e / (L·N), the same for every token of every layer.
  if (config_.output_router_logits)
    b.moe->set_load_balance_grad(
        load_balance_prob_grad(config_, st.expert_fraction, double(b.moe->config().tokens) * world_, loss_scale));
  b.moe->backward_combine(dresid.data());
}

void MixtralModel::moe_backward_dispatch(int layer, ModelState& st) { st.blocks[layer].moe->backward_dispatch(nullptr); }

void MixtralModel::moe_backward_experts(int layer, ModelState& st) { st.blocks[layer].moe->backward_experts(); }

void MixtralModel::moe_backward_return(int layer, ModelState& st) { st.blocks[layer].moe->backward_return(nullptr); }

void MixtralModel::moe_backward_finish(int layer, ModelState& st, const std::vector<float>& dresid,
                                       std::vector<float>& dh) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  BlockState& b = st.blocks[layer];
  MixtralLayerWeights& g = grads_.layers[layer];
  std::vector<float> dhn2(n * H);
  b.moe->backward_finish(dhn2.data());
  // h feeds both the residual and the post-attention norm.
  dh = dresid;
  std::vector<float> dh_norm(n * H);
  accumulate(g.post_attention_layernorm.data(), H, [&](double* dw) {
    cpu::rmsnorm_backward(b.h.data(), weights_.layers[layer].post_attention_layernorm.data(), b.rstd2.data(),
                          dhn2.data(), dh_norm.data(), dw, n, H);
  });
  add_into(dh, dh_norm);
}

void MixtralModel::moe_collect_grads(int layer, ModelState& st) {
  BlockState& b = st.blocks[layer];
  MixtralLayerWeights& g = grads_.layers[layer];
  const MoeWeights mg = b.moe->grads();  // collective: gate summed over ranks
  b.moe->zero_grads();
  add_into(g.moe.gate, mg.gate);
  add_into(g.moe.w1, mg.w1);
  add_into(g.moe.w3, mg.w3);
  add_into(g.moe.w2, mg.w2);
}

void MixtralModel::attention_backward(int layer, ModelState& st, std::vector<float>& dh, std::vector<float>& dresid) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, Q = config_.q_size(), KV = config_.kv_size();
  const int32_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t D = config_.head_size();
  BlockState& b = st.blocks[layer];
  const MixtralLayerWeights& w = weights_.layers[layer];
  MixtralLayerWeights& g = grads_.layers[layer];
  std::vector<float> dattn(n * Q), dq(n * Q), dk(n * KV), dv(n * KV);
  accumulate(g.o_proj.data(), H * Q, [&](double* dw) {
    cpu::linear_backward(b.attn.data(), w.o_proj.data(), dh.data(), dattn.data(), dw, n, Q, H);
  });
  cpu::attention_backward(b.q.data(), b.k.data(), b.v.data(), b.lse.data(), dattn.data(), dq.data(), dk.data(),
                          dv.data(), st.batch, st.seq, heads, kv_heads, D);
  cpu::rope_backward(dq.data(), dq.data(), n, st.seq, heads, D, config_.rope_theta);
  cpu::rope_backward(dk.data(), dk.data(), n, st.seq, kv_heads, D, config_.rope_theta);
  // xn1 feeds q, k and v: its gradient is the sum of the three.
  std::vector<float> dxn1(n * H), part(n * H);
  accumulate(g.q_proj.data(), Q * H, [&](double* dw) {
    cpu::linear_backward(b.xn1.data(), w.q_proj.data(), dq.data(), dxn1.data(), dw, n, H, Q);
  });
  accumulate(g.k_proj.data(), KV * H, [&](double* dw) {
    cpu::linear_backward(b.xn1.data(), w.k_proj.data(), dk.data(), part.data(), dw, n, H, KV);
  });
  add_into(dxn1, part);
  accumulate(g.v_proj.data(), KV * H, [&](double* dw) {
    cpu::linear_backward(b.xn1.data(), w.v_proj.data(), dv.data(), part.data(), dw, n, H, KV);
  });
  add_into(dxn1, part);
  accumulate(g.input_layernorm.data(), H, [&](double* dw) {
    cpu::rmsnorm_backward(b.x.data(), w.input_layernorm.data(), b.rstd1.data(), dxn1.data(), part.data(), dw, n, H);
  });
  dresid = dh;
  add_into(dresid, part);
}

void MixtralModel::embed_backward(ModelState& st, const std::vector<float>& dresid) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, V = config_.vocab_size;
  accumulate(grads_.embed_tokens.data(), V * H, [&](double* dw) {
    cpu::embedding_backward(st.tokens.data(), dresid.data(), dw, n, V, H);
  });
}

void MixtralModel::reduce_grads() {
  if (world_ == 1) return;
  for (ParamView& p : parameter_views(grads_, config_))
    if (!p.is_expert && !p.is_gate) comm_.allreduce_sum(p.data, p.numel, DType::f32, nullptr);
}

// ---- a whole batch on W simulated ranks -------------------------------------------------------------

EvalResult run_cpu_model(const MixtralConfig& config, const MixtralWeights& weights, const std::vector<int32_t>& tokens,
                         int64_t batch, int64_t seq, int32_t world, bool with_grad) {
  DMOE_REQUIRE_INPUT(world >= 1 && batch % world == 0,
               "mixtral: batch = {} sequences cannot be split evenly over world = {} ranks", batch, world);
  DMOE_REQUIRE(int64_t(tokens.size()) == batch * seq, "mixtral: {} tokens given for [{}, {}]", tokens.size(), batch,
               seq);
  DMOE_REQUIRE(weights.first_expert == 0 && weights.num_experts == config.num_local_experts,
               "mixtral: the weights must hold all {} experts", config.num_local_experts);
  const int64_t local = batch / world, V = config.vocab_size;
  EvalResult result;
  result.logits.resize(batch * seq * V);
  if (with_grad) result.grads = make_mixtral_weights(config, 0, config.num_local_experts);
  std::mutex mutex;
  run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
    MixtralModel model(config, comm);
    model.set_weights(slice_mixtral_experts(weights, model.first_expert(), model.experts_per_rank()));
    ModelState st;
    model.forward(tokens.data() + rank * local * seq, local, seq, st);
    std::copy(st.logits.begin(), st.logits.end(), result.logits.begin() + rank * local * seq * V);
    if (with_grad) {
      model.backward(st);
      model.reduce_grads();
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) {
      result.loss = st.loss;
      result.ce_loss = st.ce_loss;
      result.aux_loss = st.aux_loss;
    }
    if (!with_grad) return;
    // Dense tensors (equal on every rank after reduce_grads) from rank 0; each rank's experts from it.
    std::vector<ParamView> mine = parameter_views(model.grads(), config);
    std::vector<ParamView> all = parameter_views(result.grads, config);
    size_t j = 0;
    for (const ParamView& p : mine) {
      while (all[j].name != p.name) ++j;
      if (p.is_expert || rank == 0) std::copy(p.data, p.data + p.numel, all[j].data);
    }
  });
  return result;
}

}  // namespace dmoe
