// test_cuda_mixtral.cpp — the Mixtral model on the GPU (model/cuda/) against the CPU model, its oracle: logits,
// loss (with the router's aux loss) and the gradient of every parameter, f32 and bf16; bit-identical reruns; and
// training steps through train_mixtral (--engine cuda vs cpu) with the same losses.
// Run: dmoe_gpu_tests --gtest_filter='GpuMixtral*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unistd.h>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "core/random.hpp"
#include "gpu_test_util.hpp"
#include "model/cuda/cuda_mixtral.hpp"
#include "model/mixtral.hpp"
#include "model/mixtral_config.hpp"
#include "model/train_replica.hpp"
#include "model/trainer.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

// The tiny model of bench/models with shapes that are no multiple of a tile anywhere (head_dim 16, 3 kv heads
// shared by 6 query heads, 300-token vocabulary, 37-token sequences).
MixtralConfig odd_config() {
  MixtralConfig c = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/tiny.json").string());
  c.vocab_size = 300;
  c.hidden_size = 96;
  c.intermediate_size = 80;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 3;
  c.num_local_experts = 4;
  c.num_experts_per_tok = 2;
  c.initializer_range = 0.1;  // logits and gradients well away from zero: relative errors mean something
  c.output_router_logits = true;
  c.validate();
  return c;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng.next() % uint64_t(vocab));
  return t;
}

// ‖a − b‖ / ‖b‖ (fp64).
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void compare(const EvalResult& gpu, const EvalResult& cpu, const MixtralConfig& c, double tol_logits,
             double tol_loss, double tol_grad, const char* what) {
  EXPECT_LE(rel_error(gpu.logits, cpu.logits), tol_logits) << what << ": logits";
  EXPECT_NEAR(gpu.loss, cpu.loss, tol_loss * std::abs(cpu.loss)) << what << ": loss";
  EXPECT_NEAR(gpu.aux_loss, cpu.aux_loss, tol_loss * std::abs(cpu.aux_loss) + 1e-7) << what << ": aux loss";
  MixtralWeights g = gpu.grads, r = cpu.grads;
  const std::vector<ParamView> gv = parameter_views(g, c), rv = parameter_views(r, c);
  ASSERT_EQ(gv.size(), rv.size());
  double worst = 0;
  std::string worst_name;
  for (size_t i = 0; i < gv.size(); ++i) {
    const std::vector<float> a(gv[i].data, gv[i].data + gv[i].numel), b(rv[i].data, rv[i].data + rv[i].numel);
    const double e = rel_error(a, b);
    if (e > worst) worst = e, worst_name = gv[i].name;
    EXPECT_LE(e, tol_grad) << what << ": grad." << gv[i].name;
  }
  std::printf("%s: logits %.2e, loss %.2e, worst gradient %.2e (%s)\n", what, rel_error(gpu.logits, cpu.logits),
              std::abs(gpu.loss - cpu.loss) / std::abs(cpu.loss), worst, worst_name.c_str());
}

// The flat parameter layout the GPU model's all-reduce, norm and AdamW ranges rely on (host code: runs without a GPU):
// every tensor of a rank's share exactly once, of its size, 64-element aligned, inside its group, the groups in the
// order norms | dense | routers | experts, and a layer's expert stacks of the shapes EpEngine reads.
TEST(GpuMixtral, ParamLayoutCoversEveryTensorOnce) {
  for (bool tied : {false, true})
    for (int32_t world : {1, 2, 4}) {
      MixtralConfig c = odd_config();
      c.tie_word_embeddings = tied;
      const int32_t Le = c.num_local_experts / world;
      const ParamLayout lay = make_param_layout(c, Le);
      MixtralWeights share = make_mixtral_weights(c, 0, Le);
      int64_t numel = 0;
      for (const ParamView& v : parameter_views(share, c)) numel += v.numel;
      int64_t covered = 0;
      std::vector<std::pair<int64_t, int64_t>> ranges;
      for (const ParamLayout::Entry& e : lay.entries) {
        EXPECT_EQ(e.offset % 64, 0) << "tied " << tied << " world " << world;
        EXPECT_EQ(int64_t(e.select(share, e.layer)->size()), e.numel) << "layer " << e.layer << " group " << e.group;
        EXPECT_GE(e.offset, lay.group_begin[e.group]);
        EXPECT_LE(e.offset + e.numel, lay.group_begin[e.group + 1]);
        ranges.emplace_back(e.offset, e.offset + e.numel);
        covered += e.numel;
      }
      // Expert tensors count per expert in parameter_views, per stack here; the totals agree.
      EXPECT_EQ(covered, numel) << "tied " << tied << " world " << world;
      std::sort(ranges.begin(), ranges.end());
      for (size_t i = 1; i < ranges.size(); ++i) EXPECT_LE(ranges[i - 1].second, ranges[i].first) << "overlap";
      for (int g = 0; g < 4; ++g) EXPECT_LE(lay.group_begin[g], lay.group_begin[g + 1]);
      EXPECT_EQ(lay.lm_head < 0, tied);
      const int64_t H = c.hidden_size, I = c.intermediate_size;
      for (const ParamLayout::Layer& l : lay.layers) {
        EXPECT_EQ(l.w3 - l.w1, (Le * I * H + 63) / 64 * 64);  // w1 stack [Le, I, H], then w3
        EXPECT_GE(l.w1, lay.group_begin[ParamLayout::experts]);
        EXPECT_GE(l.gate, lay.group_begin[ParamLayout::routers]);
        EXPECT_LT(l.gate, lay.group_begin[ParamLayout::experts]);
      }
    }
}

TEST(GpuMixtral, F32MatchesCpuModel) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const MixtralConfig c = odd_config();
  const MixtralWeights w = random_mixtral_weights(c, 7);
  const int64_t B = 2, S = 37;
  const std::vector<int32_t> tokens = random_tokens(B * S, c.vocab_size, 3);
  const EvalResult cpu = run_cpu_model(c, w, tokens, B, S, 1, true);
  const EvalResult gpu = run_cuda_model(c, w, tokens, B, S, DType::f32, true);
  // f32 throughout on both sides; the CPU sums in fp64, the GPU in f32 in another order (cuBLAS, tiles): ~1e-6
  // relative per operation, over a few dozen chained operations.
  compare(gpu, cpu, c, 2e-5, 2e-5, 1e-4, "f32");
}

TEST(GpuMixtral, Bf16NearCpuModel) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  // Every token goes to all experts (k = E): no top-k choice a bf16 rounding could flip. With k < E a near-tie
  // between the k-th and the next expert picks another expert for a few of the 148 (token, layer) choices, and
  // those tokens' logits and their experts' gradients then differ by tens of % (measured: logits 4.7e-2, an
  // expert's w1 gradient 0.28): what is compared here is the bf16 arithmetic, not the routing's sensitivity.
  MixtralConfig c = odd_config();
  c.num_experts_per_tok = c.num_local_experts;
  const MixtralWeights w = random_mixtral_weights(c, 7);
  const int64_t B = 2, S = 37;
  const std::vector<int32_t> tokens = random_tokens(B * S, c.vocab_size, 3);
  const EvalResult cpu = run_cpu_model(c, w, tokens, B, S, 1, true);
  const EvalResult gpu = run_cuda_model(c, w, tokens, B, S, DType::bf16, true);
  // bf16 weights and activations (8 significant bits: 2^-9 relative rounding per value, several roundings per
  // block, 2 blocks): a few % on logits and gradients; the loss (a mean over 72 predictions) closer. A near-tie
  // in the router may pick another expert for a token in bf16, which moves that token's gradients more.
  compare(gpu, cpu, c, 3e-2, 1e-2, 8e-2, "bf16");
}

// The CPU twins of a W = 1 model's gradient norm and AdamW step (CudaMixtralModel::grad_sum_of_squares, adamw_step),
// tensor by tensor over its layout's entries, on what the model holds (downloaded: weights, gradients, moments).
// [0] the replicated tensors' Σ g², [1] the experts'; elements: the sizes of the two ranges the GPU sums (padding
// between tensors included: zeros there add nothing).
void cpu_grad_sums(const ParamLayout& lay, MixtralWeights& g, bool bf16_experts, double sums[2], int64_t elements[2]) {
  sums[0] = sums[1] = 0;
  std::vector<bfloat16> bits;
  for (const ParamLayout::Entry& e : lay.entries) {
    const std::vector<float>& t = *e.select(g, e.layer);
    const bool expert = e.group == ParamLayout::experts;
    if (expert && bf16_experts) {  // the bf16 twin, on the bits the model's bf16 gradients hold
      bits.resize(t.size());
      size_t not_bf16 = 0;  // grads() gives each bf16 gradient as the float it holds: the bits round-trip
      for (size_t i = 0; i < t.size(); ++i) {
        bits[i] = float_to_bf16(t[i]);
        not_bf16 += bf16_to_float(bits[i]) != t[i];
      }
      EXPECT_EQ(not_bf16, 0u) << "expert gradients that are no bf16 value, layer " << e.layer;
      sums[1] += cpu::sum_of_squares(bits.data(), int64_t(bits.size()));
    } else {
      sums[expert ? 1 : 0] += cpu::sum_of_squares(t.data(), int64_t(t.size()));
    }
  }
  elements[0] = lay.group_begin[ParamLayout::experts];
  elements[1] = lay.total() - lay.group_begin[ParamLayout::experts];
}

// The model's step on the host: the norms without weight decay, the rest with; g·grad_scale rounded to f32 first
// (cpu::scale_in_place, as the CPU trainer applies the clipping factor), then cpu::adamw_step; bf16 expert
// gradients unscaled go to the bf16 twin.
void cpu_adamw(const ParamLayout& lay, MixtralWeights& w, MixtralWeights& g, MixtralWeights& m, MixtralWeights& v,
               const cpu::AdamWParams& p, double weight_decay, double grad_scale, bool bf16_experts) {
  cpu::AdamWParams q = p;
  std::vector<bfloat16> bits;
  for (const ParamLayout::Entry& e : lay.entries) {
    q.weight_decay = e.group == ParamLayout::norms ? 0.0 : weight_decay;
    std::vector<float>& tw = *e.select(w, e.layer);
    std::vector<float> tg = *e.select(g, e.layer);
    std::vector<float>& tm = *e.select(m, e.layer);
    std::vector<float>& tv = *e.select(v, e.layer);
    const int64_t n = int64_t(tw.size());
    if (e.group == ParamLayout::experts && bf16_experts && grad_scale == 1.0) {
      bits.resize(tg.size());
      for (size_t i = 0; i < tg.size(); ++i) bits[i] = float_to_bf16(tg[i]);
      cpu::adamw_step(tw.data(), bits.data(), tm.data(), tv.data(), n, q);
      continue;
    }
    if (grad_scale != 1.0) cpu::scale_in_place(tg.data(), n, grad_scale);
    cpu::adamw_step(tw.data(), tg.data(), tm.data(), tv.data(), n, q);
  }
}

// Every tensor of `a` and `b` (MixtralWeights of one layout) the same bits; the first differing tensor's name.
testing::AssertionResult same_bits(const char* what, const ParamLayout& lay, MixtralWeights& a, MixtralWeights& b) {
  size_t bad = 0;
  std::string first;
  for (const ParamLayout::Entry& e : lay.entries) {
    const std::vector<float>& x = *e.select(a, e.layer);
    const std::vector<float>& y = *e.select(b, e.layer);
    if (x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0) continue;
    if (bad++ == 0) first = "layer " + std::to_string(e.layer) + " group " + std::to_string(int(e.group)) +
                            " offset " + std::to_string(e.offset);
  }
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << bad << " of " << lay.entries.size()
                                     << " tensors differ; the first: " << first;
}

// A bf16 model with bf16 expert gradients (dmoe train with one micro-batch, dmoe bench model) against the same model
// with f32 ones: the replicated tensors' gradients bit for bit (nothing reads the experts' gradients), the experts'
// within bf16's rounding of each element (at most 2^-8 relative, half an ulp of 8 significant bits; 4e-3 over a
// tensor), the losses of 4 AdamW steps within 5e-3 relative (the updates differ by that rounding); a second backward
// adding into bf16 gradients is refused. At every step of both models, against the CPU twins on what the model holds
// (the block comment of the bf16-gradient kernel tests in test_model_kernels.cpp says why these tolerances):
//  - the gradient norm's two sums within 2n·2^-53 relative (fp64 sums of the same exact squares in two orders);
//  - the master weights and both moments after AdamW bit for bit (the same IEEE operations in the same order; step 1
//    is the first, from zero moments: the bias corrections 1 − β^1);
// and a rerun of the bf16-gradient model gives the same losses and weights bit for bit.
TEST(GpuMixtral, Bf16ExpertGradientsNearF32) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (world != 1) GTEST_SKIP() << "one rank alone (each run opens its own W = 1 model)";
  const MixtralConfig c = odd_config();
  const MixtralWeights w = random_mixtral_weights(c, 23);
  const int64_t batch = 3, seq = 20;
  const ParamLayout lay = make_param_layout(c, c.num_local_experts);
  struct Run {
    MixtralWeights first_grads, final_weights;
    std::vector<double> losses;
    size_t bytes = 0;
  };
  // probe: after the first backward, try a second one (another micro-batch adding into the gradients) and stop.
  auto train = [&](bool bf16_grads, bool probe) {
    SCOPED_TRACE(bf16_grads ? "bf16 expert gradients" : "f32 expert gradients");
    Run out;
    CudaRank r = open_cuda_rank(c, DType::bf16, batch * seq);
    CudaMixtralModel model(c, DType::bf16, *r.comm, std::move(r.backend), bf16_grads);
    EXPECT_EQ(model.bf16_expert_grads(), bf16_grads);
    out.bytes = model.parameter_bytes();
    model.set_weights(w);
    CudaModelState st;
    for (int step = 1; step <= 4; ++step) {
      SCOPED_TRACE(testing::Message() << "step " << step);
      const std::vector<int32_t> tokens = random_tokens(batch * seq, c.vocab_size, 200 + uint64_t(step));
      model.zero_grads();
      out.losses.push_back(model.forward(tokens.data(), batch, seq, st));
      model.backward(st);
      MixtralWeights g = model.grads();
      if (step == 1) out.first_grads = g;
      if (probe) {
        model.forward(tokens.data(), batch, seq, st);
        EXPECT_THROW(model.backward(st), Error);
        break;
      }
      double sq[2], want[2];
      int64_t elements[2];
      model.grad_sum_of_squares(sq);
      cpu_grad_sums(lay, g, bf16_grads, want, elements);
      for (int k = 0; k < 2; ++k)
        EXPECT_NEAR(sq[k], want[k], 2.0 * double(elements[k]) * std::ldexp(1.0, -53) * want[k])
            << (k == 0 ? "replicated tensors' sum of squares" : "experts' sum of squares");
      cpu::AdamWParams p;
      p.lr = 1e-2;
      p.step = step;
      const double scale = cpu::clip_coefficient(sq[0] + sq[1], 1.0);
      MixtralWeights cw = model.weights(), cm, cv;
      model.moments(cm, cv);
      model.adamw_step(p, 0.1, scale);
      cpu_adamw(lay, cw, g, cm, cv, p, 0.1, scale, bf16_grads);
      MixtralWeights gw = model.weights(), gm, gv;
      model.moments(gm, gv);
      EXPECT_TRUE(same_bits("master weights after AdamW vs the CPU twins", lay, gw, cw));
      EXPECT_TRUE(same_bits("first moments after AdamW vs the CPU twins", lay, gm, cm));
      EXPECT_TRUE(same_bits("second moments after AdamW vs the CPU twins", lay, gv, cv));
    }
    out.final_weights = model.weights();
    st.blocks.clear();
    return out;
  };
  const Run f32 = train(false, false), bf = train(true, false);
  train(true, true);
  EXPECT_LT(bf.bytes, f32.bytes);
  MixtralWeights ga = f32.first_grads, gb = bf.first_grads;
  const std::vector<ParamView> va = parameter_views(ga, c), vb = parameter_views(gb, c);
  ASSERT_EQ(va.size(), vb.size());
  for (size_t i = 0; i < va.size(); ++i) {
    const std::vector<float> a(va[i].data, va[i].data + va[i].numel), b(vb[i].data, vb[i].data + vb[i].numel);
    const bool expert = va[i].name.find(".experts.") != std::string::npos;
    if (expert)
      EXPECT_LE(rel_error(b, a), 4e-3) << va[i].name;
    else
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << va[i].name;
  }
  ASSERT_EQ(f32.losses.size(), bf.losses.size());
  EXPECT_EQ(f32.losses[0], bf.losses[0]);  // the same weights: the first forward is the same
  for (size_t i = 1; i < f32.losses.size(); ++i)
    EXPECT_NEAR(bf.losses[i], f32.losses[i], 5e-3 * f32.losses[i]) << "step " << i + 1;
  // Determinism: the bf16-gradient run again, bit for bit (losses and the final master weights).
  const Run again = train(true, false);
  ASSERT_EQ(again.losses.size(), bf.losses.size());
  for (size_t i = 0; i < bf.losses.size(); ++i) EXPECT_EQ(again.losses[i], bf.losses[i]) << "rerun, step " << i + 1;
  MixtralWeights w1 = bf.final_weights, w2 = again.final_weights;
  EXPECT_TRUE(same_bits("final weights, rerun", lay, w2, w1));
}

TEST(GpuMixtral, RerunIsBitIdentical) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const MixtralConfig c = odd_config();
  const MixtralWeights w = random_mixtral_weights(c, 9);
  const std::vector<int32_t> tokens = random_tokens(3 * 20, c.vocab_size, 4);
  for (DType dt : {DType::f32, DType::bf16}) {
    const EvalResult a = run_cuda_model(c, w, tokens, 3, 20, dt, true);
    const EvalResult b = run_cuda_model(c, w, tokens, 3, 20, dt, true);
    EXPECT_EQ(std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * 4), 0) << dtype_name(dt);
    EXPECT_EQ(a.loss, b.loss) << dtype_name(dt);
    MixtralWeights ga = a.grads, gb = b.grads;
    const std::vector<ParamView> va = parameter_views(ga, c), vb = parameter_views(gb, c);
    for (size_t i = 0; i < va.size(); ++i)
      EXPECT_EQ(std::memcmp(va[i].data, vb[i].data, size_t(va[i].numel) * 4), 0) << dtype_name(dt) << " " << va[i].name;
  }
}

TEST(GpuMixtral, TrainingStepsMatchCpuEngine) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
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
  o.micro_batches = 2;  // two states per step: the engines of both micro-batches add into one gradient
  o.warmup = 2;
  o.print_every = 0;
  auto quiet = [](const std::string&) {};
  const TrainResult cpu = train_mixtral(c, o, quiet);
  o.engine = "cuda";
  const TrainResult gpu = train_mixtral(c, o, quiet);
  if (rank != 0) return;  // rank 0 keeps the records
  ASSERT_EQ(cpu.records.size(), gpu.records.size());
  for (size_t i = 0; i < cpu.records.size(); ++i) {
    // f32 on both; AdamW's first steps move each weight by ~lr whatever the gradient's size, so differences in
    // the last bits of small gradients show in later losses: 1e-4 relative over 6 steps.
    EXPECT_NEAR(gpu.records[i].loss, cpu.records[i].loss, 1e-4 * cpu.records[i].loss) << "step " << i + 1;
    EXPECT_NEAR(gpu.records[i].grad_norm, cpu.records[i].grad_norm, 1e-3 * cpu.records[i].grad_norm) << "step " << i + 1;
  }
  EXPECT_NEAR(gpu.final_val_loss, cpu.final_val_loss, 1e-4 * cpu.final_val_loss);
  EXPECT_LT(gpu.records.back().loss, gpu.records.front().loss);  // it learns
}

// The smallest shape dmoe train gives bf16 expert gradients wherever cuBLAS would store them
// (bf16_expert_grads_for_training: H·I = 1024 · 2048 = 2^21, the threshold), kept small elsewhere so a step takes
// milliseconds: 2 layers, 4 experts (top 2), 8 query and 4 kv heads of 128, the byte vocabulary of the test text.
MixtralConfig bf16_grad_train_config() {
  MixtralConfig c = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/tiny.json").string());
  c.hidden_size = 1024;
  c.intermediate_size = 2048;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.validate();
  return c;
}

// dmoe train --engine cuda --dtype bf16's options for the tests below: 4 sequences of 64 bytes per rank, lr 5e-4
// after 2 warm-up steps, one validation batch at the end.
TrainOptions bf16_grad_train_options(int32_t world, int64_t steps) {
  TrainOptions o;
  o.data_path = (fs::path(DMOE_SOURCE_DIR) / "tests" / "data" / "train_text.txt").string();
  o.steps = steps;
  o.seq = 64;
  o.batch = 4 * world;
  o.world = world;
  o.lr = 5e-4;
  o.warmup = 2;
  o.val_batches = 1;
  o.print_every = 0;
  o.engine = "cuda";
  o.dtype = DType::bf16;
  return o;
}

// dmoe train --engine cuda --dtype bf16 (train_mixtral: the data, the lr schedule, the clipping, validation, the
// replica dmoe train makes) on a shape where the trainer takes bf16 expert gradients, against the same run with f32
// expert gradients (TrainOptions::f32_expert_grads: the GPU model the CPU engine is compared with elsewhere,
// TrainingStepsMatchCpuEngine, and the kernels' CPU twins; the CPU engine itself: the test after this one):
//  - the choice: the bf16-gradient run's model reports bf16 expert gradients, the reference's f32, and two
//    micro-batches (which add into the gradients) keep them f32 and train;
//  - step 1: the same weights and tokens, so the same forward: the same loss bit for bit; its gradient norm differs by
//    the experts' bf16 rounding alone (the replicated gradients are the same bits; both weight-gradient kernels
//    accumulate in f32, in other orders): at most 2^-8 of each element, so |‖g_bf16‖ − ‖g_f32‖| ≤ ‖g_bf16 − g_f32‖ ≤
//    2^-8·‖g‖ + the f32 orders' ~1e-6: 4e-3 relative (2^-8 = 3.9e-3; a bound: the CPU experiment below measured
//    2.1e-7, the roundings' signs being random);
//  - every step finite with a non-zero gradient, and learning: the loss falls by more than 1 in 8 steps and the
//    validation loss ends below step 1's loss (the CPU engine on this run, f32: losses 5.87, 4.16, 4.78, 4.28, 4.59,
//    3.90, 3.77, 3.62, validation 3.52; each step's batch is other windows of the text, so not monotone);
//  - steps 2-8 and the final validation loss within kLossRel of the reference's (below).
TEST(GpuMixtral, TrainTakesBf16ExpertGradientsNearF32) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (4 % world != 0) GTEST_SKIP() << "the model's 4 experts do not split over " << world << " ranks";
  const MixtralConfig c = bf16_grad_train_config();
  ASSERT_TRUE(bf16_expert_grads_for_training(c, DType::bf16, 1, false, false));
  TrainOptions o = bf16_grad_train_options(world, 8);
  auto quiet = [](const std::string&) {};
  const TrainResult bf = train_mixtral(c, o, quiet);
  o.f32_expert_grads = true;
  const TrainResult f32 = train_mixtral(c, o, quiet);
  EXPECT_TRUE(bf.bf16_expert_grads) << "dmoe train did not give this shape bf16 expert gradients";
  EXPECT_FALSE(f32.bf16_expert_grads) << "f32_expert_grads was not kept";
  {
    TrainOptions two = bf16_grad_train_options(world, 2);
    two.micro_batches = 2;
    const TrainResult r = train_mixtral(c, two, quiet);
    EXPECT_FALSE(r.bf16_expert_grads) << "two micro-batches add into the expert gradients: they must stay f32";
    if (rank == 0) {
      ASSERT_EQ(r.records.size(), 2u);
      EXPECT_TRUE(std::isfinite(r.records[1].loss));
    }
  }
  if (rank != 0) return;  // rank 0 keeps the records
  ASSERT_EQ(bf.records.size(), 8u);
  ASSERT_EQ(f32.records.size(), 8u);
  for (size_t i = 0; i < bf.records.size(); ++i) {
    EXPECT_TRUE(std::isfinite(bf.records[i].loss) && std::isfinite(bf.records[i].grad_norm)) << "step " << i + 1;
    EXPECT_GT(bf.records[i].grad_norm, 0.0) << "step " << i + 1;
  }
  std::printf("step 1: loss %.6f (f32 expert grads %.6f); grad norm %.6f (%.6f, rel %.2e)\n", bf.records[0].loss,
              f32.records[0].loss, bf.records[0].grad_norm, f32.records[0].grad_norm,
              std::abs(bf.records[0].grad_norm - f32.records[0].grad_norm) / f32.records[0].grad_norm);
  EXPECT_EQ(bf.records[0].loss, f32.records[0].loss);
  EXPECT_NEAR(bf.records[0].grad_norm, f32.records[0].grad_norm, 4e-3 * f32.records[0].grad_norm);
  EXPECT_LT(bf.records.back().loss, bf.records.front().loss - 1.0);
  EXPECT_TRUE(std::isfinite(bf.final_val_loss));
  EXPECT_LT(bf.final_val_loss, bf.records.front().loss);
  // kLossRel, steps 2-8. AdamW's update m̂/(√v̂ + ε) does not change when every gradient element is scaled by one
  // factor, and bf16 rounding scales each by its own 1 + δ, |δ| ≤ 2^-8: step 1's update is the same (±lr where
  // |g| ≫ ε), later ones differ by at most ~2·2^-8 relative (m̂ and √v̂ each mix steps of different δ), so to first
  // order the loss moves by at most ~2·2^-8 ≈ 8e-3 of what the steps moved it (5.9 → 3.6 here: ~5e-3 of the loss),
  // far less with the δ random-signed, as they are. Measured with the CPU engine (f32 model) on this run, its expert
  // gradients rounded to bf16 before the norm and AdamW or not (a local experiment, not committed): the losses of
  // steps 2-8 differ by at most 7.3e-7 relative, the validation loss by 5.3e-7, the gradient norms by 2.4e-6: no
  // chaotic growth over 8 steps at this lr. On the GPU the bf16 compute copy turns tiny master-weight differences
  // into occasional one-ulp (2^-8) flips of bf16 weights, and a near-tie may route a token to another expert (its
  // 1/256 share of a jump): 2e-3 relative, ~3000 times the CPU measurement and below the first-order bound. What it
  // catches: expert weights updated from wrong, stale or missing gradients move the loss by tenths.
  constexpr double kLossRel = 2e-3;
  for (size_t i = 1; i < bf.records.size(); ++i) {
    std::printf("step %zu: loss bf16 expert grads %.6f, f32 %.6f (rel %.2e); grad norm %.6f, %.6f\n", i + 1,
                bf.records[i].loss, f32.records[i].loss,
                std::abs(bf.records[i].loss - f32.records[i].loss) / f32.records[i].loss, bf.records[i].grad_norm,
                f32.records[i].grad_norm);
    EXPECT_NEAR(bf.records[i].loss, f32.records[i].loss, kLossRel * f32.records[i].loss) << "step " << i + 1;
  }
  std::printf("validation loss after step 8: bf16 expert grads %.6f, f32 %.6f\n", bf.final_val_loss,
              f32.final_val_loss);
  EXPECT_NEAR(bf.final_val_loss, f32.final_val_loss, kLossRel * f32.final_val_loss);
}

// The first step of the run above (bf16 model, bf16 expert gradients) against the CPU engine's (f32, fp64 sums; W
// thread ranks): the same random weights (TrainOptions::seed) and tokens. The loss within 1e-2 relative (a bf16
// model: Bf16NearCpuModel's loss tolerance; with top-2 of 4 experts a near-tie may route a token elsewhere in bf16,
// which moves its 1/256 share); the gradient norm within 8e-2: ‖Δg‖/‖g‖ is at most the worst tensor's ‖Δg_i‖/‖g_i‖,
// which Bf16NearCpuModel bounds by 8e-2 for a bf16 model (and the bf16 expert gradients add at most 2^-8). The CPU
// engine's step 1 here: loss 5.871784, gradient norm 14.220552. Its step of this shape (57 M parameters, 256 tokens
// and a validation batch on the reference engine, one thread at W = 1) took ~20-35 s with the random init on a
// 2-core machine: a test of its own, so that the one above stays quick.
TEST(GpuMixtral, TrainBf16ExpertGradientsFirstStepNearCpuEngine) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (4 % world != 0) GTEST_SKIP() << "the model's 4 experts do not split over " << world << " ranks";
  const MixtralConfig c = bf16_grad_train_config();
  TrainOptions o = bf16_grad_train_options(world, 1);
  auto quiet = [](const std::string&) {};
  const TrainResult gpu = train_mixtral(c, o, quiet);
  EXPECT_TRUE(gpu.bf16_expert_grads);
  o.engine = "cpu";
  o.dtype = DType::f32;
  const TrainResult cpu = train_mixtral(c, o, quiet);
  if (rank != 0) return;
  ASSERT_EQ(gpu.records.size(), 1u);
  ASSERT_EQ(cpu.records.size(), 1u);
  const TrainRecord &g = gpu.records[0], &r = cpu.records[0];
  std::printf("step 1: loss gpu %.6f, cpu %.6f (rel %.2e); grad norm gpu %.6f, cpu %.6f (rel %.2e)\n", g.loss, r.loss,
              std::abs(g.loss - r.loss) / r.loss, g.grad_norm, r.grad_norm,
              std::abs(g.grad_norm - r.grad_norm) / r.grad_norm);
  EXPECT_NEAR(g.loss, r.loss, 1e-2 * r.loss);
  EXPECT_NEAR(g.grad_norm, r.grad_norm, 8e-2 * r.grad_norm);
}

// A run stopped after step 3, saved and resumed to step 6 ends with the same weights, bit for bit, as the run that
// went through (the GPU kernels are deterministic and the checkpoint holds the f32 master weights and both moments).
// Under dmoe launch -n W the checkpoint's experts are gathered from the ranks' processes.
TEST(GpuMixtral, ResumeIsExact) {
  if (!test::has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  int32_t rank = 0, world = 1;
  cuda_job_size(&rank, &world);
  if (4 % world != 0) GTEST_SKIP() << "the tiny model's 4 experts do not split over " << world << " ranks";
  const MixtralConfig c = load_mixtral_config((fs::path(DMOE_SOURCE_DIR) / "bench/models/tiny.json").string());
  // The ranks of one job share the parent (dmoe launch); one directory for all of them.
  const fs::path dir = fs::temp_directory_path() / ("dmoe_gpu_resume_" + std::to_string(::getppid()));
  if (rank == 0) fs::remove_all(dir);
  TrainOptions o;
  o.data_path = (fs::path(DMOE_SOURCE_DIR) / "tests" / "data" / "train_text.txt").string();
  o.steps = 6;
  o.seq = 32;
  o.batch = 2 * world;
  o.world = world;
  o.warmup = 2;
  o.print_every = 0;
  o.engine = "cuda";
  o.dtype = DType::bf16;
  auto quiet = [](const std::string&) {};
  const TrainResult through = train_mixtral(c, o, quiet);
  o.stop_after = 3;
  o.save_dir = (dir / "ckpt").string();
  train_mixtral(c, o, quiet);
  o.stop_after = 0;
  o.resume_dir = o.save_dir;
  o.save_dir = (dir / "ckpt2").string();
  const TrainResult resumed = train_mixtral(c, o, quiet);
  if (rank == 0) {
    ASSERT_EQ(resumed.records.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      EXPECT_EQ(resumed.records[i].loss, through.records[3 + i].loss) << "step " << 4 + i;
    MixtralWeights a = through.weights, b = resumed.weights;
    const std::vector<ParamView> va = parameter_views(a, c), vb = parameter_views(b, c);
    ASSERT_EQ(va.size(), vb.size());
    for (size_t i = 0; i < va.size(); ++i)
      EXPECT_EQ(std::memcmp(va[i].data, vb[i].data, size_t(va[i].numel) * 4), 0) << va[i].name;
    EXPECT_TRUE(fs::exists(dir / "ckpt2" / "model.safetensors"));
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace dmoe
