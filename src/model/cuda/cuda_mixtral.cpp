// model/cuda/cuda_mixtral.cpp — the Mixtral model's stages on one GPU (see cuda_mixtral.hpp; the CPU twin of
// every stage is in model/mixtral.cpp, and this file follows it step by step).
#include "model/cuda/cuda_mixtral.hpp"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>
#include <vector>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "core/error.hpp"
#include "cuda/check.hpp"
#include "cuda/attention_cudnn.hpp"
#include "cuda/model_kernels.cuh"
#include "model/mixtral.hpp"

namespace dmoe {
namespace {

using cuda::bf16;

// Calls fn(T{}) with T the storage type.
template <typename Fn>
void with_storage(DType storage, Fn&& fn) {
  if (storage == DType::bf16)
    fn(bf16{});
  else
    fn(float{});
}

std::vector<float>* embed_of(MixtralWeights& w, int32_t) { return &w.embed_tokens; }
std::vector<float>* norm_of(MixtralWeights& w, int32_t) { return &w.norm; }
std::vector<float>* lm_head_of(MixtralWeights& w, int32_t) { return &w.lm_head; }
std::vector<float>* in_ln_of(MixtralWeights& w, int32_t l) { return &w.layers[l].input_layernorm; }
std::vector<float>* post_ln_of(MixtralWeights& w, int32_t l) { return &w.layers[l].post_attention_layernorm; }
std::vector<float>* q_of(MixtralWeights& w, int32_t l) { return &w.layers[l].q_proj; }
std::vector<float>* k_of(MixtralWeights& w, int32_t l) { return &w.layers[l].k_proj; }
std::vector<float>* v_of(MixtralWeights& w, int32_t l) { return &w.layers[l].v_proj; }
std::vector<float>* o_of(MixtralWeights& w, int32_t l) { return &w.layers[l].o_proj; }
std::vector<float>* gate_of(MixtralWeights& w, int32_t l) { return &w.layers[l].moe.gate; }
std::vector<float>* w1_of(MixtralWeights& w, int32_t l) { return &w.layers[l].moe.w1; }
std::vector<float>* w3_of(MixtralWeights& w, int32_t l) { return &w.layers[l].moe.w3; }
std::vector<float>* w2_of(MixtralWeights& w, int32_t l) { return &w.layers[l].moe.w2; }

}  // namespace

// Stage times on the stream (enable_stage_times): a pair of events around each stage, from a pool reused every
// step; collected after the GPU passed them. Host waits inside a stage (the EP engine reads its counts) count,
// as they do for the user.
struct StageTimer {
  bool on = false;
  cudaStream_t stream = nullptr;
  std::vector<cudaEvent_t> pool;
  size_t used = 0;
  std::vector<std::pair<std::string, std::pair<cudaEvent_t, cudaEvent_t>>> open;
  std::vector<std::pair<std::string, double>> totals;  // ms, in the order stages first ran
  int steps = 0;
  cudaEvent_t next() {
    if (used == pool.size()) {
      cudaEvent_t e;
      DMOE_CHECK_CUDA(cudaEventCreate(&e));
      pool.push_back(e);
    }
    return pool[used++];
  }
  ~StageTimer() {
    for (cudaEvent_t e : pool) (void)cudaEventDestroy(e);
  }
  void collect() {
    if (open.empty()) return;
    cuda::wait_stream(stream, "stage times: waiting for the GPU");
    for (auto& [name, ev] : open) {
      float ms = 0;
      DMOE_CHECK_CUDA(cudaEventElapsedTime(&ms, ev.first, ev.second));
      auto it = std::find_if(totals.begin(), totals.end(), [&](const auto& t) { return t.first == name; });
      if (it == totals.end())
        totals.emplace_back(name, double(ms));
      else
        it->second += double(ms);
    }
    open.clear();
    used = 0;
  }
};

// Times the enclosing scope as stage `name` when the timer is on.
class StageScope {
 public:
  StageScope(StageTimer& t, const char* name) : t_(t) {
    if (!t_.on) return;
    if (t_.used + 2 > 4096) t_.collect();  // bounded pool: collect (waits) before it grows without limit
    begin_ = t_.next();
    name_ = name;
    DMOE_CHECK_CUDA(cudaEventRecord(begin_, t_.stream));
  }
  ~StageScope() {
    if (!t_.on || !begin_) return;
    cudaEvent_t end = t_.next();
    if (cudaEventRecord(end, t_.stream) == cudaSuccess) t_.open.push_back({name_, {begin_, end}});
  }
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

 private:
  StageTimer& t_;
  cudaEvent_t begin_ = nullptr;
  const char* name_ = "";
};

// The MoE engines' stage marks (EpEngine::set_stage_observer) as stage times of the model's timer.
struct EngineMarks final : StageObserver {
  StageTimer* timer = nullptr;
  std::optional<StageScope> open;
  void mark(const char* stage) override {
    open.reset();
    if (stage) open.emplace(*timer, stage);
  }
};

ParamLayout make_param_layout(const MixtralConfig& c, int32_t experts_per_rank) {
  const int64_t H = c.hidden_size, V = c.vocab_size, Q = c.q_size(), KV = c.kv_size(), I = c.intermediate_size;
  const int64_t E = c.num_local_experts, Le = experts_per_rank;
  const int32_t L = c.num_hidden_layers;
  ParamLayout p;
  p.layers.resize(L);
  int64_t at = 0;
  // Each tensor starts at a multiple of 64 elements (256 bytes in f32, 128 in bf16): aligned for the
  // vectorised kernels and cuBLAS.
  auto add = [&](ParamLayout::Group g, std::vector<float>* (*sel)(MixtralWeights&, int32_t), int32_t layer,
                 int64_t numel) {
    at = (at + 63) / 64 * 64;
    p.entries.push_back({sel, layer, g, at, numel});
    const int64_t offset = at;
    at += numel;
    return offset;
  };
  p.group_begin[ParamLayout::norms] = 0;
  for (int32_t l = 0; l < L; ++l) {
    p.layers[l].input_layernorm = add(ParamLayout::norms, in_ln_of, l, H);
    p.layers[l].post_attention_layernorm = add(ParamLayout::norms, post_ln_of, l, H);
  }
  p.norm = add(ParamLayout::norms, norm_of, -1, H);
  at = (at + 63) / 64 * 64;
  p.group_begin[ParamLayout::dense] = at;
  p.embed_tokens = add(ParamLayout::dense, embed_of, -1, V * H);
  for (int32_t l = 0; l < L; ++l) {
    p.layers[l].q_proj = add(ParamLayout::dense, q_of, l, Q * H);
    p.layers[l].k_proj = add(ParamLayout::dense, k_of, l, KV * H);
    p.layers[l].v_proj = add(ParamLayout::dense, v_of, l, KV * H);
    p.layers[l].o_proj = add(ParamLayout::dense, o_of, l, H * Q);
  }
  if (!c.tie_word_embeddings) p.lm_head = add(ParamLayout::dense, lm_head_of, -1, V * H);
  at = (at + 63) / 64 * 64;
  p.group_begin[ParamLayout::routers] = at;
  for (int32_t l = 0; l < L; ++l) p.layers[l].gate = add(ParamLayout::routers, gate_of, l, E * H);
  at = (at + 63) / 64 * 64;
  p.group_begin[ParamLayout::experts] = at;
  for (int32_t l = 0; l < L; ++l) {
    p.layers[l].w1 = add(ParamLayout::experts, w1_of, l, Le * I * H);
    p.layers[l].w3 = add(ParamLayout::experts, w3_of, l, Le * I * H);
    p.layers[l].w2 = add(ParamLayout::experts, w2_of, l, Le * H * I);
  }
  at = (at + 63) / 64 * 64;
  p.group_begin[4] = at;
  return p;
}

struct CudaMixtralModel::Impl {
  cublasHandle_t cublas = nullptr;
  cuda::Workspace ws;
  cudaStream_t stream = nullptr;
  cudaEvent_t head_event = nullptr;  // orders head_forward's loss all-reduce on another stream after the loss
  // bf16: cuDNN's fused attention when it can run here (DMOE_ATTENTION=own forces the own kernels); f32 and
  // head_dim not a multiple of 8 use the own kernels.
  std::unique_ptr<cuda::CudnnAttention> cudnn;
  std::string attention = "own";
  StageTimer timer;
  EngineMarks marks;
  // grad_sum_of_squares' two f64 sums, allocated once: a Buffer per call cost a cudaMalloc and a cudaFree (which
  // synchronises the device) every step. Released before the backend (impl_ is declared after backend_).
  Buffer norm_sums;
  ~Impl() {
    if (cublas && cuda::wait_stream_quietly(stream)) (void)cublasDestroy(cublas);
    if (head_event) (void)cudaEventDestroy(head_event);
  }
};

CudaMixtralModel::CudaMixtralModel(const MixtralConfig& config, DType storage, Comm& comm,
                                   std::unique_ptr<Backend> backend, bool bf16_expert_grads)
    : config_(config), storage_(storage), comm_(comm), rank_(comm.rank()), world_(comm.world()),
      backend_(std::move(backend)), impl_(std::make_unique<Impl>()),
      bf16_expert_grads_(bf16_expert_grads && storage == DType::bf16) {
  config_.validate();
  DMOE_REQUIRE(backend_ && backend_->on_device(), "cuda mixtral: needs a CUDA backend");
  DMOE_REQUIRE_INPUT(storage == DType::f32 || storage == DType::bf16,
                     "cuda mixtral: dtype {} is not supported; allowed: f32, bf16", dtype_name(storage));
  DMOE_REQUIRE(backend_->storage_dtype() == storage, "cuda mixtral: the backend stores {}, the model {}",
               dtype_name(backend_->storage_dtype()), dtype_name(storage));
  DMOE_REQUIRE_INPUT(config_.num_local_experts % world_ == 0,
                     "mixtral: num_local_experts = {} is not divisible by the {} ranks", config_.num_local_experts,
                     world_);
  DMOE_REQUIRE_INPUT(config_.head_size() % 2 == 0 && config_.head_size() <= 256,
                     "cuda mixtral: head_dim {} must be even and <= 256", config_.head_size());
  elem_ = dtype_size(storage);
  impl_->stream = static_cast<cudaStream_t>(backend_->stream());
  impl_->marks.timer = &impl_->timer;
  DMOE_CHECK_CUDA(cudaEventCreateWithFlags(&impl_->head_event, cudaEventDisableTiming));
  DMOE_CHECK_CUBLAS(cublasCreate(&impl_->cublas));
  DMOE_CHECK_CUBLAS(cublasSetStream(impl_->cublas, impl_->stream));
  DMOE_CHECK_CUBLAS(cublasSetMathMode(impl_->cublas, CUBLAS_DEFAULT_MATH));  // no TF32: f32 is f32
  const char* choice = std::getenv("DMOE_ATTENTION");
  const std::string want = choice && *choice ? choice : "auto";
  DMOE_REQUIRE_INPUT(want == "auto" || want == "own" || want == "cudnn",
                     "DMOE_ATTENTION='{}' is not allowed; allowed: auto, own, cudnn", want);
  if (storage_ == DType::bf16 && want != "own" && config_.head_size() % 8 == 0) {
    std::string why;
    if (cuda::CudnnAttention::available(&why)) {
      impl_->cudnn = std::make_unique<cuda::CudnnAttention>();
      impl_->attention = "cudnn";
    } else {
      DMOE_REQUIRE_INPUT(want != "cudnn", "DMOE_ATTENTION=cudnn, but cuDNN attention cannot run here: {}", why);
    }
  } else {
    DMOE_REQUIRE_INPUT(want != "cudnn", "DMOE_ATTENTION=cudnn needs a bf16 model with head_dim a multiple of 8 (this "
                       "one: {}, head_dim {})", dtype_name(storage_), config_.head_size());
  }
  layout_ = make_param_layout(config_, experts_per_rank());
  for (Buffer* b : {&master_, &grad_, &expert_grad_, &m_, &v_, &compute_}) b->bind(*backend_);
  for (Buffer& b : scratch_) b.bind(*backend_);
  const size_t bytes = size_t(layout_.total()) * sizeof(float);
  master_.ensure(bytes);
  m_.ensure(bytes);
  v_.ensure(bytes);
  backend_->zero(master_.data(), bytes);  // the padding between tensors stays 0 in every buffer
  backend_->zero(m_.data(), bytes);
  backend_->zero(v_.data(), bytes);
  // bf16 expert gradients: the f32 buffer ends where the experts begin, and the experts' are a bf16 buffer of their
  // own, at the same offsets less the experts' start.
  const int64_t experts_at = layout_.group_begin[ParamLayout::experts];
  const size_t grad_bytes = bf16_expert_grads_ ? size_t(experts_at) * sizeof(float) : bytes;
  grad_.ensure(std::max<size_t>(grad_bytes, 4));
  backend_->zero(grad_.data(), grad_bytes);
  if (bf16_expert_grads_) {
    const size_t expert_bytes = size_t(layout_.total() - experts_at) * 2;
    expert_grad_.ensure(std::max<size_t>(expert_bytes, 2));
    backend_->zero(expert_grad_.data(), expert_bytes);
  }
  if (storage_ == DType::bf16) {
    compute_.ensure(size_t(layout_.total()) * 2);
    backend_->zero(compute_.data(), size_t(layout_.total()) * 2);
  }
  experts_fresh_.assign(config_.num_hidden_layers, true);
}

CudaMixtralModel::~CudaMixtralModel() = default;

const char* CudaMixtralModel::attention_kernel() const { return impl_->attention.c_str(); }

void CudaMixtralModel::enable_stage_times(bool on) {
  impl_->timer.collect();
  impl_->timer.on = on;
  impl_->timer.stream = impl_->stream;
}

std::vector<std::pair<std::string, double>> CudaMixtralModel::stage_times() {
  impl_->timer.collect();
  return impl_->timer.totals;
}

void CudaMixtralModel::reset_stage_times() {
  impl_->timer.collect();
  impl_->timer.totals.clear();
}

size_t CudaMixtralModel::parameter_bytes() const {
  const size_t total = size_t(layout_.total()), experts = total - size_t(layout_.group_begin[ParamLayout::experts]);
  // master, m, v (f32); gradients f32, or bf16 for the experts; the bf16 copy
  return total * 12 + (bf16_expert_grads_ ? (total - experts) * 4 + experts * 2 : total * 4) +
         (storage_ == DType::bf16 ? total * 2 : 0);
}

void* CudaMixtralModel::w(int64_t offset) const {
  if (storage_ == DType::bf16) return compute_.as<bf16>() + offset;
  return master_.as<float>() + offset;
}
float* CudaMixtralModel::g(int64_t offset) const {
  DMOE_REQUIRE(!bf16_expert_grads_ || offset < layout_.group_begin[ParamLayout::experts],
               "cuda mixtral: an f32 gradient pointer asked for an expert tensor, whose gradients are bf16");
  return grad_.as<float>() + offset;
}

void* CudaMixtralModel::expert_grad(int64_t offset) const {
  DMOE_REQUIRE(offset >= layout_.group_begin[ParamLayout::experts] && offset < layout_.total(),
               "cuda mixtral: expert_grad({}) is not an expert tensor's offset (experts: [{}, {}))", offset,
               layout_.group_begin[ParamLayout::experts], layout_.total());
  if (!bf16_expert_grads_) return grad_.as<float>() + offset;
  return expert_grad_.as<bf16>() + (offset - layout_.group_begin[ParamLayout::experts]);
}

void CudaMixtralModel::upload_share(const MixtralWeights& src_const, float* dst) {
  MixtralWeights& src = const_cast<MixtralWeights&>(src_const);  // select() gives non-const; nothing is written
  DMOE_REQUIRE(src.first_expert == first_expert() && src.num_experts == experts_per_rank(),
               "cuda mixtral: rank {} owns experts [{}, {}) but was given [{}, {})", rank_, first_expert(),
               first_expert() + experts_per_rank(), src.first_expert, src.first_expert + src.num_experts);
  parameter_views(src, config_);  // checks every shape
  for (const ParamLayout::Entry& e : layout_.entries) {
    const std::vector<float>& t = *e.select(src, e.layer);
    DMOE_REQUIRE(int64_t(t.size()) == e.numel, "cuda mixtral: a tensor of layer {} has {} elements, expected {}",
                 e.layer, t.size(), e.numel);
    backend_->upload(dst + e.offset, t.data(), size_t(e.numel) * sizeof(float));
  }
}

void CudaMixtralModel::download_share(const float* src, MixtralWeights& dst) {
  dst = make_mixtral_weights(config_, first_expert(), experts_per_rank());
  for (const ParamLayout::Entry& e : layout_.entries) {
    std::vector<float>& t = *e.select(dst, e.layer);
    backend_->download(t.data(), src + e.offset, size_t(e.numel) * sizeof(float));
  }
}

void CudaMixtralModel::refresh_compute_copy() {
  if (storage_ != DType::bf16) return;
  cuda::convert_from_f32<bf16>(master_.as<float>(), compute_.as<bf16>(), layout_.total(), impl_->stream);
}

void CudaMixtralModel::set_weights(const MixtralWeights& share) {
  upload_share(share, master_.as<float>());
  refresh_compute_copy();
}

void CudaMixtralModel::set_moments(const MixtralWeights& m, const MixtralWeights& v) {
  upload_share(m, m_.as<float>());
  upload_share(v, v_.as<float>());
}

MixtralWeights CudaMixtralModel::weights() {
  MixtralWeights out;
  download_share(master_.as<float>(), out);
  return out;
}

MixtralWeights CudaMixtralModel::grads() {
  MixtralWeights out;
  if (!bf16_expert_grads_) {
    download_share(grad_.as<float>(), out);
    return out;
  }
  out = make_mixtral_weights(config_, first_expert(), experts_per_rank());
  std::vector<bfloat16> bits;
  for (const ParamLayout::Entry& e : layout_.entries) {
    std::vector<float>& t = *e.select(out, e.layer);
    if (e.group != ParamLayout::experts) {
      backend_->download(t.data(), grad_.as<float>() + e.offset, size_t(e.numel) * sizeof(float));
      continue;
    }
    bits.resize(size_t(e.numel));
    backend_->download(bits.data(), expert_grad(e.offset), size_t(e.numel) * 2);
    for (size_t i = 0; i < bits.size(); ++i) t[i] = bf16_to_float(bits[i]);
  }
  return out;
}

void CudaMixtralModel::moments(MixtralWeights& m, MixtralWeights& v) {
  download_share(m_.as<float>(), m);
  download_share(v_.as<float>(), v);
}

void CudaMixtralModel::gather_full_buffer(const float* src, MixtralWeights& dst) {
  const int32_t E = config_.num_local_experts, Le = experts_per_rank();
  if (rank_ == 0) dst = make_mixtral_weights(config_, 0, E);
  Buffer full(*backend_);
  for (const ParamLayout::Entry& e : layout_.entries) {
    if (e.group != ParamLayout::experts) {  // replicated: rank 0's copy is everyone's
      if (rank_ == 0) backend_->download(e.select(dst, e.layer)->data(), src + e.offset, size_t(e.numel) * 4);
      continue;
    }
    const int64_t per_expert = e.numel / Le, all = per_expert * E;
    float* f = static_cast<float*>(full.ensure(size_t(all) * 4));
    backend_->zero(f, size_t(all) * 4);
    backend_->copy(f + int64_t(first_expert()) * per_expert, src + e.offset, size_t(e.numel) * 4);
    comm_.allreduce_sum(f, all, DType::f32, backend_->stream());  // x + 0 + … = x exactly
    if (rank_ == 0) backend_->download(e.select(dst, e.layer)->data(), f, size_t(all) * 4);
  }
}

void CudaMixtralModel::gather_full(MixtralWeights& w, MixtralWeights& m, MixtralWeights& v) {
  gather_full_buffer(master_.as<float>(), w);
  gather_full_buffer(m_.as<float>(), m);
  gather_full_buffer(v_.as<float>(), v);
}

void CudaMixtralModel::gather_full_grads(MixtralWeights& g) {
  DMOE_REQUIRE(!bf16_expert_grads_, "cuda mixtral: gather_full_grads needs f32 expert gradients (a model made "
               "without bf16_expert_grads, as dmoe eval --grad makes it)");
  gather_full_buffer(grad_.as<float>(), g);
}

void CudaMixtralModel::zero_grads() {
  StageScope scope(impl_->timer, "zero gradients");
  // The experts' gradients are not cleared: the first backward of each layer writes them (EpEngine).
  backend_->zero(grad_.data(), size_t(layout_.group_begin[ParamLayout::experts]) * sizeof(float));
  experts_fresh_.assign(config_.num_hidden_layers, true);
}

// ---- forward ---------------------------------------------------------------------------------------

double CudaMixtralModel::forward(const int32_t* tokens, int64_t batch, int64_t seq, CudaModelState& st) {
  begin_forward(tokens, batch, seq, st);
  embed_forward(st);
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    attention_forward(l, st);
    moe_forward(l, st);
  }
  head_forward(st);
  return st.loss;
}

void CudaMixtralModel::begin_forward(const int32_t* tokens, int64_t batch, int64_t seq, CudaModelState& st) {
  const std::vector<int32_t> targets = next_token_targets(config_, tokens, batch, seq);
  const int64_t n = batch * seq;
  st.batch = batch;
  st.seq = seq;
  st.tokens.assign(tokens, tokens + n);
  for (Buffer* b : {&st.tokens_dev, &st.targets_dev, &st.out, &st.xfn, &st.rstdf, &st.logits, &st.lse_head,
                    &st.loss_sum, &st.count, &st.dresid, &st.dmoe})
    b->bind(*backend_);
  backend_->upload(st.tokens_dev.ensure(n * 4), tokens, n * 4);
  backend_->upload(st.targets_dev.ensure(n * 4), targets.data(), n * 4);
  st.blocks.resize(config_.num_hidden_layers);
  st.forward_done = false;
}

void CudaMixtralModel::embed_forward(CudaModelState& st) {
  StageScope scope(impl_->timer, "fwd embedding");
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    cuda::embedding_forward<T>(st.tokens_dev.as<int32_t>(), static_cast<const T*>(w(layout_.embed_tokens)),
                               static_cast<T*>(st.out.ensure(n * H * elem_)), n, config_.vocab_size, H,
                               impl_->stream);
  });
}

void CudaMixtralModel::attention_forward(int layer, CudaModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, Q = config_.q_size(), KV = config_.kv_size();
  const int32_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  const int64_t D = config_.head_size();
  const ParamLayout::Layer& lw = layout_.layers[layer];
  CudaBlockState& b = st.blocks[layer];
  for (Buffer* x : {&b.x, &b.xn1, &b.rstd1, &b.q, &b.k, &b.v, &b.attn, &b.lse, &b.h, &b.hn2, &b.rstd2, &b.moe_out})
    x->bind(*backend_);
  // The block's input is the residual stream so far (st.out): kept as this block's x, and st.out becomes
  // free for the block's output (swap, no copy).
  std::swap(b.x, st.out);
  cudaStream_t s = impl_->stream;
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    auto W = [&](int64_t off) { return static_cast<const T*>(w(off)); };
    std::optional<StageScope> scope;
    scope.emplace(impl_->timer, "fwd norm + q/k/v + rope");
    T* x = b.x.as<T>();
    T* xn1 = static_cast<T*>(b.xn1.ensure(n * H * elem_));
    float* rstd1 = static_cast<float*>(b.rstd1.ensure(n * 4));
    cuda::rmsnorm_forward<T>(x, W(lw.input_layernorm), xn1, rstd1, n, H, float(config_.rms_norm_eps), s);
    T* q = static_cast<T*>(b.q.ensure(n * Q * elem_));
    T* k = static_cast<T*>(b.k.ensure(n * KV * elem_));
    T* v = static_cast<T*>(b.v.ensure(n * KV * elem_));
    cuda::linear_forward<T, T>(xn1, W(lw.q_proj), q, n, H, Q, impl_->cublas);
    cuda::linear_forward<T, T>(xn1, W(lw.k_proj), k, n, H, KV, impl_->cublas);
    cuda::linear_forward<T, T>(xn1, W(lw.v_proj), v, n, H, KV, impl_->cublas);
    cuda::rope_forward<T>(q, q, n, st.seq, heads, D, config_.rope_theta, s);
    cuda::rope_forward<T>(k, k, n, st.seq, kv_heads, D, config_.rope_theta, s);
    T* attn = static_cast<T*>(b.attn.ensure(n * Q * elem_));
    float* lse = static_cast<float*>(b.lse.ensure(st.batch * heads * st.seq * 4));
    scope.reset();
    scope.emplace(impl_->timer, "fwd attention core");
    if constexpr (std::is_same_v<T, bf16>) {
      if (impl_->cudnn) {
        impl_->cudnn->forward(q, k, v, attn, lse, st.batch, st.seq, heads, kv_heads, D, s);
      } else {
        cuda::attention_forward<T>(q, k, v, attn, lse, st.batch, st.seq, heads, kv_heads, D, impl_->ws, s);
      }
    } else {
      cuda::attention_forward<T>(q, k, v, attn, lse, st.batch, st.seq, heads, kv_heads, D, impl_->ws, s);
    }
    scope.reset();
    scope.emplace(impl_->timer, "fwd o-proj + residual + norm");
    T* h = static_cast<T*>(b.h.ensure(n * H * elem_));
    cuda::linear_forward<T, T>(attn, W(lw.o_proj), h, n, Q, H, impl_->cublas);
    cuda::add_into<T>(h, x, n * H, s);
    T* hn2 = static_cast<T*>(b.hn2.ensure(n * H * elem_));
    float* rstd2 = static_cast<float*>(b.rstd2.ensure(n * 4));
    cuda::rmsnorm_forward<T>(h, W(lw.post_attention_layernorm), hn2, rstd2, n, H, float(config_.rms_norm_eps), s);
  });
}

void CudaMixtralModel::prepare_moe(CudaBlockState& b, int64_t tokens, int layer) {
  if (!b.moe || b.moe->config().tokens != tokens) {
    b.moe.reset();
    MoeConfig mc = config_.moe_config(tokens, world_);
    mc.dtype = storage_;
    b.moe = std::make_unique<EpEngine>(mc, *backend_, comm_);
    // Views into the flat buffers (fixed for the model's life): the engine always reads the current weights and
    // adds into the gradients. Set once: set_grad_views clears the router's gradient.
    const ParamLayout::Layer& lw = layout_.layers[layer];
    b.moe->set_weight_views(WeightViews{w(lw.gate), w(lw.w1), w(lw.w3), w(lw.w2)});
    b.moe->set_grad_views(GradViews{g(lw.gate), expert_grad(lw.w1), expert_grad(lw.w3), expert_grad(lw.w2),
                                    bf16_expert_grads_});
    b.moe->set_stage_observer(&impl_->marks);
  }
}

void CudaMixtralModel::moe_forward(int layer, CudaModelState& st) {
  const Stream s = backend_->stream();
  moe_route(layer, st);
  moe_dispatch(layer, st, s);
  moe_experts(layer, st);
  moe_combine(layer, st, s);
  moe_finish(layer, st);
}

void CudaMixtralModel::prepare_engines(CudaModelState& st) {
  for (int l = 0; l < config_.num_hidden_layers; ++l) prepare_moe(st.blocks[size_t(l)], st.batch * st.seq, l);
}

void CudaMixtralModel::moe_route(int layer, CudaModelState& st) {
  CudaBlockState& b = st.blocks[layer];
  prepare_moe(b, st.batch * st.seq, layer);
  b.moe->forward_route(b.hn2.data(), ForwardMode::train);  // its stages: the engine's marks
}

void CudaMixtralModel::moe_dispatch(int layer, CudaModelState& st, Stream lane) {
  st.blocks[layer].moe->forward_dispatch(lane);
}

void CudaMixtralModel::moe_experts(int layer, CudaModelState& st) { st.blocks[layer].moe->forward_experts(); }

void CudaMixtralModel::moe_combine(int layer, CudaModelState& st, Stream lane) {
  st.blocks[layer].moe->forward_combine(lane);
}

void CudaMixtralModel::moe_finish(int layer, CudaModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  CudaBlockState& b = st.blocks[layer];
  void* out = b.moe_out.ensure(n * H * elem_);
  b.moe->forward_finish(out);
  impl_->marks.mark(nullptr);
  StageScope scope(impl_->timer, "fwd MoE residual");
  // The block's output (the next block's input): h + MoE(hn2).
  void* next = st.out.ensure(n * H * elem_);
  backend_->copy(next, b.h.data(), n * H * elem_);
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    cuda::add_into<T>(static_cast<T*>(next), static_cast<const T*>(out), n * H, impl_->stream);
  });
}

void CudaMixtralModel::head_forward(CudaModelState& st, Stream lane) {
  StageScope scope(impl_->timer, "fwd final norm + LM head + loss");
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, V = config_.vocab_size;
  const int32_t L = config_.num_hidden_layers, E = config_.num_local_experts;
  cudaStream_t s = impl_->stream;
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    T* xfn = static_cast<T*>(st.xfn.ensure(n * H * elem_));
    float* rstd = static_cast<float*>(st.rstdf.ensure(n * 4));
    cuda::rmsnorm_forward<T>(st.out.as<T>(), static_cast<const T*>(w(layout_.norm)), xfn, rstd, n, H,
                             float(config_.rms_norm_eps), s);
    const int64_t head = layout_.lm_head >= 0 ? layout_.lm_head : layout_.embed_tokens;
    float* logits = static_cast<float*>(st.logits.ensure(size_t(n) * V * 4));
    cuda::linear_forward<T, float>(xfn, static_cast<const T*>(w(head)), logits, n, H, V, impl_->cublas);
  });
  float* lse = static_cast<float*>(st.lse_head.ensure(n * 4));
  double* loss_sum = static_cast<double*>(st.loss_sum.ensure(8));
  int64_t* count = static_cast<int64_t*>(st.count.ensure(8));
  cuda::cross_entropy_forward(st.logits.as<float>(), st.targets_dev.as<int32_t>(), lse, loss_sum, count, n, V, -100,
                              impl_->ws, s);
  double sums[2] = {0, 0};
  int64_t c = 0;
  const Stream on = lane ? lane : backend_->stream();
  if (on != backend_->stream()) {  // the all-reduce and the read on `lane`, after the loss kernels
    DMOE_CHECK_CUDA(cudaEventRecord(impl_->head_event, s));
    DMOE_CHECK_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(on), impl_->head_event, 0));
  }
  if (world_ > 1) {
    // The loss over all ranks: the count goes next to the sum (as a double) and both are summed on the device.
    comm_.allreduce_sum(loss_sum, 1, DType::f64, on);
    comm_.allreduce_sum(count, 1, DType::i64, on);
  }
  backend_->download_on(&sums[0], loss_sum, 8, on);  // waits for the stream (bounded)
  backend_->download_on(&c, count, 8, on);
  sums[1] = double(c);
  st.ce_count = int64_t(sums[1]);
  DMOE_REQUIRE(st.ce_count > 0, "mixtral: no next-token prediction in the batch");
  st.ce_loss = sums[0] / sums[1];
  st.aux_loss = 0;
  st.expert_fraction.assign(E, 0.0);
  if (config_.output_router_logits) {
    std::vector<EpEngine*> engines;
    for (int l = 0; l < L; ++l) engines.push_back(st.blocks[l].moe.get());
    st.aux_loss = pooled_load_balance_loss(config_, engines, st.expert_fraction);
  }
  st.loss = st.ce_loss + (config_.output_router_logits ? config_.router_aux_loss_coef * st.aux_loss : 0.0);
  st.forward_done = true;
}

std::vector<float> CudaMixtralModel::logits(const CudaModelState& st) {
  DMOE_REQUIRE(st.forward_done, "cuda mixtral: logits() needs a completed forward()");
  std::vector<float> out(size_t(st.batch * st.seq * config_.vocab_size));
  backend_->download(out.data(), st.logits.data(), out.size() * 4);
  return out;
}

std::vector<float> CudaMixtralModel::gather_logits(const CudaModelState& st) {
  DMOE_REQUIRE(st.forward_done, "cuda mixtral: gather_logits() needs a completed forward()");
  if (world_ == 1) return logits(st);
  const int64_t mine = st.batch * st.seq * config_.vocab_size, all = mine * world_;
  Buffer full(*backend_);
  float* f = static_cast<float*>(full.ensure(size_t(all) * 4));
  backend_->zero(f, size_t(all) * 4);
  backend_->copy(f + int64_t(rank_) * mine, st.logits.data(), size_t(mine) * 4);
  comm_.allreduce_sum(f, all, DType::f32, backend_->stream());  // x + 0 + … = x exactly
  std::vector<float> out;  // (the buffer's release waits for the stream, so the all-reduce has read it)
  if (rank_ == 0) {
    out.resize(size_t(all));
    backend_->download(out.data(), f, size_t(all) * 4);
  }
  return out;
}

// ---- backward --------------------------------------------------------------------------------------

void CudaMixtralModel::backward(CudaModelState& st, double loss_scale) {
  DMOE_REQUIRE(st.forward_done, "mixtral: backward() needs a completed forward() on this state");
  head_backward(st, loss_scale);
  for (int l = config_.num_hidden_layers - 1; l >= 0; --l) {
    moe_backward(l, st, loss_scale);
    attention_backward(l, st);
  }
  embed_backward(st);
}

// Scratch kept by the model between stages (grow-only): used inside one compute stage only, and compute stages
// run one at a time on the backend's stream. What passes between stages is in the state (dresid, dmoe).
void CudaMixtralModel::head_backward(CudaModelState& st, double loss_scale) {
  DMOE_REQUIRE(st.forward_done, "mixtral: backward() needs a completed forward() on this state");
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, V = config_.vocab_size;
  cudaStream_t s = impl_->stream;
  StageScope scope(impl_->timer, "bwd loss + LM head + final norm");
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    auto W = [&](int64_t off) { return static_cast<const T*>(w(off)); };
    T* dr = static_cast<T*>(st.dresid.ensure(n * H * elem_));
    T* dl = static_cast<T*>(scratch_[8].ensure(size_t(n) * V * elem_));
    cuda::cross_entropy_backward<T>(st.logits.as<float>(), st.targets_dev.as<int32_t>(), st.lse_head.as<float>(), dl,
                                    n, V, -100, loss_scale / double(st.ce_count), s);
    const bool tied = layout_.lm_head < 0;
    const int64_t head = tied ? layout_.embed_tokens : layout_.lm_head;
    T* dxfn = static_cast<T*>(scratch_[2].ensure(n * H * elem_));
    // dlogits is T: bf16 for a bf16 model, the precision its GEMMs take (the CPU twin keeps f32).
    cuda::linear_backward<T>(st.xfn.as<T>(), W(head), dl, dxfn, g(head), n, H, V, impl_->cublas);
    cuda::rmsnorm_backward<T>(st.out.as<T>(), W(layout_.norm), st.rstdf.as<float>(), dxfn, dr, g(layout_.norm), n,
                              H, impl_->ws, s);
  });
}

void CudaMixtralModel::moe_backward(int layer, CudaModelState& st, double loss_scale) {
  const Stream s = backend_->stream();
  moe_backward_combine(layer, st, loss_scale);
  moe_backward_dispatch(layer, st, s);
  moe_backward_experts(layer, st);
  moe_backward_return(layer, st, s);
  moe_backward_finish(layer, st);
}

void CudaMixtralModel::moe_backward_combine(int layer, CudaModelState& st, double loss_scale) {
  CudaBlockState& b = st.blocks[layer];
  if (config_.output_router_logits)
    b.moe->set_load_balance_grad(
        load_balance_prob_grad(config_, st.expert_fraction, double(b.moe->config().tokens) * world_, loss_scale));
  // The first backward of a layer after zero_grads() writes its experts' gradients, the others add to them
  // (in the order these calls come, which is the order their expert phases run on the backend's stream).
  if (experts_fresh_[layer]) {
    b.moe->zero_grads();  // the gate's share is zero already; the experts' are written by this backward
    experts_fresh_[layer] = false;
  } else {
    b.moe->accumulate_grads();
  }
  b.moe->backward_combine(st.dresid.data());  // its stages: the engine's marks
}

void CudaMixtralModel::moe_backward_dispatch(int layer, CudaModelState& st, Stream lane) {
  st.blocks[layer].moe->backward_dispatch(lane);
}

void CudaMixtralModel::moe_backward_experts(int layer, CudaModelState& st) { st.blocks[layer].moe->backward_experts(); }

void CudaMixtralModel::moe_backward_return(int layer, CudaModelState& st, Stream lane) {
  st.blocks[layer].moe->backward_return(lane);
}

void CudaMixtralModel::moe_backward_finish(int layer, CudaModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  st.blocks[layer].moe->backward_finish(st.dmoe.ensure(n * H * elem_));
  impl_->marks.mark(nullptr);
}

void CudaMixtralModel::attention_backward(int layer, CudaModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size, Q = config_.q_size(), KV = config_.kv_size(),
                D = config_.head_size();
  const int32_t heads = config_.num_attention_heads, kv_heads = config_.num_key_value_heads;
  cudaStream_t s = impl_->stream;
  Buffer& dh = scratch_[1];
  Buffer& dattn = scratch_[3];
  Buffer& dq = scratch_[4];
  Buffer& dk = scratch_[5];
  Buffer& dv = scratch_[6];
  Buffer& dxn1 = scratch_[7];
  CudaBlockState& b = st.blocks[layer];
  const ParamLayout::Layer& lw = layout_.layers[layer];
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    auto W = [&](int64_t off) { return static_cast<const T*>(w(off)); };
    T* dr = st.dresid.as<T>();
    T* dhn2 = st.dmoe.as<T>();
    std::optional<StageScope> scope;
    scope.emplace(impl_->timer, "bwd post-attention norm + residual");
    T* dhp = static_cast<T*>(dh.ensure(n * H * elem_));
    cuda::rmsnorm_backward<T>(b.h.as<T>(), W(lw.post_attention_layernorm), b.rstd2.as<float>(), dhn2, dhp,
                              g(lw.post_attention_layernorm), n, H, impl_->ws, s);
    cuda::add_into<T>(dhp, dr, n * H, s);  // h feeds the residual and the norm
    scope.reset();
    scope.emplace(impl_->timer, "bwd o-proj");
    T* da = static_cast<T*>(dattn.ensure(n * Q * elem_));
    cuda::linear_backward<T>(b.attn.as<T>(), W(lw.o_proj), dhp, da, g(lw.o_proj), n, Q, H, impl_->cublas);
    scope.reset();
    scope.emplace(impl_->timer, "bwd attention core");
    T* dqp = static_cast<T*>(dq.ensure(n * Q * elem_));
    T* dkp = static_cast<T*>(dk.ensure(n * KV * elem_));
    T* dvp = static_cast<T*>(dv.ensure(n * KV * elem_));
    bool done = false;
    if constexpr (std::is_same_v<T, bf16>) {
      if (impl_->cudnn) {
        impl_->cudnn->backward(b.q.as<T>(), b.k.as<T>(), b.v.as<T>(), b.attn.as<T>(), b.lse.as<float>(), da, dqp,
                               dkp, dvp, st.batch, st.seq, heads, kv_heads, D, s);
        done = true;
      }
    }
    if (!done)
      cuda::attention_backward<T>(b.q.as<T>(), b.k.as<T>(), b.v.as<T>(), b.attn.as<T>(), b.lse.as<float>(), da,
                                  dqp, dkp, dvp, st.batch, st.seq, heads, kv_heads, D, impl_->ws, s);
    scope.reset();
    scope.emplace(impl_->timer, "bwd rope + q/k/v + norm");
    cuda::rope_backward<T>(dqp, dqp, n, st.seq, heads, D, config_.rope_theta, s);
    cuda::rope_backward<T>(dkp, dkp, n, st.seq, kv_heads, D, config_.rope_theta, s);
    // xn1 feeds q, k and v: its gradient is the sum of the three.
    T* dx1 = static_cast<T*>(dxn1.ensure(n * H * elem_));
    cuda::linear_backward<T>(b.xn1.as<T>(), W(lw.q_proj), dqp, dx1, g(lw.q_proj), n, H, Q, impl_->cublas);
    cuda::linear_backward<T>(b.xn1.as<T>(), W(lw.k_proj), dkp, dx1, g(lw.k_proj), n, H, KV, impl_->cublas, true);
    cuda::linear_backward<T>(b.xn1.as<T>(), W(lw.v_proj), dvp, dx1, g(lw.v_proj), n, H, KV, impl_->cublas, true);
    cuda::rmsnorm_backward<T>(b.x.as<T>(), W(lw.input_layernorm), b.rstd1.as<float>(), dx1, dr,
                              g(lw.input_layernorm), n, H, impl_->ws, s);
    cuda::add_into<T>(dr, dhp, n * H, s);  // dresid = dh + d(norm input)
  });
}

void CudaMixtralModel::embed_backward(CudaModelState& st) {
  const int64_t n = st.batch * st.seq, H = config_.hidden_size;
  StageScope scope(impl_->timer, "bwd embedding");
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    cuda::embedding_backward<T>(st.tokens_dev.as<int32_t>(), st.dresid.as<T>(), g(layout_.embed_tokens), n,
                                config_.vocab_size, H, impl_->ws, impl_->stream);
  });
  st.forward_done = false;
}

void CudaMixtralModel::reduce_grads() {
  if (world_ == 1) return;
  StageScope scope(impl_->timer, "gradient all-reduce");
  // Norms, dense matrices and routers are contiguous: one all-reduce (the experts stay with their owners).
  comm_.allreduce_sum(grad_.data(), layout_.group_begin[ParamLayout::experts], DType::f32, backend_->stream());
}

void CudaMixtralModel::grad_sum_of_squares(double out[2]) {
  StageScope scope(impl_->timer, "gradient norm");
  impl_->norm_sums.bind(*backend_);
  double* d = static_cast<double*>(impl_->norm_sums.ensure(16));
  const int64_t split = layout_.group_begin[ParamLayout::experts];
  cuda::sum_of_squares(g(0), split, d, impl_->ws, impl_->stream);
  if (bf16_expert_grads_)
    cuda::sum_of_squares(static_cast<const bf16*>(expert_grad(split)), layout_.total() - split, d + 1, impl_->ws,
                         impl_->stream);
  else
    cuda::sum_of_squares(g(split), layout_.total() - split, d + 1, impl_->ws, impl_->stream);
  if (world_ > 1) comm_.allreduce_sum(d + 1, 1, DType::f64, backend_->stream());  // the experts of every rank
  backend_->download(out, d, 16);
}

void CudaMixtralModel::adamw_step(const cpu::AdamWParams& p, double weight_decay, double grad_scale) {
  StageScope scope(impl_->timer, "AdamW");
  const int64_t split = layout_.group_begin[ParamLayout::dense];  // norms: no weight decay
  const int64_t experts_at = layout_.group_begin[ParamLayout::experts], total = layout_.total();
  cpu::AdamWParams no_decay = p, decay = p;
  no_decay.weight_decay = 0;
  decay.weight_decay = weight_decay;
  float* pm = master_.as<float>();
  float* gr = grad_.as<float>();
  float* m = m_.as<float>();
  float* v = v_.as<float>();
  with_storage(storage_, [&](auto tag) {
    using T = decltype(tag);
    T* copy = storage_ == DType::bf16 ? reinterpret_cast<T*>(compute_.data()) : nullptr;
    auto at = [&](int64_t o) { return copy ? copy + o : nullptr; };
    cuda::adamw_step<T>(pm, gr, m, v, split, no_decay, grad_scale, copy, impl_->stream);
    if (!bf16_expert_grads_) {
      cuda::adamw_step<T>(pm + split, gr + split, m + split, v + split, total - split, decay, grad_scale, at(split),
                          impl_->stream);
      return;
    }
    cuda::adamw_step<T>(pm + split, gr + split, m + split, v + split, experts_at - split, decay, grad_scale,
                        at(split), impl_->stream);
    cuda::adamw_step<T>(pm + experts_at, static_cast<const bf16*>(expert_grad(experts_at)), m + experts_at,
                        v + experts_at, total - experts_at, decay, grad_scale, at(experts_at), impl_->stream);
  });
}

}  // namespace dmoe
