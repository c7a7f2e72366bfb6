// device_probe.hpp — which GPU the resource probe (core/resource_probe.hpp) reads: the current CUDA device, named
// for NVML by its PCI bus id (NVML numbers devices without CUDA_VISIBLE_DEVICES, so an index would be wrong).
// bench/cuda/device_probe.cpp in CUDA builds; bench/no_cuda/device_probe_stub.cpp says "not a CUDA build".
#pragma once

#include <string>

#include "core/resource_probe.hpp"

namespace dmoe {

// The current CUDA device's PCI bus id ("0000:65:00.0"); empty with *why where there is none.
std::string current_cuda_device_pci_bus_id(std::string* why);

// Sets options.gpu and names the current CUDA device (or says why there is none); gpu_scope says who else the
// device-wide numbers cover.
inline void probe_current_cuda_device(ResourceProbeOptions& options, const std::string& gpu_scope) {
  options.gpu = true;
  options.gpu_pci_bus_id = current_cuda_device_pci_bus_id(&options.gpu_why);
  options.gpu_scope = gpu_scope;
}

}  // namespace dmoe
