// env.cpp — see env.hpp.
#include "core/env.hpp"

#include <cstdlib>

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

}  // namespace dmoe
