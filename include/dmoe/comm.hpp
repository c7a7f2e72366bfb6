// dmoe/comm.hpp — public: the communicator interface (Comm), ranks as threads (make_thread_comms,
// run_thread_ranks), and how a process learns its rank (detect_process_env). In a CUDA build
// (DMOE_WITH_CUDA) also the GPU communicators (NCCL, NVSHMEM, one local rank).
#pragma once

#include "comm/comm.hpp"
#include "comm/process_env.hpp"

#if defined(DMOE_WITH_CUDA)
#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#endif
