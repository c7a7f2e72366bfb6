"""dmoe: distributed Mixture-of-Experts layers (C++/CUDA engines) for Python.

Two ways in:

* ``dmoe.MoELayer`` (module ``dmoe.module``): a ``torch.nn.Module`` whose gate and experts are
  ``torch.nn.Parameter`` s, running dmoe's engines forward and backward (torch is imported only when it is used);
* ``dmoe.layer_forward`` / ``dmoe.layer_backward``: numpy arrays in and out, on the CPU reference engine with
  ``world`` simulated ranks (threads), for tests and for use without torch.

Weight layout (Mixtral's checkpoint layout, experts stacked): gate ``[E, H]``; ``w1`` (gate projection) and
``w3`` (up projection, SwiGLU only) ``[E, I, H]``; ``w2`` (down projection) ``[E, H, I]``. An expert computes
``w2 @ act(w1 @ x)`` (relu, gelu) or ``w2 @ (silu(w1 @ x) * (w3 @ x))`` (swiglu); a token's output is the sum of
its top-k experts' outputs weighted by the softmax of the router logits ``x @ gate.T`` over the chosen k
(renormalised to sum to 1 when ``renormalize``).
"""

from __future__ import annotations

__version__ = "0.1.0"

try:
    from ._build_info import CUDA as _BUILT_WITH_CUDA
except ImportError:  # the source tree's python/dmoe, not a build
    _BUILT_WITH_CUDA = False
if _BUILT_WITH_CUDA:
    # A CUDA build links NCCL and NVSHMEM by soname; torch ships its own (often newer) copies. Whichever loads
    # first serves both, and torch needs symbols older copies lack: so torch, when installed, loads first.
    import importlib.util as _util

    if _util.find_spec("torch") is not None:
        import torch  # noqa: F401
    else:  # NVSHMEM from its pip package (nvidia-nvshmem-cu13), when the loader path does not have it
        try:
            import ctypes
            import glob
            import os

            import nvidia.nvshmem as _nvshmem

            for _lib in glob.glob(os.path.join(list(_nvshmem.__path__)[0], "lib", "libnvshmem_host.so.*")):
                ctypes.CDLL(_lib, mode=ctypes.RTLD_GLOBAL)
                break
        except (ImportError, OSError):
            pass
try:
    from . import _dmoe  # noqa: F401,E402  (the extension)
except ImportError as _err:
    if "cannot open shared object file" not in str(_err):
        raise
    raise ImportError(
        f"dmoe: the extension could not load a shared library it links ({_err}); a CUDA build needs cuBLAS and NCCL "
        "(the CUDA toolkit's lib directory) and NVSHMEM (pip package nvidia-nvshmem-cu13, or NVSHMEM_HOME/lib) on "
        "LD_LIBRARY_PATH, unless torch (imported first when installed) has loaded them") from _err
from ._dmoe import Session, cuda_built

__all__ = ["Session", "cuda_built", "layer_forward", "layer_backward", "MoELayer", "init_from_process_group",
           "__version__"]

# 'silu' is swiglu's alias, as the CLI and a Hugging Face config's hidden_act take it (the experts are SwiGLU).
_ACTIVATIONS = ("relu", "gelu", "swiglu", "silu")


def _np():
    import numpy

    return numpy


def _as_f32(name, a, shape):
    np = _np()
    if not isinstance(a, np.ndarray):
        raise TypeError(f"dmoe: {name} must be a numpy.ndarray, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise TypeError(f"dmoe: {name} has dtype {a.dtype}; allowed: float32")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"dmoe: {name} has shape {list(a.shape)}; expected {list(shape)}")
    # As dmoe run checks its files: a NaN or Inf would come back as NaN results, or as a router error.
    bad = np.argwhere(~np.isfinite(a))
    if bad.size:
        first = tuple(int(i) for i in bad[0])
        raise ValueError(f"dmoe: {name}{list(first)} is {a[first]}; inputs and weights must be finite "
                         f"({len(bad)} elements are not)")
    a = np.ascontiguousarray(a)
    # The extension takes writable arrays only; an input that is read-only (np.frombuffer, a memory map) is copied
    # rather than refused with nanobind's "incompatible function arguments".
    return a if a.flags.writeable else a.copy()


def _check_finite_results(out, allow_non_finite):
    # As dmoe run refuses to write them: finite inputs can still overflow inside the layer (x · 1e37 gives Inf
    # products and NaN sums), and NaN results must not pass as numbers.
    if allow_non_finite:
        return
    np = _np()
    arrays = [("y", out["y"])] + ([("dx", out["dx"])] if "dx" in out else []) + \
        [("grads['" + k + "']", v) for k, v in out.get("grads", {}).items()]
    for name, a in arrays:
        bad = np.argwhere(~np.isfinite(a))
        if bad.size:
            first = tuple(int(i) for i in bad[0])
            raise ValueError(f"dmoe: {name}{list(first)} is {a[first]} ({len(bad)} elements are not finite): the "
                             f"finite inputs overflow float32 inside the layer; scale them down, or pass "
                             f"allow_non_finite=True to get the results anyway")


def _run(x, gate, w1, w3, w2, top_k, activation, world, dy, renormalize, capacity_factor, drop_policy,
         aux_loss_coef, z_loss_coef, dtype, pad_to_capacity, batch_row_multiple, allow_non_finite=False):
    np = _np()
    from ._checks import check_bool, check_choice, check_float, check_int

    check_choice("dmoe", "activation", activation, _ACTIVATIONS)
    activation = "swiglu" if activation == "silu" else activation
    # The scalars' types and ranges here: the extension's refusal of a wrong type names no argument.
    top_k = check_int("dmoe", "top_k", top_k)
    world = check_int("dmoe", "world", world)
    batch_row_multiple = check_int("dmoe", "batch_row_multiple", batch_row_multiple)
    capacity_factor = check_float("dmoe", "capacity_factor", capacity_factor,
                                  "0 (dropless) or a finite number > 0")
    aux_loss_coef = check_float("dmoe", "aux_loss_coef", aux_loss_coef)
    z_loss_coef = check_float("dmoe", "z_loss_coef", z_loss_coef)
    renormalize = check_bool("dmoe", "renormalize", renormalize)
    pad_to_capacity = check_bool("dmoe", "pad_to_capacity", pad_to_capacity)
    allow_non_finite = check_bool("dmoe", "allow_non_finite", allow_non_finite)
    check_choice("dmoe", "dtype", dtype, ("float32", "f32", "bfloat16", "bf16"))
    check_choice("dmoe", "drop_policy", drop_policy, ("latest-tokens", "lowest-weight"))
    # Arguments that cannot act were taken without a word (as dmoe run refuses the flags): the loss coefficients
    # weight the router losses in the backward only, and the losses come back unweighted; a drop policy chooses the
    # tokens a full expert drops, and a dropless layer drops none.
    if dy is None:
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if value != 0:
                raise ValueError(f"dmoe: {name} = {value} weights a router loss in the backward only, and layer_forward "
                                 f"has none (its 'losses' are unweighted): use layer_backward, or drop {name}")
    if capacity_factor == 0 and drop_policy != "latest-tokens":
        raise ValueError(f"dmoe: drop_policy = '{drop_policy}' chooses the tokens a full expert drops, and "
                         f"capacity_factor = 0 is dropless: give a capacity_factor > 0, or drop drop_policy")
    for name, a in (("x", x), ("gate", gate), ("w1", w1), ("w3", w3), ("w2", w2), ("dy", dy)):
        if a is not None and not isinstance(a, np.ndarray):
            raise TypeError(f"dmoe: {name} must be a numpy.ndarray, got {type(a).__name__}")
    if not isinstance(gate, np.ndarray) or gate.ndim != 2:
        raise ValueError("dmoe: gate must be a 2-D numpy array [experts, hidden]")
    if not isinstance(w1, np.ndarray) or w1.ndim != 3:
        raise ValueError("dmoe: w1 must be a 3-D numpy array [experts, ffn, hidden]")
    E, H = gate.shape
    I = w1.shape[1]
    gate = _as_f32("gate", gate, (E, H))
    w1 = _as_f32("w1", w1, (E, I, H))
    w2 = _as_f32("w2", w2, (E, H, I))
    if activation == "swiglu":
        if w3 is None:
            raise ValueError("dmoe: w3 is None but the activation is swiglu, which needs it ([experts, ffn, hidden])")
        w3 = _as_f32("w3", w3, (E, I, H))
    elif w3 is not None:
        raise ValueError(f"dmoe: w3 is given but the activation is {activation}; w3 is only for swiglu")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise ValueError("dmoe: x must be a 2-D numpy array [tokens, hidden] (world ranks' tokens in rank order)")
    if x.shape[0] == 0:
        raise ValueError("dmoe: x has 0 rows; give at least one token per rank (rows = world * tokens)")
    x = _as_f32("x", x, (x.shape[0], H))
    rows = x.shape[0]
    s = Session(H, I, E, top_k, activation, world=world, engine="cpu", dtype=dtype, renormalize=renormalize,
                capacity_factor=capacity_factor, drop_policy=drop_policy, aux_loss_coef=aux_loss_coef,
                z_loss_coef=z_loss_coef, pad_to_capacity=pad_to_capacity, batch_row_multiple=batch_row_multiple)
    out = {
        "y": np.empty_like(x),
        "expert_ids": np.empty((rows, top_k), np.int32),
        "expert_weights": np.empty((rows, top_k), np.float32),
        "router_logits": np.empty((rows, E), np.float32),
    }
    ticket = s.forward(x, out["y"], gate, w1, w3, w2, train=True, expert_ids=out["expert_ids"],
                       expert_weights=out["expert_weights"], router_logits=out["router_logits"])
    lb, z = s.losses(ticket)
    out["losses"] = {"load_balance": lb, "z_loss": z}
    if dy is None:
        s.release(ticket)
        _check_finite_results(out, allow_non_finite)
        return out
    dy = _as_f32("dy", dy, (rows, H))
    out["dx"] = np.empty_like(x)
    g = {"gate": np.empty((E, H), np.float64), "w1": np.empty((E, I, H), np.float64),
         "w3": np.empty((E, I, H), np.float64) if activation == "swiglu" else None,
         "w2": np.empty((E, H, I), np.float64)}
    s.backward(ticket, dy, out["dx"], g["gate"], g["w1"], g["w3"], g["w2"])
    out["grads"] = {k: v for k, v in g.items() if v is not None}
    _check_finite_results(out, allow_non_finite)
    return out


def layer_forward(x, gate, w1, w3, w2, *, top_k, activation="swiglu", world=1, renormalize=True,
                  capacity_factor=0.0, drop_policy="latest-tokens", aux_loss_coef=0.0, z_loss_coef=0.0,
                  dtype="float32", pad_to_capacity=True, batch_row_multiple=1, allow_non_finite=False):
    """The layer's forward on the CPU reference engine, ``world`` ranks simulated as threads.

    ``x`` is ``[world * T, H]`` float32 (rank r's T tokens at rows ``r*T .. (r+1)*T``); the weights are float32 in
    the layout of the module docstring (``w3`` None unless swiglu). ``capacity_factor`` 0 is dropless; otherwise
    each (rank, expert) keeps at most ``ceil(cf * T * k / E)`` rows (``drop_policy`` 'latest-tokens' or
    'lowest-weight'). ``dtype`` 'bfloat16' rounds every stored activation to bf16 as a bf16 GPU engine stores
    them. Returns a dict: ``y`` [N, H], ``expert_ids`` [N, k] int32, ``expert_weights`` [N, k], ``router_logits``
    [N, E], ``losses`` {'load_balance', 'z_loss'} (over all ranks' tokens, unweighted: ``aux_loss_coef`` and
    ``z_loss_coef`` act in ``layer_backward`` only, and a non-zero one is refused here; so is a ``drop_policy``
    other than the default on a dropless layer). Inputs must be finite; results that are not (finite inputs
    overflowing float32) raise ValueError unless ``allow_non_finite``.
    """
    return _run(x, gate, w1, w3, w2, top_k, activation, world, None, renormalize, capacity_factor, drop_policy,
                aux_loss_coef, z_loss_coef, dtype, pad_to_capacity, batch_row_multiple, allow_non_finite)


def layer_backward(x, gate, w1, w3, w2, dy, *, top_k, activation="swiglu", world=1, renormalize=True,
                   capacity_factor=0.0, drop_policy="latest-tokens", aux_loss_coef=0.0, z_loss_coef=0.0,
                   dtype="float32", pad_to_capacity=True, batch_row_multiple=1, allow_non_finite=False):
    """Forward and backward: what ``layer_forward`` returns plus ``dx`` [N, H] and ``grads`` (float64, fp64
    accumulation): 'gate' (summed over ranks), 'w1', 'w3' (swiglu), 'w2' — the gradients of ``sum(y * dy)``
    plus ``aux_loss_coef * load_balance + z_loss_coef * z_loss``.
    """
    return _run(x, gate, w1, w3, w2, top_k, activation, world, dy, renormalize, capacity_factor, drop_policy,
                aux_loss_coef, z_loss_coef, dtype, pad_to_capacity, batch_row_multiple, allow_non_finite)


def __getattr__(name):
    # MoELayer needs torch: imported on first use, so numpy-only use of dmoe never imports torch.
    if name == "MoELayer":
        from .module import MoELayer

        return MoELayer
    if name == "init_from_process_group":
        from .module import init_from_process_group

        return init_from_process_group
    if name == "hf":
        import importlib

        return importlib.import_module(".hf", __name__)
    raise AttributeError(f"module 'dmoe' has no attribute '{name}'")
