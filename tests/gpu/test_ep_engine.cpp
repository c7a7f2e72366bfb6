// The vanilla EP engine on CUDA against the CPU reference engine (same EpEngine code, CPU kernels and
// ThreadComm). One process: W = 1 with the local communicator. Launched as W processes (dmoe launch or
// mpirun): each rank runs its share on its GPU through NCCL or NVSHMEM and compares its tokens' outputs
// and its experts' gradients with the CPU run of all ranks.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "cuda/check.hpp"
#include "cpu/kernels.hpp"
#include "cuda/cuda_backend.hpp"
#include "engine/reference.hpp"
#include "gpu_test_util.hpp"
#include "layer_test_util.hpp"

namespace dmoe {
namespace {

bool have_gpu() { return test::has_cuda_device(); }

struct EngineCase {
  Activation act;
  DType dtype;
  double capacity_factor;
};

// Runs this process's rank of the layer on the GPU and compares with the CPU reference of all ranks.
void compare_with_cpu(MoeConfig c, Comm& comm, int device) {
  c.world = comm.world();
  const int32_t rank = comm.rank(), Le = c.experts_per_rank();
  const int64_t T = c.tokens, H = c.hidden, k = c.top_k;
  MoeConfig all = c;
  const MoeWeights w = random_moe_weights(all, 17);
  const auto x = inputs_without_near_ties(c, w, 100);
  ASSERT_FALSE(x.empty());
  Rng rng(5);
  const auto dy = rng.normal_vector(x.size(), 1.0);
  const LayerResult ref = run_cpu_layer(c, w, x, &dy);

  auto backend = make_cuda_backend(c.dtype, device);
  EpEngine engine(c, *backend, comm);
  engine.set_weights(slice_experts(w, c.first_expert(rank), Le));
  const size_t elem = dtype_size(backend->storage_dtype());
  void* xd = backend->allocate(T * H * elem);
  void* yd = backend->allocate(T * H * elem);
  void* dyd = backend->allocate(T * H * elem);
  void* dxd = backend->allocate(T * H * elem);
  backend->upload_f32(xd, x.data() + rank * T * H, T * H);
  backend->upload_f32(dyd, dy.data() + rank * T * H, T * H);
  // An inference forward (nothing kept for backward) gives the same outputs, bit for bit; backward then
  // refuses until a train forward has run.
  std::vector<float> y_inference(T * H);
  engine.forward(xd, yd, ForwardMode::inference);
  backend->download_f32(y_inference.data(), yd, T * H);
  EXPECT_THROW(engine.backward(dyd, dxd), Error);
  engine.forward(xd, yd);
  engine.backward(dyd, dxd);
  std::vector<float> y(T * H), dx(T * H);
  backend->download_f32(y.data(), yd, T * H);
  backend->download_f32(dx.data(), dxd, T * H);
  const MoeWeights g = engine.grads();
  // Determinism (docs/architecture.md): a second engine on the same inputs gives the same bits — no
  // floating-point atomics whose order varies, on any rank.
  {
    EpEngine again(c, *backend, comm);
    again.set_weights(slice_experts(w, c.first_expert(rank), Le));
    again.forward(xd, yd);
    again.backward(dyd, dxd);
    std::vector<float> y2(T * H), dx2(T * H);
    backend->download_f32(y2.data(), yd, T * H);
    backend->download_f32(dx2.data(), dxd, T * H);
    const MoeWeights g2 = again.grads();
    EXPECT_TRUE(y2 == y) << "rank " << rank << ": y differs between two runs";
    EXPECT_TRUE(dx2 == dx) << "rank " << rank << ": dx differs between two runs";
    EXPECT_TRUE(g2.gate == g.gate && g2.w1 == g.w1 && g2.w2 == g.w2 && g2.w3 == g.w3)
        << "rank " << rank << ": the gradients differ between two runs";
  }
  for (void* p : {xd, yd, dyd, dxd}) backend->release(p);

  EXPECT_TRUE(y_inference == y) << "inference forward differs from the train forward";
  // Routing and the plan: exact.
  const auto ids = engine.expert_ids();
  ASSERT_EQ(ids, std::vector<int32_t>(ref.expert_ids.begin() + rank * T * k, ref.expert_ids.begin() + (rank + 1) * T * k));
  // Tolerances: f32 — fp32 accumulation (TF32 off) against fp64, sums of ≤ a few hundred terms: 1e-5.
  // bf16 — both sides round stored activations to bf16, but accumulate differently, so a value can
  // round to the neighbouring bf16 (relative step 2^-8 = 4e-3): 2e-2 on norms.
  const double tol = c.dtype == DType::f32 ? 1e-5 : 2e-2;
  const std::string tag = fmt::format("rank {} {} {} cf={}", rank, activation_name(c.activation), dtype_name(c.dtype),
                                      c.capacity_factor);
  EXPECT_CLOSE(y.data(), ref.y.data() + rank * T * H, size_t(T * H), tol, tag << " y");
  EXPECT_CLOSE(dx.data(), ref.dx.data() + rank * T * H, size_t(T * H), tol, tag << " dx");
  const size_t m = size_t(c.ffn * H), off = size_t(c.first_expert(rank)) * m;
  EXPECT_CLOSE(g.w1.data(), ref.grads.w1.data() + off, Le * m, tol, tag << " dW1");
  EXPECT_CLOSE(g.w2.data(), ref.grads.w2.data() + off, Le * m, tol, tag << " dW2");
  if (c.activation == Activation::swiglu) EXPECT_CLOSE(g.w3.data(), ref.grads.w3.data() + off, Le * m, tol, tag << " dW3");
  EXPECT_CLOSE(g.gate.data(), ref.grads.gate.data(), size_t(c.experts * H), tol, tag << " dWg");
  EXPECT_NEAR(engine.losses().load_balance, ref.losses.load_balance, 1e-4);
}

MoeConfig case_config(const EngineCase& ec) {
  MoeConfig c;
  c.tokens = 48;
  c.hidden = 64;
  c.ffn = 96;
  c.experts = 8;
  c.top_k = 2;
  c.activation = ec.act;
  c.dtype = ec.dtype;
  c.capacity_factor = ec.capacity_factor;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

class GpuEngine : public ::testing::TestWithParam<EngineCase> {};

TEST_P(GpuEngine, MatchesCpuReference) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const ProcessEnv env = detect_process_env();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const int device = choose_device(env, devices);
  if (env.world == 1) {
    auto comm = make_local_comm();
    compare_with_cpu(case_config(GetParam()), *comm, device);
  } else {
    DMOE_CHECK_CUDA(cudaSetDevice(device));
    cudaStream_t stream;
    DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    const CommKind kind = parse_comm_kind(std::getenv("DMOE_COMM") ? std::getenv("DMOE_COMM") : "auto");
    auto comm = make_gpu_comm(env, kind, size_t(48) * 2 * 64 * 4, stream);
    compare_with_cpu(case_config(GetParam()), *comm, device);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuEngine,
    ::testing::Values(EngineCase{Activation::swiglu, DType::f32, 0}, EngineCase{Activation::relu, DType::f32, 0},
                      EngineCase{Activation::gelu, DType::f32, 0}, EngineCase{Activation::swiglu, DType::bf16, 0},
                      EngineCase{Activation::relu, DType::bf16, 0}, EngineCase{Activation::swiglu, DType::f32, 0.75},
                      EngineCase{Activation::gelu, DType::bf16, 1.0}),
    [](const auto& info) {
      return std::string(activation_name(info.param.act)) + "_" + dtype_name(info.param.dtype) +
             (info.param.capacity_factor > 0 ? "_capacity" : "_dropless");
    });

// Determinism at a size where the own Hopper GEMM, the grouped weight-gradient kernel and the multi-block
// reductions all run (the small cases above may take other paths): the training step twice, bit for bit.
TEST(GpuEngineDeterminism, TrainingStepRepeatsBitForBit) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const ProcessEnv env = detect_process_env();
  if (env.world > 1) GTEST_SKIP() << "one process";
  MoeConfig c;
  c.tokens = 2048;
  c.hidden = 1024;
  c.ffn = 1536;
  c.experts = 16;
  c.top_k = 4;
  c.activation = Activation::swiglu;
  c.dtype = DType::bf16;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  const MoeWeights w = random_moe_weights(c, 31);
  Rng rng(7);
  const auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
  const auto dy = rng.normal_vector(x.size(), 1.0);
  auto backend = make_cuda_backend(c.dtype, 0);
  auto comm = make_local_comm();
  const int64_t n = c.tokens * c.hidden;
  void* xd = backend->allocate(n * 2);
  void* yd = backend->allocate(n * 2);
  void* dyd = backend->allocate(n * 2);
  void* dxd = backend->allocate(n * 2);
  backend->upload_f32(xd, x.data(), n);
  backend->upload_f32(dyd, dy.data(), n);
  std::vector<float> y[2], dx[2];
  MoeWeights g[2];
  for (int run = 0; run < 2; ++run) {
    EpEngine engine(c, *backend, *comm);
    engine.set_weights(w);
    for (int step = 0; step < 2; ++step) {  // the second step writes the gradients over the first's
      engine.zero_grads();
      engine.forward(xd, yd);
      engine.backward(dyd, dxd);
    }
    y[run].resize(n);
    dx[run].resize(n);
    backend->download_f32(y[run].data(), yd, n);
    backend->download_f32(dx[run].data(), dxd, n);
    g[run] = engine.grads();
  }
  for (void* p : {xd, yd, dyd, dxd}) backend->release(p);
  EXPECT_TRUE(y[0] == y[1]) << "y differs between two runs";
  EXPECT_TRUE(dx[0] == dx[1]) << "dx differs between two runs";
  EXPECT_TRUE(g[0].gate == g[1].gate) << "dWg differs between two runs";
  EXPECT_TRUE(g[0].w1 == g[1].w1 && g[0].w3 == g[1].w3 && g[0].w2 == g[1].w2) << "the experts' gradients differ";
}

// The deferral and capture tests' layer: W = 1, bf16 SwiGLU small enough for the own Hopper GEMM without counts.
MoeConfig own_gemm_layer_config() {
  MoeConfig c;
  c.tokens = 1000;
  c.hidden = 512;
  c.ffn = 768;
  c.experts = 8;
  c.top_k = 2;
  c.activation = Activation::swiglu;
  c.dtype = DType::bf16;
  return c;
}

// Deferred routing reads on the GPU (EpOptions::defer_routing_reads; the own Hopper GEMM reads the expert offsets
// on the device): the train forward issues no host read, and the step's every result equals the step that reads
// the counts at once, bit for bit (same kernels: only the host's read of the counts moves). A token with NaN
// router logits passes the forward (it cannot be seen without a read) and is reported by what reads the counts
// first — the backward here — with the message the immediate read gives; the engine stays usable.
TEST(GpuEngineDeferredRouting, EqualsReadingAtOnceAndReportsNaNAtTheBackward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (detect_process_env().world > 1) GTEST_SKIP() << "one process";
  MoeConfig c = own_gemm_layer_config();
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  const MoeWeights w = random_moe_weights(c, 37);
  Rng rng(11);
  auto x = rng.normal_vector(size_t(c.tokens * c.hidden), 1.0);
  const auto dy = rng.normal_vector(x.size(), 1.0);
  auto backend = make_cuda_backend(c.dtype, 0);
  auto comm = make_local_comm();
  const int64_t n = c.tokens * c.hidden;
  void* xd = backend->allocate(n * 2);
  void* yd = backend->allocate(n * 2);
  void* dyd = backend->allocate(n * 2);
  void* dxd = backend->allocate(n * 2);
  backend->upload_f32(xd, x.data(), n);
  backend->upload_f32(dyd, dy.data(), n);
  std::vector<float> y[2], dx[2];
  MoeWeights g[2];
  RouterLosses l[2];
  std::vector<int64_t> kept[2];
  bool deferred = false;
  for (int defer = 0; defer < 2; ++defer) {
    EpOptions options;
    options.defer_routing_reads = defer == 1;
    EpEngine engine(c, *backend, *comm, options);
    engine.set_weights(w);
    engine.forward(xd, yd);
    if (defer) deferred = engine.routing_pending();
    engine.backward(dyd, dxd);
    l[defer] = engine.losses();
    kept[defer] = engine.kept_counts();
    y[defer].resize(n);
    dx[defer].resize(n);
    backend->download_f32(y[defer].data(), yd, n);
    backend->download_f32(dx[defer].data(), dxd, n);
    g[defer] = engine.grads();
  }
  if (!deferred) {
    for (void* p : {xd, yd, dyd, dxd}) backend->release(p);
    GTEST_SKIP() << "this GPU or build cannot run the own Hopper GEMM: the forward reads its counts at once";
  }
  EXPECT_TRUE(y[0] == y[1]) << "y differs";
  EXPECT_TRUE(dx[0] == dx[1]) << "dx differs";
  EXPECT_TRUE(g[0].gate == g[1].gate && g[0].w1 == g[1].w1 && g[0].w3 == g[1].w3 && g[0].w2 == g[1].w2)
      << "the gradients differ";
  EXPECT_EQ(l[0].load_balance, l[1].load_balance);
  EXPECT_EQ(l[0].z_loss, l[1].z_loss);
  EXPECT_EQ(kept[0], kept[1]);

  // NaN in token 17's input: its router logits are NaN.
  EpEngine engine(c, *backend, *comm);
  engine.set_weights(w);
  std::vector<float> bad = x;
  bad[17 * c.hidden + 3] = std::nanf("");
  backend->upload_f32(xd, bad.data(), n);
  engine.forward(xd, yd);
  ASSERT_TRUE(engine.routing_pending());
  try {
    engine.backward(dyd, dxd);
    ADD_FAILURE() << "the backward of a forward with NaN router logits ran";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("token 17 choice "), std::string::npos) << m;  // its NaN logits leave 0 or 1 valid choice
    EXPECT_NE(m.find("NaN"), std::string::npos) << m;
  }
  EXPECT_THROW((void)engine.losses(), Error) << "nothing was kept of that forward";
  backend->upload_f32(xd, x.data(), n);
  engine.forward(xd, yd);
  engine.backward(dyd, dxd);
  std::vector<float> again(n);
  backend->download_f32(again.data(), yd, n);
  EXPECT_TRUE(again == y[1]) << "the engine after the error gives the first results again";
  for (void* p : {xd, yd, dyd, dxd}) backend->release(p);
}

// An inference forward at W = 1 (bf16, dropless, the own Hopper GEMM) defers its routing reads inside a CUDA-graph
// capture (global mode, as PyTorch's), so it waits for nothing there: replays on new inputs equal eager forwards
// (which read their counts at once, on the same kernels) bit for bit; the
// counts of a captured forward are refused on the host with a clear error; a train forward, and a forward that
// reads its counts at once, are refused inside a capture before anything is queued; a NaN token of a deferred
// inference forward is reported when its counts are read.
TEST(GpuEngineGraphCapture, InferenceForwardReplaysEqualEagerAndTheRestIsRefused) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  if (detect_process_env().world > 1) GTEST_SKIP() << "one process";
  const MoeConfig c = own_gemm_layer_config();
  const MoeWeights w = random_moe_weights(c, 71);
  const int64_t n = c.tokens * c.hidden;
  Rng rng(73);
  const auto x0 = rng.normal_vector(size_t(n), 1.0);
  const auto x1 = rng.normal_vector(size_t(n), 1.0);
  auto backend = make_cuda_backend(c.dtype, 0);
  cudaStream_t stream;
  DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  set_cuda_backend_stream(*backend, stream);
  auto comm = make_local_comm();
  void* xa = backend->allocate(n * 2);
  void* xb = backend->allocate(n * 2);
  void* in = backend->allocate(n * 2);
  void* out = backend->allocate(n * 2);
  backend->upload_f32(xa, x0.data(), n);
  backend->upload_f32(xb, x1.data(), n);
  const auto download = [&](void* p) {
    std::vector<float> v(static_cast<size_t>(n));
    backend->download_f32(v.data(), p, n);
    return v;
  };
  const auto refusal = [&](EpEngine& e, ForwardMode mode) {
    std::string message;
    DMOE_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    try {
      e.forward(in, out, mode);
    } catch (const Error& err) {
      message = err.what();
    }
    cudaGraph_t g = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess) << "the refusal must leave the capture valid";
    if (g) cudaGraphDestroy(g);
    return message;
  };
  {
    EpEngine engine(c, *backend, *comm);
    engine.set_weights(w);
    engine.forward(xb, out, ForwardMode::inference);  // eager: reads its counts at once (defer_inference_reads off)
    const std::vector<float> y1 = download(out);
    const std::vector<int64_t> kept1 = engine.kept_counts();
    // Whether a capture can defer here (the own Hopper GEMM; it reads only shapes and pointers' alignment).
    if (!backend->expert_ffn_forward_takes_device_offsets(xb, xb, xb, xb, nullptr, nullptr, out, out,
                                                          c.tokens * c.top_k, c.experts, c.hidden, c.ffn,
                                                          c.activation)) {
      for (void* p : {xa, xb, in, out}) backend->release(p);
      use_own_cuda_backend_stream(*backend);
      cudaStreamDestroy(stream);
      GTEST_SKIP() << "this GPU or build cannot run the own Hopper GEMM: the forward reads its counts at once";
    }
    engine.forward(xa, out, ForwardMode::inference);
    const std::vector<float> y0 = download(out);
    ASSERT_FALSE(y0 == y1);

    // Warm-up on `in` (the buffers exist at this size), then the capture.
    backend->copy(in, xa, size_t(n) * 2);
    engine.forward(in, out, ForwardMode::inference);
    // Ends a capture that a failure left open, so that the tests after this one find the device usable.
    struct CaptureGuard {
      cudaStream_t s;
      bool open = true;
      ~CaptureGuard() {
        if (!open) return;
        cudaGraph_t g = nullptr;
        (void)cudaStreamEndCapture(s, &g);
        if (g) cudaGraphDestroy(g);
        (void)cudaGetLastError();
      }
    };
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    {
      DMOE_CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      CaptureGuard guard{stream};
      engine.forward(in, out, ForwardMode::inference);
      guard.open = false;
      DMOE_CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
    }
    DMOE_CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    EXPECT_TRUE(engine.captured());
    try {
      (void)engine.kept_counts();
      ADD_FAILURE() << "the counts of a captured forward were given on the host";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("captured in a CUDA graph"), std::string::npos) << e.what();
    }
    for (int r = 0; r < 6; ++r) {
      DMOE_CHECK_CUDA(cudaMemcpyAsync(in, r % 2 ? xb : xa, size_t(n) * 2, cudaMemcpyDeviceToDevice, stream));
      DMOE_CHECK_CUDA(cudaGraphLaunch(exec, stream));
      EXPECT_TRUE(download(out) == (r % 2 ? y1 : y0)) << "replay " << r << " differs from the eager forward";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);

    const std::string train = refusal(engine, ForwardMode::train);
    EXPECT_NE(train.find("a train forward cannot be captured"), std::string::npos) << train;
    // Eager again: the engine reads its counts as before.
    engine.forward(xb, out, ForwardMode::inference);
    EXPECT_FALSE(engine.captured());
    EXPECT_EQ(engine.kept_counts(), kept1);
    EXPECT_TRUE(download(out) == y1);
  }
  {
    // NaN in token 5's input, in a deferred inference forward (as in a capture; here defer_inference_reads):
    // reported when the counts are read (here by the accessor), naming the forward.
    EpOptions deferred;
    deferred.defer_inference_reads = true;
    EpEngine engine(c, *backend, *comm, deferred);
    engine.set_weights(w);
    std::vector<float> bad = x0;
    bad[5 * c.hidden + 2] = std::nanf("");
    backend->upload_f32(in, bad.data(), n);
    engine.forward(in, out, ForwardMode::inference);
    EXPECT_TRUE(engine.routing_pending());
    try {
      (void)engine.kept_counts();
      ADD_FAILURE() << "a NaN token's routing was not reported";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("token 5 choice "), std::string::npos) << m;
      EXPECT_NE(m.find("last inference forward"), std::string::npos) << m;
    }
  }
  {
    EpOptions at_once;
    at_once.defer_routing_reads = false;
    EpEngine engine(c, *backend, *comm, at_once);
    engine.set_weights(w);
    backend->copy(in, xa, size_t(n) * 2);
    engine.forward(in, out, ForwardMode::inference);
    const std::string m = refusal(engine, ForwardMode::inference);
    EXPECT_NE(m.find("cannot be captured in a CUDA graph: it reads the routing counts on the host"), std::string::npos)
        << m;
  }
  for (void* p : {xa, xb, in, out}) backend->release(p);
  use_own_cuda_backend_stream(*backend);
  cudaStreamDestroy(stream);
}

TEST(GpuEngineErrors, OutOfMemorySaysWhatHowMuchAndWhatIsFree) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto backend = make_cuda_backend(DType::bf16, 0);
  try {
    backend->allocate(size_t(1) << 50);  // 1 PiB
    FAIL() << "a 1 PiB allocation succeeded";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of GPU memory"), std::string::npos) << m;
    EXPECT_NE(m.find("1125899906842624 bytes"), std::string::npos) << m;
    EXPECT_NE(m.find("GiB free of"), std::string::npos) << m;
  }
  // The device is still usable afterwards (cudaMalloc's error is not left behind).
  void* p = backend->allocate(1 << 20);
  EXPECT_NE(p, nullptr);
  backend->release(p);
  backend->synchronize();
}

}  // namespace
}  // namespace dmoe
