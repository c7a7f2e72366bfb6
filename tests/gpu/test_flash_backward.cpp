// The Flash backward (FlashEngine::backward, cuda::flash_backward) against the CPU reference engine's backward
// and, at W = 1, the EP engine's on the GPU. One process: W = 1. Launched as W processes (dmoe launch / mpirun,
// NVSHMEM), each rank checks its tokens' dx, its experts' gradients and the gate's gradient summed over ranks.
//
// Tolerance: 2e-2 on norms, as the EP engine's bf16 GPU tests (tests/gpu/test_ep_engine.cpp): both sides round
// stored activations to bf16 and accumulate in different orders. Routing: exact (inputs without near ties).
// Determinism: a second train forward and backward on the same inputs gives the same bits.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "cuda/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "engine/ep_engine.hpp"
#include "engine/moe_engine.hpp"
#include "engine/reference.hpp"
#include "flash/flash_engine.hpp"
#include "flash/flash_kernel.hpp"
#include "flash_test_util.hpp"
#include "gpu_test_util.hpp"
#include "layer_test_util.hpp"

namespace dmoe {
namespace {

using test::kTolBf16;  // gpu_test_util.hpp

// The forward's case table row, with the auxiliary losses on (their gradients are part of the backward).
MoeConfig backward_config(const FlashCase& fc, int32_t world) {
  MoeConfig c = flash_case_config(fc, world);
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

struct Grads {
  std::vector<float> dx, gate, w1, w3, w2;
};

class FlashBackward : public ::testing::TestWithParam<FlashCase> {};

TEST_P(FlashBackward, MatchesCpuReferenceAndEpEngine) {
  if (!flash_runs_here()) GTEST_SKIP() << "no sm_90 GPU with this build's sm_90a kernels";
  const ProcessEnv env = detect_process_env();
  int devices = 0;
  cudaGetDeviceCount(&devices);
  const int device = choose_device(env, devices);
  DMOE_CHECK_CUDA(cudaSetDevice(device));
  auto backend = make_cuda_backend(DType::bf16, device);
  const auto stream = static_cast<cudaStream_t>(backend->stream());
  {
    auto comm = make_flash_test_comm(env, stream);
    const MoeConfig c = backward_config(GetParam(), comm->world());
    const int32_t rank = comm->rank(), Le = c.experts_per_rank();
    const int64_t T = c.tokens, H = c.hidden, I = c.ffn, E = c.experts, k = c.top_k;
    const bool swiglu = c.activation == Activation::swiglu;
    const MoeWeights w = random_moe_weights(c, 29);
    const auto x = inputs_without_near_ties(c, w, 500, 1e-4f);
    ASSERT_FALSE(x.empty());
    Rng rng(31);
    const auto dy = rng.normal_vector(x.size(), 1.0);
    const LayerResult ref = run_cpu_layer(c, w, x, &dy);

    FlashEngine engine(c, *comm, /*train=*/true);
    engine.set_weights(slice_experts(w, c.first_expert(rank), Le));
    void* xd = backend->allocate(T * H * 2);
    void* yd = backend->allocate(T * H * 2);
    void* dyd = backend->allocate(T * H * 2);
    void* dxd = backend->allocate(T * H * 2);
    backend->upload_f32(xd, x.data() + rank * T * H, T * H);
    backend->upload_f32(dyd, dy.data() + rank * T * H, T * H);
    FlashGradViews g;
    g.gate = backend->allocate(E * H * 4);
    g.w1 = backend->allocate(Le * I * H * 4);
    g.w2 = backend->allocate(Le * H * I * 4);
    g.w3 = swiglu ? backend->allocate(Le * I * H * 4) : nullptr;
    auto run = [&]() {
      backend->zero(g.gate, size_t(E * H) * 4);
      engine.forward(xd, yd, stream);
      engine.backward(dyd, dxd, g, /*accumulate=*/false, *backend, stream);
      engine.check(stream);
      Grads out;
      out.dx.resize(size_t(T * H));
      backend->download_f32(out.dx.data(), dxd, T * H);
      comm->allreduce_sum(g.gate, E * H, DType::f32, stream);  // the gate's parts, summed over ranks
      auto dl = [&](const void* p, std::vector<float>& v, int64_t n) {
        v.resize(size_t(n));
        backend->download(v.data(), p, size_t(n) * 4);
      };
      dl(g.gate, out.gate, E * H);
      dl(g.w1, out.w1, Le * I * H);
      dl(g.w2, out.w2, Le * H * I);
      if (swiglu) dl(g.w3, out.w3, Le * I * H);
      return out;
    };
    const Grads a = run();
    const std::string tag = "rank " + std::to_string(rank) + " " + c.summary();
    const auto ids = engine.expert_ids(stream);
    ASSERT_EQ(ids, std::vector<int32_t>(ref.expert_ids.begin() + rank * T * k, ref.expert_ids.begin() + (rank + 1) * T * k))
        << tag;
    EXPECT_CLOSE(a.dx.data(), ref.dx.data() + rank * T * H, size_t(T * H), kTolBf16, tag << " dx vs CPU");
    const size_t m = size_t(I * H), off = size_t(c.first_expert(rank)) * m;
    EXPECT_CLOSE(a.w1.data(), ref.grads.w1.data() + off, Le * m, kTolBf16, tag << " dW1 vs CPU");
    EXPECT_CLOSE(a.w2.data(), ref.grads.w2.data() + off, Le * m, kTolBf16, tag << " dW2 vs CPU");
    if (swiglu) EXPECT_CLOSE(a.w3.data(), ref.grads.w3.data() + off, Le * m, kTolBf16, tag << " dW3 vs CPU");
    EXPECT_CLOSE(a.gate.data(), ref.grads.gate.data(), size_t(E * H), kTolBf16, tag << " dWg vs CPU");

    // Deterministic: the same inputs again (the other parity's buffers) give the same bits.
    const Grads b = run();
    EXPECT_TRUE(b.dx == a.dx) << tag << ": dx differs between two runs";
    EXPECT_TRUE(b.gate == a.gate && b.w1 == a.w1 && b.w2 == a.w2 && b.w3 == a.w3)
        << tag << ": the gradients differ between two runs";
    // One backward per forward.
    EXPECT_THROW(engine.backward(dyd, dxd, g, false, *backend, stream), Error);

    if (comm->world() == 1) {  // the EP engine on the same GPU, through MoeEngine; Flash through it too
      auto local = make_local_comm();
      const auto ep = make_moe_engine(EngineKind::ep, c, *backend, *local);
      const auto flash = make_moe_engine(EngineKind::flash, c, *backend, *local);
      EXPECT_TRUE(flash->supports_backward());
      for (MoeEngine* e : {ep.get(), flash.get()}) {
        e->set_weights(w);
        e->zero_grads();
        for (int step = 0; step < 2; ++step) {  // two backwards: the second adds to the first
          e->forward(xd, yd, ForwardMode::train);
          e->backward(dyd, dxd);
        }
        e->finish();
      }
      const MoeWeights ge = ep->grads(), gf = flash->grads();
      EXPECT_CLOSE(gf.w1.data(), ge.w1.data(), ge.w1.size(), kTolBf16, tag << " dW1 (2 steps) vs EP");
      EXPECT_CLOSE(gf.w2.data(), ge.w2.data(), ge.w2.size(), kTolBf16, tag << " dW2 (2 steps) vs EP");
      if (swiglu) EXPECT_CLOSE(gf.w3.data(), ge.w3.data(), ge.w3.size(), kTolBf16, tag << " dW3 (2 steps) vs EP");
      EXPECT_CLOSE(gf.gate.data(), ge.gate.data(), ge.gate.size(), kTolBf16, tag << " dWg (2 steps) vs EP");
      // Same router probabilities bit for bit (the EP router's code) and the same counts: the losses agree.
      EXPECT_NEAR(flash->losses().load_balance, ep->losses().load_balance, 1e-6 * ep->losses().load_balance);
      EXPECT_NEAR(flash->losses().z_loss, ep->losses().z_loss, 1e-6 * ep->losses().z_loss);
      EXPECT_NEAR(flash->losses().load_balance, ref.losses.load_balance, 1e-4);
      // Backward after an inference forward: refused, naming what to do.
      flash->forward(xd, yd, ForwardMode::inference);
      EXPECT_THROW(flash->backward(dyd, dxd), Error);
    }
    for (void* p : {xd, yd, dyd, dxd, g.gate, g.w1, g.w2, g.w3})
      if (p) backend->release(p);
    comm->barrier(stream);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashBackward,
                         ::testing::Values(FlashCase{Activation::swiglu, 0, 300, 8, 2},
                                           FlashCase{Activation::relu, 0, 300, 8, 2},
                                           FlashCase{Activation::gelu, 0, 300, 8, 2},
                                           FlashCase{Activation::swiglu, 1.0, 300, 8, 2},
                                           FlashCase{Activation::relu, 0.5, 129, 8, 1},
                                           FlashCase{Activation::swiglu, 0, 1, 8, 2},
                                           FlashCase{Activation::gelu, 0, 512, 16, 4}),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace dmoe
