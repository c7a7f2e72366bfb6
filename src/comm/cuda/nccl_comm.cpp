// nccl_comm.cpp — NcclComm: the Comm interface over NCCL, one GPU per rank.
//
// The communicator is non-blocking (created so in init_nccl, so that waiting for absent ranks is
// bounded): every NCCL call may return ncclInProgress, after which wait_nccl_ready polls until the
// work is enqueued on the stream. A failed or timed-out communicator is aborted and unusable.
#include <cuda_runtime.h>
#include <nccl.h>

#include <vector>

#include "comm/comm.hpp"
#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/comm_detail.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"

namespace dmoe {

namespace {

using comm_detail::wait_nccl_ready;

ncclDataType_t nccl_reduce_type(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::bf16: break;
  }
  DMOE_FAIL("NcclComm allreduce_sum: {} is not supported (sums in bf16 lose precision and differ from the CPU "
            "engine); reduce in f32, f64, i32 or i64", dtype_name(dtype));
}

class NcclComm final : public Comm {
 public:
  NcclComm(ncclComm_t comm, int32_t rank, int32_t world) : comm_(comm), rank_(rank), world_(world) {}
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ~NcclComm() override {
    cuda::free_quietly(token_);
    if (!comm_) return;  // aborted after an error
    // Finalize flushes outstanding work; bounded like every other wait. A destructor must not throw.
    const ncclResult_t finalize = ncclCommFinalize(comm_);
    bool ok = finalize == ncclSuccess || finalize == ncclInProgress;
    if (ok) {
      try {
        wait_nccl_ready(comm_, "NcclComm destruction");
      } catch (const Error&) {
        return;  // wait_nccl_ready aborted the communicator
      }
    }
    if (ok)
      ncclCommDestroy(comm_);
    else
      ncclCommAbort(comm_);
  }

  int32_t rank() const override { return rank_; }
  int32_t world() const override { return world_; }
  const char* name() const override { return "nccl"; }

  void alltoallv(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts, DType dtype,
                 Stream stream) override {
    require_usable();
    const size_t elem = dtype_size(dtype);
    auto* s = static_cast<cudaStream_t>(stream);
    // Bytes, not elements: every dtype moves the same way, bf16 included.
    std::vector<size_t> send_off(size_t(world_) + 1, 0), recv_off(size_t(world_) + 1, 0);
    for (int32_t p = 0; p < world_; ++p) {
      DMOE_REQUIRE(send_counts[p] >= 0 && recv_counts[p] >= 0,
                   "NcclComm alltoallv: negative count for peer {} (send {}, recv {})", p, send_counts[p],
                   recv_counts[p]);
      send_off[p + 1] = send_off[p] + size_t(send_counts[p]) * elem;
      recv_off[p + 1] = recv_off[p] + size_t(recv_counts[p]) * elem;
    }
    check(ncclGroupStart(), "ncclGroupStart");
    for (int32_t p = 0; p < world_; ++p) {
      const size_t send_bytes = send_off[p + 1] - send_off[p];
      const size_t recv_bytes = recv_off[p + 1] - recv_off[p];
      if (send_bytes > 0)
        check(ncclSend(static_cast<const char*>(send) + send_off[p], send_bytes, ncclUint8, p, comm_, s), "ncclSend");
      if (recv_bytes > 0)
        check(ncclRecv(static_cast<char*>(recv) + recv_off[p], recv_bytes, ncclUint8, p, comm_, s), "ncclRecv");
    }
    issued(ncclGroupEnd(), "alltoallv (ncclGroupEnd)");
  }

  void allreduce_sum(void* data, int64_t count, DType dtype, Stream stream) override {
    require_usable();
    const ncclDataType_t type = nccl_reduce_type(dtype);
    if (count <= 0) return;
    issued(ncclAllReduce(data, data, size_t(count), type, ncclSum, comm_, static_cast<cudaStream_t>(stream)),
           "allreduce_sum");
  }

  void broadcast(void* data, int64_t count, DType dtype, int32_t root, Stream stream) override {
    require_usable();
    DMOE_REQUIRE(root >= 0 && root < world_, "NcclComm broadcast: root {} outside [0, {})", root, world_);
    if (count <= 0) return;
    issued(ncclBroadcast(data, data, size_t(count) * dtype_size(dtype), ncclUint8, root, comm_,
                         static_cast<cudaStream_t>(stream)),
           "broadcast");
  }

  // A one-element all-reduce orders the stream after every rank's arrival; the wait makes it a host
  // barrier too (the ThreadComm meaning).
  void barrier(Stream stream) override {
    require_usable();
    auto* s = static_cast<cudaStream_t>(stream);
    if (!token_) DMOE_COMM_CHECK_CUDA(cudaMalloc(&token_, sizeof(int32_t)));
    DMOE_COMM_CHECK_CUDA(cudaMemsetAsync(token_, 0, sizeof(int32_t), s));
    issued(ncclAllReduce(token_, token_, 1, ncclInt32, ncclSum, comm_, s), "barrier");
    comm_detail::wait_stream(s, fmt::format("NcclComm barrier on rank {}", rank_), comm_);
  }

 private:
  void require_usable() const {
    DMOE_REQUIRE(comm_, "NcclComm on rank {} was aborted after an earlier error; create a new communicator", rank_);
  }

  void check(ncclResult_t status, const char* what) {
    if (status == ncclSuccess || status == ncclInProgress) return;
    const std::string detail = ncclGetLastError(comm_);
    abort_comm();
    DMOE_FAIL("NcclComm {} on rank {} failed: {} ({})", what, rank_, ncclGetErrorString(status), detail);
  }

  // After the call that enqueues work: wait (bounded) until NCCL has queued it on the stream.
  void issued(ncclResult_t status, const char* what) {
    check(status, what);
    try {
      wait_nccl_ready(comm_, fmt::format("NcclComm {} on rank {}", what, rank_));
    } catch (const Error&) {
      comm_ = nullptr;  // aborted by wait_nccl_ready
      throw;
    }
  }

  void abort_comm() {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  ncclComm_t comm_;
  int32_t rank_, world_;
  void* token_ = nullptr;  // [1] i32 device scratch of barrier()
};

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(const ProcessEnv& env) {
  ncclComm_t comm = init_nccl(env);
  return std::make_unique<NcclComm>(comm, env.rank, env.world);
}

}  // namespace dmoe
