// nvshmem_comm.cpp — NvshmemComm: the Comm interface over NVSHMEM's host API (puts and collectives on
// streams). Works where NCCL refuses: several ranks on one GPU under MPS (docs: DEVICE.md).
//
// The engine's buffers are plain cudaMalloc memory, which other PEs cannot address, so the communicator
// owns symmetric staging memory (same size on every PE; bytes per PE):
//   recv_slots_   [2][world][slot_bytes_]  slot s of set c receives what PE s sends to this PE in a
//                                       call of parity c (alltoallv calls alternate between the two sets)
//   send_slots_   [world][slot_bytes_]  only when some peer is not load/store reachable (another node):
//                                       a put's source must then be symmetric too
//   scratch_src_, scratch_dst_  [kScratchBytes] each: operands of reductions and broadcasts, which go
//                                       through in chunks of kScratchBytes
//
// allreduce_sum between PEs of one node (every scratch reachable through nvshmem_ptr): reduce-scatter in place
// (PE r sums slice r of every PE's scratch_src_, in PE order, into its scratch_dst_) and an all-gather by copies,
// two barriers a chunk. NVSHMEM's own on-stream reduction, used otherwise, measured 2.4 GB/s for the 80 MB of a
// model's replicated gradients on two PEs sharing an H200 (docs/perf.md).
//   slot_bytes_ = max_bytes_per_peer rounded up to kAlign.
//
// alltoallv: put each segment into its slot of this call's set on the peer (a device copy to
// nvshmem_ptr(peer) when reachable, else nvshmemx_putmem_on_stream), barrier (all puts landed), copy the
// slots into the caller's packed receive buffer. The segment to itself is copied on a side stream while
// the puts run. No barrier is needed before the puts: the set a call writes was last read by the copy-out
// two calls earlier, which every PE's stream finished before entering the previous call's barrier, and
// this PE issues its puts only after that barrier. (Like every collective here, consecutive calls are
// ordered on one stream per PE, or by the host in between.)
#include <exception>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "comm/comm.hpp"
#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/comm_detail.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/peer_reduce.hpp"
#include "core/error.hpp"
#include "cuda/check.hpp"

#if defined(DMOE_WITH_NVSHMEM)
#include <nvshmem_host.h>
#endif

namespace dmoe {

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kScratchBytes = size_t(16) << 20;
// NVSHMEM carves its own buffers (team sync arrays, collective scratch) out of the symmetric heap.
constexpr size_t kNvshmemReserveBytes = size_t(128) << 20;

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

size_t slot_bytes_for(size_t max_bytes_per_peer) { return std::max(kAlign, round_up(max_bytes_per_peer, kAlign)); }

}  // namespace

size_t nvshmem_comm_heap_bytes(int32_t world, size_t max_bytes_per_peer) {
  // Two receive sets, and the send slots (whether they are needed is known only after initialisation).
  return 3 * size_t(world) * slot_bytes_for(max_bytes_per_peer) + 2 * kScratchBytes + kNvshmemReserveBytes;
}

#if defined(DMOE_WITH_NVSHMEM)

namespace {

using comm_detail::wait_stream;

class NvshmemComm final : public Comm {
 public:
  NvshmemComm(const ProcessEnv& env, size_t max_bytes_per_peer, cudaStream_t stream)
      : rank_(env.rank), world_(env.world), max_bytes_per_peer_(max_bytes_per_peer),
        slot_bytes_(slot_bytes_for(max_bytes_per_peer)) {
    init_nvshmem(env, nvshmem_comm_heap_bytes(world_, max_bytes_per_peer));
    // Several PEs on one GPU without MPS (or without an active-thread percentage) give "limited MPG": host
    // collectives then abort the process. Say why, and how to run it, instead.
    // The user's job setup, not a bug: an input error (no source location in the message).
    DMOE_REQUIRE_INPUT(nvshmemx_init_status() != NVSHMEM_STATUS_LIMITED_MPG,
                       "rank {}: NVSHMEM runs with limited multi-PE-per-GPU support, so its collectives would abort: "
                       "ranks sharing a GPU need an MPS daemon and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE set per rank "
                       "(adding up to <= 100). `dmoe launch` does both; under mpirun start MPS yourself and export the "
                       "percentage (mpirun -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50 for two ranks)", rank_);
    recv_slots_ = allocate(2 * set_bytes(), "receive slots");
    scratch_src_ = allocate(kScratchBytes, "reduction scratch");
    scratch_dst_ = allocate(kScratchBytes, "reduction scratch");

    // The reductions' fast path: every PE's scratch is load/store reachable (one node) — sum slices in place.
    peer_reduce_ = world_ > 1 && world_ <= kPeerReduceMaxPes;
    for (int32_t p = 0; p < world_ && peer_reduce_; ++p) {
      peer_src_.pe[p] = p == rank_ ? scratch_src_ : nvshmem_ptr(scratch_src_, p);
      peer_dst_[p] = p == rank_ ? scratch_dst_ : static_cast<char*>(nvshmem_ptr(scratch_dst_, p));
      if (!peer_src_.pe[p] || !peer_dst_[p]) peer_reduce_ = false;
    }
    peer_recv_slots_.resize(size_t(world_), nullptr);
    int local_needs_staging = 0;
    for (int32_t p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      peer_recv_slots_[p] = static_cast<char*>(nvshmem_ptr(recv_slots_, p));
      if (!peer_recv_slots_[p]) local_needs_staging = 1;
    }
    // Allocation is collective: every PE must agree whether send slots exist. Max over PEs.
    int needs_staging = local_needs_staging;
    if (world_ > 1) {
      DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(scratch_src_, &local_needs_staging, sizeof(int), cudaMemcpyHostToDevice, stream));
      DMOE_CHECK_NVSHMEM(nvshmemx_int_max_reduce_on_stream(NVSHMEM_TEAM_WORLD, reinterpret_cast<int*>(scratch_dst_),
                                                           reinterpret_cast<const int*>(scratch_src_), 1, stream));
      DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(&needs_staging, scratch_dst_, sizeof(int), cudaMemcpyDeviceToHost, stream));
      wait_stream(stream, fmt::format("NvshmemComm set-up on rank {}", rank_));
    }
    if (needs_staging) send_slots_ = allocate(set_bytes(), "send slots");
    DMOE_COMM_CHECK_CUDA(cudaStreamCreateWithFlags(&self_stream_, cudaStreamNonBlocking));
    DMOE_COMM_CHECK_CUDA(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
    DMOE_COMM_CHECK_CUDA(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  }

  ~NvshmemComm() override {
    if (!nvshmem_is_initialized()) return;  // finalized already: the heap is gone
    // Unwinding from an error that maybe only this rank saw: nvshmem_free is collective and would wait
    // for peers that may never come, hiding the error. Leave the buffers to process exit instead.
    if (std::uncaught_exceptions() > 0 || cuda::gpu_abandoned()) return;
    // Queued copies may still use the buffers; nvshmem_free itself synchronises the PEs.
    if (!cuda::synchronize_device_quietly()) return;
    cudaEventDestroy(fork_);
    cudaEventDestroy(join_);
    cudaStreamDestroy(self_stream_);
    for (char* p : {send_slots_, scratch_dst_, scratch_src_, recv_slots_})
      if (p) nvshmem_free(p);
  }
  NvshmemComm(const NvshmemComm&) = delete;
  NvshmemComm& operator=(const NvshmemComm&) = delete;

  int32_t rank() const override { return rank_; }
  int32_t world() const override { return world_; }
  const char* name() const override { return "nvshmem"; }

  void alltoallv(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts, DType dtype,
                 Stream stream) override {
    auto* s = static_cast<cudaStream_t>(stream);
    const size_t elem = dtype_size(dtype);
    // Check every segment before anything is sent, so a too-large one fails before any peer is waited on.
    std::vector<size_t> send_off(size_t(world_) + 1, 0), recv_off(size_t(world_) + 1, 0);
    for (int32_t p = 0; p < world_; ++p) {
      DMOE_REQUIRE(send_counts[p] >= 0 && recv_counts[p] >= 0,
                   "NvshmemComm alltoallv: negative count for peer {} (send {}, recv {})", p, send_counts[p],
                   recv_counts[p]);
      const size_t send_bytes = size_t(send_counts[p]) * elem, recv_bytes = size_t(recv_counts[p]) * elem;
      DMOE_REQUIRE(send_bytes <= max_bytes_per_peer_ && recv_bytes <= max_bytes_per_peer_,
                   "NvshmemComm alltoallv on rank {}: the segment {} peer {} needs {} bytes ({} {} elements), more than "
                   "max_bytes_per_peer = {} this communicator was created with; create it with at least {}",
                   rank_, send_bytes > max_bytes_per_peer_ ? "to" : "from", p, std::max(send_bytes, recv_bytes),
                   std::max(send_counts[p], recv_counts[p]), dtype_name(dtype), max_bytes_per_peer_,
                   std::max(send_bytes, recv_bytes));
      DMOE_REQUIRE(p != rank_ || send_counts[p] == recv_counts[p],
                   "NvshmemComm alltoallv on rank {}: the segment to itself must be as long sent as received (send "
                   "count {}, recv count {})", rank_, send_counts[p], recv_counts[p]);
      send_off[p + 1] = send_off[p] + send_bytes;
      recv_off[p + 1] = recv_off[p] + recv_bytes;
    }
    const auto* send_bytes_ptr = static_cast<const char*>(send);
    auto* recv_bytes_ptr = static_cast<char*>(recv);

    const size_t set_offset = size_t(parity_) * set_bytes();  // this call's receive set
    parity_ ^= 1;
    // The segment to itself: on the side stream, beside the puts.
    const size_t self_bytes = send_off[rank_ + 1] - send_off[rank_];
    if (self_bytes > 0) {
      DMOE_COMM_CHECK_CUDA(cudaEventRecord(fork_, s));
      DMOE_COMM_CHECK_CUDA(cudaStreamWaitEvent(self_stream_, fork_, 0));
      DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(recv_bytes_ptr + recv_off[rank_], send_bytes_ptr + send_off[rank_],
                                           self_bytes, cudaMemcpyDeviceToDevice, self_stream_));
      DMOE_COMM_CHECK_CUDA(cudaEventRecord(join_, self_stream_));
    }
    for (int32_t p = 0; p < world_; ++p) {
      const size_t bytes = send_off[p + 1] - send_off[p];
      if (bytes == 0 || p == rank_) continue;
      const size_t slot_offset = set_offset + size_t(rank_) * slot_bytes_;  // my slot on peer p
      if (peer_recv_slots_[p]) {
        DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(peer_recv_slots_[p] + slot_offset, send_bytes_ptr + send_off[p], bytes,
                                             cudaMemcpyDeviceToDevice, s));
      } else {
        char* staged = send_slots_ + size_t(p) * slot_bytes_;
        DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(staged, send_bytes_ptr + send_off[p], bytes, cudaMemcpyDeviceToDevice, s));
        nvshmemx_putmem_on_stream(recv_slots_ + slot_offset, staged, bytes, p, s);
      }
    }
    nvshmemx_barrier_all_on_stream(s);  // completes the puts: every slot addressed to this PE is filled
    for (int32_t p = 0; p < world_; ++p) {
      const size_t bytes = recv_off[p + 1] - recv_off[p];
      if (bytes == 0 || p == rank_) continue;
      const char* from = recv_slots_ + set_offset + size_t(p) * slot_bytes_;
      DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(recv_bytes_ptr + recv_off[p], from, bytes, cudaMemcpyDeviceToDevice, s));
    }
    if (self_bytes > 0) DMOE_COMM_CHECK_CUDA(cudaStreamWaitEvent(s, join_, 0));
  }

  void allreduce_sum(void* data, int64_t count, DType dtype, Stream stream) override {
    DMOE_REQUIRE(dtype != DType::bf16, "NvshmemComm allreduce_sum: bf16 is not supported (sums in bf16 lose precision "
                 "and differ from the CPU engine); reduce in f32, f64, i32 or i64");
    auto* s = static_cast<cudaStream_t>(stream);
    const size_t elem = dtype_size(dtype);
    const int64_t chunk = int64_t(kScratchBytes / elem);
    for (int64_t first = 0; first < count; first += chunk) {
      const int64_t n = std::min(chunk, count - first);
      char* part = static_cast<char*>(data) + size_t(first) * elem;
      DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(scratch_src_, part, size_t(n) * elem, cudaMemcpyDeviceToDevice, s));
      // Every PE has its chunk in scratch_src_, and has copied the previous chunk out of the scratch_dst_ of
      // every PE, before anyone reduces into scratch_dst_ again.
      nvshmemx_barrier_all_on_stream(s);
      if (peer_reduce_) {
        // Reduce-scatter in place: PE r sums slice r of every PE's scratch_src_ (in PE order) into its own
        // scratch_dst_; then, after a barrier, all-gather: every PE copies slice p from PE p's scratch_dst_.
        // Slices are multiples of 64 elements, so every slice but the last starts 256-byte aligned.
        const int64_t slice = ((n + world_ - 1) / world_ + 63) / 64 * 64;
        const int64_t begin = std::min<int64_t>(n, int64_t(rank_) * slice), end = std::min<int64_t>(n, begin + slice);
        peer_reduce_slice(peer_src_, world_, scratch_dst_, begin, end, dtype, s);
        nvshmemx_barrier_all_on_stream(s);  // every slice summed
        for (int32_t p = 0; p < world_; ++p) {
          const int64_t b = std::min<int64_t>(n, int64_t(p) * slice), e = std::min<int64_t>(n, b + slice);
          if (e > b)
            DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(part + size_t(b) * elem, peer_dst_[p] + size_t(b) * elem,
                                                 size_t(e - b) * elem, cudaMemcpyDeviceToDevice, s));
        }
      } else {
        reduce_sum(dtype, size_t(n), s);
        DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(part, scratch_dst_, size_t(n) * elem, cudaMemcpyDeviceToDevice, s));
      }
    }
  }

  void broadcast(void* data, int64_t count, DType dtype, int32_t root, Stream stream) override {
    DMOE_REQUIRE(root >= 0 && root < world_, "NvshmemComm broadcast: root {} outside [0, {})", root, world_);
    auto* s = static_cast<cudaStream_t>(stream);
    const size_t total = size_t(std::max<int64_t>(count, 0)) * dtype_size(dtype);
    for (size_t first = 0; first < total; first += kScratchBytes) {
      const size_t bytes = std::min(kScratchBytes, total - first);
      char* part = static_cast<char*>(data) + first;
      if (rank_ == root)
        DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(scratch_src_, part, bytes, cudaMemcpyDeviceToDevice, s));
      nvshmemx_barrier_all_on_stream(s);  // as in allreduce_sum: scratch_dst_ is free again everywhere
      DMOE_CHECK_NVSHMEM(nvshmemx_broadcastmem_on_stream(NVSHMEM_TEAM_WORLD, scratch_dst_, scratch_src_, bytes, root, s));
      if (rank_ != root) DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(part, scratch_dst_, bytes, cudaMemcpyDeviceToDevice, s));
    }
  }

  void barrier(Stream stream) override {
    auto* s = static_cast<cudaStream_t>(stream);
    nvshmemx_barrier_all_on_stream(s);
    wait_stream(s, fmt::format("NvshmemComm barrier on rank {}", rank_));
  }

 private:
  char* allocate(size_t bytes, const char* what) {
    auto* p = static_cast<char*>(nvshmem_malloc(bytes));
    DMOE_REQUIRE(p, "rank {}: nvshmem_malloc of {} bytes ({}) failed: the symmetric heap is too small (NVSHMEM_SYMMETRIC_SIZE="
                 "{}); raise NVSHMEM_SYMMETRIC_SIZE (this communicator asks for {} bytes in all: {} ranks x {} bytes per "
                 "peer x 2 + scratch) or lower max_bytes_per_peer", rank_, bytes, what,
                 std::getenv("NVSHMEM_SYMMETRIC_SIZE") ? std::getenv("NVSHMEM_SYMMETRIC_SIZE") : "unset",
                 nvshmem_comm_heap_bytes(world_, max_bytes_per_peer_), world_, slot_bytes_);
    return p;
  }

  void reduce_sum(DType dtype, size_t n, cudaStream_t s) {
    switch (dtype) {
      case DType::f32:
        DMOE_CHECK_NVSHMEM(nvshmemx_float_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD, reinterpret_cast<float*>(scratch_dst_),
                                                               reinterpret_cast<const float*>(scratch_src_), n, s));
        return;
      case DType::f64:
        DMOE_CHECK_NVSHMEM(nvshmemx_double_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD,
                                                                reinterpret_cast<double*>(scratch_dst_),
                                                                reinterpret_cast<const double*>(scratch_src_), n, s));
        return;
      case DType::i32:
        DMOE_CHECK_NVSHMEM(nvshmemx_int32_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD,
                                                               reinterpret_cast<int32_t*>(scratch_dst_),
                                                               reinterpret_cast<const int32_t*>(scratch_src_), n, s));
        return;
      case DType::i64:
        DMOE_CHECK_NVSHMEM(nvshmemx_int64_sum_reduce_on_stream(NVSHMEM_TEAM_WORLD,
                                                               reinterpret_cast<int64_t*>(scratch_dst_),
                                                               reinterpret_cast<const int64_t*>(scratch_src_), n, s));
        return;
      case DType::bf16: break;
    }
    DMOE_FAIL("NvshmemComm allreduce_sum: {} is not supported", dtype_name(dtype));
  }

  size_t set_bytes() const { return size_t(world_) * slot_bytes_; }

  int32_t rank_, world_;
  size_t max_bytes_per_peer_, slot_bytes_;
  int parity_ = 0;  // which receive set the next alltoallv writes
  cudaStream_t self_stream_ = nullptr;  // the segment to itself, beside the puts
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  char* recv_slots_ = nullptr;
  char* send_slots_ = nullptr;
  char* scratch_src_ = nullptr;
  char* scratch_dst_ = nullptr;
  std::vector<char*> peer_recv_slots_;  // [world] recv_slots_ of PE p in this process's address space, or null
  bool peer_reduce_ = false;            // every PE's scratch reachable: reductions by peer_reduce_slice
  PeerPointers peer_src_{};             // [world] scratch_src_ of PE p here
  char* peer_dst_[kPeerReduceMaxPes] = {};  // [world] scratch_dst_ of PE p here
};

}  // namespace

std::unique_ptr<Comm> make_nvshmem_comm(const ProcessEnv& env, size_t max_bytes_per_peer, cudaStream_t stream) {
  return std::make_unique<NvshmemComm>(env, max_bytes_per_peer, stream);
}

#else  // !DMOE_WITH_NVSHMEM

std::unique_ptr<Comm> make_nvshmem_comm(const ProcessEnv& env, size_t, cudaStream_t) {
  DMOE_FAIL("rank {}: the NVSHMEM communicator is unavailable: this dmoe was built without NVSHMEM (CMake did not find "
            "it; see cmake/FindNVSHMEM.cmake)", env.rank);
}

#endif

}  // namespace dmoe
