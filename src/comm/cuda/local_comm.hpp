// local_comm.hpp — a one-rank GPU communicator (device copies); see local_comm.cpp.
#pragma once

#include <memory>

#include "comm/comm.hpp"

namespace dmoe {

std::unique_ptr<Comm> make_local_comm();

}  // namespace dmoe
