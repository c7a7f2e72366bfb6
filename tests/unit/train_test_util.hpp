// train_test_util.hpp — what the training-loop tests share (test_train.cpp, test_train_flow.cpp): the tiny model,
// the frozen training text, a small run's options, and a fixture with a scratch folder per test.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "model/mixtral_config.hpp"
#include "model/trainer.hpp"

namespace dmoe::test {

inline std::string train_text() {
  return (std::filesystem::path(DMOE_SOURCE_DIR) / "tests" / "data" / "train_text.txt").string();
}

inline MixtralConfig tiny_model() {
  return load_mixtral_config((std::filesystem::path(DMOE_SOURCE_DIR) / "bench/models/tiny.json").string());
}

// A 6-step run of 4 sequences of 16 tokens, warm-up 2, quiet.
inline TrainOptions small_train_options() {
  TrainOptions o;
  o.data_path = train_text();
  o.seq = 16;
  o.batch = 4;
  o.steps = 6;
  o.warmup = 2;
  o.print_every = 0;
  return o;
}

// A scratch folder per test (removed after it); p(name) is a path inside it.
class TrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("dmoe_train_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name() + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

}  // namespace dmoe::test
