// cuda/cuda_backend.cpp — CudaBackend: dmoe::Backend over the CUDA launchers of cuda/kernels.cuh.
//
// Each stage casts the backend's void pointers to the storage type (float or __nv_bfloat16) and calls the
// launcher of the same name on the backend's stream. See cuda_backend.hpp for what synchronises.
#include "cuda/cuda_backend.hpp"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/dispatch_plan.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"
#include "cuda/kernels.cuh"

namespace dmoe {
namespace {

using cuda::bf16;

// The copy goes into pinned memory owned here, with an event behind it: wait() waits for that event only.
class CudaReadback final : public HostReadback {
 public:
  explicit CudaReadback(const cudaStream_t* stream) : stream_(stream) {
    DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~CudaReadback() override {
    // A copy still in flight writes into the block: wait for it (quietly) before freeing, unless the GPU hangs.
    if (pending_ && !cuda::gpu_abandoned()) pending_ = cudaEventSynchronize(done_) != cudaSuccess;
    if (host_ && !pending_) (void)cudaFreeHost(host_);
    (void)cudaEventDestroy(done_);
  }
  CudaReadback(const CudaReadback&) = delete;
  CudaReadback& operator=(const CudaReadback&) = delete;

  void start(const void* src, size_t bytes) override {
    if (bytes > capacity_) {
      if (pending_) wait("cuda backend: a readback growing its block");
      if (host_) DMOE_CHECK_CUDA(cudaFreeHost(host_));
      host_ = nullptr;
      capacity_ = 0;
      DMOE_CHECK_CUDA(cudaHostAlloc(&host_, bytes, cudaHostAllocPortable));
      capacity_ = bytes;
    }
    if (bytes) DMOE_CHECK_CUDA(cudaMemcpyAsync(host_, src, bytes, cudaMemcpyDeviceToHost, *stream_));
    DMOE_CHECK_CUDA(cudaEventRecord(done_, *stream_));
    pending_ = true;
  }
  const void* wait(const char* what) override {
    if (pending_) cuda::wait_event(done_, what);
    pending_ = false;
    return host_;
  }

 private:
  const cudaStream_t* stream_;  // the backend's current stream (it may switch between calls)
  cudaEvent_t done_ = nullptr;
  void* host_ = nullptr;
  size_t capacity_ = 0;
  bool pending_ = false;
};

class CudaBackend final : public Backend {
 public:
  CudaBackend(DType storage, int device) : storage_(storage), device_(device) {
    DMOE_REQUIRE(storage == DType::f32 || storage == DType::bf16,
                 "cuda backend: storage dtype {} is not supported; allowed: f32, bf16", dtype_name(storage));
    int count = 0;
    DMOE_CHECK_CUDA(cudaGetDeviceCount(&count));
    DMOE_REQUIRE(device >= 0 && device < count, "cuda backend: device {} does not exist; this machine has {}",
                 device, count);
    cuda::set_device_or_explain(device, "cuda backend");
    DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    own_stream_ = stream_;
    DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&switch_event_, cudaEventDisableTiming));
    DMOE_CHECK_CUBLAS(cublasCreate(&cublas_));
    DMOE_CHECK_CUBLAS(cublasSetStream(cublas_, stream_));
    // f32 GEMMs must be true f32 (the CPU comparison assumes it): no TF32 tensor-op math.
    DMOE_CHECK_CUBLAS(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    ctx_ = cuda::CudaContext{stream_, cublas_, &workspace_, &host_staging_};
  }

  ~CudaBackend() override {
    // cublasDestroy synchronises the device: left to process exit when the GPU work hangs.
    const bool idle = cuda::wait_stream_quietly(stream_) &&
                      (stream_ == own_stream_ || cuda::wait_stream_quietly(own_stream_));
    if (idle) (void)cublasDestroy(cublas_);
    (void)cudaEventDestroy(switch_event_);
    (void)cudaStreamDestroy(own_stream_);  // never a caller's stream
  }

  // See set_cuda_backend_stream. The caller's stream may be the legacy default stream (null).
  void use_stream(cudaStream_t next) {
    if (next == stream_) return;
    DMOE_CHECK_CUDA(cudaSetDevice(device_));
    // No join across a CUDA-graph capture's boundary (CUDA refuses a dependency that crosses it): work captured
    // on `next` runs only when the graph is launched, after what the caller ordered before the launch.
    if (!capturing(stream_) && !capturing(next)) {
      DMOE_CHECK_CUDA(cudaEventRecord(switch_event_, stream_));
      DMOE_CHECK_CUDA(cudaStreamWaitEvent(next, switch_event_, 0));
    }
    DMOE_CHECK_CUBLAS(cublasSetStream(cublas_, next));
    stream_ = next;
    ctx_.stream = next;
  }
  cudaStream_t own_stream() const { return own_stream_; }

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  const char* name() const override { return "cuda"; }
  bool on_device() const override { return true; }
  DType storage_dtype() const override { return storage_; }
  DType grad_accum_dtype() const override { return DType::f32; }
  Stream stream() override { return stream_; }
  bool stream_capturing() override { return capturing(stream_); }
  static bool capturing(cudaStream_t s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t e = cudaStreamIsCapturing(s, &status);
    if (e == cudaErrorStreamCaptureImplicit) {  // the legacy stream while a blocking stream captures: part of it
      (void)cudaGetLastError();
      return true;
    }
    DMOE_CHECK_CUDA(e);
    return status != cudaStreamCaptureStatusNone;
  }

  // ---- memory ----
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    return cuda::device_malloc(bytes, "an engine buffer");
  }
  void release(void* p) noexcept override {
    if (!p) return;
    // Queued kernels may still use the block; errors cannot be reported from here. If the stream does not
    // finish (a peer rank died inside a collective), the block is left to process exit rather than freed
    // under running work or waited on forever.
    if (cuda::wait_stream_quietly(stream_)) (void)cudaFree(p);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) DMOE_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    // Pageable host memory is staged by the driver before the call returns: `host` may be reused at once.
    if (bytes) DMOE_CHECK_CUDA(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
  }
  void download(void* host, const void* src, size_t bytes) override {
    // Through pinned staging, so that the wait is time-limited (a pageable target would block inside
    // cudaMemcpyAsync until the GPU is done, however long that takes).
    cuda::download_bounded(host, src, bytes, stream_, &host_staging_, "cuda backend: reading device memory");
  }
  void upload_on(void* dst, const void* host, size_t bytes, Stream stream) override {
    if (bytes)
      DMOE_CHECK_CUDA(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
  }
  void download_on(void* host, const void* src, size_t bytes, Stream stream) override {
    // The staging block is shared with download(): one host thread issues both, and each waits before returning.
    cuda::download_bounded(host, src, bytes, static_cast<cudaStream_t>(stream), &host_staging_,
                           "cuda backend: reading device memory (exchange stream)");
  }
  void zero(void* p, size_t bytes) override {
    if (bytes) DMOE_CHECK_CUDA(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  void synchronize() override { cuda::wait_stream(stream_, "cuda backend: waiting for the GPU"); }

  // Conversions on the host with core's round-to-nearest-even, bit for bit the CPU backend's rounding.
  void upload_f32(void* dst, const float* host, int64_t count) override {
    if (storage_ == DType::f32) return upload(dst, host, size_t(count) * sizeof(float));
    std::vector<uint16_t> bits(count);
    for (int64_t i = 0; i < count; ++i) bits[i] = float_to_bf16(host[i]).bits;
    upload(dst, bits.data(), bits.size() * sizeof(uint16_t));
  }
  void download_f32(float* host, const void* src, int64_t count) override {
    if (storage_ == DType::f32) return download(host, src, size_t(count) * sizeof(float));
    std::vector<uint16_t> bits(count);
    download(bits.data(), src, bits.size() * sizeof(uint16_t));
    for (int64_t i = 0; i < count; ++i) host[i] = bf16_to_float(bfloat16{bits[i]});
  }

  // ---- stages ----
  void router_forward(const void* x, const void* wg, float* logits, float* probs, int32_t* ids,
                      float* weights, float* lse, int64_t tokens, int64_t hidden, int32_t experts,
                      int32_t top_k, bool renormalize) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::router_logits<T>(as<T>(x), as<T>(wg), logits, tokens, hidden, experts, ctx_);
    });
    cuda::router_topk(logits, probs, ids, weights, lse, tokens, experts, top_k, renormalize, stream_);
  }

  void plan_send(const int32_t* ids, const float* weights, int64_t tokens, int32_t top_k, int32_t experts,
                 int64_t capacity, DropPolicy policy, const SendPlanBuffers& plan, int64_t* routed_host,
                 int64_t* counts_host) override {
    cuda::plan_send(ids, tokens, top_k, experts, capacity, plan.slot, plan.row_token, plan.row_choice,
                    routed_host, counts_host, ctx_);
    if (policy != DropPolicy::lowest_weight || capacity < 0) return;
    // The policies differ only for experts over capacity. For lowest_weight there, the plan is built on
    // the host by core build_send_plan and uploaded (a sort by weight per expert; first version).
    if (std::none_of(routed_host, routed_host + experts, [&](int64_t r) { return r > capacity; })) return;
    const int64_t assignments = tokens * top_k;
    std::vector<int32_t> h_ids(assignments);
    std::vector<float> h_weights(assignments);
    download(h_ids.data(), ids, h_ids.size() * sizeof(int32_t));
    download(h_weights.data(), weights, h_weights.size() * sizeof(float));
    const SendPlan p =
        build_send_plan(h_ids.data(), h_weights.data(), tokens, top_k, experts, capacity, policy);
    upload(plan.slot, p.slot.data(), p.slot.size() * sizeof(int32_t));
    upload(plan.row_token, p.row_token.data(), p.row_token.size() * sizeof(int32_t));
    upload(plan.row_choice, p.row_choice.data(), p.row_choice.size() * sizeof(int32_t));
    std::copy(p.routed.begin(), p.routed.end(), routed_host);
    std::copy(p.counts.begin(), p.counts.end(), counts_host);
  }

  void router_aux_partials(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                           int32_t experts, int32_t top_k, double* prob_sum, double* assigned,
                           double* z_sum) override {
    cuda::router_aux_partials(probs, lse, ids, tokens, experts, top_k, prob_sum, assigned, z_sum, ctx_);
  }

  void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
                           const SendPlanBuffers& plan, int64_t* counts) override {
    cuda::plan_send_on_device(ids, tokens, top_k, experts, capacity, plan.slot, plan.row_token, plan.row_choice,
                              counts, ctx_);
  }
  void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                                     int32_t experts, int32_t top_k, void* stats) override {
    cuda::router_aux_partials_on_device(probs, lse, ids, tokens, experts, top_k, stats, ctx_);
  }
  bool expert_ffn_forward_takes_device_offsets(const void* x, const void* w1, const void* w3, const void* w2,
                                               const void* pre1, const void* pre3, const void* h, const void* out,
                                               int64_t rows, int32_t local_experts, int64_t hidden, int64_t ffn,
                                               Activation activation) override {
    // The own kernel runs bf16 only; f32 stays on cuBLAS, whose products need the counts on the host.
    return storage_ == DType::bf16 &&
           cuda::expert_ffn_forward_takes_device_offsets(x, w1, w3, w2, pre1, pre3, h, out, rows, local_experts,
                                                         hidden, ffn, activation);
  }
  void expert_ffn_forward_device_offsets(const void* x, const void* w1, const void* w3, const void* w2, void* pre1,
                                         void* pre3, void* h, void* out, const int64_t* expert_offsets, int64_t rows,
                                         int32_t local_experts, int64_t hidden, int64_t ffn,
                                         Activation activation) override {
    DMOE_REQUIRE(storage_ == DType::bf16, "cuda backend: expert_ffn_forward_device_offsets needs bf16 storage");
    cuda::expert_ffn_forward_device_offsets(as<bf16>(x), as<bf16>(w1), as<bf16>(w3), as<bf16>(w2), as<bf16>(pre1),
                                            as<bf16>(pre3), as<bf16>(h), as<bf16>(out), expert_offsets, rows,
                                            local_experts, hidden, ffn, activation, ctx_);
  }
  std::unique_ptr<HostReadback> make_readback() override { return std::make_unique<CudaReadback>(&stream_); }

  void gather_rows(const void* x, const int32_t* rows, void* out, int64_t n, int64_t hidden) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::gather_rows<T>(as<T>(x), rows, as<T>(out), n, hidden, stream_);
    });
  }

  void permute_segments(const void* src, void* dst, const int64_t* src_offsets, const int64_t* dst_offsets,
                        const int64_t* counts, int64_t segments, int64_t hidden) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::permute_segments<T>(as<T>(src), as<T>(dst), src_offsets, dst_offsets, counts, segments, hidden,
                                stream_);
    });
  }

  void combine(const void* rows, const int32_t* slot, const float* weights, void* y, int64_t tokens,
               int32_t top_k, int64_t hidden) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::combine<T>(as<T>(rows), slot, weights, nullptr, as<T>(y), tokens, top_k, hidden, stream_);
    });
  }

  void expert_ffn_forward(const void* x, const void* w1, const void* w3, const void* w2, void* pre1,
                          void* pre3, void* h, void* out, const int64_t* expert_offsets,
                          int32_t local_experts, int64_t hidden, int64_t ffn,
                          Activation activation) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::expert_ffn_forward<T>(as<T>(x), as<T>(w1), as<T>(w3), as<T>(w2), as<T>(pre1), as<T>(pre3),
                                  as<T>(h), as<T>(out), expert_offsets, local_experts, hidden, ffn,
                                  activation, ctx_);
    });
  }

  void combine_backward(const void* dy, const void* rows, const int32_t* slot, const float* weights,
                        void* drows, float* dweights, int64_t tokens, int32_t top_k,
                        int64_t hidden) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::combine_backward<T>(as<T>(dy), as<T>(rows), slot, weights, as<T>(drows), dweights, tokens, top_k,
                                hidden, stream_);
    });
  }

  void expert_ffn_backward(const void* x, const void* w1, const void* w3, const void* w2, const void* pre1,
                           const void* pre3, const void* h, const void* dout, void* dx, void* dw1, void* dw3,
                           void* dw2, const int64_t* expert_offsets, int32_t local_experts, int64_t hidden,
                           int64_t ffn, Activation activation, bool accumulate, DType dw_dtype) override {
    DMOE_REQUIRE(dw_dtype == DType::f32 || (dw_dtype == DType::bf16 && storage_ == DType::bf16 && !accumulate),
                 "cuda backend: expert weight gradients in {} (allowed: f32; bf16 for bf16 weights when written, not "
                 "added to)", dtype_name(dw_dtype));
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::expert_ffn_backward<T>(as<T>(x), as<T>(w1), as<T>(w3), as<T>(w2), as<T>(pre1), as<T>(pre3),
                                   as<T>(h), as<T>(dout), as<T>(dx), dw1, dw3, dw2, dw_dtype == DType::bf16,
                                   expert_offsets, local_experts, hidden, ffn, activation, accumulate, ctx_);
    });
  }

  void router_backward(const void* x, const void* wg, const float* probs, const int32_t* ids,
                       const float* weights, const float* dweights, const cpu::RouterAuxGrad& aux,
                       float* dlogits, float* dx_router, void* dwg, int64_t tokens, int64_t hidden,
                       int32_t experts, int32_t top_k, bool renormalize) override {
    cuda::router_topk_backward(probs, ids, weights, dweights, dlogits, tokens, experts, top_k, renormalize,
                               aux, ctx_);
    zero(dx_router, size_t(tokens) * size_t(hidden) * sizeof(float));  // the launcher accumulates (+=)
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::router_logits_backward<T>(as<T>(x), as<T>(wg), dlogits, dx_router, as<float>(dwg), tokens, hidden,
                                      experts, ctx_);
    });
  }

  void scatter_back(const void* dsend, const int32_t* slot, const void* dx_router, void* dx, int64_t tokens,
                    int32_t top_k, int64_t hidden) override {
    with_storage([&](auto tag) {
      using T = decltype(tag);
      cuda::combine<T>(as<T>(dsend), slot, nullptr, as<float>(dx_router), as<T>(dx), tokens, top_k, hidden,
                       stream_);
    });
  }

 private:
  // Calls fn(T{}) with T the storage type.
  template <typename Fn>
  void with_storage(Fn&& fn) {
    if (storage_ == DType::bf16)
      fn(bf16{});
    else
      fn(float{});
  }
  template <typename T>
  static const T* as(const void* p) {
    return static_cast<const T*>(p);
  }
  template <typename T>
  static T* as(void* p) {
    return static_cast<T*>(p);
  }

  DType storage_;
  int device_;
  cudaStream_t stream_ = nullptr;      // where work is issued: own_stream_ or a caller's
  cudaStream_t own_stream_ = nullptr;  // created and destroyed by the backend
  cudaEvent_t switch_event_ = nullptr; // orders the old stream's work before the new one's (use_stream)
  cublasHandle_t cublas_ = nullptr;
  cuda::Workspace workspace_;
  cuda::HostStaging host_staging_;
  cuda::CudaContext ctx_;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(DType storage, int device) {
  return std::make_unique<CudaBackend>(storage, device);
}

namespace {
CudaBackend& as_cuda_backend(Backend& backend, const char* what) {
  auto* cuda = dynamic_cast<CudaBackend*>(&backend);
  DMOE_REQUIRE(cuda != nullptr, "{}: the {} backend is not a CUDA backend (make_cuda_backend)", what, backend.name());
  return *cuda;
}
}  // namespace

void set_cuda_backend_stream(Backend& backend, Stream stream) {
  as_cuda_backend(backend, "set_cuda_backend_stream").use_stream(static_cast<cudaStream_t>(stream));
}

void use_own_cuda_backend_stream(Backend& backend) {
  CudaBackend& cuda = as_cuda_backend(backend, "use_own_cuda_backend_stream");
  cuda.use_stream(cuda.own_stream());
}

}  // namespace dmoe
