// crash_backtrace.cpp — the GPU test binary prints a backtrace when it crashes (SIGSEGV, SIGBUS, SIGFPE,
// SIGILL, SIGABRT): the GPU machine has no debugger, and a crash there would otherwise say only "signal 11".
// Frames are "binary(+offset)": `addr2line -Cfe build/tests/dmoe_gpu_tests offset` names them on the build
// machine.
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <initializer_list>

namespace {

void on_crash(int sig) {
  const char* head = "dmoe_gpu_tests: fatal signal, backtrace:\n";
  (void)!::write(STDERR_FILENO, head, std::strlen(head));
  void* frames[64];
  const int n = ::backtrace(frames, 64);
  ::backtrace_symbols_fd(frames, n, STDERR_FILENO);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

const bool installed = [] {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) ::signal(sig, on_crash);
  return true;
}();

}  // namespace
