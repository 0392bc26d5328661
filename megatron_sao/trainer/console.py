"""A compact live console: a rich progress bar whose description carries the step's key figures."""

from __future__ import annotations

import sys


class Console:
    def __init__(self, mode: str, total: int, title: str = "sao train"):
        self.mode, self.total, self.title = mode, total, title
        self._progress = self._task = None
        if mode == "rich":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("[bold]{task.fields[title]}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("", total=total, title=title)

    @staticmethod
    def summary(m: dict) -> str:
        parts = [f"step {m.get('step', 0) + 1}", f"v{m.get('version', 0)}"]
        for key, label, fmt in (("loss", "loss", ".4f"), ("reward", "reward", ".3f"), ("eval/accuracy", "eval", ".3f"),
                                ("critic/loss", "v-loss", ".4f"), ("critic/explained_variance", "EV", ".2f"),
                                ("actor/kept_fraction", "kept", ".3f"), ("tokens_per_s", "tok/s", ".0f"),
                                ("trainer_idle_fraction", "idle", ".2f")):
            if key in m and isinstance(m[key], (int, float)):
                parts.append(f"{label} {m[key]:{fmt}}")
        return "  ".join(parts)

    def update(self, m: dict) -> None:
        if self.mode == "none":
            return
        text = self.summary(m)
        if self._progress is not None:
            self._progress.update(self._task, completed=m.get("step", 0) + 1, description=text)
        else:
            print(f"[{self.title}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
