"""Run the test suite as N pytest processes at once, one part each (tests/parts.py): `make test` runs two,
so both cores of a 2-core machine work while one part waits on a server (its imports, its warm-up, a
stall timeout) or computes HF's reference rows.

    .venv/bin/python scripts/run_tests.py --parts 2 -- -q -ra --durations=30 tests
    .venv/bin/python scripts/run_tests.py --parts 2 --update-seconds -- -q tests   # and refresh the weights

Each part writes its own log (and junit XML) under --log-dir; a line every --heartbeat seconds says how far
each part is; when all are done each part's log is printed whole, then one summary line per part. The exit
status is 0 only if every part passed (a part that selected nothing counts as passed when another ran
tests). SIGINT/SIGTERM reach every part as SIGINT, so pytest stops its servers on the way out.
--update-seconds writes each module's measured seconds (setup + call + teardown of its tests, from the
junit XML) into tests/module_seconds.json, which balances the next runs' parts.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from parts import SECONDS_FILE, STARTS_LEDGER, load_seconds  # noqa: E402

NO_TESTS = 5  # pytest's exit status when a part selected nothing


def module_seconds(junit_paths) -> dict:
    """{tests/.../test_x.py: seconds} summed over the testcases of the junit XML files."""
    out = {}
    for path in junit_paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            classname = case.get("classname", "")
            parts = classname.split(".")
            while parts and not os.path.isfile(os.path.join(REPO, *parts[:-1], parts[-1] + ".py")):
                parts.pop()  # a class inside the module: drop it
            if parts:
                mod = "/".join(parts) + ".py"
                out[mod] = out.get(mod, 0.0) + float(case.get("time") or 0.0)
    return out


def _progress(log: str) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "starting"
    pct = re.findall(r"\[\s*(\d+)%\]", tail)
    if pct:
        return f"{pct[-1]}%"
    return "running" if re.search(r"^part \d+/\d+: ", tail, re.M) else "collecting"


def _summary(log: str) -> str:
    with open(log, errors="replace") as f:
        lines = [l.strip() for l in f if l.strip()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|errors|no tests ran|deselected)\b", line) and " in " in line:
            return line.strip("= ")
    return lines[-1] if lines else "(no output)"


def _starts(ledger: str) -> str:
    """One line from a part's ledger of server starts (tests/helpers.py: test, seconds to ready, flags)."""
    try:
        with open(ledger) as f:
            seconds = [float(line.split("\t")[1]) for line in f if line.strip()]
    except FileNotFoundError:
        return "0 servers started"
    except (OSError, ValueError, IndexError) as e:
        return f"the ledger of server starts is unreadable ({e})"
    return f"{len(seconds)} servers started, {sum(seconds):.0f} s from launch to ready in all"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=int, default=2, help="pytest processes at once (default 2)")
    p.add_argument("--log-dir", default=os.path.join(REPO, "build", "test-logs"))
    p.add_argument("--heartbeat", type=float, default=60.0, help="seconds between progress lines")
    p.add_argument("--update-seconds", action="store_true",
                   help="write the measured seconds per module into tests/module_seconds.json")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    ns = p.parse_args(argv)
    args = [a for a in ns.pytest_args if a != "--"] or ["tests"]
    if ns.parts < 1:
        p.error(f"--parts: a number of processes >= 1, got {ns.parts}")
    os.makedirs(ns.log_dir, exist_ok=True)
    t0 = time.monotonic()
    procs, logs, junits = [], [], []
    for k in range(1, ns.parts + 1):
        log = os.path.join(ns.log_dir, f"part-{k}-of-{ns.parts}.log")
        junit = os.path.join(ns.log_dir, f"part-{k}-of-{ns.parts}.xml")
        starts = os.path.join(ns.log_dir, f"part-{k}-of-{ns.parts}.starts.tsv")
        if os.path.exists(starts):
            os.unlink(starts)
        with open(log, "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "pytest", "--part", f"{k}/{ns.parts}",
                                           f"--junitxml={junit}", *args],
                                          stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, STARTS_LEDGER: starts}))
        logs.append(log)
        junits.append(junit)
    print(f"[run_tests] {ns.parts} parts of `pytest {' '.join(args)}`; logs in {ns.log_dir}", flush=True)

    def forward(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    next_beat = time.monotonic() + ns.heartbeat
    while any(proc.poll() is None for proc in procs):
        time.sleep(1.0)
        if time.monotonic() >= next_beat:
            next_beat += ns.heartbeat
            state = ", ".join(f"part {k}: {'done' if proc.poll() is not None else _progress(log)}"
                              for k, (proc, log) in enumerate(zip(procs, logs), 1))
            print(f"[run_tests] {(time.monotonic() - t0) / 60:.1f} min: {state}", flush=True)
    wall = time.monotonic() - t0
    for k, log in enumerate(logs, 1):
        print(f"\n{'=' * 30} part {k} of {ns.parts}: {log} {'=' * 30}", flush=True)
        with open(log, errors="replace") as f:
            sys.stdout.write(f.read())
    rcs = [proc.returncode for proc in procs]
    print(f"\n[run_tests] {wall:.1f} s wall for {ns.parts} parts")
    for k in range(1, ns.parts + 1):
        print(f"[run_tests] part {k}: {_starts(os.path.join(ns.log_dir, f'part-{k}-of-{ns.parts}.starts.tsv'))}")
    for k, (rc, log) in enumerate(zip(rcs, logs), 1):
        print(f"[run_tests] part {k}: exit {rc}: {_summary(log)}")
    if ns.update_seconds:
        measured = module_seconds([j for j in junits if os.path.exists(j)])
        seconds = {**load_seconds(), **{m: round(s, 1) for m, s in measured.items()}}
        with open(SECONDS_FILE, "w") as f:
            json.dump(dict(sorted(seconds.items())), f, indent=1)
            f.write("\n")
        print(f"[run_tests] {len(measured)} modules' seconds written to {SECONDS_FILE}")
    ran = [rc for rc in rcs if rc != NO_TESTS]
    if not ran:
        return NO_TESTS
    return next((rc for rc in ran if rc != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
