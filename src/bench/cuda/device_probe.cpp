// device_probe.cpp — see bench/device_probe.hpp (CUDA builds).
#include "bench/device_probe.hpp"

#include <cuda_runtime.h>

#include <fmt/format.h>

namespace dmoe {

std::string current_cuda_device_pci_bus_id(std::string* why) {
  int device = -1;
  cudaError_t rc = cudaGetDevice(&device);
  if (rc != cudaSuccess) {
    *why = fmt::format("cudaGetDevice: {}", cudaGetErrorString(rc));
    return {};
  }
  char id[32] = {};
  rc = cudaDeviceGetPCIBusId(id, int(sizeof(id)), device);
  if (rc != cudaSuccess) {
    *why = fmt::format("cudaDeviceGetPCIBusId({}): {}", device, cudaGetErrorString(rc));
    return {};
  }
  return id;
}

}  // namespace dmoe
