// error.hpp — dmoe::Error and the checking macros every layer uses.
//
// Errors carry what failed, where (file:line) and, once a rank is known, which rank. Bad user input is
// reported with DMOE_REQUIRE: the message names the field, the value and the rule that was broken.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace dmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// The rank printed in error messages; -1 until a launcher or engine sets it for this process/thread.
int& error_rank();

[[noreturn]] void throw_error(const char* file, int line, const std::string& message);

}  // namespace dmoe

// DMOE_REQUIRE(cond, "fmt {}", args...): throws dmoe::Error with the formatted message when cond fails.
#define DMOE_REQUIRE(cond, ...)                                                  \
  do {                                                                           \
    if (!(cond)) ::dmoe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define DMOE_FAIL(...) ::dmoe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))
