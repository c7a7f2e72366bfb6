// train_replica.cpp — the CPU engine's TrainReplica (MixtralModel on the host). The GPU's is in model/cuda/ (a build
// without CUDA compiles model/no_cuda/ instead).
#include "model/train_replica.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"
#include "flow/cpu_executor.hpp"
#include "model/mixtral.hpp"

namespace dmoe {

bool bf16_expert_grads_pay_off(const MixtralConfig& config, bool grouped_bf16_wgrad) {
  if (grouped_bf16_wgrad && config.hidden_size % 8 == 0 && config.intermediate_size % 8 == 0) return true;
  return int64_t(config.hidden_size) * int64_t(config.intermediate_size) >= kBf16ExpertGradMinWeight;
}

bool bf16_expert_grads_for_training(const MixtralConfig& config, DType storage, int32_t micro_batches,
                                    bool flow_schedule, bool grouped_bf16_wgrad) {
  return storage == DType::bf16 && micro_batches == 1 && !flow_schedule &&
         bf16_expert_grads_pay_off(config, grouped_bf16_wgrad);
}

double TrainReplica::flow_step(const flow::TaskGraph&, const int32_t*, int64_t, int64_t) {
  DMOE_FAIL("train --schedule: the {} replica was made without a Flow executor", engine_name());
}

void FlowTimeAccumulator::add(const flow::TaskGraph& graph, const std::vector<flow::TraceEvent>& timeline) {
  const flow::GraphSpec& g = graph.spec;
  const bool new_graph = steps_seen_ == 0 || g.micro_batches != last_spec_.micro_batches ||
                         g.chunk_bytes != last_spec_.chunk_bytes || g.schedule != last_spec_.schedule;
  last_spec_ = g;
  ++steps_seen_;
  if (new_graph) {  // the table is of one graph: --schedule tuned's samples do not count toward its choice's
    kind_ms_.clear();
    span_ms_ = 0;
    steps_ = 0;
    return;
  }
  if (kind_ms_.empty()) kind_ms_.assign(flow::kNumTaskKinds, 0.0);
  double first = 0, last = 0;
  for (size_t i = 0; i < timeline.size(); ++i) {
    const flow::TraceEvent& e = timeline[i];
    kind_ms_[size_t(graph.tasks[size_t(e.task)].kind)] += e.end_ms - e.start_ms;
    first = i == 0 ? e.start_ms : std::min(first, e.start_ms);
    last = std::max(last, e.end_ms);
  }
  span_ms_ += last - first;
  ++steps_;
}

TrainReplica::FlowTimes FlowTimeAccumulator::table(const std::string& clock,
                                                   const std::function<std::string(flow::TaskKind)>& where) const {
  TrainReplica::FlowTimes t;
  t.steps = steps_;
  t.span_ms = span_ms_;
  t.clock = clock;
  if (steps_ == 0) return t;
  static const char* const what[flow::kNumTaskKinds] = {
      "attention + gate", "dispatch all-to-all", "experts", "combine all-to-all", "combine backward all-to-all",
      "experts backward", "dispatch backward all-to-all", "gate + attention backward", "gradient all-reduce chunks"};
  for (int k = 0; k < flow::kNumTaskKinds; ++k) {
    const flow::TaskKind kind = flow::TaskKind(k);
    t.kinds.emplace_back(fmt::format("{:<4}{} ({})", flow::task_kind_name(kind), what[k], where(kind)),
                         kind_ms_[size_t(k)]);
  }
  return t;
}

namespace {

class CpuReplica final : public TrainReplica {
 public:
  CpuReplica(const MixtralConfig& config, Comm& comm, MixtralWeights share, MixtralWeights m, MixtralWeights v,
             int32_t micro_batches, Comm* allreduce_comm)
      : comm_(comm), ar_comm_(allreduce_comm), model_(config, comm), m_(std::move(m)), v_(std::move(v)),
        states_(micro_batches) {
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
  double flow_step(const flow::TaskGraph& graph, const int32_t* tokens, int64_t batch, int64_t seq) override {
    DMOE_REQUIRE(ar_comm_ != nullptr, "train --schedule: the CPU replica was made without the all-reduce communicator");
    const double loss = flow::run_cpu_flow_step(model_, *ar_comm_, graph, tokens, batch, seq, flow_states_, &timeline_);
    flow_time_.add(graph, timeline_);
    return loss;
  }
  FlowTimes flow_times() override {
    return flow_time_.table("wall clock of the executor's threads", [](flow::TaskKind kind) -> std::string {
      switch (flow::stream_of(kind)) {
        case flow::Stream::compute: return "compute thread";
        case flow::Stream::alltoall: return "all-to-all thread";
        default: return "all-reduce thread, own communicator";
      }
    });
  }
  // Thread ranks time their own steps; the tuner needs one value on every rank (each rank's tuner must suggest the
  // same next graph), so rank 0's goes to all.
  double rank0_value(double value) override {
    if (comm_.world() == 1) return value;
    double v = comm_.rank() == 0 ? value : 0.0;
    comm_.allreduce_sum(&v, 1, DType::f64, nullptr);
    return v;
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
  Comm* ar_comm_;  // the Flow executor's chunks (flow_step); null without --schedule
  MixtralModel model_;
  MixtralWeights m_, v_;
  std::vector<ModelState> states_;
  std::vector<ModelState> flow_states_;      // the executor's micro-batch states (it sizes them to the graph's R)
  std::vector<flow::TraceEvent> timeline_;   // the last Flow step's, reused
  FlowTimeAccumulator flow_time_;
  std::vector<ParamView> params_, grads_, ms_, vs_;
};

}  // namespace

std::unique_ptr<TrainReplica> make_cpu_replica(const MixtralConfig& config, Comm& comm, MixtralWeights share,
                                               MixtralWeights m, MixtralWeights v, int32_t micro_batches,
                                               Comm* allreduce_comm) {
  return std::make_unique<CpuReplica>(config, comm, std::move(share), std::move(m), std::move(v), micro_batches,
                                      allreduce_comm);
}


}  // namespace dmoe
