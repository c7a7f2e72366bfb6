// comm/cuda/peer_reduce.cu — see peer_reduce.hpp.
#include "comm/cuda/peer_reduce.hpp"

#include "cuda/check.hpp"

namespace dmoe {
namespace {

template <typename T>
__global__ void peer_reduce_kernel(PeerPointers peers, int32_t world, T* __restrict__ dst, int64_t begin, int64_t end) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end; i += stride) {
    T sum = static_cast<const T*>(peers.pe[0])[i];
    for (int32_t p = 1; p < world; ++p) sum += static_cast<const T*>(peers.pe[p])[i];
    dst[i] = sum;
  }
}

// f32 in float4 packs where the slice and every buffer are 16-byte aligned (the common case: slices start at
// multiples of 64 elements of 256-byte aligned buffers).
__global__ void peer_reduce_f32x4(PeerPointers peers, int32_t world, float4* __restrict__ dst, int64_t begin4,
                                  int64_t end4) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = begin4 + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end4; i += stride) {
    float4 sum = static_cast<const float4*>(peers.pe[0])[i];
    for (int32_t p = 1; p < world; ++p) {
      const float4 v = static_cast<const float4*>(peers.pe[p])[i];
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    dst[i] = sum;
  }
}

template <typename T>
void launch(const PeerPointers& peers, int32_t world, void* dst, int64_t begin, int64_t end, cudaStream_t stream) {
  const int64_t n = end - begin;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 2048));
  peer_reduce_kernel<T><<<blocks, 256, 0, stream>>>(peers, world, static_cast<T*>(dst), begin, end);
  DMOE_CHECK_LAUNCH();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void peer_reduce_slice(const PeerPointers& peers, int32_t world, void* dst, int64_t begin, int64_t end, DType dtype,
                       cudaStream_t stream) {
  DMOE_CUDA_REQUIRE(world >= 1 && world <= kPeerReduceMaxPes, "peer_reduce_slice: %d PEs (allowed 1..%d)", world,
                    kPeerReduceMaxPes);
  if (end <= begin) return;
  switch (dtype) {
    case DType::f32: {
      bool vec = begin % 4 == 0 && end % 4 == 0 && aligned16(dst);
      for (int32_t p = 0; p < world && vec; ++p) vec = aligned16(peers.pe[p]);
      if (vec) {
        const int64_t n4 = (end - begin) / 4;
        const unsigned blocks = unsigned(std::min<int64_t>((n4 + 255) / 256, 2048));
        peer_reduce_f32x4<<<blocks, 256, 0, stream>>>(peers, world, static_cast<float4*>(dst), begin / 4, end / 4);
        DMOE_CHECK_LAUNCH();
      } else {
        launch<float>(peers, world, dst, begin, end, stream);
      }
      return;
    }
    case DType::f64: launch<double>(peers, world, dst, begin, end, stream); return;
    case DType::i32: launch<int32_t>(peers, world, dst, begin, end, stream); return;
    case DType::i64: launch<int64_t>(peers, world, dst, begin, end, stream); return;
    case DType::bf16: break;
  }
  DMOE_CUDA_REQUIRE(false, "peer_reduce_slice: dtype %d is not supported (f32, f64, i32, i64)", int(dtype));
}

}  // namespace dmoe
