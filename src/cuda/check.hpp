// cuda/check.hpp — error checks for CUDA runtime and cuBLAS calls: a failing call throws dmoe::Error
// naming the call, the library's error string and file:line (and the rank, once one is set), through
// dmoe::throw_error like DMOE_FAIL.
//
// NOTE: this header must not include core/error.hpp: nvcc 13.0's front end rejects fmt 9's consteval
// format strings (header-only fmt, -std=c++20), so .cu files cannot see fmt at all. The checks here build
// their messages with printf-style formatting instead (dmoe::cuda::fail, check.cpp).
//
// Kernel launches are asynchronous: DMOE_CHECK_LAUNCH() catches bad launch configurations at once;
// faults inside a kernel surface at the next synchronising call. Define DMOE_CUDA_SYNC_LAUNCHES to
// synchronise after every launch while hunting such a fault (slow; debugging only).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <functional>

namespace dmoe::cuda {

// Throws dmoe::Error("<formatted message> (file:line)") (with the rank when one is set).
[[noreturn]] void fail(const char* file, int line, const char* format, ...)
    __attribute__((format(printf, 3, 4)));

// Throws the input-error kind of dmoe::Error (core/error.hpp: the message alone, no file:line): for bad input
// found in code that nvcc compiles, where fmt is not used.
[[noreturn]] void fail_input(const char* format, ...) __attribute__((format(printf, 1, 2)));

// A kernel that gives up waiting on a flag (a time limit, see DMOE_GPU_WAIT_TIMEOUT_MS) writes what it
// waited for into this record — host memory mapped into the device, so it survives the trap that follows
// — and fail() appends it to the message of the CUDA error that the trap causes.
struct DeviceWaitRecord {
  int set;        // 0 until a kernel writes the record
  int kernel;     // which kernel (DeviceWaitKernel)
  int role;       // kernel-specific: which role of a persistent kernel waited (Flash: flash::Role)
  int what;       // kernel-specific: which flag or barrier
  int block, thread, slot;
  int rank;       // the waiting rank (multi-rank kernels; -1 otherwise)
  unsigned parity;
  unsigned long long expected, seen;  // flag waits: the value awaited and the last value read
  unsigned long long waited_ms;
};
enum DeviceWaitKernel : int { kWaitSm90GroupedGemm = 1, kWaitFlash = 2, kWaitSm90Wgrad = 3 };

// Words for a Flash wait record (flash/flash_kernel.cu registers it; null until then).
using WaitDescriber = void (*)(const DeviceWaitRecord& record, char* text, unsigned long size);
void set_wait_describer(int kernel, WaitDescriber describe);

// The record's device-side address (created on first use; the same for every device of the process).
DeviceWaitRecord* device_wait_record();

// Once a host-side wait has given up on the GPU (time-out, a peer rank known to have failed, a GPU error),
// kernels may spin forever: every later cudaFree, cudaDeviceSynchronize or cublasDestroy (which
// synchronise the device implicitly) would hang the process while it unwinds and exits. gpu_abandoned()
// says so; the release paths below then leave memory to process exit instead.
bool gpu_abandoned();
void abandon_gpu();
// cudaFree / cudaDeviceSynchronize for destructors: skipped (false) once the GPU is abandoned; never throw.
void free_quietly(void* p) noexcept;
bool synchronize_device_quietly() noexcept;

// cudaMalloc that says what failed: on failure a dmoe::Error naming `what`, the bytes asked for, the device
// and its free and total memory (cudaMemGetInfo), instead of a bare "out of memory". Never returns null
// (bytes == 0 gets a 16-byte block, so kernels see a valid pointer).
void* device_malloc(size_t bytes, const char* what);

// cudaSetDevice(device) that names `who` and, for "busy or unavailable" (cudaErrorDevicesUnavailable), what it can
// mean: an exclusive-process GPU held by another process, or an MPS server refusing clients — a shared MPS daemon
// (mpirun, Slurm) does so for 2-3 s after a job whose ranks died with kernels in flight. Not retried: measured on
// the H200, the refusal sticks inside the process (73 attempts over 15 s all failed) while a new process opens the
// GPU 2-3 s after the failed job (docs/faults.md).
void set_device_or_explain(int device, const char* who);

// cudaStreamSynchronize with a time limit (DMOE_COMM_TIMEOUT_S, core/env.hpp): spins briefly, then polls
// with growing sleeps; past the limit it fails naming `what` (e.g. a peer rank died inside a collective
// that this stream waits on). GPU errors fail as DMOE_CHECK_CUDA would. `poll`, when given, runs between
// polls and may throw (the communicators check their library's asynchronous errors there).
void wait_stream(cudaStream_t stream, const char* what, const std::function<void()>& poll = nullptr);
// The same for the work a stream had queued when `event` was recorded (the stream may have gone on since): the
// host waits for an earlier point of a stream without draining what came after it.
void wait_event(cudaEvent_t event, const char* what);
// The same for destructors and release paths, which cannot throw: true when the stream finished within
// the limit without an error.
bool wait_stream_quietly(cudaStream_t stream) noexcept;

}  // namespace dmoe::cuda

#define DMOE_CHECK_CUDA(call)                                                                         \
  do {                                                                                                \
    const cudaError_t dmoe_cuda_status_ = (call);                                                     \
    if (dmoe_cuda_status_ != cudaSuccess)                                                             \
      ::dmoe::cuda::fail(__FILE__, __LINE__, "CUDA call `%s` failed: %s (%s)", #call,                 \
                         cudaGetErrorString(dmoe_cuda_status_), cudaGetErrorName(dmoe_cuda_status_)); \
  } while (0)

#define DMOE_CHECK_CUBLAS(call)                                                         \
  do {                                                                                  \
    const cublasStatus_t dmoe_cublas_status_ = (call);                                  \
    if (dmoe_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                   \
      ::dmoe::cuda::fail(__FILE__, __LINE__, "cuBLAS call `%s` failed: %s (%s)", #call, \
                         cublasGetStatusString(dmoe_cublas_status_),                    \
                         cublasGetStatusName(dmoe_cublas_status_));                     \
  } while (0)

#if defined(DMOE_CUDA_SYNC_LAUNCHES)
#define DMOE_CHECK_LAUNCH()                   \
  do {                                        \
    DMOE_CHECK_CUDA(cudaGetLastError());      \
    DMOE_CHECK_CUDA(cudaDeviceSynchronize()); \
  } while (0)
#else
#define DMOE_CHECK_LAUNCH() DMOE_CHECK_CUDA(cudaGetLastError())
#endif

// DMOE_CUDA_REQUIRE(cond, "printf format", args...): the fmt-free DMOE_REQUIRE for .cu files.
#define DMOE_CUDA_REQUIRE(cond, ...)                                  \
  do {                                                                \
    if (!(cond)) ::dmoe::cuda::fail(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
