// thread_comm.cpp — ThreadComm: W ranks as threads of one process, exchanging rows through shared
// host memory. The CPU engine runs on it; so do the multi-rank unit tests in CI.
//
// Every collective is "publish pointers, barrier, read peers, barrier": after the first barrier all
// peers' buffers are visible; the second keeps a peer from reusing its buffer while others still read.
// (allreduce has three: each rank reduces one slice, then all copy the slices.)
// Reductions sum in rank order, so every rank gets the same bits.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "comm/comm.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/host_resources.hpp"

namespace dmoe {

void Comm::alltoall(const void* send, void* recv, int64_t count_per_peer, DType dtype, Stream stream) {
  std::vector<int64_t> counts(world(), count_per_peer);
  alltoallv(send, counts.data(), recv, counts.data(), dtype, stream);
}

namespace {

// Thrown by ThreadComm::exit_rank: the rank's thread ends as if its process had died.
struct RankExited {
  std::string why;
};

// A barrier that fails instead of hanging: when a rank dies (poison) or the wait exceeds the timeout
// (DMOE_COMM_TIMEOUT_S). Every rank's current stage is kept, so that errors name where the failed or
// missing ranks were.
class ThreadGroup {
 public:
  explicit ThreadGroup(int32_t world)
      : send_(world), counts_(world), offsets_(world), data_(world), partials_(world), world_(world), arrived_mask_(size_t(world), 0),
        stages_(size_t(world), FaultStage::none), timeout_(host_wait_timeout_seconds()) {}

  int32_t world() const { return world_; }

  // `closing`: the second barrier of a collective. Every rank that passed the first one is reading its
  // peers' buffers and will arrive here, so a poison (a rank that failed elsewhere) must not make this
  // rank leave early and free a buffer a peer still reads.
  void barrier(int32_t rank, const char* what, bool closing = false) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (poisoned_ && !closing) fail_poisoned(rank, what);
    const uint64_t gen = generation_;
    arrived_mask_[size_t(rank)] = 1;
    if (++arrived_ == world_) {
      arrived_ = 0;
      std::fill(arrived_mask_.begin(), arrived_mask_.end(), 0);
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool done =
        cv_.wait_for(lock, timeout_, [&] { return generation_ != gen || (poisoned_ && !closing); });
    if (generation_ != gen) return;  // everyone arrived: the collective goes on, even if poisoned since
    if (poisoned_) fail_poisoned(rank, what);
    if (!done) {
      // The ranks that never came, with the stage each was last in; the others learn it through the poison.
      std::string missing;
      for (int32_t r = 0; r < world_; ++r)
        if (!arrived_mask_[size_t(r)])
          missing += fmt::format("{}rank {} (last in stage {})", missing.empty() ? "" : ", ", r,
                                 fault_stage_name(stages_[size_t(r)]));
      const std::string cause = fmt::format("rank {} waited {:g} s in {} (stage {}) for {} of {} ranks: {}", rank,
                                            timeout_.count(), what, fault_stage_name(stages_[size_t(rank)]),
                                            world_ - arrived_, world_, missing);
      poison_locked(cause);
      lock.unlock();
      // Not a bug in dmoe: a rank that failed or hangs, or a healthy step longer than the limit (a large model on the
      // CPU engine), so the message says how to raise it.
      DMOE_FAIL_RUN("ThreadComm: {}; the limit is DMOE_COMM_TIMEOUT_S={:g} s: if that rank is only slow (a large "
                    "step on the CPU engine), raise it, e.g. DMOE_COMM_TIMEOUT_S={:g}", cause, timeout_.count(),
                    std::max(600.0, timeout_.count() * 10));
    }
  }

  // `cause` says which rank failed and where; the first cause is the one reported to the others.
  void poison(const std::string& cause) {
    std::lock_guard<std::mutex> lock(mutex_);
    poison_locked(cause);
  }
  bool poisoned() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return poisoned_;
  }
  void enter_stage(int32_t rank, FaultStage stage) {
    std::lock_guard<std::mutex> lock(mutex_);
    stages_[size_t(rank)] = stage;
  }
  FaultStage stage_of(int32_t rank) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stages_[size_t(rank)];
  }

  // Published per collective (valid between the two barriers).
  std::vector<const void*> send_;
  std::vector<const int64_t*> counts_;
  std::vector<const int64_t*> offsets_;
  std::vector<void*> data_;
  std::vector<const void*> partials_;

 private:
  void poison_locked(const std::string& cause) {
    if (!poisoned_) cause_ = cause;
    poisoned_ = true;
    cv_.notify_all();
  }
  // Called with mutex_ held (the caller's unique_lock releases it as the error unwinds).
  [[noreturn]] void fail_poisoned(int32_t rank, const char* what) {
    DMOE_FAIL_RUN("ThreadComm: {} aborted on rank {}: another rank failed: {}", what, rank, cause_);
  }

  int32_t world_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  int32_t arrived_ = 0;
  std::vector<char> arrived_mask_;   // [W] arrived at the current generation's barrier
  std::vector<FaultStage> stages_;   // [W] the stage each rank last entered
  uint64_t generation_ = 0;
  bool poisoned_ = false;
  std::string cause_;
  std::chrono::duration<double> timeout_;
};

template <typename T>
void sum_in_rank_order(const std::vector<void*>& data, int32_t world, int64_t count, T* out) {
  for (int64_t i = 0; i < count; ++i) {
    T acc = static_cast<const T*>(data[0])[i];
    for (int32_t r = 1; r < world; ++r) acc += static_cast<const T*>(data[r])[i];
    out[i] = acc;
  }
}

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<ThreadGroup> group, int32_t rank) : group_(std::move(group)), rank_(rank) {}

  int32_t rank() const override { return rank_; }
  int32_t world() const override { return group_->world(); }
  const char* name() const override { return "thread"; }

  void alltoallv(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                 DType dtype, Stream) override {
    const size_t elem = dtype_size(dtype);
    // Where each peer's elements start in this rank's send buffer, published so that a receiver finds
    // its segment in O(1): summing the sender's counts per receiver made the exchange O(W^3) over all
    // ranks (minutes at W = 4096).
    send_offsets_.resize(size_t(world()));
    int64_t offset = 0;
    for (int32_t p = 0; p < world(); ++p) {
      send_offsets_[size_t(p)] = offset;
      offset += send_counts[p];
    }
    group_->send_[rank_] = send;
    group_->counts_[rank_] = send_counts;
    group_->offsets_[rank_] = send_offsets_.data();
    group_->barrier(rank_, "alltoallv");
    // NOTE: nothing may throw between the two barriers (a peer may be reading this rank's buffers);
    // a mismatch is reported after the closing barrier.
    std::string mismatch;
    int64_t recv_offset = 0;
    for (int32_t p = 0; p < world(); ++p) {
      const int64_t* peer_counts = group_->counts_[p];
      const int64_t peer_offset = group_->offsets_[p][rank_];
      if (peer_counts[rank_] != recv_counts[p]) {
        if (mismatch.empty())
          mismatch = fmt::format("ThreadComm alltoallv: rank {} expects {} elements from rank {}, which sends {}",
                                 rank_, recv_counts[p], p, peer_counts[rank_]);
        recv_offset += recv_counts[p];
        continue;
      }
      if (recv_counts[p] > 0)
        std::memcpy(static_cast<char*>(recv) + recv_offset * elem,
                    static_cast<const char*>(group_->send_[p]) + peer_offset * elem,
                    size_t(recv_counts[p]) * elem);
      recv_offset += recv_counts[p];
    }
    group_->barrier(rank_, "alltoallv", /*closing=*/true);
    if (!mismatch.empty()) DMOE_FAIL("{}", mismatch);
  }

  // Reduce-scatter, then all-gather: rank r sums its slice [count·r/W, count·(r+1)/W) over all ranks (in
  // rank order, so every rank gets the same bits), then every rank copies all slices. O(count) per rank;
  // every rank summing everything was O(W·count) per rank, which at W = E = 1024 took most of a forward.
  void allreduce_sum(void* data, int64_t count, DType dtype, Stream) override {
    DMOE_REQUIRE(dtype != DType::bf16, "ThreadComm allreduce: bf16 is not supported; reduce in f32 or f64");
    const size_t elem = dtype_size(dtype);
    const int64_t lo = count * rank_ / world(), hi = count * (rank_ + 1) / world();
    partial_.resize(size_t(hi - lo) * elem);
    std::vector<void*> slices(static_cast<size_t>(world()));  // allocated here: nothing may throw below
    group_->data_[rank_] = data;
    group_->barrier(rank_, "allreduce");
    for (int32_t r = 0; r < world(); ++r) slices[size_t(r)] = static_cast<char*>(group_->data_[r]) + lo * elem;
    switch (dtype) {
      case DType::f32: sum_in_rank_order(slices, world(), hi - lo, reinterpret_cast<float*>(partial_.data())); break;
      case DType::f64: sum_in_rank_order(slices, world(), hi - lo, reinterpret_cast<double*>(partial_.data())); break;
      case DType::i32: sum_in_rank_order(slices, world(), hi - lo, reinterpret_cast<int32_t*>(partial_.data())); break;
      case DType::i64: sum_in_rank_order(slices, world(), hi - lo, reinterpret_cast<int64_t*>(partial_.data())); break;
      case DType::bf16: break;  // rejected above
    }
    group_->partials_[rank_] = partial_.data();
    // NOTE: closing semantics for the middle barrier too: peers may still read this rank's data.
    group_->barrier(rank_, "allreduce", /*closing=*/true);
    // Every rank has read every `data` (first phase): each may now overwrite its own with the result.
    for (int32_t r = 0; r < world(); ++r) {
      const int64_t rlo = count * r / world(), rhi = count * (r + 1) / world();
      if (rhi > rlo) std::memcpy(static_cast<char*>(data) + rlo * elem, group_->partials_[r], size_t(rhi - rlo) * elem);
    }
    group_->barrier(rank_, "allreduce", /*closing=*/true);
  }

  void broadcast(void* data, int64_t count, DType dtype, int32_t root, Stream) override {
    DMOE_REQUIRE(root >= 0 && root < world(), "ThreadComm broadcast: root {} outside [0, {})", root, world());
    group_->data_[rank_] = data;
    group_->barrier(rank_, "broadcast");
    if (rank_ != root) std::memcpy(data, group_->data_[root], size_t(count) * dtype_size(dtype));
    group_->barrier(rank_, "broadcast", /*closing=*/true);
  }

  void barrier(Stream) override { group_->barrier(rank_, "barrier"); }

  void enter_stage(FaultStage stage) override { group_->enter_stage(rank_, stage); }
  bool abandoned() const override { return group_->poisoned(); }
  [[noreturn]] void exit_rank(const std::string& why) override { throw RankExited{why}; }

  // Marks the group failed: the others stop at their next wait with `cause`.
  void poison(const std::string& cause) { group_->poison(cause); }
  FaultStage stage() const { return group_->stage_of(rank_); }

 private:
  std::shared_ptr<ThreadGroup> group_;
  int32_t rank_;
  std::vector<int64_t> send_offsets_;  // [W] of the current alltoallv (read by peers between its barriers)
  std::vector<char> partial_;          // this rank's slice of the current allreduce's sum (read by peers)
};

}  // namespace

std::vector<std::unique_ptr<Comm>> make_thread_comms(int32_t world) {
  DMOE_REQUIRE(world >= 1, "ThreadComm: world = {} is invalid; must be >= 1", world);
  auto group = std::make_shared<ThreadGroup>(world);
  std::vector<std::unique_ptr<Comm>> comms;
  for (int32_t r = 0; r < world; ++r) comms.push_back(std::make_unique<ThreadComm>(group, r));
  return comms;
}

void run_thread_ranks(int32_t world, const std::function<void(int32_t, Comm&)>& fn) {
  auto comms = make_thread_comms(world);
  run_thread_ranks(comms, fn);
}

void run_thread_ranks(const std::vector<std::unique_ptr<Comm>>& comms, const std::function<void(int32_t, Comm&)>& fn) {
  const int32_t world = int32_t(comms.size());
  for (const auto& c : comms)
    DMOE_REQUIRE(c && dynamic_cast<ThreadComm*>(c.get()) != nullptr && c->world() == world,
                 "run_thread_ranks: the communicators must be the {} of one make_thread_comms({})", world, world);
  std::vector<std::exception_ptr> errors(world);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < world; ++r) try {
    threads.emplace_back([&, r] {
      error_rank() = world > 1 ? r : -1;
      auto& comm = static_cast<ThreadComm&>(*comms[r]);
      try {
        fn(r, comm);
      } catch (const RankExited& exited) {
        // A rank that stops without an error of its own: the run fails all the same, naming it.
        errors[r] = std::make_exception_ptr(Error(fmt::format("[rank {}] {}", r, exited.why)));
        comm.poison(fmt::format("rank {} exited in stage {}", r, fault_stage_name(comm.stage())));
      } catch (const std::exception& e) {
        errors[r] = std::current_exception();
        comm.poison(fmt::format("rank {} failed in stage {}: {}", r, fault_stage_name(comm.stage()), e.what()));
      } catch (...) {
        errors[r] = std::current_exception();
        comm.poison(fmt::format("rank {} failed in stage {}", r, fault_stage_name(comm.stage())));
      }
    });
  } catch (const std::system_error& e) {
    // The ranks already running would wait for this one forever; stop them, and say which limit was met.
    static_cast<ThreadComm&>(*comms[0]).poison(fmt::format("rank {} could not be started", r));
    for (auto& t : threads) t.join();
    fail_thread_start(e, fmt::format("the thread of simulated rank {} of {}", r, world));
  }
  for (auto& t : threads) t.join();
  // Report the root cause: a rank's own error before the "another rank failed" ones it caused.
  std::exception_ptr first;
  for (int32_t r = 0; r < world && !first; ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const Error& e) {
      if (std::string(e.what()).find("another rank failed") == std::string::npos) first = errors[r];
    } catch (...) {
      first = errors[r];
    }
  }
  for (int32_t r = 0; r < world && !first; ++r)
    if (errors[r]) first = errors[r];
  if (first) std::rethrow_exception(first);
}

}  // namespace dmoe
