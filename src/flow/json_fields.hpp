// json_fields.hpp — the checks Flow's JSON inputs (cost files, cluster files) share: a required non-negative
// number, and an object with only known keys. Errors name the file's path to the field and what is allowed.
#pragma once

#include <cmath>
#include <initializer_list>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace dmoe::flow {

inline double number_at(const nlohmann::json& j, const std::string& key, const std::string& where) {
  DMOE_REQUIRE_INPUT(j.contains(key), "{}: missing key '{}'", where, key);
  DMOE_REQUIRE_INPUT(j.at(key).is_number(), "{}.{}: must be a number (got {})", where, key, j.at(key).dump());
  const double v = j.at(key).get<double>();
  DMOE_REQUIRE_INPUT(std::isfinite(v) && v >= 0, "{}.{} = {}: must be finite and >= 0", where, key, v);
  return v;
}

inline void only_keys(const nlohmann::json& j, std::initializer_list<const char*> keys, const std::string& where) {
  DMOE_REQUIRE_INPUT(j.is_object(), "{}: must be a JSON object (got {})", where, j.dump());
  for (auto it = j.begin(); it != j.end(); ++it) {
    bool known = false;
    std::string allowed;
    for (const char* k : keys) {
      known |= it.key() == k;
      allowed += std::string(allowed.empty() ? "" : ", ") + k;
    }
    DMOE_REQUIRE_INPUT(known, "{}: unknown key '{}' (allowed: {})", where, it.key(), allowed);
  }
}

}  // namespace dmoe::flow
