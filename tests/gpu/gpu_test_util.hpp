// gpu_test_util.hpp — what the GPU tests share: whether a CUDA device is visible (tests skip without one).
#pragma once

#include <cuda_runtime.h>

namespace dmoe::test {

inline bool has_cuda_device() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver or no device: not an error for the tests that follow
    return false;
  }
  return count > 0;
}

}  // namespace dmoe::test
