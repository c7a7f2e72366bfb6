// fault_point.cpp — the injection point of DMOE_FAULT (core/fault.hpp, comm/comm.hpp).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/comm.hpp"
#include "core/env.hpp"
#include "core/error.hpp"

namespace dmoe {

void Comm::exit_rank(const std::string& why) {
  std::fprintf(stderr, "dmoe: [rank %d] %s\n", rank(), why.c_str());
  std::fflush(nullptr);
  std::_Exit(kFaultExitCode);
}

void fault_point(Comm& comm, FaultStage stage) {
  comm.enter_stage(stage);
  const std::optional<Fault> fault = fault_from_env();
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
      throw Error(fmt::format("[rank {}] injected fault: rank {} hung at stage {} ({}) until the other ranks gave up",
                              comm.rank(), comm.rank(), fault_stage_name(stage), spec));
    }
    case FaultKind::exit:
      comm.exit_rank(fmt::format("injected fault: rank {} exits at stage {} ({})", comm.rank(),
                                 fault_stage_name(stage), spec));
  }
}

}  // namespace dmoe
