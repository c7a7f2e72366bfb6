// cuda/device_utils.cuh — device helpers shared by the kernels: storage <-> f32 conversion, packed
// 16-byte loads/stores of N elements, warp reductions and scans, launch-geometry helpers.
// Device code only (include from .cu files).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dmoe::cuda {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Elements of T in 32-bit words: a word holds one f32 or two bf16 (element 0 in the low half).
template <typename T>
struct WordCodec;
template <>
struct WordCodec<float> {
  static constexpr int kPerWord = 1;
  __device__ __forceinline__ static float get(uint32_t w, int) { return __uint_as_float(w); }
  __device__ __forceinline__ static uint32_t pack(const float* v) { return __float_as_uint(v[0]); }
};
template <>
struct WordCodec<__nv_bfloat16> {
  static constexpr int kPerWord = 2;
  // bf16 -> f32 is exact: the bf16 bits are the high half of the f32.
  __device__ __forceinline__ static float get(uint32_t w, int i) {
    return __uint_as_float(i == 0 ? (w << 16) : (w & 0xffff0000u));
  }
  __device__ __forceinline__ static uint32_t pack(const float* v) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(v[0]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(v[1]));
    return lo | (hi << 16);
  }
};

// Loads N consecutive elements as f32. N == 1 is a scalar access; otherwise N·sizeof(T) must be a
// multiple of 16 and p 16-byte aligned (the launchers check), so the load is N·sizeof(T)/16 LDG.128.
template <int N, typename T>
__device__ __forceinline__ void load_f32(const T* p, float (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = to_f32(*p);
  } else {
    static_assert((N * sizeof(T)) % 16 == 0, "vector access must be whole 16-byte chunks");
    constexpr int kChunks = int(N * sizeof(T) / 16);
    constexpr int kPerWord = WordCodec<T>::kPerWord;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(p)[c];
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int i = 0; i < kPerWord; ++i) out[(c * 4 + w) * kPerWord + i] = WordCodec<T>::get(words[w], i);
    }
  }
}

// Stores N f32 values as T (same access rules as load_f32).
template <int N, typename T>
__device__ __forceinline__ void store_f32(T* p, const float (&v)[N]) {
  if constexpr (N == 1) {
    *p = from_f32<T>(v[0]);
  } else {
    static_assert((N * sizeof(T)) % 16 == 0, "vector access must be whole 16-byte chunks");
    constexpr int kChunks = int(N * sizeof(T) / 16);
    constexpr int kPerWord = WordCodec<T>::kPerWord;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) words[w] = WordCodec<T>::pack(&v[(c * 4 + w) * kPerWord]);
      reinterpret_cast<uint4*>(p)[c] = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// Inclusive prefix sum over the lanes of a full warp.
template <typename I>
__device__ __forceinline__ I warp_inclusive_scan(I v, int lane) {
#pragma unroll
  for (int offset = 1; offset < kWarp; offset *= 2) {
    const I other = __shfl_up_sync(kFullMask, v, offset);
    if (lane >= offset) v += other;
  }
  return v;
}

__device__ __forceinline__ int lane_id() { return int(threadIdx.x) & (kWarp - 1); }

}  // namespace dmoe::cuda
