// ThreadComm: data movement must be exact. Payloads encode (source rank, destination rank, index).
#include <gtest/gtest.h>

#include <atomic>

#include "comm/comm.hpp"
#include "core/error.hpp"

namespace dmoe {
namespace {

int64_t payload(int32_t src, int32_t dst, int64_t i) { return (int64_t(src) << 40) | (int64_t(dst) << 20) | i; }
// Rank src sends (src + 2*dst) % 5 elements to dst: uneven, and sometimes zero.
int64_t count_of(int32_t src, int32_t dst) { return (src + 2 * dst) % 5; }

class ThreadCommWorld : public ::testing::TestWithParam<int32_t> {};

TEST_P(ThreadCommWorld, AlltoallvMovesEveryElementExactly) {
  const int32_t world = GetParam();
  run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
    std::vector<int64_t> send_counts(world), recv_counts(world), send, recv;
    for (int32_t p = 0; p < world; ++p) {
      send_counts[p] = count_of(rank, p);
      recv_counts[p] = count_of(p, rank);
      for (int64_t i = 0; i < send_counts[p]; ++i) send.push_back(payload(rank, p, i));
    }
    int64_t total = 0;
    for (auto c : recv_counts) total += c;
    recv.assign(total, -1);
    comm.alltoallv(send.data(), send_counts.data(), recv.data(), recv_counts.data(), DType::i64, nullptr);
    int64_t at = 0;
    for (int32_t p = 0; p < world; ++p)
      for (int64_t i = 0; i < recv_counts[p]; ++i, ++at)
        ASSERT_EQ(recv[at], payload(p, rank, i)) << "rank " << rank << " from " << p << " element " << i;
  });
}

TEST_P(ThreadCommWorld, AllreduceIsExactAndIdenticalOnEveryRank) {
  const int32_t world = GetParam();
  std::vector<std::vector<double>> results(world);
  run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
    std::vector<double> v(7);
    for (int i = 0; i < 7; ++i) v[i] = 0.1 * (rank + 1) * (i + 1);
    comm.allreduce_sum(v.data(), 7, DType::f64, nullptr);
    std::vector<int64_t> n(3, rank);
    comm.allreduce_sum(n.data(), 3, DType::i64, nullptr);
    EXPECT_EQ(n[0], int64_t(world) * (world - 1) / 2);
    results[rank] = v;
  });
  for (int i = 0; i < 7; ++i) {
    double expect = 0;  // rank order, as ThreadComm promises
    for (int r = 0; r < world; ++r) expect += 0.1 * (r + 1) * (i + 1);
    for (int r = 0; r < world; ++r) EXPECT_EQ(results[r][i], expect);
  }
}

TEST_P(ThreadCommWorld, BroadcastFromEveryRoot) {
  const int32_t world = GetParam();
  for (int32_t root = 0; root < world; ++root)
    run_thread_ranks(world, [&](int32_t rank, Comm& comm) {
      std::vector<int32_t> v(5, rank == root ? 100 + root : -1);
      comm.broadcast(v.data(), 5, DType::i32, root, nullptr);
      for (int x : v) EXPECT_EQ(x, 100 + root);
    });
}

INSTANTIATE_TEST_SUITE_P(Worlds, ThreadCommWorld, ::testing::Values(1, 2, 3, 4, 8));

TEST(ThreadComm, FailingRankStopsTheOthersWithItsError) {
  std::atomic<int> others_failed{0};
  try {
    run_thread_ranks(4, [&](int32_t rank, Comm& comm) {
      if (rank == 2) DMOE_FAIL("rank two broke");
      try {
        comm.barrier(nullptr);
      } catch (const Error&) {
        ++others_failed;
        throw;
      }
    });
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank two broke"), std::string::npos) << e.what();
  }
  EXPECT_EQ(others_failed.load(), 3);
}

TEST(ThreadComm, MismatchedCountsAreReported) {
  EXPECT_THROW(run_thread_ranks(2,
                                [&](int32_t rank, Comm& comm) {
                                  std::vector<int64_t> sc{1, 1}, rc{1, rank == 0 ? 2 : 1};
                                  std::vector<int32_t> s(2), r(3);
                                  comm.alltoallv(s.data(), sc.data(), r.data(), rc.data(), DType::i32, nullptr);
                                }),
               Error);
}

}  // namespace
}  // namespace dmoe
