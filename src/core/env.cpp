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
  DMOE_REQUIRE_INPUT(end != text && *end == '\0' && v > 0 && v <= 1e9,
                     "DMOE_COMM_TIMEOUT_S='{}' is invalid: expected seconds > 0 and <= 1e9", text);
  return v;
}

}  // namespace dmoe
