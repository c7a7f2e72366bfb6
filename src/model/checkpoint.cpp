// checkpoint.cpp — MoE layer weights <-> safetensors under Mixtral names (see checkpoint.hpp).
#include "model/checkpoint.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/output_file.hpp"
#include "model/config_io.hpp"

namespace dmoe {

namespace {

constexpr const char* kShardSaveId = "dmoe_save_id";

std::string random_save_id() {
  std::random_device device;
  const uint64_t time = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", (uint64_t(device()) << 32 ^ uint64_t(device())) ^ (time * 0x9E3779B97F4A7C15ull));
}

}  // namespace

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

// The index in `name` right after `head` and before a '.', as in "model.layers.{N}." or "experts.{N}."; -1 when the
// name does not start so (or the index is no plain decimal number).
int64_t index_after(const std::string& name, const std::string& head) {
  if (name.size() <= head.size() || name.compare(0, head.size(), head) != 0) return -1;
  const size_t dot = name.find('.', head.size());
  if (dot == std::string::npos) return -1;
  const std::string digits = name.substr(head.size(), dot - head.size());
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

// A tensor of an expert the config does not have (experts.{E} with E >= experts) means the file holds another
// layer than the config describes; it was ignored, so the layer ran with the config's experts only, rc 0.
void require_no_expert_beyond(const std::vector<std::string>& names, const std::string& source,
                              const std::string& prefix, int64_t experts, const char* config_key) {
  for (const std::string& name : names) {
    const int64_t e = index_after(name, prefix + "experts.");
    DMOE_REQUIRE_INPUT(e < experts, "checkpoint '{}': tensor '{}' is of expert {}, but the config has {} = {} "
                       "(experts 0..{}): the file's experts do not match the config (a layer's experts must match its "
                       "gate's rows); give a file of experts 0..{} only, or the config of the file's layer", source,
                       name, e, config_key, experts, experts - 1, experts - 1);
  }
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

// A tensor of the layer that the load does not read (a gate.bias, an expert's bias, the same layer's experts in the
// transformers 5.x fused layout) was ignored: run gave the same y as without it, rc 0 (G20-4 of the twentieth pass).
// Within the layer's names (under `prefix`; for the bare prefix "" the gate.* and experts.* names) only the gate's
// weight and the experts' w1, w2 (and w3 for SwiGLU) weights may be; other layers' tensors, and the rest of a whole
// model's, stay allowed (run --weights of a model file with --layer L).
void require_no_unread_layer_tensors(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix) {
  const std::string gate = gate_name(prefix), experts = prefix + "experts.";
  const bool swiglu = config.activation == Activation::swiglu;
  static const std::regex expert(R"(([0-9]+)\.(w1|w2|w3)\.weight)");
  static const std::regex mixtral_layer(R"(model\.layers\.([0-9]+)\.block_sparse_moe\.)");
  std::smatch layer;
  const std::string fused_head =
      std::regex_match(prefix, layer, mixtral_layer) ? fmt::format("model.layers.{}.mlp.", layer[1].str()) : "";
  for (const std::string& name : file.names()) {
    if (!fused_head.empty() && name.compare(0, fused_head.size(), fused_head) == 0 &&
        (name == fused_head + "gate.weight" || name.compare(fused_head.size(), 8, "experts.") == 0))
      DMOE_FAIL_INPUT("checkpoint '{}': the layer under '{}' also has '{}', its experts in the transformers 5.x fused "
                      "layout, which run would ignore (two versions of the same layer); run reads the Mixtral layout "
                      "({}{{E}}.w1.weight ...): keep one layout", file.source(), prefix, name, experts);
    const bool in_layer = prefix.empty() ? name.compare(0, 5, "gate.") == 0 || name.compare(0, 8, "experts.") == 0
                                         : name.compare(0, prefix.size(), prefix) == 0;
    if (!in_layer || name == gate) continue;
    std::smatch m;
    if (name.compare(0, experts.size(), experts) == 0) {
      const std::string rest = name.substr(experts.size());
      if (std::regex_match(rest, m, expert)) continue;  // a w3 of non-SwiGLU experts is named by the load below
    }
    DMOE_FAIL_INPUT("checkpoint '{}': tensor '{}' is in the MoE layer under '{}' but is not one of its parameters{}, so "
                    "run would ignore it and compute another layer than the file's; the layer is the gate's '{}' and "
                    "each expert's {} weights, without biases: remove it from the file", file.source(), name, prefix,
                    name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0 ? " (the layer has no biases)"
                                                                                       : std::string(),
                    gate, swiglu ? "w1, w3 and w2" : "w1 and w2");
  }
}

// The layers whose MoE the file holds in the transformers 5.x fused layout (model.layers.L.mlp.gate.weight beside
// mlp.experts.gate_up_proj), which eval and train --init read (load_fused_moe) but run does not.
std::set<int> fused_moe_layers(const SafetensorsFile& file) {
  static const std::regex fused_gate(R"(model\.layers\.(0|[1-9][0-9]{0,8})\.mlp\.gate\.weight)");
  std::set<int> layers;
  std::smatch m;
  for (const std::string& name : file.names())
    if (std::regex_match(name, m, fused_gate) &&
        file.has(fmt::format("model.layers.{}.mlp.experts.gate_up_proj", m[1].str())))
      layers.insert(std::stoi(m[1].str()));
  return layers;
}

// G21-8 (twenty-first pass): run --layer 1 on a fused 5.x file said "layers with an MoE gate: none", although eval
// reads the file: the fused layers are named, with the commands that read them.
std::string fused_layers_note(const SafetensorsFile& file) {
  const std::set<int> fused = fused_moe_layers(file);
  if (fused.empty()) return "";
  return fmt::format("; the file holds the MoE of layers {} in the transformers 5.x fused layout "
                     "(model.layers.L.mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj), which run "
                     "does not read (it reads the Mixtral layout, model.layers.L.block_sparse_moe.*): eval and train "
                     "--init read such a whole model, or save the model in the Mixtral layout (transformers' "
                     "save_pretrained with save_original_format=True)", join(fused));
}

// "layers with an MoE gate: 0, 3" or what else was found, for errors about a missing gate.
std::string moe_layers_present(const SafetensorsFile& file) {
  const std::set<int> layers = moe_layers(file);
  if (!layers.empty()) return "layers with an MoE gate: " + join(layers) + fused_layers_note(file);
  if (!fused_moe_layers(file).empty()) return "no layer with a Mixtral MoE gate" + fused_layers_note(file);
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
    DMOE_FAIL_INPUT("checkpoint '{}': layer {} has no MoE gate '{}'; layers with an MoE gate: {}{}", file.source(),
                    *layer, gate_name(prefix), layers.empty() ? std::string("none") : join(layers),
                    fused_layers_note(file));
  }
  const std::set<int> layers = moe_layers(file);
  if (!layers.empty()) return layer_prefix(*layers.begin());
  if (file.has("block_sparse_moe.gate.weight")) return "block_sparse_moe.";
  if (file.has("gate.weight")) return "";
  // A layer written under another prefix (init --prefix P): the error listed the names looked for but not the gate that
  // is there, nor the option that reads it.
  std::string others;
  for (const std::string& name : file.names())
    if (name.size() > 11 && name.compare(name.size() - 11, 11, "gate.weight") == 0 &&
        name.find(".experts.") == std::string::npos)
      others += fmt::format("{}--prefix '{}'", others.empty() ? "" : ", ", name.substr(0, name.size() - 11));
  const std::string fused = fused_layers_note(file);
  DMOE_FAIL_INPUT("checkpoint '{}': no MoE layer found; looked for 'model.layers.{{L}}.block_sparse_moe.gate.weight', "
                  "'block_sparse_moe.gate.weight' and 'gate.weight' among its {} tensors{}",
                  file.source(), file.size(),
                  !fused.empty() ? fused
                  : others.empty() ? std::string()
                                   : fmt::format("; the file has a gate under another prefix: give {}", others));
}

MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix,
                            int32_t first_expert, int32_t num_experts) {
  MoeWeights w = make_moe_weights(config, first_expert, num_experts);
  const int64_t h = config.hidden, i = config.ffn, matrix = h * i;
  const bool swiglu = config.activation == Activation::swiglu;

  const std::string gate = gate_name(prefix);
  DMOE_REQUIRE_INPUT(file.has(gate), "checkpoint '{}': gate tensor '{}' is missing (check --prefix / --layer; {})",
                     file.source(), gate, moe_layers_present(file));
  require_no_expert_beyond(file.names(), file.source(), prefix, config.experts, "experts");
  require_no_unread_layer_tensors(file, config, prefix);
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

// ---- whole models -----------------------------------------------------------------------------------

namespace {

// The file CheckpointReader::open reads first: a model directory's index.json, else its model.safetensors. A
// directory holding both is two models (e.g. init-model wrote one of each into it): the index was read without a word,
// where transformers' from_pretrained reads model.safetensors first, so the two gave different models for one path.
std::string checkpoint_entry_file(const std::string& path_or_dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path_or_dir, ec)) return path_or_dir;
  const std::filesystem::path dir(path_or_dir);
  const std::filesystem::path index = dir / "model.safetensors.index.json", single = dir / "model.safetensors";
  const bool has_index = std::filesystem::exists(std::filesystem::symlink_status(index, ec)),
             has_single = std::filesystem::exists(std::filesystem::symlink_status(single, ec));
  DMOE_REQUIRE_INPUT(!(has_index && has_single), "model directory '{}' holds both model.safetensors and "
                     "model.safetensors.index.json, two models: which one is meant is a guess (transformers reads "
                     "model.safetensors, the index's shards are another model); name the file to read ('{}' or '{}'), "
                     "or remove the one that is stale", path_or_dir, single.string(), index.string());
  // Neither: the error was the missing model.safetensors alone ("not a readable regular file"), as if that were the
  // only thing a model directory may hold (an index of another name beside its shards was not mentioned).
  DMOE_REQUIRE_INPUT(has_index || has_single, "model directory '{}' holds neither model.safetensors nor "
                     "model.safetensors.index.json, the files a model directory is read from; name the model's file "
                     "(a .safetensors file, or an index ending in .json)", path_or_dir);
  return has_index ? index.string() : single.string();
}

// A weight_map entry must name a file beside the index (no directories above it, no absolute paths).
bool is_shard_name(const std::string& f) {
  return !f.empty() && std::filesystem::path(f).is_relative() && f.find("..") == std::string::npos;
}

}  // namespace

CheckpointReader CheckpointReader::open(const std::string& path_or_dir) {
  const std::string path = checkpoint_entry_file(path_or_dir);
  CheckpointReader r;
  r.source_ = path;
  const std::filesystem::path p(path);
  r.directory_ = p.has_parent_path() ? p.parent_path().string() : ".";
  if (p.extension() != ".json") {
    r.files_[""] = std::make_shared<SafetensorsFile>(SafetensorsFile::open(path));
    return r;
  }
  // read_json_file: a duplicate tensor in the weight_map is an error (nlohmann kept the last one, so which shard was
  // read was a guess), and so is an index that is a directory (it read as empty JSON).
  const nlohmann::json j = read_json_file(path, "checkpoint index");
  DMOE_REQUIRE_INPUT(j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object(),
               "checkpoint index '{}': expected an object with \"weight_map\": {{tensor name: shard file}}", path);
  std::map<std::string, std::string> shard_of_file;  // a shard's normalised name -> the name it is read under
  const std::filesystem::path shard_dir(r.directory_);
  for (const auto& [name, file] : j.at("weight_map").items()) {
    DMOE_REQUIRE_INPUT(file.is_string(), "checkpoint index '{}': weight_map['{}'] must be a file name (found {})", path,
                 name, file.type_name());
    const std::string given = file.get<std::string>();
    DMOE_REQUIRE_INPUT(is_shard_name(given),
                 "checkpoint index '{}': weight_map['{}'] = '{}' must be a file name beside the index", path, name,
                 given);
    // G23A-6: one shard spelt two ways ('./m-00001…' and 'm-00001…', or a link to it) was read as two shards, and
    // each tensor of it reported "present twice … remove it from './m-00001…'", which deleted its only copy. Shards
    // are keyed by the file they name: the name lexically normalised, and a name that is another one's file (a link,
    // a hard link) taken as that one.
    std::string f = std::filesystem::path(given).lexically_normal().string();
    if (!shard_of_file.count(f)) {
      std::string same = f;
      for (const auto& [known, rep] : shard_of_file) {
        std::error_code eq;
        if (std::filesystem::equivalent(shard_dir / f, shard_dir / known, eq) && !eq) {
          same = rep;
          break;
        }
      }
      shard_of_file[f] = same;
    }
    f = shard_of_file[f];
    // The index itself, read as a shard, was reported as a second copy of the tensor its real shard holds (G22A-7);
    // compared by the file named (G23A-6: './INDEX' or a link to the index read it as a safetensors file, "header
    // length … is absurd").
    std::error_code self_ec;
    const bool self = f == p.filename().string() ||
                      (std::filesystem::equivalent(shard_dir / f, p, self_ec) && !self_ec);
    DMOE_REQUIRE_INPUT(!self, "checkpoint index '{}': weight_map['{}'] = '{}' names the index itself; it must name "
                       "the shard (a .safetensors file beside the index) that holds '{}'", path, name, given, name);
    r.weight_map_[name] = f;
  }
  DMOE_REQUIRE_INPUT(!r.weight_map_.empty(), "checkpoint index '{}': weight_map is empty", path);
  if (j.contains("metadata") && j.at("metadata").is_object() && j.at("metadata").contains(kShardSaveId)) {
    const nlohmann::json& id = j.at("metadata").at(kShardSaveId);
    DMOE_REQUIRE_INPUT(id.is_string() && !id.get<std::string>().empty(), "checkpoint index '{}': metadata.{} must be a "
                       "non-empty string (found {})", path, kShardSaveId, id.dump());
    r.save_id_ = id.get<std::string>();
  }
  return r;
}

std::vector<std::string> checkpoint_files(const std::string& path_or_dir) {
  const std::string path = checkpoint_entry_file(path_or_dir);
  std::vector<std::string> files{path};
  const std::filesystem::path p(path);
  if (p.extension() != ".json") return files;
  std::set<std::string> shards;
  try {
    const nlohmann::json j = read_json_file(path, "checkpoint index");
    if (j.is_object() && j.contains("weight_map") && j.at("weight_map").is_object())
      for (const auto& [name, file] : j.at("weight_map").items())
        if (file.is_string() && is_shard_name(file.get<std::string>()))  // one name per spelling (G23A-6)
          shards.insert(std::filesystem::path(file.get<std::string>()).lexically_normal().string());
  } catch (const Error&) {
    return files;  // CheckpointReader::open says what is wrong with the index
  }
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  for (const std::string& shard : shards) files.push_back((dir / shard).string());
  return files;
}

const SafetensorsFile& CheckpointReader::shard(const std::string& file_name) const {
  auto& file = files_[file_name];
  if (!file) {
    const std::string path = (std::filesystem::path(directory_) / file_name).string();
    file = std::make_shared<SafetensorsFile>(SafetensorsFile::open(path));
    if (!save_id_.empty()) {
      const auto meta = file->metadata();
      const auto id = meta.find(kShardSaveId);
      DMOE_REQUIRE_INPUT(id != meta.end() && id->second == save_id_, "checkpoint '{}': shard '{}' is of another save "
                         "than the index (its {} {}, the index's {}): the shards and the index were written by "
                         "different runs (one killed between its renames, or a shard copied in); write the model "
                         "again", source_, file_name, kShardSaveId, id == meta.end() ? "missing" : id->second,
                         save_id_);
    }
  }
  return *file;
}

const SafetensorsFile& CheckpointReader::file_of(const std::string& name) const {
  if (weight_map_.empty()) return *files_.at("");
  auto it = weight_map_.find(name);
  DMOE_REQUIRE_INPUT(it != weight_map_.end(), "checkpoint '{}': tensor '{}' is not in the weight_map", source_, name);
  const SafetensorsFile& file = shard(it->second);
  DMOE_REQUIRE_INPUT(file.has(name), "checkpoint '{}': the weight_map puts '{}' in '{}', which does not hold it", source_,
               name, it->second);
  return file;
}

// G21-3 (twenty-first pass): names() listed the weight_map's keys only, so a tensor a shard holds beside them (an
// lm_head.bias, a second lm_head.weight of other values) was never seen by the check that every tensor of the model
// is one dmoe reads, and was ignored with rc 0. Every shard is opened here and its tensors compared with the map.
void CheckpointReader::check_shards() const {
  if (weight_map_.empty() || shards_checked_) return;
  std::set<std::string> shard_names;
  for (const auto& [name, file] : weight_map_) shard_names.insert(file);
  for (const std::string& file_name : shard_names) {
    const SafetensorsFile& file = shard(file_name);
    for (const std::string& name : file.names()) {
      const auto it = weight_map_.find(name);
      DMOE_REQUIRE_INPUT(it != weight_map_.end(), "checkpoint '{}': shard '{}' holds tensor '{}', which the index's "
                         "weight_map does not name, so it would be ignored; every tensor of a shard must be named in "
                         "the weight_map with that shard (remove the tensor from the shard, or add it to the index)",
                         source_, file_name, name);
      // A map entry naming a shard that does not hold the tensor was reported as the tensor "present twice", with the
      // advice to remove it from the one shard that holds it (G22A-7 of the twenty-second pass): the entry is wrong.
      DMOE_REQUIRE_INPUT(it->second == file_name || shard(it->second).has(name), "checkpoint '{}': the index's "
                         "weight_map puts tensor '{}' in shard '{}', which does not hold it; it is in shard '{}': fix the "
                         "index's entry (\"{}\": \"{}\")", source_, name, it->second, file_name, name, file_name);
      DMOE_REQUIRE_INPUT(it->second == file_name, "checkpoint '{}': tensor '{}' is present twice, in shard '{}' and in "
                         "shard '{}' (where the index's weight_map puts it): two versions of one tensor, one of which "
                         "would be ignored; a tensor must be in exactly one shard (remove it from '{}')", source_, name,
                         file_name, it->second, file_name);
    }
  }
  for (const auto& [name, file] : weight_map_)
    DMOE_REQUIRE_INPUT(shard(file).has(name), "checkpoint '{}': the weight_map puts '{}' in '{}', which does not hold it",
                       source_, name, file);
  shards_checked_ = true;
}

std::map<std::string, std::string> CheckpointReader::metadata() const {
  if (weight_map_.empty()) return files_.at("")->metadata();
  return {};
}

bool CheckpointReader::has(const std::string& name) const {
  if (weight_map_.empty()) return files_.at("")->has(name);
  return weight_map_.count(name) != 0;
}

std::vector<std::string> CheckpointReader::names() const {
  if (weight_map_.empty()) return files_.at("")->names();
  check_shards();  // the shards hold exactly the weight_map's tensors, each once
  std::vector<std::string> v;
  for (const auto& [name, file] : weight_map_) v.push_back(name);
  return v;
}

std::string CheckpointReader::dtype(const std::string& name) const { return file_of(name).info(name).dtype; }

void CheckpointReader::read_f32_into(const std::string& name, const std::vector<int64_t>& shape, float* out) const {
  file_of(name).read_f32_into(name, shape, out);
}

namespace {

// transformers 5.x in memory (and in files saved with save_original_format=False): the router at
// model.layers.L.mlp.gate.weight and each layer's experts fused, mlp.experts.gate_up_proj [E, 2I, H] (rows
// [0, I) of expert e are its w1, [I, 2I) its w3) and mlp.experts.down_proj [E, H, I] (w2).
bool load_fused_moe(const CheckpointReader& reader, const MixtralConfig& c, int layer, MoeWeights& moe) {
  const std::string p = fmt::format("model.layers.{}.mlp.", layer);
  const int64_t E = c.num_local_experts, I = c.intermediate_size, H = c.hidden_size, m = I * H;
  // A layer with some of the fused tensors but not all was reported as missing the Mixtral layout's router
  // (block_sparse_moe.gate.weight), not the fused tensor it lacks (G22A-9 of the twenty-second pass).
  const std::pair<std::string, std::vector<int64_t>> fused[] = {
      {p + "gate.weight", {E, H}}, {p + "experts.gate_up_proj", {E, 2 * I, H}}, {p + "experts.down_proj", {E, H, I}}};
  std::string present, missing;
  for (const auto& [name, shape] : fused)
    if (reader.has(name))
      present += (present.empty() ? "" : ", ") + name;
    else
      missing += fmt::format("{}'{}' {}", missing.empty() ? "" : " and ", name, shape_string(shape));
  if (present.empty()) return false;  // neither layout's router: the Mixtral tensors are named as missing
  DMOE_REQUIRE_INPUT(missing.empty(), "checkpoint '{}': layer {} holds the transformers 5.x fused layout ({}) but lacks "
                     "{}; a fused layer holds all of mlp.gate.weight [E, H], mlp.experts.gate_up_proj [E, 2I, H] and "
                     "mlp.experts.down_proj [E, H, I] (or, in the Mixtral layout, block_sparse_moe.gate.weight and each "
                     "expert's w1/w3/w2)", reader.source(), layer, present, missing);
  reader.read_f32_into(p + "gate.weight", {E, H}, moe.gate.data());
  std::vector<float> gate_up(E * 2 * m), down(E * m);
  reader.read_f32_into(p + "experts.gate_up_proj", {E, 2 * I, H}, gate_up.data());
  reader.read_f32_into(p + "experts.down_proj", {E, H, I}, down.data());
  for (int32_t local = 0; local < moe.num_experts; ++local) {
    const int64_t e = moe.first_expert + local;
    std::copy(gate_up.begin() + e * 2 * m, gate_up.begin() + e * 2 * m + m, moe.w1.begin() + local * m);
    std::copy(gate_up.begin() + e * 2 * m + m, gate_up.begin() + (e + 1) * 2 * m, moe.w3.begin() + local * m);
    std::copy(down.begin() + e * m, down.begin() + (e + 1) * m, moe.w2.begin() + local * m);
  }
  return true;
}

// A tensor of the file that the load does not read was ignored without a word (G20-4 of the twentieth pass): an
// lm_head.bias of +-5, or the fused 5.x experts beside the per-expert ones, gave the same loss as without them, rc 0,
// and train --init saved the model without them. Every tensor must be one the model reads (any expert: the other
// ranks' are read by them), apart from the rotary inverse frequencies older transformers saved as buffers (dmoe
// computes them from rope_theta).
void require_no_unread_tensors(const CheckpointReader& reader, const MixtralConfig& config,
                               const std::vector<bool>& fused) {
  static const std::regex expert(R"(model\.layers\.([0-9]+)\.block_sparse_moe\.experts\.([0-9]+)\.w[123]\.weight)");
  static const std::regex fused_name(R"(model\.layers\.([0-9]+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj))");
  static const std::regex rotary(R"(model\.layers\.[0-9]+\.self_attn\.rotary_emb\.inv_freq)");
  std::set<std::string> read;
  for (int L = 0; L < config.num_hidden_layers; ++L) {  // every parameter but the experts' (the pattern above)
    read.insert(fmt::format("model.layers.{}.input_layernorm.weight", L));
    for (const char* m : {"q_proj", "k_proj", "v_proj", "o_proj"})
      read.insert(fmt::format("model.layers.{}.self_attn.{}.weight", L, m));
    read.insert(fmt::format("model.layers.{}.post_attention_layernorm.weight", L));
    if (!fused[size_t(L)]) read.insert(gate_name(layer_prefix(L)));
  }
  for (const char* name : {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}) read.insert(name);
  for (const std::string& name : reader.names()) {
    if (read.count(name) || std::regex_match(name, rotary)) continue;
    std::smatch m;
    if (std::regex_match(name, m, expert)) {
      const int64_t L = std::stoll(m[1].str());
      if (L < config.num_hidden_layers && !fused[size_t(L)]) continue;
      DMOE_FAIL_INPUT("checkpoint '{}': layer {} holds its experts in both layouts: the transformers 5.x fused tensors "
                      "(model.layers.{}.mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj), which are "
                      "read, and per-expert ones such as '{}', which would be ignored (the file has no "
                      "'{}'); keep one layout", reader.source(), L, L, name, gate_name(layer_prefix(int(L))));
    }
    if (std::regex_match(name, m, fused_name)) {
      const int64_t L = std::stoll(m[1].str());
      // Without the Mixtral gate either, the fused set is incomplete: load_fused_moe named the missing tensor.
      if (L < config.num_hidden_layers && (fused[size_t(L)] || !reader.has(gate_name(layer_prefix(int(L)))))) continue;
      DMOE_FAIL_INPUT("checkpoint '{}': layer {} holds its MoE in both layouts: the Mixtral tensors "
                      "model.layers.{}.block_sparse_moe.*, which are read, and the transformers 5.x fused '{}', which "
                      "would be ignored (two versions of the same experts and router); keep one layout",
                      reader.source(), L, L, name);
    }
    DMOE_FAIL_INPUT("checkpoint '{}': tensor '{}' is not a parameter of dmoe's Mixtral model{}, so it would be "
                    "ignored and another model than the file's would run; remove it from the file (dmoe reads the "
                    "embeddings, each layer's input_layernorm, q/k/v/o_proj, post_attention_layernorm, "
                    "block_sparse_moe gate and experts' w1/w3/w2 (or the fused mlp.experts), model.norm and "
                    "lm_head.weight, all without biases)", reader.source(), name,
                    name.size() > 5 && name.compare(name.size() - 5, 5, ".bias") == 0
                        ? " (its layers have no biases)" : std::string());
  }
}

}  // namespace

MixtralWeights load_mixtral_weights(const CheckpointReader& reader, const MixtralConfig& config,
                                    int32_t first_expert, int32_t num_experts) {
  MixtralWeights w = make_mixtral_weights(config, first_expert, num_experts);
  // Tensors of layers (or experts) past the config's were ignored: a config with num_hidden_layers 1 evaluated, or
  // trained from, the first layer of a 2-layer file with rc 0 — another model than the file's. transformers loads it
  // with a warning about unused weights; dmoe says so and stops, as for a tied config on an untied file.
  {
    const std::vector<std::string> names = reader.names();
    int64_t file_layers = 0;
    std::string first_beyond;
    for (const std::string& name : names) {
      const int64_t L = index_after(name, kLayersPrefix);
      if (L >= config.num_hidden_layers && first_beyond.empty()) first_beyond = name;
      file_layers = std::max(file_layers, L + 1);
    }
    DMOE_REQUIRE_INPUT(first_beyond.empty(), "checkpoint '{}': tensor '{}' is of layer {}, but the config has "
                       "num_hidden_layers = {}: the file holds a model of {} layers, which would run with its last "
                       "ones dropped; set num_hidden_layers to {} (or use a config.json of this model)",
                       reader.source(), first_beyond, index_after(first_beyond, kLayersPrefix),
                       config.num_hidden_layers, file_layers, file_layers);
    for (int L = 0; L < config.num_hidden_layers; ++L)
      require_no_expert_beyond(names, reader.source(), layer_prefix(L), config.num_local_experts, "num_local_experts");
  }
  std::vector<bool> fused(config.num_hidden_layers, false);
  for (int L = 0; L < config.num_hidden_layers; ++L)
    if (!reader.has(gate_name(layer_prefix(L)))) fused[L] = load_fused_moe(reader, config, L, w.layers[L].moe);
  require_no_unread_tensors(reader, config, fused);
  const std::string layers = "model.layers.";
  for (ParamView& p : parameter_views(w, config)) {
    if (p.name.compare(0, layers.size(), layers) == 0 && p.name.find(".block_sparse_moe.") != std::string::npos &&
        fused[std::stoi(p.name.substr(layers.size()))])
      continue;  // read from the fused 5.x tensors above
    DMOE_REQUIRE_INPUT(reader.has(p.name),
                 "checkpoint '{}': tensor '{}' {} is missing (the config asks for {} layers, {} experts{})",
                 reader.source(), p.name, shape_string(p.shape), config.num_hidden_layers, config.num_local_experts,
                 config.tie_word_embeddings ? ", tied embeddings" : ", an lm_head");
    reader.read_f32_into(p.name, p.shape, p.data);
  }
  // A tied config reads no lm_head, as transformers ties it to the embeddings; but a file whose lm_head.weight differs
  // from its embeddings holds an untied model, which was evaluated (or trained on, with --init) as another model
  // without a word. (An lm_head equal to the embeddings, as some conversions keep it, is fine.)
  if (config.tie_word_embeddings && reader.has("lm_head.weight")) {
    const int64_t V = config.vocab_size, H = config.hidden_size;
    std::vector<float> head(size_t(V * H));
    reader.read_f32_into("lm_head.weight", {V, H}, head.data());
    DMOE_REQUIRE_INPUT(std::equal(head.begin(), head.end(), w.embed_tokens.begin()),
                       "checkpoint '{}' holds an lm_head.weight that differs from model.embed_tokens.weight, but the "
                       "config ties them (tie_word_embeddings true), which would drop it: the file is an untied model; "
                       "set tie_word_embeddings false in the config, or remove lm_head.weight from the file",
                       reader.source());
  }
  // A NaN or Inf weight gave an eval loss of nan with rc 0, or a router error about NaN logits that named no
  // tensor: refused here, naming it (the fused 5.x tensors included, as they landed in the same views).
  for (const ParamView& p : parameter_views(w, config))
    for (int64_t i = 0; i < p.numel; ++i)
      if (!std::isfinite(p.data[i])) {
        const int64_t cols = p.shape.size() == 2 ? p.shape[1] : p.numel;
        const std::string at = p.shape.size() == 2 ? fmt::format("[{}, {}]", i / cols, i % cols) : fmt::format("[{}]", i);
        DMOE_FAIL_INPUT("checkpoint '{}': tensor '{}' {} element {} is {}; weights must be finite", reader.source(),
                        p.name, shape_string(p.shape), at, p.data[i]);
      }
  return w;
}

MixtralWeights load_mixtral_weights(const CheckpointReader& reader, const MixtralConfig& config) {
  return load_mixtral_weights(reader, config, 0, config.num_local_experts);
}

void add_mixtral_tensors(SafetensorsWriter& writer, const MixtralWeights& w, const MixtralConfig& config,
                         const std::string& name_prefix, DType stored_as) {
  // parameter_views needs a mutable model only to hand out pointers; nothing is written through them.
  for (const ParamView& p : parameter_views(const_cast<MixtralWeights&>(w), config))
    writer.add_f32(name_prefix + p.name, p.shape, p.data, stored_as);
}

std::vector<uint8_t> mixtral_checkpoint_bytes(const MixtralWeights& w, const MixtralConfig& config,
                                              const std::map<std::string, std::string>& metadata) {
  SafetensorsWriter writer;
  for (const ParamView& p : parameter_views(const_cast<MixtralWeights&>(w), config))
    writer.add_f32(p.name, p.shape, p.data);
  writer.set_metadata("format", "pt");
  for (const auto& [key, value] : metadata) writer.set_metadata(key, value);
  return writer.serialize();
}

std::string shard_base(const std::string& index_path) {
  std::string base = std::filesystem::path(index_path).filename().string();
  for (const std::string suffix : {".json", ".index", ".safetensors"})
    if (base.size() > suffix.size() && base.compare(base.size() - suffix.size(), suffix.size(), suffix) == 0)
      base.resize(base.size() - suffix.size());
  return base.empty() || base == ".json" ? std::string("model") : base;
}

namespace {

// The save id in a safetensors file's __metadata__ (its header only is read); "" when it has none or is no such file.
std::string save_id_of_file(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  uint8_t length_bytes[8] = {};
  if (!in.read(reinterpret_cast<char*>(length_bytes), 8)) return {};
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = length << 8 | length_bytes[i];
  if (length == 0 || length > SafetensorsFile::kMaxHeaderBytes) return {};
  std::string header(size_t(length), '\0');
  if (!in.read(header.data(), std::streamsize(length))) return {};
  const nlohmann::json j = nlohmann::json::parse(header, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("__metadata__") || !j.at("__metadata__").is_object()) return {};
  const nlohmann::json& meta = j.at("__metadata__");
  return meta.contains(kShardSaveId) && meta.at(kShardSaveId).is_string() ? meta.at(kShardSaveId).get<std::string>()
                                                                          : std::string();
}

}  // namespace

std::string shard_file_name(const std::string& index_path, size_t shard, size_t count) {
  return fmt::format("{}-{:05d}-of-{:05d}.safetensors", shard_base(index_path), shard, count);
}

bool is_shard_file_name(const std::string& index_path, const std::string& file_name) {
  const std::string head = shard_base(index_path) + "-";
  static const std::regex tail(R"([0-9]{5}-of-[0-9]{5}\.safetensors)");
  return file_name.size() > head.size() && file_name.compare(0, head.size(), head) == 0 &&
         std::regex_match(file_name.substr(head.size()), tail);
}

namespace {

// G19-1, G19-2 (nineteenth bad-input pass): --save-config through a symlink to a shard this save writes was written
// over that shard (the model broken, rc 0); through a symlink to an old shard this save removes, the model was
// committed and the old shards removed before the config's write failed. The collision check compared names only.
// Now every output is compared with every other and with every file to be removed by identity (same_file follows
// symlinks), before anything is written.
void require_outputs_apart(const std::vector<NamedPath>& outputs, const std::vector<NamedPath>& removed) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = i + 1; j < outputs.size(); ++j)
      DMOE_REQUIRE_INPUT(!same_file(outputs[i].path, outputs[j].path), "{} '{}' and {} '{}' are the same file (a "
                         "symbolic or hard link to it): one would be written over the other; give each output a file "
                         "of its own (e.g. --save-config config.json, not a link to a shard)", outputs[i].option,
                         outputs[i].path, outputs[j].option, outputs[j].path);
    for (const NamedPath& r : removed)
      DMOE_REQUIRE_INPUT(!same_file(outputs[i].path, r.path), "{} '{}' is the same file as '{}' ({}), which this save "
                         "removes once the new model is in place: it would be written, then deleted; give {} a file of "
                         "its own (e.g. config.json, not a link to a shard)", outputs[i].option, outputs[i].path,
                         r.path, r.option, outputs[i].option);
  }
}

// Consecutive tensors fill a shard until the next one would pass the limit (a tensor is never split): the shard of
// each tensor. One rule for the save and for the count init-model checks against the free inodes before it generates
// anything (G22A-4 of the twenty-second pass: that count was ceil(bytes / shard_bytes) + 1, which is no bound, as a
// tensor is not split: 27 counted for 30 shards, or 1,019,137 for 41).
std::vector<size_t> pack_shards(const std::vector<int64_t>& tensor_bytes, int64_t max_shard_bytes) {
  std::vector<size_t> shard_of;
  size_t shard = 0;
  int64_t bytes = 0;
  for (const int64_t b : tensor_bytes) {
    if (bytes > 0 && bytes + b > max_shard_bytes) {
      ++shard;
      bytes = 0;
    }
    shard_of.push_back(shard);
    bytes += b;
  }
  return shard_of;
}

// The f32 bytes of a whole model's tensors in parameter_views' order, from the config alone (no weights).
std::vector<int64_t> mixtral_tensor_bytes(const MixtralConfig& c) {
  const int64_t H = c.hidden_size, V = c.vocab_size, I = c.intermediate_size, E = c.num_local_experts;
  std::vector<int64_t> bytes{4 * V * H};
  for (int L = 0; L < c.num_hidden_layers; ++L) {
    for (const int64_t n : {H, c.q_size() * H, c.kv_size() * H, c.kv_size() * H, H * c.q_size(), H, E * H})
      bytes.push_back(4 * n);
    for (int64_t e = 0; e < E; ++e)
      for (int w = 0; w < 3; ++w) bytes.push_back(4 * I * H);
  }
  bytes.push_back(4 * H);
  if (!c.tie_word_embeddings) bytes.push_back(4 * V * H);
  return bytes;
}

}  // namespace

size_t mixtral_shard_count(const MixtralConfig& config, int64_t max_shard_bytes) {
  const std::vector<size_t> shard_of = pack_shards(mixtral_tensor_bytes(config), max_shard_bytes);
  return shard_of.empty() ? 0 : shard_of.back() + 1;
}

void save_mixtral_checkpoint(const std::string& path, const MixtralWeights& w, const MixtralConfig& config,
                             int64_t max_shard_bytes, const std::vector<AlsoWritten>& also) {
  if (max_shard_bytes <= 0) {
    std::vector<NamedPath> outputs;
    for (const AlsoWritten& a : also) outputs.push_back(a.file);
    outputs.push_back({"--out", path});
    require_outputs_apart(outputs, {});
    OutputFileSet files;
    for (const AlsoWritten& a : also) files.write(a.file.path, a.text);
    files.write(path, mixtral_checkpoint_bytes(w, config));
    files.commit();
    return;
  }
  std::vector<ParamView> views = parameter_views(const_cast<MixtralWeights&>(w), config);
  std::vector<int64_t> tensor_bytes;
  int64_t total = 0;
  for (const ParamView& p : views) {
    tensor_bytes.push_back(p.numel * 4);
    total += p.numel * 4;
  }
  // init-model counted these files from the config (mixtral_shard_count): the two lists must stay one.
  DMOE_REQUIRE(w.num_experts != config.num_local_experts || tensor_bytes == mixtral_tensor_bytes(config),
               "sharded checkpoint '{}': the tensors differ from those mixtral_tensor_bytes lists", path);
  const std::vector<size_t> shard_of = pack_shards(tensor_bytes, max_shard_bytes);
  std::vector<std::vector<const ParamView*>> shards(shard_of.empty() ? 1 : shard_of.back() + 1);
  for (size_t i = 0; i < views.size(); ++i) shards[shard_of[i]].push_back(&views[i]);
  const std::filesystem::path dir = std::filesystem::path(path).has_parent_path()
                                        ? std::filesystem::path(path).parent_path() : std::filesystem::path(".");
  std::vector<std::string> names;
  for (size_t s = 0; s < shards.size(); ++s) names.push_back(shard_file_name(path, s + 1, shards.size()));
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::json::object()}};
  // The index is written last: named as one of the shards, it replaced that shard (a broken model, no error).
  for (const std::string& name : names)
    DMOE_REQUIRE_INPUT(std::filesystem::path(path).filename() != name, "sharded checkpoint '{}': the index has the name "
                       "of one of its shards; name it model.safetensors.index.json", path);
  // The index being replaced (if any): the files it names are this model's earlier shards. An index that cannot be read
  // names none.
  std::set<std::string> old_named;
  std::string old_save_id;
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) {
    std::ifstream in(path);
    const nlohmann::json old = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (old.is_object() && old.contains("weight_map") && old.at("weight_map").is_object())
      for (const auto& [name, file] : old.at("weight_map").items())
        if (file.is_string()) old_named.insert(file.get<std::string>());
    if (old.is_object() && old.contains("metadata") && old.at("metadata").is_object() &&
        old.at("metadata").contains(kShardSaveId) && old.at("metadata").at(kShardSaveId).is_string())
      old_save_id = old.at("metadata").at(kShardSaveId).get<std::string>();
  }
  // The shards and the index together or not at all: each shard was renamed into place as soon as it was written, so
  // a write that failed (or was interrupted) at shard 3 of 4 left the new shards 1-2 beside the old 3-4 and the old
  // index, whose weight_map names the same files: a model of two saves, read without a word. Every shard is checked
  // before the first is written, and all are renamed at the end (OutputFileSet), the index last.
  // A file at a shard's name that the index being replaced does not name is not this model's: all shards used to be
  // named model-…, so a second index in the directory replaced the first one's shards with rc 0 (F1 of the eighteenth
  // bad-input pass). It is refused, not replaced.
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::filesystem::path target = dir / names[s];
    check_output_file(target.string(), fmt::format("shard {} of {} (beside --out '{}')", s + 1, shards.size(), path));
    DMOE_REQUIRE_INPUT(!std::filesystem::exists(std::filesystem::symlink_status(target, ec)) || old_named.count(names[s]),
                       "sharded checkpoint '{}': '{}' exists, and {}: it is not a shard of this model (another model's "
                       "shard, a file of yours, or one left by an interrupted save), and would be replaced; remove it "
                       "if it is stale, or give --out another name (the shards are named after the index: {})", path,
                       target.string(), std::filesystem::exists(path, ec) ? "the index being replaced does not name it"
                                                                          : "no index is being replaced",
                       shard_file_name(path, 1, shards.size()));
  }
  // The old index's shards that the new one does not name, of this index's names and of its save (its save id, where it
  // has one), are removed after the commit (below); they are found now, so that no output can be one of them.
  std::vector<NamedPath> outputs, removed;
  for (const AlsoWritten& a : also) outputs.push_back(a.file);
  outputs.push_back({"--out", path});
  for (size_t s = 0; s < shards.size(); ++s)
    outputs.push_back({fmt::format("shard {} of {}", s + 1, shards.size()), (dir / names[s]).string()});
  for (const std::string& name : names) old_named.erase(name);
  for (const std::string& file : old_named)
    if (is_shard_file_name(path, file) && std::filesystem::exists(dir / file, ec) &&
        (old_save_id.empty() || save_id_of_file(dir / file) == old_save_id))
      removed.push_back({"a shard of the index being replaced", (dir / file).string()});
  require_outputs_apart(outputs, removed);
  OutputFileSet files;
  // One id for the save, in the index's metadata and every shard's (HF readers ignore both): a SIGKILL between the
  // renames below left shards of two seeds under one index, which eval read, rc 0 (H5 of the seventeenth pass).
  const std::string save_id = random_save_id();
  index["metadata"][kShardSaveId] = save_id;
  for (size_t s = 0; s < shards.size(); ++s) {
    SafetensorsWriter writer;
    for (const ParamView* p : shards[s]) {
      writer.add_f32(p->name, p->shape, p->data);
      index["weight_map"][p->name] = names[s];
    }
    writer.set_metadata("format", "pt");
    writer.set_metadata(kShardSaveId, save_id);
    files.write((dir / names[s]).string(), writer.serialize());
  }
  for (const AlsoWritten& a : also) files.write(a.file.path, a.text);
  files.write(path, index.dump(2) + "\n");
  // The shards the index being replaced named (e.g. 42 of an earlier --shard-bytes 1): after the commit those the new
  // index does not name are removed, or they stayed beside the new model (41 stale files, the index right). Only files
  // of this directory with a shard name of this index, and of the replaced index's save (its save id, where it has
  // one), are removed: a file of another model that the old index happened to name (written under the old common
  // names) is left be (F1: rewriting one model's index deleted another's shards). The commit removes them before a
  // signal it held back ends the process (G19-4: removed after it, they stayed, and going back to their shard count
  // was then refused).
  for (const NamedPath& file : removed) files.remove_after_commit(file.path);
  files.commit();
}

}  // namespace dmoe
