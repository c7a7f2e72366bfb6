// dmoe init — random MoE layer weights (Mixtral names) and, optionally, random inputs.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "core/random.hpp"
#include "model/checkpoint.hpp"
#include "model/config_io.hpp"
#include "options.hpp"

namespace dmoe::cli {

namespace {

struct InitOptions {
  ConfigOptions config;
  std::string out, input, grad_output, save_config, prefix;
  int layer = 0;
  uint64_t seed = 1;
};

// A random activation [world*tokens, hidden] named `name`, written into `files` (not yet in place).
void write_activation(OutputFileSet& files, const std::string& path, const char* name, const MoeConfig& c,
                      uint64_t seed) {
  Rng rng(seed);
  const int64_t rows = c.tokens * c.world;
  std::vector<float> v = rng.normal_vector(size_t(rows * c.hidden), 1.0);
  SafetensorsWriter w;
  w.add_f32(name, {rows, c.hidden}, v, c.dtype);
  w.set_metadata("producer", "dmoe init");
  files.write(path, w.serialize());
}

// Before anything is generated: the memory the weights and activations take while being serialised, and
// the disk space of the files, against what this machine has (nothing is written when either is short).
void check_init_resources(const MoeConfig& c, const InitOptions& o) {
  const double stored = double(dtype_size(c.dtype));
  const double params = double(c.experts) * double(c.hidden) *
                        (1.0 + expert_matrices(c.activation) * double(c.ffn));  // gate + experts
  const double activation = double(c.tokens) * double(c.world) * double(c.hidden);  // x or dy elements
  const bool any_activation = !o.input.empty() || !o.grad_output.empty();
  // f32 weights stay alive; each file is held as the writer's copy and the serialised bytes (2 × stored),
  // an activation also as f32 while being generated.
  const double peak = 4 * params + std::max(2 * stored * params, any_activation ? (4 + 2 * stored) * activation : 0.0);
  require_host_memory(peak, fmt::format("init ({:.3g} weight parameters{})", params,
                                        any_activation ? fmt::format(", x/dy [{}, {}]", c.tokens * c.world, c.hidden)
                                                       : std::string()));
  // Disk: the files that land on each file system, against its free space.
  struct Volume {
    dev_t device;
    std::string directory;
    double bytes;
    uint64_t files = 1;  // the temporaries created there at once (one set: all exist before the first rename)
  };
  std::vector<Volume> volumes;
  auto add = [&](const std::string& path, double bytes) {
    if (path.empty()) return;
    const std::filesystem::path parent = std::filesystem::path(path).parent_path();
    const std::string dir = parent.empty() ? std::string(".") : parent.string();
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) return;
    for (Volume& v : volumes)
      if (v.device == st.st_dev) {
        v.bytes += bytes;
        ++v.files;
        return;
      }
    volumes.push_back({st.st_dev, dir, bytes});
  };
  add(o.out, stored * params);
  add(o.input, stored * activation);
  add(o.grad_output, stored * activation);
  add(o.save_config, 0);  // a small file, but an inode
  // And `ulimit -f` (G15, sixteenth pass): a weights file past it failed only after the weights were generated.
  require_file_size_allowed(stored * params, fmt::format("init --out {}", o.out));
  if (any_activation)
    require_file_size_allowed(stored * activation, fmt::format("init {} (x or dy)", o.input.empty() ? "--grad-output "
                                                               + o.grad_output : "--input " + o.input));
  for (const Volume& v : volumes) {
    const std::optional<uint64_t> free = disk_free_bytes(v.directory);
    DMOE_REQUIRE_INPUT(!free || v.bytes <= double(*free),
                       "init would write about {} to the file system of '{}', which has {} free", format_bytes(v.bytes),
                       v.directory, format_bytes(double(*free)));
    require_free_inodes(v.files, v.directory, fmt::format("init (its outputs in '{}')", v.directory));
  }
}

}  // namespace

Command add_init_command(CLI::App& app) {
  auto o = std::make_shared<InitOptions>();
  CLI::App* sub = app.add_subcommand("init", "write random MoE layer weights (and inputs) as safetensors");
  add_config_options(*sub, o->config);
  sub->add_option("--out", o->out, "weights file to write")->required();
  CLI::Option* layer_option = sub->add_option("--layer", o->layer, "layer index L in model.layers.L.block_sparse_moe.")
                                  ->check(Range(0, 1000000));
  sub->add_option("--prefix", o->prefix, "tensor-name prefix (instead of --layer)");
  sub->add_option("--seed", o->seed, "random seed");
  sub->add_option("--input", o->input, "also write a random input x [world*tokens, hidden] here");
  sub->add_option("--grad-output", o->grad_output, "also write a random dy [world*tokens, hidden] here");
  sub->add_option("--save-config", o->save_config, "also write the resolved config as dmoe JSON");
  return [o, layer_option] {
    require_not_under_launcher("init", "--out (and --input, --grad-output, --save-config)");
    require_prefix_ends_with_dot(o->prefix);
    require_layer_or_prefix(layer_option->count() > 0 ? std::optional<int>(o->layer) : std::nullopt, o->prefix);
    // The weights file holds tensors only: the routing flags reach --save-config's JSON and nothing else, and were
    // taken and dropped without it (`init --capacity-factor 1 --out w.st` printed "cf=1", rc 0, and w.st had no cf).
    if (o->save_config.empty())
      for (const auto& [given, name] : {std::pair{o->config.capacity_factor.has_value(), "--capacity-factor"},
                                        std::pair{o->config.drop_policy.has_value(), "--drop-policy"},
                                        std::pair{o->config.aux_loss_coef.has_value(), "--aux-loss-coef"},
                                        std::pair{o->config.z_loss_coef.has_value(), "--z-loss-coef"},
                                        std::pair{o->config.no_renormalize, "--no-renormalize"}})
        DMOE_REQUIRE_INPUT(!given, "init: {} is not recorded in --out (a safetensors file holds the tensors only): "
                           "add --save-config FILE to keep it in the config, or give it to dmoe run / bench", name);
    MoeConfig defaults;
    defaults.tokens = 64;
    MoeConfig c = resolve_config(o->config, defaults);
    validate_config(c, o->config);
    // Before anything is generated: the outputs are distinct files, none is the --config read, and each
    // can be written.
    const std::vector<NamedPath> outputs{{"--out", o->out},
                                         {"--input", o->input},
                                         {"--grad-output", o->grad_output},
                                         {"--save-config", o->save_config}};
    require_distinct_files(outputs, {{"--config", o->config.config_path.empty()
                                                      ? std::string()
                                                      : find_config_file(o->config.config_path)}});
    for (const NamedPath& out : outputs)
      if (!out.path.empty()) check_output_file(out.path, out.option);
    check_init_resources(c, *o);
    const std::string prefix = o->prefix.empty() ? layer_prefix(o->layer) : o->prefix;
    // All files appear together or none does (a failure part-way, e.g. a full disk, leaves no new weights
    // beside an old x).
    OutputFileSet files;
    {
      MoeWeights w = random_moe_weights(c, o->seed);
      SafetensorsWriter writer;
      save_moe_weights(writer, w, prefix, c.dtype);
      writer.set_metadata("producer", "dmoe init");
      files.write(o->out, writer.serialize());
    }
    if (!o->input.empty()) write_activation(files, o->input, "x", c, o->seed + 1);
    if (!o->grad_output.empty()) write_activation(files, o->grad_output, "dy", c, o->seed + 2);
    if (!o->save_config.empty()) files.write(o->save_config, config_to_json(c).dump(2) + "\n");
    files.commit();
    const int64_t rows = c.tokens * c.world;
    std::printf("wrote %s: %s (prefix %s)\n", o->out.c_str(), c.summary().c_str(), prefix.c_str());
    for (const auto& [path, name] : {std::pair{o->input, "x"}, std::pair{o->grad_output, "dy"}})
      if (!path.empty())
        std::printf("wrote %s: %s [%lld, %lld] %s\n", path.c_str(), name, (long long)rows, (long long)c.hidden,
                    dtype_name(c.dtype));
    if (!o->save_config.empty()) std::printf("wrote %s\n", o->save_config.c_str());
    return 0;
  };
}

}  // namespace dmoe::cli
