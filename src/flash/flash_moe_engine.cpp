// flash/flash_moe_engine.cpp — FlashEngine behind MoeEngine (engine/moe_engine.hpp). CUDA builds only; the
// CPU build links engine/no_cuda/flash_moe_engine_stub.cpp instead.
//
// FlashEngine's buffers (symmetric region, task tables) are sized by the token count, so the adapter keeps one
// FlashEngine per count it was asked for: set_tokens back to a count seen before costs nothing (and, at W > 1,
// no collective). Weights given by set_weights are uploaded once into the backend's memory and lent to every
// FlashEngine as views. Work goes on the backend's stream. Made for training (MoeEngineOptions::backward), its
// FlashEngines keep the forward's state and it holds f32 gradient accumulators; a train forward also computes the
// router's auxiliary losses (one host read of the statistics, summed over ranks, as EpEngine does).
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dispatch_plan.hpp"
#include "core/error.hpp"
#include "engine/buffer.hpp"
#include "engine/moe_engine.hpp"
#include "flash/flash_engine.hpp"
#include "flash/flash_kernel.hpp"

namespace dmoe {

bool cuda_engines_built() { return true; }

namespace {

class FlashMoeEngine final : public MoeEngine {
 public:
  FlashMoeEngine(const MoeConfig& config, Backend& backend, Comm& comm, bool train)
      : config_(config), backend_(backend), comm_(comm), train_(train), gate_(backend), w1_(backend), w3_(backend),
        w2_(backend), dgate_(backend), dw1_(backend), dw3_(backend), dw2_(backend) {
    select(config_.tokens);
    if (train_) {
      const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts, Le = config_.experts_per_rank();
      grads_.gate = dgate_.ensure(E * H * 4);
      grads_.w1 = dw1_.ensure(Le * I * H * 4);
      grads_.w2 = dw2_.ensure(Le * H * I * 4);
      grads_.w3 = config_.activation == Activation::swiglu ? dw3_.ensure(Le * I * H * 4) : nullptr;
      zero_grads();
    }
  }
  ~FlashMoeEngine() override {
    engines_.clear();  // FlashEngine's destructor waits for the device before the weights below are freed
  }

  EngineKind kind() const override { return EngineKind::flash; }
  const MoeConfig& config() const override { return config_; }
  Backend& backend() override { return backend_; }
  bool supports_backward() const override { return train_; }

  void set_weights(const MoeWeights& w) override {
    const int32_t Le = config_.experts_per_rank(), rank = comm_.rank();
    DMOE_REQUIRE_INPUT(w.hidden == config_.hidden && w.ffn == config_.ffn && w.experts == config_.experts,
                       "engine 'flash': the weights are for hidden {} ffn {} experts {}; the config has {} {} {}",
                       w.hidden, w.ffn, w.experts, config_.hidden, config_.ffn, config_.experts);
    DMOE_REQUIRE_INPUT(w.first_expert == config_.first_expert(rank) && w.num_experts == Le,
                       "engine 'flash': rank {} owns experts [{}, {}); the weights hold [{}, {})", rank,
                       config_.first_expert(rank), config_.first_expert(rank) + Le, w.first_expert,
                       w.first_expert + w.num_experts);
    DMOE_REQUIRE_INPUT(w.activation == config_.activation,
                       "engine 'flash': the weights are for activation {}; the config has {}",
                       activation_name(w.activation), activation_name(config_.activation));
    backend_.synchronize();  // a forward in flight may still read the previous copies
    auto upload = [&](Buffer& b, const std::vector<float>& v) -> const void* {
      backend_.upload_f32(b.ensure(v.size() * 2), v.data(), int64_t(v.size()));
      return b.data();
    };
    WeightViews views;
    views.gate = upload(gate_, w.gate);
    views.w1 = upload(w1_, w.w1);
    views.w3 = config_.activation == Activation::swiglu ? upload(w3_, w.w3) : nullptr;
    views.w2 = upload(w2_, w.w2);
    set_weight_views(views);
  }
  void set_weight_views(const WeightViews& views) override {
    views_ = views;
    has_weights_ = true;
    engine_->set_weight_views(views_.gate, views_.w1, views_.w3, views_.w2);
  }
  void set_tokens(int64_t tokens) override {
    DMOE_REQUIRE_INPUT(tokens >= 1, "engine 'flash': tokens = {} is invalid; must be >= 1", tokens);
    select(tokens);
    if (has_weights_) engine_->set_weight_views(views_.gate, views_.w1, views_.w3, views_.w2);
  }

  void forward(const void* x, void* y, ForwardMode mode) override {
    DMOE_REQUIRE_INPUT(mode == ForwardMode::inference || train_, "train forward: {}", kFlashForwardOnly);
    DMOE_REQUIRE(has_weights_, "engine 'flash': set_weights() or set_weight_views() before forward()");
    engine_->forward(x, y, stream());
    trained_ = mode == ForwardMode::train;
    if (trained_) {
      losses_ = flash_train_losses(*engine_, backend_, comm_, stream());
      has_losses_ = true;
    }
  }
  void backward(const void* dy, void* dx) override {
    DMOE_REQUIRE_INPUT(train_, "backward: {}", kFlashForwardOnly);
    DMOE_REQUIRE_INPUT(trained_, "engine 'flash': backward() follows a train forward (forward(x, y, "
                       "ForwardMode::train)); the last forward ran in inference mode and kept nothing for it");
    engine_->backward(dy, dx, grads_, /*accumulate=*/!expert_grads_zero_, backend_, stream());
    expert_grads_zero_ = false;
    timed_backward_ = timing_;
    trained_ = false;
  }
  void zero_grads() override {
    DMOE_REQUIRE_INPUT(train_, "zero_grads: {}", kFlashForwardOnly);
    backend_.zero(grads_.gate, size_t(config_.experts * config_.hidden) * 4);
    expert_grads_zero_ = true;  // the experts' are written (not added) by the next backward
  }
  MoeWeights grads() override {
    DMOE_REQUIRE_INPUT(train_, "grads: {}", kFlashForwardOnly);
    const int64_t H = config_.hidden, I = config_.ffn, E = config_.experts, Le = config_.experts_per_rank();
    MoeWeights g = make_moe_weights(config_, config_.first_expert(comm_.rank()), int32_t(Le));
    // The gate is replicated: its gradient is the sum over ranks, reduced on a copy (grads() may be called again).
    Buffer reduced(backend_);
    void* dwg = reduced.ensure(E * H * 4);
    backend_.copy(dwg, grads_.gate, size_t(E * H) * 4);
    if (config_.world > 1) comm_.allreduce_sum(dwg, E * H, DType::f32, backend_.stream());
    auto download = [&](const void* src, std::vector<float>& out, int64_t n) {
      out.resize(size_t(n));
      backend_.download(out.data(), src, size_t(n) * 4);
    };
    download(dwg, g.gate, E * H);
    if (expert_grads_zero_) {
      g.w1.assign(size_t(Le * I * H), 0.f);
      g.w2.assign(size_t(Le * H * I), 0.f);
      if (config_.activation == Activation::swiglu) g.w3.assign(size_t(Le * I * H), 0.f);
      return g;
    }
    download(grads_.w1, g.w1, Le * I * H);
    download(grads_.w2, g.w2, Le * H * I);
    if (config_.activation == Activation::swiglu) download(grads_.w3, g.w3, Le * I * H);
    return g;
  }
  void set_stage_timing(bool on) override {
    timing_ = on;
    for (auto& [tokens, e] : engines_) e->set_backward_timing(on && train_);
  }
  std::vector<std::pair<std::string, double>> stage_times() override {
    std::vector<std::pair<std::string, double>> out;
    if (!timing_ || !train_ || !timed_backward_) return out;
    const std::vector<double> ms = engine_->backward_stage_ms(stream());
    for (int32_t i = 0; i < flash::kBackwardStages; ++i) out.emplace_back(flash::backward_stage_name(i), ms[size_t(i)]);
    return out;
  }
  RouterLosses losses() override {
    DMOE_REQUIRE_INPUT(has_losses_, "losses: engine 'flash' computes the router's auxiliary losses in a train forward "
                       "(forward(x, y, ForwardMode::train) of an engine made for training); none has run");
    return losses_;
  }
  void finish() override { engine_->check(stream()); }

  std::vector<int32_t> expert_ids() override { return engine_->expert_ids(stream()); }
  std::vector<float> expert_weights() override { return engine_->expert_weights(stream()); }
  std::vector<int64_t> expert_rows() override { return engine_->expert_rows(stream()); }
  int64_t rows_sent_to_peers() override {
    // Flash sends exactly the kept rows (no padding); the plan of the routing says which go off-rank.
    const auto ids = expert_ids();
    const auto weights = expert_weights();
    const SendPlan plan = build_send_plan(ids.data(), weights.data(), config_.tokens, config_.top_k, config_.experts,
                                          config_.capacity(), config_.drop_policy);
    const int32_t Le = config_.experts_per_rank();
    return plan.rows() - plan.rank_count(comm_.rank(), Le);
  }

 private:
  cudaStream_t stream() { return static_cast<cudaStream_t>(backend_.stream()); }
  void select(int64_t tokens) {
    config_.tokens = tokens;
    auto& engine = engines_[tokens];
    if (!engine) {
      engine = std::make_unique<FlashEngine>(config_, comm_, train_);
      if (timing_ && train_) engine->set_backward_timing(true);
    }
    engine_ = engine.get();
    trained_ = false;
    timed_backward_ = false;
  }
  MoeConfig config_;
  Backend& backend_;
  Comm& comm_;
  bool train_ = false;          // made for training: FlashEngines keep state, gradient accumulators exist
  Buffer gate_, w1_, w3_, w2_;  // set_weights' copies (bf16 on the backend)
  Buffer dgate_, dw1_, dw3_, dw2_;  // f32 gradient accumulators
  FlashGradViews grads_;
  bool expert_grads_zero_ = true;  // zero_grads since the last backward: the next one overwrites the experts'
  bool trained_ = false;           // the last forward of the current engine ran in train mode, no backward yet
  RouterLosses losses_;
  bool has_losses_ = false;
  bool timing_ = false;          // set_stage_timing: backwards record their stage boundaries
  bool timed_backward_ = false;  // the current engine's last backward was timed
  WeightViews views_;
  bool has_weights_ = false;
  std::map<int64_t, std::unique_ptr<FlashEngine>> engines_;  // by token count
  FlashEngine* engine_ = nullptr;                            // the current count's
};

}  // namespace

std::unique_ptr<MoeEngine> make_flash_moe_engine(const MoeConfig& config, Backend& backend, Comm& comm, bool train) {
  DMOE_REQUIRE_INPUT(backend.storage_dtype() == DType::bf16,
                     "engine 'flash' runs bf16 only, and the backend stores {}; make the CUDA backend with bf16",
                     dtype_name(backend.storage_dtype()));
  DMOE_REQUIRE_INPUT(config.world == 1 || std::string(comm.name()) == "nvshmem",
                     "engine 'flash' at world = {} keeps its buffers in NVSHMEM's symmetric heap, and the "
                     "communicator is '{}'; allowed: the nvshmem communicator (--comm nvshmem), or world 1",
                     config.world, comm.name());
  const std::string why = cuda::flash_unusable_reason(flash::make_shape(config, 1));
  DMOE_REQUIRE_INPUT(why.empty(), "engine 'flash' cannot run {}: {}; use engine 'ep'", config.summary(), why);
  return std::make_unique<FlashMoeEngine>(config, backend, comm, train);
}

}  // namespace dmoe
