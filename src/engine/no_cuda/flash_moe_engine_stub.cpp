// engine/no_cuda/flash_moe_engine_stub.cpp — a build without CUDA has no Flash engine: make_moe_engine refuses
// ep and flash before it gets here (moe_engine_unusable_reason); this says so again for a direct caller.
#include "core/error.hpp"
#include "engine/moe_engine.hpp"

namespace dmoe {

bool cuda_engines_built() { return false; }

std::unique_ptr<MoeEngine> make_flash_moe_engine(const MoeConfig&, Backend&, Comm&, bool) {
  DMOE_FAIL_INPUT("engine 'flash' needs the CUDA engines, and this dmoe was built without CUDA (DMOE_CUDA=OFF or no "
                  "nvcc); use engine 'cpu'");
}

}  // namespace dmoe
