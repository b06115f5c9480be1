"""Shared by the benchmarks: the machine's name, CSV output, the summary block, plots (when matplotlib
is there), and the end of a run that started servers."""
from __future__ import annotations

import csv
import os
import platform
import shutil
import statistics
import sys
from typing import Callable, Dict, List, Optional, Tuple


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores {cpu}, {mem:.0f} GiB"


def write_csv(path: str, rows: List[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, path)


def ratio_spread(num: Dict[int, dict], den: Dict[int, dict], key: str, reps: List[int],
                 digits: int = 3) -> Tuple[float, float, float]:
    """Two ways measured in the same repetitions (rep -> row, each): the ratio num/den of `key` in each of `reps`,
    as its median, min and max, rounded to `digits`."""
    ratios = [num[r][key] / den[r][key] for r in reps]
    return round(statistics.median(ratios), digits), round(min(ratios), digits), round(max(ratios), digits)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib missing: no plot (make bench installs it)")
        return None


def plot_bars(path: str, values: Dict[str, float], ylabel: str, title: str) -> None:
    plt = _pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(list(values), list(values.values()), color=["#888", "#2a7"][: len(values)] + ["#27a"] * 8)
    for i, v in enumerate(values.values()):
        ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    save_figure(plt, fig, path)


def save_figure(plt, fig, path: str, title: Optional[str] = None, dpi: int = 120) -> None:
    """Every plot's tail: the figure's title (if any), laid out, written to `path`, closed."""
    if title is not None:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def write_summary(out_dir: str, name: str, summary: List[dict], header: str, line: Callable[[dict], str]) -> None:
    """Every benchmark's summary block: its rows to `<name>_summary.csv` in `out_dir`, then on stdout
    `header` and `line(row)` for each row."""
    write_csv(os.path.join(out_dir, f"{name}_summary.csv"), summary)
    print(header)
    for s in summary:
        print(line(s))


def stop_servers(servers: Dict[str, object], work: str, logs: str, ok: bool) -> None:
    """The end of a benchmark that started servers (name -> ServerProcess), whatever happened: each server
    stopped, its `work` folder (dump dirs) removed, and its `logs` folder removed after a run that completed
    (`ok`), else named on stderr."""
    for s in servers.values():
        s.stop()
    shutil.rmtree(work, ignore_errors=True)
    if ok:
        shutil.rmtree(logs, ignore_errors=True)
    else:
        print(f"server logs kept in {logs}", file=sys.stderr)
