// mixtral_config.hpp — the whole-model configuration of a Mixtral (Transformer-MoE) language model, read
// from and written as a Hugging Face `config.json` (model_type "mixtral").
//
// Read: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads
// (default: num_attention_heads), head_dim (null/absent: hidden_size / num_attention_heads),
// num_local_experts, num_experts_per_tok, vocab_size, rms_norm_eps, rope_theta (top level, as transformers
// 4.x writes it, or rope_parameters.rope_theta, as 5.x does), tie_word_embeddings, output_router_logits,
// router_aux_loss_coef, max_position_embeddings, hidden_act (silu only), sliding_window (null or >= the
// sequence length: dmoe has no sliding-window mask), rope_parameters.rope_type (default only). Other HF
// keys (architectures, bos_token_id, …) are ignored; a wrong type or value is an error naming the key.
// Written: all of the above (rope_theta both ways), model_type and architectures, so that
// transformers' MixtralConfig.from_pretrained reads the file.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "core/config.hpp"

namespace dmoe {

struct MixtralConfig {
  int64_t vocab_size = 32000;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // each expert's FFN width
  int32_t num_hidden_layers = 0;
  int32_t num_attention_heads = 0;
  int32_t num_key_value_heads = 0;
  int64_t head_dim = 0;  // 0: hidden_size / num_attention_heads
  int32_t num_local_experts = 0;
  int32_t num_experts_per_tok = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 1e6;
  bool tie_word_embeddings = false;
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;
  int64_t max_position_embeddings = 4096 * 32;
  int64_t sliding_window = 0;  // 0: none (null)
  double initializer_range = 0.02;  // std of the random initialisation (dmoe init-model, as HF)

  int64_t head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  int64_t q_size() const { return int64_t(num_attention_heads) * head_size(); }    // q_proj rows
  int64_t kv_size() const { return int64_t(num_key_value_heads) * head_size(); }   // k_proj, v_proj rows
  // Throws naming the key, its value and the rule.
  void validate() const;
  // Checks a sequence length against max_position_embeddings and sliding_window. `source` names where the length
  // came from in the error ("train: --seq"; the default, "sequence length", for a length of no option).
  // `min_seq`: eval needs 2 (its loss predicts each next token); the range in the error says so.
  void check_sequence(int64_t seq, std::string_view source = "sequence length", int64_t min_seq = 1) const;
  // The MoE layer of one block for `tokens` tokens per rank on `world` ranks: SwiGLU, renormalised
  // top-k, dropless, f32, no auxiliary terms of its own (the model adds Mixtral's).
  MoeConfig moe_config(int64_t tokens, int32_t world) const;
  // Parameters in the model (tied lm_head counted once).
  int64_t num_parameters() const;
  // FLOP of one forward over batch × seq tokens (n = batch·seq), per layer 2nH(Q+2KV) + 2nQH (projections) + 2nHE
  // (router) + 2nk·3HI (the k experts a token goes to) + 2·batch·heads·seq²·D (causal attention: QKᵀ and PV over
  // the visible half), plus 2nHV for the LM head. A training step is 3 × this (6·parameters·tokens convention).
  double forward_flop(int64_t batch, int64_t seq) const;
  std::string summary() const;
};

MixtralConfig mixtral_config_from_json(const nlohmann::json& j);
nlohmann::json mixtral_config_to_json(const MixtralConfig& c);
// Reads a config.json; errors name the file. Validates.
MixtralConfig load_mixtral_config(const std::string& path);
void save_mixtral_config(const MixtralConfig& c, const std::string& path);

}  // namespace dmoe
