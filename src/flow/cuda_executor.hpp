// cuda_executor.hpp — one training step of the GPU Mixtral model (src/model/cuda/cuda_mixtral.*) in a Flow task
// graph's issue orders, on CUDA streams of this rank's GPU, issued by one host thread (docs/flow.md, "The GPU
// executor"):
//
//   compute stream (the backend's)  AT  → moe_finish of layer l−1 (l > 0) or embed_forward (l = 0),
//                                         attention_forward, moe_route (gate, send plan, gather)
//                                   E   → moe_experts;  E' → moe_backward_experts
//                                   AT' → moe_backward_finish (router backward, dx), attention_backward,
//                                         embed_backward (l = 0)
//   all-to-all stream               D → moe_dispatch;  C → moe_combine;  C' → moe_backward_dispatch;
//                                   D' → moe_backward_return (the model's communicator: every collective on it)
//                                   C' first issues its compute prelude on the compute stream: moe_backward_combine
//                                   and, for l = L−1, moe_finish + head_forward (its loss all-reduce on this
//                                   stream) + head_backward — the graph folds the head into C'[L−1, r]
//   AR chunk k                      bytes [k·Sp, (k+1)·Sp) of the replicated gradients in the graph's layout
//                                   (ReplicatedLayout): final norm + lm_head (complete after C'[L−1, r]'s prelude
//                                   for every r), layers L−1 … 0 (norms, q/k/v/o, router of each), the embedding
//                                   (complete after AT'[0, r]); nothing is all-reduced outside the chunks.
//                                   Two modes (ArComm):
//     own    an all-reduce stream and a communicator of its own (NCCL), chunks issued in chunk order whenever the
//            dynamic priority rule allows (a timing-dependent decision that changes only *when* a chunk goes on
//            its own communicator, never the order of any communicator's collectives);
//     model  the all-to-all stream and the model's communicator: the host issues every task, chunks included, in
//            single_comm_issue_order(graph) — decided from the graph alone, identical on every rank. For ranks
//            sharing a GPU (MPS) and NVSHMEM, where a second communicator is impossible.
//
// True dependencies are CUDA events (one per task, recorded at its end on its stream; a task's stream waits for
// the events of its dependencies on other streams). The host issues the compute and all-to-all tasks in one fixed
// merge of their two orders — a pure function of the graph, identical on every rank.
//
// Gradients are bit-identical at W = 1 to forward(r) for r = 0..R−1, then backward(r, 1/R) for r = 0..R−1, then
// reduce_grads() (each tensor gets its micro-batches' contributions in the same order on the one compute stream;
// the kernels are deterministic). At W > 1 too when the all-reduce sums each element in an order that does not
// depend on how the buffer is cut (two ranks: a + b; NVSHMEM's rank-order sum); NCCL's sums over more ranks may
// differ in the last bits between chunkings. Refused: tied embeddings (head and embedding backward add into one
// tensor in another order than the sequential one), a graph whose dense_grad_bytes_per_layer, head_grad_bytes or
// embed_grad_bytes is not the model's (set_mixtral_grad_layout), Sp not a multiple of 4.
//
// Without CUDA (DMOE_CUDA=OFF) the executor's constructor and measure_cuda_flow refuse with a dmoe::Error.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "core/dtype.hpp"
#include "core/resource_probe.hpp"
#include "flow/simulator.hpp"
#include "flow/task_graph.hpp"
#include "model/mixtral_config.hpp"
#include "model/mixtral_weights.hpp"

namespace dmoe {
class CudaMixtralModel;
struct CudaModelState;
}  // namespace dmoe

namespace dmoe::flow {

// Bytes of one layer's all-reduced gradients in the GPU model: norms, q/k/v/o and the router, f32 (the GPU
// model all-reduces its routers' gradients with the dense ones; the CPU model's EpEngine sums them itself).
int64_t cuda_mixtral_dense_grad_bytes_per_layer(const MixtralConfig& config);

// The merged issue order of the compute and all-to-all tasks the executor's host thread follows: at each point
// the next all-to-all if all its dependencies have been issued, else the next compute task (whose dependencies
// then have been issued: the graph is acyclic with in-order streams). All-to-all first because the host blocks
// inside some compute phases (the send plan's counts), and an all-to-all issued before that wait keeps the link
// busy during it. AR tasks are not in it. Pure function of the graph (host code, unit-tested).
std::vector<int32_t> merged_issue_order(const TaskGraph& graph);

// Where the AR chunks go (docs/flow.md, "One communicator, a static order").
enum class ArComm : uint8_t {
  own,    // a second communicator and stream; chunks under the dynamic priority rule (host polls CUDA events)
  model,  // the model's communicator on the all-to-all stream; chunks at static places (single_comm_issue_order)
};
const char* ar_comm_name(ArComm mode);  // "own", "model"
// The mode for a job: DMOE_FLOW_AR_COMM = `env_value` (nullptr or "" = auto): "own", "model" or "auto". auto:
// model when world > 1 and either the ranks share a GPU or the model's communicator is NVSHMEM (`model_comm_name`
// "nvshmem"; a second NvshmemComm cannot coexist with it, and NCCL cannot run two ranks on one GPU); own otherwise
// (a NCCL model communicator, or W = 1 where nothing is reduced). Bad values throw naming the allowed ones. Every
// rank must decide alike (same environment); the executor's first step checks it across ranks.
ArComm choose_ar_comm(const char* env_value, int32_t world, bool gpus_shared, const std::string& model_comm_name);
// DMOE_FLOW_CHUNKS_PER_GAP = `env_value` (nullptr or "": 1): at most this many AR chunks are placed beside one compute
// task in single_comm_issue_order; 0 = no limit. Must be a decimal integer in [0, 2^31).
int32_t chunks_per_gap_from_env(const char* env_value);

// ArComm::model's host issue order of every task of the graph (compute, all-to-all and AR), a pure function of
// (graph, chunks_per_gap). At each point, the first that applies:
//   1. the next all-to-all, if all its dependencies have been issued;
//   2. the next AR chunk, if all its dependencies have been issued and fewer than chunks_per_gap chunks (0: any
//      number) have been issued since the last compute task;
//   3. the next compute task (its dependencies have been issued: the graph is acyclic with in-order streams);
//   4. the next AR chunk (compute and all-to-all are exhausted: the rest of the AR at the end).
// Without the chunks it is merged_issue_order(graph). The all-to-alls and chunks, in this order, are the model
// communicator's collective order; a chunk is never placed ahead of an all-to-all whose dependencies have been
// issued, and sits where the next all-to-all waits for a compute task that is not yet issued (a gap the
// communicator would idle through). Host code, unit-tested.
std::vector<int32_t> single_comm_issue_order(const TaskGraph& graph, int32_t chunks_per_gap);

class CudaFlowExecutor {
 public:
  // `allreduce_comm`: a communicator of its own over the model's ranks (same rank, same world): ArComm::own, with an
  // all-reduce stream of its own. nullptr: ArComm::model (every collective on the model's communicator, in
  // single_comm_issue_order with chunks_per_gap_from_env(DMOE_FLOW_CHUNKS_PER_GAP)). Creates the streams and the
  // events. Throws in a build without CUDA.
  CudaFlowExecutor(CudaMixtralModel& model, Comm* allreduce_comm);
  ArComm ar_comm() const;
  ~CudaFlowExecutor();
  CudaFlowExecutor(const CudaFlowExecutor&) = delete;
  CudaFlowExecutor& operator=(const CudaFlowExecutor&) = delete;

  // One step: tokens [batch, seq] of this rank split into graph.spec.micro_batches micro-batches of whole
  // sequences; states: R states (resized). Adds the gradients (scaled 1/R) to the model's and all-reduces the
  // replicated ones over ranks. Returns the mean of the micro-batches' losses once the GPU is done. Collective
  // over the model's ranks (the first step of a spec checks with one small all-reduce that every rank has it).
  // timeline (optional): every task's GPU start and end (CUDA events) in ms from the step's start.
  double step(const TaskGraph& graph, const int32_t* tokens, int64_t batch, int64_t seq,
              std::vector<CudaModelState>& states, std::vector<TraceEvent>* timeline = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// This process as one rank of a GPU job (dmoe launch -n W, or alone): `steps` steps (zero_grads + one step) of a
// model with these weights (all experts; each rank takes its share) on this rank's tokens [batch, seq]; step_ms is
// the median over ranks' rank-0 wall time per step after one warm-up step (a barrier before each), timeline rank
// 0's last step (empty on the other ranks).
struct CudaFlowMeasurement {
  GraphSpec spec;
  double step_ms = 0;
  double loss = 0;
  std::vector<TraceEvent> timeline;
  std::optional<ResourceReport> resources;  // with a probe: over the timed steps (the warm-up step left out)
};
// The executor's all-reduce communicator for this process's rank of the job, by choose_ar_comm(DMOE_FLOW_AR_COMM):
// nullptr for ArComm::model (pass it to CudaFlowExecutor: the model's communicator is used); for ArComm::own a local
// one at W = 1, else a second NCCL communicator (refused when ranks share GPUs: NCCL needs one GPU per rank; two
// NVSHMEM communicators would pair their world barriers wrongly across streams). Collective over the job's ranks.
std::unique_ptr<Comm> open_cuda_allreduce_comm(const Comm& model_comm);

struct CudaFlowJob;  // the rank's model, communicators and executor, kept across measurements
class CudaFlowSession {
 public:
  CudaFlowSession(const MixtralConfig& config, const MixtralWeights& full_weights, DType storage, int64_t max_tokens);
  ~CudaFlowSession();
  int32_t rank() const;
  int32_t world() const;
  ArComm ar_comm() const;  // where its executor's AR chunks go
  // probe (optional): started after the warm-up step, finished after the last timed step (core/resource_probe.hpp).
  CudaFlowMeasurement measure(const GraphSpec& spec, const int32_t* tokens, int64_t batch, int64_t seq, int32_t steps,
                              ResourceProbe* probe = nullptr);

 private:
  std::unique_ptr<CudaFlowJob> job_;
};

}  // namespace dmoe::flow
