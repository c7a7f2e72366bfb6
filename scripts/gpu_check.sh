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
# profile (per-kernel times under Nsight Compute), wgrad (the sm90 weight-gradient kernel: tests, kernel
# benchmark, training step per DMOE_WGRAD path), gpus (one rank per GPU on a multi-GPU machine),
# flash (the Flash kernel at W = 1: its tests, and its benchmark beside EP), flash_decode (the split gate,
# spread combine and down-tile prefetch against the old defaults: their tests, decode T = 1-128 and two large configs
# in each mode), flash_multi (Flash at W = 2, 4
# ranks on the GPU), flash_backward (the Flash backward: its tests at W = 1, 2, 4 and the training step beside
# EP's on the four named configs), faults (the fault-injection matrix over GPU processes), sanitize (compute-sanitizer),
# skiplag (the skip paths of the own GEMM and Flash with late warps, each case its own process; the shape that hung once);
# all = tests,multi,bench,modes (default).
#
# Run from the repository root. Needs the NVSHMEM wheel in the Python on PATH (the GPU machine has it in
# its PyTorch environment). Every step has a time limit; logs go to LOG_DIR, a summary to stdout.
set -u
B=${1:-build}
O=${2:-out/gpu}
WHAT=${3:-all}
[ "$WHAT" = all ] && WHAT=tests,multi,bench,modes
# Every part is checked before the first runs: a misspelt later part ('tests,fash') was found only after the earlier
# ones had run (minutes of a short device lease), and so was a BUILD_DIR without dmoe in it.
PARTS="tests multi bench quick gemm wgrad modes profile gpus flash flash_decode flash_multi flash_backward faults sanitize skiplag"
for part in ${WHAT//,/ }; do
  case " $PARTS " in
    *" $part "*) ;;
    *) echo "gpu_check.sh: unknown part '$part'; allowed: ${PARTS// /, }, all (alone)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$B/dmoe" ]; then
  echo "gpu_check.sh: '$B/dmoe' is not an executable: BUILD_DIR must be a dmoe build (cmake --build BUILD_DIR)" >&2
  exit 2
fi
mkdir -p "$O"
export DMOE_HOME=$PWD NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 DMOE_COMM_TIMEOUT_S=60
NV=$(python3 -c "import nvidia.nvshmem as m; print(m.__path__[0])" 2>/dev/null)/lib
# libcudnn.so.9 for CudnnAttention (dlopen'ed; PyTorch's nvidia-cudnn wheel) and the shared CUDA runtime that
# cudnn-frontend loads beside it (/usr/local/cuda/lib64).
CUDNN_LIB=$(python3 -c "import nvidia.cudnn as m; print(m.__path__[0])" 2>/dev/null)/lib
export LD_LIBRARY_PATH=$NV:$CUDNN_LIB:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
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
  # Flow's GPU executor with ranks sharing the GPU: AR chunks on the model's NVSHMEM communicator (static order).
  for n in 2 4; do
    run 300 "flow_launch_w$n" "$B/dmoe" launch -n "$n" -- "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
      --gtest_filter='GpuFlow*'
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

part_skiplag() {
  # docs/faults.md, "An own-GEMM wait that fired once": warps 1-3 of skipping consumers made late (the test aids). A
  # hang stops its process with the kernel's wait report (limit 4 s here), so each case runs alone.
  export DMOE_GPU_WAIT_TIMEOUT_MS=4000
  local t
  for t in $("$B/tests/dmoe_gpu_tests" --gtest_list_tests --gtest_filter='*OwnGemm*lagged*:FlashLayerLaggedSkip*' |
             awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
    run 60 "skiplag_${t//\//_}" "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter="$t"
  done
  unset DMOE_GPU_WAIT_TIMEOUT_MS
  local i
  for i in 1 2 3 4; do
    run 100 "skiplag_gemm_bert_$i" "$B/dmoe" bench gemm --tokens 8192 --hidden 512 --ffn 1024 --experts 32 --top-k 1 \
      --activation swiglu --dtype bf16 --wgrad
  done
}

part_wgrad() {
  # The sm90 TMA + wgmma weight-gradient kernel (opt-in, DMOE_WGRAD=sm90, until this part has passed): its tests
  # against the CPU twin and the mma.sync kernel, alone first (a fault poisons the context), then the kernels side
  # by side, and the training step with each weight-gradient path, interleaved.
  run 200 wgrad_tests "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*GroupedWgrad*'
  for cfg in fine-grained flash-paper decode mixtral; do
    run 120 "wgrad_gemm_$cfg" "$B/dmoe" bench gemm --config "$cfg" --wgrad --json "$O/wgrad_gemm_$cfg.json"
  done
  for round in $(seq 1 "${WGRAD_ROUNDS:-2}"); do
    for cfg in fine-grained flash-paper decode; do
      for w in sm90 mma cublas; do
        DMOE_WGRAD=$w run 120 "wgrad_step_${cfg}_${w}_$round" "$B/dmoe" bench layer --config "$cfg" \
          --check-tokens 0 --json "$O/wgrad_step_${cfg}_${w}_$round.json"
      done
    done
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
  # The Flash persistent kernel: its GPU tests alone first (one process; *Flash* also takes MoeEngineGpu*'s and
  # MoeEngineGpuCli's: the interface and `dmoe run --engine flash`), the own GEMM and EP engine after the
  # shared tile-engine headers changed, then Flash beside EP in the same rounds on every named config and decode
  # at small T.
  export DMOE_GPU_WAIT_TIMEOUT_MS=${DMOE_GPU_WAIT_TIMEOUT_MS:-5000}
  run 150 flash_tests_w1 "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*Flash*'
  run 150 flash_regress_gemm_ep "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*OwnGemm*:*GpuEngine*'
  for cfg in flash-paper fine-grained mixtral decode; do
    run 120 "flash_bench_$cfg" "$B/dmoe" bench layer --config "$cfg" --flash --no-backward --check-tokens 4 \
      --json "$O/flash_bench_$cfg.json"
  done
  # Flash alone through MoeEngine (--engine flash: no EP rows; the training step is left out, with a note).
  run 120 flash_alone_bench_flash-paper "$B/dmoe" bench layer --config flash-paper --engine flash --check-tokens 4 \
    --json "$O/flash_alone_bench_flash-paper.json"
  for t in 1 8 32; do
    run 60 "flash_bench_decode_t$t" "$B/dmoe" bench layer --config decode --tokens "$t" --flash --no-backward \
      --check-tokens 1 --json "$O/flash_bench_decode_t$t.json"
  done
}

part_flash_decode() {
  # The decode-size paths (docs/flash.md): DMOE_FLASH_GATE=auto|split against block, DMOE_FLASH_COMBINE=slice against
  # token, DMOE_FLASH_PREFETCH=1 against 0. Tests first; then each mode's benchmark beside the defaults (auto, slice,
  # 0). Changing a default needs its tests passed and these numbers in docs/perf.md.
  export DMOE_GPU_WAIT_TIMEOUT_MS=${DMOE_GPU_WAIT_TIMEOUT_MS:-5000}
  run 200 flash_decode_tests "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
    --gtest_filter='*FlashLayer.*:*FlashLayerSplitGate.*:*FlashLayerSpreadCombine.*:*FlashLayerPrefetchDown.*:*FlashLayerBlockGateTokenCombine.*'
  local t mode gate combine prefetch
  for t in 1 8 32 128; do
    # gate/combine/prefetch: the defaults (auto/slice/0 since the twenty-eighth session), the old defaults
    # (block/token/0), each of the two changes alone, forced split, and the prefetch on top
    for mode in auto/slice/0 block/token/0 auto/token/0 block/slice/0 split/slice/0 auto/slice/1; do
      IFS=/ read -r gate combine prefetch <<<"$mode"
      [ "$gate" = split ] && [ "$t" -gt 64 ] && continue  # T/64 * H/64 items past one wave: an input error
      DMOE_FLASH_GATE=$gate DMOE_FLASH_COMBINE=$combine DMOE_FLASH_PREFETCH=$prefetch \
        run 60 "flash_decode_t${t}_${gate}_${combine}_$prefetch" "$B/dmoe" bench layer --config decode --tokens "$t" \
        --flash --no-backward --check-tokens 1 --json "$O/flash_decode_t${t}_${gate}_${combine}_$prefetch.json"
    done
  done
  local cfg
  for cfg in flash-paper fine-grained; do
    for mode in token/0 slice/0 token/1; do
      IFS=/ read -r combine prefetch <<<"$mode"
      DMOE_FLASH_COMBINE=$combine DMOE_FLASH_PREFETCH=$prefetch run 120 "flash_decode_${cfg}_${combine}_$prefetch" \
        "$B/dmoe" bench layer --config "$cfg" --flash --no-backward --check-tokens 2 \
        --json "$O/flash_decode_${cfg}_${combine}_$prefetch.json"
    done
  done
}

part_flash_multi() {
  # Flash with W = 2, 4 ranks sharing the GPU (MPS) through dmoe launch and mpirun, and its benchmark at W = 4.
  local n
  export DMOE_GPU_WAIT_TIMEOUT_MS=${DMOE_GPU_WAIT_TIMEOUT_MS:-5000}
  for n in 2 4; do
    run 200 "flash_launch_w$n" "$B/dmoe" launch -n "$n" -- "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
      --gtest_filter='*FlashLayer.*:*FlashLayerSplitGate.*:*FlashLayerSpreadCombine.*:*FlashLayerPrefetchDown.*:*FlashLayerBlockGateTokenCombine.*:*FlashBackward.*'
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
    "$B/tests/dmoe_gpu_tests" --gtest_brief=1 --gtest_filter='*FlashLayer.*:*FlashBackward.*'
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

part_flash_backward() {
  # The Flash backward (issue 14): its tests at W = 1 and W = 2, 4 ranks sharing the GPU, the engine interface and
  # `dmoe run --engine flash --grad-output`, then Flash's training step beside EP's on the named configs.
  local n cfg
  run 200 flash_backward_w1 "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
    --gtest_filter='*FlashBackward.*:*MoeEngineGpu*:*FlashLayer.*'
  export DMOE_GPU_WAIT_TIMEOUT_MS=${DMOE_GPU_WAIT_TIMEOUT_MS:-5000}
  for n in 2 4; do
    run 200 "flash_backward_launch_w$n" "$B/dmoe" launch -n "$n" -- "$B/tests/dmoe_gpu_tests" --gtest_brief=1 \
      --gtest_filter='*FlashBackward.*'
  done
  for cfg in flash-paper fine-grained mixtral decode; do
    run 120 "flash_step_$cfg" "$B/dmoe" bench layer --config "$cfg" --flash --check-tokens 2 \
      --json "$O/flash_step_$cfg.json"
  done
}

part_faults() {
  # Issue 11's fault matrix on the GPU (docs/faults.md): DMOE_FAULT=rank:stage:kind on the last rank of a
  # W-rank training step (train forward + backward of a small bf16 layer), ranks sharing the GPU under MPS,
  # so the NVSHMEM communicator (NCCL needs a GPU per rank). Each case passes when the job fails (rc != 0),
  # ends within its bound (the no-fault run's time + 10 s, + DMOE_COMM_TIMEOUT_S for hangs), and its output
  # names the failed rank and the stage; "survivor" says whether a surviving rank's own error did (the stage
  # board; under dmoe launch and mpirun a rank that exits or throws takes the job down before survivors
  # time out). Table in $O/faults.md. FAULT_WORLDS / FAULT_MPIRUN_WORLDS choose W, FAULT_KINDS the kinds.
  local shape="bench layer --engine cuda --tokens 256 --hidden 256 --ffn 512 --experts 8 --top-k 2 --dtype bf16"
  shape="$shape --warmup 0 --repeat 1 --check-tokens 0"
  local limit=5 w f stage kind t0 rc s base named surv ok
  local table="$O/faults.md"
  if [ ! -f "$table" ]; then  # a second call (other W) adds rows
    echo "| launcher | W | stage | kind | rc | s | bound s | names rank+stage | survivor named it | ranks left | verdict |" >"$table"
    echo "|---|---|---|---|---|---|---|---|---|---|---|" >>"$table"
  fi
  fault_case() {  # fault_case LAUNCHER W STAGE KIND BASE_S CMD...
    local launcher=$1 w=$2 stage=$3 kind=$4 base=$5
    shift 5
    f=$((w - 1))
    local bound=$((base + 10))
    [ "$kind" = hang ] && bound=$((bound + limit))
    local log="$O/fault_${launcher}_w${w}_${stage}_$kind.log"
    t0=$(date +%s.%N)
    DMOE_FAULT="$f:$stage:$kind" DMOE_COMM_TIMEOUT_S=$limit timeout -k 5 $((bound + 30)) "$@" >"$log" 2>&1
    rc=$?
    s=$(python3 -c "import time; print(f'{time.time() - $t0:.1f}')")
    # Ranks still alive once the launcher is gone would be a failure of their own (and would hold the GPU's MPS
    # server for the next case): count and end them.
    local strays
    strays=$(pgrep -fc "$B/dmoe $shape" || true)
    if [ "${strays:-0}" -gt 0 ]; then
      pkill -9 -f "$B/dmoe $shape"
      sleep 2
    fi
    # A shared MPS daemon (mpirun) needs a moment to release the clients of a job that ended in a failure; the next
    # job's cudaSetDevice fails with "busy or unavailable" until then. dmoe launch runs a daemon per job.
    if [ "$launcher" = mpirun ]; then
      # How long until a fresh process may open the GPU again (there is no in-process retry: a refusal sticks
      # inside the process that met it, docs/faults.md): tells a daemon that needs time from that.
      local probe_t0=$SECONDS probe_ok=no
      while [ $((SECONDS - probe_t0)) -lt 40 ]; do
        if timeout 20 "$B/dmoe" bench layer --engine cuda --tokens 16 --hidden 64 --ffn 64 \
          --experts 2 --top-k 1 --warmup 0 --repeat 1 --check-tokens 0 --no-backward >/dev/null 2>&1; then
          probe_ok=yes
          break
        fi
        sleep 1
      done
      echo "== mps probe after $stage $kind: a new process opened the GPU: $probe_ok after $((SECONDS - probe_t0)) s"
    fi
    named=no
    grep -aq "rank $f" "$log" && grep -aq "$stage" "$log" && named=yes
    surv=no
    grep -aE "rank $f (\(pid [0-9]+\) is not waiting|failed in stage|exited in stage|gave up|'s process)" "$log" |
      grep -avq "^\[rank $f\]" && surv=yes
    ok=pass
    [ "$rc" -eq 0 ] && ok=FAIL
    [ "$named" = no ] && ok=FAIL
    python3 -c "import sys; sys.exit(0 if $s <= $bound else 1)" || ok=FAIL
    [ "${strays:-0}" -gt 0 ] && ok=FAIL
    echo "| $launcher | $w | $stage | $kind | $rc | $s | $bound | $named | $surv | ${strays:-0} | $ok |" >>"$table"
    echo "== fault $launcher W=$w $stage $kind: rc=$rc ${s}s (bound $bound) named=$named survivor=$surv strays=${strays:-0} $ok"
  }
  for w in ${FAULT_WORLDS-2 4 8}; do
    t0=$SECONDS
    run 120 "fault_baseline_launch_w$w" "$B/dmoe" launch -n "$w" -- "$B/dmoe" $shape
    base=$((SECONDS - t0))
    for stage in before_dispatch alltoall expert_gemm combine backward allreduce; do
      for kind in ${FAULT_KINDS:-throw exit hang}; do
        fault_case launch "$w" "$stage" "$kind" "$base" "$B/dmoe" launch -n "$w" -- "$B/dmoe" $shape
      done
    done
  done
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/dmoe-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/dmoe-mps/log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  for w in ${FAULT_MPIRUN_WORLDS-4}; do
    local mpi=(mpirun --allow-run-as-root --oversubscribe -n "$w" -x LD_LIBRARY_PATH -x DMOE_HOME
      -x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY -x CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / w))
      -x NVSHMEM_DISABLE_NCCL=1 -x NCCL_NVLS_ENABLE=0 -x NVSHMEM_DISABLE_NVLS=1 -x DMOE_FAULT -x DMOE_COMM_TIMEOUT_S)
    t0=$SECONDS
    DMOE_FAULT= run 120 "fault_baseline_mpirun_w$w" "${mpi[@]}" "$B/dmoe" $shape
    base=$((SECONDS - t0))
    for stage in ${FAULT_MPIRUN_STAGES:-before_dispatch alltoall expert_gemm combine backward allreduce}; do
      for kind in ${FAULT_KINDS:-throw exit hang}; do
        fault_case mpirun "$w" "$stage" "$kind" "$base" "${mpi[@]}" "$B/dmoe" $shape
      done
    done
  done
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  grep -c "| pass |" "$table" | sed 's/^/faults passed: /'
  grep -c "| FAIL |" "$table" | sed 's/^/faults failed: /'
}

part_sanitize() {
  # compute-sanitizer's four tools over the whole GPU suite (issue 11): scripts/sanitize_suite.py runs a job per
  # tool and test suite, SANITIZE_JOBS at once, within SANITIZE_BUDGET seconds, with the kernels' and the host's
  # wait limits raised for the slowdown, and accounts for every test (covered, over the limit, not reached);
  # SANITIZE_FILTER narrows it, SANITIZE_RESUME=summary.json runs only what an earlier run did not cover. Then
  # the minimal reproductions of the reports that belong to the tools or to NVIDIA's libraries (tests/sanitizer),
  # and initcheck on `dmoe run --engine cuda`.
  python3 scripts/sanitize_suite.py --bin "$B/tests/dmoe_gpu_tests" --out "$O/sanitize" --jobs "${SANITIZE_JOBS:-12}" \
    --budget "${SANITIZE_BUDGET:-540}" --job-limit "${SANITIZE_JOB_LIMIT:-300}" ${SANITIZE_FILTER:+--filter "$SANITIZE_FILTER"} \
    ${SANITIZE_RESUME:+--resume "$SANITIZE_RESUME"} --split 'OwnGemm|GpuFlow|Determinism|GpuMixtral|Attention|FlashBackward' \
    >"$O/sanitize.log" 2>&1
  echo "== sanitize_suite: rc=$?"
  grep -v '^\[ *[0-9]* s\]' "$O/sanitize.log" | head -40
  export DMOE_GPU_WAIT_TIMEOUT_MS=900000 DMOE_COMM_TIMEOUT_S=900
  # initcheck and stores it may not track: plain stores, TMA bulk stores, cuBLAS.
  for mode in plain bulk cublas; do
    compute-sanitizer --tool initcheck "$B/tests/dmoe_initcheck_repro" "$mode" >"$O/san_repro_$mode.log" 2>&1
    echo "== initcheck repro $mode: rc=$? $(grep -ac 'Uninitialized __global__' "$O/san_repro_$mode.log") reports; \
$(grep -a 'sum' "$O/san_repro_$mode.log")"
  done
  # cuDNN's fused attention and a cuBLAS Hopper GEMM alone, under each tool (their results checked).
  local mode tool
  for mode in cudnn cublas; do
    for tool in memcheck racecheck synccheck initcheck; do
      timeout 150 compute-sanitizer --tool "$tool" --print-limit 20 "$B/tests/dmoe_library_repro" "$mode" \
        >"$O/san_library_${mode}_$tool.log" 2>&1
      echo "== library repro $mode $tool: rc=$? $(grep -a 'SUMMARY' "$O/san_library_${mode}_$tool.log" | tail -1) \
$(grep -a "^$mode:" "$O/san_library_${mode}_$tool.log")"
    done
  done
  local d="$O/san_run"
  mkdir -p "$d"
  "$B/dmoe" init --hidden 512 --ffn 1024 --experts 8 --top-k 2 --tokens 256 --world 1 --dtype bf16 \
    --out "$d/w.safetensors" --input "$d/x.safetensors" --grad-output "$d/dy.safetensors" --save-config "$d/c.json" \
    >"$d/init.log" 2>&1
  run 120 san_initcheck_run compute-sanitizer --tool initcheck --print-limit 50 "$B/dmoe" run --engine cuda \
    --config "$d/c.json" --weights "$d/w.safetensors" --input "$d/x.safetensors" --grad-output "$d/dy.safetensors" \
    --output "$d/y.safetensors"
  grep -aE "ERROR SUMMARY" "$O/san_initcheck_run.log" | tail -1
  unset DMOE_GPU_WAIT_TIMEOUT_MS
  export DMOE_COMM_TIMEOUT_S=60
}

for part in ${WHAT//,/ }; do
  part_$part  # (checked against PARTS above)
done
