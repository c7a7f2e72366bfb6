// dmoe bench [layer] — times the MoE layer on the engines available here and prints a table.
//
// On a machine without a GPU this times the CPU reference engine at W = 1 and W = 4 simulated ranks
// (tokens per rank fixed) and checks each against the single-rank run of all W*T tokens.
//   GFLOP/s = W · (2·m·T·k·H·I + 2·T·H·E) / time, m = 3 for SwiGLU else 2 (forward);
//   backward counts 2× the forward FLOPs.   tokens/s = W·T / time.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "bench_gpu.hpp"
#include "comm/process_env.hpp"
#include "commands.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "core/random.hpp"
#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"
#include "model/mixtral_config.hpp"
#include "options.hpp"

namespace dmoe::cli {

namespace {

struct BenchOptions {
  std::string what = "layer";
  ConfigOptions config;
  std::vector<int32_t> worlds{1, 4};
  int warmup = 1;
  int repeat = 3;
  std::string json_path;
  bool no_backward = false;
  std::string engine = "auto";
  std::string comm = "auto";
  bool peers = false;
  std::string python = "python3";
  int check_tokens = 8;
  int batch_row_multiple = 1;
  bool alltoall = false;
  bool flash = false;
  std::string gemm_variants = "b256,b256s,b256E,b256M,b128";
  bool gemm_square = false;
  bool gemm_dgrad = false;
  bool gemm_wgrad = false;
  int64_t batch = 8, seq = 1024;  // model
  bool f32_expert_grads = false;  // model
};

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

template <typename F>
Timing time_host(int warmup, int repeat, const char* label, F&& fn) {
  // Progress on a terminal (one line, rewritten, at most 10 times a second); elsewhere (logs, CI) a line once the
  // timing has run for more than 2 s, then one every 5 s, so a slow config is never silent and a fast one stays clean.
  // (A line per call flooded a pipe with ~4400 lines a second, GBs over a long run: F13 of the eighteenth bad-input
  // pass; flow measure --progress is throttled the same way.)
  const bool terminal = ::isatty(2);
  const auto start = std::chrono::steady_clock::now();
  double next_report_s = terminal ? 0.0 : 2.0;
  auto report = [&](const char* phase, int done, int total, double last_ms) {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (elapsed < next_report_s && done != total) return;
    if (terminal) {
      std::fprintf(stderr, "\r  %s %s: %d/%d (%.0f ms)   ", label, phase, done, total, last_ms);
      next_report_s = elapsed + 0.1;
    } else if (elapsed >= next_report_s) {
      std::fprintf(stderr, "  %s %s: %d/%d (%.0f ms, %.0f s so far)\n", label, phase, done, total, last_ms, elapsed);
      next_report_s = elapsed + 5.0;
    }
  };
  for (int i = 0; i < warmup; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    report("warm-up", i + 1, warmup,
           std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::vector<double> ms;
  for (int i = 0; i < repeat; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    report("timed", i + 1, repeat, ms.back());
  }
  if (terminal) std::fprintf(stderr, "\r%*s\r", 70, "");
  std::sort(ms.begin(), ms.end());
  return Timing{ms[ms.size() / 2], ms.front(), ms.back()};
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app.add_subcommand("bench", "time the MoE layer and print a table (CPU engine without a GPU)");
  sub->add_option("what", o->what, "what to time: layer, gemm (GPU: the own grouped GEMM's variants), or model (GPU: "
                  "a whole Mixtral model's training step; --config a model of bench/models or a config.json)")
      ->check(CLI::IsMember({"layer", "gemm", "model"}));
  add_config_options(*sub, o->config);
  CLI::Option* worlds_option =
      sub->add_option("-n,--worlds", o->worlds, "CPU: simulated rank counts to run (each divides E; --world W = -n W)");
  sub->add_option("--warmup", o->warmup, "untimed iterations first")->check(Range(0, 1000000));
  sub->add_option("--repeat", o->repeat, "timed iterations (median reported)")->check(Range(1, 1000000));
  sub->add_option("--json", o->json_path, "also write the results as JSON here");
  sub->add_flag("--no-backward", o->no_backward, "time the forward pass only");
  sub->add_option("--engine", o->engine,
                  "auto (ep when a GPU is visible, else cpu) | cpu | ep (aliases cuda, gpu) | flash (GPU, bf16: the "
                  "Flash engine alone: forward, train forward and training step)")
      ->check(CLI::IsMember({"auto", "cpu", "ep", "flash", "cuda", "gpu"}));
  sub->add_option("--comm", o->comm, "GPU communicator for W > 1: auto | nccl | nvshmem")
      ->check(CLI::IsMember({"auto", "nccl", "nvshmem"}));
  sub->add_flag("--peers", o->peers, "GPU, W = 1: also time the PyTorch peers (bench/peers.py) on the same data");
  sub->add_option("--python", o->python, "Python interpreter with PyTorch for --peers");
  sub->add_option("--check-tokens", o->check_tokens, "GPU: tokens recomputed in fp64 on the CPU to check the output")
      ->check(Range(0, 64));
  sub->add_flag("--flash", o->flash,
                "GPU, bf16: also time the Flash kernel (one persistent kernel per rank) beside EP, in the same rounds, "
                "and Flash's training step beside EP's (--engine flash times Flash alone)");
  sub->add_flag("--alltoall", o->alltoall,
                "GPU, W > 1: also time one all-to-all of the layer's off-rank bytes alone (GB/s per GPU)");
  sub->add_option("--batch-row-multiple", o->batch_row_multiple,
                  "GPU: pad each expert's batch with zero rows to a multiple of this (GEMM tile height)")
      ->check(Range(1, 4096));
  sub->add_option("--variants", o->gemm_variants,
                  "gemm: kernel variants, comma-separated: b<N> tile width, s staged / d direct epilogue, q dynamic tile "
                  "schedule; to "
                  "place time (wrong results): E stores left out, M products and stores left out (e.g. b256,b256E)");
  sub->add_flag("--square", o->gemm_square, "gemm: also an 8192^3 product per variant");
  sub->add_flag("--dgrad", o->gemm_dgrad,
                "gemm: also the backward's input-gradient products (dh = dout·w2, dx = dpre·w1) on the own NN "
                "kernel per variant and on cuBLAS (variant cublas)");
  sub->add_flag("--wgrad", o->gemm_wgrad,
                "gemm: also the backward's weight gradients (dw1, dw3 for SwiGLU, dw2), stored and accumulated, on the "
                "sm90 kernel (sm90; sm90red: accumulating by L2 reductions), the mma.sync kernel (mma) and one cuBLAS "
                "call per expert (cublas)");
  CLI::Option* batch_option =
      sub->add_option("--batch", o->batch, "model: sequences per step")->check(Range(int64_t(1), int64_t(1) << 20));
  CLI::Option* seq_option =
      sub->add_option("--seq", o->seq, "model: sequence length")->check(Range(int64_t(2), int64_t(1) << 24));
  CLI::Option* f32_grads_option = sub->add_flag(
      "--f32-expert-grads", o->f32_expert_grads,
      "model, bf16: keep the experts' gradients in f32, as dmoe train does with several micro-batches or a Flow "
      "schedule (default: bf16 where the experts are large enough for it to pay, as dmoe train does with one "
      "micro-batch; src/model/cuda/cuda_mixtral.hpp)");
  return [o, sub, worlds_option, batch_option, seq_option, f32_grads_option] {
    // A model's options on another benchmark would be ignored: refuse them instead.
    for (const CLI::Option* opt : {batch_option, seq_option})
      DMOE_REQUIRE_INPUT(o->what == "model" || opt->count() == 0,
                         "{} is an option of `dmoe bench model` (a whole model's step); `dmoe bench {}` times one "
                         "layer's tokens: give --tokens instead", opt->get_name(), o->what);
    DMOE_REQUIRE_INPUT(o->what == "model" || f32_grads_option->count() == 0,
                       "--f32-expert-grads is an option of `dmoe bench model` (a whole model's step; `dmoe bench {}` "
                       "would ignore it)", o->what);
    // So would the GEMM benchmark's outside it, and a layer's shape and engine options on a whole model's step
    // (its shapes come from the model config; --dtype, --warmup, --repeat, --json apply).
    for (const char* name : {"--variants", "--square", "--dgrad", "--wgrad"})  // --wgrad was left out: ignored
      DMOE_REQUIRE_INPUT(o->what == "gemm" || sub->count(name) == 0, "{} is an option of `dmoe bench gemm`; `dmoe "
                         "bench {}` would ignore it", name, o->what);
    if (o->what == "model")
      for (const char* name : {"--tokens", "--hidden", "--ffn", "--experts", "--top-k", "--activation",
                               "--capacity-factor", "--drop-policy", "--world", "--aux-loss-coef", "--z-loss-coef",
                               "--no-renormalize", "--worlds", "--no-backward", "--engine", "--comm", "--peers",
                               "--python", "--check-tokens", "--flash", "--alltoall", "--batch-row-multiple"})
        DMOE_REQUIRE_INPUT(sub->count(name) == 0, "{} is an option of `dmoe bench layer`; `dmoe bench model` takes the "
                           "model's shapes from --config (and --batch, --seq, --dtype) and would ignore it", name);
    // bench gemm times one rank's expert products (world 1: run_gpu_gemm_bench sets it) with the kernel benchmark's
    // own warm-up and rounds: the layer's run options were accepted and ignored there (`bench gemm --world 4 --repeat
    // 100 --no-backward` timed W = 1 with the default rounds, rc 0).
    if (o->what == "gemm")
      for (const char* name : {"--world", "--worlds", "--no-backward", "--engine", "--comm", "--peers", "--python",
                               "--check-tokens", "--flash", "--alltoall", "--batch-row-multiple", "--warmup",
                               "--repeat"})
        DMOE_REQUIRE_INPUT(sub->count(name) == 0, "{} is an option of `dmoe bench layer`; `dmoe bench gemm` times one "
                           "rank's expert products (world 1, on this GPU) with its own warm-up and rounds, and would "
                           "ignore it", name);
    DMOE_REQUIRE_INPUT(sub->count("--python") == 0 || o->peers, "--python names the interpreter of --peers; without "
                       "--peers it would be ignored");
    // A benchmark can run for minutes: find out now, not after it, that its JSON cannot be written.
    if (!o->json_path.empty()) {
      require_distinct_files({{"--json", o->json_path}},
                             {{"--config", o->config.config_path.empty() ? std::string()
                                           : o->what == "model" ? find_model_config_file(o->config.config_path)
                                                                : find_config_file(o->config.config_path)}});
      check_output_file(o->json_path, "--json");
      // G22B-3: on a file system with no space left (or under ulimit -f 0) the whole benchmark ran, then its write
      // failed. Checked now, as run and init check theirs, against a lower bound of the file (a one-row result is
      // ~650 B): no benchmark whose results fit is refused.
      require_output_space(256, o->json_path, "--json", "at the least: the benchmark's results as JSON");
    }
    if (o->what == "model") {
      DMOE_REQUIRE_INPUT(gpu_available(), "dmoe bench model times a whole model on the GPU: no CUDA device is visible "
                         "(or this build has no CUDA); `dmoe train --engine cpu` trains on the CPU");
      ModelBenchArgs m;
      m.config_name = o->config.config_path.empty() ? "gpt2-tiny-moe" : o->config.config_path;
      m.config = load_mixtral_config(find_model_config_file(m.config_name));
      m.batch = o->batch;
      m.seq = o->seq;
      const std::string dt = o->config.dtype.value_or("bf16");
      DMOE_REQUIRE_INPUT(dt == "f32" || dt == "bf16", "--dtype '{}' is not allowed; allowed: f32, bf16", dt);
      m.dtype = parse_dtype(dt);
      m.warmup = std::max(1, o->warmup);
      m.repeat = o->repeat;
      m.json_path = o->json_path;
      DMOE_REQUIRE_INPUT(!o->f32_expert_grads || m.dtype == DType::bf16, "--f32-expert-grads: an f32 model's "
                         "gradients are all f32 already (it applies to --dtype bf16)");
      m.bf16_expert_grads = !o->f32_expert_grads;
      return run_gpu_model_bench(m);
    }
    if (o->what == "gemm") {
      DMOE_REQUIRE_INPUT(gpu_available(), "dmoe bench gemm times the own GPU kernel: no CUDA device is visible (or this "
                         "build has no CUDA)");
      GpuBenchArgs g;
      ConfigOptions co = o->config;
      if (co.config_path.empty()) co.config_path = "fine-grained";
      g.config = resolve_config(co);
      g.config_name = co.config_path;
      g.json_path = o->json_path;
      g.gemm_variants = o->gemm_variants;
      g.gemm_square = o->gemm_square;
      g.gemm_dgrad = o->gemm_dgrad;
      g.gemm_wgrad = o->gemm_wgrad;
      return run_gpu_gemm_bench(g);
    }
    const bool backward = !o->no_backward;
    // cuda and gpu are the older names of ep; auto is ep when a GPU is visible.
    const std::string engine = o->engine == "gpu" || o->engine == "cuda" ? "ep" : o->engine;
    const bool use_gpu = engine == "ep" || engine == "flash" || (engine == "auto" && gpu_available());
    DMOE_REQUIRE_INPUT(!(engine == "flash" && o->flash),
                       "--engine flash times the Flash kernel alone, and --flash times it beside EP in the same rounds; "
                       "give one of them");
    if (engine == "flash" && cuda_engines_built()) {
      // Checked before the GPU is looked at, so that the rule shows on any machine.
      ConfigOptions co = o->config;
      if (co.config_path.empty()) co.config_path = "flash-paper";  // the GPU run's default below
      const MoeConfig checked = resolve_config(co);
      MoeEngineOptions engine_options;
      engine_options.backward = false;
      const std::string why = moe_engine_unusable_reason(EngineKind::flash, checked, engine_options);
      DMOE_REQUIRE_INPUT(why.empty(), "--engine flash: {}", why);
    }
    DMOE_REQUIRE_INPUT(!((engine == "ep" || engine == "flash") && !gpu_available()),
                 "--engine {}: no CUDA device is visible (or this build has no CUDA); use --engine cpu", o->engine);
    if (use_gpu) {
      GpuBenchArgs g;
      ConfigOptions co = o->config;
      if (co.config_path.empty()) co.config_path = "flash-paper";
      g.config = resolve_config(co);
      require_routing_flags_used(o->config, g.config, backward, "bench", "leave out --no-backward");
      // On the GPU the ranks are processes: a --world that is not this job's size would be ignored.
      const int32_t job_world = detect_process_env().world;
      DMOE_REQUIRE_INPUT(!o->config.world || *o->config.world == job_world,
                         "--world {}: on the GPU the ranks are processes and this job has {}; start W ranks with "
                         "dmoe launch -n W -- dmoe bench ... (or mpirun), or use --engine cpu for simulated ranks",
                         *o->config.world, job_world);
      require_fault_reachable("bench", job_world, "", backward, "leave out --no-backward");  // G22B-6
      g.config_name = co.config_path;
      g.comm = o->comm;
      g.backward = backward;
      g.peers = o->peers;
      g.python = o->python;
      g.json_path = o->json_path;
      g.check_tokens = o->check_tokens;
      g.batch_row_multiple = o->batch_row_multiple;
      g.alltoall = o->alltoall;
      g.flash = o->flash;
      g.engine = engine == "flash" ? EngineKind::flash : EngineKind::ep;
      g.warmup = std::max(o->warmup, 3);
      return run_gpu_layer_bench(g);
    }
    if (o->alltoall) std::fprintf(stderr, "note: --alltoall times the GPU communicators; ignored on the CPU\n");
    if (sub->count("--check-tokens"))
      std::fprintf(stderr, "note: --check-tokens is the GPU run's check; ignored on the CPU, whose every output is "
                   "compared with a single-rank run (max|y-ref|)\n");
    if (sub->count("--batch-row-multiple"))
      std::fprintf(stderr, "note: --batch-row-multiple pads the GPU's expert batches; ignored on the CPU\n");
    if (o->comm != "auto")
      std::fprintf(stderr, "note: --comm %s picks a GPU communicator; ignored on the CPU (ranks are threads)\n",
                   o->comm.c_str());
    DMOE_REQUIRE_INPUT(!o->peers, "--peers times the PyTorch peers on the GPU; this run is on the CPU engine (no GPU "
                       "visible, or --engine cpu), which has no peers to compare with");
    DMOE_REQUIRE_INPUT(!o->flash, "--flash times the Flash GPU kernel; this run is on the CPU engine (no GPU visible, or "
                 "--engine cpu). The CPU twin of the Flash protocol is tested by the unit tests");
    require_one_process("bench", "time the whole benchmark on the same cores as the others (their work in its times) "
                        "and write --json", "use --engine ep on a GPU (one rank per process)");
    MoeConfig defaults;  // small enough for a 2-core machine: ~0.2 GFLOP per rank per forward
    defaults.tokens = 128;
    defaults.hidden = 256;
    defaults.ffn = 512;
    defaults.experts = 8;
    defaults.top_k = 2;
    defaults.activation = Activation::swiglu;
    MoeConfig base = resolve_config(o->config, defaults);
    require_routing_flags_used(o->config, base, backward, "bench", "leave out --no-backward");
    // A world from --world or the config file is the one rank count to run, unless -n says otherwise.
    std::vector<int32_t> worlds = o->worlds;
    // `-n 1 -n 1` ran and printed W = 1 twice (two JSON entries), without a word (G20-15): a count once each.
    for (size_t i = 0; i < worlds.size(); ++i)
      for (size_t j = 0; j < i; ++j)
        DMOE_REQUIRE_INPUT(worlds[i] != worlds[j], "-n/--worlds {}: W = {} is given twice; give each rank count once "
                           "(each is run and printed once per value)", fmt::join(o->worlds, " "), worlds[i]);
    if (o->config.world || base.world != 1) {
      DMOE_REQUIRE_INPUT(worlds_option->count() == 0 || o->worlds == std::vector<int32_t>{base.world},
                         "world = {} (from {}) and -n/--worlds {} disagree; give the rank counts once", base.world,
                         o->config.world ? "--world" : "--config " + o->config.config_path, fmt::join(o->worlds, " "));
      worlds = {base.world};
    }
    validate_config(base, o->config);
    base.world = 1;
    // G22B-6: DMOE_FAULT against the whole run, not each row: -n 1 4 with a fault on rank 3 was refused at its W = 1
    // row, and a backward fault under --no-backward was reported after the run, its --json written.
    require_fault_reachable("bench", *std::max_element(worlds.begin(), worlds.end()),
                            worlds.size() > 1 ? fmt::format("the largest W of -n {}", fmt::join(worlds, " ")) : "",
                            backward, "leave out --no-backward");

    // Before anything is timed: each world's memory and time (warm-ups, timed calls, the reference run).
    for (int32_t world : worlds) {
      MoeConfig c = base;
      c.world = world;
      c.validate();
      check_cpu_engine_cost(c, o->warmup + o->repeat + 1, backward ? o->warmup + o->repeat : 0);
    }
    nlohmann::json results = nlohmann::json::array();
    std::printf("engine: cpu reference (simulated ranks as threads); time = median of %d after %d warm-up\n",
                o->repeat, o->warmup);
    // One cold call is no median: its first-touch costs land in whichever column runs first.
    if (o->repeat < 3 || o->warmup < 1)
      std::fprintf(stderr, "note: --repeat %d --warmup %d: each time is %s; for a comparable number give --repeat >= 3 "
                   "and --warmup >= 1\n", o->repeat, o->warmup,
                   o->warmup < 1 ? "taken from cold calls (the first call pays the allocations)" : "a median of fewer "
                   "than 3 calls");
    std::printf("%-44s %3s %10s %9s %10s %11s %12s %12s\n", "config", "W", "fwd ms", "GFLOP/s", "fwd+bwd ms",
                "GFLOP/s", "tokens/s", "max|y-ref|");
    std::fflush(stdout);  // a slow config's header shows at once, also through a pipe
    for (int32_t world : worlds) {
      MoeConfig c = base;
      c.world = world;
      c.validate();
      MoeConfig single = base;
      single.tokens = base.tokens * world;
      const double params = double(c.experts) * c.hidden * (1.0 + expert_matrices(c.activation) * double(c.ffn));
      if (params > 2e8) std::fprintf(stderr, "  generating %.3g random weights for W=%d\n", params, world);
      const MoeWeights w = random_moe_weights(single, 1);
      Rng rng(2);
      const auto x = rng.normal_vector(size_t(single.tokens * c.hidden), 1.0);
      const auto dy = rng.normal_vector(x.size(), 1.0);

      LayerResult r;
      const std::string label = fmt::format("W={} forward", world);
      const Timing fwd = time_host(o->warmup, o->repeat, label.c_str(), [&] { r = run_cpu_layer(c, w, x, nullptr); });
      Timing both;
      if (backward)
        both = time_host(o->warmup, o->repeat, fmt::format("W={} forward+backward", world).c_str(), [&] { run_cpu_layer(c, w, x, &dy); });
      if (fwd.median_ms > 2000)
        std::fprintf(stderr, "  W=%d: the single-rank reference run (all %lld tokens on one thread)\n", world,
                     (long long)single.tokens);
      const LayerResult ref = run_cpu_layer(single, w, x, nullptr);
      const double diff = max_abs_diff(r.y, ref.y);

      // FLOPs of all ranks: experts (rows actually kept) + router.
      int64_t kept = 0;
      for (auto n : r.kept) kept += n;
      const double m = c.activation == Activation::swiglu ? 3 : 2;
      const double flops = 2 * m * double(kept) * c.hidden * c.ffn + 2.0 * world * c.tokens * c.hidden * c.experts;
      const double tokens = double(world) * c.tokens;
      // With --no-backward the fwd+bwd columns say "not timed" and the JSON has no such keys: a zero time
      // would print as an absurd rate.
      const std::string both_ms = backward ? fmt::format("{:.2f}", both.median_ms) : "not timed";
      const std::string both_rate = backward ? fmt::format("{:.2f}", 3 * flops / both.median_ms * 1e-6) : "-";
      std::printf("%-44s %3d %10.2f %9.2f %10s %11s %12.0f %12.3g\n", c.summary().c_str(), world, fwd.median_ms,
                  flops / fwd.median_ms * 1e-6, both_ms.c_str(), both_rate.c_str(), tokens / fwd.median_ms * 1e3, diff);
      // With drops the two runs differ by design (a max|y-ref| of 0.13 was shown as if the engine were wrong).
      if (c.capacity_factor > 0 && world > 1 && diff > 0)
        std::fprintf(stderr, "  note: W=%d: capacity_factor %g drops per (source rank, expert) on W ranks but per "
                     "expert on the single-rank reference, so max|y-ref| is not expected to be 0 here (it is with "
                     "capacity_factor 0)\n", world, c.capacity_factor);
      // A layer of a few thousand FLOPs is timed by the engine's per-call work (threads woken, buffers sized), not its
      // arithmetic: 1x1 shapes printed "GFLOP/s 0.00" and a forward+backward faster than the forward, unremarked.
      // Under ~1 MFLOP a call (well under 0.1 ms of math on one core) the rows say so.
      const bool overhead_bound = flops < 1e6;
      if (overhead_bound)
        std::fprintf(stderr, "  note: W=%d: %.3g FLOP per forward, so these times are the engine's per-call overhead "
                     "(threads, buffers), not its arithmetic: GFLOP/s is no measure of the math at this size\n", world,
                     flops);
      nlohmann::json row = {{"engine", "cpu"}, {"config", c.summary()}, {"world", world}, {"overhead_bound", overhead_bound},
                            {"tokens_per_rank", c.tokens}, {"forward_ms", {{"median", fwd.median_ms}, {"min", fwd.min_ms}, {"max", fwd.max_ms}}},
                            {"forward_flop", flops}, {"forward_gflops", flops / fwd.median_ms * 1e-6},
                            {"tokens_per_s", tokens / fwd.median_ms * 1e3}, {"max_abs_diff_vs_single_rank", diff},
                            {"flop_formula", "2*m*rows_kept*H*I + 2*W*T*H*E (m=3 swiglu, else 2); fwd+bwd = 3x"}};
      if (backward) {
        row["forward_backward_ms"] = {{"median", both.median_ms}, {"min", both.min_ms}, {"max", both.max_ms}};
        row["forward_backward_gflops"] = 3 * flops / both.median_ms * 1e-6;
      }
      results.push_back(row);
      std::fflush(stdout);
    }
    if (!o->json_path.empty()) {
      write_file_atomically(o->json_path, results.dump(2) + "\n");
      std::printf("wrote %s\n", o->json_path.c_str());
    }
    return 0;
  };
}

}  // namespace dmoe::cli
