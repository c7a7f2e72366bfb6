// cuda/check.cpp — the fmt-free failure path of cuda/check.hpp, forwarding to dmoe::throw_error.
#include "cuda/check.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>

#include "core/env.hpp"
#include "core/peer_watch.hpp"
#include "core/error.hpp"

namespace dmoe::cuda {

namespace {

std::mutex record_mutex;
DeviceWaitRecord* record_host = nullptr;    // pinned, mapped; null until a kernel asked for it
DeviceWaitRecord* record_device = nullptr;  // its device address (portable: the same for every device)

WaitDescriber flash_describer = nullptr;

// The barrier an sm90 GEMM or weight-gradient kernel's wait was for (its `what` codes).
const char* sm90_wait_name(int what) {
  switch (what) {
    case 0: return "full (TMA data)";
    case 1: return "empty (slot released)";
    case 2: return "main-loop order (the other consumer's previous tile)";
    case 3: return "tile-ring full (next tile index)";
    case 4: return "tile-ring empty (index taken)";
    case 5: return "resident-A full (the strip's A loaded)";
    case 6: return "resident-A ready (its tail rows cleared)";
    case 7: return "resident-A empty (both consumers done with it)";
    default: return "unknown";
  }
}

std::string describe(const DeviceWaitRecord& r) {
  char text[768];
  if (r.kernel == kWaitFlash && flash_describer != nullptr) {
    flash_describer(r, text, sizeof(text));
  } else if (r.kernel == kWaitSm90GroupedGemm || r.kernel == kWaitSm90Wgrad) {
    std::snprintf(text, sizeof(text),
                  "; the %s kernel (block %d, thread %d) waited more than %llu ms for the %s "
                  "barrier of %s %d (phase parity %u) and stopped; raise DMOE_GPU_WAIT_TIMEOUT_MS if "
                  "the GPU is shared and slow, otherwise this is a bug",
                  r.kernel == kWaitSm90Wgrad ? "sm90 grouped weight-gradient" : "sm90 grouped GEMM", r.block, r.thread,
                  r.waited_ms, sm90_wait_name(r.what),
                  r.what == 2 ? "consumer" : r.what >= 5 ? "resident-A buffer" : r.what >= 3 ? "tile-ring entry" : "pipeline slot",
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

namespace {
std::atomic<bool> g_gpu_abandoned{false};
}

bool gpu_abandoned() { return g_gpu_abandoned.load(std::memory_order_relaxed); }
void abandon_gpu() { g_gpu_abandoned.store(true, std::memory_order_relaxed); }

void free_quietly(void* p) noexcept {
  if (p && !gpu_abandoned()) (void)cudaFree(p);
}

bool synchronize_device_quietly() noexcept {
  if (gpu_abandoned()) return false;
  return cudaDeviceSynchronize() == cudaSuccess;
}

namespace {

// Marks this rank waiting on the process's stage board (core/peer_watch.hpp) while a wait sleeps.
struct WaitingMark {
  PeerWatch* watch = peer_watch();
  bool set = false;
  void on() {
    if (watch && !set) watch->set_waiting(set = true);
  }
  ~WaitingMark() {
    if (set) watch->set_waiting(false);
  }
};

}  // namespace

namespace {

// The bounded wait behind wait_stream and wait_event: `query` is cudaStreamQuery or cudaEventQuery of the
// awaited work, `awaited` names it in the messages.
void wait_until(const std::function<cudaError_t()>& query, const char* awaited, const char* what,
                const std::function<void()>& poll) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  const double limit = host_wait_timeout_seconds();
  WaitingMark mark;
  // Spin for the first 2 ms (the engine's waits on its critical path are tens of microseconds), then
  // sleep 50 µs growing to 1 ms between polls.
  auto sleep = std::chrono::microseconds(50);
  for (;;) {
    const cudaError_t status = query();
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) {
      abandon_gpu();
      fail(__FILE__, __LINE__, "%s: the GPU reported %s (%s) while waiting for %s", what,
           cudaGetErrorString(status), cudaGetErrorName(status), awaited);
    }
    if (poll) {
      try {
        poll();
      } catch (...) {
        abandon_gpu();
        throw;
      }
    }
    const double waited = std::chrono::duration<double>(Clock::now() - start).count();
    if (waited > limit) {
      abandon_gpu();
      std::string peers;
      if (mark.watch) {
        mark.watch->give_up();
        peers = mark.watch->describe_peers();
      }
      fail(__FILE__, __LINE__,
           "%s: waited %.0f s for %s to finish (DMOE_COMM_TIMEOUT_S=%.0f); the GPU work hangs — "
           "most likely a peer rank failed, or is not calling the same collective this rank's stream waits on%s%s",
           what, waited, awaited, limit, peers.empty() ? "" : "; ", peers.c_str());
    }
    if (waited > 2e-3) {
      // A peer known to have failed will never take part in the collective this stream may wait on.
      mark.on();
      if (mark.watch) {
        if (const std::string failed = mark.watch->failed_peer(); !failed.empty()) {
          abandon_gpu();
          fail(__FILE__, __LINE__, "%s: stopped waiting for %s after %.1f s: %s", what, awaited, waited,
               failed.c_str());
        }
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(1000));
    }
  }
}

}  // namespace

void wait_stream(cudaStream_t stream, const char* what, const std::function<void()>& poll) {
  wait_until([stream] { return cudaStreamQuery(stream); }, "the GPU stream", what, poll);
}

void wait_event(cudaEvent_t event, const char* what) {
  wait_until([event] { return cudaEventQuery(event); }, "the GPU work before an event", what, nullptr);
}

void* device_malloc(size_t bytes, const char* what) {
  void* p = nullptr;
  const cudaError_t status = cudaMalloc(&p, bytes == 0 ? 16 : bytes);
  if (status == cudaSuccess) return p;
  (void)cudaGetLastError();  // cudaMalloc's error is not sticky; clear it for the calls that follow
  if (status == cudaErrorStreamCaptureUnsupported || status == cudaErrorStreamCaptureInvalidated)
    fail(__FILE__, __LINE__,
         "allocating %s (%zu bytes) inside a CUDA-graph capture (%s), which invalidates it: run the same call once "
         "before capturing (a warm-up with the same shapes), so that its buffers exist", what, bytes,
         cudaGetErrorString(status));
  size_t free_bytes = 0, total_bytes = 0;
  int device = -1;
  (void)cudaGetDevice(&device);
  (void)cudaMemGetInfo(&free_bytes, &total_bytes);
  fail(__FILE__, __LINE__,
       "out of GPU memory: allocating %s needs %zu bytes (%.2f GiB) on device %d, which has %.2f GiB free of %.2f GiB "
       "(%s); use fewer tokens per rank or more ranks, or free the memory other processes hold (nvidia-smi)",
       what, bytes, double(bytes) / double(1ull << 30), device, double(free_bytes) / double(1ull << 30),
       double(total_bytes) / double(1ull << 30), cudaGetErrorString(status));
}

void set_device_or_explain(int device, const char* who) {
  const cudaError_t status = cudaSetDevice(device);
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  if (status == cudaErrorDevicesUnavailable)
    fail(__FILE__, __LINE__,
         "%s: cannot use GPU %d: %s — it is in exclusive-process mode and another process holds it, or its MPS "
         "server refuses clients (a shared MPS daemon does so for 2-3 s after a job whose ranks failed: start the "
         "job again; `nvidia-smi -q -d COMPUTE` shows the mode)",
         who, device, cudaGetErrorString(status));
  fail(__FILE__, __LINE__, "%s: cudaSetDevice(%d) failed: %s (%s)", who, device, cudaGetErrorString(status),
       cudaGetErrorName(status));
}

bool wait_stream_quietly(cudaStream_t stream) noexcept {
  if (gpu_abandoned()) return false;
  try {
    wait_stream(stream, "");
    return true;
  } catch (...) {
    return false;
  }
}

namespace {

// printf-style formatting into a string (fail and fail_input; nvcc-compiled callers do not use fmt).
std::string vformat(const char* format, va_list args) {
  va_list copy;
  va_copy(copy, args);
  const int length = std::vsnprintf(nullptr, 0, format, copy);
  va_end(copy);
  std::string message(length > 0 ? size_t(length) : 0, '\0');
  if (length > 0) std::vsnprintf(message.data(), message.size() + 1, format, args);
  return message;
}

}  // namespace

void fail(const char* file, int line, const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::string message = vformat(format, args);
  va_end(args);
  {
    std::lock_guard<std::mutex> lock(record_mutex);
    if (record_host != nullptr && reinterpret_cast<volatile DeviceWaitRecord*>(record_host)->set != 0)
      message += describe(*record_host);
  }
  throw_error(file, line, message);
}

void fail_input(const char* format, ...) {
  va_list args;
  va_start(args, format);
  const std::string message = vformat(format, args);
  va_end(args);
  throw_input_error(message);
}

}  // namespace dmoe::cuda
