// resource_probe.cpp — see resource_probe.hpp.
#include "core/resource_probe.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/format.h>

namespace dmoe {

namespace fs = std::filesystem;

namespace {
double monotonic_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

// ---- readings ------------------------------------------------------------------------------------------------

ProbeReading ProbeReading::unavailable(std::string unit, const std::string& reason) {
  ProbeReading r;
  r.unit = std::move(unit);
  r.what = "not available: " + reason;
  return r;
}

std::string ProbeReading::text() const {
  if (!value) return what;
  if (unit == "bytes") return fmt::format("{:.1f} MiB ({})", *value / double(1 << 20), what);
  if (unit == "J") return fmt::format("{:.4g} J ({})", *value, what);
  return fmt::format("{:.6g} {} ({})", *value, unit, what);
}

nlohmann::json ProbeReading::to_json() const {
  return {{"value", value ? nlohmann::json(*value) : nlohmann::json(nullptr)}, {"unit", unit}, {"what", what}};
}

std::vector<std::string> ResourceReport::lines() const {
  std::vector<std::string> out = {"peak host memory: " + host_peak_memory.text(),
                                  "CPU energy per step: " + cpu_energy_per_step.text()};
  if (gpu) {
    out.push_back("GPU energy per step: " + gpu_energy_per_step.text());
    out.push_back("GPU memory of this process, peak: " + gpu_process_memory_peak.text());
    out.push_back("GPU memory used on the device, peak: " + gpu_device_memory_peak.text());
  }
  return out;
}

nlohmann::json ResourceReport::to_json() const {
  nlohmann::json j = {{"steps", steps}, {"host_peak_memory", host_peak_memory.to_json()},
                      {"host_resident_at_start", host_resident_at_start.to_json()},
                      {"cpu_energy_per_step", cpu_energy_per_step.to_json()}};
  if (gpu) {
    j["gpu_energy_per_step"] = gpu_energy_per_step.to_json();
    j["gpu_process_memory_peak"] = gpu_process_memory_peak.to_json();
    j["gpu_device_memory_peak"] = gpu_device_memory_peak.to_json();
  }
  return j;
}

// ---- host peak memory ------------------------------------------------------------------------------------------

std::optional<uint64_t> proc_status_bytes(const std::string& status_path, const std::string& field) {
  std::ifstream in(status_path);
  std::string line;
  const std::string key = field + ":";
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream s(line.substr(key.size()));
    uint64_t kb = 0;
    std::string unit;
    if (!(s >> kb >> unit) || unit != "kB") return std::nullopt;
    return kb * 1024;
  }
  return std::nullopt;
}

HostPeakProbe::HostPeakProbe(std::string proc_dir) : proc_dir_(std::move(proc_dir)) {}

void HostPeakProbe::start() {
  started_ = true;
#if defined(__GLIBC__)
  // Memory freed before the interval but still held by the allocator is resident and would be the reset's
  // starting level: hand it back first (every arena; glibc >= 2.8).
  malloc_trim(0);
#endif
  reset_ok_ = false;
  reset_error_.clear();
  const std::string path = proc_dir_ + "/clear_refs";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    reset_error_ = fmt::format("{}: cannot be opened for writing: {}", path, std::strerror(errno));
  } else {
    if (::write(fd, "5", 1) != 1) reset_error_ = fmt::format("{}: writing \"5\" failed: {}", path, std::strerror(errno));
    ::close(fd);
  }
  reset_ok_ = reset_error_.empty();
  rss_at_start_ = proc_status_bytes(proc_dir_ + "/status", "VmRSS");
  if (reset_ok_) {
    // Linux < 4.0 accepts the write but has no "5": the mark then stays above the current resident set.
    const auto hwm = proc_status_bytes(proc_dir_ + "/status", "VmHWM");
    if (hwm && rss_at_start_ && *hwm > *rss_at_start_ + (uint64_t(4) << 20)) {
      reset_ok_ = false;
      reset_error_ = fmt::format("{}: \"5\" was accepted but VmHWM ({} kB) stayed above VmRSS ({} kB): the kernel "
                                 "does not reset the mark (needs Linux >= 4.0)", path, *hwm / 1024, *rss_at_start_ / 1024);
    }
  }
}

ProbeReading HostPeakProbe::finish(const std::string& scope) const {
  const std::string status = proc_dir_ + "/status";
  const auto hwm = proc_status_bytes(status, "VmHWM");
  if (!started_) return ProbeReading::unavailable("bytes", "the probe was not started");
  if (!hwm) return ProbeReading::unavailable("bytes", fmt::format("no VmHWM in {} (not Linux?)", status));
  ProbeReading r;
  r.unit = "bytes";
  r.value = double(*hwm);
  if (reset_ok_)
    r.what = fmt::format("peak resident set of {} over the interval; VmHWM after a clear_refs reset at the start{}",
                         scope,
                         rss_at_start_ ? fmt::format(", when {:.1f} MiB were resident", *rss_at_start_ / double(1 << 20))
                                       : std::string());
  else
    r.what = fmt::format("PROCESS-LIFETIME peak of {}, NOT this interval's: the high-water mark could not be reset "
                         "({})", scope, reset_error_);
  return r;
}

// ---- RAPL ------------------------------------------------------------------------------------------------------

namespace {

bool read_u64(const std::string& path, uint64_t* v, std::string* why) {
  std::ifstream in(path);
  if (!in) {
    *why = fmt::format("{}: cannot be read: {}", path, std::strerror(errno));
    return false;
  }
  if (!(in >> *v)) {
    *why = fmt::format("{}: not a number", path);
    return false;
  }
  return true;
}

}  // namespace

RaplProbe::RaplProbe(std::string powercap_dir) : dir_(std::move(powercap_dir)) {}

void RaplProbe::start() {
  domains_.clear();
  error_.clear();
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) {
    error_ = fmt::format("{} does not exist (no powercap/RAPL driver here, or not visible in this container)", dir_);
    return;
  }
  // Top-level package domains only ("intel-rapl:0", not the sub-domains "intel-rapl:0:0" they contain).
  const std::regex package(R"(intel-rapl:[0-9]+)");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (std::regex_match(e.path().filename().string(), package)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  if (names.empty()) {
    error_ = fmt::format("no intel-rapl:N package domain in {}", dir_);
    return;
  }
  for (const std::string& n : names) {
    Domain d;
    d.path = dir_ + "/" + n;
    std::ifstream name_file(d.path + "/name");
    if (!(name_file >> d.name)) d.name = n;
    if (!read_u64(d.path + "/max_energy_range_uj", &d.range_uj, &error_) ||
        !read_u64(d.path + "/energy_uj", &d.start_uj, &error_)) {
      domains_.clear();
      return;
    }
    domains_.push_back(d);
  }
}

ProbeReading RaplProbe::finish(int64_t steps) const {
  if (!error_.empty()) return ProbeReading::unavailable("J", error_);
  if (domains_.empty()) return ProbeReading::unavailable("J", "the probe was not started");
  double uj = 0;
  std::string names;
  for (const Domain& d : domains_) {
    uint64_t end = 0;
    std::string why;
    if (!read_u64(d.path + "/energy_uj", &end, &why)) return ProbeReading::unavailable("J", why);
    // The counter wraps to 0 past max_energy_range_uj; one wrap is seen, more (an interval longer than the
    // range at full power, ~20 min for 262 kJ at 200 W) would be undercounted.
    uj += double(end >= d.start_uj ? end - d.start_uj : d.range_uj - d.start_uj + end);
    names += (names.empty() ? "" : ", ") + d.name;
  }
  ProbeReading r;
  r.unit = "J";
  r.value = uj * 1e-6 / double(std::max<int64_t>(1, steps));
  r.what = fmt::format("RAPL {} over {} steps, per step: the whole package, every process on it", names, steps);
  return r;
}

// ---- NVML ------------------------------------------------------------------------------------------------------

// A named namespace, not an anonymous one: Nvml::Api (declared in the header) has fields of these types, which in a
// unity build (several sources in one unit) is a -Wsubobject-linkage warning.
namespace nvml_abi {

// NVML's C API as documented (nvml.h is not needed: these are the few calls used, with their documented types).
using nvmlReturn = int;  // NVML_SUCCESS = 0
constexpr nvmlReturn kNvmlSuccess = 0, kNvmlInsufficientSize = 7;
constexpr unsigned long long kNvmlValueNotAvailable = ~0ull;
struct NvmlProcessInfo {  // nvmlProcessInfo_t (v2 and v3 of the running-processes queries)
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
};
struct NvmlMemory {  // nvmlMemory_t
  unsigned long long total, free, used;
};

}  // namespace nvml_abi
using namespace nvml_abi;

struct Nvml::Api {
  nvmlReturn (*init)() = nullptr;
  nvmlReturn (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn) = nullptr;
  nvmlReturn (*by_pci_bus_id)(const char*, void**) = nullptr;
  nvmlReturn (*total_energy)(void*, unsigned long long*) = nullptr;
  nvmlReturn (*memory_info)(void*, NvmlMemory*) = nullptr;
  nvmlReturn (*compute_processes)(void*, unsigned int*, NvmlProcessInfo*) = nullptr;
  std::string compute_processes_name;

  std::string error(const char* call, nvmlReturn rc) const {
    const char* s = error_string ? error_string(rc) : nullptr;
    return fmt::format("{}: {} (NVML error {})", call, s ? s : "unknown error", rc);
  }
};

std::string default_nvml_library() {
  const char* env = std::getenv("DMOE_NVML_LIBRARY");
  return env && *env ? env : "libnvidia-ml.so.1";
}

std::unique_ptr<Nvml> Nvml::open(const std::string& library, std::string* why) {
  std::unique_ptr<Nvml> n(new Nvml());
  dlerror();
  n->handle_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!n->handle_) {
    const char* e = dlerror();
    *why = fmt::format("NVML: dlopen({}) failed: {} (no NVIDIA driver here?)", library, e ? e : "unknown error");
    return nullptr;
  }
  n->api_ = std::make_unique<Api>();
  Api& a = *n->api_;
  auto sym = [&](const char* name, auto* fn) {
    void* p = dlsym(n->handle_, name);
    if (p) *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
    return p != nullptr;
  };
  const char* missing = nullptr;
  if (!sym("nvmlInit_v2", &a.init)) missing = "nvmlInit_v2";
  else if (!sym("nvmlShutdown", &a.shutdown)) missing = "nvmlShutdown";
  else if (!sym("nvmlErrorString", &a.error_string)) missing = "nvmlErrorString";
  else if (!sym("nvmlDeviceGetHandleByPciBusId_v2", &a.by_pci_bus_id)) missing = "nvmlDeviceGetHandleByPciBusId_v2";
  else if (!sym("nvmlDeviceGetTotalEnergyConsumption", &a.total_energy)) missing = "nvmlDeviceGetTotalEnergyConsumption";
  else if (!sym("nvmlDeviceGetMemoryInfo", &a.memory_info)) missing = "nvmlDeviceGetMemoryInfo";
  if (missing) {
    *why = fmt::format("NVML: {} has no symbol {} (driver too old?)", library, missing);
    return nullptr;  // the destructor closes the library
  }
  if (sym("nvmlDeviceGetComputeRunningProcesses_v3", &a.compute_processes))
    a.compute_processes_name = "nvmlDeviceGetComputeRunningProcesses_v3";
  else if (sym("nvmlDeviceGetComputeRunningProcesses_v2", &a.compute_processes))
    a.compute_processes_name = "nvmlDeviceGetComputeRunningProcesses_v2";
  const nvmlReturn rc = a.init();
  if (rc != kNvmlSuccess) {
    *why = a.error("nvmlInit_v2", rc);
    return nullptr;
  }
  n->initialised_ = true;
  return n;
}

Nvml::~Nvml() {
  if (initialised_ && api_ && api_->shutdown) api_->shutdown();  // its error has nobody to go to
  if (handle_) dlclose(handle_);
}

bool Nvml::device_by_pci_bus_id(const std::string& bus_id, Device* device, std::string* why) const {
  const nvmlReturn rc = api_->by_pci_bus_id(bus_id.c_str(), device);
  if (rc != kNvmlSuccess) *why = api_->error(fmt::format("nvmlDeviceGetHandleByPciBusId_v2({})", bus_id).c_str(), rc);
  return rc == kNvmlSuccess;
}

bool Nvml::total_energy_mj(Device device, uint64_t* mj, std::string* why) const {
  unsigned long long v = 0;
  const nvmlReturn rc = api_->total_energy(device, &v);
  if (rc != kNvmlSuccess) {
    *why = api_->error("nvmlDeviceGetTotalEnergyConsumption", rc);
    return false;
  }
  *mj = v;
  return true;
}

bool Nvml::device_used_bytes(Device device, uint64_t* used, std::string* why) const {
  NvmlMemory m{};
  const nvmlReturn rc = api_->memory_info(device, &m);
  if (rc != kNvmlSuccess) {
    *why = api_->error("nvmlDeviceGetMemoryInfo", rc);
    return false;
  }
  *used = m.used;
  return true;
}

bool Nvml::process_used_bytes(Device device, uint32_t pid, uint64_t* used, std::string* why) const {
  if (!api_->compute_processes) {
    *why = "NVML has neither nvmlDeviceGetComputeRunningProcesses_v3 nor _v2";
    return false;
  }
  std::vector<NvmlProcessInfo> infos;
  for (int attempt = 0; attempt < 4; ++attempt) {  // the list can grow between the size query and the read
    unsigned int count = unsigned(infos.size());
    const nvmlReturn rc = api_->compute_processes(device, &count, infos.empty() ? nullptr : infos.data());
    if (rc == kNvmlInsufficientSize) {
      infos.resize(size_t(count) + 8);
      continue;
    }
    if (rc != kNvmlSuccess) {
      *why = api_->error(api_->compute_processes_name.c_str(), rc);
      return false;
    }
    for (unsigned i = 0; i < count && i < infos.size(); ++i) {
      if (infos[i].pid != pid) continue;
      if (infos[i].usedGpuMemory == kNvmlValueNotAvailable) {
        *why = fmt::format("{}: this process (pid {}) is listed without its memory (MPS client or virtualised GPU)",
                           api_->compute_processes_name, pid);
        return false;
      }
      *used = infos[i].usedGpuMemory;
      return true;
    }
    *why = fmt::format("{}: this process (pid {}) is not among the device's {} compute processes (under MPS the "
                       "server holds the memory)", api_->compute_processes_name, pid, count);
    return false;
  }
  *why = fmt::format("{}: the process list kept growing", api_->compute_processes_name);
  return false;
}

// ---- energy counter updates ------------------------------------------------------------------------------------

void EnergyUpdates::reset(Sample at_start) {
  prev_ = at_start;
  first_.reset();
  last_.reset();
  updates_ = 0;
}

void EnergyUpdates::add(Sample s) {
  if (prev_ && s.mj != prev_->mj) {
    ++updates_;
    if (!first_) first_ = s;
    last_ = s;
  }
  prev_ = s;
}

ProbeReading EnergyUpdates::per_step(double interval_s, int64_t steps, const std::string& what) const {
  if (updates_ < 2 || !first_ || !last_ || last_->t_s <= first_->t_s)
    return ProbeReading::unavailable(
        "J", fmt::format("the energy counter updated {} time{} during the {:.0f} ms interval; two are needed for a mean "
                         "power (it advances in steps tens of ms apart): measure more steps",
                         updates_, updates_ == 1 ? "" : "s", interval_s * 1e3));
  const double span_s = last_->t_s - first_->t_s;
  const double watts = double(last_->mj - std::min(last_->mj, first_->mj)) * 1e-3 / span_s;
  ProbeReading r;
  r.unit = "J";
  r.value = watts * interval_s / double(std::max<int64_t>(1, steps));
  r.what = fmt::format("{}; mean power {:.0f} W between the counter's first and last of {} updates ({:.0f} of {:.0f} "
                       "ms) times the interval", what, watts, updates_, span_s * 1e3, interval_s * 1e3);
  return r;
}

// ---- all of it -------------------------------------------------------------------------------------------------

ResourceProbe::ResourceProbe(ResourceProbeOptions options)
    : o_(std::move(options)), host_(o_.proc_dir), rapl_(o_.powercap_dir) {
  if (!o_.gpu) return;
  if (o_.gpu_pci_bus_id.empty()) {
    gpu_error_ = o_.gpu_why.empty() ? "no GPU named" : o_.gpu_why;
    return;
  }
  nvml_ = Nvml::open(o_.nvml_library, &gpu_error_);
  if (nvml_ && !nvml_->device_by_pci_bus_id(o_.gpu_pci_bus_id, &device_, &gpu_error_)) nvml_.reset();
}

ResourceProbe::~ResourceProbe() {
  stop_ = true;
  if (poller_.joinable()) poller_.join();
}

void ResourceProbe::poll_once() {
  uint64_t proc = 0, dev = 0;
  std::string proc_why, dev_why;
  const bool proc_ok = nvml_->process_used_bytes(device_, uint32_t(::getpid()), &proc, &proc_why);
  const bool dev_ok = nvml_->device_used_bytes(device_, &dev, &dev_why);
  uint64_t mj = 0;
  std::string energy_why;
  const bool energy_ok = energy_started_ && nvml_->total_energy_mj(device_, &mj, &energy_why);
  const double now = monotonic_s();
  std::lock_guard<std::mutex> lock(mutex_);
  if (energy_ok) energy_.add({now, mj});
  ++samples_;
  if (proc_ok) process_peak_ = std::max(process_peak_, proc);
  else if (process_error_.empty()) process_error_ = proc_why;
  if (dev_ok) device_peak_ = std::max(device_peak_, dev);
  else if (device_error_.empty()) device_error_ = dev_why;
}

void ResourceProbe::start() {
  stop_ = true;  // a second start() without finish(): the previous poller ends first
  if (poller_.joinable()) poller_.join();
  if (nvml_) {
    energy_error_.clear();
    uint64_t mj = 0;
    start_s_ = monotonic_s();
    energy_started_ = nvml_->total_energy_mj(device_, &mj, &energy_error_);
    if (energy_started_) energy_.reset({start_s_, mj});
    process_peak_ = device_peak_ = 0;
    samples_ = 0;
    process_error_.clear();
    device_error_.clear();
    poll_once();
    stop_ = false;
    poller_ = std::thread([this] {
      while (!stop_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(std::max(1, o_.poll_ms)));
        if (!stop_) poll_once();
      }
    });
  }
  rapl_.start();
  host_.start();  // last: the others' set-up is not in the interval
}

ResourceReport ResourceProbe::finish(int64_t steps) {
  ResourceReport r;
  r.steps = steps;
  r.host_peak_memory = host_.finish(o_.scope);
  if (host_.resident_at_start()) {
    r.host_resident_at_start.unit = "bytes";
    r.host_resident_at_start.value = double(*host_.resident_at_start());
    r.host_resident_at_start.what = "VmRSS when the interval started";
  } else {
    r.host_resident_at_start = ProbeReading::unavailable("bytes", "no VmRSS in " + o_.proc_dir + "/status");
  }
  r.cpu_energy_per_step = rapl_.finish(steps);
  r.gpu = o_.gpu;
  if (!o_.gpu) return r;
  if (!nvml_) {
    r.gpu_energy_per_step = ProbeReading::unavailable("J", gpu_error_);
    r.gpu_process_memory_peak = ProbeReading::unavailable("bytes", gpu_error_);
    r.gpu_device_memory_peak = ProbeReading::unavailable("bytes", gpu_error_);
    return r;
  }
  const double interval_s = monotonic_s() - start_s_;
  const std::string scope = o_.gpu_scope.empty() ? std::string() : "; " + o_.gpu_scope;
  stop_ = true;
  if (poller_.joinable()) poller_.join();
  poll_once();
  std::lock_guard<std::mutex> lock(mutex_);
  if (energy_started_) {
    r.gpu_energy_per_step = energy_.per_step(
        interval_s, steps,
        fmt::format("NVML total energy of GPU {} over {} steps, per step: the whole device, every process on it{}",
                    o_.gpu_pci_bus_id, steps, scope));
  } else {
    r.gpu_energy_per_step = ProbeReading::unavailable("J", energy_error_);
  }
  if (process_peak_ > 0 || process_error_.empty()) {
    r.gpu_process_memory_peak.unit = "bytes";
    r.gpu_process_memory_peak.value = double(process_peak_);
    r.gpu_process_memory_peak.what =
        fmt::format("this process (pid {}) on GPU {}, NVML's usedGpuMemory: the maximum of {} samples, one every {} "
                    "ms (shorter-lived allocations can be missed){}", ::getpid(), o_.gpu_pci_bus_id, samples_,
                    o_.poll_ms, process_error_.empty() ? "" : "; some samples failed: " + process_error_);
  } else {
    r.gpu_process_memory_peak = ProbeReading::unavailable("bytes", process_error_);
  }
  if (device_peak_ > 0 || device_error_.empty()) {
    r.gpu_device_memory_peak.unit = "bytes";
    r.gpu_device_memory_peak.value = double(device_peak_);
    r.gpu_device_memory_peak.what =
        fmt::format("DEVICE-WIDE used memory of GPU {} (every process on it and the driver's reservations{}): the "
                    "maximum of {} samples, one every {} ms", o_.gpu_pci_bus_id, scope, samples_, o_.poll_ms);
  } else {
    r.gpu_device_memory_peak = ProbeReading::unavailable("bytes", device_error_);
  }
  return r;
}

}  // namespace dmoe
