"""Markdown tables and matplotlib figures for the experiment reports (files, never the screen)."""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
import matplotlib.pyplot as plt

from benchmarks.reproduce.runner import ROOT
from benchmarks.reproduce.summary import mean_curve


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def header(title: str, command: str, seeds: list[int], wall_s: float, extra: str = "") -> str:
    return (f"# {title}\n\n"
            f"- command: `{command}`\n"
            f"- seeds: {seeds}; commit {git_commit()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n"
            f"- machine: {platform.machine()}, {__import__('os').cpu_count()} CPU cores, "
            f"Python {platform.python_version()}\n"
            f"- wall time of this invocation: {wall_s / 60:.1f} min "
            f"(runs reused from an earlier invocation's cache add nothing)\n"
            + (f"{extra}\n" if extra else "") + "\n")


def band_plot(ax, groups: dict[str, tuple[list[list[float]], list[list[float]]]], xlabel: str, ylabel: str,
              title: str = "", hline: float | None = None, hline_label: str = "") -> None:
    """One line per group: the mean over seeds, shaded between the seeds' min and max."""
    for label, (xs, ys) in groups.items():
        x, mean, lo, hi = mean_curve(xs, ys)
        if not x:
            continue
        (line,) = ax.plot(x, mean, marker=".", label=f"{label} (n={len(ys)})")
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    if hline is not None and not math.isnan(hline):
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1, label=hline_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def save_fig(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_report(out: Path, markdown: str, data: dict) -> None:
    """results.md and summary.json (every number of the tables, per seed), each written atomically."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("results.md", markdown), ("summary.json", json.dumps(data, indent=1, default=str))):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def runs_section(results, common: tuple[str, ...]) -> str:
    """The exact `sao train` overrides of each label (beyond what every run of the start shares), so
    any row can be re-run by hand: `sao train <config> <common> <these> run.seed=<seed>`."""
    seen: dict[str, object] = {}
    for r in results:
        seen.setdefault(r.run.label, r.run)
    # What the commands got: a checkpointing run's `run.save_every` replaces the one `common` has.
    common = tuple(o for o in common if all(o in run.command_overrides() for run in seen.values()))
    def rel(text: str) -> str:  # paths relative to the checkout, so the report reads the same anywhere
        return text.replace(str(ROOT) + "/", "")

    lines = ["\n<details><summary>Exact configuration of every row</summary>\n",
             (f"Config `{next(iter(seen.values())).config}` with, "
              f"for every run: `{rel(' '.join(common))}`\n") if seen else ""]
    for label, run in seen.items():
        own = [o for o in run.command_overrides() if o not in common]
        lines.append(f"- **{label}**: `{rel(' '.join(own))}`")
    lines.append("\nPer-run directories (metrics.jsonl, config.yaml snapshot, eval/) are listed in summary.json.\n"
                 "</details>\n")
    return "\n".join(lines)
