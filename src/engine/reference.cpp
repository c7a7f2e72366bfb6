#include "engine/reference.hpp"

#include <mutex>

#include "core/error.hpp"

namespace dmoe {

int64_t LayerResult::dropped() const {
  int64_t total = 0;
  for (size_t e = 0; e < routed.size(); ++e) total += routed[e] - kept[e];
  return total;
}

LayerResult run_cpu_layer(const MoeConfig& config, const MoeWeights& weights, const std::vector<float>& x,
                          const std::vector<float>* dy, const EpOptions& options) {
  config.validate();
  const int64_t T = config.tokens, H = config.hidden, W = config.world, k = config.top_k;
  const int32_t Le = config.experts_per_rank();
  DMOE_REQUIRE(int64_t(x.size()) == W * T * H, "cpu layer: x has {} elements; expected world*tokens*hidden = {}",
               x.size(), W * T * H);
  DMOE_REQUIRE(!dy || int64_t(dy->size()) == W * T * H,
               "cpu layer: dy has {} elements; expected world*tokens*hidden = {}", dy->size(), W * T * H);
  DMOE_REQUIRE(weights.first_expert == 0 && weights.num_experts == config.experts,
               "cpu layer: weights must hold all {} experts", config.experts);

  LayerResult result;
  result.y.resize(W * T * H);
  result.expert_ids.resize(W * T * k);
  result.expert_weights.resize(W * T * k);
  result.routed.assign(config.experts, 0);
  result.kept.assign(config.experts, 0);
  result.expert_rows.assign(config.experts, 0);
  if (dy) {
    result.dx.resize(W * T * H);
    result.grads = make_moe_weights(config, 0, config.experts);
  }
  std::mutex mutex;

  run_thread_ranks(config.world, [&](int32_t rank, Comm& comm) {
    auto backend = make_cpu_backend(config.dtype);
    EpEngine engine(config, *backend, comm, options);
    engine.set_weights(slice_experts(weights, config.first_expert(rank), Le));
    // Host memory is the CPU backend's memory, so rank slices are used in place (rounded to bf16 for
    // a bf16 config, as an upload would).
    std::vector<float> x_local(x.begin() + rank * T * H, x.begin() + (rank + 1) * T * H);
    backend->upload_f32(x_local.data(), x_local.data(), T * H);
    float* y = result.y.data() + rank * T * H;
    engine.forward(x_local.data(), y);
    auto ids = engine.expert_ids();
    auto ws = engine.expert_weights();
    std::copy(ids.begin(), ids.end(), result.expert_ids.begin() + rank * T * k);
    std::copy(ws.begin(), ws.end(), result.expert_weights.begin() + rank * T * k);
    if (dy) {
      std::vector<float> dy_local(dy->begin() + rank * T * H, dy->begin() + (rank + 1) * T * H);
      backend->upload_f32(dy_local.data(), dy_local.data(), T * H);
      engine.backward(dy_local.data(), result.dx.data() + rank * T * H);
      MoeWeights g = engine.grads();
      const size_t m = size_t(config.ffn * config.hidden), off = size_t(config.first_expert(rank)) * m;
      std::copy(g.w1.begin(), g.w1.end(), result.grads.w1.begin() + off);
      std::copy(g.w2.begin(), g.w2.end(), result.grads.w2.begin() + off);
      if (!g.w3.empty()) std::copy(g.w3.begin(), g.w3.end(), result.grads.w3.begin() + off);
      if (rank == 0) result.grads.gate = g.gate;
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (rank == 0) result.losses = engine.losses();
    result.rows_received += engine.rows_received();
    for (int32_t e = 0; e < Le; ++e) result.expert_rows[config.first_expert(rank) + e] = engine.layout().expert_rows(e);
    result.rows_sent += engine.rows_sent();
    for (int32_t e = 0; e < config.experts; ++e) {
      result.routed[e] += engine.routed_counts()[e];
      result.kept[e] += engine.kept_counts()[e];
    }
  });
  return result;
}

}  // namespace dmoe
