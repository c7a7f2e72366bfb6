// stage_board.hpp — a page of shared memory where the ranks of a multi-process job on one node record
// where they are, so that a rank waiting on its peers can name the one that failed or hangs.
//
// One slot per rank: pid, state (running, done, failed, exited, gave up), the FaultStage it last entered
// and when, and whether it sits in a host-side wait. Each rank writes only its own slot (lock-free atomics
// on a shared mapping); readers poll. It answers the questions a surviving rank has when a collective does
// not finish:
//   - has a peer already failed?  state failed/exited/gave-up, or state running while its process is gone
//     (kill(pid, 0): same node only) → stop waiting now, naming it;
//   - if nobody failed, who hangs? the ranks that are running and not waiting, with their stage.
// It is diagnostics only: a board that cannot be opened is reported once and the job runs without it.
//
// The file: DMOE_STAGE_BOARD when set ("off" disables it), else $DMOE_RENDEZVOUS/stage-board under `dmoe
// launch`, else /dev/shm/dmoe-stage-board-<job>-<uid> under mpirun (PMIX_NAMESPACE or Open MPI's job id)
// and srun (SLURM_JOB_ID.SLURM_STEP_ID); none for a single process. Ranks on other nodes of a multi-node
// job write their own node's file and read as "not on this node".
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "comm/process_env.hpp"
#include "core/fault.hpp"
#include "core/peer_watch.hpp"

namespace dmoe {

enum class RankState : int32_t { unknown = 0, running = 1, done = 2, failed = 3, exited = 4, gave_up = 5 };
const char* rank_state_name(RankState state);

// One rank's slot as a reader sees it.
struct RankSlot {
  int32_t pid = 0;  // 0: the rank has not opened the board (not started yet, or on another node)
  RankState state = RankState::unknown;
  FaultStage stage = FaultStage::none;
  bool waiting = false;
  double seconds_in_stage = 0;  // since it entered `stage`
  bool process_alive = false;   // kill(pid, 0) succeeded
};

class StageBoard final : public PeerWatch {
 public:
  // Opens (creating when needed) the board at `path` for a job of `world` ranks and takes slot `rank`
  // (pid, running). Throws dmoe::Error naming the path when the file cannot be created or mapped, or holds
  // a board of another world size. `local_world`: ranks of this job on this node (the last of them to
  // finish removes the file). `job`: the job's identity (stage_board_job), the same in every rank of the job:
  // each slot carries it, and a slot of another job (a board left by a killed job at a fixed DMOE_STAGE_BOARD
  // path) reads as not started, so its old pids and states are not taken for this job's ranks. "" (no identity):
  // every slot is read as this job's.
  StageBoard(const std::string& path, int32_t world, int32_t rank, int32_t local_world, const std::string& job = "");
  ~StageBoard() override;  // unmaps (the slot keeps its last state)
  StageBoard(const StageBoard&) = delete;
  StageBoard& operator=(const StageBoard&) = delete;

  void enter(FaultStage stage);
  void mark(RankState state);  // done: removes the file when every local rank is done
  RankSlot slot(int32_t rank) const;
  int32_t rank() const { return rank_; }
  int32_t world() const { return world_; }
  const std::string& path() const { return path_; }
  // Whether `path` still names the file this board maps (not replaced since; not a link): the only file removed.
  bool is_file_at_path() const;

  // PeerWatch.
  std::string failed_peer() override;
  std::string describe_peers() override;
  void set_waiting(bool waiting) override;
  void give_up() override { mark(RankState::gave_up); }

 private:
  // The peers (other than `except`) that run and do not wait: the ones that hang, in words.
  std::string hanging_peers(int32_t except) const;
  struct Mapping;
  std::string path_;
  int32_t world_ = 0, rank_ = 0, local_world_ = 0;
  uint64_t job_ = 0;  // the job's tag (0: none)
  Mapping* map_ = nullptr;
};

// The board file for this process (rules above); "" when there is none.
std::string stage_board_path(const ProcessEnv& env);
// The job's identity, the same in all its ranks and another in the next job: DMOE_JOB_ID when set, else
// DMOE_RENDEZVOUS under dmoe launch (a directory of its own per launch), PMIX_NAMESPACE (or Open MPI's job id)
// under mpirun, SLURM_JOB_ID.SLURM_STEP_ID under srun; "" when there is none.
std::string stage_board_job(const ProcessEnv& env);

// The process's board, used by every communicator of a multi-rank job for its lifetime:
// attach_stage_board opens it on first use (registered as the process's PeerWatch) and marks this rank
// running; detach_stage_board marks it done when the last user leaves cleanly, failed when it leaves while
// an exception unwinds (`failing`). Null / no-op for a single rank, without a path, or when the board could
// not be opened (a warning on stderr, once). At process exit a rank still running is marked exited, and the
// last rank of the node to exit removes the file.
StageBoard* attach_stage_board(const ProcessEnv& env);
void detach_stage_board(bool failing);
// The board opened above, or null.
StageBoard* process_stage_board();
// What process exit does for the board (a rank still running is marked exited; the last rank of the node
// removes the file), for a process about to end without its exit handlers (std::_Exit).
void finish_stage_board();

// attach_stage_board for an object's lifetime (the GPU communicators of make_gpu_comm hold one).
class StageBoardUse {
 public:
  explicit StageBoardUse(const ProcessEnv& env) : board_(attach_stage_board(env)) {}
  ~StageBoardUse();
  StageBoardUse(const StageBoardUse&) = delete;
  StageBoardUse& operator=(const StageBoardUse&) = delete;
  StageBoard* board() const { return board_; }

 private:
  StageBoard* board_;
};

}  // namespace dmoe
