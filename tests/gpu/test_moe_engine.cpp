// MoeEngine on the GPU (W = 1): through make_moe_engine, Flash equals EP within the bf16 tolerance and the CPU
// reference's routing exactly, also across token counts; Flash made for forwards only refuses backward, train
// forwards and losses saying how to make one that trains; the factory names Flash's shape limits. Then the same through the tool: `dmoe run --engine flash`
// against `--engine ep` and `--engine cpu` on files this test writes.
//
// Tolerance: as tests/gpu/test_flash.cpp — both engines store bf16 activations but accumulate in different orders,
// so a value can round to the neighbouring bf16 (relative step 2^-8): 2e-2 on norms. Routing: exact (inputs
// without near ties, margin 1e-4 in logits).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "../unit/cli_test_util.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "cuda/cuda_backend.hpp"
#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"
#include "flash/flash_kernel.hpp"
#include "gpu_test_util.hpp"
#include "layer_test_util.hpp"
#include "model/checkpoint.hpp"
#include "model/config_io.hpp"
#include "model/safetensors.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;
using test::kTolBf16;  // gpu_test_util.hpp

MoeConfig engine_config(int64_t tokens) {
  MoeConfig c;
  c.tokens = tokens;
  c.hidden = 256;
  c.ffn = 384;
  c.experts = 8;
  c.top_k = 2;
  c.activation = Activation::swiglu;
  c.dtype = DType::bf16;
  return c;
}

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

// One engine's forward on host data, through the interface only.
struct Forward {
  std::vector<float> y;
  std::vector<int32_t> ids;
};
Forward run_forward(MoeEngine& engine, const std::vector<float>& x) {
  Backend& be = engine.backend();
  const int64_t n = engine.config().tokens * engine.config().hidden;
  const size_t bytes = size_t(n) * dtype_size(be.storage_dtype());
  void* xd = be.allocate(bytes);
  void* yd = be.allocate(bytes);
  be.upload_f32(xd, x.data(), n);
  engine.forward(xd, yd, ForwardMode::inference);
  engine.finish();
  Forward f;
  f.y.resize(size_t(n));
  be.download_f32(f.y.data(), yd, n);
  f.ids = engine.expert_ids();
  be.release(xd);
  be.release(yd);
  return f;
}

TEST(MoeEngineGpu, FlashEqualsEpAndTheCpuRoutingThroughTheFactory) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  auto backend = make_cuda_backend(DType::bf16, 0);
  auto comm = make_local_comm();
  MoeEngineOptions forward_only;
  forward_only.backward = false;
  const MoeConfig c0 = engine_config(300);
  const MoeWeights w = random_moe_weights(c0, 41);
  const auto ep = make_moe_engine(EngineKind::ep, c0, *backend, *comm, forward_only);
  const auto flash = make_moe_engine(EngineKind::flash, c0, *backend, *comm, forward_only);
  EXPECT_STREQ(flash->name(), "flash");
  EXPECT_FALSE(flash->supports_backward());
  ep->set_weights(w);
  flash->set_weights(w);
  // 300 tokens, then 64 (a second FlashEngine inside the adapter), then 300 again (the first one, reused).
  for (const int64_t tokens : {300, 64, 300}) {
    const MoeConfig c = engine_config(tokens);
    ep->set_tokens(tokens);
    flash->set_tokens(tokens);
    const auto x = inputs_without_near_ties(c, w, 700 + uint64_t(tokens), 1e-4f);
    ASSERT_FALSE(x.empty());
    const LayerResult ref = run_cpu_layer(c, w, x, nullptr);
    const Forward fe = run_forward(*ep, x), ff = run_forward(*flash, x);
    const std::string tag = "T = " + std::to_string(tokens);
    EXPECT_EQ(ff.ids, ref.expert_ids) << tag << ": Flash's routing differs from the CPU reference's";
    EXPECT_EQ(fe.ids, ref.expert_ids) << tag << ": EP's routing differs from the CPU reference's";
    EXPECT_CLOSE(ff.y.data(), fe.y.data(), ff.y.size(), kTolBf16, tag << " flash vs ep");
    EXPECT_CLOSE(ff.y.data(), ref.y.data(), ff.y.size(), kTolBf16, tag << " flash vs cpu");
    EXPECT_EQ(flash->expert_rows(), ep->expert_rows()) << tag;
    EXPECT_EQ(flash->rows_sent_to_peers(), 0) << tag;
  }
  // Made for forwards only: train calls refused, never a silent fallback.
  Backend& be = *backend;
  void* xd = be.allocate(300 * 256 * 2);
  void* yd = be.allocate(300 * 256 * 2);
  for (const std::string& e :
       {input_error([&] { flash->forward(xd, yd, ForwardMode::train); }), input_error([&] { flash->backward(xd, yd); }),
        input_error([&] { flash->zero_grads(); }), input_error([&] { flash->grads(); }),
        input_error([&] { flash->losses(); })}) {
    EXPECT_TRUE(e.find("backward = true") != std::string::npos || e.find("train forward") != std::string::npos) << e;
  }
  be.release(xd);
  be.release(yd);
}

TEST(MoeEngineGpu, FactoryNamesWhatFlashCannotRun) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  auto bf16 = make_cuda_backend(DType::bf16, 0);
  auto f32 = make_cuda_backend(DType::f32, 0);
  auto comm = make_local_comm();
  MoeEngineOptions forward_only;
  forward_only.backward = false;
  MoeConfig c = engine_config(64);
  EXPECT_TRUE(make_moe_engine(EngineKind::flash, c, *bf16, *comm)->supports_backward());  // trains (issue 14)
  EXPECT_NE(input_error([&] { make_moe_engine(EngineKind::flash, c, *f32, *comm, forward_only); }).find("bf16 only"),
            std::string::npos);
  c.hidden = 200;
  const std::string hidden = input_error([&] { make_moe_engine(EngineKind::flash, c, *bf16, *comm, forward_only); });
  EXPECT_NE(hidden.find("hidden = 200 is not a multiple of 16"), std::string::npos) << hidden;
  EXPECT_NE(hidden.find("use engine 'ep'"), std::string::npos) << hidden;
  c.hidden = 256;
  c.experts = 256;  // the gate's warps hold at most 192
  const std::string experts = input_error([&] { make_moe_engine(EngineKind::flash, c, *bf16, *comm, forward_only); });
  EXPECT_NE(experts.find("E = 256"), std::string::npos) << experts;
  c.experts = 8;
  c.dtype = DType::f32;
  EXPECT_NE(input_error([&] { make_moe_engine(EngineKind::flash, c, *f32, *comm, forward_only); })
                .find("allowed: dtype bf16"), std::string::npos);
  EXPECT_NO_THROW(make_moe_engine(EngineKind::ep, c, *f32, *comm));  // EP serves f32, forward and backward
}

class MoeEngineGpuCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_engine_gpu_cli_" + std::to_string(::getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const char* name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// `dmoe run --engine flash` against `--engine ep` (y within 2e-2, routing equal) and `--engine cpu` (routing
// exactly equal) on one layer: weights and config from `dmoe init`, x written here without near-tied logits.
TEST_F(MoeEngineGpuCli, RunEngineFlashEqualsEpAndCpuRouting) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  // One process's CLI runs: under a launcher the children inherit its rank variables, and `dmoe run --engine cpu` is
  // then (rightly) refused as one of W processes. Found at W = 2 on the H100, twenty-fifth session.
  if (detect_process_env().world > 1) GTEST_SKIP() << "a one-process test (dmoe run --engine cpu refuses to be one of "
                                                   << detect_process_env().world << " processes)";
  const MoeConfig c = engine_config(300);
  auto r = test::run_cli("init --hidden 256 --ffn 384 --experts 8 --top-k 2 --tokens 300 --dtype bf16 --seed 7 "
                         "--out " + p("w.st") + " --save-config " + p("c.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  const MoeConfig saved = load_config_file(p("c.json"));
  const MoeWeights w = load_moe_weights(SafetensorsFile::open(p("w.st")), saved, layer_prefix(0));
  const auto x = inputs_without_near_ties(c, w, 900, 1e-4f);
  ASSERT_FALSE(x.empty());
  SafetensorsWriter xs;
  xs.add_f32("x", {c.tokens, c.hidden}, x, DType::bf16);
  xs.write(p("x.st"));
  const std::string common = "run --config " + p("c.json") + " --weights " + p("w.st") + " --input " + p("x.st");
  for (const char* engine : {"cpu", "ep", "flash"}) {
    r = test::run_cli(common + " --engine " + engine + " --output-dtype f32 --output " + p(engine));
    ASSERT_EQ(r.status, 0) << engine << "\n" << r.output;
    EXPECT_NE(r.output.find(std::string("engine ") + engine), std::string::npos) << r.output;
  }
  const auto read = [&](const char* engine) { return SafetensorsFile::open(p(engine)); };
  const int64_t T = c.tokens, H = c.hidden, k = c.top_k;
  const auto y_flash = read("flash").read_f32("y", {T, H}), y_ep = read("ep").read_f32("y", {T, H});
  const auto y_cpu = read("cpu").read_f32("y", {T, H});
  const auto ids_flash = read("flash").read_i32("expert_ids", {T, k});
  EXPECT_EQ(ids_flash, read("cpu").read_i32("expert_ids", {T, k})) << "flash routing vs the CPU reference";
  EXPECT_EQ(ids_flash, read("ep").read_i32("expert_ids", {T, k})) << "flash routing vs ep";
  EXPECT_CLOSE(y_flash.data(), y_ep.data(), y_flash.size(), kTolBf16, "dmoe run: flash vs ep");
  EXPECT_CLOSE(y_flash.data(), y_cpu.data(), y_flash.size(), kTolBf16, "dmoe run: flash vs cpu");
  EXPECT_EQ(read("flash").metadata().count("load_balance_loss"), 0u) << "Flash computes no losses: none written";
  EXPECT_EQ(read("ep").metadata().count("load_balance_loss"), 1u);
  // Backward: `--engine flash --grad-output` against `--engine ep` (dx and every gradient within 2e-2) and the
  // losses (written by both: a train forward).
  Rng rng(77);
  const auto dy = rng.normal_vector(size_t(T * H), 1.0);
  SafetensorsWriter dys;
  dys.add_f32("dy", {T, H}, dy, DType::bf16);
  dys.write(p("dy.st"));
  for (const char* engine : {"ep", "flash"}) {
    r = test::run_cli(common + " --engine " + engine + " --grad-output " + p("dy.st") + " --output-dtype f32 --output " +
                      p((std::string(engine) + "_bwd").c_str()));
    ASSERT_EQ(r.status, 0) << engine << "\n" << r.output;
  }
  const SafetensorsFile fb = SafetensorsFile::open(p("flash_bwd")), eb = SafetensorsFile::open(p("ep_bwd"));
  EXPECT_EQ(fb.metadata().count("load_balance_loss"), 1u);
  for (const std::string& name : eb.names()) {
    if (name.rfind("grad", 0) != 0 && name != "dx") continue;
    ASSERT_TRUE(fb.has(name)) << name;
    const auto a = fb.read_f32(name, fb.info(name).shape), b = eb.read_f32(name, eb.info(name).shape);
    EXPECT_CLOSE(a.data(), b.data(), a.size(), kTolBf16, "dmoe run --grad-output: flash vs ep, " << name);
  }
}

}  // namespace
}  // namespace dmoe
