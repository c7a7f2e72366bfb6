// kill_test_util.hpp — a commit interrupted by a signal, for the unit tests of output files and saves: `work` runs in a
// forked child whose OutputFileSet raises `sig` right after its rename number `after` (0-based;
// core/output_file.hpp's test hook). Returns the child's wait status; a child that finishes `work` exits 3 (4 when it
// throws), so the caller's check that the status is the signal fails when the signal never came.
#pragma once

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstddef>
#include <functional>

#include <gtest/gtest.h>

#include "core/output_file.hpp"

namespace dmoe::test {

inline int run_child_signalled_after_rename(size_t after, int sig, const std::function<void()>& work) {
  const pid_t pid = ::fork();
  EXPECT_GE(pid, 0) << "fork";
  if (pid < 0) return -1;
  if (pid == 0) {
    static size_t rename_at;
    static int signal_to_send;
    rename_at = after;
    signal_to_send = sig;
    set_after_rename_hook_for_tests([](size_t renamed) {
      if (renamed == rename_at) ::raise(signal_to_send);
    });
    try {
      work();
    } catch (...) {
      ::_exit(4);
    }
    ::_exit(3);
  }
  int status = 0;
  EXPECT_EQ(::waitpid(pid, &status, 0), pid);
  return status;
}

}  // namespace dmoe::test
