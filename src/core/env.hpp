// env.hpp — settings from the environment that more than one layer reads.
#pragma once

namespace dmoe {

// Limit, in seconds, of every host-side wait on the GPU or on peer ranks (DMOE_COMM_TIMEOUT_S, default
// 600): a wait that runs past it fails with an error that names what it waited for, instead of hanging.
double host_wait_timeout_seconds();

// DMOE_DEFER_ROUTING = 1 (default) | 0: whether EpEngine may defer a train forward's host read of its routing
// counts (EpOptions::defer_routing_reads; 0 turns it off everywhere, e.g. to measure what it saves).
bool defer_routing_reads_allowed();

}  // namespace dmoe
