// core/flash_protocol.hpp — the Flash layer's protocol as plain data, for the host and the device: the
// signal word, row metadata, the task table (which tiles a rank's arrivals create and in which order they
// run), and the byte layout of every buffer. The CUDA kernel (flash/flash_kernel.cu) and its CPU twin
// (cpu/flash.cpp) both read these, so the layout and the scheduling logic are tested on the CPU.
//
// One forward on rank r, W ranks, epoch n (the forward's sequence number, 1, 2, ...; parity n & 1):
//   1. gate: ids/weights of r's tokens, per-block counts per expert;
//   2. counts: r writes signal(n, routed[e]) into every rank's inbox counts[parity][r][e];
//      every block waits for all W·E entries of epoch n and derives the same offsets everywhere;
//   3. dispatch: each kept (t, j) row goes to owner(e)'s recv[parity] at
//        expert_begin(e) + Σ_{s<r} kept[s][e] + (rank of t among r's tokens routed to e),
//      with meta {r, t·k + j}; then ready[parity][r] = signal(n, rows) at every destination;
//   4. tasks on each rank: up tiles (expert, row tile, column tile of the FFN width), then down tiles
//      (expert, row tile, column tile of H). An up tile waits for the sources whose rows it reads; a down
//      tile waits until every up tile of its row tile is done (up_done counter). A down tile stores its
//      rows straight into the home rank's `out` [T·k, H] and adds its rows to the home's `arrived`;
//   5. combine on the home: once arrived == kept rows · down column tiles, y[t] = Σ_j w[t,j]·out[t·k+j].
// Signals carry the epoch, so back-to-back forwards need no host barrier; buffers a peer may still read
// (recv, meta, counts, ready) alternate by parity. docs/flash.md has the ordering argument.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/config.hpp"
#include "core/dtype.hpp"

namespace dmoe::flash {

constexpr int32_t kTileRows = 128;  // rows of a task tile (two consumer warpgroups of 64 on the GPU)
constexpr int32_t kTileCols = 256;  // accumulator columns of a task tile
constexpr int32_t kGateChunkTokens = 64;  // tokens of one gate chunk (the kernel's mma row groups: 4 of 16)
constexpr int32_t kGateChunkCols = 64;    // columns of H in one gate chunk (one 128-byte-swizzled TMA box)

// ---- signal word: bits 63..32 the epoch, 31..0 a value (a count) ---------------------------------------
DMOE_HD constexpr uint64_t make_signal(uint32_t epoch, uint32_t value) { return (uint64_t(epoch) << 32) | value; }
DMOE_HD constexpr uint32_t signal_epoch(uint64_t s) { return uint32_t(s >> 32); }
DMOE_HD constexpr uint32_t signal_value(uint64_t s) { return uint32_t(s & 0xffffffffu); }

// Beside every received row: who sent it and which of its (token, choice) pairs it is.
struct RowMeta {
  int32_t source;        // sending rank
  int32_t token_choice;  // t·k + j on the source
};
static_assert(sizeof(RowMeta) == 8, "RowMeta is two int32");

// Counters and the epoch of one rank (device memory, local), zero before the first forward.
struct Control {
  uint64_t grid_barrier;   // blocks arrived at the barrier after the gate, over all forwards (n·G after n)
  uint64_t dispatch_done;  // blocks done sending rows, over all forwards
  uint64_t exit_count;     // blocks done, over all forwards; the last one advances `epoch`
  uint32_t epoch;          // the sequence number of the next forward minus one (0 before the first)
  uint32_t task_counter;   // the next task index handed out after the first wave (reset every forward)
  uint32_t error;          // first error seen (Error below), 0 = none; sticky until the engine reads it
  uint32_t error_detail;   // e.g. the token
  uint64_t gate_barrier;   // blocks arrived after the split gate's partial logits, over all forwards (n·G after n:
                           // an engine's forwards all split the gate or none does)
  uint64_t pad[2];
};
static_assert(sizeof(Control) == 64, "Control is one 64-byte block");

enum Error : uint32_t { kErrorNone = 0, kErrorNanRouting = 1 };

// What a kernel's time-out record names (cuda::DeviceWaitRecord::role / what).
enum Role : int32_t { kRoleGate = 1, kRoleCounts = 2, kRoleDispatch = 3, kRoleProducer = 4, kRoleConsumer = 5,
                      kRoleCombine = 6, kRoleBackward = 7 };
enum WaitWhat : int32_t { kWaitGridBarrier = 1, kWaitCounts = 2, kWaitRowsReady = 3, kWaitUpDone = 4,
                          kWaitArrived = 5, kWaitSlotFull = 6, kWaitSlotEmpty = 7, kWaitRingFull = 8,
                          kWaitRingEmpty = 9, kWaitGradReady = 10, kWaitDxReady = 11,
                          kWaitGateBarrier = 12 };
const char* role_name(int32_t role);
const char* wait_name(int32_t what);

// Where the time goes inside one forward (Params::profile): per block, the global timer (ns) at each
// phase boundary, and two counters. Written only when profiling is on.
enum ProfileSlot : int32_t {
  kStampStart = 0,     // the block starts
  kStampLogits,        // its tokens' router logits are computed
  kStampGate,          // its tokens are routed
  kStampBarrier,       // every block is routed (grid barrier)
  kStampCounts,        // every rank's counts are in; offsets and task table built
  kStampDispatch,      // its rows are sent
  kStampFirstTask,     // its consumers have their first task
  kStampTasksDone,     // its consumers have no task left
  kStampArrived,       // every row of this rank's tokens is back
  kStampCombined,      // its tokens are combined: the block ends
  kProducerWaitNs,     // ns its producer spent waiting for tasks' inputs (signals, up_done)
  kTasksRun,           // tasks its processor ran
  kProfileSlots
};

// ---- shape ------------------------------------------------------------------------------------------
struct Shape {
  int64_t tokens = 0;    // T: tokens per rank
  int64_t hidden = 0;    // H
  int64_t ffn = 0;       // I
  int32_t experts = 0;   // E (all ranks)
  int32_t top_k = 0;     // k
  int32_t world = 1;     // W
  int64_t capacity = -1; // rows one source may send one expert; -1 = dropless
  Activation activation = Activation::swiglu;
  bool renormalize = true;
  DType storage = DType::bf16;  // element type of x, y, weights and every row buffer
  int32_t element_bytes = 2;    // bytes of one stored element: dtype_size(storage) on the GPU, 4 on the CPU
                                // (whose twin holds f32 and emulates bf16 by rounding)
  int32_t grid = 1;      // blocks of the kernel (the CPU twin: 1)
  bool train = false;    // forwards keep what the backward reads (probabilities, lse, pre-activations) and the
                         // backward's buffers exist (flash_backward); false: inference only, smaller regions
  bool split_gate = false;  // the router logits' K columns split over the blocks (decode sizes; see
                            // split_gate_items): set by the engine (cuda::flash_split_gate, DMOE_FLASH_GATE), false
                            // on the CPU twin
  bool spread_combine = false;  // the combine's (token, column slice) items over every block's consumer warps instead
                                // of each block's own tokens (cuda::flash_spread_combine, DMOE_FLASH_COMBINE); the
                                // sums and their order are the same, so the CPU twin has no flag of its own
  bool prefetch_down = false;   // a down tile waiting for its up tiles fetches its w2 box into L2 meanwhile
                                // (cuda::flash_prefetch_down, DMOE_FLASH_PREFETCH; a hint: the same results)

  DMOE_HD int32_t local_experts() const { return experts / world; }
  // The split gate's work items: (64-token chunk, 64-column chunk of H) pairs, one per block; each block writes
  // its item's partial logits [64 tokens, E] (f32) and, after a grid barrier, the owner of a token sums that
  // token's partials in column-chunk order (deterministic). Used where a block's own tokens would otherwise take
  // many dependent rounds of column chunks (a token's whole H in one block: ~22 µs at H = 4096, docs/perf.md).
  DMOE_HD int64_t gate_column_chunks() const { return (hidden + kGateChunkCols - 1) / kGateChunkCols; }
  DMOE_HD int64_t split_gate_items() const {
    return (tokens + kGateChunkTokens - 1) / kGateChunkTokens * gate_column_chunks();
  }
  // Rows one rank can receive in one forward: every row routed to it by every source.
  DMOE_HD int64_t recv_rows() const {
    const int64_t all = int64_t(world) * tokens * top_k;
    if (capacity < 0) return all;
    const int64_t capped = int64_t(world) * local_experts() * capacity;
    return capped < all ? capped : all;
  }
  DMOE_HD int32_t up_out_cols() const { return activation == Activation::swiglu ? kTileCols / 2 : kTileCols; }
  DMOE_HD int32_t up_col_tiles() const { return int32_t((ffn + up_out_cols() - 1) / up_out_cols()); }
  DMOE_HD int32_t down_col_tiles() const { return int32_t((hidden + kTileCols - 1) / kTileCols); }
  // Row tiles of one rank's experts in the worst case (recv_rows spread so that each expert ends on a
  // partial tile): bounds the up_done counters.
  DMOE_HD int64_t max_row_tiles() const { return (recv_rows() + kTileRows - 1) / kTileRows + local_experts(); }
};

// Shape of one rank of `config` run with `grid` blocks.
Shape make_shape(const MoeConfig& config, int32_t grid);

DMOE_HD int32_t row_tiles(int64_t rows) { return int32_t((rows + kTileRows - 1) / kTileRows); }

// ---- combine work items --------------------------------------------------------------------------------
// The combine sums each token's k rows in 16-byte chunks (8 bf16 columns), a warp per work item; an item is a
// token's columns [c_lo, c_hi) in chunks. Without spread_combine, a block's own tokens [t_begin, t_end), whole
// rows, its kCombineWarps warps striding over them; with it, every token's slices over all the grid's warps (any
// block may sum any token), warp-major (item i on block i % grid, warp (i % (8·grid)) / grid: a few items land on
// as many blocks), slices of kCombineWideChunks while there is an item for every warp, else of
// kCombineNarrowChunks (one chunk a lane). Every (token, chunk) is one item's exactly once
// (tests/unit/test_flash_protocol.cpp); the kernel's loop is `for (i = first; i < end; i += step)`.
constexpr int32_t kCombineWarps = 8;          // consumer warps of a block
constexpr int64_t kCombineWideChunks = 128;   // 32 lanes x 4 chunks in flight
constexpr int64_t kCombineNarrowChunks = 32;  // one chunk a lane
struct CombineItems {
  int64_t slice = 0;  // chunks of one item
  int64_t first = 0, end = 0, step = 1;
  DMOE_HD int64_t slices(int64_t chunks) const { return (chunks + slice - 1) / slice; }
};
DMOE_HD CombineItems combine_items(const Shape& s, int64_t block, int64_t grid, int32_t warp, int64_t t_begin,
                                   int64_t t_end) {
  const int64_t chunks = s.hidden / 8;
  CombineItems c;
  if (!s.spread_combine) {
    c.slice = chunks;
    c.first = t_begin + warp;
    c.end = t_end;
    c.step = kCombineWarps;
    return c;
  }
  const int64_t warps = grid * kCombineWarps;
  const int64_t wide = (chunks + kCombineWideChunks - 1) / kCombineWideChunks;
  c.slice = s.tokens * wide >= warps ? kCombineWideChunks : kCombineNarrowChunks;
  c.first = int64_t(warp) * grid + block;  // warp-major: few items land on as many blocks (SMs) as there are items
  c.end = s.tokens * c.slices(chunks);
  c.step = warps;
  return c;
}

// ---- task table --------------------------------------------------------------------------------------
// Tasks of one rank, numbered: all up tiles (expert by expert; inside an expert, row tiles fastest within
// a column tile, so tiles running together share the weight slice), then all down tiles in the same
// order. Every down tile's dependencies (its row tile's up tiles) have lower numbers, and up tiles depend
// only on arrivals, so handing tasks out in number order to co-resident processors cannot deadlock.
//   offsets [2·Le + 1]: offsets[e] first up task of expert e, offsets[Le + e] first down task, [2Le] total
//   row_tile_base [Le + 1]: Σ of the row tiles of the experts before e (indexes the up_done counters)
DMOE_HD void build_task_table(const int32_t* expert_rows, int32_t local_experts, int32_t up_cols,
                                     int32_t down_cols, int32_t* offsets, int32_t* row_tile_base) {
  int32_t t = 0, base = 0;
  for (int32_t e = 0; e < local_experts; ++e) {
    offsets[e] = t;
    row_tile_base[e] = base;
    const int32_t m = row_tiles(expert_rows[e]);
    t += m * up_cols;
    base += m;
  }
  row_tile_base[local_experts] = base;
  for (int32_t e = 0; e < local_experts; ++e) {
    offsets[local_experts + e] = t;
    t += row_tiles(expert_rows[e]) * down_cols;
  }
  offsets[2 * local_experts] = t;
}

// Entry e of the same table from the exclusive prefix of the experts' row tiles (tile_prefix[e] = Σ_{e'<e}
// row_tiles(expert_rows[e']), tile_prefix[Le] = all), so that every thread can write one entry (Flash's counts
// phase); e = Le writes the totals. Equal to build_task_table (tests/unit/test_flash_protocol.cpp).
DMOE_HD void task_table_entry(int32_t e, const int32_t* tile_prefix, int32_t local_experts, int32_t up_cols,
                              int32_t down_cols, int32_t* offsets, int32_t* row_tile_base) {
  const int32_t all = tile_prefix[local_experts];
  row_tile_base[e] = tile_prefix[e];
  if (e < local_experts) {
    offsets[e] = tile_prefix[e] * up_cols;
    offsets[local_experts + e] = all * up_cols + tile_prefix[e] * down_cols;
  } else {
    offsets[2 * local_experts] = all * (up_cols + down_cols);
  }
}

struct Task {
  int32_t down;      // 0: up projection (+ activation), 1: down projection
  int32_t expert;    // local expert
  int32_t m_tile;    // row tile inside the expert's rows
  int32_t n_tile;    // column tile
  int32_t row_tile;  // row_tile_base[expert] + m_tile (the up_done counter)
};

DMOE_HD Task decode_task(const int32_t* offsets, const int32_t* row_tile_base, const int32_t* expert_rows,
                                int32_t local_experts, int32_t t) {
  // The group (2·Le of them: up of each expert, then down) whose range holds t; empty groups are skipped
  // by taking the last group starting at or before t.
  int32_t lo = 0, hi = 2 * local_experts - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  Task task;
  task.down = lo >= local_experts ? 1 : 0;
  task.expert = task.down ? lo - local_experts : lo;
  const int32_t m = row_tiles(expert_rows[task.expert]);
  const int32_t local = t - offsets[lo];
  task.m_tile = local % m;
  task.n_tile = local / m;
  task.row_tile = row_tile_base[task.expert] + task.m_tile;
  return task;
}

// ---- buffers -----------------------------------------------------------------------------------------
// Symmetric region (every rank allocates the same layout; peers write into it):
//   recv    [2][R, H]   storage   rows received, by parity; R = Shape::recv_rows()
//   meta    [2][R]      RowMeta   beside each received row
//   out     [T·k, H]    storage   expert outputs of this rank's (t, j), written by the experts' ranks
//   counts  [2][W, E]   u64       signal(epoch, rows source s routed to expert e, before capacity)
//   ready   [2][W]      u64       signal(epoch, rows source s sent here): all of them have landed
//   arrived [1]         u64       rows·down-column-tiles of `out` written so far in this forward
//   train only (Shape::train; empty otherwise), written and read by flash_backward:
//   grad_recv  [R, H]   storage  the received rows' gradients w[t,j]·dy[t], written by their homes at the rows'
//                                places (dest_row), the forward's order
//   dx_rows    [R, H]   storage  the received rows' input gradients, read by their homes in place
//   grad_ready [W]      u64      signal(epoch, 1) from source s: all its rows' gradients have landed here
//   dx_ready   [W]      u64      signal(epoch, 1) from expert rank d: its dx rows are complete
// Local region (this rank only):
//   h          [R, I]        storage  activations of the received rows
//   ids        [T, k]        i32      chosen experts
//   weights    [T, k]        f32      gate weights
//   slot       [T, k]        i32      rank of t among this rank's tokens routed to ids[t,j] (−1: dropped)
//   block_counts [G, E]      i32      tokens each block routed to each expert
//   up_done    [max_row_tiles] u32    finished up tiles (both halves) per row tile
//   peers      [W]           u64      every rank's symmetric region as this rank addresses it
//   control    [1]           Control
//   train only: probs [T, E] f32 and lse [T] f32 (the gate's), pre1 / pre3 [R, I] storage (the up products
//   before the activation; pre3 SwiGLU only), dest_row [T, k] i32 (the row of each kept (t, j) in its expert's
//   rank's recv, written by the dispatch), and the backward's own: dweights [T, k] f32, choice_slot [T, k] i32
//   (t·k + j, −1 dropped: the CPU twin's combine slots), dlogits [T, E] f32, dx_router [T, H] f32.
// Every part starts on a 256-byte boundary.
struct SymmetricLayout {
  size_t recv = 0, meta = 0, out = 0, counts = 0, ready = 0, arrived = 0;
  size_t grad_recv = 0, dx_rows = 0, grad_ready = 0, dx_ready = 0;
  size_t bytes = 0;
};
struct LocalLayout {
  size_t h = 0, ids = 0, weights = 0, slot = 0, block_counts = 0, up_done = 0, peers = 0, control = 0;
  size_t probs = 0, lse = 0, pre1 = 0, pre3 = 0, dest_row = 0, dweights = 0, choice_slot = 0, dlogits = 0,
         dx_router = 0;
  size_t gate_partial = 0;  // split gate: [gate_column_chunks, T, E] f32 partial logits (0 bytes otherwise)
  size_t bytes = 0;
};
SymmetricLayout symmetric_layout(const Shape& s);
LocalLayout local_layout(const Shape& s);

// Everything one forward of one rank reads and writes. Plain data: built on the host, passed by value to
// the kernel (device pointers) or to the CPU twin (host pointers, f32 storage).
struct Params {
  Shape shape;
  int32_t rank = 0;
  const void* x = nullptr;     // [T, H]
  const void* gate = nullptr;  // [E, H]
  const void* w1 = nullptr;    // [Le, I, H]
  const void* w3 = nullptr;    // [Le, I, H], SwiGLU only
  const void* w2 = nullptr;    // [Le, H, I]
  void* y = nullptr;           // [T, H]
  char* symmetric = nullptr;   // this rank's symmetric region
  char* local = nullptr;       // this rank's local region (holds the peers table and Control)
  unsigned long long timeout_ns = 10'000'000'000ull;  // every wait's limit
  void* wait_record = nullptr;  // GPU: cuda::DeviceWaitRecord (host-mapped)
  uint64_t* profile = nullptr;  // GPU, optional: [grid, kProfileSlots] (ProfileSlot); null = off
  uint32_t skip_lag_ns = 0;     // GPU test aid: warps 1-3 of a consumer skipping a task's rows sleep this long
                                // before each slot wait (FlashEngine::set_skip_lag_for_tests); 0 in real calls
};

// One backward of one rank, after its train forward (epoch n = Control::epoch, the forward's) and before the
// next forward: every rank runs the backward of the same forward. The steps (docs/flash.md, "The backward"):
//   1. home: for every kept (t, j): dweights[t,j] = <dy[t], out[t·k+j]>, and the row gradient w[t,j]·dy[t] stored straight
//      into its expert's rank, owner(e).grad_recv[dest_row[t,j]] (combine backward and dispatch in one pass);
//      then grad_ready[r] = signal(n, 1) at every rank;
//   2. experts' rank: waits for every source's grad_ready (its grad_recv is then the forward's expert batch of
//      gradients, the same order as recv);
//   3. expert backward over each local expert's rows (expert_ffn_backward: x = recv, pre1/pre3/h of the forward)
//      into dx_rows; then dx_ready[r] = signal(n, 1) at every rank;
//   4. home: waits for every rank's dx_ready; router backward (dlogits from dweights and the auxiliary terms,
//      dx_router = dlogits · gate, dgate += dlogitsᵀ · x); dx[t] = Σ_j owner(e).dx_rows[dest_row[t,j]] +
//      dx_router[t], read in place from the experts' ranks (scatter back and return in one pass).
// The load-balance term's expert fractions come from the count exchange already in every rank's inbox
// (routed counts of every source, before capacity), so the backward needs no collective of its own.
struct BackwardParams {
  Params forward;                 // the forward's (shape.train must be true), same buffers and weights
  const void* dy = nullptr;       // [T, H] storage
  void* dx = nullptr;             // [T, H] storage, overwritten
  void* dgate = nullptr;          // [E, H] accumulator (CPU f64, GPU f32): += this rank's part (not summed over ranks)
  void* dw1 = nullptr;            // [Le, I, H] accumulator
  void* dw3 = nullptr;            // [Le, I, H] accumulator, SwiGLU only
  void* dw2 = nullptr;            // [Le, H, I] accumulator
  bool accumulate = true;         // false: the experts' gradients are overwritten (zeros for experts without rows)
  // GPU, accumulate = false only: dw1/dw3/dw2 are bf16 (the storage dtype), each f32 product rounded once as it
  // is stored (Backend::expert_ffn_backward's dw_dtype); dgate stays f32. The CPU twin refuses it.
  bool experts_bf16 = false;
  double aux_loss_coef = 0;       // load-balance loss coefficient (0: no term)
  double z_loss_coef = 0;         // router z-loss coefficient (0: no term)
  // GPU, optional: kBackwardStages + 1 cudaEvent_t recorded on the stream at the stage boundaries (where the
  // time goes); null = off. The CPU twin ignores it.
  void* stage_events = nullptr;
  // GPU, optional: the forward's count inbox (counts[parity], W·E signals of epoch inbox_epoch) already read on
  // the host — by a caller that waited for the train forward anyway, for its losses —, so the backward issues its
  // launches without a stream wait. Null: the backward waits for the forward and reads it itself.
  const uint64_t* inbox_host = nullptr;
  uint32_t inbox_epoch = 0;
};

// The stages a profiled GPU backward records (BackwardParams::stage_events): the first is the host's read of
// the forward's counts (the stream idles meanwhile), then the protocol's steps.
constexpr int32_t kBackwardStages = 5;
const char* backward_stage_name(int32_t stage);

// From a rank's count inbox of one forward (counts[parity]: [W, E] signals, every source's routed counts): the
// row offsets of its local experts in recv / grad_recv / dx_rows (expert_offsets [Le + 1], kept rows), and every
// expert's routed assignments over all ranks (assigned [E], before capacity: the load-balance term's counts).
void backward_rows(const Shape& s, int32_t rank, const uint64_t* inbox, int64_t* expert_offsets, double* assigned);

}  // namespace dmoe::flash
