// layer_session.hpp — LayerSession: one MoE layer as a caller outside C++ (the Python module) sees it.
//
// A session owns what an engine needs — backend, communicator, engines — for one MoeConfig and one engine
// kind, and runs forward and backward on raw pointers that the caller owns (weights, activations, gradients;
// no copies of them are made):
//
//   cpu    the reference engine (EpEngine on the CPU backend). With config.world = W > 1 the W ranks are
//          simulated as threads of this process (ThreadComm): the caller holds all ranks' tokens (rank r's
//          T = rows / W at rows [r·T, (r+1)·T)) and all E experts; rank r's engine reads its share in place.
//   ep     EpEngine on the CUDA backend, one rank per process (W = 1, or W processes under dmoe launch,
//          mpirun or srun: detect_process_env; NcclComm or NvshmemComm chosen by make_gpu_comm). The
//          caller holds this rank's tokens, the whole gate and this rank's E/W experts.
//   flash  FlashEngine (CUDA, bf16): inference forwards on one engine per row count, train forwards on a train
//          FlashEngine per pending forward (its backward: FlashEngine::backward, on the session's backend stream,
//          ordered after the caller's stream and before its next work by events; a train forward synchronises
//          the host for its losses, the backward does not).
//
// Token counts change from call to call (config.tokens is ignored). A train forward returns a ticket
// whose engine state stays reserved for the backward of that forward; forwards issued while a ticket is
// pending use another engine (one per pending forward), so several forwards may be in flight before
// their backwards, in any order. All ranks must make the same calls in the same order with the same row
// counts (EpEngine checks the config across ranks when the row count changes).
//
// Pointers: backend memory (host for cpu, device for ep/flash), storage dtype (config.dtype; the CPU
// engine stores f32 and rounds to bf16 when config.dtype is bf16), row-major and contiguous. Gradients
// are written in grad_dtype() (f64 on the CPU, f32 on CUDA; the experts' may be bf16, SessionBackward).
// CUDA calls are asynchronous on the session's stream (set_stream): read their outputs on the host only after
// synchronising it, as for any CUDA work.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "comm/comm.hpp"
#include "core/config.hpp"
#include "engine/backend.hpp"
#include "engine/ep_engine.hpp"
#include "engine/moe_engine.hpp"  // EngineKind, parse_engine_kind, the engines' checks

namespace dmoe {

struct SessionOptions {
  EngineKind engine = EngineKind::cpu;
  EpOptions ep;                // how EpEngine moves rows (cpu, ep)
  int32_t device = -1;         // CUDA device of this rank; -1: choose_device (DMOE_DEVICE, else local rank)
  std::string comm = "auto";   // CUDA, W > 1: auto | nccl | nvshmem (make_gpu_comm)
  int64_t max_tokens = 8192;   // CUDA, W > 1: most rows per forward on this rank (sizes NVSHMEM's staging)
};

struct SessionForward {
  const void* x = nullptr;     // [rows, H] storage dtype
  void* y = nullptr;           // [rows, H] storage dtype
  int64_t rows = 0;            // rows of x this process holds (cpu with W > 1: all ranks' rows)
  bool train = true;           // keep what backward needs (cpu, ep) and compute the auxiliary losses
  WeightViews weights;         // gate [E, H]; experts: all E (cpu), this rank's E/W (ep, flash)
  // Optional outputs (null: not written), backend memory: routing of every row.
  int32_t* expert_ids = nullptr;     // [rows, k]
  float* expert_weights = nullptr;   // [rows, k]
  float* router_logits = nullptr;    // [rows, E] (cpu and ep only)
};

struct SessionBackward {
  int64_t ticket = -1;         // what forward() returned
  const void* dy = nullptr;    // [rows, H] storage dtype
  void* dx = nullptr;          // [rows, H] storage dtype
  // Written (not added to), grad_dtype(), the weights' shapes: the gate's gradient summed over all ranks,
  // the experts' for the experts held here. grads.experts_in_storage_dtype (engines ep and flash, bf16
  // weights): the experts' are bf16 instead, each f32 product rounded once as it is stored (what casting the
  // f32 gradient would give, without writing and reading it); the gate's stays grad_dtype().
  GradViews grads;
};

class LayerSession {
 public:
  // config.tokens is ignored; config.world is the number of ranks. ep/flash with W > 1: collective.
  LayerSession(const MoeConfig& config, const SessionOptions& options);
  ~LayerSession();
  LayerSession(const LayerSession&) = delete;
  LayerSession& operator=(const LayerSession&) = delete;

  EngineKind engine() const { return options_.engine; }
  const MoeConfig& config() const { return config_; }
  int32_t rank() const { return rank_; }          // this process's rank (0 for cpu)
  int32_t world() const { return config_.world; }
  int32_t device() const { return device_; }      // CUDA device, -1 for cpu
  // The experts held here: [first_expert(), first_expert() + held_experts()).
  int32_t first_expert() const;
  int32_t held_experts() const;
  DType grad_dtype() const;
  const char* comm_name() const;

  // CUDA: the stream the following calls issue their work on (a cudaStream_t, may be the null stream);
  // nothing waits for it. The stream must outlive the session, or be replaced by another first: the
  // destructor and buffer releases wait on it. cpu: ignored.
  void set_stream(Stream stream);

  // Runs the forward. train: returns a ticket for backward() (release() it when no backward follows);
  // inference: returns -1.
  int64_t forward(const SessionForward& f);
  void backward(const SessionBackward& b);
  // Frees a train forward's state without a backward (e.g. its autograd graph was dropped). Unknown
  // tickets are ignored (so it can be called from destructors).
  void release(int64_t ticket) noexcept;
  // The auxiliary losses of the train forward behind `ticket` (over all ranks' tokens). ep: the first call
  // after a forward with deferred routing reads (EpOptions) waits for its router's statistics.
  RouterLosses losses(int64_t ticket);
  // Train forwards not yet backward()ed or release()d, and engines kept for reuse (for tests).
  int64_t pending() const;
  int64_t engines() const;

 private:
  struct Slot;
  Slot& take_slot();
  void run_ranks(Slot& slot, const std::function<void(int32_t rank, EpEngine& engine)>& fn);
  int64_t flash_forward(const SessionForward& f);
  void flash_backward(const SessionBackward& b);

  MoeConfig config_;
  SessionOptions options_;
  int32_t rank_ = 0;
  int32_t device_ = -1;
  Stream stream_ = nullptr;
  bool have_stream_ = false;
  // CUDA: one backend and communicator for the process; cpu: per slot (each ThreadComm group is its own).
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Comm> comm_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::map<int64_t, Slot*> tickets_;
  int64_t next_ticket_ = 0;
  struct FlashState;
  std::unique_ptr<FlashState> flash_;
};

}  // namespace dmoe
