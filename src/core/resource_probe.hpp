// resource_probe.hpp — peak memory and energy over an interval of training steps (issue 15, Flow: "report peak
// memory and energy per step for vanilla and Flow"). Host code only: the GPU is read through NVML, loaded with
// dlopen at run time (nothing linked: the binary starts where there is no NVML), and the CUDA device that NVML
// should read is named by the caller (bench/device_probe.hpp finds the current one in CUDA builds).
//
// What is measured, and where it is not available (docs/flow.md, "Peak memory and energy"):
//   host peak memory   VmHWM of this process (/proc/self/status) after resetting it with "5" written to
//                      /proc/self/clear_refs (Linux >= 4.0) at the start of the interval: the peak resident set
//                      over the interval (everything resident counts: weights, optimizer state, other threads —
//                      every thread rank of the CPU engine). Where the reset is refused, the process-lifetime
//                      peak, labelled as such (never presented as the interval's).
//   CPU energy         RAPL package counters (/sys/class/powercap/intel-rapl:N/energy_uj, wrap-around by
//                      max_energy_range_uj): the whole package(s), every process on them. Usually unreadable in
//                      containers and for non-root users (kernel >= 5.10): "not available: <reason>".
//   GPU energy         nvmlDeviceGetTotalEnergyConsumption (mJ since the driver loaded), polled with the memory:
//                      the counter advances in steps tens of ms apart, so a difference of two readings around a
//                      short interval is off by up to a step at each end (0 J for a 60 ms interval on an H200).
//                      The mean power between the first and the last update seen inside the interval, times the
//                      interval; "not available" with fewer than two updates. The whole device (every process on
//                      it, e.g. every rank sharing it under MPS).
//   GPU memory         polled every poll_ms on a thread while the interval runs: this process's entry in
//                      nvmlDeviceGetComputeRunningProcesses (not reported under MPS, where the server owns the
//                      memory: then "not available") and the device's used memory (nvmlDeviceGetMemoryInfo,
//                      device-wide); the maximum over the samples, so an allocation living shorter than a poll
//                      can be missed.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace dmoe {

// One measured quantity: a value and what it covers, or no value and why ("not available: <reason>").
struct ProbeReading {
  std::optional<double> value;
  std::string unit;  // "bytes" or "J"
  std::string what;  // what the number covers; for no value: "not available: <reason>"
  static ProbeReading unavailable(std::string unit, const std::string& reason);
  std::string text() const;          // "41.2 MiB (what)", "0.125 J (what)" or "not available: <reason>"
  nlohmann::json to_json() const;    // {"value": number or null, "unit": ..., "what": ...}
};

// VmRSS / VmHWM of a /proc status file, bytes; nullopt where missing.
std::optional<uint64_t> proc_status_bytes(const std::string& status_path, const std::string& field);

// Host peak resident memory over [start(), finish()].
class HostPeakProbe {
 public:
  explicit HostPeakProbe(std::string proc_dir = "/proc/self");
  // Returns free heap pages to the kernel (malloc_trim, glibc), then resets the high-water mark. After a refused
  // reset, reset_error() says why and finish() reports the lifetime peak, labelled so.
  void start();
  ProbeReading finish(const std::string& scope) const;
  bool reset_worked() const { return reset_ok_; }
  const std::optional<uint64_t>& resident_at_start() const { return rss_at_start_; }  // VmRSS after the reset
  const std::string& reset_error() const { return reset_error_; }

 private:
  std::string proc_dir_;
  bool started_ = false, reset_ok_ = false;
  std::string reset_error_;
  std::optional<uint64_t> rss_at_start_;
};

// CPU package energy (RAPL) over [start(), finish()].
class RaplProbe {
 public:
  explicit RaplProbe(std::string powercap_dir = "/sys/class/powercap");
  void start();
  ProbeReading finish(int64_t steps) const;  // joules per step

 private:
  struct Domain {
    std::string path, name;
    uint64_t start_uj = 0, range_uj = 0;
  };
  std::string dir_;
  std::vector<Domain> domains_;
  std::string error_;  // non-empty: not available
};

// NVML, loaded with dlopen. open() returns null and says why where the library, a symbol or nvmlInit fails.
class Nvml {
 public:
  static std::unique_ptr<Nvml> open(const std::string& library, std::string* why);
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  using Device = void*;
  // Every call returns false and sets *why ("nvmlXxx: <NVML's error string>") on an NVML error.
  bool device_by_pci_bus_id(const std::string& bus_id, Device* device, std::string* why) const;
  bool total_energy_mj(Device device, uint64_t* mj, std::string* why) const;
  bool device_used_bytes(Device device, uint64_t* used, std::string* why) const;
  // This process's usedGpuMemory among the device's compute processes; false with why when it is not listed or
  // the driver does not report it (MPS clients, some virtualised GPUs).
  bool process_used_bytes(Device device, uint32_t pid, uint64_t* used, std::string* why) const;

 private:
  Nvml() = default;
  struct Api;
  void* handle_ = nullptr;
  std::unique_ptr<Api> api_;
  bool initialised_ = false;
};

// The updates of an energy counter that advances in steps, seen by polling: the first and the last reading at
// which its value changed. per_step() is the mean power between those two updates times the interval's length,
// per step; not available (with the reason) where fewer than two updates fell inside the interval.
class EnergyUpdates {
 public:
  struct Sample {
    double t_s = 0;   // seconds on any monotonic clock
    uint64_t mj = 0;  // the counter, millijoules
  };
  void reset(Sample at_start);
  void add(Sample s);
  int64_t updates() const { return updates_; }
  ProbeReading per_step(double interval_s, int64_t steps, const std::string& what) const;

 private:
  std::optional<Sample> prev_, first_, last_;
  int64_t updates_ = 0;
};

// The default NVML library name (dlopen'ed; DMOE_NVML_LIBRARY overrides it, e.g. a path).
std::string default_nvml_library();

struct ResourceProbeOptions {
  std::string scope = "this process";  // who the host numbers cover, e.g. "rank 0's process (W thread ranks)"
  bool gpu = false;                    // read the GPU below through NVML
  std::string gpu_pci_bus_id;          // the CUDA device NVML reads (empty with gpu: not available, gpu_why says why)
  std::string gpu_why;
  std::string gpu_scope;               // who shares the device, e.g. "2 ranks under MPS"
  std::string nvml_library = default_nvml_library();
  int32_t poll_ms = 10;
  std::string powercap_dir = "/sys/class/powercap";
  std::string proc_dir = "/proc/self";
};

struct ResourceReport {
  int64_t steps = 0;
  ProbeReading host_peak_memory;   // bytes
  ProbeReading host_resident_at_start;  // bytes: VmRSS at start() (the peak minus this is what the interval added)
  ProbeReading cpu_energy_per_step;  // J
  bool gpu = false;
  ProbeReading gpu_energy_per_step;         // J
  ProbeReading gpu_process_memory_peak;     // bytes
  ProbeReading gpu_device_memory_peak;      // bytes, device-wide
  std::vector<std::string> lines() const;   // one per reading, "name: text"
  nlohmann::json to_json() const;           // {"steps": n, "host_peak_memory": {...}, ...}
};

// Everything above over one interval of `steps` steps: start() before the first, finish(steps) after the last.
class ResourceProbe {
 public:
  explicit ResourceProbe(ResourceProbeOptions options);
  ~ResourceProbe();
  ResourceProbe(const ResourceProbe&) = delete;
  ResourceProbe& operator=(const ResourceProbe&) = delete;
  void start();
  ResourceReport finish(int64_t steps);

 private:
  void poll_once();
  ResourceProbeOptions o_;
  HostPeakProbe host_;
  RaplProbe rapl_;
  std::unique_ptr<Nvml> nvml_;
  Nvml::Device device_ = nullptr;
  std::string gpu_error_;  // non-empty: no GPU reading at all
  EnergyUpdates energy_;
  bool energy_started_ = false;
  double start_s_ = 0;
  std::string energy_error_;
  std::thread poller_;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  uint64_t process_peak_ = 0, device_peak_ = 0;
  int64_t samples_ = 0;
  std::string process_error_, device_error_;
};

}  // namespace dmoe
