// simulator.hpp — a discrete-event simulator of one rank's training step under a Flow task graph.
//
// Resources: the compute stream (in-order: compute_order), and the link, on which the all-to-alls (in
// alltoall_order) and the AR chunks (in chunk order) run under CommQueue's priority rule. All ranks are
// taken to be symmetric (same costs), so one rank's timeline is the step's: a collective starts when this
// rank issues it. Per-task cost, for a task covering m of the R micro-batches (m = 1, or R for a whole-batch
// task):
//     compute / all-to-all:  fixed_ms + batch_ms · m / R       (batch_ms: the whole batch's cost, measured)
//     AR chunk of b bytes:   alpha_ms + b / beta               (beta in bytes per ms)
// Output: step time, busy time per resource, and a trace (every task's start and end) that can be written
// as Chrome trace-event JSON (chrome://tracing, Perfetto).
//
// Calibration (issue 15): the cost file is meant to hold measured per-task times (fixed and per-batch parts
// from runs at two R); the numbers in bench/flow/ are illustrative, not measured (docs/flow.md).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "flow/comm_queue.hpp"
#include "flow/task_graph.hpp"

namespace dmoe::flow {

struct TaskCost {
  double fixed_ms = 0;  // per task, whatever its size (launch, latency, synchronisation)
  double batch_ms = 0;  // the part proportional to the tokens, for the whole batch
};

struct CostModel {
  std::array<TaskCost, 8> tasks{};       // indexed by TaskKind (AT, D, E, C, C', E', D', AT')
  double ar_alpha_ms = 0;                 // per AR call
  double ar_bytes_per_ms = 1e7;           // β (1e7 B/ms = 10 GB/s)
  int64_t dense_grad_bytes_per_layer = 0;  // bytes all-reduced per layer
  int64_t head_grad_bytes = 0;             // bytes all-reduced of the head (final norm, lm_head); GraphSpec's
  int64_t embed_grad_bytes = 0;            // bytes all-reduced of the embedding; GraphSpec's
  int32_t layers = 0;                      // from the file; 0 when it has none
  // The file's "note": what the costs are (example.json's say "NOT measured"; fit_cost_model says which ones it could
  // not measure, e.g. the all-reduce at W = 1, where no all-reduce runs). flow simulate / tune print it.
  std::string note;
  TaskCost& operator[](TaskKind k) { return tasks[size_t(k)]; }
  const TaskCost& operator[](TaskKind k) const { return tasks[size_t(k)]; }
};

// {"layers": 12, "dense_grad_bytes_per_layer": 3145728,
//  "tasks": {"AT": {"fixed_ms": 0.05, "batch_ms": 1.2}, "D": …, "E": …, "C": …, "C'": …, "E'": …, "D'": …, "AT'": …},
//  "allreduce": {"alpha_ms": 0.03, "gbytes_per_s": 20}}
// Optional: "head_grad_bytes", "embed_grad_bytes" (the head's and the embedding's all-reduced bytes, laid out
// before and after the layers' as GraphSpec's; 0 when absent — a file without them models the layers' AR only).
// Optional "note": a string, kept in CostModel::note.
// Every task kind is required; unknown keys and negative values are errors naming the key.
CostModel parse_cost_model(const nlohmann::json& j, const std::string& where = "costs");
CostModel load_cost_model(const std::string& path);
void validate(const CostModel& costs);

// The inverse of parse_cost_model (parse_cost_model(cost_model_json(c)) == c).
nlohmann::json cost_model_json(const CostModel& costs);

double task_cost_ms(const Task& task, const CostModel& costs, int32_t micro_batches);
std::vector<double> task_costs_ms(const TaskGraph& graph, const CostModel& costs);

struct TraceEvent {
  int32_t task = 0;
  double start_ms = 0, end_ms = 0;
};

struct SimResult {
  double step_ms = 0;           // last task's end
  double forward_end_ms = 0;    // last forward task's end
  double backward_end_ms = 0;   // last compute / all-to-all task's end (the step without AR)
  double compute_busy_ms = 0, alltoall_busy_ms = 0, allreduce_busy_ms = 0;
  std::vector<TraceEvent> events;  // in start order (ties: compute, all-to-all, AR)
  // The tasks of one stream in the order they started.
  std::vector<int32_t> start_order(const TaskGraph& graph, Stream stream) const;
};

// cost_ms[id] per task (task_costs_ms, or any non-negative costs — the tests use random ones).
SimResult simulate(const TaskGraph& graph, const std::vector<double>& cost_ms, LinkModel link = LinkModel::exclusive);
SimResult simulate(const TaskGraph& graph, const CostModel& costs, LinkModel link = LinkModel::exclusive);
// ArComm::model: the all-to-alls and chunks on one communicator in a fixed order (single_comm_issue_order of
// flow/cuda_executor.hpp), one at a time, each once its dependencies are done (CommQueue's one-communicator mode).
SimResult simulate_one_communicator(const TaskGraph& graph, const std::vector<double>& cost_ms,
                                    const std::vector<int32_t>& order);
SimResult simulate_one_communicator(const TaskGraph& graph, const CostModel& costs, const std::vector<int32_t>& order);

// W ranks with their own costs (cost_ms[rank][task]), collectives matched across ranks: a collective starts
// when every rank has issued it and takes the longest of the ranks' costs. Each rank issues by CommQueue's rule
// with `link`: separate = the all-to-all and AR communicators progress independently (Flow's choice);
// exclusive = one serial communication engine per rank (a rank that issued a chunk cannot issue an all-to-all
// until the chunk completes). With different timings per rank, the latter can deadlock: reported, not thrown.
struct RanksResult {
  bool deadlocked = false;
  std::string deadlock;                            // what each rank was waiting in, when deadlocked
  double step_ms = 0;                              // the last rank's end
  std::vector<std::vector<int32_t>> alltoall_issue, allreduce_issue;  // [rank]: the order each rank issued
};
RanksResult simulate_ranks(const TaskGraph& graph, const std::vector<std::vector<double>>& cost_ms, LinkModel link);

// Calibration: fits a CostModel to measured timelines (each run: a graph and every task's start and end, e.g.
// run_cpu_flow_step's timeline, or a GPU executor's). Per task kind, a least-squares line through the measured
// durations d = fixed_ms + batch_ms · x with x = m / R (so the runs must cover two values of x: two R, or
// pipe-moe's whole-batch tasks beside micro-batch ones); the AR, d = alpha_ms + bytes / beta when the calls
// have two sizes at least and the time grows with them — otherwise alpha_ms = their mean time and beta =
// kUnmeasuredBytesPerMs (bytes free). A kind with no measured task (the CPU executor's empty E, C, E', D')
// costs 0. Negative fitted values (noise) are clamped to 0. Errors name the kind and what is missing. The result's
// note lists what was not measured (the all-reduce's placeholder, kinds at 0, clamped values), so a file written from
// it does not pass a free all-reduce off as a measured one.
constexpr double kUnmeasuredBytesPerMs = 1e15;
struct MeasuredRun {
  const TaskGraph* graph = nullptr;
  std::vector<TraceEvent> timeline;
};
struct FitOptions {
  // Charge each task from when it could have started — its dependencies' and its stream's previous task's end —
  // to its end, not from its measured start. A GPU executor's timeline has gaps there that no task's kernels fill:
  // the host issuing late (its waits for each micro-batch's routing counts and loss). The simulator starts a task
  // the moment it can, so without this its steps come out short by those gaps (the ninth session: −9 to −12 %).
  // AR chunks stay charged as measured: they wait by the priority rule, which the simulator applies itself.
  bool charge_issue_gaps = false;
  // With charge_issue_gaps: the all-to-alls and the AR chunks share one communicator (ArComm::model), so a
  // communication task could start only after the one before it on either stream.
  bool one_communicator = false;
};
CostModel fit_cost_model(const std::vector<MeasuredRun>& runs, const FitOptions& options = {});

// Chrome trace-event JSON: one complete event ("ph": "X") per task, tid 0 compute, 1 all-to-all, 2 AR, all
// under process `pid` (several schedules can share one file, one process each), and a "flow" summary.
nlohmann::json trace_json(const TaskGraph& graph, const SimResult& result, int pid = 0);

}  // namespace dmoe::flow
