// ablation.cpp — the five schedules and the tuner on the simulator (see ablation.hpp).
#include "flow/ablation.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dmoe::flow {

namespace {
GraphSpec make_spec(Schedule s, int32_t layers, int32_t r, int64_t chunk, const CostModel& c) {
  GraphSpec spec;
  spec.layers = layers;
  spec.micro_batches = r;
  spec.schedule = s;
  spec.dense_grad_bytes_per_layer = c.dense_grad_bytes_per_layer;
  spec.head_grad_bytes = c.head_grad_bytes;
  spec.embed_grad_bytes = c.embed_grad_bytes;
  spec.chunk_bytes = chunk;
  return spec;
}
}  // namespace

double simulated_step_ms(int32_t layers, const CostModel& costs, const TunePoint& p, LinkModel link) {
  return simulate(build_task_graph(make_spec(Schedule::tuned, layers, p.micro_batches, p.chunk_bytes(), costs)), costs,
                  link)
      .step_ms;
}

TunerOptions tuner_options_within_task_limit(int32_t layers, const CostModel& costs, TunerOptions options) {
  const auto tasks = [&](int32_t r, double log2_chunk) {  // as validate(GraphSpec) counts them
    const int64_t total = int64_t(layers) * costs.dense_grad_bytes_per_layer + costs.head_grad_bytes + costs.embed_grad_bytes;
    const int64_t chunk = std::max<int64_t>(1, std::llround(std::exp2(log2_chunk)));
    return 8 * int64_t(layers) * r + (total == 0 ? 0 : ceil_div(total, chunk));
  };
  std::vector<int32_t> kept;
  for (int32_t r : options.micro_batches)
    if (tasks(r, options.log2_chunk_max) <= kMaxTasks) kept.push_back(r);
  std::string all;
  for (int32_t r : options.micro_batches) all += (all.empty() ? "" : ", ") + std::to_string(r);
  DMOE_REQUIRE_INPUT(!kept.empty(), "the tuner's points (R in {{{}}}, Sp up to 2^{:g} bytes) all make task graphs of "
                     "more than {} tasks at {} layers (dense_grad_bytes_per_layer {}): give fewer --layers", all,
                     options.log2_chunk_max, kMaxTasks, layers, costs.dense_grad_bytes_per_layer);
  const int32_t largest = *std::max_element(kept.begin(), kept.end());
  while (options.log2_chunk_min < options.log2_chunk_max && tasks(largest, options.log2_chunk_min) > kMaxTasks)
    options.log2_chunk_min = std::min(options.log2_chunk_max, options.log2_chunk_min + options.log2_chunk_step);
  options.micro_batches = kept;
  return options;
}

TuneRun tune_on_simulator(int32_t layers, const CostModel& costs, int32_t samples, const TunerOptions& options,
                          LinkModel link, const StepDone& step_done) {
  DMOE_REQUIRE(samples >= 1 && samples <= 1000, "--samples {}: must be in [1, 1000]", samples);
  FlowTuner tuner(tuner_options_within_task_limit(layers, costs, options));
  TuneRun run;
  for (int32_t i = 0; i < samples; ++i) {
    // Past the grid's size the tuner could only repeat its best point, each time refitting a larger model: --samples
    // 1000 on the 228-point grid ran ~2.5 h, the last ~770 samples repeating one point.
    if (tuner.exhausted()) break;
    const TunePoint p = tuner.suggest();
    const double y = simulated_step_ms(layers, costs, p, link);
    tuner.observe(p, y);
    run.samples.push_back({p, y});
    if (step_done) step_done(fmt::format("tuner sample {} of {}", i + 1, samples));
  }
  run.best = tuner.best();
  run.best_step_ms = tuner.best_value();
  return run;
}

ScheduleRun run_schedule(Schedule s, int32_t layers, int32_t r, int64_t chunk, const CostModel& costs,
                         int32_t tune_samples, const TunerOptions& options, bool vanilla_with_r, LinkModel link,
                         const StepDone& step_done) {
  GraphSpec spec = make_spec(s, layers, r, chunk, costs);
  if (s == Schedule::vanilla && !vanilla_with_r) spec.micro_batches = 1;
  if (s == Schedule::tuned) {
    const TuneRun t = tune_on_simulator(layers, costs, tune_samples, options, link,
                                        step_done ? StepDone([&](const std::string& what) { step_done("tuned: " + what); })
                                                  : StepDone());
    spec.micro_batches = t.best.micro_batches;
    spec.chunk_bytes = t.best.chunk_bytes();
  }
  ScheduleRun run{spec, simulate(build_task_graph(spec), costs, link)};
  if (step_done) step_done(schedule_name(s));
  return run;
}

std::vector<ScheduleRun> run_ablation(int32_t layers, int32_t r, int64_t chunk, const CostModel& costs,
                                      int32_t tune_samples, const TunerOptions& options, LinkModel link,
                                      const StepDone& step_done) {
  std::vector<ScheduleRun> runs;
  for (Schedule s : {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar, Schedule::tuned})
    runs.push_back(run_schedule(s, layers, r, chunk, costs, tune_samples, options, false, link, step_done));
  return runs;
}

}  // namespace dmoe::flow
