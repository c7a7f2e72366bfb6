// commands.hpp — each subcommand registers itself on the app and returns the function that runs it.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace dmoe::cli {

using Command = std::function<int()>;

Command add_init_command(CLI::App& app);
Command add_run_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_launch_command(CLI::App& app);
Command add_init_model_command(CLI::App& app);
Command add_eval_command(CLI::App& app);
Command add_train_command(CLI::App& app);
Command add_flow_command(CLI::App& app);

}  // namespace dmoe::cli
