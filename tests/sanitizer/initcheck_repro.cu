// initcheck_repro.cu — the minimal reproduction behind docs/faults.md's compute-sanitizer section: does
// initcheck see global memory written by (a) a plain store, (b) a TMA bulk store from shared memory
// (cp.async.bulk, as Hopper GEMM epilogues write their tiles), (c) a cuBLAS GEMM (what writes dmoe's
// router logits), when a later kernel reads it? Run under `compute-sanitizer --tool initcheck`; each mode
// writes every element before the read, so any "Uninitialized __global__ memory read" is the tool's.
//
//   dmoe_initcheck_repro plain|bulk|cublas
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kN = 4096;  // floats

__global__ void write_plain(float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < kN) out[i] = float(i);
}

// One block per 1024 floats: fill shared memory, then one thread copies it out with a bulk async store.
__global__ void write_bulk(float* out) {
  __shared__ alignas(128) float tile[1024];
  for (int i = threadIdx.x; i < 1024; i += blockDim.x) tile[i] = float(blockIdx.x * 1024 + i);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic stores visible to the async proxy
  __syncthreads();
  if (threadIdx.x == 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(tile));
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(out + blockIdx.x * 1024), "r"(src),
                 "r"(1024 * 4)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
  }
}

__global__ void read_sum(const float* in, float* sum) {
  float s = 0;
  for (int i = threadIdx.x; i < kN; i += blockDim.x) s += in[i];
  atomicAdd(sum, s);
}

int check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  float *buf = nullptr, *sum = nullptr;
  if (check(cudaMalloc(&buf, kN * sizeof(float)), "cudaMalloc") || check(cudaMalloc(&sum, sizeof(float)), "cudaMalloc") ||
      check(cudaMemset(sum, 0, sizeof(float)), "cudaMemset"))
    return 2;
  if (std::strcmp(mode, "plain") == 0) {
    write_plain<<<kN / 256, 256>>>(buf);
  } else if (std::strcmp(mode, "bulk") == 0) {
    write_bulk<<<kN / 1024, 128>>>(buf);
  } else if (std::strcmp(mode, "cublas") == 0) {
    // As dmoe's router logits: C [64 tokens, 64 experts] f32 = A [64, 64] bf16 · B [64, 64] bf16 (cublasGemmEx,
    // f32 compute), inputs of ones written by cudaMemcpy.
    std::vector<unsigned short> h(kN, 0x3F80);  // bf16 1.0
    void *a = nullptr, *b = nullptr;
    cudaMalloc(&a, kN * 2);
    cudaMalloc(&b, kN * 2);
    cudaMemcpy(a, h.data(), kN * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(b, h.data(), kN * 2, cudaMemcpyHostToDevice);
    cublasHandle_t handle;
    cublasCreate(&handle);
    const float one = 1, zero = 0;
    if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, 64, 64, 64, &one, a, CUDA_R_16BF, 64, b, CUDA_R_16BF, 64, &zero,
                     buf, CUDA_R_32F, 64, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
      std::fprintf(stderr, "cublasGemmEx failed\n");
      return 2;
    }
    cudaDeviceSynchronize();
    cublasDestroy(handle);
  } else {
    std::fprintf(stderr, "usage: %s plain|bulk|cublas\n", argv[0]);
    return 2;
  }
  read_sum<<<1, 256>>>(buf, sum);
  float h = 0;
  if (check(cudaMemcpy(&h, sum, sizeof(float), cudaMemcpyDeviceToHost), "read back")) return 2;
  const double expected = std::strcmp(mode, "cublas") == 0 ? 64.0 * kN : double(kN) * (kN - 1) / 2;
  std::printf("%s: sum %.0f (expected %.0f)\n", mode, h, expected);
  return h == float(expected) ? 0 : 1;
}
