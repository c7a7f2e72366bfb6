// MoeEngine (engine/moe_engine.hpp) without a GPU: the factory's cpu engine is the reference engine bit for bit,
// and every engine that cannot run says what is wrong and what is allowed (Flash's forward-only rule naming issue
// 14, its dtype and drop policy, the backend kind, a CPU-only build); then `dmoe run|bench --engine ep|flash` and
// their refusals on a machine without a GPU (CI). With a GPU the refusals that need none still run; the rest is in
// tests/gpu/test_moe_engine.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <mutex>
#include <regex>

#include "cli_test_util.hpp"
#include "comm/comm.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"
#include "model/moe_weights.hpp"
#include "model/safetensors.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;
using test::run_cli;

MoeConfig small_config() {
  MoeConfig c;
  c.tokens = 6;
  c.hidden = 16;
  c.ffn = 8;
  c.experts = 4;
  c.top_k = 2;
  c.world = 2;
  return c;
}

// The bad-input error an engine call throws (a test failure if it throws none or an internal one).
std::string input_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_TRUE(e.is_input()) << "an internal error where bad input was expected: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

bool has_gpu() { return fs::exists("/dev/nvidia0"); }

TEST(MoeEngine, CpuKindThroughTheFactoryIsTheReferenceEngineBitForBit) {
  const MoeConfig c = small_config();
  const MoeWeights w = random_moe_weights(c, 3);
  Rng rng(4);
  const auto x = rng.normal_vector(size_t(c.world * c.tokens * c.hidden), 1.0);
  const auto dy = rng.normal_vector(x.size(), 1.0);
  const LayerResult ref = run_cpu_layer(c, w, x, &dy);
  const int64_t T = c.tokens, H = c.hidden, k = c.top_k;
  std::vector<float> y(x.size()), dx(x.size());
  std::vector<int32_t> ids(size_t(c.world * T * k));
  RouterLosses losses;
  MoeWeights g0;
  std::mutex mutex;
  run_thread_ranks(c.world, [&](int32_t rank, Comm& comm) {
    auto backend = make_cpu_backend(c.dtype);
    const auto engine = make_moe_engine(EngineKind::cpu, c, *backend, comm);
    EXPECT_STREQ(engine->name(), "cpu");
    EXPECT_TRUE(engine->supports_backward());
    engine->set_weights(slice_experts(w, c.first_expert(rank), c.experts_per_rank()));
    std::vector<float> xl(x.begin() + rank * T * H, x.begin() + (rank + 1) * T * H);
    std::vector<float> dyl(dy.begin() + rank * T * H, dy.begin() + (rank + 1) * T * H);
    engine->forward(xl.data(), y.data() + rank * T * H, ForwardMode::train);
    engine->backward(dyl.data(), dx.data() + rank * T * H);
    engine->finish();
    const auto mine = engine->expert_ids();
    std::copy(mine.begin(), mine.end(), ids.begin() + rank * T * k);
    const auto rows = engine->expert_rows();
    EXPECT_EQ(rows.size(), size_t(c.experts_per_rank()));
    MoeWeights g = engine->grads();
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t e = 0; e < rows.size(); ++e) EXPECT_EQ(rows[e], ref.expert_rows[c.first_expert(rank) + e]);
    if (rank == 0) {
      losses = engine->losses();
      g0 = std::move(g);
    }
  });
  EXPECT_EQ(y, ref.y);
  EXPECT_EQ(dx, ref.dx);
  EXPECT_EQ(ids, ref.expert_ids);
  EXPECT_EQ(g0.gate, ref.grads.gate);
  EXPECT_EQ(losses.load_balance, ref.losses.load_balance);
}

TEST(MoeEngine, EngineNamesAndTheirAllowedValues) {
  EXPECT_EQ(parse_engine_kind("ep"), EngineKind::ep);
  EXPECT_STREQ(engine_kind_name(EngineKind::flash), "flash");
  EXPECT_NE(input_error([] { parse_engine_kind("cuda"); }).find("allowed: cpu, ep, flash"), std::string::npos);
}

TEST(MoeEngine, FlashIsRefusedWithWhatIsWrongAndWhatIsAllowed) {
  MoeConfig c = small_config();
  c.world = 1;
  c.dtype = DType::bf16;
  MoeEngineOptions train;  // backward = true by default: Flash trains (issue 14), so nothing is refused for it
  if (cuda_engines_built()) EXPECT_EQ(moe_engine_unusable_reason(EngineKind::flash, c, train), "");
  MoeEngineOptions inference;
  inference.backward = false;
  if (cuda_engines_built()) {
    EXPECT_EQ(moe_engine_unusable_reason(EngineKind::ep, c, train), "");
  }
  if (!cuda_engines_built()) {
    for (EngineKind kind : {EngineKind::ep, EngineKind::flash})
      EXPECT_NE(moe_engine_unusable_reason(kind, c, inference).find("built without CUDA"), std::string::npos);
  } else {
    EXPECT_EQ(moe_engine_unusable_reason(EngineKind::flash, c, inference), "");
    c.dtype = DType::f32;
    const std::string dtype = moe_engine_unusable_reason(EngineKind::flash, c, inference);
    EXPECT_NE(dtype.find("bf16 only, and dtype = f32; allowed: dtype bf16"), std::string::npos) << dtype;
    c.dtype = DType::bf16;
    c.capacity_factor = 1.0;
    c.drop_policy = DropPolicy::lowest_weight;
    const std::string policy = moe_engine_unusable_reason(EngineKind::flash, c, inference);
    EXPECT_NE(policy.find("drop_policy = lowest-weight; allowed: drop_policy latest-tokens"), std::string::npos)
        << policy;
    c.drop_policy = DropPolicy::latest_tokens;
  }
  EXPECT_EQ(moe_engine_unusable_reason(EngineKind::cpu, c, train), "");

  // The factory: the same reasons, then the backend kind and the world.
  auto backend = make_cpu_backend(DType::bf16);
  const auto comms = make_thread_comms(1);
  const std::string flash_on_cpu =
      input_error([&] { make_moe_engine(EngineKind::flash, c, *backend, *comms[0], inference); });
  EXPECT_NE(flash_on_cpu.find(cuda_engines_built() ? "runs on a CUDA backend" : "built without CUDA"),
            std::string::npos) << flash_on_cpu;
  EXPECT_NE(input_error([&] { make_moe_engine(EngineKind::flash, c, *backend, *comms[0]); })
                .find(cuda_engines_built() ? "runs on a CUDA backend" : "built without CUDA"),
            std::string::npos);
  EXPECT_NE(input_error([&] { make_moe_engine(EngineKind::ep, c, *backend, *comms[0]); }).find("use engine 'cpu'"),
            std::string::npos);
  MoeConfig two = c;
  two.world = 2;
  EXPECT_NE(input_error([&] { make_moe_engine(EngineKind::cpu, two, *backend, *comms[0]); }).find("world = 2"),
            std::string::npos);
}

class MoeEngineCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_engine_cli_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    ASSERT_EQ(run_cli("init --tokens 4 --hidden 16 --ffn 16 --experts 4 --top-k 2 --seed 2 --out " + p("w.st") +
                      " --input " + p("x.st") + " --grad-output " + p("dy.st")).status, 0);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const char* name) const { return (dir_ / name).string(); }
  std::string run_args(const std::string& engine, const std::string& extra = "") const {
    return "run --engine " + engine + " --top-k 2 --weights " + p("w.st") + " --input " + p("x.st") + " --output " +
           p("y.st") + extra;
  }
  fs::path dir_;
};

// A user error: exit 1, the needle, no source location, nothing written.
void expect_refused(const test::CliResult& r, const std::string& needle, const std::string& what, const fs::path& out) {
  EXPECT_EQ(r.status, 1) << what << "\n" << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << what << ": expected '" << needle << "' in\n" << r.output;
  EXPECT_FALSE(std::regex_search(r.output, std::regex(R"(\.(cpp|hpp|cu):[0-9]+\))"))) << what << "\n" << r.output;
  EXPECT_FALSE(fs::exists(out)) << what;
}

TEST_F(MoeEngineCli, RunFlashBackwardWithoutAGpuSaysWhatToUse) {
  // --engine flash --grad-output runs the Flash backward (issue 14) where a GPU is; here it is refused with
  // what to use instead, nothing written.
  if (has_gpu()) GTEST_SKIP() << "a GPU is visible: tests/gpu/test_moe_engine.cpp runs the Flash backward";
  expect_refused(run_cli(run_args("flash", " --dtype bf16 --grad-output " + p("dy.st"))), "use --engine cpu",
                 "flash --grad-output, real files", dir_ / "y.st");
}

TEST_F(MoeEngineCli, RunFlashAndEpWithoutAGpuSayWhatToUse) {
  // f32: Flash's dtype rule shows on any machine with the CUDA engines built (a CPU-only build says it has
  // none, and what to use).
  expect_refused(run_cli(run_args("flash")), cuda_engines_built() ? "bf16 only" : "use --engine cpu",
                 "flash f32", dir_ / "y.st");
  if (cuda_engines_built())
    expect_refused(run_cli(run_args("flash")), "allowed: dtype bf16", "flash f32, allowed", dir_ / "y.st");
  if (has_gpu()) GTEST_SKIP() << "a GPU is visible: tests/gpu/test_moe_engine.cpp runs these engines";
  for (const char* engine : {"ep", "cuda", "gpu"})
    expect_refused(run_cli(run_args(engine)), "use --engine cpu", engine, dir_ / "y.st");
  expect_refused(run_cli(run_args("flash", " --dtype bf16")), "use --engine cpu", "flash bf16", dir_ / "y.st");
  expect_refused(run_cli(run_args("ep", " --grad-output " + p("dy.st"))), "use --engine cpu", "ep backward",
                 dir_ / "y.st");
  const auto bad = run_cli(run_args("tpu"));
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--engine"), std::string::npos) << bad.output;
}

TEST_F(MoeEngineCli, BenchEngineFlashAndFlashBesideEp) {
  const std::string shape = " --tokens 8 --hidden 16 --ffn 16 --experts 4 --top-k 2 --repeat 1 --warmup 0";
  expect_refused(run_cli("bench --engine flash --flash" + shape), "give one of them", "--engine flash --flash",
                 dir_ / "none");
  expect_refused(run_cli("bench --engine flash --dtype f32" + shape),
                 cuda_engines_built() ? "bf16 only" : "use --engine cpu", "bench flash f32", dir_ / "none");
  expect_refused(run_cli("bench --engine flash --dtype bf16 --capacity-factor 1 --drop-policy lowest-weight" + shape),
                 cuda_engines_built() ? "allowed: drop_policy latest-tokens" : "use --engine cpu",
                 "bench flash lowest-weight", dir_ / "none");
  const auto help = run_cli("bench --help");
  EXPECT_NE(help.output.find("ep (aliases cuda, gpu) | flash"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("--engine flash times Flash alone"), std::string::npos) << help.output;
  const auto run_help = run_cli("run --help");
  EXPECT_NE(run_help.output.find("flash (this GPU"), std::string::npos) << run_help.output;
  if (has_gpu()) GTEST_SKIP() << "a GPU is visible: the GPU benchmarks are run by scripts/gpu_check.sh";
  for (const char* engine : {"ep", "flash"})
    expect_refused(run_cli(std::string("bench --engine ") + engine + " --dtype bf16" + shape), "use --engine cpu",
                   engine, dir_ / "none");
}

}  // namespace
}  // namespace dmoe
