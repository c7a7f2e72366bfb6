// gpu_test_util.hpp — what the GPU tests share: whether a CUDA device is visible (tests skip without one), the
// bf16 tolerance, fresh seeds, and the grouped-GEMM tests' random groups and bf16 data. (The GPU tests build as
// unity units: what two test files both need lives here, not in each file's anonymous namespace.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.hpp"

namespace dmoe::test {

inline bool has_cuda_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error for the tests that follow
    return false;
  }
  return count > 0;
}

// Outputs stored as bf16, ‖gpu − cpu‖ / ‖cpu‖: both sides round to bf16, but a value near a rounding boundary can
// land on different sides, and the GPU stores some intermediates (dh, dpre, attention's p and dS) as bf16 where
// the CPU keeps fp64. The project's bf16 tolerance.
inline constexpr double kTolBf16 = 2e-2;

// A seed from the system's entropy source (each run new; tests print it with their failures).
inline uint64_t fresh_seed() {
  std::random_device device;
  return (uint64_t(device()) << 32) ^ uint64_t(device());
}

// Row offsets of `groups` groups after `before` untouched rows: random sizes in [0, max_rows], and the edge
// cases every grouped-GEMM test wants (group 1 empty, group 2 exactly one 128-row tile, group 3 40 rows: the
// second consumer's 64 rows all lie past it, group 4 one row); skew: every row in the middle group.
inline std::vector<int64_t> grouped_test_offsets(std::mt19937_64& rng, int32_t groups, int64_t max_rows,
                                                 int64_t before, bool skew = false) {
  std::vector<int64_t> offsets(size_t(groups) + 1, before);
  for (int32_t g = 0; g < groups; ++g) {
    int64_t rows = int64_t(rng() % uint64_t(max_rows + 1));
    if (skew) rows = g == groups / 2 ? max_rows : 0;
    else if (g == 1) rows = 0;
    else if (g == 2) rows = 128;
    else if (g == 3) rows = 40;
    else if (g == 4) rows = 1;
    offsets[size_t(g) + 1] = offsets[size_t(g)] + rows;
  }
  return offsets;
}

// `count` bf16 values (their bits) drawn from N(0, 1).
inline std::vector<uint16_t> random_bf16_bits(std::mt19937_64& rng, size_t count) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<uint16_t> v(count);
  for (auto& x : v) x = float_to_bf16(normal(rng)).bits;
  return v;
}

}  // namespace dmoe::test

#define DMOE_SKIP_WITHOUT_GPU()                                             \
  do {                                                                      \
    if (!::dmoe::test::has_cuda_device()) GTEST_SKIP() << "no CUDA device"; \
  } while (0)
