// device_probe_stub.cpp — bench/device_probe.hpp in a build without CUDA: there is no CUDA device to name.
#include "bench/device_probe.hpp"

namespace dmoe {

std::string current_cuda_device_pci_bus_id(std::string* why) {
  *why = "a build without CUDA (DMOE_CUDA=OFF): no CUDA device";
  return {};
}

}  // namespace dmoe
