// dmoe — command-line entry point. Thin: parses arguments and calls the library.
//
//   dmoe init   random weights (and inputs) in safetensors
//   dmoe run    one forward (and backward) of an MoE layer on safetensors inputs
//   dmoe bench  time the engines on a config and print a table
//   dmoe init-model / eval   a whole Mixtral model: random HF checkpoint / forward (+ backward) on tokens
//   dmoe train  train a Mixtral model on byte-level text (CPU)
//   dmoe flow   Flow's schedules on the simulator: simulate (the ablation), tune (Sp, R)
#include <csignal>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <new>
#include <string>

#include <sys/resource.h>

#include "comm/stage_board.hpp"
#include "commands.hpp"
#include "options.hpp"
#include "core/env.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/host_resources.hpp"
#include "flow/cuda_executor.hpp"

#ifndef DMOE_VERSION
#define DMOE_VERSION "unknown"
#endif

#if defined(DMOE_WITH_CUDA)
#define DMOE_ENGINES "engines: cpu, cuda"
#else
#define DMOE_ENGINES "engines: cpu (built without CUDA)"
#endif

namespace {

// A rank of a multi-process job that failed ends at once, without the exit handlers: NVSHMEM's and the
// CUDA runtime's would synchronise with GPU work that waits for peers which will never come, or with peers
// that are themselves stuck, and the launcher (dmoe launch, mpirun) only tears the job down once a rank has
// exited. The stage board records the failure first (comm/stage_board.hpp).
int failed_exit(int code) {
  if (dmoe::process_stage_board() == nullptr) return code;
  dmoe::finish_stage_board();
  std::fflush(nullptr);
  std::_Exit(code);
}

// What a command prints on standard output is its result (bench's table, flow's ablation, the lines naming what
// was written). A write there that failed (a full disk, /dev/full, a closed descriptor) was lost with rc 0.
int check_stdout(int rc) {
  errno = 0;
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int err = errno;
  if (flushed && !std::ferror(stdout) && std::cout.good()) return rc;
  std::fprintf(stderr, "dmoe: error: writing to standard output failed%s%s; what this command printed there is lost "
               "or incomplete\n", err ? ": " : "", err ? std::strerror(err) : "");
  return rc == 0 ? 1 : rc;
}

int run_main(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) { return check_stdout(run_main(argc, argv)); }

namespace {

int run_main(int argc, char** argv) {
  // G15 (sixteenth pass): past a small `ulimit -f`, SIGXFSZ ended dmoe in the middle of a write (its default action,
  // a core dump), leaving the output's temporary behind and saying nothing. Ignored, the write fails with EFBIG
  // instead, which every output path reports (naming the file; the old one kept, the temporary removed).
  ::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"dmoe: distributed Mixture-of-Experts engine (CPU reference; CUDA when built with it)"};
  app.set_version_flag("--version", "dmoe " DMOE_VERSION " (" DMOE_ENGINES ")");
  // --help shows each option's default ("[3]"); options without one show nothing.
  app.option_defaults()->always_capture_default();
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
  // Defaults that say nothing: a required option's placeholder ("=0 REQUIRED"), an empty list ("=[]").
  for (CLI::App* sub : app.get_subcommands({}))
    for (CLI::Option* option : sub->get_options())
      if (option->get_required() || option->get_default_str() == "[]") option->default_str("");
  for (CLI::App* sub : app.get_subcommands({})) dmoe::cli::check_option_values(*sub);
  // CLI11 answers an unknown command ("dmoe bogus", "dmoe trian") with "A subcommand is required", which names
  // neither the word nor the commands.
  std::string names;
  bool known = false;
  for (CLI::App* sub : app.get_subcommands({})) {
    names += (names.empty() ? "" : ", ") + sub->get_name();
    known = known || (argc >= 2 && sub->get_name() == argv[1]);
  }
  if (argc >= 2 && argv[1][0] != '-' && !known) {
    std::fprintf(stderr, "dmoe: error: '%s' is not a dmoe command; allowed: %s (dmoe --help)\n", argv[1],
                 names.c_str());
    return 1;
  }
  // The same for an option before the command ("dmoe --bogus", "dmoe -v"): CLI11 said "A subcommand is required".
  if (argc >= 2 && argv[1][0] == '-') {
    const std::string first = argv[1];
    if (first != "--help" && first != "-h" && first != "--version" && first.rfind("--help=", 0) != 0) {
      std::fprintf(stderr, "dmoe: error: '%s' is not an option of dmoe itself; allowed: --help, --version, or a "
                   "command first: %s (dmoe COMMAND --help)\n", first.c_str(), names.c_str());
      return 1;
    }
  }
  // --version after a command ("dmoe train --version") was answered with that command's first missing option
  // ("--config is required"): it prints the version wherever it stands, as --help prints help. Not for launch, whose
  // command's own options follow it.
  if (known && std::string(argv[1]) != "launch")
    for (int i = 2; i < argc && std::string(argv[i]) != "--"; ++i)
      if (std::string(argv[i]) == "--version") {
        std::printf("dmoe " DMOE_VERSION " (" DMOE_ENGINES ")\n");
        return 0;
      }
  try {
    app.parse(argc, argv);
    for (auto& [sub, run] : commands) {
      if (!sub->parsed()) continue;
      // DMOE_FAULT is read before the work: an invalid one, or one set for a command without fault points, used to
      // be reported only after the command had written its outputs.
      if (sub->get_name() != "launch") {
        (void)dmoe::fault_from_env();
        // Every DMOE_* knob with a fixed set of values, the GPU ones included (core/env.hpp): refused before any work.
        dmoe::check_environment();
        (void)dmoe::flow::chunks_per_gap_from_env(std::getenv("DMOE_FLOW_CHUNKS_PER_GAP"));
        if (sub->get_name() == "init" || sub->get_name() == "init-model")
          dmoe::require_no_fault_injected(sub->get_name());
      }
      const int rc = run();
      // A fault test whose fault never fired must not pass as if the fault had been survived. The launcher's own
      // process runs no rank (its ranks check themselves).
      if (rc == 0 && sub->get_name() != "launch") {
        const std::string unfired = dmoe::unfired_fault(sub->get_name());
        if (!unfired.empty()) {
          std::fprintf(stderr, "dmoe: error: %s\n", unfired.c_str());
          return 1;
        }
      }
      return rc;
    }
    return 0;
  } catch (const CLI::ConversionError& e) {
    const std::string why = dmoe::cli::explain_conversion_error(app, e.what());
    if (why.empty()) return app.exit(e);
    return app.exit(CLI::ConversionError(why));
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const dmoe::Error& e) {
    // Bad input is the message alone; other errors end in their source location (core/error.hpp).
    std::fprintf(stderr, "dmoe: error: %s\n", e.what());
    return failed_exit(1);
  } catch (const std::bad_alloc&) {
    // The hint names the sizes of the command that ran (a whole model's are not the layer flags).
    std::string what = "the problem";
    for (const auto& [sub, run] : commands)
      if (sub->parsed()) what = sub->get_name();
    const bool model = what == "init-model" || what == "eval" || what == "train" || what == "flow";
    // flow simulate and tune have no model: their size is --layers (they were told only the model's sizes).
    const std::string hint =
        !model ? std::string("tokens, hidden, ffn, experts, world")
               : (what == "flow" ? std::string("simulate, tune: --layers, --micro-batches; project, measure: ") : std::string()) +
                     "--batch, --seq (eval: the --tokens shape), or " + dmoe::kModelSizes;
    // Under `ulimit -v` the limit, not the problem's size, is the likelier cause (H13 of the seventeenth pass: a
    // 0.26 M-parameter model's train was told to shrink its --batch): said first.
    struct rlimit as {};
    const std::string limit =
        ::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY
            ? "this process may map at most " + dmoe::format_bytes(double(as.rlim_cur)) +
                  " (ulimit -v; the binary's libraries take ~1 GB of it): raise that limit, or "
            : std::string();
    std::fprintf(stderr, "dmoe: error: out of host memory (std::bad_alloc) in dmoe %s; %smake it smaller (%s)\n",
                 what.c_str(), limit.c_str(), hint.c_str());
    return failed_exit(1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dmoe: unexpected error: %s\n", e.what());
    return failed_exit(2);
  }
}

}  // namespace
