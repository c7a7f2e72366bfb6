// cli_test_util.hpp — running the `dmoe` binary from a CPU test: its exit status and everything it printed
// (stdout and stderr together).
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace dmoe::test {

struct CliResult {
  int status;          // exit code, -1 when it did not exit normally
  std::string output;  // stdout + stderr
};

// Runs a shell command line (stderr joined to stdout).
inline CliResult run_shell(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  CliResult r{-1, ""};
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// `env`: "NAME=value ..." assignments for the command's environment.
inline CliResult run_cli(const std::string& args, const std::string& env = "") {
  return run_shell((env.empty() ? "" : env + " ") + std::string(DMOE_CLI_PATH) + " " + args);
}

}  // namespace dmoe::test
