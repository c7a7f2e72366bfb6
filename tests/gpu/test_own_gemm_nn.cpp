// test_own_gemm_nn.cpp — the NN variant of dmoe's own Hopper grouped GEMM (sm90_grouped_gemm_nn,
// cuda/grouped_gemm_sm90.cu: C = A·B_g (+ A2·B2_g), B MN-major) against its CPU twin
// (cpu::grouped_gemm_nn, fp64 sums) and against cuBLAS (gemm_rm_grouped, as the backward pass ran it) on
// the same bf16 inputs.
//
// Shapes: many tiles per CTA (the slot ring wraps), empty groups, a group of 1 row, of exactly 128 rows,
// of 40 (the second consumer skips), rows not a multiple of 128, n and k not multiples of the tile (n tails
// inside a 64-column panel, k tails inside a k-block — and, with the second product, at the boundary
// between the two parts), all rows in one group (skew), rows before the first and after the last group
// that must stay untouched. Both tile widths and both schedules. Skips where no sm_90 GPU is present or
// the build lacks sm_90a.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cpu/kernels.hpp"
#include "cuda/common.hpp"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

using test::grouped_test_offsets;
using test::has_cuda_device;
using test::random_bf16_bits;

struct NnShape {
  int32_t groups;
  int64_t max_rows, n, k;
  int block_n;        // 0: the default (DMOE_SM90_BLOCK_N or 256)
  bool two;           // the second product (A2·B2: SwiGLU's dx)
  int schedule = 0;   // 0 default (dynamic), 1 static, 2 dynamic
  bool skew = false;  // all rows in one group (the others empty)
  bool twin = false;  // through cuda::grouped_gemm_nn (the twin's signature, workspace scratch)
  uint32_t lag_ns = 0;  // Sm90Tuning::skip_lag_ns (test_own_gemm.cpp's lagged shapes)
};

struct DeviceBuffers {
  std::vector<void*> list;
  ~DeviceBuffers() {
    for (void* d : list) cudaFree(d);
  }
  void* upload(const std::vector<uint16_t>& v) {
    void* d = nullptr;
    if (v.empty()) return d;
    EXPECT_EQ(cudaMalloc(&d, v.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    list.push_back(d);
    return d;
  }
};

class CudaKernelsOwnGemmNN : public testing::TestWithParam<NnShape> {};

TEST_P(CudaKernelsOwnGemmNN, MatchesCpuTwinAndCublas) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const NnShape s = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);

  // Rows: 5 untouched rows, the groups, 3 untouched rows.
  constexpr int64_t kBefore = 5, kAfter = 3;
  const std::vector<int64_t> offsets = grouped_test_offsets(rng, s.groups, s.max_rows, kBefore, s.skew);
  const int64_t rows_total = offsets.back() + kAfter;
  auto random_bf16 = [&](size_t count) { return random_bf16_bits(rng, count); };
  const std::vector<uint16_t> a = random_bf16(size_t(rows_total * s.k));
  const std::vector<uint16_t> b = random_bf16(size_t(s.groups) * s.k * s.n);
  const std::vector<uint16_t> a2 = random_bf16(s.two ? size_t(rows_total * s.k) : 0);
  const std::vector<uint16_t> b2 = random_bf16(s.two ? size_t(s.groups) * s.k * s.n : 0);
  constexpr uint16_t kSentinel = 0x7fc1;  // a NaN no product produces
  std::vector<uint16_t> c(size_t(rows_total * s.n), kSentinel), c_blas = c;

  cuda::CudaContext ctx;
  cuda::Workspace workspace;
  ctx.workspace = &workspace;
  ASSERT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
  ASSERT_EQ(cublasCreate(&ctx.cublas), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(ctx.cublas, ctx.stream), CUBLAS_STATUS_SUCCESS);
  struct Release {
    cuda::CudaContext& ctx;
    ~Release() {
      cublasDestroy(ctx.cublas);
      cudaStreamDestroy(ctx.stream);
    }
  } release{ctx};
  DeviceBuffers buffers;
  auto* d_a = static_cast<const __nv_bfloat16*>(buffers.upload(a));
  auto* d_b = static_cast<const __nv_bfloat16*>(buffers.upload(b));
  auto* d_a2 = static_cast<const __nv_bfloat16*>(buffers.upload(a2));
  auto* d_b2 = static_cast<const __nv_bfloat16*>(buffers.upload(b2));
  auto* d_c = static_cast<__nv_bfloat16*>(buffers.upload(c));
  auto* d_c_blas = static_cast<__nv_bfloat16*>(buffers.upload(c_blas));

  const cuda::GroupedGemmNN g{d_a, d_b, d_c, offsets.data(), s.groups, s.n, s.k, d_a2, d_b2};
  if (!cuda::sm90_grouped_gemm_nn_usable(g))
    GTEST_SKIP() << "the own grouped GEMM needs an sm_90 GPU and a build for sm_90a";
  if (s.twin) {
    cuda::grouped_gemm_nn(d_a, d_b, d_a2, d_b2, d_c, offsets.data(), s.groups, s.n, s.k, ctx);
  } else {
    void* scratch = workspace.reserve(cuda::sm90_grouped_gemm_scratch_bytes(s.groups), ctx.stream);
    cuda::Sm90Tuning tuning;
    tuning.block_n = s.block_n;
    tuning.schedule = s.schedule;
    tuning.skip_lag_ns = s.lag_ns;
    cuda::sm90_grouped_gemm_nn(ctx, scratch, g, tuning);
  }
  cudaError_t status = cudaStreamSynchronize(ctx.stream);
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);

  // cuBLAS as expert_ffn_backward ran it: one problem per group with rows; the second product adds with
  // beta = 1 (a second rounding to bf16).
  std::vector<cuda::GemmProblem> p1, p2;
  for (int32_t e = 0; e < s.groups; ++e) {
    const int64_t r0 = offsets[e], m = offsets[e + 1] - r0;
    if (m == 0) continue;
    p1.push_back({m, s.n, s.k, d_a + r0 * s.k, d_b + int64_t(e) * s.k * s.n, d_c_blas + r0 * s.n});
    if (s.two) p2.push_back({m, s.n, s.k, d_a2 + r0 * s.k, d_b2 + int64_t(e) * s.k * s.n, d_c_blas + r0 * s.n});
  }
  void* pointers = workspace.reserve(cuda::grouped_pointer_bytes(int64_t(p1.size())), ctx.stream);
  cuda::gemm_rm_grouped(ctx, pointers, false, false, s.k, s.n, s.n, 1.f, 0.f, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, p1);
  if (s.two)
    cuda::gemm_rm_grouped(ctx, pointers, false, false, s.k, s.n, s.n, 1.f, 1.f, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF,
                          p2);
  status = cudaStreamSynchronize(ctx.stream);
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
  ASSERT_EQ(cudaMemcpy(c.data(), d_c, c.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(c_blas.data(), d_c_blas, c_blas.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);

  // The CPU twin on the same (bf16-valued) inputs, bf16 storage: fp64 sums rounded once. Its first product
  // alone bounds cuBLAS's intermediate rounding for the two-product case.
  auto to_f32 = [](const std::vector<uint16_t>& v) {
    std::vector<float> f(v.size());
    for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(bfloat16{v[i]});
    return f;
  };
  const std::vector<float> fa = to_f32(a), fb = to_f32(b), fa2 = to_f32(a2), fb2 = to_f32(b2);
  std::vector<float> twin(size_t(rows_total * s.n), 0.f), first(s.two ? twin.size() : 0, 0.f);
  cpu::grouped_gemm_nn(fa.data(), fb.data(), s.two ? fa2.data() : nullptr, s.two ? fb2.data() : nullptr, twin.data(),
                       offsets.data(), s.groups, s.n, s.k, DType::bf16);
  if (s.two)
    cpu::grouped_gemm_nn(fa.data(), fb.data(), nullptr, nullptr, first.data(), offsets.data(), s.groups, s.n, s.k,
                         DType::bf16);

  auto value = [](uint16_t bits) { return double(bf16_to_float(bfloat16{bits})); };
  const double k_total = double(s.two ? 2 * s.k : s.k);
  int64_t bad = 0, bad_blas = 0, untouched_bad = 0;
  std::string first_bad, first_bad_blas;
  for (int64_t r = 0; r < rows_total; ++r) {
    const bool in_group = r >= offsets.front() && r < offsets.back();
    for (int64_t j = 0; j < s.n; ++j) {
      const size_t i = size_t(r * s.n + j);
      if (!in_group) {
        untouched_bad += c[i] != kSentinel;
        continue;
      }
      const double ref = twin[i], got = value(c[i]), blas = value(c_blas[i]);
      // Own kernel vs the twin: both round to bf16 from sums that differ in their last bits (fp32 in
      // another order), so they may land on neighbouring bf16 values: one ulp, <= 2^-7 relative (seen on
      // the H200: -4.40625 against -4.4375), plus fp32 accumulation over k_total terms of size ~1 (1e-5
      // per term, as test_own_gemm.cpp).
      const double tol = 7.9e-3 * std::abs(ref) + 1e-5 * k_total;
      if (!(std::abs(got - ref) <= tol) && bad++ == 0)
        first_bad = "row " + std::to_string(r) + " col " + std::to_string(j) + ": got " + std::to_string(got) +
                    ", twin " + std::to_string(ref);
      // Own kernel vs cuBLAS: both within their bound of the exact sum; cuBLAS's two-product result also
      // carries the rounding of its first product (|first| · 2^-9, taken as 4e-3 · |first|).
      const double tol_blas = tol + 7.9e-3 * std::abs(ref) + 1e-5 * k_total + (s.two ? 7.9e-3 * std::abs(first[i]) : 0.0);
      if (!(std::abs(got - blas) <= tol_blas) && bad_blas++ == 0)
        first_bad_blas = "row " + std::to_string(r) + " col " + std::to_string(j) + ": got " + std::to_string(got) +
                         ", cuBLAS " + std::to_string(blas);
    }
  }
  EXPECT_EQ(untouched_bad, 0) << "elements outside every group were written";
  EXPECT_EQ(bad, 0) << bad << " elements off the CPU twin; first: " << first_bad;
  EXPECT_EQ(bad_blas, 0) << bad_blas << " elements off cuBLAS; first: " << first_bad_blas;
}

// 48 groups of up to 300 rows, n = 520, k = 392 (n tail of 8 inside a panel, k tail of 8): ~300 tiles of
// 128 columns, several per CTA; the same with 256 columns and with the second product; deep k (32
// k-blocks per part); tiny (n = k = 8: one panel, mostly zeros from TMA's fill); k = 72 with two parts
// (each part's last k-block holds 8 rows, the part boundary inside the tile's reduction); n = 200 (tile
// of 256 reading past n: three panels in, one all past); skew (1000 rows in one of 8 groups); the static
// schedule; the fine-grained and flash-paper backward shapes scaled down in rows; through the twin.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaKernelsOwnGemmNN,
    testing::Values(NnShape{48, 300, 520, 392, 128, false}, NnShape{48, 300, 520, 392, 256, false},
                    NnShape{48, 300, 520, 392, 256, true}, NnShape{12, 260, 264, 2048, 128, false},
                    NnShape{12, 260, 264, 2048, 256, true}, NnShape{6, 70, 8, 8, 128, false},
                    NnShape{6, 70, 8, 8, 256, true}, NnShape{20, 300, 264, 72, 256, true},
                    NnShape{20, 300, 200, 136, 256, false}, NnShape{8, 1000, 264, 136, 256, true, 0, true},
                    NnShape{8, 1000, 264, 136, 128, false, 0, true}, NnShape{48, 300, 520, 392, 256, false, 1},
                    NnShape{20, 300, 264, 72, 128, true, 1}, NnShape{8, 1000, 264, 136, 256, true, 1, true},
                    NnShape{16, 120, 2048, 768, 256, true}, NnShape{16, 120, 768, 2048, 256, false},
                    NnShape{16, 200, 2048, 256, 0, false, 0, false, true},
                    NnShape{10, 300, 264, 72, 0, true, 0, false, true},
                    NnShape{48, 300, 520, 392, 256, true, 2, false, false, 20000}),
    [](const testing::TestParamInfo<NnShape>& info) {
      const NnShape& s = info.param;
      return "G" + std::to_string(s.groups) + "_rows" + std::to_string(s.max_rows) + "_n" + std::to_string(s.n) +
             "_k" + std::to_string(s.k) + "_bn" + std::to_string(s.block_n) + (s.two ? "_two" : "") +
             (s.schedule == 1 ? "_static" : s.schedule == 2 ? "_dynamic" : "") + (s.skew ? "_skew" : "") +
             (s.twin ? "_twin" : "") + (s.lag_ns != 0 ? "_lagged" : "");
    });

// What the kernel refuses, with the reason in the message: n or k not a multiple of 8, a2 without b2, the
// staged epilogue. (Needs the GPU only for the usable check's device query.)
TEST(CudaKernelsOwnGemmNN, RefusesWhatItCannotRun) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const std::vector<int64_t> offsets{0, 16};
  __nv_bfloat16* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  cuda::GroupedGemmNN g{p, p, p, offsets.data(), 1, 64, 64};
  if (!cuda::sm90_grouped_gemm_nn_usable(g)) {
    cudaFree(p);
    GTEST_SKIP() << "the own grouped GEMM needs an sm_90 GPU and a build for sm_90a";
  }
  cuda::CudaContext ctx;
  auto message = [&](const cuda::GroupedGemmNN& x, const cuda::Sm90Tuning& t) {
    try {
      cuda::sm90_grouped_gemm_nn(ctx, p, x, t);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  cuda::GroupedGemmNN odd_n = g;
  odd_n.n = 60;
  EXPECT_FALSE(cuda::sm90_grouped_gemm_nn_usable(odd_n));
  EXPECT_NE(message(odd_n, {}).find("multiples of 8"), std::string::npos) << message(odd_n, {});
  cuda::GroupedGemmNN odd_k = g;
  odd_k.k = 12;
  EXPECT_FALSE(cuda::sm90_grouped_gemm_nn_usable(odd_k));
  cuda::GroupedGemmNN half = g;
  half.a2 = p;
  EXPECT_FALSE(cuda::sm90_grouped_gemm_nn_usable(half));
  cuda::Sm90Tuning staged;
  staged.epilogue = 1;
  EXPECT_NE(message(g, staged).find("staged"), std::string::npos) << message(g, staged);
  cudaFree(p);
}

}  // namespace
}  // namespace dmoe
