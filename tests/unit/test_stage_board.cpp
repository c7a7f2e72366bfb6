// test_stage_board.cpp — the shared-memory stage board (comm/stage_board.hpp) that lets ranks running as
// processes name a failed or hung peer: slots written by one rank and read by another, a peer process that
// dies without a word, an injected hang that ends as soon as a peer gives up, the file rules and the errors.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "comm/comm.hpp"
#include "comm/stage_board.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

namespace fs = std::filesystem;

struct TempBoardDir {
  fs::path dir;
  TempBoardDir() {
    char tmpl[] = "/tmp/dmoe-stage-board-test-XXXXXX";
    dir = ::mkdtemp(tmpl);
  }
  ~TempBoardDir() { fs::remove_all(dir); }
  std::string path(const char* name = "board") const { return (dir / name).string(); }
};

TEST(StageBoard, SlotsWrittenByOneRankAreSeenByAnother) {
  TempBoardDir t;
  StageBoard r0(t.path(), 2, 0, 2), r1(t.path(), 2, 1, 2);
  EXPECT_EQ(r0.slot(1).state, RankState::running);
  EXPECT_EQ(r0.slot(1).pid, ::getpid());
  EXPECT_EQ(r0.slot(1).stage, FaultStage::none);
  r1.enter(FaultStage::expert_gemm);
  EXPECT_EQ(r0.slot(1).stage, FaultStage::expert_gemm);
  EXPECT_TRUE(r0.failed_peer().empty());
  // Rank 0 waits, rank 1 does not: on a time-out rank 0 names rank 1 and its stage.
  r0.set_waiting(true);
  const std::string seen_by_0 = r0.describe_peers();
  EXPECT_NE(seen_by_0.find("rank 1"), std::string::npos) << seen_by_0;
  EXPECT_NE(seen_by_0.find("not waiting"), std::string::npos) << seen_by_0;
  EXPECT_NE(seen_by_0.find("expert_gemm"), std::string::npos) << seen_by_0;
  const std::string seen_by_1 = r1.describe_peers();
  EXPECT_NE(seen_by_1.find("rank 0: running, waiting"), std::string::npos) << seen_by_1;
  r1.mark(RankState::failed);
  std::this_thread::sleep_for(std::chrono::milliseconds(15));  // failed_peer looks at most every 10 ms
  EXPECT_EQ(r0.failed_peer(), "rank 1 failed in stage expert_gemm");
}

TEST(StageBoard, ARankThatFailedBecauseAThirdHangsNamesTheHungOneToo) {
  TempBoardDir t;
  StageBoard r0(t.path(), 3, 0, 3), r1(t.path(), 3, 1, 3), r2(t.path(), 3, 2, 3);
  r0.enter(FaultStage::alltoall);
  r0.set_waiting(true);
  r1.enter(FaultStage::alltoall);
  r2.enter(FaultStage::expert_gemm);  // runs, does not wait: hangs
  r1.mark(RankState::failed);         // gave up on rank 2 and failed
  const std::string failed = r0.failed_peer();
  EXPECT_NE(failed.find("rank 1 failed in stage alltoall; rank 2 (pid"), std::string::npos) << failed;
  EXPECT_NE(failed.find("stage expert_gemm"), std::string::npos) << failed;
}

TEST(StageBoard, PeerProcessThatDiesWithoutAWordIsNamedWithItsStage) {
  TempBoardDir t;
  StageBoard r0(t.path(), 2, 0, 2);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      StageBoard r1(t.path(), 2, 1, 2);
      r1.enter(FaultStage::combine);
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);  // gone while "running": as if killed
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  const RankSlot s = r0.slot(1);
  EXPECT_EQ(s.pid, child);
  EXPECT_FALSE(s.process_alive);
  const std::string failed = r0.failed_peer();
  EXPECT_NE(failed.find("rank 1's process (pid " + std::to_string(child) + ") is gone"), std::string::npos) << failed;
  EXPECT_NE(failed.find("combine"), std::string::npos) << failed;
}

TEST(StageBoard, RefusesAFileOfAnotherWorldAndAPathItCannotCreate) {
  TempBoardDir t;
  { StageBoard four(t.path(), 4, 0, 4); }
  try {
    StageBoard two(t.path(), 2, 0, 2);
    FAIL() << "a board of 4 ranks was opened as one of 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(t.path()), std::string::npos) << e.what();
  }
  EXPECT_THROW(StageBoard(t.path("no/such/dir/board"), 2, 0, 2), Error);
  EXPECT_THROW(StageBoard(t.path(), 4, 4, 4), Error);  // rank out of range
}

TEST(StageBoard, LeavesAFileThatIsNoBoardAsItIs) {
  // DMOE_STAGE_BOARD naming a file of the user's (smaller than a board) had it extended with zeros to the board's size
  // before "is not a dmoe stage board" was said.
  TempBoardDir t;
  const std::string text = "not a board\n";
  { std::ofstream(t.path("notes.txt")) << text; }
  try {
    StageBoard b(t.path("notes.txt"), 2, 0, 2);
    FAIL() << "a text file was taken as a stage board";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("it was left as it is"), std::string::npos) << e.what();
  }
  std::ifstream in(t.path("notes.txt"), std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text);
  // A board of 2 ranks is not extended into one of 4 either; and no FIFO or device is taken.
  { StageBoard two(t.path(), 2, 0, 2); }
  const auto size_of_two = fs::file_size(t.path());
  EXPECT_THROW(StageBoard(t.path(), 4, 0, 4), Error);
  EXPECT_EQ(fs::file_size(t.path()), size_of_two);
  ASSERT_EQ(::mkfifo(t.path("fifo").c_str(), 0600), 0);
  EXPECT_THROW(StageBoard(t.path("fifo"), 2, 0, 2), Error);
}

TEST(StageBoard, AnEmptyFileOrALinkAtThePathIsRefusedAndNotRemoved) {
  // Seen in the code in the twentieth bad-input pass: DMOE_STAGE_BOARD naming a user's empty file (or a link to one)
  // had it sized into a board, and the job's last rank unlinked the path at the end: the user's file was gone.
  TempBoardDir t;
  { std::ofstream(t.path("empty")); }
  ASSERT_EQ(fs::file_size(t.path("empty")), 0u);
  try {
    StageBoard b(t.path("empty"), 2, 0, 2);
    FAIL() << "an empty file of the user's was taken as a stage board";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is an empty file that no rank of this job made into a board"),
              std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_regular_file(t.path("empty")));
  EXPECT_EQ(fs::file_size(t.path("empty")), 0u);
  fs::create_symlink(t.path("empty"), t.path("link"));
  fs::create_symlink(t.path("missing"), t.path("dangling"));
  for (const char* name : {"link", "dangling"}) {
    try {
      StageBoard b(t.path(name), 2, 0, 2);
      FAIL() << "a symbolic link was followed to a stage board: " << name;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is a symbolic link"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(fs::is_symlink(t.path(name))) << name;
  }
  EXPECT_EQ(fs::file_size(t.path("empty")), 0u);
  EXPECT_FALSE(fs::exists(t.path("missing")));
  // A board the job made is its own to remove, while the path still names it; a file put in its place is not.
  StageBoard made(t.path("board"), 2, 0, 2);
  EXPECT_TRUE(made.is_file_at_path());
  { std::ofstream(t.path("other")) << "user"; }
  fs::rename(t.path("other"), t.path("board"));
  EXPECT_FALSE(made.is_file_at_path());
}

TEST(StageBoard, PathFollowsTheLauncher) {
  ProcessEnv env;
  env.world = 2;
  ::unsetenv("DMOE_STAGE_BOARD");
  env.launcher = "single";
  EXPECT_EQ(stage_board_path(env), "");
  env.launcher = "dmoe-launch";
  ::setenv("DMOE_RENDEZVOUS", "/tmp/launch-x/rendezvous", 1);
  EXPECT_EQ(stage_board_path(env), "/tmp/launch-x/rendezvous/stage-board");
  ::unsetenv("DMOE_RENDEZVOUS");
  EXPECT_EQ(stage_board_path(env), "");
  env.launcher = "mpirun";
  ::setenv("PMIX_NAMESPACE", "prterun-host-1234@1", 1);
  EXPECT_EQ(stage_board_path(env), "/dev/shm/dmoe-stage-board-prterun-host-1234_1-" + std::to_string(::getuid()));
  ::unsetenv("PMIX_NAMESPACE");
  ::setenv("DMOE_STAGE_BOARD", "off", 1);
  EXPECT_EQ(stage_board_path(env), "");
  ::setenv("DMOE_STAGE_BOARD", "/tmp/my-board", 1);
  EXPECT_EQ(stage_board_path(env), "/tmp/my-board");
  ::unsetenv("DMOE_STAGE_BOARD");
}

TEST(StageBoard, ABoardLeftByAKilledJobIsNotTakenForThisJobsRanks) {
  // G21-7 (twenty-first pass): a job killed at a fixed DMOE_STAGE_BOARD path leaves its board (no exit handler ran);
  // the next job of the same world attached it with the old slots, and a wait stopped at once on "rank 1 failed"
  // before the new rank 1 had attached. Slots carry their job's identity now.
  TempBoardDir t;
  {
    StageBoard old0(t.path(), 2, 0, 2, "dmoe-launch:/tmp/old"), old1(t.path(), 2, 1, 2, "dmoe-launch:/tmp/old");
    old1.enter(FaultStage::combine);
    old1.mark(RankState::failed);
  }  // unmapped, the file stays, as after a SIGKILL
  ASSERT_TRUE(fs::exists(t.path()));
  StageBoard new0(t.path(), 2, 0, 2, "dmoe-launch:/tmp/new");
  EXPECT_EQ(new0.slot(1).pid, 0);
  EXPECT_EQ(new0.failed_peer(), "") << "the old job's rank 1 was taken for this job's";
  const std::string peers = new0.describe_peers();
  EXPECT_NE(peers.find("rank 1: not seen on this node"), std::string::npos) << peers;
  // This job's rank 1 counts as soon as it attaches.
  StageBoard new1(t.path(), 2, 1, 2, "dmoe-launch:/tmp/new");
  EXPECT_EQ(new0.slot(1).pid, ::getpid());
  EXPECT_EQ(new0.slot(1).state, RankState::running);
  new1.enter(FaultStage::alltoall);
  new1.mark(RankState::failed);
  std::this_thread::sleep_for(std::chrono::milliseconds(15));  // failed_peer looks at most every 10 ms
  EXPECT_EQ(new0.failed_peer(), "rank 1 failed in stage alltoall");
}

TEST(StageBoard, JobIdentityFollowsTheLauncher) {
  ProcessEnv env;
  env.world = 2;
  ::unsetenv("DMOE_JOB_ID");
  env.launcher = "single";
  EXPECT_EQ(stage_board_job(env), "");
  env.launcher = "dmoe-launch";
  ::setenv("DMOE_RENDEZVOUS", "/tmp/launch-x/rendezvous", 1);
  EXPECT_EQ(stage_board_job(env), "dmoe-launch:/tmp/launch-x/rendezvous");
  ::unsetenv("DMOE_RENDEZVOUS");
  env.launcher = "srun";
  ::setenv("SLURM_JOB_ID", "77", 1);
  ::setenv("SLURM_STEP_ID", "3", 1);
  EXPECT_EQ(stage_board_job(env), "srun:77.3");
  ::unsetenv("SLURM_JOB_ID");
  ::unsetenv("SLURM_STEP_ID");
  ::setenv("DMOE_JOB_ID", "nightly-5", 1);
  EXPECT_EQ(stage_board_job(env), "job:nightly-5");
  ::unsetenv("DMOE_JOB_ID");
}

// A one-process Comm whose failure handling is the base class's (the process's stage board), as the GPU
// communicators' is; its collectives are never called here.
class BoardOnlyComm final : public Comm {
 public:
  int32_t rank() const override { return 0; }
  int32_t world() const override { return 2; }
  const char* name() const override { return "board-only"; }
  void alltoallv(const void*, const int64_t*, void*, const int64_t*, DType, Stream) override {}
  void allreduce_sum(void*, int64_t, DType, Stream) override {}
  void broadcast(void*, int64_t, DType, int32_t, Stream) override {}
  void barrier(Stream) override {}
};

// The process board is one per process: this is the only test that attaches it.
TEST(StageBoard, InjectedHangEndsAsSoonAsAPeerProcessGivesUp) {
  TempBoardDir t;
  ::setenv("DMOE_STAGE_BOARD", t.path().c_str(), 1);
  ProcessEnv env;
  env.world = env.local_world = 2;
  env.launcher = "mpirun";
  StageBoard* board = attach_stage_board(env);
  ::unsetenv("DMOE_STAGE_BOARD");
  ASSERT_NE(board, nullptr);
  ASSERT_EQ(process_stage_board(), board);
  ASSERT_EQ(peer_watch(), board);
  BoardOnlyComm comm;
  comm.enter_stage(FaultStage::backward);
  EXPECT_EQ(board->slot(0).stage, FaultStage::backward);

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 1: waits a little, then gives up on rank 0
    try {
      StageBoard r1(t.path(), 2, 1, 2);
      r1.enter(FaultStage::alltoall);
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      r1.give_up();
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // alive: only the state says it
    } catch (...) {
      ::_exit(2);
    }
    ::_exit(0);
  }
  ::setenv("DMOE_FAULT", "0:alltoall:hang", 1);
  ::setenv("DMOE_COMM_TIMEOUT_S", "30", 1);  // without the board the hang would last 4 × 30 s
  const auto start = std::chrono::steady_clock::now();
  std::string error;
  try {
    fault_point(comm, FaultStage::alltoall);
  } catch (const Error& e) {
    error = e.what();
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::unsetenv("DMOE_FAULT");
  ::unsetenv("DMOE_COMM_TIMEOUT_S");
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_NE(error.find("hung at stage alltoall"), std::string::npos) << error;
  EXPECT_LT(seconds, 5.0);
  EXPECT_GT(seconds, 0.15);
  detach_stage_board(false);
  EXPECT_EQ(board->slot(0).state, RankState::done);
}

}  // namespace
}  // namespace dmoe
