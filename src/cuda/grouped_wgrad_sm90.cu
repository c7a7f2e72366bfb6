// cuda/grouped_wgrad_sm90.cu — the experts' weight gradients on Hopper (sm_90a): for every group g with rows,
// C_g [m, n] (+)= A_g^T · B_g, A_g [rows_g, m] and B_g [rows_g, n] the group's rows of two row-major bf16
// activation matrices, f32 accumulation and output (or, with c_bf16, bf16 output: each f32 sum rounded once, for
// the PyTorch module's and the bf16 GPU model's expert gradients, written 16 bytes per lane after a transpose
// inside each quad). Same descriptor and semantics as the mma.sync kernel
// (GroupedWgrad, grouped_wgrad.cu), which stays for sm_80-class GPUs (f32 output only).
//
// Why: the mma.sync kernel runs one CTA per 128×128 tile and writes its f32 tile only after its products,
// so the SM's tensor cores idle during the stores and its DRAM writes idle during the products: measured
// 481 µs storing (214 TFLOP/s, ~1.6 TB/s) and 840 µs accumulating on fine-grained dw1 (docs/perf.md). With
// reductions of ~256 rows, a 128×128 tile is 8.4 MFLOP (~1.4 µs of one SM's wgmma peak) against 64 KiB of
// f32 output (~1.8 µs of one SM's share of DRAM bandwidth): the epilogue is as long as the main loop, so
// it has to run beside the next tile's products rather than after them.
//
// Structure (one persistent CTA per SM, 384 threads; the tile engine of grouped_gemm_sm90.cu, its
// primitives in sm90_primitives.cuh and layouts in sm90_layout.hpp):
//   warpgroup 0   producer: one thread takes tile indices (the first wave by blockIdx, then from a global
//                 counter: tiles start in index order), hands each to the consumers through a 4-entry
//                 ring, and TMA-loads its k-blocks (64 rows of A_g and of B_g) into a ring of kStages (7) slots
//                 of 32 KiB; in accumulate mode it also prefetches the tile's C rows into L2
//                 (cp.async.bulk.prefetch.L2), about two main loops before the epilogue reads them.
//   warpgroups 1-2 consumers, "ping-pong": consumer w takes the CTA's tiles w, w + 2, w + 4, ... of its
//                 sequence; each computes a whole 128×128 tile (two wgmma m64n128k16 per k16 step, 128
//                 f32 accumulators per thread) and stores it straight from registers (f32 pairs, every
//                 quad of lanes writing 32 contiguous bytes: whole sectors) while the other consumer's
//                 products run on the tensor cores. Both read every tile index, so each knows where in
//                 the slot ring its own tiles' k-blocks sit (the other's tiles are skipped by count). The
//                 main loops run in tile order (an order barrier per consumer, as CUTLASS's ping-pong
//                 orders its math warpgroups): skipping by count is only safe once the other consumer
//                 has waited for its tile's slots — whenever two consecutive tiles have more k-blocks than
//                 there are slots (found when the strip schedule hung, nineteenth session; see the wait).
// Tiles: the groups with rows, in order, each ceil(m/128) × ceil(n/128) tiles, n fastest; a table of those
// groups replaces a search (every group with rows has the same number of tiles).
//
// Two schedules over those tiles (Sm90WgradTuning::schedule; the host splits the groups by their rows):
//   tile   every tile's k-blocks of A and B go through the slot ring (32 KiB slots). With ~256 rows a group
//          that reads 2 bytes of operand per byte of f32 output: fine-grained's dw1 moved 4.5 TB/s of tile
//          loads from L2 beside 2 TB/s of gradient writes, and Nsight Compute put the kernel at 86 % of the
//          L2's throughput (docs/perf.md, eleventh session): the L2, not DRAM or the tensor cores, bound it.
//   strip  (groups of at most kStripMaxKBlocks k-blocks = 320 rows; the longer ones take the tile schedule
//          in a second launch) the work unit is a strip: up to kStripMaxLen consecutive column tiles of one
//          row of tiles of one group. The producer loads the strip's A k-range once into one of two
//          resident buffers (the next strip's A lands in the other while this one is read), then each
//          tile's B k-blocks through a ring of 16 KiB slots; the consumers take the strip's tiles in turn
//          as before, reading A from the buffer. Per tile of an 8-tile strip that is 9/16 of the tile
//          schedule's operand loads. Resident-A barriers: a_full (the TMA loads landed), a_ready (the owner
//          of the strip's first tile cleared A's tail rows, below, and fenced: 128 arrivals), a_empty (each
//          consumer's thread 0 once its tiles of the strip have read A: at the strip's last tile, after the
//          products if it owns it, on the skip if not). The same wgmma instructions run over the same
//          k-blocks in the same order: both schedules give the same bits (tested).
//          Expected on the H200 (written before measuring): the L2 traffic per output byte falls from ~3.25
//          to ~2.1 (loads 2.25 → 1.1, writes 1), so ~1.3-1.5× on the L2-bound storing products —
//          flash-paper dw1 507 → ~350-390 µs, fine-grained 399 → ~280-310 µs — until the DRAM writes
//          (~3-4 TB/s) bound it; decode (16 rows: loads are 1/8 of the writes) unchanged. Measured
//          (docs/perf.md, nineteenth session): the tile loads fell 38 % as designed, the time only 6-10 %
//          (flash-paper 508 → 460 µs, fine-grained 399 → 367): past the L2 the f32 writes bound it.
//
// Operands: A_g^T [m, rows] has m contiguous and B_g [rows, n] n contiguous, so both are MN-major for
// wgmma: TMA loads each as 64-column panels × 64 k-rows (128-byte swizzle; the NN kernel's B layout,
// sm90_layout.hpp: rowmajor_panel_spec, mnmajor_desc), and the instruction reads A with its transpose-A and
// B with its transpose-B immediate set (bf16 allows both from shared memory).
//
// A group's last k-block: the reduction runs over the group's rows only, but a TMA box of 64 rows starting
// at the group's last k-block also holds the next group's first rows (TMA's zero fill only starts at the
// end of the matrix). Those rows are cleared in shared memory before the products read them: the owning
// consumer waits for the slot's data, its 128 threads write zeros over k-rows [rows_g % 64, 64) of every
// panel the producer loaded (generic-proxy stores), each thread then orders its stores before the
// tensor cores' reads with fence.proxy.async.shared::cta (wgmma reads shared memory through the async
// proxy), and a warpgroup barrier makes all 128 threads' stores precede the first wgmma. Both operands
// are cleared, so no NaN or Inf in a neighbouring group's rows can reach this group's sums (0 · Inf =
// NaN). The same fence also orders these stores before the producer's next TMA write into the slot
// (released by the consumer's later arrival on the slot's empty barrier). Per-group tensor maps bounded
// at the group's rows would avoid the stores but cost a map encoding per group and call on the host.
// Panels wholly past m (or n) are not loaded; the stale bytes in them feed only output rows >= m
// (columns >= n), which are never stored.
//
// Accumulate mode reads C: by default each consumer loads its tile's C rows into registers (32 f32 pairs
// in flight per thread, from L2 after the producer's prefetch), adds and stores; Sm90WgradTuning /
// DMOE_SM90_WGRAD_ACCUMULATE=red instead sends the sums as red.global.add.v2.f32 (the add happens at L2;
// every element is touched by one tile, so the result is the same f32 sum c + acc either way).
//
// Expected on the H200, fine-grained dw1 (128 experts × 768 × 2048, ~256 rows each, 103 GFLOP, 6144
// tiles, ~47 per CTA): storing writes 0.78 GB of f32 (~165 µs at ~4.7 TB/s) and reads 0.18 GB of
// operands once from DRAM (L2 serves the tiles' repeated reads: ~1.6 GB of tile loads, ~8 TB/s of L2 at
// ~200 µs), against 103 GFLOP (~130 µs at ~800 TFLOP/s); with the stores overlapped the kernel should be
// bound by the DRAM writes: ~190-220 µs (2.2-2.5× the mma.sync kernel's 481), the excess being the first
// and last tiles of each CTA (no overlap) and wgmma at ~4 k-blocks per tile. Accumulating reads the same
// 0.78 GB back: ~1.6 GB of DRAM traffic, ~350-400 µs (vs 840). Measured (eleventh session): 399 µs storing,
// 860 accumulating — L2-bound (the strip schedule below took the storing case to 367 µs).
//
// Every mbarrier wait has a time limit (DMOE_GPU_WAIT_TIMEOUT_MS): past it the wait is recorded
// (cuda/check.hpp, kWaitSm90Wgrad) and the kernel traps, so a bug is an error, not a hang.
#include <cuda.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#include "core/env.hpp"
#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"
#include "cuda/sm90_host.hpp"
#include "cuda/sm90_layout.hpp"
#include "cuda/sm90_primitives.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kTileM = 128, kTileN = 128;  // one consumer warpgroup's tile
constexpr int kBK = 64;                    // k-block: rows of the reduction per slot (128-byte panel rows)
constexpr int kThreads = 384;              // producer warpgroup + two consumer warpgroups
constexpr int kPanels = kTileM / sm90::kMnPanelCols;  // 64-column panels per operand and k-block (2)
static_assert(kTileM == kTileN, "A and B have the same number of panels per slot");
constexpr int kPanelBytes = int(sm90::mn_panel_bytes(kBK));  // 8 KiB
constexpr int kOperandBytes = kPanels * kPanelBytes;         // 16 KiB: one operand's k-block
constexpr int kStageBytes = 2 * kOperandBytes;               // A's panels, then B's
constexpr int kTileRing = 4;                                 // tile indices in flight to the consumers
constexpr int kMaxSmem = 232448;                             // sm_90 opt-in limit (227 KiB)
// up to 8 slots' barriers, the tile ring's, the consumers' order barriers, the ring
constexpr int kBarBytes = 8 * 2 * 8 + 8 * 2 * kTileRing + 8 * 2 + 4 * kTileRing;
constexpr int kStagesFit = (kMaxSmem - 1024 - kBarBytes) / kStageBytes;
constexpr int kStages = kStagesFit < 8 ? kStagesFit : 8;
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kBarBytes;
static_assert(kStages >= 4 && kSmemBytes <= kMaxSmem, "slots do not fit in shared memory");
// The strip schedule: groups of at most kStripMaxKBlocks k-blocks (320 rows) keep A's k-range resident in
// two buffers (the next strip's loads land while the current one is read), leaving at least
// kStripMinStages 16 KiB slots for B; strips of at most kStripMaxLen tiles.
constexpr int kStripMaxKBlocks = 5, kStripMinStages = 4, kStripMaxStages = 8, kStripMaxLen = 8;
constexpr int kStripBarBytes = 8 * 2 * kStripMaxStages + 8 * 2 * kTileRing + 8 * 2 + 8 * 6 + 4 * kTileRing;
constexpr int strip_smem_bytes(int res_kblocks, int b_stages) {
  return 1024 + (2 * res_kblocks + b_stages) * kOperandBytes + kStripBarBytes;
}
static_assert(strip_smem_bytes(kStripMaxKBlocks, kStripMinStages) <= kMaxSmem, "strip buffers do not fit");

// How C is written: store (accumulate = false), load-add-store, reductions at L2, or stored as bf16 (c_bf16:
// 16-byte stores after a transpose inside each quad, or, as measured against, each lane's 4-byte pairs).
enum WgradMode : int { kStore = 0, kLoadAdd = 1, kRed = 2, kStoreBf16 = 3, kStoreBf16Pairs = 4 };

struct WgradSm90Params {
  const int64_t* row_offsets;  // [groups + 1], as given
  const int32_t* active;       // [tiles / tiles_per_group] the groups with rows, in order
  int32_t* tile_counter;       // the dynamic schedule's next-tile counter, zeroed before the launch
  float* c;
  __nv_bfloat16* c_bf16;       // kStoreBf16: C's bf16 elements (c unused)
  int64_t c_stride;            // elements between consecutive groups' C
  int64_t a_first, b_first;    // the offsets' row number of a's and b's row 0
  int32_t m, n;
  int32_t n_tiles, tiles_per_group, tiles;
  // The strip schedule (header comment): strips of up to strip_len column tiles, n_chunks per row of tiles,
  // strips_per_group = row tiles · n_chunks; every group of the launch has at most res_kblocks k-blocks
  // (the resident A buffer's size); b_stages slots of B.
  int32_t strip_len, n_chunks, strips_per_group, strips, res_kblocks, b_stages;
  unsigned long long timeout_ns;
  DeviceWaitRecord* wait_record;
};

#ifdef DMOE_SM90A_DEVICE

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int what, int slot, const WgradSm90Params& p) {
  mbar_wait(bar, parity, what, slot, p.timeout_ns, p.wait_record, kWaitSm90Wgrad);
}

struct WgradTile {
  int32_t group;
  int32_t rows;          // the group's rows (> 0)
  int32_t a_row, b_row;  // the group's first row in a and in b (TMA row coordinates)
  int32_t m0, n0;        // the tile's first output row and column
  int32_t local, count;  // strip schedule: the tile's place in its strip, and the strip's tiles
};

// The j-th group with rows of the launch: its index, rows and first rows in a and b.
__device__ __forceinline__ void decode_group(const WgradSm90Params& p, int32_t j, WgradTile& tc) {
  tc.group = __ldg(p.active + j);
  const int64_t r0 = __ldg(p.row_offsets + tc.group);
  tc.rows = int32_t(__ldg(p.row_offsets + tc.group + 1) - r0);
  tc.a_row = int32_t(r0 - p.a_first);
  tc.b_row = int32_t(r0 - p.b_first);
}

// Tile t of the tile schedule: the groups with rows in order, each's tiles n fastest.
__device__ __forceinline__ WgradTile decode_tile(const WgradSm90Params& p, int32_t t) {
  WgradTile tc;
  const int32_t j = t / p.tiles_per_group, local = t - j * p.tiles_per_group;
  decode_group(p, j, tc);
  tc.m0 = (local / p.n_tiles) * kTileM;
  tc.n0 = (local % p.n_tiles) * kTileN;
  tc.local = 0;
  tc.count = 1;
  return tc;
}

// Tile t = u · strip_len + local of the strip schedule: strip u is (group, row of tiles, chunk of at most
// strip_len consecutive column tiles), chunks fastest; a strip's last chunk may be shorter.
__device__ __forceinline__ WgradTile decode_strip_tile(const WgradSm90Params& p, int32_t t) {
  WgradTile tc;
  const int32_t u = t / p.strip_len;
  tc.local = t - u * p.strip_len;
  const int32_t j = u / p.strips_per_group, in_group = u - j * p.strips_per_group;
  const int32_t mt = in_group / p.n_chunks, chunk = in_group - mt * p.n_chunks;
  decode_group(p, j, tc);
  tc.m0 = mt * kTileM;
  const int32_t first_tile = chunk * p.strip_len;
  tc.count = min(p.strip_len, p.n_tiles - first_tile);
  tc.n0 = (first_tile + tc.local) * kTileN;
  return tc;
}

__device__ __forceinline__ int32_t k_blocks_of(const WgradTile& tc) { return (tc.rows + kBK - 1) / kBK; }

__device__ __forceinline__ void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(addr), "r"(0) : "memory");
}

// Zeroes k-rows [tail, 64) of `panels` panels of one k-block (the rows past a group: header comment), by
// one warpgroup's 128 threads; the caller fences and synchronises.
__device__ __forceinline__ void clear_tail_rows(int tail, int panels, int tid, uint32_t first_a, int a_panels,
                                                uint32_t first_b) {
  const int chunks = int(sm90::wgrad_tail_bytes(tail, kBK)) / 16;  // per panel
  for (int q = tid; q < chunks * panels; q += 128) {
    const int panel = q / chunks, chunk = q - panel * chunks;
    const uint32_t base = panel < a_panels ? first_a + panel * kPanelBytes : first_b + (panel - a_panels) * kPanelBytes;
    st_shared_zero16(base + sm90::wgrad_tail_offset(tail) + uint32_t(chunk) * 16);
  }
}

__device__ __forceinline__ void prefetch_l2(const void* global, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(global), "r"(bytes) : "memory");
}

__device__ __forceinline__ void red_add_f32x2(float* global, float x, float y) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(global), "f"(x), "f"(y) : "memory");
}

#endif  // DMOE_SM90A_DEVICE

// kStrip = false: the tile schedule (every tile loads A's and B's k-blocks into the slot ring);
// kStrip = true: the strip schedule (A's k-blocks once per strip into a resident buffer, B's through the
// ring). Header comment.
template <int kMode, bool kStrip>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_wgrad_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                              const __grid_constant__ WgradSm90Params p) {
#ifdef DMOE_SM90A_DEVICE
  // Slots: the tile schedule's hold A's and B's k-block (32 KiB), the strip schedule's B's only (16 KiB),
  // after its two resident A buffers of res_kblocks k-blocks each.
  const int S = kStrip ? p.b_stages : kStages;
  constexpr uint32_t kSlotBytes = kStrip ? kOperandBytes : kStageBytes;
  const uint32_t a_buffer_bytes = kStrip ? uint32_t(p.res_kblocks) * kOperandBytes : 0u;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t base = smem_u32(smem);
  const uint32_t slots = base + 2 * a_buffer_bytes;
  // full[S], empty[S], tile_full[R], tile_empty[R], done[2], (strip: a_full[2], a_ready[2], a_empty[2]), ring
  const uint32_t bars = slots + uint32_t(S) * kSlotBytes;
  auto a_buffer = [&](int b) { return base + uint32_t(b) * a_buffer_bytes; };
  auto slot_a = [&](int s) { return slots + uint32_t(s) * kSlotBytes; };  // tile schedule only
  auto slot_b = [&](int s) { return slots + uint32_t(s) * kSlotBytes + (kStrip ? 0u : uint32_t(kOperandBytes)); };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (S + s); };
  auto tile_full = [&](int r) { return bars + 8 * (2 * S + r); };
  auto tile_empty = [&](int r) { return bars + 8 * (2 * S + kTileRing + r); };
  // Consumer c's main loop of its latest tile is done (every k-block's data waited for and read).
  auto mainloop_done = [&](int c) { return bars + 8 * (2 * S + 2 * kTileRing + c); };
  const uint32_t a_bars = bars + 8 * (2 * S + 2 * kTileRing + 2);
  auto a_full = [&](int b) { return a_bars + 8 * b; };        // the producer's TMA loads of the buffer landed
  auto a_ready = [&](int b) { return a_bars + 8 * (2 + b); };  // the strip's tail rows cleared (first tile's owner)
  auto a_empty = [&](int b) { return a_bars + 8 * (4 + b); };  // both consumers are done reading it
  const uint32_t tile_ring = bars + 8 * (2 * S + 2 * kTileRing + 2 + (kStrip ? 6 : 0));
  auto decode = [&](int32_t t) { return kStrip ? decode_strip_tile(p, t) : decode_tile(p, t); };
  const int32_t work_units = kStrip ? p.strips : p.tiles;
  constexpr int kProducerRegs = kStrip && (kMode == kLoadAdd || kMode == kRed) ? 56 : 40;
  static_assert(kProducerRegs * 128 + (kProducerRegs == 56 ? 224 : 232) * 256 <= 65536, "register file");

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 1);  // one arrival: the consumer that owns the slot's tile
    }
    for (int r = 0; r < kTileRing; ++r) {
      mbar_init(tile_full(r), 1);
      mbar_init(tile_empty(r), 2 * 128);  // every consumer thread reads every index, then arrives
    }
    for (int c = 0; c < 2; ++c) mbar_init(mainloop_done(c), 1);  // that consumer's thread 0, per tile
    if constexpr (kStrip) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(a_full(b), 1);
        mbar_init(a_ready(b), 128);  // every thread of the first tile's owner, after its tail stores
        mbar_init(a_empty(b), 2);    // thread 0 of each consumer, at the strip's last tile
      }
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---- producer ----
    // (The strip schedule's C prefetch spilled 20-28 bytes at 40 registers: 56 for it, 224 for the consumers.)
    if constexpr (kProducerRegs == 56)
      asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    else
      asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
      uint32_t it = 0, i = 0;
      int32_t next = int32_t(blockIdx.x);
      for (uint32_t q = 0;; ++q) {  // q: this CTA's work units (tiles, or strips)
        const int32_t u = next < work_units ? next : -1;
        if (u < 0) {
          const int r = int(i % kTileRing);
          mbar_wait(tile_empty(r), ((i / kTileRing) & 1) ^ 1, 4, r, p);
          st_shared_volatile(tile_ring + 4 * r, -1);
          mbar_arrive(tile_full(r));
          break;
        }
        next = int32_t(gridDim.x) + atomicAdd(p.tile_counter, 1);  // its latency hides behind the loads
        const int32_t first_t = kStrip ? u * p.strip_len : u;
        const WgradTile first = decode(first_t);
        const int a_panels = sm90::mn_panels_in(p.m, first.m0, kTileM);
        const int32_t k_blocks = k_blocks_of(first);
        if constexpr (kStrip) {
          // The strip's A: every k-block once, into buffer q % 2 when both consumers are done with it.
          const int b = int(q & 1);
          mbar_wait(a_empty(b), ((q >> 1) & 1) ^ 1, 7, b, p);
          mbar_expect_tx(a_full(b), uint32_t(a_panels * k_blocks) * kPanelBytes);
          for (int32_t kb = 0; kb < k_blocks; ++kb)
            for (int j = 0; j < a_panels; ++j)
              tma_load_2d(a_buffer(b) + uint32_t(kb) * kOperandBytes + j * kPanelBytes, &map_a,
                          first.m0 + j * sm90::kMnPanelCols, first.a_row + kb * kBK, a_full(b));
        }
        for (int32_t local = 0; local < first.count; ++local, ++i) {
          const int32_t t = first_t + local;
          const int r = int(i % kTileRing);
          mbar_wait(tile_empty(r), ((i / kTileRing) & 1) ^ 1, 4, r, p);
          st_shared_volatile(tile_ring + 4 * r, t);
          mbar_arrive(tile_full(r));
          const int32_t n0 = first.n0 + local * kTileN;
          if constexpr (kMode == kLoadAdd || kMode == kRed) {
            // C's tile rows into L2 now; the owning consumer reads (or reduces into) them after this tile's
            // main loop, which starts once the previous tile's slots drain (and the other consumer's main loop
            // of the previous tile ends).
            const float* c_tile = p.c + int64_t(first.group) * p.c_stride + int64_t(first.m0) * p.n + n0;
            const uint32_t bytes = uint32_t(min(kTileN, p.n - n0)) * 4;  // n % 8 == 0: a multiple of 32
            const int rows_in = min(kTileM, p.m - first.m0);
            for (int rr = 0; rr < rows_in; ++rr) prefetch_l2(c_tile + int64_t(rr) * p.n, bytes);
          }
          const int b_panels = sm90::mn_panels_in(p.n, n0, kTileN);
          for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
            const int s = int(it % uint32_t(S));
            mbar_wait(empty(s), ((it / uint32_t(S)) & 1) ^ 1, 1, s, p);
            mbar_expect_tx(full(s), uint32_t((kStrip ? 0 : a_panels) + b_panels) * kPanelBytes);
#pragma unroll
            for (int j = 0; j < kPanels; ++j) {
              if (!kStrip && j < a_panels)
                tma_load_2d(slot_a(s) + j * kPanelBytes, &map_a, first.m0 + j * sm90::kMnPanelCols,
                            first.a_row + kb * kBK, full(s));
              if (j < b_panels)
                tma_load_2d(slot_b(s) + j * kPanelBytes, &map_b, n0 + j * sm90::kMnPanelCols, first.b_row + kb * kBK,
                            full(s));
            }
          }
        }
      }
    }
  } else {
    // ---- consumers ----
    if constexpr (kProducerRegs == 56)
      asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    else
      asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;
    const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
    float acc0[64], acc1[64];  // output rows m0 + [0, 64) and m0 + [64, 128) of the tile
#pragma unroll
    for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.f;  // (each tile's first products overwrite them)
    uint32_t it = 0;
    uint32_t q = 0;         // strip schedule: strips this CTA's consumers have seen end
    bool a_waited = false;  // strip schedule: this consumer has waited for the current strip's A
    for (uint32_t i = 0;; ++i) {
      const int r = int(i % kTileRing);
      mbar_wait(tile_full(r), (i / kTileRing) & 1, 3, r, p);
      const int32_t t = ld_shared_volatile(tile_ring + 4 * r);
      mbar_arrive(tile_empty(r));
      if (t < 0) break;
      const WgradTile tc = decode(t);
      const int32_t k_blocks = k_blocks_of(tc);
      const bool last_of_strip = tc.local == tc.count - 1;
      const int tail = tc.rows % kBK;  // rows of the group in its last k-block (0: a full one)
      const int a_panels = sm90::mn_panels_in(p.m, tc.m0, kTileM);
      const int b = int(q & 1);        // strip schedule: the strip's A buffer
      if (int(i & 1) != consumer) {  // the other consumer's tile: its k-blocks fill the next slots
        it += uint32_t(k_blocks);
        if (kStrip && last_of_strip) {
          if (tid == 0) mbar_arrive(a_empty(b));  // this consumer's tiles of the strip are done
          ++q;
          a_waited = false;
        }
        continue;
      }
      if constexpr (kStrip) {
        if (!a_waited) {
          // The strip's A: loaded (a_full), then its tail rows cleared by the owner of the strip's first
          // tile (a_ready; the clearing thread's fence orders its stores before the tensor cores' reads).
          mbar_wait(a_full(b), (q >> 1) & 1, 5, b, p);
          if (tc.local == 0) {
            if (tail != 0)
              clear_tail_rows(tail, a_panels, tid, a_buffer(b) + uint32_t(k_blocks - 1) * kOperandBytes, a_panels, 0);
            fence_async_shared();
            mbar_arrive(a_ready(b));
          }
          mbar_wait(a_ready(b), (q >> 1) & 1, 6, b, p);
          a_waited = true;
        }
      }
      // The main loops run in tile order: this tile's only after the other consumer's previous one. Without
      // it, whenever the skipped tile i − 1 and this tile i have more k-blocks together than the S slots, some
      // k-block of tile i waits on a slot last filled for tile i − 1 before its owner has waited for that
      // fill — one phase early — and passes if that load has not landed (phase parity repeats every two
      // phases). With S = 4 and tiles of exactly 4 k-blocks it happened every run (the strip schedule's first
      // version hung); the tile schedule (S = 7) was exposed from 4 + 4 k-blocks on (groups over 192 rows),
      // hidden by timing. Keep the barrier for every tile, not only for the exact-S case.
      // (A review's protocol model, nineteenth session: without the barrier 3 + 3 k-blocks at S = 4 failed too.)
      if (i >= 1) mbar_wait(mainloop_done(1 - consumer), ((i - 1) / 2) & 1, 2, 1 - consumer, p);
      const int b_panels = sm90::mn_panels_in(p.n, tc.n0, kTileN);
      int prev_slot = -1;
      for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = int(it % uint32_t(S));
        mbar_wait(full(s), (it / uint32_t(S)) & 1, 0, s, p);
        if (tail != 0 && kb == k_blocks - 1) {
          // Clear the k-rows past the group (the next group's rows) in every loaded panel of the slot (A's
          // and B's, or B's only: the strip's A was cleared once above); then fence (generic stores -> the
          // tensor cores' async-proxy reads) and wait for the whole warpgroup's stores (header comment).
          if constexpr (kStrip)
            clear_tail_rows(tail, b_panels, tid, 0, 0, slot_b(s));
          else
            clear_tail_rows(tail, a_panels + b_panels, tid, slot_a(s), a_panels, slot_b(s));
          fence_async_shared();
          warpgroup_barrier(1 + consumer);
        }
        const uint32_t a_kblock = kStrip ? a_buffer(b) + uint32_t(kb) * kOperandBytes : slot_a(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk) {
          const uint64_t desc_b = mnmajor_swizzled_desc<kBK>(slot_b(s) + sm90::mn_kstep_offset(kk));
          const uint64_t desc_a0 = mnmajor_swizzled_desc<kBK>(a_kblock + sm90::mn_kstep_offset(kk));
          const uint64_t desc_a1 = mnmajor_swizzled_desc<kBK>(a_kblock + kPanelBytes + sm90::mn_kstep_offset(kk));
          const int scale = (kb > 0 || kk > 0) ? 1 : 0;
          Wgmma<kTileN>::mma<1, 1>(acc0, desc_a0, desc_b, scale);
          Wgmma<kTileN>::mma<1, 1>(acc1, desc_a1, desc_b, scale);
        }
        wgmma_commit();
        // Keep this k-block's products in flight; the previous one's are done, so its slot goes back.
        wgmma_wait<1>();
        if (prev_slot >= 0 && tid == 0) mbar_arrive(empty(prev_slot));
        prev_slot = s;
      }
      wgmma_wait<0>();
      // After wgmma_wait<0> (not after the issue, as CUTLASS does): thread 0's arrival then stands for all four
      // warps, because the last wgmma cannot complete before every warp issued it; arriving earlier lets a slow
      // warp see the barrier two phases ahead (hung in the review's model).
      if (tid == 0) {
        mbar_arrive(empty(prev_slot));
        mbar_arrive(mainloop_done(consumer));
      }
      if (kStrip && last_of_strip) {
        if (tid == 0) mbar_arrive(a_empty(b));  // the products have read the strip's A
        ++q;
        a_waited = false;
      }

      // Epilogue, straight from registers while the other consumer's products run. Accumulator fragment
      // (warp w, lane l) of an m64n128 product: rows 16w + l/4 (+ 8), and for each 8-column block j the
      // columns 8j + 2(l%4) + {0, 1}: every quad writes 32 contiguous bytes of one row.
      float* c_group = p.c + int64_t(tc.group) * p.c_stride;
      const int col_in = tc.n0 + 2 * (lane % 4);
      // 8-column blocks of this lane's pairs inside n (n is a multiple of 8: a pair is wholly in or out).
      const int cols_left = (p.n - tc.n0 + 7) / 8;
      // One m64 half of the tile (acc0: rows m0 + [0, 64), acc1: the next 64).
      auto write_half = [&](const float(&acc)[64], int mb) {
        const int row_base = tc.m0 + 64 * mb + 16 * warp + lane / 4;
        if constexpr (kMode == kLoadAdd) {
          // Old values in flight, then the sums: 16 pairs (one row) at a time while both halves'
          // accumulators are live (128 registers, ptxas's budget being 168 at 384 threads), both rows' 32
          // pairs at once for the second half, whose loads can take the first half's registers.
          auto rows_add = [&](auto halves) {
            constexpr int kHalves = decltype(halves)::value;
#pragma unroll
            for (int h0 = 0; h0 < 2; h0 += kHalves) {
              float2 old[kHalves][16];
#pragma unroll
              for (int hh = 0; hh < kHalves; ++hh) {
                const int row = row_base + 8 * (h0 + hh);
                const float2* src = reinterpret_cast<const float2*>(c_group + int64_t(row) * p.n + col_in);
                const int pairs = row < p.m ? cols_left : 0;  // 8-column blocks j < pairs are inside
#pragma unroll
                for (int j = 0; j < 16; ++j) old[hh][j] = j < pairs ? __ldcg(src + 4 * j) : make_float2(0.f, 0.f);
              }
#pragma unroll
              for (int hh = 0; hh < kHalves; ++hh) {
                const int half = h0 + hh, row = row_base + 8 * half;
                if (row >= p.m) continue;
                float2* dst = reinterpret_cast<float2*>(c_group + int64_t(row) * p.n + col_in);
#pragma unroll
                for (int j = 0; j < 16; ++j)
                  if (j < cols_left)
                    __stcs(dst + 4 * j, make_float2(old[hh][j].x + acc[4 * j + 2 * half],
                                                    old[hh][j].y + acc[4 * j + 2 * half + 1]));
              }
            }
          };
          if (mb == 0)
            rows_add(std::integral_constant<int, 1>{});
          else
            rows_add(std::integral_constant<int, 2>{});
        } else if constexpr (kMode == kStoreBf16) {
          // Each f32 pair rounded once to a bf16 pair (one 32-bit word), then the quad's words of four
          // consecutive 8-column blocks transposed (two xor steps, one shuffle per word): lane q then holds
          // block 4i + q's 8 columns and writes them as one 16-byte store, so a quad writes 64 contiguous bytes
          // (two whole 32-byte sectors) of a row per instruction. The pairs' own 4-byte stores (kStoreBf16Pairs)
          // left every sector half written by each instruction and ran at ~1 TB/s of output.
          __nv_bfloat16* b_group = p.c_bf16 + int64_t(tc.group) * p.c_stride;
          const int q = lane % 4;
          const bool hi = (q & 2) != 0, lo = (q & 1) != 0;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = row_base + 8 * half;
            // The row's first column of this quad's blocks (16-byte aligned: n % 8 == 0, c_stride % 8 == 0).
            __nv_bfloat16* dst_row = b_group + int64_t(row) * p.n + tc.n0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              uint32_t w[4];  // w[b]: this lane's word of block 4i + b
#pragma unroll
              for (int b = 0; b < 4; ++b) {
                const __nv_bfloat162 v =
                    __floats2bfloat162_rn(acc[4 * (4 * i + b) + 2 * half], acc[4 * (4 * i + b) + 2 * half + 1]);
                w[b] = *reinterpret_cast<const uint32_t*>(&v);
              }
              // Step 1 (partner q ^ 2): keep the two blocks whose bit 1 equals q's, swap the other two.
              uint32_t keep[2], got[2];  // keep[t] = (block (q & 2) + t, from q); got[t] = (same block, from q ^ 2)
#pragma unroll
              for (int t = 0; t < 2; ++t) {
                keep[t] = hi ? w[2 + t] : w[t];
                got[t] = __shfl_xor_sync(0xffffffffu, hi ? w[t] : w[2 + t], 2);
              }
              // Step 2 (partner q ^ 1): keep block q's two words, swap block q ^ 1's.
              const uint32_t own_k = lo ? keep[1] : keep[0], own_g = lo ? got[1] : got[0];
              const uint32_t in_k = __shfl_xor_sync(0xffffffffu, lo ? keep[0] : keep[1], 1);  // from q ^ 1
              const uint32_t in_g = __shfl_xor_sync(0xffffffffu, lo ? got[0] : got[1], 1);    // from q ^ 3
              // Block q's words by source lane s: s = q → own_k, q ^ 1 → in_k, q ^ 2 → own_g, q ^ 3 → in_g.
              uint32_t out[4];
#pragma unroll
              for (int s = 0; s < 4; ++s) {
                const int d = s ^ q;
                out[s] = d == 0 ? own_k : d == 1 ? in_k : d == 2 ? own_g : in_g;
              }
              const int block = 4 * i + q;  // shuffles above run in every lane; only the stores are guarded
              if (row < p.m && block < cols_left)
                __stcs(reinterpret_cast<uint4*>(dst_row + 8 * block), make_uint4(out[0], out[1], out[2], out[3]));
            }
          }
        } else if constexpr (kMode == kStoreBf16Pairs) {
          // Each f32 pair rounded once to a bf16 pair (4 bytes; a quad writes 16 contiguous bytes of a row).
          __nv_bfloat16* b_group = p.c_bf16 + int64_t(tc.group) * p.c_stride;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = row_base + 8 * half;
            if (row >= p.m) continue;
            __nv_bfloat16* dst = b_group + int64_t(row) * p.n + col_in;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              if (j >= cols_left) continue;
              __stcs(reinterpret_cast<__nv_bfloat162*>(dst + 8 * j),
                     __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]));
            }
          }
        } else {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int row = row_base + 8 * half;
            if (row >= p.m) continue;
            float* dst = c_group + int64_t(row) * p.n + col_in;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              if (j >= cols_left) continue;
              if constexpr (kMode == kRed)
                red_add_f32x2(dst + 8 * j, acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
              else
                __stcs(reinterpret_cast<float2*>(dst + 8 * j), make_float2(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]));
            }
          }
        }
      };
      write_half(acc0, 0);
      write_half(acc1, 1);
    }
  }
#endif  // DMOE_SM90A_DEVICE
}

// DMOE_SM90_WGRAD_ACCUMULATE=load (default) | red: how accumulate mode reads C (Sm90WgradTuning).
int accumulate_mode_from_env() {
  static const int mode = [] {
    return env_choice("DMOE_SM90_WGRAD_ACCUMULATE", {"load", "red"}, "load") == "red" ? int(kRed) : int(kLoadAdd);
  }();
  return mode;
}

template <int kMode, bool kStrip>
void launch(const CudaContext& ctx, const CUtensorMap& map_a, const CUtensorMap& map_b, const WgradSm90Params& p) {
  const auto kernel = grouped_wgrad_sm90_kernel<kMode, kStrip>;
  static SmemOptIn opt_in;
  // The strip schedule's size depends on the launch (its buffers and slots): opt in to the most it takes.
  opt_in.apply(kernel, kStrip ? kMaxSmem : kSmemBytes);
  const int bytes = kStrip ? strip_smem_bytes(p.res_kblocks, p.b_stages) : kSmemBytes;
  const int blocks = std::min(kStrip ? p.strips : p.tiles, device_info().sms);
  kernel<<<blocks, kThreads, bytes, ctx.stream>>>(map_a, map_b, p);
  DMOE_CHECK_LAUNCH();
}

template <bool kStrip>
void launch_mode(int mode, const CudaContext& ctx, const CUtensorMap& map_a, const CUtensorMap& map_b,
                 const WgradSm90Params& p) {
  switch (mode) {
    case kStore: return launch<kStore, kStrip>(ctx, map_a, map_b, p);
    case kLoadAdd: return launch<kLoadAdd, kStrip>(ctx, map_a, map_b, p);
    case kRed: return launch<kRed, kStrip>(ctx, map_a, map_b, p);
    case kStoreBf16Pairs: return launch<kStoreBf16Pairs, kStrip>(ctx, map_a, map_b, p);
    default: return launch<kStoreBf16, kStrip>(ctx, map_a, map_b, p);
  }
}

}  // namespace

bool sm90_grouped_wgrad_usable(const GroupedWgrad& g) {
  if (g.groups <= 0 || g.m <= 0 || g.n <= 0 || g.row_offsets == nullptr) return false;
  // TMA: row strides of a multiple of 16 bytes, 16-byte aligned bases; f32 pairs and 16-byte L2 prefetches
  // of C rows (n % 8, c_group_stride % 4).
  if (g.m % 8 != 0 || g.n % 8 != 0 || g.lda % 8 != 0 || g.ldb % 8 != 0 || g.lda < g.m || g.ldb < g.n) return false;
  if (g.c_group_stride % 4 != 0) return false;
  const void* c = g.c_bf16 != nullptr ? static_cast<const void*>(g.c_bf16) : static_cast<const void*>(g.c);
  if (!is_aligned(g.a, 16) || !is_aligned(g.b, 16) || !is_aligned(c, 16)) return false;
  if (g.c_bf16 != nullptr && g.accumulate) return false;  // bf16 C is stored, never added to
  if (g.c_bf16 != nullptr && g.c_group_stride % 8 != 0) return false;  // its 16-byte stores
  // TMA coordinates (rows of a and b, columns) and the tile fields are 32-bit.
  const int64_t first = std::min(g.a_first_row, g.b_first_row);
  if (g.row_offsets[g.groups] - first >= (int64_t(1) << 31) - kBK || g.m >= (int64_t(1) << 31) - kTileM ||
      g.n >= (int64_t(1) << 31) - kTileN)
    return false;
  const int64_t tiles_per_group = ((g.m + kTileM - 1) / kTileM) * ((g.n + kTileN - 1) / kTileN);
  if (tiles_per_group * g.groups >= (int64_t(1) << 31)) return false;
  return device_info().usable;
}

size_t sm90_grouped_wgrad_scratch_bytes(int32_t groups) {
  // row offsets (int64), the groups with rows (int32: the strip launch's, then the tile launch's), the two
  // launches' tile counters (int32)
  const size_t bytes = (size_t(groups) + 1) * sizeof(int64_t) + size_t(groups) * sizeof(int32_t) + 2 * sizeof(int32_t);
  return (bytes + 255) / 256 * 256;
}

void sm90_grouped_wgrad(const CudaContext& ctx, void* scratch, const GroupedWgrad& g, const Sm90WgradTuning& t) {
  if (!check_wgrad_call(g, "sm90_grouped_wgrad")) return;
  DMOE_CUDA_REQUIRE(t.accumulate >= 0 && t.accumulate <= 2,
                    "sm90_grouped_wgrad: accumulate = %d; allowed: 0 (default), 1 (load), 2 (red)", t.accumulate);
  DMOE_CUDA_REQUIRE(t.bf16_store == 0 || t.bf16_store == 1,
                    "sm90_grouped_wgrad: bf16_store = %d; allowed: 0 (16-byte stores), 1 (4-byte pairs)", t.bf16_store);
  DMOE_CUDA_REQUIRE(t.schedule == 0 || t.schedule == 1,
                    "sm90_grouped_wgrad: schedule = %d; allowed: 0 (strips where they fit), 1 (tiles only)", t.schedule);
  DMOE_CUDA_REQUIRE(sm90_grouped_wgrad_usable(g),
                    "sm90_grouped_wgrad: not usable here (needs an sm_90 GPU, a build for sm_90a, m, n, lda, ldb "
                    "multiples of 8 — m = %lld, n = %lld, lda = %lld, ldb = %lld — lda >= m, ldb >= n, 16-byte "
                    "aligned pointers and c_group_stride a multiple of 4 (of 8 for a bf16 C, which is stored, not accumulated)",
                    (long long)g.m, (long long)g.n, (long long)g.lda, (long long)g.ldb);
  // The groups with rows: those of at most kStripMaxKBlocks k-blocks take the strip schedule (unless tiles
  // are asked for), the longer ones the tile schedule, in a second launch; `active` holds the first list,
  // then the second.
  const int64_t m_tiles = (g.m + kTileM - 1) / kTileM, n_tiles = (g.n + kTileN - 1) / kTileN;
  const int64_t strip_len = std::min<int64_t>(n_tiles, kStripMaxLen), n_chunks = (n_tiles + strip_len - 1) / strip_len;
  std::vector<int32_t> active, long_groups;
  int64_t strip_rows = 0;  // the most rows of a group in the strip launch
  for (int32_t e = 0; e < g.groups; ++e) {
    const int64_t rows = g.row_offsets[e + 1] - g.row_offsets[e];
    if (rows <= 0) continue;
    if (t.schedule == 0 && rows <= int64_t(kStripMaxKBlocks) * kBK) {
      active.push_back(e);
      strip_rows = std::max(strip_rows, rows);
    } else {
      long_groups.push_back(e);
    }
  }
  // Tile indices of the strip launch (strip · strip_len + place) are 32-bit.
  if (int64_t(active.size()) * m_tiles * n_chunks * strip_len >= (int64_t(1) << 31)) {
    long_groups.insert(long_groups.end(), active.begin(), active.end());
    active.clear();
  }
  const int32_t strip_groups = int32_t(active.size());
  active.insert(active.end(), long_groups.begin(), long_groups.end());
  if (active.empty()) return;  // no rows: every C is left alone

  WgradSm90Params p{};
  p.m = int32_t(g.m);
  p.n = int32_t(g.n);
  p.n_tiles = int32_t(n_tiles);
  p.tiles_per_group = int32_t(m_tiles * n_tiles);
  p.c = g.c;
  p.c_bf16 = g.c_bf16;
  p.c_stride = g.c_group_stride;
  p.a_first = g.a_first_row;
  p.b_first = g.b_first_row;
  p.timeout_ns = wait_timeout_ns();
  p.wait_record = device_wait_record();

  char* ws = static_cast<char*>(scratch);
  const size_t offsets_bytes = (size_t(g.groups) + 1) * sizeof(int64_t);
  const size_t active_bytes = size_t(g.groups) * sizeof(int32_t);
  upload_async(ws, g.row_offsets, offsets_bytes, ctx.stream);
  upload_async(ws + offsets_bytes, active.data(), active.size() * sizeof(int32_t), ctx.stream);
  p.row_offsets = reinterpret_cast<const int64_t*>(ws);
  const int32_t* active_device = reinterpret_cast<const int32_t*>(ws + offsets_bytes);
  int32_t* counters = reinterpret_cast<int32_t*>(ws + offsets_bytes + active_bytes);
  DMOE_CHECK_CUDA(cudaMemsetAsync(counters, 0, 2 * sizeof(int32_t), ctx.stream));

  // Maps over the rows the groups use (from a's / b's row 0 to the last group's end): TMA reads zeros past
  // them, and past m / n.
  const int64_t end = g.row_offsets[g.groups];
  const CUtensorMap map_a = make_rowmajor_panel_map(g.a, end - g.a_first_row, g.m, g.lda, kBK);
  const CUtensorMap map_b = make_rowmajor_panel_map(g.b, end - g.b_first_row, g.n, g.ldb, kBK);
  const int mode = g.c_bf16 != nullptr ? int(t.bf16_store == 1 ? kStoreBf16Pairs : kStoreBf16)
                   : !g.accumulate     ? int(kStore)
                   : t.accumulate == 0 ? accumulate_mode_from_env()
                                       : t.accumulate;
  if (strip_groups > 0) {
    WgradSm90Params ps = p;
    ps.active = active_device;
    ps.tile_counter = counters;
    ps.strip_len = int32_t(strip_len);
    ps.n_chunks = int32_t(n_chunks);
    ps.strips_per_group = int32_t(m_tiles * n_chunks);
    ps.strips = ps.strips_per_group * strip_groups;
    ps.res_kblocks = int32_t((strip_rows + kBK - 1) / kBK);
    ps.b_stages = kStripMaxStages;
    while (ps.b_stages > kStripMinStages && strip_smem_bytes(ps.res_kblocks, ps.b_stages) > kMaxSmem) --ps.b_stages;
    ps.tiles = ps.strips * ps.strip_len;  // an upper bound of the tile indices (unused by the strip kernel)
    launch_mode<true>(mode, ctx, map_a, map_b, ps);
  }
  if (int32_t(active.size()) > strip_groups) {
    p.active = active_device + strip_groups;
    p.tile_counter = counters + 1;
    p.tiles = p.tiles_per_group * (int32_t(active.size()) - strip_groups);
    launch_mode<false>(mode, ctx, map_a, map_b, p);
  }
}

void grouped_wgrad(const GroupedWgrad& g, const CudaContext& ctx) {
  DMOE_CUDA_REQUIRE(ctx.workspace != nullptr, "grouped_wgrad: the context has no workspace");
  if (sm90_grouped_wgrad_usable(g)) {
    void* scratch = ctx.workspace->reserve(sm90_grouped_wgrad_scratch_bytes(g.groups), ctx.stream);
    return sm90_grouped_wgrad(ctx, scratch, g);
  }
  void* scratch = ctx.workspace->reserve(grouped_wgrad_scratch_bytes(std::max(g.groups, 0)), ctx.stream);
  grouped_wgrad(ctx, scratch, g);
}

}  // namespace dmoe::cuda
