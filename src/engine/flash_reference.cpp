// flash_reference.cpp — see flash_reference.hpp.
#include "engine/flash_reference.hpp"

#include <cstring>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "cpu/kernels.hpp"

namespace dmoe {

namespace {

// 64-byte aligned host block (atomics on the signal words need 8-byte alignment).
struct HostRegion {
  std::vector<uint64_t> words;
  explicit HostRegion(size_t bytes) : words((bytes + 7) / 8 + 8, 0) {}
  char* data() { return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(words.data()) + 63) & ~uintptr_t(63)); }
};

}  // namespace

FlashCpuResult run_cpu_flash_layer(const MoeConfig& config, const MoeWeights& weights,
                                   const std::vector<std::vector<float>>& xs, unsigned long long timeout_ns,
                                   const std::vector<std::vector<float>>* dys) {
  config.validate();
  DMOE_REQUIRE(config.drop_policy == DropPolicy::latest_tokens || config.dropless(),
               "flash: drop_policy = {} is not supported; Flash keeps the earliest tokens (latest-tokens)",
               drop_policy_name(config.drop_policy));
  flash::Shape shape = flash::make_shape(config, 1);
  shape.element_bytes = int32_t(sizeof(float));  // the CPU twin stores f32 (bf16 emulated by rounding)
  shape.train = dys != nullptr;
  DMOE_REQUIRE(!dys || dys->size() == xs.size(), "run_cpu_flash_layer: {} dy for {} forwards; give one per forward",
               dys ? dys->size() : 0, xs.size());
  const int32_t W = config.world, Le = config.experts_per_rank();
  const int64_t T = config.tokens, H = config.hidden;
  for (const auto& x : xs)
    DMOE_REQUIRE(int64_t(x.size()) == W * T * H, "run_cpu_flash_layer: x has {} values; expected W·T·H = {}",
                 x.size(), W * T * H);
  if (dys)
    for (const auto& dy : *dys)
      DMOE_REQUIRE(int64_t(dy.size()) == W * T * H, "run_cpu_flash_layer: dy has {} values; expected W·T·H = {}",
                   dy.size(), W * T * H);
  const int64_t I = config.ffn, E = config.experts;
  const bool swiglu = config.activation == Activation::swiglu;
  // f64 accumulators per rank (the CPU backend's): the gate's part and the rank's experts
  const size_t ranks = static_cast<size_t>(W);
  std::vector<std::vector<double>> dgate(ranks), dw1(ranks), dw3(ranks), dw2(ranks);
  if (dys)
    for (int32_t r = 0; r < W; ++r) {
      dgate[r].assign(size_t(E * H), 0.0);
      dw1[r].assign(size_t(Le * I * H), 0.0);
      dw2[r].assign(size_t(Le * H * I), 0.0);
      if (swiglu) dw3[r].assign(size_t(Le * I * H), 0.0);
    }
  const flash::SymmetricLayout sl = flash::symmetric_layout(shape);
  const flash::LocalLayout ll = flash::local_layout(shape);
  std::vector<HostRegion> symmetric, local;
  for (int32_t r = 0; r < W; ++r) {
    symmetric.emplace_back(sl.bytes);
    local.emplace_back(ll.bytes);
  }
  for (int32_t r = 0; r < W; ++r) {
    auto* peers = reinterpret_cast<uint64_t*>(local[r].data() + ll.peers);
    for (int32_t d = 0; d < W; ++d) peers[d] = reinterpret_cast<uint64_t>(symmetric[d].data());
  }
  std::vector<MoeWeights> shards;
  for (int32_t r = 0; r < W; ++r) shards.push_back(slice_experts(weights, r * Le, Le));

  FlashCpuResult result;
  result.y.assign(xs.size(), std::vector<float>(size_t(W * T * H)));
  if (dys) result.dx.assign(xs.size(), std::vector<float>(size_t(W * T * H)));
  result.ranks.resize(size_t(W));
  std::mutex error_mutex;
  std::exception_ptr error;
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < W; ++r) try {
    threads.emplace_back([&, r] {
      try {
        for (size_t i = 0; i < xs.size(); ++i) {
          flash::Params p;
          p.shape = shape;
          p.rank = r;
          p.x = xs[i].data() + size_t(r * T * H);
          p.gate = weights.gate.data();
          p.w1 = shards[r].w1.data();
          p.w3 = shards[r].w3.empty() ? nullptr : shards[r].w3.data();
          p.w2 = shards[r].w2.data();
          p.y = result.y[i].data() + size_t(r * T * H);
          p.symmetric = symmetric[r].data();
          p.local = local[r].data();
          p.timeout_ns = timeout_ns;
          cpu::flash_forward(p);
          if (!dys) continue;
          flash::BackwardParams b;
          b.forward = p;
          b.dy = (*dys)[i].data() + size_t(r * T * H);
          b.dx = result.dx[i].data() + size_t(r * T * H);
          b.dgate = dgate[r].data();
          b.dw1 = dw1[r].data();
          b.dw3 = swiglu ? dw3[r].data() : nullptr;
          b.dw2 = dw2[r].data();
          b.accumulate = i > 0;
          b.aux_loss_coef = config.aux_loss_coef;
          b.z_loss_coef = config.z_loss_coef;
          cpu::flash_backward(b);
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    });
  } catch (const std::system_error& e) {
    // The ranks already started wait for this one's signals until their bounded waits expire; join them, then
    // say which limit was met (a joinable std::thread left behind would end the process in std::terminate).
    for (auto& t : threads) t.join();
    fail_thread_start(e, fmt::format("the thread of simulated Flash rank {} of {}", r, W));
  }
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);

  if (dys) {
    MoeWeights& g = result.grads;
    g = make_moe_weights(config, 0, config.experts);
    std::vector<double> gate_sum(size_t(E * H), 0.0);
    for (int32_t r = 0; r < W; ++r)
      for (size_t i = 0; i < gate_sum.size(); ++i) gate_sum[i] += dgate[r][i];
    for (size_t i = 0; i < gate_sum.size(); ++i) g.gate[i] = float(gate_sum[i]);
    for (int32_t r = 0; r < W; ++r) {
      const size_t off = size_t(r) * Le * I * H;
      for (size_t i = 0; i < dw1[r].size(); ++i) g.w1[off + i] = float(dw1[r][i]);
      for (size_t i = 0; i < dw2[r].size(); ++i) g.w2[off + i] = float(dw2[r][i]);
      if (swiglu)
        for (size_t i = 0; i < dw3[r].size(); ++i) g.w3[off + i] = float(dw3[r][i]);
    }
  }
  if (!xs.empty()) {
    const uint32_t parity = uint32_t(xs.size()) & 1;
    const int64_t R = shape.recv_rows();
    for (int32_t r = 0; r < W; ++r) {
      FlashCpuRankState& st = result.ranks[r];
      const auto* recv = reinterpret_cast<const float*>(symmetric[r].data() + sl.recv) + size_t(parity) * R * H;
      const auto* meta = reinterpret_cast<const flash::RowMeta*>(symmetric[r].data() + sl.meta) + size_t(parity) * R;
      const auto* counts = reinterpret_cast<const uint64_t*>(symmetric[r].data() + sl.counts) +
                           size_t(parity) * W * config.experts;
      st.expert_rows.assign(size_t(Le), 0);
      int64_t rows = 0;
      for (int32_t le = 0; le < Le; ++le) {
        for (int32_t s = 0; s < W; ++s) {
          const int64_t n = flash::signal_value(counts[size_t(s) * config.experts + r * Le + le]);
          st.expert_rows[le] += shape.capacity < 0 ? n : std::min<int64_t>(n, shape.capacity);
        }
        rows += st.expert_rows[le];
      }
      st.recv.assign(recv, recv + rows * H);
      st.meta.assign(meta, meta + rows);
    }
  }
  return result;
}

}  // namespace dmoe
