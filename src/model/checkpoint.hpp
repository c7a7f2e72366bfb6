// checkpoint.hpp — MoE layer weights and gradients in safetensors files, under Mixtral's tensor names.
//
// With a prefix P (default layer_prefix(0) = "model.layers.0.block_sparse_moe."):
//   P + "gate.weight"              [E, H]  router
//   P + "experts.{e}.w1.weight"    [I, H]  gate projection (SwiGLU) / up projection (relu, gelu)
//   P + "experts.{e}.w3.weight"    [I, H]  up projection, SwiGLU only
//   P + "experts.{e}.w2.weight"    [H, I]  down projection
// Gradients are stored as "grad." + the weight's name. bf16/f16 tensors are widened to f32 on load.
//
// Whole Mixtral models (every tensor of mixtral_weights.hpp, the MoE layers under the names above) are read
// from one model.safetensors or a sharded checkpoint (model.safetensors.index.json: {"weight_map":
// {tensor name: shard file name}}, shards beside the index), and written to one file or sharded.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/output_file.hpp"
#include "model/mixtral_weights.hpp"
#include "model/moe_weights.hpp"
#include "model/safetensors.hpp"

namespace dmoe {

// "model.layers.{layer}.block_sparse_moe."
std::string layer_prefix(int layer);
// Full tensor names under a prefix.
std::string gate_name(const std::string& prefix);
std::string expert_weight_name(const std::string& prefix, int32_t expert, const char* matrix);  // "w1"|"w2"|"w3"

// The prefix of the MoE layer to load. With `layer`, that layer (error listing the layers present if its
// gate is missing); without, the lowest model.layers.{L} holding a gate, else "block_sparse_moe." or ""
// (a bare "gate.weight"); else an error saying which names were looked for.
std::string find_moe_prefix(const SafetensorsFile& file, std::optional<int> layer = std::nullopt);

// The full gate and experts [first_expert, first_expert + num_experts), shapes checked against config.
MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix,
                            int32_t first_expert, int32_t num_experts);
// All config.experts experts.
MoeWeights load_moe_weights(const SafetensorsFile& file, const MoeConfig& config, const std::string& prefix);

// Adds the gate and the held experts (global index first_expert + local) stored as `stored_as`.
void save_moe_weights(SafetensorsWriter& writer, const MoeWeights& weights, const std::string& prefix,
                      DType stored_as = DType::f32);
// Adds gradients (same layout as weights) under "grad." + prefix.
void add_moe_grads(SafetensorsWriter& writer, const MoeWeights& grads, const std::string& prefix,
                   DType stored_as = DType::f32);

// The shapes of the layer at `prefix`: hidden and experts from the gate, ffn from expert 0's w1,
// activation swiglu when w3 is present (else relu: relu and gelu files look alike), dtype bf16 when the
// gate is stored as BF16. tokens and top_k cannot be inferred and stay 0 — the caller sets them.
MoeConfig infer_moe_config(const SafetensorsFile& file, const std::string& prefix);

// ---- whole models -----------------------------------------------------------------------------------

// A checkpoint of one safetensors file or of shards listed by an index.json (a path ending in ".json"), or a
// Hugging Face model directory (its model.safetensors.index.json, else its model.safetensors). Shards are
// opened on first use. Errors name the index, the shard and the tensor.
class CheckpointReader {
 public:
  static CheckpointReader open(const std::string& path_or_dir);
  const std::string& source() const { return source_; }
  bool has(const std::string& name) const;
  // Sorted. For an index, every shard is opened and must hold exactly the tensors the weight_map puts in it: a tensor
  // the map does not name, or one present in two shards, is an error naming the shard and the tensor.
  std::vector<std::string> names() const;
  // The tensor converted to float; its shape must be `shape` (the error names both).
  void read_f32_into(const std::string& name, const std::vector<int64_t>& shape, float* out) const;
  // The tensor's dtype as stored ("F32", "BF16", ...).
  std::string dtype(const std::string& name) const;
  // The one file's __metadata__ (strings); empty for a sharded checkpoint.
  std::map<std::string, std::string> metadata() const;

 private:
  const SafetensorsFile& file_of(const std::string& name) const;
  const SafetensorsFile& shard(const std::string& file_name) const;  // opened on first use, its save id checked
  void check_shards() const;

  mutable bool shards_checked_ = false;

  std::string source_;
  std::string directory_;                          // where the shards are
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file (index only)
  // An index dmoe wrote names its save ("dmoe_save_id" in its metadata, and in each shard's): a shard of another save
  // (a kill between the renames of init-model --shard-bytes, a shard copied in) is refused when opened.
  std::string save_id_;
  mutable std::map<std::string, std::shared_ptr<SafetensorsFile>> files_;
};

// The files CheckpointReader::open(path_or_dir) reads: the file, or the directory's index.json or model.safetensors,
// and an index's shards (those its weight_map names; an index that cannot be read adds none, and open() reports it).
// For the checks that an output is none of them: an eval --output or train --log onto a shard destroyed the model.
std::vector<std::string> checkpoint_files(const std::string& path_or_dir);

// Every parameter of `config`, this rank's experts [first_expert, first_expert + num_experts). Missing tensors
// and wrong shapes are errors naming the tensor, and so is a NaN or Inf weight (naming the element); tensors the model does not use are ignored (a tied model's
// lm_head.weight, rotary inv_freq buffers of old checkpoints). A layer's MoE may also be stored as
// transformers 5.x holds it in memory (mlp.gate.weight, fused mlp.experts.gate_up_proj / down_proj).
MixtralWeights load_mixtral_weights(const CheckpointReader& reader, const MixtralConfig& config,
                                    int32_t first_expert, int32_t num_experts);
MixtralWeights load_mixtral_weights(const CheckpointReader& reader, const MixtralConfig& config);  // all experts
// Adds every tensor of w under name_prefix + its HF name ("" for weights, "grad." for gradients).
void add_mixtral_tensors(SafetensorsWriter& writer, const MixtralWeights& w, const MixtralConfig& config,
                         const std::string& name_prefix = "", DType stored_as = DType::f32);
// The part of a shard's name before "-NNNNN-of-NNNNN.safetensors": the index's file name without ".json", ".index" and
// ".safetensors" ("model" for model.safetensors.index.json, as HF writes it).
std::string shard_base(const std::string& index_path);
// The name of shard `shard` (1-based) of `count` of the sharded checkpoint whose index is `index_path`: the index's
// name without ".json", ".index" and ".safetensors", then "-0000i-of-0000N.safetensors", as HF names them
// (model.safetensors.index.json: model-00001-of-00004.safetensors; a.index.json: a-00001-of-00004.safetensors). Two
// indexes of one directory thus have shards of their own (they all used to be model-…, so a second model replaced the
// first one's shards).
std::string shard_file_name(const std::string& index_path, size_t shard, size_t count);
// Whether `file_name` (a name, no directory) is a shard name of that index, of any count ("<base>-NNNNN-of-NNNNN.safetensors").
bool is_shard_file_name(const std::string& index_path, const std::string& file_name);
// Writes w as HF would: max_shard_bytes = 0 → one safetensors file at `path`; otherwise `path` is the
// index.json to write and the shards shard_file_name(path, i, N) go beside it, each up to about
// max_shard_bytes (a tensor is never split). Metadata {"format": "pt"} as HF writes. A file at a shard's name is
// replaced only when the index being replaced names it (else the save is refused: it may be another model's), and
// the old index's shards that the new one does not name are removed only when they are of its save (their save id).
// The caller keeps other writers out of the directory meanwhile (init-model holds its lock, ExclusiveLock).
// The one-file form's bytes (max_shard_bytes = 0), for a caller that writes it with others (OutputFileSet).
// `metadata`: entries beside {"format": "pt"} (train --save tags its files with the step, see trainer.cpp).
std::vector<uint8_t> mixtral_checkpoint_bytes(const MixtralWeights& w, const MixtralConfig& config,
                                              const std::map<std::string, std::string>& metadata = {});
// `also`: other files of the command (init-model's --save-config: {option, path} and its text), written in the same
// set as the model, so that all of them appear or none. Before anything is written, every output (the model or the
// index, every shard, each of `also`) is checked by file identity (symlinks followed) against every other and against
// every shard of the index being replaced that the save will remove; a collision is refused naming both.
struct AlsoWritten {
  NamedPath file;
  std::string text;
};
void save_mixtral_checkpoint(const std::string& path, const MixtralWeights& w, const MixtralConfig& config,
                             int64_t max_shard_bytes = 0, const std::vector<AlsoWritten>& also = {});
// The number of shards save_mixtral_checkpoint writes for a whole model of `config` at max_shard_bytes > 0 (the same
// packing, from the config alone): init-model counts its files before it generates the weights (G22A-4).
size_t mixtral_shard_count(const MixtralConfig& config, int64_t max_shard_bytes);

}  // namespace dmoe
