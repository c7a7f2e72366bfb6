// dmoe_ext.cpp — the extension module dmoe._dmoe: LayerSession (engine/layer_session.hpp) for Python.
//
// Arrays cross as nanobind ndarrays (DLPack: numpy arrays, torch tensors, anything with __dlpack__) without
// copies: the engine reads and writes the caller's memory. Every array is checked before any work — device
// (host memory for the cpu engine, this session's GPU for ep/flash), dtype, shape and C-contiguity — and a
// mismatch raises TypeError or ValueError naming the argument, what it is and what is allowed. dmoe's own
// errors become ValueError (bad input) or RuntimeError (internal). The GIL is released while the engine runs.
// A session runs one call at a time (a mutex: threads sharing a layer wait for each other), and it keeps the
// arrays a train forward read (x and the weights, which its backward reads again) referenced until that
// backward or release, so that dropping them in between cannot leave the engine reading freed memory.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <type_traits>
#include <string>
#include <vector>

#include "comm/bootstrap_exchange.hpp"
#include "core/config.hpp"
#include "core/error.hpp"
#include "engine/layer_session.hpp"

namespace nb = nanobind;

namespace dmoe {
namespace {

using Array = nb::ndarray<>;              // written by dmoe (y, dx, the gradients, the routing outputs)
using InArray = nb::ndarray<nb::ro>;      // read only (x, the weights, dy): read-only arrays are accepted

// Takes one argument as an array, with a message naming it when it is none (nanobind's own message for a
// mismatch lists the whole signature and not which argument is wrong).
template <class A>
A as_array(nb::handle h, const char* name) {
  A a;
  if (nb::try_cast<A>(h, a, /*convert=*/false)) return a;
  std::string why;
  if constexpr (!std::is_same_v<A, InArray>) {
    InArray ro;
    if (nb::try_cast<InArray>(h, ro, false))
      throw nb::value_error(("dmoe: " + std::string(name) + " is read-only; dmoe writes its result there: pass a "
                             "writable array").c_str());
  }
  if (nb::hasattr(h, "requires_grad") && nb::hasattr(h, "detach") && nb::cast<bool>(h.attr("requires_grad")))
    why = " (a torch.Tensor that requires grad: pass tensor.detach())";
  else if (nb::hasattr(h, "is_meta") && nb::cast<bool>(h.attr("is_meta")))
    why = " (a tensor on the 'meta' device has no data)";
  const std::string type = nb::cast<std::string>(nb::str(nb::handle(reinterpret_cast<PyObject*>(Py_TYPE(h.ptr())))
                                                                .attr("__name__")));
  throw nb::type_error(("dmoe: " + std::string(name) + " must be an array (numpy.ndarray, torch.Tensor or anything "
                        "with __dlpack__ or the buffer protocol), got " + type + why)
                           .c_str());
}

template <class A>
std::optional<A> as_optional_array(nb::handle h, const char* name) {
  if (h.is_none()) return std::nullopt;
  return as_array<A>(h, name);
}

std::string dtype_text(nb::dlpack::dtype t) {
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  std::string base = code == nb::dlpack::dtype_code::Float    ? "float"
                     : code == nb::dlpack::dtype_code::Bfloat ? "bfloat"
                     : code == nb::dlpack::dtype_code::Int    ? "int"
                     : code == nb::dlpack::dtype_code::UInt   ? "uint"
                     : code == nb::dlpack::dtype_code::Bool   ? "bool"
                                                              : "complex";
  return base + std::to_string(int(t.bits)) + (t.lanes != 1 ? "x" + std::to_string(int(t.lanes)) : "");
}

nb::dlpack::dtype dlpack_of(DType t) {
  switch (t) {
    case DType::f32: return nb::dtype<float>();
    case DType::f64: return nb::dtype<double>();
    case DType::i32: return nb::dtype<int32_t>();
    case DType::i64: return nb::dtype<int64_t>();
    case DType::bf16: return nb::dlpack::dtype{uint8_t(nb::dlpack::dtype_code::Bfloat), 16, 1};
  }
  return {};
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

template <class A>
std::string shape_of(const A& a) {
  std::vector<int64_t> s;
  for (size_t i = 0; i < a.ndim(); ++i) s.push_back(int64_t(a.shape(i)));
  return shape_text(s);
}

// What the session's arrays must live on, for messages and checks.
struct Place {
  bool cuda = false;
  int device = -1;
  std::string text() const { return cuda ? "CUDA device " + std::to_string(device) : "host (CPU) memory"; }
};

// Checks one array and returns its data pointer: device, dtype, shape (the element count only when
// `flat`: any shape with that many elements, e.g. [B, S, H] for [rows, H]), C-contiguity.
template <class A>
void* check_array(const A& a, const char* name, const Place& place, DType dtype, const std::vector<int64_t>& shape,
                  bool flat = false) {
  const bool on_cuda = a.device_type() == nb::device::cuda::value;
  const bool on_host = a.device_type() == nb::device::cpu::value;
  if (place.cuda ? !(on_cuda && a.device_id() == place.device) : !on_host) {
    const std::string where = on_cuda ? "CUDA device " + std::to_string(a.device_id())
                              : on_host ? "host (CPU) memory"
                                        : "device type " + std::to_string(a.device_type());
    throw nb::value_error(("dmoe: " + std::string(name) + " is in " + where + "; this session's engine needs it in " +
                           place.text() + (place.cuda ? "" : " (engine 'cpu'; for a GPU use engine 'ep' or 'flash')"))
                              .c_str());
  }
  if (a.dtype() != dlpack_of(dtype))
    throw nb::type_error(("dmoe: " + std::string(name) + " has dtype " + dtype_text(a.dtype()) + "; allowed: " +
                          dtype_text(dlpack_of(dtype)) + " (" + dtype_name(dtype) + ")")
                             .c_str());
  int64_t count = 1;
  for (int64_t s : shape) count *= s;
  bool shape_ok = true;
  if (flat) {
    shape_ok = int64_t(a.size()) == count && a.ndim() >= 1 && int64_t(a.shape(a.ndim() - 1)) == shape.back();
  } else {
    shape_ok = a.ndim() == shape.size();
    for (size_t i = 0; shape_ok && i < shape.size(); ++i) shape_ok = int64_t(a.shape(i)) == shape[i];
  }
  if (!shape_ok)
    throw nb::value_error(("dmoe: " + std::string(name) + " has shape " + shape_of(a) + "; expected " +
                           shape_text(shape) + (flat ? " (or any shape with that last dimension and element count)" : ""))
                              .c_str());
  int64_t expect = 1;  // C-contiguous: strides (in elements) of dims longer than 1 are products of the later dims
  for (size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      throw nb::value_error(("dmoe: " + std::string(name) + " (shape " + shape_of(a) +
                             ") is not C-contiguous; pass a contiguous array (numpy.ascontiguousarray, "
                             "tensor.contiguous())")
                                .c_str());
    expect *= int64_t(a.shape(i));
  }
  return const_cast<void*>(static_cast<const void*>(a.data()));
}

DType parse_storage(const std::string& name) {
  if (name == "f32" || name == "float32") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  throw nb::value_error(("dmoe: dtype '" + name + "' is not supported; allowed: float32 (f32), bfloat16 (bf16)").c_str());
}

class PySession {
 public:
  PySession(int64_t hidden, int64_t ffn, int32_t experts, int32_t top_k, const std::string& activation,
            int32_t world, const std::string& engine, const std::string& dtype, bool renormalize,
            double capacity_factor, const std::string& drop_policy, double aux_loss_coef, double z_loss_coef,
            int32_t device, const std::string& comm, int64_t max_tokens, bool pad_to_capacity,
            int32_t batch_row_multiple) {
    MoeConfig c;
    c.tokens = 1;
    c.hidden = hidden;
    c.ffn = ffn;
    c.experts = experts;
    c.top_k = top_k;
    c.activation = parse_activation(activation);
    c.world = world;
    c.dtype = parse_storage(dtype);
    c.renormalize = renormalize;
    c.capacity_factor = capacity_factor;
    c.drop_policy = parse_drop_policy(drop_policy);
    c.aux_loss_coef = aux_loss_coef;
    c.z_loss_coef = z_loss_coef;
    SessionOptions o;
    o.engine = parse_engine_kind(engine);
    // Checked for every engine (the CPU engine ignores them), so that a typo is not found only on a GPU.
    if (comm != "auto" && comm != "nccl" && comm != "nvshmem")
      throw nb::value_error(("dmoe: comm '" + comm + "' is unknown; allowed: auto, nccl, nvshmem").c_str());
    if (max_tokens < 1)
      throw nb::value_error(("dmoe: max_tokens = " + std::to_string(max_tokens) + " is invalid; must be >= 1").c_str());
    o.device = device;
    o.comm = comm;
    o.max_tokens = max_tokens;
    o.ep.pad_to_capacity = pad_to_capacity;
    o.ep.batch_row_multiple = batch_row_multiple;
    session_ = std::make_unique<LayerSession>(c, o);
    place_.cuda = o.engine != EngineKind::cpu;
    place_.device = session_->device();
    // The CPU engine stores f32 (a bf16 config is emulated by rounding); CUDA stores the config's dtype.
    storage_ = place_.cuda ? c.dtype : DType::f32;
  }

  LayerSession& session() { return *session_; }
  const Place& place() const { return place_; }
  DType storage() const { return storage_; }

  // Runs fn on the session with the GIL released and the session's lock held (the lock is taken without the GIL,
  // so a thread waiting for it never blocks one that needs the GIL).
  template <class F>
  auto locked(F&& fn) {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mutex_);
    return fn(*session_);
  }

  void set_stream(uintptr_t stream) {
    locked([&](LayerSession& s) { s.set_stream(reinterpret_cast<Stream>(stream)); });
  }

  int64_t forward(nb::handle x_h, nb::handle y_h, nb::handle gate_h, nb::handle w1_h, nb::handle w3_h,
                  nb::handle w2_h, bool train, nb::handle ids_h, nb::handle weights_h, nb::handle logits_h) {
    const MoeConfig& c = session_->config();
    const int64_t H = c.hidden, E = c.experts, k = c.top_k, Ne = session_->held_experts();
    const InArray x = as_array<InArray>(x_h, "x");
    const Array y = as_array<Array>(y_h, "y");
    const InArray gate = as_array<InArray>(gate_h, "gate"), w1 = as_array<InArray>(w1_h, "w1"),
                  w2 = as_array<InArray>(w2_h, "w2");
    const std::optional<InArray> w3 = as_optional_array<InArray>(w3_h, "w3");
    const std::optional<Array> expert_ids = as_optional_array<Array>(ids_h, "expert_ids"),
                               expert_weights = as_optional_array<Array>(weights_h, "expert_weights"),
                               router_logits = as_optional_array<Array>(logits_h, "router_logits");
    if (x.ndim() < 1 || int64_t(x.shape(x.ndim() - 1)) != H)
      throw nb::value_error(("dmoe: x has shape " + shape_of(x) + "; its last dimension must be hidden = " +
                             std::to_string(H)).c_str());
    const int64_t rows = int64_t(x.size()) / H;
    if (rows < 1)
      throw nb::value_error(("dmoe: x has shape " + shape_of(x) + ", no tokens; give at least one").c_str());
    SessionForward f;
    f.rows = rows;
    f.train = train;
    f.x = check_array(x, "x", place_, storage_, {rows, H}, true);
    f.y = check_array(y, "y", place_, storage_, {rows, H}, true);
    check_weights(gate, w1, w3, w2, storage_, Ne, "");
    f.weights = WeightViews{gate.data(), w1.data(), w3 ? w3->data() : nullptr, w2.data()};
    if (expert_ids) f.expert_ids = static_cast<int32_t*>(check_array(*expert_ids, "expert_ids", place_, DType::i32, {rows, k}));
    if (expert_weights)
      f.expert_weights = static_cast<float*>(check_array(*expert_weights, "expert_weights", place_, DType::f32, {rows, k}));
    if (router_logits)
      f.router_logits = static_cast<float*>(check_array(*router_logits, "router_logits", place_, DType::f32, {rows, E}));
    const int64_t ticket = locked([&](LayerSession& s) { return s.forward(f); });
    if (ticket >= 0) {
      Pending& p = pending_[ticket];
      p.rows = rows;
      for (nb::handle h : {x_h, gate_h, w1_h, w3_h, w2_h}) p.keep.push_back(nb::borrow(h));
    }
    return ticket;
  }

  void backward(int64_t ticket, nb::handle dy_h, nb::handle dx_h, nb::handle dgate_h, nb::handle dw1_h,
                nb::handle dw3_h, nb::handle dw2_h) {
    const MoeConfig& c = session_->config();
    const int64_t H = c.hidden;
    const InArray dy = as_array<InArray>(dy_h, "dy");
    const Array dx = as_array<Array>(dx_h, "dx"), dgate = as_array<Array>(dgate_h, "grad gate"),
                dw1 = as_array<Array>(dw1_h, "grad w1"), dw2 = as_array<Array>(dw2_h, "grad w2");
    const std::optional<Array> dw3 = as_optional_array<Array>(dw3_h, "grad w3");
    const auto pending = pending_.find(ticket);
    if (pending == pending_.end())
      throw nb::value_error(("dmoe: backward: ticket " + std::to_string(ticket) + " is not a pending train forward "
                             "of this layer (already backward()ed or released, or from an inference forward)").c_str());
    // dy and dx have the rows of that forward (the engine reads and writes that many).
    const int64_t rows = pending->second.rows;
    if (dy.ndim() < 1 || int64_t(dy.shape(dy.ndim() - 1)) != H)
      throw nb::value_error(("dmoe: dy has shape " + shape_of(dy) + "; its last dimension must be hidden = " +
                             std::to_string(H)).c_str());
    if (int64_t(dy.size()) / H != rows)
      throw nb::value_error(("dmoe: dy has shape " + shape_of(dy) + ", " + std::to_string(int64_t(dy.size()) / H) +
                             " rows, but the forward of ticket " + std::to_string(ticket) + " had " +
                             std::to_string(rows) + "; dy and dx must have x's rows").c_str());
    SessionBackward b;
    b.ticket = ticket;
    b.dy = check_array(dy, "dy", place_, storage_, {rows, H}, true);
    b.dx = check_array(dx, "dx", place_, storage_, {rows, H}, true);
    // The experts' gradients in grad_dtype, or (engines ep/flash, bf16 weights) in bf16: written as they are
    // stored, without an f32 copy to cast (the module passes bf16 for bf16 parameters).
    const bool experts_bf16 = storage_ == DType::bf16 && place_.cuda && dw1.dtype() == dlpack_of(DType::bf16);
    for (const Array* g : {&dw2, dw3 ? &*dw3 : nullptr})
      if (g && g->dtype() != dw1.dtype())
        throw nb::type_error(("dmoe: grad w1, w3 and w2 must share one dtype (" +
                              std::string(dtype_name(session_->grad_dtype())) +
                              (storage_ == DType::bf16 && place_.cuda ? ", or bf16 for the bf16 weights" : "") +
                              "); got grad w1 " + dtype_text(dw1.dtype()) + " and " + dtype_text(g->dtype()))
                                 .c_str());
    check_weights(dgate, dw1, dw3, dw2, session_->grad_dtype(), session_->held_experts(), "grad ",
                  experts_bf16 ? DType::bf16 : session_->grad_dtype());
    b.grads = GradViews{dgate.data(), dw1.data(), dw3 ? dw3->data() : nullptr, dw2.data(), experts_bf16};
    // The engine uses the forward's state up whether the backward succeeds or fails: so are its kept arrays
    // (released here, with the GIL held, after the engine is done with them).
    std::vector<nb::object> keep = std::move(pending->second.keep);
    pending_.erase(pending);
    locked([&](LayerSession& s) { s.backward(b); });
  }

  // An unknown or already released ticket was silently nothing: a second release (or one after backward) hid a
  // caller's mix-up of tickets, as backward's and losses' errors do not.
  void release(int64_t ticket) {
    if (pending_.find(ticket) == pending_.end())
      throw nb::value_error(("dmoe: release: ticket " + std::to_string(ticket) + " is not a pending train forward "
                             "of this layer (already backward()ed or released, or from an inference forward)").c_str());
    locked([&](LayerSession& s) { s.release(ticket); });
    pending_.erase(ticket);
  }

  std::tuple<double, double> losses(int64_t ticket) {
    const RouterLosses l = locked([&](LayerSession& s) { return s.losses(ticket); });
    return std::make_tuple(l.load_balance, l.z_loss);
  }

  int64_t pending() {
    return locked([&](LayerSession& s) { return s.pending(); });
  }

  int64_t engines() {
    return locked([&](LayerSession& s) { return s.engines(); });
  }

 private:
  // expert_dtype: of w1/w3/w2 (defaults to dtype, the gate's).
  template <class A>
  void check_weights(const A& gate, const A& w1, const std::optional<A>& w3, const A& w2, DType dtype,
                     int64_t Ne, const std::string& prefix, std::optional<DType> expert_dtype = std::nullopt) {
    const MoeConfig& c = session_->config();
    const int64_t H = c.hidden, I = c.ffn, E = c.experts;
    const bool swiglu = c.activation == Activation::swiglu;
    const DType ed = expert_dtype.value_or(dtype);
    check_array(gate, (prefix + "gate").c_str(), place_, dtype, {E, H});
    check_array(w1, (prefix + "w1").c_str(), place_, ed, {Ne, I, H});
    check_array(w2, (prefix + "w2").c_str(), place_, ed, {Ne, H, I});
    if (swiglu != w3.has_value())
      throw nb::value_error(("dmoe: " + prefix + "w3 is " + (w3 ? "given" : "None") + " but the activation is " +
                             activation_name(c.activation) + "; w3 (the up projection) is given exactly for swiglu")
                                .c_str());
    if (w3) check_array(*w3, (prefix + "w3").c_str(), place_, ed, {Ne, I, H});
  }

  // A pending train forward: its rows, and the arrays it read (kept referenced until its backward or release).
  struct Pending {
    int64_t rows = 0;
    std::vector<nb::object> keep;
  };

  std::mutex mutex_;  // one engine call at a time
  std::map<int64_t, Pending> pending_;  // touched with the GIL held
  std::unique_ptr<LayerSession> session_;
  Place place_;
  DType storage_ = DType::f32;
};

}  // namespace
}  // namespace dmoe

NB_MODULE(_dmoe, m) {
  using namespace dmoe;
  // Modules holding sessions may live until interpreter exit (torch keeps modules in globals): not a leak.
  nb::set_leak_warnings(false);
  m.doc() = "dmoe's engines (see dmoe.MoELayer and dmoe.layer_forward for the Python API)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const dmoe::Error& e) {
      PyErr_SetString(e.is_input() ? PyExc_ValueError : PyExc_RuntimeError, e.what());
    }
  });
  m.def("cuda_built", &cuda_engines_built, "Whether this build has the CUDA engines (ep, flash).");
  m.def(
      "_set_bootstrap_exchange",
      [](nb::object fn) {
        if (fn.is_none()) return set_bootstrap_exchange({});
        // Kept as long as it is registered; released with the GIL held, or left to the OS after interpreter exit.
        std::shared_ptr<nb::object> held(new nb::object(fn), [](nb::object* p) {
          if (!Py_IsInitialized()) return;
          nb::gil_scoped_acquire gil;
          delete p;
        });
        set_bootstrap_exchange([held](const std::string& name, void* data, size_t bytes) {
          nb::gil_scoped_acquire gil;  // the communicators are set up with the GIL released
          try {
            nb::object out = (*held)(name, nb::bytes(static_cast<const char*>(data), bytes));
            const nb::bytes got = nb::cast<nb::bytes>(out);
            if (got.size() != bytes)
              throw std::runtime_error("the exchange returned " + std::to_string(got.size()) + " bytes for " + name +
                                       ", expected " + std::to_string(bytes));
            std::memcpy(data, got.c_str(), bytes);
          } catch (nb::python_error& e) {
            throw std::runtime_error(e.what());  // the Python error is released here, under the GIL
          } catch (nb::cast_error&) {
            throw std::runtime_error("the exchange for " + name + " did not return bytes");
          }
        });
      },
      nb::arg("exchange").none(),
      "Registers fn(name: str, payload: bytes) -> bytes, called collectively by every rank while dmoe's "
      "communicators start: it returns rank 0's payload on every rank (dmoe.init_from_process_group registers one "
      "over a torch.distributed group); None removes it.");
  m.def(
      "_run_bootstrap_exchange",
      [](const std::string& name, nb::bytes payload) {
        const BootstrapExchange exchange = bootstrap_exchange();
        if (!exchange) throw nb::value_error("no bootstrap exchange is registered");
        std::string buffer(payload.c_str(), payload.size());
        {
          nb::gil_scoped_release release;  // as when the communicators start
          exchange(name, buffer.data(), buffer.size());
        }
        return nb::bytes(buffer.data(), buffer.size());
      },
      nb::arg("name"), nb::arg("payload"), "Tests: runs the registered exchange as a communicator's start-up would.");

  nb::class_<PySession>(m, "Session",
                        "One MoE layer's engine state (dmoe::LayerSession): forward/backward on caller-owned arrays.")
      .def(nb::init<int64_t, int64_t, int32_t, int32_t, const std::string&, int32_t, const std::string&,
                    const std::string&, bool, double, const std::string&, double, double, int32_t, const std::string&,
                    int64_t, bool, int32_t>(),
           nb::arg("hidden"), nb::arg("ffn"), nb::arg("experts"), nb::arg("top_k"), nb::arg("activation") = "swiglu",
           nb::arg("world") = 1, nb::arg("engine") = "cpu", nb::arg("dtype") = "f32", nb::arg("renormalize") = true,
           nb::arg("capacity_factor") = 0.0, nb::arg("drop_policy") = "latest-tokens", nb::arg("aux_loss_coef") = 0.0,
           nb::arg("z_loss_coef") = 0.0, nb::arg("device") = -1, nb::arg("comm") = "auto",
           nb::arg("max_tokens") = 8192, nb::arg("pad_to_capacity") = true, nb::arg("batch_row_multiple") = 1)
      .def_prop_ro("rank", [](PySession& s) { return s.session().rank(); })
      .def_prop_ro("world", [](PySession& s) { return s.session().world(); })
      .def_prop_ro("device", [](PySession& s) { return s.session().device(); })
      .def_prop_ro("engine", [](PySession& s) { return std::string(engine_kind_name(s.session().engine())); })
      .def_prop_ro("comm", [](PySession& s) { return std::string(s.session().comm_name()); })
      .def_prop_ro("first_expert", [](PySession& s) { return s.session().first_expert(); })
      .def_prop_ro("held_experts", [](PySession& s) { return s.session().held_experts(); })
      .def_prop_ro("storage_dtype", [](PySession& s) { return std::string(dtype_name(s.storage())); })
      .def_prop_ro("grad_dtype", [](PySession& s) { return std::string(dtype_name(s.session().grad_dtype())); })
      .def_prop_ro("pending", &PySession::pending)
      .def_prop_ro("engines", &PySession::engines)
      .def("set_stream", &PySession::set_stream, nb::arg("stream"),
           "CUDA: issue the following calls' work on this cudaStream_t (an int, e.g. torch's "
           "current_stream().cuda_stream; 0 is the legacy default stream).")
      // The arrays are taken as objects (None too) and converted by as_array, whose messages name the argument.
      .def("forward", &PySession::forward, nb::arg("x").none(), nb::arg("y").none(), nb::arg("gate").none(),
           nb::arg("w1").none(), nb::arg("w3").none(), nb::arg("w2").none(), nb::arg("train") = true,
           nb::arg("expert_ids").none() = nb::none(),
           nb::arg("expert_weights").none() = nb::none(), nb::arg("router_logits").none() = nb::none(),
           "Writes y; returns a ticket for backward() when train (-1 otherwise).")
      .def("backward", &PySession::backward, nb::arg("ticket"), nb::arg("dy").none(), nb::arg("dx").none(),
           nb::arg("dgate").none(), nb::arg("dw1").none(), nb::arg("dw3").none(), nb::arg("dw2").none(),
           "Writes dx and the gradients (grad_dtype; gate summed over ranks) of the forward behind ticket. CUDA "
           "with bfloat16 weights: dw1/dw3/dw2 may be bfloat16 instead (rounded once as they are stored).")
      .def("release", &PySession::release, nb::arg("ticket"))
      .def("losses", &PySession::losses, nb::arg("ticket"),
           "(load_balance, z_loss) of a pending train forward, over all ranks' tokens.");
}
