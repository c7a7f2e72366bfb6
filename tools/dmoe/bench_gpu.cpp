// bench_gpu.cpp — `dmoe bench layer` on GPUs: ceilings, the engine (ep, or flash alone), Flash beside EP
// (--flash), and the PyTorch peers.
#include "bench_gpu.hpp"

#if DMOE_WITH_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "bench/cuda/gemm_bench.hpp"
#include "bench/cuda/gpu_timing.hpp"
#include "bench/cuda/layer_bench.hpp"
#include "bench/cuda/model_bench.hpp"
#include "comm/cuda/bootstrap.hpp"
#include "comm/cuda/gpu_comm.hpp"
#include "comm/cuda/local_comm.hpp"
#include "comm/process_env.hpp"
#include "core/error.hpp"
#include "core/flash_protocol.hpp"
#include "cuda/check.hpp"
#include "cuda/cuda_backend.hpp"
#include "flash/flash_engine.hpp"
#include "model/checkpoint.hpp"
#include "model/config_io.hpp"
#include "model/moe_weights.hpp"
#include "core/output_file.hpp"
#include "data_dir.hpp"

namespace dmoe::cli {

bool gpu_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

namespace {

struct Row {
  std::string engine;
  int world;
  double ms, min_ms, max_ms, tflops, pct_roofline, tokens_per_s, error;
  std::string error_note;
};

void print_row(const Row& r) {
  std::printf("%-16s %3d %10.3f %8.3f %8.3f %9.1f %9.1f %13.4g  %.2e %s\n", r.engine.c_str(), r.world, r.ms, r.min_ms,
              r.max_ms, r.tflops, r.pct_roofline, r.tokens_per_s, r.error, r.error_note.c_str());
}

// bench/peers.py from the data roots (data_dir.hpp); a bad-input error listing where it looked if none has it.
std::string find_peers_script() {
  const std::vector<DataRoot> roots = data_roots();
  const std::string script = find_data_file(roots, "bench/peers.py");
  DMOE_REQUIRE_INPUT(!script.empty(),
                     "--peers: bench/peers.py was not found; looked in, in this order:{}\nset DMOE_HOME to a folder "
                     "holding it (a dmoe source tree or an install's share/dmoe)",
                     describe_search(roots, "bench/peers.py"));
  return script;
}

// Runs bench/peers.py on the data of the dmoe run and returns its JSON (empty on failure, with a note).
nlohmann::json run_peers(const GpuBenchArgs& a, const std::string& script, const MoeConfig& c,
                         const bench::LayerBenchData& data, uint64_t seed) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("dmoe_peers_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    SafetensorsWriter w;
    save_moe_weights(w, hashed_moe_weights(c, seed, 0, c.experts), layer_prefix(0), c.dtype);
    w.write((dir / "weights.safetensors").string());
  }
  {
    SafetensorsWriter x;
    x.add_f32("x", {c.tokens, c.hidden}, data.x, c.dtype);
    x.write((dir / "x.safetensors").string());
    SafetensorsWriter y;
    y.add_f32("y", {c.tokens, c.hidden}, data.y, c.dtype);
    y.add_i32("expert_ids", {c.tokens, c.top_k}, data.expert_ids);
    y.add_f32("expert_weights", {c.tokens, c.top_k}, data.expert_weights, DType::f32);
    y.write((dir / "dmoe.safetensors").string());
  }
  save_config_file(c, (dir / "config.json").string());
  const std::string cmd = fmt::format("{} {} --config {} --weights {} --input {} --dmoe {} --json {}", a.python, script,
                                      (dir / "config.json").string(), (dir / "weights.safetensors").string(),
                                      (dir / "x.safetensors").string(), (dir / "dmoe.safetensors").string(),
                                      (dir / "peers.json").string());
  std::fprintf(stderr, "running PyTorch peers: %s\n", cmd.c_str());
  nlohmann::json out;
  if (std::system(cmd.c_str()) == 0) {
    std::ifstream f(dir / "peers.json");
    out = nlohmann::json::parse(f, nullptr, false);
  } else {
    std::fprintf(stderr, "PyTorch peers failed or PyTorch is missing; their rows are left out\n");
  }
  fs::remove_all(dir);
  return out.is_discarded() ? nlohmann::json() : out;
}

}  // namespace

int run_gpu_layer_bench(const GpuBenchArgs& a) {
  const ProcessEnv env = detect_process_env();
  int devices = 0;
  DMOE_CHECK_CUDA(cudaGetDeviceCount(&devices));
  const int device = choose_device(env, devices);
  MoeConfig c = a.config;
  c.world = env.world;
  c.validate();
  // Before any GPU work: --peers needs bench/peers.py (W = 1 only).
  const std::string peers_script = a.peers && env.world == 1 ? find_peers_script() : std::string();
  auto backend = make_cuda_backend(c.dtype, device);
  const auto stream = static_cast<cudaStream_t>(backend->stream());
  // The largest segment one rank sends another: all its T·k rows (dropless worst case), or Le·C rows
  // on a padded capacity wire.
  const int64_t max_rows = std::max<int64_t>(c.tokens * c.top_k,
                                             c.dropless() ? 0 : int64_t(c.experts_per_rank()) * c.capacity());
  const size_t max_bytes_per_peer = size_t(max_rows) * c.hidden * dtype_size(c.dtype);
  const bool flash_alone = a.engine == EngineKind::flash;
  // Flash at W > 1 keeps its buffers in NVSHMEM's symmetric heap: its communicator must be NVSHMEM's.
  DMOE_REQUIRE_INPUT(!(flash_alone && env.world > 1 && a.comm == "nccl"),
                     "--engine flash at W = {} needs the nvshmem communicator (its buffers live in NVSHMEM's heap); "
                     "allowed: --comm auto or nvshmem", env.world);
  const CommKind comm_kind = flash_alone ? CommKind::nvshmem : parse_comm_kind(a.comm);
  if ((a.flash || flash_alone) && env.world > 1 && !std::getenv("DMOE_NVSHMEM_MIN_HEAP")) {
    // NVSHMEM's heap is fixed at start: room for the communicator and Flash's symmetric region.
    // With a backward, a second (train) Flash engine beside: its region too.
    flash::Shape train_shape = flash::make_shape(c, 1);
    train_shape.train = true;
    const size_t flash_bytes = flash::symmetric_layout(flash::make_shape(c, 1)).bytes +
                               (a.backward ? flash::symmetric_layout(train_shape).bytes : 0);
    ::setenv("DMOE_NVSHMEM_MIN_HEAP", std::to_string(flash_bytes + (size_t(3) << 30)).c_str(), 1);
  }
  std::unique_ptr<Comm> comm = env.world == 1 ? make_local_comm()
                                              : make_gpu_comm(env, comm_kind, max_bytes_per_peer, stream);
  const bool root = env.rank == 0;

  cudaDeviceProp prop;
  DMOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  // Ranks sharing a GPU measure their ceilings at the same time: each sees its share of the GPU.
  comm->barrier(stream);
  const bench::Ceilings ceil = bench::measure_ceilings(stream);
  comm->barrier(stream);
  bench::LayerBenchOptions o;
  o.backward = a.backward;
  o.check_tokens = a.check_tokens;
  o.timing.warmup = a.warmup;
  o.timing.min_iterations = a.min_iterations;
  o.engine.batch_row_multiple = a.batch_row_multiple;
  o.time_alltoall = a.alltoall;
  o.flash = a.flash;
  o.kind = a.engine;
  o.link_ceiling = a.alltoall && env.world > 1 && env.local_world == env.world;
  bench::LayerBenchData data;
  const bench::LayerBenchResult r =
      bench::bench_ep_layer(c, *backend, *comm, ceil, o, root && env.world == 1 && a.peers ? &data : nullptr);

  nlohmann::json rows = nlohmann::json::array();
  if (root) {
    const double m = c.activation == Activation::swiglu ? 3 : 2;
    std::printf("\n%s — %s on %s (%d SMs), rank 0 of %d (%s)\n", a.config_name.c_str(), c.summary().c_str(), prop.name,
                prop.multiProcessorCount, env.world, env.launcher.c_str());
    std::printf("ceilings (this run): bf16 GEMM 8192^3 %.1f TFLOP/s; device copy %.0f GB/s (read+write)\n",
                ceil.gemm_flop_per_s * 1e-12, ceil.copy_byte_per_s * 1e-9);
    std::printf("F = 2*%g*T*k*H*I = %.4g GFLOP/rank; bytes = Lt*%g*H*I*s + 2*T*H*s = %.4g MB/rank (Lt = %d of %d "
                "local experts received rows); roofline = max(F/GEMM, bytes/copy) = %.4f ms; comm = %.4g "
                "MB/rank/direction\n", m, r.flop * 1e-9, m, r.bytes * 1e-6, r.touched_experts, c.experts_per_rank(),
                r.roofline_ms, r.comm_bytes * 1e-6);
    std::printf("GEMM ceiling timed in the same rounds as the forwards: %.1f TFLOP/s -> roofline %.4f ms; "
                "%%roofl* below uses it\n", r.gemm_ceiling_same_rounds * 1e-12, r.roofline_same_rounds_ms);
    std::printf("fwd: forward in inference mode (nothing kept for backward), as the PyTorch peers run it\n");
    std::printf("%-16s %3s %10s %8s %8s %9s %9s %13s  %s\n", "engine", "W", "fwd ms", "min", "max", "TFLOP/s",
                "%roofl", "tokens/s", "rel.err");
    Row row{r.engine, env.world, r.forward.median_ms, r.forward.min_ms, r.forward.max_ms, r.tflops(),
            r.percent_of_roofline(), r.tokens_per_s(), r.max_rel_error,
            fmt::format("(vs fp64 CPU, {} tokens); %roofl* {:.1f}", r.checked_tokens,
                        r.percent_of_roofline_same_rounds())};
    print_row(row);
    nlohmann::json j = {{"config", a.config_name}, {"config_summary", c.summary()}, {"engine", r.engine},
                        {"world", env.world}, {"gpu", prop.name}, {"forward_ms", r.forward.median_ms},
                        {"forward_min_ms", r.forward.min_ms}, {"forward_max_ms", r.forward.max_ms},
                        {"iterations", r.forward.iterations}, {"flop", r.flop}, {"bytes", r.bytes},
                        {"roofline_ms", r.roofline_ms}, {"percent_of_roofline", r.percent_of_roofline()},
                        {"tflops", r.tflops()}, {"tokens_per_s", r.tokens_per_s()}, {"comm_bytes", r.comm_bytes},
                        {"max_rel_error", r.max_rel_error}, {"gemm_ceiling_tflops", ceil.gemm_flop_per_s * 1e-12},
                        {"copy_ceiling_gbps", ceil.copy_byte_per_s * 1e-9},

                        {"gemm_ceiling_same_rounds_tflops", r.gemm_ceiling_same_rounds * 1e-12},
                        {"percent_of_roofline_same_rounds", r.percent_of_roofline_same_rounds()}};
    if (r.forward_train.iterations > 0) j["forward_train_ms"] = r.forward_train.median_ms;
    if (r.flash_forward.iterations > 0) {
      const double fms = r.flash_forward.median_ms;
      Row frow{"flash", env.world, fms, r.flash_forward.min_ms, r.flash_forward.max_ms, r.flop / (fms * 1e-3) * 1e-12,
               r.flash_percent_of_roofline(), double(env.world) * c.tokens / (fms * 1e-3), r.flash_max_rel_error,
               fmt::format("(vs fp64 CPU); {:.3f}x EP; {} blocks; routing {} EP's", r.forward.median_ms / fms,
                           r.flash_grid, r.flash_routing_equal ? "equals" : "DIFFERS FROM")};
      print_row(frow);
      j["flash_forward_ms"] = fms;
      j["flash_forward_min_ms"] = r.flash_forward.min_ms;
      j["flash_forward_max_ms"] = r.flash_forward.max_ms;
      j["flash_percent_of_roofline"] = r.flash_percent_of_roofline();
      j["flash_max_rel_error"] = r.flash_max_rel_error;
      j["flash_speedup_vs_ep"] = r.forward.median_ms / fms;
      j["flash_routing_equal"] = r.flash_routing_equal;
      j["flash_grid"] = r.flash_grid;
      const FlashProfileSummary ps = summarize_flash_profile(r.flash_profile, r.flash_grid);
      std::printf("flash inside the kernel (one profiled forward, %d blocks): span %.3f ms, processors busy %.0f %%, "
                  "producer waiting for inputs median %.3f ms (max %.3f), %.0f tasks per block\n", r.flash_grid,
                  ps.span_ms, 100.0 * ps.processors_busy, ps.producer_wait_median_ms, ps.producer_wait_max_ms,
                  ps.tasks_per_block_median);
      nlohmann::json phases = nlohmann::json::array();
      for (const auto& ph : ps.phases) {
        std::printf("flash phase  %-36s median %.3f ms  max %.3f ms\n", ph.name, ph.median_ms, ph.max_ms);
        phases.push_back({{"phase", ph.name}, {"median_ms", ph.median_ms}, {"max_ms", ph.max_ms}});
      }
      j["flash_phases"] = phases;
      j["flash_span_ms"] = ps.span_ms;
      j["flash_processors_busy"] = ps.processors_busy;
    }
    if (r.forward_train.iterations > 0)  // not for Flash alone: made for forwards only
      std::printf("%-16s %3d %10.3f %8.3f %8.3f %9.1f %9.1f  (forward that keeps what backward needs; the row "
                  "above keeps nothing)\n", (r.engine + " train").c_str(), env.world, r.forward_train.median_ms,
                  r.forward_train.min_ms, r.forward_train.max_ms, r.flop / (r.forward_train.median_ms * 1e-3) * 1e-12,
                  100.0 * r.roofline_ms / r.forward_train.median_ms);
    if (r.forward_backward.iterations > 0) {
      j["forward_backward_ms"] = r.forward_backward.median_ms;
      std::printf("%-16s %3d %10.3f %8.3f %8.3f %9.1f  (a training step: zero_grads, forward, backward; 3F)\n", (r.engine + " f+b").c_str(),
                  env.world, r.forward_backward.median_ms, r.forward_backward.min_ms, r.forward_backward.max_ms,
                  3 * r.flop / (r.forward_backward.median_ms * 1e-3) * 1e-12);
    }
    if (r.flash_forward_backward.iterations > 0) {
      const auto& f = r.flash_forward_backward;
      j["flash_forward_backward_ms"] = f.median_ms;
      j["flash_step_speedup_vs_ep"] = r.forward_backward.median_ms / f.median_ms;
      j["flash_dx_rel_diff_vs_ep"] = r.flash_dx_rel_diff;
      j["flash_dw_rel_diff_vs_ep"] = r.flash_dw_rel_diff;
      std::printf("%-16s %3d %10.3f %8.3f %8.3f %9.1f  (Flash's training step, same rounds: %.3fx EP's; dx %.2e and "
                  "dW %.2e from EP's, relative)\n", "flash f+b", env.world, f.median_ms, f.min_ms, f.max_ms,
                  3 * r.flop / (f.median_ms * 1e-3) * 1e-12, r.forward_backward.median_ms / f.median_ms,
                  r.flash_dx_rel_diff, r.flash_dw_rel_diff);
      nlohmann::json stages = nlohmann::json::array();
      for (const auto& [name, ms] : r.flash_backward_stages) {
        std::printf("flash backward stage  %-52s %.3f ms\n", name.c_str(), ms);
        stages.push_back({{"stage", name}, {"ms", ms}});
      }
      j["flash_backward_stages"] = stages;
    }
    if (r.alltoall.iterations > 0) {
      const double gbps = r.alltoall_bytes / (r.alltoall.median_ms * 1e-3) * 1e-9;
      j["alltoall_ms"] = r.alltoall.median_ms;
      j["alltoall_bytes"] = r.alltoall_bytes;
      j["alltoall_gbps_per_gpu"] = gbps;
      std::printf("all-to-all alone (%s, uniform, %.4g MB to other ranks per rank): %.3f ms (min %.3f, max %.3f)"
                  " = %.1f GB/s per GPU per direction\n",
                  r.engine.c_str(), r.alltoall_bytes * 1e-6, r.alltoall.median_ms, r.alltoall.min_ms,
                  r.alltoall.max_ms, gbps);
      // The link ceiling: the better of the two ways, per direction.
      nlohmann::json links = nlohmann::json::array();
      for (const auto& l : r.link) {
        const double ce = l.bytes / (l.copy_engine_ms * 1e-3) * 1e-9, sm = l.bytes / (l.sm_store_ms * 1e-3) * 1e-9;
        links.push_back({{"bytes", l.bytes}, {"copy_engine_gbps", ce}, {"sm_store_gbps", sm}});
        // The first ceiling is at the exchange's bytes: the one the all-to-all is set against.
        const std::string against =
            &l == &r.link.front()
                ? fmt::format(" -> the all-to-all above at {:.0f} % of the better", 100.0 * gbps / std::max(ce, sm))
                : std::string();
        std::printf("link ceiling (this run; every GPU pushing %.4g MB into the next rank's GPU at once, slowest "
                    "rank): copy engine %.1f GB/s, SM stores %.1f GB/s per direction%s\n",
                    l.bytes * 1e-6, ce, sm, against.c_str());
      }
      if (!r.link.empty()) j["link_ceiling"] = links;
    }
    rows.push_back(j);
  }
  if (root && env.world == 1 && a.peers) {
    const nlohmann::json peers = run_peers(a, peers_script, c, data, o.seed);
    if (peers.contains("peers"))
      for (auto& [name, p] : peers["peers"].items()) {
        if (p.contains("skipped")) {
          std::printf("%-16s skipped: %s\n", ("torch-" + name).c_str(), p["skipped"].get<std::string>().c_str());
          continue;
        }
        const double ms = p["median_ms"];
        Row row{"torch-" + name, 1, ms, p["min_ms"], p["max_ms"], r.flop / (ms * 1e-3) * 1e-12,
                100.0 * r.roofline_ms / ms, double(c.tokens) / (ms * 1e-3), p["rel_error_vs_dmoe"],
                fmt::format("(vs dmoe, same routing; own routing differs on {:.2f}% of tokens)",
                            100.0 * p["tokens_routed_differently"].get<double>())};
        print_row(row);
        rows.push_back({{"config", a.config_name}, {"engine", row.engine}, {"world", 1}, {"forward_ms", ms},
                        {"percent_of_roofline", row.pct_roofline}, {"tflops", row.tflops},
                        {"rel_error_vs_dmoe", row.error}, {"torch", peers.value("torch", "")}});
      }
  }
  // Destroying a GPU communicator is collective; NVSHMEM, when it was started, ends with the process.
  comm.reset();
  if (nvshmem_is_initialized()) finalize_nvshmem();
  if (root && !a.json_path.empty()) {
    write_file_atomically(a.json_path, rows.dump(2) + "\n");
    std::printf("wrote %s\n", a.json_path.c_str());
  }
  return 0;
}

int run_gpu_gemm_bench(const GpuBenchArgs& a) {
  MoeConfig c = a.config;
  c.world = 1;
  c.validate();
  DMOE_CHECK_CUDA(cudaSetDevice(0));
  cudaStream_t stream;
  DMOE_CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop;
  DMOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const auto variants = bench::parse_gemm_variants(a.gemm_variants);
  const bench::Ceilings ceil = bench::measure_ceilings(stream);
  auto rows = bench::bench_expert_gemms(c, variants, a.gemm_square, stream);
  if (a.gemm_dgrad) {
    const auto dgrad = bench::bench_dgrad_gemms(c, variants, stream);
    rows.insert(rows.end(), dgrad.begin(), dgrad.end());
  }
  if (a.gemm_wgrad) {
    const auto wgrad = bench::bench_wgrad_gemms(c, stream);
    rows.insert(rows.end(), wgrad.begin(), wgrad.end());
  }
  std::printf("\n%s — %s on %s (%d SMs): expert GEMMs of dmoe's own kernel, inference (h only)\n",
              a.config_name.c_str(), c.summary().c_str(), prop.name, prop.multiProcessorCount);
  std::printf("ceilings (this run): bf16 GEMM 8192^3 %.1f TFLOP/s; device copy %.0f GB/s\n",
              ceil.gemm_flop_per_s * 1e-12, ceil.copy_byte_per_s * 1e-9);
  if (a.gemm_dgrad)
    std::printf("dh, dx: the backward's input-gradient products (GroupedGemmNN: B MN-major; SwiGLU's dx one product "
                "over 2I) per variant, and on cuBLAS as expert_ffn_backward runs them (variant cublas)\n");
  if (a.gemm_wgrad)
    std::printf("dw1, dw3, dw2: the backward's weight gradients C_e (+)= A_e^T * B_e over each expert's rows (m x n "
                "outputs, k = the expert's rows), stored and accumulated, on the sm90 kernel (sm90red: accumulating "
                "by L2 reductions), the mma.sync kernel (mma) and one cuBLAS call per expert (cublas); GB/s = "
                "(N*(m + n)*2 + Le*m*n*4 (x2 accumulating)) / median, Le = experts with rows: the least DRAM traffic "
                "(operands once, C written, and read when accumulating)\n");
  std::printf("TFLOP/s = 2*N*n*k / median; tile loads = sum over tiles and k-blocks of (BM + BN rows) * 128 B, "
              "per second\n");
  std::printf("%-10s %-14s %10s %10s %10s %9s %14s %8s\n", "variant", "product", "median us", "min", "max", "TFLOP/s",
              "tile loads TB/s", "GB/s");
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : rows) {
    const double s = r.stats.median_ms * 1e-3;
    const std::string gbps = r.min_bytes > 0 ? fmt::format("{:.0f}", r.min_bytes / s * 1e-9) : "-";
    const std::string tiles = r.tile_load_bytes > 0 ? fmt::format("{:.2f}", r.tile_load_bytes / s * 1e-12) : "-";
    std::printf("%-10s %-14s %10.1f %10.1f %10.1f %9.1f %14s %8s\n", r.variant.c_str(), r.product.c_str(),
                r.stats.median_ms * 1e3, r.stats.min_ms * 1e3, r.stats.max_ms * 1e3, r.flop / s * 1e-12, tiles.c_str(),
                gbps.c_str());
    out.push_back({{"config", a.config_name}, {"variant", r.variant}, {"product", r.product},
                   {"median_ms", r.stats.median_ms}, {"min_ms", r.stats.min_ms}, {"max_ms", r.stats.max_ms},
                   {"tflops", r.flop / s * 1e-12}, {"tile_load_tbps", r.tile_load_bytes / s * 1e-12},
                   {"min_bytes_gbps", r.min_bytes / s * 1e-9}, {"gemm_ceiling_tflops", ceil.gemm_flop_per_s * 1e-12}});
  }
  DMOE_CHECK_CUDA(cudaStreamDestroy(stream));
  if (!a.json_path.empty()) {
    write_file_atomically(a.json_path, out.dump(2) + "\n");
    std::printf("wrote %s\n", a.json_path.c_str());
  }
  return 0;
}

int run_gpu_model_bench(const ModelBenchArgs& a) {
  DMOE_CHECK_CUDA(cudaSetDevice(0));
  cudaDeviceProp prop;
  DMOE_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  bench::ModelBenchOptions o;
  o.batch = a.batch;
  o.seq = a.seq;
  o.dtype = a.dtype;
  o.warmup = a.warmup;
  o.min_iterations = a.repeat;
  o.bf16_expert_grads = a.bf16_expert_grads;
  const bench::ModelBenchResult r = bench::bench_model_step(a.config, o);
  if (r.rank != 0) return 0;  // rank 0 reports for the job
  const double n = double(a.batch) * double(a.seq) * r.world;  // tokens of a step over all ranks
  const double step_s = r.step.median_ms * 1e-3, fwd_s = r.forward.median_ms * 1e-3;
  // FLOP/s of the whole job against the ceiling of the GPUs it runs on (ranks sharing one GPU under MPS share its
  // ceiling; W ranks on W GPUs have W of them). The ceiling is rank 0's, timed in the same rounds.
  int visible = 1;
  DMOE_CHECK_CUDA(cudaGetDeviceCount(&visible));
  const int gpus = std::max(1, std::min(r.world, visible));
  const double job_flop = r.step_flop * r.world, job_fwd_flop = r.forward_flop * r.world;
  const double mfu = job_flop / step_s / (r.gemm_ceiling_flop_per_s * gpus);
  std::printf("\n%s — %s, %.3g parameters, batch %lld x seq %lld per rank, %d rank%s, %s, on %s\n",
              a.config_name.c_str(), a.config.summary().c_str(), r.parameters, (long long)a.batch, (long long)a.seq,
              r.world, r.world == 1 ? "" : "s (tokens/s, TFLOP/s and MFU of the whole job; FLOP per rank below)",
              dtype_name(a.dtype), prop.name);
  std::printf("FLOP per rank: forward %.4g, step 3 x forward = %.4g (formula: src/bench/cuda/model_bench.hpp); bf16 GEMM "
              "ceiling in the same rounds %.1f TFLOP/s; expert gradients %s\n", r.forward_flop, r.step_flop,
              r.gemm_ceiling_flop_per_s * 1e-12, r.bf16_expert_grads ? "bf16" : "f32");
  if (gpus < r.world)
    std::printf("ranks share a GPU (MPS): the MFU column is against rank 0's ceiling timed while the other ranks run, "
                "so it overstates; compare tokens/s with W = 1 instead\n");
  std::printf("%-26s %10s %10s %10s %12s %9s %8s\n", "", "median ms", "min", "max", "tokens/s", "TFLOP/s", "MFU");
  std::printf("%-26s %10.2f %10.2f %10.2f %12.0f %9.1f %7.1f%%\n", "training step (fwd+bwd+opt)", r.step.median_ms,
              r.step.min_ms, r.step.max_ms, n / step_s, job_flop / step_s * 1e-12, 100 * mfu);
  std::printf("%-26s %10.2f %10.2f %10.2f %12.0f %9.1f %7.1f%%\n", "forward (with the loss)", r.forward.median_ms,
              r.forward.min_ms, r.forward.max_ms, n / fwd_s, job_fwd_flop / fwd_s * 1e-12,
              100 * job_fwd_flop / fwd_s / (r.gemm_ceiling_flop_per_s * gpus));
  std::printf("%-26s %10.2f %10.2f %10.2f   (backward = this - forward: %.2f ms)\n", "forward + backward",
              r.forward_backward.median_ms, r.forward_backward.min_ms, r.forward_backward.max_ms,
              r.forward_backward.median_ms - r.forward.median_ms);
  std::printf("%-26s %10.2f %10.2f %10.2f   (%.1f GB/s over the %.2f GiB of parameter buffers)\n",
              "optimizer (norm + AdamW)", r.optimizer.median_ms, r.optimizer.min_ms, r.optimizer.max_ms,
              r.parameter_bytes / (r.optimizer.median_ms * 1e-3) * 1e-9, r.parameter_bytes / double(1ull << 30));
  double staged = 0;
  for (const auto& st : r.stages) staged += st.second;
  std::printf("time per stage of a step (ms; all layers; events on the stream, host waits included; sum %.2f):\n",
              staged);
  for (const auto& [name, ms] : r.stages)
    std::printf("  %-46s %9.2f %6.1f%%\n", name.c_str(), ms, 100 * ms / std::max(staged, 1e-9));
  std::printf("device memory in use after the steps %.2f GiB (parameter buffers %.2f GiB); loss %.4f -> %.4f over "
              "%d steps\n", r.device_bytes_in_use / double(1ull << 30), r.parameter_bytes / double(1ull << 30),
              r.loss_first, r.loss_last, r.step.iterations + a.warmup);
  if (!a.json_path.empty()) {
    nlohmann::json j{{"config", a.config_name}, {"world", r.world}, {"gpus", gpus}, {"batch", a.batch}, {"seq", a.seq}, {"dtype", dtype_name(a.dtype)},
                     {"gpu", prop.name}, {"parameters", r.parameters}, {"step_median_ms", r.step.median_ms},
                     {"step_min_ms", r.step.min_ms}, {"step_max_ms", r.step.max_ms},
                     {"step_iterations", r.step.iterations}, {"forward_median_ms", r.forward.median_ms},
                     {"expert_grads", r.bf16_expert_grads ? "bf16" : "f32"},
                     {"forward_backward_median_ms", r.forward_backward.median_ms},
                     {"optimizer_median_ms", r.optimizer.median_ms},
                     {"stages_ms", [&] {
                        nlohmann::json st = nlohmann::json::object();
                        for (const auto& [name, ms] : r.stages) st[name] = ms;
                        return st;
                      }()},
                     {"step_flop", r.step_flop}, {"forward_flop", r.forward_flop},
                     {"gemm_ceiling_tflops", r.gemm_ceiling_flop_per_s * 1e-12}, {"mfu", mfu},
                     {"tokens_per_s", n / step_s}, {"device_bytes_in_use", r.device_bytes_in_use},
                     {"parameter_bytes", r.parameter_bytes}, {"loss_first", r.loss_first}, {"loss_last", r.loss_last}};
    write_file_atomically(a.json_path, j.dump(2) + "\n");
    std::printf("wrote %s\n", a.json_path.c_str());
  }
  return 0;
}

}  // namespace dmoe::cli

#else

namespace dmoe::cli {
bool gpu_available() { return false; }
int run_gpu_layer_bench(const GpuBenchArgs&) { return 1; }
int run_gpu_gemm_bench(const GpuBenchArgs&) { return 1; }
int run_gpu_model_bench(const ModelBenchArgs&) { return 1; }
}  // namespace dmoe::cli

#endif
