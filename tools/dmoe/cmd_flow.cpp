// dmoe flow — Flow's schedules on the discrete-event simulator (src/flow/, docs/flow.md).
//
//   dmoe flow simulate --costs bench/flow/example.json [--layers L] [--micro-batches R] [--schedule all|NAME]
//                      [--chunk-bytes Sp] [--samples N] [--seed S] [--trace trace.json] [--json out.json]
//   dmoe flow tune     --costs bench/flow/example.json [--layers L] [--samples N] [--seed S] [--json out.json]
//   dmoe flow measure  --config tiny [--batch 8] [--seq 32] [--world 1] [--schedule pipe-attn] [--measure-r 1,2,4]
//                      [--steps 3] [--costs-out fitted.json] [--json out.json]
//                      [--engine cpu|cuda] [--dtype f32|bf16] [--micro-batches 2] [--trace t.json]
//
// --engine cuda runs the GPU executor (src/flow/cuda_executor.*) in this process as one rank of the job
// (dmoe launch -n W; --world must be 1 or W): --schedule all measures the ablation (vanilla at R = 1, the others
// at --micro-batches); one schedule measures it at every --measure-r and fits costs as the CPU measure does.
//
// measure runs the CPU executor (the Mixtral model's stages in the graph's orders, src/flow/cpu_executor.*) at
// each R, fits a cost file to the timelines of every R but the last (both when two are given) and compares the
// simulator's prediction with the measured step at every R (the last one out of sample); --schedule all measures
// the ablation instead (vanilla at R = 1, the others at --micro-batches; no fit). Every row also gets its peak
// memory and energy per step (core/resource_probe.hpp; "n/a" in the table where not available, the reason below it).
// simulate prints the step time of each schedule (the paper's ablation: vanilla, pipe-moe, pipe-attn,
// chunked-ar, tuned) from per-task costs; tune runs the Bayesian optimiser of (Sp, R) against the simulator
// and compares its best with the best of the whole grid.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include "bench/device_probe.hpp"
#include "commands.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"
#include "core/random.hpp"
#include "core/resource_probe.hpp"
#include "data_dir.hpp"
#include "flow/ablation.hpp"
#include "flow/cpu_executor.hpp"
#include "flow/cuda_executor.hpp"
#include "flow/projection.hpp"
#include "model/mixtral_config.hpp"
#include "model/mixtral_weights.hpp"
#include "options.hpp"

namespace dmoe::cli {

namespace {

using nlohmann::json;

struct FlowOptions {
  std::string action;
  std::string costs_path;
  int32_t layers = 0;
  int32_t micro_batches = 2;
  std::string schedule = "all";
  int64_t chunk_bytes = flow::kDefaultChunkBytes;
  int32_t samples = 10;
  uint64_t seed = 1;
  std::string trace_path, json_path;
  // measure
  std::string model_config = "tiny", costs_out;
  int64_t batch = 8, seq = 32;
  int32_t world = 1, steps = 3;
  std::string measure_r_text = "1,2,4";  // --measure-r as given; parse_measure_r reads it strictly
  bool measure_r_given = false;           // the default's error says it is the default (the user gave no 4)
  std::vector<int32_t> measure_r;
  bool schedule_given = false;
  std::string engine = "cpu", dtype = "f32";
  // simulate, tune, project: the simulator's link model
  std::string link = "exclusive";
  flow::LinkModel link_model = flow::LinkModel::exclusive;
  // project
  std::string cluster;
  int32_t gpus = 16, experts = 0;
  bool experts_given = false;
  bool seq_given = false;
  // seconds between progress lines on stderr (0: after every simulated or measured step); measure's default is 2
  double progress_s = 10;
  bool progress_given = false;
};

// --measure-r: comma-separated values of R, each a decimal integer in [1, 4096]. Read strictly: CLI11's list
// option skipped an empty value ("1,,2" ran as 1,2) and a typo deserves an error, not a guess.
std::vector<int32_t> parse_measure_r(const std::string& text) {
  std::vector<int32_t> out;
  size_t begin = 0;
  while (true) {
    const size_t end = text.find(',', begin);
    const std::string v = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
    DMOE_REQUIRE_INPUT(!v.empty() && v.size() <= 4 && v.find_first_not_of("0123456789") == std::string::npos &&
                           std::stoi(v) >= 1 && std::stoi(v) <= 4096,
                       "--measure-r {}: '{}' is not a value of R (allowed: integers in [1, 4096] separated by single "
                       "commas, e.g. 1,2,4)", text, v);
    out.push_back(std::stoi(v));
    if (end == std::string::npos) break;
    begin = end + 1;
  }
  return out;
}

flow::LinkModel parse_link(const std::string& s) {
  if (s == "exclusive") return flow::LinkModel::exclusive;
  if (s == "separate") return flow::LinkModel::separate;
  if (s == "shared") return flow::LinkModel::shared;
  DMOE_FAIL_INPUT("--link {}: allowed: exclusive (one collective on the link at a time, the paper's model), separate "
                  "(the two communicators overlap for free), shared (they overlap and split the bandwidth)", s);
}

void write_json(const std::string& path, const json& j, const char* what) {
  check_output_file(path, what);
  // Text fields only (a note naming a model file): a byte that is not UTF-8 becomes U+FFFD, not a late type_error.
  write_file_atomically(path, j.dump(1, ' ', false, json::error_handler_t::replace) + "\n");
}

// An action's output files (--costs-out, --trace, --json), written together: each is checked again and goes to its
// temporary as it is made, and commit() renames them all into place, or none (OutputFileSet). Written one by one,
// `flow measure --costs-out c --trace t --json j` with j failing at the end left c and t replaced and j not, the error
// naming only j: a set of two runs (G20-5, twentieth pass). The "wrote" lines are printed once all are in place.
class FlowOutputs {
 public:
  void add(const std::string& path, const json& j, const char* option, std::string wrote) {
    check_output_file(path, option);
    files_.write(path, j.dump(1, ' ', false, json::error_handler_t::replace) + "\n");  // as write_json's
    wrote_.push_back(std::move(wrote));
  }
  void commit() {
    files_.commit();
    for (const std::string& line : wrote_) std::printf("%s\n", line.c_str());
    wrote_.clear();
  }

 private:
  OutputFileSet files_;
  std::vector<std::string> wrote_;
};

json run_json(const flow::ScheduleRun& run) {
  const flow::SimResult& r = run.result;
  return {{"schedule", flow::schedule_name(run.spec.schedule)},
          {"micro_batches", run.spec.micro_batches},
          {"chunk_bytes", run.spec.chunk_bytes},
          {"step_ms", r.step_ms},
          {"forward_end_ms", r.forward_end_ms},
          {"backward_end_ms", r.backward_end_ms},
          {"compute_busy_ms", r.compute_busy_ms},
          {"alltoall_busy_ms", r.alltoall_busy_ms},
          {"allreduce_busy_ms", r.allreduce_busy_ms}};
}

// A fitted cost file's note: how it was made, then what the fit could not measure (at W = 1 the all-reduce moves no
// data and its bandwidth is a placeholder: the file said nothing, and flow simulate then took the all-reduce as free).
// The same is printed when the file is written.
std::string fitted_note(const std::string& how, const flow::CostModel& fit) {
  if (fit.note.empty()) return how;
  std::printf("note: the fitted costs: %s\n", fit.note.c_str());
  return how + "; " + fit.note;
}

// A cost file's note (what its costs are, what was not measured), above the results computed from it.
void print_costs_note(const flow::CostModel& costs, const std::string& path) {
  if (!costs.note.empty()) std::printf("costs note (%s): %s\n", path.c_str(), costs.note.c_str());
}

bool chunked(flow::Schedule s) { return s == flow::Schedule::chunked_ar || s == flow::Schedule::tuned; }

// The samples the tuner will take, with notes on stderr when that is not --samples or takes long. The tuner stops
// once every point of its grid (at this many layers) is sampled: --samples 1000 on the 228-point grid ran ~2.5 h, its
// last ~770 samples repeating the best point. It refits its Gaussian process at every sample, measured on the 2-core
// CI machine (bench/flow/example.json; the simulated steps are a small part): ~11 s at 160 samples, ~49 s at 240,
// growing as samples^3.65.
int32_t planned_tuner_samples(int32_t layers, const flow::CostModel& costs, const flow::TunerOptions& tuner,
                              int32_t asked, const char* what) {
  const flow::FlowTuner grid(flow::tuner_options_within_task_limit(layers, costs, tuner));
  const int32_t samples = int32_t(std::min<size_t>(size_t(asked), grid.candidates().size()));
  if (samples < asked)
    std::fprintf(stderr, "note: --samples %d: the tuner's grid has %zu points at %d layers and it stops once every one "
                 "is sampled (more could only repeat its best), so %s takes at most %d\n", asked,
                 grid.candidates().size(), layers, what, samples);
  const double seconds = 49.0 * std::pow(double(samples) / 240.0, 3.65);
  if (seconds > 10)
    std::fprintf(stderr, "note: %s with %d tuner samples may take about %.0f s%s before it prints (the tuner's fit grows "
                 "as samples^3.65: ~11 s at 160, ~49 s at 240 on a 2-core machine)\n", what, samples, seconds,
                 seconds > 3600 ? fmt::format(" ({:.1f} h)", seconds / 3600).c_str() : "");
  return samples;
}

// Progress of a long simulation on stderr, at most one line per `every_s` seconds (none in the first ones): at
// --layers 100000 each simulated step takes seconds and `flow simulate` was silent for 49 s, `flow tune` (with its
// grid of ~230 simulations) for minutes. The estimate of what is left assumes the steps still to come cost as much as
// the ones done (the tuner's fit grows with its samples: it is an underestimate at hundreds of samples).
class SimulationProgress {
 public:
  SimulationProgress(std::string what, int64_t total, double every_s)
      : what_(std::move(what)), total_(total), every_s_(every_s) {}
  void operator()(const std::string& last) {
    ++done_;
    const double t = seconds_since(start_);
    if (t < next_s_) return;
    next_s_ = t + every_s_;
    std::fprintf(stderr, "%s: %lld of %lld simulated steps after %.1f s (last: %s); about %.0f s left\n", what_.c_str(),
                 (long long)done_, (long long)total_, t, last.c_str(),
                 done_ >= total_ ? 0.0 : t / double(done_) * double(total_ - done_));
  }
  flow::StepDone callback() {
    return [this](const std::string& last) { (*this)(last); };
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::string what_;
  int64_t total_ = 0, done_ = 0;
  double every_s_ = 10;
  double next_s_ = every_s_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// `outputs`: files of the action written before (project's --costs-out), committed with this one's; null: none.
int simulate_command(const FlowOptions& o, const flow::CostModel& costs, int32_t layers,
                     FlowOutputs* outputs = nullptr) {
  FlowOutputs own;
  if (!outputs) outputs = &own;
  std::vector<flow::ScheduleRun> runs;
  flow::TunerOptions tuner;
  tuner.seed = o.seed;
  if (o.action == "project") {  // a projected R must split each GPU's --batch sequences (as train --schedule tuned)
    tuner.micro_batches.clear();
    for (int32_t r : {1, 2, 4, 8})
      if (o.batch % r == 0) tuner.micro_batches.push_back(r);
  }
  const bool tuned_row = o.schedule == "all" || o.schedule == "tuned";
  const int32_t samples = tuned_row ? planned_tuner_samples(layers, costs, tuner, o.samples, "the tuned row") : 0;
  // The ablation: four schedules and the tuned row (its samples, then its best point).
  const int64_t steps = o.schedule == "all" ? 4 + samples + 1 : o.schedule == "tuned" ? samples + 1 : 1;
  SimulationProgress progress("flow " + o.action, steps, o.progress_s);
  if (o.schedule == "all") {
    runs = flow::run_ablation(layers, o.micro_batches, o.chunk_bytes, costs, o.samples, tuner, o.link_model,
                              progress.callback());
  } else {
    const flow::Schedule s = flow::parse_schedule(o.schedule, "--schedule");
    runs.push_back(flow::run_schedule(s, layers, o.micro_batches, o.chunk_bytes, costs, o.samples, tuner, true,
                                      o.link_model, progress.callback()));
  }
  std::printf("flow %s: %d layers, %lld dense gradient bytes per layer, %lld of the head, %lld of the embedding, costs "
              "%s, link %s (one rank's timeline; ranks symmetric)\n",
              o.action.c_str(), layers, (long long)costs.dense_grad_bytes_per_layer, (long long)costs.head_grad_bytes,
              (long long)costs.embed_grad_bytes, o.costs_path.c_str(), o.link.c_str());
  std::printf("%-11s %3s %10s %10s %8s %8s %9s %9s %9s %9s %9s\n", "schedule", "R", "Sp KiB", "step ms", "speedup",
              "vs prev", "fwd ms", "bwd ms", "compute", "a2a", "AR");
  const double base = runs.front().result.step_ms;
  double previous = base;
  for (const flow::ScheduleRun& run : runs) {
    const flow::SimResult& r = run.result;
    const std::string sp = chunked(run.spec.schedule) ? fmt::format("{:.0f}", double(run.spec.chunk_bytes) / 1024) : "-";
    std::printf("%-11s %3d %10s %10.2f %7.2fx %7.1f%% %9.2f %9.2f %9.2f %9.2f %9.2f\n",
                flow::schedule_name(run.spec.schedule), run.spec.micro_batches, sp.c_str(), r.step_ms,
                base / r.step_ms, 100.0 * (r.step_ms - previous) / previous, r.forward_end_ms, r.backward_end_ms,
                r.compute_busy_ms, r.alltoall_busy_ms, r.allreduce_busy_ms);
    previous = r.step_ms;
  }
  std::printf("speedup = first row's step / this step; vs prev = change from the row above; compute/a2a/AR = busy "
              "ms of the compute stream, the all-to-alls and the all-reduce\n");
  if (o.action != "project") print_costs_note(costs, o.costs_path);
  if (!o.trace_path.empty()) {
    // The trace is built as a JSON document before it is written: ~2 KB of memory per event (measured: 2000 layers of
    // bench/flow/example.json, 144093 events, 282 MB above the same run without --trace; the file takes ~240 B per
    // event). --layers 20000 under a 3 GB limit ended in the last-resort "out of host memory (std::bad_alloc)",
    // whose hint named the model's sizes, not --layers; now the estimate is checked first and says what to change.
    size_t events = 0;
    for (const flow::ScheduleRun& run : runs) events += run.result.events.size();
    require_host_memory(2200.0 * double(events), fmt::format("flow {} --trace ({} events of {} layers, as a JSON "
                        "document of ~2 KB per event)", o.action, events, layers),
                        "--layers, --micro-batches, or leave out --trace (the table above is complete)");
    json trace = {{"traceEvents", json::array()}, {"displayTimeUnit", "ms"}, {"flow", json::array()}};
    for (size_t i = 0; i < runs.size(); ++i) {
      const json t = flow::trace_json(flow::build_task_graph(runs[i].spec), runs[i].result, int(i));
      for (const json& e : t.at("traceEvents")) trace["traceEvents"].push_back(e);
      trace["flow"].push_back(t.at("flow"));
    }
    outputs->add(o.trace_path, trace, "--trace", fmt::format("wrote {} (Chrome trace events: chrome://tracing or "
                                                             "ui.perfetto.dev; one process per schedule)", o.trace_path));
  }
  if (!o.json_path.empty()) {
    json out = {{"layers", layers}, {"costs", path_for_json(o.costs_path)}, {"link", o.link}, {"runs", json::array()}};
    if (o.action == "project") out["projected_costs"] = flow::cost_model_json(costs);
    for (const flow::ScheduleRun& run : runs) out["runs"].push_back(run_json(run));
    outputs->add(o.json_path, out, "--json", "wrote " + o.json_path);
  }
  outputs->commit();
  return 0;
}

// dmoe flow project: the cost model from a model config, a batch and a cluster file (flow/projection.hpp), then the
// ablation on it as flow simulate prints it.
int project_command(FlowOptions o) {
  flow::ProjectionSpec spec;
  spec.model = load_mixtral_config(find_model_config_file(o.model_config));
  if (o.experts_given) {  // "default: the config's" when not given; a value given is taken as written
    DMOE_REQUIRE_INPUT(o.experts >= spec.model.num_experts_per_tok, "--experts {}: must be >= num_experts_per_tok = {} "
                       "of --config {} (and a multiple of --gpus)", o.experts, spec.model.num_experts_per_tok,
                       o.model_config);
    spec.model.num_local_experts = o.experts;
  }
  // --seq against the model, as measure checks it: `--config tiny` (256 positions) was projected at 1024 tokens, and
  // --seq 4000000000000 printed a 2.5e17 ms step, rc 0.
  if (!o.seq_given) o.seq = std::min<int64_t>(1024, spec.model.max_position_embeddings);
  spec.model.check_sequence(o.seq, "flow project: --seq");
  spec.batch = o.batch;
  spec.seq = o.seq;
  spec.gpus = o.gpus;
  DMOE_REQUIRE_INPUT(o.dtype == "bf16" || o.dtype == "f32", "--dtype {}: allowed: bf16, f32", o.dtype);
  spec.act_bytes = o.dtype == "bf16" ? 2 : 4;
  DMOE_REQUIRE_INPUT(!o.cluster.empty(), "--cluster: required for flow project (a cluster JSON file, or a named one "
                     "from bench/flow/clusters such as h200)");
  const std::string cluster_path = find_named_json(o.cluster, "bench/flow/clusters", "cluster file");
  const flow::ClusterModel cluster = flow::load_cluster_model(cluster_path);
  const flow::CostModel costs = flow::project_costs(spec, cluster);
  std::printf("flow project: %s, E = %d, %lld x %lld tokens per GPU (%s on the wire), %d GPUs in nodes of %d, cluster "
              "%s (%s)\n",
              o.model_config.c_str(), spec.model.num_local_experts, (long long)spec.batch, (long long)spec.seq,
              o.dtype.c_str(), spec.gpus, std::min(cluster.gpus_per_node, spec.gpus), cluster.name.c_str(),
              cluster_path.c_str());
  std::printf("per-task costs (ms per call + ms for the whole batch): AT %.3f + %.3f, E %.3f + %.3f, D/C/C'/D' %.3f + "
              "%.3f each, AT' %.3f + %.3f, E' %.3f + %.3f; %s\n",
              costs[flow::TaskKind::attention_fwd].fixed_ms, costs[flow::TaskKind::attention_fwd].batch_ms,
              costs[flow::TaskKind::expert_fwd].fixed_ms, costs[flow::TaskKind::expert_fwd].batch_ms,
              costs[flow::TaskKind::dispatch_fwd].fixed_ms, costs[flow::TaskKind::dispatch_fwd].batch_ms,
              costs[flow::TaskKind::attention_bwd].fixed_ms, costs[flow::TaskKind::attention_bwd].batch_ms,
              costs[flow::TaskKind::expert_bwd].fixed_ms, costs[flow::TaskKind::expert_bwd].batch_ms,
              // One GPU all-reduces nothing: its placeholder bandwidth printed as "1e+09 GB/s effective".
              spec.gpus > 1 ? fmt::format("AR {:.3f} ms + {:.3g} GB/s effective", costs.ar_alpha_ms,
                                          costs.ar_bytes_per_ms / 1e6).c_str()
                            : "no all-reduce (one GPU)");
  FlowOutputs outputs;  // --costs-out with simulate's --trace and --json, all or none
  if (!o.costs_out.empty())
    outputs.add(o.costs_out, flow::cost_model_json(costs), "--costs-out",
                fmt::format("wrote {} (a cost file for flow simulate / tune)", o.costs_out));
  o.costs_path = "projected from " + cluster_path;
  return simulate_command(o, costs, costs.layers, &outputs);
}

int tune_command(const FlowOptions& o, const flow::CostModel& costs, int32_t layers) {
  flow::TunerOptions tuner;
  tuner.seed = o.seed;
  // The grid the tuner searched (cut to the graphs that can be built at this many layers): every point of it is
  // simulated too, after the tuner's samples, to say how far the tuner's best is from the grid's.
  const flow::TunerOptions searched = flow::tuner_options_within_task_limit(layers, costs, tuner);
  const flow::FlowTuner grid(searched);
  const int32_t taken = planned_tuner_samples(layers, costs, tuner, o.samples, "flow tune");
  SimulationProgress progress("flow tune", taken + int64_t(grid.candidates().size()), o.progress_s);
  const flow::TuneRun run = flow::tune_on_simulator(layers, costs, o.samples, tuner, o.link_model, progress.callback());
  tuner = searched;
  std::printf("flow tune: %d layers, costs %s; Bayesian optimisation (GP, Matern-5/2, EI) of log2(Sp) in [%g, %g] x "
              "R in {%s}, seed %llu\n",
              layers, o.costs_path.c_str(), tuner.log2_chunk_min, tuner.log2_chunk_max,
              fmt::format("{}", fmt::join(tuner.micro_batches, ", ")).c_str(), (unsigned long long)o.seed);
  print_costs_note(costs, o.costs_path);
  std::printf("%6s %8s %10s %3s %10s %10s\n", "sample", "log2 Sp", "Sp KiB", "R", "step ms", "best ms");
  double best = std::numeric_limits<double>::infinity();
  json samples = json::array();
  for (size_t i = 0; i < run.samples.size(); ++i) {
    const flow::TuneSample& s = run.samples[i];
    best = std::min(best, s.step_ms);
    std::printf("%6zu %8.3f %10.0f %3d %10.3f %10.3f\n", i + 1, s.point.log2_chunk_bytes,
                double(s.point.chunk_bytes()) / 1024, s.point.micro_batches, s.step_ms, best);
    samples.push_back({{"log2_chunk_bytes", s.point.log2_chunk_bytes}, {"chunk_bytes", s.point.chunk_bytes()},
                       {"micro_batches", s.point.micro_batches}, {"step_ms", s.step_ms}});
  }
  // The whole grid, for reference (what the tuner's samples save).
  flow::TunePoint grid_point;
  double grid_best = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < grid.candidates().size(); ++i) {
    const flow::TunePoint& p = grid.candidates()[i];
    const double v = flow::simulated_step_ms(layers, costs, p, o.link_model);
    if (v < grid_best) grid_best = v, grid_point = p;
    progress(fmt::format("grid point {} of {}", i + 1, grid.candidates().size()));
  }
  std::printf("best: Sp = %.0f KiB (log2 %.3f), R = %d: %.3f ms; the grid's best (%zu simulations): %.3f ms at Sp = "
              "%.0f KiB, R = %d (tuner %.2f%% above)\n",
              double(run.best.chunk_bytes()) / 1024, run.best.log2_chunk_bytes, run.best.micro_batches,
              run.best_step_ms, grid.candidates().size(), grid_best, double(grid_point.chunk_bytes()) / 1024,
              grid_point.micro_batches, 100.0 * (run.best_step_ms - grid_best) / grid_best);
  if (!o.json_path.empty()) {
    write_json(o.json_path,
               {{"layers", layers}, {"costs", path_for_json(o.costs_path)}, {"seed", o.seed}, {"samples", samples},
                {"best", {{"chunk_bytes", run.best.chunk_bytes()}, {"micro_batches", run.best.micro_batches},
                          {"step_ms", run.best_step_ms}}},
                {"grid_best", {{"chunk_bytes", grid_point.chunk_bytes()}, {"micro_batches", grid_point.micro_batches},
                               {"step_ms", grid_best}, {"simulations", grid.candidates().size()}}}},
               "--json");
    std::printf("wrote %s\n", o.json_path.c_str());
  }
  return 0;
}

// A reading as a table cell: MiB or J with three significant digits, or "n/a" (the reason is printed below the table).
std::string cell(const ProbeReading& r) {
  if (!r.value) return "n/a";
  return r.unit == "bytes" ? fmt::format("{:.1f}", *r.value / double(1 << 20)) : fmt::format("{:.4g}", *r.value);
}

// Peak host memory above what was resident at the start of the interval (MiB), or "n/a".
std::string added_cell(const ResourceReport& r) {
  if (!r.host_peak_memory.value || !r.host_resident_at_start.value) return "n/a";
  return fmt::format("{:.1f}", (*r.host_peak_memory.value - *r.host_resident_at_start.value) / double(1 << 20));
}

// Under a table: each run's readings with what they cover (or why they are missing).
void print_resource_labels(const std::vector<std::string>& names, const std::vector<ResourceReport>& reports) {
  for (size_t i = 0; i < reports.size(); ++i) {
    std::printf("%s:\n", names[i].c_str());
    for (const std::string& l : reports[i].lines()) std::printf("  %s\n", l.c_str());
  }
}

// The trace of measured timelines (one process per run), as the simulator's --trace writes it.
json measured_trace(const std::vector<std::pair<flow::GraphSpec, std::vector<flow::TraceEvent>>>& runs) {
  json trace = {{"traceEvents", json::array()}, {"displayTimeUnit", "ms"}, {"flow", json::array()}};
  for (size_t i = 0; i < runs.size(); ++i) {
    flow::SimResult r;
    r.events = runs[i].second;
    for (const flow::TraceEvent& e : r.events) r.step_ms = std::max(r.step_ms, e.end_ms);
    const json t = flow::trace_json(flow::build_task_graph(runs[i].first), r, int(i));
    for (const json& e : t.at("traceEvents")) trace["traceEvents"].push_back(e);
    trace["flow"].push_back(t.at("flow"));
  }
  return trace;
}

// The graphs flow measure runs: --schedule all's ablation (vanilla at R = 1, the others at --micro-batches), or one
// schedule at every --measure-r. dense_bytes: one layer's all-reduced gradients in the engine's layout (the head's
// and the embedding's are the same on both engines: set_mixtral_grad_layout).
std::vector<flow::GraphSpec> measure_specs(const FlowOptions& o, const MixtralConfig& c, flow::Schedule schedule,
                                           bool ablation, int64_t dense_bytes) {
  auto spec_of = [&](flow::Schedule sch, int32_t r) {
    flow::GraphSpec spec;
    spec.layers = c.num_hidden_layers;
    spec.micro_batches = r;
    spec.schedule = sch;
    flow::set_mixtral_grad_layout(spec, c, dense_bytes);
    spec.chunk_bytes = o.chunk_bytes;
    return spec;
  };
  std::vector<flow::GraphSpec> specs;
  if (ablation) {
    specs.push_back(spec_of(flow::Schedule::vanilla, 1));
    for (flow::Schedule sch : {flow::Schedule::pipe_moe, flow::Schedule::pipe_attn, flow::Schedule::chunked_ar})
      specs.push_back(spec_of(sch, o.micro_batches));
  } else {
    for (int32_t r : o.measure_r) specs.push_back(spec_of(schedule, r));
  }
  return specs;
}

int measure_command(const FlowOptions& o) {
  const MixtralConfig c = load_mixtral_config(find_model_config_file(o.model_config));
  // The executors' own check said so with a source location (G11 of the sixteenth pass), as an internal error.
  DMOE_REQUIRE_INPUT(!c.tie_word_embeddings, "flow measure --config {}: tie_word_embeddings = true; the Flow executors "
                     "need untied embeddings (train --schedule refuses them too): set it to false", o.model_config);
  const bool ablation = o.schedule_given && o.schedule == "all";
  const flow::Schedule schedule =
      flow::parse_schedule(o.schedule_given && !ablation ? o.schedule : "pipe-attn", "--schedule");
  DMOE_REQUIRE_INPUT(ablation || o.measure_r.size() >= 2,
                     "--measure-r: give at least two values of R (the fit needs two), or --schedule all");
  // One message per option: "--world 1 (>= 1), --batch 0 (>= 1)" did not say which was wrong (G22B-7 (a)).
  DMOE_REQUIRE_INPUT(o.world >= 1, "--world {} is invalid: must be >= 1 (ranks)", o.world);
  DMOE_REQUIRE_INPUT(o.batch >= 1, "--batch {} is invalid: must be >= 1 (sequences per rank)", o.batch);
  // One range for --seq, [2, max_position_embeddings] (the loss predicts each next token): --seq 1 said "(>= 2)",
  // --seq 1000 "outside [1, max_position_embeddings = 256]" (G19-7 of the nineteenth bad-input pass).
  c.check_sequence(o.seq, "flow measure: --seq", 2);  // was "sequence length 300 is outside ...", the option unnamed
  DMOE_REQUIRE_INPUT(o.steps >= 1, "--steps {}: must be >= 1", o.steps);
  DMOE_REQUIRE_INPUT(c.num_local_experts % o.world == 0,
                     "--world {}: must divide num_local_experts = {} of --config {} (each rank owns E/W experts)",
                     o.world, c.num_local_experts, o.model_config);
  if (ablation) {
    DMOE_REQUIRE_INPUT(o.micro_batches >= 1 && o.batch % o.micro_batches == 0,
                       "--micro-batches {}: must be >= 1 and divide --batch {}", o.micro_batches, o.batch);
    DMOE_REQUIRE_INPUT(o.costs_out.empty(), "--costs-out: needs one --schedule measured at several --measure-r (not all)");
  } else {
    for (int32_t r : o.measure_r)
      DMOE_REQUIRE_INPUT(r >= 1 && o.batch % r == 0, "--measure-r {}: must divide --batch {} (sequences per rank){}", r,
                         o.batch, o.measure_r_given ? "" : fmt::format("; {} is the default --measure-r {}: give "
                         "--measure-r with divisors of --batch, or a --batch that {} divides", r, o.measure_r_text, r));
  }
  require_host_memory(model_activation_bytes_lower_bound(double(o.world) * double(o.batch) * double(o.seq),
                                                         c.vocab_size, c.hidden_size, c.num_hidden_layers),
                      fmt::format("flow measure ({} ranks x batch {} x seq {} on the CPU executor: at least the logits, "
                                  "their gradient and two activations per layer)", o.world, o.batch, o.seq),
                      std::string("--batch, --seq, --world, or ") + kModelSizes);
  const MixtralWeights w = random_mixtral_weights(c, 1);
  Rng rng(2);
  std::vector<int32_t> tokens(size_t(o.world * o.batch * o.seq));
  for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(c.vocab_size));
  const std::vector<flow::GraphSpec> specs =
      measure_specs(o, c, schedule, ablation, flow::mixtral_dense_grad_bytes_per_layer(c));
  std::vector<flow::CpuFlowMeasurement> runs;
  std::vector<flow::TaskGraph> graphs;
  std::vector<ResourceReport> resources;
  std::vector<std::string> run_names;
  // A long measurement is not silent: once it has run for 2 s, a line every 2 s with the steps done and an
  // estimate of the time left (from the mean step so far; later runs take longer or shorter).
  const auto start = std::chrono::steady_clock::now();
  double last_report = 0, total_ms = 0;
  int32_t done = 0;
  std::string current;
  const int32_t all_steps = o.steps * int32_t(specs.size());
  auto progress = [&](int32_t step, double ms) {
    ++done;
    total_ms += ms;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double every = o.progress_given ? o.progress_s : 2.0;
    if (elapsed < every || elapsed - last_report < every) return;
    last_report = elapsed;
    std::fprintf(stderr, "  flow measure: %s, step %d/%d (%.0f ms); %d of %d steps in %.0f s, ~%.0f s left\n",
                 current.c_str(), step, o.steps, ms, done, all_steps, elapsed,
                 total_ms / done * (all_steps - done) * 1e-3);
  };
  for (const flow::GraphSpec& spec : specs) {
    current = fmt::format("{} R = {}", flow::schedule_name(spec.schedule), spec.micro_batches);
    // Peak memory and energy around the whole measurement (core/resource_probe.hpp): measure_cpu_flow builds the
    // thread ranks' models inside, so the interval holds that set-up as well as the steps.
    ResourceProbeOptions po;
    po.scope = fmt::format("this process: its {} thread ranks, their models built inside the interval, and the "
                           "command's full copy of the weights", o.world);
    ResourceProbe probe(po);
    probe.start();
    runs.push_back(flow::measure_cpu_flow(c, w, tokens, o.batch, o.seq, o.world, spec, o.steps, progress));
    ResourceReport rep = probe.finish(o.steps);
    if (rep.cpu_energy_per_step.value)
      rep.cpu_energy_per_step.what += "; the interval also holds the models' set-up (energy over it / steps)";
    resources.push_back(rep);
    graphs.push_back(flow::build_task_graph(spec));
    run_names.push_back(fmt::format("{} R = {}", flow::schedule_name(spec.schedule), spec.micro_batches));
  }
  std::printf("flow measure: CPU executor, model %s (%d layers), %lld sequences x %lld tokens per rank, W = %d, "
              "median of %d steps",
              o.model_config.c_str(), c.num_hidden_layers, (long long)o.batch, (long long)o.seq, o.world, o.steps);
  json rows = json::array();
  std::optional<flow::CostModel> fit;
  if (ablation) {
    std::printf("; ablation (vanilla at R = 1)\n%-11s %3s %12s %8s %14s %13s %11s\n", "schedule", "R",
                "measured ms", "speedup", "peak host MiB", "above start", "CPU J/step");
    for (size_t i = 0; i < runs.size(); ++i) {
      std::printf("%-11s %3d %12.2f %7.2fx %14s %13s %11s\n", flow::schedule_name(specs[i].schedule),
                  specs[i].micro_batches, runs[i].step_ms, runs[0].step_ms / runs[i].step_ms,
                  cell(resources[i].host_peak_memory).c_str(), added_cell(resources[i]).c_str(),
                  cell(resources[i].cpu_energy_per_step).c_str());
      rows.push_back({{"schedule", flow::schedule_name(specs[i].schedule)}, {"micro_batches", specs[i].micro_batches},
                      {"chunk_bytes", specs[i].chunk_bytes}, {"measured_ms", runs[i].step_ms},
                      {"resources", resources[i].to_json()}});
    }
  } else {
    // Fit on every R but the last (on both when there are two), so the last row is a prediction out of sample.
    const size_t num_fit = runs.size() > 2 ? runs.size() - 1 : runs.size();
    std::vector<flow::MeasuredRun> measured;
    for (size_t i = 0; i < num_fit; ++i) measured.push_back({&graphs[i], runs[i].timeline});
    fit = flow::fit_cost_model(measured);
    std::string fitted;
    for (size_t i = 0; i < num_fit; ++i) fitted += fmt::format("{}{}", i ? ", " : "", o.measure_r[i]);
    std::printf(", schedule %s; costs fitted to R = %s, simulator with separate communicators\n",
                flow::schedule_name(schedule), fitted.c_str());
    std::printf("%3s %12s %13s %8s %14s %13s %11s\n", "R", "measured ms", "predicted ms", "error", "peak host MiB",
                "above start", "CPU J/step");
    for (size_t i = 0; i < runs.size(); ++i) {
      const double predicted = flow::simulate(graphs[i], *fit, flow::LinkModel::separate).step_ms;
      std::printf("%3d %12.2f %13.2f %7.1f%% %14s %13s %11s\n", o.measure_r[i], runs[i].step_ms, predicted,
                  100.0 * (predicted - runs[i].step_ms) / runs[i].step_ms, cell(resources[i].host_peak_memory).c_str(),
                  added_cell(resources[i]).c_str(), cell(resources[i].cpu_energy_per_step).c_str());
      rows.push_back({{"micro_batches", o.measure_r[i]}, {"measured_ms", runs[i].step_ms}, {"predicted_ms", predicted},
                      {"resources", resources[i].to_json()}});
    }
  }
  print_resource_labels(run_names, resources);
  FlowOutputs outputs;  // --costs-out, --trace and --json: all or none
  if (!o.costs_out.empty()) {
    json costs = flow::cost_model_json(*fit);
    costs["note"] = fitted_note(fmt::format("fitted by dmoe flow measure (CPU executor, model {}, batch {} x {}, W = {}, "
                                            "schedule {})", o.model_config, o.batch, o.seq, o.world,
                                            flow::schedule_name(schedule)), *fit);
    outputs.add(o.costs_out, costs, "--costs-out", "wrote " + o.costs_out);
  }
  if (!o.trace_path.empty()) {  // rank 0's last step of each run, measured on the executor's threads
    std::vector<std::pair<flow::GraphSpec, std::vector<flow::TraceEvent>>> traced;
    for (size_t i = 0; i < runs.size(); ++i) traced.push_back({specs[i], runs[i].timeline});
    outputs.add(o.trace_path, measured_trace(traced), "--trace",
                fmt::format("wrote {} (rank 0's last step of each run; Chrome trace events, or bench/plot_trace.py "
                            "for a Gantt PNG)", o.trace_path));
  }
  if (!o.json_path.empty()) {
    json out = {{"engine", "cpu"}, {"model", o.model_config}, {"world", o.world},
                {"schedule", ablation ? "all" : flow::schedule_name(schedule)}, {"rows", rows}};
    if (fit) out["costs"] = flow::cost_model_json(*fit);
    outputs.add(o.json_path, out, "--json", "wrote " + o.json_path);
  }
  outputs.commit();
  return 0;
}

int measure_cuda_command(const FlowOptions& o) {
  const MixtralConfig c = load_mixtral_config(find_model_config_file(o.model_config));
  // The executors' own check said so with a source location (G11 of the sixteenth pass), as an internal error.
  DMOE_REQUIRE_INPUT(!c.tie_word_embeddings, "flow measure --config {}: tie_word_embeddings = true; the Flow executors "
                     "need untied embeddings (train --schedule refuses them too): set it to false", o.model_config);
  DMOE_REQUIRE_INPUT(o.dtype == "f32" || o.dtype == "bf16", "--dtype {}: allowed: f32, bf16", o.dtype);
  const DType storage = o.dtype == "bf16" ? DType::bf16 : DType::f32;
  const bool ablation = o.schedule_given && o.schedule == "all";
  const flow::Schedule schedule =
      flow::parse_schedule(o.schedule_given && !ablation ? o.schedule : "pipe-attn", "--schedule");
  DMOE_REQUIRE_INPUT(ablation || o.measure_r.size() >= 2,
                     "--measure-r: give at least two values of R (the fit needs two), or --schedule all");
  DMOE_REQUIRE_INPUT(o.batch >= 1, "--batch {} (>= 1)", o.batch);
  c.check_sequence(o.seq, "flow measure: --seq", 2);  // one range, as the CPU executor's (G19-7)
  DMOE_REQUIRE_INPUT(o.steps >= 1, "--steps {}: must be >= 1", o.steps);
  DMOE_REQUIRE_INPUT(o.micro_batches >= 1 && o.batch % o.micro_batches == 0,
                     "--micro-batches {}: must be >= 1 and divide --batch {}", o.micro_batches, o.batch);
  if (!ablation)
    for (int32_t r : o.measure_r)
      DMOE_REQUIRE_INPUT(r >= 1 && o.batch % r == 0, "--measure-r {}: must divide --batch {} (sequences per rank){}", r,
                         o.batch, o.measure_r_given ? "" : fmt::format("; {} is the default --measure-r {}: give "
                         "--measure-r with divisors of --batch, or a --batch that {} divides", r, o.measure_r_text, r));
  const MixtralWeights w = random_mixtral_weights(c, 1);
  flow::CudaFlowSession session(c, w, storage, o.batch * o.seq);
  const int32_t world = session.world(), rank = session.rank();
  DMOE_REQUIRE_INPUT(o.world == 1 || o.world == world,
                     "--world {}: with --engine cuda the ranks are the job's processes (dmoe launch -n W); this job has "
                     "{}: leave --world out or give {}", o.world, world, world);
  DMOE_REQUIRE_INPUT(c.num_local_experts % world == 0, "the job's {} ranks must divide num_local_experts = {} of --config {}",
                     world, c.num_local_experts, o.model_config);
  Rng rng(2);
  std::vector<int32_t> tokens(size_t(world * o.batch * o.seq));
  for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(c.vocab_size));
  const int32_t* mine = tokens.data() + size_t(rank) * o.batch * o.seq;
  const std::vector<flow::GraphSpec> specs =
      measure_specs(o, c, schedule, ablation, flow::cuda_mixtral_dense_grad_bytes_per_layer(c));
  // Peak memory and energy over each measurement's timed steps, on rank 0 (its process, its GPU through NVML).
  std::optional<ResourceProbe> probe;
  if (rank == 0) {
    ResourceProbeOptions po;
    po.scope = fmt::format("{} (the session's model and earlier measurements' allocations included)",
                           world > 1 ? "rank 0's process" : "this process");
    const char* shared = std::getenv("DMOE_SHARED_GPUS");
    probe_current_cuda_device(po, world == 1 ? "one rank"
                                  : shared && std::string(shared) == "1"
                                      ? fmt::format("the job's {} ranks share it (MPS)", world)
                                      : "rank 0's GPU: the other ranks' GPUs are not read");
    probe.emplace(po);
  }
  std::vector<flow::CudaFlowMeasurement> runs;
  for (const flow::GraphSpec& spec : specs)
    runs.push_back(session.measure(spec, mine, o.batch, o.seq, o.steps, probe ? &*probe : nullptr));
  if (rank != 0) return 0;
  std::vector<ResourceReport> resources;
  std::vector<std::string> run_names;
  for (const flow::CudaFlowMeasurement& m : runs) {
    resources.push_back(m.resources.value_or(ResourceReport{}));
    run_names.push_back(fmt::format("{} R = {}", flow::schedule_name(m.spec.schedule), m.spec.micro_batches));
  }
  auto gpu_cells = [&](size_t i) {
    const ResourceReport& r = resources[i];
    return fmt::format(" {:>14} {:>13} {:>11} {:>13} {:>12}", cell(r.host_peak_memory), added_cell(r),
                       cell(r.gpu_energy_per_step), cell(r.gpu_process_memory_peak), cell(r.gpu_device_memory_peak));
  };
  const std::string gpu_header = fmt::format(" {:>14} {:>13} {:>11} {:>13} {:>12}", "peak host MiB", "above start",
                                             "GPU J/step", "GPU proc MiB", "GPU dev MiB");
  std::vector<flow::TaskGraph> graphs;
  for (const flow::GraphSpec& spec : specs) graphs.push_back(flow::build_task_graph(spec));
  std::printf("flow measure: GPU executor (%s), model %s (%d layers), %lld sequences x %lld tokens per rank, W = %d, "
              "median of %d steps after a warm-up step\n", o.dtype.c_str(), o.model_config.c_str(), c.num_hidden_layers,
              (long long)o.batch, (long long)o.seq, world, o.steps);
  const bool one_comm = session.ar_comm() == flow::ArComm::model;
  std::printf("AR chunks: %s (DMOE_FLOW_AR_COMM=%s)\n",
              one_comm ? "on the model's communicator, placed statically in its issue order"
                       : "on a communicator of their own, under the dynamic priority rule",
              flow::ar_comm_name(session.ar_comm()));
  json rows = json::array();
  std::vector<std::pair<flow::GraphSpec, std::vector<flow::TraceEvent>>> traced;
  for (const flow::CudaFlowMeasurement& m : runs) traced.push_back({m.spec, m.timeline});
  if (ablation) {
    std::printf("%-11s %3s %12s %8s %9s%s\n", "schedule", "R", "measured ms", "speedup", "loss", gpu_header.c_str());
    for (size_t i = 0; i < runs.size(); ++i) {
      const flow::CudaFlowMeasurement& m = runs[i];
      std::printf("%-11s %3d %12.3f %7.2fx %9.5f%s\n", flow::schedule_name(m.spec.schedule), m.spec.micro_batches,
                  m.step_ms, runs[0].step_ms / m.step_ms, m.loss, gpu_cells(i).c_str());
      rows.push_back({{"schedule", flow::schedule_name(m.spec.schedule)}, {"micro_batches", m.spec.micro_batches},
                      {"chunk_bytes", m.spec.chunk_bytes}, {"measured_ms", m.step_ms}, {"loss", m.loss},
                      {"resources", resources[i].to_json()}});
    }
  }
  flow::CostModel fit;
  bool fitted_costs = false;
  if (!ablation) {
    const size_t num_fit = runs.size() > 2 ? runs.size() - 1 : runs.size();
    std::vector<flow::MeasuredRun> measured;
    for (size_t i = 0; i < num_fit; ++i) measured.push_back({&graphs[i], runs[i].timeline});
    // The GPU executor's timeline has gaps no kernel fills (the host's waits for each micro-batch's routing counts
    // and loss): each task is charged from when it could have started (FitOptions).
    flow::FitOptions fit_options;
    fit_options.charge_issue_gaps = true;
    fit_options.one_communicator = session.ar_comm() == flow::ArComm::model;
    fit = flow::fit_cost_model(measured, fit_options);
    fitted_costs = true;
    // The simulator as the executor issued: ArComm::model's fixed order on one communicator (the same
    // single_comm_issue_order the executor followed), or separate communicators under the dynamic rule.
    const int32_t per_gap = flow::chunks_per_gap_from_env(std::getenv("DMOE_FLOW_CHUNKS_PER_GAP"));
    std::printf("schedule %s; costs fitted to all but the last R (each task charged from when it could start: host "
                "gaps included); simulator %s\n", flow::schedule_name(schedule),
                one_comm ? fmt::format("with the executor's fixed order on one communicator ({} chunk(s) per gap)",
                                       per_gap).c_str()
                         : "with separate communicators (the dynamic rule)");
    // "tail": the measured step past its last task's end (the host's final waits and reads; not simulated).
    std::printf("%3s %12s %13s %8s %8s%s\n", "R", "measured ms", "predicted ms", "error", "tail ms", gpu_header.c_str());
    for (size_t i = 0; i < runs.size(); ++i) {
      const double predicted =
          one_comm ? flow::simulate_one_communicator(graphs[i], fit, flow::single_comm_issue_order(graphs[i], per_gap))
                         .step_ms
                   : flow::simulate(graphs[i], fit, flow::LinkModel::separate).step_ms;
      double last_end = 0;
      for (const flow::TraceEvent& e : runs[i].timeline) last_end = std::max(last_end, e.end_ms);
      std::printf("%3d %12.3f %13.3f %7.1f%% %8.3f%s\n", specs[i].micro_batches, runs[i].step_ms, predicted,
                  100.0 * (predicted - runs[i].step_ms) / runs[i].step_ms, runs[i].step_ms - last_end,
                  gpu_cells(i).c_str());
      rows.push_back({{"micro_batches", specs[i].micro_batches}, {"measured_ms", runs[i].step_ms},
                      {"predicted_ms", predicted}, {"tail_ms", runs[i].step_ms - last_end},
                      {"resources", resources[i].to_json()}});
    }
  }
  print_resource_labels(run_names, resources);
  FlowOutputs outputs;  // --costs-out, --trace and --json: all or none
  if (!o.costs_out.empty()) {
    DMOE_REQUIRE_INPUT(fitted_costs, "--costs-out: needs one --schedule measured at several --measure-r (not all)");
    json costs = flow::cost_model_json(fit);
    costs["note"] = fitted_note(fmt::format("fitted by dmoe flow measure (GPU executor, {}, model {}, batch {} x {}, "
                                            "W = {}, schedule {})", o.dtype, o.model_config, o.batch, o.seq, world,
                                            flow::schedule_name(schedule)), fit);
    outputs.add(o.costs_out, costs, "--costs-out", "wrote " + o.costs_out);
  }
  if (!o.trace_path.empty())
    outputs.add(o.trace_path, measured_trace(traced), "--trace",
                fmt::format("wrote {} (measured GPU timelines, CUDA events; one process per run)", o.trace_path));
  if (!o.json_path.empty()) {
    json out = {{"engine", "cuda"}, {"model", o.model_config}, {"world", world},
                {"ar_comm", flow::ar_comm_name(session.ar_comm())}, {"rows", rows}};
    if (fitted_costs) out["costs"] = flow::cost_model_json(fit);
    outputs.add(o.json_path, out, "--json", "wrote " + o.json_path);
  }
  outputs.commit();
  return 0;
}

// An option of another action (or engine) would be accepted and ignored (flow simulate --world 4, tune --chunk-bytes,
// measure --costs): refused, naming where it applies. Then the values measure uses, before any work (the graph's own
// checks come after the model is built, and their errors name no option).
void check_options_of_action(const CLI::App& sub, const FlowOptions& o) {
  const bool cuda = o.action == "measure" && o.engine == "cuda";
  // measure --schedule all: the ablation (vanilla at R = 1, the others at --micro-batches), on either engine.
  const bool ablation = o.action == "measure" && o.schedule_given && o.schedule == "all";
  const std::string here = (o.action == "measure" ? fmt::format("flow measure --engine {}", o.engine) : "flow " + o.action) +
                           (o.schedule_given ? " --schedule " + o.schedule : "");
  // The schedules (or the ablation, all) that read Sp, R and the tuner's samples; simulate's tuned row picks its own
  // Sp and R, and only the tuned row samples.
  // project prints the ablation as simulate does, on costs it derives.
  const bool simulates = o.action == "simulate" || o.action == "project";
  const std::string sch = o.schedule_given ? o.schedule : simulates ? "all" : "pipe-attn";
  const bool reads_chunk = simulates ? sch == "chunked-ar" || sch == "all"
                                     : o.action == "measure" && (sch == "chunked-ar" || sch == "tuned" || ablation);
  const bool reads_samples = sch == "all" || sch == "tuned";
  struct Rule {
    const char* option;
    bool applies;
    const char* where;
  };
  const bool project = o.action == "project";
  const Rule rules[] = {
      {"--costs", o.action == "simulate" || o.action == "tune",
       "flow simulate and flow tune (measure fits a cost file: --costs-out; project derives one)"},
      {"--layers", o.action == "simulate" || o.action == "tune",
       "flow simulate and flow tune (measure and project take the --config's layers)"},
      {"--samples", o.action == "tune" || (simulates && reads_samples),
       "flow tune and flow simulate's / project's tuned row (--schedule all or tuned)"},
      {"--seed", o.action == "tune" || (simulates && reads_samples),
       "flow tune and flow simulate's / project's tuned row (--schedule all or tuned)"},
      {"--micro-batches", (simulates && sch != "tuned") || ablation,
       "flow simulate and project (but not --schedule tuned, which picks R) and flow measure --schedule all (measure "
       "takes its R from --measure-r)"},
      {"--schedule", o.action != "tune", "flow simulate, project and measure (tune runs chunked-ar)"},
      {"--chunk-bytes", reads_chunk,
       "flow simulate, project and measure with --schedule chunked-ar (or all: its chunked-ar row; measure: also "
       "tuned's graph); tune, and simulate's tuned row, choose Sp"},
      {"--trace", o.action != "tune", "flow simulate, project and measure (tune runs no single schedule)"},
      {"--config", o.action == "measure" || project, "flow measure and project"},
      {"--batch", o.action == "measure" || project, "flow measure and project"},
      {"--seq", o.action == "measure" || project, "flow measure and project"},
      {"--world", o.action == "measure", "flow measure (project: --gpus)"},
      {"--steps", o.action == "measure", "flow measure"},
      {"--measure-r", o.action == "measure" && !ablation, "flow measure with one --schedule (all measures the ablation)"},
      {"--costs-out", (o.action == "measure" && !ablation) || project,
       "flow measure with one --schedule (all fits no costs) and flow project"},
      {"--engine", o.action == "measure", "flow measure"},
      {"--dtype", cuda || project, "flow measure --engine cuda (the CPU model is f32) and flow project"},
      {"--cluster", project, "flow project"},
      {"--gpus", project, "flow project"},
      {"--experts", project, "flow project"},
      {"--link", o.action != "measure", "flow simulate, tune and project (the executors run on real links)"},
  };
  for (const Rule& r : rules)
    DMOE_REQUIRE_INPUT(r.applies || sub.count(r.option) == 0, "{}: {} is an option of {}; it would be ignored here: "
                       "drop it", here, r.option, r.where);
  if (o.action != "measure") return;
  DMOE_REQUIRE_INPUT(o.steps >= 1 && o.steps <= 100000, "--steps {}: must be in [1, 100000]", o.steps);
  // The executors cut the all-reduce on f32 elements; a chunk count past the graph's task limit is caught by it.
  DMOE_REQUIRE_INPUT(o.chunk_bytes >= 4 && o.chunk_bytes % 4 == 0 && o.chunk_bytes <= flow::kMaxChunkBytes,
                     "--chunk-bytes {}: must be a positive multiple of 4 (the all-reduce is cut on f32 gradients) of at "
                     "most 2^40 = {} (a chunk at least as large as the gradients is one all-reduce)", o.chunk_bytes,
                     flow::kMaxChunkBytes);
  if (!ablation) {
    std::vector<int32_t> sorted = o.measure_r;
    std::sort(sorted.begin(), sorted.end());
    DMOE_REQUIRE_INPUT(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                       "--measure-r {}: a value of R is given twice; the fit needs distinct values",
                       fmt::join(o.measure_r, ","));
  }
}

}  // namespace

Command add_flow_command(CLI::App& app) {
  auto o = std::make_shared<FlowOptions>();
  CLI::App* sub = app.add_subcommand("flow", "Flow's schedules on the simulator: simulate (the ablation), tune (Sp, R), "
                                      "project (costs from a model and a cluster), measure (an executor)");
  sub->add_option("action", o->action, "simulate, tune, project (the ablation at a cluster's scale, costs from first "
                  "principles), or measure (the CPU or GPU executor against the simulator)")
      ->required();
  sub->add_option("--link", o->link, "simulate, tune, project: exclusive (one collective on the link at a time; "
                  "default for simulate, tune), separate (overlap for free), shared (overlap sharing the bandwidth; "
                  "default for project)");
  sub->add_option("--cluster", o->cluster, "project: cluster JSON (bench/flow/clusters: h200, rtx3090-pcie)");
  sub->add_option("--gpus", o->gpus, "project: GPUs P (experts spread over them)");
  sub->add_option("--experts", o->experts, "project: experts E (default: the config's; must divide by --gpus)");
  sub->add_option("--costs", o->costs_path,
                  "simulate, tune: per-task costs JSON, or a named one in bench/flow (e.g. example)");
  sub->add_option("--layers", o->layers, "layers (default: the cost file's \"layers\")");
  sub->add_option("--micro-batches", o->micro_batches, "R for pipe-moe, pipe-attn, chunked-ar (default 2; vanilla "
                  "runs R = 1 unless this is given)");
  sub->add_option("--schedule", o->schedule, "all, or one of vanilla, pipe-moe, pipe-attn, chunked-ar, tuned (measure: "
                  "all or a fixed one; default pipe-attn)");
  sub->add_option("--chunk-bytes", o->chunk_bytes, "Sp of chunked-ar (default 1 MiB)");
  sub->add_option("--samples", o->samples, "tuner samples (simulated steps)");
  sub->add_option("--seed", o->seed, "tuner seed");
  sub->add_option("--trace", o->trace_path, "simulate: write the timelines as Chrome trace-event JSON");
  sub->add_option("--json", o->json_path, "also write the results as JSON");
  sub->add_option("--progress", o->progress_s, "seconds between progress lines on stderr while simulating or "
                  "measuring (0: after every step; measure's default: 2)")->capture_default_str();
  sub->add_option("--config", o->model_config, "measure: HF Mixtral config.json or a named model in bench/models");
  sub->add_option("--batch", o->batch, "measure: sequences per rank");
  sub->add_option("--seq", o->seq, "measure: sequence length (default 32); project: tokens per sequence (default 1024, or the model's max_position_embeddings if fewer); within the model's positions");
  sub->add_option("--world", o->world, "measure: simulated ranks");
  sub->add_option("--measure-r", o->measure_r_text, "measure: values of R, comma-separated (all but the last are "
                  "fitted)")->capture_default_str();
  sub->add_option("--steps", o->steps, "measure: steps per R (median)");
  sub->add_option("--costs-out", o->costs_out, "measure: write the fitted cost file here");
  sub->add_option("--engine", o->engine, "measure: cpu (the CPU executor, simulated ranks) or cuda (aliases ep, gpu: the GPU executor; "
                  "ranks: dmoe launch -n W)");
  sub->add_option("--dtype", o->dtype, "measure --engine cuda: f32 or bf16");
  return [o, sub] {
    DMOE_REQUIRE_INPUT(o->action == "simulate" || o->action == "tune" || o->action == "measure" ||
                           o->action == "project",
                       "flow {}: unknown action (allowed: simulate, tune, project, measure)", o->action);
    if (o->action != "measure") require_no_fault_injected("flow " + o->action);  // only the executors have fault points
    o->progress_given = sub->count("--progress") > 0;
    DMOE_REQUIRE_INPUT(std::isfinite(o->progress_s) && o->progress_s >= 0 && o->progress_s <= 86400,
                       "--progress {}: must be seconds in [0, 86400] (0 prints after every simulated step)",
                       o->progress_s);
    o->schedule_given = sub->count("--schedule") > 0;
    // vanilla is one batch per step (R = 1, as in the ablation); asked for alone it took the --micro-batches default
    // of 2, so the same schedule printed two step times. A given --micro-batches still runs it at that R.
    if (o->schedule == "vanilla" && sub->count("--micro-batches") == 0) o->micro_batches = 1;
    o->measure_r_given = sub->count("--measure-r") > 0;
    o->experts_given = sub->count("--experts") > 0;
    if (o->action == "project" && sub->count("--link") == 0) o->link = "shared";
    o->measure_r = parse_measure_r(o->measure_r_text);
    if (o->action == "measure") o->engine = model_engine(o->engine);  // before the options' applicability (cuda)
    check_options_of_action(*sub, *o);
    o->link_model = parse_link(o->link);
    // Outputs are checked before any work, and none may be one of the inputs (--trace onto --costs would
    // replace the cost file with the trace).
    for (const auto& [option, path] : {std::pair<const char*, const std::string*>{"--trace", &o->trace_path},
                                       {"--json", &o->json_path}, {"--costs-out", &o->costs_out}})
      if (!path->empty()) check_output_file(*path, option);
    const std::vector<NamedPath> outputs = {{"--trace", o->trace_path}, {"--json", o->json_path},
                                            {"--costs-out", o->costs_out}};
    // The outputs are one set (FlowOutputs): their temporaries all exist before the first rename. Each probe above
    // passed alone, so 2-3 outputs on a file system with fewer free inodes ran the whole simulation or measurement,
    // then failed with "no free inodes" (G21-4, twenty-first pass). Counted per file system up front, as init's set.
    {
      struct Volume {
        dev_t device;
        std::string directory, options;
        uint64_t files;
      };
      std::vector<Volume> volumes;
      for (const NamedPath& out : outputs) {
        if (out.path.empty()) continue;
        const std::filesystem::path parent = std::filesystem::path(out.path).parent_path();
        const std::string dir = parent.empty() ? std::string(".") : parent.string();
        struct stat st {};
        if (::stat(dir.c_str(), &st) != 0) continue;
        const auto v = std::find_if(volumes.begin(), volumes.end(), [&](const Volume& x) { return x.device == st.st_dev; });
        if (v == volumes.end()) {
          volumes.push_back({st.st_dev, dir, out.option, 1});
        } else {
          v->options += ", " + out.option;
          ++v->files;
        }
      }
      for (const Volume& v : volumes)
        if (v.files > 1)
          require_free_inodes(v.files, v.directory, fmt::format("flow {} (its outputs {}, written together)",
                                                                o->action, v.options));
      // G22B-3: and their bytes (and ulimit -f): on a file system with no space left the whole simulation or
      // measurement ran, then the write failed. A lower bound of each file (the smallest, a one-run --json, is
      // ~350 B): no run whose outputs fit is refused.
      for (const NamedPath& out : outputs)
        if (!out.path.empty())
          require_output_space(256, out.path, out.option, fmt::format("at the least: flow {}'s {}", o->action,
                                                                      out.option == "--trace" ? "timelines"
                                                                      : out.option == "--json" ? "results"
                                                                                               : "fitted costs"));
    }
    // simulate, tune and project run no ranks: under a launcher every process wrote the same outputs over each
    // other's (the work done n times, the file of whichever finished last).
    if (o->action != "measure") {
      std::string written;
      for (const NamedPath& out : outputs)
        if (!out.path.empty()) written += (written.empty() ? "" : ", ") + out.option + " " + out.path;
      if (!written.empty()) require_not_under_launcher("flow " + o->action, written);
    }
    if (o->action == "project") {
      if (sub->count("--dtype") == 0) o->dtype = "bf16";
      o->seq_given = sub->count("--seq") > 0;  // not given: the paper models' 1024, or the model's maximum if shorter
      // The cluster file is an input too: `--cluster cl.json --json cl.json` replaced the cluster with the results
      // (rc 0; a named one in DMOE_HOME's bench/flow/clusters the same).
      std::vector<NamedPath> inputs = {{"--config", find_model_config_file(o->model_config)}};
      if (!o->cluster.empty())
        inputs.push_back({"--cluster", find_named_json(o->cluster, "bench/flow/clusters", "cluster file")});
      require_distinct_files(outputs, inputs);
      DMOE_REQUIRE_INPUT(o->micro_batches >= 1 && o->micro_batches <= 4096, "--micro-batches {}: must be in [1, 4096]",
                         o->micro_batches);
      DMOE_REQUIRE_INPUT(o->samples >= 2 && o->samples <= 1000, "--samples {}: must be in [2, 1000] (one sample is one "
                         "guess, no search; train --tune-samples has the same floor)", o->samples);
      DMOE_REQUIRE_INPUT(o->chunk_bytes >= 1 && o->chunk_bytes <= flow::kMaxChunkBytes, "--chunk-bytes {}: must be in "
                       "[1, 2^40 = {}] (a chunk at least as large as the gradients is one all-reduce)", o->chunk_bytes,
                       flow::kMaxChunkBytes);
      // R splits each GPU's batch along its sequences (no sequence is cut, docs/flow.md), as train and measure
      // require: `--batch 1` projected pipe-attn at the default R = 2 (and a tuned R = 2, 1.38x), a schedule that
      // cannot run. (The tuned row's candidates are the divisors among 1, 2, 4, 8: simulate_command.)
      DMOE_REQUIRE_INPUT(o->schedule == "tuned" || o->batch < 1 || o->batch % o->micro_batches == 0,
                         "--micro-batches {}{}: must divide --batch {} (each GPU's sequences are split into R "
                         "micro-batches; no sequence is cut): give --micro-batches with a divisor of --batch, or a "
                         "--batch that {} divides", o->micro_batches, sub->count("--micro-batches") ? "" : " (the default)",
                         o->batch, o->micro_batches);
      return project_command(*o);
    }
    if (o->action == "measure") {
      require_distinct_files(outputs, {{"--config", find_model_config_file(o->model_config)}});
      if (o->engine == "cuda") return measure_cuda_command(*o);
      require_one_process("flow measure", "measure every R on the same cores as the others (their steps in its "
                          "timings) and write its outputs", "use --engine cuda (one rank per process)");
      return measure_command(*o);
    }
    DMOE_REQUIRE_INPUT(!o->costs_path.empty(), "--costs: required for flow {} (a cost JSON file, or a named one "
                       "from bench/flow such as example)", o->action);
    o->costs_path = find_named_json(o->costs_path, "bench/flow", "cost file");  // printed as the file read
    require_distinct_files(outputs, {{"--costs", o->costs_path}});
    const flow::CostModel costs = flow::load_cost_model(o->costs_path);
    // Past 100000 the task graph's own check refused it as an internal error, with a source location.
    DMOE_REQUIRE_INPUT(o->layers >= 0 && o->layers <= 100000, "--layers {}: must be in [1, 100000], or 0 for the cost "
                       "file's \"layers\"", o->layers);
    const int32_t layers = o->layers > 0 ? o->layers : costs.layers;
    DMOE_REQUIRE_INPUT(layers >= 1, "--layers {}: must be >= 1 (or give \"layers\" in {})", o->layers, o->costs_path);
    DMOE_REQUIRE_INPUT(o->micro_batches >= 1 && o->micro_batches <= 4096, "--micro-batches {}: must be in [1, 4096]",
                       o->micro_batches);
    DMOE_REQUIRE_INPUT(o->chunk_bytes >= 1 && o->chunk_bytes <= flow::kMaxChunkBytes, "--chunk-bytes {}: must be in "
                       "[1, 2^40 = {}] (a chunk at least as large as the gradients is one all-reduce)", o->chunk_bytes,
                       flow::kMaxChunkBytes);
    DMOE_REQUIRE_INPUT(o->samples >= 2 && o->samples <= 1000, "--samples {}: must be in [2, 1000] (one sample is one "
                         "guess, no search; train --tune-samples has the same floor)", o->samples);
    if (o->action == "tune") return tune_command(*o, costs, layers);
    return simulate_command(*o, costs, layers);
  };
}

}  // namespace dmoe::cli
