// bench_gpu.hpp — the GPU part of `dmoe bench layer` (compiled when CUDA is available).
#pragma once

#include <string>

#include "core/config.hpp"
#include "core/dtype.hpp"
#include "engine/moe_engine.hpp"
#include "model/mixtral_config.hpp"

namespace dmoe::cli {

struct GpuBenchArgs {
  MoeConfig config;        // world is taken from the process environment
  std::string config_name;
  std::string comm = "auto";  // auto | nccl | nvshmem
  bool backward = false;
  bool peers = false;         // run bench/peers.py (PyTorch) on the same data, W = 1 only
  std::string python = "python3";
  std::string json_path;
  int check_tokens = 8;
  int warmup = 5;
  int min_iterations = 20;
  int batch_row_multiple = 1;  // EpOptions::batch_row_multiple (tile padding of the experts' batches)
  bool alltoall = false;       // W > 1: also time the dispatch's all-to-all alone (bandwidth per GPU)
  bool flash = false;          // also time the Flash kernel beside EP (bf16)
  EngineKind engine = EngineKind::ep;  // the engine timed: ep, or flash alone
  std::string gemm_variants = "b256,b256s,b256E,b256M,b128";  // dmoe bench gemm (bench/cuda/gemm_bench.hpp)
  bool gemm_square = false;    // dmoe bench gemm: also an 8192^3 product per variant
  bool gemm_dgrad = false;     // dmoe bench gemm: also the backward's input-gradient products (NN) vs cuBLAS
  bool gemm_wgrad = false;     // dmoe bench gemm: also the backward's weight gradients: sm90, mma.sync, cuBLAS
};

// True when a CUDA device is visible to this process.
// `dmoe bench model`: a whole Mixtral model's training step on this GPU (bench/cuda/model_bench.hpp).
struct ModelBenchArgs {
  MixtralConfig config;
  std::string config_name, json_path;
  int64_t batch = 8, seq = 1024;
  DType dtype = DType::bf16;
  int warmup = 2, repeat = 5;
  bool bf16_expert_grads = true;  // bf16 model: the experts' gradients in bf16 (CudaMixtralModel)
};

bool gpu_available();
int run_gpu_layer_bench(const GpuBenchArgs& args);
// `dmoe bench gemm`: the own grouped GEMM's variants on the config's expert products (one GPU, W = 1).
int run_gpu_gemm_bench(const GpuBenchArgs& args);
int run_gpu_model_bench(const ModelBenchArgs& args);

}  // namespace dmoe::cli
