// flash/flash_moe_engine.cpp — FlashEngine behind MoeEngine (engine/moe_engine.hpp). CUDA builds only; the
// CPU build links engine/no_cuda/flash_moe_engine_stub.cpp instead.
//
// FlashEngine's buffers (symmetric region, task tables) are sized by the token count, so the adapter keeps one
// FlashEngine per count it was asked for: set_tokens back to a count seen before costs nothing (and, at W > 1,
// no collective). Weights given by set_weights are uploaded once into the backend's memory and lent to every
// FlashEngine as views. Work goes on the backend's stream.
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>

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
  FlashMoeEngine(const MoeConfig& config, Backend& backend, Comm& comm)
      : config_(config), backend_(backend), comm_(comm), gate_(backend), w1_(backend), w3_(backend), w2_(backend) {
    select(config_.tokens);
  }
  ~FlashMoeEngine() override {
    engines_.clear();  // FlashEngine's destructor waits for the device before the weights below are freed
  }

  EngineKind kind() const override { return EngineKind::flash; }
  const MoeConfig& config() const override { return config_; }
  Backend& backend() override { return backend_; }
  bool supports_backward() const override { return false; }

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
    DMOE_REQUIRE_INPUT(mode == ForwardMode::inference,
                       "{} (a train forward keeps that state and computes the router's losses; run the forward in "
                       "inference mode)", kFlashForwardOnly);
    DMOE_REQUIRE(has_weights_, "engine 'flash': set_weights() or set_weight_views() before forward()");
    engine_->forward(x, y, stream());
  }
  void backward(const void*, void*) override { DMOE_FAIL_INPUT("backward: {}", kFlashForwardOnly); }
  void zero_grads() override { DMOE_FAIL_INPUT("zero_grads: {}", kFlashForwardOnly); }
  MoeWeights grads() override { DMOE_FAIL_INPUT("grads: {}", kFlashForwardOnly); }
  RouterLosses losses() const override {
    DMOE_FAIL_INPUT("losses: engine 'flash' does not compute the router's auxiliary losses (they belong to a train "
                    "forward, and {}); use engine 'ep'", kFlashForwardOnly);
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
    if (!engine) engine = std::make_unique<FlashEngine>(config_, comm_);
    engine_ = engine.get();
  }

  MoeConfig config_;
  Backend& backend_;
  Comm& comm_;
  Buffer gate_, w1_, w3_, w2_;  // set_weights' copies (bf16 on the backend)
  WeightViews views_;
  bool has_weights_ = false;
  std::map<int64_t, std::unique_ptr<FlashEngine>> engines_;  // by token count
  FlashEngine* engine_ = nullptr;                            // the current count's
};

}  // namespace

std::unique_ptr<MoeEngine> make_flash_moe_engine(const MoeConfig& config, Backend& backend, Comm& comm) {
  DMOE_REQUIRE_INPUT(backend.storage_dtype() == DType::bf16,
                     "engine 'flash' runs bf16 only, and the backend stores {}; make the CUDA backend with bf16",
                     dtype_name(backend.storage_dtype()));
  DMOE_REQUIRE_INPUT(config.world == 1 || std::string(comm.name()) == "nvshmem",
                     "engine 'flash' at world = {} keeps its buffers in NVSHMEM's symmetric heap, and the "
                     "communicator is '{}'; allowed: the nvshmem communicator (--comm nvshmem), or world 1",
                     config.world, comm.name());
  const std::string why = cuda::flash_unusable_reason(flash::make_shape(config, 1));
  DMOE_REQUIRE_INPUT(why.empty(), "engine 'flash' cannot run {}: {}; use engine 'ep'", config.summary(), why);
  return std::make_unique<FlashMoeEngine>(config, backend, comm);
}

}  // namespace dmoe
