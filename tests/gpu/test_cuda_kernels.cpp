// test_cuda_kernels.cpp — every CUDA stage (through CudaBackend) against its CPU twin (src/cpu/).
//
// Data movement (gather_rows, permute_segments, plan_send) must match bit for bit, on payloads whose
// bits encode (row, column). Math is compared with ‖gpu − cpu‖₂ / ‖cpu‖₂ against a tolerance written
// at each check; a failure prints the max abs/rel error and the first mismatch. Inputs are fresh random
// values on every run; the seed is printed with any failure (SCOPED_TRACE).
//
// Every test skips with "no CUDA device" on a machine without a GPU. Run on the GPU machine:
//   build-cuda/tests/dmoe_gpu_tests --gtest_filter='CudaKernels*'
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/config.hpp"
#include "core/dispatch_plan.hpp"
#include "core/dtype.hpp"
#include "core/error.hpp"
#include "core/random.hpp"
#include "core/routing_block.hpp"
#include "cpu/kernels.hpp"
#include "cuda/cuda_backend.hpp"
#include "engine/backend.hpp"
#include "gpu_test_util.hpp"

namespace dmoe {
namespace {

// ---- tolerances (‖gpu − cpu‖ / ‖cpu‖) ---------------------------------------------------------------

// Outputs in f32 computed from the same inputs: fp32 accumulation on the GPU vs fp64 on the CPU.
constexpr double kTolF32 = 1e-5;
using test::kTolBf16;  // outputs stored as bf16 (gpu_test_util.hpp)
// fp64 sums of the same f32 values in another order.
constexpr double kTolF64Sum = 1e-12;

double storage_tolerance(DType storage) { return storage == DType::bf16 ? kTolBf16 : kTolF32; }

// ---- environment ---------------------------------------------------------------------------------------

using test::has_cuda_device;

using test::fresh_seed;

#define DMOE_SEED_TRACE(seed) SCOPED_TRACE(::testing::Message() << "seed " << (seed))

// ---- device buffers ------------------------------------------------------------------------------------

class DeviceBuffer {
 public:
  DeviceBuffer(Backend& backend, size_t bytes)
      : backend_(&backend), data_(backend.allocate(std::max<size_t>(bytes, 16))) {}
  ~DeviceBuffer() { backend_->release(data_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : backend_(o.backend_), data_(std::exchange(o.data_, nullptr)) {}

  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }

 private:
  Backend* backend_;
  void* data_;
};

size_t storage_bytes(const Backend& backend, int64_t count) {
  return size_t(count) * dtype_size(backend.storage_dtype());
}

// A storage buffer holding `values` (rounded to bf16 on a bf16 backend).
DeviceBuffer storage_from(Backend& backend, const std::vector<float>& values) {
  DeviceBuffer buffer(backend, storage_bytes(backend, int64_t(values.size())));
  backend.upload_f32(buffer.get(), values.data(), int64_t(values.size()));
  return buffer;
}

std::vector<float> storage_to_host(Backend& backend, const DeviceBuffer& buffer, int64_t count) {
  std::vector<float> out(count);
  backend.download_f32(out.data(), buffer.get(), count);
  return out;
}

template <typename T>
DeviceBuffer raw_from(Backend& backend, const std::vector<T>& values) {
  DeviceBuffer buffer(backend, values.size() * sizeof(T));
  backend.upload(buffer.get(), values.data(), values.size() * sizeof(T));
  return buffer;
}

template <typename T>
std::vector<T> raw_to_host(Backend& backend, const DeviceBuffer& buffer, int64_t count) {
  std::vector<T> out(count);
  backend.download(out.data(), buffer.get(), out.size() * sizeof(T));
  return out;
}

// The values a storage buffer holds after upload_f32.
std::vector<float> rounded(std::vector<float> values, DType storage) {
  if (storage == DType::bf16)
    for (float& v : values) v = round_to_bf16(v);
  return values;
}

// ---- comparisons ---------------------------------------------------------------------------------------

// DMOE_TEST_VERBOSE=1 prints every relative error, to see the margin below each tolerance.
bool verbose() {
  static const bool on = std::getenv("DMOE_TEST_VERBOSE") != nullptr;
  return on;
}

// ‖got − want‖₂ / ‖want‖₂ <= tol; the message gives max abs/rel error and the first element off by more
// than tol · max(|want|, rms(want)).
template <typename Got, typename Want>
testing::AssertionResult close_rel(const std::string& what, const std::vector<Got>& got,
                                   const std::vector<Want>& want, double tol) {
  if (got.size() != want.size())
    return testing::AssertionFailure()
           << what << ": sizes differ (gpu " << got.size() << ", cpu " << want.size() << ")";
  if (want.empty()) return testing::AssertionSuccess();
  double diff2 = 0, ref2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(got[i]) - double(want[i]);
    diff2 += d * d;
    ref2 += double(want[i]) * double(want[i]);
  }
  const double rms = std::sqrt(ref2 / double(want.size()));
  const double rel_norm = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  if (verbose()) std::cout << "[ rel err  ] " << what << ": " << rel_norm << " (tol " << tol << ")\n";
  if (rel_norm <= tol) return testing::AssertionSuccess();

  double max_abs = -1, max_rel = 0;
  size_t worst = 0;
  int64_t first_bad = -1;
  for (size_t i = 0; i < got.size(); ++i) {
    const double w = double(want[i]);
    const double abs_err = std::fabs(double(got[i]) - w);
    if (!(abs_err <= max_abs)) {  // also catches NaN
      max_abs = abs_err;
      worst = i;
    }
    if (std::fabs(w) > 1e-3 * rms) max_rel = std::max(max_rel, abs_err / std::fabs(w));
    if (first_bad < 0 && !(abs_err <= tol * std::max(std::fabs(w), rms))) first_bad = int64_t(i);
  }
  auto failure = testing::AssertionFailure();
  failure << what << ": ||gpu-cpu||/||cpu|| = " << rel_norm << " > tol " << tol << " (" << got.size()
          << " elements, rms(cpu) " << rms << "); max abs err " << max_abs << " at " << worst << " (gpu "
          << double(got[worst]) << ", cpu " << double(want[worst]) << "); max rel err " << max_rel;
  if (first_bad >= 0)
    failure << "; first mismatch at " << first_bad << " (gpu " << double(got[first_bad]) << ", cpu "
            << double(want[first_bad]) << ")";
  return failure;
}

// Bit-for-bit equality; the message lists the first mismatches.
template <typename T>
testing::AssertionResult equal_exact(const std::string& what, const std::vector<T>& got,
                                     const std::vector<T>& want) {
  if (got.size() != want.size())
    return testing::AssertionFailure()
           << what << ": sizes differ (gpu " << got.size() << ", cpu " << want.size() << ")";
  int64_t mismatches = 0;
  std::ostringstream first;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) == 0) continue;
    if (mismatches < 5) first << " [" << i << "] gpu " << +got[i] << " cpu " << +want[i] << ";";
    ++mismatches;
  }
  if (mismatches == 0) return testing::AssertionSuccess();
  return testing::AssertionFailure() << what << ": " << mismatches << " of " << got.size()
                                     << " elements differ; first:" << first.str();
}

// ---- random inputs ---------------------------------------------------------------------------------------

// k distinct experts per token, drawn from [0, used_experts).
std::vector<int32_t> random_ids(Rng& rng, int64_t tokens, int32_t top_k, int32_t used_experts) {
  std::vector<int32_t> ids(tokens * top_k), pool(used_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int32_t j = 0; j < top_k; ++j) {
      const int32_t pick = j + int32_t(rng.next() % uint64_t(used_experts - j));
      std::swap(pool[j], pool[pick]);
      ids[t * top_k + j] = pool[j];
    }
  }
  return ids;
}

// Routing as the router makes it (CPU twin on random logits): probs [T,E], ids/weights [T,k], lse [T].
struct Routing {
  std::vector<float> logits, probs, weights, lse;
  std::vector<int32_t> ids;
};

Routing random_routing(Rng& rng, int64_t tokens, int32_t experts, int32_t top_k, bool renormalize) {
  Routing r;
  r.logits = rng.normal_vector(size_t(tokens) * experts, 2.0);
  r.probs.resize(r.logits.size());
  r.ids.resize(size_t(tokens) * top_k);
  r.weights.resize(r.ids.size());
  r.lse.resize(tokens);
  cpu::router_topk(r.logits.data(), r.probs.data(), r.ids.data(), r.weights.data(), r.lse.data(), tokens,
                   experts, top_k, renormalize);
  return r;
}

// Raw payloads for the movement tests: the storage bits of element (row, col) encode the pair, as
// 1 + row·H + col (f32, exact below 2^24) or 1 + (row·H + col) mod 0x7f00 (bf16: finite, never NaN).
template <typename U>
U payload(int64_t row, int64_t col, int64_t hidden) {
  const int64_t code = row * hidden + col;
  if constexpr (sizeof(U) == 4)
    return U(1 + code);
  else
    return U(1 + code % 0x7f00);
}

template <typename U>
float raw_to_f32(U bits) {
  if constexpr (sizeof(U) == 4)
    return bits_float(bits);
  else
    return bf16_to_float(bfloat16{bits});
}

template <typename U>
U f32_to_raw(float value) {
  if constexpr (sizeof(U) == 4)
    return float_bits(value);
  else
    return float_to_bf16(value).bits;
}

template <typename U>
std::vector<float> raw_to_f32(const std::vector<U>& raw) {
  std::vector<float> out(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) out[i] = raw_to_f32(raw[i]);
  return out;
}

template <typename U>
std::vector<U> f32_to_raw(const std::vector<float>& values) {
  std::vector<U> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = f32_to_raw<U>(values[i]);
  return out;
}

std::string dtype_label(DType d) { return dtype_name(d); }

// =========================================================================================================
// Basics
// =========================================================================================================

class CudaKernelsBasics : public testing::TestWithParam<DType> {};

TEST_P(CudaKernelsBasics, UploadDownloadRoundsLikeTheCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(GetParam());
  std::vector<float> values = rng.normal_vector(1001, 3.0);
  values.insert(values.end(), {0.f, -0.f, 1e-40f, -3.3e38f, 1.00390625f, 1.01171875f});
  DeviceBuffer buffer = storage_from(*backend, values);
  // Exact: bf16 storage holds round-to-nearest-even values, bit for bit what the CPU backend computes.
  EXPECT_TRUE(equal_exact("round trip", storage_to_host(*backend, buffer, int64_t(values.size())),
                          rounded(values, GetParam())));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaKernelsBasics, testing::Values(DType::f32, DType::bf16),
                         [](const testing::TestParamInfo<DType>& param_info) {
                           return dtype_label(param_info.param);
                         });

// =========================================================================================================
// Data movement: gather_rows, permute_segments (exact)
// =========================================================================================================

class CudaKernelsMovement : public testing::TestWithParam<std::tuple<DType, int64_t>> {};

template <typename U>
void check_gather_rows(Backend& backend, Rng& rng, int64_t tokens, int64_t hidden, int64_t n) {
  std::vector<U> x(size_t(tokens * hidden));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t c = 0; c < hidden; ++c) x[t * hidden + c] = payload<U>(t, c, hidden);
  std::vector<int32_t> rows(n);
  for (auto& r : rows) r = int32_t(rng.next() % uint64_t(tokens));

  DeviceBuffer d_x = raw_from(backend, x);
  DeviceBuffer d_rows = raw_from(backend, rows);
  DeviceBuffer d_out(backend, size_t(n * hidden) * sizeof(U));
  backend.gather_rows(d_x.get(), d_rows.as<int32_t>(), d_out.get(), n, hidden);
  const std::vector<U> got = raw_to_host<U>(backend, d_out, n * hidden);

  const std::vector<float> x_f = raw_to_f32(x);
  std::vector<float> out_f(size_t(n * hidden));
  cpu::gather_rows(x_f.data(), rows.data(), out_f.data(), n, hidden);
  EXPECT_TRUE(equal_exact("gather_rows", got, f32_to_raw<U>(out_f)));
}

TEST_P(CudaKernelsMovement, GatherRowsExact) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, hidden] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  // 300 tokens: the bf16 payload stays unique (300·72 < 0x7f00).
  if (storage == DType::f32)
    check_gather_rows<uint32_t>(*backend, rng, 300, hidden, 517);
  else
    check_gather_rows<uint16_t>(*backend, rng, 300, hidden, 517);
}

template <typename U>
void check_permute_segments(Backend& backend, Rng& rng, int32_t world, int32_t local_experts,
                            int64_t hidden) {
  // Rows from each source rank for each local expert; about a quarter of the segments are empty.
  std::vector<int64_t> counts(size_t(world) * local_experts);
  for (auto& c : counts) c = (rng.next() % 4 == 0) ? 0 : int64_t(rng.next() % 12);
  counts[0] = 0;
  const ExpertBatchLayout layout = build_expert_batch_layout(counts.data(), world, local_experts);
  const int64_t rows = layout.rows();
  const int64_t segments = int64_t(counts.size());

  std::vector<U> recv(size_t(rows * hidden)), sentinel(size_t(rows * hidden));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < hidden; ++c) {
      recv[r * hidden + c] = payload<U>(r, c, hidden);
      sentinel[r * hidden + c] = payload<U>(r + 5000, c, hidden);
    }

  // Both directions: receive buffer → expert batch, then back.
  for (int direction = 0; direction < 2; ++direction) {
    const std::vector<int64_t>& src_off = direction == 0 ? layout.recv_offsets : layout.batch_offsets;
    const std::vector<int64_t>& dst_off = direction == 0 ? layout.batch_offsets : layout.recv_offsets;
    DeviceBuffer d_src = raw_from(backend, recv);
    DeviceBuffer d_dst = raw_from(backend, sentinel);
    backend.permute_segments(d_src.get(), d_dst.get(), src_off.data(), dst_off.data(), counts.data(),
                             segments, hidden);
    const std::vector<U> got = raw_to_host<U>(backend, d_dst, rows * hidden);

    const std::vector<float> src_f = raw_to_f32(recv);
    std::vector<float> dst_f = raw_to_f32(sentinel);
    cpu::permute_segments(src_f.data(), dst_f.data(), src_off.data(), dst_off.data(), counts.data(), segments,
                          hidden);
    EXPECT_TRUE(equal_exact(direction == 0 ? "permute_segments recv->batch" : "permute_segments batch->recv",
                            got, f32_to_raw<U>(dst_f)))
        << "world " << world << ", local experts " << local_experts << ", rows " << rows;
  }
}

TEST_P(CudaKernelsMovement, PermuteSegmentsExact) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, hidden] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  // 15 segments, and 320 (more than one launch's table of 256).
  for (auto [world, local_experts] : {std::pair{3, 5}, std::pair{8, 40}}) {
    if (storage == DType::f32)
      check_permute_segments<uint32_t>(*backend, rng, world, local_experts, hidden);
    else
      check_permute_segments<uint16_t>(*backend, rng, world, local_experts, hidden);
  }
}

// H = 72: 16-byte copies and packed combine; 36: 8-byte bf16 rows; 7: element-wise fallbacks; 1032: rows
// long enough for the 4-deep copy loop and several column steps per lane.
INSTANTIATE_TEST_SUITE_P(Shapes, CudaKernelsMovement,
                         testing::Combine(testing::Values(DType::f32, DType::bf16),
                                          testing::Values(int64_t{72}, int64_t{36}, int64_t{7},
                                                          int64_t{1032})),
                         [](const testing::TestParamInfo<std::tuple<DType, int64_t>>& param_info) {
                           return dtype_label(std::get<0>(param_info.param)) + "_H" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// =========================================================================================================
// Send plan (exact against core build_send_plan)
// =========================================================================================================

struct PlanCase {
  int64_t tokens;
  int32_t experts;
  int32_t top_k;
  int32_t used_experts;    // ids are drawn from [0, used): experts beyond get no rows
  double capacity_factor;  // 0: dropless
  DropPolicy policy;
};

std::string plan_case_name(const PlanCase& c) {
  std::ostringstream s;
  s << "T" << c.tokens << "_E" << c.experts << "_k" << c.top_k << "_used" << c.used_experts << "_cf"
    << int(c.capacity_factor * 100) << "_" << drop_policy_name(c.policy);
  std::string name = s.str();
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';  // gtest names: letters, digits, '_'
  return name;
}

class CudaKernelsPlan : public testing::TestWithParam<PlanCase> {};

TEST_P(CudaKernelsPlan, PlanSendMatchesCore) {
  DMOE_SKIP_WITHOUT_GPU();
  const PlanCase c = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(DType::f32);

  const int64_t assignments = c.tokens * c.top_k;
  const std::vector<int32_t> ids = random_ids(rng, c.tokens, c.top_k, c.used_experts);
  std::vector<float> weights(assignments);
  for (auto& w : weights) w = float(1 + rng.next() % 4) / 4.f;  // few levels: ties for lowest_weight
  const int64_t capacity =
      c.capacity_factor == 0 ? -1 : int64_t(std::ceil(c.capacity_factor * double(assignments) / c.experts));

  DeviceBuffer d_ids = raw_from(*backend, ids);
  DeviceBuffer d_weights = raw_from(*backend, weights);
  const std::vector<int32_t> unset(assignments, -7);
  DeviceBuffer d_slot = raw_from(*backend, unset);
  DeviceBuffer d_row_token = raw_from(*backend, unset);
  DeviceBuffer d_row_choice = raw_from(*backend, unset);
  SendPlanBuffers buffers;
  buffers.slot = d_slot.as<int32_t>();
  buffers.row_token = d_row_token.as<int32_t>();
  buffers.row_choice = d_row_choice.as<int32_t>();
  std::vector<int64_t> routed(c.experts, -1), counts(c.experts, -1);
  backend->plan_send(d_ids.as<int32_t>(), d_weights.as<float>(), c.tokens, c.top_k, c.experts, capacity,
                     c.policy, buffers, routed.data(), counts.data());

  const SendPlan want =
      build_send_plan(ids.data(), weights.data(), c.tokens, c.top_k, c.experts, capacity, c.policy);
  const int64_t rows = want.rows();
  EXPECT_TRUE(equal_exact("routed", routed, want.routed));
  EXPECT_TRUE(equal_exact("counts", counts, want.counts));
  EXPECT_TRUE(equal_exact("slot", raw_to_host<int32_t>(*backend, d_slot, assignments), want.slot));
  EXPECT_TRUE(equal_exact("row_token", raw_to_host<int32_t>(*backend, d_row_token, rows), want.row_token));
  EXPECT_TRUE(equal_exact("row_choice", raw_to_host<int32_t>(*backend, d_row_choice, rows), want.row_choice));
  if (c.capacity_factor > 0) {
    EXPECT_GT(want.dropped(), 0) << "the case should drop rows";
  }
}

// The plan with its counts left on the device (the deferred train forward's) equals its CPU twin bit for bit:
// slot, rows and the whole PlanCountsBlock (routed, kept, offsets, bad word).
TEST_P(CudaKernelsPlan, PlanSendOnDeviceMatchesCpuTwin) {
  DMOE_SKIP_WITHOUT_GPU();
  const PlanCase c = GetParam();
  if (c.policy != DropPolicy::latest_tokens) GTEST_SKIP() << "the device plan is latest-tokens only";
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(DType::f32);
  const int64_t assignments = c.tokens * c.top_k;
  const std::vector<int32_t> ids = random_ids(rng, c.tokens, c.top_k, c.used_experts);
  const int64_t capacity =
      c.capacity_factor == 0 ? -1 : int64_t(std::ceil(c.capacity_factor * double(assignments) / c.experts));
  DeviceBuffer d_ids = raw_from(*backend, ids);
  const std::vector<int32_t> unset(assignments, -7);
  DeviceBuffer d_slot = raw_from(*backend, unset), d_row_token = raw_from(*backend, unset),
               d_row_choice = raw_from(*backend, unset);
  DeviceBuffer d_block(*backend, PlanCountsBlock::bytes(c.experts));
  SendPlanBuffers buffers{d_slot.as<int32_t>(), d_row_token.as<int32_t>(), d_row_choice.as<int32_t>()};
  backend->plan_send_on_device(d_ids.as<int32_t>(), c.tokens, c.top_k, c.experts, capacity, buffers,
                               d_block.as<int64_t>());
  std::vector<int32_t> slot(assignments), row_token(unset), row_choice(unset);
  std::vector<int64_t> block(PlanCountsBlock::words(c.experts));
  cpu::plan_send_on_device(ids.data(), c.tokens, c.top_k, c.experts, capacity, slot.data(), row_token.data(),
                           row_choice.data(), block.data());
  const int64_t rows = block[3 * size_t(c.experts)];
  std::vector<int64_t> got_block = raw_to_host<int64_t>(*backend, d_block, int64_t(block.size()));
  EXPECT_EQ(PlanCountsBlock::read_bad(got_block.data(), c.experts), kNoBadAssignment);
  got_block.back() = block.back() = 0;  // the bad word's upper 4 bytes are not part of the layout
  EXPECT_TRUE(equal_exact("counts block", got_block, block));
  EXPECT_TRUE(equal_exact("slot", raw_to_host<int32_t>(*backend, d_slot, assignments), slot));
  const auto first = [rows](std::vector<int32_t> v) { return std::vector<int32_t>(v.begin(), v.begin() + rows); };
  EXPECT_TRUE(equal_exact("row_token", raw_to_host<int32_t>(*backend, d_row_token, rows), first(row_token)));
  EXPECT_TRUE(equal_exact("row_choice", raw_to_host<int32_t>(*backend, d_row_choice, rows), first(row_choice)));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CudaKernelsPlan,
    testing::Values(PlanCase{1000, 5, 2, 4, 0, DropPolicy::latest_tokens},    // expert 4 gets 0 rows
                    PlanCase{1000, 5, 2, 4, 0.6, DropPolicy::latest_tokens},  // capacity 240 < ~500 routed
                    PlanCase{1000, 5, 2, 4, 0.6, DropPolicy::lowest_weight},
                    PlanCase{4097, 64, 8, 64, 0, DropPolicy::latest_tokens},  // 129 tiles: scan in chunks
                    PlanCase{4097, 64, 8, 64, 0.9, DropPolicy::latest_tokens},
                    PlanCase{4097, 64, 8, 64, 0.9, DropPolicy::lowest_weight},
                    PlanCase{2000, 1500, 4, 1500, 0,
                             DropPolicy::latest_tokens},  // E > 1024: offsets in chunks
                    PlanCase{777, 16, 1, 16, 0.5, DropPolicy::latest_tokens},
                    PlanCase{65536, 256, 8, 256, 0, DropPolicy::latest_tokens},  // 2048 tiles
                    PlanCase{65536, 256, 8, 256, 1.0, DropPolicy::latest_tokens},
                    PlanCase{3, 3, 3, 3, 0, DropPolicy::latest_tokens},   // k = E
                    PlanCase{0, 4, 2, 4, 0, DropPolicy::latest_tokens}),  // no tokens
    [](const testing::TestParamInfo<PlanCase>& param_info) { return plan_case_name(param_info.param); });

TEST(CudaKernelsPlanErrors, RejectsExpertIdOutOfRange) {
  DMOE_SKIP_WITHOUT_GPU();
  auto backend = make_cuda_backend(DType::f32);
  Rng rng(7);
  const int64_t tokens = 40;
  const int32_t top_k = 2, experts = 6;
  std::vector<int32_t> ids = random_ids(rng, tokens, top_k, experts);
  ids[5 * top_k + 1] = experts;  // token 5, choice 1
  const std::vector<float> weights(ids.size(), 0.5f);
  DeviceBuffer d_ids = raw_from(*backend, ids);
  DeviceBuffer d_weights = raw_from(*backend, weights);
  DeviceBuffer d_slot(*backend, ids.size() * 4), d_token(*backend, ids.size() * 4),
      d_choice(*backend, ids.size() * 4);
  SendPlanBuffers buffers{d_slot.as<int32_t>(), d_token.as<int32_t>(), d_choice.as<int32_t>()};
  std::vector<int64_t> routed(experts), counts(experts);
  try {
    backend->plan_send(d_ids.as<int32_t>(), d_weights.as<float>(), tokens, top_k, experts, -1,
                       DropPolicy::latest_tokens, buffers, routed.data(), counts.data());
    ADD_FAILURE() << "plan_send accepted expert id " << experts;
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("token 5 choice 1 has expert id 6"), std::string::npos) << message;
  }
  // The backend stays usable (no device fault).
  ids = random_ids(rng, tokens, top_k, experts);
  backend->upload(d_ids.get(), ids.data(), ids.size() * sizeof(int32_t));
  EXPECT_NO_THROW(backend->plan_send(d_ids.as<int32_t>(), d_weights.as<float>(), tokens, top_k, experts, -1,
                                     DropPolicy::latest_tokens, buffers, routed.data(), counts.data()));
}

// =========================================================================================================
// Router: forward, auxiliary statistics, backward
// =========================================================================================================

struct RouterShape {
  int64_t tokens;
  int64_t hidden;
  int32_t experts;
  int32_t top_k;
};

class CudaKernelsRouter : public testing::TestWithParam<std::tuple<DType, RouterShape, bool>> {};

std::string router_name(const testing::TestParamInfo<std::tuple<DType, RouterShape, bool>>& info) {
  const auto& [storage, s, renormalize] = info.param;
  std::ostringstream o;
  o << dtype_label(storage) << "_T" << s.tokens << "_H" << s.hidden << "_E" << s.experts << "_k" << s.top_k
    << (renormalize ? "_renorm" : "_raw");
  return o.str();
}

TEST_P(CudaKernelsRouter, ForwardMatchesCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, s, renormalize] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  const int64_t T = s.tokens, H = s.hidden;
  const int32_t E = s.experts, k = s.top_k;

  const std::vector<float> x = rounded(rng.normal_vector(size_t(T * H), 1.0), storage);
  const std::vector<float> wg =
      rounded(rng.normal_vector(size_t(E * H), 1.0 / std::sqrt(double(H))), storage);
  DeviceBuffer d_x = storage_from(*backend, x), d_wg = storage_from(*backend, wg);
  DeviceBuffer d_logits(*backend, size_t(T * E) * 4), d_probs(*backend, size_t(T * E) * 4);
  DeviceBuffer d_ids(*backend, size_t(T * k) * 4), d_weights(*backend, size_t(T * k) * 4),
      d_lse(*backend, size_t(T) * 4);
  backend->router_forward(d_x.get(), d_wg.get(), d_logits.as<float>(), d_probs.as<float>(),
                          d_ids.as<int32_t>(), d_weights.as<float>(), d_lse.as<float>(), T, H, E, k,
                          renormalize);
  const auto logits = raw_to_host<float>(*backend, d_logits, T * E);
  const auto probs = raw_to_host<float>(*backend, d_probs, T * E);
  const auto ids = raw_to_host<int32_t>(*backend, d_ids, T * k);
  const auto weights = raw_to_host<float>(*backend, d_weights, T * k);
  const auto lse = raw_to_host<float>(*backend, d_lse, T);

  // CPU from the same (rounded) inputs.
  std::vector<float> c_logits(T * E), c_probs(T * E), c_weights(T * k), c_lse(T);
  std::vector<int32_t> c_ids(T * k);
  cpu::router_logits(x.data(), wg.data(), c_logits.data(), T, H, E);
  cpu::router_topk(c_logits.data(), c_probs.data(), c_ids.data(), c_weights.data(), c_lse.data(), T, E, k,
                   renormalize);
  EXPECT_TRUE(close_rel("logits", logits, c_logits, kTolF32));  // f32 out, fp32 accumulation

  // Twin check on the GPU's own logits: the same per-token code (core/routing.hpp) must pick the same
  // experts exactly; probabilities differ only by f32 vs fp64 sums.
  {
    std::vector<float> t_probs(T * E), t_weights(T * k), t_lse(T);
    std::vector<int32_t> t_ids(T * k);
    cpu::router_topk(logits.data(), t_probs.data(), t_ids.data(), t_weights.data(), t_lse.data(), T, E, k,
                     renormalize);
    EXPECT_TRUE(equal_exact("ids (from the GPU logits)", ids, t_ids));
    EXPECT_TRUE(close_rel("probs (from the GPU logits)", probs, t_probs, kTolF32));
    EXPECT_TRUE(close_rel("weights (from the GPU logits)", weights, t_weights, kTolF32));
    EXPECT_TRUE(close_rel("lse (from the GPU logits)", lse, t_lse, kTolF32));
  }

  // Against the CPU's logits: ids must agree wherever the k-th and (k+1)-th logits are clearly apart;
  // near-ties may flip and are only counted.
  int64_t clear = 0, clear_mismatch = 0, near_tie = 0, flipped = 0;
  std::vector<float> w_match, c_w_match;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> row(c_logits.begin() + t * E, c_logits.begin() + (t + 1) * E);
    std::sort(row.begin(), row.end(), std::greater<float>());
    // Clear = every adjacent gap among the first k+1 logits is wide: a near-tie inside the top k can
    // swap the order of two chosen experts (and their slots) as well as a near-tie at the k-th place.
    bool is_clear = true;
    for (int32_t j = 0; j < k && j + 1 < E; ++j)
      is_clear = is_clear && row[j] - row[j + 1] > 1e-4f * (1.f + std::fabs(row[j]));
    const bool same = std::equal(ids.begin() + t * k, ids.begin() + (t + 1) * k, c_ids.begin() + t * k);
    if (is_clear) {
      ++clear;
      clear_mismatch += !same;
    } else {
      ++near_tie;
      flipped += !same;
    }
    if (same) {
      w_match.insert(w_match.end(), weights.begin() + t * k, weights.begin() + (t + 1) * k);
      c_w_match.insert(c_w_match.end(), c_weights.begin() + t * k, c_weights.begin() + (t + 1) * k);
    }
  }
  EXPECT_EQ(clear_mismatch, 0) << "of " << clear << " tokens with a clear top-k";
  if (near_tie > 0)
    std::cout << "[   INFO   ] router: " << flipped << " of " << near_tie << " near-tie tokens flipped ("
              << 100.0 * double(flipped) / double(T) << "% of all tokens)\n";
  EXPECT_TRUE(close_rel("probs", probs, c_probs, kTolF32));
  EXPECT_TRUE(close_rel("weights (tokens with equal ids)", w_match, c_w_match, kTolF32));
  EXPECT_TRUE(close_rel("lse", lse, c_lse, kTolF32));
}

TEST_P(CudaKernelsRouter, BackwardMatchesCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, s, renormalize] = GetParam();
  const int64_t T = s.tokens, H = s.hidden;
  const int32_t E = s.experts, k = s.top_k;
  auto backend = make_cuda_backend(storage);
  for (const bool with_aux : {false, true}) {
    const uint64_t seed = fresh_seed();
    DMOE_SEED_TRACE(seed);
    SCOPED_TRACE(with_aux ? "with auxiliary losses" : "without auxiliary losses");
    Rng rng(seed);
    const Routing r = random_routing(rng, T, E, k, renormalize);
    const std::vector<float> dweights = rng.normal_vector(size_t(T * k), 1.0);
    std::vector<double> fraction(E);
    for (auto& f : fraction) f = rng.uniform() * 2.0 / E;
    const double lb_scale = 0.37, z_scale = 0.011;
    const std::vector<float> x = rounded(rng.normal_vector(size_t(T * H), 1.0), storage);
    const std::vector<float> wg =
        rounded(rng.normal_vector(size_t(E * H), 1.0 / std::sqrt(double(H))), storage);
    const std::vector<float> dwg0 = rng.normal_vector(size_t(E * H), 0.1);  // accumulator's prior content

    DeviceBuffer d_x = storage_from(*backend, x), d_wg = storage_from(*backend, wg);
    DeviceBuffer d_probs = raw_from(*backend, r.probs), d_ids = raw_from(*backend, r.ids);
    DeviceBuffer d_weights = raw_from(*backend, r.weights), d_dweights = raw_from(*backend, dweights);
    DeviceBuffer d_lse = raw_from(*backend, r.lse), d_dwg = raw_from(*backend, dwg0);
    DeviceBuffer d_dlogits(*backend, size_t(T * E) * 4), d_dx(*backend, size_t(T * H) * 4);
    cpu::RouterAuxGrad gpu_aux;  // lse on the device, expert fraction on the host
    gpu_aux.expert_fraction = with_aux ? fraction.data() : nullptr;
    gpu_aux.lb_scale = lb_scale;
    gpu_aux.lse = with_aux ? d_lse.as<float>() : nullptr;
    gpu_aux.z_scale = z_scale;
    backend->router_backward(d_x.get(), d_wg.get(), d_probs.as<float>(), d_ids.as<int32_t>(),
                             d_weights.as<float>(), d_dweights.as<float>(), gpu_aux, d_dlogits.as<float>(),
                             d_dx.as<float>(), d_dwg.get(), T, H, E, k, renormalize);

    cpu::RouterAuxGrad aux;
    if (with_aux) {
      aux.expert_fraction = fraction.data();
      aux.lb_scale = lb_scale;
      aux.lse = r.lse.data();
      aux.z_scale = z_scale;
    }
    std::vector<float> c_dlogits(T * E), c_dx(T * H, 0.f);
    std::vector<double> c_dwg(dwg0.begin(), dwg0.end());
    cpu::router_topk_backward(r.probs.data(), r.ids.data(), r.weights.data(), dweights.data(),
                              c_dlogits.data(), T, E, k, renormalize, aux);
    cpu::router_logits_backward(x.data(), wg.data(), c_dlogits.data(), c_dx.data(), c_dwg.data(), T, H, E);

    // All three outputs are f32 from identical inputs.
    EXPECT_TRUE(close_rel("dlogits", raw_to_host<float>(*backend, d_dlogits, T * E), c_dlogits, kTolF32));
    EXPECT_TRUE(close_rel("dx_router", raw_to_host<float>(*backend, d_dx, T * H), c_dx, kTolF32));
    EXPECT_TRUE(close_rel("dwg", raw_to_host<float>(*backend, d_dwg, E * H), c_dwg, kTolF32));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaKernelsRouter,
    testing::Combine(testing::Values(DType::f32, DType::bf16),
                     testing::Values(RouterShape{333, 72, 10, 3}, RouterShape{257, 136, 64, 8},
                                     RouterShape{100, 40, 300, 6},  // big E: 64 tokens a block
                                     RouterShape{65, 16, 2, 2},
                                     RouterShape{2100, 8192, 4, 2}),  // bf16 dwg: 2 chunks
                     testing::Bool()),
    router_name);

TEST(CudaKernelsRouterAux, PartialsMatchCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  auto backend = make_cuda_backend(DType::f32);
  for (const RouterShape s :
       {RouterShape{1234, 0, 10, 3}, RouterShape{40000, 0, 64, 8}, RouterShape{7, 0, 5, 5}}) {
    const uint64_t seed = fresh_seed();
    DMOE_SEED_TRACE(seed);
    Rng rng(seed);
    const Routing r = random_routing(rng, s.tokens, s.experts, s.top_k, true);
    DeviceBuffer d_probs = raw_from(*backend, r.probs), d_lse = raw_from(*backend, r.lse);
    DeviceBuffer d_ids = raw_from(*backend, r.ids);
    std::vector<double> prob_sum(s.experts), assigned(s.experts), z(1);
    backend->router_aux_partials(d_probs.as<float>(), d_lse.as<float>(), d_ids.as<int32_t>(), s.tokens,
                                 s.experts, s.top_k, prob_sum.data(), assigned.data(), z.data());
    std::vector<double> c_prob_sum(s.experts), c_assigned(s.experts), c_z(1);
    cpu::router_aux_partials(r.probs.data(), r.lse.data(), r.ids.data(), s.tokens, s.experts, s.top_k,
                             c_prob_sum.data(), c_assigned.data(), c_z.data());
    EXPECT_TRUE(close_rel("prob_sum", prob_sum, c_prob_sum, kTolF64Sum)) << "T " << s.tokens;
    EXPECT_TRUE(equal_exact("assigned", assigned, c_assigned)) << "T " << s.tokens;
    EXPECT_TRUE(close_rel("z_sum", z, c_z, kTolF64Sum)) << "T " << s.tokens;
    // The same sums left on the device (AuxPartialsBlock): bit for bit the host-read ones (same kernels).
    DeviceBuffer d_block(*backend, AuxPartialsBlock::bytes(s.experts));
    backend->router_aux_partials_on_device(d_probs.as<float>(), d_lse.as<float>(), d_ids.as<int32_t>(), s.tokens,
                                           s.experts, s.top_k, d_block.get());
    const auto block = raw_to_host<char>(*backend, d_block, int64_t(AuxPartialsBlock::bytes(s.experts)));
    EXPECT_EQ(AuxPartialsBlock::read_bad(block.data(), s.experts), kNoBadAssignment);
    std::vector<double> d_prob_sum(s.experts), d_assigned(s.experts), d_z(1);
    AuxPartialsBlock::decode(block.data(), s.experts, d_prob_sum.data(), d_assigned.data(), d_z.data());
    EXPECT_TRUE(equal_exact("prob_sum (device block)", d_prob_sum, prob_sum));
    EXPECT_TRUE(equal_exact("assigned (device block)", d_assigned, assigned));
    EXPECT_TRUE(equal_exact("z_sum (device block)", d_z, z));
  }
}

// =========================================================================================================
// Combine (forward, scatter back, backward)
// =========================================================================================================

class CudaKernelsCombine : public testing::TestWithParam<std::tuple<DType, int64_t>> {};

// A plan with drops: slot [T, k] with -1 entries, S rows.
SendPlan plan_with_drops(Rng& rng, int64_t tokens, int32_t top_k, int32_t experts) {
  const std::vector<int32_t> ids = random_ids(rng, tokens, top_k, experts);
  const std::vector<float> weights(ids.size(), 1.f);
  const int64_t capacity = int64_t(0.8 * double(tokens * top_k) / experts);
  return build_send_plan(ids.data(), weights.data(), tokens, top_k, experts, capacity,
                         DropPolicy::latest_tokens);
}

TEST_P(CudaKernelsCombine, ForwardAndScatterBackMatchCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, hidden] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  const int64_t T = 300, H = hidden;
  const int32_t k = 3, E = 7;
  const SendPlan plan = plan_with_drops(rng, T, k, E);
  ASSERT_GT(plan.dropped(), 0);
  const int64_t S = plan.rows();
  DeviceBuffer d_slot = raw_from(*backend, plan.slot);

  {  // y = Σ_j w·rows[slot]
    const std::vector<float> rows = rounded(rng.normal_vector(size_t(S * H), 1.0), storage);
    std::vector<float> weights(T * k);
    for (auto& w : weights) w = float(rng.uniform());
    DeviceBuffer d_rows = storage_from(*backend, rows), d_weights = raw_from(*backend, weights);
    DeviceBuffer d_y(*backend, storage_bytes(*backend, T * H));
    backend->combine(d_rows.get(), d_slot.as<int32_t>(), d_weights.as<float>(), d_y.get(), T, k, H);
    std::vector<float> c_y(T * H);
    cpu::combine(rows.data(), plan.slot.data(), weights.data(), nullptr, c_y.data(), T, k, H, storage);
    EXPECT_TRUE(
        close_rel("combine y", storage_to_host(*backend, d_y, T * H), c_y, storage_tolerance(storage)));
  }
  {  // dx = Σ_j dsend[slot] + dx_router
    const std::vector<float> dsend = rounded(rng.normal_vector(size_t(S * H), 1.0), storage);
    const std::vector<float> dx_router = rng.normal_vector(size_t(T * H), 0.5);
    DeviceBuffer d_dsend = storage_from(*backend, dsend), d_dx_router = raw_from(*backend, dx_router);
    DeviceBuffer d_dx(*backend, storage_bytes(*backend, T * H));
    backend->scatter_back(d_dsend.get(), d_slot.as<int32_t>(), d_dx_router.get(), d_dx.get(), T, k, H);
    std::vector<float> c_dx(T * H);
    cpu::combine(dsend.data(), plan.slot.data(), nullptr, dx_router.data(), c_dx.data(), T, k, H, storage);
    EXPECT_TRUE(close_rel("scatter_back dx", storage_to_host(*backend, d_dx, T * H), c_dx,
                          storage_tolerance(storage)));
  }
}

TEST_P(CudaKernelsCombine, BackwardMatchesCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, hidden] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  const int64_t T = 300, H = hidden;
  const int32_t k = 3, E = 7;
  const SendPlan plan = plan_with_drops(rng, T, k, E);
  const int64_t S = plan.rows();
  // Two extra rows that no slot references: they must keep their content.
  const std::vector<float> dy = rounded(rng.normal_vector(size_t(T * H), 1.0), storage);
  const std::vector<float> rows = rounded(rng.normal_vector(size_t((S + 2) * H), 1.0), storage);
  const std::vector<float> drows0 = rounded(rng.normal_vector(size_t((S + 2) * H), 1.0), storage);
  std::vector<float> weights(T * k);
  for (auto& w : weights) w = float(rng.uniform());

  DeviceBuffer d_slot = raw_from(*backend, plan.slot), d_weights = raw_from(*backend, weights);
  DeviceBuffer d_dy = storage_from(*backend, dy), d_rows = storage_from(*backend, rows);
  DeviceBuffer d_drows = storage_from(*backend, drows0);
  DeviceBuffer d_dweights(*backend, size_t(T * k) * 4);
  backend->combine_backward(d_dy.get(), d_rows.get(), d_slot.as<int32_t>(), d_weights.as<float>(),
                            d_drows.get(), d_dweights.as<float>(), T, k, H);

  std::vector<float> c_drows = drows0, c_dweights(T * k);
  cpu::combine_backward(dy.data(), rows.data(), plan.slot.data(), weights.data(), c_drows.data(),
                        c_dweights.data(), T, k, H, storage);
  EXPECT_TRUE(close_rel("drows", storage_to_host(*backend, d_drows, (S + 2) * H), c_drows,
                        storage_tolerance(storage)));
  // dweights is f32: dot products of identical stored values.
  EXPECT_TRUE(close_rel("dweights", raw_to_host<float>(*backend, d_dweights, T * k), c_dweights, kTolF32));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaKernelsCombine,
                         testing::Combine(testing::Values(DType::f32, DType::bf16),
                                          testing::Values(int64_t{72}, int64_t{36}, int64_t{7},
                                                          int64_t{1032})),
                         [](const testing::TestParamInfo<std::tuple<DType, int64_t>>& param_info) {
                           return dtype_label(std::get<0>(param_info.param)) + "_H" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// =========================================================================================================
// Expert FFN (forward, backward) over 5 local experts, one of them without rows
// =========================================================================================================

struct FfnShape {
  int64_t hidden;
  int64_t ffn;
};

class CudaKernelsFfn : public testing::TestWithParam<std::tuple<DType, Activation, FfnShape>> {};

std::string ffn_name(const testing::TestParamInfo<std::tuple<DType, Activation, FfnShape>>& info) {
  const auto& [storage, activation, s] = info.param;
  return dtype_label(storage) + "_" + activation_name(activation) + "_H" + std::to_string(s.hidden) + "_I" +
         std::to_string(s.ffn);
}

// Expert weights, inputs and row offsets (host, rounded to the storage type).
struct FfnProblem {
  int32_t local_experts = 5;
  std::vector<int64_t> offsets;  // [Le+1]
  int64_t rows = 0;
  std::vector<float> x, w1, w3, w2;
};

FfnProblem random_ffn_problem(Rng& rng, DType storage, Activation activation, int64_t H, int64_t I) {
  FfnProblem p;
  p.offsets.assign(p.local_experts + 1, 0);
  for (int32_t e = 0; e < p.local_experts; ++e) {
    const uint64_t max_rows = H >= 256 ? 300 : 45;                      // more rows for the larger shape
    const int64_t n = e == 2 ? 0 : 1 + int64_t(rng.next() % max_rows);  // expert 2 gets no rows
    p.offsets[e + 1] = p.offsets[e] + n;
  }
  p.rows = p.offsets.back();
  const size_t weight = size_t(p.local_experts * I * H);
  p.x = rounded(rng.normal_vector(size_t(p.rows * H), 1.0), storage);
  p.w1 = rounded(rng.normal_vector(weight, 1.0 / std::sqrt(double(H))), storage);
  if (activation == Activation::swiglu)
    p.w3 = rounded(rng.normal_vector(weight, 1.0 / std::sqrt(double(H))), storage);
  p.w2 = rounded(rng.normal_vector(weight, 1.0 / std::sqrt(double(I))), storage);
  return p;
}

// CPU forward, expert by expert: pre1, pre3 (SwiGLU), h [rows, I], out [rows, H].
struct FfnForward {
  std::vector<float> pre1, pre3, h, out;
};

FfnForward cpu_ffn_forward(const FfnProblem& p, DType storage, Activation activation, int64_t H, int64_t I) {
  const bool swiglu = activation == Activation::swiglu;
  FfnForward f;
  f.pre1.assign(p.rows * I, 0.f);
  if (swiglu) f.pre3.assign(p.rows * I, 0.f);
  f.h.assign(p.rows * I, 0.f);
  f.out.assign(p.rows * H, 0.f);
  for (int32_t e = 0; e < p.local_experts; ++e) {
    const int64_t r0 = p.offsets[e], n = p.offsets[e + 1] - r0;
    if (n == 0) continue;
    cpu::expert_ffn_forward(p.x.data() + r0 * H, p.w1.data() + e * I * H,
                            swiglu ? p.w3.data() + e * I * H : nullptr, p.w2.data() + e * I * H,
                            f.pre1.data() + r0 * I, swiglu ? f.pre3.data() + r0 * I : nullptr,
                            f.h.data() + r0 * I, f.out.data() + r0 * H, n, H, I, activation, storage);
  }
  return f;
}

TEST_P(CudaKernelsFfn, ForwardMatchesCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, activation, s] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  const int64_t H = s.hidden, I = s.ffn;
  const bool swiglu = activation == Activation::swiglu;
  const FfnProblem p = random_ffn_problem(rng, storage, activation, H, I);

  DeviceBuffer d_x = storage_from(*backend, p.x), d_w1 = storage_from(*backend, p.w1);
  DeviceBuffer d_w3 = storage_from(*backend, p.w3), d_w2 = storage_from(*backend, p.w2);
  DeviceBuffer d_pre1(*backend, storage_bytes(*backend, p.rows * I)),
      d_pre3(*backend, storage_bytes(*backend, p.rows * I));
  DeviceBuffer d_h(*backend, storage_bytes(*backend, p.rows * I)),
      d_out(*backend, storage_bytes(*backend, p.rows * H));
  backend->expert_ffn_forward(d_x.get(), d_w1.get(), swiglu ? d_w3.get() : nullptr, d_w2.get(), d_pre1.get(),
                              swiglu ? d_pre3.get() : nullptr, d_h.get(), d_out.get(), p.offsets.data(),
                              p.local_experts, H, I, activation);

  const FfnForward c = cpu_ffn_forward(p, storage, activation, H, I);
  const double tol = storage_tolerance(storage);
  EXPECT_TRUE(close_rel("pre1", storage_to_host(*backend, d_pre1, p.rows * I), c.pre1, tol));
  if (swiglu) {
    EXPECT_TRUE(close_rel("pre3", storage_to_host(*backend, d_pre3, p.rows * I), c.pre3, tol));
  }
  EXPECT_TRUE(close_rel("h", storage_to_host(*backend, d_h, p.rows * I), c.h, tol));
  EXPECT_TRUE(close_rel("out", storage_to_host(*backend, d_out, p.rows * H), c.out, tol));
}

TEST_P(CudaKernelsFfn, BackwardMatchesCpu) {
  DMOE_SKIP_WITHOUT_GPU();
  const auto [storage, activation, s] = GetParam();
  const uint64_t seed = fresh_seed();
  DMOE_SEED_TRACE(seed);
  Rng rng(seed);
  auto backend = make_cuda_backend(storage);
  const int64_t H = s.hidden, I = s.ffn;
  const bool swiglu = activation == Activation::swiglu;
  const FfnProblem p = random_ffn_problem(rng, storage, activation, H, I);
  // Both sides start from the CPU's forward activations (already rounded to the storage type), so the
  // activation derivatives see identical inputs.
  const FfnForward f = cpu_ffn_forward(p, storage, activation, H, I);
  // Both ways of treating the weight gradients: added to (accumulate) or written over (the first
  // backward after zero_grads).
  for (const bool accumulate : {true, false}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    const std::vector<float> dout = rounded(rng.normal_vector(size_t(p.rows * H), 1.0), storage);
    const size_t weight = size_t(p.local_experts * I * H);
    const std::vector<float> dw1_0 = rng.normal_vector(weight, 0.1), dw2_0 = rng.normal_vector(weight, 0.1);
    const std::vector<float> dw3_0 = rng.normal_vector(swiglu ? weight : 0, 0.1);

    DeviceBuffer d_x = storage_from(*backend, p.x), d_w1 = storage_from(*backend, p.w1);
    DeviceBuffer d_w3 = storage_from(*backend, p.w3), d_w2 = storage_from(*backend, p.w2);
    DeviceBuffer d_pre1 = storage_from(*backend, f.pre1), d_pre3 = storage_from(*backend, f.pre3);
    DeviceBuffer d_h = storage_from(*backend, f.h), d_dout = storage_from(*backend, dout);
    DeviceBuffer d_dx(*backend, storage_bytes(*backend, p.rows * H));
    DeviceBuffer d_dw1 = raw_from(*backend, dw1_0), d_dw3 = raw_from(*backend, dw3_0),
                 d_dw2 = raw_from(*backend, dw2_0);
    backend->expert_ffn_backward(d_x.get(), d_w1.get(), swiglu ? d_w3.get() : nullptr, d_w2.get(), d_pre1.get(),
                                 swiglu ? d_pre3.get() : nullptr, d_h.get(), d_dout.get(), d_dx.get(),
                                 d_dw1.get(), swiglu ? d_dw3.get() : nullptr, d_dw2.get(), p.offsets.data(),
                                 p.local_experts, H, I, activation, accumulate, DType::f32);

    std::vector<float> c_dx(p.rows * H, 0.f);
    // Accumulate: the reference starts from the buffers' contents; overwrite: from zero (and the buffers'
    // random contents must not leak into the result).
    auto start_of = [&](const std::vector<float>& v0) {
      return accumulate ? std::vector<double>(v0.begin(), v0.end()) : std::vector<double>(v0.size(), 0.0);
    };
    std::vector<double> c_dw1 = start_of(dw1_0), c_dw3 = start_of(dw3_0), c_dw2 = start_of(dw2_0);
    for (int32_t e = 0; e < p.local_experts; ++e) {
      const int64_t r0 = p.offsets[e], n = p.offsets[e + 1] - r0;
      if (n == 0) continue;
      const int64_t wo = e * I * H;
      cpu::expert_ffn_backward(
          p.x.data() + r0 * H, p.w1.data() + wo, swiglu ? p.w3.data() + wo : nullptr, p.w2.data() + wo,
          f.pre1.data() + r0 * I, swiglu ? f.pre3.data() + r0 * I : nullptr, f.h.data() + r0 * I,
          dout.data() + r0 * H, c_dx.data() + r0 * H, c_dw1.data() + wo, swiglu ? c_dw3.data() + wo : nullptr,
          c_dw2.data() + wo, n, H, I, activation, storage);
    }
    const double tol = storage_tolerance(storage);
    EXPECT_TRUE(close_rel("dx", storage_to_host(*backend, d_dx, p.rows * H), c_dx, tol));
    // Weight gradients are f32 accumulators, but for bf16 the GPU rounds dpre1/dpre3 to bf16 before them.
    EXPECT_TRUE(close_rel("dw1", raw_to_host<float>(*backend, d_dw1, int64_t(weight)), c_dw1, tol));
    if (swiglu) {
      EXPECT_TRUE(close_rel("dw3", raw_to_host<float>(*backend, d_dw3, int64_t(weight)), c_dw3, tol));
    }
    EXPECT_TRUE(close_rel("dw2", raw_to_host<float>(*backend, d_dw2, int64_t(weight)), c_dw2, tol));
    if (storage == DType::bf16 && !accumulate) {
      // bf16 weight gradients, written as they are stored (the PyTorch module's bf16 parameters): the same
      // values within bf16's rounding, every expert overwritten (the buffers start at 1.5, not zero).
      SCOPED_TRACE("bf16 weight gradients");
      const std::vector<float> junk(weight, 1.5f);
      DeviceBuffer b_dw1 = storage_from(*backend, junk), b_dw3 = storage_from(*backend, junk),
                   b_dw2 = storage_from(*backend, junk);
      backend->expert_ffn_backward(d_x.get(), d_w1.get(), swiglu ? d_w3.get() : nullptr, d_w2.get(), d_pre1.get(),
                                   swiglu ? d_pre3.get() : nullptr, d_h.get(), d_dout.get(), d_dx.get(),
                                   b_dw1.get(), swiglu ? b_dw3.get() : nullptr, b_dw2.get(), p.offsets.data(),
                                   p.local_experts, H, I, activation, /*accumulate=*/false, DType::bf16);
      EXPECT_TRUE(close_rel("dx", storage_to_host(*backend, d_dx, p.rows * H), c_dx, tol));
      EXPECT_TRUE(close_rel("dw1", storage_to_host(*backend, b_dw1, int64_t(weight)), c_dw1, tol));
      if (swiglu) {
        EXPECT_TRUE(close_rel("dw3", storage_to_host(*backend, b_dw3, int64_t(weight)), c_dw3, tol));
      }
      EXPECT_TRUE(close_rel("dw2", storage_to_host(*backend, b_dw2, int64_t(weight)), c_dw2, tol));
    }
  }
}

// H=72, I=40: 16-byte aligned rows (grouped cuBLAS path); H=36, I=20: bf16 rows of 72/40 bytes break
// 16-byte alignment (per-expert GEMM loop, scalar activation kernel); H=7, I=5: odd everything;
// H=264, I=136: larger aligned products.
INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaKernelsFfn,
    testing::Combine(testing::Values(DType::f32, DType::bf16),
                     testing::Values(Activation::relu, Activation::gelu, Activation::swiglu),
                     testing::Values(FfnShape{72, 40}, FfnShape{36, 20}, FfnShape{7, 5}, FfnShape{264, 136})),
    ffn_name);

TEST(CudaKernelsFfnEmpty, NoRowsLeavesOrZeroesTheGradients) {
  DMOE_SKIP_WITHOUT_GPU();
  auto backend = make_cuda_backend(DType::bf16);
  const int64_t H = 16, I = 8;
  const int32_t le = 3;
  const std::vector<int64_t> offsets(le + 1, 0);
  const std::vector<float> w(size_t(le * I * H), 0.25f), dw0(size_t(le * I * H), 1.5f);
  DeviceBuffer d_w = storage_from(*backend, w), d_dw = raw_from(*backend, dw0);
  DeviceBuffer d_rows(*backend, 256);
  backend->expert_ffn_forward(d_rows.get(), d_w.get(), d_w.get(), d_w.get(), d_rows.get(), d_rows.get(),
                              d_rows.get(), d_rows.get(), offsets.data(), le, H, I, Activation::swiglu);
  backend->expert_ffn_backward(d_rows.get(), d_w.get(), d_w.get(), d_w.get(), d_rows.get(), d_rows.get(),
                               d_rows.get(), d_rows.get(), d_rows.get(), d_dw.get(), d_dw.get(), d_dw.get(),
                               offsets.data(), le, H, I, Activation::swiglu, /*accumulate=*/true, DType::f32);
  EXPECT_TRUE(equal_exact("dw untouched", raw_to_host<float>(*backend, d_dw, le * I * H), dw0));
  // Overwriting: experts without rows get zero gradients.
  backend->expert_ffn_backward(d_rows.get(), d_w.get(), d_w.get(), d_w.get(), d_rows.get(), d_rows.get(),
                               d_rows.get(), d_rows.get(), d_rows.get(), d_dw.get(), d_dw.get(), d_dw.get(),
                               offsets.data(), le, H, I, Activation::swiglu, /*accumulate=*/false, DType::f32);
  EXPECT_TRUE(equal_exact("dw zeroed", raw_to_host<float>(*backend, d_dw, le * I * H),
                          std::vector<float>(size_t(le * I * H), 0.f)));
}

}  // namespace
}  // namespace dmoe
