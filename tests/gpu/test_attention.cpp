// test_attention.cpp — causal grouped-query attention on the GPU against the CPU twin
// (cpu::attention_forward/backward, fp64): the own kernels (cuda/attention.cu, f32 and bf16) and cuDNN's
// fused attention (cuda/attention_cudnn.hpp, bf16).
//
// Inputs are N(0, 1) (q·k/sqrt(D) is then N(0, 1) too: softmax rows neither flat nor one-hot), fresh on every
// run; the seed is printed with any failure. For bf16 the inputs are rounded to bf16 on the host first, so the
// CPU sees exactly the values the GPU reads. Results are compared by ‖gpu − cpu‖₂ / ‖cpu‖₂ against the
// tolerance written beside each check; a failure also prints the largest absolute error and where it is.
//
// Every test skips without a GPU; the cuDNN tests also skip (with CudnnAttention::available's reason) when
// cuDNN cannot run. On the GPU machine:
//   build/tests/dmoe_gpu_tests --gtest_filter='*Attention*'
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "cpu/model_kernels.hpp"
#include "cuda/attention_cudnn.hpp"
#include "cuda/check.hpp"
#include "cuda/kernels.cuh"
#include "cuda/model_kernels.cuh"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

using cuda::bf16;

// ---- tolerances (‖gpu − cpu‖₂ / ‖cpu‖₂) ---------------------------------------------------------------

// Own kernels, f32: out and lse accumulate in f32 (dot products of length D, the online softmax's rescaling)
// where the CPU uses fp64; a few f32 ulps per term.
constexpr double kTolF32Forward = 2e-5;
// Own kernels, f32 gradients: dS = p·(dP − Di) cancels when dP ≈ Di, which magnifies the f32 rounding of
// both terms (and the GPU's Di = dout·out uses the f32-rounded out, where the CPU sums p·dP in fp64).
constexpr double kTolF32Backward = 1e-4;
// bf16 outputs (out, dq, dk, dv): both sides see the same bf16 inputs, but the GPU stores its results in
// bf16 (relative rounding 2⁻⁹ per element) and its backward takes Di from the bf16-rounded out; cuDNN also
// rounds p and dS to bf16 for its tensor-core products. The project's bf16 tolerance (gpu_test_util.hpp).
using test::kTolBf16;
// lse from bf16 inputs, own kernels: f32 throughout (not rounded to bf16), so as accurate as the f32 path.
constexpr double kTolLseOwn = 2e-5;
// lse from cuDNN: f32 statistics of f32-accumulated tensor-core scores (exact bf16 products), but its softmax
// runs in base 2 with the hardware's approximate exp2/log2; allow a little more than the own kernels.
constexpr double kTolLseCudnn = 1e-4;

// ---- environment and data -------------------------------------------------------------------------------

using test::fresh_seed;

struct Shape {
  int64_t batch, seq;
  int32_t heads, kv_heads;
  int64_t head_dim;
  int64_t n() const { return batch * seq; }
  int64_t q_count() const { return n() * heads * head_dim; }
  int64_t kv_count() const { return n() * kv_heads * head_dim; }
  int64_t lse_count() const { return batch * heads * seq; }
};

std::string describe(const Shape& s) {
  return "batch " + std::to_string(s.batch) + ", seq " + std::to_string(s.seq) + ", heads " +
         std::to_string(s.heads) + ", kv_heads " + std::to_string(s.kv_heads) + ", head_dim " +
         std::to_string(s.head_dim);
}

template <typename T>
float round_to(float x) {
  if constexpr (std::is_same_v<T, bf16>) return __bfloat162float(__float2bfloat16(x));
  return x;
}

// N(0, 1) values, rounded to T (so the CPU reference reads what the GPU reads).
template <typename T>
std::vector<float> random_values(std::mt19937_64& rng, int64_t count) {
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(count));
  for (float& x : v) x = round_to<T>(normal(rng));
  return v;
}

class RawDeviceBuffer {
 public:
  explicit RawDeviceBuffer(size_t bytes) { DMOE_CHECK_CUDA(cudaMalloc(&data_, std::max<size_t>(bytes, 16))); }
  ~RawDeviceBuffer() { cuda::free_quietly(data_); }
  RawDeviceBuffer(const RawDeviceBuffer&) = delete;
  RawDeviceBuffer& operator=(const RawDeviceBuffer&) = delete;
  RawDeviceBuffer(RawDeviceBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)) {}
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  void* data_ = nullptr;
};

template <typename T>
RawDeviceBuffer upload(const std::vector<float>& values) {
  std::vector<T> converted(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      converted[i] = __float2bfloat16(values[i]);
    else
      converted[i] = values[i];
  }
  RawDeviceBuffer buffer(converted.size() * sizeof(T));
  DMOE_CHECK_CUDA(cudaMemcpy(buffer.as<T>(), converted.data(), converted.size() * sizeof(T), cudaMemcpyHostToDevice));
  return buffer;
}

template <typename T>
std::vector<float> download(const RawDeviceBuffer& buffer, int64_t count) {
  std::vector<T> raw(static_cast<size_t>(count));
  DMOE_CHECK_CUDA(cudaMemcpy(raw.data(), buffer.as<T>(), raw.size() * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> out(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16>)
      out[i] = __bfloat162float(raw[i]);
    else
      out[i] = raw[i];
  }
  return out;
}

template <typename T>
std::vector<uint8_t> download_bytes(const RawDeviceBuffer& buffer, int64_t count) {
  std::vector<uint8_t> raw(size_t(count) * sizeof(T));
  DMOE_CHECK_CUDA(cudaMemcpy(raw.data(), buffer.as<T>(), raw.size(), cudaMemcpyDeviceToHost));
  return raw;
}

// ‖gpu − cpu‖₂ / max(‖cpu‖₂, floor) <= tolerance, with the largest absolute error and its index on failure.
// floor: for results that can be zero in exact arithmetic (dq and dk at seq = 1, where the softmax over one key
// has no gradient): 1 % of a typical result's norm (inputs N(0, 1): gradient elements O(1)), so that rounding
// noise around an exact zero is judged against that instead of against the zero.
void expect_close(const std::vector<float>& gpu, const std::vector<float>& cpu, double tolerance, const char* what,
                  double floor = 1e-30) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double diff2 = 0, ref2 = 0, max_abs = 0;
  size_t where = 0;
  bool finite = true;
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double d = double(gpu[i]) - double(cpu[i]);
    finite = finite && std::isfinite(gpu[i]);
    diff2 += d * d;
    ref2 += double(cpu[i]) * double(cpu[i]);
    if (std::abs(d) > max_abs) {
      max_abs = std::abs(d);
      where = i;
    }
  }
  const double rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), floor);
  EXPECT_TRUE(finite) << what << ": the GPU result holds a NaN or an infinity";
  EXPECT_LE(rel, tolerance) << what << ": relative L2 error " << rel << " (tolerance " << tolerance
                            << "); largest absolute error " << max_abs << " at " << where << " (gpu " << gpu[where]
                            << ", cpu " << cpu[where] << ")";
}

// The CPU reference of one shape.
struct Reference {
  std::vector<float> q, k, v, dout;  // inputs (rounded to the GPU's storage type)
  std::vector<float> out, lse, dq, dk, dv;
};

template <typename T>
Reference make_reference(const Shape& s, uint64_t seed, bool backward) {
  std::mt19937_64 rng(seed);
  Reference r;
  r.q = random_values<T>(rng, s.q_count());
  r.k = random_values<T>(rng, s.kv_count());
  r.v = random_values<T>(rng, s.kv_count());
  r.dout = random_values<T>(rng, s.q_count());
  r.out.resize(size_t(s.q_count()));
  r.lse.resize(size_t(s.lse_count()));
  cpu::attention_forward(r.q.data(), r.k.data(), r.v.data(), r.out.data(), r.lse.data(), s.batch, s.seq, s.heads,
                         s.kv_heads, s.head_dim);
  if (backward) {
    r.dq.resize(size_t(s.q_count()));
    r.dk.resize(size_t(s.kv_count()));
    r.dv.resize(size_t(s.kv_count()));
    cpu::attention_backward(r.q.data(), r.k.data(), r.v.data(), r.lse.data(), r.dout.data(), r.dq.data(),
                            r.dk.data(), r.dv.data(), s.batch, s.seq, s.heads, s.kv_heads, s.head_dim);
  }
  return r;
}

// Device tensors of one run: inputs uploaded, outputs allocated.
template <typename T>
struct DeviceRun {
  RawDeviceBuffer q, k, v, dout, out, lse, dq, dk, dv;
  DeviceRun(const Shape& s, const Reference& r)
      : q(upload<T>(r.q)),
        k(upload<T>(r.k)),
        v(upload<T>(r.v)),
        dout(upload<T>(r.dout)),
        out(size_t(s.q_count()) * sizeof(T)),
        lse(size_t(s.lse_count()) * sizeof(float)),
        dq(size_t(s.q_count()) * sizeof(T)),
        dk(size_t(s.kv_count()) * sizeof(T)),
        dv(size_t(s.kv_count()) * sizeof(T)) {}
};

class OwnedStream {
 public:
  OwnedStream() { DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~OwnedStream() {
    if (stream_) (void)cudaStreamDestroy(stream_);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t get() const { return stream_; }
  void sync() const { DMOE_CHECK_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

// ---- own kernels ---------------------------------------------------------------------------------------

template <typename T>
void run_own(const Shape& s, DeviceRun<T>& d, cuda::Workspace& ws, const OwnedStream& stream) {
  cuda::attention_forward<T>(d.q.template as<T>(), d.k.template as<T>(), d.v.template as<T>(), d.out.template as<T>(),
                             d.lse.template as<float>(), s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, ws,
                             stream.get());
  cuda::attention_backward<T>(d.q.template as<T>(), d.k.template as<T>(), d.v.template as<T>(),
                              d.out.template as<T>(), d.lse.template as<float>(), d.dout.template as<T>(),
                              d.dq.template as<T>(), d.dk.template as<T>(), d.dv.template as<T>(), s.batch, s.seq,
                              s.heads, s.kv_heads, s.head_dim, ws, stream.get());
  stream.sync();
}

// The brief's grid (batch 1-2; seq 1, 5, 64, 129: one key, less than a tile, one full tile, a tile and a row
// past two; heads 4 over 4, 2, 1 kv heads: MHA, GQA, MQA; head_dim 8, 64, 128) and the edges of head_dim
// (2, the smallest; 256, the largest, which runs the 8-threads-per-row configuration).
std::vector<Shape> own_shapes() {
  std::vector<Shape> shapes;
  for (int64_t batch : {1, 2})
    for (int64_t seq : {1, 5, 64, 129})
      for (int32_t kv_heads : {4, 2, 1})
        for (int64_t head_dim : {8, 64, 128}) shapes.push_back({batch, seq, 4, kv_heads, head_dim});
  shapes.push_back({1, 7, 2, 2, 2});
  shapes.push_back({2, 33, 4, 2, 256});
  shapes.push_back({1, 70, 2, 1, 256});
  return shapes;
}

template <typename T>
void own_kernels_match_cpu() {
  const bool is_bf16 = std::is_same_v<T, bf16>;
  const double tol_out = is_bf16 ? kTolBf16 : kTolF32Forward;
  const double tol_grad = is_bf16 ? kTolBf16 : kTolF32Backward;
  const double tol_lse = kTolLseOwn;
  OwnedStream stream;
  cuda::Workspace ws;
  for (const Shape& s : own_shapes()) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << describe(s) << ", seed " << seed);
    const Reference r = make_reference<T>(s, seed, /*backward=*/true);
    DeviceRun<T> d(s, r);
    run_own<T>(s, d, ws, stream);
    expect_close(download<T>(d.out, s.q_count()), r.out, tol_out, "out");
    expect_close(download<float>(d.lse, s.lse_count()), r.lse, tol_lse, "lse");
    expect_close(download<T>(d.dq, s.q_count()), r.dq, tol_grad, "dq", 1e-2 * std::sqrt(double(s.q_count())));
    expect_close(download<T>(d.dk, s.kv_count()), r.dk, tol_grad, "dk", 1e-2 * std::sqrt(double(s.kv_count())));
    expect_close(download<T>(d.dv, s.kv_count()), r.dv, tol_grad, "dv");
    if (::testing::Test::HasFailure()) return;  // one failing shape is enough to read
  }
}

TEST(CudaAttention, OwnKernelsF32MatchCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  own_kernels_match_cpu<float>();
}

TEST(CudaAttention, OwnKernelsBf16MatchCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  own_kernels_match_cpu<bf16>();
}

// The backward fed the CPU's lse and out (instead of its own forward's) gives the same gradients: the
// backward kernels depend on the forward only through lse and out, as documented.
TEST(CudaAttention, OwnBackwardF32FromCpuForward) {
  DMOE_SKIP_WITHOUT_GPU();
  const Shape s{2, 129, 4, 2, 64};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << describe(s) << ", seed " << seed);
  const Reference r = make_reference<float>(s, seed, true);
  DeviceRun<float> d(s, r);
  RawDeviceBuffer out = upload<float>(r.out), lse = upload<float>(r.lse);
  OwnedStream stream;
  cuda::Workspace ws;
  cuda::attention_backward<float>(d.q.as<float>(), d.k.as<float>(), d.v.as<float>(), out.as<float>(),
                                  lse.as<float>(), d.dout.as<float>(), d.dq.as<float>(), d.dk.as<float>(),
                                  d.dv.as<float>(), s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, ws,
                                  stream.get());
  stream.sync();
  expect_close(download<float>(d.dq, s.q_count()), r.dq, kTolF32Backward, "dq", 1e-2 * std::sqrt(double(s.q_count())));
  expect_close(download<float>(d.dk, s.kv_count()), r.dk, kTolF32Backward, "dk", 1e-2 * std::sqrt(double(s.kv_count())));
  expect_close(download<float>(d.dv, s.kv_count()), r.dv, kTolF32Backward, "dv");
}

// Two runs on the same inputs are bit-identical (fixed summation orders, no atomics), forward and backward,
// on a shape with several query and key tiles per sequence and four query heads per kv head.
template <typename T>
void own_kernels_deterministic() {
  const Shape s{2, 129, 4, 1, 64};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << describe(s) << ", seed " << seed);
  const Reference r = make_reference<T>(s, seed, /*backward=*/false);
  OwnedStream stream;
  cuda::Workspace ws;
  DeviceRun<T> first(s, r), second(s, r);
  run_own<T>(s, first, ws, stream);
  run_own<T>(s, second, ws, stream);
  EXPECT_EQ(download_bytes<T>(first.out, s.q_count()), download_bytes<T>(second.out, s.q_count())) << "out";
  EXPECT_EQ(download_bytes<float>(first.lse, s.lse_count()), download_bytes<float>(second.lse, s.lse_count()))
      << "lse";
  EXPECT_EQ(download_bytes<T>(first.dq, s.q_count()), download_bytes<T>(second.dq, s.q_count())) << "dq";
  EXPECT_EQ(download_bytes<T>(first.dk, s.kv_count()), download_bytes<T>(second.dk, s.kv_count())) << "dk";
  EXPECT_EQ(download_bytes<T>(first.dv, s.kv_count()), download_bytes<T>(second.dv, s.kv_count())) << "dv";
}

TEST(CudaAttention, OwnKernelsF32Deterministic) {
  DMOE_SKIP_WITHOUT_GPU();
  own_kernels_deterministic<float>();
}

TEST(CudaAttention, OwnKernelsBf16Deterministic) {
  DMOE_SKIP_WITHOUT_GPU();
  own_kernels_deterministic<bf16>();
}

TEST(CudaAttention, OwnKernelsRejectBadSizes) {
  DMOE_SKIP_WITHOUT_GPU();
  cuda::Workspace ws;
  // Odd head_dim, head_dim past 256, heads not a multiple of kv_heads: refused before any launch.
  EXPECT_THROW(cuda::attention_forward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 4, 4, 4, 7, ws, nullptr),
               Error);
  EXPECT_THROW(cuda::attention_forward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 4, 4, 4, 258, ws,
                                              nullptr),
               Error);
  EXPECT_THROW(cuda::attention_forward<float>(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 4, 4, 3, 8, ws, nullptr),
               Error);
}

// ---- cuDNN ---------------------------------------------------------------------------------------------

#define DMOE_SKIP_WITHOUT_CUDNN()                                                      \
  do {                                                                                 \
    DMOE_SKIP_WITHOUT_GPU();                                                           \
    std::string why;                                                                   \
    if (!cuda::CudnnAttention::available(&why)) GTEST_SKIP() << "cuDNN attention: " << why; \
  } while (0)

// The stub (a build without cudnn-frontend) and a machine without cuDNN say why; never an empty reason.
TEST(CudnnAttention, AvailableGivesAReason) {
  std::string why;
  const bool ok = cuda::CudnnAttention::available(&why);
  if (ok)
    EXPECT_TRUE(why.empty()) << why;
  else
    EXPECT_FALSE(why.empty());
  std::cout << "[ INFO     ] CudnnAttention::available: " << (ok ? "yes" : "no: " + why) << "\n";
}

void run_cudnn(cuda::CudnnAttention& attention, const Shape& s, DeviceRun<bf16>& d, const OwnedStream& stream) {
  attention.forward(d.q.as<bf16>(), d.k.as<bf16>(), d.v.as<bf16>(), d.out.as<bf16>(), d.lse.as<float>(), s.batch,
                    s.seq, s.heads, s.kv_heads, s.head_dim, stream.get());
  attention.backward(d.q.as<bf16>(), d.k.as<bf16>(), d.v.as<bf16>(), d.out.as<bf16>(), d.lse.as<float>(),
                     d.dout.as<bf16>(), d.dq.as<bf16>(), d.dk.as<bf16>(), d.dv.as<bf16>(), s.batch, s.seq, s.heads,
                     s.kv_heads, s.head_dim, stream.get());
  stream.sync();
}

// bf16 forward (out, and lse: cuDNN's Stats must be the natural-log logsumexp of the scaled scores) and
// backward against the CPU; seq 128 and 1024, head_dim 64 and 128, MHA, GQA and MQA.
TEST(CudnnAttention, MatchesCpu) {
  DMOE_SKIP_WITHOUT_CUDNN();
  const std::vector<Shape> shapes = {
      {2, 128, 4, 2, 64}, {2, 128, 8, 1, 128}, {1, 128, 4, 4, 128}, {1, 1024, 4, 4, 64}, {1, 1024, 8, 2, 128}};
  cuda::CudnnAttention attention;
  OwnedStream stream;
  for (const Shape& s : shapes) {
    const uint64_t seed = fresh_seed();
    SCOPED_TRACE(::testing::Message() << describe(s) << ", seed " << seed);
    const Reference r = make_reference<bf16>(s, seed, /*backward=*/true);
    DeviceRun<bf16> d(s, r);
    run_cudnn(attention, s, d, stream);
    expect_close(download<bf16>(d.out, s.q_count()), r.out, kTolBf16, "out");
    expect_close(download<float>(d.lse, s.lse_count()), r.lse, kTolLseCudnn, "lse");
    expect_close(download<bf16>(d.dq, s.q_count()), r.dq, kTolBf16, "dq", 1e-2 * std::sqrt(double(s.q_count())));
    expect_close(download<bf16>(d.dk, s.kv_count()), r.dk, kTolBf16, "dk", 1e-2 * std::sqrt(double(s.kv_count())));
    expect_close(download<bf16>(d.dv, s.kv_count()), r.dv, kTolBf16, "dv");
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_EQ(attention.graphs_built(), 2 * shapes.size()) << "one forward and one backward graph per shape";
}

// A shape run again reuses its graphs, and cuDNN's deterministic backward is bit-identical run to run.
TEST(CudnnAttention, CachedAndDeterministic) {
  DMOE_SKIP_WITHOUT_CUDNN();
  const Shape s{2, 256, 8, 2, 128};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << describe(s) << ", seed " << seed);
  const Reference r = make_reference<bf16>(s, seed, /*backward=*/false);
  cuda::CudnnAttention attention;
  OwnedStream stream;
  DeviceRun<bf16> first(s, r), second(s, r);
  run_cudnn(attention, s, first, stream);
  run_cudnn(attention, s, second, stream);
  EXPECT_EQ(attention.graphs_built(), 2u);
  EXPECT_EQ(download_bytes<bf16>(first.out, s.q_count()), download_bytes<bf16>(second.out, s.q_count())) << "out";
  EXPECT_EQ(download_bytes<float>(first.lse, s.lse_count()), download_bytes<float>(second.lse, s.lse_count()))
      << "lse";
  EXPECT_EQ(download_bytes<bf16>(first.dq, s.q_count()), download_bytes<bf16>(second.dq, s.q_count())) << "dq";
  EXPECT_EQ(download_bytes<bf16>(first.dk, s.kv_count()), download_bytes<bf16>(second.dk, s.kv_count())) << "dk";
  EXPECT_EQ(download_bytes<bf16>(first.dv, s.kv_count()), download_bytes<bf16>(second.dv, s.kv_count())) << "dv";
}

// The own bf16 kernels and cuDNN agree with each other (out, lse) on a long sequence: either forward's lse
// can feed either backward.
TEST(CudnnAttention, AgreesWithOwnKernels) {
  DMOE_SKIP_WITHOUT_CUDNN();
  const Shape s{1, 1024, 8, 2, 128};
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE(::testing::Message() << describe(s) << ", seed " << seed);
  const Reference r = make_reference<bf16>(s, seed, /*backward=*/false);
  cuda::CudnnAttention attention;
  OwnedStream stream;
  cuda::Workspace ws;
  DeviceRun<bf16> own(s, r), fused(s, r);
  run_own<bf16>(s, own, ws, stream);
  run_cudnn(attention, s, fused, stream);
  expect_close(download<bf16>(fused.out, s.q_count()), download<bf16>(own.out, s.q_count()), kTolBf16, "out");
  expect_close(download<float>(fused.lse, s.lse_count()), download<float>(own.lse, s.lse_count()), kTolLseCudnn,
               "lse");
}

// A shape cuDNN cannot take (head_dim not a multiple of 8) is refused with a dmoe error naming it.
TEST(CudnnAttention, RejectsUnalignedHeadDim) {
  DMOE_SKIP_WITHOUT_CUDNN();
  cuda::CudnnAttention attention;
  try {
    attention.forward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 4, 4, 12, nullptr);
    ADD_FAILURE() << "head_dim 12 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 12"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dmoe
