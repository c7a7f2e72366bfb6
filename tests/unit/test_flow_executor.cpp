// test_flow_executor.cpp — the CPU Flow executor (src/flow/cpu_executor.*): the Mixtral model's stages run in a
// task graph's orders on three threads per rank (compute, all-to-all, all-reduce with its own ThreadComm) give
// gradients and losses bit-identical to the sequential order (forward r = 0..R−1, backward r = 0..R−1,
// reduce_grads), for every schedule, W = 1, 2 and 4, R = 2 and 4, chunks that split tensors (the head's among them)
// and one chunk for all; the head's (final norm, lm_head) and the embedding's gradients are all-reduced in the
// graph's chunks, each chunk only after every task that writes its bytes.
//
// Run: dmoe_unit_tests --gtest_filter='FlowExecutor*'
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "core/error.hpp"
#include "core/random.hpp"
#include "flow/cpu_executor.hpp"
#include "model/mixtral.hpp"

namespace dmoe::flow {
namespace {

MixtralConfig tiny(bool tied = false) {
  MixtralConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 6;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.num_local_experts = 4;
  c.num_experts_per_tok = 2;
  c.rope_theta = 100.0;
  c.tie_word_embeddings = tied;
  c.output_router_logits = true;
  c.router_aux_loss_coef = 0.1;
  c.max_position_embeddings = 64;
  c.initializer_range = 0.5;
  return c;
}

struct RankOut {
  double loss = 0;
  std::vector<std::vector<float>> grads;  // every tensor of this rank, parameter_views order
  std::vector<std::string> names;         // their names (this rank's experts only: the list is shorter than W = 1's)
};

// fn(model, allreduce_comm, tokens of this rank) -> loss, on W thread ranks with two communicator groups.
template <typename Fn>
std::vector<RankOut> on_ranks(const MixtralConfig& c, int32_t world, int64_t batch, int64_t seq, Fn&& fn) {
  const MixtralWeights w = random_mixtral_weights(c, 5);
  Rng rng(9);
  std::vector<int32_t> tokens(static_cast<size_t>(world * batch * seq));
  for (auto& t : tokens) t = int32_t(rng.next() % uint64_t(c.vocab_size));
  auto ar_comms = make_thread_comms(world);
  std::vector<RankOut> out(static_cast<size_t>(world));
  run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
    MixtralModel model(c, comm);
    model.set_weights(slice_mixtral_experts(w, model.first_expert(), model.experts_per_rank()));
    model.zero_grads();
    out[size_t(rank)].loss = fn(model, *ar_comms[size_t(rank)], tokens.data() + rank * batch * seq);
    for (const ParamView& p : parameter_views(model.grads(), c)) {
      out[size_t(rank)].grads.emplace_back(p.data, p.data + p.numel);
      out[size_t(rank)].names.push_back(p.name);
    }
  });
  return out;
}

// The sequential order: forward r = 0..R−1, then backward r in `order`, then reduce_grads().
std::vector<RankOut> sequential(const MixtralConfig& c, int32_t world, int64_t batch, int64_t seq, int32_t R,
                                bool reversed = false) {
  return on_ranks(c, world, batch, seq, [&](MixtralModel& model, Comm&, const int32_t* tokens) {
    std::vector<ModelState> st(static_cast<size_t>(R));
    const int64_t micro = batch / R;
    double loss = 0;
    for (int32_t r = 0; r < R; ++r) loss += model.forward(tokens + r * micro * seq, micro, seq, st[size_t(r)]) / R;
    for (int32_t i = 0; i < R; ++i) model.backward(st[size_t(reversed ? R - 1 - i : i)], 1.0 / R);
    model.reduce_grads();
    return loss;
  });
}

bool bit_equal(const std::vector<RankOut>& a, const std::vector<RankOut>& b, std::string* first_diff) {
  for (size_t r = 0; r < a.size(); ++r) {
    if (std::memcmp(&a[r].loss, &b[r].loss, sizeof(double)) != 0) {
      *first_diff = "loss of rank " + std::to_string(r);
      return false;
    }
    for (size_t t = 0; t < a[r].grads.size(); ++t)
      if (a[r].grads[t].size() != b[r].grads[t].size() ||
          std::memcmp(a[r].grads[t].data(), b[r].grads[t].data(), a[r].grads[t].size() * sizeof(float)) != 0) {
        *first_diff = "rank " + std::to_string(r) + " tensor " + std::to_string(t);
        return false;
      }
  }
  return true;
}

GraphSpec spec_for(const MixtralConfig& c, Schedule s, int32_t R, int64_t chunk) {
  GraphSpec spec;
  spec.layers = c.num_hidden_layers;
  spec.micro_batches = R;
  spec.schedule = s;
  set_mixtral_grad_layout(spec, c, mixtral_dense_grad_bytes_per_layer(c));
  spec.chunk_bytes = chunk;
  return spec;
}

// The tiny model's replicated layout: head (norm 8 + lm_head 88 floats) 384 B, three layers of 832 B, embedding 352 B.
constexpr int64_t kTinyHead = 384, kTinyLayer = 832, kTinyEmbed = 352;

// The tasks that write bytes [begin, end) of the layout, restated from the model (head_backward runs in C'[L−1, r]'s
// prelude, a layer's dense backward in its AT', embed_backward in AT'[0, r]), not from the chunks' deps.
std::vector<int32_t> writers(const TaskGraph& g, int64_t begin, int64_t end) {
  const int32_t L = g.spec.layers;
  std::vector<int32_t> w;
  for (const Task& t : g.tasks) {
    bool writes = false;
    if (t.kind == TaskKind::combine_bwd && t.layer == L - 1) writes = begin < kTinyHead;
    if (t.kind == TaskKind::attention_bwd) {
      const int64_t lo = kTinyHead + int64_t(L - 1 - t.layer) * kTinyLayer;
      writes = begin < lo + kTinyLayer && lo < end;
      if (t.layer == 0) writes = writes || end > kTinyHead + L * kTinyLayer;
    }
    if (writes) w.push_back(t.id);
  }
  return w;
}

TEST(FlowExecutor, BitIdenticalToTheSequentialOrder) {
  const MixtralConfig c = tiny();
  const int64_t batch = 4, seq = 5;
  ASSERT_EQ(mixtral_head_grad_bytes(c), kTinyHead);
  ASSERT_EQ(mixtral_dense_grad_bytes_per_layer(c), kTinyLayer);
  ASSERT_EQ(mixtral_embed_grad_bytes(c), kTinyEmbed);
  // Sp = 64 cuts every tensor; 200 cuts inside the head and its second chunk spans the head's end; 384 ends exactly
  // at the head's end; 1 MiB is one chunk of everything.
  for (int32_t world : {1, 2, 4})
    for (int32_t R : {2, 4}) {
      const std::vector<RankOut> want = sequential(c, world, batch, seq, R);
      for (Schedule s : {Schedule::vanilla, Schedule::pipe_moe, Schedule::pipe_attn, Schedule::chunked_ar})
        for (int64_t chunk : {int64_t(64), int64_t(200), int64_t(384), int64_t(1) << 20}) {
          if (chunk != int64_t(1) << 20 && s != Schedule::chunked_ar) continue;
          SCOPED_TRACE(::testing::Message() << schedule_name(s) << " W=" << world << " R=" << R << " Sp=" << chunk);
          const TaskGraph g = build_task_graph(spec_for(c, s, R, chunk));
          const std::vector<RankOut> got =
              on_ranks(c, world, batch, seq, [&](MixtralModel& model, Comm& ar, const int32_t* tokens) {
                std::vector<ModelState> st;
                return run_cpu_flow_step(model, ar, g, tokens, batch, seq, st);
              });
          std::string diff;
          EXPECT_TRUE(bit_equal(got, want, &diff)) << "first difference: " << diff;
        }
    }
  // The comparison can fail: the trainer's order (backward from r = R−1 down) differs in the last bits.
  std::string diff;
  EXPECT_FALSE(bit_equal(sequential(c, 2, batch, seq, 4, true), sequential(c, 2, batch, seq, 4), &diff));
  // And it would fail if the head's or the embedding's gradients were left out of the all-reduce or reduced before
  // their last contribution: rank 0's own gradient of each differs from the sum over ranks. (Not so for every layer
  // tensor with these weights: the other ranks' parts of some are below rank 0's last bit.)
  for (int32_t world : {2, 4}) {
    const std::vector<RankOut> own = on_ranks(c, world, batch, seq, [&](MixtralModel& model, Comm&, const int32_t* tokens) {
      ModelState st;
      const double loss = model.forward(tokens, batch, seq, st);
      model.backward(st, 1.0);
      return loss;
    });
    const std::vector<RankOut> summed = sequential(c, world, batch, seq, 1);
    // Indexed by rank 0's own list of tensors: a rank holds E/W experts, so the names of a whole model's weights
    // (all E experts) would index past it (ASan's build read empty vectors there: CI of the twentieth session).
    ASSERT_EQ(own[0].names, summed[0].names);
    int found = 0;
    for (size_t t = 0; t < own[0].names.size(); ++t) {
      const std::string& name = own[0].names[t];
      if (name != "model.norm.weight" && name != "lm_head.weight" && name != "model.embed_tokens.weight") continue;
      ++found;
      SCOPED_TRACE(name + " W=" + std::to_string(world));
      ASSERT_FALSE(own[0].grads[t].empty());
      EXPECT_NE(own[0].grads[t], summed[0].grads[t]);
    }
    EXPECT_EQ(found, 3);
  }
}

TEST(FlowExecutor, TimelineRespectsDependenciesAndStreamOrders) {
  // Measured on the wall clock: every task (each runs its stages: none is empty since the MoE stage is cut at its
  // all-to-alls) starts after each of its dependencies ended, and each thread runs its tasks one at a time in the
  // graph's order.
  const MixtralConfig c = tiny();
  const TaskGraph g = build_task_graph(spec_for(c, Schedule::chunked_ar, 2, 64));
  std::vector<std::vector<TraceEvent>> timelines(2);
  on_ranks(c, 2, 4, 5, [&](MixtralModel& model, Comm& ar, const int32_t* tokens) {
    std::vector<ModelState> st;
    return run_cpu_flow_step(model, ar, g, tokens, 4, 5, st, &timelines[size_t(ar.rank())]);
  });
  for (const std::vector<TraceEvent>& tl : timelines) {
    std::vector<double> start(g.tasks.size(), -1), end(g.tasks.size(), -1);
    for (const TraceEvent& e : tl) start[size_t(e.task)] = e.start_ms, end[size_t(e.task)] = e.end_ms;
    for (const Task& t : g.tasks) EXPECT_GE(start[size_t(t.id)], 0) << g.describe(t.id) << " was not recorded";
    EXPECT_EQ(tl.size(), g.tasks.size());
    for (const Task& t : g.tasks)
      for (int32_t d : t.deps)
        EXPECT_GE(start[size_t(t.id)], end[size_t(d)]) << g.describe(t.id) << " after " << g.describe(d);
    // Every chunk (the head's first) starts after every task that writes its bytes has ended, the writers found from
    // the model's layout, not from the graph's dependencies.
    int64_t at = 0;
    for (int32_t id : g.allreduce_order) {
      const Task& t = g.tasks[size_t(id)];
      EXPECT_EQ(t.offset, at);
      for (int32_t w : writers(g, t.offset, t.offset + t.bytes))
        EXPECT_GE(start[size_t(id)], end[size_t(w)]) << g.describe(id) << " before " << g.describe(w) << " ended";
      at += t.bytes;
    }
    EXPECT_EQ(at, kTinyHead + 3 * kTinyLayer + kTinyEmbed);
    for (Stream s : {Stream::compute, Stream::alltoall, Stream::allreduce}) {
      double previous_end = 0;
      for (int32_t id : g.order(s)) {
        EXPECT_GE(start[size_t(id)], previous_end) << g.describe(id);
        previous_end = end[size_t(id)];
      }
    }
  }
}

TEST(FlowExecutor, RefusesWhatItCannotRun) {
  auto error_of = [](const MixtralConfig& c, const GraphSpec& spec) {
    try {
      on_ranks(c, 1, 4, 5, [&](MixtralModel& model, Comm& ar, const int32_t* tokens) {
        std::vector<ModelState> st;
        return run_cpu_flow_step(model, ar, build_task_graph(spec), tokens, 4, 5, st);
      });
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  const MixtralConfig c = tiny();
  EXPECT_NE(error_of(tiny(true), spec_for(tiny(true), Schedule::pipe_attn, 2, 64)).find("tie_word_embeddings"),
            std::string::npos);
  GraphSpec wrong = spec_for(c, Schedule::pipe_attn, 2, 64);
  wrong.dense_grad_bytes_per_layer += 4;
  EXPECT_NE(error_of(c, wrong).find("dense_grad_bytes_per_layer"), std::string::npos);
  // A graph without the head's or the embedding's bytes would leave them unreduced: refused.
  for (int part : {0, 1}) {
    GraphSpec no_head = spec_for(c, Schedule::chunked_ar, 2, 64);
    (part == 0 ? no_head.head_grad_bytes : no_head.embed_grad_bytes) = 0;
    EXPECT_NE(error_of(c, no_head).find("head_grad_bytes"), std::string::npos);
  }
  EXPECT_NE(error_of(c, spec_for(c, Schedule::chunked_ar, 2, 66)).find("multiple of 4"), std::string::npos);
  EXPECT_NE(error_of(c, spec_for(c, Schedule::pipe_attn, 3, 64)).find("do not split into micro_batches 3"),
            std::string::npos);
  // Ranks that would run different graphs (here: another Sp on rank 1) are stopped before any collective of the
  // step could mismatch, naming the difference.
  std::string mismatch = "(no error)";
  try {
    on_ranks(c, 2, 4, 5, [&](MixtralModel& model, Comm& ar, const int32_t* tokens) {
      std::vector<ModelState> st;
      const GraphSpec sp = spec_for(c, Schedule::chunked_ar, 2, model.rank() == 0 ? 64 : 128);
      return run_cpu_flow_step(model, ar, build_task_graph(sp), tokens, 4, 5, st);
    });
  } catch (const Error& e) {
    mismatch = e.what();
  }
  EXPECT_NE(mismatch.find("runs another task graph or batch than rank 0"), std::string::npos) << mismatch;
}

}  // namespace
}  // namespace dmoe::flow
