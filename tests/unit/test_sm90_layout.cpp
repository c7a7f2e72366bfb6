// test_sm90_layout.cpp — the Hopper tile engine's layout arithmetic (cuda/sm90_layout.hpp), without a GPU
// (runs in CI): the wgmma shared-memory descriptors' bit fields and the TMA maps' parameters against
// hand-derived values, and an emulation of one k-block of a tile — TMA writing the boxes into a
// shared-memory image with the 128-byte swizzle, wgmma reading the operands back through the descriptors
// by the canonical layouts of the PTX ISA — whose products must equal the product of the global matrices.
// The emulation uses the same offsets and descriptor functions as the kernels, for the NT product (K-major
// B, which runs on the H200: a check of the emulation itself) and the NN product (MN-major B).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/sm90_layout.hpp"

namespace dmoe {
namespace {

using namespace cuda::sm90;

struct DescFields {
  uint32_t start, lbo, sbo, base_offset, layout;
};
DescFields decode(uint64_t d) {
  return {uint32_t(d & 0x3FFF) << 4, uint32_t((d >> 16) & 0x3FFF) << 4, uint32_t((d >> 32) & 0x3FFF) << 4,
          uint32_t((d >> 49) & 7), uint32_t(d >> 62)};
}

TEST(Sm90Layout, DescriptorBitsMatchHandDerivedValues) {
  // K-major A of consumer 1 (64 rows in: +8192), k16 step 1 (+32 bytes), slot at 0x4000: start 0x6020.
  // Fields: start 0x602, LBO 1 (unused, 16 bytes), SBO 1024 >> 4 = 0x40, layout 1 (128-byte swizzle).
  EXPECT_EQ(kmajor_desc(0x4000 + 64 * 128 + kmajor_kstep_offset(1), 128), 0x4000004000010602ull);
  // 64-byte rows (BK = 32): SBO 512 >> 4 = 0x20, layout 2.
  EXPECT_EQ(kmajor_desc(0x1000, 64), 0x8000002000010100ull);
  // MN-major B at 0x8000, k16 step 1 (+16 rows · 128 B = 2048): start 0x880; LBO = panel 8192 >> 4 =
  // 0x200; SBO = 8 rows · 128 B = 1024 >> 4 = 0x40; layout 1.
  EXPECT_EQ(mnmajor_desc(0x8000 + mn_kstep_offset(1), 64), 0x4000004002000880ull);
  const DescFields f = decode(mnmajor_desc(0x8000 + mn_kstep_offset(3), 64));
  EXPECT_EQ(f.start, 0x8000u + 3 * 2048);
  EXPECT_EQ(f.lbo, 8192u);
  EXPECT_EQ(f.sbo, 1024u);
  EXPECT_EQ(f.base_offset, 0u);
  EXPECT_EQ(f.layout, 1u);
  // The start field holds bits [4, 18) of the address: the whole 227 KiB of shared memory.
  EXPECT_EQ(decode(kmajor_desc(0x37FF0, 128)).start, 0x37FF0u);
  // Every k16 step of a 64-row k-block starts on a 1024-byte atom (so base offset 0 is right), and the
  // panels of a 256-column tile are 8192 bytes apart.
  for (int kk = 0; kk < 4; ++kk) EXPECT_EQ(mn_kstep_offset(kk) % 1024, 0u);
  EXPECT_EQ(mn_panel_offset(3, 64), 3u * 8192);
  EXPECT_EQ(mn_panel_bytes(64), 8192u);
  // Panels a tile loads: all but in the last column tile (n = 520: tile 2 starts at 512, 8 columns, one
  // panel; n = 200, 256 columns: 4 panels cover 256, 200 needs 4 (the last partly); n = 8: one).
  EXPECT_EQ(mn_panels_in(520, 0, 256), 4);
  EXPECT_EQ(mn_panels_in(520, 512, 256), 1);
  EXPECT_EQ(mn_panels_in(200, 0, 256), 4);
  EXPECT_EQ(mn_panels_in(130, 0, 256), 3);
  EXPECT_EQ(mn_panels_in(8, 0, 256), 1);
  EXPECT_EQ(mn_panels_in(8, 0, 128), 1);
  EXPECT_EQ(mn_panels_in(2048, 1792, 256), 4);
  EXPECT_EQ(mn_panels_in(264, 256, 128), 1);
}

void expect_tma_limits(const TmaSpec& s) {
  // cuTensorMapEncodeTiled: strides multiples of 16 below 2^40, boxes of at most 256 elements, the inner
  // box dimension within the swizzle span (128 bytes: exactly one swizzle row, what the wgmma atom is).
  for (int i = 0; i + 1 < s.rank; ++i) {
    EXPECT_EQ(s.strides[i] % 16, 0u) << "stride " << i;
    EXPECT_LT(s.strides[i], uint64_t(1) << 40);
  }
  for (int i = 0; i < s.rank; ++i) {
    EXPECT_GE(s.box[i], 1u);
    EXPECT_LE(s.box[i], 256u);
    EXPECT_LE(s.dims[i], uint64_t(1) << 32);
  }
  EXPECT_EQ(s.box[0] * 2, uint32_t(s.swizzle_bytes));
}

TEST(Sm90Layout, TensorMapParametersMatchHandDerivedValues) {
  // flash-paper dh = dout·w2 and dx = dpre·w1 (64 experts, H = I = 2048): B = [64, 2048, 2048].
  TmaSpec b = mnmajor_spec(64, 2048, 2048, 64);
  EXPECT_EQ(b.rank, 3);
  EXPECT_EQ(b.dims[0], 2048u);  // n, contiguous
  EXPECT_EQ(b.dims[1], 2048u);  // k
  EXPECT_EQ(b.dims[2], 64u);    // groups
  EXPECT_EQ(b.strides[0], 4096u);
  EXPECT_EQ(b.strides[1], 2048u * 4096u);
  EXPECT_EQ(b.box[0], 64u);
  EXPECT_EQ(b.box[1], 64u);
  EXPECT_EQ(b.box[2], 1u);
  EXPECT_EQ(b.swizzle_bytes, 128);
  EXPECT_EQ(b.box_bytes(), 8192u);  // one panel; BN / 64 of them = BN · 128 bytes, the slot's B
  expect_tma_limits(b);
  // fine-grained dx (128 experts, k = I = 768, n = H = 2048) and dh (k = 2048, n = 768).
  b = mnmajor_spec(128, 768, 2048, 64);
  EXPECT_EQ(b.dims[0], 2048u);
  EXPECT_EQ(b.dims[1], 768u);
  EXPECT_EQ(b.dims[2], 128u);
  EXPECT_EQ(b.strides[0], 4096u);
  EXPECT_EQ(b.strides[1], 768u * 4096u);
  expect_tma_limits(b);
  b = mnmajor_spec(128, 2048, 768, 64);
  EXPECT_EQ(b.dims[0], 768u);
  EXPECT_EQ(b.strides[0], 1536u);
  EXPECT_EQ(b.strides[1], 2048u * 1536u);
  expect_tma_limits(b);
  // A (K-major): dpre [rows, 768], boxes of 128 rows × 64 columns.
  const TmaSpec a = kmajor_spec(65536, 768, 128, 64);
  EXPECT_EQ(a.rank, 2);
  EXPECT_EQ(a.dims[0], 768u);
  EXPECT_EQ(a.dims[1], 65536u);
  EXPECT_EQ(a.strides[0], 1536u);
  EXPECT_EQ(a.box[0], 64u);
  EXPECT_EQ(a.box[1], 128u);
  EXPECT_EQ(a.box_bytes(), 16384u);
  expect_tma_limits(a);
  EXPECT_EQ(kmajor_spec(100, 256, 128, 32).swizzle_bytes, 64);
  // The weight-gradient kernel's operands: fine-grained dw1's dpre1 [rows, 768] (A, m contiguous) and x
  // [rows, 2048] (B), and a padded one (ld > cols); boxes of 64 columns × 64 rows = one MN-major panel.
  TmaSpec w = rowmajor_panel_spec(32768, 768, 768, 64);
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.dims[0], 768u);
  EXPECT_EQ(w.dims[1], 32768u);
  EXPECT_EQ(w.strides[0], 1536u);
  EXPECT_EQ(w.box[0], 64u);
  EXPECT_EQ(w.box[1], 64u);
  EXPECT_EQ(w.box_bytes(), mn_panel_bytes(64));
  expect_tma_limits(w);
  w = rowmajor_panel_spec(1000, 200, 216, 64);
  EXPECT_EQ(w.dims[0], 200u);
  EXPECT_EQ(w.strides[0], 432u);
  expect_tma_limits(w);
  EXPECT_EQ(wgrad_tail_offset(1), 128u);
  EXPECT_EQ(wgrad_tail_bytes(1, 64), 63u * 128u);
  EXPECT_EQ(wgrad_tail_offset(33) + wgrad_tail_bytes(33, 64), mn_panel_bytes(64));
}

// ---- emulation --------------------------------------------------------------------------------------

// The 128-byte swizzle on a shared-memory address (slots are 1024-byte aligned, so relative addresses do).
uint32_t swizzle128(uint32_t addr) { return addr ^ (((addr >> 7) & 7) << 4); }

// TMA: the box at `coord` of the global matrix (dims/strides of `s`, element type uint16) into `smem` at
// `dst`, elements in box order (dim 0 fastest), 128-byte swizzled; out-of-range elements are zeros.
void tma_write(std::vector<uint8_t>& smem, uint32_t dst, const TmaSpec& s, const std::vector<uint16_t>& global,
               const int64_t (&coord)[3]) {
  ASSERT_EQ(s.swizzle_bytes, 128);
  for (uint32_t i2 = 0; i2 < s.box[2]; ++i2)
    for (uint32_t i1 = 0; i1 < s.box[1]; ++i1)
      for (uint32_t i0 = 0; i0 < s.box[0]; ++i0) {
        const int64_t g[3] = {coord[0] + i0, coord[1] + i1, coord[2] + i2};
        bool in = true;
        for (int d = 0; d < s.rank; ++d) in = in && g[d] >= 0 && uint64_t(g[d]) < s.dims[d];
        uint16_t v = 0;
        if (in) {
          uint64_t byte = uint64_t(g[0]) * 2;
          for (int d = 1; d < s.rank; ++d) byte += uint64_t(g[d]) * s.strides[d - 1];
          v = global[byte / 2];
        }
        const uint32_t off = dst + ((i2 * s.box[1] + i1) * s.box[0] + i0) * 2;
        std::memcpy(&smem[swizzle128(off)], &v, 2);
      }
}

uint16_t read16(const std::vector<uint8_t>& smem, uint32_t addr) {
  uint16_t v;
  std::memcpy(&v, &smem[swizzle128(addr)], 2);
  return v;
}

// wgmma's view of a K-major operand (128-byte swizzle): element (row, k) of the 16-column step.
uint16_t kmajor_element(const std::vector<uint8_t>& smem, uint64_t desc, int row, int k) {
  const DescFields f = decode(desc);
  EXPECT_EQ(f.layout, kLayoutSwizzle128);
  return read16(smem, f.start + uint32_t(row / 8) * f.sbo + uint32_t(row % 8) * 128 + uint32_t(k) * 2);
}
// wgmma's view of an MN-major operand (128-byte swizzle; 16-byte units ((8, n), (8, k)) : ((1, LBO), (8,
// SBO))): element (col, k) of the 16-row step.
uint16_t mnmajor_element(const std::vector<uint8_t>& smem, uint64_t desc, int col, int k) {
  const DescFields f = decode(desc);
  EXPECT_EQ(f.layout, kLayoutSwizzle128);
  return read16(smem, f.start + uint32_t(col / 64) * f.lbo + uint32_t(k / 8) * f.sbo + uint32_t(k % 8) * 128 +
                          uint32_t(col % 64) * 2);
}

struct TileCase {
  bool nn;
  int32_t groups;
  int64_t rows, n, k;  // A [rows, k]; NN: B [groups, k, n]; NT: B [groups · n, k]
  int bn;
  int32_t group;
  int64_t a_row, n_tile, kb;  // the tile and k-block emulated
};

// Loads one k-block of the tile as the producer does and runs the consumers' k16 steps through the
// descriptors; every product must equal the global matrices' product over that k-block (values are small
// integers, so the sums are exact). k-rows past k (NN: past the group's k rows) must read as zeros.
void check_tile(const TileCase& t) {
  constexpr int BM = 128, BK = 64;
  std::mt19937 rng(7);
  auto small = [&] { return uint16_t(1 + rng() % 7); };  // stored as raw integers, not bf16
  std::vector<uint16_t> a(size_t(t.rows * t.k)), b(size_t(t.groups * t.n * t.k));
  for (auto& v : a) v = small();
  for (auto& v : b) v = small();
  const uint32_t slot = 1024;  // 1024-aligned, as the kernel's slots
  const uint32_t a_bytes = BM * 128, slot_b = slot + a_bytes;
  std::vector<uint8_t> smem(slot + a_bytes + uint32_t(t.bn) * 128 + 1024, 0xEE);
  const TmaSpec sa = kmajor_spec(t.rows, t.k, BM, BK);
  tma_write(smem, slot, sa, a, {t.kb * BK, t.a_row, 0});
  if (t.nn) {
    const TmaSpec sb = mnmajor_spec(t.groups, t.k, t.n, BK);
    ASSERT_EQ(sb.box_bytes() * uint32_t(t.bn / kMnPanelCols), uint32_t(t.bn) * 128) << "expect_tx bytes";
    // Only the panels the producer loads; the others keep stale bytes (0xEE here), which feed only
    // columns >= n (not compared below: never stored).
    const int panels = mn_panels_in(t.n, t.n_tile * t.bn, t.bn);
    for (int j = 0; j < panels; ++j)
      tma_write(smem, slot_b + mn_panel_offset(j, BK), sb, b, {t.n_tile * t.bn + j * kMnPanelCols, t.kb * BK, t.group});
  } else {
    const TmaSpec sb = kmajor_spec(int64_t(t.groups) * t.n, t.k, t.bn, BK);
    tma_write(smem, slot_b, sb, b, {t.kb * BK, int64_t(t.group) * t.n + t.n_tile * t.bn, 0});
  }
  // Global reference over this k-block (zeros past k; NN: B_g only, never the next group's rows).
  auto a_at = [&](int64_t r, int64_t q) -> int64_t { return r < t.rows && q < t.k ? a[r * t.k + q] : 0; };
  auto b_at = [&](int64_t col, int64_t q) -> int64_t {
    if (col >= t.n || q >= t.k) return 0;
    return t.nn ? b[(int64_t(t.group) * t.k + q) * t.n + col] : b[(int64_t(t.group) * t.n + col) * t.k + q];
  };
  int64_t bad = 0;
  for (int consumer = 0; consumer < 2; ++consumer) {
    const uint32_t a_base = slot + uint32_t(consumer) * 64 * 128;
    for (int m = 0; m < 64; m += 7)
      for (int col = 0; col < t.bn && t.n_tile * t.bn + col < t.n; col += 3) {
        int64_t got = 0, want = 0;
        for (int kk = 0; kk < BK / 16; ++kk) {
          const uint64_t da = kmajor_desc(a_base + kmajor_kstep_offset(kk), 128);
          const uint64_t db = t.nn ? mnmajor_desc(slot_b + mn_kstep_offset(kk), BK)
                                   : kmajor_desc(slot_b + kmajor_kstep_offset(kk), 128);
          for (int k = 0; k < 16; ++k) {
            const int64_t x = kmajor_element(smem, da, m, k);
            const int64_t y = t.nn ? mnmajor_element(smem, db, col, k) : kmajor_element(smem, db, col, k);
            got += x * y;
            const int64_t q = t.kb * BK + kk * 16 + k;
            want += a_at(t.a_row + consumer * 64 + m, q) * b_at(t.n_tile * t.bn + col, q);
          }
        }
        if (got != want && bad++ < 3)
          ADD_FAILURE() << "consumer " << consumer << " row " << m << " col " << col << ": " << got << " vs " << want;
      }
  }
  EXPECT_EQ(bad, 0);
}

// The weight-gradient kernel's k-block: C [m0 + 128, n0 + 128) += A_g^T · B_g over 64 rows of group g, A
// [rows, m] and B [rows, n] row-major (padded rows: lda, ldb), both loaded as 64-column panels and both
// read as MN-major operands (A through the same descriptor as B, wgmma's transpose-A set); in the group's
// last k-block the rows past it (the next group's) are cleared as the consumer does, so the products must
// equal the sums over the group's rows of the k-block only. Panels wholly past m or n are not loaded (their
// stale bytes feed only outputs past m or n, not compared).
struct WgradTileCase {
  int64_t rows, m, n, lda, ldb;
  int64_t group_begin, group_rows;  // the group's rows [begin, begin + rows) of A and B (a_first = b_first = 0)
  int64_t m0, n0, kb;
};

void check_wgrad_tile(const WgradTileCase& t) {
  constexpr int BK = 64, kPanels = 2;
  std::mt19937 rng(11);
  auto small = [&] { return uint16_t(1 + rng() % 7); };
  std::vector<uint16_t> a(size_t(t.rows * t.lda)), b(size_t(t.rows * t.ldb));
  for (auto& v : a) v = small();
  for (auto& v : b) v = small();
  const uint32_t slot = 1024, slot_b = slot + kPanels * mn_panel_bytes(BK);
  std::vector<uint8_t> smem(slot_b + kPanels * mn_panel_bytes(BK) + 1024, 0xEE);
  const TmaSpec sa = rowmajor_panel_spec(t.rows, t.m, t.lda, BK), sb = rowmajor_panel_spec(t.rows, t.n, t.ldb, BK);
  const int a_panels = mn_panels_in(t.m, t.m0, 128), b_panels = mn_panels_in(t.n, t.n0, 128);
  const int64_t row0 = t.group_begin + t.kb * BK;
  for (int j = 0; j < a_panels; ++j) tma_write(smem, slot + mn_panel_offset(j, BK), sa, a, {t.m0 + 64 * j, row0, 0});
  for (int j = 0; j < b_panels; ++j) tma_write(smem, slot_b + mn_panel_offset(j, BK), sb, b, {t.n0 + 64 * j, row0, 0});
  const int64_t k_blocks = (t.group_rows + BK - 1) / BK;
  const int tail = int(t.group_rows % BK);
  if (t.kb == k_blocks - 1 && tail != 0) {
    for (int j = 0; j < a_panels + b_panels; ++j) {
      const uint32_t panel = j < a_panels ? slot + mn_panel_offset(j, BK) : slot_b + mn_panel_offset(j - a_panels, BK);
      std::memset(&smem[panel + wgrad_tail_offset(tail)], 0, wgrad_tail_bytes(tail, BK));
    }
  }
  int64_t bad = 0;
  for (int half = 0; half < 2; ++half)  // the two m64 products: A panel 0 and A panel 1
    for (int mi = 0; mi < 64 && t.m0 + 64 * half + mi < t.m; mi += 5)
      for (int nj = 0; nj < 128 && t.n0 + nj < t.n; nj += 3) {
        int64_t got = 0, want = 0;
        for (int kk = 0; kk < BK / 16; ++kk) {
          const uint64_t da = mnmajor_desc(slot + mn_panel_offset(half, BK) + mn_kstep_offset(kk), BK);
          const uint64_t db = mnmajor_desc(slot_b + mn_kstep_offset(kk), BK);
          for (int k = 0; k < 16; ++k) got += int64_t(mnmajor_element(smem, da, mi, k)) * mnmajor_element(smem, db, nj, k);
        }
        for (int64_t r = row0; r < std::min(row0 + BK, t.group_begin + t.group_rows); ++r)
          want += int64_t(a[r * t.lda + t.m0 + 64 * half + mi]) * b[r * t.ldb + t.n0 + nj];
        if (got != want && bad++ < 3)
          ADD_FAILURE() << "m " << t.m0 + 64 * half + mi << " n " << t.n0 + nj << ": " << got << " vs " << want;
      }
  EXPECT_EQ(bad, 0);
}

TEST(Sm90Layout, EmulatedWgradTileMatchesTheProduct) {
  check_wgrad_tile({300, 256, 256, 256, 256, 10, 200, 0, 128, 1});    // a full k-block inside the group
  check_wgrad_tile({300, 256, 256, 256, 256, 10, 200, 128, 0, 3});    // the last: 8 rows, then group 2's
  check_wgrad_tile({300, 200, 136, 216, 144, 50, 1, 128, 128, 0});    // one row; m and n tails, padded rows:
                                                                      // B's second panel wholly past n
  check_wgrad_tile({130, 768, 2048, 768, 2048, 97, 33, 640, 1920, 0});  // fine-grained dw1's shapes, 33 rows
}

TEST(Sm90Layout, EmulatedNtTileMatchesTheProduct) {
  // The K-major B of the forward kernel (runs on the H200): checks the emulation's model of TMA and wgmma.
  check_tile({false, 3, 300, 264, 136, 256, 1, 128, 0, 1});
  check_tile({false, 3, 300, 264, 136, 128, 2, 256, 2, 2});  // k tail (136 = 2·64 + 8), rows past the end
}

TEST(Sm90Layout, EmulatedNnTileMatchesTheProduct) {
  check_tile({true, 3, 300, 520, 136, 256, 0, 0, 0, 0});
  check_tile({true, 3, 300, 520, 136, 256, 1, 128, 2, 2});  // n tail (520 = 2·256 + 8), k tail: zeros, not
                                                             // group 2's rows
  check_tile({true, 2, 200, 192, 72, 128, 0, 100, 1, 1});    // 128 columns, k tail of 8 rows in group 0
  check_tile({true, 2, 200, 130, 136, 256, 1, 0, 0, 2});     // 3 of 4 panels loaded, the third partly
  check_tile({true, 4, 130, 2048, 768, 256, 3, 2, 7, 11});   // fine-grained dx's shapes, last group
}

}  // namespace
}  // namespace dmoe
