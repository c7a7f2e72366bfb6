// cuda/attention.cu — causal grouped-query attention, forward and backward (the twins of
// cpu::attention_forward/backward; launchers declared in cuda/model_kernels.cuh). The f32 path, and the
// oracle on the GPU for cuDNN's fused attention (cuda/attention_cudnn.hpp).
//
// Flash-attention structure, plain f32 arithmetic on shared-memory tiles (no tensor cores):
//   - forward: one block per (tile of kRows queries, query head, sequence). It walks the key tiles up to the
//     diagonal with an online softmax (running max m and sum l per row, in f32) and writes out = acc / l and
//     lse = m + log(l).
//   - backward: Di = rowsum(dout ∘ out) first (one warp per row, into the workspace); then one kernel per
//     (query tile, query head) for dq and one per (key tile, kv head) for dk, dv. Both recompute
//     p = exp(scale·q·k − lse) and dS = p (dout·v − Di). The dk/dv kernel loops over the query heads of its
//     kv head in order, and over the query tiles in order, so every sum has a fixed order: results are
//     bit-identical run to run (no atomics).
// Thread layout: kRows rows per block, kTpr consecutive threads per row (a power of two dividing the warp, so
// row reductions are xor shuffles, which give every lane of the row the same bits). A thread holds kDpt
// columns of its row's accumulators, columns d = c + kTpr·x (c = its index within the row). Scores of a row
// are split the same way over the kCols keys of a tile: key c + kTpr·x. Tiles are stored as f32 rows of
// head_dim + 1 floats (the pad makes the column reads of different rows fall in different banks).
#include <cmath>

#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"
#include "cuda/model_kernels.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kRows = 32;  // queries per tile
constexpr int kCols = 32;  // keys per tile
constexpr int kMaxHeadDim = 256;

template <typename T>
struct AttentionParams {
  const T* q;      // [n, Hq, D]
  const T* k;      // [n, Hkv, D]
  const T* v;      // [n, Hkv, D]
  const T* out;    // [n, Hq, D] (backward)
  const T* dout;   // [n, Hq, D] (backward)
  T* o;            // forward: out
  T* dq;           // [n, Hq, D]
  T* dk;           // [n, Hkv, D]
  T* dv;           // [n, Hkv, D]
  float* lse;      // [B, Hq, S] (forward writes, backward reads)
  float* di;       // [B, Hq, S] rowsum(dout ∘ out) (backward scratch)
  int64_t seq;
  int32_t heads, kv_heads, head_dim;
  float scale;
};

// Rows [0, rows) of a tile from global memory (row r at src + r·stride), as f32 with leading dimension
// ld; rows [rows, tile_rows) are zero.
template <typename T>
__device__ __forceinline__ void load_tile(float* dst, const T* __restrict__ src, int rows, int tile_rows,
                                          int64_t stride, int head_dim, int ld) {
  for (int idx = threadIdx.x; idx < tile_rows * head_dim; idx += blockDim.x) {
    const int r = idx / head_dim, d = idx - r * head_dim;
    dst[r * ld + d] = r < rows ? to_f32(src[r * stride + d]) : 0.f;
  }
}

template <int kTpr>
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int off = 1; off < kTpr; off <<= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

template <int kTpr>
__device__ __forceinline__ float row_sum(float v) {
#pragma unroll
  for (int off = 1; off < kTpr; off <<= 1) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma unroll 4
  for (int d = 0; d < n; ++d) s = fmaf(a[d], b[d], s);
  return s;
}

// Offset of (token b·seq + s, head h, 0) in a [n, heads, D] tensor.
__device__ __forceinline__ int64_t row_offset(int64_t b, int64_t seq, int64_t s, int32_t heads, int32_t h,
                                              int32_t head_dim) {
  return ((b * seq + s) * heads + h) * int64_t(head_dim);
}

size_t forward_smem(int head_dim) {
  return sizeof(float) * (size_t(kRows + 2 * kCols) * (head_dim + 1) + size_t(kRows) * (kCols + 1));
}
size_t dq_smem(int head_dim) {
  return sizeof(float) * (size_t(2 * kRows + 2 * kCols) * (head_dim + 1) + size_t(kRows) * (kCols + 1));
}
size_t dkdv_smem(int head_dim) {
  return sizeof(float) * (size_t(2 * kRows + 2 * kCols) * (head_dim + 1) + size_t(2 * kCols) * (kRows + 1) +
                          2 * kRows);
}

// ---- forward -------------------------------------------------------------------------------------------

template <typename T, int kTpr, int kDpt>
__global__ void __launch_bounds__(kRows * kTpr, 1) attention_forward_kernel(const __grid_constant__ AttentionParams<T> p) {
  extern __shared__ float smem[];
  const int D = p.head_dim, ld = D + 1;
  float* sQ = smem;                // [kRows][ld]
  float* sK = sQ + kRows * ld;     // [kCols][ld]
  float* sV = sK + kCols * ld;     // [kCols][ld]
  float* sP = sV + kCols * ld;     // [kRows][kCols + 1]
  const int r = threadIdx.x / kTpr, c = threadIdx.x % kTpr;
  const int64_t q0 = int64_t(blockIdx.x) * kRows, b = blockIdx.z;
  const int h = blockIdx.y, kvh = h / (p.heads / p.kv_heads);
  const int q_rows = int(min64(kRows, p.seq - q0));
  const int64_t i = q0 + r;  // this thread's query (rows past the sequence compute on zeros, write nothing)

  load_tile(sQ, p.q + row_offset(b, p.seq, q0, p.heads, h, D), q_rows, kRows, int64_t(p.heads) * D, D, ld);
  float acc[kDpt];
#pragma unroll
  for (int x = 0; x < kDpt; ++x) acc[x] = 0.f;
  float m = -INFINITY, l = 0.f;

  const int64_t last_key = min64(q0 + kRows, p.seq) - 1;  // keys past it are hidden from the whole tile
  for (int64_t k0 = 0; k0 <= last_key; k0 += kCols) {
    const int k_rows = int(min64(kCols, p.seq - k0));
    __syncthreads();  // the previous tile's reads of sK, sV, sP are done (and sQ is loaded, first time)
    load_tile(sK, p.k + row_offset(b, p.seq, k0, p.kv_heads, kvh, D), k_rows, kCols, int64_t(p.kv_heads) * D, D, ld);
    load_tile(sV, p.v + row_offset(b, p.seq, k0, p.kv_heads, kvh, D), k_rows, kCols, int64_t(p.kv_heads) * D, D, ld);
    __syncthreads();

    constexpr int kPerThread = kCols / kTpr;
    float s[kPerThread];
    float tile_max = -INFINITY;
#pragma unroll
    for (int x = 0; x < kPerThread; ++x) {
      const int jl = c + x * kTpr;
      const bool visible = jl < k_rows && k0 + jl <= i;
      s[x] = visible ? dot(sQ + r * ld, sK + jl * ld, D) * p.scale : -INFINITY;
      tile_max = fmaxf(tile_max, s[x]);
    }
    // Key 0 is visible to every row, so m is finite from the first tile on; exp(−inf − m) = 0 hides the rest.
    const float m_new = fmaxf(m, row_max<kTpr>(tile_max));
    const float alpha = expf(m - m_new);
    float psum = 0.f;
#pragma unroll
    for (int x = 0; x < kPerThread; ++x) {
      const float pj = expf(s[x] - m_new);
      sP[r * (kCols + 1) + c + x * kTpr] = pj;
      psum += pj;
    }
    l = l * alpha + row_sum<kTpr>(psum);
    m = m_new;
    __syncthreads();
#pragma unroll
    for (int x = 0; x < kDpt; ++x) {
      const int d = c + x * kTpr;
      if (d < D) {
        float a = acc[x] * alpha;
        for (int j = 0; j < k_rows; ++j) a = fmaf(sP[r * (kCols + 1) + j], sV[j * ld + d], a);
        acc[x] = a;
      }
    }
  }
  if (i < p.seq) {
    T* o = p.o + row_offset(b, p.seq, i, p.heads, h, D);
    const float inv_l = 1.f / l;
#pragma unroll
    for (int x = 0; x < kDpt; ++x) {
      const int d = c + x * kTpr;
      if (d < D) o[d] = from_f32<T>(acc[x] * inv_l);
    }
    if (c == 0) p.lse[(b * p.heads + h) * p.seq + i] = m + logf(l);
  }
}

// ---- backward ------------------------------------------------------------------------------------------

// di[b, h, s] = Σ_d dout·out (f32, lanes then the warp tree): one warp per (token, head) row, grid-stride.
template <typename T>
__global__ void __launch_bounds__(256) attention_di_kernel(const __grid_constant__ AttentionParams<T> p,
                                                            int64_t rows) {
  const int lane = lane_id();
  const int64_t warps = int64_t(gridDim.x) * (256 / kWarp);
  for (int64_t row = int64_t(blockIdx.x) * (256 / kWarp) + threadIdx.x / kWarp; row < rows; row += warps) {
    // row = token·Hq + h
    const T* g = p.dout + row * p.head_dim;
    const T* o = p.out + row * p.head_dim;
    float s = 0.f;
    for (int d = lane; d < p.head_dim; d += kWarp) s = fmaf(to_f32(g[d]), to_f32(o[d]), s);
    s = warp_sum(s);
    if (lane == 0) {
      const int64_t token = row / p.heads, h = row % p.heads;
      const int64_t b = token / p.seq, i = token % p.seq;
      p.di[(b * p.heads + h) * p.seq + i] = s;
    }
  }
}

// dq for one (query tile, query head, sequence): dq_i = scale Σ_j dS_ij k_j over the visible key tiles.
template <typename T, int kTpr, int kDpt>
__global__ void __launch_bounds__(kRows * kTpr, 1) attention_dq_kernel(const __grid_constant__ AttentionParams<T> p) {
  extern __shared__ float smem[];
  const int D = p.head_dim, ld = D + 1;
  float* sQ = smem;                // [kRows][ld]
  float* sG = sQ + kRows * ld;     // dout [kRows][ld]
  float* sK = sG + kRows * ld;     // [kCols][ld]
  float* sV = sK + kCols * ld;     // [kCols][ld]
  float* sS = sV + kCols * ld;     // dS [kRows][kCols + 1]
  const int r = threadIdx.x / kTpr, c = threadIdx.x % kTpr;
  const int64_t q0 = int64_t(blockIdx.x) * kRows, b = blockIdx.z;
  const int h = blockIdx.y, kvh = h / (p.heads / p.kv_heads);
  const int q_rows = int(min64(kRows, p.seq - q0));
  const int64_t i = q0 + r;
  const bool row_valid = i < p.seq;

  load_tile(sQ, p.q + row_offset(b, p.seq, q0, p.heads, h, D), q_rows, kRows, int64_t(p.heads) * D, D, ld);
  load_tile(sG, p.dout + row_offset(b, p.seq, q0, p.heads, h, D), q_rows, kRows, int64_t(p.heads) * D, D, ld);
  const int64_t stat = (b * p.heads + h) * p.seq + i;
  const float lse_i = row_valid ? p.lse[stat] : 0.f;
  const float di_i = row_valid ? p.di[stat] : 0.f;
  float acc[kDpt];
#pragma unroll
  for (int x = 0; x < kDpt; ++x) acc[x] = 0.f;

  const int64_t last_key = min64(q0 + kRows, p.seq) - 1;
  for (int64_t k0 = 0; k0 <= last_key; k0 += kCols) {
    const int k_rows = int(min64(kCols, p.seq - k0));
    __syncthreads();
    load_tile(sK, p.k + row_offset(b, p.seq, k0, p.kv_heads, kvh, D), k_rows, kCols, int64_t(p.kv_heads) * D, D, ld);
    load_tile(sV, p.v + row_offset(b, p.seq, k0, p.kv_heads, kvh, D), k_rows, kCols, int64_t(p.kv_heads) * D, D, ld);
    __syncthreads();
    constexpr int kPerThread = kCols / kTpr;
#pragma unroll
    for (int x = 0; x < kPerThread; ++x) {
      const int jl = c + x * kTpr;
      float ds = 0.f;
      if (row_valid && jl < k_rows && k0 + jl <= i) {
        const float* qi = sQ + r * ld;
        const float* gi = sG + r * ld;
        const float* kj = sK + jl * ld;
        const float* vj = sV + jl * ld;
        float s = 0.f, dp = 0.f;
#pragma unroll 4
        for (int d = 0; d < D; ++d) {
          s = fmaf(qi[d], kj[d], s);
          dp = fmaf(gi[d], vj[d], dp);
        }
        const float pij = expf(s * p.scale - lse_i);
        ds = pij * (dp - di_i);
      }
      sS[r * (kCols + 1) + jl] = ds;
    }
    __syncthreads();
#pragma unroll
    for (int x = 0; x < kDpt; ++x) {
      const int d = c + x * kTpr;
      if (d < D) {
        float a = acc[x];
        for (int j = 0; j < k_rows; ++j) a = fmaf(sS[r * (kCols + 1) + j], sK[j * ld + d], a);
        acc[x] = a;
      }
    }
  }
  if (row_valid) {
    T* dq = p.dq + row_offset(b, p.seq, i, p.heads, h, D);
#pragma unroll
    for (int x = 0; x < kDpt; ++x) {
      const int d = c + x * kTpr;
      if (d < D) dq[d] = from_f32<T>(acc[x] * p.scale);
    }
  }
}

// dk, dv for one (key tile, kv head, sequence): dk_j = scale Σ_{h in group, i >= j} dS_ij q_i and
// dv_j = Σ p_ij dout_i, the query heads of the group in order, the query tiles of each in order.
template <typename T, int kTpr, int kDpt>
__global__ void __launch_bounds__(kCols * kTpr, 1) attention_dkdv_kernel(const __grid_constant__ AttentionParams<T> p) {
  extern __shared__ float smem[];
  const int D = p.head_dim, ld = D + 1;
  float* sK = smem;                  // [kCols][ld]
  float* sV = sK + kCols * ld;       // [kCols][ld]
  float* sQ = sV + kCols * ld;       // [kRows][ld]
  float* sG = sQ + kRows * ld;       // dout [kRows][ld]
  float* sP = sG + kRows * ld;       // p [kCols][kRows + 1] (key-major: transposed)
  float* sS = sP + kCols * (kRows + 1);  // dS [kCols][kRows + 1]
  float* sLse = sS + kCols * (kRows + 1);  // [kRows]
  float* sDi = sLse + kRows;              // [kRows]
  const int r = threadIdx.x / kTpr, c = threadIdx.x % kTpr;  // r: this thread's key row in the tile
  const int64_t k0 = int64_t(blockIdx.x) * kCols, b = blockIdx.z;
  const int kvh = blockIdx.y, group = p.heads / p.kv_heads;
  const int k_rows = int(min64(kCols, p.seq - k0));
  const int64_t j = k0 + r;
  const bool key_valid = j < p.seq;

  load_tile(sK, p.k + row_offset(b, p.seq, k0, p.kv_heads, kvh, D), k_rows, kCols, int64_t(p.kv_heads) * D, D, ld);
  load_tile(sV, p.v + row_offset(b, p.seq, k0, p.kv_heads, kvh, D), k_rows, kCols, int64_t(p.kv_heads) * D, D, ld);
  float dk_acc[kDpt], dv_acc[kDpt];
#pragma unroll
  for (int x = 0; x < kDpt; ++x) dk_acc[x] = dv_acc[x] = 0.f;

  for (int g = 0; g < group; ++g) {
    const int h = kvh * group + g;
    // Queries before k0 see none of these keys: start at the query tile holding query k0.
    for (int64_t q0 = k0 / kRows * kRows; q0 < p.seq; q0 += kRows) {
      const int q_rows = int(min64(kRows, p.seq - q0));
      __syncthreads();  // the previous query tile's reads are done (and sK, sV are loaded, first time)
      load_tile(sQ, p.q + row_offset(b, p.seq, q0, p.heads, h, D), q_rows, kRows, int64_t(p.heads) * D, D, ld);
      load_tile(sG, p.dout + row_offset(b, p.seq, q0, p.heads, h, D), q_rows, kRows, int64_t(p.heads) * D, D, ld);
      for (int x = threadIdx.x; x < kRows; x += blockDim.x) {
        const int64_t stat = (b * p.heads + h) * p.seq + q0 + x;
        sLse[x] = x < q_rows ? p.lse[stat] : 0.f;
        sDi[x] = x < q_rows ? p.di[stat] : 0.f;
      }
      __syncthreads();
      constexpr int kPerThread = kRows / kTpr;
#pragma unroll
      for (int x = 0; x < kPerThread; ++x) {
        const int il = c + x * kTpr;
        float pij = 0.f, ds = 0.f;
        if (key_valid && il < q_rows && q0 + il >= j) {
          const float* qi = sQ + il * ld;
          const float* gi = sG + il * ld;
          const float* kj = sK + r * ld;
          const float* vj = sV + r * ld;
          float s = 0.f, dp = 0.f;
#pragma unroll 4
          for (int d = 0; d < D; ++d) {
            s = fmaf(qi[d], kj[d], s);
            dp = fmaf(gi[d], vj[d], dp);
          }
          pij = expf(s * p.scale - sLse[il]);
          ds = pij * (dp - sDi[il]);
        }
        sP[r * (kRows + 1) + il] = pij;
        sS[r * (kRows + 1) + il] = ds;
      }
      __syncthreads();
#pragma unroll
      for (int x = 0; x < kDpt; ++x) {
        const int d = c + x * kTpr;
        if (d < D) {
          float a = dv_acc[x], e = dk_acc[x];
          for (int il = 0; il < q_rows; ++il) {
            a = fmaf(sP[r * (kRows + 1) + il], sG[il * ld + d], a);
            e = fmaf(sS[r * (kRows + 1) + il], sQ[il * ld + d], e);
          }
          dv_acc[x] = a;
          dk_acc[x] = e;
        }
      }
    }
  }
  if (key_valid) {
    T* dk = p.dk + row_offset(b, p.seq, j, p.kv_heads, kvh, D);
    T* dv = p.dv + row_offset(b, p.seq, j, p.kv_heads, kvh, D);
#pragma unroll
    for (int x = 0; x < kDpt; ++x) {
      const int d = c + x * kTpr;
      if (d < D) {
        dk[d] = from_f32<T>(dk_acc[x] * p.scale);
        dv[d] = from_f32<T>(dv_acc[x]);
      }
    }
  }
}

// ---- launch ------------------------------------------------------------------------------------------

void check_sizes(int64_t batch, int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim) {
  DMOE_CUDA_REQUIRE(batch > 0 && seq > 0 && heads > 0 && kv_heads > 0 && heads % kv_heads == 0,
                    "attention: batch = %lld, seq = %lld must be positive and heads = %d a positive multiple of "
                    "kv_heads = %d", (long long)batch, (long long)seq, heads, kv_heads);
  DMOE_CUDA_REQUIRE(head_dim > 0 && head_dim <= kMaxHeadDim && head_dim % 2 == 0,
                    "attention: head_dim = %lld must be even and in [2, %d]", (long long)head_dim, kMaxHeadDim);
  DMOE_CUDA_REQUIRE(batch <= 65535 && heads <= 65535, "attention: batch = %lld and heads = %d must be <= 65535 "
                    "(grid dimensions)", (long long)batch, heads);
}

// Sets the kernel's dynamic shared memory limit (above the default 48 KB for large head_dim) and launches it.
template <typename T>
void run_kernel(void (*kernel)(AttentionParams<T>), dim3 grid, int threads, size_t smem, cudaStream_t stream,
                const AttentionParams<T>& p) {
  DMOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  kernel<<<grid, threads, smem, stream>>>(p);
  DMOE_CHECK_LAUNCH();
}

// Calls f.template operator()<kTpr, kDpt>() with the smallest configuration that covers head_dim.
template <typename F>
void with_config(int64_t head_dim, F&& f) {
  if (head_dim <= 8) f.template operator()<4, 2>();
  else if (head_dim <= 32) f.template operator()<4, 8>();
  else if (head_dim <= 64) f.template operator()<4, 16>();
  else if (head_dim <= 128) f.template operator()<4, 32>();
  else f.template operator()<8, 32>();
}

template <typename T>
AttentionParams<T> make_params(int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim) {
  AttentionParams<T> p{};
  p.seq = seq;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = int32_t(head_dim);
  p.scale = float(1.0 / std::sqrt(double(head_dim)));
  return p;
}

}  // namespace

template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, float* lse, int64_t batch, int64_t seq,
                       int32_t heads, int32_t kv_heads, int64_t head_dim, Workspace& ws, cudaStream_t stream) {
  check_sizes(batch, seq, heads, kv_heads, head_dim);
  AttentionParams<T> p = make_params<T>(seq, heads, kv_heads, head_dim);
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = out;
  p.lse = lse;
  const dim3 grid(unsigned((seq + kRows - 1) / kRows), unsigned(heads), unsigned(batch));
  with_config(head_dim, [&]<int kTpr, int kDpt>() {
    run_kernel<T>(attention_forward_kernel<T, kTpr, kDpt>, grid, kRows * kTpr, forward_smem(int(head_dim)), stream, p);
  });
}

template <typename T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const float* lse, const T* dout, T* dq,
                        T* dk, T* dv, int64_t batch, int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim,
                        Workspace& ws, cudaStream_t stream) {
  check_sizes(batch, seq, heads, kv_heads, head_dim);
  AttentionParams<T> p = make_params<T>(seq, heads, kv_heads, head_dim);
  p.q = q;
  p.k = k;
  p.v = v;
  p.out = out;
  p.dout = dout;
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.lse = const_cast<float*>(lse);  // read only in the backward kernels
  const int64_t rows = batch * seq * heads;
  p.di = static_cast<float*>(ws.reserve(size_t(rows) * sizeof(float), stream));

  attention_di_kernel<T><<<grid_for(rows, 256 / kWarp), 256, 0, stream>>>(p, rows);
  DMOE_CHECK_LAUNCH();
  const dim3 q_grid(unsigned((seq + kRows - 1) / kRows), unsigned(heads), unsigned(batch));
  const dim3 k_grid(unsigned((seq + kCols - 1) / kCols), unsigned(kv_heads), unsigned(batch));
  with_config(head_dim, [&]<int kTpr, int kDpt>() {
    run_kernel<T>(attention_dq_kernel<T, kTpr, kDpt>, q_grid, kRows * kTpr, dq_smem(int(head_dim)), stream, p);
    run_kernel<T>(attention_dkdv_kernel<T, kTpr, kDpt>, k_grid, kCols * kTpr, dkdv_smem(int(head_dim)), stream, p);
  });
}

#define DMOE_INSTANTIATE_ATTENTION(T)                                                                          \
  template void attention_forward<T>(const T*, const T*, const T*, T*, float*, int64_t, int64_t, int32_t,      \
                                     int32_t, int64_t, Workspace&, cudaStream_t);                              \
  template void attention_backward<T>(const T*, const T*, const T*, const T*, const float*, const T*, T*, T*,  \
                                      T*, int64_t, int64_t, int32_t, int32_t, int64_t, Workspace&, cudaStream_t);

DMOE_INSTANTIATE_ATTENTION(float)
DMOE_INSTANTIATE_ATTENTION(bf16)

}  // namespace dmoe::cuda
