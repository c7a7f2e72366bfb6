// process_env.hpp — who this process is among the ranks of a job, read from the launcher's environment.
//
// One process per rank. The rank, the world size and the node-local placement come from whichever
// launcher started the process, tried in this order:
//   dmoe launch   DMOE_RANK, DMOE_WORLD, DMOE_LOCAL_RANK, DMOE_LOCAL_WORLD        launcher "dmoe-launch"
//   Open MPI      OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE           launcher "mpirun"
//   Slurm srun    SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, tasks per    launcher "srun"
//                 node; only with SLURM_STEP_ID (a job step): a batch script's own
//                 process has SLURM_PROCID and SLURM_NTASKS too, and is one process
//   PMI (Hydra)   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS            launcher "pmi"
//   none of them  rank 0 of 1                                                      launcher "single"
// dmoe launch is tried first because it may itself run inside an MPI or Slurm job: its children inherit
// those variables, but DMOE_* describe them.
//
// Host only: no CUDA here, so the CPU build and the launcher can use it.
#pragma once

#include <cstdint>
#include <string>

namespace dmoe {

struct ProcessEnv {
  int32_t rank = 0;         // in [0, world)
  int32_t world = 1;        // number of ranks in the job
  int32_t local_rank = 0;   // in [0, local_world): index among the ranks on this node
  int32_t local_world = 1;  // ranks on this node
  std::string launcher = "single";  // "dmoe-launch" | "mpirun" | "srun" | "pmi" | "single"
};

// Reads the environment (see above). Throws dmoe::Error naming the variable when a value is not an
// integer or breaks 0 <= rank < world, 0 <= local_rank < local_world <= world.
ProcessEnv detect_process_env();

// The GPU this rank should use: DMOE_DEVICE when set (dmoe launch sets it; must be in
// [0, device_count)), else local_rank % device_count. Throws when device_count < 1.
int32_t choose_device(const ProcessEnv& env, int32_t device_count);

// Parses an environment variable as a decimal int32 (the whole value, optional sign, no blanks).
// Returns false when the variable is unset; throws dmoe::Error naming the variable when it is malformed.
bool env_int32(const char* name, int32_t& value);

}  // namespace dmoe
