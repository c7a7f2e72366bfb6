// mixtral_weights.cpp — shapes, HF names, random initialisation of a Mixtral model's parameters.
#include "model/mixtral_weights.hpp"

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/random.hpp"
#include "model/checkpoint.hpp"

namespace dmoe {
namespace {

// FNV-1a of the name: a tensor's random stream does not depend on which other tensors exist.
uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

std::string layer_name(int layer, const char* rest) { return fmt::format("model.layers.{}.{}", layer, rest); }

}  // namespace

MixtralWeights make_mixtral_weights(const MixtralConfig& c, int32_t first_expert, int32_t num_experts) {
  c.validate();
  DMOE_REQUIRE(first_expert >= 0 && num_experts >= 0 && first_expert + num_experts <= c.num_local_experts,
               "mixtral weights: experts [{}, {}) are outside [0, {})", first_expert, first_expert + num_experts,
               c.num_local_experts);
  const int64_t H = c.hidden_size, V = c.vocab_size;
  MixtralWeights w;
  w.first_expert = first_expert;
  w.num_experts = num_experts;
  w.embed_tokens.assign(V * H, 0.0f);
  w.norm.assign(H, 0.0f);
  if (!c.tie_word_embeddings) w.lm_head.assign(V * H, 0.0f);
  w.layers.resize(c.num_hidden_layers);
  const MoeConfig moe = c.moe_config(1, 1);
  for (auto& l : w.layers) {
    l.input_layernorm.assign(H, 0.0f);
    l.post_attention_layernorm.assign(H, 0.0f);
    l.q_proj.assign(c.q_size() * H, 0.0f);
    l.k_proj.assign(c.kv_size() * H, 0.0f);
    l.v_proj.assign(c.kv_size() * H, 0.0f);
    l.o_proj.assign(H * c.q_size(), 0.0f);
    l.moe = make_moe_weights(moe, first_expert, num_experts);
  }
  return w;
}

std::vector<ParamView> parameter_views(MixtralWeights& w, const MixtralConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, E = c.num_local_experts;
  DMOE_REQUIRE(int64_t(w.layers.size()) == c.num_hidden_layers && int64_t(w.embed_tokens.size()) == V * H,
               "mixtral weights: {} layers and an embedding of {} values do not match the config ({} layers, "
               "[{}, {}])", w.layers.size(), w.embed_tokens.size(), c.num_hidden_layers, V, H);
  std::vector<ParamView> views;
  auto add = [&](std::string name, std::vector<int64_t> shape, float* data, size_t have, bool expert = false,
                 bool gate = false) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    DMOE_REQUIRE(int64_t(have) >= n, "mixtral weights: {} holds {} values; its shape {} needs {}", name, have,
                 shape_string(shape), n);
    views.push_back(ParamView{std::move(name), std::move(shape), data, n, expert, gate});
  };
  add("model.embed_tokens.weight", {V, H}, w.embed_tokens.data(), w.embed_tokens.size());
  for (int L = 0; L < c.num_hidden_layers; ++L) {
    MixtralLayerWeights& l = w.layers[L];
    add(layer_name(L, "input_layernorm.weight"), {H}, l.input_layernorm.data(), l.input_layernorm.size());
    add(layer_name(L, "self_attn.q_proj.weight"), {c.q_size(), H}, l.q_proj.data(), l.q_proj.size());
    add(layer_name(L, "self_attn.k_proj.weight"), {c.kv_size(), H}, l.k_proj.data(), l.k_proj.size());
    add(layer_name(L, "self_attn.v_proj.weight"), {c.kv_size(), H}, l.v_proj.data(), l.v_proj.size());
    add(layer_name(L, "self_attn.o_proj.weight"), {H, c.q_size()}, l.o_proj.data(), l.o_proj.size());
    add(layer_name(L, "post_attention_layernorm.weight"), {H}, l.post_attention_layernorm.data(),
        l.post_attention_layernorm.size());
    const std::string prefix = layer_prefix(L);
    add(gate_name(prefix), {E, H}, l.moe.gate.data(), l.moe.gate.size(), false, true);
    DMOE_REQUIRE(l.moe.num_experts == w.num_experts && l.moe.first_expert == w.first_expert,
                 "mixtral weights: layer {} holds experts [{}, {}), the model [{}, {})", L, l.moe.first_expert,
                 l.moe.first_expert + l.moe.num_experts, w.first_expert, w.first_expert + w.num_experts);
    for (int32_t local = 0; local < l.moe.num_experts; ++local) {
      const int32_t e = l.moe.first_expert + local;
      const size_t off = size_t(local) * size_t(I * H);
      add(expert_weight_name(prefix, e, "w1"), {I, H}, l.moe.w1.data() + off, l.moe.w1.size() - off, true);
      add(expert_weight_name(prefix, e, "w3"), {I, H}, l.moe.w3.data() + off, l.moe.w3.size() - off, true);
      add(expert_weight_name(prefix, e, "w2"), {H, I}, l.moe.w2.data() + off, l.moe.w2.size() - off, true);
    }
  }
  add("model.norm.weight", {H}, w.norm.data(), w.norm.size());
  if (!c.tie_word_embeddings) add("lm_head.weight", {V, H}, w.lm_head.data(), w.lm_head.size());
  return views;
}

MixtralWeights random_mixtral_weights(const MixtralConfig& c, uint64_t seed, int32_t first_expert,
                                      int32_t num_experts) {
  MixtralWeights w = make_mixtral_weights(c, first_expert, num_experts);
  for (ParamView& p : parameter_views(w, c)) {
    if (p.shape.size() == 1) {  // RMSNorm weights start at 1, as HF's
      std::fill(p.data, p.data + p.numel, 1.0f);
      continue;
    }
    Rng rng(seed ^ name_hash(p.name));
    for (int64_t i = 0; i < p.numel; ++i) p.data[i] = float(rng.normal() * c.initializer_range);
  }
  return w;
}

MixtralWeights random_mixtral_weights(const MixtralConfig& c, uint64_t seed) {
  return random_mixtral_weights(c, seed, 0, c.num_local_experts);
}

MixtralWeights slice_mixtral_experts(const MixtralWeights& w, int32_t first_expert, int32_t num_experts) {
  MixtralWeights s;
  s.embed_tokens = w.embed_tokens;
  s.norm = w.norm;
  s.lm_head = w.lm_head;
  s.first_expert = first_expert;
  s.num_experts = num_experts;
  for (const auto& l : w.layers) {
    MixtralLayerWeights sl = l;
    sl.moe = slice_experts(l.moe, first_expert, num_experts);  // global expert indices
    s.layers.push_back(std::move(sl));
  }
  return s;
}

}  // namespace dmoe
