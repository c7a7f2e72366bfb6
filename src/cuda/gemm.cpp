// cuda/gemm.cpp — row-major GEMM wrappers over cuBLAS: one product (cublasGemmEx_64) and the grouped
// expert product (cublasGemmGroupedBatchedEx_64 for many small products; a loop of single products for
// large ones and where the grouped API does not take the operand types). See common.hpp for the
// row-major ↔ column-major mapping.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/env.hpp"
#include "cuda/common.hpp"
#include "cuda/sm90_host.hpp"

namespace dmoe::cuda {

namespace {

cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

// The grouped API takes A, B and C of one type (bf16 or f32) with fp32 compute; see the cuBLAS table
// for cublasGemmGroupedBatchedEx. Mixed types (bf16 × bf16 → f32) are not in it.
bool grouped_supports(cudaDataType_t a_type, cudaDataType_t b_type, cudaDataType_t c_type) {
  return a_type == b_type && b_type == c_type && (a_type == CUDA_R_16BF || a_type == CUDA_R_32F);
}

// The grouped call pays only for small products. Measured on H200, cuBLAS 13.1, bf16, up-projection
// (TFLOP/s grouped / loop of cublasGemmEx; one GEMM of the same FLOPs reaches 780-870):
//   Le=32 n=64   H=4096 I=1024   (0.27 G MAC per expert): 173 / 35
//   Le=64 n=256  H=2048 I=1408   (0.74 G):                281 / 142
//   Le=64 n=512  H=2048 I=1408   (1.5 G):                 293 / 285
//   Le=8  n=64   H=4096 I=14336  (3.8 G):                 212 / 209
//   Le=8  n=128  H=4096 I=14336  (7.5 G):                 270 / 417
//   Le=16 n=1024 H=7168 I=2048   (15 G):                  336 / 786
//   Le=8  n=2048 H=4096 I=14336  (120 G):                 332 / 839
// so the loop takes over from a mean of 1.5 G multiply-adds per problem.
constexpr double kGroupedMaxMeanMacs = 1.5e9;

// A single expert's product of a few hundred rows fills only a few of the 132 SMs (M=256, N=2048 is 16
// output tiles of 128×256), which is why the plain loop is slow for mid-sized experts. Issuing the
// experts' products on several streams at once lets their tiles share the GPU. Side streams are forked
// from and joined back into the caller's stream with events, so ordering is unchanged for everyone else.
constexpr int kMaxSideStreams = int(kMaxExpertGemmStreams);  // core/env.hpp

struct SideStreams {
  int device = -1;
  cudaEvent_t fork = nullptr;
  std::vector<cudaStream_t> streams;
  std::vector<cublasHandle_t> handles;  // one per stream: a handle's workspace must not be shared
  std::vector<cudaEvent_t> done;
};

// Per host thread and device; created on first use and kept for the life of the process (destroying
// cuBLAS handles during process exit can fail after the CUDA context is gone).
SideStreams& side_streams() {
  thread_local std::vector<SideStreams*> pools;
  int device = 0;
  DMOE_CHECK_CUDA(cudaGetDevice(&device));
  for (SideStreams* p : pools)
    if (p->device == device) return *p;
  auto* p = new SideStreams;
  p->device = device;
  DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&p->fork, cudaEventDisableTiming));
  for (int i = 0; i < kMaxSideStreams; ++i) {
    cudaStream_t st;
    cublasHandle_t h;
    cudaEvent_t ev;
    DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    DMOE_CHECK_CUBLAS(cublasCreate(&h));
    DMOE_CHECK_CUBLAS(cublasSetStream(h, st));
    DMOE_CHECK_CUBLAS(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));  // no TF32, as the main handle
    DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    p->streams.push_back(st);
    p->handles.push_back(h);
    p->done.push_back(ev);
  }
  pools.push_back(p);
  return *p;
}

// How the experts' products run. DMOE_EXPERT_GEMM=grouped|loop|streams|own forces one (for measurements;
// own = dmoe's sm90 grouped GEMM, bf16 forward products only, cuBLAS elsewhere); auto: the own kernel
// below kOwnMaxMeanMacs where it can run, else grouped below kGroupedMaxMeanMacs, else one product after
// another.
enum class ExpertGemmMode { automatic, grouped, loop, streams, own };

ExpertGemmMode expert_gemm_mode() {
  static const ExpertGemmMode mode = [] {
    // core/env.hpp: the same reading as check_environment()'s when the command started.
    const std::string v = env_choice("DMOE_EXPERT_GEMM", {"auto", "grouped", "loop", "streams", "own"}, "auto");
    if (v == "grouped") return ExpertGemmMode::grouped;
    if (v == "loop") return ExpertGemmMode::loop;
    if (v == "streams") return ExpertGemmMode::streams;
    if (v == "own") return ExpertGemmMode::own;
    return ExpertGemmMode::automatic;
  }();
  return mode;
}

// How many side streams DMOE_EXPERT_GEMM=streams spreads the products over: DMOE_EXPERT_GEMM_STREAMS (1 to
// kMaxSideStreams, default kMaxSideStreams); fewer streams keep fewer products running side by side.
int side_stream_count() {
  static const int count = [] {
    return int(env_integer("DMOE_EXPERT_GEMM_STREAMS", 1, kMaxSideStreams, kMaxSideStreams, "streams"));
  }();
  return count;
}

// Side streams are opt-in (DMOE_EXPERT_GEMM=streams); auto never picks them. Measured on H200
// (docs/perf.md, 2026-11-29), whole-layer forward, grouped / loop / streams: flash-paper (1.07 G MACs
// per expert product) 1.248 / 1.306 / 1.137 ms, but streams measured 1.78 and 1.28 ms in a later run
// (grouped stays at 1.25); fine-grained (0.40 G) 1.509 / 3.323 / 3.406 ms; decode (0.10 G)
// 0.849 / 2.989 / 3.271 ms. cuBLAS's kernels for these shapes do not reliably run side by side, so the
// gain is neither large nor stable; the grouped kernel of our own (below) replaced them for small products.
// Nor do they fill the tails of Mixtral's large products (60 G per expert, T = 4096 forward + backward through
// the PyTorch module, sixteenth session): 14.4-14.7 ms on 2, 4, 8 or 16 streams against 14.25 one after another.

// The own kernel (grouped_gemm_sm90.cu) against cuBLAS, whole-layer forward on H200 (docs/perf.md,
// 2026-11-29), by mean multiply-adds per expert product:
//   0.10 G (decode)                 0.82 ms own vs 0.79-0.85 grouped (a tie)
//   0.40 G (fine-grained)           0.96 vs 1.38 grouped
//   1.07 G (flash-paper)            0.74 vs 1.19 grouped
//   2.1 G (T 8192, E 32, H=I 2048)  0.68 vs 0.96 (side streams, an earlier sweep)
//   4.3 G (T 4096, E 8)             0.392 vs 0.375 loop
//   8.6 G (T 8192, E 8)             0.589 vs 0.588 loop
//   60 G (mixtral)                  5.0 vs 4.45 loop
// Ranks sharing a GPU under MPS run the own kernel slower than cuBLAS (W = 4, flash-paper: 4.8 ms own vs
// 3.2 ms loop; cause not established, docs/perf.md); their products are larger, so this bound keeps them
// on cuBLAS.
constexpr double kOwnMaxMeanMacs = 4e9;

}  // namespace

// The grouped weight-gradient kernel (the mma.sync grouped_wgrad.cu) against the per-expert cuBLAS loop,
// whole-layer forward + backward on H200 (docs/perf.md, fourth session), by mean multiply-adds per expert
// product:
//   0.10 G (decode)          5.28 ms own vs 5.99 loop
//   0.40 G (fine-grained)    5.01 vs 6.38
//   1.07 G (flash-paper)     4.28 vs 4.45
//   60 G (mixtral)           21.0 vs 15.3 (cuBLAS's big tiles reach ~700 TFLOP/s; the kernel's mma.sync
//                            tiles do not)
// so auto takes it below the size where the two met, about flash-paper's.
//
// The TMA + wgmma kernel (grouped_wgrad_sm90.cu) against both, measured on the H200 (docs/perf.md, eleventh
// session; `dmoe bench gemm --config C --wgrad`, dw1 stored, µs, and the training step with each, ms):
//   0.10 G (decode)          kernel: sm90 582, mma 513, cublas 668     step: 3.27 / 3.08 / 3.50
//   0.40 G (fine-grained)    399, 479, 1449                            3.27 / 3.59 / 4.52
//   1.07 G (flash-paper)     507, 622, 728                             2.72 / 3.07 / 3.01
//   2.1 G (llama2-moe)       176, 257, 203                             model step 150.3 (sm90) / 151.7 (cublas)
//   16 G (deepseek-v2-s)     2136, 3487, 1793                          model step 190.1 (sm90) / 176.7 (cublas)
//   60 G (mixtral)           2067, 3361, 1701                          15.9 / 19.7 / 14.5
// so auto takes mma below kMmaWgradMaxMeanMacs (few rows per expert: the sm90 kernel's 128-row k-blocks are
// mostly padding), sm90 up to kSm90WgradMaxMeanMacs (between llama2-moe's and deepseek-v2-s's products), cuBLAS
// above (its larger tiles reach 570-640 TFLOP/s there, the sm90 kernel's 128 × 128 tiles ~480).
// Where the sm90 kernel cannot run (an sm_80-class GPU, or a shape it refuses), the mma.sync kernel keeps its
// own measured bound against cuBLAS (the fourth session's, above: where the two met, about flash-paper's).
// Accumulating into existing gradients (C read, added, written: micro-batches after the first, gradients not
// zeroed) the sm90 kernel is never the fastest (µs, dw1; eleventh session / nineteenth session's call 4, the
// latter with the strip schedule and the order barrier; sm90 = the better of load and red):
//   0.10 G (decode)          sm90 1378 / 1345, mma 1208 / 1210, cublas 1470 / —
//   0.40 G (fine-grained)    861 / 863, 837 / 837, 1516 / —
//   1.07 G (flash-paper)     1128 / 1131, 1099 / 1098, 1170 / —
//   2.1 G (llama2-moe)       354 / 355, 370 / —, 323 / —
//   16 G, 60 G               3032, 3688; 3838, 4061; 2058, 2079
// so auto takes mma below kMmaOverCublasMaxMeanMacs there, cuBLAS above.
constexpr double kMmaWgradMaxMeanMacs = 2.5e8;
constexpr double kSm90WgradMaxMeanMacs = 6e9;
constexpr int64_t kSm90Bf16WgradMaxOutput = int64_t(1) << 24;
constexpr double kMmaOverCublasMaxMeanMacs = 1.5e9;
// bf16 gradients (the PyTorch module's, stored without an f32 copy; the GPU model's large experts): cuBLAS's path is
// one cublasGemmEx per expert and product, each ~15-20 µs of host time on the H200 machine (a memset, the launch and
// an event record inside cuBLAS: 24 calls, ~430 µs of the T = 512 Mixtral backward's host time), where the sm90
// kernel is one launch per product. Its bf16 store wrote each lane's 4-byte pairs (half of every 32-byte sector per
// instruction) and ran at ~1 TB/s of output (sixteenth session: 2.68 ms against cuBLAS's 0.92-1.07 on Mixtral's T = 64
// to 512 backward); since 3a0b2e5 each quad transposes its words and a lane stores 8 columns (16 bytes). Measured
// (docs/perf.md, twenty-first session, H100, `dmoe bench gemm --wgrad`, dw1 bf16 stored, µs, 16-byte stores / the
// old pairs / cuBLAS's per-expert calls; events around each call, so cuBLAS's include the gaps where the host issues
// its calls slower than the GPU runs them):
//   0.10 G (decode, 16 rows × 64 experts)       383 / 649 / 858
//   0.13 G (GPT2-Tiny-MoE's layer)               23 / 25 / 186
//   0.40 G (fine-grained)                       322 / 372 / 1699
//   0.94 G (Mixtral T = 64: 16 rows × 8)        448 / 756 / 412
//   1.07 G (flash-paper)                        408 / 477 / 711
//   7.5 G (Mixtral T = 512)                     503 / 828 / 462
//   16 G, 60 G (DeepSeek-V2-S, Mixtral T 4096)  2182, 2294 / 2133, 2212 / 1747, 1631
// cuBLAS loses where its per-expert calls are short (many experts of small outputs: the host issues slower than the
// GPU runs them) and wins on Mixtral's few large experts (4096 × 14336 outputs each) at every T. Through the PyTorch
// module (bench/module_block_profile.py, Mixtral block fwd + bwd, ms; same call, H100) the sm90 kernel there was
// slower at T = 64 (3.93 against 3.69) and T = 256 (4.07 against 3.67), though it cut the backward's host time
// (373 against 820 µs at T = 64): the GPU, not the host, bounds that step. So auto takes the sm90 kernel for bf16
// gradients below kSm90WgradMaxMeanMacs where each expert's output has fewer than kSm90Bf16WgradMaxOutput elements
// (measured: ≤ 6.3 M wins, decode's; 58.7 M loses, Mixtral's; nothing between), else cuBLAS.

namespace {

enum class WgradMode { automatic, own, sm90, mma, cublas };

WgradMode wgrad_mode() {
  static const WgradMode mode = [] {
    const std::string v = env_choice("DMOE_WGRAD", {"auto", "own", "sm90", "mma", "cublas"}, "auto");
    if (v == "own") return WgradMode::own;
    if (v == "sm90") return WgradMode::sm90;
    if (v == "mma") return WgradMode::mma;
    if (v == "cublas") return WgradMode::cublas;
    return WgradMode::automatic;
  }();
  return mode;
}

}  // namespace

bool grouped_bf16_wgrad_available() {
  const WgradMode m = wgrad_mode();
  return (m == WgradMode::automatic || m == WgradMode::own || m == WgradMode::sm90) && device_info().usable;
}

WgradKernel pick_wgrad_kernel(double mean_macs, const std::vector<GroupedWgrad>& calls) {
  using enum WgradMode;
  const WgradMode mode = wgrad_mode();
  auto all = [&](bool (*usable)(const GroupedWgrad&)) {
    for (const GroupedWgrad& g : calls)
      if (!usable(g)) return false;
    return true;
  };
  const bool usable_sm90 = all(sm90_grouped_wgrad_usable), usable_mma = all(grouped_wgrad_usable);
  switch (mode) {
    case sm90:
      if (usable_sm90) return WgradKernel::sm90;
      break;
    case mma:
      if (usable_mma) return WgradKernel::mma;
      break;
    case own:
      if (usable_sm90) return WgradKernel::sm90;
      if (usable_mma) return WgradKernel::mma;
      break;
    case automatic:
      if (!calls.empty() && calls.front().c_bf16 != nullptr) {  // bf16 (stored, never accumulated): above
        const bool small_outputs = std::all_of(calls.begin(), calls.end(), [](const GroupedWgrad& g) {
          return g.m * g.n < kSm90Bf16WgradMaxOutput;
        });
        return mean_macs < kSm90WgradMaxMeanMacs && small_outputs && usable_sm90 ? WgradKernel::sm90
                                                                                  : WgradKernel::cublas;
      }
      if (!calls.empty() && std::all_of(calls.begin(), calls.end(), [](const GroupedWgrad& g) { return g.accumulate; }))
        return mean_macs >= kMmaOverCublasMaxMeanMacs ? WgradKernel::cublas
               : usable_mma                           ? WgradKernel::mma
               : usable_sm90                          ? WgradKernel::sm90  // 0.40 G: 861 µs against cuBLAS's 1516
                                                      : WgradKernel::cublas;
      if (mean_macs < kMmaWgradMaxMeanMacs && usable_mma) return WgradKernel::mma;
      if (mean_macs < kSm90WgradMaxMeanMacs && usable_sm90) return WgradKernel::sm90;
      if (mean_macs < kMmaOverCublasMaxMeanMacs && usable_mma) return WgradKernel::mma;
      break;
    case cublas: break;
  }
  return WgradKernel::cublas;
}

const char* wgrad_kernel_name(WgradKernel k) {
  return k == WgradKernel::sm90 ? "sm90" : k == WgradKernel::mma ? "mma" : "cublas";
}

// DMOE_DGRAD: the input-gradient products of the backward pass (dh = dout·w2, dx = dpre1·w1 + dpre3·w3) on
// the own kernel's NN variant. Default auto, with the forward's bound kOwnMaxMeanMacs: measured on the H200
// (docs/perf.md, ninth session) dh and dx ran 1.96× (flash-paper) and 1.7-2.2× (fine-grained) faster than
// cuBLAS's grouped call, whose shapes the forward's bound also sends to the own kernel. Above it, at Mixtral's
// T = 512 backward (7.5 G per product), the own kernel took 0.96 ms against cuBLAS's ~0.75 (sixteenth session),
// although its two launches save most of cuBLAS's 24 calls' ~400 µs of host time.
bool prefer_own_dgrad(double mean_macs) {
  static const int mode = [] {  // 0 auto, 1 own, 2 cublas
    const std::string v = env_choice("DMOE_DGRAD", {"auto", "own", "cublas"}, "auto");
    return v == "cublas" ? 2 : v == "own" ? 1 : 0;
  }();
  return mode == 1 || (mode == 0 && mean_macs < kOwnMaxMeanMacs);
}

namespace {

// DMOE_EXPERT_GEMM's choice for the own kernel: forced on or off, or (auto) below `bound` multiply-adds per expert.
bool prefer_own_below(double mean_macs, double bound) {
  switch (expert_gemm_mode()) {
    case ExpertGemmMode::own:
      return true;
    case ExpertGemmMode::automatic:
      return mean_macs < bound;
    default:
      return false;
  }
}

}  // namespace

bool prefer_own_grouped_gemm(double mean_macs) { return prefer_own_below(mean_macs, kOwnMaxMeanMacs); }

// Without the host's counts, cuBLAS's grouped or per-expert products need them read first: the host waits for
// the router, and the work queued behind the forward (a PyTorch model's next kernels) is issued only after it.
// That wait cost the one-layer Mixtral training step T = 512 ~2.6 ms on the H200 (docs/perf.md, thirteenth
// session), more than the own kernel loses against cuBLAS up to ~16 G multiply-adds per expert (8.6 G: equal,
// 60 G: 12 % slower, table above; an H200 product of 16 G takes ~1 ms).
constexpr double kOwnWithoutCountsMaxMeanMacs = 16e9;

bool prefer_own_grouped_gemm_without_counts(double mean_macs) {
  return prefer_own_below(mean_macs, kOwnWithoutCountsMaxMeanMacs);
}

void gemm_rm(cublasHandle_t cublas, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
             const void* a, cudaDataType_t a_type, int64_t lda, const void* b, cudaDataType_t b_type,
             int64_t ldb, float beta, void* c, cudaDataType_t c_type, int64_t ldc) {
  DMOE_CUDA_REQUIRE(m >= 0 && n >= 0 && k >= 0, "gemm: negative shape m=%lld n=%lld k=%lld", (long long)m,
                    (long long)n, (long long)k);
  if (m == 0 || n == 0) return;
  // Column-major: C^T [n, m] = op(B)^T [n, k] · op(A)^T [k, m]. A row-major [r, c] buffer is the
  // column-major [c, r] matrix, so "no transpose" in row-major terms is also CUBLAS_OP_N here.
  DMOE_CHECK_CUBLAS(cublasGemmEx_64(cublas, op(trans_b), op(trans_a), n, m, k, &alpha, b, b_type, ldb, a,
                                    a_type, lda, &beta, c, c_type, ldc, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

void gemm_rm_grouped(const CudaContext& ctx, void* pointer_scratch, bool trans_a, bool trans_b, int64_t lda,
                     int64_t ldb, int64_t ldc, float alpha, float beta, cudaDataType_t a_type,
                     cudaDataType_t b_type, cudaDataType_t c_type, const std::vector<GemmProblem>& problems) {
  if (problems.empty()) return;
  bool aligned = true;
  double macs = 0;
  for (const GemmProblem& p : problems) {
    aligned = aligned && is_aligned(p.a, 16) && is_aligned(p.b, 16) && is_aligned(p.c, 16);
    macs += double(p.m) * double(p.n) * double(p.k);
  }
  const double mean_macs = macs / double(problems.size());
  const bool small = mean_macs < kGroupedMaxMeanMacs;
  const ExpertGemmMode forced = expert_gemm_mode();
  const bool grouped_ok = grouped_supports(a_type, b_type, c_type) && aligned && problems.size() > 1;
  const bool use_streams = problems.size() > 1 && forced == ExpertGemmMode::streams;
  const bool use_grouped = grouped_ok && !use_streams &&
                           (forced == ExpertGemmMode::grouped || (forced == ExpertGemmMode::automatic && small));

  if (use_streams) {
    SideStreams& side = side_streams();
    const int n_streams = int(std::min<size_t>(problems.size(), size_t(side_stream_count())));
    DMOE_CHECK_CUDA(cudaEventRecord(side.fork, ctx.stream));
    for (int s = 0; s < n_streams; ++s) DMOE_CHECK_CUDA(cudaStreamWaitEvent(side.streams[s], side.fork, 0));
    for (size_t i = 0; i < problems.size(); ++i) {
      const GemmProblem& p = problems[i];
      gemm_rm(side.handles[i % n_streams], trans_a, trans_b, p.m, p.n, p.k, alpha, p.a, a_type, lda, p.b, b_type,
              ldb, beta, p.c, c_type, ldc);
    }
    for (int s = 0; s < n_streams; ++s) {
      DMOE_CHECK_CUDA(cudaEventRecord(side.done[s], side.streams[s]));
      DMOE_CHECK_CUDA(cudaStreamWaitEvent(ctx.stream, side.done[s], 0));
    }
    return;
  }

  if (!use_grouped) {
    // NOTE: the loop is the path for large products (faster, see above), mixed-type products (weight
    // gradients of bf16 experts into f32) and row lengths that break 16-byte alignment; each call is
    // one expert's whole product.
    for (const GemmProblem& p : problems)
      gemm_rm(ctx.cublas, trans_a, trans_b, p.m, p.n, p.k, alpha, p.a, a_type, lda, p.b, b_type, ldb, beta,
              p.c, c_type, ldc);
    return;
  }

  // One group per problem (every expert has its own m or k); cuBLAS sees the swapped product (see
  // gemm_rm), so its A array holds our B pointers and its B array our A pointers.
  const int64_t g = int64_t(problems.size());
  std::vector<cublasOperation_t> trans_a_arr(g, op(trans_b)), trans_b_arr(g, op(trans_a));
  std::vector<int64_t> m_arr(g), n_arr(g), k_arr(g), lda_arr(g, ldb), ldb_arr(g, lda), ldc_arr(g, ldc);
  std::vector<int64_t> group_size(g, 1);
  std::vector<float> alpha_arr(g, alpha), beta_arr(g, beta);
  std::vector<const void*> pointers(3 * g);  // [cublas A (= our B)] [cublas B (= our A)] [C]
  for (int64_t i = 0; i < g; ++i) {
    const GemmProblem& p = problems[i];
    m_arr[i] = p.n;
    n_arr[i] = p.m;
    k_arr[i] = p.k;
    pointers[i] = p.b;
    pointers[g + i] = p.a;
    pointers[2 * g + i] = p.c;
  }
  upload_async(pointer_scratch, pointers.data(), pointers.size() * sizeof(void*), ctx.stream);
  void** device_pointers = static_cast<void**>(pointer_scratch);  // [3g] as laid out above
  const void* const* cublas_a = device_pointers;
  const void* const* cublas_b = device_pointers + g;
  void* const* cublas_c = device_pointers + 2 * g;
  DMOE_CHECK_CUBLAS(cublasGemmGroupedBatchedEx_64(
      ctx.cublas, trans_a_arr.data(), trans_b_arr.data(), m_arr.data(), n_arr.data(), k_arr.data(),
      alpha_arr.data(), cublas_a, b_type, lda_arr.data(), cublas_b, a_type, ldb_arr.data(), beta_arr.data(),
      cublas_c, c_type, ldc_arr.data(), g, group_size.data(), CUBLAS_COMPUTE_32F));
}

}  // namespace dmoe::cuda
