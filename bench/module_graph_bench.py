#!/usr/bin/env python3
"""dmoe's MoELayer at decode sizes, eager against CUDA-graph replays: the decode config (bench/configs/decode.json:
H 4096, I 1536, E 64, k 8, SwiGLU, bf16), T = 1, 8, 128 tokens, engines 'ep' and 'flash', inference (no_grad).

For each: time per forward of 200 back-to-back calls (CUDA events around the loop, so host gaps count: this is the
throughput a decode loop sees), median of 5 loops after 20 warm-ups; eager calls the module, graph replays one
captured forward. Also whether the replays' outputs equal eager ones bit for bit. A diagnostic for docs/perf.md.

    PYTHONPATH=build/python python3 bench/module_graph_bench.py
"""
import json
import sys

import torch

import dmoe

H, I, E, K = 4096, 1536, 64, 8


def per_call(fn, n=200, warm=20, loops=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(loops):
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return sorted(times)[loops // 2]


def main():
    torch.manual_seed(0)
    ep = dmoe.MoELayer(H, I, E, K, engine="ep", device="cuda", dtype=torch.bfloat16)
    fl = dmoe.MoELayer(H, I, E, K, engine="flash", device="cuda", dtype=torch.bfloat16)
    fl.load_state_dict(ep.state_dict())
    rows = []
    with torch.no_grad():
        for tokens in (1, 8, 128):
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
            for name, layer in (("ep", ep), ("flash", fl)):
                static_x = x.clone()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(3):
                        layer(static_x)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_y = layer(static_x)
                eager_ms = per_call(lambda: layer(x))
                graph_ms = per_call(graph.replay)
                static_x.copy_(x)
                graph.replay()
                equal = bool(torch.equal(static_y, layer(x)))
                row = {"tokens": tokens, "engine": name, "eager_ms": round(eager_ms, 4), "graph_ms": round(graph_ms, 4),
                       "speed_up": round(eager_ms / graph_ms, 3), "graph_equals_eager": equal}
                rows.append(row)
                print(json.dumps(row))
                sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()
