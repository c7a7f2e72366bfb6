// fault_point.cpp — the injection point of DMOE_FAULT (core/fault.hpp, comm/comm.hpp).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/comm.hpp"
#include "comm/stage_board.hpp"
#include "core/env.hpp"
#include "core/error.hpp"

namespace dmoe {

void Comm::enter_stage(FaultStage stage) {
  if (StageBoard* board = process_stage_board()) board->enter(stage);
}

bool Comm::abandoned() const {
  StageBoard* board = process_stage_board();
  return board && !board->failed_peer().empty();
}

void Comm::exit_rank(const std::string& why) {
  if (StageBoard* board = process_stage_board()) board->mark(RankState::exited);
  std::fprintf(stderr, "dmoe: [rank %d] %s\n", rank(), why.c_str());
  std::fflush(nullptr);
  std::_Exit(kFaultExitCode);
}

void fault_point(Comm& comm, FaultStage stage) {
  comm.enter_stage(stage);
  note_stage_reached(comm.rank(), stage);
  const std::optional<Fault> fault = fault_from_env();
  // A rank that does not exist would never fail, and the run would pass as if the fault had been survived. A run of
  // several worlds (bench -n 1 4) checked it up front against its largest (require_fault_reachable): a row of a smaller
  // world is no error, the fault fires in the row that has its rank (G22B-6).
  const int32_t world = std::max(comm.world(), fault_run_world());
  DMOE_REQUIRE_INPUT(!fault || fault->rank < world, "DMOE_FAULT names rank {}, but this run has {} ranks "
                     "(0 to {}); the fault would never fire", fault ? fault->rank : 0, world, world - 1);
  if (!fault || fault->rank != comm.rank() || fault->stage != stage) return;
  const std::string spec =
      fmt::format("DMOE_FAULT={}:{}:{}", fault->rank, fault_stage_name(stage), fault_kind_name(fault->kind));
  switch (fault->kind) {
    case FaultKind::throw_error:
      throw Error(fmt::format("[rank {}] injected fault: rank {} failed at stage {} ({})", comm.rank(), comm.rank(),
                              fault_stage_name(stage), spec));
    case FaultKind::hang: {
      const auto limit = std::chrono::duration<double>(4 * host_wait_timeout_seconds());
      const auto start = std::chrono::steady_clock::now();
      while (!comm.abandoned() && std::chrono::steady_clock::now() - start < limit)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      // Across processes, a real hang never wakes: the ranks that gave up report and the launcher ends this
      // one. Give them a second to do so before this injected one ends.
      if (process_stage_board()) std::this_thread::sleep_for(std::chrono::seconds(1));
      throw Error(fmt::format("[rank {}] injected fault: rank {} hung at stage {} ({}) until the other ranks gave up",
                              comm.rank(), comm.rank(), fault_stage_name(stage), spec));
    }
    case FaultKind::exit:
      comm.exit_rank(fmt::format("injected fault: rank {} exits at stage {} ({})", comm.rank(),
                                 fault_stage_name(stage), spec));
  }
}

}  // namespace dmoe
