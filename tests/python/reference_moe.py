"""An independent float64 numpy implementation of the MoE layer dmoe computes (forward and gradients), written
from the definitions, token by token — no dispatch buffers, no all-to-all — for the tests to compare with.

Layer: logits = x Wgᵀ; p = softmax(logits); the k largest p (ties to the lower expert index); gate weights
w_j = p_j (divided by their sum when renormalising). Expert e: relu/gelu(erf): W2 act(W1 x); swiglu:
W2 (silu(W1 x) * (W3 x)). y_t = Σ_j w_tj out_{e_tj}(x_t) over kept assignments. Capacity mode (per simulated
rank, per expert) keeps C = min(ceil(cf·T·k/E), T) assignments: the earliest tokens, or the largest gate
weights (ties to the earlier token). Losses (over all N tokens): load balance E Σ_e f_e P_e with
f_e = routed_e / (N k) (before capacity) and P_e = mean_t p_te; z-loss mean_t logsumexp_t².
The gradients are of sum(y · dy) + aux_coef · load_balance + z_coef · z_loss.
"""

from __future__ import annotations

import math

import numpy as np

_ERF = np.vectorize(math.erf)


def act(a, kind):
    if kind == "relu":
        return np.maximum(a, 0.0)
    if kind == "gelu":
        return 0.5 * a * (1.0 + _ERF(a / math.sqrt(2.0)))
    raise ValueError(kind)


def act_grad(a, kind):
    if kind == "relu":
        return (a > 0).astype(np.float64)
    cdf = 0.5 * (1.0 + _ERF(a / math.sqrt(2.0)))
    return cdf + a * np.exp(-0.5 * a * a) / math.sqrt(2.0 * math.pi)


def silu(a):
    return a / (1.0 + np.exp(-a))


def silu_grad(a):
    s = 1.0 / (1.0 + np.exp(-a))
    return s * (1.0 + a * (1.0 - s))


def routing(x, gate, k, renormalize):
    logits = x @ gate.T
    m = logits.max(axis=1, keepdims=True)
    e = np.exp(logits - m)
    p = e / e.sum(axis=1, keepdims=True)
    lse = (m + np.log(e.sum(axis=1, keepdims=True)))[:, 0]
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]  # stable: ties to the lower index
    w = np.take_along_axis(p, ids, axis=1)
    if renormalize:
        w = w / w.sum(axis=1, keepdims=True)
    return logits, p, lse, ids, w


def kept_mask(ids, w, world, experts, capacity_factor, policy):
    n, k = ids.shape
    keep = np.ones((n, k), bool)
    if capacity_factor == 0:
        return keep
    t = n // world
    cap = min(max(math.ceil(capacity_factor * t * k / experts), 1), t)
    for r in range(world):
        for e in range(experts):
            sel = [(tok, j) for tok in range(r * t, (r + 1) * t) for j in range(k) if ids[tok, j] == e]
            if policy == "lowest-weight":
                sel.sort(key=lambda a: (-w[a[0], a[1]], a[0]))
            for tok, j in sel[cap:]:
                keep[tok, j] = False
    return keep


def expert_forward(xt, e, w1, w3, w2, kind):
    a1 = w1[e] @ xt
    if kind == "swiglu":
        a3 = w3[e] @ xt
        h = silu(a1) * a3
    else:
        a3 = None
        h = act(a1, kind)
    return w2[e] @ h, (a1, a3, h)


def layer(x, gate, w1, w3, w2, dy, *, top_k, activation, world=1, renormalize=True, capacity_factor=0.0,
          drop_policy="latest-tokens", aux_loss_coef=0.0, z_loss_coef=0.0):
    """Returns a dict like dmoe.layer_backward's (float64)."""
    x, gate, w1, w2 = (np.asarray(a, np.float64) for a in (x, gate, w1, w2))
    w3 = None if w3 is None else np.asarray(w3, np.float64)
    n, hdim = x.shape
    experts = gate.shape[0]
    logits, p, lse, ids, w = routing(x, gate, top_k, renormalize)
    keep = kept_mask(ids, w, world, experts, capacity_factor, drop_policy)
    y = np.zeros_like(x)
    outs = {}
    for t in range(n):
        for j in range(top_k):
            if keep[t, j]:
                out, saved = expert_forward(x[t], ids[t, j], w1, w3, w2, activation)
                outs[t, j] = (out, saved)
                y[t] += w[t, j] * out
    routed = np.bincount(ids.ravel(), minlength=experts)
    f = routed / (n * top_k)
    pm = p.mean(axis=0)
    losses = {"load_balance": float(experts * np.sum(f * pm)), "z_loss": float(np.mean(lse ** 2))}
    res = {"y": y, "expert_ids": ids, "expert_weights": w, "router_logits": logits, "losses": losses, "kept": keep}
    if dy is None:
        return res
    dy = np.asarray(dy, np.float64)
    dx = np.zeros_like(x)
    g = {"gate": np.zeros_like(gate), "w1": np.zeros_like(w1), "w2": np.zeros_like(w2)}
    if w3 is not None:
        g["w3"] = np.zeros_like(w3)
    dw = np.zeros_like(w)
    for (t, j), (out, (a1, a3, h)) in outs.items():
        e = ids[t, j]
        dw[t, j] = dy[t] @ out
        dout = w[t, j] * dy[t]
        g["w2"][e] += np.outer(dout, h)
        dh = w2[e].T @ dout
        if activation == "swiglu":
            da1 = dh * a3 * silu_grad(a1)
            da3 = dh * silu(a1)
            g["w3"][e] += np.outer(da3, x[t])
            dx[t] += w3[e].T @ da3
        else:
            da1 = dh * act_grad(a1, activation)
        g["w1"][e] += np.outer(da1, x[t])
        dx[t] += w1[e].T @ da1
    # gate weights -> probabilities of the chosen experts
    dp = np.zeros_like(p)
    for t in range(n):
        sel = p[t, ids[t]]
        if renormalize:
            s = sel.sum()
            d = (dw[t] - np.sum(dw[t] * w[t])) / s
        else:
            d = dw[t]
        dp[t, ids[t]] += d
    dp += aux_loss_coef * experts * f[None, :] / n
    dlogits = p * (dp - np.sum(p * dp, axis=1, keepdims=True))
    dlogits += z_loss_coef * 2.0 * lse[:, None] / n * p
    dx += dlogits @ gate
    g["gate"] = dlogits.T @ x
    res["dx"] = dx
    res["grads"] = g
    return res
