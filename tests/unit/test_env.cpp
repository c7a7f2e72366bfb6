// test_env.cpp — settings read from the environment (core/env.hpp).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

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

// An empty value is the default, as for the other knobs (README: "an empty value is as unset"); it was refused until
// the thirteenth bad-input pass, with no reason recorded.
TEST_F(TimeoutEnv, EmptyIsTheDefault) {
  setenv("DMOE_COMM_TIMEOUT_S", "", 1);
  EXPECT_EQ(host_wait_timeout_seconds(), 600.0);
}

TEST_F(TimeoutEnv, RejectsWhatIsNotAPositiveNumber) {
  for (const char* bad : {" ", "abc", "10s", "0", "-3"}) {
    setenv("DMOE_COMM_TIMEOUT_S", bad, 1);
    try {
      host_wait_timeout_seconds();
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DMOE_COMM_TIMEOUT_S"), std::string::npos) << e.what();
    }
  }
}

// The readers of the GPU knobs (seventh bad-input pass): exact words, strict decimal integers in a range, input errors.
TEST(EnvKnobs, ChoicesAndIntegersAreExactAndNameTheVariable) {
  ::unsetenv("DMOE_TEST_KNOB");
  EXPECT_EQ(env_choice("DMOE_TEST_KNOB", {"a", "b"}, "a"), "a");
  EXPECT_EQ(env_integer("DMOE_TEST_KNOB", 1, 9, 5, ""), 5);
  ::setenv("DMOE_TEST_KNOB", "", 1);
  EXPECT_EQ(env_choice("DMOE_TEST_KNOB", {"a", "b"}, "a"), "a");
  EXPECT_EQ(env_integer("DMOE_TEST_KNOB", 1, 9, 5, ""), 5);
  ::setenv("DMOE_TEST_KNOB", "b", 1);
  EXPECT_EQ(env_choice("DMOE_TEST_KNOB", {"a", "b"}, "a"), "b");
  ::setenv("DMOE_TEST_KNOB", "9", 1);
  EXPECT_EQ(env_integer("DMOE_TEST_KNOB", 1, 9, 5, ""), 9);
  for (const char* bad : {"B", " b", "b ", "c"}) {
    ::setenv("DMOE_TEST_KNOB", bad, 1);
    try {
      (void)env_choice("DMOE_TEST_KNOB", {"a", "b"}, "a");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_TRUE(e.is_input()) << e.what();
      EXPECT_NE(std::string(e.what()).find("DMOE_TEST_KNOB='" + std::string(bad) + "' is not allowed; allowed: a, b"),
                std::string::npos) << e.what();
    }
  }
  for (const char* bad : {"0", "10", " 5", "5 ", "+5", "5.0", "0x5", "-", "99999999999999999999"}) {
    ::setenv("DMOE_TEST_KNOB", bad, 1);
    try {
      (void)env_integer("DMOE_TEST_KNOB", 1, 9, 5, "units");
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_TRUE(e.is_input()) << e.what();
      EXPECT_NE(std::string(e.what()).find("allowed: a decimal integer from 1 to 9 units"), std::string::npos)
          << e.what();
    }
  }
  ::unsetenv("DMOE_TEST_KNOB");
}

TEST(EnvKnobs, UnknownDmoeNamesAreFoundWithTheirNearestKnownName) {
  std::string a = "DMOE_WGARD=sm90", b = "DMOE_EXPERT_GEMM=loop", c = "PATH=/bin", d = "DMOE_SOMETHING_ELSE=1",
              e = "DMOE_HOME";
  char* environment[] = {a.data(), b.data(), c.data(), d.data(), e.data(), nullptr};
  const std::vector<std::string> w = unknown_dmoe_variables(environment);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_NE(w[0].find("DMOE_WGARD is set but dmoe reads no such variable"), std::string::npos) << w[0];
  EXPECT_NE(w[0].find("(did you mean DMOE_WGRAD?)"), std::string::npos) << w[0];
  EXPECT_NE(w[1].find("DMOE_SOMETHING_ELSE"), std::string::npos) << w[1];
  EXPECT_NE(w[1].find("the README lists"), std::string::npos) << w[1];  // no near miss: no guess
}

TEST(EnvKnobs, ByteSizesAreExactAndNameTheVariable) {
  const char* name = "DMOE_TEST_KNOB";
  const std::vector<std::pair<const char*, uint64_t>> good = {
      {"0", 0}, {"4096", 4096}, {"1k", 1024}, {"1kB", 1024}, {"2KiB", 2048}, {"3M", 3ull << 20}, {"1G", 1ull << 30},
      {"1GiB", 1ull << 30}, {"5GB", 5ull << 30}, {"2T", 2ull << 40}, {"7B", 7}};
  for (const auto& [text, bytes] : good) {
    setenv(name, text, 1);
    EXPECT_EQ(env_byte_size(name, 99), bytes) << text;
  }
  // A malformed value was read as 0 bytes (no floor for the NVSHMEM heap) without a word.
  for (const char* bad : {"abc", "1e9", " 1G", "1 G", "1iB", "1GG", "1BB", "-1", "1.5G"}) {
    setenv(name, bad, 1);
    try {
      (void)env_byte_size(name, 99);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(std::string("DMOE_TEST_KNOB='") + bad + "'"), std::string::npos) << m;
      EXPECT_NE(m.find("allowed: a decimal number of bytes"), std::string::npos) << m;
    }
  }
  // A size past 64 bits is one, too large (G19-9: it was "not a size").
  for (const char* large : {"99999999999999999999", "16777216T", "18446744073709551616", "17179869184G"}) {
    setenv(name, large, 1);
    try {
      (void)env_byte_size(name, 99);
      ADD_FAILURE() << large << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("DMOE_TEST_KNOB='") + large + "' is too large: the maximum is "
                                           "18446744073709551615 bytes"), std::string::npos) << e.what();
    }
  }
  setenv(name, "18446744073709551615", 1);
  EXPECT_EQ(env_byte_size(name, 99), UINT64_MAX);
  setenv(name, "16777215T", 1);
  EXPECT_EQ(env_byte_size(name, 99), 16777215ull << 40);
  unsetenv(name);
  EXPECT_EQ(env_byte_size(name, 99), 99u);
}

// G19-8 (nineteenth bad-input pass): "1g", "1GB" and "1K" were taken but "1gib" and "1Gi" refused, by a message that
// promised "KiB too": the suffix is read in any case now, with B, i or iB after it, and the message lists the spellings.
TEST(EnvKnobs, ByteSizeSuffixesAreReadInAnyCaseAsTheMessageSays) {
  const char* name = "DMOE_TEST_KNOB";
  const std::vector<std::pair<const char*, uint64_t>> good = {
      {"1g", 1ull << 30},   {"1m", 1ull << 20},   {"1K", 1024},        {"1t", 1ull << 40},  {"1GB", 1ull << 30},
      {"1gib", 1ull << 30}, {"1Gi", 1ull << 30},  {"1GIB", 1ull << 30}, {"2kib", 2048},      {"3Mi", 3ull << 20},
      {"1gB", 1ull << 30},  {"4TiB", 4ull << 40}, {"7b", 7},           {"512mib", 512ull << 20}};
  for (const auto& [text, bytes] : good) {
    setenv(name, text, 1);
    EXPECT_EQ(env_byte_size(name, 99), bytes) << text;
  }
  for (const char* bad : {"1gi b", "1gbi", "1ib", "1i", "1bb", "1bi", "1kk", "1gibb", "1P", "1Gib2"}) {
    setenv(name, bad, 1);
    try {
      (void)env_byte_size(name, 99);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("optionally with a suffix K, M, G or T (powers of 1024), in any case and "
                                           "optionally followed by B, i or iB (1G, 1g, 1GB, 1Gi, 1GiB, 1gib"),
                std::string::npos) << e.what();
    }
  }
  unsetenv(name);
}

}  // namespace
}  // namespace dmoe
