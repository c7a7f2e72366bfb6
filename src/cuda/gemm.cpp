// cuda/gemm.cpp — row-major GEMM wrappers over cuBLAS: one product (cublasGemmEx_64) and the grouped
// expert product (cublasGemmGroupedBatchedEx_64 for many small products; a loop of single products for
// large ones and where the grouped API does not take the operand types). See common.hpp for the
// row-major ↔ column-major mapping.
#include <vector>

#include "cuda/common.hpp"

namespace dmoe::cuda {

namespace {

cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

// The grouped API takes A, B and C of one type (bf16 or f32) with fp32 compute; see the cuBLAS table
// for cublasGemmGroupedBatchedEx. Mixed types (bf16 × bf16 → f32) are not in it.
bool grouped_supports(cudaDataType_t a_type, cudaDataType_t b_type, cudaDataType_t c_type) {
  return a_type == b_type && b_type == c_type && (a_type == CUDA_R_16BF || a_type == CUDA_R_32F);
}

// The grouped call pays only for small products. Measured on H200, cuBLAS 13.1, bf16, up-projection
// (TFLOP/s grouped / loop of cublasGemmEx; one GEMM of the same FLOPs reaches 780-870):
//   Le=32 n=64   H=4096 I=1024   (0.27 G MAC per expert): 173 / 35
//   Le=64 n=256  H=2048 I=1408   (0.74 G):                281 / 142
//   Le=64 n=512  H=2048 I=1408   (1.5 G):                 293 / 285
//   Le=8  n=64   H=4096 I=14336  (3.8 G):                 212 / 209
//   Le=8  n=128  H=4096 I=14336  (7.5 G):                 270 / 417
//   Le=16 n=1024 H=7168 I=2048   (15 G):                  336 / 786
//   Le=8  n=2048 H=4096 I=14336  (120 G):                 332 / 839
// so the loop takes over from a mean of 1.5 G multiply-adds per problem.
constexpr double kGroupedMaxMeanMacs = 1.5e9;

}  // namespace

void gemm_rm(cublasHandle_t cublas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
             const void* a, cudaDataType_t a_type, int64_t lda, const void* b, cudaDataType_t b_type,
             int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc) {
  DMOE_CUDA_REQUIRE(m >= 0 && n >= 0 && k >= 0, "gemm: negative shape m=%lld n=%lld k=%lld", (long long)m,
                    (long long)n, (long long)k);
  if (m == 0 || n == 0) return;
  // Column-major: C^T [n, m] = op(B)^T [n, k] · op(A)^T [k, m]. A row-major [r, c] buffer is the
  // column-major [c, r] matrix, so "no transpose" in row-major terms is also CUBLAS_OP_N here.
  DMOE_CHECK_CUBLAS(cublasGemmEx_64(cublas, op(trans_b), op(trans_a), n, m, k, &alpha, b, b_type, ldb, a,
                                    a_type, lda, &beta, c, c_type, ldc, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

void gemm_rm_grouped(const CudaContext& ctx, void* pointer_scratch, bool trans_a, bool trans_b, int64_t lda,
                     int64_t ldb, int64_t ldc, float alpha, float beta, cudaDataType_t a_type,
                     cudaDataType_t b_type, cudaDataType_t c_type, const std::vector<GemmProblem>& problems) {
  if (problems.empty()) return;
  bool aligned = true;
  double macs = 0;
  for (const GemmProblem& p : problems) {
    aligned = aligned && is_aligned(p.a, 16) && is_aligned(p.b, 16) && is_aligned(p.c, 16);
    macs += double(p.m) * double(p.n) * double(p.k);
  }
  const bool small = macs / double(problems.size()) < kGroupedMaxMeanMacs;

  if (!grouped_supports(a_type, b_type, c_type) || !aligned || !small || problems.size() == 1) {
    // NOTE: the loop is the path for large products (faster, see above), mixed-type products (weight
    // gradients of bf16 experts into f32) and row lengths that break 16-byte alignment; each call is
    // one expert's whole product.
    for (const GemmProblem& p : problems)
      gemm_rm(ctx.cublas, trans_a, trans_b, p.m, p.n, p.k, alpha, p.a, a_type, lda, p.b, b_type, ldb, beta,
              p.c, c_type, ldc);
    return;
  }

  // One group per problem (every expert has its own m or k); cuBLAS sees the swapped product (see
  // gemm_rm), so its A array holds our B pointers and its B array our A pointers.
  const int64_t g = int64_t(problems.size());
  std::vector<cublasOperation_t> trans_a_arr(g, op(trans_b)), trans_b_arr(g, op(trans_a));
  std::vector<int64_t> m_arr(g), n_arr(g), k_arr(g), lda_arr(g, ldb), ldb_arr(g, lda), ldc_arr(g, ldc);
  std::vector<int64_t> group_size(g, 1);
  std::vector<float> alpha_arr(g, alpha), beta_arr(g, beta);
  std::vector<const void*> pointers(3 * g);  // [cublas A (= our B)] [cublas B (= our A)] [C]
  for (int64_t i = 0; i < g; ++i) {
    const GemmProblem& p = problems[i];
    m_arr[i] = p.n;
    n_arr[i] = p.m;
    k_arr[i] = p.k;
    pointers[i] = p.b;
    pointers[g + i] = p.a;
    pointers[2 * g + i] = p.c;
  }
  upload_async(pointer_scratch, pointers.data(), pointers.size() * sizeof(void*), ctx.stream);
  void** device_pointers = static_cast<void**>(pointer_scratch);  // [3g] as laid out above
  const void* const* cublas_a = device_pointers;
  const void* const* cublas_b = device_pointers + g;
  void* const* cublas_c = device_pointers + 2 * g;
  DMOE_CHECK_CUBLAS(cublasGemmGroupedBatchedEx_64(
      ctx.cublas, trans_a_arr.data(), trans_b_arr.data(), m_arr.data(), n_arr.data(), k_arr.data(),
      alpha_arr.data(), cublas_a, b_type, lda_arr.data(), cublas_b, a_type, ldb_arr.data(), beta_arr.data(),
      cublas_c, c_type, ldc_arr.data(), g, group_size.data(), CUBLAS_COMPUTE_32F));
}

}  // namespace dmoe::cuda
