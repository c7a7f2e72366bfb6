// cuda/permute.cu — data movement around the experts (twins of cpu/permute.cpp): gather tokens into the
// expert-major send buffer, move row segments between the receive buffer and the expert batch, combine
// expert outputs back into tokens (forward and backward), and the f32 <-> storage conversions.
//
// Copies move raw bytes in the widest unit the row length and the pointers allow (16 bytes when
// row_bytes % 16 == 0, down to one element), one warp per row. Combine kernels read 16-byte packs of
// 16/sizeof(T) elements when hidden is a multiple of that, and single elements otherwise; sums are f32
// over the k choices in order j = 0..k-1.
#include <algorithm>
#include <type_traits>

#include "cuda/common.hpp"
#include "cuda/device_utils.cuh"

namespace dmoe::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
// Segments per permute launch: their tables travel in the kernel parameters (about 6 KB; the limit is
// 32 KB), so no upload and no scratch memory are needed.
constexpr int kMaxSegmentsPerLaunch = 256;

// ---- row copies ---------------------------------------------------------------------------------

// One warp copies one row of `units` copy units: four loads in flight per lane before the stores.
// (Written out by hand: the compiler's own 4x unrolling of the plain loop spilled registers.)
template <typename U>
__device__ __forceinline__ void copy_row(const U* __restrict__ src, U* __restrict__ dst, int64_t units,
                                         int lane) {
  int64_t c = lane;
  for (; c + 3 * kWarp < units; c += 4 * kWarp) {
    const U v0 = src[c], v1 = src[c + kWarp], v2 = src[c + 2 * kWarp], v3 = src[c + 3 * kWarp];
    dst[c] = v0;
    dst[c + kWarp] = v1;
    dst[c + 2 * kWarp] = v2;
    dst[c + 3 * kWarp] = v3;
  }
#pragma unroll 1
  for (; c < units; c += kWarp) dst[c] = src[c];
}

template <typename U>
struct GatherParams {
  const U* x;           // [*, row_units]
  const int32_t* rows;  // [n] source row of each output row
  U* out;               // [n, row_units]
  int64_t n;
  int64_t row_units;  // row length in copy units
};

template <typename U>
__global__ void __launch_bounds__(kThreads) gather_rows_kernel(const __grid_constant__ GatherParams<U> p) {
  const int lane = lane_id();
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t i = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; i < p.n; i += num_warps) {
    // NOTE: rows[i] must be a valid row (it comes from a send plan's row_token); not checked here.
    copy_row(p.x + int64_t(p.rows[i]) * p.row_units, p.out + i * p.row_units, p.row_units, lane);
  }
}

template <typename U>
struct PermuteParams {
  const U* src;
  U* dst;
  int64_t row_units;
  int32_t segments;                              // <= kMaxSegmentsPerLaunch
  int64_t row_begin[kMaxSegmentsPerLaunch + 1];  // prefix sums of the counts: rows of segment s are
                                                 // [row_begin[s], row_begin[s+1]) of this launch
  int64_t src_offset[kMaxSegmentsPerLaunch];
  int64_t dst_offset[kMaxSegmentsPerLaunch];
};

template <typename U>
__global__ void __launch_bounds__(kThreads)
    permute_segments_kernel(const __grid_constant__ PermuteParams<U> p) {
  const int lane = lane_id();
  const int64_t total = p.row_begin[p.segments];
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; r < total; r += num_warps) {
    // Last segment whose first row is <= r (warp-uniform, so the parameter reads broadcast). Empty
    // segments share their begin with the next one; the search lands on the non-empty one holding r.
    int lo = 0, hi = p.segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.row_begin[mid] <= r)
        lo = mid;
      else
        hi = mid - 1;
    }
    const int64_t i = r - p.row_begin[lo];
    copy_row(p.src + (p.src_offset[lo] + i) * p.row_units, p.dst + (p.dst_offset[lo] + i) * p.row_units,
             p.row_units, lane);
  }
}

// Calls fn(unit) with the widest copy unit (uint4, uint2, uint32_t, uint16_t) that divides the row and
// every base pointer's alignment; fn launches the kernel instantiated for that unit.
template <typename Fn>
void with_copy_unit(size_t row_bytes, std::initializer_list<const void*> pointers, Fn&& fn) {
  auto fits = [&](size_t unit) {
    if (row_bytes % unit) return false;
    for (const void* p : pointers)
      if (!is_aligned(p, unit)) return false;
    return true;
  };
  if (fits(16))
    fn(uint4{});
  else if (fits(8))
    fn(uint2{});
  else if (fits(4))
    fn(uint32_t{});
  else
    fn(uint16_t{});
}

// ---- combine ------------------------------------------------------------------------------------

template <typename T>
struct CombineParams {
  const T* rows;         // [S, H]
  const int32_t* slot;   // [T, k], -1 dropped
  const float* weights;  // [T, k] or null (weight 1)
  const float* addend;   // [T, H] f32 or null
  T* y;                  // [T, H]
  int64_t tokens;
  int32_t top_k;
  int64_t hidden;
};

// One warp per token; each lane owns N consecutive columns per step.
template <typename T, int N>
__global__ void __launch_bounds__(kThreads) combine_kernel(const __grid_constant__ CombineParams<T> p) {
  const int lane = lane_id();
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; t < p.tokens; t += num_warps) {
    const int32_t* slot_t = p.slot + t * p.top_k;
    for (int64_t c = int64_t(lane) * N; c < p.hidden; c += int64_t(kWarp) * N) {
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.f;
      for (int32_t j = 0; j < p.top_k; ++j) {
        const int32_t s = slot_t[j];
        if (s < 0) continue;  // dropped by capacity
        const float w = p.weights != nullptr ? p.weights[t * p.top_k + j] : 1.f;
        float v[N];
        load_f32<N>(p.rows + int64_t(s) * p.hidden + c, v);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = fmaf(w, v[i], acc[i]);
      }
      if (p.addend != nullptr) {
        float a[N];
        load_f32<N>(p.addend + t * p.hidden + c, a);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] += a[i];
      }
      store_f32<N>(p.y + t * p.hidden + c, acc);
    }
  }
}

template <typename T>
struct CombineBackwardParams {
  const T* dy;           // [T, H]
  const T* rows;         // [S, H]
  const int32_t* slot;   // [T, k]
  const float* weights;  // [T, k] or null (weight 1)
  T* drows;              // [S, H]
  float* dweights;       // [T, k]
  int64_t tokens;
  int32_t top_k;
  int64_t hidden;
};

template <typename T, int N>
__global__ void __launch_bounds__(kThreads)
    combine_backward_kernel(const __grid_constant__ CombineBackwardParams<T> p) {
  const int lane = lane_id();
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; t < p.tokens; t += num_warps) {
    const T* dy_t = p.dy + t * p.hidden;
    for (int32_t j = 0; j < p.top_k; ++j) {
      const int64_t a = t * p.top_k + j;
      const int32_t s = p.slot[a];
      if (s < 0) {  // dropped: the weight did not contribute to y
        if (lane == 0) p.dweights[a] = 0.f;
        continue;
      }
      const float w = p.weights != nullptr ? p.weights[a] : 1.f;
      const T* row = p.rows + int64_t(s) * p.hidden;
      T* drow = p.drows + int64_t(s) * p.hidden;
      float dot = 0.f;
      for (int64_t c = int64_t(lane) * N; c < p.hidden; c += int64_t(kWarp) * N) {
        float g[N], v[N], out[N];
        load_f32<N>(dy_t + c, g);
        load_f32<N>(row + c, v);
#pragma unroll
        for (int i = 0; i < N; ++i) {
          dot = fmaf(g[i], v[i], dot);
          out[i] = w * g[i];
        }
        store_f32<N>(drow + c, out);
      }
      dot = warp_sum(dot);
      if (lane == 0) p.dweights[a] = dot;
    }
  }
}

// ---- conversions --------------------------------------------------------------------------------

template <typename From, typename To>
__global__ void __launch_bounds__(kThreads) convert_kernel(const From* in, To* out, int64_t count) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride)
    out[i] = from_f32<To>(to_f32(in[i]));
}

// Elements per 16-byte pack, when hidden and every pointer allow it; else 1.
template <typename T>
constexpr int kPack = int(16 / sizeof(T));

template <typename T>
bool can_pack(int64_t hidden, std::initializer_list<const void*> pointers) {
  if (hidden % kPack<T> != 0) return false;
  for (const void* p : pointers)
    if (p != nullptr && !is_aligned(p, 16)) return false;
  return true;
}

unsigned warp_grid(int64_t items) { return grid_for(items, kWarpsPerBlock, int64_t(1) << 16); }

}  // namespace

template <typename T>
void convert_from_f32(const float* in, T* out, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  convert_kernel<float, T><<<grid_for(count, kThreads, 4096), kThreads, 0, stream>>>(in, out, count);
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void convert_to_f32(const T* in, float* out, int64_t count, cudaStream_t stream) {
  if (count <= 0) return;
  convert_kernel<T, float><<<grid_for(count, kThreads, 4096), kThreads, 0, stream>>>(in, out, count);
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void gather_rows(const T* x, const int32_t* rows, T* out, int64_t n, int64_t hidden, cudaStream_t stream) {
  if (n <= 0 || hidden <= 0) return;
  const size_t row_bytes = size_t(hidden) * sizeof(T);
  with_copy_unit(row_bytes, {x, out}, [&](auto unit) {
    using U = decltype(unit);
    GatherParams<U> p{reinterpret_cast<const U*>(x), rows, reinterpret_cast<U*>(out), n,
                      int64_t(row_bytes / sizeof(U))};
    gather_rows_kernel<U><<<warp_grid(n), kThreads, 0, stream>>>(p);
    DMOE_CHECK_LAUNCH();
  });
}

template <typename T>
void permute_segments(const T* src, T* dst, const int64_t* src_offsets, const int64_t* dst_offsets,
                      const int64_t* counts, int64_t segments, int64_t hidden, cudaStream_t stream) {
  if (segments <= 0 || hidden <= 0) return;
  const size_t row_bytes = size_t(hidden) * sizeof(T);
  with_copy_unit(row_bytes, {src, dst}, [&](auto unit) {
    using U = decltype(unit);
    for (int64_t first = 0; first < segments; first += kMaxSegmentsPerLaunch) {
      PermuteParams<U> p{};
      p.src = reinterpret_cast<const U*>(src);
      p.dst = reinterpret_cast<U*>(dst);
      p.row_units = int64_t(row_bytes / sizeof(U));
      p.segments = int32_t(std::min<int64_t>(kMaxSegmentsPerLaunch, segments - first));
      for (int32_t s = 0; s < p.segments; ++s) {
        const int64_t g = first + s;
        DMOE_CUDA_REQUIRE(counts[g] >= 0 && src_offsets[g] >= 0 && dst_offsets[g] >= 0,
                          "permute_segments: segment %lld has count %lld, src offset %lld, dst offset %lld; "
                          "all must be >= 0",
                          (long long)g, (long long)counts[g], (long long)src_offsets[g],
                          (long long)dst_offsets[g]);
        p.row_begin[s + 1] = p.row_begin[s] + counts[g];
        p.src_offset[s] = src_offsets[g];
        p.dst_offset[s] = dst_offsets[g];
      }
      const int64_t rows = p.row_begin[p.segments];
      if (rows == 0) continue;
      permute_segments_kernel<U><<<warp_grid(rows), kThreads, 0, stream>>>(p);
      DMOE_CHECK_LAUNCH();
    }
  });
}

template <typename T>
void combine(const T* rows, const int32_t* slot, const float* weights, const float* addend, T* y,
             int64_t tokens, int32_t top_k, int64_t hidden, cudaStream_t stream) {
  if (tokens <= 0 || hidden <= 0) return;
  CombineParams<T> p{rows, slot, weights, addend, y, tokens, top_k, hidden};
  if (can_pack<T>(hidden, {rows, y, addend}))
    combine_kernel<T, kPack<T>><<<warp_grid(tokens), kThreads, 0, stream>>>(p);
  else
    combine_kernel<T, 1><<<warp_grid(tokens), kThreads, 0, stream>>>(p);
  DMOE_CHECK_LAUNCH();
}

template <typename T>
void combine_backward(const T* dy, const T* rows, const int32_t* slot, const float* weights, T* drows,
                      float* dweights, int64_t tokens, int32_t top_k, int64_t hidden, cudaStream_t stream) {
  if (tokens <= 0) return;
  CombineBackwardParams<T> p{dy, rows, slot, weights, drows, dweights, tokens, top_k, hidden};
  if (can_pack<T>(hidden, {dy, rows, drows}))
    combine_backward_kernel<T, kPack<T>><<<warp_grid(tokens), kThreads, 0, stream>>>(p);
  else
    combine_backward_kernel<T, 1><<<warp_grid(tokens), kThreads, 0, stream>>>(p);
  DMOE_CHECK_LAUNCH();
}

#define DMOE_INSTANTIATE_PERMUTE(T)                                                                        \
  template void convert_from_f32<T>(const float*, T*, int64_t, cudaStream_t);                              \
  template void convert_to_f32<T>(const T*, float*, int64_t, cudaStream_t);                                \
  template void gather_rows<T>(const T*, const int32_t*, T*, int64_t, int64_t, cudaStream_t);              \
  template void permute_segments<T>(const T*, T*, const int64_t*, const int64_t*, const int64_t*, int64_t, \
                                    int64_t, cudaStream_t);                                                \
  template void combine<T>(const T*, const int32_t*, const float*, const float*, T*, int64_t, int32_t,     \
                           int64_t, cudaStream_t);                                                         \
  template void combine_backward<T>(const T*, const T*, const int32_t*, const float*, T*, float*, int64_t, \
                                    int32_t, int64_t, cudaStream_t);

DMOE_INSTANTIATE_PERMUTE(float)
DMOE_INSTANTIATE_PERMUTE(bf16)

}  // namespace dmoe::cuda
