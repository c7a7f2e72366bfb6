// fault.hpp — fault injection for the failure tests: DMOE_FAULT=rank:stage:kind makes one rank fail at
// one stage of the MoE layer, so that the tests can check that every other rank stops within the
// communicator's time limit (DMOE_COMM_TIMEOUT_S) with an error naming the failed rank and its stage.
//
//   stage: before_dispatch (after the router, before the first exchange), alltoall (entering an
//          all-to-all: counts or rows, forward or backward), expert_gemm (before the experts' FFN,
//          forward or backward), combine (before the weighted combine), backward (entering backward),
//          allreduce (entering an all-reduce: the engine's config check, the losses, the gate gradient)
//   kind:  throw (the rank throws a dmoe::Error), exit (the rank stops as if its process had died),
//          hang (the rank stops making progress until the others give up on it)
// The fault fires the first time the rank reaches the stage. Plain data and parsing here; the injection
// point is comm/comm.hpp's fault_point(), since exit and hang depend on how ranks run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace dmoe {

enum class FaultStage : int8_t { none = -1, before_dispatch, alltoall, expert_gemm, combine, backward, allreduce };
enum class FaultKind : int8_t { throw_error, exit, hang };

const char* fault_stage_name(FaultStage stage);
const char* fault_kind_name(FaultKind kind);

struct Fault {
  int32_t rank = -1;
  FaultStage stage = FaultStage::none;
  FaultKind kind = FaultKind::throw_error;
};

// "3:expert_gemm:hang"; a bad spec is a dmoe::Error naming it and listing what is allowed.
Fault parse_fault(std::string_view text);
// DMOE_FAULT, parsed on every call (so a test can set it between runs); nullopt when unset or empty.
std::optional<Fault> fault_from_env();

// What fault points this process passed (comm/fault_point.cpp calls note_stage_reached), so that a run whose fault
// never fired does not end as if it had been survived: unfired_fault() says why DMOE_FAULT did not fire where it
// should have — its rank ran in this process but never reached its stage, or no rank of this process passed a
// fault point at all — and is empty otherwise (no DMOE_FAULT, it fired, or its rank runs in another process).
void note_stage_reached(int32_t rank, FaultStage stage);
std::string unfired_fault(std::string_view command);
void reset_stages_reached();  // for tests
// For a command that passes no fault point (init, init-model, flow simulate|tune|project): with DMOE_FAULT set,
// the input error unfired_fault() would give after the work, before it (so no output is written first).
void require_no_fault_injected(std::string_view command);
// G22B-6: DMOE_FAULT checked against the whole run before any work: its rank against the run's largest world
// (`world_note` says where that comes from, e.g. "the largest W of -n 1 4"; may be empty), a backward stage against
// whether the run has a backward (`backward_hint`: how to get one, e.g. "leave out --no-backward"). bench -n 1 4 with a
// fault on rank 3 was refused at its W = 1 row (fault_point checks each row's world), and a backward fault with
// --no-backward was reported only after the run, its outputs written. Records `largest_world` for fault_point, which
// then accepts a row of a smaller world (the fault fires in the row that has its rank).
void require_fault_reachable(std::string_view command, int32_t largest_world, std::string_view world_note,
                             bool backward_runs, std::string_view backward_hint);
// The largest world require_fault_reachable recorded; 0 when it was not called.
int32_t fault_run_world();

}  // namespace dmoe
