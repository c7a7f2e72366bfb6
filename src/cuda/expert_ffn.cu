// cuda/expert_ffn.cu — the grouped expert FFN over a rank's local experts (twin of cpu/expert_ffn.cpp,
// for all experts at once), forward and backward.
//
//   forward:   pre1 = x·w1^T, pre3 = x·w3^T (SwiGLU)     grouped GEMM, one problem per expert with rows
//              h = act(pre1) or silu(pre1)·pre3          one elementwise kernel over all rows
//              out = h·w2^T                              grouped GEMM
//   backward:  dh = dout·w2                              grouped GEMM (storage type)
//              dw2 += dout^T·h                           per expert (bf16 inputs, f32 accumulator)
//              dpre1, dpre3 from dh, pre1, pre3          one elementwise kernel (dpre1 overwrites dh)
//              dw1 += dpre1^T·x, dw3 += dpre3^T·x        per expert (as dw2)
//              (accumulate = false: the weight gradients are written, not added: beta = 0)
//              dx = dpre1·w1 (+ dpre3·w3)                grouped GEMM; the second adds with beta = 1
//                                                        (own NN kernel: one product over both, k = 2·I)
//
// GEMMs go through gemm_rm_grouped (cuda/gemm.cpp): one cublasGemmGroupedBatchedEx call for many small
// expert products (A, B and C of one type, 16-byte aligned), else a loop of cublasGemmEx, one call per
// expert with rows (faster for large products: on H200 the grouped call reached ~330 TFLOP/s where the
// loop reached ~840). The forward's bf16 products take dmoe's own Hopper kernel where auto prefers it
// (grouped_gemm_sm90.cu). The weight gradients of bf16 experts take dmoe's grouped weight-gradient kernel
// (one launch per product for all experts: TMA + wgmma on sm_90, grouped_wgrad_sm90.cu, else mma.sync,
// grouped_wgrad.cu) where DMOE_WGRAD picks it, else the cuBLAS loop: the grouped API has no bf16 × bf16 →
// f32 form. Every GEMM accumulates in f32 (CUBLAS_COMPUTE_32F; no TF32 for f32 storage).
//
// The input-gradient products (dh, dx) of bf16 experts take the own kernel's NN variant (B MN-major:
// the weights as stored) where DMOE_DGRAD prefers it (auto by default; gemm.cpp).
//
// Stored intermediates (pre1, pre3, h, dh/dpre1, dpre3, dx) have the storage type, as on the CPU with
// bf16 rounding; for bf16 on cuBLAS the SwiGLU dx is rounded twice (after dpre1·w1, then after adding
// dpre3·w3), on the own NN kernel once.
#include <algorithm>
#include <vector>

#include "cuda/common.hpp"
#include "cuda/activation.cuh"
#include "cuda/device_utils.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kThreads = 256;
template <typename T>
struct ActForwardParams {
  const T* pre1;  // [count]
  const T* pre3;  // [count] (SwiGLU) or null
  T* h;           // [count]
  int64_t count;  // rows · I
};

// Grid-stride over packs of N elements.
template <typename T, Activation A, int N>
__global__ void __launch_bounds__(kThreads)
    act_forward_kernel(const __grid_constant__ ActForwardParams<T> p) {
  const int64_t packs = p.count / N;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += stride) {
    float a[N], out[N];
    load_f32<N>(p.pre1 + i * N, a);
    if constexpr (A == Activation::swiglu) {
      float b[N];
      load_f32<N>(p.pre3 + i * N, b);
#pragma unroll
      for (int j = 0; j < N; ++j) out[j] = act_value<A>(a[j]) * b[j];
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) out[j] = act_value<A>(a[j]);
    }
    store_f32<N>(p.h + i * N, out);
  }
}

template <typename T>
struct ActBackwardParams {
  const T* dh;    // [count]
  const T* pre1;  // [count]
  const T* pre3;  // [count] (SwiGLU) or null
  T* dpre1;       // [count]; may be dh itself (every element is read before it is written)
  T* dpre3;       // [count] (SwiGLU) or null
  int64_t count;
};

template <typename T, Activation A, int N>
__global__ void __launch_bounds__(kThreads)
    act_backward_kernel(const __grid_constant__ ActBackwardParams<T> p) {
  const int64_t packs = p.count / N;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < packs; i += stride) {
    float g[N], a[N], d1[N];
    load_f32<N>(p.dh + i * N, g);
    load_f32<N>(p.pre1 + i * N, a);
    if constexpr (A == Activation::swiglu) {
      float b[N], d3[N];
      load_f32<N>(p.pre3 + i * N, b);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        // h = silu(p1)·p3:  dp1 = dh·p3·silu'(p1),  dp3 = dh·silu(p1)
        d1[j] = g[j] * b[j] * act_derivative<A>(a[j]);
        d3[j] = g[j] * act_value<A>(a[j]);
      }
      store_f32<N>(p.dpre3 + i * N, d3);
    } else {
#pragma unroll
      for (int j = 0; j < N; ++j) d1[j] = g[j] * act_derivative<A>(a[j]);
    }
    store_f32<N>(p.dpre1 + i * N, d1);
  }
}

template <typename T>
constexpr int kPack = int(16 / sizeof(T));

template <typename T>
bool packable(int64_t count, std::initializer_list<const void*> pointers) {
  if (count % kPack<T> != 0) return false;
  for (const void* p : pointers)
    if (p != nullptr && !is_aligned(p, 16)) return false;
  return true;
}

// Instantiates kernel<T, A, N> for the run-time activation and pack width.
template <typename T, template <typename, Activation, int> class Launch, typename Params>
void launch_activation(Activation activation, bool packed, const Params& p, int64_t count,
                       cudaStream_t stream) {
  const unsigned blocks = grid_for(packed ? count / kPack<T> : count, kThreads, 8192);
  switch (activation) {
    case Activation::relu:
      packed ? Launch<T, Activation::relu, kPack<T>>::run(p, blocks, stream)
             : Launch<T, Activation::relu, 1>::run(p, blocks, stream);
      break;
    case Activation::gelu:
      packed ? Launch<T, Activation::gelu, kPack<T>>::run(p, blocks, stream)
             : Launch<T, Activation::gelu, 1>::run(p, blocks, stream);
      break;
    case Activation::swiglu:
      packed ? Launch<T, Activation::swiglu, kPack<T>>::run(p, blocks, stream)
             : Launch<T, Activation::swiglu, 1>::run(p, blocks, stream);
      break;
  }
  DMOE_CHECK_LAUNCH();
}

template <typename T, Activation A, int N>
struct ForwardLaunch {
  static void run(const ActForwardParams<T>& p, unsigned blocks, cudaStream_t stream) {
    act_forward_kernel<T, A, N><<<blocks, kThreads, 0, stream>>>(p);
  }
};

template <typename T, Activation A, int N>
struct BackwardLaunch {
  static void run(const ActBackwardParams<T>& p, unsigned blocks, cudaStream_t stream) {
    act_backward_kernel<T, A, N><<<blocks, kThreads, 0, stream>>>(p);
  }
};

void check_offsets(const int64_t* expert_offsets, int32_t local_experts, const char* stage) {
  DMOE_CUDA_REQUIRE(local_experts >= 0, "%s: local_experts = %d; must be >= 0", stage, local_experts);
  DMOE_CUDA_REQUIRE(expert_offsets[0] >= 0, "%s: expert_offsets[0] = %lld; must be >= 0", stage,
                    (long long)expert_offsets[0]);
  for (int32_t e = 0; e < local_experts; ++e)
    DMOE_CUDA_REQUIRE(expert_offsets[e + 1] >= expert_offsets[e],
                      "%s: expert_offsets[%d] = %lld < expert_offsets[%d] = %lld; offsets must not decrease",
                      stage, e + 1, (long long)expert_offsets[e + 1], e, (long long)expert_offsets[e]);
}

}  // namespace

template <typename T>
void expert_ffn_forward(const T* x, const T* w1, const T* w3, const T* w2, T* pre1, T* pre3, T* h, T* out,
                        const int64_t* expert_offsets, int32_t local_experts, int64_t hidden, int64_t ffn,
                        Activation activation, const CudaContext& ctx) {
  check_offsets(expert_offsets, local_experts, "expert_ffn_forward");
  const bool swiglu = activation == Activation::swiglu;
  DMOE_CUDA_REQUIRE(!swiglu || w3 != nullptr, "expert_ffn_forward: SwiGLU needs w3");
  DMOE_CUDA_REQUIRE(!swiglu || (pre1 == nullptr) == (pre3 == nullptr),
                    "expert_ffn_forward: pre1 and pre3 are both kept or both null (inference)");
  const int64_t row_begin = expert_offsets[0];
  const int64_t rows = expert_offsets[local_experts] - row_begin;
  if (rows == 0 || hidden == 0 || ffn == 0) return;
  // Inference (pre1 null): nothing is kept for the backward pass. The own kernel then stores only h;
  // the cuBLAS path still needs the pre-activations between its GEMMs and the activation pass: scratch.
  const bool keep = pre1 != nullptr;
  int64_t active = 0;  // experts with rows
  for (int32_t e = 0; e < local_experts; ++e) active += expert_offsets[e + 1] > expert_offsets[e];

  // bf16 on Hopper: dmoe's own grouped GEMM (one persistent kernel over all experts' tiles) where the
  // policy in gemm.cpp prefers it for this size of expert product. Its up-projection also applies the
  // activation in the epilogue (SwiGLU: gate and up products in the same tile), so no activation pass.
  bool own_gemm = false;
  GroupedGemmNT up, g2;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    up = {x, w1, pre1, expert_offsets, local_experts, ffn, hidden, h, activation, swiglu ? w3 : nullptr,
          swiglu ? pre3 : nullptr};
    g2 = {h, w2, out, expert_offsets, local_experts, hidden, ffn};
    const double mean_macs = double(rows) * double(hidden) * double(ffn) / double(active);
    own_gemm = prefer_own_grouped_gemm(mean_macs) && sm90_grouped_gemm_usable(up) && sm90_grouped_gemm_usable(g2);
  }

  ScratchLayout layout;
  const size_t off_pointers = layout.add(grouped_pointer_bytes(active));
  const size_t off_sm90 = layout.add(sm90_grouped_gemm_scratch_bytes(local_experts));
  const size_t pre_bytes = keep || own_gemm ? 0 : size_t(rows) * ffn * sizeof(T);
  const size_t off_pre1 = layout.add(pre_bytes);
  const size_t off_pre3 = layout.add(swiglu ? pre_bytes : 0);
  char* ws = static_cast<char*>(ctx.workspace->reserve(layout.total(), ctx.stream));
  void* pointers = ws + off_pointers;
  const cudaDataType_t type = cuda_data_type<T>();
  // Row r of the batch is row r - row_base of pre1 / pre3 (row_base = 0 when they are the caller's).
  const int64_t row_base = keep ? 0 : row_begin;
  if (!keep && !own_gemm) {
    pre1 = reinterpret_cast<T*>(ws + off_pre1);
    if (swiglu) pre3 = reinterpret_cast<T*>(ws + off_pre3);
  }

  const int64_t weight_size = ffn * hidden;  // elements of one expert's w1, w3 or w2
  std::vector<GemmProblem> up1, up3, down;   // experts with rows only
  for (int32_t e = 0; e < local_experts && !own_gemm; ++e) {
    const int64_t r0 = expert_offsets[e], n = expert_offsets[e + 1] - r0;
    if (n == 0) continue;
    const int64_t p0 = (r0 - row_base) * ffn;
    // pre1 [n, I] = x [n, H] · w1_e [I, H]^T (pre3 likewise);  out [n, H] = h [n, I] · w2_e [H, I]^T
    up1.push_back({n, ffn, hidden, x + r0 * hidden, w1 + e * weight_size, pre1 + p0});
    if (swiglu) up3.push_back({n, ffn, hidden, x + r0 * hidden, w3 + e * weight_size, pre3 + p0});
    down.push_back({n, hidden, ffn, h + r0 * ffn, w2 + e * weight_size, out + r0 * hidden});
  }

  if (own_gemm) {
    sm90_grouped_gemm(ctx, ws + off_sm90, up);
  } else {
    gemm_rm_grouped(ctx, pointers, false, true, hidden, hidden, ffn, 1.f, 0.f, type, type, type, up1);
    if (swiglu)
      gemm_rm_grouped(ctx, pointers, false, true, hidden, hidden, ffn, 1.f, 0.f, type, type, type, up3);
    const int64_t count = rows * ffn;
    const int64_t p0 = (row_begin - row_base) * ffn;
    ActForwardParams<T> ap{pre1 + p0, swiglu ? pre3 + p0 : nullptr, h + row_begin * ffn, count};
    launch_activation<T, ForwardLaunch>(activation, packable<T>(count, {ap.pre1, ap.pre3, ap.h}), ap, count,
                                        ctx.stream);
  }

  if (own_gemm)
    sm90_grouped_gemm(ctx, ws + off_sm90, g2);
  else
    gemm_rm_grouped(ctx, pointers, false, true, ffn, ffn, hidden, 1.f, 0.f, type, type, type, down);
}

namespace {

// The products of expert_ffn_forward_device_offsets: the fused up projection, then the down projection.
GroupedGemmNT up_gemm_device_offsets(const bf16* x, const bf16* w1, const bf16* w3, bf16* pre1, bf16* pre3, bf16* h,
                                     const int64_t* offsets, int64_t rows, int32_t local_experts, int64_t hidden,
                                     int64_t ffn, Activation activation) {
  const bool swiglu = activation == Activation::swiglu;
  GroupedGemmNT up{x, w1, pre1, offsets, local_experts, ffn, hidden, h, activation, swiglu ? w3 : nullptr,
                   swiglu ? pre3 : nullptr};
  up.offsets_on_device = true;
  up.rows = rows;
  return up;
}

GroupedGemmNT down_gemm_device_offsets(const bf16* h, const bf16* w2, bf16* out, const int64_t* offsets, int64_t rows,
                                       int32_t local_experts, int64_t hidden, int64_t ffn) {
  GroupedGemmNT down{h, w2, out, offsets, local_experts, hidden, ffn};
  down.offsets_on_device = true;
  down.rows = rows;
  return down;
}

}  // namespace

bool expert_ffn_forward_takes_device_offsets(const void* x, const void* w1, const void* w3, const void* w2,
                                             const void* pre1, const void* pre3, const void* h, const void* out,
                                             int64_t rows, int32_t local_experts, int64_t hidden, int64_t ffn,
                                             Activation activation) {
  if (rows <= 0 || local_experts <= 0 || hidden <= 0 || ffn <= 0) return false;
  const double mean_macs = double(rows) * double(hidden) * double(ffn) / double(std::min<int64_t>(rows, local_experts));
  if (!prefer_own_grouped_gemm_without_counts(mean_macs)) return false;
  // Null pre-activations: inference, which the own kernel's fused epilogue handles (h only).
  auto b = [](const void* p) { return static_cast<const bf16*>(p); };
  auto m = [](const void* p) { return const_cast<bf16*>(static_cast<const bf16*>(p)); };
  const int64_t probe[2] = {0, rows};  // usable() reads only the shapes and pointers, not the offsets
  GroupedGemmNT up = up_gemm_device_offsets(b(x), b(w1), b(w3), m(pre1), m(pre3), m(h), probe, rows, local_experts,
                                            hidden, ffn, activation);
  GroupedGemmNT down = down_gemm_device_offsets(b(h), b(w2), m(out), probe, rows, local_experts, hidden, ffn);
  return sm90_grouped_gemm_usable(up) && sm90_grouped_gemm_usable(down);
}

void expert_ffn_forward_device_offsets(const bf16* x, const bf16* w1, const bf16* w3, const bf16* w2, bf16* pre1,
                                       bf16* pre3, bf16* h, bf16* out, const int64_t* expert_offsets, int64_t rows,
                                       int32_t local_experts, int64_t hidden, int64_t ffn, Activation activation,
                                       const CudaContext& ctx) {
  const bool swiglu = activation == Activation::swiglu;
  DMOE_CUDA_REQUIRE(!swiglu || w3 != nullptr, "expert_ffn_forward_device_offsets: SwiGLU needs w3");
  DMOE_CUDA_REQUIRE(!swiglu || (pre1 == nullptr) == (pre3 == nullptr),
                    "expert_ffn_forward_device_offsets: pre1 and pre3 are both kept or both null (inference)");
  DMOE_CUDA_REQUIRE(expert_ffn_forward_takes_device_offsets(x, w1, w3, w2, pre1, pre3, h, out, rows, local_experts,
                                                            hidden, ffn, activation),
                    "expert_ffn_forward_device_offsets: the own Hopper grouped GEMM cannot run this call (needs an "
                    "sm_90 GPU, a build for sm_90a, H and I multiples of 8, 16-byte aligned buffers; rows = %lld, "
                    "H = %lld, I = %lld; or DMOE_EXPERT_GEMM forces cuBLAS)", (long long)rows, (long long)hidden,
                    (long long)ffn);
  // Both products read the offsets on the device; each lays out its tile table in the same scratch in turn
  // (stream order), so one reservation serves both.
  void* scratch = ctx.workspace->reserve(sm90_grouped_gemm_scratch_bytes(local_experts), ctx.stream);
  sm90_grouped_gemm(ctx, scratch,
                    up_gemm_device_offsets(x, w1, w3, pre1, pre3, h, expert_offsets, rows, local_experts, hidden, ffn,
                                           activation));
  sm90_grouped_gemm(ctx, scratch, down_gemm_device_offsets(h, w2, out, expert_offsets, rows, local_experts, hidden, ffn));
}

template <typename T>
void expert_ffn_backward(const T* x, const T* w1, const T* w3, const T* w2, const T* pre1, const T* pre3,
                         const T* h, const T* dout, T* dx, void* dw1, void* dw3, void* dw2, bool dw_bf16,
                         const int64_t* expert_offsets, int32_t local_experts, int64_t hidden, int64_t ffn,
                         Activation activation, bool accumulate, const CudaContext& ctx) {
  check_offsets(expert_offsets, local_experts, "expert_ffn_backward");
  const bool swiglu = activation == Activation::swiglu;
  DMOE_CUDA_REQUIRE(!swiglu || (w3 != nullptr && pre3 != nullptr && dw3 != nullptr),
                    "expert_ffn_backward: SwiGLU needs w3, pre3 and dw3");
  DMOE_CUDA_REQUIRE(!dw_bf16 || (std::is_same_v<T, bf16> && !accumulate),
                    "expert_ffn_backward: bf16 weight gradients need bf16 weights and accumulate = false");
  const size_t dw_elem = dw_bf16 ? sizeof(bf16) : sizeof(float);
  // Expert e's gradient in dw (float or bf16 elements).
  auto at = [&](void* dw, int64_t element) { return static_cast<char*>(dw) + size_t(element) * dw_elem; };
  const int64_t row_begin = expert_offsets[0];
  const int64_t rows = expert_offsets[local_experts] - row_begin;
  const int64_t weight_size = ffn * hidden;
  if (!accumulate) {
    // Overwrite: the products below write (beta = 0) the experts that have rows; the others get zeros.
    for (int32_t e = 0; e < local_experts; ++e) {
      if (expert_offsets[e + 1] > expert_offsets[e]) continue;
      for (void* dw : {dw1, dw3, dw2})
        if (dw != nullptr)
          DMOE_CHECK_CUDA(cudaMemsetAsync(at(dw, e * weight_size), 0, size_t(weight_size) * dw_elem, ctx.stream));
    }
  }
  if (rows == 0 || hidden == 0 || ffn == 0) return;
  const float beta_w = accumulate ? 1.f : 0.f;

  // Scratch: dh [rows, I] (overwritten by dpre1), dpre3 [rows, I] (SwiGLU), grouped pointer arrays.
  int64_t active = 0;
  for (int32_t e = 0; e < local_experts; ++e) active += expert_offsets[e + 1] > expert_offsets[e];
  ScratchLayout layout;
  const size_t off_dh = layout.add(size_t(rows) * ffn * sizeof(T));
  const size_t off_dpre3 = layout.add(swiglu ? size_t(rows) * ffn * sizeof(T) : 0);
  const size_t off_pointers = layout.add(grouped_pointer_bytes(active));
  const size_t off_wgrad = layout.add(std::is_same_v<T, bf16> ? std::max(grouped_wgrad_scratch_bytes(local_experts),
                                                                         sm90_grouped_wgrad_scratch_bytes(local_experts))
                                                               : 0);
  const size_t off_dgrad = layout.add(std::is_same_v<T, bf16> ? sm90_grouped_gemm_scratch_bytes(local_experts) : 0);
  char* ws = static_cast<char*>(ctx.workspace->reserve(layout.total(), ctx.stream));
  T* dh = reinterpret_cast<T*>(ws + off_dh);  // row r of the batch is dh row r - row_begin
  T* dpre1 = dh;
  T* dpre3 = swiglu ? reinterpret_cast<T*>(ws + off_dpre3) : nullptr;
  void* pointers = ws + off_pointers;

  std::vector<GemmProblem> dh_p, dw2_p, dw1_p, dw3_p, dx1_p, dx3_p;
  for (int32_t e = 0; e < local_experts; ++e) {
    const int64_t r0 = expert_offsets[e], n = expert_offsets[e + 1] - r0;
    if (n == 0) continue;                       // no rows: nothing to add to this expert's weight gradients
    const int64_t s0 = (r0 - row_begin) * ffn;  // expert's first element in dh / dpre1 / dpre3
    // dh [n, I] = dout [n, H] · w2_e [H, I]
    dh_p.push_back({n, ffn, hidden, dout + r0 * hidden, w2 + e * weight_size, dh + s0});
    // dw2_e [H, I] += dout^T [H, n] · h [n, I]
    dw2_p.push_back({hidden, ffn, n, dout + r0 * hidden, h + r0 * ffn, at(dw2, e * weight_size)});
    // dw1_e [I, H] += dpre1^T [I, n] · x [n, H]  (dw3 likewise)
    dw1_p.push_back({ffn, hidden, n, dpre1 + s0, x + r0 * hidden, at(dw1, e * weight_size)});
    if (swiglu) dw3_p.push_back({ffn, hidden, n, dpre3 + s0, x + r0 * hidden, at(dw3, e * weight_size)});
    // dx [n, H] = dpre1 [n, I] · w1_e [I, H]  (+ dpre3 · w3_e)
    dx1_p.push_back({n, hidden, ffn, dpre1 + s0, w1 + e * weight_size, dx + r0 * hidden});
    if (swiglu) dx3_p.push_back({n, hidden, ffn, dpre3 + s0, w3 + e * weight_size, dx + r0 * hidden});
  }
  const cudaDataType_t type = cuda_data_type<T>();

  // The weight gradients of bf16 experts: one launch per product of dmoe's own kernel where it runs and
  // DMOE_WGRAD picks it (gemm.cpp: the TMA + wgmma sm90_grouped_wgrad on sm_90, else the mma.sync
  // grouped_wgrad; cuBLAS has no grouped bf16 × bf16 → f32 form, its path is one call per expert).
  // c_g [m, n] (+)= a_g^T · b_g over the experts' rows (a and b indexed like the offsets, from a_first / 0).
  // Generic, so that it is instantiated only for bf16 (the kernels' input type).
  // c: f32 elements, or bf16 where dw_bf16 (then stored, never accumulated: checked above).
  auto wgrad_call = [&](const auto* a, int64_t a_first, int64_t m, const auto* b, int64_t n, void* c) {
    GroupedWgrad g;
    g.a = a;
    g.b = b;
    if (dw_bf16)
      g.c_bf16 = static_cast<__nv_bfloat16*>(c);
    else
      g.c = static_cast<float*>(c);
    g.row_offsets = expert_offsets;
    g.groups = local_experts;
    g.m = m;
    g.n = n;
    g.lda = m;
    g.ldb = n;
    g.a_first_row = a_first;
    g.c_group_stride = weight_size;
    g.accumulate = accumulate;
    return g;
  };
  WgradKernel wgrad_kernel = WgradKernel::cublas;
  if constexpr (std::is_same_v<T, bf16>) {
    // f32 gradients: any of the kernels; bf16 gradients: the sm90 kernel or cuBLAS (the mma.sync kernel stores f32
    // only; the bounds: gemm.cpp).
    const double mean_macs = double(hidden) * double(ffn) * double(rows) / double(std::max<int64_t>(active, 1));
    std::vector<GroupedWgrad> calls{wgrad_call(dout, 0, hidden, h, ffn, dw2),
                                    wgrad_call(dpre1, row_begin, ffn, x, hidden, dw1)};
    if (swiglu) calls.push_back(wgrad_call(dpre3, row_begin, ffn, x, hidden, dw3));
    wgrad_kernel = pick_wgrad_kernel(mean_macs, calls);
  }
  auto wgrad = [&](const T* a, int64_t a_first, int64_t m, const T* b, int64_t n, void* c,
                   const std::vector<GemmProblem>& loop_problems) {
    if constexpr (std::is_same_v<T, bf16>) {
      if (wgrad_kernel == WgradKernel::sm90)
        return sm90_grouped_wgrad(ctx, ws + off_wgrad, wgrad_call(a, a_first, m, b, n, c));
      if (wgrad_kernel == WgradKernel::mma) return grouped_wgrad(ctx, ws + off_wgrad, wgrad_call(a, a_first, m, b, n, c));
    }
    gemm_rm_grouped(ctx, pointers, true, false, m, n, n, 1.f, beta_w, type, type, dw_bf16 ? type : CUDA_R_32F,
                    loop_problems);
  };

  // The input-gradient products of bf16 experts on the own kernel's NN variant (B = the weights as stored,
  // MN-major) where DMOE_DGRAD prefers it (auto by default, gemm.cpp) and it can run. Offsets
  // rebased to the batch's first row, so that A and C both start there (dh, dpre1 and dpre3 start at
  // row_begin). SwiGLU's dx is one product over both halves (dpre1·w1 + dpre3·w3, one rounding) where
  // cuBLAS adds the second with beta = 1.
  bool own_dgrad = false;
  std::vector<int64_t> rebased;
  if constexpr (std::is_same_v<T, bf16>) {
    const double mean_macs = double(rows) * double(hidden) * double(ffn) / double(std::max<int64_t>(active, 1));
    if (prefer_own_dgrad(mean_macs)) {
      rebased.resize(size_t(local_experts) + 1);
      for (int32_t e = 0; e <= local_experts; ++e) rebased[e] = expert_offsets[e] - row_begin;
      const GroupedGemmNN dh_g{dout + row_begin * hidden, w2, dh, rebased.data(), local_experts, ffn, hidden};
      const GroupedGemmNN dx_g{dpre1, w1, dx + row_begin * hidden, rebased.data(), local_experts, hidden, ffn,
                               swiglu ? dpre3 : nullptr, swiglu ? w3 : nullptr};
      own_dgrad = sm90_grouped_gemm_nn_usable(dh_g) && sm90_grouped_gemm_nn_usable(dx_g);
    }
  }
  auto dgrad_own = [&](const T* a, const T* b, const T* a2, const T* b2, T* c, int64_t n, int64_t k) {
    if constexpr (std::is_same_v<T, bf16>)
      sm90_grouped_gemm_nn(ctx, ws + off_dgrad, GroupedGemmNN{a, b, c, rebased.data(), local_experts, n, k, a2, b2});
  };

  if (own_dgrad)
    dgrad_own(dout + row_begin * hidden, w2, nullptr, nullptr, dh, ffn, hidden);
  else
    gemm_rm_grouped(ctx, pointers, false, false, hidden, ffn, ffn, 1.f, 0.f, type, type, type, dh_p);
  wgrad(dout, 0, hidden, h, ffn, dw2, dw2_p);

  const int64_t count = rows * ffn;
  ActBackwardParams<T> bp{
      dh, pre1 + row_begin * ffn, swiglu ? pre3 + row_begin * ffn : nullptr, dpre1, dpre3, count};
  launch_activation<T, BackwardLaunch>(activation, packable<T>(count, {bp.dh, bp.pre1, bp.pre3, bp.dpre3}),
                                       bp, count, ctx.stream);

  wgrad(dpre1, row_begin, ffn, x, hidden, dw1, dw1_p);
  if (swiglu) wgrad(dpre3, row_begin, ffn, x, hidden, dw3, dw3_p);
  if (own_dgrad) {
    dgrad_own(dpre1, w1, swiglu ? dpre3 : nullptr, swiglu ? w3 : nullptr, dx + row_begin * hidden, hidden, ffn);
    return;
  }
  gemm_rm_grouped(ctx, pointers, false, false, ffn, hidden, hidden, 1.f, 0.f, type, type, type, dx1_p);
  if (swiglu)
    gemm_rm_grouped(ctx, pointers, false, false, ffn, hidden, hidden, 1.f, 1.f, type, type, type, dx3_p);
}

#define DMOE_INSTANTIATE_EXPERT_FFN(T)                                                                       \
  template void expert_ffn_forward<T>(const T*, const T*, const T*, const T*, T*, T*, T*, T*,                \
                                      const int64_t*, int32_t, int64_t, int64_t, Activation,                 \
                                      const CudaContext&);                                                   \
  template void expert_ffn_backward<T>(const T*, const T*, const T*, const T*, const T*, const T*, const T*, \
                                       const T*, T*, void*, void*, void*, bool, const int64_t*, int32_t,     \
                                       int64_t, int64_t, Activation, bool, const CudaContext&);

DMOE_INSTANTIATE_EXPERT_FFN(float)
DMOE_INSTANTIATE_EXPERT_FFN(bf16)

}  // namespace dmoe::cuda
