// task_graph.cpp — building Flow's static task graph (see task_graph.hpp for the tasks and schedules).
#include "flow/task_graph.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dmoe::flow {

const char* task_kind_name(TaskKind kind) {
  switch (kind) {
    case TaskKind::attention_fwd: return "AT";
    case TaskKind::dispatch_fwd: return "D";
    case TaskKind::expert_fwd: return "E";
    case TaskKind::combine_fwd: return "C";
    case TaskKind::combine_bwd: return "C'";
    case TaskKind::expert_bwd: return "E'";
    case TaskKind::dispatch_bwd: return "D'";
    case TaskKind::attention_bwd: return "AT'";
    case TaskKind::allreduce: return "AR";
  }
  return "?";
}

const char* stream_name(Stream stream) {
  switch (stream) {
    case Stream::compute: return "compute";
    case Stream::alltoall: return "alltoall";
    case Stream::allreduce: return "allreduce";
  }
  return "?";
}

const char* schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::vanilla: return "vanilla";
    case Schedule::pipe_moe: return "pipe-moe";
    case Schedule::pipe_attn: return "pipe-attn";
    case Schedule::chunked_ar: return "chunked-ar";
    case Schedule::tuned: return "tuned";
  }
  return "?";
}

Schedule parse_schedule(const std::string& name, const char* field) {
  for (Schedule s : {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar, Schedule::tuned})
    if (name == schedule_name(s)) return s;
  DMOE_FAIL_INPUT("{} '{}': unknown schedule (allowed: vanilla, pipe-moe, pipe-attn, chunked-ar, tuned)", field, name);
}

Stream stream_of(TaskKind kind) {
  switch (kind) {
    case TaskKind::dispatch_fwd:
    case TaskKind::combine_fwd:
    case TaskKind::combine_bwd:
    case TaskKind::dispatch_bwd: return Stream::alltoall;
    case TaskKind::allreduce: return Stream::allreduce;
    default: return Stream::compute;
  }
}

namespace {

bool is_chunked(Schedule s) { return s == Schedule::chunked_ar || s == Schedule::tuned; }

int64_t num_allreduce_tasks(const GraphSpec& spec) {
  const int64_t total = ReplicatedLayout(spec).total();
  if (total == 0) return 0;
  if (!is_chunked(spec.schedule)) return 1;
  return ceil_div(total, spec.chunk_bytes);
}

}  // namespace

bool same_spec(const GraphSpec& a, const GraphSpec& b) {
  return a.layers == b.layers && a.micro_batches == b.micro_batches && a.schedule == b.schedule &&
         a.dense_grad_bytes_per_layer == b.dense_grad_bytes_per_layer && a.chunk_bytes == b.chunk_bytes &&
         a.head_grad_bytes == b.head_grad_bytes && a.embed_grad_bytes == b.embed_grad_bytes;
}

void validate(const GraphSpec& spec) {
  DMOE_REQUIRE(spec.layers >= 1 && spec.layers <= 100000, "layers {}: must be in [1, 100000]", spec.layers);
  DMOE_REQUIRE(spec.micro_batches >= 1 && spec.micro_batches <= 4096, "micro_batches {}: must be in [1, 4096]",
               spec.micro_batches);
  DMOE_REQUIRE(spec.dense_grad_bytes_per_layer >= 0 && spec.dense_grad_bytes_per_layer <= (int64_t(1) << 40),
               "dense_grad_bytes_per_layer {}: must be in [0, 2^40]", spec.dense_grad_bytes_per_layer);
  DMOE_REQUIRE(spec.head_grad_bytes >= 0 && spec.head_grad_bytes <= (int64_t(1) << 40),
               "head_grad_bytes {}: must be in [0, 2^40]", spec.head_grad_bytes);
  DMOE_REQUIRE(spec.embed_grad_bytes >= 0 && spec.embed_grad_bytes <= (int64_t(1) << 40),
               "embed_grad_bytes {}: must be in [0, 2^40]", spec.embed_grad_bytes);
  if (is_chunked(spec.schedule))
    DMOE_REQUIRE_INPUT(spec.chunk_bytes >= 1 && spec.chunk_bytes <= kMaxChunkBytes, "chunk_bytes {}: must be in [1, "
                       "2^40] for schedule {} (a chunk at least as large as the gradients is one all-reduce)",
                       spec.chunk_bytes, schedule_name(spec.schedule));
  const int64_t tasks = 8 * int64_t(spec.layers) * spec.micro_batches + num_allreduce_tasks(spec);
  // Worded by schedule (G21-12 of the twenty-first pass): "raise chunk_bytes" was the advice for vanilla and pipe-moe,
  // which refuse --chunk-bytes, and layers, the main factor, was not named.
  if (is_chunked(spec.schedule))
    DMOE_REQUIRE_INPUT(tasks <= kMaxTasks, "schedule {}, layers {}, micro_batches {}, chunk_bytes {} "
                       "(dense_grad_bytes_per_layer {}): {} tasks, more than the {} allowed (8 per layer and "
                       "micro-batch, and {} all-reduce chunks); lower layers (--layers, or a model's "
                       "num_hidden_layers) or micro_batches (--micro-batches), or raise chunk_bytes (--chunk-bytes)", schedule_name(spec.schedule),
                       spec.layers, spec.micro_batches, spec.chunk_bytes, spec.dense_grad_bytes_per_layer, tasks,
                       kMaxTasks, num_allreduce_tasks(spec));
  DMOE_REQUIRE_INPUT(tasks <= kMaxTasks, "schedule {}, layers {}, micro_batches {}: {} tasks, more than the {} "
                     "allowed (8 per layer and micro-batch, and {} all-reduce); lower layers (--layers, or a model's "
                     "num_hidden_layers) or micro_batches (--micro-batches): schedule {} has no chunk_bytes to raise",
                     schedule_name(spec.schedule), spec.layers, spec.micro_batches, tasks, kMaxTasks,
                     num_allreduce_tasks(spec), schedule_name(spec.schedule));
}

const std::vector<int32_t>& TaskGraph::order(Stream s) const {
  switch (s) {
    case Stream::alltoall: return alltoall_order;
    case Stream::allreduce: return allreduce_order;
    default: return compute_order;
  }
}

std::string TaskGraph::describe(int32_t task_id) const {
  DMOE_REQUIRE(task_id >= 0 && task_id < int32_t(tasks.size()), "task id {}: must be in [0, {})", task_id,
               tasks.size());
  const Task& t = tasks[size_t(task_id)];
  if (t.kind == TaskKind::allreduce) return fmt::format("AR[chunk {}, {} B]", t.chunk, t.bytes);
  if (t.micro_batch < 0) return fmt::format("{}[l={},all]", task_kind_name(t.kind), t.layer);
  return fmt::format("{}[l={},r={}]", task_kind_name(t.kind), t.layer, t.micro_batch);
}

TaskGraph build_task_graph(const GraphSpec& spec) {
  validate(spec);
  const int32_t L = spec.layers, R = spec.micro_batches;
  const bool vanilla = spec.schedule == Schedule::vanilla;
  const bool whole_attention = spec.schedule == Schedule::pipe_moe;  // AT/AT' on the whole batch
  TaskGraph g;
  g.spec = spec;
  g.tasks.reserve(size_t(8 * int64_t(L) * R + num_allreduce_tasks(spec)));

  // ids[kind][l][r]; whole-batch tasks are stored at every r of their layer.
  std::vector<std::vector<std::vector<int32_t>>> ids(
      kNumTaskKinds, std::vector<std::vector<int32_t>>(size_t(L), std::vector<int32_t>(size_t(R), -1)));
  auto id = [&](TaskKind k, int32_t l, int32_t r) { return ids[size_t(k)][size_t(l)][size_t(r)]; };
  int32_t previous = -1;  // vanilla: the previous task in the sequential order
  auto add = [&](TaskKind kind, int32_t layer, int32_t r, std::vector<int32_t> deps) {
    Task t;
    t.id = int32_t(g.tasks.size());
    t.kind = kind;
    t.stream = stream_of(kind);
    t.layer = layer;
    t.micro_batch = r;
    t.num_micro_batches = r < 0 ? R : 1;
    if (vanilla && previous >= 0) deps.push_back(previous);
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
    t.deps = std::move(deps);
    if (layer >= 0) {
      if (r < 0)
        for (int32_t q = 0; q < R; ++q) ids[size_t(kind)][size_t(layer)][size_t(q)] = t.id;
      else
        ids[size_t(kind)][size_t(layer)][size_t(r)] = t.id;
    }
    previous = t.id;
    g.tasks.push_back(std::move(t));
    return g.tasks.back().id;
  };
  auto all_r = [&](TaskKind k, int32_t l) {
    std::vector<int32_t> v;
    for (int32_t r = 0; r < R; ++r) v.push_back(id(k, l, r));
    return v;
  };

  // True dependencies, one function per kind (shared by every schedule).
  auto add_at_fwd = [&](int32_t l, int32_t r) {  // r = -1: whole batch
    std::vector<int32_t> deps;
    if (l > 0) deps = r < 0 ? all_r(TaskKind::combine_fwd, l - 1) : std::vector<int32_t>{id(TaskKind::combine_fwd, l - 1, r)};
    add(TaskKind::attention_fwd, l, r, deps);
  };
  auto add_fwd = [&](TaskKind k, TaskKind before, int32_t l, int32_t r) { add(k, l, r, {id(before, l, r)}); };
  auto add_combine_bwd = [&](int32_t l, int32_t r) {
    // The last layer's output gradient needs the micro-batch's forward (the head's loss is folded into C).
    add(TaskKind::combine_bwd, l, r,
        {l == L - 1 ? id(TaskKind::combine_fwd, l, r) : id(TaskKind::attention_bwd, l + 1, r)});
  };
  auto add_at_bwd = [&](int32_t l, int32_t r) {
    add(TaskKind::attention_bwd, l, r,
        r < 0 ? all_r(TaskKind::dispatch_bwd, l) : std::vector<int32_t>{id(TaskKind::dispatch_bwd, l, r)});
  };

  if (vanilla) {
    for (int32_t r = 0; r < R; ++r)
      for (int32_t l = 0; l < L; ++l) {
        add_at_fwd(l, r);
        add_fwd(TaskKind::dispatch_fwd, TaskKind::attention_fwd, l, r);
        add_fwd(TaskKind::expert_fwd, TaskKind::dispatch_fwd, l, r);
        add_fwd(TaskKind::combine_fwd, TaskKind::expert_fwd, l, r);
      }
    g.num_forward_tasks = int32_t(g.tasks.size());
    for (int32_t r = 0; r < R; ++r)
      for (int32_t l = L - 1; l >= 0; --l) {
        add_combine_bwd(l, r);
        add_fwd(TaskKind::expert_bwd, TaskKind::combine_bwd, l, r);
        add_fwd(TaskKind::dispatch_bwd, TaskKind::expert_bwd, l, r);
        add_at_bwd(l, r);
      }
  } else {
    for (int32_t l = 0; l < L; ++l) {
      if (whole_attention)
        add_at_fwd(l, -1);
      else
        for (int32_t r = 0; r < R; ++r) add_at_fwd(l, r);
      for (int32_t r = 0; r < R; ++r) add_fwd(TaskKind::dispatch_fwd, TaskKind::attention_fwd, l, r);
      for (int32_t r = 0; r < R; ++r) add_fwd(TaskKind::expert_fwd, TaskKind::dispatch_fwd, l, r);
      for (int32_t r = 0; r < R; ++r) add_fwd(TaskKind::combine_fwd, TaskKind::expert_fwd, l, r);
    }
    g.num_forward_tasks = int32_t(g.tasks.size());
    for (int32_t l = L - 1; l >= 0; --l) {
      for (int32_t r = 0; r < R; ++r) add_combine_bwd(l, r);
      for (int32_t r = 0; r < R; ++r) add_fwd(TaskKind::expert_bwd, TaskKind::combine_bwd, l, r);
      for (int32_t r = 0; r < R; ++r) add_fwd(TaskKind::dispatch_bwd, TaskKind::expert_bwd, l, r);
      if (whole_attention)
        add_at_bwd(l, -1);
      else
        for (int32_t r = 0; r < R; ++r) add_at_bwd(l, r);
    }
  }

  // The all-reduce. The replicated gradients are laid out in the order backward completes them
  // (ReplicatedLayout: head, layer L−1 … layer 0, embedding), so chunk k covers bytes [k·Sp, min((k+1)·Sp, total))
  // and depends on every task that writes any of its bytes, for every micro-batch: C'[L−1, r] for the head's
  // bytes (its prelude runs the head's backward), AT'[l, r] for layer l's, AT'[0, r] for the embedding's.
  const ReplicatedLayout lay(spec);
  const int64_t total = lay.total(), per_layer = spec.dense_grad_bytes_per_layer;
  const int64_t num_ar = num_allreduce_tasks(spec);
  for (int64_t k = 0; k < num_ar; ++k) {
    const int64_t begin = is_chunked(spec.schedule) ? k * spec.chunk_bytes : 0;
    // (k + 1)·Sp is below total + Sp; past total only for the last chunk, where Sp may be large: no overflow either way.
    const int64_t end = is_chunked(spec.schedule) ? (total - begin <= spec.chunk_bytes ? total : begin + spec.chunk_bytes)
                                                  : total;
    std::vector<int32_t> deps;
    auto append = [&](const std::vector<int32_t>& v) { deps.insert(deps.end(), v.begin(), v.end()); };
    if (begin < lay.layers_begin()) append(all_r(TaskKind::combine_bwd, L - 1));
    const int64_t lo = std::max(begin, lay.layers_begin()), hi = std::min(end, lay.embed_begin());
    if (lo < hi)  // layer indices in the layout: i = L−1−l
      for (int64_t i = (lo - lay.layers_begin()) / per_layer; i <= (hi - 1 - lay.layers_begin()) / per_layer; ++i)
        append(all_r(TaskKind::attention_bwd, L - 1 - int32_t(i)));
    if (end > lay.embed_begin()) append(all_r(TaskKind::attention_bwd, 0));
    const int32_t ar = add(TaskKind::allreduce, -1, -1, std::move(deps));
    g.tasks[size_t(ar)].chunk = int32_t(k);
    g.tasks[size_t(ar)].bytes = end - begin;
    g.tasks[size_t(ar)].offset = begin;
    g.tasks[size_t(ar)].num_micro_batches = R;
  }

  // Issue orders: the creation order filtered by stream. Creation follows the schedule's per-stream order
  // (per layer AT_1..AT_R then E_1..E_R on compute, D_1..D_R then C_1..C_R on the all-to-all communicator;
  // backward mirrored; vanilla: the sequential order), so this is a pure function of the spec.
  for (const Task& t : g.tasks) {
    switch (t.stream) {
      case Stream::compute: g.compute_order.push_back(t.id); break;
      case Stream::alltoall: g.alltoall_order.push_back(t.id); break;
      case Stream::allreduce: g.allreduce_order.push_back(t.id); break;
    }
  }
  check_task_graph(g);
  return g;
}

void check_task_graph(const TaskGraph& g) {
  const int32_t n = int32_t(g.tasks.size());
  std::vector<int32_t> position(size_t(n), -1);  // index in its stream's order
  for (Stream s : {Stream::compute, Stream::alltoall, Stream::allreduce}) {
    const auto& order = g.order(s);
    for (size_t i = 0; i < order.size(); ++i) {
      const int32_t t = order[i];
      DMOE_REQUIRE(t >= 0 && t < n, "{} order[{}] = {}: not a task id (tasks: {})", stream_name(s), i, t, n);
      DMOE_REQUIRE(position[size_t(t)] < 0, "task {} appears twice in the stream orders", g.describe(t));
      DMOE_REQUIRE(g.tasks[size_t(t)].stream == s, "task {} is on stream {} but listed in the {} order",
                   g.describe(t), stream_name(g.tasks[size_t(t)].stream), stream_name(s));
      position[size_t(t)] = int32_t(i);
    }
  }
  std::vector<std::vector<int32_t>> successors(static_cast<size_t>(n));
  std::vector<int32_t> indegree(size_t(n), 0);
  for (int32_t i = 0; i < n; ++i) {
    const Task& t = g.tasks[size_t(i)];
    DMOE_REQUIRE(t.id == i, "tasks[{}].id = {}: must equal its index", i, t.id);
    DMOE_REQUIRE(position[size_t(i)] >= 0, "task {} is in no stream order", g.describe(i));
    for (int32_t d : t.deps) {
      DMOE_REQUIRE(d >= 0 && d < n && d != i, "task {}: dependency {} is not another task", g.describe(i), d);
      successors[size_t(d)].push_back(i);
      ++indegree[size_t(i)];
    }
  }
  for (Stream s : {Stream::compute, Stream::alltoall, Stream::allreduce}) {
    const auto& order = g.order(s);
    for (size_t i = 1; i < order.size(); ++i) {
      successors[size_t(order[i - 1])].push_back(order[i]);
      ++indegree[size_t(order[i])];
    }
  }
  // Kahn's algorithm over dependency + stream-order edges: all tasks must be reached.
  std::vector<int32_t> ready;
  for (int32_t i = 0; i < n; ++i)
    if (indegree[size_t(i)] == 0) ready.push_back(i);
  int32_t reached = 0;
  while (!ready.empty()) {
    const int32_t t = ready.back();
    ready.pop_back();
    ++reached;
    for (int32_t s : successors[size_t(t)])
      if (--indegree[size_t(s)] == 0) ready.push_back(s);
  }
  if (reached != n) {
    for (int32_t i = 0; i < n; ++i)
      DMOE_REQUIRE(indegree[size_t(i)] == 0,
                   "the dependencies and stream orders form a cycle ({} of {} tasks unreachable, e.g. {}): a stream "
                   "would wait forever",
                   n - reached, n, g.describe(i));
  }
}

}  // namespace dmoe::flow
