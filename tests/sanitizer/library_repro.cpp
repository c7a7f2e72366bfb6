// library_repro.cpp — minimal reproductions for the compute-sanitizer reports that the GPU suite's run over the
// whole suite (scripts/sanitize_suite.py, docs/faults.md) attributes to NVIDIA's libraries, not to dmoe: one
// library call on inputs that cudaMemcpy wrote in full, nothing of dmoe's own kernels in between, and a check
// that the results are right (so a report is about the tool's view, not a wrong value).
//
//   dmoe_library_repro cudnn    cuDNN's fused attention, forward + backward (bf16, causal, GQA: the
//                               sdpa_sm90_flash_{fprop,bprop}_wgmma kernels the model uses), compared with
//                               dmoe's own attention kernels on the same inputs;
//   dmoe_library_repro cublas   one bf16 GEMM large enough for cuBLAS's Hopper kernels (nvjet_sm90_*),
//                               C = A·B of ones (every element = K), read back by cudaMemcpy.
//
// Run each mode under the four tools (gpu_check.sh's sanitize part does): every report these print belongs to the
// library kernel named in it or to the copy of what that kernel wrote.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_cudnn.hpp"
#include "cuda/kernels.cuh"
#include "cuda/model_kernels.cuh"

namespace {

int check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}

template <typename T>
T* upload(const std::vector<T>& h) {
  T* d = nullptr;
  if (check(cudaMalloc(&d, h.size() * sizeof(T)), "cudaMalloc") ||
      check(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"))
    std::exit(2);
  return d;
}

// Outputs are left as cudaMalloc gives them: the library kernel is what writes them (initcheck's question).
template <typename T>
T* output(size_t n) {
  T* d = nullptr;
  if (check(cudaMalloc(&d, n * sizeof(T)), "cudaMalloc")) std::exit(2);
  return d;
}

std::vector<float> download_bf16(const __nv_bfloat16* d, size_t n) {
  std::vector<__nv_bfloat16> h(n);
  if (check(cudaMemcpy(h.data(), d, n * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost), "download")) std::exit(2);
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = __bfloat162float(h[i]);
  return f;
}

double max_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::isfinite(a[i]) ? std::max(m, double(std::fabs(a[i] - b[i]))) : 1e30;
  return m;
}

int run_cudnn() {
  std::string why;
  if (!dmoe::cuda::CudnnAttention::available(&why)) {
    std::fprintf(stderr, "cuDNN attention is not available here: %s\n", why.c_str());
    return 2;
  }
  const int64_t batch = 1, seq = 128, D = 64;
  const int32_t heads = 4, kv_heads = 2;
  const size_t nq = size_t(batch * seq * heads * D), nkv = size_t(batch * seq * kv_heads * D);
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.f, 1.f);
  auto random = [&](size_t n) {
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = __float2bfloat16(dist(gen));
    return v;
  };
  __nv_bfloat16 *q = upload(random(nq)), *k = upload(random(nkv)), *v = upload(random(nkv)), *dout = upload(random(nq));
  // Two sets of outputs: cuDNN's and the own kernels'.
  __nv_bfloat16 *out[2], *dq[2], *dk[2], *dv[2];
  float* lse[2];
  for (int i = 0; i < 2; ++i) {
    out[i] = output<__nv_bfloat16>(nq);
    dq[i] = output<__nv_bfloat16>(nq);
    dk[i] = output<__nv_bfloat16>(nkv);
    dv[i] = output<__nv_bfloat16>(nkv);
    lse[i] = output<float>(size_t(batch * heads * seq));
  }
  cudaStream_t stream;
  if (check(cudaStreamCreate(&stream), "cudaStreamCreate")) return 2;
  {
    dmoe::cuda::CudnnAttention attention;
    attention.forward(q, k, v, out[0], lse[0], batch, seq, heads, kv_heads, D, stream);
    attention.backward(q, k, v, out[0], lse[0], dout, dq[0], dk[0], dv[0], batch, seq, heads, kv_heads, D, stream);
    if (check(cudaStreamSynchronize(stream), "cuDNN attention")) return 2;
  }
  dmoe::cuda::Workspace ws;
  dmoe::cuda::attention_forward<__nv_bfloat16>(q, k, v, out[1], lse[1], batch, seq, heads, kv_heads, D, ws, stream);
  dmoe::cuda::attention_backward<__nv_bfloat16>(q, k, v, out[1], lse[1], dout, dq[1], dk[1], dv[1], batch, seq, heads,
                                                kv_heads, D, ws, stream);
  if (check(cudaStreamSynchronize(stream), "own attention")) return 2;
  // bf16 results of two different summation orders: a few bf16 ulps apart at these magnitudes.
  const double tol = 0.1;
  const double d_out = max_diff(download_bf16(out[0], nq), download_bf16(out[1], nq));
  const double d_dq = max_diff(download_bf16(dq[0], nq), download_bf16(dq[1], nq));
  const double d_dk = max_diff(download_bf16(dk[0], nkv), download_bf16(dk[1], nkv));
  const double d_dv = max_diff(download_bf16(dv[0], nkv), download_bf16(dv[1], nkv));
  std::printf("cudnn: max |cuDNN - own| out %.3g, dq %.3g, dk %.3g, dv %.3g (tolerance %.2g)\n", d_out, d_dq, d_dk,
              d_dv, tol);
  return d_out <= tol && d_dq <= tol && d_dk <= tol && d_dv <= tol ? 0 : 1;
}

int run_cublas() {
  const int n = 2048;  // C [n, n] f32 = A [n, n] bf16 · B [n, n] bf16, all ones: every element n
  std::vector<__nv_bfloat16> ones(size_t(n) * n, __float2bfloat16(1.f));
  __nv_bfloat16 *a = upload(ones), *b = upload(ones);
  float* c = output<float>(size_t(n) * n);
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) return 2;
  const float one = 1, zero = 0;
  if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, c,
                   CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "cublasGemmEx failed\n");
    return 2;
  }
  std::vector<float> h(size_t(n) * n);
  if (check(cudaMemcpy(h.data(), c, h.size() * sizeof(float), cudaMemcpyDeviceToHost), "read back")) return 2;
  cublasDestroy(handle);
  size_t wrong = 0;
  for (float x : h) wrong += x != float(n);
  std::printf("cublas: %zu of %zu elements differ from %d\n", wrong, h.size(), n);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "cudnn") == 0) return run_cudnn();
  if (std::strcmp(mode, "cublas") == 0) return run_cublas();
  std::fprintf(stderr, "usage: %s cudnn|cublas\n", argv[0]);
  return 2;
}
