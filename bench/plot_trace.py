#!/usr/bin/env python3
"""A Flow trace as a Gantt chart (PNG): one panel per process of the trace (a schedule of `dmoe flow simulate
--trace`, or a measured run of `dmoe flow measure --engine cuda --trace`), one lane per stream (compute,
all-to-all, all-reduce), one bar per task, coloured by task kind (AT, D, E, C, C', E', D', AT', AR), on one time
axis so that the schedules' steps compare at a glance.

    bench/plot_trace.py trace.json --out gantt.png [--title TEXT] [--pids 0,3]

The trace is Chrome trace-event JSON (the "traceEvents" list: "X" events with ts/dur in microseconds, "M" events
naming processes and threads), as dmoe writes it. Needs matplotlib (pip install matplotlib); dmoe itself does not.
"""
import argparse
import json
import os
import sys

# One colour per task kind; the backward kinds are darker shades of their forward's.
COLOURS = {
    "AT": "#4c72b0", "AT'": "#27406b",
    "D": "#dd8452", "D'": "#8c4a22",
    "E": "#55a868", "E'": "#2d6b3b",
    "C": "#c44e52", "C'": "#7a2327",
    "AR": "#8172b3",
}


def read_trace(path):
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        sys.exit(f"plot_trace: {path}: {err}")
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        sys.exit(f"plot_trace: {path}: no traceEvents list (a Chrome trace-event JSON file is expected)")
    processes, threads, spans = {}, {}, {}
    for e in events:
        if not isinstance(e, dict):
            continue
        pid, tid = e.get("pid", 0), e.get("tid", 0)
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[pid] = e.get("args", {}).get("name", f"process {pid}")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(pid, tid)] = e.get("args", {}).get("name", f"stream {tid}")
        elif e.get("ph") == "X":
            try:
                ts, dur = float(e["ts"]), float(e["dur"])
            except (KeyError, TypeError, ValueError):
                sys.exit(f"plot_trace: {path}: an X event without numeric ts and dur: {e}")
            kind = e.get("cat") or str(e.get("name", "?")).split("[")[0]
            spans.setdefault(pid, []).append((tid, ts / 1000.0, dur / 1000.0, kind))
    if not spans:
        sys.exit(f"plot_trace: {path}: no task spans (X events) in the trace")
    return processes, threads, spans


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="Chrome trace-event JSON written by dmoe flow simulate/measure --trace")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="")
    ap.add_argument("--pids", default="", help="comma-separated process ids to draw (default: all)")
    args = ap.parse_args()
    # savefig writes --out in place: onto the input (`plot_trace.py t.json --out t.json`) it replaced the trace with the PNG.
    if os.path.exists(args.out) and os.path.exists(args.trace) and os.path.samefile(args.out, args.trace):
        sys.exit(f"plot_trace: --out {args.out} is the trace {args.trace}: writing the PNG would destroy it; give another --out")
    processes, threads, spans = read_trace(args.trace)
    pids = sorted(spans)
    if args.pids:
        try:
            wanted = [int(p) for p in args.pids.split(",")]
        except ValueError:
            sys.exit(f"plot_trace: --pids {args.pids}: give process ids separated by commas, e.g. 0,3")
        missing = [p for p in wanted if p not in spans]
        if missing:
            sys.exit(f"plot_trace: --pids: {missing} not in the trace (it has {pids})")
        pids = wanted
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        sys.exit("plot_trace: needs matplotlib (pip install matplotlib)")

    end = max(t + d for p in pids for (_, t, d, _) in spans[p])
    fig, axes = plt.subplots(len(pids), 1, figsize=(12, 1.0 + 1.1 * len(pids)), sharex=True, squeeze=False)
    kinds = set()
    for ax, pid in zip(axes[:, 0], pids):
        tids = sorted({s[0] for s in spans[pid]})
        for lane, tid in enumerate(tids):
            bars = [(t, d) for (tt, t, d, _) in spans[pid] if tt == tid]
            colours = [COLOURS.get(k, "#999999") for (tt, _, _, k) in spans[pid] if tt == tid]
            kinds.update(k for (tt, _, _, k) in spans[pid] if tt == tid)
            ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=colours, edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(tids)))
        ax.set_yticklabels([threads.get((pid, t), f"stream {t}") for t in tids], fontsize=8)
        ax.set_ylim(-0.6, len(tids) - 0.4)
        step = max(t + d for (_, t, d, _) in spans[pid])
        ax.set_title(f"{processes.get(pid, f'process {pid}')}: {step:.2f} ms", fontsize=9, loc="left")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("ms from the step's start")
    axes[-1, 0].set_xlim(0, end * 1.01)
    order = [k for k in COLOURS if k in kinds] + sorted(k for k in kinds if k not in COLOURS)
    fig.legend(handles=[Patch(color=COLOURS.get(k, "#999999"), label=k) for k in order], loc="upper right",
               ncol=len(order), fontsize=8, frameon=False)
    if args.title:
        fig.suptitle(args.title, x=0.01, ha="left", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    try:
        fig.savefig(args.out, dpi=120)
    except OSError as err:
        sys.exit(f"plot_trace: --out {args.out}: {err}")
    print(f"wrote {args.out} ({len(pids)} panel(s), {sum(len(spans[p]) for p in pids)} tasks)")


if __name__ == "__main__":
    main()
