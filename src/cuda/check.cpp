// cuda/check.cpp — the fmt-free failure path of cuda/check.hpp, forwarding to dmoe::throw_error.
#include "cuda/check.hpp"

#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "core/error.hpp"

namespace dmoe::cuda {

namespace {

std::mutex record_mutex;
DeviceWaitRecord* record_host = nullptr;  // pinned, mapped; null until a kernel asked for it

std::string describe(const DeviceWaitRecord& r) {
  char text[512];
  if (r.kernel == kWaitSm90GroupedGemm) {
    std::snprintf(text, sizeof(text),
                  "; the sm90 grouped GEMM kernel (block %d, thread %d) waited more than %llu ms for the %s "
                  "barrier of pipeline slot %d (phase parity %u) and stopped; raise DMOE_GPU_WAIT_TIMEOUT_MS if "
                  "the GPU is shared and slow, otherwise this is a bug",
                  r.block, r.thread, r.waited_ms, r.what == 0 ? "full (TMA data)" : "empty (slot released)",
                  r.slot, r.parity);
  } else {
    std::snprintf(text, sizeof(text), "; kernel %d (block %d, thread %d) timed out waiting on flag %d", r.kernel,
                  r.block, r.thread, r.what);
  }
  return text;
}

}  // namespace

DeviceWaitRecord* device_wait_record() {
  std::lock_guard<std::mutex> lock(record_mutex);
  if (record_host == nullptr) {
    void* p = nullptr;
    DMOE_CHECK_CUDA(cudaHostAlloc(&p, sizeof(DeviceWaitRecord), cudaHostAllocMapped | cudaHostAllocPortable));
    std::memset(p, 0, sizeof(DeviceWaitRecord));
    record_host = static_cast<DeviceWaitRecord*>(p);
  }
  void* device = nullptr;
  DMOE_CHECK_CUDA(cudaHostGetDevicePointer(&device, record_host, 0));
  return static_cast<DeviceWaitRecord*>(device);
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
