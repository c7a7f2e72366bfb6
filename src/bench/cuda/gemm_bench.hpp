// gemm_bench.hpp — times dmoe's own grouped GEMM (cuda/grouped_gemm_sm90.cu) on the expert products of a
// layer config, one variant of the kernel after another in the same process and on the same data, so
// that kernel changes are compared without the run-to-run spread of whole-layer timings.
//
//   rows per expert: uniform top-k routing of T tokens over E experts (seeded), all experts local (W = 1)
//   up    = x [N, H] · w1_e^T (and w3_e^T for SwiGLU), activation fused, only h stored (inference)
//   down  = h [N, I] · w2_e^T
//   F     = 2·N·n·k per product (n = 2I for SwiGLU's up), TFLOP/s = F / median time
//   loads = what the kernel's tiles read per k-block, summed (A rows + B rows, 128 bytes each), over time:
//           the L2-to-SM traffic the kernel asks for (NN: A rows + B's BN columns × 64 k-rows, the same bytes)
// Every timing: GpuTimer (warm-up, L2 flushed before each call, CUDA events, median).
#pragma once

#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "bench/stats.hpp"
#include "core/config.hpp"
#include "cuda/common.hpp"

namespace dmoe::bench {

struct GemmVariant {
  std::string name;  // as parsed: e.g. "b256" = 256-column tiles; "b128s" = 128 columns, staged epilogue
  cuda::Sm90Tuning tuning;
};

// "b256,b256s,b128": b = tile width, s = staged / d = direct epilogue; for
// measurement only (wrong results): E = stores left out, M = products and stores left out.
std::vector<GemmVariant> parse_gemm_variants(const std::string& list);

struct GemmBenchRow {
  std::string variant, product;
  Stats stats;
  double flop = 0;
  double tile_load_bytes = 0;
  double min_bytes = 0;  // --wgrad: the DRAM bytes the product must move at least (0: not given)
};

// The config's up and down products for each variant; with `square`, also one 8192×8192×8192 product
// (a single group) per variant, to set the kernel beside cuBLAS's GEMM ceiling.
std::vector<GemmBenchRow> bench_expert_gemms(const MoeConfig& config, const std::vector<GemmVariant>& variants,
                                             bool square, cudaStream_t stream, uint64_t seed = 1);

// The backward pass's input-gradient products (same routing):
//   dh = dout [N, H] · w2_e [H, I]                       (n = I, k = H)
//   dx = dpre1 [N, I] · w1_e [I, H] (+ dpre3 · w3_e)     (n = H, k = I; SwiGLU: one product over 2I)
// for each variant on the own kernel's NN variant (sm90_grouped_gemm_nn; variants with the staged
// epilogue are left out: it is not built for NN), and as expert_ffn_backward runs them on cuBLAS
// (gemm_rm_grouped: grouped call or loop as DMOE_EXPERT_GEMM / its size policy picks; SwiGLU's dx as two
// calls, the second with beta = 1), variant "cublas". All timed in the same rounds.
std::vector<GemmBenchRow> bench_dgrad_gemms(const MoeConfig& config, const std::vector<GemmVariant>& variants,
                                            cudaStream_t stream, uint64_t seed = 1);

// The backward pass's weight gradients (same routing), as expert_ffn_backward runs them:
//   dw1 = dpre1^T [I, N] · x [N, H]   (m = I, n = H; dw3 likewise with dpre3 for SwiGLU)
//   dw2 = dout^T [H, N] · h [N, I]    (m = H, n = I)
// each stored (the first backward after zero_grads) and accumulated, on the sm90 kernel
// (sm90_grouped_wgrad; accumulating also as L2 reductions, variant "sm90red"), the mma.sync kernel
// (grouped_wgrad, variant "mma") and one cublasGemmEx per expert (variant "cublas"). All timed in the
// same rounds. F = 2·N·m·n; min_bytes = N·(m + n)·2 (operands once) + Le·m·n·4 (C written) (+ the same
// read when accumulating), Le = experts with rows.
std::vector<GemmBenchRow> bench_wgrad_gemms(const MoeConfig& config, cudaStream_t stream, uint64_t seed = 1);

}  // namespace dmoe::bench
