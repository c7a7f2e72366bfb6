// cuda/check.cpp — the fmt-free failure path of cuda/check.hpp, forwarding to dmoe::throw_error.
#include "cuda/check.hpp"

#include <cstdarg>
#include <cstdio>
#include <string>

#include "core/error.hpp"

namespace dmoe::cuda {

void fail(const char* file, int line, const char* format, ...) {
  va_list args;
  va_start(args, format);
  va_list copy;
  va_copy(copy, args);
  const int length = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::string message(length > 0 ? size_t(length) : 0, '\0');
  if (length > 0) std::vsnprintf(message.data(), message.size() + 1, format, args);
  va_end(args);
  throw_error(file, line, message);
}

}  // namespace dmoe::cuda
