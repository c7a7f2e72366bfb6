#!/usr/bin/env python3
"""A pure-Python transcription of transformers' Mixtral forward pass, checked against `dmoe eval`.

Plain Python (no torch, no numpy), fp64 throughout, written from transformers 5.24's modeling_mixtral.py
op by op (MixtralRMSNorm, MixtralRotaryEmbedding + rotate_half, repeat_kv + eager attention with the causal
mask, MixtralTopKRouter, MixtralExperts, ForCausalLMLoss, load_balancing_loss_func), so it checks the forward
conventions — head layout, RoPE halves, GQA grouping, top-k renormalisation, the next-token shift, the aux
loss pooled over layers — independently of dmoe's C++ (the finite-difference tests only check that dmoe's
backward matches dmoe's forward). tests/hf/compare_mixtral.py does the same against transformers itself,
gradients included, where torch is available.

Self-contained mode (CI): makes small configs, runs `dmoe init-model` and `dmoe eval`, compares:
    python3 tests/hf/reference_mixtral.py --dmoe build-cpu/dmoe
On given files:
    python3 tests/hf/reference_mixtral.py --config config.json --weights model.safetensors \
        --tokens tokens.safetensors --dmoe-output out.safetensors

Tolerance: |dmoe - reference| <= rtol * max|reference| per tensor (rtol 1e-5; dmoe stores f32, this runs in
fp64, so the difference is f32 rounding of O(1) values through a few layers, ~1e-6).
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

# ---- safetensors (the subset dmoe writes: F32, I32, I64) ------------------------------------------------

FORMATS = {"F32": ("f", 4), "I32": ("i", 4), "I64": ("q", 8), "F64": ("d", 8)}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        fmt, size = FORMATS[info["dtype"]]
        b, e = info["data_offsets"]
        count = (e - b) // size
        values = list(struct.unpack_from("<%d%s" % (count, fmt), data, 8 + n + b))
        out[name] = (info["shape"], values)
    return out


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, values)."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        dtype, shape, values = tensors[name]
        fmt, size = FORMATS[dtype]
        blob = struct.pack("<%d%s" % (len(values), fmt), *values)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- the model, op by op ------------------------------------------------------------------------------

def matrix(weights, name):
    shape, values = weights[name]
    rows, cols = shape
    return [values[r * cols:(r + 1) * cols] for r in range(rows)]


def linear(x, w):  # nn.functional.linear(x, w): x @ w.T, w [out, in]
    return [sum(a * b for a, b in zip(x, wr)) for wr in w]


def rmsnorm(x, w, eps):  # MixtralRMSNorm
    variance = sum(v * v for v in x) / len(x)
    r = 1.0 / math.sqrt(variance + eps)
    return [wi * (v * r) for wi, v in zip(w, x)]


def softmax(v):
    m = max(v)
    e = [math.exp(a - m) for a in v]
    s = sum(e)
    return [a / s for a in e]


def silu(v):
    return v / (1.0 + math.exp(-v))


def rotate_half(x):  # cat(-x2, x1)
    h = len(x) // 2
    return [-a for a in x[h:]] + x[:h]


def forward(cfg, weights, tokens):
    """Returns logits [B][S][V], ce loss, aux loss (load_balancing_loss_func) and the total loss."""
    H = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    D = cfg.get("head_dim") or H // heads
    E = cfg["num_local_experts"]
    k = cfg["num_experts_per_tok"]
    L = cfg["num_hidden_layers"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    groups = heads // kv_heads
    embed = matrix(weights, "model.embed_tokens.weight")
    lm_head = embed if cfg.get("tie_word_embeddings") else matrix(weights, "lm_head.weight")
    inv_freq = [1.0 / (theta ** (i / D)) for i in range(0, D, 2)]  # compute_default_rope_parameters

    all_logits, router_logits = [], [[] for _ in range(L)]
    for seq in tokens:
        S = len(seq)
        x = [list(embed[t]) for t in seq]
        cos, sin = [], []
        for pos in range(S):
            freqs = [pos * f for f in inv_freq]
            emb = freqs + freqs  # torch.cat((freqs, freqs), dim=-1)
            cos.append([math.cos(a) for a in emb])
            sin.append([math.sin(a) for a in emb])
        for layer in range(L):
            p = "model.layers.%d." % layer
            a = [rmsnorm(v, weights[p + "input_layernorm.weight"][1], eps) for v in x]
            q = [linear(v, matrix(weights, p + "self_attn.q_proj.weight")) for v in a]
            kk = [linear(v, matrix(weights, p + "self_attn.k_proj.weight")) for v in a]
            vv = [linear(v, matrix(weights, p + "self_attn.v_proj.weight")) for v in a]
            # view(B, S, heads, D).transpose(1, 2): head h is columns [h*D, (h+1)*D)
            qh = [[q[s][h * D:(h + 1) * D] for s in range(S)] for h in range(heads)]
            kh = [[kk[s][h * D:(h + 1) * D] for s in range(S)] for h in range(kv_heads)]
            vh = [[vv[s][h * D:(h + 1) * D] for s in range(S)] for h in range(kv_heads)]
            rope = lambda t, s: [t[i] * cos[s][i] + rotate_half(t)[i] * sin[s][i] for i in range(D)]
            qh = [[rope(qh[h][s], s) for s in range(S)] for h in range(heads)]
            kh = [[rope(kh[h][s], s) for s in range(S)] for h in range(kv_heads)]
            out = [[0.0] * (heads * D) for _ in range(S)]
            for h in range(heads):
                g = h // groups  # repeat_kv: query head h uses kv head h // n_rep
                for i in range(S):
                    scores = [sum(a * b for a, b in zip(qh[h][i], kh[g][j])) * D ** -0.5 for j in range(i + 1)]
                    pr = softmax(scores)  # causal mask: keys j <= i
                    for d in range(D):
                        out[i][h * D + d] = sum(pr[j] * vh[g][j][d] for j in range(i + 1))
            o = [linear(v, matrix(weights, p + "self_attn.o_proj.weight")) for v in out]
            h1 = [[a + b for a, b in zip(x[s], o[s])] for s in range(S)]
            m = [rmsnorm(v, weights[p + "post_attention_layernorm.weight"][1], eps) for v in h1]
            gate = matrix(weights, p + "block_sparse_moe.gate.weight")
            y = []
            for s in range(S):
                logits = linear(m[s], gate)
                router_logits[layer].append(logits)
                probs = softmax(logits)
                top = sorted(range(E), key=lambda e: -probs[e])[:k]  # torch.topk
                total = sum(probs[e] for e in top)
                acc = [0.0] * H
                for e in top:
                    ep = p + "block_sparse_moe.experts.%d." % e
                    gt = linear(m[s], matrix(weights, ep + "w1.weight"))
                    up = linear(m[s], matrix(weights, ep + "w3.weight"))
                    hidden = [silu(a) * b for a, b in zip(gt, up)]
                    down = linear(hidden, matrix(weights, ep + "w2.weight"))
                    acc = [c + probs[e] / total * d for c, d in zip(acc, down)]
                y.append(acc)
            x = [[a + b for a, b in zip(h1[s], y[s])] for s in range(S)]
        xf = [rmsnorm(v, weights["model.norm.weight"][1], eps) for v in x]
        all_logits.append([linear(v, lm_head) for v in xf])

    # ForCausalLMLoss: labels = tokens shifted left, last position ignored; mean over the rest.
    ce, count = 0.0, 0
    for b, seq in enumerate(tokens):
        for s in range(len(seq) - 1):
            row = all_logits[b][s]
            mx = max(row)
            ce += mx + math.log(sum(math.exp(v - mx) for v in row)) - row[seq[s + 1]]
            count += 1
    ce /= count
    # load_balancing_loss_func: counts and probabilities pooled over all layers' rows.
    tokens_per_expert, prob_sum, rows = [0.0] * E, [0.0] * E, 0
    for layer in range(L):
        for logits in router_logits[layer]:
            probs = softmax(logits)
            for e in sorted(range(E), key=lambda e: -probs[e])[:k]:
                tokens_per_expert[e] += 1
            for e in range(E):
                prob_sum[e] += probs[e]
            rows += 1
    aux = E * sum((tokens_per_expert[e] / rows) * (prob_sum[e] / rows) for e in range(E))
    loss = ce + (cfg.get("router_aux_loss_coef", 0.001) * aux if cfg.get("output_router_logits") else 0.0)
    return all_logits, ce, aux, loss


# ---- comparison ---------------------------------------------------------------------------------------

def compare(cfg, weights_path, tokens_path, output_path, rtol):
    weights = read_safetensors(weights_path)
    shape, flat = read_safetensors(tokens_path)["tokens"]
    B, S = shape
    tokens = [flat[b * S:(b + 1) * S] for b in range(B)]
    logits, ce, aux, loss = forward(cfg, weights, tokens)
    out = read_safetensors(output_path)
    got = out["logits"][1]
    want = [v for seq in logits for row in seq for v in row]
    scale = max(abs(v) for v in want)
    err = max(abs(a - b) for a, b in zip(got, want))
    ok = len(got) == len(want) and err <= rtol * scale
    print(f"  {'ok  ' if ok else 'MISS'} logits: max abs err {err:.3e}, max |ref| {scale:.3e} (tolerance {rtol:.0e} * max)")
    checks = [("ce_loss", ce), ("loss", loss)]
    if cfg.get("output_router_logits"):  # otherwise transformers computes no aux loss (dmoe writes 0)
        checks.append(("aux_loss", aux))
    for name, value in checks:
        d = out[name][1][0]
        good = abs(d - value) <= rtol * max(abs(value), 1e-12)
        print(f"  {'ok  ' if good else 'MISS'} {name}: dmoe {d:.8f} reference {value:.8f}")
        ok = ok and good
    return ok


SELF_TEST_CASES = {
    # GQA 4:2, top-2, untied, aux loss on.
    "gqa-aux": dict(vocab_size=37, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                    router_aux_loss_coef=0.1, tie_word_embeddings=False),
    # Tied, multi-head, head_dim 6 != 16/4, top-1, aux off (a plain rope_theta key, as transformers 4.x).
    "tied-top1": dict(vocab_size=29, hidden_size=16, intermediate_size=10, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=6, num_local_experts=3, num_experts_per_tok=1,
                      output_router_logits=False, tie_word_embeddings=True),
}


def self_test(dmoe, rtol):
    ok_all = True
    with tempfile.TemporaryDirectory(prefix="dmoe_ref_") as d:
        for name, overrides in SELF_TEST_CASES.items():
            cfg = dict(model_type="mixtral", rms_norm_eps=1e-5, max_position_embeddings=64, initializer_range=0.3,
                       hidden_act="silu")
            cfg.update(overrides)
            if name == "tied-top1":
                cfg["rope_theta"] = 50.0
            else:
                cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 100.0}
            cpath, wpath = os.path.join(d, name + ".json"), os.path.join(d, name + ".safetensors")
            tpath, opath = os.path.join(d, name + "_tokens.safetensors"), os.path.join(d, name + "_out.safetensors")
            with open(cpath, "w") as f:
                json.dump(cfg, f)
            B, S = 2, 6
            toks = [(b * 11 + s * 7 + 3) % cfg["vocab_size"] for b in range(B) for s in range(S)]
            write_safetensors(tpath, {"tokens": ("I64", [B, S], toks)})
            for cmd in ([dmoe, "init-model", "--config", cpath, "--seed", "5", "--out", wpath],
                        [dmoe, "eval", "--config", cpath, "--weights", wpath, "--tokens", tpath, "--output", opath]):
                r = subprocess.run(cmd, capture_output=True, text=True)
                if r.returncode != 0:
                    print(f"MISS {' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
                    return False
            print(f"== {name}")
            ok_all = compare(cfg, wpath, tpath, opath, rtol) and ok_all
    return ok_all


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dmoe", help="dmoe binary: run the self-contained cases")
    ap.add_argument("--config")
    ap.add_argument("--weights", help="one model.safetensors (F32)")
    ap.add_argument("--tokens")
    ap.add_argument("--dmoe-output", help="the file `dmoe eval --output` wrote")
    ap.add_argument("--rtol", type=float, default=1e-5)
    args = ap.parse_args()
    if args.dmoe:
        ok = self_test(args.dmoe, args.rtol)
    elif args.config and args.weights and args.tokens and args.dmoe_output:
        with open(args.config) as f:
            ok = compare(json.load(f), args.weights, args.tokens, args.dmoe_output, args.rtol)
    else:
        ap.error("give --dmoe, or --config, --weights, --tokens and --dmoe-output")
    print("1 passed, 0 failed" if ok else "0 passed, 1 failed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
