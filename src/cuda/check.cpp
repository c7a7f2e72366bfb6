// cuda/check.cpp — the fmt-free failure path of cuda/check.hpp, forwarding to dmoe::throw_error.
#include "cuda/check.hpp"

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "core/env.hpp"
#include "core/error.hpp"

namespace dmoe::cuda {

namespace {

std::mutex record_mutex;
DeviceWaitRecord* record_host = nullptr;    // pinned, mapped; null until a kernel asked for it
DeviceWaitRecord* record_device = nullptr;  // its device address (portable: the same for every device)

WaitDescriber flash_describer = nullptr;

std::string describe(const DeviceWaitRecord& r) {
  char text[768];
  if (r.kernel == kWaitFlash && flash_describer != nullptr) {
    flash_describer(r, text, sizeof(text));
  } else if (r.kernel == kWaitSm90GroupedGemm) {
    std::snprintf(text, sizeof(text),
                  "; the sm90 grouped GEMM kernel (block %d, thread %d) waited more than %llu ms for the %s "
                  "barrier of pipeline slot %d (phase parity %u) and stopped; raise DMOE_GPU_WAIT_TIMEOUT_MS if "
                  "the GPU is shared and slow, otherwise this is a bug",
                  r.block, r.thread, r.waited_ms, r.what == 0 ? "full (TMA data)" : r.what == 1 ? "empty (slot released)" : r.what == 3 ? "tile-ring full (next tile index)" : "tile-ring empty (index taken)",
                  r.slot, r.parity);
  } else {
    std::snprintf(text, sizeof(text), "; kernel %d (block %d, thread %d) timed out waiting on flag %d", r.kernel,
                  r.block, r.thread, r.what);
  }
  return text;
}

}  // namespace

void set_wait_describer(int kernel, WaitDescriber d) {
  std::lock_guard<std::mutex> lock(record_mutex);
  if (kernel == kWaitFlash) flash_describer = d;
}

// Called at every launch of a kernel that waits: the allocation and address lookup happen once.
DeviceWaitRecord* device_wait_record() {
  std::lock_guard<std::mutex> lock(record_mutex);
  if (record_host == nullptr) {
    void* p = nullptr;
    DMOE_CHECK_CUDA(cudaHostAlloc(&p, sizeof(DeviceWaitRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, sizeof(DeviceWaitRecord));
    void* device = nullptr;
    DMOE_CHECK_CUDA(cudaHostGetDevicePointer(&device, p, 0));
    record_host = static_cast<DeviceWaitRecord*>(p);
    record_device = static_cast<DeviceWaitRecord*>(device);
  }
  return record_device;
}

void wait_stream(cudaStream_t stream, const char* what, const std::function<void()>& poll) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const double limit = host_wait_timeout_seconds();
  // Spin for the first 2 ms (the engine's waits on its critical path are tens of microseconds), then
  // sleep 50 µs growing to 1 ms between polls.
  auto sleep = std::chrono::microseconds(50);
  for (;;) {
    const cudaError_t status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady)
      fail(__FILE__, __LINE__, "%s: the GPU reported %s (%s) while waiting for the stream", what,
           cudaGetErrorString(status), cudaGetErrorName(status));
    if (poll) poll();
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited > limit)
      fail(__FILE__, __LINE__,
           "%s: waited %.0f s for the GPU stream to finish (DMOE_COMM_TIMEOUT_S=%.0f); the GPU work hangs — "
           "most likely a peer rank failed, or is not calling the same collective this rank's stream waits on",
           what, waited, limit);
    if (waited > 2e-3) {
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
    }
  }
}

bool wait_stream_quietly(cudaStream_t stream) noexcept {
  try {
    wait_stream(stream, "");
    return true;
  } catch (...) {
    return false;
  }
}

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
  {
    std::lock_guard<std::mutex> lock(record_mutex);
    if (record_host != nullptr && reinterpret_cast<volatile DeviceWaitRecord*>(record_host)->set != 0)
      message += describe(*record_host);
  }
  throw_error(file, line, message);
}

}  // namespace dmoe::cuda
