// train_replica.cpp — the CPU engine's TrainReplica (MixtralModel on the host). The GPU's is in model/cuda/ (a build
// without CUDA compiles model/no_cuda/ instead).
#include "model/train_replica.hpp"

#include <vector>

#include "core/error.hpp"
#include "model/mixtral.hpp"

namespace dmoe {

double TrainReplica::flow_step(const flow::TaskGraph&, const int32_t*, int64_t, int64_t) {
  DMOE_FAIL_INPUT("train --schedule: the {} engine has no Flow executor in the trainer; use --engine cuda (the CPU "
                  "executor runs in dmoe flow measure)", engine_name());
}
namespace {

class CpuReplica final : public TrainReplica {
 public:
  CpuReplica(const MixtralConfig& config, Comm& comm, MixtralWeights share, MixtralWeights m, MixtralWeights v,
             int32_t micro_batches)
      : comm_(comm), model_(config, comm), m_(std::move(m)), v_(std::move(v)), states_(micro_batches) {
    model_.set_weights(std::move(share));
    params_ = parameter_views(model_.weights(), config);
    grads_ = parameter_views(model_.grads(), config);
    ms_ = parameter_views(m_, config);
    vs_ = parameter_views(v_, config);
  }
  double forward(const int32_t* tokens, int64_t batch, int64_t seq, int32_t slot) override {
    return model_.forward(tokens, batch, seq, states_.at(slot));
  }
  void backward(int32_t slot, double loss_scale) override { model_.backward(states_.at(slot), loss_scale); }
  double evaluate(const int32_t* tokens, int64_t batch, int64_t seq) override {
    ModelState st;
    return model_.forward(tokens, batch, seq, st);
  }
  void zero_grads() override { model_.zero_grads(); }
  void reduce_grads() override { model_.reduce_grads(); }
  void grad_sum_of_squares(double out[2]) override {
    out[0] = out[1] = 0;
    for (const ParamView& g : grads_) out[g.is_expert ? 1 : 0] += cpu::sum_of_squares(g.data, g.numel);
    if (comm_.world() > 1) comm_.allreduce_sum(&out[1], 1, DType::f64, nullptr);
  }
  void adamw_step(const cpu::AdamWParams& p, double weight_decay, double grad_scale) override {
    cpu::AdamWParams ap = p;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (grad_scale != 1.0) cpu::scale_in_place(grads_[i].data, grads_[i].numel, grad_scale);
      ap.weight_decay = params_[i].shape.size() >= 2 ? weight_decay : 0.0;
      cpu::adamw_step(params_[i].data, grads_[i].data, ms_[i].data, vs_[i].data, params_[i].numel, ap);
    }
    model_.weights_changed();
  }
  void export_share(MixtralWeights& weights, MixtralWeights& m, MixtralWeights& v) override {
    weights = model_.weights();
    m = m_;
    v = v_;
  }
  Comm& comm() override { return comm_; }
  void barrier() override { comm_.barrier(nullptr); }
  const char* engine_name() const override { return "cpu"; }

 private:
  Comm& comm_;
  MixtralModel model_;
  MixtralWeights m_, v_;
  std::vector<ModelState> states_;
  std::vector<ParamView> params_, grads_, ms_, vs_;
};

}  // namespace

std::unique_ptr<TrainReplica> make_cpu_replica(const MixtralConfig& config, Comm& comm, MixtralWeights share,
                                               MixtralWeights m, MixtralWeights v, int32_t micro_batches) {
  return std::make_unique<CpuReplica>(config, comm, std::move(share), std::move(m), std::move(v), micro_batches);
}


}  // namespace dmoe
