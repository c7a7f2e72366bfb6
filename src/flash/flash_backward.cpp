// flash/flash_backward.cpp — the Flash layer backward of one rank (flash::BackwardParams; the CPU twin is
// cpu::flash_backward in cpu/flash.cpp): the protocol's five steps as a short sequence of launches on one
// stream — the arithmetic on the backend's kernels (combine backward, the grouped expert backward on the own
// Hopper GEMMs, the router backward, the scatter back), the data movement and the signals between the ranks on
// flash_backward.cu's kernels. Not yet one persistent kernel (docs/flash.md, "The backward"): the expert
// backward's row offsets are read on the host once per backward (one stream synchronisation), and the stages
// run one after the other.
#include <algorithm>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/flash_protocol.hpp"
#include "cpu/kernels.hpp"
#include "cuda/check.hpp"
#include "engine/backend.hpp"
#include "flash/flash_backward_kernels.hpp"
#include "flash/flash_kernel.hpp"

namespace dmoe::cuda {

void flash_backward(const flash::BackwardParams& b, Backend& backend, cudaStream_t stream) {
  const flash::Params& p = b.forward;
  const flash::Shape& s = p.shape;
  DMOE_REQUIRE(s.train, "cuda::flash_backward: the forward's shape was made without train (it kept nothing)");
  DMOE_REQUIRE(static_cast<cudaStream_t>(backend.stream()) == stream,
               "cuda::flash_backward: the backend's stream must be the stream of the backward");
  DMOE_REQUIRE(backend.storage_dtype() == DType::bf16 && backend.grad_accum_dtype() == DType::f32,
               "cuda::flash_backward: needs a bf16 CUDA backend with f32 gradient accumulators");
  const int64_t T = s.tokens, H = s.hidden, I = s.ffn;
  const int32_t E = s.experts, k = s.top_k, W = s.world, Le = s.local_experts(), r = p.rank;
  const int64_t R = s.recv_rows();
  const bool swiglu = s.activation == Activation::swiglu;
  const flash::SymmetricLayout sl = flash::symmetric_layout(s);
  const flash::LocalLayout ll = flash::local_layout(s);
  const BackwardArgs a{r, W, H, p.symmetric, p.local, sl, ll, p.timeout_ns,
                       p.wait_record != nullptr ? p.wait_record : device_wait_record()};
  char* sym = p.symmetric;
  char* loc = p.local;

  auto* events = static_cast<cudaEvent_t*>(b.stage_events);
  auto mark = [&](int32_t i) {
    if (events) DMOE_CHECK_CUDA(cudaEventRecord(events[i], stream));
  };
  mark(0);
  // The one host read: the forward's epoch and count inbox give each local expert's rows (the grouped expert
  // backward takes host offsets) and the load-balance term's expert fractions.
  wait_stream(stream, "Flash backward: the train forward on this rank's stream");
  flash::Control control{};
  DMOE_CHECK_CUDA(cudaMemcpy(&control, loc + ll.control, sizeof(control), cudaMemcpyDeviceToHost));
  DMOE_REQUIRE(control.epoch > 0, "cuda::flash_backward: no forward has run");
  const uint32_t parity = control.epoch & 1;
  std::vector<uint64_t> inbox(size_t(W) * E);
  DMOE_CHECK_CUDA(cudaMemcpy(inbox.data(), sym + sl.counts + size_t(parity) * W * E * sizeof(uint64_t),
                             inbox.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  std::vector<int64_t> offsets(size_t(Le) + 1, 0);
  std::vector<double> assigned(size_t(E), 0.0);
  for (int32_t src = 0; src < W; ++src)
    for (int32_t e = 0; e < E; ++e) {
      DMOE_REQUIRE(flash::signal_epoch(inbox[size_t(src) * E + e]) == control.epoch,
                   "cuda::flash_backward: the count of source {} for expert {} is not of forward {}", src, e,
                   control.epoch);
      const int64_t n = flash::signal_value(inbox[size_t(src) * E + e]);
      assigned[e] += double(n);
      if (e / Le == r) offsets[e % Le + 1] += s.capacity < 0 ? n : std::min<int64_t>(n, s.capacity);
    }
  for (int32_t le = 0; le < Le; ++le) offsets[le + 1] += offsets[le];
  const int64_t rows = offsets[Le];

  mark(1);
  // 1. combine backward on the home
  auto* choice_slot = reinterpret_cast<int32_t*>(loc + ll.choice_slot);
  auto* dweights = reinterpret_cast<float*>(loc + ll.dweights);
  flash_choice_slots(reinterpret_cast<const int32_t*>(loc + ll.slot), choice_slot, T * k, stream);
  backend.combine_backward(b.dy, sym + sl.out, choice_slot, reinterpret_cast<const float*>(loc + ll.weights),
                           sym + sl.grad_out, dweights, T, k, H);
  mark(2);
  // 2. the received rows' gradients from their homes (at W = 1 stream order is the signal)
  if (W > 1) {
    flash_signal_peers(a, sl.grad_ready, stream);
    flash_wait_signals(a, sl.grad_ready, flash::kWaitGradReady, stream);
  }
  const auto* meta = reinterpret_cast<const flash::RowMeta*>(sym + sl.meta) + size_t(parity) * R;
  auto* grad_recv = reinterpret_cast<char*>(loc + ll.grad_recv);
  auto* dx_rows = reinterpret_cast<char*>(loc + ll.dx_rows);
  flash_move_rows(a, meta, grad_recv, rows, /*pull=*/true, stream);
  mark(3);
  // 3. expert backward over the received rows (x = the forward's recv rows, its pre-activations and h)
  backend.expert_ffn_backward(sym + sl.recv + size_t(parity) * R * H * 2, p.w1, swiglu ? p.w3 : nullptr, p.w2,
                              loc + ll.pre1, swiglu ? loc + ll.pre3 : nullptr, loc + ll.h, grad_recv, dx_rows, b.dw1,
                              swiglu ? b.dw3 : nullptr, b.dw2, offsets.data(), Le, H, I, s.activation, b.accumulate);
  mark(4);
  // 4. dx rows home
  flash_move_rows(a, meta, dx_rows, rows, /*pull=*/false, stream);
  if (W > 1) {
    flash_signal_peers(a, sl.dx_ready, stream);
    flash_wait_signals(a, sl.dx_ready, flash::kWaitDxReady, stream);
  }
  mark(5);
  // 5. router backward and dx
  const double n_tokens = double(T) * W;
  std::vector<double> fraction(static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) fraction[e] = assigned[e] / (n_tokens * k);
  cpu::RouterAuxGrad aux;
  aux.expert_fraction = b.aux_loss_coef > 0 ? fraction.data() : nullptr;
  aux.lb_scale = b.aux_loss_coef * E / n_tokens;
  aux.lse = b.z_loss_coef > 0 ? reinterpret_cast<const float*>(loc + ll.lse) : nullptr;
  aux.z_scale = 2.0 * b.z_loss_coef / n_tokens;
  auto* dx_router = reinterpret_cast<float*>(loc + ll.dx_router);
  backend.router_backward(p.x, p.gate, reinterpret_cast<const float*>(loc + ll.probs),
                          reinterpret_cast<const int32_t*>(loc + ll.ids), reinterpret_cast<const float*>(loc + ll.weights),
                          dweights, aux, reinterpret_cast<float*>(loc + ll.dlogits), dx_router, b.dgate, T, H, E, k,
                          s.renormalize);
  backend.scatter_back(sym + sl.dx_out, choice_slot, dx_router, b.dx, T, k, H);
  mark(6);
}

}  // namespace dmoe::cuda
