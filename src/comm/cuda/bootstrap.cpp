// bootstrap.cpp — NVSHMEM and NCCL initialisation across launchers (see bootstrap.hpp), plus the file
// rendezvous dmoe launch provides and the bounded stream wait the communicators share.
#include "comm/cuda/bootstrap.hpp"

#include <cuda_runtime.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#if defined(DMOE_WITH_NVSHMEM)
#include <nvshmem_host.h>
#endif

#include "comm/bootstrap_exchange.hpp"
#include "comm/cuda/comm_detail.hpp"
#include "core/env.hpp"
#include "core/peer_watch.hpp"
#include "core/error.hpp"
#include "core/output_file.hpp"
#include "cuda/check.hpp"

namespace dmoe {

namespace comm_detail {

double comm_timeout_seconds() { return host_wait_timeout_seconds(); }

void wait_stream(cudaStream_t stream, const std::string& what, ncclComm_t nccl) {
  std::function<void()> poll;
  if (nccl)
    poll = [&] {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(nccl, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
        DMOE_FAIL("{}: NCCL reported an asynchronous error: {} ({})", what, ncclGetErrorString(async),
                  ncclGetLastError(nccl));
    };
  cuda::wait_stream(stream, what.c_str(), poll);
}

void wait_nccl_ready(ncclComm_t comm, const std::string& what) {
  const double timeout = comm_timeout_seconds();
  const auto start = std::chrono::steady_clock::now();
  auto sleep = std::chrono::microseconds(20);
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &state);
    if (query != ncclSuccess) state = query;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) {
      const std::string detail = ncclGetLastError(comm);
      ncclCommAbort(comm);
      DMOE_FAIL("{}: NCCL failed: {} ({})", what, ncclGetErrorString(state), detail);
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    PeerWatch* watch = peer_watch();
    if (watch && waited > 2e-3) {
      if (const std::string failed = watch->failed_peer(); !failed.empty()) {
        cuda::abandon_gpu();
        ncclCommAbort(comm);
        DMOE_FAIL_RUN("{}: stopped waiting for NCCL after {:.1f} s: {}", what, waited, failed);
      }
    }
    if (waited > timeout) {
      cuda::abandon_gpu();
      ncclCommAbort(comm);
      std::string peers;
      if (watch) {
        watch->give_up();
        peers = watch->describe_peers();
      }
      DMOE_FAIL_RUN("{}: waited {:.0f} s for NCCL (DMOE_COMM_TIMEOUT_S={:g}); a peer rank has probably failed or is "
                    "not making the same call{}{} (if it is only slow, raise DMOE_COMM_TIMEOUT_S)", what, waited, timeout,
                    peers.empty() ? "" : "; ", peers);
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min(sleep * 2, std::chrono::microseconds(2000));
  }
}

}  // namespace comm_detail

namespace {

// ---- file rendezvous (dmoe launch) ----------------------------------------------------------------

std::string rendezvous_dir(const ProcessEnv& env) {
  const char* dir = std::getenv("DMOE_RENDEZVOUS");
  DMOE_REQUIRE(dir && *dir, "rank {}: DMOE_RENDEZVOUS is not set, but DMOE_RANK is: run the ranks with `dmoe launch`, "
               "which creates the rendezvous directory", env.rank);
  return dir;
}

// Written atomically (temporary + rename): a reader sees the whole file or none of it.
void publish_file(const std::string& path, const void* data, size_t bytes) {
  write_file_atomically(path, std::span<const uint8_t>(static_cast<const uint8_t*>(data), bytes));
}

// Waits (bounded) for rank 0's file of exactly `bytes` bytes and reads it.
void read_published_file(const ProcessEnv& env, const std::string& path, void* data, size_t bytes, const char* what) {
  constexpr double kTimeoutS = 60.0;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::vector<char> content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      DMOE_REQUIRE(content.size() == bytes, "rank {}: {} in {} has {} bytes, expected {}", env.rank, what, path,
                   content.size(), bytes);
      std::memcpy(data, content.data(), bytes);
      return;
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    DMOE_REQUIRE(waited < kTimeoutS, "rank {}: waited {:.0f} s for rank 0 to publish {} as {}; did rank 0 fail "
                 "(its output says), or do the ranks not run the same sequence of communicator set-ups?",
                 env.rank, waited, what, path);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Rank 0 publishes `bytes` under `name`, the others read it: through the exchange the embedding application
// registered (bootstrap_exchange.hpp: the Python module's torch.distributed group), else through the rendezvous
// directory. Names carry a per-process sequence number (every rank creates its communicators in the same
// order), so a second set-up never reads a stale id.
void exchange_bootstrap_bytes(const ProcessEnv& env, const std::string& name, void* data, size_t bytes,
                            const char* what) {
  if (const BootstrapExchange exchange = bootstrap_exchange()) {
    try {
      exchange(name, data, bytes);
    } catch (const std::exception& e) {
      DMOE_FAIL("rank {}: the registered bootstrap exchange could not deliver {} ({}): {}", env.rank, what, name,
                e.what());
    }
    return;
  }
  const std::string path = rendezvous_dir(env) + "/" + name;
  if (env.rank == 0)
    publish_file(path, data, bytes);
  else
    read_published_file(env, path, data, bytes, what);
}

void set_env_default(const char* name, const char* value) { ::setenv(name, value, 0); }

#if defined(DMOE_WITH_NVSHMEM)
bool g_nvshmem_initialized = false;
size_t g_nvshmem_heap_bytes = 0;
int g_nvshmem_uid_sequence = 0;
#endif
int g_nccl_id_sequence = 0;

}  // namespace

size_t parse_byte_size(const std::string& text) { return size_t(parse_byte_count(text).value_or(0)); }

int32_t select_device(const ProcessEnv& env) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  DMOE_REQUIRE(status == cudaSuccess || status == cudaErrorNoDevice || status == cudaErrorInsufficientDriver,
               "rank {}: cudaGetDeviceCount failed: {} ({})", env.rank, cudaGetErrorString(status),
               cudaGetErrorName(status));
  if (status != cudaSuccess) count = 0;
  const int32_t device = choose_device(env, count);
  cuda::set_device_or_explain(device, fmt::format("rank {}", env.rank).c_str());
  return device;
}

#if defined(DMOE_WITH_NVSHMEM)

void init_nvshmem(const ProcessEnv& env, size_t symmetric_heap_bytes) {
  if (g_nvshmem_initialized) {
    DMOE_REQUIRE(g_nvshmem_heap_bytes == 0 || symmetric_heap_bytes <= g_nvshmem_heap_bytes,
                 "rank {}: NVSHMEM is already initialised with a symmetric heap of {} bytes; {} bytes are now asked "
                 "for, and the heap cannot grow: raise NVSHMEM_SYMMETRIC_SIZE to at least {} (or create the largest "
                 "communicator first)", env.rank, g_nvshmem_heap_bytes, symmetric_heap_bytes, symmetric_heap_bytes);
    return;
  }
  // The heap cannot grow once NVSHMEM runs, and a process may create a larger communicator later (a
  // test binary creates many): reserve at least DMOE_NVSHMEM_MIN_HEAP bytes (default 1 GiB).
  size_t floor_bytes = size_t(1) << 30;
  // core/env.hpp: strict (a malformed value was read as 0, no floor, without a word).
  floor_bytes = size_t(env_byte_size("DMOE_NVSHMEM_MIN_HEAP", floor_bytes));
  symmetric_heap_bytes = std::max(symmetric_heap_bytes, floor_bytes);
  // NVSHMEM reads its environment on first use: everything is set before the first NVSHMEM call.
  const char* user_size = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  if (!user_size) ::setenv("NVSHMEM_SYMMETRIC_SIZE", std::to_string(symmetric_heap_bytes).c_str(), 1);
  const std::string heap_text = std::getenv("NVSHMEM_SYMMETRIC_SIZE");
  const size_t heap_bytes = parse_byte_size(heap_text);
  DMOE_REQUIRE(heap_bytes == 0 || heap_bytes >= symmetric_heap_bytes,
               "rank {}: NVSHMEM_SYMMETRIC_SIZE={} ({} bytes) is smaller than the {} bytes the communicator needs: "
               "raise NVSHMEM_SYMMETRIC_SIZE to at least {} or unset it", env.rank, heap_text, heap_bytes,
               symmetric_heap_bytes, symmetric_heap_bytes);
  set_env_default("NVSHMEM_DISABLE_NVLS", "1");

  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  unsigned int flags = 0;
  nvshmemx_uniqueid_t uid = NVSHMEMX_UNIQUEID_INITIALIZER;
  std::string bootstrap;
  if (env.launcher == "dmoe-launch" || env.launcher == "single") {
    bootstrap = "unique id";
    if (env.rank == 0) DMOE_CHECK_NVSHMEM(nvshmemx_get_uniqueid(&uid));
    if (env.world > 1)
      exchange_bootstrap_bytes(env, "nvshmem-uid-" + std::to_string(g_nvshmem_uid_sequence++), &uid, sizeof(uid),
                             "the NVSHMEM unique id");
    DMOE_CHECK_NVSHMEM(nvshmemx_set_attr_uniqueid_args(env.rank, env.world, &uid, &attr));
    flags = NVSHMEMX_INIT_WITH_UNIQUEID;
  } else {
    set_env_default("NVSHMEM_BOOTSTRAP", env.launcher == "mpirun" ? "MPI" : "PMI");
    bootstrap = std::string("NVSHMEM_BOOTSTRAP=") + std::getenv("NVSHMEM_BOOTSTRAP");
  }
  const int status = nvshmemx_hostlib_init_attr(flags, &attr);
  DMOE_REQUIRE(status == 0,
               "rank {}: NVSHMEM initialisation failed (status {}, launcher {}, bootstrap {}) with a symmetric heap of "
               "NVSHMEM_SYMMETRIC_SIZE={}{}; if the GPU is short of memory lower it (or the communicator's bytes per "
               "peer); set NVSHMEM_DEBUG=INFO for NVSHMEM's reasons",
               env.rank, status, env.launcher, bootstrap, heap_text, user_size ? " (set by the user)" : "");
  g_nvshmem_initialized = true;
  g_nvshmem_heap_bytes = heap_bytes;
  const int my_pe = nvshmem_my_pe(), n_pes = nvshmem_n_pes();
  DMOE_REQUIRE(my_pe == env.rank && n_pes == env.world,
               "NVSHMEM sees PE {} of {}, but the launcher ({}) says rank {} of {}: the bootstrap ({}) does not match "
               "how the processes were started", my_pe, n_pes, env.launcher, env.rank, env.world, bootstrap);
}

bool nvshmem_is_initialized() { return g_nvshmem_initialized; }

size_t nvshmem_heap_bytes() { return g_nvshmem_initialized ? g_nvshmem_heap_bytes : 0; }

void finalize_nvshmem() {
  if (!g_nvshmem_initialized) return;
  nvshmemx_hostlib_finalize();
  g_nvshmem_initialized = false;
  g_nvshmem_heap_bytes = 0;
}

#else  // !DMOE_WITH_NVSHMEM

void init_nvshmem(const ProcessEnv& env, size_t) {
  DMOE_FAIL("rank {}: this dmoe was built without NVSHMEM (CMake did not find it; see cmake/FindNVSHMEM.cmake), "
            "so the NVSHMEM communicator and the NVSHMEM bootstrap are unavailable", env.rank);
}
bool nvshmem_is_initialized() { return false; }
size_t nvshmem_heap_bytes() { return 0; }
void finalize_nvshmem() {}

#endif

ncclComm_t init_nccl(const ProcessEnv& env) {
  set_env_default("NCCL_NVLS_ENABLE", "0");
  ncclUniqueId id{};
  if (env.rank == 0) DMOE_CHECK_NCCL(ncclGetUniqueId(&id));
  if (env.world > 1) {
    if (env.launcher == "dmoe-launch") {
      exchange_bootstrap_bytes(env, "nccl-id-" + std::to_string(g_nccl_id_sequence++), &id, sizeof(id),
                             "the NCCL unique id");
    } else {
#if defined(DMOE_WITH_NVSHMEM)
      // No shared directory across machines: the id travels through NVSHMEM, which has its own bootstrap.
      // NVSHMEM's default heap (1 GiB) rather than a minimal one: the heap cannot grow later, and an
      // NvshmemComm created afterwards in the same process must still fit.
      // (The id itself needs only bytes: a heap the user chose is fine whatever its size.)
      constexpr size_t kDefaultHeap = size_t(1) << 30;
      init_nvshmem(env, std::getenv("NVSHMEM_SYMMETRIC_SIZE") ? 2 * sizeof(id) : kDefaultHeap);
      auto* buffer = static_cast<char*>(nvshmem_malloc(2 * sizeof(id)));
      DMOE_REQUIRE(buffer, "rank {}: nvshmem_malloc of {} bytes for the NCCL unique id failed (NVSHMEM_SYMMETRIC_SIZE "
                   "too small?)", env.rank, 2 * sizeof(id));
      char* src = buffer;
      char* dst = buffer + sizeof(id);
      cudaStream_t stream = nullptr;
      DMOE_COMM_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(src, &id, sizeof(id), cudaMemcpyHostToDevice, stream));
      DMOE_CHECK_NVSHMEM(nvshmemx_broadcastmem_on_stream(NVSHMEM_TEAM_WORLD, dst, src, sizeof(id), 0, stream));
      if (env.rank != 0) DMOE_COMM_CHECK_CUDA(cudaMemcpyAsync(&id, dst, sizeof(id), cudaMemcpyDeviceToHost, stream));
      comm_detail::wait_stream(stream, fmt::format("rank {}: broadcast of the NCCL unique id", env.rank));
      DMOE_COMM_CHECK_CUDA(cudaStreamDestroy(stream));
      nvshmem_free(buffer);
#else
      DMOE_FAIL("rank {}: under {} the NCCL unique id travels through NVSHMEM, and this dmoe was built without it; "
                "start the ranks with `dmoe launch` instead", env.rank, env.launcher);
#endif
    }
  }
  // Non-blocking init, so the wait for the other ranks is bounded (a blocking init waits forever for a
  // rank that died before joining). The communicator stays non-blocking: see nccl_comm.cpp.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t started = ncclCommInitRankConfig(&comm, env.world, id, env.rank, &config);
  DMOE_REQUIRE(started == ncclSuccess || started == ncclInProgress,
               "rank {}: ncclCommInitRankConfig failed: {} ({})", env.rank, ncclGetErrorString(started),
               ncclGetLastError(comm));
  comm_detail::wait_nccl_ready(comm, fmt::format("rank {}: NCCL initialisation of {} ranks", env.rank, env.world));
  return comm;
}

}  // namespace dmoe
