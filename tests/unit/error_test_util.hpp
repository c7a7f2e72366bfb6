// error_test_util.hpp — the message of the dmoe::Error a call throws, for tests of refusals.
#pragma once

#include <functional>
#include <string>

#include "core/error.hpp"

namespace dmoe::test {

// e.what() of the dmoe::Error that fn throws; `none` when it returns normally (other exceptions propagate).
inline std::string error_of(const std::function<void()>& fn, const std::string& none = "(no error)") {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return none;
}

}  // namespace dmoe::test
