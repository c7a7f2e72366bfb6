// test_cuda_flow.cpp — Flow's GPU executor (src/flow/cuda_executor.*): one step of the GPU Mixtral model in each
// schedule's task graph gives the loss and every gradient of the sequential order (forward r = 0..R−1, backward
// r = 0..R−1 with 1/R, reduce_grads), bit for bit; the timeline (CUDA events) respects the dependencies and, with
// two ranks, shows all-to-alls overlapping compute of other micro-batches.
// Run: dmoe_gpu_tests --gtest_filter='GpuFlow*'   (and under dmoe launch -n 2 -- ... for W = 2: ranks sharing one GPU
// under MPS put the AR chunks on the model's NVSHMEM communicator in the static order, ArComm::model; with a GPU per
// rank and NCCL, on a second communicator; DMOE_FLOW_AR_COMM=own|model forces either)
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "core/random.hpp"
#include "flow/cpu_executor.hpp"
#include "flow/cuda_executor.hpp"
#include "flow/task_graph.hpp"
#include "gpu_test_util.hpp"
#include "model/cuda/cuda_mixtral.hpp"
#include "model/mixtral.hpp"
#include "model/mixtral_config.hpp"
#include "model/train_replica.hpp"
#include "model/trainer.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

// dmoe launch sets DMOE_SHARED_GPUS=1 when ranks share a GPU (MPS). There the executor puts the chunks on the model's
// communicator (ArComm::model); only a forced DMOE_FLOW_AR_COMM=own (a NCCL communicator, one GPU per rank) is refused.
bool own_ar_comm_on_shared_gpus() {
  const char* shared = std::getenv("DMOE_SHARED_GPUS");
  const char* mode = std::getenv("DMOE_FLOW_AR_COMM");
  return shared && std::strcmp(shared, "1") == 0 && mode && std::strcmp(mode, "own") == 0;
}
#define SKIP_WITHOUT_GPU()                                                                             \
  do {                                                                                                 \
    if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";                                    \
    if (own_ar_comm_on_shared_gpus())                                                                  \
      GTEST_SKIP() << "DMOE_FLOW_AR_COMM=own with ranks sharing a GPU: NCCL needs one GPU per rank";   \
  } while (0)

MixtralConfig flow_config() {
  MixtralConfig c = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/tiny.json").string());
  c.num_hidden_layers = 3;
  c.output_router_logits = true;  // the pooled aux loss crosses layers: its statistics must be there in time
  c.initializer_range = 0.1;
  c.validate();
  return c;
}

// This process's rank of the job, its model and the executor's second communicator (null: ArComm::model).
struct Job {
  int32_t rank = 0, world = 1;
  std::unique_ptr<Comm> comm, ar_comm;
  std::unique_ptr<CudaMixtralModel> model;
  ~Job() { model.reset(); }
};

std::unique_ptr<Job> open_job(const MixtralConfig& c, DType dtype, int64_t max_tokens) {
  auto j = std::make_unique<Job>();
  CudaRank r = open_cuda_rank(c, dtype, max_tokens);
  j->rank = r.rank;
  j->world = r.world;
  j->comm = std::move(r.comm);
  j->ar_comm = flow::open_cuda_allreduce_comm(*j->comm);
  j->model = std::make_unique<CudaMixtralModel>(c, dtype, *j->comm, std::move(r.backend));
  j->model->set_weights(slice_mixtral_experts(random_mixtral_weights(c, 7), j->model->first_expert(),
                                              j->model->experts_per_rank()));
  return j;
}

std::vector<int32_t> rank_tokens(const MixtralConfig& c, int32_t rank, int32_t world, int64_t n) {
  Rng rng(11);
  std::vector<int32_t> all(size_t(world * n));
  for (auto& t : all) t = int32_t(rng.next() % uint64_t(c.vocab_size));
  return std::vector<int32_t>(all.begin() + rank * n, all.begin() + (rank + 1) * n);
}

flow::GraphSpec spec_for(const MixtralConfig& c, flow::Schedule s, int32_t R, int64_t sp) {
  flow::GraphSpec spec;
  spec.layers = c.num_hidden_layers;
  spec.micro_batches = R;
  spec.schedule = s;
  flow::set_mixtral_grad_layout(spec, c, flow::cuda_mixtral_dense_grad_bytes_per_layer(c));
  spec.chunk_bytes = sp;
  return spec;
}

void expect_same_grads(const MixtralConfig& c, MixtralWeights got, MixtralWeights want, const std::string& what) {
  const std::vector<ParamView> g = parameter_views(got, c), w = parameter_views(want, c);
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) {
    int64_t differ = 0;
    for (int64_t k = 0; k < g[i].numel; ++k) differ += g[i].data[k] != w[i].data[k];
    EXPECT_EQ(differ, 0) << what << ": " << g[i].name << " differs in " << differ << " of " << g[i].numel
                         << " elements";
  }
}

void schedules_equal_sequential(DType dtype) {
  const MixtralConfig c = flow_config();
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (c.num_local_experts % world != 0) GTEST_SKIP() << "4 experts do not split over " << world << " ranks";
  const int64_t batch = 4, seq = 16;
  auto job = open_job(c, dtype, batch * seq);
  CudaMixtralModel& m = *job->model;
  const std::vector<int32_t> tokens = rank_tokens(c, job->rank, job->world, batch * seq);
  flow::CudaFlowExecutor executor(m, job->ar_comm.get());
  if (job->rank == 0)
    std::printf("[flow] W = %d, AR chunks on the %s communicator (%s)\n", job->world,
                flow::ar_comm_name(executor.ar_comm()), job->comm->name());
  struct Case {
    flow::Schedule schedule;
    int32_t R;
    int64_t sp;
  };
  // The head's chunks (final norm + lm_head, laid out first): Sp = a third of the head's bytes cuts inside it, Sp = the
  // head's bytes ends a chunk at its end; 64 B cuts every tensor.
  const int64_t head = flow::mixtral_head_grad_bytes(c), head_third = head / 3 / 4 * 4;
  for (const Case& k : {Case{flow::Schedule::vanilla, 2, 1 << 20}, Case{flow::Schedule::pipe_moe, 2, 1 << 20},
                        Case{flow::Schedule::pipe_attn, 2, 1 << 20}, Case{flow::Schedule::pipe_attn, 4, 1 << 20},
                        Case{flow::Schedule::chunked_ar, 2, 1 << 20}, Case{flow::Schedule::chunked_ar, 4, 64},
                        Case{flow::Schedule::chunked_ar, 2, head_third}, Case{flow::Schedule::chunked_ar, 4, head}}) {
    const std::string what = std::string(flow::schedule_name(k.schedule)) + " R=" + std::to_string(k.R) +
                             " Sp=" + std::to_string(k.sp) + " " + dtype_name(dtype);
    // The sequential order on the same micro-batches.
    std::vector<CudaModelState> ref(size_t(k.R));
    const int64_t micro = batch / k.R;
    m.zero_grads();
    double want_loss = 0;
    for (int32_t r = 0; r < k.R; ++r) want_loss += m.forward(tokens.data() + r * micro * seq, micro, seq, ref[size_t(r)]) / k.R;
    for (int32_t r = 0; r < k.R; ++r) m.backward(ref[size_t(r)], 1.0 / k.R);
    m.reduce_grads();
    const MixtralWeights want = m.grads();
    ref.clear();
    // The executor.
    std::vector<CudaModelState> states;
    m.zero_grads();
    const flow::TaskGraph g = flow::build_task_graph(spec_for(c, k.schedule, k.R, k.sp));
    const double loss = executor.step(g, tokens.data(), batch, seq, states);
    EXPECT_EQ(loss, want_loss) << what;
    expect_same_grads(c, m.grads(), want, what);
    states.clear();
  }
}

TEST(GpuFlow, EveryScheduleEqualsSequentialF32) {
  SKIP_WITHOUT_GPU();
  schedules_equal_sequential(DType::f32);
}

TEST(GpuFlow, EveryScheduleEqualsSequentialBf16) {
  SKIP_WITHOUT_GPU();
  schedules_equal_sequential(DType::bf16);
}

// The timeline is made of CUDA events on the three streams: each task starts after its dependencies ended, one
// stream's tasks do not overlap each other, and (W > 1, where the all-to-alls move data) some all-to-all runs while
// the compute stream runs a task of another micro-batch.
TEST(GpuFlow, TimelineRespectsDependenciesAndOverlaps) {
  SKIP_WITHOUT_GPU();
  const MixtralConfig c = flow_config();
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (c.num_local_experts % world != 0) GTEST_SKIP() << "4 experts do not split over " << world << " ranks";
  const int64_t batch = 8, seq = 64;
  auto job = open_job(c, DType::bf16, batch * seq);
  const std::vector<int32_t> tokens = rank_tokens(c, job->rank, job->world, batch * seq);
  flow::CudaFlowExecutor executor(*job->model, job->ar_comm.get());
  const flow::TaskGraph g = flow::build_task_graph(spec_for(c, flow::Schedule::chunked_ar, 4, 4096));
  std::vector<CudaModelState> states;
  std::vector<flow::TraceEvent> timeline;
  for (int step = 0; step < 3; ++step) {  // the last step's timeline, after warm-up
    job->model->zero_grads();
    executor.step(g, tokens.data(), batch, seq, states, &timeline);
  }
  ASSERT_EQ(timeline.size(), g.tasks.size());
  // The head's gradients are the first chunks, waiting for the last layer's C' (its prelude runs the head's backward)
  // of every micro-batch, and no AT': checked below against the GPU's timestamps like every other dependency.
  const flow::Task& first = g.tasks[size_t(g.allreduce_order.front())];
  ASSERT_EQ(first.deps.size(), 4u);
  for (int32_t d : first.deps) {
    EXPECT_EQ(g.tasks[size_t(d)].kind, flow::TaskKind::combine_bwd);
    EXPECT_EQ(g.tasks[size_t(d)].layer, c.num_hidden_layers - 1);
  }
  std::vector<flow::TraceEvent> by_id(g.tasks.size());
  for (const flow::TraceEvent& e : timeline) by_id[size_t(e.task)] = e;
  const double slack = 1e-3;  // ms: event timestamps have ~0.5 us resolution
  for (const flow::Task& t : g.tasks) {
    EXPECT_LE(by_id[size_t(t.id)].start_ms, by_id[size_t(t.id)].end_ms + slack) << g.describe(t.id);
    for (int32_t d : t.deps)
      EXPECT_GE(by_id[size_t(t.id)].start_ms + slack, by_id[size_t(d)].end_ms) << g.describe(t.id) << " vs "
                                                                                 << g.describe(d);
  }
  for (flow::Stream s : {flow::Stream::compute, flow::Stream::alltoall, flow::Stream::allreduce}) {
    const std::vector<int32_t>& order = g.order(s);
    for (size_t i = 1; i < order.size(); ++i)
      EXPECT_GE(by_id[size_t(order[i])].start_ms + slack, by_id[size_t(order[i - 1])].end_ms)
          << g.describe(order[i]);
  }
  if (job->world == 1) return;
  double overlap_ms = 0;
  for (int32_t a : g.alltoall_order)
    for (int32_t cpt : g.compute_order) {
      if (g.tasks[size_t(a)].micro_batch == g.tasks[size_t(cpt)].micro_batch) continue;
      const double lo = std::max(by_id[size_t(a)].start_ms, by_id[size_t(cpt)].start_ms);
      const double hi = std::min(by_id[size_t(a)].end_ms, by_id[size_t(cpt)].end_ms);
      if (hi > lo) overlap_ms += hi - lo;
    }
  EXPECT_GT(overlap_ms, 0.0) << "no all-to-all overlapped compute of another micro-batch";
  std::printf("[rank %d] all-to-all x compute overlap: %.3f ms in a %.3f ms step\n", job->rank, overlap_ms,
              timeline.back().end_ms);
}

// dmoe train --engine cuda --schedule S: the same training curve as the sequential loop (the first step's loss is
// the same double; later steps differ in the last bits, since the loop runs its backwards from r = R−1 down).
TEST(GpuFlow, TrainingWithSchedulesFollowsTheSequentialLoop) {
  SKIP_WITHOUT_GPU();
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (4 % world != 0) GTEST_SKIP() << "the tiny model's 4 experts do not split over " << world << " ranks";
  const MixtralConfig c = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/tiny.json").string());
  TrainOptions o;
  o.data_path = (fs::path(DMOE_SOURCE_DIR) / "tests" / "data" / "train_text.txt").string();
  o.steps = 6;
  o.seq = 32;
  o.batch = 4 * world;
  o.world = world;
  o.micro_batches = 2;
  o.warmup = 2;
  o.print_every = 0;
  o.engine = "cuda";
  auto quiet = [](const std::string&) {};
  const TrainResult base = train_mixtral(c, o, quiet);
  for (const char* s : {"vanilla", "pipe-moe", "pipe-attn", "chunked-ar"}) {
    o.schedule = s;
    o.chunk_bytes = 4096;
    const TrainResult flow_run = train_mixtral(c, o, quiet);
    if (rank != 0) continue;
    ASSERT_EQ(flow_run.records.size(), base.records.size()) << s;
    EXPECT_EQ(flow_run.records[0].loss, base.records[0].loss) << s;
    for (size_t i = 0; i < base.records.size(); ++i)
      EXPECT_NEAR(flow_run.records[i].loss, base.records[i].loss, 1e-4 * base.records[i].loss) << s << " step " << i + 1;
    EXPECT_NEAR(flow_run.final_val_loss, base.final_val_loss, 1e-4 * base.final_val_loss) << s;
  }
}

}  // namespace
}  // namespace dmoe
