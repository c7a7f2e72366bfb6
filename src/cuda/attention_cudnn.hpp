// cuda/attention_cudnn.hpp — causal grouped-query attention on cuDNN's fused flash-attention kernels (bf16),
// through the header-only cudnn-frontend graph API. The fast path beside the own kernels of
// cuda/attention.cu, with exactly their semantics and layouts (cuda/model_kernels.cuh, cpu/model_kernels.hpp):
//   q, out [n, Hq, D], k, v [n, Hkv, D] bf16 (n = batch·seq, token t = b·seq + s: cuDNN's BSHD layout, given
//   to it as strides of its [B, H, S, D] view); query head h reads kv head h / (Hq/Hkv); causal (key j
//   visible to query i iff j <= i: cuDNN's top-left aligned diagonal band, right bound 0, which for equal
//   query and key lengths is HF's causal mask); scale 1/sqrt(D); lse [B, Hq, S] f32.
// lse is cuDNN's "Stats" output as it comes: the natural-log logsumexp of the scaled (and masked) scores of
// each query row, the same quantity as the own kernels' lse, so either path's forward feeds either backward.
//
// Built with the frontend found (cmake/FindCudnnFrontend.cmake), libcudnn.so.9 is loaded at run time
// (dlopen; nothing is linked): DMOE_CUDNN_LIBRARY (a path) if set, else libcudnn.so.9 on the loader's path,
// else the library the configure step found. Without the frontend the class is a stub: available() is false
// and says so, the other members throw.
//
// One object per stream user: it owns a cuDNN handle (bound to the stream of each call), the graphs built so
// far (one per shape and direction, built on first use: a build takes a while, later calls only execute),
// and a grow-only workspace. Not thread-safe; calls on one object are issued in order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

namespace dmoe::cuda {

class CudnnAttention {
 public:
  // Whether cuDNN attention can run here: built with the frontend, libcudnn.so.9 (>= 9.0) loadable, a CUDA
  // device of compute capability 8.0 or above. When false and `why` is given, *why says what is missing.
  static bool available(std::string* why = nullptr);

  // Throws (dmoe::Error with available()'s reason) when !available().
  CudnnAttention();
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // out, lse overwritten. head_dim a multiple of 8 (cuDNN's 16-byte stride alignment), pointers 16-byte
  // aligned; cuDNN's own limits (e.g. head_dim <= 256 on Hopper) are reported by the graph build, naming the
  // shape. Asynchronous on `stream`, like the own kernels (the first call of a shape builds its graph first).
  void forward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out,
               float* lse, int64_t batch, int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim,
               cudaStream_t stream);
  // dq, dk, dv overwritten (dk, dv summed over the query heads of each kv head). Runs cuDNN's deterministic
  // backward (no atomics on dq), so results are bit-identical run to run, as the own kernels' are.
  void backward(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* out,
                const float* lse, const __nv_bfloat16* dout, __nv_bfloat16* dq, __nv_bfloat16* dk,
                __nv_bfloat16* dv, int64_t batch, int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim,
                cudaStream_t stream);

  // Graphs built so far (forward and backward shapes together).
  size_t graphs_built() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace dmoe::cuda
