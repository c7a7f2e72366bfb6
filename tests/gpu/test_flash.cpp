// The Flash persistent kernel against the CPU reference engine and the EP engine on the GPU. One process:
// W = 1. Launched as W processes (dmoe launch / mpirun, ranks sharing GPUs under MPS or one per GPU): each
// rank runs its share over NVSHMEM symmetric memory and compares its tokens with the CPU run of all ranks.
//
// Tolerances: both sides store bf16 activations but accumulate in different orders (the kernel: wgmma f32
// k-blocks and an f32 combine; the CPU: fp64 sums), so a value can round to the neighbouring bf16 (relative
// step 2^-8): 2e-2 on norms, as the EP engine's GPU tests. Routing: exact (inputs without near ties).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "engine/ep_engine.hpp"
#include "engine/reference.hpp"
#include "flash/flash_engine.hpp"
#include "flash/flash_kernel.hpp"
#include "flash_test_util.hpp"
#include "gpu_test_util.hpp"
#include "layer_test_util.hpp"

namespace dmoe {
namespace {

using test::kTolBf16;  // gpu_test_util.hpp

std::vector<bfloat16> to_bf16(const float* v, size_t n) {
  std::vector<bfloat16> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = float_to_bf16(v[i]);
  return b;
}

std::vector<float> from_bf16(const std::vector<bfloat16>& b) {
  std::vector<float> v(b.size());
  for (size_t i = 0; i < b.size(); ++i) v[i] = bf16_to_float(b[i]);
  return v;
}

struct DeviceRows {
  void* ptr = nullptr;
  size_t n = 0;
  explicit DeviceRows(size_t elements) : n(elements) { DMOE_CHECK_CUDA(cudaMalloc(&ptr, std::max<size_t>(n * 2, 16))); }
  ~DeviceRows() { cudaFree(ptr); }
  void upload(const float* v) {
    const auto b = to_bf16(v, n);
    DMOE_CHECK_CUDA(cudaMemcpy(ptr, b.data(), n * 2, cudaMemcpyHostToDevice));
  }
  std::vector<float> download() const {
    std::vector<bfloat16> b(n);
    DMOE_CHECK_CUDA(cudaMemcpy(b.data(), ptr, n * 2, cudaMemcpyDeviceToHost));
    return from_bf16(b);
  }
};

class FlashLayer : public ::testing::TestWithParam<FlashCase> {};

// y and the routing against the CPU reference (all ranks' tokens) and, at W = 1, the EP engine on the GPU.
// `split_gate`: whether the engine must have chosen the split gate (0 or 1; 2: auto's rule, split where the items
// fit the grid and H has at least 16 column chunks).
void check_flash_layer(const FlashCase& fc, int64_t hidden, int split_gate) {
  const ProcessEnv env = detect_process_env();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const int device = choose_device(env, devices);
  DMOE_CHECK_CUDA(cudaSetDevice(device));
  cudaStream_t stream;
  DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  {
    auto comm = make_flash_test_comm(env, stream);
    MoeConfig c = flash_case_config(fc, comm->world());
    c.hidden = hidden;
    const int32_t rank = comm->rank(), Le = c.experts_per_rank();
    const int64_t T = c.tokens, H = c.hidden, k = c.top_k;
    const MoeWeights w = random_moe_weights(c, 23);
    // Margin 1e-4: the kernel's f32 tensor-core logits differ from fp64 by ~1e-6 at H = 256.
    const auto x = inputs_without_near_ties(c, w, 300, 1e-4f);
    ASSERT_FALSE(x.empty());
    const LayerResult ref = run_cpu_layer(c, w, x, nullptr);

    FlashEngine engine(c, *comm);
    const flash::Shape& shape = engine.shape();
    const bool expect_split = split_gate == 2 ? shape.split_gate_items() <= shape.grid && shape.gate_column_chunks() >= 16
                                              : split_gate != 0;
    ASSERT_EQ(shape.split_gate, expect_split) << c.summary() << ", grid " << shape.grid;
    const char* combine = std::getenv("DMOE_FLASH_COMBINE");
    ASSERT_EQ(shape.spread_combine, combine == nullptr || std::string(combine) == "slice");  // unset: slice
    const char* prefetch = std::getenv("DMOE_FLASH_PREFETCH");
    ASSERT_EQ(shape.prefetch_down, prefetch != nullptr && std::string(prefetch) == "1");
    engine.set_weights(slice_experts(w, c.first_expert(rank), Le));
    DeviceRows xd{size_t(T * H)}, yd{size_t(T * H)};
    // First a forward of other tokens (this rank's rows in reverse order: other routing, other drops), so that
    // the checked forward follows one whose partial logits, drop marks and returned rows differ: a read of the
    // previous forward's data shows (the same input twice would hide it).
    std::vector<float> other(size_t(T * H));
    for (int64_t t = 0; t < T; ++t)
      std::copy_n(x.data() + (rank * T + (T - 1 - t)) * H, H, other.data() + t * H);
    xd.upload(other.data());
    engine.forward(xd.ptr, yd.ptr, stream);
    engine.check(stream);
    xd.upload(x.data() + rank * T * H);
    engine.forward(xd.ptr, yd.ptr, stream);
    engine.check(stream);
    const auto y = yd.download();
    const auto ids = engine.expert_ids(stream);
    const std::string tag = "rank " + std::to_string(rank) + " " + c.summary();
    ASSERT_EQ(ids, std::vector<int32_t>(ref.expert_ids.begin() + rank * T * k, ref.expert_ids.begin() + (rank + 1) * T * k))
        << tag;
    const auto rows = engine.expert_rows(stream);
    for (int32_t le = 0; le < Le; ++le) EXPECT_EQ(rows[le], ref.kept[c.first_expert(rank) + le]) << tag << " expert " << le;
    EXPECT_CLOSE(y.data(), ref.y.data() + rank * T * H, size_t(T * H), kTolBf16, tag << " y vs CPU");

    // A second forward on the same data gives the same bits (the other parity's buffers).
    engine.forward(xd.ptr, yd.ptr, stream);
    engine.check(stream);
    EXPECT_TRUE(yd.download() == y) << tag << ": second forward differs";

    if (comm->world() == 1) {
      auto backend = make_cuda_backend(DType::bf16, device);
      auto local = make_local_comm();
      EpEngine ep(c, *backend, *local);
      ep.set_weights(w);
      void* ex = backend->allocate(T * H * 2);
      void* ey = backend->allocate(T * H * 2);
      backend->upload_f32(ex, x.data(), T * H);
      ep.forward(ex, ey, ForwardMode::inference);
      std::vector<float> y_ep(size_t(T * H));
      backend->download_f32(y_ep.data(), ey, T * H);
      EXPECT_EQ(ep.expert_ids(), ids) << tag << ": routing differs from the EP engine";
      EXPECT_CLOSE(y.data(), y_ep.data(), size_t(T * H), kTolBf16, tag << " y vs EP");
      backend->release(ex);
      backend->release(ey);
    }
    comm->barrier(stream);
  }
  cudaStreamDestroy(stream);
}

TEST_P(FlashLayer, MatchesCpuReferenceAndEpEngine) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  check_flash_layer(GetParam(), 256, 0);  // H = 256: 4 column chunks, the block's own gate loop (auto)
}

// An environment variable (DMOE_FLASH_GATE, DMOE_FLASH_COMBINE) for one scope (restored after).
struct ScopedEnv {
  std::string name, before;
  bool had = false;
  ScopedEnv(const char* variable, const char* value) : name(variable) {
    if (const char* v = std::getenv(variable)) {
      had = true;
      before = v;
    }
    setenv(variable, value, 1);
  }
  ~ScopedEnv() {
    if (had) setenv(name.c_str(), before.c_str(), 1);
    else unsetenv(name.c_str());
  }
};
struct ScopedGateMode : ScopedEnv {
  explicit ScopedGateMode(const char* mode) : ScopedEnv("DMOE_FLASH_GATE", mode) {}
};

// The split gate (every (token chunk, column chunk) item on a block of its own, partial logits summed by each
// token's block after a grid barrier): chosen by auto at H = 1024 (16 column chunks) where the items fit the grid,
// forced at H = 256; against the CPU reference and EP as above, with partial token chunks (T = 1, 37, 300), k = 8,
// E = 16, every activation; and H = 1024 with the block's own loop (block) for the same cases.
TEST(FlashLayerSplitGate, MatchesCpuReferenceAndEpEngine) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  const FlashCase cases[] = {{Activation::swiglu, 0, 1, 8, 2}, {Activation::swiglu, 0, 37, 8, 8},
                             {Activation::relu, 0.5, 129, 8, 1}, {Activation::gelu, 0, 300, 16, 4}};
  for (const FlashCase& fc : cases) {
    SCOPED_TRACE(case_name(fc));
    {
      ScopedGateMode mode("auto");
      check_flash_layer(fc, 1024, 2);
    }
    {
      // Forced split needs a block per item: under MPS a rank's grid can be smaller (then it is an input error).
      MoeConfig c = flash_case_config(fc, 1);
      flash::Shape shape = flash::make_shape(c, 1);
      shape.grid = cuda::flash_grid_blocks(shape);
      if (shape.split_gate_items() <= shape.grid) {
        ScopedGateMode mode("split");
        check_flash_layer(fc, 256, 1);
      }
    }
    {
      ScopedGateMode mode("block");
      check_flash_layer(fc, 1024, 0);
    }
  }
}

// The combine spread over every block's warps (DMOE_FLASH_COMBINE=slice), on the full grid (132 blocks: 1056
// warps, so the narrow 256-column slices at these T) and on a grid of 8 forced through DMOE_FLASH_GRID (64 warps:
// wide 1024-column slices from T = 37 on); H = 256, 1024 and 1040 (130 chunks: the last slice cut; with the split
// gate, a partial last column chunk of 16); capacity (0.5) in one case; with the split gate where auto takes it;
// against the CPU reference and EP as above (each element is the token combine's sum in its order: the same
// tolerances). The index arithmetic itself is checked on the CPU (FlashProtocol.CombineItemsCoverEveryChunkOnce).
TEST(FlashLayerSpreadCombine, MatchesCpuReferenceAndEpEngine) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  ScopedEnv combine("DMOE_FLASH_COMBINE", "slice");
  const FlashCase cases[] = {{Activation::swiglu, 0, 1, 8, 2}, {Activation::swiglu, 0, 37, 8, 8},
                             {Activation::relu, 0.5, 129, 8, 1}, {Activation::gelu, 0, 300, 16, 4}};
  for (const FlashCase& fc : cases) {
    SCOPED_TRACE(case_name(fc));
    check_flash_layer(fc, 256, 0);
    {
      ScopedGateMode mode("auto");
      check_flash_layer(fc, 1024, 2);
      check_flash_layer(fc, 1040, 2);
    }
    {
      ScopedEnv grid("DMOE_FLASH_GRID", "8");
      check_flash_layer(fc, 1040, 0);
    }
  }
}

// The paths the defaults left (twenty-eighth session): each block's own gate loop and its own tokens' combine
// (DMOE_FLASH_GATE=block, DMOE_FLASH_COMBINE=token), kept selectable, on the same cases at H = 1024 and 1040.
TEST(FlashLayerBlockGateTokenCombine, MatchesCpuReferenceAndEpEngine) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  ScopedEnv combine("DMOE_FLASH_COMBINE", "token");
  ScopedGateMode mode("block");
  const FlashCase cases[] = {{Activation::swiglu, 0, 1, 8, 2}, {Activation::swiglu, 0, 37, 8, 8},
                             {Activation::relu, 0.5, 129, 8, 1}, {Activation::gelu, 0, 300, 16, 4}};
  for (const FlashCase& fc : cases) {
    SCOPED_TRACE(case_name(fc));
    check_flash_layer(fc, 1024, 0);
    check_flash_layer(fc, 1040, 0);
  }
}

// The down tiles' L2 prefetch (DMOE_FLASH_PREFETCH=1, a hint) with the spread combine and the split gate, as the
// decode path would run them: the same cases against the CPU reference and EP.
TEST(FlashLayerPrefetchDown, MatchesCpuReferenceAndEpEngine) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  ScopedEnv prefetch("DMOE_FLASH_PREFETCH", "1");
  ScopedEnv combine("DMOE_FLASH_COMBINE", "slice");
  ScopedGateMode mode("auto");
  const FlashCase cases[] = {{Activation::swiglu, 0, 1, 8, 2}, {Activation::relu, 0.5, 129, 8, 1},
                             {Activation::gelu, 0, 300, 16, 4}};
  for (const FlashCase& fc : cases) {
    SCOPED_TRACE(case_name(fc));
    check_flash_layer(fc, 1024, 2);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashLayer,
                         ::testing::Values(FlashCase{Activation::swiglu, 0, 300, 8, 2},
                                           FlashCase{Activation::relu, 0, 300, 8, 2},
                                           FlashCase{Activation::gelu, 0, 300, 8, 2},
                                           FlashCase{Activation::swiglu, 1.0, 300, 8, 2},
                                           FlashCase{Activation::relu, 0.5, 129, 8, 1},
                                           FlashCase{Activation::swiglu, 0, 1, 8, 2},
                                           FlashCase{Activation::swiglu, 0, 64, 8, 8},
                                           FlashCase{Activation::gelu, 0, 512, 16, 4}),
                         [](const auto& info) { return case_name(info.param); });

// The consumers' skip path with warps 1-3 of every skipping consumer 20 µs late at each slot (the test aid): tasks
// of more k-blocks (H = I = 1024: 16) than the 4 slots, experts of 64 rows or fewer (T 64, k 8: the second consumer
// skips every task) and of mixed sizes. The one-arrival skip loop without the warpgroup barrier lets thread 0 run two
// fills ahead of its warps and hangs the next task (the own GEMM's wait report, docs/faults.md); with it the
// results are the CPU reference's, as without the lag.
TEST(FlashLayerLaggedSkip, LateWarpsInTheSkipPathChangeNothing) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  const ProcessEnv env = detect_process_env();
  if (env.world > 1) GTEST_SKIP() << "one process";
  for (const FlashCase& fc : {FlashCase{Activation::swiglu, 0, 64, 8, 8}, FlashCase{Activation::relu, 0, 300, 8, 2}}) {
    MoeConfig c = flash_case_config(fc, 1);
    c.hidden = 1024;
    c.ffn = 1024;
    const MoeWeights w = random_moe_weights(c, 31);
    const auto x = inputs_without_near_ties(c, w, 300, 1e-4f);
    ASSERT_FALSE(x.empty()) << c.summary();
    const LayerResult ref = run_cpu_layer(c, w, x, nullptr);
    auto comm = make_local_comm();
    FlashEngine engine(c, *comm);
    engine.set_weights(w);
    DeviceRows xd(x.size()), yd(x.size());
    xd.upload(x.data());
    engine.forward(xd.ptr, yd.ptr, nullptr);
    engine.check(nullptr);
    const auto y = yd.download();
    engine.set_skip_lag_for_tests(20000);
    for (int rep = 0; rep < 3; ++rep) {
      engine.forward(xd.ptr, yd.ptr, nullptr);
      engine.check(nullptr);
      EXPECT_TRUE(yd.download() == y) << c.summary() << ": lagged forward " << rep << " differs";
    }
    EXPECT_EQ(engine.expert_ids(nullptr), ref.expert_ids) << c.summary();
    EXPECT_CLOSE(y.data(), ref.y.data(), y.size(), kTolBf16, c.summary() << " y vs CPU");
  }
}

// Skew: every token picks expert 0 first and expert 1 second (x > 0, the gate's only non-zero row is 0's, the
// other logits tie at exactly 0 and go to the lower index), so experts 2.. and, at W > 2, whole ranks get
// nothing; one expert gets every token.
TEST(FlashLayerSkew, AllTokensToOneExpert) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  const ProcessEnv env = detect_process_env();
  if (env.world > 1) GTEST_SKIP() << "one process";
  MoeConfig c = flash_case_config(FlashCase{Activation::swiglu, 0, 700, 8, 2}, 1);
  MoeWeights w = random_moe_weights(c, 5);
  std::fill(w.gate.begin(), w.gate.end(), 0.f);
  for (int64_t h = 0; h < c.hidden; ++h) w.gate[h] = 0.0625f;
  Rng rng(8);
  auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
  for (auto& v : x) v = round_to_bf16(std::abs(v) + 0.01f);
  const LayerResult ref = run_cpu_layer(c, w, x, nullptr);
  auto comm = make_local_comm();
  FlashEngine engine(c, *comm);
  engine.set_weights(w);
  DeviceRows xd(x.size()), yd(x.size());
  xd.upload(x.data());
  engine.forward(xd.ptr, yd.ptr, nullptr);
  engine.check(nullptr);
  EXPECT_EQ(engine.expert_ids(nullptr), ref.expert_ids);
  const auto rows = engine.expert_rows(nullptr);
  EXPECT_EQ(rows[0], c.tokens);
  EXPECT_EQ(rows[1], c.tokens);
  for (int32_t e = 2; e < c.experts; ++e) EXPECT_EQ(rows[e], 0);
  const auto y = yd.download();
  EXPECT_CLOSE(y.data(), ref.y.data(), y.size(), kTolBf16, "skewed y");
}

// Back to back with no host synchronisation: 1000 forwards over 8 different inputs, each into its own output;
// then every output equals the one its input gave first (bit for bit: the kernel is deterministic), and
// those match the CPU reference. Then a CUDA graph of one forward, replayed with new inputs.
TEST(FlashLayerLaunches, ThousandBackToBackAndGraphReplay) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  const ProcessEnv env = detect_process_env();
  if (env.world > 1) GTEST_SKIP() << "one process";
  const MoeConfig c = flash_case_config(FlashCase{Activation::swiglu, 0, 128, 8, 2}, 1);
  const MoeWeights w = random_moe_weights(c, 9);
  const int64_t n = c.tokens * c.hidden;
  std::vector<std::vector<float>> xs;
  for (int i = 0; i < 8; ++i) xs.push_back(inputs_without_near_ties(c, w, 500 + 60 * i, 1e-4f));
  auto comm = make_local_comm();
  FlashEngine engine(c, *comm);
  engine.set_weights(w);
  cudaStream_t stream;
  DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<std::unique_ptr<DeviceRows>> xd;
  for (auto& x : xs) {
    xd.push_back(std::make_unique<DeviceRows>(size_t(n)));
    xd.back()->upload(x.data());
  }
  constexpr int kLaunches = 1000;
  DeviceRows ys{size_t(n) * kLaunches};
  for (int i = 0; i < kLaunches; ++i)
    engine.forward(xd[i % 8]->ptr, static_cast<__nv_bfloat16*>(ys.ptr) + size_t(i) * n, stream);
  engine.check(stream);
  const auto all = ys.download();
  for (int i = 0; i < 8; ++i) {
    const LayerResult ref = run_cpu_layer(c, w, xs[i], nullptr);
    EXPECT_CLOSE(all.data() + size_t(i) * n, ref.y.data(), size_t(n), kTolBf16, "input " << i);
  }
  for (int i = 8; i < kLaunches; ++i)
    ASSERT_EQ(std::memcmp(all.data() + size_t(i) * n, all.data() + size_t(i % 8) * n, size_t(n) * sizeof(float)), 0)
        << "launch " << i << " differs from launch " << i % 8;

  // Graph: capture one forward reading `in` and writing `out`, replay with new contents of `in`.
  DeviceRows in{size_t(n)}, out{size_t(n)};
  in.upload(xs[0].data());
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  DMOE_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  engine.forward(in.ptr, out.ptr, stream);
  DMOE_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  DMOE_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 10; ++r) {
    const int i = (r * 3) % 8;
    DMOE_CHECK_CUDA(cudaMemcpyAsync(in.ptr, xd[i]->ptr, size_t(n) * 2, cudaMemcpyDeviceToDevice, stream));
    DMOE_CHECK_CUDA(cudaGraphLaunch(exec, stream));
    cuda::wait_stream(stream, "graph replay");
    const auto y = out.download();
    ASSERT_EQ(std::memcmp(y.data(), all.data() + size_t(i) * n, size_t(n) * sizeof(float)), 0) << "replay " << r;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(FlashEngineConfig, RefusesWhatItCannotRun) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  const ProcessEnv env = detect_process_env();
  if (env.world > 1) GTEST_SKIP() << "one process";
  auto comm = make_local_comm();
  MoeConfig c = flash_case_config(FlashCase{Activation::swiglu, 0, 64, 8, 2}, 1);
  c.dtype = DType::f32;
  EXPECT_THROW(FlashEngine(c, *comm), Error);
  c.dtype = DType::bf16;
  c.hidden = 200;  // not a multiple of 16
  EXPECT_THROW(FlashEngine(c, *comm), Error);
  c.hidden = 256;
  c.capacity_factor = 1.0;
  c.drop_policy = DropPolicy::lowest_weight;
  EXPECT_THROW(FlashEngine(c, *comm), Error);
}

}  // namespace
}  // namespace dmoe
