// test_env.cpp — settings read from the environment (core/env.hpp).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/env.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

// Sets DMOE_COMM_TIMEOUT_S for one test and restores the previous value.
class TimeoutEnv : public testing::Test {
 protected:
  void SetUp() override {
    const char* v = std::getenv("DMOE_COMM_TIMEOUT_S");
    had_ = v != nullptr;
    if (had_) saved_ = v;
  }
  void TearDown() override {
    if (had_)
      setenv("DMOE_COMM_TIMEOUT_S", saved_.c_str(), 1);
    else
      unsetenv("DMOE_COMM_TIMEOUT_S");
  }
  bool had_ = false;
  std::string saved_;
};

TEST_F(TimeoutEnv, DefaultIsTenMinutes) {
  unsetenv("DMOE_COMM_TIMEOUT_S");
  EXPECT_EQ(host_wait_timeout_seconds(), 600.0);
}

TEST_F(TimeoutEnv, ReadsSeconds) {
  setenv("DMOE_COMM_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(host_wait_timeout_seconds(), 2.5);
}

TEST_F(TimeoutEnv, RejectsWhatIsNotAPositiveNumber) {
  for (const char* bad : {"", "abc", "10s", "0", "-3"}) {
    setenv("DMOE_COMM_TIMEOUT_S", bad, 1);
    try {
      host_wait_timeout_seconds();
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DMOE_COMM_TIMEOUT_S"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace dmoe
