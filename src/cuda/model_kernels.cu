// cuda/model_kernels.cu — the dense part of a Mixtral model and its training step on the GPU (twins of
// cpu/model_kernels.cpp, declared in cuda/model_kernels.cuh): embedding, RMSNorm, rotary position
// embedding, linear (cuBLAS), softmax cross-entropy, AdamW, the gradient-norm reductions and add_into.
// Attention lives in cuda/attention.cu.
//
// Determinism: no atomics on values anywhere. Block and warp reductions combine in a fixed shape that
// depends only on the block size, and every launch geometry that shapes a sum (rows per block of the
// RMSNorm weight gradient, blocks of the fp64 reductions) is a function of the problem size alone, never
// of the device, so a result is bit-identical run to run (and across GPUs of another SM count).
//
// Rounding: where the CPU twin rounds in f32 (RMSNorm's y, RoPE's forward), the kernels use the
// explicitly rounded intrinsics (__fmul_rn, __fadd_rn) so that nvcc does not contract a product and a sum
// into one FMA; where the CPU works in fp64 (AdamW, RoPE's backward, scale_in_place) the kernels do too,
// with the same operation order, so those results match the CPU bit for bit on the same inputs.
//
// Vector access: row kernels read 16-byte packs (16/sizeof(T) elements) when the row length is a multiple
// of the pack and every pointer is 16-byte aligned, else single elements.
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"
#include "cuda/model_kernels.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;

// Elements of T in one 16-byte pack.
template <typename T>
constexpr int kPack = int(16 / sizeof(T));

bool all_aligned(std::initializer_list<const void*> pointers, size_t alignment) {
  for (const void* p : pointers)
    if (p != nullptr && !is_aligned(p, alignment)) return false;
  return true;
}

// Rows of `count` elements can be read in packs of N when count % N == 0 and the pointers are aligned.
template <int N>
bool packable(int64_t count, std::initializer_list<const void*> pointers) {
  return count % N == 0 && all_aligned(pointers, 16);
}

// Threads of a row kernel: enough for one pack per thread, a multiple of a warp, at most kThreads.
unsigned row_threads(int64_t packs) {
  const int64_t warps = (packs + kWarp - 1) / kWarp;
  return unsigned(std::clamp<int64_t>(warps, 1, kWarpsPerBlock) * kWarp);
}

// ---- reductions in a fixed order --------------------------------------------------------------------

// Butterfly sum over a full warp: every lane ends with the same value (each step adds a pair in either
// order, and addition is commutative), independent of anything but the lanes' inputs.
template <typename V>
__device__ __forceinline__ V warp_reduce_sum(V v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total. `scratch`
// holds 32 values; a leading barrier lets a loop call this again with the same scratch.
template <typename V>
__device__ __forceinline__ V block_reduce_sum(V v, V* scratch) {
  v = warp_reduce_sum(v);
  const int warp = int(threadIdx.x) / kWarp;
  const int lane = lane_id();
  const int warps = int(blockDim.x) / kWarp;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  V total = lane < warps ? scratch[lane] : V(0);
  return warp_reduce_sum(total);
}

// ---- embedding ------------------------------------------------------------------------------------

// One warp per output row, copying 16-byte units (U = uint4) or single elements (U = T).
template <typename U>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(const int32_t* __restrict__ tokens, const U* __restrict__ table, U* __restrict__ out,
                             int64_t n, int64_t row_units) {
  const int lane = lane_id();
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; t < n; t += num_warps) {
    const U* src = table + int64_t(tokens[t]) * row_units;
    U* dst = out + t * row_units;
    for (int64_t c = lane; c < row_units; c += kWarp) dst[c] = src[c];
  }
}

__global__ void __launch_bounds__(kThreads) iota_kernel(int32_t* __restrict__ out, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) out[i] = int32_t(i);
}

// Work item w = (sorted index i, column tile): a warp whose i starts a run of equal tokens (the first
// position of that token in the sorted order) sums dout over the run's positions, in position order (the
// sort is stable and the positions went in ascending), for its tile of 32·N columns, and adds the sum into
// dtable. Other items end at once. Each (token, column) is owned by exactly one warp: no atomics.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    embedding_backward_kernel(const uint32_t* __restrict__ sorted_tokens, const int32_t* __restrict__ sorted_pos,
                              const T* __restrict__ dout, float* __restrict__ dtable, int64_t n, int64_t hidden,
                              int64_t col_tiles) {
  const int lane = lane_id();
  const int64_t items = n * col_tiles;
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t w = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; w < items; w += num_warps) {
    const int64_t i = w / col_tiles;
    const int64_t tile = w - i * col_tiles;
    const uint32_t token = sorted_tokens[i];
    if (i > 0 && sorted_tokens[i - 1] == token) continue;  // not the first of its run (warp-uniform)
    const int64_t c = (tile * kWarp + lane) * N;
    if (c >= hidden) continue;
    float acc[N];
#pragma unroll
    for (int k = 0; k < N; ++k) acc[k] = 0.f;
    for (int64_t j = i; j < n && sorted_tokens[j] == token; ++j) {
      float v[N];
      load_f32<N>(dout + int64_t(sorted_pos[j]) * hidden + c, v);
#pragma unroll
      for (int k = 0; k < N; ++k) acc[k] += v[k];
    }
    float* row = dtable + int64_t(token) * hidden + c;
    float d[N];
    load_f32<N>(row, d);
#pragma unroll
    for (int k = 0; k < N; ++k) d[k] += acc[k];
    store_f32<N>(row, d);
  }
}

// ---- RMSNorm --------------------------------------------------------------------------------------

// One block per row (grid-stride over rows); thread i owns the packs i, i + blockDim, ... of the row.
template <typename T, int N>
__global__ void rmsnorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                       float* __restrict__ rstd, int64_t rows, int64_t hidden, float eps) {
  __shared__ float scratch[kWarp];
  const int64_t step = int64_t(blockDim.x) * N;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * hidden;
    float ss = 0.f;
    for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += step) {
      float v[N];
      load_f32<N>(xr + c, v);
#pragma unroll
      for (int k = 0; k < N; ++k) ss = fmaf(v[k], v[k], ss);
    }
    ss = block_reduce_sum(ss, scratch);
    // As HF: mean in f32, then 1/sqrt(mean + eps) (IEEE sqrt and division: no fast math in this build).
    const float s = 1.0f / sqrtf(__fdiv_rn(ss, float(hidden)) + eps);
    if (threadIdx.x == 0) rstd[r] = s;
    T* yr = y + r * hidden;
    for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += step) {
      float v[N], g[N], out[N];
      load_f32<N>(xr + c, v);
      load_f32<N>(w + c, g);
#pragma unroll
      for (int k = 0; k < N; ++k) out[k] = __fmul_rn(g[k], __fmul_rn(v[k], s));  // w ∘ (x · rstd), as the CPU
      store_f32<N>(yr + c, out);
    }
  }
}

// Block b takes rows [b·rows_per_block, (b+1)·rows_per_block): dx of each row, and the block's share of dw
// summed over its rows in order into shared memory (each thread owns the same columns on every row, so the
// shared accumulators have one writer each), written to partial[b, :] at the end.
template <typename T, int N>
__global__ void rmsnorm_backward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                        const float* __restrict__ rstd, const T* __restrict__ dy, T* __restrict__ dx,
                                        float* __restrict__ partial, int64_t rows, int64_t hidden,
                                        int64_t rows_per_block) {
  __shared__ float scratch[kWarp];
  extern __shared__ float dw_acc[];  // [hidden]
  const int64_t step = int64_t(blockDim.x) * N;
  for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += step)
#pragma unroll
    for (int k = 0; k < N; ++k) dw_acc[c + k] = 0.f;

  const int64_t r_begin = int64_t(blockIdx.x) * rows_per_block;
  const int64_t r_end = min(rows, r_begin + rows_per_block);
  for (int64_t r = r_begin; r < r_end; ++r) {
    const T* xr = x + r * hidden;
    const T* gr = dy + r * hidden;
    const float s = rstd[r];
    float dot = 0.f;  // Σ_j w_j dy_j x_j
    for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += step) {
      float xv[N], gv[N], wv[N];
      load_f32<N>(xr + c, xv);
      load_f32<N>(gr + c, gv);
      load_f32<N>(w + c, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) dot = fmaf(wv[k] * gv[k], xv[k], dot);
    }
    dot = block_reduce_sum(dot, scratch);
    const float coef = s * s * s * dot / float(hidden);
    T* dxr = dx + r * hidden;
    for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += step) {
      float xv[N], gv[N], wv[N], out[N];
      load_f32<N>(xr + c, xv);
      load_f32<N>(gr + c, gv);
      load_f32<N>(w + c, wv);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        out[k] = s * wv[k] * gv[k] - coef * xv[k];
        dw_acc[c + k] += gv[k] * xv[k] * s;
      }
      store_f32<N>(dxr + c, out);
    }
  }
  float* dst = partial + int64_t(blockIdx.x) * hidden;
  for (int64_t c = int64_t(threadIdx.x) * N; c < hidden; c += step)
#pragma unroll
    for (int k = 0; k < N; ++k) dst[c + k] = dw_acc[c + k];
}

// dw[i] += Σ_b partial[b, i], b in order (one thread per column).
__global__ void __launch_bounds__(kThreads)
    column_sum_kernel(const float* __restrict__ partial, float* __restrict__ dw, int64_t blocks, int64_t hidden) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < hidden; i += stride) {
    float acc = 0.f;
    for (int64_t b = 0; b < blocks; ++b) acc += partial[b * hidden + i];
    dw[i] += acc;
  }
}

// ---- rotary position embedding --------------------------------------------------------------------

constexpr int64_t kRopeMaxHalf = 512;  // head_dim <= 1024

// inv_freq[j] = 1 / theta^(2j/D) comes from the host (rope_launch), computed by the very expressions of the
// CPU twin (and of HF, which builds inv_freq on the host at initialisation): the device's powf may round
// differently, and at position s an ulp of inv_freq moves the angle by s ulps.
struct RopeParams {
  int64_t n, seq, heads, head_dim;
  float inv_freq[kRopeMaxHalf];
};

// Thread item = (token t, frequency j); it walks the heads of t, so the angle cos(s·inv_freq), sin(s·inv_freq)
// (f32, as HF) is computed once per item. Each item reads both halves' elements j and j + D/2 before writing
// them, and no other item touches them: x and y may alias.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kThreads) rope_kernel(const T* x, T* y, const __grid_constant__ RopeParams p) {
  const int64_t half = p.head_dim / 2;
  const int64_t item = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item < p.n * half) {
    const int64_t t = item / half;
    const int64_t j = item - t * half;
    const float angle = __fmul_rn(float(t % p.seq), p.inv_freq[j]);
    float c, sn;
    sincosf(angle, &sn, &c);
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t base = (t * p.heads + h) * p.head_dim;
      const float a = to_f32(x[base + j]);
      const float b = to_f32(x[base + j + half]);
      float lo, hi;
      if constexpr (!kBackward) {
        // HF: q·cos + rotate_half(q)·sin, each product rounded to f32, then the f32 sum.
        lo = __fadd_rn(__fmul_rn(a, c), __fmul_rn(-b, sn));
        hi = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
      } else {
        // The transpose, in fp64 as the CPU twin (the products of two floats are exact in fp64).
        lo = float(__dadd_rn(__dmul_rn(double(a), double(c)), __dmul_rn(double(b), double(sn))));
        hi = float(__dsub_rn(__dmul_rn(double(b), double(c)), __dmul_rn(double(a), double(sn))));
      }
      y[base + j] = from_f32<T>(lo);
      y[base + j + half] = from_f32<T>(hi);
    }
  }
}

// ---- softmax cross-entropy ------------------------------------------------------------------------

// Online logsumexp state: m = max so far, s = Σ exp(x − m). combine() is symmetric bit for bit (products
// and the sum rounded separately), so a butterfly leaves the same state in every lane.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ void online_add(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = __fadd_rn(__fmul_rn(a.s, expf(a.m - x)), 1.f);
    a.m = x;
  } else {
    a.s += x == -INFINITY ? 0.f : expf(x - a.m);  // NaN logits propagate into s
  }
}

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, __fadd_rn(a.s, b.s)};
  const float ea = a.m == -INFINITY ? 0.f : expf(a.m - m);
  const float eb = b.m == -INFINITY ? 0.f : expf(b.m - m);
  return {m, __fadd_rn(__fmul_rn(a.s, ea), __fmul_rn(b.s, eb))};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    MaxSum o;
    o.m = __shfl_xor_sync(kFullMask, v.m, offset);
    o.s = __shfl_xor_sync(kFullMask, v.s, offset);
    v = combine(v, o);
  }
  return v;
}

constexpr int kCeThreads = 256;
constexpr int64_t kCeMaxBlocks = 4096;

// Block b takes rows b, b + gridDim, ...: the row's logsumexp (online, f32; the final m + log(s) in fp64),
// and on thread 0 the block's fp64 loss and count over its rows in order.
template <int N>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_forward_kernel(const float* __restrict__ logits, const int32_t* __restrict__ targets,
                                 float* __restrict__ lse, double* __restrict__ loss_partial,
                                 int64_t* __restrict__ count_partial, int64_t rows, int64_t vocab,
                                 int32_t ignore_index) {
  __shared__ MaxSum scratch[kCeThreads / kWarp];
  const int warp = int(threadIdx.x) / kWarp;
  const int lane = lane_id();
  double loss = 0;
  int64_t count = 0;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    MaxSum st{-INFINITY, 0.f};
    for (int64_t c = int64_t(threadIdx.x) * N; c < vocab; c += int64_t(kCeThreads) * N) {
      float v[N];
      load_f32<N>(row + c, v);
#pragma unroll
      for (int k = 0; k < N; ++k) online_add(st, v[k]);
    }
    st = warp_combine(st);
    __syncthreads();  // the previous row's reads of scratch are done
    if (lane == 0) scratch[warp] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
      MaxSum total = scratch[0];
      for (int i = 1; i < kCeThreads / kWarp; ++i) total = combine(total, scratch[i]);
      const double l = double(total.m) + log(double(total.s));
      lse[r] = float(l);
      const int32_t target = targets[r];
      if (target != ignore_index) {
        // Targets outside [0, vocab) are the caller's error (checked on the host); they give NaN here
        // instead of an out-of-bounds read.
        const double picked = target >= 0 && target < vocab ? double(row[target]) : double(NAN);
        loss += l - picked;
        ++count;
      }
    }
  }
  if (threadIdx.x == 0) {
    loss_partial[blockIdx.x] = loss;
    count_partial[blockIdx.x] = count;
  }
}

// One block: the partials summed in a fixed shape (thread i takes i, i + blockDim, ... in order, then the
// block tree); overwrites the outputs.
constexpr int kFinalThreads = 256;

template <typename V>
__global__ void __launch_bounds__(kFinalThreads)
    final_sum_kernel(const V* __restrict__ partial, int64_t blocks, V* __restrict__ out) {
  __shared__ V scratch[kWarp];
  V acc = 0;
  for (int64_t i = threadIdx.x; i < blocks; i += kFinalThreads) acc += partial[i];
  acc = block_reduce_sum(acc, scratch);
  if (threadIdx.x == 0) *out = acc;
}

// dlogits = scale · (exp(x − lse) − onehot), one block per row (grid-stride); each thread reads its
// elements before writing them, so dlogits may alias logits (T = float).
template <typename T, int N>
__global__ void __launch_bounds__(kCeThreads)
    cross_entropy_backward_kernel(const float* logits, const int32_t* __restrict__ targets,
                                  const float* __restrict__ lse, T* dlogits, int64_t rows, int64_t vocab,
                                  int32_t ignore_index, float scale) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int32_t target = targets[r];
    const bool ignored = target == ignore_index;
    const float l = lse[r];
    const float* row = logits + r * vocab;
    T* d = dlogits + r * vocab;
    for (int64_t c = int64_t(threadIdx.x) * N; c < vocab; c += int64_t(kCeThreads) * N) {
      float v[N];
      if (ignored) {
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = 0.f;
      } else {
        load_f32<N>(row + c, v);
#pragma unroll
        for (int k = 0; k < N; ++k) {
          const float p = expf(v[k] - l);
          v[k] = scale * (p - (c + k == target ? 1.f : 0.f));
        }
      }
      store_f32<N>(d + c, v);
    }
  }
}

// ---- optimizer ------------------------------------------------------------------------------------

struct AdamWConsts {
  double lr, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, bc1, bc2, decay, grad_scale;
};

// The CPU twin's arithmetic, operation for operation in fp64 (explicitly rounded: no contraction into
// FMA). The gradient is first scaled and rounded to f32, which is what the CPU's scale_in_place stores
// before its adamw_step reads it (grad_scale = 1 leaves it unchanged).
template <typename T>
__device__ __forceinline__ void adamw_one(float& param, float grad, float& m, float& v, const AdamWConsts& k,
                                          T* copy) {
  const double g = double(float(__dmul_rn(double(grad), k.grad_scale)));
  const double mi = __dadd_rn(__dmul_rn(k.beta1, double(m)), __dmul_rn(k.one_minus_beta1, g));
  const double vi = __dadd_rn(__dmul_rn(k.beta2, double(v)), __dmul_rn(__dmul_rn(k.one_minus_beta2, g), g));
  m = float(mi);
  v = float(vi);
  const double update = __ddiv_rn(__ddiv_rn(mi, k.bc1), __dadd_rn(__dsqrt_rn(__ddiv_rn(vi, k.bc2)), k.eps));
  param = float(__dsub_rn(__dmul_rn(double(param), k.decay), __dmul_rn(k.lr, update)));
  if (copy != nullptr) *copy = from_f32<T>(param);
}

// kVec: param, grad, m, v are 16-byte aligned (and param_copy aligned to 4 elements): float4 accesses for
// the first n/4·4 elements; the last n % 4 elements (and everything when !kVec) one at a time.
// Four gradients as floats: one 16-byte load of f32, one 8-byte load of bf16 (each the float it holds).
__device__ __forceinline__ float4 load4_f32(const float* g, int64_t i) { return reinterpret_cast<const float4*>(g)[i]; }
__device__ __forceinline__ float4 load4_f32(const bf16* g, int64_t i) {
  const uint2 w = reinterpret_cast<const uint2*>(g)[i];
  const __nv_bfloat162 a = *reinterpret_cast<const __nv_bfloat162*>(&w.x), b = *reinterpret_cast<const __nv_bfloat162*>(&w.y);
  return make_float4(__low2float(a), __high2float(a), __low2float(b), __high2float(b));
}

// G: the gradient's type (f32, or bf16: a bf16 model's expert gradients), read as the float it holds.
template <typename T, typename G, bool kVec>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ param, const G* __restrict__ grad, float* __restrict__ m,
                 float* __restrict__ v, int64_t n, const __grid_constant__ AdamWConsts k, T* __restrict__ copy) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if constexpr (kVec) {
    const int64_t vecs = n / 4;
    for (int64_t i = first; i < vecs; i += stride) {
      float4 p = reinterpret_cast<float4*>(param)[i];
      const float4 g = load4_f32(grad, i);
      float4 mm = reinterpret_cast<float4*>(m)[i];
      float4 vv = reinterpret_cast<float4*>(v)[i];
      adamw_one<T>(p.x, g.x, mm.x, vv.x, k, nullptr);  // the copy is stored below, as one pack
      adamw_one<T>(p.y, g.y, mm.y, vv.y, k, nullptr);
      adamw_one<T>(p.z, g.z, mm.z, vv.z, k, nullptr);
      adamw_one<T>(p.w, g.w, mm.w, vv.w, k, nullptr);
      reinterpret_cast<float4*>(param)[i] = p;
      reinterpret_cast<float4*>(m)[i] = mm;
      reinterpret_cast<float4*>(v)[i] = vv;
      if (copy != nullptr) {
        if constexpr (std::is_same_v<T, float>) {
          reinterpret_cast<float4*>(copy)[i] = p;
        } else {
          const float f[4] = {p.x, p.y, p.z, p.w};
          uint2 packed;
          packed.x = WordCodec<T>::pack(f);
          packed.y = WordCodec<T>::pack(f + 2);
          reinterpret_cast<uint2*>(copy)[i] = packed;
        }
      }
    }
    scalar_begin = vecs * 4;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride)
    adamw_one(param[i], to_f32(grad[i]), m[i], v[i], k, copy != nullptr ? copy + i : nullptr);
}

constexpr int64_t kSumMaxBlocks = 1024;

// Block b: thread i sums the squares of elements (or float4s) i + b·blockDim, then + gridDim·blockDim, ...
// in fp64; the block tree gives partial[b]. The geometry depends only on n (sum_of_squares).
template <typename G, bool kVec>
__global__ void __launch_bounds__(kThreads)
    sum_of_squares_kernel(const G* __restrict__ g, int64_t n, double* __restrict__ partial) {
  __shared__ double scratch[kWarp];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0;
  int64_t scalar_begin = 0;
  if constexpr (kVec) {
    const int64_t vecs = n / 4;
    for (int64_t i = first; i < vecs; i += stride) {
      const float4 x = load4_f32(g, i);
      acc = fma(double(x.x), double(x.x), acc);
      acc = fma(double(x.y), double(x.y), acc);
      acc = fma(double(x.z), double(x.z), acc);
      acc = fma(double(x.w), double(x.w), acc);
    }
    scalar_begin = vecs * 4;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) {
    const double x = double(to_f32(g[i]));
    acc = fma(x, x, acc);
  }
  acc = block_reduce_sum(acc, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads) scale_kernel(float* __restrict__ g, int64_t n, double scale) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if constexpr (kVec) {
    const int64_t vecs = n / 4;
    for (int64_t i = first; i < vecs; i += stride) {
      float4 x = reinterpret_cast<float4*>(g)[i];
      x.x = float(__dmul_rn(double(x.x), scale));
      x.y = float(__dmul_rn(double(x.y), scale));
      x.z = float(__dmul_rn(double(x.z), scale));
      x.w = float(__dmul_rn(double(x.w), scale));
      reinterpret_cast<float4*>(g)[i] = x;
    }
    scalar_begin = vecs * 4;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride) g[i] = float(__dmul_rn(double(g[i]), scale));
}

// ---- elementwise ------------------------------------------------------------------------------------

// N = 1, or a pack with both pointers aligned: packs for the first n/N·N elements, then single ones.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) add_into_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if constexpr (N > 1) {
    const int64_t packs = n / N;
    for (int64_t i = first; i < packs; i += stride) {
      float a[N], b[N];
      load_f32<N>(dst + i * N, a);
      load_f32<N>(src + i * N, b);
#pragma unroll
      for (int k = 0; k < N; ++k) a[k] += b[k];
      store_f32<N>(dst + i * N, a);
    }
    scalar_begin = packs * N;
  }
  for (int64_t i = scalar_begin + first; i < n; i += stride)
    dst[i] = from_f32<T>(to_f32(dst[i]) + to_f32(src[i]));
}

unsigned elementwise_grid(int64_t work) { return grid_for(work, kThreads, 8192); }

}  // namespace

// ---- embedding ------------------------------------------------------------------------------------

template <typename T>
void embedding_forward(const int32_t* tokens, const T* table, T* out, int64_t n, int64_t vocab, int64_t hidden,
                       cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return;
  const unsigned grid = grid_for(n, kWarpsPerBlock, 65535);
  if (packable<kPack<T>>(hidden, {table, out})) {
    embedding_forward_kernel<uint4><<<grid, kThreads, 0, stream>>>(
        tokens, reinterpret_cast<const uint4*>(table), reinterpret_cast<uint4*>(out), n, hidden / kPack<T>);
  } else {
    embedding_forward_kernel<T><<<grid, kThreads, 0, stream>>>(tokens, table, out, n, hidden);
  }
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void embedding_backward(const int32_t* tokens, const T* dout, float* dtable, int64_t n, int64_t vocab, int64_t hidden,
                        Workspace& ws, cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return;
  DMOE_CUDA_REQUIRE(n <= INT32_MAX, "embedding_backward: %lld positions; at most 2^31 - 1 are supported",
                    (long long)n);
  DMOE_CUDA_REQUIRE(vocab > 0 && vocab <= INT32_MAX, "embedding_backward: vocab = %lld is outside [1, 2^31)",
                    (long long)vocab);
  int end_bit = 1;  // sort only the bits a token in [0, vocab) can have
  while (end_bit < 31 && (int64_t(1) << end_bit) < vocab) ++end_bit;

  const uint32_t* keys_in = reinterpret_cast<const uint32_t*>(tokens);  // tokens are >= 0: same order
  size_t sort_bytes = 0;
  DMOE_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in, static_cast<uint32_t*>(nullptr),
                                                  static_cast<const int32_t*>(nullptr),
                                                  static_cast<int32_t*>(nullptr), int(n), 0, end_bit, stream));
  ScratchLayout layout;
  const size_t keys_at = layout.add(size_t(n) * sizeof(uint32_t));
  const size_t pos_in_at = layout.add(size_t(n) * sizeof(int32_t));
  const size_t pos_out_at = layout.add(size_t(n) * sizeof(int32_t));
  const size_t sort_at = layout.add(sort_bytes);
  char* base = static_cast<char*>(ws.reserve(layout.total(), stream));
  auto* keys_out = reinterpret_cast<uint32_t*>(base + keys_at);
  auto* pos_in = reinterpret_cast<int32_t*>(base + pos_in_at);
  auto* pos_out = reinterpret_cast<int32_t*>(base + pos_out_at);

  iota_kernel<<<elementwise_grid(n), kThreads, 0, stream>>>(pos_in, n);
  DMOE_CHECK_LAUNCH();
  DMOE_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(base + sort_at, sort_bytes, keys_in, keys_out, pos_in, pos_out,
                                                  int(n), 0, end_bit, stream));

  auto launch = [&](auto pack) {
    constexpr int N = decltype(pack)::value;
    const int64_t col_tiles = (hidden + int64_t(kWarp) * N - 1) / (int64_t(kWarp) * N);
    embedding_backward_kernel<T, N><<<grid_for(n * col_tiles, kWarpsPerBlock, 65535), kThreads, 0, stream>>>(
        keys_out, pos_out, dout, dtable, n, hidden, col_tiles);
  };
  if (packable<kPack<T>>(hidden, {dout, dtable}))
    launch(std::integral_constant<int, kPack<T>>{});
  else
    launch(std::integral_constant<int, 1>{});
  DMOE_CHECK_LAUNCH();
}

// ---- RMSNorm --------------------------------------------------------------------------------------

template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t hidden, float eps,
                     cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  const unsigned grid = grid_for(rows, 1, 65535);
  if (packable<kPack<T>>(hidden, {x, w, y})) {
    constexpr int N = kPack<T>;
    rmsnorm_forward_kernel<T, N><<<grid, row_threads(hidden / N), 0, stream>>>(x, w, y, rstd, rows, hidden, eps);
  } else {
    rmsnorm_forward_kernel<T, 1><<<grid, row_threads(hidden), 0, stream>>>(x, w, y, rstd, rows, hidden, eps);
  }
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void rmsnorm_backward(const T* x, const T* w, const float* rstd, const T* dy, T* dx, float* dw, int64_t rows,
                      int64_t hidden, Workspace& ws, cudaStream_t stream) {
  if (rows <= 0 || hidden <= 0) return;
  // The partition of the rows shapes dw's sum: it depends on `rows` alone. 16 rows a block up to 1024
  // blocks (16384 rows), then more rows a block. Scratch: [blocks, hidden] f32 partials.
  const int64_t blocks = std::clamp<int64_t>((rows + 15) / 16, 1, 1024);
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  const int64_t used_blocks = (rows + rows_per_block - 1) / rows_per_block;
  const size_t smem = size_t(hidden) * sizeof(float);
  DMOE_CUDA_REQUIRE(smem <= 200 * 1024, "rmsnorm_backward: hidden = %lld is larger than supported (51200)",
                    (long long)hidden);

  ScratchLayout layout;
  const size_t partial_at = layout.add(size_t(used_blocks) * size_t(hidden) * sizeof(float));
  float* partial = reinterpret_cast<float*>(static_cast<char*>(ws.reserve(layout.total(), stream)) + partial_at);

  auto launch = [&](auto pack) {
    constexpr int N = decltype(pack)::value;
    auto kernel = rmsnorm_backward_kernel<T, N>;
    if (smem > 48 * 1024)
      DMOE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    kernel<<<unsigned(used_blocks), row_threads(hidden / N), smem, stream>>>(x, w, rstd, dy, dx, partial, rows,
                                                                             hidden, rows_per_block);
  };
  if (packable<kPack<T>>(hidden, {x, w, dy, dx}))
    launch(std::integral_constant<int, kPack<T>>{});
  else
    launch(std::integral_constant<int, 1>{});
  DMOE_CHECK_LAUNCH();
  column_sum_kernel<<<grid_for(hidden, kThreads, 4096), kThreads, 0, stream>>>(partial, dw, used_blocks, hidden);
  DMOE_CHECK_LAUNCH();
}

// ---- rotary position embedding --------------------------------------------------------------------

namespace {

template <typename T, bool kBackward>
void rope_launch(const T* x, T* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                 cudaStream_t stream) {
  DMOE_CUDA_REQUIRE(head_dim > 0 && head_dim % 2 == 0, "rope: head_dim = %lld must be positive and even",
                    (long long)head_dim);
  DMOE_CUDA_REQUIRE(head_dim / 2 <= kRopeMaxHalf, "rope: head_dim = %lld is larger than supported (%lld)",
                    (long long)head_dim, (long long)(2 * kRopeMaxHalf));
  DMOE_CUDA_REQUIRE(seq > 0, "rope: seq = %lld must be positive", (long long)seq);
  DMOE_CUDA_REQUIRE(theta > 0, "rope: theta = %g must be positive", theta);
  if (n <= 0 || heads <= 0) return;
  RopeParams p{};
  p.n = n;
  p.seq = seq;
  p.heads = heads;
  p.head_dim = head_dim;
  for (int64_t j = 0; j < head_dim / 2; ++j) {  // the CPU twin's rope_angles, expression for expression
    const float exponent = float(2 * j) / float(head_dim);
    p.inv_freq[j] = 1.0f / std::pow(float(theta), exponent);
  }
  // One item a thread (a grid-stride loop keeps one more 64-bit value live across sincosf's slow-path call,
  // which ptxas spilled).
  rope_kernel<T, kBackward><<<grid_for(n * (head_dim / 2), kThreads, INT32_MAX), kThreads, 0, stream>>>(x, y, p);
  DMOE_CHECK_LAUNCH();
}

}  // namespace

template <typename T>
void rope_forward(const T* x, T* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                  cudaStream_t stream) {
  rope_launch<T, false>(x, y, n, seq, heads, head_dim, theta, stream);
}

template <typename T>
void rope_backward(const T* dy, T* dx, int64_t n, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                   cudaStream_t stream) {
  rope_launch<T, true>(dy, dx, n, seq, heads, head_dim, theta, stream);
}

// ---- linear ------------------------------------------------------------------------------------------

namespace {

cudaStream_t stream_of(cublasHandle_t cublas) {
  cudaStream_t stream = nullptr;
  DMOE_CHECK_CUBLAS(cublasGetStream(cublas, &stream));
  return stream;
}

}  // namespace

template <typename T, typename Y>
void linear_forward(const T* x, const T* w, Y* y, int64_t rows, int64_t in, int64_t out, cublasHandle_t cublas) {
  if (rows <= 0 || out <= 0) return;
  if (in <= 0) {  // an empty sum: y = 0
    DMOE_CHECK_CUDA(cudaMemsetAsync(y, 0, size_t(rows) * size_t(out) * sizeof(Y), stream_of(cublas)));
    return;
  }
  // y [rows, out] = x [rows, in] · w^T, w stored [out, in].
  gemm_rm(cublas, false, true, rows, out, in, 1.f, x, cuda_data_type<T>(), in, w, cuda_data_type<T>(), in, 0.f, y,
          cuda_data_type<Y>(), out);
}

template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, float* dw, int64_t rows, int64_t in, int64_t out,
                     cublasHandle_t cublas, bool accumulate_dx) {
  if (rows <= 0 || in <= 0) return;
  if (out <= 0) {  // dy has no columns: dx = 0 (or unchanged), dw has no rows
    if (dx != nullptr && !accumulate_dx)
      DMOE_CHECK_CUDA(cudaMemsetAsync(dx, 0, size_t(rows) * size_t(in) * sizeof(T), stream_of(cublas)));
    return;
  }
  if (dx != nullptr)  // dx [rows, in] = dy [rows, out] · w [out, in]
    gemm_rm(cublas, false, false, rows, in, out, 1.f, dy, cuda_data_type<T>(), out, w, cuda_data_type<T>(), in,
            accumulate_dx ? 1.f : 0.f, dx, cuda_data_type<T>(), in);
  // dw [out, in] += dy^T · x: op(A) = dy^T with dy stored [rows, out] (lda = out), B = x [rows, in].
  gemm_rm(cublas, true, false, out, in, rows, 1.f, dy, cuda_data_type<T>(), out, x, cuda_data_type<T>(), in, 1.f,
          dw, CUDA_R_32F, in);
}

// ---- softmax cross-entropy ---------------------------------------------------------------------------

void cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, double* loss_sum,
                           int64_t* count, int64_t rows, int64_t vocab, int32_t ignore_index, Workspace& ws,
                           cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) {  // no work, but the outputs still say so: 0 and 0
    DMOE_CHECK_CUDA(cudaMemsetAsync(loss_sum, 0, sizeof(double), stream));
    DMOE_CHECK_CUDA(cudaMemsetAsync(count, 0, sizeof(int64_t), stream));
    return;
  }
  const int64_t blocks = std::min(rows, kCeMaxBlocks);  // depends on rows only: the loss sums' shape
  ScratchLayout layout;
  const size_t loss_at = layout.add(size_t(blocks) * sizeof(double));
  const size_t count_at = layout.add(size_t(blocks) * sizeof(int64_t));
  char* base = static_cast<char*>(ws.reserve(layout.total(), stream));
  auto* loss_partial = reinterpret_cast<double*>(base + loss_at);
  auto* count_partial = reinterpret_cast<int64_t*>(base + count_at);
  if (packable<4>(vocab, {logits}))
    cross_entropy_forward_kernel<4><<<unsigned(blocks), kCeThreads, 0, stream>>>(
        logits, targets, lse, loss_partial, count_partial, rows, vocab, ignore_index);
  else
    cross_entropy_forward_kernel<1><<<unsigned(blocks), kCeThreads, 0, stream>>>(
        logits, targets, lse, loss_partial, count_partial, rows, vocab, ignore_index);
  DMOE_CHECK_LAUNCH();
  final_sum_kernel<double><<<1, kFinalThreads, 0, stream>>>(loss_partial, blocks, loss_sum);
  DMOE_CHECK_LAUNCH();
  final_sum_kernel<int64_t><<<1, kFinalThreads, 0, stream>>>(count_partial, blocks, count);
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse, T* dlogits,
                            int64_t rows, int64_t vocab, int32_t ignore_index, double scale, cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return;
  const unsigned grid = grid_for(rows, 1, 65535);
  constexpr int N = kPack<T>;  // 16 bytes of T; the logits then come in N·4 bytes, whole 16-byte chunks
  if (packable<N>(vocab, {logits, dlogits}))
    cross_entropy_backward_kernel<T, N><<<grid, kCeThreads, 0, stream>>>(logits, targets, lse, dlogits, rows, vocab,
                                                                         ignore_index, float(scale));
  else
    cross_entropy_backward_kernel<T, 1><<<grid, kCeThreads, 0, stream>>>(logits, targets, lse, dlogits, rows, vocab,
                                                                         ignore_index, float(scale));
  DMOE_CHECK_LAUNCH();
}

// ---- optimizer ---------------------------------------------------------------------------------------

namespace {

template <typename T, typename G>
void adamw_step_any(float* param, const G* grad, float* m, float* v, int64_t n, const cpu::AdamWParams& p,
                    double grad_scale, T* param_copy, cudaStream_t stream) {
  DMOE_CUDA_REQUIRE(p.step >= 1, "adamw: step = %lld must be >= 1 (bias corrections use 1 - beta^step)",
                    (long long)p.step);
  if (n <= 0) return;
  // The same host expressions as the CPU twin, so the constants are the same doubles.
  AdamWConsts k{};
  k.lr = p.lr;
  k.beta1 = p.beta1;
  k.one_minus_beta1 = 1.0 - p.beta1;
  k.beta2 = p.beta2;
  k.one_minus_beta2 = 1.0 - p.beta2;
  k.eps = p.eps;
  k.bc1 = 1.0 - std::pow(p.beta1, double(p.step));
  k.bc2 = 1.0 - std::pow(p.beta2, double(p.step));
  k.decay = 1.0 - p.lr * p.weight_decay;
  k.grad_scale = grad_scale;
  const bool vec = all_aligned({param, m, v}, 16) && is_aligned(grad, 4 * sizeof(G)) &&
                   (param_copy == nullptr || is_aligned(param_copy, 4 * sizeof(T)));
  if (vec)
    adamw_kernel<T, G, true><<<elementwise_grid((n + 3) / 4), kThreads, 0, stream>>>(param, grad, m, v, n, k,
                                                                                      param_copy);
  else
    adamw_kernel<T, G, false><<<elementwise_grid(n), kThreads, 0, stream>>>(param, grad, m, v, n, k, param_copy);
  DMOE_CHECK_LAUNCH();
}

template <typename G>
void sum_of_squares_any(const G* g, int64_t n, double* out, Workspace& ws, cudaStream_t stream) {
  if (n <= 0) {  // the empty sum
    DMOE_CHECK_CUDA(cudaMemsetAsync(out, 0, sizeof(double), stream));
    return;
  }
  // At least 16 elements a thread before another block is added; the count depends on n only.
  const int64_t blocks = std::clamp<int64_t>((n + kThreads * 16 - 1) / (kThreads * 16), 1, kSumMaxBlocks);
  ScratchLayout layout;
  const size_t partial_at = layout.add(size_t(blocks) * sizeof(double));
  auto* partial = reinterpret_cast<double*>(static_cast<char*>(ws.reserve(layout.total(), stream)) + partial_at);
  if (is_aligned(g, 4 * sizeof(G)))
    sum_of_squares_kernel<G, true><<<unsigned(blocks), kThreads, 0, stream>>>(g, n, partial);
  else
    sum_of_squares_kernel<G, false><<<unsigned(blocks), kThreads, 0, stream>>>(g, n, partial);
  DMOE_CHECK_LAUNCH();
  final_sum_kernel<double><<<1, kFinalThreads, 0, stream>>>(partial, blocks, out);
  DMOE_CHECK_LAUNCH();
}

}  // namespace

template <typename T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const cpu::AdamWParams& p,
                double grad_scale, T* param_copy, cudaStream_t stream) {
  adamw_step_any(param, grad, m, v, n, p, grad_scale, param_copy, stream);
}

template <typename T>
void adamw_step(float* param, const bf16* grad, float* m, float* v, int64_t n, const cpu::AdamWParams& p,
                double grad_scale, T* param_copy, cudaStream_t stream) {
  adamw_step_any(param, grad, m, v, n, p, grad_scale, param_copy, stream);
}

void sum_of_squares(const float* g, int64_t n, double* out, Workspace& ws, cudaStream_t stream) {
  sum_of_squares_any(g, n, out, ws, stream);
}

void sum_of_squares(const bf16* g, int64_t n, double* out, Workspace& ws, cudaStream_t stream) {
  sum_of_squares_any(g, n, out, ws, stream);
}

void scale_in_place(float* g, int64_t n, double scale, cudaStream_t stream) {
  if (n <= 0) return;
  if (is_aligned(g, 16))
    scale_kernel<true><<<elementwise_grid((n + 3) / 4), kThreads, 0, stream>>>(g, n, scale);
  else
    scale_kernel<false><<<elementwise_grid(n), kThreads, 0, stream>>>(g, n, scale);
  DMOE_CHECK_LAUNCH();
}

// ---- elementwise ------------------------------------------------------------------------------------

template <typename T>
void add_into(T* dst, const T* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int N = kPack<T>;
  if (all_aligned({dst, src}, 16))
    add_into_kernel<T, N><<<elementwise_grid((n + N - 1) / N), kThreads, 0, stream>>>(dst, src, n);
  else
    add_into_kernel<T, 1><<<elementwise_grid(n), kThreads, 0, stream>>>(dst, src, n);
  DMOE_CHECK_LAUNCH();
}

// ---- instantiations ----------------------------------------------------------------------------------

#define DMOE_INSTANTIATE_MODEL_KERNELS(T)                                                                          \
  template void embedding_forward<T>(const int32_t*, const T*, T*, int64_t, int64_t, int64_t, cudaStream_t);     \
  template void embedding_backward<T>(const int32_t*, const T*, float*, int64_t, int64_t, int64_t, Workspace&,   \
                                      cudaStream_t);                                                             \
  template void rmsnorm_forward<T>(const T*, const T*, T*, float*, int64_t, int64_t, float, cudaStream_t);       \
  template void rmsnorm_backward<T>(const T*, const T*, const float*, const T*, T*, float*, int64_t, int64_t,    \
                                    Workspace&, cudaStream_t);                                                   \
  template void rope_forward<T>(const T*, T*, int64_t, int64_t, int64_t, int64_t, double, cudaStream_t);         \
  template void rope_backward<T>(const T*, T*, int64_t, int64_t, int64_t, int64_t, double, cudaStream_t);        \
  template void linear_backward<T>(const T*, const T*, const T*, T*, float*, int64_t, int64_t, int64_t,          \
                                   cublasHandle_t, bool);                                                        \
  template void cross_entropy_backward<T>(const float*, const int32_t*, const float*, T*, int64_t, int64_t,      \
                                          int32_t, double, cudaStream_t);                                        \
  template void adamw_step<T>(float*, const float*, float*, float*, int64_t, const cpu::AdamWParams&, double, T*, \
                              cudaStream_t);                                                                     \
  template void adamw_step<T>(float*, const bf16*, float*, float*, int64_t, const cpu::AdamWParams&, double, T*,  \
                              cudaStream_t);                                                                     \
  template void add_into<T>(T*, const T*, int64_t, cudaStream_t);

DMOE_INSTANTIATE_MODEL_KERNELS(float)
DMOE_INSTANTIATE_MODEL_KERNELS(bf16)

template void linear_forward<float, float>(const float*, const float*, float*, int64_t, int64_t, int64_t,
                                           cublasHandle_t);
template void linear_forward<bf16, bf16>(const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, cublasHandle_t);
template void linear_forward<bf16, float>(const bf16*, const bf16*, float*, int64_t, int64_t, int64_t,
                                          cublasHandle_t);

}  // namespace dmoe::cuda
