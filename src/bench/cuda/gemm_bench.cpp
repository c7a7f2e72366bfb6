#include "bench/cuda/gemm_bench.hpp"

#include <algorithm>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <utility>

#include "bench/cuda/gpu_timing.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"

namespace dmoe::bench {

std::vector<GemmVariant> parse_gemm_variants(const std::string& list) {
  std::vector<GemmVariant> out;
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t end = std::min(list.find(',', begin), list.size());
    const std::string name = list.substr(begin, end - begin);
    begin = end + 1;
    if (name.empty()) continue;
    GemmVariant v{name, {}};
    for (size_t i = 0; i < name.size();) {
      const char key = name[i++];
      size_t digits = i;
      while (digits < name.size() && std::isdigit(static_cast<unsigned char>(name[digits]))) ++digits;
      const std::string number = name.substr(i, digits - i);
      i = digits;
      const bool needs_number = key == 'b';
      DMOE_REQUIRE(!needs_number || !number.empty(), "GEMM variant '{}': '{}' needs a number (e.g. b256)", name,
                   key);
      DMOE_REQUIRE(number.size() <= 4, "GEMM variant '{}': the number after '{}' is too long", name, key);
      switch (key) {
        case 'b': v.tuning.block_n = std::stoi(number); break;
        case 's': v.tuning.epilogue = 1; break;
        case 'd': v.tuning.epilogue = 2; break;
        case 'q': v.tuning.schedule = 2; break;  // dynamic tile schedule (a global queue)
        case 'E': v.tuning.leave_out = 1; break;  // measurement: stores left out
        case 'M': v.tuning.leave_out = 2; break;  // measurement: products and stores left out
        default:
          DMOE_FAIL("GEMM variant '{}': unknown key '{}'; allowed: b<N> (tile width), "
                    "s (staged epilogue), d (direct epilogue), q (dynamic tile schedule), E (stores left out), M (products "
                    "and stores left out)", name, key);
      }
    }
    out.push_back(v);
  }
  DMOE_REQUIRE(!out.empty(), "no GEMM variants in '{}'", list);
  return out;
}

namespace {

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { DMOE_CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~DeviceBuffer() { cuda::free_quietly(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  __nv_bfloat16* bf16() const { return static_cast<__nv_bfloat16*>(p); }
};

// Rows per expert of T tokens each routed to k distinct experts drawn uniformly.
std::vector<int64_t> uniform_routing_offsets(int64_t tokens, int32_t experts, int32_t top_k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> counts(experts, 0);
  std::vector<int32_t> ids(experts);
  for (int32_t e = 0; e < experts; ++e) ids[e] = e;
  for (int64_t t = 0; t < tokens; ++t)
    for (int32_t j = 0; j < top_k; ++j) {  // partial Fisher-Yates: k distinct experts
      const int32_t pick = j + int32_t(rng() % uint64_t(experts - j));
      std::swap(ids[j], ids[pick]);
      ++counts[ids[j]];
    }
  std::vector<int64_t> offsets(experts + 1, 0);
  for (int32_t e = 0; e < experts; ++e) offsets[e + 1] = offsets[e] + counts[e];
  return offsets;
}

// Bytes the kernel's tiles load: per tile and k-block, BM rows of A and BN rows of B, 128 bytes each.
double tile_loads(const std::vector<int64_t>& offsets, int64_t n_out, int64_t k, int tile_n_out, int tile_b_rows) {
  double bytes = 0;
  const int64_t k_blocks = (k + 63) / 64, n_tiles = (n_out + tile_n_out - 1) / tile_n_out;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t m_tiles = (offsets[e + 1] - offsets[e] + 127) / 128;
    bytes += double(m_tiles * n_tiles * k_blocks) * (128 + tile_b_rows) * 128.0;
  }
  return bytes;
}

// Rank 0's experts (W = 1: all of them) of the config's uniform routing: row offsets and rows. The kernels
// timed are bf16 only: `what` names the benchmark in the error for another dtype.
struct LocalRouting {
  int32_t experts = 0;
  std::vector<int64_t> offsets;  // [experts + 1]
  int64_t rows = 0;
};
LocalRouting local_routing(const MoeConfig& c, uint64_t seed, const char* what) {
  DMOE_REQUIRE(c.dtype == DType::bf16, "{}: the kernels are bf16 only (config dtype {})", what, dtype_name(c.dtype));
  const std::vector<int64_t> offsets = uniform_routing_offsets(c.tokens * c.world, c.experts, c.top_k, seed);
  LocalRouting r;
  r.experts = c.experts_per_rank();
  r.offsets.assign(offsets.begin(), offsets.begin() + r.experts + 1);
  r.rows = r.offsets.back();
  return r;
}

// A cuBLAS handle on `stream` with the engine's math mode (no TF32).
struct CublasHandle {
  cublasHandle_t h = nullptr;
  explicit CublasHandle(cudaStream_t stream) {
    DMOE_CHECK_CUBLAS(cublasCreate(&h));
    DMOE_CHECK_CUBLAS(cublasSetStream(h, stream));
    DMOE_CHECK_CUBLAS(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
  }
  ~CublasHandle() { cublasDestroy(h); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
};

// Times every row's work in the same rounds (GpuTimer::time_interleaved), so the GPU's clock drift over the
// run does not favour the rows measured first, and fills in their statistics.
void time_rows(std::vector<GemmBenchRow>& rows, const std::vector<std::function<void()>>& work, cudaStream_t stream) {
  GpuTimer timer(stream);
  TimingOptions timing;
  timing.warmup = 2;
  timing.min_iterations = 15;
  timing.min_total_ms = 3000;
  const std::vector<Stats> stats = timer.time_interleaved(work, timing);
  for (size_t i = 0; i < rows.size(); ++i) rows[i].stats = stats[i];
  DMOE_CHECK_CUDA(cudaStreamSynchronize(stream));
}

}  // namespace

std::vector<GemmBenchRow> bench_expert_gemms(const MoeConfig& c, const std::vector<GemmVariant>& variants,
                                             bool square, cudaStream_t stream, uint64_t seed) {
  const int64_t H = c.hidden, I = c.ffn;
  const bool swiglu = c.activation == Activation::swiglu;
  const LocalRouting routing = local_routing(c, seed, "dmoe bench gemm");
  const int32_t E = routing.experts;
  const std::vector<int64_t>& local = routing.offsets;
  const int64_t N = routing.rows;

  DeviceBuffer x(size_t(N) * H * 2), w1(size_t(E) * I * H * 2), w3(swiglu ? size_t(E) * I * H * 2 : 0),
      w2(size_t(E) * H * I * 2), h(size_t(N) * I * 2), out(size_t(N) * H * 2);
  fill_uniform_bf16(x.p, N * H, seed + 1, 1.0f, stream);
  fill_uniform_bf16(w1.p, E * I * H, seed + 2, 0.03f, stream);
  if (swiglu) fill_uniform_bf16(w3.p, E * I * H, seed + 3, 0.03f, stream);
  fill_uniform_bf16(w2.p, E * H * I, seed + 4, 0.03f, stream);
  fill_uniform_bf16(h.p, N * I, seed + 5, 1.0f, stream);

  cuda::Workspace workspace;
  cuda::CudaContext ctx;
  ctx.stream = stream;
  ctx.workspace = &workspace;
  void* scratch = workspace.reserve(cuda::sm90_grouped_gemm_scratch_bytes(std::max(E, 1)), stream);

  cuda::GroupedGemmNT up{x.bf16(), w1.bf16(), nullptr, local.data(), E, I, H, h.bf16(), c.activation,
                         swiglu ? w3.bf16() : nullptr, nullptr};
  cuda::GroupedGemmNT down{h.bf16(), w2.bf16(), out.bf16(), local.data(), E, H, I};
  DMOE_REQUIRE(cuda::sm90_grouped_gemm_usable(up) && cuda::sm90_grouped_gemm_usable(down),
               "dmoe bench gemm: the own grouped GEMM cannot run here (needs an sm_90 GPU and a build for sm_90a)");

  // Every (variant, product) is timed in the same rounds (time_rows).
  std::vector<GemmBenchRow> rows;
  std::vector<std::function<void()>> work;
  const double up_flop = 2.0 * double(N) * double(swiglu ? 2 * I : I) * double(H);
  const double down_flop = 2.0 * double(N) * double(H) * double(I);
  for (const GemmVariant& v : variants) {
    const int bn = v.tuning.block_n == 0 ? 256 : v.tuning.block_n;
    rows.push_back({v.name, "up", {}, up_flop, tile_loads(local, I, H, swiglu ? bn / 2 : bn, bn)});
    work.push_back([&, v] { cuda::sm90_grouped_gemm(ctx, scratch, up, v.tuning); });
    rows.push_back({v.name, "down", {}, down_flop, tile_loads(local, H, I, bn, bn)});
    work.push_back([&, v] { cuda::sm90_grouped_gemm(ctx, scratch, down, v.tuning); });
  }
  constexpr int64_t S = 8192;
  const std::vector<int64_t> one{0, S};
  std::unique_ptr<DeviceBuffer> a, b, cc;
  cuda::GroupedGemmNT g;
  if (square) {
    a = std::make_unique<DeviceBuffer>(size_t(S) * S * 2);
    b = std::make_unique<DeviceBuffer>(size_t(S) * S * 2);
    cc = std::make_unique<DeviceBuffer>(size_t(S) * S * 2);
    fill_uniform_bf16(a->p, S * S, seed + 6, 1.0f, stream);
    fill_uniform_bf16(b->p, S * S, seed + 7, 1.0f, stream);
    g = cuda::GroupedGemmNT{a->bf16(), b->bf16(), cc->bf16(), one.data(), 1, S, S};
    for (const GemmVariant& v : variants) {
      const int bn = v.tuning.block_n == 0 ? 256 : v.tuning.block_n;
      rows.push_back({v.name, "square 8192^3", {}, 2.0 * double(S) * S * S, tile_loads(one, S, S, bn, bn)});
      work.push_back([&, v] { cuda::sm90_grouped_gemm(ctx, scratch, g, v.tuning); });
    }
  }
  time_rows(rows, work, stream);
  return rows;
}

std::vector<GemmBenchRow> bench_dgrad_gemms(const MoeConfig& c, const std::vector<GemmVariant>& variants,
                                            cudaStream_t stream, uint64_t seed) {
  const int64_t H = c.hidden, I = c.ffn;
  const bool swiglu = c.activation == Activation::swiglu;
  const LocalRouting routing = local_routing(c, seed, "dmoe bench gemm --dgrad");
  const int32_t E = routing.experts;
  const std::vector<int64_t>& local = routing.offsets;
  const int64_t N = routing.rows;

  DeviceBuffer dout(size_t(N) * H * 2), dpre1(size_t(N) * I * 2), dpre3(swiglu ? size_t(N) * I * 2 : 0),
      w1(size_t(E) * I * H * 2), w3(swiglu ? size_t(E) * I * H * 2 : 0), w2(size_t(E) * H * I * 2),
      dh(size_t(N) * I * 2), dx(size_t(N) * H * 2);
  fill_uniform_bf16(dout.p, N * H, seed + 11, 1.0f, stream);
  fill_uniform_bf16(dpre1.p, N * I, seed + 12, 1.0f, stream);
  if (swiglu) fill_uniform_bf16(dpre3.p, N * I, seed + 13, 1.0f, stream);
  fill_uniform_bf16(w1.p, E * I * H, seed + 14, 0.03f, stream);
  if (swiglu) fill_uniform_bf16(w3.p, E * I * H, seed + 15, 0.03f, stream);
  fill_uniform_bf16(w2.p, E * H * I, seed + 16, 0.03f, stream);

  cuda::Workspace workspace;
  cuda::CudaContext ctx;
  ctx.stream = stream;
  ctx.workspace = &workspace;
  const CublasHandle blas(stream);
  ctx.cublas = blas.h;
  const size_t scratch_bytes = (cuda::sm90_grouped_gemm_scratch_bytes(std::max(E, 1)) + 255) / 256 * 256;
  char* ws = static_cast<char*>(workspace.reserve(scratch_bytes + cuda::grouped_pointer_bytes(E) + 256, stream));
  void* scratch = ws;
  void* pointers = ws + scratch_bytes;

  const cuda::GroupedGemmNN g_dh{dout.bf16(), w2.bf16(), dh.bf16(), local.data(), E, I, H};
  const cuda::GroupedGemmNN g_dx{dpre1.bf16(), w1.bf16(), dx.bf16(), local.data(), E, H, I,
                                 swiglu ? dpre3.bf16() : nullptr, swiglu ? w3.bf16() : nullptr};
  DMOE_REQUIRE(cuda::sm90_grouped_gemm_nn_usable(g_dh) && cuda::sm90_grouped_gemm_nn_usable(g_dx),
               "dmoe bench gemm --dgrad: the own NN kernel cannot run here (needs an sm_90 GPU and a build for sm_90a)");

  // cuBLAS's problems, as expert_ffn_backward builds them (experts with rows only).
  std::vector<cuda::GemmProblem> dh_p, dx1_p, dx3_p;
  for (int32_t e = 0; e < E; ++e) {
    const int64_t r0 = local[e], n = local[e + 1] - r0;
    if (n == 0) continue;
    const int64_t w = e * H * I;
    dh_p.push_back({n, I, H, dout.bf16() + r0 * H, w2.bf16() + w, dh.bf16() + r0 * I});
    dx1_p.push_back({n, H, I, dpre1.bf16() + r0 * I, w1.bf16() + w, dx.bf16() + r0 * H});
    if (swiglu) dx3_p.push_back({n, H, I, dpre3.bf16() + r0 * I, w3.bf16() + w, dx.bf16() + r0 * H});
  }
  const cudaDataType_t t = CUDA_R_16BF;

  std::vector<GemmBenchRow> rows;
  std::vector<std::function<void()>> work;
  const double dh_flop = 2.0 * double(N) * double(I) * double(H);
  const double dx_flop = dh_flop * (swiglu ? 2 : 1);
  for (const GemmVariant& v : variants) {
    if (v.tuning.epilogue == 1) continue;  // staged: not built for NN
    const int bn = v.tuning.block_n == 0 ? 256 : v.tuning.block_n;
    rows.push_back({v.name, "dh", {}, dh_flop, tile_loads(local, I, H, bn, bn)});
    work.push_back([&, v] { cuda::sm90_grouped_gemm_nn(ctx, scratch, g_dh, v.tuning); });
    rows.push_back({v.name, "dx", {}, dx_flop, tile_loads(local, H, swiglu ? 2 * I : I, bn, bn)});
    work.push_back([&, v] { cuda::sm90_grouped_gemm_nn(ctx, scratch, g_dx, v.tuning); });
  }
  rows.push_back({"cublas", "dh", {}, dh_flop, 0});
  work.push_back([&] { cuda::gemm_rm_grouped(ctx, pointers, false, false, H, I, I, 1.f, 0.f, t, t, t, dh_p); });
  rows.push_back({"cublas", "dx", {}, dx_flop, 0});
  work.push_back([&] {
    cuda::gemm_rm_grouped(ctx, pointers, false, false, I, H, H, 1.f, 0.f, t, t, t, dx1_p);
    if (swiglu) cuda::gemm_rm_grouped(ctx, pointers, false, false, I, H, H, 1.f, 1.f, t, t, t, dx3_p);
  });
  time_rows(rows, work, stream);
  return rows;
}

std::vector<GemmBenchRow> bench_wgrad_gemms(const MoeConfig& c, cudaStream_t stream, uint64_t seed) {
  const int64_t H = c.hidden, I = c.ffn;
  const bool swiglu = c.activation == Activation::swiglu;
  const LocalRouting routing = local_routing(c, seed, "dmoe bench gemm --wgrad");
  const int32_t E = routing.experts;
  const std::vector<int64_t>& local = routing.offsets;
  const int64_t N = routing.rows;

  // The backward's activations and one f32 gradient buffer [E, H·I] that every product writes (dw1, dw3
  // and dw2 have the same size; the values only matter for the kernels' speed, not their results).
  DeviceBuffer dout(size_t(N) * H * 2), h(size_t(N) * I * 2), dpre1(size_t(N) * I * 2),
      dpre3(swiglu ? size_t(N) * I * 2 : 0), x(size_t(N) * H * 2), dw(size_t(E) * H * I * sizeof(float)),
      dw_bf16(size_t(E) * H * I * 2);
  fill_uniform_bf16(dout.p, N * H, seed + 21, 1.0f, stream);
  fill_uniform_bf16(h.p, N * I, seed + 22, 1.0f, stream);
  fill_uniform_bf16(dpre1.p, N * I, seed + 23, 1.0f, stream);
  if (swiglu) fill_uniform_bf16(dpre3.p, N * I, seed + 24, 1.0f, stream);
  fill_uniform_bf16(x.p, N * H, seed + 25, 1.0f, stream);
  DMOE_CHECK_CUDA(cudaMemsetAsync(dw.p, 0, size_t(E) * H * I * sizeof(float), stream));

  cuda::Workspace workspace;
  cuda::CudaContext ctx;
  ctx.stream = stream;
  ctx.workspace = &workspace;
  const CublasHandle blas(stream);
  ctx.cublas = blas.h;
  const size_t scratch_bytes =
      (std::max(cuda::sm90_grouped_wgrad_scratch_bytes(std::max(E, 1)), cuda::grouped_wgrad_scratch_bytes(std::max(E, 1))) +
       255) / 256 * 256;
  char* ws = static_cast<char*>(workspace.reserve(scratch_bytes + cuda::grouped_pointer_bytes(E) + 256, stream));
  void* scratch = ws;
  void* pointers = ws + scratch_bytes;
  int64_t active = 0;
  for (int32_t e = 0; e < E; ++e) active += local[e + 1] > local[e];

  struct Product {
    const char* name;
    const DeviceBuffer* a;  // [N, m]
    const DeviceBuffer* b;  // [N, n]
    int64_t m, n;
  };
  std::vector<Product> products{{"dw1", &dpre1, &x, I, H}};
  if (swiglu) products.push_back({"dw3", &dpre3, &x, I, H});
  products.push_back({"dw2", &dout, &h, H, I});

  std::vector<GemmBenchRow> rows;
  std::vector<std::function<void()>> work;
  for (const Product& pr : products) {
    // bf16 gradients (the PyTorch module's bf16 experts, the GPU model's bf16 expert gradients): stored, the sm90
    // kernel's two store paths against cuBLAS's per-expert calls with bf16 output.
    {
      cuda::GroupedWgrad g;
      g.a = pr.a->bf16();
      g.b = pr.b->bf16();
      g.c_bf16 = static_cast<__nv_bfloat16*>(dw_bf16.p);
      g.row_offsets = local.data();
      g.groups = E;
      g.m = pr.m;
      g.n = pr.n;
      g.lda = pr.m;
      g.ldb = pr.n;
      g.c_group_stride = H * I;
      g.accumulate = false;  // a bf16 C is stored, never accumulated (the kernel refuses that; the default adds)
      DMOE_REQUIRE(cuda::sm90_grouped_wgrad_usable(g),
                   "dmoe bench gemm --wgrad: the bf16-output weight-gradient kernel cannot run here (needs an sm_90 "
                   "GPU and a build for sm_90a)");
      std::vector<cuda::GemmProblem> loop;
      for (int32_t e = 0; e < E; ++e) {
        const int64_t r0 = local[e], rows_e = local[e + 1] - r0;
        if (rows_e == 0) continue;
        loop.push_back({pr.m, pr.n, rows_e, pr.a->bf16() + r0 * pr.m, pr.b->bf16() + r0 * pr.n,
                        static_cast<__nv_bfloat16*>(dw_bf16.p) + e * H * I});
      }
      const std::string product = std::string(pr.name) + " bf16";
      const double flop = 2.0 * double(N) * double(pr.m) * double(pr.n);
      // At least: the operands once and C written (2 bytes an element).
      const double bytes = double(N) * double(pr.m + pr.n) * 2 + double(active) * double(pr.m * pr.n) * 2;
      cuda::Sm90WgradTuning wide, pairs;
      pairs.bf16_store = 1;
      rows.push_back({"sm90", product, {}, flop, 0, bytes});
      work.push_back([&, g, wide] { cuda::sm90_grouped_wgrad(ctx, scratch, g, wide); });
      rows.push_back({"sm90pairs", product, {}, flop, 0, bytes});
      work.push_back([&, g, pairs] { cuda::sm90_grouped_wgrad(ctx, scratch, g, pairs); });
      rows.push_back({"cublas", product, {}, flop, 0, bytes});
      work.push_back([&, pr, loop] {
        const cudaDataType_t t = CUDA_R_16BF;
        cuda::gemm_rm_grouped(ctx, pointers, true, false, pr.m, pr.n, pr.n, 1.f, 0.f, t, t, t, loop);
      });
    }
    for (const bool accumulate : {false, true}) {
      cuda::GroupedWgrad g;
      g.a = pr.a->bf16();
      g.b = pr.b->bf16();
      g.c = static_cast<float*>(dw.p);
      g.row_offsets = local.data();
      g.groups = E;
      g.m = pr.m;
      g.n = pr.n;
      g.lda = pr.m;
      g.ldb = pr.n;
      g.c_group_stride = H * I;
      g.accumulate = accumulate;
      DMOE_REQUIRE(cuda::sm90_grouped_wgrad_usable(g) && cuda::grouped_wgrad_usable(g),
                   "dmoe bench gemm --wgrad: the weight-gradient kernels cannot run here (needs an sm_90 GPU and a "
                   "build for sm_90a)");
      // cuBLAS's problems, as expert_ffn_backward builds them (experts with rows only).
      std::vector<cuda::GemmProblem> loop;
      for (int32_t e = 0; e < E; ++e) {
        const int64_t r0 = local[e], rows_e = local[e + 1] - r0;
        if (rows_e == 0) continue;
        loop.push_back({pr.m, pr.n, rows_e, pr.a->bf16() + r0 * pr.m, pr.b->bf16() + r0 * pr.n,
                        static_cast<float*>(dw.p) + e * H * I});
      }
      const std::string product = std::string(pr.name) + (accumulate ? " acc" : " store");
      const double flop = 2.0 * double(N) * double(pr.m) * double(pr.n);
      // At least: the operands once, C written, and C read when accumulating.
      const double bytes =
          double(N) * double(pr.m + pr.n) * 2 + double(active) * double(pr.m * pr.n) * 4 * (accumulate ? 2 : 1);
      const int tm = (pr.m + 127) / 128, tn = (pr.n + 127) / 128;
      // Tile loads of the sm90 kernel: per tile and k-block of 64 rows, 128 A and 128 B columns of 128 bytes.
      double tile_bytes = 0;
      for (int32_t e = 0; e < E; ++e) tile_bytes += double((local[e + 1] - local[e] + 63) / 64) * tm * tn * 2 * 128 * 128;
      // The strip schedule (groups of at most 320 rows; longer ones as above): A's k-blocks once per strip of
      // up to 8 column tiles, B's per tile.
      double strip_bytes = 0;
      const int strips_per_row = (tn + 7) / 8;
      for (int32_t e = 0; e < E; ++e) {
        const int64_t rows_e = local[e + 1] - local[e], kb = (rows_e + 63) / 64;
        strip_bytes += rows_e > 320 ? double(kb) * tm * tn * 2 * 128 * 128
                                    : double(kb) * tm * (strips_per_row + tn) * 128 * 128;
      }
      auto add = [&](const char* variant, std::function<void()> fn, double tiles) {
        rows.push_back({variant, product, {}, flop, tiles, bytes});
        work.push_back(std::move(fn));
      };
      cuda::Sm90WgradTuning load, red, tiles;
      load.accumulate = 1;
      red.accumulate = 2;
      tiles.accumulate = 1;
      tiles.schedule = 1;
      add("sm90", [&, g, load] { cuda::sm90_grouped_wgrad(ctx, scratch, g, load); }, strip_bytes);
      if (accumulate) add("sm90red", [&, g, red] { cuda::sm90_grouped_wgrad(ctx, scratch, g, red); }, strip_bytes);
      add("sm90tiles", [&, g, tiles] { cuda::sm90_grouped_wgrad(ctx, scratch, g, tiles); }, tile_bytes);
      add("mma", [&, g] { cuda::grouped_wgrad(ctx, scratch, g); }, 0);
      add("cublas", [&, pr, loop, accumulate] {
        const cudaDataType_t t = CUDA_R_16BF;
        cuda::gemm_rm_grouped(ctx, pointers, true, false, pr.m, pr.n, pr.n, 1.f, accumulate ? 1.f : 0.f, t, t,
                              CUDA_R_32F, loop);
      }, 0);
    }
  }
  time_rows(rows, work, stream);
  return rows;
}

}  // namespace dmoe::bench
