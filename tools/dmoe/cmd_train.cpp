// dmoe train — train a Mixtral model on the CPU engine from byte-level text (see src/model/trainer.hpp).
//
//   dmoe train --config tiny --data /usr/share/common-licenses --steps 200 --seq 64 --batch 8
//         [--world W] [--init random|CKPT] [--resume DIR] [--save DIR] [--log FILE] [--lr 3e-3] ...
#include <cstdio>

#include "commands.hpp"
#include "core/error.hpp"
#include "model/mixtral_config.hpp"
#include "model/trainer.hpp"
#include "options.hpp"

namespace dmoe::cli {

Command add_train_command(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  auto config = std::make_shared<std::string>();
  auto engine = std::make_shared<std::string>("cpu");
  CLI::App* sub = app.add_subcommand("train", "train a Mixtral model on byte-level text (CPU engine)");
  sub->add_option("--config", *config, "HF Mixtral config.json or a named model in bench/models (e.g. tiny)")
      ->required();
  sub->add_option("--data", o->data_path, "text file (or a directory of them) whose bytes are the tokens, e.g. "
                  "/usr/share/common-licenses (Debian base-files)")->required();
  sub->add_option("--steps", o->steps, "last training step")->check(CLI::PositiveNumber);
  sub->add_option("--stop-after", o->stop_after, "stop (and save) after this step of the --steps schedule")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--seq", o->seq, "sequence length")->check(CLI::Range(2, 1 << 20));
  sub->add_option("--batch", o->batch, "sequences per step over all ranks")->check(CLI::PositiveNumber);
  sub->add_option("--world", o->world, "simulated ranks (batch split, experts sharded E/W)")->check(CLI::PositiveNumber);
  sub->add_option("--micro-batches", o->micro_batches, "split each rank's share into R micro-batches (all "
                  "forwards, then all backwards; gradients averaged)")->check(CLI::PositiveNumber);
  sub->add_option("--engine", *engine, "cpu (the only training engine so far)");
  sub->add_option("--init", o->init, "random, or a model.safetensors / index.json to start from");
  sub->add_option("--resume", o->resume_dir, "continue the run saved in this directory (exact resume)");
  sub->add_option("--save", o->save_dir, "write a checkpoint here at the end (and every --save-every steps)");
  sub->add_option("--save-every", o->save_every, "also save every N steps")->check(CLI::NonNegativeNumber);
  sub->add_option("--log", o->log_path, "JSON-lines log: {step, loss, lr, grad_norm, tokens_per_s}, {step, val_loss}");
  sub->add_option("--lr", o->lr, "peak learning rate");
  sub->add_option("--min-lr", o->min_lr, "final learning rate of the cosine (default lr/10)");
  sub->add_option("--warmup", o->warmup, "linear warm-up steps")->check(CLI::NonNegativeNumber);
  sub->add_option("--weight-decay", o->weight_decay, "AdamW decoupled weight decay (matrices only)");
  sub->add_option("--beta1", o->beta1);
  sub->add_option("--beta2", o->beta2);
  sub->add_option("--clip", o->clip, "max global gradient norm (0: none)")->check(CLI::NonNegativeNumber);
  sub->add_option("--val-fraction", o->val_fraction, "held-out tail of the data");
  sub->add_option("--val-every", o->val_every, "validate every N steps (and at the end)")->check(CLI::NonNegativeNumber);
  sub->add_option("--val-batches", o->val_batches, "held-out windows = val-batches x batch")->check(CLI::PositiveNumber);
  sub->add_option("--seed", o->seed, "data order and random init");
  sub->add_option("--print-every", o->print_every, "progress line every N steps (0: none)")->check(CLI::NonNegativeNumber);
  return [o, config, engine] {
    DMOE_REQUIRE(*engine == "cpu", "--engine {}: training runs on the CPU engine only (allowed: cpu)", *engine);
    const MixtralConfig c = load_mixtral_config(find_model_config_file(*config));
    const TrainResult r = train_mixtral(c, *o);
    if (!r.records.empty())
      std::printf("done: step %lld loss %.4f val loss %.4f%s%s\n", (long long)r.records.back().step,
                  r.records.back().loss, r.final_val_loss, o->save_dir.empty() ? "" : " | saved ",
                  o->save_dir.c_str());
    return 0;
  };
}

}  // namespace dmoe::cli
