// train_replica.hpp — one rank's model as the training loop (model/trainer.cpp) drives it, on the CPU engine
// (MixtralModel, host memory) or on a GPU (CudaMixtralModel, device memory): forward and backward of
// micro-batches, the gradient reduction, the global-norm parts and the AdamW step, and the weights and
// moments back on the host for checkpoints. The loop's arithmetic (schedule, clipping factor, logging) is
// written once above this interface.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "core/dtype.hpp"
#include "cpu/model_kernels.hpp"
#include "flow/simulator.hpp"  // flow::TraceEvent
#include "flow/task_graph.hpp"
#include "model/mixtral_config.hpp"
#include "model/mixtral_weights.hpp"

namespace dmoe {

class TrainReplica {
 public:
  virtual ~TrainReplica() = default;
  // Micro-batch `slot` (0 .. micro_batches-1) of this rank: tokens [batch, seq]; the loss over all ranks.
  virtual double forward(const int32_t* tokens, int64_t batch, int64_t seq, int32_t slot) = 0;
  virtual void backward(int32_t slot, double loss_scale) = 0;
  // A forward that keeps nothing for a backward (validation); the loss over all ranks.
  virtual double evaluate(const int32_t* tokens, int64_t batch, int64_t seq) = 0;
  virtual void zero_grads() = 0;
  virtual void reduce_grads() = 0;
  // One step's forwards, backwards (1/R each) and the replicated gradients' all-reduce as a Flow task graph
  // (graph.spec.micro_batches micro-batches of this rank's tokens [batch, seq]); the mean of the micro-batches'
  // losses. The CPU engine runs it on the CPU executor (threads), the GPU engine on the GPU executor (streams);
  // docs/flow.md. The graph's dense_grad_bytes_per_layer is the engine's layout (flow::mixtral_/
  // cuda_mixtral_dense_grad_bytes_per_layer); the executors refuse another.
  virtual double flow_step(const flow::TaskGraph& graph, const int32_t* tokens, int64_t batch, int64_t seq);
  // Σ g² of the gradients: [0] the replicated tensors (the same on every rank), [1] the experts of all ranks
  // (collective).
  virtual void grad_sum_of_squares(double out[2]) = 0;
  // AdamW (cpu::adamw_step's arithmetic) on g = grad_scale · grad, weight decay on matrices only.
  virtual void adamw_step(const cpu::AdamWParams& p, double weight_decay, double grad_scale) = 0;
  // This rank's share of the weights and the two moments, on the host.
  virtual void export_share(MixtralWeights& weights, MixtralWeights& m, MixtralWeights& v) = 0;
  // Ranks that are processes (the GPU engine at W > 1): every expert of the weights and moments gathered to rank 0
  // (collective; true), where threads share memory instead (false: nothing done).
  virtual bool gather_full(MixtralWeights& weights, MixtralWeights& m, MixtralWeights& v) { return false; }
  // Rank 0's `value` on every rank (collective; the GPU job's communicator): measurements that decide what every
  // rank runs next (the Flow tuner's step times) must be the same everywhere. Threads and W = 1 return `value`.
  virtual double rank0_value(double value) { return value; }
  virtual Comm& comm() = 0;
  virtual void barrier() = 0;  // every rank here (collective; waits)
  // The bf16 GEMM ceiling of this rank's GPU (FLOP/s), measured when the replica was made; 0 on the CPU engine.
  virtual double gemm_ceiling_flop_per_s() const { return 0; }
  // Time per stage summed over the steps so far, ms (the GPU model's stage events; empty on the CPU engine).
  virtual std::vector<std::pair<std::string, double>> stage_times() { return {}; }
  // flow_step's own timing (the stage timer is off inside it: its streams interleave): per task kind, the GPU time
  // of its tasks' spans (CUDA events), ms summed over the Flow steps so far, in kind order; and the summed span of
  // the steps' tasks (first start to last end). Empty (steps = 0) without Flow steps.
  struct FlowTimes {
    int64_t steps = 0;
    double span_ms = 0;
    std::vector<std::pair<std::string, double>> kinds;  // e.g. ("AT  attention + gate (compute)", ms)
    std::string clock;  // how the kinds were timed, e.g. "CUDA events" or "wall clock of the executor's threads"
  };
  virtual FlowTimes flow_times() { return {}; }
  // Whether the model keeps its experts' gradients in bf16 (the GPU model's bf16_expert_grads); false on the CPU.
  virtual bool bf16_expert_grads() const { return false; }
  virtual const char* engine_name() const = 0;
};

// flow_times()'s bookkeeping, one copy for both engines: each Flow step's timeline summed per task kind and its span
// (first start to last end), over the steps of the last graph run (a new schedule, R or Sp starts the table again:
// --schedule tuned's table is of its choice, not of its samples); that graph's first step is left out (it builds
// the engines and plans for that shape).
class FlowTimeAccumulator {
 public:
  void add(const flow::TaskGraph& graph, const std::vector<flow::TraceEvent>& timeline);
  // where(kind): the resource the kind ran on, e.g. "compute" or "all-to-all stream".
  TrainReplica::FlowTimes table(const std::string& clock,
                                const std::function<std::string(flow::TaskKind)>& where) const;

 private:
  std::vector<double> kind_ms_;  // per task kind, summed over the counted steps
  double span_ms_ = 0;
  int64_t steps_ = 0;       // steps counted
  int64_t steps_seen_ = 0;  // every step, counted or not
  flow::GraphSpec last_spec_;
};

// The CPU engine's rank `comm.rank()` of a W-thread job, starting from its share of the weights and moments.
// allreduce_comm: a second communicator over the same thread ranks (make_thread_comms), for the Flow executor's
// gradient chunks (flow_step); null when the run has no --schedule (flow_step then refuses).
std::unique_ptr<TrainReplica> make_cpu_replica(const MixtralConfig& config, Comm& comm, MixtralWeights share,
                                               MixtralWeights m, MixtralWeights v, int32_t micro_batches,
                                               Comm* allreduce_comm = nullptr);

// This process as one rank of a GPU job (dmoe launch / mpirun / srun, or alone): its GPU, a communicator over
// the job's processes (NCCL or NVSHMEM; none at W = 1), the model in `storage` (f32 or bf16). `full`, `m`, `v`
// hold every expert; the replica takes its rank's share. `max_tokens` is the most tokens of one forward (a micro-batch,
// or the validation share: sizes the communicator's buffers). bf16_expert_grads: the model keeps its experts' gradients
// in bf16 (CudaMixtralModel's option; bf16_expert_grads_for_training decides it for dmoe train). Throws a clear error in
// a build without CUDA.
std::unique_ptr<TrainReplica> make_cuda_replica(const MixtralConfig& config, DType storage, const MixtralWeights& full,
                                                const MixtralWeights& m, const MixtralWeights& v,
                                                int32_t micro_batches, int64_t max_tokens,
                                                bool bf16_expert_grads = false);

// Whether bf16 expert gradients make a GPU step faster for this shape. Where the GPU stores them with one grouped
// launch per product (`grouped_bf16_wgrad`: cuda_grouped_bf16_wgrad(), the sm90 kernel's 16-byte bf16 stores) they pay
// on every measured shape (docs/perf.md, twenty-first session, H100, 8 × 1024 tokens, bf16 vs f32 expert gradients, the
// same call): GPT2-Tiny-MoE (H·I = 0.13 M) step 14.7 → 13.7 ms, BERT-Large-MoE (0.52 M) 46.0 → 44.7 ms; the kernel's
// 16-byte stores need H and I multiples of 8. Elsewhere bf16 products go to one cuBLAS call per expert and product,
// whose host time (~15-20 µs a call) pays only for large experts (eighteenth session, H200: DeepSeek-V2-S (7.9 M)
// optimizer 32.7 → 30.0 ms, LLaMA2-MoE (4.2 M) step 148.6 → 143.5 ms; GPT2-Tiny-MoE 38.0 ms against 13.4 and
// BERT-Large-MoE 49.7 against 40.7, their backward's 1152-2304 cuBLAS calls host-bound): H·I of at least
// kBf16ExpertGradMinWeight elements.
constexpr int64_t kBf16ExpertGradMinWeight = int64_t(1) << 21;
bool bf16_expert_grads_pay_off(const MixtralConfig& config, bool grouped_bf16_wgrad);
// dmoe train's choice: a bf16 GPU model, one backward per layer a step (one micro-batch: several add into the
// gradients; no Flow schedule: its R varies), and a shape where it pays.
bool bf16_expert_grads_for_training(const MixtralConfig& config, DType storage, int32_t micro_batches,
                                    bool flow_schedule, bool grouped_bf16_wgrad);
// Whether this process's GPU stores bf16 weight gradients with one grouped launch per product (an sm_90 GPU, a build
// for sm_90a, DMOE_WGRAD auto, own or sm90); false in a build without CUDA.
bool cuda_grouped_bf16_wgrad();
// The rank and size of the GPU job this process belongs to (1 rank when not started by a launcher).
void cuda_job_size(int32_t* rank, int32_t* world);

}  // namespace dmoe
