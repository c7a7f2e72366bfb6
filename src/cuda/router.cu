// cuda/router.cu — the gate on the GPU (twin of cpu/router.cpp): logits through cuBLAS, then one thread
// per token running the shared per-token math of core/routing.hpp (softmax_row<float>, topk_row,
// gate_weights_row<float>); the auxiliary-loss statistics; and the backward pass.
//
// Accumulation is f32 where the CPU uses fp64 (softmax sums, gradient sums); the auxiliary statistics
// are summed in fp64 as on the CPU, in a fixed order (per chunk of tokens, then chunks in order), so every
// result is deterministic run to run.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "core/routing.hpp"
#include "core/routing_block.hpp"
#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"
#include "cuda/warp_routing.cuh"

namespace dmoe::cuda {

namespace {

// NaN logits leave topk_row without a valid choice (id -1): then no probability is read (it would be
// probs[-1]), the weights become NaN and the send plan reports the invalid expert id.
__device__ __forceinline__ void write_gate_weights(const float* prob_row, const int32_t* id_row, int32_t top_k,
                                                   bool renormalize, float* weights) {
  for (int32_t j = 0; j < top_k; ++j)
    if (id_row[j] < 0) {
      for (int32_t i = 0; i < top_k; ++i) weights[i] = __int_as_float(0x7fc00000);
      return;
    }
  gate_weights_row<float>(prob_row, id_row, top_k, renormalize, weights);
}

}  // namespace

namespace {

// ---- softmax + top-k ------------------------------------------------------------------------------

constexpr int kTopkThreads = 128;                   // one token per thread
constexpr size_t kTopkStagedMaxBytes = 136 * 1024;  // see router_topk

struct RouterTopkParams {
  const float* logits;  // [T, E]
  float* probs;         // [T, E]
  int32_t* ids;         // [T, k]
  float* weights;       // [T, k]
  float* lse;           // [T]
  int64_t tokens;
  int32_t experts;
  int32_t top_k;
  bool renormalize;
};

// kStaged: the block stages its tokens' logits in shared memory with coalesced loads (the rows of
// consecutive tokens are one contiguous range), thread i runs token i's routing out of shared memory, and
// the probabilities go back with coalesced stores. Rows are padded to E+1 floats so that the threads, which
// walk their rows in lockstep, hit distinct banks. Otherwise each thread works on its rows in global
// memory directly (L1/L2 serve the repeated passes); see router_topk for the choice.
template <bool kStaged>
__global__ void __launch_bounds__(kTopkThreads)
    router_topk_kernel(const __grid_constant__ RouterTopkParams p) {
  const int32_t num_experts = p.experts;
  const int64_t t0 = int64_t(blockIdx.x) * kTopkThreads;
  const int32_t n = int32_t(min(int64_t(kTopkThreads), p.tokens - t0));
  if constexpr (!kStaged) {
    if (int32_t(threadIdx.x) < n) {
      const int64_t t = t0 + threadIdx.x;
      const float* logit_row = p.logits + t * num_experts;
      float* prob_row = p.probs + t * num_experts;
      int32_t* id_row = p.ids + t * p.top_k;
      p.lse[t] = softmax_row<float>(logit_row, num_experts, prob_row);
      topk_row(logit_row, num_experts, p.top_k, id_row);
      write_gate_weights(prob_row, id_row, p.top_k, p.renormalize, p.weights + t * p.top_k);
    }
    return;
  } else {
    extern __shared__ float smem[];
    const int32_t stride = num_experts + 1;
    float* s_logits = smem;                         // [128 tokens, E+1]
    float* s_probs = smem + kTopkThreads * stride;  // [128 tokens, E+1]
    const int32_t elements = n * num_experts;       // < 2^31: it fits in shared memory

    const float* g_logits = p.logits + t0 * num_experts;
    for (int32_t i = threadIdx.x; i < elements; i += blockDim.x)
      s_logits[(i / num_experts) * stride + i % num_experts] = g_logits[i];
    __syncthreads();

    if (int32_t(threadIdx.x) < n) {
      const int64_t t = t0 + threadIdx.x;
      const float* logit_row = s_logits + threadIdx.x * stride;
      float* prob_row = s_probs + threadIdx.x * stride;
      int32_t* id_row = p.ids + t * p.top_k;
      p.lse[t] = softmax_row<float>(logit_row, num_experts, prob_row);
      topk_row(logit_row, num_experts, p.top_k, id_row);
      write_gate_weights(prob_row, id_row, p.top_k, p.renormalize, p.weights + t * p.top_k);
    }
    __syncthreads();

    float* g_probs = p.probs + t0 * num_experts;
    for (int32_t i = threadIdx.x; i < elements; i += blockDim.x)
      g_probs[i] = s_probs[(i / num_experts) * stride + i % num_experts];
  }
}

// One warp per token (the version above runs one thread per token: at T = 4096 that is 32 blocks, and each
// thread walks E logits k+2 times; measured 118 µs at E = 128, k = 8 on H200): cuda/warp_routing.cuh, the
// same code as Flash's gate. A row holding a NaN takes the per-thread code (lane 0).
constexpr int kTopkWarpThreads = 256;
constexpr int kTopkWarpTokens = kTopkWarpThreads / kWarp;

template <int kSlots>
__global__ void __launch_bounds__(kTopkWarpThreads)
    router_topk_warp_kernel(const __grid_constant__ RouterTopkParams p) {
  const int lane = lane_id();
  const int64_t t = int64_t(blockIdx.x) * kTopkWarpTokens + threadIdx.x / kWarp;
  if (t >= p.tokens) return;  // whole warps leave together
  const int32_t num_experts = p.experts;
  const float* logit_row = p.logits + t * num_experts;
  float* prob_row = p.probs + t * num_experts;
  int32_t* id_row = p.ids + t * p.top_k;

  WarpRoutingRow<kSlots> r;
  if (!warp_softmax_stats(logit_row, num_experts, lane, r)) {
    if (lane == 0) {
      p.lse[t] = softmax_row<float>(logit_row, num_experts, prob_row);
      topk_row(logit_row, num_experts, p.top_k, id_row);
      write_gate_weights(prob_row, id_row, p.top_k, p.renormalize, p.weights + t * p.top_k);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kSlots; ++i)
    if (lane + kWarp * i < num_experts) prob_row[lane + kWarp * i] = r.ex[i] / r.sum;
  if (lane == 0) p.lse[t] = r.max_logit + logf(r.sum);
  warp_topk(r, num_experts, p.top_k, lane, [&](int32_t j, int32_t best, float) {
    if (lane == 0) id_row[j] = best;
  });
  __syncwarp();  // probabilities and ids written by the other lanes are read below
  if (lane == 0) write_gate_weights(prob_row, id_row, p.top_k, p.renormalize, p.weights + t * p.top_k);
}

// ---- auxiliary-loss statistics ---------------------------------------------------------------------

constexpr int kAuxThreads = 256;

struct AuxPartialsParams {
  const float* probs;  // [T, E]
  const float* lse;    // [T]
  const int32_t* ids;  // [T, k]
  int64_t tokens;
  int32_t experts;
  int32_t top_k;
  int64_t chunk_tokens;     // tokens per block
  double* prob_partial;     // [chunks, E]
  double* z_partial;        // [chunks]
  int32_t* assigned;        // [E], zeroed before the launch
  int32_t* bad_assignment;  // first (t*k + j) with an id outside [0, E); preset to INT32_MAX
};

// Block c sums its chunk of tokens: one thread per expert down the columns of probs (coalesced across
// the experts), a fixed-shape tree for lse², and integer counts of the ids (exact in any order).
__global__ void __launch_bounds__(kAuxThreads)
    aux_partials_kernel(const __grid_constant__ AuxPartialsParams p) {
  __shared__ double s_z[kAuxThreads];
  const int64_t t_begin = int64_t(blockIdx.x) * p.chunk_tokens;
  const int64_t t_end = min(p.tokens, t_begin + p.chunk_tokens);

  for (int32_t e = threadIdx.x; e < p.experts; e += blockDim.x) {
    double sum = 0;
    for (int64_t t = t_begin; t < t_end; ++t) sum += double(p.probs[t * p.experts + e]);
    p.prob_partial[int64_t(blockIdx.x) * p.experts + e] = sum;
  }

  double z = 0;
  for (int64_t t = t_begin + threadIdx.x; t < t_end; t += blockDim.x)
    z += double(p.lse[t]) * double(p.lse[t]);
  s_z[threadIdx.x] = z;
  __syncthreads();
  for (int width = kAuxThreads / 2; width > 0; width /= 2) {
    if (int(threadIdx.x) < width) s_z[threadIdx.x] += s_z[threadIdx.x + width];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.z_partial[blockIdx.x] = s_z[0];

  for (int64_t a = t_begin * p.top_k + threadIdx.x; a < t_end * p.top_k; a += blockDim.x) {
    const int32_t e = p.ids[a];
    if (e >= 0 && e < p.experts)
      atomicAdd(&p.assigned[e], 1);
    else
      atomicMin(p.bad_assignment, int32_t(a));
  }
}

struct AuxReduceParams {
  const double* prob_partial;  // [chunks, E]
  const double* z_partial;     // [chunks]
  int64_t chunks;
  int32_t experts;
  double* prob_sum;  // [E]
  double* z_sum;     // [1]
};

// One warp per expert (and one more for z): lane l sums chunks l, l + 32, ... in order, then a fixed
// shuffle tree adds the lanes — the same order, so the same sum, on every run. (One thread per expert
// walking all chunks was a chain of dependent loads: 43 µs for 256 chunks on H200.)
__global__ void __launch_bounds__(kAuxThreads) aux_reduce_kernel(const __grid_constant__ AuxReduceParams p) {
  const int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;  // expert, or E for z
  const int lane = lane_id();
  if (w > p.experts) return;
  double sum = 0;
  if (w < p.experts) {
    for (int64_t c = lane; c < p.chunks; c += kWarp) sum += p.prob_partial[c * p.experts + w];
  } else {
    for (int64_t c = lane; c < p.chunks; c += kWarp) sum += p.z_partial[c];
  }
  sum = warp_sum(sum);
  if (lane == 0) {
    if (w < p.experts)
      p.prob_sum[w] = sum;
    else
      *p.z_sum = sum;
  }
}

// ---- backward through gate weights and softmax -----------------------------------------------------

constexpr int kBackwardThreads = 256;
constexpr int kBackwardWarps = kBackwardThreads / kWarp;

struct RouterTopkBackwardParams {
  const float* probs;     // [T, E]
  const int32_t* ids;     // [T, k]
  const float* weights;   // [T, k]
  const float* dweights;  // [T, k]
  float* dlogits;         // [T, E]
  const float* lb_grad;   // [E] lb_scale · f_e, or null
  const float* lse;       // [T] or null
  float z_scale;
  int64_t tokens;
  int32_t experts;
  int32_t top_k;
  bool renormalize;
};

// dL/dp at expert ids[j] coming from the gate weights:
//   renormalised w_j = p_{i_j} / S:  (dw_j − Σ_l dw_l·w_l) / S;  otherwise dw_j.
__device__ __forceinline__ float gate_grad(const RouterTopkBackwardParams& p, float dw, float dw_dot_w,
                                           float sum_p) {
  return p.renormalize ? (dw - dw_dot_w) / sum_p : dw;
}

// One warp per token. With dp_e = lb_e + g(e) (g from the gate weights, nonzero at the k chosen experts)
// and s = Σ_e dp_e·p_e, the softmax backward is dlogit_e = p_e·(dp_e − s) + z·p_e: the lanes first write
// p_e·(lb_e − s) + z·p_e over all experts, then add p_e·g(e) at the chosen ones.
__global__ void __launch_bounds__(kBackwardThreads)
    router_topk_backward_kernel(const __grid_constant__ RouterTopkBackwardParams p) {
  const int lane = lane_id();
  const int64_t num_warps = int64_t(gridDim.x) * kBackwardWarps;
  const int32_t num_experts = p.experts, k = p.top_k;
  for (int64_t t = int64_t(blockIdx.x) * kBackwardWarps + threadIdx.x / kWarp; t < p.tokens; t += num_warps) {
    const float* prob = p.probs + t * num_experts;
    const int32_t* id = p.ids + t * k;
    const float* w = p.weights + t * k;
    const float* dw = p.dweights + t * k;
    float* dlogit = p.dlogits + t * num_experts;

    float sum_p = 0.f, dw_dot_w = 0.f;
    for (int32_t j = lane; j < k; j += kWarp) {
      sum_p += prob[id[j]];
      dw_dot_w += dw[j] * w[j];
    }
    sum_p = warp_sum(sum_p);
    dw_dot_w = warp_sum(dw_dot_w);

    float s = 0.f;
    for (int32_t j = lane; j < k; j += kWarp) s += gate_grad(p, dw[j], dw_dot_w, sum_p) * prob[id[j]];
    if (p.lb_grad != nullptr)
      for (int32_t e = lane; e < num_experts; e += kWarp) s += p.lb_grad[e] * prob[e];
    s = warp_sum(s);

    const float z = p.lse != nullptr ? p.z_scale * p.lse[t] : 0.f;
    for (int32_t e = lane; e < num_experts; e += kWarp) {
      const float lb = p.lb_grad != nullptr ? p.lb_grad[e] : 0.f;
      dlogit[e] = prob[e] * (lb - s) + z * prob[e];
    }
    __syncwarp();  // the chosen experts' entries were written by other lanes
    // NOTE: a token lists an expert at most once (topk_row), so these updates never collide.
    for (int32_t j = lane; j < k; j += kWarp) {
      const int32_t e = id[j];
      dlogit[e] += prob[e] * gate_grad(p, dw[j], dw_dot_w, sum_p);
    }
    __syncwarp();
  }
}

}  // namespace

template <typename T>
void router_logits(const T* x, const T* wg, float* logits, int64_t tokens, int64_t hidden, int32_t experts,
                   const CudaContext& ctx) {
  // logits [T, E] = x [T, H] · wg [E, H]^T
  gemm_rm(ctx.cublas, false, true, tokens, experts, hidden, 1.f, x, cuda_data_type<T>(), hidden, wg,
          cuda_data_type<T>(), hidden, 0.f, logits, CUDA_R_32F, experts);
}

void router_topk(const float* logits, float* probs, int32_t* ids, float* weights, float* lse, int64_t tokens,
                 int32_t experts, int32_t top_k, bool renormalize, cudaStream_t stream) {
  DMOE_CUDA_REQUIRE(top_k >= 1 && top_k <= experts,
                    "router_topk: top_k = %d is invalid; need 1 <= top_k <= %d", top_k, experts);
  if (tokens <= 0) return;
  RouterTopkParams p{logits, probs, ids, weights, lse, tokens, experts, top_k, renormalize};
  if (experts <= 8 * kWarp) {
    const unsigned warp_blocks = unsigned((tokens + kTopkWarpTokens - 1) / kTopkWarpTokens);
    if (experts <= kWarp)
      router_topk_warp_kernel<1><<<warp_blocks, kTopkWarpThreads, 0, stream>>>(p);
    else if (experts <= 2 * kWarp)
      router_topk_warp_kernel<2><<<warp_blocks, kTopkWarpThreads, 0, stream>>>(p);
    else if (experts <= 4 * kWarp)
      router_topk_warp_kernel<4><<<warp_blocks, kTopkWarpThreads, 0, stream>>>(p);
    else
      router_topk_warp_kernel<8><<<warp_blocks, kTopkWarpThreads, 0, stream>>>(p);
    DMOE_CHECK_LAUNCH();
    return;
  }
  // Staging takes two padded [128, E+1] f32 tiles per block, which caps the blocks per SM as E grows.
  // Measured on H200 (T = 32768, k = 8; ms staged / unstaged): E=8 0.015/0.014, E=64 0.054/0.125,
  // E=128 0.206/0.244, E=256 0.676/0.481. So: staged up to E = 135 (136 KiB), unstaged beyond.
  const size_t bytes = size_t(2) * kTopkThreads * (size_t(experts) + 1) * sizeof(float);
  const unsigned blocks = unsigned((tokens + kTopkThreads - 1) / kTopkThreads);
  if (bytes <= kTopkStagedMaxBytes) {
    if (bytes > 48 * 1024)  // above the default dynamic shared-memory limit: opt in
      DMOE_CHECK_CUDA(cudaFuncSetAttribute(router_topk_kernel<true>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    router_topk_kernel<true><<<blocks, kTopkThreads, bytes, stream>>>(p);
  } else {
    router_topk_kernel<false><<<blocks, kTopkThreads, 0, stream>>>(p);
  }
  DMOE_CHECK_LAUNCH();
}

namespace {

struct AuxShape {
  int64_t chunk_tokens = 0, chunks = 0;
  size_t partial_bytes = 0;  // prob partials [chunks, E] f64
  size_t z_bytes = 0;        // z partials [chunks] f64
};

AuxShape aux_shape(int64_t tokens, int32_t experts) {
  DMOE_CUDA_REQUIRE(experts >= 1, "router_aux_partials: experts = %d; must be >= 1", experts);
  AuxShape s;
  // At most ~1024 chunks of at least 32 tokens: enough blocks to fill the GPU, few partials to reduce.
  s.chunk_tokens = std::max<int64_t>(32, (tokens + 1023) / 1024);
  s.chunks = std::max<int64_t>(1, (tokens + s.chunk_tokens - 1) / s.chunk_tokens);
  s.partial_bytes = size_t(s.chunks) * experts * sizeof(double);
  s.z_bytes = size_t(s.chunks) * sizeof(double);
  return s;
}

// The partial sums' kernels; the results into `block` (core/routing_block.hpp's AuxPartialsBlock).
void launch_aux_partials(const AuxShape& sh, const float* probs, const float* lse, const int32_t* ids,
                         int64_t tokens, int32_t experts, int32_t top_k, double* prob_partial, double* z_partial,
                         void* block, const CudaContext& ctx) {
  int32_t* d_assigned = AuxPartialsBlock::assigned(block, experts);
  int32_t* d_bad = AuxPartialsBlock::bad(block, experts);
  DMOE_CHECK_CUDA(cudaMemsetAsync(d_assigned, 0, size_t(experts) * sizeof(int32_t), ctx.stream));
  // 0x7f7f7f7f: none; the block's padding after the word too (its readers copy whole blocks: initcheck).
  const size_t bad_and_pad = AuxPartialsBlock::bytes(experts) - size_t(reinterpret_cast<char*>(d_bad) -
                                                                       static_cast<char*>(block));
  DMOE_CHECK_CUDA(cudaMemsetAsync(d_bad, 0x7f, bad_and_pad, ctx.stream));
  AuxPartialsParams pp{probs, lse, ids, tokens, experts, top_k, sh.chunk_tokens, prob_partial, z_partial,
                       d_assigned, d_bad};
  aux_partials_kernel<<<unsigned(sh.chunks), kAuxThreads, 0, ctx.stream>>>(pp);
  DMOE_CHECK_LAUNCH();
  AuxReduceParams rp{prob_partial, z_partial, sh.chunks, experts, AuxPartialsBlock::prob_sum(block),
                     AuxPartialsBlock::z_sum(block, experts)};
  aux_reduce_kernel<<<grid_for(int64_t(experts + 1) * kWarp, kAuxThreads), kAuxThreads, 0, ctx.stream>>>(rp);
  DMOE_CHECK_LAUNCH();
}

}  // namespace

void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                                   int32_t experts, int32_t top_k, void* stats, const CudaContext& ctx) {
  const AuxShape sh = aux_shape(tokens, experts);
  ScratchLayout layout;
  const size_t off_prob_partial = layout.add(sh.partial_bytes);
  const size_t off_z_partial = layout.add(sh.z_bytes);
  char* ws = static_cast<char*>(ctx.workspace->reserve(layout.total(), ctx.stream));
  launch_aux_partials(sh, probs, lse, ids, tokens, experts, top_k, reinterpret_cast<double*>(ws + off_prob_partial),
                      reinterpret_cast<double*>(ws + off_z_partial), stats, ctx);
}

void router_aux_partials(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                         int32_t experts, int32_t top_k, double* prob_sum, double* assigned, double* z_sum,
                         const CudaContext& ctx) {
  const AuxShape sh = aux_shape(tokens, experts);
  // Scratch: the partials, then the block copied back to the host in one transfer.
  const size_t result_bytes = AuxPartialsBlock::bytes(experts);
  ScratchLayout layout;
  const size_t off_prob_partial = layout.add(sh.partial_bytes);
  const size_t off_z_partial = layout.add(sh.z_bytes);
  const size_t off_result = layout.add(result_bytes);
  char* ws = static_cast<char*>(ctx.workspace->reserve(layout.total(), ctx.stream));
  char* result = ws + off_result;
  launch_aux_partials(sh, probs, lse, ids, tokens, experts, top_k, reinterpret_cast<double*>(ws + off_prob_partial),
                      reinterpret_cast<double*>(ws + off_z_partial), result, ctx);

  std::vector<char> host(result_bytes);
  download_bounded(host.data(), result, result_bytes, ctx.stream, ctx.host_staging, "router_aux_partials: reading the statistics");
  const int32_t bad = AuxPartialsBlock::read_bad(host.data(), experts);
  if (bad != kNoBadAssignment) {
    int32_t id = 0;
    DMOE_CHECK_CUDA(cudaMemcpy(&id, ids + bad, sizeof(int32_t), cudaMemcpyDeviceToHost));
    fail(__FILE__, __LINE__, "router_aux_partials: token %d choice %d has expert id %d; allowed [0, %d)",
         bad / top_k, bad % top_k, id, experts);
  }
  AuxPartialsBlock::decode(host.data(), experts, prob_sum, assigned, z_sum);
}

void router_topk_backward(const float* probs, const int32_t* ids, const float* weights, const float* dweights,
                          float* dlogits, int64_t tokens, int32_t experts, int32_t top_k, bool renormalize,
                          const cpu::RouterAuxGrad& aux, const CudaContext& ctx) {
  if (tokens <= 0) return;
  float* lb_grad = nullptr;
  if (aux.expert_fraction != nullptr) {
    // ∂L_lb/∂p[t, e] = lb_scale · f_e, the same for every token: one [E] table.
    std::vector<float> host(experts);
    for (int32_t e = 0; e < experts; ++e) host[e] = float(aux.lb_scale * aux.expert_fraction[e]);
    lb_grad = static_cast<float*>(ctx.workspace->reserve(host.size() * sizeof(float), ctx.stream));
    upload_async(lb_grad, host.data(), host.size() * sizeof(float), ctx.stream);
  }
  RouterTopkBackwardParams p{probs,   ids,     weights, dweights,
                             dlogits, lb_grad, aux.lse, float(aux.z_scale),
                             tokens,  experts, top_k,   renormalize};
  router_topk_backward_kernel<<<grid_for(tokens, kBackwardWarps, int64_t(1) << 16), kBackwardThreads, 0,
                                ctx.stream>>>(p);
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void router_logits_backward(const T* x, const T* wg, const float* dlogits, float* dx, float* dwg,
                            int64_t tokens, int64_t hidden, int32_t experts, const CudaContext& ctx) {
  if (tokens <= 0 || hidden <= 0) return;
  if constexpr (std::is_same_v<T, float>) {
    // dx [T, H] += dlogits [T, E] · wg [E, H];  dwg [E, H] += dlogits^T · x [T, H]
    gemm_rm(ctx.cublas, false, false, tokens, hidden, experts, 1.f, dlogits, CUDA_R_32F, experts, wg,
            CUDA_R_32F, hidden, 1.f, dx, CUDA_R_32F, hidden);
    gemm_rm(ctx.cublas, true, false, experts, hidden, tokens, 1.f, dlogits, CUDA_R_32F, experts, x,
            CUDA_R_32F, hidden, 1.f, dwg, CUDA_R_32F, hidden);
  } else {
    // cuBLAS multiplies operands of one type only, and the gradients must stay f32: widen wg and x to
    // f32 (exact). x goes in chunks of tokens so the scratch stays within 64 MiB.
    const int64_t chunk = std::clamp<int64_t>((int64_t(16) << 20) / hidden, 1, tokens);
    ScratchLayout layout;
    const size_t off_wg = layout.add(size_t(experts) * hidden * sizeof(float));
    const size_t off_x = layout.add(size_t(chunk) * hidden * sizeof(float));
    char* ws = static_cast<char*>(ctx.workspace->reserve(layout.total(), ctx.stream));
    auto* wg32 = reinterpret_cast<float*>(ws + off_wg);  // [E, H]
    auto* x32 = reinterpret_cast<float*>(ws + off_x);    // [chunk, H]
    convert_to_f32(wg, wg32, int64_t(experts) * hidden, ctx.stream);
    gemm_rm(ctx.cublas, false, false, tokens, hidden, experts, 1.f, dlogits, CUDA_R_32F, experts, wg32,
            CUDA_R_32F, hidden, 1.f, dx, CUDA_R_32F, hidden);
    for (int64_t t0 = 0; t0 < tokens; t0 += chunk) {
      const int64_t n = std::min(chunk, tokens - t0);
      convert_to_f32(x + t0 * hidden, x32, n * hidden, ctx.stream);
      gemm_rm(ctx.cublas, true, false, experts, hidden, n, 1.f, dlogits + t0 * experts, CUDA_R_32F, experts,
              x32, CUDA_R_32F, hidden, 1.f, dwg, CUDA_R_32F, hidden);
    }
  }
}

#define DMOE_INSTANTIATE_ROUTER(T)                                                                           \
  template void router_logits<T>(const T*, const T*, float*, int64_t, int64_t, int32_t, const CudaContext&); \
  template void router_logits_backward<T>(const T*, const T*, const float*, float*, float*, int64_t,         \
                                          int64_t, int32_t, const CudaContext&);

DMOE_INSTANTIATE_ROUTER(float)
DMOE_INSTANTIATE_ROUTER(bf16)

}  // namespace dmoe::cuda
