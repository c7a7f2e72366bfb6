// run_gpu.cpp — one MoE layer forward (and backward) on the GPU through the same EpEngine as the CPU
// reference (CudaBackend + LocalComm). Compiled to an error message in builds without CUDA.
#include "run_gpu.hpp"

#include "bench_gpu.hpp"
#include "core/error.hpp"

#if DMOE_WITH_CUDA
#include "comm/cuda/local_comm.hpp"
#include "cuda/cuda_backend.hpp"
#endif

namespace dmoe::cli {

LayerResult run_gpu_layer(const MoeConfig& c, const MoeWeights& w, const std::vector<float>& x,
                          const std::vector<float>* dy) {
#if DMOE_WITH_CUDA
  DMOE_REQUIRE_INPUT(gpu_available(), "--engine cuda: no CUDA device is visible to this process; use --engine cpu");
  DMOE_REQUIRE_INPUT(c.world == 1,
                     "--engine cuda runs one rank per process: world = {} here; use --engine cpu for simulated ranks",
                     c.world);
  c.validate();
  const int64_t T = c.tokens, H = c.hidden;
  auto backend = make_cuda_backend(c.dtype, 0);
  auto comm = make_local_comm();
  EpEngine engine(c, *backend, *comm);
  engine.set_weights(w);
  const size_t elem = dtype_size(backend->storage_dtype());
  Buffer xd(*backend), yd(*backend), dyd(*backend), dxd(*backend);
  backend->upload_f32(xd.ensure(T * H * elem), x.data(), T * H);
  engine.forward(xd.data(), yd.ensure(T * H * elem));  // train: the losses are reported

  LayerResult r;
  r.y.resize(T * H);
  backend->download_f32(r.y.data(), yd.data(), T * H);
  r.expert_ids = engine.expert_ids();
  r.expert_weights = engine.expert_weights();
  r.losses = engine.losses();
  r.routed = engine.routed_counts();
  r.kept = engine.kept_counts();
  r.rows_received = engine.rows_received();
  r.rows_sent = engine.rows_sent();
  if (dy) {
    backend->upload_f32(dyd.ensure(T * H * elem), dy->data(), T * H);
    engine.backward(dyd.data(), dxd.ensure(T * H * elem));
    r.dx.resize(T * H);
    backend->download_f32(r.dx.data(), dxd.data(), T * H);
    r.grads = engine.grads();
  }
  return r;
#else
  (void)c, (void)w, (void)x, (void)dy;
  DMOE_FAIL_INPUT("--engine cuda: this dmoe was built without CUDA (configure with -DDMOE_CUDA=ON); use --engine cpu");
#endif
}

}  // namespace dmoe::cli
