// Launcher and process environment, on the CPU: detect_process_env for each launcher's variables, and
// `dmoe launch` running small shell children (output relay, per-rank environment, MPS handling with a
// fake nvidia-smi / nvidia-cuda-mps-control on PATH, failure teardown, signal forwarding).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/launcher.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// ---- detect_process_env ---------------------------------------------------------------------------

// Clears every launcher variable for the test and restores the caller's values afterwards.
class EnvGuard {
 public:
  EnvGuard() {
    for (const char* name : kNames) {
      if (const char* v = std::getenv(name)) saved_[name] = v;
      ::unsetenv(name);
    }
  }
  ~EnvGuard() {
    for (const char* name : kNames) {
      ::unsetenv(name);
      if (auto it = saved_.find(name); it != saved_.end()) ::setenv(name, it->second.c_str(), 1);
    }
  }
  void set(const char* name, const char* value) { ::setenv(name, value, 1); }

 private:
  static constexpr std::array<const char*, 24> kNames{
      "DMOE_RANK", "DMOE_WORLD", "DMOE_LOCAL_RANK", "DMOE_LOCAL_WORLD", "DMOE_DEVICE",
      "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
      "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_ID", "PMI_RANK", "PMI_SIZE",
      "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "DMOE_SHARED_GPUS", "DMOE_RENDEZVOUS"};
  std::map<std::string, std::string> saved_;
};

void expect_env(const ProcessEnv& e, int32_t rank, int32_t world, int32_t local_rank, int32_t local_world,
                const char* launcher) {
  EXPECT_EQ(e.rank, rank);
  EXPECT_EQ(e.world, world);
  EXPECT_EQ(e.local_rank, local_rank);
  EXPECT_EQ(e.local_world, local_world);
  EXPECT_EQ(e.launcher, launcher);
}

// The error names the variable that was wrong.
void expect_env_error(const char* variable) {
  try {
    detect_process_env();
    ADD_FAILURE() << "expected an error naming " << variable;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(variable), std::string::npos) << e.what();
  }
}

TEST(LaunchEnv, SingleProcessWithoutLauncherVariables) {
  EnvGuard env;
  expect_env(detect_process_env(), 0, 1, 0, 1, "single");
}

TEST(LaunchEnv, DmoeLaunchVariables) {
  EnvGuard env;
  env.set("DMOE_RANK", "2");
  env.set("DMOE_WORLD", "4");
  env.set("DMOE_LOCAL_RANK", "2");
  env.set("DMOE_LOCAL_WORLD", "4");
  expect_env(detect_process_env(), 2, 4, 2, 4, "dmoe-launch");
}

TEST(LaunchEnv, DmoeLaunchWinsOverMpiVariablesItInherits) {
  EnvGuard env;
  env.set("OMPI_COMM_WORLD_RANK", "0");
  env.set("OMPI_COMM_WORLD_SIZE", "1");
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
  env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "1");
  env.set("DMOE_RANK", "1");
  env.set("DMOE_WORLD", "3");
  expect_env(detect_process_env(), 1, 3, 1, 3, "dmoe-launch");  // local defaults to global: one node
}

TEST(LaunchEnv, OpenMpiVariables) {
  EnvGuard env;
  env.set("OMPI_COMM_WORLD_RANK", "5");
  env.set("OMPI_COMM_WORLD_SIZE", "8");
  env.set("OMPI_COMM_WORLD_LOCAL_RANK", "1");
  env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "4");
  expect_env(detect_process_env(), 5, 8, 1, 4, "mpirun");
}

// A task of an srun step: SLURM_STEP_ID marks the step (srun(1)). Until the thirteenth bad-input pass this test
// set no SLURM_STEP_ID and pinned SLURM_NTASKS alone as an srun world; but sbatch(1) gives a batch script's own
// process SLURM_PROCID and SLURM_NTASKS too (the job's task count, no SLURM_STEP_*), so SLURM_NTASKS alone does not
// tell a step's task from the one process of the script (SlurmBatchScriptIsOneProcess).
TEST(LaunchEnv, SlurmVariables) {
  EnvGuard env;
  env.set("SLURM_STEP_ID", "0");
  env.set("SLURM_PROCID", "3");
  env.set("SLURM_NTASKS", "4");
  env.set("SLURM_LOCALID", "1");
  env.set("SLURM_NTASKS_PER_NODE", "2");
  expect_env(detect_process_env(), 3, 4, 1, 2, "srun");
}

// sbatch --ntasks=4 (or --ntasks-per-node=2 on 2 nodes): the batch script runs once, on the first node, with the
// job's variables; dmoe run directly in it is a single process (srun would start the 4 tasks).
TEST(LaunchEnv, SlurmBatchScriptIsOneProcess) {
  EnvGuard env;
  env.set("SLURM_PROCID", "0");
  env.set("SLURM_NTASKS", "4");
  env.set("SLURM_LOCALID", "0");
  env.set("SLURM_NODEID", "0");
  env.set("SLURM_TASKS_PER_NODE", "2(x2)");
  env.set("SLURM_NTASKS_PER_NODE", "2");
  expect_env(detect_process_env(), 0, 1, 0, 1, "single");
}

// srun -n 2 inside a job of --ntasks-per-node=4: the step's counts (SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE)
// win over the job's inherited SLURM_NTASKS and SLURM_NTASKS_PER_NODE (which gave a local world of 4 in a world of 2:
// refused as invalid before).
TEST(LaunchEnv, SlurmStepCountsWinOverTheJobs) {
  EnvGuard env;
  env.set("SLURM_STEP_ID", "3");
  env.set("SLURM_PROCID", "1");
  env.set("SLURM_NTASKS", "8");
  env.set("SLURM_NTASKS_PER_NODE", "4");
  env.set("SLURM_TASKS_PER_NODE", "4(x2)");
  env.set("SLURM_STEP_NUM_TASKS", "2");
  env.set("SLURM_STEP_TASKS_PER_NODE", "2");
  env.set("SLURM_LOCALID", "1");
  env.set("SLURM_NODEID", "0");
  expect_env(detect_process_env(), 1, 2, 1, 2, "srun");
}

TEST(LaunchEnv, SlurmCompressedTasksPerNode) {
  EnvGuard env;
  env.set("SLURM_STEP_ID", "0");
  env.set("SLURM_PROCID", "6");
  env.set("SLURM_NTASKS", "7");
  env.set("SLURM_LOCALID", "0");
  env.set("SLURM_NODEID", "3");
  env.set("SLURM_TASKS_PER_NODE", "2(x3),1");  // nodes 0..2 run 2 tasks, node 3 runs 1
  expect_env(detect_process_env(), 6, 7, 0, 1, "srun");
  env.set("SLURM_NODEID", "4");
  expect_env_error("SLURM_TASKS_PER_NODE");
  env.set("SLURM_NODEID", "0");
  env.set("SLURM_TASKS_PER_NODE", "2(x3");
  expect_env_error("SLURM_TASKS_PER_NODE");
}

TEST(LaunchEnv, PmiVariables) {
  EnvGuard env;
  env.set("PMI_RANK", "1");
  env.set("PMI_SIZE", "2");
  expect_env(detect_process_env(), 1, 2, 1, 2, "pmi");
  env.set("MPI_LOCALRANKID", "0");
  env.set("MPI_LOCALNRANKS", "1");
  expect_env(detect_process_env(), 1, 2, 0, 1, "pmi");
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  {
    EnvGuard env;
    env.set("DMOE_RANK", "1x");
    env.set("DMOE_WORLD", "2");
    expect_env_error("DMOE_RANK");
  }
  {
    EnvGuard env;
    env.set("DMOE_RANK", "2");
    env.set("DMOE_WORLD", "2");  // rank out of range
    expect_env_error("DMOE_RANK");
  }
  {
    EnvGuard env;
    env.set("DMOE_RANK", "0");  // DMOE_WORLD missing
    expect_env_error("DMOE_WORLD");
  }
  {
    EnvGuard env;
    env.set("OMPI_COMM_WORLD_RANK", "0");
    env.set("OMPI_COMM_WORLD_SIZE", "");
    env.set("OMPI_COMM_WORLD_LOCAL_RANK", "0");
    env.set("OMPI_COMM_WORLD_LOCAL_SIZE", "1");
    expect_env_error("OMPI_COMM_WORLD_SIZE");
  }
  {
    EnvGuard env;
    env.set("SLURM_STEP_ID", "0");
    env.set("SLURM_PROCID", "0");
    env.set("SLURM_NTASKS", "2");
    env.set("SLURM_LOCALID", " 0");
    env.set("SLURM_NTASKS_PER_NODE", "2");
    expect_env_error("SLURM_LOCALID");
  }
  {
    EnvGuard env;
    env.set("PMI_RANK", "0");
    env.set("PMI_SIZE", "99999999999");  // overflows int32
    expect_env_error("PMI_SIZE");
  }
}

TEST(LaunchEnv, ChooseDevice) {
  EnvGuard env;
  ProcessEnv e;
  e.rank = e.local_rank = 5;
  e.world = e.local_world = 8;
  EXPECT_EQ(choose_device(e, 1), 0);
  EXPECT_EQ(choose_device(e, 4), 1);
  env.set("DMOE_DEVICE", "3");
  EXPECT_EQ(choose_device(e, 4), 3);
  env.set("DMOE_DEVICE", "4");
  EXPECT_THROW(choose_device(e, 4), Error);
  env.set("DMOE_DEVICE", "one");
  EXPECT_THROW(choose_device(e, 4), Error);
  EXPECT_THROW(choose_device(e, 0), Error);
}

TEST(LaunchEnv, AssignDevicesRoundRobin) {
  EXPECT_EQ(assign_devices(5, {0, 1}), (std::vector<int32_t>{0, 1, 0, 1, 0}));
  EXPECT_EQ(assign_devices(3, {2}), (std::vector<int32_t>{2, 2, 2}));
  EXPECT_TRUE(assign_devices(3, {}).empty());
}

// ---- dmoe launch ----------------------------------------------------------------------------------

std::string sh_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

struct CliResult {
  int status = -1;
  std::string output;
};

CliResult run_shell(const std::string& command) {
  CliResult r;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), pipe)) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Alive and not a zombie (an orphan killed here may wait for a reaper that never comes).
bool process_running(pid_t pid) {
  if (::kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t paren = line.rfind(')');
  return !(paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z');
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Lines "[rank R] key=value ..." printed by the children, as (rank -> key -> value).
std::map<int, std::map<std::string, std::string>> parse_rank_vars(const std::string& output) {
  std::map<int, std::map<std::string, std::string>> vars;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    int rank = -1;
    if (std::sscanf(line.c_str(), "[rank %d]", &rank) != 1) continue;
    std::istringstream words(line.substr(line.find(']') + 1));
    for (std::string w; words >> w;)
      if (const size_t eq = w.find('='); eq != std::string::npos) vars[rank][w.substr(0, eq)] = w.substr(eq + 1);
  }
  return vars;
}

// Each test gets a directory with a fake nvidia-smi (listing `gpus` GPUs) and a fake MPS control tool
// that logs its start and quit, so the GPU paths of the launcher run on a machine without GPUs.
class LaunchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("dmoe_launch_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "bin");
  }
  void TearDown() override { fs::remove_all(dir_); }

  void write_script(const std::string& name, const std::string& body) {
    const fs::path path = dir_ / "bin" / name;
    std::ofstream(path) << "#!/bin/sh\n" << body;
    fs::permissions(path, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec);
  }
  void fake_gpus(int count) {
    std::string body;
    for (int g = 0; g < count; ++g) body += "echo 'GPU " + std::to_string(g) + ": NVIDIA Fake (UUID: GPU-0)'\n";
    write_script("nvidia-smi", body);
  }
  // Like the real one: `-d` leaves a daemon running (a sleep) whose pid is in the pipe directory;
  // `quit` ends it a little later, so the launcher has to wait for it.
  void fake_mps() {
    const std::string pid_file = "\"$CUDA_MPS_PIPE_DIRECTORY/nvidia-cuda-mps-control.pid\"";
    write_script("nvidia-cuda-mps-control",
                 "if [ \"$1\" = -d ]; then echo \"start $CUDA_MPS_PIPE_DIRECTORY\" >> " + mps_log() +
                     "; sleep 30 & echo $! > " + pid_file + "; exit 0; fi\n"
                     "read cmd\necho \"$cmd $CUDA_MPS_PIPE_DIRECTORY\" >> " + mps_log() + "\n"
                     "pid=$(cat " + pid_file + "); cp " + pid_file + " " + (dir_ / "daemon.pid").string() +
                     "; (sleep 0.2; kill $pid) &\n");
  }
  std::string mps_log() const { return (dir_ / "mps.log").string(); }
  std::string read_file(const fs::path& p) const {
    std::ifstream in(p);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  // Runs `dmoe launch ARGS -- sh -c SCRIPT SCRIPT_ARGS` with the fake tools first on PATH.
  CliResult launch_sh(const std::string& args, const std::string& script, const std::string& env_prefix = "",
                      const std::string& script_args = "") {
    const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
    return run_shell(env_prefix + " PATH=" + sh_quote(path) + " " + DMOE_CLI_PATH + " launch " + args + " -- sh -c " +
                     sh_quote(script) + " " + script_args);
  }

  // The same through the library entry point, in this process (no CLI start-up, which loads the CUDA
  // libraries): PATH gets the fake tools first, `env` is applied (nullptr unsets) and restored after.
  CliResult launch_lib(int32_t ranks, const std::string& script, std::vector<int32_t> gpus = {}, bool use_mps = true,
                       std::vector<std::pair<const char*, const char*>> env = {}) {
    const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
    // Whatever the machine running the tests exports must not change what the launcher decides.
    std::vector<std::pair<const char*, const char*>> defaults{
        {"PATH", path.c_str()}, {"CUDA_VISIBLE_DEVICES", nullptr}, {"CUDA_MPS_PIPE_DIRECTORY", nullptr},
        {"CUDA_MPS_LOG_DIRECTORY", nullptr}, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", nullptr},
        {"NCCL_NVLS_ENABLE", nullptr}, {"NVSHMEM_DISABLE_NVLS", nullptr}, {"NVSHMEM_DISABLE_NCCL", nullptr}};
    env.insert(env.begin(), defaults.begin(), defaults.end());  // later entries (the test's) win
    std::vector<std::pair<std::string, std::optional<std::string>>> saved;
    for (const auto& [name, value] : env) {
      const char* old = std::getenv(name);
      saved.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      if (value)
        ::setenv(name, value, 1);
      else
        ::unsetenv(name);
    }
    const fs::path out_path = dir_ / "launch_out.txt";
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CliResult r;
    LaunchOptions o;
    o.num_ranks = ranks;
    o.gpus = std::move(gpus);
    o.use_mps = use_mps;
    o.command = {"sh", "-c", script};
    o.out_fd = fd;
    o.err_fd = fd;
    try {
      r.status = launch(o);
    } catch (const Error& e) {
      r.output = std::string(e.what()) + "\n";
    }
    ::close(fd);
    for (auto it = saved.rbegin(); it != saved.rend(); ++it) {
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
    }
    r.output = read_file(out_path) + r.output;
    return r;
  }

  fs::path dir_;
};

constexpr const char* kPrintEnv =
    "echo r=$DMOE_RANK w=$DMOE_WORLD lr=$DMOE_LOCAL_RANK lw=$DMOE_LOCAL_WORLD dev=${DMOE_DEVICE-none} "
    "shared=${DMOE_SHARED_GPUS-none} pct=${CUDA_MPS_ACTIVE_THREAD_PERCENTAGE-none} "
    "pipe=${CUDA_MPS_PIPE_DIRECTORY-none} nvls=$NCCL_NVLS_ENABLE shmem_nvls=$NVSHMEM_DISABLE_NVLS "
    "shmem_nccl=${NVSHMEM_DISABLE_NCCL-none} rv=$DMOE_RENDEZVOUS; "
    "[ -d \"$DMOE_RENDEZVOUS\" ] && echo rv_exists=1";

TEST_F(LaunchCli, EveryRanksOutputIsPrefixed) {
  fake_gpus(0);
  const auto r = launch_sh("-n 3", "echo out $DMOE_RANK; echo err $DMOE_RANK >&2; printf partial$DMOE_RANK");
  ASSERT_EQ(r.status, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    const std::string p = "[rank " + std::to_string(rank) + "] ";
    EXPECT_TRUE(contains(r.output, p + "out " + std::to_string(rank) + "\n")) << r.output;
    EXPECT_TRUE(contains(r.output, p + "err " + std::to_string(rank) + "\n")) << r.output;
    EXPECT_TRUE(contains(r.output, p + "partial" + std::to_string(rank) + "\n")) << r.output;  // unterminated line
  }
}

TEST_F(LaunchCli, RanksSharingGpusGetMpsAndPercentages) {
  fake_gpus(2);
  fake_mps();
  const auto r = launch_lib(4, kPrintEnv);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto vars = parse_rank_vars(r.output);
  ASSERT_EQ(vars.size(), 4u) << r.output;
  std::string pipe_dir, rendezvous;
  for (int rank = 0; rank < 4; ++rank) {
    auto v = vars.at(rank);
    EXPECT_EQ(v["r"], std::to_string(rank));
    EXPECT_EQ(v["w"], "4");
    EXPECT_EQ(v["lr"], std::to_string(rank));
    EXPECT_EQ(v["lw"], "4");
    EXPECT_EQ(v["dev"], std::to_string(rank % 2));
    EXPECT_EQ(v["shared"], "1");
    EXPECT_EQ(v["pct"], "50");  // two ranks per GPU
    EXPECT_EQ(v["nvls"], "0");
    EXPECT_EQ(v["shmem_nvls"], "1");
    EXPECT_EQ(v["shmem_nccl"], "1");
    EXPECT_EQ(v["rv_exists"], "1");
    EXPECT_NE(v["pipe"], "none");
    if (rank == 0) pipe_dir = v["pipe"], rendezvous = v["rv"];
    EXPECT_EQ(v["pipe"], pipe_dir);
    EXPECT_EQ(v["rv"], rendezvous);
  }
  // The private daemon was started and stopped with the same pipe directory; temp dirs are gone.
  EXPECT_EQ(read_file(mps_log()), "start " + pipe_dir + "\nquit " + pipe_dir + "\n");
  const std::string daemon_pid = read_file(dir_ / "daemon.pid");
  ASSERT_FALSE(daemon_pid.empty());
  EXPECT_FALSE(process_running(pid_t(std::stol(daemon_pid)))) << "the launcher returned before the daemon exited";
  EXPECT_FALSE(fs::exists(rendezvous)) << rendezvous;
  EXPECT_FALSE(fs::exists(pipe_dir)) << pipe_dir;
}

TEST_F(LaunchCli, UnevenSharingAndNoMps) {
  fake_gpus(2);
  fake_mps();
  // Three ranks on GPUs 0 and 1 (from --gpus): GPU 0 hosts two, so 50% each there and 100% on GPU 1.
  auto r = launch_lib(3, kPrintEnv, {0, 1});
  ASSERT_EQ(r.status, 0) << r.output;
  auto vars = parse_rank_vars(r.output);
  EXPECT_EQ(vars[0]["pct"], "50");
  EXPECT_EQ(vars[1]["pct"], "100");
  EXPECT_EQ(vars[2]["pct"], "50");
  EXPECT_EQ(vars[1]["dev"], "1");

  fs::remove(mps_log());
  fake_gpus(1);
  r = launch_lib(2, kPrintEnv, {}, /*use_mps=*/false);  // both on the one GPU, no daemon
  ASSERT_EQ(r.status, 0) << r.output;
  vars = parse_rank_vars(r.output);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(vars[rank]["dev"], "0");
    EXPECT_EQ(vars[rank]["pct"], "none");
    EXPECT_EQ(vars[rank]["pipe"], "none");
    EXPECT_EQ(vars[rank]["shared"], "1");
    EXPECT_EQ(vars[rank]["shmem_nccl"], "1");
  }
  EXPECT_FALSE(fs::exists(mps_log()));
}

TEST_F(LaunchCli, OneRankPerGpuNeedsNoMpsAndUserSettingsWin) {
  fake_gpus(2);
  fake_mps();
  const auto r = launch_lib(2, kPrintEnv, {}, true, {{"NCCL_NVLS_ENABLE", "1"}});
  ASSERT_EQ(r.status, 0) << r.output;
  auto vars = parse_rank_vars(r.output);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(vars[rank]["dev"], std::to_string(rank));
    EXPECT_EQ(vars[rank]["shared"], "0");
    EXPECT_EQ(vars[rank]["pct"], "none");
    EXPECT_EQ(vars[rank]["shmem_nccl"], "none");
    EXPECT_EQ(vars[rank]["nvls"], "1");  // the caller's value is kept
  }
  EXPECT_FALSE(fs::exists(mps_log()));
}

TEST_F(LaunchCli, CudaVisibleDevicesDecidesTheGpuCount) {
  fake_gpus(1);  // nvidia-smi lists every GPU of the machine; CUDA_VISIBLE_DEVICES narrows what ranks see
  const auto r = launch_lib(3, kPrintEnv, {}, true, {{"CUDA_VISIBLE_DEVICES", "4,5,6"}});
  ASSERT_EQ(r.status, 0) << r.output;
  auto vars = parse_rank_vars(r.output);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(vars[rank]["dev"], std::to_string(rank));  // indices into the visible list
    EXPECT_EQ(vars[rank]["shared"], "0");
  }
}

TEST_F(LaunchCli, GpusPastTheVisibleOnesAreRefused) {
  // la1 (fourteenth bad-input pass): `--gpus 7,99` without those GPUs handed DMOE_DEVICE 7 and 99 to the ranks, rc 0.
  fake_gpus(2);
  auto r = launch_lib(2, kPrintEnv, {1, 2});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "--gpus lists 2, but 2 GPUs are visible here; GPU indices must be in [0, 2)")) << r.output;
  fake_gpus(0);
  r = launch_lib(1, kPrintEnv, {0});
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "no GPU is visible here: leave out --gpus")) << r.output;
  fake_gpus(1);
  r = launch_lib(1, kPrintEnv, {2}, true, {{"CUDA_VISIBLE_DEVICES", "4,5,6"}});  // an index into the visible list
  EXPECT_EQ(r.status, 0) << r.output;
}

TEST_F(LaunchCli, NoGpusMeansNoDeviceAndNoMps) {
  fake_gpus(0);
  fake_mps();
  const auto r = launch_lib(2, kPrintEnv);
  ASSERT_EQ(r.status, 0) << r.output;
  auto vars = parse_rank_vars(r.output);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(vars[rank]["dev"], "none");
    EXPECT_EQ(vars[rank]["shared"], "none");
    EXPECT_EQ(vars[rank]["pct"], "none");
  }
  EXPECT_FALSE(fs::exists(mps_log()));
}

TEST_F(LaunchCli, FailingRankStopsTheOthersQuickly) {
  fake_gpus(0);
  const std::string pid_file = (dir_ / "sleeper.pid").string();
  const auto start = Clock::now();
  const auto r = launch_lib(2, "if [ $DMOE_RANK = 0 ]; then sleep 0.3; echo about to fail >&2; echo boom >&2; "
                                   "exit 3; fi; echo $$ > " + pid_file + "; exec sleep 30");
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(r.status, 3) << r.output;
  EXPECT_LT(seconds, 10.0) << r.output;
  EXPECT_TRUE(contains(r.output, "dmoe launch: rank 0 failed (exit code 3)")) << r.output;
  EXPECT_TRUE(contains(r.output, "  | boom")) << r.output;  // the failed rank's last stderr lines
  EXPECT_TRUE(contains(r.output, "stopping the other 1 rank(s)")) << r.output;
  const std::string pid_text = read_file(pid_file);
  ASSERT_FALSE(pid_text.empty());
  const pid_t sleeper = pid_t(std::stol(pid_text));
  EXPECT_EQ(::kill(sleeper, 0), -1);  // killed and reaped
  EXPECT_EQ(errno, ESRCH);
}

TEST_F(LaunchCli, RankKilledBySignalIsReported) {
  fake_gpus(0);
  const auto r = launch_lib(2, "if [ $DMOE_RANK = 1 ]; then kill -KILL $$; fi; sleep 5");
  EXPECT_EQ(r.status, 128 + SIGKILL) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 failed (signal 9")) << r.output;
}

TEST_F(LaunchCli, BadArgumentsAreRefused) {
  fake_gpus(0);
  auto r = launch_sh("-n 0", "true");
  EXPECT_NE(r.status, 0) << r.output;
  r = launch_sh("-n 2 --gpus 0,x", "true");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.output, "--gpus")) << r.output;
  r = run_shell(std::string(DMOE_CLI_PATH) + " launch -n 2 -- dmoe-no-such-program-xyz");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.output, "cannot find an executable 'dmoe-no-such-program-xyz'")) << r.output;
}

TEST_F(LaunchCli, CommandOptionsAfterDoubleDashAreNotParsed) {
  fake_gpus(0);
  const auto r = launch_sh("-n 2", "echo args \"$@\"", "", "x -n 3 --gpus -- --no-mps");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] args -n 3 --gpus -- --no-mps")) << r.output;
}

TEST_F(LaunchCli, SigtermIsForwardedToTheRanks) {
  fake_gpus(0);
  const fs::path out_path = dir_ / "out.txt";
  const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
  const std::string script = "trap 'echo got TERM $DMOE_RANK; exit 0' TERM; echo ready; while :; do sleep 0.05; done";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::setenv("PATH", path.c_str(), 1);
    ::execl(DMOE_CLI_PATH, DMOE_CLI_PATH, "launch", "-n", "2", "--", "sh", "-c", script.c_str(), (char*)nullptr);
    ::_exit(127);
  }
  // Wait (bounded) until both ranks run their trap, then signal the launcher.
  const auto start = Clock::now();
  auto ready_count = [&] {
    const std::string text = read_file(out_path);
    return (contains(text, "[rank 0] ready") ? 1 : 0) + (contains(text, "[rank 1] ready") ? 1 : 0);
  };
  while (ready_count() < 2 && Clock::now() - start < std::chrono::seconds(5))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(ready_count(), 2) << read_file(out_path);
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  pid_t got = 0;
  while ((got = ::waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() - start < std::chrono::seconds(10))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (got == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    FAIL() << "the launcher did not exit after SIGTERM: " << read_file(out_path);
  }
  const std::string text = read_file(out_path);
  // It ends by the signal itself once the ranks are done (G22B-1; it exited with 128 + SIGTERM before).
  ASSERT_TRUE(WIFSIGNALED(status)) << text;
  EXPECT_EQ(WTERMSIG(status), SIGTERM) << text;
  EXPECT_TRUE(contains(text, "[rank 0] got TERM 0")) << text;
  EXPECT_TRUE(contains(text, "[rank 1] got TERM 1")) << text;
}

// G22B-2: a signal that reached a rank between fork() and the reset of its signal handlers ran the launcher's inherited
// handler in the child (a flag in the child's memory) and was lost: the rank execed and ran on until the SIGKILL after
// the grace period. The test hook holds the rank's child in that window (1 s) while the launcher gets its SIGTERM and
// forwards it; the rank must end by it before its exec, at once, not after the 5 s grace.
int g_fork_window_fd = -1;

TEST_F(LaunchCli, SignalInTheForkWindowStillStopsTheRank) {
  fake_gpus(0);
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
  const fs::path out_path = dir_ / "out.txt";
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(ready[0]);
    g_fork_window_fd = ready[1];
    set_after_fork_hook_for_tests([] {
      [[maybe_unused]] const ssize_t n = ::write(g_fork_window_fd, "x", 1);
      struct timespec one_second {1, 0};
      ::nanosleep(&one_second, nullptr);  // cut short by a handler that runs (the bug), not by a blocked signal
    });
    ::setenv("PATH", path.c_str(), 1);
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    LaunchOptions o;
    o.num_ranks = 1;
    o.command = {"sh", "-c", "echo started; exec sleep 30"};
    o.out_fd = fd;
    o.err_fd = fd;
    int rc = 100;
    try {
      rc = launch(o);
    } catch (...) {
      rc = 101;
    }
    ::_exit(rc);
  }
  ::close(ready[1]);
  pollfd in_window{ready[0], POLLIN, 0};
  const bool reached = ::poll(&in_window, 1, 10000) == 1;
  ::close(ready[0]);
  if (reached) ::kill(pid, SIGTERM);  // the rank's child is in the window now
  int status = 0;
  pid_t got = 0;
  while ((got = ::waitpid(pid, &status, WNOHANG)) == 0 && Clock::now() - start < std::chrono::seconds(20))
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (got == 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const std::string text = read_file(out_path);
  ASSERT_TRUE(reached) << "the rank's child never reached the hook: " << text;
  ASSERT_NE(got, 0) << "the launcher did not end: " << text;
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << text;
  EXPECT_FALSE(contains(text, "[rank 0] started")) << "the rank execed past the SIGTERM: " << text;
  EXPECT_LT(seconds, 4.0) << "the rank ran on until the SIGKILL after the grace period: " << text;
}

// The library entry point, with the relayed output going to a file of the test's choosing.
TEST_F(LaunchCli, LibraryLaunchWritesToTheGivenDescriptors) {
  fake_gpus(0);
  // --gpus 0 needs a visible GPU 0 (this test calls launch() without the fake nvidia-smi on PATH).
  const char* old_visible = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::optional<std::string> saved_visible = old_visible ? std::optional<std::string>(old_visible) : std::nullopt;
  ::setenv("CUDA_VISIBLE_DEVICES", "0", 1);
  const fs::path out_path = dir_ / "lib_out.txt";
  const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  LaunchOptions o;
  o.num_ranks = 2;
  o.gpus = {0};
  o.use_mps = false;
  o.command = {"sh", "-c", "echo lib $DMOE_RANK $DMOE_DEVICE; [ $DMOE_RANK = 1 ] && sleep 0.2 && exit 7; exit 0"};
  o.out_fd = fd;
  o.err_fd = fd;
  const int status = launch(o);
  ::close(fd);
  if (saved_visible)
    ::setenv("CUDA_VISIBLE_DEVICES", saved_visible->c_str(), 1);
  else
    ::unsetenv("CUDA_VISIBLE_DEVICES");
  const std::string text = read_file(out_path);
  EXPECT_EQ(status, 7) << text;
  EXPECT_TRUE(contains(text, "[rank 0] lib 0 0")) << text;
  EXPECT_TRUE(contains(text, "[rank 1] lib 1 0")) << text;
  EXPECT_TRUE(contains(text, "rank 1 failed (exit code 7)")) << text;
}

// ---- The twenty-third pass (G23B) ----------------------------------------------------------------------------------

// Runs `body` in a forked child (which _exits with its result) and waits for it at most `limit_s`; a child still
// running then is killed (with its process group's ranks) and reported as -1.
struct ChildResult {
  bool ended = false;
  int status = 0;
  double seconds = 0;
};
template <typename Body>
ChildResult run_in_child(Body body, double limit_s, const std::function<void(pid_t)>& meanwhile = {}) {
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::setpgid(0, 0);
    int rc = 100;
    try {
      rc = body();
    } catch (...) {
      rc = 101;
    }
    ::_exit(rc);
  }
  ChildResult r;
  if (pid < 0) return r;
  ::setpgid(pid, pid);
  if (meanwhile) meanwhile(pid);
  pid_t got = 0;
  while ((got = ::waitpid(pid, &r.status, WNOHANG)) == 0 &&
         std::chrono::duration<double>(Clock::now() - start).count() < limit_s)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (got == 0) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &r.status, 0);
    return r;
  }
  r.ended = true;
  return r;
}

// G23B-1: a launcher started with SIGCHLD ignored (inherited from a Python supervisor) never reaped its ranks: the
// kernel reaped them itself, every waitpid said ECHILD, and the poll loop ran forever (a SIGTERM changed nothing).
// The launch sets SIGCHLD to its default and restores the caller's disposition afterwards.
TEST_F(LaunchCli, SigchldIgnoredByTheCallerStillEnds) {
  fake_gpus(0);
  const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
  const fs::path out_path = dir_ / "out.txt";
  const ChildResult r = run_in_child([&] {
    ::signal(SIGCHLD, SIG_IGN);
    ::setenv("PATH", path.c_str(), 1);
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    LaunchOptions o;
    o.num_ranks = 2;
    o.command = {"sh", "-c", "echo hi $DMOE_RANK; [ $DMOE_RANK = 1 ] && exit 3; exit 0"};
    o.out_fd = fd;
    o.err_fd = fd;
    const int rc = launch(o);
    struct sigaction now {};
    ::sigaction(SIGCHLD, nullptr, &now);
    return rc + (now.sa_handler == SIG_IGN ? 0 : 50);  // 50: the caller's SIG_IGN was not restored
  }, 15);
  const std::string text = read_file(out_path);
  ASSERT_TRUE(r.ended) << "the launcher never ended with SIGCHLD ignored: " << text;
  ASSERT_TRUE(WIFEXITED(r.status)) << text;
  EXPECT_EQ(WEXITSTATUS(r.status), 3) << text;
  EXPECT_TRUE(contains(text, "[rank 1] hi 1")) << text;  // rank 0 may be stopped before its echo
  EXPECT_TRUE(contains(text, "rank 1 failed (exit code 3)")) << text;
  EXPECT_LT(r.seconds, 8.0) << text;
}

// G23B-3: `nohup dmoe launch … &` was ended by SIGHUP and a background launch (SIGINT ignored by the shell) by SIGINT:
// INT, TERM and HUP were taken over even when they arrived ignored, and reset to the default in the ranks. A signal
// ignored at the start now stays ignored, in the launcher and in its ranks, as for a bare process under nohup.
TEST_F(LaunchCli, SignalsIgnoredAtTheStartStayIgnoredInTheLauncherAndTheRanks) {
  fake_gpus(0);
  const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
  const fs::path out_path = dir_ / "out.txt";
  const std::string script = "kill -HUP $$; kill -INT $$; echo survived $DMOE_RANK; sleep 1; echo finished $DMOE_RANK";
  const ChildResult r = run_in_child([&] {
    ::signal(SIGHUP, SIG_IGN);
    ::signal(SIGINT, SIG_IGN);
    ::setenv("PATH", path.c_str(), 1);
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl(DMOE_CLI_PATH, DMOE_CLI_PATH, "launch", "-n", "2", "--", "sh", "-c", script.c_str(), (char*)nullptr);
    return 127;
  }, 20, [&](pid_t pid) {
    const auto start = Clock::now();
    while (!contains(read_file(out_path), "survived") && Clock::now() - start < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ::kill(pid, SIGHUP);  // a logout
    ::kill(pid, SIGINT);  // a Ctrl-C meant for the script that started it in the background
  });
  const std::string text = read_file(out_path);
  ASSERT_TRUE(r.ended) << text;
  ASSERT_TRUE(WIFEXITED(r.status)) << "ended by signal " << WTERMSIG(r.status) << ": " << text;
  EXPECT_EQ(WEXITSTATUS(r.status), 0) << text;
  EXPECT_TRUE(contains(text, "[rank 0] finished 0")) << text;
  EXPECT_TRUE(contains(text, "[rank 1] finished 1")) << text;
  EXPECT_FALSE(contains(text, "received signal")) << text;
}

// G23B-4: a fork that failed (ulimit -u) was an internal error with a source location ("fork failed for rank 15 …
// (launcher.cpp:411)"), and the ranks already started got SIGKILL with no grace period. It is an input error naming
// ulimit -u now, and the started ranks get SIGTERM first. The test hook makes the fork of rank 2 fail with EAGAIN once
// ranks 0 and 1 have set their TERM trap.
std::string g_ready_dir;

TEST_F(LaunchCli, ForkFailureNamesUlimitAndStopsTheStartedRanksGently) {
  fake_gpus(0);
  g_ready_dir = dir_.string();
  set_fork_failure_for_tests([](int32_t rank) {
    if (rank != 2) return 0;
    const auto start = Clock::now();
    while (!(fs::exists(g_ready_dir + "/ready0") && fs::exists(g_ready_dir + "/ready1")) &&
           Clock::now() - start < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return EAGAIN;
  });
  const CliResult r = launch_lib(3, "trap 'echo got TERM $DMOE_RANK; exit 0' TERM; touch " + dir_.string() +
                                    "/ready$DMOE_RANK; while :; do sleep 0.05; done");
  set_fork_failure_for_tests(nullptr);
  EXPECT_TRUE(contains(r.output, "cannot start rank 2 of 3")) << r.output;
  EXPECT_TRUE(contains(r.output, "ulimit -u")) << r.output;
  EXPECT_FALSE(contains(r.output, ".cpp:")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] got TERM 0")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] got TERM 1")) << r.output;
}

// G23B-5: a TMPDIR where the rendezvous directory could be made but not its `rendezvous` subdirectory (one free inode
// left; here a path one component short of PATH_MAX) ended in "unexpected error: filesystem error …", rc 2. It is an
// input error naming TMPDIR and the cause now, and the launch directory is removed.
TEST_F(LaunchCli, RendezvousSubdirectoryThatCannotBeMadeNamesTmpdir) {
  fake_gpus(0);
  // TMPDIR/dmoe-launch-XXXXXX fits in PATH_MAX, TMPDIR/dmoe-launch-XXXXXX/rendezvous does not.
  fs::path tmp = dir_;
  while (tmp.string().size() + 250 < 4070) tmp /= std::string(240, 'd');
  tmp /= std::string(4070 - tmp.string().size() - 1, 'e');
  std::error_code ec;
  fs::create_directories(tmp, ec);
  ASSERT_FALSE(ec) << ec.message();
  ASSERT_EQ(tmp.string().size(), 4070u);
  const CliResult r = launch_sh("-n 1", "echo hi", "TMPDIR=" + sh_quote(tmp.string()));
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "TMPDIR")) << r.output;
  EXPECT_TRUE(contains(r.output, "File name too long")) << r.output;
  EXPECT_FALSE(contains(r.output, "unexpected error")) << r.output;
  EXPECT_TRUE(fs::is_empty(tmp)) << "the launch directory was left";
}


// G23B-7: a signal that reached the launcher after its poll loop, while it stopped the MPS daemon and removed its
// directory, was recorded and then dropped: rc 0 and no word. The fake MPS control tool sends the launcher SIGTERM
// when told to quit (in the cleanup); the launcher must end by it.
TEST_F(LaunchCli, SignalDuringTheFinalCleanupIsNotSwallowed) {
  fake_gpus(1);
  write_script("nvidia-cuda-mps-control", "[ \"$1\" = -d ] && exit 0\nread cmd\nkill -TERM $PPID\nsleep 0.2\nexit 0\n");
  const CliResult r = launch_sh("-n 2", "echo done $DMOE_RANK",
                                "env -u CUDA_VISIBLE_DEVICES -u CUDA_MPS_PIPE_DIRECTORY");
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "received signal 15")) << r.output;
  EXPECT_TRUE(contains(r.output, "while cleaning up")) << r.output;
}

// G23B-8: a SIGTERM after a forwarded USR1 (caught by the rank) was forwarded, but the teardown still counted as "not
// terminated": 5 s after the USR1 the launcher said it was "sending SIGTERM", which it had already sent, and the
// SIGKILL came about 9 s after the user's SIGTERM instead of 5.
TEST_F(LaunchCli, SigtermAfterAForwardedSignalStartsItsOwnGracePeriod) {
  fake_gpus(0);
  const std::string path = (dir_ / "bin").string() + ":" + std::getenv("PATH");
  const fs::path out_path = dir_ / "out.txt";
  const std::string script = "trap 'echo got USR1' USR1; trap '' TERM; echo ready; while :; do sleep 0.05; done";
  Clock::time_point term_at;
  const ChildResult r = run_in_child([&] {
    ::setenv("PATH", path.c_str(), 1);
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl(DMOE_CLI_PATH, DMOE_CLI_PATH, "launch", "-n", "1", "--", "sh", "-c", script.c_str(), (char*)nullptr);
    return 127;
  }, 30, [&](pid_t pid) {
    const auto start = Clock::now();
    while (!contains(read_file(out_path), "ready") && Clock::now() - start < std::chrono::seconds(10))
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    ::kill(pid, SIGUSR1);
    std::this_thread::sleep_for(std::chrono::seconds(2));
    ::kill(pid, SIGTERM);
    term_at = Clock::now();
  });
  const double after_term = std::chrono::duration<double>(Clock::now() - term_at).count();
  const std::string text = read_file(out_path);
  ASSERT_TRUE(r.ended) << text;
  EXPECT_TRUE(contains(text, "received signal 10")) << text;
  EXPECT_FALSE(contains(text, "sending SIGTERM")) << text;
  EXPECT_GT(after_term, 4.5) << text;
  EXPECT_LT(after_term, 7.5) << "the SIGKILL did not come 5 s after the user's SIGTERM: " << text;
}

// G23B-9: a dmoe-launch-* directory the launcher could not remove (a rank left a read-only directory with a file in
// it) stayed in TMPDIR without a word. Now it is named. The launch runs as nobody when the tests run as root (root
// removes it anyway).
TEST_F(LaunchCli, UnremovableLaunchDirectoryIsNamed) {
  const fs::path tmp = dir_ / "tmp";
  fs::create_directories(tmp);
  fs::permissions(tmp, fs::perms::all);
  const fs::path out_path = dir_ / "out.txt";
  const ChildResult r = run_in_child([&] {
    const int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) return 90;
    ::setenv("TMPDIR", tmp.c_str(), 1);
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    LaunchOptions o;
    o.num_ranks = 1;
    o.command = {"sh", "-c", "mkdir \"$DMOE_RENDEZVOUS/ro\" && touch \"$DMOE_RENDEZVOUS/ro/f\" && "
                             "chmod 555 \"$DMOE_RENDEZVOUS/ro\""};
    o.out_fd = fd;
    o.err_fd = fd;
    return launch(o);
  }, 20);
  const std::string text = read_file(out_path);
  ASSERT_TRUE(r.ended) << text;
  ASSERT_TRUE(WIFEXITED(r.status)) << text;
  EXPECT_EQ(WEXITSTATUS(r.status), 0) << text;
  std::string left;
  for (const auto& e : fs::directory_iterator(tmp)) left = e.path().string();
  ASSERT_FALSE(left.empty()) << "nothing was left to report: " << text;
  EXPECT_TRUE(contains(text, "could not remove its directory " + left)) << text;
  for (const auto& e : fs::recursive_directory_iterator(tmp)) fs::permissions(e.path(), fs::perms::all);
}

// G23B-11: ranks that failed on their own at about the same time: only the first was reported, the others' exit codes
// never (they were taken as part of the teardown). Ranks 1 and 2 ignore SIGTERM and fail with their own codes after
// rank 0 has; rank 3 is ended by the SIGTERM and is no failure of its own.
TEST_F(LaunchCli, EveryRankThatFailsOnItsOwnIsReported) {
  fake_gpus(0);
  const std::string d = dir_.string();
  const CliResult r = launch_lib(4, "case $DMOE_RANK in "
                                    "0) while [ ! -e " + d + "/ready1 ] || [ ! -e " + d + "/ready2 ]; do sleep 0.02; "
                                    "done; echo err0 >&2; exit 3;; "
                                    "1|2) trap '' TERM; touch " + d + "/ready$DMOE_RANK; sleep 0.5; "
                                    "exit $((3 + DMOE_RANK));; "
                                    "3) sleep 5;; esac");
  EXPECT_EQ(r.status, 3) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 0 failed (exit code 3)")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 1 also failed (exit code 4)")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 2 also failed (exit code 5)")) << r.output;
  EXPECT_FALSE(contains(r.output, "rank 3 also failed")) << r.output;
}

}  // namespace
}  // namespace dmoe
