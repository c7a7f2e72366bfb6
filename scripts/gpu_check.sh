#!/usr/bin/env bash
# The GPU machine's check, in one command (the device lease is short): GPU tests at W = 1 (one process)
# and W = 2, 4, 8 ranks sharing the GPU under MPS (through `dmoe launch` and through `mpirun`), then the
# layer benchmark on every named config with the PyTorch peers, and W = 4, 8 weak scaling.
#
#   scripts/gpu_check.sh BUILD_DIR LOG_DIR [PARTS]
#
# PARTS: comma-separated, run in the order given: tests (one process), multi (W = 2, 4, 8 ranks), modes
# (expert-GEMM strategies side by side), bench (named configs with the PyTorch peers, weak scaling), quick
# (named configs, forward only, no peers), gemm (the own GEMM's variants and its DRAM traffic),
# profile (per-kernel times under Nsight Compute), gpus (one rank per GPU on a multi-GPU machine),
# flash (the Flash kernel at W = 1: its tests, and its benchmark beside EP), flash_multi (Flash at W = 2, 4
# ranks on the GPU);
# all = tests,multi,bench,modes (default).
#
# Run from the repository root. Needs the NVSHMEM wheel in the Python on PATH (the GPU machine has it in
# its PyTorch environment). Every step has a time limit; logs go to LOG_DIR, a summary to stdout.
set -u
B=${1:-build}
O=${2:-out/gpu}
WHAT=${3:-all}
[ "$WHAT" = all ] && WHAT=tests,multi,bench,modes
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
  grep -aE "PASSED|FAILED|SKIPPED \]|rank [0-9]+ failed|error:|Error|^engine|ep-|^flash|^torch-|ceilings|F = |all-to-all|link ceiling|^b[0-9]+|dram__|lts__t_sector|gpu__time" "$O/$name.log" |
    sed -E 's/^\[rank [0-9]+\] //' | sort | uniq -c | sort -rn | head -25
}

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
git log -1 --format='commit %H' 2>/dev/null || true

part_tests() {
  # dmoe's own Hopper GEMM first, alone: a fault there would poison the CUDA context of later tests.
  run 120 gpu_tests_own_gemm "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*CudaKernelsOwnGemm*'
  run 300 gpu_tests_w1 "$B/tests/dmoe_gpu_tests" --gtest_brief=1
  # The same kernels and engine with cuBLAS's grouped GEMM instead of the own one.
  DMOE_EXPERT_GEMM=grouped run 200 gpu_tests_w1_cublas "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
    --gtest_filter='*CudaKernels*:*GpuEngine*'
  # The CLI tests: `dmoe run --engine cuda` against `--engine cpu` where a GPU is present.
  run 200 cli_tests "$B/tests/dmoe_unit_tests" --gtest_brief=1 --gtest_filter='Cli*'
}

part_multi() {
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
}

part_bench() {
  for cfg in decode flash-paper fine-grained mixtral; do
    run 150 "bench_$cfg" "$B/dmoe" bench layer --config "$cfg" --peers --json "$O/bench_$cfg.json"
  done
  for n in 4 8; do
    run 150 "bench_flash-paper_w$n" "$B/dmoe" launch -n "$n" -- "$B/dmoe" bench layer --config flash-paper \
      --no-backward --alltoall --json "$O/bench_flash-paper_w$n.json"
  done
}

part_quick() {
  # The named configs' forward alone (no peers, no backward): the check after a kernel change.
  for cfg in decode flash-paper fine-grained mixtral; do
    run 100 "quick_$cfg" "$B/dmoe" bench layer --config "$cfg" --check-tokens 4 --no-backward \
      --json "$O/quick_$cfg.json"
  done
}

part_gemm() {
  # The own grouped GEMM alone: kernel variants interleaved (E / M: stores / products and stores left
  # out), then the DRAM bytes and L2 hit rate of the default kernel's products (Nsight Compute; the first
  # three launches are the warm-up's up, up, down).
  for cfg in fine-grained flash-paper decode mixtral; do
    run 100 "gemm_$cfg" "$B/dmoe" bench gemm --config "$cfg" --variants b256,b256E,b256M,b128 \
      --json "$O/gemm_$cfg.json"
    run 100 "gemm_dram_$cfg" ncu --clock-control none -k regex:grouped_gemm_sm90 -c 3 --metrics \
      dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum \
      "$B/dmoe" bench gemm --config "$cfg" --variants b256
  done
}

part_modes() {
  # The expert GEMM strategies side by side (src/cuda/gemm.cpp): what auto should pick; own-staged = the
  # own kernel storing tiles through shared memory with bulk stores instead of from registers.
  for cfg in flash-paper fine-grained decode mixtral; do
    for mode in grouped loop own own-staged; do
      [ "$mode" = own-staged ] && export DMOE_SM90_EPILOGUE=staged
      DMOE_EXPERT_GEMM=${mode%-staged} run 100 "mode_${cfg}_$mode" "$B/dmoe" bench layer --config "$cfg" \
        --check-tokens 4 --no-backward --json "$O/mode_${cfg}_$mode.json"
      unset DMOE_SM90_EPILOGUE
    done
  done
}

part_profile() {
  # Per-kernel device time of dmoe's own kernels (Nsight Compute, clocks left alone): the first iterations
  # of the forward, to split the layer into stages. The cuBLAS router GEMM is not matched (not dmoe::).
  for cfg in fine-grained flash-paper; do
    run 200 "ncu_$cfg" ncu --clock-control none --kernel-name-base demangled -k regex:dmoe:: -c 40 \
      --metrics gpu__time_duration.sum --csv "$B/dmoe" bench layer --config "$cfg" --no-backward --check-tokens 0
  done
}

part_gpus() {
  # One rank per GPU (issues 4 and 17): tests through dmoe launch and mpirun, the engine suite over each
  # communicator (auto picks NVSHMEM on one node with peer-connected GPUs), the named configs at W = #GPUs with the
  # training step and the all-to-all alone, every config with each communicator, weak scaling over
  # W = 1, 2, 4, 8 as the GPUs allow, and W = 2 on one GPU under MPS beside it.
  local n w
  n=$(nvidia-smi -L | wc -l)
  nvidia-smi topo -m > "$O/topology.txt" 2>&1
  run 120 "gpus_launch_w$n" "$B/dmoe" launch -n "$n" -- "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
    --gtest_filter='GpuComm*:*GpuEngine*'
  DMOE_COMM=nccl run 120 "gpus_launch_w${n}_engine_nccl" "$B/dmoe" launch -n "$n" -- \
    "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*GpuEngine*'
  run 120 "gpus_mpirun_w$n" mpirun --allow-run-as-root -n "$n" -x LD_LIBRARY_PATH -x DMOE_HOME \
    -x NCCL_NVLS_ENABLE=0 -x NVSHMEM_DISABLE_NVLS=1 -x DMOE_COMM_TIMEOUT_S \
    "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='GpuComm*:*GpuEngine*'
  # Every named config with each communicator at W = #GPUs, and at W = 1 in the same run: the weak-scaling
  # ratio per config and the data for choosing what --comm auto picks on one node.
  for cfg in flash-paper fine-grained decode mixtral; do
    for comm in nccl nvshmem; do
      run 60 "gpus_bench_${cfg}_w${n}_$comm" "$B/dmoe" launch -n "$n" -- "$B/dmoe" bench layer \
        --config "$cfg" --comm "$comm" --alltoall --check-tokens 4 --json "$O/gpus_${cfg}_w${n}_$comm.json"
    done
    run 60 "gpus_bench_${cfg}_w1" "$B/dmoe" bench layer --config "$cfg" --check-tokens 4 \
      --json "$O/gpus_${cfg}_w1.json"
  done
  for w in 2 4; do  # weak scaling below W = #GPUs (W = #GPUs ran above)
    [ "$w" -lt "$n" ] && run 60 "gpus_bench_flash-paper_w${w}_of_$n" "$B/dmoe" launch -n "$w" -- "$B/dmoe" bench \
      layer --config flash-paper --alltoall --check-tokens 4 --no-backward
  done
  CUDA_VISIBLE_DEVICES=0 run 60 gpus_bench_flash-paper_w2_mps "$B/dmoe" launch -n 2 -- "$B/dmoe" bench layer \
    --config flash-paper --alltoall --check-tokens 4
  # Flash with one rank per GPU (issue 17): its tests through dmoe launch and mpirun (direct stores into the peers'
  # GPUs over NVLink), and every named config at W = #GPUs beside EP in the same rounds, with W = 1 for weak scaling.
  DMOE_GPU_WAIT_TIMEOUT_MS=10000 run 120 "gpus_flash_launch_w$n" "$B/dmoe" launch -n "$n" -- \
    "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*FlashLayer.*'
  run 120 "gpus_flash_mpirun_w$n" mpirun --allow-run-as-root -n "$n" -x LD_LIBRARY_PATH -x DMOE_HOME \
    -x NCCL_NVLS_ENABLE=0 -x NVSHMEM_DISABLE_NVLS=1 -x DMOE_COMM_TIMEOUT_S -x DMOE_NVSHMEM_MIN_HEAP=8G \
    "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*FlashLayer.*'
  for cfg in flash-paper fine-grained decode mixtral; do
    run 90 "gpus_flash_bench_${cfg}_w$n" "$B/dmoe" launch -n "$n" -- "$B/dmoe" bench layer --config "$cfg" --flash \
      --alltoall --no-backward --check-tokens 4 --json "$O/gpus_flash_${cfg}_w$n.json"
    run 60 "gpus_flash_bench_${cfg}_w1" "$B/dmoe" bench layer --config "$cfg" --flash --no-backward --check-tokens 4 \
      --json "$O/gpus_flash_${cfg}_w1.json"
  done
}

part_flash() {
  # The Flash persistent kernel: its GPU tests alone first (one process), the own GEMM and EP engine after the
  # shared tile-engine headers changed, then Flash beside EP in the same rounds on every named config and decode
  # at small T.
  export DMOE_GPU_WAIT_TIMEOUT_MS=${DMOE_GPU_WAIT_TIMEOUT_MS:-5000}
  run 150 flash_tests_w1 "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*Flash*'
  run 150 flash_regress_gemm_ep "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*OwnGemm*:*GpuEngine*'
  for cfg in flash-paper fine-grained mixtral decode; do
    run 120 "flash_bench_$cfg" "$B/dmoe" bench layer --config "$cfg" --flash --no-backward --check-tokens 4 \
      --json "$O/flash_bench_$cfg.json"
  done
  for t in 1 8 32; do
    run 60 "flash_bench_decode_t$t" "$B/dmoe" bench layer --config decode --tokens "$t" --flash --no-backward \
      --check-tokens 1 --json "$O/flash_bench_decode_t$t.json"
  done
}

part_flash_multi() {
  # Flash with W = 2, 4 ranks sharing the GPU (MPS) through dmoe launch and mpirun, and its benchmark at W = 4.
  local n
  export DMOE_GPU_WAIT_TIMEOUT_MS=${DMOE_GPU_WAIT_TIMEOUT_MS:-5000}
  for n in 2 4; do
    run 200 "flash_launch_w$n" "$B/dmoe" launch -n "$n" -- "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
      --gtest_filter='*FlashLayer.*'
  done
  run 150 flash_bench_flash-paper_w4 "$B/dmoe" launch -n 4 -- "$B/dmoe" bench layer --config flash-paper --flash \
    --no-backward --check-tokens 2 --json "$O/flash_bench_flash-paper_w4.json"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/dmoe-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dmoe-mps/log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  run 200 flash_mpirun_w4 mpirun --allow-run-as-root --oversubscribe -n 4 -x LD_LIBRARY_PATH -x DMOE_HOME \
    -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 \
    -x NVSHMEM_DISABLE_NCCL=1 -x NCCL_NVLS_ENABLE=0 -x NVSHMEM_DISABLE_NVLS=1 -x DMOE_COMM_TIMEOUT_S \
    -x DMOE_GPU_WAIT_TIMEOUT_MS -x DMOE_NVSHMEM_MIN_HEAP=4G \
    "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*FlashLayer.*'
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

for part in ${WHAT//,/ }; do
  case $part in
    tests | multi | bench | quick | gemm | modes | profile | gpus | flash | flash_multi) part_$part ;;
    *) echo "unknown part '$part'; allowed: tests, multi, bench, quick, gemm, modes, profile, gpus, flash, flash_multi, all" >&2; exit 2 ;;
  esac
done
