#!/usr/bin/env python3
"""Sweep of `dmoe bench layer` over tokens per rank and experts (H = I = 2048, k = 2, ReLU, bf16, W = 1),
with a plot of the forward time and the % of roofline (PNG).

  bench/sweep.py --dmoe build/dmoe --out sweep.png [--json sweep.json]
                 [--tokens 1024,2048,4096,8192] [--experts 8,32,64,128]

Every point is one `dmoe bench layer` run (its own ceilings, median timing, fp64 sample check).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run_point(dmoe, tokens, experts, extra):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [dmoe, "bench", "layer", "--config", "flash-paper", "--tokens", str(tokens), "--experts", str(experts),
           "--check-tokens", "2", "--no-backward", "--json", path] + extra
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = json.load(open(path))
    os.unlink(path)
    return rows[0]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dmoe", default="build/dmoe")
    p.add_argument("--out", default="sweep.png")
    p.add_argument("--json")
    p.add_argument("--tokens", default="1024,2048,4096,8192")
    p.add_argument("--experts", default="8,32,64,128")
    a = p.parse_args()
    tokens = [int(t) for t in a.tokens.split(",")]
    experts = [int(e) for e in a.experts.split(",")]
    points = []
    for e in experts:
        for t in tokens:
            r = run_point(a.dmoe, t, e, [])
            points.append({"tokens": t, "experts": e, "forward_ms": r["forward_ms"],
                           "percent_of_roofline": r["percent_of_roofline"], "tflops": r["tflops"]})
            print(f"T={t:6d} E={e:4d}: {r['forward_ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s, "
                  f"{r['percent_of_roofline']:.1f}% of roofline", file=sys.stderr)
    if a.json:
        json.dump(points, open(a.json, "w"), indent=2)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for e in experts:
        pts = [q for q in points if q["experts"] == e]
        ax1.plot([q["tokens"] for q in pts], [q["forward_ms"] for q in pts], marker="o", label=f"E={e}")
        ax2.plot([q["tokens"] for q in pts], [q["percent_of_roofline"] for q in pts], marker="o", label=f"E={e}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank (T)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax1.set_yscale("log")
    ax1.set_ylabel("forward time (ms, median)")
    ax2.set_ylabel("% of roofline max(F/GEMM, bytes/copy)")
    fig.suptitle("dmoe EP layer forward, H=I=2048, k=2, ReLU, bf16, W=1 (1×H200)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
