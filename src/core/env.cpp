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
  DMOE_REQUIRE_INPUT(end != text && *end == '\0' && v > 0, "DMOE_COMM_TIMEOUT_S='{}' is invalid: expected seconds > 0",
                     text);
  return v;
}

}  // namespace dmoe
