// model/no_cuda/cuda_model_stub.cpp — the GPU model's entry points in a build without CUDA (CMake compiles this
// folder instead of model/cuda/): each one refuses with what to do instead.
#include <vector>

#include "core/error.hpp"
#include "model/mixtral.hpp"
#include "model/train_replica.hpp"

namespace dmoe {

std::unique_ptr<TrainReplica> make_cuda_replica(const MixtralConfig&, DType, const MixtralWeights&,
                                                const MixtralWeights&, const MixtralWeights&, int32_t, int64_t, bool) {
  DMOE_FAIL_INPUT("--engine cuda needs the CUDA engines, and this dmoe was built without CUDA (DMOE_CUDA=OFF or no "
                  "nvcc); use --engine cpu");
}
EvalResult run_cuda_model(const MixtralConfig&, const MixtralWeights&, const std::vector<int32_t>&, int64_t, int64_t,
                          DType, bool) {
  DMOE_FAIL_INPUT("--engine cuda needs the CUDA engines, and this dmoe was built without CUDA (DMOE_CUDA=OFF or no "
                  "nvcc); use --engine cpu");
}
bool cuda_grouped_bf16_wgrad() { return false; }
void cuda_job_size(int32_t* rank, int32_t* world) {
  *rank = 0;
  *world = 1;
}

}  // namespace dmoe
