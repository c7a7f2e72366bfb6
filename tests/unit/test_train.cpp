// test_train.cpp — the CPU training loop (src/model/trainer.*) and `dmoe train`: the learning-rate schedule,
// exact resume from a checkpoint, W = 2 ranks against one, and a short real run whose loss must fall.
//
// Data: tests/data/train_text.txt (real English text: the README of an earlier commit, frozen so that editing
// the README does not move the losses these tests compare), byte-level.
// Run: dmoe_unit_tests --gtest_filter='Train*'
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.hpp"
#include "core/error.hpp"
#include "model/mixtral_config.hpp"
#include "model/train_replica.hpp"
#include "model/trainer.hpp"
#include "train_test_util.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

namespace fs = std::filesystem;
using test::train_text;
MixtralConfig tiny() { return test::tiny_model(); }

class Train : public test::TrainTest {
 protected:
  TrainOptions small() const { return test::small_train_options(); }
};

// dmoe train's choice of bf16 expert gradients on the GPU (model/train_replica.hpp): a bf16 model, one micro-batch, no
// Flow schedule, and a shape where they pay — any H and I multiples of 8 where the GPU stores bf16 weight gradients
// with one grouped launch per product (the sm90 kernel), else experts of H·I >= 2 M elements (cuBLAS's per-expert
// bf16 products of small experts were measured slower); anything else keeps them f32 (several micro-batches add into
// them, which bf16 ones refuse).
TEST(TrainExpertGrads, Bf16OnlyWithOneBackwardPerStepWhereTheyPay) {
  MixtralConfig big = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/llama2-moe.json").string());
  MixtralConfig small = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/gpt2-tiny-moe.json").string());
  for (const bool grouped : {false, true}) {
    SCOPED_TRACE(grouped ? "grouped bf16 weight gradients" : "cuBLAS's per-expert bf16 products");
    EXPECT_TRUE(bf16_expert_grads_pay_off(big, grouped));            // 1024 x 4096
    EXPECT_EQ(bf16_expert_grads_pay_off(small, grouped), grouped);   // 256 x 512
    EXPECT_TRUE(bf16_expert_grads_for_training(big, DType::bf16, 1, false, grouped));
    EXPECT_FALSE(bf16_expert_grads_for_training(big, DType::bf16, 2, false, grouped));  // micro-batches add into them
    EXPECT_FALSE(bf16_expert_grads_for_training(big, DType::bf16, 1, true, grouped));   // a Flow schedule (R varies)
    EXPECT_FALSE(bf16_expert_grads_for_training(big, DType::f32, 1, false, grouped));   // an f32 model's are f32
    EXPECT_EQ(bf16_expert_grads_for_training(small, DType::bf16, 1, false, grouped), grouped);
  }
  MixtralConfig edge = small;
  edge.hidden_size = 1024;
  edge.intermediate_size = 2048;  // exactly 2^21
  EXPECT_TRUE(bf16_expert_grads_pay_off(edge, false));
  edge.intermediate_size = 2047;
  EXPECT_FALSE(bf16_expert_grads_pay_off(edge, false));
  EXPECT_FALSE(bf16_expert_grads_pay_off(edge, true));  // not a multiple of 8: the grouped kernel's stores refuse it
  edge.intermediate_size = 2040;
  EXPECT_TRUE(bf16_expert_grads_pay_off(edge, true));
}

TEST(TrainSchedule, WarmupThenCosineToMinLr) {
  TrainOptions o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup = 4;
  o.steps = 14;
  EXPECT_DOUBLE_EQ(scheduled_lr(o, 1), 0.25);   // linear warm-up
  EXPECT_DOUBLE_EQ(scheduled_lr(o, 4), 1.0);    // peak
  EXPECT_DOUBLE_EQ(scheduled_lr(o, 9), 0.55);   // half-way down the cosine: (1 + 0.1) / 2
  EXPECT_NEAR(scheduled_lr(o, 14), 0.1, 1e-15); // the floor at the last step
  // Without a warm-up the cosine starts at the peak on step 1 (it started a step later: no step used lr, and a
  // one-step run used min_lr, 0 with --min-lr 0, so it trained nothing with rc 0).
  o.warmup = 0;
  o.steps = 5;
  EXPECT_DOUBLE_EQ(scheduled_lr(o, 1), 1.0);
  EXPECT_DOUBLE_EQ(scheduled_lr(o, 3), 0.55);
  EXPECT_NEAR(scheduled_lr(o, 5), 0.1, 1e-15);
  o.steps = 1;
  o.min_lr = 0;
  EXPECT_DOUBLE_EQ(scheduled_lr(o, 1), 1.0);
}

TEST_F(Train, ResumeIsExact) {
  // 6 steps straight against 3 steps of the same 6-step schedule (--stop-after 3, as an interrupted run),
  // saved, then resumed for steps 4..6: the same losses and bit-identical final weights (same schedule, same
  // batches, the f32 weights and moments saved exactly).
  const TrainResult a = train_mixtral(tiny(), small(), [](const std::string&) {});
  TrainOptions first = small();
  first.stop_after = 3;
  first.save_dir = p("half");
  train_mixtral(tiny(), first, [](const std::string&) {});
  TrainOptions second = small();
  second.resume_dir = p("half");
  second.save_dir = p("resumed");
  const TrainResult b = train_mixtral(tiny(), second, [](const std::string&) {});
  ASSERT_EQ(a.records.size(), 6u);
  ASSERT_EQ(b.records.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(b.records[i].step, a.records[3 + i].step);
    EXPECT_EQ(b.records[i].loss, a.records[3 + i].loss) << "step " << b.records[i].step;
  }
  MixtralWeights wa = a.weights, wb = b.weights;
  const MixtralConfig c = tiny();
  std::vector<ParamView> va = parameter_views(wa, c), vb = parameter_views(wb, c);
  for (size_t i = 0; i < va.size(); ++i)
    EXPECT_TRUE(std::equal(va[i].data, va[i].data + va[i].numel, vb[i].data)) << va[i].name;
  EXPECT_TRUE(fs::exists(p("resumed/model.safetensors")) && fs::exists(p("resumed/optimizer.safetensors")) &&
              fs::exists(p("resumed/config.json")));
  // Resuming with another data seed is refused: the batches would differ from the saved run's.
  TrainOptions other = second;
  other.seed = 2;
  EXPECT_THROW(train_mixtral(tiny(), other, [](const std::string&) {}), Error);
  // Another --lr or --steps takes effect (a new schedule) and says that the run no longer continues the saved one;
  // the exact resume above printed no such note.
  std::string notes;
  TrainOptions changed = second;
  changed.save_dir.clear();
  changed.lr = second.lr * 2;
  changed.steps = 8;
  train_mixtral(tiny(), changed, [&](const std::string& line) { notes += line + "\n"; });
  EXPECT_NE(notes.find("replaces the saved run's"), std::string::npos) << notes;
  EXPECT_NE(notes.find("--steps 8 replaces the saved run's 6"), std::string::npos) << notes;
  std::string exact;
  second.save_dir.clear();
  train_mixtral(tiny(), second, [&](const std::string& line) { exact += line + "\n"; });
  EXPECT_EQ(exact.find("note:"), std::string::npos) << exact;
}

TEST_F(Train, TwoRanksFollowOneRank) {
  // Same global batch split over 2 ranks (experts 2 + 2): the losses agree up to summation order, which
  // AdamW's normalised steps amplify a little over 4 steps (observed ~1e-8).
  TrainOptions o = small();
  o.steps = 4;
  const TrainResult one = train_mixtral(tiny(), o, [](const std::string&) {});
  o.world = 2;
  const TrainResult two = train_mixtral(tiny(), o, [](const std::string&) {});
  ASSERT_EQ(two.records.size(), one.records.size());
  for (size_t i = 0; i < one.records.size(); ++i)
    EXPECT_NEAR(two.records[i].loss, one.records[i].loss, 1e-6) << "step " << one.records[i].step;
  // Two micro-batches per rank: step 1's loss (before any update) is the same cross-entropy (equal counts per
  // micro-batch) plus router_aux_loss_coef = 0.01 times an aux loss whose statistics are now per micro-batch,
  // which moves it by 0.01 × (a small change of aux): observed 7e-6 on this data, hence 1e-4 (the change
  // follows the text: 1.02e-4 on a later README). (The exact equivalence without the aux loss is tested in
  // Mixtral.MicroBatchesAverageToTheFullBatchGradient.)
  o.micro_batches = 2;
  const TrainResult micro = train_mixtral(tiny(), o, [](const std::string&) {});
  EXPECT_NEAR(micro.records[0].loss, two.records[0].loss, 1e-4);
  o.micro_batches = 3;
  EXPECT_THROW(train_mixtral(tiny(), o, [](const std::string&) {}), Error);  // 2 per rank into 3
  o.micro_batches = 1;
  o.batch = 3;
  EXPECT_THROW(train_mixtral(tiny(), o, [](const std::string&) {}), Error);  // 3 sequences over 2 ranks
}

using Result = test::CliResult;
using test::run_cli;

TEST_F(Train, CliTrainsTinyAndTheLossFalls) {
  auto r = run_cli("train --config tiny --data " + train_text() + " --steps 30 --seq 32 --batch 4 --warmup 5 --lr 3e-3 "
                   "--val-every 15 --log " + p("log.jsonl") + " --save " + p("ckpt") + " --print-every 10");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("tokens/s"), std::string::npos) << r.output;
  std::ifstream log(p("log.jsonl"));
  std::vector<double> losses, val;
  for (std::string line; std::getline(log, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) {
      val.push_back(j["val_loss"].get<double>());
    } else {
      ASSERT_TRUE(j.contains("lr") && j.contains("tokens_per_s")) << line;
      losses.push_back(j["loss"].get<double>());
    }
  }
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_EQ(val.size(), 2u);  // steps 15 and 30
  // Bytes start at ln 256 = 5.55; a few dozen steps learn at least the byte frequencies (~3.5 on English
  // text). Mean of the last 5 against the first: a drop of 1.0 nats is far outside step-to-step noise (~0.2).
  double last = 0;
  for (size_t i = losses.size() - 5; i < losses.size(); ++i) last += losses[i] / 5;
  EXPECT_NEAR(losses[0], 5.55, 0.1);
  EXPECT_LT(last, losses[0] - 1.0) << "first " << losses[0] << ", mean of the last 5 " << last;
  EXPECT_LT(val.back(), losses[0] - 1.0);
  EXPECT_TRUE(fs::exists(p("ckpt/model.safetensors")) && fs::exists(p("ckpt/trainer_state.json")));

  // Engines and dtypes: a word that is no engine, bf16 on the CPU engine, and (without a GPU) the GPU engine
  // are refused naming what is allowed; eval on the GPU takes --world from the job (one process per rank).
  auto no_engine = run_cli("train --config tiny --data " + train_text() + " --steps 2 --engine tpu");
  EXPECT_NE(no_engine.status, 0);
  EXPECT_NE(no_engine.output.find("allowed: cpu, cuda"), std::string::npos) << no_engine.output;
  auto cpu_bf16 = run_cli("train --config tiny --data " + train_text() + " --steps 2 --dtype bf16");
  EXPECT_NE(cpu_bf16.status, 0);
  EXPECT_NE(cpu_bf16.output.find("bf16 with --engine cuda"), std::string::npos) << cpu_bf16.output;
  auto eval_world = run_cli("eval --config tiny --weights " + p("ckpt/model.safetensors") + " --tokens x --output " +
                            p("o.safetensors") + " --engine cuda --world 2");
  EXPECT_NE(eval_world.status, 0);
  EXPECT_NE(eval_world.output.find("--world 2 but this GPU job has 1 ranks (dmoe launch -n W"), std::string::npos)
      << eval_world.output;
  // The CPU engine's ranks are threads of one process: run as one of a launcher's processes, each would write
  // --output (refused before anything is read).
  auto eval_cpu_job = run_cli("eval --config tiny --weights " + p("ckpt/model.safetensors") + " --tokens x --output " +
                              p("o.safetensors") + " --world 2", "DMOE_RANK=1 DMOE_WORLD=2 DMOE_LOCAL_RANK=1 DMOE_LOCAL_WORLD=2");
  EXPECT_NE(eval_cpu_job.status, 0);
  EXPECT_NE(eval_cpu_job.output.find("but this is one of 2 processes (dmoe-launch)"), std::string::npos)
      << eval_cpu_job.output;
  if (!std::getenv("CUDA_VISIBLE_DEVICES") && !fs::exists("/dev/nvidia0")) {
    auto gpu = run_cli("train --config tiny --data " + train_text() + " --steps 2 --engine cuda");
    EXPECT_NE(gpu.status, 0);
    EXPECT_TRUE(gpu.output.find("needs a CUDA GPU, and none is visible") != std::string::npos ||
                gpu.output.find("built without CUDA") != std::string::npos) << gpu.output;
  }

  // A missing --data file is named.
  auto bad = run_cli("train --config tiny --data " + p("missing.txt") + " --steps 2");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("missing.txt"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace dmoe
