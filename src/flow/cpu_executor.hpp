// cpu_executor.hpp — runs one training step of the CPU Mixtral model (src/model/mixtral.*) in a Flow task
// graph's issue orders, on three host threads per rank:
//
//   compute thread     compute_order:  AT  → embed_forward (l = 0) or moe_finish (l − 1) + attention_forward +
//                                            moe_route
//                                      E   → moe_experts
//                                      E'  → moe_backward_experts
//                                      AT' → moe_backward_finish + attention_backward + embed_backward (l = 0)
//   all-to-all thread  alltoall_order: D   → moe_dispatch          C  → moe_combine
//                                      C'  → prelude: l = L−1: moe_finish + head_forward (the loss all-reduce) +
//                                            head_backward; l < L−1: moe_collect_grads(l + 1) (the gate's sum
//                                            over ranks); then moe_backward_combine + moe_backward_dispatch
//                                      D'  → moe_backward_return; after the last task moe_collect_grads(0)
//                      (the caller's thread: every collective on the model's communicator is issued here,
//                      in alltoall_order, so every rank issues them in the same order)
//   all-reduce thread  allreduce_order on its own communicator: chunk k all-reduces bytes [k·Sp, (k+1)·Sp)
//                      of the replicated gradients in the graph's layout (ReplicatedLayout: final norm and
//                      lm_head, layers L−1 … 0, the embedding), once every task writing them is done (the head:
//                      C'[L−1, r] for every r; a layer: its AT'; the embedding: AT'[0]), under the priority rule
//                      (no all-to-all stage ready or running). Nothing is all-reduced outside the graph's tasks.
//
// The MoE stage is cut at its all-to-alls (EpEngine's phases, MixtralModel::moe_route … moe_collect_grads), as on
// the GPU executor: the experts of one micro-batch run on the compute thread while another's rows are exchanged.
// Every task waits for its true dependencies only.
//
// The gradients are bit-identical to running, on the same micro-batches, forward(r) for r = 0..R−1, then
// backward(r, 1/R) for r = 0..R−1, then reduce_grads(): every gradient tensor receives its micro-batches'
// contributions in the same order (each stage kind runs its micro-batches in order on one thread), and the
// chunked all-reduce sums each element over ranks as reduce_grads() does. Not with tied embeddings: there
// head_backward and embed_backward both add into embed_tokens, in another order than the sequential one
// (refused). (The trainer runs its backwards from r = R−1 down; that order is not this one.)
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "comm/comm.hpp"
#include "flow/simulator.hpp"
#include "flow/task_graph.hpp"
#include "model/mixtral.hpp"

namespace dmoe::flow {

// Bytes of one layer's all-reduced gradients (norms, q/k/v/o; not the gate, which EpEngine sums, nor experts).
int64_t mixtral_dense_grad_bytes_per_layer(const MixtralConfig& config);
// Bytes of the head's all-reduced gradients: the final norm and lm_head (f32; the norm only with tied embeddings,
// whose head gradient is the embedding's), and of the embedding's. The same in the GPU model.
int64_t mixtral_head_grad_bytes(const MixtralConfig& config);
int64_t mixtral_embed_grad_bytes(const MixtralConfig& config);
// The spec's replicated-gradient layout for a Mixtral model: dense_grad_bytes_per_layer (the engine's:
// mixtral_dense_grad_bytes_per_layer, or cuda_mixtral_dense_grad_bytes_per_layer for the GPU model, which
// all-reduces its routers with the layers), head_grad_bytes and embed_grad_bytes. The executors refuse another.
void set_mixtral_grad_layout(GraphSpec& spec, const MixtralConfig& config, int64_t dense_grad_bytes_per_layer);

// One step on this rank: tokens [batch, seq], split into graph.spec.micro_batches micro-batches of whole
// sequences; states: R states (resized). Adds the gradients (scaled 1/R) to model.grads() and all-reduces the
// dense ones over ranks through allreduce_comm (a communicator of its own, same ranks as the model's).
// Returns the mean of the micro-batches' losses. Collective over the model's ranks.
// timeline (optional): every task's wall-clock start and end in ms from the step's start, in the order
// the tasks ended (measured per-task times: the input a cost file for the simulator is fitted from).
double run_cpu_flow_step(MixtralModel& model, Comm& allreduce_comm, const TaskGraph& graph, const int32_t* tokens,
                         int64_t batch, int64_t seq, std::vector<ModelState>& states,
                         std::vector<TraceEvent>* timeline = nullptr);

// Measurement on W thread ranks (two ThreadComm groups): `steps` training steps (zero_grads + one
// run_cpu_flow_step) of a model with these weights on tokens [W·batch, seq]; step_ms is rank 0's median wall
// time per step (a barrier before each), timeline rank 0's last step. `on_step` (optional) is called on rank 0
// after each step with the step's number (from 1) and its wall time, for a caller's progress line.
struct CpuFlowMeasurement {
  GraphSpec spec;
  double step_ms = 0;
  std::vector<TraceEvent> timeline;
};
CpuFlowMeasurement measure_cpu_flow(const MixtralConfig& config, const MixtralWeights& weights,
                                    const std::vector<int32_t>& tokens, int64_t batch, int64_t seq, int32_t world,
                                    const GraphSpec& spec, int32_t steps,
                                    const std::function<void(int32_t, double)>& on_step = {});

}  // namespace dmoe::flow
