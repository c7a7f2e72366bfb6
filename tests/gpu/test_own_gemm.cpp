// test_own_gemm.cpp — dmoe's own Hopper grouped GEMM (cuda/grouped_gemm_sm90.cu) against a host fp64
// reference on the same bf16 inputs.
//
// The shapes are chosen to exercise what the expert FFN tests (a few tiles, one per CTA) do not: many
// tiles per CTA so the TMA/wgmma slot ring wraps its phases several times, groups without rows, a group
// of exactly one tile, ragged row, K and N tails, rows before the first and after the last group that
// must stay untouched. Skips where no sm_90 GPU is present or the build lacks sm_90a.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/config.hpp"
#include "core/dtype.hpp"
#include "cpu/kernels.hpp"
#include "cuda/common.hpp"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

using test::grouped_test_offsets;
using test::has_cuda_device;
using test::random_bf16_bits;

struct OwnGemmShape {
  int32_t groups;
  int64_t max_rows, n, k;
  int block_n;
  int epilogue;  // 0: C only; 1 relu, 2 gelu, 3 swiglu: fused activation (h, and C2 for SwiGLU)
  int store = 1;  // 1: staged in shared memory + bulk stores, 2: direct stores from registers
  int schedule = 0;  // 0 default (dynamic), 1 static, 2 dynamic (tiles after the first wave from a global counter)
  uint32_t lag_ns = 0;  // Sm90Tuning::skip_lag_ns: warps 1-3 of a skipping consumer late at every slot
};

constexpr const char* kEpilogueNames[] = {"plain", "relu", "gelu", "swiglu"};

double activation_of(int epilogue, double x) {
  switch (epilogue) {
    case 1: return x > 0 ? x : 0;
    case 2: return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    default: return x / (1 + std::exp(-x));
  }
}

class CudaKernelsOwnGemm : public testing::TestWithParam<OwnGemmShape> {};

TEST_P(CudaKernelsOwnGemm, MatchesHostReference) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const OwnGemmShape s = GetParam();
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);

  // Rows: 5 untouched rows, the groups (group 1 empty, group 2 exactly 128 rows), 3 untouched rows.
  constexpr int64_t kBefore = 5, kAfter = 3;
  const std::vector<int64_t> offsets = grouped_test_offsets(rng, s.groups, s.max_rows, kBefore);
  const int64_t rows_total = offsets.back() + kAfter;
  auto random_bf16 = [&](size_t count) { return random_bf16_bits(rng, count); };
  const std::vector<uint16_t> a = random_bf16(size_t(rows_total * s.k));
  const bool fused = s.epilogue != 0, gated = s.epilogue == 3;
  const std::vector<uint16_t> b = random_bf16(size_t(s.groups) * s.n * s.k);
  const std::vector<uint16_t> b2 = random_bf16(gated ? size_t(s.groups) * s.n * s.k : 0);
  constexpr uint16_t kSentinel = 0x7fc1;  // a NaN no product produces
  std::vector<uint16_t> c(size_t(rows_total * s.n), kSentinel), c2 = c, h = c;

  cuda::CudaContext ctx;
  cuda::Workspace workspace;
  ctx.workspace = &workspace;
  ASSERT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
  std::vector<void*> buffers;
  auto upload = [&](const std::vector<uint16_t>& v) -> void* {
    void* d = nullptr;
    if (v.empty()) return d;
    EXPECT_EQ(cudaMalloc(&d, v.size() * 2), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(d, v.data(), v.size() * 2, cudaMemcpyHostToDevice), cudaSuccess);
    buffers.push_back(d);
    return d;
  };
  auto download = [&](void* d, std::vector<uint16_t>& v) {
    ASSERT_EQ(cudaMemcpy(v.data(), d, v.size() * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  };
  auto release = [&] {
    for (void* d : buffers) cudaFree(d);
    cudaStreamDestroy(ctx.stream);
  };
  void *d_a = upload(a), *d_b = upload(b), *d_b2 = upload(b2), *d_c = upload(c);
  void *d_c2 = gated ? upload(c2) : nullptr, *d_h = fused ? upload(h) : nullptr;

  cuda::GroupedGemmNT g;
  g.a = static_cast<const __nv_bfloat16*>(d_a);
  g.b = static_cast<const __nv_bfloat16*>(d_b);
  g.c = static_cast<__nv_bfloat16*>(d_c);
  g.row_offsets = offsets.data();
  g.groups = s.groups;
  g.n = s.n;
  g.k = s.k;
  if (fused) {
    g.h = static_cast<__nv_bfloat16*>(d_h);
    g.activation = s.epilogue == 1 ? Activation::relu : s.epilogue == 2 ? Activation::gelu : Activation::swiglu;
    g.b2 = static_cast<const __nv_bfloat16*>(d_b2);
    g.c2 = static_cast<__nv_bfloat16*>(d_c2);
  }
  if (!cuda::sm90_grouped_gemm_usable(g)) {
    release();
    GTEST_SKIP() << "the own grouped GEMM needs an sm_90 GPU and a build for sm_90a";
  }
  void* scratch = workspace.reserve(cuda::sm90_grouped_gemm_scratch_bytes(s.groups), ctx.stream);
  cuda::Sm90Tuning tuning;
  tuning.block_n = s.block_n;
  tuning.epilogue = s.store;
  tuning.schedule = s.schedule;
  tuning.skip_lag_ns = s.lag_ns;
  cuda::sm90_grouped_gemm(ctx, scratch, g, tuning);
  const cudaError_t status = cudaStreamSynchronize(ctx.stream);
  if (status != cudaSuccess) release();
  ASSERT_EQ(status, cudaSuccess) << cudaGetErrorString(status);
  download(d_c, c);
  if (gated) download(d_c2, c2);
  if (fused) download(d_h, h);
  // A fused call that keeps no pre-activations (inference: c and c2 null) writes the same h, bit for bit.
  std::vector<uint16_t> h_only(h.size(), kSentinel);
  if (fused) {
    void* d_h_only = upload(h_only);
    cuda::GroupedGemmNT g_inf = g;
    g_inf.c = nullptr;
    g_inf.c2 = nullptr;
    g_inf.h = static_cast<__nv_bfloat16*>(d_h_only);
    EXPECT_TRUE(cuda::sm90_grouped_gemm_usable(g_inf));
    cuda::sm90_grouped_gemm(ctx, scratch, g_inf, tuning);
    const cudaError_t st = cudaStreamSynchronize(ctx.stream);
    if (st != cudaSuccess) release();
    ASSERT_EQ(st, cudaSuccess) << cudaGetErrorString(st);
    download(d_h_only, h_only);
  }
  release();
  if (fused) EXPECT_TRUE(h_only == h) << "h differs when the pre-activations are not kept";

  auto value = [](uint16_t bits) { return double(bf16_to_float(bfloat16{bits})); };
  int64_t bad = 0, untouched_bad = 0;
  std::string first;
  auto check = [&](const char* what, int64_t r, int32_t group, int64_t j, double got, double ref, double tol) {
    if (std::abs(got - ref) <= tol) return;
    if (bad++ == 0)
      first = std::string(what) + " row " + std::to_string(r) + " (group " + std::to_string(group) + ") col " +
              std::to_string(j) + ": got " + std::to_string(got) + ", expected " + std::to_string(ref);
  };
  std::vector<double> arow(s.k);
  for (int64_t r = 0; r < rows_total; ++r) {
    int32_t group = -1;
    for (int32_t e = 0; e < s.groups; ++e)
      if (r >= offsets[e] && r < offsets[e + 1]) group = e;
    if (group < 0) {
      for (int64_t j = 0; j < s.n; ++j)
        untouched_bad += (c[r * s.n + j] != kSentinel) + (h[r * s.n + j] != kSentinel) + (c2[r * s.n + j] != kSentinel);
      continue;
    }
    for (int64_t q = 0; q < s.k; ++q) arow[q] = value(a[r * s.k + q]);
    for (int64_t j = 0; j < s.n; ++j) {
      // bf16 output rounding (2^-9 relative) plus fp32 accumulation over k terms of size ~1.
      auto dot = [&](const std::vector<uint16_t>& w) {
        const uint16_t* wrow = w.data() + (int64_t(group) * s.n + j) * s.k;
        double sum = 0;
        for (int64_t q = 0; q < s.k; ++q) sum += arow[q] * value(wrow[q]);
        return sum;
      };
      const double ref = dot(b), got = value(c[r * s.n + j]);
      check("C", r, group, j, got, ref, 4e-3 * std::abs(ref) + 1e-5 * double(s.k));
      if (!fused) continue;
      // h from the kernel's own (already checked) rounded pre-activations: this isolates the epilogue.
      double expected = activation_of(s.epilogue, got);
      if (gated) {
        const double ref2 = dot(b2), got2 = value(c2[r * s.n + j]);
        check("C2", r, group, j, got2, ref2, 4e-3 * std::abs(ref2) + 1e-5 * double(s.k));
        expected *= got2;
      }
      check("h", r, group, j, value(h[r * s.n + j]), expected, 4e-3 * std::abs(expected) + 1e-6);
    }
  }
  EXPECT_EQ(untouched_bad, 0) << "elements outside every group were written";
  EXPECT_EQ(bad, 0) << bad << " elements off; first: " << first;
}

// 48 groups of up to 300 rows, n = 520 and k = 392 (tails in both): ~300 tiles of 128 columns, several per
// CTA, 7 k-blocks each; the same with 256-column tiles; a deep-k case (k = 2048, 32 k-blocks per tile);
// a tiny one; the fused activations (SwiGLU: half-width output tiles of gate and up columns); both ways
// of storing tiles (all with the default, dynamic tile schedule); the static schedule on the same shapes;
// ~1200 fused SwiGLU tiles of 256 columns whose groups mix last tiles of <= 64 rows (second consumer
// skips) and longer ones, with both schedules — the case that hung the first dynamic kernel on the H200
// (fine-grained, decode at T = 1024, mixtral at T = 512; a stack frame from register pressure).
// Lagged: the same mixes with warps 1-3 of every skipping consumer 20 µs late at each slot, k-blocks over
// the 4 slots of 256-column tiles: before the skip path held its warps together (a named barrier before
// thread 0's arrival), thread 0 ran two fills ahead of them and the next tile hung (the wait report of
// docs/faults.md, seen once in a benchmark on the H200, reproduced here on every run).
INSTANTIATE_TEST_SUITE_P(Shapes, CudaKernelsOwnGemm,
                         testing::Values(OwnGemmShape{48, 300, 520, 392, 128, 0},
                                         OwnGemmShape{48, 300, 520, 392, 256, 0},
                                         OwnGemmShape{12, 260, 264, 2048, 128, 0},
                                         OwnGemmShape{3, 70, 8, 8, 128, 0},
                                         OwnGemmShape{20, 300, 264, 136, 256, 1},
                                         OwnGemmShape{20, 300, 264, 136, 128, 2},
                                         OwnGemmShape{20, 300, 264, 136, 256, 3},
                                         OwnGemmShape{20, 300, 200, 72, 128, 3},
                                         OwnGemmShape{48, 300, 520, 392, 256, 0, 2},
                                         OwnGemmShape{12, 260, 264, 2048, 128, 0, 2},
                                         OwnGemmShape{3, 70, 8, 8, 128, 0, 2},
                                         OwnGemmShape{20, 300, 264, 136, 256, 1, 2},
                                         OwnGemmShape{20, 300, 264, 136, 128, 2, 2},
                                         OwnGemmShape{20, 300, 264, 136, 128, 3, 2},
                                         OwnGemmShape{20, 300, 264, 136, 256, 3, 2},
                                         OwnGemmShape{20, 300, 264, 40, 256, 3, 2},
                                         OwnGemmShape{48, 300, 520, 392, 256, 0, 2, 1},
                                         OwnGemmShape{12, 260, 264, 2048, 128, 0, 2, 1},
                                         OwnGemmShape{3, 70, 8, 8, 128, 0, 2, 1},
                                         OwnGemmShape{20, 300, 264, 136, 256, 1, 2, 1},
                                         OwnGemmShape{20, 300, 264, 136, 128, 2, 2, 1},
                                         OwnGemmShape{20, 300, 264, 136, 256, 3, 2, 1},
                                         OwnGemmShape{128, 200, 776, 72, 256, 3, 2, 2},
                                         OwnGemmShape{128, 200, 776, 72, 256, 3, 2, 1},
                                         OwnGemmShape{48, 300, 520, 392, 256, 0, 2, 2, 20000},
                                         OwnGemmShape{48, 300, 520, 392, 256, 0, 2, 1, 20000},
                                         OwnGemmShape{20, 300, 264, 1024, 256, 3, 2, 2, 20000},
                                         OwnGemmShape{20, 300, 264, 1024, 128, 1, 1, 0, 20000}),
                         [](const testing::TestParamInfo<OwnGemmShape>& info) {
                           const OwnGemmShape& s = info.param;
                           return "G" + std::to_string(s.groups) + "_n" + std::to_string(s.n) + "_k" +
                                  std::to_string(s.k) + "_bn" + std::to_string(s.block_n) + "_" +
                                  kEpilogueNames[s.epilogue] + (s.store == 2 ? "_direct" : "_staged") +
                                  (s.schedule == 2 ? "_dynamic" : s.schedule == 1 ? "_static" : "") +
                                  (s.lag_ns != 0 ? "_lagged" : "");
                         });

// Offsets in device memory (GroupedGemmNT::offsets_on_device: the deferred train forward's, no host read of the
// counts) give the host-offset call's outputs bit for bit: the same tiles, each one CTA's products in the same
// k order, only where the table is built differs. Then the device tile table against its CPU twin, on valid
// offsets and on wrong ones (decreasing, past the rows), which it clips.
TEST(CudaKernelsOwnGemmDeviceOffsets, EqualHostOffsetsAndTheTileTableTwin) {
  if (!has_cuda_device()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  for (const int epilogue : {0, 3}) {  // plain C; fused SwiGLU (h and C2)
    const int32_t groups = 20;
    const int64_t n = 264, k = 136;
    const std::vector<int64_t> offsets = grouped_test_offsets(rng, groups, 300, 0);
    const int64_t rows = offsets.back();
    const bool gated = epilogue == 3;
    const std::vector<uint16_t> a = random_bf16_bits(rng, size_t(rows * k));
    const std::vector<uint16_t> b = random_bf16_bits(rng, size_t(groups) * n * k);
    const std::vector<uint16_t> b2 = random_bf16_bits(rng, gated ? size_t(groups) * n * k : 0);
    cuda::CudaContext ctx;
    cuda::Workspace workspace;
    ctx.workspace = &workspace;
    ASSERT_EQ(cudaStreamCreate(&ctx.stream), cudaSuccess);
    std::vector<void*> buffers;
    auto device = [&](size_t bytes, const void* from) -> void* {
      void* d = nullptr;
      EXPECT_EQ(cudaMalloc(&d, bytes ? bytes : 16), cudaSuccess);
      if (from) EXPECT_EQ(cudaMemcpy(d, from, bytes, cudaMemcpyHostToDevice), cudaSuccess);
      else EXPECT_EQ(cudaMemset(d, 0, bytes), cudaSuccess);
      buffers.push_back(d);
      return d;
    };
    const size_t out_bytes = size_t(rows * n) * 2;
    void *d_a = device(a.size() * 2, a.data()), *d_b = device(b.size() * 2, b.data());
    void* d_b2 = gated ? device(b2.size() * 2, b2.data()) : nullptr;
    void* d_offsets = device(offsets.size() * 8, offsets.data());
    std::vector<void*> out[2];
    for (auto& o : out) o = {device(out_bytes, nullptr), gated ? device(out_bytes, nullptr) : nullptr,
                             gated ? device(out_bytes, nullptr) : nullptr};
    auto call = [&](int which) {
      cuda::GroupedGemmNT g;
      g.a = static_cast<const __nv_bfloat16*>(d_a);
      g.b = static_cast<const __nv_bfloat16*>(d_b);
      g.c = static_cast<__nv_bfloat16*>(out[which][0]);
      g.groups = groups;
      g.n = n;
      g.k = k;
      if (gated) {
        g.h = static_cast<__nv_bfloat16*>(out[which][2]);
        g.activation = Activation::swiglu;
        g.b2 = static_cast<const __nv_bfloat16*>(d_b2);
        g.c2 = static_cast<__nv_bfloat16*>(out[which][1]);
      }
      g.row_offsets = which == 0 ? offsets.data() : static_cast<const int64_t*>(d_offsets);
      g.offsets_on_device = which == 1;
      g.rows = rows;
      return g;
    };
    if (!cuda::sm90_grouped_gemm_usable(call(0))) {
      for (void* d : buffers) cudaFree(d);
      cudaStreamDestroy(ctx.stream);
      GTEST_SKIP() << "the own grouped GEMM needs an sm_90 GPU and a build for sm_90a";
    }
    EXPECT_TRUE(cuda::sm90_grouped_gemm_usable(call(1)));
    void* scratch = workspace.reserve(cuda::sm90_grouped_gemm_scratch_bytes(groups), ctx.stream);
    cuda::sm90_grouped_gemm(ctx, scratch, call(0));
    cuda::sm90_grouped_gemm(ctx, scratch, call(1));
    ASSERT_EQ(cudaStreamSynchronize(ctx.stream), cudaSuccess);
    for (int i = 0; i < (gated ? 3 : 1); ++i) {
      std::vector<uint16_t> host_offsets(size_t(rows * n)), device_offsets(host_offsets.size());
      ASSERT_EQ(cudaMemcpy(host_offsets.data(), out[0][i], out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(device_offsets.data(), out[1][i], out_bytes, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_TRUE(host_offsets == device_offsets) << "output " << i << " (C, C2, h) differs, epilogue " << epilogue;
    }

    // The tile table: valid offsets, then wrong ones.
    const std::vector<int64_t> wrong = {7, 500, 100, 100000, 3};
    for (const auto* table : {&offsets, &wrong}) {
      const int32_t g = int32_t(table->size()) - 1;
      const int64_t bound_rows = table == &offsets ? rows : 600;
      void* d_in = device(table->size() * 8, table->data());
      void* d_clipped = device(table->size() * 8, nullptr);
      void* d_tiles_at = device(table->size() * 4, nullptr);
      void* d_tiles = device(4, nullptr);
      cuda::grouped_tile_table(static_cast<const int64_t*>(d_in), g, bound_rows, 3, 128,
                               static_cast<int64_t*>(d_clipped), static_cast<int32_t*>(d_tiles_at),
                               static_cast<int32_t*>(d_tiles), ctx.stream);
      ASSERT_EQ(cudaStreamSynchronize(ctx.stream), cudaSuccess);
      std::vector<int64_t> clipped(table->size()), want_clipped(table->size());
      std::vector<int32_t> tiles_at(table->size()), want_tiles_at(table->size());
      int32_t tiles = -1, want_tiles = -2;
      ASSERT_EQ(cudaMemcpy(clipped.data(), d_clipped, clipped.size() * 8, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(tiles_at.data(), d_tiles_at, tiles_at.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&tiles, d_tiles, 4, cudaMemcpyDeviceToHost), cudaSuccess);
      cpu::grouped_tile_table(table->data(), g, bound_rows, 3, 128, want_clipped.data(), want_tiles_at.data(),
                              &want_tiles);
      EXPECT_EQ(clipped, want_clipped);
      EXPECT_EQ(tiles_at, want_tiles_at);
      EXPECT_EQ(tiles, want_tiles);
    }
    for (void* d : buffers) cudaFree(d);
    cudaStreamDestroy(ctx.stream);
  }
}

}  // namespace
}  // namespace dmoe
