// The dmoe command end to end on a tiny config: init → run (forward + backward) → check the written
// tensors against the library's reference engine; and the errors a user sees for bad input.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.hpp"
#include "engine/reference.hpp"
#include "model/checkpoint.hpp"
#include "model/config_io.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

using Result = test::CliResult;
using test::run_cli;

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const char* name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

TEST_F(Cli, InitRunForwardBackwardMatchesLibrary) {
  auto init = run_cli("init --tokens 6 --hidden 16 --ffn 12 --experts 4 --top-k 2 --world 2 --seed 5 --out " +
                      p("w.safetensors") + " --input " + p("x.safetensors") + " --grad-output " + p("dy.safetensors") +
                      " --save-config " + p("c.json"));
  ASSERT_EQ(init.status, 0) << init.output;
  auto run = run_cli("run --config " + p("c.json") + " --weights " + p("w.safetensors") + " --input " +
                     p("x.safetensors") + " --grad-output " + p("dy.safetensors") + " --output " + p("y.safetensors"));
  ASSERT_EQ(run.status, 0) << run.output;

  const MoeConfig c = load_config_file(p("c.json"));
  const auto wf = SafetensorsFile::open(p("w.safetensors"));
  const MoeWeights w = load_moe_weights(wf, c, layer_prefix(0));
  const auto x = SafetensorsFile::open(p("x.safetensors")).read_f32("x", {12, 16});
  const auto dy = SafetensorsFile::open(p("dy.safetensors")).read_f32("dy", {12, 16});
  const LayerResult ref = run_cpu_layer(c, w, x, &dy);

  const auto out = SafetensorsFile::open(p("y.safetensors"));
  EXPECT_EQ(out.read_f32("y", {12, 16}), ref.y);
  EXPECT_EQ(out.read_i32("expert_ids", {12, 2}), ref.expert_ids);
  EXPECT_EQ(out.read_f32("expert_weights", {12, 2}), ref.expert_weights);
  EXPECT_EQ(out.read_f32("dx", {12, 16}), ref.dx);
  EXPECT_EQ(out.read_f32("grad.model.layers.0.block_sparse_moe.gate.weight", {4, 16}), ref.grads.gate);
  EXPECT_EQ(out.read_f32("grad.model.layers.0.block_sparse_moe.experts.3.w2.weight", {16, 12}),
            std::vector<float>(ref.grads.w2.begin() + 3 * 16 * 12, ref.grads.w2.end()));
}

TEST_F(Cli, RunsFromMixtralConfigJsonAndBf16Weights) {
  std::ofstream(p("config.json")) << R"({"architectures": ["MixtralForCausalLM"], "hidden_size": 16,
    "intermediate_size": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "hidden_act": "silu",
    "num_hidden_layers": 2, "torch_dtype": "bfloat16"})";
  ASSERT_EQ(run_cli("init --config " + p("config.json") + " --tokens 5 --layer 1 --out " + p("w.safetensors") +
                    " --input " + p("x.safetensors")).status, 0);
  auto run = run_cli("run --config " + p("config.json") + " --weights " + p("w.safetensors") + " --input " +
                     p("x.safetensors") + " --output " + p("y.safetensors"));
  ASSERT_EQ(run.status, 0) << run.output;
  const auto out = SafetensorsFile::open(p("y.safetensors"));
  EXPECT_EQ(out.info("y").dtype, "BF16");
  EXPECT_EQ(out.info("expert_ids").shape, (std::vector<int64_t>{5, 2}));
}

TEST_F(Cli, BadInputGivesClearErrors) {
  ASSERT_EQ(run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("w.safetensors") +
                    " --input " + p("x.safetensors")).status, 0);
  // Wrong top-k for the file: shapes are fine, so this runs; a wrong hidden size must not.
  auto r = run_cli("run --hidden 9 --top-k 2 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
                   " --output " + p("y.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("error"), std::string::npos) << r.output;
  r = run_cli("run --top-k 9 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") + " --output " +
              p("y.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("top_k"), std::string::npos) << r.output;
  r = run_cli("run --top-k 2 --world 3 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
              " --output " + p("y.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("world"), std::string::npos) << r.output;
  std::ofstream(p("junk.safetensors")) << "not a safetensors file at all";
  r = run_cli("run --top-k 2 --weights " + p("junk.safetensors") + " --input " + p("x.safetensors") + " --output " +
              p("y.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("junk.safetensors"), std::string::npos) << r.output;
  r = run_cli("run --top-k 2 --weights " + p("missing.safetensors") + " --input " + p("x.safetensors") +
              " --output " + p("y.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("missing.safetensors"), std::string::npos) << r.output;
  {  // a NaN in x is named with its position
    SafetensorsWriter bad;
    std::vector<float> x(4 * 8, 0.5f);
    x[2 * 8 + 5] = std::nanf("");
    bad.add_f32("x", {4, 8}, x, DType::f32);
    bad.write(p("xnan.safetensors"));
  }
  r = run_cli("run --top-k 2 --weights " + p("w.safetensors") + " --input " + p("xnan.safetensors") + " --output " +
              p("y.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("x[2, 5] is nan"), std::string::npos) << r.output;
  // The CUDA engine: without a GPU (CI) it says why it cannot run and what to use instead; with one it
  // must agree with the CPU engine (f32, fp32 accumulation against fp64: 1e-5 relative).
  r = run_cli("run --engine cuda --top-k 2 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
              " --output " + p("y_gpu.safetensors"));
  if (r.status != 0) {
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.output.find("--engine cpu"), std::string::npos) << r.output;
  } else {
    ASSERT_EQ(run_cli("run --top-k 2 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
                      " --output " + p("y_cpu.safetensors")).status, 0);
    const auto gpu = SafetensorsFile::open(p("y_gpu.safetensors")).read_f32("y", {4, 8});
    const auto cpu = SafetensorsFile::open(p("y_cpu.safetensors")).read_f32("y", {4, 8});
    for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(gpu[i], cpu[i], 1e-5 * (1 + std::abs(cpu[i]))) << i;
  }
  r = run_cli("init --activation tanh --out " + p("w2.safetensors"));
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("relu, gelu, swiglu"), std::string::npos) << r.output;
}

TEST_F(Cli, BenchPrintsTableAndJson) {
  // --engine cpu: on a machine with a GPU, auto would run the GPU bench (one row per engine, not per W).
  auto r = run_cli("bench --engine cpu --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 -n 1 2 --repeat 1 --warmup 0 --json " +
                   p("b.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("GFLOP/s"), std::string::npos) << r.output;
  std::ifstream f(p("b.json"));
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[1]["world"], 2);
  EXPECT_EQ(j[1]["max_abs_diff_vs_single_rank"], 0.0);
  EXPECT_EQ(j[0]["overhead_bound"], true);  // 8 tokens of H = I = 16: ~2e4 FLOP a forward
  // b1 (fourteenth bad-input pass): such rows, and cold single calls, printed rates with no word about them.
  EXPECT_NE(r.output.find("per-call overhead (threads, buffers), not its arithmetic"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("note: --repeat 1 --warmup 0: each time is taken from cold calls"), std::string::npos)
      << r.output;
  // A layer of real size, warmed up, has neither note.
  auto big = run_cli("bench --engine cpu --tokens 64 --hidden 64 --ffn 128 --experts 4 --top-k 2 -n 1 --repeat 3 "
                     "--warmup 1 --no-backward --json " + p("big.json"));
  ASSERT_EQ(big.status, 0) << big.output;
  EXPECT_EQ(big.output.find("note:"), std::string::npos) << big.output;
  std::ifstream fb(p("big.json"));
  EXPECT_EQ(nlohmann::json::parse(fb)[0]["overhead_bound"], false);
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST_F(Cli, RunRefusesAnOutputThatIsOneOfItsInputs) {
  ASSERT_EQ(run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("w.safetensors") +
                    " --input " + p("x.safetensors") + " --grad-output " + p("dy.safetensors") + " --save-config " +
                    p("c.json")).status, 0);
  const std::string x = file_bytes(p("x.safetensors")), w = file_bytes(p("w.safetensors"));
  fs::create_hard_link(p("w.safetensors"), p("w_link.safetensors"));
  const std::string args = "run --config " + p("c.json") + " --weights " + p("w.safetensors") + " --input " +
                           p("x.safetensors") + " --grad-output " + p("dy.safetensors") + " --output ";
  struct Case {
    std::string output, option;
  };
  for (const Case& k : {Case{(dir_ / "." / "x.safetensors").string(), "--input"},
                        Case{p("w_link.safetensors"), "--weights"}, Case{p("dy.safetensors"), "--grad-output"},
                        Case{p("c.json"), "--config"}}) {
    const auto r = run_cli(args + k.output);
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("--output '" + k.output + "' is the same file as " + k.option), std::string::npos)
        << r.output;
  }
  EXPECT_EQ(file_bytes(p("x.safetensors")), x);
  EXPECT_EQ(file_bytes(p("w.safetensors")), w);
  // Not a regular file: refused before anything runs, and the device stays a device.
  auto r = run_cli(args + "/dev/full");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("'/dev/full' is a character device"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_character_file("/dev/full"));
  // init's outputs may not coincide either.
  r = run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("a.safetensors") + " --input " +
              (dir_ / "." / "a.safetensors").string());
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("are the same file"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("a.safetensors")));
}

TEST_F(Cli, BenchJsonThatCannotBeWrittenIsRefusedBeforeTiming) {
  const std::string bench = "bench --engine cpu --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 -n 1 --repeat 1 "
                            "--warmup 0 --json ";
  for (const std::string& path : {std::string("/dev/full"), std::string("/proc/version"), p("no/such/dir/b.json"),
                                  dir_.string()}) {
    const auto r = run_cli(bench + path);
    EXPECT_EQ(r.status, 1) << path << ": " << r.output;
    EXPECT_NE(r.output.find("--json '" + path + "'"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("engine: cpu"), std::string::npos) << "timed before refusing: " << r.output;
    EXPECT_EQ(r.output.find("wrote"), std::string::npos) << r.output;
  }
}

TEST_F(Cli, BenchNoBackwardReportsNoBackwardTime) {
  auto r = run_cli("bench --engine cpu --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 -n 1 --repeat 1 --warmup 0 "
                   "--no-backward --json " + p("b.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("not timed"), std::string::npos) << r.output;
  std::ifstream f(p("b.json"));
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j.size(), 1u);
  EXPECT_FALSE(j[0].contains("forward_backward_ms")) << j.dump();
  EXPECT_FALSE(j[0].contains("forward_backward_gflops")) << j.dump();
}

// `dmoe bench model` (a whole model's training step) needs a GPU; its --batch/--seq are refused on the layer
// benchmark, where they would be ignored.
TEST_F(Cli, BenchModelOptionsAreItsOwn) {
  auto r = run_cli("bench --engine cpu --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 -n 1 --repeat 1 "
                   "--warmup 0 --batch 4");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--batch is an option of `dmoe bench model`"), std::string::npos) << r.output;
  auto s = run_cli("bench gemm --seq 64");
  EXPECT_NE(s.status, 0);
  EXPECT_NE(s.output.find("--seq is an option of `dmoe bench model`"), std::string::npos) << s.output;
  auto g = run_cli("bench --engine cpu --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 -n 1 --repeat 1 "
                   "--warmup 0 --f32-expert-grads");
  EXPECT_NE(g.status, 0);
  EXPECT_NE(g.output.find("--f32-expert-grads is an option of `dmoe bench model`"), std::string::npos) << g.output;
  EXPECT_EQ(g.output.find("give --tokens instead"), std::string::npos) << g.output;  // that hint is --batch/--seq's
  if (!fs::exists("/dev/nvidia0")) {
    auto m = run_cli("bench model --config tiny");
    EXPECT_NE(m.status, 0);
    EXPECT_NE(m.output.find("no CUDA device is visible"), std::string::npos) << m.output;
  }
}

TEST_F(Cli, BenchWorldTakesEffectOnTheCpuEngine) {
  const std::string bench = "bench --engine cpu --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 --repeat 1 "
                            "--warmup 0 --no-backward --world 2 ";
  auto r = run_cli(bench + "--json " + p("b.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  std::ifstream f(p("b.json"));
  const auto j = nlohmann::json::parse(f);
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["world"], 2);
  r = run_cli(bench + "-n 1 4");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("disagree"), std::string::npos) << r.output;
}

TEST_F(Cli, NonFiniteResultsAreAnErrorUnlessAllowed) {
  ASSERT_EQ(run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("w.safetensors")).status, 0);
  {  // finite, but 1e38 overflows the experts' products
    SafetensorsWriter big;
    std::vector<float> x(4 * 8, 0.5f);
    for (int j = 0; j < 8; ++j) x[1 * 8 + j] = 1e38f;
    big.add_f32("x", {4, 8}, x, DType::f32);
    big.write(p("xbig.safetensors"));
  }
  const std::string run = "run --top-k 2 --weights " + p("w.safetensors") + " --input " + p("xbig.safetensors") +
                          " --output " + p("y.safetensors");
  auto r = run_cli(run);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("y[1, "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("--allow-non-finite"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("y.safetensors")));
  r = run_cli(run + " --allow-non-finite");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("warning"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(p("y.safetensors")));
}

TEST_F(Cli, ConfigTokensMustAgreeAndZeroIsNotReplaced) {
  std::ofstream(p("c.json")) << R"({"tokens": 3, "hidden": 8, "ffn": 8, "experts": 4, "top_k": 2})";
  ASSERT_EQ(run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("w.safetensors") +
                    " --input " + p("x.safetensors")).status, 0);
  auto r = run_cli("run --config " + p("c.json") + " --weights " + p("w.safetensors") + " --input " +
                   p("x.safetensors") + " --output " + p("y.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("tokens = 3 per rank (from --config"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("4 rows"), std::string::npos) << r.output;
  std::ofstream(p("c0.json")) << R"({"tokens": 0, "hidden": 8, "ffn": 8, "experts": 4, "top_k": 2})";
  r = run_cli("init --config " + p("c0.json") + " --out " + p("w0.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("tokens = 0 is invalid"), std::string::npos) << r.output;
  // top_k nowhere (a weights file does not record it; a config without the key): said so, with the rule.
  r = run_cli("run --weights " + p("w.safetensors") + " --input " + p("x.safetensors") + " --output " +
              p("y.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("top_k is not known: the weights file"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("pass --top-k K (1 <= K <= experts = 4)"), std::string::npos) << r.output;
  std::ofstream(p("nok.json")) << R"({"hidden": 8, "ffn": 8, "experts": 4})";
  r = run_cli("run --config " + p("nok.json") + " --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
              " --output " + p("y.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("top_k is not known: --config"), std::string::npos) << r.output;
  // top_k: 0 given (flag or file): the value and the rule, not "unknown".
  std::ofstream(p("k0.json")) << R"({"hidden": 8, "ffn": 8, "experts": 4, "top_k": 0})";
  for (const std::string& how : {std::string("--top-k 0"), "--config " + p("k0.json")}) {
    r = run_cli("run " + how + " --weights " + p("w.safetensors") + " --input " + p("x.safetensors") + " --output " +
                p("y.safetensors"));
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(r.output.find("top_k = 0 is invalid; must satisfy 1 <= top_k <= experts (4)"), std::string::npos)
        << how << ": " << r.output;
  }
}

TEST_F(Cli, MessagesSayTheRuleWithoutSourceLocations) {
  auto r = run_cli("bench --repeat 0");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--repeat: 0 is not in range 1 to 1000000"), std::string::npos) << r.output;
  EXPECT_LT(r.output.size(), 200u) << r.output;
  r = run_cli("init --config " + dir_.string() + " --out " + p("w.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("is a directory; expected a JSON file"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("JSON:"), std::string::npos) << r.output;
  r = run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --prefix model.layers.0.block_sparse_moe --out " +
              p("w.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("--prefix 'model.layers.0.block_sparse_moe' must end with '.'"), std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(p("w.safetensors")));
  ASSERT_EQ(run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("w.safetensors") +
                    " --input " + p("x.safetensors")).status, 0);
  r = run_cli("run --top-k 2 --layer 3 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
              " --output " + p("y.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("layers with an MoE gate: 0"), std::string::npos) << r.output;
  // Bad input is reported without dmoe's source location ("(config_io.cpp:125)").
  for (const std::string& bad : {std::string("init --activation tanh --out ") + p("a.safetensors"),
                                 "run --top-k 9 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
                                     " --output " + p("y.safetensors"),
                                 "run --top-k 2 --prefix nope. --weights " + p("w.safetensors") + " --input " +
                                     p("x.safetensors") + " --output " + p("y.safetensors")}) {
    r = run_cli(bad);
    EXPECT_EQ(r.status, 1) << bad << ": " << r.output;
    EXPECT_NE(r.output.find("dmoe: error: "), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find(".cpp:"), std::string::npos) << r.output;
  }
}

TEST_F(Cli, VersionHelpDefaultsAndEngineNames) {
  auto r = run_cli("--version");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("dmoe 0.", 0), 0u) << r.output;
  r = run_cli("bench --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.output.find("{false}"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("=3"), std::string::npos) << "--repeat's default: " << r.output;
  EXPECT_NE(r.output.find("| cpu | ep (aliases cuda, gpu) | flash"), std::string::npos) << r.output;
  r = run_cli("launch --help");
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r.output.find("=0 REQUIRED"), std::string::npos) << "a required option's placeholder: " << r.output;
  EXPECT_EQ(r.output.find("=[]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("The ranks' standard input is /dev/null"), std::string::npos) << r.output;  // F23
  // ep names the CUDA EP engine in both subcommands; cuda and gpu are accepted as its old names.
  if (!fs::exists("/dev/nvidia0")) {
    for (const char* engine : {"cuda", "gpu"}) {
      r = run_cli(std::string("bench --engine ") + engine + " --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2");
      EXPECT_EQ(r.status, 1) << r.output;
      EXPECT_NE(r.output.find("use --engine cpu"), std::string::npos) << r.output;
      r = run_cli(std::string("run --engine ") + engine + " --top-k 2 --weights " + p("none") + " --input " + p("x") +
                  " --output " + p("y"));
      EXPECT_EQ(r.status, 1) << r.output;
      EXPECT_EQ(r.output.find("not in {"), std::string::npos) << r.output;
    }
  }
}

TEST_F(Cli, JobsTooLargeForThisMachineAreRefusedUpFrontWritingNothing) {
  // 10^9 tokens × 1024 columns: terabytes; refused with the estimate before any file exists.
  auto r = run_cli("init --tokens 1000000000 --hidden 1024 --ffn 8 --experts 4 --top-k 2 --out " +
                   p("w.safetensors") + " --input " + p("x.safetensors"));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("would allocate about"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("TiB"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("MemAvailable"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("bad_alloc"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_empty(dir_));
  // W = 4096 on the CPU engine: every rank's gate replica alone is 4096·4096·4096·4 bytes.
  r = run_cli("bench --engine cpu --world 4096 --experts 4096 --hidden 4096 --ffn 16 --tokens 1 --top-k 1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("the CPU engine on T=1 H=4096"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("would allocate about"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("engine: cpu"), std::string::npos) << "started before refusing: " << r.output;
}

TEST_F(Cli, InjectedHangOnOneRankEndsTheRunInTime) {
  ASSERT_EQ(run_cli("init --tokens 4 --hidden 8 --ffn 8 --experts 4 --top-k 2 --world 2 --out " + p("w.safetensors") +
                    " --input " + p("x.safetensors")).status, 0);
  const auto r = run_cli("run --world 2 --top-k 2 --weights " + p("w.safetensors") + " --input " + p("x.safetensors") +
                         " --output " + p("y.safetensors"), "DMOE_FAULT=1:expert_gemm:hang DMOE_COMM_TIMEOUT_S=1");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("rank 1 (last in stage expert_gemm)"), std::string::npos) << r.output;
  // F11 (fifteenth pass): a time limit is no bug of dmoe's: no "(thread_comm.cpp:77)", and how to raise it.
  EXPECT_NE(r.output.find("the limit is DMOE_COMM_TIMEOUT_S=1 s"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("raise it, e.g. DMOE_COMM_TIMEOUT_S=600"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(".cpp:"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(p("y.safetensors")));
}

TEST_F(Cli, InitWritesAllItsFilesOrNone) {
  // A file-size limit (SIGXFSZ ignored: write() fails with EFBIG, as on a full disk) that the weights
  // (~4 KB) fit under and x (1000 x 8 floats, 32 KB) does not: nothing may appear, not even the weights.
  const std::string init = "init --tokens 1000 --hidden 8 --ffn 8 --experts 4 --top-k 2 --out " + p("w.safetensors") +
                           " --input " + p("x.safetensors") + " --save-config " + p("c.json");
  // The limit is found before anything is generated (G15, sixteenth pass), and dmoe ignores SIGXFSZ itself (no trap
  // here): before, the signal's default action ended it mid-write, its temporary left behind.
  auto r = run_cli(init, "ulimit -f 16;");
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("init --input " + p("x.safetensors") + " (x or dy) would be a file of about"),
            std::string::npos) << r.output;
  EXPECT_TRUE(fs::is_empty(dir_)) << "left behind: " << fs::directory_iterator(dir_)->path();
  r = run_cli(init);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(fs::exists(p("w.safetensors")) && fs::exists(p("x.safetensors")) && fs::exists(p("c.json")));
}

TEST_F(Cli, HelpForEverySubcommand) {
  for (const char* sub : {"init", "run", "bench"}) {
    auto r = run_cli(std::string(sub) + " --help");
    EXPECT_EQ(r.status, 0) << sub;
    EXPECT_NE(r.output.find("--config"), std::string::npos) << sub << ": " << r.output;
  }
}

}  // namespace
}  // namespace dmoe
