// cpu/flash.cpp — the CPU twin of the Flash kernel (flash/flash_kernel.cu): the same protocol
// (core/flash_protocol.hpp) over the same buffers, one thread per rank, host memory standing in for the
// symmetric heap. It is the specification of what the kernel moves where: row placement, metadata,
// signals with epochs and parities, the arrival count that ends a forward. The math calls the CPU kernels
// the reference engine calls (router, expert FFN over each expert's rows in canonical order, combine), so
// its outputs equal the reference engine's bit for bit.
//
// Differences forced by the host: one "block" (grid = 1); an expert's tiles run as one call once all its
// sources have landed (the tile table itself is tested separately); f32 storage (bf16 emulated by rounding,
// as everywhere on the CPU).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include "core/error.hpp"
#include "core/flash_protocol.hpp"
#include "cpu/kernels.hpp"

namespace dmoe::cpu {

namespace {

using Clock = std::chrono::steady_clock;

uint64_t load_acquire(const uint64_t* p) { return std::atomic_ref<const uint64_t>(*p).load(std::memory_order_acquire); }
void store_release(uint64_t* p, uint64_t v) { std::atomic_ref<uint64_t>(*p).store(v, std::memory_order_release); }
void add_release(uint64_t* p, uint64_t v) { std::atomic_ref<uint64_t>(*p).fetch_add(v, std::memory_order_acq_rel); }

// Spins until pred(value) holds; past the time limit throws naming the rank, role and what was awaited.
template <typename Pred>
uint64_t wait_for(const uint64_t* flag, Pred pred, const flash::Params& p, int32_t role, int32_t what, int32_t slot,
                  uint64_t expected) {
  uint64_t v = load_acquire(flag);
  if (pred(v)) return v;
  const auto start = Clock::now();
  for (int spin = 0;; ++spin) {
    v = load_acquire(flag);
    if (pred(v)) return v;
    if (spin > 64) std::this_thread::yield();
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
    if (uint64_t(waited) > p.timeout_ns)
      DMOE_FAIL("flash (CPU twin) rank {}: the {} role waited {} ms for {} (slot {}): expected {:#x}, last seen {:#x}",
                p.rank, flash::role_name(role), waited / 1000000, flash::wait_name(what), slot, expected, v);
  }
}

}  // namespace

void flash_forward(const flash::Params& p) {
  const flash::Shape& s = p.shape;
  DMOE_REQUIRE(s.grid == 1, "cpu::flash_forward: grid = {}; the CPU twin runs one block", s.grid);
  DMOE_REQUIRE(s.world >= 1 && s.experts % s.world == 0, "cpu::flash_forward: E = {} not divisible by W = {}",
               s.experts, s.world);
  const int64_t T = s.tokens, H = s.hidden, I = s.ffn;
  const int32_t E = s.experts, k = s.top_k, W = s.world, Le = s.local_experts(), r = p.rank;
  const int64_t R = s.recv_rows();
  const flash::SymmetricLayout sl = flash::symmetric_layout(s);
  const flash::LocalLayout ll = flash::local_layout(s);
  auto* control = reinterpret_cast<flash::Control*>(p.local + ll.control);
  const auto* peers = reinterpret_cast<const uint64_t*>(p.local + ll.peers);
  auto peer = [&](int32_t d) { return reinterpret_cast<char*>(peers[d]); };
  const uint32_t epoch = control->epoch + 1;
  const uint32_t parity = epoch & 1;
  auto recv_of = [&](char* base) { return reinterpret_cast<float*>(base + sl.recv) + size_t(parity) * R * H; };
  auto meta_of = [&](char* base) { return reinterpret_cast<flash::RowMeta*>(base + sl.meta) + size_t(parity) * R; };
  auto counts_of = [&](char* base) { return reinterpret_cast<uint64_t*>(base + sl.counts) + size_t(parity) * W * E; };
  auto ready_of = [&](char* base) { return reinterpret_cast<uint64_t*>(base + sl.ready) + size_t(parity) * W; };
  auto* arrived = reinterpret_cast<uint64_t*>(p.symmetric + sl.arrived);
  auto* out = reinterpret_cast<float*>(p.symmetric + sl.out);
  auto* ids = reinterpret_cast<int32_t*>(p.local + ll.ids);
  auto* weights = reinterpret_cast<float*>(p.local + ll.weights);
  auto* slot = reinterpret_cast<int32_t*>(p.local + ll.slot);
  const auto* x = static_cast<const float*>(p.x);

  // No peer adds to `arrived` before it has this forward's rows, which leave after this reset.
  store_release(arrived, 0);

  // 1. gate
  std::vector<float> logits(static_cast<size_t>(T * E)), probs(static_cast<size_t>(T * E)), lse(static_cast<size_t>(T));
  router_logits(x, static_cast<const float*>(p.gate), logits.data(), T, H, E);
  router_topk(logits.data(), probs.data(), ids, weights, lse.data(), T, E, k, s.renormalize);
  if (s.train) {  // the router backward's inputs
    std::copy(probs.begin(), probs.end(), reinterpret_cast<float*>(p.local + ll.probs));
    std::copy(lse.begin(), lse.end(), reinterpret_cast<float*>(p.local + ll.lse));
  }
  std::vector<uint32_t> routed(size_t(E), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int32_t j = 0; j < k; ++j) {
      const int32_t e = ids[t * k + j];
      if (e < 0) {  // NaN logits: no choice (the token is dropped, the error reported)
        slot[t * k + j] = -1;
        if (control->error == flash::kErrorNone) {
          control->error = flash::kErrorNanRouting;
          control->error_detail = uint32_t(t);
        }
        continue;
      }
      const int64_t rank_in_expert = routed[e]++;
      slot[t * k + j] = (s.capacity < 0 || rank_in_expert < s.capacity) ? int32_t(rank_in_expert) : -1;
    }

  // 2. counts to every rank, then everyone's counts
  for (int32_t d = 0; d < W; ++d)
    for (int32_t e = 0; e < E; ++e) store_release(counts_of(peer(d)) + size_t(r) * E + e, flash::make_signal(epoch, routed[e]));
  std::vector<int64_t> kept(size_t(W) * E);
  const uint64_t* inbox = counts_of(p.symmetric);
  for (int32_t src = 0; src < W; ++src)
    for (int32_t e = 0; e < E; ++e) {
      const uint64_t v = wait_for(inbox + size_t(src) * E + e, [&](uint64_t seen) { return flash::signal_epoch(seen) == epoch; },
                                  p, flash::kRoleCounts, flash::kWaitCounts, src, flash::make_signal(epoch, 0));
      const int64_t n = flash::signal_value(v);
      kept[size_t(src) * E + e] = s.capacity < 0 ? n : std::min<int64_t>(n, s.capacity);
    }
  // begin[e]: first row of expert e in its owner's receive buffer; before[s][e]: rows of e from sources < s
  std::vector<int64_t> begin(static_cast<size_t>(E)), column(static_cast<size_t>(E), 0);
  for (int32_t e = 0; e < E; ++e)
    for (int32_t src = 0; src < W; ++src) column[e] += kept[size_t(src) * E + e];
  for (int32_t e = 0; e < E; ++e) begin[e] = (e % Le == 0) ? 0 : begin[e - 1] + column[e - 1];
  auto before = [&](int32_t src, int32_t e) {
    int64_t n = 0;
    for (int32_t q = 0; q < src; ++q) n += kept[size_t(q) * E + e];
    return n;
  };

  // 3. dispatch: rows and metadata, then one ready signal per destination
  std::vector<uint32_t> rows_to(size_t(W), 0);
  for (int64_t t = 0; t < T; ++t)
    for (int32_t j = 0; j < k; ++j) {
      if (slot[t * k + j] < 0) continue;
      const int32_t e = ids[t * k + j], d = e / Le;
      const int64_t row = begin[e] + before(r, e) + slot[t * k + j];
      std::copy_n(x + t * H, H, recv_of(peer(d)) + row * H);
      meta_of(peer(d))[row] = flash::RowMeta{r, int32_t(t * k + j)};
      if (s.train) reinterpret_cast<int32_t*>(p.local + ll.dest_row)[t * k + j] = int32_t(row);
      ++rows_to[d];
    }
  for (int32_t d = 0; d < W; ++d) store_release(ready_of(peer(d)) + r, flash::make_signal(epoch, rows_to[d]));

  // 4. this rank's experts, each once every source that sends it rows has landed
  const int32_t down_cols = s.down_col_tiles();
  const float* recv = recv_of(p.symmetric);
  const flash::RowMeta* meta = meta_of(p.symmetric);
  const uint64_t* ready = ready_of(p.symmetric);
  std::vector<bool> landed(size_t(W), false);
  std::vector<float> pre1_tmp, pre3_tmp, rows_out;
  const bool swiglu = s.activation == Activation::swiglu;
  for (int32_t le = 0; le < Le; ++le) {
    const int32_t e = r * Le + le;
    const int64_t n = column[e];
    if (n == 0) continue;
    for (int32_t src = 0; src < W; ++src)
      if (kept[size_t(src) * E + e] > 0 && !landed[src]) {
        wait_for(ready + src, [&](uint64_t v) { return flash::signal_epoch(v) == epoch; }, p, flash::kRoleProducer,
                 flash::kWaitRowsReady, src, flash::make_signal(epoch, 0));
        landed[src] = true;
      }
    // h (and with train the pre-activations) stay in the local region at the rows' positions: the backward
    // reads them there, as the kernel's up tiles leave them.
    float* h = reinterpret_cast<float*>(p.local + ll.h) + begin[e] * I;
    float* pre1 = nullptr;
    float* pre3 = nullptr;
    if (s.train) {
      pre1 = reinterpret_cast<float*>(p.local + ll.pre1) + begin[e] * I;
      pre3 = swiglu ? reinterpret_cast<float*>(p.local + ll.pre3) + begin[e] * I : nullptr;
    } else {
      pre1_tmp.assign(size_t(n * I), 0.f);
      pre3_tmp.assign(swiglu ? size_t(n * I) : 0, 0.f);
      pre1 = pre1_tmp.data();
      pre3 = swiglu ? pre3_tmp.data() : nullptr;
    }
    rows_out.assign(size_t(n * H), 0.f);
    const auto* w1 = static_cast<const float*>(p.w1) + size_t(le) * I * H;
    const auto* w3 = p.w3 ? static_cast<const float*>(p.w3) + size_t(le) * I * H : nullptr;
    const auto* w2 = static_cast<const float*>(p.w2) + size_t(le) * H * I;
    expert_ffn_forward(recv + begin[e] * H, w1, w3, w2, pre1, pre3, h, rows_out.data(), n, H, I, s.activation,
                       s.storage);
    std::vector<uint64_t> rows_from(size_t(W), 0);
    for (int64_t i = 0; i < n; ++i) {
      const flash::RowMeta m = meta[begin[e] + i];
      float* dst = reinterpret_cast<float*>(peer(m.source) + sl.out) + int64_t(m.token_choice) * H;
      std::copy_n(rows_out.data() + i * H, H, dst);
      ++rows_from[m.source];
    }
    for (int32_t src = 0; src < W; ++src)
      if (rows_from[src] > 0) add_release(reinterpret_cast<uint64_t*>(peer(src) + sl.arrived), rows_from[src] * down_cols);
  }

  // 5. combine once every kept row of this rank's tokens has come back
  uint64_t kept_total = 0;
  for (int32_t e = 0; e < E; ++e) kept_total += uint64_t(kept[size_t(r) * E + e]);
  const uint64_t target = kept_total * uint64_t(down_cols);
  wait_for(arrived, [&](uint64_t v) { return v == target; }, p, flash::kRoleCombine, flash::kWaitArrived, -1, target);
  std::vector<int32_t> out_slot(size_t(T) * k);
  for (int64_t i = 0; i < T * k; ++i) out_slot[i] = slot[i] >= 0 ? int32_t(i) : -1;
  combine(out, out_slot.data(), weights, nullptr, static_cast<float*>(p.y), T, k, H, s.storage);
  control->epoch = epoch;
}

void flash_backward(const flash::BackwardParams& b) {
  const flash::Params& p = b.forward;
  const flash::Shape& s = p.shape;
  DMOE_REQUIRE(s.train, "cpu::flash_backward: the shape was made without train (the forward kept nothing)");
  DMOE_REQUIRE(!b.experts_bf16, "cpu::flash_backward: the CPU twin's expert gradients are f64 (experts_bf16 is GPU-only)");
  const int64_t T = s.tokens, H = s.hidden, I = s.ffn;
  const int32_t E = s.experts, k = s.top_k, W = s.world, Le = s.local_experts();
  const int64_t R = s.recv_rows();
  const bool swiglu = s.activation == Activation::swiglu;
  const flash::SymmetricLayout sl = flash::symmetric_layout(s);
  const flash::LocalLayout ll = flash::local_layout(s);
  const auto* control = reinterpret_cast<const flash::Control*>(p.local + ll.control);
  const auto* peers = reinterpret_cast<const uint64_t*>(p.local + ll.peers);
  auto peer = [&](int32_t d) { return reinterpret_cast<char*>(peers[d]); };
  const uint32_t epoch = control->epoch;  // the forward's
  DMOE_REQUIRE(epoch > 0, "cpu::flash_backward: no forward has run");
  const uint32_t parity = epoch & 1;
  auto local_f = [&](size_t at) { return reinterpret_cast<float*>(p.local + at); };
  const auto* slot = reinterpret_cast<const int32_t*>(p.local + ll.slot);
  const auto* ids = reinterpret_cast<const int32_t*>(p.local + ll.ids);
  const auto* dest_row = reinterpret_cast<const int32_t*>(p.local + ll.dest_row);
  const float* weights = local_f(ll.weights);
  auto* choice_slot = reinterpret_cast<int32_t*>(p.local + ll.choice_slot);
  float* dweights = local_f(ll.dweights);
  auto signal_all = [&](size_t offset) {
    for (int32_t d = 0; d < W; ++d)
      store_release(reinterpret_cast<uint64_t*>(peer(d) + offset) + p.rank, flash::make_signal(epoch, 1));
  };
  auto wait_all = [&](size_t offset, int32_t what) {
    for (int32_t src = 0; src < W; ++src)
      wait_for(reinterpret_cast<const uint64_t*>(p.symmetric + offset) + src,
               [&](uint64_t v) { return flash::signal_epoch(v) == epoch; }, p, flash::kRoleBackward, what, src,
               flash::make_signal(epoch, 1));
  };
  auto expert_rank_row = [&](size_t part, int64_t i) {  // row dest_row[i] of a symmetric part on ids[i]'s rank
    return reinterpret_cast<float*>(peer(ids[i] / Le) + part) + int64_t(dest_row[i]) * H;
  };

  // 1. combine backward on the home, each row's gradient stored at its place in its expert's rank's grad_recv
  for (int64_t i = 0; i < T * k; ++i) choice_slot[i] = slot[i] >= 0 ? int32_t(i) : -1;
  std::vector<float> drows(size_t(T * k * H));
  combine_backward(static_cast<const float*>(b.dy), reinterpret_cast<const float*>(p.symmetric + sl.out), choice_slot,
                   weights, drows.data(), dweights, T, k, H, s.storage);
  for (int64_t i = 0; i < T * k; ++i)
    if (choice_slot[i] >= 0) std::copy_n(drows.data() + i * H, H, expert_rank_row(sl.grad_recv, i));
  signal_all(sl.grad_ready);

  // 2. every source's row gradients have landed: grad_recv is the forward's expert batch of gradients
  std::vector<int64_t> expert_offsets(size_t(Le) + 1);
  std::vector<double> assigned(static_cast<size_t>(E));
  flash::backward_rows(s, p.rank, reinterpret_cast<const uint64_t*>(p.symmetric + sl.counts) + size_t(parity) * W * E,
                       expert_offsets.data(), assigned.data());
  wait_all(sl.grad_ready, flash::kWaitGradReady);

  // 3. expert backward over each local expert's rows, into this rank's dx_rows; then every home may read them
  const auto* recv = reinterpret_cast<const float*>(p.symmetric + sl.recv) + size_t(parity) * R * H;
  const auto* grad_recv = reinterpret_cast<const float*>(p.symmetric + sl.grad_recv);
  auto* dx_rows = reinterpret_cast<float*>(p.symmetric + sl.dx_rows);
  auto* dw1 = static_cast<double*>(b.dw1);
  auto* dw3 = static_cast<double*>(b.dw3);
  auto* dw2 = static_cast<double*>(b.dw2);
  if (!b.accumulate) {
    std::fill_n(dw1, size_t(Le) * I * H, 0.0);
    std::fill_n(dw2, size_t(Le) * H * I, 0.0);
    if (swiglu) std::fill_n(dw3, size_t(Le) * I * H, 0.0);
  }
  for (int32_t le = 0; le < Le; ++le) {
    const int64_t r0 = expert_offsets[le], n = expert_offsets[le + 1] - r0;
    if (n == 0) continue;
    const int64_t wm = I * H;
    expert_ffn_backward(recv + r0 * H, static_cast<const float*>(p.w1) + le * wm,
                        swiglu ? static_cast<const float*>(p.w3) + le * wm : nullptr,
                        static_cast<const float*>(p.w2) + le * wm, local_f(ll.pre1) + r0 * I,
                        swiglu ? local_f(ll.pre3) + r0 * I : nullptr, local_f(ll.h) + r0 * I, grad_recv + r0 * H,
                        dx_rows + r0 * H, dw1 + le * wm, swiglu ? dw3 + le * wm : nullptr, dw2 + le * wm, n, H, I,
                        s.activation, s.storage);
  }
  signal_all(sl.dx_ready);

  // 4. router backward (this rank's dweights only), then dx from the experts' ranks' dx rows read in place, once
  //    every rank's are complete
  const double n_tokens = double(T) * W;
  std::vector<double> fraction(static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) fraction[e] = assigned[e] / (n_tokens * k);
  RouterAuxGrad aux;
  aux.expert_fraction = b.aux_loss_coef > 0 ? fraction.data() : nullptr;
  aux.lb_scale = b.aux_loss_coef * E / n_tokens;
  aux.lse = b.z_loss_coef > 0 ? local_f(ll.lse) : nullptr;
  aux.z_scale = 2.0 * b.z_loss_coef / n_tokens;
  float* dlogits = local_f(ll.dlogits);
  float* dx_router = local_f(ll.dx_router);
  router_topk_backward(local_f(ll.probs), ids, weights, dweights, dlogits, T, E, k, s.renormalize, aux);
  std::fill_n(dx_router, size_t(T) * H, 0.f);
  router_logits_backward(static_cast<const float*>(p.x), static_cast<const float*>(p.gate), dlogits, dx_router,
                         static_cast<double*>(b.dgate), T, H, E);
  wait_all(sl.dx_ready, flash::kWaitDxReady);
  for (int64_t i = 0; i < T * k; ++i)  // the rows the scatter back reads, gathered from their experts' ranks
    if (choice_slot[i] >= 0) std::copy_n(expert_rank_row(sl.dx_rows, i), H, drows.data() + i * H);
  combine(drows.data(), choice_slot, nullptr, dx_router, static_cast<float*>(b.dx), T, k, H, s.storage);
}

}  // namespace dmoe::cpu
