// model/cuda/cuda_mixtral.hpp — the Mixtral model of model/mixtral.hpp on one GPU per rank: the same stages,
// the same per-micro-batch state passed in (never kept in the model), the CUDA twins of the CPU kernels
// (cuda/model_kernels.cuh), cuBLAS for the dense projections, and the MoE layers on EpEngine over the CUDA
// backend (NCCL or NVSHMEM between ranks).
//
// Parameters live in four flat device buffers of one layout (ParamLayout): f32 master weights, f32 gradients,
// and AdamW's two f32 moments; a bf16 model also keeps a bf16 copy of the weights, which every kernel reads
// (an f32 model reads the master weights), and with bf16 expert gradients (the constructor's option) the f32
// gradient buffer ends where the experts begin and theirs are a bf16 buffer of their own. The layout groups the
// tensors by how the step treats them:
//   [norms | dense matrices | routers | experts]
// so one all-reduce covers the replicated gradients (norms, dense, routers), one AdamW launch with weight
// decay covers dense..experts (two with bf16 expert gradients) and one without covers the norms, and the gradient
// norm is two sums. Within the
// experts group a layer's w1, w3 and w2 are each one [Le, ·, ·] stack, the layout EpEngine reads.
//
// Activations are in the storage type (f32 or bf16); logits f32. Everything is issued on the backend's stream;
// forward() waits once at the end for the loss (and the routers' statistics of the aux loss).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "core/dtype.hpp"
#include "cpu/model_kernels.hpp"
#include "engine/backend.hpp"
#include "engine/buffer.hpp"
#include "engine/ep_engine.hpp"
#include "model/mixtral_config.hpp"
#include "model/mixtral_weights.hpp"

namespace dmoe {

// Where each tensor of a rank's share lives in the flat parameter buffers (offsets in elements).
struct ParamLayout {
  enum Group { norms = 0, dense = 1, routers = 2, experts = 3 };
  struct Entry {
    std::vector<float>* (*select)(MixtralWeights&, int32_t layer);  // the host tensor of the same role
    int32_t layer = -1;
    Group group = dense;
    int64_t offset = 0, numel = 0;
  };
  std::vector<Entry> entries;
  int64_t group_begin[5] = {0, 0, 0, 0, 0};  // group g is [group_begin[g], group_begin[g + 1])
  int64_t total() const { return group_begin[4]; }
  // Per layer: offsets of the input/post-attention norms, q/k/v/o, the router and the three expert stacks.
  struct Layer {
    int64_t input_layernorm, post_attention_layernorm, q_proj, k_proj, v_proj, o_proj, gate, w1, w3, w2;
  };
  std::vector<Layer> layers;
  int64_t embed_tokens = 0, norm = 0, lm_head = -1;  // lm_head -1: tied to embed_tokens
};
ParamLayout make_param_layout(const MixtralConfig& c, int32_t experts_per_rank);

// What one block keeps between its forward and its backward, in device memory (n tokens).
struct CudaBlockState {
  Buffer x, xn1, rstd1, q, k, v, attn, lse, h, hn2, rstd2, moe_out;
  std::unique_ptr<EpEngine> moe;
};

struct CudaModelState {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> tokens;  // host copy [n]
  Buffer tokens_dev, targets_dev;
  std::vector<CudaBlockState> blocks;
  Buffer out;                   // [n, H] the last block's output (the final norm's input)
  Buffer xfn, rstdf, logits, lse_head, loss_sum, count;
  // Backward's activation gradients that pass from one stage to the next (per micro-batch, so that several
  // backwards can be in flight): dresid [n, H] the residual stream's, dmoe [n, H] the MoE input's.
  Buffer dresid, dmoe;
  int64_t ce_count = 0;
  double ce_loss = 0, aux_loss = 0, loss = 0;
  std::vector<double> expert_fraction;
  bool forward_done = false;
};

// This process as one rank of a GPU job (dmoe launch / mpirun / srun, or alone): its GPU made current, a CUDA
// backend of `storage`, and a communicator over the job's processes (NCCL or NVSHMEM, chosen as make_gpu_comm
// does; a local one at W = 1) with buffers for `max_tokens` tokens of one forward. Throws naming what is missing.
struct CudaRank {
  int32_t rank = 0, world = 1;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Comm> comm;
};
CudaRank open_cuda_rank(const MixtralConfig& config, DType storage, int64_t max_tokens);

class CudaMixtralModel {
 public:
  // storage f32 or bf16; the process's GPU must be current (select_device); `comm` the job's communicator
  // (its collectives are issued on the stream of backend()).
  // bf16_expert_grads (bf16 storage only; ignored for f32): the experts' gradients are bf16, as a bf16 PyTorch
  // model's are (the router's and the dense tensors' stay f32; weights and moments stay f32 masters): the
  // backward writes them rounded once from its f32 accumulators, and the gradient norm and AdamW read half the
  // bytes. A step may then run one backward per layer only (a second one, another micro-batch adding into them,
  // is refused by EpEngine). dmoe train takes it where bf16_expert_grads_for_training says (model/train_replica.hpp:
  // one micro-batch, no Flow schedule, a shape where it pays); dmoe bench model where bf16_expert_grads_pay_off unless
  // --f32-expert-grads; eval --grad keeps f32.
  CudaMixtralModel(const MixtralConfig& config, DType storage, Comm& comm, std::unique_ptr<Backend> backend,
                   bool bf16_expert_grads = false);
  ~CudaMixtralModel();
  CudaMixtralModel(const CudaMixtralModel&) = delete;
  CudaMixtralModel& operator=(const CudaMixtralModel&) = delete;

  // This rank's share (experts [first_expert(), +experts_per_rank())) uploaded as the master weights;
  // moments start at zero unless given (resume).
  void set_weights(const MixtralWeights& share);
  void set_moments(const MixtralWeights& m, const MixtralWeights& v);
  // Copies back to the host (same share layout).
  MixtralWeights weights();
  MixtralWeights grads();
  void moments(MixtralWeights& m, MixtralWeights& v);
  // Every expert of the weights and moments (all ranks' shares) into w, m, v on rank 0 (collective; the other ranks'
  // outputs are left empty): each expert stack is summed over the ranks from zeros and this rank's share, on the
  // device, through the communicator.
  void gather_full(MixtralWeights& w, MixtralWeights& m, MixtralWeights& v);
  // The same for the gradients (after reduce_grads(), so rank 0's replicated ones are everyone's): `dmoe eval
  // --grad` of a job of W ranks.
  void gather_full_grads(MixtralWeights& g);

  void zero_grads();
  // tokens [batch, seq] (host). Returns the loss over all ranks (collective); waits for the GPU once.
  double forward(const int32_t* tokens, int64_t batch, int64_t seq, CudaModelState& state);
  void backward(CudaModelState& state, double loss_scale = 1.0);
  void reduce_grads();  // replicated gradients summed over ranks (collective)
  // Σ g²: [0] the replicated tensors, [1] the experts of all ranks (collective; waits for the GPU).
  void grad_sum_of_squares(double out[2]);
  // AdamW on every tensor with g = grad_scale · grad; weight decay on all but the norms.
  void adamw_step(const cpu::AdamWParams& p, double weight_decay, double grad_scale);
  // The logits of the state's last forward, [n, V] f32 on the host.
  std::vector<float> logits(const CudaModelState& state);
  // Every rank's logits, [world · n, V] in rank order, on rank 0 (collective: every rank's state holds the same n;
  // the other ranks get an empty vector). Summed from zeros on the device, as gather_full.
  std::vector<float> gather_logits(const CudaModelState& state);

  // The stages forward() and backward() run, for an executor that issues them itself (Flow's GPU executor,
  // src/flow/cuda_executor.hpp). forward() = begin_forward, embed_forward, per layer attention_forward and
  // moe_forward, head_forward; backward() = head_backward, per layer (L−1 first) moe_backward and
  // attention_backward, embed_backward. Compute stages issue on backend().stream(); the MoE stage is cut at its
  // all-to-alls (EpEngine's phases): moe_forward = moe_route, moe_dispatch(s), moe_experts, moe_combine(s),
  // moe_finish and moe_backward = moe_backward_combine, moe_backward_dispatch(s), moe_backward_experts,
  // moe_backward_return(s), moe_backward_finish with s = backend().stream(); the exchange phases issue only the
  // engine's collectives on `lane` (the caller orders lane and the backend's stream with events).
  // head_forward's loss all-reduce (W > 1) goes on `lane` (null: the backend's stream), after an event that
  // orders it behind the loss kernels; it then waits for `lane` (the loss is read on the host).
  void begin_forward(const int32_t* tokens, int64_t batch, int64_t seq, CudaModelState& st);
  // Creates the state's MoE engines for its token count now (with W > 1 each checks the ranks' configs with a
  // collective on the backend's stream), so that no collective of the model's communicator is issued from a
  // compute stage later; moe_route does it otherwise. After begin_forward.
  void prepare_engines(CudaModelState& st);
  void embed_forward(CudaModelState& st);
  void attention_forward(int layer, CudaModelState& st);
  void moe_forward(int layer, CudaModelState& st);
  void moe_route(int layer, CudaModelState& st);
  void moe_dispatch(int layer, CudaModelState& st, Stream lane);
  void moe_experts(int layer, CudaModelState& st);
  void moe_combine(int layer, CudaModelState& st, Stream lane);
  void moe_finish(int layer, CudaModelState& st);
  void head_forward(CudaModelState& st, Stream lane = nullptr);
  void head_backward(CudaModelState& st, double loss_scale);
  void moe_backward(int layer, CudaModelState& st, double loss_scale);
  void moe_backward_combine(int layer, CudaModelState& st, double loss_scale);
  void moe_backward_dispatch(int layer, CudaModelState& st, Stream lane);
  void moe_backward_experts(int layer, CudaModelState& st);
  void moe_backward_return(int layer, CudaModelState& st, Stream lane);
  void moe_backward_finish(int layer, CudaModelState& st);
  void attention_backward(int layer, CudaModelState& st);
  void embed_backward(CudaModelState& st);
  // The f32 gradient buffer (layout()), e.g. for an all-reduce of parts of it; with bf16 expert gradients it
  // ends where the experts begin.
  float* gradients() { return grad_.as<float>(); }
  bool bf16_expert_grads() const { return bf16_expert_grads_; }

  const MixtralConfig& config() const { return config_; }
  int32_t rank() const { return rank_; }
  int32_t world() const { return world_; }
  int32_t first_expert() const { return rank_ * experts_per_rank(); }
  int32_t experts_per_rank() const { return config_.num_local_experts / world_; }
  DType storage() const { return storage_; }
  Backend& backend() { return *backend_; }
  Comm& comm() { return comm_; }  // the job's (all-to-all) communicator
  const ParamLayout& layout() const { return layout_; }
  size_t parameter_bytes() const;  // device memory of the parameter buffers
  const char* attention_kernel() const;  // "cudnn" or "own" (DMOE_ATTENTION)
  // Per-stage GPU time (events on the stream around each stage; host waits inside a stage count): off by default.
  // stage_times() waits for the GPU and returns the totals since the last reset, in ms, in first-run order.
  void enable_stage_times(bool on);
  std::vector<std::pair<std::string, double>> stage_times();
  void reset_stage_times();
  // The f32 master weights (layout()); after writing them directly, refresh_compute_copy() updates the bf16 copy.
  float* master_weights() { return master_.as<float>(); }
  void refresh_compute_copy();

 private:
  struct Impl;
  void* w(int64_t offset) const;  // compute copy (storage type) at an element offset
  float* g(int64_t offset) const; // f32 gradient at an element offset (not an expert's with bf16 expert gradients)
  void* expert_grad(int64_t offset) const;  // an expert tensor's gradient: f32, or bf16 (bf16_expert_grads_)
  void prepare_moe(CudaBlockState& b, int64_t tokens, int layer);
  void upload_share(const MixtralWeights& src, float* dst);
  void download_share(const float* src, MixtralWeights& dst);
  void gather_full_buffer(const float* src, MixtralWeights& dst);

  MixtralConfig config_;
  DType storage_;
  Comm& comm_;
  int32_t rank_ = 0, world_ = 1;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Impl> impl_;  // cuBLAS handle, workspace (CUDA types stay out of this header)
  ParamLayout layout_;
  Buffer master_, grad_, m_, v_, compute_;  // compute_: bf16 copy (empty for f32)
  Buffer expert_grad_;                      // bf16 expert gradients [experts' elements] (bf16_expert_grads_)
  bool bf16_expert_grads_ = false;
  std::vector<bool> experts_fresh_;         // per layer: no backward since zero_grads()
  Buffer scratch_[9];                       // backward's gradients of activations (grow-only)
  size_t elem_ = 4;
};

}  // namespace dmoe
