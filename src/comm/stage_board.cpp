// stage_board.cpp — see stage_board.hpp.
#include "comm/stage_board.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cerrno>
#include <exception>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/error.hpp"

namespace dmoe {

namespace {

constexpr uint64_t kMagic = 0x64'6d'6f'65'53'42'44'31ull;  // "dmoeSBD1"
constexpr uint64_t kClaimed = 1;                            // the creator is writing the header

static_assert(std::atomic<int32_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free &&
                  std::atomic<uint64_t>::is_always_lock_free,
              "the board's atomics are shared between processes: they must be lock-free");

struct alignas(64) Header {
  std::atomic<uint64_t> magic;
  std::atomic<int32_t> world;
};

struct alignas(64) Slot {
  std::atomic<uint64_t> job;  // the job tag of the rank that wrote the slot (job_tag); 0: none known
  std::atomic<int32_t> pid;
  std::atomic<int32_t> state;
  std::atomic<int32_t> stage;
  std::atomic<int32_t> waiting;
  std::atomic<int64_t> stage_ns;  // CLOCK_MONOTONIC (the same clock in every process of the node)
};

int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

static_assert(sizeof(Slot) == 64, "the board's layout (its size per rank) is fixed");

// A job's identity as a nonzero 64-bit tag (FNV-1a), or 0 when the job has none.
uint64_t job_tag(const std::string& job) {
  if (job.empty()) return 0;
  uint64_t h = 0xcbf29ce484222325ull;
  for (const unsigned char c : job) h = (h ^ c) * 0x100000001b3ull;
  return h == 0 ? 1 : h;
}

size_t board_bytes(int32_t world) { return sizeof(Header) + size_t(world) * sizeof(Slot); }

bool process_alive(int32_t pid) { return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM); }

const char* stage_words(FaultStage s) { return s == FaultStage::none ? "no stage yet" : fault_stage_name(s); }

}  // namespace

const char* rank_state_name(RankState state) {
  switch (state) {
    case RankState::unknown: return "unknown";
    case RankState::running: return "running";
    case RankState::done: return "done";
    case RankState::failed: return "failed";
    case RankState::exited: return "exited";
    case RankState::gave_up: return "gave up";
  }
  return "?";
}

struct StageBoard::Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  Header* header() const { return static_cast<Header*>(base); }
  Slot* slot(int32_t r) const { return reinterpret_cast<Slot*>(static_cast<char*>(base) + sizeof(Header)) + r; }
  int64_t last_check_ns = 0;
  std::string last_failure;
  dev_t dev = 0;  // the board file's identity: only that file is removed at the end
  ino_t ino = 0;
};

StageBoard::StageBoard(const std::string& path, int32_t world, int32_t rank, int32_t local_world,
                       const std::string& job)
    : path_(path), world_(world), rank_(rank), local_world_(local_world), job_(job_tag(job)) {
  DMOE_REQUIRE(world >= 1 && rank >= 0 && rank < world, "stage board {}: rank {} of {} is invalid", path, rank, world);
  const size_t bytes = board_bytes(world);
  // The first rank creates the board (O_EXCL) and sizes it at once; the others open that file. A file that was there
  // before, empty (a user's file named by DMOE_STAGE_BOARD), or a symbolic link to one, was taken as a new board and
  // sized, and the job's last rank then unlinked the path: the user's file was deleted. Links are not followed now, and
  // an existing file must become a board of this size within the creator's moment; else it is refused and left.
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  const bool created = fd >= 0;
  if (!created && errno == EEXIST) fd = ::open(path.c_str(), O_RDWR | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0 && errno == ELOOP)
    DMOE_FAIL("stage board {}: is a symbolic link; a board is a file of its own (set DMOE_STAGE_BOARD to another "
              "path); it was left as it is", path);
  DMOE_REQUIRE(fd >= 0, "stage board {}: cannot open or create it: {}", path, std::strerror(errno));
  struct stat st {};
  if (!created) {  // a peer that created it sizes it right away: wait for that a moment (2 s), as for its header
    const auto start = std::chrono::steady_clock::now();
    while (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 0 &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(2))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size == 0) {
      ::close(fd);
      DMOE_FAIL("stage board {}: is an empty file that no rank of this job made into a board (a user's file, or one "
                "left by a job killed as it began); remove it, or set DMOE_STAGE_BOARD to another path; it was left "
                "as it is", path);
    }
  }
  // A board is sized in one ftruncate from 0: a file of another size, or one that is no regular file, is not one of
  // this job's, and is left as it is (DMOE_STAGE_BOARD naming a text file had it extended with zeros before the
  // "not a dmoe stage board" error).
  if (::fstat(fd, &st) == 0 && (!S_ISREG(st.st_mode) || (st.st_size != 0 && size_t(st.st_size) != bytes))) {
    const bool regular = S_ISREG(st.st_mode);
    ::close(fd);
    if (!regular) DMOE_FAIL("stage board {}: is not a regular file (a board is a file of shared memory)", path);
    DMOE_FAIL("stage board {}: holds {} bytes, a board of {} ranks has {}: a file of another job, or not a stage "
              "board (remove it, or set DMOE_STAGE_BOARD to another path); it was left as it is", path,
              size_t(st.st_size), world, bytes);
  }
  if (::fstat(fd, &st) != 0 || (size_t(st.st_size) < bytes && ::ftruncate(fd, off_t(bytes)) != 0)) {
    const int e = errno;
    ::close(fd);
    DMOE_FAIL("stage board {}: cannot size it to {} bytes: {}", path, bytes, std::strerror(e));
  }
  if (size_t(st.st_size) > bytes) {
    ::close(fd);
    DMOE_FAIL("stage board {}: holds {} bytes, a board of {} ranks has {}: a file of another job (remove it, or set "
              "DMOE_STAGE_BOARD to another path)", path, size_t(st.st_size), world, bytes);
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  DMOE_REQUIRE(base != MAP_FAILED, "stage board {}: cannot map it: {}", path, std::strerror(e));
  map_ = new Mapping;
  map_->base = base;
  map_->bytes = bytes;
  map_->dev = st.st_dev;
  map_->ino = st.st_ino;
  Header* h = map_->header();
  uint64_t expected = 0;
  if (h->magic.compare_exchange_strong(expected, kClaimed)) {
    h->world.store(world);
    h->magic.store(kMagic, std::memory_order_release);
  } else {
    const auto start = std::chrono::steady_clock::now();
    while (h->magic.load(std::memory_order_acquire) == kClaimed &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(2))
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const uint64_t magic = h->magic.load(std::memory_order_acquire);
  const int32_t board_world = h->world.load();
  if (magic != kMagic || board_world != world) {
    ::munmap(map_->base, map_->bytes);
    delete map_;
    map_ = nullptr;
    DMOE_FAIL("stage board {}: {} (expected a board of {} ranks)", path,
              magic != kMagic ? "is not a dmoe stage board" : fmt::format("is a board of {} ranks", board_world).c_str(),
              world);
  }
  // The slot is written with pid 0 first, then this job's tag, then the pid: a reader never sees the old job's pid
  // under this job's tag.
  Slot* s = map_->slot(rank);
  s->pid.store(0, std::memory_order_release);
  s->job.store(job_, std::memory_order_release);
  s->stage.store(int32_t(FaultStage::none));
  s->stage_ns.store(monotonic_ns());
  s->waiting.store(0);
  s->state.store(int32_t(RankState::running));
  s->pid.store(int32_t(::getpid()), std::memory_order_release);
}

bool StageBoard::is_file_at_path() const {
  struct stat st {};
  return map_ && ::lstat(path_.c_str(), &st) == 0 && S_ISREG(st.st_mode) && st.st_dev == map_->dev &&
         st.st_ino == map_->ino;
}

StageBoard::~StageBoard() {
  if (!map_) return;
  ::munmap(map_->base, map_->bytes);
  delete map_;
}

void StageBoard::enter(FaultStage stage) {
  Slot* s = map_->slot(rank_);
  s->stage_ns.store(monotonic_ns(), std::memory_order_relaxed);
  s->stage.store(int32_t(stage), std::memory_order_release);
}

void StageBoard::mark(RankState state) { map_->slot(rank_)->state.store(int32_t(state), std::memory_order_release); }

void StageBoard::set_waiting(bool waiting) { map_->slot(rank_)->waiting.store(waiting ? 1 : 0, std::memory_order_relaxed); }

RankSlot StageBoard::slot(int32_t r) const {
  DMOE_REQUIRE(r >= 0 && r < world_, "stage board: rank {} is out of range [0, {})", r, world_);
  const Slot* s = map_->slot(r);
  RankSlot out;
  // A board left at a fixed DMOE_STAGE_BOARD path by a job that was killed (SIGKILL: no exit handler removed it) is
  // attached by the next job of the same world as it is: its slots held the old ranks' pids and states, and a wait
  // stopped at once on "rank 1's process (pid ...) is gone" or "rank 1 failed" before the new rank 1 had attached
  // (G21-7 of the twenty-first pass). A slot written by another job reads as not started.
  out.pid = s->pid.load(std::memory_order_acquire);
  if (s->job.load(std::memory_order_acquire) != job_) {
    out.pid = 0;
    return out;
  }
  out.state = RankState(s->state.load(std::memory_order_acquire));
  out.stage = FaultStage(s->stage.load(std::memory_order_acquire));
  out.waiting = s->waiting.load(std::memory_order_relaxed) != 0;
  out.seconds_in_stage = double(monotonic_ns() - s->stage_ns.load(std::memory_order_relaxed)) * 1e-9;
  out.process_alive = process_alive(out.pid);
  return out;
}

std::string StageBoard::failed_peer() {
  // Polled between the sleeps of a wait: look at most every 10 ms (one kill(2) per peer).
  const int64_t now = monotonic_ns();
  if (now - map_->last_check_ns < 10'000'000) return map_->last_failure;
  map_->last_check_ns = now;
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const RankSlot s = slot(r);
    if (s.pid == 0) continue;  // not started, or on another node
    const char* stage = stage_words(s.stage);
    switch (s.state) {
      case RankState::failed:
      case RankState::exited: {
        // A rank that failed because a third one hangs: name the hung one too.
        const std::string hung = hanging_peers(r);
        map_->last_failure = fmt::format("rank {} {} in stage {}{}{}", r, s.state == RankState::failed ? "failed" : "exited",
                                         stage, hung.empty() ? "" : "; ", hung);
        return map_->last_failure;
      }
      case RankState::gave_up:
        map_->last_failure = fmt::format("rank {} gave up waiting in stage {} ({})", r, stage, describe_peers());
        return map_->last_failure;
      case RankState::running:
        if (!s.process_alive) {
          map_->last_failure = fmt::format("rank {}'s process (pid {}) is gone without a word, last in stage {}", r,
                                           s.pid, stage);
          return map_->last_failure;
        }
        break;
      case RankState::unknown:
      case RankState::done:
        break;
    }
  }
  return {};
}

namespace {

bool is_hanging(const RankSlot& s) { return s.pid != 0 && s.state == RankState::running && s.process_alive && !s.waiting; }

std::string hanging_text(int32_t r, const RankSlot& s) {
  return fmt::format("rank {} (pid {}) is not waiting for the GPU or its peers: stuck or busy in stage {} for {:.1f} s",
                     r, s.pid, stage_words(s.stage), s.seconds_in_stage);
}

}  // namespace

std::string StageBoard::hanging_peers(int32_t except) const {
  std::string out;
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_ || r == except) continue;
    const RankSlot s = slot(r);
    if (is_hanging(s)) out += (out.empty() ? "" : "; ") + hanging_text(r, s);
  }
  return out;
}

std::string StageBoard::describe_peers() {
  std::string hanging, others;
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const RankSlot s = slot(r);
    std::string text;
    if (s.pid == 0) {
      text = fmt::format("rank {}: not seen on this node", r);
    } else if (is_hanging(s)) {
      hanging += (hanging.empty() ? "" : "; ") + hanging_text(r, s);
      continue;
    } else {
      text = fmt::format("rank {}: {}{}, in stage {} for {:.1f} s", r, rank_state_name(s.state),
                         s.state == RankState::running && !s.process_alive ? " (process gone)"
                         : s.waiting                                       ? ", waiting"
                                                                           : "",
                         stage_words(s.stage), s.seconds_in_stage);
    }
    others += (others.empty() ? "" : "; ") + text;
  }
  if (hanging.empty() && others.empty()) return {};
  std::string out = "stage board " + path_ + ": ";
  if (!hanging.empty()) out += hanging + (others.empty() ? "" : "; others: ");
  return out + others;
}

std::string stage_board_path(const ProcessEnv& env) {
  if (const char* p = std::getenv("DMOE_STAGE_BOARD")) {
    const std::string v = p;
    if (v.empty() || v == "off" || v == "0") return {};
    return v;
  }
  auto sanitize = [](std::string s) {
    for (char& c : s)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.') c = '_';
    return s;
  };
  const std::string uid = std::to_string(::getuid());
  if (env.launcher == "dmoe-launch") {
    const char* dir = std::getenv("DMOE_RENDEZVOUS");
    return dir && *dir ? std::string(dir) + "/stage-board" : std::string();
  }
  if (env.launcher == "mpirun") {
    const char* job = std::getenv("PMIX_NAMESPACE");
    if (!job || !*job) job = std::getenv("OMPI_MCA_ess_base_jobid");
    return job && *job ? "/dev/shm/dmoe-stage-board-" + sanitize(job) + "-" + uid : std::string();
  }
  if (env.launcher == "srun") {
    const char* job = std::getenv("SLURM_JOB_ID");
    const char* step = std::getenv("SLURM_STEP_ID");
    return job && *job ? "/dev/shm/dmoe-stage-board-" + sanitize(std::string(job) + "." + (step ? step : "0")) + "-" + uid
                       : std::string();
  }
  return {};
}

std::string stage_board_job(const ProcessEnv& env) {
  const auto get = [](const char* name) {
    const char* v = std::getenv(name);
    return std::string(v ? v : "");
  };
  if (const std::string job = get("DMOE_JOB_ID"); !job.empty()) return "job:" + job;
  if (env.launcher == "dmoe-launch") {
    const std::string dir = get("DMOE_RENDEZVOUS");  // a directory of its own per launch
    return dir.empty() ? std::string() : "dmoe-launch:" + dir;
  }
  if (env.launcher == "mpirun") {
    std::string job = get("PMIX_NAMESPACE");
    if (job.empty()) job = get("OMPI_MCA_ess_base_jobid");
    return job.empty() ? std::string() : "mpirun:" + job;
  }
  if (env.launcher == "srun") {
    const std::string job = get("SLURM_JOB_ID"), step = get("SLURM_STEP_ID");
    return job.empty() ? std::string() : "srun:" + job + "." + (step.empty() ? "0" : step);
  }
  return {};
}

namespace {

std::mutex g_board_mutex;
StageBoard* g_board = nullptr;  // lives until process exit (its mapping is read by atexit)
int32_t g_users = 0;
bool g_tried = false;

}  // namespace

void finish_stage_board() {
  StageBoard* b = g_board;
  if (!b) return;
  if (b->slot(b->rank()).state == RankState::running) b->mark(RankState::exited);
  // The last rank of the node to leave removes the file (dmoe launch removes its directory anyway).
  for (int32_t r = 0; r < b->world(); ++r) {
    const RankSlot s = b->slot(r);
    if (r != b->rank() && s.pid != 0 && s.process_alive) return;
  }
  if (!b->is_file_at_path()) return;  // the path names another file now: not this job's to remove
  ::unlink(b->path().c_str());
}

namespace {
void at_exit() { finish_stage_board(); }
}  // namespace

StageBoard* attach_stage_board(const ProcessEnv& env) {
  if (env.world <= 1) return nullptr;
  std::lock_guard<std::mutex> lock(g_board_mutex);
  if (!g_tried) {
    g_tried = true;
    const std::string path = stage_board_path(env);
    if (!path.empty()) {
      try {
        g_board = new StageBoard(path, env.world, env.rank, env.local_world, stage_board_job(env));
        set_peer_watch(g_board);
        std::atexit(at_exit);
      } catch (const Error& e) {
        std::fprintf(stderr, "dmoe: [rank %d] warning: running without the stage board (errors about peers will "
                     "not say which rank failed): %s\n", env.rank, e.what());
      }
    }
  }
  if (!g_board) return nullptr;
  if (g_users++ == 0) g_board->mark(RankState::running);
  return g_board;
}

void detach_stage_board(bool failing) {
  std::lock_guard<std::mutex> lock(g_board_mutex);
  if (!g_board || g_users == 0) return;
  --g_users;
  if (failing)
    g_board->mark(RankState::failed);  // the peers stop waiting for this rank
  else if (g_users == 0)
    g_board->mark(RankState::done);
}

StageBoardUse::~StageBoardUse() {
  if (board_) detach_stage_board(std::uncaught_exceptions() > 0);
}

StageBoard* process_stage_board() {
  std::lock_guard<std::mutex> lock(g_board_mutex);
  return g_board;
}

}  // namespace dmoe
