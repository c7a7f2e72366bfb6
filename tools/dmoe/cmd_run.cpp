// dmoe run — one forward (and with --grad-output, backward) of an MoE layer on safetensors files.
//
//   input  --input X:        x [T_total, H] (f32 or bf16); T_total = world * tokens per rank
//   output --output Y:       y [T_total, H], expert_ids [T_total, k] int32, expert_weights [T_total, k];
//                            with --grad-output DY (dy [T_total, H]): dx and "grad." + each weight name.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"
#include "model/checkpoint.hpp"
#include "model/config_io.hpp"
#include "options.hpp"
#include "run_gpu.hpp"

namespace dmoe::cli {

namespace {

struct RunOptions {
  ConfigOptions config;
  std::string weights, input, output, grad_output, prefix, engine = "cpu", output_dtype;  // engine: cpu | ep | flash
  std::optional<int> layer;
  bool allow_non_finite = false;
};

// "y[3, 5] is inf" for the first non-finite value of the results (losses, y, dx, gradients); "" if none.
std::string first_non_finite(const LayerResult& r, const MoeConfig& c, bool backward) {
  if (!std::isfinite(r.losses.load_balance)) return fmt::format("the load-balance loss is {}", r.losses.load_balance);
  if (!std::isfinite(r.losses.z_loss)) return fmt::format("the z-loss is {}", r.losses.z_loss);
  auto scan = [](const std::vector<float>& v, int64_t cols, const char* name) -> std::string {
    for (size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i])) return fmt::format("{}[{}, {}] is {}", name, i / size_t(cols), i % size_t(cols), v[i]);
    return "";
  };
  std::string bad = scan(r.y, c.hidden, "y");
  if (bad.empty()) bad = scan(r.expert_weights, c.top_k, "expert_weights");
  if (!backward) return bad;
  if (bad.empty()) bad = scan(r.dx, c.hidden, "dx");
  if (bad.empty()) bad = scan(r.grads.gate, c.hidden, "the gate's gradient");
  if (bad.empty()) bad = scan(r.grads.w1, c.hidden, "the experts' w1 gradient (stacked)");
  if (bad.empty()) bad = scan(r.grads.w3, c.hidden, "the experts' w3 gradient (stacked)");
  if (bad.empty()) bad = scan(r.grads.w2, c.ffn, "the experts' w2 gradient (stacked)");
  return bad;
}

// `file` (of `option`) must hold the tensor `name` and nothing else: an extra tensor (a mask, a second batch) was
// ignored without a word, rc 0 (G20-4 of the twentieth pass), where eval --tokens refuses one.
void require_only_tensor(const SafetensorsFile& file, const std::string& path, const char* name, const char* option,
                         const char* expected) {
  DMOE_REQUIRE_INPUT(file.has(name), "{}: no tensor '{}' (expected {}); tensors present: {}", path, name, expected,
                     tensor_list(file));
  std::string others;
  for (const std::string& n : file.names())
    if (n != name) others += (others.empty() ? "'" : ", '") + n + "'";
  DMOE_REQUIRE_INPUT(others.empty(), "{} {}: holds {} beside '{}', which run would ignore: run reads {} alone (every "
                     "row is a token; no mask); give a file with '{}' only", option, path, others, name, expected, name);
}

}  // namespace

Command add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  CLI::App* sub = app.add_subcommand("run", "run one MoE layer forward (and backward) on safetensors inputs");
  add_config_options(*sub, o->config);
  sub->add_option("--weights", o->weights, "safetensors file with the layer's weights (Mixtral names)")->required();
  sub->add_option("--input", o->input, "safetensors file holding x [tokens, hidden]")->required();
  sub->add_option("--output", o->output, "safetensors file to write y, expert_ids, expert_weights (, dx, grads)")->required();
  sub->add_option("--grad-output", o->grad_output, "safetensors file holding dy [tokens, hidden]: also run backward");
  // As init's --layer: `--layer -1` was looked up as 'model.layers.-1.block_sparse_moe.gate.weight'.
  sub->add_option("--layer", o->layer, "use model.layers.L.block_sparse_moe. (default: the first MoE layer in the file)")
      ->check(Range(0, 1000000));
  sub->add_option("--prefix", o->prefix, "tensor-name prefix of the layer (instead of --layer)");
  sub->add_option("--engine", o->engine,
                  "cpu (reference engine; config world = simulated ranks) | ep (aliases cuda, gpu; expert parallelism "
                  "on this process's GPU, world 1) | flash (this GPU, the forward as one persistent kernel; bf16; "
                  "--grad-output runs the Flash backward)")
      ->check(CLI::IsMember({"cpu", "ep", "flash", "cuda", "gpu"}));
  sub->add_flag("--allow-non-finite", o->allow_non_finite,
               "write results that hold NaN or Inf (by default they are an error and nothing is written)");
  sub->add_option("--output-dtype", o->output_dtype, "dtype of written activations: f32 | bf16 (default: config dtype)");
  return [o] {
    // cuda and gpu are the older names of ep (one vocabulary with bench and the Python module: cpu | ep | flash).
    if (o->engine == "gpu" || o->engine == "cuda") o->engine = "ep";
    const EngineKind kind = parse_engine_kind(o->engine);
    if (kind == EngineKind::cpu)
      require_one_process("run", "compute the whole layer and write --output", "use --engine ep (this process's GPU)");
    require_prefix_ends_with_dot(o->prefix);
    require_layer_or_prefix(o->layer, o->prefix);
    // Before anything is read or computed: the output must not be one of the inputs, and must be writable.
    require_distinct_files({{"--output", o->output}},
                           {{"--input", o->input},
                            {"--weights", o->weights},
                            {"--grad-output", o->grad_output},
                            {"--config", o->config.config_path.empty() ? std::string()
                                                                       : find_config_file(o->config.config_path)}});
    check_output_file(o->output, "--output");
    // run reads one layer from one safetensors file: a sharded model's index was read as one, its JSON bytes as the
    // header length ("header length 8387229874382703227 is absurd"; F11 of the eighteenth bad-input pass).
    if (std::filesystem::path(o->weights).extension() == ".json") {
      std::string gate, shard;
      try {  // the shard of the layer's gate (--prefix, --layer, else the lowest layer with one), where the index says
        const nlohmann::json j = read_json_file(o->weights, "checkpoint index");
        const nlohmann::json& map = j.at("weight_map");
        if (!o->prefix.empty() || o->layer) {
          gate = gate_name(o->prefix.empty() ? layer_prefix(*o->layer) : o->prefix);
        } else {
          for (int L = 0; L < 100000 && gate.empty(); ++L)
            if (map.contains(gate_name(layer_prefix(L)))) gate = gate_name(layer_prefix(L));
        }
        if (!gate.empty() && map.contains(gate) && map.at(gate).is_string())
          shard = (std::filesystem::path(o->weights).parent_path() / map.at(gate).get<std::string>()).string();
      } catch (const std::exception&) {  // an index that is no JSON, or has no weight_map: the plain advice below
      }
      DMOE_FAIL_INPUT("--weights '{}' is a .json file, a sharded model's index: run reads one MoE layer from one "
                      "safetensors file; {}, or evaluate the whole model with dmoe eval --weights (and train --init), "
                      "which take an index", o->weights,
                      shard.empty() ? "give the shard that holds the layer (the index's weight_map names it)"
                                    : fmt::format("the layer's gate '{}' is in the shard '{}': give that file", gate,
                                                  shard));
    }
    const SafetensorsFile weights_file = SafetensorsFile::open(o->weights);
    const std::string prefix = o->prefix.empty() ? find_moe_prefix(weights_file, o->layer) : o->prefix;
    // Without --config the shapes come from the weights file; top_k must then be given. kTopKUnknown marks
    // "nobody said" apart from a top_k of 0 given by a flag or the file (which validate() names).
    // A top_k of -1 given by the flag or the file is told apart by resolving again with another mark (it was taken for
    // "nobody said": `--top-k -1` was answered "the weights file does not record it; pass --top-k K").
    constexpr int32_t kTopKUnknown = -1, kTopKUnknownToo = -2;
    // tokens likewise: "not given" was tokens == 0, so `--tokens 0` (or "tokens": 0 in the config) was taken as not
    // given and replaced by x's rows without a word, where init refuses it (G20-9). No option or file gives INT64_MIN.
    constexpr int64_t kTokensUnknown = std::numeric_limits<int64_t>::min();
    const MoeConfig inferred = o->config.config_path.empty() ? infer_moe_config(weights_file, prefix) : MoeConfig{};
    const auto resolved_with = [&](int32_t mark) {
      MoeConfig m = inferred;
      m.top_k = mark;
      m.tokens = kTokensUnknown;
      return resolve_config(o->config, m);
    };
    MoeConfig c = resolved_with(kTopKUnknown);
    const bool tokens_given = c.tokens != kTokensUnknown;
    DMOE_REQUIRE_INPUT(c.top_k != kTopKUnknown || resolved_with(kTopKUnknownToo).top_k != kTopKUnknownToo,
                       "top_k is not known: {} does not record it; pass --top-k K (1 <= K <= experts = {})",
                       o->config.config_path.empty() ? "the weights file " + o->weights
                                                     : "--config " + o->config.config_path,
                       c.experts);

    // A tokens or world below 1 is refused as init and bench refuse it, naming where it came from: `--world -8` was
    // "x has 8 tokens, not divisible by world = -8" (G20-10), `--tokens 0` replaced by x's rows (G20-9).
    if ((tokens_given && c.tokens < 1) || c.world < 1) {
      MoeConfig judged = c;
      if (!tokens_given) judged.tokens = 1;
      validate_config(judged, o->config);
    }
    const SafetensorsFile input = SafetensorsFile::open(o->input);
    require_only_tensor(input, o->input, "x", "--input", "x [tokens, hidden]");
    const TensorInfo& xi = input.info("x");
    DMOE_REQUIRE_INPUT(xi.shape.size() == 2, "{}: x has shape {}; expected [tokens, hidden]", o->input,
                       shape_string(xi.shape));
    const int64_t total = xi.shape[0];
    DMOE_REQUIRE_INPUT(total % c.world == 0, "{}: x has {} tokens, not divisible by world = {}", o->input, total,
                       c.world);
    const int64_t per_rank = total / c.world;
    // Tokens come from the input; tokens given by --tokens or by the --config file must agree with it.
    DMOE_REQUIRE_INPUT(!tokens_given || c.tokens == per_rank,
                       "tokens = {} per rank ({}), but x in {} holds {} rows for world = {} ranks ({} per rank); drop "
                       "tokens or make it match", c.tokens,
                       o->config.tokens ? std::string("--tokens") : "from --config " + o->config.config_path, o->input,
                       total, c.world, per_rank);
    c.tokens = per_rank;
    validate_config(c, o->config, {{"tokens", fmt::format("the rows of x in --input {} over world = {} ranks", o->input,
                                                          c.world)}});
    require_routing_flags_used(o->config, c, !o->grad_output.empty(), "run", "add --grad-output FILE (dy)");
    // G22B-6: a backward fault without --grad-output was reported only after the run, its --output written.
    require_fault_reachable("run", c.world, "", !o->grad_output.empty(), "add --grad-output FILE (dy)");
    // What the engine cannot run is said before the weights are read (a build without CUDA says so below).
    if (kind != EngineKind::cpu && cuda_engines_built()) {
      MoeEngineOptions engine_options;
      engine_options.backward = !o->grad_output.empty();
      const std::string why = moe_engine_unusable_reason(kind, c, engine_options);
      DMOE_REQUIRE_INPUT(why.empty(), "--engine {}: {}", o->engine, why);
    }

    // The output's size is known now: a full disk failed the write after the layer had run.
    const DType out_dtype = o->output_dtype.empty() ? c.dtype : parse_dtype(o->output_dtype);
    {
      const double es = out_dtype == DType::bf16 ? 2.0 : 4.0, rows = double(total), H = double(c.hidden);
      const double params = double(c.experts) * H *
                            (1.0 + double(c.ffn) * (c.activation == Activation::swiglu ? 3.0 : 2.0));
      const bool backward = !o->grad_output.empty();
      require_output_space(rows * H * es * (backward ? 2 : 1) + rows * double(c.top_k) * 8 + (backward ? 4 * params : 0),
                           o->output, "--output", backward ? "y, the routing, dx and the f32 weight gradients"
                                                           : "y and the routing");
    }
    const std::vector<float> x = input.read_f32("x", {total, c.hidden});
    const MoeWeights w = load_moe_weights(weights_file, c, prefix);
    std::vector<float> dy;
    if (!o->grad_output.empty()) {
      const SafetensorsFile g = SafetensorsFile::open(o->grad_output);
      require_only_tensor(g, o->grad_output, "dy", "--grad-output", "dy [tokens, hidden]");
      dy = g.read_f32("dy", {total, c.hidden});
    }

    // Non-finite inputs would reach the router as NaN logits; name the first bad element instead.
    auto require_finite = [&](const std::vector<float>& v, const char* name, const std::string& file) {
      for (size_t i = 0; i < v.size(); ++i)
        DMOE_REQUIRE_INPUT(std::isfinite(v[i]), "{}: {}[{}, {}] is {}; inputs must be finite", file, name,
                           i / size_t(c.hidden), i % size_t(c.hidden), v[i]);
    };
    require_finite(x, "x", o->input);
    if (!dy.empty()) require_finite(dy, "dy", o->grad_output);

    if (kind == EngineKind::cpu) check_cpu_engine_cost(c, dy.empty() ? 1 : 0, dy.empty() ? 0 : 1);
    GpuLayerResult gpu;
    if (kind != EngineKind::cpu) gpu = run_gpu_layer(kind, c, w, x, dy.empty() ? nullptr : &dy);
    const LayerResult r = kind == EngineKind::cpu ? run_cpu_layer(c, w, x, dy.empty() ? nullptr : &dy) : gpu.layer;
    const bool losses = kind == EngineKind::cpu || gpu.losses_computed;  // Flash without --grad-output: inference, none

    // Finite inputs and weights can still overflow (x ~ 1e38): a NaN or Inf in the results is an error by
    // default, and nothing is written.
    const std::string bad = first_non_finite(r, c, !dy.empty());
    if (!bad.empty()) {
      DMOE_REQUIRE_INPUT(o->allow_non_finite,
                         "{} (inputs and weights are finite: the layer overflowed float); nothing was written to {}; "
                         "pass --allow-non-finite to write such results anyway", bad, o->output);
      std::fprintf(stderr, "warning: %s; writing it anyway (--allow-non-finite)\n", bad.c_str());
    }

    SafetensorsWriter out;
    out.add_f32("y", {total, c.hidden}, r.y, out_dtype);
    out.add_i32("expert_ids", {total, c.top_k}, r.expert_ids);
    out.add_f32("expert_weights", {total, c.top_k}, r.expert_weights, DType::f32);
    if (!dy.empty()) {
      out.add_f32("dx", {total, c.hidden}, r.dx, out_dtype);
      add_moe_grads(out, r.grads, prefix, DType::f32);
    }
    out.set_metadata("producer", "dmoe run");
    out.set_metadata("config", c.summary());
    out.set_metadata("engine", o->engine);
    if (losses) {  // left out, not written as 0, when the engine did not compute them
      out.set_metadata("load_balance_loss", fmt::format("{:.17g}", r.losses.load_balance));
      out.set_metadata("z_loss", fmt::format("{:.17g}", r.losses.z_loss));
    }
    out.set_metadata("dropped_assignments", std::to_string(r.dropped()));
    out.write(o->output);
    const std::string loss_text =
        losses ? fmt::format("load-balance loss {:.6g} | z-loss {:.6g}", r.losses.load_balance, r.losses.z_loss)
               : std::string("losses not computed (flash without --grad-output runs the inference forward)");
    std::printf("%s | engine %s | %s | dropped %lld | wrote %s\n", c.summary().c_str(), o->engine.c_str(),
                loss_text.c_str(), (long long)r.dropped(), o->output.c_str());
    return 0;
  };
}

}  // namespace dmoe::cli
