// test_faults.cpp — injected faults on the CPU engine (DMOE_FAULT, core/fault.hpp) over ThreadComm: for
// W ∈ {2, 4, 8} × every stage × every kind, the last rank fails and every other rank must stop within the
// communicator's time limit (DMOE_COMM_TIMEOUT_S = 1 s for hangs here) with an error naming the failed
// rank and its stage; the run as a whole fails (never a result with a rank missing).
//
// Run: dmoe_unit_tests --gtest_filter='*Fault*'. 54 cases, ~1 s each for hangs, ~0.01 s otherwise.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "comm/comm.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/random.hpp"
#include "engine/backend.hpp"
#include "engine/ep_engine.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

// Readable parameters in test names and failures (gtest finds these by argument-dependent lookup).
void PrintTo(FaultStage stage, std::ostream* os) { *os << fault_stage_name(stage); }
void PrintTo(FaultKind kind, std::ostream* os) { *os << fault_kind_name(kind); }

namespace {

// Sets an environment variable for one scope and restores the previous value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(FaultSpec, ParsesAndRefusesWithTheRules) {
  const Fault f = parse_fault("3:expert_gemm:hang");
  EXPECT_EQ(f.rank, 3);
  EXPECT_EQ(f.stage, FaultStage::expert_gemm);
  EXPECT_EQ(f.kind, FaultKind::hang);
  EXPECT_EQ(parse_fault("0:allreduce:throw").kind, FaultKind::throw_error);
  for (const char* bad : {"", "1", "1:alltoall", "x:alltoall:exit", "-1:alltoall:exit", "1:gemm:exit",
                          "1:alltoall:crash", "1:alltoall:exit:2"}) {
    try {
      parse_fault(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("rank:stage:kind"), std::string::npos) << msg;
      EXPECT_NE(msg.find("before_dispatch, alltoall, expert_gemm, combine, backward, allreduce"), std::string::npos)
          << msg;
    }
  }
  ScopedEnv none("DMOE_FAULT", "");
  EXPECT_FALSE(fault_from_env().has_value());
}

using FaultCase = std::tuple<int32_t, FaultStage, FaultKind>;

class FaultMatrix : public ::testing::TestWithParam<FaultCase> {};

TEST_P(FaultMatrix, SurvivorsStopInTimeNamingTheFailedRankAndStage) {
  const auto [world, stage, kind] = GetParam();
  const int32_t failed = world - 1;
  const ScopedEnv fault("DMOE_FAULT", fmt::format("{}:{}:{}", failed, fault_stage_name(stage), fault_kind_name(kind)));
  // A hang is found by the time limit, 1 s here; throw and exit by the poison, long before a 10 s limit
  // (so that a rank slowed by a loaded CI machine is never mistaken for the failed one).
  const ScopedEnv timeout("DMOE_COMM_TIMEOUT_S", kind == FaultKind::hang ? "1" : "10");

  MoeConfig c;
  c.tokens = 4;
  c.hidden = 8;
  c.ffn = 8;
  c.experts = 8;
  c.top_k = 2;
  c.world = world;
  const MoeWeights w = random_moe_weights(c, 1);
  Rng rng(2);
  const auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
  const auto dy = rng.normal_vector(x.size(), 1.0);

  std::vector<std::string> messages(world);
  std::string error;
  const auto start = std::chrono::steady_clock::now();
  try {
    run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
      try {
        auto backend = make_cpu_backend(c.dtype);
        EpEngine engine(c, *backend, comm);
        engine.set_weights(slice_experts(w, c.first_expert(rank), c.experts_per_rank()));
        std::vector<float> xr = x, y(x.size()), dx(x.size()), dyr = dy;
        engine.forward(xr.data(), y.data());
        engine.backward(dyr.data(), dx.data());
        (void)engine.grads();
      } catch (const Error& e) {
        messages[rank] = e.what();
        throw;
      }
    });
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Hang: the 1 s limit + the hung rank's 5 ms poll; throw, exit: well under their 10 s limit. Generous for
  // a loaded 2-core CI machine (and ASan).
  EXPECT_LT(seconds, 5.0);
  ASSERT_FALSE(error.empty()) << "the run succeeded with rank " << failed << " failed";
  const std::string named = kind == FaultKind::hang ? fmt::format("rank {} (last in stage {})", failed,
                                                                  fault_stage_name(stage))
                            : kind == FaultKind::exit ? fmt::format("rank {} exited in stage {}", failed,
                                                                    fault_stage_name(stage))
                                                      : fmt::format("rank {} failed in stage {}", failed,
                                                                    fault_stage_name(stage));
  for (int32_t r = 0; r < world; ++r) {
    if (r == failed) continue;
    EXPECT_NE(messages[r].find(named), std::string::npos) << "rank " << r << ": '" << messages[r] << "'";
  }
  if (std::getenv("DMOE_TEST_VERBOSE"))
    for (int32_t r = 0; r < world; ++r) std::printf("rank %d: %s\n", r, messages[r].c_str());
  EXPECT_NE(error.find(fmt::format("rank {}", failed)), std::string::npos) << error;
  EXPECT_NE(error.find(fault_stage_name(stage)), std::string::npos) << error;
}

std::string case_name(const ::testing::TestParamInfo<FaultCase>& info) {
  const auto [world, stage, kind] = info.param;
  return fmt::format("W{}_{}_{}", world, fault_stage_name(stage), fault_kind_name(kind));
}

INSTANTIATE_TEST_SUITE_P(
    AllStagesAndKinds, FaultMatrix,
    ::testing::Combine(::testing::Values(2, 4, 8),
                       ::testing::Values(FaultStage::before_dispatch, FaultStage::alltoall, FaultStage::expert_gemm,
                                         FaultStage::combine, FaultStage::backward, FaultStage::allreduce),
                       ::testing::Values(FaultKind::throw_error, FaultKind::exit, FaultKind::hang)),
    case_name);

}  // namespace
}  // namespace dmoe
