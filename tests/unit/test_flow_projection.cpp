// test_flow_projection.cpp — per-task costs from a model, a batch and a cluster (src/flow/projection.*), the
// cluster file's checks, and `dmoe flow project`.
//
// Run: dmoe_unit_tests --gtest_filter='FlowProjection*'
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.hpp"
#include "flow/cpu_executor.hpp"
#include "flow/projection.hpp"
#include "flow_test_util.hpp"

namespace dmoe::flow {
namespace {

using nlohmann::json;
using test::error_of;

ClusterModel cluster() {
  ClusterModel c;
  c.name = "test";
  c.flop_per_s = 1e12;            // 1e9 FLOP per ms
  c.nvlink_bytes_per_s = 100e9;   // 1e8 B per ms
  c.net_bytes_per_s = 10e9;       // 1e7 B per ms
  c.gpus_per_node = 4;
  c.compute_fixed_ms = 0.01;
  c.alltoall_fixed_ms = 0.02;
  c.allreduce_alpha_ms = 0.03;
  return c;
}

ProjectionSpec spec() {
  ProjectionSpec s;
  s.model.hidden_size = 64;
  s.model.intermediate_size = 128;
  s.model.num_hidden_layers = 3;
  s.model.num_attention_heads = 4;
  s.model.num_key_value_heads = 2;
  s.model.num_local_experts = 8;
  s.model.num_experts_per_tok = 2;
  s.batch = 2;
  s.seq = 8;
  s.gpus = 8;
  s.act_bytes = 2;
  return s;
}

TEST(FlowProjection, CostsAreTheFormulasOfTheHeader) {
  const ProjectionSpec s = spec();
  const CostModel c = project_costs(s, cluster());
  const double T = 16, H = 64, Q = 64, KV = 32, I = 128, E = 8, k = 2, D = 16;  // head size 64 / 4
  const double at = 2 * T * H * (Q + 2 * KV) + 2 * T * Q * H + 2 * 2 * 4 * 8 * 8 * D + 2 * T * H * E;
  const double ex = 2 * T * k * 3 * H * I;
  EXPECT_EQ(c.layers, 3);
  EXPECT_EQ(c.dense_grad_bytes_per_layer, mixtral_dense_grad_bytes_per_layer(s.model));
  // The head's (final norm + lm_head) and the embedding's replicated gradients are all-reduced too, in their chunks.
  EXPECT_EQ(c.head_grad_bytes, 4 * int64_t(H + s.model.vocab_size * H));
  EXPECT_EQ(c.embed_grad_bytes, 4 * int64_t(s.model.vocab_size * H));
  EXPECT_DOUBLE_EQ(c[TaskKind::attention_fwd].batch_ms, at / 1e9);
  EXPECT_DOUBLE_EQ(c[TaskKind::attention_bwd].batch_ms, 2 * at / 1e9);
  EXPECT_DOUBLE_EQ(c[TaskKind::expert_fwd].batch_ms, ex / 1e9);
  EXPECT_DOUBLE_EQ(c[TaskKind::expert_bwd].batch_ms, 2 * ex / 1e9);
  EXPECT_DOUBLE_EQ(c[TaskKind::attention_fwd].fixed_ms, 0.01);
  // 8 GPUs in 2 nodes of 4: of the T·k rows (H bf16 values each) 3/8 stay in the node, 4/8 leave it; the
  // network is the slower of the two here.
  const double rows = T * k * H * 2;
  const double a2a = std::max(rows * 3 / 8 / 1e8, rows * 4 / 8 / 1e7);
  for (TaskKind kind : {TaskKind::dispatch_fwd, TaskKind::combine_fwd, TaskKind::combine_bwd, TaskKind::dispatch_bwd}) {
    EXPECT_DOUBLE_EQ(c[kind].batch_ms, a2a) << task_kind_name(kind);
    EXPECT_DOUBLE_EQ(c[kind].fixed_ms, 0.02) << task_kind_name(kind);
  }
  // Ring all-reduce over the network (more than a node): 2·7/8 of the bytes at 1e7 B/ms.
  EXPECT_DOUBLE_EQ(c.ar_bytes_per_ms, 1e7 / (2.0 * 7 / 8));
  EXPECT_DOUBLE_EQ(c.ar_alpha_ms, 0.03);

  // Inside one node the ring and the rows go over NVLink; on one GPU nothing is sent.
  ProjectionSpec one_node = s;
  one_node.gpus = 4;
  const CostModel n = project_costs(one_node, cluster());
  EXPECT_DOUBLE_EQ(n[TaskKind::dispatch_fwd].batch_ms, rows * 3 / 4 / 1e8);
  EXPECT_DOUBLE_EQ(n.ar_bytes_per_ms, 1e8 / (2.0 * 3 / 4));
  ProjectionSpec alone = s;
  alone.gpus = 1;
  const CostModel a = project_costs(alone, cluster());
  EXPECT_EQ(a[TaskKind::dispatch_fwd].batch_ms, 0);
  EXPECT_EQ(a[TaskKind::dispatch_fwd].fixed_ms, 0);
  EXPECT_EQ(a.ar_alpha_ms, 0);
}

TEST(FlowProjection, InconsistentSetupsAreRefusedNamingWhatIsWrong) {
  ProjectionSpec s = spec();
  s.gpus = 3;
  EXPECT_NE(error_of([&] { project_costs(s, cluster()); }).find("8 experts do not split over 3 GPUs"),
            std::string::npos);
  s.gpus = 8;
  s.model.num_local_experts = 24;
  ClusterModel odd = cluster();
  odd.gpus_per_node = 3;
  EXPECT_NE(error_of([&] { project_costs(s, odd); }).find("not whole nodes of 3"), std::string::npos);
  s.act_bytes = 3;
  EXPECT_NE(error_of([&] { project_costs(s, cluster()); }).find("allowed: 2, 4"), std::string::npos);

  const json good = {{"flop_per_s", 1e12}, {"nvlink_gbytes_per_s", 100}, {"net_gbytes_per_s", 10},
                     {"gpus_per_node", 4}, {"compute_fixed_ms", 0}, {"alltoall_fixed_ms", 0},
                     {"allreduce_alpha_ms", 0}, {"notes", "x"}};
  EXPECT_EQ(parse_cluster_model(good, "c.json").nvlink_bytes_per_s, 100e9);
  json unknown = good;
  unknown["nvlink_gbps"] = 1;
  EXPECT_NE(error_of([&] { parse_cluster_model(unknown, "c.json"); }).find("unknown key 'nvlink_gbps'"),
            std::string::npos);
  json missing = good;
  missing.erase("net_gbytes_per_s");
  EXPECT_NE(error_of([&] { parse_cluster_model(missing, "c.json"); }).find("missing key 'net_gbytes_per_s'"),
            std::string::npos);
  json zero = good;
  zero["flop_per_s"] = 0;
  EXPECT_NE(error_of([&] { parse_cluster_model(zero, "c.json"); }).find("c.json.flop_per_s = 0: must be in [1e6, 1e19]"),
            std::string::npos);
  json fraction = good;
  fraction["gpus_per_node"] = 2.5;
  EXPECT_NE(error_of([&] { parse_cluster_model(fraction, "c.json"); }).find("gpus_per_node = 2.5"), std::string::npos);
}

TEST(FlowProjection, CliPrintsTheAblationAndWritesTheCosts) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / ("dmoe_flow_project_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string out = (dir / "costs.json").string(), js = (dir / "p.json").string();
  const dmoe::test::CliResult r =
      dmoe::test::run_cli("flow project --config gpt2-tiny-moe --cluster h200 --gpus 16 --costs-out " + out +
                          " --json " + js);
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* row : {"vanilla", "pipe-moe", "pipe-attn", "chunked-ar", "tuned", "link shared"})
    EXPECT_NE(r.output.find(row), std::string::npos) << row << "\n" << r.output;
  // The written costs are a cost file for flow simulate, and give it the same vanilla step.
  const CostModel written = load_cost_model(out);
  EXPECT_EQ(written.layers, 12);
  std::ifstream f(js);
  const json p = json::parse(f);
  EXPECT_EQ(p.at("link"), "shared");
  EXPECT_EQ(parse_cost_model(p.at("projected_costs"), "p").dense_grad_bytes_per_layer,
            written.dense_grad_bytes_per_layer);
  EXPECT_NE(r.output.find("GB/s effective"), std::string::npos) << r.output;
  // F13 (fifteenth pass): one GPU's placeholder all-reduce bandwidth was printed as "1e+09 GB/s effective".
  const dmoe::test::CliResult one = dmoe::test::run_cli("flow project --config gpt2-tiny-moe --cluster h200 --gpus 1");
  ASSERT_EQ(one.status, 0) << one.output;
  EXPECT_NE(one.output.find("no all-reduce (one GPU)"), std::string::npos) << one.output;
  EXPECT_EQ(one.output.find("GB/s effective"), std::string::npos) << one.output;
  // Options of another action are refused, not ignored; --gpus must fit the experts.
  const dmoe::test::CliResult bad = dmoe::test::run_cli("flow simulate --costs example --gpus 16");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("--gpus"), std::string::npos) << bad.output;
  const dmoe::test::CliResult split = dmoe::test::run_cli("flow project --config gpt2-tiny-moe --cluster h200 --gpus 12");
  EXPECT_NE(split.status, 0);
  EXPECT_NE(split.output.find("16 experts do not split over 12 GPUs"), std::string::npos) << split.output;
  const dmoe::test::CliResult link = dmoe::test::run_cli("flow simulate --costs example --link wire");
  EXPECT_NE(link.output.find("--link wire: allowed: exclusive"), std::string::npos) << link.output;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dmoe::flow
