// test_checkpoint.cpp — MoE layer weights in safetensors: round trips, slices, prefixes, errors.
//
// Run: dmoe_unit_tests --gtest_filter='Checkpoint*'.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>

#include "core/error.hpp"
#include "error_test_util.hpp"
#include "model/checkpoint.hpp"

namespace dmoe {
namespace {

using test::error_of;

MoeConfig small_config(Activation act) {
  MoeConfig c;
  c.tokens = 4;
  c.hidden = 8;
  c.ffn = 6;
  c.experts = 4;
  c.top_k = 2;
  c.activation = act;
  return c;
}

#define EXPECT_HAS(msg, word) EXPECT_NE((msg).find(word), std::string::npos) << "missing '" << (word) << "' in: " << (msg)

void expect_same(const MoeWeights& a, const MoeWeights& b) {
  EXPECT_EQ(a.hidden, b.hidden);
  EXPECT_EQ(a.ffn, b.ffn);
  EXPECT_EQ(a.experts, b.experts);
  EXPECT_EQ(a.first_expert, b.first_expert);
  EXPECT_EQ(a.num_experts, b.num_experts);
  EXPECT_EQ(a.activation, b.activation);
  EXPECT_EQ(a.gate, b.gate);
  EXPECT_EQ(a.w1, b.w1);
  EXPECT_EQ(a.w3, b.w3);
  EXPECT_EQ(a.w2, b.w2);
}

SafetensorsFile saved(const MoeWeights& w, const std::string& prefix, DType stored_as = DType::f32) {
  SafetensorsWriter writer;
  save_moe_weights(writer, w, prefix, stored_as);
  return SafetensorsFile::parse(writer.serialize(), "layer.safetensors");
}

// A copy of file without the tensor `skip` (raw bytes copied, dtype kept).
SafetensorsFile without(const SafetensorsFile& file, const std::string& skip) {
  SafetensorsWriter writer;
  for (const std::string& name : file.names()) {
    if (name == skip) continue;
    const TensorInfo& t = file.info(name);
    EXPECT_TRUE(t.dtype == "F32" || t.dtype == "BF16");
    writer.add(name, t.dtype == "F32" ? DType::f32 : DType::bf16, t.shape, file.raw(name).data());
  }
  return SafetensorsFile::parse(writer.serialize(), "layer.safetensors");
}

TEST(CheckpointTest, Names) {
  EXPECT_EQ(layer_prefix(7), "model.layers.7.block_sparse_moe.");
  EXPECT_EQ(gate_name(layer_prefix(0)), "model.layers.0.block_sparse_moe.gate.weight");
  EXPECT_EQ(expert_weight_name(layer_prefix(0), 3, "w2"), "model.layers.0.block_sparse_moe.experts.3.w2.weight");
}

TEST(CheckpointTest, RoundTripSwiglu) {
  const MoeConfig c = small_config(Activation::swiglu);
  const MoeWeights w = random_moe_weights(c, 1);
  SafetensorsWriter writer;
  save_moe_weights(writer, w, layer_prefix(0));
  const std::string path = (std::filesystem::temp_directory_path() /
                            fmt::format("dmoe_checkpoint_rt_{}.safetensors", getpid())).string();
  writer.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  std::filesystem::remove(path);

  EXPECT_EQ(file.size(), 1u + 3u * 4u);
  EXPECT_EQ(file.info("model.layers.0.block_sparse_moe.gate.weight").shape, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(file.info("model.layers.0.block_sparse_moe.experts.2.w1.weight").shape, (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(file.info("model.layers.0.block_sparse_moe.experts.2.w3.weight").shape, (std::vector<int64_t>{6, 8}));
  EXPECT_EQ(file.info("model.layers.0.block_sparse_moe.experts.2.w2.weight").shape, (std::vector<int64_t>{8, 6}));
  EXPECT_EQ(find_moe_prefix(file), layer_prefix(0));
  expect_same(load_moe_weights(file, c, layer_prefix(0)), w);
}

TEST(CheckpointTest, RoundTripReluHasNoW3) {
  const MoeConfig c = small_config(Activation::relu);
  const MoeWeights w = random_moe_weights(c, 2);
  ASSERT_TRUE(w.w3.empty());
  const SafetensorsFile file = saved(w, "block_sparse_moe.");
  EXPECT_EQ(file.size(), 1u + 2u * 4u);
  for (const std::string& name : file.names()) EXPECT_EQ(name.find("w3"), std::string::npos) << name;
  EXPECT_EQ(find_moe_prefix(file), "block_sparse_moe.");
  expect_same(load_moe_weights(file, c, "block_sparse_moe."), w);

  // A relu config must not silently load SwiGLU experts (their w3 would be dropped).
  const SafetensorsFile swiglu = saved(random_moe_weights(small_config(Activation::swiglu), 3), "");
  const std::string msg = error_of([&] { load_moe_weights(swiglu, c, ""); });
  EXPECT_HAS(msg, "'experts.0.w3.weight' is present");
  EXPECT_HAS(msg, "relu");
}

TEST(CheckpointTest, Bf16Storage) {
  const MoeConfig c = small_config(Activation::swiglu);
  const MoeWeights w = random_moe_weights(c, 4);  // f32 values, most not representable in bf16
  const SafetensorsFile file = saved(w, layer_prefix(0), DType::bf16);
  EXPECT_EQ(file.info(gate_name(layer_prefix(0))).dtype, "BF16");
  const MoeWeights r = load_moe_weights(file, c, layer_prefix(0));
  MoeWeights expected = w;
  for (auto* v : {&expected.gate, &expected.w1, &expected.w3, &expected.w2})
    for (float& x : *v) x = round_to_bf16(x);
  expect_same(r, expected);

  // Weights that are already bf16 values survive bf16 storage exactly.
  MoeConfig cb = c;
  cb.dtype = DType::bf16;
  const MoeWeights wb = random_moe_weights(cb, 5);
  expect_same(load_moe_weights(saved(wb, "", DType::bf16), cb, ""), wb);
  EXPECT_EQ(infer_moe_config(saved(wb, "", DType::bf16), "").dtype, DType::bf16);
}

TEST(CheckpointTest, LoadAndSaveSlicesOfExperts) {
  const MoeConfig c = small_config(Activation::swiglu);
  const MoeWeights w = random_moe_weights(c, 6);
  const SafetensorsFile file = saved(w, layer_prefix(0));
  expect_same(load_moe_weights(file, c, layer_prefix(0), 1, 2), slice_experts(w, 1, 2));
  expect_same(load_moe_weights(file, c, layer_prefix(0), 3, 1), slice_experts(w, 3, 1));
  const MoeWeights none = load_moe_weights(file, c, layer_prefix(0), 2, 0);
  EXPECT_EQ(none.gate, w.gate);
  EXPECT_TRUE(none.w1.empty());

  // A rank's share is saved under its global expert indices.
  const SafetensorsFile part = saved(slice_experts(w, 2, 2), layer_prefix(0));
  EXPECT_TRUE(part.has(expert_weight_name(layer_prefix(0), 2, "w1")));
  EXPECT_TRUE(part.has(expert_weight_name(layer_prefix(0), 3, "w2")));
  EXPECT_FALSE(part.has(expert_weight_name(layer_prefix(0), 0, "w1")));
  expect_same(load_moe_weights(part, c, layer_prefix(0), 2, 2), slice_experts(w, 2, 2));
  std::string msg = error_of([&] { load_moe_weights(part, c, layer_prefix(0)); });
  EXPECT_HAS(msg, "expert 0 tensor 'model.layers.0.block_sparse_moe.experts.0.w1.weight' is missing");

  msg = error_of([&] { load_moe_weights(file, c, layer_prefix(0), 3, 2); });
  EXPECT_HAS(msg, "experts [3, 5) are outside [0, 4)");
}

TEST(CheckpointTest, PrefixAutoDetectionAndLayerSelection) {
  const MoeConfig c = small_config(Activation::swiglu);
  SafetensorsWriter writer;
  save_moe_weights(writer, random_moe_weights(c, 5), layer_prefix(5));
  save_moe_weights(writer, random_moe_weights(c, 3), layer_prefix(3));
  save_moe_weights(writer, random_moe_weights(c, 10), layer_prefix(10));  // "10" sorts before "3" as text
  writer.add_f32("model.layers.0.self_attn.q_proj.weight", {2, 2}, std::vector<float>(4, 0.f));
  writer.add_f32("model.layers.007.block_sparse_moe.gate.weight", {1}, std::vector<float>(1, 0.f));
  const SafetensorsFile file = SafetensorsFile::parse(writer.serialize(), "model.safetensors");

  EXPECT_EQ(find_moe_prefix(file), "model.layers.3.block_sparse_moe.");
  EXPECT_EQ(find_moe_prefix(file, 5), "model.layers.5.block_sparse_moe.");
  expect_same(load_moe_weights(file, c, find_moe_prefix(file, 5)), random_moe_weights(c, 5));
  const std::string msg = error_of([&] { find_moe_prefix(file, 0); });
  EXPECT_HAS(msg, "model.safetensors");
  EXPECT_HAS(msg, "layer 0 has no MoE gate 'model.layers.0.block_sparse_moe.gate.weight'");
  EXPECT_HAS(msg, "layers with an MoE gate: 3, 5, 10");
}

TEST(CheckpointTest, PrefixFallbacksAndNothingFound) {
  const MoeWeights w = random_moe_weights(small_config(Activation::relu), 7);
  EXPECT_EQ(find_moe_prefix(saved(w, "block_sparse_moe.")), "block_sparse_moe.");
  EXPECT_EQ(find_moe_prefix(saved(w, "")), "");

  SafetensorsWriter other;
  other.add_f32("lm_head.weight", {2}, std::vector<float>(2, 0.f));
  add_moe_grads(other, w, layer_prefix(0));  // gradients are not weights
  const SafetensorsFile file = SafetensorsFile::parse(other.serialize(), "nomoe.safetensors");
  std::string msg = error_of([&] { find_moe_prefix(file); });
  EXPECT_HAS(msg, "nomoe.safetensors");
  EXPECT_HAS(msg, "model.layers.{L}.block_sparse_moe.gate.weight");
  EXPECT_HAS(msg, "'gate.weight'");
  msg = error_of([&] { find_moe_prefix(file, 2); });
  EXPECT_HAS(msg, "layers with an MoE gate: none");
}

TEST(CheckpointTest, MissingTensorAndWrongShapeErrors) {
  const MoeConfig c = small_config(Activation::swiglu);
  const std::string p = layer_prefix(0);
  const SafetensorsFile file = saved(random_moe_weights(c, 8), p);

  std::string msg = error_of([&] { load_moe_weights(without(file, expert_weight_name(p, 2, "w3")), c, p); });
  EXPECT_HAS(msg, "expert 2 tensor 'model.layers.0.block_sparse_moe.experts.2.w3.weight' is missing");
  EXPECT_HAS(msg, "w1, w3, w2");
  msg = error_of([&] { load_moe_weights(without(file, gate_name(p)), c, p); });
  EXPECT_HAS(msg, "gate tensor 'model.layers.0.block_sparse_moe.gate.weight' is missing");
  msg = error_of([&] { load_moe_weights(file, c, "model.layers.1.block_sparse_moe."); });
  EXPECT_HAS(msg, "model.layers.1.block_sparse_moe.gate.weight");

  MoeConfig wide = c;
  wide.ffn = 7;
  msg = error_of([&] { load_moe_weights(file, wide, p); });
  EXPECT_HAS(msg, "'model.layers.0.block_sparse_moe.experts.0.w1.weight' has shape [6, 8], expected [7, 8]");
  MoeConfig more = c;
  more.experts = 8;
  msg = error_of([&] { load_moe_weights(file, more, p); });
  EXPECT_HAS(msg, "'model.layers.0.block_sparse_moe.gate.weight' has shape [4, 8], expected [8, 8]");

  MoeWeights broken = random_moe_weights(c, 9);
  broken.w2.pop_back();
  SafetensorsWriter writer;
  msg = error_of([&] { save_moe_weights(writer, broken, p); });
  EXPECT_HAS(msg, "inconsistent sizes");
}

TEST(CheckpointTest, GradientsUseGradPrefixedNames) {
  const MoeConfig c = small_config(Activation::swiglu);
  const MoeWeights w = random_moe_weights(c, 10), g = random_moe_weights(c, 11);
  SafetensorsWriter writer;
  save_moe_weights(writer, w, layer_prefix(0));
  add_moe_grads(writer, slice_experts(g, 2, 2), layer_prefix(0));
  const SafetensorsFile file = SafetensorsFile::parse(writer.serialize(), "grads.safetensors");
  EXPECT_TRUE(file.has("grad.model.layers.0.block_sparse_moe.experts.3.w1.weight"));
  EXPECT_TRUE(file.has("grad.model.layers.0.block_sparse_moe.gate.weight"));
  EXPECT_FALSE(file.has("grad.model.layers.0.block_sparse_moe.experts.1.w1.weight"));
  EXPECT_EQ(find_moe_prefix(file), layer_prefix(0));
  expect_same(load_moe_weights(file, c, "grad." + layer_prefix(0), 2, 2), slice_experts(g, 2, 2));
  expect_same(load_moe_weights(file, c, layer_prefix(0)), w);
}

TEST(CheckpointTest, InferConfigFromWeights) {
  const MoeConfig c = small_config(Activation::swiglu);
  const MoeConfig inferred = infer_moe_config(saved(random_moe_weights(c, 12), layer_prefix(0)), layer_prefix(0));
  EXPECT_EQ(inferred.hidden, 8);
  EXPECT_EQ(inferred.ffn, 6);
  EXPECT_EQ(inferred.experts, 4);
  EXPECT_EQ(inferred.activation, Activation::swiglu);
  EXPECT_EQ(inferred.dtype, DType::f32);
  EXPECT_EQ(inferred.top_k, 0);
  const MoeConfig relu = infer_moe_config(saved(random_moe_weights(small_config(Activation::relu), 13), ""), "");
  EXPECT_EQ(relu.activation, Activation::relu);
}

TEST(CheckpointTest, NonFiniteWeightsAreRefusedNamingTheTensorAndIndex) {
  const MoeConfig c = small_config(Activation::swiglu);
  MoeWeights w = random_moe_weights(c, 3);
  w.w3[2 * c.ffn * c.hidden + 1 * c.hidden + 5] = std::nanf("");  // expert 2's w3 [1, 5]
  std::string msg = error_of([&] { load_moe_weights(saved(w, ""), c, ""); });
  EXPECT_HAS(msg, "tensor 'experts.2.w3.weight' [1, 5] is nan");
  EXPECT_HAS(msg, "weights must be finite");
  w = random_moe_weights(c, 3);
  w.gate[3 * c.hidden + 7] = -INFINITY;
  msg = error_of([&] { load_moe_weights(saved(w, "", DType::bf16), c, ""); });
  EXPECT_HAS(msg, "tensor 'gate.weight' [3, 7] is -inf");
}

}  // namespace
}  // namespace dmoe
