// flow/no_cuda/cuda_executor_stub.cpp — the GPU executor in a build without CUDA (CMake compiles this instead of
// src/flow/cuda/): every entry point refuses with what to do instead.
#include "core/error.hpp"
#include "flow/cuda_executor.hpp"

namespace dmoe::flow {

namespace {
[[noreturn]] void refuse() {
  DMOE_FAIL_INPUT("the Flow GPU executor (--engine cuda) needs the CUDA engines, and this dmoe was built without CUDA "
                  "(DMOE_CUDA=OFF or no nvcc); use --engine cpu");
}
}  // namespace

struct CudaFlowExecutor::Impl {};
CudaFlowExecutor::CudaFlowExecutor(CudaMixtralModel&, Comm*) { refuse(); }
CudaFlowExecutor::~CudaFlowExecutor() = default;
ArComm CudaFlowExecutor::ar_comm() const { return ArComm::own; }
double CudaFlowExecutor::step(const TaskGraph&, const int32_t*, int64_t, int64_t, std::vector<CudaModelState>&,
                              std::vector<TraceEvent>*) {
  refuse();
}

std::unique_ptr<Comm> open_cuda_allreduce_comm(const Comm&) { refuse(); }

struct CudaFlowJob {};
CudaFlowSession::CudaFlowSession(const MixtralConfig&, const MixtralWeights&, DType, int64_t) { refuse(); }
CudaFlowSession::~CudaFlowSession() = default;
int32_t CudaFlowSession::rank() const { return 0; }
int32_t CudaFlowSession::world() const { return 1; }
ArComm CudaFlowSession::ar_comm() const { return ArComm::own; }
CudaFlowMeasurement CudaFlowSession::measure(const GraphSpec&, const int32_t*, int64_t, int64_t, int32_t,
                                             ResourceProbe*) {
  refuse();
}

}  // namespace dmoe::flow
