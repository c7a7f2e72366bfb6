// model/cuda/cuda_replica.cpp — TrainReplica on a GPU: this process is one rank of the job (dmoe launch,
// mpirun, srun, or alone) and runs CudaMixtralModel on its GPU.
#include <algorithm>
#include <vector>

#include "bench/cuda/gpu_timing.hpp"
#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"
#include "cuda/common.hpp"
#include "cuda/cuda_backend.hpp"
#include "flow/cuda_executor.hpp"
#include "flow/simulator.hpp"
#include "model/cuda/cuda_mixtral.hpp"
#include "model/mixtral.hpp"
#include "model/train_replica.hpp"

namespace dmoe {
namespace {

class CudaReplica final : public TrainReplica {
 public:
  CudaReplica(const MixtralConfig& config, DType storage, const MixtralWeights& full, const MixtralWeights& m,
              const MixtralWeights& v, int32_t micro_batches, int64_t max_tokens, bool bf16_expert_grads)
      : states_(micro_batches) {
    CudaRank r = open_cuda_rank(config, storage, max_tokens);
    comm_ = std::move(r.comm);
    std::unique_ptr<Backend> backend = std::move(r.backend);
    model_ = std::make_unique<CudaMixtralModel>(config, storage, *comm_, std::move(backend),
                                                bf16_expert_grads);
    const int32_t first = model_->first_expert(), held = model_->experts_per_rank();
    model_->set_weights(slice_mixtral_experts(full, first, held));
    model_->set_moments(slice_mixtral_experts(m, first, held), slice_mixtral_experts(v, first, held));
    model_->enable_stage_times(true);
    // The MFU of the progress line is against the bf16 GEMM ceiling of this GPU, timed once here (8192³, best
    // of 3 after a warm-up: ~10 ms).
    {
      cudaStream_t s = static_cast<cudaStream_t>(model_->backend().stream());
      bench::CeilingGemm gemm(s);
      bench::GpuTimer timer(s);
      bench::TimingOptions t;
      t.warmup = 1;
      t.min_iterations = 3;
      t.max_iterations = 3;
      t.min_total_ms = 0;
      t.flush_l2 = false;
      ceiling_ = bench::CeilingGemm::flop() / (timer.time([&] { gemm.run(); }, t).min_ms * 1e-3);
    }
  }
  double gemm_ceiling_flop_per_s() const override { return ceiling_; }
  ~CudaReplica() override {
    if (agree_) cudaFree(agree_);
    states_.clear();  // engines before the model's backend and the communicator
    eval_.reset();
    executor_.reset();
    model_.reset();
  }
  double flow_step(const flow::TaskGraph& graph, const int32_t* tokens, int64_t batch, int64_t seq) override {
    if (!executor_) {  // collective: every rank reaches its first Flow step together
      ar_comm_ = flow::open_cuda_allreduce_comm(*comm_);  // nullptr: the chunks go on comm_ (ArComm::model)
      executor_ = std::make_unique<flow::CudaFlowExecutor>(*model_, ar_comm_.get());
    }
    // The stage timer marks one stream in issue order: meaningless with three streams interleaved. Off for the
    // step (the stages outside it, zero_grads, norm, AdamW, validation, stay timed); the step is timed per task.
    model_->enable_stage_times(false);
    const double loss = executor_->step(graph, tokens, batch, seq, states_, &timeline_);
    model_->enable_stage_times(true);
    flow_time_.add(graph, timeline_);
    return loss;
  }
  FlowTimes flow_times() override {
    const bool one_comm = executor_ && executor_->ar_comm() == flow::ArComm::model;
    return flow_time_.table("CUDA events", [one_comm](flow::TaskKind kind) -> std::string {
      switch (flow::stream_of(kind)) {
        case flow::Stream::compute: return "compute";
        case flow::Stream::alltoall: return "all-to-all stream";
        default: return one_comm ? "all-to-all stream, model's communicator" : "own stream and communicator";
      }
    });
  }
  double forward(const int32_t* tokens, int64_t batch, int64_t seq, int32_t slot) override {
    return model_->forward(tokens, batch, seq, states_.at(slot));
  }
  void backward(int32_t slot, double loss_scale) override { model_->backward(states_.at(slot), loss_scale); }
  double evaluate(const int32_t* tokens, int64_t batch, int64_t seq) override {
    if (!eval_) eval_ = std::make_unique<CudaModelState>();
    return model_->forward(tokens, batch, seq, *eval_);
  }
  void zero_grads() override { model_->zero_grads(); }
  void reduce_grads() override { model_->reduce_grads(); }
  void grad_sum_of_squares(double out[2]) override { model_->grad_sum_of_squares(out); }
  void adamw_step(const cpu::AdamWParams& p, double weight_decay, double grad_scale) override {
    model_->adamw_step(p, weight_decay, grad_scale);
  }
  void export_share(MixtralWeights& weights, MixtralWeights& m, MixtralWeights& v) override {
    weights = model_->weights();
    model_->moments(m, v);
  }
  bool gather_full(MixtralWeights& weights, MixtralWeights& m, MixtralWeights& v) override {
    model_->gather_full(weights, m, v);
    return true;
  }
  double rank0_value(double value) override {
    if (comm_->world() == 1) return value;
    cudaStream_t s = static_cast<cudaStream_t>(model_->backend().stream());
    if (!agree_) DMOE_CHECK_CUDA(cudaMalloc(&agree_, sizeof(float)));
    float f = float(value);  // step times in ms: f32 keeps 7 digits, far finer than their run-to-run spread
    DMOE_CHECK_CUDA(cudaMemcpyAsync(agree_, &f, sizeof(f), cudaMemcpyHostToDevice, s));
    comm_->broadcast(agree_, 1, DType::f32, 0, model_->backend().stream());
    DMOE_CHECK_CUDA(cudaMemcpyAsync(&f, agree_, sizeof(f), cudaMemcpyDeviceToHost, s));
    cuda::wait_stream(s, "train: rank 0's value (broadcast)");
    return f;
  }
  Comm& comm() override { return *comm_; }
  void barrier() override {
    if (comm_->world() > 1) comm_->barrier(model_->backend().stream());
  }
  std::vector<std::pair<std::string, double>> stage_times() override { return model_->stage_times(); }
  bool bf16_expert_grads() const override { return model_->bf16_expert_grads(); }
  const char* engine_name() const override { return "cuda"; }

 private:
  std::unique_ptr<Comm> comm_;
  std::unique_ptr<Comm> ar_comm_;  // Flow's all-reduce communicator (flow_step), after comm_ in destruction order
  std::unique_ptr<CudaMixtralModel> model_;
  std::unique_ptr<flow::CudaFlowExecutor> executor_;
  std::vector<flow::TraceEvent> timeline_;  // the last Flow step's, reused
  FlowTimeAccumulator flow_time_;
  std::vector<CudaModelState> states_;
  std::unique_ptr<CudaModelState> eval_;
  double ceiling_ = 0;
  void* agree_ = nullptr;  // rank0_value's device float
};

}  // namespace

CudaRank open_cuda_rank(const MixtralConfig& config, DType storage, int64_t max_tokens) {
  const ProcessEnv env = detect_process_env();
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  DMOE_REQUIRE_INPUT(count > 0, "--engine cuda needs a CUDA GPU, and none is visible; use --engine cpu");
  CudaRank r;
  r.rank = env.rank;
  r.world = env.world;
  if (env.world == 1) {
    r.backend = make_cuda_backend(storage, choose_device(env, count));
    r.comm = make_local_comm();
  } else {
    const int32_t device = select_device(env);
    r.backend = make_cuda_backend(storage, device);
    const int64_t k = config.num_experts_per_tok, Le = config.num_local_experts / env.world;
    const size_t per_peer = size_t(std::max(max_tokens * k, max_tokens * Le)) * size_t(config.hidden_size) *
                            dtype_size(storage);
    r.comm = make_gpu_comm(env, CommKind::automatic, per_peer, static_cast<cudaStream_t>(r.backend->stream()));
  }
  return r;
}

std::unique_ptr<TrainReplica> make_cuda_replica(const MixtralConfig& config, DType storage, const MixtralWeights& full,
                                                const MixtralWeights& m, const MixtralWeights& v,
                                                int32_t micro_batches, int64_t max_tokens, bool bf16_expert_grads) {
  return std::make_unique<CudaReplica>(config, storage, full, m, v, micro_batches, max_tokens, bf16_expert_grads);
}

EvalResult run_cuda_model(const MixtralConfig& config, const MixtralWeights& weights, const std::vector<int32_t>& tokens,
                          int64_t batch, int64_t seq, DType storage, bool with_grad) {
  DMOE_REQUIRE(int64_t(tokens.size()) == batch * seq, "mixtral: {} tokens given for [{}, {}]", tokens.size(), batch,
               seq);
  DMOE_REQUIRE(weights.first_expert == 0 && weights.num_experts == config.num_local_experts,
               "mixtral: the weights must hold all {} experts", config.num_local_experts);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  DMOE_REQUIRE_INPUT(count > 0, "--engine cuda needs a CUDA GPU, and none is visible; use --engine cpu");
  const ProcessEnv env = detect_process_env();
  // A job of W processes (dmoe launch, mpirun, srun): this rank runs sequences [rank·B/W, +B/W) with its experts
  // E/W, as a training step does; the logits and gradients are gathered to rank 0, which alone fills the result.
  DMOE_REQUIRE_INPUT(batch % env.world == 0,
                     "eval: batch = {} sequences cannot be split evenly over the job's {} ranks", batch, env.world);
  DMOE_REQUIRE_INPUT(config.num_local_experts % env.world == 0,
                     "eval: num_local_experts = {} cannot be split evenly over the job's {} ranks",
                     config.num_local_experts, env.world);
  const int64_t local = batch / env.world;
  CudaRank r = open_cuda_rank(config, storage, local * seq);
  EvalResult result;
  result.rank = r.rank;
  {
    CudaMixtralModel model(config, storage, *r.comm, std::move(r.backend));
    model.set_weights(slice_mixtral_experts(weights, model.first_expert(), model.experts_per_rank()));
    CudaModelState st;
    model.zero_grads();
    model.forward(tokens.data() + int64_t(r.rank) * local * seq, local, seq, st);  // the loss is over all ranks
    result.logits = model.gather_logits(st);
    result.loss = st.loss;
    result.ce_loss = st.ce_loss;
    result.aux_loss = st.aux_loss;
    if (with_grad) {
      model.backward(st);
      model.reduce_grads();
      if (r.world == 1)
        result.grads = model.grads();  // all experts are here: no gathering buffers
      else
        model.gather_full_grads(result.grads);
    }
    st.blocks.clear();  // engines before the model's backend
  }
  return result;
}

bool cuda_grouped_bf16_wgrad() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return false;
  return cuda::grouped_bf16_wgrad_available();
}

void cuda_job_size(int32_t* rank, int32_t* world) {
  const ProcessEnv env = detect_process_env();
  *rank = env.rank;
  *world = env.world;
}

}  // namespace dmoe
