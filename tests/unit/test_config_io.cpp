// test_config_io.cpp — MoeConfig <-> JSON: round trips, each error message, Mixtral config.json.
//
// Run: dmoe_unit_tests --gtest_filter='ConfigIo*'.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "model/config_io.hpp"
#include "model/mixtral_config.hpp"

namespace dmoe {
namespace {

using nlohmann::json;

std::string temp_path(const std::string& tag) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (std::filesystem::temp_directory_path() /
          fmt::format("dmoe_{}_{}_{}_{}.json", info->test_suite_name(), info->name(), getpid(), tag))
      .string();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// The message of the dmoe::Error that parsing j throws ("(no error)" when none).
std::string error_of(const json& j) {
  try {
    config_from_json(j);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_HAS(msg, word) EXPECT_NE((msg).find(word), std::string::npos) << "missing '" << (word) << "' in: " << (msg)

MoeConfig sample_config() {
  MoeConfig c;
  c.tokens = 128;
  c.hidden = 256;
  c.ffn = 512;
  c.experts = 16;
  c.top_k = 4;
  c.activation = Activation::gelu;
  c.renormalize = false;
  c.capacity_factor = 1.25;
  c.drop_policy = DropPolicy::lowest_weight;
  c.dtype = DType::bf16;
  c.world = 4;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 1e-3;
  return c;
}

TEST(ConfigIoTest, RoundTripThroughJsonAndFile) {
  const MoeConfig c = sample_config();
  const json j = config_to_json(c);
  EXPECT_EQ(j.at("activation"), "gelu");
  EXPECT_EQ(j.at("drop_policy"), "lowest-weight");
  EXPECT_EQ(j.at("dtype"), "bf16");
  EXPECT_EQ(config_from_json(j), c);
  EXPECT_EQ(config_from_json(json::parse(j.dump())), c);  // through text, doubles included

  const std::string path = temp_path("rt");
  save_config_file(c, path);
  EXPECT_EQ(load_config_file(path), c);
  std::filesystem::remove(path);

  const MoeConfig defaults;
  EXPECT_EQ(config_from_json(config_to_json(defaults)), defaults);
}

TEST(ConfigIoTest, MissingKeysKeepDefaultsAndNothingIsValidated) {
  const MoeConfig c = config_from_json(json{{"hidden", 64}, {"experts", 8}, {"activation", "relu"}});
  MoeConfig expected;
  expected.hidden = 64;
  expected.experts = 8;
  expected.activation = Activation::relu;
  EXPECT_EQ(c, expected);
  EXPECT_EQ(config_from_json(json::object()), MoeConfig{});
  // tokens = 0 and top_k > experts are validate()'s business, not the parser's.
  EXPECT_NO_THROW(config_from_json(json{{"tokens", 0}, {"experts", 2}, {"top_k", 5}}));
  EXPECT_EQ(config_from_json(json{{"capacity_factor", 2}}).capacity_factor, 2.0);  // integers are numbers
  EXPECT_EQ(config_from_json(json{{"dtype", "bfloat16"}}).dtype, DType::bf16);
}

TEST(ConfigIoTest, UnknownKeyIsNamedWithTheAllowedKeys) {
  const std::string msg = error_of(json{{"hidden", 8}, {"hiden", 8}});
  EXPECT_HAS(msg, "unknown key 'hiden'");
  EXPECT_HAS(msg, "allowed keys: tokens, hidden, ffn, experts, top_k, activation");
  EXPECT_HAS(msg, "z_loss_coef");
}

TEST(ConfigIoTest, WrongTypesNameTheKeyAndTheExpectedType) {
  std::string msg = error_of(json{{"experts", "8"}});
  EXPECT_HAS(msg, "key 'experts' must be an integer");
  EXPECT_HAS(msg, "string");
  msg = error_of(json{{"experts", 8.0}});
  EXPECT_HAS(msg, "key 'experts' must be an integer");
  msg = error_of(json{{"tokens", true}});
  EXPECT_HAS(msg, "key 'tokens' must be an integer");
  msg = error_of(json{{"renormalize", 1}});
  EXPECT_HAS(msg, "key 'renormalize' must be a boolean");
  msg = error_of(json{{"activation", 3}});
  EXPECT_HAS(msg, "key 'activation' must be a string");
  msg = error_of(json{{"capacity_factor", "1.0"}});
  EXPECT_HAS(msg, "key 'capacity_factor' must be a number");
  msg = error_of(json{{"aux_loss_coef", nullptr}});
  EXPECT_HAS(msg, "key 'aux_loss_coef' must be a number");
  msg = error_of(json{{"world", 10000000000ll}});
  EXPECT_HAS(msg, "key 'world' = 10000000000 is out of range");
  msg = error_of(json{{"hidden", 18446744073709551615ull}});
  EXPECT_HAS(msg, "key 'hidden'");
  EXPECT_HAS(msg, "out of range");
  msg = error_of(json::array({1, 2}));
  EXPECT_HAS(msg, "must be an object");
}

TEST(ConfigIoTest, BadEnumValuesListTheAllowedOnes) {
  std::string msg = error_of(json{{"activation", "tanh"}});
  EXPECT_HAS(msg, "activation 'tanh'");
  EXPECT_HAS(msg, "allowed");
  msg = error_of(json{{"drop_policy", "random"}});
  EXPECT_HAS(msg, "drop_policy 'random'");
  EXPECT_HAS(msg, "latest-tokens");
  msg = error_of(json{{"dtype", "f16"}});
  EXPECT_HAS(msg, "dtype 'f16'");
}

// config.json of mistralai/Mixtral-8x7B-v0.1 (abridged only by key order).
constexpr const char* kMixtral8x7B = R"({
  "architectures": ["MixtralForCausalLM"],
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "hidden_act": "silu",
  "hidden_size": 4096,
  "initializer_range": 0.02,
  "intermediate_size": 14336,
  "max_position_embeddings": 32768,
  "model_type": "mixtral",
  "num_attention_heads": 32,
  "num_experts_per_tok": 2,
  "num_hidden_layers": 32,
  "num_key_value_heads": 8,
  "num_local_experts": 8,
  "output_router_logits": false,
  "rms_norm_eps": 1e-05,
  "rope_theta": 1000000.0,
  "router_aux_loss_coef": 0.02,
  "sliding_window": null,
  "tie_word_embeddings": false,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.36.0.dev0",
  "use_cache": true,
  "vocab_size": 32000
})";

TEST(ConfigIoTest, MixtralConfigJson) {
  MoeConfig c = config_from_json(json::parse(kMixtral8x7B));
  EXPECT_EQ(c.hidden, 4096);
  EXPECT_EQ(c.ffn, 14336);
  EXPECT_EQ(c.experts, 8);
  EXPECT_EQ(c.top_k, 2);
  EXPECT_EQ(c.activation, Activation::swiglu);
  EXPECT_TRUE(c.renormalize);
  EXPECT_EQ(c.dtype, DType::bf16);
  EXPECT_EQ(c.tokens, 0);  // the caller sets tokens from its input
  EXPECT_TRUE(c.dropless());
  c.tokens = 16;
  EXPECT_NO_THROW(c.validate());

  // Through a file as well.
  const std::string path = temp_path("mixtral");
  write_text(path, kMixtral8x7B);
  EXPECT_EQ(load_config_file(path).ffn, 14336);
  std::filesystem::remove(path);
}

TEST(ConfigIoTest, MixtralVariantsAndErrors) {
  json j = json::parse(kMixtral8x7B);
  j["torch_dtype"] = "float32";
  EXPECT_EQ(config_from_json(j).dtype, DType::f32);
  j["torch_dtype"] = "float16";  // no f16 engine: refused rather than silently run in f32
  EXPECT_HAS(error_of(j), "torch_dtype 'float16' is not supported");
  EXPECT_HAS(error_of(j), "allowed: float32, bfloat16");
  j.erase("torch_dtype");
  j["dtype"] = "bfloat16";  // newer transformers spell it "dtype"
  EXPECT_EQ(config_from_json(j).dtype, DType::bf16);
  j["hidden_act"] = "gelu";
  EXPECT_EQ(config_from_json(j).activation, Activation::gelu);
  j["hidden_act"] = "relu";
  EXPECT_EQ(config_from_json(j).activation, Activation::relu);
  j["hidden_act"] = "gelu_pytorch_tanh";
  std::string msg = error_of(j);
  EXPECT_HAS(msg, "hidden_act 'gelu_pytorch_tanh' is not supported");

  json k = json::parse(kMixtral8x7B);
  k.erase("num_experts_per_tok");
  msg = error_of(k);
  EXPECT_HAS(msg, "required key 'num_experts_per_tok' is missing");
  // Detected by num_local_experts alone: the other required keys are then named.
  msg = error_of(json{{"num_local_experts", 8}});
  EXPECT_HAS(msg, "required key 'hidden_size' is missing");
  json l = json::parse(kMixtral8x7B);
  l["intermediate_size"] = "14336";
  msg = error_of(l);
  EXPECT_HAS(msg, "key 'intermediate_size' must be an integer");
  l["intermediate_size"] = 0;
  msg = error_of(l);
  EXPECT_HAS(msg, "key 'intermediate_size' = 0 is out of range");
}

TEST(ConfigIoTest, HuggingFaceFieldsTakeEffectOrAreRefused) {
  // router_aux_loss_coef (0.02 in Mixtral's config) becomes the load-balancing loss weight.
  json j = json::parse(kMixtral8x7B);
  EXPECT_EQ(config_from_json(j).aux_loss_coef, 0.02);
  j["router_z_loss_coef"] = 0.001;
  EXPECT_EQ(config_from_json(j).z_loss_coef, 0.001);
  // Keys the file lacks keep the caller's defaults (tokens, world).
  MoeConfig defaults;
  defaults.tokens = 64;
  defaults.world = 2;
  EXPECT_EQ(config_from_json(j, defaults).tokens, 64);
  EXPECT_EQ(config_from_json(j, defaults).world, 2);
  // A dmoe key inside a Hugging Face config would be dropped: refused, pointing to its flag.
  for (const char* key : {"tokens", "top_k", "capacity_factor", "world"}) {
    json k = json::parse(kMixtral8x7B);
    k[key] = 4;
    const std::string msg = error_of(k);
    EXPECT_HAS(msg, fmt::format("key '{}' is a dmoe config key", key));
    EXPECT_HAS(msg, "--");
  }
  // Another model type is not read as Mixtral.
  json q = json::parse(kMixtral8x7B);
  q["model_type"] = "qwen2_moe";
  const std::string msg = error_of(q);
  EXPECT_HAS(msg, "model_type 'qwen2_moe' is not supported");
  EXPECT_HAS(msg, "'mixtral'");
  EXPECT_HAS(error_of(json{{"model_type", "qwen2_moe"}, {"num_experts", 60}}), "model_type 'qwen2_moe'");
}

// Sixth bad-input pass (docs/faults.md, 2026-12-03): both were read as a float Mixtral layer (or model), rc 0.
TEST(ConfigIoTest, QuantizedConfigsAndOtherArchitecturesAreRefused) {
  json q = json::parse(kMixtral8x7B);
  q["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
  std::string msg = error_of(q);
  EXPECT_HAS(msg, "quantization_config (quant_method gptq) is not supported");
  EXPECT_HAS(msg, "unquantized float32 or bfloat16 weights");
  q["quantization_config"] = nullptr;  // null: no quantization
  EXPECT_EQ(error_of(q), "(no error)");
  // A Qwen2-MoE class with Mixtral's keys and no model_type.
  json a = json::parse(kMixtral8x7B);
  a.erase("model_type");
  a["architectures"] = {"Qwen2MoeForCausalLM"};
  EXPECT_HAS(error_of(a), "architectures array [\"Qwen2MoeForCausalLM\"] names no Mixtral class");
  a["architectures"] = {"MixtralForSequenceClassification"};
  EXPECT_EQ(error_of(a), "(no error)");
  // The whole-model reader takes the same rules.
  json m = {{"hidden_size", 64}, {"intermediate_size", 128}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
            {"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"vocab_size", 256},
            {"quantization_config", {{"quant_method", "awq"}}}};
  msg.clear();
  try {
    mixtral_config_from_json(m);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, "quantization_config (quant_method awq) is not supported");
}

TEST(ConfigIoTest, DuplicateKeysAndDirectoriesAreRefused) {
  const std::string dup = temp_path("dup");
  write_text(dup, R"({"hidden": 8, "top_k": 2, "experts": 4, "top_k": 1})");
  std::string msg;
  try {
    load_config_file(dup);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, dup);
  EXPECT_HAS(msg, "key 'top_k' appears more than once");
  write_text(dup, R"({"model_type": "mixtral", "rope_scaling": {"type": "a", "type": "b"}})");
  msg.clear();
  try {
    load_config_file(dup);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, "key 'type' appears more than once");
  std::filesystem::remove(dup);
  const std::string dir = temp_path("dir");
  std::filesystem::create_directories(dir);
  msg.clear();
  try {
    load_config_file(dir);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, "is a directory; expected a JSON file");
  std::filesystem::remove(dir);
  // A device or FIFO would block or never end (/dev/zero); refused before reading.
  for (const char* device : {"/dev/zero", "/dev/null"}) {
    msg.clear();
    try {
      load_config_file(device);
    } catch (const Error& e) {
      msg = e.what();
    }
    EXPECT_HAS(msg, "is not a regular file");
  }
}

// Sixth bad-input pass (docs/faults.md, 2026-12-03): each case was read, or crashed, before its fix.
TEST(ConfigIoTest, DeepNestingNulBytesAndUnderflowingNumbersAreRefused) {
  const std::string path = temp_path("strict");
  const auto message = [&](const std::string& text) {
    write_text(path, text);
    try {
      load_config_file(path);
    } catch (const Error& e) {
      EXPECT_TRUE(e.is_input()) << e.what();
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // 100000 nested arrays as a value: the "must be an integer (found array ...)" message dumped it recursively (SIGSEGV).
  std::string msg = message(R"({"hidden": )" + std::string(100000, '[') + std::string(100000, ']') + "}");
  EXPECT_HAS(msg, path);
  EXPECT_HAS(msg, "nest deeper than 128 levels");
  // nlohmann's lexer stops at a NUL: what followed was ignored and the file taken.
  msg = message(std::string(R"({"hidden": 8, "experts": 4})") + '\0' + "garbage");
  EXPECT_HAS(msg, "byte 27 of the file is NUL (0x00)");
  // 1e-400 was read as 0: a capacity_factor that asked for a tiny capacity ran dropless.
  msg = message(R"({"hidden": 8, "experts": 4, "capacity_factor": 1e-400})");
  EXPECT_HAS(msg, "the number 1e-400 is too small for a double and would be read as 0");
  // Zeros written as zeros, and the smallest doubles, are fine.
  EXPECT_EQ(message(R"({"hidden": 8, "capacity_factor": 0.0e-400, "aux_loss_coef": -0, "z_loss_coef": 4.9e-324})"),
            "no error");
  std::filesystem::remove(path);
}

TEST(ConfigIoTest, FileErrorsNameTheFile) {
  std::string msg;
  try {
    load_config_file("/no/such/config.json");
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, "/no/such/config.json");

  const std::string bad_json = temp_path("badjson");
  write_text(bad_json, "{\"hidden\": 8,");
  msg.clear();
  try {
    load_config_file(bad_json);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, bad_json);
  EXPECT_HAS(msg, "not valid JSON");
  std::filesystem::remove(bad_json);

  const std::string bad_key = temp_path("badkey");
  write_text(bad_key, "{\"experts\": \"eight\"}");
  msg.clear();
  try {
    load_config_file(bad_key);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_HAS(msg, bad_key);
  EXPECT_HAS(msg, "key 'experts' must be an integer");
  std::filesystem::remove(bad_key);
}

}  // namespace
}  // namespace dmoe
