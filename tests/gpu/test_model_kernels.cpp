// test_model_kernels.cpp — the CUDA model kernels (cuda/model_kernels.cu) against their CPU twins
// (cpu/model_kernels.cpp), in f32 and bf16 storage.
//
// bf16: the CPU inputs are the bf16-rounded values, so both sides compute from the same numbers; the GPU's
// bf16 outputs are compared with the CPU's unrounded f32/fp64 results. Rounding to bf16 moves a value by
// at most half an ulp, which is at most 2^-8 of its magnitude (8 significant bits): kBf16Rel below.
// Every check states its tolerance and why. Tolerances "relative to the row's scale" allow
// rel·|cpu| + row_rel·max|cpu row|: f32 sums of random-signed terms err in absolute terms, not relative to
// an element that happens to cancel to near zero.
//
// Sizes: small and odd (rows 1, 3, 37; hidden 8, 96, 130 — 130 takes the kernels' single-element paths,
// 8 and 96 their 16-byte packs; vocab 300 and 301; head_dim 8, 64, 128), and larger ones for the
// reductions (rows 4096 × hidden 1024; cross-entropy over 5000 rows, more than the 4096 blocks of the
// loss partials, and 256 rows × vocab 32000).
//
// Fresh random inputs on every run; the seed is printed with any failure. Skips without a CUDA device.
//   build/tests/dmoe_gpu_tests --gtest_filter='CudaModelKernels*'
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/dtype.hpp"
#include "cpu/model_kernels.hpp"
#include "cuda/model_kernels.cuh"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

using cuda::bf16;
using test::has_cuda_device;


// ---- tolerances ------------------------------------------------------------------------------------

// Half a bf16 ulp relative to the value (see the file comment).
const double kBf16Rel = std::ldexp(1.0, -8);
// f32 results of the same inputs, the CPU accumulating in fp64 and the GPU in f32.
constexpr double kF32Rel = 1e-5;

// ---- device memory -----------------------------------------------------------------------------------

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

template <typename U>
class Buf {
 public:
  explicit Buf(size_t count) : count_(count) {
    check_cuda(cudaMalloc(&data_, std::max<size_t>(count, 1) * sizeof(U)), "cudaMalloc");
  }
  template <typename H>
  explicit Buf(const std::vector<H>& host) : Buf(host.size()) {
    upload(host);
  }
  ~Buf() {
    if (data_) cudaFree(data_);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  Buf(Buf&& o) noexcept : data_(std::exchange(o.data_, nullptr)), count_(o.count_) {}

  U* get() const { return data_; }
  size_t size() const { return count_; }
  template <typename H>
  void upload(const std::vector<H>& host) {
    static_assert(sizeof(H) == sizeof(U), "host and device element sizes differ");
    if (host.size() != count_) throw std::runtime_error("Buf::upload: size mismatch");
    check_cuda(cudaMemcpy(data_, host.data(), count_ * sizeof(U), cudaMemcpyHostToDevice), "upload");
  }
  template <typename H = U>
  std::vector<H> read() const {
    static_assert(sizeof(H) == sizeof(U), "host and device element sizes differ");
    check_cuda(cudaDeviceSynchronize(), "kernels before a read");
    std::vector<H> out(count_);
    check_cuda(cudaMemcpy(out.data(), data_, count_ * sizeof(U), cudaMemcpyDeviceToHost), "download");
    return out;
  }

 private:
  U* data_ = nullptr;
  size_t count_ = 0;
};

// Host representation of a storage type: f32 values, or bf16 bits.
template <typename T>
struct Repr;
template <>
struct Repr<float> {
  using Host = float;
  static Host encode(float v) { return v; }
  static float decode(Host h) { return h; }
  static float round(float v) { return v; }
  static constexpr bool kBf16 = false;
};
template <>
struct Repr<bf16> {
  using Host = uint16_t;
  static Host encode(float v) { return float_to_bf16(v).bits; }
  static float decode(Host h) { return bf16_to_float(bfloat16{h}); }
  static float round(float v) { return round_to_bf16(v); }
  static constexpr bool kBf16 = true;
};

template <typename T>
Buf<T> to_device(const std::vector<float>& values) {
  std::vector<typename Repr<T>::Host> host(values.size());
  for (size_t i = 0; i < values.size(); ++i) host[i] = Repr<T>::encode(values[i]);
  return Buf<T>(host);
}

template <typename T>
std::vector<float> from_device(const Buf<T>& buf) {
  const auto host = buf.template read<typename Repr<T>::Host>();
  std::vector<float> out(host.size());
  for (size_t i = 0; i < host.size(); ++i) out[i] = Repr<T>::decode(host[i]);
  return out;
}

// The values a T buffer holds after to_device (what the CPU twin must see).
template <typename T>
std::vector<float> rounded(std::vector<float> values) {
  for (float& v : values) v = Repr<T>::round(v);
  return values;
}

// Stream, cuBLAS handle bound to it (no TF32, as the engine's), workspace.
struct GpuEnv {
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  cuda::Workspace ws;
  GpuEnv() {
    check_cuda(cudaStreamCreate(&stream), "cudaStreamCreate");
    if (cublasCreate(&cublas) != CUBLAS_STATUS_SUCCESS) throw std::runtime_error("cublasCreate");
    cublasSetStream(cublas, stream);
    cublasSetMathMode(cublas, CUBLAS_DEFAULT_MATH);
  }
  ~GpuEnv() {
    cudaStreamSynchronize(stream);
    cublasDestroy(cublas);
    cudaStreamDestroy(stream);
  }
};

// ---- random inputs -------------------------------------------------------------------------------------

using test::fresh_seed;

#define DMOE_SEED_TRACE(seed) SCOPED_TRACE(::testing::Message() << "seed " << (seed))

std::vector<float> normal(std::mt19937_64& rng, size_t count, double mean = 0, double stddev = 1) {
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<float> v(count);
  for (float& x : v) x = float(dist(rng));
  return v;
}

std::vector<float> to_f32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

// ---- comparisons ---------------------------------------------------------------------------------------

// |got − want| <= rel·|want| + row_rel·max_{row}|want| + abs element by element, rows of `cols` elements
// (cols = 0: the whole vector is one row). NaN fails. The message gives the count, the worst element and
// the first.
template <typename G, typename W>
testing::AssertionResult near(const std::string& what, const std::vector<G>& got, const std::vector<W>& want,
                              double rel, double row_rel, size_t cols = 0, double abs = 0) {
  if (got.size() != want.size())
    return testing::AssertionFailure() << what << ": sizes differ (gpu " << got.size() << ", cpu " << want.size()
                                       << ")";
  if (cols == 0) cols = std::max<size_t>(want.size(), 1);
  size_t bad = 0, first = 0, worst = 0;
  double worst_excess = -1;
  for (size_t r0 = 0; r0 < want.size(); r0 += cols) {
    const size_t r1 = std::min(want.size(), r0 + cols);
    double scale = 0;
    for (size_t i = r0; i < r1; ++i) scale = std::max(scale, std::fabs(double(want[i])));
    for (size_t i = r0; i < r1; ++i) {
      const double err = std::fabs(double(got[i]) - double(want[i]));
      const double allowed = rel * std::fabs(double(want[i])) + row_rel * scale + abs;
      if (!(err <= allowed)) {
        if (bad++ == 0) first = i;
        const double excess = std::isnan(err) ? std::numeric_limits<double>::infinity() : err - allowed;
        if (excess > worst_excess) {
          worst_excess = excess;
          worst = i;
        }
      }
    }
  }
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << bad << " of " << want.size()
                                     << " elements outside tolerance (rel " << rel << ", row_rel " << row_rel
                                     << "); worst at " << worst << " (gpu " << double(got[worst]) << ", cpu "
                                     << double(want[worst]) << "); first at " << first << " (gpu "
                                     << double(got[first]) << ", cpu " << double(want[first]) << ")";
}

template <typename U>
testing::AssertionResult bitwise_equal(const std::string& what, const std::vector<U>& got,
                                       const std::vector<U>& want) {
  if (got.size() != want.size())
    return testing::AssertionFailure() << what << ": sizes differ (" << got.size() << " vs " << want.size() << ")";
  size_t bad = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(U)) == 0) continue;
    if (bad++ < 5) first << " [" << i << "] " << +got[i] << " vs " << +want[i] << ";";
  }
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " differ:" << first.str();
}

// Distance in units in the last place between two finite floats (0: the same bits, up to ±0).
int64_t ulp_distance(float a, float b) {
  auto ordered = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? int64_t(INT32_MIN) - int64_t(i) : int64_t(i);
  };
  return std::llabs(ordered(a) - ordered(b));
}

testing::AssertionResult within_ulps(const std::string& what, const std::vector<float>& got,
                                     const std::vector<float>& want, int64_t max_ulps) {
  if (got.size() != want.size()) return testing::AssertionFailure() << what << ": sizes differ";
  size_t bad = 0, first = 0;
  int64_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const int64_t d = std::isfinite(got[i]) ? ulp_distance(got[i], want[i]) : INT64_MAX;
    worst = std::max(worst, d);
    if (d > max_ulps && bad++ == 0) first = i;
  }
  if (bad == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " elements more than "
                                     << max_ulps << " ulp apart (worst " << worst << "); first at " << first
                                     << " (gpu " << got[first] << ", cpu " << want[first] << ")";
}

// ---- the typed suite: every test runs for f32 and bf16 storage ------------------------------------------

template <typename T>
class CudaModelKernels : public testing::Test {};
using StorageTypes = testing::Types<float, bf16>;
TYPED_TEST_SUITE(CudaModelKernels, StorageTypes);

// Tolerance of an output stored as T: f32 error only, or that plus the bf16 rounding.
template <typename T>
double storage_rel(double f32_rel) {
  return Repr<T>::kBf16 ? kBf16Rel + f32_rel : f32_rel;
}

// ---- embedding ------------------------------------------------------------------------------------------

TYPED_TEST(CudaModelKernels, EmbeddingForwardCopiesRows) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  const int64_t vocab = 300;
  for (int64_t hidden : {8, 96, 130})
    for (int64_t n : {1, 3, 37}) {
      SCOPED_TRACE(testing::Message() << "hidden " << hidden << " n " << n);
      const std::vector<float> table = rounded<T>(normal(rng, size_t(vocab * hidden)));
      std::vector<int32_t> tokens(n);
      for (auto& t : tokens) t = int32_t(rng() % uint64_t(vocab));
      tokens[0] = int32_t(vocab - 1);  // the last row too
      std::vector<float> want(size_t(n * hidden));
      cpu::embedding_forward(tokens.data(), table.data(), want.data(), n, vocab, hidden);

      Buf<int32_t> d_tokens(tokens);
      Buf<T> d_table = to_device<T>(table);
      Buf<T> d_out(size_t(n * hidden));
      cuda::embedding_forward<T>(d_tokens.get(), d_table.get(), d_out.get(), n, vocab, hidden, env.stream);
      // A copy: bit-exact.
      EXPECT_TRUE(bitwise_equal("embedding out", from_device(d_out), want));
    }
}

TYPED_TEST(CudaModelKernels, EmbeddingBackwardRepeatedTokensDeterministic) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  const int64_t vocab = 300;
  const int32_t hot = 7;  // many positions of one token
  for (int64_t hidden : {8, 96, 130})
    for (int64_t n : {1, 3, 37, 2000}) {
      SCOPED_TRACE(testing::Message() << "hidden " << hidden << " n " << n);
      // 40% of the positions are the hot token, the rest from [0, 50): rows 50..299 receive nothing.
      std::vector<int32_t> tokens(n);
      for (auto& t : tokens) t = rng() % 5 < 2 ? hot : int32_t(rng() % 50);
      const std::vector<float> dout = rounded<T>(normal(rng, size_t(n * hidden)));
      const std::vector<float> init = normal(rng, size_t(vocab * hidden));  // dtable accumulates (+=)

      std::vector<double> want(init.begin(), init.end());
      cpu::embedding_backward(tokens.data(), dout.data(), want.data(), n, vocab, hidden);

      Buf<int32_t> d_tokens(tokens);
      Buf<T> d_dout = to_device<T>(dout);
      Buf<float> d_table(init);
      cuda::embedding_backward<T>(d_tokens.get(), d_dout.get(), d_table.get(), n, vocab, hidden, env.ws,
                                  env.stream);
      const std::vector<float> got = d_table.read();
      // f32 sums in position order vs fp64: the rounding error of an f32 sum of up to ~800 unit-scale terms
      // stays far below 1e-5 of the row's scale; rel 1e-5 for the elements themselves.
      EXPECT_TRUE(near("dtable", got, want, kF32Rel, kF32Rel, size_t(hidden)));
      // Rows no position names are untouched: exactly their initial values.
      const std::vector<float> unused_got(got.begin() + 50 * hidden, got.end());
      const std::vector<float> unused_init(init.begin() + 50 * hidden, init.end());
      EXPECT_TRUE(bitwise_equal("unused rows", unused_got, unused_init));

      // A second run from the same initial table: bit for bit the same (no atomics, a stable sort).
      d_table.upload(init);
      cuda::embedding_backward<T>(d_tokens.get(), d_dout.get(), d_table.get(), n, vocab, hidden, env.ws,
                                  env.stream);
      EXPECT_TRUE(bitwise_equal("dtable, second run", d_table.read(), got));
    }
}

// ---- RMSNorm --------------------------------------------------------------------------------------------

struct RowsHidden {
  int64_t rows, hidden;
};
const RowsHidden kRmsShapes[] = {{1, 8}, {3, 96}, {37, 130}, {37, 8}, {3, 130}, {4096, 1024}};

TYPED_TEST(CudaModelKernels, RmsNormForward) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  const float eps = 1e-5f;
  for (const RowsHidden s : kRmsShapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " hidden " << s.hidden);
    const std::vector<float> x = rounded<T>(normal(rng, size_t(s.rows * s.hidden), 0, 2));
    const std::vector<float> w = rounded<T>(normal(rng, size_t(s.hidden), 1, 0.1));
    std::vector<float> y(x.size()), rstd(s.rows);
    cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), s.rows, s.hidden, eps);

    Buf<T> d_x = to_device<T>(x), d_w = to_device<T>(w);
    Buf<T> d_y(x.size());
    Buf<float> d_rstd(size_t(s.rows));
    cuda::rmsnorm_forward<T>(d_x.get(), d_w.get(), d_y.get(), d_rstd.get(), s.rows, s.hidden, eps, env.stream);
    // rstd: an f32 sum of H positive squares (a few dozen sequential terms a thread, then a tree) has a
    // relative error of a few 1e-6 at H = 1024; the CPU's mean is fp64. rel 1e-5.
    EXPECT_TRUE(near("rstd", d_rstd.read(), rstd, kF32Rel, 0));
    // y = w·(x·rstd): the same f32 products as the CPU, so only rstd's error (rel 1e-5), plus the bf16
    // rounding of the output.
    EXPECT_TRUE(near("y", from_device(d_y), y, storage_rel<T>(kF32Rel), 0));
  }
}

TYPED_TEST(CudaModelKernels, RmsNormBackward) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const RowsHidden s : kRmsShapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " hidden " << s.hidden);
    const std::vector<float> x = rounded<T>(normal(rng, size_t(s.rows * s.hidden), 0, 2));
    const std::vector<float> w = rounded<T>(normal(rng, size_t(s.hidden), 1, 0.1));
    const std::vector<float> dy = rounded<T>(normal(rng, x.size()));
    std::vector<float> y(x.size()), rstd(s.rows);
    cpu::rmsnorm_forward(x.data(), w.data(), y.data(), rstd.data(), s.rows, s.hidden, 1e-5f);
    const std::vector<float> dw_init = normal(rng, size_t(s.hidden));  // dw accumulates
    std::vector<float> dx(x.size());
    std::vector<double> dw(dw_init.begin(), dw_init.end());
    cpu::rmsnorm_backward(x.data(), w.data(), rstd.data(), dy.data(), dx.data(), dw.data(), s.rows, s.hidden);

    Buf<T> d_x = to_device<T>(x), d_w = to_device<T>(w), d_dy = to_device<T>(dy);
    Buf<float> d_rstd(rstd), d_dw(dw_init);  // both sides use the CPU's rstd
    Buf<T> d_dx = to_device<T>(normal(rng, x.size()));  // garbage: dx is overwritten
    cuda::rmsnorm_backward<T>(d_x.get(), d_w.get(), d_rstd.get(), d_dy.get(), d_dx.get(), d_dw.get(), s.rows,
                              s.hidden, env.ws, env.stream);
    // dx = rstd·w·dy − rstd³·x·dot/H: the f32 dot over H terms errs by ~1e-6 of the row's scale; rel 1e-5
    // to the row's scale (dx cancels to near zero at some elements), plus the bf16 rounding.
    EXPECT_TRUE(near("dx", from_device(d_dx), dx, storage_rel<T>(kF32Rel), kF32Rel, size_t(s.hidden)));
    // dw += Σ_rows dy·x·rstd: f32 sums over 16-row blocks, then over up to 256 block partials; the errors of
    // such sums of random-signed terms stay below 1e-5 of the largest |dw|.
    const std::vector<float> got_dw = d_dw.read();
    EXPECT_TRUE(near("dw", got_dw, dw, kF32Rel, kF32Rel));

    // Deterministic: the same dw from the same start.
    d_dw.upload(dw_init);
    cuda::rmsnorm_backward<T>(d_x.get(), d_w.get(), d_rstd.get(), d_dy.get(), d_dx.get(), d_dw.get(), s.rows,
                              s.hidden, env.ws, env.stream);
    EXPECT_TRUE(bitwise_equal("dw, second run", d_dw.read(), got_dw));
  }
}

// ---- rotary position embedding -------------------------------------------------------------------------

struct RopeShape {
  int64_t batch, seq, heads, head_dim;
  double theta;
};
const RopeShape kRopeShapes[] = {{1, 1, 1, 8, 10000.0},    {3, 5, 3, 8, 10000.0},    {1, 37, 2, 64, 10000.0},
                                 {3, 5, 1, 128, 1e6},      {2, 37, 3, 128, 500000.0},
                                 {1, 4096, 2, 128, 1e6}};  // angles up to 4095 rad

TYPED_TEST(CudaModelKernels, RopeForwardBackwardInPlace) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const RopeShape s : kRopeShapes) {
    SCOPED_TRACE(testing::Message() << "batch " << s.batch << " seq " << s.seq << " heads " << s.heads
                                    << " head_dim " << s.head_dim << " theta " << s.theta);
    const int64_t n = s.batch * s.seq;
    const size_t count = size_t(n * s.heads * s.head_dim);
    const std::vector<float> x = rounded<T>(normal(rng, count));
    std::vector<float> want(count), want_back(count);
    cpu::rope_forward(x.data(), want.data(), n, s.seq, s.heads, s.head_dim, s.theta);
    cpu::rope_backward(x.data(), want_back.data(), n, s.seq, s.heads, s.head_dim, s.theta);
    // inv_freq and the angles are the CPU's own f32 values (the launcher computes inv_freq on the host with
    // the CPU twin's expressions); cos/sin differ by a couple of f32 ulps (CUDA's sincosf vs the host's
    // libm), so each output is off by ~1e-7 of its vector's scale: rel 1e-5 to the head vector's scale,
    // plus the bf16 rounding.
    const double rel = storage_rel<T>(kF32Rel);

    Buf<T> d_x = to_device<T>(x);
    Buf<T> d_y(count);
    cuda::rope_forward<T>(d_x.get(), d_y.get(), n, s.seq, s.heads, s.head_dim, s.theta, env.stream);
    const std::vector<float> got = from_device(d_y);
    EXPECT_TRUE(near("rope forward", got, want, rel, kF32Rel, size_t(s.head_dim)));
    cuda::rope_backward<T>(d_x.get(), d_y.get(), n, s.seq, s.heads, s.head_dim, s.theta, env.stream);
    const std::vector<float> got_back = from_device(d_y);
    EXPECT_TRUE(near("rope backward", got_back, want_back, rel, kF32Rel, size_t(s.head_dim)));

    // In place (x and y the same buffer): the same bits as out of place.
    Buf<T> d_inplace = to_device<T>(x);
    cuda::rope_forward<T>(d_inplace.get(), d_inplace.get(), n, s.seq, s.heads, s.head_dim, s.theta, env.stream);
    EXPECT_TRUE(bitwise_equal("rope forward in place", from_device(d_inplace), got));
    d_inplace.upload(d_x.template read<typename Repr<T>::Host>());
    cuda::rope_backward<T>(d_inplace.get(), d_inplace.get(), n, s.seq, s.heads, s.head_dim, s.theta, env.stream);
    EXPECT_TRUE(bitwise_equal("rope backward in place", from_device(d_inplace), got_back));
  }
}

// ---- linear ---------------------------------------------------------------------------------------------

struct LinearShape {
  int64_t rows, in, out;
};
const LinearShape kLinearShapes[] = {{1, 8, 96}, {3, 96, 130}, {37, 130, 8}, {37, 96, 96}, {3, 130, 130}};

// y = x·wᵀ with output type Y, against the CPU on the same (rounded) inputs.
template <typename T, typename Y>
void check_linear_forward(std::mt19937_64& rng, GpuEnv& env, const LinearShape& s) {
  const std::vector<float> x = rounded<T>(normal(rng, size_t(s.rows * s.in)));
  const std::vector<float> w = rounded<T>(normal(rng, size_t(s.out * s.in), 0, 0.1));
  std::vector<float> want(size_t(s.rows * s.out));
  cpu::linear_forward(x.data(), w.data(), want.data(), s.rows, s.in, s.out);
  Buf<T> d_x = to_device<T>(x), d_w = to_device<T>(w);
  Buf<Y> d_y(want.size());
  cuda::linear_forward<T, Y>(d_x.get(), d_w.get(), d_y.get(), s.rows, s.in, s.out, env.cublas);
  // cuBLAS with f32 accumulation (no TF32) on products exact in f32: dot products of `in` terms err by
  // ~1e-7 of the row's scale; rel 1e-5 to the row's scale, plus the bf16 rounding of a bf16 output.
  EXPECT_TRUE(near("linear y", from_device(d_y), want, storage_rel<Y>(kF32Rel), kF32Rel, size_t(s.out)));
}

TYPED_TEST(CudaModelKernels, LinearForward) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const LinearShape s : kLinearShapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " in " << s.in << " out " << s.out);
    check_linear_forward<T, T>(rng, env, s);
    if constexpr (std::is_same_v<T, bf16>) check_linear_forward<bf16, float>(rng, env, s);  // f32 logits
  }
}

TYPED_TEST(CudaModelKernels, LinearBackwardAccumulates) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const LinearShape s : kLinearShapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " in " << s.in << " out " << s.out);
    const std::vector<float> x = rounded<T>(normal(rng, size_t(s.rows * s.in)));
    const std::vector<float> w = rounded<T>(normal(rng, size_t(s.out * s.in), 0, 0.1));
    const std::vector<float> dy = rounded<T>(normal(rng, size_t(s.rows * s.out)));
    const std::vector<float> dw_init = normal(rng, w.size());
    const std::vector<float> dx_init = rounded<T>(normal(rng, x.size()));

    // CPU: two backward calls accumulating into dw; dx of the second call; dx_init + dx for the
    // accumulating variant.
    std::vector<float> dx(x.size());
    std::vector<double> dw(dw_init.begin(), dw_init.end());
    cpu::linear_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), s.rows, s.in, s.out);
    cpu::linear_backward(x.data(), w.data(), dy.data(), dx.data(), dw.data(), s.rows, s.in, s.out);
    std::vector<double> dx_acc(x.size());
    for (size_t i = 0; i < x.size(); ++i) dx_acc[i] = double(dx_init[i]) + double(dx[i]);

    Buf<T> d_x = to_device<T>(x), d_w = to_device<T>(w), d_dy = to_device<T>(dy);
    Buf<float> d_dw(dw_init);
    Buf<T> d_dx = to_device<T>(normal(rng, x.size()));  // garbage: overwritten
    cuda::linear_backward<T>(d_x.get(), d_w.get(), d_dy.get(), d_dx.get(), d_dw.get(), s.rows, s.in, s.out,
                             env.cublas);
    cuda::linear_backward<T>(d_x.get(), d_w.get(), d_dy.get(), nullptr, d_dw.get(), s.rows, s.in, s.out,
                             env.cublas);  // dx null: only dw
    // Dot products of `out` (dx) or `rows` (dw) terms in f32: ~1e-7 of the row's scale; rel 1e-5 to it (and
    // the bf16 rounding of dx).
    EXPECT_TRUE(near("dx", from_device(d_dx), dx, storage_rel<T>(kF32Rel), kF32Rel, size_t(s.in)));
    EXPECT_TRUE(near("dw (accumulated twice)", d_dw.read(), dw, kF32Rel, kF32Rel, size_t(s.in)));

    Buf<T> d_dx_acc = to_device<T>(dx_init);
    Buf<float> d_dw2(dw_init);
    cuda::linear_backward<T>(d_x.get(), d_w.get(), d_dy.get(), d_dx_acc.get(), d_dw2.get(), s.rows, s.in, s.out,
                             env.cublas, /*accumulate_dx=*/true);
    // dx_init + dy·w with cuBLAS beta = 1. For a bf16 dx cuBLAS rounds dy·w to bf16 before adding the bf16
    // dx_init and rounds the sum again (measured on the H200: 1.5 ulp off where one rounding gives 0.5): two
    // bf16 roundings; f32 as above.
    const double acc_rel = std::is_same_v<T, float> ? storage_rel<T>(kF32Rel) : 2 * storage_rel<T>(kF32Rel);
    // The intermediate dy·w is rounded at its own scale (the row's), which cancellation against dx_init can make
    // much larger than the result: bf16 rows get the same two roundings relative to the row's scale.
    const double acc_row_rel = std::is_same_v<T, float> ? kF32Rel : acc_rel;
    EXPECT_TRUE(near("dx accumulated", from_device(d_dx_acc), dx_acc, acc_rel, acc_row_rel, size_t(s.in)));
  }
}

// ---- cross-entropy --------------------------------------------------------------------------------------

constexpr int32_t kIgnore = -100;

struct CeShape {
  int64_t rows, vocab;
  bool all_ignored = false;
};
const CeShape kCeShapes[] = {{1, 300},    {3, 300},  {37, 300}, {37, 301}, {3, 301, true},
                             {5000, 300}, {256, 32000}};

struct CeCase {
  std::vector<float> logits;
  std::vector<int32_t> targets;
};

CeCase random_ce(std::mt19937_64& rng, const CeShape& s) {
  CeCase c;
  c.logits = normal(rng, size_t(s.rows * s.vocab), 0, 3);
  c.targets.resize(s.rows);
  for (int64_t r = 0; r < s.rows; ++r) {
    c.targets[r] = int32_t(rng() % uint64_t(s.vocab));
    if (s.all_ignored || (s.rows > 1 && (r == 0 || rng() % 4 == 0))) c.targets[r] = kIgnore;  // ~1/4 ignored
  }
  if (s.rows > 2 && !s.all_ignored) c.targets[s.rows - 1] = int32_t(s.vocab - 1);  // the last column
  return c;
}

TEST(CudaModelKernelsF32, CrossEntropyForward) {
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const CeShape s : kCeShapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " vocab " << s.vocab);
    const CeCase c = random_ce(rng, s);
    std::vector<float> lse(s.rows);
    double loss = 0;
    int64_t count = 0;
    cpu::cross_entropy_forward(c.logits.data(), c.targets.data(), lse.data(), &loss, &count, s.rows, s.vocab,
                               kIgnore);

    Buf<float> d_logits(c.logits), d_lse(size_t(s.rows));
    Buf<int32_t> d_targets(c.targets);
    Buf<double> d_loss(std::vector<double>{std::nan("")});  // overwritten, not accumulated
    Buf<int64_t> d_count(std::vector<int64_t>{-12345});
    cuda::cross_entropy_forward(d_logits.get(), d_targets.get(), d_lse.get(), d_loss.get(), d_count.get(), s.rows,
                                s.vocab, kIgnore, env.ws, env.stream);
    // lse: an f32 online sum of `vocab` exponentials (relative error ~1e-6) then fp64 m + log(s), rounded to
    // f32 (an ulp of |lse| ~ 10 is 1e-6): abs 1e-5.
    {
      const std::vector<float> got = d_lse.read();
      size_t bad = 0, first = 0;
      for (size_t r = 0; r < got.size(); ++r)
        if (!(std::fabs(double(got[r]) - double(lse[r])) <= 1e-5) && bad++ == 0) first = r;
      EXPECT_EQ(bad, 0u) << "lse rows off by more than 1e-5; first: row " << first << " (gpu " << got[first]
                         << ", cpu " << lse[first] << ")";
    }
    // count: exact. loss_sum: each row's term inherits lse's error (<= 1e-5), summed in fp64:
    // |Δ| <= 1e-5 · count.
    EXPECT_EQ(d_count.read()[0], count);
    const double got_loss = d_loss.read()[0];
    EXPECT_NEAR(got_loss, loss, 1e-5 * double(std::max<int64_t>(count, 1)));
    if (count == 0) {
      EXPECT_EQ(got_loss, 0.0);
    }

    // Deterministic: the same bits again.
    cuda::cross_entropy_forward(d_logits.get(), d_targets.get(), d_lse.get(), d_loss.get(), d_count.get(), s.rows,
                                s.vocab, kIgnore, env.ws, env.stream);
    EXPECT_TRUE(bitwise_equal("loss_sum, second run", d_loss.read(), std::vector<double>{got_loss}));
  }
}

TYPED_TEST(CudaModelKernels, CrossEntropyBackward) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const CeShape s : kCeShapes) {
    SCOPED_TRACE(testing::Message() << "rows " << s.rows << " vocab " << s.vocab);
    const CeCase c = random_ce(rng, s);
    std::vector<float> lse(s.rows);
    double loss = 0;
    int64_t count = 0;
    cpu::cross_entropy_forward(c.logits.data(), c.targets.data(), lse.data(), &loss, &count, s.rows, s.vocab,
                               kIgnore);
    const double scale = 1.0 / double(std::max<int64_t>(count, 1));  // the mean's gradient
    std::vector<float> want(c.logits.size());
    cpu::cross_entropy_backward(c.logits.data(), c.targets.data(), lse.data(), want.data(), s.rows, s.vocab,
                                kIgnore, scale);

    Buf<float> d_logits(c.logits), d_lse(lse);  // both sides use the CPU's lse
    Buf<int32_t> d_targets(c.targets);
    Buf<T> d_dlogits = to_device<T>(normal(rng, c.logits.size()));  // garbage: overwritten
    cuda::cross_entropy_backward<T>(d_logits.get(), d_targets.get(), d_lse.get(), d_dlogits.get(), s.rows, s.vocab,
                                    kIgnore, scale, env.stream);
    const std::vector<float> got = from_device(d_dlogits);
    // p = expf(x − lse) in f32: rounding x − lse (|x − lse| <= ~25) errs by <= 1e-6 of p, expf adds 2 ulps:
    // rel 1e-5 (plus the bf16 rounding). The target's p − 1 can cancel: its error is absolute, <= ~1.5e-6·scale
    // since p <= 1: abs 4e-6·scale.
    EXPECT_TRUE(near("dlogits", got, want, storage_rel<T>(kF32Rel), 0, size_t(s.vocab), 4e-6 * scale));
    // Ignored rows: exactly zero.
    size_t nonzero = 0;
    for (int64_t r = 0; r < s.rows; ++r)
      if (c.targets[r] == kIgnore)
        for (int64_t i = 0; i < s.vocab; ++i) nonzero += got[size_t(r * s.vocab + i)] != 0.f;
    EXPECT_EQ(nonzero, 0u) << "ignored rows must be all zeros";

    if constexpr (std::is_same_v<T, float>) {
      // dlogits may alias logits (f32): the same bits as into a separate buffer.
      Buf<float> d_alias(c.logits);
      cuda::cross_entropy_backward<float>(d_alias.get(), d_targets.get(), d_lse.get(), d_alias.get(), s.rows,
                                          s.vocab, kIgnore, scale, env.stream);
      EXPECT_TRUE(bitwise_equal("dlogits aliasing logits", d_alias.read(), got));
    }
  }
}

// ---- optimizer ------------------------------------------------------------------------------------------

cpu::AdamWParams adamw_params(int64_t step) {
  cpu::AdamWParams p;
  p.lr = 3e-4;
  p.beta1 = 0.9;
  p.beta2 = 0.95;
  p.eps = 1e-8;
  p.weight_decay = 0.1;
  p.step = step;
  return p;
}

// Sizes: scalar only (1, 3), float4 packs and a tail (37, 1001), and an unaligned start (offset 1: the
// scalar kernel).
struct AdamShape {
  int64_t n;
  int64_t offset;
};
const AdamShape kAdamShapes[] = {{1, 0}, {3, 0}, {37, 0}, {1001, 0}, {37, 1}, {4096, 1}};

TYPED_TEST(CudaModelKernels, AdamWMatchesCpu) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const AdamShape s : kAdamShapes)
    for (int64_t step : {1, 10}) {
      for (double grad_scale : {1.0, 0.37}) {
        SCOPED_TRACE(testing::Message() << "n " << s.n << " offset " << s.offset << " step " << step
                                        << " grad_scale " << grad_scale);
        const size_t total = size_t(s.n + s.offset);
        std::vector<float> param = normal(rng, total), grad = normal(rng, total, 0, 0.01);
        std::vector<float> m = normal(rng, total, 0, 0.001), v = normal(rng, total, 0, 1e-4);
        for (float& x : v) x = std::fabs(x);  // second moments are >= 0
        if (step == 1)
          for (size_t i = 0; i < total; ++i) m[i] = v[i] = 0.f;  // the first step starts from zero moments

        // CPU: the clipping factor as the trainer applies it (scale_in_place), then the step.
        std::vector<float> cp = param, cg = grad, cm = m, cv = v;
        const cpu::AdamWParams ap = adamw_params(step);
        cpu::scale_in_place(cg.data() + s.offset, s.n, grad_scale);
        cpu::adamw_step(cp.data() + s.offset, cg.data() + s.offset, cm.data() + s.offset, cv.data() + s.offset, s.n,
                        ap);

        Buf<float> d_p(param), d_g(grad), d_m(m), d_v(v);
        Buf<T> d_copy = to_device<T>(std::vector<float>(total, 0.f));
        cuda::adamw_step<T>(d_p.get() + s.offset, d_g.get() + s.offset, d_m.get() + s.offset, d_v.get() + s.offset,
                            s.n, ap, grad_scale, d_copy.get() + s.offset, env.stream);
        // The same fp64 operations in the same order (the GPU folds grad_scale in but rounds the scaled
        // gradient to f32 as scale_in_place stores it): the results should be bit-identical; 1 f32 ulp
        // allowed.
        const std::vector<float> gp = d_p.read(), gm = d_m.read(), gv = d_v.read();
        EXPECT_TRUE(within_ulps("param", gp, cp, 1));
        EXPECT_TRUE(within_ulps("m", gm, cm, 1));
        EXPECT_TRUE(within_ulps("v", gv, cv, 1));
        // The copy in T: exactly the rounding of the updated param (elements before `offset` untouched: 0).
        const std::vector<float> copy = from_device(d_copy);
        std::vector<float> want_copy(total, 0.f);
        for (size_t i = size_t(s.offset); i < total; ++i) want_copy[i] = Repr<T>::round(gp[i]);
        EXPECT_TRUE(bitwise_equal("param_copy", copy, want_copy));
        // The gradient is read only.
        EXPECT_TRUE(bitwise_equal("grad unchanged", d_g.read(), grad));

        // Without a copy: the same update.
        Buf<float> d_p2(param), d_m2(m), d_v2(v);
        cuda::adamw_step<T>(d_p2.get() + s.offset, d_g.get() + s.offset, d_m2.get() + s.offset,
                            d_v2.get() + s.offset, s.n, ap, grad_scale, static_cast<T*>(nullptr), env.stream);
        EXPECT_TRUE(bitwise_equal("param without copy", d_p2.read(), gp));
      }
    }
}

TEST(CudaModelKernelsF32, SumOfSquaresAndScale) {
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  const AdamShape shapes[] = {{1, 0}, {3, 0}, {37, 0}, {1001, 0}, {1000, 1}, {4096 * 1024, 0}, {4096 * 1024 + 3, 1}};
  for (const AdamShape s : shapes) {
    SCOPED_TRACE(testing::Message() << "n " << s.n << " offset " << s.offset);
    const std::vector<float> g = normal(rng, size_t(s.n + s.offset));
    const double want = cpu::sum_of_squares(g.data() + s.offset, s.n);
    Buf<float> d_g(g);
    Buf<double> d_out(std::vector<double>{std::nan("")});  // overwritten
    cuda::sum_of_squares(d_g.get() + s.offset, s.n, d_out.get(), env.ws, env.stream);
    const double got = d_out.read()[0];
    // fp64 sums of the same n non-negative terms (the squares of floats are exact in fp64) in two orders:
    // each within (n − 1)·2^-53 of the exact sum, relative.
    EXPECT_NEAR(got, want, 2.0 * double(s.n) * std::ldexp(1.0, -53) * want);
    cuda::sum_of_squares(d_g.get() + s.offset, s.n, d_out.get(), env.ws, env.stream);
    EXPECT_TRUE(bitwise_equal("sum of squares, second run", d_out.read(), std::vector<double>{got}));

    // scale_in_place: one fp64 product rounded to f32, as the CPU: bit-identical.
    std::vector<float> want_scaled = g;
    cpu::scale_in_place(want_scaled.data() + s.offset, s.n, 0.3);
    cuda::scale_in_place(d_g.get() + s.offset, s.n, 0.3, env.stream);
    EXPECT_TRUE(bitwise_equal("scale_in_place", d_g.read(), want_scaled));
  }
  // The empty sum is 0 (written, not left as it was).
  Buf<double> d_out(std::vector<double>{std::nan("")});
  Buf<float> d_g(size_t(1));
  cuda::sum_of_squares(d_g.get(), 0, d_out.get(), env.ws, env.stream);
  EXPECT_EQ(d_out.read()[0], 0.0);
}

// ---- bf16 gradients (the GPU model's bf16 expert gradients, CudaMixtralModel) ----------------------------
//
// cuda::adamw_step / sum_of_squares on bf16 gradients against their CPU twins (cpu/model_kernels.cpp). Read both
// implementations side by side:
//  - AdamW: the GPU's adamw_one is the CPU loop operation for operation in fp64, each explicitly rounded
//    (__dmul_rn, __dadd_rn, __ddiv_rn, __dsqrt_rn: no FMA contraction), the constants (bc1, bc2, 1 - beta, decay)
//    from the same host expressions; the host side is built -std=c++20 (CMAKE_CXX_EXTENSIONS OFF, so GCC's
//    -ffp-contract=off) with no -march, so the CPU twin has no FMA either; a bf16 is read as the float it holds
//    on both sides (exact). grad_scale (the clipping factor): the GPU rounds g·scale to f32, as the CPU's
//    scale_in_place stores it before its f32 adamw_step reads it. So the same IEEE operations in the same order:
//    params, moments and the bf16 copy must be the CPU's bit for bit (no ulp allowed).
//  - sum_of_squares: the squares of bf16 values are exact in fp64 (16 significant bits) on both sides; the CPU adds
//    them in index order, the GPU per thread, then a block tree, then the blocks' partials: another order. Random
//    gradients: each side within γ(n−1) ≈ (n−1)·2^-53 of the exact sum (non-negative terms, any order), so within
//    2n·2^-53 of each other, relative. Gradients whose squares are multiples of 2^-42 below 2^-20 (|g| in
//    [2^-14, 2^-10), or 0): every partial sum of up to 2^31 of them is a multiple of 2^-42 below 2^53·2^-42,
//    exactly representable, so every order gives the exact sum: the GPU must equal the CPU bit for bit (an
//    element dropped or read twice shows).
// Every result is also rerun (the same call on the same inputs: bit-identical, the kernels are deterministic)
// and compared with the f32-gradient kernel on the floats the bf16 gradients hold (bit for bit: the same
// arithmetic, and for the sum the same geometry and order, which depend on n and the alignment path only).

// Shapes: n elements at element offset `offset` in param, m, v and the copy, and `grad_offset` in the gradient.
// AdamW's packed kernel (param, m, v 16-byte aligned, bf16 gradient 8-byte, copy 8-byte) launches
// ceil(((n + 3) / 4) / 256) blocks of 256 threads, at most 8192 (2^23 elements a pass of its grid-stride loop),
// one float4/4×bf16 pack a thread, then the n % 4 tail one at a time; the scalar kernel ceil(n / 256) blocks, at
// most 8192 (2^21 elements a pass).
struct Bf16GradShape {
  int64_t n, offset, grad_offset;
};
const Bf16GradShape kBf16GradAdamShapes[] = {
    {1, 0, 0},       {3, 0, 0},  // scalar tail only (n < 4)
    {37, 0, 0},                  // one block: 9 packs, tail 1
    {1001, 0, 0},                // one block: 250 packs, tail 1
    {3077, 0, 0},                // 4 blocks, the last with 1 pack; tail 1
    {20483, 4, 4},               // packs from an offset of 4 elements (16 B f32, 8 B bf16): 5120 packs in 20 blocks
                                 // (a 21st launched for (n + 3) / 4 = 5121 has none); tail 3
    {37, 1, 1},      {4096, 1, 1},  // all unaligned: the scalar kernel (16 blocks for 4096)
    {1001, 0, 1},    {1001, 0, 2},  // only the gradient unaligned (2 B, 4 B: not 8): scalar
    {1001, 2, 0},                   // only param/m/v unaligned (8 B: not 16): scalar
    {(int64_t(1) << 23) + 4 * 37 + 3, 0, 0},  // packs: a second grid-stride pass of 37 packs; tail 3
    {(int64_t(1) << 21) + 1001, 1, 1},        // scalar: a second grid-stride pass of 1001 elements
};

// N(0, 0.01) gradients rounded to bf16 (their bits), with edge values spread through: +0, -0, 1e-30 (far below
// eps: the update is ~0), ±1e4 (the update saturates at ±lr), every few dozen elements.
std::vector<bfloat16> bf16_grads(std::mt19937_64& rng, size_t count) {
  const std::vector<float> g = normal(rng, count, 0, 0.01);
  std::vector<bfloat16> out(count);
  for (size_t i = 0; i < count; ++i) {
    float x = g[i];
    if (i % 97 == 5) x = 0.0f;
    if (i % 89 == 7) x = -0.0f;
    if (i % 83 == 11) x = (i & 1) ? 1e-30f : -1e-30f;
    if (i % 79 == 13) x = (i & 1) ? 1e4f : -1e4f;
    out[i] = float_to_bf16(x);
  }
  return out;
}

std::vector<float> held_floats(const std::vector<bfloat16>& g) {
  std::vector<float> f(g.size());
  for (size_t i = 0; i < g.size(); ++i) f[i] = bf16_to_float(g[i]);
  return f;
}

std::vector<uint16_t> bits_of(const std::vector<bfloat16>& g) {
  std::vector<uint16_t> b(g.size());
  for (size_t i = 0; i < g.size(); ++i) b[i] = g[i].bits;
  return b;
}

TEST(CudaModelKernelsBf16Grad, AdamWIsTheCpuTwinBitForBit) {
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const Bf16GradShape s : kBf16GradAdamShapes) {
    const size_t total = size_t(s.n + s.offset), gtotal = size_t(s.n + s.grad_offset);
    const std::vector<float> param0 = normal(rng, total);
    const std::vector<bfloat16> g16 = bf16_grads(rng, gtotal);
    const std::vector<float> gheld = held_floats(g16);
    const std::vector<float> m_rand = normal(rng, total, 0, 0.001);
    std::vector<float> v_rand = normal(rng, total, 0, 1e-4);
    for (float& x : v_rand) x = std::fabs(x);  // second moments are >= 0
    Buf<float> d_p(total), d_m(total), d_v(total), d_p2(total), d_m2(total), d_v2(total), d_gf(gheld);
    Buf<bf16> d_g(g16), d_copy(total), d_copy2(total);
    Buf<float> d_copyf(total);
    const std::vector<uint16_t> zeros16(total, 0);
    // step 1: the first step, from zero moments (bias corrections 1 − β^1: m̂ = g, v̂ = g², the update ≈ ±lr);
    // 2 and 10: later steps from random moments.
    for (int64_t step : {1, 2, 10})
      for (double grad_scale : {1.0, 0.37}) {
        SCOPED_TRACE(testing::Message() << "n " << s.n << " offset " << s.offset << " grad_offset " << s.grad_offset
                                        << " step " << step << " grad_scale " << grad_scale);
        const std::vector<float> m0 = step == 1 ? std::vector<float>(total, 0.f) : m_rand;
        const std::vector<float> v0 = step == 1 ? std::vector<float>(total, 0.f) : v_rand;
        const cpu::AdamWParams ap = adamw_params(step);
        const size_t o = size_t(s.offset), go = size_t(s.grad_offset);

        // CPU: the bf16 twin where there is no clipping factor; else the trainer's order on the held floats
        // (scale_in_place rounds g·scale to f32, then the f32 twin).
        std::vector<float> cp = param0, cm = m0, cv = v0;
        if (grad_scale == 1.0) {
          cpu::adamw_step(cp.data() + o, g16.data() + go, cm.data() + o, cv.data() + o, s.n, ap);
        } else {
          std::vector<float> cg = gheld;
          cpu::scale_in_place(cg.data() + go, s.n, grad_scale);
          cpu::adamw_step(cp.data() + o, cg.data() + go, cm.data() + o, cv.data() + o, s.n, ap);
        }

        // GPU, with the bf16 copy of the weights (what a bf16 model's kernels read).
        d_p.upload(param0), d_m.upload(m0), d_v.upload(v0), d_copy.upload(zeros16);
        cuda::adamw_step<bf16>(d_p.get() + o, d_g.get() + go, d_m.get() + o, d_v.get() + o, s.n, ap, grad_scale,
                               d_copy.get() + o, env.stream);
        const std::vector<float> gp = d_p.read(), gm = d_m.read(), gv = d_v.read();
        // Tolerance 0: the same IEEE operations in the same order (the block comment above); the elements outside
        // [offset, offset + n) must be untouched on both sides.
        EXPECT_TRUE(bitwise_equal("param vs CPU twin", gp, cp));
        EXPECT_TRUE(bitwise_equal("m vs CPU twin", gm, cm));
        EXPECT_TRUE(bitwise_equal("v vs CPU twin", gv, cv));
        // The copy: exactly the bf16 rounding of the updated f32 param (round to nearest even on both sides);
        // zeros outside the range.
        const std::vector<uint16_t> copy = d_copy.read<uint16_t>();
        std::vector<uint16_t> want_copy(total, 0);
        for (size_t i = o; i < total; ++i) want_copy[i] = float_to_bf16(cp[i]).bits;
        EXPECT_TRUE(bitwise_equal("bf16 copy", copy, want_copy));
        EXPECT_TRUE(bitwise_equal("gradient is read only", d_g.read<uint16_t>(), bits_of(g16)));

        // Determinism: the same call on the same inputs again, bit for bit.
        d_p2.upload(param0), d_m2.upload(m0), d_v2.upload(v0), d_copy2.upload(zeros16);
        cuda::adamw_step<bf16>(d_p2.get() + o, d_g.get() + go, d_m2.get() + o, d_v2.get() + o, s.n, ap, grad_scale,
                               d_copy2.get() + o, env.stream);
        EXPECT_TRUE(bitwise_equal("param, rerun", d_p2.read(), gp));
        EXPECT_TRUE(bitwise_equal("m, rerun", d_m2.read(), gm));
        EXPECT_TRUE(bitwise_equal("v, rerun", d_v2.read(), gv));
        EXPECT_TRUE(bitwise_equal("bf16 copy, rerun", d_copy2.read<uint16_t>(), copy));

        // The f32-gradient kernel on the floats the bf16 gradients hold, with an f32 copy (an f32 model's
        // instantiation): each element's arithmetic is the same, so the same bits; the copy is the param itself.
        d_p2.upload(param0), d_m2.upload(m0), d_v2.upload(v0), d_copyf.upload(std::vector<float>(total, 0.f));
        cuda::adamw_step<float>(d_p2.get() + o, d_gf.get() + go, d_m2.get() + o, d_v2.get() + o, s.n, ap,
                                grad_scale, d_copyf.get() + o, env.stream);
        EXPECT_TRUE(bitwise_equal("param, f32-gradient kernel", d_p2.read(), gp));
        EXPECT_TRUE(bitwise_equal("m, f32-gradient kernel", d_m2.read(), gm));
        EXPECT_TRUE(bitwise_equal("v, f32-gradient kernel", d_v2.read(), gv));
        std::vector<float> want_copyf(total, 0.f);
        std::copy(gp.begin() + std::ptrdiff_t(o), gp.end(), want_copyf.begin() + std::ptrdiff_t(o));
        EXPECT_TRUE(bitwise_equal("f32 copy", d_copyf.read(), want_copyf));

        // Without a copy (the bf16 gradient kernel, copy nullptr): the same update.
        d_p2.upload(param0), d_m2.upload(m0), d_v2.upload(v0);
        cuda::adamw_step<bf16>(d_p2.get() + o, d_g.get() + go, d_m2.get() + o, d_v2.get() + o, s.n, ap, grad_scale,
                               static_cast<bf16*>(nullptr), env.stream);
        EXPECT_TRUE(bitwise_equal("param without a copy", d_p2.read(), gp));
        if (HasFailure()) return;  // one shape's report, not thirteen
      }
  }
  // step 0 has no bias correction (1 − β^0 = 0): refused, as the CPU twin refuses it.
  Buf<float> p(size_t(4)), m(size_t(4)), v(size_t(4));
  Buf<bf16> g(size_t(4));
  EXPECT_ANY_THROW(cuda::adamw_step<bf16>(p.get(), g.get(), m.get(), v.get(), 4, adamw_params(0), 1.0,
                                          static_cast<bf16*>(nullptr), env.stream));
}

// Gradients whose sum of squares is exact in any order (the block comment above): |g| in [2^-14, 2^-10) with a
// random sign and 7 random fraction bits, or ±0 (every 7th element).
std::vector<bfloat16> exact_sum_bf16_grads(std::mt19937_64& rng, size_t count) {
  std::vector<bfloat16> out(count);
  for (size_t i = 0; i < count; ++i) {
    const uint64_t r = rng();
    const uint16_t sign = uint16_t((r & 1) << 15);
    if (i % 7 == 3) {
      out[i].bits = sign;  // ±0
      continue;
    }
    const uint16_t exponent = uint16_t(127 - 14 + int((r >> 1) % 4));  // 2^-14 .. 2^-11
    const uint16_t fraction = uint16_t((r >> 8) & 0x7f);
    out[i].bits = uint16_t(sign | (exponent << 7) | fraction);
  }
  return out;
}

TEST(CudaModelKernelsBf16Grad, SumOfSquaresMatchesCpuTwin) {
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  // The kernel: ceil(n / 4096) blocks of 256 threads, at most 1024, fp64 per thread over packs of 4 (8-byte
  // aligned) or single elements, a block tree, then one block over the partials. Sizes: one block (1, 3, 37,
  // 1001), unaligned starts (offsets 1, 2: 2 B and 4 B, the scalar kernel; offset 4: 8 B, packs), 6 blocks and a
  // tail of 3, the 1024 blocks exactly (4 passes of packs), and 16 grid-stride passes (packs, tail 1; scalar).
  const AdamShape shapes[] = {{1, 0},    {3, 0},           {37, 0},
                              {1001, 0}, {1000, 1},        {1000, 2},
                              {1000, 4}, {5 * 4096 + 3, 0}, {4096 * 1024, 0},
                              {(int64_t(1) << 24) + 1, 0}, {(int64_t(1) << 22) + 3, 1}};
  for (const AdamShape s : shapes)
    for (bool exact : {false, true}) {
      SCOPED_TRACE(testing::Message() << "n " << s.n << " offset " << s.offset
                                      << (exact ? " (exactly summable)" : " (random)"));
      const size_t total = size_t(s.n + s.offset);
      const std::vector<bfloat16> g16 = exact ? exact_sum_bf16_grads(rng, total) : bf16_grads(rng, total);
      // bf16_grads' ±1e4 would dwarf the rest (the bound is relative to the sum): set to 0 in the random case.
      std::vector<bfloat16> g = g16;
      if (!exact)
        for (bfloat16& x : g)
          if (std::fabs(bf16_to_float(x)) > 1.0f) x.bits = 0;
      const double want = cpu::sum_of_squares(g.data() + s.offset, s.n);
      Buf<bf16> d_g(g);
      Buf<double> d_out(std::vector<double>{std::nan("")});  // overwritten
      cuda::sum_of_squares(d_g.get() + s.offset, s.n, d_out.get(), env.ws, env.stream);
      const double got = d_out.read()[0];
      if (exact) {
        // Every order gives the exact sum (the block comment above): tolerance 0.
        EXPECT_TRUE(bitwise_equal("exact sum vs CPU twin", std::vector<double>{got}, std::vector<double>{want}));
      } else {
        // Two orders of n non-negative exact terms, each within (n − 1)·2^-53 of the exact sum, relative.
        EXPECT_NEAR(got, want, 2.0 * double(s.n) * std::ldexp(1.0, -53) * want);
      }
      EXPECT_GT(want, 0.0);
      // Determinism: the same call again, bit for bit (the geometry depends on n only).
      cuda::sum_of_squares(d_g.get() + s.offset, s.n, d_out.get(), env.ws, env.stream);
      EXPECT_TRUE(bitwise_equal("rerun", d_out.read(), std::vector<double>{got}));
      // The f32 kernel on the floats the bf16 gradients hold: the same squares, summed in the same order (the
      // same geometry; offsets 0 and 4 take packs on both, 1 and 2 the scalar loop on both): bit for bit.
      Buf<float> d_f(held_floats(g));
      cuda::sum_of_squares(d_f.get() + s.offset, s.n, d_out.get(), env.ws, env.stream);
      EXPECT_TRUE(bitwise_equal("f32 kernel on the held floats", d_out.read(), std::vector<double>{got}));
      if (HasFailure()) return;
    }
  // The empty sum is 0 (written, not left as it was).
  Buf<double> d_out(std::vector<double>{std::nan("")});
  Buf<bf16> d_g(size_t(1));
  cuda::sum_of_squares(d_g.get(), 0, d_out.get(), env.ws, env.stream);
  EXPECT_EQ(d_out.read()[0], 0.0);
}

// ---- elementwise ----------------------------------------------------------------------------------------

TYPED_TEST(CudaModelKernels, AddInto) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  std::mt19937_64 rng(seed);
  GpuEnv env;
  for (const AdamShape s : {AdamShape{1, 0}, AdamShape{3, 0}, AdamShape{37, 0}, AdamShape{1001, 0},
                            AdamShape{1001, 1}}) {
    SCOPED_TRACE(testing::Message() << "n " << s.n << " offset " << s.offset);
    const size_t total = size_t(s.n + s.offset);
    const std::vector<float> a = rounded<T>(normal(rng, total)), b = rounded<T>(normal(rng, total));
    Buf<T> d_a = to_device<T>(a), d_b = to_device<T>(b);
    cuda::add_into<T>(d_a.get() + s.offset, d_b.get() + s.offset, s.n, env.stream);
    // One f32 sum rounded once to T (round to nearest even on both sides): bit-exact.
    std::vector<float> want = a;
    for (size_t i = size_t(s.offset); i < total; ++i) want[i] = Repr<T>::round(a[i] + b[i]);
    EXPECT_TRUE(bitwise_equal("add_into", from_device(d_a), want));
  }
}

// ---- zero-size work -------------------------------------------------------------------------------------

TYPED_TEST(CudaModelKernels, ZeroSizeIsANoOp) {
  using T = TypeParam;
  DMOE_SKIP_WITHOUT_GPU();
  GpuEnv env;
  Buf<T> t(size_t(16));
  Buf<float> f(size_t(16));
  Buf<int32_t> i(std::vector<int32_t>(16, 0));
  Buf<double> d(std::vector<double>{std::nan("")});
  Buf<int64_t> c(std::vector<int64_t>{-1});
  cuda::embedding_forward<T>(i.get(), t.get(), t.get(), 0, 300, 8, env.stream);
  cuda::embedding_backward<T>(i.get(), t.get(), f.get(), 0, 300, 8, env.ws, env.stream);
  cuda::rmsnorm_forward<T>(t.get(), t.get(), t.get(), f.get(), 0, 8, 1e-5f, env.stream);
  cuda::rmsnorm_backward<T>(t.get(), t.get(), f.get(), t.get(), t.get(), f.get(), 0, 8, env.ws, env.stream);
  cuda::rope_forward<T>(t.get(), t.get(), 0, 4, 2, 8, 1e4, env.stream);
  cuda::rope_backward<T>(t.get(), t.get(), 0, 4, 2, 8, 1e4, env.stream);
  cuda::linear_forward<T, T>(t.get(), t.get(), t.get(), 0, 8, 8, env.cublas);
  cuda::linear_backward<T>(t.get(), t.get(), t.get(), t.get(), f.get(), 0, 8, 8, env.cublas);
  cuda::cross_entropy_backward<T>(f.get(), i.get(), f.get(), t.get(), 0, 300, kIgnore, 1.0, env.stream);
  cuda::adamw_step<T>(f.get(), f.get(), f.get(), f.get(), 0, adamw_params(1), 1.0, t.get(), env.stream);
  cuda::add_into<T>(t.get(), t.get(), 0, env.stream);
  cuda::scale_in_place(f.get(), 0, 2.0, env.stream);
  // The reductions still write their (empty) results: loss 0 over 0 rows.
  cuda::cross_entropy_forward(f.get(), i.get(), f.get(), d.get(), c.get(), 0, 300, kIgnore, env.ws, env.stream);
  EXPECT_EQ(d.read()[0], 0.0);
  EXPECT_EQ(c.read()[0], 0);
  EXPECT_EQ(cudaStreamSynchronize(env.stream), cudaSuccess);
}

}  // namespace
}  // namespace dmoe
