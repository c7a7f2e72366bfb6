// cpu/gemm.cpp — the one CPU matrix product, C = A · B^T, used by the router and the expert FFN; the
// grouped NN product (the twin of the CUDA kernel's NN variant), C = A · B_g per group; and the grouped
// weight gradient (the twin of the CUDA weight-gradient kernels), C_g (+)= A_g^T · B_g per group.
//
// Both operands are row-major with the reduction dimension innermost, so every output element is a dot
// product of two contiguous rows. Each dot product is accumulated in fp64 in index order 0..k-1 and
// rounded to float once; C[i, j] therefore depends only on row i of A and row j of B, never on m, n or
// how the work is split (what lets W simulated ranks reproduce one rank bit for bit).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cpu {

namespace {

// The specification of one element: fp64 dot product in order p = 0..k-1, rounded once.
float dot_rows(const float* a_row, const float* b_row, int64_t k) {
  double acc = 0;
  for (int64_t p = 0; p < k; ++p) acc += double(a_row[p]) * double(b_row[p]);
  return float(acc);
}

}  // namespace

void gemm_nt(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k) {
  // Blocks of 2 rows of A × 4 rows of B: eight independent fp64 sums hide the add latency and every
  // loaded value is used 2 or 4 times. Each sum still runs over p = 0..k-1 in order, so the block
  // computes exactly what dot_rows computes (products of two floats are exact in fp64, so FMA or not
  // makes no difference either).
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) {
    const float* a0 = a + i * k;
    const float* a1 = a0 + k;
    float* c0 = c + i * n;
    float* c1 = c0 + n;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const float* b0 = b + j * k;
      const float* b1 = b0 + k;
      const float* b2 = b1 + k;
      const float* b3 = b2 + k;
      double s00 = 0, s01 = 0, s02 = 0, s03 = 0;  // row i
      double s10 = 0, s11 = 0, s12 = 0, s13 = 0;  // row i + 1
      for (int64_t p = 0; p < k; ++p) {
        const double x0 = a0[p], x1 = a1[p];
        const double y0 = b0[p], y1 = b1[p], y2 = b2[p], y3 = b3[p];
        s00 += x0 * y0;
        s01 += x0 * y1;
        s02 += x0 * y2;
        s03 += x0 * y3;
        s10 += x1 * y0;
        s11 += x1 * y1;
        s12 += x1 * y2;
        s13 += x1 * y3;
      }
      c0[j + 0] = float(s00);
      c0[j + 1] = float(s01);
      c0[j + 2] = float(s02);
      c0[j + 3] = float(s03);
      c1[j + 0] = float(s10);
      c1[j + 1] = float(s11);
      c1[j + 2] = float(s12);
      c1[j + 3] = float(s13);
    }
    for (; j < n; ++j) {
      c0[j] = dot_rows(a0, b + j * k, k);
      c1[j] = dot_rows(a1, b + j * k, k);
    }
  }
  for (; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) c[i * n + j] = dot_rows(a + i * k, b + j * k, k);
}

void grouped_tile_table(const int64_t* row_offsets, int32_t groups, int64_t rows, int32_t n_tiles, int32_t block_m,
                        int64_t* clipped, int32_t* tile_offsets, int32_t* tiles) {
  DMOE_REQUIRE(groups >= 0 && rows >= 0 && n_tiles >= 1 && block_m >= 1,
               "grouped_tile_table: groups = {}, rows = {}, n_tiles = {}, block_m = {}; need groups, rows >= 0 and "
               "n_tiles, block_m >= 1", groups, rows, n_tiles, block_m);
  int64_t prev = 0, tile = 0;
  clipped[0] = 0;
  tile_offsets[0] = 0;
  for (int32_t g = 0; g < groups; ++g) {
    const int64_t end = std::clamp(row_offsets[g + 1], prev, rows);
    tile += (end - prev + block_m - 1) / block_m * n_tiles;
    clipped[g + 1] = end;
    tile_offsets[g + 1] = int32_t(tile);
    prev = end;
  }
  *tiles = int32_t(tile);
}

void grouped_gemm_nn(const float* a, const float* b, const float* a2, const float* b2, float* c,
                     const int64_t* row_offsets, int32_t groups, int64_t n, int64_t k, DType storage) {
  DMOE_REQUIRE(groups >= 0 && n >= 0 && k >= 0, "grouped_gemm_nn: groups = {}, n = {}, k = {}; must be >= 0", groups,
               n, k);
  DMOE_REQUIRE((a2 == nullptr) == (b2 == nullptr), "grouped_gemm_nn: a2 and b2 are both given or both null");
  if (groups > 0) DMOE_REQUIRE(row_offsets[0] >= 0, "grouped_gemm_nn: row_offsets[0] = {}; must be >= 0", row_offsets[0]);
  std::vector<double> acc(static_cast<size_t>(n));
  for (int32_t g = 0; g < groups; ++g) {
    DMOE_REQUIRE(row_offsets[g + 1] >= row_offsets[g], "grouped_gemm_nn: row_offsets[{}] = {} < row_offsets[{}] = {}",
                 g + 1, row_offsets[g + 1], g, row_offsets[g]);
    for (int64_t r = row_offsets[g]; r < row_offsets[g + 1]; ++r) {
      std::fill(acc.begin(), acc.end(), 0.0);
      // Each acc[j] runs over p in order (row p of B_g is contiguous in j): A·B, then A2·B2.
      auto add = [&](const float* am, const float* bm) {
        const float* arow = am + r * k;
        const float* bg = bm + int64_t(g) * k * n;
        for (int64_t p = 0; p < k; ++p) {
          const double x = arow[p];
          const float* brow = bg + p * n;
          for (int64_t j = 0; j < n; ++j) acc[j] += x * double(brow[j]);
        }
      };
      add(a, b);
      if (a2 != nullptr) add(a2, b2);
      float* crow = c + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const float f = float(acc[j]);
        crow[j] = storage == DType::bf16 ? round_to_bf16(f) : f;
      }
    }
  }
}

void grouped_wgrad(const GroupedWgrad& g) {
  DMOE_REQUIRE(g.groups >= 0 && g.m >= 0 && g.n >= 0, "grouped_wgrad: groups = {}, m = {}, n = {}; must be >= 0",
               g.groups, g.m, g.n);
  DMOE_REQUIRE(g.lda >= g.m && g.ldb >= g.n, "grouped_wgrad: lda = {} < m = {} or ldb = {} < n = {}", g.lda, g.m,
               g.ldb, g.n);
  DMOE_REQUIRE(g.c_bf16 == nullptr || !g.accumulate,
               "grouped_wgrad: a bf16 C is stored, not accumulated into (accumulate must be false)");
  if (g.groups == 0) return;
  DMOE_REQUIRE(g.row_offsets[0] >= g.a_first_row && g.row_offsets[0] >= g.b_first_row,
               "grouped_wgrad: the first group starts at row {}, before a's first row {} or b's {}", g.row_offsets[0],
               g.a_first_row, g.b_first_row);
  for (int32_t e = 0; e < g.groups; ++e)
    DMOE_REQUIRE(g.row_offsets[e + 1] >= g.row_offsets[e], "grouped_wgrad: row_offsets[{}] = {} < row_offsets[{}] = {}",
                 e + 1, g.row_offsets[e + 1], e, g.row_offsets[e]);
  std::vector<double> acc(static_cast<size_t>(g.m * g.n));
  for (int32_t e = 0; e < g.groups; ++e) {
    if (g.row_offsets[e + 1] == g.row_offsets[e]) continue;  // no rows: C_e untouched
    std::fill(acc.begin(), acc.end(), 0.0);
    // Row by row, so that each acc[i, j] runs over the rows in order (row r of A and B are contiguous).
    for (int64_t r = g.row_offsets[e]; r < g.row_offsets[e + 1]; ++r) {
      const float* arow = g.a + (r - g.a_first_row) * g.lda;
      const float* brow = g.b + (r - g.b_first_row) * g.ldb;
      for (int64_t i = 0; i < g.m; ++i) {
        const double x = arow[i];
        double* out = acc.data() + i * g.n;
        for (int64_t j = 0; j < g.n; ++j) out[j] += x * double(brow[j]);
      }
    }
    if (g.c_bf16 != nullptr) {
      bfloat16* c = g.c_bf16 + int64_t(e) * g.c_group_stride;
      for (int64_t i = 0; i < g.m * g.n; ++i) c[i] = float_to_bf16(float(acc[i]));
      continue;
    }
    float* c = g.c + int64_t(e) * g.c_group_stride;
    for (int64_t i = 0; i < g.m * g.n; ++i) c[i] = float(g.accumulate ? acc[i] + double(c[i]) : acc[i]);
  }
}

}  // namespace dmoe::cpu
