#!/usr/bin/env bash
# Builds and runs every test: the normal build (CUDA code compiled when nvcc is present; GPU tests,
# label `gpu`, skip with a message where there is no GPU) and an ASan+UBSan build of the CPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)

cmake --preset default
cmake --build --preset default -j"$jobs"
ctest --preset default -j"$jobs"

cmake --preset asan
cmake --build --preset asan -j"$jobs" --target dmoe_unit_tests dmoe_cli
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --preset asan -j"$jobs" -L unit

# The Python package (pip install . built CPU-only, pytest over tests/python).
scripts/test-python.sh
