// launcher.cpp — `dmoe launch`: fork/exec N ranks, relay their output, tear everything down on failure.
//
// One thread does everything: a poll loop over the children's stdout/stderr pipes that also reaps exited
// children, watches for a forwarded signal and enforces the SIGTERM -> SIGKILL grace period. Everything
// started here (children, MPS daemon, temp directory, signal handlers) is undone by RAII guards, so an
// exception or an early return leaves nothing behind.
#include "comm/launcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <utility>
#include <thread>

#include "core/error.hpp"
#include "core/host_resources.hpp"
#include "core/output_file.hpp"

extern char** environ;

namespace dmoe {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed terminal or pipe must not stop the launcher from cleaning up
    done += size_t(n);
  }
}

void message(int fd, const std::string& text) { write_all(fd, "dmoe launch: " + text + "\n"); }

// ---- signals ------------------------------------------------------------------------------------

volatile sig_atomic_t g_received_signal = 0;

void on_signal(int sig) { g_received_signal = sig; }

// Every signal the launcher changes the disposition of while it runs (filled by SignalGuard): a rank's child resets
// each of them to the default before its exec (reset_child_signals).
sigset_t g_changed_signals;
// Those of them that arrived ignored (SIGPIPE, SIGXFSZ): the ranks get them ignored again, as a bare process would
// (G23B-3).
sigset_t g_ignored_at_start;

// Installs the forwarding handlers (and ignores SIGPIPE and SIGXFSZ, so a closed output pipe or a file-size limit on
// the launcher's output cannot kill it mid-teardown: a write fails instead) for the lifetime of one launch; restores
// the previous dispositions.
// G22B-1: only SIGINT, SIGTERM and SIGHUP were forwarded. Any other terminating signal (Slurm's --signal=USR1,
// `timeout -s USR1`, ALRM, USR2, PWR, a CPU-time limit's XCPU ...) ended the launcher by its default action, the ranks
// then died by PR_SET_PDEATHSIG's SIGKILL (a rank's hidden output temporary left for good) and the launcher's own
// dmoe-launch-* directory stayed in TMPDIR. Now every signal the ranks' output files clean up for (cleaned_signals())
// is forwarded and tears the launch down as SIGTERM does; INT, TERM and HUP unless they arrive ignored (G23B-3), the
// others where they are at their default disposition (one that is ignored, or handled by an embedding program, is left
// alone).
class SignalGuard {
 public:
  SignalGuard() {
    g_received_signal = 0;
    sigemptyset(&g_changed_signals);
    sigemptyset(&g_ignored_at_start);
    struct sigaction action {};
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    for (const int sig : cleaned_signals()) {
      const bool ignored_here = sig == SIGPIPE || sig == SIGXFSZ;
      struct sigaction previous {};
      if (::sigaction(sig, nullptr, &previous) != 0) continue;
      // G23B-3: a signal that arrives ignored stays ignored, INT, TERM and HUP included: `nohup dmoe launch … &` was
      // ended by the logout's SIGHUP and a background launch in a script (SIGINT ignored) by a Ctrl-C meant for the
      // script, though `nohup sleep` and a background `dmoe train` go on. The ranks get it ignored too.
      const bool ignored = previous.sa_handler == SIG_IGN && !(previous.sa_flags & SA_SIGINFO);
      if (ignored) sigaddset(&g_ignored_at_start, sig);
      const bool always = (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) && !ignored;
      const bool at_default = previous.sa_handler == SIG_DFL && !(previous.sa_flags & SA_SIGINFO);
      if (!ignored_here && !always && !at_default) continue;
      if (::sigaction(sig, ignored_here ? &ignore : &action, nullptr) != 0) continue;
      saved_.emplace_back(sig, previous);
      sigaddset(&g_changed_signals, sig);
    }
    // G23B-1: with SIGCHLD ignored (SIG_IGN or SA_NOCLDWAIT inherited across exec, e.g. from a Python supervisor) the
    // kernel reaped the ranks itself, every waitpid said ECHILD and the poll loop never ended. The default for the
    // launch (the ranks inherit it), the caller's disposition back afterwards.
    struct sigaction chld {};
    if (::sigaction(SIGCHLD, nullptr, &chld) == 0 && (chld.sa_handler == SIG_IGN || (chld.sa_flags & SA_NOCLDWAIT))) {
      struct sigaction def {};
      def.sa_handler = SIG_DFL;
      sigemptyset(&def.sa_mask);
      if (::sigaction(SIGCHLD, &def, nullptr) == 0) saved_.emplace_back(SIGCHLD, chld);
    }
  }
  ~SignalGuard() {
    for (const auto& [sig, previous] : saved_) ::sigaction(sig, &previous, nullptr);
  }
  SignalGuard(const SignalGuard&) = delete;
  SignalGuard& operator=(const SignalGuard&) = delete;

 private:
  std::vector<std::pair<int, struct sigaction>> saved_;
};

// ---- environment and programs ---------------------------------------------------------------------

using EnvList = std::vector<std::string>;  // "NAME=value" entries, as execve wants them

void set_env(EnvList& env, const std::string& name, const std::string& value, bool overwrite = true) {
  const std::string key = name + "=";
  for (auto& entry : env)
    if (entry.compare(0, key.size(), key) == 0) {
      if (overwrite) entry = key + value;
      return;
    }
  env.push_back(key + value);
}

EnvList current_env() {
  EnvList env;
  for (char** e = environ; e && *e; ++e) env.emplace_back(*e);
  return env;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

// The program's path: as given when it contains '/', else the first executable match on PATH.
// Resolved here, before fork, so a typo is one clear error instead of N failed ranks.
std::string find_program(const std::string& name) {
  if (name.find('/') != std::string::npos) return is_executable_file(name) ? name : std::string();
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', start), dirs.size());
    const std::string dir = end > start ? dirs.substr(start, end - start) : ".";
    const std::string candidate = dir + "/" + name;
    if (is_executable_file(candidate)) return candidate;
    start = end + 1;
  }
  return {};
}

std::vector<char*> c_strings(std::vector<std::string>& strings) {
  std::vector<char*> out;
  for (auto& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

void (*g_after_fork_hook_for_tests)() = nullptr;
int (*g_fork_failure_for_tests)(int32_t rank) = nullptr;  // set_fork_failure_for_tests (G23B-4)

// In a freshly forked child: the dispositions the launcher found (the default, or SIG_IGN where the signal arrived
// ignored: G23B-3, as for a bare process under nohup; the launcher's own SIG_IGN would survive exec), nothing blocked.
// The order matters (G22B-2): the forwarded signals arrive blocked, so one pending is delivered at the unblock, with
// its default action.
void reset_child_signals() {
  struct sigaction def {};
  def.sa_handler = SIG_DFL;
  sigemptyset(&def.sa_mask);
  struct sigaction ign {};
  ign.sa_handler = SIG_IGN;
  sigemptyset(&ign.sa_mask);
  for (int sig = 1; sig < NSIG; ++sig)
    if (sigismember(&g_changed_signals, sig) == 1)
      sigaction(sig, sigismember(&g_ignored_at_start, sig) == 1 ? &ign : &def, nullptr);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, nullptr);
}

void redirect_to_dev_null(int fd, int flags) {
  const int null_fd = ::open("/dev/null", flags);
  if (null_fd >= 0 && null_fd != fd) {
    ::dup2(null_fd, fd);
    ::close(null_fd);
  }
}

// Runs a helper program (the MPS control tool) to completion with `stdin_text` as its input and its
// output discarded. Returns its exit code; -1 when it could not start, ran past `timeout_s` (then it is
// killed) or died by a signal.
int run_helper(const std::string& program, std::vector<std::string> args, EnvList env, const std::string& stdin_text,
               double timeout_s) {
  int in_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0) return -1;
  args.insert(args.begin(), program);
  std::vector<char*> argv = c_strings(args);
  std::vector<char*> envp = c_strings(env);
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(in_pipe[0]);
    ::close(in_pipe[1]);
    return -1;
  }
  if (pid == 0) {
    reset_child_signals();
    ::dup2(in_pipe[0], 0);
    // An MPS control daemon keeps its inherited descriptors; it must not hold the launcher's output
    // pipes open (a reader of the launcher would never see EOF).
    redirect_to_dev_null(1, O_WRONLY);
    redirect_to_dev_null(2, O_WRONLY);
    ::execve(program.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(in_pipe[0]);
  write_all(in_pipe[1], stdin_text);
  ::close(in_pipe[1]);
  const auto start = Clock::now();
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0 && errno != EINTR) return -1;
    if (seconds_since(start) > timeout_s) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// ---- temp directory and MPS daemon ------------------------------------------------------------------

class TempDir {
 public:
  explicit TempDir(int err_fd) : err_fd_(err_fd) {
    const char* tmp = std::getenv("TMPDIR");
    const bool from_env = tmp && *tmp;
    std::string pattern = std::string(from_env ? tmp : "/tmp") + "/dmoe-launch-XXXXXX";
    // TMPDIR is the user's: a bad one is an input error naming it (it ended in a source location).
    DMOE_REQUIRE_INPUT(::mkdtemp(pattern.data()) != nullptr, "dmoe launch: cannot create its rendezvous directory "
                       "'{}': {}; {}", pattern, std::strerror(errno),
                       from_env ? fmt::format("TMPDIR='{}' must name a writable directory (or unset it for /tmp)", tmp)
                                : std::string("/tmp must be a writable directory (or set TMPDIR to one)"));
    // Absolute: the ranks get it in DMOE_RENDEZVOUS (and their stage board under it), and a rank command that changes
    // directory (`sh -c 'cd run && dmoe ...'`) looked for TMPDIR=tmp's relative path elsewhere (G20-13).
    std::error_code ec;
    const fs::path absolute = fs::absolute(pattern, ec);
    path_ = ec ? pattern : absolute.lexically_normal().string();
  }
  ~TempDir() {
    if (keep_) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
    // G23B-9: left in TMPDIR without a word (a rank's read-only directory in it, say): named now.
    if (ec)
      message(err_fd_, fmt::format("warning: could not remove its directory {}: {}; remove it by hand", path_,
                                   ec.message()));
  }
  void keep() { keep_ = true; }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool keep_ = false;
  int err_fd_;
};

// A directory under the launch's own one in TMPDIR. G23B-5: std::filesystem's exception ("unexpected error: filesystem
// error … rendezvous", rc 2) when TMPDIR had room for the launch directory but not one more (a last free inode): an
// input error naming TMPDIR and the cause now; the launch directory is removed on the way out.
void create_launch_subdirectory(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
  if (!ec) return;
  const char* tmp = std::getenv("TMPDIR");
  const std::string where = tmp && *tmp ? fmt::format("TMPDIR='{}'", tmp) : std::string("/tmp");
  DMOE_FAIL_INPUT("dmoe launch: cannot create '{}' in its rendezvous directory: {}; {}", path, ec.message(),
                  ec == std::errc::no_space_on_device
                      ? fmt::format("the file system of {} has no free space or no free inodes left (`df -i`): free "
                                    "some, or set TMPDIR to another directory", where)
                      : fmt::format("{} must name a writable directory with room for the launch's files (or set "
                                    "TMPDIR to another one)", where));
}

constexpr double kMpsCommandTimeoutS = 15.0;
constexpr double kMpsExitTimeoutS = 30.0;

// A private MPS control daemon: its pipe and log directories live in the launch's temp directory, so
// it neither meets nor disturbs another daemon on the machine. Stopped ("quit") on destruction.
class MpsDaemon {
 public:
  MpsDaemon(std::string control, const std::string& dir, int err_fd)
      : control_(std::move(control)), pipe_dir_(dir + "/mps-pipe"), log_dir_(dir + "/mps-log"), err_fd_(err_fd) {
    create_launch_subdirectory(pipe_dir_);
    create_launch_subdirectory(log_dir_);
    const int rc = run_helper(control_, {"-d"}, env(), "", kMpsCommandTimeoutS);
    DMOE_REQUIRE(rc == 0, "could not start the MPS daemon: `{} -d` exited with {} (CUDA_MPS_PIPE_DIRECTORY={}); "
                 "run with --no-mps to go without it", control_, rc, pipe_dir_);
  }
  // Sends "quit" and waits (bounded) until the daemon has exited: its MPS server may still be releasing
  // ranks that were killed, and removing the pipe directory under a live daemon would leave it
  // unreachable. Returns false when it is still running; the caller then keeps the directory.
  bool stop() {
    const pid_t pid = read_pid();
    const int rc = run_helper(control_, {}, env(), "quit\n", kMpsCommandTimeoutS);
    const auto start = Clock::now();
    while (pid > 0 && process_alive(pid) && seconds_since(start) < kMpsExitTimeoutS)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (pid > 0 && process_alive(pid)) {
      message(err_fd_, fmt::format("warning: the MPS daemon (pid {}) is still running {:.0f} s after `quit`; stop it "
                                   "with `echo quit | CUDA_MPS_PIPE_DIRECTORY={} {}`", pid, kMpsExitTimeoutS,
                                   pipe_dir_, control_));
      return false;
    }
    if (rc != 0)
      message(err_fd_, fmt::format("warning: stopping the MPS daemon (`echo quit | {}` with CUDA_MPS_PIPE_DIRECTORY={}) "
                                   "returned {}", control_, pipe_dir_, rc));
    return true;
  }
  MpsDaemon(const MpsDaemon&) = delete;
  MpsDaemon& operator=(const MpsDaemon&) = delete;

  const std::string& pipe_dir() const { return pipe_dir_; }
  const std::string& log_dir() const { return log_dir_; }

 private:
  // The control daemon writes its pid into the pipe directory (nvidia-cuda-mps-control.pid).
  pid_t read_pid() const {
    std::ifstream in(pipe_dir_ + "/nvidia-cuda-mps-control.pid");
    long pid = 0;
    return (in >> pid) ? pid_t(pid) : pid_t(0);
  }

  // The daemon is not our child (it daemonised), so it is never reaped here; a zombie counts as gone.
  static bool process_alive(pid_t pid) {
    if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
    const size_t paren = line.rfind(')');
    return !(paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z');
  }

  EnvList env() const {
    EnvList e = current_env();
    set_env(e, "CUDA_MPS_PIPE_DIRECTORY", pipe_dir_);
    set_env(e, "CUDA_MPS_LOG_DIRECTORY", log_dir_);
    return e;
  }

  std::string control_, pipe_dir_, log_dir_;
  int err_fd_;
};

// ---- the ranks ------------------------------------------------------------------------------------

struct OutputPipe {
  int fd = -1;
  int out_fd = -1;  // where its lines go
  std::string partial;
};

struct Rank {
  int32_t index = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;  // waitpid status once exited
  bool status_unknown = false;  // exited, but reaped elsewhere (G23B-1): waitpid said ECHILD
  OutputPipe out, err;
  std::deque<std::string> err_tail;
};

constexpr double kReapAfterKillS = 10.0;  // how long a rank may take to go after SIGKILL (G23B-1)

class RankSet {
 public:
  RankSet(const LaunchOptions& o) : options_(o), ranks_(size_t(o.num_ranks)) {
    for (int32_t r = 0; r < o.num_ranks; ++r) {
      ranks_[r].index = r;
      ranks_[r].out.out_fd = o.out_fd;
      ranks_[r].err.out_fd = o.err_fd;
    }
  }
  // Nothing outlives the launch: SIGKILL to every rank still running, then reap (bounded, G23B-1: a rank in
  // uninterruptible sleep must not hold the launcher forever).
  ~RankSet() {
    for (auto& r : ranks_)
      if (r.running) ::kill(-r.pid, SIGKILL);
    const auto start = Clock::now();
    while (num_running() > 0 && seconds_since(start) < kReapAfterKillS) {
      reap();
      if (num_running() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    for (auto& r : ranks_) {
      close_stream(r.out);
      close_stream(r.err);
    }
  }
  RankSet(const RankSet&) = delete;
  RankSet& operator=(const RankSet&) = delete;

  // Returns "" once the rank runs, or why its fork failed (the caller stops the ranks already started, G23B-4).
  std::string start(int32_t r, const std::string& program, std::vector<std::string> args, EnvList env) {
    // Out of descriptors (checked before the first rank, but something else may take them meanwhile): an input error,
    // not an internal one with a source location (G20-7).
    int out_pipe[2], err_pipe[2];
    const auto pipe_failed = [&](int e) {
      DMOE_FAIL_INPUT("dmoe launch: cannot make the output pipes of rank {} of {}: {}{}", r, ranks_.size(),
                      std::strerror(e), e == EMFILE || e == ENFILE ? "; each rank needs 2 open descriptors in the "
                      "launcher: raise ulimit -n, or launch fewer ranks" : "");
    };
    if (::pipe2(out_pipe, O_CLOEXEC) != 0) pipe_failed(errno);
    if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
      const int e = errno;
      ::close(out_pipe[0]);
      ::close(out_pipe[1]);
      pipe_failed(e);
    }
    args[0] = program;
    std::vector<char*> argv = c_strings(args);
    std::vector<char*> envp = c_strings(env);
    const std::string exec_error = fmt::format("dmoe launch: cannot execute '{}': ", program);
    const pid_t parent = ::getpid();
    // G22B-2: a signal that reached the child between fork() and reset_child_signals() ran the launcher's inherited
    // on_signal, which only set a flag in the child's copy: the signal was lost, and the rank ran on until the SIGKILL
    // after the grace period (its temporaries left). Now the launcher's signals are blocked across fork: in the child
    // one that comes early stays pending until reset_child_signals() has set the default action and then unblocks it
    // (the rank ends by it, before its exec); in the parent until the rank is recorded as running, so the forwarding
    // loop (which signals only running ranks) reaches it.
    sigset_t saved_mask;
    ::sigprocmask(SIG_BLOCK, &g_changed_signals, &saved_mask);
    pid_t pid = -1;
    if (const int e = g_fork_failure_for_tests ? g_fork_failure_for_tests(r) : 0; e != 0)
      errno = e;
    else
      pid = ::fork();
    if (pid < 0) {
      const int e = errno;
      ::sigprocmask(SIG_SETMASK, &saved_mask, nullptr);
      for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
      // G23B-4: an internal error with a source location ("fork failed for rank 15 … (launcher.cpp:411)") that named no
      // limit, and the ranks started got SIGKILL at once. A resource limit is the user's to raise.
      struct rlimit nproc {};
      const bool limited = ::getrlimit(RLIMIT_NPROC, &nproc) == 0 && nproc.rlim_cur != RLIM_INFINITY;
      return fmt::format("dmoe launch: cannot start rank {} of {}: fork failed: {}; {}", r, ranks_.size(),
                         std::strerror(e), e == EAGAIN
                             ? fmt::format("the processes of this user are limited (ulimit -u{}): raise ulimit -u, or "
                                           "launch fewer ranks", limited ? fmt::format(" = {}", nproc.rlim_cur) : "")
                             : std::string("out of memory or processes: launch fewer ranks (see ulimit -u)"));
    }
    if (pid == 0) {
      // Child: only async-signal-safe work between fork and exec.
      ::setpgid(0, 0);
#if defined(__linux__)
      // If the launcher is killed outright (SIGKILL), take the rank with it.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
#endif
      if (g_after_fork_hook_for_tests) g_after_fork_hook_for_tests();
      reset_child_signals();  // the default actions first, then nothing blocked: a pending signal ends the rank here
      redirect_to_dev_null(0, O_RDONLY);
      ::dup2(out_pipe[1], 1);
      ::dup2(err_pipe[1], 2);
      ::execve(argv[0], argv.data(), envp.data());
      const char* reason = std::strerror(errno);
      [[maybe_unused]] ssize_t ignored = ::write(2, exec_error.data(), exec_error.size());
      ignored = ::write(2, reason, std::strlen(reason));
      ignored = ::write(2, "\n", 1);
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here: the child may not have run yet when we first signal its group
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    ::fcntl(out_pipe[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err_pipe[0], F_SETFL, O_NONBLOCK);
    Rank& rank = ranks_[r];
    rank.pid = pid;
    rank.running = true;
    rank.out.fd = out_pipe[0];
    rank.err.fd = err_pipe[0];
    ::sigprocmask(SIG_SETMASK, &saved_mask, nullptr);  // recorded: a signal held back now is forwarded to it too
    return "";
  }

  // Waits up to timeout_ms for output, relays it; returns false when no pipe is open any more.
  bool pump(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<std::pair<Rank*, OutputPipe*>> owners;
    for (auto& r : ranks_)
      for (OutputPipe* s : {&r.out, &r.err})
        if (s->fd >= 0) {
          fds.push_back(pollfd{s->fd, POLLIN, 0});
          owners.emplace_back(&r, s);
        }
    if (fds.empty()) {
      if (timeout_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms));
      return false;
    }
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n <= 0) return true;  // timeout or EINTR (a signal: the caller looks at it)
    for (size_t i = 0; i < fds.size(); ++i)
      if (fds[i].revents) drain(*owners[i].first, *owners[i].second);
    return true;
  }

  // Reaps exited children; returns the ranks that exited since the last call.
  std::vector<Rank*> reap() {
    std::vector<Rank*> exited;
    for (auto& r : ranks_) {
      if (!r.running) continue;
      const pid_t got = ::waitpid(r.pid, &r.status, WNOHANG);
      // G23B-1: ECHILD (reaped by someone else) counts as exited, status unknown: the loop waited for it forever.
      const bool gone = got < 0 && errno == ECHILD;
      if (got == r.pid || gone) {
        r.running = false;
        r.status_unknown = gone;
        exited.push_back(&r);
      }
    }
    return exited;
  }

  void signal_running(int sig) {
    for (auto& r : ranks_)
      if (r.running) ::kill(-r.pid, sig);
  }

  int32_t num_running() const {
    int32_t n = 0;
    for (const auto& r : ranks_) n += r.running ? 1 : 0;
    return n;
  }

  // Reads whatever is left in a rank's pipes (its own writes are all there once it has exited).
  void drain_rank(Rank& r) {
    drain(r, r.out);
    drain(r, r.err);
  }

  // Emits partial last lines and closes every pipe (grandchildren may hold them open forever).
  void close_all() {
    for (auto& r : ranks_) {
      flush_partial(r, r.out);
      flush_partial(r, r.err);
      close_stream(r.out);
      close_stream(r.err);
    }
  }

 private:
  void emit(Rank& r, OutputPipe& s, std::string line) {
    if (&s == &r.err) {
      r.err_tail.push_back(line);
      while (int32_t(r.err_tail.size()) > std::max(options_.failure_tail_lines, 0)) r.err_tail.pop_front();
    }
    write_all(s.out_fd, fmt::format("[rank {}] {}\n", r.index, line));
  }

  void flush_partial(Rank& r, OutputPipe& s) {
    if (!s.partial.empty()) emit(r, s, std::exchange(s.partial, {}));
  }

  void drain(Rank& r, OutputPipe& s) {
    constexpr size_t kMaxLine = 64 * 1024;  // a longer line without '\n' is relayed in pieces
    char buf[16384];
    while (s.fd >= 0) {
      const ssize_t n = ::read(s.fd, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return;  // EAGAIN: nothing more for now
      if (n == 0) {       // EOF
        flush_partial(r, s);
        close_stream(s);
        return;
      }
      s.partial.append(buf, size_t(n));
      size_t start = 0;
      for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
        emit(r, s, s.partial.substr(start, nl - start));
      s.partial.erase(0, start);
      if (s.partial.size() > kMaxLine) flush_partial(r, s);
    }
  }

  static void close_stream(OutputPipe& s) {
    if (s.fd >= 0) ::close(s.fd);
    s.fd = -1;
  }

  const LaunchOptions& options_;
  std::vector<Rank> ranks_;
};

std::string describe_exit(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* name = ::strsignal(WTERMSIG(status));
    return fmt::format("signal {} ({})", WTERMSIG(status), name ? name : "?");
  }
  return "unknown status";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }
bool failed(const Rank& r) { return r.status_unknown || failed(r.status); }

}  // namespace

int32_t count_gpus_with_nvidia_smi() {
  FILE* pipe = ::popen("nvidia-smi -L 2>/dev/null", "r");
  if (!pipe) return 0;
  int32_t count = 0;
  char line[1024];
  while (std::fgets(line, sizeof(line), pipe))
    if (std::strncmp(line, "GPU ", 4) == 0) ++count;  // MIG instances are indented lines: not counted
  const int status = ::pclose(pipe);
  return (WIFEXITED(status) && WEXITSTATUS(status) == 0) ? count : 0;
}

int32_t count_visible_gpus() {
  // DMOE_DEVICE indexes the devices CUDA shows the child, which CUDA_VISIBLE_DEVICES narrows; nvidia-smi
  // lists them all.
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES")) {
    int32_t count = 0;
    std::string list = visible;
    for (size_t start = 0; start < list.size();) {
      const size_t end = std::min(list.find(',', start), list.size());
      if (end > start) ++count;
      start = end + 1;
    }
    return count;
  }
  return count_gpus_with_nvidia_smi();
}

std::vector<int32_t> assign_devices(int32_t num_ranks, const std::vector<int32_t>& gpus) {
  std::vector<int32_t> devices;
  if (gpus.empty()) return devices;
  for (int32_t r = 0; r < num_ranks; ++r) devices.push_back(gpus[size_t(r) % gpus.size()]);
  return devices;
}

namespace {

// The launch itself; `ended_by` is the signal that stopped it (0: none), for launch() to end by once every guard here
// has cleaned up.
int run_launch(const LaunchOptions& o, int& ended_by) {
  DMOE_REQUIRE_INPUT(o.num_ranks >= 1 && o.num_ranks <= 4096, "-n {} is invalid: the number of ranks must be in [1, 4096]",
                     o.num_ranks);
  DMOE_REQUIRE_INPUT(!o.command.empty(), "no command to launch: give it after `--`, e.g. dmoe launch -n 2 -- dmoe bench ...");
  for (int32_t g : o.gpus) DMOE_REQUIRE_INPUT(g >= 0, "--gpus lists {}: GPU indices must be >= 0", g);
  if (!o.gpus.empty()) {
    // Indices into the GPUs the ranks will see: `--gpus 7,99` on a machine without those was handed on as DMOE_DEVICE
    // 7 and 99 (rc 0), for each rank's CUDA to fail on later or never.
    const int32_t visible = count_visible_gpus();
    for (int32_t g : o.gpus)
      DMOE_REQUIRE_INPUT(g < visible, "--gpus lists {}, but {}; GPU indices must be in [0, {}) (indices into "
                         "CUDA_VISIBLE_DEVICES when it is set, else into `nvidia-smi -L`)", g,
                         visible == 0 ? std::string("no GPU is visible here: leave out --gpus")
                                      : fmt::format("{} GPU{} visible here", visible, visible == 1 ? " is" : "s are"),
                         visible);
  }
  const std::string program = find_program(o.command[0]);
  DMOE_REQUIRE_INPUT(!program.empty(), "cannot find an executable '{}'{}", o.command[0],
                     o.command[0].find('/') == std::string::npos ? " on PATH" : "");

  // GPUs: dealt round-robin; count the ranks on each to size MPS shares.
  std::vector<int32_t> gpus = o.gpus;
  if (gpus.empty())
    for (int32_t g = 0, n = count_visible_gpus(); g < n; ++g) gpus.push_back(g);
  const std::vector<int32_t> devices = assign_devices(o.num_ranks, gpus);
  std::map<int32_t, int32_t> ranks_on_gpu;
  for (int32_t d : devices) ++ranks_on_gpu[d];
  bool shared = false;
  for (const auto& [gpu, n] : ranks_on_gpu) shared = shared || n > 1;

  // Each rank's stdout and stderr stay open in the launcher as a pipe each (two descriptors, four while it starts):
  // past ulimit -n the error came at rank ~N/2, after the ranks before it had started and run (G20-7). Refused first.
  require_file_descriptors(2 * int64_t(o.num_ranks) + 16, fmt::format("dmoe launch -n {} (two pipes per rank, and its "
                           "rendezvous directory and signals)", o.num_ranks));
  SignalGuard signals;
  TempDir temp(o.err_fd);
  const std::string rendezvous = temp.path() + "/rendezvous";
  create_launch_subdirectory(rendezvous);

  EnvList base = current_env();
  std::unique_ptr<MpsDaemon> mps;
  // Stops the daemon on every way out (after RankSet, declared below, has ended the ranks); keeps the
  // temp directory when the daemon does not exit, so it can still be reached through its pipe directory.
  struct MpsStopper {
    std::unique_ptr<MpsDaemon>& mps;
    TempDir& temp;
    ~MpsStopper() {
      if (mps && !mps->stop()) temp.keep();
    }
  } mps_stopper{mps, temp};
  std::string mps_pipe_dir, mps_log_dir;
  bool mps_active = false;
  if (shared && o.use_mps) {
    if (const char* existing = std::getenv("CUDA_MPS_PIPE_DIRECTORY"); existing && *existing) {
      // The caller runs (or chose) an MPS daemon: use it, do not start a second.
      mps_active = true;
      message(o.err_fd, fmt::format("ranks share a GPU; using the MPS daemon at CUDA_MPS_PIPE_DIRECTORY={}", existing));
    } else if (const std::string control = find_program("nvidia-cuda-mps-control"); !control.empty()) {
      mps = std::make_unique<MpsDaemon>(control, temp.path(), o.err_fd);
      set_env(base, "CUDA_MPS_PIPE_DIRECTORY", mps->pipe_dir());
      set_env(base, "CUDA_MPS_LOG_DIRECTORY", mps->log_dir());
      mps_active = true;
    } else {
      message(o.err_fd, "warning: ranks share a GPU but nvidia-cuda-mps-control is not on PATH: their kernels "
                        "time-slice and NVSHMEM host collectives abort (\"limited MPG\")");
    }
  }
  set_env(base, "DMOE_WORLD", std::to_string(o.num_ranks));
  set_env(base, "DMOE_LOCAL_WORLD", std::to_string(o.num_ranks));
  // The ranks of one launch meet in the launcher's own directory; a DMOE_RENDEZVOUS the caller set was replaced
  // without a word (the ranks' stage board and bootstrap files went elsewhere than the caller's directory).
  if (const char* own = std::getenv("DMOE_RENDEZVOUS"); own && *own && rendezvous != own)
    message(o.err_fd, fmt::format("note: DMOE_RENDEZVOUS={} from the environment is not used: the ranks of one "
                                  "dmoe launch meet in the launcher's own directory ({}); unset DMOE_RENDEZVOUS "
                                  "to silence this", own, rendezvous));
  set_env(base, "DMOE_RENDEZVOUS", rendezvous);
  set_env(base, "NCCL_NVLS_ENABLE", "0", false);
  set_env(base, "NVSHMEM_DISABLE_NVLS", "1", false);
  if (!devices.empty()) set_env(base, "DMOE_SHARED_GPUS", shared ? "1" : "0");
  // NVSHMEM's NCCL path would meet NCCL's duplicate-GPU refusal.
  if (shared) set_env(base, "NVSHMEM_DISABLE_NCCL", "1");

  // G23B-4: more ranks than ulimit -u allows this user at all are refused before the first starts (root is not held
  // to it). The user's other processes count too: a fork that fails later is reported as below.
  if (struct rlimit nproc {}; ::geteuid() != 0 && ::getrlimit(RLIMIT_NPROC, &nproc) == 0 &&
                              nproc.rlim_cur != RLIM_INFINITY)
    DMOE_REQUIRE_INPUT(rlim_t(o.num_ranks) < nproc.rlim_cur, "dmoe launch -n {} starts {} processes besides itself, but "
                       "ulimit -u allows this user {} in all: raise ulimit -u, or launch fewer ranks", o.num_ranks,
                       o.num_ranks, nproc.rlim_cur);

  RankSet ranks(o);
  std::string start_error;
  for (int32_t r = 0; r < o.num_ranks; ++r) {
    if (g_received_signal != 0) break;  // stopped while starting: no more ranks; the loop below ends those started
    EnvList env = base;
    set_env(env, "DMOE_RANK", std::to_string(r));
    set_env(env, "DMOE_LOCAL_RANK", std::to_string(r));
    if (!devices.empty()) {
      set_env(env, "DMOE_DEVICE", std::to_string(devices[r]));
      // floor(100 / k) per process, so the shares on one GPU add up to at most 100.
      if (mps_active) set_env(env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", std::to_string(100 / ranks_on_gpu[devices[r]]));
    }
    start_error = ranks.start(r, program, o.command, std::move(env));
    if (!start_error.empty()) break;
  }

  constexpr int kPollMs = 50;
  constexpr double kDrainAfterExitS = 1.0;  // grandchildren may hold a rank's pipes open after it exits
  int result = 0;
  bool tearing_down = false, killed = false, terminated = false;
  auto teardown_start = Clock::now();
  auto all_exited_at = Clock::now();
  auto killed_at = Clock::now();
  bool all_exited = false;
  // G23B-11: the signals sent to the ranks, and whether a rank's own failure began the teardown: a rank that then
  // fails otherwise than by one of them failed on its own and is reported too (only the first was).
  std::vector<int> sent{SIGKILL};
  bool rank_failed = false;
  const auto stopped_by_us = [&](int status) {
    for (const int s : sent)
      if ((WIFSIGNALED(status) && WTERMSIG(status) == s) || (WIFEXITED(status) && WEXITSTATUS(status) == 128 + s))
        return true;
    return false;
  };
  auto begin_teardown = [&](int sig) {
    sent.push_back(sig);
    if (!tearing_down) {
      tearing_down = true;
      teardown_start = Clock::now();
      terminated = sig == SIGTERM;
    } else if (sig == SIGTERM && !terminated && !killed) {
      // G23B-8: a SIGTERM during the grace of a forwarded USR1 (or INT ...) starts the SIGTERM's own grace: the
      // launcher said 5 s after the USR1 that it was "sending SIGTERM", already sent, and the SIGKILL came ~9 s after.
      terminated = true;
      teardown_start = Clock::now();
    }
    ranks.signal_running(sig);
  };
  if (!start_error.empty()) {
    // G23B-4: the ranks already started are stopped as for a failed rank: SIGTERM, then SIGKILL after the grace.
    if (const int32_t started = ranks.num_running(); started > 0)
      message(o.err_fd, fmt::format("a rank could not be started; stopping the {} started rank(s) (SIGTERM, SIGKILL "
                                    "after {} s)", started, o.kill_grace_seconds));
    begin_teardown(SIGTERM);
  }

  for (;;) {
    const bool pipes_open = ranks.pump(kPollMs);
    if (const int sig = g_received_signal; sig != 0) {
      g_received_signal = 0;
      message(o.err_fd, fmt::format("received signal {} ({}); forwarding it to the ranks", sig, ::strsignal(sig)));
      if (result == 0) {
        result = 128 + sig;
        ended_by = sig;
      }
      begin_teardown(sig);
    }
    for (Rank* r : ranks.reap()) {
      if (!failed(*r)) continue;
      if (tearing_down) {
        if (rank_failed && (r->status_unknown || !stopped_by_us(r->status)))
          message(o.err_fd, fmt::format("rank {} also failed ({})", r->index, r->status_unknown ? "exit status unknown"
                                        : describe_exit(r->status)));
        continue;
      }
      rank_failed = true;
      ranks.drain_rank(*r);
      std::string report = fmt::format("rank {} failed ({})", r->index, r->status_unknown ? "its exit status is "
                                       "unknown: another waiter reaped it" : describe_exit(r->status));
      if (!r->err_tail.empty()) {
        report += fmt::format("; its last {} stderr line(s):", r->err_tail.size());
        for (const auto& line : r->err_tail) report += "\n  | " + line;
      }
      message(o.err_fd, report);
      result = r->status_unknown ? 1 : exit_code_of(r->status);
      if (const int32_t others = ranks.num_running(); others > 0)
        message(o.err_fd, fmt::format("stopping the other {} rank(s) (SIGTERM, SIGKILL after {} s)", others,
                                      o.kill_grace_seconds));
      begin_teardown(SIGTERM);
    }
    if (tearing_down && !killed && ranks.num_running() > 0 && seconds_since(teardown_start) > o.kill_grace_seconds) {
      if (!terminated) {
        // G22B-1: a rank may catch a forwarded USR1 or ALRM and go on (a checkpoint request): it gets a SIGTERM and a
        // second grace period, to clean up, before the SIGKILL.
        message(o.err_fd, fmt::format("{} rank(s) still running {} s after the signal; sending SIGTERM (SIGKILL after "
                                      "{} s)", ranks.num_running(), o.kill_grace_seconds, o.kill_grace_seconds));
        ranks.signal_running(SIGTERM);
        sent.push_back(SIGTERM);
        terminated = true;
        teardown_start = Clock::now();
      } else {
        ranks.signal_running(SIGKILL);
        killed = true;
        killed_at = Clock::now();
      }
    }
    // G23B-1: every wait bounded: a rank that does not go even after SIGKILL (uninterruptible sleep) is left.
    if (killed && ranks.num_running() > 0 && seconds_since(killed_at) > kReapAfterKillS) {
      message(o.err_fd, fmt::format("{} rank(s) still there {:.0f} s after SIGKILL; not waiting for them any longer",
                                    ranks.num_running(), kReapAfterKillS));
      if (result == 0) result = 1;
      break;
    }
    if (ranks.num_running() == 0) {
      if (!all_exited) {
        all_exited = true;
        all_exited_at = Clock::now();
      }
      if (!pipes_open || seconds_since(all_exited_at) > kDrainAfterExitS) break;
    }
  }
  ranks.close_all();
  if (!start_error.empty()) DMOE_FAIL_INPUT("{}", start_error);  // after the teardown above (G23B-4)
  return result;
}

}  // namespace

void set_after_fork_hook_for_tests(void (*hook)()) { g_after_fork_hook_for_tests = hook; }

void set_fork_failure_for_tests(int (*hook)(int32_t rank)) { g_fork_failure_for_tests = hook; }

int launch(const LaunchOptions& o) {
  int ended_by = 0;
  int result = run_launch(o, ended_by);
  // G23B-7: a signal that came after the poll loop, while the MPS daemon was stopped and the directory removed, was
  // recorded and never read (rc 0, no word). It ends the launch as one in the loop does. (Its handler was still
  // installed then; once run_launch has restored the dispositions, a signal takes its default action.)
  if (const int late = g_received_signal; late != 0 && ended_by == 0) {
    g_received_signal = 0;
    message(o.err_fd, fmt::format("received signal {} ({}) while cleaning up; the ranks had ended", late,
                                  ::strsignal(late)));
    ended_by = late;
    result = 128 + late;
  }
  if (ended_by != 0 && o.end_by_signal) {
    // G22B-1: the ranks, the MPS daemon, the rendezvous directory and the handlers are gone; the launcher now ends by
    // the signal's default action, as a process without it would (a shell loop sees an interrupt, Slurm its signal).
    struct sigaction def {};
    def.sa_handler = SIG_DFL;
    sigemptyset(&def.sa_mask);
    ::sigaction(ended_by, &def, nullptr);
    sigset_t only;
    sigemptyset(&only);
    sigaddset(&only, ended_by);
    ::sigprocmask(SIG_UNBLOCK, &only, nullptr);
    ::raise(ended_by);
  }
  return result;
}

}  // namespace dmoe
