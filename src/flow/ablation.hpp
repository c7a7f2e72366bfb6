// ablation.hpp — the paper's ablation on the simulator: the five schedules from one cost file, and the
// tuner run against the simulator (what `dmoe flow simulate` and `dmoe flow tune` print).
//
//   vanilla      R = 1 (no micro-batches), whole AR after backward
//   pipe-moe     R micro-batches through D/E/C, AT on the whole batch
//   pipe-attn    + AT per micro-batch
//   chunked-ar   + AR in chunks of Sp (default 1 MiB) under the priority rule
//   tuned        chunked-ar at the (Sp, R) the tuner found in `samples` simulated steps
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flow/simulator.hpp"
#include "flow/task_graph.hpp"
#include "flow/tuner.hpp"

namespace dmoe::flow {

struct ScheduleRun {
  GraphSpec spec;
  SimResult result;
};

struct TuneSample {
  TunePoint point;
  double step_ms = 0;
};

struct TuneRun {
  // In the order the tuner asked for them; fewer than asked when every point of the grid was sampled (the tuner
  // stops there: more samples could only repeat its best point).
  std::vector<TuneSample> samples;
  TunePoint best;
  double best_step_ms = 0;
};

// Called after each simulated step with what it was ("pipe-attn", "tuned: sample 3 of 10"): `dmoe flow` prints
// progress from it, since a step at --layers 100000 takes seconds and the ablation's table printed after 49 s of silence.
using StepDone = std::function<void(const std::string& what)>;

// `link`: the simulator's link model for every run (simulate(); exclusive, the paper's, by default).
// The simulated step at (Sp, R) with the tuned schedule.
double simulated_step_ms(int32_t layers, const CostModel& costs, const TunePoint& point,
                         LinkModel link = LinkModel::exclusive);
// The tuner's grid cut to the points whose task graph fits kMaxTasks at `layers` (the R whose graph is too large even
// at the largest Sp are dropped, and the smallest Sp raised until the largest R left fits): at --layers 100000 the grid's
// R = 8 could not be built, and `flow simulate` failed after seconds of work naming "chunk_bytes 7692387 ...,
// micro_batches 8", a point nobody gave. Throws dmoe::Error (input) when no point fits. tune_on_simulator applies it.
TunerOptions tuner_options_within_task_limit(int32_t layers, const CostModel& costs, TunerOptions options);
TuneRun tune_on_simulator(int32_t layers, const CostModel& costs, int32_t samples, const TunerOptions& options = {},
                          LinkModel link = LinkModel::exclusive, const StepDone& step_done = {});

// One schedule (vanilla runs with R = 1 unless vanilla_with_r). schedule tuned: runs the tuner first.
ScheduleRun run_schedule(Schedule schedule, int32_t layers, int32_t micro_batches, int64_t chunk_bytes,
                         const CostModel& costs, int32_t tune_samples = 10, const TunerOptions& options = {},
                         bool vanilla_with_r = false, LinkModel link = LinkModel::exclusive,
                         const StepDone& step_done = {});
// All five, in the ablation's order.
std::vector<ScheduleRun> run_ablation(int32_t layers, int32_t micro_batches, int64_t chunk_bytes, const CostModel& costs,
                                      int32_t tune_samples = 10, const TunerOptions& options = {},
                                      LinkModel link = LinkModel::exclusive, const StepDone& step_done = {});

}  // namespace dmoe::flow
