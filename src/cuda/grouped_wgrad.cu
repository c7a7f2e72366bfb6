// cuda/grouped_wgrad.cu — dmoe's grouped weight-gradient GEMM (bf16 in, f32 out): for every group g with
// rows, C_g [m, n] (+)= A_g^T · B_g, where A_g [rows_g, m] and B_g [rows_g, n] are the group's rows of two
// row-major activation matrices (the reduction runs over the rows: tokens routed to expert g).
//
// Why: the experts' weight gradients are bf16 × bf16 → f32 products, which cuBLAS's grouped API does not
// offer, so the backward pass ran one cublasGemmEx per expert and product — 384 small calls on the
// fine-grained config (128 experts × dw1, dw3, dw2; each ~0.4 G multiply-adds over ~256 rows), most of
// them leaving the GPU idle between tiles (docs/perf.md). Here one launch covers every expert's tiles.
//
// Structure: one CTA per 128×128 output tile of one group (grid x = column tiles, y = row tiles, z =
// groups), 8 warps as 2 (m) × 4 (n), each warp 64×32 of the tile. The reduction dimension (the group's
// rows) runs in k-blocks of 32 rows through a 4-stage cp.async ring; rows past the group and columns past
// m / n are zero-filled by the copy, so any row count works. Both operands are stored with m (or n)
// contiguous — the transposed layout for mma.sync — so fragments come from `ldmatrix .trans`; shared
// rows are padded by 16 bytes, which puts the 8 rows an ldmatrix reads in 8 different bank groups.
// mma.sync m16n8k16 (bf16, f32 accumulate) rather than Hopper's wgmma keeps the kernel portable to sm_80+
// and simple; it is not the fastest possible form (docs/perf.md has what it reaches). On sm_90 dmoe takes
// the TMA + wgmma kernel instead (grouped_wgrad_sm90.cu: persistent, its stores overlapping the products);
// this one stays for sm_80-class GPUs and as DMOE_WGRAD=mma.
//
// The epilogue adds the f32 accumulators to C (accumulate) or stores them, 8-byte pairs per thread; each
// output element belongs to exactly one CTA, so no atomics are needed.
//
// Measured (H200, fine-grained dw1: 128 experts × 768 × 2048 over ~256 rows each, docs/perf.md): 840 µs,
// 123 TFLOP/s. The reduction is short (one expert's rows), so per FLOP the kernel moves as many bytes for
// C (f32 read + write, 8 bytes per element per tile) as for the operands: ~3.2 GB through L2 and 1.8 GB
// of DRAM per launch. Prefetching C's tile into L2 at the CTA's start changed nothing (tried, removed).
// Storing instead (accumulate = false, the first backward after zero_grads) takes 481 µs, 214 TFLOP/s.
#include <mutex>
#include <vector>

#include "cuda/common.hpp"

namespace dmoe::cuda {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 32;  // output tile and k-block (rows of the reduction)
constexpr int kStages = 4;
constexpr int kThreads = 256;                  // 8 warps: 2 along m × 4 along n
constexpr int kRowElems = kBM + 8;             // padded shared row (bf16): 272 bytes
constexpr int kStageElems = 2 * kBK * kRowElems;  // A block then B block
constexpr int kSmemBytes = kStages * kStageElems * 2;
static_assert(kBM == kBN, "one padded row length serves both operands");

struct WgradParams {
  const __nv_bfloat16* a;
  const __nv_bfloat16* b;
  float* c;
  const int64_t* offsets;   // device copy of the group row offsets [groups + 1]
  int64_t a_first, b_first;  // the offsets' row number of a's and b's row 0
  int64_t m, n, lda, ldb;
  int64_t c_stride;          // elements between consecutive groups' C
  int accumulate;
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define DMOE_WGRAD_DEVICE 1
#endif

#ifdef DMOE_WGRAD_DEVICE
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, bypassing L1; `bytes` = 0 writes zeros (rows or columns past the matrix).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

__global__ void __launch_bounds__(kThreads, 2) grouped_wgrad_kernel(const WgradParams p) {
#ifdef DMOE_WGRAD_DEVICE
  const int group = int(blockIdx.z);
  const int64_t r0 = p.offsets[group];
  const int64_t rows = p.offsets[group + 1] - r0;
  if (rows <= 0) return;  // no rows: this group's gradient gets nothing
  const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * kBN;
  const __nv_bfloat16* a = p.a + (r0 - p.a_first) * p.lda + m0;
  const __nv_bfloat16* b = p.b + (r0 - p.b_first) * p.ldb + n0;

  float* c = p.c + int64_t(group) * p.c_stride;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const uint32_t smem_base = smem_addr(smem);
  const int tid = int(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int warp_m = warp / 4, warp_n = warp % 4;  // warp tile: rows 64·warp_m, columns 32·warp_n

  // Loader: a k-block is 32 rows × 128 columns of each operand = 512 chunks of 16 bytes; 2 per thread.
  const int64_t m_left = p.m - m0, n_left = p.n - n0;  // columns of this tile inside the matrices
  auto load = [&](int stage, int64_t kb) {
    const uint32_t a_dst = smem_base + uint32_t(stage * kStageElems) * 2;
    const uint32_t b_dst = a_dst + uint32_t(kBK * kRowElems) * 2;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int chunk = tid + i * kThreads;
      const int row = chunk / 16, col = (chunk % 16) * 8;
      const int64_t k = kb * kBK + row;
      const uint32_t off = uint32_t(row * kRowElems + col) * 2;
      // m and n are multiples of 8, so a chunk is wholly inside or outside.
      const bool a_ok = k < rows && col < m_left, b_ok = k < rows && col < n_left;
      cp_async_16(a_dst + off, a_ok ? static_cast<const void*>(a + k * p.lda + col) : p.a, a_ok ? 16 : 0);
      cp_async_16(b_dst + off, b_ok ? static_cast<const void*>(b + k * p.ldb + col) : p.b, b_ok ? 16 : 0);
    }
  };

  float acc[4][4][4];  // [m16 block][n8 block][fragment]
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;

  const int64_t k_blocks = (rows + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_blocks) load(s, s);
    cp_async_commit();
  }

  // ldmatrix .trans lanes: lane l gives the address of row (l % 8) of matrix l / 8. A (m contiguous):
  // matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15) = fragments a0..a3 of
  // m16n8k16. B (n contiguous): (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) =
  // b0, b1 of two n8 blocks.
  const int mat = lane / 8, mrow = lane % 8;
  const int a_k = mrow + (mat / 2) * 8, a_m = warp_m * 64 + (mat % 2) * 8;
  const int b_k = mrow + (mat % 2) * 8, b_n = warp_n * 32 + (mat / 2) * 8;

  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    cp_async_wait<kStages - 2>();  // this k-block's copies (issued kStages - 1 blocks ago) have landed
    __syncthreads();               // ... for every thread; and everyone is done with the slot refilled next
    const int64_t next = kb + kStages - 1;
    if (next < k_blocks) load(int(next % kStages), next);
    cp_async_commit();

    const int stage = int(kb % kStages);
    const uint32_t a_base = smem_base + uint32_t(stage * kStageElems) * 2;
    const uint32_t b_base = a_base + uint32_t(kBK * kRowElems) * 2;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[4][4], bf[2][4];
#pragma unroll
      for (int i = 0; i < 4; ++i)
        ldmatrix_x4_trans(af[i], a_base + uint32_t((kk + a_k) * kRowElems + a_m + i * 16) * 2);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        ldmatrix_x4_trans(bf[j], b_base + uint32_t((kk + b_k) * kRowElems + b_n + j * 16) * 2);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], af[i], bf[j / 2][(j % 2) * 2], bf[j / 2][(j % 2) * 2 + 1]);
    }
  }
  cp_async_wait<0>();

  // Fragment (lane l): rows l/4 and l/4 + 8 of the m16 block, columns 2(l%4), +1 of the n8 block.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t m = m0 + warp_m * 64 + i * 16 + lane / 4 + half * 8;
      if (m >= p.m) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = n0 + warp_n * 32 + j * 8 + (lane % 4) * 2;
        if (n >= p.n) continue;  // n even and p.n a multiple of 8: the pair is wholly inside
        float2* dst = reinterpret_cast<float2*>(c + m * p.n + n);
        float2 v = make_float2(acc[i][j][2 * half], acc[i][j][2 * half + 1]);
        if (p.accumulate) {
          const float2 old = *dst;
          v.x += old.x;
          v.y += old.y;
        }
        *dst = v;
      }
    }
  }
#else
  __trap();  // not built for this device; grouped_wgrad_usable() said so before any launch
#endif
}

// Whether the kernel has a body for the current device (sm_80+ in this build).
bool kernel_built_for_device() {
  static std::mutex mutex;
  static std::vector<int> known;  // per device: -1 unknown, 0 no, 1 yes
  int device = 0;
  DMOE_CHECK_CUDA(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  if (int(known.size()) <= device) known.resize(device + 1, -1);
  if (known[device] < 0) {
    int major = 0;
    DMOE_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cudaFuncAttributes attr{};
    bool ok = major >= 8 && cudaFuncGetAttributes(&attr, grouped_wgrad_kernel) == cudaSuccess &&
              attr.binaryVersion >= 80;
    (void)cudaGetLastError();
    if (ok) ok = cudaFuncSetAttribute(grouped_wgrad_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kSmemBytes) == cudaSuccess;
    (void)cudaGetLastError();
    known[device] = ok ? 1 : 0;
  }
  return known[device] == 1;
}

}  // namespace

bool grouped_wgrad_usable(const GroupedWgrad& g) {
  if (g.groups <= 0 || g.m <= 0 || g.n <= 0 || g.c_bf16 != nullptr) return false;  // f32 C only
  if (g.m % 8 != 0 || g.n % 8 != 0 || g.lda % 8 != 0 || g.ldb % 8 != 0) return false;
  if (!is_aligned(g.a, 16) || !is_aligned(g.b, 16) || !is_aligned(g.c, 16)) return false;
  // Grid: column tiles in x (< 2^31), row tiles in y and groups in z (< 2^16).
  if ((g.m + kBM - 1) / kBM >= 65536 || g.groups >= 65536) return false;
  return kernel_built_for_device();
}

size_t grouped_wgrad_scratch_bytes(int32_t groups) {
  return (size_t(groups) + 1) * sizeof(int64_t);
}

bool check_wgrad_call(const GroupedWgrad& g, const char* who) {
  DMOE_CUDA_REQUIRE(g.groups >= 0, "%s: groups = %d; must be >= 0", who, g.groups);
  if (g.groups == 0 || g.m == 0 || g.n == 0) return false;
  for (int32_t e = 0; e < g.groups; ++e)
    DMOE_CUDA_REQUIRE(g.row_offsets[e + 1] >= g.row_offsets[e],
                      "%s: row_offsets[%d] = %lld < row_offsets[%d] = %lld; offsets must not decrease", who, e + 1,
                      (long long)g.row_offsets[e + 1], e, (long long)g.row_offsets[e]);
  DMOE_CUDA_REQUIRE(g.row_offsets[0] >= g.a_first_row && g.row_offsets[0] >= g.b_first_row,
                    "%s: the first group starts at row %lld, before a's first row %lld or b's %lld", who,
                    (long long)g.row_offsets[0], (long long)g.a_first_row, (long long)g.b_first_row);
  return true;
}

void grouped_wgrad(const CudaContext& ctx, void* scratch, const GroupedWgrad& g) {
  if (!check_wgrad_call(g, "grouped_wgrad")) return;
  DMOE_CUDA_REQUIRE(grouped_wgrad_usable(g),
                    "grouped_wgrad: not usable here (needs an sm_80+ GPU and a build for it, m, n, lda, ldb multiples "
                    "of 8 — m = %lld, n = %lld, lda = %lld, ldb = %lld — and 16-byte aligned pointers)",
                    (long long)g.m, (long long)g.n, (long long)g.lda, (long long)g.ldb);
  upload_async(scratch, g.row_offsets, (size_t(g.groups) + 1) * sizeof(int64_t), ctx.stream);
  WgradParams p{};
  p.a = g.a;
  p.b = g.b;
  p.c = g.c;
  p.offsets = static_cast<const int64_t*>(scratch);
  p.a_first = g.a_first_row;
  p.b_first = g.b_first_row;
  p.m = g.m;
  p.n = g.n;
  p.lda = g.lda;
  p.ldb = g.ldb;
  p.c_stride = g.c_group_stride;
  p.accumulate = g.accumulate ? 1 : 0;
  const dim3 grid(unsigned((g.n + kBN - 1) / kBN), unsigned((g.m + kBM - 1) / kBM), unsigned(g.groups));
  grouped_wgrad_kernel<<<grid, kThreads, kSmemBytes, ctx.stream>>>(p);
  DMOE_CHECK_LAUNCH();
}

}  // namespace dmoe::cuda
