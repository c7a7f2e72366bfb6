// dmoe — command-line entry point. Thin: parses arguments and calls the library.
//
//   dmoe init   random weights (and inputs) in safetensors
//   dmoe run    one forward (and backward) of an MoE layer on safetensors inputs
//   dmoe bench  time the engines on a config and print a table
//   dmoe init-model / eval   a whole Mixtral model: random HF checkpoint / forward (+ backward) on tokens
//   dmoe train  train a Mixtral model on byte-level text (CPU)
//   dmoe flow   Flow's schedules on the simulator: simulate (the ablation), tune (Sp, R)
#include <cstdio>
#include <map>

#include "commands.hpp"
#include "core/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"dmoe: distributed Mixture-of-Experts engine (CPU reference; CUDA when built with it)"};
  app.require_subcommand(1);
  std::map<CLI::App*, dmoe::cli::Command> commands;
  auto add = [&](dmoe::cli::Command (*make)(CLI::App&)) {
    const size_t before = app.get_subcommands({}).size();
    dmoe::cli::Command run = make(app);
    commands[app.get_subcommands({})[before]] = run;
  };
  add(dmoe::cli::add_init_command);
  add(dmoe::cli::add_run_command);
  add(dmoe::cli::add_bench_command);
  add(dmoe::cli::add_launch_command);
  add(dmoe::cli::add_init_model_command);
  add(dmoe::cli::add_eval_command);
  add(dmoe::cli::add_train_command);
  add(dmoe::cli::add_flow_command);
  try {
    app.parse(argc, argv);
    for (auto& [sub, run] : commands)
      if (sub->parsed()) return run();
    return 0;
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const dmoe::Error& e) {
    std::fprintf(stderr, "dmoe: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmoe: unexpected error: %s\n", e.what());
    return 2;
  }
}
