// test_flow_cli.cpp — `dmoe flow simulate` / `dmoe flow tune`: the ablation table and JSON equal the library's
// simulation, the trace holds every task of every schedule, the tuned row is no slower than chunked-ar at the
// tuner's first point, and bad input gets a message naming the field.
//
// Run: dmoe_unit_tests --gtest_filter='FlowCli*'
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.hpp"
#include "flow/ablation.hpp"

namespace dmoe::flow {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using Result = dmoe::test::CliResult;
using dmoe::test::run_cli;

json read_json(const fs::path& p) {
  std::ifstream f(p);
  return json::parse(f);
}

struct FlowCli : ::testing::Test {
  fs::path dir = fs::temp_directory_path() / ("dmoe_flow_cli_" + std::to_string(::getpid()));
  fs::path costs = fs::path(DMOE_SOURCE_DIR) / "bench/flow/example.json";
  void SetUp() override { fs::create_directories(dir); }
  void TearDown() override { fs::remove_all(dir); }
};

TEST_F(FlowCli, SimulateAblationMatchesTheLibrary) {
  const Result r = run_cli("flow simulate --costs " + costs.string() + " --layers 4 --micro-batches 2 --json " +
                           (dir / "out.json").string() + " --trace " + (dir / "trace.json").string());
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* s : {"vanilla", "pipe-moe", "pipe-attn", "chunked-ar", "tuned"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  const json out = read_json(dir / "out.json");
  const CostModel c = load_cost_model(costs.string());
  const std::vector<ScheduleRun> lib = run_ablation(4, 2, kDefaultChunkBytes, c);
  ASSERT_EQ(out.at("runs").size(), lib.size());
  size_t tasks = 0;
  for (size_t i = 0; i < lib.size(); ++i) {
    const json& row = out.at("runs")[i];
    EXPECT_EQ(row.at("schedule"), schedule_name(lib[i].spec.schedule));
    EXPECT_EQ(row.at("micro_batches"), lib[i].spec.micro_batches);
    EXPECT_DOUBLE_EQ(row.at("step_ms").get<double>(), lib[i].result.step_ms);
    tasks += lib[i].result.events.size();
  }
  EXPECT_EQ(out.at("runs")[0].at("micro_batches"), 1);  // vanilla: no micro-batches
  // The tuner's first sample is chunked-ar's point (1 MiB, R = 2), so tuned is never slower.
  EXPECT_LE(out.at("runs")[4].at("step_ms").get<double>(), out.at("runs")[3].at("step_ms").get<double>());
  const json trace = read_json(dir / "trace.json");
  size_t complete = 0;
  for (const json& e : trace.at("traceEvents")) complete += e.at("ph") == "X";
  EXPECT_EQ(complete, tasks);
  EXPECT_EQ(trace.at("flow").size(), 5u);
}

TEST_F(FlowCli, OneScheduleAndTune) {
  const Result one = run_cli("flow simulate --costs " + costs.string() + " --layers 2 --schedule vanilla "
                             "--micro-batches 2 --json " + (dir / "v.json").string());
  ASSERT_EQ(one.status, 0) << one.output;
  const json v = read_json(dir / "v.json");
  ASSERT_EQ(v.at("runs").size(), 1u);
  EXPECT_EQ(v.at("runs")[0].at("micro_batches"), 2);  // an explicit schedule keeps --micro-batches
  // F12 (fifteenth pass): vanilla alone took the --micro-batches default of 2, not the ablation's R = 1.
  ASSERT_EQ(run_cli("flow simulate --costs " + costs.string() + " --layers 2 --schedule vanilla --json " +
                    (dir / "v1.json").string()).status, 0);
  ASSERT_EQ(run_cli("flow simulate --costs " + costs.string() + " --layers 2 --json " + (dir / "all.json").string())
                .status, 0);
  const json v1 = read_json(dir / "v1.json"), all = read_json(dir / "all.json");
  EXPECT_EQ(v1.at("runs")[0].at("micro_batches"), 1);
  EXPECT_EQ(all.at("runs")[0].at("schedule"), "vanilla");
  EXPECT_EQ(v1.at("runs")[0].at("step_ms"), all.at("runs")[0].at("step_ms"));
  // F21: one tuner sample is a guess, not a search (train --tune-samples had the floor of 2 already).
  const Result one_sample = run_cli("flow tune --costs " + costs.string() + " --samples 1");
  EXPECT_EQ(one_sample.status, 1) << one_sample.output;
  EXPECT_NE(one_sample.output.find("--samples 1: must be in [2, 1000]"), std::string::npos) << one_sample.output;
  const Result t = run_cli("flow tune --costs " + costs.string() + " --layers 3 --samples 6 --json " +
                           (dir / "t.json").string());
  ASSERT_EQ(t.status, 0) << t.output;
  const json tj = read_json(dir / "t.json");
  ASSERT_EQ(tj.at("samples").size(), 6u);
  const CostModel c = load_cost_model(costs.string());
  const TuneRun lib = tune_on_simulator(3, c, 6);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(tj.at("samples")[i].at("chunk_bytes"), lib.samples[i].point.chunk_bytes());
    EXPECT_DOUBLE_EQ(tj.at("samples")[i].at("step_ms").get<double>(), lib.samples[i].step_ms);
  }
  EXPECT_GE(tj.at("best").at("step_ms").get<double>(), tj.at("grid_best").at("step_ms").get<double>());
}

TEST_F(FlowCli, MeasureFitsAndPredicts) {
  // The CPU executor at R = 1, 2 on the tiny model: the fitted cost file loads, every row has a measured and
  // a predicted step (how close they are depends on the machine's load: not asserted).
  const Result r = run_cli("flow measure --config tiny --batch 4 --seq 8 --world 2 --measure-r 1,2 --steps 1 "
                           "--costs-out " + (dir / "fit.json").string() + " --json " + (dir / "m.json").string() +
                           " --trace " + (dir / "t.json").string());
  ASSERT_EQ(r.status, 0) << r.output;
  // The measured timelines as a trace: one process per R, every task of rank 0's last step.
  const json trace = read_json(dir / "t.json");
  int spans = 0;
  for (const json& e : trace.at("traceEvents")) spans += e.at("ph") == "X";
  EXPECT_GT(spans, 0);
  EXPECT_EQ(trace.at("flow").size(), 2u);
  const json m = read_json(dir / "m.json");
  ASSERT_EQ(m.at("rows").size(), 2u);
  for (const json& row : m.at("rows")) {
    EXPECT_GT(row.at("measured_ms").get<double>(), 0);
    EXPECT_GT(row.at("predicted_ms").get<double>(), 0);
  }
  const CostModel fit = load_cost_model((dir / "fit.json").string());
  EXPECT_EQ(fit.layers, 2);
  EXPECT_GT(fit[TaskKind::attention_fwd].fixed_ms + fit[TaskKind::attention_fwd].batch_ms, 0);
  // The experts are a task of their own on the CPU executor too (the MoE stage cut at its all-to-alls).
  EXPECT_GT(fit[TaskKind::expert_fwd].fixed_ms + fit[TaskKind::expert_fwd].batch_ms, 0);
  const Result bad = run_cli("flow measure --config tiny --batch 4 --measure-r 1,3");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--measure-r 3: must divide --batch 4"), std::string::npos) << bad.output;
  const Result no_costs = run_cli("flow simulate");
  EXPECT_NE(no_costs.output.find("--costs: required for flow simulate"), std::string::npos) << no_costs.output;
}

TEST_F(FlowCli, BadInputNamesTheField) {
  auto fails_with = [&](const std::string& args, const std::string& needle) {
    const Result r = run_cli(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\n" << r.output;
  };
  fails_with("flow simulate --costs " + costs.string() + " --schedule fast", "--schedule 'fast': unknown schedule");
  fails_with("flow simulate --costs /nonexistent.json", "--costs '/nonexistent.json': cannot be opened for reading");
  fails_with("flow simulate --costs " + costs.string() + " --micro-batches 0", "--micro-batches 0");
  fails_with("flow walk --costs " + costs.string(), "flow walk: unknown action (allowed: simulate, tune, project, measure)");
  std::ofstream(dir / "bad.json") << R"({"dense_grad_bytes_per_layer": 10, "tasks": {}, "allreduce": {}})";
  fails_with("flow simulate --costs " + (dir / "bad.json").string(), "tasks: missing key 'AT'");
  json nl = read_json(costs);
  nl.erase("layers");
  std::ofstream(dir / "nolayers.json") << nl.dump();
  fails_with("flow tune --costs " + (dir / "nolayers.json").string(), "--layers 0: must be >= 1");
}

}  // namespace
}  // namespace dmoe::flow
