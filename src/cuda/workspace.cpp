// cuda/workspace.cpp — the grow-only device scratch block used by the launchers (see kernels.cuh).
#include <algorithm>

#include "cuda/check.hpp"
#include "cuda/kernels.cuh"

namespace dmoe::cuda {

Workspace::~Workspace() {
  // Queued work may still use the block; cudaFree waits for the device, errors cannot be reported here.
  if (data_) (void)cudaFree(data_);
}

void* Workspace::reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_ && data_) return data_;
  // Grow by at least half again so that a slowly rising demand does not reallocate every call.
  const size_t grown = std::max(bytes, bytes_ + bytes_ / 2);
  const size_t rounded = std::max<size_t>((grown + 255) / 256 * 256, 256);
  if (data_) {
    DMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
    DMOE_CHECK_CUDA(cudaFree(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  DMOE_CHECK_CUDA(cudaMalloc(&data_, rounded));
  bytes_ = rounded;
  return data_;
}

}  // namespace dmoe::cuda
