// flash/flash_kernel.cu — the Flash layer forward: gate, dispatch, expert FFN and combine of one rank as one
// persistent kernel (cooperative launch, one 384-thread block per multiprocessor). The protocol — buffers,
// signals, epochs, the task table — is core/flash_protocol.hpp; cpu/flash.cpp is its CPU twin; docs/flash.md
// has the ordering argument and how to read a time-out report.
//
// Roles (named device functions; the top-level kernel only routes to them):
//   gate_role        all threads: router logits on tensor cores (mma.sync, f32 accumulation), then softmax /
//                    top-k / gate weights, a warp per token (cuda/warp_routing.cuh, as the EP router), then
//                    each token's rank among this block's tokens routed to each expert;
//   grid_barrier     once, after the gate (block counts complete);
//   counts_role      block 0 sends this rank's routed counts to every rank; every block waits for all ranks'
//                    counts and derives the same offsets and the task table;
//   dispatch_role    warps copy each kept (token, choice) row (and its metadata) to the expert's rank — by
//                    direct stores into the peer's symmetric buffer (nvshmem_ptr), locally at W = 1 — and the
//                    last block done signals every destination;
//   processor_role   the sm90 tile engine: a producer warpgroup takes task indices (first wave: blockIdx, then a
//                    global counter: the scheduler) and, before loading a task's operands by TMA, subscribes to
//                    what it needs (its sources' ready signals, or its row tile's up_done counter); two consumer
//                    warpgroups run wgmma and the epilogues: up tiles store h with the activation fused and count
//                    themselves in up_done; down tiles store their rows straight into the home rank's `out` and
//                    add them to the home's `arrived`;
//   combine_role     consumer threads, once `arrived` says every row is back: y[t] = Σ_j w[t,j]·out[t·k+j], a
//                    block's own tokens, or (spread_combine) column slices of every token over the grid's warps.
// No role burns a whole multiprocessor on scheduling or polling: the queue is one counter and each processor
// subscribes to its own task's signals (the reference design dedicates blocks to both).
//
// Every wait is bounded (DMOE_GPU_WAIT_TIMEOUT_MS); past it the record names the rank, role, what was awaited,
// the expected and the last seen value (cuda/check.hpp), and the kernel traps.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "core/flash_protocol.hpp"
#include "core/routing.hpp"
#include "cuda/activation.cuh"
#include "cuda/check.hpp"
#include "cuda/device_utils.cuh"
#include "cuda/sm90_host.hpp"
#include "cuda/sm90_primitives.cuh"
#include "cuda/warp_routing.cuh"
#include "flash/flash_kernel.hpp"

namespace dmoe::cuda {

namespace {

using flash::kTileCols;
using flash::kTileRows;

constexpr int kThreads = 384;  // producer warpgroup + two consumer warpgroups
constexpr int kConsumers = 2;
constexpr int kBK = 64;                               // k-block columns (128-byte rows, 128-byte swizzle)
constexpr int kRowBytes = kBK * 2;
constexpr int kABytes = kTileRows * kRowBytes;        // 16 KiB
constexpr int kBBytes = kTileCols * kRowBytes;        // 32 KiB
constexpr int kStageBytes = kABytes + kBBytes;        // 48 KiB
constexpr int kStages = 4;
constexpr int kRingBytes = kStages * kStageBytes;     // 192 KiB: also the gate's and dispatch's scratch
constexpr int kTileRing = 2;
constexpr int kBarrierBytes = 8 * (2 * kStages + 2 * kTileRing) + 4 * kTileRing;
constexpr int kGateTokens = 64;                       // tokens per gate chunk (4 mma row groups of 16)
constexpr int kMaxGateStages = 8;                     // gate chunks of 64 columns in flight, at most
constexpr int kMinGateStages = 2;
constexpr int kGateBarrierOffset = 128;               // the gate's kMaxGateStages mbarriers, in the barrier block
constexpr int kMaxGateTasks = 2;                      // warp tasks per warp: 4·ceil(E/32)/12 <= 2 -> E <= 192
constexpr int kMaxGateExperts = 32 * (kThreads / 32) * kMaxGateTasks / 4;
constexpr int kGateSlots = kMaxGateExperts / 32;      // logits per lane in the warp routing (warp_routing.cuh)
constexpr int kMaxSmem = 232448;
static_assert(kGateTokens == flash::kGateChunkTokens && kBK == flash::kGateChunkCols, "the split gate's items");
constexpr int kTableBase = 1024 + kRingBytes + 256;   // tables start after the aligned ring and barriers

static_assert(kBarrierBytes <= kGateBarrierOffset && kGateBarrierOffset + 8 * kMaxGateStages <= 256,
              "the tile engine's and the gate's barriers fit their 256 bytes");

// Shared-memory tables that live through the whole kernel (int32 unless said).
struct TableLayout {
  int offsets, row_tile_base, expert_rows, expert_begin, seg_begin, scalars, bytes;
};
__host__ __device__ inline TableLayout table_layout(int32_t Le, int32_t W) {
  TableLayout t;
  int at = 0;
  t.offsets = at;       at += 4 * (2 * Le + 1);
  t.row_tile_base = at; at += 4 * (Le + 1);
  t.expert_rows = at;   at += 4 * Le;
  t.expert_begin = at;  at += 4 * Le;
  t.seg_begin = at;     at += 4 * Le * (W + 1);
  at = (at + 15) / 16 * 16;
  t.scalars = at;       at += 24;  // u64: kept rows of this rank (combine target), unused, this forward's epoch
  t.bytes = at;
  return t;
}

// Scratch in the ring region before the GEMM phase (bytes from the ring's start).
struct ScratchLayout {
  int logits, ids, counts, base, dst_base, kept, column, begin, prefix, tiles, gate_stage, gate_stages, gate_stage_bytes,
      bytes;
};
__host__ __device__ inline ScratchLayout scratch_layout(int32_t E, int32_t k, int32_t W) {
  ScratchLayout s;
  int at = 0;
  s.logits = at;   at += 4 * kGateTokens * (E + 1);
  s.ids = at;      at += 4 * kGateTokens * k;
  s.counts = at;   at += 4 * E;  // this block's tokens per expert (gate), then routed totals (counts)
  s.base = at;     at += 4 * E;  // tokens of earlier blocks per expert
  s.dst_base = at; at += 4 * E;  // first destination row of this block's rows of each expert
  s.kept = at;     at += 4 * W * E;
  s.column = at;   at += 4 * E;
  s.begin = at;    at += 4 * E;
  s.prefix = at;   at += 4 * (E + 1);  // exclusive prefix of column (begin)
  s.tiles = at;    at += 4 * (E + 1);  // exclusive prefix of the local experts' row tiles (task table)
  at = (at + 1023) / 1024 * 1024;  // TMA's 128-byte swizzle: stages on 1024-byte boundaries
  // A stage: x [64 tokens, 64 columns] and the gate [E rows, 64 columns] (on 1024-byte boundaries). As many
  // stages as the ring has room for, up to 8.
  s.gate_stage = at;
  s.gate_stage_bytes = kGateTokens * 128 + (E * 128 + 1023) / 1024 * 1024;
  s.gate_stages = max(kMinGateStages, min(kMaxGateStages, (kRingBytes - at) / s.gate_stage_bytes));
  at += s.gate_stages * s.gate_stage_bytes;
  s.bytes = at;
  return s;
}

int smem_bytes_for(const flash::Shape& s) {
  return kTableBase + table_layout(s.local_experts(), s.world).bytes;
}

// TMA maps of the operands: recv [2R, H] (both parities), h [R, I], w1/w3 [Le·I, H], w2 [Le·H, I]; the gate's
// x [T, H] (boxes of 64 rows) and gate [E, H] (one box of E rows).
struct TileMaps {
  CUtensorMap recv, h, w1, w3, w2, x, gate;
};

struct KernelArgs {
  flash::Params p;
  int64_t recv_rows;
  flash::SymmetricLayout sl;
  flash::LocalLayout ll;
};

#ifdef DMOE_SM90A_DEVICE

__device__ __forceinline__ const __nv_bfloat16* bf(const void* p) { return static_cast<const __nv_bfloat16*>(p); }

// Spins until pred(load()) holds; past the limit, records and traps. Returns the value that satisfied it.
template <typename Load, typename Pred>
__device__ __forceinline__ uint64_t wait_flag(Load load, Pred pred, const KernelArgs& a, int role, int what, int slot,
                                              uint64_t expected) {
  uint64_t v = load();
  if (pred(v)) return v;
  const unsigned long long start = global_time_ns();
  for (;;) {
    v = load();
    if (pred(v)) return v;
    const unsigned long long waited = global_time_ns() - start;
    if (waited > a.p.timeout_ns)
      report_wait_timeout(static_cast<DeviceWaitRecord*>(a.p.wait_record), kWaitFlash, role, a.p.rank, what, slot,
                          0, expected, v, waited);
  }
}

__device__ __forceinline__ void flash_mbar_wait(uint32_t bar, uint32_t parity, int what, int slot, const KernelArgs& a,
                                                int role) {
  mbar_wait(bar, parity, what, slot, a.p.timeout_ns, static_cast<DeviceWaitRecord*>(a.p.wait_record), kWaitFlash,
            role);
}

__device__ __forceinline__ char* peer_base(const KernelArgs& a, int32_t d) {
  return reinterpret_cast<char*>(reinterpret_cast<const uint64_t*>(a.p.local + a.ll.peers)[d]);
}
__device__ __forceinline__ flash::Control* control(const KernelArgs& a) {
  return reinterpret_cast<flash::Control*>(a.p.local + a.ll.control);
}

__device__ __forceinline__ void stamp(const KernelArgs& a, int32_t slot) {
  if (a.p.profile != nullptr) a.p.profile[int64_t(blockIdx.x) * flash::kProfileSlots + slot] = global_time_ns();
}

// d[4] += A (16×16 bf16, row-major fragments) · B (16×8 bf16, column fragments).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8×8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8 and gets,
// of each matrix, the word of row l / 4, columns 2(l % 4) and 2(l % 4) + 1: mma.sync's fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// ---- grid barrier (once per forward) ---------------------------------------------------------------------
__device__ void grid_barrier(const KernelArgs& a, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t* bar = &control(a)->grid_barrier;
    const uint64_t target = uint64_t(epoch) * gridDim.x;
    atomic_add_acq_rel_gpu(bar, 1);
    wait_flag([&] { return ld_acquire_gpu(bar); }, [&](uint64_t v) { return v >= target; }, a, flash::kRoleGate,
              flash::kWaitGridBarrier, -1, target);
  }
  __syncthreads();
}

// The split gate's barrier: every block's partial logits written (Control::gate_barrier). An engine's shape, and so
// whether its forwards split the gate, is fixed: every forward of a split engine arrives, so the target is epoch·G.
__device__ void gate_barrier(const KernelArgs& a, uint32_t epoch) {
  uint64_t* bar = &control(a)->gate_barrier;
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint64_t target = uint64_t(epoch) * gridDim.x;
    atomic_add_acq_rel_gpu(bar, 1);
    wait_flag([&] { return ld_acquire_gpu(bar); }, [&](uint64_t v) { return v >= target; }, a, flash::kRoleGate,
              flash::kWaitGateBarrier, -1, target);
  }
  __syncthreads();
}

// ---- gate ------------------------------------------------------------------------------------------------
// This block's tokens [t_begin, t_end): ids, weights, and slot[t·k+j] = rank of t among this block's tokens
// routed to ids[t,j]; block_counts[block][e] = this block's tokens routed to e.
//
// Logits [64 tokens, E] on tensor cores (mma.sync m16n8k16, f32 accumulation; fragments by ldmatrix). Warp
// tasks: (16-token group, 32-expert group), each summing its outputs in k order alone (deterministic). K in
// chunks of 64 columns, each a TMA box of x [64 rows] and of the gate [E rows] (128-byte swizzle: 16-byte chunk
// c of row r at r·128 + (c ^ r % 8)·16; zeros past H and T), 2-8 chunks in flight (scratch_layout); thread 0
// refills the stage of chunk ck − 1 after the barrier that ends its use. Rows past n and experts past E are
// clamped to a valid row and their results dropped.
// Measured (docs/perf.md, ninth session): the loop takes ~0.55 µs per chunk whether fragments come by 32-bit
// shared loads or by ldmatrix, with 4 or 8 stages (cause not found yet); routing one token per thread
// (topk_row's O(k·E) loop) took 17-59 µs, so one warp routes a token with the EP router's code
// (cuda/warp_routing.cuh). wgmma here was tried and rejected: ptxas
// then serialises every wgmma of the kernel, the tile engine's included (C7512, registers).
__device__ void route_token_serial(const KernelArgs& a, const float* row, int64_t t, int32_t* id_row) {
  const flash::Shape& s = a.p.shape;
  const int32_t E = s.experts, k = s.top_k;
  auto* ids = reinterpret_cast<int32_t*>(a.p.local + a.ll.ids);
  auto* weights = reinterpret_cast<float*>(a.p.local + a.ll.weights);
  // The per-thread code of core/routing.hpp (rows holding a NaN: it defines what NaN routing does).
  topk_row(row, E, k, id_row);
  float m = row[0];
  for (int32_t e = 1; e < E; ++e) m = row[e] > m ? row[e] : m;
  float sum = 0.f;
  for (int32_t e = 0; e < E; ++e) sum += expf(row[e] - m);
  bool valid = true;
  for (int32_t j = 0; j < k; ++j) valid = valid && id_row[j] >= 0;
  float wsum = 0.f;
  for (int32_t j = 0; j < k; ++j) {
    const float w = valid ? float(expf(row[id_row[j]] - m) / sum) : __int_as_float(0x7fc00000);
    weights[t * k + j] = w;
    wsum += w;
    ids[t * k + j] = id_row[j];
  }
  if (s.renormalize && valid)
    for (int32_t j = 0; j < k; ++j) weights[t * k + j] = weights[t * k + j] / wsum;
  if (!valid) {
    flash::Control* ctl = control(a);
    if (atomicCAS(&ctl->error, 0u, uint32_t(flash::kErrorNanRouting)) == 0u) ctl->error_detail = uint32_t(t);
  }
}

// One warp's products of a 64-column chunk for one task (16 tokens × 32 experts): four k16 steps of four
// m16n8k16 mma.sync each, A (x) and B (the gate's rows, clamped at E − 1) by ldmatrix from the chunk's
// 128-byte-swizzled stage.
__device__ __forceinline__ void gate_chunk_products(float (&acc)[4][4], uint32_t xb, uint32_t wb, int32_t a_row,
                                                    int32_t b_row0, int32_t b_row1, int mi, int r8) {
#pragma unroll 1  // unrolled, the SwiGLU kernel spilled registers (ptxas -v, before gate_role was its own function)
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t af[4], b01[4], b23[4];
    ldmatrix_x4(af, xb + a_row * 128 + (((2 * kk + mi / 2) ^ r8) << 4));
    ldmatrix_x4(b01, wb + b_row0 * 128 + (((2 * kk + mi % 2) ^ (b_row0 & 7)) << 4));
    ldmatrix_x4(b23, wb + b_row1 * 128 + (((2 * kk + mi % 2) ^ (b_row1 & 7)) << 4));
    const uint32_t f0[2] = {b01[0], b01[1]}, f1[2] = {b01[2], b01[3]};
    const uint32_t f2[2] = {b23[0], b23[1]}, f3[2] = {b23[2], b23[3]};
    mma_16816(acc[0], af, f0);
    mma_16816(acc[1], af, f1);
    mma_16816(acc[2], af, f2);
    mma_16816(acc[3], af, f3);
  }
}

// The split gate (flash::Shape::split_gate_items, decode sizes): block b computes item b = (token chunk tc, column
// chunk kc), the logits of tokens [64·tc, 64·tc + 64) over H's columns [64·kc, 64·kc + 64), with the one-group
// loop's warp tasks on one TMA stage (gate stage 0 and its mbarrier, phase 0: nothing else loads a gate chunk in a
// split forward), and stores them to gate_partial[kc, t, e]; gate_role sums a token's partials in kc order after
// the gate barrier. One round trip per block instead of ceil(H/64) chunks in the token's own block.
__device__ __noinline__ void split_gate_partials(const KernelArgs& a, const TileMaps& maps, uint8_t* scratch) {
  const flash::Shape& s = a.p.shape;
  const int64_t item = blockIdx.x;
  if (item >= s.split_gate_items()) return;
  const int32_t E = s.experts;
  const int64_t T = s.tokens, chunks = s.gate_column_chunks();
  const int64_t tc = item / chunks, kc = item % chunks, t0 = tc * kGateTokens;
  const int32_t n = int32_t(min(int64_t(kGateTokens), T - t0));
  const ScratchLayout sc = scratch_layout(E, s.top_k, s.world);
  uint8_t* x_stage = scratch + sc.gate_stage;
  uint8_t* w_stage = x_stage + kGateTokens * 128;
  const uint32_t bar = smem_u32(scratch) + kRingBytes + kGateBarrierOffset;
  if (threadIdx.x == 0) {
    fence_async_shared();
    mbar_expect_tx(bar, uint32_t(kGateTokens * 128 + E * 128));
    tma_load_2d(smem_u32(x_stage), &maps.x, int32_t(kc * 64), int32_t(t0), bar);
    tma_load_2d(smem_u32(w_stage), &maps.gate, int32_t(kc * 64), 0, bar);
  }
  flash_mbar_wait(bar, 0, flash::kWaitSlotFull, 0, a, flash::kRoleGate);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mi = lane / 8, r8 = lane % 8;
  const int32_t tasks = 4 * ((E + 31) / 32);
  const int32_t my_tasks = (tasks - warp + kThreads / 32 - 1) / (kThreads / 32);  // <= kMaxGateTasks
  float* partial = reinterpret_cast<float*>(a.p.local + a.ll.gate_partial) + (kc * T + t0) * E;
  const uint32_t xb = smem_u32(x_stage), wb = smem_u32(w_stage);
#pragma unroll
  for (int m = 0; m < kMaxGateTasks; ++m) {
    if (m >= my_tasks) break;
    const int32_t task = warp + m * (kThreads / 32);
    const int32_t tg = task % 4, eg = task / 4;
    if (tg * 16 >= n) continue;
    float acc[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[nt][i] = 0.f;
    const int32_t a_row = tg * 16 + 8 * (mi % 2) + r8;
    const int32_t b_row0 = min(eg * 32 + 8 * (mi / 2) + r8, E - 1);
    const int32_t b_row1 = min(eg * 32 + 16 + 8 * (mi / 2) + r8, E - 1);
    gate_chunk_products(acc, xb, wb, a_row, b_row0, b_row1, mi, r8);
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int32_t e0 = eg * 32 + nt * 8 + 2 * (lane % 4);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int32_t row = tg * 16 + lane / 4 + (i >= 2 ? 8 : 0), e = e0 + (i & 1);
        if (row < n && e < E) partial[int64_t(row) * E + e] = acc[nt][i];
      }
    }
  }
}

// Its own function (noinline): inlined into the kernel, the split K loop below made the relu and gelu kernels
// spill 32 bytes (their expert roles' registers and the gate's shared one allocation); alone, nothing spills.
__device__ __noinline__ void gate_role(const KernelArgs& a, const TileMaps& maps, uint8_t* scratch, int64_t t_begin, int64_t t_end) {
  const flash::Shape& s = a.p.shape;
  const int32_t E = s.experts, k = s.top_k;
  const int64_t H = s.hidden;
  const ScratchLayout sc = scratch_layout(E, k, s.world);
  float* logits = reinterpret_cast<float*>(scratch + sc.logits);
  int32_t* ids_s = reinterpret_cast<int32_t*>(scratch + sc.ids);
  int32_t* counts = reinterpret_cast<int32_t*>(scratch + sc.counts);
  auto* ids = reinterpret_cast<int32_t*>(a.p.local + a.ll.ids);
  auto* weights = reinterpret_cast<float*>(a.p.local + a.ll.weights);
  auto* slot = reinterpret_cast<int32_t*>(a.p.local + a.ll.slot);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int stride = E + 1;

  uint8_t* stage_base = scratch + sc.gate_stage;
  const int S = sc.gate_stages;
  auto x_stage = [&](int st) { return stage_base + st * sc.gate_stage_bytes; };
  auto w_stage = [&](int st) { return x_stage(st) + kGateTokens * 128; };
  const uint32_t gate_bars = smem_u32(scratch) + kRingBytes + kGateBarrierOffset;
  const uint32_t box_bytes = uint32_t(kGateTokens * 128 + E * 128);  // what TMA writes per stage
  const int64_t chunks = (H + 63) / 64;
  const int32_t tasks = 4 * ((E + 31) / 32);
  const int32_t my_tasks = (tasks - warp + kThreads / 32 - 1) / (kThreads / 32);  // <= kMaxGateTasks
  // ldmatrix.x4: lane l gives row l % 8 of matrix l / 8 (A: rows +8 for odd matrices, k + 8 for the upper
  // two; B: the next 8 experts for the upper two, k + 8 for odd ones). Rows of a matrix start at multiples
  // of 8, so the swizzle of row r is r % 8 = l % 8 (A); B's clamped rows use their own.
  const int mi = lane / 8, r8 = lane % 8;

  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) counts[e] = 0;
  if (threadIdx.x == 0 && t_begin >= t_end) stamp(a, flash::kStampLogits);  // no tokens: the phase is empty
  uint32_t gate_seq = 0;  // chunks loaded so far: stage = seq % S, mbarrier parity = (seq / S) & 1
  for (int64_t c0 = t_begin; c0 < t_end; c0 += kGateTokens) {
    const int32_t n = int32_t(min(int64_t(kGateTokens), t_end - c0));
    auto load_chunk = [&](int64_t ck) {  // thread 0 only
      const uint32_t g = gate_seq + uint32_t(ck);
      const int st = int(g % S);
      const uint32_t bar = gate_bars + 8 * st;
      fence_async_shared();
      mbar_expect_tx(bar, box_bytes);
      tma_load_2d(smem_u32(x_stage(st)), &maps.x, int32_t(ck * 64), int32_t(c0), bar);
      tma_load_2d(smem_u32(w_stage(st)), &maps.gate, int32_t(ck * 64), 0, bar);
    };
    // Few tokens (decode): the tasks (16-token group, 32-expert group) are fewer than the 12 warps, which then mostly
    // idled while the chunks were waited for one after another (~0.55 µs each: 37 µs for H = 4096 at any T up to a
    // token per block, docs/perf.md). So the K loop is split over `groups` warp groups: warp w runs task
    // w % task_count over chunks g, g + groups, ... (g = w / task_count), every stage in flight, and the groups'
    // partial sums are added in group order after the loop (deterministic; another summation order than the
    // one-group loop below, whose results it matches to f32 rounding). Measured (docs/perf.md, eighteenth session):
    // decode T = 1 forward 0.207 → 0.186 ms, T = 128 0.705 → 0.684; inlined, it cost the relu and gelu kernels 32
    // bytes of register spills (ptxas -v) and flash-paper (relu, the one-group loop) 0.737 → 0.749 ms (hence noinline).
    const int32_t tg_count = (n + 15) / 16, eg_count = (E + 31) / 32, task_count = tg_count * eg_count;
    const int32_t rows16 = 16 * tg_count;
    int32_t groups = min(S, (kThreads / 32) / task_count);
    while (groups > 1 && groups * rows16 * E * 4 > S * sc.gate_stage_bytes) --groups;  // the partials' room
    float acc[kMaxGateTasks][4][4];  // the split path uses acc[0]
#pragma unroll
    for (int m = 0; m < kMaxGateTasks; ++m)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][nt][i] = 0.f;
    if (s.split_gate) {
      // Every block's partials are written (gate barrier): this block's tokens' sums, in column-chunk order.
      const float* partial = reinterpret_cast<const float*>(a.p.local + a.ll.gate_partial);
      const int64_t T = s.tokens, plane = T * E, nchunks = s.gate_column_chunks();
      for (int32_t i = threadIdx.x; i < n * E; i += blockDim.x) {
        const int32_t row = i / E, e = i % E;
        const float* p = partial + (c0 + row) * E + e;
        float v = 0.f;
#pragma unroll 8
        for (int64_t kc = 0; kc < nchunks; ++kc) v += __ldcg(p + kc * plane);  // other blocks wrote them (L2)
        logits[row * stride + e] = v;
      }
      __syncthreads();
    } else if (groups >= 2) {
      const int32_t my_task = warp % task_count, g = warp / task_count;
      const bool active = g < groups;
      const int32_t tg = my_task % tg_count, eg = my_task / tg_count;
      float (&acc1)[4][4] = acc[0];
      const int32_t nchunks = int32_t(chunks);
      int32_t loaded = 0;  // chunks whose load thread 0 has issued
      if (threadIdx.x == 0)
        for (; loaded < S && loaded < nchunks; ++loaded) load_chunk(loaded);
      for (int32_t r0 = 0; r0 < nchunks; r0 += groups) {
        const int32_t ck = r0 + g;
        if (active && ck < nchunks) {
          const uint32_t gs = gate_seq + uint32_t(ck);
          const int st = int(gs % S);
          flash_mbar_wait(gate_bars + 8 * st, (gs / S) & 1, flash::kWaitSlotFull, st, a, flash::kRoleGate);
          const uint32_t xb = smem_u32(x_stage(st)), wb = smem_u32(w_stage(st));
          const int32_t a_row = tg * 16 + 8 * (mi % 2) + r8;
          const int32_t b_row0 = min(eg * 32 + 8 * (mi / 2) + r8, E - 1);
          const int32_t b_row1 = min(eg * 32 + 16 + 8 * (mi / 2) + r8, E - 1);
          gate_chunk_products(acc1, xb, wb, a_row, b_row0, b_row1, mi, r8);
        }
        __syncthreads();  // chunks [r0, r0 + groups) are done with: their stages take the next ones
        if (threadIdx.x == 0)
          for (; loaded < nchunks && loaded < r0 + groups + S; ++loaded) load_chunk(loaded);
      }
      gate_seq += uint32_t(chunks);
      // The partials [groups][rows16][E] in the stages (every load has landed and been read: free).
      float* partial = reinterpret_cast<float*>(stage_base);
      if (active) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int32_t e0 = eg * 32 + nt * 8 + 2 * (lane % 4);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int32_t row = tg * 16 + lane / 4 + (i >= 2 ? 8 : 0), e = e0 + (i & 1);
            if (row < n && e < E) partial[(int64_t(g) * rows16 + row) * E + e] = acc1[nt][i];
          }
        }
      }
      __syncthreads();
      for (int32_t i = threadIdx.x; i < n * E; i += blockDim.x) {
        const int32_t row = i / E, e = i % E;
        float v = partial[int64_t(row) * E + e];
        for (int32_t gg = 1; gg < groups; ++gg) v += partial[(int64_t(gg) * rows16 + row) * E + e];
        logits[row * stride + e] = v;
      }
      __syncthreads();  // logits complete; every stage is free for the next token chunk
    } else {
      if (threadIdx.x == 0)
        for (int64_t ck = 0; ck < S - 1 && ck < chunks; ++ck) load_chunk(ck);
      for (int64_t ck = 0; ck < chunks; ++ck) {
        const uint32_t g = gate_seq + uint32_t(ck);
        const int st = int(g % S);
        flash_mbar_wait(gate_bars + 8 * st, (g / S) & 1, flash::kWaitSlotFull, st, a, flash::kRoleGate);
        __syncthreads();  // every warp is done with chunk ck − 1's stage
        if (threadIdx.x == 0 && ck + S - 1 < chunks) load_chunk(ck + S - 1);
        const uint32_t xb = smem_u32(x_stage(st)), wb = smem_u32(w_stage(st));
#pragma unroll
        for (int m = 0; m < kMaxGateTasks; ++m) {
          if (m >= my_tasks) break;
          const int32_t task = warp + m * (kThreads / 32);
          const int32_t tg = task % 4, eg = task / 4;
          if (tg * 16 >= n) continue;
          const int32_t a_row = tg * 16 + 8 * (mi % 2) + r8;
          const int32_t b_row0 = min(eg * 32 + 8 * (mi / 2) + r8, E - 1);
          const int32_t b_row1 = min(eg * 32 + 16 + 8 * (mi / 2) + r8, E - 1);
          gate_chunk_products(acc[m], xb, wb, a_row, b_row0, b_row1, mi, r8);
        }
      }
      gate_seq += uint32_t(chunks);
      __syncthreads();  // every warp is done with the last stages
#pragma unroll
      for (int m = 0; m < kMaxGateTasks; ++m) {
        if (m >= my_tasks) break;
        const int32_t task = warp + m * (kThreads / 32);
        const int32_t tg = task % 4, eg = task / 4;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          const int32_t e0 = eg * 32 + nt * 8 + 2 * (lane % 4);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int32_t row = tg * 16 + lane / 4 + (i >= 2 ? 8 : 0), e = e0 + (i & 1);
            if (row < n && e < E) logits[row * stride + e] = acc[m][nt][i];
          }
        }
      }
      __syncthreads();  // logits complete; every stage is free for the next token chunk
    }
    if (threadIdx.x == 0) stamp(a, flash::kStampLogits);
    // Softmax, top-k and gate weights: one warp per token, the EP router's code (equal ids and weights).
    for (int32_t row = warp; row < n; row += kThreads / 32) {
      const int64_t t = c0 + row;
      const float* lrow = logits + row * stride;
      int32_t* id_row = ids_s + row * k;
      WarpRoutingRow<kGateSlots> r;
      if (warp_softmax_stats(lrow, E, lane, r)) {
        if (s.train) {  // the router backward's inputs: the EP router's values, bit for bit (router.cu)
          float* prob_row = reinterpret_cast<float*>(a.p.local + a.ll.probs) + t * E;
#pragma unroll
          for (int i = 0; i < kGateSlots; ++i)
            if (lane + 32 * i < E) prob_row[lane + 32 * i] = r.ex[i] / r.sum;
          if (lane == 0) reinterpret_cast<float*>(a.p.local + a.ll.lse)[t] = r.max_logit + logf(r.sum);
        }
        // Pick j is the same on every lane: every lane sums the weights in j order (gate_weights_row<float>'s
        // order), and lane j % 32 keeps pick j in its slot j / 32, so the stores are coalesced and nothing
        // is read back from global memory.
        int32_t my_id[kGateSlots];
        float my_w[kGateSlots], wsum = 0.f;
        warp_topk(r, E, k, lane, [&](int32_t j, int32_t best, float best_v) {
          const float w = expf(best_v - r.max_logit) / r.sum;
          wsum += w;
#pragma unroll
          for (int i = 0; i < kGateSlots; ++i)
            if (j == lane + 32 * i) {
              my_id[i] = best;
              my_w[i] = w;
            }
        });
#pragma unroll
        for (int i = 0; i < kGateSlots; ++i) {
          const int32_t j = lane + 32 * i;
          if (j >= k) break;
          id_row[j] = my_id[i];
          ids[t * k + j] = my_id[i];
          weights[t * k + j] = s.renormalize ? my_w[i] / wsum : my_w[i];
        }
      } else if (lane == 0) {
        route_token_serial(a, lrow, t, id_row);
      }
    }
    __syncthreads();
    // Ranks in token order: warp 0 walks the chunk's n·k choices 32 at a time; the lanes holding the same
    // expert rank among themselves by lane (match_any), after that expert's count so far.
    if (warp == 0) {
      const int32_t nk = n * k;
      for (int32_t c = 0; c < nk; c += 32) {
        const int32_t i = c + lane;
        const int32_t e = i < nk ? ids_s[i] : -1;
        const unsigned same = __match_any_sync(kFullMask, e);
        const int32_t before = __popc(same & ((1u << lane) - 1u));
        const int32_t so_far = e >= 0 ? counts[e] : 0;
        __syncwarp();
        if (i < nk) slot[c0 * k + i] = e >= 0 ? so_far + before : -1;
        if (e >= 0 && before == 0) counts[e] = so_far + __popc(same);
        __syncwarp();
      }
    }
    __syncthreads();
  }
  auto* block_counts = reinterpret_cast<int32_t*>(a.p.local + a.ll.block_counts);
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) block_counts[int64_t(blockIdx.x) * E + e] = counts[e];
}

// ---- counts: exchange, offsets, task table ----------------------------------------------------------------
// out[i] = Σ_{j<i} in[j] for i < n and out[n] = the total, by one warp (in may be out).
__device__ void warp_exclusive_scan(const int32_t* in, int32_t n, int32_t* out, int lane) {
  int32_t carry = 0;
  for (int32_t c = 0; c < n; c += 32) {
    const int32_t v = c + lane < n ? in[c + lane] : 0;
    const int32_t inclusive = warp_inclusive_scan(v, lane);
    if (c + lane < n) out[c + lane] = carry + inclusive - v;
    carry += __shfl_sync(kFullMask, inclusive, 31);
  }
  if (lane == 0) out[n] = carry;
}

__device__ void counts_role(const KernelArgs& a, uint8_t* scratch, uint8_t* tables, uint32_t epoch) {
  const flash::Shape& s = a.p.shape;
  const int32_t E = s.experts, k = s.top_k, W = s.world, Le = s.local_experts(), me = a.p.rank;
  const uint32_t parity = epoch & 1;
  const ScratchLayout sc = scratch_layout(E, k, W);
  const TableLayout tl = table_layout(Le, W);
  int32_t* routed = reinterpret_cast<int32_t*>(scratch + sc.counts);
  int32_t* base = reinterpret_cast<int32_t*>(scratch + sc.base);
  int32_t* dst_base = reinterpret_cast<int32_t*>(scratch + sc.dst_base);
  int32_t* kept = reinterpret_cast<int32_t*>(scratch + sc.kept);
  int32_t* column = reinterpret_cast<int32_t*>(scratch + sc.column);
  int32_t* begin = reinterpret_cast<int32_t*>(scratch + sc.begin);
  const auto* block_counts = reinterpret_cast<const int32_t*>(a.p.local + a.ll.block_counts);

  // base[e] = Σ of earlier blocks' counts, routed[e] = Σ of all: every thread takes a strided share of the
  // blocks of one expert (independent loads in flight), summed in shared memory.
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    base[e] = 0;
    routed[e] = 0;
  }
  __syncthreads();
  {
    const int32_t lanes_per_expert = max(1, int32_t(blockDim.x) / E);
    const int32_t G = int32_t(gridDim.x);
    for (int32_t i = threadIdx.x; i < E * lanes_per_expert; i += blockDim.x) {
      const int32_t e = i % E, part = i / E;
      int32_t before = 0, total = 0;
#pragma unroll 4
      for (int32_t b = part; b < G; b += lanes_per_expert) {
        const int32_t c = __ldcg(block_counts + int64_t(b) * E + e);  // other blocks wrote it (L2, not L1)
        before += b < int32_t(blockIdx.x) ? c : 0;
        total += c;
      }
      atomicAdd(base + e, before);
      atomicAdd(routed + e, total);
    }
  }
  __syncthreads();
  if (blockIdx.x == 0)
    for (int32_t i = threadIdx.x; i < W * E; i += blockDim.x) {
      const int32_t d = i / E, e = i % E;
      uint64_t* inbox = reinterpret_cast<uint64_t*>(peer_base(a, d) + a.sl.counts) + size_t(parity) * W * E;
      st_relaxed_sys(inbox + size_t(me) * E + e, flash::make_signal(epoch, uint32_t(routed[e])));
    }
  const uint64_t* inbox = reinterpret_cast<const uint64_t*>(a.p.symmetric + a.sl.counts) + size_t(parity) * W * E;
  for (int32_t i = threadIdx.x; i < W * E; i += blockDim.x) {
    const uint64_t v = wait_flag([&] { return ld_relaxed_sys(inbox + i); },
                                 [&](uint64_t seen) { return flash::signal_epoch(seen) == epoch; }, a,
                                 flash::kRoleCounts, flash::kWaitCounts, i / E, flash::make_signal(epoch, 0));
    const int64_t n = flash::signal_value(v);
    kept[i] = int32_t(s.capacity < 0 ? n : min(n, s.capacity));
  }
  __syncthreads();
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t c = 0;
    for (int32_t src = 0; src < W; ++src) c += kept[src * E + e];
    column[e] = c;
  }
  __syncthreads();
  // Three warps at once (a thread walking E or Le serially took ~10 µs of this phase at E = 128):
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int32_t* prefix = reinterpret_cast<int32_t*>(scratch + sc.prefix);
  int32_t* tiles = reinterpret_cast<int32_t*>(scratch + sc.tiles);
  if (warp == 0) {
    // begin[e] = rows of the experts of e's owner that precede e: the exclusive prefix of column, less its
    // value at the owner's first expert.
    warp_exclusive_scan(column, E, prefix, lane);
    __syncwarp();
    for (int32_t e = lane; e < E; e += 32) begin[e] = prefix[e] - prefix[e - e % Le];
  } else if (warp == 1) {
    // the rows this rank sends, all of which come back (the combine's target)
    uint32_t mine = 0;
    for (int32_t e = lane; e < E; e += 32) mine += uint32_t(kept[me * E + e]);
    mine = __reduce_add_sync(kFullMask, mine);
    if (lane == 0) reinterpret_cast<uint64_t*>(tables + tl.scalars)[0] = mine;
  } else if (warp == 2) {
    // the task table (core/flash_protocol.hpp: task_table_entry), from the local experts' row tiles
    for (int32_t le = lane; le < Le; le += 32) tiles[le] = flash::row_tiles(column[me * Le + le]);
    __syncwarp();
    warp_exclusive_scan(tiles, Le, tiles, lane);
    __syncwarp();
    for (int32_t le = lane; le <= Le; le += 32)
      flash::task_table_entry(le, tiles, Le, s.up_col_tiles(), s.down_col_tiles(),
                              reinterpret_cast<int32_t*>(tables + tl.offsets),
                              reinterpret_cast<int32_t*>(tables + tl.row_tile_base));
  }
  __syncthreads();
  int32_t* expert_rows = reinterpret_cast<int32_t*>(tables + tl.expert_rows);
  int32_t* expert_begin = reinterpret_cast<int32_t*>(tables + tl.expert_begin);
  int32_t* seg_begin = reinterpret_cast<int32_t*>(tables + tl.seg_begin);
  for (int32_t e = threadIdx.x; e < E; e += blockDim.x) {
    int32_t before_me = 0;
    for (int32_t src = 0; src < me; ++src) before_me += kept[src * E + e];
    dst_base[e] = begin[e] + before_me + base[e];
  }
  for (int32_t le = threadIdx.x; le < Le; le += blockDim.x) {
    const int32_t e = me * Le + le;
    expert_rows[le] = column[e];
    expert_begin[le] = begin[e];
    int32_t at = 0;
    for (int32_t src = 0; src < W; ++src) {
      seg_begin[le * (W + 1) + src] = at;
      at += kept[src * E + e];
    }
    seg_begin[le * (W + 1) + W] = at;
  }
  __syncthreads();
}

// ---- dispatch ----------------------------------------------------------------------------------------------
__device__ void dispatch_role(const KernelArgs& a, uint8_t* scratch, int64_t t_begin, int64_t t_end, uint32_t epoch) {
  const flash::Shape& s = a.p.shape;
  const int32_t E = s.experts, k = s.top_k, W = s.world, Le = s.local_experts(), me = a.p.rank;
  const int64_t H = s.hidden, R = a.recv_rows;
  const uint32_t parity = epoch & 1;
  const ScratchLayout sc = scratch_layout(E, k, W);
  const int32_t* base = reinterpret_cast<const int32_t*>(scratch + sc.base);
  const int32_t* dst_base = reinterpret_cast<const int32_t*>(scratch + sc.dst_base);
  const auto* ids = reinterpret_cast<const int32_t*>(a.p.local + a.ll.ids);
  auto* slot = reinterpret_cast<int32_t*>(a.p.local + a.ll.slot);
  const __nv_bfloat16* x = bf(a.p.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t chunks = H / 8;  // 16-byte chunks per row

  for (int64_t i = t_begin * k + warp; i < t_end * k; i += kThreads / 32) {
    const int32_t e = ids[i];
    const int32_t local_rank = slot[i];
    const bool kept = e >= 0 && local_rank >= 0 && (s.capacity < 0 || int64_t(base[e]) + local_rank < s.capacity);
    if (!kept) {
      if (lane == 0) slot[i] = -1;
      continue;
    }
    const int32_t d = e / Le;
    const int64_t row = int64_t(dst_base[e]) + local_rank;
    char* peer = peer_base(a, d);
    const uint4* src = reinterpret_cast<const uint4*>(x + (i / k) * H);
    uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<__nv_bfloat16*>(peer + a.sl.recv) + (parity * R + row) * H);
    for (int64_t c = lane; c < chunks; c += 32) dst[c] = __ldg(src + c);
    if (lane == 0) {
      auto* meta = reinterpret_cast<flash::RowMeta*>(peer + a.sl.meta) + parity * R + row;
      *meta = flash::RowMeta{me, int32_t(i)};
      // Train forwards: where the row went, for the backward's direct stores and in-place reads.
      if (s.train) reinterpret_cast<int32_t*>(a.p.local + a.ll.dest_row)[i] = int32_t(row);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    const uint64_t done = atomic_add_acq_rel_gpu(&control(a)->dispatch_done, 1) + 1;
    if (done == uint64_t(epoch) * gridDim.x) {  // the last block: every row of this rank has been written
      fence_acq_rel_sys();
      for (int32_t d = 0; d < W; ++d) {
        uint64_t* ready = reinterpret_cast<uint64_t*>(peer_base(a, d) + a.sl.ready) + parity * W + me;
        st_release_sys(ready, flash::make_signal(epoch, 1));
      }
    }
  }
}

// ---- combine (the consumer warpgroups, threads 128..383): once every row of this rank's tokens is back ----------------------------------
__device__ void combine_role(const KernelArgs& a, uint8_t* tables, int64_t t_begin, int64_t t_end, uint32_t epoch) {
  const flash::Shape& s = a.p.shape;
  const int32_t k = s.top_k, Le = s.local_experts(), W = s.world;
  const int64_t H = s.hidden;
  const TableLayout tl = table_layout(Le, W);
  const uint64_t target = reinterpret_cast<const uint64_t*>(tables + tl.scalars)[0] * uint64_t(s.down_col_tiles());
  if (threadIdx.x == 128) {
    const uint64_t* arrived = reinterpret_cast<const uint64_t*>(a.p.symmetric + a.sl.arrived);
    wait_flag([&] { return ld_acquire_sys(arrived); }, [&](uint64_t v) { return v == target; }, a,
              flash::kRoleCombine, flash::kWaitArrived, -1, target);
    stamp(a, flash::kStampArrived);
  }
  asm volatile("bar.sync 3, 256;" ::: "memory");
  const auto* weights = reinterpret_cast<const float*>(a.p.local + a.ll.weights);
  const auto* slot = reinterpret_cast<const int32_t*>(a.p.local + a.ll.slot);
  const __nv_bfloat16* out = reinterpret_cast<const __nv_bfloat16*>(a.p.symmetric + a.sl.out);
  __nv_bfloat16* y = static_cast<__nv_bfloat16*>(a.p.y);
  const int warp = (threadIdx.x - 128) / 32, lane = threadIdx.x % 32;  // flash::kCombineWarps warps
  const int64_t chunks = H / 8;  // 16-byte chunks of a row
  constexpr int kBatch = 4;      // chunks per lane in flight (flash::kCombineWideChunks = 32 lanes x kBatch)
  static_assert(flash::kCombineWideChunks == 32 * kBatch && flash::kCombineWarps == 8, "the combine's items");
  // Work items (flash::combine_items): a block's own tokens, a warp a token (the default), or (spread_combine)
  // column slices of every token over all the grid's consumer warps — `arrived` counts the whole rank's rows, so
  // any block may sum any token; at decode sizes one warp walking the token's k rows took ~14 us on an H100 (T = 1).
  const flash::CombineItems items = flash::combine_items(s, blockIdx.x, gridDim.x, warp, t_begin, t_end);
  const int64_t slices = items.slices(chunks);
  for (int64_t item = items.first; item < items.end; item += items.step) {
    const int64_t t = item / slices, c_lo = (item % slices) * items.slice, c_hi = min(chunks, c_lo + items.slice);
    for (int64_t c0 = c_lo + lane; c0 < c_hi; c0 += 32 * kBatch) {
      float accy[kBatch][8];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int i = 0; i < 8; ++i) accy[u][i] = 0.f;
      for (int32_t j = 0; j < k; ++j) {
        // Past L1: with spread_combine the token's weights and drop marks were written by another block (the gate,
        // the dispatch), and this block's own dispatch may have cached their line before they were.
        if (__ldcg(slot + t * k + j) < 0) continue;  // dropped: contributes nothing
        const float w = __ldcg(weights + t * k + j);
        const uint4* row = reinterpret_cast<const uint4*>(out + (t * k + j) * H);
        uint4 raw[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          raw[u] = c0 + 32 * u < c_hi ? __ldcg(row + c0 + 32 * u) : make_uint4(0, 0, 0, 0);  // written by peers
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const uint32_t words[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
          for (int wi = 0; wi < 4; ++wi) {
            accy[u][2 * wi] += w * WordCodec<__nv_bfloat16>::get(words[wi], 0);
            accy[u][2 * wi + 1] += w * WordCodec<__nv_bfloat16>::get(words[wi], 1);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (c0 + 32 * u >= c_hi) break;
        uint32_t packed[4];
#pragma unroll
        for (int wi = 0; wi < 4; ++wi) packed[wi] = WordCodec<__nv_bfloat16>::pack(&accy[u][2 * wi]);
        reinterpret_cast<uint4*>(y + t * H)[c0 + 32 * u] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
    }
  }
  asm volatile("bar.sync 3, 256;" ::: "memory");
  if (threadIdx.x == 128) {
    stamp(a, flash::kStampCombined);
    flash::Control* ctl = control(a);
    const uint64_t done = atomic_add_acq_rel_gpu(&ctl->exit_count, 1) + 1;
    if (done == uint64_t(epoch) * gridDim.x) *reinterpret_cast<volatile uint32_t*>(&ctl->epoch) = epoch;
  }
}

// ---- processors: the tile engine over the task table -------------------------------------------------------

template <Activation A>
__device__ void processor_role(const KernelArgs& a, const TileMaps& maps, uint8_t* smem, uint8_t* tables,
                               int64_t t_begin, int64_t t_end, uint32_t epoch) {
  constexpr bool kGated = A == Activation::swiglu;
  constexpr int kUpOut = kGated ? kTileCols / 2 : kTileCols;  // h columns per up tile
  const flash::Shape& s = a.p.shape;
  const int32_t W = s.world, Le = s.local_experts();
  const int64_t H = s.hidden, I = s.ffn, R = a.recv_rows;
  const uint32_t parity = epoch & 1;
  const TableLayout tl = table_layout(Le, W);
  const int32_t* offsets = reinterpret_cast<const int32_t*>(tables + tl.offsets);
  const int32_t* row_tile_base = reinterpret_cast<const int32_t*>(tables + tl.row_tile_base);
  const int32_t* expert_rows = reinterpret_cast<const int32_t*>(tables + tl.expert_rows);
  const int32_t* expert_begin = reinterpret_cast<const int32_t*>(tables + tl.expert_begin);
  const int32_t* seg_begin = reinterpret_cast<const int32_t*>(tables + tl.seg_begin);
  const int32_t tasks = offsets[2 * Le];
  const int32_t up_cols = s.up_col_tiles(), down_cols = s.down_col_tiles();
  auto* up_done = reinterpret_cast<uint32_t*>(a.p.local + a.ll.up_done);
  flash::Control* ctl = control(a);

  const uint32_t slots = smem_u32(smem);
  const uint32_t bars = slots + kRingBytes;
  auto slot_a = [&](int st) { return slots + st * kStageBytes; };
  auto slot_b = [&](int st) { return slots + st * kStageBytes + kABytes; };
  auto full = [&](int st) { return bars + 8 * st; };
  auto empty = [&](int st) { return bars + 8 * (kStages + st); };
  auto tile_full = [&](int r) { return bars + 8 * (2 * kStages + r); };
  auto tile_empty = [&](int r) { return bars + 8 * (2 * kStages + kTileRing + r); };
  const uint32_t tile_ring = bars + 8 * (2 * kStages + 2 * kTileRing);
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---- producer: scheduler (task indices) and subscriber (the task's inputs) ----
    // 64 registers: the subscriber's waits need more than the GEMM producer's 40 (ptxas spilled at 40-56);
    // the consumers get 216 (128·64 + 256·216 <= 64 Ki registers per SM) and do not spill there.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 64;");
    if (threadIdx.x == 0) {
      fence_async_shared();  // the ring held the gate's and dispatch's tables (generic writes) until now
      uint64_t landed = 0;  // sources whose ready signal this block has seen (W <= 64; else always re-read)
      uint64_t waited_ns = 0, tasks_run = 0;
      int32_t next = int32_t(blockIdx.x);
      uint32_t it = 0;
      for (uint32_t i = 0;; ++i) {
        const int32_t t = next < tasks ? next : -1;
        const int r = int(i % kTileRing);
        flash_mbar_wait(tile_empty(r), ((i / kTileRing) & 1) ^ 1, flash::kWaitRingEmpty, r, a, flash::kRoleProducer);
        st_shared_volatile(tile_ring + 4 * r, t);
        mbar_arrive(tile_full(r));
        if (t < 0) break;
        next = int32_t(gridDim.x) + int32_t(atomicAdd(&ctl->task_counter, 1u));
        ++tasks_run;
        const unsigned long long wait_start = a.p.profile != nullptr ? global_time_ns() : 0;
        const flash::Task task = flash::decode_task(offsets, row_tile_base, expert_rows, Le, t);
        const int32_t rows = expert_rows[task.expert];
        const int32_t lo = task.m_tile * kTileRows, hi = min(rows, lo + kTileRows);
        if (!task.down) {
          const int32_t* seg = seg_begin + task.expert * (W + 1);
          for (int32_t src = 0; src < W; ++src) {
            if (seg[src + 1] <= lo || seg[src] >= hi) continue;  // no rows of this source in the tile
            if (src < 64 && (landed >> src & 1)) continue;
            const uint64_t* ready = reinterpret_cast<const uint64_t*>(a.p.symmetric + a.sl.ready) + parity * W + src;
            wait_flag([&] { return ld_acquire_sys(ready); },
                      [&](uint64_t v) { return flash::signal_epoch(v) == epoch; }, a, flash::kRoleProducer,
                      flash::kWaitRowsReady, src, flash::make_signal(epoch, 1));
            if (src < 64) landed |= uint64_t(1) << src;
          }
        } else {
          const uint32_t* counter = up_done + task.row_tile;
          const uint64_t target = uint64_t(kConsumers) * uint64_t(up_cols);
          if (s.prefetch_down && uint64_t(ld_acquire_gpu(counter)) < target) {
            // The weights do not depend on h: while the row tile's up tiles finish, its w2 tile streams into L2
            // (at T = 1 the down phase waited for the whole up phase with a third of the blocks idle).
            const int32_t b_row = int32_t(int64_t(task.expert) * H + int64_t(task.n_tile) * kTileCols);
            for (int32_t kb = 0; kb < int32_t((I + kBK - 1) / kBK); ++kb) tma_prefetch_l2_2d(&maps.w2, kb * kBK, b_row);
          }
          wait_flag([&] { return uint64_t(ld_acquire_gpu(counter)); }, [&](uint64_t v) { return v >= target; }, a,
                    flash::kRoleProducer, flash::kWaitUpDone, task.row_tile, target);
        }
        if (a.p.profile != nullptr) waited_ns += global_time_ns() - wait_start;
        fence_proxy_async_global();  // rows written by other blocks/GPUs, read next by TMA
        const int32_t k_blocks = int32_t(((task.down ? I : H) + kBK - 1) / kBK);
        const int32_t a_row = int32_t(expert_begin[task.expert] + lo + (task.down ? 0 : int64_t(parity) * R));
        for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
          const int st = int(it % kStages);
          flash_mbar_wait(empty(st), ((it / kStages) & 1) ^ 1, flash::kWaitSlotEmpty, st, a, flash::kRoleProducer);
          mbar_expect_tx(full(st), kStageBytes);
          if (!task.down) {
            const int32_t b_row = int32_t(int64_t(task.expert) * I + int64_t(task.n_tile) * kUpOut);
            tma_load_2d(slot_a(st), &maps.recv, kb * kBK, a_row, full(st));
            tma_load_2d(slot_b(st), &maps.w1, kb * kBK, b_row, full(st));
            if constexpr (kGated) tma_load_2d(slot_b(st) + kUpOut * kRowBytes, &maps.w3, kb * kBK, b_row, full(st));
          } else {
            const int32_t b_row = int32_t(int64_t(task.expert) * H + int64_t(task.n_tile) * kTileCols);
            tma_load_2d(slot_a(st), &maps.h, kb * kBK, a_row, full(st));
            tma_load_2d(slot_b(st), &maps.w2, kb * kBK, b_row, full(st));
          }
        }
      }
      if (a.p.profile != nullptr) {
        a.p.profile[int64_t(blockIdx.x) * flash::kProfileSlots + flash::kProducerWaitNs] = waited_ns;
        a.p.profile[int64_t(blockIdx.x) * flash::kProfileSlots + flash::kTasksRun] = tasks_run;
      }
    }
    return;  // the producer warpgroup ends here, as the grouped GEMM's does
  }

  // ---- consumers ----
  asm volatile("setmaxnreg.inc.sync.aligned.u32 216;");
  const int consumer = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int q = lane % 4;
  float acc[kTileCols / 2];
  uint32_t it = 0;
  for (uint32_t i = 0;; ++i) {
    const int r = int(i % kTileRing);
    flash_mbar_wait(tile_full(r), (i / kTileRing) & 1, flash::kWaitRingFull, r, a, flash::kRoleConsumer);
    const int32_t t = ld_shared_volatile(tile_ring + 4 * r);
    mbar_arrive(tile_empty(r));
    if (i == 0 && threadIdx.x == 128) stamp(a, flash::kStampFirstTask);
    if (t < 0) break;
    const flash::Task task = flash::decode_task(offsets, row_tile_base, expert_rows, Le, t);
    const int32_t rows = expert_rows[task.expert];
    const int32_t begin = expert_begin[task.expert];
    const int32_t k_blocks = int32_t(((task.down ? I : H) + kBK - 1) / kBK);
    const bool skip = task.m_tile * kTileRows + consumer * 64 >= rows;
    if (skip) {
      for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
        const int st = int(it % kStages);
        if (a.p.skip_lag_ns != 0 && warp != 0) __nanosleep(a.p.skip_lag_ns);  // test aid: a late warp
        flash_mbar_wait(full(st), (it / kStages) & 1, flash::kWaitSlotFull, st, a, flash::kRoleConsumer);
        // Thread 0's arrival stands for all four warps: without a wgmma to tie them, a late warp could see the slot
        // refilled twice and wait a phase late (the own GEMM's skip path, docs/faults.md), so all four first.
        warpgroup_barrier(1 + consumer);
        if (threadIdx.x % 128 == 0) mbar_arrive(empty(st));
      }
    } else {
      int prev_slot = -1;
      for (int32_t kb = 0; kb < k_blocks; ++kb, ++it) {
        const int st = int(it % kStages);
        flash_mbar_wait(full(st), (it / kStages) & 1, flash::kWaitSlotFull, st, a, flash::kRoleConsumer);
        const uint32_t a_base = slot_a(st) + consumer * 64 * kRowBytes;
        const uint32_t b_base = slot_b(st);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk)
          Wgmma<kTileCols>::mma(acc, kmajor_swizzled_desc<kRowBytes>(a_base + kk * 32),
                                kmajor_swizzled_desc<kRowBytes>(b_base + kk * 32), (kb > 0 || kk > 0) ? 1 : 0);
        wgmma_commit();
        wgmma_wait<1>();
        if (prev_slot >= 0 && threadIdx.x % 128 == 0) mbar_arrive(empty(prev_slot));
        prev_slot = st;
      }
      wgmma_wait<0>();
      if (prev_slot >= 0 && threadIdx.x % 128 == 0) mbar_arrive(empty(prev_slot));
    }

    // Epilogue. Fragment (warp w, lane l): rows 16w + l/4 (+8), columns 8j + 2(l%4) + {0,1} for block j;
    // the lanes of a quad trade words so that each stores one whole 16-byte block.
    const int32_t row_in_expert = task.m_tile * kTileRows + consumer * 64 + warp * 16 + lane / 4;
    if (!task.down) {
      if (!skip) {
        __nv_bfloat16* h = reinterpret_cast<__nv_bfloat16*>(a.p.local + a.ll.h);
        // Train forwards keep the pre-activations (the stored bf16 values the activation read) for the backward.
        __nv_bfloat16* pre1 = s.train ? reinterpret_cast<__nv_bfloat16*>(a.p.local + a.ll.pre1) : nullptr;
        __nv_bfloat16* pre3 = s.train && kGated ? reinterpret_cast<__nv_bfloat16*>(a.p.local + a.ll.pre3) : nullptr;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int32_t rr = row_in_expert + 8 * half;
          const bool row_ok = rr < rows;
          const int64_t row = int64_t(begin + rr) * I;
#pragma unroll
          for (int jq = 0; jq < kUpOut / 32; ++jq) {
            uint32_t wh[4], wp1[4], wp3[4];
#pragma unroll
            for (int j4 = 0; j4 < 4; ++j4) {
              const int j = 4 * jq + j4;
              const __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
              wp1[j4] = bf162_bits(v);
              wp3[j4] = 0;
              float h0 = act_value<A>(__low2float(v)), h1 = act_value<A>(__high2float(v));
              if constexpr (kGated) {
                const int ju = j + kUpOut / 8;
                const __nv_bfloat162 u = __floats2bfloat162_rn(acc[4 * ju + 2 * half], acc[4 * ju + 2 * half + 1]);
                wp3[j4] = bf162_bits(u);
                h0 *= __low2float(u);
                h1 *= __high2float(u);
              }
              wh[j4] = bf162_bits(__floats2bfloat162_rn(h0, h1));
            }
            const int64_t col = int64_t(task.n_tile) * kUpOut + 8 * (4 * jq + q);
            const uint4 oh = quad_transpose(wh, q);
            if (row_ok && col < I) *reinterpret_cast<uint4*>(h + row + col) = oh;
            if (pre1 != nullptr) {  // warp-uniform: every lane takes part in the quad transposes
              const uint4 o1 = quad_transpose(wp1, q);
              if (row_ok && col < I) *reinterpret_cast<uint4*>(pre1 + row + col) = o1;
              if constexpr (kGated) {
                const uint4 o3 = quad_transpose(wp3, q);
                if (row_ok && col < I) *reinterpret_cast<uint4*>(pre3 + row + col) = o3;
              }
            }
          }
        }
      }
      warpgroup_barrier(1 + consumer);
      if (threadIdx.x % 128 == 0) atomic_add_release_gpu(up_done + task.row_tile, 1u);
    } else {
      if (!skip) {
        const flash::RowMeta* meta = reinterpret_cast<const flash::RowMeta*>(a.p.symmetric + a.sl.meta) + parity * R;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int32_t rr = row_in_expert + 8 * half;
          const bool row_ok = rr < rows;
          __nv_bfloat16* dst = nullptr;
          if (row_ok) {
            const int2 m = __ldcg(reinterpret_cast<const int2*>(meta + begin + rr));
            dst = reinterpret_cast<__nv_bfloat16*>(peer_base(a, m.x) + a.sl.out) + int64_t(m.y) * H;
          }
#pragma unroll
          for (int jq = 0; jq < kTileCols / 32; ++jq) {
            uint32_t wc[4];
#pragma unroll
            for (int j4 = 0; j4 < 4; ++j4) {
              const int j = 4 * jq + j4;
              wc[j4] = bf162_bits(__floats2bfloat162_rn(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]));
            }
            const int64_t col = int64_t(task.n_tile) * kTileCols + 8 * (4 * jq + q);
            const uint4 oc = quad_transpose(wc, q);
            if (row_ok && col < H) *reinterpret_cast<uint4*>(dst + col) = oc;
          }
        }
        warpgroup_barrier(1 + consumer);
        if (threadIdx.x % 128 == 0) {
          // This warpgroup's 64 rows, by source: add them to each home's arrival count.
          fence_acq_rel_sys();
          const int32_t lo = task.m_tile * kTileRows + consumer * 64, hi = min(rows, lo + 64);
          const int32_t* seg = seg_begin + task.expert * (W + 1);
          for (int32_t src = 0; src < W; ++src) {
            const int32_t n = min(hi, seg[src + 1]) - max(lo, seg[src]);
            if (n > 0) atomic_add_release_sys(reinterpret_cast<uint64_t*>(peer_base(a, src) + a.sl.arrived), uint64_t(n));
          }
        }
      }
    }
  }

  if (threadIdx.x == 128) stamp(a, flash::kStampTasksDone);
  asm volatile("bar.sync 3, 256;" ::: "memory");  // both consumer warpgroups: no task left
  combine_role(a, tables, t_begin, t_end, epoch);
}

#endif  // DMOE_SM90A_DEVICE

template <Activation A>
__global__ void __launch_bounds__(kThreads, 1)
    flash_forward_kernel(const __grid_constant__ TileMaps maps, const __grid_constant__ KernelArgs a) {
#ifdef DMOE_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tables = smem + kRingBytes + 256;
  uint64_t* epoch_s = reinterpret_cast<uint64_t*>(tables + table_layout(a.p.shape.local_experts(), a.p.shape.world).scalars) + 2;
  const flash::Shape& s = a.p.shape;
  // This block's tokens: an even split, in order.
  const int64_t per = (s.tokens + gridDim.x - 1) / gridDim.x;
  const int64_t t_begin = min(s.tokens, int64_t(blockIdx.x) * per), t_end = min(s.tokens, t_begin + per);

  if (threadIdx.x == 0) {
    flash::Control* ctl = control(a);
    *epoch_s = *reinterpret_cast<volatile uint32_t*>(&ctl->epoch) + 1;
    if (blockIdx.x == 0) {
      ctl->task_counter = 0;
      // No peer adds to `arrived` before it has this forward's rows, which leave after the grid barrier.
      *reinterpret_cast<volatile uint64_t*>(a.p.symmetric + a.sl.arrived) = 0;
    }
    const uint32_t bars = smem_u32(smem) + kRingBytes;
    for (int st = 0; st < kStages; ++st) {
      mbar_init(bars + 8 * st, 1);
      mbar_init(bars + 8 * (kStages + st), kConsumers);
    }
    for (int r = 0; r < kTileRing; ++r) {
      mbar_init(bars + 8 * (2 * kStages + r), 1);
      mbar_init(bars + 8 * (2 * kStages + kTileRing + r), kConsumers * 128);
    }
    for (int st = 0; st < kMaxGateStages; ++st) mbar_init(bars + kGateBarrierOffset + 8 * st, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&maps.recv)) : "memory");
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(&maps.w1)) : "memory");
  }
  {
    auto* up_done = reinterpret_cast<uint32_t*>(a.p.local + a.ll.up_done);
    const int64_t n = s.max_row_tiles();
    for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads)
      up_done[i] = 0;
  }
  __syncthreads();
  const uint32_t epoch = uint32_t(*epoch_s);
  if (threadIdx.x == 0) stamp(a, flash::kStampStart);
  if (s.split_gate) {
    split_gate_partials(a, maps, smem);
    gate_barrier(a, epoch);
  }
  gate_role(a, maps, smem, t_begin, t_end);
  if (threadIdx.x == 0) stamp(a, flash::kStampGate);
  grid_barrier(a, epoch);
  if (threadIdx.x == 0) stamp(a, flash::kStampBarrier);
  counts_role(a, smem, tables, epoch);
  if (threadIdx.x == 0) stamp(a, flash::kStampCounts);
  dispatch_role(a, smem, t_begin, t_end, epoch);
  __syncthreads();  // the ring region is the tile engine's from here on
  if (threadIdx.x == 0) stamp(a, flash::kStampDispatch);
  processor_role<A>(a, maps, smem, tables, t_begin, t_end, epoch);  // ends with the combine (consumers)
#endif
}

void describe_flash_wait(const DeviceWaitRecord& r, char* text, unsigned long size) {
  std::snprintf(text, size,
                "; the Flash kernel on rank %d (block %d, thread %d, role: %s) waited more than %llu ms for %s "
                "(slot %d): expected %#llx, last seen %#llx (a signal is epoch << 32 | value). A peer rank that "
                "failed or never launched the same forward leaves its signals behind; raise "
                "DMOE_GPU_WAIT_TIMEOUT_MS only if the GPU is shared and slow",
                r.rank, r.block, r.thread, flash::role_name(r.role), r.waited_ms, flash::wait_name(r.what), r.slot,
                r.expected, r.seen);
}

template <Activation A>
void launch(const KernelArgs& args, const TileMaps& maps, cudaStream_t stream) {
  const auto kernel = flash_forward_kernel<A>;
  const int smem = smem_bytes_for(args.p.shape);
  static std::mutex mutex;
  static std::vector<bool> attribute_set;
  {
    int device = 0;
    DMOE_CHECK_CUDA(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    if (int(attribute_set.size()) <= device) attribute_set.resize(device + 1, false);
    if (!attribute_set[device]) {
      DMOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
      attribute_set[device] = true;
    }
  }
  void* kernel_args[] = {const_cast<TileMaps*>(&maps), const_cast<KernelArgs*>(&args)};
  DMOE_CHECK_CUDA(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(args.p.shape.grid),
                                              dim3(kThreads), kernel_args, size_t(smem), stream));
}

template <Activation A>
int max_blocks_per_sm(int smem) {
  int blocks = 0;
  DMOE_CHECK_CUDA(cudaFuncSetAttribute(flash_forward_kernel<A>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem));
  DMOE_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, flash_forward_kernel<A>, kThreads, size_t(smem)));
  return blocks;
}

}  // namespace

std::string flash_unusable_reason(const flash::Shape& s) {
  char text[512];
  if (s.storage != DType::bf16) return "Flash runs bf16 storage only (dtype f32 is served by the EP engine)";
  if (s.hidden % 16 != 0) {
    std::snprintf(text, sizeof(text), "hidden = %lld is not a multiple of 16 (the gate's tensor-core steps)",
                  (long long)s.hidden);
    return text;
  }
  if (s.ffn % 8 != 0) {
    std::snprintf(text, sizeof(text), "ffn = %lld is not a multiple of 8 (TMA row strides)", (long long)s.ffn);
    return text;
  }
  if (s.recv_rows() * 2 + kTileRows >= (int64_t(1) << 31) || int64_t(s.local_experts()) * std::max(s.hidden, s.ffn) >= (int64_t(1) << 31))
    return "the receive buffer or the weights exceed TMA's 32-bit row coordinates";
  if (s.experts > kMaxGateExperts) {
    std::snprintf(text, sizeof(text), "E = %d experts: the gate's warps hold at most %d", s.experts,
                  kMaxGateExperts);
    return text;
  }
  if (scratch_layout(s.experts, s.top_k, s.world).bytes > kRingBytes) {
    std::snprintf(text, sizeof(text), "E = %d, k = %d, W = %d: the gate's and dispatch's tables (%d bytes) exceed the %d "
                  "bytes of shared memory they borrow", s.experts, s.top_k, s.world,
                  scratch_layout(s.experts, s.top_k, s.world).bytes, kRingBytes);
    return text;
  }
  if (smem_bytes_for(s) > kMaxSmem) {
    std::snprintf(text, sizeof(text), "E/W = %d local experts at W = %d: the task tables need %d bytes of shared "
                  "memory, more than the %d a block has", s.local_experts(), s.world, smem_bytes_for(s), kMaxSmem);
    return text;
  }
  if (!device_info().usable) return "needs an sm_90 GPU (H100/H200) and a build for sm_90a (DMOE_CUDA_ARCH=90a)";
  return "";
}

int32_t flash_grid_blocks(const flash::Shape& s) {
  const int smem = smem_bytes_for(s);
  int per_sm = 0;
  switch (s.activation) {
    case Activation::relu: per_sm = max_blocks_per_sm<Activation::relu>(smem); break;
    case Activation::gelu: per_sm = max_blocks_per_sm<Activation::gelu>(smem); break;
    case Activation::swiglu: per_sm = max_blocks_per_sm<Activation::swiglu>(smem); break;
  }
  DMOE_CUDA_REQUIRE(per_sm >= 1, "flash: the kernel does not fit on a multiprocessor (%d bytes of shared memory)", smem);
  int32_t grid = int32_t(device_info().sms * per_sm);
  // Ranks sharing a GPU (MPS): each client's share of the SMs is a cap, not a reservation, and another rank's
  // kernel that spins on this rank (an NVSHMEM barrier, or its own Flash kernel) can hold SMs of the shares'
  // sum. A grid that needs its whole share can then never become resident while the other rank waits for it:
  // seen on the H200 at W = 2 with 66 of 66 blocks (trap at the grid barrier). Leave a quarter free.
  const char* shared = std::getenv("DMOE_SHARED_GPUS");
  const char* mps_share = std::getenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE");
  if ((shared && std::string(shared) == "1") || (mps_share && std::atof(mps_share) < 100))
    grid = std::max(1, grid * 3 / 4);
  if (const int64_t forced = env_integer("DMOE_FLASH_GRID", 1, (int64_t(1) << 31) - 1, 0, "blocks")) {
    if (forced > grid)
      fail_input("DMOE_FLASH_GRID=%lld is more blocks than can be resident here; allowed: 1 to %d", (long long)forced,
                 grid);
    grid = int32_t(forced);
  }
  return grid;
}

bool flash_split_gate(const flash::Shape& s) {
  // Unset means auto (measured on an H100 in the twenty-eighth session, docs/perf.md: decode T = 1 forward -7 %):
  // the rule below; split forces it, block keeps each block's own loop.
  const std::string mode = env_choice("DMOE_FLASH_GATE", {"auto", "split", "block"}, "auto");
  const bool fits = s.split_gate_items() <= int64_t(s.grid);
  if (mode == "block") return false;
  if (mode == "split") {
    if (!fits)
      fail_input("DMOE_FLASH_GATE=split needs a block per gate item: ceil(T/64)*ceil(H/64) = %lld items for T = %lld, "
                 "H = %lld, but the grid has %d blocks; allowed here: auto or block", (long long)s.split_gate_items(),
                 (long long)s.tokens, (long long)s.hidden, s.grid);
    return true;
  }
  return fits && s.gate_column_chunks() >= 16;
}

bool flash_prefetch_down() {
  // Off: measured on an H100 in the twenty-eighth session (docs/perf.md), the hint slowed decode T = 1 by 7 % (the
  // prefetches compete with the up tiles' own weight stream, which is what bounds the time).
  return env_choice("DMOE_FLASH_PREFETCH", {"0", "1"}, "0") == "1";
}

bool flash_spread_combine() {
  // Unset means slice (measured on an H100 in the twenty-eighth session, docs/perf.md: the combine's tail at T = 1
  // 17 -> 5 us; large configs unchanged within noise).
  return env_choice("DMOE_FLASH_COMBINE", {"token", "slice"}, "slice") == "slice";
}

void flash_forward(const flash::Params& p, cudaStream_t stream) {
  const std::string why = flash_unusable_reason(p.shape);
  DMOE_CUDA_REQUIRE(why.empty(), "flash_forward: %s", why.c_str());
  static std::once_flag registered;
  std::call_once(registered, [] { set_wait_describer(kWaitFlash, describe_flash_wait); });
  const flash::Shape& s = p.shape;
  KernelArgs args{};
  args.p = p;
  args.recv_rows = s.recv_rows();
  args.sl = flash::symmetric_layout(s);
  args.ll = flash::local_layout(s);
  if (args.p.wait_record == nullptr) args.p.wait_record = device_wait_record();
  const int Le = s.local_experts();
  const int up_out = s.up_out_cols();
  TileMaps maps;
  maps.recv = make_kmajor_map(p.symmetric + args.sl.recv, 2 * args.recv_rows, s.hidden, kTileRows, kBK);
  maps.h = make_kmajor_map(p.local + args.ll.h, args.recv_rows, s.ffn, kTileRows, kBK);
  maps.w1 = make_kmajor_map(p.w1, int64_t(Le) * s.ffn, s.hidden, up_out, kBK);
  maps.w3 = s.activation == Activation::swiglu ? make_kmajor_map(p.w3, int64_t(Le) * s.ffn, s.hidden, up_out, kBK)
                                               : maps.w1;
  maps.w2 = make_kmajor_map(p.w2, int64_t(Le) * s.hidden, s.ffn, kTileCols, kBK);
  maps.x = make_kmajor_map(p.x, s.tokens, s.hidden, kGateTokens, kBK);
  maps.gate = make_kmajor_map(p.gate, s.experts, s.hidden, s.experts, kBK);
  switch (s.activation) {
    case Activation::relu: return launch<Activation::relu>(args, maps, stream);
    case Activation::gelu: return launch<Activation::gelu>(args, maps, stream);
    case Activation::swiglu: return launch<Activation::swiglu>(args, maps, stream);
  }
}

}  // namespace dmoe::cuda
