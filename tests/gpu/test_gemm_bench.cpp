// test_gemm_bench.cpp — the variant list of `dmoe bench gemm` (bench/cuda/gemm_bench.hpp): parsed into the
// kernel's tuning, and bad lists rejected with a message naming the variant and what is allowed. No GPU
// needed (this runs in CI).
#include <gtest/gtest.h>

#include <string>

#include "bench/cuda/gemm_bench.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

TEST(GemmBenchVariants, ParsesKeys) {
  const auto v = bench::parse_gemm_variants("b256,b128s,b256E,b256M,d,b256q");
  ASSERT_EQ(v.size(), 6u);
  EXPECT_EQ(v[0].name, "b256");
  EXPECT_EQ(v[0].tuning.block_n, 256);
  EXPECT_EQ(v[0].tuning.epilogue, 0);
  EXPECT_EQ(v[1].tuning.block_n, 128);
  EXPECT_EQ(v[1].tuning.epilogue, 1);
  EXPECT_EQ(v[2].tuning.leave_out, 1);
  EXPECT_EQ(v[3].tuning.leave_out, 2);
  EXPECT_EQ(v[4].tuning.block_n, 0);
  EXPECT_EQ(v[4].tuning.epilogue, 2);
  EXPECT_EQ(v[5].tuning.schedule, 2);
  EXPECT_EQ(bench::parse_gemm_variants(",b256,,").size(), 1u) << "empty entries are skipped";
}

TEST(GemmBenchVariants, RejectsBadLists) {
  auto message = [](const std::string& list) {
    try {
      bench::parse_gemm_variants(list);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(message("b256,x3").find("unknown key 'x'"), std::string::npos) << message("b256,x3");
  EXPECT_NE(message("b256,x3").find("allowed"), std::string::npos);
  EXPECT_NE(message("bs").find("needs a number"), std::string::npos) << message("bs");
  EXPECT_NE(message("").find("no GEMM variants"), std::string::npos) << message("");
  EXPECT_NE(message("b99999999999").find("too long"), std::string::npos) << message("b99999999999");
}

}  // namespace
}  // namespace dmoe
