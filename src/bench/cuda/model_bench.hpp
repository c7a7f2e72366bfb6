// bench/cuda/model_bench.hpp — `dmoe bench model`: one training step of a whole Mixtral model on this GPU
// (CudaMixtralModel: forward with the loss, backward, gradient norm, AdamW), and its forward alone, timed in the
// same rounds as the GEMM ceiling; FLOPs, MFU and the memory the model holds.
//
// FLOPs of a step (MixtralConfig::forward_flop; written out so the MFU can be checked by hand), n = batch·seq tokens,
// per layer
//   dense  = 2·n·H·(Q + 2·KV) + 2·n·Q·H          (q, k, v, o projections)
//   router = 2·n·H·E
//   experts = 2·n·k·3·H·I                        (the k experts a token is routed to; SwiGLU: w1, w3, w2)
//   attention = 2·batch·heads·seq²·D             (causal: QKᵀ and PV over the visible half)
//   head = 2·n·H·V
// forward = Σ layers (dense + router + experts + attention) + head; a training step = 3 × forward (the backward
// computes two products for every one of the forward), the convention behind 6·parameters·tokens.
// MFU = step FLOPs / step time / the bf16 GEMM ceiling timed in the same rounds (bench/cuda/gpu_timing.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "bench/stats.hpp"
#include "core/dtype.hpp"
#include "model/mixtral_config.hpp"

namespace dmoe::bench {

struct ModelBenchOptions {
  int64_t batch = 8, seq = 1024;
  DType dtype = DType::bf16;
  int warmup = 2;
  int min_iterations = 5;
  // bf16 model: the experts' gradients in bf16 where bf16_expert_grads_pay_off (model/train_replica.hpp), as dmoe train
  bool bf16_expert_grads = true;
};

struct ModelBenchResult {
  Stats step, forward;
  Stats forward_backward;  // zero_grads, forward, backward (no optimizer)
  Stats optimizer;         // gradient all-reduce (W > 1), global norm, AdamW over every parameter
  double step_flop = 0, forward_flop = 0;
  double gemm_ceiling_flop_per_s = 0;  // same rounds
  double loss_first = 0, loss_last = 0;  // of the timed steps (random tokens: the loss near ln V, and falling)
  double parameters = 0;               // of the model (all experts)
  double device_bytes_in_use = 0;      // after the steps (cudaMemGetInfo): parameters, moments, activations
  double parameter_bytes = 0;          // the model's parameter buffers (f32 master, grads, 2 moments, bf16 copy)
  bool bf16_expert_grads = false;      // as the model ran
  int32_t rank = 0, world = 1;         // of the job (each rank its own batch: tokens/s of the job = world × one's)
  std::vector<std::pair<std::string, double>> stages;  // ms per step of each stage (CudaMixtralModel::stage_times)
};

ModelBenchResult bench_model_step(const MixtralConfig& config, const ModelBenchOptions& options);
double model_forward_flop(const MixtralConfig& config, int64_t batch, int64_t seq);

}  // namespace dmoe::bench
