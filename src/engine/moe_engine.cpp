// moe_engine.cpp — see moe_engine.hpp: engine names, the host-side checks, the EpEngine adapter, the factory.
#include "engine/moe_engine.hpp"

#include <utility>

#include "core/error.hpp"

namespace dmoe {

const char* const kFlashForwardOnly =
    "this engine 'flash' was made for forwards only (MoeEngineOptions::backward = false), so it keeps no state for a "
    "backward pass; make it with backward = true to train";

EngineKind parse_engine_kind(std::string_view name) {
  if (name == "cpu") return EngineKind::cpu;
  if (name == "ep") return EngineKind::ep;
  if (name == "flash") return EngineKind::flash;
  DMOE_FAIL_INPUT("engine '{}' is unknown; allowed: cpu, ep, flash", name);
}

const char* engine_kind_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::cpu: return "cpu";
    case EngineKind::ep: return "ep";
    case EngineKind::flash: return "flash";
  }
  return "?";
}

std::string moe_engine_unusable_reason(EngineKind kind, const MoeConfig& c, const MoeEngineOptions& /*options*/) {
  if (kind == EngineKind::cpu) return "";
  if (!cuda_engines_built())
    return fmt::format("engine '{}' needs the CUDA engines, and this dmoe was built without CUDA (DMOE_CUDA=OFF or "
                       "no nvcc); use engine 'cpu'", engine_kind_name(kind));
  if (kind == EngineKind::ep) return "";
  if (c.dtype != DType::bf16)
    return fmt::format("engine 'flash' runs bf16 only, and dtype = {}; allowed: dtype bf16 (f32 layers run on engine "
                       "'ep')", dtype_name(c.dtype));
  if (!c.dropless() && c.drop_policy != DropPolicy::latest_tokens)
    return fmt::format("engine 'flash' keeps each expert's earliest tokens under a capacity, and drop_policy = {}; "
                       "allowed: drop_policy latest-tokens, or capacity_factor 0 (dropless), or engine 'ep'",
                       drop_policy_name(c.drop_policy));
  return "";
}

namespace {

// EpEngine behind the interface: every call forwards to it (its phase API stays on EpEngine itself).
class EpMoeEngine final : public MoeEngine {
 public:
  EpMoeEngine(EngineKind kind, const MoeConfig& config, Backend& backend, Comm& comm, const EpOptions& options)
      : kind_(kind), rank_(comm.rank()), engine_(config, backend, comm, options) {}

  EngineKind kind() const override { return kind_; }
  const MoeConfig& config() const override { return engine_.config(); }
  Backend& backend() override { return engine_.backend(); }
  bool supports_backward() const override { return true; }
  void set_weights(const MoeWeights& shard) override { engine_.set_weights(shard); }
  void set_weight_views(const WeightViews& views) override { engine_.set_weight_views(views); }
  void set_tokens(int64_t tokens) override { engine_.set_tokens(tokens); }
  void forward(const void* x, void* y, ForwardMode mode) override { engine_.forward(x, y, mode); }
  void backward(const void* dy, void* dx) override { engine_.backward(dy, dx); }
  void zero_grads() override { engine_.zero_grads(); }
  MoeWeights grads() override { return engine_.grads(); }
  void finish() override { engine_.backend().synchronize(); }
  std::vector<int32_t> expert_ids() override { return engine_.expert_ids(); }
  std::vector<float> expert_weights() override { return engine_.expert_weights(); }
  std::vector<int64_t> expert_rows() override {
    std::vector<int64_t> rows(size_t(engine_.config().experts_per_rank()));
    for (size_t e = 0; e < rows.size(); ++e) rows[e] = engine_.layout().expert_rows(int32_t(e));
    return rows;
  }
  int64_t rows_sent_to_peers() override { return engine_.rows_sent() - engine_.rows_sent_to(rank_); }
  RouterLosses losses() override { return engine_.losses(); }

 private:
  EngineKind kind_;
  int32_t rank_;
  EpEngine engine_;
};

}  // namespace

std::unique_ptr<MoeEngine> make_moe_engine(EngineKind kind, const MoeConfig& config, Backend& backend, Comm& comm,
                                           const MoeEngineOptions& options) {
  const std::string why = moe_engine_unusable_reason(kind, config, options);
  DMOE_REQUIRE_INPUT(why.empty(), "{}", why);
  if (kind == EngineKind::cpu)
    DMOE_REQUIRE_INPUT(!backend.on_device(),
                       "engine 'cpu' is the reference engine on the CPU backend, and the backend given is '{}'; "
                       "use engine 'ep' on a GPU", backend.name());
  else
    DMOE_REQUIRE_INPUT(backend.on_device(),
                       "engine '{}' runs on a CUDA backend, and the backend given is '{}'; use engine 'cpu' on the "
                       "CPU", engine_kind_name(kind), backend.name());
  DMOE_REQUIRE_INPUT(config.world == comm.world(), "config world = {} but the communicator has {} ranks",
                     config.world, comm.world());
  if (kind == EngineKind::flash) return make_flash_moe_engine(config, backend, comm, options.backward);
  return std::make_unique<EpMoeEngine>(kind, config, backend, comm, options.ep);
}

}  // namespace dmoe
