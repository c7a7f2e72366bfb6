// dmoe init-model / dmoe eval — whole Mixtral models in Hugging Face layout.
//
//   dmoe init-model --config C --out model.safetensors [--seed N] [--shard-bytes B]
//       random weights (HF initialisation: normal(0, initializer_range), norms 1) under HF names;
//       with --shard-bytes, --out is the index.json and shards go beside it.
//   dmoe eval --config C --weights model.safetensors|index.json --tokens FILE --output OUT [--grad] [--world W]
//       FILE holds tokens [B, S] (I32 or I64). OUT receives logits [B, S, V] f32, loss (scalar f32: mean
//       next-token cross-entropy + router_aux_loss_coef · aux when output_router_logits), ce_loss and aux_loss
//       scalars, and with --grad grad.<HF name> for every parameter.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <optional>
#include <regex>

#include <sys/stat.h>

#include "commands.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "model/checkpoint.hpp"
#include "model/mixtral.hpp"
#include "model/mixtral_config.hpp"
#include "comm/process_env.hpp"
#include "options.hpp"

namespace dmoe::cli {

namespace {

struct InitModelOptions {
  std::string config, out, save_config;
  uint64_t seed = 1;
  int64_t shard_bytes = 0;
};

struct EvalOptions {
  std::string config, weights, tokens, output, engine = "cpu", dtype = "f32";
  bool grad = false;
  int32_t world = 1;
};

// tokens [B, S] from a safetensors file, I32 or I64 (values must fit int32).
HostTensor<int32_t> read_tokens(const std::string& path) {
  const SafetensorsFile f = SafetensorsFile::open(path);
  DMOE_REQUIRE_INPUT(f.has("tokens"), "{}: no tensor 'tokens' (expected tokens [batch, seq], I32 or I64); tensors "
               "present: {}", path, tensor_list(f));
  // Every position of tokens is a real token and a target: a file that also holds, say, an attention_mask or labels
  // (a tokenizer's export with input_ids renamed) was evaluated with the padding counted in the loss, the mask and
  // labels ignored, rc 0.
  std::string others;
  for (const std::string& name : f.names())
    if (name != "tokens") others += (others.empty() ? "'" : ", '") + name + "'";
  DMOE_REQUIRE_INPUT(others.empty(), "{}: holds {} beside 'tokens', which eval would ignore: eval reads tokens [batch, "
                     "seq] alone and takes every position as a real token (the loss is the next-token cross-entropy "
                     "over all of them: no attention mask, no labels); give a file with 'tokens' only", path, others);
  const TensorInfo& t = f.info("tokens");
  DMOE_REQUIRE_INPUT(t.dtype == "I32" || t.dtype == "I64", "{}: tokens has dtype {}; allowed: I32, I64", path, t.dtype);
  DMOE_REQUIRE_INPUT(t.shape.size() == 2 && t.shape[0] >= 1 && t.shape[1] >= 2,
               "{}: tokens has shape {}; expected [batch >= 1, seq >= 2] (the loss predicts each next token)", path,
               shape_string(t.shape));
  // The file is its header and the tokens, nothing else: stray bytes after the data region (or before the tokens in
  // it) were ignored, rc 0 (G19-11 of the nineteenth bad-input pass): a file appended to, or tokens cut short by a
  // header that describes fewer of them than were written. (The generic reader tolerates holes and trailing bytes.)
  const uint64_t expected = f.data_start() + t.nbytes();
  DMOE_REQUIRE_INPUT(f.file_bytes() == expected && t.begin == 0, "{}: the file is {} bytes, but its header ({} bytes "
                     "with the length field) and tokens {} {} ({} bytes) make {} bytes: {} byte(s) are no tensor's{}; "
                     "a tokens file holds its header and the tokens only (was it appended to?)", path, f.file_bytes(),
                     f.data_start(), t.dtype, shape_string(t.shape), t.nbytes(), expected, f.file_bytes() - expected,
                     t.begin > 0 ? fmt::format(" ({} of them before the tokens)", t.begin)
                                 : std::string(" (after the tokens)"));
  return f.read_i32("tokens");
}


// Before the weights are generated (a model too large used to fill the memory tensor by tensor, for minutes, and end
// in a bare std::bad_alloc): the f32 weights plus a file's (or shard's) writer copy and serialised bytes, against
// MemAvailable, and the file's size against the free space where it goes.
void check_init_model_resources(const MixtralConfig& c, const std::string& out, int64_t shard_bytes,
                                const std::string& save_config) {
  const double params = double(c.num_parameters()), file_bytes = 4 * params;
  const double buffered = shard_bytes > 0 ? std::min(file_bytes, double(shard_bytes)) : file_bytes;
  require_host_memory(file_bytes + 2 * buffered,
                      fmt::format("init-model ({:.3g} parameters of {}, f32)", params, c.summary()),
                      kModelSizes);
  const std::filesystem::path parent = std::filesystem::path(out).parent_path();
  const std::string dir = parent.empty() ? std::string(".") : parent.string();
  const std::optional<uint64_t> free = disk_free_bytes(dir);
  DMOE_REQUIRE_INPUT(!free || file_bytes <= double(*free),
                     "init-model would write about {} to the file system of '{}', which has {} free",
                     format_bytes(file_bytes), dir, format_bytes(double(*free)));
  // Its files, all created before the first is renamed into place: the shards as the save packs them (the same
  // packing, from the config) and the index, and --save-config where it is on the same file system. G22A-4 of the
  // twenty-second pass: ceil(bytes / shard_bytes) + 1 was counted, which is no bound (a tensor is not split: 27 for 30
  // shards, found at shard 28 after the generation; 1,019,137 for 41, a false refusal), and --save-config was not.
  uint64_t files = shard_bytes > 0 ? uint64_t(mixtral_shard_count(c, shard_bytes)) + 1 : 1;
  std::string config_too;
  if (!save_config.empty()) {
    const std::filesystem::path config_parent = std::filesystem::path(save_config).parent_path();
    const std::string config_dir = config_parent.empty() ? std::string(".") : config_parent.string();
    struct stat a {}, b {};
    if (::stat(dir.c_str(), &a) == 0 && ::stat(config_dir.c_str(), &b) == 0 && a.st_dev == b.st_dev) {
      ++files;
      config_too = " and --save-config " + save_config;
    } else {
      require_free_inodes(1, config_dir, fmt::format("init-model --save-config {}", save_config));
    }
  }
  require_free_inodes(files, dir, fmt::format("init-model --out {}{}{}", out,
                                              shard_bytes > 0 ? " (its shards and their index)" : "", config_too));
  require_file_size_allowed(buffered, fmt::format("init-model --out {}{}", out, shard_bytes > 0 ? " (a shard)" : ""));
}

// With --shard-bytes, --out is the index and its shards go beside it, named after it (shard_file_name: NAME.index.json
// has NAME-0000i-of-0000N.safetensors; model.safetensors.index.json, as HF, model-0000i-of-0000N). Readers take a
// path ending in .json for an index: any other --out made a model its own reader refused ("header length ... is
// absurd"), one named as a shard had the index written over that shard, and a --save-config of a shard's name
// replaced the shard with the config; all with rc 0.
void check_sharded_outputs(const InitModelOptions& o, const std::string& config_path) {
  namespace fs = std::filesystem;
  // By the name's end (a bare ".json" has no extension to std::filesystem, and was told to "end in .json").
  DMOE_REQUIRE_INPUT(fs::path(o.out).filename().string().ends_with(".json"), "--out '{}' with --shard-bytes: --out is "
                     "the index.json of the shards, and must end in .json (e.g. model.safetensors.index.json); without "
                     "--shard-bytes it is one model.safetensors", o.out);
  // The shards are named after the index (NAME.index.json: NAME-0000i-of-0000N.safetensors): a NAME starting with '-'
  // gave shards named like options (--out ./-.index.json: --00001-of-00003.safetensors), an empty one or one starting
  // with '.' hidden files (--out .index.json: .index-00001-of-00003.safetensors) (G19-12 of the nineteenth pass).
  std::string name = fs::path(o.out).filename().string();
  for (const std::string suffix : {".json", ".index", ".safetensors"})
    if (name.ends_with(suffix)) name.resize(name.size() - suffix.size());
  DMOE_REQUIRE_INPUT(!name.empty() && name[0] != '.' && name[0] != '-', "--out '{}' with --shard-bytes: the shards are "
                     "named after the index (NAME.index.json has NAME-0000i-of-0000N.safetensors), and its NAME is {}: "
                     "{}; allowed: a NAME that is not empty and starts with neither '.' nor '-', e.g. --out "
                     "model.safetensors.index.json", o.out, name.empty() ? std::string("empty") : "'" + name + "'",
                     name.empty() ? fmt::format("the index would be a hidden file, its shards '{}-0000i-of-0000N"
                                                ".safetensors'", shard_base(o.out))
                     : name[0] == '-' ? fmt::format("the shards would be named like options ('{}-0000i-of-0000N"
                                                    ".safetensors')", name)
                                      : fmt::format("the shards would be hidden files ('{}-0000i-of-0000N.safetensors')",
                                                    name));
  // The shards' file names go into the index's weight_map, a JSON text, which holds UTF-8 only: a NAME of other bytes
  // (a Latin-1 name) ended in "type_error.316" after the whole model was generated (twenty-first pass).
  DMOE_REQUIRE_INPUT(is_utf8(name), "--out '{}' with --shard-bytes: the shards' names (NAME-0000i-of-0000N.safetensors) "
                     "are written into the index's weight_map, a JSON text, and NAME is not valid UTF-8; allowed: a "
                     "UTF-8 file name (the directory may be any)", o.out);
  const fs::path dir = fs::path(o.out).parent_path().empty() ? fs::path(".") : fs::path(o.out).parent_path();
  // A file beside --out with a shard's name is replaced by that shard: the --config read (a config copied to
  // model-00001-of-00001.safetensors became 1 MB of weights, rc 0) or the --save-config written.
  const auto is_shard_beside_out = [&](const std::string& path) {
    const fs::path p(path);
    const fs::path p_dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
    return same_file(dir.string(), p_dir.string()) && is_shard_file_name(o.out, p.filename().string());
  };
  for (const auto& [option, path] : {std::pair<const char*, std::string>{"--save-config", o.save_config},
                                     {"--config", config_path}})
    DMOE_REQUIRE_INPUT(path.empty() || !is_shard_beside_out(path),
                       "{} '{}' has the name of a shard that --shard-bytes writes beside --out '{}' "
                       "({}-0000i-of-0000N.safetensors): the shard would replace it; give it another name, e.g. "
                       "config.json", option, path, o.out, shard_base(o.out));
}

// A model directory is read from its model.safetensors.index.json or its model.safetensors, and one holding both is
// refused by every reader (eval --weights DIR, train --init DIR: which model is meant would be a guess). init-model
// wrote the second beside the first with rc 0 (F12 of the eighteenth bad-input pass); it is refused before the work.
// Other names (a.index.json beside b.index.json, each with shards of its own) are read by their names only.
void require_no_second_model_beside(const std::string& out) {
  namespace fs = std::filesystem;
  const fs::path p(out);
  const std::string name = p.filename().string();
  const char* other = name == "model.safetensors" ? "model.safetensors.index.json"
                      : name == "model.safetensors.index.json" ? "model.safetensors" : nullptr;
  if (!other) return;
  const fs::path beside = (p.parent_path().empty() ? fs::path(".") : p.parent_path()) / other;
  std::error_code ec;
  DMOE_REQUIRE_INPUT(!fs::exists(fs::symlink_status(beside, ec)), "--out '{}': its directory already holds {} ('{}'): "
                     "with both it would be a directory of two models, which eval --weights DIR and train --init DIR "
                     "refuse (which one is meant would be a guess); remove '{}' if it is stale, or write this model "
                     "into another directory or under another name", out, other, beside.string(), beside.string());
}

// "the loss is nan", "logits[0, 3, 17] is inf", ... for the first non-finite result of an eval; "" if none.
std::string first_non_finite(const EvalResult& r, const MixtralConfig& c, int64_t S, bool grad) {
  for (const auto& [name, v] : {std::pair<const char*, double>{"the loss", r.loss}, {"the cross-entropy", r.ce_loss},
                                {"the load-balancing loss", r.aux_loss}})
    // Written as float32: a finite double past float's range is inf in the file.
    if (!std::isfinite(v) || std::fabs(v) > double(std::numeric_limits<float>::max()))
      return fmt::format("{} is {}{}", name, v, std::isfinite(v) ? " (inf as float32)" : "");
  const int64_t V = c.vocab_size;
  for (size_t i = 0; i < r.logits.size(); ++i)
    if (!std::isfinite(r.logits[i]))
      return fmt::format("logits[{}, {}, {}] is {}", int64_t(i) / (S * V), int64_t(i) / V % S, int64_t(i) % V,
                         r.logits[i]);
  if (grad)
    for (const ParamView& p : parameter_views(const_cast<MixtralWeights&>(r.grads), c))
      for (int64_t i = 0; i < p.numel; ++i)
        if (!std::isfinite(p.data[i])) return fmt::format("the gradient of {} (element {}) is {}", p.name, i, p.data[i]);
  return "";
}

}  // namespace

Command add_init_model_command(CLI::App& app) {
  auto o = std::make_shared<InitModelOptions>();
  CLI::App* sub = app.add_subcommand("init-model", "write a random Mixtral model (HF names and layout)");
  sub->add_option("--config", o->config, "HF Mixtral config.json, or a named model in bench/models (e.g. tiny)")
      ->required();
  sub->add_option("--out", o->out, "model.safetensors to write (with --shard-bytes: the index.json)")->required();
  sub->add_option("--seed", o->seed, "random seed");
  sub->add_option("--shard-bytes", o->shard_bytes, "write shards of about this many bytes and an index.json")
      ->check(Range(int64_t(0), std::numeric_limits<int64_t>::max()));
  sub->add_option("--save-config", o->save_config, "also write the config as config.json here");
  return [o] {
    require_not_under_launcher("init-model", "--out (with --shard-bytes: the index and its shards)");
    const std::string config_path = find_model_config_file(o->config);
    // Before anything is computed: the outputs are not the config and can be written.
    require_distinct_files({{"--out", o->out}, {"--save-config", o->save_config}}, {{"--config", config_path}});
    if (o->shard_bytes > 0) check_sharded_outputs(*o, config_path);
    // Without shards --out is one safetensors file, and every reader (eval --weights, train --init, run) takes a name
    // ending in .json for an index: `init-model --out m.json` wrote a model its own reader refused ("byte 2 of the file
    // is NUL ... a JSON file is text"), rc 0.
    DMOE_REQUIRE_INPUT(o->shard_bytes > 0 || std::filesystem::path(o->out).extension() != ".json",
                       "--out '{}' ends in .json, the name of a sharded model's index: without --shard-bytes --out is "
                       "one safetensors file, which readers of a .json name would take for an index; give a name "
                       "such as model.safetensors, or add --shard-bytes B for shards and an index", o->out);
    check_output_file(o->out, "--out");
    if (!o->save_config.empty()) check_output_file(o->save_config, "--save-config");
    // One writer at a time in --out's directory: concurrent init-model --shard-bytes runs into one index each reported
    // success while their renames interleaved, leaving an index over another run's shards (F3 of the eighteenth pass);
    // a model written beside one being written could also make a directory of two models. The lock (flock on the
    // directory, as train --save takes on its checkpoint directory) is held until the process ends; a second writer is
    // refused before it generates anything.
    ExclusiveLock directory_lock;
    {
      const std::filesystem::path parent = std::filesystem::path(o->out).parent_path();
      const std::string dir = parent.empty() ? std::string(".") : parent.string();
      DMOE_REQUIRE_INPUT(directory_lock.lock_directory(dir, "init-model --out", /*wait=*/false),
                         "init-model --out {}: another dmoe process is writing into '{}' now (it holds the directory's "
                         "lock: another init-model, or a train --save into it): wait for it to end, or write elsewhere",
                         o->out, dir);
    }
    require_no_second_model_beside(o->out);
    const MixtralConfig c = load_mixtral_config(config_path);
    check_init_model_resources(c, o->out, o->shard_bytes, o->save_config);
    // A large model was silent for minutes (bert-large-moe, 4.7 GiB: > 90 s on 2 cores); its size is known now.
    const double file_bytes = 4.0 * double(c.num_parameters());
    const bool large = file_bytes >= double(512ull << 20);
    const auto start = std::chrono::steady_clock::now();
    if (large)
      std::fprintf(stderr, "init-model: %.3g parameters, a file of about %s: generating random weights, then writing "
                   "(about a minute per 4 GB on a small machine)\n", double(c.num_parameters()),
                   format_bytes(file_bytes).c_str());
    const MixtralWeights w = random_mixtral_weights(c, o->seed);
    if (large)
      std::fprintf(stderr, "init-model: weights generated in %.0f s; writing %s\n",
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), o->out.c_str());
    // The config is written with the model, in one set (G19-2: written after the model's commit, a failure left the
    // new model in place and the old shards removed).
    std::vector<AlsoWritten> also;
    if (!o->save_config.empty())
      also.push_back({{"--save-config", o->save_config}, mixtral_config_to_json(c).dump(2) + "\n"});
    save_mixtral_checkpoint(o->out, w, c, o->shard_bytes, also);
    std::printf("wrote %s: %s\n", o->out.c_str(), c.summary().c_str());
    // As init says it (G21-13 of the twenty-first pass: the config was written without a line).
    if (!o->save_config.empty()) std::printf("wrote %s\n", o->save_config.c_str());
    return 0;
  };
}

Command add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalOptions>();
  CLI::App* sub = app.add_subcommand("eval", "forward (and backward) of a whole Mixtral model on a token batch");
  sub->add_option("--config", o->config,
                  "HF Mixtral config.json (or its model directory), or a named model in bench/models")->required();
  sub->add_option("--weights", o->weights,
                  "model.safetensors, a sharded model.safetensors.index.json, or a model directory")
      ->required();
  sub->add_option("--tokens", o->tokens, "safetensors file with tokens [batch, seq] (I32 or I64)")->required();
  sub->add_option("--output", o->output, "safetensors file for logits, loss (and grad.<name>)")->required();
  sub->add_flag("--grad", o->grad, "also run backward and write grad.<HF name> for every parameter");
  sub->add_option("--world", o->world, "ranks: batch split over ranks, experts sharded E/W (cpu: threads; cuda: the job's processes)")
      ->check(Range(1, 4096));
  sub->add_option("--engine", o->engine, "cpu (ranks as threads) | cuda (aliases ep, gpu; this process's GPU; W > 1: one process per rank, "
                  "dmoe launch -n W)");
  sub->add_option("--dtype", o->dtype, "cuda: f32 | bf16 (the weights and activations the kernels use)");
  return [o] {
    o->engine = model_engine(o->engine);
    DMOE_REQUIRE_INPUT(o->dtype == "f32" || (o->dtype == "bf16" && o->engine == "cuda"),
                       "--dtype '{}' is not allowed with --engine {}; allowed: f32 (cpu, cuda), bf16 (cuda)", o->dtype,
                       o->engine);
    // --world with --engine cuda is the job's size: one process per rank (dmoe launch -n W, mpirun -n W). The CPU
    // engine simulates its ranks as threads of one process: under a launcher each process would run the whole eval
    // and write --output.
    const ProcessEnv job = detect_process_env();
    if (o->engine == "cuda")
      DMOE_REQUIRE_INPUT(job.world == o->world,
                         "eval: --world {} but this GPU job has {} ranks (dmoe launch -n W, mpirun -n W); give --world "
                         "{} or start W processes", o->world, job.world, job.world);
    else
      DMOE_REQUIRE_INPUT(job.world == 1,
                         "eval --engine cpu runs its --world {} ranks as threads of one process, but this is one of {} "
                         "processes ({}): each would compute and write --output; run it alone, or use --engine cuda",
                         o->world, job.world, job.launcher);
    const std::string config_path = find_model_config_file(o->config);
    // Before anything is read or computed: the output is none of the inputs and can be written.
    // The weights may be a model directory or a sharded index: each file it reads is an input (an --output onto a
    // shard, or onto the model.safetensors of a --weights directory, replaced the model with rc 0).
    std::vector<NamedPath> inputs = {{"--config", config_path}, {"--weights", o->weights}, {"--tokens", o->tokens}};
    for (const std::string& f : checkpoint_files(o->weights)) inputs.push_back({"--weights", f});
    require_distinct_files({{"--output", o->output}}, inputs);
    // An --output named as a model inside the model's directory made it hold two models, which every reader then
    // refused (`eval --output ckpt/model.safetensors.index.json` after a sharded save), rc 0.
    {
      namespace fs = std::filesystem;
      std::error_code ec;
      const fs::path weights_dir = fs::is_directory(o->weights, ec) ? fs::path(o->weights)
                                                                     : fs::path(o->weights).parent_path();
      const fs::path out(o->output);
      const std::string name = out.filename().string();
      DMOE_REQUIRE_INPUT(!((name == "model.safetensors" || name == "model.safetensors.index.json") &&
                           same_file(weights_dir.empty() ? "." : weights_dir.string(),
                                     out.parent_path().empty() ? "." : out.parent_path().string())),
                         "--output '{}' is named as a model in the directory of --weights '{}': a reader of that "
                         "directory would find two models (or this output instead of the weights); write it "
                         "elsewhere or under another name, e.g. eval.safetensors", o->output, o->weights);
    }
    check_output_file(o->output, "--output");
    const MixtralConfig c = load_mixtral_config(config_path);
    const HostTensor<int32_t> tokens = read_tokens(o->tokens);
    const int64_t B = tokens.shape[0], S = tokens.shape[1], V = c.vocab_size;
    c.check_sequence(S, "eval --tokens: the sequence length (the tokens' second dimension)", 2);
    // The ranks split the batch's sequences and the experts (the engines' own errors named neither --world nor
    // --tokens: "mixtral: batch = 3 sequences cannot be split evenly over world = 2 ranks").
    DMOE_REQUIRE_INPUT(B % o->world == 0, "eval --world {}: the {} sequences of --tokens {} cannot be split evenly over "
                       "{} ranks (each rank evaluates whole sequences): give a --world that divides {}, or a batch "
                       "that is a multiple of {}", o->world, B, o->tokens, o->world, B, o->world);
    DMOE_REQUIRE_INPUT(c.num_local_experts % o->world == 0, "eval --world {}: the {} experts of --config {} "
                       "(num_local_experts) cannot be split evenly over {} ranks: give a --world that divides {}",
                       o->world, c.num_local_experts, o->config, o->world, c.num_local_experts);
    // Before the weights are read, naming the file: the model's check said "mixtral: token -1 at [0, 0] is outside the
    // vocabulary [0, 256)" after loading the weights, the file and the config it is judged by not named.
    for (size_t t = 0; t < tokens.values.size(); ++t)
      DMOE_REQUIRE_INPUT(tokens.values[t] >= 0 && tokens.values[t] < V, "eval --tokens {}: token {} at [{}, {}] is "
                         "outside the vocabulary [0, {}) of --config {} (vocab_size)", o->tokens, tokens.values[t],
                         int64_t(t) / S, int64_t(t) % S, V, o->config);
    // Before the weights are read: the host's share (the CPU engine's activations; on either engine the logits
    // [B, S, V] as the result, the writer's copy and the serialised file).
    const double logits_bytes = 4.0 * double(B) * double(S) * double(V);
    require_host_memory((o->engine == "cuda" ? 0.0 : model_activation_bytes_lower_bound(double(B) * double(S), double(V),
                                                                                       c.hidden_size, c.num_hidden_layers)) +
                            3 * logits_bytes,
                        fmt::format("eval of tokens [{}, {}] (at least the logits [{}, {}, {}] f32 three times{})", B, S,
                                    B, S, V, o->engine == "cuda" ? "" : ", their gradient and two activations per layer"),
                        std::string("fewer or shorter sequences in --tokens, or ") + kModelSizes);
    // The output's size is known now: a full disk failed the write after the whole forward and backward.
    require_output_space(logits_bytes + (o->grad ? 4.0 * double(c.num_parameters()) : 0.0), o->output, "--output",
                         fmt::format("the logits [{}, {}, {}] f32{}", B, S, V,
                                     o->grad ? " and an f32 gradient per parameter" : ""));
    const MixtralWeights w = load_mixtral_weights(CheckpointReader::open(o->weights), c);
    const EvalResult r = o->engine == "cuda" ? run_cuda_model(c, w, tokens.values, B, S, parse_dtype(o->dtype), o->grad)
                                             : run_cpu_model(c, w, tokens.values, B, S, o->world, o->grad);
    if (r.rank != 0) return 0;  // a GPU job's other ranks: rank 0 holds the gathered result and writes it
    // Finite weights can still overflow float (a loss of nan was written with rc 0): an error, and nothing is written.
    const std::string bad = first_non_finite(r, c, S, o->grad);
    DMOE_REQUIRE_INPUT(bad.empty(), "eval: {} (the weights and tokens are valid: the model overflowed float); nothing "
                       "was written to {}", bad, o->output);

    SafetensorsWriter out;
    out.add_f32("logits", {B, S, V}, r.logits);
    const float loss = float(r.loss), ce = float(r.ce_loss), aux = float(r.aux_loss);
    out.add_f32("loss", {}, &loss);
    out.add_f32("ce_loss", {}, &ce);
    out.add_f32("aux_loss", {}, &aux);
    if (o->grad) add_mixtral_tensors(out, r.grads, c, "grad.");
    out.set_metadata("producer", "dmoe eval");
    out.set_metadata("config", c.summary());
    out.set_metadata("loss", fmt::format("{:.17g}", r.loss));
    out.write(o->output);
    std::printf("%s | batch %lld x %lld | world %d | loss %.6f (ce %.6f, aux %.6f) | wrote %s\n",
                c.summary().c_str(), (long long)B, (long long)S, o->world, r.loss, r.ce_loss, r.aux_loss,
                o->output.c_str());
    return 0;
  };
}

}  // namespace dmoe::cli
