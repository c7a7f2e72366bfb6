// cuda/sm90_layout.hpp — the layout arithmetic of the Hopper tile engine: wgmma shared-memory matrix
// descriptors, where a slot's operand tiles and their k-steps start, and the parameters (dimensions,
// strides, box, swizzle) the kernels' TMA tensor maps are encoded from. Plain C++ without CUDA headers, so
// that a host unit test (tests/unit/test_sm90_layout.cpp, runs in CI without a GPU) checks every number the
// kernels use; the device code (sm90_primitives.cuh, grouped_gemm_sm90.cu) calls these same functions.
//
// The two operand layouts, both bf16, both written by TMA with a 128-byte swizzle into 1024-byte aligned
// slots (the swizzle is a function of the shared-memory address: 16-byte chunk bits [4,7) are XORed with
// bits [7,10); TMA applies it when writing and wgmma when reading, so the two agree when both start from
// the same unswizzled address of every element):
//
//   K-major (A always; B of the NT product, C = A·Bᵀ): a tile of R rows × 64 k-columns, one 128-byte row
//   per matrix row. Canonical wgmma layout (PTX ISA, "Shared Memory Matrix Layout", K-major, 128-byte
//   swizzle): 8-row × 128-byte atoms of 1024 bytes; the stride byte offset (SBO) is the distance between
//   atoms along M/N (8 rows · 128 B = 1024); the leading byte offset is unused (set to 1). A k16 step is a
//   plain start-address offset of 32 bytes inside the row (the swizzle is applied on the final address).
//
//   MN-major (B of the NN product, C = A·B with B row-major [K, N]): TMA loads boxes of 64 n-columns
//   (128 bytes) × 64 k-rows, one per "panel" of 8192 bytes, BN/64 panels side by side. Inside a panel, k-row
//   r sits at r·128 bytes and column c at 2c in it. Canonical wgmma layout for MN-major, 128-byte swizzle
//   (in 16-byte units: ((8, n), (8, k)) : ((1, LBO), (8, SBO))): 64 MN-elements contiguous, 8 k-rows 128
//   bytes apart form a 1024-byte atom; the leading byte offset (LBO) is the distance between atoms along
//   MN (the next 64 columns: the next panel, 8192 bytes), the stride byte offset (SBO) the distance between
//   atoms along K (the next 8 k-rows: 1024 bytes). So for MN-major the two offsets swap roles against the
//   K-major case, and both are used. A k16 step covers two k-atoms: its start moves by 16 rows · 128 B =
//   2048 bytes, which stays 1024-aligned (base offset 0). The instruction reads B as MN-major only with
//   its transpose-B immediate set to 1 (bf16 allows it from shared memory).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DMOE_SM90_HD __host__ __device__
#else
#define DMOE_SM90_HD
#endif

namespace dmoe::cuda::sm90 {

// Descriptor layout types (bits [62, 64)).
constexpr uint32_t kLayoutSwizzle128 = 1;
constexpr uint32_t kLayoutSwizzle64 = 2;

// Shared-memory matrix descriptor (PTX ISA, wgmma "Matrix Descriptor Format"):
//   bits [0, 14)  start address >> 4     bits [16, 30) leading byte offset >> 4
//   bits [32, 46) stride byte offset >> 4  bits [49, 52) base offset (0: atoms are 1024-byte aligned)
//   bits [62, 64) layout type (1 = 128-byte swizzle, 2 = 64-byte, 3 = 32-byte, 0 = none)
constexpr DMOE_SM90_HD uint64_t smem_desc(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes, uint32_t layout) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo_bytes >> 4) & 0x3FFF) << 32) | (uint64_t(layout & 3) << 62);
}

// K-major operand with the swizzle as wide as its rows (128 or 64 bytes).
constexpr DMOE_SM90_HD uint64_t kmajor_desc(uint32_t addr, int row_bytes) {
  return smem_desc(addr, 16, 8 * uint32_t(row_bytes), row_bytes == 128 ? kLayoutSwizzle128 : kLayoutSwizzle64);
}
// Offset of k16 step kk inside a K-major row (2 bytes per element).
constexpr DMOE_SM90_HD uint32_t kmajor_kstep_offset(int kk) { return uint32_t(kk) * 32; }

// MN-major B tile of the NN kernel: panels of 64 columns × bk k-rows.
constexpr int kMnPanelCols = 64;                                      // 128 bytes: one swizzle row
constexpr DMOE_SM90_HD uint32_t mn_panel_bytes(int bk) { return uint32_t(bk) * 128; }
constexpr DMOE_SM90_HD uint32_t mn_panel_offset(int panel, int bk) { return uint32_t(panel) * mn_panel_bytes(bk); }
constexpr DMOE_SM90_HD uint32_t mn_kstep_offset(int kk) { return uint32_t(kk) * 16 * 128; }
// Panels of a tile starting at column col0 that hold columns below n (at least 1: tiles start below n).
// The producer loads only these: a box wholly past the matrix is not asked of TMA, and the stale panels
// left in the slot only feed output columns >= n, which are never stored (a wgmma output column reads
// only its own B column).
constexpr DMOE_SM90_HD int mn_panels_in(int64_t n, int64_t col0, int bn) {
  const int64_t left = (n - col0 + kMnPanelCols - 1) / kMnPanelCols;
  return left < bn / kMnPanelCols ? int(left) : bn / kMnPanelCols;
}
// LBO = next panel (64 MN-columns on), SBO = next 8 k-rows.
constexpr DMOE_SM90_HD uint64_t mnmajor_desc(uint32_t addr, int bk) {
  return smem_desc(addr, mn_panel_bytes(bk), 8 * 128, kLayoutSwizzle128);
}

// ---- TMA tensor maps (host) ---------------------------------------------------------------------------
// What cuTensorMapEncodeTiled is given: dims innermost first (elements), byte strides of dims 1.. (dim 0 is
// contiguous), box (elements), swizzle span in bytes; out-of-range elements are read as zeros.
struct TmaSpec {
  int rank = 2;
  uint64_t dims[3] = {0, 0, 0};
  uint64_t strides[2] = {0, 0};
  uint32_t box[3] = {1, 1, 1};
  int swizzle_bytes = 128;
  uint32_t box_bytes() const { return box[0] * box[1] * box[2] * 2; }
};

// K-major [rows, k] bf16 row-major, boxes of box_rows × box_k (64 or 32 columns: 128- or 64-byte rows).
inline TmaSpec kmajor_spec(int64_t rows, int64_t k, int box_rows, int box_k) {
  TmaSpec s;
  s.rank = 2;
  s.dims[0] = uint64_t(k);
  s.dims[1] = uint64_t(rows);
  s.strides[0] = uint64_t(k) * 2;
  s.box[0] = uint32_t(box_k);
  s.box[1] = uint32_t(box_rows);
  s.swizzle_bytes = box_k * 2;
  return s;
}

// MN-major B of the NN kernel: [groups, k, n] bf16 (each group's [k, n] row-major), one box = one panel
// (64 columns × box_k rows of one group). Rank 3 so that a group's last k-block reads zeros past its k
// rows instead of the next group's first rows (which A's zero columns would cancel only if they are
// finite), and rows past the end likewise.
inline TmaSpec mnmajor_spec(int32_t groups, int64_t k, int64_t n, int box_k) {
  TmaSpec s;
  s.rank = 3;
  s.dims[0] = uint64_t(n);
  s.dims[1] = uint64_t(k);
  s.dims[2] = uint64_t(groups);
  s.strides[0] = uint64_t(n) * 2;
  s.strides[1] = uint64_t(k) * uint64_t(n) * 2;
  s.box[0] = uint32_t(kMnPanelCols);
  s.box[1] = uint32_t(box_k);
  s.box[2] = 1;
  s.swizzle_bytes = 128;
  return s;
}

// ---- the weight-gradient kernel (grouped_wgrad_sm90.cu) -------------------------------------------------
// C_g = A_g^T · B_g reduces over the rows of two row-major matrices: A_g^T [m, rows] has m contiguous and
// B_g [rows, n] has n contiguous, so both operands are MN-major for wgmma and both are loaded as the NN
// kernel's B: panels of 64 columns × box_rows rows (128-byte swizzle, one box each), read through
// mnmajor_desc (A with the transpose-A immediate set). A 2-D map over [rows, cols] with row stride ld:
// rows and columns past the matrix read as zeros; rows of the next group inside the box are the
// kernel's to clear (it zeroes them in shared memory, see wgrad_tail_bytes).
inline TmaSpec rowmajor_panel_spec(int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  TmaSpec s;
  s.rank = 2;
  s.dims[0] = uint64_t(cols);
  s.dims[1] = uint64_t(rows);
  s.strides[0] = uint64_t(ld) * 2;
  s.box[0] = uint32_t(kMnPanelCols);
  s.box[1] = uint32_t(box_rows);
  s.swizzle_bytes = 128;
  return s;
}
// Where a panel's k-rows from `rows_in` on start, and how many bytes they span: row r of a panel is the
// 128 bytes at r·128 (the swizzle permutes 16-byte chunks inside a row only), so clearing rows
// [rows_in, bk) is clearing this byte range, swizzled or not.
constexpr DMOE_SM90_HD uint32_t wgrad_tail_offset(int rows_in) { return uint32_t(rows_in) * 128; }
constexpr DMOE_SM90_HD uint32_t wgrad_tail_bytes(int rows_in, int bk) { return uint32_t(bk - rows_in) * 128; }

}  // namespace dmoe::cuda::sm90
