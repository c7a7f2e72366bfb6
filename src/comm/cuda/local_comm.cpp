// local_comm.cpp — a communicator of one rank on one GPU: an all-to-all is a device copy, a reduction
// or broadcast leaves the data as it is. Lets single-process GPU runs use the same EpEngine code path
// without starting NCCL or NVSHMEM.
#include <cuda_runtime.h>

#include "comm/cuda/local_comm.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"

namespace dmoe {
namespace {

class LocalComm final : public Comm {
 public:
  int32_t rank() const override { return 0; }
  int32_t world() const override { return 1; }
  const char* name() const override { return "local"; }

  void alltoallv(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts, DType dtype,
                 Stream stream) override {
    DMOE_REQUIRE(send_counts[0] == recv_counts[0], "LocalComm alltoallv: sends {} elements but receives {}",
                 send_counts[0], recv_counts[0]);
    if (send_counts[0] > 0 && send != recv)
      DMOE_CHECK_CUDA(cudaMemcpyAsync(recv, send, size_t(send_counts[0]) * dtype_size(dtype), cudaMemcpyDefault,
                                      static_cast<cudaStream_t>(stream)));
  }
  void allreduce_sum(void*, int64_t, DType, Stream) override {}
  void broadcast(void*, int64_t, DType, int32_t root, Stream) override {
    DMOE_REQUIRE(root == 0, "LocalComm broadcast: root {} outside [0, 1)", root);
  }
  void barrier(Stream stream) override {
    cuda::wait_stream(static_cast<cudaStream_t>(stream), "local comm: barrier");
  }
};

}  // namespace

std::unique_ptr<Comm> make_local_comm() { return std::make_unique<LocalComm>(); }

}  // namespace dmoe
