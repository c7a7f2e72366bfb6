// test_resource_probe.cpp — peak memory and energy per step (core/resource_probe.hpp): the host high-water mark
// over an interval, RAPL on a fake powercap tree, NVML's loader where there is no NVML (this CPU machine) and with
// a fake library name, and the lines `dmoe train --schedule` and `dmoe flow measure` print and write.
// Run: dmoe_unit_tests --gtest_filter='ResourceProbe*'
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli_test_util.hpp"
#include "core/resource_probe.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kMiB = 1 << 20;

class ResourceProbe_ : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dmoe_resource_probe_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string p(const std::string& name) const { return (dir_ / name).string(); }
  static void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }
  fs::path dir_;
};
using ResourceProbeHost = ResourceProbe_;
using ResourceProbeRapl = ResourceProbe_;
using ResourceProbeNvml = ResourceProbe_;
using ResourceProbeCli = ResourceProbe_;

// Allocates and touches `bytes` (every page resident), keeping the compiler from removing it.
char* touch(size_t bytes) {
  char* p = static_cast<char*>(std::malloc(bytes));
  std::memset(p, 1, bytes);
  asm volatile("" : : "r"(p) : "memory");
  return p;
}

// The peak grows by what the interval allocates, and an earlier, larger allocation (freed before the start) is
// not in it: that is what makes it the interval's peak rather than the process's.
TEST_F(ResourceProbeHost, PeakCoversTheIntervalOnly) {
  char* big = touch(size_t(256 * kMiB));  // above the mmap threshold: freed back to the kernel
  std::free(big);
  HostPeakProbe probe;
  probe.start();
  if (!probe.reset_worked()) GTEST_SKIP() << "the kernel refused to reset the high-water mark: " << probe.reset_error();
  const auto rss0 = proc_status_bytes("/proc/self/status", "VmRSS");
  ASSERT_TRUE(rss0);
  char* mine = touch(size_t(64 * kMiB));
  const ProbeReading r = probe.finish("this test");
  std::free(mine);
  ASSERT_TRUE(r.value) << r.what;
  EXPECT_EQ(r.unit, "bytes");
  EXPECT_GE(*r.value, double(*rss0) + 60 * kMiB) << r.text();
  EXPECT_LT(*r.value, double(*rss0) + 200 * kMiB) << "the freed 256 MiB is in the peak: " << r.text();
  EXPECT_NE(r.what.find("over the interval"), std::string::npos) << r.what;
  EXPECT_EQ(r.what.find("LIFETIME"), std::string::npos) << r.what;
}

// Where the reset is refused (here: a proc directory without clear_refs), the number is the lifetime peak and the
// label says so.
TEST_F(ResourceProbeHost, RefusedResetIsLabelledAsTheLifetimePeak) {
  write(p("status"), "Name:\tx\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n");
  HostPeakProbe probe(dir_.string());
  probe.start();
  EXPECT_FALSE(probe.reset_worked());
  EXPECT_NE(probe.reset_error().find("clear_refs: cannot be opened"), std::string::npos) << probe.reset_error();
  const ProbeReading r = probe.finish("this test");
  ASSERT_TRUE(r.value);
  EXPECT_EQ(*r.value, 204800.0 * 1024);
  EXPECT_NE(r.what.find("PROCESS-LIFETIME peak"), std::string::npos) << r.what;
  EXPECT_NE(r.what.find("NOT this interval's"), std::string::npos) << r.what;
  // An accepted write that leaves the mark above the resident set (Linux < 4.0) is a refused reset too.
  write(p("clear_refs"), "");
  HostPeakProbe old_kernel(dir_.string());
  old_kernel.start();
  EXPECT_FALSE(old_kernel.reset_worked());
  EXPECT_NE(old_kernel.reset_error().find("Linux >= 4.0"), std::string::npos) << old_kernel.reset_error();
  // No status file at all: no number.
  HostPeakProbe none((dir_ / "missing").string());
  none.start();
  const ProbeReading n = none.finish("x");
  EXPECT_FALSE(n.value);
  EXPECT_EQ(n.what.rfind("not available: ", 0), 0u) << n.what;
  EXPECT_TRUE(n.to_json().at("value").is_null());
}

// Package domains only (not their sub-domains), summed, with the counter's wrap-around.
TEST_F(ResourceProbeRapl, SumsPackagesAndHandlesWrapAround) {
  for (const char* d : {"intel-rapl:0", "intel-rapl:1", "intel-rapl:0:0"}) fs::create_directories(dir_ / d);
  auto domain = [&](const char* d, const char* name, uint64_t energy, uint64_t range) {
    write(p(std::string(d) + "/name"), name);
    write(p(std::string(d) + "/energy_uj"), std::to_string(energy));
    write(p(std::string(d) + "/max_energy_range_uj"), std::to_string(range));
  };
  domain("intel-rapl:0", "package-0", 1'000'000, 10'000'000);
  domain("intel-rapl:1", "package-1", 9'000'000, 10'000'000);
  domain("intel-rapl:0:0", "core", 0, 10'000'000);
  RaplProbe probe(dir_.string());
  probe.start();
  domain("intel-rapl:0", "package-0", 4'000'000, 10'000'000);  // +3 J
  domain("intel-rapl:1", "package-1", 1'000'000, 10'000'000);  // wrapped: +2 J
  domain("intel-rapl:0:0", "core", 5'000'000, 10'000'000);     // a sub-domain of package 0: not added again
  const ProbeReading r = probe.finish(2);
  ASSERT_TRUE(r.value) << r.what;
  EXPECT_DOUBLE_EQ(*r.value, 2.5);
  EXPECT_NE(r.what.find("package-0, package-1"), std::string::npos) << r.what;

  RaplProbe none((dir_ / "missing").string());
  none.start();
  const ProbeReading n = none.finish(2);
  EXPECT_FALSE(n.value);
  EXPECT_NE(n.what.find("not available: "), std::string::npos) << n.what;
  // Unreadable counters (root-only since Linux 5.10, as in most containers): not available, saying which file.
  fs::remove(dir_ / "intel-rapl:1" / "energy_uj");
  RaplProbe unreadable(dir_.string());
  unreadable.start();
  const ProbeReading u = unreadable.finish(2);
  EXPECT_FALSE(u.value);
  EXPECT_NE(u.what.find("intel-rapl:1/energy_uj: cannot be read"), std::string::npos) << u.what;
}

// No NVML on this machine: the loader says why instead of failing; a fake library name shows the dlopen error,
// and a real library without NVML's symbols the missing-symbol one. The GPU readings then say "not available".
TEST_F(ResourceProbeNvml, MissingLibraryIsReportedNotFatal) {
  std::string why;
  auto real = Nvml::open("libnvidia-ml.so.1", &why);
  if (real) {
    std::printf("NVML is present on this machine: the not-available path is checked with fake names only\n");
  } else {
    EXPECT_NE(why.find("dlopen(libnvidia-ml.so.1) failed"), std::string::npos) << why;
  }
  why.clear();
  EXPECT_EQ(Nvml::open("/nonexistent/libnvidia-ml-fake.so.1", &why), nullptr);
  EXPECT_NE(why.find("NVML: dlopen(/nonexistent/libnvidia-ml-fake.so.1) failed"), std::string::npos) << why;
  why.clear();
  EXPECT_EQ(Nvml::open("libm.so.6", &why), nullptr);
  EXPECT_NE(why.find("has no symbol nvmlInit_v2"), std::string::npos) << why;

  ResourceProbeOptions o;
  o.gpu = true;
  o.gpu_pci_bus_id = "0000:01:00.0";
  o.nvml_library = "/nonexistent/libnvidia-ml-fake.so.1";
  o.powercap_dir = p("no_powercap");
  ResourceProbe probe(o);
  probe.start();
  const ResourceReport r = probe.finish(3);
  EXPECT_TRUE(r.host_peak_memory.value);
  EXPECT_FALSE(r.cpu_energy_per_step.value);
  for (const ProbeReading* g : {&r.gpu_energy_per_step, &r.gpu_process_memory_peak, &r.gpu_device_memory_peak}) {
    EXPECT_FALSE(g->value);
    EXPECT_NE(g->what.find("not available: NVML: dlopen(/nonexistent/libnvidia-ml-fake.so.1) failed"),
              std::string::npos) << g->what;
  }
  const json j = r.to_json();
  EXPECT_EQ(j.at("steps"), 3);
  EXPECT_TRUE(j.at("gpu_energy_per_step").at("value").is_null());
  EXPECT_EQ(r.lines().size(), 5u);

  // No device named (a build without CUDA): the reason given is the one reported.
  ResourceProbeOptions none;
  none.gpu = true;
  none.gpu_why = "a build without CUDA";
  ResourceProbe p2(none);
  p2.start();
  EXPECT_EQ(p2.finish(1).gpu_energy_per_step.what, "not available: a build without CUDA");
}

// NVML's energy counter advances in steps: a 60 ms interval read at its ends gave 0 J on the H200. The mean power
// between the first and last update inside the interval, times the interval; fewer than two updates: no value.
TEST(EnergyUpdates, MeanPowerBetweenUpdatesTimesTheInterval) {
  EnergyUpdates e;
  e.reset({0.0, 1000});
  for (int i = 1; i <= 9; ++i) e.add({0.01 * i, 1000});  // no update in the first 90 ms
  EXPECT_FALSE(e.per_step(0.09, 3, "x").value);
  EXPECT_NE(e.per_step(0.09, 3, "x").what.find("updated 0 times during the 90 ms interval"), std::string::npos)
      << e.per_step(0.09, 3, "x").what;
  e.add({0.10, 1000 + 40'000});  // one update: still no mean power
  EXPECT_FALSE(e.per_step(0.10, 3, "x").value);
  // Updates every 100 ms at 400 W (40 J each), polled every 10 ms, a 1.0 s interval of 4 steps: 100 J per step.
  for (int i = 11; i <= 100; ++i) e.add({0.01 * i, uint64_t(1000 + 40'000 * (i / 10))});
  ASSERT_EQ(e.updates(), 10);
  const ProbeReading r = e.per_step(1.0, 4, "NVML");
  ASSERT_TRUE(r.value);
  EXPECT_NEAR(*r.value, 100.0, 1e-9);
  EXPECT_EQ(r.unit, "J");
  EXPECT_NE(r.what.find("mean power 400 W"), std::string::npos) << r.what;
  // reset() forgets the updates.
  e.reset({2.0, 5});
  EXPECT_EQ(e.updates(), 0);
}

// The trainer's end-of-run lines (CPU engine, the CPU Flow executor on 2 thread ranks) and the last step's
// record in the log.
TEST_F(ResourceProbeCli, TrainPrintsPeakMemoryAndEnergy) {
  const std::string data = (fs::path(DMOE_SOURCE_DIR) / "tests/data/train_text.txt").string();
  const auto r = test::run_cli("train --config tiny --data " + data + " --steps 3 --seq 16 --world 2 --batch 4 "
                               "--micro-batches 2 --schedule pipe-attn --log " + p("log.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("resources over the 3 training steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("peak host memory: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("(all 2 thread ranks)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CPU energy per step: "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("GPU energy"), std::string::npos) << "the CPU engine reads no GPU:\n" << r.output;
  std::ifstream log(p("log.jsonl"));
  json last;
  for (std::string line; std::getline(log, line);)
    if (json j = json::parse(line); j.contains("loss")) last = j;  // the last step's record (its val_loss follows)
  ASSERT_TRUE(last.contains("resources")) << last.dump();
  EXPECT_EQ(last.at("step"), 3);
  EXPECT_GT(last.at("resources").at("host_peak_memory").at("value").get<double>(), 0);
  EXPECT_TRUE(last.at("resources").contains("cpu_energy_per_step"));
}

// flow measure: every row of the table and of --json carries its readings, for one schedule at several R and for
// the ablation (--schedule all).
TEST_F(ResourceProbeCli, FlowMeasureReportsEachSchedule) {
  const auto r = test::run_cli("flow measure --config tiny --batch 4 --seq 8 --world 2 --measure-r 1,2 --steps 1 "
                               "--json " + p("m.json"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("peak host MiB"), std::string::npos) << r.output;
  std::ifstream in(p("m.json"));
  const json m = json::parse(in);
  ASSERT_EQ(m.at("rows").size(), 2u);
  for (const json& row : m.at("rows")) {
    ASSERT_TRUE(row.contains("resources")) << row.dump();
    EXPECT_GT(row.at("resources").at("host_peak_memory").at("value").get<double>(), 0) << row.dump();
    EXPECT_FALSE(row.at("resources").at("host_peak_memory").at("what").get<std::string>().empty());
    EXPECT_TRUE(row.at("resources").contains("cpu_energy_per_step"));
  }
  const auto all = test::run_cli("flow measure --config tiny --batch 4 --seq 8 --world 2 --schedule all "
                                 "--micro-batches 2 --steps 1 --json " + p("all.json"));
  ASSERT_EQ(all.status, 0) << all.output;
  std::ifstream in2(p("all.json"));
  const json a = json::parse(in2);
  ASSERT_EQ(a.at("rows").size(), 4u);
  const char* names[] = {"vanilla", "pipe-moe", "pipe-attn", "chunked-ar"};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(a.at("rows")[i].at("schedule"), names[i]);
    EXPECT_EQ(a.at("rows")[i].at("micro_batches"), i == 0 ? 1 : 2);
    EXPECT_GT(a.at("rows")[i].at("measured_ms").get<double>(), 0);
    EXPECT_GT(a.at("rows")[i].at("resources").at("host_peak_memory").at("value").get<double>(), 0);
  }
  EXPECT_FALSE(a.contains("costs"));
  const auto no_fit = test::run_cli("flow measure --config tiny --batch 4 --schedule all --costs-out " + p("c.json"));
  EXPECT_NE(no_fit.status, 0);
  EXPECT_NE(no_fit.output.find("--costs-out is an option of flow measure with one --schedule"), std::string::npos)
      << no_fit.output;
}

}  // namespace
}  // namespace dmoe
