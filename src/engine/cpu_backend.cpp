// cpu_backend.cpp — Backend on the host, running the CPU kernels (src/cpu/). Memory is host memory and
// activations are stored as f32; a bf16 config is emulated by rounding stored values to bf16.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "core/error.hpp"
#include "cpu/kernels.hpp"
#include "engine/backend.hpp"

namespace dmoe {
namespace {

// The CPU has one order: the copy is made at once.
class CopyReadback final : public HostReadback {
 public:
  void start(const void* src, size_t bytes) override {
    bytes_.resize(bytes);
    if (bytes) std::memcpy(bytes_.data(), src, bytes);
  }
  const void* wait(const char*) override { return bytes_.data(); }

 private:
  std::vector<char> bytes_;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(DType storage) : storage_(storage) {
    DMOE_REQUIRE(storage == DType::f32 || storage == DType::bf16,
                 "cpu backend: storage dtype {} is not supported; allowed: f32, bf16", dtype_name(storage));
  }
  const char* name() const override { return "cpu"; }
  bool on_device() const override { return false; }
  // Buffers hold floats; `storage_` only decides the rounding the kernels apply.
  DType storage_dtype() const override { return DType::f32; }
  DType grad_accum_dtype() const override { return DType::f64; }
  Stream stream() override { return nullptr; }

  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p && bytes) DMOE_FAIL("cpu backend: out of host memory allocating {} bytes", bytes);
    return p;
  }
  void release(void* p) noexcept override { std::free(p); }
  void copy(void* dst, const void* src, size_t bytes) override { if (bytes) std::memmove(dst, src, bytes); }
  void upload(void* dst, const void* host, size_t bytes) override { copy(dst, host, bytes); }
  void download(void* host, const void* src, size_t bytes) override { copy(host, src, bytes); }
  void zero(void* p, size_t bytes) override { if (bytes) std::memset(p, 0, bytes); }
  void synchronize() override {}

  void upload_f32(void* dst, const float* host, int64_t count) override {
    float* out = static_cast<float*>(dst);
    for (int64_t i = 0; i < count; ++i) out[i] = storage_ == DType::bf16 ? round_to_bf16(host[i]) : host[i];
  }
  void download_f32(float* host, const void* src, int64_t count) override {
    copy(host, src, size_t(count) * sizeof(float));
  }

  void router_forward(const void* x, const void* wg, float* logits, float* probs, int32_t* ids,
                      float* weights, float* lse, int64_t tokens, int64_t hidden, int32_t experts,
                      int32_t top_k, bool renormalize) override {
    cpu::router_logits(f(x), f(wg), logits, tokens, hidden, experts);
    cpu::router_topk(logits, probs, ids, weights, lse, tokens, experts, top_k, renormalize);
  }

  void plan_send(const int32_t* ids, const float* weights, int64_t tokens, int32_t top_k, int32_t experts,
                 int64_t capacity, DropPolicy policy, const SendPlanBuffers& plan, int64_t* routed_host,
                 int64_t* counts_host) override {
    SendPlan p = build_send_plan(ids, weights, tokens, top_k, experts, capacity, policy);
    std::memcpy(plan.slot, p.slot.data(), p.slot.size() * sizeof(int32_t));
    std::memcpy(plan.row_token, p.row_token.data(), p.row_token.size() * sizeof(int32_t));
    std::memcpy(plan.row_choice, p.row_choice.data(), p.row_choice.size() * sizeof(int32_t));
    std::memcpy(routed_host, p.routed.data(), p.routed.size() * sizeof(int64_t));
    std::memcpy(counts_host, p.counts.data(), p.counts.size() * sizeof(int64_t));
  }

  void router_aux_partials(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                           int32_t experts, int32_t top_k, double* prob_sum, double* assigned,
                           double* z_sum) override {
    cpu::router_aux_partials(probs, lse, ids, tokens, experts, top_k, prob_sum, assigned, z_sum);
  }

  void gather_rows(const void* x, const int32_t* rows, void* out, int64_t n, int64_t hidden) override {
    cpu::gather_rows(f(x), rows, f(out), n, hidden);
  }
  void permute_segments(const void* src, void* dst, const int64_t* src_offsets, const int64_t* dst_offsets,
                        const int64_t* counts, int64_t segments, int64_t hidden) override {
    cpu::permute_segments(f(src), f(dst), src_offsets, dst_offsets, counts, segments, hidden);
  }
  void combine(const void* rows, const int32_t* slot, const float* weights, void* y, int64_t tokens,
               int32_t top_k, int64_t hidden) override {
    cpu::combine(f(rows), slot, weights, nullptr, f(y), tokens, top_k, hidden, storage_);
  }

  void expert_ffn_forward(const void* x, const void* w1, const void* w3, const void* w2, void* pre1,
                          void* pre3, void* h, void* out, const int64_t* expert_offsets,
                          int32_t local_experts, int64_t hidden, int64_t ffn,
                          Activation activation) override {
    const bool swiglu = activation == Activation::swiglu;
    // Inference (pre1 null): the pre-activations of one expert at a time live in scratch.
    std::vector<float> scratch1, scratch3;
    for (int32_t e = 0; e < local_experts; ++e) {
      const int64_t r0 = expert_offsets[e], n = expert_offsets[e + 1] - r0;
      if (n == 0) continue;
      const int64_t wm = ffn * hidden;
      float* p1 = pre1 ? f(pre1) + r0 * ffn : (scratch1.resize(size_t(n * ffn)), scratch1.data());
      float* p3 = !swiglu ? nullptr : pre3 ? f(pre3) + r0 * ffn : (scratch3.resize(size_t(n * ffn)), scratch3.data());
      cpu::expert_ffn_forward(f(x) + r0 * hidden, f(w1) + e * wm, swiglu ? f(w3) + e * wm : nullptr,
                              f(w2) + e * wm, p1, p3, f(h) + r0 * ffn, f(out) + r0 * hidden, n, hidden, ffn,
                              activation, storage_);
    }
  }

  void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
                           const SendPlanBuffers& plan, int64_t* counts) override {
    cpu::plan_send_on_device(ids, tokens, top_k, experts, capacity, plan.slot, plan.row_token, plan.row_choice,
                             counts);
  }
  void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                                     int32_t experts, int32_t top_k, void* stats) override {
    cpu::router_aux_partials_on_device(probs, lse, ids, tokens, experts, top_k, stats);
  }
  // Host memory is the backend's: the offsets are readable here, so every call qualifies.
  bool expert_ffn_forward_takes_device_offsets(const void*, const void*, const void*, const void*, const void*,
                                               const void*, const void*, const void*, int64_t rows, int32_t,
                                               int64_t, int64_t, Activation) override {
    return rows >= 0;
  }
  void expert_ffn_forward_device_offsets(const void* x, const void* w1, const void* w3, const void* w2, void* pre1,
                                         void* pre3, void* h, void* out, const int64_t* expert_offsets, int64_t rows,
                                         int32_t local_experts, int64_t hidden, int64_t ffn,
                                         Activation activation) override {
    DMOE_REQUIRE(expert_offsets[0] == 0 && expert_offsets[local_experts] == rows,
                 "cpu backend: expert_ffn_forward_device_offsets: offsets span [{}, {}); expected [0, {})",
                 expert_offsets[0], expert_offsets[local_experts], rows);
    expert_ffn_forward(x, w1, w3, w2, pre1, pre3, h, out, expert_offsets, local_experts, hidden, ffn, activation);
  }
  std::unique_ptr<HostReadback> make_readback() override { return std::make_unique<CopyReadback>(); }

  void combine_backward(const void* dy, const void* rows, const int32_t* slot, const float* weights,
                        void* drows, float* dweights, int64_t tokens, int32_t top_k,
                        int64_t hidden) override {
    cpu::combine_backward(f(dy), f(rows), slot, weights, f(drows), dweights, tokens, top_k, hidden, storage_);
  }

  void expert_ffn_backward(const void* x, const void* w1, const void* w3, const void* w2, const void* pre1,
                           const void* pre3, const void* h, const void* dout, void* dx, void* dw1, void* dw3,
                           void* dw2, const int64_t* expert_offsets, int32_t local_experts, int64_t hidden,
                           int64_t ffn, Activation activation, bool accumulate, DType dw_dtype) override {
    DMOE_REQUIRE(dw_dtype == DType::f64, "cpu backend: expert weight gradients are f64 (asked for {})",
                 dtype_name(dw_dtype));
    const bool swiglu = activation == Activation::swiglu;
    if (!accumulate) {  // overwrite: the kernels below add, so start every expert's gradients at zero
      const size_t count = size_t(local_experts) * size_t(ffn) * size_t(hidden);
      std::fill_n(d(dw1), count, 0.0);
      std::fill_n(d(dw2), count, 0.0);
      if (swiglu) std::fill_n(d(dw3), count, 0.0);
    }
    for (int32_t e = 0; e < local_experts; ++e) {
      const int64_t r0 = expert_offsets[e], n = expert_offsets[e + 1] - r0;
      if (n == 0) continue;
      const int64_t wm = ffn * hidden;
      cpu::expert_ffn_backward(f(x) + r0 * hidden, f(w1) + e * wm, swiglu ? f(w3) + e * wm : nullptr,
                               f(w2) + e * wm, f(pre1) + r0 * ffn, swiglu ? f(pre3) + r0 * ffn : nullptr,
                               f(h) + r0 * ffn, f(dout) + r0 * hidden, f(dx) + r0 * hidden,
                               d(dw1) + e * wm, swiglu ? d(dw3) + e * wm : nullptr, d(dw2) + e * wm, n,
                               hidden, ffn, activation, storage_);
    }
  }

  void router_backward(const void* x, const void* wg, const float* probs, const int32_t* ids,
                       const float* weights, const float* dweights, const cpu::RouterAuxGrad& aux,
                       float* dlogits, float* dx_router, void* dwg, int64_t tokens, int64_t hidden,
                       int32_t experts, int32_t top_k, bool renormalize) override {
    cpu::router_topk_backward(probs, ids, weights, dweights, dlogits, tokens, experts, top_k, renormalize, aux);
    std::memset(dx_router, 0, size_t(tokens * hidden) * sizeof(float));
    cpu::router_logits_backward(f(x), f(wg), dlogits, dx_router, d(dwg), tokens, hidden, experts);
  }

  void scatter_back(const void* dsend, const int32_t* slot, const void* dx_router, void* dx, int64_t tokens,
                    int32_t top_k, int64_t hidden) override {
    cpu::combine(f(dsend), slot, nullptr, static_cast<const float*>(dx_router), f(dx), tokens, top_k,
                 hidden, storage_);
  }

 private:
  static const float* f(const void* p) { return static_cast<const float*>(p); }
  static float* f(void* p) { return static_cast<float*>(p); }
  static double* d(void* p) { return static_cast<double*>(p); }
  DType storage_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(DType storage) { return std::make_unique<CpuBackend>(storage); }

}  // namespace dmoe
