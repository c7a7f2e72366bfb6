// checkpoint.cpp — MoE layer weights <-> safetensors under Mixtral names (see checkpoint.hpp).
#include "model/checkpoint.hpp"

#include <cmath>
#include <cstdint>
#include <set>

#include "core/error.hpp"

namespace dmoe {
namespace {

constexpr const char* kLayersPrefix = "model.layers.";
constexpr const char* kMoeGateSuffix = ".block_sparse_moe.gate.weight";

// Layers L for which "model.layers.{L}.block_sparse_moe.gate.weight" exists, ascending.
std::set<int> moe_layers(const SafetensorsFile& file) {
  const std::string head = kLayersPrefix, tail = kMoeGateSuffix;
  std::set<int> layers;
  for (const std::string& name : file.names()) {
    if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
        name.compare(name.size() - tail.size(), tail.size(), tail) != 0)
      continue;
    const std::string digits = name.substr(head.size(), name.size() - head.size() - tail.size());
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const int layer = std::stoi(digits);
    if (file.has(layer_prefix(layer) + "gate.weight")) layers.insert(layer);  // rejects "007" spellings
  }
  return layers;
}

std::string join(const std::set<int>& values) {
  std::string s;
  for (int v : values) s += fmt::format("{}{}", s.empty() ? "" : ", ", v);
  return s;
}

// Checks the stacked arrays of w against its own dimensions before they are written out.
void check_sizes(const MoeWeights& w, const char* what) {
  const size_t matrix = size_t(w.ffn * w.hidden);
  const size_t stacked = size_t(w.num_experts) * matrix;
  const bool swiglu = w.activation == Activation::swiglu;
  DMOE_REQUIRE(w.gate.size() == size_t(w.experts * w.hidden) && w.w1.size() == stacked &&
                   w.w2.size() == stacked && w.w3.size() == (swiglu ? stacked : 0),
               "checkpoint: {} have inconsistent sizes for E={} H={} I={} Ne={} {}: gate {}, w1 {}, w3 {}, w2 {}",
               what, w.experts, w.hidden, w.ffn, w.num_experts, activation_name(w.activation), w.gate.size(),
               w.w1.size(), w.w3.size(), w.w2.size());
}

void add_layer(SafetensorsWriter& writer, const MoeWeights& w, const std::string& prefix, DType stored_as,
               const char* what) {
  check_sizes(w, what);
  const int64_t matrix = w.ffn * w.hidden;
  writer.add_f32(gate_name(prefix), {w.experts, w.hidden}, w.gate.data(), stored_as);
  for (int32_t local = 0; local < w.num_experts; ++local) {
    const int32_t e = w.first_expert + local;
    writer.add_f32(expert_weight_name(prefix, e, "w1"), {w.ffn, w.hidden}, w.w1.data() + local * matrix,
                   stored_as);
    if (!w.w3.empty())
      writer.add_f32(expert_weight_name(prefix, e, "w3"), {w.ffn, w.hidden}, w.w3.data() + local * matrix,
                     stored_as);
    writer.add_f32(expert_weight_name(prefix, e, "w2"), {w.hidden, w.ffn}, w.w2.data() + local * matrix,
                   stored_as);
  }
}

// A NaN or Inf weight would turn every row routed through it into NaN with no error; refuse it on load,
// naming the tensor and the first bad element. rows x cols floats at `values`.
void require_finite(const SafetensorsFile& file, const std::string& name, const float* values, int64_t rows,
                    int64_t cols) {
  for (int64_t i = 0; i < rows * cols; ++i)
    DMOE_REQUIRE_INPUT(std::isfinite(values[i]), "checkpoint '{}': tensor '{}' [{}, {}] is {}; weights must be finite",
                       file.source(), name, i / cols, i % cols, values[i]);
}

// "layers with an MoE gate: 0, 3" or what else was found, for errors about a missing gate.
std::string moe_layers_present(const SafetensorsFile& file) {
  const std::set<int> layers = moe_layers(file);
  if (!layers.empty()) return "layers with an MoE gate: " + join(layers);
  if (file.has("block_sparse_moe.gate.weight")) return "the file has 'block_sparse_moe.gate.weight'";
  if (file.has("gate.weight")) return "the file has a bare 'gate.weight' (prefix '')";
  return fmt::format("no MoE gate among its {} tensors", file.size());
}

}  // namespace

std::string layer_prefix(int layer) { return fmt::format("{}{}.block_sparse_moe.", kLayersPrefix, layer); }

std::string gate_name(const std::string& prefix) { return prefix + "gate.weight"; }

std::string expert_weight_name(const std::string& prefix, int32_t expert, const char* matrix) {
  return fmt::format("{}experts.{}.{}.weight", prefix, expert, matrix);
}

std::string find_moe_prefix(const SafetensorsFile& file, std::optional<int> layer) {
  if (layer) {
    const std::string prefix = layer_prefix(*layer);
    if (file.has(gate_name(prefix))) return prefix;
    const std::set<int> layers = moe_layers(file);
    DMOE_FAIL_INPUT("checkpoint '{}': layer {} has no MoE gate '{}'; layers with an MoE gate: {}", file.source(),
                    *layer, gate_name(prefix), layers.empty() ? std::string("none") : join(layers));
  }
  const std::set<int> layers = moe_layers(file);
  if (!layers.empty()) return layer_prefix(*layers.begin());
  if (file.has("block_sparse_moe.gate.weight")) return "block_sparse_moe.";
  if (file.has("gate.weight")) return "";
  DMOE_FAIL_INPUT("checkpoint '{}': no MoE layer found; looked for 'model.layers.{{L}}.block_sparse_moe.gate.weight', "
                  "'block_sparse_moe.gate.weight' and 'gate.weight' among its {} tensors",
                  file.source(), file.size());
}

MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix,
                            int32_t first_expert, int32_t num_experts) {
  MoeWeights w = make_moe_weights(config, first_expert, num_experts);
  const int64_t h = config.hidden, i = config.ffn, matrix = h * i;
  const bool swiglu = config.activation == Activation::swiglu;

  const std::string gate = gate_name(prefix);
  DMOE_REQUIRE_INPUT(file.has(gate), "checkpoint '{}': gate tensor '{}' is missing (check --prefix / --layer; {})",
                     file.source(), gate, moe_layers_present(file));
  file.read_f32_into(gate, {config.experts, h}, w.gate.data());
  require_finite(file, gate, w.gate.data(), config.experts, h);

  // A missing matrix is named with its expert; w3 in a non-SwiGLU load means the config does not match.
  auto load_matrix = [&](int32_t e, const char* matrix_name, std::vector<int64_t> shape, float* out) {
    const std::string name = expert_weight_name(prefix, e, matrix_name);
    DMOE_REQUIRE_INPUT(file.has(name), "checkpoint '{}': expert {} tensor '{}' is missing ({} experts need {})",
                       file.source(), e, name, activation_name(config.activation), swiglu ? "w1, w3, w2" : "w1, w2");
    file.read_f32_into(name, shape, out);
    require_finite(file, name, out, shape[0], shape[1]);
  };
  for (int32_t local = 0; local < num_experts; ++local) {
    const int32_t e = first_expert + local;
    load_matrix(e, "w1", {i, h}, w.w1.data() + local * matrix);
    if (swiglu) {
      load_matrix(e, "w3", {i, h}, w.w3.data() + local * matrix);
    } else {
      DMOE_REQUIRE_INPUT(!file.has(expert_weight_name(prefix, e, "w3")),
                         "checkpoint '{}': '{}' is present but the config's activation is {}; a file with w3 holds "
                         "SwiGLU experts (set activation swiglu)",
                         file.source(), expert_weight_name(prefix, e, "w3"), activation_name(config.activation));
    }
    load_matrix(e, "w2", {h, i}, w.w2.data() + local * matrix);
  }
  return w;
}

MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix) {
  return load_moe_weights(file, config, prefix, 0, config.experts);
}

void save_moe_weights(SafetensorsWriter& writer, const MoeWeights& weights, const std::string& prefix,
                      DType stored_as) {
  add_layer(writer, weights, prefix, stored_as, "weights");
}

void add_moe_grads(SafetensorsWriter& writer, const MoeWeights& grads, const std::string& prefix,
                   DType stored_as) {
  add_layer(writer, grads, "grad." + prefix, stored_as, "gradients");
}

MoeConfig infer_moe_config(const SafetensorsFile& file, const std::string& prefix) {
  const std::string gate = gate_name(prefix);
  DMOE_REQUIRE_INPUT(file.has(gate), "checkpoint '{}': cannot infer the config: gate tensor '{}' is missing (check "
                     "--prefix / --layer; {})", file.source(), gate, moe_layers_present(file));
  const TensorInfo& g = file.info(gate);
  DMOE_REQUIRE_INPUT(g.shape.size() == 2 && g.shape[0] >= 1 && g.shape[0] <= INT32_MAX,
                     "checkpoint '{}': gate '{}' has shape {}, expected [experts, hidden]", file.source(), gate,
                     shape_string(g.shape));
  const std::string w1 = expert_weight_name(prefix, 0, "w1");
  DMOE_REQUIRE_INPUT(file.has(w1), "checkpoint '{}': cannot infer the FFN width: '{}' is missing", file.source(), w1);
  const TensorInfo& up = file.info(w1);
  DMOE_REQUIRE_INPUT(up.shape.size() == 2 && up.shape[1] == g.shape[1],
               "checkpoint '{}': '{}' has shape {}, expected [ffn, {}]", file.source(), w1, shape_string(up.shape),
                     g.shape[1]);
  MoeConfig c;
  c.experts = int32_t(g.shape[0]);
  c.hidden = g.shape[1];
  c.ffn = up.shape[0];
  c.activation = file.has(expert_weight_name(prefix, 0, "w3")) ? Activation::swiglu : Activation::relu;
  c.dtype = g.dtype == "BF16" ? DType::bf16 : DType::f32;
  return c;
}

}  // namespace dmoe
