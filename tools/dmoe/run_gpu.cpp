// run_gpu.cpp — one MoE layer forward (and backward) on the GPU through the MoeEngine interface (CudaBackend +
// LocalComm; EpEngine for ep, FlashEngine for flash). Compiled to an error message in builds without CUDA.
#include "run_gpu.hpp"

#include "bench_gpu.hpp"
#include "core/dispatch_plan.hpp"
#include "core/error.hpp"

#if DMOE_WITH_CUDA
#include "comm/cuda/local_comm.hpp"
#include "cuda/cuda_backend.hpp"
#endif

namespace dmoe::cli {

GpuLayerResult run_gpu_layer(EngineKind kind, const MoeConfig& c, const MoeWeights& w, const std::vector<float>& x,
                             const std::vector<float>* dy) {
  const char* name = engine_kind_name(kind);
#if DMOE_WITH_CUDA
  DMOE_REQUIRE_INPUT(gpu_available(), "--engine {}: no CUDA device is visible to this process; use --engine cpu",
                     name);
  DMOE_REQUIRE_INPUT(c.world == 1,
                     "--engine {} runs one rank per process: world = {} here; use --engine cpu for simulated ranks",
                     name, c.world);
  c.validate();
  MoeEngineOptions options;
  options.backward = dy != nullptr;
  // Everything the engine can be refused for, before a backend (a CUDA context) is made.
  const std::string why = moe_engine_unusable_reason(kind, c, options);
  DMOE_REQUIRE_INPUT(why.empty(), "--engine {}: {}", name, why);
  const int64_t T = c.tokens, H = c.hidden;
  auto backend = make_cuda_backend(c.dtype, 0);
  auto comm = make_local_comm();
  const auto engine = make_moe_engine(kind, c, *backend, *comm, options);
  engine->set_weights(w);
  const size_t elem = dtype_size(backend->storage_dtype());
  Buffer xd(*backend), yd(*backend), dyd(*backend), dxd(*backend);
  backend->upload_f32(xd.ensure(T * H * elem), x.data(), T * H);
  // train where the engine has it: the losses are reported (and kept for the backward); Flash made for forwards
  // only (no --grad-output) runs the inference forward.
  const bool train = engine->supports_backward();
  engine->forward(xd.data(), yd.ensure(T * H * elem), train ? ForwardMode::train : ForwardMode::inference);
  engine->finish();

  GpuLayerResult out;
  LayerResult& r = out.layer;
  r.y.resize(T * H);
  backend->download_f32(r.y.data(), yd.data(), T * H);
  r.expert_ids = engine->expert_ids();
  r.expert_weights = engine->expert_weights();
  if (train) r.losses = engine->losses();
  out.losses_computed = train;
  // The counts from the routing: build_send_plan is their definition (EP's plan equals it bit for bit).
  const SendPlan plan = build_send_plan(r.expert_ids.data(), r.expert_weights.data(), T, c.top_k, c.experts,
                                        c.capacity(), c.drop_policy);
  r.routed = plan.routed;
  r.kept = plan.counts;
  r.expert_rows = engine->expert_rows();
  for (const int64_t n : r.expert_rows) r.rows_received += n;
  if (dy) {
    backend->upload_f32(dyd.ensure(T * H * elem), dy->data(), T * H);
    engine->backward(dyd.data(), dxd.ensure(T * H * elem));
    r.dx.resize(T * H);
    backend->download_f32(r.dx.data(), dxd.data(), T * H);
    r.grads = engine->grads();
  }
  return out;
#else
  (void)c, (void)w, (void)x, (void)dy;
  DMOE_FAIL_INPUT("--engine {}: this dmoe was built without CUDA (configure with -DDMOE_CUDA=ON); use --engine cpu",
                  name);
#endif
}

}  // namespace dmoe::cli
