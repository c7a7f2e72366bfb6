#!/usr/bin/env bash
# Installs the dependencies (scripts/install-deps.sh), then builds and runs every test: the normal build (CUDA code compiled when nvcc is present; GPU tests,
# label `gpu`, skip with a message where there is no GPU, there all in one process), its install (scripts/check_install.sh), an
# ASan+UBSan build of the CPU tests and a ThreadSanitizer build of the tests whose code runs as threads, and the
# Python package. Each phase's time is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
timings=()
phase_t0=$SECONDS
phase() {  # phase NAME: the time since the last call is NAME's
  timings+=("$1 $((SECONDS - phase_t0)) s")
  phase_t0=$SECONDS
}
# On a fresh machine this is the README's one test command: the dependencies first (idempotent, ~2 s when present).
scripts/install-deps.sh
phase install-deps

# The Python tests' venv and downloads (torch ~540 MB) go on in the background while the builds compile; the
# package build and pytest run at the end. Its output: build/python-prepare.log.
mkdir -p build
scripts/test-python.sh prepare >build/python-prepare.log 2>&1 &
prepare_pid=$!
trap 'kill $prepare_pid 2>/dev/null || true' EXIT

cmake --preset default
cmake --build --preset default -j"$jobs"
phase "default build"
# Where no GPU is visible (nvidia-smi lists none), every GPU test skips; as one ctest process each, the 630 of them
# spent ~45 s of a 2-core CI run loading cuBLAS and NCCL only to skip. There the GPU binary runs once, in one
# process, and must still exit 0 with each test skipped and saying why; with a GPU each test is its own process.
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  ctest --preset default -j"$jobs"
else
  ctest --preset default -j"$jobs" -LE gpu
  if [ -x build/tests/dmoe_gpu_tests ]; then
    echo "test.sh: no GPU visible: the GPU tests in one process (each skips with its reason)"
    build/tests/dmoe_gpu_tests --gtest_brief=1 | tail -n 3
  fi
fi
phase "default ctest"
# The installed library and tool as a user meets them: cmake --install, find_package(dmoe) from
# examples/consumer, the installed dmoe with named configs from another directory.
scripts/check_install.sh build
phase "install + consumer"

# The sanitizer presets build in unity mode (CMAKE_UNITY_BUILD, 4 sources per unit: fewer repeated header parses
# and template instantiations; file-local names must not clash between sources).
cmake --preset asan
cmake --build --preset asan -j"$jobs" --target dmoe_unit_tests dmoe_cli
phase "asan build"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --preset asan -j"$jobs" -L unit
phase "asan ctest"

# ThreadSanitizer: ThreadComm's ranks as threads, the fault matrix, the EP and Flash reference engines, Flow's
# executor, the stage board (tests/CMakeLists.txt lists them); any report fails the run.
cmake --preset tsan
cmake --build --preset tsan -j"$jobs" --target dmoe_tsan_tests
phase "tsan build"
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ctest --preset tsan -j"$jobs" -L tsan
phase "tsan ctest"

# The Python package (pip install . built CPU-only, pytest over tests/python).
if ! wait $prepare_pid; then
  cat build/python-prepare.log >&2
  echo "test.sh: preparing the Python venv failed (build/python-prepare.log above)" >&2
  exit 1
fi
trap - EXIT
cat build/python-prepare.log
phase "python venv (waited for)"
scripts/test-python.sh test
phase "python package + pytest"
echo "test.sh: all passed; time per phase: $(IFS=';'; echo "${timings[*]}" | sed 's/;/, /g')"
