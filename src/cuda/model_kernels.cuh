// cuda/model_kernels.cuh — host launchers of the CUDA kernels of the dense part of a Mixtral model and its
// training step: the twins of src/cpu/model_kernels.hpp (same names, same arguments, device pointers).
//
// Differences from the CPU twins, as in cuda/kernels.cuh:
//   - T is the storage type of activations and weights (float or __nv_bfloat16). Per-row statistics
//     (rstd, lse), logits and weight-gradient accumulators are f32 (the CPU's accumulators are fp64).
//   - Sums accumulate in f32 in a fixed order (no atomics on values): every result is bit-identical run to
//     run. Reductions that give one number (loss, sum of squares) accumulate in fp64.
//   - Launchers that need scratch take a Workspace (after the sizes), and the stream last. None synchronises.
//   - Where the GPU needs more than the CPU twin's arguments it says so beside the launcher.
// Shapes as on the CPU: n = batch·seq tokens, token t = b·seq + s; attention tensors [n, heads, head_dim].
//
// This header is plain host C++ (no device code).
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cpu/model_kernels.hpp"
#include "cuda/kernels.cuh"

namespace dmoe::cuda {

// ---- embedding -----------------------------------------------------------------------------------

// out[t, :] = table[tokens[t], :]. tokens [n] (device; in [0, vocab), checked by the caller on the host).
template <typename T>
void embedding_forward(const int32_t* tokens, const T* table, T* out, int64_t n, int64_t vocab, int64_t hidden,
                       cudaStream_t stream);
// dtable[v, :] += Σ_{t: tokens[t] = v} dout[t, :], each row's sum in token order (deterministic: the
// positions are grouped by token with a stable sort in `ws`, no atomics). dtable [vocab, H] f32.
template <typename T>
void embedding_backward(const int32_t* tokens, const T* dout, float* dtable, int64_t n, int64_t vocab, int64_t hidden,
                        Workspace& ws, cudaStream_t stream);

// ---- RMSNorm ---------------------------------------------------------------------------------------

// rstd = 1/sqrt(mean(x²) + eps) (f32 accumulation), y = T(w · x · rstd) computed in f32.
template <typename T>
void rmsnorm_forward(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t hidden, float eps,
                     cudaStream_t stream);
// dx (overwritten) as on the CPU; dw [H] f32 += Σ_rows dy∘x·rstd (per-block partial sums in `ws`, then summed
// in block order: deterministic).
template <typename T>
void rmsnorm_backward(const T* x, const T* w, const float* rstd, const T* dy, T* dx, float* dw, int64_t rows,
                      int64_t hidden, Workspace& ws, cudaStream_t stream);

// ---- rotary position embedding (HF rotate_half), x and y may alias ------------------------------------

template <typename T>
void rope_forward(const T* x, T* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                  cudaStream_t stream);
template <typename T>
void rope_backward(const T* dy, T* dx, int64_t n, int64_t seq, int64_t heads, int64_t head_dim, double theta,
                   cudaStream_t stream);

// ---- causal grouped-query attention (own kernels; cuda/attention_cudnn.hpp is the fast bf16 path) -------

// out [n, Hq, D]; lse [batch, Hq, seq] f32 = natural-log logsumexp of the scaled scores of the visible keys.
// Online softmax in f32. head_dim <= 256 and even.
template <typename T>
void attention_forward(const T* q, const T* k, const T* v, T* out, float* lse, int64_t batch, int64_t seq,
                       int32_t heads, int32_t kv_heads, int64_t head_dim, Workspace& ws, cudaStream_t stream);
// dq, dk, dv overwritten (dk, dv summed over the query heads of a kv head in a fixed order). The GPU also
// takes `out` (the forward's output: Σ_j p_ij dP_ij = dout_i·out_i, as flash attention computes it).
template <typename T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const float* lse, const T* dout, T* dq,
                        T* dk, T* dv, int64_t batch, int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim,
                        Workspace& ws, cudaStream_t stream);

// ---- linear (cuBLAS; `cublas` is bound to the stream the work runs on) ----------------------------------

// y [rows, out] = x [rows, in] · w [out, in]ᵀ. Y is T or float (the LM head writes f32 logits).
template <typename T, typename Y>
void linear_forward(const T* x, const T* w, Y* y, int64_t rows, int64_t in, int64_t out, cublasHandle_t cublas);
// dx [rows, in] = dy · w (overwritten; null: not computed), or += when accumulate_dx; dw [out, in] f32 +=
// dyᵀ · x.
template <typename T>
void linear_backward(const T* x, const T* w, const T* dy, T* dx, float* dw, int64_t rows, int64_t in, int64_t out,
                     cublasHandle_t cublas, bool accumulate_dx = false);

// ---- softmax cross-entropy ---------------------------------------------------------------------------

// logits [rows, vocab] f32; targets [rows] (ignore_index or in [0, vocab), checked by the caller). lse [rows];
// *loss_sum (device, fp64) = Σ_rows (lse − logit[target]); *count (device) = rows not ignored.
void cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, double* loss_sum,
                           int64_t* count, int64_t rows, int64_t vocab, int32_t ignore_index, Workspace& ws,
                           cudaStream_t stream);
// dlogits [rows, vocab] (T, overwritten; may alias logits when T is float) = scale · (softmax − onehot); 0 on
// ignored rows.
template <typename T>
void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse, T* dlogits,
                            int64_t rows, int64_t vocab, int32_t ignore_index, double scale, cudaStream_t stream);

// ---- optimizer -----------------------------------------------------------------------------------------

// The CPU twin's AdamW (fp64 arithmetic per element) on g = grad_scale · grad (the clipping factor folded in,
// where the CPU scales the gradient first). param_copy: null, or [n] of T receiving the updated parameter in
// the storage type (the bf16 weights the model computes with; f32 master weights stay in param).
template <typename T>
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const cpu::AdamWParams& p,
                double grad_scale, T* param_copy, cudaStream_t stream);
// The same on bf16 gradients (a bf16 model's expert gradients, CudaMixtralModel), each read as the float it holds.
template <typename T>
void adamw_step(float* param, const bf16* grad, float* m, float* v, int64_t n, const cpu::AdamWParams& p,
                double grad_scale, T* param_copy, cudaStream_t stream);
// *out (device, fp64) = Σ g² (deterministic: per-block fp64 partials in `ws`, summed in block order).
void sum_of_squares(const float* g, int64_t n, double* out, Workspace& ws, cudaStream_t stream);
void sum_of_squares(const bf16* g, int64_t n, double* out, Workspace& ws, cudaStream_t stream);
void scale_in_place(float* g, int64_t n, double scale, cudaStream_t stream);

// ---- elementwise --------------------------------------------------------------------------------------

// dst[i] += src[i] (in f32, rounded once to T).
template <typename T>
void add_into(T* dst, const T* src, int64_t n, cudaStream_t stream);

}  // namespace dmoe::cuda
