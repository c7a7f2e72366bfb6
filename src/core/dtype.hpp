// dtype.hpp — element types and a host/device bfloat16 with round-to-nearest-even conversion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DMOE_HD __host__ __device__ __forceinline__
#else
#define DMOE_HD inline
#endif

namespace dmoe {

enum class DType : uint8_t { f32, bf16, f64, i32, i64 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f64: return 8;
    case DType::i32: return 4;
    case DType::i64: return 8;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}

// bfloat16 as raw bits; conversions round to nearest even and keep NaN a NaN.
struct bfloat16 {
  uint16_t bits;
};

DMOE_HD uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

DMOE_HD float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

DMOE_HD bfloat16 float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bfloat16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bfloat16{uint16_t(u >> 16)};
}

DMOE_HD float bf16_to_float(bfloat16 b) { return bits_float(uint32_t(b.bits) << 16); }

// The value a float takes after being stored as bf16 (used by the CPU engine to emulate bf16 storage).
DMOE_HD float round_to_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// The value a kernel stores for v: the float, or the float a bf16 buffer would hold (the CPU kernels' twins of
// the GPU's rounding on store).
inline float stored_value(double v, DType storage) {
  const float f = float(v);
  return storage == DType::bf16 ? round_to_bf16(f) : f;
}

}  // namespace dmoe
