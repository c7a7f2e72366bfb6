// cpu/model_kernels.hpp — the CPU kernels of the dense part of a Transformer-MoE (Mixtral) model and of
// its training step: embedding, RMSNorm, rotary position embedding, causal grouped-query attention,
// linear, softmax cross-entropy, AdamW and global gradient-norm clipping.
//
// Same rules as cpu/kernels.hpp: plain loops, the specification the CUDA twins (same names, same
// arguments, device pointers, a stream last) will be checked against. f32 storage; every sum whose
// order matters is accumulated in fp64 in index order and rounded once. Weight gradients accumulate
// (+=) into fp64 buffers, tokens in order, so W ranks summing their partial gradients reproduce one
// rank's up to the last rounding. Shapes are written beside each argument; row-major throughout.
//
// Token layout: n = batch·seq tokens, token t = b·seq + s is position s of sequence b.
// Attention activations are [n, heads, head_dim] (HF's [B, S, heads, head_dim] before its transpose).
#pragma once

#include <cstdint>

#include "core/dtype.hpp"

namespace dmoe::cpu {

// ---- embedding -----------------------------------------------------------------------------------

// out[t, :] = table[tokens[t], :].  tokens [n] in [0, vocab) (checked); table [vocab, H]; out [n, H].
void embedding_forward(const int32_t* tokens, const float* table, float* out, int64_t n, int64_t vocab,
                       int64_t hidden);
// dtable[tokens[t], :] += dout[t, :], t in order.  dtable [vocab, H] fp64.
void embedding_backward(const int32_t* tokens, const float* dout, double* dtable, int64_t n, int64_t vocab,
                        int64_t hidden);

// ---- RMSNorm (HF Mixtral/Llama) ------------------------------------------------------------------

// Per row: rstd = 1 / sqrt(mean(x²) + eps) (mean in fp64, rounded to f32, then the f32 rsqrt);
// y = w ∘ (x · rstd) in f32, as HF computes it.  x, y [rows, H]; w [H]; rstd [rows] (kept for backward).
void rmsnorm_forward(const float* x, const float* w, float* y, float* rstd, int64_t rows, int64_t hidden,
                     float eps);
// dx = rstd·(w∘dy) − rstd³·x·Σ_j(w_j dy_j x_j)/H (overwritten); dw [H] fp64 += Σ_rows dy∘x·rstd.
void rmsnorm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                      double* dw, int64_t rows, int64_t hidden);

// ---- rotary position embedding (HF rotate_half convention) ---------------------------------------

// For token t at position s = t mod seq, each head's vector v [D] (D = head_dim, even) becomes
//   y = v ∘ cos + rotate_half(v) ∘ sin,  rotate_half(v) = (−v[D/2:], v[:D/2]),
//   cos[i] = cos(s · inv_freq[i mod D/2]), inv_freq[j] = 1 / theta^(2j/D), all in f32 as HF computes them.
// x, y [n, heads, D] (may alias).
void rope_forward(const float* x, float* y, int64_t n, int64_t seq, int64_t heads, int64_t head_dim,
                  double theta);
// The transpose: dx = dy ∘ cos + rotate_halfᵀ(dy ∘ sin). dy, dx [n, heads, D] (may alias).
void rope_backward(const float* dy, float* dx, int64_t n, int64_t seq, int64_t heads, int64_t head_dim,
                   double theta);

// ---- causal grouped-query attention ---------------------------------------------------------------

// q [n, Hq, D]; k, v [n, Hkv, D] (Hq a multiple of Hkv; query head h reads kv head h / (Hq/Hkv), HF's
// repeat_kv); out [n, Hq, D]; lse [batch, Hq, seq] = logsumexp over the visible keys (kept for backward:
// the probabilities are recomputed there, as flash attention does). For query position i of a sequence:
//   p_ij = softmax_j≤i(scale · q_i·k_j),  out_i = Σ_j p_ij v_j,  scale = 1/sqrt(D).
// Scores, softmax and the weighted sum in fp64.
void attention_forward(const float* q, const float* k, const float* v, float* out, float* lse, int64_t batch,
                       int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim);
// dq [n, Hq, D], dk, dv [n, Hkv, D] overwritten:
//   dP_ij = dout_i·v_j, dS_ij = p_ij (dP_ij − Σ_j' p_ij' dP_ij'), dq_i = scale Σ_j dS_ij k_j,
//   dk_j = scale Σ_i dS_ij q_i, dv_j = Σ_i p_ij dout_i (summed over the query heads sharing a kv head).
void attention_backward(const float* q, const float* k, const float* v, const float* lse, const float* dout,
                        float* dq, float* dk, float* dv, int64_t batch, int64_t seq, int32_t heads,
                        int32_t kv_heads, int64_t head_dim);

// ---- linear (no bias; HF weight layout [out, in]) ------------------------------------------------

// y [rows, out] = x [rows, in] · w [out, in]ᵀ.
void linear_forward(const float* x, const float* w, float* y, int64_t rows, int64_t in, int64_t out);
// dx [rows, in] = dy · w (overwritten; null: not computed); dw [out, in] fp64 += dyᵀ · x, rows in order.
void linear_backward(const float* x, const float* w, const float* dy, float* dx, double* dw, int64_t rows,
                     int64_t in, int64_t out);

// ---- softmax cross-entropy -----------------------------------------------------------------------

// Rows whose target is ignore_index contribute nothing; other targets must be in [0, vocab) (checked).
// lse [rows] = logsumexp(logits row) (fp64, kept for backward; written for ignored rows too);
// *loss_sum = Σ_rows (lse − logit[target]) in fp64; *count = rows not ignored. Mean = loss_sum / count.
void cross_entropy_forward(const float* logits, const int32_t* targets, float* lse, double* loss_sum,
                           int64_t* count, int64_t rows, int64_t vocab, int32_t ignore_index);
// dlogits [rows, vocab] = scale · (softmax(logits) − onehot(target)); 0 on ignored rows (overwritten).
// For the mean over non-ignored rows, scale = dloss / count.
void cross_entropy_backward(const float* logits, const int32_t* targets, const float* lse, float* dlogits,
                            int64_t rows, int64_t vocab, int32_t ignore_index, double scale);

// ---- optimizer -----------------------------------------------------------------------------------

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;  // t, counted from 1 (for the bias corrections 1 − β^t)
};

// PyTorch AdamW (decoupled weight decay), f32 master weights and moments, arithmetic in fp64:
//   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
//   p ← p − lr · (m / (1−β1^t)) / (sqrt(v / (1−β2^t)) + eps).
// param, grad, m, v [n].
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p);
// The same on bf16 gradients (the GPU model's bf16 expert gradients), each read as the float it holds.
void adamw_step(float* param, const bfloat16* grad, float* m, float* v, int64_t n, const AdamWParams& p);

// Σ g² in fp64, in order (one tensor's share of the global gradient norm).
double sum_of_squares(const float* g, int64_t n);
double sum_of_squares(const bfloat16* g, int64_t n);
// g ← g · scale.
void scale_in_place(float* g, int64_t n, double scale);
// The factor torch.nn.utils.clip_grad_norm_ multiplies every gradient by: min(1, max_norm / (norm + 1e-6))
// where norm = sqrt(Σ over all tensors of sum_of_squares); max_norm <= 0 means no clipping (1).
double clip_coefficient(double total_sum_of_squares, double max_norm);

}  // namespace dmoe::cpu
