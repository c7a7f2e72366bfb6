// core/flash_protocol.cpp — buffer layouts and names of the Flash protocol (see flash_protocol.hpp).
#include "core/flash_protocol.hpp"

#include <algorithm>

#include "core/error.hpp"

namespace dmoe::flash {

namespace {

constexpr size_t kAlign = 256;

size_t carve(size_t& offset, size_t bytes) {
  const size_t at = offset;
  offset = (offset + bytes + kAlign - 1) / kAlign * kAlign;
  return at;
}

}  // namespace

Shape make_shape(const MoeConfig& c, int32_t grid) {
  DMOE_REQUIRE(grid >= 1, "flash: grid = {} blocks; must be >= 1", grid);
  Shape s;
  s.tokens = c.tokens;
  s.hidden = c.hidden;
  s.ffn = c.ffn;
  s.experts = c.experts;
  s.top_k = c.top_k;
  s.world = c.world;
  s.capacity = c.dropless() ? -1 : c.capacity();
  s.activation = c.activation;
  s.renormalize = c.renormalize;
  s.storage = c.dtype;
  s.element_bytes = int32_t(dtype_size(c.dtype));
  s.grid = grid;
  return s;
}

SymmetricLayout symmetric_layout(const Shape& s) {
  const size_t elem = size_t(s.element_bytes);
  const size_t R = size_t(s.recv_rows());
  SymmetricLayout l;
  size_t at = 0;
  l.recv = carve(at, 2 * R * size_t(s.hidden) * elem);
  l.meta = carve(at, 2 * R * sizeof(RowMeta));
  l.out = carve(at, size_t(s.tokens) * size_t(s.top_k) * size_t(s.hidden) * elem);
  l.counts = carve(at, 2 * size_t(s.world) * size_t(s.experts) * sizeof(uint64_t));
  l.ready = carve(at, 2 * size_t(s.world) * sizeof(uint64_t));
  l.arrived = carve(at, sizeof(uint64_t));
  const size_t train_w = s.train ? size_t(s.world) : 0;
  const size_t train_recv = s.train ? R : 0;
  l.grad_recv = carve(at, train_recv * size_t(s.hidden) * elem);
  l.dx_rows = carve(at, train_recv * size_t(s.hidden) * elem);
  l.grad_ready = carve(at, train_w * sizeof(uint64_t));
  l.dx_ready = carve(at, train_w * sizeof(uint64_t));
  l.bytes = at;
  return l;
}

LocalLayout local_layout(const Shape& s) {
  const size_t elem = size_t(s.element_bytes);
  const size_t R = size_t(s.recv_rows());
  const size_t tk = size_t(s.tokens) * size_t(s.top_k);
  LocalLayout l;
  size_t at = 0;
  l.h = carve(at, R * size_t(s.ffn) * elem);
  l.ids = carve(at, tk * sizeof(int32_t));
  l.weights = carve(at, tk * sizeof(float));
  l.slot = carve(at, tk * sizeof(int32_t));
  l.block_counts = carve(at, size_t(s.grid) * size_t(s.experts) * sizeof(int32_t));
  l.up_done = carve(at, size_t(s.max_row_tiles()) * sizeof(uint32_t));
  l.peers = carve(at, size_t(s.world) * sizeof(uint64_t));
  l.control = carve(at, sizeof(Control));
  const size_t T = s.train ? size_t(s.tokens) : 0, Rt = s.train ? R : 0, tkt = s.train ? tk : 0;
  l.probs = carve(at, T * size_t(s.experts) * sizeof(float));
  l.lse = carve(at, T * sizeof(float));
  l.pre1 = carve(at, Rt * size_t(s.ffn) * elem);
  l.pre3 = carve(at, (s.activation == Activation::swiglu ? Rt : 0) * size_t(s.ffn) * elem);
  l.dest_row = carve(at, tkt * sizeof(int32_t));
  l.dweights = carve(at, tkt * sizeof(float));
  l.choice_slot = carve(at, tkt * sizeof(int32_t));
  l.dlogits = carve(at, T * size_t(s.experts) * sizeof(float));
  l.dx_router = carve(at, T * size_t(s.hidden) * sizeof(float));
  l.gate_partial = carve(at, s.split_gate ? size_t(s.gate_column_chunks()) * size_t(s.tokens) * size_t(s.experts) *
                                                sizeof(float)
                                          : 0);
  l.bytes = at;
  return l;
}

const char* role_name(int32_t role) {
  switch (role) {
    case kRoleGate: return "gate";
    case kRoleCounts: return "count exchange";
    case kRoleDispatch: return "dispatch";
    case kRoleProducer: return "processor (TMA producer)";
    case kRoleConsumer: return "processor (wgmma consumer)";
    case kRoleCombine: return "combine";
    case kRoleBackward: return "backward";
  }
  return "unknown role";
}

const char* backward_stage_name(int32_t stage) {
  static const char* names[kBackwardStages] = {
      "host read of the counts (stream idle; 0 when the caller read them)", "combine backward, row gradients into the experts' ranks",
      "expert backward (grouped GEMMs)", "router backward", "scatter back (dx rows read in place)"};
  return stage >= 0 && stage < kBackwardStages ? names[stage] : "unknown stage";
}

void backward_rows(const Shape& s, int32_t rank, const uint64_t* inbox, int64_t* expert_offsets, double* assigned) {
  const int32_t E = s.experts, W = s.world, Le = s.local_experts();
  for (int32_t le = 0; le <= Le; ++le) expert_offsets[le] = 0;
  for (int32_t e = 0; e < E; ++e) assigned[e] = 0;
  for (int32_t src = 0; src < W; ++src)
    for (int32_t e = 0; e < E; ++e) {
      const int64_t n = signal_value(inbox[size_t(src) * E + e]);
      assigned[e] += double(n);
      if (e / Le == rank) expert_offsets[e % Le + 1] += s.capacity < 0 ? n : std::min<int64_t>(n, s.capacity);
    }
  for (int32_t le = 0; le < Le; ++le) expert_offsets[le + 1] += expert_offsets[le];
}

const char* wait_name(int32_t what) {
  switch (what) {
    case kWaitGridBarrier: return "the grid barrier after the gate (every block of this rank)";
    case kWaitCounts: return "the routed-row counts of source rank `slot` (counts inbox)";
    case kWaitRowsReady: return "the rows of source rank `slot` (ready signal)";
    case kWaitUpDone: return "the up-projection tiles of row tile `slot` (up_done counter)";
    case kWaitArrived: return "the expert outputs of this rank's tokens (arrived counter)";
    case kWaitSlotFull: return "a pipeline slot's TMA data (full barrier)";
    case kWaitSlotEmpty: return "a pipeline slot to be released (empty barrier)";
    case kWaitRingFull: return "the next task index (tile ring full)";
    case kWaitRingEmpty: return "the task ring entry to be taken (tile ring empty)";
    case kWaitGradReady: return "the row gradients of source rank `slot` (grad_ready signal)";
    case kWaitDxReady: return "the input gradients from expert rank `slot` (dx_ready signal)";
    case kWaitGateBarrier: return "the grid barrier after the split gate's partial logits (every block of this rank)";
  }
  return "an unknown flag";
}

}  // namespace dmoe::flash
