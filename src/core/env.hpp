// env.hpp — settings from the environment that more than one layer reads.
#pragma once

namespace dmoe {

// Limit, in seconds, of every host-side wait on the GPU or on peer ranks (DMOE_COMM_TIMEOUT_S, default
// 600): a wait that runs past it fails with an error that names what it waited for, instead of hanging.
double host_wait_timeout_seconds();

}  // namespace dmoe
