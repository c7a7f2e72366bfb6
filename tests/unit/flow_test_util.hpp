// flow_test_util.hpp — what the Flow tests share: the message of an expected dmoe::Error, and a graph spec.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/error.hpp"
#include "flow/task_graph.hpp"

namespace dmoe::flow::test {

// The message of the dmoe::Error fn throws, "(no error)" when it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline GraphSpec spec_of(Schedule s, int32_t layers, int32_t r, int64_t dense = 3 << 20, int64_t chunk = 1 << 20) {
  GraphSpec spec;
  spec.layers = layers;
  spec.micro_batches = r;
  spec.schedule = s;
  spec.dense_grad_bytes_per_layer = dense;
  spec.chunk_bytes = chunk;
  return spec;
}

}  // namespace dmoe::flow::test
