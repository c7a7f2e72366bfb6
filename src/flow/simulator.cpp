// simulator.cpp — the discrete-event simulator of Flow's schedules (see simulator.hpp).
#include "flow/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "flow/json_fields.hpp"
#include "model/config_io.hpp"

namespace dmoe::flow {

using nlohmann::json;

void validate(const CostModel& c) {
  for (int k = 0; k < 8; ++k) {
    const char* name = task_kind_name(TaskKind(k));
    DMOE_REQUIRE(std::isfinite(c.tasks[size_t(k)].fixed_ms) && c.tasks[size_t(k)].fixed_ms >= 0,
                 "costs.tasks.{}.fixed_ms = {}: must be finite and >= 0", name, c.tasks[size_t(k)].fixed_ms);
    DMOE_REQUIRE(std::isfinite(c.tasks[size_t(k)].batch_ms) && c.tasks[size_t(k)].batch_ms >= 0,
                 "costs.tasks.{}.batch_ms = {}: must be finite and >= 0", name, c.tasks[size_t(k)].batch_ms);
  }
  DMOE_REQUIRE(std::isfinite(c.ar_alpha_ms) && c.ar_alpha_ms >= 0, "costs.allreduce.alpha_ms = {}: must be finite and >= 0",
               c.ar_alpha_ms);
  DMOE_REQUIRE(std::isfinite(c.ar_bytes_per_ms) && c.ar_bytes_per_ms > 0,
               "costs.allreduce.gbytes_per_s = {}: must be finite and > 0", c.ar_bytes_per_ms / 1e6);
  DMOE_REQUIRE(c.dense_grad_bytes_per_layer >= 0, "costs.dense_grad_bytes_per_layer = {}: must be >= 0",
               c.dense_grad_bytes_per_layer);
  DMOE_REQUIRE(c.head_grad_bytes >= 0 && c.embed_grad_bytes >= 0,
               "costs.head_grad_bytes = {}, embed_grad_bytes = {}: must be >= 0", c.head_grad_bytes, c.embed_grad_bytes);
}

CostModel parse_cost_model(const json& j, const std::string& where) {
  only_keys(j, {"layers", "dense_grad_bytes_per_layer", "head_grad_bytes", "embed_grad_bytes", "tasks", "allreduce",
               "note"}, where);
  CostModel c;
  if (j.contains("note")) {
    DMOE_REQUIRE_INPUT(j.at("note").is_string(), "{}.note = {}: must be a string", where, j.at("note").dump().substr(0, 80));
    c.note = j.at("note").get<std::string>();
  }
  if (j.contains("layers")) {
    DMOE_REQUIRE_INPUT(j.at("layers").is_number_integer() && j.at("layers").get<int64_t>() >= 1 &&
                     j.at("layers").get<int64_t>() <= 100000,
                 "{}.layers = {}: must be an integer in [1, 100000]", where, j.at("layers").dump());
    c.layers = j.at("layers").get<int32_t>();
  }
  DMOE_REQUIRE_INPUT(j.contains("dense_grad_bytes_per_layer"), "{}: missing key 'dense_grad_bytes_per_layer'", where);
  DMOE_REQUIRE_INPUT(j.at("dense_grad_bytes_per_layer").is_number_integer() &&
                   j.at("dense_grad_bytes_per_layer").get<int64_t>() >= 0,
               "{}.dense_grad_bytes_per_layer = {}: must be an integer >= 0", where,
               j.at("dense_grad_bytes_per_layer").dump());
  c.dense_grad_bytes_per_layer = j.at("dense_grad_bytes_per_layer").get<int64_t>();
  // The task graph's limit, checked here as the file's error (it ended in "(task_graph.cpp:81)").
  DMOE_REQUIRE_INPUT(c.dense_grad_bytes_per_layer <= (int64_t(1) << 40), "{}.dense_grad_bytes_per_layer = {}: must be "
                     "at most 2^40", where, c.dense_grad_bytes_per_layer);
  for (const char* key : {"head_grad_bytes", "embed_grad_bytes"}) {
    if (!j.contains(key)) continue;
    const json& v = j.at(key);
    DMOE_REQUIRE_INPUT(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= (int64_t(1) << 40),
                       "{}.{} = {}: must be an integer in [0, 2^40]", where, key, v.dump());
    (std::string(key) == "head_grad_bytes" ? c.head_grad_bytes : c.embed_grad_bytes) = v.get<int64_t>();
  }
  DMOE_REQUIRE_INPUT(j.contains("tasks"), "{}: missing key 'tasks' (AT, D, E, C, C', E', D', AT')", where);
  const json& tasks = j.at("tasks");
  only_keys(tasks, {"AT", "D", "E", "C", "C'", "E'", "D'", "AT'"}, where + ".tasks");
  for (int k = 0; k < 8; ++k) {
    const std::string name = task_kind_name(TaskKind(k));
    DMOE_REQUIRE_INPUT(tasks.contains(name), "{}.tasks: missing key '{}' (every one of AT, D, E, C, C', E', D', AT' is required)",
                 where, name);
    const std::string w = where + ".tasks." + name;
    only_keys(tasks.at(name), {"fixed_ms", "batch_ms"}, w);
    c.tasks[size_t(k)].fixed_ms = tasks.at(name).contains("fixed_ms") ? number_at(tasks.at(name), "fixed_ms", w) : 0.0;
    c.tasks[size_t(k)].batch_ms = number_at(tasks.at(name), "batch_ms", w);
  }
  DMOE_REQUIRE_INPUT(j.contains("allreduce"), "{}: missing key 'allreduce' ({{\"alpha_ms\", \"gbytes_per_s\"}})", where);
  only_keys(j.at("allreduce"), {"alpha_ms", "gbytes_per_s"}, where + ".allreduce");
  c.ar_alpha_ms = number_at(j.at("allreduce"), "alpha_ms", where + ".allreduce");
  // Its own rule only, one for every bad value: number_at's "must be finite and >= 0" for -5 allowed the 0 that "must
  // be > 0" refused, and "at most 1e300" let up to 1.8e302 through (G22B-7 (b) of the twenty-second pass).
  DMOE_REQUIRE_INPUT(j.at("allreduce").contains("gbytes_per_s"), "{}.allreduce: missing key 'gbytes_per_s'", where);
  const nlohmann::json& g = j.at("allreduce").at("gbytes_per_s");
  DMOE_REQUIRE_INPUT(g.is_number(), "{}.allreduce.gbytes_per_s: must be a number (got {})", where, g.dump());
  const double gbps = g.get<double>();
  DMOE_REQUIRE_INPUT(gbps > 0 && gbps <= 1e300, "{}.allreduce.gbytes_per_s = {}: must be in (0, 1e300] GB/s", where,
                     gbps);
  c.ar_bytes_per_ms = gbps * 1e6;  // 1 GB/s = 1e9 B / 1e3 ms
  // With every cost 0 the step takes 0 ms and no speed-up is defined (simulate printed nan, rc 0). allreduce.alpha_ms
  // is paid per all-reduce, and with no gradient bytes nothing is all-reduced: a file of zero tasks and zero bytes but
  // an alpha_ms > 0 still printed "-nanx" in every row (F8 of the eighteenth bad-input pass).
  const bool all_reduces = c.dense_grad_bytes_per_layer > 0 || c.head_grad_bytes > 0 || c.embed_grad_bytes > 0;
  bool any_cost = all_reduces;
  for (const TaskCost& t : c.tasks) any_cost |= t.fixed_ms > 0 || t.batch_ms > 0;
  DMOE_REQUIRE_INPUT(any_cost, "{}: every cost is 0 (the tasks' fixed_ms and batch_ms; and with dense_grad_bytes_per_layer, "
                     "head_grad_bytes and embed_grad_bytes 0 nothing is all-reduced, so allreduce.alpha_ms is never "
                     "paid): the step would take 0 ms, of which no speed-up can be taken; give at least one task cost "
                     "> 0 or gradient bytes to all-reduce", where);
  validate(c);
  return c;
}

json cost_model_json(const CostModel& c) {
  json tasks = json::object();
  for (int k = 0; k < 8; ++k)
    tasks[task_kind_name(TaskKind(k))] = {{"fixed_ms", c.tasks[size_t(k)].fixed_ms}, {"batch_ms", c.tasks[size_t(k)].batch_ms}};
  json j = {{"dense_grad_bytes_per_layer", c.dense_grad_bytes_per_layer},
            {"tasks", tasks},
            {"allreduce", {{"alpha_ms", c.ar_alpha_ms}, {"gbytes_per_s", c.ar_bytes_per_ms / 1e6}}}};
  if (c.layers > 0) j["layers"] = c.layers;
  if (!c.note.empty()) j["note"] = c.note;
  if (c.head_grad_bytes > 0) j["head_grad_bytes"] = c.head_grad_bytes;
  if (c.embed_grad_bytes > 0) j["embed_grad_bytes"] = c.embed_grad_bytes;
  return j;
}

namespace {
// Least squares y = a + b·x; false when the x do not take two distinct values.
bool fit_line(const std::vector<double>& x, const std::vector<double>& y, double* a, double* b) {
  const double n = double(x.size());
  double sx = 0, sy = 0;
  for (size_t i = 0; i < x.size(); ++i) sx += x[i], sy += y[i];
  const double mx = sx / n, my = sy / n;
  double sxx = 0, sxy = 0;
  for (size_t i = 0; i < x.size(); ++i) sxx += (x[i] - mx) * (x[i] - mx), sxy += (x[i] - mx) * (y[i] - my);
  if (!(sxx > 1e-12 * (1 + mx * mx))) return false;
  *b = sxy / sxx;
  *a = my - *b * mx;
  return true;
}
}  // namespace

namespace {

// Each event's duration as fit_cost_model charges it: end − start, or with charge_issue_gaps end − the time the
// task could have started (the latest of its dependencies' ends and its stream's previous task's end — the
// communicator's previous task with one_communicator —, never before 0, never after its measured start); AR
// chunks always as measured (their waits follow the priority rule, which the simulator applies).
std::vector<double> charged_durations(const TaskGraph& g, const std::vector<TraceEvent>& timeline,
                                      const FitOptions& o) {
  std::vector<double> d(timeline.size());
  if (!o.charge_issue_gaps) {
    for (size_t i = 0; i < timeline.size(); ++i) d[i] = timeline[i].end_ms - timeline[i].start_ms;
    return d;
  }
  std::vector<double> end(g.tasks.size(), -1.0);
  for (const TraceEvent& e : timeline) end[size_t(e.task)] = e.end_ms;
  std::vector<size_t> by_start(timeline.size());
  for (size_t i = 0; i < by_start.size(); ++i) by_start[i] = i;
  std::stable_sort(by_start.begin(), by_start.end(),
                   [&](size_t a, size_t b) { return timeline[a].start_ms < timeline[b].start_ms; });
  std::array<double, 3> stream_free{0.0, 0.0, 0.0};  // compute, all-to-all, AR: the previous task's end
  for (size_t i : by_start) {
    const TraceEvent& e = timeline[i];
    const Task& t = g.tasks[size_t(e.task)];
    const bool comm = t.stream != Stream::compute;
    const size_t lane = o.one_communicator && comm ? size_t(Stream::alltoall) : size_t(t.stream);
    double ready = stream_free[lane];
    for (int32_t dep : t.deps)
      if (end[size_t(dep)] >= 0) ready = std::max(ready, end[size_t(dep)]);
    ready = std::min(ready, e.start_ms);  // a timeline whose order says otherwise is charged as measured
    // AR chunks wait by the priority rule (only in the gaps between all-to-alls), which the simulator models
    // itself: charged as measured.
    d[i] = e.end_ms - (t.kind == TaskKind::allreduce ? e.start_ms : ready);
    stream_free[lane] = std::max(stream_free[lane], e.end_ms);
  }
  return d;
}

}  // namespace

CostModel fit_cost_model(const std::vector<MeasuredRun>& runs, const FitOptions& options) {
  DMOE_REQUIRE(!runs.empty(), "fit_cost_model: no measured runs");
  std::array<std::vector<double>, 9> x, y;  // per kind: m/R (AR: bytes) and the charged duration
  CostModel c;
  for (size_t i = 0; i < runs.size(); ++i) {
    DMOE_REQUIRE(runs[i].graph, "fit_cost_model: run {} has no graph", i);
    const TaskGraph& g = *runs[i].graph;
    if (i == 0) {
      c.dense_grad_bytes_per_layer = g.spec.dense_grad_bytes_per_layer, c.layers = g.spec.layers;
      c.head_grad_bytes = g.spec.head_grad_bytes, c.embed_grad_bytes = g.spec.embed_grad_bytes;
    }
    for (const TraceEvent& e : runs[i].timeline)
      DMOE_REQUIRE(e.task >= 0 && e.task < int32_t(g.tasks.size()) && e.end_ms >= e.start_ms,
                   "fit_cost_model: run {}: event for task {} [{}, {}] is not a task of its graph or ends before it starts",
                   i, e.task, e.start_ms, e.end_ms);
    const std::vector<double> charged = charged_durations(g, runs[i].timeline, options);
    for (size_t j = 0; j < runs[i].timeline.size(); ++j) {
      const Task& t = g.tasks[size_t(runs[i].timeline[j].task)];
      const size_t k = size_t(t.kind);
      x[k].push_back(t.kind == TaskKind::allreduce ? double(t.bytes)
                                                   : double(t.num_micro_batches) / double(g.spec.micro_batches));
      y[k].push_back(charged[j]);
    }
  }
  std::vector<std::string> unmeasured;
  for (int k = 0; k < 8; ++k) {
    const std::string name = task_kind_name(TaskKind(k));
    if (x[size_t(k)].empty()) {  // not measured: costs 0
      unmeasured.push_back(name + " (no task measured: 0)");
      continue;
    }
    double a = 0, b = 0;
    DMOE_REQUIRE(fit_line(x[size_t(k)], y[size_t(k)], &a, &b),
                 "fit_cost_model: task kind {}: all {} measured tasks cover the same share of the batch; measure two "
                 "values of R (micro_batches) to separate fixed_ms from batch_ms",
                 name, x[size_t(k)].size());
    if (a < 0) unmeasured.push_back(fmt::format("{}.fixed_ms (fitted {:.3g}: clamped to 0)", name, a));
    if (b < 0) unmeasured.push_back(fmt::format("{}.batch_ms (fitted {:.3g}: clamped to 0)", name, b));
    c.tasks[size_t(k)] = {std::max(0.0, a), std::max(0.0, b)};
  }
  const size_t ar = size_t(TaskKind::allreduce);
  if (x[ar].empty()) {
    unmeasured.push_back("allreduce (no all-reduce measured: alpha_ms and gbytes_per_s are the defaults)");
  } else {
    double a = 0, b = 0;
    if (fit_line(x[ar], y[ar], &a, &b) && b > 0) {
      c.ar_alpha_ms = std::max(0.0, a);
      c.ar_bytes_per_ms = 1.0 / b;
    } else {  // one size only (or no growth with size): the mean time per call, bytes free
      double mean = 0;
      for (double v : y[ar]) mean += v / double(y[ar].size());
      c.ar_alpha_ms = mean;
      c.ar_bytes_per_ms = kUnmeasuredBytesPerMs;
      unmeasured.push_back(fmt::format("allreduce.gbytes_per_s ({:.0e} is a placeholder: the measured calls' time did "
                                       "not grow with their bytes, e.g. at one rank, where no all-reduce moves data; "
                                       "alpha_ms is their mean, {:.3g} ms)", kUnmeasuredBytesPerMs / 1e6, mean));
    }
  }
  if (!unmeasured.empty()) c.note = fmt::format("not measured: {}", fmt::join(unmeasured, "; "));
  validate(c);
  return c;
}

CostModel load_cost_model(const std::string& path) {
  return parse_cost_model(read_json_file(path, "--costs"), path);
}

double task_cost_ms(const Task& t, const CostModel& c, int32_t micro_batches) {
  if (t.kind == TaskKind::allreduce) return c.ar_alpha_ms + double(t.bytes) / c.ar_bytes_per_ms;
  const TaskCost& k = c[t.kind];
  return k.fixed_ms + k.batch_ms * double(t.num_micro_batches) / double(micro_batches);
}

std::vector<double> task_costs_ms(const TaskGraph& g, const CostModel& c) {
  validate(c);
  std::vector<double> v(g.tasks.size());
  for (const Task& t : g.tasks) v[size_t(t.id)] = task_cost_ms(t, c, g.spec.micro_batches);
  return v;
}

std::vector<int32_t> SimResult::start_order(const TaskGraph& g, Stream s) const {
  std::vector<int32_t> v;
  for (const TraceEvent& e : events)
    if (g.tasks[size_t(e.task)].stream == s) v.push_back(e.task);
  return v;
}

namespace {
// The event loop of simulate() and simulate_one_communicator(): the queue decides what goes on the link.
SimResult run_simulation(const TaskGraph& g, const std::vector<double>& cost, LinkModel link, CommQueue& queue);
}  // namespace

SimResult simulate(const TaskGraph& g, const std::vector<double>& cost, LinkModel link) {
  CommQueue queue(g, link);
  return run_simulation(g, cost, link, queue);
}

SimResult simulate_one_communicator(const TaskGraph& g, const std::vector<double>& cost,
                                    const std::vector<int32_t>& order) {
  CommQueue queue(g, order);
  return run_simulation(g, cost, LinkModel::exclusive, queue);
}

SimResult simulate_one_communicator(const TaskGraph& g, const CostModel& costs, const std::vector<int32_t>& order) {
  return simulate_one_communicator(g, task_costs_ms(g, costs), order);
}

namespace {
SimResult run_simulation(const TaskGraph& g, const std::vector<double>& cost, LinkModel link, CommQueue& queue) {
  const size_t n = g.tasks.size();
  DMOE_REQUIRE(cost.size() == n, "costs: {} entries for {} tasks", cost.size(), n);
  // Costs come from the user's cost file or cluster (finite each, but products and sums can overflow).
  for (size_t i = 0; i < n; ++i)
    DMOE_REQUIRE_INPUT(std::isfinite(cost[i]) && cost[i] >= 0, "cost of task {} = {} ms: must be finite and >= 0 (the "
                       "costs overflow: give smaller fixed_ms/batch_ms, or a larger allreduce gbytes_per_s or cluster "
                       "bandwidth)", g.describe(int32_t(i)), cost[i]);
  SimResult res;
  std::vector<uint8_t> done(n, 0);
  std::vector<double> end(n, 0);
  size_t compute_next = 0;
  int32_t compute_running = -1;
  std::vector<int32_t> running;  // tasks in flight (at most one per resource)
  size_t completed = 0;
  double t = 0;
  auto ready = [&](int32_t id) {
    for (int32_t d : g.tasks[size_t(id)].deps)
      if (!done[size_t(d)]) return false;
    return true;
  };
  auto retire = [&](int32_t id) {
    done[size_t(id)] = 1;
    ++completed;
    if (id == compute_running)
      compute_running = -1;
    else
      queue.finished(id);
  };
  // Starts a task at time t; a task of zero cost is retired at once, so what depends on it sees it done
  // at the same instant (returns true then: the start phase runs again).
  // LinkModel::shared: a communication task's cost is its time alone on the link; while an all-to-all and a chunk
  // are both in flight each progresses at half speed, so `left` (the work still to do, in ms alone) is what
  // decides their ends, and end[] is fixed when they retire. Compute tasks always run at full speed.
  const bool fluid = link == LinkModel::shared;
  std::vector<double> left(fluid ? n : 0, 0);
  std::vector<size_t> event_of(n, 0);  // index of the task's entry in res.events
  auto on_link = [&](int32_t id) { return g.tasks[size_t(id)].stream != Stream::compute; };
  auto link_tasks = [&] {
    int k = 0;
    for (int32_t id : running) k += on_link(id);
    return k;
  };
  auto start = [&](int32_t id) {
    end[size_t(id)] = t + cost[size_t(id)];
    event_of[size_t(id)] = res.events.size();
    res.events.push_back({id, t, end[size_t(id)]});
    if (cost[size_t(id)] > 0) {
      if (fluid) left[size_t(id)] = cost[size_t(id)];
      running.push_back(id);
      return false;
    }
    retire(id);
    return true;
  };
  while (completed < n) {
    // Start what can start at time t: the next compute task, then the link's pick, until nothing changes.
    for (bool again = true; again;) {
      again = false;
      // Compute first, through any zero-cost tasks, so the link decides on everything done at time t.
      while (compute_running < 0 && compute_next < g.compute_order.size() && ready(g.compute_order[compute_next])) {
        compute_running = g.compute_order[compute_next++];
        if (!start(compute_running)) break;
      }
      const CommQueue::Pick p = queue.pick(done);
      for (int32_t id : {p.alltoall, p.allreduce})
        if (id >= 0) {
          queue.started(id);
          again |= start(id);
        }
    }
    if (completed == n) break;
    // Advance to the next completion and retire every task ending then.
    DMOE_REQUIRE(!running.empty(), "simulation stuck at {} ms with {} of {} tasks done (next compute {}, next "
                 "all-to-all {}): the stream orders contradict the dependencies",
                 t, completed, n, compute_next < g.compute_order.size() ? g.describe(g.compute_order[compute_next]) : "none",
                 queue.next_alltoall() >= 0 ? g.describe(queue.next_alltoall()) : "none");
    double next = std::numeric_limits<double>::infinity();
    if (fluid) {
      // Rates now: 1 for compute, 1 / (communication tasks in flight) for those; the next end is the first task
      // to finish its remaining work at its rate. Everything in flight advances to then.
      const double share = 1.0 / std::max(1, link_tasks());
      int32_t first = -1;  // the task that ends at `next`
      for (int32_t id : running) {
        const double rate = on_link(id) ? share : 1.0;
        const double e = on_link(id) ? t + left[size_t(id)] / rate : end[size_t(id)];
        if (e < next || first < 0) next = e, first = id;
      }
      for (int32_t id : running)
        if (on_link(id)) {
          left[size_t(id)] = std::max(0.0, left[size_t(id)] - (next - t) * share);
          // A task whose remaining work is within rounding of 0 ends now, and so does the first to end whatever
          // rounding left of it: when t is large beside its remaining work, t + left == t and nothing advanced
          // (costs of 1e300 ms beside 0.1 ms ones looped forever).
          if (id == first || left[size_t(id)] <= 1e-12 * std::max(1.0, cost[size_t(id)])) {
            end[size_t(id)] = next;
            res.events[event_of[size_t(id)]].end_ms = next;
          } else {
            end[size_t(id)] = std::numeric_limits<double>::infinity();  // not yet known
          }
        }
    } else {
      for (int32_t id : running) next = std::min(next, end[size_t(id)]);
    }
    t = next;
    for (size_t i = 0; i < running.size();) {
      const int32_t id = running[i];
      if (end[size_t(id)] <= t) {
        running[i] = running.back();
        running.pop_back();
        retire(id);
      } else {
        ++i;
      }
    }
  }
  for (const Task& task : g.tasks) {
    const double e = end[size_t(task.id)], c = cost[size_t(task.id)];
    res.step_ms = std::max(res.step_ms, e);
    if (task.id < g.num_forward_tasks) res.forward_end_ms = std::max(res.forward_end_ms, e);
    if (task.stream != Stream::allreduce) res.backward_end_ms = std::max(res.backward_end_ms, e);
    (task.stream == Stream::compute    ? res.compute_busy_ms
     : task.stream == Stream::alltoall ? res.alltoall_busy_ms
                                       : res.allreduce_busy_ms) += c;
  }
  DMOE_REQUIRE_INPUT(std::isfinite(res.step_ms) && std::isfinite(res.compute_busy_ms) &&
                         std::isfinite(res.alltoall_busy_ms) && std::isfinite(res.allreduce_busy_ms),
                     "the simulated step takes {} ms (compute {}, all-to-all {}, all-reduce {} ms): the task costs "
                     "overflow when added up; give smaller fixed_ms/batch_ms, or a larger allreduce gbytes_per_s or "
                     "cluster bandwidth", res.step_ms, res.compute_busy_ms, res.alltoall_busy_ms,
                     res.allreduce_busy_ms);
  return res;
}

}  // namespace

RanksResult simulate_ranks(const TaskGraph& g, const std::vector<std::vector<double>>& cost, LinkModel link) {
  const size_t W = cost.size(), n = g.tasks.size();
  DMOE_REQUIRE(W >= 1, "simulate_ranks: no ranks");
  DMOE_REQUIRE(link != LinkModel::shared, "simulate_ranks: the shared-bandwidth link model is simulate()'s only "
               "(allowed here: exclusive, separate)");
  for (size_t r = 0; r < W; ++r) {
    DMOE_REQUIRE(cost[r].size() == n, "simulate_ranks: rank {} has {} costs for {} tasks", r, cost[r].size(), n);
    for (double c : cost[r]) DMOE_REQUIRE(std::isfinite(c) && c > 0, "simulate_ranks: costs must be finite and > 0");
  }
  RanksResult res;
  res.alltoall_issue.resize(W);
  res.allreduce_issue.resize(W);
  std::vector<std::vector<uint8_t>> done(W, std::vector<uint8_t>(n, 0));
  std::vector<CommQueue> queues;
  for (size_t r = 0; r < W; ++r) queues.emplace_back(g, link);
  std::vector<size_t> compute_next(W, 0);
  std::vector<int32_t> compute_running(W, -1);
  std::vector<double> compute_end(W, 0);
  std::vector<int32_t> issued(n, 0);             // ranks that issued collective id
  std::vector<double> collective_end(n, -1);      // >= 0 once started on all ranks
  std::vector<int32_t> collectives_running;
  size_t completed = 0;                           // (rank, task) pairs
  double t = 0;
  auto ready = [&](size_t r, int32_t id) {
    for (int32_t d : g.tasks[size_t(id)].deps)
      if (!done[r][size_t(d)]) return false;
    return true;
  };
  while (completed < W * n) {
    for (size_t r = 0; r < W; ++r) {
      if (compute_running[r] < 0 && compute_next[r] < g.compute_order.size() &&
          ready(r, g.compute_order[compute_next[r]])) {
        compute_running[r] = g.compute_order[compute_next[r]++];
        compute_end[r] = t + cost[r][size_t(compute_running[r])];
      }
      const CommQueue::Pick p = queues[r].pick(done[r]);
      for (int32_t id : {p.alltoall, p.allreduce})
        if (id >= 0) {
          queues[r].started(id);
          (g.tasks[size_t(id)].stream == Stream::alltoall ? res.alltoall_issue : res.allreduce_issue)[r].push_back(id);
          if (++issued[size_t(id)] == int32_t(W)) {
            double c = 0;
            for (size_t q = 0; q < W; ++q) c = std::max(c, cost[q][size_t(id)]);
            collective_end[size_t(id)] = t + c;
            collectives_running.push_back(id);
          }
        }
    }
    double next = std::numeric_limits<double>::infinity();
    for (size_t r = 0; r < W; ++r)
      if (compute_running[r] >= 0) next = std::min(next, compute_end[r]);
    for (int32_t id : collectives_running) next = std::min(next, collective_end[size_t(id)]);
    if (!std::isfinite(next)) {
      res.deadlocked = true;
      for (size_t r = 0; r < W; ++r) {
        std::string waiting;
        for (int32_t id : {queues[r].next_alltoall(), queues[r].next_allreduce()})
          if (id >= 0) waiting += (waiting.empty() ? "" : ", next ") + g.describe(id);
        res.deadlock += fmt::format("{}rank {}: {} (all-to-all {}, AR {})", r ? "; " : "", r,
                                    waiting.empty() ? "nothing left to issue" : "next " + waiting,
                                    queues[r].alltoall_running() ? "issued, waiting for peers" : "idle",
                                    queues[r].allreduce_running() ? "issued, waiting for peers" : "idle");
      }
      return res;
    }
    t = next;
    for (size_t r = 0; r < W; ++r)
      if (compute_running[r] >= 0 && compute_end[r] <= t) {
        done[r][size_t(compute_running[r])] = 1;
        compute_running[r] = -1;
        ++completed;
      }
    for (size_t i = 0; i < collectives_running.size();) {
      const int32_t id = collectives_running[i];
      if (collective_end[size_t(id)] <= t) {
        for (size_t r = 0; r < W; ++r) {
          done[r][size_t(id)] = 1;
          queues[r].finished(id);
          ++completed;
        }
        collectives_running[i] = collectives_running.back();
        collectives_running.pop_back();
      } else {
        ++i;
      }
    }
  }
  res.step_ms = t;
  return res;
}

SimResult simulate(const TaskGraph& g, const CostModel& costs, LinkModel link) {
  return simulate(g, task_costs_ms(g, costs), link);
}

json trace_json(const TaskGraph& g, const SimResult& r, int pid) {
  json events = json::array();
  for (const TraceEvent& e : r.events) {
    const Task& t = g.tasks[size_t(e.task)];
    json ev = {{"name", g.describe(e.task)}, {"cat", task_kind_name(t.kind)}, {"ph", "X"},
               {"ts", e.start_ms * 1e3},      {"dur", (e.end_ms - e.start_ms) * 1e3},
               {"pid", pid},                  {"tid", int(t.stream)},
               {"args", {{"layer", t.layer}, {"micro_batch", t.micro_batch}, {"deps", t.deps}}}};
    if (t.kind == TaskKind::allreduce) ev["args"]["bytes"] = t.bytes;
    events.push_back(std::move(ev));
  }
  for (Stream s : {Stream::compute, Stream::alltoall, Stream::allreduce})
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", int(s)},
                      {"args", {{"name", stream_name(s)}}}});
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid},
                    {"args", {{"name", fmt::format("{} (R={}, Sp={} B)", schedule_name(g.spec.schedule),
                                                   g.spec.micro_batches, g.spec.chunk_bytes)}}}});
  json out = {{"traceEvents", events},
              {"displayTimeUnit", "ms"},
              {"flow", {{"schedule", schedule_name(g.spec.schedule)},
                        {"layers", g.spec.layers},
                        {"micro_batches", g.spec.micro_batches},
                        {"chunk_bytes", g.spec.chunk_bytes},
                        {"step_ms", r.step_ms},
                        {"forward_end_ms", r.forward_end_ms},
                        {"backward_end_ms", r.backward_end_ms},
                        {"compute_busy_ms", r.compute_busy_ms},
                        {"alltoall_busy_ms", r.alltoall_busy_ms},
                        {"allreduce_busy_ms", r.allreduce_busy_ms}}}};
  return out;
}

}  // namespace dmoe::flow
