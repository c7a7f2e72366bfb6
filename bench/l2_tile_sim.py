#!/usr/bin/env python3
"""L2-reuse model of dmoe's own grouped GEMM (src/cuda/grouped_gemm_sm90.cu): how many bytes a tile
schedule reads from DRAM, to rank tile orders before spending GPU time on them.

  bench/l2_tile_sim.py --config fine-grained --product up [--order m-fastest] [--jitter 0.05]
                       [--l2-mb 60] [--sms 132] [--seed 1]

Model (first order, stated so that it can be checked against Nsight Compute's dram__bytes_read):
- rows per expert from uniform top-k routing of T tokens (as `dmoe bench gemm`); tiles of 128 rows ×
  BN columns (SwiGLU's up projection: BN/2 columns of the gate and of the up weights per tile), numbered
  expert by expert in the kernel's order (`--order m-fastest`: row tiles fastest, the kernel's), or the
  alternatives named in ORDERS;
- one CTA per SM walks tiles t = b, b + G, b + 2G, ... (persistent; `--schedule dynamic`: each CTA takes
  the next tile in order when it finishes one); a tile is k_blocks steps of equal
  length times (1 + a uniform random jitter of ±`jitter` per tile, modelling the drift between CTAs that
  interleaved timings show), then its epilogue;
- each step reads the tile's A k-block (128 rows × 128 B) and B k-block (BN rows × 128 B) as chunks
  keyed by (operand, expert, tile row or column, k-block); an LRU cache of `l2-mb` holds them; a miss
  reads the chunk from DRAM; each tile's output is written through the cache (it occupies capacity);
- no partition effects, sectors or prefetch: the model counts what the schedule's reuse distance
  alone costs. Calibration against the measured bytes is in docs/perf.md.
"""
import argparse
import heapq
import json
import os
import random
from collections import OrderedDict

ORDERS = ("m-fastest", "n-fastest")


def load_config(name):
    here = os.path.dirname(os.path.abspath(__file__))
    path = name if os.path.exists(name) else os.path.join(here, "configs", name + ".json")
    if not os.path.exists(path):
        raise SystemExit(f"config '{name}' not found (a file, or one of bench/configs/*.json)")
    return json.load(open(path))


def uniform_routing(tokens, experts, top_k, seed):
    rng = random.Random(seed)
    counts = [0] * experts
    for _ in range(tokens):
        for e in rng.sample(range(experts), top_k):
            counts[e] += 1
    return counts


def tiles_of(counts, n_out, k, tile_n_out, order):
    """The kernel's tile list: (expert, m, n) in execution order."""
    n_tiles = -(-n_out // tile_n_out)
    tiles = []
    for e, rows in enumerate(counts):
        m_tiles = -(-rows // 128)
        if order == "m-fastest":
            tiles += [(e, m, n) for n in range(n_tiles) for m in range(m_tiles)]
        elif order == "n-fastest":
            tiles += [(e, m, n) for m in range(m_tiles) for n in range(n_tiles)]
        else:
            raise SystemExit(f"unknown order '{order}'; allowed: {', '.join(ORDERS)}")
    return tiles


class Lru:
    def __init__(self, capacity):
        self.capacity, self.used, self.items = capacity, 0, OrderedDict()

    def touch(self, key, size):
        """True on a hit; a miss inserts the chunk, evicting the least recently used."""
        if key in self.items:
            self.items.move_to_end(key)
            return True
        self.items[key] = size
        self.used += size
        while self.used > self.capacity:
            _, s = self.items.popitem(last=False)
            self.used -= s
        return False


def simulate(cfg, product, order, jitter, l2_bytes, sms, seed, schedule="static"):
    T, E, k_top = cfg["tokens"], cfg["experts"], cfg["top_k"]
    H, I = cfg["hidden"], cfg["ffn"]
    gated = cfg.get("activation", "relu") == "swiglu"
    counts = uniform_routing(T, E, k_top, seed)
    bn = 256
    if product == "up":
        n_out, k = I, H
        tile_n_out = bn // 2 if gated else bn
    else:
        n_out, k, tile_n_out = H, I, bn
    k_blocks = -(-k // 64)
    tiles = tiles_of(counts, n_out, k, tile_n_out, order)
    grid = min(len(tiles), sms)
    rng = random.Random(seed + 1)

    # Events (time, sequence, tile, k-block or -1 for the epilogue). static: CTA b runs tiles b, b + G, ...
    # (the kernel's schedule); dynamic: each CTA takes the next tile in order when it finishes one (a
    # global tile counter), so tiles with neighbouring indices start close together however the CTAs drift.
    events = []
    seq = 0

    def run_tile(ti, t_now):
        nonlocal seq
        step = 1.0 + rng.uniform(-jitter, jitter)
        for kb in range(k_blocks):
            events.append((t_now + kb * step, seq, ti, kb))
            seq += 1
        t_now += k_blocks * step
        events.append((t_now, seq, ti, -1))
        seq += 1
        return t_now + step  # epilogue ~ one k-block

    if schedule == "static":
        for b in range(grid):
            t_now = 0.0
            for ti in range(b, len(tiles), grid):
                t_now = run_tile(ti, t_now)
    else:
        free = [(0.0, b) for b in range(grid)]
        heapq.heapify(free)
        for ti in range(len(tiles)):
            t_now, b = heapq.heappop(free)
            heapq.heappush(free, (run_tile(ti, t_now), b))
    heapq.heapify(events)

    cache = Lru(l2_bytes)
    a_chunk = 128 * 128
    b_chunk = (tile_n_out if gated and product == "up" else bn) * 128  # per weight matrix
    dram_read = 0
    minimum = 0
    seen = set()
    while events:
        _, _, ti, kb = heapq.heappop(events)
        e, m, n = tiles[ti]
        if kb < 0:  # the tile's output goes through the cache
            rows = min(128, counts[e] - m * 128)
            cache.touch(("out", e, m, n), rows * tile_n_out * 2)
            continue
        chunks = [(("a", e, m, kb), a_chunk)]
        if product == "up" and gated:
            chunks += [(("w1", e, n, kb), b_chunk), (("w3", e, n, kb), b_chunk)]
        else:
            chunks += [(("w", e, n, kb), b_chunk)]
        for key, size in chunks:
            if key not in seen:
                seen.add(key)
                minimum += size
            if not cache.touch(key, size):
                dram_read += size
    return {"tiles": len(tiles), "dram_read_gb": dram_read / 1e9, "minimum_gb": minimum / 1e9,
            "ratio": dram_read / max(minimum, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="fine-grained")
    p.add_argument("--product", choices=("up", "down"), default="up")
    p.add_argument("--order", choices=ORDERS, default="m-fastest")
    p.add_argument("--schedule", choices=("static", "dynamic"), default="static",
                   help="static: CTA b takes tiles b, b+G, ... (the kernel's); dynamic: next tile on finishing")
    p.add_argument("--jitter", type=float, default=0.05, help="per-tile speed spread (fraction)")
    p.add_argument("--l2-mb", type=float, default=60.0)
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if not 0 <= a.jitter < 1:
        raise SystemExit(f"--jitter {a.jitter}: must be in [0, 1)")
    r = simulate(load_config(a.config), a.product, a.order, a.jitter, int(a.l2_mb * 1e6), a.sms, a.seed,
                 a.schedule)
    print(f"{a.config} {a.product} order={a.order} schedule={a.schedule} jitter={a.jitter} L2={a.l2_mb} MB: "
          f"{r['tiles']} tiles, "
          f"DRAM read {r['dram_read_gb']:.3f} GB (minimum {r['minimum_gb']:.3f} GB, {r['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
