// flash/flash_backward.cpp — the Flash layer backward of one rank (flash::BackwardParams; the CPU twin is
// cpu::flash_backward in cpu/flash.cpp): the protocol's steps as a short sequence of launches on one stream —
// the grouped expert backward (the own Hopper GEMMs) and the router backward on the backend's kernels; the
// combine backward that stores the row gradients straight into the experts' ranks, the scatter back that reads
// their dx rows in place, and the signals between the ranks on flash_backward.cu's kernels. Not yet one
// persistent kernel (docs/flash.md, "The backward"): the expert backward's row offsets come from the host (read
// with the train forward's losses, or here with one stream wait), and the stages run one after the other.
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
  // The forward's epoch and count inbox give each local expert's rows (the grouped expert backward takes host
  // offsets) and the load-balance term's expert fractions: given by the caller (read while it waited for the train
  // forward's losses), or read here, the backward's one stream wait.
  std::vector<uint64_t> inbox(size_t(W) * E);
  uint32_t epoch = b.inbox_epoch;
  if (b.inbox_host != nullptr) {
    std::copy(b.inbox_host, b.inbox_host + inbox.size(), inbox.begin());
  } else {
    wait_stream(stream, "Flash backward: the train forward on this rank's stream");
    flash::Control control{};
    DMOE_CHECK_CUDA(cudaMemcpy(&control, loc + ll.control, sizeof(control), cudaMemcpyDeviceToHost));
    epoch = control.epoch;
    DMOE_REQUIRE(epoch > 0, "cuda::flash_backward: no forward has run");
    DMOE_CHECK_CUDA(cudaMemcpy(inbox.data(), sym + sl.counts + size_t(epoch & 1) * W * E * sizeof(uint64_t),
                               inbox.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
  }
  const uint32_t parity = epoch & 1;
  for (int32_t src = 0; src < W; ++src)
    for (int32_t e = 0; e < E; ++e)
      DMOE_REQUIRE(flash::signal_epoch(inbox[size_t(src) * E + e]) == epoch,
                   "cuda::flash_backward: the count of source {} for expert {} is not of forward {}", src, e, epoch);
  std::vector<int64_t> offsets(size_t(Le) + 1);
  std::vector<double> assigned(static_cast<size_t>(E));
  flash::backward_rows(s, r, inbox.data(), offsets.data(), assigned.data());

  mark(1);
  // 1. combine backward on the home, each row gradient stored straight into its expert's rank's grad_recv; then
  //    every source's rows have landed here (at W = 1 stream order is the signal)
  const auto* slot = reinterpret_cast<const int32_t*>(loc + ll.slot);
  auto* dweights = reinterpret_cast<float*>(loc + ll.dweights);
  const auto* ids = reinterpret_cast<const int32_t*>(loc + ll.ids);
  const auto* dest_row = reinterpret_cast<const int32_t*>(loc + ll.dest_row);
  const auto* weights = reinterpret_cast<const float*>(loc + ll.weights);
  flash_combine_backward(a,
                         CombineBackwardArgs{static_cast<const __nv_bfloat16*>(b.dy),
                                             reinterpret_cast<const __nv_bfloat16*>(sym + sl.out), weights, ids,
                                             slot, dest_row, dweights, T, k, Le},
                         stream);
  if (W > 1) {
    flash_signal_peers(a, sl.grad_ready, stream);
    flash_wait_signals(a, sl.grad_ready, flash::kWaitGradReady, stream);
  }
  mark(2);
  // 2. expert backward over the received rows (x = the forward's recv rows, its pre-activations and h; the
  //    gradients in grad_recv in the same order) into dx_rows, which the homes then read in place
  backend.expert_ffn_backward(sym + sl.recv + size_t(parity) * R * H * 2, p.w1, swiglu ? p.w3 : nullptr, p.w2,
                              loc + ll.pre1, swiglu ? loc + ll.pre3 : nullptr, loc + ll.h, sym + sl.grad_recv,
                              sym + sl.dx_rows, b.dw1, swiglu ? b.dw3 : nullptr, b.dw2, offsets.data(), Le, H, I,
                              s.activation, b.accumulate, b.experts_bf16 ? DType::bf16 : DType::f32);
  if (W > 1) flash_signal_peers(a, sl.dx_ready, stream);
  mark(3);
  // 3. router backward (needs only this rank's dweights: it runs while the peers finish their experts)
  const double n_tokens = double(T) * W;
  std::vector<double> fraction(static_cast<size_t>(E));
  for (int32_t e = 0; e < E; ++e) fraction[e] = assigned[e] / (n_tokens * k);
  cpu::RouterAuxGrad aux;
  aux.expert_fraction = b.aux_loss_coef > 0 ? fraction.data() : nullptr;
  aux.lb_scale = b.aux_loss_coef * E / n_tokens;
  aux.lse = b.z_loss_coef > 0 ? reinterpret_cast<const float*>(loc + ll.lse) : nullptr;
  aux.z_scale = 2.0 * b.z_loss_coef / n_tokens;
  auto* dx_router = reinterpret_cast<float*>(loc + ll.dx_router);
  backend.router_backward(p.x, p.gate, reinterpret_cast<const float*>(loc + ll.probs), ids, weights, dweights, aux,
                          reinterpret_cast<float*>(loc + ll.dlogits), dx_router, b.dgate, T, H, E, k, s.renormalize);
  mark(4);
  // 4. dx, once every expert rank's dx rows are complete, read in place from them
  if (W > 1) flash_wait_signals(a, sl.dx_ready, flash::kWaitDxReady, stream);
  flash_scatter_back(a, ScatterBackArgs{ids, slot, dest_row, dx_router, static_cast<__nv_bfloat16*>(b.dx), T,
                                        k, Le},
                     stream);
  mark(5);
}

}  // namespace dmoe::cuda
