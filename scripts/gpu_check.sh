#!/usr/bin/env bash
# The GPU machine's check, in one command (the device lease is short): GPU tests at W = 1 (one process)
# and W = 2, 4, 8 ranks sharing the GPU under MPS (through `dmoe launch` and through `mpirun`), then the
# layer benchmark on every named config with the PyTorch peers, and W = 4, 8 weak scaling.
#
#   scripts/gpu_check.sh BUILD_DIR LOG_DIR [tests|bench|all]
#
# Run from the repository root. Needs the NVSHMEM wheel in the Python on PATH (the GPU machine has it in
# its PyTorch environment). Every step has a time limit; logs go to LOG_DIR, a summary to stdout.
set -u
B=${1:-build}
O=${2:-out/gpu}
WHAT=${3:-all}
mkdir -p "$O"
export DMOE_HOME=$PWD NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 DMOE_COMM_TIMEOUT_S=60
NV=$(python3 -c "import nvidia.nvshmem as m; print(m.__path__[0])" 2>/dev/null)/lib
export LD_LIBRARY_PATH=$NV:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
run() {  # run LIMIT_S NAME CMD...: log to $O/NAME.log, print the verdict lines
  local limit=$1 name=$2
  shift 2
  local t0=$SECONDS
  timeout -k 5 "$limit" "$@" >"$O/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc ($((SECONDS - t0)) s)"
  grep -aE "PASSED|FAILED|SKIPPED \]|rank [0-9]+ failed|error:|Error|^engine|^ep-|^torch-|^ceilings|^F = |roofline" "$O/$name.log" |
    sed -E 's/^\[rank [0-9]+\] //' | sort | uniq -c | sort -rn | head -25
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
git log -1 --format='commit %H' 2>/dev/null || true

if [ "$WHAT" != bench ]; then
  run 300 gpu_tests_w1 "$B/tests/dmoe_gpu_tests" --gtest_brief=1
  DMOE_EXPERT_GEMM=streams run 200 gpu_tests_w1_streams "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
    --gtest_filter='CudaKernels*:*GpuEngine*'
  for n in 2 4 8; do
    run 200 "launch_w$n" "$B/dmoe" launch -n "$n" -- "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
      --gtest_filter='GpuComm*:*GpuEngine*'
  done
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/dmoe-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dmoe-mps/log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  for n in 4 8; do
    run 200 "mpirun_w$n" mpirun --allow-run-as-root --oversubscribe -n "$n" -x LD_LIBRARY_PATH -x DMOE_HOME \
      -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / n)) \
      -x NVSHMEM_DISABLE_NCCL=1 -x NCCL_NVLS_ENABLE=0 -x NVSHMEM_DISABLE_NVLS=1 -x DMOE_COMM_TIMEOUT_S \
      "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='GpuComm*:*GpuEngine*'
  done
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi

if [ "$WHAT" != tests ]; then
  for cfg in decode flash-paper fine-grained mixtral; do
    run 150 "bench_$cfg" "$B/dmoe" bench layer --config "$cfg" --peers --json "$O/bench_$cfg.json"
  done
  # The expert GEMM strategies side by side (src/cuda/gemm.cpp): what auto should pick.
  for cfg in flash-paper fine-grained decode; do
    for mode in grouped loop streams; do
      DMOE_EXPERT_GEMM=$mode run 100 "mode_${cfg}_$mode" "$B/dmoe" bench layer --config "$cfg" --check-tokens 2 \
        --json "$O/mode_${cfg}_$mode.json"
    done
  done
  for n in 4 8; do
    run 150 "bench_flash-paper_w$n" "$B/dmoe" launch -n "$n" -- "$B/dmoe" bench layer --config flash-paper \
      --no-backward --json "$O/bench_flash-paper_w$n.json"
  done
fi
