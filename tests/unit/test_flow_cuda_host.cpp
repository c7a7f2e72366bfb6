// The GPU executor's host-only parts (src/flow/cuda_executor_host.cpp) and its refusals, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>

#include "cli_test_util.hpp"
#include "core/error.hpp"
#include "flow/cuda_executor.hpp"
#include "flow/task_graph.hpp"
#include "model/mixtral_config.hpp"

namespace dmoe::flow {
namespace {

TEST(FlowCudaHost, MergedIssueOrderKeepsStreamOrdersAndDependencies) {
  for (Schedule s : {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar})
    for (int32_t R : {1, 2, 4})
      for (int32_t L : {1, 3}) {
        GraphSpec spec;
        spec.layers = L;
        spec.micro_batches = R;
        spec.schedule = s;
        spec.dense_grad_bytes_per_layer = 1000;
        spec.chunk_bytes = 256;
        const TaskGraph g = build_task_graph(spec);
        const std::vector<int32_t> order = merged_issue_order(g);
        ASSERT_EQ(order.size(), g.compute_order.size() + g.alltoall_order.size());
        std::vector<int32_t> position(g.tasks.size(), -1);
        for (size_t i = 0; i < order.size(); ++i) position[size_t(order[i])] = int32_t(i);
        for (const auto* stream : {&g.compute_order, &g.alltoall_order})
          for (size_t i = 1; i < stream->size(); ++i)
            EXPECT_LT(position[size_t((*stream)[i - 1])], position[size_t((*stream)[i])]);
        for (int32_t id : order)
          for (int32_t d : g.tasks[size_t(id)].deps) {
            ASSERT_GE(position[size_t(d)], 0) << g.describe(id) << " depends on " << g.describe(d);
            EXPECT_LT(position[size_t(d)], position[size_t(id)]) << g.describe(id);
          }
        // All-to-all first: D[l, r] comes right after AT[l, r] when that is its only dependency (pipe-attn).
        if (s == Schedule::pipe_attn && R > 1) {
          const int32_t d0 = g.alltoall_order[0];
          EXPECT_EQ(position[size_t(d0)], 1) << g.describe(order[1]);
        }
        EXPECT_EQ(order, merged_issue_order(g));  // a pure function of the graph
      }
}

GraphSpec host_spec(Schedule s, int32_t L, int32_t R, int64_t dense, int64_t sp) {
  GraphSpec spec;
  spec.layers = L;
  spec.micro_batches = R;
  spec.schedule = s;
  spec.dense_grad_bytes_per_layer = dense;
  spec.chunk_bytes = sp;
  return spec;
}

// Short names for the hand-written expected orders: "AT'10" = AT'[l=1, r=0], "ch2" = AR chunk 2.
std::string short_name(const TaskGraph& g, int32_t id) {
  const Task& t = g.tasks[size_t(id)];
  if (t.kind == TaskKind::allreduce) return "ch" + std::to_string(t.chunk);
  return std::string(task_kind_name(t.kind)) + std::to_string(t.layer) + std::to_string(t.micro_batch);
}
std::string names(const TaskGraph& g, const std::vector<int32_t>& order) {
  std::string out;
  for (int32_t id : order) {
    if (!out.empty()) out += ' ';
    out += short_name(g, id);
  }
  return out;
}

// L = 2, R = 2, chunked-ar, 4 chunks (two per layer): the orders worked out by hand from the rule.
TEST(FlowCudaHost, SingleCommIssueOrderOfASmallGraph) {
  const TaskGraph g = build_task_graph(host_spec(Schedule::chunked_ar, 2, 2, 1000, 500));
  const std::string forward = "AT00 D00 AT01 D01 E00 C00 E01 C01 AT10 D10 AT11 D11 E10 C10 E11 C11 ";
  const std::string backward = "C'10 C'11 E'10 D'10 E'11 D'11 AT'10 C'00 AT'11 C'01 ";
  // One chunk per gap: chunk 0 once AT'[1, 0..1] are issued, behind C'[0, 1] (issued at the same point); chunk 1
  // in the next gap (D'[0, 0] waits for E'[0, 0]); layer 0's chunks after its last AT'.
  EXPECT_EQ(names(g, single_comm_issue_order(g, 1)), forward + backward + "ch0 E'00 D'00 ch1 E'01 D'01 AT'00 AT'01 ch2 ch3");
  // No limit: all of a layer's chunks right behind the all-to-all issued where they became available.
  EXPECT_EQ(names(g, single_comm_issue_order(g, 0)), forward + backward + "ch0 ch1 E'00 D'00 E'01 D'01 AT'00 AT'01 ch2 ch3");
  // With the head's gradients laid out first (500 B: one chunk) and the embedding's last (500 B): the head's chunk
  // goes in the first gap of the backward, behind C'[1, 1] (the all-to-all issued where it became placeable; D'[1, 0]
  // waits for E'[1, 0]); the layers' chunks move one down; the embedding's goes at the end.
  GraphSpec with_head = host_spec(Schedule::chunked_ar, 2, 2, 1000, 500);
  with_head.head_grad_bytes = 500;
  with_head.embed_grad_bytes = 500;
  const TaskGraph h = build_task_graph(with_head);
  EXPECT_EQ(names(h, single_comm_issue_order(h, 1)),
            forward + "C'10 C'11 ch0 E'10 D'10 E'11 D'11 AT'10 C'00 AT'11 C'01 ch1 E'00 D'00 ch2 E'01 D'01 AT'00 AT'01 "
                      "ch3 ch4 ch5");
  // Whole AR (pipe-attn): one task, after everything.
  const TaskGraph p = build_task_graph(host_spec(Schedule::pipe_attn, 2, 2, 1000, 500));
  const std::vector<int32_t> po = single_comm_issue_order(p, 1);
  EXPECT_EQ(short_name(p, po.back()), "ch0");
  EXPECT_EQ(short_name(p, po[po.size() - 2]), "AT'01");
}

// Every task once; each stream's order and every dependency respected; the chunks where the rule puts them; without
// the chunks it is merged_issue_order; the same order for the same graph.
TEST(FlowCudaHost, SingleCommIssueOrderFollowsTheRule) {
  for (Schedule s : {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar, Schedule::tuned})
    for (int32_t R : {1, 2, 4})
      for (int32_t L : {1, 3})
        for (int64_t sp : {64, 256, 1000, 4096})
          for (int32_t per_gap : {0, 1, 2})
            for (bool with_head : {false, true}) {  // the head's (700 B) and the embedding's (300 B) chunks too
            GraphSpec spec = host_spec(s, L, R, 1000, sp);
            if (with_head) spec.head_grad_bytes = 700, spec.embed_grad_bytes = 300;
            const TaskGraph g = build_task_graph(spec);
            const std::string what = std::string(schedule_name(s)) + " L=" + std::to_string(L) + " R=" +
                                     std::to_string(R) + " Sp=" + std::to_string(sp) + " per_gap=" +
                                     std::to_string(per_gap) + (with_head ? " with head" : "");
            const std::vector<int32_t> order = single_comm_issue_order(g, per_gap);
            ASSERT_EQ(order.size(), g.tasks.size()) << what;
            std::vector<int32_t> position(g.tasks.size(), -1);
            for (size_t i = 0; i < order.size(); ++i) {
              ASSERT_EQ(position[size_t(order[i])], -1) << what << ": " << g.describe(order[i]) << " twice";
              position[size_t(order[i])] = int32_t(i);
            }
            for (Stream st : {Stream::compute, Stream::alltoall, Stream::allreduce}) {
              const std::vector<int32_t>& so = g.order(st);
              for (size_t i = 1; i < so.size(); ++i)
                EXPECT_LT(position[size_t(so[i - 1])], position[size_t(so[i])]) << what << ": " << g.describe(so[i]);
            }
            for (int32_t id : order)
              for (int32_t d : g.tasks[size_t(id)].deps)
                EXPECT_LT(position[size_t(d)], position[size_t(id)]) << what << ": " << g.describe(id);
            auto issuable_at = [&](int32_t id, int32_t p) {  // all dependencies placed before position p
              for (int32_t d : g.tasks[size_t(id)].deps)
                if (position[size_t(d)] >= p) return false;
              return true;
            };
            int32_t last_compute = -1, chunks_since = 0;
            for (int32_t p = 0; p < int32_t(order.size()); ++p) {
              const Task& t = g.tasks[size_t(order[size_t(p)])];
              if (t.stream == Stream::compute) {
                // Nothing that could go before a compute task was left waiting: no issuable all-to-all and, while the
                // gap's budget lasts, no issuable chunk.
                for (int32_t a : g.alltoall_order)
                  if (position[size_t(a)] > p) {
                    EXPECT_FALSE(issuable_at(a, p)) << what << ": " << g.describe(t.id) << " before " << g.describe(a);
                    break;
                  }
                if (per_gap == 0 || chunks_since < per_gap)
                  for (int32_t k : g.allreduce_order)
                    if (position[size_t(k)] > p) {
                      EXPECT_FALSE(issuable_at(k, p)) << what << ": " << g.describe(t.id) << " before " << g.describe(k);
                      break;
                    }
                last_compute = p;
                chunks_since = 0;
              } else if (t.stream == Stream::allreduce) {
                // A chunk never goes ahead of an all-to-all whose dependencies are all placed.
                for (int32_t a : g.alltoall_order)
                  if (position[size_t(a)] > p) {
                    EXPECT_FALSE(issuable_at(a, p)) << what << ": " << g.describe(t.id) << " before " << g.describe(a);
                    break;
                  }
                ++chunks_since;
                // At most per_gap chunks beside one compute task, except after the last one (the end of the AR).
                const bool after_all_compute = last_compute == position[size_t(g.compute_order.back())];
                if (per_gap > 0 && !after_all_compute) {
                  EXPECT_LE(chunks_since, per_gap) << what << ": " << g.describe(t.id);
                }
              }
            }
            std::vector<int32_t> without_chunks;
            for (int32_t id : order)
              if (g.tasks[size_t(id)].stream != Stream::allreduce) without_chunks.push_back(id);
            EXPECT_EQ(without_chunks, merged_issue_order(g)) << what;
            EXPECT_EQ(order, single_comm_issue_order(build_task_graph(g.spec), per_gap)) << what;  // a pure function
          }
}

TEST(FlowCudaHost, ArCommModeFromTheEnvironment) {
  // auto: the model's communicator wherever a second one cannot be opened (shared GPU, NVSHMEM); NCCL keeps its own.
  EXPECT_EQ(choose_ar_comm(nullptr, 2, true, "nvshmem"), ArComm::model);
  EXPECT_EQ(choose_ar_comm("", 2, false, "nvshmem"), ArComm::model);
  EXPECT_EQ(choose_ar_comm("auto", 4, true, "nccl"), ArComm::model);
  EXPECT_EQ(choose_ar_comm(nullptr, 2, false, "nccl"), ArComm::own);
  EXPECT_EQ(choose_ar_comm(nullptr, 1, false, "local"), ArComm::own);
  EXPECT_EQ(choose_ar_comm("own", 2, true, "nvshmem"), ArComm::own);  // forced (refused later: NCCL on a shared GPU)
  EXPECT_EQ(choose_ar_comm("model", 2, false, "nccl"), ArComm::model);
  EXPECT_EQ(choose_ar_comm("model", 1, false, "local"), ArComm::model);
  try {
    choose_ar_comm("nccl", 2, false, "nccl");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DMOE_FLOW_AR_COMM='nccl' is invalid: allowed: auto, own, model"),
              std::string::npos) << e.what();
  }
  EXPECT_STREQ(ar_comm_name(ArComm::own), "own");
  EXPECT_STREQ(ar_comm_name(ArComm::model), "model");
  EXPECT_EQ(chunks_per_gap_from_env(nullptr), 1);
  EXPECT_EQ(chunks_per_gap_from_env(""), 1);
  EXPECT_EQ(chunks_per_gap_from_env("0"), 0);
  EXPECT_EQ(chunks_per_gap_from_env("3"), 3);
  for (const char* bad : {"-1", "x", "2x", "+2", "99999999999"}) EXPECT_THROW(chunks_per_gap_from_env(bad), Error) << bad;
  EXPECT_EQ(chunks_per_gap_from_env("2147483647"), 2147483647);
}

TEST(FlowCudaHost, DenseBytesPerLayerCountRouterNormsAndAttention) {
  MixtralConfig c;
  c.hidden_size = 64;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_local_experts = 4;
  const int64_t H = 64, Q = c.q_size(), KV = c.kv_size();
  EXPECT_EQ(cuda_mixtral_dense_grad_bytes_per_layer(c), 4 * (2 * H + 2 * Q * H + 2 * KV * H + 4 * H));
}

TEST(FlowCudaHost, MeasureEngineCudaBadInputNamesWhatIsAllowed) {
  auto fails_with = [](const std::string& args, const std::string& needle) {
    const test::CliResult r = test::run_cli(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\n" << r.output;
  };
  fails_with("flow measure --config tiny --engine tpu", "--engine 'tpu' is not an engine; allowed: cpu, cuda (aliases ep, gpu)");
  fails_with("flow measure --config tiny --engine flash", "--engine flash: the whole model runs its MoE layers on the EP");
  // ep and gpu name the GPU executor (one vocabulary with run and bench): its own rules apply.
  fails_with("flow measure --config tiny --engine ep --dtype f16", "--dtype f16: allowed: f32, bf16");
  fails_with("flow measure --config tiny --engine cuda --dtype f16", "--dtype f16: allowed: f32, bf16");
  fails_with("flow measure --config tiny --engine cuda --batch 4 --measure-r 1,3", "--measure-r 3: must divide --batch 4");
  fails_with("flow measure --config tiny --engine cuda --batch 4 --schedule all --micro-batches 3",
             "--micro-batches 3: must be >= 1 and divide --batch 4");
  fails_with("flow measure --config tiny --engine cuda --schedule fast", "--schedule 'fast': unknown schedule");
  fails_with("flow measure --config tiny --dtype bf16", "--dtype is an option of flow measure --engine cuda");
}

TEST(FlowCudaHost, TrainScheduleBadInputNamesWhatIsAllowed) {
  const std::string base = std::string("train --config tiny --steps 1 --batch 2 --seq 8 --data ") + DMOE_SOURCE_DIR +
                           "/tests/data/train_text.txt";
  auto fails_with = [](const std::string& args, const std::string& needle) {
    const test::CliResult r = test::run_cli(args);
    EXPECT_NE(r.status, 0) << args;
    EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\n" << r.output;
  };
  fails_with(base + " --schedule fast", "--schedule 'fast': unknown schedule");
  fails_with(base + " --schedule tuned --engine cuda --micro-batches 2", "--schedule tuned chooses R itself");
  fails_with(base + " --schedule tuned --engine cuda --tune-samples 1", "--tune-samples 1 must be >= 2");
  // options of one schedule given to another would be ignored: refused
  fails_with(base + " --tune-samples 3", "--tune-samples is an option of --schedule tuned (this run: no --schedule)");
  fails_with(base + " --schedule pipe-attn --engine cuda --tune-file x.json",
             "--tune-file is an option of --schedule tuned (this run: --schedule pipe-attn)");
  fails_with(base + " --schedule pipe-moe --engine cuda --chunk-bytes 4096",
             "--chunk-bytes is the chunk of --schedule chunked-ar (this run: --schedule pipe-moe");
  // checked before any GPU work: the tuning must fit into the run, and a --tune-file that is some other JSON is
  // refused, not replaced
  fails_with(base + " --schedule tuned --engine cuda", "= 36 steps, more than the 1 this run has");
  const std::string other = testing::TempDir() + "/not_a_tuning_file.json";
  {
    std::ofstream f(other);
    f << "{\"loss\": 1.5}\n";
  }
  fails_with(base + " --schedule tuned --engine cuda --tune-file " + other, "not a Flow tuning file");
  std::ifstream back(other);
  const std::string kept((std::istreambuf_iterator<char>(back)), std::istreambuf_iterator<char>());
  EXPECT_EQ(kept, "{\"loss\": 1.5}\n");
  fails_with(base + " --schedule chunked-ar --engine cuda --chunk-bytes 6", "--chunk-bytes 6 must be a positive multiple of 4");
}

#if !defined(DMOE_WITH_CUDA)
TEST(FlowCudaHost, CpuOnlyBuildRefusesTheGpuExecutor) {
  const test::CliResult r = test::run_cli("flow measure --config tiny --engine cuda --batch 2 --seq 8 --measure-r 1,2");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("built without CUDA"), std::string::npos) << r.output;
  MixtralConfig c;
  EXPECT_THROW(CudaFlowSession(c, MixtralWeights{}, DType::f32, 16), Error);
  const test::CliResult t = test::run_cli(std::string("train --config tiny --steps 1 --batch 2 --seq 8 --engine cuda "
                                                      "--schedule pipe-attn --data ") + DMOE_SOURCE_DIR +
                                          "/tests/data/train_text.txt");
  EXPECT_NE(t.status, 0);
  EXPECT_NE(t.output.find("built without CUDA"), std::string::npos) << t.output;
}
#endif

}  // namespace
}  // namespace dmoe::flow
