// cuda/workspace.cpp — the grow-only device scratch block and pinned host staging used by the launchers
// (see kernels.cuh).
#include <algorithm>
#include <cstring>

#include "cuda/check.hpp"
#include "cuda/kernels.cuh"

namespace dmoe::cuda {

Workspace::~Workspace() {
  // Queued work may still use the block; cudaFree waits for the device, errors cannot be reported here.
  free_quietly(data_);
}

void* Workspace::reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_ && data_) return data_;
  // Grow by at least half again so that a slowly rising demand does not reallocate every call.
  const size_t grown = std::max(bytes, bytes_ + bytes_ / 2);
  const size_t rounded = std::max<size_t>((grown + 255) / 256 * 256, 256);
  if (data_) {
    wait_stream(stream, "workspace: growing the scratch block");
    DMOE_CHECK_CUDA(cudaFree(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  data_ = device_malloc(rounded, "the kernels' scratch block");
  bytes_ = rounded;
  return data_;
}

HostStaging::~HostStaging() {
  // cudaFreeHost synchronises the device: not when its work hangs (gpu_abandoned).
  if (data_ && !gpu_abandoned()) (void)cudaFreeHost(data_);
}

void* HostStaging::reserve(size_t bytes, cudaStream_t stream) {
  if (bytes <= bytes_ && data_) return data_;
  const size_t grown = std::max({bytes, bytes_ + bytes_ / 2, size_t(4096)});
  if (data_) {
    wait_stream(stream, "host staging: growing the pinned block");
    DMOE_CHECK_CUDA(cudaFreeHost(data_));
    data_ = nullptr;
    bytes_ = 0;
  }
  DMOE_CHECK_CUDA(cudaHostAlloc(&data_, grown, cudaHostAllocPortable));
  bytes_ = grown;
  return data_;
}

void download_bounded(void* host, const void* device, size_t bytes, cudaStream_t stream, HostStaging* staging,
                      const char* what) {
  if (bytes == 0) return;
  if (staging == nullptr) {
    DMOE_CHECK_CUDA(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
    wait_stream(stream, what);
    return;
  }
  // Large reads go in chunks through a staging block of at most 8 MiB.
  constexpr size_t kChunk = size_t(8) << 20;
  void* pinned = staging->reserve(std::min(bytes, kChunk), stream);
  for (size_t done = 0; done < bytes; done += kChunk) {
    const size_t n = std::min(kChunk, bytes - done);
    DMOE_CHECK_CUDA(
        cudaMemcpyAsync(pinned, static_cast<const char*>(device) + done, n, cudaMemcpyDeviceToHost, stream));
    wait_stream(stream, what);
    std::memcpy(static_cast<char*>(host) + done, pinned, n);
  }
}

}  // namespace dmoe::cuda
