// comm.hpp — the communicator every engine talks through.
//
// Implementations: ThreadComm (ranks are threads of one process, buffers in host memory; the CPU
// engine), NcclComm (one GPU per rank) and NvshmemComm (ranks may share a GPU under MPS). Each
// operation is issued on `stream` (a cudaStream_t for the CUDA communicators; ignored by ThreadComm)
// and is collective: every rank of the communicator must call it, in the same order.
//
// Buffers for alltoallv are packed by peer in rank order: the elements for (or from) peer p start at
// the sum of the counts of peers before p.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/fault.hpp"

namespace dmoe {

using Stream = void*;  // cudaStream_t on the CUDA communicators, unused on the CPU

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t world() const = 0;
  virtual const char* name() const = 0;

  // send_counts[p]: elements this rank sends to peer p; recv_counts[p]: elements it receives from p.
  virtual void alltoallv(const void* send, const int64_t* send_counts, void* recv,
                         const int64_t* recv_counts, DType dtype, Stream stream) = 0;
  // In-place element-wise sum over all ranks. Summation is in rank order (deterministic) where the
  // implementation can promise it (ThreadComm does).
  virtual void allreduce_sum(void* data, int64_t count, DType dtype, Stream stream) = 0;
  virtual void broadcast(void* data, int64_t count, DType dtype, int32_t root, Stream stream) = 0;
  virtual void barrier(Stream stream) = 0;

  // Every peer sends count_per_peer elements to every peer (a fixed-size alltoallv).
  void alltoall(const void* send, void* recv, int64_t count_per_peer, DType dtype, Stream stream);

  // Failure handling (fault_point below). enter_stage records the stage this rank enters where its peers
  // can name it in their errors (ThreadComm in its shared state; across processes in the process's stage
  // board, comm/stage_board.hpp, when one is open). abandoned() is true once the other ranks have given up
  // on this one, or one of them failed (ends an injected hang). exit_rank stops this rank as if its process
  // had died: a process exits (code kFaultExitCode); ThreadComm ends the rank's thread.
  virtual void enter_stage(FaultStage stage);
  virtual bool abandoned() const;
  [[noreturn]] virtual void exit_rank(const std::string& why);
};

inline constexpr int kFaultExitCode = 86;

// Called by the engine as it enters each stage: records the stage (enter_stage) and, when DMOE_FAULT
// (core/fault.hpp) names this rank and stage, fails the way it says: throw a dmoe::Error, exit_rank, or
// hang until abandoned() (bounded by 4 × DMOE_COMM_TIMEOUT_S, then a dmoe::Error).
void fault_point(Comm& comm, FaultStage stage);

// Ranks as threads: make_thread_comms(W) returns W communicators sharing one state; give one to each
// thread. Collectives block until all W threads arrive; a thread that throws (or exits, exit_rank)
// poisons the group so the others fail instead of waiting forever, naming the failed rank and its stage;
// every wait is bounded by DMOE_COMM_TIMEOUT_S (the error names the ranks that did not arrive and the
// stages they were last in).
std::vector<std::unique_ptr<Comm>> make_thread_comms(int32_t world);

// Runs fn(rank, comm) on `world` threads with ThreadComms and rethrows the first error (with its rank).
void run_thread_ranks(int32_t world, const std::function<void(int32_t, Comm&)>& fn);
// The same on communicators made by make_thread_comms (kept across calls, e.g. by engines bound to them).
// After a call that failed, the group is poisoned: make new communicators.
void run_thread_ranks(const std::vector<std::unique_ptr<Comm>>& comms, const std::function<void(int32_t, Comm&)>& fn);

}  // namespace dmoe
