#!/usr/bin/env python3
"""PyTorch peers of dmoe's MoE layer, timed on the same GPU with the same weights and inputs.

  loop     the per-expert loop of a Hugging Face Mixtral sparse-MoE block (router, softmax, top-k,
           renormalise, then for each expert: gather its tokens, FFN, scaled index_add)
  grouped  sort rows by expert and run the expert FFN as grouped GEMMs (torch._grouped_mm, where the
           installed PyTorch has it), then scatter back with the gate weights

Timing matches dmoe's helper: warm-up, L2 flush (a 2×L2 memset) outside the timed region, CUDA events
around each call, median and spread over the iterations. Errors are measured with dmoe's routing fed to
the peer (bf16 routers flip near-tied experts), as ‖y_peer − y_dmoe‖ / ‖y_dmoe‖ over all tokens.

Only for comparison: dmoe never needs Python. Usage (dmoe bench layer --peers runs it):
  peers.py --config C.json --weights W.safetensors --input X.safetensors --dmoe Y.safetensors --json OUT
"""
import argparse
import json
import statistics
import sys

import torch
from safetensors.torch import load_file


def act_fn(name):
    if name == "relu":
        return torch.relu
    if name == "gelu":
        return lambda t: torch.nn.functional.gelu(t)  # erf form, as dmoe
    return torch.nn.functional.silu  # swiglu gate


def load_layer(path, prefix, cfg, device, dtype):
    t = load_file(path, device=str(device))
    E = cfg["experts"]
    gate = t[prefix + "gate.weight"].to(dtype)
    w1 = torch.stack([t[f"{prefix}experts.{e}.w1.weight"] for e in range(E)]).to(dtype)  # [E, I, H]
    w2 = torch.stack([t[f"{prefix}experts.{e}.w2.weight"] for e in range(E)]).to(dtype)  # [E, H, I]
    w3 = None
    if cfg["activation"] == "swiglu":
        w3 = torch.stack([t[f"{prefix}experts.{e}.w3.weight"] for e in range(E)]).to(dtype)
    return gate, w1, w3, w2


def route(x, gate, k, renormalize):
    logits = (x @ gate.t()).float()
    probs = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def expert_mlp(xs, w1e, w3e, w2e, act):
    h = act(xs @ w1e.t())
    if w3e is not None:
        h = h * (xs @ w3e.t())
    return h @ w2e.t()


def loop_layer(x, gate, w1, w3, w2, cfg, ids=None, weights=None):
    """The Hugging Face Mixtral block's structure: one masked gather + FFN + index_add per expert."""
    if ids is None:
        ids, weights = route(x, gate, cfg["top_k"], cfg.get("renormalize", True))
    act = act_fn(cfg["activation"])
    y = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(ids.long(), num_classes=cfg["experts"]).permute(2, 1, 0)  # [E, k, T]
    for e in range(cfg["experts"]):
        slot, tok = torch.where(mask[e])
        if tok.numel() == 0:
            continue
        out = expert_mlp(x[tok], w1[e], None if w3 is None else w3[e], w2[e], act)
        y.index_add_(0, tok, (out * weights[tok, slot, None]).to(x.dtype))
    return y


def grouped_layer(x, gate, w1t, w3t, w2t, cfg, ids=None, weights=None):
    """Rows sorted by expert, expert FFN as three (two) grouped GEMMs over all experts at once."""
    if ids is None:
        ids, weights = route(x, gate, cfg["top_k"], cfg.get("renormalize", True))
    k, E = cfg["top_k"], cfg["experts"]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    xs = x[tok]
    act = act_fn(cfg["activation"])
    h = act(torch._grouped_mm(xs, w1t, offs=offs))
    if w3t is not None:
        h = h * torch._grouped_mm(xs, w3t, offs=offs)
    out = torch._grouped_mm(h, w2t, offs=offs)
    out = out * weights.reshape(-1)[order, None].to(out.dtype)
    y = torch.zeros_like(x)
    y.index_add_(0, tok, out.to(x.dtype))
    return y


def time_cuda(fn, warmup=5, min_iters=20, min_total_ms=300.0, max_iters=2000):
    props = torch.cuda.get_device_properties(0)
    flush = torch.empty(2 * max(props.L2_cache_size, 1 << 20), dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    while len(times) < max_iters and (len(times) < min_iters or sum(times) < min_total_ms):
        flush.fill_(len(times) & 0xFF)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
            "iterations": len(times)}


def rel_err(a, b):
    return (torch.linalg.vector_norm((a.float() - b.float())) / torch.linalg.vector_norm(b.float())).item()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--weights", required=True)
    p.add_argument("--prefix", default="model.layers.0.block_sparse_moe.")
    p.add_argument("--input", required=True)
    p.add_argument("--dmoe", required=True, help="dmoe output: y, expert_ids, expert_weights")
    p.add_argument("--json", required=True)
    p.add_argument("--peers", default="loop,grouped")
    a = p.parse_args()

    cfg = json.load(open(a.config))
    dev = torch.device("cuda")
    dtype = torch.bfloat16 if cfg.get("dtype", "f32") == "bf16" else torch.float32
    gate, w1, w3, w2 = load_layer(a.weights, a.prefix, cfg, dev, dtype)
    x = load_file(a.input, device="cuda")["x"].to(dtype)
    ref = load_file(a.dmoe, device="cuda")
    y_dmoe, ids_dmoe, w_dmoe = ref["y"], ref["expert_ids"], ref["expert_weights"].float()

    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "peers": {}}
    with torch.no_grad():
        # Share of tokens whose expert set differs from dmoe's when the peer routes by itself.
        ids_own, _ = route(x, gate, cfg["top_k"], cfg.get("renormalize", True))
        same = (torch.sort(ids_own, dim=-1).values == torch.sort(ids_dmoe.long(), dim=-1).values).all(dim=-1)
        flipped = 1.0 - same.float().mean().item()
        for name in a.peers.split(","):
            if name == "loop":
                fn = lambda: loop_layer(x, gate, w1, w3, w2, cfg)
                check = loop_layer(x, gate, w1, w3, w2, cfg, ids_dmoe, w_dmoe)
            elif name == "grouped":
                if not hasattr(torch, "_grouped_mm") or dtype != torch.bfloat16:
                    results["peers"][name] = {"skipped": "torch._grouped_mm needs PyTorch >= 2.8 and bf16"}
                    continue
                w1t = w1.transpose(1, 2)  # [E, H, I], column-major as _grouped_mm wants
                w3t = None if w3 is None else w3.transpose(1, 2)
                w2t = w2.transpose(1, 2)  # [E, I, H]
                fn = lambda: grouped_layer(x, gate, w1t, w3t, w2t, cfg)
                check = grouped_layer(x, gate, w1t, w3t, w2t, cfg, ids_dmoe, w_dmoe)
            else:
                raise SystemExit(f"unknown peer {name!r}; allowed: loop, grouped")
            r = time_cuda(fn)
            r["rel_error_vs_dmoe"] = rel_err(check, y_dmoe)
            r["tokens_routed_differently"] = flipped
            results["peers"][name] = r
            print(f"peer {name}: {r['median_ms']:.3f} ms, rel. error vs dmoe {r['rel_error_vs_dmoe']:.2e}",
                  file=sys.stderr)
    json.dump(results, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
