#include "core/error.hpp"

namespace dmoe {

int& error_rank() {
  thread_local int rank = -1;
  return rank;
}

void throw_error(const char* file, int line, const std::string& message) {
  const char* base = file;
  for (const char* p = file; *p; ++p)
    if (*p == '/') base = p + 1;
  if (error_rank() >= 0)
    throw Error(fmt::format("[rank {}] {} ({}:{})", error_rank(), message, base, line));
  throw Error(fmt::format("{} ({}:{})", message, base, line));
}

void throw_input_error(const std::string& message) {
  if (error_rank() >= 0) throw Error(fmt::format("[rank {}] {}", error_rank(), message), ErrorKind::input);
  throw Error(message, ErrorKind::input);
}

}  // namespace dmoe
