// test_model_cli.cpp — whole-model configs, checkpoints and the `dmoe init-model` / `dmoe eval` commands:
// HF config.json parsing and its errors, the named models in bench/models, checkpoint round trips (one file
// and sharded), eval's outputs against the library, and the errors a user sees for bad input.
//
// Run: dmoe_unit_tests --gtest_filter='ModelConfig*:ModelCheckpoint*:ModelCli*'
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.hpp"
#include "core/error.hpp"
#include "model/checkpoint.hpp"
#include "model/mixtral.hpp"
#include "model/mixtral_config.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using Result = test::CliResult;
using test::run_cli;

json small_json() {
  return json{{"model_type", "mixtral"},   {"vocab_size", 13},         {"hidden_size", 8},
              {"intermediate_size", 6},    {"num_hidden_layers", 2},   {"num_attention_heads", 4},
              {"num_key_value_heads", 2},  {"num_local_experts", 4},   {"num_experts_per_tok", 2},
              {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 500.0}}},
              {"output_router_logits", true}, {"router_aux_loss_coef", 0.02}, {"max_position_embeddings", 32},
              {"initializer_range", 0.3}, {"head_dim", nullptr}, {"sliding_window", nullptr}};
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ModelConfig, ParsesHfConfigsAndNamesBadKeys) {
  const MixtralConfig c = mixtral_config_from_json(small_json());
  EXPECT_EQ(c.head_size(), 2);
  EXPECT_EQ(c.rope_theta, 500.0);  // from rope_parameters (transformers 5.x)
  EXPECT_TRUE(c.output_router_logits);
  // Round trip through the written form (which has both rope_theta spellings).
  const MixtralConfig back = mixtral_config_from_json(mixtral_config_to_json(c));
  EXPECT_EQ(mixtral_config_to_json(back), mixtral_config_to_json(c));

  auto with = [](const char* key, json value) {
    json j = small_json();
    j[key] = value;
    return error_of([&] { mixtral_config_from_json(j); });
  };
  EXPECT_NE(with("model_type", "llama").find("model_type"), std::string::npos);
  EXPECT_NE(with("num_key_value_heads", 3).find("num_key_value_heads = 3"), std::string::npos);
  EXPECT_NE(with("hidden_size", 9).find("not divisible by num_attention_heads"), std::string::npos);
  EXPECT_NE(with("hidden_act", "gelu").find("hidden_act"), std::string::npos);
  EXPECT_NE(with("rope_theta", 100.0).find("disagree"), std::string::npos);
  EXPECT_NE(with("rope_scaling", {{"type", "linear"}, {"factor", 2.0}}).find("rope_scaling"), std::string::npos);
  EXPECT_NE(with("sliding_window", 0).find("'sliding_window' = 0 must be >= 1"), std::string::npos);
  EXPECT_NE(with("num_experts_per_tok", 5).find("exceeds num_local_experts"), std::string::npos);
  EXPECT_NE(with("vocab_size", "big").find("'vocab_size' must be an integer"), std::string::npos);
  json missing = small_json();
  missing.erase("num_local_experts");
  EXPECT_NE(error_of([&] { mixtral_config_from_json(missing); }).find("'num_local_experts' is missing"),
            std::string::npos);
  MixtralConfig windowed = c;
  windowed.sliding_window = 4;
  EXPECT_NE(error_of([&] { windowed.check_sequence(5); }).find("sliding_window"), std::string::npos);
}

TEST(ModelConfig, NamedModelsHaveThePaperShapes) {
  struct Shape {
    const char* name;
    int64_t hidden, ffn;
    int32_t layers, experts, top_k, heads;
  };
  for (const Shape& s : {Shape{"gpt2-tiny-moe", 256, 512, 12, 16, 2, 4}, Shape{"bert-large-moe", 512, 1024, 24, 32, 1, 8},
                         Shape{"llama2-moe", 1024, 4096, 32, 16, 1, 16}, Shape{"deepseek-v2-s", 5120, 1536, 4, 32, 8, 40},
                         Shape{"tiny", 64, 128, 2, 4, 2, 4}}) {
    const MixtralConfig c =
        load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench" / "models" / (std::string(s.name) + ".json")).string());
    EXPECT_EQ(c.hidden_size, s.hidden) << s.name;
    EXPECT_EQ(c.intermediate_size, s.ffn) << s.name;
    EXPECT_EQ(c.num_hidden_layers, s.layers) << s.name;
    EXPECT_EQ(c.num_local_experts, s.experts) << s.name;
    EXPECT_EQ(c.num_experts_per_tok, s.top_k) << s.name;
    EXPECT_EQ(c.num_attention_heads, s.heads) << s.name;
    if (std::string(s.name) != "tiny") {
      EXPECT_EQ(c.vocab_size, 32000) << s.name;
      EXPECT_EQ(c.max_position_embeddings, 1024) << s.name;
    }
  }
}

class ModelCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_model_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    std::ofstream(p("config.json")) << small_json().dump(2);
    config_ = load_mixtral_config(p("config.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  // tokens [B, S] as I64 (what torch writes), values seeded.
  std::vector<int32_t> write_tokens(const std::string& path, int64_t B, int64_t S, int64_t vocab) {
    std::vector<int64_t> t64(B * S);
    std::vector<int32_t> t32(B * S);
    for (int64_t i = 0; i < B * S; ++i) t32[i] = int32_t(t64[i] = (i * 7 + 3) % vocab);
    SafetensorsWriter w;
    w.add("tokens", DType::i64, {B, S}, t64.data());
    w.write(path);
    return t32;
  }
  fs::path dir_;
  MixtralConfig config_;
};

TEST_F(ModelCli, CheckpointRoundTripsOneFileAndSharded) {
  const MixtralWeights w = random_mixtral_weights(config_, 4);
  save_mixtral_checkpoint(p("one.safetensors"), w, config_);
  save_mixtral_checkpoint(p("model.safetensors.index.json"), w, config_, 2000);
  int shards = 0;
  for (const auto& e : fs::directory_iterator(dir_)) shards += e.path().filename().string().rfind("model-", 0) == 0;
  EXPECT_GT(shards, 2);  // ~2 kB shards of a ~10 kB model
  for (const char* file : {"one.safetensors", "model.safetensors.index.json"}) {
    MixtralWeights r = load_mixtral_weights(CheckpointReader::open(p(file)), config_);
    MixtralWeights want = w;
    std::vector<ParamView> a = parameter_views(r, config_), b = parameter_views(want, config_);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(std::equal(a[i].data, a[i].data + a[i].numel, b[i].data)) << file << ": " << a[i].name;
  }
  // transformers 5.x's fused in-memory layout (save_original_format=False) loads to the same weights.
  {
    MixtralWeights src = w;
    SafetensorsWriter fused;
    const int64_t E = config_.num_local_experts, I = config_.intermediate_size, H = config_.hidden_size;
    for (const ParamView& v : parameter_views(src, config_))
      if (v.name.find("block_sparse_moe") == std::string::npos) fused.add_f32(v.name, v.shape, v.data);
    for (int L = 0; L < config_.num_hidden_layers; ++L) {
      const MoeWeights& m = w.layers[L].moe;
      std::vector<float> gate_up(E * 2 * I * H), down(E * H * I);
      for (int64_t e = 0; e < E; ++e) {
        std::copy(m.w1_of(int32_t(e)), m.w1_of(int32_t(e)) + I * H, gate_up.begin() + e * 2 * I * H);
        std::copy(m.w3_of(int32_t(e)), m.w3_of(int32_t(e)) + I * H, gate_up.begin() + e * 2 * I * H + I * H);
        std::copy(m.w2_of(int32_t(e)), m.w2_of(int32_t(e)) + H * I, down.begin() + e * H * I);
      }
      const std::string p5 = "model.layers." + std::to_string(L) + ".mlp.";
      fused.add_f32(p5 + "gate.weight", {E, H}, m.gate);
      fused.add_f32(p5 + "experts.gate_up_proj", {E, 2 * I, H}, gate_up);
      fused.add_f32(p5 + "experts.down_proj", {E, H, I}, down);
    }
    fused.write(p("fused.safetensors"));
    MixtralWeights r = load_mixtral_weights(CheckpointReader::open(p("fused.safetensors")), config_, 2, 2);
    MixtralWeights want = slice_mixtral_experts(w, 2, 2);
    std::vector<ParamView> a = parameter_views(r, config_), b = parameter_views(want, config_);
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_TRUE(std::equal(a[i].data, a[i].data + a[i].numel, b[i].data)) << "fused: " << a[i].name;
  }
  // A config asking for more layers names the first missing tensor.
  MixtralConfig deeper = config_;
  deeper.num_hidden_layers = 3;
  EXPECT_NE(error_of([&] { load_mixtral_weights(CheckpointReader::open(p("one.safetensors")), deeper); })
                .find("'model.layers.2.input_layernorm.weight' [8] is missing"),
            std::string::npos);
  // An index pointing at a shard that does not hold the tensor.
  json index = {{"weight_map", {{"model.embed_tokens.weight", "one.safetensors"}, {"model.norm.weight", "nope.safetensors"}}}};
  std::ofstream(p("bad.index.json")) << index.dump();
  const CheckpointReader bad = CheckpointReader::open(p("bad.index.json"));
  float buf[8];
  EXPECT_NE(error_of([&] { bad.read_f32_into("model.norm.weight", {8}, buf); }).find("nope.safetensors"),
            std::string::npos);
}

TEST_F(ModelCli, EvalWritesLogitsLossAndEveryGradientAsTheLibrary) {
  const int64_t B = 2, S = 5;
  auto init = run_cli("init-model --config " + p("config.json") + " --seed 3 --out " + p("model.safetensors"));
  ASSERT_EQ(init.status, 0) << init.output;
  const std::vector<int32_t> tokens = write_tokens(p("tokens.safetensors"), B, S, config_.vocab_size);
  auto eval = run_cli("eval --grad --config " + p("config.json") + " --weights " + p("model.safetensors") +
                      " --tokens " + p("tokens.safetensors") + " --output " + p("out.safetensors"));
  ASSERT_EQ(eval.status, 0) << eval.output;

  const MixtralWeights w = load_mixtral_weights(CheckpointReader::open(p("model.safetensors")), config_);
  EvalResult want = run_cpu_model(config_, w, tokens, B, S, 1, true);
  const SafetensorsFile out = SafetensorsFile::open(p("out.safetensors"));
  EXPECT_EQ(out.read_f32("logits", {B, S, config_.vocab_size}), want.logits);  // same code, same order: exact
  EXPECT_EQ(out.read_f32("loss", {})[0], float(want.loss));
  EXPECT_GT(out.read_f32("aux_loss", {})[0], 0.0f);  // output_router_logits is on in this config
  size_t n = 0;
  for (const ParamView& g : parameter_views(want.grads, config_)) {
    EXPECT_EQ(out.read_f32("grad." + g.name, g.shape), std::vector<float>(g.data, g.data + g.numel)) << g.name;
    ++n;
  }
  EXPECT_EQ(n, size_t(1 + 2 * (6 + 1 + 3 * 4) + 1 + 1));  // embed, 2 × (6 dense + gate + 12 expert), norm, lm_head

  // Two simulated ranks: the same results up to summation order (~1e-7 relative).
  auto eval2 = run_cli("eval --grad --world 2 --config " + p("config.json") + " --weights " + p("model.safetensors") +
                       " --tokens " + p("tokens.safetensors") + " --output " + p("out2.safetensors"));
  ASSERT_EQ(eval2.status, 0) << eval2.output;
  const SafetensorsFile out2 = SafetensorsFile::open(p("out2.safetensors"));
  EXPECT_NEAR(out2.read_f32("loss", {})[0], out.read_f32("loss", {})[0], 1e-5);
}

TEST_F(ModelCli, EvalReadsShardedCheckpointsAndNamesBadInput) {
  // (single.safetensors: init-model refuses to write a model.safetensors beside a model.safetensors.index.json.)
  ASSERT_EQ(run_cli("init-model --config " + p("config.json") + " --seed 3 --out " + p("single.safetensors")).status, 0);
  auto sharded = run_cli("init-model --config " + p("config.json") + " --seed 3 --shard-bytes 3000 --out " +
                         p("model.safetensors.index.json"));
  ASSERT_EQ(sharded.status, 0) << sharded.output;
  write_tokens(p("tokens.safetensors"), 1, 4, config_.vocab_size);
  const std::string common = " --config " + p("config.json") + " --tokens " + p("tokens.safetensors");
  ASSERT_EQ(run_cli("eval" + common + " --weights " + p("single.safetensors") + " --output " + p("a.safetensors")).status, 0);
  auto e = run_cli("eval" + common + " --weights " + p("model.safetensors.index.json") + " --output " + p("b.safetensors"));
  ASSERT_EQ(e.status, 0) << e.output;
  EXPECT_EQ(SafetensorsFile::open(p("a.safetensors")).read_f32("logits").values,
            SafetensorsFile::open(p("b.safetensors")).read_f32("logits").values);  // same seed, same weights
  // A model directory (config.json + index) for both --config and --weights, as save_pretrained leaves it (without the
  // one-file model beside it: a directory holding both is refused, BadInput.ModelDirectoryWithAnIndexAndAModelFileIsRefused).
  auto d = run_cli("eval --config " + dir_.string() + " --weights " + dir_.string() + " --tokens " +
                   p("tokens.safetensors") + " --output " + p("d.safetensors"));
  ASSERT_EQ(d.status, 0) << d.output;
  EXPECT_EQ(SafetensorsFile::open(p("d.safetensors")).read_f32("logits").values,
            SafetensorsFile::open(p("b.safetensors")).read_f32("logits").values);
  fs::rename(p("single.safetensors"), p("model.safetensors"));

  // A token outside the vocabulary.
  write_tokens(p("big.safetensors"), 1, 4, 1000);
  auto big = run_cli("eval --config " + p("config.json") + " --tokens " + p("big.safetensors") + " --weights " +
                     p("model.safetensors") + " --output " + p("c.safetensors"));
  EXPECT_NE(big.status, 0);
  EXPECT_NE(big.output.find("outside the vocabulary [0, 13)"), std::string::npos) << big.output;
  // No 'tokens' tensor.
  SafetensorsWriter wrong;
  const std::vector<int32_t> ids = {1, 2};
  wrong.add_i32("input_ids", {1, 2}, ids);
  wrong.write(p("wrong.safetensors"));
  auto none = run_cli("eval --config " + p("config.json") + " --tokens " + p("wrong.safetensors") + " --weights " +
                      p("model.safetensors") + " --output " + p("c.safetensors"));
  EXPECT_NE(none.output.find("no tensor 'tokens'"), std::string::npos) << none.output;
  // A batch that does not split over the ranks, and a checkpoint for another config.
  auto split = run_cli("eval --world 2" + common + " --weights " + p("model.safetensors") + " --output " + p("c.safetensors"));
  EXPECT_NE(split.output.find("cannot be split evenly over 2 ranks"), std::string::npos) << split.output;
  json other = small_json();
  other["intermediate_size"] = 7;
  std::ofstream(p("other.json")) << other.dump();
  auto shape = run_cli("eval --config " + p("other.json") + " --tokens " + p("tokens.safetensors") + " --weights " +
                       p("model.safetensors") + " --output " + p("c.safetensors"));
  EXPECT_NE(shape.output.find("has shape [6, 8], expected [7, 8]"), std::string::npos) << shape.output;
  // An output that is one of the inputs is refused before anything is written: the weights stay intact.
  const auto before = SafetensorsFile::open(p("model.safetensors")).read_f32("model.norm.weight").values;
  auto clobber = run_cli("eval" + common + " --weights " + p("model.safetensors") + " --output ./" +
                         std::filesystem::relative(p("model.safetensors")).string());
  EXPECT_NE(clobber.status, 0);
  EXPECT_NE(clobber.output.find("--weights"), std::string::npos) << clobber.output;
  EXPECT_EQ(SafetensorsFile::open(p("model.safetensors")).read_f32("model.norm.weight").values, before);
  auto onto_config = run_cli("init-model --config " + p("config.json") + " --out " + p("config.json"));
  EXPECT_NE(onto_config.status, 0);
  EXPECT_NE(onto_config.output.find("--config"), std::string::npos) << onto_config.output;
}

}  // namespace
}  // namespace dmoe
