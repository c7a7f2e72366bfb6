// test_host_resources.cpp — the up-front estimates (core/host_resources.hpp) and the refusals built on them:
// a job that cannot fit is refused with the numbers before anything is allocated or written.
//
// Run: dmoe_unit_tests --gtest_filter='HostResources*'.
#include <gtest/gtest.h>

#include <string>

#include "core/error.hpp"
#include "core/host_resources.hpp"

namespace dmoe {
namespace {

TEST(HostResources, MachineFiguresAreRead) {
  const auto available = host_memory_available_bytes();
  ASSERT_TRUE(available.has_value());  // Linux (CI)
  EXPECT_GT(*available, 0u);
  const auto free = disk_free_bytes(".");
  ASSERT_TRUE(free.has_value());
  EXPECT_FALSE(disk_free_bytes("/no/such/dir").has_value());
  EXPECT_EQ(format_bytes(100), "100 B");
  EXPECT_EQ(format_bytes(1.5 * 1024 * 1024 * 1024), "1.5 GiB");
}

TEST(HostResources, CpuLayerEstimateFollowsItsFormula) {
  MoeConfig c;
  c.tokens = 16;
  c.hidden = 32;
  c.ffn = 64;
  c.experts = 8;
  c.top_k = 2;
  c.world = 4;
  const CpuLayerEstimate fwd = estimate_cpu_layer(c, false), both = estimate_cpu_layer(c, true);
  EXPECT_DOUBLE_EQ(fwd.flop, 4.0 * (2 * 3 * 16 * 2 * 32 * 64 + 2 * 16 * 32 * 8));
  EXPECT_DOUBLE_EQ(both.flop, 3 * fwd.flop);
  EXPECT_GT(both.bytes, fwd.bytes);
  // The gate is replicated on every rank: at W = E = 4096 that alone is W·E·H·4 bytes.
  c.world = c.experts = 4096;
  c.hidden = 256;
  EXPECT_GT(estimate_cpu_layer(c, false).bytes, 4096.0 * 4096 * 256 * 4);
}

TEST(HostResources, TooMuchMemoryIsRefusedWithTheNumbers) {
  std::string msg;
  try {
    require_host_memory(1e18, "a test job");
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("a test job would allocate about 888.2 PiB"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MemAvailable"), std::string::npos) << msg;
  EXPECT_NO_THROW(require_host_memory(1024, "a small job"));
}

}  // namespace
}  // namespace dmoe
