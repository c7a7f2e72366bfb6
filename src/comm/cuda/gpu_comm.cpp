// gpu_comm.cpp — choosing between NcclComm and NvshmemComm (rules in gpu_comm.hpp).
#include "comm/cuda/gpu_comm.hpp"

#include <cstdlib>
#include <string>

#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/comm_detail.hpp"
#include "comm/stage_board.hpp"
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
    DMOE_REQUIRE_INPUT(flag == 0 || flag == 1, "DMOE_SHARED_GPUS={} is invalid; allowed: 0 or 1", flag);
    if (why) *why = fmt::format("DMOE_SHARED_GPUS={}", flag);
    return flag == 1;
  }
  const bool shared = env.local_world > visible_devices;
  if (why)
    *why = fmt::format("{} ranks on this node {} {} visible GPU(s)", env.local_world, shared ? "exceed" : "fit on",
                       visible_devices);
  return shared;
}

CommKind resolve_comm_kind(CommKind requested, bool gpus_shared, bool one_node, bool peers_connected) {
  if (requested != CommKind::automatic) return requested;
  if (gpus_shared) return CommKind::nvshmem;
  return one_node && peers_connected ? CommKind::nvshmem : CommKind::nccl;
}

namespace {

// Whether this rank sees two or more GPUs and every pair of them can reach each other peer-to-peer.
bool visible_gpus_peer_connected(int visible) {
  if (visible < 2) return false;
  for (int a = 0; a < visible; ++a)
    for (int b = 0; b < visible; ++b) {
      if (a == b) continue;
      int can = 0;
      DMOE_COMM_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) return false;
    }
  return true;
}

// A communicator of a multi-rank job with the process's stage board attached for its lifetime
// (comm/stage_board.hpp): its peers see this rank's stages and whether it failed. Members end in reverse
// order: the communicator first (its destruction waits, bounded, on the peers), then the board use.
class WatchedComm final : public Comm {
 public:
  WatchedComm(const ProcessEnv& env, std::unique_ptr<Comm> inner) : use_(env), inner_(std::move(inner)) {}
  int32_t rank() const override { return inner_->rank(); }
  int32_t world() const override { return inner_->world(); }
  const char* name() const override { return inner_->name(); }
  void alltoallv(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts, DType dtype,
                 Stream stream) override {
    inner_->alltoallv(send, send_counts, recv, recv_counts, dtype, stream);
  }
  void allreduce_sum(void* data, int64_t count, DType dtype, Stream stream) override {
    inner_->allreduce_sum(data, count, dtype, stream);
  }
  void broadcast(void* data, int64_t count, DType dtype, int32_t root, Stream stream) override {
    inner_->broadcast(data, count, dtype, root, stream);
  }
  void barrier(Stream stream) override { inner_->barrier(stream); }

 private:
  StageBoardUse use_;
  std::unique_ptr<Comm> inner_;
};

std::unique_ptr<Comm> watched(const ProcessEnv& env, std::unique_ptr<Comm> comm) {
  if (env.world <= 1) return comm;
  return std::make_unique<WatchedComm>(env, std::move(comm));
}

}  // namespace

std::unique_ptr<Comm> make_gpu_comm(const ProcessEnv& env, CommKind kind, size_t max_bytes_per_peer,
                                    cudaStream_t stream) {
  if (env.world > 1) error_rank() = env.rank;
  select_device(env);
  int visible = 0;
  DMOE_COMM_CHECK_CUDA(cudaGetDeviceCount(&visible));
  std::string why;
  const bool shared = env.world > 1 && gpus_are_shared(env, visible, &why);
  if (kind == CommKind::automatic && env.world > 1)
    kind = resolve_comm_kind(kind, shared, env.local_world == env.world, visible_gpus_peer_connected(visible));
  else if (kind == CommKind::automatic)
    kind = CommKind::nccl;  // one rank: no peers; the cheaper set-up
  if (kind == CommKind::nccl) {
    DMOE_REQUIRE(!shared, "the NCCL communicator needs one GPU per rank, but ranks share GPUs here ({}): NCCL refuses "
                 "two ranks on one GPU (\"Duplicate GPU detected\"). Use the NVSHMEM communicator (auto picks it), "
                 "or give every rank its own GPU", why);
    return watched(env, make_nccl_comm(env));
  }
  return watched(env, make_nvshmem_comm(env, max_bytes_per_peer, stream));
}

}  // namespace dmoe
