// The GPU executor's host-only parts (src/flow/cuda_executor_host.cpp) and its refusals, without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
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
  fails_with("flow measure --config tiny --engine gpu", "--engine gpu: allowed: cpu, cuda");
  fails_with("flow measure --config tiny --engine cuda --dtype f16", "--dtype f16: allowed: f32, bf16");
  fails_with("flow measure --config tiny --engine cuda --batch 4 --measure-r 1,3", "--measure-r 3: must divide --batch 4");
  fails_with("flow measure --config tiny --engine cuda --batch 4 --schedule all --micro-batches 3",
             "--micro-batches 3: must be >= 1 and divide --batch 4");
  fails_with("flow measure --config tiny --engine cuda --schedule fast", "--schedule 'fast': unknown schedule");
  fails_with("flow measure --config tiny --dtype bf16", "--dtype: only with --engine cuda");
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
  fails_with(base + " --schedule pipe-attn", "--schedule pipe-attn needs --engine cuda");
  fails_with(base + " --schedule tuned --engine cuda", "--schedule tuned is not available yet");
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
