// cuda/grouped_gemm_sm90.cu — dmoe's own grouped GEMM for Hopper (sm_90a), the expert FFN's forward
// products: for every group g (a local expert) C[r, :] = A[r, :] · B_g^T over the group's rows r, bf16
// in and out, fp32 accumulation. Its NN variant (GroupedGemmNN, same kernel template with kNN) computes
// the backward's input gradients C[r, :] = A[r, :] · B_g (+ A2[r, :] · B2_g) with B_g row-major [k, n]
// (MN-major for wgmma): B tiles are 64-column panels from a rank-3 map, read with transpose-B set
// (layout, descriptors and why they match: sm90_layout.hpp).
//
// Why: cuBLAS runs the experts' products one after another (or in a grouped call that behaves alike), and
// one product of a few hundred rows is only a handful of output tiles, so most of the 132 SMs idle
// (docs/perf.md: ~280 TFLOP/s on 64 experts of 256 rows). Here one persistent kernel walks the tiles of
// all groups, so every SM has work until the last tile — the tile scheduler Flash builds on.
//
// Structure (one CTA per SM, 384 threads):
//   warpgroup 0   producer: one thread issues TMA loads of A (BM×64) and B (BN×64) k-blocks into a ring
//                 of `stages` shared-memory slots, each guarded by a full/empty mbarrier pair;
//   warpgroups 1-2 consumers: each owns 64 of the BM = 128 rows of the tile, runs wgmma m64nBNk16 over
//                 the slots (operands K-major, 128-byte swizzle, as TMA wrote them), then stores its
//                 accumulators as bf16, masked to the group's rows and to N: by default straight from
//                 registers, the lanes of a quad trading words so that each writes 16 bytes; with
//                 DMOE_SM90_EPILOGUE=staged through shared memory and bulk stores (measured slower).
//                 A consumer whose 64 rows all lie past the group skips its products and stores.
// Tiles are numbered group by group, row tiles fastest within a column tile, so the CTAs running at the
// same time share A and B slices in L2. After the first wave each CTA's producer takes the next index from
// a global counter (one atomic per tile) and hands it to the consumers through a 2-entry mbarrier ring:
// tiles start in index order however the CTAs drift, which is what keeps those slices shared (with the
// static schedule, CTA b taking b, b + G, ..., drift made the fine-grained up projection read 1.64× its
// minimum DRAM bytes; DMOE_SM90_SCHEDULE=static keeps it for comparison). A group's last row tile reads rows of the next group (or TMA's
// zero fill past the end); those rows are computed and not stored. No padding is added in memory.
//
// Where the time goes (docs/perf.md, `dmoe bench gemm` with stages left out): on the fine-grained
// config's up projection the stores take ~20 % of the kernel; with the dynamic schedule it reads 1.05× its
// minimum DRAM bytes at ~2.4 TB/s (Nsight Compute), so it is no longer DRAM-bound.
// Measured and slower (git history): 2-CTA clusters sharing A by multicast, L2 prefetch by TMA or by a
// spare warp, 32-column k-blocks, two CTAs per SM, 256×128 tiles; the staged epilogue (opt-in).
//
// Every mbarrier wait has a time limit (DMOE_GPU_WAIT_TIMEOUT_MS, default 10 s): a wait that runs past it
// records which barrier, slot and phase it waited for (cuda/check.hpp) and traps; the CUDA error that
// follows carries that description, so a bug is an error, not a hang.
#include <cuda.h>  // CUtensorMap and its enums (types only; the driver function is looked up at run time)
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "core/env.hpp"
#include "cuda/activation.cuh"
#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"
#include "cuda/sm90_host.hpp"
#include "cuda/sm90_layout.hpp"
#include "cuda/sm90_primitives.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kBlockM = 128;        // rows per tile: two consumer warpgroups of 64
constexpr int kThreads = 384;       // producer warpgroup + two consumer warpgroups
constexpr int kConsumers = 2;
constexpr int kMaxSmem = 232448;    // dynamic shared memory one CTA may opt into on sm_90 (227 KiB)
// The producer hands each tile index to the consumers through a ring of kTileRing entries (index + full
// and empty mbarriers), so that tiles can come from a global counter (Sm90Tuning::schedule).
constexpr int kTileRing = 2;
constexpr int kTileRingBytes = kTileRing * (8 + 8 + 8);

// A k-block is BK = 64 columns (128-byte rows, 128-byte swizzle); the descriptor and map code also take
// BK = 32 (64-byte swizzle, twice the slots), measured slower and not instantiated.
// kStaged: the epilogue goes through a shared-memory staging tile and asynchronous bulk stores (one per
// row), so that the consumers start the next tile's products while the stores drain; it costs slots,
// which cost more than the overlap gained on H200 (8-13 % per GEMM, docs/perf.md): opt-in only.
template <int BN, int BK, bool kStaged>
struct TileConfig {
  static_assert(BK == 64 || BK == 32, "k-blocks of 64 or 32 columns");
  static constexpr int row_bytes = BK * 2;  // one swizzle row
  static constexpr int a_bytes = kBlockM * row_bytes;
  static constexpr int b_bytes = BN * row_bytes;
  static constexpr int stage_bytes = a_bytes + b_bytes;
  // staging: per consumer 64 rows of (at most) 128 output columns, unpadded — a tile's outputs leave in
  // chunks of 128 columns, and 32 KiB in all leaves room for 4 slots of a 128×256 tile
  static constexpr int staging_cols = BN < 128 ? BN : 128;
  static constexpr int staging_row_bytes = staging_cols * 2;
  static constexpr int staging_bytes = kStaged ? kConsumers * 64 * staging_row_bytes : 0;
  // As many slots as fit beside the staging tile, the barriers and 1 KiB to align the slots to the
  // swizzle atom (at most 16).
  static constexpr int stages_fit = (kMaxSmem - 1024 - staging_bytes - 16 * 16 - kTileRingBytes) / stage_bytes;
  static constexpr int stages = stages_fit < 16 ? stages_fit : 16;
  static constexpr int smem_bytes = stages * stage_bytes + staging_bytes + 2 * stages * 8 + kTileRingBytes + 1024;
  static_assert(stages >= 2 && smem_bytes <= kMaxSmem, "tile does not fit in shared memory");
};

struct Sm90Params {
  const int64_t* row_offsets;   // [groups + 1] rows of A and C, from A's row 0
  const int32_t* tile_offsets;  // [groups + 1] first tile of each group
  __nv_bfloat16* c;
  __nv_bfloat16* c2;            // fused SwiGLU: the up half (pre3)
  __nv_bfloat16* h;             // fused activation output
  int64_t n, k;                 // NN: k per part (a second part, A2·B2, has the same k)
  int32_t groups;
  int32_t k_parts;              // NN: 2 = C = A·B + A2·B2 (both parts' k-blocks in one accumulation), else 1
  int32_t tiles;                // the tiles, or (tiles_on_device) a bound on them that sized the grid
  const int32_t* tiles_on_device;  // null, or the tiles as counted on the device (offsets in device memory)
  int32_t n_tiles;              // column tiles per group
  int32_t leave_out;            // measurement aid (Sm90Tuning::leave_out): 1 no stores, 2 no products either
  uint32_t skip_lag_ns;         // test aid (Sm90Tuning::skip_lag_ns): 0 in every real call
  int32_t* tile_counter;        // kDynamic: the next tiles' counter, zeroed before the launch
  unsigned long long timeout_ns;
  DeviceWaitRecord* wait_record;  // host-mapped; written only when a wait times out
};

#ifdef DMOE_SM90A_DEVICE

// The shared bounded wait (sm90_primitives.cuh) with this kernel's time limit and record.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity, int what, int slot, const Sm90Params& p) {
  mbar_wait(bar, parity, what, slot, p.timeout_ns, p.wait_record, kWaitSm90GroupedGemm);
}

// The group of tile t (tile_offsets is non-decreasing; groups without rows own no tiles).
__device__ __forceinline__ int find_group(const int32_t* tile_offsets, int32_t groups, int32_t t) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(tile_offsets + mid) <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// 32-bit rows (sm90_grouped_gemm_usable bounds the total below 2^31): the fields live through the whole
// tile, and the fused SwiGLU consumer at 256 columns is at ptxas's register limit.
struct TileCoord {
  int32_t row_begin;  // the group's first row
  int32_t rows;       // the group's rows
  int32_t group, m_tile, n_tile;
};

__device__ __forceinline__ TileCoord decode_tile(const Sm90Params& p, int32_t t) {
  TileCoord tc;
  tc.group = find_group(p.tile_offsets, p.groups, t);
  tc.row_begin = int32_t(__ldg(p.row_offsets + tc.group));
  tc.rows = int32_t(__ldg(p.row_offsets + tc.group + 1)) - tc.row_begin;
  const int32_t m_tiles = (tc.rows + kBlockM - 1) / kBlockM;
  const int32_t local = t - __ldg(p.tile_offsets + tc.group);
  tc.m_tile = local % m_tiles;
  tc.n_tile = local / m_tiles;
  return tc;
}

#endif  // DMOE_SM90A_DEVICE

// kNN: B is MN-major (GroupedGemmNN: C = A·B_g with B_g row-major [k, n]); its tiles are BN/64 panels of
// 64 columns × BK k-rows, loaded by a rank-3 map [groups, k, n] and read by wgmma with transpose-B set
// (layout and descriptor in sm90_layout.hpp). With k_parts = 2 the producer runs the k-blocks of A·B, then
// those of A2·B2 (map_a2, map_b2) into the same slots; the consumers see one longer reduction.
// kFuse: the epilogue also applies the activation A and writes h (GroupedGemmNT). For SwiGLU a tile's BN
// columns are BN/2 columns of the gate product (B = w1, rows from map_b) followed by the same BN/2 columns
// of the up product (w3, map_b2), so one thread holds both halves of each h element.
// kDynamic: tiles after the first wave come from a global counter through the tile ring (see the producer);
// the static schedule (CTA b takes b, b + G, ...) is a separate instantiation without the ring.
template <int BN, int BK, bool kFuse, Activation A, bool kStaged, bool kDynamic, bool kNN = false>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                             const __grid_constant__ CUtensorMap map_b2, const __grid_constant__ CUtensorMap map_a2,
                             const __grid_constant__ Sm90Params p) {
#ifdef DMOE_SM90A_DEVICE
  static_assert(!kNN || (!kFuse && BK == 64), "NN: no fused activation; k-blocks of 64 rows (128-byte panels)");
  constexpr bool kGated = kFuse && A == Activation::swiglu;
  constexpr int kOutN = kGated ? BN / 2 : BN;  // output columns per tile
  using Cfg = TileConfig<BN, BK, kStaged>;
  constexpr int S = Cfg::stages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t slots = smem_u32(smem);
  const uint32_t staging = slots + S * Cfg::stage_bytes;
  const uint32_t bars = staging + Cfg::staging_bytes;  // full[S], empty[S], tile_full[R], tile_empty[R], ring
  auto slot_a = [&](int s) { return slots + s * Cfg::stage_bytes; };
  auto slot_b = [&](int s) { return slots + s * Cfg::stage_bytes + Cfg::a_bytes; };
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (S + s); };
  auto tile_full = [&](int r) { return bars + 8 * (2 * S + r); };
  auto tile_empty = [&](int r) { return bars + 8 * (2 * S + kTileRing + r); };
  // The ring's indices, by shared-space address (a 32-bit register, not a 64-bit generic pointer: the fused
  // SwiGLU consumer at 256 columns has no registers to spare).
  const uint32_t tile_ring = bars + 8 * (2 * S + 2 * kTileRing);

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), kConsumers);
    }
    if constexpr (kDynamic)
      for (int r = 0; r < kTileRing; ++r) {
        mbar_init(tile_full(r), 1);
        mbar_init(tile_empty(r), kConsumers * 128);  // every consumer thread reads the index, then arrives
      }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  const int32_t k_blocks_part = int32_t((p.k + BK - 1) / BK);
  const int32_t k_blocks = kNN ? k_blocks_part * p.k_parts : k_blocks_part;

  if (warpgroup == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_a)) : "memory");
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_b)) : "memory");
      if constexpr (kGated)
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_b2)) : "memory");
      if (kNN && p.k_parts == 2) {
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_a2)) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&map_b2)) : "memory");
      }
      uint32_t it = 0;
      // The tile sequence: the first tile is blockIdx.x; then the static schedule adds gridDim.x, the
      // dynamic one takes the next index from the global counter, so that tiles start in index order
      // however the CTAs drift, and the tiles sharing an expert's rows or a weight slice (neighbouring
      // indices) stay close in time (bench/l2_tile_sim.py, docs/perf.md). Each index goes to the
      // consumers through the tile ring; -1 ends the sequence.
      const int32_t tiles = p.tiles_on_device ? __ldg(p.tiles_on_device) : p.tiles;
      int32_t next = int32_t(blockIdx.x);
      for (uint32_t i = 0;; ++i) {
        const int32_t t = next < tiles ? next : -1;
        if constexpr (kDynamic) {
          const int r = int(i % kTileRing);
          mbar_wait(tile_empty(r), ((i / kTileRing) & 1) ^ 1, 4, r, p);
          st_shared_volatile(tile_ring + 4 * r, t);
          mbar_arrive(tile_full(r));
          // Fetched before this tile's loads, so that the atomic's latency hides behind them.
          if (t >= 0) next = int32_t(gridDim.x) + atomicAdd(p.tile_counter, 1);
        } else {
          next = t + int32_t(gridDim.x);
        }
        if (t < 0) break;
        const TileCoord tc = decode_tile(p, t);
        const int32_t a_row = tc.row_begin + tc.m_tile * kBlockM;
        const int32_t b_row = int32_t(int64_t(tc.group) * p.n + int64_t(tc.n_tile) * kOutN);
        // NN: B panels holding columns below n (sm90::mn_panels_in; all BN/64 but in a last column tile).
        [[maybe_unused]] const int32_t col0 = tc.n_tile * BN;
        [[maybe_unused]] const int panels = kNN ? sm90::mn_panels_in(p.n, col0, BN) : 0;
        for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = int(it % S);
          const uint32_t phase = (it / S) & 1;
          mbar_wait(empty(s), phase ^ 1, 1, s, p);
          if constexpr (kNN) {
            // The part's maps and its k-block; B as the panels of one group's [BK k-rows, 64 columns].
            const bool second = kb >= k_blocks_part;
            const int32_t kl = second ? kb - k_blocks_part : kb;
            mbar_expect_tx(full(s), Cfg::a_bytes + panels * sm90::mn_panel_bytes(BK));
            tma_load_2d(slot_a(s), second ? &map_a2 : &map_a, kl * BK, a_row, full(s));
#pragma unroll
            for (int j = 0; j < BN / sm90::kMnPanelCols; ++j)
              if (j < panels)
                tma_load_3d(slot_b(s) + sm90::mn_panel_offset(j, BK), second ? &map_b2 : &map_b,
                            col0 + j * sm90::kMnPanelCols, kl * BK, tc.group, full(s));
          } else {
            mbar_expect_tx(full(s), Cfg::stage_bytes);
            tma_load_2d(slot_a(s), &map_a, kb * BK, a_row, full(s));
            tma_load_2d(slot_b(s), &map_b, kb * BK, b_row, full(s));
            if constexpr (kGated) tma_load_2d(slot_b(s) + kOutN * Cfg::row_bytes, &map_b2, kb * BK, b_row, full(s));
          }
        }
      }
    }
  } else {
    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int consumer = warpgroup - 1;
    const int warp = (threadIdx.x / 32) % 4;
    const int lane = threadIdx.x % 32;
    float acc[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
    uint32_t it = 0;
    for (uint32_t i = 0;; ++i) {
      int32_t t;
      if constexpr (kDynamic) {
        const int r = int(i % kTileRing);
        mbar_wait(tile_full(r), (i / kTileRing) & 1, 3, r, p);
        t = ld_shared_volatile(tile_ring + 4 * r);
        mbar_arrive(tile_empty(r));
        if (t < 0) break;
      } else {
        t = int32_t(blockIdx.x + i * gridDim.x);
        if (t >= (p.tiles_on_device ? __ldg(p.tiles_on_device) : p.tiles)) break;
      }
      const TileCoord tc = decode_tile(p, t);
      // A group's last row tile often holds 64 rows or fewer (experts of ~256 rows: about half of them
      // end with such a tile); the second warpgroup's rows are then all past the group, so it skips its
      // products and stores and only hands the slots back.
      if (tc.m_tile * kBlockM + consumer * 64 >= tc.rows || p.leave_out == 2) {
        for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = int(it % S);
          if (p.skip_lag_ns != 0 && warp != 0) __nanosleep(p.skip_lag_ns);  // test aid: a late warp
          // Waiting for the slot to be full first keeps the empty barrier's arrivals in step with the
          // other consumer's (one arrival per filling of the slot).
          mbar_wait(full(s), (it / S) & 1, 0, s, p);
          // Thread 0's one arrival stands for all four warps, so all four must have seen this fill before
          // the slot can be refilled: no wgmma ties the warps together here, and a warp left behind by two
          // fills of a slot waits on a parity that repeats — a phase late — and the next tile's wgmma then
          // hangs the warpgroup (the wait report of faults.md; the lagged test in test_own_gemm.cpp).
          warpgroup_barrier(1 + consumer);
          if (threadIdx.x % 128 == 0) mbar_arrive(empty(s));
        }
        continue;
      }
      int prev_slot = -1;
      for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = int(it % S);
        const uint32_t phase = (it / S) & 1;
        mbar_wait(full(s), phase, 0, s, p);
        const uint32_t a_base = slot_a(s) + consumer * 64 * Cfg::row_bytes;  // this warpgroup's 64 rows
        const uint32_t b_base = slot_b(s);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
          const uint64_t desc_a = kmajor_swizzled_desc<Cfg::row_bytes>(a_base + sm90::kmajor_kstep_offset(kk));
          if constexpr (kNN)
            Wgmma<BN>::template mma<1>(acc, desc_a, mnmajor_swizzled_desc<BK>(b_base + sm90::mn_kstep_offset(kk)),
                                       (kb > 0 || kk > 0) ? 1 : 0);
          else
            Wgmma<BN>::mma(acc, desc_a, kmajor_swizzled_desc<Cfg::row_bytes>(b_base + sm90::kmajor_kstep_offset(kk)),
                           (kb > 0 || kk > 0) ? 1 : 0);
        }
        wgmma_commit();
        // Keep this k-block's products in flight; the previous one is done, so its slot goes back.
        wgmma_wait<1>();
        if (prev_slot >= 0 && threadIdx.x % 128 == 0) mbar_arrive(empty(prev_slot));
        prev_slot = s;
      }
      wgmma_wait<0>();
      if (prev_slot >= 0 && threadIdx.x % 128 == 0) mbar_arrive(empty(prev_slot));

      if (p.leave_out != 0) continue;

      if constexpr (kStaged) {
        // Staged epilogue, one chunk of (at most) 128 columns of one output matrix at a time: wait until
        // this warpgroup's previous bulk stores have read the staging tile, write the fragments into it,
        // then one lane per row sends the row; the next tile's products start while the stores drain.
        constexpr int kChunk = kOutN < Cfg::staging_cols ? kOutN : Cfg::staging_cols;  // columns per chunk
        const int tid = threadIdx.x % 128;
        const uint32_t stage_base = staging + consumer * 64 * Cfg::staging_row_bytes;
        uint8_t* stage_ptr = smem + (stage_base - slots);
        const int64_t col_tile = int64_t(tc.n_tile) * kOutN;
        const int64_t first_row = int64_t(tc.m_tile) * kBlockM + consumer * 64;  // in the group
        const int q = lane % 4;
        // With a fused activation, h is computed from the stored (bf16-rounded) pre-activations, as the
        // activation kernel computes it: round the accumulators in place once, so that every output below
        // reads only them (nothing else stays live across the outputs).
        if constexpr (kFuse) {
#pragma unroll
          for (int i = 0; i < BN / 2; ++i) acc[i] = __bfloat162float(__float2bfloat16_rn(acc[i]));
        }
        // One chunk of one output matrix: 0 = C, 1 = h, 2 = C2 (SwiGLU's up product).
        auto emit = [&](auto which, auto chunk) {
          constexpr int o = decltype(which)::value, c = decltype(chunk)::value;
          if ((o == 0 && p.c == nullptr) || (o == 2 && p.c2 == nullptr)) return;  // not kept (uniform)
          const int64_t col0 = col_tile + c * kChunk;
          if (col0 >= p.n) return;  // (uniform)
          bulk_wait_read();
          warpgroup_barrier(1 + consumer);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int local_row = warp * 16 + lane / 4 + 8 * half;
#pragma unroll
            for (int jc = 0; jc < kChunk / 32; ++jc) {
              const int jq = c * (kChunk / 32) + jc;
              uint32_t w[4];
#pragma unroll
              for (int i = 0; i < 4; ++i) {
                const int j = 4 * jq + i;
                const int ju = j + kOutN / 8;  // SwiGLU: the up product's block for the same columns
                const float a0 = acc[4 * j + 2 * half], a1 = acc[4 * j + 2 * half + 1];
                if constexpr (o == 0) {
                  w[i] = bf162_bits(__floats2bfloat162_rn(a0, a1));
                } else if constexpr (o == 2) {
                  w[i] = bf162_bits(__floats2bfloat162_rn(acc[4 * ju + 2 * half], acc[4 * ju + 2 * half + 1]));
                } else {
                  float h0 = act_value<A>(a0), h1 = act_value<A>(a1);
                  if constexpr (kGated) {
                    h0 *= acc[4 * ju + 2 * half];
                    h1 *= acc[4 * ju + 2 * half + 1];
                  }
                  w[i] = bf162_bits(__floats2bfloat162_rn(h0, h1));
                }
              }
              const uint4 words = quad_transpose(w, q);
              *reinterpret_cast<uint4*>(stage_ptr + local_row * Cfg::staging_row_bytes + 16 * (4 * jc + q)) = words;
            }
          }
          fence_async_shared();
          warpgroup_barrier(1 + consumer);
          if (tid < 64 && first_row + tid < tc.rows) {
            __nv_bfloat16* out = o == 0 ? p.c : o == 1 ? p.h : p.c2;
            const uint32_t bytes = uint32_t(min(int64_t(kChunk), p.n - col0)) * 2;
            bulk_store(out + (int64_t(tc.row_begin) + first_row + tid) * p.n + col0, stage_base + tid * Cfg::staging_row_bytes,
                       bytes);
          }
          bulk_commit();
        };
        auto emit_all = [&](auto which) {
          emit(which, std::integral_constant<int, 0>{});
          if constexpr (kOutN > kChunk) emit(which, std::integral_constant<int, 1>{});
        };
        static_assert(kOutN <= 2 * kChunk, "at most two chunks per output");
        emit_all(std::integral_constant<int, 0>{});
        if constexpr (kFuse) emit_all(std::integral_constant<int, 1>{});
        if constexpr (kGated) emit_all(std::integral_constant<int, 2>{});
        continue;
      }

      // Epilogue: accumulator fragment (warp w, lane l) holds rows 16w + l/4 (+8) and, for every 8-column
      // block j, columns 8j + 2(l%4) + {0, 1}. The four lanes of a quad trade words (quad_transpose) so
      // that each stores one whole block: 16-byte stores, 64 contiguous bytes per quad.
      const int32_t row_in_group = tc.m_tile * kBlockM + consumer * 64 + warp * 16 + lane / 4;
      const int q = lane % 4;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int32_t r = row_in_group + 8 * half;
        const bool row_ok = r < tc.rows;  // the shuffles below need every lane, so only stores are masked
        const int64_t row = int64_t(tc.row_begin + r) * p.n;
#pragma unroll
        for (int jq = 0; jq < kOutN / 32; ++jq) {
          uint32_t wc[4], wh[4], wu[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int j = 4 * jq + i;
            const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
            wc[i] = bf162_bits(v);
            if constexpr (kFuse) {
              // h from the stored (rounded) pre-activations, as the separate activation kernel computes it.
              float h0 = act_value<A>(__low2float(v)), h1 = act_value<A>(__high2float(v));
              if constexpr (kGated) {
                const int ju = j + kOutN / 8;  // the up product's block for the same columns
                const __nv_bfloat162 u =
                    __floats2bfloat162_rn(acc[4 * ju + 2 * half], acc[4 * ju + 2 * half + 1]);
                wu[i] = bf162_bits(u);
                h0 *= __low2float(u);
                h1 *= __high2float(u);
              }
              wh[i] = bf162_bits(__floats2bfloat162_rn(h0, h1));
            }
          }
          const int64_t col = int64_t(tc.n_tile) * kOutN + 8 * (4 * jq + q);
          const bool ok = row_ok && col < p.n;  // n is a multiple of 8: a block is all in or all out
          // With a fused activation the pre-activations are stored only when kept for the backward
          // pass (c, c2 non-null); the test is uniform over the kernel, so the shuffles stay converged.
          if (!kFuse || p.c != nullptr) {
            const uint4 oc = quad_transpose(wc, q);
            if (ok) *reinterpret_cast<uint4*>(p.c + row + col) = oc;
          }
          if constexpr (kFuse) {
            const uint4 oh = quad_transpose(wh, q);
            if (ok) *reinterpret_cast<uint4*>(p.h + row + col) = oh;
          }
          if constexpr (kGated) {
            if (p.c2 != nullptr) {
              const uint4 ou = quad_transpose(wu, q);
              if (ok) *reinterpret_cast<uint4*>(p.c2 + row + col) = ou;
            }
          }
        }
      }
    }
    if constexpr (kStaged) bulk_wait_all();  // the staging tile must outlive its stores
  }
#endif  // DMOE_SM90A_DEVICE
}

// Whether this build carries the sm_90a kernel body (the file may also be built for other targets, where
// the kernel is empty); answered by the device itself.
__global__ void sm90a_probe_kernel(int* built) {
#ifdef DMOE_SM90A_DEVICE
  *built = 1;
#else
  *built = 0;
#endif
}

int column_tile() {
  static const int bn = [] {
    // 256 by default: faster than 128 on all four named configs (docs/perf.md). core/env.hpp reads it.
    return env_choice("DMOE_SM90_BLOCK_N", {"128", "256"}, "256") == "128" ? 128 : 256;
  }();
  return bn;
}

// The tile table of a call whose row offsets are in device memory (GroupedGemmNT::offsets_on_device): one
// thread walks the groups (E <= a few hundred: microseconds), clipping the offsets into [0, rows] so that no
// tile reaches outside the operands whatever the offsets hold. The twin of cpu::grouped_tile_table.
__global__ void grouped_tile_table_kernel(const int64_t* row_offsets, int32_t groups, int64_t rows, int32_t n_tiles,
                                          int32_t block_m, int64_t* clipped, int32_t* tile_offsets, int32_t* tiles) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t prev = 0, tile = 0;
  clipped[0] = 0;
  tile_offsets[0] = 0;
  for (int32_t g = 0; g < groups; ++g) {
    int64_t end = row_offsets[g + 1];
    end = end < prev ? prev : end > rows ? rows : end;
    tile += (end - prev + block_m - 1) / block_m * n_tiles;
    clipped[g + 1] = end;
    tile_offsets[g + 1] = int32_t(tile);
    prev = end;
  }
  *tiles = int32_t(tile);
}

// At most this many tiles for `rows` rows in `groups` groups, however they split: every non-empty group adds
// less than one row tile of rounding.
int64_t tile_bound(int64_t rows, int32_t groups, int32_t n_tiles) {
  const int64_t nonempty = std::min<int64_t>(groups, rows);
  return (rows + nonempty * (kBlockM - 1)) / kBlockM * n_tiles;
}

// The tile table of a call (tiles numbered group by group, row tiles fastest), uploaded into the scratch
// with the row offsets, and the parameters every instantiation shares. Returns the number of tiles (0:
// nothing to launch); with offsets in device memory, a bound on them (the device counts the tiles).
int32_t prepare_tiles(const CudaContext& ctx, void* scratch, const int64_t* row_offsets, bool offsets_on_device,
                      int64_t device_rows, int32_t groups, int64_t n, int64_t k, int out_n, bool dynamic,
                      const Sm90Tuning& aids, Sm90Params& p) {
  const int32_t n_tiles = int32_t((n + out_n - 1) / out_n);
  char* ws = static_cast<char*>(scratch);
  const size_t offsets_bytes = (size_t(groups) + 1) * sizeof(int64_t);
  const size_t tile_offsets_bytes = (size_t(groups) + 1) * sizeof(int32_t);
  int32_t tiles = 0;
  if (offsets_on_device) {
    const int64_t bound = tile_bound(device_rows, groups, n_tiles);
    DMOE_CUDA_REQUIRE(bound < (int64_t(1) << 31), "sm90_grouped_gemm: up to %lld tiles (%d groups, %lld rows, "
                      "n = %lld); at most 2^31 - 1: split the call", (long long)bound, groups,
                      (long long)device_rows, (long long)n);
    tiles = int32_t(bound);
    if (tiles == 0) return 0;
    grouped_tile_table_kernel<<<1, 32, 0, ctx.stream>>>(
        row_offsets, groups, device_rows, n_tiles, kBlockM, reinterpret_cast<int64_t*>(ws),
        reinterpret_cast<int32_t*>(ws + offsets_bytes),
        reinterpret_cast<int32_t*>(ws + offsets_bytes + tile_offsets_bytes + sizeof(int32_t)));
    DMOE_CHECK_LAUNCH();
  } else {
    std::vector<int32_t> tile_offsets(size_t(groups) + 1, 0);
    for (int32_t e = 0; e < groups; ++e) {
      const int64_t rows = row_offsets[e + 1] - row_offsets[e];
      const int64_t next = int64_t(tile_offsets[e]) + (rows + kBlockM - 1) / kBlockM * int64_t(n_tiles);
      DMOE_CUDA_REQUIRE(next < (int64_t(1) << 31), "sm90_grouped_gemm: more than 2^31 - 1 tiles (%d groups, "
                        "%lld rows, n = %lld); split the call", groups, (long long)row_offsets[groups],
                        (long long)n);
      tile_offsets[e + 1] = int32_t(next);
    }
    tiles = tile_offsets[groups];
    if (tiles == 0) return 0;
    upload_async(ws, row_offsets, offsets_bytes, ctx.stream);
    upload_async(ws + offsets_bytes, tile_offsets.data(), tile_offsets.size() * sizeof(int32_t), ctx.stream);
  }
  const size_t counter_offset = offsets_bytes + tile_offsets_bytes;  // 4-byte aligned

  p = Sm90Params{};
  p.row_offsets = reinterpret_cast<const int64_t*>(ws);
  p.tile_offsets = reinterpret_cast<const int32_t*>(ws + offsets_bytes);
  p.n = n;
  p.k = k;
  p.groups = groups;
  p.k_parts = 1;
  p.tiles = tiles;
  p.tiles_on_device = offsets_on_device ? reinterpret_cast<const int32_t*>(ws + counter_offset + sizeof(int32_t)) : nullptr;
  p.n_tiles = n_tiles;
  p.leave_out = aids.leave_out;
  p.skip_lag_ns = aids.skip_lag_ns;
  p.tile_counter = reinterpret_cast<int32_t*>(ws + counter_offset);
  if (dynamic) DMOE_CHECK_CUDA(cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), ctx.stream));
  p.timeout_ns = wait_timeout_ns();
  p.wait_record = device_wait_record();
  return tiles;
}

template <int BN, int BK, bool kFuse, Activation A, bool kStaged, bool kDynamic>
void launch(const CudaContext& ctx, void* scratch, const GroupedGemmNT& g, const Sm90Tuning& aids) {
  using Cfg = TileConfig<BN, BK, kStaged>;
  const auto kernel = grouped_gemm_sm90_kernel<BN, BK, kFuse, A, kStaged, kDynamic>;
  constexpr bool kGated = kFuse && A == Activation::swiglu;
  constexpr int kOutN = kGated ? BN / 2 : BN;
  Sm90Params p;
  const int32_t tiles = prepare_tiles(ctx, scratch, g.row_offsets, g.offsets_on_device, g.rows, g.groups, g.n, g.k,
                                      kOutN, kDynamic, aids, p);
  if (tiles == 0) return;

  const int64_t rows_total = g.offsets_on_device ? g.rows : g.row_offsets[g.groups];
  const CUtensorMap map_a = make_kmajor_map(g.a, rows_total, g.k, kBlockM, BK);
  const CUtensorMap map_b = make_kmajor_map(g.b, int64_t(g.groups) * g.n, g.k, kOutN, BK);
  const CUtensorMap map_b2 = kGated ? make_kmajor_map(g.b2, int64_t(g.groups) * g.n, g.k, kOutN, BK) : map_b;
  p.c = g.c;
  p.c2 = g.c2;
  p.h = g.h;

  static SmemOptIn opt_in;
  opt_in.apply(kernel, Cfg::smem_bytes);
  const int blocks = std::min(tiles, device_info().sms);
  kernel<<<blocks, kThreads, Cfg::smem_bytes, ctx.stream>>>(map_a, map_b, map_b2, map_a, p);
  DMOE_CHECK_LAUNCH();
}

// The NN product (GroupedGemmNN): direct epilogue only, BK = 64.
template <int BN, bool kDynamic>
void launch_nn(const CudaContext& ctx, void* scratch, const GroupedGemmNN& g, const Sm90Tuning& aids) {
  constexpr int BK = 64;
  using Cfg = TileConfig<BN, BK, false>;
  const auto kernel = grouped_gemm_sm90_kernel<BN, BK, false, Activation::relu, false, kDynamic, true>;
  Sm90Params p;
  const int32_t tiles =
      prepare_tiles(ctx, scratch, g.row_offsets, false, 0, g.groups, g.n, g.k, BN, kDynamic, aids, p);
  if (tiles == 0) return;

  const bool two = g.a2 != nullptr;
  const int64_t rows_total = g.row_offsets[g.groups];
  const CUtensorMap map_a = make_kmajor_map(g.a, rows_total, g.k, kBlockM, BK);
  const CUtensorMap map_b = make_mnmajor_map(g.b, g.groups, g.k, g.n, BK);
  const CUtensorMap map_a2 = two ? make_kmajor_map(g.a2, rows_total, g.k, kBlockM, BK) : map_a;
  const CUtensorMap map_b2 = two ? make_mnmajor_map(g.b2, g.groups, g.k, g.n, BK) : map_b;
  p.c = g.c;
  p.k_parts = two ? 2 : 1;

  static SmemOptIn opt_in;
  opt_in.apply(kernel, Cfg::smem_bytes);
  const int blocks = std::min(tiles, device_info().sms);
  kernel<<<blocks, kThreads, Cfg::smem_bytes, ctx.stream>>>(map_a, map_b, map_b2, map_a2, p);
  DMOE_CHECK_LAUNCH();
}

template <int BN, int BK, bool kStaged, bool kDynamic>
void launch_for(const CudaContext& ctx, void* scratch, const GroupedGemmNT& g, const Sm90Tuning& lo) {
  if (g.h == nullptr) return launch<BN, BK, false, Activation::relu, kStaged, kDynamic>(ctx, scratch, g, lo);
  switch (g.activation) {
    case Activation::relu:
      return launch<BN, BK, true, Activation::relu, kStaged, kDynamic>(ctx, scratch, g, lo);
    case Activation::gelu:
      return launch<BN, BK, true, Activation::gelu, kStaged, kDynamic>(ctx, scratch, g, lo);
    case Activation::swiglu:
      return launch<BN, BK, true, Activation::swiglu, kStaged, kDynamic>(ctx, scratch, g, lo);
  }
}

// DMOE_SM90_SCHEDULE=dynamic (default) | static: how CTAs get their tiles after the first wave. Measured on
// the H200 (docs/perf.md, fourth session): dynamic cut the fine-grained up projection's DRAM reads from
// 1.55 to 0.99 GB (minimum 0.94) and its time 460 -> 408 µs; no config was slower.
bool dynamic_schedule() {
  static const bool dynamic = [] {
    return env_choice("DMOE_SM90_SCHEDULE", {"dynamic", "static"}, "dynamic") == "dynamic";
  }();
  return dynamic;
}

// DMOE_SM90_EPILOGUE=direct (default) | staged: how tiles are written (see TileConfig). Measured on H200
// (docs/perf.md, 2026-11-29): staged is 8-13 % slower per GEMM (fine-grained up 548 vs 484 µs, down 280 vs
// 258 µs): the slot it costs (3 instead of 4 at 256 columns) hurts the main loop more than the overlapped
// stores gain, and the outputs of a fused tile go out one after another through the one staging tile.
bool staged_epilogue() {
  static const bool staged = [] {
    return env_choice("DMOE_SM90_EPILOGUE", {"direct", "staged"}, "direct") == "staged";
  }();
  return staged;
}

}  // namespace

static PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    DMOE_CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q));
    DMOE_CUDA_REQUIRE(q == cudaDriverEntryPointSuccess && f != nullptr,
                      "cuTensorMapEncodeTiled not found in the CUDA driver (needs a CUDA 12+ driver)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// Encodes a map from its parameters (sm90_layout.hpp, where the host unit test checks them).
static CUtensorMap encode_map(const void* base, const sm90::TmaSpec& spec, const char* what) {
  CUtensorMap map;
  cuuint64_t dims[3];
  cuuint64_t strides[2];
  cuuint32_t box[3];
  const cuuint32_t element_strides[3] = {1, 1, 1};
  for (int i = 0; i < spec.rank; ++i) {
    dims[i] = spec.dims[i];
    box[i] = spec.box[i];
    if (i + 1 < spec.rank) strides[i] = spec.strides[i];
  }
  const CUtensorMapSwizzle swizzle = spec.swizzle_bytes == 128 ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : spec.swizzle_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                                : CU_TENSOR_MAP_SWIZZLE_32B;
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, cuuint32_t(spec.rank),
                                          const_cast<void*>(base), dims, strides, box, element_strides,
                                          CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  DMOE_CUDA_REQUIRE(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed (error %d) for %s [%llu, %llu, %llu] bf16",
                    int(r), what, (unsigned long long)spec.dims[2], (unsigned long long)spec.dims[1],
                    (unsigned long long)spec.dims[0]);
  return map;
}

CUtensorMap make_kmajor_map(const void* base, int64_t rows, int64_t k, int box_rows, int box_k) {
  return encode_map(base, sm90::kmajor_spec(rows, k, box_rows, box_k), "a K-major matrix");
}

CUtensorMap make_mnmajor_map(const void* base, int32_t groups, int64_t k, int64_t n, int box_k) {
  return encode_map(base, sm90::mnmajor_spec(groups, k, n, box_k), "MN-major matrices");
}

CUtensorMap make_rowmajor_panel_map(const void* base, int64_t rows, int64_t cols, int64_t ld, int box_rows) {
  return encode_map(base, sm90::rowmajor_panel_spec(rows, cols, ld, box_rows), "a row-major matrix in 64-column panels");
}

// Multiprocessors this process's context may use. Under MPS with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (which
// `dmoe launch` sets when ranks share a GPU) the device attribute already reports the client's share (seen on the
// H200: 32 of 132 SMs at 25 %); the driver's execution affinity (CUDA 11.4+) is asked as well, for contexts
// limited some other way. A persistent kernel that assumed more would wait for blocks that never become resident.
int context_sm_limit(int device_sms) {
  int limit = device_sms;
  DMOE_CHECK_CUDA(cudaFree(nullptr));  // the context must exist to be asked
  void* f = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion("cuCtxGetExecAffinity", &f, 11040, cudaEnableDefault, &q) == cudaSuccess &&
      q == cudaDriverEntryPointSuccess && f != nullptr) {
    CUexecAffinityParam param{};
    if (reinterpret_cast<PFN_cuCtxGetExecAffinity_v11040>(f)(&param, CU_EXEC_AFFINITY_TYPE_SM_COUNT) == CUDA_SUCCESS &&
        param.param.smCount.val > 0)
      limit = std::min<int>(limit, int(param.param.smCount.val));
  } else {
    (void)cudaGetLastError();
  }
  return limit;
}

const DeviceInfo& device_info() {
  static std::mutex mutex;
  static std::vector<DeviceInfo> infos;
  int device = 0;
  DMOE_CHECK_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (int(infos.size()) <= device) infos.resize(device + 1, DeviceInfo{});
  DeviceInfo& info = infos[device];
  if (info.sms == 0) {
    int major = 0, minor = 0;
    DMOE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    DMOE_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    DMOE_CHECK_CUDA(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device));
    info.sms = std::min(info.sms, context_sm_limit(info.sms));
    bool built = false;
    if (major == 9 && minor == 0) {
      cudaFuncAttributes attr{};
      // The kernel has an image for this device only if the build targeted sm_90a.
      if (cudaFuncGetAttributes(&attr, sm90a_probe_kernel) == cudaSuccess) {
        int* flag = nullptr;
        int host = 0;
        DMOE_CHECK_CUDA(cudaMalloc(&flag, sizeof(int)));
        sm90a_probe_kernel<<<1, 1>>>(flag);
        DMOE_CHECK_LAUNCH();
        DMOE_CHECK_CUDA(cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost));
        DMOE_CHECK_CUDA(cudaFree(flag));
        built = host == 1;
      } else {
        (void)cudaGetLastError();
      }
    }
    info.usable = built;
  }
  return info;
}

unsigned long long wait_timeout_ns() {
  static const unsigned long long ns = [] {
    // Bounded so that the nanoseconds fit 64 bits (a larger value wrapped into a short limit).
    const int64_t ms = env_integer("DMOE_GPU_WAIT_TIMEOUT_MS", 1, kMaxGpuWaitTimeoutMs, 10000, "milliseconds");
    return (unsigned long long)ms * 1000000ull;
  }();
  return ns;
}

size_t sm90_grouped_gemm_scratch_bytes(int32_t groups) {
  // row offsets (int64), tile offsets (int32), the dynamic schedule's tile counter (int32), the tiles counted on
  // the device (int32; offsets in device memory)
  const size_t bytes = (size_t(groups) + 1) * (sizeof(int64_t) + sizeof(int32_t)) + 2 * sizeof(int32_t);
  return (bytes + 255) / 256 * 256;
}

void grouped_tile_table(const int64_t* row_offsets, int32_t groups, int64_t rows, int32_t n_tiles, int32_t block_m,
                        int64_t* clipped, int32_t* tile_offsets, int32_t* tiles, cudaStream_t stream) {
  DMOE_CUDA_REQUIRE(groups >= 0 && rows >= 0 && n_tiles >= 1 && block_m >= 1,
                    "grouped_tile_table: groups = %d, rows = %lld, n_tiles = %d, block_m = %d; need groups, rows >= 0 "
                    "and n_tiles, block_m >= 1", groups, (long long)rows, n_tiles, block_m);
  grouped_tile_table_kernel<<<1, 32, 0, stream>>>(row_offsets, groups, rows, n_tiles, block_m, clipped, tile_offsets,
                                                  tiles);
  DMOE_CHECK_LAUNCH();
}

bool sm90_grouped_gemm_usable(const GroupedGemmNT& g) {
  if (g.groups <= 0 || g.n <= 0 || g.k <= 0) return false;
  // TMA: row strides of a multiple of 16 bytes, 16-byte aligned bases; bf16 pairs in the epilogue.
  if (g.k % 8 != 0 || g.n % 8 != 0) return false;
  if (!is_aligned(g.a, 16) || !is_aligned(g.b, 16) || !is_aligned(g.c, 16)) return false;
  // c (and c2) may be null only with a fused activation: the pre-activations are then not kept.
  if (g.c == nullptr && g.h == nullptr) return false;
  const bool gated = g.h != nullptr && g.activation == Activation::swiglu;
  if (g.h != nullptr && !is_aligned(g.h, 16)) return false;
  if (gated && (!is_aligned(g.b2, 16) || !is_aligned(g.c2, 16))) return false;
  // Tile coordinates are 32-bit in TMA.
  const int64_t rows = g.offsets_on_device ? g.rows : g.row_offsets[g.groups];
  if (rows < 0 || rows >= (int64_t(1) << 31) - kBlockM || int64_t(g.groups) * g.n >= (int64_t(1) << 31)) return false;
  return device_info().usable;
}

void sm90_grouped_gemm(const CudaContext& ctx, void* scratch, const GroupedGemmNT& g, const Sm90Tuning& t) {
  DMOE_CUDA_REQUIRE(g.groups >= 0, "sm90_grouped_gemm: groups = %d; must be >= 0", g.groups);
  if (g.groups == 0) return;
  for (int32_t e = 0; e < g.groups && !g.offsets_on_device; ++e)  // device offsets: clipped on the device
    DMOE_CUDA_REQUIRE(g.row_offsets[e + 1] >= g.row_offsets[e] && g.row_offsets[0] >= 0,
                      "sm90_grouped_gemm: row_offsets[%d] = %lld < row_offsets[%d] = %lld; offsets must not "
                      "decrease", e + 1, (long long)g.row_offsets[e + 1], e, (long long)g.row_offsets[e]);
  DMOE_CUDA_REQUIRE(sm90_grouped_gemm_usable(g),
                    "sm90_grouped_gemm: not usable here (needs an sm_90 GPU, a build for sm_90a, k and n multiples "
                    "of 8 — k = %lld, n = %lld — and 16-byte aligned pointers)", (long long)g.k, (long long)g.n);
  DMOE_CUDA_REQUIRE(t.block_n == 0 || t.block_n == 128 || t.block_n == 256,
                    "sm90_grouped_gemm: block_n = %d; allowed: 0 (default), 128, 256", t.block_n);
  DMOE_CUDA_REQUIRE(t.epilogue >= 0 && t.epilogue <= 2,
                    "sm90_grouped_gemm: epilogue = %d; allowed: 0 (default), 1 (staged), 2 (direct)", t.epilogue);
  const bool staged = t.epilogue == 0 ? staged_epilogue() : t.epilogue == 1;
  const bool wide = (t.block_n == 0 ? column_tile() : t.block_n) == 256;
  DMOE_CUDA_REQUIRE(t.leave_out >= 0 && t.leave_out <= 2,
                    "sm90_grouped_gemm: leave_out = %d; allowed: 0, 1 (no stores), 2 (no products, no stores)",
                    t.leave_out);
  DMOE_CUDA_REQUIRE(t.skip_lag_ns <= 1000000u, "sm90_grouped_gemm: skip_lag_ns = %u; allowed: 0 to 1000000 (a test "
                    "aid)", t.skip_lag_ns);
  const Sm90Tuning& lo = t;  // the aids (leave_out, skip_lag_ns) travel to the launch
  DMOE_CUDA_REQUIRE(t.schedule >= 0 && t.schedule <= 2,
                    "sm90_grouped_gemm: schedule = %d; allowed: 0 (default), 1 (static), 2 (dynamic)", t.schedule);
  const bool dyn = t.schedule == 0 ? dynamic_schedule() : t.schedule == 2;
  // k-blocks of 64 columns: 32 (9 slots of 24 KiB instead of 4 of 48) measured 5-10 % slower on every
  // config (docs/perf.md), so the kernel is instantiated for 64 only.
  // The dynamic schedule is built for direct stores (the default); the opt-in staged epilogue runs static.
  if (staged)
    wide ? launch_for<256, 64, true, false>(ctx, scratch, g, lo) : launch_for<128, 64, true, false>(ctx, scratch, g, lo);
  else if (dyn)
    wide ? launch_for<256, 64, false, true>(ctx, scratch, g, lo) : launch_for<128, 64, false, true>(ctx, scratch, g, lo);
  else
    wide ? launch_for<256, 64, false, false>(ctx, scratch, g, lo)
         : launch_for<128, 64, false, false>(ctx, scratch, g, lo);
}

bool sm90_grouped_gemm_nn_usable(const GroupedGemmNN& g) {
  if (g.groups <= 0 || g.n <= 0 || g.k <= 0) return false;
  // TMA: row strides of a multiple of 16 bytes (A: 2k, B: 2n), 16-byte aligned bases; the epilogue stores
  // 8-column blocks.
  if (g.k % 8 != 0 || g.n % 8 != 0) return false;
  if (!is_aligned(g.a, 16) || !is_aligned(g.b, 16) || !is_aligned(g.c, 16)) return false;
  if ((g.a2 == nullptr) != (g.b2 == nullptr)) return false;
  if (g.a2 != nullptr && (!is_aligned(g.a2, 16) || !is_aligned(g.b2, 16))) return false;
  // Tile coordinates are 32-bit in TMA (rows of A; columns, k-rows and groups of B).
  if (g.row_offsets[g.groups] >= (int64_t(1) << 31) - kBlockM || g.n >= (int64_t(1) << 31) ||
      g.k >= (int64_t(1) << 31))
    return false;
  return device_info().usable;
}

void sm90_grouped_gemm_nn(const CudaContext& ctx, void* scratch, const GroupedGemmNN& g, const Sm90Tuning& t) {
  DMOE_CUDA_REQUIRE(g.groups >= 0, "sm90_grouped_gemm_nn: groups = %d; must be >= 0", g.groups);
  if (g.groups == 0) return;
  for (int32_t e = 0; e < g.groups; ++e)
    DMOE_CUDA_REQUIRE(g.row_offsets[e + 1] >= g.row_offsets[e] && g.row_offsets[0] >= 0,
                      "sm90_grouped_gemm_nn: row_offsets[%d] = %lld < row_offsets[%d] = %lld; offsets must not "
                      "decrease", e + 1, (long long)g.row_offsets[e + 1], e, (long long)g.row_offsets[e]);
  DMOE_CUDA_REQUIRE(sm90_grouped_gemm_nn_usable(g),
                    "sm90_grouped_gemm_nn: not usable here (needs an sm_90 GPU, a build for sm_90a, k and n multiples "
                    "of 8 — k = %lld, n = %lld — 16-byte aligned pointers, a2 and b2 both given or both null)",
                    (long long)g.k, (long long)g.n);
  DMOE_CUDA_REQUIRE(t.block_n == 0 || t.block_n == 128 || t.block_n == 256,
                    "sm90_grouped_gemm_nn: block_n = %d; allowed: 0 (default), 128, 256", t.block_n);
  DMOE_CUDA_REQUIRE(t.epilogue == 0 || t.epilogue == 2,
                    "sm90_grouped_gemm_nn: epilogue = %d; allowed: 0 (default: direct), 2 (direct); the staged "
                    "epilogue is not built for the NN product", t.epilogue);
  DMOE_CUDA_REQUIRE(t.leave_out >= 0 && t.leave_out <= 2,
                    "sm90_grouped_gemm_nn: leave_out = %d; allowed: 0, 1 (no stores), 2 (no products, no stores)",
                    t.leave_out);
  DMOE_CUDA_REQUIRE(t.skip_lag_ns <= 1000000u, "sm90_grouped_gemm_nn: skip_lag_ns = %u; allowed: 0 to 1000000 (a test "
                    "aid)", t.skip_lag_ns);
  DMOE_CUDA_REQUIRE(t.schedule >= 0 && t.schedule <= 2,
                    "sm90_grouped_gemm_nn: schedule = %d; allowed: 0 (default), 1 (static), 2 (dynamic)", t.schedule);
  const bool wide = (t.block_n == 0 ? column_tile() : t.block_n) == 256;
  const bool dyn = t.schedule == 0 ? dynamic_schedule() : t.schedule == 2;
  if (dyn)
    wide ? launch_nn<256, true>(ctx, scratch, g, t) : launch_nn<128, true>(ctx, scratch, g, t);
  else
    wide ? launch_nn<256, false>(ctx, scratch, g, t) : launch_nn<128, false>(ctx, scratch, g, t);
}

// The twin of cpu::grouped_gemm_nn: scratch from the context's workspace (reserved here, so callers that
// hold pointers into the workspace call sm90_grouped_gemm_nn with their own scratch instead).
void grouped_gemm_nn(const bf16* a, const bf16* b, const bf16* a2, const bf16* b2, bf16* c,
                     const int64_t* row_offsets, int32_t groups, int64_t n, int64_t k, const CudaContext& ctx) {
  DMOE_CUDA_REQUIRE(groups >= 0, "grouped_gemm_nn: groups = %d; must be >= 0", groups);
  if (groups == 0 || n == 0 || row_offsets[groups] == row_offsets[0]) return;
  if (k == 0) {  // empty sums: the groups' rows (contiguous from row_offsets[0]) are zeros
    DMOE_CHECK_CUDA(cudaMemsetAsync(c + row_offsets[0] * n, 0,
                                    size_t(row_offsets[groups] - row_offsets[0]) * size_t(n) * sizeof(bf16), ctx.stream));
    return;
  }
  GroupedGemmNN g{a, b, c, row_offsets, groups, n, k, a2, b2};
  DMOE_CUDA_REQUIRE(ctx.workspace != nullptr, "grouped_gemm_nn: the context has no workspace");
  void* scratch = ctx.workspace->reserve(sm90_grouped_gemm_scratch_bytes(groups), ctx.stream);
  sm90_grouped_gemm_nn(ctx, scratch, g);
}

}  // namespace dmoe::cuda
