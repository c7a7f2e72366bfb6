// moe_engine.hpp — MoeEngine: one MoE layer of one rank, whichever engine runs it (issue 12).
//
//   auto engine = make_moe_engine(EngineKind::flash, config, backend, comm, options);   // validates first
//   engine->set_weights(shard);               // gate [E, H] and this rank's experts
//   engine->forward(x, y, ForwardMode::inference);
//   engine->finish();                         // waits; throws if the forward flagged an error
//   const auto ids = engine->expert_ids();
//
// Engines (EngineKind):
//   cpu    EpEngine on a CPU backend (the reference engine; ranks as threads over ThreadComm are the caller's)
//   ep     EpEngine on a CUDA backend (vanilla expert parallelism, forward and backward)
//   flash  FlashEngine: the whole forward as one persistent kernel per rank (bf16); made with
//          options.backward (the default) its train forwards keep their state and backward() runs the Flash
//          backward (a short sequence of launches, cuda::flash_backward); made without, it refuses them
//
// Plain C++ (no CUDA types, as backend.hpp): the CPU build compiles it, and its factory refuses ep and flash
// there. The engines are adapted, not derived from this class: EpEngine stays a concrete class whose phase
// API (forward_route, ...) Flow's executor and the model use directly, and FlashEngine's buffers are sized by
// the token count, which its adapter hides by keeping one FlashEngine per count (moe_engine.cpp,
// flash/flash_moe_engine.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "comm/comm.hpp"
#include "core/config.hpp"
#include "engine/backend.hpp"
#include "engine/ep_engine.hpp"
#include "model/moe_weights.hpp"

namespace dmoe {

enum class EngineKind : uint8_t { cpu, ep, flash };

// "cpu" | "ep" | "flash"; throws a bad-input dmoe::Error naming the allowed values otherwise. (The tool's
// `cuda`/`gpu` are its own aliases of `ep`.)
EngineKind parse_engine_kind(std::string_view name);
const char* engine_kind_name(EngineKind kind);
// Whether this build has the CUDA engines (ep, flash).
bool cuda_engines_built();

struct MoeEngineOptions {
  EpOptions ep;          // how EpEngine moves rows (cpu, ep); Flash has its own protocol
  // The caller will run backward passes (or train forwards). Flash then keeps each forward's state (router
  // probabilities, pre-activations) and the backward's buffers; without it Flash's forwards need less memory and
  // a train forward or backward is refused.
  bool backward = true;
};

// Why `kind` cannot run `config` with `options`, as far as can be told without a GPU ("" when nothing is
// wrong): Flash's dtype (bf16) and drop policy (latest-tokens), and whether this build has the CUDA engines.
// The factory adds what needs the device (Flash's shape limits, flash_unusable_reason).
std::string moe_engine_unusable_reason(EngineKind kind, const MoeConfig& config, const MoeEngineOptions& options);

class MoeEngine {
 public:
  virtual ~MoeEngine() = default;

  virtual EngineKind kind() const = 0;
  const char* name() const { return engine_kind_name(kind()); }
  virtual const MoeConfig& config() const = 0;   // config.tokens: this rank's current token count
  virtual Backend& backend() = 0;                // x, y, dy, dx live in its memory, storage dtype
  virtual bool supports_backward() const = 0;    // false for flash made without options.backward

  // Gate [E, H] and this rank's experts (weights.first_expert == config.first_expert(rank)), copied.
  virtual void set_weights(const MoeWeights& shard) = 0;
  // The same borrowed from the caller (backend memory, storage dtype; see WeightViews): no copy.
  virtual void set_weight_views(const WeightViews& views) = 0;
  // This rank's token count for the following forwards (collective with W > 1).
  virtual void set_tokens(int64_t tokens) = 0;

  // x, y: [T, H]. train keeps what backward needs and computes the router's losses.
  virtual void forward(const void* x, void* y, ForwardMode mode) = 0;
  // dy, dx: [T, H]; adds the parameter gradients (zero_grads starts them over). Once per train forward (Flash:
  // before the next forward).
  virtual void backward(const void* dy, void* dx) = 0;
  virtual void zero_grads() = 0;
  // Gradients on the host: the gate's summed over the ranks, this rank's experts.
  virtual MoeWeights grads() = 0;
  // Waits for the work issued so far and throws if it failed or flagged an error (Flash: NaN router logits).
  virtual void finish() = 0;

  // Routing and row counts of the last forward (host copies; they wait for it).
  virtual std::vector<int32_t> expert_ids() = 0;      // [T, k]
  virtual std::vector<float> expert_weights() = 0;    // [T, k]
  virtual std::vector<int64_t> expert_rows() = 0;     // [Le] rows each local expert computed (EP: padding included)
  virtual int64_t rows_sent_to_peers() = 0;           // rows this rank sent to other ranks (EP: padding included)
  // The router's auxiliary losses of the last train forward.
  virtual RouterLosses losses() = 0;
  // Where the last backward's time went, for engines that record it (flash, after set_stage_timing(true)):
  // (stage, ms between device events), waits for the work issued; empty for the others.
  virtual void set_stage_timing(bool /*on*/) {}
  virtual std::vector<std::pair<std::string, double>> stage_times() { return {}; }
};

// Makes the engine `kind` for this rank: `backend` (CPU backend for cpu, CUDA backend for ep and flash) and
// `comm` (config.world == comm.world(); flash with W > 1 needs the NVSHMEM communicator) outlive it. Validates
// first: a bad-input dmoe::Error that names what is wrong and what is allowed.
std::unique_ptr<MoeEngine> make_moe_engine(EngineKind kind, const MoeConfig& config, Backend& backend, Comm& comm,
                                           const MoeEngineOptions& options = {});

// The Flash adapter, made by make_moe_engine after its host checks (flash/flash_moe_engine.cpp; a build
// without CUDA has a stub that refuses).
std::unique_ptr<MoeEngine> make_flash_moe_engine(const MoeConfig& config, Backend& backend, Comm& comm, bool train);

// The error text every refused Flash train forward / backward of an engine made for forwards only shares.
extern const char* const kFlashForwardOnly;

}  // namespace dmoe
