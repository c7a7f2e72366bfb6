// cuda/activation.cuh — the experts' activations on the device (f32; the same formulas as the CPU's,
// which evaluates them in fp64): used by the elementwise activation kernels (expert_ffn.cu) and the own
// grouped GEMM's fused epilogue (grouped_gemm_sm90.cu), so both paths give identical bits.
// Device code only (include from .cu files).
#pragma once

#include <cuda_runtime.h>

#include "cuda/kernels.cuh"

namespace dmoe::cuda {

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

template <Activation A>
__device__ __forceinline__ float act_value(float x) {
  if constexpr (A == Activation::relu) {
    return x > 0.f ? x : 0.f;
  } else if constexpr (A == Activation::gelu) {
    return 0.5f * x * (1.f + erff(x * kInvSqrt2));
  } else {
    // silu, the gate half of SwiGLU. __fdividef (within 2 ulp; 0 where 1 + e^-x overflows, the limit) and not
    // '/': IEEE division calls a slow-path subroutine whose ABI made the own GEMM's fused SwiGLU consumer
    // (at ptxas's 168-register limit) spill into a stack frame; that kernel hung on the H200 (docs/perf.md).
    return __fdividef(x, 1.f + expf(-x));
  }
}

template <Activation A>
__device__ __forceinline__ float act_derivative(float x) {
  if constexpr (A == Activation::relu) {
    return x > 0.f ? 1.f : 0.f;
  } else if constexpr (A == Activation::gelu) {
    // d/dx [x·Φ(x)] = Φ(x) + x·φ(x)
    return 0.5f * (1.f + erff(x * kInvSqrt2)) + x * kInvSqrt2Pi * expf(-0.5f * x * x);
  } else {
    // d/dx [x·σ(x)] = σ(x)·(1 + x·(1 − σ(x)))
    const float s = 1.f / (1.f + expf(-x));
    return s * (1.f + x * (1.f - s));
  }
}

}  // namespace dmoe::cuda
