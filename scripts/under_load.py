"""Run the timing-exposed end-to-end modules with every core busy, several times: a test that waits on the
clock instead of on published state fails here first (issue 43).

    .venv/bin/python scripts/under_load.py                      # 3 runs of the default modules
    .venv/bin/python scripts/under_load.py --runs 1 tests/e2e/test_harvest.py

A bounded CPU hog (one spinning process per core, at the tests' own priority, each ending itself after
--hog-limit seconds even if this script dies) runs for the whole of each pytest run and is stopped after
it. Prints one line per run (passed / failed / errors, wall time) and a summary `runs x failures`; the
exit status is 0 only if every run passed.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODULES = ["tests/e2e/test_admission.py", "tests/e2e/test_harvest.py", "tests/e2e/test_request_contract.py",
                   "tests/e2e/test_exact_rows.py", "tests/e2e/test_overlay_serves.py", "tests/e2e/test_reader_restart.py",
                   "tests/e2e/test_security.py", "tests/e2e/test_request_rids.py", "tests/e2e/test_full_pool.py",
                   "tests/e2e/test_speculative.py"]
HOG = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def _hogs(n: int, limit: float):
    return [subprocess.Popen([sys.executable, "-c", HOG, str(limit)]) for _ in range(n)]


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def _counts(output: str) -> dict:
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tail)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", default=DEFAULT_MODULES)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="spinning processes (default: one per core)")
    p.add_argument("--hog-limit", type=float, default=3600.0, help="each hog ends itself after this many seconds")
    p.add_argument("--log-dir", default=os.path.join(REPO, "benchmarks", "results", "under_load"))
    ns = p.parse_args(argv)
    os.makedirs(ns.log_dir, exist_ok=True)
    env = dict(os.environ, SGLANG_HS_STRICT_SKIPS="1")
    failures = 0
    for run in range(1, ns.runs + 1):
        hogs = _hogs(ns.hogs, ns.hog_limit)
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra", *ns.modules],
                                  cwd=REPO, env=env, capture_output=True, text=True)
        finally:
            _stop(hogs)
        wall = time.monotonic() - t0
        log = os.path.join(ns.log_dir, f"run-{run}.log")
        with open(log, "w") as f:
            f.write(proc.stdout + proc.stderr)
        c = _counts(proc.stdout)
        bad = c.get("failed", 0) + c.get("error", 0) + c.get("errors", 0)
        failures += bad > 0 or proc.returncode != 0
        print(f"run {run}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, "
              f"{c.get('error', 0) + c.get('errors', 0)} errors, exit {proc.returncode}, {wall:.0f}s with "
              f"{ns.hogs} hog(s) (log {log})", flush=True)
    print(f"{ns.runs} runs x {failures} failed runs ({len(ns.modules)} modules, every core busy)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
