// cpu/gemm.cpp — the one CPU matrix product, C = A · B^T, used by the router and the expert FFN.
//
// Both operands are row-major with the reduction dimension innermost, so every output element is a dot
// product of two contiguous rows. Each dot product is accumulated in fp64 in index order 0..k-1 and
// rounded to float once; C[i, j] therefore depends only on row i of A and row j of B, never on m, n or
// how the work is split (what lets W simulated ranks reproduce one rank bit for bit).
#include <cstdint>

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

}  // namespace dmoe::cpu
