// error.hpp — dmoe::Error and the checking macros every layer uses.
//
// Three kinds of error, one type:
//   - bad input (a flag, a config field, a file, an environment variable the user gave): DMOE_REQUIRE_INPUT
//     and DMOE_FAIL_INPUT. The message names the field, the value and the rule that was broken; it carries
//     no source location, since it is about the input, not about dmoe's code.
//   - internal (a broken invariant, a failed system or library call): DMOE_REQUIRE and DMOE_FAIL. The
//     message ends in (file:line), for the bug report.
//   - the run (a time limit reached, a peer rank that failed): DMOE_FAIL_RUN. Neither the input's fault nor a bug
//     in dmoe's code, so no source location; the message says what was waited for and which setting bounds it.
// Both carry the rank, once one is known ("[rank r] ...").
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace dmoe {

enum class ErrorKind { input, internal, run };

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, ErrorKind kind = ErrorKind::internal)
      : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  bool is_input() const { return kind_ == ErrorKind::input; }

 private:
  ErrorKind kind_;
};

// The rank printed in error messages; -1 until a launcher or engine sets it for this process/thread.
int& error_rank();

// Internal error: the message with (file:line).
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
// Bad input: the message alone.
[[noreturn]] void throw_input_error(const std::string& message);
// A failure of the run (a timeout, a peer): the message alone.
[[noreturn]] void throw_run_error(const std::string& message);

}  // namespace dmoe

// DMOE_REQUIRE(cond, "fmt {}", args...): throws an internal dmoe::Error (with file:line) when cond fails.
#define DMOE_REQUIRE(cond, ...)                                                  \
  do {                                                                           \
    if (!(cond)) ::dmoe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define DMOE_FAIL(...) ::dmoe::throw_error(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

// DMOE_REQUIRE_INPUT(cond, "fmt {}", args...): throws a bad-input dmoe::Error when cond fails.
#define DMOE_REQUIRE_INPUT(cond, ...)                                      \
  do {                                                                     \
    if (!(cond)) ::dmoe::throw_input_error(fmt::format(__VA_ARGS__));      \
  } while (0)

#define DMOE_FAIL_INPUT(...) ::dmoe::throw_input_error(fmt::format(__VA_ARGS__))

#define DMOE_FAIL_RUN(...) ::dmoe::throw_run_error(fmt::format(__VA_ARGS__))
