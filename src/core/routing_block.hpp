// routing_block.hpp — the routing results a backend leaves in its memory for the host to read later.
//
// A train forward at W = 1 needs its per-expert counts and router statistics on the host only for the
// backward and the reported losses, not for the forward itself (the grouped GEMM reads the expert offsets on
// the device). Backend::plan_send_on_device and Backend::router_aux_partials_on_device write these blocks;
// EpEngine copies them to the host behind the forward (HostReadback) and decodes them when it needs them,
// so the forward never waits for the GPU (docs/architecture.md, "Deferred routing reads").
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dmoe {

// The marker of "no bad assignment" (the kernels memset the word with 0x7f bytes).
inline constexpr int32_t kNoBadAssignment = 0x7f7f7f7f;

// plan_send's counts: int64 words [3E + 2] =
//   routed [E]          assignments per expert before capacity
//   kept [E]            rows per expert in the send buffer
//   offsets [E + 1]     exclusive prefix sums of kept: expert e's rows are [offsets[e], offsets[e + 1])
//   bad [1]             its first 4 bytes: an int32, the first assignment t·k + j whose expert id is outside
//                       [0, E) (a token with NaN router logits), or kNoBadAssignment
struct PlanCountsBlock {
  static constexpr size_t words(int32_t experts) { return 3 * size_t(experts) + 2; }
  static constexpr size_t bytes(int32_t experts) { return words(experts) * sizeof(int64_t); }
  static int64_t* routed(void* block) { return static_cast<int64_t*>(block); }
  static int64_t* kept(void* block, int32_t experts) { return routed(block) + experts; }
  static int64_t* offsets(void* block, int32_t experts) { return routed(block) + 2 * size_t(experts); }
  static int32_t* bad(void* block, int32_t experts) {
    return reinterpret_cast<int32_t*>(routed(block) + 3 * size_t(experts) + 1);
  }
  static int32_t read_bad(const void* block, int32_t experts) {
    int32_t b = 0;
    std::memcpy(&b, static_cast<const int64_t*>(block) + 3 * size_t(experts) + 1, sizeof(b));
    return b;
  }
};

// router_aux_partials' sums: prob_sum [E] f64, z_sum [1] f64, then assigned [E] i32 and bad [1] i32 (as in
// PlanCountsBlock), padded to a multiple of 8 bytes.
struct AuxPartialsBlock {
  static constexpr size_t bytes(int32_t experts) {
    return ((size_t(experts) + 1) * sizeof(double) + (size_t(experts) + 1) * sizeof(int32_t) + 7) / 8 * 8;
  }
  static double* prob_sum(void* block) { return static_cast<double*>(block); }
  static double* z_sum(void* block, int32_t experts) { return prob_sum(block) + experts; }
  static int32_t* assigned(void* block, int32_t experts) {
    return reinterpret_cast<int32_t*>(prob_sum(block) + size_t(experts) + 1);
  }
  static int32_t* bad(void* block, int32_t experts) { return assigned(block, experts) + experts; }
  // The sums as the host-side router_aux_partials returns them (assigned as doubles); the bad word is the
  // caller's to check.
  static void decode(const void* block, int32_t experts, double* prob_sum_out, double* assigned_out, double* z_out) {
    const auto* d = static_cast<const double*>(block);
    int32_t a = 0;
    const char* a_bytes = reinterpret_cast<const char*>(d + size_t(experts) + 1);
    for (int32_t e = 0; e < experts; ++e) {
      prob_sum_out[e] = d[e];
      std::memcpy(&a, a_bytes + size_t(e) * sizeof(int32_t), sizeof(a));
      assigned_out[e] = double(a);
    }
    *z_out = d[experts];
  }
  static int32_t read_bad(const void* block, int32_t experts) {
    int32_t b = 0;
    std::memcpy(&b, reinterpret_cast<const char*>(static_cast<const double*>(block) + size_t(experts) + 1) +
                        size_t(experts) * sizeof(int32_t), sizeof(b));
    return b;
  }
};

}  // namespace dmoe
