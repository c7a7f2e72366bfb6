// process_env.cpp — detect_process_env(): rank, world and node placement from the launcher's variables.
#include "comm/process_env.hpp"

#include <charconv>
#include <cstdlib>
#include <string_view>

#include "core/error.hpp"

namespace dmoe {

namespace {

bool parse_int32(std::string_view text, int32_t& value) {
  if (!text.empty() && text.front() == '+') text.remove_prefix(1);
  if (text.empty()) return false;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size();
}

// Slurm writes tasks per node compressed: "4", "2(x3),1" = nodes 0..2 run 2 tasks, node 3 runs 1.
// Returns the count of node `node_idx`, or throws naming `variable` when the text does not parse.
int32_t slurm_tasks_on_node(const char* variable, std::string_view text, int32_t node_idx) {
  int32_t node = 0;
  std::string_view rest = text;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    int32_t tasks = 0, repeat = 1;
    const size_t paren = item.find("(x");
    bool ok = true;
    if (paren == std::string_view::npos) {
      ok = parse_int32(item, tasks);
    } else {
      ok = parse_int32(item.substr(0, paren), tasks) && item.back() == ')' &&
           parse_int32(item.substr(paren + 2, item.size() - paren - 3), repeat) && repeat >= 1;
    }
    DMOE_REQUIRE_INPUT(ok && tasks >= 1, "{}='{}' is malformed: expected counts like '4' or '2(x3),1'", variable,
                       text);
    if (node_idx < node + repeat) return tasks;
    node += repeat;
  }
  DMOE_FAIL_INPUT("{}='{}' lists {} nodes, but SLURM_NODEID is {}", variable, text, node, node_idx);
}

void validate(const ProcessEnv& e, const char* rank_var, const char* world_var, const char* local_rank_var,
              const char* local_world_var) {
  DMOE_REQUIRE_INPUT(e.world >= 1, "{}={} is invalid: the world size must be >= 1", world_var, e.world);
  DMOE_REQUIRE_INPUT(e.rank >= 0 && e.rank < e.world, "{}={} is invalid: must be in [0, {}) ({}={})", rank_var,
                     e.rank, e.world, world_var, e.world);
  DMOE_REQUIRE_INPUT(e.local_world >= 1 && e.local_world <= e.world,
                     "{}={} is invalid: must be in [1, {}] ({}={})", local_world_var, e.local_world, e.world,
                     world_var, e.world);
  DMOE_REQUIRE_INPUT(e.local_rank >= 0 && e.local_rank < e.local_world, "{}={} is invalid: must be in [0, {}) ({}={})",
                     local_rank_var, e.local_rank, e.local_world, local_world_var, e.local_world);
}

// Reads a required variable of a launcher whose other variables are present.
int32_t required(const char* name, const char* launcher_hint) {
  int32_t v = 0;
  DMOE_REQUIRE_INPUT(env_int32(name, v), "{} is not set, but other {} variables are: the launcher's environment is incomplete",
                     name, launcher_hint);
  return v;
}

}  // namespace

bool env_int32(const char* name, int32_t& value) {
  const char* text = std::getenv(name);
  if (!text) return false;
  DMOE_REQUIRE_INPUT(parse_int32(text, value), "{}='{}' is malformed: expected a decimal integer", name, text);
  return true;
}

ProcessEnv detect_process_env() {
  ProcessEnv e;
  int32_t v = 0;

  if (std::getenv("DMOE_RANK") || std::getenv("DMOE_WORLD")) {
    e.launcher = "dmoe-launch";
    e.rank = required("DMOE_RANK", "DMOE_*");
    e.world = required("DMOE_WORLD", "DMOE_*");
    // One node is all dmoe launch starts; without the local variables the ranks are all local.
    e.local_rank = env_int32("DMOE_LOCAL_RANK", v) ? v : e.rank;
    e.local_world = env_int32("DMOE_LOCAL_WORLD", v) ? v : e.world;
    validate(e, "DMOE_RANK", "DMOE_WORLD", "DMOE_LOCAL_RANK", "DMOE_LOCAL_WORLD");
    return e;
  }

  if (std::getenv("OMPI_COMM_WORLD_RANK")) {
    e.launcher = "mpirun";
    e.rank = required("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_*");
    e.world = required("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_*");
    e.local_rank = required("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_*");
    e.local_world = required("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_*");
    validate(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE");
    return e;
  }

  // Slurm's variables describe a launcher world only inside a job step, which srun starts and marks with
  // SLURM_STEP_ID (srun(1), OUTPUT ENVIRONMENT VARIABLES). A batch script's own process (sbatch(1): SLURM_PROCID,
  // SLURM_NTASKS = the job's --ntasks, SLURM_LOCALID, SLURM_TASKS_PER_NODE, but no SLURM_STEP_*) is one process
  // that srun would start the tasks from; read as a world of SLURM_NTASKS it would wait for ranks never started.
  if (std::getenv("SLURM_PROCID") && std::getenv("SLURM_STEP_ID")) {
    e.launcher = "srun";
    e.rank = required("SLURM_PROCID", "SLURM_*");
    // The step's task count and tasks per node: SLURM_NTASKS and SLURM_NTASKS_PER_NODE are the job's (inherited
    // from sbatch/salloc; larger when the step asked for fewer tasks). The job's are read only where a step's
    // variable is missing.
    const char* world_var = std::getenv("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
    e.world = required(world_var, "SLURM_*");
    e.local_rank = required("SLURM_LOCALID", "SLURM_*");
    const char* local_world_var = "SLURM_NTASKS_PER_NODE";
    if (!std::getenv("SLURM_STEP_TASKS_PER_NODE") && env_int32("SLURM_NTASKS_PER_NODE", v)) {
      e.local_world = v;
    } else {
      int32_t node_idx = 0;
      if (!env_int32("SLURM_NODEID", node_idx)) node_idx = 0;
      const char* per_node_var = std::getenv("SLURM_STEP_TASKS_PER_NODE") ? "SLURM_STEP_TASKS_PER_NODE"
                                                                          : "SLURM_TASKS_PER_NODE";
      const char* per_node = std::getenv(per_node_var);
      DMOE_REQUIRE_INPUT(per_node, "srun environment without tasks per node: none of SLURM_STEP_TASKS_PER_NODE, "
                         "SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE is set");
      e.local_world = slurm_tasks_on_node(per_node_var, per_node, node_idx);
      local_world_var = per_node_var;
    }
    validate(e, "SLURM_PROCID", world_var, "SLURM_LOCALID", local_world_var);
    return e;
  }

  if (std::getenv("PMI_RANK")) {
    e.launcher = "pmi";
    e.rank = required("PMI_RANK", "PMI_*");
    e.world = required("PMI_SIZE", "PMI_*");
    // Hydra (MPICH's mpiexec) publishes node-local placement as MPI_LOCALRANKID / MPI_LOCALNRANKS;
    // without them assume one node.
    e.local_rank = env_int32("MPI_LOCALRANKID", v) ? v : e.rank;
    e.local_world = env_int32("MPI_LOCALNRANKS", v) ? v : e.world;
    validate(e, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
    return e;
  }

  return e;  // single process: rank 0 of 1
}

int32_t choose_device(const ProcessEnv& env, int32_t device_count) {
  DMOE_REQUIRE_INPUT(device_count >= 1, "rank {}: no GPU is visible (device count {}); a GPU communicator needs one",
                     env.rank, device_count);
  int32_t device = 0;
  if (env_int32("DMOE_DEVICE", device)) {
    DMOE_REQUIRE_INPUT(device >= 0 && device < device_count, "DMOE_DEVICE={} is invalid: must be in [0, {}) ({} GPUs visible)",
                       device, device_count, device_count);
    return device;
  }
  return env.local_rank % device_count;
}

}  // namespace dmoe
