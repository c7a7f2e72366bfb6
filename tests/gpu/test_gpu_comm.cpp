// NcclComm and NvshmemComm on real GPUs: exact data movement (payloads encode source rank, destination
// rank, row and column), all-reduce in every supported dtype (chunked sizes included), broadcast, barrier.
//
// Every test runs inside one rank; start W ranks with
//   dmoe launch -n W -- dmoe_gpu_tests --gtest_filter='GpuComm*'          (ranks may share one GPU)
//   mpirun -n W dmoe_gpu_tests --gtest_filter='GpuComm*'                  (NVSHMEM's MPI bootstrap)
// or run the binary alone for W = 1. Tests are collective: every rank runs the same tests in the same
// order, so skips depend only on facts every rank shares (GPU present, GPUs shared). Data checks come
// after the collectives, so a failed check never leaves a peer waiting.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.hpp"
#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

constexpr size_t kMaxBytesPerPeer = size_t(1) << 20;

#define CHECK_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call

// ---- one set of communicators per process, shared by the tests, torn down before NVSHMEM ----------

struct Shared {
  ProcessEnv env;
  bool has_gpu = false;
  cudaStream_t stream = nullptr;
  std::map<CommKind, std::unique_ptr<Comm>> comms;
};

Shared& shared() {
  static Shared s = [] {
    Shared x;
    x.env = detect_process_env();
    int count = 0;
    x.has_gpu = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    if (x.has_gpu) {
      select_device(x.env);
      cudaStreamCreateWithFlags(&x.stream, cudaStreamNonBlocking);
    }
    return x;
  }();
  return s;
}

class CommEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    Shared& s = shared();
    s.comms.clear();  // collective frees, before NVSHMEM goes
    finalize_nvshmem();
    if (s.stream) cudaStreamDestroy(s.stream);
    s.stream = nullptr;
  }
};

[[maybe_unused]] const auto* const kEnvironment = ::testing::AddGlobalTestEnvironment(new CommEnvironment);

// The communicator of `kind`, created on first use; nullptr with a reason when this run cannot test it.
Comm* comm_or_skip(CommKind kind, std::string* reason) {
  Shared& s = shared();
  if (!s.has_gpu) {
    *reason = "no GPU visible";
    return nullptr;
  }
  if (kind == CommKind::nccl && s.env.world > 1) {
    int visible = 0;
    cudaGetDeviceCount(&visible);
    std::string why;
    if (gpus_are_shared(s.env, visible, &why)) {
      *reason = "NCCL needs one GPU per rank and the ranks share GPUs here (" + why + ")";
      return nullptr;
    }
  }
  auto& slot = s.comms[kind];
  if (!slot) slot = make_gpu_comm(s.env, kind, kMaxBytesPerPeer, s.stream);
  return slot.get();
}

#define COMM_OR_SKIP(kind)                      \
  std::string skip_reason_;                     \
  Comm* comm = comm_or_skip(kind, &skip_reason_); \
  if (!comm) GTEST_SKIP() << skip_reason_;

template <typename T>
struct DeviceArray {
  explicit DeviceArray(size_t n) : size(n) {
    if (n) cudaMalloc(&data, n * sizeof(T));
  }
  ~DeviceArray() {
    if (data) cudaFree(data);
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload(const std::vector<T>& v) { cudaMemcpy(data, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> download() const {
    std::vector<T> v(size);
    if (size) cudaMemcpy(v.data(), data, size * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  T* data = nullptr;
  size_t size;
};

// ---- alltoallv ---------------------------------------------------------------------------------------

// Rows source s sends to destination d in round `round`: a mix of zero and non-zero counts.
int64_t rows_between(int32_t s, int32_t d, int32_t round, int64_t scale) {
  const int64_t base = (3 * s + 5 * d + round) % 4;  // 0..3: some pairs send nothing
  return base == 0 ? 0 : base * scale + s + 2 * d;
}

// Element (row r, column c) of the segment s -> d: fields packed so any misplaced element is visible.
int32_t payload(int32_t s, int32_t d, int64_t row, int32_t col, int32_t round) {
  return (s << 24) | (d << 16) | int32_t((row & 0x3ff) << 6) | ((col & 0x7) << 3) | (round & 0x7);
}

// Runs `rounds` alltoallvs back to back (no host sync in between, so slot reuse is exercised), then
// checks every received element exactly.
void check_alltoallv(Comm& comm, cudaStream_t stream, int64_t scale, int32_t cols, int32_t rounds) {
  const int32_t me = comm.rank(), world = comm.world();
  struct Round {
    std::vector<int64_t> send_counts, recv_counts;
    std::unique_ptr<DeviceArray<int32_t>> send, recv;
  };
  std::vector<Round> rs(static_cast<size_t>(rounds));
  for (int32_t round = 0; round < rounds; ++round) {
    Round& r = rs[round];
    std::vector<int32_t> host;
    for (int32_t d = 0; d < world; ++d) {
      const int64_t rows = rows_between(me, d, round, scale);
      r.send_counts.push_back(rows * cols);
      for (int64_t row = 0; row < rows; ++row)
        for (int32_t c = 0; c < cols; ++c) host.push_back(payload(me, d, row, c, round));
    }
    int64_t recv_total = 0;
    for (int32_t s = 0; s < world; ++s) {
      r.recv_counts.push_back(rows_between(s, me, round, scale) * cols);
      recv_total += r.recv_counts.back();
    }
    r.send = std::make_unique<DeviceArray<int32_t>>(host.size());
    r.send->upload(host);
    r.recv = std::make_unique<DeviceArray<int32_t>>(size_t(recv_total));
    cudaMemset(r.recv->data, 0xff, size_t(recv_total) * sizeof(int32_t));
  }
  for (auto& r : rs)
    comm.alltoallv(r.send->data, r.send_counts.data(), r.recv->data, r.recv_counts.data(), DType::i32, stream);
  comm.barrier(stream);

  for (int32_t round = 0; round < rounds; ++round) {
    const std::vector<int32_t> got = rs[round].recv->download();
    size_t i = 0, mismatches = 0;
    for (int32_t s = 0; s < world; ++s)
      for (int64_t row = 0; row < rows_between(s, me, round, scale); ++row)
        for (int32_t c = 0; c < cols; ++c, ++i) {
          const int32_t want = payload(s, me, row, c, round);
          if (got[i] != want && mismatches++ < 5)
            ADD_FAILURE() << comm.name() << " rank " << me << " round " << round << ": element from rank " << s
                          << " row " << row << " col " << c << " is 0x" << std::hex << got[i] << ", expected 0x"
                          << want;
        }
    EXPECT_EQ(mismatches, 0u) << comm.name() << " rank " << me << " round " << round;
    EXPECT_EQ(i, got.size());
  }
}

// bf16 travels as raw 16-bit words: the check is on the bits.
void check_alltoallv_bf16(Comm& comm, cudaStream_t stream) {
  const int32_t me = comm.rank(), world = comm.world();
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<uint16_t> host;
  for (int32_t d = 0; d < world; ++d) {
    const int64_t n = 7 + d + 3 * me;
    send_counts.push_back(n);
    for (int64_t e = 0; e < n; ++e) host.push_back(uint16_t((me << 12) | (d << 8) | e));
  }
  int64_t total = 0;
  for (int32_t s = 0; s < world; ++s) total += recv_counts.emplace_back(7 + me + 3 * s);
  DeviceArray<uint16_t> send(host.size()), recv(static_cast<size_t>(total));
  send.upload(host);
  comm.alltoallv(send.data, send_counts.data(), recv.data, recv_counts.data(), DType::bf16, stream);
  comm.barrier(stream);
  const auto got = recv.download();
  size_t i = 0;
  for (int32_t s = 0; s < world; ++s)
    for (int64_t e = 0; e < recv_counts[s]; ++e, ++i)
      ASSERT_EQ(got[i], uint16_t((s << 12) | (me << 8) | e)) << comm.name() << " from rank " << s << " element " << e;
}

// ---- all-reduce and broadcast ---------------------------------------------------------------------------

// Values are small integers, exact in every dtype, so the sum is exact whatever the order.
template <typename T>
void check_allreduce(Comm& comm, cudaStream_t stream, DType dtype, int64_t count) {
  const int32_t me = comm.rank(), world = comm.world();
  std::vector<T> host(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) host[i] = T((i % 1024) * (me + 1) - me);
  DeviceArray<T> data(host.size());
  data.upload(host);
  comm.allreduce_sum(data.data, count, dtype, stream);
  comm.barrier(stream);
  const auto got = data.download();
  size_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i) {
    const T want = T((i % 1024) * (int64_t(world) * (world + 1) / 2) - int64_t(world) * (world - 1) / 2);
    if (got[i] != want && mismatches++ < 5)
      ADD_FAILURE() << comm.name() << " " << dtype_name(dtype) << " rank " << me << " element " << i << ": "
                    << double(got[i]) << ", expected " << double(want);
  }
  EXPECT_EQ(mismatches, 0u) << comm.name() << " " << dtype_name(dtype) << " count " << count;
}

void check_broadcast(Comm& comm, cudaStream_t stream, int32_t root, int64_t count) {
  const int32_t me = comm.rank();
  std::vector<int32_t> host(static_cast<size_t>(count), -1);
  if (me == root)
    for (int64_t i = 0; i < count; ++i) host[i] = int32_t(i * 3 + 7 + root);
  DeviceArray<int32_t> data(host.size());
  data.upload(host);
  comm.broadcast(data.data, count, DType::i32, root, stream);
  comm.barrier(stream);
  const auto got = data.download();
  size_t mismatches = 0;
  for (int64_t i = 0; i < count; ++i)
    if (got[i] != int32_t(i * 3 + 7 + root) && mismatches++ < 5)
      ADD_FAILURE() << comm.name() << " rank " << me << " element " << i << ": " << got[i] << ", expected "
                    << i * 3 + 7 + root;
  EXPECT_EQ(mismatches, 0u) << comm.name() << " broadcast from " << root << " count " << count;
}

// ---- the tests, once per communicator ------------------------------------------------------------------

// Instantiated as GpuComm/GpuCommKinds.*/{nccl,nvshmem}, so --gtest_filter='GpuComm*' selects them.
class GpuCommKinds : public ::testing::TestWithParam<CommKind> {};

TEST_P(GpuCommKinds, RankAndWorldMatchTheLauncher) {
  COMM_OR_SKIP(GetParam());
  EXPECT_EQ(comm->rank(), shared().env.rank);
  EXPECT_EQ(comm->world(), shared().env.world);
  EXPECT_STREQ(comm->name(), comm_kind_name(GetParam()));
  if (comm->world() == 1) std::printf("note: single process, W = 1 semantics only; start W ranks with dmoe launch\n");
}

TEST_P(GpuCommKinds, AlltoallvSmallSegmentsExact) {
  COMM_OR_SKIP(GetParam());
  check_alltoallv(*comm, shared().stream, /*scale=*/1, /*cols=*/3, /*rounds=*/1);
}

TEST_P(GpuCommKinds, AlltoallvLargeSegmentsBackToBackExact) {
  COMM_OR_SKIP(GetParam());
  // Up to ~(3*300 + 3*7) rows x 64 i32 = ~236 KB per segment; five rounds without a host sync between.
  check_alltoallv(*comm, shared().stream, /*scale=*/300, /*cols=*/64, /*rounds=*/5);
}

TEST_P(GpuCommKinds, AlltoallvBf16Bits) {
  COMM_OR_SKIP(GetParam());
  check_alltoallv_bf16(*comm, shared().stream);
}

TEST_P(GpuCommKinds, AllreduceSumAllDtypes) {
  COMM_OR_SKIP(GetParam());
  cudaStream_t s = shared().stream;
  check_allreduce<float>(*comm, s, DType::f32, 1000);
  check_allreduce<double>(*comm, s, DType::f64, 1000);
  check_allreduce<int32_t>(*comm, s, DType::i32, 1000);
  check_allreduce<int64_t>(*comm, s, DType::i64, 1000);
  check_allreduce<int32_t>(*comm, s, DType::i32, 1);
}

TEST_P(GpuCommKinds, AllreduceSumLargerThanStaging) {
  COMM_OR_SKIP(GetParam());
  // NvshmemComm reduces through 16 MiB of staging: 9.4 M floats (37.7 MB) take three chunks, the last one partial
  // and no multiple of the 64-element slices its reduce-scatter splits a chunk into; 2.1 M int64 two chunks.
  check_allreduce<float>(*comm, shared().stream, DType::f32, 9 * (1 << 20) + 12345);
  check_allreduce<int64_t>(*comm, shared().stream, DType::i64, 2 * (1 << 20) + 17);
  // Fewer elements than PEs × 64: some PEs' slices are empty.
  check_allreduce<float>(*comm, shared().stream, DType::f32, 65);
}

TEST_P(GpuCommKinds, BroadcastFromEveryRoot) {
  COMM_OR_SKIP(GetParam());
  for (int32_t root = 0; root < comm->world(); ++root) check_broadcast(*comm, shared().stream, root, 1000 + root);
  check_broadcast(*comm, shared().stream, comm->world() - 1, 2 * (1 << 20) + 5);  // several staging chunks
}

TEST_P(GpuCommKinds, RepeatedBarriers) {
  COMM_OR_SKIP(GetParam());
  for (int i = 0; i < 20; ++i) comm->barrier(shared().stream);
}

TEST_P(GpuCommKinds, BadArgumentsFailOnEveryRankBeforeCommunicating) {
  COMM_OR_SKIP(GetParam());
  cudaStream_t s = shared().stream;
  EXPECT_THROW(comm->allreduce_sum(nullptr, 4, DType::bf16, s), Error);
  EXPECT_THROW(comm->broadcast(nullptr, 4, DType::i32, comm->world(), s), Error);
  if (GetParam() == CommKind::nvshmem) {
    // One segment over max_bytes_per_peer: every rank asks the same, so every rank throws.
    std::vector<int64_t> counts(size_t(comm->world()), int64_t(kMaxBytesPerPeer / 4 + 1));
    try {
      comm->alltoallv(nullptr, counts.data(), nullptr, counts.data(), DType::f32, s);
      ADD_FAILURE() << "expected an error for a segment over max_bytes_per_peer";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_bytes_per_peer"), std::string::npos) << e.what();
    }
  }
  comm->barrier(s);  // still usable afterwards
}

INSTANTIATE_TEST_SUITE_P(GpuComm, GpuCommKinds, ::testing::Values(CommKind::nccl, CommKind::nvshmem),
                         [](const auto& param_info) { return std::string(comm_kind_name(param_info.param)); });

// ---- choosing the communicator -------------------------------------------------------------------------

TEST(GpuCommChoice, ParseCommKind) {
  EXPECT_EQ(parse_comm_kind("auto"), CommKind::automatic);
  EXPECT_EQ(parse_comm_kind("nccl"), CommKind::nccl);
  EXPECT_EQ(parse_comm_kind("nvshmem"), CommKind::nvshmem);
  EXPECT_THROW(parse_comm_kind("mpi"), Error);
}

TEST(GpuCommChoice, AutomaticResolvesByPlacementAndConnectivity) {
  // (gpus_shared, one_node, peers_connected) -> what auto picks.
  EXPECT_EQ(resolve_comm_kind(CommKind::automatic, true, true, true), CommKind::nvshmem);
  EXPECT_EQ(resolve_comm_kind(CommKind::automatic, true, false, false), CommKind::nvshmem);  // NCCL would refuse
  EXPECT_EQ(resolve_comm_kind(CommKind::automatic, false, true, true), CommKind::nvshmem);   // one NVLink node
  EXPECT_EQ(resolve_comm_kind(CommKind::automatic, false, true, false), CommKind::nccl);     // no P2P / unknown
  EXPECT_EQ(resolve_comm_kind(CommKind::automatic, false, false, true), CommKind::nccl);     // several nodes
  // An explicit choice is never overridden (a refusal of NCCL on shared GPUs comes later, with reasons).
  EXPECT_EQ(resolve_comm_kind(CommKind::nccl, true, true, true), CommKind::nccl);
  EXPECT_EQ(resolve_comm_kind(CommKind::nvshmem, false, false, false), CommKind::nvshmem);
}

TEST(GpuCommChoice, ExplicitNcclOnSharedGpusIsRefused) {
  Shared& s = shared();
  if (!s.has_gpu) GTEST_SKIP() << "no GPU visible";
  int visible = 0;
  cudaGetDeviceCount(&visible);
  if (s.env.world == 1 || !gpus_are_shared(s.env, visible))
    GTEST_SKIP() << "ranks do not share GPUs here (start several ranks on one GPU to test this)";
  try {
    make_gpu_comm(s.env, CommKind::nccl, kMaxBytesPerPeer, s.stream);
    ADD_FAILURE() << "expected make_gpu_comm(nccl) to refuse shared GPUs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Duplicate GPU"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dmoe
