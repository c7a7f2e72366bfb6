// bench/cuda/model_bench.cpp — see model_bench.hpp.
#include "bench/cuda/model_bench.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <memory>
#include <vector>

#include "bench/cuda/gpu_timing.hpp"
#include "comm/cuda/local_comm.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "cuda/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "model/cuda/cuda_mixtral.hpp"
#include "model/train_replica.hpp"

namespace dmoe::bench {

double model_forward_flop(const MixtralConfig& c, int64_t batch, int64_t seq) { return c.forward_flop(batch, seq); }

ModelBenchResult bench_model_step(const MixtralConfig& config, const ModelBenchOptions& o) {
  int32_t r_world = 1;
  DMOE_REQUIRE_INPUT(o.batch >= 1, "bench model: --batch {} (need >= 1)", o.batch);
  config.check_sequence(o.seq, "bench model: --seq", 2);  // one range, [2, max_position_embeddings], as flow measure's
  // This process is one rank of the job (W = 1 alone; under dmoe launch / mpirun each rank its own batch, the
  // experts sharded E/W, the replicated gradients all-reduced: weak scaling in tokens per rank).
  CudaRank rank = open_cuda_rank(config, o.dtype, o.batch * o.seq);
  DMOE_REQUIRE_INPUT(config.num_local_experts % rank.world == 0,
                     "bench model: num_local_experts = {} does not split over the job's {} ranks",
                     config.num_local_experts, rank.world);
  std::unique_ptr<Comm> comm = std::move(rank.comm);
  CudaMixtralModel model(config, o.dtype, *comm, std::move(rank.backend),
                         o.bf16_expert_grads && bf16_expert_grads_pay_off(config, cuda_grouped_bf16_wgrad()));
  r_world = rank.world;
  cudaStream_t stream = static_cast<cudaStream_t>(model.backend().stream());
  // Random weights straight on the device (a host-side init of billions of values would take minutes):
  // uniform with HF's standard deviation for matrices (±√3·σ), norms 1.
  const ParamLayout& lay = model.layout();
  const float a = float(std::sqrt(3.0) * config.initializer_range);
  uint64_t seed = 11;
  for (const ParamLayout::Entry& e : lay.entries) {
    float* p = model.master_weights() + e.offset;
    if (e.group == ParamLayout::norms) {
      std::vector<float> ones(size_t(e.numel), 1.0f);
      model.backend().upload(p, ones.data(), ones.size() * 4);
    } else {
      fill_uniform_f32(p, e.numel, seed++, a, stream);
    }
  }
  model.refresh_compute_copy();

  const int64_t n = o.batch * o.seq;
  Rng rng(5 + uint64_t(comm->rank()));  // each rank its own batch
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(config.vocab_size));
  // One state for every timed piece (a second one would double the activations' memory: LLaMA2-MoE's 32 layers
  // then no longer fit beside 6.6e9 parameters' 18 bytes each).
  CudaModelState train;
  ModelBenchResult r;
  int64_t step_no = 0;
  bool first = true;
  auto optimizer = [&] {
    model.reduce_grads();
    double sq[2];
    model.grad_sum_of_squares(sq);
    cpu::AdamWParams p;
    p.lr = 1e-4;
    p.step = ++step_no;
    model.adamw_step(p, 0.1, cpu::clip_coefficient(sq[0] + sq[1], 1.0));
  };
  auto step = [&] {
    model.zero_grads();
    const double loss = model.forward(tokens.data(), o.batch, o.seq, train);
    model.backward(train);
    optimizer();
    if (first) r.loss_first = loss;
    first = false;
    r.loss_last = loss;
  };
  auto forward = [&] { model.forward(tokens.data(), o.batch, o.seq, train); };
  auto forward_backward = [&] {
    model.zero_grads();
    model.forward(tokens.data(), o.batch, o.seq, train);
    model.backward(train);
  };
  CeilingGemm ceiling(stream);
  GpuTimer timer(stream);
  TimingOptions t;
  t.warmup = o.warmup;
  t.min_iterations = o.min_iterations;
  t.max_iterations = std::max(o.min_iterations, 50);
  t.min_total_ms = 0;
  t.flush_l2 = false;  // a step moves gigabytes; an L2 flush would change nothing but the run time
  Buffer agree(model.backend());
  if (comm->world() > 1) {
    // Every rank runs as many timed rounds as rank 0 (the steps are collective).
    void* n_dev = agree.ensure(8);
    t.agree_iterations = [&model, &comm, n_dev](int wanted) {
      int64_t count = wanted;
      model.backend().upload(n_dev, &count, sizeof(count));
      comm->broadcast(n_dev, 1, DType::i64, 0, model.backend().stream());
      model.backend().download(&count, n_dev, sizeof(count));
      return int(count);
    };
  }
  // The optimizer alone runs on the gradients of the last backward (its numbers change nothing timed after it:
  // each step starts from zero_grads).
  const std::vector<Stats> s =
      timer.time_interleaved({step, forward, forward_backward, optimizer, [&] { ceiling.run(); }}, t);
  r.step = s[0];
  r.forward = s[1];
  r.forward_backward = s[2];
  r.optimizer = s[3];
  r.gemm_ceiling_flop_per_s = CeilingGemm::flop() / (s[4].median_ms * 1e-3);
  // Where a step's time goes: stage times over a few more steps (events only; no extra waits inside the step).
  const int breakdown_steps = 3;
  model.reset_stage_times();
  model.enable_stage_times(true);
  for (int i = 0; i < breakdown_steps; ++i) step();
  for (auto& [name, ms] : model.stage_times()) r.stages.emplace_back(name, ms / breakdown_steps);
  model.enable_stage_times(false);
  r.forward_flop = model_forward_flop(config, o.batch, o.seq);
  r.step_flop = 3 * r.forward_flop;
  r.parameters = double(config.num_parameters());
  r.parameter_bytes = double(model.parameter_bytes());
  size_t free_b = 0, total_b = 0;
  DMOE_CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  r.device_bytes_in_use = double(total_b - free_b);
  r.world = r_world;
  r.bf16_expert_grads = model.bf16_expert_grads();
  r.rank = comm->rank();
  train.blocks.clear();
  return r;
}

}  // namespace dmoe::bench
