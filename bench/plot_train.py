#!/usr/bin/env python3
"""The loss curve of a `dmoe train --log FILE` run as a PNG: training loss per step (and its running mean) and the
validation loss where it was measured.

    bench/plot_train.py train.jsonl --out loss.png [--title TEXT]

Needs matplotlib (pip install matplotlib); dmoe itself does not.
"""
import argparse
import json
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="JSON lines written by dmoe train --log")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    ap.add_argument("--window", type=int, default=50, help="steps in the running mean")
    args = ap.parse_args()
    # savefig writes --out in place: onto the input (`plot_train.py t.json --out t.json`) it replaced the log with the PNG.
    if os.path.exists(args.out) and os.path.exists(args.log) and os.path.samefile(args.out, args.log):
        sys.exit(f"plot_train: --out {args.out} is the log {args.log}: writing the PNG would destroy it; give another --out")
    steps, losses, val_steps, val = [], [], [], []
    with open(args.log) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                sys.exit(f"{args.log}:{n}: not JSON ({err})")
            if "val_loss" in rec:
                val_steps.append(rec["step"])
                val.append(rec["val_loss"])
            elif "loss" in rec:
                steps.append(rec["step"])
                losses.append(rec["loss"])
    if not steps:
        sys.exit(f"{args.log}: no training records (lines with 'step' and 'loss')")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("matplotlib is needed for the plot: pip install matplotlib")
    w = max(1, args.window)
    mean = [sum(losses[max(0, i - w + 1):i + 1]) / (i - max(0, i - w + 1) + 1) for i in range(len(losses))]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(steps, losses, color="#9ecae1", linewidth=0.6, label="training loss (per step)")
    ax.plot(steps, mean, color="#2171b5", linewidth=1.4, label=f"training loss ({w}-step mean)")
    if val:
        ax.plot(val_steps, val, "o-", color="#d94801", markersize=3, linewidth=1.2, label="validation loss (held out)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    if args.title:
        ax.set_title(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}: {len(steps)} steps, last loss {losses[-1]:.4f}" +
          (f", last validation loss {val[-1]:.4f}" if val else ""))


if __name__ == "__main__":
    main()
