"""dmoe.layer_forward / layer_backward (the CPU engine, W simulated ranks) against reference_moe.py, an
independent float64 implementation, and the API's refusals of bad input. Needs numpy only."""

import numpy as np
import pytest

import dmoe
from reference_moe import layer as reference_layer

H, I, E, K = 16, 24, 8, 2


def make(activation, rows, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s, scale=1.0: (rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
    x = f(rows, H)
    gate = f(E, H, scale=0.5)
    w1 = f(E, I, H, scale=1 / np.sqrt(H))
    w3 = f(E, I, H, scale=1 / np.sqrt(H)) if activation == "swiglu" else None
    w2 = f(E, H, I, scale=1 / np.sqrt(I))
    dy = f(rows, H)
    return x, gate, w1, w3, w2, dy


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# f32 storage of the activations (h, pre-activations, expert outputs) against a float64 reference: relative
# errors of a few f32 ulps per stage; 2e-5 of the largest magnitude bounds them with room (measured < 3e-6).
TOL = 2e-5


@pytest.mark.parametrize("activation", ["relu", "gelu", "swiglu"])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("capacity_factor,policy", [(0.0, "latest-tokens"), (1.0, "latest-tokens"),
                                                    (0.75, "lowest-weight")])
def test_forward_and_gradients_match_reference(activation, world, capacity_factor, policy):
    rows = 12 * world
    x, gate, w1, w3, w2, dy = make(activation, rows, seed=world)
    kw = dict(top_k=K, activation=activation, world=world, capacity_factor=capacity_factor, drop_policy=policy,
              aux_loss_coef=0.01, z_loss_coef=0.001)
    got = dmoe.layer_backward(x, gate, w1, w3, w2, dy, **kw)
    ref = reference_layer(x, gate, w1, w3, w2, dy, **kw)
    if capacity_factor:
        assert not ref["kept"].all(), "the capacity case must drop something, else it tests nothing new"
    np.testing.assert_array_equal(got["expert_ids"], ref["expert_ids"])
    assert rel_err(got["expert_weights"], ref["expert_weights"]) < TOL
    assert rel_err(got["router_logits"], ref["router_logits"]) < TOL
    assert rel_err(got["y"], ref["y"]) < TOL
    assert rel_err(got["dx"], ref["dx"]) < TOL
    assert set(got["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        assert got["grads"][name].dtype == np.float64
        assert rel_err(got["grads"][name], g) < TOL, name
    for name in ("load_balance", "z_loss"):
        assert abs(got["losses"][name] - ref["losses"][name]) < 1e-5 * abs(ref["losses"][name]), name


def test_ranks_agree_with_one_rank():
    # Dropless: W simulated ranks give the single-rank result bit for bit (docs/architecture.md), except the
    # gate's gradient, summed per rank first (last-bit differences of the fp64 sum).
    x, gate, w1, w3, w2, dy = make("swiglu", 16, seed=3)
    one = dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K, world=1)
    four = dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K, world=4)
    np.testing.assert_array_equal(one["y"], four["y"])
    np.testing.assert_array_equal(one["dx"], four["dx"])
    np.testing.assert_array_equal(one["grads"]["w1"], four["grads"]["w1"])
    assert rel_err(four["grads"]["gate"], one["grads"]["gate"]) < 1e-12


def test_forward_without_backward_and_no_renormalize():
    x, gate, w1, w3, w2, _ = make("gelu", 10, seed=5)
    got = dmoe.layer_forward(x, gate, w1, None, w2, top_k=3, activation="gelu", renormalize=False)
    ref = reference_layer(x, gate, w1, None, w2, None, top_k=3, activation="gelu", renormalize=False)
    assert "dx" not in got and "grads" not in got
    assert rel_err(got["y"], ref["y"]) < TOL
    assert np.all(got["expert_weights"].sum(axis=1) < 1.0)  # not renormalised


def test_bf16_rounds_activations():
    x, gate, w1, w3, w2, _ = make("swiglu", 8, seed=6)
    f32 = dmoe.layer_forward(x, gate, w1, w3, w2, top_k=K)
    bf16 = dmoe.layer_forward(x, gate, w1, w3, w2, top_k=K, dtype="bfloat16")
    # bf16 keeps 8 mantissa bits: every y differs from f32 by at most a few bf16 ulps but not by nothing
    err = rel_err(bf16["y"], f32["y"])
    assert 1e-4 < err < 5e-2, err
    y = bf16["y"].view(np.uint32)
    assert np.all((y & 0xFFFF) == 0), "bf16 storage: the low 16 bits of every stored f32 are zero"


def expect(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match):
        fn(*a, **kw)


def test_bad_input_is_refused_with_a_clear_message():
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    kw = dict(top_k=K)
    expect(TypeError, "x has dtype float64; allowed: float32", dmoe.layer_forward, x.astype(np.float64), gate, w1, w3,
           w2, **kw)
    expect(ValueError, r"w2 has shape \[8, 24, 16\]; expected \[8, 16, 24\]", dmoe.layer_forward, x, gate, w1, w3,
           w2.transpose(0, 2, 1).copy(), **kw)
    expect(ValueError, "w3 is None but the activation is swiglu", dmoe.layer_forward, x, gate, w1, None, w2, **kw)
    expect(ValueError, "w3 is given but the activation is relu", dmoe.layer_forward, x, gate, w1, w3, w2, top_k=K,
           activation="relu")
    expect(ValueError, "activation 'tanh' is unknown; allowed: relu, gelu, swiglu", dmoe.layer_forward, x, gate, w1,
           w3, w2, top_k=K, activation="tanh")
    expect(ValueError, "experts = 8 is not divisible by world = 3", dmoe.layer_forward, x, gate, w1, w3, w2, top_k=K,
           world=3)
    expect(ValueError, "7 rows cannot be split over world = 2", dmoe.layer_forward, x[:7], gate, w1, w3, w2, top_k=K,
           world=2)
    expect(ValueError, "top_k", dmoe.layer_forward, x, gate, w1, w3, w2, top_k=9)
    expect(ValueError, "capacity_factor", dmoe.layer_forward, x, gate, w1, w3, w2, top_k=K, capacity_factor=-1.0)
    expect(ValueError, "drop", dmoe.layer_forward, x, gate, w1, w3, w2, top_k=K, capacity_factor=1.0,
           drop_policy="random")
    expect(TypeError, "must be a numpy.ndarray", dmoe.layer_forward, x.tolist(), gate, w1, w3, w2, **kw)


def test_session_checks_arrays():
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    s = dmoe.Session(H, I, E, K)
    y = np.empty_like(x)
    expect(ValueError, "is not C-contiguous", s.forward, x, y, gate, w1, w3, np.ascontiguousarray(w2)[:, :, ::-1])
    expect(ValueError, "x has shape", s.forward, x[:, :8].copy(), y, gate, w1, w3, w2)
    expect(ValueError, r"y has shape \[4, 16\]", s.forward, x, y[:4], gate, w1, w3, w2)
    expect(TypeError, "expert_ids has dtype int64; allowed: int32", s.forward, x, y, gate, w1, w3, w2,
           expert_ids=np.empty((8, K), np.int64))
    ticket = s.forward(x, y, gate, w1, w3, w2)
    assert s.pending == 1
    dx = np.empty_like(x)
    grads = [np.empty(a.shape, np.float32) for a in (gate, w1, w3, w2)]
    expect(TypeError, "grad gate has dtype float32; allowed: float64", s.backward, ticket, dy, dx, *grads)
    grads = [np.empty(a.shape, np.float64) for a in (gate, w1, w3, w2)]
    s.backward(ticket, dy, dx, *grads)
    assert s.pending == 0
    expect(ValueError, "not a pending train forward", s.backward, ticket, dy, dx, *grads)
    expect(ValueError, "engine 'gpu' is unknown; allowed: cpu, ep, flash", dmoe.Session, H, I, E, K, engine="gpu")
    if not dmoe.cuda_built():
        expect(ValueError, "built without CUDA", dmoe.Session, H, I, E, K, engine="ep")


def test_non_finite_empty_and_read_only_inputs():
    # Tenth session's bad-input pass (docs/faults.md): a NaN in x ended in the router's internal error with a
    # source location (router.cpp:31; now an input error there too, tests/unit/test_cpu_kernels.cpp), an Inf in the gate or a NaN in dy came back as numbers or NaN without a word, 0 rows were
    # refused as "y ... is not C-contiguous", and a read-only x as nanobind's "incompatible function arguments".
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    kw = dict(top_k=K)
    bad_x = x.copy()
    bad_x[3, 2] = np.nan
    expect(ValueError, r"x\[3, 2\] is nan; inputs and weights must be finite", dmoe.layer_forward, bad_x, gate, w1,
           w3, w2, **kw)
    bad_gate = gate.copy()
    bad_gate[0, 0] = np.inf
    expect(ValueError, r"gate\[0, 0\] is inf", dmoe.layer_forward, x, bad_gate, w1, w3, w2, **kw)
    expect(ValueError, r"dy\[0, 0\] is nan", dmoe.layer_backward, x, gate, w1, w3, w2, np.full_like(dy, np.nan), **kw)
    expect(ValueError, "x has 0 rows", dmoe.layer_forward, x[:0], gate, w1, w3, w2, **kw)
    ro = x.copy()
    ro.setflags(write=False)
    np.testing.assert_array_equal(dmoe.layer_forward(ro, gate, w1, w3, w2, **kw)["y"],
                                  dmoe.layer_forward(x, gate, w1, w3, w2, **kw)["y"])


def test_results_that_overflow_are_refused_unless_allowed():
    # Finite inputs that overflow float32 inside the layer (x · 1e37) gave NaN results without a word; dmoe run
    # refuses to write such results, and so does the numpy API now, unless allow_non_finite=True.
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    kw = dict(top_k=K)
    big = (x * np.float32(1e37)).astype(np.float32)
    assert np.isfinite(big).all()
    expect(ValueError, r"not finite\): the finite inputs overflow float32 inside the layer", dmoe.layer_forward, big,
           gate, w1, w3, w2, **kw)
    out = dmoe.layer_forward(big, gate, w1, w3, w2, allow_non_finite=True, **kw)
    assert not np.isfinite(out["y"]).all()
    expect(ValueError, r"not finite", dmoe.layer_backward, x, gate, w1, w3, w2,
           np.full_like(dy, np.float32(3e38)), **kw)
    # Finite results pass as before.
    assert np.isfinite(dmoe.layer_forward(x, gate, w1, w3, w2, **kw)["y"]).all()


# ---- the Python API's bad-input pass (docs/faults.md, "Python API bad-input pass") -------------------------------


def test_scalar_arguments_are_refused_by_name():
    # A wrong scalar type reached the extension, whose refusal was nanobind's "incompatible function arguments"
    # for Session.__init__, naming no argument (and top_k=True an opaque "an integer is required").
    x, gate, w1, w3, w2, _ = make("swiglu", 8)
    run = lambda **kw: dmoe.layer_forward(x, gate, w1, w3, w2, **dict(dict(top_k=K), **kw))  # noqa: E731
    expect(TypeError, "top_k = 2.0 is a float; must be an int", run, top_k=2.0)
    expect(TypeError, "top_k = True is a bool", run, top_k=True)
    expect(ValueError, r"world = 2147483648 is invalid; must be an int in \[1, 2147483647\]", run, world=2**31)
    expect(TypeError, "capacity_factor = '1' is a str", run, capacity_factor="1")
    expect(TypeError, "renormalize = None is a NoneType; must be True or False", run, renormalize=None)
    expect(TypeError, "pad_to_capacity = 'no' is a str", run, pad_to_capacity="no")
    expect(ValueError, "dtype 'float16' is unknown; allowed: float32, f32, bfloat16, bf16", run, dtype="float16")
    assert run(top_k=np.int64(K), capacity_factor=np.float32(1.0))["y"].shape == x.shape


def test_session_backward_needs_the_rows_of_its_forward():
    # dy and dx with other rows than the forward's were read and written as if they had them: out of bounds.
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    s = dmoe.Session(H, I, E, K)
    ticket = s.forward(x, np.empty_like(x), gate, w1, w3, w2)
    grads = [np.empty(a.shape, np.float64) for a in (gate, w1, w3, w2)]
    expect(ValueError, r"dy has shape \[4, 16\], 4 rows, but the forward of ticket 0 had 8", s.backward, ticket,
           dy[:4].copy(), np.empty((4, H), np.float32), *grads)
    expect(ValueError, "had 8", s.backward, ticket, np.tile(dy, (8, 1)), np.empty((64, H), np.float32), *grads)
    dx = np.empty_like(x)
    s.backward(ticket, dy, dx, *grads)  # still pending: the refusals used nothing up
    np.testing.assert_array_equal(dx, dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K)["dx"])


def test_session_keeps_what_a_train_forward_read_until_its_backward():
    # The engine reads x and the weights again in the backward; arrays dropped in between were freed, and the
    # backward read freed memory (dx came back wrong without a word).
    import gc
    import weakref

    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    s = dmoe.Session(H, I, E, K)
    xc, w1c = x.copy(), w1.copy()
    refs = [weakref.ref(xc), weakref.ref(w1c)]
    ticket = s.forward(xc, np.empty_like(x), gate, w1c, w3, w2)
    del xc, w1c
    gc.collect()
    junk = [np.full(w1.shape, 7.0, np.float32) for _ in range(8)]  # noqa: F841  (reuses freed memory, if any)
    assert all(r() is not None for r in refs)
    dx = np.empty_like(x)
    s.backward(ticket, dy, dx, *[np.empty(a.shape, np.float64) for a in (gate, w1, w3, w2)])
    np.testing.assert_array_equal(dx, dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K)["dx"])
    gc.collect()
    assert all(r() is None for r in refs)  # let go after the backward (and after release, below)
    xc = x.copy()
    ref = weakref.ref(xc)
    s.release(s.forward(xc, np.empty_like(x), gate, w1, w3, w2))
    del xc
    assert ref() is None


def test_session_names_the_array_that_is_wrong():
    # nanobind's "incompatible function arguments" (the whole signature) for a read-only x, a read-only y, a list or
    # None; 0 rows were "not C-contiguous"; an unknown comm or max_tokens 0 passed on the CPU engine.
    x, gate, w1, w3, w2, _ = make("swiglu", 8)
    s = dmoe.Session(H, I, E, K)
    ro = x.copy()
    ro.setflags(write=False)
    y = np.empty_like(x)
    s.forward(ro, y, gate, w1, w3, w2, train=False)  # inputs may be read-only
    np.testing.assert_array_equal(y, dmoe.layer_forward(x, gate, w1, w3, w2, top_k=K)["y"])
    y.setflags(write=False)
    expect(ValueError, "y is read-only; dmoe writes its result there", s.forward, x, y, gate, w1, w3, w2)
    expect(TypeError, "x must be an array .* got list", s.forward, x.tolist(), np.empty_like(x), gate, w1, w3, w2)
    expect(TypeError, "gate must be an array .* got NoneType", s.forward, x, np.empty_like(x), None, w1, w3, w2)
    expect(ValueError, r"x has shape \[0, 16\], no tokens", s.forward, x[:0], x[:0].copy(), gate, w1, w3, w2)
    expect(ValueError, "comm 'mpi' is unknown; allowed: auto, nccl, nvshmem", dmoe.Session, H, I, E, K, comm="mpi")
    expect(ValueError, "max_tokens = 0 is invalid", dmoe.Session, H, I, E, K, max_tokens=0)


def test_threads_sharing_a_session_take_turns():
    # Train forwards from several threads on one session raced in the engine state: SIGSEGV (world 2), or wrong
    # results (world 1). In a subprocess, so that a crash fails this test, not the run.
    import subprocess
    import sys

    code = (
        "import threading, numpy as np, dmoe\n"
        "rng = np.random.default_rng(0)\n"
        "f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)\n"
        f"H, I, E, K = {H}, {I}, {E}, {K}\n"
        "x, gate, w1, w3, w2 = f(8, H), f(E, H), f(E, I, H), f(E, I, H), f(E, H, I)\n"
        "ref = dmoe.layer_forward(x, gate, w1, w3, w2, top_k=K, world=2)['y']\n"
        "s = dmoe.Session(H, I, E, K, world=2)\n"
        "bad = []\n"
        "def run():\n"
        "    for _ in range(20):\n"
        "        y = np.empty_like(x)\n"
        "        s.release(s.forward(x, y, gate, w1, w3, w2))\n"
        "        bad.append(not np.array_equal(y, ref))\n"
        "ts = [threading.Thread(target=run) for _ in range(4)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\n"
        "print(sum(bad), len(bad), s.pending)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split() == ["0", "80", "0"]


# ---- the twelfth bad-input pass (docs/faults.md, "twelfth pass") ------------------------------------------------


def test_arguments_that_cannot_act_are_refused():
    # layer_forward took aux_loss_coef / z_loss_coef (they weight the losses in the backward only; the forward's
    # losses are unweighted) and drop_policy on a dropless layer without a word, as dmoe run's flags were.
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    expect(ValueError, "aux_loss_coef = 5.0 weights a router loss in the backward only", dmoe.layer_forward, x, gate,
           w1, w3, w2, top_k=K, aux_loss_coef=5.0)
    expect(ValueError, "z_loss_coef = 0.5 weights a router loss in the backward only", dmoe.layer_forward, x, gate,
           w1, w3, w2, top_k=K, z_loss_coef=0.5)
    for run in (dmoe.layer_forward, lambda *a, **kw: dmoe.layer_backward(*a, dy, **kw)):
        expect(ValueError, "drop_policy = 'lowest-weight' chooses the tokens a full expert drops, and "
               "capacity_factor = 0 is dropless", run, x, gate, w1, w3, w2, top_k=K, drop_policy="lowest-weight")
    # Where they act, they are taken.
    assert "dx" in dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K, aux_loss_coef=5.0, z_loss_coef=0.5)
    dmoe.layer_forward(x, gate, w1, w3, w2, top_k=K, capacity_factor=1.0, drop_policy="lowest-weight")


def test_silu_is_swiglus_alias_and_release_needs_a_pending_ticket():
    # Thirteenth bad-input pass. activation='silu' was refused ("allowed: relu, gelu, swiglu") where the CLI and a
    # Hugging Face config's hidden_act take it for SwiGLU.
    x, gate, w1, w3, w2, dy = make("swiglu", 8)
    swiglu = dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K)
    silu = dmoe.layer_backward(x, gate, w1, w3, w2, dy, top_k=K, activation="silu")
    for name in ("y", "dx"):
        np.testing.assert_array_equal(silu[name], swiglu[name])
    np.testing.assert_array_equal(dmoe.layer_forward(x, gate, w1, w3, w2, top_k=K, activation="silu")["y"], swiglu["y"])
    # Session.release of an unknown, released or backward()ed ticket was silently nothing.
    s = dmoe.Session(H, I, E, K)
    ticket = s.forward(x, np.empty_like(x), gate, w1, w3, w2)
    s.release(ticket)
    assert s.pending == 0
    expect(ValueError, f"release: ticket {ticket} is not a pending train forward of this layer", s.release, ticket)
    expect(ValueError, "release: ticket 99 is not a pending train forward", s.release, 99)
    expect(ValueError, "release: ticket -1 is not a pending train forward", s.release,
           s.forward(x, np.empty_like(x), gate, w1, w3, w2, train=False))
    t2 = s.forward(x, np.empty_like(x), gate, w1, w3, w2)
    s.backward(t2, dy, np.empty_like(x), *[np.empty(a.shape, np.float64) for a in (gate, w1, w3, w2)])
    expect(ValueError, f"release: ticket {t2} is not a pending", s.release, t2)
