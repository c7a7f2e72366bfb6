// dmoe launch — start N local ranks of a command (one process each), relay their output, and tear all of
// them down when one fails. The logic lives in src/comm/launcher.cpp; this file only parses.
//
//   dmoe launch -n 4 -- dmoe_gpu_tests --gtest_filter='GpuComm*'
//   dmoe launch -n 8 --gpus 0 -- dmoe bench ...        (8 ranks on GPU 0 under a private MPS daemon)
#include <sstream>

#include "commands.hpp"
#include "comm/launcher.hpp"
#include "core/error.hpp"
#include "options.hpp"

namespace dmoe::cli {

namespace {

std::vector<int32_t> parse_gpu_list(const std::string& text) {
  std::vector<int32_t> gpus;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    size_t used = 0;
    int value = -1;
    try {
      value = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    DMOE_REQUIRE_INPUT(used == item.size() && !item.empty() && value >= 0,
                       "--gpus '{}' is invalid: expected a comma-separated list of GPU indices such as 0,1,2", text);
    gpus.push_back(value);
  }
  DMOE_REQUIRE_INPUT(!gpus.empty(), "--gpus '{}' is empty: list GPU indices such as 0,1", text);
  // getline drops a trailing empty item: "0," (a typo of "0,1"?) would run every rank on GPU 0.
  DMOE_REQUIRE_INPUT(text.back() != ',', "--gpus '{}' is invalid: it ends in ','; expected a comma-separated list of "
                     "GPU indices such as 0,1,2", text);
  return gpus;
}

}  // namespace

Command add_launch_command(CLI::App& app) {
  struct Options {
    int32_t num_ranks = 0;
    std::string gpus;
    bool no_mps = false;
    std::vector<std::string> command;
  };
  auto o = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand(
      "launch", "start N local ranks of a command: dmoe launch -n N [--gpus 0,1] [--no-mps] -- CMD ARGS...");
  sub->add_option("-n,--ranks", o->num_ranks, "number of ranks (processes) to start")
      ->required()
      ->check(Range(1, 4096));
  sub->add_option("--gpus", o->gpus, "GPU indices dealt round-robin to the ranks (default: all GPUs nvidia-smi lists)");
  sub->add_flag("--no-mps", o->no_mps, "do not start an MPS daemon when ranks share a GPU");
  // The command: everything after `--` lands in this positional untouched, its own options included
  // (CLI11 parses no option after `--`). A command without options may also come without `--`.
  sub->add_option("command", o->command, "the program to run and its arguments (after --)");
  sub->footer("The command follows `--`. Each rank gets DMOE_RANK, DMOE_WORLD, DMOE_LOCAL_RANK, "
              "DMOE_LOCAL_WORLD, DMOE_DEVICE, DMOE_RENDEZVOUS; output lines are prefixed \"[rank R] \". "
              "The ranks' standard input is /dev/null (N ranks cannot share one stream; `echo x | dmoe launch` "
              "gives them nothing): pass input as files.");
  return [o] {
    LaunchOptions options;
    options.num_ranks = o->num_ranks;
    options.use_mps = !o->no_mps;
    if (!o->gpus.empty()) options.gpus = parse_gpu_list(o->gpus);
    options.command = o->command;
    options.end_by_signal = true;  // the exit status says the signal, as a process without the launcher's would
    return launch(options);
  };
}

}  // namespace dmoe::cli
