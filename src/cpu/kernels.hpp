// cpu/kernels.hpp — the CPU kernels: plain loops, the specification every CUDA kernel is checked against.
//
// Each function here has a CUDA twin in src/cuda/ with the same name and the same arguments (there the
// pointers are device pointers, the storage type may be bf16, and a stream is passed last). Shapes are
// written beside each argument; all matrices are row-major. Sums whose order matters accumulate in fp64.
// `storage` = DType::bf16 makes a kernel round what it stores to bf16, emulating bf16 storage.
#pragma once

#include <cstdint>

#include "core/config.hpp"
#include "core/dtype.hpp"
#include "core/flash_protocol.hpp"

namespace dmoe::cpu {

// C[m, n] = A[m, k] · B[n, k]^T  (fp64 accumulation, then rounded to float).
void gemm_nt(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k);

// For every group g and its rows r in [row_offsets[g], row_offsets[g+1]):
//   C[r, :] = A[r, :] · B_g (+ A2[r, :] · B2_g)
// A, A2 [rows, k], C [rows, n] (rows indexed from 0 like the offsets), B, B2 [groups, k, n] (each group's
// [k, n] row-major: the "NN" product of the backward pass, dh = dout·w2 and dx = dpre1·w1 + dpre3·w3).
// a2 and b2 are both null or both given; one fp64 sum per element over both products (p = 0..k-1 of A·B,
// then of A2·B2), rounded to float once (then to bf16 when storage is bf16). Rows outside every group are
// left untouched. The CUDA twin runs dmoe's own Hopper kernel (bf16).
void grouped_gemm_nn(const float* a, const float* b, const float* a2, const float* b2, float* c,
                     const int64_t* row_offsets, int32_t groups, int64_t n, int64_t k, DType storage);

// The tile table of a grouped GEMM whose row offsets are in device memory (the twin of the kernel that dmoe's
// own Hopper GEMM runs before itself then; cuda::grouped_tile_table): clipped [groups + 1] = the offsets clipped
// into [0, rows] and made non-decreasing (clipped[0] = 0), tile_offsets [groups + 1] = the first tile of each
// group (ceil(rows_g / block_m) · n_tiles tiles per group), tiles [1] = their total.
void grouped_tile_table(const int64_t* row_offsets, int32_t groups, int64_t rows, int32_t n_tiles, int32_t block_m,
                        int64_t* clipped, int32_t* tile_offsets, int32_t* tiles);

// The experts' weight gradients: for every group g with rows r in [row_offsets[g], row_offsets[g+1]):
//   C_g [m, n] = Σ_r A[r - a_first_row, :]^T · B[r - b_first_row, :]   (+ C_g when accumulate)
// A [·, m] with row stride lda, B [·, n] with row stride ldb, C_g at c + g·c_group_stride, row-major [m, n].
// Each element is one fp64 sum over the group's rows in order (plus C_g's old value last, with
// accumulate), rounded to float once. Groups without rows are left untouched. The fields mirror the CUDA
// descriptor cuda::GroupedWgrad (there a and b are bf16); the CUDA twin runs dmoe's own kernels
// (sm90_grouped_wgrad on sm_90, else the mma.sync one).
struct GroupedWgrad {
  const float* a = nullptr;
  const float* b = nullptr;
  float* c = nullptr;
  bfloat16* c_bf16 = nullptr;  // where set, C is stored here as bf16 (the float result rounded; accumulate false)
  const int64_t* row_offsets = nullptr;  // [groups + 1]
  int32_t groups = 0;
  int64_t m = 0, n = 0, lda = 0, ldb = 0;
  int64_t a_first_row = 0, b_first_row = 0;
  int64_t c_group_stride = 0;
  bool accumulate = true;
};
void grouped_wgrad(const GroupedWgrad& g);

// ---- router --------------------------------------------------------------------------------------

// logits[T, E] = x[T, H] · wg[E, H]^T.
void router_logits(const float* x, const float* wg, float* logits, int64_t tokens, int64_t hidden,
                   int32_t experts);

// Per token: probs = softmax(logits) [T, E]; ids [T, k] = top-k by (logit desc, index asc);
// weights [T, k] = probs at ids, renormalised to sum 1 if `renormalize`; lse [T] = logsumexp(logits).
void router_topk(const float* logits, float* probs, int32_t* ids, float* weights, float* lse,
                 int64_t tokens, int32_t experts, int32_t top_k, bool renormalize);

// Partial sums over this rank's tokens for the auxiliary losses (summed over ranks by the engine):
// prob_sum[e] = Σ_t probs[t, e]; assigned[e] = #{(t, j): ids[t, j] = e}; z_sum = Σ_t lse[t]^2.
void router_aux_partials(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                         int32_t experts, int32_t top_k, double* prob_sum, double* assigned,
                         double* z_sum);

// The same sums into a block laid out as core/routing_block.hpp's AuxPartialsBlock (the twin of the CUDA
// launcher that leaves them in device memory): prob_sum, z_sum, assigned as int32, and the bad word
// (kNoBadAssignment, or the first assignment t·k + j whose id is outside [0, E), which then counts nowhere).
void router_aux_partials_on_device(const float* probs, const float* lse, const int32_t* ids, int64_t tokens,
                                   int32_t experts, int32_t top_k, void* stats);

// Gradient terms of the auxiliary losses, given global statistics (N = tokens over all ranks):
//   load balance  L_lb = E · Σ_e f_e · P_e, f_e = assigned_e / (N·k) (constant), P_e = Σ_t p[t,e] / N
//                 → ∂L/∂p[t,e] = lb_scale · f_e, with lb_scale = coef · E / N
//   z-loss        L_z = Σ_t lse_t² / N → ∂L/∂logit[t,e] = z_scale · lse_t · p[t,e], z_scale = 2·coef / N
struct RouterAuxGrad {
  const double* expert_fraction = nullptr;  // [E] f_e; null: no load-balance term
  double lb_scale = 0;
  const float* lse = nullptr;               // [T]; null: no z-loss term
  double z_scale = 0;
};

// dlogits [T, E] = gradient of the loss w.r.t. the logits, from dweights [T, k] (gradient w.r.t. the gate
// weights) through renormalisation and softmax, plus the auxiliary-loss terms.
void router_topk_backward(const float* probs, const int32_t* ids, const float* weights,
                          const float* dweights, float* dlogits, int64_t tokens, int32_t experts,
                          int32_t top_k, bool renormalize, const RouterAuxGrad& aux);

// dx [T, H] += dlogits [T, E] · wg [E, H];  dwg [E, H] (fp64) += dlogits^T · x, tokens in order.
void router_logits_backward(const float* x, const float* wg, const float* dlogits, float* dx,
                            double* dwg, int64_t tokens, int64_t hidden, int32_t experts);

// ---- dispatch plan -------------------------------------------------------------------------------

// core build_send_plan with DropPolicy::latest_tokens (capacity < 0: dropless), its counts into a block laid out
// as core/routing_block.hpp's PlanCountsBlock (routed, kept, the send buffer's expert offsets, the bad word):
// slot [T*k], row_token and row_choice (the first offsets[E] rows). With an expert id outside [0, E) the bad word
// names the first such assignment and the plan is unspecified but safe (every slot -1 or a row below
// offsets[E] <= T*k; this twin leaves it empty): the caller reports the error before using it.
// Distinct experts per token are the router's guarantee (build_send_plan checks it; this twin does not).
void plan_send_on_device(const int32_t* ids, int64_t tokens, int32_t top_k, int32_t experts, int64_t capacity,
                         int32_t* slot, int32_t* row_token, int32_t* row_choice, int64_t* counts);

// ---- data movement -------------------------------------------------------------------------------

// out[i, :] = x[rows[i], :] for i < n (builds the expert-major send buffer from x and row_token).
void gather_rows(const float* x, const int32_t* rows, float* out, int64_t n, int64_t hidden);

// Copies segments of rows: dst[dst_offsets[s] + i] = src[src_offsets[s] + i], i < counts[s].
// Used between the source-major receive buffer and the expert-major batch, both ways.
void permute_segments(const float* src, float* dst, const int64_t* src_offsets,
                      const int64_t* dst_offsets, const int64_t* counts, int64_t segments,
                      int64_t hidden);

// y[t] = Σ_j weights[t, j] · rows[slot[t, j]] over j in order, skipping slot -1 (dropped), then
// + addend[t] when addend is non-null; fp64 sum, rounded once. weights may be null (weight 1).
// y [T, H]; rows [S, H]; slot, weights [T, k]; addend [T, H].
// (With weights = null and addend = the router's dx this is the backward "scatter back" of dx.)
void combine(const float* rows, const int32_t* slot, const float* weights, const float* addend,
             float* y, int64_t tokens, int32_t top_k, int64_t hidden, DType storage);

// Backward of combine: drows[slot[t, j]] = weights[t, j] · dy[t]; dweights[t, j] = <dy[t], rows[slot]>
// (0 for dropped assignments). drows rows not referenced by any slot are left untouched.
void combine_backward(const float* dy, const float* rows, const int32_t* slot, const float* weights,
                      float* drows, float* dweights, int64_t tokens, int32_t top_k, int64_t hidden,
                      DType storage);

// ---- expert FFN ----------------------------------------------------------------------------------

// One expert over its n rows. x [n, H]; w1 [I, H]; w3 [I, H] (SwiGLU only, else null); w2 [H, I].
//   pre1 = x·w1^T [n, I];  pre3 = x·w3^T [n, I] (SwiGLU; else null)
//   h = act(pre1) (relu, gelu with erf) or silu(pre1) ∘ pre3 (SwiGLU) [n, I];  out = h·w2^T [n, H].
// pre1, pre3 and h are kept for the backward pass.
void expert_ffn_forward(const float* x, const float* w1, const float* w3, const float* w2, float* pre1,
                        float* pre3, float* h, float* out, int64_t n, int64_t hidden, int64_t ffn,
                        Activation activation, DType storage);

// Backward of expert_ffn_forward. dout [n, H] → dx [n, H] (overwritten); weight gradients accumulate
// (+=) in fp64 with rows in order: dw1 [I, H], dw3 [I, H] (SwiGLU; else null), dw2 [H, I].
void expert_ffn_backward(const float* x, const float* w1, const float* w3, const float* w2,
                         const float* pre1, const float* pre3, const float* h, const float* dout,
                         float* dx, double* dw1, double* dw3, double* dw2, int64_t n, int64_t hidden,
                         int64_t ffn, Activation activation, DType storage);

// Activation value and derivative (shared by forward, backward and tests).
float activation_forward(Activation activation, float x);
float activation_derivative(Activation activation, float x);  // SwiGLU: derivative of silu

// ---- Flash ---------------------------------------------------------------------------------------

// One rank's whole MoE layer forward by the Flash protocol (core/flash_protocol.hpp), the twin of the
// persistent kernel cuda::flash_forward: p's buffers are host memory laid out as symmetric_layout /
// local_layout, peers' regions reachable through the local peers table; each rank calls it on its own
// thread, W ranks at once. f32 storage (bf16 emulated by rounding); grid must be 1. Outputs equal the
// reference engine's (run_cpu_layer) bit for bit; every wait is bounded by p.timeout_ns and throws.
void flash_forward(const flash::Params& p);

// The same rank's backward of its last forward (p.forward.shape.train), by the protocol of
// flash::BackwardParams; the twin of cuda::flash_backward. Accumulators are f64 (dgate this rank's part,
// dw1/dw3/dw2 its experts'). dx, dgate and the experts' gradients equal the reference engine's bit for bit.
void flash_backward(const flash::BackwardParams& p);

}  // namespace dmoe::cpu
