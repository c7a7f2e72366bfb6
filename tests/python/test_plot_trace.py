"""bench/plot_trace.py: a Flow trace (Chrome trace events, as dmoe flow simulate/measure --trace write them) as a
Gantt PNG, and its refusals. Needs matplotlib (scripts/requirements-python.txt); skipped without it."""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "plot_trace.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def trace_events():
    # Two processes (schedules), three streams, the kinds the executors and the simulator write.
    ev = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}} for p, n in ((0, "vanilla"), (1, "pipe"))]
    ev += [{"ph": "M", "name": "thread_name", "pid": p, "tid": t, "args": {"name": n}}
           for p in (0, 1) for t, n in ((0, "compute"), (1, "alltoall"), (2, "allreduce"))]
    t = 0.0
    for kind, tid, dur in (("AT", 0, 900.0), ("D", 1, 400.0), ("E", 0, 700.0), ("C", 1, 400.0), ("C'", 1, 400.0),
                           ("E'", 0, 1400.0), ("D'", 1, 400.0), ("AT'", 0, 1800.0), ("AR", 2, 300.0)):
        for pid in (0, 1):
            ev.append({"ph": "X", "pid": pid, "tid": tid, "name": f"{kind}[l=0,r=0]", "cat": kind, "ts": t,
                       "dur": dur * (1.0 if pid == 0 else 0.7)})
        t += dur
    return ev


def test_gantt_png_of_a_trace(tmp_path):
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": trace_events(), "displayTimeUnit": "ms"}))
    out = tmp_path / "g.png"
    r = run(str(trace), "--out", str(out), "--title", "test")
    assert r.returncode == 0, r.stderr
    assert "2 panel(s), 18 tasks" in r.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    one = tmp_path / "one.png"
    r = run(str(trace), "--out", str(one), "--pids", "1")
    assert r.returncode == 0 and "1 panel(s), 9 tasks" in r.stdout, r.stdout + r.stderr


def test_bad_traces_and_options_are_refused(tmp_path):
    pytest.importorskip("matplotlib")
    not_trace = tmp_path / "x.json"
    not_trace.write_text(json.dumps({"loss": 1.5}))
    r = run(str(not_trace), "--out", str(tmp_path / "x.png"))
    assert r.returncode != 0 and "no traceEvents list" in r.stderr
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    r = run(str(empty), "--out", str(tmp_path / "e.png"))
    assert r.returncode != 0 and "no task spans" in r.stderr
    good = tmp_path / "t.json"
    good.write_text(json.dumps({"traceEvents": trace_events()}))
    r = run(str(good), "--out", str(tmp_path / "p.png"), "--pids", "7")
    assert r.returncode != 0 and "[7] not in the trace" in r.stderr
    r = run(str(good), "--out", str(tmp_path / "no_dir" / "p.png"))
    assert r.returncode != 0 and "--out" in r.stderr


def test_out_onto_the_trace_is_refused(tmp_path):
    # The twelfth bad-input pass: savefig wrote --out in place, so `plot_trace.py t.json --out t.json` replaced the
    # trace with the PNG (and plot_train.py the log). Refused before anything is read or drawn (no matplotlib needed).
    trace = tmp_path / "t.json"
    text = json.dumps({"traceEvents": trace_events()})
    trace.write_text(text)
    r = run(str(trace), "--out", str(trace))
    assert r.returncode != 0 and "--out" in r.stderr and "is the trace" in r.stderr, r.stderr
    assert trace.read_text() == text
    link = tmp_path / "link.png"
    link.symlink_to(trace)
    r = run(str(trace), "--out", str(link))
    assert r.returncode != 0 and "is the trace" in r.stderr, r.stderr
    assert trace.read_text() == text
    log = tmp_path / "train.jsonl"
    log.write_text('{"step": 1, "loss": 5.5}\n')
    train = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "plot_train.py")
    r = subprocess.run([sys.executable, train, str(log), "--out", str(log)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "is the log" in r.stderr, r.stderr
    assert log.read_text() == '{"step": 1, "loss": 5.5}\n'
