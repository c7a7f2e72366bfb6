// flash_test_util.hpp — what the Flash GPU tests share (test_flash.cpp, test_flash_backward.cpp): the case
// table's row, its name and config, and this process's communicator.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/config.hpp"

namespace dmoe {
namespace {

// The communicator of this process: local at W = 1, NVSHMEM otherwise (Flash's symmetric memory lives in its
// heap, which must hold Flash's regions too).
std::unique_ptr<Comm> make_flash_test_comm(const ProcessEnv& env, cudaStream_t stream) {
  if (env.world == 1) return make_local_comm();
  if (!std::getenv("DMOE_NVSHMEM_MIN_HEAP")) ::setenv("DMOE_NVSHMEM_MIN_HEAP", "4G", 1);
  return make_gpu_comm(env, CommKind::nvshmem, size_t(1) << 20, stream);
}

struct FlashCase {
  Activation act;
  double capacity_factor;
  int64_t tokens;
  int32_t experts, top_k;
};

std::string case_name(const FlashCase& fc) {
  return std::string(activation_name(fc.act)) + (fc.capacity_factor > 0 ? "_capacity" : "_dropless") + "_T" +
         std::to_string(fc.tokens) + "_E" + std::to_string(fc.experts) + "_k" + std::to_string(fc.top_k);
}

MoeConfig flash_case_config(const FlashCase& fc, int32_t world) {
  MoeConfig c;
  c.tokens = fc.tokens;
  c.hidden = 256;
  c.ffn = 384;  // SwiGLU: 3 up column tiles of 128; relu/gelu: 1.5 tiles of 256 (a partial tile)
  c.experts = fc.experts;
  c.top_k = fc.top_k;
  c.activation = fc.act;
  c.dtype = DType::bf16;
  c.capacity_factor = fc.capacity_factor;
  c.world = world;
  return c;
}

}  // namespace
}  // namespace dmoe
