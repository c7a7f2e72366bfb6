// gpu_comm.cpp — choosing between NcclComm and NvshmemComm (rules in gpu_comm.hpp).
#include "comm/cuda/gpu_comm.hpp"

#include <cstdlib>
#include <string>

#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/comm_detail.hpp"
#include "core/error.hpp"

namespace dmoe {

CommKind parse_comm_kind(std::string_view text) {
  if (text == "auto" || text == "automatic") return CommKind::automatic;
  if (text == "nccl") return CommKind::nccl;
  if (text == "nvshmem") return CommKind::nvshmem;
  DMOE_FAIL("communicator '{}' is unknown: choose auto, nccl or nvshmem", text);
}

const char* comm_kind_name(CommKind kind) {
  switch (kind) {
    case CommKind::automatic: return "auto";
    case CommKind::nccl: return "nccl";
    case CommKind::nvshmem: return "nvshmem";
  }
  return "?";
}

bool gpus_are_shared(const ProcessEnv& env, int32_t visible_devices, std::string* why) {
  int32_t flag = 0;
  if (env_int32("DMOE_SHARED_GPUS", flag)) {
    DMOE_REQUIRE(flag == 0 || flag == 1, "DMOE_SHARED_GPUS={} is invalid: must be 0 or 1", flag);
    if (why) *why = fmt::format("DMOE_SHARED_GPUS={}", flag);
    return flag == 1;
  }
  const bool shared = env.local_world > visible_devices;
  if (why)
    *why = fmt::format("{} ranks on this node {} {} visible GPU(s)", env.local_world, shared ? "exceed" : "fit on",
                       visible_devices);
  return shared;
}

std::unique_ptr<Comm> make_gpu_comm(const ProcessEnv& env, CommKind kind, size_t max_bytes_per_peer,
                                    cudaStream_t stream) {
  if (env.world > 1) error_rank() = env.rank;
  select_device(env);
  int visible = 0;
  DMOE_COMM_CHECK_CUDA(cudaGetDeviceCount(&visible));
  std::string why;
  const bool shared = env.world > 1 && gpus_are_shared(env, visible, &why);
  if (kind == CommKind::automatic) kind = shared ? CommKind::nvshmem : CommKind::nccl;
  if (kind == CommKind::nccl) {
    DMOE_REQUIRE(!shared, "the NCCL communicator needs one GPU per rank, but ranks share GPUs here ({}): NCCL refuses "
                 "two ranks on one GPU (\"Duplicate GPU detected\"). Use the NVSHMEM communicator (auto picks it), "
                 "or give every rank its own GPU", why);
    return make_nccl_comm(env);
  }
  return make_nvshmem_comm(env, max_bytes_per_peer, stream);
}

}  // namespace dmoe
