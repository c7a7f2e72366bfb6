// task_graph.hpp — Flow's static task graph of one training step (issue 15, after FlowMoE), plain data.
//
// One step's batch is split along samples into R micro-batches. Per layer l and micro-batch r:
//   forward:   AT (attention + gate, compute)  D (dispatch all-to-all, comm)  E (experts, compute)
//              C (combine all-to-all, comm)
//   backward:  the mirror image, layer L−1 first: C' (combine backward: the output gradients go to the
//              experts, comm)  E' (experts backward, compute)  D' (dispatch backward: the input gradients
//              come home, comm)  AT' (gate + attention backward, compute; completes layer l's dense
//              gradients once all R micro-batches have run it)
//   AR:        the all-reduce of the replicated (data-parallel) parameters' gradients, one task or chunks of Sp
//              bytes of the gradient buffer laid out in the order backward completes it: the head (final norm +
//              lm_head, complete once C'[L−1, r] has run for every r: the head's backward is folded into C'[L−1]),
//              then layers L−1 … 0 (each complete after its AT' for every r), then the embedding (complete after
//              AT'[0, r] for every r). A chunk depends on every task that writes any of its bytes.
//
// A task lists its true dependencies; each stream also has a fixed issue order (in-order streams, as CUDA
// streams are). Three issue sequences: compute, all-to-all (communicator A) and all-reduce chunks
// (communicator B, its own; docs/flow.md says why). All three are a pure function of the GraphSpec — never
// of timing — so every rank issues the same operations in the same order on each communicator.
//
// Schedules (the ablation of the paper):
//   vanilla     every task waits for the previous one in the sequential order (for r: forward of r; for r:
//               backward of r; then the whole AR), i.e. nothing overlaps;
//   pipe-moe    D/E/C pipelined over R micro-batches, AT on the whole batch; whole AR after backward;
//   pipe-attn   AT pipelined too (AT_{l+1,r} waits only for C_{l,r}); whole AR after backward;
//   chunked-ar  + AR in chunks of chunk_bytes, each available once the layers it covers are complete;
//   tuned       the chunked-ar graph; R and Sp chosen by the tuner (src/flow/tuner.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dmoe::flow {

enum class TaskKind : uint8_t {
  attention_fwd,   // AT
  dispatch_fwd,    // D
  expert_fwd,      // E
  combine_fwd,     // C
  combine_bwd,     // C'
  expert_bwd,      // E'
  dispatch_bwd,    // D'
  attention_bwd,   // AT'
  allreduce,       // AR chunk (or the whole AR)
};
constexpr int kNumTaskKinds = 9;

enum class Stream : uint8_t { compute, alltoall, allreduce };

enum class Schedule : uint8_t { vanilla, pipe_moe, pipe_attn, chunked_ar, tuned };

const char* task_kind_name(TaskKind kind);   // "AT", "D", "E", "C", "C'", "E'", "D'", "AT'", "AR"
const char* stream_name(Stream stream);      // "compute", "alltoall", "allreduce"
const char* schedule_name(Schedule schedule);  // "vanilla", "pipe-moe", "pipe-attn", "chunked-ar", "tuned"
// Parses a schedule name; bad names throw dmoe::Error naming the field and the allowed values.
Schedule parse_schedule(const std::string& name, const char* field = "schedule");
Stream stream_of(TaskKind kind);

constexpr int64_t kDefaultChunkBytes = int64_t(1) << 20;  // the paper's fixed Sp of the chunked-ar ablation step
constexpr int64_t kMaxTasks = int64_t(1) << 22;           // refuse graphs beyond this (a mistyped Sp)
// The largest Sp an option or a tuning file may give: 2^40 bytes (1 TiB), far past any model's replicated gradients (a
// chunk at least as large as them is one all-reduce). Near INT64_MAX the chunk count's (total + Sp - 1) / Sp wrapped
// negative, no all-reduce task was made and the ranks trained apart with rc 0 (G20-3 of the twentieth pass).
constexpr int64_t kMaxChunkBytes = int64_t(1) << 40;
// ceil(a / b) for a >= 0, b >= 1, without the overflow of (a + b - 1) / b.
constexpr int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

struct GraphSpec {
  int32_t layers = 1;
  int32_t micro_batches = 1;                 // R
  Schedule schedule = Schedule::vanilla;
  int64_t dense_grad_bytes_per_layer = 0;    // bytes of layer l's all-reduced gradients (attention, norms, gate)
  int64_t chunk_bytes = kDefaultChunkBytes;  // Sp; used by chunked-ar and tuned only
  int64_t head_grad_bytes = 0;   // final norm + lm_head, all-reduced; laid out first (written by C'[L−1, r]'s head)
  int64_t embed_grad_bytes = 0;  // the embedding, all-reduced; laid out last (written by AT'[0, r])
};
// Field by field (GraphSpec has padding: memcmp of two specs may differ where the fields do not).
bool same_spec(const GraphSpec& a, const GraphSpec& b);

// The replicated-gradient layout the AR chunks cut, in the order backward completes it:
//   [0, head)                          the head (final norm + lm_head)
//   [head, head + L·G)                 layer L−1 first, … layer 0 (G = dense_grad_bytes_per_layer)
//   [head + L·G, head + L·G + embed)   the embedding
struct ReplicatedLayout {
  int64_t head = 0, per_layer = 0, embed = 0;
  int32_t layers = 0;
  explicit ReplicatedLayout(const GraphSpec& spec)
      : head(spec.head_grad_bytes), per_layer(spec.dense_grad_bytes_per_layer), embed(spec.embed_grad_bytes),
        layers(spec.layers) {}
  int64_t layers_begin() const { return head; }
  int64_t embed_begin() const { return head + int64_t(layers) * per_layer; }
  int64_t total() const { return embed_begin() + embed; }
};

// Throws dmoe::Error naming the field, the value and what is allowed.
void validate(const GraphSpec& spec);

struct Task {
  int32_t id = 0;
  TaskKind kind = TaskKind::attention_fwd;
  Stream stream = Stream::compute;
  int32_t layer = 0;         // 0-based; -1 for an AR task
  int32_t micro_batch = 0;   // 0-based; -1 for a task on the whole batch (pipe-moe's AT, AR)
  int32_t chunk = -1;        // AR chunk index (0 = the first bytes backward produces); -1 otherwise
  int64_t bytes = 0;         // AR: the chunk's bytes; 0 otherwise
  int64_t offset = 0;        // AR: the chunk's first byte in the ReplicatedLayout; 0 otherwise
  int32_t num_micro_batches = 1;  // how many micro-batches the task covers (R for whole-batch tasks)
  std::vector<int32_t> deps;      // true dependencies (task ids), sorted, no duplicates
};

struct TaskGraph {
  GraphSpec spec;
  std::vector<Task> tasks;               // tasks[i].id == i
  std::vector<int32_t> compute_order;    // issue order of the compute stream
  std::vector<int32_t> alltoall_order;   // issue order on the all-to-all communicator
  std::vector<int32_t> allreduce_order;  // issue order on the all-reduce communicator (chunk index order)
  int32_t num_forward_tasks = 0;         // tasks of kind AT..C
  // Every all-reduced byte: head + layers + embedding (ReplicatedLayout).
  int64_t total_dense_bytes() const { return ReplicatedLayout(spec).total(); }
  const std::vector<int32_t>& order(Stream s) const;
  std::string describe(int32_t task_id) const;  // e.g. "E'[l=3,r=1]", "AR[chunk 7, 1048576 B]"
};

TaskGraph build_task_graph(const GraphSpec& spec);

// A check of the structural invariants: ids, deps in range and earlier-issued, each task on exactly one
// stream order, the graph of deps plus stream-order edges acyclic. Throws dmoe::Error naming the first
// violation. (build_task_graph's output passes; the tests also feed it broken graphs.)
void check_task_graph(const TaskGraph& graph);

}  // namespace dmoe::flow
