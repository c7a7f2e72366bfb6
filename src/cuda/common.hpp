// cuda/common.hpp — host-side helpers of the CUDA launchers: data-type tags, alignment tests, grid sizes,
// small host-to-workspace uploads, and the row-major GEMM wrappers over cuBLAS (gemm.cpp).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cuda/check.hpp"
#include "cuda/kernels.cuh"

namespace dmoe::cuda {

template <typename T>
constexpr cudaDataType_t cuda_data_type() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16>, "storage is f32 or bf16");
  return std::is_same_v<T, float> ? CUDA_R_32F : CUDA_R_16BF;
}

inline bool is_aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// Blocks for `work` items at `per_block` items a block, capped (grid-stride loops cover the rest).
inline unsigned grid_for(int64_t work, int64_t per_block, int64_t max_blocks = int64_t(1) << 20) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return unsigned(std::clamp<int64_t>(blocks, 1, max_blocks));
}

// Copies a small host array into device scratch on `stream`. The copy is stream-ordered; the host array
// may be reused once this returns (pageable memory is staged by the driver before the call returns).
inline void upload_async(void* device_dst, const void* host_src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  DMOE_CHECK_CUDA(cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, stream));
}

// ---- row-major GEMM on cuBLAS (gemm.cpp) -----------------------------------------------------------
//
// C [m, n] = alpha · op(A) · op(B) + beta · C, all row-major; op(A) is [m, k] (A stored [m, k], or
// [k, m] when trans_a), op(B) is [k, n] (B stored [k, n], or [n, k] when trans_b). cuBLAS is
// column-major, where a row-major matrix reads as its transpose, so this is the column-major product
// C^T = op(B)^T · op(A)^T: cuBLAS gets (B, A) swapped and (n, m) swapped. Compute type is always
// CUBLAS_COMPUTE_32F (fp32 accumulation; no TF32 for f32 inputs).
void gemm_rm(cublasHandle_t cublas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
             const void* a, cudaDataType_t a_type, int64_t lda, const void* b, cudaDataType_t b_type,
             int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc);

// One product of a grouped GEMM (one expert); every problem of a group shares the transposes, leading
// dimensions, alpha and beta, and differs in m, n, k and the pointers.
struct GemmProblem {
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
};

// Runs the problems (problems with m, n or k = 0 must be left out by the caller) as one
// cublasGemmGroupedBatchedEx call when the products are small (below 1.5 G multiply-adds on average;
// larger ones run faster one by one, measurements in gemm.cpp), cuBLAS supports the types (A, B and C
// of one type: bf16 or f32) and every pointer is 16-byte aligned; otherwise as a loop of cublasGemmEx
// calls. The grouped call reads device pointer arrays, which are uploaded into the context's workspace
// at `pointer_scratch` (3·problems pointers, laid out by the caller).
void gemm_rm_grouped(const CudaContext& ctx, void* pointer_scratch, bool trans_a, bool trans_b, int64_t lda,
                     int64_t ldb, int64_t ldc, float alpha, float beta, cudaDataType_t a_type,
                     cudaDataType_t b_type, cudaDataType_t c_type, const std::vector<GemmProblem>& problems);

inline size_t grouped_pointer_bytes(int64_t problems) { return size_t(problems) * 3 * sizeof(void*); }

// Whether the experts' forward products should run on dmoe's own grouped GEMM (below) rather than cuBLAS,
// for products of `mean_macs` multiply-adds on average. DMOE_EXPERT_GEMM=own forces it (where usable),
// grouped / loop / streams force cuBLAS; auto decides by size (measurements in gemm.cpp).
bool prefer_own_grouped_gemm(double mean_macs);
// The same choice where cuBLAS would cost a host read of the expert counts that the own kernel does not (a train
// forward whose counts stay on the device, EpEngine): the own kernel up to a larger size (gemm.cpp).
bool prefer_own_grouped_gemm_without_counts(double mean_macs);

// ---- dmoe's own grouped GEMM for Hopper (grouped_gemm_sm90.cu) ------------------------------------------
//
// For every group g: C[r, :] = A[r, :] · B_g^T for the rows r in [row_offsets[g], row_offsets[g+1]);
// A [rows, k] and C [rows, n] row-major (lda = k, ldc = n), B = [groups, n, k] (each group's matrix
// [n, k], as the experts' w1/w3/w2 are stored), all bf16, fp32 accumulation. Rows of C outside every group
// are not written. row_offsets is a host array of groups + 1 entries.
//
// Fused activation (h != null): the epilogue also writes h = act(C) — or, for SwiGLU, C2 = A·B2_g^T as well
// and h = silu(C)·C2 — computed from the bf16-rounded C (and C2), as the separate activation kernel does.
struct GroupedGemmNT {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  __nv_bfloat16* c = nullptr;                  // [rows, n]; with h it may be null (not kept)
  const int64_t* row_offsets = nullptr;
  int32_t groups = 0;
  int64_t n = 0, k = 0;
  __nv_bfloat16* h = nullptr;                  // [rows, n], null: no fused activation
  Activation activation = Activation::relu;    // with h
  const __nv_bfloat16* b2 = nullptr;           // SwiGLU: w3 [groups, n, k]
  __nv_bfloat16* c2 = nullptr;                 // SwiGLU: pre3 [rows, n]; may be null (not kept)
  // row_offsets in device memory (written by an earlier kernel on the stream: no host read of the counts); the
  // rows [0, rows) of A and C are the groups' (row_offsets[0] = 0, row_offsets[groups] = rows; offsets outside
  // are clipped, so a wrong table computes wrong rows but touches no memory outside them).
  bool offsets_on_device = false;
  int64_t rows = 0;
};

// The tile table of a grouped GEMM over offsets in device memory (GroupedGemmNT::offsets_on_device), as the own
// GEMM builds it before its launch: clipped [groups + 1] (the offsets clipped into [0, rows], non-decreasing),
// tile_offsets [groups + 1] (group g's first tile: ceil(rows_g / block_m) · n_tiles tiles each), tiles [1] the
// total. Device pointers; the twin of cpu::grouped_tile_table.
void grouped_tile_table(const int64_t* row_offsets, int32_t groups, int64_t rows, int32_t n_tiles, int32_t block_m,
                        int64_t* clipped, int32_t* tile_offsets, int32_t* tiles, cudaStream_t stream);

// True where the kernel can run: an sm_90 GPU, this build targets sm_90a, k and n multiples of 8,
// 16-byte aligned pointers.
bool sm90_grouped_gemm_usable(const GroupedGemmNT& g);
// Device scratch the call needs (offsets and the tile table), from the context's workspace.
size_t sm90_grouped_gemm_scratch_bytes(int32_t groups);
// How the kernel runs; 0 fields take the environment's setting or the measured default.
struct Sm90Tuning {
  int block_n = 0;   // tile width, 128 or 256; 0 = DMOE_SM90_BLOCK_N or 256
  int epilogue = 0;  // 1 staged (shared memory, asynchronous bulk stores), 2 direct (stores from
                     // registers); 0 = DMOE_SM90_EPILOGUE or direct
  int schedule = 0;  // tiles after the first wave: 1 static (CTA b takes b, b + G, ...), 2 dynamic (the next
                     // index from a global counter: tiles start in order however CTAs drift); 0 =
                     // DMOE_SM90_SCHEDULE or dynamic
  int leave_out = 0;  // measurement aid, wrong results: 1 = no stores, 2 = no products and no stores (loads
                      // and the pipeline only); times of the variants place the kernel's time in its stages
  uint32_t skip_lag_ns = 0;  // test aid: warps 1-3 of a consumer warpgroup whose rows all lie past its group
                             // sleep this long before each slot wait, so that the skip path must hold its
                             // warps together (tests/gpu/test_own_gemm.cpp); at most 1e6 (__nanosleep's bound)
};
void sm90_grouped_gemm(const CudaContext& ctx, void* scratch, const GroupedGemmNT& g, const Sm90Tuning& tuning = {});

// ---- the NN variant (grouped_gemm_sm90.cu): the backward pass's input-gradient products -----------------
//
// For every group g: C[r, :] = A[r, :] · B_g (+ A2[r, :] · B2_g) for the rows r in [row_offsets[g],
// row_offsets[g+1]); A, A2 [rows, k] and C [rows, n] row-major, B, B2 = [groups, k, n] (each group's
// matrix [k, n] row-major, as w2 [H, I] is for dh = dout·w2 and w1, w3 [I, H] are for dx = dpre1·w1 +
// dpre3·w3). bf16 in and out, fp32 accumulation; with A2 (and B2) both products run in one accumulation
// over 2k (one rounding, where cuBLAS's beta = 1 second pass rounds twice). Rows of C outside every
// group are not written. row_offsets is a host array of groups + 1 entries. Same kernel, tile scheduler
// and tunings as sm90_grouped_gemm, with B loaded MN-major (sm90_layout.hpp); the staged epilogue is not
// built for it (Sm90Tuning::epilogue = 1 is refused).
struct GroupedGemmNN {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  __nv_bfloat16* c = nullptr;
  const int64_t* row_offsets = nullptr;
  int32_t groups = 0;
  int64_t n = 0, k = 0;
  const __nv_bfloat16* a2 = nullptr;  // second product's A [rows, k], or null (then b2 is null too)
  const __nv_bfloat16* b2 = nullptr;  // second product's B [groups, k, n]
};
// True where the kernel can run: an sm_90 GPU, this build targets sm_90a, k and n multiples of 8 (TMA's
// 16-byte row strides; 16-byte stores), 16-byte aligned pointers, a2 and b2 both given or both null, fewer
// than 2^31 - 128 rows. Any row counts (empty groups, 1 row), any k, n tails past the tile.
bool sm90_grouped_gemm_nn_usable(const GroupedGemmNN& g);
// Scratch: as sm90_grouped_gemm_scratch_bytes (offsets, tile table, counter).
void sm90_grouped_gemm_nn(const CudaContext& ctx, void* scratch, const GroupedGemmNN& g,
                          const Sm90Tuning& tuning = {});
// Whether the backward pass's bf16 input-gradient products (dh = dout·w2, dx = dpre1·w1 + dpre3·w3) take
// sm90_grouped_gemm_nn: DMOE_DGRAD=cublas (default, until measured on the H200) | own (wherever usable) |
// auto (own below the forward's size bound, kOwnMaxMeanMacs in gemm.cpp; an unmeasured guess).
bool prefer_own_dgrad(double mean_macs);

// ---- dmoe's grouped weight-gradient GEMM (grouped_wgrad.cu) -----------------------------------------------
//
// For every group g with rows: C_g [m, n] = A_g^T · B_g (+ C_g with accumulate), A_g = rows
// [row_offsets[g], row_offsets[g+1]) of A [·, m] (row stride lda), B_g the same rows of B [·, n] (ldb);
// row r of the offsets is row r - a_first_row of A and r - b_first_row of B. bf16 in, f32 out and
// accumulation; C_g at c + g·c_group_stride, row-major [m, n]. Groups without rows are left alone.
// row_offsets is a host array of groups + 1 entries.
struct GroupedWgrad {
  const __nv_bfloat16* a = nullptr;
  const __nv_bfloat16* b = nullptr;
  float* c = nullptr;
  // Where set, C is stored here as bf16 instead (each f32 sum rounded once; accumulate must be false, and c is
  // not used): the sm90 kernel only (the gradients of bf16 experts as the PyTorch module keeps them).
  __nv_bfloat16* c_bf16 = nullptr;
  const int64_t* row_offsets = nullptr;
  int32_t groups = 0;
  int64_t m = 0, n = 0, lda = 0, ldb = 0;
  int64_t a_first_row = 0, b_first_row = 0;
  int64_t c_group_stride = 0;
  bool accumulate = true;
};
// True where it can run: an sm_80+ GPU with the kernel in this build, m, n, lda, ldb multiples of 8,
// 16-byte aligned pointers, f32 C (no c_bf16). The mma.sync kernel (sm_80-class GPUs; on sm_90 the TMA + wgmma
// one below).
bool grouped_wgrad_usable(const GroupedWgrad& g);
size_t grouped_wgrad_scratch_bytes(int32_t groups);
void grouped_wgrad(const CudaContext& ctx, void* scratch, const GroupedWgrad& g);
// The launchers' argument checks (offsets non-decreasing, the first group at or after a's and b's first
// rows; `who` names the caller in the error); false when there is nothing to do (no groups, m or n 0).
bool check_wgrad_call(const GroupedWgrad& g, const char* who);

// ---- the weight gradients on Hopper (grouped_wgrad_sm90.cu) ---------------------------------------------
//
// Same descriptor and semantics as grouped_wgrad (any row count, m and n tails, groups without rows left
// alone), on TMA + wgmma: persistent CTAs over a tile table, two consumer warpgroups taking alternate
// 128×128 tiles so that one's stores overlap the other's products.
// True where it can run: an sm_90 GPU and a build for sm_90a, m, n, lda, ldb multiples of 8, lda >= m,
// ldb >= n, 16-byte aligned a, b and c (or c_bf16, with accumulate false), c_group_stride a multiple of 4 (of 8
// for c_bf16: its 16-byte stores), fewer than 2^31 - 64 rows from a's (and b's) first row to the last group's end.
bool sm90_grouped_wgrad_usable(const GroupedWgrad& g);
size_t sm90_grouped_wgrad_scratch_bytes(int32_t groups);
struct Sm90WgradTuning {
  int accumulate = 0;  // how accumulate = true reads C: 1 load (into registers, added, stored), 2 red (f32
                       // reductions at L2, no round trip through the SM); 0 = DMOE_SM90_WGRAD_ACCUMULATE or load
  int schedule = 0;    // 0: the strip schedule for groups of at most 320 rows (A's k-range loaded once for up to
                       // 8 tiles), the tile schedule for longer ones; 1: the tile schedule for every group
  int bf16_store = 0;  // a bf16 C (c_bf16): 0 16-byte stores (each quad's words transposed first); 1 each lane's
                       // 4-byte pairs as they come out of the accumulators (1.2-2× slower, docs/perf.md; benchmarks)
};
void sm90_grouped_wgrad(const CudaContext& ctx, void* scratch, const GroupedWgrad& g, const Sm90WgradTuning& t = {});

// The twin of cpu::grouped_wgrad: dmoe's best own kernel here (sm90_grouped_wgrad where usable, else the
// mma.sync grouped_wgrad), scratch from the context's workspace.
void grouped_wgrad(const GroupedWgrad& g, const CudaContext& ctx);

// Which kernel the backward pass's bf16 weight gradients take (DMOE_WGRAD; measurements in gemm.cpp):
//   auto (default)  by mean multiply-adds per expert product (bounds and measurements in gemm.cpp): mma below
//                   kMmaWgradMaxMeanMacs, the TMA + wgmma kernel (sm90) below kSm90WgradMaxMeanMacs, else cublas;
//                   where sm90 cannot run, mma below kMmaOverCublasMaxMeanMacs; accumulating calls: mma below
//                   kMmaOverCublasMaxMeanMacs, else cublas (sm90 measured slower there); bf16 gradients (c_bf16,
//                   which the mma.sync kernel does not store): sm90 below kSm90WgradMaxMeanMacs where each expert's
//                   output has fewer than kSm90Bf16WgradMaxOutput (2^24) elements, else cublas
//   own             the sm90 kernel wherever usable, else the mma.sync kernel
//   sm90            the TMA + wgmma kernel wherever usable
//   mma             the mma.sync kernel wherever usable
//   cublas          one cublasGemmEx per expert and product
// Every call in `calls` must be usable on the kernel picked; otherwise cuBLAS runs them.
enum class WgradKernel { cublas, sm90, mma };
WgradKernel pick_wgrad_kernel(double mean_macs, const std::vector<GroupedWgrad>& calls);
// Whether bf16 weight gradients can be stored by one grouped launch per product here: an sm_90 GPU, a build for
// sm_90a, and DMOE_WGRAD auto, own or sm90 (the model's choice of bf16 expert gradients, model/train_replica.hpp).
bool grouped_bf16_wgrad_available();
const char* wgrad_kernel_name(WgradKernel k);

}  // namespace dmoe::cuda
