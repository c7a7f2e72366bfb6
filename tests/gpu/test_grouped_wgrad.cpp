// test_grouped_wgrad.cpp — dmoe's grouped weight-gradient kernels, C_g (+)= A_g^T · B_g: the TMA + wgmma
// one (sm90_grouped_wgrad, cuda/grouped_wgrad_sm90.cu; both ways of accumulating, its strip schedule for
// groups of at most 320 rows beside the tile schedule, and the tile schedule alone), the mma.sync one
// (grouped_wgrad, cuda/grouped_wgrad.cu) and the CUDA twin (cuda::grouped_wgrad(g, ctx): the best of the
// two here) against the CPU twin (cpu::grouped_wgrad, fp64 sums) on the same bf16 inputs; and the sm90
// kernel against the mma.sync one (the same semantics: what is written, what is left alone).
//
// Shapes exercise the kernels' edges: groups without rows, of one row, of 33 rows (a k-block tail of 1
// row for the mma kernel's 32-row and 33 for the sm90 kernel's 64-row k-blocks), of several k-blocks
// (the slot rings wrap), of thousands of rows; many groups (many tiles per CTA: the sm90 kernel's two
// consumers take turns); m and n tails (not multiples of the 128-wide tile, and wholly-outside 64-column
// panels); a first row of A or B that is not row 0 of the offsets (the backward pass's scratch-relative
// dpre); padded rows (lda > m, ldb > n) and padding between the groups' C; accumulation into a C filled
// with values, and plain stores. C of a group without rows, and the padding, must end exactly as it
// began. Skips where the kernel cannot run (no GPU, no sm_90 GPU or build for the sm90 kernel).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "cpu/kernels.hpp"
#include "cuda/common.hpp"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

using test::has_cuda_device;
using test::random_bf16_bits;

struct WgradShape {
  int32_t groups;
  int32_t max_rows;
  int64_t m, n;
  bool accumulate;
  int64_t a_first = 0;  // rows of A before the first group's (A holds rows from a_first on)
  int64_t b_first = 0;  // likewise for B
  int64_t pad = 0;      // lda = m + pad, ldb = n + pad, c_group_stride = m·n + pad
};

enum class Kernel { sm90, sm90_red, sm90_tiles, mma, twin };

const char* kernel_name(Kernel k) {
  switch (k) {
    case Kernel::sm90: return "sm90";
    case Kernel::sm90_red: return "sm90red";
    case Kernel::sm90_tiles: return "sm90tiles";
    case Kernel::mma: return "mma";
    case Kernel::twin: return "twin";
  }
  return "?";
}

// One problem: offsets, inputs (bf16 bits) and C's initial values, on the host.
struct WgradProblem {
  WgradShape s;
  std::vector<int64_t> offsets;
  int64_t a_rows = 0, b_rows = 0;
  std::vector<uint16_t> a, b;
  std::vector<float> c0;

  explicit WgradProblem(const WgradShape& shape, uint64_t seed) : s(shape) {
    std::mt19937_64 rng(seed);
    // Offsets start at 7 (rows before it belong to no group); group 1 empty, group 2 one row, group 3 33
    // rows, the rest random up to max_rows.
    constexpr int64_t kBefore = 7;
    offsets.assign(size_t(s.groups) + 1, kBefore);
    for (int32_t g = 0; g < s.groups; ++g) {
      int64_t rows = int64_t(rng() % uint64_t(s.max_rows + 1));
      if (g == 1) rows = 0;
      if (g == 2) rows = 1;
      if (g == 3) rows = 33;
      offsets[g + 1] = offsets[g] + rows;
    }
    const int64_t end = offsets.back() + 2;  // two rows after the last group, also outside every group
    a_rows = end - s.a_first;
    b_rows = end - s.b_first;
    a = random_bf16_bits(rng, size_t(a_rows * lda()));
    b = random_bf16_bits(rng, size_t(b_rows * ldb()));
    std::normal_distribution<float> normal(0.f, 1.f);
    c0.resize(size_t(s.groups) * stride());
    for (auto& x : c0) x = normal(rng);
  }
  int64_t lda() const { return s.m + s.pad; }
  int64_t ldb() const { return s.n + s.pad; }
  int64_t stride() const { return s.m * s.n + s.pad; }
};

// The descriptor fields both twins share (cuda::GroupedWgrad and cpu::GroupedWgrad), from the problem.
template <typename Descriptor>
void describe(Descriptor& g, const WgradProblem& pr, bool accumulate) {
  g.row_offsets = pr.offsets.data();
  g.groups = pr.s.groups;
  g.m = pr.s.m;
  g.n = pr.s.n;
  g.lda = pr.lda();
  g.ldb = pr.ldb();
  g.a_first_row = pr.s.a_first;
  g.b_first_row = pr.s.b_first;
  g.c_group_stride = pr.stride();
  g.accumulate = accumulate;
}

struct DeviceRun {
  cuda::CudaContext ctx;
  cuda::Workspace workspace;
  std::vector<void*> buffers;
  DeviceRun() {
    ctx.workspace = &workspace;
    EXPECT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
  }
  ~DeviceRun() {
    for (void* d : buffers) cudaFree(d);
    cudaStreamDestroy(ctx.stream);
  }
  void* upload(const void* data, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, bytes), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    buffers.push_back(d);
    return d;
  }
};

// Runs `kernel` on the problem; false (and nothing run) where it cannot run here.
bool run_on_gpu(Kernel kernel, const WgradProblem& pr, std::vector<float>& c, std::string& error) {
  DeviceRun run;
  cuda::GroupedWgrad g;
  g.a = static_cast<const __nv_bfloat16*>(run.upload(pr.a.data(), pr.a.size() * 2));
  g.b = static_cast<const __nv_bfloat16*>(run.upload(pr.b.data(), pr.b.size() * 2));
  g.c = static_cast<float*>(run.upload(pr.c0.data(), pr.c0.size() * sizeof(float)));
  describe(g, pr, pr.s.accumulate);
  const bool sm90 = kernel == Kernel::sm90 || kernel == Kernel::sm90_red || kernel == Kernel::sm90_tiles;
  if (sm90 ? !cuda::sm90_grouped_wgrad_usable(g) : kernel == Kernel::mma ? !cuda::grouped_wgrad_usable(g) : false)
    return false;
  if (kernel == Kernel::twin && !cuda::sm90_grouped_wgrad_usable(g) && !cuda::grouped_wgrad_usable(g)) return false;
  if (sm90) {
    void* scratch = run.workspace.reserve(cuda::sm90_grouped_wgrad_scratch_bytes(g.groups), run.ctx.stream);
    cuda::Sm90WgradTuning t;
    t.accumulate = kernel == Kernel::sm90_red ? 2 : 1;
    t.schedule = kernel == Kernel::sm90_tiles ? 1 : 0;  // sm90, sm90_red: strips for groups of <= 320 rows
    cuda::sm90_grouped_wgrad(run.ctx, scratch, g, t);
  } else if (kernel == Kernel::mma) {
    void* scratch = run.workspace.reserve(cuda::grouped_wgrad_scratch_bytes(g.groups), run.ctx.stream);
    cuda::grouped_wgrad(run.ctx, scratch, g);
  } else {
    cuda::grouped_wgrad(g, run.ctx);
  }
  const cudaError_t status = cudaStreamSynchronize(run.ctx.stream);
  if (status != cudaSuccess) {
    error = cudaGetErrorString(status);
    return true;
  }
  c.resize(pr.c0.size());
  EXPECT_EQ(cudaMemcpy(c.data(), g.c, c.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return true;
}

// The CPU twin on the bf16 values: the reference and, on |A| and |B| without C, the magnitude Σ|a·b| of
// each element's products (for the tolerance).
struct Reference {
  std::vector<float> c, mag;
};
Reference cpu_reference(const WgradProblem& pr) {
  auto to_f32 = [](const std::vector<uint16_t>& v, bool absolute) {
    std::vector<float> f(v.size());
    for (size_t i = 0; i < v.size(); ++i) f[i] = bf16_to_float(bfloat16{v[i]});
    if (absolute)
      for (auto& x : f) x = std::abs(x);
    return f;
  };
  Reference ref;
  ref.c = pr.c0;
  ref.mag.assign(pr.c0.size(), 0.f);
  for (const bool absolute : {false, true}) {
    const std::vector<float> fa = to_f32(pr.a, absolute), fb = to_f32(pr.b, absolute);
    cpu::GroupedWgrad g;
    g.a = fa.data();
    g.b = fb.data();
    g.c = absolute ? ref.mag.data() : ref.c.data();
    describe(g, pr, absolute ? false : pr.s.accumulate);
    cpu::grouped_wgrad(g);
  }
  return ref;
}

// Tolerance of one element of group g: f32 accumulation of the group's R products (each exact in f32: bf16
// · bf16 has 16 significant bits) in some order, plus the add of C's old value: each of the R additions
// errs by at most one f32 ulp of a partial sum (2^-23 relative: tensor cores are not guaranteed to round
// to nearest), every partial sum bounded by Σ|a·b| + |c0|, so |got − exact| ≤ (R + 1)·2^-23·(Σ|a·b| +
// |c0|); the CPU twin is within 2^-24·|exact| of exact. A rigorous bound, so never flaky: typical errors
// are ~√R smaller.
double tolerance(int64_t rows, double mag, double c0) { return (double(rows) + 2) * std::ldexp(1.0, -23) * (mag + std::abs(c0)) + 1e-30; }

// Compares `got` with `want` element by element: groups with rows within `scale` times the tolerance,
// groups without rows and the padding bit for bit against C's initial values.
void expect_matches(const WgradProblem& pr, const std::vector<float>& got, const std::vector<float>& want,
                    const std::vector<float>& mag, double scale, const std::string& what) {
  const WgradShape& s = pr.s;
  int64_t bad = 0, untouched_bad = 0;
  std::string first;
  for (int32_t grp = 0; grp < s.groups; ++grp) {
    const int64_t rows = pr.offsets[grp + 1] - pr.offsets[grp];
    const size_t base = size_t(grp) * pr.stride();
    for (int64_t i = 0; i < pr.stride(); ++i) {
      const size_t at = base + size_t(i);
      if (rows == 0 || i >= s.m * s.n) {
        untouched_bad += got[at] != pr.c0[at];
        continue;
      }
      const double c0 = s.accumulate ? double(pr.c0[at]) : 0.0;
      const double tol = scale * tolerance(rows, mag[at], c0);
      if (!(std::abs(double(got[at]) - double(want[at])) <= tol) && bad++ == 0)
        first = "group " + std::to_string(grp) + " element (" + std::to_string(i / s.n) + ", " +
                std::to_string(i % s.n) + "): got " + std::to_string(got[at]) + ", " + what + " " +
                std::to_string(want[at]) + " (tolerance " + std::to_string(tol) + ")";
    }
  }
  EXPECT_EQ(untouched_bad, 0) << "C of a group without rows, or the padding between groups, changed";
  EXPECT_EQ(bad, 0) << bad << " elements off " << what << "; first: " << first;
}

class CudaKernelsGroupedWgrad : public testing::TestWithParam<std::tuple<WgradShape, Kernel>> {};

TEST_P(CudaKernelsGroupedWgrad, MatchesCpuTwin) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const auto [shape, kernel] = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const WgradProblem pr(shape, seed);
  std::vector<float> c;
  std::string error;
  if (!run_on_gpu(kernel, pr, c, error))
    GTEST_SKIP() << "the " << kernel_name(kernel) << " weight-gradient kernel cannot run here (needs "
                 << (kernel == Kernel::mma ? "an sm_80+ GPU" : "an sm_90 GPU and a build for sm_90a") << ")";
  ASSERT_TRUE(error.empty()) << error;
  const Reference ref = cpu_reference(pr);
  expect_matches(pr, c, ref.c, ref.mag, 1.0, "the CPU twin");
}

// The sm90 kernel and the mma.sync kernel on the same inputs: the same elements written (bit-identical
// elsewhere), the values within both kernels' tolerances of each other.
TEST_P(CudaKernelsGroupedWgrad, Sm90MatchesMmaKernel) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const auto [shape, kernel] = GetParam();
  if (kernel != Kernel::sm90) GTEST_SKIP() << "once per shape (the sm90 parameter)";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const WgradProblem pr(shape, seed);
  std::vector<float> c90, cmma;
  std::string error;
  if (!run_on_gpu(Kernel::sm90, pr, c90, error) || !run_on_gpu(Kernel::mma, pr, cmma, error))
    GTEST_SKIP() << "needs an sm_90 GPU and a build for sm_90a";
  ASSERT_TRUE(error.empty()) << error;
  const Reference ref = cpu_reference(pr);  // only its magnitudes: the tolerance
  expect_matches(pr, c90, cmma, ref.mag, 2.0, "the mma.sync kernel");
}

// The strip schedule (groups of at most 320 rows: A's k-range loaded once per strip of up to 8 tiles) and
// the tile schedule run the same wgmma instructions over the same k-blocks in the same order: every element
// bit-identical, stored and accumulated (load and red).
TEST_P(CudaKernelsGroupedWgrad, Sm90StripScheduleEqualsTileScheduleBitwise) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const auto [shape, kernel] = GetParam();
  if (kernel != Kernel::sm90 && kernel != Kernel::sm90_red) GTEST_SKIP() << "once per shape and way of accumulating";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const WgradProblem pr(shape, seed);
  std::vector<float> strips, tiles;
  std::string error;
  if (!run_on_gpu(kernel, pr, strips, error)) GTEST_SKIP() << "needs an sm_90 GPU and a build for sm_90a";
  ASSERT_TRUE(error.empty()) << error;
  // (sm90_tiles accumulates by loading C; red's one f32 add per element at L2 gives the same bits for these
  // normal-valued sums — an L2 f32 atomic may flush subnormals, which the register add keeps)
  ASSERT_TRUE(run_on_gpu(Kernel::sm90_tiles, pr, tiles, error));
  ASSERT_TRUE(error.empty()) << error;
  int64_t bad = 0;
  size_t first = 0;
  for (size_t i = 0; i < strips.size(); ++i)
    if (std::memcmp(&strips[i], &tiles[i], sizeof(float)) != 0 && bad++ == 0) first = i;
  EXPECT_EQ(bad, 0) << bad << " elements differ; first at " << first << ": " << strips[first] << " vs " << tiles[first];
}

// The bf16 store (c_bf16, the PyTorch module's bf16 expert gradients) on the same inputs as the f32 store: every
// written element is the f32 store's value rounded once to bf16 (the same sums, only the store differs), and a
// group without rows and the padding keep their initial bits. Store shapes only (a bf16 C is never
// accumulated: the kernel refuses, and the mma.sync kernel takes no bf16 C).
TEST_P(CudaKernelsGroupedWgrad, Sm90Bf16StoreIsTheF32StoreRounded) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const auto [shape, kernel] = GetParam();
  if (kernel != Kernel::sm90 || shape.accumulate) GTEST_SKIP() << "once per store shape (the sm90 parameter)";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  const WgradProblem pr(shape, seed);
  std::vector<float> c32;
  std::string error;
  if (!run_on_gpu(Kernel::sm90, pr, c32, error)) GTEST_SKIP() << "needs an sm_90 GPU and a build for sm_90a";
  ASSERT_TRUE(error.empty()) << error;
  DeviceRun run;
  cuda::GroupedWgrad g;
  g.a = static_cast<const __nv_bfloat16*>(run.upload(pr.a.data(), pr.a.size() * 2));
  g.b = static_cast<const __nv_bfloat16*>(run.upload(pr.b.data(), pr.b.size() * 2));
  std::vector<uint16_t> c16(pr.c0.size());
  for (size_t i = 0; i < c16.size(); ++i) c16[i] = float_to_bf16(pr.c0[i]).bits;
  g.c_bf16 = static_cast<__nv_bfloat16*>(run.upload(c16.data(), c16.size() * 2));
  describe(g, pr, false);
  ASSERT_TRUE(cuda::sm90_grouped_wgrad_usable(g));
  g.accumulate = true;
  EXPECT_FALSE(cuda::sm90_grouped_wgrad_usable(g)) << "a bf16 C must not be accumulated into";
  EXPECT_FALSE(cuda::grouped_wgrad_usable(g)) << "the mma.sync kernel stores f32 only";
  g.accumulate = false;
  void* scratch = run.workspace.reserve(cuda::sm90_grouped_wgrad_scratch_bytes(g.groups), run.ctx.stream);
  // Both store paths: 16-byte stores after the quad transpose (the default), and the 4-byte pairs.
  for (const int path : {0, 1}) {
    SCOPED_TRACE(path == 0 ? "16-byte stores" : "4-byte pairs");
    ASSERT_EQ(cudaMemcpy(g.c_bf16, c16.data(), c16.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    cuda::Sm90WgradTuning tuning;
    tuning.bf16_store = path;
    cuda::sm90_grouped_wgrad(run.ctx, scratch, g, tuning);
    ASSERT_EQ(cudaStreamSynchronize(run.ctx.stream), cudaSuccess);
    std::vector<uint16_t> got(c16.size());
    ASSERT_EQ(cudaMemcpy(got.data(), g.c_bf16, got.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
    int64_t bad = 0;
    std::string first;
    for (int32_t grp = 0; grp < shape.groups; ++grp) {
      const bool rows = pr.offsets[grp + 1] > pr.offsets[grp];
      for (int64_t i = 0; i < pr.stride(); ++i) {
        const size_t at = size_t(grp) * pr.stride() + size_t(i);
        const uint16_t want = rows && i < shape.m * shape.n ? float_to_bf16(c32[at]).bits : c16[at];
        if (got[at] != want && bad++ == 0)
          first = "group " + std::to_string(grp) + " element " + std::to_string(i) + ": got bits " +
                  std::to_string(got[at]) + ", want " + std::to_string(want);
      }
    }
    EXPECT_EQ(bad, 0) << bad << " elements differ from the f32 store rounded (or changed outside the groups' C); first: "
                      << first;
  }
}

// Calls with many strips or tiles per CTA (buffer reuse, skipped tiles, the order barrier), GPU only: the strip
// schedule against the tile schedule bit for bit (stored, accumulated by loading C, and by L2 reductions — each
// against the tile schedule doing the same), three runs each, no wait timing out; and the sm90 kernel against the
// mma.sync kernel within both kernels' tolerance (magnitudes Σ|a·b| from the mma.sync kernel on |A|, |B|). The tile
// schedule is checked against the CPU twin above on smaller shapes.
struct StressCase {
  const char* name;
  int32_t groups;
  int32_t rows_lo, rows_hi;  // rows of a group: uniform in [lo, hi], every fifth group the multiple of 64 in it
  int64_t m, n;
};
// flash-paper-like (strips of 8, ~4 per CTA, 4 + 4 k-blocks at S = 4); odd strips of 3 tiles with m's last row
// tile one panel (1088 = 8.5 · 128) and rows around every multiple of 64; 1-tile strips (n = 128: a consumer owns
// nothing in every other strip, and clears A's tail in turn) at 3 k-blocks with 8 B slots; strips of 8 and 2
// (n = 1160) near the 320-row bound; 3-k-block tiles at S = 4 (one 320-row group: 3 + 3 > 4); long groups (385-448
// rows, 7 k-blocks = the tile schedule's 7 slots) on the tile schedule.
const StressCase kStressCases[] = {
    {"flash_paper_like", 64, 232, 280, 1024, 1024}, {"odd_strips_tails", 96, 1, 320, 1088, 384},
    {"one_tile_strips", 160, 129, 192, 1024, 128},  {"near_bound_long_n", 48, 290, 320, 1024, 1160},
    {"three_kblocks_at_s4", 96, 129, 192, 1024, 1024}, {"long_groups_tiles", 48, 385, 448, 1024, 1024},
};

class CudaKernelsGroupedWgradStress : public testing::TestWithParam<StressCase> {};

TEST_P(CudaKernelsGroupedWgradStress, StripsEqualTilesAndMatchTheMmaKernel) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const StressCase& sc = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  std::vector<int64_t> offsets(size_t(sc.groups) + 1, 0);
  for (int32_t g = 0; g < sc.groups; ++g) {
    int64_t rows = sc.rows_lo + int64_t(rng() % uint64_t(sc.rows_hi - sc.rows_lo + 1));
    if (g % 5 == 0 && (rows / 64) * 64 >= sc.rows_lo && rows >= 64) rows = (rows / 64) * 64;
    if (std::string(sc.name) == "three_kblocks_at_s4" && g == 7) rows = 320;  // res_kblocks 5: 4 B slots
    offsets[g + 1] = offsets[g] + rows;
  }
  const int64_t total = offsets.back(), M = sc.m, N = sc.n;
  std::vector<uint16_t> a = random_bf16_bits(rng, size_t(total * M)), b = random_bf16_bits(rng, size_t(total * N));
  DeviceRun run;
  cuda::GroupedWgrad g;
  g.a = static_cast<const __nv_bfloat16*>(run.upload(a.data(), a.size() * 2));
  g.b = static_cast<const __nv_bfloat16*>(run.upload(b.data(), b.size() * 2));
  const std::vector<float> c0(size_t(sc.groups) * M * N, 0.5f);
  g.c = static_cast<float*>(run.upload(c0.data(), c0.size() * sizeof(float)));
  g.row_offsets = offsets.data();
  g.groups = sc.groups;
  g.m = M;
  g.n = N;
  g.lda = M;
  g.ldb = N;
  g.c_group_stride = M * N;
  if (!cuda::sm90_grouped_wgrad_usable(g) || !cuda::grouped_wgrad_usable(g))
    GTEST_SKIP() << "needs an sm_90 GPU and a build for sm_90a";
  void* scratch = run.workspace.reserve(
      std::max(cuda::sm90_grouped_wgrad_scratch_bytes(g.groups), cuda::grouped_wgrad_scratch_bytes(g.groups)),
      run.ctx.stream);
  // kernel: 0 strips (sm90 default), 1 tiles, 2 the mma.sync kernel; accumulate: 0 store, 1 load, 2 red.
  auto result = [&](const cuda::GroupedWgrad& call, int kernel, int accumulate) {
    EXPECT_EQ(cudaMemcpy(call.c, c0.data(), c0.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    cuda::GroupedWgrad h = call;
    h.accumulate = accumulate != 0;
    if (kernel == 2) {
      cuda::grouped_wgrad(run.ctx, scratch, h);
    } else {
      cuda::Sm90WgradTuning t;
      t.schedule = kernel;
      t.accumulate = accumulate == 2 ? 2 : 1;
      cuda::sm90_grouped_wgrad(run.ctx, scratch, h, t);
    }
    const cudaError_t status = cudaStreamSynchronize(run.ctx.stream);
    EXPECT_EQ(status, cudaSuccess) << cudaGetErrorString(status) << " (a trapped wait: the kernel stopped)";
    std::vector<float> c(c0.size());
    EXPECT_EQ(cudaMemcpy(c.data(), call.c, c.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    return c;
  };
  for (const int accumulate : {0, 1, 2}) {
    const std::vector<float> tiles = result(g, 1, accumulate);
    ASSERT_FALSE(HasFailure());
    for (int repeat = 0; repeat < 3; ++repeat) {
      const std::vector<float> strips = result(g, 0, accumulate);
      ASSERT_FALSE(HasFailure());
      EXPECT_EQ(std::memcmp(strips.data(), tiles.data(), tiles.size() * sizeof(float)), 0)
          << "accumulate mode " << accumulate << ", run " << repeat;
    }
  }
  // Against the mma.sync kernel (another summation order): per element (rows + 2) · 2^-23 · (Σ|a·b| + |c0|) for
  // each kernel (the bound of `tolerance` above), Σ|a·b| from the mma.sync kernel on |A| and |B| (its own error is
  // far below the bound's slack).
  for (auto& x : a) x &= 0x7fff;
  for (auto& x : b) x &= 0x7fff;
  cuda::GroupedWgrad abs_call = g;
  abs_call.a = static_cast<const __nv_bfloat16*>(run.upload(a.data(), a.size() * 2));
  abs_call.b = static_cast<const __nv_bfloat16*>(run.upload(b.data(), b.size() * 2));
  std::vector<float> mag = result(abs_call, 2, 0);
  for (const int accumulate : {0, 1}) {
    const std::vector<float> sm90 = result(g, 0, accumulate), mma = result(g, 2, accumulate);
    int64_t bad = 0;
    std::string first;
    for (int32_t grp = 0; grp < sc.groups; ++grp) {
      const int64_t rows = offsets[grp + 1] - offsets[grp];
      for (int64_t i = 0; i < M * N; ++i) {
        const size_t at = size_t(grp) * size_t(M * N) + size_t(i);
        const double tol = 2.0 * tolerance(rows, mag[at], accumulate ? 0.5 : 0.0);
        if (!(std::abs(double(sm90[at]) - double(mma[at])) <= tol) && bad++ == 0)
          first = "group " + std::to_string(grp) + " element " + std::to_string(i) + ": " + std::to_string(sm90[at]) +
                  " vs " + std::to_string(mma[at]);
      }
    }
    EXPECT_EQ(bad, 0) << bad << " elements off the mma.sync kernel's (accumulate " << accumulate << "); first: " << first;
  }
}

INSTANTIATE_TEST_SUITE_P(Calls, CudaKernelsGroupedWgradStress, testing::ValuesIn(kStressCases),
                         [](const testing::TestParamInfo<StressCase>& info) { return std::string(info.param.name); });

// DMOE_WGRAD=auto's choice (cuda/gemm.cpp, from the measured tables there): storing, mma.sync below 0.25 G
// multiply-adds per expert product, the sm90 kernel below 6 G, cuBLAS above; accumulating, mma.sync below 1.5 G and
// cuBLAS above (the sm90 kernel was slower at every measured size; it takes them only where mma.sync cannot run);
// bf16 gradients, the sm90 kernel below 6 G where each expert's output is below 2^24 elements, else cuBLAS.
TEST(CudaKernelsGroupedWgradPolicy, AutoPicksByMeasuredSizeAndMode) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const char* knob = std::getenv("DMOE_WGRAD");
  if (knob != nullptr && *knob != '\0' && std::string(knob) != "auto") GTEST_SKIP() << "DMOE_WGRAD=" << knob;
  DeviceRun run;
  std::vector<int64_t> offsets{0, 256, 512};
  std::vector<uint16_t> zeros(size_t(512) * 256, 0);
  cuda::GroupedWgrad g;
  g.a = static_cast<const __nv_bfloat16*>(run.upload(zeros.data(), zeros.size() * 2));
  g.b = static_cast<const __nv_bfloat16*>(run.upload(zeros.data(), zeros.size() * 2));
  std::vector<float> c(size_t(2) * 256 * 256, 0.f);
  g.c = static_cast<float*>(run.upload(c.data(), c.size() * sizeof(float)));
  g.row_offsets = offsets.data();
  g.groups = 2;
  g.m = g.n = g.lda = g.ldb = 256;
  g.c_group_stride = 256 * 256;
  if (!cuda::sm90_grouped_wgrad_usable(g) || !cuda::grouped_wgrad_usable(g))
    GTEST_SKIP() << "needs an sm_90 GPU and a build for sm_90a";
  using K = cuda::WgradKernel;
  auto pick = [&](double macs, bool accumulate) {
    cuda::GroupedWgrad h = g;
    h.accumulate = accumulate;
    return cuda::pick_wgrad_kernel(macs, {h, h});
  };
  EXPECT_EQ(pick(1.0e8, false), K::mma);
  EXPECT_EQ(pick(1.07e9, false), K::sm90);
  EXPECT_EQ(pick(2.1e9, false), K::sm90);
  EXPECT_EQ(pick(1.6e10, false), K::cublas);
  EXPECT_EQ(pick(1.0e8, true), K::mma);
  EXPECT_EQ(pick(1.07e9, true), K::mma);
  EXPECT_EQ(pick(2.1e9, true), K::cublas);
  EXPECT_EQ(pick(1.6e10, true), K::cublas);
  // bf16 gradients (stored): the sm90 kernel below 6 G where each expert's output has fewer than 2^24 elements (the
  // mma.sync kernel stores f32 only), cuBLAS otherwise (Mixtral's 4096 × 14336 experts: measured slower on sm90).
  std::vector<uint16_t> c16(size_t(2) * 256 * 256, 0);
  cuda::GroupedWgrad b = g;
  b.c = nullptr;
  b.c_bf16 = static_cast<__nv_bfloat16*>(run.upload(c16.data(), c16.size() * 2));
  b.accumulate = false;
  ASSERT_TRUE(cuda::sm90_grouped_wgrad_usable(b));
  EXPECT_EQ(cuda::pick_wgrad_kernel(1.0e8, {b, b}), K::sm90);
  EXPECT_EQ(cuda::pick_wgrad_kernel(2.1e9, {b, b}), K::sm90);
  EXPECT_EQ(cuda::pick_wgrad_kernel(7.5e9, {b, b}), K::cublas);
  cuda::GroupedWgrad wide = b;  // the descriptor only: pick_wgrad_kernel reads the shapes, runs nothing
  wide.m = 14336;
  wide.n = 4096;
  wide.lda = wide.m;
  wide.ldb = wide.n;
  wide.c_group_stride = wide.m * wide.n;
  ASSERT_TRUE(cuda::sm90_grouped_wgrad_usable(wide));
  EXPECT_EQ(cuda::pick_wgrad_kernel(0.94e9, {wide, b}), K::cublas);
  EXPECT_EQ(cuda::pick_wgrad_kernel(0.94e9, {b, b}), K::sm90);
}

std::string shape_name(const WgradShape& s) {
  return "G" + std::to_string(s.groups) + "_r" + std::to_string(s.max_rows) + "_m" + std::to_string(s.m) + "_n" +
         std::to_string(s.n) + (s.accumulate ? "_acc" : "_store") +
         (s.a_first ? "_afirst" + std::to_string(s.a_first) : "") +
         (s.b_first ? "_bfirst" + std::to_string(s.b_first) : "") + (s.pad ? "_pad" + std::to_string(s.pad) : "");
}

// 40 groups of up to 300 rows (several k-blocks: the rings wrap), m = 200 and n = 136 (tails in both tile
// directions; n = 136: the second panel of a last column tile is wholly past n), accumulating and
// storing; A starting at a row other than 0 (but before the offsets' first, 7); a tile-exact case (m = n = 256); a narrow one
// (m = n = 8); many groups (128, up to 96 rows: dozens of tiles per CTA); long reductions (3 groups of
// up to 4000 rows); fine-grained's m = 768 (6 row tiles); B starting after the offsets' first row;
// padded rows and padding between groups' C.
const WgradShape kShapes[] = {
    {40, 300, 200, 136, true},         {40, 300, 200, 136, false},       {12, 700, 136, 200, true, 5},
    {6, 150, 256, 256, true},          {5, 64, 8, 8, true},              {128, 96, 136, 264, false},
    {128, 96, 136, 264, true},         {3, 4000, 256, 128, true},        {3, 4000, 256, 128, false, 6},
    {16, 300, 768, 136, false},        {10, 200, 264, 128, true, 3, 6},  {20, 200, 200, 136, true, 0, 0, 16},
    {20, 200, 200, 136, false, 2, 0, 8},
    // more than 8 column tiles (strips of 8 and a shorter last one), groups around the strip schedule's
    // 320-row bound (some take the tile schedule in a second launch)
    {8, 400, 136, 1160, false},        {8, 400, 200, 1160, true},
    // a last column tile of 56 columns (7 of the bf16 store's 8-column blocks: a partial quad after the first)
    {20, 200, 200, 184, false},
};

INSTANTIATE_TEST_SUITE_P(Shapes, CudaKernelsGroupedWgrad,
                         testing::Combine(testing::ValuesIn(kShapes),
                                          testing::Values(Kernel::sm90, Kernel::sm90_red, Kernel::sm90_tiles, Kernel::mma, Kernel::twin)),
                         [](const testing::TestParamInfo<std::tuple<WgradShape, Kernel>>& info) {
                           return shape_name(std::get<0>(info.param)) + "_" + kernel_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace dmoe
