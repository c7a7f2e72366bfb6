// test_grouped_wgrad.cpp — dmoe's grouped weight-gradient kernel (cuda/grouped_wgrad.cu) against a host
// fp64 reference on the same bf16 inputs.
//
// Shapes exercise the kernel's edges: groups without rows, of one row, of a row count that is not a
// multiple of the 32-row k-block, of several k-blocks (the 4-slot copy ring wraps); m and n tails (not
// multiples of the 128-wide tile); a first row of A that is not row 0 of the offsets (the backward pass's
// scratch-relative dpre); accumulation into a C filled with values, and plain stores. C of every other
// group must end exactly as it began where its group has no rows. Skips where no sm_80+ GPU is present.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "cuda/common.hpp"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

using test::has_cuda_device;

struct WgradShape {
  int32_t groups;
  int32_t max_rows;
  int64_t m, n;
  bool accumulate;
  int64_t a_first = 0;  // rows of A before the first group's (A holds rows from a_first on)
};

class CudaKernelsGroupedWgrad : public testing::TestWithParam<WgradShape> {};

TEST_P(CudaKernelsGroupedWgrad, MatchesHostReference) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const WgradShape s = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);

  // Row offsets start at 7 (rows 0-6 of B belong to no group); group 1 empty, group 2 one row, group 3
  // 33 rows (one full k-block and one row), the rest random up to max_rows.
  constexpr int64_t kBefore = 7;
  std::vector<int64_t> offsets(s.groups + 1, kBefore);
  for (int32_t g = 0; g < s.groups; ++g) {
    int64_t rows = int64_t(rng() % uint64_t(s.max_rows + 1));
    if (g == 1) rows = 0;
    if (g == 2) rows = 1;
    if (g == 3) rows = 33;
    offsets[g + 1] = offsets[g] + rows;
  }
  const int64_t b_rows = offsets.back() + 2;  // two rows after the last group, also outside every group
  const int64_t a_rows = b_rows - s.a_first;

  std::normal_distribution<float> normal(0.f, 1.f);
  auto random_bf16 = [&](size_t count) {
    std::vector<uint16_t> v(count);
    for (auto& x : v) x = float_to_bf16(normal(rng)).bits;
    return v;
  };
  const std::vector<uint16_t> a = random_bf16(size_t(a_rows * s.m));
  const std::vector<uint16_t> b = random_bf16(size_t(b_rows * s.n));
  std::vector<float> c0(size_t(s.groups) * s.m * s.n);
  for (auto& x : c0) x = normal(rng);
  std::vector<float> c = c0;

  cuda::CudaContext ctx;
  cuda::Workspace workspace;
  ctx.workspace = &workspace;
  ASSERT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
  std::vector<void*> buffers;
  auto upload = [&](const void* data, size_t bytes) -> void* {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    buffers.push_back(d);
    return d;
  };
  auto release = [&] {
    for (void* d : buffers) cudaFree(d);
    cudaStreamDestroy(ctx.stream);
  };
  void* d_a = upload(a.data(), a.size() * 2);
  void* d_b = upload(b.data(), b.size() * 2);
  void* d_c = upload(c.data(), c.size() * sizeof(float));

  cuda::GroupedWgrad g;
  g.a = static_cast<const __nv_bfloat16*>(d_a);
  g.b = static_cast<const __nv_bfloat16*>(d_b);
  g.c = static_cast<float*>(d_c);
  g.row_offsets = offsets.data();
  g.groups = s.groups;
  g.m = s.m;
  g.n = s.n;
  g.lda = s.m;
  g.ldb = s.n;
  g.a_first_row = s.a_first;
  g.b_first_row = 0;
  g.c_group_stride = s.m * s.n;
  g.accumulate = s.accumulate;
  if (!cuda::grouped_wgrad_usable(g)) {
    release();
    GTEST_SKIP() << "the grouped weight-gradient kernel needs an sm_80+ GPU and a build for it";
  }
  void* scratch = workspace.reserve(cuda::grouped_wgrad_scratch_bytes(s.groups), ctx.stream);
  cuda::grouped_wgrad(ctx, scratch, g);
  const cudaError_t status = cudaStreamSynchronize(ctx.stream);
  if (status != cudaSuccess) release();
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
  ASSERT_EQ(cudaMemcpy(c.data(), d_c, c.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  release();

  auto value = [](uint16_t bits) { return double(bf16_to_float(bfloat16{bits})); };
  int64_t bad = 0, untouched_bad = 0;
  std::string first;
  std::vector<double> ref(size_t(s.m * s.n)), mag(size_t(s.m * s.n));
  for (int32_t grp = 0; grp < s.groups; ++grp) {
    const int64_t r0 = offsets[grp], rows = offsets[grp + 1] - r0;
    const float* cg = c.data() + size_t(grp) * s.m * s.n;
    const float* c0g = c0.data() + size_t(grp) * s.m * s.n;
    if (rows == 0) {
      for (int64_t i = 0; i < s.m * s.n; ++i) untouched_bad += cg[i] != c0g[i];
      continue;
    }
    std::fill(ref.begin(), ref.end(), 0.0);
    std::fill(mag.begin(), mag.end(), 0.0);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      const uint16_t* arow = a.data() + (r - s.a_first) * s.m;
      const uint16_t* brow = b.data() + r * s.n;
      for (int64_t i = 0; i < s.m; ++i) {
        const double ai = value(arow[i]);
        for (int64_t j = 0; j < s.n; ++j) {
          const double p = ai * value(brow[j]);
          ref[i * s.n + j] += p;
          mag[i * s.n + j] += std::abs(p);
        }
      }
    }
    for (int64_t i = 0; i < s.m * s.n; ++i) {
      const double expected = ref[i] + (s.accumulate ? double(c0g[i]) : 0.0);
      // f32 accumulation over at most max_rows products, then one f32 add: a few f32 ulps of the magnitude.
      const double tol = 1e-5 * (mag[i] + std::abs(double(c0g[i]))) + 1e-6;
      if (std::abs(double(cg[i]) - expected) > tol) {
        if (bad++ == 0)
          first = "group " + std::to_string(grp) + " element (" + std::to_string(i / s.n) + ", " +
                  std::to_string(i % s.n) + "): got " + std::to_string(cg[i]) + ", expected " +
                  std::to_string(expected);
      }
    }
  }
  EXPECT_EQ(untouched_bad, 0) << "C of a group without rows changed";
  EXPECT_EQ(bad, 0) << bad << " elements off; first: " << first;
}

// 40 groups of up to 300 rows (several k-blocks: the copy ring wraps), m = 200 and n = 136 (tails in both
// tile directions), accumulating and storing; A starting at a row after the offsets' first; a tile-exact
// case (m = n = 256); a narrow one (m = n = 8).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaKernelsGroupedWgrad,
                         testing::Values(WgradShape{40, 300, 200, 136, true}, WgradShape{40, 300, 200, 136, false},
                                         WgradShape{12, 700, 136, 200, true, 5}, WgradShape{6, 150, 256, 256, true},
                                         WgradShape{5, 64, 8, 8, true}),
                         [](const testing::TestParamInfo<WgradShape>& info) {
                           const WgradShape& s = info.param;
                           return "G" + std::to_string(s.groups) + "_m" + std::to_string(s.m) + "_n" +
                                  std::to_string(s.n) + (s.accumulate ? "_acc" : "_store") +
                                  (s.a_first ? "_afirst" + std::to_string(s.a_first) : "");
                         });

}  // namespace
}  // namespace dmoe
