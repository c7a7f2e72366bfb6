// env.cpp — see env.hpp.
#include "core/env.hpp"

#include <cstdlib>
#include <string>

#include "core/error.hpp"

namespace dmoe {

double host_wait_timeout_seconds() {
  const char* text = std::getenv("DMOE_COMM_TIMEOUT_S");
  if (!text) return 600.0;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  // At most 1e9 s (~32 years): a deadline of now + v must fit the clocks' 64-bit nanoseconds (inf would not).
  // At least 10 ms: below that a wait gives up before a peer thread or process can arrive, so the run fails (or
  // passes) by timing alone, with a time-out message that reads like a hang.
  DMOE_REQUIRE_INPUT(end != text && *end == '\0' && v >= 0.01 && v <= 1e9,
                     "DMOE_COMM_TIMEOUT_S='{}' is invalid: expected seconds in [0.01, 1e9] (below 10 ms every wait "
                     "would give up before its peers can arrive)", text);
  return v;
}

bool defer_routing_reads_allowed() {
  const char* text = std::getenv("DMOE_DEFER_ROUTING");
  if (!text || !*text) return true;
  const std::string v = text;
  DMOE_REQUIRE_INPUT(v == "0" || v == "1", "DMOE_DEFER_ROUTING='{}' is invalid: allowed 1 (defer the routing "
                     "counts' host read where a forward can, the default) or 0 (read them in every forward)", v);
  return v == "1";
}

}  // namespace dmoe
