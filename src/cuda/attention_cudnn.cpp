// cuda/attention_cudnn.cpp — CudnnAttention (attention_cudnn.hpp): cuDNN's fused attention through
// cudnn-frontend graphs, or a stub when the build did not find the frontend (DMOE_WITH_CUDNN unset).
//
// Loading: the frontend is compiled with NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING, so its calls into cuDNN go
// through dlsym on cudnn_frontend::cudnn_dlhandle (defined and set here), and its few CUDA runtime calls
// (device properties, graph helpers) through a shared libcudart.so.<major> that it dlopens by name. dmoe
// links the CUDA runtime statically, so that library may not be on the loader's path: it is preloaded here
// from the toolkit directory of the build when the name alone does not resolve (a later dlopen by name then
// finds the loaded object), unless CUDNN_FRONTEND_CUDART_LIB_NAME already tells the frontend which one to use.
#include "cuda/attention_cudnn.hpp"

#include <cstdlib>
#include <string>

#include "core/error.hpp"

#if defined(DMOE_WITH_CUDNN)

#include <dlfcn.h>

#include <cmath>
#include <exception>
#include <map>
#include <tuple>
#include <unordered_map>

#include <cudnn_frontend.h>

#include "cuda/check.hpp"
#include "cuda/common.hpp"
#include "cuda/kernels.cuh"

// The frontend's handle of the loaded libcudnn (declared extern by cudnn_frontend_shim.h).
namespace cudnn_frontend {
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace dmoe::cuda {

namespace fe = cudnn_frontend;

namespace {

// ---- loading libcudnn (once per process) ------------------------------------------------------------

struct CudnnLibrary {
  bool ok = false;
  std::string why;       // when !ok: what failed, with every path tried
  size_t version = 0;    // cudnnGetVersion(), e.g. 91900
  std::string path;      // the name or path that loaded
};

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "unknown dlopen error";
}

// libcudart.so.<major> for the frontend's runtime calls: "" when loadable, else what was tried.
std::string preload_cudart() {
  if (const char* named = std::getenv("CUDNN_FRONTEND_CUDART_LIB_NAME"); named && *named) return "";
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) version = CUDART_VERSION;
  const std::string soname = "libcudart.so." + std::to_string(version / 1000);
  std::string tried;
  if (dlopen(soname.c_str(), RTLD_NOW | RTLD_GLOBAL)) return "";
  tried = soname + ": " + dl_error();
#if defined(DMOE_CUDART_LIBRARY_DIR_HINT)
  const std::string hinted = std::string(DMOE_CUDART_LIBRARY_DIR_HINT) + "/" + soname;
  if (dlopen(hinted.c_str(), RTLD_NOW | RTLD_GLOBAL)) return "";
  tried += "; " + hinted + ": " + dl_error();
#endif
  return "cudnn-frontend needs the shared CUDA runtime " + soname + " at run time (tried " + tried +
         "; add its directory to LD_LIBRARY_PATH or name it in CUDNN_FRONTEND_CUDART_LIB_NAME)";
}

CudnnLibrary load_library() {
  CudnnLibrary lib;
  std::vector<std::string> candidates;
  if (const char* explicit_path = std::getenv("DMOE_CUDNN_LIBRARY"); explicit_path && *explicit_path) {
    candidates.push_back(explicit_path);  // the user's choice: nothing else is tried
  } else {
    candidates.push_back("libcudnn.so.9");
#if defined(DMOE_CUDNN_LIBRARY_HINT)
    candidates.push_back(DMOE_CUDNN_LIBRARY_HINT);
#endif
  }
  void* handle = nullptr;
  std::string tried;
  for (const std::string& name : candidates) {
    dlerror();
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle) {
      lib.path = name;
      break;
    }
    tried += (tried.empty() ? "" : "; ") + name + ": " + dl_error();
  }
  if (!handle) {
    lib.why = "libcudnn.so.9 could not be loaded (" + tried +
              "); set DMOE_CUDNN_LIBRARY to its path or add its directory to LD_LIBRARY_PATH (PyTorch's wheels "
              "have it in site-packages/nvidia/cudnn/lib)";
    return lib;
  }
  using GetVersion = size_t (*)();
  auto get_version = reinterpret_cast<GetVersion>(dlsym(handle, "cudnnGetVersion"));
  if (!get_version) {
    lib.why = lib.path + " has no cudnnGetVersion: " + dl_error();
    return lib;
  }
  lib.version = get_version();
  if (lib.version < 90000 || lib.version >= 100000) {
    lib.why = lib.path + " is cuDNN " + std::to_string(lib.version) + "; cuDNN 9 is needed";
    return lib;
  }
  if (std::string cudart = preload_cudart(); !cudart.empty()) {
    lib.why = cudart;
    return lib;
  }
  fe::cudnn_dlhandle = handle;
  lib.ok = true;
  return lib;
}

const CudnnLibrary& library() {
  static const CudnnLibrary lib = load_library();  // thread-safe, once
  return lib;
}

// ---- graphs -----------------------------------------------------------------------------------------

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kdO, kdQ, kdK, kdV };
enum class Direction { forward, backward };

struct Shape {
  int64_t batch, seq;
  int32_t heads, kv_heads;
  int64_t head_dim;
};

std::string describe(const Shape& s) {
  return fmt::format("batch {}, seq {}, heads {}, kv_heads {}, head_dim {}, bf16", s.batch, s.seq, s.heads,
                     s.kv_heads, s.head_dim);
}

// [B, H, S, D] view of a [B·S, H, D] tensor (token-major, BSHD).
std::vector<int64_t> bhsd_dims(const Shape& s, int64_t h) { return {s.batch, h, s.seq, s.head_dim}; }
std::vector<int64_t> bshd_strides(const Shape& s, int64_t h) {
  return {s.seq * h * s.head_dim, s.head_dim, h * s.head_dim, 1};
}

std::shared_ptr<fe::graph::Tensor_attributes> activation(fe::graph::Graph& g, const char* name, Uid uid,
                                                          const Shape& s, int64_t h) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(bhsd_dims(s, h))
                      .set_stride(bshd_strides(s, h)));
}

// lse [B, H, S] seen as cuDNN's Stats [B, H, S, 1] f32.
fe::graph::Tensor_attributes& as_stats(fe::graph::Tensor_attributes& t, const Shape& s) {
  return t.set_uid(kStats)
      .set_data_type(fe::DataType_t::FLOAT)
      .set_dim({s.batch, s.heads, s.seq, 1})
      .set_stride({int64_t(s.heads) * s.seq, s.seq, 1, 1});
}

float softmax_scale(const Shape& s) { return float(1.0 / std::sqrt(double(s.head_dim))); }

void check(fe::error_t status, const char* step, Direction dir, const Shape& s) {
  DMOE_REQUIRE(status.is_good(), "cuDNN attention {} ({}): {} failed: {}",
               dir == Direction::forward ? "forward" : "backward", describe(s), step, status.get_message());
}

std::shared_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

std::shared_ptr<fe::graph::Graph> forward_graph(const Shape& s) {
  auto g = new_graph();
  auto q = activation(*g, "q", kQ, s, s.heads);
  auto k = activation(*g, "k", kK, s, s.kv_heads);
  auto v = activation(*g, "v", kV, s, s.kv_heads);
  auto options = fe::graph::SDPA_attributes()
                     .set_name("dmoe_attention_forward")
                     .set_generate_stats(true)
                     .set_causal_mask(true)
                     .set_attn_scale(softmax_scale(s));
  auto [o, stats] = g->sdpa(q, k, v, options);
  o->set_output(true).set_uid(kO).set_dim(bhsd_dims(s, s.heads)).set_stride(bshd_strides(s, s.heads));
  as_stats(stats->set_output(true), s);
  return g;
}

std::shared_ptr<fe::graph::Graph> backward_graph(const Shape& s) {
  auto g = new_graph();
  auto q = activation(*g, "q", kQ, s, s.heads);
  auto k = activation(*g, "k", kK, s, s.kv_heads);
  auto v = activation(*g, "v", kV, s, s.kv_heads);
  auto o = activation(*g, "o", kO, s, s.heads);
  auto dout = activation(*g, "dout", kdO, s, s.heads);
  auto stats = g->tensor(fe::graph::Tensor_attributes().set_name("stats"));
  as_stats(*stats, s);
  auto options = fe::graph::SDPA_backward_attributes()
                     .set_name("dmoe_attention_backward")
                     .set_causal_mask(true)
                     .set_attn_scale(softmax_scale(s))
                     .set_deterministic_algorithm(true);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, options);
  dq->set_output(true).set_uid(kdQ).set_dim(bhsd_dims(s, s.heads)).set_stride(bshd_strides(s, s.heads));
  dk->set_output(true).set_uid(kdK).set_dim(bhsd_dims(s, s.kv_heads)).set_stride(bshd_strides(s, s.kv_heads));
  dv->set_output(true).set_uid(kdV).set_dim(bhsd_dims(s, s.kv_heads)).set_stride(bshd_strides(s, s.kv_heads));
  return g;
}

void check_shape(const Shape& s, std::initializer_list<const void*> pointers) {
  DMOE_REQUIRE(s.batch > 0 && s.seq > 0 && s.heads > 0 && s.kv_heads > 0 && s.heads % s.kv_heads == 0,
               "cuDNN attention ({}): sizes must be positive and heads a multiple of kv_heads", describe(s));
  DMOE_REQUIRE(s.head_dim > 0 && s.head_dim % 8 == 0,
               "cuDNN attention ({}): head_dim must be a positive multiple of 8 (16-byte strides)", describe(s));
  for (const void* p : pointers)
    DMOE_REQUIRE(is_aligned(p, 16), "cuDNN attention ({}): every tensor must be 16-byte aligned", describe(s));
}

}  // namespace

// ---- CudnnAttention ----------------------------------------------------------------------------------

struct CudnnAttention::State {
  cudnnHandle_t handle = nullptr;
  // Key: direction, sizes, storage type (bf16 only today).
  using Key = std::tuple<int, int64_t, int64_t, int32_t, int32_t, int64_t, int>;
  std::map<Key, std::shared_ptr<fe::graph::Graph>> graphs;
  Workspace workspace;

  fe::graph::Graph& graph(Direction dir, const Shape& s) {
    const Key key{int(dir), s.batch, s.seq, s.heads, s.kv_heads, s.head_dim, int(CUDA_R_16BF)};
    if (auto it = graphs.find(key); it != graphs.end()) return *it->second;
    auto g = dir == Direction::forward ? forward_graph(s) : backward_graph(s);
    check(g->validate(), "graph validation", dir, s);
    check(g->build_operation_graph(handle), "building the operation graph", dir, s);
    check(g->create_execution_plans({fe::HeurMode_t::A}), "creating execution plans", dir, s);
    check(g->check_support(), "support check (no cuDNN engine runs this graph)", dir, s);
    check(g->build_plans(), "building the plan", dir, s);
    return *graphs.emplace(key, std::move(g)).first->second;
  }

  void run(Direction dir, const Shape& s, std::unordered_map<int64_t, void*>& pack, cudaStream_t stream) {
    try {
      const cudnnStatus_t bound = fe::detail::set_stream(handle, stream);
      DMOE_REQUIRE(bound == CUDNN_STATUS_SUCCESS, "cuDNN attention ({}): cudnnSetStream failed: {}", describe(s),
                   fe::detail::get_error_string(bound));
      fe::graph::Graph& g = graph(dir, s);
      int64_t bytes = 0;
      check(g.get_workspace_size(bytes), "workspace query", dir, s);
      void* ws = workspace.reserve(size_t(std::max<int64_t>(bytes, 0)), stream);
      check(g.execute(handle, pack, ws), "execution", dir, s);
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // the frontend's own throws (a symbol missing from libcudnn, ...)
      DMOE_FAIL("cuDNN attention {} ({}): {}", dir == Direction::forward ? "forward" : "backward", describe(s),
                e.what());
    }
  }
};

bool CudnnAttention::available(std::string* why) {
  auto say = [&](std::string reason) {
    if (why) *why = std::move(reason);
    return false;
  };
  const CudnnLibrary& lib = library();
  if (!lib.ok) return say(lib.why);
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return say("no CUDA device");
  }
  if (major < 8) return say(fmt::format("cuDNN fused attention needs compute capability 8.0 or above (device {} "
                                        "is {}.x)", device, major));
  if (why) why->clear();
  return true;
}

CudnnAttention::CudnnAttention() : state_(std::make_unique<State>()) {
  std::string why;
  DMOE_REQUIRE(available(&why), "cuDNN attention is not available: {}", why);
  const cudnnStatus_t status = fe::detail::create_handle(&state_->handle);
  DMOE_REQUIRE(status == CUDNN_STATUS_SUCCESS, "cudnnCreate failed: {} (cuDNN {}, {})",
               fe::detail::get_error_string(status), library().version, library().path);
}

CudnnAttention::~CudnnAttention() {
  // cudnnDestroy synchronises the device: skipped once the GPU is abandoned (check.hpp), as cudaFree is.
  if (state_ && state_->handle && !gpu_abandoned()) (void)fe::detail::destroy_handle(state_->handle);
}

size_t CudnnAttention::graphs_built() const { return state_->graphs.size(); }

void CudnnAttention::forward(const bf16* q, const bf16* k, const bf16* v, bf16* out, float* lse, int64_t batch,
                             int64_t seq, int32_t heads, int32_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  const Shape s{batch, seq, heads, kv_heads, head_dim};
  check_shape(s, {q, k, v, out, lse});
  std::unordered_map<int64_t, void*> pack{{kQ, const_cast<bf16*>(q)}, {kK, const_cast<bf16*>(k)},
                                          {kV, const_cast<bf16*>(v)}, {kO, out},
                                          {kStats, lse}};
  state_->run(Direction::forward, s, pack, stream);
}

void CudnnAttention::backward(const bf16* q, const bf16* k, const bf16* v, const bf16* out, const float* lse,
                              const bf16* dout, bf16* dq, bf16* dk, bf16* dv, int64_t batch, int64_t seq,
                              int32_t heads, int32_t kv_heads, int64_t head_dim, cudaStream_t stream) {
  const Shape s{batch, seq, heads, kv_heads, head_dim};
  check_shape(s, {q, k, v, out, lse, dout, dq, dk, dv});
  std::unordered_map<int64_t, void*> pack{
      {kQ, const_cast<bf16*>(q)},      {kK, const_cast<bf16*>(k)},   {kV, const_cast<bf16*>(v)},
      {kO, const_cast<bf16*>(out)},    {kdO, const_cast<bf16*>(dout)}, {kStats, const_cast<float*>(lse)},
      {kdQ, dq},                       {kdK, dk},                    {kdV, dv}};
  state_->run(Direction::backward, s, pack, stream);
}

}  // namespace dmoe::cuda

#else  // !DMOE_WITH_CUDNN: the stub

namespace dmoe::cuda {

namespace {
constexpr const char* kNotBuilt =
    "dmoe was built without cudnn-frontend (install scripts/requirements-gpu.txt, or set CUDNN_FRONTEND_HOME, "
    "and configure again)";
}  // namespace

struct CudnnAttention::State {};

bool CudnnAttention::available(std::string* why) {
  if (why) *why = kNotBuilt;
  return false;
}

CudnnAttention::CudnnAttention() { DMOE_FAIL("cuDNN attention is not available: {}", kNotBuilt); }
CudnnAttention::~CudnnAttention() = default;
size_t CudnnAttention::graphs_built() const { return 0; }

void CudnnAttention::forward(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*, __nv_bfloat16*,
                             float*, int64_t, int64_t, int32_t, int32_t, int64_t, cudaStream_t) {
  DMOE_FAIL("cuDNN attention is not available: {}", kNotBuilt);
}

void CudnnAttention::backward(const __nv_bfloat16*, const __nv_bfloat16*, const __nv_bfloat16*,
                              const __nv_bfloat16*, const float*, const __nv_bfloat16*, __nv_bfloat16*,
                              __nv_bfloat16*, __nv_bfloat16*, int64_t, int64_t, int32_t, int32_t, int64_t,
                              cudaStream_t) {
  DMOE_FAIL("cuDNN attention is not available: {}", kNotBuilt);
}

}  // namespace dmoe::cuda

#endif
