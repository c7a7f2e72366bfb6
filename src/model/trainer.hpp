// trainer.hpp — training a Mixtral model on the CPU: byte-level text data, AdamW with global gradient
// clipping, linear warm-up + cosine decay, held-out validation, JSON-lines log, checkpoints with exact resume.
//
// Data: the bytes of a text file are the tokens (vocab_size >= 256). The last val_fraction of the file is
// held out. Step t's batch is B windows of seq bytes at offsets drawn from Rng(seed, t) over the training
// part, so a resumed run sees exactly the batches the uninterrupted one would have. Validation uses fixed,
// evenly spaced windows of the held-out part.
//
// Optimizer: AdamW (cpu::adamw_step) on every tensor, weight decay on matrices only (not RMSNorm weights),
// gradients clipped to a global norm first (over all ranks' experts and the replicated tensors once).
// lr(t) = lr·t/warmup for t <= warmup, then min_lr + (lr − min_lr)·(1 + cos(π·(t − warmup)/(steps − warmup)))/2;
// with warmup 0: min_lr + (lr − min_lr)·(1 + cos(π·(t − 1)/(steps − 1)))/2 (the peak at step 1; lr for one step).
//
// W ranks (threads + ThreadComm): the global batch is split B/W sequences per rank, replicated tensors see
// the same summed gradients and the same AdamW arithmetic on every rank (so they stay identical), experts
// are sharded E/W. Checkpoints are whole models (HF names): DIR/model.safetensors, DIR/config.json,
// DIR/optimizer.safetensors (exp_avg.<name>, exp_avg_sq.<name>), DIR/trainer_state.json (step, seed, …).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "model/mixtral_config.hpp"
#include "model/mixtral_weights.hpp"

namespace dmoe {

struct TrainOptions {
  std::string data_path;      // text file; its bytes are the tokens
  int64_t steps = 100;        // length of the schedule (steps counted from 1; a resumed run continues to it)
  int64_t stop_after = 0;     // > 0: stop (and save) after this step, keeping the schedule of `steps`
  int64_t seq = 64;
  int64_t batch = 8;          // global: sequences per step over all ranks
  int32_t world = 1;
  int32_t micro_batches = 1;  // R: each rank's share runs as R micro-batches (all forwards, then all
                              // backwards, each with its own ModelState; gradients averaged). The aux loss's
                              // statistics are then per micro-batch, as HF computes them per forward call.
  double lr = 3e-3, min_lr = -1;  // min_lr < 0: lr / 10
  int64_t warmup = 10;
  double weight_decay = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double clip = 1.0;          // max global gradient norm; 0 = no clipping
  double val_fraction = 0.1;
  int64_t val_every = 0;      // 0: validate at the end only
  int64_t val_batches = 4;    // windows evaluated = val_batches · batch
  uint64_t seed = 1;          // data order (and the random init)
  std::string init = "random";  // "random" or a model.safetensors / index.json to start from
  std::string resume_dir;     // continue the run saved here (weights, moments, step)
  std::string save_dir;       // write a checkpoint here at the end (and every save_every steps)
  int64_t save_every = 0;
  std::string log_path;       // JSON lines
  int64_t print_every = 1;    // progress line on stdout; 0: none
  std::string engine = "cpu"; // cpu: W ranks as threads in this process; cuda: this process is one rank of a GPU
                              // job (dmoe launch / mpirun / srun, or alone) and `world` must be the job's size
  DType dtype = DType::f32;   // cuda: the model's storage (f32 or bf16; f32 master weights and moments either way)
  // Flow (docs/flow.md): empty runs the loop below (R forwards, R backwards from r = R−1 down, one all-reduce);
  // vanilla | pipe-moe | pipe-attn | chunked-ar runs each step as one task graph on the engine's Flow executor (cpu:
  // flow/cpu_executor.hpp, three threads per rank; cuda: flow/cuda_executor.hpp, three streams; backwards
  // r = 0..R−1, so the gradients differ from the empty schedule's in the last bits). tuned: the first
  // steps sample the vanilla graph once, then (Sp, R) of chunked-ar with the Bayesian tuner (flow/tuner.hpp),
  // tune_steps timed steps after one warm-up step per sample, all of them real training steps; then the fastest
  // sample (vanilla included) for the rest of the run.
  std::string schedule;
  int64_t chunk_bytes = int64_t(1) << 20;  // Sp of chunked-ar
  int32_t tune_samples = 8;                // tuned: samples (the vanilla baseline, then tune_samples − 1 points)
  int32_t tune_steps = 3;                  // tuned: timed steps per point (after one warm-up step)
  std::string tune_file;                   // tuned: samples and choice as JSON, one entry per run shape (model,
                                           // batch, seq, world, dtype): this shape's is reused without tuning
  // cuda, bf16: keep the experts' gradients f32 where bf16_expert_grads_for_training (train_replica.hpp) would make
  // them bf16 (dmoe train --f32-expert-grads; the reference run of the GPU tests; dmoe bench model's flag of that name).
  bool f32_expert_grads = false;
  // Options whose value a bare --resume took from the saved trainer_state.json ("--seq", "--min-lr", ...; dmoe train's
  // adopt_saved_settings): their errors name the state file and its key, not an option the user did not give.
  std::set<std::string> from_state;
};

struct TrainRecord {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0;
  double val_loss = -1;  // >= 0 where validation ran after this step
};

struct TrainResult {
  std::vector<TrainRecord> records;  // one per step run
  MixtralWeights weights;            // final, all experts
  double final_val_loss = -1;
  bool bf16_expert_grads = false;    // the GPU model kept its experts' gradients in bf16 (TrainReplica's answer)
};

// The learning rate of step t (1-based).
double scheduled_lr(const TrainOptions& o, int64_t step);

// The journal of a checkpoint's commit (`--save DIR`): a save killed between its renames (SIGKILL, out of memory) is
// completed from it by complete_interrupted_save(DIR, LOG), which every rank of a resumed run calls before reading the
// checkpoint (safe when several do). A new run's --log published with that save is completed too, only onto `log_path`
// (the resuming run's --log) where it is the same file; "" completes the checkpoint alone. Returns a note for the
// user, or "" when there was nothing to complete.
inline constexpr const char* kCheckpointJournal = ".dmoe-commit.json";
std::string complete_interrupted_save(const std::string& dir, const std::string& log_path);

// Runs the training; prints progress lines via `print` (null: stdout). With engine cuda and W > 1 ranks every
// process calls it (collective); rank 0 prints, logs and saves.
TrainResult train_mixtral(const MixtralConfig& config, const TrainOptions& options,
                          const std::function<void(const std::string&)>& print = nullptr);

}  // namespace dmoe
