#!/usr/bin/env bash
# Installs the dependencies (scripts/install-deps.sh), then builds and runs every test: the normal build (CUDA code compiled when nvcc is present; GPU tests,
# label `gpu`, skip with a message where there is no GPU), its install (scripts/check_install.sh), an
# ASan+UBSan build of the CPU tests and a ThreadSanitizer build of the tests whose code runs as threads.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# On a fresh machine this is the README's one test command: the dependencies first (idempotent, ~2 s when present).
scripts/install-deps.sh

cmake --preset default
cmake --build --preset default -j"$jobs"
ctest --preset default -j"$jobs"
# The installed library and tool as a user meets them: cmake --install, find_package(dmoe) from
# examples/consumer, the installed dmoe with named configs from another directory.
scripts/check_install.sh build

cmake --preset asan
cmake --build --preset asan -j"$jobs" --target dmoe_unit_tests dmoe_cli
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --preset asan -j"$jobs" -L unit

# ThreadSanitizer: ThreadComm's ranks as threads, the fault matrix, the EP and Flash reference engines, Flow's
# executor, the stage board (tests/CMakeLists.txt lists them); any report fails the run.
cmake --preset tsan
cmake --build --preset tsan -j"$jobs" --target dmoe_tsan_tests
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --preset tsan -j"$jobs" -L tsan

# The Python package (pip install . built CPU-only, pytest over tests/python).
scripts/test-python.sh
