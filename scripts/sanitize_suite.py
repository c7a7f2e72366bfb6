#!/usr/bin/env python3
"""compute-sanitizer's four tools over the whole GPU test suite, in parallel, within a time budget (issue 11).

    scripts/sanitize_suite.py --bin build/tests/dmoe_gpu_tests --out OUT [--tools memcheck,racecheck,...]
        [--jobs 16] [--budget 540] [--job-limit 300] [--filter GTEST_FILTER] [--resume SUMMARY] [--split REGEX]

One GPU test binary, each tool run on every test suite of it as a separate process (a job = one tool × one
suite, or one test for the suites `--split` names), `--jobs` of them at once. A job past `--job-limit` seconds is
stopped; the tests it finished count as covered, the one it was in is reported as "over the limit", and the ones
it had not reached are queued again as a new job. Nothing new starts once `--budget` seconds are spent, and jobs
still running then are stopped, so every test ends as one of: passed / failed / skipped (under the tool), over the
limit, stopped at the budget, crashed, or not reached — the summary says how many of each per tool, so a partial
run is never mistaken for the whole suite. `--resume` takes an earlier run's summary.json and runs, per tool, only
what it did not cover.

Many sanitized processes on one GPU slow each other's kernels far more than their count (the seventeenth
session: an own-GEMM test that takes 5 s alone ran past 240 s beside 15 others, and its 60 s bounded wait fired),
so the kernels' wait limit is raised to 900 s and the host's to 900 s (DMOE_GPU_WAIT_TIMEOUT_MS,
DMOE_COMM_TIMEOUT_S) unless already set, and heavy suites are best `--split`.

Reports: every "=========" block the tool printed is attributed to the test that was running (gtest's RUN/OK
lines are in the same stream) and to its first stack frame; OUT/summary.json holds them, OUT/summary.md the
table, OUT/logs.tgz each job's whole output (OUT/<tool>/<job>.log with --keep-logs).
"""
import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

RUN = re.compile(r"^\[ RUN      \] (\S+)")
END = re.compile(r"^\[ +(OK|FAILED|SKIPPED) +\] (\S+?)(?: \(\d+ ms\))?$")
ERROR_SUMMARY = re.compile(r"^========= ERROR SUMMARY: (\d+) error")
RACE_SUMMARY = re.compile(r"^========= RACECHECK SUMMARY: (\d+) hazard")
REPORT_START = re.compile(r"^========= (?!ERROR SUMMARY|RACECHECK SUMMARY|COMPUTE-SANITIZER|Target application)(\S.*)$")
FRAME = re.compile(r"^=========\s+(?:at |Host Frame:)\s*(.*)$")


def list_tests(binary, gfilter):
    cmd = [binary, "--gtest_list_tests"] + ([f"--gtest_filter={gfilter}"] if gfilter else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    suites = collections.OrderedDict()
    suite = None
    for line in out.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
            if not suite.endswith("."):  # "Running main() from gtest_main.cc" and the like
                suite = None
                continue
            suites[suite] = []
        elif suite is not None:
            suites[suite].append(suite + line.split("#")[0].strip())
    return suites


def parse_log(text):
    """Outcome per test, the test running at the end (if any), reports per (test, kind, first frame)."""
    outcome, running, summary = {}, None, None
    found = []  # [test, kind, first frame] per report, in order
    for line in text.splitlines():
        m = RUN.match(line)
        if m:
            running = m.group(1)
            continue
        m = END.match(line)
        if m:
            outcome[m.group(2)] = {"OK": "passed", "FAILED": "failed", "SKIPPED": "skipped"}[m.group(1)]
            if m.group(2) == running:
                running = None
            continue
        m = ERROR_SUMMARY.match(line) or RACE_SUMMARY.match(line)
        if m:
            summary = (summary or 0) + int(m.group(1))
            continue
        m = FRAME.match(line)
        if m:
            if found and found[-1][2] is None:
                found[-1][2] = m.group(1).strip()[:160]
            continue
        m = REPORT_START.match(line)
        if m:
            found.append([running or "(outside a test)", re.sub(r"0x[0-9a-f]+", "0x..", m.group(1))[:160], None])
    reports = collections.Counter((t, k, f or "(no frame)") for t, k, f in found)
    return outcome, running, reports, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tools", default="memcheck,racecheck,synccheck,initcheck")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--job-limit", type=float, default=300.0, help="seconds per job before it is stopped")
    ap.add_argument("--filter", default="", help="gtest filter applied to the listing")
    ap.add_argument("--sanitizer", default="compute-sanitizer")
    ap.add_argument("--resume", default="", help="a summary.json of an earlier run: per tool, only the tests it "
                    "did not cover")
    ap.add_argument("--keep-logs", action="store_true", help="keep OUT/<tool>/*.log (default: packed into "
                    "OUT/logs.tgz, one file to bring back from a lent machine)")
    ap.add_argument("--split", default="", help="regex: tests whose name matches get a job each (slow ones, so "
                    "that they run side by side)")
    a = ap.parse_args()
    tools = [t for t in a.tools.split(",") if t]
    allowed = {"memcheck", "racecheck", "synccheck", "initcheck"}
    if not tools or set(tools) - allowed:
        sys.exit(f"--tools {a.tools!r}: allowed: a comma-separated subset of {sorted(allowed)}")
    if a.jobs < 1 or a.budget <= 0 or a.job_limit <= 0:
        sys.exit("--jobs must be >= 1 and --budget, --job-limit > 0")
    env = dict(os.environ)
    env.setdefault("DMOE_GPU_WAIT_TIMEOUT_MS", "900000")
    env.setdefault("DMOE_COMM_TIMEOUT_S", "900")
    suites = list_tests(a.bin, a.filter)
    all_tests = [t for ts in suites.values() for t in ts]
    os.makedirs(a.out, exist_ok=True)

    # Jobs: (tool, name, tests). Racecheck is the slowest tool: its jobs go first.
    order = sorted(tools, key=lambda t: {"racecheck": 0, "memcheck": 1, "initcheck": 2, "synccheck": 3}[t])
    wanted = {tool: set(all_tests) for tool in tools}
    if a.resume:
        prev = json.load(open(a.resume))["tools"]
        wanted = {tool: set(prev[tool]["not_covered"]) & set(all_tests) if tool in prev else set(all_tests)
                  for tool in tools}
    split = re.compile(a.split) if a.split else None
    queue = collections.deque()
    for tool in order:
        for name, ts in suites.items():
            mine = [t for t in ts if t in wanted[tool]]
            alone = [t for t in mine if split and split.search(t)]
            rest = [t for t in mine if t not in alone]
            queue.extend((tool, t, [t]) for t in alone)
            if rest:
                queue.append((tool, name, rest))
    all_tests_of = {tool: sorted(wanted[tool]) for tool in tools}
    state = {tool: {} for tool in tools}  # test -> outcome
    reports = {tool: collections.Counter() for tool in tools}
    summaries = {tool: 0 for tool in tools}
    t0 = time.monotonic()
    running = []  # (proc, tool, name, tests, start, log path, file)
    serial = collections.Counter()

    def start(tool, name, tests):
        serial[(tool, name)] += 1
        d = os.path.join(a.out, tool)
        os.makedirs(d, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        path = os.path.join(d, f"{safe}.{serial[(tool, name)]}.log")
        f = open(path, "w")
        whole = serial[(tool, name)] == 1 and name.endswith(".") and len(tests) == len(suites.get(name, []))
        gfilter = name + "*" if whole else ":".join(tests)
        cmd = [a.sanitizer, "--tool", tool, "--print-limit", "1000", a.bin, f"--gtest_filter={gfilter}"]
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        running.append((p, tool, name, tests, time.monotonic(), path, f))

    def finish(entry, stopped):
        p, tool, name, tests, st, path, f = entry
        if stopped:
            try:
                os.killpg(p.pid, 9)
            except ProcessLookupError:
                pass
        p.wait()
        f.close()
        text = open(path, errors="replace").read()
        outcome, inside, rep, summary = parse_log(text)
        for t, o in outcome.items():
            state[tool][t] = o
        reports[tool].update(rep)
        summaries[tool] += summary or 0
        left = [t for t in tests if t not in outcome and t != inside]
        if inside is not None:
            state[tool][inside] = stopped or f"crashed (rc {p.returncode})"
        if left:
            if stopped or inside is not None or p.returncode != 0:
                queue.append((tool, name, left))  # not reached: run them again in a new process
        print(f"[{time.monotonic() - t0:6.0f} s] {tool} {name}: rc {p.returncode}{f' ({stopped})' if stopped else ''}, "
              f"{len(outcome)} done, {summary if summary is not None else '?'} reported, {len(left)} left", flush=True)

    while queue or running:
        now = time.monotonic()
        for entry in list(running):
            p, st = entry[0], entry[4]
            if p.poll() is not None:
                reason = None
            elif now - t0 > a.budget:
                reason = "stopped at the budget"
            elif now - st > a.job_limit:
                reason = "over the limit"
            else:
                continue
            running.remove(entry)
            finish(entry, reason)
        while queue and len(running) < a.jobs and time.monotonic() - t0 < a.budget:
            start(*queue.popleft())
        if time.monotonic() - t0 >= a.budget and not running:
            break
        time.sleep(0.5)

    result = {"binary": a.bin, "tests": len(all_tests), "elapsed_s": round(time.monotonic() - t0, 1), "tools": {}}
    lines = ["| tool | passed | failed | skipped | over the job limit | stopped at the budget | crashed | not reached | "
             "reports (the tool's summary lines) |", "|---|---|---|---|---|---|---|---|---|"]
    for tool in tools:
        c = collections.Counter(state[tool].get(t, "not reached") for t in all_tests_of[tool])
        crashed = sum(v for k, v in c.items() if k.startswith("crashed"))
        rep = [{"test": k[0], "kind": k[1], "first_frame": k[2], "count": v} for k, v in reports[tool].most_common()]
        result["tools"][tool] = {
            "outcomes": dict(c), "reported": summaries[tool], "reports": rep,
            "tests": len(all_tests_of[tool]),
            "not_covered": sorted(t for t in all_tests_of[tool]
                                  if state[tool].get(t, "not reached") not in ("passed", "failed", "skipped")),
            "failed": sorted(t for t in all_tests_of[tool] if state[tool].get(t) == "failed"),
            "outcome_of": {t: state[tool].get(t, "not reached") for t in all_tests_of[tool]},
        }
        lines.append(f"| {tool} | {c['passed']} | {c['failed']} | {c['skipped']} | {c['over the limit']} | "
                     f"{c['stopped at the budget']} | {crashed} | {c['not reached']} | {summaries[tool]} |")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=1)
    if not a.keep_logs:
        dirs = [t for t in tools if os.path.isdir(os.path.join(a.out, t))]
        if dirs:
            subprocess.run(["tar", "czf", "logs.tgz"] + dirs, cwd=a.out, check=True)
            subprocess.run(["rm", "-rf"] + dirs, cwd=a.out, check=True)
    md = "\n".join(lines)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    for tool in tools:
        for r in result["tools"][tool]["reports"][:15]:
            print(f"{tool}: {r['count']} × {r['kind']} @ {r['first_frame']} in {r['test']}")
        nc = result["tools"][tool]["not_covered"]
        if nc:
            print(f"{tool}: not covered ({len(nc)}): {' '.join(nc[:30])}{' ...' if len(nc) > 30 else ''}")
        fl = result["tools"][tool]["failed"]
        if fl:
            print(f"{tool}: failed under the tool ({len(fl)}): {' '.join(fl[:30])}")


if __name__ == "__main__":
    main()
