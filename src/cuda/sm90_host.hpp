// cuda/sm90_host.hpp — host side of the Hopper tile engine, shared by the grouped GEMM and Flash: tensor maps
// for K-major and MN-major bf16 operands, whether this device and build can run sm_90a kernels, the time limit of
// device-side waits (DMOE_GPU_WAIT_TIMEOUT_MS), and the shared-memory opt-in of a kernel. Definitions in
// grouped_gemm_sm90.cu.
#pragma once

#include <cuda.h>  // CUtensorMap and its enums (types only; the driver function is looked up at run time)

#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/check.hpp"

namespace dmoe::cuda {

struct DeviceInfo {
  bool usable = false;  // compute capability 9.0 and the sm_90a kernels are in this build
  int sms = 0;          // multiprocessors this process may use (under MPS: its share)
};
// For the current device (cached per device).
const DeviceInfo& device_info();

// [rows, k] bf16 row-major, boxes of box_rows × box_k (64 or 32) with the swizzle as wide as a box row
// (128 or 64 bytes); out-of-range reads are zeros.
CUtensorMap make_kmajor_map(const void* base, int64_t rows, int64_t k, int box_rows, int box_k);
// [groups, k, n] bf16 (each group's [k, n] row-major: MN-major for wgmma's B), boxes of one group's
// box_k rows × 64 columns with the 128-byte swizzle (sm90_layout.hpp: mnmajor_spec); out-of-range reads
// (past a group's k rows, past n) are zeros.
CUtensorMap make_mnmajor_map(const void* base, int32_t groups, int64_t k, int64_t n, int box_k);
// [rows, cols] bf16 with row stride ld (elements), boxes of 64 columns × box_rows rows, 128-byte swizzle
// (sm90_layout.hpp: rowmajor_panel_spec): both operands of the weight-gradient kernel.
CUtensorMap make_rowmajor_panel_map(const void* base, int64_t rows, int64_t cols, int64_t ld, int box_rows);

// DMOE_GPU_WAIT_TIMEOUT_MS (default 10 s) in nanoseconds: how long a device-side wait may spin.
unsigned long long wait_timeout_ns();

// The dynamic shared-memory opt-in is per function and per device: once for each device this process uses.
// One object per kernel instantiation (a static in each launcher).
struct SmemOptIn {
  std::mutex mutex;
  std::vector<bool> set;
  template <typename Kernel>
  void apply(Kernel kernel, int bytes) {
    int device = 0;
    DMOE_CHECK_CUDA(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mutex);
    if (int(set.size()) <= device) set.resize(device + 1, false);
    if (!set[device]) {
      DMOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
      set[device] = true;
    }
  }
};

}  // namespace dmoe::cuda
