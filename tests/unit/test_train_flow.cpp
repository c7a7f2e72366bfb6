// test_train_flow.cpp — `dmoe train --schedule` on the CPU engine: the trainer driving the CPU Flow executor
// (flow/cpu_executor.hpp) on thread ranks, each schedule against the sequential loop, and the online tuner.
// In the ThreadSanitizer binary too (tests/CMakeLists.txt): ranks, the executor's threads and the trainer's
// per-rank state all run at once here.
// Run: dmoe_unit_tests --gtest_filter='TrainFlow*'
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "model/mixtral_config.hpp"
#include "model/trainer.hpp"
#include "train_test_util.hpp"

namespace dmoe {
namespace {

class TrainFlow : public test::TrainTest {
 protected:
  static MixtralConfig tiny() { return test::tiny_model(); }
  static TrainOptions small() { return test::small_train_options(); }
};

// Flow on the CPU engine (--schedule, the CPU executor: three threads per rank, the chunks on a second thread
// group): every schedule trains the same model as the sequential loop. The executor runs its backwards r = 0..R−1
// where the loop runs them from r = R−1 down, so gradients differ in the last bits and AdamW carries that on:
// step 1's loss (before any update) is equal, later ones within 1e-4 relative (the GPU test's tolerance; observed
// equal to 5 digits). W = 2, R = 2 (pipelined schedules split each rank's batch), Sp = 4 KiB (cuts tensors).
TEST_F(TrainFlow, FlowSchedulesOnTheCpuFollowTheSequentialLoop) {
  TrainOptions o = small();
  o.steps = 4;
  o.world = 2;
  o.micro_batches = 2;
  o.val_every = 4;
  const TrainResult base = train_mixtral(tiny(), o, [](const std::string&) {});
  for (const char* schedule : {"vanilla", "pipe-moe", "pipe-attn", "chunked-ar"}) {
    o.schedule = schedule;
    o.chunk_bytes = schedule == std::string("chunked-ar") ? 4096 : int64_t(1) << 20;
    std::string printed;
    o.print_every = 4;
    const TrainResult flow_run = train_mixtral(tiny(), o, [&](const std::string& line) { printed += line + "\n"; });
    o.print_every = 0;
    ASSERT_EQ(flow_run.records.size(), base.records.size()) << schedule;
    EXPECT_EQ(flow_run.records[0].loss, base.records[0].loss) << schedule;
    for (size_t i = 0; i < base.records.size(); ++i)
      EXPECT_NEAR(flow_run.records[i].loss, base.records[i].loss, 1e-4 * base.records[i].loss)
          << schedule << " step " << i + 1;
    EXPECT_NEAR(flow_run.final_val_loss, base.final_val_loss, 1e-4 * base.final_val_loss) << schedule;
    // The run went through the executor and says how its tasks were timed.
    EXPECT_NE(printed.find("Flow executor (--schedule " + std::string(schedule)), std::string::npos) << printed;
    EXPECT_NE(printed.find("wall clock of the executor's threads"), std::string::npos) << printed;
  }
}

// --schedule tuned on thread ranks: every rank must run the same graph at every step (rank 0's step times are
// every rank's observations), the choice is written to the tuning file and a second run of the same shape reuses
// it without sampling. Before the replica agreed on rank 0's value and each rank kept its own graph, thread ranks
// shared one graph variable that each replaced while the others ran it (a crash at W = 2).
TEST_F(TrainFlow, TunedScheduleOnTheCpuChoosesAndReuses) {
  TrainOptions o = small();
  o.world = 2;
  o.steps = 10;
  o.schedule = "tuned";
  o.tune_samples = 3;
  o.tune_steps = 1;  // (3 + the baseline again) × (1 + 1 warm-up) = 8 steps of sampling, then 2 at the choice
  o.tune_file = p("tune.json");
  o.print_every = 1;
  std::string printed;
  const TrainResult first = train_mixtral(tiny(), o, [&](const std::string& line) { printed += line + "\n"; });
  EXPECT_EQ(first.records.size(), 10u);
  EXPECT_NE(printed.find("tuned: chose "), std::string::npos) << printed;
  // The first sample is the vanilla baseline, the two next chunked-ar from R = 1 at 1 MiB, the last the baseline again.
  EXPECT_NE(printed.find("tuned: sample 1/4: vanilla (R = 1"), std::string::npos) << printed;
  EXPECT_NE(printed.find("tuned: sample 2/4: R = 1, Sp = 1024.0 KiB"), std::string::npos) << printed;
  EXPECT_NE(printed.find("tuned: sample 4/4: vanilla (R = 1, the all-reduce after the backward), again"),
            std::string::npos) << printed;
  // The per-task table is of the chosen graph only: its 2 steps after sampling, the first left out (when the choice is
  // the last sample's point, that sample's 2 steps are the same graph and count too: 3).
  const bool one = printed.find("over its last 1 steps") != std::string::npos;
  const bool three = printed.find("over its last 3 steps") != std::string::npos;
  EXPECT_TRUE(one || three) << printed;
  std::ifstream f(p("tune.json"));
  const nlohmann::json t = nlohmann::json::parse(f);
  ASSERT_EQ(t["runs"].size(), 1u) << t.dump();
  const nlohmann::json& samples = t["runs"][0]["samples"];
  ASSERT_EQ(samples.size(), 4u) << t.dump();
  EXPECT_EQ(samples[0]["schedule"], "vanilla") << t.dump();
  EXPECT_EQ(samples[1]["schedule"], "chunked-ar") << t.dump();
  EXPECT_EQ(samples[3]["schedule"], "vanilla") << t.dump();
  EXPECT_EQ(t["runs"][0]["key"]["world"], 2) << t.dump();
  const nlohmann::json& choice = t["runs"][0]["choice"];
  const int r = choice["micro_batches"].get<int>();
  EXPECT_TRUE(r == 1 || r == 2) << t.dump();  // 2 sequences per rank: R = 4, 8 do not divide them
  // The choice is the fastest sample, the baseline included (ties to vanilla).
  double fastest = 1e300;
  for (const auto& smp : samples) fastest = std::min(fastest, smp["step_ms"].get<double>());
  EXPECT_EQ(choice["step_ms"].get<double>(), fastest) << t.dump();
  const bool vanilla = choice["schedule"] == "vanilla";
  const double baseline = std::min(samples[0]["step_ms"].get<double>(), samples[3]["step_ms"].get<double>());
  EXPECT_EQ(vanilla, baseline == fastest) << t.dump();
  printed.clear();
  o.steps = 2;
  const TrainResult second = train_mixtral(tiny(), o, [&](const std::string& line) { printed += line + "\n"; });
  EXPECT_EQ(second.records.size(), 2u);
  EXPECT_NE(printed.find(vanilla ? std::string("tuned: reusing vanilla") : "tuned: reusing R = " + std::to_string(r)),
            std::string::npos) << printed;
  EXPECT_EQ(printed.find("tuned: sample"), std::string::npos) << printed;

  // A file whose choice is the baseline runs the vanilla graph (--schedule vanilla's) without sampling, whatever the
  // samples were; its losses are vanilla's.
  nlohmann::json forced = t;
  forced["runs"][0]["choice"] = {{"schedule", "vanilla"}, {"micro_batches", 1}, {"chunk_bytes", 1 << 20}, {"step_ms", 1.0}};
  std::ofstream(p("forced.json")) << forced.dump();
  o.tune_file = p("forced.json");
  printed.clear();
  const TrainResult reused = train_mixtral(tiny(), o, [&](const std::string& line) { printed += line + "\n"; });
  EXPECT_NE(printed.find("tuned: reusing vanilla"), std::string::npos) << printed;
  EXPECT_NE(printed.find("Flow executor (--schedule tuned (vanilla"), std::string::npos) << printed;
  TrainOptions v = o;
  v.schedule = "vanilla";
  v.tune_file.clear();
  const TrainResult plain = train_mixtral(tiny(), v, [](const std::string&) {});
  ASSERT_EQ(plain.records.size(), reused.records.size());
  for (size_t i = 0; i < plain.records.size(); ++i) EXPECT_EQ(plain.records[i].loss, reused.records[i].loss) << i;
}

}  // namespace
}  // namespace dmoe
