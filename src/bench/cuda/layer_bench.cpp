#include "bench/cuda/layer_bench.hpp"

#include <algorithm>
#include <functional>
#include <memory>
#include <cmath>
#include <map>
#include <mutex>
#include <thread>

#include "core/dispatch_plan.hpp"
#include "core/error.hpp"
#include "cpu/kernels.hpp"
#include "cuda/check.hpp"
#include "engine/ep_engine.hpp"
#include "engine/moe_engine.hpp"
#include "flash/flash_engine.hpp"
#include "model/moe_weights.hpp"

namespace dmoe::bench {

namespace {

// fp64 expert FFN of one token row (the reference for the sampled check).
std::vector<double> ffn_fp64(const MoeWeights& w, int32_t local, const float* x, Activation act) {
  const int64_t H = w.hidden, I = w.ffn;
  const float* w1 = w.w1_of(local);
  const float* w3 = w.w3_of(local);
  const float* w2 = w.w2_of(local);
  std::vector<double> h(I), out(H, 0.0);
  for (int64_t i = 0; i < I; ++i) {
    double a = 0, b = 0;
    for (int64_t c = 0; c < H; ++c) a += double(w1[i * H + c]) * x[c];
    if (act == Activation::swiglu) {
      for (int64_t c = 0; c < H; ++c) b += double(w3[i * H + c]) * x[c];
      h[i] = a / (1 + std::exp(-a)) * b;
    } else if (act == Activation::relu) {
      h[i] = a > 0 ? a : 0;
    } else {
      h[i] = 0.5 * a * (1 + std::erf(a / std::sqrt(2.0)));
    }
  }
  for (int64_t c = 0; c < H; ++c) {
    double acc = 0;
    for (int64_t i = 0; i < I; ++i) acc += double(w2[c * I + i]) * h[i];
    out[c] = acc;
  }
  return out;
}

// Every rank's `value` (allreduce of a W-slot vector, each rank filling its own slot).
std::vector<double> gather_doubles(double value, Backend& backend, Comm& comm) {
  const int32_t W = comm.world();
  std::vector<double> all(size_t(W), 0.0);
  all[size_t(comm.rank())] = value;
  void* d = backend.allocate(all.size() * sizeof(double));
  backend.upload(d, all.data(), all.size() * sizeof(double));
  comm.allreduce_sum(d, W, DType::f64, backend.stream());
  backend.download(all.data(), d, all.size() * sizeof(double));
  backend.release(d);
  return all;
}

// The link ceiling beside the all-to-all (LayerBenchResult::link): each rank pushes into the GPU of the
// next rank, all at once. Skipped on every rank alike when ranks share a GPU (several pushes would split
// one GPU's links, and part of the exchange would not cross a link at all) or a next GPU is not reachable
// peer-to-peer.
std::vector<LayerBenchResult::LinkCeiling> measure_link_ceiling(Backend& backend, Comm& comm, size_t exchange_bytes) {
  const int32_t W = comm.world(), rank = comm.rank();
  int device = 0;
  DMOE_CHECK_CUDA(cudaGetDevice(&device));
  std::vector<double> devices = gather_doubles(device, backend, comm);
  const int peer = int(devices[size_t((rank + 1) % W)]);
  // Shared GPUs: decided from the gathered list alone, so every rank decides alike.
  std::sort(devices.begin(), devices.end());
  if (std::adjacent_find(devices.begin(), devices.end()) != devices.end()) return {};
  int can = 0;
  if (peer != device) DMOE_CHECK_CUDA(cudaDeviceCanAccessPeer(&can, device, peer));
  const std::vector<double> usable = gather_doubles(can ? 1 : 0, backend, comm);
  if (std::any_of(usable.begin(), usable.end(), [](double u) { return u == 0; })) return {};

  void* token = backend.allocate(sizeof(int64_t));
  backend.zero(token, sizeof(int64_t));
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  std::vector<LayerBenchResult::LinkCeiling> out;
  for (const size_t bytes : {exchange_bytes, size_t(256) << 20}) {
    const PeerPushTimes t = time_peer_push(
        peer, bytes, stream, [&] { comm.allreduce_sum(token, 1, DType::i64, backend.stream()); });
    const std::vector<double> ce = gather_doubles(t.copy_engine.median_ms, backend, comm);
    const std::vector<double> sm = gather_doubles(t.sm_store.median_ms, backend, comm);
    out.push_back({double(bytes), *std::max_element(ce.begin(), ce.end()), *std::max_element(sm.begin(), sm.end())});
  }
  backend.release(token);
  return out;
}

}  // namespace

LayerBenchResult bench_ep_layer(const MoeConfig& c, Backend& backend, Comm& comm, const Ceilings& ceilings,
                                const LayerBenchOptions& o, LayerBenchData* keep) {
  c.validate();
  const int32_t rank = comm.rank(), W = c.world, Le = c.experts_per_rank();
  const int64_t T = c.tokens, H = c.hidden, I = c.ffn;
  const bool bf16 = c.dtype == DType::bf16;
  const size_t elem = dtype_size(backend.storage_dtype());
  const double m = c.activation == Activation::swiglu ? 3 : 2;

  DMOE_REQUIRE(!(o.flash && o.kind != EngineKind::ep), "bench_ep_layer: Flash beside EP needs kind ep");
  MoeEngineOptions engine_options;
  engine_options.ep = o.engine;
  engine_options.backward = o.backward;
  const std::unique_ptr<MoeEngine> engine_ptr = make_moe_engine(o.kind, c, backend, comm, engine_options);
  MoeEngine& engine = *engine_ptr;
  const bool train = engine.supports_backward();  // Flash alone: inference forwards only
  const MoeWeights weights = hashed_moe_weights(c, o.seed, c.first_expert(rank), Le);
  engine.set_weights(weights);
  std::unique_ptr<FlashEngine> flash;  // beside EP (o.flash)
  if (o.flash) {
    flash = std::make_unique<FlashEngine>(c, comm);
    flash->set_weights(weights);
  }
  const std::vector<float> x_all = hashed_activations(o.seed + 1, W * T, H, bf16);
  const std::vector<float> x(x_all.begin() + rank * T * H, x_all.begin() + (rank + 1) * T * H);
  void* xd = backend.allocate(T * H * elem);
  void* yd = backend.allocate(T * H * elem);
  backend.upload_f32(xd, x.data(), T * H);

  GpuTimer timer(static_cast<cudaStream_t>(backend.stream()));
  TimingOptions timing = o.timing;
  void* n_dev = nullptr;
  if (W > 1) {
    // Every rank runs rank 0's iteration count (the engine's collectives need all ranks each time).
    n_dev = backend.allocate(sizeof(int64_t));
    timing.agree_iterations = [&backend, &comm, n_dev](int wanted) {
      int64_t n = wanted;
      backend.upload(n_dev, &n, sizeof(n));
      comm.broadcast(n_dev, 1, DType::i64, 0, backend.stream());
      backend.download(&n, n_dev, sizeof(n));
      return int(n);
    };
  }
  LayerBenchResult r;
  r.engine = o.kind == EngineKind::flash ? std::string("flash") : std::string("ep-") + comm.name();
  r.config = c;
  // Interleaved, so that the comparison of the two modes does not depend on which ran first; the GEMM
  // ceiling's product runs in the same rounds, for a ceiling at the clocks the layer runs at.
  CeilingGemm ceiling_gemm(static_cast<cudaStream_t>(backend.stream()));
  void* flash_y = flash ? backend.allocate(T * H * elem) : nullptr;
  const auto stream = static_cast<cudaStream_t>(backend.stream());
  // The order of EP's rounds as before Flash alone existed: inference, train, ceiling, Flash beside.
  std::vector<std::function<void()>> timed = {[&] { engine.forward(xd, yd, ForwardMode::inference); }};
  if (train) timed.push_back([&] { engine.forward(xd, yd, ForwardMode::train); });
  timed.push_back([&] { ceiling_gemm.run(); });
  if (flash) timed.push_back([&] { flash->forward(xd, flash_y, stream); });
  const std::vector<Stats> fwd = timer.time_interleaved(timed, timing);
  r.forward = fwd[0];
  if (train) r.forward_train = fwd[1];
  r.gemm_ceiling_same_rounds = CeilingGemm::flop() / (fwd[train ? 2 : 1].median_ms * 1e-3);
  engine.finish();  // Flash alone: a forward that flagged an error (NaN routing) fails here
  if (flash) {
    r.flash_forward = fwd.back();
    r.flash_grid = flash->grid();
    flash->check(stream);
  }
  if (o.backward && train) {
    void* dyd = backend.allocate(T * H * elem);
    void* dxd = backend.allocate(T * H * elem);
    const auto dy = hashed_activations(o.seed + 2, T, H, bf16);
    backend.upload_f32(dyd, dy.data(), T * H);
    // One micro-batch's training step: the gradients start from zero_grads (the backward then writes the
    // experts' gradients instead of adding to zeros), as when each optimizer step takes one micro-batch.
    std::vector<std::function<void()>> steps = {[&] {
      engine.zero_grads();
      engine.forward(xd, yd, ForwardMode::train);
      engine.backward(dyd, dxd);
    }};
    // Flash's training step beside (an engine made for training: its forwards keep the backward's state),
    // interleaved with EP's so that both see the same clocks.
    std::unique_ptr<MoeEngine> flash_train;
    void* fdx = nullptr;
    void* fy = nullptr;
    if (o.flash) {
      MoeEngineOptions fo;
      fo.backward = true;
      flash_train = make_moe_engine(EngineKind::flash, c, backend, comm, fo);
      flash_train->set_weights(weights);
      fdx = backend.allocate(T * H * elem);
      fy = backend.allocate(T * H * elem);
      steps.push_back([&] {
        flash_train->zero_grads();
        flash_train->forward(xd, fy, ForwardMode::train);
        flash_train->backward(dyd, fdx);
      });
    }
    const std::vector<Stats> st = timer.time_interleaved(steps, timing);
    r.forward_backward = st[0];
    if (flash_train) {
      r.flash_forward_backward = st[1];
      flash_train->finish();
      engine.finish();
      // The last step of each: dx and the experts' gradients side by side (same weights, x, dy).
      std::vector<float> a(size_t(T * H)), b(size_t(T * H));
      backend.download_f32(a.data(), fdx, T * H);
      backend.download_f32(b.data(), dxd, T * H);
      auto rel = [](const std::vector<float>& u, const std::vector<float>& v) {
        double num = 0, den = 0;
        for (size_t i = 0; i < u.size(); ++i) {
          num += (double(u[i]) - v[i]) * (double(u[i]) - v[i]);
          den += double(v[i]) * v[i];
        }
        return std::sqrt(num / std::max(den, 1e-300));
      };
      r.flash_dx_rel_diff = rel(a, b);
      const MoeWeights gf = flash_train->grads(), ge = engine.grads();
      r.flash_dw_rel_diff = std::max(rel(gf.w1, ge.w1), rel(gf.w2, ge.w2));
      // One more step with the backward's stage boundaries recorded: where its time goes.
      flash_train->set_stage_timing(true);
      flash_train->zero_grads();
      flash_train->forward(xd, fy, ForwardMode::train);
      flash_train->backward(dyd, fdx);
      r.flash_backward_stages = flash_train->stage_times();
      flash_train->set_stage_timing(false);
      backend.release(fdx);
      backend.release(fy);
    }
    backend.release(dyd);
    backend.release(dxd);
  }
  engine.forward(xd, yd, ForwardMode::inference);  // a last, untimed forward whose outputs are checked
  engine.finish();

  r.flop = 2 * m * double(T) * c.top_k * double(H) * double(I);
  // Only the experts that received rows have their weights read (decode at T = 1 touches k of E).
  r.touched_experts = 0;
  for (const int64_t rows : engine.expert_rows()) r.touched_experts += rows > 0 ? 1 : 0;
  r.bytes = double(r.touched_experts) * m * double(H) * double(I) * elem + 2.0 * double(T) * double(H) * elem;
  r.roofline_ms = std::max(r.flop / ceilings.gemm_flop_per_s, r.bytes / ceilings.copy_byte_per_s) * 1e3;
  r.roofline_same_rounds_ms =
      std::max(r.flop / r.gemm_ceiling_same_rounds, r.bytes / ceilings.copy_byte_per_s) * 1e3;
  const int64_t off_rank_rows = engine.rows_sent_to_peers();
  r.comm_bytes = double(off_rank_rows) * double(H) * double(elem);

  if (o.time_alltoall && W > 1) {
    // Every rank must run the same all-to-all: the mean over ranks of the rows sent off-rank, spread
    // evenly over the W − 1 peers.
    backend.upload(n_dev, &off_rank_rows, sizeof(int64_t));
    comm.allreduce_sum(n_dev, 1, DType::i64, backend.stream());
    int64_t total_rows = 0;
    backend.download(&total_rows, n_dev, sizeof(int64_t));
    const int64_t pairs = int64_t(W) * (W - 1);
    const int64_t per_peer = std::max<int64_t>(1, (total_rows + pairs - 1) / pairs) * H;  // elements
    void* send = backend.allocate(size_t(W) * per_peer * elem);
    void* recv = backend.allocate(size_t(W) * per_peer * elem);
    backend.zero(send, size_t(W) * per_peer * elem);
    r.alltoall = timer.time(
        [&] { comm.alltoall(send, recv, per_peer, backend.storage_dtype(), backend.stream()); }, timing);
    r.alltoall_bytes = double(W - 1) * double(per_peer) * double(elem);
    backend.release(send);
    backend.release(recv);
    if (o.link_ceiling) r.link = measure_link_ceiling(backend, comm, size_t(r.alltoall_bytes));
  }

  // Check a sample of this rank's tokens against the fp64 CPU computation with each engine's routing.
  std::vector<float> y(T * H);
  backend.download_f32(y.data(), yd, T * H);
  const auto ids = engine.expert_ids();
  const auto ws = engine.expert_weights();
  const int n_check = int(std::min<int64_t>(o.check_tokens, T));
  std::map<int32_t, MoeWeights> experts;  // only the experts the sample needs
  auto sample_error = [&](const std::vector<float>& yv, const std::vector<int32_t>& idv, const std::vector<float>& wv) {
    const SendPlan plan = build_send_plan(idv.data(), wv.data(), T, c.top_k, c.experts, c.capacity(), c.drop_policy);
    for (int i = 0; i < n_check; ++i) {
      const int64_t t = i * T / std::max(n_check, 1);
      for (int32_t j = 0; j < c.top_k; ++j)
        if (plan.slot[t * c.top_k + j] >= 0 && !experts.count(idv[t * c.top_k + j]))
          experts.emplace(idv[t * c.top_k + j], hashed_moe_weights(c, o.seed, idv[t * c.top_k + j], 1));
    }
    std::vector<double> errors(n_check, 0.0);
    std::vector<std::thread> pool;
    for (int i = 0; i < n_check; ++i)
      pool.emplace_back([&, i] {
        const int64_t t = i * T / std::max(n_check, 1);
        std::vector<double> ref(H, 0.0);
        for (int32_t j = 0; j < c.top_k; ++j) {
          if (plan.slot[t * c.top_k + j] < 0) continue;
          const auto out = ffn_fp64(experts.at(idv[t * c.top_k + j]), 0, x.data() + t * H, c.activation);
          for (int64_t col = 0; col < H; ++col) ref[col] += double(wv[t * c.top_k + j]) * out[col];
        }
        double num = 0, den = 0;
        for (int64_t col = 0; col < H; ++col) {
          num += (yv[t * H + col] - ref[col]) * (yv[t * H + col] - ref[col]);
          den += ref[col] * ref[col];
        }
        errors[i] = std::sqrt(num / std::max(den, 1e-300));
      });
    for (auto& th : pool) th.join();
    double worst = 0;
    for (double e : errors) worst = std::max(worst, e);
    return worst;
  };
  r.max_rel_error = sample_error(y, ids, ws);
  r.checked_tokens = n_check;
  if (flash) {
    flash->forward(xd, flash_y, stream);
    flash->check(stream);
    std::vector<float> fy(T * H);
    backend.download_f32(fy.data(), flash_y, T * H);
    const auto fids = flash->expert_ids(stream);
    r.flash_routing_equal = fids == ids;
    r.flash_max_rel_error = sample_error(fy, fids, flash->expert_weights(stream));
    flash->set_profiling(true);  // one more forward, timed inside the kernel, for where the time goes
    flash->forward(xd, flash_y, stream);
    r.flash_profile = flash->profile(stream);
    flash->set_profiling(false);
    backend.release(flash_y);
  }

  if (keep) {
    keep->x = x;
    keep->y = std::move(y);
    keep->expert_ids = ids;
    keep->expert_weights = ws;
  }
  backend.release(xd);
  backend.release(yd);
  if (n_dev) backend.release(n_dev);
  return r;
}

}  // namespace dmoe::bench
